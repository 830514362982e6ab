/*
 * gen: the lifecycle of a generation request (POST /v1/completions, /v1/chat/completions)
 * once its prompt is tokenized, and the engine-thread -> loop-thread event queue.
 *
 *   gen_start: engine_submit --ok--> LIVE (closecb set on the connection;
 *            stream: headers + first chunk sent at once)
 *   engine thread: engine_cb copies each event onto srv.qstack (a wake_stack: lock-free) and
 *         signals srv.wake when it was empty (wake.h: an eventfd, no lock shared with the loop)
 *   loop: gen_on_wake drains -> DELTA: stream chunk / accumulate;  FINISH|ERROR (terminal,
 *         one per choice): the last one writes the final answer (an ERROR of any choice
 *         answers at once with the error and cancels the other choices: `ended`).
 *         The gen is freed ONLY when every choice's terminal event has arrived AND the answer
 *         is finished (sent, flushed, or the client is gone): gen_maybe_free.
 *   closecb (client gone): mark, engine_cancel; the evhttp_request is then detached from its
 *         connection (libevent hands it to us) and is freed with evhttp_request_free when the
 *         gen is freed; if libevent finishes the request itself (on_complete), we forget it.
 *   watch (every GEN_WATCH_MS while a gen is live): a client that left while nothing is
 *         written to it is seen by no callback (libevent does not read a connection whose
 *         non-stream answer is computed; a stream's FIN looks like a half-close): the watch
 *         peeks a non-stream request (http_gate_client_gone) and cancels it, and sends a
 *         half-closed stream one SSE comment to draw a reset, so a request whose client left during a
 *         long prefill, a wait for KV blocks or a KV transfer is cancelled at the engine's next
 *         step boundary instead of running to its first token (docs/disaggregation.md).
 *   drain timeout (server.c): gen_fail_all answers every unfinished request with the 503
 *         error (streams: an error event and [DONE]) and cancels it; finish_reason
 *         "cancelled" never reaches a client.
 *
 * n > 1: the engine forks the request into n choices (engine.h); events carry the choice
 * index; a stream interleaves the choices' chunks (each with its index and its own final
 * chunk), then the usage chunk and [DONE] after the last choice.
 *
 * Backpressure (streams): one chunk in flight per request; later output accumulates in
 * g->pending and goes out when the previous chunk was written.
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/keyvalq_struct.h>

#include "conn_gate.h"
#include "server_internal.h"

/* One engine event copied for the loop thread; payload arrays live in the same block. */
struct qev {
    struct wake_node node;   /* srv.qstack (wake.h) */
    struct gen *g;
    struct engine_event ev;
    bool embedded; /* the gen's terminal slot: not freed separately */
    void *payload; /* a terminal slot's owned payload (text, ids, logprobs, top, message); NULL for
                      a delta, whose payload follows it in its own block */
};

/* Per-choice state (gen.ch[index]). */
struct gen_choice {
    kv_buf text;                  /* non-stream: accumulated text */
    json_t *lp;                   /* non-stream: accumulated logprobs */
    size_t lp_offset;
    enum finish_reason finish;
    int completion_tokens;
    bool done;                    /* its terminal event arrived */
    uint64_t t_first_ns;
    gram_tool_stream_t *tools;    /* tool-call extraction of this choice (toolcalls.c); NULL = none */
    struct qev term;              /* terminal-event slot (never lost to malloc failure) */
};

struct gen {
    struct gen *prev, *next;      /* live list */
    struct evhttp_request *req;   /* NULL once libevent owns/freed it */
    struct evhttp_connection *conn; /* NULL once closed or our closecb removed */
    bool detached;                /* req detached from its connection: we must free it */
    bool client_gone;
    bool peek_gone;               /* the watch saw the client gone (peer_closed), cancelled */
    bool probed;                  /* stream: an SSE comment went out to a client whose input
                                     ended, to draw its reset if it closed its socket */
    bool stream, include_usage, started, tokens_as_ids;
    enum oai_kind kind;
    uint64_t eid;
    char id[48];
    int64_t created;
    bool want_lp;
    int n, n_done;                /* choices; terminal events received */
    struct gen_choice *ch;        /* (n), allocated with the gen */
    bool ended;                   /* the answer is written (or being flushed) or failed: later
                                     events are only counted */
    bool failed;                  /* answered with an error */
    int prompt_tokens, cached_tokens;
    uint64_t t_arrival_ns, t_admitted_ns;
    /* backpressure: one chunk in flight; more output waits in pending */
    bool inflight;
    kv_buf pending;
    bool end_after_flush;
    /* disaggregated serving */
    bool probe;                   /* /kv_probe: answer {prompt_tokens, cached_tokens} */
    enum oai_disagg_type dtype;
    uint64_t disagg_id;
    bool context_first;
    int32_t *prompt_ids;          /* context leg: owned copy, echoed as prompt_token_ids */
    size_t n_prompt_ids;
    int32_t first_id;             /* context leg: the first generated token */
    bool has_first;
    struct token_logprob first_lp, first_top[20];
    int n_first_top;
    bool has_first_lp;
    /* tool calls extracted from the output (toolcalls.c, per choice) */
    int tool_fmt, max_calls;
};


/* ------------------------------------------------------------------ gen lifecycle */

static void gen_free(struct gen *g) {
    if (g->prev) g->prev->next = g->next;
    else srv.live = g->next;
    if (g->next) g->next->prev = g->prev;
    srv.n_live--;
    for (int i = 0; i < g->n; i++) {
        kv_buf_free(&g->ch[i].text);
        json_decref(g->ch[i].lp);
        gram_tool_stream_free(g->ch[i].tools);
    }
    kv_buf_free(&g->pending);
    free(g->prompt_ids);
    free(g);
    server_maybe_drained();
}

/* Releases our hold on the connection/request before a final write or free. */
static void gen_unhook(struct gen *g) {
    if (g->conn) evhttp_connection_set_closecb(g->conn, NULL, NULL);
    g->conn = NULL;
    if (g->req) evhttp_request_set_on_complete_cb(g->req, NULL, NULL);
}

/* Frees g once every choice ended and the answer is finished (or the client is gone). */
static void gen_maybe_free(struct gen *g) {
    if (g->n_done < g->n) return;
    if (g->req && !g->client_gone) return; /* an answer still to finish (stream flushing) */
    if (g->req && g->detached) evhttp_request_free(g->req);
    g->req = NULL;
    gen_unhook(g);
    gen_free(g);
}

static void on_close(struct evhttp_connection *conn, void *arg) {
    struct gen *g = arg;
    (void)conn;
    g->conn = NULL;
    if (!g->client_gone && !g->peek_gone) srv.ctr.client_disconnects++; /* counted once */
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
    if (g->n_done < g->n) engine_cancel(srv.e, g->eid);
    if (g->end_after_flush) { /* the answer was complete: nothing more will be written */
        if (g->req && g->detached) evhttp_request_free(g->req);
        g->req = NULL;
        gen_maybe_free(g);
    }
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
        gen_maybe_free(g);
    }
}

static void stream_start(struct gen *g) {
    http_count_status(200);
    http_common_headers(g->req, "text/event-stream");
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
    m->index = 0;
}

/* Is the client of a non-stream request gone? (conn_gate.h: a reset, or an end of input that
 * is not a half-close; a half-closed client still reads the answer.) */
static bool peer_closed(struct gen *g) {
    return g->conn && http_gate_client_gone(g->conn);
}

static int engine_err_status(kv_status st) {
    switch (st) {
    case KV_EINVAL: case KV_ETOOLONG: return 400;
    case KV_EBUSY: case KV_ECANCELLED: return 503;
    default: return 500;
    }
}

static char *ctx_response_add_params(const struct gen *g, const char *body, bool offered);

/* Answers g with e now (stream: an error event and [DONE]; else the HTTP status of e) and
 * cancels the choices still running. Later events are only counted. */
static void gen_fail(struct gen *g, const struct oai_error *e) {
    g->ended = g->failed = true;
    if (g->n_done < g->n) engine_cancel(srv.e, g->eid);
    if (g->client_gone || !g->req) {
        gen_maybe_free(g);
        return;
    }
    if (g->stream) {
        resp_error_sse(&g->pending, e);
        kv_buf_puts(&g->pending, "data: [DONE]\n\n");
        g->end_after_flush = true;
        flush_pending(g); /* frees g when flushed and every choice ended */
        return;
    }
    struct evhttp_request *req = g->req;
    gen_unhook(g);
    g->req = NULL;
    if (g->peek_gone) { /* written only so libevent cleans up: no client reads it, not a 5xx of ours */
        struct http_reply_ctx quiet = srv.reply;
        quiet.ctr = NULL;
        http_reply_error(&quiet, req, e);
    } else {
        http_send_error(req, e);
    }
    gen_maybe_free(g);
}

void gen_fail_all(const struct oai_error *e) {
    struct gen *g = srv.live;
    while (g) {
        struct gen *next = g->next; /* gen_fail may free g */
        if (!g->ended) gen_fail(g, e);
        g = next;
    }
}

/* Latency histograms of a request whose choices all finished (metrics.c). */
static void observe_latency(const struct gen *g) {
    struct http_latency *l = &srv.ctr.lat;
    uint64_t now = kv_now_ns(), first = 0;
    for (int i = 0; i < g->n; i++) {
        const struct gen_choice *c = &g->ch[i];
        if (c->t_first_ns && (!first || c->t_first_ns < first)) first = c->t_first_ns;
        if (c->t_first_ns && c->completion_tokens > 1)
            metrics_observe(l, MH_TPOT, (double)(now - c->t_first_ns) / 1e9 / (c->completion_tokens - 1));
        if (c->finish == FINISH_LENGTH) l->finished_length++;
        else if (c->finish == FINISH_STOP) l->finished_stop++;
    }
    if (!g->t_arrival_ns) return;
    if (first >= g->t_arrival_ns) metrics_observe(l, MH_TTFT, (double)(first - g->t_arrival_ns) / 1e9);
    if (g->t_admitted_ns >= g->t_arrival_ns)
        metrics_observe(l, MH_QUEUE, (double)(g->t_admitted_ns - g->t_arrival_ns) / 1e9);
    metrics_observe(l, MH_E2E, (double)(now - g->t_arrival_ns) / 1e9);
}

/* The usage of the whole answer: completion tokens summed over the choices. */
static struct resp_usage usage_of(const struct gen *g) {
    struct resp_usage u = {g->prompt_tokens, 0, g->cached_tokens};
    for (int i = 0; i < g->n; i++) u.completion_tokens += g->ch[i].completion_tokens;
    return u;
}

static void stream_event(struct gen *g, struct gen_choice *c, int index,
                         const struct engine_event *ev, bool terminal) {
    struct resp_meta m;
    meta_of(g, &m);
    m.index = index;
    json_t *lp = NULL;
    if (g->want_lp && ev->logprobs && ev->n_ids > 0) {
        lp = resp_logprobs_new(g->kind);
        resp_logprobs_append(lp, g->kind, srv.t, g->tokens_as_ids, ev->logprobs, ev->top,
                             ev->n_ids, ev->n_top, &c->lp_offset);
    }
    const char *fin = terminal ? finish_reason_str(ev->finish) : NULL;
    if (c->tools) {
        const char *mk = ev->n_ids > 0 && ev->ids ? tools_marker_text(srv.t, g->tool_fmt, ev->ids[0]) : NULL;
        if (mk)
            tools_stream_event(c->tools, &g->pending, &m, mk, strlen(mk), NULL, NULL, g->tool_fmt, g->max_calls,
                               &srv.rng);
        tools_stream_event(c->tools, &g->pending, &m, ev->text, ev->text_len, lp, fin, g->tool_fmt, g->max_calls,
                           &srv.rng);
    } else if (g->kind == OAI_CHAT) {
        /* content (and its logprobs) first; the finish chunk has delta {} (OpenAI) */
        if (ev->text_len > 0 || lp)
            resp_chunk_sse(&g->pending, &m, NULL, ev->text ? ev->text : "", ev->text_len, lp, NULL);
        if (fin) resp_chunk_sse(&g->pending, &m, NULL, NULL, 0, NULL, fin);
    } else if (ev->text_len > 0 || lp || fin) {
        resp_chunk_sse(&g->pending, &m, NULL, ev->text ? ev->text : "", ev->text_len, lp, fin);
    }
    if (terminal && g->n_done == g->n) {
        if (g->include_usage) {
            struct resp_usage u = usage_of(g);
            resp_usage_sse(&g->pending, &m, &u);
        }
        kv_buf_puts(&g->pending, "data: [DONE]\n\n");
        g->end_after_flush = true;
        g->ended = true;
        observe_latency(g);
    }
    flush_pending(g);
}

static void finish_full(struct gen *g) {
    struct resp_meta m;
    meta_of(g, &m);
    struct resp_usage u = usage_of(g);
    char *body;
    if (g->probe) {
        json_t *po = json_pack("{s:i, s:i}", "prompt_tokens", g->prompt_tokens, "cached_tokens",
                               g->cached_tokens);
        body = po ? json_dumps(po, JSON_COMPACT) : NULL;
        json_decref(po);
    } else {
        struct resp_choice rc[ENGINE_MAX_CHOICES];
        for (int i = 0; i < g->n; i++) {
            struct gen_choice *c = &g->ch[i];
            rc[i] = (struct resp_choice){c->text.data, c->text.len, c->lp, finish_reason_str(c->finish)};
            c->lp = NULL; /* stolen */
        }
        body = resp_full_json_n(&m, rc, g->n, &u);
        for (int i = 0; body && i < g->n; i++)
            if (g->ch[i].tools) {
                char *b2 = tools_rewrite_body(g->ch[i].tools, body, i, g->ch[i].text.data, g->ch[i].text.len,
                                              g->tool_fmt, g->max_calls, &srv.rng);
                free(body);
                body = b2;
            }
        if (body && g->dtype == OAI_DISAGG_CONTEXT_ONLY) {
            /* the KV stays offered unless the request ended here in context first */
            bool offered = g->ch[0].finish == FINISH_NOT_FINISHED || !g->context_first;
            char *b2 = ctx_response_add_params(g, body, offered);
            free(body);
            body = b2;
        }
    }
    observe_latency(g);
    g->ended = true;
    struct evhttp_request *req = g->req;
    gen_unhook(g);
    g->req = NULL;
    if (body) http_send_json_str(req, 200, body);
    else http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
    free(body);
    gen_maybe_free(g);
}

static void handle_event(struct gen *g, const struct engine_event *ev) {
    bool terminal = ev->type != ENGINE_EV_DELTA;
    int index = ev->index >= 0 && ev->index < g->n ? ev->index : 0;
    struct gen_choice *c = &g->ch[index];
    if (terminal && !c->done) {
        c->done = true;
        g->n_done++;
    }
    if (g->client_gone || !g->req || g->ended) {
        if (terminal) gen_maybe_free(g);
        return;
    }
    if (ev->type == ENGINE_EV_ERROR || (terminal && ev->finish == FINISH_CANCELLED)) {
        /* an engine error, or a cancel the client did not ask for (it never sees
         * finish_reason "cancelled"): the whole answer fails */
        struct oai_error e;
        if (ev->type == ENGINE_EV_ERROR)
            oai_errf(&e, engine_err_status(ev->status), ev->status == KV_EINVAL || ev->status == KV_ETOOLONG
                     ? "invalid_request_error" : "server_error", NULL,
                     ev->status == KV_ETOOLONG ? "context_length_exceeded" : NULL, "%s",
                     ev->message && *ev->message ? ev->message : kv_status_str(ev->status));
        else
            oai_errf(&e, 503, "server_error", NULL, NULL, "the request was cancelled by the server");
        gen_fail(g, &e);
        return;
    }
    /* DELTA or FINISH (FINISH may carry the last held-back text) */
    if (!c->t_first_ns && ev->t_first_token_ns) c->t_first_ns = ev->t_first_token_ns;
    if (terminal) {
        c->finish = ev->finish;
        c->completion_tokens = ev->completion_tokens;
        g->prompt_tokens = ev->prompt_tokens;
        if (index == 0) {
            g->cached_tokens = ev->cached_tokens;
            g->t_arrival_ns = ev->t_arrival_ns;
            g->t_admitted_ns = ev->t_admitted_ns;
        }
    }
    if (g->stream) {
        stream_event(g, c, index, ev, terminal);
        return;
    }
    if (g->dtype == OAI_DISAGG_CONTEXT_ONLY && !g->has_first && ev->n_ids > 0 && ev->ids) {
        g->has_first = true;
        g->first_id = ev->ids[0];
        if (ev->logprobs) {
            g->has_first_lp = true;
            g->first_lp = ev->logprobs[0];
            g->n_first_top = ev->top ? (ev->n_top < 20 ? ev->n_top : 20) : 0;
            for (int i = 0; i < g->n_first_top; i++) g->first_top[i] = ev->top[i];
        }
    }
    const char *mk = c->tools && ev->n_ids > 0 && ev->ids ? tools_marker_text(srv.t, g->tool_fmt, ev->ids[0]) : NULL;
    if (mk) kv_buf_puts(&c->text, mk);
    if (ev->text_len) kv_buf_append(&c->text, ev->text, ev->text_len);
    if (g->want_lp && ev->logprobs && ev->n_ids > 0)
        resp_logprobs_append(c->lp, g->kind, srv.t, g->tokens_as_ids, ev->logprobs, ev->top,
                             ev->n_ids, ev->n_top, &c->lp_offset);
    if (!terminal) return; /* a client gone meanwhile is seen by the watch */
    if (g->n_done == g->n) finish_full(g);
}

/* Context leg: adds choices[0].disaggregated_params (docs/disaggregation.md) to the body.
 * Returns a new heap string, or NULL on ENOMEM. */
static char *ctx_response_add_params(const struct gen *g, const char *body, bool offered) {
    /* JSON_ALLOW_NUL: the text may hold U+0000 (a <0x00> byte token), which our JSON carries */
    json_t *o = json_loads(body, JSON_ALLOW_NUL, NULL);
    json_t *ch = o ? json_array_get(json_object_get(o, "choices"), 0) : NULL;
    json_t *d = json_object();
    json_t *ids = json_array();
    if (!ch || !d || !ids) goto oom;
    for (size_t i = 0; i < g->n_prompt_ids; i++) json_array_append_new(ids, json_integer(g->prompt_ids[i]));
    const struct http_config *c = srv.cfg;
    json_object_set_new(d, "request_type", json_string("context_only"));
    json_object_set_new(d, "disagg_request_id", json_integer((json_int_t)g->disagg_id));
    json_object_set_new(d, "ctx_request_id", json_integer((json_int_t)g->eid));
    json_object_set_new(d, "schedule_style",
                        json_string(g->context_first ? "context_first" : "generation_first"));
    json_object_set_new(d, "first_gen_tokens",
                        g->has_first ? json_pack("[i]", g->first_id) : json_array());
    json_object_set_new(d, "prompt_token_ids", ids);
    json_object_set_new(d, "kv_offered", json_boolean(offered));
    ids = NULL;
    if (c && c->kv_endpoint) json_object_set_new(d, "ctx_info_endpoint", json_string(c->kv_endpoint));
    if (c && c->kv_transport) json_object_set_new(d, "kv_transport", json_string(c->kv_transport));
    if (c && c->kv_pool_json) {
        json_t *pool = json_loads(c->kv_pool_json, 0, NULL);
        if (pool) json_object_set_new(d, "pool", pool);
    }
    if (g->has_first_lp) {
        json_t *top = json_array();
        for (int i = 0; i < g->n_first_top; i++)
            json_array_append_new(top, json_pack("[i, f]", g->first_top[i].id,
                                                 (double)g->first_top[i].logprob));
        json_object_set_new(d, "first_gen_logprobs",
                            json_pack("{s:i, s:f, s:o}", "id", g->first_lp.id, "logprob",
                                      (double)g->first_lp.logprob, "top", top));
    }
    json_object_set_new(ch, "disaggregated_params", d);
    d = NULL;
    char *out = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return out;
oom:
    json_decref(ids);
    json_decref(d);
    json_decref(o);
    return NULL;
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
    int index = ev->index >= 0 && ev->index < g->n ? ev->index : 0;
    /* a delta and its payload are one block: the loop frees what this thread allocated (a
     * glibc arena this thread also locks), so once per event, not twice */
    struct qev *q = terminal ? &g->ch[index].term : kv_malloc(sizeof *q + sz);
    if (!q) return; /* a lost delta: the text is lost, the terminal event still comes */
    memset(q, 0, sizeof *q);
    q->embedded = terminal;
    q->g = g;
    q->ev = *ev;
    char *p = terminal ? kv_malloc(sz) : (char *)(q + 1);
    q->payload = terminal ? p : NULL; /* owned separately only by a terminal slot */
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
    atomic_fetch_add(&srv.pushing, 1); /* gen_shutdown waits for us before freeing srv.wake */
    if (atomic_load(&srv.closed)) { /* loop is gone: nobody will read this (shutdown after timeout) */
        atomic_fetch_sub(&srv.pushing, 1);
        free(q->payload);
        if (!q->embedded) free(q);
        return;
    }
    loop_wake_push(srv.wake, &srv.qstack, &q->node);
    atomic_fetch_sub(&srv.pushing, 1);
}

void gen_on_wake(void *arg) {
    (void)arg;
    for (struct wake_node *n = wake_stack_take_all(&srv.qstack), *next; n; n = next) { /* in push order */
        next = n->next;
        struct qev *q = WAKE_ITEM(n, struct qev, node);
        void *payload = q->payload;
        bool emb = q->embedded;
        handle_event(q->g, &q->ev); /* may free q->g (and the embedded q with it) */
        free(payload);
        if (!emb) free(q);
    }
}


/* ------------------------------------------------------------------ the watch */

#define GEN_WATCH_MS 50
static struct event *g_watch; /* persistent timer, pending while srv.live is not empty */

/* Every GEN_WATCH_MS: is the client of a request still being computed gone? A non-stream
 * request is peeked (http_gate_client_gone: a reset, or an end of input that draws one with an
 * interim 100 Continue); the (cancelled) answer is still sent so libevent cleans up. A stream's
 * connection is read by libevent (a reset closes it: on_close), but its end of input is held
 * as a half-close (conn_gate.h): such a stream gets one SSE comment (": \n\n", skipped by SSE
 * readers), so a closed socket answers with a reset, which the gate turns into a close. */
static void on_watch(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    (void)arg;
    for (struct gen *g = srv.live, *next; g; g = next) {
        next = g->next;
        if (g->client_gone || g->peek_gone || !g->req || !g->conn || g->ended || g->n_done == g->n)
            continue;
        if (!g->stream) {
            if (peer_closed(g)) {
                g->peek_gone = true;
                srv.ctr.client_disconnects++;
                engine_cancel(srv.e, g->eid);
            }
            continue;
        }
        if (g->started && !g->probed && http_gate_input_held(g->conn)) {
            g->probed = true;
            kv_buf_puts(&g->pending, ": \n\n");
            flush_pending(g); /* never frees g: there is pending output */
        }
    }
    if (!srv.live) event_del(g_watch);
}

static void watch_arm(void) {
    if (!g_watch) g_watch = event_new(srv.base, -1, EV_PERSIST, on_watch, NULL);
    if (!g_watch || event_pending(g_watch, EV_TIMEOUT, NULL)) return;
    struct timeval tv = {0, GEN_WATCH_MS * 1000};
    event_add(g_watch, &tv); /* a failure leaves the close callbacks, as before */
}

/* ------------------------------------------------------------------ start / shutdown */

static void make_id(char *out, size_t cap, const char *prefix) {
    uint64_t a = kv_rng_next(&srv.rng), b = kv_rng_next(&srv.rng) ^ ++srv.id_counter;
    snprintf(out, cap, "%s%016llx%08llx", prefix, (unsigned long long)a,
             (unsigned long long)(b & 0xffffffffull));
}

void gen_start(struct evhttp_request *req, const struct oai_request *r, const int32_t *ids,
               size_t n) {
    enum oai_kind kind = r->kind;
    int mml = engine_config(srv.e)->max_model_len;
    int n_ch = r->n >= 1 && r->n <= ENGINE_MAX_CHOICES && !r->probe ? r->n : 1;
    struct gen *g = kv_calloc(1, sizeof *g + (size_t)n_ch * sizeof(struct gen_choice));
    if (!g) {
        http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    g->n = n_ch;
    g->ch = (struct gen_choice *)(g + 1);
    for (int i = 0; i < n_ch; i++) kv_buf_init(&g->ch[i].text);
    kv_buf_init(&g->pending);
    g->req = req;
    g->kind = kind;
    g->stream = r->stream;
    g->include_usage = r->include_usage;
    g->tokens_as_ids = r->tokens_as_ids;
    g->want_lp = r->sp.logprobs;
    g->created = kv_unix_time();
    g->probe = r->probe;
    g->dtype = r->disagg.type;
    g->disagg_id = r->disagg.disagg_id;
    g->context_first = r->disagg.context_first;
    if (g->dtype == OAI_DISAGG_CONTEXT_ONLY) {
        g->prompt_ids = kv_malloc((n ? n : 1) * sizeof *g->prompt_ids);
        if (!g->prompt_ids) {
            free(g);
            http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
            return;
        }
        memcpy(g->prompt_ids, ids, n * sizeof *ids);
        g->n_prompt_ids = n;
    }
    make_id(g->id, sizeof g->id, kind == OAI_CHAT ? "chatcmpl-" : "cmpl-");
    if (r->so.parse_tool_calls) {
        g->tool_fmt = srv.lim.tool_fmt;
        g->max_calls = r->so.parallel_tool_calls ? 0 : 1;
        for (int i = 0; i < n_ch; i++) {
            g->ch[i].tools = gram_tool_stream_new((enum gram_tool_fmt)(g->tool_fmt ? g->tool_fmt : GRAM_TOOLS_HERMES));
            if (!g->ch[i].tools) {
                for (int k = 0; k < i; k++) gram_tool_stream_free(g->ch[k].tools);
                free(g->prompt_ids);
                free(g);
                http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
                return;
            }
        }
    }
    if (g->want_lp && !g->stream)
        for (int i = 0; i < n_ch; i++) g->ch[i].lp = resp_logprobs_new(kind);
    /* link before submit: events may arrive (on the engine thread) before submit returns,
     * but they are only handled by this loop thread, after this function. */
    g->next = srv.live;
    if (srv.live) srv.live->prev = g;
    srv.live = g;
    srv.n_live++;
    struct engine_request_params p;
    oai_engine_params(r, ids, n, mml, &p); /* p.cache_salt = r->cache_salt, copied by submit */
    if (r->probe) {
        p.disagg = ENGINE_DISAGG_PROBE;
        p.n = 1;
    }
    char err[512] = "";
    kv_status st = engine_submit(srv.e, &p, engine_cb, g, &g->eid, err, sizeof err);
    if (st) {
        g->req = NULL;
        gen_free(g);
        if (st == KV_EBUSY || st == KV_ECANCELLED)
            http_send_errf(req, 503, "server_error", NULL, NULL,
                           *err ? err : "the server is overloaded (request queue full); retry later");
        else if (st == KV_EIO) /* engine_healthy false: a sticky device error */
            http_send_errf(req, 503, "server_error", NULL, "backend_unhealthy", *err ? err : "backend unusable");
        else if (st == KV_ETOOLONG)
            http_send_errf(req, 400, "invalid_request_error", kind == OAI_CHAT ? "messages" : "prompt",
                           "context_length_exceeded", *err ? err : "the prompt is too long");
        else if (st == KV_EINVAL)
            http_send_errf(req, 400, "invalid_request_error", NULL, NULL, *err ? err : "invalid request");
        else if (st == KV_EUNSUPPORTED) /* a disaggregated leg without KV transfer, or a
                                           host-sampler feature on a device-sampling worker */
            http_send_errf(req, 400, "invalid_request_error",
                           r->disagg.type != OAI_DISAGG_NONE ? "disaggregated_params"
                           : r->n > 1 ? "n" : r->n_logit_bias ? "logit_bias" : "min_tokens", NULL,
                           *err ? err : "disaggregated serving is not enabled on this worker");
        else
            http_send_errf(req, 500, "server_error", NULL, NULL, *err ? err : kv_status_str(st));
        return;
    }
    g->conn = evhttp_request_get_connection(req);
    if (g->conn) evhttp_connection_set_closecb(g->conn, on_close, g);
    evhttp_request_set_on_complete_cb(req, on_complete_foreign, g);
    watch_arm();
    if (g->stream) {
        stream_start(g);
        if (kind == OAI_CHAT) {
            struct resp_meta m;
            meta_of(g, &m);
            for (m.index = 0; m.index < g->n; m.index++)
                resp_chunk_sse(&g->pending, &m, "assistant", "", 0, NULL, NULL);
            flush_pending(g);
        }
    }
}

void gen_cancel_all(void) {
    for (struct gen *g = srv.live; g; g = g->next) engine_cancel(srv.e, g->eid);
}

void gen_shutdown(void) {
    /* From here on engine events are dropped (gens still live after the grace period are
     * leaked on purpose: the engine may still hold their pointers). */
    atomic_store(&srv.closed, true);
    while (atomic_load(&srv.pushing) > 0) sched_yield(); /* a push under way ends at once */
    for (struct wake_node *n = wake_stack_take_all(&srv.qstack), *next; n; n = next) {
        next = n->next;
        struct qev *q = WAKE_ITEM(n, struct qev, node);
        free(q->payload);
        if (!q->embedded) free(q);
    }
    for (struct gen *g = srv.live; g; g = g->next) gen_unhook(g);
    if (g_watch) event_free(g_watch);
    g_watch = NULL;
}
