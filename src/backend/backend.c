/* backend: shared helpers of the backend interface (see backend.h). */
#include "backend.h"

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
