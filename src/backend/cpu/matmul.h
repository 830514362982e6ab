/*
 * matmul: batch-invariant matrix product Y = X W^T (+ bias) with f32 activations and weights
 * in their stored precision (struct kv_wmat: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), the
 * CPU backend's kernel for every projection and the output head.
 *
 *   X: (M, K) activations, row-major, row stride K      W: (N, K) weight rows (out, in)
 *   Y: (M, N) row-major, row stride N                    bias: (N) or NULL
 *
 * INVARIANCE CONTRACT: Y[m][n] is a function of X[m][0..K), the dequantized row w = W[n]
 * (kv_dequant_row: bitwise llama.cpp's dequantization, src/quant/quant.h), bias[n] and K only.
 * It does not depend on M, on m (the row's position), on the other rows, on the blocking, on
 * the thread count or on which thread ran it, nor on the instruction set picked at run time
 * (AVX-512, AVX2 and generic give identical bits). Every element is computed as
 *
 *   K16 = K - K % 16
 *   lane[j] = 0;  for k = j, j+16, ..., < K16 (increasing):  lane[j] = fma(X[m][k], w[k], lane[j])
 *   s = tree(lane)      fixed pairwise tree: l8[j] = lane[j] + lane[j+8]  (j < 8),
 *                       l4[j] = l8[j] + l8[j+4], l2[j] = l4[j] + l4[j+2], s = l2[0] + l2[1]
 *   for k = K16 .. K-1:  s = fma(X[m][k], w[k], s)
 *   if (bias) s = s + bias[n]
 *   Y[m][n] = s
 *
 * in IEEE single precision, round-to-nearest, fma = one rounding (C fmaf). Because w is
 * exactly the dequantized float, a quantized model gives the same bits as the F32 model
 * that holds its dequantization (llama.cpp's `llama-quantize ... F32` output): tested. This
 * holds for F32/F16 weights always, for BF16 weights in the F32 BF16-matmul mode and for the
 * quantized types in the F32 quantized-matmul mode; the default INT8 mode (kv_matmul_set_quant
 * below) multiplies quantized weights with 8-bit activations under src/quant/q8.h's contract
 * instead, and the default BF16 mode (kv_matmul_set_bf16) BF16 weights with bf16 activations
 * under matmul_bf16.h's -- both equally batch- and ISA-invariant, within a tolerance of this
 * one.
 * kv_matmul_reference() is a scalar transcription of this order, used by the unit test.
 *
 * Kernels (one per ISA, each doing exactly the arithmetic above), for M > 4 (prefill): register
 * tiles of R X rows x C W rows, each accumulator the 16 lanes of one output: AVX-512 (32 zmm)
 * 8x3 tiles, one zmm per accumulator; AVX2 (16 ymm) 4x3 tiles of one ymm, run once per 8-lane
 * half of the 16 lanes (lanes 0-7 and 8-15 are independent lanes of the contract); generic:
 * scalar fmaf. K is cut into blocks of at most 768 floats so the X tile stays in L1 while the
 * task's W rows stream past it; between K blocks the 16 lanes are saved in a per-thread buffer
 * and reloaded (each lane still adds in increasing k), and after the last block a shuffle
 * network runs the fixed tree on 16 (AVX2: 8) outputs at once. The SIMD families read X packed
 * once per product (tile by tile, so each tile is one sequential stream; matmul_x86.c says why).
 * Work split: W is cut into blocks of rows (about half a core's L2 of f32, at most 1 MiB, so a
 * block stays in L2 while all rows use it; smaller for >= 4 tasks per thread) and every block
 * is one thread-pool task computing all M rows of its columns, so each output element is
 * computed entirely by one thread. INT8 mode, quantized
 * weights: the batch's activation rows are quantized once per distinct X (kv_q8_quantize), then
 * a task runs kv_q8_dot_rows on its rows (M <= 4, or no AMX/VNNI) or repacks them into a
 * per-thread panel (kv_q8_pack) and runs kv_q8_dot_packed (prefill); a matrix the CPU backend
 * repacked whole at load (struct kv_wmat.panel, Q8_0) goes to kv_q8_dot_packed for every M,
 * its tasks cut at 16-row groups. An F16/BF16 matrix the CPU backend repacked at load into
 * qdot.h's grouped layout (struct kv_wmat.panel) goes to kv_qdot_grouped when M <= 4, to the
 * AVX-512 family's grouped tiles (the weights widened in registers, tile512's order; 4 < M <=
 * 64) when the matrix's rows are a multiple of 4, and is converted to the task's f32 panel
 * by kv_fgroup_rows otherwise (more rows, the AVX2 and generic families, other row counts). Otherwise, when M <= 4
 * (decode; every weight type, F32 included) the task calls kv_qdot_rows (src/quant/qdot.h),
 * which dequantizes 16 weights at a time into registers and FMAs them at once (nothing
 * written but Y); for larger M and non-F32 weights the task dequantizes its block into a
 * per-thread f32 panel first (the dequantization is amortised over M rows). All follow the
 * contract above, so the split points change no bits.
 *
 * Example:
 *   kv_matmul_w(x, n_rows, &lw->wq, lw->bq, q, tp);  // q = x wq^T (+ bq), wq in any type
 */
#ifndef KV_BACKEND_CPU_MATMUL_H
#define KV_BACKEND_CPU_MATMUL_H

#include "../../base/threadpool.h"
#include "../../model/model.h"

/* One product of a batch (all pointers borrowed for the call). Y must not overlap X, W, bias.
 * N = W->rows, K = W->cols. */
struct kv_matmul_op {
    const float *X;             /* (M, K) */
    const struct kv_wmat *W;    /* (N, K), a supported type (kv_qtype_supported) */
    const float *bias;          /* (N) or NULL */
    float *Y;                   /* (M, N) */
    int M;                      /* >= 0 (K == 0 gives Y = bias or 0) */
};

/* Y = X W^T (+ bias) over the pool tp (NULL = the calling thread only). Cannot fail; a
 * weight type outside quant.h's set is a programming error (the loaders refuse it). */
void kv_matmul_w(const float *X, int M, const struct kv_wmat *W, const float *bias, float *Y, kv_threadpool_t *tp);
/* The same with an F32 weight matrix of N rows of K floats. */
void kv_matmul(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y,
               kv_threadpool_t *tp);
/* Runs n_ops independent products in one parallel-for (one wake-up of the pool instead of
 * n_ops): e.g. the Q, K and V projections of a layer. Each result is as from kv_matmul_w. */
void kv_matmul_batch(const struct kv_matmul_op *ops, int n_ops, kv_threadpool_t *tp);

/* Scalar transcription of the contract (slow; for tests). F32 weights, no pool. */
void kv_matmul_reference(const float *X, int M, int K, const float *W, int N, const float *bias, float *Y);

/* Instruction set of the kernels. AUTO (the default) picks the best one the CPU supports,
 * restricted by the environment variable KVSERVE_CPU_ISA=generic|avx2|avx512 when set (read
 * once, at the first use; an unknown value is ignored with a warning). Forcing one is for
 * tests and benchmarks only: it is process-wide and must not race with a running kv_matmul.
 * Returns the set now in effect (a forced set the CPU lacks falls back to AUTO's choice).
 * Also sets the dequantization kernels' ISA (kv_quant_set_isa) to the same family. */
enum kv_matmul_isa { KV_MATMUL_ISA_AUTO = 0, KV_MATMUL_ISA_GENERIC, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512 };
enum kv_matmul_isa kv_matmul_set_isa(enum kv_matmul_isa isa);
/* Parses KVSERVE_CPU_ISA (unset or empty: AUTO; generic|avx2|avx512, any case). KV_EINVAL
 * for another value, KV_EUNSUPPORTED for a family this CPU lacks (message in err); *out is
 * AUTO then. `kvserve serve` / `generate` / bench_engine call it at start and refuse to run on
 * an error, so a typo cannot silently benchmark the default kernels. */
kv_status kv_cpu_isa_env(enum kv_matmul_isa *out, char *err, size_t errlen);
/* The set in effect now (never AUTO: resolves it on first use). The attention kernels
 * (attention.h) follow it too. */
enum kv_matmul_isa kv_matmul_get_isa(void);
/* "avx512", "avx2" or "generic": the set kv_matmul uses now. */
const char *kv_matmul_isa_name(void);

/* How quantized weights (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) are multiplied; F32/F16/BF16 weights
 * always follow the INVARIANCE CONTRACT above.
 *   INT8 (the default): each activation row is quantized to 8 bits (one scale per 32 or 256
 *     elements) and multiplied with the packed blocks in integer arithmetic (src/quant/q8.h's
 *     contract; llama.cpp's arithmetic class): a few times fewer operations than dequantizing
 *     to f32. Y[m][n] is still a function of X[m], W[n] and K only (batch-, thread- and
 *     ISA-invariant, bitwise), within a tolerance of the f32 product (q8.h, docs).
 *   F32: the contract above with the exactly dequantized weights, so a quantized file gives
 *     bitwise the results of its dequant-F32 twin.
 * AUTO resolves to KVSERVE_CPU_QUANT_MATMUL=int8|f32 when set (read at first use), else
 * INT8. Process-wide; set it before work starts (tests flip it between runs). Returns the
 * mode now in effect. */
enum kv_matmul_quant { KV_MATMUL_QUANT_AUTO = 0, KV_MATMUL_QUANT_INT8, KV_MATMUL_QUANT_F32 };
enum kv_matmul_quant kv_matmul_set_quant(enum kv_matmul_quant q);
/* The mode in effect (never AUTO). */
enum kv_matmul_quant kv_matmul_get_quant(void);
/* "int8" / "f32". */
const char *kv_matmul_quant_name(enum kv_matmul_quant q);
/* How BF16 weights are multiplied (F32/F16 weights always follow the INVARIANCE CONTRACT above):
 *   BF16: the activations are rounded to bf16 and multiplied in pairs, llama.cpp's arithmetic
 *     class for BF16 files (its vec_dot_type): one `vdpbf16ps` does 32 products where an f32
 *     FMA does 16. Contract in matmul_bf16.h: batch-, thread- and ISA-invariant (the AVX2 and
 *     generic families emulate the instruction bit for bit), within the activations' rounding
 *     (relative 2^-9 a product) of the f32 product.
 *   F32: the contract above on the exactly widened weights (bitwise the F32 twin's results).
 * AUTO resolves to KVSERVE_CPU_BF16_MATMUL=bf16|f32 when set (read at first use), else to
 * kv_matmul_bf16_default() for the ISA family in effect at each product (so forcing
 * KVSERVE_CPU_ISA=avx2 on a Zen 5 runs what an AVX2 machine runs). Process-wide; set it before
 * work starts. Returns the mode now in effect. */
enum kv_matmul_bf16 { KV_MATMUL_BF16_AUTO = 0, KV_MATMUL_BF16_BF16, KV_MATMUL_BF16_F32 };
enum kv_matmul_bf16 kv_matmul_set_bf16(enum kv_matmul_bf16 m);
/* The mode AUTO picks now: BF16 where the kernels in effect run `vdpbf16ps` at twice the f32
 * FMA's products (the AVX-512 family on AMD CPUs with AVX512_BF16: Zen 4 / Zen 5), F32
 * elsewhere. Measured (docs/benchmarks.md): on a Zen 5 the BF16 mode's products run 1.5-1.8x
 * faster than f32; on an Intel Xeon with AVX512_BF16 + AMX (Sapphire Rapids class) prefill ran
 * at 0.6x (its vdpbf16ps does not outrun two FMAs); the AVX2 emulation runs prefill at 0.9x of
 * f32 and decode of a 768-wide model at 0.75x (its lanes' two dependent FMAs a step). */
enum kv_matmul_bf16 kv_matmul_bf16_default(void);
/* The mode in effect (never AUTO). */
enum kv_matmul_bf16 kv_matmul_get_bf16(void);
/* "bf16" / "f32". */
const char *kv_matmul_bf16_name(enum kv_matmul_bf16 m);
/* Parses "auto" / "bf16" / "f32" (any case): KV_EINVAL with a message naming s otherwise. */
kv_status kv_matmul_bf16_parse(const char *s, enum kv_matmul_bf16 *out, char *err, size_t errlen);
/* The kernels BF16 weights run on now: in BF16 mode its family, "avx512-bf16" (vdpbf16ps),
 * "avx2-emul" (AVX2, or an AVX-512 CPU without AVX512_BF16) or "generic"; in F32 mode
 * "f32 kernels" (the float tiles named by kv_matmul_isa_name). */
const char *kv_matmul_bf16_family_name(void);

/* Checks the CPU kernel environment variables a CLI honours -- KVSERVE_CPU_ISA (kv_cpu_isa_env),
 * KVSERVE_CPU_QUANT_MATMUL (int8|f32), KVSERVE_CPU_BF16_MATMUL (auto|bf16|f32), KVSERVE_CPU_AMX (0|1), KVSERVE_CPU_PREPACK,
 * KVSERVE_CPU_THP and KVSERVE_CPU_PANEL_THP (0|1), KVSERVE_CPU_FLOAT_LAYOUT (rows|grouped; backend.h),
 * KVSERVE_CPU_PREFETCH (auto|cache|nta; quant.h) -- so that `kvserve serve`,
 * `generate` and bench_engine refuse a typo at start instead of running other kernels than
 * asked. KV_EINVAL / KV_EUNSUPPORTED with a message naming the variable; changes nothing. */
kv_status kv_cpu_env_check(char *err, size_t errlen);
/* Parses "int8" / "f32" (any case): KV_EINVAL with a message naming s otherwise. */
kv_status kv_matmul_quant_parse(const char *s, enum kv_matmul_quant *out, char *err, size_t errlen);

#endif
