/*
 * matmul_bf16: the BF16 mode's kernels (contract and layouts in matmul_bf16.h).
 */
#include "matmul_bf16.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include <math.h>
#include <string.h>

#include "simd_internal.h"

#define AI static inline __attribute__((always_inline))

/* ---- scalar pieces of the contract ---- */

AI float bf16_f(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
AI float daz(float x) {
    union { float f; uint32_t u; } v = {x};
    if (!(v.u & 0x7f800000u)) v.u &= 0x80000000u;
    return v.f;
}
/* one lane step: ftz(fmaf(daz(a), daz(b), daz(c))), where ftz flushes a result that is tiny in
 * x86's sense: detected AFTER rounding, i.e. the exact value rounded to 24 bits with an unbounded
 * exponent is below 2^-126. fmaf rounds with gradual underflow, so an exact value in
 * [2^-126 - 2^-151, 2^-126) comes back as the normal 2^-126 although the hardware (vdpbf16ps,
 * vfmadd under MXCSR.FTZ) flushes it: that one case is checked on the exact value, in double
 * (a b is exact there, c is normal or zero, and the sum's rounding cannot cross the threshold,
 * which lies 2^-151 from every multiple of 2^-149). Found by the tester with a lane of
 * 2^-126 + 2^-149 - 3 * 2^-150. */
AI float lane_step(float a, float b, float c) {
    a = daz(a), b = daz(b), c = daz(c);
    float r = fmaf(a, b, c);
    if (fabsf(r) == 0x1p-126f && fabs((double)a * (double)b + (double)c) < 0x1p-126 - 0x1p-151) return copysignf(0.0f, r);
    return daz(r);
}
/* an addition under the same rule (the exact sum of two normal floats below 2^-126 is a multiple
 * of 2^-149, representable: daz of the rounded sum is exact) */
AI float add_z(float a, float b) { return daz(daz(a) + daz(b)); }

/* Row r of a task's rows (either layout): its first 64-byte chunk (32 weights); chunk s is
 * *cs bytes further. The file's rows: consecutive chunks; the grouped layout: the rows of r's
 * group (4, or fewer in the last group) interleave chunk by chunk. */
static inline const char *w_row(const struct kv_bf16_w *w, int K, int r, size_t *cs) {
    if (!w->grouped) {
        *cs = 64;
        return (const char *)w->w + (size_t)r * w->row_bytes;
    }
    int g = r / 4, nr = w->n_rows - 4 * g < 4 ? w->n_rows - 4 * g : 4;
    *cs = (size_t)nr * 64;
    return (const char *)w->w + (size_t)g * 4 * (size_t)K * 2 + (size_t)(r % 4) * 64;
}

/* Weight k of row r of a task (either layout). */
AI uint16_t w_at(const struct kv_bf16_w *w, int K, int r, int k) {
    size_t cs;
    const char *p = w_row(w, K, r, &cs) + (size_t)(k / 32) * cs;
    return ((const uint16_t *)p)[k % 32];
}

/* The contract for one (X row, weight row), lanes and all: the generic family and the
 * reference. xrow: K floats; w(k): the row's weights. */
#define DOT_SCALAR(xrow, WK, K, out)                                                               \
    do {                                                                                           \
        int K32_ = (K) - (K) % 32;                                                                 \
        float lane_[16];                                                                           \
        for (int j = 0; j < 16; j++) lane_[j] = 0.0f;                                              \
        for (int k0 = 0; k0 < K32_; k0 += 32)                                                      \
            for (int j = 0; j < 16; j++) {                                                         \
                int k_ = k0 + 2 * j + 1;                                                           \
                lane_[j] = lane_step(bf16_f(kv_bf16_round((xrow)[k_])), bf16_f(WK(k_)), lane_[j]); \
                k_ = k0 + 2 * j;                                                                   \
                lane_[j] = lane_step(bf16_f(kv_bf16_round((xrow)[k_])), bf16_f(WK(k_)), lane_[j]); \
            }                                                                                      \
        float l8_[8], l4_[4];                                                                      \
        for (int j = 0; j < 8; j++) l8_[j] = add_z(lane_[j], lane_[j + 8]);                         \
        for (int j = 0; j < 4; j++) l4_[j] = add_z(l8_[j], l8_[j + 4]);                             \
        float s_ = add_z(add_z(l4_[0], l4_[2]), add_z(l4_[1], l4_[3]));                            \
        for (int k_ = K32_; k_ < (K); k_++)                                                        \
            s_ = lane_step(bf16_f(kv_bf16_round((xrow)[k_])), bf16_f(WK(k_)), s_);                 \
        (out) = s_;                                                                                \
    } while (0)

static void cols_generic(const float *X, size_t ldx, int M, int K, const struct kv_bf16_w *w, const float *bias,
                         float *Y, size_t ldy) {
    for (int m = 0; m < M; m++)
        for (int r = 0; r < w->n_rows; r++) {
            const float *x = X + (size_t)m * ldx;
            float s;
#define WK_G(k) w_at(w, K, r, k)
            DOT_SCALAR(x, WK_G, K, s);
#undef WK_G
            if (bias) s = add_z(s, bias[r]);
            Y[(size_t)m * ldy + r] = s;
        }
}

void kv_bf16_reference(const float *X, size_t ldx, int M, int K, const uint16_t *W, size_t ldw, int N,
                       const float *bias, float *Y, size_t ldy) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *x = X + (size_t)m * ldx;
            const uint16_t *wr = W + (size_t)n * ldw;
            float s;
#define WK_R(k) wr[k]
            DOT_SCALAR(x, WK_R, K, s);
#undef WK_R
            if (bias) s = add_z(s, bias[n]);
            Y[(size_t)m * ldy + n] = s;
        }
}

/* ---- blocking shared by the SIMD families ----
 * Like matmul_x86.c's float tiles (its loop-nest comment): X tiles of R rows (packed once per
 * product, one sequential stream per tile), K blocks of at most KC steps of 32 when there is
 * more than one X tile (the X tile stays in L1 while the task's W rows stream from L2), W tiles
 * of up to 4 rows (one group of the grouped layout). Between K blocks a tile's 16 lanes go to
 * the sums buffer and come back: each lane still steps through k in increasing order. */
#define KC 64 /* steps of 32: a 6-row bf16 X tile of 24 KiB */
#define CMAX 4

static int k_blocks(int steps, int one_tile) { return one_tile || steps <= KC ? 1 : (steps + KC - 1) / KC; }
static int k_bound(int steps, int nkb, int b) { return (int)((long)steps * b / nkb); }

/* Where one W tile's rows and chunks are: row c, chunk (step) s at base + c * rs + s * cs. */
struct wtile {
    const char *base;
    size_t rs, cs;
    int C;
};

/* The task's W tile of rows r0 .. r0 + 3 (fewer at the end; r0 a multiple of 4, so in the
 * grouped layout the tile is one group). */
static struct wtile w_tile(const struct kv_bf16_w *w, int K, int r0) {
    struct wtile t = {NULL, w->grouped ? 64 : w->row_bytes, 0, w->n_rows - r0 < 4 ? w->n_rows - r0 : 4};
    t.base = w_row(w, K, r0, &t.cs);
    return t;
}

/* Floats of saved lanes for the tiles of n_rows rows, R X rows a tile (at most 4 W rows a tile,
 * the AVX2 panel form's 3 included). */
static size_t lane_floats(int R, int n_rows) { return (size_t)(n_rows / 3 + 1) * (size_t)R * CMAX * 16; }

/* The K % 32 tail (file layout only), the bias, the store: one output from its tree sum (under
 * the caller's MXCSR.DAZ|FTZ, as everything in the SIMD families). */
AI float finish(float s, const float *x, const uint16_t *wt, int nt, const float *bias) {
    for (int k = 0; k < nt; k++) s = fmaf(bf16_f(kv_bf16_round(x[k])), bf16_f(wt[k]), s);
    if (bias) s = s + *bias;
    return s;
}

/* Every output of an R x C tile from its tree sums s[r C + c]: finish() with X row r's tail
 * (X + r ldx + K32) and W row c's (w + c wld + K32, elements; NULL when K % 32 == 0). */
AI void finish_tile(const float *s, const int R, const int C, const float *X, size_t ldx, const uint16_t *w,
                    size_t wld, int K, const float *bias, float *Y, size_t ldy) {
    const int K32 = K - K % 32, nt = K % 32;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            Y[r * ldy + c] = finish(s[r * C + c], X + r * ldx + K32, w ? w + c * wld + K32 : NULL, nt,
                                    bias ? bias + c : NULL);
}

struct tile_job {
    const void *xt;          /* the X tile at the block's first step */
    const float *X;          /* f32 row m0 (tails) */
    size_t ldx;
    const struct wtile *wt;  /* the W tile */
    int s0, steps, K;
    int first, last;
    float *buf;              /* R * C * 16 saved lanes */
    const float *bias;       /* at the tile's first row, or NULL */
    float *Y;                /* Y at (m0, r0) */
    size_t ldy;
};

#ifdef KV_CPU_X86

/* MXCSR.DAZ|FTZ on the calling thread for one kv_bf16_cols call (the SIMD families' whole
 * arithmetic runs under it), then the caller's MXCSR back. The "memory" clobbers keep every load
 * of the operands after the switch and every store of Y before the undo. ldmxcsr costs tens of
 * cycles: once per call, not per tile (per tile cost the AVX2 decode of a 768-wide model 25%). */
static inline unsigned csr_enter(void) {
    unsigned c, n;
    __asm__ volatile("stmxcsr %0" : "=m"(c)::"memory");
    n = c | 0x8040u; /* FTZ (bit 15) | DAZ (bit 6) */
    __asm__ volatile("ldmxcsr %0" ::"m"(n) : "memory");
    return c;
}
static inline void csr_leave(unsigned c) { __asm__ volatile("ldmxcsr %0" ::"m"(c) : "memory"); }

#define T512BF __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))

/* ---- AVX-512 BF16: R x C tiles of zmm accumulators, vdpbf16ps ---- */
#define RB512 6 /* 24 accumulators + 4 W + 1 X of 32 zmm */

AI T512BF void tile_bf512(const struct tile_job *j, const int R, const int C) {
    __m512 acc[RB512 * CMAX];
    _Pragma("GCC unroll 24") for (int i = 0; i < R * C; i++)
        acc[i] = j->first ? _mm512_setzero_ps() : _mm512_load_ps(j->buf + 16 * i);
    const uint16_t *X = j->xt;
    const char *W = j->wt->base + (size_t)j->s0 * j->wt->cs;
    const size_t rs = j->wt->rs, cs = j->wt->cs;
    for (int s = 0; s < j->steps; s++, X += R * 32, W += cs) {
        __m512i w[CMAX];
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) w[c] = _mm512_loadu_si512(W + c * rs);
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {
            __m512i x = _mm512_loadu_si512(X + r * 32);
            __asm__("" : "+v"(x)); /* one load per X vector (see matmul_x86.c's tile512) */
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)
                acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], (__m512bh)x, (__m512bh)w[c]);
        }
    }
    if (!j->last) {
        _Pragma("GCC unroll 24") for (int i = 0; i < R * C; i++) _mm512_store_ps(j->buf + 16 * i, acc[i]);
        return;
    }
    float s[RB512 * CMAX];
    kv_tree16_512(acc, R * C < 16 ? R * C : 16, s);
    if (R * C > 16) kv_tree16_512(acc + 16, R * C - 16, s + 16);
    finish_tile(s, R, C, j->X, j->ldx, (const uint16_t *)j->wt->base, rs / 2, j->K, j->bias, j->Y, j->ldy);
}

#define TILE_SWITCH(FN, R, C, j)                        \
    switch ((R) * 8 + (C)) {                            \
    case 6 * 8 + 4: FN(j, 6, 4); break;                 \
    case 6 * 8 + 3: FN(j, 6, 3); break;                 \
    case 6 * 8 + 2: FN(j, 6, 2); break;                 \
    case 6 * 8 + 1: FN(j, 6, 1); break;                 \
    case 5 * 8 + 4: FN(j, 5, 4); break;                 \
    case 5 * 8 + 3: FN(j, 5, 3); break;                 \
    case 5 * 8 + 2: FN(j, 5, 2); break;                 \
    case 5 * 8 + 1: FN(j, 5, 1); break;                 \
    case 4 * 8 + 4: FN(j, 4, 4); break;                 \
    case 4 * 8 + 3: FN(j, 4, 3); break;                 \
    case 4 * 8 + 2: FN(j, 4, 2); break;                 \
    case 4 * 8 + 1: FN(j, 4, 1); break;                 \
    case 3 * 8 + 4: FN(j, 3, 4); break;                 \
    case 3 * 8 + 3: FN(j, 3, 3); break;                 \
    case 3 * 8 + 2: FN(j, 3, 2); break;                 \
    case 3 * 8 + 1: FN(j, 3, 1); break;                 \
    case 2 * 8 + 4: FN(j, 2, 4); break;                 \
    case 2 * 8 + 3: FN(j, 2, 3); break;                 \
    case 2 * 8 + 2: FN(j, 2, 2); break;                 \
    case 2 * 8 + 1: FN(j, 2, 1); break;                 \
    case 1 * 8 + 4: FN(j, 1, 4); break;                 \
    case 1 * 8 + 3: FN(j, 1, 3); break;                 \
    case 1 * 8 + 2: FN(j, 1, 2); break;                 \
    case 1 * 8 + 1: FN(j, 1, 1); break;                 \
    default: break;                                     \
    }

static T512BF void run_tile512(const struct tile_job *j, int R, int C) { TILE_SWITCH(tile_bf512, R, C, j) }

/* ---- AVX2 emulation: vfmadd231ps under MXCSR.DAZ|FTZ ----
 * A 16-lane accumulator is two independent 8-lane halves (lanes 0-7 cover the pairs of a
 * chunk's first 16 weights, lanes 8-15 the last 16). Decode form (M <= 4): one X row a tile,
 * both halves of a step in turn, one ymm per (half, column): 2 x 4 = 8 accumulators + 4 W + 1 X
 * (+ the mask) of 16 ymm, so a W tile's chunks are read once, in order (a pass per half
 * measured ~20% slower decode: the second pass re-read the group). A W vector's 8 dwords are 8
 * (even, odd) weight pairs: the odd weights as floats are the dwords with the low half
 * cleared, the even ones the dwords shifted left by 16. The X tile is packed as floats, per
 * (step, row): odd 8, even 8 of the first half, then of the second. */
#define RB256 1

#define T256E KV_T256


AI T256E void tile_bf256(const struct tile_job *j, const int R, const int C) {
    (void)R; /* always 1 */
    __m256 acc[2 * CMAX]; /* [h * C + c] */
    const size_t rs = j->wt->rs, cs = j->wt->cs;
    const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);
    _Pragma("GCC unroll 8") for (int i = 0; i < 2 * C; i++) {
        int h = i / C, c = i % C;
        acc[i] = j->first ? _mm256_setzero_ps() : _mm256_load_ps(j->buf + 16 * c + 8 * h);
    }
    const float *X = (const float *)j->xt;
    const char *W = j->wt->base + (size_t)j->s0 * cs;
    for (int s = 0; s < j->steps; s++, X += 32, W += cs) {
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256i w[CMAX];
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)
                w[c] = _mm256_loadu_si256((const __m256i *)(W + c * rs + 32 * h));
            __m256 x = _mm256_load_ps(X + 16 * h);
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)
                acc[h * C + c] = _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_and_si256(w[c], mask)), acc[h * C + c]);
            x = _mm256_load_ps(X + 16 * h + 8);
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)
                acc[h * C + c] = _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(w[c], 16)), acc[h * C + c]);
        }
    }
    if (!j->last) {
        _Pragma("GCC unroll 8") for (int i = 0; i < 2 * C; i++) {
            int h = i / C, c = i % C;
            _mm256_store_ps(j->buf + 16 * c + 8 * h, acc[i]);
        }
        return;
    }
    __m256 l8[CMAX]; /* l8 = lanes 0-7 + lanes 8-15 */
    _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) l8[c] = _mm256_add_ps(acc[c], acc[C + c]);
    float s[CMAX];
    kv_tree8_256(l8, C, s);
    finish_tile(s, 1, C, j->X, j->ldx, (const uint16_t *)j->wt->base, rs / 2, j->K, j->bias, j->Y, j->ldy);
}

static T256E void run_tile256(const struct tile_job *j, int R, int C) {
    (void)R;
    switch (C) {
    case 4: tile_bf256(j, 1, 4); break;
    case 3: tile_bf256(j, 1, 3); break;
    case 2: tile_bf256(j, 1, 2); break;
    case 1: tile_bf256(j, 1, 1); break;
    default: break;
    }
}

/* ---- AVX2 emulation for prefill (M > 4): the task's rows split once into f32 planes ----
 * Each weight row is converted once per task into the X packing's float layout (per step and
 * half: odd 8, even 8), so the tile is pure loads and FMAs as matmul_x86.c's tile256: 4 X rows x 3 W
 * rows, 12 accumulators + 3 W + 1 X of 16 ymm; the conversion is amortised over all M rows
 * (the f32 mode converts its panel the same way). Same products in the same order. */
#define RP256 4
#define CP256 3

/* Row i of the task's rows (either layout) as planes: K32 floats at d. */
static T256E void split_row(const struct kv_bf16_w *w, int K, int i, float *d) {
    const int steps = K / 32;
    size_t cs;
    const char *p = w_row(w, K, i, &cs);
    const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int s = 0; s < steps; s++, p += cs, d += 32)
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * h));
            _mm256_store_ps(d + 16 * h, _mm256_castsi256_ps(_mm256_and_si256(v, mask)));
            _mm256_store_ps(d + 16 * h + 8, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
}

struct ptile_job {
    const float *xt;  /* X tile at the block's first step */
    const float *wp;  /* the tile's first W row's planes at the block's first step */
    size_t ldw;       /* floats between two rows' planes */
    const float *X;   /* f32 row m0 (tails) */
    size_t ldx;
    const uint16_t *wtail; /* the tile's first W row at element 0 (file layout, tails) */
    size_t wtail_ld;       /* elements between two rows there */
    int steps, K, first, last;
    float *buf;
    const float *bias;
    float *Y;
    size_t ldy;
};

AI T256E void ptile256(const struct ptile_job *j, const int R, const int C) {
    __m256 acc[RP256 * CP256];
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        _Pragma("GCC unroll 12") for (int i = 0; i < R * C; i++)
            acc[i] = j->first ? _mm256_setzero_ps() : _mm256_load_ps(j->buf + 16 * i + 8 * h);
        const float *X = j->xt + 16 * h, *W = j->wp + 16 * h;
        for (int s = 0; s < j->steps; s++, X += R * 32, W += 32) {
            _Pragma("GCC unroll 2") for (int e = 0; e < 2; e++) { /* odd, then even */
                __m256 w[CP256];
                _Pragma("GCC unroll 3") for (int c = 0; c < C; c++) w[c] = _mm256_load_ps(W + c * j->ldw + 8 * e);
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                    __m256 x = _mm256_load_ps(X + r * 32 + 8 * e);
                    _Pragma("GCC unroll 3") for (int c = 0; c < C; c++)
                        acc[r * C + c] = _mm256_fmadd_ps(x, w[c], acc[r * C + c]);
                }
            }
        }
        if (!j->last || h == 0) {
            _Pragma("GCC unroll 12") for (int i = 0; i < R * C; i++) _mm256_store_ps(j->buf + 16 * i + 8 * h, acc[i]);
        }
    }
    if (!j->last) return;
    _Pragma("GCC unroll 12") for (int i = 0; i < R * C; i++) acc[i] = _mm256_add_ps(_mm256_load_ps(j->buf + 16 * i), acc[i]);
    float s[RP256 * CP256];
    kv_tree8_256(acc, R * C < 8 ? R * C : 8, s);
    if (R * C > 8) kv_tree8_256(acc + 8, R * C - 8, s + 8);
    finish_tile(s, R, C, j->X, j->ldx, j->wtail, j->wtail_ld, j->K, j->bias, j->Y, j->ldy);
}

static T256E void run_ptile256(const struct ptile_job *j, int R, int C) {
    switch (R * 8 + C) {
    case 4 * 8 + 3: ptile256(j, 4, 3); break;
    case 4 * 8 + 2: ptile256(j, 4, 2); break;
    case 4 * 8 + 1: ptile256(j, 4, 1); break;
    case 3 * 8 + 3: ptile256(j, 3, 3); break;
    case 3 * 8 + 2: ptile256(j, 3, 2); break;
    case 3 * 8 + 1: ptile256(j, 3, 1); break;
    case 2 * 8 + 3: ptile256(j, 2, 3); break;
    case 2 * 8 + 2: ptile256(j, 2, 2); break;
    case 2 * 8 + 1: ptile256(j, 2, 1); break;
    case 1 * 8 + 3: ptile256(j, 1, 3); break;
    case 1 * 8 + 2: ptile256(j, 1, 2); break;
    case 1 * 8 + 1: ptile256(j, 1, 1); break;
    default: break;
    }
}

/* The panel form of kv_bf16_cols for the AVX2 family (M > 4). panel: n_rows * K32 floats. */
static T256E void cols_panel256(const void *xp, const float *X, size_t ldx, int M, int K, const struct kv_bf16_w *w,
                                const float *bias, float *Y, size_t ldy, float *sums, float *panel) {
    const int K32 = K - K % 32, steps = K32 / 32, n = w->n_rows;
    for (int i = 0; i < n; i++) split_row(w, K, i, panel + (size_t)i * K32);
    const int nkb = k_blocks(steps, M <= RP256);
    for (int m0 = 0; m0 < M; m0 += RP256) {
        int Rt = M - m0 < RP256 ? M - m0 : RP256;
        const float *xt = (const float *)xp + (size_t)m0 * K32;
        for (int kb = 0; kb < nkb; kb++) {
            int s0 = k_bound(steps, nkb, kb), s1 = k_bound(steps, nkb, kb + 1);
            for (int r0 = 0, t = 0; r0 < n; r0 += CP256, t++) {
                int C = n - r0 < CP256 ? n - r0 : CP256;
                struct ptile_job j = {xt + (size_t)s0 * Rt * 32,
                                      panel + (size_t)r0 * K32 + (size_t)s0 * 32,
                                      (size_t)K32,
                                      X + (size_t)m0 * ldx,
                                      ldx,
                                      w->grouped ? NULL : (const uint16_t *)((const char *)w->w + (size_t)r0 * w->row_bytes),
                                      w->row_bytes / 2,
                                      s1 - s0,
                                      K,
                                      kb == 0,
                                      kb == nkb - 1,
                                      sums + (size_t)t * RP256 * CP256 * 16,
                                      bias ? bias + r0 : NULL,
                                      Y + (size_t)m0 * ldy + r0,
                                      ldy};
                run_ptile256(&j, Rt, C);
            }
        }
    }
}

#endif /* KV_CPU_X86 */

/* ---- families, packing, the loop nest ---- */

enum kv_bf16_family kv_bf16_family_for(int isa) {
#ifdef KV_CPU_X86
    __builtin_cpu_init();
    if (isa == 3 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return KV_BF16_AVX512;
    if (isa >= 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return KV_BF16_AVX2;
#else
    (void)isa;
#endif
    return KV_BF16_GENERIC;
}

const char *kv_bf16_family_name(enum kv_bf16_family f) {
    return f == KV_BF16_AVX512 ? "avx512-bf16" : f == KV_BF16_AVX2 ? "avx2-emul" : "generic";
}

/* X rows per tile (the X packing's R): AVX2 takes the panel form above 4 rows. */
static int fam_rows(enum kv_bf16_family f, int M) {
#ifdef KV_CPU_X86
    return f == KV_BF16_AVX512 ? RB512 : f == KV_BF16_AVX2 ? (M > 4 ? RP256 : RB256) : 0;
#else
    (void)f, (void)M;
    return 0;
#endif
}

size_t kv_bf16_xpack_bytes(enum kv_bf16_family f, int M, int K) {
    size_t n = (size_t)(M > 0 ? M : 0) * (size_t)(K - K % 32);
    return f == KV_BF16_AVX512 ? n * 2 : f == KV_BF16_AVX2 ? n * 4 : 0;
}

/* Layout: X tile t (rows t R .. t R + Rt - 1), step s, row r at element t R K32 + (s Rt + r) 32;
 * AVX-512: the 32 rounded values of the step; AVX2: floats, per half h, odd 8 then even 8. */
void kv_bf16_pack_x(enum kv_bf16_family f, const float *X, size_t ldx, int M, int K, void *xp) {
    const int R = fam_rows(f, M), K32 = K - K % 32;
    if (!R) return;
    for (int t = 0; t < M; t += R) {
        int Rt = M - t < R ? M - t : R;
        for (int s = 0; s < K32 / 32; s++)
            for (int r = 0; r < Rt; r++) {
                const float *x = X + (size_t)(t + r) * ldx + 32 * s;
                size_t o = (size_t)t * K32 + ((size_t)s * Rt + r) * 32;
                if (f == KV_BF16_AVX512) {
                    uint16_t *d = (uint16_t *)xp + o;
                    for (int e = 0; e < 32; e++) d[e] = kv_bf16_round(x[e]);
                } else {
                    float *d = (float *)xp + o;
                    for (int h = 0; h < 2; h++)
                        for (int e = 0; e < 8; e++) {
                            d[16 * h + e] = bf16_f(kv_bf16_round(x[16 * h + 2 * e + 1]));
                            d[16 * h + 8 + e] = bf16_f(kv_bf16_round(x[16 * h + 2 * e]));
                        }
                }
            }
    }
}

size_t kv_bf16_sums_floats(enum kv_bf16_family f, int M, int K, int n_rows) {
    int R = fam_rows(f, M);
    size_t n = lane_floats(R ? R : 1, n_rows);
    /* the AVX2 panel form: its planes after the sums, 64-byte aligned */
    if (f == KV_BF16_AVX2 && M > 4) n = ((n + 15) & ~(size_t)15) + (size_t)n_rows * (size_t)(K - K % 32);
    return n;
}

void kv_bf16_cols(enum kv_bf16_family f, const void *xp, const float *X, size_t ldx, int M, int K,
                  const struct kv_bf16_w *w, const float *bias, float *Y, size_t ldy, float *sums) {
    const int R = fam_rows(f, M);
    if (!R || !xp) {
        cols_generic(X, ldx, M, K, w, bias, Y, ldy);
        return;
    }
#ifdef KV_CPU_X86
    unsigned csr = csr_enter();
    if (f == KV_BF16_AVX2 && M > 4) {
        cols_panel256(xp, X, ldx, M, K, w, bias, Y, ldy, sums, sums + ((lane_floats(RP256, w->n_rows) + 15) & ~(size_t)15));
        csr_leave(csr);
        return;
    }
    const int K32 = K - K % 32, steps = K32 / 32;
    const size_t esz = f == KV_BF16_AVX512 ? 2 : 4;
    const int nkb = k_blocks(steps, M <= R);
    for (int m0 = 0; m0 < M; m0 += R) {
        int Rt = M - m0 < R ? M - m0 : R;
        const char *xt = (const char *)xp + (size_t)m0 * K32 * esz;
        for (int kb = 0; kb < nkb; kb++) {
            int s0 = k_bound(steps, nkb, kb), s1 = k_bound(steps, nkb, kb + 1);
            for (int r0 = 0; r0 < w->n_rows; r0 += 4) {
                const struct wtile wt = w_tile(w, K, r0);
                struct tile_job j = {xt + (size_t)s0 * Rt * 32 * esz,
                                     X + (size_t)m0 * ldx,
                                     ldx,
                                     &wt,
                                     s0,
                                     s1 - s0,
                                     K,
                                     kb == 0,
                                     kb == nkb - 1,
                                     sums + (size_t)(r0 / 4) * R * CMAX * 16,
                                     bias ? bias + r0 : NULL,
                                     Y + (size_t)m0 * ldy + r0,
                                     ldy};
                if (f == KV_BF16_AVX512) run_tile512(&j, Rt, wt.C);
                else run_tile256(&j, Rt, wt.C);
            }
        }
    }
    csr_leave(csr);
#else
    (void)sums;
#endif
}
