/*
 * router: the HTTP front and the request flows of `kvserve router` (router.h).
 *
 *   client request (struct rreq) ->
 *     aggregated pool:  PLAIN leg to the next worker, relayed
 *     context first:    [PROBE gen worker -> local? PLAIN leg to it] -> CONTEXT leg
 *                       (validated; finished -> answered from it) -> GENERATION leg, relayed
 *     generation first: [GET /server_info of the context worker, cached] -> GENERATION leg
 *                       (relayed) and CONTEXT leg at once; a failed context leg aborts the
 *                       generation leg and the client gets the error
 *   The relayed (final) leg: streaming clients get the router's headers only with the first
 *   complete upstream SSE event (first-chunk pull: an earlier failure is a real HTTP status
 *   + OpenAI error JSON); later failures are `data: {"error":...}` + `data: [DONE]`.
 *   Upstream events are relayed verbatim, re-framed at event boundaries; while the client's
 *   output buffer is above RELAY_HIGH the upstream transfer is paused.
 *   Client gone (close callback, or a peek for EOF while nothing is being written): every
 *   leg is aborted (its connection closes, the worker cancels) and the rreq freed.
 *   An rreq is freed once the client is answered or gone AND no leg is running.
 */
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

#define RELAY_HIGH ((size_t)256 << 10) /* pause the upstream above this many unsent bytes */
#define SSE_MAX ((size_t)16 << 20)     /* one upstream event may not exceed this */

enum { UPX_PROBE = 10, UPX_INFO = 11, UPX_MODELS = 12 };
enum outcome { OUT_OK = 0, OUT_CLIENT_ERROR, OUT_UPSTREAM_ERROR, OUT_CANCELLED, OUT_N };
static const char *outcome_names[OUT_N] = {"ok", "client_error", "upstream_error", "cancelled"};

struct router {
    struct router_config cfg;
    struct event_base *base;
    struct http_listener *lis;
    struct http_counters ctr;
    struct http_reply_ctx reply;
    char self_id[300];
    struct upstream up;
    struct rt_pool ctx, gen, agg;
    struct rt_retry_policy pol;
    char **ctx_endpoint;  /* per context worker: cached ctx_info_endpoint (heap) or NULL */
    struct rreq *live;
    int n_live;
    struct event *tick;   /* peeks quiet client connections for EOF */
    kv_rng rng;
    uint64_t id_counter;
    bool stopping;
    /* metrics */
    uint64_t requests[OUT_N];
    uint64_t context_legs, generation_legs, plain_legs, local_prefills;
    uint64_t retries[3][3];   /* [leg kind][delivery class] */
    uint64_t upstream_errors[3];
};

struct rreq {
    struct router *r;
    struct rreq *prev, *next;
    struct evhttp_request *req;     /* NULL once answered or gone */
    struct evhttp_connection *conn; /* NULL once closed or unhooked */
    struct event *kick;             /* deferred cancel after a client close */
    bool client_gone, headers_sent, saw_done, ctx_ok, counted;
    bool chat, stream, include_usage;
    const char *path;
    json_t *base;                   /* the client body without disaggregated_params */
    char *conv_id;
    uint64_t id;
    int gen_idx, ctx_idx;
    int retries[3];                 /* per leg kind */
    json_t *gen_body;               /* the generation leg's body (kept across retries) */
    struct upx *probe, *info, *ctx, *final;
    enum rt_leg_kind final_kind;
    kv_buf sse;                     /* upstream bytes of an incomplete SSE event */
    uint64_t last_peek_ns;
};

/* ------------------------------------------------------------------ helpers */

static uint64_t new_id(struct router *r) {
    /* random high bits + a counter, below 2^53 (a JSON number every client parses exactly) */
    uint64_t x = (kv_rng_next(&r->rng) << 20) ^ (++r->id_counter);
    x &= RT_MAX_ID;
    return x ? x : 1;
}

static void count_outcome(struct rreq *q, enum outcome o) {
    if (q->counted) return;
    q->counted = true;
    q->r->requests[o]++;
}

static bool any_leg(const struct rreq *q) { return q->probe || q->info || q->ctx || q->final; }

static void unhook(struct rreq *q) {
    if (q->conn) evhttp_connection_set_closecb(q->conn, NULL, NULL);
    q->conn = NULL;
    if (q->req) evhttp_request_set_on_complete_cb(q->req, NULL, NULL);
}

static void rreq_free(struct rreq *q) {
    struct router *r = q->r;
    unhook(q);
    upx_free(q->probe);
    upx_free(q->info);
    upx_free(q->ctx);
    upx_free(q->final);
    if (q->prev) q->prev->next = q->next;
    else r->live = q->next;
    if (q->next) q->next->prev = q->prev;
    r->n_live--;
    if (q->kick) event_free(q->kick);
    json_decref(q->base);
    json_decref(q->gen_body);
    free(q->conv_id);
    kv_buf_free(&q->sse);
    free(q);
    if (r->stopping && r->n_live == 0) event_base_loopexit(r->base, &(struct timeval){0, 50000});
}

/* Frees q when nothing is left to do. */
static void maybe_free(struct rreq *q) {
    if (!q->req && !any_leg(q)) rreq_free(q);
}

/* Aborts every running leg (closing its connection). */
static void abort_legs(struct rreq *q) {
    upx_free(q->probe);
    upx_free(q->info);
    upx_free(q->ctx);
    upx_free(q->final);
    q->probe = q->info = q->ctx = q->final = NULL;
}

/* Takes the client request out of q for a final reply. */
static struct evhttp_request *take_req(struct rreq *q) {
    struct evhttp_request *req = q->req;
    unhook(q);
    q->req = NULL;
    return req;
}

/* Answers the client with an OpenAI error (HTTP status, or an SSE error event + [DONE] once
 * the stream has started), aborts the legs and frees q when possible. */
/* Generation first: after an upstream failure the cached ctx_info_endpoint may be stale (a
 * restarted context worker listens on a new transfer port): ask /server_info again next time. */
static void forget_ctx_endpoint(struct rreq *q) {
    struct router *r = q->r;
    if (r->cfg.style != ROUTER_GENERATION_FIRST || r->ctx.n == 0 || q->ctx_idx < 0 ||
        q->ctx_idx >= r->ctx.n || !r->ctx_endpoint[q->ctx_idx])
        return;
    free(r->ctx_endpoint[q->ctx_idx]);
    r->ctx_endpoint[q->ctx_idx] = NULL;
}

static void fail_client(struct rreq *q, int status, const char *type, const char *code,
                        const char *msg, enum outcome oc) {
    struct router *r = q->r;
    count_outcome(q, oc);
    abort_legs(q);
    if (oc == OUT_UPSTREAM_ERROR) forget_ctx_endpoint(q);
    if (q->req && !q->client_gone) {
        struct evhttp_request *req = take_req(q);
        if (q->headers_sent) {
            char *e = rt_error_json(type, code, msg);
            struct evbuffer *b = evbuffer_new();
            if (b) {
                evbuffer_add_printf(b, "data: %s\n\ndata: [DONE]\n\n", e ? e : "{}");
                evhttp_send_reply_chunk(req, b);
                evbuffer_free(b);
            }
            free(e);
            evhttp_send_reply_end(req);
        } else {
            http_reply_errf(&r->reply, req, status, type, NULL, code, msg);
        }
    }
    maybe_free(q);
}

/* Terminal: relays an upstream error answer (status + body) unchanged when the body is an
 * OpenAI error object (a 4xx passes through), else wraps it; frees u, aborts the other legs. */
static void relay_upstream_error(struct rreq *q, struct upx *u, long status) {
    struct router *r = q->r;
    enum outcome oc = status < 500 ? OUT_CLIENT_ERROR : OUT_UPSTREAM_ERROR;
    json_t *j = json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, 0, NULL);
    bool ok = json_is_object(json_object_get(j, "error"));
    json_decref(j);
    if (q->headers_sent || !ok) {
        char msg[600];
        snprintf(msg, sizeof msg, "upstream worker answered HTTP %ld: %.400s", status,
                 u->resp.len ? kv_buf_cstr(&u->resp) : "(empty body)");
        upx_free(u);
        fail_client(q, status >= 400 && status < 600 ? (int)status : 502,
                    status < 500 ? "invalid_request_error" : "server_error", NULL, msg, oc);
        return;
    }
    count_outcome(q, oc);
    if (oc == OUT_UPSTREAM_ERROR) forget_ctx_endpoint(q);
    abort_legs(q);
    struct evhttp_request *req = take_req(q);
    if (req && !q->client_gone)
        http_reply_body(&r->reply, req, (int)status, "application/json", u->resp.data, u->resp.len);
    upx_free(u);
    maybe_free(q);
}

static const char *curl_reason(const struct upx *u, CURLcode rc) {
    return u->errbuf[0] ? u->errbuf : curl_easy_strerror(rc);
}

/* ------------------------------------------------------------------ client side */

static void on_kick(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct rreq *q = arg;
    count_outcome(q, OUT_CANCELLED);
    abort_legs(q);
    maybe_free(q);
}

static void client_gone(struct rreq *q) {
    if (q->client_gone) return;
    q->client_gone = true;
    q->r->ctr.client_disconnects++;
    KV_INFO("router: client disconnected; cancelling request %llu", (unsigned long long)q->id);
    event_active(q->kick, EV_READ, 0);
}

static void on_close(struct evhttp_connection *conn, void *arg) {
    (void)conn;
    struct rreq *q = arg;
    q->conn = NULL;
    if (q->req) {
        evhttp_request_set_on_complete_cb(q->req, NULL, NULL);
        /* detached: libevent handed the request to us; otherwise it frees it after this */
        if (evhttp_request_get_connection(q->req) == NULL) evhttp_request_free(q->req);
        q->req = NULL;
    }
    client_gone(q);
}

static void on_complete_foreign(struct evhttp_request *req, void *arg) {
    (void)req;
    struct rreq *q = arg;
    q->req = NULL;
    if (q->conn) evhttp_connection_set_closecb(q->conn, NULL, NULL);
    q->conn = NULL;
    client_gone(q);
}

/* EOF on a connection we are not writing to (libevent does not read it meanwhile). */
static bool peer_closed(struct rreq *q) {
    if (!q->conn) return false;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(q->conn);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0) return false;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct router *r = arg;
    for (struct rreq *q = r->live, *next; q; q = next) {
        next = q->next;
        if (q->req && !q->client_gone && !q->headers_sent && peer_closed(q)) {
            /* answer anyway so libevent cleans the connection up */
            struct evhttp_request *req = take_req(q);
            http_reply_errf(&r->reply, req, 499, "invalid_request_error", NULL, NULL,
                            "client closed the connection");
            q->client_gone = true;
            r->ctr.client_disconnects++;
            KV_INFO("router: client disconnected; cancelling request %llu",
                    (unsigned long long)q->id);
            count_outcome(q, OUT_CANCELLED);
            abort_legs(q);
            maybe_free(q);
        }
    }
}

static size_t client_backlog(struct rreq *q) {
    if (!q->conn) return 0;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(q->conn);
    return bev ? evbuffer_get_length(bufferevent_get_output(bev)) : 0;
}

static void on_chunk_written(struct evhttp_connection *conn, void *arg) {
    (void)conn;
    struct rreq *q = arg;
    if (q->final && q->final->paused && client_backlog(q) < RELAY_HIGH / 2) upx_resume(q->final);
}

static void send_chunk(struct rreq *q, const char *p, size_t n) {
    if (!q->req || q->client_gone) return;
    if (!q->headers_sent) {
        http_reply_count(&q->r->reply, 200);
        http_reply_headers(&q->r->reply, q->req, "text/event-stream");
        evhttp_add_header(evhttp_request_get_output_headers(q->req), "Cache-Control", "no-cache");
        evhttp_send_reply_start(q->req, 200, "OK");
        q->headers_sent = true;
    }
    struct evbuffer *b = evbuffer_new();
    if (!b) return;
    evbuffer_add(b, p, n);
    evhttp_send_reply_chunk_with_cb(q->req, b, on_chunk_written, q);
    evbuffer_free(b);
}

/* ------------------------------------------------------------------ legs */

static void on_final_done(struct upx *u, const struct rt_outcome *o, CURLcode rc);
static void on_ctx_done(struct upx *u, const struct rt_outcome *o, CURLcode rc);
static void start_context(struct rreq *q);

static struct upx *leg_send(struct rreq *q, const struct rt_pool *pool, int idx, const char *path,
                            const json_t *body, upx_done_fn done, int kind) {
    struct router *r = q->r;
    char url[2048];
    snprintf(url, sizeof url, "%s%s", pool->urls[idx], path);
    char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
    if (body && !s) return NULL;
    struct upx *u = upx_start(&r->up, url, s, s ? strlen(s) : 0, r->cfg.timeout_s, q);
    free(s);
    if (!u) return NULL;
    u->on_done = done;
    u->worker = idx;
    u->kind = kind;
    KV_DEBUG("router: %s leg of %llu -> %s", kind <= RT_LEG_PLAIN ? rt_leg_name(kind) : "aux",
             (unsigned long long)q->id, url);
    return u;
}

static size_t on_relay_data(struct upx *u, const char *p, size_t n) {
    struct rreq *q = u->owner;
    if (!q->req || q->client_gone) return 0;
    if (q->headers_sent && client_backlog(q) > RELAY_HIGH) {
        u->paused = true;
        return CURL_WRITEFUNC_PAUSE;
    }
    if (q->sse.len + n > SSE_MAX || kv_buf_append(&q->sse, p, n)) return 0;
    size_t k = rt_sse_complete(q->sse.data, q->sse.len);
    if (k > 0) {
        if (rt_sse_has_done(q->sse.data, k)) q->saw_done = true;
        send_chunk(q, q->sse.data, k);
        memmove(q->sse.data, q->sse.data + k, q->sse.len - k);
        q->sse.len -= k;
    }
    return n;
}

static const struct rt_pool *pool_of(struct router *r, enum rt_leg_kind k) {
    return k == RT_LEG_CONTEXT ? &r->ctx : k == RT_LEG_GENERATION ? &r->gen : &r->agg;
}

/* Sends the relayed leg (kind generation or plain) to pool worker idx with body. */
static void send_final(struct rreq *q, enum rt_leg_kind kind, const struct rt_pool *pool, int idx,
                       const json_t *body) {
    q->final_kind = kind;
    q->final = leg_send(q, pool, idx, q->path, body, on_final_done, kind);
    if (!q->final) {
        fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    if (q->stream) q->final->on_data = on_relay_data;
    if (kind == RT_LEG_GENERATION) q->r->generation_legs++;
    else q->r->plain_legs++;
}

static void count_retry(struct router *r, enum rt_leg_kind k, const struct rt_outcome *o) {
    r->retries[k][rt_classify(o)]++;
}

static void on_final_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->final = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        maybe_free(q);
        return;
    }
    enum rt_delivery d = rt_classify(o);
    if (d == RT_COMPLETED) {
        if (q->stream && u->on_data) {
            if (!q->saw_done) {
                upx_free(u);
                fail_client(q, 502, "server_error", "upstream_truncated",
                            "the upstream stream ended before data: [DONE]", OUT_UPSTREAM_ERROR);
                return;
            }
            upx_free(u);
            count_outcome(q, OUT_OK);
            struct evhttp_request *req = take_req(q);
            evhttp_send_reply_end(req);
            maybe_free(q);
            return;
        }
        count_outcome(q, OUT_OK);
        struct evhttp_request *req = take_req(q);
        http_reply_body(&r->reply, req, (int)o->http_status,
                        u->ctype[0] ? u->ctype : "application/json", u->resp.data, u->resp.len);
        upx_free(u);
        maybe_free(q);
        return;
    }
    /* failed */
    enum rt_leg_kind k = q->final_kind;
    bool streamed = q->headers_sent || q->sse.len > 0;
    if (rt_should_retry(k, o, &r->pol, q->retries[k], streamed)) {
        q->retries[k]++;
        count_retry(r, k, o);
        const struct rt_pool *pool = pool_of(r, k);
        int idx = rt_pool_pick((struct rt_pool *)pool, u->worker);
        KV_WARN("router: %s leg of %llu failed on %s (%s, %s); retry %d on %s", rt_leg_name(k),
                (unsigned long long)q->id, pool->urls[u->worker], curl_reason(u, rc),
                rt_delivery_name(d), q->retries[k], pool->urls[idx]);
        upx_free(u);
        q->final = NULL;
        if (k == RT_LEG_GENERATION && q->gen_body) send_final(q, k, pool, idx, q->gen_body);
        else send_final(q, k, pool, idx, q->base);
        return;
    }
    r->upstream_errors[k]++;
    if (o->http_status > 0 && !(o->http_status >= 200 && o->http_status < 300)) {
        relay_upstream_error(q, u, o->http_status);
        return;
    }
    char msg[700];
    snprintf(msg, sizeof msg, "%s leg failed on %s: %s (%s)", rt_leg_name(k),
             pool_of(r, k)->urls[u->worker], curl_reason(u, rc), rt_delivery_name(d));
    KV_WARN("router: request %llu: %s", (unsigned long long)q->id, msg);
    int status = rc == CURLE_OPERATION_TIMEDOUT ? 504 : 502;
    upx_free(u);
    fail_client(q, status, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
}

/* ---- context first ---- */

static void send_context(struct rreq *q) {
    struct router *r = q->r;
    const char *style = r->cfg.style == ROUTER_GENERATION_FIRST ? "generation_first" : "context_first";
    json_t *body = rt_context_leg(q->base, q->id, style, q->conv_id);
    q->ctx = body ? leg_send(q, &r->ctx, q->ctx_idx, q->path, body, on_ctx_done, RT_LEG_CONTEXT) : NULL;
    json_decref(body);
    if (!q->ctx) {
        fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    r->context_legs++;
}

static void ctx_answer_finished(struct rreq *q, const json_t *resp) {
    struct router *r = q->r;
    count_outcome(q, OUT_OK);
    json_t *clean = rt_strip_disagg(resp);
    struct evhttp_request *req = take_req(q);
    if (q->stream) {
        /* spec §3 step 5 yields only [DONE] here; we send the finished answer as chunks */
        kv_buf b;
        kv_buf_init(&b);
        if (!clean || rt_response_to_sse(clean, q->chat, q->include_usage, &b)) {
            http_reply_errf(&r->reply, req, 500, "server_error", NULL, NULL, "out of memory");
        } else {
            http_reply_count(&r->reply, 200);
            http_reply_headers(&r->reply, req, "text/event-stream");
            evhttp_add_header(evhttp_request_get_output_headers(req), "Cache-Control", "no-cache");
            struct evbuffer *eb = evbuffer_new();
            if (eb) evbuffer_add(eb, b.data, b.len);
            evhttp_send_reply(req, 200, "OK", eb);
            if (eb) evbuffer_free(eb);
        }
        kv_buf_free(&b);
    } else {
        http_reply_json(&r->reply, req, 200, clean);
        clean = NULL;
    }
    json_decref(clean);
}

static void on_ctx_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->ctx = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        maybe_free(q);
        return;
    }
    bool gen_first = r->cfg.style == ROUTER_GENERATION_FIRST;
    enum rt_delivery d = rt_classify(o);
    if (d != RT_COMPLETED) {
        /* generation first: the generation leg waits for this id, so a retry keeps it and is
         * made only when the leg is certainly undelivered (the generation rule) */
        enum rt_leg_kind pk = gen_first ? RT_LEG_GENERATION : RT_LEG_CONTEXT;
        if (rt_should_retry(pk, o, &r->pol, q->retries[RT_LEG_CONTEXT], false)) {
            q->retries[RT_LEG_CONTEXT]++;
            count_retry(r, RT_LEG_CONTEXT, o);
            int idx = rt_pool_pick(&r->ctx, u->worker);
            KV_WARN("router: context leg of %llu failed on %s (%s, %s); retry %d on %s",
                    (unsigned long long)q->id, r->ctx.urls[u->worker], curl_reason(u, rc),
                    rt_delivery_name(d), q->retries[RT_LEG_CONTEXT], r->ctx.urls[idx]);
            upx_free(u);
            if (gen_first && idx != q->ctx_idx) idx = q->ctx_idx; /* its endpoint is in the gen leg */
            q->ctx_idx = idx;
            if (!gen_first) q->id = new_id(r); /* spec §2: a context retry gets a fresh id */
            send_context(q);
            return;
        }
        r->upstream_errors[RT_LEG_CONTEXT]++;
        if (o->http_status > 0) {
            relay_upstream_error(q, u, o->http_status); /* 4xx unchanged */
            return;
        }
        char msg[700];
        snprintf(msg, sizeof msg, "context leg failed on %s: %s (%s)", r->ctx.urls[u->worker],
                 curl_reason(u, rc), rt_delivery_name(d));
        KV_WARN("router: request %llu: %s", (unsigned long long)q->id, msg);
        int status = rc == CURLE_OPERATION_TIMEDOUT ? 504 : 502;
        upx_free(u);
        fail_client(q, status, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
        return;
    }
    if (gen_first) { /* the generation leg carries the answer */
        q->ctx_ok = true;
        upx_free(u);
        maybe_free(q);
        return;
    }
    char err[300];
    json_error_t je;
    json_t *resp = json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, 0, &je);
    upx_free(u);
    const json_t *dp = resp ? rt_context_check(resp, err, sizeof err) : NULL;
    if (!resp) snprintf(err, sizeof err, "the context response is not JSON: %s", je.text);
    if (!dp) {
        r->upstream_errors[RT_LEG_CONTEXT]++;
        KV_WARN("router: request %llu: %s", (unsigned long long)q->id, err);
        json_decref(resp);
        fail_client(q, 500, "server_error", NULL, err, OUT_UPSTREAM_ERROR);
        return;
    }
    if (rt_context_finished(resp, q->base)) {
        ctx_answer_finished(q, resp);
        json_decref(resp);
        maybe_free(q);
        return;
    }
    q->gen_body = rt_generation_leg(q->base, dp, q->conv_id);
    json_decref(resp);
    if (!q->gen_body) {
        fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    send_final(q, RT_LEG_GENERATION, &r->gen, q->gen_idx, q->gen_body);
}

static void on_probe_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->probe = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        maybe_free(q);
        return;
    }
    bool local = false;
    if (rt_classify(o) == RT_COMPLETED) {
        json_t *j = json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, 0, NULL);
        local = rt_probe_local(j, r->cfg.max_local_prefill_tokens);
        json_decref(j);
    } else {
        KV_DEBUG("router: /kv_probe on %s failed (%s, HTTP %ld): disaggregated flow",
                 r->gen.urls[u->worker], curl_reason(u, rc), o->http_status);
    }
    upx_free(u);
    if (local) {
        r->local_prefills++;
        send_final(q, RT_LEG_PLAIN, &r->gen, q->gen_idx, q->base);
        return;
    }
    send_context(q);
}

static void start_context(struct rreq *q) {
    struct router *r = q->r;
    if (r->cfg.max_local_prefill_tokens >= 0) {
        q->probe = leg_send(q, &r->gen, q->gen_idx, "/kv_probe", q->base, on_probe_done, UPX_PROBE);
        if (q->probe) return;
    }
    send_context(q);
}

/* ---- generation first ---- */

static void start_gen_first(struct rreq *q) {
    struct router *r = q->r;
    q->gen_body = rt_generation_first_leg(q->base, q->id, r->ctx_endpoint[q->ctx_idx], q->conv_id);
    if (!q->gen_body) {
        fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    send_final(q, RT_LEG_GENERATION, &r->gen, q->gen_idx, q->gen_body);
    if (q->final) send_context(q);
}

static void on_info_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->info = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        maybe_free(q);
        return;
    }
    const char *ep = NULL;
    json_t *j = NULL;
    if (rt_classify(o) == RT_COMPLETED) {
        j = json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, 0, NULL);
        ep = rt_server_info_endpoint(j);
    }
    if (!ep) {
        char msg[600];
        snprintf(msg, sizeof msg, "cannot get ctx_info_endpoint from %s/server_info: %s",
                 r->ctx.urls[u->worker],
                 o->http_status >= 200 && o->http_status < 300 ? "no disaggregated_params.ctx_info_endpoint"
                                                                 : curl_reason(u, rc));
        json_decref(j);
        upx_free(u);
        r->upstream_errors[RT_LEG_CONTEXT]++;
        fail_client(q, 502, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
        return;
    }
    free(r->ctx_endpoint[u->worker]);
    r->ctx_endpoint[u->worker] = strdup(ep);
    json_decref(j);
    upx_free(u);
    if (!r->ctx_endpoint[q->ctx_idx]) {
        fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    start_gen_first(q);
}

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
    if (q) q->kick = event_new(r->base, -1, 0, on_kick, q);
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
    q->id = new_id(r);
    q->next = r->live;
    if (r->live) r->live->prev = q;
    r->live = q;
    r->n_live++;
    q->conn = evhttp_request_get_connection(req);
    if (q->conn) evhttp_connection_set_closecb(q->conn, on_close, q);
    evhttp_request_set_on_complete_cb(req, on_complete_foreign, q);

    if (r->ctx.n == 0 || r->gen.n == 0) { /* aggregated pool: a plain proxy */
        send_final(q, RT_LEG_PLAIN, &r->agg, rt_pool_pick(&r->agg, -1), q->base);
        return;
    }
    q->ctx_idx = rt_pool_pick(&r->ctx, -1);
    q->gen_idx = rt_pool_pick(&r->gen, -1);
    if (r->cfg.style == ROUTER_CONTEXT_FIRST) {
        start_context(q);
        return;
    }
    if (r->ctx_endpoint[q->ctx_idx]) {
        start_gen_first(q);
        return;
    }
    q->info = leg_send(q, &r->ctx, q->ctx_idx, "/server_info", NULL, on_info_done, UPX_INFO);
    if (!q->info) fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
}

/* GET /v1/models: the answer of one worker (generation, else aggregated, else context). */
static void on_models_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->final = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        maybe_free(q);
        return;
    }
    if (o->http_status > 0) {
        count_outcome(q, o->http_status < 400 ? OUT_OK : OUT_UPSTREAM_ERROR);
        struct evhttp_request *req = take_req(q);
        http_reply_body(&r->reply, req, (int)o->http_status,
                        u->ctype[0] ? u->ctype : "application/json", u->resp.data, u->resp.len);
        upx_free(u);
        maybe_free(q);
        return;
    }
    char msg[600];
    snprintf(msg, sizeof msg, "cannot list models: %s", curl_reason(u, rc));
    upx_free(u);
    fail_client(q, 502, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
}

static void handle_models(struct router *r, struct evhttp_request *req) {
    struct rt_pool *p = r->gen.n ? &r->gen : r->agg.n ? &r->agg : &r->ctx;
    struct rreq *q = calloc(1, sizeof *q);
    if (q) q->kick = event_new(r->base, -1, 0, on_kick, q);
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
    if (q->conn) evhttp_connection_set_closecb(q->conn, on_close, q);
    evhttp_request_set_on_complete_cb(req, on_complete_foreign, q);
    q->final = leg_send(q, p, rt_pool_pick(p, -1), "/v1/models", NULL, on_models_done, UPX_MODELS);
    if (!q->final) fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
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
        fail_client(q, 503, "server_error", NULL, "the router is stopping", OUT_CANCELLED);
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
    r->tick = event_new(r->base, -1, EV_PERSIST, on_tick, r);
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
    while (r->live) rreq_free(r->live);
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
