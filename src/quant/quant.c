/*
 * quant: type table, the scalar reference dequantizers, the generic (plain C) fast path and
 * the per-ISA dispatch. The AVX2 / AVX-512 kernels are in quant_x86.c.
 *
 * Float operations, per element, as llama.cpp's dequantize_row_* (ggml-quants.c) performs
 * them; checked bitwise against llama.cpp's output (tests/unit/quant/test_quant.c):
 *   F16   exact conversion              BF16  bits << 16             F32  copy
 *   Q8_0  (float)q * d                  Q4_0  (float)(q - 8) * d
 *   Q4_K  d1 = d * sc, m1 = dmin * m (each rounded to float), x = d1 * (float)q - m1
 *   Q5_K  as Q4_K with q = low nibble + 16 * high bit
 *   Q6_K  ds = d * sc (rounded), x = ds * (float)(q - 32)
 * Q4_K/Q5_K: d1 * q is always exact (11 + 6 + 5 significant bits), so the result is the one
 * rounding of the subtraction whether or not a compiler fuses it (llama.cpp's files agree with
 * both); we keep mul and sub separate (the literal C). Q6_K: the association matters
 * ((d * sc) * q, not d * (sc * q): the latter differs from llama.cpp in ~1.4% of elements).
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "quant_internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- type table ---- */

static const char *const k_names[] = {
    [0] = "F32",      [1] = "F16",     [2] = "Q4_0",     [3] = "Q4_1",    [6] = "Q5_0",
    [7] = "Q5_1",     [8] = "Q8_0",    [9] = "Q8_1",     [10] = "Q2_K",   [11] = "Q3_K",
    [12] = "Q4_K",    [13] = "Q5_K",   [14] = "Q6_K",    [15] = "Q8_K",   [16] = "IQ2_XXS",
    [17] = "IQ2_XS",  [18] = "IQ3_XXS", [19] = "IQ1_S",  [20] = "IQ4_NL", [21] = "IQ3_S",
    [22] = "IQ2_S",   [23] = "IQ4_XS", [24] = "I8",      [25] = "I16",    [26] = "I32",
    [27] = "I64",     [28] = "F64",    [29] = "IQ1_M",   [30] = "BF16",   [34] = "TQ1_0",
    [35] = "TQ2_0",   [39] = "MXFP4",  [40] = "NVFP4",    [41] = "Q1_0",   [42] = "Q2_0",
};

struct qinfo {
    int slot; /* KV_DQ_* */
    int blck;
    size_t bytes;
};

/* -1 slot: unsupported */
static struct qinfo qinfo(int type) {
    switch (type) {
    case KV_QTYPE_F32: return (struct qinfo){KV_DQ_F32, 1, 4};
    case KV_QTYPE_F16: return (struct qinfo){KV_DQ_F16, 1, 2};
    case KV_QTYPE_BF16: return (struct qinfo){KV_DQ_BF16, 1, 2};
    case KV_QTYPE_Q8_0: return (struct qinfo){KV_DQ_Q8_0, 32, 34};
    case KV_QTYPE_Q4_0: return (struct qinfo){KV_DQ_Q4_0, 32, 18};
    case KV_QTYPE_Q4_K: return (struct qinfo){KV_DQ_Q4_K, 256, 144};
    case KV_QTYPE_Q5_K: return (struct qinfo){KV_DQ_Q5_K, 256, 176};
    case KV_QTYPE_Q6_K: return (struct qinfo){KV_DQ_Q6_K, 256, 210};
    default: return (struct qinfo){-1, 0, 0};
    }
}

bool kv_qtype_supported(int type) { return qinfo(type).slot >= 0; }

const char *kv_qtype_name(int type) {
    if (type < 0 || (size_t)type >= sizeof k_names / sizeof k_names[0] || !k_names[type]) return "unknown";
    return k_names[type];
}

int kv_qtype_block_elems(int type) { return qinfo(type).blck; }
size_t kv_qtype_block_bytes(int type) { return qinfo(type).bytes; }

size_t kv_qtype_row_bytes(int type, int64_t n) {
    struct qinfo q = qinfo(type);
    if (q.slot < 0 || n < 0 || n % q.blck) return 0;
    uint64_t nb = (uint64_t)n / (uint64_t)q.blck;
    if (nb > SIZE_MAX / q.bytes) return 0;
    return (size_t)nb * q.bytes;
}

/* ---- scalar reference: one element at a time, the formats as ggml documents them ---- */

static void ref_f32(const void *src, float *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }

static void ref_f16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) dst[i] = kv_quant_h2f(kv_quant_ld16(p + 2 * i));
}

static void ref_bf16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)kv_quant_ld16(p + 2 * i) << 16;
        memcpy(&dst[i], &bits, 4);
    }
}

/* Q8_0 block: f16 d; int8 q[32]. x[j] = q[j] * d. */
static void ref_q8_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 34, dst += 32) {
        float d = kv_quant_h2f(kv_quant_ld16(b));
        for (int j = 0; j < 32; j++) dst[j] = (float)(int8_t)b[2 + j] * d;
    }
}

/* Q4_0 block: f16 d; u8 qs[16]. x[j] = (lo nibble of qs[j] - 8) * d, x[j+16] = (hi - 8) * d. */
static void ref_q4_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 18, dst += 32) {
        float d = kv_quant_h2f(kv_quant_ld16(b));
        for (int j = 0; j < 32; j++) {
            uint8_t byte = b[2 + (j & 15)];
            int q = (j < 16 ? byte & 0x0f : byte >> 4) - 8;
            dst[j] = (float)q * d;
        }
    }
}

/* Q4_K block: f16 d, dmin; scales[12]; qs[128]. 8 sub-blocks of 32: sub-block s uses
 * qs[32*(s/2) ..] low nibbles (s even) or high nibbles (s odd). Q5_K: scales, qh[32], qs[128];
 * element l of sub-block s gets +16 when bit s of qh[l] is set. */
static void ref_qk45(const uint8_t *b, float *dst, int64_t nb, bool q5) {
    for (int64_t i = 0; i < nb; i++, b += q5 ? 176 : 144, dst += 256) {
        float d = kv_quant_h2f(kv_quant_ld16(b));
        float dmin = kv_quant_h2f(kv_quant_ld16(b + 2));
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (q5 ? 48 : 16);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            kv_quant_scale_min_k4(s, scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                uint8_t byte = qs[32 * (s / 2) + l];
                int q = s & 1 ? byte >> 4 : byte & 0x0f;
                if (q5 && (qh[l] >> s & 1)) q += 16;
                dst[32 * s + l] = d1 * (float)q - m1;
            }
        }
    }
}
static void ref_q4_k(const void *src, float *dst, int64_t nb) { ref_qk45(src, dst, nb, false); }
static void ref_q5_k(const void *src, float *dst, int64_t nb) { ref_qk45(src, dst, nb, true); }

/* Q6_K block: ql[128], qh[64], int8 scales[16], f16 d. Element e = 128*h + 32*g + l
 * (h 0..1, g 0..3, l 0..31): low 4 bits from ql[64*h + 32*(g&1) + l] (low nibble for g < 2,
 * high for g >= 2), high 2 bits = bits 2g..2g+1 of qh[32*h + l]; scale scales[8*h + 2*g + l/16];
 * x = (d * scale) * (q - 32). */
static void ref_q6_k(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 210, dst += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = kv_quant_h2f(kv_quant_ld16(b + 208));
        for (int e = 0; e < 256; e++) {
            int h = e / 128, g = e % 128 / 32, l = e % 32;
            uint8_t lb = ql[64 * h + 32 * (g & 1) + l];
            int lo = g < 2 ? lb & 0x0f : lb >> 4;
            int hi = qh[32 * h + l] >> (2 * g) & 3;
            int q = (lo | hi << 4) - 32;
            float ds = d * (float)sc[8 * h + 2 * g + l / 16];
            dst[e] = ds * (float)q;
        }
    }
}

static const struct kv_dq_table k_ref = {{
    [KV_DQ_F32] = ref_f32, [KV_DQ_F16] = ref_f16, [KV_DQ_BF16] = ref_bf16, [KV_DQ_Q8_0] = ref_q8_0,
    [KV_DQ_Q4_0] = ref_q4_0, [KV_DQ_Q4_K] = ref_q4_k, [KV_DQ_Q5_K] = ref_q5_k, [KV_DQ_Q6_K] = ref_q6_k,
}};

/* ---- generic fast path: plain C, block at a time, inner loops the compiler can vectorize
 * (SSE2 on baseline x86-64); same operations as the reference ---- */

/* Branch-free exact f16 -> f32 (same bits as kv_quant_h2f), with masks instead of selects so
 * the compiler vectorizes it. */
static inline float gen_h2f(uint16_t h) {
    uint32_t em = h & 0x7fffu, sign = ((uint32_t)h ^ em) << 16;
    uint32_t is_sub = 0u - (uint32_t)(em < 0x0400u);  /* zero or subnormal */
    uint32_t is_inf = 0u - (uint32_t)(em >= 0x7c00u); /* inf or nan: exponent 255 */
    uint32_t is_nan = 0u - (uint32_t)(em > 0x7c00u);  /* nan: quiet bit */
    uint32_t bits = ((em << 13) + (112u << 23) + (is_inf & ((128u - 16u) << 23))) | (is_nan & 0x00400000u);
    float sub = (float)(int32_t)em * 0x1p-24f; /* exact */
    uint32_t sbits;
    memcpy(&sbits, &sub, 4);
    bits = (sbits & is_sub) | (bits & ~is_sub) | sign;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* chunks of 64 through a local array, so the loop has a fixed trip count and vectorizes */
static void gen_f16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        uint16_t h[64];
        float f[64];
        memcpy(h, p + 2 * i, sizeof h);
        for (int j = 0; j < 64; j++) f[j] = gen_h2f(h[j]);
        memcpy(dst + i, f, sizeof f);
    }
    for (; i < n; i++) dst[i] = gen_h2f(kv_quant_ld16(p + 2 * i));
}

static void gen_bf16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        uint32_t bits = (uint32_t)h << 16;
        memcpy(&dst[i], &bits, 4);
    }
}

static void gen_q8_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 34, dst += 32) {
        float d = gen_h2f(kv_quant_ld16(b));
        int8_t q[32];
        memcpy(q, b + 2, 32);
        for (int j = 0; j < 32; j++) dst[j] = (float)q[j] * d;
    }
}

static void gen_q4_0(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 18, dst += 32) {
        float d = gen_h2f(kv_quant_ld16(b));
        uint8_t q[16];
        memcpy(q, b + 2, 16);
        for (int j = 0; j < 16; j++) {
            dst[j] = (float)((q[j] & 0x0f) - 8) * d;
            dst[j + 16] = (float)((q[j] >> 4) - 8) * d;
        }
    }
}

static inline __attribute__((always_inline)) void gen_qk45(const uint8_t *b, float *dst, int64_t nb, bool q5) {
    for (int64_t i = 0; i < nb; i++, b += q5 ? 176 : 144, dst += 256) {
        float d = gen_h2f(kv_quant_ld16(b)), dmin = gen_h2f(kv_quant_ld16(b + 2));
        const uint8_t *scales = b + 4;
        uint8_t qh[32], qs[128];
        memcpy(qh, b + 16, 32);
        memcpy(qs, b + (q5 ? 48 : 16), 128);
        uint32_t sc[2], mn[2];
        kv_quant_scales_k4(scales, sc, mn);
        for (int c = 0; c < 4; c++) {
            float da = d * (float)kv_quant_k4_byte(sc, 2 * c), ma = dmin * (float)kv_quant_k4_byte(mn, 2 * c);
            float db = d * (float)kv_quant_k4_byte(sc, 2 * c + 1), mb = dmin * (float)kv_quant_k4_byte(mn, 2 * c + 1);
            const uint8_t *q = qs + 32 * c;
            float *y = dst + 64 * c;
            uint8_t ua = (uint8_t)(1u << (2 * c)), ub = (uint8_t)(2u << (2 * c));
            for (int l = 0; l < 32; l++) {
                int qa = q[l] & 0x0f, qb = q[l] >> 4;
                if (q5) {
                    qa += qh[l] & ua ? 16 : 0;
                    qb += qh[l] & ub ? 16 : 0;
                }
                y[l] = da * (float)qa - ma;
                y[l + 32] = db * (float)qb - mb;
            }
        }
    }
}
static void gen_q4_k(const void *src, float *dst, int64_t nb) { gen_qk45(src, dst, nb, false); }
static void gen_q5_k(const void *src, float *dst, int64_t nb) { gen_qk45(src, dst, nb, true); }

static void gen_q6_k(const void *src, float *dst, int64_t nb) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < nb; i++, b += 210, dst += 256) {
        uint8_t blk[208];
        memcpy(blk, b, 208);
        float d = gen_h2f(kv_quant_ld16(b + 208));
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(blk + 192 + 8 * h);
            float *y = dst + 128 * h;
            for (int k = 0; k < 2; k++) {
                float s0 = d * (float)sc[k], s1 = d * (float)sc[k + 2];
                float s2 = d * (float)sc[k + 4], s3 = d * (float)sc[k + 6];
                for (int l = 16 * k; l < 16 * k + 16; l++) {
                    int q1 = ((ql[l] & 0x0f) | (qh[l] & 3) << 4) - 32;
                    int q2 = ((ql[l + 32] & 0x0f) | (qh[l] >> 2 & 3) << 4) - 32;
                    int q3 = ((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) - 32;
                    int q4 = ((ql[l + 32] >> 4) | (qh[l] >> 6) << 4) - 32;
                    y[l] = s0 * (float)q1;
                    y[l + 32] = s1 * (float)q2;
                    y[l + 64] = s2 * (float)q3;
                    y[l + 96] = s3 * (float)q4;
                }
            }
        }
    }
}

static const struct kv_dq_table k_generic = {{
    [KV_DQ_F32] = ref_f32, [KV_DQ_F16] = gen_f16, [KV_DQ_BF16] = gen_bf16, [KV_DQ_Q8_0] = gen_q8_0,
    [KV_DQ_Q4_0] = gen_q4_0, [KV_DQ_Q4_K] = gen_q4_k, [KV_DQ_Q5_K] = gen_q5_k, [KV_DQ_Q6_K] = gen_q6_k,
}};

/* ---- ISA choice ---- */

static _Atomic int g_isa = KV_QUANT_ISA_AUTO; /* resolved set, never AUTO after first use */

/* F16C: every AVX2 CPU has it; GCC can check it, older clang cannot name it */
#if defined(__clang__)
#define HAS_F16C 1
#else
#define HAS_F16C __builtin_cpu_supports("f16c")
#endif

static enum kv_quant_isa cpu_best(void) {
#ifdef KV_QUANT_X86
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HAS_F16C;
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return KV_QUANT_ISA_AVX512;
    if (avx2) return KV_QUANT_ISA_AVX2;
#endif
    return KV_QUANT_ISA_GENERIC;
}

int kv_quant_isa_env(void) {
    const char *e = getenv("KVSERVE_CPU_ISA");
    if (!e || !*e) return KV_QUANT_ISA_AUTO;
    if (!strcasecmp(e, "generic")) return KV_QUANT_ISA_GENERIC;
    if (!strcasecmp(e, "avx2")) return KV_QUANT_ISA_AVX2;
    if (!strcasecmp(e, "avx512")) return KV_QUANT_ISA_AVX512;
    return -1;
}

/* KVSERVE_CPU_ISA, read on first use: the highest set AUTO may pick (unset or invalid: no
 * limit; the CLIs refuse an invalid value before any kernel runs). */
static enum kv_quant_isa env_limit(void) {
    static _Atomic int cached = -1;
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v >= 0) return (enum kv_quant_isa)v;
    v = kv_quant_isa_env();
    if (v <= KV_QUANT_ISA_AUTO) v = KV_QUANT_ISA_AVX512;
    atomic_store_explicit(&cached, v, memory_order_relaxed);
    return (enum kv_quant_isa)v;
}

enum kv_quant_isa kv_quant_set_isa(enum kv_quant_isa isa) {
    enum kv_quant_isa best = cpu_best();
    if (isa == KV_QUANT_ISA_AUTO) {
        enum kv_quant_isa lim = env_limit();
        isa = best < lim ? best : lim;
    } else if (isa < KV_QUANT_ISA_GENERIC || isa > best) {
        isa = best;
    }
    atomic_store(&g_isa, (int)isa);
    return isa;
}

enum kv_quant_isa kv_quant_get_isa(void) {
    int isa = atomic_load_explicit(&g_isa, memory_order_relaxed);
    if (isa == KV_QUANT_ISA_AUTO) isa = (int)kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    return (enum kv_quant_isa)isa;
}

const char *kv_quant_isa_name(enum kv_quant_isa isa) {
    switch (isa) {
    case KV_QUANT_ISA_GENERIC: return "generic";
    case KV_QUANT_ISA_AVX2: return "avx2";
    case KV_QUANT_ISA_AVX512: return "avx512";
    default: return "auto";
    }
}

/* ---- prefetch mode (quant.h) ---- */

static _Atomic int g_prefetch = KV_PREFETCH_AUTO; /* resolved mode, never AUTO after first use */

int kv_quant_prefetch_env(void) {
    const char *e = getenv("KVSERVE_CPU_PREFETCH");
    if (!e || !*e || !strcasecmp(e, "auto")) return KV_PREFETCH_AUTO;
    if (!strcasecmp(e, "cache")) return KV_PREFETCH_CACHE;
    if (!strcasecmp(e, "nta")) return KV_PREFETCH_NTA;
    return -1;
}

enum kv_prefetch kv_quant_set_prefetch(enum kv_prefetch mode) {
    if (mode != KV_PREFETCH_CACHE && mode != KV_PREFETCH_NTA) {
        int e = kv_quant_prefetch_env();
        if (e == KV_PREFETCH_CACHE || e == KV_PREFETCH_NTA) {
            mode = (enum kv_prefetch)e;
        } else {
            mode = KV_PREFETCH_CACHE;
#ifdef KV_QUANT_X86
            __builtin_cpu_init();
            if (__builtin_cpu_is("amd")) mode = KV_PREFETCH_NTA;
#endif
        }
    }
    atomic_store(&g_prefetch, (int)mode);
    return mode;
}

enum kv_prefetch kv_quant_get_prefetch(void) {
    int m = atomic_load_explicit(&g_prefetch, memory_order_relaxed);
    if (m == KV_PREFETCH_AUTO) m = (int)kv_quant_set_prefetch(KV_PREFETCH_AUTO);
    return (enum kv_prefetch)m;
}

const char *kv_quant_prefetch_name(enum kv_prefetch mode) {
    return mode == KV_PREFETCH_CACHE ? "cache" : mode == KV_PREFETCH_NTA ? "nta" : "auto";
}

static const struct kv_dq_table *table_for(enum kv_quant_isa isa) {
#ifdef KV_QUANT_X86
    if (isa == KV_QUANT_ISA_AVX512) return &kv_dq_avx512;
    if (isa == KV_QUANT_ISA_AVX2) return &kv_dq_avx2;
#endif
    (void)isa;
    return &k_generic;
}

static void run(const struct kv_dq_table *tab, int type, const void *src, float *dst, int64_t n) {
    struct qinfo q = qinfo(type);
    if (q.slot < 0 || n <= 0 || n % q.blck) return;
    tab->fn[q.slot](src, dst, n / q.blck);
}

void kv_dequant_row(int type, const void *src, float *dst, int64_t n) {
    run(table_for(kv_quant_get_isa()), type, src, dst, n);
}

void kv_dequant_row_ref(int type, const void *src, float *dst, int64_t n) { run(&k_ref, type, src, dst, n); }
