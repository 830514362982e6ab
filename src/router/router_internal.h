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

/* ---- policy.c ---- */

/* A round-robin pool of worker base URLs (spec §1.1 RoundRobin). urls borrowed. */
struct rt_pool {
    const char *const *urls;
    int n;
    unsigned next;
};
/* The next index; if it equals exclude (>= 0) and n > 1 the one after. -1 when n == 0. */
int rt_pool_pick(struct rt_pool *p, int exclude);

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
