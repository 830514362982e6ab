/*
 * kv_mirror: the kv_aware policy's view of each worker's KV cache (spec §1.1 KvCacheAware,
 * peers.md BUG-13 / BUG-14, docs/routing.md).
 *
 *   worker /kv_events (SSE) --workers.c--> kv_mirror_apply(event) --> set of block hashes
 *   request prompt ids --kv_hash_root/kv_hash_block (same secret, tokens per block)--> bh[]
 *   held(W): walk bh[0..] while the block is in W's mirror (device 1.0 x tpb tokens, host
 *   tier 0.75 x tpb) or predicted for W (the router sent that prefix to W less than
 *   --predicted-prefix-ttl ago: 1.0 x tpb); stop at the first block W has neither way.
 *   specific(W): the held blocks no other worker holds and below no point where another
 *   placed request continued the chain differently (a shared prefix is nobody's).
 *   cost(W) = legs(W) x mean work per leg - overlap_weight x specific(W); the lowest wins
 *   (load 0 on a worker prefilling this request's prefix when that prefix >= 4 x the
 *   request's own tokens); ties more held, least loaded, round robin; with no specific
 *   block and nothing to follow: least loaded, more held, fewest sent, least work.
 *   (Dynamo's KV router cost in tokens; the spec §1.1 score matched / prompt - legs / 64
 *   piled a shared system prompt onto one worker at low concurrency, BUG-14.)
 *
 * A mirror is only as good as its stream: after a reconnect or a `lost` marker it is cleared
 * and rebuilt from what follows; a changed worker_id is a new worker (cleared). A worker whose
 * tokens_per_block, hash_scheme or hash_key_id differ from the router's is refused (never a
 * silent zero overlap). Pure data structures; loop thread only.
 */
#ifndef KV_ROUTER_KV_MIRROR_H
#define KV_ROUTER_KV_MIRROR_H

#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

#include "router_internal.h"

struct kv_mirror;
struct kv_mirror *kv_mirror_new(void);
void kv_mirror_free(struct kv_mirror *m);
void kv_mirror_clear(struct kv_mirror *m);
/* 0 = not cached, 1 = device, 2 = host tier. */
int kv_mirror_tier(const struct kv_mirror *m, uint64_t hash);
long kv_mirror_size(const struct kv_mirror *m);

/* What the router expects of every worker it mirrors. */
struct kv_mirror_expect {
    int tokens_per_block;
    const char *hash_scheme; /* KV_HASH_SCHEME */
    const char *hash_key_id; /* kv_hash_key_id of the router's --hash-key-file secret */
};

enum kv_mirror_result {
    KV_MIRROR_OK = 0,
    KV_MIRROR_RESYNC,   /* a `lost` marker or a new worker_id: the mirror was cleared */
    KV_MIRROR_END,      /* a final `lost`: the stream ends; reconnect without `after` */
    KV_MIRROR_REFUSED,  /* the start event's scheme differs: refuse the worker (reason in err) */
    KV_MIRROR_BAD,      /* not an event we understand (ignored, logged) */
};
/* Applies one /kv_events event object (docs/api.md): start (checks the scheme against ex,
 * remembers worker_id; a different worker_id than before clears), stored (+ "tier":"host"
 * -> host tier), tier (a stored block moved to "host" or back to "device"), removed,
 * cleared, lost. *last_seq advances with every seq seen. */
enum kv_mirror_result kv_mirror_apply(struct kv_mirror *m, const json_t *ev,
                                      const struct kv_mirror_expect *ex, uint64_t *last_seq,
                                      char *err, size_t errlen);
/* The worker_id of the last start event ("" before one). */
const char *kv_mirror_worker_id(const struct kv_mirror *m);

/* In-flight predictions of one pool: (block hash, worker) -> expiry; and the chains placed
 * (each block's successor, and whether a second one followed it). */
struct rt_predict;
struct rt_predict *rt_predict_new(double ttl_s);
void rt_predict_free(struct rt_predict *pr);
/* Forgets every prediction for worker (it left). */
void rt_predict_forget_worker(struct rt_predict *pr, int worker);

/* kv_aware: a worker prefilling a prefix the request shares takes it regardless of its load
 * when that in-flight prefix is at least this many times the request's own new tokens. */
#define RT_KV_FOLLOW_RATIO 4
/* kv_aware placement (the cost above); records the request's blocks as predicted for the
 * chosen worker and its chain. *predicted = held tokens there. Out of memory: least loaded. */
int rt_kv_select(struct rt_pool *p, const struct rt_route *rq, int exclude, enum rt_reason *why,
                 long *predicted);

#endif
