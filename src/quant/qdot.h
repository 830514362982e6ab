/*
 * qdot: fused dequantize-and-dot kernels for decode (a few activation rows against packed
 * GGUF weight rows), the M <= 4 path of the CPU matmul (src/backend/cpu/matmul.h).
 *
 *   Y[m * ldy + r] = dot(X[m * ldx + 0 .. K), dequant(row r of w))   m < M, r < n_rows
 *
 * ARITHMETIC CONTRACT (matmul.h's INVARIANCE CONTRACT, without bias): with w = the row as
 * kv_dequant_row gives it (bitwise llama.cpp's dequantization, quant.h), K16 = K - K % 16,
 *   lane[j] = +0; for k = j, j+16, ... < K16 (increasing): lane[j] = fmaf(X[m][k], w[k], lane[j])
 *   l8[j] = lane[j] + lane[j+8]  (j < 8), l4[j] = l8[j] + l8[j+4], l2[j] = l4[j] + l4[j+2],
 *   s = l2[0] + l2[1];  for k = K16 .. K-1: s = fmaf(X[m][k], w[k], s);  Y = s
 * in IEEE binary32, round to nearest. Every ISA (generic scalar fmaf; AVX2+FMA+F16C: a
 * 16-lane accumulator as two ymm; AVX-512: one zmm) gives identical bits, equal to
 * kv_dequant_row + kv_matmul_reference on the dequantized floats (tests/unit/quant/
 * test_qdot.c). Each dequantized 16-float chunk lives in registers only: nothing is written
 * but Y. The result depends on X[m], the row and K only (not on M, n_rows, the strides,
 * the grouping of rows in the kernel or the ISA). Non-finite weights/activations: the same
 * NaN/inf-ness as the contract; a NaN's payload may differ between ISAs (as in matmul).
 *
 * ISA: kv_quant_get_isa() at each call (quant.h: KVSERVE_CPU_ISA, kv_quant_set_isa).
 * Thread-safety: pure; call from any number of threads on disjoint Y.
 */
#ifndef KV_QUANT_QDOT_H
#define KV_QUANT_QDOT_H

#include <stddef.h>

#include "quant.h"

/* type: a kv_qtype_supported type. w: n_rows packed rows, row r at (const char *)w + r *
 * row_bytes (row_bytes >= kv_qtype_row_bytes(type, K); any alignment). K >= 0, a multiple
 * of the type's block (32 or 256 for the block types; F32/F16/BF16: any K). X: M rows of K
 * floats, row m at X + m * ldx (ldx >= K; any alignment). Y: row m at Y + m * ldy, elements
 * 0 .. n_rows-1 written (ldy >= n_rows; must not overlap w or X). M >= 1 (any M: handled
 * 4 rows at a time; M <= 4 is the case it is built for). n_rows >= 1.
 * Invalid arguments (unsupported type, K not a multiple of the block, K < 0, M < 1,
 * n_rows < 1) write nothing: callers check kv_qtype_row_bytes first. */
void kv_qdot_rows(int type, const void *w, size_t row_bytes, int n_rows, int K, const float *X, size_t ldx, int M,
                  float *Y, size_t ldy);

#endif
