/* Test helpers for weight matrices in their stored precision (struct kv_wmat, model.h). */
#ifndef KV_TESTS_WMAT_UTIL_H
#define KV_TESTS_WMAT_UTIL_H

#include <stdlib.h>
#include <string.h>

#include "model/model.h"

/* Element i (row-major over rows x cols) of w, dequantized. */
static inline float wmat_at(const struct kv_wmat *w, size_t i) {
    size_t r = i / (size_t)w->cols, c = i % (size_t)w->cols;
    if (w->type == KV_QTYPE_F32) return ((const float *)w->data)[i];
    float *row = malloc((size_t)w->cols * sizeof(float));
    if (!row) abort();
    kv_dequant_row(w->type, (const char *)w->data + r * w->row_bytes, row, w->cols);
    float v = row[c];
    free(row);
    return v;
}
/* All of w dequantized into a new array (free it). */
static inline float *wmat_to_f32(const struct kv_wmat *w) {
    float *f = malloc((size_t)w->rows * w->cols * sizeof(float) + 1);
    if (!f) abort();
    for (int r = 0; r < w->rows; r++)
        kv_dequant_row(w->type, (const char *)w->data + (size_t)r * w->row_bytes, f + (size_t)r * w->cols, w->cols);
    return f;
}
/* Same type, shape and bytes. */
static inline int wmat_equal(const struct kv_wmat *a, const struct kv_wmat *b) {
    return a->type == b->type && a->rows == b->rows && a->cols == b->cols && a->row_bytes == b->row_bytes &&
           memcmp(a->data, b->data, (size_t)a->rows * a->row_bytes) == 0;
}
/* A writable copy of src with every matrix dequantized to F32 (model_alloc layout), or
 * NULL when out of memory. For tests that modify weights of a loaded (read-only) model. */
static inline model_t *test_model_clone_f32(const model_t *src) {
    model_t *m;
    if (model_alloc(&src->cfg, &m)) return NULL;
    const struct model_config *c = &src->cfg;
    size_t d = (size_t)c->dim, q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
#define CPYM(dst, s)                                                                                 \
    do {                                                                                             \
        float *f_ = wmat_to_f32(&(s));                                                               \
        memcpy(kv_wmat_f32(&(dst)), f_, (size_t)(s).rows * (s).cols * sizeof(float));               \
        free(f_);                                                                                    \
    } while (0)
#define CPYV(dst, s, n) do { if (s) memcpy(dst, s, (n) * sizeof(float)); } while (0)
    CPYM(m->w.tok_embd, src->w.tok_embd);
    if (!c->tied_embeddings) CPYM(m->w.output, src->w.output);
    CPYV(m->w.out_norm, src->w.out_norm, d);
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_weights *a = &m->w.layers[l];
        const struct layer_weights *b = &src->w.layers[l];
        CPYV(a->attn_norm, b->attn_norm, d);
        CPYV(a->ffn_norm, b->ffn_norm, d);
        CPYM(a->wq, b->wq);
        CPYM(a->wk, b->wk);
        CPYM(a->wv, b->wv);
        CPYM(a->wo, b->wo);
        CPYM(a->w_gate, b->w_gate);
        CPYM(a->w_up, b->w_up);
        CPYM(a->w_down, b->w_down);
        if (c->attn_bias) {
            CPYV(a->bq, b->bq, q);
            CPYV(a->bk, b->bk, kv);
            CPYV(a->bv, b->bv, kv);
        }
        if (c->qk_norm) {
            CPYV(a->q_norm, b->q_norm, (size_t)c->head_dim);
            CPYV(a->k_norm, b->k_norm, (size_t)c->head_dim);
        }
    }
#undef CPYM
#undef CPYV
    m->format = src->format;
    memcpy(m->path, src->path, sizeof m->path);
    return m;
}
#endif
