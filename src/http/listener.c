/* listener: an instance-based evhttp listener (bind, limits, accept backoff, signals, stop)
 * shared by the worker's server.c and the router; see listener.h. */
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>

#include "conn_gate.h"
#include "listener.h"

#define HTTP_MAX_HEADERS_BYTES (1 << 20) /* request line + headers */

struct http_listener {
    struct http_listener_config cfg;
    char name[32];
    char host[256];
    struct event_base *base;
    struct evhttp *http;
    struct http_gates *gates;   /* per-connection framing and limits (conn_gate.h) */
    struct evhttp_bound_socket *bound;
    struct event *accept_timer; /* re-enables the listener after an accept() failure */
    struct event *stop_ev;      /* event_active'd by http_listener_stop */
    struct event *sigint, *sigterm;
    pthread_mutex_t mu;         /* guards stop_ev against free during http_listener_stop */
    size_t body_limit;
    uint64_t accept_errors, accept_logged_ns;
    int port;
    bool stopping, signalled;
};

/* The error callback of an evconnlistener gets evhttp's callback argument, not ours, so the
 * live listeners are kept in a list to map one back (loop threads; under g_reg_mu). */
static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static struct http_listener *g_reg[64];
static int g_nreg;

static void registry_add(struct http_listener *l) {
    pthread_mutex_lock(&g_reg_mu);
    if (g_nreg < (int)(sizeof g_reg / sizeof g_reg[0])) g_reg[g_nreg++] = l;
    pthread_mutex_unlock(&g_reg_mu);
}

static void registry_remove(struct http_listener *l) {
    pthread_mutex_lock(&g_reg_mu);
    for (int i = 0; i < g_nreg; i++)
        if (g_reg[i] == l) {
            g_reg[i] = g_reg[--g_nreg];
            break;
        }
    pthread_mutex_unlock(&g_reg_mu);
}

static struct http_listener *registry_find(struct evconnlistener *el) {
    struct http_listener *found = NULL;
    pthread_mutex_lock(&g_reg_mu);
    for (int i = 0; i < g_nreg && !found; i++)
        if (g_reg[i]->bound && evhttp_bound_socket_get_listener(g_reg[i]->bound) == el)
            found = g_reg[i];
    pthread_mutex_unlock(&g_reg_mu);
    return found;
}

/* Body limit answered with OpenAI error JSON. libevent 2.1 answers bodies over its own cap
 * with an HTML 413 and offers no hook to change that body, so its cap is set higher
 * (body_hard_cap) and bodies between the two limits get the JSON 413 here. */
static size_t body_hard_cap(size_t limit) {
    size_t cap = limit * 4;
    return cap < ((size_t)64 << 20) ? ((size_t)64 << 20) : cap;
}

static void on_request(struct evhttp_request *req, void *arg) {
    struct http_listener *l = arg;
    if (l->cfg.reply && l->cfg.reply->ctr) l->cfg.reply->ctr->http_requests_total++;
    size_t body_len = evbuffer_get_length(evhttp_request_get_input_buffer(req));
    if (body_len > l->body_limit) {
        char msg[160];
        snprintf(msg, sizeof msg, "request body of %zu bytes exceeds the limit of %zu bytes",
                 body_len, l->body_limit);
        http_reply_errf(l->cfg.reply, req, 413, "invalid_request_error", NULL, "request_too_large",
                        msg);
        return;
    }
    l->cfg.on_request(req, l->cfg.arg);
}

/* accept() failed for a reason libevent does not retry by itself (EMFILE / ENFILE / ENOBUFS:
 * out of descriptors or memory). libevent's default is to log a warning and retry at once,
 * a busy loop that burns a core and writes ~400k log lines a second while the condition lasts.
 * Pause accepting for 100 ms instead, and log at most every 10 s. */
static void on_accept_resume(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct http_listener *l = arg;
    if (l->bound) evconnlistener_enable(evhttp_bound_socket_get_listener(l->bound)); /* (NULL once unbound) */
}

static void on_accept_error(struct evconnlistener *el, void *arg) {
    (void)arg; /* evhttp's own pointer: find our instance by its evconnlistener */
    struct http_listener *l = registry_find(el);
    if (!l) return;
    int err = EVUTIL_SOCKET_ERROR();
    l->accept_errors++;
    uint64_t now = kv_now_ns();
    if (l->accept_logged_ns == 0 || now - l->accept_logged_ns > 10000000000ull) {
        KV_WARN("%s: accept() failed: %s (%llu time(s)); pausing new connections for 100 ms",
                l->name, evutil_socket_error_to_string(err), (unsigned long long)l->accept_errors);
        l->accept_logged_ns = now;
    }
    struct timeval tv = {0, 100000};
    if (l->accept_timer && evconnlistener_disable(el) == 0) evtimer_add(l->accept_timer, &tv);
}

void http_listener_unbind(struct http_listener *l) {
    if (!l) return;
    if (l->accept_timer) evtimer_del(l->accept_timer);
    if (l->bound) {
        evhttp_del_accept_socket(l->http, l->bound);
        l->bound = NULL;
    }
}

static void begin_stop(struct http_listener *l) {
    if (l->stopping) return;
    l->stopping = true;
    if (!l->cfg.keep_accepting) http_listener_unbind(l);
    if (l->cfg.on_stop) l->cfg.on_stop(l->cfg.arg);
    else event_base_loopbreak(l->base);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    (void)what;
    struct http_listener *l = arg;
    KV_INFO("%s: received signal %d", l->name, (int)sig);
    if (l->stopping && l->signalled && l->cfg.on_signal_again) {
        l->cfg.on_signal_again(l->cfg.arg, (int)sig);
        return;
    }
    l->signalled = true;
    begin_stop(l);
}

/* The SIGINT/SIGTERM disposition under libevent's: libevent saves the disposition it finds
 * when a signal event is added and restores it when the event is freed. Had it found the
 * default action (terminate), a signal repeated while the server tears down (process managers,
 * `timeout` and shells send several) could land between that restore and anything we set
 * after it, and kill the process with a signal status instead of exit 0 (seen: the e2e
 * "repeated SIGTERM" check, one exit of -15 in a loaded run). So http_listener_new installs
 * this handler first: it only records the signal. One arriving in the microseconds before
 * libevent's handler is in place is raised again right after (not lost); after the events are
 * freed a stopping server swallows repeats, and a listener freed without a signal puts the
 * default action back. */
static volatile sig_atomic_t g_early_sig;
static void early_sig(int sig) { g_early_sig = sig; }

static void on_stop_ev(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    begin_stop(arg);
}

kv_status http_write_port_file(const char *path, int port, char *err, size_t errlen) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return kv_errf(KV_EIO, err, errlen, "cannot write port file %s: %s", tmp, strerror(errno));
    fprintf(f, "%d\n", port);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        return kv_errf(KV_EIO, err, errlen, "cannot write port file %s: %s", path, strerror(errno));
    }
    return KV_OK;
}

kv_status http_listener_start(struct event_base *base, const struct http_listener_config *cfg,
                              struct http_listener **out, char *err, size_t errlen) {
    *out = NULL;
    if (!base || !cfg || !cfg->on_request)
        return kv_errf(KV_EINVAL, err, errlen, "http_listener_start: missing base or on_request");
    struct http_listener *l = calloc(1, sizeof *l);
    if (!l) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    kv_status st = KV_OK;
    pthread_mutex_init(&l->mu, NULL);
    l->cfg = *cfg;
    l->base = base;
    snprintf(l->name, sizeof l->name, "%s", cfg->name && *cfg->name ? cfg->name : "http");
    snprintf(l->host, sizeof l->host, "%s", cfg->host && *cfg->host ? cfg->host : "127.0.0.1");
    l->body_limit = cfg->max_body_bytes ? cfg->max_body_bytes : (size_t)16 << 20;
    l->http = evhttp_new(base);
    l->stop_ev = event_new(base, -1, 0, on_stop_ev, l);
    l->accept_timer = evtimer_new(base, on_accept_resume, l);
    if (cfg->handle_signals) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = early_sig;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        l->sigint = evsignal_new(base, SIGINT, on_signal, l);
        l->sigterm = evsignal_new(base, SIGTERM, on_signal, l);
    }
    if (!l->http || !l->stop_ev || !l->accept_timer ||
        (cfg->handle_signals && (!l->sigint || !l->sigterm))) {
        st = kv_errf(KV_ENOMEM, err, errlen, "cannot create the event loop");
        goto fail;
    }
    if (l->sigint) evsignal_add(l->sigint, NULL);
    if (l->sigterm) evsignal_add(l->sigterm, NULL);
    if (cfg->handle_signals && g_early_sig) { /* caught by early_sig before the events were added */
        int sig = g_early_sig;
        g_early_sig = 0;
        raise(sig);
    }
    /* The gates enforce the limits and answer with JSON; libevent's own (HTML) limits are
     * set above them and are never reached by a request that passed a gate. */
    struct http_gate_limits gl = {.max_head_bytes = HTTP_MAX_HEADERS_BYTES,
                                  .max_body_bytes = l->body_limit,
                                  .max_buffered_bytes = cfg->conn.max_buffered_bytes,
                                  .max_connections = cfg->conn.max_connections,
                                  .header_timeout_ms = cfg->conn.header_timeout_ms,
                                  .keepalive_timeout_ms = cfg->conn.keepalive_timeout_ms};
    l->gates = http_gates_new(base, l->http, &gl, cfg->reply, l->name);
    if (!l->gates) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto fail;
    }
    evhttp_set_max_body_size(l->http, (ev_ssize_t)body_hard_cap(l->body_limit));
    evhttp_set_max_headers_size(l->http, HTTP_MAX_HEADERS_BYTES + (64 << 10));
    evhttp_set_flags(l->http, EVHTTP_SERVER_LINGERING_CLOSE);
    evhttp_set_timeout(l->http, cfg->timeout_s > 0 ? cfg->timeout_s : 3600);
    evhttp_set_allowed_methods(l->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(l->http, on_request, l);
    int port = cfg->port < 0 ? 8000 : cfg->port;
    errno = 0;
    l->bound = evhttp_bind_socket_with_handle(l->http, l->host, (ev_uint16_t)port);
    if (!l->bound) { /* errno is 0 when the address did not resolve */
        st = kv_errf(KV_EIO, err, errlen, "cannot listen on %s:%d: %s", l->host, port,
                     errno ? strerror(errno) : "cannot resolve the address");
        goto fail;
    }
    evconnlistener_set_error_cb(evhttp_bound_socket_get_listener(l->bound), on_accept_error);
    registry_add(l);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(evhttp_bound_socket_get_fd(l->bound), (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6) port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    l->port = port;
    if (cfg->port_file && *cfg->port_file &&
        (st = http_write_port_file(cfg->port_file, port, err, errlen)))
        goto fail;
    *out = l;
    return KV_OK;
fail:
    http_listener_free(l);
    return st;
}

void http_listener_gate_stats(const struct http_listener *l, struct http_gate_stats *out) {
    http_gates_stats(l ? l->gates : NULL, out);
}

int http_listener_port(const struct http_listener *l) { return l ? l->port : -1; }
const char *http_listener_host(const struct http_listener *l) { return l ? l->host : ""; }
struct evhttp *http_listener_evhttp(struct http_listener *l) { return l ? l->http : NULL; }
bool http_listener_stopping(const struct http_listener *l) { return l && l->stopping; }
bool http_listener_signalled(const struct http_listener *l) { return l && l->signalled; }

void http_listener_stop(struct http_listener *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    if (l->stop_ev) event_active(l->stop_ev, EV_READ, 0);
    pthread_mutex_unlock(&l->mu);
}

void http_listener_free(struct http_listener *l) {
    if (!l) return;
    registry_remove(l);
    if (l->http) evhttp_free(l->http);
    http_gates_release(l->gates); /* connections freed later by libevent still find it */
    if (l->accept_timer) event_free(l->accept_timer);
    bool handled = l->sigint || l->sigterm;
    if (l->sigint) event_free(l->sigint);
    if (l->sigterm) event_free(l->sigterm);
    /* Freeing the signal events restored early_sig (above): once a signal has asked us to
     * stop, repeats are swallowed until the process exits; without one, the default action
     * comes back. */
    if (handled && !l->signalled) {
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
    }
    pthread_mutex_lock(&l->mu);
    if (l->stop_ev) event_free(l->stop_ev);
    l->stop_ev = NULL;
    pthread_mutex_unlock(&l->mu);
    pthread_mutex_destroy(&l->mu);
    free(l);
}
