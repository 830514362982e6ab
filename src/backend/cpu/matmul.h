/*
 * matmul: batch-invariant f32 matrix product Y = X W^T (+ bias), the CPU backend's kernel for
 * every projection and the output head.
 *
 *   X: (M, K) activations, row-major, row stride K      W: (N, K) weight rows (out, in)
 *   Y: (M, N) row-major, row stride N                    bias: (N) or NULL
 *
 * INVARIANCE CONTRACT: Y[m][n] is a function of X[m][0..K), W[n][0..K), bias[n] and K only.
 * It does not depend on M, on m (the row's position), on the other rows, on the blocking, on
 * the thread count or on which thread ran it, nor on the instruction set picked at run time
 * (AVX-512, AVX2 and generic builds give identical bits). Every element is computed as
 *
 *   K16 = K - K % 16
 *   lane[j] = 0;  for k = j, j+16, ..., < K16 (increasing):  lane[j] = lane[j] + X[m][k]*W[n][k]
 *   s = tree(lane)      fixed pairwise tree: l8[j] = lane[j] + lane[j+8]  (j < 8),
 *                       l4[j] = l8[j] + l8[j+4], l2[j] = l4[j] + l4[j+2], s = l2[0] + l2[1]
 *   for k = K16 .. K-1:  s = s + X[m][k]*W[n][k]
 *   if (bias) s = s + bias[n]
 *   Y[m][n] = s
 *
 * in IEEE single precision with round-to-nearest, every product rounded before its add (no
 * fused multiply-add: the file is compiled with -std=c11, i.e. -ffp-contract=off, and the
 * kernel never calls fma). kv_matmul_reference() is a scalar transcription of exactly this
 * order, used by the unit test to prove it.
 *
 * Work split: W is cut into blocks of rows (about 192 KiB, so a block stays in L2 while all
 * rows use it; smaller when needed for >= 4 tasks per thread) and every block is one
 * thread-pool task that computes all M rows of its columns, so each output element is
 * computed entirely by one thread. Register tiles: 4 X rows x 4 W rows (16 accumulators),
 * edges Rx4 / Rx1 for R = 2, 3, 4 leftover rows; a lone row (M == 1, decode) streams W one
 * row at a time, at close to memory bandwidth. All tiles do the same per-element arithmetic.
 *
 * Example:
 *   kv_matmul(x, n_rows, dim, wq, q_dim, NULL, q, tp);  // q = x wq^T
 */
#ifndef KV_BACKEND_CPU_MATMUL_H
#define KV_BACKEND_CPU_MATMUL_H

#include "../../base/threadpool.h"

/* One product of a batch (all pointers borrowed for the call). Y must not overlap X, W, bias. */
struct kv_matmul_op {
    const float *X;    /* (M, K) */
    const float *W;    /* (N, K) */
    const float *bias; /* (N) or NULL */
    float *Y;          /* (M, N) */
    int M, N, K;       /* M >= 0, N >= 0, K >= 0 (K == 0 gives Y = bias or 0) */
};

/* Y = X W^T (+ bias) over the pool tp (NULL = the calling thread only). Cannot fail. */
void kv_matmul(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y,
               kv_threadpool_t *tp);
/* Runs n_ops independent products in one parallel-for (one wake-up of the pool instead of
 * n_ops): e.g. the Q, K and V projections of a layer. Each result is as from kv_matmul. */
void kv_matmul_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp);

/* Scalar transcription of the contract (slow; for tests). Same signature as kv_matmul, no pool. */
void kv_matmul_reference(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y);

/* Instruction set of the kernel. AUTO (the default) picks the best one the CPU supports.
 * Forcing one is for tests and benchmarks only: it is process-wide and must not race with a
 * running kv_matmul. Returns the set now in effect (a forced set the CPU lacks falls back to
 * AUTO's choice). */
enum kv_matmul_isa { KV_MATMUL_ISA_AUTO = 0, KV_MATMUL_ISA_GENERIC, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512 };
enum kv_matmul_isa kv_matmul_set_isa(enum kv_matmul_isa isa);
/* "avx512", "avx2" or "generic": the set kv_matmul uses now. */
const char *kv_matmul_isa_name(void);

#endif
