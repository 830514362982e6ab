/*
 * kvcache: the KV pool's block bookkeeping (which blocks are free, who holds them).
 * Storage lives in the backend (backend.h); this module hands out block ids.
 *
 * Pin contract (after SQLite's pcache): kv_pool_alloc returns a block with refcount 1;
 * every kv_pool_ref needs exactly one kv_pool_release; a block returns to the free list
 * when its refcount drops to 0. Releasing a free block is a bug (assert).
 *
 * Reuse (kv_pool_enable_reuse): full, computed blocks are registered under their chained
 * keyed hash (hash.h) and stay CACHED at refcount 0 until kv_pool_alloc needs a block:
 *
 *   FREE --alloc--> IN USE (refcount >= 1) --register--> IN USE + indexed
 *     ^                 | release to 0, not indexed      | release to 0
 *     +-----------------+                                 v
 *     +<--evict (LRU, no host tier)-- CACHED (refcount 0, in the device LRU)
 *                                         | evict with a host tier: bytes copied to a host
 *                                         v slot (HOST, in the host LRU), device block reused
 *   kv_pool_acquire: CACHED -> IN USE; HOST -> a fresh device block + a host->device copy.
 *
 * Pin contract: a block with refcount >= 1 is never evicted, moved or re-registered; its
 * bytes may only be written by the holder that allocated it, and only before it is
 * registered (registered blocks are immutable). kv_pool_n_free counts free + CACHED blocks
 * (both can be handed out by kv_pool_alloc).
 *
 * Exact matching: the index maps hash -> entries, and a hit also requires the same parent
 * entry (a 64-bit uid that is never reused, or the exact extra-key bytes of the root) and
 * the same token ids. A hash collision is therefore always a miss, never reuse.
 *
 * Copies: evictions to and promotions from the host tier do not move bytes; they queue
 * kv_copy_ops that the caller executes IN ORDER (through the backend) before the next
 * forward writes any block (kv_pool_pending_copies / kv_pool_clear_copies).
 */
#ifndef KV_KVCACHE_H
#define KV_KVCACHE_H

#include "../base/base.h"
#include "../hash/hash.h"

typedef struct kv_pool kv_pool_t;

/* n_blocks >= 1, tokens_per_block >= 1. NULL on allocation failure. */
kv_pool_t *kv_pool_new(int n_blocks, int tokens_per_block);
void kv_pool_free(kv_pool_t *p);
int kv_pool_n_blocks(const kv_pool_t *p);
/* Blocks kv_pool_alloc can hand out: free + CACHED (refcount 0). */
int kv_pool_n_free(const kv_pool_t *p);
int kv_pool_tokens_per_block(const kv_pool_t *p);
/* Allocates one block (refcount 1): a free one, else the least recently used CACHED one
 * (evicted, or offloaded to the host tier). Returns the block id, or -1 if none. */
int kv_pool_alloc(kv_pool_t *p);
/* Allocates n blocks into out[0..n) all-or-nothing: KV_NO_SPACE and nothing allocated if
 * fewer than n are free. */
kv_status kv_pool_alloc_n(kv_pool_t *p, int n, int32_t *out);
void kv_pool_ref(kv_pool_t *p, int block);
void kv_pool_release(kv_pool_t *p, int block);
int kv_pool_refcount(const kv_pool_t *p, int block);

/* ---- reuse (all of these require kv_pool_enable_reuse, except where noted) ---- */

/* Turns the reuse index on, with n_host_blocks host-tier slots (0 = no host tier).
 * Call once, on an empty pool. KV_ENOMEM (pool unchanged), KV_EINVAL. */
kv_status kv_pool_enable_reuse(kv_pool_t *p, int n_host_blocks);
bool kv_pool_reuse_enabled(const kv_pool_t *p);
int kv_pool_n_host_blocks(const kv_pool_t *p);
/* Uid of the chain root for these exact extra-key bytes (the tagged bytes that went into
 * kv_hash_root; len may be 0). Roots are kept LRU (4096); returns 0 on ENOMEM (no match). */
uint64_t kv_pool_root_uid(kv_pool_t *p, const void *bytes, size_t len);
/* Finds the entry following parent_uid with hash h and tokens[0..T). Returns an entry id
 * (< n_blocks: a device block; >= n_blocks: a host slot) and its uid, or -1 (miss). Touches
 * nothing. */
int kv_pool_lookup(const kv_pool_t *p, uint64_t parent_uid, const kv_hash *h,
                   const int32_t *tokens, uint64_t *uid);
/* Pins a found entry for the caller (refcount +1) and returns its device block id. A host
 * entry gets a fresh device block (possibly evicting another CACHED block) and a queued
 * host->device copy. Returns -1 if no device block is available (nothing changed). */
int kv_pool_acquire(kv_pool_t *p, int entry);
/* Registers device block b (refcount >= 1, all T tokens computed) as the child of
 * parent_uid with hash h. If an equal entry (same parent_uid and tokens) already exists, b
 * stays unindexed and that entry's uid is returned; otherwise b's new uid. parent_hash is
 * only reported in events. Returns 0 if reuse is off. */
uint64_t kv_pool_register(kv_pool_t *p, int b, uint64_t parent_uid, const kv_hash *parent_hash,
                          const kv_hash *h, const int32_t *tokens);
/* Drops every CACHED and HOST entry (blocks in use stay indexed). */
void kv_pool_clear_cache(kv_pool_t *p);

struct kv_copy_op {
    bool to_host;       /* true: device block -> host slot; false: host slot -> device block */
    int32_t block;      /* device block id */
    int32_t host_slot;  /* 0 .. n_host_blocks-1 */
};
/* Queued copies, in the order they must run. Valid until the next pool call. */
const struct kv_copy_op *kv_pool_pending_copies(const kv_pool_t *p, int *n);
void kv_pool_clear_copies(kv_pool_t *p);
/* Checksum slot of a host entry (for debug round-trip checks by the copier). */
uint64_t *kv_pool_host_checksum(kv_pool_t *p, int host_slot);

enum kv_pool_event_type {
    KV_POOL_EV_STORED = 0,
    KV_POOL_EV_REMOVED,
    KV_POOL_EV_CLEARED,
    KV_POOL_EV_TIER, /* a cached block moved between tiers (offloaded to host, or back) */
};
struct kv_pool_event {
    enum kv_pool_event_type type;
    const kv_hash *hash;        /* STORED / REMOVED */
    const kv_hash *parent_hash; /* STORED: the parent block's hash, or the chain root */
    bool parent_is_root;
    const int32_t *tokens;      /* STORED: (n_tokens) */
    int n_tokens;
    bool host;                  /* TIER: now in the host tier (false: back on the device) */
};
/* Called synchronously from pool calls (stored: register; removed: an entry leaves every
 * tier; cleared: kv_pool_clear_cache; tier: an eviction offloaded the block to the host tier,
 * or a hit brought it back to the device). Event data is valid during the call. */
typedef void (*kv_pool_event_cb)(const struct kv_pool_event *ev, void *user);
void kv_pool_set_event_cb(kv_pool_t *p, kv_pool_event_cb cb, void *user);

struct kv_pool_stats {
    uint64_t hits_device, hits_host; /* blocks acquired from each tier */
    uint64_t evictions;              /* CACHED device blocks reused for new data */
    uint64_t offloads;               /* of those, copied to the host tier */
    uint64_t host_evictions;         /* host entries dropped */
    uint64_t registered;             /* blocks added to the index */
};
void kv_pool_get_stats(const kv_pool_t *p, struct kv_pool_stats *out);
/* CACHED device blocks (refcount 0, indexed) and host entries. 0 when reuse is off. */
int kv_pool_n_cached(const kv_pool_t *p);
int kv_pool_n_host_cached(const kv_pool_t *p);

/* Blocks needed to hold n_tokens tokens. */
static inline int kv_blocks_for_tokens(int n_tokens, int tokens_per_block) {
    return (n_tokens + tokens_per_block - 1) / tokens_per_block;
}

#endif
