/*
 * matmul_internal: what matmul.c (task planning, the generic family, per-thread buffers) and
 * matmul_x86.c (the AVX-512 and AVX2 families) share. Not a public interface. Include it after
 * the file's `#pragma GCC optimize("fp-contract=off")`: its simd_internal.h helpers are compiled
 * into the kernels, where only the explicit fmas may fuse.
 */
#ifndef KV_BACKEND_CPU_MATMUL_INTERNAL_H
#define KV_BACKEND_CPU_MATMUL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "matmul.h"
#include "simd_internal.h"

#ifdef KV_CPU_X86
#define KV_MATMUL_X86 1
#endif

#define AI static inline __attribute__((always_inline))

/* A task's operands: columns [n0, n1) of all M rows of op.
 *   Xp: X packed for the family's tiles (x86 families: kv_mm_pack_x, once per op in run_batch,
 *       shared read-only by every task), NULL for the generic family (X read in place).
 *   Wp: W rows n0.. (f32, in place or a task's dequantized panel), ldw floats apart. */
struct cols_args {
    const struct kv_matmul_op *op;
    const float *Xp;
    const float *Wp;
    size_t ldw;
    int n0, n1;
};
typedef void (*cols_fn)(const struct cols_args *a);

/* Per-thread buffers (matmul.c), one per use because they are live at once: this thread's
 * buffer `which` of at least n bytes, 64-byte aligned (2 MiB pages advised when large), kept
 * for the thread's next call and freed at thread exit; NULL when out of memory. */
enum { BUF_ACT, BUF_PANEL, BUF_SUMS, BUF_XPACK, BUF_BF16X, BUF_N };
void *kv_mm_thread_buf(int which, size_t n);

/* This thread's buffer of the tiles' saved 16-lane partial sums (between K blocks), at least n
 * floats. Out of memory aborts: a few tens of KiB per thread. */
AI float *thread_sums(size_t n) {
    float *p = kv_mm_thread_buf(BUF_SUMS, (n < 16 ? 16 : n) * sizeof(float));
    if (!p) abort();
    return p;
}

#ifdef KV_MATMUL_X86
/* Register tiles of the x86 families: R X rows x C W rows.
 * AVX-512: 8 x 3 = 24 accumulators + 3 W + 1 X of the 32 zmm.
 * AVX2: 4 x 3 = 12 accumulators + 3 W + 1 X of the 16 ymm, run once per 8-lane half. */
#define R512 8
#define C512 3
#define R256 4
#define C256 3

/* The f32 tiles (packed X in a->Xp, f32 W rows in a->Wp): the task's columns for all M rows.
 * Call only on a CPU with the family's ISA (matmul.c's ISA choice). */
void kv_mm_cols_avx512(const struct cols_args *a);
void kv_mm_cols_avx2(const struct cols_args *a);

/* The AVX-512 tiles over F16/BF16 rows in the grouped layout (qdot.h) starting at g (the
 * matrix's panel; the task's rows are a->n0..): the task's columns for all M rows. */
typedef void (*hcols_fn)(const struct cols_args *a, const uint8_t *g);
/* The grouped tiles for an op of M rows of this weight type on family fn, or NULL (the task's
 * rows widened into an f32 panel instead). */
hcols_fn kv_mm_hcols_for(cols_fn fn, int type, int M);

/* Packs rows [0, M) of X (K floats apart) for tiles of R rows into Xp (M * (K - K % 16)
 * floats): tile t, 16-float step s: Xp[t R K16 + s Rt 16 + r 16 + j] = X[t R + r][16 s + j]. */
void kv_mm_pack_x(const float *X, int M, int K, int R, float *Xp);
#endif

#endif
