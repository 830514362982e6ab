/*
 * qdot_internal: what qdot.c (validation, generic kernel, dispatch) and qdot_x86.c (AVX2 and
 * AVX-512 kernels) share. Not a public interface.
 */
#ifndef KV_QUANT_QDOT_INTERNAL_H
#define KV_QUANT_QDOT_INTERNAL_H

#include "quant_internal.h"

/* Arguments already validated by kv_qdot_rows; 1 <= M <= 4. */
typedef void (*kv_qdot_fn)(int type, const uint8_t *w, size_t rb, int n_rows, int K, const float *X, size_t ldx,
                           int M, float *Y, size_t ldy);

#ifdef KV_QUANT_X86
void kv_qdot_avx2(int type, const uint8_t *w, size_t rb, int n_rows, int K, const float *X, size_t ldx, int M,
                  float *Y, size_t ldy);
void kv_qdot_avx512(int type, const uint8_t *w, size_t rb, int n_rows, int K, const float *X, size_t ldx, int M,
                    float *Y, size_t ldy);
#endif

#endif
