/*
 * backend: the compute interface the engine drives. A backend owns the weights' compute
 * copy and the KV pool storage; it never sees requests, only batches of sequences.
 * (Modelled on ggml-backend: a struct of function pointers plus a context pointer.)
 *
 * KV pool storage: n_blocks blocks, each one contiguous region of
 *   block_bytes = n_layers * 2 * n_kv_heads * tokens_per_block * head_dim * sizeof(float)
 * laid out as
 *
 *   block b: [layer 0: K [kv_head 0: tok 0..T-1 x head_dim] [kv_head 1] ... | V [kv_head 0] ...]
 *            [layer 1: K ... | V ...] ... [layer L-1]
 *
 * i.e. [layer][k|v][kv_head][token][head_dim], so one block is one copyable region (host
 * offload and KV transfer copy whole blocks).
 *
 * A sequence's block table lists block ids in position order: token position p of the
 * sequence lives in block block_table[p / T], slot p % T. Attention reads K/V through the
 * block table, never through a per-request contiguous copy.
 */
#ifndef KV_BACKEND_H
#define KV_BACKEND_H

#include "../base/base.h"
#include "../model/model.h"

struct kv_geometry {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int tokens_per_block;
};
/* Bytes of one block for geometry g (f32 K and V). */
size_t kv_block_bytes(const struct kv_geometry *g);

enum batch_logits { BATCH_LOGITS_NONE = 0, BATCH_LOGITS_LAST = 1, BATCH_LOGITS_ALL = 2 };

/* One sequence's slice of a forward step. All pointers are borrowed for the call. */
struct batch_seq {
    const int32_t *tokens;      /* (n_tokens) new token ids to run */
    int n_tokens;               /* >= 1 */
    int n_past;                 /* tokens of this sequence already in the KV cache; the new
                                   tokens take positions n_past .. n_past+n_tokens-1 */
    const int32_t *block_table; /* (n_blocks) block ids covering n_past + n_tokens positions */
    int n_blocks;
    enum batch_logits logits;   /* which new tokens need logits */
};

struct batch {
    const struct batch_seq *seqs;
    int n_seqs;
};

/* Rows of logits a batch produces: sum over seqs of (LAST ? 1 : ALL ? n_tokens : 0). */
int batch_n_logits(const struct batch *b);

typedef struct backend backend_t;

struct backend_ops {
    const char *name;
    /* Allocates the KV pool storage (replacing any previous one; contents zeroed).
     * KV_ENOMEM with the old pool freed on failure. */
    kv_status (*kv_alloc)(backend_t *be, int n_blocks, const struct kv_geometry *g);
    /* Runs the model on the batch: writes K/V of every new token into its block slot and
     * writes logits rows (batch_n_logits(b) x n_vocab, f32, in sequence order) to logits.
     * Contract: on KV_OK every sequence was computed; on error the KV contents of the new
     * positions are undefined but no other position was touched (the caller recomputes).
     * Errors: KV_EINVAL for a block id outside the pool, a block table too short for
     * n_past + n_tokens, or a token id outside the vocabulary (message in err). */
    kv_status (*forward)(backend_t *be, const struct batch *b, float *logits, char *err,
                         size_t errlen);
    /* Copies whole blocks src[i] -> dst[i] inside the pool (optional; NULL if unsupported). */
    kv_status (*copy_blocks)(backend_t *be, const int32_t *src, const int32_t *dst, int n);
    /* Host pointer to block b's storage (optional: CPU backend and tests). */
    float *(*block_ptr)(backend_t *be, int b);
    void (*free)(backend_t *be);
};

struct backend {
    const struct backend_ops *ops;
    void *ctx;                 /* owned by the backend */
    const model_t *model;      /* borrowed; must outlive the backend */
    struct kv_geometry geom;   /* of the current pool */
    int n_blocks;
};

/* CPU backend: f32 compute, OpenBLAS sgemm for every matrix product (all tokens of the
 * batch stacked into one matrix), attention/RMSNorm/RoPE/SwiGLU in C over n_threads
 * threads (0 = all cores). The model must outlive the backend. */
kv_status backend_cpu_new(const model_t *m, int n_threads, backend_t **out, char *err, size_t errlen);
void backend_free(backend_t *be);

#endif
