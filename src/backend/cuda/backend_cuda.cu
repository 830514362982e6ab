/*
 * CUDA backend: host side (weights upload, KV pool, forward driver, host copies).
 * See backend_cuda.h for the contract, kernels.cuh for the kernels.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "cuda_internal.h"
#include "kernels.cuh"
#include "attn_flash.cuh"

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

template <typename... KArgs, typename... Args>
static cudaError_t klaunch(const struct cuda_ctx *c, void (*k)(KArgs...), dim3 g, dim3 b, size_t smem,
                           Args... args) {
    cudaLaunchConfig_t cf = {};
    cf.gridDim = g, cf.blockDim = b, cf.dynamicSmemBytes = smem, cf.stream = c->st;
    cudaLaunchAttribute at[1] = {};
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cf.attrs = at, cf.numAttrs = c->pdl ? 1 : 0;
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
    int T, L, parts, split_len, tpb, attn2, n_tiles, n1;
    size_t cap_meta, block_floats;
    int kv_dtype;
    const void *ptr[9];
};
struct graph_entry {
    struct graph_key k;
    cudaGraphExec_t exec; /* NULL: empty slot */
};

static void graphs_clear(struct cuda_ctx *c) {
    if (!c->gcache) return;
    for (int i = 0; i < GRAPH_CACHE; i++)
        if (c->gcache[i].exec) cudaGraphExecDestroy(c->gcache[i].exec), c->gcache[i].exec = NULL;
}

/* ---- helpers ---- */

static unsigned grid_for(size_t n, int threads) {
    size_t g = (n + threads - 1) / threads;
    if (g > 65536) g = 65536;
    return g ? (unsigned)g : 1u;
}

static kv_status dev_alloc(void **p, size_t bytes, char *err, size_t errlen) {
    *p = NULL;
    CU_TRY(kvc_malloc(p, bytes ? bytes : 16), "cudaMalloc");
    return KV_OK;
}

static kv_status grow(void **p, size_t *cap, size_t need_bytes, char *err, size_t errlen) {
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

/* Uploads matrix w (any stored type: rows are dequantized to f32 on the host, chunk by
 * chunk, then converted on the device) into dst (weight dtype) at element offset off, or
 * fills n values with random ones (random mode: w NULL). */
static kv_status put_weights(struct cuda_ctx *c, void *dst, size_t off, const struct kv_wmat *w, size_t n,
                             bool is_norm, uint64_t seed, float *staging, size_t staging_floats, char *err,
                             size_t errlen) {
    char *d = (char *)dst + off * c->wsz;
    if (!w) { /* random mode */
        float mean = is_norm ? 1.0f : 0.0f, amp = is_norm ? 0.1f : 0.02f * 1.7320508f;
        if (c->f32w) k_fill_random<float><<<grid_for(n, 256), 256, 0, c->st>>>((float *)d, n, seed, mean, amp);
        else
            k_fill_random<__nv_bfloat16><<<grid_for(n, 256), 256, 0, c->st>>>((__nv_bfloat16 *)d, n, seed, mean, amp);
        LAUNCHED("fill random");
        return KV_OK;
    }
    if (n != (size_t)w->rows * (size_t)w->cols)
        return kv_errf(KV_EINVAL, err, errlen, "cuda: weights upload: matrix of %d x %d, expected %zu values", w->rows,
                       w->cols, n);
    const float *src = w->type == KV_QTYPE_F32 ? (const float *)w->data : NULL;
    float *host = NULL; /* dequantized rows of a non-F32 matrix */
    size_t rows_per_chunk = staging_floats / (size_t)(w->cols > 0 ? w->cols : 1);
    if (!src) {
        if (!rows_per_chunk) return kv_errf(KV_EINVAL, err, errlen, "cuda: weights upload: rows too long");
        host = (float *)malloc(rows_per_chunk * (size_t)w->cols * sizeof(float));
        if (!host) return kv_errf(KV_ENOMEM, err, errlen, "cuda: weights upload: out of host memory");
    }
    kv_status st = KV_OK;
    if (src && c->f32w) {
        CU_TRY(kvc_memcpy_async(d, src, n * sizeof(float), cudaMemcpyHostToDevice, c->st), "weights upload");
        return KV_OK;
    }
    /* staging (device) is reused by the next chunk's copy only after this chunk's convert
     * kernel ran: both are ordered on c->st */
    for (size_t r = 0; r < (size_t)w->rows; r += rows_per_chunk) {
        size_t nr = (size_t)w->rows - r < rows_per_chunk ? (size_t)w->rows - r : rows_per_chunk;
        size_t k = nr * (size_t)w->cols, i = r * (size_t)w->cols;
        const float *chunk = src ? src + i : host;
        if (!src)
            for (size_t q = 0; q < nr; q++)
                kv_dequant_row(w->type, (const char *)w->data + (r + q) * w->row_bytes, host + q * (size_t)w->cols,
                               w->cols);
        /* pageable source: the copy has taken the bytes when it returns, so host is reusable */
        cudaError_t e = kvc_memcpy_async(c->f32w ? (void *)((float *)d + i) : (void *)staging, chunk,
                                        k * sizeof(float), cudaMemcpyHostToDevice, c->st);
        if (e != cudaSuccess) {
            st = kv_errf(KV_EIO, err, errlen, "cuda: weights upload: %s", cudaGetErrorString(e));
            break;
        }
        if (!c->f32w) {
            k_convert<__nv_bfloat16><<<grid_for(k, 256), 256, 0, c->st>>>((__nv_bfloat16 *)d + i, staging, k);
            kvc_launched();
            e = cudaGetLastError();
            if (e != cudaSuccess) {
                st = kv_errf(KV_EIO, err, errlen, "cuda: convert: %s", cudaGetErrorString(e));
                break;
            }
        }
    }
    free(host);
    return st;
}

/* f32 vectors (norms, biases) stay f32. */
static kv_status put_f32(struct cuda_ctx *c, float **dst, const float *const *srcs, const size_t *ns, int nsrc,
                         bool is_norm, uint64_t seed, char *err, size_t errlen) {
    size_t tot = 0;
    for (int i = 0; i < nsrc; i++) tot += ns[i];
    kv_status st = dev_alloc((void **)dst, tot * sizeof(float), err, errlen);
    if (st) return st;
    size_t off = 0;
    for (int i = 0; i < nsrc; i++) {
        if (srcs[i]) {
            CU_TRY(kvc_memcpy_async(*dst + off, srcs[i], ns[i] * sizeof(float), cudaMemcpyHostToDevice, c->st),
                   "upload");
        } else {
            k_fill_random<float><<<grid_for(ns[i], 256), 256, 0, c->st>>>(*dst + off, ns[i], seed + (uint64_t)i,
                                                                            is_norm ? 1.0f : 0.0f, 0.1f);
            LAUNCHED("fill random");
        }
        off += ns[i];
    }
    c->weight_bytes += tot * sizeof(float);
    return KV_OK;
}

static kv_status alloc_w(struct cuda_ctx *c, void **p, size_t n, char *err, size_t errlen) {
    c->weight_bytes += n * c->wsz;
    return dev_alloc(p, n * c->wsz, err, errlen);
}


static kv_status upload_model(struct cuda_ctx *c, uint64_t seed, char *err, size_t errlen) {
    const model_t *m = c->m;
    const struct model_config *cfg = &m->cfg;
    bool rnd = seed != 0;
    size_t dim = (size_t)cfg->dim, V = (size_t)cfg->n_vocab, ffn = (size_t)cfg->ffn_dim;
    size_t qw = (size_t)cfg->n_heads * cfg->head_dim, kw = (size_t)cfg->n_kv_heads * cfg->head_dim;
    size_t staging_floats = (size_t)16 << 20; /* 64 MiB */
    float *staging = NULL;
    kv_status st = KV_OK;
    if (!c->f32w && !rnd && (st = dev_alloc((void **)&staging, staging_floats * sizeof(float), err, errlen)))
        return st;
#define PUT(dst, off, src, n, norm, sd)                                                                      \
    do {                                                                                                     \
        if ((st = put_weights(c, dst, off, rnd ? NULL : (src), n, norm, sd, staging, staging_floats, err,   \
                              errlen)))                                                                      \
            goto out;                                                                                        \
    } while (0)
    if ((st = alloc_w(c, &c->tok_embd, V * dim, err, errlen))) goto out;
    PUT(c->tok_embd, 0, &m->w.tok_embd, V * dim, false, seed + 1);
    if (cfg->tied_embeddings || (!rnd && m->w.output.data == m->w.tok_embd.data)) {
        c->output = c->tok_embd;
    } else {
        if ((st = alloc_w(c, &c->output, V * dim, err, errlen))) goto out;
        PUT(c->output, 0, &m->w.output, V * dim, false, seed + 2);
    }
    {
        const float *srcs[1] = {rnd ? NULL : m->w.out_norm};
        size_t ns[1] = {dim};
        if ((st = put_f32(c, &c->out_norm, srcs, ns, 1, true, seed + 3, err, errlen))) goto out;
    }
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct layer_weights *lw = rnd ? NULL : &m->w.layers[l];
        struct cuda_layer *L = &c->L[l];
        uint64_t s = seed + 100 + (uint64_t)l * 16;
        if ((st = alloc_w(c, &L->wqkv, (qw + 2 * kw) * dim, err, errlen))) goto out;
        PUT(L->wqkv, 0, lw ? &lw->wq : NULL, qw * dim, false, s + 0);
        PUT(L->wqkv, qw * dim, lw ? &lw->wk : NULL, kw * dim, false, s + 1);
        PUT(L->wqkv, (qw + kw) * dim, lw ? &lw->wv : NULL, kw * dim, false, s + 2);
        if ((st = alloc_w(c, &L->wo, dim * qw, err, errlen))) goto out;
        PUT(L->wo, 0, lw ? &lw->wo : NULL, dim * qw, false, s + 3);
        if ((st = alloc_w(c, &L->wgu, 2 * ffn * dim, err, errlen))) goto out;
        PUT(L->wgu, 0, lw ? &lw->w_gate : NULL, ffn * dim, false, s + 4);
        PUT(L->wgu, ffn * dim, lw ? &lw->w_up : NULL, ffn * dim, false, s + 5);
        if ((st = alloc_w(c, &L->wdown, dim * ffn, err, errlen))) goto out;
        PUT(L->wdown, 0, lw ? &lw->w_down : NULL, dim * ffn, false, s + 6);
        const float *an[1] = {lw ? lw->attn_norm : NULL}, *fn[1] = {lw ? lw->ffn_norm : NULL};
        size_t nd[1] = {dim};
        if ((st = put_f32(c, &L->attn_norm, an, nd, 1, true, s + 7, err, errlen))) goto out;
        if ((st = put_f32(c, &L->ffn_norm, fn, nd, 1, true, s + 8, err, errlen))) goto out;
        if (cfg->attn_bias) {
            const float *b[3] = {lw ? lw->bq : NULL, lw ? lw->bk : NULL, lw ? lw->bv : NULL};
            size_t nb[3] = {qw, kw, kw};
            if ((st = put_f32(c, &L->bqkv, b, nb, 3, false, s + 9, err, errlen))) goto out;
        }
        if (cfg->qk_norm) {
            const float *qn[1] = {lw ? lw->q_norm : NULL}, *kn[1] = {lw ? lw->k_norm : NULL};
            size_t nh[1] = {(size_t)cfg->head_dim};
            if ((st = put_f32(c, &L->q_norm, qn, nh, 1, true, s + 12, err, errlen))) goto out;
            if ((st = put_f32(c, &L->k_norm, kn, nh, 1, true, s + 13, err, errlen))) goto out;
        }
    }
    {
        float *f = (float *)malloc((size_t)(cfg->head_dim / 2) * sizeof(float));
        if (!f) {
            st = kv_errf(KV_ENOMEM, err, errlen, "cuda backend: out of host memory");
            goto out;
        }
        backend_rope_inv_freq(cfg, f);
        const float *srcs[1] = {f};
        size_t ns[1] = {(size_t)cfg->head_dim / 2};
        st = put_f32(c, &c->inv_freq, srcs, ns, 1, false, 0, err, errlen);
        if (!st) {
            cudaError_t e = kvc_stream_sync(c->st); /* f is freed next */
            if (e != cudaSuccess) st = kv_errf(KV_EIO, err, errlen, "cuda: upload: %s", cudaGetErrorString(e));
        }
        free(f);
        if (st) goto out;
    }
    {
        cudaError_t e = kvc_stream_sync(c->st);
        if (e != cudaSuccess) st = kv_errf(KV_EIO, err, errlen, "cuda: weights upload: %s", cudaGetErrorString(e));
    }
#undef PUT
out:
    if (staging) kvc_free(staging);
    return st;
}

/* ---- ops ---- */

static void free_pool(struct cuda_ctx *c) {
    if (c->pool) kvc_free(c->pool);
    c->pool = NULL;
}

static kv_status cuda_kv_alloc(backend_t *be, int n_blocks, const struct kv_geometry *g) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    const struct model_config *cfg = &c->m->cfg;
    kvc_stream_sync(c->st);
    graphs_clear(c);
    free_pool(c);
    be->n_blocks = 0;
    memset(&be->geom, 0, sizeof be->geom);
    if (n_blocks < 1 || !g || g->n_layers != cfg->n_layers || g->n_kv_heads != cfg->n_kv_heads ||
        g->head_dim != cfg->head_dim || g->tokens_per_block < 1) {
        KV_ERROR("cuda backend: kv_alloc: geometry does not match the model or n_blocks < 1");
        return KV_EINVAL;
    }
    if (g->kv_dtype != KV_DTYPE_F32 && g->kv_dtype != KV_DTYPE_BF16) {
        KV_ERROR("cuda backend: kv_alloc: KV cache dtype %s (%d) is not supported (f32 or bf16)",
                 kv_dtype_name(g->kv_dtype), g->kv_dtype);
        return KV_EINVAL;
    }
    if (g->kv_dtype == KV_DTYPE_BF16 && g->head_dim % 4) {
        KV_ERROR("cuda backend: kv_alloc: a bf16 KV cache needs head_dim %% 4 == 0 (head_dim %d)", g->head_dim);
        return KV_EINVAL;
    }
    /* elements per block; bytes = kv_block_bytes(g) */
    size_t bf = (size_t)g->n_layers * 2 * (size_t)g->n_kv_heads * (size_t)g->tokens_per_block * (size_t)g->head_dim;
    size_t bb = bf * kv_dtype_size(g->kv_dtype);
    cudaError_t e = kvc_malloc((void **)&c->pool, (size_t)n_blocks * bb);
    if (e != cudaSuccess) {
        c->pool = NULL;
        KV_ERROR("cuda backend: kv_alloc of %d blocks x %zu bytes: %s", n_blocks, bb, cudaGetErrorString(e));
        return e == cudaErrorMemoryAllocation ? KV_ENOMEM : KV_EIO;
    }
    e = kvc_memset_async(c->pool, 0, (size_t)n_blocks * bb, c->st);
    if (e == cudaSuccess) e = kvc_stream_sync(c->st);
    if (e != cudaSuccess) {
        free_pool(c);
        KV_ERROR("cuda backend: kv_alloc: %s", cudaGetErrorString(e));
        return KV_EIO;
    }
    KV_INFO("cuda backend: KV pool %d blocks x %zu bytes, %s K/V (%.2f GiB)", n_blocks, bb, kv_dtype_name(g->kv_dtype),
            (double)n_blocks * (double)bb / (1024.0 * 1024.0 * 1024.0));
    c->block_floats = bf;
    c->block_bytes = bb;
    c->kv_dtype = g->kv_dtype;
    c->tpb = g->tokens_per_block;
    be->geom = *g;
    be->n_blocks = n_blocks;
    return KV_OK;
}

static kv_status validate(backend_t *be, const struct batch *b, char *err, size_t errlen) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    const struct model_config *cfg = &c->m->cfg;
    if (!b || b->n_seqs < 0 || (b->n_seqs > 0 && !b->seqs))
        return kv_errf(KV_EINVAL, err, errlen, "forward: bad batch");
    if (b->n_seqs > 0 && (!c->pool || be->n_blocks < 1))
        return kv_errf(KV_EINVAL, err, errlen, "forward: KV pool not allocated");
    long total = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        if (s->n_tokens < 1 || !s->tokens || s->n_past < 0 || s->n_tokens > INT32_MAX / 2 ||
            s->n_past > INT32_MAX / 2)
            return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: n_tokens %d / n_past %d invalid", i,
                           s->n_tokens, s->n_past);
        if (s->logits != BATCH_LOGITS_NONE && s->logits != BATCH_LOGITS_LAST && s->logits != BATCH_LOGITS_ALL)
            return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: bad logits mode %d", i, (int)s->logits);
        int need = (s->n_past + s->n_tokens + c->tpb - 1) / c->tpb;
        if (s->n_blocks < need || !s->block_table)
            return kv_errf(KV_EINVAL, err, errlen,
                           "forward: seq %d: block table has %d blocks, %d needed for %d positions", i, s->n_blocks,
                           need, s->n_past + s->n_tokens);
        for (int k = 0; k < need; k++)
            if (s->block_table[k] < 0 || s->block_table[k] >= be->n_blocks)
                return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: block id %d (entry %d) outside pool of %d",
                               i, (int)s->block_table[k], k, be->n_blocks);
        for (int k = 0; k < s->n_tokens; k++)
            if (s->tokens[k] < 0 || s->tokens[k] >= cfg->n_vocab)
                return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: token id %d outside vocabulary of %d", i,
                               (int)s->tokens[k], cfg->n_vocab);
        total += s->n_tokens;
        if (total > (1 << 20)) return kv_errf(KV_EINVAL, err, errlen, "forward: batch too large");
    }
    return KV_OK;
}

/* Y[M,N] (f32) = X[M,K] W[N,K]^T, X and W in the weight dtype, f32 accumulation. */
/* Tile shapes of k_gemm_inv by row count (any choice gives the same bits: see kernels.cuh):
 * M <= 16: 16 x 32 tiles, 2 warps, 6 stages (decode: many CTAs, deep prefetch of W);
 * M <= 128: 32 x 64, 4 warps, 4 stages; larger: 64 x 128, 8 warps of 2 x 2 fragments, 3 stages. */
typedef ig_cfg<1, 2, 1, 1, 6> ig_small;
typedef ig_cfg<2, 2, 1, 2, 4> ig_mid;
typedef ig_cfg<2, 4, 2, 2, 3> ig_big;

/* Allows the dynamic shared memory the k_gemm_inv variants need (once per device use). */
static cudaError_t inv_gemm_setup(void) {
    cudaError_t e = cudaFuncSetAttribute(k_gemm_inv<1, 2, 1, 1, 6>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)ig_small::smem);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_gemm_inv<2, 2, 1, 2, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)ig_mid::smem);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_gemm_inv<2, 4, 2, 2, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)ig_big::smem);
    return e;
}

/* The batch-invariant product (deterministic mode): Y[M,N] = X[M,K] W[N,K]^T on stream st.
 * bf16 (f32w false) with K % 8 == 0 and 16-byte aligned operands: k_gemm_inv; otherwise the
 * scalar kernel. The choice depends on K, the dtype and the (fixed) buffers, never on M. */
static kv_status inv_gemm(bool f32w, const void *X, int M, int K, const void *W, int N, float *Y, cudaStream_t st,
                          char *err, size_t errlen) {
    bool tc = !f32w && K % 8 == 0 && ((uintptr_t)X % 16) == 0 && ((uintptr_t)W % 16) == 0;
    if (!tc) {
        dim3 g((unsigned)((N + 127) / 128), (unsigned)(M < 65535 ? M : 65535));
        if (f32w) k_gemm_inv_scalar<float><<<g, 128, 0, st>>>((const float *)X, (const float *)W, Y, M, N, K);
        else
            k_gemm_inv_scalar<__nv_bfloat16><<<g, 128, 0, st>>>((const __nv_bfloat16 *)X, (const __nv_bfloat16 *)W, Y,
                                                                 M, N, K);
        LAUNCHED("invariant gemm (scalar)");
        return KV_OK;
    }
    const __nv_bfloat16 *x = (const __nv_bfloat16 *)X, *w = (const __nv_bfloat16 *)W;
#define IG_LAUNCH(CF, WM, WN, FM, FN, S)                                                                          \
    k_gemm_inv<WM, WN, FM, FN, S><<<dim3((unsigned)((N + CF::BN - 1) / CF::BN), (unsigned)((M + CF::BM - 1) / CF::BM)), \
                                    CF::NT, CF::smem, st>>>(x, w, Y, M, N, K)
    if (M <= 16) IG_LAUNCH(ig_small, 1, 2, 1, 1, 6);
    else if (M <= 128) IG_LAUNCH(ig_mid, 2, 2, 1, 2, 4);
    else IG_LAUNCH(ig_big, 2, 4, 2, 2, 3);
#undef IG_LAUNCH
    LAUNCHED("invariant gemm");
    return KV_OK;
}

static kv_status gemm(struct cuda_ctx *c, const void *X, int M, int K, const void *W, int N, float *Y, char *err,
                      size_t errlen) {
    const float alpha = 1.0f, beta = 0.0f;
    if (c->det) return inv_gemm(c->f32w, X, M, K, W, N, Y, c->st, err, errlen);
    if (!c->f32w && M <= c->gemv_max && K % 8 == 0) {
        unsigned g = (unsigned)((N + GEMV_WARPS - 1) / GEMV_WARPS);
        const __nv_bfloat16 *x = (const __nv_bfloat16 *)X, *w = (const __nv_bfloat16 *)W;
#define GV(MM) klaunch(c, k_gemv_bf16<MM>, dim3(g), dim3(32 * GEMV_WARPS), 0, x, w, Y, N, K)
        cudaError_t e;
        switch (M) {
        case 1: e = GV(1); break;
        case 2: e = GV(2); break;
        case 3: e = GV(3); break;
        case 4: e = GV(4); break;
        case 5: e = GV(5); break;
        case 6: e = GV(6); break;
        case 7: e = GV(7); break;
        default: e = GV(8); break;
        }
#undef GV
        CU_TRY(e, "gemv");
        return KV_OK;
    }
    kvc_launched();
    cudaDataType_t t = c->f32w ? CUDA_R_32F : CUDA_R_16BF;
    BLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, W, t, K, X, t, K, &beta, Y, CUDA_R_32F,
                          N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             "gemm");
    return KV_OK;
}

template <typename TA>
static kv_status launch_norm(struct cuda_ctx *c, float *x, const float *add, const float *w, int n_out,
                             const int32_t *rows, int write_back, char *err, size_t errlen) {
    const struct model_config *cfg = &c->m->cfg;
    KLAUNCH("rmsnorm", k_add_rmsnorm<TA>, dim3(n_out), dim3(RMS_THREADS), 0, x, add, w, (TA *)c->a, cfg->dim,
            cfg->rms_eps, rows, write_back);
    return KV_OK;
}

/* k_attn_flash instances: HDP = head_dim rounded up to 16; MT 1 or 2 m tiles per warp; f32 pool
 * (fp16 mma) and bf16 pool. */
#define FL_FOR_HDP(X, MT) X(16, MT) X(32, MT) X(48, MT) X(64, MT) X(80, MT) X(96, MT) X(112, MT) X(128, MT)
/* Allows the dynamic shared memory the k_attn_flash instances need (once per device use). */
static cudaError_t flash_setup(void) {
    cudaError_t e = cudaSuccess;
#define FL_SET(H, MT)                                                                                        \
    if (e == cudaSuccess)                                                                                    \
        e = cudaFuncSetAttribute(k_attn_flash<H, MT, float, __half>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                 (int)fl_smem_bytes(H, MT));                                                 \
    if (e == cudaSuccess)                                                                                    \
        e = cudaFuncSetAttribute(k_attn_flash<H, MT, __nv_bfloat16, __nv_bfloat16>,                          \
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fl_smem_bytes(H, MT));
    FL_FOR_HDP(FL_SET, 1)
    FL_FOR_HDP(FL_SET, 2)
#undef FL_SET
    return e;
}

/* Which rows of a step run k_attn_flash. When the backend allows it (bf16 weights, not
 * deterministic, not KVSERVE_CUDA_FLASH=0, head_dim % 8 == 0 and <= 128, GQA group <= 64 MT),
 * every sequence with more than one new token (a prefill chunk) runs k_attn_flash, in tiles
 * of 64 MT / group consecutive rows of that sequence, and single-token rows run the split
 * kernels (their row list); graph steps too. So the kernel a row runs depends only on its own
 * sequence's step, never on what else is in the batch. Returns the tile count (0: every row
 * runs the split kernels) and the split kernels' row count in *n1. */
static int flash_tiles(const struct cuda_ctx *c, const struct batch *b, bool bf16_act, int *n1) {
    const struct model_config *cfg = &c->m->cfg;
    int group = cfg->n_heads / cfg->n_kv_heads, rpt = FL_BM_OF(c->flash_mt) / group;
    *n1 = 0;
    if (!c->flash || !bf16_act || c->det || cfg->head_dim % 8 || cfg->head_dim > 128 || rpt < 1) return 0;
    int tiles = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        int n = b->seqs[i].n_tokens;
        if (n > 1) tiles += (n + rpt - 1) / rpt;
        else *n1 += n;
    }
    if (!tiles) *n1 = 0;
    return tiles;
}
static thread_local const int32_t *g_tile_pos; /* qsort context: row positions of the step */
/* heaviest tiles (last position) first, so the long causal tiles do not trail the grid */
static int tile_cmp(const void *a, const void *b) {
    const int32_t *x = (const int32_t *)a, *y = (const int32_t *)b;
    int32_t px = g_tile_pos[x[0]] + x[1], py = g_tile_pos[y[0]] + y[1];
    return (px < py) - (px > py);
}

/* Query heads per attention CTA: the largest divisor of the GQA group <= ATT_HC. */
static int att_hc(const struct model_config *cfg) {
    int group = cfg->n_heads / cfg->n_kv_heads, d = group < ATT_HC ? group : ATT_HC;
    while (group % d) d--;
    return d;
}

struct enq_args {
    int T, L, max_parts, split_len;
    bool attn2; /* k_attn_part2 for this step */
    size_t meta_n; /* int32 entries of metadata to upload */
    int n_tiles;   /* > 0: k_attn_flash over these tiles (pairs at d_meta + tiles_off) */
    int n1;        /* with n_tiles: rows of the split kernels (list at d_meta + rows1_off) */
    size_t tiles_off, rows1_off, bt_off;
};
template <typename TA> static kv_status enqueue_step(struct cuda_ctx *c, const struct enq_args *ea, char *err, size_t errlen);

template <typename TA>
static kv_status forward_t(backend_t *be, const struct batch *b, float *logits, const struct backend_sampling *sp,
                           struct backend_sample_out *sout, char *err, size_t errlen) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    const model_t *m = c->m;
    const struct model_config *cfg = &m->cfg;
    int T = 0, max_pos = 0, L = 0;
    size_t nbt = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        T += s->n_tokens;
        int e = s->n_past + s->n_tokens;
        if (e > max_pos) max_pos = e;
        nbt += (size_t)(e + c->tpb - 1) / c->tpb;
        L += s->logits == BATCH_LOGITS_ALL ? s->n_tokens : s->logits == BATCH_LOGITS_LAST ? 1 : 0;
    }
    if (T == 0) return KV_OK;
    int dim = cfg->dim, hd = cfg->head_dim, nh = cfg->n_heads;
    kv_status st;

    /* scratch */
    if (T > c->cap_rows) {
        int cap = (T + 63) / 64 * 64;
        kvc_free(c->x), kvc_free(c->h), kvc_free(c->a);
        c->x = NULL, c->h = NULL, c->a = NULL, c->cap_rows = 0;
        CU_TRY(kvc_malloc((void **)&c->x, (size_t)cap * dim * sizeof(float)), "cudaMalloc (x)");
        CU_TRY(kvc_malloc((void **)&c->h, (size_t)cap * c->hw * sizeof(float)), "cudaMalloc (h)");
        CU_TRY(kvc_malloc(&c->a, (size_t)cap * c->aw * sizeof(TA)), "cudaMalloc (a)");
        c->cap_rows = cap;
    }
    if ((st = grow((void **)&c->logits, &c->cap_logits, (size_t)(L ? L : 1) * cfg->n_vocab * sizeof(float), err,
                   errlen)))
        return st;
    int n1 = 0, n_tiles = flash_tiles(c, b, sizeof(TA) == 2, &n1);
    int T1 = n_tiles ? n1 : T, max_pos1 = 0; /* rows of the split kernels, and their last position */
    for (int i = 0; i < b->n_seqs; i++)
        if (!n_tiles || b->seqs[i].n_tokens == 1)
            max_pos1 = b->seqs[i].n_past + b->seqs[i].n_tokens > max_pos1 ? b->seqs[i].n_past + b->seqs[i].n_tokens
                                                                            : max_pos1;
    /* attention parts: 128 positions each (k_attn_part2: 32 per warp) or 32 / 16 (k_attn_part),
     * larger while rows * parts > 8192 */
    int n_groups = nh / att_hc(cfg);
    bool attn2 = c->attn2 && (c->attn2_force || (long)T1 * n_groups * ((max_pos1 + 127) / 128) >= 2 * c->n_sm);
    int split_len = attn2 ? 128 : 32;
    /* few rows (batch-1 decode at short contexts): 16-position parts when 32-position ones would
     * leave fewer than 2 CTAs per SM (H200, Llama-3-8B shape, batch 1 / 512: 5.05 -> 4.77 ms;
     * at 4096 and at batch 8 the 32-position parts stay faster) */
    if (!attn2 && (long)T1 * n_groups * ((max_pos1 + 31) / 32) < 2 * c->n_sm) split_len = 16;
    if (c->split_set) /* KVSERVE_CUDA_ATTN_SPLIT (experiments; k_attn_part2 needs multiples of 32) */
        split_len = attn2 ? (c->split_set + 31) / 32 * 32 : c->split_set;
    while ((long)T1 * ((max_pos1 + split_len - 1) / split_len) > 8192 && split_len < (1 << 24)) split_len *= 2;
    int max_parts = max_pos1 ? (max_pos1 + split_len - 1) / split_len : 1;
    if (c->det) { /* batch-invariant: one kernel, each row's split from its own position (det_split_len) */
        attn2 = c->attn2;
        split_len = 0;
        /* every row's part count (pos / det_split_len(pos) + 1) is at most this */
        max_parts = max_pos - 1 < 128 * DET_MAX_PARTS ? (max_pos - 1) / 128 + 1 : DET_MAX_PARTS;
    }
    bool use_graph = c->graphs && T <= GRAPH_MAX_ROWS;
    if (use_graph) { /* round the attention grid up so one graph serves many steps */
        int p2 = 1;
        while (p2 < max_parts) p2 *= 2;
        max_parts = p2;
    }
    size_t slots = (size_t)T * nh * max_parts;
    size_t part_bytes = slots * hd * sizeof(float), ml_bytes = slots * 2 * sizeof(float);
    if ((st = grow((void **)&c->part, &c->cap_part, part_bytes, err, errlen))) return st;
    if ((st = grow((void **)&c->part_ml, &c->cap_ml, ml_bytes, err, errlen))) return st;
    /* metadata: tokens[T] pos[T] btoff[T] logit_rows[L] tiles[2 n_tiles] rows1[n1] bt[nbt], then
     * (forward_sample) at an even entry the sampling requests (kvs_meta_len); every offset but
     * the sampling one is fixed by (T, L, n_tiles, n1), which a graph's key holds */
    size_t tiles_off = (size_t)3 * T + L, rows1_off = tiles_off + 2 * (size_t)n_tiles, bt_off = rows1_off + n1;
    size_t samp_off = (bt_off + nbt + 1) & ~(size_t)1;
    size_t meta_n = sp ? samp_off + kvs_meta_len(sp, L) : bt_off + nbt;
    if (meta_n > c->cap_meta) {
        size_t cap = meta_n * 2;
        if (c->h_meta) kvc_free_host(c->h_meta);
        if (c->d_meta) kvc_free(c->d_meta);
        c->h_meta = NULL, c->d_meta = NULL, c->cap_meta = 0;
        CU_TRY(kvc_host_alloc((void **)&c->h_meta, cap * sizeof(int32_t), cudaHostAllocDefault), "cudaHostAlloc");
        CU_TRY(kvc_malloc((void **)&c->d_meta, cap * sizeof(int32_t)), "cudaMalloc (meta)");
        c->cap_meta = cap;
    }
    int32_t *h_tok = c->h_meta, *h_pos = h_tok + T, *h_bto = h_pos + T, *h_lr = h_bto + T, *h_bt = c->h_meta + bt_off;
    int r = 0, li = 0;
    size_t bo = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        int need = (s->n_past + s->n_tokens + c->tpb - 1) / c->tpb;
        memcpy(h_bt + bo, s->block_table, (size_t)need * sizeof(int32_t));
        for (int k = 0; k < s->n_tokens; k++, r++) {
            h_tok[r] = s->tokens[k];
            h_pos[r] = s->n_past + k;
            h_bto[r] = (int32_t)bo;
            if (s->logits == BATCH_LOGITS_ALL || (s->logits == BATCH_LOGITS_LAST && k == s->n_tokens - 1))
                h_lr[li++] = r;
        }
        bo += (size_t)need;
    }
    if (n_tiles) {
        int32_t *h_tl = c->h_meta + tiles_off, *h_r1 = c->h_meta + rows1_off;
        int group = nh / cfg->n_kv_heads, rpt = FL_BM_OF(c->flash_mt) / group, k = 0, k1 = 0;
        r = 0;
        for (int i = 0; i < b->n_seqs; i++) {
            int n = b->seqs[i].n_tokens;
            if (n == 1) h_r1[k1++] = r;
            else
                for (int t = 0; t < n; t += rpt, k++) {
                    h_tl[2 * k] = r + t;
                    h_tl[2 * k + 1] = n - t < rpt ? n - t : rpt;
                }
            r += n;
        }
        g_tile_pos = h_pos;
        qsort(h_tl, (size_t)n_tiles, 2 * sizeof(int32_t), tile_cmp);
    }
    int n_sort = 0;
    if (sp && (st = kvs_meta_fill(sp, L, cfg->n_vocab, c->h_meta + samp_off, &n_sort, err, errlen))) return st;
    struct enq_args ea = {T, L, max_parts, split_len, attn2, use_graph ? c->cap_meta : meta_n, n_tiles, n1, tiles_off,
                          rows1_off, bt_off};
    if (!use_graph) {
        if ((st = enqueue_step<TA>(c, &ea, err, errlen))) return st;
    } else {
        struct graph_key k;
        memset(&k, 0, sizeof k);
        k.T = T, k.L = L, k.parts = max_parts, k.split_len = split_len, k.tpb = c->tpb, k.attn2 = attn2;
        k.n_tiles = n_tiles, k.n1 = n1;
        k.cap_meta = c->cap_meta, k.block_floats = c->block_floats, k.kv_dtype = c->kv_dtype;
        const void *ps[9] = {c->x, c->h, c->a, c->logits, c->part, c->part_ml, c->d_meta, c->h_meta, c->pool};
        memcpy(k.ptr, ps, sizeof ps);
        struct graph_entry *g = NULL;
        for (int i = 0; i < GRAPH_CACHE && !g; i++)
            if (c->gcache[i].exec && !memcmp(&c->gcache[i].k, &k, sizeof k)) g = &c->gcache[i];
        if (!g) {
            g = &c->gcache[c->gcache_next];
            c->gcache_next = (c->gcache_next + 1) % GRAPH_CACHE;
            if (g->exec) cudaGraphExecDestroy(g->exec), g->exec = NULL;
            CU_TRY(cudaStreamBeginCapture(c->st, c->capture_mode), "begin capture");
            kvc_capturing = 1;
            st = enqueue_step<TA>(c, &ea, err, errlen);
            kvc_capturing = 0;
            cudaGraph_t graph = NULL;
            cudaError_t e = cudaStreamEndCapture(c->st, &graph);
            if (!st && e != cudaSuccess)
                st = kv_errf(KV_EIO, err, errlen, "cuda: end capture: %s", cudaGetErrorString(e));
            if (!st) {
                e = kvc_graph_instantiate(&g->exec, graph);
                if (e != cudaSuccess) {
                    g->exec = NULL;
                    st = kv_errf(KV_EIO, err, errlen, "cuda: graph instantiate: %s", cudaGetErrorString(e));
                }
            }
            if (graph) cudaGraphDestroy(graph);
            cudaGetLastError();
            if (st) return st;
            g->k = k;
        }
        CU_TRY(kvc_graph_launch(g->exec, c->st), "graph launch");
    }
    if (sp) {
        if ((st = kvs_enqueue(&c->samp, c->st, c->logits, L, cfg->n_vocab, c->d_meta + samp_off, n_sort, err, errlen)))
            return st;
    } else if (L > 0) {
        CU_TRY(kvc_memcpy_async(logits, c->logits, (size_t)L * cfg->n_vocab * sizeof(float), cudaMemcpyDeviceToHost,
                               c->st),
               "logits download");
    }
    CU_TRY(kvc_stream_sync(c->st), "forward");
    if (sp) kvs_collect(&c->samp, sp, L, sout);
    return KV_OK;
}

/* Everything of one step on the stream after the host metadata is ready: metadata upload,
 * embedding, layers, output head into c->logits. Capturable into a graph. */
template <typename TA> static kv_status enqueue_step(struct cuda_ctx *c, const struct enq_args *ea, char *err, size_t errlen) {
    const struct model_config *cfg = &c->m->cfg;
    int T = ea->T, L = ea->L, max_parts = ea->max_parts, split_len = ea->split_len;
    int dim = cfg->dim, hd = cfg->head_dim, nh = cfg->n_heads, nkv = cfg->n_kv_heads, ffn = cfg->ffn_dim;
    int qw = nh * hd, kw = nkv * hd, qkvw = qw + 2 * kw;
    kv_status st;
    CU_TRY(kvc_memcpy_async(c->d_meta, c->h_meta, ea->meta_n * sizeof(int32_t), cudaMemcpyHostToDevice, c->st),
           "metadata upload");
    const int32_t *d_tok = c->d_meta, *d_pos = d_tok + T, *d_bto = d_pos + T, *d_lr = d_bto + T;
    const int32_t *d_bt = c->d_meta + ea->bt_off, *d_rows1 = ea->n_tiles ? c->d_meta + ea->rows1_off : NULL;
    const unsigned T1 = (unsigned)(ea->n_tiles ? ea->n1 : T); /* rows of the split kernels */

    k_embed<TA><<<T, 1024, 0, c->st>>>((const TA *)c->tok_embd, d_tok, c->x, dim);
    LAUNCHED("embed");
    int group = nh / nkv, hc = att_hc(cfg);
    float scale = 1.0f / sqrtf((float)hd);
    bool kvb = c->kv_dtype == KV_DTYPE_BF16;
    size_t att_smem = (size_t)ATT_WARPS * hc * (hd + 2) * sizeof(float);
    size_t att2_smem = ((size_t)hc * hd + ATT_WARPS * ATT_HC * 32 + (size_t)ATT_WARPS * hc * (hd + 2)) * sizeof(float);
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct cuda_layer *Ly = &c->L[l];
        /* attention block: x += h (previous FFN output) then norm */
        if (!(c->skip & SKIP_NORM) &&
            (st = launch_norm<TA>(c, c->x, l ? c->h : NULL, Ly->attn_norm, T, NULL, l ? 1 : 0, err, errlen)))
            return st;
        if (!(c->skip & SKIP_GEMM) && (st = gemm(c, c->a, T, dim, Ly->wqkv, qkvw, c->h, err, errlen))) return st;
#define QKV(TK)                                                                                              \
    KLAUNCH("qkv_post", k_qkv_post<TK>, dim3((unsigned)T, (unsigned)((nh + nkv + QKV_WARPS - 1) / QKV_WARPS)), \
            dim3(32 * QKV_WARPS), 0, c->h, qkvw, (const float *)Ly->bqkv, (const float *)Ly->q_norm,          \
            (const float *)Ly->k_norm, (const float *)c->inv_freq, d_pos, d_bto, d_bt, (TK *)c->pool,         \
            c->block_floats, l, nh, nkv, hd, c->tpb, cfg->rms_eps, cfg->rope_neox ? 1 : 0)
        if (c->skip & SKIP_QKV) {
        } else if (kvb) QKV(__nv_bfloat16);
        else QKV(float);
#undef QKV
        if (c->skip & SKIP_ATTN) goto attn_done;
        if (ea->n_tiles) { /* prefill: tensor-core flash attention straight into c->a */
            const int32_t *d_tiles = c->d_meta + ea->tiles_off;
            dim3 fg((unsigned)ea->n_tiles, (unsigned)nkv);
            float sl2 = scale * 1.4426950408889634f;
#define FL_ARGS(TK)                                                                                           \
    (const float *)c->h, qkvw, (const TK *)c->pool, c->block_floats, l, nkv, hd, c->tpb, group, d_pos, d_bto, d_bt, \
        d_tiles, sl2, (__nv_bfloat16 *)c->a
#define FL_CASE(H, MT)                                                                                       \
    case H:                                                                                                  \
        if (kvb)                                                                                             \
            KLAUNCH("flash attention", k_attn_flash<H, MT, __nv_bfloat16, __nv_bfloat16>, fg, dim3(32 * FL_WARPS), \
                    fl_smem_bytes(H, MT), FL_ARGS(__nv_bfloat16));                                           \
        else                                                                                                 \
            KLAUNCH("flash attention", k_attn_flash<H, MT, float, __half>, fg, dim3(32 * FL_WARPS),          \
                    fl_smem_bytes(H, MT), FL_ARGS(float));                                                   \
        break;
            int hdp = (hd + 15) / 16 * 16;
            if (c->flash_mt == 1) {
                switch (hdp) {
                    FL_FOR_HDP(FL_CASE, 1)
                default: return kv_errf(KV_EINTERNAL, err, errlen, "cuda: flash attention: head_dim %d", hd);
                }
            } else {
                switch (hdp) {
                    FL_FOR_HDP(FL_CASE, 2)
                default: return kv_errf(KV_EINTERNAL, err, errlen, "cuda: flash attention: head_dim %d", hd);
                }
            }
#undef FL_CASE
#undef FL_ARGS
            if (!ea->n1) goto attn_done;
        }
        {
        dim3 ag(T1, (unsigned)(nh / hc), (unsigned)max_parts);
#define ATT_ARGS(TK)                                                                                           \
    (const float *)c->h, qkvw, (const TK *)c->pool, c->block_floats, l, nkv, hd, c->tpb, group, hc, d_pos, d_bto, \
        d_bt, d_rows1, split_len, max_parts, scale, c->part, c->part_ml
#define ATT2(CH, TK) KLAUNCH("attention", k_attn_part2<CH, TK>, ag, dim3(32 * ATT_WARPS), att2_smem, ATT_ARGS(TK))
#define ATT(D, TK) KLAUNCH("attention", k_attn_part<D, TK>, ag, dim3(32 * ATT_WARPS), att_smem, ATT_ARGS(TK))
#define ATT_ALL(TK)                              \
    do {                                         \
        if (ea->attn2 && hd <= 128) ATT2(1, TK); \
        else if (ea->attn2) ATT2(2, TK);         \
        else if (hd <= 32) ATT(1, TK);           \
        else if (hd <= 64) ATT(2, TK);           \
        else if (hd <= 128) ATT(4, TK);          \
        else ATT(8, TK);                         \
    } while (0)
        if (kvb) ATT_ALL(__nv_bfloat16);
        else ATT_ALL(float);
#undef ATT_ALL
#undef ATT
#undef ATT2
#undef ATT_ARGS
        KLAUNCH("attention combine", k_attn_combine<TA>, dim3(T1, (unsigned)nh),
                dim3((unsigned)((hd + 31) / 32 * 32)), (size_t)max_parts * sizeof(float), (const float *)c->part,
                (const float *)c->part_ml, d_pos, d_rows1, split_len, max_parts, nh, hd, (TA *)c->a);
        }
    attn_done:
        if (!(c->skip & SKIP_GEMM) && (st = gemm(c, c->a, T, qw, Ly->wo, dim, c->h, err, errlen))) return st;
        /* FFN block */
        if (!(c->skip & SKIP_NORM) && (st = launch_norm<TA>(c, c->x, c->h, Ly->ffn_norm, T, NULL, 1, err, errlen)))
            return st;
        if (!(c->skip & SKIP_GEMM) && (st = gemm(c, c->a, T, dim, Ly->wgu, 2 * ffn, c->h, err, errlen))) return st;
        if (!(c->skip & SKIP_SWIGLU))
            KLAUNCH("swiglu", k_swiglu<TA>, dim3(grid_for((size_t)T * ffn, 256)), dim3(256), 0, (const float *)c->h,
                    (TA *)c->a, T, ffn);
        if (!(c->skip & SKIP_GEMM) && (st = gemm(c, c->a, T, ffn, Ly->wdown, dim, c->h, err, errlen))) return st;
    }
    if (L > 0) {
        /* last residual add fused into the output norm, on the logit rows only */
        if ((st = launch_norm<TA>(c, c->x, c->h, c->out_norm, L, d_lr, 0, err, errlen))) return st;
        if ((st = gemm(c, c->a, L, dim, c->output, cfg->n_vocab, c->logits, err, errlen))) return st;
    }
    return KV_OK;
}

/* A failed CUDA call may leave the context unusable (a sticky error: an illegal address, a
 * trap, ...: every later call returns it). After a failure, one 4-byte memset on the stream
 * and a sync tell: if they fail too, the backend is marked unhealthy for good (c->sick,
 * healthy() false, every later forward KV_EIO without touching the device). */
static void check_sticky(struct cuda_ctx *c, const char *err) {
    if (__atomic_load_n(&c->sick, __ATOMIC_ACQUIRE)) return;
    cudaError_t e = c->probe ? kvc_memset_async(c->probe, 0, 4, c->st) : cudaErrorInvalidValue;
    if (e == cudaSuccess) e = kvc_stream_sync(c->st);
    if (e == cudaSuccess) {
        cudaGetLastError(); /* a non-sticky error: cleared, the backend stays usable */
        return;
    }
    snprintf(c->sick_why, sizeof c->sick_why, "CUDA context unusable after: %s (probe: %s)", err,
             cudaGetErrorString(e));
    __atomic_store_n(&c->sick, 1, __ATOMIC_RELEASE);
    KV_ERROR("cuda backend: %s; every later call fails: restart the process", c->sick_why);
}

/* forward (sp NULL) or forward_sample */
static kv_status forward_any(backend_t *be, const struct batch *b, float *logits, const struct backend_sampling *sp,
                             struct backend_sample_out *sout, char *err, size_t errlen) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    kv_status st = validate(be, b, err, errlen);
    if (st) return st;
    int nl = 0;
    for (int i = 0; i < b->n_seqs; i++)
        nl += b->seqs[i].logits == BATCH_LOGITS_ALL ? b->seqs[i].n_tokens : b->seqs[i].logits == BATCH_LOGITS_LAST;
    if (nl > 0 && !sp && !logits) return kv_errf(KV_EINVAL, err, errlen, "forward: logits is NULL");
    if (nl > 0 && sp && !sout) return kv_errf(KV_EINVAL, err, errlen, "forward_sample: out is NULL");
    if (__atomic_load_n(&c->sick, __ATOMIC_ACQUIRE))
        return kv_errf(KV_EIO, err, errlen, "cuda backend unhealthy: %s", c->sick_why);
    CU_TRY(cudaSetDevice(c->dev), "cudaSetDevice");
    long num = ++c->n_forward;
    for (int i = 0; i < c->n_sticky; i++)
        if (c->sticky_at[i] == num) { /* a real sticky fault: a kernel that traps */
            k_trap<<<1, 1, 0, c->st>>>();
            kvc_launched();
        }
    st = c->f32w ? forward_t<float>(be, b, logits, sp, sout, err, errlen)
                 : forward_t<__nv_bfloat16>(be, b, logits, sp, sout, err, errlen);
    if (st == KV_EIO || st == KV_ENOMEM) check_sticky(c, err);
    for (int i = 0; i < c->n_fault && !st; i++)
        if (c->fault_at[i] == num)
            st = kv_errf(KV_EIO, err, errlen, "cuda: forward: %s (injected by KVSERVE_CUDA_FAULT)",
                         cudaGetErrorString(cudaErrorLaunchFailure));
    return st;
}

static kv_status cuda_forward(backend_t *be, const struct batch *b, float *logits, char *err, size_t errlen) {
    return forward_any(be, b, logits, NULL, NULL, err, errlen);
}

static kv_status cuda_forward_sample(backend_t *be, const struct batch *b, const struct backend_sampling *sp,
                                     struct backend_sample_out *out, char *err, size_t errlen) {
    if (!sp && b && batch_n_logits(b) > 0) return kv_errf(KV_EINVAL, err, errlen, "forward_sample: sp is NULL");
    static const struct backend_sampling none = {}; /* only used when no row has logits */
    return forward_any(be, b, NULL, sp ? sp : &none, out, err, errlen);
}

static bool cuda_healthy(backend_t *be, char *why, size_t whylen) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    if (!__atomic_load_n(&c->sick, __ATOMIC_ACQUIRE)) return true;
    if (why && whylen) snprintf(why, whylen, "%s", c->sick_why);
    return false;
}

/* KVSERVE_CUDA_FAULT=forward:N[,N...] -> c->fault_at, sticky:N[,N...] -> c->sticky_at (both
 * may be given, separated by ';'); anything else is refused. */
static kv_status parse_fault(struct cuda_ctx *c, const char *v, char *err, size_t errlen) {
    if (!v || !*v) return KV_OK;
    const char *p = v;
    while (*p) {
        bool sticky = !strncmp(p, "sticky:", 7);
        if (strncmp(p, "forward:", 8) && !sticky)
            return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CUDA_FAULT=%s: expected forward:N[,N...] and/or sticky:N[,N...]",
                           v);
        p += sticky ? 7 : 8;
        for (;;) {
            char *end;
            long n = strtol(p, &end, 10);
            int *cnt = sticky ? &c->n_sticky : &c->n_fault;
            if (end == p || n < 1 || *cnt == 16 || (*end && *end != ',' && *end != ';'))
                return kv_errf(KV_EINVAL, err, errlen,
                               "KVSERVE_CUDA_FAULT=%s: expected forward:N[,N...] and/or sticky:N[,N...] (up to 16 "
                               "numbers >= 1 each, ';' between)", v);
            (sticky ? c->sticky_at : c->fault_at)[(*cnt)++] = n;
            p = end;
            if (*p == ',') p++;
            else break;
        }
        if (*p == ';') p++;
    }
    KV_WARN("cuda backend: KVSERVE_CUDA_FAULT=%s: %d forward call(s) will fail on purpose, %d with a sticky fault", v,
            c->n_fault, c->n_sticky);
    return KV_OK;
}

static kv_status cuda_copy_blocks(backend_t *be, const int32_t *src, const int32_t *dst, int n) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    char err[256];
    size_t errlen = sizeof err;
    if (n <= 0) return n < 0 ? KV_EINVAL : KV_OK;
    for (int i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= be->n_blocks || dst[i] < 0 || dst[i] >= be->n_blocks) return KV_EINVAL;
    size_t bytes = c->block_bytes;
    /* one batched launch unless a destination is also a source (then in order, one by one) */
    bool dep = false;
    for (int i = 0; i < n && !dep; i++)
        for (int j = 0; j < n; j++)
            if (i != j && dst[i] == src[j]) {
                dep = true;
                break;
            }
    kv_status st = KV_OK;
    const int chunk = 256;
    void *dp[256];
    const void *sp[256];
    for (int i = 0; i < n && !st;) {
        int k = 0;
        while (i < n && k < (dep ? 1 : chunk)) {
            if (src[i] != dst[i]) {
                dp[k] = c->pool + (size_t)dst[i] * c->block_bytes;
                sp[k] = c->pool + (size_t)src[i] * c->block_bytes;
                k++;
            }
            i++;
        }
        st = kv_cuda_copy_pages_async(KV_CUDA_D2D, dp, sp, k, bytes, c->st, err, errlen);
    }
    cudaError_t e = kvc_stream_sync(c->st);
    if (!st && e != cudaSuccess) snprintf(err, sizeof err, "%s", cudaGetErrorString(e)), st = KV_EIO;
    if (st) KV_ERROR("cuda backend: copy_blocks: %s", err);
    return st;
}

static bool is_pinned(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* clear */
        return false;
    }
    return a.type == cudaMemoryTypeHost;
}

/* to_host: device blocks -> host[i]; else host[i] -> device blocks. */
static kv_status host_copy(backend_t *be, const int32_t *blocks, void *const *host_dst, const void *const *host_src,
                           int n, bool to_host) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    char err[256] = "";
    size_t errlen = sizeof err;
    if (n == 0) return KV_OK;
    if (n < 0 || !blocks) return KV_EINVAL;
    for (int i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= be->n_blocks || !(to_host ? host_dst[i] : host_src[i])) return KV_EINVAL;
    size_t bytes = c->block_bytes;
    bool pinned = true;
    for (int i = 0; i < n && pinned; i++) pinned = is_pinned(to_host ? host_dst[i] : host_src[i]);
    kv_status st = KV_OK;
    void *dp[256];
    const void *sp[256];
    if (pinned) {
        for (int i = 0; i < n && !st; i += 256) {
            int k = n - i < 256 ? n - i : 256;
            for (int j = 0; j < k; j++) {
                char *d = c->pool + (size_t)blocks[i + j] * c->block_bytes;
                dp[j] = to_host ? host_dst[i + j] : d;
                sp[j] = to_host ? (const void *)d : host_src[i + j];
            }
            st = kv_cuda_copy_pages_async(to_host ? KV_CUDA_D2H : KV_CUDA_H2D, dp, sp, k, bytes, c->st, err, errlen);
        }
        cudaError_t e = kvc_stream_sync(c->st);
        if (!st && e != cudaSuccess) snprintf(err, sizeof err, "%s", cudaGetErrorString(e)), st = KV_EIO;
    } else {
        /* bounce through pinned staging of up to 64 MiB (at least one block) */
        size_t per = bytes ? ((size_t)64 << 20) / bytes : 1;
        if (per < 1) per = 1;
        if (per > 256) per = 256;
        size_t need = per * bytes;
        if (c->bounce_bytes < need) {
            if (c->bounce) kvc_free_host(c->bounce);
            c->bounce = NULL, c->bounce_bytes = 0;
            if (kvc_host_alloc(&c->bounce, need, cudaHostAllocMapped) != cudaSuccess) {
                cudaGetLastError();
                c->bounce = NULL;
                KV_ERROR("cuda backend: host copy: cannot allocate %zu bytes of pinned memory", need);
                return KV_ENOMEM;
            }
            c->bounce_bytes = need;
        }
        for (int i = 0; i < n && !st; i += (int)per) {
            int k = n - i < (int)per ? n - i : (int)per;
            for (int j = 0; j < k; j++) {
                char *d = c->pool + (size_t)blocks[i + j] * c->block_bytes;
                char *h = (char *)c->bounce + (size_t)j * bytes;
                if (!to_host) memcpy(h, host_src[i + j], bytes);
                dp[j] = to_host ? (void *)h : (void *)d;
                sp[j] = to_host ? (const void *)d : (const void *)h;
            }
            st = kv_cuda_copy_pages_async(to_host ? KV_CUDA_D2H : KV_CUDA_H2D, dp, sp, k, bytes, c->st, err, errlen);
            cudaError_t e = kvc_stream_sync(c->st);
            if (!st && e != cudaSuccess) snprintf(err, sizeof err, "%s", cudaGetErrorString(e)), st = KV_EIO;
            if (!st && to_host)
                for (int j = 0; j < k; j++) memcpy(host_dst[i + j], (char *)c->bounce + (size_t)j * bytes, bytes);
        }
    }
    if (st) KV_ERROR("cuda backend: %s: %s", to_host ? "copy_to_host" : "copy_from_host", err);
    return st;
}

static kv_status cuda_copy_to_host(backend_t *be, const int32_t *blocks, void *const *host, int n) {
    return host_copy(be, blocks, host, NULL, n, true);
}
static kv_status cuda_copy_from_host(backend_t *be, const void *const *host, const int32_t *blocks, int n) {
    return host_copy(be, blocks, NULL, host, n, false);
}

static void cuda_free(backend_t *be) {
    if (!be) return;
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    if (c) {
        cudaSetDevice(c->dev);
        if (c->st) kvc_stream_sync(c->st);
        if (c->L) {
            for (int l = 0; l < c->m->cfg.n_layers; l++) {
                struct cuda_layer *L = &c->L[l];
                void *ps[] = {L->wqkv, L->wo, L->wgu, L->wdown, L->attn_norm, L->ffn_norm, L->bqkv, L->q_norm, L->k_norm};
                for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++)
                    if (ps[i]) kvc_free(ps[i]);
            }
            free(c->L);
        }
        if (c->output && c->output != c->tok_embd) kvc_free(c->output);
        void *ps[] = {c->tok_embd, c->out_norm, c->inv_freq, c->pool, c->x, c->h, c->a, c->logits, c->part,
                      c->part_ml, c->d_meta};
        for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++)
            if (ps[i]) kvc_free(ps[i]);
        if (c->h_meta) kvc_free_host(c->h_meta);
        if (c->bounce) kvc_free_host(c->bounce);
        if (c->probe) kvc_free(c->probe);
        kvs_free(&c->samp);
        graphs_clear(c);
        free(c->gcache);
        if (c->blas) cublasDestroy(c->blas);
        if (c->blas_ws) kvc_free(c->blas_ws);
        if (c->st) cudaStreamDestroy(c->st);
        free(c);
    }
    free(be);
}

static const struct backend_ops cuda_ops = {
    /* .name = */ "cuda",
    /* .kv_alloc = */ cuda_kv_alloc,
    /* .forward = */ cuda_forward,
    /* .copy_blocks = */ cuda_copy_blocks,
    /* .block_ptr = */ NULL, /* device memory: the engine uses copy_to_host / copy_from_host */
    /* .free = */ cuda_free,
    /* .copy_to_host = */ cuda_copy_to_host,
    /* .copy_from_host = */ cuda_copy_from_host,
    /* .forward_sample = */ cuda_forward_sample,
    /* .healthy = */ cuda_healthy,
};

static kv_status cuda_init(backend_t *be, struct cuda_ctx *c, const struct backend_cuda_options *opt, char *err,
                           size_t errlen) {
    const struct model_config *cfg = &c->m->cfg;
    CU_TRY(cudaSetDevice(opt->device), "cudaSetDevice");
    CU_TRY(cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking), "stream create");
    BLAS_TRY(cublasCreate(&c->blas), "create");
    BLAS_TRY(cublasSetStream(c->blas, c->st), "set stream");
    size_t ws = (size_t)32 << 20;
    CU_TRY(kvc_malloc(&c->blas_ws, ws), "cudaMalloc (cublas workspace)");
    BLAS_TRY(cublasSetWorkspace(c->blas, c->blas_ws, ws), "set workspace");
    CU_TRY(inv_gemm_setup(), "invariant gemm setup");
    CU_TRY(flash_setup(), "flash attention setup");
    CU_TRY(kvs_setup(), "sampling setup");
    CU_TRY(kvc_malloc(&c->probe, 16), "cudaMalloc (probe)");
    const char *gr = getenv("KVSERVE_CUDA_GRAPHS");
    c->graphs = !(gr && *gr == '0');
    const char *cm = getenv("KVSERVE_CUDA_CAPTURE");
    c->capture_mode = cm && !strcmp(cm, "global") ? cudaStreamCaptureModeGlobal : cudaStreamCaptureModeThreadLocal;
    c->gcache = (struct graph_entry *)calloc(GRAPH_CACHE, sizeof *c->gcache);
    if (!c->gcache) return kv_errf(KV_ENOMEM, err, errlen, "cuda backend: out of host memory");
    c->L = (struct cuda_layer *)calloc((size_t)cfg->n_layers, sizeof *c->L);
    if (!c->L) return kv_errf(KV_ENOMEM, err, errlen, "cuda backend: out of host memory");
    size_t qw = (size_t)cfg->n_heads * cfg->head_dim, kw = (size_t)cfg->n_kv_heads * cfg->head_dim;
    size_t hw = qw + 2 * kw, aw = (size_t)cfg->dim;
    if (2 * (size_t)cfg->ffn_dim > hw) hw = 2 * (size_t)cfg->ffn_dim;
    if ((size_t)cfg->dim > hw) hw = cfg->dim;
    if (qw > aw) aw = qw;
    if ((size_t)cfg->ffn_dim > aw) aw = cfg->ffn_dim;
    c->hw = hw, c->aw = aw;
    (void)be;
    return upload_model(c, opt->random_weights_seed, err, errlen);
}

extern "C" kv_status backend_cuda_new(const model_t *m, const struct backend_cuda_options *opt, backend_t **out,
                                      char *err, size_t errlen) {
    if (!m || !opt || !out) return kv_errf(KV_EINVAL, err, errlen, "backend_cuda_new: NULL argument");
    const struct model_config *cfg = &m->cfg;
    if (cfg->n_heads < 1 || cfg->n_kv_heads < 1 || cfg->n_heads % cfg->n_kv_heads || cfg->head_dim < 2 ||
        cfg->head_dim % 2 || cfg->head_dim > 256 || cfg->dim < 1 || cfg->n_vocab < 1 || cfg->ffn_dim < 1 ||
        cfg->n_layers < 1)
        return kv_errf(KV_EINVAL, err, errlen,
                       "backend_cuda_new: unsupported shape (heads %d, kv heads %d, head_dim %d; head_dim must be "
                       "even and <= 256)",
                       cfg->n_heads, cfg->n_kv_heads, cfg->head_dim);
    if (!opt->random_weights_seed &&
        (!m->w.tok_embd.data || !m->w.layers ||
         (cfg->attn_bias && (!m->w.layers[0].bq || !m->w.layers[0].bk || !m->w.layers[0].bv)) ||
         (cfg->qk_norm && (!m->w.layers[0].q_norm || !m->w.layers[0].k_norm))))
        return kv_errf(KV_EINVAL, err, errlen,
                       "backend_cuda_new: model lacks weights (or bias / q-k norm weights its config enables)");
    kv_status st = kv_cuda_device_check(err, errlen);
    if (st) return st;
    int ndev = 0;
    cudaGetDeviceCount(&ndev);
    if (opt->device < 0 || opt->device >= ndev)
        return kv_errf(KV_EINVAL, err, errlen, "backend_cuda_new: device %d outside 0..%d", opt->device, ndev - 1);
    backend_t *be = (backend_t *)calloc(1, sizeof *be);
    struct cuda_ctx *c = (struct cuda_ctx *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be), free(c);
        return kv_errf(KV_ENOMEM, err, errlen, "backend_cuda_new: out of memory");
    }
    be->ops = &cuda_ops;
    be->ctx = c;
    be->model = m;
    c->m = m;
    c->dev = opt->device;
    c->f32w = opt->f32_weights;
    const char *wd = getenv("KVSERVE_CUDA_WEIGHTS"); /* f32 | bf16: overrides opt (tests, comparisons) */
    if (wd && !strcmp(wd, "f32")) c->f32w = true;
    else if (wd && !strcmp(wd, "bf16")) c->f32w = false;
    c->wsz = c->f32w ? sizeof(float) : sizeof(__nv_bfloat16);
    const char *at = getenv("KVSERVE_CUDA_ATTN");
    c->attn2 = m->cfg.head_dim % 4 == 0 && !(at && *at == '1');
    c->attn2_force = c->attn2 && at && *at == '2';
    const char *sl = getenv("KVSERVE_CUDA_ATTN_SPLIT");
    c->split_set = sl && atoi(sl) >= 8 ? atoi(sl) / 8 * 8 : 0;
    cudaDeviceProp prop;
    c->n_sm = cudaGetDeviceProperties(&prop, opt->device) == cudaSuccess ? prop.multiProcessorCount : 132;
    const char *gm = getenv("KVSERVE_CUDA_GEMV_MAX");
    c->gemv_max = gm && *gm ? atoi(gm) : 1;
    if (c->gemv_max > GEMV_MAXM) c->gemv_max = GEMV_MAXM;
    c->det = opt->deterministic;
    const char *fl = getenv("KVSERVE_CUDA_FLASH");
    c->flash = !(fl && *fl == '0');
    const char *sk = getenv("KVSERVE_CUDA_SKIP");
    if (sk && *sk) {
        for (const char *p = sk; *p;) {
            size_t n = strcspn(p, ",");
            c->skip |= !strncmp(p, "attn", n) ? SKIP_ATTN : !strncmp(p, "norm", n) ? SKIP_NORM
                     : !strncmp(p, "qkv", n) ? SKIP_QKV : !strncmp(p, "swiglu", n) ? SKIP_SWIGLU
                     : !strncmp(p, "gemm", n) ? SKIP_GEMM : 0;
            p += n + (p[n] == ',');
        }
        KV_WARN("cuda backend: KVSERVE_CUDA_SKIP=%s: stages left out, results are WRONG (timing only)", sk);
    }
    const char *fm = getenv("KVSERVE_CUDA_FLASH_MT");
    c->flash_mt = fm && *fm == '1' ? 1 : 2;
    const char *pd = getenv("KVSERVE_CUDA_PDL");
    c->pdl = !(pd && *pd == '0');
    if ((st = parse_fault(c, getenv("KVSERVE_CUDA_FAULT"), err, errlen)) || (st = cuda_init(be, c, opt, err, errlen))) {
        cuda_free(be);
        return st;
    }
    char name[256];
    kv_cuda_device_name(c->dev, name, sizeof name);
    KV_INFO("cuda backend: %s; weights %s on the device (%.2f GiB), KV dtype per kv_alloc, %s", name,
            c->f32w ? "f32" : "bf16", (double)c->weight_bytes / (1024.0 * 1024.0 * 1024.0),
            c->det ? "deterministic (batch-invariant): our fixed-order GEMM and attention split"
                   : "cuBLAS GEMMs with f32 accumulation (not batch-invariant)");
    *out = be;
    return KV_OK;
}

extern "C" kv_status kv_cuda_gemm(int mode, int f32w, const void *X, int M, int K, const void *W, int N, float *Y,
                                  char *err, size_t errlen) {
    if (!X || !W || !Y || M < 1 || N < 1 || K < 1 || (mode != 0 && mode != 1))
        return kv_errf(KV_EINVAL, err, errlen, "kv_cuda_gemm: bad argument");
    cudaStream_t st = NULL;
    CU_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream create");
    kv_status r = KV_OK;
    if (mode == 1) {
        cudaError_t e = inv_gemm_setup();
        r = e != cudaSuccess ? kv_errf(KV_EIO, err, errlen, "cuda: %s", cudaGetErrorString(e))
                             : inv_gemm(f32w != 0, X, M, K, W, N, Y, st, err, errlen);
    } else {
        /* the default mode's choice: k_gemv_bf16 for one bf16 row, else cuBLAS */
        struct cuda_ctx c;
        memset(&c, 0, sizeof c);
        c.f32w = f32w != 0, c.gemv_max = 1, c.st = st;
        if (cublasCreate(&c.blas) != CUBLAS_STATUS_SUCCESS) r = kv_errf(KV_EIO, err, errlen, "cublas: create failed");
        if (!r && cublasSetStream(c.blas, st) != CUBLAS_STATUS_SUCCESS)
            r = kv_errf(KV_EIO, err, errlen, "cublas: set stream failed");
        if (!r) r = gemm(&c, X, M, K, W, N, Y, err, errlen);
        if (!r && kvc_stream_sync(st) != cudaSuccess) r = kv_errf(KV_EIO, err, errlen, "cuda: gemm failed");
        if (c.blas) cublasDestroy(c.blas);
    }
    cudaError_t e = kvc_stream_sync(st);
    if (!r && e != cudaSuccess) r = kv_errf(KV_EIO, err, errlen, "cuda: gemm: %s", cudaGetErrorString(e));
    cudaStreamDestroy(st);
    return r;
}
