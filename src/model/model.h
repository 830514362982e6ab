/*
 * model: model configuration, checkpoint readers (GGUF v2/v3, Hugging Face safetensors
 * directories) and weight loading. Weight matrices stay in the precision they are stored in
 * (struct kv_wmat: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; see src/quant/quant.h): a
 * GGUF file's matrices are used in place from its memory map (memory ~= file size), a HF
 * checkpoint's bf16/f16 matrices are kept 16-bit. Vectors (norms, biases) are f32.
 *
 * Example:
 *   model_t *m; char err[256];
 *   if (model_load("stories260K.gguf", &m, err, sizeof err)) { fprintf(stderr, "%s\n", err); ... }
 *   ... m->cfg.n_layers, m->w.layers[0].wq ...
 *   model_free(m);
 *
 * Matrix convention: a weight named W with shape comment (out, in) is stored as out rows of
 * `in` floats, and y = W x means y[o] = sum_i W[o*in + i] * x[i] (the PyTorch nn.Linear
 * convention; GGUF's ne[0] is `in`).
 *
 * RoPE convention (cfg.rope_neox):
 *   false: rotate adjacent pairs (x[2i], x[2i+1]) -- llama.cpp LLAMA_ROPE_TYPE_NORM, used by
 *          GGUF `llama` files whose q/k rows were permuted by the HF->GGUF converter.
 *   true:  rotate halves (x[i], x[i + head_dim/2]) -- HF `rotate_half`, used for every HF
 *          checkpoint and for GGUF qwen2/qwen3.
 */
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include "../base/base.h"
#include "../quant/quant.h"

typedef enum {
    MODEL_ARCH_LLAMA = 0, /* Llama-2/3, Mistral, TinyLlama, llama2.c stories */
    MODEL_ARCH_QWEN2,     /* q/k/v bias */
    MODEL_ARCH_QWEN3,     /* q/k RMSNorm (per head, head_dim weights), explicit head_dim */
} model_arch;

const char *model_arch_name(model_arch a);

/* Llama-3 style RoPE frequency scaling (rope_scaling.rope_type == "llama3"). */
struct rope_scaling {
    int type;                 /* 0 none, 1 llama3, 2 linear */
    float factor;             /* linear and llama3 */
    float low_freq_factor;    /* llama3 */
    float high_freq_factor;   /* llama3 */
    int original_max_pos;     /* llama3 */
};

struct model_config {
    model_arch arch;
    int n_vocab;          /* rows of the embedding / output matrices */
    int dim;              /* hidden size */
    int n_layers;
    int n_heads;          /* query heads */
    int n_kv_heads;       /* key/value heads (GQA: n_heads % n_kv_heads == 0) */
    int head_dim;         /* per head; usually dim / n_heads (Qwen3: explicit) */
    int ffn_dim;          /* SwiGLU intermediate size */
    float rms_eps;
    float rope_theta;
    bool rope_neox;       /* see file comment */
    struct rope_scaling rope_scaling;
    int max_ctx;          /* context length the model declares (tokens) */
    bool attn_bias;       /* q/k/v biases present (Qwen2) */
    bool qk_norm;         /* per-head RMSNorm on q and k before RoPE (Qwen3) */
    bool tied_embeddings; /* output matrix == token embedding matrix */
    int bos_id;           /* -1 if none */
    int eos_id;           /* -1 if none; primary EOS */
    int eos_ids[8];       /* all ids that end generation (generation_config eos_token_id list) */
    int n_eos_ids;
    char name[128];       /* the model's own name, the default id in the API: GGUF general.name
                             (unless it only repeats the architecture, as llama.cpp's llama2.c
                             converter writes), HF config _name_or_path (a local path: its last
                             component), a Hugging Face cache snapshot's repository ("org/name");
                             else the file name without .gguf, or the directory name (its
                             parent's when it is a generic one such as hf/ or a revision hash) */
};

/* A weight matrix of `rows` output rows of `cols` inputs, in its stored precision: row r is
 * the row_bytes bytes at data + r * row_bytes, packed as ggml's blocks of `type` (quant.h;
 * cols is a multiple of the type's block size). data is owned by the model (its file map or
 * its arena) and read-only, except in a model from model_alloc (F32, writable: see
 * kv_wmat_f32). Read rows through kv_dequant_row, or directly when type is F32. */
struct kv_wmat {
    const void *data;
    int type;         /* enum kv_qtype */
    int rows, cols;
    size_t row_bytes; /* kv_qtype_row_bytes(type, cols) */
    /* Optional: the same matrix repacked whole, or NULL. Q8_0: by kv_q8_pack (src/quant/q8.h:
     * 16-row groups of kv_q8_pack_bytes(type, 16, cols) bytes each, row group g at panel + g *
     * that), read by the integer matmul path. F16/BF16 (when kv_fgroup_ok(type, cols)): the
     * grouped layout of src/quant/qdot.h (kv_fgroup_pack), read by every product. Set by the
     * CPU backend on its own copies of the weight table (never in a model), owned by that
     * backend; the matmul reads it instead of data (same bits). */
    const void *panel;
};
/* The matrix's data as floats when it is F32, else NULL. Writable only for model_alloc's
 * models (tests and the demo generator fill them); a loaded file's map is read-only. */
static inline float *kv_wmat_f32(const struct kv_wmat *w) {
    return w->type == KV_QTYPE_F32 ? (float *)(uintptr_t)w->data : NULL;
}
/* An F32 view of rows x cols floats at p (borrowed). */
static inline struct kv_wmat kv_wmat_from_f32(const float *p, int rows, int cols) {
    struct kv_wmat w = {p, KV_QTYPE_F32, rows, cols, (size_t)cols * sizeof(float), NULL};
    return w;
}

struct layer_weights {
    float *attn_norm;     /* (dim) */
    struct kv_wmat wq;    /* (n_heads*head_dim, dim) */
    struct kv_wmat wk;    /* (n_kv_heads*head_dim, dim) */
    struct kv_wmat wv;    /* (n_kv_heads*head_dim, dim) */
    float *bq, *bk, *bv;  /* (n_heads*head_dim), (n_kv_heads*head_dim) x2; NULL unless attn_bias */
    float *q_norm;        /* (head_dim) NULL unless qk_norm */
    float *k_norm;        /* (head_dim) NULL unless qk_norm */
    struct kv_wmat wo;    /* (dim, n_heads*head_dim) */
    float *ffn_norm;      /* (dim) */
    struct kv_wmat w_gate; /* (ffn_dim, dim) */
    struct kv_wmat w_up;   /* (ffn_dim, dim) */
    struct kv_wmat w_down; /* (dim, ffn_dim) */
};

struct model_weights {
    struct kv_wmat tok_embd; /* (n_vocab, dim) */
    float *out_norm;         /* (dim) */
    struct kv_wmat output;   /* (n_vocab, dim); same data as tok_embd when tied */
    struct layer_weights *layers; /* n_layers entries */
};

typedef enum { MODEL_FORMAT_GGUF = 0, MODEL_FORMAT_HF_DIR } model_format;

typedef struct model {
    struct model_config cfg;
    struct model_weights w;
    model_format format;
    char path[4096];      /* what was loaded: GGUF file or HF directory */
    bool is_demo;         /* the embedded random-weight demo model */
    /* private: owned allocations of the weights */
    void *priv;
} model_t;

/* Loads a GGUF file or a Hugging Face directory (detected from the path).
 * On failure returns a negative kv_status, leaves *out untouched and writes a message
 * naming the file and the problem (missing tensor, bad shape, truncated data, unsupported
 * architecture or dtype) into err. Never crashes on malformed input. */
kv_status model_load(const char *path, model_t **out, char *err, size_t errlen);
void model_free(model_t *m);
/* Tells the OS that bytes [p, p + n) of m's file map will not be read for a while (the CPU
 * backend calls it after repacking a matrix): madvise(MADV_DONTNEED) on the whole pages inside
 * the range, so they leave the process's resident set; reading them again is still valid and
 * faults them back from the file (page cache). A no-op for memory that is not in m's file map
 * (model_alloc's arena, HF 16-bit buffers). Thread-safe; cannot fail (errors are ignored). */
void model_release_pages(const model_t *m, const void *p, size_t n);
/* True when model_release_pages(m, p, n) would release pages: [p, p + n) lies in m's GGUF file
 * map. A copy of such bytes costs no resident memory once they are released; a copy of other
 * bytes (an arena, HF buffers) doubles them. Thread-safe. */
bool model_pages_releasable(const model_t *m, const void *p, size_t n);

/* Allocates an empty model with all weight arrays for cfg (zeroed), every matrix F32 and
 * writable through kv_wmat_f32. For tests and the demo model generator. */
kv_status model_alloc(const struct model_config *cfg, model_t **out);

/* Fills every weight with deterministic pseudo-random values (N(0, std) approximated;
 * norms around 1.0) from seed. Biases and q/k norms included when cfg enables them. */
void model_randomize(model_t *m, uint64_t seed, float std);

/* Bytes of m's weights in memory: matrices in their stored precision plus f32 vectors
 * (a tied output counted once). What `kvserve serve` logs at start. */
size_t model_weight_bytes(const model_t *m);

/* "Q4_K x13, Q6_K x3" style counts of m's matrices per stored type (tied output counted
 * once), into out (truncated to outlen). For logs. */
void model_matrix_types(const model_t *m, char *out, size_t outlen);

/* Writes m as a GGUF v3 file (F32 tensors, matrices of other types dequantized, `llama` architecture metadata; for qwen2/qwen3
 * the matching architecture keys). tok_meta_writer (optional) may add tokenizer metadata.
 * Used by the demo model generator and by tests that need model files. */
struct gguf_writer;
typedef kv_status (*model_gguf_extra_fn)(struct gguf_writer *w, void *user);
kv_status model_save_gguf(const model_t *m, const char *path, model_gguf_extra_fn extra, void *user,
                          char *err, size_t errlen);

/* Reads only the configuration of a GGUF file or HF directory (no weights are converted).
 * cfg->n_vocab comes from the embedding shape when the metadata lacks it. *fmt (optional)
 * receives the format. Errors as model_load; *cfg is untouched on failure. */
kv_status model_read_config(const char *path, struct model_config *cfg, model_format *fmt, char *err,
                            size_t errlen);

/* Calls cb once per tensor stored in the GGUF file / HF checkpoint, in file order. dtype is
 * the format's name ("F32", "Q8_0", "BF16", ...); shape is outermost first (PyTorch order:
 * a GGUF tensor with ne = [in, out] is reported as [out, in]). Strings are borrowed for the
 * call only. Errors as model_load. */
typedef void (*model_tensor_fn)(void *user, const char *name, const char *dtype, int n_dims,
                                const uint64_t *shape);
kv_status model_list_tensors(const char *path, model_tensor_fn cb, void *user, char *err, size_t errlen);

/* Path of the embedded demo model (~/.cache/kvserve/demo-llama-v1.gguf, honouring
 * XDG_CACHE_HOME and KVSERVE_CACHE_DIR). Generates it deterministically on first use:
 * llama architecture, random weights, byte-level vocabulary (llama/SPM type: <unk>, <s>,
 * </s> then the 256 byte tokens <0x00>..<0xFF>, no space prefix). */
kv_status model_demo_path(char *out, size_t outlen, char *err, size_t errlen);

#endif
