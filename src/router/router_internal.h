/*
 * router internals: the pure pieces (policy.c: round robin, delivery classes, retry rules;
 * legs.c: building and checking the JSON of each leg, SSE conversion) used by router.c and
 * the unit tests in tests/unit/router/. Not a public API.
 */
#ifndef KV_ROUTER_INTERNAL_H
#define KV_ROUTER_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

#include "../base/base.h"

/* ---- policy.c: workers, pools and the placement policies ---- */

enum rt_policy_kind { RT_POLICY_ROUND_ROBIN = 0, RT_POLICY_LEAST_LOADED, RT_POLICY_KV_AWARE, RT_POLICY_CONVERSATION };
enum rt_load_metric { RT_LOAD_REQUESTS = 0, RT_LOAD_TOKENS };
/* Why a worker was chosen (metrics: kvserve_router_placements_total{role,reason}). */
enum rt_reason {
    RT_WHY_ROUND_ROBIN = 0, /* round_robin policy, or a retry moved to the next worker */
    RT_WHY_LOAD,            /* least loaded (ties round robin) */
    RT_WHY_STICKY,          /* a known conversation_id stayed on its worker */
    RT_WHY_CONTENT,         /* a new conversation followed the longest shared content prefix */
    RT_WHY_KV,              /* kv_aware: the best overlap-minus-load score from mirrored blocks */
    RT_WHY_PREDICTED,       /* kv_aware: a prefix the router just sent there (not yet reported) */
    RT_WHY_N
};
const char *rt_reason_name(enum rt_reason r);
const char *rt_policy_name(enum rt_policy_kind k);

struct kv_mirror; /* kv_mirror.h */

/* One worker of a pool. Workers are never removed from their pool (indices stay valid for
 * legs in flight): one that leaves (etcd lease gone) is marked !present, one that fails two
 * health checks in a row !healthy, one whose block hashing differs from the router's refused.
 * Only live workers (rt_worker_live) are chosen. Loop thread only. */
struct rt_worker {
    char *url;               /* owned: base URL "http://host:port" */
    bool present;            /* configured, or registered in etcd */
    bool healthy;            /* false after 2 failed health checks in a row, until one passes */
    bool refused;            /* tokens_per_block / hash scheme / hash key differ (kv_aware) */
    int health_fails;        /* consecutive failed health checks */
    bool health_busy;        /* a health check is in flight */
    long active;             /* legs in flight (requests load) */
    long tokens;             /* prompt tokens of the legs in flight (tokens load) */
    long work;               /* kv_aware load: tokens of work in flight, per leg its prompt
                                tokens not predicted cached there + its max_tokens (capped) */
    uint64_t requests;       /* legs sent */
    uint64_t predicted_tokens, reported_tokens; /* cached prompt tokens: router's guess, worker's usage */
    char *ctx_endpoint;      /* owned: cached ctx_info_endpoint (context workers), or NULL */
    struct kv_mirror *mirror; /* kv_aware: the worker's cached blocks (owned), or NULL */
    void *watch;             /* the router's /kv_events stream state (workers.c), or NULL */
    struct upx *health_u;    /* the health check in flight, or NULL */
    char why_refused[400];
    bool why_refused_final;  /* refused for a mismatch (not merely "stream not started yet") */
    bool fail_legs;          /* it left: the router fails the legs in flight on it (next tick) */
    char why_left[400];
};
static inline bool rt_worker_live(const struct rt_worker *w) {
    return w->present && w->healthy && !w->refused;
}

typedef struct conv_index conv_index_t;
struct rt_predict;

/* A pool of workers of one role (aggregated, context or generation) and its policy. */
struct rt_pool {
    const char *role;        /* "aggregated" | "context" | "generation" (static) */
    struct rt_worker **w;    /* (n) owned */
    int n, cap;
    unsigned next;           /* round-robin cursor */
    enum rt_policy_kind policy;
    enum rt_load_metric metric;
    int min_match_keys;      /* conversation: --new-conversation-min-match-blocks / 8, rounded up; 0 = off */
    conv_index_t *conv;      /* conversation policy state (owned) or NULL */
    struct rt_predict *pred; /* kv_aware in-flight predictions (owned) or NULL */
    double overlap_weight;   /* kv_aware: --kv-overlap-weight (prefill tokens vs load tokens, 1) */
    int balance;             /* kv_aware: --kv-balance-threshold (legs beyond the least loaded; 0 = off) */
    uint64_t implicit_ids;   /* counter of implicit conversation ids */
    uint64_t reasons[RT_WHY_N];
};

/* Adds url (copied) or revives the worker that has it (present = true). Returns its index or
 * -1 on ENOMEM. A new worker starts healthy with load 0. */
int rt_pool_add(struct rt_pool *p, const char *url);
/* Index of the worker with url, or -1. */
int rt_pool_find(const struct rt_pool *p, const char *url);
/* Frees the workers (not their mirrors: the caller stops those first) and the policy state. */
void rt_pool_free(struct rt_pool *p);
int rt_pool_n_live(const struct rt_pool *p);
/* Round robin over live workers (spec §1.1 RoundRobin): the next live index; if it equals
 * exclude (>= 0) and another live worker exists, the one after. -1 when none is live. */
int rt_pool_pick(struct rt_pool *p, int exclude);
/* Least loaded live worker other than exclude (spec §1.0): minimum of the pool's metric; ties
 * go to the worker sent the fewest legs so far (keeps the shares even when a closed loop
 * leaves several idle at once, BUG-14), then round robin (tied[next % n_tied], next++). With
 * only the excluded worker live it is returned (a single worker is retried on itself). -1
 * when none is live. */
int rt_pool_least_loaded(struct rt_pool *p, int exclude);
long rt_pool_load(const struct rt_pool *p, int idx);
/* Load bookkeeping of one leg: +1 request / +tokens / +work at placement, the same back at
 * its end (each clamped at 0). */
void rt_pool_charge(struct rt_pool *p, int idx, long tokens, long work);
void rt_pool_release(struct rt_pool *p, int idx, long tokens, long work);
/* kv_aware work of one leg placed with `predicted` cached tokens (docs/routing.md): its prompt
 * tokens not predicted cached + its output allowance (max_tokens, RT_OUT_DEFAULT when the
 * request has none, at most RT_OUT_CAP). */
#define RT_OUT_DEFAULT 128
#define RT_OUT_CAP 1024
long rt_leg_work(long prompt_tokens, long predicted, long max_tokens);
/* A worker left the pool (dead, lease gone, refused): its conversations are forgotten. */
void rt_pool_worker_gone(struct rt_pool *p, int idx);

/* What the policies see of one request. */
struct rt_route {
    const char *conv_id;     /* explicit conversation id (request field / X-Conversation-Id) or NULL */
    const uint64_t *ckeys;   /* (n_ckeys) content keys (conversation policy), first 8 bytes each */
    int n_ckeys;
    const uint64_t *bh;      /* (n_blocks) block hashes of the prompt's full blocks (kv_aware) */
    int n_blocks;
    int tokens_per_block;
    long tokens;             /* prompt tokens (or an estimate) */
    uint64_t now_ns;
};

/* Places one request in pool p (not exclude, when another worker is live) by the pool's
 * policy; records the placement in the policy state (conversation pin, kv prediction) and
 * counts the reason. *predicted = cached prompt tokens the router expects there (0 if it has
 * no idea). -1 when no worker is live. KV_ENOMEM inside the policy state degrades to a
 * least-loaded choice (never fails a request). */
int rt_select(struct rt_pool *p, const struct rt_route *rq, int exclude, enum rt_reason *why,
              long *predicted);
/* Coordinator path (spec §1.3): may an id-only request be placed without content? True when
 * the id is routable (tracked, worker live, not exclude) or content placement is off. */
bool rt_conv_routable(struct rt_pool *p, const char *conv_id, int exclude);

/* What libcurl told us about one finished upstream attempt. */
struct rt_outcome {
    int curl_code;        /* CURLcode (0 = the transfer completed) */
    long http_status;     /* 0 = no status line received */
    bool request_written; /* every request byte (headers + body) went out on the socket */
    bool any_written;     /* some request byte went out */
    bool got_bytes;       /* any response byte arrived */
};

/* Spec decision 3. A failure before any request byte went out (e.g. a connect timeout) is
 * undelivered whatever its code: the worker cannot have seen anything. */
enum rt_delivery {
    RT_COMPLETED = 0,      /* a 2xx response arrived in full */
    RT_UNDELIVERED,        /* refused / not resolved / send error before the request was out */
    RT_POSSIBLY_DELIVERED, /* anything after the request was written, timeouts, any status */
};
enum rt_delivery rt_classify(const struct rt_outcome *o);

enum rt_leg_kind { RT_LEG_CONTEXT = 0, RT_LEG_GENERATION, RT_LEG_PLAIN };

struct rt_retry_policy {
    int max_retries; /* spec §2 max_retries */
    bool no_retry;   /* KVSERVE_DISAGG_NO_RETRY=1 */
};
/* May a failed attempt be retried? retries_done = retries already made for this leg;
 * streamed = a byte of this leg already reached the client.
 *  generation legs: only RT_UNDELIVERED, budget max(max_retries, 5) (decision 3, PR rules);
 *  context / plain legs (spec §2 base): never a 4xx, never after a streamed byte; server
 *  disconnects and resets (empty reply, send/recv errors) budget max(max_retries, 5), other
 *  connection errors, timeouts and 5xx max_retries. no_retry -> never. */
bool rt_should_retry(enum rt_leg_kind kind, const struct rt_outcome *o,
                     const struct rt_retry_policy *p, int retries_done, bool streamed);
const char *rt_delivery_name(enum rt_delivery d);
const char *rt_leg_name(enum rt_leg_kind k);

/* ---- legs.c (JSON; every function leaves its inputs untouched) ---- */

#define RT_MAX_ID ((1ull << 53) - 1)

/* The client body without any disaggregated_params (a new reference, NULL on ENOMEM);
 * *conv_id gets a copy of disaggregated_params.conversation_id or top-level conversation_id
 * (heap, NULL when absent). */
json_t *rt_client_base(const json_t *client, char **conv_id);
/* Context leg body: client copy with stream false, stream_options removed and
 * disaggregated_params {request_type:"context_only", disagg_request_id, schedule_style,
 * conversation_id}. NULL on ENOMEM. */
json_t *rt_context_leg(const json_t *base, uint64_t id, const char *style, const char *conv_id);
/* Checks a context response (spec §3 step 4): an object with exactly one choice whose
 * disaggregated_params holds non-null ctx_request_id and disagg_request_id. Returns that
 * params object (borrowed from resp) or NULL with a reason in err. */
const json_t *rt_context_check(const json_t *resp, char *err, size_t errlen);
/* Spec §3 step 5, reconciled with docs/disaggregation.md: the context leg already finished
 * the request iff the choice's finish_reason is neither "not_finished" nor "length", or it is
 * "length" and the completion tokens reached the client's max_tokens (our workers say
 * "length" when max_tokens was 1). */
bool rt_context_finished(const json_t *resp, const json_t *client);
/* Generation leg body, context first: base + the choice's params with request_type
 * "generation_only" (everything else copied, conversation_id set). NULL on ENOMEM. */
json_t *rt_generation_leg(const json_t *base, const json_t *ctx_params, const char *conv_id);
/* Generation leg body, generation first: base + {request_type:"generation_only",
 * schedule_style:"generation_first", disagg_request_id:id, ctx_request_id:id,
 * ctx_info_endpoint, conversation_id}. */
json_t *rt_generation_first_leg(const json_t *base, uint64_t id, const char *ctx_endpoint,
                                const char *conv_id);
/* ctx_info_endpoint of a /server_info answer (a list -> its first element); borrowed or NULL. */
const char *rt_server_info_endpoint(const json_t *info);
/* The response with disaggregated_params removed from every choice (a new reference). */
json_t *rt_strip_disagg(const json_t *resp);
/* A finished non-stream response as the equivalent SSE stream: one chunk with the whole
 * text (chat: delta role + content [+ tool_calls], then a finish chunk), a usage chunk when
 * include_usage, then data: [DONE]. Appends to out; KV_ENOMEM / KV_EINVAL (not a response). */
kv_status rt_response_to_sse(const json_t *resp, bool chat, bool include_usage, kv_buf *out);
/* /kv_probe answer -> true (prefill locally) iff prompt_tokens - cached_tokens <= max_local.
 * false for a malformed answer. */
bool rt_probe_local(const json_t *probe, long max_local);
/* An OpenAI error body {"error":{message,type,param:null,code}} (heap). */
char *rt_error_json(const char *type, const char *code, const char *msg);

/* SSE re-framing: the length of the prefix of buf[0..len) made of complete events (ending in
 * "\n\n" or "\r\n\r\n"); 0 when none is complete. */
size_t rt_sse_complete(const char *buf, size_t len);
/* Does the event block buf[0..len) contain the data: [DONE] event? */
bool rt_sse_has_done(const char *buf, size_t len);

#endif
