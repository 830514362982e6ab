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

#include <stdbool.h>
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

/* ---- the grouped layout of F32/F16/BF16 matrices (decode) ----
 * A decode tile reads 4-8 weight rows at once; in the packed layout that is 4-8 concurrent
 * streams, each a row long, and from one core the hardware prefetcher keeps fewer lines in
 * flight for them than for one long stream (1B F16 model: 14.4 GB/s against llama.cpp's 16.0,
 * which reads one row at a time; docs/benchmarks.md). In the grouped layout rows are taken
 * KV_FGROUP_ROWS at a time (the last group of a matrix may have fewer, nr) and interleaved in
 * 64-byte chunks:
 *   chunk c (bytes 64c .. 64c + 63) of row i of group g  is at  g * 4 * RB + (c * nr + i) * 64
 * with RB = the packed row's bytes. Same total size as the packed rows; the whole matrix is one
 * sequential stream. The kernels run one tile over all rows of a group (AVX-512: up to 4 X
 * rows at once; AVX2, 16 registers: one X row per pass, the group's later passes hit L1/L2):
 * a tile over part of a group would read every other run of lines, which measured slower than
 * the packed rows. 4 rows, not 8: AVX2 has the registers for a 4-row tile only. Only for K
 * with RB a multiple of 64 (kv_fgroup_ok). The arithmetic is qdot's contract on the same
 * floats: same bits as kv_qdot_rows on the packed rows (tested for every ISA).
 * The CPU backend repacks F16/BF16 matrices into this layout at load (struct kv_wmat.panel). */
#define KV_FGROUP_ROWS 4

/* True when type is F32, F16 or BF16 and a row of K elements is a positive multiple of 64
 * bytes, i.e. the grouped layout exists for it. */
bool kv_fgroup_ok(int type, int K);
/* Writes n_rows packed rows (row r at (const char *)w + r * row_bytes) in the grouped layout
 * at dst (n_rows * RB bytes; must not overlap w). Nothing written unless kv_fgroup_ok(type, K)
 * and n_rows >= 1. Pure; callers may pack disjoint groups from several threads. */
void kv_fgroup_pack(int type, const void *w, size_t row_bytes, int n_rows, int K, void *dst);
/* The n_rows rows in the grouped layout at g (a group start, as for kv_qdot_grouped),
 * dequantized: row r to out + r * ldo (K floats, bitwise kv_dequant_row of the packed row;
 * ldo >= K). The x86 families convert each 64-byte chunk straight into its row (about what
 * kv_dequant_row on the packed rows costs). Invalid arguments write nothing. Pure. */
void kv_fgroup_rows(int type, const void *g, int n_rows, int K, float *out, size_t ldo);
/* kv_qdot_rows on n_rows rows in the grouped layout, starting at g (a group start; every group
 * but the last of these n_rows rows holds KV_FGROUP_ROWS rows, as in a whole matrix or any
 * range of it starting at a multiple of KV_FGROUP_ROWS). Same arguments, contract and bits as
 * kv_qdot_rows on the packed rows; invalid arguments (!kv_fgroup_ok, M < 1, n_rows < 1) write
 * nothing. */
void kv_qdot_grouped(int type, const void *g, int n_rows, int K, const float *X, size_t ldx, int M, float *Y,
                     size_t ldy);

#endif
