/*
 * kv_stream: GET /kv_events as a Server-Sent-Events stream (wire format in kv_endpoints.h).
 *
 * The engine has no "block stored" callback, so the loop reads its KV-event ring
 * (engine_kv_events, a short mutex hold) on a 20 ms timer that runs only while at least one
 * stream is open, and again at once whenever a subscriber's previous chunk has been written
 * (catch-up at socket speed). Nothing blocks the loop.
 *
 *   subscriber: START (first event sent) --tick / chunk written--> read ring after `after`
 *        -> events? one chunk (<= KVS_BATCH events) in flight, `after` advances
 *        -> ring dropped events it still needed? first read: non-final "lost", continue;
 *           later (a slow client fell a whole ring behind): final "lost", end of stream
 *   client gone (closecb): subscriber freed (the detached request freed with it)
 *
 * Backpressure: at most one chunk per subscriber is queued in libevent; while it is not
 * written, nothing more is read for that subscriber, so the engine's bounded ring is the
 * only buffer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include "kv_endpoints.h"
#include "server_internal.h"

#define KVS_TICK_US 20000
#define KVS_BATCH 256
#define KVS_KEEPALIVE_NS 15000000000ull

struct kvsub {
    struct kvsub *prev, *next;
    struct evhttp_request *req;     /* NULL once libevent owns/freed it */
    struct evhttp_connection *conn; /* NULL once closed */
    uint64_t after;                 /* last seq delivered (or the resume point) */
    bool has_after;                 /* the client named a resume point */
    bool first_read;
    bool inflight;                  /* one chunk queued in libevent */
    uint64_t last_write_ns;
};

static struct event *g_tick;
static struct engine_kv_event *g_ev; /* (KVS_BATCH) scratch */
static int32_t *g_tok;               /* (KVS_BATCH * tokens_per_block) scratch */
static char g_wid[17];

static void sub_free(struct kvsub *s) {
    if (s->prev) s->prev->next = s->next;
    else srv.subs = s->next;
    if (s->next) s->next->prev = s->prev;
    srv.n_subs--;
    free(s);
    if (srv.n_subs == 0 && g_tick) evtimer_del(g_tick);
}

static void sub_unhook(struct kvsub *s) {
    if (s->conn) evhttp_connection_set_closecb(s->conn, NULL, NULL);
    s->conn = NULL;
    if (s->req) evhttp_request_set_on_complete_cb(s->req, NULL, NULL);
}

/* Ends the response (after whatever is queued) and frees the subscriber. */
static void sub_end(struct kvsub *s) {
    struct evhttp_request *req = s->req;
    sub_unhook(s);
    s->req = NULL;
    if (req) evhttp_send_reply_end(req);
    sub_free(s);
}

static void on_close(struct evhttp_connection *conn, void *arg) {
    struct kvsub *s = arg;
    (void)conn;
    s->conn = NULL;
    srv.ctr.client_disconnects++;
    /* detached (libevent handed the request to us) -> ours to free; else libevent frees it */
    if (s->req && evhttp_request_get_connection(s->req) == NULL) {
        evhttp_request_set_on_complete_cb(s->req, NULL, NULL);
        evhttp_request_free(s->req);
    }
    s->req = NULL;
    sub_free(s);
}

static void on_complete_foreign(struct evhttp_request *req, void *arg) {
    struct kvsub *s = arg;
    (void)req;
    s->req = NULL;
    sub_unhook(s);
    sub_free(s);
}

static void pump(struct kvsub *s);

static void on_chunk_written(struct evhttp_connection *conn, void *arg) {
    struct kvsub *s = arg;
    (void)conn;
    s->inflight = false;
    pump(s);
}

static kv_status put_json(kv_buf *b, json_t *o) {
    char *j = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!j) return KV_ENOMEM;
    kv_status st = kv_buf_puts(b, "data: ");
    if (!st) st = kv_buf_puts(b, j);
    if (!st) st = kv_buf_puts(b, "\n\n");
    free(j);
    return st;
}

static json_t *lost_json(uint64_t lost, uint64_t after, bool final) {
    return json_pack("{s:s, s:s, s:I, s:I, s:b}", "type", "lost", "worker_id", g_wid, "lost",
                     (json_int_t)lost, "after", (json_int_t)after, "final", final);
}

/* Reads what the subscriber has not seen yet and queues it as one chunk. */
static void pump(struct kvsub *s) {
    if (!s->req || s->inflight) return;
    uint64_t lost = 0;
    int n = engine_kv_events(srv.e, s->after, g_ev, g_tok, KVS_BATCH, &lost);
    kv_buf b;
    kv_buf_init(&b);
    kv_status st = KV_OK;
    bool final = false;
    if (lost) {
        if (s->first_read && !s->has_after) {
            /* no resume point: start with the oldest retained event, silently */
        } else if (s->first_read) {
            st = put_json(&b, lost_json(lost, s->after, false));
        } else {
            st = put_json(&b, lost_json(lost, s->after, true));
            final = true;
        }
        if (n == 0) s->after += lost;
    }
    s->first_read = false;
    for (int i = 0; i < n && !st && !final; i++) {
        char id[40];
        snprintf(id, sizeof id, "id: %llu\n", (unsigned long long)g_ev[i].seq);
        st = kv_buf_puts(&b, id);
        if (!st) st = put_json(&b, kvapi_event_json(&g_ev[i], g_wid));
        s->after = g_ev[i].seq;
    }
    uint64_t now = kv_now_ns();
    if (!st && b.len == 0 && now - s->last_write_ns > KVS_KEEPALIVE_NS) st = kv_buf_puts(&b, ": keepalive\n\n");
    if (st) { /* out of memory: end the stream rather than skip events silently */
        kv_buf_free(&b);
        sub_end(s);
        return;
    }
    if (b.len > 0) {
        struct evbuffer *eb = evbuffer_new();
        if (eb) {
            evbuffer_add(eb, b.data, b.len);
            s->inflight = !final;
            s->last_write_ns = now;
            evhttp_send_reply_chunk_with_cb(s->req, eb, final ? NULL : on_chunk_written, s);
            evbuffer_free(eb);
        }
    }
    kv_buf_free(&b);
    if (final) sub_end(s);
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    for (struct kvsub *s = srv.subs, *next; s; s = next) {
        next = s->next; /* pump may free s */
        pump(s);
    }
}

void kvstream_start(struct evhttp_request *req, bool has_after, uint64_t after) {
    if (srv.stopping) {
        http_send_errf(req, 503, "server_error", NULL, NULL, "the server is shutting down");
        return;
    }
    int T = engine_config(srv.e)->tokens_per_block;
    if (!g_ev) g_ev = kv_malloc(KVS_BATCH * sizeof *g_ev);
    if (!g_tok) g_tok = kv_malloc((size_t)KVS_BATCH * (size_t)T * sizeof *g_tok);
    if (!g_tick) g_tick = event_new(srv.base, -1, EV_PERSIST, on_tick, NULL);
    struct kvsub *s = kv_calloc(1, sizeof *s);
    kv_buf b;
    kv_buf_init(&b);
    kvapi_worker_id(srv.e, g_wid);
    char kid[17];
    engine_hash_key_id(srv.e, kid);
    json_t *hello = json_pack("{s:s, s:s, s:i, s:s, s:s, s:I}", "type", "start", "worker_id", g_wid,
                              "tokens_per_block", T, "hash_scheme", KV_HASH_SCHEME, "hash_key_id",
                              kid, "after", (json_int_t)after);
    struct evbuffer *eb = evbuffer_new();
    if (!g_ev || !g_tok || !g_tick || !s || !eb || put_json(&b, hello)) {
        free(s);
        kv_buf_free(&b);
        if (eb) evbuffer_free(eb);
        http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    s->req = req;
    s->after = after;
    s->has_after = has_after;
    s->first_read = true;
    s->next = srv.subs;
    if (srv.subs) srv.subs->prev = s;
    srv.subs = s;
    if (srv.n_subs++ == 0) {
        struct timeval tv = {0, KVS_TICK_US};
        evtimer_add(g_tick, &tv);
    }
    http_count_status(200);
    http_common_headers(req, "text/event-stream");
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_send_reply_start(req, 200, "OK");
    s->conn = evhttp_request_get_connection(req);
    if (s->conn) evhttp_connection_set_closecb(s->conn, on_close, s);
    evhttp_request_set_on_complete_cb(req, on_complete_foreign, s);
    evbuffer_add(eb, b.data, b.len);
    kv_buf_free(&b);
    s->inflight = true;
    s->last_write_ns = kv_now_ns();
    evhttp_send_reply_chunk_with_cb(req, eb, on_chunk_written, s);
    evbuffer_free(eb);
}

void kvstream_close_all(void) {
    while (srv.subs) sub_end(srv.subs);
    if (g_tick) event_free(g_tick);
    g_tick = NULL;
    free(g_ev);
    free(g_tok);
    g_ev = NULL;
    g_tok = NULL;
}
