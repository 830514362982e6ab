/*
 * backend: the compute interface the engine drives. A backend owns the weights' compute
 * copy and the KV pool storage; it never sees requests, only batches of sequences.
 * (Modelled on ggml-backend: a struct of function pointers plus a context pointer.)
 *
 * KV pool storage: n_blocks blocks, each one contiguous region of
 *   block_bytes = n_layers * 2 * n_kv_heads * tokens_per_block * head_dim * kv_dtype_size(kv_dtype)
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
 *
 * Determinism (a hard requirement of the CPU backend; the server's acceptance test relies on
 * it): a sequence's logits and K/V are bitwise identical whether it runs alone or batched with
 * any other sequences, and whether its prompt is computed in one chunk, several chunks or token
 * by token (same backend object, same n_threads). The CUDA backend gives this guarantee only
 * with backend_options.deterministic (`serve --deterministic`, its own fixed-order GEMM and
 * attention splits; 1.5-2.7x slower); by default its cuBLAS GEMMs pick kernels by M. Backends guarantee this by computing every
 * row independently of the other rows of the batch. CPU backend (default gemm mode
 * BACKEND_CPU_GEMM_INVARIANT): every matrix product goes through our own kernel
 * (cpu/matmul.h) whose element (m, n) is computed with a fixed summation order that depends
 * only on X[m], W[n] and K: never on the row count M, the row's position, the blocking, the
 * thread count or the instruction set (AVX-512 / AVX2 / generic give the same bits). So the
 * guarantee holds by construction, whatever OpenBLAS would do (OpenBLAS 0.3.21 changes its
 * per-row summation with M, and with OPENBLAS_CORETYPE=Haswell for almost every M and row
 * offset). Attention, norms, RoPE and SwiGLU are per row / per (row, head) with a fixed
 * summation order, so the thread that runs a task does not matter.
 * tests/unit/backend/test_backend.c checks the whole forward, test_matmul.c the kernel.
 * The optional BACKEND_CPU_GEMM_OPENBLAS mode gives this guarantee up (see below).
 */
#ifndef KV_BACKEND_H
#define KV_BACKEND_H

#include "../base/base.h"
#include "../model/model.h"

/* Element type of the KV pool's K and V. 0 (f32) is the default everywhere, so a
 * zero-initialised geometry keeps the f32 pool. The CPU backend supports only
 * KV_DTYPE_F32 (kv_alloc refuses the others with KV_EINVAL); the CUDA backend supports
 * F32 and BF16 (F16 is reserved: refused with KV_EINVAL). */
enum kv_dtype { KV_DTYPE_F32 = 0, KV_DTYPE_BF16 = 1, KV_DTYPE_F16 = 2 };

/* Bytes of one K/V element of dtype d (4, 2, 2); 0 for a value outside enum kv_dtype. */
size_t kv_dtype_size(int d);
/* "f32", "bf16", "f16", or "?" for an unknown value. Static string. */
const char *kv_dtype_name(int d);
/* Parses "f32" / "bf16" / "f16" into *out. KV_EINVAL (out untouched) otherwise. */
kv_status kv_dtype_parse(const char *s, int *out);

/* Initialise with designated initializers (.n_layers = ...): fields may be appended. */
struct kv_geometry {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int tokens_per_block;
    int kv_dtype; /* enum kv_dtype; 0 = KV_DTYPE_F32 */
};
/* Bytes of one block for geometry g (K and V of g->kv_dtype; 0 for an unknown dtype). */
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

/* RoPE inverse frequencies of cfg (head_dim/2 floats into inv_freq), computed as HF
 * transformers does in f32, with cfg.rope_scaling (linear or llama3) applied. Shared by every
 * backend so they rotate identically. */
void backend_rope_inv_freq(const struct model_config *cfg, float *inv_freq);

/* Rows of logits a batch produces: sum over seqs of (LAST ? 1 : ALL ? n_tokens : 0). */
int batch_n_logits(const struct batch *b);

typedef struct backend backend_t;

/* ---- sampling on the device (optional op forward_sample; issue 10) ----
 * One logit row's sampling request: the engine's sampler pipeline (engine/sampler.h) with the
 * request's parameters, its random draw and its token history. Semantics are the host
 * sampler's: repetition penalty over prompt + generated ids (l > 0 ? l / rp : l * rp, once per
 * distinct id), then presence / frequency over generated ids (l -= count * freq + pres, once
 * per distinct id), logprobs = log_softmax of the penalised logits, then temperature == 0:
 * argmax (ties -> lowest id), else candidates sorted by (logit desc, id asc) cut to top_k,
 * top_p (smallest prefix whose mass >= top_p), min_p (weight >= min_p relative to the max),
 * and the draw u * (kept mass) walked in candidate order. */
#define BACKEND_MAX_TOP 20
struct backend_sampling {
    float temperature;        /* <= 0: greedy */
    int top_k;                /* <= 0 or >= n_vocab: off */
    float top_p;              /* outside (0, 1): off */
    float min_p;              /* <= 0: off */
    float presence_penalty, frequency_penalty, repetition_penalty; /* 0, 0, 1 (or <= 0): off */
    int n_top;                /* alternatives to report, 0..BACKEND_MAX_TOP */
    bool logprob;             /* report the chosen token's logprob */
    double u;                 /* temperature > 0: the request's draw in [0, 1) (kv_rng_f64) */
    const int32_t *prompt;    /* (n_prompt) read only when a penalty is active; borrowed */
    int n_prompt;
    const int32_t *gen;       /* (n_gen) generated ids, likewise */
    int n_gen;
};
struct backend_sample_out {
    int32_t id;                               /* the sampled token */
    float logprob;                            /* its logprob (when asked for) */
    int32_t top_id[BACKEND_MAX_TOP];          /* the n_top best (logprob desc, id asc) */
    float top_logprob[BACKEND_MAX_TOP];
};

struct backend_ops {
    const char *name;
    /* Allocates the KV pool storage (replacing any previous one; contents zeroed).
     * g must match the model (n_layers, n_kv_heads, head_dim) and n_blocks >= 1, else
     * KV_EINVAL. KV_ENOMEM / KV_EINVAL leave no pool (the old one is freed). */
    kv_status (*kv_alloc)(backend_t *be, int n_blocks, const struct kv_geometry *g);
    /* Runs the model on the batch: writes K/V of every new token into its block slot and
     * writes logits rows (batch_n_logits(b) x n_vocab, f32, in sequence order) to logits.
     * Contract: on KV_OK every sequence was computed; on error the KV contents of the new
     * positions are undefined but no other position was touched (the caller recomputes).
     * Errors: KV_EINVAL for a block id outside the pool, a block table too short for
     * n_past + n_tokens, or a token id outside the vocabulary (message in err). Only the
     * first ceil((n_past + n_tokens) / T) block-table entries are read and checked.
     * Validation happens before any computation, so on KV_EINVAL nothing was written.
     * logits may be NULL when batch_n_logits(b) == 0. KV_ENOMEM if scratch growth fails
     * (scratch grows only when a batch has more rows than any before). */
    kv_status (*forward)(backend_t *be, const struct batch *b, float *logits, char *err,
                         size_t errlen);
    /* Copies whole blocks src[i] -> dst[i] inside the pool (optional; NULL if unsupported). */
    kv_status (*copy_blocks)(backend_t *be, const int32_t *src, const int32_t *dst, int n);
    /* Host pointer to block b's storage (optional: CPU backend and tests). */
    float *(*block_ptr)(backend_t *be, int b);
    void (*free)(backend_t *be);
    /* ---- optional, appended for the host offload tier (NULL: the generic fallback in
     * backend_copy_to_host / backend_copy_from_host copies through block_ptr) ---- */
    /* Copies n whole blocks (kv_block_bytes each) device block blocks[i] -> host[i]. */
    kv_status (*copy_to_host)(backend_t *be, const int32_t *blocks, void *const *host, int n);
    /* Copies n whole blocks host[i] -> device block blocks[i]. */
    kv_status (*copy_from_host)(backend_t *be, const void *const *host, const int32_t *blocks,
                                int n);
    /* ---- optional, appended for sampling on the device (NULL: the engine samples the
     * logits rows of forward on the host) ----
     * forward, then samples every logits row on the device: sp and out have
     * batch_n_logits(b) entries, in the order forward's logits rows would have. Only the
     * sampled ids and the logprobs asked for come back. Errors as forward, plus KV_EINVAL for
     * a bad request (n_top outside 0..BACKEND_MAX_TOP, NULL token arrays with a penalty on). */
    kv_status (*forward_sample)(backend_t *be, const struct batch *b, const struct backend_sampling *sp,
                                struct backend_sample_out *out, char *err, size_t errlen);
    /* ---- optional, appended for fault handling: false once the backend can no longer compute
     * (a sticky device error: every later call would fail or return garbage); why gets the
     * reason. NULL: always healthy. Thread-safe (servers call it from their HTTP thread). */
    bool (*healthy)(backend_t *be, char *why, size_t whylen);
    /* ---- optional, appended for KV transfer of a pool outside host memory (disaggregated
     * serving, docs/disaggregation.md "CUDA IPC") ----
     * The pool's device memory: *base is the start of one device allocation of *len bytes
     * (n_blocks * kv_block_bytes(&geom)) that holds block b at base + b * kv_block_bytes, on
     * CUDA device *device. Valid until the next kv_alloc or free. KV_EINVAL when no pool is
     * allocated. NULL: the pool is in host memory (block_ptr) or cannot be exported. */
    kv_status (*device_pool)(backend_t *be, void **base, size_t *len, int *device);
};

struct backend {
    const struct backend_ops *ops;
    void *ctx;                 /* owned by the backend */
    const model_t *model;      /* borrowed; must outlive the backend */
    struct kv_geometry geom;   /* of the current pool */
    int n_blocks;
};

/* Batched block copies between the KV pool and host memory (the host offload tier): n
 * blocks of kv_block_bytes(&be->geom) each. n == 0 returns KV_OK without touching anything.
 * Uses ops->copy_to_host / copy_from_host when set, else memcpy through ops->block_ptr.
 * KV_EINVAL for a block id outside the pool (checked before any copy); KV_EUNSUPPORTED if
 * the backend has neither. */
kv_status backend_copy_to_host(backend_t *be, const int32_t *blocks, void *const *host, int n);
kv_status backend_copy_from_host(backend_t *be, const void *const *host, const int32_t *blocks,
                                 int n);

/* CPU backend: f32 compute; every matrix product (all tokens of the batch stacked into one
 * matrix) runs on the batch-invariant kernel cpu/matmul.h (backend_cpu_new_ex can pick
 * OpenBLAS instead); attention/RMSNorm/RoPE/SwiGLU in C over n_threads threads (0 = all
 * cores). The model must outlive the backend. Calls openblas_set_num_threads(n_threads)
 * (process-wide) and logs the gemm mode, kernel ISA and openblas_get_corename().
 * Weights are used in place (borrowed from m; no copy). RoPE frequencies (incl.
 * cfg.rope_scaling) are computed here: change m->cfg before creating the backend.
 * Errors: KV_EINVAL for unsupported shapes (n_heads % n_kv_heads != 0, odd head_dim) or
 * missing bias / q-k norm weights that cfg enables, or KVSERVE_CPU_PANEL_THP other than unset,
 * 0 or 1; KV_ENOMEM. *out untouched on failure.
 * One forward at a time per backend (not thread-safe). Measured with bench_engine, 2 shared
 * Zen 4 cores, invariant gemm: 12x768 Llama (32k vocab, f32) prefill of 256 tokens ~610
 * tok/s, decode ~54 tok/s at batch 1 (memory-bound: ~24 GB/s of weights); stories260K
 * prefill ~12k tok/s, decode ~3.4k steps/s at batch 1. */
kv_status backend_cpu_new(const model_t *m, int n_threads, backend_t **out, char *err, size_t errlen);

/* How the CPU backend computes its matrix products (projections and output head). */
enum backend_cpu_gemm {
    /* Default. Our batch-invariant f32 kernel (cpu/matmul.h): logits and K/V are bitwise
     * identical whatever the batch composition or chunking (see "Determinism" above).
     * Measured (2 shared Zen 4 cores): as fast as OpenBLAS for M >= 256, 1.3-4x faster for
     * M <= 16 (decode). */
    BACKEND_CPU_GEMM_INVARIANT = 0,
    /* One cblas_sgemm over all rows of the step (no padding, no tiling). NOT batch-invariant:
     * results may differ in the last bits with batch composition (OpenBLAS picks kernels by
     * M and by OPENBLAS_CORETYPE), so a sequence's sampled tokens may change when it is
     * batched with others. For experiments and comparison only. */
    BACKEND_CPU_GEMM_OPENBLAS = 1,
};
/* "invariant" / "openblas"; NULL for an unknown value. */
const char *backend_cpu_gemm_name(enum backend_cpu_gemm g);
/* Parses "invariant" / "openblas" (the serve CLI's --gemm values) into *out; KV_EINVAL (and
 * *out untouched) otherwise. */
kv_status backend_cpu_gemm_parse(const char *s, enum backend_cpu_gemm *out);

/* Where the CPU backend keeps F16/BF16 matrices (struct backend_cpu_options.float_layout). */
enum backend_cpu_float_layout { BACKEND_CPU_FLOAT_AUTO = 0, BACKEND_CPU_FLOAT_ROWS, BACKEND_CPU_FLOAT_GROUPED };
/* Parses "rows" / "grouped" (KVSERVE_CPU_FLOAT_LAYOUT) into *out; KV_EINVAL (and *out
 * untouched) otherwise. Pure. */
kv_status backend_cpu_float_layout_parse(const char *s, enum backend_cpu_float_layout *out);
struct backend_cpu_options {
    int n_threads;              /* 0 = all cores */
    enum backend_cpu_gemm gemm; /* BACKEND_CPU_GEMM_INVARIANT (0) unless asked otherwise */
    /* Keep every matrix in its file layout. By default (false), on the integer path for
     * quantized weights, Q8_0 matrices are repacked whole at creation into the prefill
     * kernels' panel layout (+5.9% bytes), and F16/BF16 matrices of a GGUF file into
     * anonymous memory (float_layout below; same bytes); the file pages they replace are
     * released and every product reads the panel: same bits, faster decode (and Q8_0
     * prefill), about 1 s more load time per GB repacked. Also turned off by
     * KVSERVE_CPU_PREPACK=0 (for A/B measurements). The KV pool (kv_alloc) is an anonymous
     * map advised for transparent huge pages (2x decode at 4k context on a VM, where every
     * 4 KiB run of the pool was a TLB miss); KVSERVE_CPU_THP=0 keeps 4 KiB pages. The panels
     * are faulted in 4 KiB pages (fast load on a VM) and collapsed into 2 MiB pages by a
     * background thread (backend_cpu_wait_pages); KVSERVE_CPU_PANEL_THP=1 advises 2 MiB
     * pages before packing instead, =0 keeps 4 KiB pages. */
    bool no_prepack;
    /* Layout of the repacked F16/BF16 matrices (with no_prepack false): BACKEND_CPU_FLOAT_ROWS
     * copies the file's rows (anonymous memory, 2 MiB pages: the decode tiles read 8 rows as
     * 8 streams), BACKEND_CPU_FLOAT_GROUPED interleaves 4 rows in 64-byte chunks (one stream
     * per matrix; kv_fgroup_pack). Same bits either way. BACKEND_CPU_FLOAT_AUTO (0):
     * KVSERVE_CPU_FLOAT_LAYOUT=rows|grouped if set, else grouped on AMD CPUs, rows elsewhere
     * (measured: docs/benchmarks.md, "F16/BF16 rows in anonymous memory"). */
    enum backend_cpu_float_layout float_layout;
};
/* backend_cpu_new with options (zero-initialised options = backend_cpu_new(m, 0, ...)).
 * Errors as backend_cpu_new, plus KV_EINVAL for an unknown gemm mode or NULL opt. */
/* Bytes of the weight panels a CPU backend repacked at creation (struct
 * backend_cpu_options.no_prepack), 0 when it repacked nothing or be is not a CPU backend. */
size_t backend_cpu_panel_bytes(const backend_t *be);
/* Waits until the background thread that collapses a CPU backend's weight panels into 2 MiB
 * pages (started at creation unless KVSERVE_CPU_PANEL_THP is 0 or 1) has finished, so that a
 * benchmark measures the steady state. No-op for other backends or when no thread runs. Not
 * thread-safe against backend_free or another call on the same backend; bits unchanged. */
void backend_cpu_wait_pages(backend_t *be);
kv_status backend_cpu_new_ex(const model_t *m, const struct backend_cpu_options *opt, backend_t **out, char *err,
                             size_t errlen);
void backend_free(backend_t *be);

/* ---- backend registry (the serve / generate CLIs' --backend cpu|cuda) ---- */
enum backend_kind { BACKEND_KIND_CPU = 0, BACKEND_KIND_CUDA = 1 };
/* "cpu" / "cuda"; NULL for an unknown value. */
const char *backend_kind_name(enum backend_kind k);
/* Parses "cpu" / "cuda" into *out; KV_EINVAL (and *out untouched) otherwise. */
kv_status backend_kind_parse(const char *s, enum backend_kind *out);
/* True when this build contains the CUDA backend (configured with KVSERVE_CUDA=ON and nvcc).
 * Says nothing about a GPU being present: backend_create reports that. */
bool backend_cuda_compiled(void);

struct backend_options {
    enum backend_kind kind;     /* BACKEND_KIND_CPU (0) unless asked otherwise */
    int n_threads;              /* cpu: 0 = all cores */
    enum backend_cpu_gemm gemm; /* cpu only */
    int device;                 /* cuda: device ordinal (0 = first GPU) */
    bool f32_weights;           /* cuda: keep weights f32 on the device (default bf16) */
    /* Batch-invariant mode (serve --deterministic): cuda: backend_cuda_options.deterministic
     * (our fixed-order GEMM and attention split instead of cuBLAS; slower); cpu: its default
     * gemm mode is batch-invariant already, so this only refuses BACKEND_CPU_GEMM_OPENBLAS
     * (KV_EINVAL) and logs "cpu backend: always batch-invariant". */
    bool deterministic;
};
/* Creates the backend opt->kind names for model m (which must outlive it).
 * cpu: backend_cpu_new_ex. cuda: backend_cuda_new (cuda/backend_cuda.h): weights bf16 in
 * device memory, KV pool in HBM; needs a GPU. Errors: KV_EINVAL (NULL argument, unknown
 * kind, unsupported shape), KV_EUNSUPPORTED (cuda asked for in a build without CUDA, or no
 * usable GPU: the message says which), KV_ENOMEM, KV_EIO (a CUDA call failed). *out is
 * untouched on failure. */
kv_status backend_create(const model_t *m, const struct backend_options *opt, backend_t **out, char *err,
                         size_t errlen);

/* The checks every backend's forward makes before touching memory: a well-formed batch, a KV pool
 * (pool_ready, be->n_blocks >= 1), per sequence 1 <= n_tokens, 0 <= n_past, a known logits
 * mode, a block table covering n_past + n_tokens positions at tpb tokens per block with ids in
 * [0, be->n_blocks), token ids in [0, n_vocab), at most max_tokens tokens in all. KV_EINVAL
 * with a message naming the sequence and the field; reads only. */
kv_status backend_check_batch(const backend_t *be, const struct batch *b, bool pool_ready, int tpb, int n_vocab,
                              long max_tokens, char *err, size_t errlen);

#endif
