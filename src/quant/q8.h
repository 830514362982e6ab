/*
 * q8: the integer path for quantized weights. Activation rows are quantized to 8 bits (one
 * f32 scale per group of 32 or 256 elements) and multiplied with the packed weight blocks in
 * exact integer arithmetic; floats appear only once per group. This is the arithmetic class of
 * llama.cpp's CPU backend (activations as Q8_0 for Q8_0/Q4_0 weights, as Q8_K for the K-quants,
 * ggml-quants.c); the kernels, the lane layout and the float order below are kvserve's own.
 *
 * Weight types: Q8_0, Q4_0 (activation groups of 32) and Q4_K, Q5_K, Q6_K (groups of 256).
 * F32/F16/BF16 weights have no integer path (kv_q8_group returns 0): they stay on the f32
 * kernels (qdot.h, matmul.h).
 *
 * ACTIVATION QUANTIZATION (per row, per group of G = kv_q8_group(type) elements x[0..G)):
 *   amax = max |x[i]|;  d = amax / 127;  id = (amax > 0) ? 127 / amax : 0;
 *   q[i] = nearest-even integer to x[i] * id   (in [-127, 127]);  s16[j] = sum of q over
 *   elements 16j .. 16j+15 of the row; s32[j] = s16[2j] + s16[2j+1].
 * in IEEE binary32 (one division each for d and id, one rounding in x * id). A group holding a
 * NaN or an infinity gets d = NaN and q = 0, so every output that reads it is NaN.
 *
 * DOT CONTRACT (per output y = dot(activation row, weight row)); every integer sum is exact
 * (bounds in q8.c), floats are IEEE binary32, round to nearest; one float chain per output:
 *   acc = +0, mn = +0
 *   Q8_0 / Q4_0 (w = d_w * v; v = the int8 quant, or nibble - 8), block b of 32, in order:
 *     S = sum_{i<32} v[32b + i] * q[32b + i];   acc = fmaf((float)S, d_w[b] * d[b], acc)
 *   Q4_K / Q5_K (w = d_w*sc_j*v - dmin_w*m_j, v = 4/5-bit unsigned, sub-block j = 32 elements)
 *   and Q6_K (w = d_w*sc_j*(v - 32), sub-block j = 16 elements), super-block s of 256, in order:
 *     S = sum_j sc_j * sum_{e in sub-block j} u[e] * q[e]   (u = v, or v - 32 for Q6_K)
 *     acc = fmaf((float)S, d_w(s) * d[s], acc)
 *     Q4_K/Q5_K only: Mn = sum_{j<8} m_j * s32[8s + j];  mn = fmaf((float)Mn, dmin_w(s) * d[s], mn)
 *   y = acc (Q4_K/Q5_K: y = acc - mn).
 * (float)S rounds to nearest even where |S| > 2^24 (possible only for the K-quants). The
 * integer sums may be formed in any order (they are exact), so one output's bits are the same
 * whether its block sums come from a per-row SIMD reduction (decode), from an outer product over
 * 16 weight rows of a repacked panel (prefill), from AMX tiles, or from scalar C: every ISA
 * family gives identical bits, and the result depends on the activation row, the weight row
 * and K only (not on the batch, the tile, the panel or the thread split), so the engine's batch
 * invariance holds on this path too.
 *
 * Accuracy: the product of a weight row with an 8-bit activation row, like llama.cpp's; it is
 * not bitwise the f32 product with the dequantized weights (matmul.h's contract, kept by the
 * "f32" quantized-kernel mode, kv_matmul_set_qmode).
 *
 * Thread-safety: every function is pure (the ISA choice is kv_quant_get_isa()).
 */
#ifndef KV_QUANT_Q8_H
#define KV_QUANT_Q8_H

#include <stddef.h>
#include <stdint.h>

#include "quant.h"

/* Activation group size of the integer path for a weight type: 32 (Q8_0, Q4_0), 256 (Q4_K,
 * Q5_K, Q6_K), 0 when the type has none. */
int kv_q8_group(int type);

/* M quantized activation rows of K elements (K a multiple of the group). Views into memory
 * the caller owns (kv_q8_act_bytes / kv_q8_act_init lay it out). Row m: q + m * K (int8),
 * d + m * (K / group) (f32 scales), s16 + m * (K / 16) (int16 sums of 16 quants). */
struct kv_q8_act {
    int M, K, group;
    int8_t *q;
    float *d;
    int16_t *s16;
};

/* Bytes of the buffer for M rows of K with that group (alignment of 64 bytes is enough). */
size_t kv_q8_act_bytes(int M, int K, int group);
/* Lays out a at buf (kv_q8_act_bytes(M, K, group) bytes, 64-byte aligned). Returns -1 (a
 * untouched) when group is not 32 or 256, K is not a positive multiple of it, or M < 1. */
int kv_q8_act_init(struct kv_q8_act *a, void *buf, int M, int K, int group);
/* Quantizes rows m0 .. m0+n-1 of a from X (row m at X + (m - m0) * ldx, K floats) by the rule
 * above. Any ISA gives the same bytes. Thread-safe for disjoint row ranges. */
void kv_q8_quantize(struct kv_q8_act *a, int m0, int n, const float *X, size_t ldx);

/* Y[m * ldy + r] = dot(activation row m0 + m of a, weight row r), m < M, r < n_rows, by the
 * contract above. type: kv_q8_group(type) == a->group; w: n_rows packed rows, row r at
 * (const char *)w + r * row_bytes (row_bytes >= kv_qtype_row_bytes(type, a->K)). Y must not
 * overlap w or a. Invalid arguments (type without a path, group mismatch, M < 1, n_rows < 1,
 * rows out of a) write nothing. */
void kv_q8_dot_rows(int type, const void *w, size_t row_bytes, int n_rows, const struct kv_q8_act *a, int m0, int M,
                    float *Y, size_t ldy);

/* The contract literally, in scalar C (slow; the tests' reference). Same arguments. */
void kv_q8_dot_rows_ref(int type, const void *w, size_t row_bytes, int n_rows, const struct kv_q8_act *a, int m0,
                        int M, float *Y, size_t ldy);

/* ---- prefill: repacked panels ----
 * For many activation rows the weight rows are first repacked (kv_q8_pack) into a panel of
 * 16-row groups with the quants as int8 in VNNI order ([k/4][row][k%4]) and the scales, sums
 * and mins beside them, so that one 4-byte broadcast of an activation times one 64-byte vector
 * of weights adds 4 products to 16 outputs at once (vpdpbusd; AMX tiles where the CPU has
 * them). Same contract, same bits as kv_q8_dot_rows. */
/* Bytes of the panel of n_rows rows of K (K a multiple of kv_q8_group(type)); 0 if invalid. */
size_t kv_q8_pack_bytes(int type, int n_rows, int K);
/* Repacks n_rows rows (row r at w + r * row_bytes) into panel (kv_q8_pack_bytes bytes,
 * 64-byte aligned). Returns -1 (nothing written) for invalid arguments. */
int kv_q8_pack(int type, const void *w, size_t row_bytes, int n_rows, int K, void *panel);
/* Y[m * ldy + r] = dot(activation row m0 + m of a, row r of the panel), m < M, r < n_rows
 * (the n_rows and K given to kv_q8_pack; a->K == K). */
void kv_q8_dot_packed(int type, const void *panel, int n_rows, const struct kv_q8_act *a, int m0, int M, float *Y,
                      size_t ldy);

/* True when the ISA in effect has a packed kernel for `type` faster than kv_q8_dot_rows for
 * many rows (AMX, AVX512-VNNI, AVX2: every type); elsewhere
 * kv_q8_dot_packed runs scalar C and callers should not pack. */
int kv_q8_packed_fast(int type);
/* True when, for M activation rows of `type`, kv_q8_dot_rows over the stored rows beats
 * repacking them (kv_q8_pack) and running kv_q8_dot_packed in the ISA in effect, counting the
 * repack (the CPU matmul repacks a task's rows every call unless the matrix was repacked at
 * load): K-quants up to KV_Q8_ROWS_MAX_M rows on AVX2 and KV_Q8_ROWS_MAX_M_512 on AVX-512
 * without AMX, whose rows tiles stage each super-block's quants and scales once for all M rows
 * (bench_qdot --int8 --m, the "pack" column: Zen 5, K = 2048, AVX2 rows ahead up to M = 64,
 * AVX-512 VNNI up to 16). Same bits either way (the contract above). */
#define KV_Q8_ROWS_MAX_M 64
#define KV_Q8_ROWS_MAX_M_512 16
int kv_q8_rows_preferred(int type, int M);

/* The prefill kernel kv_q8_dot_packed uses now: "amx", "avx512-vnni", "avx2" or
 * "none" (scalar C; kv_q8_dot_rows serves all M then). Static string. */
const char *kv_q8_packed_name(void);

/* The one parser of KVSERVE_CPU_AMX: 1 when unset, empty or "1" (AMX allowed where the CPU and
 * the kernel have it), 0 for "0" (off), -1 for any other value (the CLIs refuse it at start;
 * the kernels then keep AMX allowed). Reads the environment each call. */
int kv_q8_amx_env(void);

/* Tests: 1 = use the AVX-512 kernels without VNNI, 2 = without AMX, 3 = neither, even where
 * the CPU has them (process-wide); 0 = the CPU's best. */
void kv_q8_set_limits(int bits);

#endif
