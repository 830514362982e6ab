/*
 * kv_stream: GET /kv_events as a Server-Sent-Events stream (wire format in kv_endpoints.h).
 *
 * The engine pushes: engine_set_kv_notify signals g_wake (at most once until the next read)
 * when it adds events to its ring. On the loop, fan_out reads the ring once from the shared
 * cursor, formats each event once, and appends it to every subscriber's queue; nothing runs
 * per subscriber on a timer and nothing is read while no event arrives. The engine's cost is
 * one wakeup (an eventfd write) per batch, whatever the number of subscribers.
 *
 *   subscriber: START (hello written; catch-up from `after` (or the oldest retained event)
 *               up to the cursor queued) --events--> queue --chunk written--> next chunk
 *        queue over KVS_QUEUE_MAX bytes (a reader slower than the events): the queue is
 *        dropped, a final "lost" event is queued in its place, the stream ends after it
 *        (resync: reconnect without after)
 *        the ring overflowed past the cursor (the loop fell a whole ring behind): every
 *        stream gets a final "lost" and ends
 *   client gone (closecb): subscriber freed (the detached request freed with it)
 *
 * Limits: at most http_config.max_kv_subscribers streams (503 beyond), each holding at most
 * KVS_QUEUE_MAX bytes of formatted events plus one chunk queued in libevent.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include "kv_endpoints.h"
#include "server_internal.h"

#define KVS_BATCH 256
#define KVS_QUEUE_MAX ((size_t)1 << 20)
#define KVS_KEEPALIVE_S 15
#define KVS_DEFAULT_MAX_SUBS 64

struct kvsub {
    struct kvsub *prev, *next;
    struct evhttp_request *req;     /* NULL once libevent owns/freed it */
    struct evhttp_connection *conn; /* NULL once closed */
    kv_buf q;                       /* formatted events not yet handed to libevent */
    size_t q_events;
    uint64_t queued_seq;            /* last seq in q or written */
    bool inflight;                  /* one chunk queued in libevent */
    bool ending;                    /* a final "lost" is queued: end after it */
    uint64_t last_write_ns;
};

static struct loop_wake *g_wake;  /* signalled by the engine (any thread; wake.h) */
static struct event *g_keepalive; /* persistent, while streams exist */
static uint64_t g_cursor;         /* last seq fanned out to the live subscribers */
static bool g_cursor_set;
static struct engine_kv_event *g_ev; /* (KVS_BATCH) scratch */
static int32_t *g_tok;               /* (KVS_BATCH * tokens_per_block) scratch */
static char g_wid[17];

static void sub_free(struct kvsub *s) {
    if (s->prev) s->prev->next = s->next;
    else srv.subs = s->next;
    if (s->next) s->next->prev = s->prev;
    srv.n_subs--;
    kv_buf_free(&s->q);
    free(s);
    if (srv.n_subs == 0 && g_keepalive) evtimer_del(g_keepalive);
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

static void flush(struct kvsub *s);

static void on_chunk_written(struct evhttp_connection *conn, void *arg) {
    struct kvsub *s = arg;
    (void)conn;
    s->inflight = false;
    flush(s);
}

/* Hands the queue to libevent as one chunk (one chunk in flight per subscriber). */
static void flush(struct kvsub *s) {
    if (!s->req || s->inflight) return;
    if (s->q.len == 0) {
        if (s->ending) sub_end(s);
        return;
    }
    struct evbuffer *eb = evbuffer_new();
    if (!eb || evbuffer_add(eb, s->q.data, s->q.len) != 0) {
        if (eb) evbuffer_free(eb);
        sub_end(s); /* out of memory: end the stream rather than skip events silently */
        return;
    }
    s->q.len = 0;
    s->q_events = 0;
    s->inflight = true;
    s->last_write_ns = kv_now_ns();
    evhttp_send_reply_chunk_with_cb(s->req, eb, on_chunk_written, s);
    evbuffer_free(eb);
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

/* The subscriber cannot keep up: its queued events are dropped, a final "lost" (counting
 * them and the one that did not fit) takes their place, and the stream ends after it. */
static void drop_slow(struct kvsub *s, uint64_t not_queued) {
    uint64_t after = s->queued_seq - s->q_events;
    uint64_t lost = s->q_events + not_queued;
    s->q.len = 0;
    s->q_events = 0;
    s->ending = true;
    if (put_json(&s->q, lost_json(lost, after, true)) != KV_OK) s->q.len = 0;
}

/* Appends one formatted event (seq) to s's queue, or drops a slow subscriber. */
static void enqueue(struct kvsub *s, const char *text, size_t len, uint64_t seq) {
    if (s->ending || !s->req) return;
    if (s->q.len + len > KVS_QUEUE_MAX || kv_buf_append(&s->q, text, len) != KV_OK) {
        drop_slow(s, 1);
        return;
    }
    s->q_events++;
    s->queued_seq = seq;
}

/* Formats event ev as "id: SEQ\ndata: {...}\n\n" into b (reset first). */
static kv_status format_event(kv_buf *b, const struct engine_kv_event *ev) {
    b->len = 0;
    char id[40];
    snprintf(id, sizeof id, "id: %llu\n", (unsigned long long)ev->seq);
    kv_status st = kv_buf_puts(b, id);
    if (!st) st = put_json(b, kvapi_event_json(ev, g_wid));
    return st;
}

/* Reads the ring from g_cursor and appends every new event to every live subscriber. */
static void fan_out(void) {
    kv_buf b;
    kv_buf_init(&b);
    for (;;) {
        uint64_t lost = 0;
        int n = engine_kv_events(srv.e, g_cursor, g_ev, g_tok, KVS_BATCH, &lost);
        if (lost) { /* the loop fell a whole ring behind: every stream must resync */
            for (struct kvsub *s = srv.subs; s; s = s->next)
                if (!s->ending) drop_slow(s, lost);
            g_cursor += lost;
        }
        for (int i = 0; i < n; i++) {
            g_cursor = g_ev[i].seq;
            if (!srv.subs) continue;
            if (format_event(&b, &g_ev[i]) != KV_OK) {
                for (struct kvsub *s = srv.subs; s; s = s->next)
                    if (!s->ending) drop_slow(s, 1);
                continue;
            }
            for (struct kvsub *s = srv.subs; s; s = s->next) enqueue(s, b.data, b.len, g_ev[i].seq);
        }
        if (n < KVS_BATCH) break;
    }
    kv_buf_free(&b);
    for (struct kvsub *s = srv.subs, *next; s; s = next) {
        next = s->next; /* flush may free s */
        flush(s);
    }
}

static void on_wake(void *arg) {
    (void)arg;
    /* nobody to send to: the ring is not read (the engine's lock stays with the engine, and it
     * signals no more until a read); a new subscriber's fan_out catches the cursor up */
    if (srv.subs) fan_out();
}

/* The engine thread: new events (called under the ring's lock; only signals). */
static void notify(void *arg) {
    (void)arg;
    loop_wake_signal(g_wake);
}

static void on_keepalive(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    uint64_t now = kv_now_ns();
    for (struct kvsub *s = srv.subs, *next; s; s = next) {
        next = s->next;
        if (!s->inflight && s->q.len == 0 && !s->ending &&
            now - s->last_write_ns >= (uint64_t)KVS_KEEPALIVE_S * 1000000000ull &&
            kv_buf_puts(&s->q, ": keepalive\n\n") == KV_OK)
            flush(s);
    }
}

kv_status kvstream_init(void) {
    int T = engine_config(srv.e)->tokens_per_block;
    g_ev = kv_malloc(KVS_BATCH * sizeof *g_ev);
    g_tok = kv_malloc((size_t)KVS_BATCH * (size_t)T * sizeof *g_tok);
    g_wake = loop_wake_new(srv.base, on_wake, NULL);
    g_keepalive = event_new(srv.base, -1, EV_PERSIST, on_keepalive, NULL);
    if (!g_ev || !g_tok || !g_wake || !g_keepalive) {
        kvstream_close_all();
        return KV_ENOMEM;
    }
    kvapi_worker_id(srv.e, g_wid);
    g_cursor = engine_kv_last_seq(srv.e); /* events before the server started: catch-up only */
    g_cursor_set = true;
    engine_set_kv_notify(srv.e, notify, NULL);
    return KV_OK;
}

/* Queues the events (after, g_cursor] of the ring for a new subscriber: a non-final "lost"
 * first when the ring no longer has some it asked for. */
static void catch_up(struct kvsub *s, bool has_after, uint64_t after) {
    kv_buf b;
    kv_buf_init(&b);
    uint64_t from = after;
    bool first = true;
    while (from < g_cursor && !s->ending) {
        uint64_t lost = 0;
        int n = engine_kv_events(srv.e, from, g_ev, g_tok, KVS_BATCH, &lost);
        if (lost) {
            /* without a resume point the stream starts at the oldest retained event, silently */
            if (has_after && first) {
                kv_buf lb;
                kv_buf_init(&lb);
                if (put_json(&lb, lost_json(lost, from, false)) == KV_OK)
                    enqueue(s, lb.data, lb.len, s->queued_seq);
                kv_buf_free(&lb);
            }
            from += lost;
        }
        first = false;
        for (int i = 0; i < n && g_ev[i].seq <= g_cursor; i++) {
            if (format_event(&b, &g_ev[i]) != KV_OK) {
                drop_slow(s, 1);
                break;
            }
            enqueue(s, b.data, b.len, g_ev[i].seq);
            from = g_ev[i].seq;
        }
        if (n == 0) break;
    }
    kv_buf_free(&b);
}

void kvstream_start(struct evhttp_request *req, bool has_after, uint64_t after) {
    if (srv.stopping) {
        http_send_errf(req, 503, "server_error", NULL, NULL, "the server is shutting down");
        return;
    }
    int cap = srv.cfg && srv.cfg->max_kv_subscribers > 0 ? srv.cfg->max_kv_subscribers
                                                         : KVS_DEFAULT_MAX_SUBS;
    if (srv.n_subs >= cap) {
        char msg[160];
        snprintf(msg, sizeof msg, "too many /kv_events streams (limit %d, --max-kv-subscribers)", cap);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", "1");
        http_send_errf(req, 503, "server_error", NULL, "too_many_subscribers", msg);
        return;
    }
    if (!g_wake || !g_ev || !g_tok) {
        http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    fan_out(); /* the live subscribers are at the engine's last event: so is the cursor */
    int T = engine_config(srv.e)->tokens_per_block;
    struct kvsub *s = kv_calloc(1, sizeof *s);
    kv_buf b;
    kv_buf_init(&b);
    char kid[17];
    engine_hash_key_id(srv.e, kid);
    json_t *hello = json_pack("{s:s, s:s, s:i, s:s, s:s, s:I}", "type", "start", "worker_id", g_wid,
                              "tokens_per_block", T, "hash_scheme", KV_HASH_SCHEME, "hash_key_id",
                              kid, "after", (json_int_t)after);
    if (!s || put_json(&b, hello)) {
        free(s);
        kv_buf_free(&b);
        http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    kv_buf_init(&s->q);
    s->req = req;
    s->queued_seq = after;
    s->next = srv.subs;
    if (srv.subs) srv.subs->prev = s;
    srv.subs = s;
    if (srv.n_subs++ == 0) {
        struct timeval tv = {1, 0};
        evtimer_add(g_keepalive, &tv);
    }
    http_count_status(200);
    http_common_headers(req, "text/event-stream");
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_send_reply_start(req, 200, "OK");
    s->conn = evhttp_request_get_connection(req);
    if (s->conn) evhttp_connection_set_closecb(s->conn, on_close, s);
    evhttp_request_set_on_complete_cb(req, on_complete_foreign, s);
    kv_buf_append(&s->q, b.data, b.len);
    kv_buf_free(&b);
    catch_up(s, has_after, after);
    flush(s);
}

void kvstream_close_all(void) {
    if (srv.e && g_cursor_set) engine_set_kv_notify(srv.e, NULL, NULL);
    g_cursor_set = false;
    while (srv.subs) sub_end(srv.subs);
    loop_wake_free(g_wake);
    if (g_keepalive) event_free(g_keepalive);
    g_wake = NULL;
    g_keepalive = NULL;
    free(g_ev);
    free(g_tok);
    g_ev = NULL;
    g_tok = NULL;
}
