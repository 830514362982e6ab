/*
 * CPU backend: f32 forward over a batch of sequences with a paged KV pool.
 *
 * Per step: all new tokens of all sequences are stacked into one [T, dim] activation
 * matrix; every projection is Y = X W^T (W stored (out, in)); attention runs per (token,
 * query head) over the sequence's block table; element-wise ops and attention are spread
 * over the thread pool.
 *
 * Determinism (see backend.h, "Determinism"): in the default BACKEND_CPU_GEMM_INVARIANT mode
 * every product goes through kv_matmul (matmul.h), whose element (m, n) depends only on
 * X[m], W[n] and K by construction. BACKEND_CPU_GEMM_OPENBLAS calls cblas_sgemm once over all
 * rows: faster for large prefills on some machines, but OpenBLAS picks kernels by M, so
 * results may differ in the last bits with batch composition.
 */
#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../../base/threadpool.h"
#include "../backend.h"
#include "attention.h"
#include "matmul.h"
#include "../../quant/q8.h"
#include "../../quant/qdot.h"

struct cpu_ctx {
    const model_t *m;
    kv_threadpool_t *tp;
    int n_threads;
    enum backend_cpu_gemm gemm;
    char *pool;          /* (n_blocks * block_bytes), inside pool_map */
    void *pool_map;      /* the pool's anonymous mapping (owned; pool_map below), or NULL */
    size_t pool_map_len;
    size_t block_bytes;  /* bytes per block */
    int kv_dtype;        /* enum kv_dtype of the pool's K/V elements */
    int tpb;             /* tokens per block */
    float *inv_freq;     /* (head_dim/2) RoPE inverse frequencies after scaling */

    /* per-row scratch, capacity cap_rows */
    int cap_rows;
    float *x;    /* (rows, dim) residual stream */
    float *xb;   /* (rows, max(dim, n_heads*head_dim)) normed input / attention output */
    float *q;    /* (rows, n_heads*head_dim) */
    float *k;    /* (rows, n_kv_heads*head_dim) */
    float *v;    /* (rows, n_kv_heads*head_dim) */
    float *hb;   /* (rows, max(ffn_dim, dim)) */
    float *hb2;  /* (rows, ffn_dim) */
    float *rope_cos, *rope_sin; /* (rows, head_dim/2) */
    int32_t *row_pos;           /* (rows) absolute position of each row */
    int32_t *row_seq;           /* (rows) sequence index of each row */
    int32_t *logit_rows;        /* (rows) rows that need logits, in output order */
    int32_t *tile_row;          /* (rows) first row of each attention tile (ATTN_TILE rows of one
                                   sequence at consecutive positions, or fewer) */
    int n_tiles;
    size_t cap_ctx;             /* per-thread score capacity (floats: q heads per KV head x positions) */
    float *scores;              /* (n_threads, cap_ctx) */

    /* The weight table the forward reads: a copy of the model's (vectors and data borrowed)
     * where repacked matrices carry their panel (struct kv_wmat.panel; prepack below). */
    struct layer_weights *lw; /* (n_layers) */
    struct kv_wmat output;
    void *panels;             /* every panel, one allocation (owned), or NULL */
    size_t panel_bytes;
    size_t panel_alloc;       /* bytes of that allocation (a multiple of 2 MiB) */
    pthread_t collapser;      /* collapses the panels into 2 MiB pages after creation (prepack) */
    bool collapsing;          /* collapser started: cpu_free stops and joins it */
    bool float_grouped;       /* F16/BF16 panels in the grouped layout, else the file's rows copied */
    atomic_int collapse_stop;
};

/* ---- matrix products ---- */

/* Runs ops[0..n) (independent products Y = X W^T + bias) in the backend's gemm mode. */
static void gemm(struct cpu_ctx *c, const struct kv_matmul_op *ops, int n) {
    if (c->gemm == BACKEND_CPU_GEMM_INVARIANT) {
        kv_matmul_batch(ops, n, c->tp);
        return;
    }
    for (int i = 0; i < n; i++) { /* F32 weights only: backend_cpu_new_ex checked */
        const struct kv_matmul_op *o = &ops[i];
        int N = o->W->rows, K = o->W->cols;
        if (o->M < 1 || N < 1) continue;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, o->M, N, K, 1.0f, o->X, K, (const float *)o->W->data, K,
                    0.0f, o->Y, N);
        if (o->bias)
            for (int r = 0; r < o->M; r++) {
                float *y = o->Y + (size_t)r * N;
                for (int k = 0; k < N; k++) y[k] += o->bias[k];
            }
    }
}

#define MM(x, m, w, b, y) ((struct kv_matmul_op){.X = (x), .M = (m), .W = &(w), .bias = (b), .Y = (y)})

/* ---- element-wise kernels ---- */

static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static void rope_apply(float *x, int head_dim, const float *c, const float *s, bool neox) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = x[i0], x1 = x[i1];
        x[i0] = x0 * c[i] - x1 * s[i];
        x[i1] = x0 * s[i] + x1 * c[i];
    }
}

/* ---- parallel jobs ---- */

struct job {
    struct cpu_ctx *c;
    const struct batch *b;
    int n_rows;
    int rows_per_task;
    int layer;
    const float *norm_w; /* rmsnorm job */
    float *src, *dst;    /* rmsnorm / add jobs */
    int width;
    int heads_per_task;  /* attention: consecutive KV heads per task (kv_attn_args.n_kv) */
};

static int row_tasks(const struct job *j) { return (j->n_rows + j->rows_per_task - 1) / j->rows_per_task; }

static void task_rmsnorm(void *p, int t, int th) {
    (void)th;
    struct job *j = p;
    const struct model_config *cfg = &j->c->m->cfg;
    int r1 = (t + 1) * j->rows_per_task < j->n_rows ? (t + 1) * j->rows_per_task : j->n_rows;
    for (int r = t * j->rows_per_task; r < r1; r++)
        rmsnorm(j->dst + (size_t)r * j->width, j->src + (size_t)r * j->width, j->norm_w, j->width,
                cfg->rms_eps);
}

/* dst += src row-wise */
static void task_add(void *p, int t, int th) {
    (void)th;
    struct job *j = p;
    int r1 = (t + 1) * j->rows_per_task < j->n_rows ? (t + 1) * j->rows_per_task : j->n_rows;
    for (size_t i = (size_t)t * j->rows_per_task * j->width; i < (size_t)r1 * j->width; i++) j->dst[i] += j->src[i];
}

static void task_swiglu(void *p, int t, int th) {
    (void)th;
    struct job *j = p;
    struct cpu_ctx *c = j->c;
    int f = c->m->cfg.ffn_dim;
    int r1 = (t + 1) * j->rows_per_task < j->n_rows ? (t + 1) * j->rows_per_task : j->n_rows;
    for (size_t i = (size_t)t * j->rows_per_task * f; i < (size_t)r1 * f; i++) {
        float g = c->hb[i];
        c->hb[i] = g / (1.0f + expf(-g)) * c->hb2[i];
    }
}

/* Byte offset inside a block of the (layer, k|v, kv_head) run of tpb rows. */
static inline size_t run_off(const struct cpu_ctx *c, int layer, int kv, int kv_head) {
    const struct model_config *cfg = &c->m->cfg;
    return (((size_t)layer * 2 + kv) * cfg->n_kv_heads + kv_head) * c->tpb * cfg->head_dim * kv_dtype_size(c->kv_dtype);
}
/* Start of (layer, k|v, kv_head, pos) of a sequence: head_dim elements of kv_dtype. */
static inline char *kv_slot(const struct cpu_ctx *c, const int32_t *block_table, int layer, int kv, int kv_head,
                            int pos) {
    int tpb = c->tpb;
    return c->pool + (size_t)block_table[pos / tpb] * c->block_bytes + run_off(c, layer, kv, kv_head) +
           (size_t)(pos % tpb) * c->m->cfg.head_dim * kv_dtype_size(c->kv_dtype);
}

/* Per row: q/k/v bias (done in gemm), q/k norm, RoPE, store K/V into the row's block slot. */
static void task_qkv_post(void *p, int t, int th) {
    (void)th;
    struct job *j = p;
    struct cpu_ctx *c = j->c;
    const struct model_config *cfg = &c->m->cfg;
    const struct layer_weights *lw = &c->m->w.layers[j->layer];
    int hd = cfg->head_dim, half = hd / 2;
    int qw = cfg->n_heads * hd, kw = cfg->n_kv_heads * hd;
    int r1 = (t + 1) * j->rows_per_task < j->n_rows ? (t + 1) * j->rows_per_task : j->n_rows;
    for (int r = t * j->rows_per_task; r < r1; r++) {
        float *q = c->q + (size_t)r * qw, *k = c->k + (size_t)r * kw, *v = c->v + (size_t)r * kw;
        const float *cs = c->rope_cos + (size_t)r * half, *sn = c->rope_sin + (size_t)r * half;
        for (int h = 0; h < cfg->n_heads; h++) {
            if (cfg->qk_norm) rmsnorm(q + h * hd, q + h * hd, lw->q_norm, hd, cfg->rms_eps);
            rope_apply(q + h * hd, hd, cs, sn, cfg->rope_neox);
        }
        const struct batch_seq *s = &j->b->seqs[c->row_seq[r]];
        for (int h = 0; h < cfg->n_kv_heads; h++) {
            if (cfg->qk_norm) rmsnorm(k + h * hd, k + h * hd, lw->k_norm, hd, cfg->rms_eps);
            rope_apply(k + h * hd, hd, cs, sn, cfg->rope_neox);
            kv_store_row(kv_slot(c, s->block_table, j->layer, 0, h, c->row_pos[r]), k + h * hd, hd, c->kv_dtype);
            kv_store_row(kv_slot(c, s->block_table, j->layer, 1, h, c->row_pos[r]), v + h * hd, hd, c->kv_dtype);
        }
    }
}

/* One (attention tile, KV head): causal attention of the tile's rows (consecutive positions of
 * one sequence) and the group's query heads over positions 0..pos of each row (attention.h:
 * the same bits on every ISA, in every batch and for every tiling). */
static void task_attention(void *p, int t, int th) {
    struct job *j = p;
    struct cpu_ctx *c = j->c;
    const struct model_config *cfg = &c->m->cfg;
    int hd = cfg->head_dim, group = cfg->n_heads / cfg->n_kv_heads;
    int per = (cfg->n_kv_heads + j->heads_per_task - 1) / j->heads_per_task; /* tasks per tile */
    int ti = t / per, kvh = (t % per) * j->heads_per_task;
    int nkv = cfg->n_kv_heads - kvh < j->heads_per_task ? cfg->n_kv_heads - kvh : j->heads_per_task;
    int r = c->tile_row[ti];
    /* every sequence's first row starts a tile, so a tile never spans two sequences */
    int n_rows = (ti + 1 < c->n_tiles ? c->tile_row[ti + 1] : j->n_rows) - r;
    size_t qoff = (size_t)r * cfg->n_heads * hd + (size_t)kvh * group * hd;
    struct kv_attn_args a = {
        .q = c->q + qoff,
        .n_group = group,
        .head_dim = hd,
        .n_rows = n_rows,
        .q_stride = (size_t)cfg->n_heads * hd,
        .out_stride = (size_t)cfg->n_heads * hd,
        .n_pos = c->row_pos[r] + 1,
        .block_table = j->b->seqs[c->row_seq[r]].block_table,
        .tpb = c->tpb,
        .pool = c->pool,
        .block_bytes = c->block_bytes,
        .k_off = run_off(c, j->layer, 0, kvh),
        .v_off = run_off(c, j->layer, 1, kvh),
        .kv_dtype = c->kv_dtype,
        .scale = 1.0f / sqrtf((float)hd),
        .scores = c->scores + (size_t)th * c->cap_ctx,
        .out = c->xb + qoff,
        .n_kv = nkv,
        .head_stride = run_off(c, 0, 0, 1) - run_off(c, 0, 0, 0),
    };
    kv_attention(&a);
}

/* ---- scratch management ---- */

static kv_status grow_rows(struct cpu_ctx *c, int rows) {
    if (rows <= c->cap_rows) return KV_OK;
    const struct model_config *cfg = &c->m->cfg;
    int cap = (rows + 15) / 16 * 16;
    size_t qw = (size_t)cfg->n_heads * cfg->head_dim, kw = (size_t)cfg->n_kv_heads * cfg->head_dim;
    size_t xbw = qw > (size_t)cfg->dim ? qw : (size_t)cfg->dim;
    size_t hbw = (size_t)cfg->ffn_dim > (size_t)cfg->dim ? (size_t)cfg->ffn_dim : (size_t)cfg->dim;
    size_t half = (size_t)cfg->head_dim / 2;
    struct { void **p; size_t bytes; } bufs[] = {
        {(void **)&c->x, (size_t)cfg->dim * sizeof(float)},  {(void **)&c->xb, xbw * sizeof(float)},
        {(void **)&c->q, qw * sizeof(float)},                 {(void **)&c->k, kw * sizeof(float)},
        {(void **)&c->v, kw * sizeof(float)},                 {(void **)&c->hb, hbw * sizeof(float)},
        {(void **)&c->hb2, (size_t)cfg->ffn_dim * sizeof(float)},
        {(void **)&c->rope_cos, half * sizeof(float)},        {(void **)&c->rope_sin, half * sizeof(float)},
        {(void **)&c->row_pos, sizeof(int32_t)},              {(void **)&c->row_seq, sizeof(int32_t)},
        {(void **)&c->logit_rows, sizeof(int32_t)},           {(void **)&c->tile_row, sizeof(int32_t)},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        void *np = kv_realloc(*bufs[i].p, bufs[i].bytes * (size_t)cap);
        if (!np) return KV_ENOMEM; /* already-grown buffers stay valid; cap_rows unchanged */
        *bufs[i].p = np;
    }
    c->cap_rows = cap;
    return KV_OK;
}

/* Query rows per attention tile (prefill chunks: each K row is read once per tile). */
#define ATTN_TILE 8

static kv_status grow_ctx(struct cpu_ctx *c, int n_pos) {
    size_t need = (size_t)KV_ATTN_MAX_HEADS * ATTN_TILE * (size_t)(n_pos + ATTN_TILE) *
                  (size_t)(c->m->cfg.n_heads / c->m->cfg.n_kv_heads);
    if (need <= c->cap_ctx) return KV_OK;
    size_t cap = c->cap_ctx ? c->cap_ctx : 256;
    while (cap < need) cap *= 2;
    float *np = kv_realloc(c->scores, (size_t)cap * c->n_threads * sizeof(float));
    if (!np) return KV_ENOMEM;
    c->scores = np;
    c->cap_ctx = cap;
    return KV_OK;
}

/* ---- ops ---- */

/* The KV pool: an anonymous mapping (zeroed, committed page by page as blocks are first
 * written) aligned to 2 MiB and advised for transparent huge pages. Long-context attention
 * reads each (block, KV head) run of a layer -- 2 KiB for 16 f16 tokens of 64 dims -- from a
 * different block hundreds of KiB away: with 4 KiB pages nearly every run is a TLB miss (a
 * nested page walk under virtualization); 2 MiB pages cover a 300 MB pool with ~150 entries. */
static void pool_unmap(struct cpu_ctx *c) {
    if (c->pool_map) munmap(c->pool_map, c->pool_map_len);
    c->pool_map = NULL;
    c->pool_map_len = 0;
    c->pool = NULL;
}
static kv_status pool_map(struct cpu_ctx *c, size_t n_blocks, size_t bb) {
    const size_t huge = (size_t)2 << 20;
    if (bb && n_blocks > (SIZE_MAX - 2 * huge) / bb) return KV_ENOMEM;
    size_t len = n_blocks * bb + huge;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return KV_ENOMEM;
    c->pool_map = p;
    c->pool_map_len = len;
    c->pool = (char *)(((uintptr_t)p + huge - 1) & ~(uintptr_t)(huge - 1));
#ifdef MADV_HUGEPAGE
    const char *e = getenv("KVSERVE_CPU_THP"); /* 0: 4 KiB pages (A/B measurements; kv_cpu_env_check) */
    if (!(e && !strcmp(e, "0"))) (void)madvise(c->pool, n_blocks * bb, MADV_HUGEPAGE); /* advisory */
#endif
    return KV_OK;
}

static kv_status cpu_kv_alloc(backend_t *be, int n_blocks, const struct kv_geometry *g) {
    struct cpu_ctx *c = be->ctx;
    const struct model_config *cfg = &c->m->cfg;
    pool_unmap(c);
    be->n_blocks = 0;
    memset(&be->geom, 0, sizeof be->geom);
    if (n_blocks < 1 || !g || g->n_layers != cfg->n_layers || g->n_kv_heads != cfg->n_kv_heads ||
        g->head_dim != cfg->head_dim || g->tokens_per_block < 1) {
        KV_ERROR("cpu backend: kv_alloc: geometry does not match the model or n_blocks < 1");
        return KV_EINVAL;
    }
    if (g->kv_dtype != KV_DTYPE_F32 && g->kv_dtype != KV_DTYPE_F16 && g->kv_dtype != KV_DTYPE_BF16) {
        KV_ERROR("cpu backend: kv_alloc: unknown KV cache dtype %d", g->kv_dtype);
        return KV_EINVAL;
    }
    size_t bb = kv_block_bytes(g);
    if (pool_map(c, (size_t)n_blocks, bb) != KV_OK) return KV_ENOMEM;
    c->block_bytes = bb;
    c->kv_dtype = g->kv_dtype;
    c->tpb = g->tokens_per_block;
    be->geom = *g;
    be->n_blocks = n_blocks;
    return KV_OK;
}

static kv_status validate(backend_t *be, const struct batch *b, char *err, size_t errlen) {
    const struct cpu_ctx *c = be->ctx;
    return backend_check_batch(be, b, c->pool != NULL, c->tpb, c->m->cfg.n_vocab, INT32_MAX / 4, err, errlen);
}

static kv_status cpu_forward(backend_t *be, const struct batch *b, float *logits, char *err, size_t errlen) {
    struct cpu_ctx *c = be->ctx;
    const model_t *m = c->m;
    const struct model_config *cfg = &m->cfg;
    kv_status st = validate(be, b, err, errlen);
    if (st) return st;
    int T = 0, max_pos = 0, L = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        T += b->seqs[i].n_tokens;
        int e = b->seqs[i].n_past + b->seqs[i].n_tokens;
        if (e > max_pos) max_pos = e;
    }
    if (T == 0) return KV_OK;
    if ((st = grow_rows(c, T)) || (st = grow_ctx(c, max_pos)))
        return kv_errf(st, err, errlen, "forward: out of memory for %d rows", T);

    int dim = cfg->dim, hd = cfg->head_dim, half = hd / 2;
    /* rows: positions, embeddings, RoPE tables, logit rows, attention tiles */
    int r = 0;
    c->n_tiles = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        for (int k = 0; k < s->n_tokens; k++, r++) {
            c->row_seq[r] = i;
            c->row_pos[r] = s->n_past + k;
            kv_dequant_row(m->w.tok_embd.type,
                           (const char *)m->w.tok_embd.data + (size_t)s->tokens[k] * m->w.tok_embd.row_bytes,
                           c->x + (size_t)r * dim, dim);
            for (int e = 0; e < half; e++) {
                float ang = (float)c->row_pos[r] * c->inv_freq[e];
                c->rope_cos[(size_t)r * half + e] = cosf(ang);
                c->rope_sin[(size_t)r * half + e] = sinf(ang);
            }
            if (s->logits == BATCH_LOGITS_ALL || (s->logits == BATCH_LOGITS_LAST && k == s->n_tokens - 1))
                c->logit_rows[L++] = r;
            if (k % ATTN_TILE == 0) c->tile_row[c->n_tiles++] = r;
        }
    }

    struct job j = {.c = c, .b = b, .n_rows = T};
    j.rows_per_task = (T + 4 * c->n_threads - 1) / (4 * c->n_threads);
    if (j.rows_per_task < 1) j.rows_per_task = 1;
    int nt = row_tasks(&j);
    /* attention tasks: as many KV heads per task as still gives every thread a task (a
     * block's heads are then read as one region: attention.h, n_kv), evened out */
    {
        int nkv = cfg->n_kv_heads, hp = nkv < KV_ATTN_MAX_HEADS ? nkv : KV_ATTN_MAX_HEADS;
        while (hp > 1 && c->n_tiles * ((nkv + hp - 1) / hp) < c->n_threads) hp--;
        int per = (nkv + hp - 1) / hp;
        j.heads_per_task = (nkv + per - 1) / per;
    }

    for (int l = 0; l < cfg->n_layers; l++) {
        const struct layer_weights *lw = &c->lw[l];
        j.layer = l;
        /* attention block */
        j.src = c->x, j.dst = c->hb, j.norm_w = lw->attn_norm, j.width = dim;
        kv_threadpool_for(c->tp, nt, task_rmsnorm, &j);
        struct kv_matmul_op qkv[3] = {MM(c->hb, T, lw->wq, lw->bq, c->q),
                                      MM(c->hb, T, lw->wk, lw->bk, c->k),
                                      MM(c->hb, T, lw->wv, lw->bv, c->v)};
        gemm(c, qkv, 3);
        kv_threadpool_for(c->tp, nt, task_qkv_post, &j);
        kv_threadpool_for(c->tp, c->n_tiles * ((cfg->n_kv_heads + j.heads_per_task - 1) / j.heads_per_task),
                          task_attention, &j);
        gemm(c, &MM(c->xb, T, lw->wo, NULL, c->hb), 1);
        j.src = c->hb, j.dst = c->x;
        kv_threadpool_for(c->tp, nt, task_add, &j);
        /* FFN block */
        j.src = c->x, j.dst = c->xb, j.norm_w = lw->ffn_norm, j.width = dim;
        kv_threadpool_for(c->tp, nt, task_rmsnorm, &j);
        struct kv_matmul_op gu[2] = {MM(c->xb, T, lw->w_gate, NULL, c->hb),
                                     MM(c->xb, T, lw->w_up, NULL, c->hb2)};
        gemm(c, gu, 2);
        kv_threadpool_for(c->tp, nt, task_swiglu, &j);
        gemm(c, &MM(c->hb, T, lw->w_down, NULL, c->xb), 1);
        j.src = c->xb, j.dst = c->x;
        kv_threadpool_for(c->tp, nt, task_add, &j);
    }
    if (L == 0) return KV_OK;
    /* output head on the logit rows only */
    for (int i = 0; i < L; i++)
        rmsnorm(c->xb + (size_t)i * dim, c->x + (size_t)c->logit_rows[i] * dim, m->w.out_norm, dim, cfg->rms_eps);
    gemm(c, &MM(c->xb, L, c->output, NULL, logits), 1);
    return KV_OK;
}

static kv_status cpu_copy_blocks(backend_t *be, const int32_t *src, const int32_t *dst, int n) {
    struct cpu_ctx *c = be->ctx;
    for (int i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= be->n_blocks || dst[i] < 0 || dst[i] >= be->n_blocks) return KV_EINVAL;
    for (int i = 0; i < n; i++)
        memmove(c->pool + (size_t)dst[i] * c->block_bytes, c->pool + (size_t)src[i] * c->block_bytes,
                c->block_bytes);
    return KV_OK;
}

static float *cpu_block_ptr(backend_t *be, int b) {
    struct cpu_ctx *c = be->ctx;
    if (!c->pool || b < 0 || b >= be->n_blocks) return NULL;
    return (float *)(void *)(c->pool + (size_t)b * c->block_bytes);
}

static void cpu_free(backend_t *be) {
    if (!be) return;
    struct cpu_ctx *c = be->ctx;
    if (c) {
        if (c->collapsing) {
            atomic_store(&c->collapse_stop, 1);
            pthread_join(c->collapser, NULL);
            c->collapsing = false;
        }
        kv_threadpool_free(c->tp);
        pool_unmap(c);
        free(c->inv_freq);
        free(c->x), free(c->xb), free(c->q), free(c->k), free(c->v), free(c->hb), free(c->hb2);
        free(c->rope_cos), free(c->rope_sin), free(c->row_pos), free(c->row_seq), free(c->logit_rows);
        free(c->tile_row);
        free(c->scores);
        free(c->lw);
        free(c->panels);
        free(c);
    }
    free(be);
}

static const struct backend_ops cpu_ops = {
    .name = "cpu",
    .kv_alloc = cpu_kv_alloc,
    .forward = cpu_forward,
    .copy_blocks = cpu_copy_blocks,
    .block_ptr = cpu_block_ptr,
    .free = cpu_free,
};


/* ---- weights repacked at load ----
 * Two layouts, each chosen because it turns a decode tile's 4-16 row streams into one
 * sequential stream per task (and lets prefill skip per-task repacking):
 * - Q8_0, on the integer path (kv_matmul_get_quant() == INT8): a matrix whose repacked panel
 *   (q8.h) is at most PREPACK_GROWTH times its stored bytes is repacked whole once, here,
 *   instead of per task in every prefill. Of the stored types only Q8_0 qualifies (panel 576
 *   bytes per 16 x 32 weights against 544: +5.9%); Q4_0 and the K-quants unpack to a byte per
 *   weight (2-2.3x) and stay in place.
 * - F16/BF16, in both modes: into anonymous memory (2 MiB pages once collapsed), either the
 *   file's rows copied (the decode tiles read 8 rows: 8 streams) or the grouped layout of
 *   qdot.h (same bytes, 4 rows interleaved in 64-byte chunks: one stream per matrix); both read
 *   faster than the file's pages, which layout is faster depends on the core (1B F16 decode,
 *   one thread: Sapphire Rapids rows 9.1-9.4 tok/s, grouped 7.0-7.7, file pages 6.6-6.8; Zen 4
 *   grouped 10.3-11.4 against file pages 7.6-9.0, rows in anonymous memory not measured there:
 *   docs/benchmarks.md). Only where the file pages can be released (a GGUF map; not the tied
 *   output, whose rows the embedding still reads), so it never doubles resident memory.
 * The file pages a panel replaces are released (model_release_pages), so resident memory stays
 * about the file size. Same bits either way (q8.h's and qdot.h's contracts). */
#define PREPACK_GROWTH 1.10

struct pack_task { struct kv_wmat *w; int r0, r1; bool release; };
struct pack_run { const struct pack_task *t; const model_t *m; bool grouped; };
/* Packs one task's rows, then releases the file pages wholly inside them at once (the pages a
 * task boundary cuts go when the whole matrix is done), so a large file's resident set does not
 * reach the file plus all its panels while packing. */
static void task_pack(void *p, int t, int th) {
    (void)th;
    const struct pack_run *run = p;
    const struct pack_task *pt = &run->t[t];
    const struct kv_wmat *w = pt->w;
    const char *src = (const char *)w->data + (size_t)pt->r0 * w->row_bytes;
    if (kv_fgroup_ok(w->type, w->cols)) { /* F16/BF16; r0 is a multiple of KV_FGROUP_ROWS */
        char *dst = (char *)(uintptr_t)w->panel + (size_t)pt->r0 * w->row_bytes;
        if (run->grouped) kv_fgroup_pack(w->type, src, w->row_bytes, pt->r1 - pt->r0, w->cols, dst);
        else memcpy(dst, src, (size_t)(pt->r1 - pt->r0) * w->row_bytes);
    } else {
        size_t gb = kv_q8_pack_bytes(w->type, 16, w->cols);
        kv_q8_pack(w->type, src, w->row_bytes, pt->r1 - pt->r0, w->cols,
                   (char *)(uintptr_t)w->panel + (size_t)(pt->r0 / 16) * gb);
    }
    if (pt->release) model_release_pages(run->m, src, (size_t)(pt->r1 - pt->r0) * w->row_bytes);
}

/* The panel bytes of w if it is to be repacked (see above), else 0. */
static size_t prepack_bytes(const model_t *m, const struct kv_wmat *w, bool int8) {
    if (w->rows < 1 || w->cols < 1) return 0;
    if ((w->type == KV_QTYPE_F16 || w->type == KV_QTYPE_BF16) && kv_fgroup_ok(w->type, w->cols)) {
        size_t n = w->row_bytes * (size_t)w->rows;
        if (w->row_bytes != kv_qtype_row_bytes(w->type, w->cols) || !model_pages_releasable(m, w->data, n)) return 0;
        if (w->data == m->w.tok_embd.data) return 0; /* the tied output: the embedding reads these rows */
        return n;
    }
    if (!int8 || kv_q8_group(w->type) == 0 || !kv_q8_packed_fast(w->type)) return 0;
    size_t pb = kv_q8_pack_bytes(w->type, 16, w->cols);
    return pb > 0 && (double)pb <= PREPACK_GROWTH * 16.0 * (double)w->row_bytes ? kv_q8_pack_bytes(w->type, w->rows, w->cols)
                                                                                : 0;
}

#if defined(__linux__) && !defined(MADV_COLLAPSE)
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif
/* The panels' collapser: at the lowest priority, turns the panels into 2 MiB pages one 2 MiB
 * run at a time (MADV_COLLAPSE copies a run into a fresh huge page; readers keep seeing the
 * same bytes throughout), checking c->collapse_stop between runs. Stops at the first run the
 * kernel refuses with EINVAL (no MADV_COLLAPSE before Linux 6.1, THP off). */
static void *panel_collapser(void *arg) {
    struct cpu_ctx *c = arg;
#ifdef MADV_COLLAPSE
    (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19); /* this thread only (Linux) */
    const size_t huge = (size_t)2 << 20;
    double t0 = kv_now_s();
    size_t done = 0;
    for (size_t o = 0; o < c->panel_alloc && !atomic_load(&c->collapse_stop); o += huge) {
        if (madvise((char *)c->panels + o, huge, MADV_COLLAPSE) == 0) done += huge;
        else if (errno == EINVAL) break;
    }
    KV_INFO("cpu backend: %.0f of %.0f MiB of panels collapsed into 2 MiB pages in %.0f ms", (double)done / (1 << 20),
            (double)c->panel_alloc / (1 << 20), (kv_now_s() - t0) * 1e3);
#else
    (void)c;
#endif
    return NULL;
}

/* Copies the model's weight table into c and repacks what qualifies (see above). Only
 * allocation can fail (KV_ENOMEM, nothing repacked then, c->lw may be set: cpu_free frees). */
static kv_status prepack(struct cpu_ctx *c, bool enabled) {
    const model_t *m = c->m;
    int nl = m->cfg.n_layers;
    c->lw = kv_malloc((size_t)nl * sizeof *c->lw);
    if (!c->lw) return KV_ENOMEM;
    memcpy(c->lw, m->w.layers, (size_t)nl * sizeof *c->lw);
    c->output = m->w.output;
    if (!enabled) return KV_OK;
    const bool int8 = kv_matmul_get_quant() == KV_MATMUL_QUANT_INT8;
    int n = 0, n_tasks = 0;
    size_t total = 0;
    struct kv_wmat **ws = kv_malloc((size_t)(7 * nl + 1) * sizeof *ws);
    if (!ws) return KV_ENOMEM;
    for (int l = 0; l < nl; l++) {
        struct layer_weights *L = &c->lw[l];
        struct kv_wmat *w7[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int i = 0; i < 7; i++)
            if (prepack_bytes(m, w7[i], int8)) ws[n++] = w7[i];
    }
    if (prepack_bytes(m, &c->output, int8)) ws[n++] = &c->output;
    enum { ROWS_PER_TASK = 256 }; /* a multiple of 16 (q8 row groups) and of KV_FGROUP_ROWS */
    for (int i = 0; i < n; i++) {
        total += (prepack_bytes(m, ws[i], int8) + 63) & ~(size_t)63;
        n_tasks += (ws[i]->rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    }
    if (n == 0) {
        free(ws);
        return KV_OK;
    }
    /* Panels under 8 MiB (tiny models, tests) stay on 4 KiB pages: rounding them up to 2 MiB
     * pages would make the unused rest of the last page resident, more than the panels save. */
    const size_t huge = (size_t)2 << 20, unit = total < 4 * huge ? 4096 : huge;
    size_t alloc = (total + unit - 1) & ~(unit - 1);
    char *panels = aligned_alloc(unit, alloc);
    struct pack_task *tasks = kv_malloc((size_t)n_tasks * sizeof *tasks);
    if (!panels || !tasks) {
        free(panels), free(tasks), free(ws);
        return KV_ENOMEM;
    }
    /* Fault the panels in 4 KiB pages, advise 2 MiB pages after packing. On a VM whose free
     * memory is handed back to the host (virtio balloon free page reporting, which reports
     * free 2 MiB blocks) a fresh 2 MiB page costs a host fault per 4 KiB inside clear_page:
     * 0.12-0.25 GB/s against ~1.2 GB/s for 4 KiB pages, which come from small free blocks
     * that stay backed (docs/benchmarks.md, "Load time"). A background thread then collapses
     * the panels into 2 MiB pages (panel_collapser; decode is ~1.2x faster on 2 MiB panels:
     * fewer TLB misses). KVSERVE_CPU_PANEL_THP: 1 = advise before packing (2 MiB pages at
     * once, slow load, no thread), 0 = 4 KiB pages only (no thread). */
    const char *thp = getenv("KVSERVE_CPU_PANEL_THP");
    int thp_mode = thp && !strcmp(thp, "1") ? 1 : thp && !strcmp(thp, "0") ? 0 : 2;
    if (unit != huge) thp_mode = 0;
#ifdef MADV_HUGEPAGE
    if (thp_mode == 1) (void)madvise(panels, alloc, MADV_HUGEPAGE); /* advisory */
#endif
    double t0 = kv_now_s();
    size_t off = 0;
    int t = 0;
    for (int i = 0; i < n; i++) {
        size_t pb = prepack_bytes(m, ws[i], int8);
        /* the tied output shares its rows with the embedding, which is still looked up */
        const bool tied = ws[i] == &c->output && m->w.output.data == m->w.tok_embd.data;
        ws[i]->panel = panels + off;
        off += (pb + 63) & ~(size_t)63;
        for (int r = 0; r < ws[i]->rows; r += ROWS_PER_TASK)
            tasks[t++] = (struct pack_task){ws[i], r, r + ROWS_PER_TASK < ws[i]->rows ? r + ROWS_PER_TASK : ws[i]->rows,
                                            !tied};
    }
    struct pack_run run = {tasks, m, c->float_grouped};
    kv_threadpool_for(c->tp, n_tasks, task_pack, &run);
    size_t stored = 0;
    for (int i = 0; i < n; i++) {
        stored += ws[i]->row_bytes * (size_t)ws[i]->rows;
        if (!(ws[i] == &c->output && m->w.output.data == m->w.tok_embd.data)) /* the pages tasks' ends cut */
            model_release_pages(m, ws[i]->data, ws[i]->row_bytes * (size_t)ws[i]->rows);
    }
    int n_float = 0;
    for (int i = 0; i < n; i++) {
        if (!kv_fgroup_ok(ws[i]->type, ws[i]->cols)) continue;
        n_float++;
        if (!c->float_grouped) { /* the file's rows, moved: the products read data as before */
            ws[i]->data = ws[i]->panel;
            ws[i]->panel = NULL;
        }
    }
    KV_INFO("cpu backend: repacked %d matrices (%d Q8_0 for the integer path, %d F16/BF16 %s; "
            "%.1f MiB stored -> %.1f MiB panels) in %.0f ms",
            n, n - n_float, n_float, c->float_grouped ? "grouped" : "rows in anonymous memory",
            (double)stored / (1 << 20), (double)total / (1 << 20), (kv_now_s() - t0) * 1e3);
    c->panels = panels;
    c->panel_bytes = total;
    c->panel_alloc = alloc;
#ifdef MADV_HUGEPAGE
    if (thp_mode == 2) {
        (void)madvise(panels, alloc, MADV_HUGEPAGE); /* advisory */
        c->collapsing = pthread_create(&c->collapser, NULL, panel_collapser, c) == 0; /* else 4 KiB pages stay */
    }
#endif
    free(tasks);
    free(ws);
    return KV_OK;
}

void backend_cpu_wait_pages(backend_t *be) {
    if (!be || be->ops != &cpu_ops) return;
    struct cpu_ctx *c = be->ctx;
    if (c->collapsing) {
        pthread_join(c->collapser, NULL);
        c->collapsing = false;
    }
}

size_t backend_cpu_panel_bytes(const backend_t *be) {
    return be && be->ops == &cpu_ops ? ((const struct cpu_ctx *)be->ctx)->panel_bytes : 0;
}

kv_status backend_cpu_new(const model_t *m, int n_threads, backend_t **out, char *err, size_t errlen) {
    struct backend_cpu_options o = {.n_threads = n_threads, .gemm = BACKEND_CPU_GEMM_INVARIANT};
    return backend_cpu_new_ex(m, &o, out, err, errlen);
}

const char *backend_cpu_gemm_name(enum backend_cpu_gemm g) {
    switch (g) {
    case BACKEND_CPU_GEMM_INVARIANT: return "invariant";
    case BACKEND_CPU_GEMM_OPENBLAS: return "openblas";
    }
    return NULL;
}

kv_status backend_cpu_float_layout_parse(const char *s, enum backend_cpu_float_layout *out) {
    if (!s || !out) return KV_EINVAL;
    if (!strcmp(s, "rows")) *out = BACKEND_CPU_FLOAT_ROWS;
    else if (!strcmp(s, "grouped")) *out = BACKEND_CPU_FLOAT_GROUPED;
    else return KV_EINVAL;
    return KV_OK;
}

kv_status backend_cpu_gemm_parse(const char *s, enum backend_cpu_gemm *out) {
    if (!s || !out) return KV_EINVAL;
    if (!strcmp(s, "invariant")) *out = BACKEND_CPU_GEMM_INVARIANT;
    else if (!strcmp(s, "openblas")) *out = BACKEND_CPU_GEMM_OPENBLAS;
    else return KV_EINVAL;
    return KV_OK;
}

kv_status backend_cpu_new_ex(const model_t *m, const struct backend_cpu_options *opt, backend_t **out, char *err,
                             size_t errlen) {
    if (!m || !out || !opt) return kv_errf(KV_EINVAL, err, errlen, "backend_cpu_new: NULL argument");
    if (!backend_cpu_gemm_name(opt->gemm))
        return kv_errf(KV_EINVAL, err, errlen, "backend_cpu_new: unknown gemm mode %d", (int)opt->gemm);
    int n_threads = opt->n_threads;
    const struct model_config *cfg = &m->cfg;
    if (cfg->n_heads < 1 || cfg->n_kv_heads < 1 || cfg->n_heads % cfg->n_kv_heads || cfg->head_dim < 2 ||
        cfg->head_dim % 2 || cfg->dim < 1 || cfg->n_vocab < 1 || cfg->ffn_dim < 1 || cfg->n_layers < 1)
        return kv_errf(KV_EINVAL, err, errlen,
                       "backend_cpu_new: unsupported shape (heads %d, kv heads %d, head_dim %d)", cfg->n_heads,
                       cfg->n_kv_heads, cfg->head_dim);
    if ((cfg->attn_bias && (!m->w.layers[0].bq || !m->w.layers[0].bk || !m->w.layers[0].bv)) ||
        (cfg->qk_norm && (!m->w.layers[0].q_norm || !m->w.layers[0].k_norm)))
        return kv_errf(KV_EINVAL, err, errlen, "backend_cpu_new: model lacks bias / q-k norm weights its config enables");
    if (opt->gemm == BACKEND_CPU_GEMM_OPENBLAS) {
        bool f32 = m->w.output.type == KV_QTYPE_F32; /* the embedding is only looked up, never multiplied */
        for (int l = 0; f32 && l < cfg->n_layers; l++) {
            const struct layer_weights *L = &m->w.layers[l];
            f32 = L->wq.type == KV_QTYPE_F32 && L->wk.type == KV_QTYPE_F32 && L->wv.type == KV_QTYPE_F32 &&
                  L->wo.type == KV_QTYPE_F32 && L->w_gate.type == KV_QTYPE_F32 && L->w_up.type == KV_QTYPE_F32 &&
                  L->w_down.type == KV_QTYPE_F32;
        }
        if (!f32) {
            char types[256];
            model_matrix_types(m, types, sizeof types);
            return kv_errf(KV_EINVAL, err, errlen,
                           "--gemm openblas needs F32 matrices; this model stores %s (use the default --gemm "
                           "invariant)",
                           types);
        }
    }
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    backend_t *be = kv_calloc(1, sizeof *be);
    struct cpu_ctx *c = kv_calloc(1, sizeof *c);
    if (!be || !c) {
        free(be), free(c);
        return kv_errf(KV_ENOMEM, err, errlen, "backend_cpu_new: out of memory");
    }
    be->ops = &cpu_ops;
    be->ctx = c;
    be->model = m;
    c->m = m;
    c->n_threads = n_threads;
    c->gemm = opt->gemm;
    c->tp = kv_threadpool_new(n_threads);
    c->inv_freq = kv_malloc((size_t)(cfg->head_dim / 2) * sizeof(float));
    if (!c->tp || !c->inv_freq || grow_rows(c, 16) || grow_ctx(c, 256)) {
        cpu_free(be);
        return kv_errf(KV_ENOMEM, err, errlen, "backend_cpu_new: out of memory");
    }
    const char *pt = getenv("KVSERVE_CPU_PANEL_THP");
    if (pt && *pt && strcmp(pt, "0") && strcmp(pt, "1")) {
        cpu_free(be);
        return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_PANEL_THP=%s: expected 0 (4 KiB pages) or 1 (2 MiB pages "
                       "advised before packing); unset = collapse into 2 MiB pages after packing", pt);
    }
    enum backend_cpu_float_layout fl = opt->float_layout;
    const char *fe = getenv("KVSERVE_CPU_FLOAT_LAYOUT");
    if (fl == BACKEND_CPU_FLOAT_AUTO && fe && *fe) {
        if (backend_cpu_float_layout_parse(fe, &fl) != KV_OK) {
            cpu_free(be);
            return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_CPU_FLOAT_LAYOUT=%s: expected rows or grouped", fe);
        }
    }
    if (fl == BACKEND_CPU_FLOAT_AUTO) {
#if defined(__x86_64__) || defined(__i386__)
        fl = __builtin_cpu_is("amd") ? BACKEND_CPU_FLOAT_GROUPED : BACKEND_CPU_FLOAT_ROWS;
#else
        fl = BACKEND_CPU_FLOAT_ROWS;
#endif
    }
    if (fl != BACKEND_CPU_FLOAT_ROWS && fl != BACKEND_CPU_FLOAT_GROUPED) {
        cpu_free(be);
        return kv_errf(KV_EINVAL, err, errlen, "backend_cpu_new: unknown float layout %d", (int)fl);
    }
    c->float_grouped = fl == BACKEND_CPU_FLOAT_GROUPED;
    const char *pe = getenv("KVSERVE_CPU_PREPACK");
    if (prepack(c, !opt->no_prepack && !(pe && !strcmp(pe, "0")) && c->gemm == BACKEND_CPU_GEMM_INVARIANT) != KV_OK) {
        cpu_free(be);
        return kv_errf(KV_ENOMEM, err, errlen, "backend_cpu_new: out of memory repacking the weights");
    }
    backend_rope_inv_freq(cfg, c->inv_freq);
    openblas_set_num_threads(n_threads);
    if (c->gemm == BACKEND_CPU_GEMM_INVARIANT)
        KV_INFO("cpu backend: %d threads, gemm invariant (kernel %s, quantized weights: %s matmul, prefill %s; "
                "BF16 weights: %s matmul (%s); prefetch %s; OpenBLAS core %s unused)", n_threads, kv_matmul_isa_name(),
                kv_matmul_quant_name(kv_matmul_get_quant()),
                kv_matmul_get_quant() == KV_MATMUL_QUANT_INT8 ? kv_q8_packed_name() : "f32 kernels",
                kv_matmul_bf16_name(kv_matmul_get_bf16()),
                kv_matmul_bf16_family_name(), kv_quant_prefetch_name(kv_quant_get_prefetch()),
                openblas_get_corename());
    else
        KV_INFO("cpu backend: %d threads, gemm openblas (core %s; NOT batch-invariant; attention prefetch %s)",
                n_threads, openblas_get_corename(), kv_quant_prefetch_name(kv_quant_get_prefetch()));
    *out = be;
    return KV_OK;
}
