/*
 * The batch-1 decode megakernel's host side (decode_mk.cuh has the kernel): whether it serves
 * a model (mk_setup), its launch (mk_launch) and the timing tool's printout (mk_prof_print).
 */
#include <cuda_bf16.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "cuda_ctx.h"
#include "decode_mk.cuh"

typedef void (*mk_kernel_t)(const mk_params);
/* the kernel for head_dim hd, the profile on or off */
static mk_kernel_t mk_kernel(int hd, bool prof) {
    if (prof) return hd == 64 ? k_decode_mk<64, true> : k_decode_mk<128, true>;
    return hd == 64 ? k_decode_mk<64, false> : k_decode_mk<128, false>;
}

kv_status mk_setup(struct cuda_ctx *c, char *err, size_t errlen) {
    const struct model_config *cfg = &c->m->cfg;
    const char *e = getenv("KVSERVE_CUDA_MK");
    c->mk = false;
    int hd = cfg->head_dim, nh = cfg->n_heads, nkv = cfg->n_kv_heads, G = nh / nkv, dim = cfg->dim, ffn = cfg->ffn_dim;
    int nc = c->n_sm, qkvw = (nh + 2 * nkv) * hd;
    if ((e && *e ? *e == '0' : !MK_DEFAULT) || c->f32w || c->det || !c->dec_tc || !c->qkv_fuse || c->skip || G > 8 ||
        (hd != 64 && hd != 128) || dim % MK_KQ || (nh * hd) % MK_KQ || ffn % MK_KQ || nkv > nc ||
        (dim + nc - 1) / nc > MK_CW * 32) /* the residual rows of a CTA: one per thread */
        return KV_OK;

    int dev = c->dev, coop = 0, optin = 0;
    CU_TRY(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev), "device attribute");
    CU_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "device attribute");
    if (!coop) return KV_OK;
    /* the product slots: rows per CTA x K / MK_KQ, the largest of the four products */
    auto cdiv = [](long a, long b) { return (a + b - 1) / b; };
    long sl = cdiv(qkvw, nc) * (dim / MK_KQ), t;
    if ((t = cdiv(dim, nc) * (nh * hd / MK_KQ)) > sl) sl = t;
    if ((t = 2 * cdiv(ffn, nc) * (dim / MK_KQ)) > sl) sl = t;
    if ((t = cdiv(dim, nc) * (ffn / MK_KQ)) > sl) sl = t;
    long xk = dim > nh * hd ? dim : nh * hd;
    if (ffn > xk) xk = ffn;
    size_t xbb = (size_t)xk * 4, own = xbb + (size_t)sl * sizeof(float);
    /* the attention's parts: at most 2 ceil(nc / nkv) after the graph's power-of-two rounding */
    size_t att = dec_tc_smem_bytes(hd, G, 2 * (int)cdiv(nc, nkv), MK_ANS);
    size_t u = ((att > own ? att : own) + 127) / 128 * 128;
    long room = (long)optin - 1024 /* static shared memory */ - MK_HEAD - (long)u;
    int nst = room > 0 ? (int)(room / MK_CHUNK) : 0;
    const char *ns = getenv("KVSERVE_CUDA_MK_NST"); /* experiments: ring stages, 4 .. MK_MAX_NST */
    int want = ns && atoi(ns) >= 4 && atoi(ns) <= MK_MAX_NST ? atoi(ns) : MK_NST;
    if (nst > want) nst = want;
    if (nst < 4) return KV_OK;
    c->mk_lm_rows = (int)(sl / (dim / MK_KQ)); /* the output head's rows a run: what the slots hold */
    c->mk_nst = nst, c->mk_u_off = MK_HEAD + (unsigned)nst * MK_CHUNK, c->mk_part_off = (unsigned)xbb;
    c->mk_smem = c->mk_u_off + u;
    mk_kernel_t k = mk_kernel(hd, false), kp = mk_kernel(hd, true);
    CU_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)c->mk_smem), "megakernel setup");
    CU_TRY(cudaFuncSetAttribute(kp, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)c->mk_smem), "megakernel setup");
    int per_sm = 0;
    CU_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, MK_THREADS, c->mk_smem), "megakernel occupancy");
    if (per_sm < 1) return KV_OK;
    struct mk_layer *hl = (struct mk_layer *)calloc((size_t)cfg->n_layers, sizeof *hl);
    if (!hl) return kv_errf(KV_ENOMEM, err, errlen, "cuda backend: out of host memory");
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct cuda_layer *L = &c->L[l];
        hl[l] = {(const __nv_bfloat16 *)L->wqkv, (const __nv_bfloat16 *)L->wo, (const __nv_bfloat16 *)L->wgu,
                 (const __nv_bfloat16 *)L->wdown, L->attn_norm, L->ffn_norm, L->bqkv, L->q_norm, L->k_norm};
    }
    cudaError_t ce = kvc_malloc(&c->mk_layers, (size_t)cfg->n_layers * sizeof *hl);
    if (ce == cudaSuccess) ce = kvc_memcpy_sync(c->mk_layers, hl, (size_t)cfg->n_layers * sizeof *hl, cudaMemcpyHostToDevice);
    free(hl);
    CU_TRY(ce, "megakernel layer table");
    CU_TRY(kvc_malloc((void **)&c->mk_bar, 16), "cudaMalloc (megakernel barrier)");
    CU_TRY(kvc_memset_async(c->mk_bar, 0, 16, c->st), "memset (megakernel barrier)");
    const char *lme = getenv("KVSERVE_CUDA_MK_LM"); /* experiments: 0 the output head in two kernels after it */
    c->mk_lm = !(lme && *lme == '0') && c->mk_lm_rows > 0;
    const char *dbg = getenv("KVSERVE_CUDA_MK_DBG");
    c->mk_dbg = dbg ? atoi(dbg) : 0;
    const char *pf = getenv("KVSERVE_CUDA_MK_PROF");
    if (pf && *pf == '1') {
        CU_TRY(kvc_malloc((void **)&c->mk_prof, (size_t)c->n_sm * MK_NPROF * sizeof(long long)), "cudaMalloc (profile)");
        /* (zero: with KVSERVE_CUDA_MK_DBG & 16 the producer writes none of its slots) */
        CU_TRY(kvc_memset_async(c->mk_prof, 0, (size_t)c->n_sm * MK_NPROF * sizeof(long long), c->st), "memset (profile)");
    }
    c->mk = true;
    return KV_OK;
}

/* KVSERVE_CUDA_MK_PROF=1 (a timing tool, not for serving: one blocking copy a step): the
 * step's megakernel phase cycles, mean and max over the CTAs, on stderr. */
void mk_prof_print(struct cuda_ctx *c) {
    static const char *const names[MK_NPROF] = {"norm", "load", "products", "(starved)", "epilogue", "grid barrier",
                                                "attention", "all", "qkv>", "attn>", "o>", "gu>", "down>", "pairs@pos", "@other",
                                                "idle@qkv", "@o", "@gu", "@down", "@head"};
    long long *h = (long long *)malloc((size_t)c->n_sm * MK_NPROF * sizeof(long long));
    if (!h || kvc_memcpy_sync(h, c->mk_prof, (size_t)c->n_sm * MK_NPROF * sizeof(long long), cudaMemcpyDeviceToHost)) {
        free(h);
        return;
    }
    int khz = 0;
    cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, c->dev);
    double us = khz > 0 ? 1e3 / khz : 0;
    char line[1024];
    int o = snprintf(line, sizeof line, "mk prof (us, mean/max over CTAs):");
    for (int k = 0; k < MK_NPROF; k++) {
        double s = 0, mx = 0;
        for (int i = 0; i < c->n_sm; i++) s += (double)h[(size_t)i * MK_NPROF + k], mx = fmax(mx, (double)h[(size_t)i * MK_NPROF + k]);
        o += snprintf(line + o, sizeof line - (size_t)o, " %s %.0f/%.0f", names[k], s / c->n_sm * us, mx * us);
    }
    fprintf(stderr, "%s\n", line);
    free(h);
}

kv_status mk_launch(struct cuda_ctx *c, int split_len, int max_parts, const int32_t *d_pos, const int32_t *d_bto,
                    const int32_t *d_bt, bool lm, char *err, size_t errlen) {
    const struct model_config *cfg = &c->m->cfg;
    mk_params P;
    memset(&P, 0, sizeof P);
    P.layers = (const mk_layer *)c->mk_layers;
    P.n_layers = cfg->n_layers, P.dim = cfg->dim, P.ffn = cfg->ffn_dim, P.nh = cfg->n_heads, P.nkv = cfg->n_kv_heads;
    P.G = P.nh / P.nkv, P.tpb = c->tpb, P.neox = cfg->rope_neox ? 1 : 0;
    P.eps = cfg->rms_eps, P.sl2 = 1.4426950408889634f / sqrtf((float)cfg->head_dim);
    P.inv_freq = c->inv_freq, P.x = c->x, P.qkv = c->h, P.a = (__nv_bfloat16 *)c->a;
    P.pool = (__nv_bfloat16 *)c->pool, P.block_floats = c->block_floats;
    P.row_pos = d_pos, P.row_bt = d_bto, P.bt = d_bt, P.split_len = split_len, P.max_parts = max_parts;
    P.part = c->part, P.part_ml = c->part_ml, P.cnt = c->dec_cnt, P.bar = c->mk_bar;
    P.nst = c->mk_nst, P.u_off = c->mk_u_off, P.part_off = c->mk_part_off, P.prof = c->mk_prof;
    P.dbg = c->mk_dbg;
    P.wout = (const __nv_bfloat16 *)c->output, P.out_norm = c->out_norm, P.logits = c->logits;
    P.vocab = cfg->n_vocab, P.lm = lm ? 1 : 0, P.lm_rows = c->mk_lm_rows;
    cudaLaunchConfig_t cf = {};
    cf.gridDim = dim3((unsigned)c->n_sm), cf.blockDim = dim3(MK_THREADS), cf.dynamicSmemBytes = c->mk_smem, cf.stream = c->st;
    cudaLaunchAttribute at[1] = {};
    at[0].id = cudaLaunchAttributeCooperative; /* every CTA resident at once: the grid barriers need it */
    at[0].val.cooperative = 1;
    cf.attrs = at, cf.numAttrs = 1;
    kvc_launched();
    mk_kernel_t k = mk_kernel(cfg->head_dim, c->mk_prof != NULL);
    cudaError_t e = cudaLaunchKernelEx(&cf, k, P);
    if (e == cudaErrorCooperativeLaunchTooLarge) { /* the SMs are not all ours (MPS, a partition) */
        c->mk = false;
        KV_WARN("cuda backend: the decode megakernel cannot have every SM; one-row steps use eight kernels a layer "
                "from the next step on");
    }
    CU_TRY(e, "decode megakernel");
    return KV_OK;
}

