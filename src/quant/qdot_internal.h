/*
 * qdot_internal: what qdot.c (validation, generic kernel, dispatch) and qdot_x86.c (AVX2 and
 * AVX-512 kernels) share. Not a public interface.
 */
#ifndef KV_QUANT_QDOT_INTERNAL_H
#define KV_QUANT_QDOT_INTERNAL_H

#include "quant_internal.h"

/* Arguments already validated by kv_qdot_rows / kv_qdot_grouped; 1 <= M <= 4. Row r starts at
 * w + r * rb; for F32/F16/BF16 the row's 64-byte chunk c is at that + c * cs (cs = 64: a packed
 * row; the grouped layout passes rb = 64, cs = 64 * rows of the group). Block types: cs unused. */
typedef void (*kv_qdot_fn)(int type, const uint8_t *w, size_t rb, size_t cs, int n_rows, int K, const float *X, size_t ldx,
                           int M, float *Y, size_t ldy);

#ifdef KV_QUANT_X86
void kv_qdot_avx2(int type, const uint8_t *w, size_t rb, size_t cs, int n_rows, int K, const float *X, size_t ldx, int M,
                  float *Y, size_t ldy);
void kv_qdot_avx512(int type, const uint8_t *w, size_t rb, size_t cs, int n_rows, int K, const float *X, size_t ldx, int M,
                    float *Y, size_t ldy);
/* kv_fgroup_rows (qdot.h) for F32/F16/BF16, arguments validated */
void kv_fgroup_rows_avx2(int type, const uint8_t *g, int n_rows, int K, float *out, size_t ldo);
void kv_fgroup_rows_avx512(int type, const uint8_t *g, int n_rows, int K, float *out, size_t ldo);
#endif

#endif
