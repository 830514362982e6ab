/*
 * The CUDA backend's context and launch helpers, shared by backend_cuda.cu (weights upload, KV
 * pool, host copies, creation) and forward.cu (the forward driver, GEMM choice, attention
 * routing, sampling and health). C++; not a public header (backend_cuda.h is).
 */
#ifndef KV_CUDA_CTX_H
#define KV_CUDA_CTX_H

#include <cublas_v2.h>

#include "cuda_internal.h"

#define BLAS_TRY(call, what)                                                                       \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            return kv_errf(s_ == CUBLAS_STATUS_ALLOC_FAILED ? KV_ENOMEM : KV_EIO, err, errlen,     \
                           "cublas: %s: %s", (what), cublasGetStatusString(s_));                   \
    } while (0)
#define LAUNCHED(what)                                                                             \
    do {                                                                                           \
        kvc_launched();                                                                            \
        CU_TRY(cudaGetLastError(), what);                                                          \
    } while (0)

/* Launches kernel k on c->st, with programmatic dependent launch when c->pdl (kernels.cuh:
 * pdl_wait / pdl_trigger; captured into graphs as programmatic edges). Counts the launch;
 * returns the launch's error. */
struct cuda_ctx;
template <typename... KArgs, typename... Args>
static cudaError_t klaunch(const struct cuda_ctx *c, void (*k)(KArgs...), dim3 g, dim3 b, size_t smem,
                           Args... args);

struct cuda_layer {
    void *wqkv, *wo, *wgu, *wdown; /* weight dtype */
    float *attn_norm, *ffn_norm, *bqkv, *q_norm, *k_norm;
};

struct cuda_ctx {
    const model_t *m;
    int dev;
    bool f32w;
    int n_sm;
    bool attn2;   /* k_attn_part2 (lane per position; hd % 4 == 0): KVSERVE_CUDA_ATTN=1 selects k_attn_part */
    bool attn2_force; /* KVSERVE_CUDA_ATTN=2: k_attn_part2 for every split step (experiments) */
    int split_set;    /* KVSERVE_CUDA_ATTN_SPLIT=N: first split length tried (a multiple of 8; experiments) */
    int gemv_max; /* products with M <= gemv_max rows use k_gemv_bf16 (KVSERVE_CUDA_GEMV_MAX, default 1) */
    bool det;     /* batch-invariant mode (backend_cuda_options.deterministic): inv_gemm, fixed attention split */
    bool pdl;     /* programmatic dependent launch for the forward's own kernels (KVSERVE_CUDA_PDL=0: off) */
    bool flash;   /* k_attn_flash may serve prefill steps (flash_tiles; KVSERVE_CUDA_FLASH=0: never) */
    int flash_mt; /* its m tiles per warp: 1 or 2 (KVSERVE_CUDA_FLASH_MT; default 2) */
    int dec_rows;  /* single-token steps of <= dec_rows split rows run k_attn_dec (KVSERVE_CUDA_DEC_ROWS;
                    * 0: never; at most DEC_ROWS_CAP) */
    int dec_ctas;  /* k_attn_dec's split: parts doubled while the grid exceeds dec_ctas CTAs
                    * (KVSERVE_CUDA_DEC_CTAS=N: N per SM; 0: dec_split_len's default, 4 per SM
                    * for 1-2 rows, 8 for more) */
    int dec_half;  /* k_attn_dec may use half-tile (16-position) parts when 32-position ones leave SMs
                    * idle (KVSERVE_CUDA_DEC_HALF=0: never) */
    bool dec_tc;  /* k_attn_dec_tc where it applies (KVSERVE_CUDA_DEC_TC=0: k_attn_dec only) */
    bool qkv_fuse;     /* all-decode k_attn_dec_tc steps do k_qkv_post's work in the attention
                        * kernel (default; KVSERVE_CUDA_QKV_FUSE=0: a k_qkv_post launch) */
    bool gemv_late;    /* k_gemv_bf16 lets the next kernel launch only after its loads (default;
                        * KVSERVE_CUDA_GEMV_LATE=0: at its start) */
    bool dec_pdl; /* k_attn_dec* launched with PDL (KVSERVE_CUDA_DEC_PDL=1; default plain stream order: 1-12% faster steps, H200) */
    int dec_late; /* k_attn_dec triggers the next kernel's launch after its loads (KVSERVE_CUDA_DEC_LATE) */
    unsigned *dec_cnt; /* (DEC_ROWS_CAP, n_kv) k_attn_dec's last-part counters, zero between launches */
    /* the batch-1 decode megakernel (decode_mk.cuh; KVSERVE_CUDA_MK=0: off), set up by mk_setup */
    bool mk;
    size_t mk_smem;              /* its dynamic shared memory */
    int mk_nst;                  /* ring stages */
    unsigned mk_u_off, mk_part_off;
    void *mk_layers;             /* device array of struct mk_layer, n_layers */
    unsigned *mk_bar;            /* grid-barrier counter (zero between launches) */
    bool mk_lm;                  /* the output head in the megakernel (KVSERVE_CUDA_MK_LM=0: after it) */
    int mk_lm_rows;              /* mk_params.lm_rows */
    int mk_dbg;                  /* KVSERVE_CUDA_MK_DBG (timing experiments; results wrong) */
    long long *mk_prof;          /* KVSERVE_CUDA_MK_PROF=1 (timing tool): per-CTA phase cycles, printed per step */
    unsigned skip; /* timing only (KVSERVE_CUDA_SKIP, backend_cuda.h): stages left out, SKIP_* bits */
    size_t wsz; /* bytes per weight element */
    cudaStream_t st;
    cublasHandle_t blas;
    /* weights */
    void *tok_embd, *output; /* output == tok_embd when tied */
    float *out_norm;
    struct cuda_layer *L;
    float *inv_freq;
    size_t weight_bytes;
    /* KV pool */
    char *pool;          /* n_blocks * block_bytes bytes; elements of kv_dtype */
    size_t block_floats; /* elements (of kv_dtype) per block, despite the name */
    size_t block_bytes;  /* kv_block_bytes(&geom) */
    int kv_dtype;        /* KV_DTYPE_F32 or KV_DTYPE_BF16 */
    int tpb;
    float **bounce_src; /* scratch pointer tables for host copies (n entries) */
    void *bounce;       /* pinned staging for host copies from/to pageable memory */
    size_t bounce_bytes;
    /* scratch */
    int cap_rows;
    float *x;  /* (rows, dim) residual stream */
    float *h;  /* (rows, hw) GEMM outputs */
    void *a;   /* (rows, aw) GEMM inputs, weight dtype */
    size_t hw, aw;
    size_t cap_logits; /* floats */
    float *logits;
    size_t cap_part, cap_ml; /* bytes */
    float *part, *part_ml;
    size_t cap_meta; /* int32 entries */
    int32_t *d_meta, *h_meta;
    void *blas_ws; /* cuBLAS workspace (set explicitly so GEMMs can be graph-captured) */
    /* CUDA graphs of whole forward steps (steps of <= GRAPH_MAX_ROWS rows; KVSERVE_CUDA_GRAPHS=0
     * turns them off). A graph is reused only when every launch parameter it captured is the
     * same (rows, logit rows, attention grid, every buffer pointer); see graph_key. */
    bool graphs;
    cudaStreamCaptureMode capture_mode; /* KVSERVE_CUDA_CAPTURE=global: Global, else ThreadLocal */
    struct graph_entry *gcache;
    int gcache_next;
    /* fault injection (KVSERVE_CUDA_FAULT=forward:N,...): forward numbers that fail */
    long n_forward;
    long fault_at[16];
    int n_fault;
    long sticky_at[16]; /* KVSERVE_CUDA_FAULT=sticky:N: forward numbers that start with a trapping kernel */
    int n_sticky;
    /* health (check_sticky): set once a failed call left the CUDA context unusable */
    int sick;
    char sick_why[320];
    void *probe; /* 16 device bytes for the health probe */
    /* sampling on the device (sample.cu) */
    struct kvs_state samp;
};

/* klaunch with programmatic dependent launch chosen by pdl (and c->pdl) */
template <typename... KArgs, typename... Args>
static cudaError_t klaunch_pdl(const struct cuda_ctx *c, bool pdl, void (*k)(KArgs...), dim3 g, dim3 b, size_t smem,
                               Args... args);
template <typename... KArgs, typename... Args>
static cudaError_t klaunch(const struct cuda_ctx *c, void (*k)(KArgs...), dim3 g, dim3 b, size_t smem,
                           Args... args) {
    return klaunch_pdl(c, true, k, g, b, smem, args...);
}
template <typename... KArgs, typename... Args>
static cudaError_t klaunch_pdl(const struct cuda_ctx *c, bool pdl, void (*k)(KArgs...), dim3 g, dim3 b, size_t smem,
                               Args... args) {
    cudaLaunchConfig_t cf = {};
    cf.gridDim = g, cf.blockDim = b, cf.dynamicSmemBytes = smem, cf.stream = c->st;
    cudaLaunchAttribute at[1] = {};
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cf.attrs = at, cf.numAttrs = c->pdl && pdl ? 1 : 0;
    kvc_launched();
    return cudaLaunchKernelEx(&cf, k, ((KArgs)args)...);
}
#define KLAUNCH(what, ...) CU_TRY(klaunch(c, __VA_ARGS__), what)

/* KVSERVE_CUDA_SKIP (bench only: results are wrong): stages of every layer left out */
#define SKIP_ATTN 1u   /* attention (+ combine) */
#define SKIP_NORM 2u   /* the two RMSNorms */
#define SKIP_QKV 4u    /* q/k norm + RoPE + KV store */
#define SKIP_SWIGLU 8u
#define SKIP_GEMM 16u  /* the four projections */
#define GRAPH_MAX_ROWS 64
#define GRAPH_CACHE 32
struct graph_key {
    int T, L, parts, split_len, tpb, attn2, n_tiles, n1, dec, single, mk;
    size_t cap_meta, block_floats;
    int kv_dtype;
    const void *ptr[9];
};
struct graph_entry {
    struct graph_key k;
    cudaGraphExec_t exec; /* NULL: empty slot */
};

static inline void graphs_clear(struct cuda_ctx *c) {
    if (!c->gcache) return;
    for (int i = 0; i < GRAPH_CACHE; i++)
        if (c->gcache[i].exec) cudaGraphExecDestroy(c->gcache[i].exec), c->gcache[i].exec = NULL;
}

/* Blocks of threads covering n items (at most 65536; kernels loop over the rest). */
static inline unsigned grid_for(size_t n, int threads) {
    size_t g = (n + threads - 1) / threads;
    if (g > 65536) g = 65536;
    return g ? (unsigned)g : 1u;
}

/* Grows device scratch *p to at least need_bytes (doubling from 4 KiB; contents not kept). */
static inline kv_status grow(void **p, size_t *cap, size_t need_bytes, char *err, size_t errlen) {
    if (need_bytes <= *cap) return KV_OK;
    size_t nc = *cap ? *cap : 4096;
    while (nc < need_bytes) nc *= 2;
    if (*p) kvc_free(*p);
    *p = NULL;
    *cap = 0;
    CU_TRY(kvc_malloc(p, nc), "cudaMalloc (scratch)");
    *cap = nc;
    return KV_OK;
}

/* ---- forward.cu ---- */
/* backend_ops.forward, .forward_sample and .healthy of the CUDA backend (backend.h). */
kv_status cuda_forward(backend_t *be, const struct batch *b, float *logits, char *err, size_t errlen);
kv_status cuda_forward_sample(backend_t *be, const struct batch *b, const struct backend_sampling *sp,
                              struct backend_sample_out *out, char *err, size_t errlen);
bool cuda_healthy(backend_t *be, char *why, size_t whylen);
/* Raise the dynamic shared memory limits of k_gemm_inv / k_attn_flash (once per device use). */
cudaError_t inv_gemm_setup(void);
cudaError_t flash_setup(void);
/* Decides whether the batch-1 decode megakernel serves this model on this device (c->mk; off
 * when the shapes, the options or the device do not allow it, never an error for that) and
 * allocates its layer table and barrier counter. Errors: a failed CUDA call (KV_EIO / KV_ENOMEM). */
kv_status mk_setup(struct cuda_ctx *c, char *err, size_t errlen);
/* Enqueues the megakernel for a one-row step (c->mk; its attention parts split_len positions
 * long, max_parts of them at most; the step's metadata at d_pos / d_bto / d_bt) on c->st:
 * every layer, c->x left holding the last residual, and with lm (only where c->mk_lm) the
 * output head too: the row's logits in c->logits (n_vocab f32). KV_EIO when the launch fails;
 * when it fails because the grid cannot be co-resident, c->mk is cleared first (later steps
 * run the eight-kernel layers). */
kv_status mk_launch(struct cuda_ctx *c, int split_len, int max_parts, const int32_t *d_pos, const int32_t *d_bto,
                    const int32_t *d_bt, bool lm, char *err, size_t errlen);
/* KVSERVE_CUDA_MK_PROF=1 only: the last megakernel step's phase times on stderr (one blocking
 * copy). */
void mk_prof_print(struct cuda_ctx *c);
/* Raises k_attn_dec's dynamic shared memory limit (once per device use). */
cudaError_t dec_setup(void);
#define DEC_ROWS_CAP 256
#define DEC_ROWS_DEFAULT DEC_ROWS_CAP
#define DEC_SMEM_MAX (160 * 1024)

#endif
