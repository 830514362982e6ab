/*
 * CUDA backend: the forward driver (backend_cuda.h): batch validation, the GEMM choice (GEMV,
 * cuBLAS, the batch-invariant GEMM), which attention kernel each row runs (k_attn_flash for
 * prefill chunks; k_attn_dec_tc for up to 256 single-token rows where its shape applies, the
 * split kernels + combine otherwise), CUDA graphs per step
 * shape, sampling on the device (sample.cu) and the health probe after a failed step.
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
#include "attn_flash.cuh"
#include "attn_decode.cuh"

static kv_status validate(backend_t *be, const struct batch *b, char *err, size_t errlen) {
    const struct cuda_ctx *c = (const struct cuda_ctx *)be->ctx;
    return backend_check_batch(be, b, c->pool != NULL, c->tpb, c->m->cfg.n_vocab, 1L << 20, err, errlen);
}

/* Y[M,N] (f32) = X[M,K] W[N,K]^T, X and W in the weight dtype, f32 accumulation. */
/* Tile shapes of k_gemm_inv by row count (any choice gives the same bits: see kernels.cuh):
 * M <= 16: 16 x 32 tiles, 2 warps, 6 stages (decode: many CTAs, deep prefetch of W);
 * M <= 128: 32 x 64, 4 warps, 4 stages; larger: 64 x 128, 8 warps of 2 x 2 fragments, 3 stages. */
typedef ig_cfg<1, 2, 1, 1, 6> ig_small;
typedef ig_cfg<2, 2, 1, 2, 4> ig_mid;
typedef ig_cfg<2, 4, 2, 2, 3> ig_big;

/* Allows the dynamic shared memory the k_gemm_inv variants need (once per device use). */
cudaError_t inv_gemm_setup(void) {
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
#define GV(MM) klaunch(c, k_gemv_bf16<MM>, dim3(g), dim3(32 * GEMV_WARPS), 0, x, w, Y, N, K, c->gemv_late ? 1 : 0)
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
cudaError_t flash_setup(void) {
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

/* k_attn_dec instances: pool element TK x activation TA x NI items per thread (1, 2, 4). */
#define DEC_FOR(X)                                                                                          \
    X(float, float, 1) X(float, float, 2) X(float, float, 4) X(__nv_bfloat16, float, 1)                     \
    X(__nv_bfloat16, float, 2) X(__nv_bfloat16, float, 4) X(float, __nv_bfloat16, 1)                        \
    X(float, __nv_bfloat16, 2) X(float, __nv_bfloat16, 4) X(__nv_bfloat16, __nv_bfloat16, 1)                \
    X(__nv_bfloat16, __nv_bfloat16, 2) X(__nv_bfloat16, __nv_bfloat16, 4)
cudaError_t dec_setup(void) {
    cudaError_t e = cudaSuccess;
#define DEC_SET(TK, TA, NI)                                                                                   \
    if (e == cudaSuccess)                                                                                    \
        e = cudaFuncSetAttribute(k_attn_dec<TK, TA, NI>, cudaFuncAttributeMaxDynamicSharedMemorySize, DEC_SMEM_MAX);
    DEC_FOR(DEC_SET)
#undef DEC_SET
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_attn_dec_tc<64, float>, cudaFuncAttributeMaxDynamicSharedMemorySize, DEC_SMEM_MAX);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_attn_dec_tc<128, float>, cudaFuncAttributeMaxDynamicSharedMemorySize, DEC_SMEM_MAX);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_attn_dec_tc<64, __nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 DEC_SMEM_MAX);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_attn_dec_tc<128, __nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 DEC_SMEM_MAX);
    return e;
}

/* The part length of k_attn_dec_tc (k_attn_dec) for a step whose T1 split rows reach max_pos1
 * positions, or 0 where the split kernels (k_attn_part / k_attn_part2 + combine) run instead:
 * deterministic mode (its own fixed split), more than c->dec_rows rows, shapes outside
 * k_attn_dec_tc's. Parts of DEC_TILE positions,
 * DEC_TILE / 2 when the grid would have fewer CTAs than SMs (c->dec_half), doubled while the
 * grid has more than its target (c->dec_ctas, or 4 / 8 per SM by rows) CTAs or the combine's
 * weights would not fit in shared memory.
 * The length depends on the step's rows and longest context only through powers of two, so
 * a decode graph is reused until the context doubles. */
static int dec_split_len(const struct cuda_ctx *c, int T1, int max_pos1, int tks) {
    const struct model_config *cfg = &c->m->cfg;
    int hd = cfg->head_dim, G = cfg->n_heads / cfg->n_kv_heads;
    if (c->det || T1 < 1 || T1 > c->dec_rows || max_pos1 < 1 || hd % 8 ||
        (G * hd / 8 + DEC_THREADS - 1) / DEC_THREADS > 4)
        return 0;
    /* k_attn_dec_tc's shapes (bf16 pool, group <= 8, head_dim 64 / 128); the SIMT k_attn_dec
     * only with KVSERVE_CUDA_DEC_TC=0 (it beat the split kernels at batch 8 and at 4096 but
     * not at batch 1 / 512 on the H200: 5.00 vs 4.75 ms) */
    if (c->dec_tc && !(tks == 2 && G <= 8 && (hd == 64 || hd == 128))) return 0;
    long base = (long)T1 * cfg->n_kv_heads;
    int sl = DEC_TILE;
    if (c->dec_half && base * ((max_pos1 + DEC_TILE - 1) / DEC_TILE) < c->n_sm) sl = DEC_TILE / 2;
    if (c->split_set) sl = c->split_set; /* KVSERVE_CUDA_ATTN_SPLIT (experiments) */
    /* the grid's target: 4 CTAs per SM for 1-2 rows (longer parts, a shorter combine), 8 for
     * more (H200, Llama-3-8B shape, ms per step at 2048 / 4096 / 8192 with 8 -> 4 per SM:
     * 1 row 4.77 / 5.03 / 5.26 -> 4.74 / 4.83 / 5.10, 2 rows 5.49 / 5.70 / 6.13 -> 5.34 /
     * 5.49 / 5.94; 4 rows 5.77 / 6.17 / 7.05 -> 5.87 / 6.64 / 8.16, so 8 stays there) */
    long target = c->dec_ctas ? c->dec_ctas : (long)(T1 <= 2 ? 4 : 8) * c->n_sm;
    while (base * ((max_pos1 + sl - 1) / sl) > target && sl < (1 << 24)) sl *= 2;
    for (;;) {
        int parts = (max_pos1 + sl - 1) / sl, p2 = 1;
        while (p2 < parts) p2 *= 2; /* graph steps round the grid up */
        if (dec_smem_bytes(G, hd, tks, p2) <= DEC_SMEM_MAX || sl >= (1 << 24)) break;
        sl *= 2;
    }
    return dec_smem_bytes(G, hd, tks, 1) <= DEC_SMEM_MAX ? sl : 0;
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
    bool dec;   /* k_attn_dec for the split rows (split_len from dec_split_len) */
    bool mk;    /* the batch-1 decode megakernel runs the layers (decode_mk.cuh) */
    size_t meta_n; /* int32 entries of metadata to upload */
    int n_tiles;   /* > 0: k_attn_flash over these tiles (pairs at d_meta + tiles_off) */
    int n1;        /* with n_tiles: rows of the split kernels (list at d_meta + rows1_off) */
    size_t tiles_off, rows1_off, bt_off;
    bool single; /* every row is its sequence's only new token (no row reads another's new K/V) */
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
    bool single = true; /* no sequence has more than one new token */
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        T += s->n_tokens;
        if (s->n_tokens > 1) single = false;
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
    int dsl = dec_split_len(c, (int)T1, max_pos1, c->kv_dtype == KV_DTYPE_BF16 ? 2 : 4);
    /* the batch-1 megakernel: as many (KV head, part) pairs as CTAs, at most; parts a multiple
     * of DEC_TILE / 2 positions long, so a graph serves the next 16 x (SMs / KV heads) positions */
    const bool mk = c->mk && T == 1 && !n_tiles && sizeof(TA) == 2 && c->kv_dtype == KV_DTYPE_BF16 && !c->skip;
    if (mk) {
        int per = c->n_sm / cfg->n_kv_heads; /* parts per KV head */
        dsl = (max_pos1 + per - 1) / per;
        dsl = (dsl + DEC_TILE / 2 - 1) / (DEC_TILE / 2) * (DEC_TILE / 2);
    }
    if (dsl) attn2 = false, split_len = dsl, max_parts = (max_pos1 + dsl - 1) / dsl;
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
    struct enq_args ea = {T, L, max_parts, split_len, attn2, dsl != 0, mk, use_graph ? c->cap_meta : meta_n, n_tiles, n1,
                          tiles_off, rows1_off, bt_off, single};
    if (!use_graph) {
        if ((st = enqueue_step<TA>(c, &ea, err, errlen))) return st;
    } else {
        struct graph_key k;
        memset(&k, 0, sizeof k);
        k.T = T, k.L = L, k.parts = max_parts, k.split_len = split_len, k.tpb = c->tpb, k.attn2 = attn2;
        k.dec = dsl != 0, k.n_tiles = n_tiles, k.n1 = n1, k.single = single, k.mk = mk;
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
    if (mk && c->mk_prof) mk_prof_print(c);
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
    if (ea->mk) { /* every layer in the megakernel; x then holds the last residual */
        if ((st = mk_launch(c, ea->split_len, ea->max_parts, d_pos, d_bto, d_bt, L > 0 && c->mk_lm, err, errlen)))
            return st;
        if (L > 0 && !c->mk_lm) {
            if ((st = launch_norm<TA>(c, c->x, NULL, c->out_norm, L, d_lr, 0, err, errlen))) return st;
            if ((st = gemm(c, c->a, L, dim, c->output, cfg->n_vocab, c->logits, err, errlen))) return st;
        }
        return KV_OK;
    }
    int group = nh / nkv, hc = att_hc(cfg);
    float scale = 1.0f / sqrtf((float)hd);
    bool kvb = c->kv_dtype == KV_DTYPE_BF16;
    size_t att_smem = (size_t)ATT_WARPS * hc * (hd + 2) * sizeof(float);
    size_t att2_smem = ((size_t)hc * hd + ATT_WARPS * ATT_HC * 32 + (size_t)ATT_WARPS * hc * (hd + 2)) * sizeof(float);
    /* every row its sequence's only new token and served by k_attn_dec_tc: the q/k
     * post-processing and the K/V store run inside it (dec_qkv_t), no k_qkv_post launch
     * (KVSERVE_CUDA_QKV_FUSE=0: off). Not with several rows of one sequence (a prefill chunk
     * on the split kernels): a row reads the K/V the rows before it store. */
    const bool dtc = kvb && c->dec_tc && group <= 8 && (hd == 64 || hd == 128); /* k_attn_dec_tc's shapes */
    const bool fq = c->qkv_fuse && ea->single && ea->dec && !ea->n_tiles && dtc && !(c->skip & (SKIP_QKV | SKIP_ATTN));
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
        if ((c->skip & SKIP_QKV) || fq) { /* fq: inside k_attn_dec_tc */
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
        if (ea->dec) { /* few single-token rows: k_attn_dec(_tc), combined in the same kernel */
            dim3 dg(T1, (unsigned)nkv, (unsigned)max_parts);
            float sl2 = scale * 1.4426950408889634f;
            if (dtc) {
#define DTC_ARGS                                                                                              \
    (const float *)c->h, qkvw, (__nv_bfloat16 *)c->pool, c->block_floats, l, nkv, c->tpb, group, d_pos, d_bto, \
        d_bt, d_rows1, split_len, max_parts, sl2, c->part, c->part_ml, c->dec_cnt, (TA *)c->a, c->dec_late, qp
                dec_qkv_t qp = {(const float *)Ly->bqkv, (const float *)Ly->q_norm, (const float *)Ly->k_norm,
                                (const float *)c->inv_freq, cfg->rms_eps, cfg->rope_neox ? 1 : 0, fq ? 1 : 0};
                size_t dsm = dec_tc_smem_bytes(hd, group, max_parts);
                if (hd == 64)
                    CU_TRY(klaunch_pdl(c, c->dec_pdl, k_attn_dec_tc<64, TA>, dg, dim3(DEC_THREADS), dsm, DTC_ARGS),
                           "decode attention");
                else
                    CU_TRY(klaunch_pdl(c, c->dec_pdl, k_attn_dec_tc<128, TA>, dg, dim3(DEC_THREADS), dsm, DTC_ARGS),
                           "decode attention");
#undef DTC_ARGS
                goto attn_done;
            }
            int ni = (group * hd / 8 + DEC_THREADS - 1) / DEC_THREADS;
            ni = ni <= 1 ? 1 : ni <= 2 ? 2 : 4;
            size_t dsm = dec_smem_bytes(group, hd, kvb ? 2 : 4, max_parts);
#define DEC_ARGS(TK)                                                                                           \
    (const float *)c->h, qkvw, (const TK *)c->pool, c->block_floats, l, nkv, hd, c->tpb, group, d_pos, d_bto, d_bt, \
        d_rows1, split_len, max_parts, sl2, c->part, c->part_ml, c->dec_cnt, (TA *)c->a, c->dec_late
#define DEC_NI(TK)                                                                                            \
    do {                                                                                                      \
        cudaError_t de_ = ni == 1   ? klaunch_pdl(c, c->dec_pdl, k_attn_dec<TK, TA, 1>, dg, dim3(DEC_THREADS), dsm, DEC_ARGS(TK)) \
                         : ni == 2 ? klaunch_pdl(c, c->dec_pdl, k_attn_dec<TK, TA, 2>, dg, dim3(DEC_THREADS), dsm, DEC_ARGS(TK)) \
                                   : klaunch_pdl(c, c->dec_pdl, k_attn_dec<TK, TA, 4>, dg, dim3(DEC_THREADS), dsm, DEC_ARGS(TK)); \
        CU_TRY(de_, "decode attention");                                                                      \
    } while (0)
            if (kvb) DEC_NI(__nv_bfloat16);
            else DEC_NI(float);
#undef DEC_NI
#undef DEC_ARGS
            goto attn_done;
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
            KLAUNCH("swiglu", k_swiglu<TA>,
                    dim3((unsigned)((ffn + 4 * SWIGLU_THREADS - 1) / (4 * SWIGLU_THREADS)), (unsigned)(T < 65535 ? T : 65535)),
                    dim3(SWIGLU_THREADS), 0, (const float *)c->h, (TA *)c->a, T, ffn);
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

kv_status cuda_forward(backend_t *be, const struct batch *b, float *logits, char *err, size_t errlen) {
    return forward_any(be, b, logits, NULL, NULL, err, errlen);
}

kv_status cuda_forward_sample(backend_t *be, const struct batch *b, const struct backend_sampling *sp,
                                     struct backend_sample_out *out, char *err, size_t errlen) {
    if (!sp && b && batch_n_logits(b) > 0) return kv_errf(KV_EINVAL, err, errlen, "forward_sample: sp is NULL");
    static const struct backend_sampling none = {}; /* only used when no row has logits */
    return forward_any(be, b, NULL, sp ? sp : &none, out, err, errlen);
}

bool cuda_healthy(backend_t *be, char *why, size_t whylen) {
    struct cuda_ctx *c = (struct cuda_ctx *)be->ctx;
    if (!__atomic_load_n(&c->sick, __ATOMIC_ACQUIRE)) return true;
    if (why && whylen) snprintf(why, whylen, "%s", c->sick_why);
    return false;
}

extern "C" int kv_cuda_megakernel(const backend_t *be) { return ((const struct cuda_ctx *)be->ctx)->mk ? 1 : 0; }

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

extern "C" kv_status kv_cuda_attn_decode(int mode, int kv_bf16, int T, int n_heads, int n_kv, int hd, int tpb,
                                         const int32_t *pos, const int32_t *bt_off, const int32_t *bt, const float *q,
                                         const void *pool, int split_len, float *out, char *err, size_t errlen) {
    if (!pos || !bt_off || !bt || !q || !pool || !out || T < 1 || n_kv < 1 || n_heads % n_kv || hd < 8 || hd > 256 ||
        hd % 4 || tpb < 1 || split_len < 1 || mode < 0 || mode > 2 ||
        (mode >= 1 && (hd % 8 || T > DEC_ROWS_CAP || (n_heads / n_kv * hd / 8 + DEC_THREADS - 1) / DEC_THREADS > 4)))
        return kv_errf(KV_EINVAL, err, errlen, "kv_cuda_attn_decode: bad argument");
    int G = n_heads / n_kv, hp[DEC_ROWS_CAP];
    if (T > DEC_ROWS_CAP) return kv_errf(KV_EINVAL, err, errlen, "kv_cuda_attn_decode: T > %d", DEC_ROWS_CAP);
    /* positions are device memory: the part count comes from the caller's bound */
    CU_TRY(kvc_memcpy_sync(hp, pos, (size_t)T * sizeof(int32_t), cudaMemcpyDeviceToHost), "positions");
    int max_pos = 0;
    for (int i = 0; i < T; i++) max_pos = hp[i] + 1 > max_pos ? hp[i] + 1 : max_pos;
    int max_parts = (max_pos + split_len - 1) / split_len;
    struct cuda_ctx c;
    memset(&c, 0, sizeof c);
    size_t slots = (size_t)T * n_heads * max_parts, block_floats = (size_t)2 * n_kv * tpb * hd;
    kv_status r = KV_OK;
    CU_TRY(cudaStreamCreateWithFlags(&c.st, cudaStreamNonBlocking), "stream create");
    float *part = NULL, *ml = NULL;
    unsigned *cnt = NULL;
    cudaError_t e = kvc_malloc((void **)&part, slots * hd * sizeof(float));
    if (e == cudaSuccess) e = kvc_malloc((void **)&ml, slots * 2 * sizeof(float));
    if (e == cudaSuccess) e = kvc_malloc((void **)&cnt, (size_t)T * n_kv * sizeof(unsigned));
    if (e == cudaSuccess) e = kvc_memset_async(cnt, 0, (size_t)T * n_kv * sizeof(unsigned), c.st);
    if (e == cudaSuccess) e = dec_setup();
    float scale = 1.0f / sqrtf((float)hd);
    bool tc = mode == 1 && kv_bf16 && G <= 8 && (hd == 64 || hd == 128);
    if (e == cudaSuccess && tc) {
        size_t dsm = dec_tc_smem_bytes(hd, G, max_parts);
        if (dsm > DEC_SMEM_MAX) e = cudaErrorInvalidValue;
        dim3 dg((unsigned)T, (unsigned)n_kv, (unsigned)max_parts);
#define DTC_T(HD)                                                                                             \
    klaunch(&c, k_attn_dec_tc<HD, float>, dg, dim3(DEC_THREADS), dsm, q, n_heads * hd, (__nv_bfloat16 *)pool,       \
            block_floats, 0, n_kv, tpb, G, pos, bt_off, bt, (const int32_t *)NULL, split_len, max_parts,         \
            scale * 1.4426950408889634f, part, ml, cnt, out, 0, dec_qkv_t{})
        for (int rep = 0; rep < 2 && e == cudaSuccess; rep++) e = hd == 64 ? DTC_T(64) : DTC_T(128);
#undef DTC_T
    } else if (e == cudaSuccess && mode >= 1) {
        int ni = (G * hd / 8 + DEC_THREADS - 1) / DEC_THREADS;
        ni = ni <= 1 ? 1 : ni <= 2 ? 2 : 4;
        size_t dsm = dec_smem_bytes(G, hd, kv_bf16 ? 2 : 4, max_parts);
        if (dsm > DEC_SMEM_MAX) e = cudaErrorInvalidValue;
        dim3 dg((unsigned)T, (unsigned)n_kv, (unsigned)max_parts);
#define DEC_T(TK, NI)                                                                                         \
    klaunch(&c, k_attn_dec<TK, float, NI>, dg, dim3(DEC_THREADS), dsm, q, n_heads * hd, (const TK *)pool, block_floats, 0, \
            n_kv, hd, tpb, G, pos, bt_off, bt, (const int32_t *)NULL, split_len, max_parts,                    \
            scale * 1.4426950408889634f, part, ml, cnt, out, 0)
        for (int rep = 0; rep < 2 && e == cudaSuccess; rep++) {
            if (kv_bf16) e = ni == 1 ? DEC_T(__nv_bfloat16, 1) : ni == 2 ? DEC_T(__nv_bfloat16, 2) : DEC_T(__nv_bfloat16, 4);
            else e = ni == 1 ? DEC_T(float, 1) : ni == 2 ? DEC_T(float, 2) : DEC_T(float, 4);
        }
#undef DEC_T
    } else if (e == cudaSuccess) {
        int hc = G < ATT_HC ? G : ATT_HC;
        while (G % hc) hc--;
        size_t att_smem = (size_t)ATT_WARPS * hc * (hd + 2) * sizeof(float);
        dim3 ag((unsigned)T, (unsigned)(n_heads / hc), (unsigned)max_parts);
#define ATT_T(D, TK)                                                                                          \
    klaunch(&c, k_attn_part<D, TK>, ag, dim3(32 * ATT_WARPS), att_smem, q, n_heads * hd, (const TK *)pool,     \
            block_floats, 0, n_kv, hd, tpb, G, hc, pos, bt_off, bt, (const int32_t *)NULL, split_len, max_parts, scale, \
            part, ml)
        if (kv_bf16) e = hd <= 32 ? ATT_T(1, __nv_bfloat16) : hd <= 64 ? ATT_T(2, __nv_bfloat16)
                       : hd <= 128 ? ATT_T(4, __nv_bfloat16) : ATT_T(8, __nv_bfloat16);
        else e = hd <= 32 ? ATT_T(1, float) : hd <= 64 ? ATT_T(2, float) : hd <= 128 ? ATT_T(4, float) : ATT_T(8, float);
#undef ATT_T
        if (e == cudaSuccess)
            e = klaunch(&c, k_attn_combine<float>, dim3((unsigned)T, (unsigned)n_heads), dim3((unsigned)((hd + 31) / 32 * 32)),
                        (size_t)max_parts * sizeof(float), (const float *)part, (const float *)ml, pos,
                        (const int32_t *)NULL, split_len, max_parts, n_heads, hd, out);
    }
    if (e == cudaSuccess) e = kvc_stream_sync(c.st);
    if (e != cudaSuccess) r = kv_errf(KV_EIO, err, errlen, "cuda: attention: %s", cudaGetErrorString(e));
    if (part) kvc_free(part);
    if (ml) kvc_free(ml);
    if (cnt) kvc_free(cnt);
    cudaStreamDestroy(c.st);
    return r;
}
