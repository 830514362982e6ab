/*
 * qdot: argument checks, the generic (scalar fmaf) kernel and the per-ISA dispatch of
 * kv_qdot_rows (qdot.h). The AVX2 / AVX-512 kernels are in qdot_x86.c.
 *
 * The generic kernel dequantizes 256 elements at a time with kv_dequant_row into a stack
 * buffer and runs the contract's 16 lanes in scalar fmaf: slow, but the same bits.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "qdot.h"
#include "qdot_internal.h"

#include <math.h>
#include <string.h>

/* the byte size of one element of a float type (F32/F16/BF16), 0 for the block types */
static size_t float_elt(int type) {
    return type == KV_QTYPE_F32 ? 4 : type == KV_QTYPE_F16 || type == KV_QTYPE_BF16 ? 2 : 0;
}

static void gen_rows(int type, const uint8_t *w, size_t rb, size_t cs, int n_rows, int K, const float *X, size_t ldx,
                     int M, float *Y, size_t ldy) {
    const int blck = kv_qtype_block_elems(type);
    const size_t bb = kv_qtype_block_bytes(type), elt = float_elt(type);
    const int K16 = K - K % 16;
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *row = w + (size_t)r * rb;
        float lane[4][16], tail[16], buf[256];
        uint8_t gather[1024]; /* 256 elements of at most 4 bytes, from the chunks of a grouped row */
        memset(lane, 0, sizeof lane);
        for (int k = 0; k < K; k += 256) {
            int n = K - k < 256 ? K - k : 256; /* a multiple of the block (256 is one of 32 and 256) */
            if (elt && cs != 64) { /* grouped layout: k is a multiple of 256, so of a chunk */
                size_t b0 = (size_t)k * elt, nbytes = (size_t)n * elt;
                for (size_t o = 0; o < nbytes; o += 64) memcpy(gather + o, row + ((b0 + o) / 64) * cs, 64);
                kv_dequant_row(type, gather, buf, n);
            } else {
                kv_dequant_row(type, row + (size_t)(k / blck) * bb, buf, n);
            }
            for (int i = 0; i < n; i++) {
                int kk = k + i;
                if (kk >= K16) {
                    tail[kk - K16] = buf[i];
                    continue;
                }
                for (int m = 0; m < M; m++) lane[m][kk & 15] = fmaf(X[(size_t)m * ldx + kk], buf[i], lane[m][kk & 15]);
            }
        }
        for (int m = 0; m < M; m++) {
            float l8[8], l4[4], l2[2];
            for (int j = 0; j < 8; j++) l8[j] = lane[m][j] + lane[m][j + 8];
            for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
            for (int j = 0; j < 2; j++) l2[j] = l4[j] + l4[j + 2];
            float s = l2[0] + l2[1];
            for (int k = K16; k < K; k++) s = fmaf(X[(size_t)m * ldx + k], tail[k - K16], s);
            Y[(size_t)m * ldy + r] = s;
        }
    }
}

static kv_qdot_fn pick_fn(void) {
#ifdef KV_QUANT_X86
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX512: return kv_qdot_avx512;
    case KV_QUANT_ISA_AVX2: return kv_qdot_avx2;
    default: break;
    }
#endif
    return gen_rows;
}

void kv_qdot_rows(int type, const void *w, size_t row_bytes, int n_rows, int K, const float *X, size_t ldx, int M,
                  float *Y, size_t ldy) {
    if (!kv_qtype_supported(type) || K < 0 || M < 1 || n_rows < 1) return;
    if (K % kv_qtype_block_elems(type)) return;
    kv_qdot_fn fn = pick_fn();
    for (int m0 = 0; m0 < M; m0 += 4)
        fn(type, w, row_bytes, 64, n_rows, K, X + (size_t)m0 * ldx, ldx, M - m0 < 4 ? M - m0 : 4, Y + (size_t)m0 * ldy,
           ldy);
}

bool kv_fgroup_ok(int type, int K) {
    size_t elt = float_elt(type);
    return elt && K > 0 && ((size_t)K * elt) % 64 == 0;
}

void kv_fgroup_pack(int type, const void *w, size_t row_bytes, int n_rows, int K, void *dst) {
    if (!kv_fgroup_ok(type, K) || n_rows < 1 || !w || !dst) return;
    const size_t RB = (size_t)K * float_elt(type), nc = RB / 64;
    for (int g0 = 0; g0 < n_rows; g0 += KV_FGROUP_ROWS) {
        int nr = n_rows - g0 < KV_FGROUP_ROWS ? n_rows - g0 : KV_FGROUP_ROWS;
        uint8_t *gd = (uint8_t *)dst + (size_t)g0 * RB;
        for (size_t c = 0; c < nc; c++)
            for (int i = 0; i < nr; i++)
                memcpy(gd + (c * (size_t)nr + (size_t)i) * 64, (const uint8_t *)w + (size_t)(g0 + i) * row_bytes + c * 64,
                       64);
    }
}

void kv_fgroup_rows(int type, const void *g, int n_rows, int K, float *out, size_t ldo) {
    if (!kv_fgroup_ok(type, K) || !g || !out || n_rows < 1 || ldo < (size_t)K) return;
#ifdef KV_QUANT_X86
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX512: kv_fgroup_rows_avx512(type, g, n_rows, K, out, ldo); return;
    case KV_QUANT_ISA_AVX2: kv_fgroup_rows_avx2(type, g, n_rows, K, out, ldo); return;
    default: break;
    }
#endif
    /* generic: chunk by chunk (kv_dequant_row is exact, so the same floats as the x86 paths) */
    const size_t elt = float_elt(type), RB = (size_t)K * elt, per = 64 / elt; /* per: floats a chunk */
    for (int g0 = 0; g0 < n_rows; g0 += KV_FGROUP_ROWS) {
        const int nr = n_rows - g0 < KV_FGROUP_ROWS ? n_rows - g0 : KV_FGROUP_ROWS;
        const uint8_t *b = (const uint8_t *)g + (size_t)g0 * RB;
        for (size_t c = 0; c < RB / 64; c++)
            for (int i = 0; i < nr; i++, b += 64)
                kv_dequant_row(type, b, out + (size_t)(g0 + i) * ldo + c * per, (int64_t)per);
    }
}

void kv_qdot_grouped(int type, const void *g, int n_rows, int K, const float *X, size_t ldx, int M, float *Y,
                     size_t ldy) {
    if (!kv_fgroup_ok(type, K) || M < 1 || n_rows < 1 || !g) return;
    kv_qdot_fn fn = pick_fn();
    const size_t RB = (size_t)K * float_elt(type);
    for (int g0 = 0; g0 < n_rows; g0 += KV_FGROUP_ROWS) {
        int nr = n_rows - g0 < KV_FGROUP_ROWS ? n_rows - g0 : KV_FGROUP_ROWS;
        const uint8_t *gp = (const uint8_t *)g + (size_t)g0 * RB;
        for (int m0 = 0; m0 < M; m0 += 4)
            fn(type, gp, 64, (size_t)nr * 64, nr, K, X + (size_t)m0 * ldx, ldx, M - m0 < 4 ? M - m0 : 4,
               Y + (size_t)m0 * ldy + g0, ldy);
    }
}
