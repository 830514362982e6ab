/*
 * router_state: the router's loop-thread state and the request (struct rreq) shared by
 * router.c (helpers, client side, the legs and the two flows) and routes.c (the HTTP routes, * /metrics, start-up and shutdown). Not a public API; everything runs on the router's loop.
 */
#ifndef KV_ROUTER_STATE_H
#define KV_ROUTER_STATE_H

#include <event2/event.h>
#include <event2/http.h>

#include "hash/hash.h"
#include "http/listener.h"
#include "router.h"
#include "tokenizer/tokenizer.h"
#include "upstream.h"

#define RELAY_HIGH ((size_t)256 << 10) /* pause the upstream above this many unsent bytes */
#define SSE_MAX ((size_t)16 << 20)     /* one upstream event may not exceed this */

enum { UPX_PROBE = 10, UPX_INFO = 11, UPX_MODELS = 12, UPX_HEALTH = 13, UPX_EVENTS = 14, UPX_ETCD = 15,
       UPX_COORD_FINISH = 16, UPX_KV_RELEASE = 17, UPX_COORD_SELECT_BASE = 300 /* + pool */ };
enum { POOL_AGG = 0, POOL_CTX = 1, POOL_GEN = 2, POOL_N = 3 };

/* A coordinator reservation (POST /select -> POST /finish). */
struct rt_reservation {
    struct rt_reservation *next;
    char *req_id;      /* owned */
    int pool, idx;
    long tokens, work;
};
enum outcome { OUT_OK = 0, OUT_CLIENT_ERROR, OUT_UPSTREAM_ERROR, OUT_CANCELLED, OUT_N };

struct router {
    struct router_config cfg;
    struct event_base *base;
    struct http_listener *lis;
    struct http_counters ctr;
    struct http_reply_ctx reply;
    char self_id[300];
    char worker_auth[600];        /* "Authorization: Bearer <--worker-api-key>" */
    struct upstream up;
    struct rt_pool pools[POOL_N]; /* aggregated, context, generation */
    struct rt_retry_policy pol;
    tokenizer_t *tok;     /* --tokenizer, or NULL */
    kv_hash_key key;      /* --hash-key-file (or random) */
    char key_id[17];      /* kv_hash_key_id(key) */
    struct event *health; /* health-check timer */
    struct rt_reservation *resv;
    struct etcd_watch *etcd; /* discovery_etcd.c, or NULL */
    struct upx_set coord_fin; /* coordinator /finish transfers in flight (coord_client.c) */
    uint64_t coord_placements, coord_errors;
    struct upx_set rel;       /* POST /kv_release transfers in flight (kv_release.c) */
    uint64_t kv_releases[2]; /* answered 2xx, failed */
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
    uint64_t health_failures, workers_refused, worker_left_failures;
};
#define R_AGG(r) (&(r)->pools[POOL_AGG])
#define R_CTX(r) (&(r)->pools[POOL_CTX])
#define R_GEN(r) (&(r)->pools[POOL_GEN])

struct rreq {
    struct router *r;
    struct rreq *prev, *next;
    struct evhttp_request *req;     /* NULL once answered or gone */
    struct evhttp_connection *conn; /* NULL once closed or unhooked */
    struct event *kick;             /* deferred cancel after a client close */
    bool client_gone, headers_sent, saw_done, ctx_ok, counted, counted_ok;
    bool chat, stream, include_usage;
    const char *path;
    json_t *base;                   /* the client body without disaggregated_params */
    char *conv_id;
    uint64_t id;
    int gen_idx, ctx_idx, agg_idx;
    /* placement: the worker each pool charged for this request (-1 none) */
    int charged[POOL_N];
    long tokens;                    /* prompt tokens (or an estimate), the tokens load */
    long max_tokens;                /* the client's max_tokens / max_completion_tokens, 0 = none */
    long work[POOL_N];              /* the kv_aware work charged per pool (rt_leg_work) */
    uint64_t *ckeys;                /* (n_ckeys) content keys, heap */
    int n_ckeys;
    uint64_t *bh;                   /* (n_blocks) block hashes of the full prompt blocks, heap */
    int n_blocks;
    const char *served_by;          /* URL of the worker whose answer the client gets (borrowed) */
    struct rt_worker *final_worker; /* reported cached tokens are credited to it */
    int final_pool;                 /* the pool of the final leg's worker */
    struct upx *sel[POOL_N];        /* coordinator /select in flight per pool */
    int sel_pending;
    bool coord[POOL_N];             /* the coordinator reserved for this request (finish owed) */
    int retries[3];                 /* per leg kind */
    json_t *gen_body;               /* the generation leg's body (kept across retries) */
    bool kv_held;                   /* a context leg went to context worker kv_ctx under id: it may
                                       hold KV for id until a generation leg pulls it; cleared once
                                       a generation leg completed or the context kept nothing */
    int kv_ctx;
    struct upx *probe, *info, *ctx, *final;
    enum rt_leg_kind final_kind;
    kv_buf sse;                     /* upstream bytes of an incomplete SSE event */
    uint64_t last_peek_ns;
};

/* ---- router.c: placement ---- */
/* Places q in pools[pool] by its policy (not exclude when another worker is live), moving
 * q's load charge there. -1 when no worker of the pool is live. */
int rtq_place(struct rreq *q, int pool, int exclude);
/* Gives back q's load charge in pools[pool] (no-op when none). */
void rtq_release(struct rreq *q, int pool);
/* Sets q's worker in pools[pool] to idx (chosen elsewhere: the coordinator), moving its load
 * charge and counting the reason. */
void rtq_assign(struct rreq *q, int pool, int idx, enum rt_reason why);
/* routes.c: the legs of q once placed (pools whose index is still -1 are placed locally). */
void rtq_dispatch(struct rreq *q);

/* ---- coord_client.c: placement through a coordinator (--coordinator) ---- */
/* Starts q's /select calls; true when some are in flight (rtq_dispatch follows their answers). */
bool rt_coord_select(struct rreq *q);
/* Sends /finish for every reservation q holds (fire and forget). */
void rt_coord_finish(struct rreq *q);
void rt_coord_stop(struct router *r);

/* ---- routes.c ---- */
/* Fills q's routing inputs (prompt tokens, content keys, block hashes) from the client body,
 * as far as the pools' policies need them. Never fails a request (ENOMEM = no keys). */
void rtq_route_inputs(struct rreq *q, const char *body, size_t len);

/* ---- kv_release.c: POST /kv_release to a context worker (fire and forget) ---- */
/* Asks context worker ctx_idx to drop the KV it holds for id now. No-op while stopping. */
void rt_kv_release(struct router *r, int ctx_idx, uint64_t id);
void rt_kv_release_stop(struct router *r);

/* ---- workers.c: health checks, /kv_events mirrors, coordinator, worker metrics ---- */
kv_status rt_workers_start(struct router *r, char *err, size_t errlen);
void rt_workers_stop(struct router *r);
/* A worker joined (discovery) or was configured: starts its mirror when kv_aware. */
void rt_worker_joined(struct router *r, int pool, int idx);
/* A worker left (lease gone, dead, refused): forgets its conversations and predictions and
 * fails the legs in flight on it within the next maintenance tick (100 ms; safe to call from
 * inside a libcurl callback). */
void rt_worker_left(struct router *r, int pool, int idx, const char *why);
void rt_handle_select(struct router *r, struct evhttp_request *req);
void rt_handle_finish(struct router *r, struct evhttp_request *req);
kv_status rt_workers_metrics(struct router *r, kv_buf *b);
/* The seq of the last /kv_events event the worker's mirror applied (0 before any). */
uint64_t rt_worker_events_seq(const struct rt_worker *w);

/* ---- router.c: request lifetime, client side, legs, the two flows (routes.c calls these) ---- */
void rtq_client_gone(struct rreq *q);
void rtq_count_outcome(struct rreq *q, enum outcome o);
const char *rtq_curl_reason(const struct upx *u, CURLcode rc);
void rtq_fail_client(struct rreq *q, int status, const char *type, const char *code, const char *msg, enum outcome oc);
struct upx *rtq_leg_send(struct rreq *q, const struct rt_pool *pool, int idx, const char *path, const json_t *body, upx_done_fn done, int kind);
void rtq_maybe_free(struct rreq *q);
uint64_t rtq_new_id(struct router *r);
void rtq_on_close(struct evhttp_connection *conn, void *arg);
void rtq_on_complete_foreign(struct evhttp_request *req, void *arg);
void rtq_on_info_done(struct upx *u, const struct rt_outcome *o, CURLcode rc);
void rtq_on_kick(evutil_socket_t fd, short what, void *arg);
void rtq_on_tick(evutil_socket_t fd, short what, void *arg);
void rtq_rreq_free(struct rreq *q);
void rtq_send_final(struct rreq *q, enum rt_leg_kind kind, const struct rt_pool *pool, int idx, const json_t *body);
void rtq_start_context(struct rreq *q);
void rtq_start_gen_first(struct rreq *q);
struct evhttp_request *rtq_take_req(struct rreq *q);

#endif
