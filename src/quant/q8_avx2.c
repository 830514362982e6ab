/*
 * q8_avx2: the AVX2 kernels of kv_q8 (q8.h): activation quantization, the decode tiles over
 * GGUF rows, the K-quant many-row tiles, the outer products over packed panels and the panel
 * packer. Per-function target attributes, as in q8_x86_internal.h.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "q8_x86_internal.h"

#ifdef KV_QUANT_X86

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
    const bool pf_nta = PF && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h; read once */
    const int K = a->K, nb = K / 32;
    const size_t bb = type == KV_QTYPE_Q8_0 ? 34 : 18;
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[4];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (PF) prefetch_share(w + (size_t)8 * rb, (size_t)8 * rb, b, nb, pf_nta);
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

/* K-quants, one activation row (decode): nr <= 8 weight rows. Each row's super-block is
 * unpacked in registers, its scales decoded once into one vector (kq_dec_scales) and picked per
 * chunk by vpshufb; the rows are unrolled (a short last tile re-reads row 0 for the missing rows,
 * whose lanes are never stored), so the 8 row sums stay in registers; the activation's 32-element
 * sums for the mins and Q6_K's 32 * x term are made once per super-block, not once per row. The
 * integer sums are exact and the float steps are the contract's (q8.h), in its order: the same bits. */
AVX2 static ALWAYS void kq_dec256(int type, const uint8_t *w, size_t rb, int nr, const struct kv_q8_act *a, int m,
                                  float *Y, const int PF) {
    const bool pf_nta = PF && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h; read once */
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m256i k32 = _mm256_set1_epi8(32);
    __m256 acc = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
    __m256i x32[8]; /* Q6_K: 32 * x as vpmaddubsw pairs, per chunk */
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)8 * rb, (size_t)8 * rb, s, ns, pf_nta);
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
    const bool pf_nta = PF && kv_quant_get_prefetch() == KV_PREFETCH_NTA; /* quant.h; read once */
    const int K = a->K, ns = K / 256;
    const size_t bb = kv_qtype_block_bytes(type);
    const int mins = type != KV_QTYPE_Q6_K;
    const __m256i k32 = _mm256_set1_epi8(32);
    __m256 acc[KQ_MT], mn[KQ_MT];
    for (int m = 0; m < M; m++) acc[m] = mn[m] = _mm256_setzero_ps();
    __m256i ub[8][8], scv[8][8]; /* [row][chunk]: unpacked quants, int16 scales */
    __m128i mvs[8];              /* [row]: Q4_K/Q5_K's 8 mins as int16 */
    for (int s = 0; s < ns; s++) {
        if (PF) prefetch_share(w + (size_t)8 * rb, (size_t)8 * rb, s, ns, pf_nta);
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
    /* the decode tiles' stream (one row) takes the prefetch mode (quant.h); the first tile of
     * many rows prefetches for the tiles after it, which re-read the lines: prefetcht0 */
    const bool pf_nta = MR == 1 && pf && kv_quant_get_prefetch() == KV_PREFETCH_NTA;
    __m256 acc[4][4][2], mn[4][4][2]; /* [m][u][h] */
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; m++)
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++)
            _Pragma("GCC unroll 2") for (int h = 0; h < H; h++) acc[m][u][h] = mn[m][u][h] = _mm256_setzero_ps();
    for (int s = 0; s < ng; s++) {
        const uint8_t *gp[4]; /* group s of each row group */
        _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) gp[u] = rg + (size_t)u * rgb + (size_t)s * g.grp;
        if (pf) _Pragma("GCC unroll 4") for (int u = 0; u < NG; u++) prefetch_group_ahead(gp[u], g.grp, pf, pf_nta);
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
