/*
 * matmul_bf16: BF16 weights times bf16-rounded activations, the CPU matmul's BF16 mode
 * (matmul.h: kv_matmul_set_bf16, `--bf16-matmul bf16`). Internal to the CPU backend.
 *
 * ARITHMETIC CONTRACT (BF16 mode; replaces matmul.h's INVARIANCE CONTRACT for BF16 weights):
 *   xb[k] = kv_bf16_round(X[m][k])       round to nearest even; a subnormal gives a signed
 *                                        zero; a NaN stays a (quiet) NaN
 *   K32 = K - K % 32
 *   lane[j] = +0 (j < 16); for k0 = 0, 32, ..., < K32 (increasing):
 *       lane[j] = F(xb[k0 + 2j + 1], w[k0 + 2j + 1], lane[j])
 *       lane[j] = F(xb[k0 + 2j],     w[k0 + 2j],     lane[j])
 *   s = tree(lane)                       matmul.h's fixed tree, each addition A(a, b)
 *   for k = K32 .. K-1:  s = F(xb[k], w[k], s)
 *   if (bias) s = A(s, bias[n]);   Y[m][n] = s
 * where w is the BF16 row widened exactly, F(a, b, c) = ftz(fmaf(daz(a), daz(b), daz(c))) and
 * A(a, b) = ftz(daz(a) + daz(b)) (daz: a subnormal input becomes a zero of the same sign; ftz: a
 * tiny result does, tininess detected after rounding as x86 does, so an exact value just below
 * 2^-126 that rounds up to it is flushed too; F rounds once): every operation of the mode
 * flushes subnormals. F is what one step of `vdpbf16ps` does (Intel SDM,
 * VDPBF16PS: "FP32 FMA with daz in, ftz out and RNE rounding", the odd pair first), so the
 * AVX-512 BF16 family runs it in hardware: one instruction does 32 products of a row pair,
 * twice the f32 FMA's 16. The SIMD families run a whole call under MXCSR.DAZ|FTZ (set and
 * restored on the calling thread), so their tree, tail and bias follow A and F, and the AVX2
 * family (also what AVX-512 CPUs without AVX512_BF16 run) emulates the instruction with
 * vfmadd231ps; generic applies daz / ftz explicitly around fmaf and +. Checked against the instruction on an AMD Zen 5 (48 M random lanes, subnormals
 * and mixed exponents: all equal; NaN payloads may differ, as elsewhere in matmul.h) and by
 * tests/unit/backend/test_matmul_bf16.c on every family the machine has.
 * So Y[m][n] depends on X[m], the row W[n], bias[n] and K only: not on M, the row's position,
 * the blocking, the thread or the ISA family (bitwise). Against the f32 contract it differs by
 * the activations' rounding to 8 significant bits (relative error of a product <= 2^-9; the
 * products are exact): docs/benchmarks.md gives the logit differences measured.
 *
 * Weights: a task's n_rows rows either in the file's layout (row r at w + r * row_bytes) or
 * in qdot.h's grouped layout (w at a group start; 4-row groups of 64-byte chunks, the last
 * group may be shorter; only for K a multiple of 32). Tiles read 64-byte chunks (32 weights of
 * one row) with one load each.
 *
 * Thread-safety: pure functions of their arguments; call from any number of threads on
 * disjoint Y and sums.
 */
#ifndef KV_BACKEND_CPU_MATMUL_BF16_H
#define KV_BACKEND_CPU_MATMUL_BF16_H

#include <stddef.h>
#include <stdint.h>

/* Kernel families of BF16 mode (KV_BF16_AVX512: needs AVX512_BF16; KV_BF16_AVX2: AVX2 + FMA,
 * also what an AVX-512 CPU without AVX512_BF16 runs). */
enum kv_bf16_family { KV_BF16_GENERIC = 0, KV_BF16_AVX2, KV_BF16_AVX512 };

/* The family for the matmul ISA isa (enum kv_matmul_isa's value: 1 generic, 2 avx2, 3 avx512;
 * anything else generic) on this CPU. */
enum kv_bf16_family kv_bf16_family_for(int isa);
/* "avx512-bf16", "avx2-emul", "generic". */
const char *kv_bf16_family_name(enum kv_bf16_family f);

/* bf16 bits of x under the contract's rounding. */
static inline uint16_t kv_bf16_round(float x) {
    union { float f; uint32_t u; } v = {x};
    uint32_t e = (v.u >> 23) & 0xff;
    if (e == 0xff) return (uint16_t)((v.u >> 16) | ((v.u & 0x7fffff) ? 0x40 : 0)); /* inf; NaN quieted */
    if (e == 0) return (uint16_t)((v.u >> 16) & 0x8000);                          /* zero, subnormal */
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

/* Bytes of the packed activations of M rows of K for family f (0 for generic, which reads X in
 * place). */
size_t kv_bf16_xpack_bytes(enum kv_bf16_family f, int M, int K);
/* Packs X (M rows, row m at X + m * ldx) for family f into xp (kv_bf16_xpack_bytes, 64-byte
 * aligned): the rounded activations in the order the family's tiles read them. Nothing for
 * generic. Pure. */
void kv_bf16_pack_x(enum kv_bf16_family f, const float *X, size_t ldx, int M, int K, void *xp);

/* Floats of the per-thread partial-sum buffer kv_bf16_cols needs for n_rows rows. */
size_t kv_bf16_sums_floats(enum kv_bf16_family f, int M, int K, int n_rows);

/* A task's weight rows (borrowed). */
struct kv_bf16_w {
    const void *w;    /* row 0 (file layout) or a group start (grouped) */
    size_t row_bytes; /* file layout: bytes from one row to the next (>= 2K); grouped: ignored */
    int grouped;      /* qdot.h's grouped layout (then K % 32 == 0) */
    int n_rows;       /* >= 1 */
};

/* Y[m * ldy + r] = the contract for X row m and weight row r (+ bias[r] when bias), m < M,
 * r < w->n_rows. xp: kv_bf16_pack_x's output for the same X (NULL for generic), X: the f32
 * rows (row m at X + m * ldx; read for the K % 32 tail and by generic). sums:
 * kv_bf16_sums_floats floats, 64-byte aligned, scratch. M >= 1, K >= 1. Cannot fail. */
void kv_bf16_cols(enum kv_bf16_family f, const void *xp, const float *X, size_t ldx, int M, int K,
                  const struct kv_bf16_w *w, const float *bias, float *Y, size_t ldy, float *sums);

/* The contract, scalar, on file-layout rows (tests). */
void kv_bf16_reference(const float *X, size_t ldx, int M, int K, const uint16_t *W, size_t ldw, int N,
                       const float *bias, float *Y, size_t ldy);

#endif
