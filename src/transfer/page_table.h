/*
 * page_table: what a worker's KV pools look like in memory, so that two workers can agree on
 * which bytes to move (spec seed-features §4 "pool matching", §8 masked pools, decision 8).
 *
 * A page table is a list of pool VIEWS. A view is one pool role (kv now; indexer_k and recurrent
 * state later) over a set of GLOBAL layer ids, with its dtype and block geometry, and one ENTRY
 * per layer it holds: where that layer's bytes sit inside one block of the pool.
 *
 *   kvserve's CPU pool (backend.h), one view, role kv, layers 0..L-1, f32:
 *     block b = [layer 0: K (heads x T x head_dim) | V ...][layer 1 ...] ...
 *     entry(layer l) = {offset l * bytes_per_layer, bytes_per_layer}
 *     bytes_per_layer = kv_factor * n_kv_heads * T * head_dim * dtype_size
 *
 *   masked pool (spec §8): only owning layers hold a row; mask [T,F,T,F] over layers 0..3 gives
 *     entries for layers 0 and 2 at packed rows 0 and 1 (offsets 0 and bytes_per_layer).
 *     No mask = the dense layout byte for byte. A mask with no owning layer = no view.
 *
 * Matching (receiver side, kvx_page_table_match): for each local view, the FIRST peer view with
 * the same role and a non-empty overlap of global layer ids; the mapping lists, per overlapping
 * layer, the source offset, destination offset and length inside one block. So a sender holding
 * layers 0..7 and another holding 8..15 each fill their part of one receiver holding 0..15, and a
 * pipeline reshard needs no special case. Refused with a message: a different dtype, tokens per
 * block, head count or head size, or no overlapping layer at all.
 *
 * Ownership: a page table owns its entry arrays (kvx_page_table_free). Not thread-safe; plain data.
 */
#ifndef KV_TRANSFER_PAGE_TABLE_H
#define KV_TRANSFER_PAGE_TABLE_H

#include <jansson.h>

#include "../base/base.h"

enum kvx_dtype { KVX_DTYPE_F32 = 0, KVX_DTYPE_F16, KVX_DTYPE_BF16, KVX_DTYPE_U8 };
enum kvx_pool_role { KVX_ROLE_KV = 0, KVX_ROLE_INDEXER_K, KVX_ROLE_RECURRENT };

/* Bytes per element (4, 2, 2, 1); 0 for an unknown dtype. */
size_t kvx_dtype_size(int dtype);
const char *kvx_dtype_name(int dtype);       /* "f32", "f16", "bf16", "u8" */
const char *kvx_role_name(int role);         /* "kv", "indexer_k", "recurrent_state" */

struct kvx_layer_entry {
    int layer;                /* global layer id */
    size_t offset;            /* bytes from the start of the block */
    size_t bytes;
};

struct kvx_pool_view {
    enum kvx_pool_role role;
    enum kvx_dtype dtype;
    int tokens_per_block;
    int n_kv_heads;
    int head_dim;
    int kv_factor;            /* 2 for K+V, 1 for single-tensor pools */
    size_t pool_offset;       /* where this pool's block 0 starts in the transfer region */
    size_t block_bytes;       /* stride of one block of this pool */
    int n_entries;
    struct kvx_layer_entry *entries; /* owned, (n_entries) ascending offsets, no overlap */
};

#define KVX_MAX_VIEWS 8
struct kvx_page_table {
    int n_views;
    struct kvx_pool_view views[KVX_MAX_VIEWS];
};

/* The dense kv pool of kvserve's backends (layout above). KV_EINVAL for non-positive sizes or
 * an unknown dtype (message); KV_ENOMEM. *pt is overwritten (not freed first). */
kv_status kvx_page_table_dense_kv(struct kvx_page_table *pt, int first_layer, int n_layers,
                                  int n_kv_heads, int head_dim, int tokens_per_block, int dtype,
                                  char *err, size_t errlen);

/* General builder: appends one view of `role` over global layers[0..n_layers) to pt. mask: NULL
 * (every layer owns a row) or (n_layers) flags; owning layers get consecutive rows. pool_rows: the
 * pool's row count (rows per block), which must equal the number of owning layers (spec §8: a
 * mismatch is an error); -1 = that number. bytes_per_row = kv_factor * heads * T * head_dim *
 * dtype size. No owning layer -> no view appended, KV_OK. KV_EINVAL (message; also for an owning
 * layer id listed twice) / KV_ENOMEM; pt is unchanged on error. */
kv_status kvx_page_table_add_view(struct kvx_page_table *pt, int role, int dtype, int tokens_per_block,
                                  int n_kv_heads, int head_dim, int kv_factor, const int *layers,
                                  int n_layers, const bool *mask, int pool_rows, size_t pool_offset,
                                  char *err, size_t errlen);
void kvx_page_table_free(struct kvx_page_table *pt);
/* Deep copy. KV_ENOMEM (dst zeroed). */
kv_status kvx_page_table_copy(struct kvx_page_table *dst, const struct kvx_page_table *src);

/* {"views":[{"role","dtype","tokens_per_block","n_kv_heads","head_dim","kv_factor",
 *  "pool_offset","block_bytes","entries":[[layer, offset, bytes], ...]}]}. New reference; NULL
 * on ENOMEM. */
json_t *kvx_page_table_to_json(const struct kvx_page_table *pt);
/* Strict parse of untrusted JSON: every field present and in range, entries inside the block and
 * not overlapping, no layer id twice in a view, at most KVX_MAX_VIEWS views and 65536 entries each. KV_EFORMAT (message);
 * *pt zeroed on error. */
kv_status kvx_page_table_from_json(const json_t *j, struct kvx_page_table *pt, char *err,
                                   size_t errlen);

/* One contiguous copy inside a block pair: src [src_off, +len) of a source block -> dst
 * [dst_off, +len) of a destination block (offsets include the views' pool_offset base). */
struct kvx_segment {
    size_t src_off, dst_off, len;
};
struct kvx_map {
    size_t src_block_bytes, dst_block_bytes; /* strides (of the matched views) */
    int n_seg;
    struct kvx_segment *seg;                 /* owned, in destination order */
    bool whole_block;                        /* one segment covering both whole blocks */
};
/* Receiver-side matching of the local (destination) table against the peer's (source). Only
 * single-view local tables are mapped today (kvserve's pools); every local entry must find its
 * layer in the peer's matched view, else KV_EINVAL naming the layer (a split sender covers a
 * subset: kvx_page_table_match_partial). KV_EINVAL with a message for any mismatch (naming the
 * sender = peer and the receiver = local, so it reads the same in either worker's log); KV_ENOMEM. */
kv_status kvx_page_table_match(const struct kvx_page_table *local, const struct kvx_page_table *peer,
                               struct kvx_map *out, char *err, size_t errlen);
/* Like match, but maps only the local layers the peer holds (for several senders with disjoint
 * layer ranges filling one receiver); *n_layers = layers mapped (>= 1, else KV_EINVAL). */
kv_status kvx_page_table_match_partial(const struct kvx_page_table *local,
                                       const struct kvx_page_table *peer, struct kvx_map *out,
                                       int *n_layers, char *err, size_t errlen);
void kvx_map_free(struct kvx_map *m);
/* Bytes moved per block pair. */
size_t kvx_map_bytes_per_block(const struct kvx_map *m);

/* One contiguous run for the data plane: source region bytes [src_off, +len) -> dst pointer. */
struct kvx_run {
    uint64_t src_off;
    uint8_t *dst;
    size_t len;
};
/* Runs for moving src_blocks[i] -> dst_blocks[i] (i < n) under map m, into the destination
 * region dst_base; adjacent runs (contiguous on both sides) are merged. *runs is heap (caller
 * frees); returns KV_OK / KV_ENOMEM. */
kv_status kvx_map_runs(const struct kvx_map *m, const int32_t *src_blocks, const int32_t *dst_blocks,
                       int n, uint8_t *dst_base, struct kvx_run **runs, int *n_runs);

#endif
