/*
 * kvcache: the KV pool's block bookkeeping (which blocks are free, who holds them).
 * Storage lives in the backend (backend.h); this module hands out block ids.
 *
 * Pin contract (after SQLite's pcache): kv_pool_alloc returns a block with refcount 1;
 * every kv_pool_ref needs exactly one kv_pool_release; a block returns to the free list
 * when its refcount drops to 0. Releasing a free block is a bug (assert).
 *
 * Later (reuse issue): full blocks get chained keyed hashes and stay cached at refcount 0
 * until evicted LRU.
 */
#ifndef KV_KVCACHE_H
#define KV_KVCACHE_H

#include "../base/base.h"

typedef struct kv_pool kv_pool_t;

/* n_blocks >= 1, tokens_per_block >= 1. NULL on allocation failure. */
kv_pool_t *kv_pool_new(int n_blocks, int tokens_per_block);
void kv_pool_free(kv_pool_t *p);
int kv_pool_n_blocks(const kv_pool_t *p);
int kv_pool_n_free(const kv_pool_t *p);
int kv_pool_tokens_per_block(const kv_pool_t *p);
/* Allocates one block (refcount 1). Returns the block id, or -1 if none is free. */
int kv_pool_alloc(kv_pool_t *p);
/* Allocates n blocks into out[0..n) all-or-nothing: KV_NO_SPACE and nothing allocated if
 * fewer than n are free. */
kv_status kv_pool_alloc_n(kv_pool_t *p, int n, int32_t *out);
void kv_pool_ref(kv_pool_t *p, int block);
void kv_pool_release(kv_pool_t *p, int block);
int kv_pool_refcount(const kv_pool_t *p, int block);

/* Blocks needed to hold n_tokens tokens. */
static inline int kv_blocks_for_tokens(int n_tokens, int tokens_per_block) {
    return (n_tokens + tokens_per_block - 1) / tokens_per_block;
}

#endif
