/*
 * attention: per-ISA kernels for the contract of attention.h. The generic family is the
 * contract in scalar C; the AVX2 and AVX-512 families do the same IEEE operations with
 * 16-lane vectors (AVX2: two ymm halves), widening f16 with F16C / AVX-512F conversions and
 * bf16 with a 16-bit shift (both exact). Compiled with fp-contract off: only the explicit
 * fmas fuse.
 */
#include "attention.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include <math.h>
#include <string.h>

#include "../../base/base.h"
#include "../../quant/quant.h"
#include "../backend.h"
#include "matmul.h"

#include "simd_internal.h"
#ifdef KV_CPU_X86
#define KV_ATTN_X86 1
#endif

#define AI static inline __attribute__((always_inline))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef KV_ATTN_X86
/* f32 -> f16 with F16C, 8 at a time: IEEE round-to-nearest-even, as kv_f32_to_f16 for every
 * non-NaN value (including subnormal results, overflow to inf and f32 subnormals, with the
 * default MXCSR); a group holding a NaN goes through kv_f32_to_f16 (its NaN is canonical). */
static KV_T256 void store_f16_f16c(uint16_t *d, const float *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {
            for (int t = 0; t < 8; t++) d[i + t] = kv_f32_to_f16(src[i + t]);
            continue;
        }
        _mm_storeu_si128((__m128i *)(void *)(d + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) d[i] = kv_f32_to_f16(src[i]);
}
#endif

void kv_store_row(void *dst, const float *src, int n, int kv_dtype) {
    if (kv_dtype == KV_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
#ifdef KV_ATTN_X86
    if (kv_dtype == KV_DTYPE_F16 && kv_matmul_get_isa() >= KV_MATMUL_ISA_AVX2) {
        store_f16_f16c(d, src, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) d[i] = kv_dtype == KV_DTYPE_F16 ? kv_f32_to_f16(src[i]) : f32_to_bf16(src[i]);
}

/* Element i of a stored row, widened exactly. */
AI float elem(const char *row, int i, int dt) {
    if (dt == KV_DTYPE_F32) {
        float f;
        memcpy(&f, row + 4 * (size_t)i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)i, 2);
    return dt == KV_DTYPE_F16 ? kv_f16_to_f32(h) : bf16_to_f32(h);
}

/* Row of position p of the run at byte offset off. */
AI const char *row_ptr(const struct kv_attn_args *a, size_t off, int p, size_t row_bytes) {
    return a->pool + (size_t)a->block_table[p / a->tpb] * a->block_bytes + off + (size_t)(p % a->tpb) * row_bytes;
}

/* Rows of positions [p, p + n) of the run at byte offset off (n <= 16), one division per
 * block instead of one per row. */
AI void rows_of(const struct kv_attn_args *a, size_t off, int p, int n, size_t rb, const char **out) {
    int blk = p / a->tpb, slot = p - blk * a->tpb;
    const char *base = a->pool + (size_t)a->block_table[blk] * a->block_bytes + off;
    for (int t = 0; t < n; t++, slot++) {
        if (slot == a->tpb) base = a->pool + (size_t)a->block_table[++blk] * a->block_bytes + off, slot = 0;
        out[t] = base + (size_t)slot * rb;
    }
}

/* Prefetches the rows of positions [p, min(p + n, end)) of the run at off: a run of one block
 * is only tpb rows long (2 KiB for 16 f16 rows of 64), too short for the hardware prefetcher,
 * and the next block's run is elsewhere in the pool. KV_PREFETCH_CACHE (quant.h) prefetches
 * into L2 (prefetcht1); nta (the mode NTA, read once per kv_attention call: the default on AMD)
 * uses prefetchnta: on a Zen 5 core decode attention at 8k context ran 1.2-1.3x faster with it
 * (AVX2 family 1.18-1.2x; 8-row prefill tiles 1.02-1.07x; in-process alternated runs,
 * docs/benchmarks.md). Prefetches only: same bits. */
AI void prefetch_rows(const struct kv_attn_args *a, size_t off, int p, int n, int end, size_t rb, const bool nta) {
    int e = p + n < end ? p + n : end;
    while (p < e) {
        int blk = p / a->tpb, slot = p - blk * a->tpb, in = a->tpb - slot < e - p ? a->tpb - slot : e - p;
        const char *r = a->pool + (size_t)a->block_table[blk] * a->block_bytes + off + (size_t)slot * rb;
        KV_PREFETCH_RANGE(r, (size_t)in * rb, nta, 2);
        p += in;
    }
}

/* kv_expf (attention.h's contract): exp(x) for the softmax's x = s_i - mx <= 0, from IEEE
 * binary32 operations only (one rounding each; fma fused), so the scalar code below and the
 * vector versions give the same bits:
 *   NaN -> x;  x < -87 -> +0
 *   n = rint(x * log2(e))  (nearest even);  r = fma(n, -C1, x);  r = fma(n, C2, r)
 *   p = P0;  p = fma(p, r, P1) ... fma(p, r, P5);  y = fma(p, r * r, r) + 1;  result = y * 2^n
 * C1 + C2 splits ln 2 so that n * C1 is exact; P0..P5 are the minimax coefficients of Cephes'
 * expf (S. Moshier, public domain). Error below 1 ulp of the exact exp on [-87, 0] (checked on
 * every 32nd float there). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#define EXP_MIN (-87.0f)

static inline float kv_expf(float x) {
    if (x != x) return x;
    if (x < EXP_MIN) return 0.0f;
    float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_C1, x);
    r = fmaf(n, EXP_C2, r);
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t b = (uint32_t)((int32_t)n + 127) << 23; /* n in [-126, 0] */
    float sc;
    memcpy(&sc, &b, 4);
    return y * sc;
}

/* The sum of the softmax: 16 lanes (lane j adds e_i for i = j, j + 16, ... < n16 in order),
 * the fixed tree of the dot products, then the tail in order. */
static inline float lanes_sum(const float lane[16], const float *e, int n16, int n) {
    float l8[8], l4[4];
    for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
    for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
    float s = (l4[0] + l4[2]) + (l4[1] + l4[3]);
    for (int i = n16; i < n; i++) s = s + e[i];
    return s;
}

/* The softmax part of the contract over scores[0..n), in place: e_i; returns 1 / sum. Scalar
 * transcription (the generic family's). */
static float softmax_generic(float *s, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (s[i] > mx) mx = s[i];
    const int n16 = n - n % 16;
    float lane[16] = {0};
    for (int i = 0; i < n; i++) {
        s[i] = kv_expf(s[i] - mx);
        if (i < n16) lane[i % 16] = lane[i % 16] + s[i];
    }
    return 1.0f / lanes_sum(lane, s, n16, n);
}

/* ---- generic ---- */

/* Scores row of (row j, head g): stride n_pos + n_rows - 1 floats. */
AI float *scores_of(const struct kv_attn_args *a, int j, int g) {
    return a->scores + ((size_t)j * a->n_group + g) * (size_t)(a->n_pos + a->n_rows - 1);
}

static void attn_generic_head(const struct kv_attn_args *a) {
    const int hd = a->head_dim, dt = a->kv_dtype, hd16 = hd - hd % 16;
    const size_t rb = (size_t)hd * kv_dtype_size(dt);
    for (int jg = 0; jg < a->n_rows * a->n_group; jg++) {
        int j = jg / a->n_group, g = jg % a->n_group, np = a->n_pos + j;
        const float *q = a->q + (size_t)j * a->q_stride + (size_t)g * hd;
        float *sc = scores_of(a, j, g);
        for (int i = 0; i < np; i++) {
            const char *k = row_ptr(a, a->k_off, i, rb);
            float lane[16];
            for (int j = 0; j < 16; j++) lane[j] = 0.0f;
            for (int e = 0; e < hd16; e += 16)
                for (int j = 0; j < 16; j++) lane[j] = fmaf(q[e + j], elem(k, e + j, dt), lane[j]);
            float l8[8], l4[4];
            for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
            for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
            float s = (l4[0] + l4[2]) + (l4[1] + l4[3]);
            for (int e = hd16; e < hd; e++) s = fmaf(q[e], elem(k, e, dt), s);
            sc[i] = s * a->scale;
        }
        float inv = softmax_generic(sc, np);
        float *out = a->out + (size_t)j * a->out_stride + (size_t)g * hd;
        for (int e = 0; e < hd; e++) out[e] = 0.0f;
        for (int i = 0; i < np; i++) {
            const char *v = row_ptr(a, a->v_off, i, rb);
            float w = sc[i] * inv;
            for (int e = 0; e < hd; e++) out[e] = fmaf(w, elem(v, e, dt), out[e]);
        }
    }
}

/* The softmax and value passes of the vector families (shared text; VACC is the family's
 * register-accumulator kernel, N64..N16 its vector counts for 64..16 floats of head_dim;
 * VACCM the same for NPM (row, head) pairs at once over chunks of DCH floats of NVM vectors,
 * NVM2 for a DCH/2 remainder). Use a, hd, hd16, dt, rb, R, G, n_last of the enclosing kernel.
 * Every out element still adds its positions' terms in increasing position: the pairs share
 * the V loads of their common positions, the remaining positions of a pair follow alone.
 * ATTN_SOFTMAX: softmax per (row, head) of a, 1/sum kept in INVS (recomputed from the e_i
 * when the tile x group exceeds the table); ATTN_VALUES_BLOCK: the value terms of the KV
 * block starting at position P0 (its rows are contiguous, so the block stays in L1 across the
 * tile's rows and the group's heads). */
#define ATTN_SOFTMAX(SOFTMAX, INVS) \
    do { \
        for (int jg = 0; jg < R * G; jg++) { \
            int j = jg / G, g = jg % G; \
            float iv = SOFTMAX(scores_of(a, j, g), a->n_pos + j); \
            if (jg < 256) (INVS)[jg] = iv; \
            memset(a->out + (size_t)j * a->out_stride + (size_t)g * hd, 0, (size_t)hd * sizeof(float)); \
        } \
    } while (0)
#define ATTN_VALUES_BLOCK(P0, INVS, VACC, N64, N48, N32, N16, VACCM, NPM, DCH, NVM, NVM2) \
    do { \
        const int p0 = (P0); \
        const float *invs = (INVS); \
        int jg = 0; \
        for (; jg + NPM <= R * G && (DCH) <= hd16 && hd16 % ((DCH) / 2) == 0; jg += NPM) { \
            int npa = a->n_pos + jg / G; /* the smallest position count of the NPM pairs */ \
            if (p0 >= npa) break; \
            int pc = p0 + a->tpb < npa ? p0 + a->tpb : npa; \
            const float *scs[NPM]; \
            float ivs[NPM], *outs[NPM]; \
            for (int x = 0; x < NPM; x++) { \
                int j = (jg + x) / G, g = (jg + x) % G; \
                scs[x] = scores_of(a, j, g); \
                ivs[x] = attn_inv(invs, jg + x, scs[x], a->n_pos + j); \
                outs[x] = a->out + (size_t)j * a->out_stride + (size_t)g * hd; \
            } \
            int d0 = 0; \
            for (; d0 + (DCH) <= hd16; d0 += (DCH)) VACCM(a, scs, ivs, outs, d0, p0, pc, rb, NVM, NPM); \
            if (hd16 - d0 == (DCH) / 2) VACCM(a, scs, ivs, outs, d0, p0, pc, rb, NVM2, NPM); \
            for (int x = 0; x < NPM; x++) { \
                int np = a->n_pos + (jg + x) / G, p1 = p0 + a->tpb < np ? p0 + a->tpb : np; \
                attn_v_tail(a, scs[x], ivs[x], outs[x], p0, pc, rb, hd16); \
                int e0 = 0; \
                for (; e0 < hd16 && hd16 - e0 >= 64; e0 += 64) VACC(a, scs[x], ivs[x], outs[x], e0, pc, p1, rb, N64); \
                if (hd16 - e0 == 48) VACC(a, scs[x], ivs[x], outs[x], e0, pc, p1, rb, N48); \
                else if (hd16 - e0 == 32) VACC(a, scs[x], ivs[x], outs[x], e0, pc, p1, rb, N32); \
                else if (hd16 - e0 == 16) VACC(a, scs[x], ivs[x], outs[x], e0, pc, p1, rb, N16); \
                attn_v_tail(a, scs[x], ivs[x], outs[x], pc, p1, rb, hd16); \
            } \
        } \
        for (; jg < R * G; jg++) { \
            int j = jg / G, g = jg % G, np = a->n_pos + j; \
            if (p0 >= np) continue; \
            int p1 = p0 + a->tpb < np ? p0 + a->tpb : np; \
            const float *sc = scores_of(a, j, g); \
            float iv = attn_inv(invs, jg, sc, np); \
            float *out = a->out + (size_t)j * a->out_stride + (size_t)g * hd; \
            int d0 = 0; \
            for (; d0 + 64 <= hd16; d0 += 64) VACC(a, sc, iv, out, d0, p0, p1, rb, N64); \
            if (hd16 - d0 == 48) VACC(a, sc, iv, out, d0, p0, p1, rb, N48); \
            else if (hd16 - d0 == 32) VACC(a, sc, iv, out, d0, p0, p1, rb, N32); \
            else if (hd16 - d0 == 16) VACC(a, sc, iv, out, d0, p0, p1, rb, N16); \
            attn_v_tail(a, sc, iv, out, p0, p1, rb, hd16); \
        } \
    } while (0)

/* The n_kv (>= 1) single-head argument sets of a (attention.h, n_kv). */
static int split_heads(const struct kv_attn_args *a, struct kv_attn_args *A) {
    int n = a->n_kv > 1 ? a->n_kv : 1;
    size_t per_scores = (size_t)a->n_rows * a->n_group * (size_t)(a->n_pos + a->n_rows - 1);
    for (int x = 0; x < n; x++) {
        A[x] = *a;
        A[x].n_kv = 1;
        A[x].k_off = a->k_off + (size_t)x * a->head_stride;
        A[x].v_off = a->v_off + (size_t)x * a->head_stride;
        A[x].q = a->q + (size_t)x * a->n_group * a->head_dim;
        A[x].out = a->out + (size_t)x * a->n_group * a->head_dim;
        A[x].scores = a->scores + (size_t)x * per_scores;
    }
    return n;
}

/* The vector families' kernel over the KV heads of a (shared text; SC is the scores
 * function, then ATTN_VALUES_BLOCK's family arguments): K and V are visited block by block
 * with the heads inside, so the heads' runs of a block (adjacent in the pool) are read as one
 * sequential region; each (row, head) still does exactly the contract's operations. */
#define ATTN_KERNEL(A0, CH, SC, SOFTMAX, ...) \
    do { \
        struct kv_attn_args A_[KV_ATTN_MAX_HEADS]; \
        const int H_ = split_heads((A0), A_); \
        const int hd = (A0)->head_dim, dt = (A0)->kv_dtype, hd16 = hd - hd % 16, R = (A0)->n_rows, G = (A0)->n_group; \
        const int n_last = (A0)->n_pos + R - 1; /* positions the last row attends */ \
        const size_t rb = (size_t)hd * kv_dtype_size(dt); \
        const bool nta_ = kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* prefetch_rows; once a call */ \
        (void)hd16; \
        for (int i0 = 0; i0 < n_last; i0 += (CH)) { \
            int ni = n_last - i0 < (CH) ? n_last - i0 : (CH); \
            for (int x = 0; x < H_; x++) { \
                if (dt == KV_DTYPE_F16) SC(&A_[x], i0, ni, rb, KV_DTYPE_F16, nta_); \
                else if (dt == KV_DTYPE_BF16) SC(&A_[x], i0, ni, rb, KV_DTYPE_BF16, nta_); \
                else SC(&A_[x], i0, ni, rb, KV_DTYPE_F32, nta_); \
            } \
        } \
        float invs_[KV_ATTN_MAX_HEADS][256]; \
        for (int x = 0; x < H_; x++) { \
            const struct kv_attn_args *a = &A_[x]; \
            ATTN_SOFTMAX(SOFTMAX, invs_[x]); \
        } \
        for (int p0_ = 0; p0_ < n_last; p0_ += (A0)->tpb) \
            for (int x = 0; x < H_; x++) { \
                const struct kv_attn_args *a = &A_[x]; \
                prefetch_rows(a, a->v_off, p0_ + a->tpb, a->tpb, n_last, rb, nta_); \
                ATTN_VALUES_BLOCK(p0_, invs_[x], __VA_ARGS__); \
            } \
    } while (0)

/* 1 / sum of (row, head) jg: from the table, or recomputed in order from its e_i. */
AI float attn_inv(const float *invs, int jg, const float *sc, int np) {
    if (jg < 256) return invs[jg];
    const int n16 = np - np % 16;
    float lane[16] = {0};
    for (int i = 0; i < n16; i++) lane[i % 16] = lane[i % 16] + sc[i];
    return 1.0f / lanes_sum(lane, sc, n16, np);
}
/* The head_dim % 16 tail of out over positions [p0, p1). */
AI void attn_v_tail(const struct kv_attn_args *a, const float *sc, float iv, float *out, int p0, int p1, size_t rb,
                    int hd16) {
    for (int i = p0; i < p1 && hd16 < a->head_dim; i++) {
        const char *v = row_ptr(a, a->v_off, i, rb);
        float w = sc[i] * iv;
        for (int e = hd16; e < a->head_dim; e++) out[e] = __builtin_fmaf(w, elem(v, e, a->kv_dtype), out[e]);
    }
}

#ifdef KV_ATTN_X86
/* Widest head_dim (its multiple of 16) whose K rows the vector families widen to f32 once per
 * chunk (scores512 / scores256): 16 rows of it on the stack, 16 KiB. */
#define KV_ATTN_WIDEN_MAX 256

/* ---- AVX-512 ---- */
#define T512 KV_T512

AI T512 __m512 ld512(const char *row, int e, int dt) {
    if (dt == KV_DTYPE_F32) return _mm512_loadu_ps((const void *)(row + 4 * (size_t)e));
    __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)e));
    if (dt == KV_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* out[g][d0 .. d0 + 16*NV) += over positions [p0, p1) (inside one block: its rows are
 * contiguous): w_i * v_i, accumulators in registers. */
AI T512 void vacc512(const struct kv_attn_args *a, const float *sc, float inv, float *out, int d0, int p0, int p1,
                     size_t rb, const int NV) {
    __m512 acc[4];
    _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) acc[u] = _mm512_loadu_ps(out + d0 + 16 * u);
    const char *v = p0 < p1 ? row_ptr(a, a->v_off, p0, rb) : NULL; /* [p0, p1) lies in one block */
    for (int i = p0; i < p1; i++, v += rb) {
        __m512 w = _mm512_set1_ps(sc[i] * inv);
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++)
            acc[u] = _mm512_fmadd_ps(w, ld512(v, d0 + 16 * u, a->kv_dtype), acc[u]);
    }
    _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) _mm512_storeu_ps(out + d0 + 16 * u, acc[u]);
}

/* The score loop of scores512 over the rows and heads of the tile: the main part of each dot
 * product reads K row t at km[t] as dtype dm (the pool's rows, or their f32 copy), the
 * head_dim % 16 tail at kr[t] as the pool's dt. */
AI T512 void scores512_rows(const struct kv_attn_args *a, int i0, int ni, const char *const *km, const int dm,
                            const char *const *kr, const int dt) {
    const int hd = a->head_dim, hd16 = hd - hd % 16;
    for (int j = 0; j < a->n_rows; j++) {
        int cnt = a->n_pos + j - i0; /* positions of this chunk row j sees */
        if (cnt <= 0) continue;
        if (cnt > ni) cnt = ni;
        for (int g = 0; g < a->n_group; g++) {
            const float *q = a->q + (size_t)j * a->q_stride + (size_t)g * hd;
            __m512 acc[16];
            _Pragma("GCC unroll 16") for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
            for (int e = 0; e < hd16; e += 16) {
                __m512 qv = _mm512_loadu_ps(q + e);
                _Pragma("GCC unroll 16") for (int t = 0; t < 16; t++)
                    acc[t] = _mm512_fmadd_ps(qv, ld512(km[t], e, dm), acc[t]);
            }
            float *sc = scores_of(a, j, g) + i0;
            if (hd16 == hd) { /* no tail: the sums scaled and stored as one vector */
                __m512 z = _mm512_mul_ps(kv_tree16_512v(acc), _mm512_set1_ps(a->scale));
                _mm512_mask_storeu_ps(sc, (__mmask16)((1u << cnt) - 1), z);
                continue;
            }
            float s[16];
            kv_tree16_512(acc, cnt, s);
            for (int t = 0; t < cnt; t++) {
                float v = s[t];
                for (int e = hd16; e < hd; e++) v = __builtin_fmaf(q[e], elem(kr[t], e, dt), v);
                sc[t] = v * a->scale;
            }
        }
    }
}

/* Scores of positions [i0, i0 + 16) (at most ni of them; rows past n_last are never read)
 * for every row and head of the tile: one accumulator per position, the 16 trees at once.
 * In prefill tiles (more than one row) f16 / bf16 K rows are widened once into an f32 copy on
 * the stack (exact: the same products follow), so the inner loop is loads and fmas only; a
 * decode row reads the pool's rows directly (at long context its K reads are the cost, and
 * the copy measured no better for a GQA group of 4). */
AI T512 void scores512(const struct kv_attn_args *a, int i0, int ni, size_t rb, const int dt, const bool nta) {
    const int hd = a->head_dim, hd16 = hd - hd % 16;
    const char *kr[16];
    rows_of(a, a->k_off, i0, ni, rb, kr);
    for (int t = ni; t < 16; t++) kr[t] = kr[ni - 1];
    prefetch_rows(a, a->k_off, i0 + 16, 16, a->n_pos + a->n_rows - 1, rb, nta);
    if (dt == KV_DTYPE_F32 || hd16 > KV_ATTN_WIDEN_MAX || a->n_rows < 2) {
        scores512_rows(a, i0, ni, kr, dt, kr, dt);
        return;
    }
    float kf[16 * KV_ATTN_WIDEN_MAX] __attribute__((aligned(64)));
    const char *km[16];
    for (int t = 0; t < 16; t++) {
        float *d = kf + (size_t)t * hd16;
        for (int e = 0; e < hd16; e += 16) _mm512_store_ps(d + e, ld512(kr[t], e, dt));
        km[t] = (const char *)d;
    }
    scores512_rows(a, i0, ni, km, KV_DTYPE_F32, kr, dt);
}

/* vacc512 for NP (row, head) pairs at once over their common positions [p0, p1): the V
 * vectors are loaded once for all pairs (NP * NV <= 16 accumulators). */
AI T512 void vaccm512(const struct kv_attn_args *a, const float *const *sc, const float *inv, float *const *out, int d0,
                      int p0, int p1, size_t rb, const int NV, const int NP) {
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int x = 0; x < NP; x++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) acc[x][u] = _mm512_loadu_ps(out[x] + d0 + 16 * u);
    const char *v = p0 < p1 ? row_ptr(a, a->v_off, p0, rb) : NULL; /* [p0, p1) lies in one block */
    for (int i = p0; i < p1; i++, v += rb) {
        __m512 vv[4];
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) vv[u] = ld512(v, d0 + 16 * u, a->kv_dtype);
        _Pragma("GCC unroll 4") for (int x = 0; x < NP; x++) {
            __m512 w = _mm512_set1_ps(sc[x][i] * inv[x]);
            _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) acc[x][u] = _mm512_fmadd_ps(w, vv[u], acc[x][u]);
        }
    }
    _Pragma("GCC unroll 4") for (int x = 0; x < NP; x++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) _mm512_storeu_ps(out[x] + d0 + 16 * u, acc[x][u]);
}

/* kv_expf on 16 lanes: the same operations in the same order (roundscale = rint). */
AI T512 __m512 expf512(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_C1), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_C2), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __mmask16 lo = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_LT_OQ), nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512i b = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_maskz_mov_ps((__mmask16)~(lo | nan), n)),
                                                   _mm512_set1_epi32(127)), 23);
    __m512 e = _mm512_maskz_mov_ps((__mmask16)~lo, _mm512_mul_ps(y, _mm512_castsi512_ps(b)));
    return _mm512_mask_mov_ps(e, nan, x);
}
/* softmax_generic with 16 lanes per vector: max (NaN ignored, as the scalar compare), e_i, the
 * 16 lane sums in one accumulator. */
static T512 float softmax512(float *s, int n) {
    const int n16 = n - n % 16;
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < n16; i += 16) vm = _mm512_max_ps(_mm512_loadu_ps(s + i), vm); /* NaN lanes keep vm */
    float mx = _mm512_reduce_max_ps(vm);
    for (int i = n16; i < n; i++)
        if (s[i] > mx) mx = s[i];
    __m512 vmx = _mm512_set1_ps(mx), acc = _mm512_setzero_ps();
    for (int i = 0; i < n16; i += 16) {
        __m512 e = expf512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    for (int i = n16; i < n; i++) s[i] = kv_expf(s[i] - mx);
    float lane[16];
    _mm512_storeu_ps(lane, acc);
    return 1.0f / lanes_sum(lane, s, n16, n);
}

static T512 void attn_avx512(const struct kv_attn_args *a0) {
    ATTN_KERNEL(a0, 16, scores512, softmax512, vacc512, 4, 3, 2, 1, vaccm512, 4, 64, 4, 2);
}

/* ---- AVX2 + FMA + F16C ---- */
#define T256 KV_T256

AI T256 __m256 ld256(const char *row, int e, int dt) {
    if (dt == KV_DTYPE_F32) return _mm256_loadu_ps((const float *)(const void *)(row + 4 * (size_t)e));
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * (size_t)e));
    if (dt == KV_DTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* As vacc512 with NV 8-lane halves (NV <= 8). */
AI T256 void vacc256(const struct kv_attn_args *a, const float *sc, float inv, float *out, int d0, int p0, int p1,
                     size_t rb, const int NV) {
    __m256 acc[8];
    _Pragma("GCC unroll 8") for (int u = 0; u < NV; u++) acc[u] = _mm256_loadu_ps(out + d0 + 8 * u);
    const char *v = p0 < p1 ? row_ptr(a, a->v_off, p0, rb) : NULL; /* [p0, p1) lies in one block */
    for (int i = p0; i < p1; i++, v += rb) {
        __m256 w = _mm256_set1_ps(sc[i] * inv);
        _Pragma("GCC unroll 8") for (int u = 0; u < NV; u++)
            acc[u] = _mm256_fmadd_ps(w, ld256(v, d0 + 8 * u, a->kv_dtype), acc[u]);
    }
    _Pragma("GCC unroll 8") for (int u = 0; u < NV; u++) _mm256_storeu_ps(out + d0 + 8 * u, acc[u]);
}

/* As scores512_rows with 8 positions per chunk (16 lanes as two ymm halves per position). */
AI T256 void scores256_rows(const struct kv_attn_args *a, int i0, int ni, const char *const *km, const int dm,
                            const char *const *kr, const int dt) {
    const int hd = a->head_dim, hd16 = hd - hd % 16;
    for (int j = 0; j < a->n_rows; j++) {
        int cnt = a->n_pos + j - i0;
        if (cnt <= 0) continue;
        if (cnt > ni) cnt = ni;
        for (int g = 0; g < a->n_group; g++) {
            const float *q = a->q + (size_t)j * a->q_stride + (size_t)g * hd;
            __m256 lo[8], hi[8];
            _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) lo[t] = hi[t] = _mm256_setzero_ps();
            for (int e = 0; e < hd16; e += 16) {
                __m256 ql = _mm256_loadu_ps(q + e), qh = _mm256_loadu_ps(q + e + 8);
                _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
                    lo[t] = _mm256_fmadd_ps(ql, ld256(km[t], e, dm), lo[t]);
                    hi[t] = _mm256_fmadd_ps(qh, ld256(km[t], e + 8, dm), hi[t]);
                }
            }
            _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) lo[t] = _mm256_add_ps(lo[t], hi[t]); /* l8 */
            float *sc = scores_of(a, j, g) + i0;
            if (hd16 == hd) { /* no tail: the sums scaled and stored as one vector */
                __m256 z = _mm256_mul_ps(kv_tree8_256v(lo), _mm256_set1_ps(a->scale));
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                _mm256_maskstore_ps(sc, _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lane), z);
                continue;
            }
            float s[8];
            kv_tree8_256(lo, cnt, s);
            for (int t = 0; t < cnt; t++) {
                float v = s[t];
                for (int e = hd16; e < hd; e++) v = __builtin_fmaf(q[e], elem(kr[t], e, dt), v);
                sc[t] = v * a->scale;
            }
        }
    }
}

/* As scores512 with 8 positions per chunk (the same f32 copy of K rows in prefill tiles). */
AI T256 void scores256(const struct kv_attn_args *a, int i0, int ni, size_t rb, const int dt, const bool nta) {
    const int hd = a->head_dim, hd16 = hd - hd % 16;
    const char *kr[8];
    rows_of(a, a->k_off, i0, ni, rb, kr);
    for (int t = ni; t < 8; t++) kr[t] = kr[ni - 1];
    prefetch_rows(a, a->k_off, i0 + 8, 8, a->n_pos + a->n_rows - 1, rb, nta);
    if (dt == KV_DTYPE_F32 || hd16 > KV_ATTN_WIDEN_MAX || a->n_rows < 2) {
        scores256_rows(a, i0, ni, kr, dt, kr, dt);
        return;
    }
    float kf[8 * KV_ATTN_WIDEN_MAX] __attribute__((aligned(32)));
    const char *km[8];
    for (int t = 0; t < 8; t++) {
        float *d = kf + (size_t)t * hd16;
        for (int e = 0; e < hd16; e += 8) _mm256_store_ps(d + e, ld256(kr[t], e, dt));
        km[t] = (const char *)d;
    }
    scores256_rows(a, i0, ni, km, KV_DTYPE_F32, kr, dt);
}

/* As vaccm512 with 8-lane halves (NP * NV <= 8 accumulators). */
AI T256 void vaccm256(const struct kv_attn_args *a, const float *const *sc, const float *inv, float *const *out, int d0,
                      int p0, int p1, size_t rb, const int NV, const int NP) {
    __m256 acc[2][4];
    _Pragma("GCC unroll 2") for (int x = 0; x < NP; x++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) acc[x][u] = _mm256_loadu_ps(out[x] + d0 + 8 * u);
    const char *v = p0 < p1 ? row_ptr(a, a->v_off, p0, rb) : NULL; /* [p0, p1) lies in one block */
    for (int i = p0; i < p1; i++, v += rb) {
        __m256 vv[4];
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) vv[u] = ld256(v, d0 + 8 * u, a->kv_dtype);
        _Pragma("GCC unroll 2") for (int x = 0; x < NP; x++) {
            __m256 w = _mm256_set1_ps(sc[x][i] * inv[x]);
            _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) acc[x][u] = _mm256_fmadd_ps(w, vv[u], acc[x][u]);
        }
    }
    _Pragma("GCC unroll 2") for (int x = 0; x < NP; x++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) _mm256_storeu_ps(out[x] + d0 + 8 * u, acc[x][u]);
}

/* kv_expf on 8 lanes (the AVX-512 version's operations). */
AI T256 __m256 expf256(__m256 x) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_C1), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256 lo = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_LT_OQ), nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 nn = _mm256_andnot_ps(_mm256_or_ps(lo, nan), n); /* 0 where unused: no overflow in the shift */
    __m256i b = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nn), _mm256_set1_epi32(127)), 23);
    __m256 e = _mm256_andnot_ps(lo, _mm256_mul_ps(y, _mm256_castsi256_ps(b)));
    return _mm256_blendv_ps(e, x, nan);
}
/* softmax512 with two 8-lane halves of the 16 lane sums. */
static T256 float softmax256(float *s, int n) {
    const int n16 = n - n % 16;
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < n16; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(s + i), vm);
    float t[8];
    _mm256_storeu_ps(t, vm);
    float mx = -INFINITY;
    for (int i = 0; i < 8; i++)
        if (t[i] > mx) mx = t[i];
    for (int i = n16; i < n; i++)
        if (s[i] > mx) mx = s[i];
    __m256 vmx = _mm256_set1_ps(mx), lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int i = 0; i < n16; i += 16) {
        __m256 e0 = expf256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
        __m256 e1 = expf256(_mm256_sub_ps(_mm256_loadu_ps(s + i + 8), vmx));
        _mm256_storeu_ps(s + i, e0);
        _mm256_storeu_ps(s + i + 8, e1);
        lo = _mm256_add_ps(lo, e0);
        hi = _mm256_add_ps(hi, e1);
    }
    for (int i = n16; i < n; i++) s[i] = kv_expf(s[i] - mx);
    float lane[16];
    _mm256_storeu_ps(lane, lo);
    _mm256_storeu_ps(lane + 8, hi);
    return 1.0f / lanes_sum(lane, s, n16, n);
}

static T256 void attn_avx2(const struct kv_attn_args *a0) {
    ATTN_KERNEL(a0, 8, scores256, softmax256, vacc256, 8, 6, 4, 2, vaccm256, 2, 32, 4, 2);
}
#endif

static void attn_generic(const struct kv_attn_args *a0) {
    struct kv_attn_args A[KV_ATTN_MAX_HEADS];
    int n = split_heads(a0, A);
    for (int x = 0; x < n; x++) attn_generic_head(&A[x]);
}

void kv_attention(const struct kv_attn_args *a) {
    enum kv_matmul_isa isa = kv_matmul_get_isa();
#ifdef KV_ATTN_X86
    if (isa == KV_MATMUL_ISA_AVX512) {
        attn_avx512(a);
        return;
    }
    if (isa == KV_MATMUL_ISA_AVX2) {
        attn_avx2(a);
        return;
    }
#endif
    (void)isa;
    attn_generic(a);
}
