/*
 * quant: the GGUF/ggml weight block formats kvserve computes with, and their dequantization.
 *
 * A weight matrix stays in the precision it is stored in (F32, F16, BF16, Q8_0, Q4_0, Q4_K,
 * Q5_K, Q6_K); kernels read its packed rows and dequantize on the fly. Type numbers are ggml's
 * (`enum ggml_type` in ggml.h; the GGUF tensor-info type field), so a GGUF tensor's type is
 * used as is. Block layouts follow ggml's docs and ggml-common.h (little-endian, packed):
 *
 *   type  elems/block  bytes/block  layout
 *   F32        1           4        float
 *   F16        1           2        IEEE binary16
 *   BF16       1           2        bfloat16 (upper half of a float)
 *   Q8_0      32          34        f16 d; int8 qs[32]                       x = d * q
 *   Q4_0      32          18        f16 d; u8 qs[16] (lo nibbles = elems 0..15,
 *                                   hi nibbles = 16..31)                      x = d * (q - 8)
 *   Q4_K     256         144        f16 d, dmin; u8 scales[12] (8 x 6-bit scale + 6-bit min);
 *                                   u8 qs[128]                                x = d*sc*q - dmin*m
 *   Q5_K     256         176        as Q4_K plus u8 qh[32] (5th bit)
 *   Q6_K     256         210        u8 ql[128], u8 qh[64], int8 scales[16], f16 d
 *                                                                             x = d * sc * (q - 32)
 *
 * BIT-EXACTNESS CONTRACT: kv_dequant_row gives, for every element, exactly the float that
 * llama.cpp's own dequantization (dequantize_row_* in ggml-quants.c) gives -- the files
 * models/tiny-quant/tiny-<T>.dequant-f32.gguf of the test data are that reference and
 * tests/unit/quant/test_quant.c compares every tensor of every file bitwise. The fast path
 * (vectorized per ISA) and the scalar reference give identical bits. The float operations per
 * type (and why they match) are listed at the top of quant.c. F16 converts exactly (subnormals,
 * +-0, +-inf); a NaN keeps sign and payload with the quiet bit set, like F16C's vcvtph2ps and
 * ggml (base's kv_f16_to_f32 keeps a signalling NaN signalling: the only difference).
 *
 * Thread-safety: call from any thread. Every function is pure except for the process-wide ISA
 * choice (kv_quant_set_isa; atomic, and every ISA gives the same bits).
 */
#ifndef KV_QUANT_H
#define KV_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ggml type numbers of the formats we compute with. */
enum kv_qtype {
    KV_QTYPE_F32 = 0,
    KV_QTYPE_F16 = 1,
    KV_QTYPE_Q4_0 = 2,
    KV_QTYPE_Q8_0 = 8,
    KV_QTYPE_Q4_K = 12,
    KV_QTYPE_Q5_K = 13,
    KV_QTYPE_Q6_K = 14,
    KV_QTYPE_BF16 = 30,
};

/* True for the types above (the ones kv_dequant_row accepts). */
bool kv_qtype_supported(int type);
/* "F32", "Q4_K", ... for any ggml type number (also unsupported ones, e.g. "Q2_K");
 * "unknown" for numbers ggml does not define. Static string. */
const char *kv_qtype_name(int type);
/* Elements per block (1, 32 or 256); 0 for an unsupported type. */
int kv_qtype_block_elems(int type);
/* Bytes per block (4, 2, 34, 18, 144, 176, 210); 0 for an unsupported type. */
size_t kv_qtype_block_bytes(int type);
/* Bytes of a row of n elements; 0 when the type is unsupported or n is not a multiple of
 * the block size (n >= 0). */
size_t kv_qtype_row_bytes(int type, int64_t n);

/* Dequantizes n elements (n a multiple of the block size, checked by the caller with
 * kv_qtype_row_bytes) from src (packed blocks, any alignment) into dst (n floats).
 * Bitwise equal to llama.cpp (see the contract above). Picks the best ISA of the CPU once;
 * KVSERVE_CPU_ISA (generic|avx2|avx512) restricts it like the matmul kernels. An
 * unsupported type writes nothing (callers check kv_qtype_supported first). */
void kv_dequant_row(int type, const void *src, float *dst, int64_t n);
/* Scalar transcription of the formats (slow; the tests' reference). Same contract. */
void kv_dequant_row_ref(int type, const void *src, float *dst, int64_t n);
/* (Both: n <= 0, or n not a multiple of the block size, also writes nothing.) */

/* ---- instruction set of kv_dequant_row (every set gives the same bits) ----
 * AUTO (the default) is the best set the CPU has (AVX-512 needs avx512f+bw+vl, AVX2 needs
 * avx2+fma+f16c), lowered to KVSERVE_CPU_ISA=generic|avx2|avx512 when that is set (read once,
 * on first use; another value is ignored). */
enum kv_quant_isa { KV_QUANT_ISA_AUTO = 0, KV_QUANT_ISA_GENERIC, KV_QUANT_ISA_AVX2, KV_QUANT_ISA_AVX512 };
/* Forces the set kv_dequant_row uses (tests and benchmarks: process-wide; set it before
 * starting work that calls kv_dequant_row -- threads racing with it see the old or the new set,
 * both correct). AUTO re-applies the default choice. A forced set the CPU lacks falls back to
 * the best one it has (KVSERVE_CPU_ISA does not limit a forced set). Returns the set now in
 * effect, so `kv_quant_set_isa(x) == x` tells whether x is available. */
enum kv_quant_isa kv_quant_set_isa(enum kv_quant_isa isa);
/* The set in effect now (never AUTO). */
enum kv_quant_isa kv_quant_get_isa(void);
/* The one parser of KVSERVE_CPU_ISA: AUTO when unset or empty, the set it names
 * (generic|avx2|avx512, any case), -1 for another value. Reads the environment each call. */
int kv_quant_isa_env(void);
/* "generic", "avx2", "avx512" ("auto" for AUTO). Static string. */
const char *kv_quant_isa_name(enum kv_quant_isa isa);

/* ---- software prefetch of data read once (the kernels' streams) ----
 * The decode kernels prefetch what they stream: the F16/BF16 weight panels and rows
 * (qdot_x86.c: group_prefetch, float_prefetch), the integer path's Q8_0 panel groups and file
 * rows (q8_x86_internal.h: prefetch_group_ahead, prefetch_share) and, in attention
 * (backend/cpu/attention.c: prefetch_rows), the K/V rows of the next positions. CACHE uses the
 * per-site hints tuned on a Sapphire Rapids core (prefetcht0 into L1 for the panels, prefetcht1
 * into L2 for rows and K/V); NTA uses prefetchnta at every one of these sites (the prefill
 * tiles' prefetches of data they re-read keep their hints). On a Zen 5 core the CACHE hints cost
 * bandwidth (in-process alternated runs: the 1B-shaped F16 panel stream 0.83x of no prefetch at
 * all, NTA ~1.0x; 8k-context decode attention 1.2-1.3x faster with NTA), so AUTO picks NTA on
 * AMD CPUs and CACHE elsewhere (docs/benchmarks.md, "Software prefetch per vendor").
 * KVSERVE_CPU_PREFETCH=auto|cache|nta (any case) overrides AUTO; it is read when AUTO is
 * resolved (the first use, or kv_quant_set_prefetch(AUTO)); another value counts as unset (the
 * CLIs refuse it first: kv_cpu_env_check). Prefetches only: every mode gives the same bits. */
enum kv_prefetch { KV_PREFETCH_AUTO = 0, KV_PREFETCH_CACHE, KV_PREFETCH_NTA };
/* Forces the mode (tests and benchmarks: process-wide, threads racing with it see the old or
 * the new mode, both correct); AUTO re-applies the default choice. Returns the mode now in
 * effect (never AUTO). */
enum kv_prefetch kv_quant_set_prefetch(enum kv_prefetch mode);
/* The mode in effect now (never AUTO); one relaxed atomic load after the first call, cheap
 * enough to read once per kernel call. */
enum kv_prefetch kv_quant_get_prefetch(void);
/* The one parser of KVSERVE_CPU_PREFETCH: AUTO when unset or empty, the mode it names, -1 for
 * another value. Reads the environment each call. */
int kv_quant_prefetch_env(void);
/* "auto", "cache", "nta". Static string. */
const char *kv_quant_prefetch_name(enum kv_prefetch mode);
/* The sites' one loop: prefetches the 64-byte lines of [p, p + bytes) with prefetchnta when nta
 * is true, else with locality LOC (a constant: 3 = prefetcht0, 2 = prefetcht1). */
#define KV_PREFETCH_RANGE(p, bytes, nta, LOC)                                                  \
    do {                                                                                     \
        const char *kv_pf_ = (const char *)(p);                                              \
        const size_t kv_pfn_ = (bytes);                                                      \
        if (nta)                                                                             \
            for (size_t o_ = 0; o_ < kv_pfn_; o_ += 64) __builtin_prefetch(kv_pf_ + o_, 0, 0);   \
        else                                                                                 \
            for (size_t o_ = 0; o_ < kv_pfn_; o_ += 64) __builtin_prefetch(kv_pf_ + o_, 0, LOC); \
    } while (0)

#endif
