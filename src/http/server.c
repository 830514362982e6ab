/*
 * server: the lifecycle of the worker's HTTP front: routing table, start (http_serve) and stop
 * (http_server_stop, SIGINT/SIGTERM). Binding, limits, accept backoff and signals are the
 * shared http_listener's (listener.c); API keys and CORS are access.c's.
 *
 * Drain (a stop):  SERVING --SIGTERM--> DRAINING: new generations, /tokenize... answer 503
 *   (Retry-After), /ready answers 503, /health stays 200 (liveness), the socket still accepts;
 *   in-flight requests run on --> no live generation left: DRAINED (kv_events streams end,
 *   socket closed, loop ends 100 ms later) | --shutdown-timeout passed (or a second SIGINT):
 *   the rest are answered 503 (streams: error event + [DONE]) and cancelled, then DRAINED once
 *   their engine terminal events came back (at most 10 s more).
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

struct server http_srv = {.reply = {.ctr = &http_srv.ctr, .id_header = "X-Kvserve-Worker",
                                    .id_value = http_srv.worker_id}};

enum route_id { R_COMPLETIONS, R_CHAT, R_MODELS, R_HEALTH, R_READY, R_TOKENIZE, R_DETOKENIZE,
                R_METRICS, R_KV_EVENTS, R_SERVER_INFO, R_KV_PROBE, R_KV_RELEASE };
static const struct {
    const char *path;
    enum evhttp_cmd_type method;
    enum route_id id;
} routes[] = {
    {"/v1/completions", EVHTTP_REQ_POST, R_COMPLETIONS},
    {"/v1/chat/completions", EVHTTP_REQ_POST, R_CHAT},
    {"/v1/models", EVHTTP_REQ_GET, R_MODELS},
    /* without the /v1 prefix too, as llama.cpp's server (clients given the bare host URL) */
    {"/completions", EVHTTP_REQ_POST, R_COMPLETIONS},
    {"/chat/completions", EVHTTP_REQ_POST, R_CHAT},
    {"/models", EVHTTP_REQ_GET, R_MODELS},
    {"/health", EVHTTP_REQ_GET, R_HEALTH},
    {"/ready", EVHTTP_REQ_GET, R_READY},
    {"/tokenize", EVHTTP_REQ_POST, R_TOKENIZE},
    {"/detokenize", EVHTTP_REQ_POST, R_DETOKENIZE},
    {"/metrics", EVHTTP_REQ_GET, R_METRICS},
    {"/kv_events", EVHTTP_REQ_GET, R_KV_EVENTS},
    {"/server_info", EVHTTP_REQ_GET, R_SERVER_INFO},
    {"/kv_probe", EVHTTP_REQ_POST, R_KV_PROBE},
    {"/kv_release", EVHTTP_REQ_POST, R_KV_RELEASE},
};

/* GET /health: 200 {"status":"ok"}, or 503 with an error JSON once the backend can no longer
 * compute (engine_healthy: a sticky CUDA error), so that routers and load balancers take the
 * worker out instead of sending it requests that can only fail. */
static void handle_health(struct evhttp_request *req) {
    char why[256] = "";
    if (engine_healthy(srv.e, why, sizeof why)) { /* liveness: also 200 while draining */
        http_send_json_str(req, 200, srv.stopping ? "{\"status\":\"draining\"}" : "{\"status\":\"ok\"}");
        return;
    }
    char msg[400];
    snprintf(msg, sizeof msg, "the compute backend is unusable: %s; restart the server", why);
    http_send_errf(req, 503, "server_error", NULL, "backend_unhealthy", msg);
}

/* Readiness: takes new requests (not draining, backend healthy). */
static void handle_ready(struct evhttp_request *req) {
    char why[256] = "";
    if (srv.stopping)
        http_send_errf(req, 503, "server_error", NULL, "shutting_down",
                       "the server is shutting down and takes no new requests");
    else if (!engine_healthy(srv.e, why, sizeof why))
        http_send_errf(req, 503, "server_error", NULL, "backend_unhealthy", why);
    else
        http_send_json_str(req, 200, "{\"status\":\"ready\"}");
}

static void on_request(struct evhttp_request *req, void *arg) {
    (void)arg; /* counted and size-checked by the listener */
    const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(req);
    const char *path = u ? evhttp_uri_get_path(u) : NULL;
    if (!path || !*path) path = "/";
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    KV_DEBUG("http: %s %s", http_method_name(cmd), path);
    if (access_check(req, path)) return;
    if ((!strncmp(path, "/v1/models/", 11) && path[11]) || (!strncmp(path, "/models/", 8) && path[8])) {
        if (cmd != EVHTTP_REQ_GET) {
            evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "GET");
            http_send_errf(req, 405, "invalid_request_error", NULL, "method_not_allowed",
                           "only GET is allowed on /v1/models/{model}");
            return;
        }
        handle_model(req, path + (path[1] == 'v' ? 11 : 8)); /* after "/v1/models/" or "/models/" */
        return;
    }
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
        case R_HEALTH: handle_health(req); return;
        case R_READY: handle_ready(req); return;
        case R_TOKENIZE: handle_tokenize(req); return;
        case R_DETOKENIZE: handle_detokenize(req); return;
        case R_METRICS: handle_metrics(req); return;
        case R_KV_EVENTS: handle_kv_events(req); return;
        case R_SERVER_INFO: handle_server_info(req); return;
        case R_KV_PROBE: handle_kv_probe(req); return;
        case R_KV_RELEASE: handle_kv_release(req); return;
        }
    }
    char msg[300];
    snprintf(msg, sizeof msg, "no route for %s %.200s", http_method_name(cmd), path);
    http_send_errf(req, 404, "not_found_error", NULL, NULL, msg);
}

/* ------------------------------------------------------------------ start / stop */

static struct event *g_drain_timer; /* --shutdown-timeout */
static struct event *g_grace_timer; /* 10 s for the terminal events of failed requests */
static bool g_failing, g_drained;

static void on_grace(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    if (srv.n_live > 0)
        KV_WARN("http: %d request(s) did not end within 10 s of being failed", srv.n_live);
    event_base_loopbreak(srv.base);
}

bool server_drain_failing(void) { return g_failing || g_drained; }

static struct event *g_xfer_poll; /* while the drain waits for KV offers (TRANSFER_OUT) */

/* KV this worker still offers to a generation worker (a context leg answered already, its
 * blocks pinned until the peer pulled them): no HTTP request shows it, yet the client's
 * disaggregated request fails if the process exits before the pull. */
static int transfers_out(void) {
    struct engine_stats st;
    engine_get_stats(srv.e, &st);
    return st.n_transfer_out;
}

static void on_xfer_poll(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    server_maybe_drained();
}

void server_maybe_drained(void) {
    if (!srv.stopping || g_drained || srv.n_live > 0 || prep_pending() > 0) return;
    if (!g_failing && transfers_out() > 0) { /* look again shortly (the drain timer bounds it) */
        if (!g_xfer_poll) g_xfer_poll = evtimer_new(srv.base, on_xfer_poll, NULL);
        if (g_xfer_poll) {
            struct timeval tv = {0, 50000};
            evtimer_add(g_xfer_poll, &tv);
            return;
        }
    }
    server_drained();
}

void server_drained(void) {
    if (g_drained) return;
    g_drained = true;
    KV_INFO("http: drained; closing");
    kvstream_close_all(); /* final chunks queued */
    http_listener_unbind(srv.listener);
    /* let the last replies' final bytes (chunked terminators) reach the sockets first */
    event_base_loopexit(srv.base, &(struct timeval){0, 100000});
}

/* The drain time is over: fail what is still running (503), wait for the engine's terminal
 * events (at most 10 s), then stop. */
static void fail_remaining(void) {
    if (g_failing || g_drained) return;
    g_failing = true;
    if (srv.n_live > 0)
        KV_WARN("http: %d request(s) still running at the end of the drain: failing them with 503",
                srv.n_live);
    struct oai_error e;
    oai_errf(&e, 503, "server_error", NULL, "shutting_down",
             "the server is shutting down: the request did not finish within the shutdown timeout");
    gen_fail_all(&e);
    if (srv.n_live == 0 && prep_pending() == 0) {
        server_drained();
        return;
    }
    if (g_drain_timer) evtimer_del(g_drain_timer);
    g_grace_timer = evtimer_new(srv.base, on_grace, NULL);
    struct timeval tv = {10, 0};
    if (g_grace_timer) evtimer_add(g_grace_timer, &tv);
    else event_base_loopbreak(srv.base);
}

static void on_drain_timeout(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    fail_remaining();
}

/* The listener's on_stop (signal or http_server_stop): start draining. The listening socket
 * stays open (keep_accepting) so that new requests get a 503 instead of a refused connection. */
static void begin_stop(void *arg) {
    (void)arg;
    if (srv.stopping) return;
    srv.stopping = true;
    if (srv.cfg && srv.cfg->on_stopping) srv.cfg->on_stopping(srv.cfg->hook_arg);
    int t = srv.cfg ? srv.cfg->shutdown_timeout_s : 0;
    if (t == 0) t = HTTP_DEFAULT_SHUTDOWN_TIMEOUT_S;
    int nx = transfers_out();
    if (srv.n_live == 0 && prep_pending() == 0 && nx == 0) {
        server_drained();
        return;
    }
    KV_INFO("http: draining: %d request(s) in flight (+%d being prepared, %d KV offer(s) not "
            "pulled yet) get %d s to finish (--shutdown-timeout); new requests get 503",
            srv.n_live, prep_pending(), nx, t > 0 ? t : 0);
    if (t < 0) {
        fail_remaining();
        return;
    }
    g_drain_timer = evtimer_new(srv.base, on_drain_timeout, NULL);
    struct timeval tv = {t, 0};
    if (g_drain_timer) evtimer_add(g_drain_timer, &tv);
    else fail_remaining();
    server_maybe_drained(); /* only KV offers left: wait for their pulls */
}

/* A second SIGINT while draining (Ctrl-C twice): end the drain now. */
static void on_signal_again(void *arg, int sig) {
    (void)arg;
    if (sig != SIGINT || !srv.stopping) return;
    KV_INFO("http: second interrupt: ending the drain now");
    fail_remaining();
}

static pthread_mutex_t g_stop_mu = PTHREAD_MUTEX_INITIALIZER; /* guards g_stop_listener */
static struct http_listener *g_stop_listener; /* set while serving */

void http_server_stop(void) {
    pthread_mutex_lock(&g_stop_mu);
    if (g_stop_listener) http_listener_stop(g_stop_listener);
    pthread_mutex_unlock(&g_stop_mu);
}

kv_status http_serve(const struct http_config *cfg, engine_t *e, const model_t *m,
                     const tokenizer_t *t, char *err, size_t errlen) {
    kv_status st = KV_OK;
    signal(SIGPIPE, SIG_IGN);
    if (evthread_use_pthreads() != 0) return kv_errf(KV_EINTERNAL, err, errlen, "evthread_use_pthreads failed");
    wake_stack_init(&srv.qstack);
    atomic_store(&srv.closed, false);
    srv.cfg = cfg;
    srv.e = e;
    srv.m = m;
    srv.t = t;
    srv.model_name = cfg->served_model_name && *cfg->served_model_name ? cfg->served_model_name
                                                                       : m->cfg.name;
    srv.lim.served_name = srv.model_name;
    srv.lim.n_vocab = tok_n_vocab(t);
    srv.lim.max_model_len = engine_config(e)->max_model_len;
    srv.lim.tool_fmt = cfg && cfg->tool_call_parser ? gram_tool_fmt_from_name(cfg->tool_call_parser)
                                                    : gram_tool_fmt_detect(tok_chat_template(t));
    srv.live = NULL;
    srv.n_live = 0;
    srv.subs = NULL;
    srv.n_subs = 0;
    srv.stopping = false;
    g_failing = g_drained = false;
    srv.lim.aliases = cfg->model_aliases;
    srv.lim.n_aliases = cfg->n_model_aliases;
    srv.worker_id[0] = 0;
    memset(&srv.ctr, 0, sizeof srv.ctr);
    kv_rng_seed(&srv.rng, kv_now_ns() ^ ((uint64_t)getpid() << 32));
    const char *host = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";

    srv.base = event_base_new();
    srv.wake = srv.base ? loop_wake_new(srv.base, gen_on_wake, NULL) : NULL;
    if (!srv.base || !srv.wake) {
        st = kv_errf(KV_ENOMEM, err, errlen, "cannot create the event loop");
        goto done;
    }
    /* X-Kvserve-Worker before the listener starts: KVSERVE_WORKER_ID, else host:port (the
     * port is known only after binding; nothing is answered before it is set below) */
    const char *wid = getenv("KVSERVE_WORKER_ID");
    struct http_listener_config lc = {
        .name = "http", .host = host, .port = cfg->port, .port_file = NULL,
        .max_body_bytes = cfg->max_body_bytes, .timeout_s = 3600, /* a stream may wait long */
        .conn = cfg->conn,
        .handle_signals = true, .reply = &srv.reply, .on_request = on_request,
        .on_stop = begin_stop, .on_signal_again = on_signal_again, .keep_accepting = true,
        .arg = NULL};
    if ((st = http_listener_start(srv.base, &lc, &srv.listener, err, errlen))) goto done;
    int port = http_listener_port(srv.listener);
    if (wid && *wid) snprintf(srv.worker_id, sizeof srv.worker_id, "%s", wid);
    else snprintf(srv.worker_id, sizeof srv.worker_id, "%s:%d", host, port);
    if (cfg->on_listening && (st = cfg->on_listening(host, port, cfg->hook_arg, err, errlen))) goto done;
    if (cfg->port_file && *cfg->port_file &&
        (st = http_write_port_file(cfg->port_file, port, err, errlen)))
        goto done;
    srv.http = http_listener_evhttp(srv.listener);
    if (kvstream_init() != KV_OK || prep_init(cfg->prep_threads > 0 ? cfg->prep_threads : 2) != KV_OK) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto done;
    }
    KV_INFO("http: listening on http://%s:%d (model '%s', max_model_len %d)", host, port,
            srv.model_name, srv.lim.max_model_len);
    pthread_mutex_lock(&g_stop_mu);
    g_stop_listener = srv.listener;
    pthread_mutex_unlock(&g_stop_mu);
    event_base_dispatch(srv.base);
    pthread_mutex_lock(&g_stop_mu);
    g_stop_listener = NULL;
    pthread_mutex_unlock(&g_stop_mu);
    KV_INFO("http: stopped");
done:
    prep_shutdown();
    gen_shutdown();
    kvstream_close_all();
    http_listener_free(srv.listener); /* frees the evhttp and every connection */
    srv.listener = NULL;
    srv.http = NULL;
    if (g_xfer_poll) event_free(g_xfer_poll);
    g_xfer_poll = NULL;
    if (g_grace_timer) event_free(g_grace_timer);
    g_grace_timer = NULL;
    if (g_drain_timer) event_free(g_drain_timer);
    g_drain_timer = NULL;
    loop_wake_free(srv.wake);
    srv.wake = NULL;
    if (srv.base) event_base_free(srv.base);
    srv.base = NULL;
    return st;
}
