/*
 * simd_internal: pieces shared by the CPU backend's per-ISA kernels (matmul_x86.c, matmul_bf16.c, attention.c).
 * Not a public header. Include it after the file's `#pragma GCC optimize("fp-contract=off")`:
 * the kernels' arithmetic contracts allow only explicit fmas.
 *
 * The fixed 16-lane reduction tree of the contracts (matmul.h):
 *   l8[j] = a[j] + a[j+8] (j < 8), l4[j] = l8[j] + l8[j+4], l2[j] = l4[j] + l4[j+2], l2[0] + l2[1]
 */
#ifndef KV_BACKEND_CPU_SIMD_INTERNAL_H
#define KV_BACKEND_CPU_SIMD_INTERNAL_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_CPU_X86 1

#define KV_T512 __attribute__((target("avx512f,fma")))
#define KV_T256 __attribute__((target("avx2,fma,f16c")))

/* The tree over the 16 lanes of one zmm. */
static inline __attribute__((always_inline)) KV_T512 float kv_hsum512(__m512 a) {
    __m256 lo = _mm512_castps512_ps256(a);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    __m256 b = _mm256_add_ps(lo, hi);                                              /* l8 */
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1)); /* l4 */
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));                                 /* l2[0], l2[1] */
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
/* The tree over 16 lanes held as lo (lanes 0..7) and hi (8..15). */
static inline __attribute__((always_inline)) KV_T256 float kv_hsum256x2(__m256 lo, __m256 hi) {
    __m256 b = _mm256_add_ps(lo, hi); /* l8 */
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

/* The contract's tree over 16 accumulators at once, unpermuted: lane 4t + u of the result is
 * tree(v[4u + t]). Each step adds the same lane pairs as kv_hsum512: l8 (halves of one zmm),
 * l4 (quarters), l2 and s (pairs inside a quarter). */
static inline __attribute__((always_inline)) KV_T512 __m512 kv_tree16_512z(const __m512 *v) {
    __m512 p[8], q[4], r[2];
    for (int i = 0; i < 8; i++) /* quarters: l8 of v[2i] (0, 1), of v[2i+1] (2, 3) */
        p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter t: l4 of v[4i + t] */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* quarter t: l2 of v[8i + t], l2 of v[8i + 4 + t] */
        r[i] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0xEE));
    /* float 4t + u: s of v[4u + t] */
    return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
}

/* The tree over 16 accumulators: out[i] = tree(a[i]), i < n (n <= 16; a[n..16) are not read). */
static inline __attribute__((always_inline)) KV_T512 void kv_tree16_512(const __m512 *a, int n, float *out) {
    __m512 v[16];
    for (int i = 0; i < 16; i++) v[i] = i < n ? a[i] : _mm512_setzero_ps();
    float t[16] __attribute__((aligned(64)));
    _mm512_store_ps(t, kv_tree16_512z(v));
    for (int i = 0; i < n; i++) out[i] = t[4 * (i & 3) + (i >> 2)];
}

/* The tree over all 16 accumulators, the sums left in a vector in natural order (lane i: the
 * sum of v[i]): the same additions, a lane permutation instead of the store. */
static inline __attribute__((always_inline)) KV_T512 __m512 kv_tree16_512v(const __m512 *v) {
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, kv_tree16_512z(v));
}

/* The tree from l8 (lanes j + lanes j+8, one ymm per output) over 8 accumulators,
 * unpermuted: lane 4h + u of the result is the sum of v[2u + h]. */
static inline __attribute__((always_inline)) KV_T256 __m256 kv_tree8_256z(const __m256 *v) {
    __m256 p[4], q[2];
    for (int i = 0; i < 4; i++) /* lane half h: l4 of v[2i + h] */
        p[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* half h: l2 of v[4i + h], l2 of v[4i + 2 + h] */
        q[i] = _mm256_add_ps(_mm256_shuffle_ps(p[2 * i], p[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(p[2 * i], p[2 * i + 1], 0xEE));
    /* float 4h + u: s of v[2u + h] */
    return _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], 0x88), _mm256_shuffle_ps(q[0], q[1], 0xDD));
}

/* The tree from l8 for n <= 8 outputs at once: out[i] = tree(a[i]) (a[n..8) are not read). */
static inline __attribute__((always_inline)) KV_T256 void kv_tree8_256(const __m256 *a, int n, float *out) {
    __m256 v[8];
    for (int i = 0; i < 8; i++) v[i] = i < n ? a[i] : _mm256_setzero_ps();
    float t[8] __attribute__((aligned(32)));
    _mm256_store_ps(t, kv_tree8_256z(v));
    for (int i = 0; i < n; i++) out[i] = t[4 * (i & 1) + (i >> 1)];
}

/* kv_tree8_256 of all 8 accumulators, the sums in natural order in a vector (see kv_tree16_512v). */
static inline __attribute__((always_inline)) KV_T256 __m256 kv_tree8_256v(const __m256 *v) {
    return _mm256_permutevar8x32_ps(kv_tree8_256z(v), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#endif

#endif
