/*
 * Batch-invariant matmul kernel (src/backend/cpu/matmul.h):
 *  - every row of an M-row product (M = 1..40, rows taken at several offsets of a larger X,
 *    random neighbours, 1/2/3 threads, single and batched calls) is bitwise equal to the
 *    same row computed alone (M = 1, 1 thread);
 *  - the result is bitwise equal to kv_matmul_reference(), the scalar transcription of the
 *    documented summation order (so no fused multiply-add, no reordering), for every ISA
 *    instantiation this CPU can run (AVX-512, AVX2, generic);
 *  - values are within 1e-5 relative (of sum |x*w|) of a double-precision reference.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/matmul.h"
#include "quant/qdot.h"
#include "quant/quant.h"

static uint64_t g_rng = 88172645463325252ull;
static float frand(void) { /* xorshift64, uniform in [-1, 1) */
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}
static float *rnd_buf(size_t n) {
    float *p = malloc(n * sizeof(float));
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

/* Shapes: K around the 16-lane boundary and with tails; N with 8/4/1 column edges. */
static const int shapes[][2] = {{37, 53}, {64, 48}, {17, 16}, {9, 7}, {130, 96}, {5, 1}, {40, 200}};

static void check_close_to_double(const float *X, int M, int K, const float *W, int N, const float *bias,
                                  const float *Y) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = bias ? bias[n] : 0.0, mag = bias ? fabs(bias[n]) : 0.0;
            for (int k = 0; k < K; k++) {
                double p = (double)X[(size_t)m * K + k] * W[(size_t)n * K + k];
                s += p, mag += fabs(p);
            }
            double e = fabs(Y[(size_t)m * N + n] - s);
            if (e > 1e-5 * (mag > 1e-30 ? mag : 1e-30))
                fail_msg("M %d K %d N %d: y[%d][%d] = %.9g, double reference %.9g", M, K, N, m, n,
                         (double)Y[(size_t)m * N + n], s);
        }
}

static void test_rows_equal_alone(void **st) {
    (void)st;
    kv_threadpool_t *tps[4] = {NULL, kv_threadpool_new(1), kv_threadpool_new(2), kv_threadpool_new(3)};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int N = shapes[si][0], K = shapes[si][1];
        int MAXR = 40 + 23;
        float *X = rnd_buf((size_t)MAXR * K), *W = rnd_buf((size_t)N * K), *bias = rnd_buf((size_t)N);
        float *alone = malloc((size_t)MAXR * N * sizeof(float)), *Y = malloc((size_t)MAXR * N * sizeof(float));
        float *ref = malloc((size_t)MAXR * N * sizeof(float));
        /* every row alone, no pool */
        for (int r = 0; r < MAXR; r++)
            kv_matmul(X + (size_t)r * K, 1, K, W, N, si % 2 ? bias : NULL, alone + (size_t)r * N, NULL);
        kv_matmul_reference(X, MAXR, K, W, N, si % 2 ? bias : NULL, ref);
        if (memcmp(alone, ref, (size_t)MAXR * N * sizeof(float)))
            fail_msg("N %d K %d: kernel differs from the scalar transcription of its summation order", N, K);
        check_close_to_double(X, MAXR, K, W, N, si % 2 ? bias : NULL, alone);
        const int offs[] = {0, 1, 3, 5, 23};
        for (int M = 1; M <= 40; M++)
            for (size_t oi = 0; oi < sizeof offs / sizeof offs[0]; oi++)
                for (int ti = 0; ti < 4; ti++) {
                    if ((M + (int)oi + ti) % 2 && M > 8) continue; /* halve the work, keep coverage */
                    int off = offs[oi];
                    memset(Y, 0xff, (size_t)M * N * sizeof(float));
                    kv_matmul(X + (size_t)off * K, M, K, W, N, si % 2 ? bias : NULL, Y, tps[ti]);
                    if (memcmp(Y, alone + (size_t)off * N, (size_t)M * N * sizeof(float)))
                        fail_msg("N %d K %d: M %d at row offset %d with pool %d (0 = none) differs from rows alone",
                                 N, K, M, off, ti);
                }
        free(X), free(W), free(bias), free(alone), free(Y), free(ref);
    }
    for (int i = 1; i < 4; i++) kv_threadpool_free(tps[i]);
}

/* kv_matmul_batch: several products in one parallel-for give the same bits as one at a time. */
static void test_batch_equals_single(void **st) {
    (void)st;
    kv_threadpool_t *tp = kv_threadpool_new(2);
    int M = 13, K = 96, Ns[3] = {72, 24, 200};
    float *X = rnd_buf((size_t)M * K), *W[3], *b = rnd_buf(200), *Y[3], *Z[3];
    struct kv_matmul_op ops[3];
    struct kv_wmat wm[3];
    for (int i = 0; i < 3; i++) {
        W[i] = rnd_buf((size_t)Ns[i] * K);
        Y[i] = calloc((size_t)M * Ns[i], sizeof(float));
        Z[i] = calloc((size_t)M * Ns[i], sizeof(float));
        wm[i] = kv_wmat_from_f32(W[i], Ns[i], K);
        ops[i] = (struct kv_matmul_op){.X = X, .W = &wm[i], .bias = i == 1 ? b : NULL, .Y = Y[i], .M = M};
        kv_matmul(X, M, K, W[i], Ns[i], i == 1 ? b : NULL, Z[i], NULL);
    }
    kv_matmul_batch(ops, 3, tp);
    for (int i = 0; i < 3; i++) {
        assert_memory_equal(Y[i], Z[i], (size_t)M * Ns[i] * sizeof(float));
        free(W[i]), free(Y[i]), free(Z[i]);
    }
    /* K == 0: bias (or zero); M == 0: nothing written */
    float y0[3] = {7, 7, 7};
    kv_matmul(X, 1, 0, X, 3, b, y0, tp);
    for (int i = 0; i < 3; i++) assert_true(y0[i] == b[i]);
    kv_matmul(X, 0, K, X, 3, NULL, y0, tp);
    assert_true(y0[0] == b[0]);
    free(X), free(b);
    kv_threadpool_free(tp);
}

/* Each ISA instantiation the CPU supports gives the same bits as the scalar transcription,
 * for shapes that reach every edge of the kernels' blocking: K split into several K blocks
 * (the blocks hold at most 768 floats; K 1553 and 2000 need 3, 2048 3 equal ones) with and
 * without a K % 16 tail, M not a multiple of the register tiles' rows (AVX-512 8, AVX2 4)
 * and every remainder of them, N not a multiple of the tiles' columns (3), with and without
 * bias, on no pool and on a 2-thread pool (each row also checked against itself alone). */
static void test_isas_identical(void **st) {
    (void)st;
    kv_threadpool_t *tp = kv_threadpool_new(2);
    static const int cases[][3] = {/* M, N, K */
                                   {11, 45, 777}, {23, 38, 1553}, {17, 7, 2000}, {9, 29, 2048}, {15, 13, 768},
                                   {31, 5, 784},  {7, 52, 16},    {12, 4, 33},   {5, 101, 800}};
    enum kv_matmul_isa isas[] = {KV_MATMUL_ISA_GENERIC, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512};
    int tested = 0;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        int M = cases[ci][0], N = cases[ci][1], K = cases[ci][2];
        float *X = rnd_buf((size_t)M * K), *W = rnd_buf((size_t)N * K), *b = ci % 2 ? NULL : rnd_buf((size_t)N);
        float *ref = malloc((size_t)M * N * sizeof(float)), *Y = malloc((size_t)M * N * sizeof(float));
        kv_matmul_reference(X, M, K, W, N, b, ref);
        check_close_to_double(X, M, K, W, N, b, ref);
        for (int i = 0; i < 3; i++) {
            if (kv_matmul_set_isa(isas[i]) != isas[i]) {
                if (ci == 0) fprintf(stderr, "NOTE: ISA %d not supported by this CPU, not tested\n", (int)isas[i]);
                continue;
            }
            if (ci == 0) fprintf(stderr, "checking kernel ISA %s\n", kv_matmul_isa_name());
            for (int pool = 0; pool < 2; pool++) {
                memset(Y, 0, (size_t)M * N * sizeof(float));
                kv_matmul(X, M, K, W, N, b, Y, pool ? tp : NULL);
                if (memcmp(Y, ref, (size_t)M * N * sizeof(float)))
                    fail_msg("ISA %s, M %d N %d K %d, pool %d: differs from the reference", kv_matmul_isa_name(), M, N,
                             K, pool);
            }
            for (int m = 0; m < M; m += 3) { /* a row alone (decode-sized M = 1) */
                kv_matmul(X + (size_t)m * K, 1, K, W, N, b, Y, NULL);
                if (memcmp(Y, ref + (size_t)m * N, (size_t)N * sizeof(float)))
                    fail_msg("ISA %s, N %d K %d: row %d alone differs from the reference", kv_matmul_isa_name(), N, K, m);
            }
            tested++;
        }
        free(X), free(W), free(b), free(ref), free(Y);
    }
    kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
    assert_true(tested >= 1);
    kv_threadpool_free(tp);
}

/* Weights stored as F16 / BF16 (prefill: dequantized into the per-thread panel, then the same
 * tiles): every ISA gives the bits of the reference on the widened weights. */
static void test_isas_identical_f16_panel(void **st) {
    (void)st;
    kv_matmul_set_bf16(KV_MATMUL_BF16_F32); /* the f32 contract (BF16 mode: test_matmul_bf16.c) */
    kv_threadpool_t *tp = kv_threadpool_new(2);
    int M = 21, N = 50, K = 1040; /* 65 steps: 2 K blocks */
    float *X = rnd_buf((size_t)M * K), *Wf = rnd_buf((size_t)N * K), *ref = malloc((size_t)M * N * sizeof(float));
    float *Y = malloc((size_t)M * N * sizeof(float));
    uint16_t *h = malloc((size_t)N * K * sizeof(uint16_t));
    for (int type = 0; type < 2; type++) {
        for (size_t i = 0; i < (size_t)N * K; i++) { /* store, then widen: Wf holds exactly the stored weights */
            uint32_t u;
            memcpy(&u, &Wf[i], 4);
            h[i] = type == 0 ? kv_f32_to_f16(Wf[i]) : (uint16_t)(u >> 16);
            Wf[i] = type == 0 ? kv_f16_to_f32(h[i]) : kv_bf16_to_f32(h[i]);
        }
        int qt = type == 0 ? KV_QTYPE_F16 : KV_QTYPE_BF16;
        struct kv_wmat w = {h, qt, N, K, kv_qtype_row_bytes(qt, K), NULL};
        kv_matmul_reference(X, M, K, Wf, N, NULL, ref);
        enum kv_matmul_isa isas[] = {KV_MATMUL_ISA_GENERIC, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512};
        for (int i = 0; i < 3; i++) {
            if (kv_matmul_set_isa(isas[i]) != isas[i]) continue;
            memset(Y, 0, (size_t)M * N * sizeof(float));
            kv_matmul_w(X, M, &w, NULL, Y, tp);
            if (memcmp(Y, ref, (size_t)M * N * sizeof(float)))
                fail_msg("%s weights, ISA %s: differs from the reference", type == 0 ? "F16" : "BF16", kv_matmul_isa_name());
        }
    }
    kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
    kv_matmul_set_bf16(KV_MATMUL_BF16_AUTO);
    free(X), free(Wf), free(ref), free(Y), free(h);
    kv_threadpool_free(tp);
}

/* Weights stored as F16 / BF16 in the CPU backend's grouped layout (qdot.h: what the backend
 * repacks them into at load): M <= 4 runs the grouped decode tiles, 5..64 rows on AVX-512 the
 * grouped tiles that widen the weights in registers (with their prefetches running past the
 * task's rows and the packed X), the rest (and AVX2, generic, N % 4 != 0) the f32 panel.
 * M from 1 to 33 (every row remainder of a tile), 48, 64 and 65 (the bound) and a few larger, K of
 * 1, 2 and 3 K blocks (K 1056: 33 chunks, blocks of an odd chunk count), N a multiple of 4 or
 * not, with and without bias, one and two threads: every ISA gives the bits of the reference on the widened weights. */
static void test_isas_identical_grouped(void **st) {
    (void)st;
    kv_matmul_set_bf16(KV_MATMUL_BF16_F32);
    kv_threadpool_t *tp = kv_threadpool_new(2);
    /* N, K, bias: the grouped tiles take the N % 4 == 0 shapes (K 1056: 2 K blocks, 2048: 3,
     * 64: 1), with and without bias; N 30 and 9 keep the panel */
    static const int shapes[][3] = {{52, 1056, 1}, {32, 2048, 0}, {20, 64, 1}, {8, 96, 0}, {30, 2048, 1}, {9, 96, 0}};
    static const int Ms[] = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                             20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 35, 48, 64, 65, 70, 129};
    enum kv_matmul_isa isas[] = {KV_MATMUL_ISA_GENERIC, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512};
    int tested = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int N = shapes[si][0], K = shapes[si][1], Mmax = 129;
        float *X = rnd_buf((size_t)Mmax * K), *Wf = rnd_buf((size_t)N * K), *b = shapes[si][2] ? rnd_buf((size_t)N) : NULL;
        float *ref = malloc((size_t)Mmax * N * sizeof(float)), *Y = malloc((size_t)Mmax * N * sizeof(float));
        uint16_t *h = malloc((size_t)N * K * sizeof(uint16_t)), *g = malloc((size_t)N * K * sizeof(uint16_t));
        for (int type = 0; type < 2; type++) {
            for (size_t i = 0; i < (size_t)N * K; i++) {
                uint32_t u;
                memcpy(&u, &Wf[i], 4);
                h[i] = type == 0 ? kv_f32_to_f16(Wf[i]) : (uint16_t)(u >> 16);
                Wf[i] = type == 0 ? kv_f16_to_f32(h[i]) : kv_bf16_to_f32(h[i]);
            }
            int qt = type == 0 ? KV_QTYPE_F16 : KV_QTYPE_BF16;
            size_t rb = kv_qtype_row_bytes(qt, K);
            assert_true(kv_fgroup_ok(qt, K));
            kv_fgroup_pack(qt, h, rb, N, K, g);
            struct kv_wmat w = {h, qt, N, K, rb, g};
            kv_matmul_reference(X, Mmax, K, Wf, N, b, ref);
            for (int i = 0; i < 3; i++) {
                if (kv_matmul_set_isa(isas[i]) != isas[i]) continue;
                for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++)
                    for (int pool = 0; pool < 2; pool++) {
                        int M = Ms[mi];
                        memset(Y, 0, (size_t)M * N * sizeof(float));
                        kv_matmul_w(X, M, &w, b, Y, pool ? tp : NULL);
                        if (memcmp(Y, ref, (size_t)M * N * sizeof(float)))
                            fail_msg("%s grouped, ISA %s, M %d N %d K %d, pool %d: differs from the reference",
                                     type == 0 ? "F16" : "BF16", kv_matmul_isa_name(), M, N, K, pool);
                    }
                tested++;
            }
        }
        free(X), free(Wf), free(b), free(ref), free(Y), free(h), free(g);
    }
    kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
    kv_matmul_set_bf16(KV_MATMUL_BF16_AUTO);
    assert_true(tested >= 8);
    kv_threadpool_free(tp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_equal_alone),
        cmocka_unit_test(test_batch_equals_single),
        cmocka_unit_test(test_isas_identical),
        cmocka_unit_test(test_isas_identical_f16_panel),
        cmocka_unit_test(test_isas_identical_grouped),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
