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
#include "conv_index.h"
#include "kv_mirror.h"
#include "http/http.h"

static const char *outcome_names[OUT_N] = {"ok", "client_error", "upstream_error", "cancelled"};

/* ------------------------------------------------------------------ routing inputs */

/* Appends the code points of UTF-8 s (invalid bytes as themselves). */
static kv_status push_cps(kv_buf *out, const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        int32_t cp = *p;
        int n = 1;
        if (cp >= 0xf0 && p[1] && p[2] && p[3]) cp = (cp & 7) << 18 | (p[1] & 63) << 12 | (p[2] & 63) << 6 | (p[3] & 63), n = 4;
        else if (cp >= 0xe0 && p[1] && p[2]) cp = (cp & 15) << 12 | (p[1] & 63) << 6 | (p[2] & 63), n = 3;
        else if (cp >= 0xc0 && p[1]) cp = (cp & 31) << 6 | (p[1] & 63), n = 2;
        if (kv_buf_append(out, &cp, sizeof cp)) return KV_ENOMEM;
        p += n;
    }
    return KV_OK;
}

/* Decision 1 without a tokenizer: UTF-32 code points of the canonical text (spec §1.2: chat
 * = "role:content" lines joined by "\n"; completion = the string, a string list joined by
 * "\n"). */
static kv_status canonical_cps(const json_t *body, bool chat, kv_buf *out) {
    kv_status st = KV_OK;
    size_t i;
    json_t *v;
    if (chat) {
        json_array_foreach(json_object_get(body, "messages"), i, v) {
            if (i) st |= push_cps(out, "\n");
            const char *role = json_string_value(json_object_get(v, "role"));
            st |= push_cps(out, role ? role : "");
            st |= push_cps(out, ":");
            json_t *c = json_object_get(v, "content");
            if (json_is_string(c)) st |= push_cps(out, json_string_value(c));
            size_t k;
            json_t *part;
            json_array_foreach(c, k, part) {
                const char *t = json_string_value(json_object_get(part, "text"));
                if (t) st |= push_cps(out, t);
            }
        }
        return st;
    }
    json_t *pr = json_object_get(body, "prompt");
    if (json_is_string(pr)) return push_cps(out, json_string_value(pr));
    json_array_foreach(pr, i, v) {
        if (json_is_integer(v)) { /* a pre-tokenized prompt: the ids themselves */
            int32_t id = (int32_t)json_integer_value(v);
            st |= kv_buf_append(out, &id, sizeof id);
            continue;
        }
        if (i) st |= push_cps(out, "\n");
        if (json_is_string(v)) st |= push_cps(out, json_string_value(v));
    }
    return st;
}

void rtq_route_inputs(struct rreq *q, const char *body, size_t len) {
    struct router *r = q->r;
    bool conv = false, kv = false, tok_load = false;
    for (int i = 0; i < POOL_N; i++) {
        if (!r->pools[i].n) continue;
        conv |= r->pools[i].policy == RT_POLICY_CONVERSATION && r->pools[i].min_match_keys > 0;
        kv |= r->pools[i].policy == RT_POLICY_KV_AWARE;
        tok_load |= r->pools[i].metric == RT_LOAD_TOKENS;
    }
    if (!conv && !kv && !tok_load) { /* round robin / least loaded by requests: nothing to hash */
        q->tokens = (long)(len / 5 > 0 ? len / 5 : 1);
        return;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    char *salt = NULL, err[256];
    kv_buf cps;
    kv_buf_init(&cps);
    json_t *j = NULL;
    bool have_ids = http_prompt_ids(r->tok, q->chat, body, len, &ids, &n, &salt, err, sizeof err) == KV_OK;
    const int32_t *elems = ids;
    size_t n_elems = n;
    if (!have_ids && conv) {
        j = json_loadb(body, len, 0, NULL);
        if (j && !canonical_cps(j, q->chat, &cps)) {
            elems = (const int32_t *)cps.data;
            n_elems = cps.len / sizeof(int32_t);
        }
        const char *cs = json_string_value(json_object_get(j, "cache_salt"));
        if (cs) salt = strdup(cs);
    }
    q->tokens = have_ids ? (long)n : (long)(len / 5 > 0 ? len / 5 : 1); /* spec §1.2: chars / 5 */
    int T = r->cfg.tokens_per_block;
    if (conv && elems && n_elems) {
        int max = r->cfg.max_conversation_keys;
        kv_hash *keys = malloc((size_t)max * sizeof *keys);
        q->ckeys = keys ? malloc((size_t)max * sizeof *q->ckeys) : NULL;
        if (q->ckeys) {
            q->n_ckeys = kv_content_keys(&r->key, salt, salt ? strlen(salt) : 0, elems, n_elems, T, keys, max);
            for (int i = 0; i < q->n_ckeys; i++) q->ckeys[i] = kv_hash_u64(&keys[i]);
        }
        free(keys);
    }
    if (kv && have_ids && n > 1) { /* the worker's chain: full blocks before the last token */
        int nb = (int)((n - 1) / (size_t)T);
        q->bh = nb ? malloc((size_t)nb * sizeof *q->bh) : NULL;
        if (q->bh) {
            struct kv_extra_key x = {KV_EXTRA_CACHE_SALT, salt, salt ? strlen(salt) : 0};
            kv_hash h;
            kv_hash_root(&r->key, &x, salt ? 1 : 0, &h);
            for (int i = 0; i < nb; i++) {
                kv_hash_block(&r->key, &h, ids + (size_t)i * T, T, &h);
                q->bh[i] = kv_hash_u64(&h);
            }
            q->n_blocks = nb;
        }
    }
    json_decref(j);
    kv_buf_free(&cps);
    free(ids);
    free(salt);
}

/* ------------------------------------------------------------------ routes */

/* "no live <role> worker" plus why the first one is out (refused: the mismatch, BUG-13). */
static void no_worker_msg(const struct rt_pool *p, char *msg, size_t n) {
    for (int i = 0; i < p->n; i++)
        if (p->w[i]->present && p->w[i]->refused) {
            snprintf(msg, n, "no live %s worker: %s is refused: %s", p->role, p->w[i]->url, p->w[i]->why_refused);
            return;
        }
    snprintf(msg, n, "no live %s worker (%d configured, none present and healthy)", p->role, p->n);
}

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
    json_t *mt = json_object_get(j, "max_completion_tokens");
    if (!json_is_integer(mt)) mt = json_object_get(j, "max_tokens");
    q->max_tokens = json_is_integer(mt) && json_integer_value(mt) > 0 ? (long)json_integer_value(mt) : 0;
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
    for (int i = 0; i < POOL_N; i++) q->charged[i] = -1;
    q->agg_idx = q->ctx_idx = q->gen_idx = -1;
    if (!q->conv_id) { /* the X-Conversation-Id header when the body has none */
        const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Conversation-Id");
        if (h && *h) q->conv_id = strdup(h);
    }
    rtq_route_inputs(q, body, len);
    if (r->cfg.coordinator && rt_coord_select(q)) return; /* rtq_dispatch follows the answers */
    rtq_dispatch(q);
}

void rtq_dispatch(struct rreq *q) {
    struct router *r = q->r;
    bool disagg = R_CTX(r)->n && R_GEN(r)->n;
    if (!disagg) { /* aggregated pool: a plain proxy */
        if (q->agg_idx < 0) q->agg_idx = rtq_place(q, POOL_AGG, -1);
        if (q->agg_idx < 0) {
            char msg[700];
            no_worker_msg(R_AGG(r), msg, sizeof msg);
            rtq_fail_client(q, 503, "server_error", "no_worker", msg, OUT_UPSTREAM_ERROR);
            return;
        }
        rtq_send_final(q, RT_LEG_PLAIN, R_AGG(r), q->agg_idx, q->base);
        return;
    }
    if (q->ctx_idx < 0) q->ctx_idx = rtq_place(q, POOL_CTX, -1);
    if (q->gen_idx < 0) q->gen_idx = rtq_place(q, POOL_GEN, -1);
    if (q->ctx_idx < 0 || q->gen_idx < 0) {
        char msg[700];
        no_worker_msg(q->ctx_idx < 0 ? R_CTX(r) : R_GEN(r), msg, sizeof msg);
        rtq_fail_client(q, 503, "server_error", "no_worker", msg, OUT_UPSTREAM_ERROR);
        return;
    }
    if (r->cfg.style == ROUTER_CONTEXT_FIRST) {
        rtq_start_context(q);
        return;
    }
    if (R_CTX(r)->w[q->ctx_idx]->ctx_endpoint) {
        rtq_start_gen_first(q);
        return;
    }
    q->info = rtq_leg_send(q, R_CTX(r), q->ctx_idx, "/server_info", NULL, rtq_on_info_done, UPX_INFO);
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
    struct rt_pool *p = R_GEN(r)->n ? R_GEN(r) : R_AGG(r)->n ? R_AGG(r) : R_CTX(r);
    struct rreq *q = calloc(1, sizeof *q);
    if (q) q->kick = event_new(r->base, -1, 0, rtq_on_kick, q);
    if (!q || !q->kick) {
        free(q);
        http_reply_errf(&r->reply, req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    kv_buf_init(&q->sse);
    for (int i = 0; i < POOL_N; i++) q->charged[i] = -1;
    q->r = r;
    q->req = req;
    q->next = r->live;
    if (r->live) r->live->prev = q;
    r->live = q;
    r->n_live++;
    q->conn = evhttp_request_get_connection(req);
    if (q->conn) evhttp_connection_set_closecb(q->conn, rtq_on_close, q);
    evhttp_request_set_on_complete_cb(req, rtq_on_complete_foreign, q);
    int mi = rt_pool_pick(p, -1);
    if (mi < 0) {
        rtq_fail_client(q, 503, "server_error", "no_worker", "no live worker", OUT_UPSTREAM_ERROR);
        return;
    }
    q->served_by = p->w[mi]->url;
    q->final = rtq_leg_send(q, p, mi, "/v1/models", NULL, on_models_done, UPX_MODELS);
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
    HDR("kv_releases_total", "counter",
        "POST /kv_release calls to context workers (KV no generation leg will pull) by outcome.");
    st |= kv_buf_printf(&b, "kvserve_router_kv_releases_total{outcome=\"ok\"} %llu\n"
                            "kvserve_router_kv_releases_total{outcome=\"failed\"} %llu\n",
                        (unsigned long long)r->kv_releases[0], (unsigned long long)r->kv_releases[1]);
#undef HDR
    st |= rt_workers_metrics(r, &b);
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
                  {"/metrics", EVHTTP_REQ_GET}, {"/select", EVHTTP_REQ_POST},
                  {"/finish", EVHTTP_REQ_POST}};
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
        case 4: handle_metrics(r, req); return;
        case 5: rt_handle_select(r, req); return;
        default: rt_handle_finish(r, req); return;
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

/* kv_aware: up to 2 s for the configured workers' /kv_events start events before the router
 * announces itself (port file), so that its first requests find them verified or refused
 * rather than "not started yet". Requests that arrive meanwhile are served. */
static void wait_mirrors(struct router *r) {
    uint64_t end = kv_now_ns() + 2000000000ull;
    for (;;) {
        bool waiting = false;
        for (int pl = 0; pl < POOL_N; pl++)
            for (int i = 0; i < r->pools[pl].n; i++) {
                const struct rt_worker *w = r->pools[pl].w[i];
                waiting |= w->mirror && w->present && w->healthy && w->refused && !w->why_refused_final;
            }
        if (!waiting || kv_now_ns() >= end) return;
        event_base_loop(r->base, EVLOOP_ONCE); /* the maintenance tick wakes it every 100 ms */
    }
}

static kv_status init_pool(struct router *r, int id, const char *role, const char *const *urls, int n,
                           char *err, size_t errlen) {
    const struct router_config *c = &r->cfg;
    struct rt_pool *p = &r->pools[id];
    p->role = role;
    p->policy = (enum rt_policy_kind)c->policy;
    p->metric = c->load_tokens ? RT_LOAD_TOKENS : RT_LOAD_REQUESTS;
    p->overlap_weight = c->kv_overlap_weight;
    p->balance = c->kv_balance_threshold;
    p->min_match_keys = (c->min_match_blocks + KV_CONTENT_GROUP_BLOCKS - 1) / KV_CONTENT_GROUP_BLOCKS;
    if (p->policy == RT_POLICY_CONVERSATION &&
        !(p->conv = conv_index_new(c->max_conversations, c->max_conversation_keys)))
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    if (p->policy == RT_POLICY_KV_AWARE && !(p->pred = rt_predict_new(c->predicted_prefix_ttl_s)))
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    for (int i = 0; i < n; i++)
        if (rt_pool_add(p, urls[i]) < 0) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
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
    if (!disagg && cfg->n_workers == 0 && !cfg->etcd)
        return kv_errf(KV_EINVAL, err, errlen,
                       "no workers: give --context and --generation URLs, --workers URLs or --etcd URL");
    if (cfg->tokens_per_block < 1)
        return kv_errf(KV_EINVAL, err, errlen, "--tokens-per-block must be >= 1");
    if (cfg->policy == ROUTER_KV_AWARE && !cfg->hash_key_file)
        return kv_errf(KV_EINVAL, err, errlen,
                       "--policy kv_aware needs --hash-key-file (the workers' block-hash secret) "
                       "to hash prompts exactly as the workers do");
    if (cfg->policy == ROUTER_KV_AWARE && !cfg->tokenizer)
        KV_WARN("router: kv_aware without --tokenizer: only prompts given as token ids can be matched");
    struct router *r = calloc(1, sizeof *r);
    if (!r) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    r->cfg = *cfg;
    if (r->cfg.max_conversations < 1) r->cfg.max_conversations = 100000;
    if (r->cfg.max_conversation_keys < 1) r->cfg.max_conversation_keys = 512;
    if ((st = init_pool(r, POOL_AGG, "aggregated", disagg ? NULL : cfg->workers, disagg ? 0 : cfg->n_workers, err, errlen)) ||
        (st = init_pool(r, POOL_CTX, "context", cfg->context, disagg ? cfg->n_context : 0, err, errlen)) ||
        (st = init_pool(r, POOL_GEN, "generation", cfg->generation, disagg ? cfg->n_generation : 0, err, errlen)))
        goto early;
    if (cfg->hash_key_file) st = kv_hash_key_load_or_create(cfg->hash_key_file, &r->key, err, errlen);
    else if (kv_hash_key_random(&r->key)) st = kv_errf(KV_EIO, err, errlen, "no randomness for a hash key");
    if (st) goto early;
    kv_hash_key_id(&r->key, r->key_id);
    if (cfg->tokenizer && (st = tok_load(cfg->tokenizer, &r->tok, err, errlen))) goto early;
    r->pol.max_retries = cfg->max_retries < 0 ? 0 : cfg->max_retries;
    const char *nr = getenv("KVSERVE_DISAGG_NO_RETRY");
    r->pol.no_retry = nr && !strcmp(nr, "1");
    if (r->pol.no_retry) KV_INFO("router: KVSERVE_DISAGG_NO_RETRY=1: upstream retries are disabled");
    kv_rng_seed(&r->rng, kv_now_ns() ^ ((uint64_t)getpid() << 32));
    r->reply = (struct http_reply_ctx){&r->ctr, "X-Kvserve-Router", r->self_id};
    signal(SIGPIPE, SIG_IGN);
    bool curl_ok = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
    r->base = event_base_new();
    if (!curl_ok || !r->base || upstream_init(&r->up, r->base)) {
        st = kv_errf(KV_ENOMEM, err, errlen, "cannot create the event loop / libcurl");
        goto done;
    }
    if (r->cfg.worker_api_key && *r->cfg.worker_api_key) {
        snprintf(r->worker_auth, sizeof r->worker_auth, "Authorization: Bearer %s", r->cfg.worker_api_key);
        r->up.auth_header = r->worker_auth;
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
                                      .conn = cfg->conn,
                                      .timeout_s = 3600, .handle_signals = true, .reply = &r->reply,
                                      .on_request = on_request, .on_stop = on_stop, .arg = r};
    if ((st = http_listener_start(r->base, &lc, &r->lis, err, errlen))) goto done;
    snprintf(r->self_id, sizeof r->self_id, "%s:%d", http_listener_host(r->lis), http_listener_port(r->lis));
    if (cfg->coordinator && strncmp(cfg->coordinator, "http://", 7) && strncmp(cfg->coordinator, "https://", 8)) {
        st = kv_errf(KV_EINVAL, err, errlen, "--coordinator %s: expected a URL like http://host:port", cfg->coordinator);
        goto done;
    }
    if ((st = rt_workers_start(r, err, errlen))) goto done;
    wait_mirrors(r);
    if (cfg->port_file && *cfg->port_file &&
        (st = http_write_port_file(cfg->port_file, http_listener_port(r->lis), err, errlen)))
        goto done;
    if (disagg)
        KV_INFO("router: listening on http://%s (%d context, %d generation worker(s), %s, "
                "max_retries %d, conditional disaggregation %s, policy %s)", r->self_id, cfg->n_context,
                cfg->n_generation, cfg->style == ROUTER_GENERATION_FIRST ? "generation first" : "context first",
                r->pol.max_retries, cfg->max_local_prefill_tokens >= 0 ? "on" : "off",
                rt_policy_name((enum rt_policy_kind)cfg->policy));
    else
        KV_INFO("router: listening on http://%s (aggregated pool of %d worker(s)%s, policy %s, load %s)",
                r->self_id, cfg->n_workers, cfg->etcd ? " + etcd discovery" : "",
                rt_policy_name((enum rt_policy_kind)cfg->policy), cfg->load_tokens ? "tokens" : "requests");
    event_base_dispatch(r->base);
    KV_INFO("router: stopped");
done:
    while (r->live) rtq_rreq_free(r->live);
    rt_workers_stop(r);
    http_listener_free(r->lis);
    if (r->tick) event_free(r->tick);
    upstream_free(&r->up);
    if (r->base) event_base_free(r->base);
    if (curl_ok) curl_global_cleanup();
early:
    for (int i = 0; i < POOL_N; i++) rt_pool_free(&r->pools[i]);
    if (r->tok) tok_free(r->tok);
    free(r);
    return st;
}
