/*
 * quant_internal: what quant.c (tables, reference, generic path, dispatch) and quant_x86.c
 * (the AVX2 and AVX-512 kernels) share. Not a public interface.
 *
 * Every kernel takes a count of whole blocks (elements for F32/F16/BF16, whose block is one
 * element) and performs, per element, exactly the IEEE operations of the reference in
 * quant.c, in the same order, so every ISA gives the same bits.
 */
#ifndef KV_QUANT_INTERNAL_H
#define KV_QUANT_INTERNAL_H

#include "quant.h"

#include <string.h>

/* src: packed blocks (any alignment); dst: nb * block_elems floats. */
typedef void (*kv_dq_fn)(const void *src, float *dst, int64_t nb);

/* One kernel per supported type (indexed by kv_dq_slot()). */
enum { KV_DQ_F32, KV_DQ_F16, KV_DQ_BF16, KV_DQ_Q8_0, KV_DQ_Q4_0, KV_DQ_Q4_K, KV_DQ_Q5_K, KV_DQ_Q6_K, KV_DQ_N };
struct kv_dq_table {
    kv_dq_fn fn[KV_DQ_N];
};

#if defined(__x86_64__) && defined(__GNUC__)
#define KV_QUANT_X86 1
extern const struct kv_dq_table kv_dq_avx2;
extern const struct kv_dq_table kv_dq_avx512;
#endif

/* IEEE binary16 -> binary32, exact for every finite value (subnormals included), +-inf kept;
 * a NaN keeps its sign and payload with the quiet bit set (what F16C's vcvtph2ps and ggml's
 * ggml_compute_fp16_to_fp32 both give). */
static inline float kv_quant_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        /* zero or subnormal: m * 2^-24 is exact in binary32 */
        float f = (float)m * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Little-endian u16 at p (any alignment). */
static inline uint16_t kv_quant_ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed scale bytes. */
static inline void kv_quant_scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* All 8 scales and mins at once (the same values as kv_quant_scale_min_k4), from the three
 * little-endian words of the scale bytes: sc/mn 0..3 are the low 6 bits of bytes 0..3 / 4..7;
 * 4..7 take their low nibble from bytes 8..11 (low / high nibble) and their top 2 bits from
 * the top 2 bits of bytes 0..3 / 4..7. Out: byte k (k = 0..7, little-endian order) of
 * sc[k / 4] is scale k (of mn[k / 4], min k). */
static inline void kv_quant_scales_k4(const uint8_t *q, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t w0 = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
    uint32_t w1 = (uint32_t)q[4] | (uint32_t)q[5] << 8 | (uint32_t)q[6] << 16 | (uint32_t)q[7] << 24;
    uint32_t w2 = (uint32_t)q[8] | (uint32_t)q[9] << 8 | (uint32_t)q[10] << 16 | (uint32_t)q[11] << 24;
    sc[0] = w0 & 0x3f3f3f3fu;
    mn[0] = w1 & 0x3f3f3f3fu;
    sc[1] = (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4;
    mn[1] = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4;
}
/* Byte k of the words kv_quant_scales_k4 wrote. */
static inline int kv_quant_k4_byte(const uint32_t w[2], int k) { return (int)(w[k >> 2] >> (8 * (k & 3)) & 0xff); }

#endif
