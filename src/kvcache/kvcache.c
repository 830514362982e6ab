/* kvcache: block bookkeeping for the KV pool, the reuse index and the host tier (see
 * kvcache.h for the state machine and the pin contract).
 *
 * Entries: ids 0..n_blocks-1 are device blocks, n_blocks..n_blocks+n_host-1 host slots.
 * Every indexed entry has a uid (never reused), its parent's uid, its hash, its parent's
 * hash and its T token ids. The index is a chained hash table over kv_hash_u64(hash).
 * Two intrusive LRU lists: 0 = CACHED device blocks, 1 = host entries (head = oldest). */
#include "kvcache.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROOTS 4096

struct root {
    uint8_t *bytes;
    size_t len;
    uint64_t uid, last_use;
};

struct kv_pool {
    int n_blocks;
    int tokens_per_block;
    int n_free;
    int32_t *free_list; /* (n_blocks) stack of free block ids; top at free_list[n_free-1] */
    int32_t *refcount;  /* (n_blocks) 0 = free or CACHED */

    /* reuse */
    bool reuse;
    int n_host, n_entries;
    uint64_t next_uid, use_clock;
    uint64_t *uid, *parent_uid; /* (n_entries); uid 0 = not indexed */
    kv_hash *hash, *parent_hash;
    bool *parent_is_root;
    int32_t *tok;               /* (n_entries * T) */
    int32_t *bucket;            /* (n_buckets) first entry or -1 */
    int32_t *hnext;             /* (n_entries) */
    uint32_t bucket_mask;
    int32_t *lprev, *lnext;     /* (n_entries) */
    int32_t lru_head[2], lru_tail[2];
    int lru_n[2];
    int32_t *host_free;         /* (n_host) stack of free host slots */
    int n_host_free;
    uint64_t *checksum;         /* (n_host) */
    struct root *roots;
    int n_roots;
    struct kv_copy_op *copies;
    int n_copies, cap_copies;
    kv_pool_event_cb ev_cb;
    void *ev_user;
    struct kv_pool_stats st;
};

kv_pool_t *kv_pool_new(int n_blocks, int tokens_per_block) {
    if (n_blocks < 1 || tokens_per_block < 1) return NULL;
    kv_pool_t *p = kv_calloc(1, sizeof *p);
    if (!p) return NULL;
    p->free_list = kv_malloc((size_t)n_blocks * sizeof *p->free_list);
    p->refcount = kv_calloc((size_t)n_blocks, sizeof *p->refcount);
    if (!p->free_list || !p->refcount) {
        kv_pool_free(p);
        return NULL;
    }
    p->n_blocks = n_blocks;
    p->tokens_per_block = tokens_per_block;
    /* Pushed in reverse so that a fresh pool hands out 0, 1, 2, ... */
    for (int i = 0; i < n_blocks; i++) p->free_list[i] = n_blocks - 1 - i;
    p->n_free = n_blocks;
    return p;
}

void kv_pool_free(kv_pool_t *p) {
    if (!p) return;
    free(p->free_list);
    free(p->refcount);
    free(p->uid);
    free(p->parent_uid);
    free(p->hash);
    free(p->parent_hash);
    free(p->parent_is_root);
    free(p->tok);
    free(p->bucket);
    free(p->hnext);
    free(p->lprev);
    free(p->lnext);
    free(p->host_free);
    free(p->checksum);
    for (int i = 0; i < p->n_roots; i++) free(p->roots[i].bytes);
    free(p->roots);
    free(p->copies);
    free(p);
}

kv_status kv_pool_enable_reuse(kv_pool_t *p, int n_host_blocks) {
    if (p->reuse || n_host_blocks < 0 || p->n_free != p->n_blocks) return KV_EINVAL;
    int ne = p->n_blocks + n_host_blocks;
    uint32_t nb = 16;
    while (nb < (uint32_t)ne * 2u && nb < (1u << 30)) nb <<= 1;
    size_t n = (size_t)ne;
    p->uid = kv_calloc(n, sizeof *p->uid);
    p->parent_uid = kv_calloc(n, sizeof *p->parent_uid);
    p->hash = kv_calloc(n, sizeof *p->hash);
    p->parent_hash = kv_calloc(n, sizeof *p->parent_hash);
    p->parent_is_root = kv_calloc(n, sizeof *p->parent_is_root);
    p->tok = kv_calloc(n * (size_t)p->tokens_per_block, sizeof *p->tok);
    p->bucket = kv_malloc(nb * sizeof *p->bucket);
    p->hnext = kv_malloc(n * sizeof *p->hnext);
    p->lprev = kv_malloc(n * sizeof *p->lprev);
    p->lnext = kv_malloc(n * sizeof *p->lnext);
    p->host_free = kv_malloc((size_t)(n_host_blocks + 1) * sizeof *p->host_free);
    p->checksum = kv_calloc((size_t)n_host_blocks + 1, sizeof *p->checksum);
    p->roots = kv_calloc(MAX_ROOTS, sizeof *p->roots);
    if (!p->uid || !p->parent_uid || !p->hash || !p->parent_hash || !p->parent_is_root ||
        !p->tok || !p->bucket || !p->hnext || !p->lprev || !p->lnext || !p->host_free ||
        !p->checksum || !p->roots) {
        /* leave the pool as it was: reuse off; kv_pool_free releases the arrays */
        return KV_ENOMEM;
    }
    for (uint32_t i = 0; i < nb; i++) p->bucket[i] = -1;
    p->bucket_mask = nb - 1;
    for (int i = 0; i < ne; i++) p->hnext[i] = p->lprev[i] = p->lnext[i] = -1;
    for (int l = 0; l < 2; l++) p->lru_head[l] = p->lru_tail[l] = -1;
    for (int i = 0; i < n_host_blocks; i++) p->host_free[i] = n_host_blocks - 1 - i;
    p->n_host_free = n_host_blocks;
    p->n_host = n_host_blocks;
    p->n_entries = ne;
    p->next_uid = 1;
    p->reuse = true;
    return KV_OK;
}

bool kv_pool_reuse_enabled(const kv_pool_t *p) { return p->reuse; }
int kv_pool_n_host_blocks(const kv_pool_t *p) { return p->n_host; }
int kv_pool_n_blocks(const kv_pool_t *p) { return p->n_blocks; }
int kv_pool_n_free(const kv_pool_t *p) { return p->n_free + (p->reuse ? p->lru_n[0] : 0); }
int kv_pool_tokens_per_block(const kv_pool_t *p) { return p->tokens_per_block; }
int kv_pool_n_cached(const kv_pool_t *p) { return p->reuse ? p->lru_n[0] : 0; }
int kv_pool_n_host_cached(const kv_pool_t *p) { return p->reuse ? p->lru_n[1] : 0; }
void kv_pool_get_stats(const kv_pool_t *p, struct kv_pool_stats *out) { *out = p->st; }

void kv_pool_set_event_cb(kv_pool_t *p, kv_pool_event_cb cb, void *user) {
    p->ev_cb = cb;
    p->ev_user = user;
}

/* ---------------------------------------------------------------- lists and index */

static void lru_push(kv_pool_t *p, int l, int e) {
    p->lprev[e] = p->lru_tail[l];
    p->lnext[e] = -1;
    if (p->lru_tail[l] >= 0) p->lnext[p->lru_tail[l]] = e;
    else p->lru_head[l] = e;
    p->lru_tail[l] = e;
    p->lru_n[l]++;
}

static void lru_unlink(kv_pool_t *p, int l, int e) {
    if (p->lprev[e] >= 0) p->lnext[p->lprev[e]] = p->lnext[e];
    else p->lru_head[l] = p->lnext[e];
    if (p->lnext[e] >= 0) p->lprev[p->lnext[e]] = p->lprev[e];
    else p->lru_tail[l] = p->lprev[e];
    p->lprev[e] = p->lnext[e] = -1;
    p->lru_n[l]--;
}

static uint32_t bucket_of(const kv_pool_t *p, const kv_hash *h) {
    uint64_t x = kv_hash_u64(h);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x & p->bucket_mask;
}

static void index_insert(kv_pool_t *p, int e) {
    uint32_t b = bucket_of(p, &p->hash[e]);
    p->hnext[e] = p->bucket[b];
    p->bucket[b] = e;
}

static void index_remove(kv_pool_t *p, int e) {
    uint32_t b = bucket_of(p, &p->hash[e]);
    int32_t *link = &p->bucket[b];
    while (*link >= 0 && *link != e) link = &p->hnext[*link];
    assert(*link == e);
    *link = p->hnext[e];
    p->hnext[e] = -1;
}

static int32_t *etok(const kv_pool_t *p, int e) { return p->tok + (size_t)e * (size_t)p->tokens_per_block; }

static void emit_removed(kv_pool_t *p, int e) {
    if (!p->ev_cb) return;
    struct kv_pool_event ev = {.type = KV_POOL_EV_REMOVED, .hash = &p->hash[e]};
    p->ev_cb(&ev, p->ev_user);
}

static void emit_tier(kv_pool_t *p, int e, bool host) {
    if (!p->ev_cb) return;
    struct kv_pool_event ev = {.type = KV_POOL_EV_TIER, .hash = &p->hash[e], .host = host};
    p->ev_cb(&ev, p->ev_user);
}

/* Drops an entry from the index (it must not be in an LRU list). */
static void unindex(kv_pool_t *p, int e, bool event) {
    index_remove(p, e);
    if (event) emit_removed(p, e);
    p->uid[e] = 0;
}

/* Moves the index data of entry from to entry to (to must be unindexed). */
static void move_entry(kv_pool_t *p, int from, int to) {
    index_remove(p, from);
    p->uid[to] = p->uid[from];
    p->parent_uid[to] = p->parent_uid[from];
    p->hash[to] = p->hash[from];
    p->parent_hash[to] = p->parent_hash[from];
    p->parent_is_root[to] = p->parent_is_root[from];
    memcpy(etok(p, to), etok(p, from), (size_t)p->tokens_per_block * sizeof(int32_t));
    p->uid[from] = 0;
    index_insert(p, to);
}

static kv_status queue_copy(kv_pool_t *p, bool to_host, int block, int slot) {
    if (p->n_copies == p->cap_copies) {
        int nc = p->cap_copies ? p->cap_copies * 2 : 64;
        void *np = kv_realloc(p->copies, (size_t)nc * sizeof *p->copies);
        if (!np) return KV_ENOMEM;
        p->copies = np;
        p->cap_copies = nc;
    }
    p->copies[p->n_copies++] = (struct kv_copy_op){to_host, block, slot};
    return KV_OK;
}

/* A host slot for an offload: a free one, else the oldest host entry's. -1 if none. */
static int take_host_slot(kv_pool_t *p) {
    if (p->n_host_free > 0) return p->host_free[--p->n_host_free];
    int e = p->lru_head[1];
    if (e < 0) return -1;
    lru_unlink(p, 1, e);
    unindex(p, e, true);
    p->st.host_evictions++;
    return e - p->n_blocks;
}

/* Frees the least recently used CACHED device block (offloading it when there is a host
 * tier) and returns it with refcount 1, or -1. */
static int evict_one(kv_pool_t *p) {
    int b = p->lru_head[0];
    if (b < 0) return -1;
    lru_unlink(p, 0, b);
    p->st.evictions++;
    int slot = p->n_host > 0 ? take_host_slot(p) : -1;
    if (slot >= 0 && queue_copy(p, true, b, slot) == KV_OK) {
        int e = p->n_blocks + slot;
        move_entry(p, b, e);
        lru_push(p, 1, e);
        p->st.offloads++;
        emit_tier(p, e, true);
    } else {
        if (slot >= 0) p->host_free[p->n_host_free++] = slot;
        unindex(p, b, true);
    }
    p->refcount[b] = 1;
    return b;
}

/* ---------------------------------------------------------------- pin contract */

int kv_pool_alloc(kv_pool_t *p) {
    if (p->n_free == 0) return p->reuse ? evict_one(p) : -1;
    int b = p->free_list[--p->n_free];
    assert(p->refcount[b] == 0);
    p->refcount[b] = 1;
    return b;
}

kv_status kv_pool_alloc_n(kv_pool_t *p, int n, int32_t *out) {
    if (n < 0) return KV_EINVAL;
    if (n > kv_pool_n_free(p)) return KV_NO_SPACE;
    for (int i = 0; i < n; i++) out[i] = kv_pool_alloc(p);
    return KV_OK;
}

void kv_pool_ref(kv_pool_t *p, int block) {
    assert(block >= 0 && block < p->n_blocks);
    assert(p->refcount[block] > 0 && "kv_pool_ref on a free block");
    p->refcount[block]++;
}

void kv_pool_release(kv_pool_t *p, int block) {
    assert(block >= 0 && block < p->n_blocks);
    assert(p->refcount[block] > 0 && "kv_pool_release on a free block");
    if (--p->refcount[block] == 0) {
        if (p->reuse && p->uid[block]) {
            lru_push(p, 0, block);
            return;
        }
        assert(p->n_free < p->n_blocks);
        p->free_list[p->n_free++] = block;
    }
}

int kv_pool_refcount(const kv_pool_t *p, int block) {
    assert(block >= 0 && block < p->n_blocks);
    return p->refcount[block];
}

/* ---------------------------------------------------------------- reuse */

uint64_t kv_pool_root_uid(kv_pool_t *p, const void *bytes, size_t len) {
    if (!p->reuse) return 0;
    p->use_clock++;
    int oldest = 0;
    for (int i = 0; i < p->n_roots; i++) {
        struct root *r = &p->roots[i];
        if (r->len == len && (len == 0 || memcmp(r->bytes, bytes, len) == 0)) {
            r->last_use = p->use_clock;
            return r->uid;
        }
        if (r->last_use < p->roots[oldest].last_use) oldest = i;
    }
    uint8_t *copy = kv_malloc(len ? len : 1);
    if (!copy) return 0;
    if (len) memcpy(copy, bytes, len);
    struct root *r;
    if (p->n_roots < MAX_ROOTS) r = &p->roots[p->n_roots++];
    else {
        r = &p->roots[oldest]; /* its blocks become unreachable and age out */
        free(r->bytes);
    }
    r->bytes = copy;
    r->len = len;
    r->uid = p->next_uid++;
    r->last_use = p->use_clock;
    return r->uid;
}

static bool entry_equal(const kv_pool_t *p, int e, uint64_t parent_uid, const int32_t *tokens) {
    return p->parent_uid[e] == parent_uid &&
           memcmp(etok(p, e), tokens, (size_t)p->tokens_per_block * sizeof *tokens) == 0;
}

int kv_pool_lookup(const kv_pool_t *p, uint64_t parent_uid, const kv_hash *h,
                   const int32_t *tokens, uint64_t *uid) {
    if (!p->reuse || parent_uid == 0) return -1;
    for (int e = p->bucket[bucket_of(p, h)]; e >= 0; e = p->hnext[e]) {
        /* the hash only narrows the search: parent and token ids decide */
        if (memcmp(p->hash[e].b, h->b, KV_HASH_LEN) == 0 && entry_equal(p, e, parent_uid, tokens)) {
            if (uid) *uid = p->uid[e];
            return e;
        }
    }
    return -1;
}

int kv_pool_acquire(kv_pool_t *p, int e) {
    assert(p->reuse && e >= 0 && e < p->n_entries && p->uid[e]);
    if (e < p->n_blocks) {
        if (p->refcount[e] == 0) lru_unlink(p, 0, e);
        p->refcount[e]++;
        p->st.hits_device++;
        return e;
    }
    /* host entry: pin it (out of the host LRU) while a device block is found */
    lru_unlink(p, 1, e);
    int b = kv_pool_alloc(p);
    if (b < 0) {
        lru_push(p, 1, e);
        return -1;
    }
    int slot = e - p->n_blocks;
    if (queue_copy(p, false, b, slot) != KV_OK) {
        lru_push(p, 1, e);
        kv_pool_release(p, b);
        return -1;
    }
    move_entry(p, e, b);
    p->host_free[p->n_host_free++] = slot; /* reusable: later copies run after this one */
    p->st.hits_host++;
    emit_tier(p, b, false);
    return b;
}

uint64_t kv_pool_register(kv_pool_t *p, int b, uint64_t parent_uid, const kv_hash *parent_hash,
                          const kv_hash *h, const int32_t *tokens) {
    if (!p->reuse || parent_uid == 0) return 0;
    assert(b >= 0 && b < p->n_blocks && p->refcount[b] > 0);
    if (p->uid[b]) return p->uid[b];
    uint64_t existing = 0;
    if (kv_pool_lookup(p, parent_uid, h, tokens, &existing) >= 0) return existing;
    p->uid[b] = p->next_uid++;
    p->parent_uid[b] = parent_uid;
    p->hash[b] = *h;
    p->parent_hash[b] = *parent_hash;
    /* a root uid is never an entry's uid: check whether the parent is an entry */
    bool is_root = false;
    for (int i = 0; i < p->n_roots && !is_root; i++) is_root = p->roots[i].uid == parent_uid;
    p->parent_is_root[b] = is_root;
    memcpy(etok(p, b), tokens, (size_t)p->tokens_per_block * sizeof *tokens);
    index_insert(p, b);
    p->st.registered++;
    if (p->ev_cb) {
        struct kv_pool_event ev = {.type = KV_POOL_EV_STORED, .hash = h, .parent_hash = parent_hash,
                                   .parent_is_root = is_root, .tokens = tokens,
                                   .n_tokens = p->tokens_per_block};
        p->ev_cb(&ev, p->ev_user);
    }
    return p->uid[b];
}

void kv_pool_clear_cache(kv_pool_t *p) {
    if (!p->reuse) return;
    while (p->lru_head[0] >= 0) {
        int b = p->lru_head[0];
        lru_unlink(p, 0, b);
        unindex(p, b, false);
        p->free_list[p->n_free++] = b;
    }
    while (p->lru_head[1] >= 0) {
        int e = p->lru_head[1];
        lru_unlink(p, 1, e);
        unindex(p, e, false);
        p->host_free[p->n_host_free++] = e - p->n_blocks;
    }
    if (p->ev_cb) {
        struct kv_pool_event ev = {.type = KV_POOL_EV_CLEARED};
        p->ev_cb(&ev, p->ev_user);
    }
}

const struct kv_copy_op *kv_pool_pending_copies(const kv_pool_t *p, int *n) {
    *n = p->n_copies;
    return p->copies;
}

void kv_pool_clear_copies(kv_pool_t *p) { p->n_copies = 0; }

uint64_t *kv_pool_host_checksum(kv_pool_t *p, int host_slot) {
    assert(host_slot >= 0 && host_slot < p->n_host);
    return &p->checksum[host_slot];
}
