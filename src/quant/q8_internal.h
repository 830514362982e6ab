/*
 * q8_internal: what q8.c (quantization, reference, dispatch) and q8_x86.c (the AVX2 and
 * AVX-512 kernels) share. Not a public interface.
 */
#ifndef KV_QUANT_Q8_INTERNAL_H
#define KV_QUANT_Q8_INTERNAL_H

#include "q8.h"
#include "quant_internal.h"

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
#endif

#endif
