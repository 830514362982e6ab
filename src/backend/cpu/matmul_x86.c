/*
 * matmul_x86: the AVX-512 and AVX2 kernel families of the batch-invariant matmul (matmul.h's
 * contract; matmul.c plans the tasks and picks the family): the f32 tiles over packed X and f32
 * W rows (in place or a task's dequantized panel), the AVX-512 tiles that widen F16/BF16 rows of
 * the grouped layout in registers, and the X packing they read. Per-function target attributes:
 * the file builds for baseline x86-64 and matmul.c only calls a family the CPU has. Compiled with
 * fp-contract off so that only the explicit fmas fuse.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "matmul_internal.h"

#ifdef KV_MATMUL_X86

#include <stdint.h>
#include <string.h>

#include "../../quant/qdot.h"

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
 * 2048 x 2112, F16, Sapphire Rapids). So run_batch packs X once per op (kv_mm_pack_x) so that a tile
 * reads its X as one sequential stream:
 *   tile t of R rows (the last one Rt = M - t R rows), 16-float step s of K16:
 *       Xp[t R K16 + s Rt 16 + r 16 + j] = X[t R + r][16 s + j]
 * The K % 16 tail elements are read in place. Same products in the same order: no bit changes.
 * (Packing W per task in groups of C rows as well measured no better, 0-10% worse: not done.)
 * Both the packed X and the task's W panel sit on 2 MiB pages (kv_mm_thread_buf); on 4 KiB pages the
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

T512 void kv_mm_cols_avx512(const struct cols_args *a) {
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

T256 void kv_mm_cols_avx2(const struct cols_args *a) {
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

/* The grouped tiles for an op of M rows of this type on family fn, or NULL (the panel). */
hcols_fn kv_mm_hcols_for(cols_fn fn, int type, int M) {
    if (fn != kv_mm_cols_avx512 || M > HTILE_MAX_M) return NULL;
    return type == KV_QTYPE_F16 ? hcols512_f16 : type == KV_QTYPE_BF16 ? hcols512_bf16 : NULL;
}

/* Packs rows [0, M) of X (K floats apart) in the layout above for tiles of R rows: M * K16
 * floats at Xp. */
void kv_mm_pack_x(const float *X, int M, int K, int R, float *Xp) {
    const int K16 = K - K % 16;
    for (int t = 0; t < M; t += R) {
        int Rt = M - t < R ? M - t : R;
        float *o = Xp + (size_t)t * K16;
        for (int s = 0; s < K16; s += 16)
            for (int r = 0; r < Rt; r++, o += 16) memcpy(o, X + (size_t)(t + r) * K + s, 16 * sizeof(float));
    }
}

#endif /* KV_MATMUL_X86 */
