/*
 * q8_x86_internal: what the x86 kernel files of kv_q8 share (q8_avx2.c, q8_avx512.c, q8_amx.c):
 * target attributes, the dispatch over weight types, the prefetch helpers, the scalar part of
 * packing a row group and the K-quant mins helpers. Always-inline: each kernel that uses a helper
 * gets its own copy, compiled for that kernel's target. Not a public interface. Include it after
 * the file's `#pragma GCC optimize("fp-contract=off")`, so that the helpers are compiled under it.
 * Per-function target attributes: the files build for baseline x86-64 and q8.c only calls a set
 * the CPU has. The kernels (q8.h):
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
#ifndef KV_QUANT_Q8_X86_INTERNAL_H
#define KV_QUANT_Q8_X86_INTERNAL_H

#include "q8_internal.h"

#ifdef KV_QUANT_X86

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define ALWAYS inline __attribute__((always_inline))

#define LDH(p) _cvtsh_ss(kv_quant_ld16(p))

/* Software prefetch of the next tile's weight rows (they follow this tile's RR rows in memory):
 * step i of n covers its share of [next, next + span). Decode (M <= 4: PF) reads each weight once,
 * and the hardware prefetchers alone leave a core far below its memory bandwidth on short rows
 * (K = 768: 27% more decode time without it); prefill re-reads a task's rows from L2 instead.
 * prefetcht1 (into L2) beats prefetcht0 by ~10% on a Sapphire Rapids core (Q8_0 and AVX2 path;
 * the L1 fill buffers are the limit), prefetchnta is 1.6x slower; one tile ahead is enough.
 * That is KV_PREFETCH_CACHE (quant.h); with nta (the caller's kv_quant_get_prefetch() ==
 * KV_PREFETCH_NTA, read once per call: the default on AMD) prefetchnta, measured on a Zen 5 core
 * with this and the decode tiles' prefetch_group_ahead both switched (bench_engine
 * --prefetch-ab, one thread, two runs): 1B Q4_K_M decode 1.01x (this path alone), 1B Q8_0
 * 1.06-1.09x (AVX2 family 1.01-1.07x). */
static ALWAYS void prefetch_share(const uint8_t *next, size_t span, int i, int n, bool nta) {
    const size_t per = (span + (size_t)n - 1) / (size_t)n; /* n is constant per tile: hoisted */
    const uint8_t *p = next + per * (size_t)i;
    KV_PREFETCH_RANGE(p, per, nta, 2); /* CACHE: to L2 (t1) */
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

/* Activation rows per call of the many-row K-quant tiles (kq_tilem512, kq_tilem256): their
 * float sums wait on the stack between super-blocks */
#define KQ_MT 64

/* Q4_K/Q5_K's mins term of 8 rows, sum_j m_j * s32_j each, as 8 int32 lanes: V[r] are the rows'
 * 8 int16 mins, s16 the activation's 16 sums of 16 of the super-block (the 32-element sums are
 * made here). Exact integer sums, as min_dot's (q8_avx512.c). */
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
 * That is prefetcht0; nta (the one-row decode tiles when kv_quant_get_prefetch() ==
 * KV_PREFETCH_NTA, quant.h: the default on AMD) uses prefetchnta, part of the Zen 5 gains in
 * prefetch_share's note. The many-row tiles keep prefetcht0: the tiles after the first re-read
 * what it brings in. Prefetches only: same bits. */
#define PF_DECODE(g) ((g).kq ? 0 : 2 * (int)(g).grp)
#define PF_MANY(type) ((type) == KV_QTYPE_Q8_0 ? 16384 : 0)
static ALWAYS void prefetch_group_ahead(const uint8_t *grp, size_t grp_bytes, int ahead, bool nta) {
    KV_PREFETCH_RANGE(grp + ahead, grp_bytes, nta, 3); /* else prefetcht0 */
}

/* The next chunk of a decode walk over `left` row groups: at most 4 groups (streams), the
 * chunks as even as they can be (5 -> 3 + 2, 6 -> 3 + 3, 7 -> 4 + 3), so no chunk is a lone
 * stream when it need not be. 4 streams: 1B Q8_0 decode 10.1 -> 13.1 tok/s on a Sapphire Rapids
 * core (bench_engine, 1 thread, medians of 5 alternated runs); 8 measured alike within noise. */
static ALWAYS int decode_chunk(int left) {
    const int n = (left + 3) / 4;
    return (left + n - 1) / n;
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

#endif /* KV_QUANT_X86 */

#endif
