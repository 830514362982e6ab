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

#include "http/conn_gate.h"
#include "http/listener.h"
#include "router.h"
#include "upstream.h"

#include "router_state.h"
#include "kv_mirror.h"

/* ------------------------------------------------------------------ helpers */

uint64_t rtq_new_id(struct router *r) {
    /* random high bits + a counter, below 2^53 (a JSON number every client parses exactly) */
    uint64_t x = (kv_rng_next(&r->rng) << 20) ^ (++r->id_counter);
    x &= RT_MAX_ID;
    return x ? x : 1;
}

int rtq_place(struct rreq *q, int pool, int exclude) {
    struct router *r = q->r;
    struct rt_pool *p = &r->pools[pool];
    struct rt_route rq = {q->conv_id, q->ckeys, q->n_ckeys, q->bh, q->n_blocks,
                          r->cfg.tokens_per_block, q->tokens, kv_now_ns()};
    enum rt_reason why;
    long predicted;
    int idx = rt_select(p, &rq, exclude, &why, &predicted);
    if (idx < 0) return -1;
    if (q->charged[pool] >= 0) rt_pool_release(p, q->charged[pool], q->tokens, q->work[pool]);
    q->work[pool] = rt_leg_work(q->tokens, predicted, q->max_tokens);
    rt_pool_charge(p, idx, q->tokens, q->work[pool]);
    q->charged[pool] = idx;
    p->w[idx]->predicted_tokens += (uint64_t)predicted;
    KV_DEBUG("router: request %llu -> %s worker %s (%s, %ld cached tokens predicted)",
             (unsigned long long)q->id, p->role, p->w[idx]->url, rt_reason_name(why), predicted);
    return idx;
}

void rtq_assign(struct rreq *q, int pool, int idx, enum rt_reason why) {
    struct rt_pool *p = &q->r->pools[pool];
    if (q->charged[pool] >= 0) rt_pool_release(p, q->charged[pool], q->tokens, q->work[pool]);
    q->work[pool] = rt_leg_work(q->tokens, 0, q->max_tokens);
    rt_pool_charge(p, idx, q->tokens, q->work[pool]);
    q->charged[pool] = idx;
    p->reasons[why]++;
    if (pool == POOL_AGG) q->agg_idx = idx;
    else if (pool == POOL_CTX) q->ctx_idx = idx;
    else q->gen_idx = idx;
}

void rtq_release(struct rreq *q, int pool) {
    if (q->charged[pool] < 0) return;
    rt_pool_release(&q->r->pools[pool], q->charged[pool], q->tokens, q->work[pool]);
    q->charged[pool] = -1;
}

/* Credits the cached_tokens a worker reported in a response or a usage chunk. */
static void credit_reported(struct rreq *q, const char *p, size_t n) {
    static const char pat[] = "\"cached_tokens\":";
    if (!q->final_worker) return;
    for (size_t i = 0; i + sizeof pat - 1 < n; i++) {
        if (p[i] != '"' || memcmp(p + i, pat, sizeof pat - 1) != 0) continue;
        size_t j = i + sizeof pat - 1;
        while (j < n && p[j] == ' ') j++;
        long v = 0;
        while (j < n && p[j] >= '0' && p[j] <= '9') v = v * 10 + (p[j++] - '0');
        q->final_worker->reported_tokens += (uint64_t)v;
        q->final_worker = NULL; /* once per request */
        return;
    }
}

void rtq_count_outcome(struct rreq *q, enum outcome o) {
    if (q->counted) return;
    q->counted = true;
    q->counted_ok = o == OUT_OK;
    q->r->requests[o]++;
}

static bool any_leg(const struct rreq *q) {
    return q->probe || q->info || q->ctx || q->final || q->sel_pending > 0;
}

static void unhook(struct rreq *q) {
    if (q->conn) evhttp_connection_set_closecb(q->conn, NULL, NULL);
    q->conn = NULL;
    if (q->req) evhttp_request_set_on_complete_cb(q->req, NULL, NULL);
}

void rtq_rreq_free(struct rreq *q) {
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
    for (int i = 0; i < POOL_N; i++) {
        upx_free(q->sel[i]);
        rtq_release(q, i);
    }
    rt_coord_finish(q);
    if (q->kv_held) rt_kv_release(r, q->kv_ctx, q->id); /* no generation leg pulled it */
    free(q->ckeys);
    free(q->bh);
    if (q->kick) event_free(q->kick);
    json_decref(q->base);
    json_decref(q->gen_body);
    free(q->conv_id);
    kv_buf_free(&q->sse);
    free(q);
    if (r->stopping && r->n_live == 0) event_base_loopexit(r->base, &(struct timeval){0, 50000});
}

/* Frees q when nothing is left to do. */
void rtq_maybe_free(struct rreq *q) {
    if (!q->req && !any_leg(q)) rtq_rreq_free(q);
}

/* Aborts every running leg (closing its connection). */
static void abort_legs(struct rreq *q) {
    for (int i = 0; i < POOL_N; i++) {
        upx_free(q->sel[i]);
        q->sel[i] = NULL;
    }
    q->sel_pending = 0;
    upx_free(q->probe);
    upx_free(q->info);
    upx_free(q->ctx);
    upx_free(q->final);
    q->probe = q->info = q->ctx = q->final = NULL;
}

/* Takes the client request out of q for a final reply. */
static void worker_header(struct rreq *q, struct evhttp_request *req) {
    if (req) evhttp_add_header(evhttp_request_get_output_headers(req), "X-Kvserve-Worker",
                               q->served_by ? q->served_by : "none");
}

struct evhttp_request *rtq_take_req(struct rreq *q) {
    struct evhttp_request *req = q->req;
    if (!q->headers_sent) worker_header(q, req);
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
    if (r->cfg.style != ROUTER_GENERATION_FIRST || R_CTX(r)->n == 0 || q->ctx_idx < 0 ||
        q->ctx_idx >= R_CTX(r)->n || !R_CTX(r)->w[q->ctx_idx]->ctx_endpoint)
        return;
    free(R_CTX(r)->w[q->ctx_idx]->ctx_endpoint);
    R_CTX(r)->w[q->ctx_idx]->ctx_endpoint = NULL;
}

void rtq_fail_client(struct rreq *q, int status, const char *type, const char *code,
                        const char *msg, enum outcome oc) {
    struct router *r = q->r;
    rtq_count_outcome(q, oc);
    abort_legs(q);
    if (oc == OUT_UPSTREAM_ERROR) forget_ctx_endpoint(q);
    if (q->req && !q->client_gone) {
        struct evhttp_request *req = rtq_take_req(q);
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
    rtq_maybe_free(q);
}

/* Terminal: relays an upstream error answer (status + body) unchanged when the body is an
 * OpenAI error object (a 4xx passes through), else wraps it; frees u, aborts the other legs. */
static void relay_upstream_error(struct rreq *q, struct upx *u, long status) {
    struct router *r = q->r;
    enum outcome oc = status < 500 ? OUT_CLIENT_ERROR : OUT_UPSTREAM_ERROR;
    json_t *j = json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, JSON_ALLOW_NUL, NULL);
    bool ok = json_is_object(json_object_get(j, "error"));
    json_decref(j);
    if (q->headers_sent || !ok) {
        char msg[600];
        snprintf(msg, sizeof msg, "upstream worker answered HTTP %ld: %.400s", status,
                 u->resp.len ? kv_buf_cstr(&u->resp) : "(empty body)");
        upx_free(u);
        rtq_fail_client(q, status >= 400 && status < 600 ? (int)status : 502,
                    status < 500 ? "invalid_request_error" : "server_error", NULL, msg, oc);
        return;
    }
    rtq_count_outcome(q, oc);
    if (oc == OUT_UPSTREAM_ERROR) forget_ctx_endpoint(q);
    abort_legs(q);
    struct evhttp_request *req = rtq_take_req(q);
    if (req && !q->client_gone)
        http_reply_body(&r->reply, req, (int)status, "application/json", u->resp.data, u->resp.len);
    upx_free(u);
    rtq_maybe_free(q);
}

const char *rtq_curl_reason(const struct upx *u, CURLcode rc) {
    return u->errbuf[0] ? u->errbuf : curl_easy_strerror(rc);
}

/* ------------------------------------------------------------------ client side */

void rtq_on_kick(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct rreq *q = arg;
    rtq_count_outcome(q, OUT_CANCELLED);
    abort_legs(q);
    rtq_maybe_free(q);
}

void rtq_client_gone(struct rreq *q) {
    if (q->client_gone) return;
    q->client_gone = true;
    q->r->ctr.client_disconnects++;
    KV_INFO("router: client disconnected; cancelling request %llu", (unsigned long long)q->id);
    event_active(q->kick, EV_READ, 0);
}

void rtq_on_close(struct evhttp_connection *conn, void *arg) {
    (void)conn;
    struct rreq *q = arg;
    q->conn = NULL;
    if (q->req) {
        evhttp_request_set_on_complete_cb(q->req, NULL, NULL);
        /* detached: libevent handed the request to us; otherwise it frees it after this */
        if (evhttp_request_get_connection(q->req) == NULL) evhttp_request_free(q->req);
        q->req = NULL;
    }
    rtq_client_gone(q);
}

void rtq_on_complete_foreign(struct evhttp_request *req, void *arg) {
    (void)req;
    struct rreq *q = arg;
    q->req = NULL;
    if (q->conn) evhttp_connection_set_closecb(q->conn, NULL, NULL);
    q->conn = NULL;
    rtq_client_gone(q);
}

/* Is the client gone while we are not writing to it (libevent does not read it meanwhile)?
 * A reset, or an end of input that is not a half-close (conn_gate.h). */
static bool peer_closed(struct rreq *q) {
    return q->conn && http_gate_client_gone(q->conn);
}

void rtq_on_tick(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct router *r = arg;
    for (struct rreq *q = r->live, *next; q; q = next) {
        next = q->next;
        if (q->req && !q->client_gone && !q->headers_sent && peer_closed(q)) {
            /* answer anyway so libevent cleans the connection up */
            struct evhttp_request *req = rtq_take_req(q);
            http_reply_errf(&r->reply, req, 499, "invalid_request_error", NULL, NULL,
                            "client closed the connection");
            q->client_gone = true;
            r->ctr.client_disconnects++;
            KV_INFO("router: client disconnected; cancelling request %llu",
                    (unsigned long long)q->id);
            rtq_count_outcome(q, OUT_CANCELLED);
            abort_legs(q);
            rtq_maybe_free(q);
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
        worker_header(q, q->req);
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
void rtq_start_context(struct rreq *q);

struct upx *rtq_leg_send(struct rreq *q, const struct rt_pool *pool, int idx, const char *path,
                            const json_t *body, upx_done_fn done, int kind) {
    struct router *r = q->r;
    char url[2048];
    snprintf(url, sizeof url, "%s%s", pool->w[idx]->url, path);
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
        credit_reported(q, q->sse.data, k);
        send_chunk(q, q->sse.data, k);
        memmove(q->sse.data, q->sse.data + k, q->sse.len - k);
        q->sse.len -= k;
    }
    return n;
}

/* The pool a leg kind draws from (a plain leg: the aggregated pool, or the generation pool
 * when it prefills locally). */
static int pool_id_of(struct rreq *q, enum rt_leg_kind k) {
    struct router *r = q->r;
    if (k == RT_LEG_CONTEXT) return POOL_CTX;
    if (k == RT_LEG_GENERATION || R_AGG(r)->n == 0 || (R_CTX(r)->n && R_GEN(r)->n)) return POOL_GEN;
    return POOL_AGG;
}
static const struct rt_pool *pool_of(struct rreq *q, enum rt_leg_kind k) {
    return &q->r->pools[pool_id_of(q, k)];
}

/* Sends the relayed leg (kind generation or plain) to pool worker idx with body. */
void rtq_send_final(struct rreq *q, enum rt_leg_kind kind, const struct rt_pool *pool, int idx,
                       const json_t *body) {
    q->final_kind = kind;
    q->served_by = pool->w[idx]->url;
    q->final_worker = pool->w[idx];
    q->final_pool = (int)(pool - q->r->pools);
    q->final = rtq_leg_send(q, pool, idx, q->path, body, on_final_done, kind);
    if (!q->final) {
        rtq_fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    if (q->stream) q->final->on_data = on_relay_data;
    if (kind == RT_LEG_GENERATION) q->r->generation_legs++;
    else q->r->plain_legs++;
}

static void count_retry(struct router *r, enum rt_leg_kind k, const struct rt_outcome *o) {
    r->retries[k][rt_classify(o)]++;
}

/* The relayed leg is the generation leg (not a local prefill's plain leg). */
static bool k_final_gen(const struct rreq *q) { return q->final_kind == RT_LEG_GENERATION; }

static void on_final_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->final = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        rtq_maybe_free(q);
        return;
    }
    enum rt_delivery d = rt_classify(o);
    if (d == RT_COMPLETED) {
        if (q->stream && u->on_data) {
            if (!q->saw_done) {
                upx_free(u);
                rtq_fail_client(q, 502, "server_error", "upstream_truncated",
                            "the upstream stream ended before data: [DONE]", OUT_UPSTREAM_ERROR);
                return;
            }
            upx_free(u);
            if (k_final_gen(q)) q->kv_held = false; /* the generation leg pulled it */
            rtq_count_outcome(q, OUT_OK);
            struct evhttp_request *req = rtq_take_req(q);
            evhttp_send_reply_end(req);
            rtq_maybe_free(q);
            return;
        }
        if (k_final_gen(q)) q->kv_held = false;
        rtq_count_outcome(q, OUT_OK);
        credit_reported(q, u->resp.data ? u->resp.data : "", u->resp.len);
        struct evhttp_request *req = rtq_take_req(q);
        http_reply_body(&r->reply, req, (int)o->http_status,
                        u->ctype[0] ? u->ctype : "application/json", u->resp.data, u->resp.len);
        upx_free(u);
        rtq_maybe_free(q);
        return;
    }
    /* failed */
    enum rt_leg_kind k = q->final_kind;
    bool streamed = q->headers_sent || q->sse.len > 0;
    if (rt_should_retry(k, o, &r->pol, q->retries[k], streamed)) {
        q->retries[k]++;
        count_retry(r, k, o);
        int pid = pool_id_of(q, k);
        const struct rt_pool *pool = &r->pools[pid];
        int idx = rtq_place(q, pid, u->worker); /* the policy again, without the failed worker */
        if (idx < 0) idx = u->worker;
        KV_WARN("router: %s leg of %llu failed on %s (%s, %s); retry %d on %s", rt_leg_name(k),
                (unsigned long long)q->id, pool->w[u->worker]->url, rtq_curl_reason(u, rc),
                rt_delivery_name(d), q->retries[k], pool->w[idx]->url);
        if (k == RT_LEG_GENERATION) q->gen_idx = idx;
        upx_free(u);
        q->final = NULL;
        if (k == RT_LEG_GENERATION && q->gen_body) rtq_send_final(q, k, pool, idx, q->gen_body);
        else rtq_send_final(q, k, pool, idx, q->base);
        return;
    }
    r->upstream_errors[k]++;
    if (o->http_status > 0 && !(o->http_status >= 200 && o->http_status < 300)) {
        relay_upstream_error(q, u, o->http_status);
        return;
    }
    char msg[700];
    snprintf(msg, sizeof msg, "%s leg failed on %s: %s (%s)", rt_leg_name(k),
             pool_of(q, k)->w[u->worker]->url, rtq_curl_reason(u, rc), rt_delivery_name(d));
    KV_WARN("router: request %llu: %s", (unsigned long long)q->id, msg);
    int status = rc == CURLE_OPERATION_TIMEDOUT ? 504 : 502;
    upx_free(u);
    rtq_fail_client(q, status, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
}

/* ---- context first ---- */

static void send_context(struct rreq *q) {
    struct router *r = q->r;
    const char *style = r->cfg.style == ROUTER_GENERATION_FIRST ? "generation_first" : "context_first";
    json_t *body = rt_context_leg(q->base, q->id, style, q->conv_id);
    q->kv_held = true;
    q->kv_ctx = q->ctx_idx;
    q->ctx = body ? rtq_leg_send(q, R_CTX(r), q->ctx_idx, q->path, body, on_ctx_done, RT_LEG_CONTEXT) : NULL;
    json_decref(body);
    if (!q->ctx) {
        rtq_fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    r->context_legs++;
}

static void ctx_answer_finished(struct rreq *q, const json_t *resp) {
    struct router *r = q->r;
    rtq_count_outcome(q, OUT_OK);
    json_t *clean = rt_strip_disagg(resp);
    struct evhttp_request *req = rtq_take_req(q);
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
    if (r->cfg.style == ROUTER_CONTEXT_FIRST) rtq_release(q, POOL_CTX); /* its part is done */
    if (q->client_gone || !q->req) {
        upx_free(u);
        rtq_maybe_free(q);
        return;
    }
    bool gen_first = r->cfg.style == ROUTER_GENERATION_FIRST;
    enum rt_delivery d = rt_classify(o);
    if (d == RT_UNDELIVERED) q->kv_held = false; /* the worker never saw it: nothing to release */
    if (d != RT_COMPLETED) {
        /* generation first: the generation leg waits for this id, so a retry keeps it and is
         * made only when the leg is certainly undelivered (the generation rule) */
        enum rt_leg_kind pk = gen_first ? RT_LEG_GENERATION : RT_LEG_CONTEXT;
        if (rt_should_retry(pk, o, &r->pol, q->retries[RT_LEG_CONTEXT], false)) {
            q->retries[RT_LEG_CONTEXT]++;
            count_retry(r, RT_LEG_CONTEXT, o);
            int idx = gen_first ? q->ctx_idx : rtq_place(q, POOL_CTX, u->worker);
            if (idx < 0) idx = u->worker;
            KV_WARN("router: context leg of %llu failed on %s (%s, %s); retry %d on %s",
                    (unsigned long long)q->id, R_CTX(r)->w[u->worker]->url, rtq_curl_reason(u, rc),
                    rt_delivery_name(d), q->retries[RT_LEG_CONTEXT], R_CTX(r)->w[idx]->url);
            upx_free(u);
            if (gen_first && idx != q->ctx_idx) idx = q->ctx_idx; /* its endpoint is in the gen leg */
            q->ctx_idx = idx;
            if (!gen_first) { /* spec §2: a context retry gets a fresh id */
                if (q->kv_held) rt_kv_release(r, q->kv_ctx, q->id); /* in case it kept KV */
                q->kv_held = false;
                q->id = rtq_new_id(r);
            }
            send_context(q);
            return;
        }
        r->upstream_errors[RT_LEG_CONTEXT]++;
        if (o->http_status > 0) {
            q->kv_held = false; /* an error answer: the context worker offered nothing */
            relay_upstream_error(q, u, o->http_status); /* 4xx unchanged */
            return;
        }
        char msg[700];
        snprintf(msg, sizeof msg, "context leg failed on %s: %s (%s)", R_CTX(r)->w[u->worker]->url,
                 rtq_curl_reason(u, rc), rt_delivery_name(d));
        KV_WARN("router: request %llu: %s", (unsigned long long)q->id, msg);
        int status = rc == CURLE_OPERATION_TIMEDOUT ? 504 : 502;
        upx_free(u);
        rtq_fail_client(q, status, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
        return;
    }
    if (gen_first) { /* the generation leg carries the answer */
        q->ctx_ok = true;
        upx_free(u);
        rtq_maybe_free(q);
        return;
    }
    char err[300];
    json_error_t je;
    /* JSON_ALLOW_NUL: the first token's text may be U+0000 (a <0x00> byte token) */
    json_t *resp = json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, JSON_ALLOW_NUL, &je);
    upx_free(u);
    const json_t *dp = resp ? rt_context_check(resp, err, sizeof err) : NULL;
    if (!resp) snprintf(err, sizeof err, "the context response is not JSON: %s", je.text);
    if (!dp) {
        r->upstream_errors[RT_LEG_CONTEXT]++;
        KV_WARN("router: request %llu: %s", (unsigned long long)q->id, err);
        json_decref(resp);
        rtq_fail_client(q, 500, "server_error", NULL, err, OUT_UPSTREAM_ERROR);
        return;
    }
    if (rt_context_finished(resp, q->base)) {
        q->kv_held = false; /* the context worker kept no KV */
        q->served_by = R_CTX(r)->w[q->ctx_idx]->url;
        ctx_answer_finished(q, resp);
        json_decref(resp);
        rtq_maybe_free(q);
        return;
    }
    q->gen_body = rt_generation_leg(q->base, dp, q->conv_id);
    json_decref(resp);
    if (!q->gen_body) {
        rtq_fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    rtq_send_final(q, RT_LEG_GENERATION, R_GEN(r), q->gen_idx, q->gen_body);
}

static void on_probe_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->probe = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        rtq_maybe_free(q);
        return;
    }
    bool local = false;
    if (rt_classify(o) == RT_COMPLETED) {
        json_t *j = json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, 0, NULL);
        local = rt_probe_local(j, r->cfg.max_local_prefill_tokens);
        json_decref(j);
    } else {
        KV_DEBUG("router: /kv_probe on %s failed (%s, HTTP %ld): disaggregated flow",
                 R_GEN(r)->w[u->worker]->url, rtq_curl_reason(u, rc), o->http_status);
    }
    upx_free(u);
    if (local) {
        r->local_prefills++;
        rtq_send_final(q, RT_LEG_PLAIN, R_GEN(r), q->gen_idx, q->base);
        return;
    }
    send_context(q);
}

void rtq_start_context(struct rreq *q) {
    struct router *r = q->r;
    if (r->cfg.max_local_prefill_tokens >= 0) {
        q->probe = rtq_leg_send(q, R_GEN(r), q->gen_idx, "/kv_probe", q->base, on_probe_done, UPX_PROBE);
        if (q->probe) return;
    }
    send_context(q);
}

/* ---- generation first ---- */

void rtq_start_gen_first(struct rreq *q) {
    struct router *r = q->r;
    q->gen_body = rt_generation_first_leg(q->base, q->id, R_CTX(r)->w[q->ctx_idx]->ctx_endpoint, q->conv_id);
    if (!q->gen_body) {
        rtq_fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    rtq_send_final(q, RT_LEG_GENERATION, R_GEN(r), q->gen_idx, q->gen_body);
    if (q->final) send_context(q);
}

void rtq_on_info_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    q->info = NULL;
    if (q->client_gone || !q->req) {
        upx_free(u);
        rtq_maybe_free(q);
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
                 R_CTX(r)->w[u->worker]->url,
                 o->http_status >= 200 && o->http_status < 300 ? "no disaggregated_params.ctx_info_endpoint"
                                                                 : rtq_curl_reason(u, rc));
        json_decref(j);
        upx_free(u);
        r->upstream_errors[RT_LEG_CONTEXT]++;
        rtq_fail_client(q, 502, "server_error", NULL, msg, OUT_UPSTREAM_ERROR);
        return;
    }
    free(R_CTX(r)->w[u->worker]->ctx_endpoint);
    R_CTX(r)->w[u->worker]->ctx_endpoint = strdup(ep);
    json_decref(j);
    upx_free(u);
    if (!R_CTX(r)->w[q->ctx_idx]->ctx_endpoint) {
        rtq_fail_client(q, 500, "server_error", NULL, "out of memory", OUT_UPSTREAM_ERROR);
        return;
    }
    rtq_start_gen_first(q);
}

