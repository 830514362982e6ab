/*
 * CUDA backend: host side (weights upload, KV pool, host copies, fault injection, creation).
 * See backend_cuda.h for the contract, forward.cu for the forward driver, kernels.cuh and
 * attn_flash.cuh for the kernels.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "cuda_ctx.h"
#include "kernels.cuh"

/* ---- helpers ---- */

static kv_status dev_alloc(void **p, size_t bytes, char *err, size_t errlen) {
    *p = NULL;
    CU_TRY(kvc_malloc(p, bytes ? bytes : 16), "cudaMalloc");
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
                      c->part_ml, c->d_meta, c->dec_cnt, c->mk_layers, c->mk_bar, c->mk_prof};
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

static kv_status cuda_device_pool(backend_t *be, void **base, size_t *len, int *device) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    if (!c->pool || be->n_blocks < 1) return KV_EINVAL;
    *base = c->pool;
    *len = (size_t)be->n_blocks * c->block_bytes;
    *device = c->dev;
    return KV_OK;
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
    /* .device_pool = */ cuda_device_pool,
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
    CU_TRY(dec_setup(), "decode attention setup");
    CU_TRY(kvc_malloc((void **)&c->dec_cnt, (size_t)DEC_ROWS_CAP * cfg->n_kv_heads * sizeof(unsigned)),
           "cudaMalloc (decode attention counters)");
    CU_TRY(kvc_memset_async(c->dec_cnt, 0, (size_t)DEC_ROWS_CAP * cfg->n_kv_heads * sizeof(unsigned), c->st),
           "memset (decode attention counters)");
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
    kv_status st = upload_model(c, opt->random_weights_seed, err, errlen);
    return st ? st : mk_setup(c, err, errlen);
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
    const char *dr = getenv("KVSERVE_CUDA_DEC_ROWS");
    c->dec_rows = dr && *dr ? atoi(dr) : DEC_ROWS_DEFAULT;
    if (c->dec_rows < 0) c->dec_rows = 0;
    if (c->dec_rows > DEC_ROWS_CAP) c->dec_rows = DEC_ROWS_CAP;
    const char *dc = getenv("KVSERVE_CUDA_DEC_CTAS");
    c->dec_ctas = dc && atoi(dc) > 0 ? atoi(dc) * c->n_sm : 0;
    const char *dh = getenv("KVSERVE_CUDA_DEC_HALF");
    c->dec_half = !(dh && *dh == '0');
    const char *dl = getenv("KVSERVE_CUDA_DEC_LATE");
    c->dec_late = dl && *dl == '1';
    const char *dt = getenv("KVSERVE_CUDA_DEC_TC");
    c->dec_tc = !(dt && *dt == '0');
    const char *dp = getenv("KVSERVE_CUDA_DEC_PDL");
    c->dec_pdl = dp && *dp == '1';
    const char *qf = getenv("KVSERVE_CUDA_QKV_FUSE");
    c->qkv_fuse = !(qf && *qf == '0');
    const char *gl = getenv("KVSERVE_CUDA_GEMV_LATE");
    c->gemv_late = !(gl && *gl == '0');
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

