/*
 * Helpers shared by the CUDA backend's GPU tests (test_cuda.c, test_cuda_ops.c): GPU
 * presence, backend creation, bf16 rounding of a model's matrices (a CPU reference on the
 * weights the GPU stores) and the logit-row error metrics and limits.
 */
#ifndef KV_CUDA_TEST_UTIL_H
#define KV_CUDA_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "wmat_util.h"
#ifdef KVSERVE_HAVE_CUDA
#include "backend/cuda/backend_cuda.h"
#endif


/* True when a GPU test can run; otherwise prints why (once per test). */
static inline int gpu_ok(void) {
#ifdef KVSERVE_HAVE_CUDA
    char why[256];
    if (kv_cuda_device_check(why, sizeof why) != KV_OK) {
        fprintf(stderr, "SKIP: %s\n", why);
        return 0;
    }
    return 1;
#else
    fprintf(stderr, "SKIP: built without the CUDA backend (KVSERVE_CUDA=OFF or no nvcc)\n");
    return 0;
#endif
}

#ifdef KVSERVE_HAVE_CUDA

static bool g_det; /* make_be's CUDA backends in deterministic mode (test_cuda_deterministic) */

static inline backend_t *make_be(const model_t *m, int cuda, bool f32w) {
    backend_t *be = NULL;
    char err[512];
    struct backend_options o = {.kind = cuda ? BACKEND_KIND_CUDA : BACKEND_KIND_CPU, .n_threads = 2,
                                .f32_weights = f32w, .deterministic = cuda && g_det};
    if (backend_create(m, &o, &be, err, sizeof err)) fail_msg("backend_create(%s): %s", cuda ? "cuda" : "cpu", err);
    return be;
}

static inline int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

/* Rounds the matrices the CUDA backend stores as bf16 (embeddings, output, projections;
 * not norms or biases) to bf16 in place, round-to-nearest-even as __float2bfloat16_rn: a
 * CPU reference on the same weights, so a comparison measures the device arithmetic. */
static inline void round_bf16(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &p[i], 4);
        if ((u & 0x7f800000u) != 0x7f800000u) u += 0x7fffu + ((u >> 16) & 1u);
        u &= 0xffff0000u;
        memcpy(&p[i], &u, 4);
    }
}
static inline void model_round_bf16(model_t *m) {
    const struct model_config *c = &m->cfg;
    size_t d = (size_t)c->dim, q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
    size_t f = (size_t)c->ffn_dim;
    /* model_alloc's F32 matrices (kv_wmat_f32 is writable there) */
    round_bf16(kv_wmat_f32(&m->w.tok_embd), (size_t)c->n_vocab * d);
    if (m->w.output.data != m->w.tok_embd.data) round_bf16(kv_wmat_f32(&m->w.output), (size_t)c->n_vocab * d);
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_weights *L = &m->w.layers[l];
        round_bf16(kv_wmat_f32(&L->wq), q * d), round_bf16(kv_wmat_f32(&L->wk), kv * d);
        round_bf16(kv_wmat_f32(&L->wv), kv * d), round_bf16(kv_wmat_f32(&L->wo), d * q);
        round_bf16(kv_wmat_f32(&L->w_gate), f * d), round_bf16(kv_wmat_f32(&L->w_up), f * d);
        round_bf16(kv_wmat_f32(&L->w_down), d * f);
    }
}

/* Rows of got against ref (n rows of V): f32 weights: max|d| / max|ref| <= tol on every row;
 * bf16 weights: ||d||_2 / ||ref||_2 <= 2 tol on every row and <= tol on average (the limits
 * of compare_shape). Returns the number of failures; prints a summary line. */
static inline int score_rows(const char *what, const float *got, const float *ref, int n, int V, bool f32w, double tol) {
    double worst_max = 0, worst_norm = 0, sum_norm = 0;
    int bad = 0;
    for (int p = 0; p < n; p++) {
        const float *a = got + (size_t)p * V, *r = ref + (size_t)p * V;
        double md = 0, mr = 0, dd = 0, rr = 0;
        for (int i = 0; i < V; i++) {
            double d = fabs((double)a[i] - r[i]);
            if (!(d <= md)) md = d; /* NaN propagates */
            if (fabs(r[i]) > mr) mr = fabs(r[i]);
            dd += d * d, rr += (double)r[i] * r[i];
        }
        double em = md / mr, en = sqrt(dd / rr);
        if (!(em <= worst_max)) worst_max = em;
        if (!(en <= worst_norm)) worst_norm = en;
        sum_norm += en;
        double e = f32w ? em : en, lim = f32w ? tol : 2 * tol;
        if (!(e <= lim) && bad++ < 3) fprintf(stderr, "  %s row %d: error %g > %g\n", what, p, e, lim);
    }
    double mean = sum_norm / n;
    if (!f32w && !(mean <= tol)) bad++;
    fprintf(stderr, "  %s: %d rows, ||d||/||ref|| mean %.3g worst %.3g, worst max|d|/max|ref| %.3g (tol %g)%s\n", what,
            n, mean, worst_norm, worst_max, tol, bad ? " FAIL" : "");
    return bad;
}
#endif

#endif
