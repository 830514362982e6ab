/*
 * quant_x86: AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL) dequantization kernels. Compiled with
 * per-function target attributes, so this file builds for baseline x86-64 and quant.c only
 * calls a set the CPU has (kv_quant_set_isa).
 *
 * Every lane performs exactly the operations of the scalar reference in quant.c (int -> float
 * conversions of small integers are exact; then the same multiplies and subtracts in the same
 * order, with no fusion), so the bits match it and llama.cpp. F16 uses vcvtph2ps, which is
 * exact and quiets a signalling NaN like kv_quant_h2f.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "quant_internal.h"

#ifdef KV_QUANT_X86

#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* f16 scale at p (unaligned) -> float, one vcvtph2ps */
#define LDH(p) _cvtsh_ss(kv_quant_ld16(p))

/* ================================ AVX2 ================================ */

AVX2 static void avx2_f32(const void *src, float *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }

AVX2 static void avx2_f16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i)));
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i + 16)));
        __m256 c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i + 32)));
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i + 48)));
        _mm256_storeu_ps(dst + i, a);
        _mm256_storeu_ps(dst + i + 8, b);
        _mm256_storeu_ps(dst + i + 16, c);
        _mm256_storeu_ps(dst + i + 24, d);
    }
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
    for (; i < n; i++) dst[i] = LDH(p + 2 * i);
}

AVX2 static void avx2_bf16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * i)));
        __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * i + 16)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(a, 16));
        _mm256_storeu_si256((__m256i *)(dst + i + 8), _mm256_slli_epi32(b, 16));
    }
    for (; i < n; i++) {
        uint32_t bits = (uint32_t)kv_quant_ld16(p + 2 * i) << 16;
        memcpy(&dst[i], &bits, 4);
    }
}

/* 8 signed bytes at p -> 8 floats */
#define I8X8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

AVX2 static void avx2_q8_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 34, dst += 32) {
        __m256 d = _mm256_set1_ps(LDH(b));
        _mm256_storeu_ps(dst, _mm256_mul_ps(I8X8(b + 2), d));
        _mm256_storeu_ps(dst + 8, _mm256_mul_ps(I8X8(b + 10), d));
        _mm256_storeu_ps(dst + 16, _mm256_mul_ps(I8X8(b + 18), d));
        _mm256_storeu_ps(dst + 24, _mm256_mul_ps(I8X8(b + 26), d));
    }
}

/* low 8 / high 8 bytes of v (signed) -> 8 floats */
#define LO8S(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
#define HI8S(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64((v), (v))))
/* low 8 / high 8 bytes of v (unsigned) -> 8 floats */
#define LO8U(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
#define HI8U(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64((v), (v))))

AVX2 static void avx2_q4_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    const __m128i m4 = _mm_set1_epi8(0x0f), k8 = _mm_set1_epi8(8);
    for (int64_t i = 0; i < nb; i++, b += 18, dst += 32) {
        __m256 d = _mm256_set1_ps(LDH(b));
        __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, m4), k8);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), k8);
        _mm256_storeu_ps(dst, _mm256_mul_ps(LO8S(lo), d));
        _mm256_storeu_ps(dst + 8, _mm256_mul_ps(HI8S(lo), d));
        _mm256_storeu_ps(dst + 16, _mm256_mul_ps(LO8S(hi), d));
        _mm256_storeu_ps(dst + 24, _mm256_mul_ps(HI8S(hi), d));
    }
}

/* Q4_K / Q5_K, 16 elements of one sub-block: y = d1 * q - m1 (q: 16 unsigned bytes) */
#define QK_STORE16_AVX2(y, q, d1, m1)                                                         \
    do {                                                                                      \
        _mm256_storeu_ps((y), _mm256_sub_ps(_mm256_mul_ps((d1), LO8U(q)), (m1)));            \
        _mm256_storeu_ps((y) + 8, _mm256_sub_ps(_mm256_mul_ps((d1), HI8U(q)), (m1)));        \
    } while (0)

AVX2 static inline __attribute__((always_inline)) void avx2_qk45(const uint8_t *b, float *dst, int64_t nb, bool q5) {
    const __m128i m4 = _mm_set1_epi8(0x0f), k16 = _mm_set1_epi8(16);
    for (int64_t i = 0; i < nb; i++, b += q5 ? 176 : 144, dst += 256) {
        float d = LDH(b), dmin = LDH(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (q5 ? 48 : 16);
        __m128i h0 = _mm_setzero_si128(), h1 = _mm_setzero_si128();
        if (q5) {
            h0 = _mm_loadu_si128((const __m128i *)qh);
            h1 = _mm_loadu_si128((const __m128i *)(qh + 16));
        }
        /* d1[s] = d * sc[s], m1[s] = dmin * mn[s] for the 8 sub-blocks, one vector each */
        uint32_t sc[2], mn[2]; /* x86 is little-endian: bytes 0..7 = sub-blocks 0..7 */
        kv_quant_scales_k4(scales, sc, mn);
        float d1[8], m1[8];
        _mm256_storeu_ps(d1, _mm256_mul_ps(_mm256_set1_ps(d), LO8U(_mm_loadl_epi64((const __m128i *)sc))));
        _mm256_storeu_ps(m1, _mm256_mul_ps(_mm256_set1_ps(dmin), LO8U(_mm_loadl_epi64((const __m128i *)mn))));
        for (int c = 0; c < 4; c++) {
            __m256 da = _mm256_broadcast_ss(&d1[2 * c]), ma = _mm256_broadcast_ss(&m1[2 * c]);
            __m256 db = _mm256_broadcast_ss(&d1[2 * c + 1]), mb = _mm256_broadcast_ss(&m1[2 * c + 1]);
            float *y = dst + 64 * c;
            __m128i ua = _mm_set1_epi8((char)(1u << (2 * c))), ub = _mm_set1_epi8((char)(2u << (2 * c)));
            for (int k = 0; k < 2; k++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(qs + 32 * c + 16 * k));
                __m128i qa = _mm_and_si128(raw, m4);
                __m128i qb = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
                if (q5) {
                    __m128i h = k ? h1 : h0;
                    qa = _mm_or_si128(qa, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, ua), ua), k16));
                    qb = _mm_or_si128(qb, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, ub), ub), k16));
                }
                QK_STORE16_AVX2(y + 16 * k, qa, da, ma);
                QK_STORE16_AVX2(y + 32 + 16 * k, qb, db, mb);
            }
        }
    }
}
AVX2 static void avx2_q4_k(const void *src, float *dst, int64_t nb) { avx2_qk45(src, dst, nb, false); }
AVX2 static void avx2_q5_k(const void *src, float *dst, int64_t nb) { avx2_qk45(src, dst, nb, true); }

/* Q6_K: the four 16-byte groups of 6-bit values (minus 32, as signed bytes) for ql bytes a
 * (ql[l]), bb (ql[l + 32]) and high bits c (qh[l]), l = 16k .. 16k + 15 of one half. */
#define Q6_GROUPS(a, bb, c, q1, q2, q3, q4)                                                    \
    do {                                                                                       \
        const __m128i m4_ = _mm_set1_epi8(0x0f), m3_ = _mm_set1_epi8(0x03);                    \
        const __m128i mc_ = _mm_set1_epi8(0x0c), m30_ = _mm_set1_epi8(0x30);                   \
        const __m128i k32_ = _mm_set1_epi8(32);                                                \
        q1 = _mm_or_si128(_mm_and_si128(a, m4_), _mm_slli_epi16(_mm_and_si128(c, m3_), 4));     \
        q2 = _mm_or_si128(_mm_and_si128(bb, m4_), _mm_slli_epi16(_mm_and_si128(c, mc_), 2));    \
        q3 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m4_), _mm_and_si128(c, m30_));    \
        q4 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(bb, 4), m4_),                           \
                          _mm_and_si128(_mm_srli_epi16(c, 2), m30_));                          \
        q1 = _mm_sub_epi8(q1, k32_);                                                           \
        q2 = _mm_sub_epi8(q2, k32_);                                                           \
        q3 = _mm_sub_epi8(q3, k32_);                                                           \
        q4 = _mm_sub_epi8(q4, k32_);                                                           \
    } while (0)

#define Q6_STORE16_AVX2(y, q, s)                                                               \
    do {                                                                                       \
        _mm256_storeu_ps((y), _mm256_mul_ps((s), LO8S(q)));                                    \
        _mm256_storeu_ps((y) + 8, _mm256_mul_ps((s), HI8S(q)));                                \
    } while (0)

AVX2 static void avx2_q6_k(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 210, dst += 256) {
        /* ds[i] = d * scales[i], the 16 sub-block scales */
        __m256 vd = _mm256_set1_ps(LDH(b + 208));
        __m128i s16 = _mm_loadu_si128((const __m128i *)(b + 192));
        float ds[16];
        _mm256_storeu_ps(ds, _mm256_mul_ps(vd, LO8S(s16)));
        _mm256_storeu_ps(ds + 8, _mm256_mul_ps(vd, HI8S(s16)));
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            const float *sc = ds + 8 * h;
            float *y = dst + 128 * h;
            for (int k = 0; k < 2; k++) {
                __m128i a = _mm_loadu_si128((const __m128i *)(ql + 16 * k));
                __m128i bb = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * k));
                __m128i c = _mm_loadu_si128((const __m128i *)(qh + 16 * k));
                __m128i q1, q2, q3, q4;
                Q6_GROUPS(a, bb, c, q1, q2, q3, q4);
                Q6_STORE16_AVX2(y + 16 * k, q1, _mm256_broadcast_ss(&sc[k]));
                Q6_STORE16_AVX2(y + 32 + 16 * k, q2, _mm256_broadcast_ss(&sc[k + 2]));
                Q6_STORE16_AVX2(y + 64 + 16 * k, q3, _mm256_broadcast_ss(&sc[k + 4]));
                Q6_STORE16_AVX2(y + 96 + 16 * k, q4, _mm256_broadcast_ss(&sc[k + 6]));
            }
        }
    }
}

const struct kv_dq_table kv_dq_avx2 = {{
    [KV_DQ_F32] = avx2_f32, [KV_DQ_F16] = avx2_f16, [KV_DQ_BF16] = avx2_bf16, [KV_DQ_Q8_0] = avx2_q8_0,
    [KV_DQ_Q4_0] = avx2_q4_0, [KV_DQ_Q4_K] = avx2_q4_k, [KV_DQ_Q5_K] = avx2_q5_k, [KV_DQ_Q6_K] = avx2_q6_k,
}};

/* =============================== AVX-512 =============================== */

AVX512 static void avx512_f16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i)));
        __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i + 32)));
        __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i + 64)));
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i + 96)));
        _mm512_storeu_ps(dst + i, a);
        _mm512_storeu_ps(dst + i + 16, b);
        _mm512_storeu_ps(dst + i + 32, c);
        _mm512_storeu_ps(dst + i + 48, d);
    }
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i))));
    if (i < n) { /* masked tail */
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        __m256i h = _mm256_maskz_loadu_epi16(m, p + 2 * i);
        _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(h));
    }
}

AVX512 static void avx512_bf16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 2 * i)));
        __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 2 * i + 32)));
        _mm512_storeu_si512(dst + i, _mm512_slli_epi32(a, 16));
        _mm512_storeu_si512(dst + i + 16, _mm512_slli_epi32(b, 16));
    }
    for (; i < n; i += 16) {
        int64_t left = n - i < 16 ? n - i : 16;
        __mmask16 m = (__mmask16)((1u << left) - 1);
        __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p + 2 * i));
        _mm512_mask_storeu_epi32(dst + i, m, _mm512_slli_epi32(a, 16));
    }
}

/* 16 bytes -> 16 floats */
#define I8X16(v) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
#define U8X16(v) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))

AVX512 static void avx512_q8_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 34, dst += 32) {
        __m512 d = _mm512_set1_ps(LDH(b));
        _mm512_storeu_ps(dst, _mm512_mul_ps(I8X16(_mm_loadu_si128((const __m128i *)(b + 2))), d));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(I8X16(_mm_loadu_si128((const __m128i *)(b + 18))), d));
    }
}

AVX512 static void avx512_q4_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    const __m128i m4 = _mm_set1_epi8(0x0f), k8 = _mm_set1_epi8(8);
    for (int64_t i = 0; i < nb; i++, b += 18, dst += 32) {
        __m512 d = _mm512_set1_ps(LDH(b));
        __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, m4), k8);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), k8);
        _mm512_storeu_ps(dst, _mm512_mul_ps(I8X16(lo), d));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(I8X16(hi), d));
    }
}

AVX512 static inline __attribute__((always_inline)) void avx512_qk45(const uint8_t *b, float *dst, int64_t nb, bool q5) {
    const __m128i m4 = _mm_set1_epi8(0x0f), k16 = _mm_set1_epi8(16);
    for (int64_t i = 0; i < nb; i++, b += q5 ? 176 : 144, dst += 256) {
        float d = LDH(b), dmin = LDH(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (q5 ? 48 : 16);
        __m128i h0 = _mm_setzero_si128(), h1 = _mm_setzero_si128();
        if (q5) {
            h0 = _mm_loadu_si128((const __m128i *)qh);
            h1 = _mm_loadu_si128((const __m128i *)(qh + 16));
        }
        uint32_t sc[2], mn[2]; /* x86 is little-endian: bytes 0..7 = sub-blocks 0..7 */
        kv_quant_scales_k4(scales, sc, mn);
        float d1[8], m1[8];
        _mm256_storeu_ps(d1, _mm256_mul_ps(_mm256_set1_ps(d), LO8U(_mm_loadl_epi64((const __m128i *)sc))));
        _mm256_storeu_ps(m1, _mm256_mul_ps(_mm256_set1_ps(dmin), LO8U(_mm_loadl_epi64((const __m128i *)mn))));
        for (int c = 0; c < 4; c++) {
            __m512 da = _mm512_set1_ps(d1[2 * c]), ma = _mm512_set1_ps(m1[2 * c]);
            __m512 db = _mm512_set1_ps(d1[2 * c + 1]), mb = _mm512_set1_ps(m1[2 * c + 1]);
            float *y = dst + 64 * c;
            __m128i ua = _mm_set1_epi8((char)(1u << (2 * c))), ub = _mm_set1_epi8((char)(2u << (2 * c)));
            for (int k = 0; k < 2; k++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(qs + 32 * c + 16 * k));
                __m128i qa = _mm_and_si128(raw, m4);
                __m128i qb = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
                if (q5) {
                    __m128i h = k ? h1 : h0;
                    qa = _mm_or_si128(qa, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, ua), ua), k16));
                    qb = _mm_or_si128(qb, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, ub), ub), k16));
                }
                _mm512_storeu_ps(y + 16 * k, _mm512_sub_ps(_mm512_mul_ps(da, U8X16(qa)), ma));
                _mm512_storeu_ps(y + 32 + 16 * k, _mm512_sub_ps(_mm512_mul_ps(db, U8X16(qb)), mb));
            }
        }
    }
}
AVX512 static void avx512_q4_k(const void *src, float *dst, int64_t nb) { avx512_qk45(src, dst, nb, false); }
AVX512 static void avx512_q5_k(const void *src, float *dst, int64_t nb) { avx512_qk45(src, dst, nb, true); }

AVX512 static void avx512_q6_k(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 210, dst += 256) {
        float ds[16];
        _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_set1_ps(LDH(b + 208)),
                                           I8X16(_mm_loadu_si128((const __m128i *)(b + 192)))));
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            const float *sc = ds + 8 * h;
            float *y = dst + 128 * h;
            for (int k = 0; k < 2; k++) {
                __m128i a = _mm_loadu_si128((const __m128i *)(ql + 16 * k));
                __m128i bb = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * k));
                __m128i c = _mm_loadu_si128((const __m128i *)(qh + 16 * k));
                __m128i q1, q2, q3, q4;
                Q6_GROUPS(a, bb, c, q1, q2, q3, q4);
                _mm512_storeu_ps(y + 16 * k, _mm512_mul_ps(_mm512_set1_ps(sc[k]), I8X16(q1)));
                _mm512_storeu_ps(y + 32 + 16 * k, _mm512_mul_ps(_mm512_set1_ps(sc[k + 2]), I8X16(q2)));
                _mm512_storeu_ps(y + 64 + 16 * k, _mm512_mul_ps(_mm512_set1_ps(sc[k + 4]), I8X16(q3)));
                _mm512_storeu_ps(y + 96 + 16 * k, _mm512_mul_ps(_mm512_set1_ps(sc[k + 6]), I8X16(q4)));
            }
        }
    }
}

const struct kv_dq_table kv_dq_avx512 = {{
    [KV_DQ_F32] = avx2_f32, [KV_DQ_F16] = avx512_f16, [KV_DQ_BF16] = avx512_bf16, [KV_DQ_Q8_0] = avx512_q8_0,
    [KV_DQ_Q4_0] = avx512_q4_0, [KV_DQ_Q4_K] = avx512_q4_k, [KV_DQ_Q5_K] = avx512_q5_k, [KV_DQ_Q6_K] = avx512_q6_k,
}};

#else
/* not x86-64 GCC/clang: quant.c uses the generic path only */
typedef int kv_quant_x86_unused;
#endif
