/*
 * conv_index: the conversation router's placement memory (spec seed-features.md §1.2-1.3,
 * decision 1). Pure data structure, no I/O; one per pool role; loop thread only.
 *
 *   conversations (LRU, at most max_convs):   id -> { worker, content keys k_1..k_n (n <= max_keys) }
 *   key nodes (hash map of the 64-bit key):   k_i -> { convs: how many tracked conversations hold
 *                                                       k_i, last: the latest of them }
 *
 * Content keys are chained (k_i depends on every element before it), so a key names its whole
 * prefix: the "prefix trie" of the spec is a hash map, and a new prompt's longest shared prefix
 * is the longest run of its leading keys present in the map. A node's worker is the worker of
 * the latest conversation that passed through it (-1 once that conversation is gone).
 * Keys are stored as their first 8 bytes: a collision only misplaces one request (routing is a
 * hint; the worker's block hashes decide reuse).
 */
#ifndef KV_ROUTER_CONV_INDEX_H
#define KV_ROUTER_CONV_INDEX_H

#include <stdbool.h>
#include <stdint.h>

#include "../base/base.h"

typedef struct conv_index conv_index_t;

/* max_convs >= 1 (spec default 100000), max_keys >= 1 (default 512). NULL on ENOMEM. */
conv_index_t *conv_index_new(int max_convs, int max_keys);
void conv_index_free(conv_index_t *ci);

/* The worker id was pinned to (moved to MRU), or -1 if the id is not tracked. */
int conv_index_lookup(conv_index_t *ci, const char *id);

/* Longest shared prefix of keys[0..n) with a tracked conversation whose worker passes
 * ok(worker, arg). Returns the depth in keys (0 = none) and sets *worker and *convs (the
 * number of tracked conversations holding that prefix). Nodes whose worker fails ok are
 * passed over (a shallower valid node may still match). */
int conv_index_match(conv_index_t *ci, const uint64_t *keys, int n, bool (*ok)(int worker, void *arg),
                     void *arg, int *worker, int *convs);

/* The id of the latest conversation holding keys[depth - 1] (borrowed, valid until the next
 * change), or NULL. */
const char *conv_index_match_id(const conv_index_t *ci, const uint64_t *keys, int depth);

/* Pins id to worker with keys[0..n) (n is cut to max_keys), replacing what the id had; the
 * least recently used conversation is forgotten when full. KV_ENOMEM leaves the index as it
 * was before the call minus, at worst, that id (never inconsistent). */
kv_status conv_index_pin(conv_index_t *ci, const char *id, int worker, const uint64_t *keys, int n);

/* Forgets every conversation pinned to worker (a removed or dead worker). Returns how many. */
int conv_index_forget_worker(conv_index_t *ci, int worker);

int conv_index_size(const conv_index_t *ci);
/* Conversations pinned to worker (metrics, tests). */
int conv_index_count_worker(const conv_index_t *ci, int worker);

#endif
