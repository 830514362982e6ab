/*
 * q8_x86: the AVX2 and AVX-512 kernels of kv_q8_dot_rows and of the activation quantization
 * (q8.h). Per-function target attributes: the file builds for baseline x86-64 and q8.c only
 * calls a set the CPU has.
 *
 * Integer products: AVX2 uses vpmaddubsw (u8 x s8 -> s16 pairs; never saturates here: the
 * unsigned side is at most 128 for Q8_0 (|w| through the sign trick), 63 otherwise) and vpmaddwd
 * (pairs x 1 or x the sub-block scale -> the contract's 4-element lanes). AVX-512 (BW) does the
 * same on 64 bytes; with VNNI, Q8_0 uses vpdpbusd on w + 128 (offset trick: the 128 * sum(q) of
 * each lane is subtracted first) and the rest vpdpwssd (pairs x scale, accumulated). Integer
 * sums are exact, so every route gives the contract's lane values, and the float steps are the
 * contract's (one fma per lane per group, the 16-lane tree): identical bits on every ISA.
 *
 * Lanes: AVX-512 holds the 16 lanes in one zmm (a chunk = 64 elements: two Q8_0/Q4_0 blocks,
 * or a quarter of a K-quant super-block); AVX2 holds lanes 0-7 and 8-15 in two ymm (a chunk =
 * 32 elements; chunk i goes to half i % 2).
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "q8_internal.h"

#ifdef KV_QUANT_X86

#include <immintrin.h>
#include <math.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define ALWAYS inline __attribute__((always_inline))

#define LDH(p) _cvtsh_ss(kv_quant_ld16(p))

int kv_q8_cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
}

/* Software prefetch of the next tile's weight rows (they follow this tile's RR rows in memory):
 * step i of n covers its share of [next, next + span). Decode (M <= 4: PF) reads each weight once,
 * and the hardware prefetchers alone leave a core far below its memory bandwidth on short rows
 * (K = 768: 27% more decode time without it); prefill re-reads a task's rows from L2 instead. */
static ALWAYS void prefetch_share(const uint8_t *next, size_t span, int i, int n) {
    const size_t per = (span + (size_t)n - 1) / (size_t)n; /* n is constant per tile: hoisted */
    const uint8_t *p = next + per * (size_t)i;
    for (size_t o = 0; o < per; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* ---------------- quantization ---------------- */

/* Shared tail: d, id from amax (the same scalar operations as the generic code). */
static ALWAYS int q_scale(float amax, int bad, int8_t *q, int G, float *d, float *id) {
    if (bad) {
        memset(q, 0, (size_t)G);
        *d = NAN;
        return 0;
    }
    *d = amax / 127.0f;
    *id = amax > 0.0f ? 127.0f / amax : 0.0f;
    return 1;
}

AVX2 void kv_q8_quantize_group_avx2(const float *x, int G, int8_t *q, float *d) {
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    __m256i mx = _mm256_setzero_si256();
    for (int i = 0; i < G; i += 8)
        mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), absmask));
    uint32_t m8[8];
    _mm256_storeu_si256((__m256i *)m8, mx);
    uint32_t mb = 0;
    for (int j = 0; j < 8; j++) mb = m8[j] > mb ? m8[j] : mb;
    float amax, id;
    memcpy(&amax, &mb, 4);
    if (!q_scale(amax, mb >= 0x7f800000u, q, G, d, &id)) return;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < G; i += 32) {
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vid));
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(b, perm));
    }
}

AVX512 void kv_q8_quantize_group_avx512(const float *x, int G, int8_t *q, float *d) {
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    __m512i mx = _mm512_setzero_si512();
    for (int i = 0; i < G; i += 16)
        mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), absmask));
    uint32_t mb = (uint32_t)_mm512_reduce_max_epu32(mx);
    float amax, id;
    memcpy(&amax, &mb, 4);
    if (!q_scale(amax, mb >= 0x7f800000u, q, G, d, &id)) return;
    const __m512 vid = _mm512_set1_ps(id);
    for (int i = 0; i < G; i += 16)
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vid))));
}

/* ---------------- AVX-512 ---------------- */

/* the contract's tree over the 16 lanes of a zmm */
AVX512 static ALWAYS float tree512(__m512 v) {
    __m256 l8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 l4 = _mm_add_ps(_mm256_castps256_ps128(l8), _mm256_extractf128_ps(l8, 1));
    __m128 l2 = _mm_add_ps(l4, _mm_movehl_ps(l4, l4));
    return _mm_cvtss_f32(_mm_add_ss(l2, _mm_shuffle_ps(l2, l2, 1)));
}

/* sum of 8 mins (u8) x 8 sums (int16) */
AVX2 static ALWAYS int32_t min_dot(__m128i mins16, const int16_t *s) {
    __m128i p = _mm_madd_epi16(mins16, _mm_loadu_si128((const __m128i *)s));
    p = _mm_add_epi32(p, _mm_unpackhi_epi64(p, p));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 1));
    return _mm_cvtsi128_si32(p);
}

/* Q8_0 / Q4_0: weight blocks b, b+1 as 64 signed (Q8_0) / unsigned nibble (Q4_0) bytes; the
 * two f16 scales as [dw_b x8, dw_b1 x8]. one: only block b (upper half zero). */
AVX512 static ALWAYS __m512i g32_w(int type, const uint8_t *b0, int one, __m512 *dw) {
    const uint8_t *b1 = b0 + (type == KV_QTYPE_Q8_0 ? 34 : 18);
    uint16_t h0 = kv_quant_ld16(b0), h1 = one ? 0 : kv_quant_ld16(b1);
    *dw = _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16((short)h1), _mm_set1_epi16((short)h0)));
    if (type == KV_QTYPE_Q8_0) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(b0 + 2));
        __m256i hi = one ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(b1 + 2));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m128i r0 = _mm_loadu_si128((const __m128i *)(b0 + 2));
    __m256i y0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r0, 4), r0), m4);
    __m256i y1 = _mm256_setzero_si256();
    if (!one) {
        __m128i r1 = _mm_loadu_si128((const __m128i *)(b1 + 2));
        y1 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r1, 4), r1), m4);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1);
}

AVX512 static ALWAYS void g32_tile512(int type, const uint8_t *w, size_t rb, const struct kv_q8_act *a, int m0,
                                      float *Y, size_t ldy, const int MR, const int RR, const int VN, const int PF) {
    const int K = a->K, nb = K / 32;
    const __m512i k80 = _mm512_set1_epi8((char)0x80), k8 = _mm512_set1_epi8(8), ones = _mm512_set1_epi16(1);
    __m512 acc[4][8];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) acc[m][r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        const int one = b + 1 == nb;
        if (PF) prefetch_share(w + (size_t)RR * rb, (size_t)RR * rb, b / 2, (nb + 1) / 2);
        const __mmask16 lanes = one ? 0x00ff : 0xffff;
        __m512i x[4], corr[4];
        __m512 dx[4];
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
            const int8_t *qx = a->q + (size_t)(m0 + m) * K + 32 * (size_t)b;
            x[m] = one ? _mm512_maskz_loadu_epi8(0xffffffffull, qx) : _mm512_loadu_si512((const void *)qx);
            const float *d = a->d + (size_t)(m0 + m) * nb + b;
            dx[m] = _mm512_mask_mov_ps(_mm512_set1_ps(d[0]), 0xff00, _mm512_set1_ps(one ? 0.0f : d[1]));
            if (type == KV_QTYPE_Q8_0) {
                if (VN) corr[m] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k80, x[m]));
            } else {
                corr[m] = VN ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), k8, x[m])
                             : _mm512_madd_epi16(_mm512_maddubs_epi16(k8, x[m]), ones);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {
            __m512 dw;
            __m512i wv = g32_w(type, w + (size_t)r * rb + (size_t)b * (type == KV_QTYPE_Q8_0 ? 34 : 18), one, &dw);
            __m512i wu = wv, aw = wv;
            if (type == KV_QTYPE_Q8_0) {
                if (VN) wu = _mm512_xor_si512(wv, k80);
                else aw = _mm512_abs_epi8(wv);
            }
            _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                __m512i P;
                if (type == KV_QTYPE_Q8_0) {
                    if (VN) {
                        P = _mm512_dpbusd_epi32(corr[m], wu, x[m]);
                    } else {
                        __mmask64 neg = _mm512_movepi8_mask(wv);
                        __m512i sx = _mm512_mask_sub_epi8(x[m], neg, _mm512_setzero_si512(), x[m]);
                        P = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), ones);
                    }
                } else {
                    P = VN ? _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, x[m]), corr[m])
                           : _mm512_sub_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(wv, x[m]), ones), corr[m]);
                }
                acc[m][r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(P), _mm512_mul_ps(dw, dx[m]), acc[m][r], lanes);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) Y[(size_t)m * ldy + r] = tree512(acc[m][r]);
}

/* K-quants, AVX-512: chunk c (64 elements) of a super-block as 64 unsigned bytes (u of the
 * contract, +32 for Q6_K). */
AVX512 static ALWAYS __m512i kq_chunk512(int type, const uint8_t *b, int c) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    if (type == KV_QTYPE_Q6_K) {
        const int h = c >> 1;
        __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
        __m256i q32 = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(q32), _mm256_srli_epi16(q32, 2), 1);
        if (c & 1)
            return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                   _mm512_and_si512(qh, _mm512_set1_epi8(0x30)));
        return _mm512_or_si512(_mm512_and_si512(ql, m4),
                               _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi8(3)), 4));
    }
    const uint8_t *qs = b + (type == KV_QTYPE_Q5_K ? 48 : 16);
    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    __m512i v = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), m4);
    if (type == KV_QTYPE_Q5_K) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
        __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
        __m512i bit = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << (2 * c)))),
                                         _mm256_set1_epi8((char)(2 << (2 * c))), 1);
        v = _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(hz, bit), v, _mm512_set1_epi8(16));
    }
    return v;
}

/* per row and super-block: the integer scales as int16 (Q4_K/Q5_K: 8, Q6_K: 16), mins, d, dmin */
AVX512 static ALWAYS __m512i kq_scales512(int type, const uint8_t *b, __m128i *mins16, float *d, float *dmin) {
    if (type == KV_QTYPE_Q6_K) {
        *d = LDH(b + 208);
        *dmin = 0.0f;
        *mins16 = _mm_setzero_si128();
        return _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
    }
    *d = LDH(b);
    *dmin = LDH(b + 2);
    uint32_t sc[2], mn[2];
    kv_quant_scales_k4(b + 4, sc, mn);
    *mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
    return _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
}

/* int16 index vectors: for chunk c, the scale of each int16 lane (2 per 4-element lane) */
AVX512 static ALWAYS __m512i kq_idx512(int type, int c) {
    if (type == KV_QTYPE_Q6_K) /* 16-element sub-blocks: int16 lane i -> scale 4c + i / 8 */
        return _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_setr_epi16(4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1,
                                                     4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                                     4 * c + 1)),
            _mm256_setr_epi16(4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                              4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3),
            1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * c))), _mm256_set1_epi16((short)(2 * c + 1)), 1);
}

AVX512 static ALWAYS void kq_tile512(int type, const uint8_t *w, size_t rb, const struct kv_q8_act *a, int m0,
                                     float *Y, size_t ldy, const int MR, const int RR, const int VN, const int PF) {
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512 acc[4][8];
    float mn[4][8];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {
            acc[m][r] = _mm512_setzero_ps();
            mn[m][r] = 0.0f;
        }
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)RR * rb, (size_t)RR * rb, s, ns);
        __m512i P[4][8], sc[8];
        __m128i mins16[8];
        float d[8], dmin[8];
        _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++)
            sc[r] = kq_scales512(type, w + (size_t)r * rb + (size_t)s * bb, &mins16[r], &d[r], &dmin[r]);
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
            _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) P[m][r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            __m512i x[4], x32[4];
            const __m512i idx = kq_idx512(type, c);
            _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                x[m] = _mm512_loadu_si512((const void *)(a->q + (size_t)(m0 + m) * K + 256 * (size_t)s + 64 * c));
                if (type == KV_QTYPE_Q6_K) x32[m] = _mm512_maddubs_epi16(k32, x[m]);
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {
                __m512i v = kq_chunk512(type, w + (size_t)r * rb + (size_t)s * bb, c);
                __m512i scv = _mm512_permutexvar_epi16(idx, sc[r]);
                _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                    __m512i pr = _mm512_maddubs_epi16(v, x[m]);
                    if (type == KV_QTYPE_Q6_K) pr = _mm512_sub_epi16(pr, x32[m]);
                    P[m][r] = VN ? _mm512_dpwssd_epi32(P[m][r], pr, scv) : _mm512_add_epi32(P[m][r], _mm512_madd_epi16(pr, scv));
                }
            }
        }
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
            const float dx = a->d[(size_t)(m0 + m) * ns + s];
            const int16_t *s32 = a->s32 + (size_t)(m0 + m) * (K / 32) + 8 * (size_t)s;
            _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {
                acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P[m][r]), _mm512_set1_ps(d[r] * dx), acc[m][r]);
                if (mins) mn[m][r] = __builtin_fmaf((float)min_dot(mins16[r], s32), dmin[r] * dx, mn[m][r]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {
            float y = tree512(acc[m][r]);
            if (mins) y = y - mn[m][r];
            Y[(size_t)m * ldy + r] = y;
        }
}

/* One tile shape per (type, rows of M): AVX-512 register file (32 zmm). */
#define TILE_ROWS(MAC, type, VN, MM, RT)                                                                   \
    do {                                                                                                  \
        if (M <= 4) {                                                                                     \
            for (; r + (RT) <= n_rows; r += (RT)) MAC(type, w8 + r * rb, rb, a, m0 + mb, y + r, ldy, MM, RT, VN, 1); \
        } else {                                                                                          \
            for (; r + (RT) <= n_rows; r += (RT)) MAC(type, w8 + r * rb, rb, a, m0 + mb, y + r, ldy, MM, RT, VN, 0); \
        }                                                                                                 \
        for (; r < n_rows; r++) MAC(type, w8 + r * rb, rb, a, m0 + mb, y + r, ldy, MM, 1, VN, 0);         \
    } while (0)
#define TILES512(MAC, type, VN)                                                                           \
    do {                                                                                                  \
        for (int mb = 0; mb < M; mb += 4) {                                                               \
            const int mm = M - mb < 4 ? M - mb : 4;                                                       \
            int r = 0;                                                                                    \
            float *y = Y + (size_t)mb * ldy;                                                              \
            if (mm == 1) TILE_ROWS(MAC, type, VN, 1, R1);                                                 \
            else if (mm == 2) TILE_ROWS(MAC, type, VN, 2, R2);                                            \
            else if (mm == 3) TILE_ROWS(MAC, type, VN, 3, R3);                                            \
            else TILE_ROWS(MAC, type, VN, 4, R4);                                                         \
        }                                                                                                 \
    } while (0)

#define R1 8
#define R2 4
#define R3 4
#define R4 3
AVX512 static ALWAYS void g32_512(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                                  int M, float *Y, size_t ldy, const int VN) {
    TILES512(g32_tile512, type, VN);
}
#undef R1
#undef R2
#undef R3
#undef R4
#define R1 6
#define R2 3
#define R3 2
#define R4 2
AVX512 static ALWAYS void kq_512(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                                 int M, float *Y, size_t ldy, const int VN) {
    TILES512(kq_tile512, type, VN);
}
#undef R1
#undef R2
#undef R3
#undef R4

#define DISPATCH512(VN)                                                                                    \
    switch (type) {                                                                                       \
    case KV_QTYPE_Q8_0: g32_512(KV_QTYPE_Q8_0, w8, rb, n_rows, a, m0, M, Y, ldy, VN); break;             \
    case KV_QTYPE_Q4_0: g32_512(KV_QTYPE_Q4_0, w8, rb, n_rows, a, m0, M, Y, ldy, VN); break;             \
    case KV_QTYPE_Q4_K: kq_512(KV_QTYPE_Q4_K, w8, rb, n_rows, a, m0, M, Y, ldy, VN); break;              \
    case KV_QTYPE_Q5_K: kq_512(KV_QTYPE_Q5_K, w8, rb, n_rows, a, m0, M, Y, ldy, VN); break;              \
    default: kq_512(KV_QTYPE_Q6_K, w8, rb, n_rows, a, m0, M, Y, ldy, VN); break;                         \
    }

AVX512 static void dot512_vnni(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                               int M, float *Y, size_t ldy) {
    DISPATCH512(1)
}
AVX512 static void dot512_plain(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                                int M, float *Y, size_t ldy) {
    DISPATCH512(0)
}

void kv_q8_dot_avx512(int type, const void *w, size_t rb, int n_rows, const struct kv_q8_act *a, int m0, int M,
                      float *Y, size_t ldy, int vnni) {
    if (vnni) dot512_vnni(type, w, rb, n_rows, a, m0, M, Y, ldy);
    else dot512_plain(type, w, rb, n_rows, a, m0, M, Y, ldy);
}

/* ---------------- AVX2 ---------------- */

/* the contract's tree from lanes 0-7 (lo) and 8-15 (hi) */
AVX2 static ALWAYS float tree256(__m256 lo, __m256 hi) {
    __m256 l8 = _mm256_add_ps(lo, hi);
    __m128 l4 = _mm_add_ps(_mm256_castps256_ps128(l8), _mm256_extractf128_ps(l8, 1));
    __m128 l2 = _mm_add_ps(l4, _mm_movehl_ps(l4, l4));
    return _mm_cvtss_f32(_mm_add_ss(l2, _mm_shuffle_ps(l2, l2, 1)));
}

/* Q8_0 / Q4_0, one block b (32 elements) into lane half b % 2 */
AVX2 static ALWAYS void g32_block256(int type, const uint8_t *w, size_t rb, const struct kv_q8_act *a, int m0, int b,
                                     __m256 acc[4][4][2], const int MR, const int RR) {
    const int K = a->K, nb = K / 32, h = b & 1;
    const size_t bb = type == KV_QTYPE_Q8_0 ? 34 : 18;
    const __m256i ones = _mm256_set1_epi16(1), k8 = _mm256_set1_epi8(8), m4 = _mm256_set1_epi8(0x0f);
    __m256i x[4], c8[4];
    float dx[4];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
        x[m] = _mm256_loadu_si256((const __m256i *)(a->q + (size_t)(m0 + m) * K + 32 * (size_t)b));
        dx[m] = a->d[(size_t)(m0 + m) * nb + b];
        if (type == KV_QTYPE_Q4_0) c8[m] = _mm256_madd_epi16(_mm256_maddubs_epi16(k8, x[m]), ones);
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) {
        const uint8_t *blk = w + (size_t)r * rb + (size_t)b * bb;
        const float dw = LDH(blk);
        __m256i wv, aw;
        if (type == KV_QTYPE_Q8_0) {
            wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
            aw = _mm256_abs_epi8(wv);
        } else {
            __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
            wv = aw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
        }
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
            __m256i P = type == KV_QTYPE_Q8_0
                            ? _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x[m], wv)), ones)
                            : _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, x[m]), ones), c8[m]);
            acc[m][r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_set1_ps(dw * dx[m]), acc[m][r][h]);
        }
    }
}

AVX2 static ALWAYS void g32_tile256(int type, const uint8_t *w, size_t rb, const struct kv_q8_act *a, int m0,
                                    float *Y, size_t ldy, const int MR, const int RR, const int VN, const int PF) {
    (void)VN;
    const int nb = a->K / 32;
    __m256 acc[4][4][2];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) acc[m][r][0] = acc[m][r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (PF) prefetch_share(w + (size_t)RR * rb, (size_t)RR * rb, b, nb);
        g32_block256(type, w, rb, a, m0, b, acc, MR, RR);
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) Y[(size_t)m * ldy + r] = tree256(acc[m][r][0], acc[m][r][1]);
}

/* K-quants, AVX2: chunk c2 (0..7, 32 elements) of a super-block as unsigned bytes */
AVX2 static ALWAYS __m256i kq_chunk256(int type, const uint8_t *b, int c2) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (type == KV_QTYPE_Q6_K) {
        const int h = c2 >> 2, g = c2 & 3;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (g & 1)));
        lo = (g & 2) ? _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4) : _mm256_and_si256(lo, m4);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), _mm256_set1_epi8(3)), 4);
        return _mm256_or_si256(lo, hi);
    }
    const uint8_t *qs = b + (type == KV_QTYPE_Q5_K ? 48 : 16);
    __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c2 >> 1)));
    __m256i v = (c2 & 1) ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
    if (type == KV_QTYPE_Q5_K) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
        __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, c2), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(hb, 4));
    }
    return v;
}

AVX2 static ALWAYS void kq_tile256(int type, const uint8_t *w, size_t rb, const struct kv_q8_act *a, int m0,
                                   float *Y, size_t ldy, const int MR, const int RR, const int VN, const int PF) {
    (void)VN;
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m256i k32 = _mm256_set1_epi8(32);
    __m256 acc[4][4][2];
    float mn[4][4];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) {
            acc[m][r][0] = acc[m][r][1] = _mm256_setzero_ps();
            mn[m][r] = 0.0f;
        }
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)RR * rb, (size_t)RR * rb, s, ns);
        __m256i P[4][4][2];
        short scs[4][16];
        __m128i mins16[4];
        float d[4], dmin[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) {
            const uint8_t *b = w + (size_t)r * rb + (size_t)s * bb;
            if (type == KV_QTYPE_Q6_K) {
                d[r] = LDH(b + 208);
                dmin[r] = 0.0f;
                mins16[r] = _mm_setzero_si128();
                for (int j = 0; j < 16; j++) scs[r][j] = (int8_t)b[192 + j];
            } else {
                d[r] = LDH(b);
                dmin[r] = LDH(b + 2);
                uint32_t sc[2], mn2[2];
                kv_quant_scales_k4(b + 4, sc, mn2);
                mins16[r] = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn2));
                for (int j = 0; j < 8; j++) scs[r][j] = (short)kv_quant_k4_byte(sc, j);
            }
        }
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
            _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) P[m][r][0] = P[m][r][1] = _mm256_setzero_si256();
        for (int c2 = 0; c2 < 8; c2++) {
            __m256i x[4], x32[4];
            _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                x[m] = _mm256_loadu_si256((const __m256i *)(a->q + (size_t)(m0 + m) * K + 256 * (size_t)s + 32 * c2));
                if (type == KV_QTYPE_Q6_K) x32[m] = _mm256_maddubs_epi16(k32, x[m]);
            }
            _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) {
                const uint8_t *b = w + (size_t)r * rb + (size_t)s * bb;
                __m256i v = kq_chunk256(type, b, c2);
                __m256i scv = type == KV_QTYPE_Q6_K
                                  ? _mm256_set_m128i(_mm_set1_epi16(scs[r][2 * c2 + 1]), _mm_set1_epi16(scs[r][2 * c2]))
                                  : _mm256_set1_epi16(scs[r][c2]);
                _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                    __m256i pr = _mm256_maddubs_epi16(v, x[m]);
                    if (type == KV_QTYPE_Q6_K) pr = _mm256_sub_epi16(pr, x32[m]);
                    P[m][r][c2 & 1] = _mm256_add_epi32(P[m][r][c2 & 1], _mm256_madd_epi16(pr, scv));
                }
            }
        }
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
            const float dx = a->d[(size_t)(m0 + m) * ns + s];
            const int16_t *s32 = a->s32 + (size_t)(m0 + m) * (K / 32) + 8 * (size_t)s;
            _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) {
                __m256 sv = _mm256_set1_ps(d[r] * dx);
                acc[m][r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P[m][r][0]), sv, acc[m][r][0]);
                acc[m][r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P[m][r][1]), sv, acc[m][r][1]);
                if (mins) mn[m][r] = __builtin_fmaf((float)min_dot(mins16[r], s32), dmin[r] * dx, mn[m][r]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int r = 0; r < RR; r++) {
            float y = tree256(acc[m][r][0], acc[m][r][1]);
            if (mins) y = y - mn[m][r];
            Y[(size_t)m * ldy + r] = y;
        }
}

#define R1 4
#define R2 2
#define R3 1
#define R4 1
AVX2 static ALWAYS void g32_256(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                                int M, float *Y, size_t ldy) {
    TILES512(g32_tile256, type, 0);
}
#undef R1
#undef R2
#define R1 4
#define R2 1
AVX2 static ALWAYS void kq_256(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                               int M, float *Y, size_t ldy) {
    TILES512(kq_tile256, type, 0);
}
#undef R1
#undef R2
#undef R3
#undef R4

AVX2 void kv_q8_dot_avx2(int type, const void *w, size_t rb, int n_rows, const struct kv_q8_act *a, int m0, int M,
                         float *Y, size_t ldy) {
    const uint8_t *w8 = w;
    switch (type) {
    case KV_QTYPE_Q8_0: g32_256(KV_QTYPE_Q8_0, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    case KV_QTYPE_Q4_0: g32_256(KV_QTYPE_Q4_0, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    case KV_QTYPE_Q4_K: kq_256(KV_QTYPE_Q4_K, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    case KV_QTYPE_Q5_K: kq_256(KV_QTYPE_Q5_K, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    default: kq_256(KV_QTYPE_Q6_K, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    }
}

#endif /* KV_QUANT_X86 */
