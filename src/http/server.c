/*
 * server: the listener and lifecycle of the HTTP front: routing table, body limit, signals,
 * start (http_serve) and stop (http_server_stop, SIGINT/SIGTERM: stop accepting, cancel live
 * generations, end /kv_events streams, wait up to 10 s for terminal events).
 * The other parts: reply.c, gen.c, handlers.c, kv_stream.c (see server_internal.h).
 */
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>
#include <event2/thread.h>

#include "server_internal.h"

struct server http_srv = {.mu = PTHREAD_MUTEX_INITIALIZER};

static struct event *g_stop_ev; /* set while serving; event_active'd by http_server_stop */
static pthread_mutex_t g_stop_mu = PTHREAD_MUTEX_INITIALIZER;

enum route_id { R_COMPLETIONS, R_CHAT, R_MODELS, R_HEALTH, R_TOKENIZE, R_DETOKENIZE, R_METRICS,
                R_KV_EVENTS, R_SERVER_INFO };
static const struct {
    const char *path;
    enum evhttp_cmd_type method;
    enum route_id id;
} routes[] = {
    {"/v1/completions", EVHTTP_REQ_POST, R_COMPLETIONS},
    {"/v1/chat/completions", EVHTTP_REQ_POST, R_CHAT},
    {"/v1/models", EVHTTP_REQ_GET, R_MODELS},
    {"/health", EVHTTP_REQ_GET, R_HEALTH},
    {"/tokenize", EVHTTP_REQ_POST, R_TOKENIZE},
    {"/detokenize", EVHTTP_REQ_POST, R_DETOKENIZE},
    {"/metrics", EVHTTP_REQ_GET, R_METRICS},
    {"/kv_events", EVHTTP_REQ_GET, R_KV_EVENTS},
    {"/server_info", EVHTTP_REQ_GET, R_SERVER_INFO},
};

/* Body limit answered with OpenAI error JSON. libevent 2.1 answers bodies over its own cap
 * with an HTML 413 and offers no hook to change that body, so its cap is set higher
 * (body_hard_cap) and bodies between the two limits get the JSON 413 here. */
static size_t body_limit;
#define HTTP_MAX_HEADERS_BYTES (1 << 20) /* request line + headers */

static size_t body_hard_cap(size_t limit) {
    size_t cap = limit * 4;
    return cap < ((size_t)64 << 20) ? ((size_t)64 << 20) : cap;
}

static void on_request(struct evhttp_request *req, void *arg) {
    (void)arg;
    srv.ctr.http_requests_total++;
    size_t body_len = evbuffer_get_length(evhttp_request_get_input_buffer(req));
    if (body_len > body_limit) {
        char msg[160];
        snprintf(msg, sizeof msg, "request body of %zu bytes exceeds the limit of %zu bytes",
                 body_len, body_limit);
        http_send_errf(req, 413, "invalid_request_error", NULL, "request_too_large", msg);
        return;
    }
    const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(req);
    const char *path = u ? evhttp_uri_get_path(u) : NULL;
    if (!path || !*path) path = "/";
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    KV_DEBUG("http: %s %s", http_method_name(cmd), path);
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(path, routes[i].path) != 0) continue;
        if (cmd != routes[i].method) {
            char msg[160];
            snprintf(msg, sizeof msg, "method %s is not allowed on %s (use %s)", http_method_name(cmd),
                     path, http_method_name(routes[i].method));
            evhttp_add_header(evhttp_request_get_output_headers(req), "Allow",
                              http_method_name(routes[i].method));
            http_send_errf(req, 405, "invalid_request_error", NULL, "method_not_allowed", msg);
            return;
        }
        switch (routes[i].id) {
        case R_COMPLETIONS: handle_generate(req, OAI_COMPLETION); return;
        case R_CHAT: handle_generate(req, OAI_CHAT); return;
        case R_MODELS: handle_models(req); return;
        case R_HEALTH: http_send_json_str(req, 200, "{\"status\":\"ok\"}"); return;
        case R_TOKENIZE: handle_tokenize(req); return;
        case R_DETOKENIZE: handle_detokenize(req); return;
        case R_METRICS: handle_metrics(req); return;
        case R_KV_EVENTS: handle_kv_events(req); return;
        case R_SERVER_INFO: handle_server_info(req); return;
        }
    }
    char msg[300];
    snprintf(msg, sizeof msg, "no route for %s %.200s", http_method_name(cmd), path);
    http_send_errf(req, 404, "not_found_error", NULL, NULL, msg);
}

/* ------------------------------------------------------------------ start / stop */

static struct evhttp_bound_socket *g_bound;
static struct event *g_grace_timer;
static struct event *g_accept_timer; /* re-enables the listener after an accept() failure */
static uint64_t g_accept_errors, g_accept_logged_ns;

/* accept() failed for a reason libevent does not retry by itself (EMFILE / ENFILE / ENOBUFS:
 * out of descriptors or memory). libevent's default is to log a warning and retry at once,
 * a busy loop that burns a core and writes ~400k log lines a second while the condition lasts.
 * Pause accepting for 100 ms instead, and log at most every 10 s. */
static void on_accept_resume(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    if (g_bound && !srv.stopping) evconnlistener_enable(evhttp_bound_socket_get_listener(g_bound));
}

static void on_accept_error(struct evconnlistener *l, void *arg) {
    (void)arg;
    int err = EVUTIL_SOCKET_ERROR();
    g_accept_errors++;
    uint64_t now = kv_now_ns();
    if (g_accept_logged_ns == 0 || now - g_accept_logged_ns > 10000000000ull) {
        KV_WARN("http: accept() failed: %s (%llu time(s)); pausing new connections for 100 ms",
                evutil_socket_error_to_string(err), (unsigned long long)g_accept_errors);
        g_accept_logged_ns = now;
    }
    struct timeval tv = {0, 100000};
    if (g_accept_timer && evconnlistener_disable(l) == 0) evtimer_add(g_accept_timer, &tv);
}

static void on_grace(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    if (srv.n_live > 0)
        KV_WARN("http: %d request(s) did not finish within the shutdown grace period", srv.n_live);
    event_base_loopbreak(srv.base);
}

static void begin_stop(void) {
    if (srv.stopping) return;
    srv.stopping = true;
    KV_INFO("http: stopping (%d live request(s) cancelled)", srv.n_live);
    if (g_accept_timer) evtimer_del(g_accept_timer);
    if (g_bound) {
        evhttp_del_accept_socket(srv.http, g_bound);
        g_bound = NULL;
    }
    gen_cancel_all();
    bool had_streams = srv.n_subs > 0;
    kvstream_close_all(); /* final chunks queued */
    if (srv.n_live == 0 && !had_streams) {
        event_base_loopbreak(srv.base);
        return;
    }
    /* live generations: up to 10 s for their terminal events (gen_free breaks the loop when
     * the last one ends); only /kv_events streams: 100 ms to flush their last chunk */
    struct timeval tv = {srv.n_live > 0 ? 10 : 0, srv.n_live > 0 ? 0 : 100000};
    g_grace_timer = evtimer_new(srv.base, on_grace, NULL);
    if (g_grace_timer) evtimer_add(g_grace_timer, &tv);
    else event_base_loopbreak(srv.base);
}

static bool g_signalled; /* a SIGINT/SIGTERM started the stop */

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    (void)what;
    (void)arg;
    g_signalled = true;
    KV_INFO("http: received signal %d", (int)sig);
    begin_stop();
}

static void on_stop_ev(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    begin_stop();
}

void http_server_stop(void) {
    pthread_mutex_lock(&g_stop_mu);
    if (g_stop_ev) event_active(g_stop_ev, EV_READ, 0);
    pthread_mutex_unlock(&g_stop_mu);
}

static kv_status write_port_file(const char *path, int port, char *err, size_t errlen) {
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

kv_status http_serve(const struct http_config *cfg, engine_t *e, const model_t *m,
                     const tokenizer_t *t, char *err, size_t errlen) {
    kv_status st = KV_OK;
    signal(SIGPIPE, SIG_IGN);
    if (evthread_use_pthreads() != 0) return kv_errf(KV_EINTERNAL, err, errlen, "evthread_use_pthreads failed");
    pthread_mutex_lock(&srv.mu);
    srv.qhead = srv.qtail = NULL;
    srv.closed = false;
    pthread_mutex_unlock(&srv.mu);
    srv.cfg = cfg;
    srv.e = e;
    srv.m = m;
    srv.t = t;
    srv.model_name = cfg->served_model_name && *cfg->served_model_name ? cfg->served_model_name
                                                                       : m->cfg.name;
    srv.lim.served_name = srv.model_name;
    srv.lim.n_vocab = tok_n_vocab(t);
    srv.lim.max_model_len = engine_config(e)->max_model_len;
    srv.live = NULL;
    srv.n_live = 0;
    srv.subs = NULL;
    srv.n_subs = 0;
    srv.stopping = false;
    g_signalled = false;
    memset(&srv.ctr, 0, sizeof srv.ctr);
    kv_rng_seed(&srv.rng, kv_now_ns() ^ ((uint64_t)getpid() << 32));
    const char *host = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";

    srv.base = event_base_new();
    srv.http = srv.base ? evhttp_new(srv.base) : NULL;
    srv.wake = srv.base ? event_new(srv.base, -1, 0, gen_on_wake, NULL) : NULL;
    struct event *stop_ev = srv.base ? event_new(srv.base, -1, 0, on_stop_ev, NULL) : NULL;
    struct event *sigint = srv.base ? evsignal_new(srv.base, SIGINT, on_signal, NULL) : NULL;
    struct event *sigterm = srv.base ? evsignal_new(srv.base, SIGTERM, on_signal, NULL) : NULL;
    if (!srv.http || !srv.wake || !stop_ev || !sigint || !sigterm) {
        st = kv_errf(KV_ENOMEM, err, errlen, "cannot create the event loop");
        goto done;
    }
    evsignal_add(sigint, NULL);
    evsignal_add(sigterm, NULL);
    body_limit = cfg->max_body_bytes ? cfg->max_body_bytes : (size_t)16 << 20;
    evhttp_set_max_body_size(srv.http, (ev_ssize_t)body_hard_cap(body_limit));
    /* libevent's default is no limit: a client could make us buffer gigabytes of headers */
    evhttp_set_max_headers_size(srv.http, HTTP_MAX_HEADERS_BYTES);
    evhttp_set_flags(srv.http, EVHTTP_SERVER_LINGERING_CLOSE);
    evhttp_set_timeout(srv.http, 3600); /* a stream may wait long in the queue */
    evhttp_set_allowed_methods(srv.http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                             EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                             EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(srv.http, on_request, NULL);
    int port = cfg->port < 0 ? 8000 : cfg->port;
    g_bound = evhttp_bind_socket_with_handle(srv.http, host, (ev_uint16_t)port);
    if (!g_bound) { /* errno is 0 when the address did not resolve */
        st = kv_errf(KV_EIO, err, errlen, "cannot listen on %s:%d: %s", host, port,
                     errno ? strerror(errno) : "cannot resolve the address");
        goto done;
    }
    g_accept_timer = evtimer_new(srv.base, on_accept_resume, NULL);
    g_accept_errors = g_accept_logged_ns = 0;
    evconnlistener_set_error_cb(evhttp_bound_socket_get_listener(g_bound), on_accept_error);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(evhttp_bound_socket_get_fd(g_bound), (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6) port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    const char *wid = getenv("KVSERVE_WORKER_ID");
    if (wid && *wid) snprintf(srv.worker_id, sizeof srv.worker_id, "%s", wid);
    else snprintf(srv.worker_id, sizeof srv.worker_id, "%s:%d", host, port);
    if (cfg->port_file && *cfg->port_file && (st = write_port_file(cfg->port_file, port, err, errlen)))
        goto done;
    KV_INFO("http: listening on http://%s:%d (model '%s', max_model_len %d)", host, port,
            srv.model_name, srv.lim.max_model_len);
    pthread_mutex_lock(&g_stop_mu);
    g_stop_ev = stop_ev;
    pthread_mutex_unlock(&g_stop_mu);
    event_base_dispatch(srv.base);
    pthread_mutex_lock(&g_stop_mu);
    g_stop_ev = NULL;
    pthread_mutex_unlock(&g_stop_mu);
    KV_INFO("http: stopped");
done:
    gen_shutdown();
    kvstream_close_all();
    if (srv.http) evhttp_free(srv.http);
    srv.http = NULL;
    g_bound = NULL;
    if (g_grace_timer) event_free(g_grace_timer);
    g_grace_timer = NULL;
    if (g_accept_timer) event_free(g_accept_timer);
    g_accept_timer = NULL;
    if (sigint) event_free(sigint);
    if (sigterm) event_free(sigterm);
    /* Freeing the signal events restored the default action (terminate). Once a signal has
     * asked us to stop, a repeated SIGINT/SIGTERM (process managers, `timeout` and shells
     * send several) must not kill the process mid-teardown with a signal status. */
    if (g_signalled) {
        signal(SIGINT, SIG_IGN);
        signal(SIGTERM, SIG_IGN);
    }
    if (stop_ev) event_free(stop_ev);
    if (srv.wake) event_free(srv.wake);
    srv.wake = NULL;
    if (srv.base) event_base_free(srv.base);
    srv.base = NULL;
    return st;
}

