/*
 * router_state: the router's loop-thread state and the request (struct rreq) shared by
 * router.c (helpers, client side, the legs and the two flows) and routes.c (the HTTP routes, * /metrics, start-up and shutdown). Not a public API; everything runs on the router's loop.
 */
#ifndef KV_ROUTER_STATE_H
#define KV_ROUTER_STATE_H

#include <event2/event.h>
#include <event2/http.h>

#include "http/listener.h"
#include "router.h"
#include "upstream.h"

#define RELAY_HIGH ((size_t)256 << 10) /* pause the upstream above this many unsent bytes */
#define SSE_MAX ((size_t)16 << 20)     /* one upstream event may not exceed this */

enum { UPX_PROBE = 10, UPX_INFO = 11, UPX_MODELS = 12 };
enum outcome { OUT_OK = 0, OUT_CLIENT_ERROR, OUT_UPSTREAM_ERROR, OUT_CANCELLED, OUT_N };

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
