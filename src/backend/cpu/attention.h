/*
 * attention: causal attention of the CPU backend over a paged KV pool whose K/V elements are
 * f32, f16 or bf16 (enum kv_dtype, backend.h), one task per (query row, KV head).
 *
 * Layout (backend.h): block b holds [layer][k|v][kv_head][token][head_dim]; a sequence's
 * position p lives in block block_table[p / tpb], slot p % tpb. The caller passes the byte
 * offsets of its (layer, kv_head) K and V runs inside a block.
 *
 * INVARIANCE CONTRACT (the same on every kernel family, generic / AVX2 / AVX-512, so a
 * sequence's output never depends on the batch, the chunking or the ISA): for query head g
 * (of the n_group heads sharing this KV head) and positions i = 0 .. n_pos-1, with k_i, v_i
 * the stored rows widened exactly to f32:
 *   s_i  = dot(q_g, k_i) * scale        dot: matmul.h's order (16 lanes, fma, fixed tree,
 *                                       fma tail)
 *   mx   = max_i s_i (NaN scores ignored);  e_i = kv_expf(s_i - mx)  (attention.c: exp from
 *          IEEE single operations only, a Cephes polynomial; < 1 ulp, same bits in
 *          scalar C and in vectors);
 *   sum  = 16 lanes, lane j adding e_i for i = j, j+16, ... < n - n % 16 in order, the dot's
 *          fixed tree, then the remaining e_i in order
 *   out_g[d] = 0; for i in order: out_g[d] = fma(e_i * (1 / sum), v_i[d], out_g[d])
 * Cost: one pass over K and one over V per (tile of rows, KV head), shared by the group's q
 * heads and the tile's rows (GQA reads each K/V row once, not n_group times; a prefill tile of
 * R rows reads it once, not R times).
 */
#ifndef KV_BACKEND_CPU_ATTENTION_H
#define KV_BACKEND_CPU_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

struct kv_attn_args {
    const float *q;            /* row j's (n_group, head_dim) query heads at q + j * q_stride */
    int n_group, head_dim;     /* head_dim >= 1 */
    int n_rows;                /* >= 1 query rows of one sequence at consecutive positions (a
                                  tile of a chunked prefill: K rows are loaded once per tile) */
    size_t q_stride, out_stride; /* floats between consecutive rows of q / out */
    int n_pos;                 /* >= 1: row 0 attends positions 0 .. n_pos-1, row j 0 .. n_pos-1+j */
    const int32_t *block_table;
    int tpb;                   /* tokens per block */
    const char *pool;          /* the KV pool (borrowed) */
    size_t block_bytes;        /* bytes per block */
    size_t k_off, v_off;       /* byte offsets of this (layer, kv head)'s K / V run in a block */
    int kv_dtype;              /* enum kv_dtype */
    float scale;               /* usually 1/sqrt(head_dim) */
    float *scores;             /* scratch: n_kv * n_rows * n_group * (n_pos + n_rows - 1) floats */
    float *out;                /* row j's (n_group, head_dim) at out + j * out_stride */
    /* KV heads done in one call (0 or 1: one; at most KV_ATTN_MAX_HEADS): heads x = 0 ..
     * n_kv-1 have their K / V runs at k_off / v_off + x * head_stride, their query heads at
     * q + x * n_group * head_dim and outputs at out + x * n_group * head_dim (consecutive
     * heads of one row). The vector kernels visit the heads inside each KV block, so a block's
     * adjacent runs are read as one region (long-context decode is bound by memory latency on
     * 2 KiB runs otherwise); every (row, head) gets the bits of a call of its own. */
    int n_kv;
    size_t head_stride;
};
#define KV_ATTN_MAX_HEADS 8

/* Runs the contract above with the kernel family kv_matmul_set_isa selected. Reads only
 * positions < n_pos; cannot fail. Thread-safe for distinct scores/out buffers. */
void kv_attention(const struct kv_attn_args *a);

/* Stores n floats as kv_dtype elements at dst (f32 copy, f16 / bf16 round-to-nearest-even;
 * the same bits on every ISA). */
void kv_store_row(void *dst, const float *src, int n, int kv_dtype);

#endif
