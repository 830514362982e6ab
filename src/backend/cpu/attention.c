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

void kv_store_row(void *dst, const float *src, int n, int kv_dtype) {
    if (kv_dtype == KV_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
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

/* The softmax part of the contract over scores[0..n), in place: e_i; returns 1 / sum. */
static float softmax_inplace(float *s, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (s[i] > mx) mx = s[i];
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    return 1.0f / sum;
}

/* ---- generic ---- */

/* Scores row of (row j, head g): stride n_pos + n_rows - 1 floats. */
AI float *scores_of(const struct kv_attn_args *a, int j, int g) {
    return a->scores + ((size_t)j * a->n_group + g) * (size_t)(a->n_pos + a->n_rows - 1);
}

static void attn_generic(const struct kv_attn_args *a) {
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
        float inv = softmax_inplace(sc, np);
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
 * register-accumulator kernel, N64..N16 its vector counts for 64..16 floats of head_dim). Uses
 * a, hd, hd16, dt, rb, R, G, n_last of the enclosing kernel. */
#define ATTN_SOFTMAX_VALUES(VACC, N64, N48, N32, N16) \
    do { \
    /* softmax per (row, head); 1/sum kept per (row, head) (recomputed from the e_i when the \
     * tile x group exceeds the local table) */ \
    float invs[256]; \
    for (int jg = 0; jg < R * G; jg++) { \
        int j = jg / G, g = jg % G; \
        float iv = softmax_inplace(scores_of(a, j, g), a->n_pos + j); \
        if (jg < 256) invs[jg] = iv; \
        memset(a->out + (size_t)j * a->out_stride + (size_t)g * hd, 0, (size_t)hd * sizeof(float)); \
    } \
    /* values: per KV block (its rows are contiguous, so the block stays in L1 across the tile's \
     * rows and the group's heads) */ \
    for (int p0 = 0; p0 < n_last; p0 += a->tpb) { \
        for (int jg = 0; jg < R * G; jg++) { \
            int j = jg / G, g = jg % G, np = a->n_pos + j; \
            if (p0 >= np) continue; \
            int p1 = p0 + a->tpb < np ? p0 + a->tpb : np; \
            const float *sc = scores_of(a, j, g); \
            float iv; \
            if (jg < 256) iv = invs[jg]; \
            else { \
                float sum = 0.0f; \
                for (int i = 0; i < np; i++) sum += sc[i]; \
                iv = 1.0f / sum; \
            } \
            float *out = a->out + (size_t)j * a->out_stride + (size_t)g * hd; \
            int d0 = 0; \
            for (; d0 + 64 <= hd16; d0 += 64) VACC(a, sc, iv, out, d0, p0, p1, rb, N64); \
            if (hd16 - d0 == 48) VACC(a, sc, iv, out, d0, p0, p1, rb, N48); \
            else if (hd16 - d0 == 32) VACC(a, sc, iv, out, d0, p0, p1, rb, N32); \
            else if (hd16 - d0 == 16) VACC(a, sc, iv, out, d0, p0, p1, rb, N16); \
            for (int i = p0; i < p1 && hd16 < hd; i++) { \
                const char *v = row_ptr(a, a->v_off, i, rb); \
                float w = sc[i] * iv; \
                for (int e = hd16; e < hd; e++) out[e] = __builtin_fmaf(w, elem(v, e, dt), out[e]); \
            } \
        } \
    } \
    } while (0)

#ifdef KV_ATTN_X86
/* ---- AVX-512 ---- */
#define T512 KV_T512

AI T512 __m512 ld512(const char *row, int e, int dt) {
    if (dt == KV_DTYPE_F32) return _mm512_loadu_ps((const void *)(row + 4 * (size_t)e));
    __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)e));
    if (dt == KV_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* out[g][d0 .. d0 + 16*NV) += over positions [p0, p1): w_i * v_i, accumulators in registers. */
AI T512 void vacc512(const struct kv_attn_args *a, const float *sc, float inv, float *out, int d0, int p0, int p1,
                     size_t rb, const int NV) {
    __m512 acc[4];
    _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) acc[u] = _mm512_loadu_ps(out + d0 + 16 * u);
    for (int i = p0; i < p1; i++) {
        const char *v = row_ptr(a, a->v_off, i, rb);
        __m512 w = _mm512_set1_ps(sc[i] * inv);
        _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++)
            acc[u] = _mm512_fmadd_ps(w, ld512(v, d0 + 16 * u, a->kv_dtype), acc[u]);
    }
    _Pragma("GCC unroll 4") for (int u = 0; u < NV; u++) _mm512_storeu_ps(out + d0 + 16 * u, acc[u]);
}

static T512 void attn_avx512(const struct kv_attn_args *a) {
    const int hd = a->head_dim, dt = a->kv_dtype, hd16 = hd - hd % 16, R = a->n_rows, G = a->n_group;
    const int n_last = a->n_pos + R - 1; /* positions the last row attends */
    const size_t rb = (size_t)hd * kv_dtype_size(dt);
    for (int i = 0; i < n_last; i++) { /* scores: each K row read once for the tile and the group */
        const char *k = row_ptr(a, a->k_off, i, rb);
        int j0 = i < a->n_pos ? 0 : i - a->n_pos + 1; /* rows that see position i */
        for (int j = j0; j < R; j++)
            for (int g = 0; g < G; g++) {
                const float *q = a->q + (size_t)j * a->q_stride + (size_t)g * hd;
                __m512 acc = _mm512_setzero_ps();
                for (int e = 0; e < hd16; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), ld512(k, e, dt), acc);
                float s = kv_hsum512(acc);
                for (int e = hd16; e < hd; e++) s = __builtin_fmaf(q[e], elem(k, e, dt), s);
                scores_of(a, j, g)[i] = s * a->scale;
            }
    }
    ATTN_SOFTMAX_VALUES(vacc512, 4, 3, 2, 1);
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
    for (int i = p0; i < p1; i++) {
        const char *v = row_ptr(a, a->v_off, i, rb);
        __m256 w = _mm256_set1_ps(sc[i] * inv);
        _Pragma("GCC unroll 8") for (int u = 0; u < NV; u++)
            acc[u] = _mm256_fmadd_ps(w, ld256(v, d0 + 8 * u, a->kv_dtype), acc[u]);
    }
    _Pragma("GCC unroll 8") for (int u = 0; u < NV; u++) _mm256_storeu_ps(out + d0 + 8 * u, acc[u]);
}

static T256 void attn_avx2(const struct kv_attn_args *a) {
    const int hd = a->head_dim, dt = a->kv_dtype, hd16 = hd - hd % 16, R = a->n_rows, G = a->n_group;
    const int n_last = a->n_pos + R - 1;
    const size_t rb = (size_t)hd * kv_dtype_size(dt);
    for (int i = 0; i < n_last; i++) {
        const char *k = row_ptr(a, a->k_off, i, rb);
        int j0 = i < a->n_pos ? 0 : i - a->n_pos + 1;
        for (int j = j0; j < R; j++)
            for (int g = 0; g < G; g++) {
                const float *q = a->q + (size_t)j * a->q_stride + (size_t)g * hd;
                __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
                for (int e = 0; e < hd16; e += 16) {
                    lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), ld256(k, e, dt), lo);
                    hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), ld256(k, e + 8, dt), hi);
                }
                float s = kv_hsum256x2(lo, hi);
                for (int e = hd16; e < hd; e++) s = __builtin_fmaf(q[e], elem(k, e, dt), s);
                scores_of(a, j, g)[i] = s * a->scale;
            }
    }
    ATTN_SOFTMAX_VALUES(vacc256, 8, 6, 4, 2);
}
#endif

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
