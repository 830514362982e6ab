/*
 * matmul: batch-invariant f32 Y = X W^T (see matmul.h for the arithmetic contract).
 *
 * One kernel body (tile(), always_inline, written with GCC vector extensions on 16-float
 * vectors) is instantiated three times with different target ISAs: AVX-512 (one zmm per
 * vector), AVX2 (two ymm) and generic x86-64/other (SSE or scalar). The vector code is the
 * same IEEE operations lane by lane in every instantiation and -ffp-contract=off (implied by
 * -std=c11) keeps mul and add separate, so all three produce the same bits.
 */
#include "matmul.h"

/* The contract needs every product rounded before its add. -std=c11 already implies this;
 * the pragma keeps it under -std=gnu11 or an explicit -ffp-contract=fast. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Vectors are never passed or returned by value (that would change the ABI between the
 * ISA instantiations): loads are memcpy into a local, reductions take a pointer. */
#define LD16(v, p) memcpy(&(v), (p), sizeof(v16))

/* Fixed tree: l8[j] = a[j] + a[j+8], l4[j] = l8[j] + l8[j+4], l2[j] = l4[j] + l4[j+2], l2[0] + l2[1]. */
ALWAYS_INLINE float hsum16(const v16 *a) {
    v8 lo, hi;
    memcpy(&lo, a, sizeof lo);
    memcpy(&hi, (const char *)a + sizeof lo, sizeof hi);
    v8 b = lo + hi;
    v4 bl, bh;
    memcpy(&bl, &b, sizeof bl);
    memcpy(&bh, (const char *)&b + sizeof bl, sizeof bh);
    v4 c = bl + bh;
    float d0 = c[0] + c[2], d1 = c[1] + c[3];
    return d0 + d1;
}

/* Y[r][c] for r < R, c < C (R, C, PF compile-time constants after inlining). X rows at stride
 * ldx, W rows at stride ldw, Y rows at stride ldy. PF: software-prefetch the next C W rows
 * (measured: +30% for M = 4 with W from DRAM, -20% for M = 64 where W comes from L2). */
ALWAYS_INLINE void tile(const float *X, size_t ldx, const float *W, size_t ldw, int K, const float *bias,
                        float *Y, size_t ldy, const int R, const int C, const int PF) {
    v16 acc[4][4];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4")
        for (int c = 0; c < C; c++) acc[r][c] = (v16){0};
    int K16 = K - K % 16;
    for (int k = 0; k < K16; k += 16) {
        v16 w[4];
        _Pragma("GCC unroll 4")
        for (int c = 0; c < C; c++) LD16(w[c], W + c * ldw + k);
        if (PF) { /* the next W tile: 4 short rows read in parallel defeat the HW prefetcher */
            _Pragma("GCC unroll 4")
            for (int c = 0; c < C; c++) /* integer arithmetic: may point past W (prefetch never faults) */
                __builtin_prefetch((const void *)((uintptr_t)(W + k) + (C + c) * ldw * sizeof(float)), 0, 3);
        }
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            v16 x;
            LD16(x, X + r * ldx + k);
            _Pragma("GCC unroll 4")
            for (int c = 0; c < C; c++) acc[r][c] += x * w[c];
        }
    }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4")
        for (int c = 0; c < C; c++) {
            float s = hsum16(&acc[r][c]);
            for (int k = K16; k < K; k++) s += X[r * ldx + k] * W[c * ldw + k];
            if (bias) s += bias[c];
            Y[r * ldy + c] = s;
        }
}

/* Columns [n0, n1) of all M rows: groups of 4 rows x 4 W rows (each W tile reused from L1
 * by 4 rows, the W block reused from L2 by all row groups); 2 or 3 leftover rows in Rx4 tiles;
 * a single row (decode) streams W one row at a time, which measured faster than 1x4 / 1x8
 * tiles when W comes from DRAM (one sequential stream for the prefetcher). */
ALWAYS_INLINE void cols_body(const struct kv_matmul_op *op, int n0, int n1) {
    const size_t K = (size_t)op->K, N = (size_t)op->N;
    const float *b = op->bias;
    int m = 0;
#define ROWS(R, PF)                                                                                                 \
    do {                                                                                                          \
        const float *x = op->X + m * K;                                                                           \
        float *y = op->Y + m * N;                                                                                 \
        int n = n0;                                                                                               \
        for (; n + 4 <= n1; n += 4) tile(x, K, op->W + n * K, K, op->K, b ? b + n : NULL, y + n, N, R, 4, PF);     \
        for (; n < n1; n++) tile(x, K, op->W + n * K, K, op->K, b ? b + n : NULL, y + n, N, R, 1, 0);             \
    } while (0)
    if (op->M < 16)
        for (; m + 4 <= op->M; m += 4) ROWS(4, 1);
    else
        for (; m + 4 <= op->M; m += 4) ROWS(4, 0);
    if (op->M - m == 3) ROWS(3, 1);
    else if (op->M - m == 2) ROWS(2, 1);
    else if (op->M - m == 1) {
        const float *x = op->X + m * K;
        float *y = op->Y + m * N;
        for (int n = n0; n < n1; n++) tile(x, K, op->W + n * K, K, op->K, b ? b + n : NULL, y + n, N, 1, 1, 0);
    }
#undef ROWS
}

typedef void (*cols_fn)(const struct kv_matmul_op *op, int n0, int n1);

static void cols_generic(const struct kv_matmul_op *op, int n0, int n1) { cols_body(op, n0, n1); }
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static void cols_avx2(const struct kv_matmul_op *op, int n0, int n1) {
    cols_body(op, n0, n1);
}
__attribute__((target("avx512f"))) static void cols_avx512(const struct kv_matmul_op *op, int n0, int n1) {
    cols_body(op, n0, n1);
}
#define KV_MATMUL_X86 1
#endif

static _Atomic int g_isa = KV_MATMUL_ISA_AUTO; /* resolved set, never AUTO after first use */

static enum kv_matmul_isa best_isa(void) {
#ifdef KV_MATMUL_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return KV_MATMUL_ISA_AVX512;
    if (__builtin_cpu_supports("avx2")) return KV_MATMUL_ISA_AVX2;
#endif
    return KV_MATMUL_ISA_GENERIC;
}

enum kv_matmul_isa kv_matmul_set_isa(enum kv_matmul_isa isa) {
    enum kv_matmul_isa best = best_isa();
    if (isa == KV_MATMUL_ISA_AUTO || isa > best) isa = best;
    atomic_store(&g_isa, (int)isa);
    return isa;
}

static cols_fn current_fn(void) {
    int isa = atomic_load_explicit(&g_isa, memory_order_relaxed);
    if (isa == KV_MATMUL_ISA_AUTO) isa = (int)kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
#ifdef KV_MATMUL_X86
    if (isa == KV_MATMUL_ISA_AVX512) return cols_avx512;
    if (isa == KV_MATMUL_ISA_AVX2) return cols_avx2;
#endif
    return cols_generic;
}

const char *kv_matmul_isa_name(void) {
    cols_fn f = current_fn();
#ifdef KV_MATMUL_X86
    if (f == cols_avx512) return "avx512";
    if (f == cols_avx2) return "avx2";
#endif
    (void)f;
    return "generic";
}

/* ---- work split ---- */

#define MAX_BATCH 8
#define L2_BLOCK_BYTES (192 * 1024) /* W rows per task: about this many bytes, stays in L2 */
/* Below this many multiply-adds in one batch, waking the pool costs more than it saves: run
 * on the calling thread (results are identical either way: each element is computed whole). */
#define INLINE_MACS (1L << 18)

struct plan {
    const struct kv_matmul_op *ops;
    int n_ops;
    int nb[MAX_BATCH];      /* W rows per task (multiple of 8 except the last task) */
    int first[MAX_BATCH + 1]; /* first task of op i; first[n_ops] = total */
    cols_fn fn;
};

static void plan_task(void *p, int t, int th) {
    (void)th;
    const struct plan *pl = p;
    int i = 0;
    while (t >= pl->first[i + 1]) i++;
    const struct kv_matmul_op *op = &pl->ops[i];
    int n0 = (t - pl->first[i]) * pl->nb[i];
    int n1 = n0 + pl->nb[i] < op->N ? n0 + pl->nb[i] : op->N;
    pl->fn(op, n0, n1);
}

static void run_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp) {
    int n_threads = tp ? kv_threadpool_size(tp) : 1;
    struct plan pl = {.ops = ops, .n_ops = n_ops, .fn = current_fn()};
    long total_rows = 0, macs = 0;
    for (int i = 0; i < n_ops; i++) {
        total_rows += ops[i].M > 0 ? ops[i].N : 0;
        macs += (long)(ops[i].M > 0 ? ops[i].M : 0) * ops[i].N * (ops[i].K > 0 ? ops[i].K : 1);
    }
    if (macs < INLINE_MACS) n_threads = 1;
    pl.first[0] = 0;
    for (int i = 0; i < n_ops; i++) {
        const struct kv_matmul_op *op = &ops[i];
        int nb = 0;
        if (op->M > 0 && op->N > 0) {
            size_t row_bytes = (size_t)(op->K > 0 ? op->K : 1) * sizeof(float);
            nb = (int)(L2_BLOCK_BYTES / row_bytes) & ~7;
            /* at least ~4 tasks per thread over the whole batch, for load balance */
            int fair = (int)((total_rows + 4L * n_threads - 1) / (4L * n_threads));
            fair = (fair + 7) & ~7;
            if (nb > fair) nb = fair;
            if (nb < 8) nb = 8;
        }
        pl.nb[i] = nb;
        pl.first[i + 1] = pl.first[i] + (nb ? (op->N + nb - 1) / nb : 0);
    }
    int total = pl.first[n_ops];
    if (!tp || n_threads == 1) {
        for (int t = 0; t < total; t++) plan_task(&pl, t, 0);
    } else {
        kv_threadpool_for(tp, total, plan_task, &pl);
    }
}

void kv_matmul_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp) {
    for (int i = 0; i < n_ops; i += MAX_BATCH) run_batch(ops + i, n_ops - i < MAX_BATCH ? n_ops - i : MAX_BATCH, tp);
}

void kv_matmul(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y,
               kv_threadpool_t *tp) {
    struct kv_matmul_op op = {.X = X, .W = W, .bias = bias, .Y = Y, .M = M, .N = N, .K = K};
    run_batch(&op, 1, tp);
}

void kv_matmul_reference(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y) {
    int K16 = K - K % 16;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *x = X + (size_t)m * K, *w = W + (size_t)n * K;
            float lane[16];
            for (int j = 0; j < 16; j++) {
                lane[j] = 0.0f;
                for (int k = j; k < K16; k += 16) {
                    volatile float p = x[k] * w[k]; /* volatile: the product is rounded, never fused */
                    lane[j] = lane[j] + p;
                }
            }
            float l8[8], l4[4], l2[2];
            for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
            for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
            for (int j = 0; j < 2; j++) l2[j] = l4[j] + l4[j + 2];
            float s = l2[0] + l2[1];
            for (int k = K16; k < K; k++) {
                volatile float p = x[k] * w[k];
                s = s + p;
            }
            if (bias) s = s + bias[n];
            Y[(size_t)m * N + n] = s;
        }
}
