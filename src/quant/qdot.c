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

static void gen_rows(int type, const uint8_t *w, size_t rb, int n_rows, int K, const float *X, size_t ldx, int M,
                     float *Y, size_t ldy) {
    const int blck = kv_qtype_block_elems(type);
    const size_t bb = kv_qtype_block_bytes(type);
    const int K16 = K - K % 16;
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *row = w + (size_t)r * rb;
        float lane[4][16], tail[16], buf[256];
        memset(lane, 0, sizeof lane);
        for (int k = 0; k < K; k += 256) {
            int n = K - k < 256 ? K - k : 256; /* a multiple of the block (256 is one of 32 and 256) */
            kv_dequant_row(type, row + (size_t)(k / blck) * bb, buf, n);
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

void kv_qdot_rows(int type, const void *w, size_t row_bytes, int n_rows, int K, const float *X, size_t ldx, int M,
                  float *Y, size_t ldy) {
    if (!kv_qtype_supported(type) || K < 0 || M < 1 || n_rows < 1) return;
    if (K % kv_qtype_block_elems(type)) return;
    kv_qdot_fn fn = gen_rows;
#ifdef KV_QUANT_X86
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX512: fn = kv_qdot_avx512; break;
    case KV_QUANT_ISA_AVX2: fn = kv_qdot_avx2; break;
    default: break;
    }
#endif
    for (int m0 = 0; m0 < M; m0 += 4)
        fn(type, w, row_bytes, n_rows, K, X + (size_t)m0 * ldx, ldx, M - m0 < 4 ? M - m0 : 4, Y + (size_t)m0 * ldy, ldy);
}
