/* backend: shared helpers of the backend interface (see backend.h). */
#include "backend.h"

#include <string.h>

size_t kv_block_bytes(const struct kv_geometry *g) {
    return (size_t)g->n_layers * 2 * (size_t)g->n_kv_heads * (size_t)g->tokens_per_block *
           (size_t)g->head_dim * sizeof(float);
}

int batch_n_logits(const struct batch *b) {
    int n = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        if (s->logits == BATCH_LOGITS_LAST) n += 1;
        else if (s->logits == BATCH_LOGITS_ALL) n += s->n_tokens;
    }
    return n;
}

void backend_free(backend_t *be) {
    if (be && be->ops && be->ops->free) be->ops->free(be);
}

static kv_status check_blocks(const backend_t *be, const int32_t *blocks, int n) {
    if (n < 0) return KV_EINVAL;
    for (int i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= be->n_blocks) return KV_EINVAL;
    return KV_OK;
}

kv_status backend_copy_to_host(backend_t *be, const int32_t *blocks, void *const *host, int n) {
    if (n == 0) return KV_OK;
    if (check_blocks(be, blocks, n)) return KV_EINVAL;
    if (be->ops->copy_to_host) return be->ops->copy_to_host(be, blocks, host, n);
    if (!be->ops->block_ptr) return KV_EUNSUPPORTED;
    size_t bytes = kv_block_bytes(&be->geom);
    for (int i = 0; i < n; i++) memcpy(host[i], be->ops->block_ptr(be, blocks[i]), bytes);
    return KV_OK;
}

kv_status backend_copy_from_host(backend_t *be, const void *const *host, const int32_t *blocks,
                                 int n) {
    if (n == 0) return KV_OK;
    if (check_blocks(be, blocks, n)) return KV_EINVAL;
    if (be->ops->copy_from_host) return be->ops->copy_from_host(be, host, blocks, n);
    if (!be->ops->block_ptr) return KV_EUNSUPPORTED;
    size_t bytes = kv_block_bytes(&be->geom);
    for (int i = 0; i < n; i++) memcpy(be->ops->block_ptr(be, blocks[i]), host[i], bytes);
    return KV_OK;
}
