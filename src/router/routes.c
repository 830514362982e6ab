/* routes: the router's HTTP routes, /metrics, start-up and shutdown (router_state.h). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/keyvalq_struct.h>
#include "http/listener.h"
#include "router.h"
#include "upstream.h"
#include "router_state.h"

static const char *outcome_names[OUT_N] = {"ok", "client_error", "upstream_error", "cancelled"};

/* ------------------------------------------------------------------ routes */

static void handle_generate(struct router *r, struct evhttp_request *req, bool chat) {
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    if (!json_is_object(j)) {
        char msg[300];
        snprintf(msg, sizeof msg, "the request body is not a JSON object%s%s", j ? "" : ": ",
                 j ? "" : je.text);
        json_decref(j);
        r->requests[OUT_CLIENT_ERROR]++;
        http_reply_errf(&r->reply, req, 400, "invalid_request_error", NULL, NULL, msg);
        return;
    }
    struct rreq *q = calloc(1, sizeof *q);
    if (q) q->kick = event_new(r->base, -1, 0, rtq_on_kick, q);
    if (q) q->base = rt_client_base(j, &q->conv_id);
    if (!q || !q->kick || !q->base) {
        json_decref(j);
        if (q) {
            if (q->kick) event_free(q->kick);
            json_decref(q->base);
            free(q->conv_id);
            free(q);
        }
        http_reply_errf(&r->reply, req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    q->r = r;
    q->req = req;
    q->chat = chat;
    q->path = chat ? "/v1/chat/completions" : "/v1/completions";
    q->stream = json_is_true(json_object_get(j, "stream"));
    q->include_usage = json_is_true(json_object_get(json_object_get(j, "stream_options"), "include_usage"));
    json_decref(j);
    kv_buf_init(&q->sse);
    q->id = rtq_new_id(r);
    q->next = r->live;
    if (r->live) r->live->prev = q;
    r->live = q;
    r->n_live++;
    q->conn = evhttp_request_get_connection(req);
    if (q->conn) evhttp_connection_set_closecb(q->conn, rtq_on_close, q);
    evhttp_request_set_on_complete_cb(req, rtq_on_complete_foreign, q);

    if (r->ctx.n == 0 || r->gen.n == 0) { /* aggregated pool: a plain proxy */
        rtq_send_final(q, RT_LEG_PLAIN, &r->agg, rt_pool_pick(&r->agg, -1), q->base);
        return;
    }
    q->ctx_idx = rt_pool_pick(&r->ctx, -1);
    q->gen_idx = rt_pool_pick(&r->gen, -1);
    if (r->cfg.style == ROUTER_CONTEXT_FIRST) {
        rtq_start_context(q);
        return;
    }
    if (r->ctx_endpoint[q->ctx_idx]) {
        rtq_start_gen_first(q);
        return;
    }
    q->info = rtq_leg_send(q, &r->ctx, q->ctx_idx, "/server_info", NULL, rtq_on_info_done, UPX_INFO);
    if (!q->info) rtq_fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
}

/* GET /v1/models: the answer of one worker (generation, else aggregated, else context). */
static void on_models_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->final = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        rtq_maybe_free(q);
        return;
    }
    if (o->http_status > 0) {
        rtq_count_outcome(q, o->http_status < 400 ? OUT_OK : OUT_UPSTREAM_ERROR);
        struct evhttp_request *req = rtq_take_req(q);
        http_reply_body(&r->reply, req, (int)o->http_status,
                        u->ctype[0] ? u->ctype : "application/json", u->resp.data, u->resp.len);
        upx_free(u);
        rtq_maybe_free(q);
        return;
    }
    char msg[600];
    snprintf(msg, sizeof msg, "cannot list models: %s", rtq_curl_reason(u, rc));
    upx_free(u);
    rtq_fail_client(q, 502, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
}

static void handle_models(struct router *r, struct evhttp_request *req) {
    struct rt_pool *p = r->gen.n ? &r->gen : r->agg.n ? &r->agg : &r->ctx;
    struct rreq *q = calloc(1, sizeof *q);
    if (q) q->kick = event_new(r->base, -1, 0, rtq_on_kick, q);
    if (!q || !q->kick) {
        free(q);
        http_reply_errf(&r->reply, req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    kv_buf_init(&q->sse);
    q->r = r;
    q->req = req;
    q->next = r->live;
    if (r->live) r->live->prev = q;
    r->live = q;
    r->n_live++;
    q->conn = evhttp_request_get_connection(req);
    if (q->conn) evhttp_connection_set_closecb(q->conn, rtq_on_close, q);
    evhttp_request_set_on_complete_cb(req, rtq_on_complete_foreign, q);
    q->final = rtq_leg_send(q, p, rt_pool_pick(p, -1), "/v1/models", NULL, on_models_done, UPX_MODELS);
    if (!q->final) rtq_fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
}

static void handle_metrics(struct router *r, struct evhttp_request *req) {
    kv_buf b;
    kv_buf_init(&b);
    kv_status st = KV_OK;
#define HDR(n, t, h) st |= kv_buf_printf(&b, "# HELP kvserve_router_" n " " h "\n# TYPE kvserve_router_" n " " t "\n")
    HDR("requests_total", "counter", "Client generation requests by outcome.");
    for (int i = 0; i < OUT_N; i++)
        st |= kv_buf_printf(&b, "kvserve_router_requests_total{outcome=\"%s\"} %llu\n", outcome_names[i],
                            (unsigned long long)r->requests[i]);
    HDR("context_legs_total", "counter", "Context legs sent (retries included).");
    st |= kv_buf_printf(&b, "kvserve_router_context_legs_total %llu\n", (unsigned long long)r->context_legs);
    HDR("generation_legs_total", "counter", "Generation legs sent (retries included).");
    st |= kv_buf_printf(&b, "kvserve_router_generation_legs_total %llu\n", (unsigned long long)r->generation_legs);
    HDR("plain_legs_total", "counter", "Plain (aggregated) requests sent (retries included).");
    st |= kv_buf_printf(&b, "kvserve_router_plain_legs_total %llu\n", (unsigned long long)r->plain_legs);
    HDR("local_prefills_total", "counter",
        "Requests a generation worker prefilled itself (conditional disaggregation).");
    st |= kv_buf_printf(&b, "kvserve_router_local_prefills_total %llu\n", (unsigned long long)r->local_prefills);
    HDR("retries_total", "counter", "Retried upstream attempts by leg and delivery class.");
    for (int k = 0; k < 3; k++)
        for (int d = RT_UNDELIVERED; d <= RT_POSSIBLY_DELIVERED; d++)
            st |= kv_buf_printf(&b, "kvserve_router_retries_total{leg=\"%s\",class=\"%s\"} %llu\n",
                                rt_leg_name(k), rt_delivery_name(d), (unsigned long long)r->retries[k][d]);
    HDR("upstream_errors_total", "counter", "Legs that failed for good (after retries) by leg.");
    for (int k = 0; k < 3; k++)
        st |= kv_buf_printf(&b, "kvserve_router_upstream_errors_total{leg=\"%s\"} %llu\n", rt_leg_name(k),
                            (unsigned long long)r->upstream_errors[k]);
    HDR("requests_in_flight", "gauge", "Client requests being served now.");
    st |= kv_buf_printf(&b, "kvserve_router_requests_in_flight %d\n", r->n_live);
    HDR("http_requests_total", "counter", "HTTP requests received.");
    st |= kv_buf_printf(&b, "kvserve_router_http_requests_total %llu\n", (unsigned long long)r->ctr.http_requests_total);
    HDR("http_errors_total", "counter", "Error answers by class.");
    st |= kv_buf_printf(&b, "kvserve_router_http_errors_total{class=\"4xx\"} %llu\n"
                            "kvserve_router_http_errors_total{class=\"5xx\"} %llu\n",
                        (unsigned long long)r->ctr.http_errors_4xx, (unsigned long long)r->ctr.http_errors_5xx);
    HDR("client_disconnects_total", "counter", "Clients that left before their answer ended.");
    st |= kv_buf_printf(&b, "kvserve_router_client_disconnects_total %llu\n",
                        (unsigned long long)r->ctr.client_disconnects);
#undef HDR
    if (st) http_reply_errf(&r->reply, req, 500, "server_error", NULL, NULL, "out of memory");
    else http_reply_body(&r->reply, req, 200, "text/plain; version=0.0.4", b.data, b.len);
    kv_buf_free(&b);
}

static void on_request(struct evhttp_request *req, void *arg) {
    struct router *r = arg;
    const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(req);
    const char *path = u ? evhttp_uri_get_path(u) : NULL;
    if (!path || !*path) path = "/";
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    static const struct {
        const char *path;
        enum evhttp_cmd_type method;
    } routes[] = {{"/v1/completions", EVHTTP_REQ_POST}, {"/v1/chat/completions", EVHTTP_REQ_POST},
                  {"/health", EVHTTP_REQ_GET}, {"/v1/models", EVHTTP_REQ_GET},
                  {"/metrics", EVHTTP_REQ_GET}};
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(path, routes[i].path) != 0) continue;
        if (cmd != routes[i].method) {
            char msg[160];
            snprintf(msg, sizeof msg, "method %s is not allowed on %s (use %s)", http_method_name(cmd),
                     path, http_method_name(routes[i].method));
            evhttp_add_header(evhttp_request_get_output_headers(req), "Allow",
                              http_method_name(routes[i].method));
            http_reply_errf(&r->reply, req, 405, "invalid_request_error", NULL, "method_not_allowed", msg);
            return;
        }
        if (r->stopping && i < 2) {
            http_reply_errf(&r->reply, req, 503, "server_error", NULL, NULL, "the router is stopping");
            return;
        }
        switch (i) {
        case 0: handle_generate(r, req, false); return;
        case 1: handle_generate(r, req, true); return;
        case 2: http_reply_json_str(&r->reply, req, 200, "{\"status\":\"ok\"}"); return;
        case 3: handle_models(r, req); return;
        default: handle_metrics(r, req); return;
        }
    }
    char msg[300];
    snprintf(msg, sizeof msg, "no route for %s %.200s", http_method_name(cmd), path);
    http_reply_errf(&r->reply, req, 404, "not_found_error", NULL, NULL, msg);
}

static void on_stop(void *arg) {
    struct router *r = arg;
    if (r->stopping) return;
    r->stopping = true;
    KV_INFO("router: stopping (%d live request(s) cancelled)", r->n_live);
    for (struct rreq *q = r->live, *next; q; q = next) {
        next = q->next;
        rtq_fail_client(q, 503, "server_error", NULL, "the router is stopping", OUT_CANCELLED);
    }
    if (r->n_live == 0) event_base_loopexit(r->base, &(struct timeval){0, 50000});
}

/* ------------------------------------------------------------------ run */

static kv_status check_urls(const char *role, const char *const *u, int n, char *err, size_t errlen) {
    for (int i = 0; i < n; i++)
        if (!u[i] || (strncmp(u[i], "http://", 7) != 0 && strncmp(u[i], "https://", 8) != 0) ||
            strlen(u[i]) > 1500)
            return kv_errf(KV_EINVAL, err, errlen, "--%s %s: expected a URL like http://host:port",
                           role, u[i] ? u[i] : "(null)");
    return KV_OK;
}

kv_status router_run(const struct router_config *cfg, char *err, size_t errlen) {
    kv_status st;
    if ((st = check_urls("context", cfg->context, cfg->n_context, err, errlen)) ||
        (st = check_urls("generation", cfg->generation, cfg->n_generation, err, errlen)) ||
        (st = check_urls("workers", cfg->workers, cfg->n_workers, err, errlen)))
        return st;
    bool disagg = cfg->n_context > 0 && cfg->n_generation > 0;
    if (!disagg && (cfg->n_context > 0 || cfg->n_generation > 0))
        return kv_errf(KV_EINVAL, err, errlen,
                       "disaggregated serving needs both --context and --generation workers");
    if (!disagg && cfg->n_workers == 0)
        return kv_errf(KV_EINVAL, err, errlen,
                       "no workers: give --context and --generation URLs, or --workers URLs");
    struct router *r = calloc(1, sizeof *r);
    if (!r) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    r->cfg = *cfg;
    r->ctx = (struct rt_pool){cfg->context, cfg->n_context, 0};
    r->gen = (struct rt_pool){cfg->generation, cfg->n_generation, 0};
    r->agg = (struct rt_pool){cfg->workers, cfg->n_workers, 0};
    r->pol.max_retries = cfg->max_retries < 0 ? 0 : cfg->max_retries;
    const char *nr = getenv("KVSERVE_DISAGG_NO_RETRY");
    r->pol.no_retry = nr && !strcmp(nr, "1");
    if (r->pol.no_retry) KV_INFO("router: KVSERVE_DISAGG_NO_RETRY=1: upstream retries are disabled");
    kv_rng_seed(&r->rng, kv_now_ns() ^ ((uint64_t)getpid() << 32));
    r->reply = (struct http_reply_ctx){&r->ctr, "X-Kvserve-Router", r->self_id};
    signal(SIGPIPE, SIG_IGN);
    bool curl_ok = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
    r->ctx_endpoint = calloc((size_t)(cfg->n_context > 0 ? cfg->n_context : 1), sizeof *r->ctx_endpoint);
    r->base = event_base_new();
    if (!curl_ok || !r->ctx_endpoint || !r->base || upstream_init(&r->up, r->base)) {
        st = kv_errf(KV_ENOMEM, err, errlen, "cannot create the event loop / libcurl");
        goto done;
    }
    r->tick = event_new(r->base, -1, EV_PERSIST, rtq_on_tick, r);
    if (!r->tick) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto done;
    }
    struct timeval tv = {0, 50000};
    evtimer_add(r->tick, &tv);
    struct http_listener_config lc = {.name = "router", .host = cfg->host, .port = cfg->port,
                                      .port_file = NULL, .max_body_bytes = cfg->max_body_bytes,
                                      .timeout_s = 3600, .handle_signals = true, .reply = &r->reply,
                                      .on_request = on_request, .on_stop = on_stop, .arg = r};
    if ((st = http_listener_start(r->base, &lc, &r->lis, err, errlen))) goto done;
    snprintf(r->self_id, sizeof r->self_id, "%s:%d", http_listener_host(r->lis), http_listener_port(r->lis));
    if (cfg->port_file && *cfg->port_file &&
        (st = http_write_port_file(cfg->port_file, http_listener_port(r->lis), err, errlen)))
        goto done;
    if (disagg)
        KV_INFO("router: listening on http://%s (%d context, %d generation worker(s), %s, "
                "max_retries %d, conditional disaggregation %s)", r->self_id, cfg->n_context,
                cfg->n_generation, cfg->style == ROUTER_GENERATION_FIRST ? "generation first" : "context first",
                r->pol.max_retries, cfg->max_local_prefill_tokens >= 0 ? "on" : "off");
    else
        KV_INFO("router: listening on http://%s (aggregated pool of %d worker(s))", r->self_id,
                cfg->n_workers);
    event_base_dispatch(r->base);
    KV_INFO("router: stopped");
done:
    while (r->live) rtq_rreq_free(r->live);
    http_listener_free(r->lis);
    if (r->tick) event_free(r->tick);
    upstream_free(&r->up);
    if (r->base) event_base_free(r->base);
    if (r->ctx_endpoint)
        for (int i = 0; i < cfg->n_context; i++) free(r->ctx_endpoint[i]);
    free(r->ctx_endpoint);
    if (curl_ok) curl_global_cleanup();
    free(r);
    return st;
}
