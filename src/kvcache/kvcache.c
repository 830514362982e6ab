/* kvcache: block bookkeeping for the KV pool (see kvcache.h for the pin contract). */
#include "kvcache.h"

#include <assert.h>
#include <stdlib.h>

struct kv_pool {
    int n_blocks;
    int tokens_per_block;
    int n_free;
    int32_t *free_list; /* (n_blocks) stack of free block ids; top at free_list[n_free-1] */
    int32_t *refcount;  /* (n_blocks) 0 = free */
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
    free(p);
}

int kv_pool_n_blocks(const kv_pool_t *p) { return p->n_blocks; }
int kv_pool_n_free(const kv_pool_t *p) { return p->n_free; }
int kv_pool_tokens_per_block(const kv_pool_t *p) { return p->tokens_per_block; }

int kv_pool_alloc(kv_pool_t *p) {
    if (p->n_free == 0) return -1;
    int b = p->free_list[--p->n_free];
    assert(p->refcount[b] == 0);
    p->refcount[b] = 1;
    return b;
}

kv_status kv_pool_alloc_n(kv_pool_t *p, int n, int32_t *out) {
    if (n < 0) return KV_EINVAL;
    if (n > p->n_free) return KV_NO_SPACE;
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
        assert(p->n_free < p->n_blocks);
        p->free_list[p->n_free++] = block;
    }
}

int kv_pool_refcount(const kv_pool_t *p, int block) {
    assert(block >= 0 && block < p->n_blocks);
    return p->refcount[block];
}
