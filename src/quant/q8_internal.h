/*
 * q8_internal: what q8.c (quantization, reference, dispatch) and the x86 kernel files
 * (q8_avx2.c, q8_avx512.c, q8_amx.c; their shared helpers in q8_x86_internal.h) share. Not a
 * public interface.
 */
#ifndef KV_QUANT_Q8_INTERNAL_H
#define KV_QUANT_Q8_INTERNAL_H

#include "q8.h"
#include "quant_internal.h"

/* Panel geometry (q8.h, prefill): a panel is ceil(n_rows / 16) row groups, each holding its 16
 * rows over all of K as K / G "groups" (a Q8_0/Q4_0 block of 32, a K-quant super-block of 256)
 * of `grp` bytes:
 *   float d[16]; [K-quants: float dmin[16]]; [Q4_K/Q5_K: int32 mins[8][16]]     (hdr bytes)
 *   J sub-blocks of S elements, each: [K-quants: int32 sc[16]]; uint8 v[S/4][16][4]  (sub bytes)
 * indexed [row of the group]; v in VNNI order (4 consecutive k of one row in 4 bytes): the
 * contract's signed value u as int8 (Q8_0: quant; Q4_0: nibble - 8; Q4_K/Q5_K: v; Q6_K: v - 32).
 * Rows past n_rows are zero. */
struct kv_q8_geo {
    int G, J, S, kq, mins;
    size_t hdr, sub, grp;
};
static inline struct kv_q8_geo kv_q8_geo(int type) {
    struct kv_q8_geo g = {0};
    switch (type) {
    case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: g.G = 32, g.J = 1, g.S = 32; break;
    case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: g.G = 256, g.J = 8, g.S = 32, g.kq = 1, g.mins = 1; break;
    case KV_QTYPE_Q6_K: g.G = 256, g.J = 16, g.S = 16, g.kq = 1; break;
    default: return g;
    }
    g.hdr = 64 + (g.kq ? 64 : 0) + (g.mins ? 512 : 0);
    g.sub = (g.kq ? 64 : 0) + (size_t)g.S * 16;
    g.grp = g.hdr + (size_t)g.J * g.sub;
    return g;
}

/* Quantizes one group of G (32 or 256) floats x into q (G int8) and *d, by q8.h's rule. */
typedef void (*kv_q8_quant_fn)(const float *x, int G, int8_t *q, float *d);
void kv_q8_quantize_group_generic(const float *x, int G, int8_t *q, float *d);

#ifdef KV_QUANT_X86
void kv_q8_quantize_group_avx2(const float *x, int G, int8_t *q, float *d);
void kv_q8_quantize_group_avx512(const float *x, int G, int8_t *q, float *d);
/* Arguments already checked by kv_q8_dot_rows. vnni: use AVX512-VNNI (the CPU has it). */
void kv_q8_dot_avx2(int type, const void *w, size_t rb, int n_rows, const struct kv_q8_act *a, int m0, int M,
                    float *Y, size_t ldy);
void kv_q8_dot_avx512(int type, const void *w, size_t rb, int n_rows, const struct kv_q8_act *a, int m0, int M,
                      float *Y, size_t ldy, int vnni);
int kv_q8_cpu_has_vnni(void);
int kv_q8_cpu_has_amx(void);
void kv_q8_pack_avx2(int type, const void *w, size_t rb, int n_rows, int K, void *panel);
void kv_q8_pack_avx512(int type, const void *w, size_t rb, int n_rows, int K, void *panel); /* AMX-INT8 usable (CPU + the kernel granted the tile state) */
/* Packed kernels; arguments checked by kv_q8_dot_packed. */
void kv_q8_packed_avx512vnni(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                             float *Y, size_t ldy);
void kv_q8_packed_avx2(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                       float *Y, size_t ldy);
void kv_q8_packed_amx(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M, float *Y,
                      size_t ldy);
#endif

#endif
