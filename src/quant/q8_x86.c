/*
 * q8_x86: the AVX2 and AVX-512 kernels of kv_q8_dot_rows and of the activation quantization
 * (q8.h). Per-function target attributes: the file builds for baseline x86-64 and q8.c only
 * calls a set the CPU has.
 *
 * Decode kernels (kv_q8_dot_rows, the packed GGUF rows as they are): a tile of 16 (AVX-512)
 * or 8 (AVX2) weight rows for one activation row. Per row, integer products into 4-element
 * lanes: AVX2 vpmaddubsw (u8 x s8 -> s16 pairs; never saturates here: the unsigned side is at
 * most 128 for Q8_0 (|w| through the sign trick), 63 otherwise) then vpmaddwd (x 1, or x the
 * sub-block scale); AVX-512 the same on 64 bytes, or with VNNI vpdpbusd on w + 128 for Q8_0 (the
 * 128 * sum(q) comes off after) and vpdpwssd for the scaled pairs. Then a transposed reduction
 * turns the tile's lane vectors into one vector of per-row block sums, and the contract's float
 * step runs on a vector of rows (one fma per row per group).
 * Prefill kernels (kv_q8_dot_packed): outer products on a repacked panel, lanes = 16 weight
 * rows. AVX512-VNNI: vpdpbusd of the panel's u + 128 (u8) with a broadcast of 4 activation bytes,
 * the 128 * sum(q) taken off per sub-block. AMX: TDPBSSD of a 16-row activation tile with the
 * panel's sub-block (signed x signed, no correction), 16 x 16 sums per instruction.
 * The same packed kernels run decode on matrices repacked at load (Q8_0): one activation row,
 * up to 4 row groups side by side so that the weights arrive as several concurrent streams.
 * Integer sums are exact, so every route gives the contract's block sums and the float steps
 * are the contract's: identical bits on every ISA.
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
#include <pthread.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define ALWAYS inline __attribute__((always_inline))

#define LDH(p) _cvtsh_ss(kv_quant_ld16(p))

int kv_q8_cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
}

/* AMX-INT8: the CPU has it, Linux granted this process the tile data state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, Linux >= 5.16), and KVSERVE_CPU_AMX is not 0. Decided once. */
#define KV_ARCH_REQ_XCOMP_PERM 0x1023
#define KV_XFEATURE_XTILEDATA 18
static int g_amx;
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;
static void amx_probe(void) {
    __builtin_cpu_init();
    if (kv_q8_amx_env() == 0) return;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("avx512vnni"))
        return;
    g_amx = syscall(SYS_arch_prctl, KV_ARCH_REQ_XCOMP_PERM, KV_XFEATURE_XTILEDATA) == 0;
}
int kv_q8_cpu_has_amx(void) {
    pthread_once(&g_amx_once, amx_probe);
    return g_amx;
}

/* Software prefetch of the next tile's weight rows (they follow this tile's RR rows in memory):
 * step i of n covers its share of [next, next + span). Decode (M <= 4: PF) reads each weight once,
 * and the hardware prefetchers alone leave a core far below its memory bandwidth on short rows
 * (K = 768: 27% more decode time without it); prefill re-reads a task's rows from L2 instead.
 * prefetcht1 (into L2) beats prefetcht0 by ~10% on a Sapphire Rapids core (Q8_0 and AVX2 path;
 * the L1 fill buffers are the limit), prefetchnta is 1.6x slower; one tile ahead is enough. */
static ALWAYS void prefetch_share(const uint8_t *next, size_t span, int i, int n) {
    const size_t per = (span + (size_t)n - 1) / (size_t)n; /* n is constant per tile: hoisted */
    const uint8_t *p = next + per * (size_t)i;
    for (size_t o = 0; o < per; o += 64) __builtin_prefetch(p + o, 0, 2); /* to L2 (t1) */
}

/* Calls FN(T, args...) with T the weight type as a compile-time constant (one instantiation of
 * the always-inline kernels per type). */
#define Q8_DISPATCH(type, FN, ...)                                                                     \
    do {                                                                                              \
        switch (type) {                                                                               \
        case KV_QTYPE_Q8_0: FN(KV_QTYPE_Q8_0, __VA_ARGS__); break;                                     \
        case KV_QTYPE_Q4_0: FN(KV_QTYPE_Q4_0, __VA_ARGS__); break;                                     \
        case KV_QTYPE_Q4_K: FN(KV_QTYPE_Q4_K, __VA_ARGS__); break;                                     \
        case KV_QTYPE_Q5_K: FN(KV_QTYPE_Q5_K, __VA_ARGS__); break;                                     \
        default: FN(KV_QTYPE_Q6_K, __VA_ARGS__); break;                                                \
        }                                                                                             \
    } while (0)

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

/* Transposed reduction: R[r] (r < 16) hold int32 lanes; lanes 0-7 belong to group A and 8-15
 * to group B of row r (or all 16 to one group: then *sa + *sb is the row's sum). Out: *va[r] =
 * sum of lanes 0-7 of R[r], *vb[r] = sum of lanes 8-15. */
AVX512 static ALWAYS void tred512(__m512i R[16], __m512i *va, __m512i *vb) {
    __m512i S1[8], S2[4];
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)
        S1[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(R[2 * i], R[2 * i + 1]), _mm512_unpackhi_epi32(R[2 * i], R[2 * i + 1]));
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
        S2[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(S1[2 * i], S1[2 * i + 1]), _mm512_unpackhi_epi64(S1[2 * i], S1[2 * i + 1]));
    /* S2[j]: 128-bit chunk c holds rows 4j..4j+3, each the sum of its original chunk c */
    __m512i Z0 = _mm512_add_epi32(_mm512_shuffle_i32x4(S2[0], S2[1], 0x88), _mm512_shuffle_i32x4(S2[0], S2[1], 0xdd));
    __m512i Z1 = _mm512_add_epi32(_mm512_shuffle_i32x4(S2[2], S2[3], 0x88), _mm512_shuffle_i32x4(S2[2], S2[3], 0xdd));
    /* Z0: [rows 0-3 A, rows 0-3 B, rows 4-7 A, rows 4-7 B] (0x88 picks chunks 0,2 / 0xdd 1,3) */
    *va = _mm512_shuffle_i32x4(Z0, Z1, 0x88);
    *vb = _mm512_shuffle_i32x4(Z0, Z1, 0xdd);
}

/* The f16 at byte offset off of rows 0..nr-1 (others 0) as 16 floats. The gather reads 4
 * bytes: off .. off+3, or off-2 .. off+1 when the f16 ends its block (Q6_K's d), so it never
 * reads outside the block. */
AVX512 static ALWAYS __m512 gather_h(const uint8_t *w, size_t rb, int nr, size_t off, const int at_end) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)rb));
    __mmask16 k = (__mmask16)((1u << nr) - 1);
    __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, (const void *)(w + off - (at_end ? 2 : 0)), 1);
    if (at_end) g = _mm512_srli_epi32(g, 16);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

/* Q8_0 / Q4_0, one activation row, nr <= 16 rows. */
AVX512 static ALWAYS void g32_row512(int type, const uint8_t *w, size_t rb, int nr, const struct kv_q8_act *a, int m,
                                     float *Y, const int VN, const int PF) {
    const int K = a->K, nb = K / 32;
    const size_t bb = type == KV_QTYPE_Q8_0 ? 34 : 18;
    const int8_t *qx = a->q + (size_t)m * K;
    const float *dx = a->d + (size_t)m * nb;
    const int16_t *s16 = a->s16 + (size_t)m * (K / 16);
    const __m512i k80 = _mm512_set1_epi8((char)0x80), m4 = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi16(1);
    /* the correction per block: S = lane sum - c * sum(q) */
    const int c = type == KV_QTYPE_Q8_0 ? (VN ? 128 : 0) : 8;
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        const int one = b + 1 == nb;
        if (PF) prefetch_share(w + (size_t)16 * rb, (size_t)16 * rb, b / 2, (nb + 1) / 2);
        __m512i x = one ? _mm512_maskz_loadu_epi8(0xffffffffull, qx + 32 * (size_t)b)
                        : _mm512_loadu_si512((const void *)(qx + 32 * (size_t)b));
        __m512i R[16];
        _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {
            if (r >= nr) {
                R[r] = _mm512_setzero_si512();
                continue;
            }
            const uint8_t *b0 = w + (size_t)r * rb + (size_t)b * bb, *b1 = b0 + bb;
            __m512i wv;
            if (type == KV_QTYPE_Q8_0) {
                __m256i lo = _mm256_loadu_si256((const __m256i *)(b0 + 2));
                __m256i hi = one ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(b1 + 2));
                wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            } else {
                __m128i r0 = _mm_loadu_si128((const __m128i *)(b0 + 2));
                __m128i r1 = one ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)(b1 + 2));
                wv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_srli_epi16(r0, 4), r0)),
                                        _mm256_set_m128i(_mm_srli_epi16(r1, 4), r1), 1);
                wv = _mm512_and_si512(wv, m4);
            }
            if (type == KV_QTYPE_Q8_0 && !VN) {
                __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), x);
                R[r] = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(wv), sx), ones);
            } else if (VN) {
                R[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), type == KV_QTYPE_Q8_0 ? _mm512_xor_si512(wv, k80) : wv, x);
            } else {
                R[r] = _mm512_madd_epi16(_mm512_maddubs_epi16(wv, x), ones);
            }
        }
        __m512i va, vb;
        tred512(R, &va, &vb);
        _Pragma("GCC unroll 2") for (int h = 0; h < 2 - one; h++) {
            const int bi = b + h;
            __m512i S = h ? vb : va;
            if (c) S = _mm512_sub_epi32(S, _mm512_set1_epi32(c * (s16[2 * bi] + s16[2 * bi + 1])));
            __m512 sv = _mm512_mul_ps(gather_h(w, rb, nr, (size_t)bi * bb, 0), _mm512_set1_ps(dx[bi]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), sv, acc);
        }
    }
    _mm512_mask_storeu_ps(Y, (__mmask16)((1u << nr) - 1), acc);
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

/* the integer scales of a super-block as int16 (Q4_K/Q5_K: 8, Q6_K: 16) in the low lanes */
AVX512 static ALWAYS __m512i kq_scales512(int type, const uint8_t *b) {
    if (type == KV_QTYPE_Q6_K)
        return _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
    uint32_t sc[2], mn[2];
    kv_quant_scales_k4(b + 4, sc, mn);
    return _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
}

/* Q4_K/Q5_K: sum_j m_j * s32[j] of one row's super-block (s16: the activation's 16 sums) */
AVX2 static ALWAYS int32_t min_dot(const uint8_t *b, const int16_t *s16) {
    uint32_t sc[2], mn[2];
    kv_quant_scales_k4(b + 4, sc, mn);
    __m128i a = _mm_loadu_si128((const __m128i *)s16), c = _mm_loadu_si128((const __m128i *)(s16 + 8));
    __m128i s32 = _mm_packs_epi32(_mm_madd_epi16(a, _mm_set1_epi16(1)), _mm_madd_epi16(c, _mm_set1_epi16(1)));
    __m128i p = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn)), s32);
    p = _mm_add_epi32(p, _mm_unpackhi_epi64(p, p));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 1));
    return _mm_cvtsi128_si32(p);
}

/* Activation rows per call of the many-row K-quant tiles (kq_tilem512, kq_tilem256): their
 * float sums wait on the stack between super-blocks */
#define KQ_MT 64
AVX2 static ALWAYS __m256i kq_mins8(const __m128i V[8], const int16_t *s16); /* AVX2 section */

/* Q4_K/Q5_K's 8 mins of one row's super-block as int16 (low 128 bits), for kq_mins8 */
AVX2 static ALWAYS __m128i kq_mins16(const uint8_t *b) {
    uint32_t sc[2], mn[2];
    kv_quant_scales_k4(b + 4, sc, mn);
    return _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]));
}

/* K-quants, AVX-512, 2..KQ_MT activation rows: nr <= 16 weight rows x M activation rows. Per
 * super-block the 16 rows' quants (kq_chunk512) and int16 scales are staged once and every one
 * of the M rows runs on them (kq_row512 decodes them again for each activation row and reads
 * the rows again from memory); the rows' mins sums by kq_mins8 on the staged mins. A short tile
 * stages row 0 for the missing rows (their lanes are never stored). Exact integer sums, and the
 * float steps of kq_row512 in its order: the same bits. */
AVX512 static ALWAYS void kq_tilem512(int type, const uint8_t *w, size_t rb, int nr, const struct kv_q8_act *a, int m0,
                                      int M, float *Y, size_t ldy, const int VN, const int PF) {
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512 acc[KQ_MT], mn[KQ_MT];
    for (int m = 0; m < M; m++) acc[m] = mn[m] = _mm512_setzero_ps();
    __m512i ub[16][4], scv[16][4]; /* [row][chunk]: unpacked quants, int16 scales */
    __m128i mvs[16];               /* [row]: Q4_K/Q5_K's 8 mins as int16 */
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)16 * rb, (size_t)16 * rb, s, ns);
        _Pragma("GCC unroll 1") for (int r = 0; r < 16; r++) {
            const uint8_t *b = w + (size_t)(r < nr ? r : 0) * rb + (size_t)s * bb;
            const __m512i sc = kq_scales512(type, b);
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                ub[r][c] = kq_chunk512(type, b, c);
                scv[r][c] = _mm512_permutexvar_epi16(kq_idx512(type, c), sc);
            }
            mvs[r] = mins ? kq_mins16(b) : _mm_setzero_si128();
        }
        const size_t doff = type == KV_QTYPE_Q6_K ? 208 : 0;
        const __m512 dw = gather_h(w, rb, nr, (size_t)s * bb + doff, type == KV_QTYPE_Q6_K);
        const __m512 dmw = mins ? gather_h(w, rb, nr, (size_t)s * bb + 2, 0) : _mm512_setzero_ps();
        _Pragma("GCC unroll 1") for (int m = 0; m < M; m++) {
            const int8_t *qx = a->q + (size_t)(m0 + m) * K + 256 * (size_t)s;
            __m512i R[16];
            _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) R[r] = _mm512_setzero_si512();
            /* chunks in a loop, not unrolled (as kq_tilem256: unrolled, GCC keeps the products) */
            _Pragma("GCC unroll 1") for (int c = 0; c < 4; c++) {
                const __m512i x = _mm512_loadu_si512((const void *)(qx + 64 * c));
                const __m512i x32 = type == KV_QTYPE_Q6_K ? _mm512_maddubs_epi16(k32, x) : _mm512_setzero_si512();
                _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {
                    __m512i pr = _mm512_maddubs_epi16(ub[r][c], x);
                    if (type == KV_QTYPE_Q6_K) pr = _mm512_sub_epi16(pr, x32);
                    R[r] = VN ? _mm512_dpwssd_epi32(R[r], pr, scv[r][c]) : _mm512_add_epi32(R[r], _mm512_madd_epi16(pr, scv[r][c]));
                }
            }
            __m512i va, vb;
            tred512(R, &va, &vb);
            const __m512 dx = _mm512_set1_ps(a->d[(size_t)(m0 + m) * ns + s]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(va, vb)), _mm512_mul_ps(dw, dx), acc[m]);
            if (mins) {
                const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + 16 * (size_t)s;
                const __m512i mi = _mm512_inserti64x4(_mm512_castsi256_si512(kq_mins8(mvs, s16)), kq_mins8(mvs + 8, s16), 1);
                mn[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mi), _mm512_mul_ps(dmw, dx), mn[m]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        _mm512_mask_storeu_ps(Y + (size_t)m * ldy, (__mmask16)((1u << nr) - 1), mins ? _mm512_sub_ps(acc[m], mn[m]) : acc[m]);
}

AVX512 static ALWAYS void kq_row512(int type, const uint8_t *w, size_t rb, int nr, const struct kv_q8_act *a, int m,
                                    float *Y, const int VN, const int PF) {
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const int8_t *qx = a->q + (size_t)m * K;
    const float *dx = a->d + (size_t)m * ns;
    const int16_t *s16 = a->s16 + (size_t)m * (K / 16);
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512 acc = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)16 * rb, (size_t)16 * rb, s, ns);
        __m512i x[4], x32[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            x[c] = _mm512_loadu_si512((const void *)(qx + 256 * (size_t)s + 64 * c));
            if (type == KV_QTYPE_Q6_K) x32[c] = _mm512_maddubs_epi16(k32, x[c]);
        }
        __m512i R[16];
        int32_t mi[16];
        _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {
            if (r >= nr) {
                R[r] = _mm512_setzero_si512();
                mi[r] = 0;
                continue;
            }
            const uint8_t *b = w + (size_t)r * rb + (size_t)s * bb;
            __m512i sc = kq_scales512(type, b), P = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                __m512i pr = _mm512_maddubs_epi16(kq_chunk512(type, b, c), x[c]);
                if (type == KV_QTYPE_Q6_K) pr = _mm512_sub_epi16(pr, x32[c]);
                __m512i scv = _mm512_permutexvar_epi16(kq_idx512(type, c), sc);
                P = VN ? _mm512_dpwssd_epi32(P, pr, scv) : _mm512_add_epi32(P, _mm512_madd_epi16(pr, scv));
            }
            R[r] = P;
            mi[r] = mins ? min_dot(b, s16 + 16 * (size_t)s) : 0;
        }
        __m512i va, vb;
        tred512(R, &va, &vb);
        const size_t doff = type == KV_QTYPE_Q6_K ? 208 : 0;
        __m512 sv = _mm512_mul_ps(gather_h(w, rb, nr, (size_t)s * bb + doff, type == KV_QTYPE_Q6_K), _mm512_set1_ps(dx[s]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(va, vb)), sv, acc);
        if (mins) {
            __m512 mv = _mm512_mul_ps(gather_h(w, rb, nr, (size_t)s * bb + 2, 0), _mm512_set1_ps(dx[s]));
            mn = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)mi)), mv, mn);
        }
    }
    if (mins) acc = _mm512_sub_ps(acc, mn);
    _mm512_mask_storeu_ps(Y, (__mmask16)((1u << nr) - 1), acc);
}

#define ROWS_LOOP(FN, T, VN, RT)                                                                          \
    do {                                                                                                  \
        for (int m = 0; m < M; m++)                                                                       \
            for (int r = 0; r < n_rows; r += RT) {                                                        \
                const int nr = n_rows - r < RT ? n_rows - r : RT;                                         \
                if (M <= 4) FN(T, w8 + (size_t)r * rb, rb, nr, a, m0 + m, Y + (size_t)m * ldy + r, VN, 1); \
                else FN(T, w8 + (size_t)r * rb, rb, nr, a, m0 + m, Y + (size_t)m * ldy + r, VN, 0);       \
            }                                                                                             \
    } while (0)

/* K-quants, M >= 2: kq_tilem512 over 16-row tiles, KQ_MT activation rows at a time (at M <= 4
 * asking for the next tile's rows meanwhile, as kq_row512 does). Functions of their own (not
 * inlined into the one-row dispatch: inlined there, the one-row Q4_K decode streamed 20% slower,
 * bench_qdot --int8 stream, Zen 5) */
#define MANY512(VN) many512_##VN(type, w8, rb, n_rows, a, m0, M, Y, ldy)
#define MANY512_FN(VN)                                                                                     \
    AVX512 __attribute__((noinline)) static void many512_##VN(int type, const uint8_t *w8, size_t rb, int n_rows, \
                                                              const struct kv_q8_act *a, int m0, int M, float *Y,  \
                                                              size_t ldy) {                                        \
        switch (type) {                                                                                   \
        case KV_QTYPE_Q4_K: MANY512_T(KV_QTYPE_Q4_K, VN); break;                                          \
        case KV_QTYPE_Q5_K: MANY512_T(KV_QTYPE_Q5_K, VN); break;                                          \
        default: MANY512_T(KV_QTYPE_Q6_K, VN); break;                                                     \
        }                                                                                                 \
    }
#define MANY512_T(T, VN)                                                                                   \
    do {                                                                                                  \
        for (int m = 0; m < M; m += KQ_MT) {                                                              \
            const int mm = M - m < KQ_MT ? M - m : KQ_MT;                                                 \
            for (int r = 0; r < n_rows; r += 16) {                                                        \
                const int nr = n_rows - r < 16 ? n_rows - r : 16;                                         \
                float *y = Y + (size_t)m * ldy + r;                                                       \
                if (M <= 4) kq_tilem512(T, w8 + (size_t)r * rb, rb, nr, a, m0 + m, mm, y, ldy, VN, 1);    \
                else kq_tilem512(T, w8 + (size_t)r * rb, rb, nr, a, m0 + m, mm, y, ldy, VN, 0);           \
            }                                                                                             \
        }                                                                                                 \
    } while (0)

#define DISPATCH512(VN)                                                                                    \
    if (M > 1 && type != KV_QTYPE_Q8_0 && type != KV_QTYPE_Q4_0) { /* K-quants, 2+ rows */                  \
        MANY512(VN);                                                                                      \
        return;                                                                                           \
    }                                                                                                     \
    switch (type) {                                                                                       \
    case KV_QTYPE_Q8_0: ROWS_LOOP(g32_row512, KV_QTYPE_Q8_0, VN, 16); break;                               \
    case KV_QTYPE_Q4_0: ROWS_LOOP(g32_row512, KV_QTYPE_Q4_0, VN, 16); break;                               \
    case KV_QTYPE_Q4_K: ROWS_LOOP(kq_row512, KV_QTYPE_Q4_K, VN, 16); break;                                \
    case KV_QTYPE_Q5_K: ROWS_LOOP(kq_row512, KV_QTYPE_Q5_K, VN, 16); break;                                \
    default: ROWS_LOOP(kq_row512, KV_QTYPE_Q6_K, VN, 16); break;                                           \
    }

MANY512_FN(1)
MANY512_FN(0)

AVX512 static void dot512_vnni(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                               int M, float *Y, size_t ldy) {
    DISPATCH512(1)
}
/* Compiled with the VNNI target only so that the shared always-inline kernels (which hold both
 * routes, picked by the constant VN) inline here; with VN = 0 no VNNI intrinsic is reached and
 * GCC does not fuse vpmaddwd + vpaddd into vpdpwssd (objdump of this function: no vpdp*), so it
 * runs on AVX-512 CPUs without VNNI. */
AVX512 static void dot512_plain(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0,
                                int M, float *Y, size_t ldy) {
    DISPATCH512(0)
}

void kv_q8_dot_avx512(int type, const void *w, size_t rb, int n_rows, const struct kv_q8_act *a, int m0, int M,
                      float *Y, size_t ldy, int vnni) {
    if (vnni) dot512_vnni(type, w, rb, n_rows, a, m0, M, Y, ldy);
    else dot512_plain(type, w, rb, n_rows, a, m0, M, Y, ldy);
}

/* Software prefetch of a panel repacked at load, into L1: the grp_bytes that lie `ahead` bytes
 * after the current group grp (0: none). Each row group is one sequential stream.
 * - decode (one activation row, up to 4 row groups side by side; every type but the K-quants,
 *   as before): two groups ahead gave +7-15% tokens/s at 1B (memory-bound; 1, 2, 4 or 6 ahead
 *   measured alike): PF_DECODE.
 * - 4 or more rows (a decode step of many sequences; prefill), Q8_0 only (the one type the CPU
 *   backend repacks at load; the others' panels are made per task and step, kv_q8_pack, and
 *   read from L2): the first tile over a row group reads it from DRAM, the others find it in
 *   L1/L2, so only the first prefetches, PF_MANY ahead. Without it that first pass waited on
 *   DRAM latency: 1B Q8_0, 16 sequences (bench_engine --concurrency 16, Zen 5, one thread,
 *   alternated pairs): AVX-512 VNNI decode 154-168 -> 192-210 tokens/s (1.14-1.36x; 2 groups
 *   ahead: 175-180, 8: 195-215, 16-64: 195-228), AVX2 1.03-1.05x (docs/benchmarks.md).
 * Prefetches only: same bits. */
#define PF_DECODE(g) ((g).kq ? 0 : 2 * (int)(g).grp)
#define PF_MANY(type) ((type) == KV_QTYPE_Q8_0 ? 16384 : 0)
static ALWAYS void prefetch_group_ahead(const uint8_t *grp, size_t grp_bytes, int ahead) {
    const char *pf = (const char *)grp + ahead;
    for (size_t l = 0; l < grp_bytes; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
}

/* ---------------- AVX-512 VNNI: packed panels (prefill) ---------------- */

/* NG consecutive 16-row groups of the panel (rgb bytes apart; nr rows valid in the last, the
 * others full) x MR activation rows (NG > 1 only with MR = 1). Decode reads the NG groups side
 * by side, NG concurrent streams: one core's read bandwidth grows with the number of sequential
 * streams in flight (docs/benchmarks.md). Each output's sums run in the same order whatever NG
 * is (the groups are independent): the same bits. */
AVX512 static ALWAYS void packed_tile(int type, const uint8_t *rg, size_t rgb, int nr, const struct kv_q8_act *a,
                                      int m0, float *Y, size_t ldy, const int MR, const int NG, const int pf) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int K = a->K, ng = K / g.G;
    __m512 acc[8][4], mn[8][4]; /* [m][u] */
    _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) acc[m][u] = mn[m][u] = _mm512_setzero_ps();
    for (int s = 0; s < ng; s++) {
        const uint8_t *gp[4]; /* group s of each row group */
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) gp[u] = rg + (size_t)u * rgb + (size_t)s * g.grp;
        if (pf) _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) prefetch_group_ahead(gp[u], g.grp, pf);
        __m512i I[8][4];
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++)
            _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) I[m][u] = _mm512_setzero_si512();
        for (int j = 0; j < g.J; j++) {
            const size_t so = g.hdr + (size_t)j * g.sub; /* the sub-block in a group */
            const int e0 = s * g.G + j * g.S;
            __m512i C[8][4];
            _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++)
                _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) C[m][u] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int k4 = 0; k4 < g.S / 4; k4++) {
                __m512i vv[4];
                _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
                    vv[u] = _mm512_xor_si512(_mm512_load_si512((const void *)(gp[u] + so + (g.kq ? 64 : 0) + 64 * k4)),
                                             _mm512_set1_epi8((char)0x80));
                _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {
                    int32_t x4;
                    memcpy(&x4, a->q + (size_t)(m0 + m) * K + e0 + 4 * k4, 4);
                    const __m512i xb = _mm512_set1_epi32(x4);
                    _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
                        C[m][u] = _mm512_dpbusd_epi32(C[m][u], vv[u], xb);
                }
            }
            _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {
                const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + e0 / 16;
                int qs = g.S == 32 ? s16[0] + s16[1] : s16[0];
                _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) {
                    __m512i t = _mm512_sub_epi32(C[m][u], _mm512_set1_epi32(128 * qs));
                    I[m][u] = g.kq ? _mm512_add_epi32(I[m][u], _mm512_mullo_epi32(t, _mm512_load_si512((const void *)(gp[u] + so))))
                                   : t;
                }
            }
        }
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) {
            const uint8_t *grp = gp[u];
            __m512 dv = _mm512_load_ps((const float *)grp);
            _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {
                const float dxs = a->d[(size_t)(m0 + m) * ng + s];
                acc[m][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[m][u]), _mm512_mul_ps(dv, _mm512_set1_ps(dxs)),
                                            acc[m][u]);
                if (g.mins) {
                    const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + 16 * (size_t)s;
                    __m512i Mi = _mm512_setzero_si512();
                    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
                        Mi = _mm512_add_epi32(Mi, _mm512_mullo_epi32(_mm512_load_si512((const void *)(grp + 128 + 64 * j)),
                                                                     _mm512_set1_epi32(s16[2 * j] + s16[2 * j + 1])));
                    __m512 dm = _mm512_mul_ps(_mm512_load_ps((const float *)(grp + 64)), _mm512_set1_ps(dxs));
                    mn[m][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mi), dm, mn[m][u]);
                }
            }
        }
    }
    _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) {
        const __mmask16 k = u == NG - 1 ? (__mmask16)((1u << nr) - 1) : (__mmask16)0xffff;
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++)
            _mm512_mask_storeu_ps(Y + (size_t)m * ldy + 16 * u, k,
                                  g.mins ? _mm512_sub_ps(acc[m][u], mn[m][u]) : acc[m][u]);
    }
}

/* The next chunk of a decode walk over `left` row groups: at most 4 groups (streams), the
 * chunks as even as they can be (5 -> 3 + 2, 6 -> 3 + 3, 7 -> 4 + 3), so no chunk is a lone
 * stream when it need not be. 4 streams: 1B Q8_0 decode 10.1 -> 13.1 tok/s on a Sapphire Rapids
 * core (bench_engine, 1 thread, medians of 5 alternated runs); 8 measured alike within noise. */
static ALWAYS int decode_chunk(int left) {
    const int n = (left + 3) / 4;
    return (left + n - 1) / n;
}

AVX512 static ALWAYS void packed_t(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0,
                                   int M, float *Y, size_t ldy) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const size_t rgb = (size_t)(a->K / g.G) * g.grp;
    if (M < 4) { /* decode: chunks of row groups side by side, per row of X */
        const int n_grp = (n_rows + 15) / 16;
        for (int q = 0; q < n_grp;) {
            const int c = decode_chunk(n_grp - q), r = 16 * q;
            const int nr = n_rows - r - 16 * (c - 1) < 16 ? n_rows - r - 16 * (c - 1) : 16; /* rows of the last group */
            const uint8_t *rg = panel + (size_t)q * rgb;
            for (int m = 0; m < M; m++) {
                float *y = Y + (size_t)m * ldy + r;
                switch (c) {
                case 1: packed_tile(type, rg, rgb, nr, a, m0 + m, y, ldy, 1, 1, PF_DECODE(g)); break;
                case 2: packed_tile(type, rg, rgb, nr, a, m0 + m, y, ldy, 1, 2, PF_DECODE(g)); break;
                case 3: packed_tile(type, rg, rgb, nr, a, m0 + m, y, ldy, 1, 3, PF_DECODE(g)); break;
                default: packed_tile(type, rg, rgb, nr, a, m0 + m, y, ldy, 1, 4, PF_DECODE(g)); break;
                }
            }
            q += c;
        }
        return;
    }
    for (int r = 0; r < n_rows; r += 16) {
        const int nr = n_rows - r < 16 ? n_rows - r : 16;
        const uint8_t *rg = panel + (size_t)(r / 16) * rgb;
        int m = 0;
        /* the first tile of the row group streams it in (prefetch_group_ahead) */
        for (; m + 8 <= M; m += 8) packed_tile(type, rg, rgb, nr, a, m0 + m, Y + (size_t)m * ldy + r, ldy, 8, 1, m ? 0 : PF_MANY(type));
        for (; m + 4 <= M; m += 4) packed_tile(type, rg, rgb, nr, a, m0 + m, Y + (size_t)m * ldy + r, ldy, 4, 1, m ? 0 : PF_MANY(type));
        for (; m < M; m++) packed_tile(type, rg, rgb, nr, a, m0 + m, Y + (size_t)m * ldy + r, ldy, 1, 1, 0);
    }
}

AVX512 void kv_q8_packed_avx512vnni(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0,
                                    int M, float *Y, size_t ldy) {
    Q8_DISPATCH(type, packed_t, panel, n_rows, a, m0, M, Y, ldy);
}

/* The scalar part of packing one row's group: d (and dmin), sub-block scales, mins. */
AVX2 static ALWAYS void pack_scales(int type, const struct kv_q8_geo *g, const uint8_t *blk, uint8_t *grp, int n) {
    if (!g->kq) {
        float d = LDH(blk);
        memcpy(grp + 4 * n, &d, 4);
        return;
    }
    float d = LDH(type == KV_QTYPE_Q6_K ? blk + 208 : blk), dmin = type == KV_QTYPE_Q6_K ? 0.0f : LDH(blk + 2);
    memcpy(grp + 4 * n, &d, 4);
    memcpy(grp + 64 + 4 * n, &dmin, 4);
    if (type == KV_QTYPE_Q6_K) {
        for (int j = 0; j < 16; j++) {
            int32_t sc = (int8_t)blk[192 + j];
            memcpy(grp + g->hdr + (size_t)j * g->sub + 4 * n, &sc, 4);
        }
        return;
    }
    uint32_t sc[2], mn[2];
    kv_quant_scales_k4(blk + 4, sc, mn);
    for (int j = 0; j < 8; j++) {
        int32_t a = kv_quant_k4_byte(sc, j), b = kv_quant_k4_byte(mn, j);
        memcpy(grp + g->hdr + (size_t)j * g->sub + 4 * n, &a, 4);
        memcpy(grp + 128 + 64 * (size_t)j + 4 * n, &b, 4);
    }
}

/* Repacks rows into the panel layout (q8_internal.h) with the chunk unpackers above and dword
 * scatters into VNNI order; the same bytes as kv_q8_pack's scalar code (test_q8). */
AVX512 static ALWAYS void pack_t(int type, const uint8_t *w, size_t rb, int n_rows, int K, uint8_t *panel) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int ng = K / g.G;
    const size_t bb = kv_qtype_block_bytes(type), rgb = (size_t)ng * g.grp, vo = g.kq ? 64 : 0;
    /* dword i of a 64-element chunk c -> byte offset in the group (K-quants) */
    __m512i idxc[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        int32_t t[16];
        for (int i = 0; i < 16; i++) {
            int e = 64 * c + 4 * i, j = e / g.S, k4 = (e % g.S) / 4;
            t[i] = (int32_t)(g.hdr + (size_t)j * g.sub + vo + 64 * (size_t)k4);
        }
        idxc[c] = _mm512_loadu_si512((const void *)t);
    }
    const __m256i idx8 = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *row = w + (size_t)r * rb;
        uint8_t *rg = panel + (size_t)(r / 16) * rgb;
        const int n = r % 16;
        for (int s = 0; s < ng; s++) {
            const uint8_t *blk = row + (size_t)s * bb;
            uint8_t *grp = rg + (size_t)s * g.grp;
            pack_scales(type, &g, blk, grp, n);
            if (!g.kq) {
                __m256i v;
                if (type == KV_QTYPE_Q8_0) {
                    v = _mm256_loadu_si256((const __m256i *)(blk + 2));
                } else {
                    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
                    v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
                    v = _mm256_sub_epi8(v, _mm256_set1_epi8(8)); /* nibble - 8 */
                }
                _mm256_i32scatter_epi32((void *)(grp + g.hdr + 4 * n), idx8, v, 1);
                continue;
            }
            const __m512i off = _mm512_set1_epi8((char)(type == KV_QTYPE_Q6_K ? 32 : 0)); /* u */
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                _mm512_i32scatter_epi32((void *)(grp + 4 * n), idxc[c], _mm512_sub_epi8(kq_chunk512(type, blk, c), off), 1);
        }
    }
}

AVX512 void kv_q8_pack_avx512(int type, const void *w, size_t rb, int n_rows, int K, void *panel) {
    Q8_DISPATCH(type, pack_t, w, rb, n_rows, K, panel);
}

/* ---------------- AMX (prefill, 16 activation rows at a time) ---------------- */

#define AMXT __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Tile configuration (64 bytes, palette 1): two sets of (C = 16 x 16 int32, A = 16 activation
 * rows x S bytes, B = S / 4 rows x 64 bytes of the panel): tmm0-2 and tmm3-5, so the product of
 * the next sub-block runs while the previous one's result is read back (amx_tile). Loaded per
 * thread when the sub-block size S changes (AMX state is per thread). */
struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static __thread int t_amx_s; /* S of the configuration loaded on this thread, 0 = none */

AMXT static void amx_config(int S) {
    if (t_amx_s == S) return;
    struct amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = 16, c.colsb[t] = 64;
        c.rows[t + 1] = 16, c.colsb[t + 1] = (uint16_t)S;
        c.rows[t + 2] = (uint8_t)(S / 4), c.colsb[t + 2] = 64;
    }
    /* GCC 12 does not see that ldtilecfg reads c and drops the stores above without this */
    __asm__ volatile("" : : "m"(c) : "memory");
    _tile_loadconfig(&c);
    t_amx_s = S;
}

/* Sub-block t (= group s, sub-block j) of a 16-row panel group rg x 16 activation rows: the
 * tile product into C from A, B (tile numbers: compile-time), its 16 x 16 int32 result stored
 * to cb. */
#define AMX_PRODUCT(C, A, B, t, cb)                                                                 \
    do {                                                                                           \
        const int s_ = (t) / g.J, j_ = (t) % g.J;                                                  \
        const uint8_t *sub_ = rg + (size_t)s_ * g.grp + g.hdr + (size_t)j_ * g.sub;                \
        _tile_zero(C);                                                                             \
        _tile_loadd(A, q0 + (size_t)s_ * g.G + (size_t)j_ * g.S, K);                               \
        _tile_loadd(B, sub_ + (g.kq ? 64 : 0), 64);                                                \
        _tile_dpbssd(C, A, B);                                                                     \
        _tile_stored(C, cb, 64);                                                                   \
    } while (0)

/* Adds sub-block t's int32 products cb into I (scaled by the sub-block scales for K-quants);
 * after a group's last sub-block, adds the group into acc / mn in float and clears I. */
AMXT static ALWAYS void amx_consume(int type, const uint8_t *rg, const struct kv_q8_act *a, int m0, int t,
                                    int32_t cb[16][16], __m512i I[16], __m512 acc[16], __m512 mn[16]) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int K = a->K, ng = K / g.G, s = t / g.J, j = t % g.J;
    const uint8_t *grp = rg + (size_t)s * g.grp;
    if (g.kq) {
        const __m512i sc = _mm512_load_si512((const void *)(grp + g.hdr + (size_t)j * g.sub));
        _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++)
            I[m] = _mm512_add_epi32(I[m], _mm512_mullo_epi32(_mm512_load_si512((const void *)cb[m]), sc));
    } else {
        _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++) I[m] = _mm512_load_si512((const void *)cb[m]);
    }
    if (j != g.J - 1) return;
    const __m512 dv = _mm512_load_ps((const float *)grp);
    __m512 dmv = _mm512_setzero_ps();
    /* the mins term sum_j min_j * bsum_j (8 sub-blocks) in vpmaddwd pairs instead of 8
     * vpmulld a row (2 uops each on one port: they were half the kernel's vector work): mins
     * (6-bit, >= 0) of sub-blocks 2i, 2i+1 as the int16 halves of each lane, the row's two
     * 32-element sums (|.| <= 32 * 128) as the broadcast int16 pair; exact, like the products */
    __m512i mp[4];
    if (g.mins) {
        dmv = _mm512_load_ps((const float *)(grp + 64));
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
            mp[i] = _mm512_or_si512(_mm512_load_si512((const void *)(grp + 128 + 128 * i)),
                                    _mm512_slli_epi32(_mm512_load_si512((const void *)(grp + 192 + 128 * i)), 16));
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++) {
        const float dxs = a->d[(size_t)(m0 + m) * ng + s];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[m]), _mm512_mul_ps(dv, _mm512_set1_ps(dxs)), acc[m]);
        I[m] = _mm512_setzero_si512();
        if (g.mins) {
            const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + 16 * (size_t)s;
            __m512i Mi = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                const uint32_t b0 = (uint16_t)(s16[4 * i] + s16[4 * i + 1]), b1 = (uint16_t)(s16[4 * i + 2] + s16[4 * i + 3]);
                Mi = _mm512_add_epi32(Mi, _mm512_madd_epi16(mp[i], _mm512_set1_epi32((int)(b0 | b1 << 16))));
            }
            mn[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mi), _mm512_mul_ps(dmv, _mm512_set1_ps(dxs)), mn[m]);
        }
    }
}

/* One 16-row group of the panel (nr valid) x 16 activation rows from m0. The sub-blocks' tile
 * products alternate between the two tile sets, one ahead of the vector work that reads them
 * back: reading a tile's stored result right after its store waited for the store (perf put a
 * quarter of the prefill on that load). The integer sums are exact, the float steps keep their
 * order: the same bits as one product at a time. */
AMXT static ALWAYS void amx_tile(int type, const uint8_t *rg, int nr, const struct kv_q8_act *a, int m0, float *Y,
                                 size_t ldy) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int K = a->K, T = K / g.G * g.J;
    int32_t cb[2][16][16] __attribute__((aligned(64)));
    __m512 acc[16], mn[16];
    __m512i I[16];
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++) {
        acc[m] = mn[m] = _mm512_setzero_ps();
        I[m] = _mm512_setzero_si512();
    }
    const int8_t *q0 = a->q + (size_t)m0 * K;
    if (T > 0) AMX_PRODUCT(0, 1, 2, 0, cb[0]);
    for (int t = 0; t < T; t += 2) {
        if (t + 1 < T) AMX_PRODUCT(3, 4, 5, t + 1, cb[1]);
        amx_consume(type, rg, a, m0, t, cb[0], I, acc, mn);
        if (t + 1 < T) {
            if (t + 2 < T) AMX_PRODUCT(0, 1, 2, t + 2, cb[0]);
            amx_consume(type, rg, a, m0, t + 1, cb[1], I, acc, mn);
        }
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++)
        _mm512_mask_storeu_ps(Y + (size_t)m * ldy, k, g.mins ? _mm512_sub_ps(acc[m], mn[m]) : acc[m]);
}

AMXT static ALWAYS void amx_t(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                              float *Y, size_t ldy) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const size_t rgb = (size_t)(a->K / g.G) * g.grp;
    const int M16 = M - M % 16;
    amx_config(g.S);
    for (int r = 0; r < n_rows; r += 16) {
        const int nr = n_rows - r < 16 ? n_rows - r : 16;
        const uint8_t *rg = panel + (size_t)(r / 16) * rgb;
        for (int m = 0; m < M16; m += 16) amx_tile(type, rg, nr, a, m0 + m, Y + (size_t)m * ldy + r, ldy);
    }
    /* fewer than 16 rows left: the VNNI kernel (same bits) */
    if (M16 < M) kv_q8_packed_avx512vnni(type, panel, n_rows, a, m0 + M16, M - M16, Y + (size_t)M16 * ldy, ldy);
}

AMXT void kv_q8_packed_amx(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                           float *Y, size_t ldy) {
    Q8_DISPATCH(type, amx_t, panel, n_rows, a, m0, M, Y, ldy);
}

/* ---------------- AVX2 ---------------- */

/* 8 rows' int32 lane vectors -> one vector of the rows' sums */
AVX2 static ALWAYS __m256i tred256(const __m256i R[8]) {
    __m256i h01 = _mm256_hadd_epi32(R[0], R[1]), h23 = _mm256_hadd_epi32(R[2], R[3]);
    __m256i h45 = _mm256_hadd_epi32(R[4], R[5]), h67 = _mm256_hadd_epi32(R[6], R[7]);
    __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    /* a: lane half 0 = rows 0-3 over lanes 0-3, half 1 = rows 0-3 over lanes 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* the f16 at byte offset off of rows 0..nr-1 (others 0) as 8 floats: one dword gather (bytes
 * off .. off+3, or off-2 .. off+1 when the f16 ends its block), low / high halves packed */
AVX2 static ALWAYS __m256 gather_h8(const uint8_t *w, size_t rb, int nr, size_t off, const int at_end) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)rb));
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i g = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(const void *)(w + off - (at_end ? 2 : 0)),
                                            idx, live, 1);
    if (at_end) g = _mm256_srli_epi32(g, 16);
    g = _mm256_and_si256(g, _mm256_set1_epi32(0xffff));
    __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(g), _mm256_extracti128_si256(g, 1));
    return _mm256_cvtph_ps(h);
}

/* gather_h8's result by scalar loads (rows >= nr: 0). Where the rows stream from DRAM the gather
 * waits for all eight lines before anything after it issues; the loads do not (K-quant decode,
 * bench_qdot --int8 stream, AVX2 Q4_K: 0.041 -> 0.032 ns a weight on Zen 5, Q6_K level). */
AVX2 static ALWAYS __m256 load_h8(const uint8_t *w, size_t rb, int nr, size_t off) {
    short h[8];
    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) h[r] = r < nr ? (short)kv_quant_ld16(w + (size_t)r * rb + off) : 0;
    return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

AVX2 static ALWAYS void store8(float *Y, int nr, __m256 v) {
    if (nr == 8) {
        _mm256_storeu_ps(Y, v);
        return;
    }
    float t[8];
    _mm256_storeu_ps(t, v);
    memcpy(Y, t, sizeof(float) * (size_t)nr);
}

/* Q8_0 / Q4_0: nr <= 8 weight rows x MR <= 4 activation rows (m0 ..), Y row m at Y + m * ldy */
AVX2 static ALWAYS void g32_tile256(int type, const uint8_t *w, size_t rb, int nr, const struct kv_q8_act *a, int m0,
                                    float *Y, size_t ldy, const int MR, const int PF) {
    const int K = a->K, nb = K / 32;
    const size_t bb = type == KV_QTYPE_Q8_0 ? 34 : 18;
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[4];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (PF) prefetch_share(w + (size_t)8 * rb, (size_t)8 * rb, b, nb);
        __m256i wv[8], aw[8];
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
            const uint8_t *blk = w + (size_t)(r < nr ? r : 0) * rb + (size_t)b * bb;
            if (type == KV_QTYPE_Q8_0) {
                wv[r] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                aw[r] = _mm256_abs_epi8(wv[r]);
            } else {
                __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
                wv[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
            }
        }
        const __m256 dw = gather_h8(w, rb, nr, (size_t)b * bb, 0);
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
            const int8_t *qx = a->q + (size_t)(m0 + m) * K + 32 * (size_t)b;
            __m256i x = _mm256_loadu_si256((const __m256i *)qx), R[8];
            _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)
                R[r] = type == KV_QTYPE_Q8_0
                           ? _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(x, wv[r])), ones)
                           : _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], x), ones);
            __m256i S = tred256(R);
            if (type == KV_QTYPE_Q4_0) {
                const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + 2 * (size_t)b;
                S = _mm256_sub_epi32(S, _mm256_set1_epi32(8 * (s16[0] + s16[1])));
            }
            __m256 sv = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[(size_t)(m0 + m) * nb + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), sv, acc[m]);
        }
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) store8(Y + (size_t)m * ldy, nr, acc[m]);
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

/* The sub-block scales of a K-quant super-block as 16 int16 lanes laid out for kq_dec256's
 * per-chunk vpshufb: chunk c2 (32 elements) takes int16 element c2 of each 128-bit lane. Q4_K /
 * Q5_K: the 8 scales (one a chunk) in both lanes; Q6_K: the even-numbered of its 16 scales in
 * the low lane, the odd in the high one (chunk c2's low half is sub-block 2 c2, its high half
 * 2 c2 + 1). *mins: Q4_K / Q5_K's 8 mins as int16 (low 128 bits). */
AVX2 static ALWAYS __m256i kq_dec_scales(int type, const uint8_t *b, __m128i *mins) {
    if (type == KV_QTYPE_Q6_K) {
        const __m128i eo = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(b + 192)), eo));
    }
    uint32_t sc[2], mn[2];
    kv_quant_scales_k4(b + 4, sc, mn);
    *mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]));
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc[1], (int)sc[0])));
}

/* Q4_K/Q5_K's mins term of 8 rows, sum_j m_j * s32_j each, as 8 int32 lanes: V[r] are the rows'
 * 8 int16 mins, s16 the activation's 16 sums of 16 of the super-block (the 32-element sums are
 * made here). Exact integer sums, as min_dot's. */
AVX2 static ALWAYS __m256i kq_mins8(const __m128i V[8], const int16_t *s16) {
    __m128i Q[8];
    const __m128i o = _mm_set1_epi16(1);
    const __m128i s32 = _mm_packs_epi32(_mm_madd_epi16(_mm_loadu_si128((const __m128i *)s16), o),
                                        _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(s16 + 8)), o));
    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) Q[r] = _mm_madd_epi16(V[r], s32);
    /* two hadd levels: rows 0-3, rows 4-7 */
    const __m128i q01 = _mm_hadd_epi32(Q[0], Q[1]), q23 = _mm_hadd_epi32(Q[2], Q[3]);
    const __m128i q45 = _mm_hadd_epi32(Q[4], Q[5]), q67 = _mm_hadd_epi32(Q[6], Q[7]);
    return _mm256_set_m128i(_mm_hadd_epi32(q45, q67), _mm_hadd_epi32(q01, q23));
}

/* K-quants, one activation row (decode): nr <= 8 weight rows. Each row's super-block is
 * unpacked in registers, its scales decoded once into one vector (kq_dec_scales) and picked per
 * chunk by vpshufb; the rows are unrolled (a short last tile re-reads row 0 for the missing rows,
 * whose lanes are never stored), so the 8 row sums stay in registers; the activation's 32-element
 * sums for the mins and Q6_K's 32 * x term are made once per super-block, not once per row. The
 * integer sums are exact and the float steps are the contract's (q8.h), in its order: the same bits. */
AVX2 static ALWAYS void kq_dec256(int type, const uint8_t *w, size_t rb, int nr, const struct kv_q8_act *a, int m,
                                  float *Y, const int PF) {
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m256i k32 = _mm256_set1_epi8(32);
    __m256 acc = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
    __m256i x32[8]; /* Q6_K: 32 * x as vpmaddubsw pairs, per chunk */
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)8 * rb, (size_t)8 * rb, s, ns);
        const int8_t *qx = a->q + (size_t)m * K + 256 * (size_t)s;
        const int16_t *s16 = a->s16 + (size_t)m * (K / 16) + 16 * (size_t)s;
        if (!mins) {
            _Pragma("GCC unroll 8") for (int c2 = 0; c2 < 8; c2++)
                x32[c2] = _mm256_maddubs_epi16(k32, _mm256_loadu_si256((const __m256i *)(qx + 32 * c2)));
        }
        __m256i R[8];
        __m128i Q[8];
        /* a loop, not unrolled: unrolled, GCC interleaved the 8 rows' 64 chunk products and
         * kept them on the stack */
        _Pragma("GCC unroll 1") for (int r = 0; r < 8; r++) {
            const uint8_t *b = w + (size_t)(r < nr ? r : 0) * rb + (size_t)s * bb;
            __m128i mv = _mm_setzero_si128();
            const __m256i t = kq_dec_scales(type, b, &mv);
            __m256i P = _mm256_setzero_si256();
            _Pragma("GCC unroll 8") for (int c2 = 0; c2 < 8; c2++) {
                const __m256i bi = _mm256_set1_epi16((short)(0x0100 * (2 * c2 + 1) + 2 * c2));
                __m256i pr = _mm256_maddubs_epi16(kq_chunk256(type, b, c2), _mm256_loadu_si256((const __m256i *)(qx + 32 * c2)));
                if (type == KV_QTYPE_Q6_K) pr = _mm256_sub_epi16(pr, x32[c2]);
                P = _mm256_add_epi32(P, _mm256_madd_epi16(pr, _mm256_shuffle_epi8(t, bi)));
            }
            R[r] = P;
            Q[r] = mv; /* the row's mins (zero for Q6_K) */
        }
        const size_t doff = type == KV_QTYPE_Q6_K ? 208 : 0;
        const __m256 dw = load_h8(w, rb, nr, (size_t)s * bb + doff);
        const float dx = a->d[(size_t)m * ns + s];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tred256(R)), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
        if (mins) {
            const __m256i mi = kq_mins8(Q, s16);
            const __m256 dmw = load_h8(w, rb, nr, (size_t)s * bb + 2);
            mn = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_mul_ps(dmw, _mm256_set1_ps(dx)), mn);
        }
    }
    store8(Y, nr, mins ? _mm256_sub_ps(acc, mn) : acc);
}

/* K-quants, two or more activation rows (a decode step of several sequences, prefills): nr <=
 * 8 weight rows x M <= KQ_MT activation rows. Per super-block the 8 rows' quants and scales are
 * staged once and every one of the M rows runs on them, so the staging and the weights' reads
 * are shared by all M rows; the rows' float sums
 * wait in a stack array between super-blocks. A short tile stages row 0 for the missing rows
 * (their lanes are never stored). The integer sums are exact and the float steps are
 * kq_dec256's, in its order, for each (weight row, activation row): the same bits, without the
 * per-step repack (kv_q8_pack) the panels need. */
AVX2 static ALWAYS void kq_tilem256(int type, const uint8_t *w, size_t rb, int nr, const struct kv_q8_act *a, int m0,
                                    int M, float *Y, size_t ldy, const int PF) {
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m256i k32 = _mm256_set1_epi8(32);
    __m256 acc[KQ_MT], mn[KQ_MT];
    for (int m = 0; m < M; m++) acc[m] = mn[m] = _mm256_setzero_ps();
    __m256i ub[8][8], scv[8][8]; /* [row][chunk]: unpacked quants, int16 scales */
    __m128i mvs[8];              /* [row]: Q4_K/Q5_K's 8 mins as int16 */
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)8 * rb, (size_t)8 * rb, s, ns);
        _Pragma("GCC unroll 1") for (int r = 0; r < 8; r++) {
            const uint8_t *b = w + (size_t)(r < nr ? r : 0) * rb + (size_t)s * bb;
            mvs[r] = _mm_setzero_si128();
            const __m256i t = kq_dec_scales(type, b, &mvs[r]);
            _Pragma("GCC unroll 8") for (int c2 = 0; c2 < 8; c2++) {
                ub[r][c2] = kq_chunk256(type, b, c2);
                scv[r][c2] = _mm256_shuffle_epi8(t, _mm256_set1_epi16((short)(0x0100 * (2 * c2 + 1) + 2 * c2)));
            }
        }
        const size_t doff = type == KV_QTYPE_Q6_K ? 208 : 0;
        const __m256 dw = load_h8(w, rb, nr, (size_t)s * bb + doff);
        const __m256 dmw = mins ? load_h8(w, rb, nr, (size_t)s * bb + 2) : _mm256_setzero_ps();
        _Pragma("GCC unroll 1") for (int m = 0; m < M; m++) {
            const int8_t *qx = a->q + (size_t)(m0 + m) * K + 256 * (size_t)s;
            __m256i R[8];
            _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) R[r] = _mm256_setzero_si256();
            /* chunks in a loop, not unrolled: unrolled, GCC made all 64 products first and kept
             * them on the stack (as in kq_dec256) */
            _Pragma("GCC unroll 1") for (int c2 = 0; c2 < 8; c2++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + 32 * c2));
                const __m256i x32 = type == KV_QTYPE_Q6_K ? _mm256_maddubs_epi16(k32, x) : _mm256_setzero_si256();
                _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
                    __m256i pr = _mm256_maddubs_epi16(ub[r][c2], x);
                    if (type == KV_QTYPE_Q6_K) pr = _mm256_sub_epi16(pr, x32);
                    R[r] = _mm256_add_epi32(R[r], _mm256_madd_epi16(pr, scv[r][c2]));
                }
            }
            const __m256 dx = _mm256_set1_ps(a->d[(size_t)(m0 + m) * ns + s]);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tred256(R)), _mm256_mul_ps(dw, dx), acc[m]);
            if (mins) {
                const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + 16 * (size_t)s;
                mn[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_mins8(mvs, s16)), _mm256_mul_ps(dmw, dx), mn[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) store8(Y + (size_t)m * ldy, nr, mins ? _mm256_sub_ps(acc[m], mn[m]) : acc[m]);
}

/* K-quants, M >= 2: kq_tilem256 over 8-row tiles, KQ_MT activation rows at a time; at M <= 4
 * the next tile's rows are asked for while this one runs (from DRAM a tile of 2-3 activation
 * rows is otherwise latency-bound: bench_qdot --int8 --m 2 stream, AVX2 Q4_K, Zen 5: without it
 * 0.063 ns a weight against 0.046 for two one-row passes) */
AVX2 static ALWAYS void kq_rows_many256_t(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a,
                                          int m0, int M, float *Y, size_t ldy) {
    for (int m = 0; m < M; m += KQ_MT) {
        const int mm = M - m < KQ_MT ? M - m : KQ_MT;
        for (int r = 0; r < n_rows; r += 8) {
            const int nr = n_rows - r < 8 ? n_rows - r : 8;
            if (M <= 4) kq_tilem256(type, w8 + (size_t)r * rb, rb, nr, a, m0 + m, mm, Y + (size_t)m * ldy + r, ldy, 1);
            else kq_tilem256(type, w8 + (size_t)r * rb, rb, nr, a, m0 + m, mm, Y + (size_t)m * ldy + r, ldy, 0);
        }
    }
}

/* A function of its own, as many512_1 (not inlined into kv_q8_dot_avx2's one-row decode) */
AVX2 __attribute__((noinline)) static void kq_rows_many256(int type, const uint8_t *w8, size_t rb, int n_rows,
                                                           const struct kv_q8_act *a, int m0, int M, float *Y,
                                                           size_t ldy) {
    switch (type) {
    case KV_QTYPE_Q4_K: kq_rows_many256_t(KV_QTYPE_Q4_K, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    case KV_QTYPE_Q5_K: kq_rows_many256_t(KV_QTYPE_Q5_K, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    default: kq_rows_many256_t(KV_QTYPE_Q6_K, w8, rb, n_rows, a, m0, M, Y, ldy); break;
    }
}

/* K-quants, one activation row: kq_dec256 over 8-row tiles. A function of its own per type:
 * compiled inside kv_q8_dot_avx2 beside the other tiles, its register allocation changed with
 * theirs (Q4_K decode 6% slower after kq_tilem256 came, bench_qdot --int8 --m 1, Zen 5) */
#define KQ_DEC_ROWS(NAME, T)                                                                                \
    AVX2 __attribute__((noinline)) static void NAME(const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, \
                                                    int m0, float *Y) {                                     \
        for (int r = 0; r < n_rows; r += 8) kq_dec256(T, w8 + (size_t)r * rb, rb, n_rows - r < 8 ? n_rows - r : 8, a, m0, Y + r, 1); \
    }
KQ_DEC_ROWS(kq_dec_rows_q4k, KV_QTYPE_Q4_K)
KQ_DEC_ROWS(kq_dec_rows_q5k, KV_QTYPE_Q5_K)
KQ_DEC_ROWS(kq_dec_rows_q6k, KV_QTYPE_Q6_K)
static void kq_dec_rows256(int type, const uint8_t *w8, size_t rb, int n_rows, const struct kv_q8_act *a, int m0, float *Y) {
    if (type == KV_QTYPE_Q4_K) kq_dec_rows_q4k(w8, rb, n_rows, a, m0, Y);
    else if (type == KV_QTYPE_Q5_K) kq_dec_rows_q5k(w8, rb, n_rows, a, m0, Y);
    else kq_dec_rows_q6k(w8, rb, n_rows, a, m0, Y);
}

#define TILES256(FN, T)                                                                                   \
    do {                                                                                                  \
        const int PF = M <= 4;                                                                            \
        for (int m = 0; m < M; m += 4) {                                                                  \
            const int mm = M - m < 4 ? M - m : 4;                                                         \
            for (int r = 0; r < n_rows; r += 8) {                                                         \
                const int nr = n_rows - r < 8 ? n_rows - r : 8;                                           \
                float *y = Y + (size_t)m * ldy + r;                                                       \
                const uint8_t *wr = w8 + (size_t)r * rb;                                                  \
                if (mm == 4) FN(T, wr, rb, nr, a, m0 + m, y, ldy, 4, 0);                                  \
                else if (PF) FN(T, wr, rb, nr, a, m0 + m, y, ldy, 1, 1);                                  \
                else FN(T, wr, rb, nr, a, m0 + m, y, ldy, 1, 0);                                          \
                for (int k = 1; k < mm && mm < 4; k++) FN(T, wr, rb, nr, a, m0 + m + k, y + (size_t)k * ldy, ldy, 1, 0); \
            }                                                                                             \
        }                                                                                                 \
    } while (0)

/* AVX2 prefill on a panel: lanes = 8 weight rows (one half of a 16-row group), MR activation
 * rows. Q4_0/Q4_K/Q5_K/Q6_K: the panel's value + off (0..63) times an activation never saturates
 * vpmaddubsw, off * sum(q) comes off per sub-block; Q8_0: |w| times the activation with w's sign
 * (at most 2 * 128 * 127 per pair). */
/* NG consecutive 16-row panel groups (rgb bytes apart; nr rows valid in the last, the others
 * full) x MR activation rows, on H 8-row halves from half `half` (H = 2: the whole group in one
 * pass, both halves' lines used as they stream in; H = 1: one half, the other half's pass finds
 * the lines in L1). NG > 1 (decode, H = 2, MR = 1): the groups side by side as concurrent
 * streams, as packed_tile; the same bits for every NG. */
AVX2 static ALWAYS void packed_tile256(int type, const uint8_t *rg, size_t rgb, int half, int nr,
                                      const struct kv_q8_act *a, int m0, float *Y, size_t ldy, const int MR, const int H,
                                      const int NG, const int pf) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int K = a->K, ng = K / g.G;
    const int off = type == KV_QTYPE_Q4_0 ? 8 : type == KV_QTYPE_Q6_K ? 32 : 0;
    const __m256i voff = _mm256_set1_epi8((char)off), ones = _mm256_set1_epi16(1);
    __m256 acc[4][4][2], mn[4][4][2]; /* [m][u][h] */
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
            _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) acc[m][u][h] = mn[m][u][h] = _mm256_setzero_ps();
    for (int s = 0; s < ng; s++) {
        const uint8_t *gp[4]; /* group s of each row group */
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) gp[u] = rg + (size_t)u * rgb + (size_t)s * g.grp;
        if (pf) _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) prefetch_group_ahead(gp[u], g.grp, pf);
        __m256i I[4][4][2];
        _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
            _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
                _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) I[m][u][h] = _mm256_setzero_si256();
        for (int j = 0; j < g.J; j++) {
            const size_t so = g.hdr + (size_t)j * g.sub; /* the sub-block in a group */
            const int e0 = s * g.G + j * g.S;
            __m256i C[4][4][2];
            _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
                _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
                    _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) C[m][u][h] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8") for (int k4 = 0; k4 < g.S / 4; k4++) {
                __m256i vv[4][2], aw[4][2];
                _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
                    _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) {
                        const uint8_t *v = gp[u] + so + (g.kq ? 64 : 0);
                        vv[u][h] = aw[u][h] = _mm256_load_si256((const __m256i *)(v + 64 * k4 + 32 * (half + h)));
                        if (type == KV_QTYPE_Q8_0) aw[u][h] = _mm256_abs_epi8(vv[u][h]); /* |w| x sign(w) q */
                        else vv[u][h] = aw[u][h] = _mm256_add_epi8(vv[u][h], voff);
                    }
                _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                    int32_t x4;
                    memcpy(&x4, a->q + (size_t)(m0 + m) * K + e0 + 4 * k4, 4);
                    const __m256i xb = _mm256_set1_epi32(x4);
                    _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
                        _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) {
                            __m256i xs = type == KV_QTYPE_Q8_0 ? _mm256_sign_epi8(xb, vv[u][h]) : xb;
                            C[m][u][h] =
                                _mm256_add_epi32(C[m][u][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[u][h], xs), ones));
                        }
                }
            }
            _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + e0 / 16;
                int qs = g.S == 32 ? s16[0] + s16[1] : s16[0];
                _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
                    _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) {
                        __m256i t = off ? _mm256_sub_epi32(C[m][u][h], _mm256_set1_epi32(off * qs)) : C[m][u][h];
                        const __m256i sc = g.kq ? _mm256_load_si256((const __m256i *)(gp[u] + so + 32 * (half + h)))
                                                : _mm256_setzero_si256();
                        I[m][u][h] = g.kq ? _mm256_add_epi32(I[m][u][h], _mm256_mullo_epi32(t, sc)) : t;
                    }
            }
        }
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) {
            const uint8_t *grp = gp[u];
            _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) {
                const size_t ho = 32 * (size_t)(half + h); /* byte offset of this half in a 64-byte row */
                const __m256 dv = _mm256_load_ps((const float *)(grp + ho));
                _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) {
                    const float dxs = a->d[(size_t)(m0 + m) * ng + s];
                    acc[m][u][h] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[m][u][h]), _mm256_mul_ps(dv, _mm256_set1_ps(dxs)), acc[m][u][h]);
                    if (g.mins) {
                        const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + 16 * (size_t)s;
                        __m256i Mi = _mm256_setzero_si256();
                        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
                            const __m256i mj = _mm256_load_si256((const __m256i *)(grp + 128 + 64 * j + ho));
                            Mi = _mm256_add_epi32(Mi, _mm256_mullo_epi32(mj, _mm256_set1_epi32(s16[2 * j] + s16[2 * j + 1])));
                        }
                        const __m256 dm = _mm256_mul_ps(_mm256_load_ps((const float *)(grp + 64 + ho)), _mm256_set1_ps(dxs));
                        mn[m][u][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Mi), dm, mn[m][u][h]);
                    }
                }
            }
        }
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
            _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) {
                const int rows = u == NG - 1 ? nr : 16; /* valid rows of group u */
                int n = rows - 8 * h < 8 ? rows - 8 * h : 8;
                if (n > 0)
                    store8(Y + (size_t)m * ldy + 16 * u + 8 * h, n,
                           g.mins ? _mm256_sub_ps(acc[m][u][h], mn[m][u][h]) : acc[m][u][h]);
            }
}

AVX2 static ALWAYS void packed_t256(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0,
                                    int M, float *Y, size_t ldy) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const size_t rgb = (size_t)(a->K / g.G) * g.grp;
    for (int r = 0; r < n_rows;) {
        const uint8_t *rg = panel + (size_t)(r / 16) * rgb;
        if (M < 4 && !g.kq && r % 16 == 0 && n_rows - r > 8) {
            /* decode: whole groups per row of X, chunks of them side by side (a last group of 8
             * rows or fewer goes by halves below) */
            const int full = (n_rows - r) / 16, part = n_rows - r - 16 * full > 8;
            const int c = decode_chunk(full + part);
            const int nr = n_rows - r - 16 * (c - 1) < 16 ? n_rows - r - 16 * (c - 1) : 16; /* rows of the last group */
            for (int m = 0; m < M; m++) {
                float *y = Y + (size_t)m * ldy + r;
                switch (c) {
                case 1: packed_tile256(type, rg, rgb, 0, nr, a, m0 + m, y, ldy, 1, 2, 1, PF_DECODE(g)); break;
                case 2: packed_tile256(type, rg, rgb, 0, nr, a, m0 + m, y, ldy, 1, 2, 2, PF_DECODE(g)); break;
                case 3: packed_tile256(type, rg, rgb, 0, nr, a, m0 + m, y, ldy, 1, 2, 3, PF_DECODE(g)); break;
                default: packed_tile256(type, rg, rgb, 0, nr, a, m0 + m, y, ldy, 1, 2, 4, PF_DECODE(g)); break;
                }
            }
            r += 16 * c;
            continue;
        }
        const int nr = n_rows - r < 8 ? n_rows - r : 8;
        const int half = (r / 8) & 1;
        int m = 0;
        /* H = 1: the first tile of half 0 streams the group's lines in, the second half's pass
         * finds them in L1/L2; fewer than 4 rows (decode) prefetch as the decode tiles do */
        const int pf = half ? 0 : M < 4 ? PF_DECODE(g) : PF_MANY(type);
        for (; m + 4 <= M; m += 4)
            packed_tile256(type, rg, rgb, half, nr, a, m0 + m, Y + (size_t)m * ldy + r, ldy, 4, 1, 1, m ? 0 : pf);
        for (; m < M; m++)
            packed_tile256(type, rg, rgb, half, nr, a, m0 + m, Y + (size_t)m * ldy + r, ldy, 1, 1, 1, M < 4 ? pf : 0);
        r += 8;
    }
}

AVX2 void kv_q8_packed_avx2(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                            float *Y, size_t ldy) {
    Q8_DISPATCH(type, packed_t256, panel, n_rows, a, m0, M, Y, ldy);
}

/* Panel packing with AVX2 unpacking (the same bytes as kv_q8_pack's scalar code): a chunk's 32
 * values are unpacked in a register, then moved as 8 dwords to their VNNI places. */
AVX2 static ALWAYS void pack_t256(int type, const uint8_t *w, size_t rb, int n_rows, int K, uint8_t *panel) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int ng = K / g.G;
    const size_t bb = kv_qtype_block_bytes(type), rgb = (size_t)ng * g.grp, vo = g.kq ? 64 : 0;
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *row = w + (size_t)r * rb;
        uint8_t *rg = panel + (size_t)(r / 16) * rgb;
        const int n = r % 16;
        for (int s = 0; s < ng; s++) {
            const uint8_t *blk = row + (size_t)s * bb;
            uint8_t *grp = rg + (size_t)s * g.grp;
            uint32_t t[8];
            pack_scales(type, &g, blk, grp, n);
            if (!g.kq) {
                __m256i v;
                if (type == KV_QTYPE_Q8_0) {
                    v = _mm256_loadu_si256((const __m256i *)(blk + 2));
                } else {
                    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
                    v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
                    v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
                }
                _mm256_storeu_si256((__m256i *)t, v);
                _Pragma("GCC unroll 8") for (int k4 = 0; k4 < 8; k4++) memcpy(grp + g.hdr + 64 * k4 + 4 * n, &t[k4], 4);
                continue;
            }
            const __m256i off = _mm256_set1_epi8((char)(type == KV_QTYPE_Q6_K ? 32 : 0));
            _Pragma("GCC unroll 8") for (int c2 = 0; c2 < 8; c2++) {
                _mm256_storeu_si256((__m256i *)t, _mm256_sub_epi8(kq_chunk256(type, blk, c2), off));
                _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
                    const int e = 32 * c2 + 4 * i, j = e / g.S, k4 = (e % g.S) / 4;
                    memcpy(grp + g.hdr + (size_t)j * g.sub + vo + 64 * (size_t)k4 + 4 * n, &t[i], 4);
                }
            }
        }
    }
}

AVX2 void kv_q8_pack_avx2(int type, const void *w, size_t rb, int n_rows, int K, void *panel) {
    Q8_DISPATCH(type, pack_t256, w, rb, n_rows, K, panel);
}

AVX2 void kv_q8_dot_avx2(int type, const void *w, size_t rb, int n_rows, const struct kv_q8_act *a, int m0, int M,
                         float *Y, size_t ldy) {
    const uint8_t *w8 = w;
    switch (type) {
    case KV_QTYPE_Q8_0: TILES256(g32_tile256, KV_QTYPE_Q8_0); break;
    case KV_QTYPE_Q4_0: TILES256(g32_tile256, KV_QTYPE_Q4_0); break;
    default: /* K-quants: each helper picks its type's instantiation */
        if (M > 1) kq_rows_many256(type, w8, rb, n_rows, a, m0, M, Y, ldy);
        else kq_dec_rows256(type, w8, rb, n_rows, a, m0, Y);
        break;
    }
}

#endif /* KV_QUANT_X86 */
