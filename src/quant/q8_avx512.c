/*
 * q8_avx512: the AVX-512 kernels of kv_q8 (q8.h): activation quantization, the one-row and
 * many-row decode tiles over GGUF rows (with or without VNNI), the VNNI outer products over
 * packed panels and the panel packer. Per-function target attributes: the file builds for
 * baseline x86-64 and q8.c only calls what the CPU has. The family is described in
 * q8_x86_internal.h.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "q8_x86_internal.h"

#ifdef KV_QUANT_X86

int kv_q8_cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
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
    const bool pf_nta = PF && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h; read once */
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
        if (PF) prefetch_share(w + (size_t)16 * rb, (size_t)16 * rb, b / 2, (nb + 1) / 2, pf_nta);
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
    const bool pf_nta = PF && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h; read once */
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512 acc[KQ_MT], mn[KQ_MT];
    for (int m = 0; m < M; m++) acc[m] = mn[m] = _mm512_setzero_ps();
    __m512i ub[16][4], scv[16][4]; /* [row][chunk]: unpacked quants, int16 scales */
    __m128i mvs[16];               /* [row]: Q4_K/Q5_K's 8 mins as int16 */
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)16 * rb, (size_t)16 * rb, s, ns, pf_nta);
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
    const bool pf_nta = PF && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h; read once */
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const int8_t *qx = a->q + (size_t)m * K;
    const float *dx = a->d + (size_t)m * ns;
    const int16_t *s16 = a->s16 + (size_t)m * (K / 16);
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512 acc = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)16 * rb, (size_t)16 * rb, s, ns, pf_nta);
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
    /* the decode tiles' stream (one row) takes the prefetch mode (quant.h); the first tile of
     * many rows prefetches for the tiles after it, which re-read the lines: prefetcht0 */
    const bool pf_nta = MR == 1 && pf && kv_quant_get_prefetch() == KV_PREFETCH_NTA;
    __m512 acc[8][4], mn[8][4]; /* [m][u] */
    _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) acc[m][u] = mn[m][u] = _mm512_setzero_ps();
    for (int s = 0; s < ng; s++) {
        const uint8_t *gp[4]; /* group s of each row group */
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) gp[u] = rg + (size_t)u * rgb + (size_t)s * g.grp;
        if (pf) _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) prefetch_group_ahead(gp[u], g.grp, pf, pf_nta);
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

#endif /* KV_QUANT_X86 */
