/*
 * qdot_x86: the AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL) kernels of kv_qdot_rows (qdot.h).
 * Per-function target attributes: this file builds for baseline x86-64 and qdot.c only calls
 * a set the CPU has (kv_quant_get_isa).
 *
 * Shape of a kernel: a tile of M activation rows (1..4) x R weight rows, one 16-lane
 * accumulator per (m, r) pair (AVX-512: one zmm; AVX2: two ymm, lanes 0-7 and 8-15). The K
 * loop walks one "step" at a time (a 256-element super-block for Q4_K/Q5_K/Q6_K, a 32-element
 * block for Q8_0/Q4_0, 16 elements for F32/F16/BF16): per weight row the block's scales are
 * computed once (the same float products as quant_x86.c: d * sc, dmin * m, d * sc6), then
 * every 16-element chunk is dequantized into a register with exactly quant_x86.c's operations
 * (Q8_0 q * d; Q4_0 (q - 8) * d; Q4_K/Q5_K (d*sc) * q - (dmin*m), separate mul and sub;
 * Q6_K (d*sc) * (q - 32); F16 vcvtph2ps; BF16 bits << 16). For the 256-element types the
 * integer values of a super-block are first unpacked as bytes into a 256-byte stack buffer
 * per row with wide integer ops (y_stage / z_stage), so a chunk costs one widening load and
 * the float ops. Each chunk is FMA'd into the M accumulators of its row (lane j of chunk c
 * is element 16c + j: the contract's lane). Then the contract's
 * tree per accumulator and the K % 16 tail in scalar fma. Tiles: AVX-512 M=1: 8 rows, else 4;
 * AVX2 M=1: 4 rows, M=2: 2, M=3/4: 1 (16 ymm); leftover rows one at a time (same bits).
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "qdot.h"
#include "qdot_internal.h"

#ifdef KV_QUANT_X86

#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ALWAYS inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))

#define LDH(p) _cvtsh_ss(kv_quant_ld16(p))
#define LD128(p) _mm_loadu_si128((const __m128i *)(p))

/* elements / bytes of one step of the K loop */
static ALWAYS int step_elems(int type) {
    switch (type) {
    case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: case KV_QTYPE_Q6_K: return 256;
    case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: return 32;
    default: return 16;
    }
}
static ALWAYS size_t step_bytes(int type) {
    switch (type) {
    case KV_QTYPE_F32: return 64;
    case KV_QTYPE_F16: case KV_QTYPE_BF16: return 32;
    case KV_QTYPE_Q8_0: return 34;
    case KV_QTYPE_Q4_0: return 18;
    case KV_QTYPE_Q4_K: return 144;
    case KV_QTYPE_Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}
static ALWAYS bool has_scales(int type) { return step_elems(type) > 16; }
/* Steps per 64-byte chunk of a row: F32 1, F16/BF16 2; the block types read whole blocks (1). */
static ALWAYS int steps_per_chunk(int type) { return has_scales(type) ? 1 : (int)(64 / step_bytes(type)); }
/* Byte offset of step st (in the chunk starting at step c0) in a row. Block types: st * SB.
 * F32/F16/BF16 rows are read in 64-byte chunks, chunk c of the row at c * cs: cs = 64 in a
 * packed row (so again st * SB), cs = nr * 64 in the grouped layout (qdot.h: kv_qdot_grouped),
 * where the row pointer advances 64 bytes per row instead of a row's bytes. The tiles loop
 * over chunks outside and over a chunk's steps inside (unrolled), so each load instruction
 * advances by the same stride every turn, which the hardware's stride prefetcher follows
 * (alternating +32 / +cs - 32 strides ran the grouped tiles ~25% slower from L2). */
static ALWAYS size_t step_off(int type, int c0, int st, size_t cs) {
    const size_t SB = step_bytes(type);
    if (has_scales(type)) return (size_t)st * SB;
    return (size_t)(c0 / steps_per_chunk(type)) * cs + (size_t)(st - c0) * SB;
}

/* F32/F16/BF16 rows (no scales): while a tile reads step st of its R rows, prefetch (into L2)
 * the matching share of the next R rows, which follow contiguously when rb is the packed row
 * size (GGUF, model_alloc): a decode step's rows are short (768 f16 = 24 lines), too short
 * for the hardware prefetcher to ramp up per row. Only for rows of at most 2 KiB: longer ones
 * stream well on their own and measured no faster (bench_qdot --k 2048/4096) with it. A
 * prefetch past the matrix is harmless. */
static ALWAYS void float_prefetch(const uint8_t *w, size_t rb, int R, int st, size_t SB, size_t cs, bool nta) {
    if (rb > 2048 || cs != 64) return; /* long rows, or the grouped layout: one stream already */
    const uint8_t *next = w + (size_t)R * rb + (size_t)st * R * SB;
    KV_PREFETCH_RANGE(next, (size_t)R * SB, nta, 2); /* nta: AMD, which runs the grouped layout by default */
}

/* The grouped layout (qdot.h; cs = R * 64 bytes per chunk turn, a group's rows in one
 * sequential stream): each turn prefetches the bytes GROUP_PF ahead. The one stream alone left
 * a Sapphire Rapids core (VM, 2 MiB panel pages) reading it slower than the file's row streams
 * (1B F16 decode 5.2 vs 6.6 tok/s); with it 6.5-6.8 (AVX2 6.5-7.7), 12x768 F16 38-43 -> 45-54
 * tok/s (bench_engine --concurrency 1, alternated; 1024 and 16384 ahead measured less). That
 * is prefetcht0 (KV_PREFETCH_CACHE); on a Zen 5 core prefetcht0 cost bandwidth instead (a
 * 1B-shaped F16 panel stream at 0.83x of no prefetch; prefetchnta ~1.0x), so nta (quant.h:
 * KV_PREFETCH_NTA, the default on AMD) uses prefetchnta. Only loads are added: same bits. */
#define GROUP_PF 4096
static ALWAYS void group_prefetch(int type, const uint8_t *w, int c0, int PER, size_t cs, bool nta) {
    if (has_scales(type) || cs == 64) return; /* block types, or file rows (float_prefetch) */
    const uint8_t *p = w + (size_t)(c0 / PER) * cs + GROUP_PF;
    KV_PREFETCH_RANGE(p, cs, nta, 3);
}

/* weight k of an F32/F16/BF16 row (the K % 16 tail) */
AVX2 static ALWAYS float w_scalar(int type, const uint8_t *row, int k) {
    float f;
    if (type == KV_QTYPE_F32) {
        memcpy(&f, row + 4 * (size_t)k, 4);
    } else if (type == KV_QTYPE_F16) {
        f = LDH(row + 2 * (size_t)k);
    } else {
        uint32_t bits = (uint32_t)kv_quant_ld16(row + 2 * (size_t)k) << 16;
        memcpy(&f, &bits, 4);
    }
    return f;
}

/* fmaf(a, b, c): one rounding */
AVX2 static ALWAYS float fma1(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

/* the contract's tail: s = fma(x[k], w[k], s) for k = K16 .. K-1 */
AVX2 static ALWAYS float tail_dot(int type, float s, const float *x, const uint8_t *row, int K16, int K) {
    for (int k = K16; k < K; k++) s = fma1(x[k], w_scalar(type, row, k), s);
    return s;
}

/* the contract's tree from l8[j] = lane[j] + lane[j+8] (an 8-float vector) */
AVX2 static ALWAYS float tree8(__m256 l8) {
    __m128 l4 = _mm_add_ps(_mm256_castps256_ps128(l8), _mm256_extractf128_ps(l8, 1));
    __m128 l2 = _mm_add_ps(l4, _mm_movehl_ps(l4, l4));
    return _mm_cvtss_f32(_mm_add_ss(l2, _mm_shuffle_ps(l2, l2, 1)));
}

/* Q4_0: the 16 signed values q - 8 of chunk ch (0: low nibbles, 1: high) */
AVX2 static ALWAYS __m128i q40_q(const uint8_t *b, int ch) {
    const __m128i m4 = _mm_set1_epi8(0x0f), k8 = _mm_set1_epi8(8);
    __m128i raw = LD128(b + 2);
    __m128i q = ch ? _mm_and_si128(_mm_srli_epi16(raw, 4), m4) : _mm_and_si128(raw, m4);
    return _mm_sub_epi8(q, k8);
}

/* low 8 / high 8 bytes of v -> 8 floats */
#define LO8S(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
#define HI8S(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64((v), (v))))
#define LO8U(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
#define HI8U(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64((v), (v))))

/* per row and step: the scales. Q8_0/Q4_0: sa[0] = d. Q4_K/Q5_K: sa[s] = d * sc[s],
 * sb[s] = dmin * m[s]. Q6_K: sa[i] = d * scales[i] (16). */
AVX2 static ALWAYS void prep_scales(int type, const uint8_t *b, float *sa, float *sb) {
    switch (type) {
    case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: sa[0] = LDH(b); break;
    case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: {
        uint32_t sc[2], mn[2];
        kv_quant_scales_k4(b + 4, sc, mn);
        _mm256_storeu_ps(sa, _mm256_mul_ps(_mm256_set1_ps(LDH(b)), LO8U(_mm_loadl_epi64((const __m128i *)sc))));
        _mm256_storeu_ps(sb, _mm256_mul_ps(_mm256_set1_ps(LDH(b + 2)), LO8U(_mm_loadl_epi64((const __m128i *)mn))));
        break;
    }
    case KV_QTYPE_Q6_K: {
        __m256 vd = _mm256_set1_ps(LDH(b + 208));
        __m128i s16 = LD128(b + 192);
        _mm256_storeu_ps(sa, _mm256_mul_ps(vd, LO8S(s16)));
        _mm256_storeu_ps(sa + 8, _mm256_mul_ps(vd, HI8S(s16)));
        break;
    }
    default: break;
    }
}

/* ================================ AVX2 ================================ */

/* AVX2, Q4_K/Q5_K/Q6_K: the super-block's integer values staged as bytes in qb, the layout
 * of z_stage below (Q6_K: q - 32 in element order; Q4_K/Q5_K: sub-blocks 2c at qb[32c ..],
 * 2c + 1 at qb[128 + 32c ..]), with 256-bit operations. */
AVX2 static ALWAYS void y_stage(int type, const uint8_t *b, uint8_t *qb) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (type == KV_QTYPE_Q6_K) {
        const __m256i m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            __m256i L0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i L1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i C = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            __m256i lo[4] = {_mm256_and_si256(L0, m4), _mm256_and_si256(L1, m4),
                             _mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(L1, 4), m4)};
            __m256i hi[4] = {_mm256_and_si256(C, m3), _mm256_and_si256(_mm256_srli_epi16(C, 2), m3),
                             _mm256_and_si256(_mm256_srli_epi16(C, 4), m3),
                             _mm256_and_si256(_mm256_srli_epi16(C, 6), m3)};
            for (int g = 0; g < 4; g++)
                _mm256_storeu_si256((__m256i *)(qb + 128 * h + 32 * g),
                                    _mm256_sub_epi8(_mm256_or_si256(lo[g], _mm256_slli_epi16(hi[g], 4)), k32));
        }
        return;
    }
    const bool q5 = type == KV_QTYPE_Q5_K;
    const __m256i one = _mm256_set1_epi8(1);
    __m256i C = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i Q = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * c));
        __m256i lo = _mm256_and_si256(Q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(Q, 4), m4);
        if (q5) { /* bit 2c of qh[l] (sub-block 2c), bit 2c + 1 (sub-block 2c + 1) */
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(C, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(C, 2 * c + 1), one), 4));
        }
        _mm256_storeu_si256((__m256i *)(qb + 32 * c), lo);
        _mm256_storeu_si256((__m256i *)(qb + 128 + 32 * c), hi);
    }
}

/* 8 bytes at p -> 8 floats */
#define LD8U(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LD8S(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

/* chunk ch of the step at b, as two 8-float halves (K-quants: from the staged qb) */
AVX2 static ALWAYS void y_dq(int type, const uint8_t *b, const float *sa, const float *sb, const uint8_t *qb, int ch,
                             __m256 *lo, __m256 *hi) {
    switch (type) {
    case KV_QTYPE_F32:
        *lo = _mm256_loadu_ps((const float *)b);
        *hi = _mm256_loadu_ps((const float *)(b + 32));
        break;
    case KV_QTYPE_F16:
        *lo = _mm256_cvtph_ps(LD128(b));
        *hi = _mm256_cvtph_ps(LD128(b + 16));
        break;
    case KV_QTYPE_BF16:
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(LD128(b)), 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(LD128(b + 16)), 16));
        break;
    case KV_QTYPE_Q8_0: {
        __m256 d = _mm256_set1_ps(sa[0]);
        __m128i q = LD128(b + 2 + 16 * ch);
        *lo = _mm256_mul_ps(LO8S(q), d);
        *hi = _mm256_mul_ps(HI8S(q), d);
        break;
    }
    case KV_QTYPE_Q4_0: {
        __m256 d = _mm256_set1_ps(sa[0]);
        __m128i q = q40_q(b, ch);
        *lo = _mm256_mul_ps(LO8S(q), d);
        *hi = _mm256_mul_ps(HI8S(q), d);
        break;
    }
    case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: {
        int s = ch >> 1;
        const uint8_t *q = qb + (s & 1 ? 128 : 0) + 32 * (s >> 1) + 16 * (ch & 1);
        __m256 d1 = _mm256_broadcast_ss(&sa[s]), m1 = _mm256_broadcast_ss(&sb[s]);
        *lo = _mm256_sub_ps(_mm256_mul_ps(d1, LD8U(q)), m1);
        *hi = _mm256_sub_ps(_mm256_mul_ps(d1, LD8U(q + 8)), m1);
        break;
    }
    default: { /* Q6_K */
        __m256 s = _mm256_broadcast_ss(&sa[ch]);
        *lo = _mm256_mul_ps(s, LD8S(qb + 16 * ch));
        *hi = _mm256_mul_ps(s, LD8S(qb + 16 * ch + 8));
        break;
    }
    }
}

AVX2 static ALWAYS void y_tile(const int type, const uint8_t *w, size_t rb, size_t cs, int K, const float *X, size_t ldx,
                               float *Y, size_t ldy, const int M, const int R) {
    const int SE = step_elems(type);
    const size_t SB = step_bytes(type);
    const int nst = K / SE, K16 = nst * SE;
    __m256 alo[4][4], ahi[4][4];
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) alo[m][r] = ahi[m][r] = _mm256_setzero_ps();
    float sa[4][16], sb[4][8];
    uint8_t qb[4][256] __attribute__((aligned(32)));
    const int PER = steps_per_chunk(type);
    const bool nta = !has_scales(type) && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h */
    for (int c0 = 0; c0 < nst; c0 += PER) { /* one chunk per turn: constant strides */
        group_prefetch(type, w, c0, PER, cs, nta);
#pragma GCC unroll 4
        for (int j = 0; j < PER; j++) {
            const int st = c0 + j;
            if (st >= nst) break;
            const uint8_t *blk = w + step_off(type, c0, st, cs);
            if (!has_scales(type)) float_prefetch(w, rb, R, st, SB, cs, nta);
            if (has_scales(type))
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    prep_scales(type, blk + (size_t)r * rb, sa[r], sb[r]);
                    if (SE == 256) y_stage(type, blk + (size_t)r * rb, qb[r]);
                }
#pragma GCC unroll 16
            for (int ch = 0; ch < SE / 16; ch++) {
                const float *x = X + (size_t)st * SE + 16 * ch;
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m256 lo, hi;
                    y_dq(type, blk + (size_t)r * rb, sa[r], sb[r], qb[r], ch, &lo, &hi);
#pragma GCC unroll 4
                    for (int m = 0; m < M; m++) {
                        alo[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)m * ldx), lo, alo[m][r]);
                        ahi[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)m * ldx + 8), hi, ahi[m][r]);
                    }
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float s = tree8(_mm256_add_ps(alo[m][r], ahi[m][r]));
            if (K16 < K) s = tail_dot(type, s, X + (size_t)m * ldx, w + (size_t)r * rb, K16, K);
            Y[(size_t)m * ldy + r] = s;
        }
}

AVX2 static ALWAYS void y_run(const int type, const uint8_t *w, size_t rb, size_t cs, int n_rows, int K, const float *X,
                              size_t ldx, int M, float *Y, size_t ldy) {
    int r = 0;
    if (cs != 64 && !has_scales(type)) { /* a group of the grouped layout (qdot.h): one pass per X row */
        for (int m = 0; m < M; m++) {
            if (n_rows == 4) {
                y_tile(type, w, rb, cs, K, X + (size_t)m * ldx, ldx, Y + (size_t)m * ldy, ldy, 1, 4);
                continue;
            }
            for (r = 0; r < n_rows; r++) /* the short last group of a matrix */
                y_tile(type, w + (size_t)r * rb, rb, cs, K, X + (size_t)m * ldx, ldx, Y + (size_t)m * ldy + r, ldy, 1, 1);
        }
        return;
    }
#define YT(MM, RR) y_tile(type, w + (size_t)r * rb, rb, cs, K, X, ldx, Y + r, ldy, MM, RR)
    switch (M) {
    case 1:
        for (; r + 4 <= n_rows; r += 4) YT(1, 4);
        for (; r < n_rows; r++) YT(1, 1);
        break;
    case 2:
        for (; r + 2 <= n_rows; r += 2) YT(2, 2);
        for (; r < n_rows; r++) YT(2, 1);
        break;
    case 3:
        for (; r < n_rows; r++) YT(3, 1);
        break;
    default:
        for (; r < n_rows; r++) YT(4, 1);
        break;
    }
#undef YT
}

/* ================================ AVX-512 ================================ */

#define I8X16(v) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
#define U8X16(v) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))

/* AVX-512, Q4_K/Q5_K/Q6_K: the integer values of one super-block at b, staged as bytes in qb
 * (256) with a few 512-bit operations, so that each chunk then costs one widening load.
 * Q6_K: q - 32 (int8) in element order. Q4_K/Q5_K: qb[32c + l] = value of element 64c + l
 * (sub-block 2c), qb[128 + 32c + l] = element 64c + 32 + l (sub-block 2c + 1). The values
 * are the reference's (quant.c): Q6_K ((ql nibble | 2 qh bits << 4) - 32), Q4_K the nibble, Q5_K
 * the nibble + 16 * the qh bit. */
AVX512 static ALWAYS void z_stage(int type, const uint8_t *b, uint8_t *qb) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    if (type == KV_QTYPE_Q6_K) {
        const __m512i m3 = _mm512_set1_epi8(3), k32 = _mm512_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            __m512i L = _mm512_loadu_si512(b + 64 * h);
            __m256i C = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            /* bytes 0..31: qh (groups 0 and 2), 32..63: qh >> 2 (groups 1 and 3) */
            __m512i Cz = _mm512_inserti64x4(_mm512_castsi256_si512(C), _mm256_srli_epi16(C, 2), 1);
            __m512i A = _mm512_and_si512(L, m4), B = _mm512_and_si512(_mm512_srli_epi16(L, 4), m4);
            __m512i H01 = _mm512_and_si512(Cz, m3), H23 = _mm512_and_si512(_mm512_srli_epi16(Cz, 4), m3);
            _mm512_storeu_si512(qb + 128 * h, _mm512_sub_epi8(_mm512_or_si512(A, _mm512_slli_epi16(H01, 4)), k32));
            _mm512_storeu_si512(qb + 128 * h + 64, _mm512_sub_epi8(_mm512_or_si512(B, _mm512_slli_epi16(H23, 4)), k32));
        }
        return;
    }
    const bool q5 = type == KV_QTYPE_Q5_K;
    const __m512i one = _mm512_set1_epi8(1);
    for (int half = 0; half < 2; half++) { /* qs bytes 64 half .. +63: c = 2 half, 2 half + 1 */
        __m512i Q = _mm512_loadu_si512(b + (q5 ? 48 : 16) + 64 * half);
        __m512i lo = _mm512_and_si512(Q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(Q, 4), m4);
        if (q5) { /* byte 32j + l (c = 2 half + j) gets bit 2c of qh[l] (lo), bit 2c + 1 (hi) */
            __m256i C = _mm256_loadu_si256((const __m256i *)(b + 16));
            __m512i Cz = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(C, 4 * half)),
                                            _mm256_srli_epi16(C, 4 * half + 2), 1);
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(Cz, one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(Cz, 1), one), 4));
        }
        _mm512_storeu_si512(qb + 64 * half, lo);
        _mm512_storeu_si512(qb + 128 + 64 * half, hi);
    }
}

AVX512 static ALWAYS __m512 z_dq(int type, const uint8_t *b, const float *sa, const float *sb, const uint8_t *qb,
                                 int ch) {
    switch (type) {
    case KV_QTYPE_F32: return _mm512_loadu_ps((const float *)b);
    case KV_QTYPE_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    case KV_QTYPE_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16));
    case KV_QTYPE_Q8_0: return _mm512_mul_ps(I8X16(LD128(b + 2 + 16 * ch)), _mm512_set1_ps(sa[0]));
    case KV_QTYPE_Q4_0: return _mm512_mul_ps(I8X16(q40_q(b, ch)), _mm512_set1_ps(sa[0]));
    case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: { /* staged by z_stage */
        int s = ch >> 1;
        __m128i q = LD128(qb + (s & 1 ? 128 : 0) + 32 * (s >> 1) + 16 * (ch & 1));
        return _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(sa[s]), U8X16(q)), _mm512_set1_ps(sb[s]));
    }
    default: return _mm512_mul_ps(_mm512_set1_ps(sa[ch]), I8X16(LD128(qb + 16 * ch))); /* Q6_K, staged */
    }
}

AVX512 static ALWAYS float z_tree(__m512 a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return tree8(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}

AVX512 static ALWAYS void z_tile(const int type, const uint8_t *w, size_t rb, size_t cs, int K, const float *X, size_t ldx,
                                 float *Y, size_t ldy, const int M, const int R) {
    const int SE = step_elems(type);
    const size_t SB = step_bytes(type);
    const int nst = K / SE, K16 = nst * SE;
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    float sa[8][16], sb[8][8];
    uint8_t qb[8][256] __attribute__((aligned(64)));
    const int PER = steps_per_chunk(type);
    const bool nta = !has_scales(type) && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h */
    for (int c0 = 0; c0 < nst; c0 += PER) { /* one chunk per turn: constant strides */
        group_prefetch(type, w, c0, PER, cs, nta);
#pragma GCC unroll 4
        for (int j = 0; j < PER; j++) {
            const int st = c0 + j;
            if (st >= nst) break;
            const uint8_t *blk = w + step_off(type, c0, st, cs);
            if (!has_scales(type)) float_prefetch(w, rb, R, st, SB, cs, nta);
            if (has_scales(type))
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    prep_scales(type, blk + (size_t)r * rb, sa[r], sb[r]);
                    if (SE == 256) z_stage(type, blk + (size_t)r * rb, qb[r]);
                }
#pragma GCC unroll 16
            for (int ch = 0; ch < SE / 16; ch++) {
                const float *x = X + (size_t)st * SE + 16 * ch;
                __m512 xv[4];
#pragma GCC unroll 4
                for (int m = 0; m < M; m++) xv[m] = _mm512_loadu_ps(x + (size_t)m * ldx);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    __m512 wv = z_dq(type, blk + (size_t)r * rb, sa[r], sb[r], qb[r], ch);
#pragma GCC unroll 4
                    for (int m = 0; m < M; m++) acc[m][r] = _mm512_fmadd_ps(xv[m], wv, acc[m][r]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            float s = z_tree(acc[m][r]);
            if (K16 < K) s = tail_dot(type, s, X + (size_t)m * ldx, w + (size_t)r * rb, K16, K);
            Y[(size_t)m * ldy + r] = s;
        }
}

AVX512 static ALWAYS void z_run(const int type, const uint8_t *w, size_t rb, size_t cs, int n_rows, int K, const float *X,
                                size_t ldx, int M, float *Y, size_t ldy) {
    int r = 0;
#define ZT(MM, RR) z_tile(type, w + (size_t)r * rb, rb, cs, K, X, ldx, Y + r, ldy, MM, RR)
    if (cs != 64 && !has_scales(type)) { /* a group of the grouped layout (qdot.h): one tile for all its rows */
        switch (n_rows == 4 ? M : 0) {
        case 1: ZT(1, 4); break;
        case 2: ZT(2, 4); break;
        case 3: ZT(3, 4); break;
        case 4: ZT(4, 4); break;
        default: /* the short last group of a matrix */
            for (; r < n_rows; r++) {
                switch (M) {
                case 1: ZT(1, 1); break;
                case 2: ZT(2, 1); break;
                case 3: ZT(3, 1); break;
                default: ZT(4, 1); break;
                }
            }
        }
        return;
    }
    switch (M) {
    case 1:
        for (; r + 8 <= n_rows; r += 8) ZT(1, 8);
        for (; r + 4 <= n_rows; r += 4) ZT(1, 4);
        for (; r < n_rows; r++) ZT(1, 1);
        break;
    case 2:
        for (; r + 4 <= n_rows; r += 4) ZT(2, 4);
        for (; r < n_rows; r++) ZT(2, 1);
        break;
    case 3:
        for (; r + 4 <= n_rows; r += 4) ZT(3, 4);
        for (; r < n_rows; r++) ZT(3, 1);
        break;
    default:
        for (; r + 4 <= n_rows; r += 4) ZT(4, 4);
        for (; r < n_rows; r++) ZT(4, 1);
        break;
    }
#undef ZT
}

/* one non-inlined kernel per type and ISA */
#define QDOT_ARGS const uint8_t *w, size_t rb, size_t cs, int n_rows, int K, const float *X, size_t ldx, int M, float *Y, size_t ldy
#define QDOT_PASS w, rb, cs, n_rows, K, X, ldx, M, Y, ldy
#define KERNELS(T, name)                                                                          \
    AVX2 NOINLINE static void y_##name(QDOT_ARGS) { y_run(T, QDOT_PASS); }                       \
    AVX512 NOINLINE static void z_##name(QDOT_ARGS) { z_run(T, QDOT_PASS); }
KERNELS(KV_QTYPE_F32, f32)
KERNELS(KV_QTYPE_F16, f16)
KERNELS(KV_QTYPE_BF16, bf16)
KERNELS(KV_QTYPE_Q8_0, q8_0)
KERNELS(KV_QTYPE_Q4_0, q4_0)
KERNELS(KV_QTYPE_Q4_K, q4_k)
KERNELS(KV_QTYPE_Q5_K, q5_k)
KERNELS(KV_QTYPE_Q6_K, q6_k)

#define DISPATCH(P)                                                                               \
    switch (type) {                                                                               \
    case KV_QTYPE_F32: P##_f32(QDOT_PASS); break;                                                 \
    case KV_QTYPE_F16: P##_f16(QDOT_PASS); break;                                                 \
    case KV_QTYPE_BF16: P##_bf16(QDOT_PASS); break;                                               \
    case KV_QTYPE_Q8_0: P##_q8_0(QDOT_PASS); break;                                               \
    case KV_QTYPE_Q4_0: P##_q4_0(QDOT_PASS); break;                                               \
    case KV_QTYPE_Q4_K: P##_q4_k(QDOT_PASS); break;                                               \
    case KV_QTYPE_Q5_K: P##_q5_k(QDOT_PASS); break;                                               \
    case KV_QTYPE_Q6_K: P##_q6_k(QDOT_PASS); break;                                               \
    default: break;                                                                               \
    }

void kv_qdot_avx2(int type, QDOT_ARGS) { DISPATCH(y) }
void kv_qdot_avx512(int type, QDOT_ARGS) { DISPATCH(z) }

/* kv_fgroup_rows (qdot.h): each 64-byte chunk of the grouped layout converted straight into
 * its row of out (the conversions are exact, so the bits of kv_dequant_row) */
#define FGROUP_ROWS_BODY(STORE16)                                                                 \
    const size_t SB = step_bytes(type), RB = (size_t)K * (SB / 16), nc = RB / 64;                 \
    const int PER = steps_per_chunk(type);                                                        \
    for (int g0 = 0; g0 < n_rows; g0 += KV_FGROUP_ROWS) {                                         \
        const int nr = n_rows - g0 < KV_FGROUP_ROWS ? n_rows - g0 : KV_FGROUP_ROWS;              \
        const uint8_t *b = g + (size_t)g0 * RB;                                                   \
        for (size_t c = 0; c < nc; c++)                                                           \
            for (int i = 0; i < nr; i++, b += 64) {                                               \
                float *o = out + (size_t)(g0 + i) * ldo + c * (size_t)PER * 16;                   \
                for (int j = 0; j < PER; j++) STORE16(o + 16 * j, b + (size_t)j * SB);            \
            }                                                                                     \
    }
#define Y_STORE16(o, p)                                                                           \
    do {                                                                                          \
        __m256 lo, hi;                                                                            \
        y_dq(type, (p), NULL, NULL, NULL, 0, &lo, &hi);                                           \
        _mm256_storeu_ps((o), lo);                                                                \
        _mm256_storeu_ps((o) + 8, hi);                                                            \
    } while (0)
#define Z_STORE16(o, p) _mm512_storeu_ps((o), z_dq(type, (p), NULL, NULL, NULL, 0))
AVX2 static ALWAYS void y_fgroup_rows(const int type, const uint8_t *g, int n_rows, int K, float *out, size_t ldo) {
    FGROUP_ROWS_BODY(Y_STORE16)
}
AVX512 static ALWAYS void z_fgroup_rows(const int type, const uint8_t *g, int n_rows, int K, float *out, size_t ldo) {
    FGROUP_ROWS_BODY(Z_STORE16)
}
AVX2 void kv_fgroup_rows_avx2(int type, const uint8_t *g, int n_rows, int K, float *out, size_t ldo) {
    switch (type) {
    case KV_QTYPE_F32: y_fgroup_rows(KV_QTYPE_F32, g, n_rows, K, out, ldo); break;
    case KV_QTYPE_F16: y_fgroup_rows(KV_QTYPE_F16, g, n_rows, K, out, ldo); break;
    case KV_QTYPE_BF16: y_fgroup_rows(KV_QTYPE_BF16, g, n_rows, K, out, ldo); break;
    default: break;
    }
}
AVX512 void kv_fgroup_rows_avx512(int type, const uint8_t *g, int n_rows, int K, float *out, size_t ldo) {
    switch (type) {
    case KV_QTYPE_F32: z_fgroup_rows(KV_QTYPE_F32, g, n_rows, K, out, ldo); break;
    case KV_QTYPE_F16: z_fgroup_rows(KV_QTYPE_F16, g, n_rows, K, out, ldo); break;
    case KV_QTYPE_BF16: z_fgroup_rows(KV_QTYPE_BF16, g, n_rows, K, out, ldo); break;
    default: break;
    }
}

#else
typedef int kv_qdot_x86_unused;
#endif
