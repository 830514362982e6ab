/*
 * Loop-thread state of the HTTP server, shared by its translation units (not a public API):
 *
 *   server.c    routing table, start/stop (http_serve, http_server_stop) on an http_listener
 *   listener.c  the generic listener shared with the router (bind, limits, signals; listener.h)
 *   reply.c     plain replies: JSON bodies, OpenAI error JSON, status counters (the worker's
 *               reply context srv.reply; the router has its own)
 *   gen.c       generation requests: engine thread -> loop queue, event handling, SSE
 *               backpressure, client disconnects (the struct gen lifecycle drawn there)
 *   handlers.c  route handlers: completions/chat (parse -> render -> tokenize -> submit),
 *               tokenize, detokenize, models, metrics, server_info, /kv_events (poll form)
 *   kv_stream.c GET /kv_events as a Server-Sent-Events stream (see kv_endpoints.h)
 *
 * Everything here is touched only by the loop thread, except srv.qstack / srv.closed /
 * srv.pushing (atomics, engine threads too) and srv.wake (signalled from engine threads).
 */
#ifndef KV_HTTP_SERVER_INTERNAL_H
#define KV_HTTP_SERVER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include <event2/event.h>
#include <event2/http.h>

#include "http.h"
#include "http_internal.h"
#include "listener.h"
#include "wake.h"

struct gen;
struct kvsub;

struct server {
    /* engine events (struct qev) for the loop: a lock-free stack (the engine pushes, the loop
     * takes all, oldest first), so the loop never waits for a lock an engine thread holds
     * (gen.c, wake.h) */
    struct wake_stack qstack;
    struct loop_wake *wake;       /* signalled by a push onto an empty stack (wake.h) */
    atomic_bool closed;           /* engine events are dropped after the loop ended */
    atomic_int pushing;           /* engine threads inside engine_cb (shutdown waits for 0) */
    /* loop-thread state */
    struct event_base *base;
    struct evhttp *http;
    const struct http_config *cfg;
    engine_t *e;
    const model_t *m;
    const tokenizer_t *t;
    const char *model_name;
    struct oai_limits lim;
    char worker_id[160];          /* X-Kvserve-Worker header value */
    struct gen *live;             /* generation requests not yet terminal */
    int n_live;
    struct kvsub *subs;           /* /kv_events stream subscribers */
    int n_subs;
    bool stopping;
    struct http_counters ctr;
    struct http_reply_ctx reply;  /* -> ctr, X-Kvserve-Worker: worker_id (static init) */
    struct http_listener *listener;
    uint64_t id_counter;
    kv_rng rng;
};
/* One server per process (defined in server.c); every file of the server calls it srv. */
extern struct server http_srv;
#define srv http_srv

/* ---- reply.c (all answer req and count the status into srv.reply; listener.h has the
 * instance forms http_reply_*) ---- */
void http_count_status(int status);
void http_common_headers(struct evhttp_request *req, const char *ctype);
void http_send_body(struct evhttp_request *req, int status, const char *ctype, const char *body,
                    size_t len);
void http_send_json_str(struct evhttp_request *req, int status, const char *s);
/* Steals o (NULL -> 500 out of memory). */
void http_send_json(struct evhttp_request *req, int status, json_t *o);
void http_send_error(struct evhttp_request *req, const struct oai_error *e);
void http_send_errf(struct evhttp_request *req, int status, const char *type, const char *param,
                    const char *code, const char *msg);

/* ---- gen.c ---- */
/* Handles POST /v1/completions and /v1/chat/completions; the request is answered (now, or
 * later from the engine events). r and ids are borrowed. */
void gen_start(struct evhttp_request *req, const struct oai_request *r, const int32_t *ids,
               size_t n);
/* Answers every live generation not yet answered with e (streams: an error event and
 * [DONE]) and cancels it in the engine (the drain timeout). */
void gen_fail_all(const struct oai_error *e);
/* Shutdown after the loop: drops queued events and unhooks the connections of live gens. */
void gen_shutdown(void);
/* The wake event's callback (engine events -> handlers). */
void gen_on_wake(void *arg);

/* ---- server.c ---- */
/* The drain ended (no live generation left while stopping): closes the /kv_events streams and
 * the listening socket and ends the loop once the last bytes are out. Idempotent. */
void server_drained(void);
/* While stopping: server_drained() once no generation is live, none is being prepared and no
 * KV offer waits for its generation worker (polled every 50 ms; after the drain timeout the
 * offers are not waited for: engine_stop cancels them). Loop thread only. */
void server_maybe_drained(void);
/* True once the drain time is over (the remaining requests are being failed) or it ended:
 * a request whose preparation finishes then is answered 503 instead of started. */
bool server_drain_failing(void);

/* ---- access.c ---- */
/* API keys and CORS for one request, before routing: adds the CORS headers for an allowed
 * Origin, answers preflights (OPTIONS) and plain OPTIONS, and answers 401 (OpenAI error JSON,
 * code invalid_api_key) when keys are configured and the request has none of them on a route
 * other than /health, /ready and /metrics. Returns true when req was answered. */
bool access_check(struct evhttp_request *req, const char *path);

/* ---- prep.c: request preparation (parse, render, tokenize) on worker threads ---- */
#define PREP_MAX_THREADS 16
enum prep_what { PREP_GENERATE, PREP_PROBE, PREP_TOKENIZE };
/* Starts n_threads workers (1..PREP_MAX_THREADS); KV_ENOMEM. After srv.base/t/lim are set. */
kv_status prep_init(int n_threads);
/* Moves req's body into a job for a worker; the request is answered later on the loop
 * thread (error JSON, gen_start, or the /tokenize reply). kind: the endpoint (PREP_PROBE
 * decides between completion and chat from the body). */
void prep_submit(struct evhttp_request *req, enum prep_what what, enum oai_kind kind);
/* Jobs submitted and not answered yet. */
int prep_pending(void);
/* Stops and joins the workers; drops unanswered jobs (after the loop ended). */
void prep_shutdown(void);

/* ---- handlers.c ---- */
void handle_generate(struct evhttp_request *req, enum oai_kind kind);
void handle_tokenize(struct evhttp_request *req);
void handle_detokenize(struct evhttp_request *req);
void handle_models(struct evhttp_request *req);
/* GET /v1/models/{id} (id: the rest of the path, percent-decoded). */
void handle_model(struct evhttp_request *req, const char *id);
void handle_metrics(struct evhttp_request *req);
void handle_server_info(struct evhttp_request *req);
/* POST /kv_probe: the cached prefix of a completions/chat body (docs/disaggregation.md). */
void handle_kv_probe(struct evhttp_request *req);
/* POST /kv_release {"disagg_request_id": N}: a context worker drops the KV it holds for N
 * (docs/disaggregation.md). */
void handle_kv_release(struct evhttp_request *req);
/* GET /kv_events: ?poll=1 -> one JSON answer; otherwise kvstream_start. */
void handle_kv_events(struct evhttp_request *req);

/* ---- kv_stream.c ---- */
/* Creates the stream machinery and registers the engine's push (engine_set_kv_notify);
 * KV_ENOMEM. Call once the loop and engine are set. */
kv_status kvstream_init(void);
/* Turns req into an SSE stream of KV events (query already validated by the caller:
 * has_after/after = the resume point). Answers errors itself. */
void kvstream_start(struct evhttp_request *req, bool has_after, uint64_t after);
/* Ends every stream (shutdown: the final chunk is queued, then the subscriber is freed) and
 * unregisters the engine's push. Idempotent. */
void kvstream_close_all(void);

#endif
