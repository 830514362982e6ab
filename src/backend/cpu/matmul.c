/*
 * matmul: batch-invariant Y = X W^T (see matmul.h for the arithmetic contract).
 *
 * Three kernel families do the same IEEE operations in the same order: AVX-512 and AVX2
 * (intrinsics, fused multiply-add) and generic (scalar fmaf). Only the blocking differs,
 * chosen per ISA so the accumulators fit the register file: AVX-512 has 32 zmm (8x3 tile: 24
 * accumulators + 3 W vectors + 1 X vector), AVX2 16 ymm (4x3 tile of one ymm per output, run
 * once for lanes 0-7 and once for lanes 8-15 of the contract's 16: 12 accumulators + 3 W + 1
 * X). Both cut K into blocks so the X tile stays in L1 (see "blocking" below).
 * The file is compiled with fp-contract off so that only the explicit fmas fuse.
 */
#include "matmul.h"

#include "../../quant/q8.h"
#include "../../quant/qdot.h"
#include "../backend.h"
#include "matmul_bf16.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simd_internal.h"
#ifdef KV_CPU_X86
#define KV_MATMUL_X86 1
#endif

#define AI static inline __attribute__((always_inline))

/* A task's operands: columns [n0, n1) of all M rows of op.
 *   Xp: X packed for the family's tiles (x86 families: pack_x, once per op in run_batch,
 *       shared read-only by every task), NULL for the generic family (X read in place).
 *   Wp: W rows n0.. (f32, in place or a task's dequantized panel), ldw floats apart. */
struct cols_args {
    const struct kv_matmul_op *op;
    const float *Xp;
    const float *Wp;
    size_t ldw;
    int n0, n1;
};
typedef void (*cols_fn)(const struct cols_args *a);

/* ---- generic: scalar, the contract literally ---- */

AI float dot_generic(const float *x, const float *w, int K) {
    int K16 = K - K % 16;
    float lane[16];
    for (int j = 0; j < 16; j++) lane[j] = 0.0f;
    for (int k = 0; k < K16; k += 16)
        for (int j = 0; j < 16; j++) lane[j] = fmaf(x[k + j], w[k + j], lane[j]);
    float l8[8], l4[4];
    for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
    for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
    float s = (l4[0] + l4[2]) + (l4[1] + l4[3]);
    for (int k = K16; k < K; k++) s = fmaf(x[k], w[k], s);
    return s;
}

static void cols_generic(const struct cols_args *a) {
    const struct kv_matmul_op *op = a->op;
    const float *Wp = a->Wp;
    const size_t ldw = a->ldw; /* the generic family always gets W in place */
    const int n0 = a->n0, n1 = a->n1, K = op->W->cols, N = op->W->rows;
    for (int m = 0; m < op->M; m++)
        for (int n = n0; n < n1; n++) {
            float s = dot_generic(op->X + (size_t)m * K, Wp + (size_t)(n - n0) * ldw, K);
            if (op->bias) s = s + op->bias[n];
            op->Y[(size_t)m * N + n] = s;
        }
}

/* ---- per-thread buffer of the tiles' saved 16-lane partial sums (between K blocks) ---- */

static void *thread_buf(int which, size_t n); /* below, with the other per-thread buffers */
enum { BUF_ACT, BUF_PANEL, BUF_SUMS, BUF_XPACK, BUF_BF16X, BUF_N };
/* This thread's partial-sum buffer of at least n floats, 64-byte aligned. Out of memory
 * aborts: a few tens of KiB per thread. */
static float *thread_sums(size_t n) {
    float *p = thread_buf(BUF_SUMS, (n < 16 ? 16 : n) * sizeof(float));
    if (!p) abort();
    return p;
}

#ifdef KV_MATMUL_X86
/* ---- blocking shared by the SIMD families ----
 *
 * A task's columns [n0, n1) (its W rows, from L2) are computed for all M rows in register
 * tiles of R X rows x C W rows. Loop nest (BLIS-like, in dot form):
 *
 *   for each group of up to R X rows:              (the X tile: R rows x one K block, in L1)
 *     for each K block [k0, k1) (<= KC_STEPS steps of 16):
 *       for each group of C W rows of the task:    (streams W from L2)
 *         acc = first block ? 0 : the tile's saved 16-lane partial sums
 *         acc += the block's products, 16 lanes per output, k increasing
 *         last block ? finish (tree, K % 16 tail, bias, store Y) : save acc
 *
 * The partial sums are the contract's 16 lanes themselves, saved between K blocks in a
 * per-thread buffer (R x C x 16 floats per tile): each lane still adds its products in
 * increasing k, so the blocking changes no bit. The tree runs on 16 (AVX2: 8) outputs at
 * once with lane shuffles (kv_tree16_512 / kv_tree8_256, simd_internal.h) doing the contract's
 * additions.
 *
 * Packed X (prefill). In place, the R rows of an X tile lie K floats apart; with K * 4 bytes
 * a multiple of 4 KiB (K = 1024, 2048, 5632, ...) all of them, and the C W rows of the task's
 * panel, map the same k to the same L1 set (11 lines of a 12-way set), and the tiles ran 20-25%
 * slower than with K padded by 64 floats (bench_matmul --cpu-time, 2048 x 2048 against
 * 2048 x 2112, F16, Sapphire Rapids). So run_batch packs X once per op (pack_x) so that a tile
 * reads its X as one sequential stream:
 *   tile t of R rows (the last one Rt = M - t R rows), 16-float step s of K16:
 *       Xp[t R K16 + s Rt 16 + r 16 + j] = X[t R + r][16 s + j]
 * The K % 16 tail elements are read in place. Same products in the same order: no bit changes.
 * (Packing W per task in groups of C rows as well measured no better, 0-10% worse: not done.)
 * Both the packed X and the task's W panel sit on 2 MiB pages (thread_buf); on 4 KiB pages the
 * packed tiles gained less than half as much (nested page walks on the VM measured).
 *
 * The next X block (the tile's next K block, or the next row tile's first: the packed X runs on
 * in memory) comes from L3 when its first tile starts; the AVX-512 tiles prefetch it into L2, a
 * share per W tile of the current block (struct tile_src.pf). Zen 5, bench_matmul --type f16
 * --cpu-time, alternated pairs: M = 512 2048 x 5632 1.11x, other 1B shapes 0.98-1.03x; the AVX2
 * tile gained nothing from it (0.95-1.0x) and does not. */
#define KC_STEPS 48 /* K block of at most 48 x 16 floats: an 8-row X tile of 24 KiB stays in L1 */

/* Number of K blocks and the bounds of block b (in floats; multiples of the granule g, 16 for
 * the f32 tiles, 32 for the grouped ones, below K16). */
static inline int k_blocks(int K16) {
    int steps = K16 / 16;
    return steps > KC_STEPS ? (steps + KC_STEPS - 1) / KC_STEPS : 1;
}
static inline int k_bound(int K16, int nkb, int b, int g) { return (int)((long)(K16 / g) * b / nkb) * g; }

/* Finishes one output from its tree sum s: the K % 16 tail in fma (x, w: the tails, nt
 * floats), then the bias. */
AI float finish(float s, const float *x, const float *w, int nt, const float *bias) {
    for (int k = 0; k < nt; k++) s = __builtin_fmaf(x[k], w[k], s);
    if (bias) s = s + *bias;
    return s;
}

/* Where one tile reads (see the loop nest): X row r at Xt + 16 r (packed), next step + 16 R;
 * W row c at Wt + c ldw, next step + 16; the K % 16 tails of X row r at Xtl + r ldx (in
 * place), of W row c at Wtl + c ldw. */
struct tile_src {
    const float *Xt, *Xtl, *Wt, *Wtl;
    size_t ldx, ldw;
    const char *pf; /* npf 64-byte lines of the next X block to prefetch (x_share) */
    int npf;
};

/* The next packed X block after rows m.. over K block [k0, k1) (this row tile's next K block,
 * or the next row tile's first: the packed X runs on in memory), shared out among the block's
 * ntl W tiles for prefetching (x_share): computed once a block (a division per tile cost
 * tile512 5% at M = 512). */
struct xnext {
    const char *x; /* the next block's first byte, or the packed X when there is none */
    size_t left;   /* bytes from x to the end of the packed X (0: none) */
    int per;       /* lines a tile: about the block's lines / ntl */
};
AI void x_next(const struct cols_args *a, int m, int R, int k0, int k1, int ntl, struct xnext *xn) {
    const size_t K16 = (size_t)a->op->W->cols - (size_t)a->op->W->cols % 16;
    const size_t end = (size_t)a->op->M * K16 * sizeof(float);
    const size_t off = ((size_t)m * K16 + (size_t)k1 * R) * sizeof(float);
    xn->per = (int)(((size_t)(k1 - k0) / 16 * R + ntl - 1) / ntl);
    xn->x = (const char *)a->Xp + (off < end ? off : 0);
    xn->left = off < end ? end - off : 0;
}
/* W tile j's share: *npf lines from *pf, none past the end of the packed X. */
AI void x_share(const struct xnext *xn, int j, const char **pf, int *npf) {
    size_t o = (size_t)j * xn->per * 64;
    *pf = xn->x;
    *npf = 0;
    if (o >= xn->left) return;
    *pf += o;
    *npf = (xn->left - o) / 64 < (size_t)xn->per ? (int)((xn->left - o) / 64) : xn->per;
}

/* Sets src for the tile of X rows m.. (R of them, m a multiple of the family's R) and W rows
 * n.. over K block [k0, k1) of the task a (a->Xp packed: the x86 families always get it), with
 * its share of the next X block xn (tiles of C W rows). */
AI void tile_at(const struct cols_args *a, int m, int R, int n, int k0, const struct xnext *xn, int C,
                struct tile_src *src) {
    x_share(xn, (n - a->n0) / C, &src->pf, &src->npf);
    const size_t K = (size_t)a->op->W->cols, K16 = K - K % 16;
    src->Xt = a->Xp + (size_t)m * K16 + (size_t)(k0 / 16) * R * 16;
    src->Xtl = a->op->X + (size_t)m * K + K16;
    src->ldx = K;
    src->Wt = a->Wp + (size_t)(n - a->n0) * a->ldw + k0;
    src->Wtl = a->Wp + (size_t)(n - a->n0) * a->ldw + K16;
    src->ldw = a->ldw;
}

/* ---- AVX-512 ---- */
#define T512 KV_T512
#define R512 8 /* X rows per tile */
#define C512 3 /* W rows per tile: 24 accumulators + 3 W + 1 X of the 32 zmm */

/* The end of a tile's K block (tile512, htile512): the n = R*C accumulators saved to buf
 * (not the last block: returns false), or their trees into s (the last: returns true). */
AI T512 bool end512(const __m512 *acc, float *buf, int last, const int n, float *s) {
    if (!last) {
        _Pragma("GCC unroll 24") for (int i = 0; i < n; i++) _mm512_store_ps(buf + 16 * i, acc[i]);
        return false;
    }
    kv_tree16_512(acc, n < 16 ? n : 16, s);
    if (n > 16) kv_tree16_512(acc + 16, n - 16, s + 16);
    return true;
}

/* One R x C tile over a K block of `steps` steps of 16: see the loop nest above. buf: the
 * tile's R*C*16 saved lanes. */
AI T512 void tile512(const struct tile_src *src, int steps, float *buf, int first, int last, int K, const float *bias,
                     float *Y, size_t ldy, const int R, const int C) {
    __m512 acc[R512 * C512];
    _Pragma("GCC unroll 24") for (int i = 0; i < R * C; i++)
        acc[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(buf + 16 * i);
    const float *X = src->Xt, *W = src->Wt;
    const size_t wr = src->ldw;
    const char *pfx = src->pf; /* up to 2 lines a step: the share x_share gives, when ntl >= R / 2 */
    const int npf = src->npf;
    for (int s = 0; s < steps; s++, X += R * 16, W += 16) {
        if (s < npf) _mm_prefetch(pfx + 64 * s, _MM_HINT_T1);
        if (s + steps < npf) _mm_prefetch(pfx + 64 * (s + steps), _MM_HINT_T1);
        __m512 w[C512];
        _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) w[c] = _mm512_loadu_ps(W + c * wr);
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
            __m512 x = _mm512_loadu_ps(X + r * 16);
            /* one load per X vector: GCC would fold it into each of the C fmas (load-bound) */
            __asm__("" : "+v"(x));
            _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) acc[r * C + c] = _mm512_fmadd_ps(x, w[c], acc[r * C + c]);
        }
    }
    float s[R512 * C512];
    if (!end512(acc, buf, last, R * C, s)) return;
    int nt = K % 16;
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 3") for (int c = 0; c < C; c++)
            Y[r * ldy + c] = finish(s[r * C + c], src->Xtl + r * src->ldx, src->Wtl + c * src->ldw, nt, bias ? bias + c : NULL);
}

/* R rows (compile-time) of X from row m against the task's columns, over every K block: the
 * loop nest above, for a family's TILE function of at most RMAX x CMAX (shared text of both
 * families). */
#define ROWS_FN(NAME, TARGET, TILE, RMAX, CMAX)                                                                   \
    AI TARGET void NAME(const struct cols_args *a, int m, float *buf, const int R) {                               \
        const struct kv_matmul_op *op = a->op;                                                                     \
        const size_t K = (size_t)op->W->cols, N = (size_t)op->W->rows;                                             \
        const int K16 = (int)K - (int)K % 16, nkb = k_blocks(K16), n0 = a->n0, n1 = a->n1;                         \
        const float *b = op->bias;                                                                                 \
        float *y = op->Y + m * N;                                                                                  \
        struct tile_src src;                                                                                       \
        for (int kb = 0; kb < nkb; kb++) {                                                                         \
            int k0 = k_bound(K16, nkb, kb, 16), k1 = k_bound(K16, nkb, kb + 1, 16);                                \
            int first = kb == 0, last = kb == nkb - 1;                                                             \
            int steps = (k1 - k0) / 16;                                                                            \
            float *tb = buf;                                                                                       \
            int n = n0;                                                                                            \
            const int ntl = (n1 - n0 + (CMAX)-1) / (CMAX);                                                         \
            struct xnext xn;                                                                                       \
            x_next(a, m, R, k0, k1, ntl, &xn);                                                                     \
            for (; n + (CMAX) <= n1; n += (CMAX), tb += 16 * (RMAX) * (CMAX)) {                                    \
                tile_at(a, m, R, n, k0, &xn, CMAX, &src);                                                          \
                TILE(&src, steps, tb, first, last, (int)K, b ? b + n : NULL, y + n, N, R, CMAX);                   \
            }                                                                                                      \
            if (n1 - n == 2) {                                                                                     \
                tile_at(a, m, R, n, k0, &xn, CMAX, &src);                                                          \
                TILE(&src, steps, tb, first, last, (int)K, b ? b + n : NULL, y + n, N, R, 2);                      \
            }                                                                                                      \
            if (n1 - n == 1) {                                                                                     \
                tile_at(a, m, R, n, k0, &xn, CMAX, &src);                                                          \
                TILE(&src, steps, tb, first, last, (int)K, b ? b + n : NULL, y + n, N, R, 1);                      \
            }                                                                                                      \
        }                                                                                                          \
    }
ROWS_FN(rows512, T512, tile512, R512, C512)

static T512 void cols_avx512(const struct cols_args *a) {
    const struct kv_matmul_op *op = a->op;
    int K = op->W->cols, nkb = k_blocks(K - K % 16);
    float *buf = thread_sums((size_t)16 * R512 * C512 * ((a->n1 - a->n0) / C512 + 1) * (nkb > 1));
    int m = 0;
    for (; m + R512 <= op->M; m += R512) rows512(a, m, buf, R512);
    switch (op->M - m) {
    case 7: rows512(a, m, buf, 7); break;
    case 6: rows512(a, m, buf, 6); break;
    case 5: rows512(a, m, buf, 5); break;
    case 4: rows512(a, m, buf, 4); break;
    case 3: rows512(a, m, buf, 3); break;
    case 2: rows512(a, m, buf, 2); break;
    case 1: rows512(a, m, buf, 1); break;
    default: break;
    }
}

/* ---- AVX2 + FMA ----
 * A 16-lane accumulator is two independent 8-lane halves (lanes 0-7: k % 16 < 8, lanes 8-15),
 * so each K block runs twice over the tile, once per half, with one ymm per (row, column):
 * R256 x C256 = 12 accumulators + C256 W + 1 X of the 16 ymm. The second pass finds the
 * block's X and W lines in L1. */
#define T256 KV_T256
#define R256 4
#define C256 3

AI T256 void tile256(const struct tile_src *src, int steps, float *buf, int first, int last, int K, const float *bias,
                     float *Y, size_t ldy, const int R, const int C) {
    __m256 acc[R256 * C256];
    const size_t wr = src->ldw;
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        _Pragma("GCC unroll 12") for (int i = 0; i < R * C; i++)
            acc[i] = first ? _mm256_setzero_ps() : _mm256_load_ps(buf + 16 * i + 8 * h);
        const float *X = src->Xt + 8 * h, *W = src->Wt + 8 * h;
        for (int s = 0; s < steps; s++, X += R * 16, W += 16) {
            __m256 w[C256];
            _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) w[c] = _mm256_loadu_ps(W + c * wr);
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                __m256 x = _mm256_loadu_ps(X + r * 16);
                _Pragma("GCC unroll 3") for (int c = 0; c < C; c++)
                    acc[r * C + c] = _mm256_fmadd_ps(x, w[c], acc[r * C + c]);
            }
        }
        if (!last || h == 0) {
            _Pragma("GCC unroll 12") for (int i = 0; i < R * C; i++) _mm256_store_ps(buf + 16 * i + 8 * h, acc[i]);
        }
    }
    if (!last) return;
    /* l8 = lanes 0-7 (saved) + lanes 8-15 (in registers) */
    _Pragma("GCC unroll 12") for (int i = 0; i < R * C; i++) acc[i] = _mm256_add_ps(_mm256_load_ps(buf + 16 * i), acc[i]);
    float s[R256 * C256];
    kv_tree8_256(acc, R * C < 8 ? R * C : 8, s);
    if (R * C > 8) kv_tree8_256(acc + 8, R * C - 8, s + 8);
    int nt = K % 16;
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 3") for (int c = 0; c < C; c++)
            Y[r * ldy + c] = finish(s[r * C + c], src->Xtl + r * src->ldx, src->Wtl + c * src->ldw, nt, bias ? bias + c : NULL);
}

ROWS_FN(rows256, T256, tile256, R256, C256)

static T256 void cols_avx2(const struct cols_args *a) {
    const struct kv_matmul_op *op = a->op;
    /* the AVX2 tile always saves the low halves: a buffer even for one K block */
    float *buf = thread_sums((size_t)16 * R256 * C256 * ((a->n1 - a->n0) / C256 + 1));
    int m = 0;
    for (; m + R256 <= op->M; m += R256) rows256(a, m, buf, R256);
    switch (op->M - m) {
    case 3: rows256(a, m, buf, 3); break;
    case 2: rows256(a, m, buf, 2); break;
    case 1: rows256(a, m, buf, 1); break;
    default: break;
    }
}

/* ---- AVX-512: F16/BF16 rows in the grouped layout, widened in registers ----
 * Steps of DECODE_ROWS < M <= HTILE_MAX_M rows with F16/BF16 weights in f32 arithmetic (decode
 * of many sequences, short prefill chunks). The panel path widens each task's 16-bit rows into
 * an f32 panel (kv_fgroup_rows) and runs tile512 over it. These tiles read the grouped layout
 * (qdot.h: rows in groups of KV_FGROUP_ROWS = 4, interleaved in 64-byte chunks, so row i of a
 * full group has chunk c at i * 64 + c * 256 bytes from its group's start), widen each W vector
 * as they load it, exactly (vcvtph2ps; bf16: the bits shifted up 16), and do tile512's fmas in
 * tile512's order on the same packed X: the same bits as the panel path (test_matmul). One
 * chunk holds two 16-float steps, so the K blocks here end on even steps (k_bound's granule 32);
 * the blocking changes no bit. Only for matrices whose every group is full (rows % 4 == 0:
 * every Llama/Qwen shape).
 *
 * Prefetch: the weights come from DRAM once a step (the first row tile of a task) and the
 * hardware prefetchers do not follow the grouped pattern (3 rows of a 4-row group, 256 bytes
 * apart): each tile prefetches, line for line, the rows of the tile HPF_TILES ahead over the
 * same chunks (past the task's last row: the next K block's first tiles), and a share of the
 * next X block into L2 as tile512 does. Zen 5, bench_matmul --type f16 --cpu-time, weights on
 * huge pages beyond the caches, alternated pairs, prefetch / none: M = 8 1.71-1.74x, 16
 * 1.24-1.37x, 32 1.08-1.20x (1B shapes); 1 or 4 tiles ahead instead of 2: 0.91-1.0x. */
#define HCHUNK 256 /* bytes from a row's chunk to its next in a full group: 4 rows x 64 */

/* Byte address of element k (a multiple of 16) of row n of a grouped matrix at g (rows n in
 * full groups), rb bytes a row. */
static inline const uint8_t *hrow_at(const uint8_t *g, size_t rb, int n, int k) {
    return g + (size_t)(n & ~3) * rb + (size_t)(n & 3) * 64 + (size_t)(k / 32) * HCHUNK + (size_t)(k % 32) * 2;
}

/* AVX-512: 16 consecutive 16-bit weights at p widened to f32 */
AI T512 __m512 h16_512(const uint8_t *p, const int bf) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    if (bf) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    return _mm512_cvtph_ps(v);
}

/* What a grouped tile prefetches: chunks 0 .. wch - 1 of the grouped rows w[c] (hrows512), and
 * nx lines of the next X block from x (x_share). */
struct hpf {
    const uint8_t *w[C512];
    int wch;
    const char *x;
    int nx;
};

/* One R x C tile over `chunks` chunks (2 steps each) of the grouped rows Wr[c]; buf: the
 * tile's R*C*16 saved lanes (tile512's scheme); pf: its prefetches. */
AI T512 void htile512(const float *Xt, const uint8_t *const *Wr, const struct hpf *pf, int chunks, float *buf,
                      int first, int last, const float *bias, float *Y, size_t ldy, const int R, const int C,
                      const int bf) {
    __m512 acc[R512 * C512];
    _Pragma("GCC unroll 24") for (int i = 0; i < R * C; i++)
        acc[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(buf + 16 * i);
    const float *X = Xt;
    const uint8_t *wp[C512], *pw[C512];
    _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) wp[c] = Wr[c];
    _Pragma("GCC unroll 3") for (int c = 0; c < C512; c++) pw[c] = pf->w[c];
    const char *px = pf->x; /* 2 lines a chunk (its 2 steps): the share x_share gives when ntl >= R */
    const int npx = pf->nx, wch = pf->wch;
    for (int ch = 0; ch < chunks; ch++) {
        if (2 * ch < npx) {
            _mm_prefetch(px + 128 * ch, _MM_HINT_T1);
            _mm_prefetch(px + 128 * ch + 64, _MM_HINT_T1);
        }
        _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++, X += R * 16) {
            __m512 w[C512];
            _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) w[c] = h16_512(wp[c] + 32 * j, bf);
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                __m512 x = _mm512_loadu_ps(X + r * 16);
                __asm__("" : "+v"(x)); /* one load per X vector (tile512) */
                _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) acc[r * C + c] = _mm512_fmadd_ps(x, w[c], acc[r * C + c]);
            }
        }
        _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) wp[c] += HCHUNK;
        if (ch < wch)
            _Pragma("GCC unroll 3") for (int c = 0; c < C512; c++)
                _mm_prefetch((const char *)pw[c] + (size_t)ch * HCHUNK, _MM_HINT_T0);
    }
    float s[R512 * C512];
    if (!end512(acc, buf, last, R * C, s)) return;
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) Y[r * ldy + c] = bias ? s[r * C + c] + bias[c] : s[r * C + c];
}

#ifndef HPF_TILES
#define HPF_TILES 2
#endif
/* ROWS_FN's loop nest for the grouped tiles: R X rows from row m against the task's columns
 * (rows n0.. of the grouped matrix at g), every K block. */
AI T512 void hrows512(const struct cols_args *a, const uint8_t *g, int m, float *buf, const int R, const int bf) {
    const struct kv_matmul_op *op = a->op;
    const size_t K = (size_t)op->W->cols, N = (size_t)op->W->rows, rb = op->W->row_bytes;
    const int K16 = (int)K, nkb = k_blocks(K16), n0 = a->n0, n1 = a->n1; /* kv_fgroup_ok: K % 32 == 0 */
    const float *b = op->bias;
    float *y = op->Y + m * N;
    for (int kb = 0; kb < nkb; kb++) {
        int k0 = k_bound(K16, nkb, kb, 32), k1 = k_bound(K16, nkb, kb + 1, 32);
        int first = kb == 0, last = kb == nkb - 1;
        const float *Xt = a->Xp + (size_t)m * K16 + (size_t)(k0 / 16) * R * 16;
        float *tb = buf;
        const int ntl = (n1 - n0 + C512 - 1) / C512, ch = (k1 - k0) / 32;
        const int nch = kb + 1 < nkb ? (k_bound(K16, nkb, kb + 2, 32) - k1) / 32 : 0; /* the next block's chunks */
        struct xnext xn;
        x_next(a, m, R, k0, k1, ntl, &xn);
        for (int n = n0; n < n1; n += C512, tb += 16 * R512 * C512) {
            const uint8_t *wr[C512];
            for (int c = 0; c < C512; c++) wr[c] = hrow_at(g, rb, n + c < n1 ? n + c : n, k0);
            /* the tile HPF_TILES ahead: in this K block, or past the task's last tile the next
             * block's (its chunks), or none after the last block */
            struct hpf pf;
            int j = (n - n0) / C512 + HPF_TILES, pn = n0 + j * C512, pk = k0;
            pf.wch = ch;
            if (j >= ntl) {
                pn = n0 + (j - ntl) * C512, pk = k1;
                pf.wch = pn < n1 ? nch : 0;
                if (!pf.wch) pn = n, pk = k0;
            }
            for (int c = 0; c < C512; c++) pf.w[c] = hrow_at(g, rb, pn + c < n1 ? pn + c : pn, pk);
            x_share(&xn, (n - n0) / C512, &pf.x, &pf.nx);
            const float *bn = b ? b + n : NULL;
            if (n1 - n >= C512) htile512(Xt, wr, &pf, ch, tb, first, last, bn, y + n, N, R, C512, bf);
            else if (n1 - n == 2) htile512(Xt, wr, &pf, ch, tb, first, last, bn, y + n, N, R, 2, bf);
            else htile512(Xt, wr, &pf, ch, tb, first, last, bn, y + n, N, R, 1, bf);
        }
    }
}

/* All M rows of the task a against its grouped F16 (bf = 0) / BF16 (bf = 1) rows at g (the
 * matrix's grouped panel; a->Xp packed for R512 rows a tile, as for tile512). */
#define HCASE(k) \
    case k: hrows512(a, g, m, buf, k, bf); break;
AI T512 void hcols512(const struct cols_args *a, const uint8_t *g, const int bf) {
    const struct kv_matmul_op *op = a->op;
    float *buf = thread_sums((size_t)16 * R512 * C512 * ((a->n1 - a->n0) / C512 + 1));
    int m = 0;
    for (; m + R512 <= op->M; m += R512) hrows512(a, g, m, buf, R512, bf);
    switch (op->M - m) {
        HCASE(7) HCASE(6) HCASE(5) HCASE(4) HCASE(3) HCASE(2) HCASE(1)
    default: break;
    }
}
#undef HCASE
static T512 void hcols512_f16(const struct cols_args *a, const uint8_t *g) { hcols512(a, g, 0); }
static T512 void hcols512_bf16(const struct cols_args *a, const uint8_t *g) { hcols512(a, g, 1); }

/* Most rows for which the grouped tiles run instead of widening the task's rows into an f32
 * panel once (kv_fgroup_rows + tile512, which costs no conversion per X row tile). Zen 5,
 * bench_matmul --type f16 --cpu-time, weights on huge pages, alternated pairs on the 1B shapes
 * (2048 x 2048, 2048 x 5632, 5632 x 2048), grouped / panel GFLOP/s, both with their
 * prefetches: M = 40 1.00-1.07, 64 1.03-1.09 (6 pairs), 128 0.91-1.11, 512 0.94-0.97 (6 pairs;
 * 1.00-1.05 in a quieter run); bench_engine 1B F16, 16 x 128-token prompts, no difference in
 * prefill (4 pairs). Without the prefetch the grouped tiles lost from M = 24 on. On Intel cores
 * vcvtph2ps takes an fma port, which favours the panel at large M further. The AVX2 family
 * keeps the panel: its grouped tiles (4 x 3, and 6 x 2 per 8-lane half) ran 0.83-0.98x the panel
 * at every M from 8 to 512 before the prefetch (vcvtph2ps ymm costs about an fma slot on Zen 5,
 * and a W vector serves only 4-6 fmas there). */
#ifndef HTILE_MAX_M /* -DHTILE_MAX_M=0 builds the panel-only variant, for A/B runs */
#define HTILE_MAX_M 64
#endif

typedef void (*hcols_fn)(const struct cols_args *a, const uint8_t *g);
/* The grouped tiles for an op of M rows of this type on family fn, or NULL (the panel). */
static hcols_fn hcols_for(cols_fn fn, int type, int M) {
    if (fn != cols_avx512 || M > HTILE_MAX_M) return NULL;
    return type == KV_QTYPE_F16 ? hcols512_f16 : type == KV_QTYPE_BF16 ? hcols512_bf16 : NULL;
}

/* Packs rows [0, M) of X (K floats apart) in the layout above for tiles of R rows: M * K16
 * floats at Xp. */
static void pack_x(const float *X, int M, int K, int R, float *Xp) {
    const int K16 = K - K % 16;
    for (int t = 0; t < M; t += R) {
        int Rt = M - t < R ? M - t : R;
        float *o = Xp + (size_t)t * K16;
        for (int s = 0; s < K16; s += 16)
            for (int r = 0; r < Rt; r++, o += 16) memcpy(o, X + (size_t)(t + r) * K + s, 16 * sizeof(float));
    }
}

#endif /* KV_MATMUL_X86 */

/* ---- ISA choice ---- */

static _Atomic int g_isa = KV_MATMUL_ISA_AUTO; /* resolved set, never AUTO after first use */

static enum kv_matmul_isa best_isa(void) {
#ifdef KV_MATMUL_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return KV_MATMUL_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return KV_MATMUL_ISA_AVX2;
#endif
    return KV_MATMUL_ISA_GENERIC;
}

_Static_assert((int)KV_MATMUL_ISA_GENERIC == (int)KV_QUANT_ISA_GENERIC && (int)KV_MATMUL_ISA_AVX2 == (int)KV_QUANT_ISA_AVX2 &&
                   (int)KV_MATMUL_ISA_AVX512 == (int)KV_QUANT_ISA_AVX512,
               "the matmul and quant ISA enums share values");

kv_status kv_cpu_isa_env(enum kv_matmul_isa *out, char *err, size_t errlen) {
    *out = KV_MATMUL_ISA_AUTO;
    int v = kv_quant_isa_env(); /* enum kv_quant_isa has kv_matmul_isa's values */
    const char *e = getenv("KVSERVE_CPU_ISA");
    if (v < 0) return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_ISA=%s: expected generic, avx2 or avx512", e);
    if (v > (int)best_isa())
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "KVSERVE_CPU_ISA=%s: this CPU lacks it (best: %s)", e,
                       best_isa() == KV_MATMUL_ISA_AVX2 ? "avx2" : "generic");
    *out = (enum kv_matmul_isa)v;
    return KV_OK;
}

/* KVSERVE_CPU_ISA, or AUTO (an invalid value: AUTO, with a warning; the CLIs refuse it first
 * through kv_cpu_isa_env). */
static enum kv_matmul_isa env_isa(void) {
    enum kv_matmul_isa isa;
    char err[160];
    if (kv_cpu_isa_env(&isa, err, sizeof err) != KV_OK) {
        KV_WARN("%s; using the CPU's best kernels", err);
        return KV_MATMUL_ISA_AUTO;
    }
    return isa;
}

enum kv_matmul_isa kv_matmul_set_isa(enum kv_matmul_isa isa) {
    enum kv_matmul_isa best = best_isa();
    if (isa == KV_MATMUL_ISA_AUTO) isa = env_isa();
    if (isa == KV_MATMUL_ISA_AUTO || isa > best) isa = best;
    atomic_store(&g_isa, (int)isa);
    kv_quant_set_isa(isa == KV_MATMUL_ISA_AVX512 ? KV_QUANT_ISA_AVX512
                     : isa == KV_MATMUL_ISA_AVX2 ? KV_QUANT_ISA_AVX2
                                                 : KV_QUANT_ISA_GENERIC);
    return isa;
}

enum kv_matmul_isa kv_matmul_get_isa(void) {
    int isa = atomic_load_explicit(&g_isa, memory_order_relaxed);
    if (isa == KV_MATMUL_ISA_AUTO) isa = (int)kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
    return (enum kv_matmul_isa)isa;
}

static cols_fn current_fn(void) {
    int isa = atomic_load_explicit(&g_isa, memory_order_relaxed);
    if (isa == KV_MATMUL_ISA_AUTO) isa = (int)kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
#ifdef KV_MATMUL_X86
    if (isa == KV_MATMUL_ISA_AVX512) return cols_avx512;
    if (isa == KV_MATMUL_ISA_AVX2) return cols_avx2;
#endif
    return cols_generic;
}

const char *kv_matmul_isa_name(void) {
    cols_fn f = current_fn();
#ifdef KV_MATMUL_X86
    if (f == cols_avx512) return "avx512";
    if (f == cols_avx2) return "avx2";
#endif
    (void)f;
    return "generic";
}

/* ---- per-thread buffers (freed at thread exit), one key per use because they are live at
 * the same time on one thread: the integer path's quantized activations (the calling thread,
 * for the whole batch), a task's weight panel (the quantized rows repacked, or dequantized to
 * f32: a task uses one of the two), the float tiles' saved partial sums (inside a task), the
 * packed X of the float tiles (the calling thread, for the whole batch) ---- */
struct tbuf {
    void *p;
    size_t cap;
};
static pthread_key_t g_buf_key[BUF_N];
static pthread_once_t g_buf_once = PTHREAD_ONCE_INIT;
static void tbuf_free(void *v) {
    struct tbuf *b = v;
    if (b) free(b->p);
    free(b);
}
static void buf_key_init(void) {
    for (int i = 0; i < BUF_N; i++)
        if (pthread_key_create(&g_buf_key[i], tbuf_free)) abort();
}
/* This thread's buffer `which` of at least n bytes, 64-byte aligned, or NULL. */
static void *thread_buf(int which, size_t n) {
    pthread_once(&g_buf_once, buf_key_init);
    struct tbuf *b = pthread_getspecific(g_buf_key[which]);
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b || pthread_setspecific(g_buf_key[which], b)) {
            free(b);
            return NULL;
        }
    }
    if (b->cap < n) {
        /* from 1 MiB on (a task's W panel, a packed X): 2 MiB-aligned on transparent huge pages,
         * as the tiles walk them with strides that would miss the TLB on 4 KiB pages */
        const size_t huge = (size_t)2 << 20;
        int big = n >= huge / 2;
        size_t len = big ? (n + huge - 1) & ~(huge - 1) : (n + 63) & ~(size_t)63;
        void *np = aligned_alloc(big ? huge : 64, len);
        if (!np) return NULL;
#ifdef MADV_HUGEPAGE
        if (big) (void)madvise(np, len, MADV_HUGEPAGE); /* advisory */
#endif
        free(b->p);
        b->p = np;
        b->cap = n;
    }
    return b->p;
}

/* ---- work split ---- */

#define MAX_BATCH 8
/* f32 W rows per task: about this many bytes, half the L2 of a core (1 MiB on Sapphire Rapids'
 * 2 MiB; 256 KiB on a Zen 2/3 core's 512 KiB), so the task's rows stay in L2 while every X tile
 * passes them. Measured (bench_matmul --type f16 --m 512 --cpu-time, Sapphire Rapids, AVX-512 /
 * AVX2): 192 KiB -> 1 MiB took 2048 x 5632 from 78 to 126 / 53 to 77 GFLOP/s (the X tiles come
 * from L3: a larger block reuses each more), 5632 x 2048 108 -> 122 / 74 -> 86; 1.5-2 MiB was
 * slower again. */
static size_t block_bytes(void) {
    static _Atomic size_t cached;
    size_t b = atomic_load_explicit(&cached, memory_order_relaxed);
    if (b) return b;
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    b = l2 > 0 ? (size_t)l2 / 2 : 512 * 1024;
    if (b < 128 * 1024) b = 128 * 1024;
    if (b > 1024 * 1024) b = 1024 * 1024;
    atomic_store_explicit(&cached, b, memory_order_relaxed);
    return b;
}

/* Below this many multiply-adds in one batch, waking the pool costs more than it saves: run
 * on the calling thread (results are identical either way: each element is computed whole). */
#define INLINE_MACS (1L << 18)
#define DECODE_ROWS 4  /* M at or below which quantized rows go through kv_qdot_rows (fused) */

struct plan {
    const struct kv_matmul_op *ops;
    int n_ops;
    int nb[MAX_BATCH];        /* W rows per task (multiple of 8 except the last task) */
    int first[MAX_BATCH + 1]; /* first task of op i; first[n_ops] = total */
    cols_fn fn;
    const struct kv_q8_act *q8[MAX_BATCH]; /* op i's quantized activations (integer path), or NULL */
    const float *xp[MAX_BATCH]; /* op i's X packed for an x86 family's float tiles (pack_x), or NULL */
#ifdef KV_MATMUL_X86
    hcols_fn hf[MAX_BATCH]; /* op i's grouped 16-bit tiles (reading xp[i]), or NULL */
#endif
    /* BF16 mode (matmul_bf16.h): op i's BF16 weights take the bf16 tiles (bf[i]), with X packed
     * for family bff at bxp[i] (NULL for the generic family) */
    bool bf[MAX_BATCH];
    const void *bxp[MAX_BATCH];
    enum kv_bf16_family bff;
};

/* Y[m][n] += bias[n] for the columns n0 .. n1 - 1 of a decode product (the kernels there write
 * the dot products only; the contract adds the bias last, in one rounding). */
static void add_bias(const struct kv_matmul_op *op, int n0, int n1) {
    if (!op->bias) return;
    const size_t N = (size_t)op->W->rows;
    for (int m = 0; m < op->M; m++)
        for (int n = n0; n < n1; n++) op->Y[(size_t)m * N + n] = op->Y[(size_t)m * N + n] + op->bias[n];
}

static void plan_task(void *p, int t, int th) {
    (void)th;
    const struct plan *pl = p;
    int i = 0;
    while (t >= pl->first[i + 1]) i++;
    const struct kv_matmul_op *op = &pl->ops[i];
    const struct kv_wmat *W = op->W;
    int n0 = (t - pl->first[i]) * pl->nb[i];
    int n1 = n0 + pl->nb[i] < W->rows ? n0 + pl->nb[i] : W->rows;
    size_t K = (size_t)W->cols;
    if (pl->bf[i]) { /* BF16 mode: every M, straight from the stored rows (grouped or the file's) */
        bool g = W->panel && kv_fgroup_ok(W->type, W->cols);
        struct kv_bf16_w bw = {g ? (const char *)W->panel + (size_t)n0 * W->row_bytes
                                 : (const char *)W->data + (size_t)n0 * W->row_bytes,
                               W->row_bytes, g, n1 - n0};
        float *sums = thread_sums(kv_bf16_sums_floats(pl->bff, op->M, (int)K, n1 - n0));
        kv_bf16_cols(pl->bff, pl->bxp[i], op->X, K, op->M, (int)K, &bw, op->bias ? op->bias + n0 : NULL, op->Y + n0,
                     (size_t)W->rows, sums);
        return;
    }
    if (W->type == KV_QTYPE_F32 && op->M > DECODE_ROWS) {
        struct cols_args ca = {op, pl->xp[i], (const float *)W->data + (size_t)n0 * K, K, n0, n1};
        pl->fn(&ca);
        return;
    }
    /* F16/BF16 in the grouped layout (qdot.h), repacked at load; n0 (a multiple of 8) starts a group */
    const char *grouped = W->panel && kv_fgroup_ok(W->type, W->cols) ? (const char *)W->panel + (size_t)n0 * W->row_bytes
                                                                      : NULL;
    /* decode rows of every type, F32 included (qdot's GEMV tiles: 8 weight rows per X row) */
    if (pl->q8[i] || op->M <= DECODE_ROWS) { /* decode: dequantize in registers, nothing written but Y */
        if (grouped) {
            kv_qdot_grouped(W->type, grouped, n1 - n0, (int)K, op->X, K, op->M, op->Y + n0, (size_t)W->rows);
        } else if (pl->q8[i] && W->panel && kv_q8_packed_fast(W->type)) {
            /* the matrix was repacked whole at load (struct kv_wmat.panel): outer products over
             * its row groups for every M, decode included (M < 4: up to 4 row groups read side by
             * side, concurrent sequential streams; q8_x86.c packed_tile) */
            size_t gb = kv_q8_pack_bytes(W->type, 16, (int)K);
            kv_q8_dot_packed(W->type, (const char *)W->panel + (size_t)(n0 / 16) * gb, n1 - n0, pl->q8[i], 0, op->M,
                             op->Y + n0, (size_t)W->rows);
        } else if (pl->q8[i] && op->M > DECODE_ROWS && kv_q8_packed_fast(W->type) &&
                   !kv_q8_rows_preferred(W->type, op->M)) {
            /* prefill: repack the task's rows once (VNNI order), then outer products for all M
             * (not where the rows path is faster even so: AVX2 K-quants at many-sequence decode) */
            size_t pb = kv_q8_pack_bytes(W->type, n1 - n0, (int)K);
            void *panel = thread_buf(BUF_PANEL, pb);
            if (!panel) abort(); /* ~1.3 bytes per weight of one task: out of memory here is fatal */
            kv_q8_pack(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, (int)K, panel);
            kv_q8_dot_packed(W->type, panel, n1 - n0, pl->q8[i], 0, op->M, op->Y + n0, (size_t)W->rows);
        } else if (pl->q8[i])
            kv_q8_dot_rows(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, pl->q8[i],
                           0, op->M, op->Y + n0, (size_t)W->rows);
        else
            kv_qdot_rows(W->type, (const char *)W->data + (size_t)n0 * W->row_bytes, W->row_bytes, n1 - n0, (int)K,
                         op->X, K, op->M, op->Y + n0, (size_t)W->rows);
        add_bias(op, n0, n1);
        return;
    }
#ifdef KV_MATMUL_X86
    /* F16/BF16 grouped rows: widened in registers by the grouped tiles (every group full) */
    if (pl->hf[i]) {
        struct cols_args ca = {op, pl->xp[i], NULL, K, n0, n1};
        pl->hf[i](&ca, (const uint8_t *)W->panel);
        return;
    }
#endif
    /* the task's rows dequantized to f32 */
    float *pn = thread_buf(BUF_PANEL, (size_t)(n1 - n0) * (K ? K : 1) * sizeof(float));
    if (!pn) abort(); /* about block_bytes() per thread: out of memory here is fatal */
    struct cols_args ca = {op, pl->xp[i], pn, K, n0, n1};
    if (grouped)
        kv_fgroup_rows(W->type, grouped, n1 - n0, (int)K, pn, K);
    else
        for (int r = n0; r < n1; r++)
            kv_dequant_row(W->type, (const char *)W->data + (size_t)r * W->row_bytes, pn + (size_t)(r - n0) * K,
                           (int64_t)K);
    pl->fn(&ca);
}

/* ---- integer path: quantized activations, per op (shared by ops with the same X) ---- */

static _Atomic int g_quant = KV_MATMUL_QUANT_AUTO;

enum kv_matmul_quant kv_matmul_set_quant(enum kv_matmul_quant q) {
    if (q == KV_MATMUL_QUANT_AUTO) {
        const char *e = getenv("KVSERVE_CPU_QUANT_MATMUL");
        char err[160];
        q = KV_MATMUL_QUANT_INT8;
        if (e && *e && kv_matmul_quant_parse(e, &q, err, sizeof err) != KV_OK) {
            KV_WARN("KVSERVE_CPU_QUANT_MATMUL: %s; using int8", err);
            q = KV_MATMUL_QUANT_INT8;
        }
    }
    atomic_store(&g_quant, (int)q);
    return q;
}

enum kv_matmul_quant kv_matmul_get_quant(void) {
    int q = atomic_load_explicit(&g_quant, memory_order_relaxed);
    return q == KV_MATMUL_QUANT_AUTO ? kv_matmul_set_quant(KV_MATMUL_QUANT_AUTO) : (enum kv_matmul_quant)q;
}

const char *kv_matmul_quant_name(enum kv_matmul_quant q) {
    return q == KV_MATMUL_QUANT_F32 ? "f32" : q == KV_MATMUL_QUANT_INT8 ? "int8" : "auto";
}

/* ---- BF16 mode (matmul_bf16.h) ---- */

static _Atomic int g_bf16 = KV_MATMUL_BF16_AUTO;     /* the mode asked for (AUTO: below) */
static _Atomic int g_bf16_env = -1;                  /* KVSERVE_CPU_BF16_MATMUL, parsed once */

enum kv_matmul_bf16 kv_matmul_bf16_default(void) {
#ifdef KV_MATMUL_X86
    static _Atomic int amd = -1;
    int a = atomic_load_explicit(&amd, memory_order_relaxed);
    if (a < 0) {
        __builtin_cpu_init();
        a = __builtin_cpu_is("amd") ? 1 : 0;
        atomic_store_explicit(&amd, a, memory_order_relaxed);
    }
    if (a && kv_bf16_family_for((int)kv_matmul_get_isa()) == KV_BF16_AVX512) return KV_MATMUL_BF16_BF16;
#endif
    return KV_MATMUL_BF16_F32;
}

/* AUTO resolved: the environment's choice, else the default for the ISA family in effect now. */
static enum kv_matmul_bf16 resolve_bf16(enum kv_matmul_bf16 m) {
    if (m != KV_MATMUL_BF16_AUTO) return m;
    int e = atomic_load_explicit(&g_bf16_env, memory_order_relaxed);
    if (e < 0) {
        const char *v = getenv("KVSERVE_CPU_BF16_MATMUL");
        char err[160];
        enum kv_matmul_bf16 p = KV_MATMUL_BF16_AUTO;
        if (v && *v && kv_matmul_bf16_parse(v, &p, err, sizeof err) != KV_OK) {
            KV_WARN("KVSERVE_CPU_BF16_MATMUL: %s; using auto", err);
            p = KV_MATMUL_BF16_AUTO;
        }
        e = (int)p;
        atomic_store_explicit(&g_bf16_env, e, memory_order_relaxed);
    }
    return e != KV_MATMUL_BF16_AUTO ? (enum kv_matmul_bf16)e : kv_matmul_bf16_default();
}

enum kv_matmul_bf16 kv_matmul_set_bf16(enum kv_matmul_bf16 m) {
    if (m == KV_MATMUL_BF16_AUTO) atomic_store(&g_bf16_env, -1); /* read the environment again */
    atomic_store(&g_bf16, (int)m);
    return resolve_bf16(m);
}

enum kv_matmul_bf16 kv_matmul_get_bf16(void) {
    return resolve_bf16((enum kv_matmul_bf16)atomic_load_explicit(&g_bf16, memory_order_relaxed));
}

const char *kv_matmul_bf16_name(enum kv_matmul_bf16 m) {
    return m == KV_MATMUL_BF16_F32 ? "f32" : m == KV_MATMUL_BF16_BF16 ? "bf16" : "auto";
}

kv_status kv_matmul_bf16_parse(const char *s, enum kv_matmul_bf16 *out, char *err, size_t errlen) {
    if (s && !strcasecmp(s, "bf16")) *out = KV_MATMUL_BF16_BF16;
    else if (s && !strcasecmp(s, "f32")) *out = KV_MATMUL_BF16_F32;
    else if (s && !strcasecmp(s, "auto")) *out = KV_MATMUL_BF16_AUTO;
    else return kv_errf(KV_EINVAL, err, errlen, "'%s': expected auto, bf16 or f32", s ? s : "");
    return KV_OK;
}

static enum kv_bf16_family bf16_family(void) { return kv_bf16_family_for((int)kv_matmul_get_isa()); }

const char *kv_matmul_bf16_family_name(void) {
    return kv_matmul_get_bf16() == KV_MATMUL_BF16_BF16 ? kv_bf16_family_name(bf16_family()) : "f32 kernels";
}

kv_status kv_cpu_env_check(char *err, size_t errlen) {
    enum kv_matmul_isa isa;
    enum kv_matmul_quant q;
    kv_status st = kv_cpu_isa_env(&isa, err, errlen);
    if (st != KV_OK) return st;
    const char *e = getenv("KVSERVE_CPU_QUANT_MATMUL");
    if (e && *e && kv_matmul_quant_parse(e, &q, err, errlen) != KV_OK)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_QUANT_MATMUL=%s: expected int8 or f32", e);
    enum kv_matmul_bf16 bm;
    e = getenv("KVSERVE_CPU_BF16_MATMUL");
    if (e && *e && kv_matmul_bf16_parse(e, &bm, err, errlen) != KV_OK)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_BF16_MATMUL=%s: expected auto, bf16 or f32", e);
    if (kv_q8_amx_env() < 0)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_AMX=%s: expected 0 (off) or 1", getenv("KVSERVE_CPU_AMX"));
    enum backend_cpu_float_layout fl;
    e = getenv("KVSERVE_CPU_FLOAT_LAYOUT");
    if (e && *e && backend_cpu_float_layout_parse(e, &fl) != KV_OK)
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_FLOAT_LAYOUT=%s: expected rows or grouped", e);
    const char *const bools[] = {"KVSERVE_CPU_PREPACK", "KVSERVE_CPU_THP", "KVSERVE_CPU_PANEL_THP"};
    for (int i = 0; i < 3; i++) {
        e = getenv(bools[i]);
        if (e && *e && strcmp(e, "0") && strcmp(e, "1"))
            return kv_errf(KV_EINVAL, err, errlen, "%s=%s: expected 0 (off) or 1", bools[i], e);
    }
    return KV_OK;
}

kv_status kv_matmul_quant_parse(const char *s, enum kv_matmul_quant *out, char *err, size_t errlen) {
    if (s && !strcasecmp(s, "int8")) *out = KV_MATMUL_QUANT_INT8;
    else if (s && !strcasecmp(s, "f32")) *out = KV_MATMUL_QUANT_F32;
    else return kv_errf(KV_EINVAL, err, errlen, "'%s': expected int8 or f32", s ? s : "");
    return KV_OK;
}

/* Two products read the same activations (X, M rows of K): their quantized / packed copy is
 * made once (plan_q8, plan_xpack). */
static int same_x(const struct kv_matmul_op *a, const struct kv_matmul_op *b) {
    return a->X == b->X && a->M == b->M && a->W->cols == b->W->cols;
}

/* Quantizes the activations of the ops that take the integer path (pl->q8[i]); ops with the
 * same X, M and group share one copy. acts: MAX_BATCH slots owned by the caller. */
static void plan_q8(struct plan *pl, struct kv_q8_act *acts) {
    const struct kv_matmul_op *ops = pl->ops;
    size_t off[MAX_BATCH], total = 0;
    int src[MAX_BATCH];
    for (int i = 0; i < pl->n_ops; i++) {
        pl->q8[i] = NULL;
        src[i] = -1;
        const struct kv_matmul_op *op = &ops[i];
        int G = kv_q8_group(op->W->type);
        if (!G || op->M < 1 || op->W->cols < 1 || op->W->rows < 1) continue;
        src[i] = i;
        for (int j = 0; j < i; j++)
            if (src[j] == j && same_x(&ops[j], op) &&
                kv_q8_group(ops[j].W->type) == G)
                src[i] = j;
        if (src[i] == i) {
            off[i] = total;
            total += (kv_q8_act_bytes(op->M, op->W->cols, G) + 63) & ~(size_t)63;
        }
    }
    if (!total) return;
    char *buf = thread_buf(BUF_ACT, total);
    if (!buf) abort(); /* M x K bytes: out of memory here is fatal, like the panel */
    for (int i = 0; i < pl->n_ops; i++) {
        if (src[i] != i) continue;
        const struct kv_matmul_op *op = &ops[i];
        kv_q8_act_init(&acts[i], buf + off[i], op->M, op->W->cols, kv_q8_group(op->W->type));
        kv_q8_quantize(&acts[i], 0, op->M, op->X, (size_t)op->W->cols);
    }
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] >= 0) pl->q8[i] = &acts[src[i]];
}

/* Shares one packed copy of X among the ops that read the same X: need[i] = the bytes op i's
 * copy takes (0: op i takes none). On return src[i] = the op whose copy op i reads (the first
 * with the same X; -1 for none) and off[i] = a copy's byte offset (64-byte aligned) in a buffer
 * of the returned size. */
static size_t share_x(const struct plan *pl, const size_t *need, int *src, size_t *off) {
    size_t total = 0;
    for (int i = 0; i < pl->n_ops; i++) {
        src[i] = -1;
        if (!need[i]) continue;
        src[i] = i;
        for (int j = 0; j < i; j++)
            if (src[j] == j && same_x(&pl->ops[j], &pl->ops[i])) src[i] = j;
        if (src[i] == i) {
            off[i] = total;
            total += (need[i] + 63) & ~(size_t)63;
        }
    }
    return total;
}

/* BF16 mode: marks the ops with BF16 weights (pl->bf) and packs their X once per distinct X
 * for the bf16 family (pl->bxp; the generic family reads X in place). */
static void plan_bf16(struct plan *pl) {
    for (int i = 0; i < pl->n_ops; i++) {
        pl->bf[i] = false;
        pl->bxp[i] = NULL;
    }
    if (kv_matmul_get_bf16() != KV_MATMUL_BF16_BF16) return;
    pl->bff = bf16_family();
    size_t need[MAX_BATCH], off[MAX_BATCH];
    int src[MAX_BATCH];
    for (int i = 0; i < pl->n_ops; i++) {
        const struct kv_matmul_op *op = &pl->ops[i];
        pl->bf[i] = op->W->type == KV_QTYPE_BF16 && op->M >= 1 && op->W->cols >= 1 && op->W->rows >= 1;
        need[i] = pl->bf[i] ? kv_bf16_xpack_bytes(pl->bff, op->M, op->W->cols) : 0;
    }
    size_t total = share_x(pl, need, src, off);
    if (!total) return;
    char *buf = thread_buf(BUF_BF16X, total);
    if (!buf) abort(); /* M x K x 2-4 bytes, like the activations: out of memory here is fatal */
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] == i) kv_bf16_pack_x(pl->bff, pl->ops[i].X, (size_t)pl->ops[i].W->cols, pl->ops[i].M, pl->ops[i].W->cols, buf + off[i]);
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] >= 0) pl->bxp[i] = buf + off[src[i]];
}

/* Packs the X of every op that runs on an x86 family's float tiles (M > DECODE_ROWS, not the
 * integer path) once, in the caller's buffer; ops with the same X share it. Marks the ops whose
 * 16-bit grouped rows take the grouped tiles (pl->hf; same packing). */
static void plan_xpack(struct plan *pl) {
#ifdef KV_MATMUL_X86
    int R = pl->fn == cols_avx512 ? R512 : pl->fn == cols_avx2 ? R256 : 0;
    if (!R) return;
    size_t need[MAX_BATCH], off[MAX_BATCH];
    int src[MAX_BATCH];
    for (int i = 0; i < pl->n_ops; i++) {
        const struct kv_matmul_op *op = &pl->ops[i];
        const struct kv_wmat *W = op->W;
        bool take = !pl->q8[i] && !pl->bf[i] && op->M > DECODE_ROWS && W->cols >= 0 && W->rows >= 1;
        /* F16/BF16 grouped at load, every group full */
        bool grouped = W->panel && kv_fgroup_ok(W->type, W->cols) && W->rows % KV_FGROUP_ROWS == 0;
        pl->hf[i] = take && grouped ? hcols_for(pl->fn, W->type, op->M) : NULL;
        /* + 16 floats: a K < 16 op still gets a (never read) buffer */
        need[i] = take ? ((size_t)op->M * (size_t)(W->cols - W->cols % 16) + 16) * sizeof(float) : 0;
    }
    size_t total = share_x(pl, need, src, off);
    if (!total) return;
    char *buf = thread_buf(BUF_XPACK, total);
    if (!buf) abort(); /* M x K floats, like the activations: out of memory here is fatal */
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] == i) pack_x(pl->ops[i].X, pl->ops[i].M, pl->ops[i].W->cols, R, (float *)(buf + off[i]));
    for (int i = 0; i < pl->n_ops; i++)
        if (src[i] >= 0) pl->xp[i] = (const float *)(buf + off[src[i]]);
#else
    (void)pl;
#endif
}

static void run_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp) {
    int n_threads = tp ? kv_threadpool_size(tp) : 1;
    struct plan pl = {.ops = ops, .n_ops = n_ops, .fn = current_fn()};
    struct kv_q8_act acts[MAX_BATCH];
    if (kv_matmul_get_quant() == KV_MATMUL_QUANT_INT8) plan_q8(&pl, acts);
    plan_bf16(&pl);
    plan_xpack(&pl);
    long total_rows = 0, macs = 0;
    for (int i = 0; i < n_ops; i++) {
        int M = ops[i].M > 0 ? ops[i].M : 0;
        total_rows += M ? ops[i].W->rows : 0;
        macs += (long)M * ops[i].W->rows * (ops[i].W->cols > 0 ? ops[i].W->cols : 1);
    }
    if (macs < INLINE_MACS) n_threads = 1;
    pl.first[0] = 0;
    for (int i = 0; i < n_ops; i++) {
        const struct kv_matmul_op *op = &ops[i];
        int N = op->W->rows, nb = 0;
        if (op->M > 0 && N > 0) {
            size_t row_bytes = (size_t)(op->W->cols > 0 ? op->W->cols : 1) * sizeof(float);
            nb = (int)(block_bytes() / row_bytes) & ~7;
            /* at least ~4 tasks per thread over the whole batch, for load balance */
            int fair = (int)((total_rows + 4L * n_threads - 1) / (4L * n_threads));
            fair = (fair + 7) & ~7;
            if (nb > fair) nb = fair;
            if (nb < 8) nb = 8;
            /* the float tiles take 3 W rows at a time (C512, C256): a task of a multiple of 24
             * rows has no 1- or 2-row remainder tile (a 16-row task, K = 5632 in f32, ran one
             * of its 6 tiles with a third of the work at the full cost) */
            if (op->M > DECODE_ROWS && !pl.q8[i] && !pl.bf[i] && nb >= 16) nb = (nb + 12) / 24 * 24;
            /* tasks start at a row group of a q8 panel (16 rows; the grouped F16/BF16 layout's
             * 4-row groups divide every nb here) */
            if (op->W->panel && !kv_fgroup_ok(op->W->type, op->W->cols)) nb = (nb + 15) & ~15;
        }
        pl.nb[i] = nb;
        pl.first[i + 1] = pl.first[i] + (nb ? (N + nb - 1) / nb : 0);
    }
    int total = pl.first[n_ops];
    if (!tp || n_threads == 1) {
        for (int t = 0; t < total; t++) plan_task(&pl, t, 0);
    } else {
        kv_threadpool_for(tp, total, plan_task, &pl);
    }
}

void kv_matmul_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp) {
    for (int i = 0; i < n_ops; i += MAX_BATCH) run_batch(ops + i, n_ops - i < MAX_BATCH ? n_ops - i : MAX_BATCH, tp);
}

void kv_matmul_w(const float *X, int M, const struct kv_wmat *W, const float *bias, float *Y, kv_threadpool_t *tp) {
    struct kv_matmul_op op = {.X = X, .W = W, .bias = bias, .Y = Y, .M = M};
    run_batch(&op, 1, tp);
}

void kv_matmul(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y,
               kv_threadpool_t *tp) {
    struct kv_wmat w = kv_wmat_from_f32(W, N, K);
    kv_matmul_w(X, M, &w, bias, Y, tp);
}

void kv_matmul_reference(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y) {
    int K16 = K - K % 16;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *x = X + (size_t)m * K, *w = W + (size_t)n * K;
            float lane[16];
            for (int j = 0; j < 16; j++) {
                lane[j] = 0.0f;
                for (int k = j; k < K16; k += 16) lane[j] = fmaf(x[k], w[k], lane[j]);
            }
            float l8[8], l4[4], l2[2];
            for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
            for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
            for (int j = 0; j < 2; j++) l2[j] = l4[j] + l4[j + 2];
            float s = l2[0] + l2[1];
            for (int k = K16; k < K; k++) s = fmaf(x[k], w[k], s);
            if (bias) s = s + bias[n];
            Y[(size_t)m * N + n] = s;
        }
}
