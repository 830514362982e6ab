/*
 * matmul: batch-invariant Y = X W^T (see matmul.h for the arithmetic contract).
 *
 * Three kernel families do the same IEEE operations in the same order: AVX-512 and AVX2
 * (intrinsics, fused multiply-add) and generic (scalar fmaf). Only the register blocking
 * differs, chosen per ISA so the accumulators fit the register file: AVX-512 has 32 zmm
 * (4x4 tile: 16 accumulators + 4 W vectors + 1 X vector), AVX2 16 ymm (3x2 tile: 6
 * accumulators of two ymm each = 12, + 2 W halves + 1 X half; the same 16-lane accumulator
 * is processed as its low and high 8 lanes, which are independent lanes of the contract).
 * The file is compiled with fp-contract off so that only the explicit fmas fuse.
 */
#include "matmul.h"

#include "../../quant/q8.h"
#include "../../quant/qdot.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "simd_internal.h"
#ifdef KV_CPU_X86
#define KV_MATMUL_X86 1
#endif

#define AI static inline __attribute__((always_inline))

/* Columns [n0, n1) of all M rows of op, with W rows n0.. at Wp (stride ldw floats). */
typedef void (*cols_fn)(const struct kv_matmul_op *op, const float *Wp, size_t ldw, int n0, int n1);

/* ---- generic: scalar, the contract literally ---- */

AI float dot_generic(const float *x, const float *w, int K) {
    int K16 = K - K % 16;
    float lane[16];
    for (int j = 0; j < 16; j++) lane[j] = 0.0f;
    for (int k = 0; k < K16; k += 16)
        for (int j = 0; j < 16; j++) lane[j] = fmaf(x[k + j], w[k + j], lane[j]);
    float l8[8], l4[4];
    for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
    for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
    float s = (l4[0] + l4[2]) + (l4[1] + l4[3]);
    for (int k = K16; k < K; k++) s = fmaf(x[k], w[k], s);
    return s;
}

static void cols_generic(const struct kv_matmul_op *op, const float *Wp, size_t ldw, int n0, int n1) {
    const int K = op->W->cols, N = op->W->rows;
    for (int m = 0; m < op->M; m++)
        for (int n = n0; n < n1; n++) {
            float s = dot_generic(op->X + (size_t)m * K, Wp + (size_t)(n - n0) * ldw, K);
            if (op->bias) s = s + op->bias[n];
            op->Y[(size_t)m * N + n] = s;
        }
}

#ifdef KV_MATMUL_X86
/* ---- AVX-512 ---- */
#define T512 KV_T512

AI T512 void tile512(const float *X, size_t ldx, const float *W, size_t ldw, int K, const float *bias, float *Y,
                     size_t ldy, const int R, const int C, const int PF) {
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    int K16 = K - K % 16;
    for (int k = 0; k < K16; k += 16) {
        __m512 w[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) w[c] = _mm512_loadu_ps(W + c * ldw + k);
        if (PF) {
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)
                __builtin_prefetch((const void *)((uintptr_t)(W + k) + (C + c) * ldw * sizeof(float)), 0, 3);
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            __m512 x = _mm512_loadu_ps(X + r * ldx + k);
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(x, w[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {
            float s = kv_hsum512(acc[r][c]);
            for (int k = K16; k < K; k++) s = __builtin_fmaf(X[r * ldx + k], W[c * ldw + k], s);
            if (bias) s = s + bias[c];
            Y[r * ldy + c] = s;
        }
}

static T512 void cols_avx512(const struct kv_matmul_op *op, const float *Wp, size_t ldw, int n0, int n1) {
    const size_t K = (size_t)op->W->cols, N = (size_t)op->W->rows;
    const float *b = op->bias;
    int m = 0;
#define ROWS(R, PF)                                                                                           \
    do {                                                                                                    \
        const float *x = op->X + m * K;                                                                     \
        float *y = op->Y + m * N;                                                                           \
        int n = n0;                                                                                         \
        for (; n + 4 <= n1; n += 4)                                                                         \
            tile512(x, K, Wp + (n - n0) * ldw, ldw, (int)K, b ? b + n : NULL, y + n, N, R, 4, PF);          \
        for (; n < n1; n++) tile512(x, K, Wp + (n - n0) * ldw, ldw, (int)K, b ? b + n : NULL, y + n, N, R, 1, 0); \
    } while (0)
    if (op->M < 16)
        for (; m + 4 <= op->M; m += 4) ROWS(4, 1);
    else
        for (; m + 4 <= op->M; m += 4) ROWS(4, 0);
    if (op->M - m == 3) ROWS(3, 1);
    else if (op->M - m == 2) ROWS(2, 1);
    else if (op->M - m == 1) ROWS(1, 0);
#undef ROWS
}

/* ---- AVX2 + FMA ---- */
#define T256 KV_T256

/* The tree over 16 lanes held as lo (lanes 0..7) and hi (8..15). */
AI T256 void tile256(const float *X, size_t ldx, const float *W, size_t ldw, int K, const float *bias, float *Y,
                     size_t ldy, const int R, const int C, const int PF) {
    __m256 acc[3][4][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    int K16 = K - K % 16;
    for (int k = 0; k < K16; k += 16) {
        if (PF) {
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)
                __builtin_prefetch((const void *)((uintptr_t)(W + k) + (C + c) * ldw * sizeof(float)), 0, 3);
        }
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256 w[4];
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) w[c] = _mm256_loadu_ps(W + c * ldw + k + 8 * h);
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                __m256 x = _mm256_loadu_ps(X + r * ldx + k + 8 * h);
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)
                    acc[r][c][h] = _mm256_fmadd_ps(x, w[c], acc[r][c][h]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {
            float s = kv_hsum256x2(acc[r][c][0], acc[r][c][1]);
            for (int k = K16; k < K; k++) s = __builtin_fmaf(X[r * ldx + k], W[c * ldw + k], s);
            if (bias) s = s + bias[c];
            Y[r * ldy + c] = s;
        }
}

static T256 void cols_avx2(const struct kv_matmul_op *op, const float *Wp, size_t ldw, int n0, int n1) {
    const size_t K = (size_t)op->W->cols, N = (size_t)op->W->rows;
    const float *b = op->bias;
    int m = 0;
#define ROWS(R, C, PF)                                                                                        \
    do {                                                                                                    \
        const float *x = op->X + m * K;                                                                     \
        float *y = op->Y + m * N;                                                                           \
        int n = n0;                                                                                         \
        for (; n + C <= n1; n += C)                                                                         \
            tile256(x, K, Wp + (n - n0) * ldw, ldw, (int)K, b ? b + n : NULL, y + n, N, R, C, PF);          \
        for (; n < n1; n++) tile256(x, K, Wp + (n - n0) * ldw, ldw, (int)K, b ? b + n : NULL, y + n, N, R, 1, 0); \
    } while (0)
    for (; m + 3 <= op->M; m += 3) ROWS(3, 2, op->M < 16);
    if (op->M - m == 2) ROWS(2, 2, 1);
    else if (op->M - m == 1) ROWS(1, 4, 0);
#undef ROWS
}
#endif /* KV_MATMUL_X86 */

/* ---- ISA choice ---- */

static _Atomic int g_isa = KV_MATMUL_ISA_AUTO; /* resolved set, never AUTO after first use */

static enum kv_matmul_isa best_isa(void) {
#ifdef KV_MATMUL_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return KV_MATMUL_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return KV_MATMUL_ISA_AVX2;
#endif
    return KV_MATMUL_ISA_GENERIC;
}

_Static_assert((int)KV_MATMUL_ISA_GENERIC == (int)KV_QUANT_ISA_GENERIC && (int)KV_MATMUL_ISA_AVX2 == (int)KV_QUANT_ISA_AVX2 &&
                   (int)KV_MATMUL_ISA_AVX512 == (int)KV_QUANT_ISA_AVX512,
               "the matmul and quant ISA enums share values");

kv_status kv_cpu_isa_env(enum kv_matmul_isa *out, char *err, size_t errlen) {
    *out = KV_MATMUL_ISA_AUTO;
    int v = kv_quant_isa_env(); /* enum kv_quant_isa has kv_matmul_isa's values */
    const char *e = getenv("KVSERVE_CPU_ISA");
    if (v < 0) return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_ISA=%s: expected generic, avx2 or avx512", e);
    if (v > (int)best_isa())
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "KVSERVE_CPU_ISA=%s: this CPU lacks it (best: %s)", e,
                       best_isa() == KV_MATMUL_ISA_AVX2 ? "avx2" : "generic");
    *out = (enum kv_matmul_isa)v;
    return KV_OK;
}

/* KVSERVE_CPU_ISA, or AUTO (an invalid value: AUTO, with a warning; the CLIs refuse it first
 * through kv_cpu_isa_env). */
static enum kv_matmul_isa env_isa(void) {
    enum kv_matmul_isa isa;
    char err[160];
    if (kv_cpu_isa_env(&isa, err, sizeof err) != KV_OK) {
        KV_WARN("%s; using the CPU's best kernels", err);
        return KV_MATMUL_ISA_AUTO;
    }
    return isa;
}

enum kv_matmul_isa kv_matmul_set_isa(enum kv_matmul_isa isa) {
    enum kv_matmul_isa best = best_isa();
    if (isa == KV_MATMUL_ISA_AUTO) isa = env_isa();
    if (isa == KV_MATMUL_ISA_AUTO || isa > best) isa = best;
    atomic_store(&g_isa, (int)isa);
    kv_quant_set_isa(isa == KV_MATMUL_ISA_AVX512 ? KV_QUANT_ISA_AVX512
                     : isa == KV_MATMUL_ISA_AVX2 ? KV_QUANT_ISA_AVX2
                                                 : KV_QUANT_ISA_GENERIC);
    return isa;
}

enum kv_matmul_isa kv_matmul_get_isa(void) {
    int isa = atomic_load_explicit(&g_isa, memory_order_relaxed);
    if (isa == KV_MATMUL_ISA_AUTO) isa = (int)kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
    return (enum kv_matmul_isa)isa;
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

/* ---- per-thread dequantization panel ---- */

struct panel {
    float *p;
    size_t cap; /* floats */
};
static pthread_key_t g_panel_key;
static pthread_once_t g_panel_once = PTHREAD_ONCE_INIT;
static void panel_free(void *v) {
    struct panel *pn = v;
    if (pn) free(pn->p);
    free(pn);
}
static void panel_key_init(void) {
    if (pthread_key_create(&g_panel_key, panel_free)) abort();
}
/* This thread's panel of at least n floats (freed when the thread exits), or NULL. */
static float *thread_panel(size_t n) {
    pthread_once(&g_panel_once, panel_key_init);
    struct panel *pn = pthread_getspecific(g_panel_key);
    if (!pn) {
        pn = calloc(1, sizeof *pn);
        if (!pn || pthread_setspecific(g_panel_key, pn)) {
            free(pn);
            return NULL;
        }
    }
    if (pn->cap < n) {
        float *np = malloc(n * sizeof(float));
        if (!np) return NULL;
        free(pn->p);
        pn->p = np;
        pn->cap = n;
    }
    return pn->p;
}

/* ---- per-thread buffers of the integer path: activations (the calling thread) and panels
 * (each task's thread; the calling thread runs tasks too, hence two keys) ---- */
struct q8buf {
    void *p;
    size_t cap;
};
static pthread_key_t g_q8_key[2];
static pthread_once_t g_q8_once = PTHREAD_ONCE_INIT;
static void q8buf_free(void *v) {
    struct q8buf *b = v;
    if (b) free(b->p);
    free(b);
}
static void q8_key_init(void) {
    if (pthread_key_create(&g_q8_key[0], q8buf_free) || pthread_key_create(&g_q8_key[1], q8buf_free)) abort();
}
/* This thread's buffer `which` of at least n bytes, 64-byte aligned (freed at thread exit), or NULL. */
static void *thread_buf(int which, size_t n) {
    pthread_once(&g_q8_once, q8_key_init);
    struct q8buf *b = pthread_getspecific(g_q8_key[which]);
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b || pthread_setspecific(g_q8_key[which], b)) {
            free(b);
            return NULL;
        }
    }
    if (b->cap < n) {
        void *np = aligned_alloc(64, (n + 63) & ~(size_t)63);
        if (!np) return NULL;
        free(b->p);
        b->p = np;
        b->cap = n;
    }
    return b->p;
}
static void *thread_q8buf(size_t n) { return thread_buf(0, n); }
static void *thread_q8panel(size_t n) { return thread_buf(1, n); }

/* ---- work split ---- */

#define MAX_BATCH 8
#define L2_BLOCK_BYTES (192 * 1024) /* f32 W rows per task: about this many bytes, stays in L2 */
/* Below this many multiply-adds in one batch, waking the pool costs more than it saves: run
 * on the calling thread (results are identical either way: each element is computed whole). */
#define INLINE_MACS (1L << 18)
#define DECODE_ROWS 4  /* M at or below which quantized rows go through kv_qdot_rows (fused) */

struct plan {
    const struct kv_matmul_op *ops;
    int n_ops;
    int nb[MAX_BATCH];        /* W rows per task (multiple of 8 except the last task) */
    int first[MAX_BATCH + 1]; /* first task of op i; first[n_ops] = total */
    cols_fn fn;
    const struct kv_q8_act *q8[MAX_BATCH]; /* op i's quantized activations (integer path), or NULL */
};

static void plan_task(void *p, int t, int th) {
    (void)th;
    const struct plan *pl = p;
    int i = 0;
    while (t >= pl->first[i + 1]) i++;
    const struct kv_matmul_op *op = &pl->ops[i];
    const struct kv_wmat *W = op->W;
    int n0 = (t - pl->first[i]) * pl->nb[i];
    int n1 = n0 + pl->nb[i] < W->rows ? n0 + pl->nb[i] : W->rows;
    size_t K = (size_t)W->cols;
    if (W->type == KV_QTYPE_F32) {
        pl->fn(op, (const float *)W->data + (size_t)n0 * K, K, n0, n1);
        return;
    }
    if (pl->q8[i] || op->M <= DECODE_ROWS) { /* decode: dequantize in registers, nothing written but Y */
        if (pl->q8[i] && op->M > DECODE_ROWS && kv_q8_packed_fast(W->type)) {
            /* prefill: repack the task's rows once (VNNI order), then outer products for all M */
            size_t pb = kv_q8_pack_bytes(W->type, n1 - n0, (int)K);
            void *panel = thread_q8panel(pb);
            if (!panel) abort(); /* ~1.3 bytes per weight of one task: out of memory here is fatal */
            kv_q8_pack(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, (int)K, panel);
            kv_q8_dot_packed(W->type, panel, n1 - n0, pl->q8[i], 0, op->M, op->Y + n0, (size_t)W->rows);
        } else if (pl->q8[i])
            kv_q8_dot_rows(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, pl->q8[i],
                           0, op->M, op->Y + n0, (size_t)W->rows);
        else
            kv_qdot_rows(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, (int)K,
                         op->X, K, op->M, op->Y + n0, (size_t)W->rows);
        if (op->bias)
            for (int m = 0; m < op->M; m++)
                for (int n = n0; n < n1; n++) op->Y[(size_t)m * W->rows + n] = op->Y[(size_t)m * W->rows + n] + op->bias[n];
        return;
    }
    int g = pl->nb[i];
    float *pn = thread_panel((size_t)g * (K ? K : 1));
    if (!pn) abort(); /* ~200 KiB per thread: out of memory here is fatal */
    for (int a = n0; a < n1; a += g) {
        int b = a + g < n1 ? a + g : n1;
        for (int r = a; r < b; r++)
            kv_dequant_row(W->type, (const char *)W->data + (size_t)r * W->row_bytes, pn + (size_t)(r - a) * K,
                           (int64_t)K);
        pl->fn(op, pn, K, a, b);
    }
}

/* ---- integer path: quantized activations, per op (shared by ops with the same X) ---- */

static _Atomic int g_quant = KV_MATMUL_QUANT_AUTO;

enum kv_matmul_quant kv_matmul_set_quant(enum kv_matmul_quant q) {
    if (q == KV_MATMUL_QUANT_AUTO) {
        const char *e = getenv("KVSERVE_CPU_QUANT_MATMUL");
        char err[160];
        q = KV_MATMUL_QUANT_INT8;
        if (e && *e && kv_matmul_quant_parse(e, &q, err, sizeof err) != KV_OK) {
            KV_WARN("KVSERVE_CPU_QUANT_MATMUL: %s; using int8", err);
            q = KV_MATMUL_QUANT_INT8;
        }
    }
    atomic_store(&g_quant, (int)q);
    return q;
}

enum kv_matmul_quant kv_matmul_get_quant(void) {
    int q = atomic_load_explicit(&g_quant, memory_order_relaxed);
    return q == KV_MATMUL_QUANT_AUTO ? kv_matmul_set_quant(KV_MATMUL_QUANT_AUTO) : (enum kv_matmul_quant)q;
}

const char *kv_matmul_quant_name(enum kv_matmul_quant q) {
    return q == KV_MATMUL_QUANT_F32 ? "f32" : q == KV_MATMUL_QUANT_INT8 ? "int8" : "auto";
}

kv_status kv_cpu_env_check(char *err, size_t errlen) {
    enum kv_matmul_isa isa;
    enum kv_matmul_quant q;
    kv_status st = kv_cpu_isa_env(&isa, err, errlen);
    if (st != KV_OK) return st;
    const char *e = getenv("KVSERVE_CPU_QUANT_MATMUL");
    if (e && *e && kv_matmul_quant_parse(e, &q, err, errlen) != KV_OK)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_QUANT_MATMUL=%s: expected int8 or f32", e);
    if (kv_q8_amx_env() < 0)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_AMX=%s: expected 0 (off) or 1", getenv("KVSERVE_CPU_AMX"));
    return KV_OK;
}

kv_status kv_matmul_quant_parse(const char *s, enum kv_matmul_quant *out, char *err, size_t errlen) {
    if (s && !strcasecmp(s, "int8")) *out = KV_MATMUL_QUANT_INT8;
    else if (s && !strcasecmp(s, "f32")) *out = KV_MATMUL_QUANT_F32;
    else return kv_errf(KV_EINVAL, err, errlen, "'%s': expected int8 or f32", s ? s : "");
    return KV_OK;
}

/* Quantizes the activations of the ops that take the integer path (pl->q8[i]); ops with the
 * same X, M and group share one copy. acts: MAX_BATCH slots owned by the caller. */
static void plan_q8(struct plan *pl, struct kv_q8_act *acts) {
    const struct kv_matmul_op *ops = pl->ops;
    size_t off[MAX_BATCH], total = 0;
    int src[MAX_BATCH];
    for (int i = 0; i < pl->n_ops; i++) {
        pl->q8[i] = NULL;
        src[i] = -1;
        const struct kv_matmul_op *op = &ops[i];
        int G = kv_q8_group(op->W->type);
        if (!G || op->M < 1 || op->W->cols < 1 || op->W->rows < 1) continue;
        src[i] = i;
        for (int j = 0; j < i; j++)
            if (src[j] == j && ops[j].X == op->X && ops[j].M == op->M && ops[j].W->cols == op->W->cols &&
                kv_q8_group(ops[j].W->type) == G)
                src[i] = j;
        if (src[i] == i) {
            off[i] = total;
            total += (kv_q8_act_bytes(op->M, op->W->cols, G) + 63) & ~(size_t)63;
        }
    }
    if (!total) return;
    char *buf = thread_q8buf(total);
    if (!buf) abort(); /* M x K bytes: out of memory here is fatal, like the panel */
    for (int i = 0; i < pl->n_ops; i++) {
        if (src[i] != i) continue;
        const struct kv_matmul_op *op = &ops[i];
        kv_q8_act_init(&acts[i], buf + off[i], op->M, op->W->cols, kv_q8_group(op->W->type));
        kv_q8_quantize(&acts[i], 0, op->M, op->X, (size_t)op->W->cols);
    }
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] >= 0) pl->q8[i] = &acts[src[i]];
}

static void run_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp) {
    int n_threads = tp ? kv_threadpool_size(tp) : 1;
    struct plan pl = {.ops = ops, .n_ops = n_ops, .fn = current_fn()};
    struct kv_q8_act acts[MAX_BATCH];
    if (kv_matmul_get_quant() == KV_MATMUL_QUANT_INT8) plan_q8(&pl, acts);
    long total_rows = 0, macs = 0;
    for (int i = 0; i < n_ops; i++) {
        int M = ops[i].M > 0 ? ops[i].M : 0;
        total_rows += M ? ops[i].W->rows : 0;
        macs += (long)M * ops[i].W->rows * (ops[i].W->cols > 0 ? ops[i].W->cols : 1);
    }
    if (macs < INLINE_MACS) n_threads = 1;
    pl.first[0] = 0;
    for (int i = 0; i < n_ops; i++) {
        const struct kv_matmul_op *op = &ops[i];
        int N = op->W->rows, nb = 0;
        if (op->M > 0 && N > 0) {
            size_t row_bytes = (size_t)(op->W->cols > 0 ? op->W->cols : 1) * sizeof(float);
            nb = (int)(L2_BLOCK_BYTES / row_bytes) & ~7;
            /* at least ~4 tasks per thread over the whole batch, for load balance */
            int fair = (int)((total_rows + 4L * n_threads - 1) / (4L * n_threads));
            fair = (fair + 7) & ~7;
            if (nb > fair) nb = fair;
            if (nb < 8) nb = 8;
        }
        pl.nb[i] = nb;
        pl.first[i + 1] = pl.first[i] + (nb ? (N + nb - 1) / nb : 0);
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

void kv_matmul_w(const float *X, int M, const struct kv_wmat *W, const float *bias, float *Y, kv_threadpool_t *tp) {
    struct kv_matmul_op op = {.X = X, .W = W, .bias = bias, .Y = Y, .M = M};
    run_batch(&op, 1, tp);
}

void kv_matmul(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y,
               kv_threadpool_t *tp) {
    struct kv_wmat w = kv_wmat_from_f32(W, N, K);
    kv_matmul_w(X, M, &w, bias, Y, tp);
}

void kv_matmul_reference(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y) {
    int K16 = K - K % 16;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *x = X + (size_t)m * K, *w = W + (size_t)n * K;
            float lane[16];
            for (int j = 0; j < 16; j++) {
                lane[j] = 0.0f;
                for (int k = j; k < K16; k += 16) lane[j] = fmaf(x[k], w[k], lane[j]);
            }
            float l8[8], l4[4], l2[2];
            for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
            for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
            for (int j = 0; j < 2; j++) l2[j] = l4[j] + l4[j + 2];
            float s = l2[0] + l2[1];
            for (int k = K16; k < K; k++) s = fmaf(x[k], w[k], s);
            if (bias) s = s + bias[n];
            Y[(size_t)m * N + n] = s;
        }
}
