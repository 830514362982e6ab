/*
 * evhttp server: routing, request lifecycle, engine-event queue, shutdown.
 *
 * Lifecycle of a generation request (struct gen):
 *
 *   handler: parse -> tokenize -> engine_submit --ok--> LIVE (closecb set on the connection;
 *            stream: headers + first chunk sent at once)
 *   engine thread: cb copies each event into srv.q (mutex) and event_active(srv.wake)
 *   loop: drain -> DELTA: stream chunk / accumulate;  FINISH|ERROR (terminal): final write,
 *         closecb cleared, gen freed.   The gen is freed ONLY on the terminal event.
 *   closecb (client gone): mark, engine_cancel; the evhttp_request is then detached from its
 *         connection (libevent hands it to us) and is freed with evhttp_request_free on the
 *         terminal event; if libevent finishes the request itself (on_complete), we forget it.
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
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>
#include <pthread.h>

#include "http.h"
#include "http_internal.h"
#include "kv_endpoints.h"
#include "tokenizer/prefix_cache.h"

struct gen;

/* One engine event copied for the loop thread; payload arrays live in the same block. */
struct qev {
    struct qev *next;
    struct gen *g;
    struct engine_event ev;
    bool embedded; /* the gen's terminal slot: not freed separately */
    void *payload; /* owned (text, ids, logprobs, top, message) */
};

struct gen {
    struct gen *prev, *next;      /* live list */
    struct evhttp_request *req;   /* NULL once libevent owns/freed it */
    struct evhttp_connection *conn; /* NULL once closed or our closecb removed */
    bool detached;                /* req detached from its connection: we must free it */
    bool client_gone;
    bool peek_gone;               /* non-stream: EOF seen by peer_closed, cancelled */
    bool stream, include_usage, started, tokens_as_ids;
    enum oai_kind kind;
    uint64_t eid;
    char id[48];
    int64_t created;
    kv_buf text;                  /* non-stream: accumulated text */
    json_t *lp;                   /* non-stream: accumulated logprobs */
    size_t lp_offset;
    bool want_lp;
    /* backpressure: one chunk in flight; more output waits in pending */
    bool inflight;
    kv_buf pending;
    bool end_after_flush;
    uint64_t last_peek_ns;
    struct qev term;              /* terminal-event slot (never lost to malloc failure) */
};

static struct server {
    pthread_mutex_t mu;
    struct qev *qhead, *qtail;
    struct event *wake;
    bool closed;                  /* engine events are dropped after the loop ended */
    /* loop-thread state */
    struct event_base *base;
    struct evhttp *http;
    const struct http_config *cfg;
    engine_t *e;
    const model_t *m;
    const tokenizer_t *t;
    const char *model_name;
    struct oai_limits lim;
    char worker_id[160];
    struct gen *live;
    int n_live;
    bool stopping;
    struct http_counters ctr;
    uint64_t id_counter;
    kv_rng rng;
} srv = {.mu = PTHREAD_MUTEX_INITIALIZER};

static struct event *g_stop_ev; /* set while serving; event_active'd by http_server_stop */
static pthread_mutex_t g_stop_mu = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------------ replies */

static void count_status(int status) {
    if (status >= 500) srv.ctr.http_errors_5xx++;
    else if (status >= 400) srv.ctr.http_errors_4xx++;
}

static void common_headers(struct evhttp_request *req, const char *ctype) {
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", ctype);
    evhttp_add_header(h, "X-Kvserve-Worker", srv.worker_id);
}

static void send_body(struct evhttp_request *req, int status, const char *ctype, const char *body,
                      size_t len) {
    count_status(status);
    common_headers(req, ctype);
    struct evbuffer *b = evbuffer_new();
    if (b) evbuffer_add(b, body, len);
    evhttp_send_reply(req, status, NULL, b);
    if (b) evbuffer_free(b);
}

static void send_json_str(struct evhttp_request *req, int status, const char *s) {
    send_body(req, status, "application/json", s ? s : "{}", s ? strlen(s) : 2);
}

static void send_json(struct evhttp_request *req, int status, json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) {
        send_json_str(req, 500, "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                                "\"param\":null,\"code\":null}}");
        return;
    }
    send_json_str(req, status, s);
    free(s);
}

static void send_error(struct evhttp_request *req, const struct oai_error *e) {
    char *s = resp_error_json(e);
    send_json_str(req, e->status, s);
    free(s);
}

static void send_errf(struct evhttp_request *req, int status, const char *type, const char *param,
                      const char *code, const char *msg) {
    struct oai_error e;
    oai_errf(&e, status, type, param, code, "%s", msg);
    send_error(req, &e);
}

/* ------------------------------------------------------------------ gen lifecycle */

static void gen_free(struct gen *g) {
    if (g->prev) g->prev->next = g->next;
    else srv.live = g->next;
    if (g->next) g->next->prev = g->prev;
    srv.n_live--;
    kv_buf_free(&g->text);
    kv_buf_free(&g->pending);
    json_decref(g->lp);
    free(g);
    if (srv.stopping && srv.n_live == 0) event_base_loopbreak(srv.base);
}

/* Releases our hold on the connection/request before a final write or free. */
static void gen_unhook(struct gen *g) {
    if (g->conn) evhttp_connection_set_closecb(g->conn, NULL, NULL);
    g->conn = NULL;
    if (g->req) evhttp_request_set_on_complete_cb(g->req, NULL, NULL);
}

static void on_close(struct evhttp_connection *conn, void *arg) {
    struct gen *g = arg;
    (void)conn;
    g->conn = NULL;
    if (!g->client_gone) srv.ctr.client_disconnects++;
    g->client_gone = true;
    /* The request is detached (req->evcon == NULL) if libevent hands it over to us; otherwise
     * libevent frees it right after this callback. */
    if (g->req) {
        if (evhttp_request_get_connection(g->req) == NULL) {
            g->detached = true;
            evhttp_request_set_on_complete_cb(g->req, NULL, NULL);
        } else {
            g->req = NULL;
        }
    }
    if (g->end_after_flush) { /* terminal event already handled: nothing more will come */
        if (g->req && g->detached) evhttp_request_free(g->req);
        g->req = NULL;
        gen_free(g);
        return;
    }
    engine_cancel(srv.e, g->eid);
}

/* libevent completed the request on its own (an error reply after a write failure). */
static void on_complete_foreign(struct evhttp_request *req, void *arg) {
    struct gen *g = arg;
    (void)req;
    g->req = NULL;
    if (g->conn) evhttp_connection_set_closecb(g->conn, NULL, NULL);
    g->conn = NULL;
    g->client_gone = true;
    engine_cancel(srv.e, g->eid);
}

static void flush_pending(struct gen *g);

static void on_chunk_written(struct evhttp_connection *conn, void *arg) {
    struct gen *g = arg;
    (void)conn;
    g->inflight = false;
    flush_pending(g);
}

/* Sends pending output if nothing is in flight; ends the response when asked and drained. */
static void flush_pending(struct gen *g) {
    if (!g->req || g->client_gone) return;
    if (g->inflight) return;
    if (g->pending.len > 0) {
        struct evbuffer *b = evbuffer_new();
        if (!b) return;
        evbuffer_add(b, g->pending.data, g->pending.len);
        g->pending.len = 0;
        g->inflight = true;
        evhttp_send_reply_chunk_with_cb(g->req, b, on_chunk_written, g);
        evbuffer_free(b);
        return;
    }
    if (g->end_after_flush) {
        struct evhttp_request *req = g->req;
        gen_unhook(g);
        g->req = NULL;
        evhttp_send_reply_end(req);
        gen_free(g);
    }
}

static void stream_start(struct gen *g) {
    count_status(200);
    common_headers(g->req, "text/event-stream");
    struct evkeyvalq *h = evhttp_request_get_output_headers(g->req);
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_send_reply_start(g->req, 200, "OK");
    g->started = true;
}

static void meta_of(const struct gen *g, struct resp_meta *m) {
    m->id = g->id;
    m->created = g->created;
    m->model = srv.model_name;
    m->kind = g->kind;
}

/* Is the peer of a non-stream request gone? (EOF seen by a non-consuming peek.) */
static bool peer_closed(struct gen *g) {
    if (!g->conn) return false;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0) return false;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static int engine_err_status(kv_status st) {
    switch (st) {
    case KV_EINVAL: case KV_ETOOLONG: return 400;
    case KV_EBUSY: case KV_ECANCELLED: return 503;
    default: return 500;
    }
}

static void handle_event(struct gen *g, const struct engine_event *ev) {
    bool terminal = ev->type != ENGINE_EV_DELTA;
    struct resp_meta m;
    meta_of(g, &m);
    if (g->client_gone || !g->req) {
        if (terminal) {
            if (g->req && g->detached) evhttp_request_free(g->req);
            g->req = NULL;
            gen_unhook(g);
            gen_free(g);
        }
        return;
    }
    if (ev->type == ENGINE_EV_ERROR) {
        struct oai_error e;
        oai_errf(&e, engine_err_status(ev->status), ev->status == KV_EINVAL || ev->status == KV_ETOOLONG
                 ? "invalid_request_error" : "server_error", NULL,
                 ev->status == KV_ETOOLONG ? "context_length_exceeded" : NULL, "%s",
                 ev->message && *ev->message ? ev->message : kv_status_str(ev->status));
        if (g->stream) {
            resp_error_sse(&g->pending, &e);
            kv_buf_puts(&g->pending, "data: [DONE]\n\n");
            g->end_after_flush = true;
            flush_pending(g);
        } else {
            struct evhttp_request *req = g->req;
            gen_unhook(g);
            g->req = NULL;
            send_error(req, &e);
            gen_free(g);
        }
        return;
    }
    /* DELTA or FINISH (FINISH may carry the last held-back text) */
    if (g->stream) {
        json_t *lp = NULL;
        if (g->want_lp && ev->logprobs && ev->n_ids > 0) {
            lp = resp_logprobs_new(g->kind);
            resp_logprobs_append(lp, g->kind, srv.t, g->tokens_as_ids, ev->logprobs, ev->top,
                                 ev->n_ids, ev->n_top, &g->lp_offset);
        }
        const char *fin = terminal ? finish_reason_str(ev->finish) : NULL;
        if (ev->text_len > 0 || lp || fin)
            resp_chunk_sse(&g->pending, &m, NULL, ev->text ? ev->text : "", ev->text_len, lp, fin);
        if (terminal) {
            if (g->include_usage) {
                struct resp_usage u = {ev->prompt_tokens, ev->completion_tokens, ev->cached_tokens};
                resp_usage_sse(&g->pending, &m, &u);
            }
            kv_buf_puts(&g->pending, "data: [DONE]\n\n");
            g->end_after_flush = true;
        }
        flush_pending(g);
        return;
    }
    if (ev->text_len) kv_buf_append(&g->text, ev->text, ev->text_len);
    if (g->want_lp && ev->logprobs && ev->n_ids > 0)
        resp_logprobs_append(g->lp, g->kind, srv.t, g->tokens_as_ids, ev->logprobs, ev->top,
                             ev->n_ids, ev->n_top, &g->lp_offset);
    if (!terminal) {
        /* libevent does not watch a connection while we compute a non-stream answer: peek.
         * On EOF cancel; the (cancelled) reply is still sent so libevent cleans up. */
        uint64_t now = kv_now_ns();
        if (!g->peek_gone && now - g->last_peek_ns > 50000000ull) {
            g->last_peek_ns = now;
            if (peer_closed(g)) {
                g->peek_gone = true;
                srv.ctr.client_disconnects++;
                engine_cancel(srv.e, g->eid);
            }
        }
        return;
    }
    struct resp_usage u = {ev->prompt_tokens, ev->completion_tokens, ev->cached_tokens};
    json_t *lp = g->lp;
    g->lp = NULL;
    char *body = resp_full_json(&m, g->text.data, g->text.len, lp, finish_reason_str(ev->finish), &u);
    struct evhttp_request *req = g->req;
    gen_unhook(g);
    g->req = NULL;
    if (body) send_json_str(req, 200, body);
    else send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
    free(body);
    gen_free(g);
}

/* ------------------------------------------------------------------ engine -> loop queue */

static size_t align8(size_t n) { return (n + 7) & ~(size_t)7; }

/* Engine thread: copy the event and wake the loop. Never blocks beyond the queue mutex. */
static void engine_cb(const struct engine_event *ev, void *user) {
    struct gen *g = user;
    bool terminal = ev->type != ENGINE_EV_DELTA;
    size_t n_top_all = ev->top ? (size_t)ev->n_ids * (size_t)ev->n_top : 0;
    size_t msg_len = ev->message ? strlen(ev->message) + 1 : 0;
    size_t sz = align8(ev->text_len + 1) + align8((size_t)ev->n_ids * sizeof(int32_t)) +
                (ev->logprobs ? (size_t)ev->n_ids : 0) * sizeof(struct token_logprob) +
                n_top_all * sizeof(struct token_logprob) + msg_len;
    struct qev *q = terminal ? &g->term : kv_malloc(sizeof *q);
    if (!q) return; /* a lost delta: the text is lost, the terminal event still comes */
    memset(q, 0, sizeof *q);
    q->embedded = terminal;
    q->g = g;
    q->ev = *ev;
    char *p = kv_malloc(sz);
    q->payload = p;
    q->ev.text = "";
    q->ev.text_len = 0;
    q->ev.ids = NULL;
    q->ev.logprobs = NULL;
    q->ev.top = NULL;
    q->ev.message = NULL;
    if (p) {
        char *c = p;
        memcpy(c, ev->text ? ev->text : "", ev->text_len);
        c[ev->text_len] = 0;
        q->ev.text = c;
        q->ev.text_len = ev->text_len;
        c += align8(ev->text_len + 1);
        if (ev->n_ids > 0 && ev->ids) memcpy(c, ev->ids, (size_t)ev->n_ids * sizeof(int32_t));
        q->ev.ids = (const int32_t *)c;
        c += align8((size_t)ev->n_ids * sizeof(int32_t));
        if (ev->logprobs) {
            memcpy(c, ev->logprobs, (size_t)ev->n_ids * sizeof(struct token_logprob));
            q->ev.logprobs = (const struct token_logprob *)c;
            c += (size_t)ev->n_ids * sizeof(struct token_logprob);
        }
        if (n_top_all) {
            memcpy(c, ev->top, n_top_all * sizeof(struct token_logprob));
            q->ev.top = (const struct token_logprob *)c;
            c += n_top_all * sizeof(struct token_logprob);
        }
        if (msg_len) {
            memcpy(c, ev->message, msg_len);
            q->ev.message = c;
        }
    } else if (!terminal) {
        free(q);
        return;
    }
    pthread_mutex_lock(&srv.mu);
    if (srv.closed) { /* loop is gone: nobody will read this (shutdown after timeout) */
        pthread_mutex_unlock(&srv.mu);
        free(q->payload);
        if (!q->embedded) free(q);
        return;
    }
    if (srv.qtail) srv.qtail->next = q;
    else srv.qhead = q;
    srv.qtail = q;
    event_active(srv.wake, EV_READ, 0);
    pthread_mutex_unlock(&srv.mu);
}

static void on_wake(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    pthread_mutex_lock(&srv.mu);
    struct qev *q = srv.qhead;
    srv.qhead = srv.qtail = NULL;
    pthread_mutex_unlock(&srv.mu);
    while (q) {
        struct qev *next = q->next;
        void *payload = q->payload;
        bool emb = q->embedded;
        handle_event(q->g, &q->ev); /* may free q->g (and the embedded q with it) */
        free(payload);
        if (!emb) free(q);
        q = next;
    }
}

/* ------------------------------------------------------------------ handlers */

static const char *method_name(enum evhttp_cmd_type c) {
    switch (c) {
    case EVHTTP_REQ_GET: return "GET";
    case EVHTTP_REQ_POST: return "POST";
    case EVHTTP_REQ_HEAD: return "HEAD";
    case EVHTTP_REQ_PUT: return "PUT";
    case EVHTTP_REQ_DELETE: return "DELETE";
    case EVHTTP_REQ_OPTIONS: return "OPTIONS";
    case EVHTTP_REQ_PATCH: return "PATCH";
    default: return "?";
    }
}

static kv_status parse_body(struct evhttp_request *req, enum oai_kind kind, struct oai_request *r) {
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
    struct oai_error e;
    if (oai_parse(kind, body, len, &srv.lim, r, &e)) {
        send_error(req, &e);
        return KV_EINVAL;
    }
    return KV_OK;
}

/* Prompt ids of a parsed request (chat: rendered template). *ids heap; errors answered. */
static kv_status prompt_ids(struct evhttp_request *req, const struct oai_request *r,
                            bool add_special, int32_t **ids, size_t *n) {
    if (r->ids) {
        *ids = kv_malloc(r->n_ids * sizeof **ids);
        if (!*ids) goto oom;
        memcpy(*ids, r->ids, r->n_ids * sizeof **ids);
        *n = r->n_ids;
        return KV_OK;
    }
    char *rendered = NULL;
    const char *text = r->text;
    size_t len = r->text_len;
    if (r->msgs) {
        char err[512] = "";
        kv_status st = tok_chat_render(srv.t, r->msgs, r->n_msgs, true, &rendered, err, sizeof err);
        if (st == KV_ENOMEM) goto oom;
        if (st) {
            send_errf(req, 400, "invalid_request_error", "messages", NULL,
                      *err ? err : "the messages cannot be rendered with this model's chat template");
            return KV_EINVAL;
        }
        text = rendered;
        len = strlen(rendered);
    }
    struct prefix_cache *pc = srv.cfg ? srv.cfg->prefix_cache : NULL;
    kv_status st = pc ? prefix_cache_encode(pc, text ? text : "", len, add_special, true, ids, n)
                      : tok_encode(srv.t, text ? text : "", len, add_special, true, ids, n);
    free(rendered);
    if (st) goto oom;
    return KV_OK;
oom:
    send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
    return KV_ENOMEM;
}

static void make_id(char *out, size_t cap, const char *prefix) {
    uint64_t a = kv_rng_next(&srv.rng), b = kv_rng_next(&srv.rng) ^ ++srv.id_counter;
    snprintf(out, cap, "%s%016llx%08llx", prefix, (unsigned long long)a,
             (unsigned long long)(b & 0xffffffffull));
}

static void handle_generate(struct evhttp_request *req, enum oai_kind kind) {
    if (srv.stopping) {
        send_errf(req, 503, "server_error", NULL, NULL, "the server is shutting down");
        return;
    }
    struct oai_request r;
    if (parse_body(req, kind, &r)) return;
    int32_t *ids = NULL;
    size_t n = 0;
    if (prompt_ids(req, &r, true, &ids, &n)) {
        oai_request_free(&r);
        return;
    }
    int mml = engine_config(srv.e)->max_model_len;
    if (n == 0) {
        send_errf(req, 400, "invalid_request_error", kind == OAI_CHAT ? "messages" : "prompt", NULL,
                  "the prompt is empty (no tokens)");
        goto out;
    }
    if (n >= (size_t)mml) {
        char msg[256];
        snprintf(msg, sizeof msg,
                 "This model's maximum context length is %d tokens; the prompt has %zu tokens "
                 "(at least 1 token must be left for the completion)", mml, n);
        send_errf(req, 400, "invalid_request_error", kind == OAI_CHAT ? "messages" : "prompt",
                  "context_length_exceeded", msg);
        goto out;
    }
    struct gen *g = kv_calloc(1, sizeof *g);
    if (!g) {
        send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    kv_buf_init(&g->text);
    kv_buf_init(&g->pending);
    g->req = req;
    g->kind = kind;
    g->stream = r.stream;
    g->include_usage = r.include_usage;
    g->tokens_as_ids = r.tokens_as_ids;
    g->want_lp = r.sp.logprobs;
    g->created = kv_unix_time();
    make_id(g->id, sizeof g->id, kind == OAI_CHAT ? "chatcmpl-" : "cmpl-");
    if (g->want_lp && !g->stream) g->lp = resp_logprobs_new(kind);
    /* link before submit: events may arrive (on the engine thread) before submit returns,
     * but they are only handled by this loop thread, after this function. */
    g->next = srv.live;
    if (srv.live) srv.live->prev = g;
    srv.live = g;
    srv.n_live++;
    struct engine_request_params p;
    oai_engine_params(&r, ids, n, mml, &p);
    struct evbuffer *inb = evhttp_request_get_input_buffer(req);
    size_t blen = evbuffer_get_length(inb);
    char *salt = kvapi_cache_salt(blen ? (const char *)evbuffer_pullup(inb, -1) : NULL, blen);
    p.cache_salt = salt; /* copied by engine_submit */
    char err[512] = "";
    kv_status st = engine_submit(srv.e, &p, engine_cb, g, &g->eid, err, sizeof err);
    free(salt);
    if (st) {
        g->req = NULL;
        gen_free(g);
        if (st == KV_EBUSY)
            send_errf(req, 503, "server_error", NULL, NULL,
                      *err ? err : "the server is overloaded (request queue full); retry later");
        else if (st == KV_ETOOLONG)
            send_errf(req, 400, "invalid_request_error", kind == OAI_CHAT ? "messages" : "prompt",
                      "context_length_exceeded", *err ? err : "the prompt is too long");
        else if (st == KV_EINVAL)
            send_errf(req, 400, "invalid_request_error", NULL, NULL, *err ? err : "invalid request");
        else
            send_errf(req, 500, "server_error", NULL, NULL, *err ? err : kv_status_str(st));
        goto out;
    }
    g->conn = evhttp_request_get_connection(req);
    if (g->conn) evhttp_connection_set_closecb(g->conn, on_close, g);
    evhttp_request_set_on_complete_cb(req, on_complete_foreign, g);
    if (g->stream) {
        stream_start(g);
        if (kind == OAI_CHAT) {
            struct resp_meta m;
            meta_of(g, &m);
            resp_chunk_sse(&g->pending, &m, "assistant", "", 0, NULL, NULL);
            flush_pending(g);
        }
    }
out:
    free(ids);
    oai_request_free(&r);
}

static void handle_tokenize(struct evhttp_request *req) {
    struct oai_request r;
    if (parse_body(req, OAI_TOKENIZE, &r)) return;
    int32_t *ids = NULL;
    size_t n = 0;
    if (prompt_ids(req, &r, r.add_special, &ids, &n) == KV_OK) {
        json_t *arr = json_array();
        for (size_t i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
        send_json(req, 200, json_pack("{s:o, s:I, s:i}", "tokens", arr, "count", (json_int_t)n,
                                      "max_model_len", engine_config(srv.e)->max_model_len));
        free(ids);
    }
    oai_request_free(&r);
}

static void handle_detokenize(struct evhttp_request *req) {
    struct oai_request r;
    if (parse_body(req, OAI_DETOKENIZE, &r)) return;
    char *s = NULL;
    size_t len = 0;
    kv_status st = tok_decode(srv.t, r.ids, r.n_ids, false, &s, &len);
    if (st == KV_EINVAL)
        send_errf(req, 400, "invalid_request_error", "tokens", NULL, "a token id is out of range");
    else if (st)
        send_errf(req, 500, "server_error", NULL, NULL, kv_status_str(st));
    else
        send_json(req, 200, json_pack("{s:s%}", "prompt", s, len));
    free(s);
    oai_request_free(&r);
}

static void handle_models(struct evhttp_request *req) {
    json_t *m = json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", srv.model_name, "object", "model",
                          "created", (json_int_t)kv_unix_time(), "owned_by", "kvserve",
                          "max_model_len", engine_config(srv.e)->max_model_len);
    if (m && srv.m->is_demo) {
        json_object_set_new(m, "demo", json_true());
        json_object_set_new(m, "note", json_string(
            "This is kvserve's built-in random-weight demo model: its output is meaningless. "
            "Serve a real model with `make serve MODEL=/path/to/model.gguf` or "
            "`kvserve serve --model PATH` (a GGUF file or a Hugging Face directory)."));
    }
    send_json(req, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
}

static void handle_metrics(struct evhttp_request *req) {
    struct engine_stats s;
    engine_get_stats(srv.e, &s);
    kv_buf b;
    kv_buf_init(&b);
    struct prefix_cache_stats pcs;
    struct prefix_cache *pc = srv.cfg ? srv.cfg->prefix_cache : NULL;
    if (pc) prefix_cache_get_stats(pc, &pcs);
    if (metrics_render(&b, &s, &srv.ctr, srv.model_name) ||
        (pc && metrics_render_prefix_token_cache(&b, &pcs, srv.model_name))) {
        kv_buf_free(&b);
        send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    send_body(req, 200, "text/plain; version=0.0.4; charset=utf-8", b.data ? b.data : "", b.len);
    kv_buf_free(&b);
}

static void handle_kv(struct evhttp_request *req, bool events) {
    char err[256] = "out of memory";
    const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(req);
    json_t *o = events ? kvapi_kv_events(srv.e, u ? evhttp_uri_get_query(u) : NULL, err, sizeof err)
                       : kvapi_server_info(srv.e, srv.model_name);
    if (!o) send_errf(req, events ? 400 : 500, events ? "invalid_request_error" : "server_error",
                      NULL, NULL, err);
    else send_json(req, 200, o);
}

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
        send_errf(req, 413, "invalid_request_error", NULL, "request_too_large", msg);
        return;
    }
    const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(req);
    const char *path = u ? evhttp_uri_get_path(u) : NULL;
    if (!path || !*path) path = "/";
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    KV_DEBUG("http: %s %s", method_name(cmd), path);
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(path, routes[i].path) != 0) continue;
        if (cmd != routes[i].method) {
            char msg[160];
            snprintf(msg, sizeof msg, "method %s is not allowed on %s (use %s)", method_name(cmd),
                     path, method_name(routes[i].method));
            evhttp_add_header(evhttp_request_get_output_headers(req), "Allow",
                              method_name(routes[i].method));
            send_errf(req, 405, "invalid_request_error", NULL, "method_not_allowed", msg);
            return;
        }
        switch (routes[i].id) {
        case R_COMPLETIONS: handle_generate(req, OAI_COMPLETION); return;
        case R_CHAT: handle_generate(req, OAI_CHAT); return;
        case R_MODELS: handle_models(req); return;
        case R_HEALTH: send_json_str(req, 200, "{\"status\":\"ok\"}"); return;
        case R_TOKENIZE: handle_tokenize(req); return;
        case R_DETOKENIZE: handle_detokenize(req); return;
        case R_METRICS: handle_metrics(req); return;
        case R_KV_EVENTS: handle_kv(req, true); return;
        case R_SERVER_INFO: handle_kv(req, false); return;
        }
    }
    char msg[300];
    snprintf(msg, sizeof msg, "no route for %s %.200s", method_name(cmd), path);
    send_errf(req, 404, "not_found_error", NULL, NULL, msg);
}

/* ------------------------------------------------------------------ start / stop */

static struct evhttp_bound_socket *g_bound;
static struct event *g_grace_timer;

static void on_grace(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    KV_WARN("http: %d request(s) did not finish within the shutdown grace period", srv.n_live);
    event_base_loopbreak(srv.base);
}

static void begin_stop(void) {
    if (srv.stopping) return;
    srv.stopping = true;
    KV_INFO("http: stopping (%d live request(s) cancelled)", srv.n_live);
    if (g_bound) {
        evhttp_del_accept_socket(srv.http, g_bound);
        g_bound = NULL;
    }
    for (struct gen *g = srv.live; g; g = g->next) engine_cancel(srv.e, g->eid);
    if (srv.n_live == 0) {
        event_base_loopbreak(srv.base);
        return;
    }
    struct timeval tv = {10, 0};
    g_grace_timer = evtimer_new(srv.base, on_grace, NULL);
    if (g_grace_timer) evtimer_add(g_grace_timer, &tv);
    else event_base_loopbreak(srv.base);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    (void)what;
    (void)arg;
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
    srv.stopping = false;
    memset(&srv.ctr, 0, sizeof srv.ctr);
    kv_rng_seed(&srv.rng, kv_now_ns() ^ ((uint64_t)getpid() << 32));
    const char *host = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";

    srv.base = event_base_new();
    srv.http = srv.base ? evhttp_new(srv.base) : NULL;
    srv.wake = srv.base ? event_new(srv.base, -1, 0, on_wake, NULL) : NULL;
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
    evhttp_set_flags(srv.http, EVHTTP_SERVER_LINGERING_CLOSE);
    evhttp_set_timeout(srv.http, 3600); /* a stream may wait long in the queue */
    evhttp_set_allowed_methods(srv.http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                             EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                             EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(srv.http, on_request, NULL);
    int port = cfg->port < 0 ? 8000 : cfg->port;
    g_bound = evhttp_bind_socket_with_handle(srv.http, host, (ev_uint16_t)port);
    if (!g_bound) {
        st = kv_errf(KV_EIO, err, errlen, "cannot listen on %s:%d: %s", host, port, strerror(errno));
        goto done;
    }
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
    /* From here on engine events are dropped (gens still live after the grace period are
     * leaked on purpose: the engine may still hold their pointers). */
    pthread_mutex_lock(&srv.mu);
    srv.closed = true;
    struct qev *q = srv.qhead;
    srv.qhead = srv.qtail = NULL;
    pthread_mutex_unlock(&srv.mu);
    while (q) {
        struct qev *next = q->next;
        free(q->payload);
        if (!q->embedded) free(q);
        q = next;
    }
    for (struct gen *g = srv.live; g; g = g->next) gen_unhook(g);
    if (srv.http) evhttp_free(srv.http);
    srv.http = NULL;
    g_bound = NULL;
    if (g_grace_timer) event_free(g_grace_timer);
    g_grace_timer = NULL;
    if (sigint) event_free(sigint);
    if (sigterm) event_free(sigterm);
    if (stop_ev) event_free(stop_ev);
    if (srv.wake) event_free(srv.wake);
    srv.wake = NULL;
    if (srv.base) event_base_free(srv.base);
    srv.base = NULL;
    return st;
}
