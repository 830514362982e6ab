/*
 * simd_internal: pieces shared by the CPU backend's per-ISA kernels (matmul.c, attention.c).
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
#endif

#endif
