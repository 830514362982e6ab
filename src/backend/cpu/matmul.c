/*
 * matmul: batch-invariant Y = X W^T (see matmul.h for the arithmetic contract).
 *
 * Three kernel families do the same IEEE operations in the same order: AVX-512 and AVX2
 * (intrinsics, fused multiply-add) and generic (scalar fmaf). Only the blocking differs,
 * chosen per ISA so the accumulators fit the register file (the tile shapes: matmul_internal.h;
 * the tiles and their K blocking: matmul_x86.c). This file holds the generic family, the ISA and mode choices, the per-thread
 * buffers and the planning: which kernel runs each task's columns (f32 tiles, grouped 16-bit
 * tiles, the quantized integer path, BF16 mode) and how a batch of ops is cut into tasks.
 * The file is compiled with fp-contract off so that only the explicit fmas fuse.
 */
#include "matmul.h"

#include "../../quant/q8.h"
#include "../../quant/qdot.h"
#include "../backend.h"
#include "matmul_bf16.h"

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
#include <sys/mman.h>
#include <unistd.h>

#include "matmul_internal.h" /* after the pragma: its simd_internal.h helpers are compiled under it */

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

static void cols_generic(const struct cols_args *a) {
    const struct kv_matmul_op *op = a->op;
    const float *Wp = a->Wp;
    const size_t ldw = a->ldw; /* the generic family always gets W in place */
    const int n0 = a->n0, n1 = a->n1, K = op->W->cols, N = op->W->rows;
    for (int m = 0; m < op->M; m++)
        for (int n = n0; n < n1; n++) {
            float s = dot_generic(op->X + (size_t)m * K, Wp + (size_t)(n - n0) * ldw, K);
            if (op->bias) s = s + op->bias[n];
            op->Y[(size_t)m * N + n] = s;
        }
}

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
    if (isa == KV_MATMUL_ISA_AVX512) return kv_mm_cols_avx512;
    if (isa == KV_MATMUL_ISA_AVX2) return kv_mm_cols_avx2;
#endif
    return cols_generic;
}

const char *kv_matmul_isa_name(void) {
    cols_fn f = current_fn();
#ifdef KV_MATMUL_X86
    if (f == kv_mm_cols_avx512) return "avx512";
    if (f == kv_mm_cols_avx2) return "avx2";
#endif
    (void)f;
    return "generic";
}

/* ---- per-thread buffers (freed at thread exit), one key per use because they are live at
 * the same time on one thread: the integer path's quantized activations (the calling thread,
 * for the whole batch), a task's weight panel (the quantized rows repacked, or dequantized to
 * f32: a task uses one of the two), the float tiles' saved partial sums (inside a task), the
 * packed X of the float tiles (the calling thread, for the whole batch) ---- */
struct tbuf {
    void *p;
    size_t cap;
};
static pthread_key_t g_buf_key[BUF_N];
static pthread_once_t g_buf_once = PTHREAD_ONCE_INIT;
static void tbuf_free(void *v) {
    struct tbuf *b = v;
    if (b) free(b->p);
    free(b);
}
static void buf_key_init(void) {
    for (int i = 0; i < BUF_N; i++)
        if (pthread_key_create(&g_buf_key[i], tbuf_free)) abort();
}
/* matmul_internal.h */
void *kv_mm_thread_buf(int which, size_t n) {
    pthread_once(&g_buf_once, buf_key_init);
    struct tbuf *b = pthread_getspecific(g_buf_key[which]);
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b || pthread_setspecific(g_buf_key[which], b)) {
            free(b);
            return NULL;
        }
    }
    if (b->cap < n) {
        /* from 1 MiB on (a task's W panel, a packed X): 2 MiB-aligned on transparent huge pages,
         * as the tiles walk them with strides that would miss the TLB on 4 KiB pages */
        const size_t huge = (size_t)2 << 20;
        int big = n >= huge / 2;
        size_t len = big ? (n + huge - 1) & ~(huge - 1) : (n + 63) & ~(size_t)63;
        void *np = aligned_alloc(big ? huge : 64, len);
        if (!np) return NULL;
#ifdef MADV_HUGEPAGE
        if (big) (void)madvise(np, len, MADV_HUGEPAGE); /* advisory */
#endif
        free(b->p);
        b->p = np;
        b->cap = n;
    }
    return b->p;
}

/* ---- work split ---- */

#define MAX_BATCH 8
/* f32 W rows per task: about this many bytes, half the L2 of a core (1 MiB on Sapphire Rapids'
 * 2 MiB; 256 KiB on a Zen 2/3 core's 512 KiB), so the task's rows stay in L2 while every X tile
 * passes them. Measured (bench_matmul --type f16 --m 512 --cpu-time, Sapphire Rapids, AVX-512 /
 * AVX2): 192 KiB -> 1 MiB took 2048 x 5632 from 78 to 126 / 53 to 77 GFLOP/s (the X tiles come
 * from L3: a larger block reuses each more), 5632 x 2048 108 -> 122 / 74 -> 86; 1.5-2 MiB was
 * slower again. */
static size_t block_bytes(void) {
    static _Atomic size_t cached;
    size_t b = atomic_load_explicit(&cached, memory_order_relaxed);
    if (b) return b;
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    b = l2 > 0 ? (size_t)l2 / 2 : 512 * 1024;
    if (b < 128 * 1024) b = 128 * 1024;
    if (b > 1024 * 1024) b = 1024 * 1024;
    atomic_store_explicit(&cached, b, memory_order_relaxed);
    return b;
}

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
    const float *xp[MAX_BATCH]; /* op i's X packed for an x86 family's float tiles (kv_mm_pack_x), or NULL */
#ifdef KV_MATMUL_X86
    hcols_fn hf[MAX_BATCH]; /* op i's grouped 16-bit tiles (reading xp[i]), or NULL */
#endif
    /* BF16 mode (matmul_bf16.h): op i's BF16 weights take the bf16 tiles (bf[i]), with X packed
     * for family bff at bxp[i] (NULL for the generic family) */
    bool bf[MAX_BATCH];
    const void *bxp[MAX_BATCH];
    enum kv_bf16_family bff;
};

/* Y[m][n] += bias[n] for the columns n0 .. n1 - 1 of a decode product (the kernels there write
 * the dot products only; the contract adds the bias last, in one rounding). */
static void add_bias(const struct kv_matmul_op *op, int n0, int n1) {
    if (!op->bias) return;
    const size_t N = (size_t)op->W->rows;
    for (int m = 0; m < op->M; m++)
        for (int n = n0; n < n1; n++) op->Y[(size_t)m * N + n] = op->Y[(size_t)m * N + n] + op->bias[n];
}

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
    if (pl->bf[i]) { /* BF16 mode: every M, straight from the stored rows (grouped or the file's) */
        bool g = W->panel && kv_fgroup_ok(W->type, W->cols);
        struct kv_bf16_w bw = {g ? (const char *)W->panel + (size_t)n0 * W->row_bytes
                                 : (const char *)W->data + (size_t)n0 * W->row_bytes,
                               W->row_bytes, g, n1 - n0};
        float *sums = thread_sums(kv_bf16_sums_floats(pl->bff, op->M, (int)K, n1 - n0));
        kv_bf16_cols(pl->bff, pl->bxp[i], op->X, K, op->M, (int)K, &bw, op->bias ? op->bias + n0 : NULL, op->Y + n0,
                     (size_t)W->rows, sums);
        return;
    }
    if (W->type == KV_QTYPE_F32 && op->M > DECODE_ROWS) {
        struct cols_args ca = {op, pl->xp[i], (const float *)W->data + (size_t)n0 * K, K, n0, n1};
        pl->fn(&ca);
        return;
    }
    /* F16/BF16 in the grouped layout (qdot.h), repacked at load; n0 (a multiple of 8) starts a group */
    const char *grouped = W->panel && kv_fgroup_ok(W->type, W->cols) ? (const char *)W->panel + (size_t)n0 * W->row_bytes
                                                                      : NULL;
    /* decode rows of every type, F32 included (qdot's GEMV tiles: 8 weight rows per X row) */
    if (pl->q8[i] || op->M <= DECODE_ROWS) { /* decode: dequantize in registers, nothing written but Y */
        if (grouped) {
            kv_qdot_grouped(W->type, grouped, n1 - n0, (int)K, op->X, K, op->M, op->Y + n0, (size_t)W->rows);
        } else if (pl->q8[i] && W->panel && kv_q8_packed_fast(W->type)) {
            /* the matrix was repacked whole at load (struct kv_wmat.panel): outer products over
             * its row groups for every M, decode included (M < 4: up to 4 row groups read side by
             * side, concurrent sequential streams; q8_avx512.c packed_tile) */
            size_t gb = kv_q8_pack_bytes(W->type, 16, (int)K);
            kv_q8_dot_packed(W->type, (const char *)W->panel + (size_t)(n0 / 16) * gb, n1 - n0, pl->q8[i], 0, op->M,
                             op->Y + n0, (size_t)W->rows);
        } else if (pl->q8[i] && op->M > DECODE_ROWS && kv_q8_packed_fast(W->type) &&
                   !kv_q8_rows_preferred(W->type, op->M)) {
            /* prefill: repack the task's rows once (VNNI order), then outer products for all M
             * (not where the rows path is faster even so: AVX2 K-quants at many-sequence decode) */
            size_t pb = kv_q8_pack_bytes(W->type, n1 - n0, (int)K);
            void *panel = kv_mm_thread_buf(BUF_PANEL, pb);
            if (!panel) abort(); /* ~1.3 bytes per weight of one task: out of memory here is fatal */
            kv_q8_pack(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, (int)K, panel);
            kv_q8_dot_packed(W->type, panel, n1 - n0, pl->q8[i], 0, op->M, op->Y + n0, (size_t)W->rows);
        } else if (pl->q8[i])
            kv_q8_dot_rows(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, pl->q8[i],
                           0, op->M, op->Y + n0, (size_t)W->rows);
        else
            kv_qdot_rows(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, (int)K,
                         op->X, K, op->M, op->Y + n0, (size_t)W->rows);
        add_bias(op, n0, n1);
        return;
    }
#ifdef KV_MATMUL_X86
    /* F16/BF16 grouped rows: widened in registers by the grouped tiles (every group full) */
    if (pl->hf[i]) {
        struct cols_args ca = {op, pl->xp[i], NULL, K, n0, n1};
        pl->hf[i](&ca, (const uint8_t *)W->panel);
        return;
    }
#endif
    /* the task's rows dequantized to f32 */
    float *pn = kv_mm_thread_buf(BUF_PANEL, (size_t)(n1 - n0) * (K ? K : 1) * sizeof(float));
    if (!pn) abort(); /* about block_bytes() per thread: out of memory here is fatal */
    struct cols_args ca = {op, pl->xp[i], pn, K, n0, n1};
    if (grouped)
        kv_fgroup_rows(W->type, grouped, n1 - n0, (int)K, pn, K);
    else
        for (int r = n0; r < n1; r++)
            kv_dequant_row(W->type, (const char *)W->data + (size_t)r * W->row_bytes, pn + (size_t)(r - n0) * K,
                           (int64_t)K);
    pl->fn(&ca);
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

/* ---- BF16 mode (matmul_bf16.h) ---- */

static _Atomic int g_bf16 = KV_MATMUL_BF16_AUTO;     /* the mode asked for (AUTO: below) */
static _Atomic int g_bf16_env = -1;                  /* KVSERVE_CPU_BF16_MATMUL, parsed once */

enum kv_matmul_bf16 kv_matmul_bf16_default(void) {
#ifdef KV_MATMUL_X86
    static _Atomic int amd = -1;
    int a = atomic_load_explicit(&amd, memory_order_relaxed);
    if (a < 0) {
        __builtin_cpu_init();
        a = __builtin_cpu_is("amd") ? 1 : 0;
        atomic_store_explicit(&amd, a, memory_order_relaxed);
    }
    if (a && kv_bf16_family_for((int)kv_matmul_get_isa()) == KV_BF16_AVX512) return KV_MATMUL_BF16_BF16;
#endif
    return KV_MATMUL_BF16_F32;
}

/* AUTO resolved: the environment's choice, else the default for the ISA family in effect now. */
static enum kv_matmul_bf16 resolve_bf16(enum kv_matmul_bf16 m) {
    if (m != KV_MATMUL_BF16_AUTO) return m;
    int e = atomic_load_explicit(&g_bf16_env, memory_order_relaxed);
    if (e < 0) {
        const char *v = getenv("KVSERVE_CPU_BF16_MATMUL");
        char err[160];
        enum kv_matmul_bf16 p = KV_MATMUL_BF16_AUTO;
        if (v && *v && kv_matmul_bf16_parse(v, &p, err, sizeof err) != KV_OK) {
            KV_WARN("KVSERVE_CPU_BF16_MATMUL: %s; using auto", err);
            p = KV_MATMUL_BF16_AUTO;
        }
        e = (int)p;
        atomic_store_explicit(&g_bf16_env, e, memory_order_relaxed);
    }
    return e != KV_MATMUL_BF16_AUTO ? (enum kv_matmul_bf16)e : kv_matmul_bf16_default();
}

enum kv_matmul_bf16 kv_matmul_set_bf16(enum kv_matmul_bf16 m) {
    if (m == KV_MATMUL_BF16_AUTO) atomic_store(&g_bf16_env, -1); /* read the environment again */
    atomic_store(&g_bf16, (int)m);
    return resolve_bf16(m);
}

enum kv_matmul_bf16 kv_matmul_get_bf16(void) {
    return resolve_bf16((enum kv_matmul_bf16)atomic_load_explicit(&g_bf16, memory_order_relaxed));
}

const char *kv_matmul_bf16_name(enum kv_matmul_bf16 m) {
    return m == KV_MATMUL_BF16_F32 ? "f32" : m == KV_MATMUL_BF16_BF16 ? "bf16" : "auto";
}

kv_status kv_matmul_bf16_parse(const char *s, enum kv_matmul_bf16 *out, char *err, size_t errlen) {
    if (s && !strcasecmp(s, "bf16")) *out = KV_MATMUL_BF16_BF16;
    else if (s && !strcasecmp(s, "f32")) *out = KV_MATMUL_BF16_F32;
    else if (s && !strcasecmp(s, "auto")) *out = KV_MATMUL_BF16_AUTO;
    else return kv_errf(KV_EINVAL, err, errlen, "'%s': expected auto, bf16 or f32", s ? s : "");
    return KV_OK;
}

static enum kv_bf16_family bf16_family(void) { return kv_bf16_family_for((int)kv_matmul_get_isa()); }

const char *kv_matmul_bf16_family_name(void) {
    return kv_matmul_get_bf16() == KV_MATMUL_BF16_BF16 ? kv_bf16_family_name(bf16_family()) : "f32 kernels";
}

kv_status kv_cpu_env_check(char *err, size_t errlen) {
    enum kv_matmul_isa isa;
    enum kv_matmul_quant q;
    kv_status st = kv_cpu_isa_env(&isa, err, errlen);
    if (st != KV_OK) return st;
    const char *e = getenv("KVSERVE_CPU_QUANT_MATMUL");
    if (e && *e && kv_matmul_quant_parse(e, &q, err, errlen) != KV_OK)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_QUANT_MATMUL=%s: expected int8 or f32", e);
    enum kv_matmul_bf16 bm;
    e = getenv("KVSERVE_CPU_BF16_MATMUL");
    if (e && *e && kv_matmul_bf16_parse(e, &bm, err, errlen) != KV_OK)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_BF16_MATMUL=%s: expected auto, bf16 or f32", e);
    if (kv_q8_amx_env() < 0)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_AMX=%s: expected 0 (off) or 1", getenv("KVSERVE_CPU_AMX"));
    if (kv_quant_prefetch_env() < 0)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_PREFETCH=%s: expected auto, cache or nta",
                       getenv("KVSERVE_CPU_PREFETCH"));
    enum backend_cpu_float_layout fl;
    e = getenv("KVSERVE_CPU_FLOAT_LAYOUT");
    if (e && *e && backend_cpu_float_layout_parse(e, &fl) != KV_OK)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_FLOAT_LAYOUT=%s: expected rows or grouped", e);
    const char *const bools[] = {"KVSERVE_CPU_PREPACK", "KVSERVE_CPU_THP", "KVSERVE_CPU_PANEL_THP"};
    for (int i = 0; i < 3; i++) {
        e = getenv(bools[i]);
        if (e && *e && strcmp(e, "0") && strcmp(e, "1"))
            return kv_errf(KV_EINVAL, err, errlen, "%s=%s: expected 0 (off) or 1", bools[i], e);
    }
    return KV_OK;
}

kv_status kv_matmul_quant_parse(const char *s, enum kv_matmul_quant *out, char *err, size_t errlen) {
    if (s && !strcasecmp(s, "int8")) *out = KV_MATMUL_QUANT_INT8;
    else if (s && !strcasecmp(s, "f32")) *out = KV_MATMUL_QUANT_F32;
    else return kv_errf(KV_EINVAL, err, errlen, "'%s': expected int8 or f32", s ? s : "");
    return KV_OK;
}

/* Two products read the same activations (X, M rows of K): their quantized / packed copy is
 * made once (plan_q8, plan_xpack). */
static int same_x(const struct kv_matmul_op *a, const struct kv_matmul_op *b) {
    return a->X == b->X && a->M == b->M && a->W->cols == b->W->cols;
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
            if (src[j] == j && same_x(&ops[j], op) &&
                kv_q8_group(ops[j].W->type) == G)
                src[i] = j;
        if (src[i] == i) {
            off[i] = total;
            total += (kv_q8_act_bytes(op->M, op->W->cols, G) + 63) & ~(size_t)63;
        }
    }
    if (!total) return;
    char *buf = kv_mm_thread_buf(BUF_ACT, total);
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

/* Shares one packed copy of X among the ops that read the same X: need[i] = the bytes op i's
 * copy takes (0: op i takes none). On return src[i] = the op whose copy op i reads (the first
 * with the same X; -1 for none) and off[i] = a copy's byte offset (64-byte aligned) in a buffer
 * of the returned size. */
static size_t share_x(const struct plan *pl, const size_t *need, int *src, size_t *off) {
    size_t total = 0;
    for (int i = 0; i < pl->n_ops; i++) {
        src[i] = -1;
        if (!need[i]) continue;
        src[i] = i;
        for (int j = 0; j < i; j++)
            if (src[j] == j && same_x(&pl->ops[j], &pl->ops[i])) src[i] = j;
        if (src[i] == i) {
            off[i] = total;
            total += (need[i] + 63) & ~(size_t)63;
        }
    }
    return total;
}

/* BF16 mode: marks the ops with BF16 weights (pl->bf) and packs their X once per distinct X
 * for the bf16 family (pl->bxp; the generic family reads X in place). */
static void plan_bf16(struct plan *pl) {
    for (int i = 0; i < pl->n_ops; i++) {
        pl->bf[i] = false;
        pl->bxp[i] = NULL;
    }
    if (kv_matmul_get_bf16() != KV_MATMUL_BF16_BF16) return;
    pl->bff = bf16_family();
    size_t need[MAX_BATCH], off[MAX_BATCH];
    int src[MAX_BATCH];
    for (int i = 0; i < pl->n_ops; i++) {
        const struct kv_matmul_op *op = &pl->ops[i];
        pl->bf[i] = op->W->type == KV_QTYPE_BF16 && op->M >= 1 && op->W->cols >= 1 && op->W->rows >= 1;
        need[i] = pl->bf[i] ? kv_bf16_xpack_bytes(pl->bff, op->M, op->W->cols) : 0;
    }
    size_t total = share_x(pl, need, src, off);
    if (!total) return;
    char *buf = kv_mm_thread_buf(BUF_BF16X, total);
    if (!buf) abort(); /* M x K x 2-4 bytes, like the activations: out of memory here is fatal */
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] == i) kv_bf16_pack_x(pl->bff, pl->ops[i].X, (size_t)pl->ops[i].W->cols, pl->ops[i].M, pl->ops[i].W->cols, buf + off[i]);
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] >= 0) pl->bxp[i] = buf + off[src[i]];
}

/* Packs the X of every op that runs on an x86 family's float tiles (M > DECODE_ROWS, not the
 * integer path) once, in the caller's buffer; ops with the same X share it. Marks the ops whose
 * 16-bit grouped rows take the grouped tiles (pl->hf; same packing). */
static void plan_xpack(struct plan *pl) {
#ifdef KV_MATMUL_X86
    int R = pl->fn == kv_mm_cols_avx512 ? R512 : pl->fn == kv_mm_cols_avx2 ? R256 : 0;
    if (!R) return;
    size_t need[MAX_BATCH], off[MAX_BATCH];
    int src[MAX_BATCH];
    for (int i = 0; i < pl->n_ops; i++) {
        const struct kv_matmul_op *op = &pl->ops[i];
        const struct kv_wmat *W = op->W;
        bool take = !pl->q8[i] && !pl->bf[i] && op->M > DECODE_ROWS && W->cols >= 0 && W->rows >= 1;
        /* F16/BF16 grouped at load, every group full */
        bool grouped = W->panel && kv_fgroup_ok(W->type, W->cols) && W->rows % KV_FGROUP_ROWS == 0;
        pl->hf[i] = take && grouped ? kv_mm_hcols_for(pl->fn, W->type, op->M) : NULL;
        /* + 16 floats: a K < 16 op still gets a (never read) buffer */
        need[i] = take ? ((size_t)op->M * (size_t)(W->cols - W->cols % 16) + 16) * sizeof(float) : 0;
    }
    size_t total = share_x(pl, need, src, off);
    if (!total) return;
    char *buf = kv_mm_thread_buf(BUF_XPACK, total);
    if (!buf) abort(); /* M x K floats, like the activations: out of memory here is fatal */
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] == i) kv_mm_pack_x(pl->ops[i].X, pl->ops[i].M, pl->ops[i].W->cols, R, (float *)(buf + off[i]));
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] >= 0) pl->xp[i] = (const float *)(buf + off[src[i]]);
#else
    (void)pl;
#endif
}

static void run_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp) {
    int n_threads = tp ? kv_threadpool_size(tp) : 1;
    struct plan pl = {.ops = ops, .n_ops = n_ops, .fn = current_fn()};
    struct kv_q8_act acts[MAX_BATCH];
    if (kv_matmul_get_quant() == KV_MATMUL_QUANT_INT8) plan_q8(&pl, acts);
    plan_bf16(&pl);
    plan_xpack(&pl);
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
            nb = (int)(block_bytes() / row_bytes) & ~7;
            /* at least ~4 tasks per thread over the whole batch, for load balance */
            int fair = (int)((total_rows + 4L * n_threads - 1) / (4L * n_threads));
            fair = (fair + 7) & ~7;
            if (nb > fair) nb = fair;
            if (nb < 8) nb = 8;
            /* the float tiles take 3 W rows at a time (C512, C256): a task of a multiple of 24
             * rows has no 1- or 2-row remainder tile (a 16-row task, K = 5632 in f32, ran one
             * of its 6 tiles with a third of the work at the full cost) */
            if (op->M > DECODE_ROWS && !pl.q8[i] && !pl.bf[i] && nb >= 16) nb = (nb + 12) / 24 * 24;
            /* tasks start at a row group of a q8 panel (16 rows; the grouped F16/BF16 layout's
             * 4-row groups divide every nb here) */
            if (op->W->panel && !kv_fgroup_ok(op->W->type, op->W->cols)) nb = (nb + 15) & ~15;
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
