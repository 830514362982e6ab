/*
 * CUDA backend (issue 10), second GPU test binary: the tensor-core prefill attention
 * (k_attn_flash) in mixed batches. Every GPU test skips with a visible "SKIP:" line where the
 * build has no CUDA backend or no GPU is usable; scripts/gpu-test.sh runs it on the device.
 * KVSERVE_CUDA_TESTS=PATTERN (cmocka wildcards) runs only the matching tests.
 *  - flash prefill: three sequences in steps that mix prefill chunks (from position 0 and
 *    from unaligned positions after an earlier chunk; eager and graph steps) with single-token
 *    rows (the split kernels over their row list), then pure decode steps; every logit
 *    row against the CPU on the same bf16-rounded weights (compare_shape's limits), for
 *    head_dim 64 / GQA group 4, head_dim 40 (padded to 48) and head_dim 32 with group 6
 *    (FL_BM / 6 = 10 rows per tile: 4 of the 64 M rows unused), f32 and bf16 KV; the
 *    same schedule with KVSERVE_CUDA_FLASH=0 (split kernels only) is scored too.
 *  - decode attention: k_attn_dec_tc / k_attn_dec (kv_cuda_attn_decode modes 1 and 2) and the
 *    split kernels (mode 0)
 *    against a double-precision reference on random q / K / V behind scattered block tables:
 *    batch 1..8 rows with contexts that are and are not multiples of the block size, GQA
 *    groups 1 / 2 / 4 / 8 / 16 / 32, head_dim 32..128, f32 and bf16 K/V, parts of 16 .. 4096 positions
 *    (one part: no combine), each k_attn_dec case launched twice (its counters reset).
 *  - decode megakernel: one sequence decoded a token at a time from position 0 (every step
 *    one row: decode_mk.cuh serves it, checked) on a bf16 pool, with and without graphs,
 *    against the CPU's prefill of the same tokens (every position's logits, compare_shape's
 *    bf16-KV limits) and against the same run with KVSERVE_CUDA_MK=0 (the eight-kernel
 *    layers); Llama shape with head_dim 128 / GQA group 2 over 2200 positions (the attention's
 *    part length grows every 528 positions at 4 KV heads), Qwen3 shape (q/k norms) with q/k/v biases, head_dim
 *    64 / group 4; greedy tokens equal to the eight-kernel run's except at near-ties.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "cuda_test_util.h"
#include "engine/sampler.h"
#include "test_util.h"

#ifdef KVSERVE_HAVE_CUDA

/* ---- flash prefill in mixed batches ---- */

#define FS 3      /* sequences */
#define FMAXN 240 /* positions per sequence */
/* steps: new tokens per sequence (0 = not in the step) */
static const int g_fsched[][FS] = {
    {100, 40, 30}, /* prefill from 0: 170 rows */
    {120, 1, 1},   /* a long chunk at n_past 100; two single-token rows on the split kernels */
    {1, 99, 1},    /* a chunk at the unaligned n_past 41 */
    {1, 20, 1},    /* graph steps (<= 64 rows) with a flash chunk and split rows */
    {7, 1, 1},
    {1, 1, 1},     /* decode: graph step, split kernels only */
    {1, 1, 1},
};
#define FSTEPS ((int)(sizeof g_fsched / sizeof g_fsched[0]))

/* Runs the schedule on be; every position's logits into out[(s * FMAXN + p) * V]; returns
 * the number of positions of each sequence in n[]. */
static float *run_fsched(backend_t *be, const model_t *m, const int32_t *toks, int kv_dtype, int n[FS]) {
    int V = m->cfg.n_vocab, tpb = 16, per = (FMAXN + tpb - 1) / tpb, nb = FS * per + 2;
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim,
                            .tokens_per_block = tpb, .kv_dtype = kv_dtype};
    assert_int_equal(be->ops->kv_alloc(be, nb, &g), KV_OK);
    int32_t bt[FS][32];
    for (int s = 0; s < FS; s++) /* scattered: block i of sequence s = nb - 1 - (i * FS + s) */
        for (int i = 0; i < per; i++) bt[s][i] = nb - 1 - (i * FS + s);
    float *out = calloc((size_t)FS * FMAXN * V, sizeof(float)), *lg = malloc((size_t)200 * V * sizeof(float));
    assert_true(out && lg);
    memset(n, 0, FS * sizeof n[0]);
    char err[512];
    for (int st = 0; st < FSTEPS; st++) {
        struct batch_seq seqs[FS];
        int ns = 0, which[FS];
        for (int s = 0; s < FS; s++) {
            int c = g_fsched[st][s];
            if (!c) continue;
            assert_true(n[s] + c <= FMAXN);
            seqs[ns] = (struct batch_seq){.tokens = toks + (size_t)s * FMAXN + n[s], .n_tokens = c, .n_past = n[s],
                                          .block_table = bt[s], .n_blocks = per, .logits = BATCH_LOGITS_ALL};
            which[ns++] = s;
        }
        struct batch b = {seqs, ns};
        if (be->ops->forward(be, &b, lg, err, sizeof err)) fail_msg("forward (step %d): %s", st, err);
        size_t row = 0;
        for (int i = 0; i < ns; i++) {
            int s = which[i];
            memcpy(out + ((size_t)s * FMAXN + n[s]) * V, lg + row * V, (size_t)seqs[i].n_tokens * V * sizeof(float));
            row += (size_t)seqs[i].n_tokens;
            n[s] += seqs[i].n_tokens;
        }
    }
    free(lg);
    return out;
}

/* A random model of shape cfg (seed) into *m and the same weights rounded to bf16 (the CPU
 * reference on what the CUDA backend stores) into *mr. */
static void model_pair(const struct model_config *cfg, uint64_t seed, model_t **m, model_t **mr) {
    assert_int_equal(model_alloc(cfg, m), KV_OK);
    model_randomize(*m, seed, 0.05f);
    assert_int_equal(model_alloc(cfg, mr), KV_OK);
    model_randomize(*mr, seed, 0.05f);
    model_round_bf16(*mr);
}

/* One shape: CPU reference on bf16-rounded weights, then the GPU with flash and without, for
 * f32 and bf16 KV. Returns the failures. */
static int flash_shape(const char *name, model_arch arch, int n_heads, int n_kv, int hd) {
    struct model_config cfg = {0};
    cfg.arch = arch;
    cfg.n_vocab = 2048, cfg.dim = 384, cfg.n_layers = 3, cfg.n_heads = n_heads, cfg.n_kv_heads = n_kv;
    cfg.head_dim = hd, cfg.ffn_dim = 1024, cfg.rms_eps = 1e-5f, cfg.rope_theta = 500000.0f, cfg.rope_neox = true;
    cfg.qk_norm = arch == MODEL_ARCH_QWEN3, cfg.tied_embeddings = true;
    cfg.max_ctx = 4096, cfg.bos_id = 1, cfg.eos_id = 2;
    model_t *m = NULL, *mr = NULL;
    model_pair(&cfg, 500 + (uint64_t)hd, &m, &mr);
    int V = cfg.n_vocab, n[FS], bad = 0;
    int32_t *toks = malloc((size_t)FS * FMAXN * sizeof *toks);
    kv_rng rng;
    kv_rng_seed(&rng, 17 + (uint64_t)hd);
    for (int i = 0; i < FS * FMAXN; i++) toks[i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
    backend_t *cpu = make_be(mr, 0, false);
    float *ref = run_fsched(cpu, mr, toks, KV_DTYPE_F32, n);
    backend_free(cpu);
    for (int kvd = 0; kvd < 2; kvd++)
        for (int flash = 1; flash >= 0; flash--) {
            if (!flash) setenv("KVSERVE_CUDA_FLASH", "0", 1);
            backend_t *gpu = make_be(m, 1, false);
            unsetenv("KVSERVE_CUDA_FLASH");
            float *got = run_fsched(gpu, m, toks, kvd ? KV_DTYPE_BF16 : KV_DTYPE_F32, n);
            backend_free(gpu);
            for (int s = 0; s < FS; s++) {
                char what[160];
                snprintf(what, sizeof what, "%s (heads %d/%d, head_dim %d), %s KV, %s, seq %d", name, n_heads, n_kv,
                         hd, kvd ? "bf16" : "f32", flash ? "flash prefill" : "split kernels only", s);
                size_t o = (size_t)s * FMAXN * V;
                /* bf16 KV: compare_shape's mean limit 1.5e-2 (its row limit 2e-2 -> 3e-2 here) */
                bad += score_rows(what, got + o, ref + o, n[s], V, false, kvd ? 1.5e-2 : 1e-2);
            }
            free(got);
        }
    free(ref), free(toks);
    model_free(m), model_free(mr);
    return bad;
}

static void test_cuda_flash_prefill(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    int bad = flash_shape("llama", MODEL_ARCH_LLAMA, 8, 2, 64);
    bad += flash_shape("qwen3", MODEL_ARCH_QWEN3, 8, 2, 40);
    bad += flash_shape("llama", MODEL_ARCH_LLAMA, 12, 2, 32);
    assert_int_equal(bad, 0);
}

/* ---- decode attention (k_attn_dec) against a reference and the split kernels ---- */

static float bf16_round(float f) { /* round-to-nearest-even, as __float2bfloat16_rn */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* One case; returns the number of output values over the limit (printed). */
static int dec_case(int T, int nh, int nkv, int hd, int bf16, int split_len, const int *ctx, uint64_t seed) {
    int tpb = 16, G = nh / nkv, per[8], nb = 0;
    for (int r = 0; r < T; r++) per[r] = (ctx[r] + tpb - 1) / tpb, nb += per[r];
    size_t bf = (size_t)2 * nkv * tpb * hd, esz = bf16 ? 2 : 4;
    float *pool = malloc((size_t)nb * bf * sizeof(float)), *q = malloc((size_t)T * nh * hd * sizeof(float));
    float *ref = malloc((size_t)T * nh * hd * sizeof(float)), *got = malloc((size_t)T * nh * hd * sizeof(float));
    uint16_t *p16 = malloc((size_t)nb * bf * 2);
    int32_t bt[8 * 320], bto[8], pos[8];
    assert_true(pool && q && ref && got && p16 && nb <= 8 * 320);
    kv_rng rng;
    kv_rng_seed(&rng, seed);
    for (size_t i = 0; i < (size_t)nb * bf; i++) {
        float v = (float)((double)(kv_rng_next(&rng) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
        pool[i] = bf16 ? bf16_round(v) : v;
        uint32_t u;
        memcpy(&u, &pool[i], 4);
        p16[i] = (uint16_t)(u >> 16);
    }
    for (int i = 0; i < T * nh * hd; i++) /* scores of a few units: a peaked softmax */
        q[i] = (float)((double)(kv_rng_next(&rng) >> 11) / 9007199254740992.0 * 6.0 - 3.0);
    /* scattered block tables: a random permutation of the blocks */
    for (int i = 0; i < nb; i++) bt[i] = i;
    for (int i = nb - 1; i > 0; i--) {
        int j = (int)(kv_rng_next(&rng) % (uint64_t)(i + 1)), t = bt[i];
        bt[i] = bt[j], bt[j] = t;
    }
    for (int r = 0, o = 0; r < T; r++) bto[r] = o, pos[r] = ctx[r] - 1, o += per[r];
    /* reference (double) */
    double *sc = malloc(8192 * sizeof(double));
    assert_non_null(sc);
    for (int r = 0; r < T; r++)
        for (int h = 0; h < nh; h++) {
            int kvh = h / G;
            const float *qh = q + ((size_t)r * nh + h) * hd;
            double M = -INFINITY, L = 0;
            for (int p = 0; p < ctx[r]; p++) {
                const float *k = pool + (size_t)bt[bto[r] + p / tpb] * bf + ((size_t)kvh * tpb + p % tpb) * hd;
                double d = 0;
                for (int e = 0; e < hd; e++) d += (double)qh[e] * k[e];
                sc[p] = d / sqrt((double)hd);
                if (sc[p] > M) M = sc[p];
            }
            for (int p = 0; p < ctx[r]; p++) L += (sc[p] = exp(sc[p] - M));
            for (int e = 0; e < hd; e++) {
                double a = 0;
                for (int p = 0; p < ctx[r]; p++)
                    a += sc[p] * pool[(size_t)bt[bto[r] + p / tpb] * bf + (((size_t)nkv + kvh) * tpb + p % tpb) * hd + e];
                ref[((size_t)r * nh + h) * hd + e] = (float)(a / L);
            }
        }
    free(sc);
    void *d_pool = kv_cuda_malloc((size_t)nb * bf * esz), *d_q = kv_cuda_malloc((size_t)T * nh * hd * 4);
    void *d_out = kv_cuda_malloc((size_t)T * nh * hd * 4), *d_i = kv_cuda_malloc((size_t)(nb + 16) * 4);
    assert_true(d_pool && d_q && d_out && d_i);
    int32_t *d_pos = (int32_t *)d_i, *d_bto = d_pos + 8, *d_bt = d_bto + 8;
    assert_int_equal(kv_cuda_memcpy(d_pool, bf16 ? (void *)p16 : (void *)pool, (size_t)nb * bf * esz), KV_OK);
    assert_int_equal(kv_cuda_memcpy(d_q, q, (size_t)T * nh * hd * 4), KV_OK);
    assert_int_equal(kv_cuda_memcpy(d_pos, pos, (size_t)T * 4), KV_OK);
    assert_int_equal(kv_cuda_memcpy(d_bto, bto, (size_t)T * 4), KV_OK);
    assert_int_equal(kv_cuda_memcpy(d_bt, bt, (size_t)nb * 4), KV_OK);
    int bad = 0;
    char err[512];
    /* mode 1 runs k_attn_dec_tc where it applies: q and p enter its bf16 products as hi + lo
     * halves (~16 mantissa bits), so its limit is 3e-4 (a plain bf16 q or p gives ~4e-3); the
     * f32 kernels 2e-5 */
    bool tc = bf16 && nh / nkv <= 8 && (hd == 64 || hd == 128);
    for (int mode = 2; mode >= 0; mode--) {
        double lim = mode == 1 && tc ? 3e-4 : 2e-5;
        if (kv_cuda_attn_decode(mode, bf16, T, nh, nkv, hd, tpb, d_pos, d_bto, d_bt, d_q, d_pool, split_len, d_out,
                                err, sizeof err))
            fail_msg("kv_cuda_attn_decode: %s", err);
        assert_int_equal(kv_cuda_memcpy(got, d_out, (size_t)T * nh * hd * 4), KV_OK);
        double worst = 0;
        for (int i = 0; i < T * nh * hd; i++) {
            /* |ref| <= 1 (a convex combination of values in [-1, 1]) */
            double d = fabs((double)got[i] - ref[i]);
            if (!(d <= lim)) bad++;
            if (!(d <= worst)) worst = d;
        }
        printf("decode attention %s: rows %d heads %d/%d hd %d %s KV split %d ctx %d..%d: max |d| %.2e\n",
               mode == 2 ? "k_attn_dec" : mode == 1 ? (tc ? "k_attn_dec_tc" : "k_attn_dec (mode 1)") : "split kernels", T, nh, nkv, hd, bf16 ? "bf16" : "f32", split_len, ctx[0],
               ctx[T - 1], worst);
    }
    kv_cuda_free(d_pool), kv_cuda_free(d_q), kv_cuda_free(d_out), kv_cuda_free(d_i);
    free(pool), free(q), free(ref), free(got), free(p16);
    return bad;
}

static void test_cuda_decode_attn(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    /* (rows, heads, kv heads, head_dim): GQA 1, 4, 8 and 2 (Qwen3-like), Llama-3-8B's 32/8 x 128 */
    static const int shapes[][4] = {{1, 32, 8, 128}, {3, 8, 8, 64}, {8, 8, 2, 128}, {5, 16, 2, 64},
                                    {2, 16, 8, 128}, {4, 12, 3, 32}, {6, 8, 1, 128}, {7, 4, 4, 40},
                                    {2, 32, 2, 128}, {1, 64, 2, 128}};
    static const int ctxs[] = {1, 15, 16, 17, 100, 255, 513, 1000, 2049, 4100};
    static const int splits[] = {16, 32, 64, 128, 4096};
    int bad = 0, k = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int bf16 = 0; bf16 < 2; bf16++, k++) {
            int T = shapes[s][0], ctx[8];
            for (int r = 0; r < T; r++) ctx[r] = ctxs[(k * 3 + r * 7) % 10];
            int sl = splits[(k + bf16) % 5];
            bad += dec_case(T, shapes[s][1], shapes[s][2], shapes[s][3], bf16, sl, ctx, 900 + (uint64_t)k);
        }
    assert_int_equal(bad, 0);
}

/* ---- sampling on the device against the host sampler ---- */

#define SR 14 /* rows: one request per sequence */
static void sample_params(int i, int V, struct sampling_params *sp) {
    sampling_params_default(sp);
    switch (i) {
    case 0: sp->temperature = 0; break;
    case 1: sp->temperature = 0, sp->logprobs = true, sp->top_logprobs = 5; break;
    case 2: sp->temperature = 0.8f; break;
    case 3: sp->top_k = 40; break;
    case 4: sp->top_p = 0.9f, sp->logprobs = true; break;
    case 5: sp->min_p = 0.05f; break;
    case 6: sp->top_k = 50, sp->top_p = 0.8f, sp->min_p = 0.02f, sp->temperature = 1.3f; break;
    case 7: sp->temperature = 0, sp->repetition_penalty = 1.3f, sp->top_logprobs = 3; break;
    case 8: sp->temperature = 0.7f, sp->frequency_penalty = 0.5f, sp->presence_penalty = 0.3f; break;
    case 9:
        sp->temperature = 0.9f, sp->repetition_penalty = 0.8f, sp->frequency_penalty = -0.4f;
        sp->presence_penalty = 1.5f, sp->top_p = 0.95f, sp->logprobs = true, sp->top_logprobs = 20;
        break;
    case 10: sp->temperature = 1.5f, sp->top_k = V; break; /* top_k = V: no sort */
    case 11: sp->temperature = 0.3f, sp->top_p = 0.5f; break;
    case 12: sp->temperature = 2.0f, sp->top_k = 1; break;
    default: sp->temperature = 1.0f, sp->top_p = 0.999f, sp->min_p = 0.3f, sp->top_logprobs = 2; break;
    }
}

/* SR sequences of a random model with V = 5003 (not a multiple of the block size) prefill
 * prompts with repeated ids, then decode steps: each step runs forward (logits back) and the
 * host sampler (sampler_sample) on a copy of each row's RNG, then forward_sample on the same
 * batch with the same draws; ids, chosen logprobs and top alternatives must agree (ids
 * exactly, logprobs within 2e-5). The sampled ids are fed back, so histories (penalties)
 * grow. Graph steps: forward_sample's CUDA calls are one graph launch, 2 launches (+1 with a
 * sort), one download and one sync, no host->device copy or memset. */
static void test_cuda_sample(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    struct model_config cfg = {0};
    cfg.arch = MODEL_ARCH_LLAMA;
    cfg.n_vocab = 5003, cfg.dim = 256, cfg.n_layers = 2, cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.head_dim = 64;
    cfg.ffn_dim = 512, cfg.rms_eps = 1e-5f, cfg.rope_theta = 10000.f, cfg.rope_neox = true, cfg.max_ctx = 1024;
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, 31337, 0.15f); /* peaked enough that top_p / min_p cut somewhere */
    int V = cfg.n_vocab, tpb = 16, plen = 40, steps = 12, per = (plen + steps + tpb) / tpb;
    backend_t *be = make_be(m, 1, false);
    assert_non_null(be->ops->forward_sample);
    struct kv_geometry g = {.n_layers = cfg.n_layers, .n_kv_heads = cfg.n_kv_heads, .head_dim = cfg.head_dim,
                            .tokens_per_block = tpb, .kv_dtype = KV_DTYPE_BF16};
    assert_int_equal(be->ops->kv_alloc(be, SR * per, &g), KV_OK);
    static int32_t toks[SR][64], bt[SR][8];
    kv_rng rng[SR], trng;
    kv_rng_seed(&trng, 7);
    struct sampling_params sps[SR];
    for (int s = 0; s < SR; s++) {
        for (int i = 0; i < per; i++) bt[s][i] = s * per + i;
        for (int i = 0; i < plen; i++) toks[s][i] = (int32_t)(kv_rng_next(&trng) % 60); /* repeats */
        kv_rng_seed(&rng[s], 1000 + (uint64_t)s);
        sample_params(s, V, &sps[s]);
    }
    struct sampler_scratch scr;
    assert_int_equal(sampler_scratch_init(&scr, V), KV_OK);
    float *lg = malloc((size_t)SR * V * sizeof(float));
    static struct backend_sampling bs[SR];
    static struct backend_sample_out bo[SR];
    struct batch_seq seqs[SR];
    char err[512];
    int bad_id = 0, bad_lp = 0, bad_top = 0, n = 0, sampled = 0;
    double worst_lp = 0;
    for (int step = 0; step <= steps; step++) {
        int np = step ? plen + step - 1 : 0;
        for (int s = 0; s < SR; s++)
            seqs[s] = (struct batch_seq){.tokens = step ? &toks[s][np] : toks[s], .n_tokens = step ? 1 : plen,
                                         .n_past = np, .block_table = bt[s], .n_blocks = per,
                                         .logits = BATCH_LOGITS_LAST};
        struct batch b = {seqs, SR};
        if (be->ops->forward(be, &b, lg, err, sizeof err)) fail_msg("forward: %s", err);
        int ngen = step; /* generated ids so far: toks[s][plen .. plen + step) */
        for (int s = 0; s < SR; s++) {
            kv_rng r2 = rng[s];
            bool lp = sps[s].logprobs || sps[s].top_logprobs > 0;
            bs[s] = (struct backend_sampling){
                .temperature = sps[s].temperature, .top_k = sps[s].top_k, .top_p = sps[s].top_p,
                .min_p = sps[s].min_p, .presence_penalty = sps[s].presence_penalty,
                .frequency_penalty = sps[s].frequency_penalty, .repetition_penalty = sps[s].repetition_penalty,
                .n_top = sps[s].top_logprobs, .logprob = lp,
                .u = sps[s].temperature > 0 ? kv_rng_f64(&r2) : 0.0, .prompt = toks[s], .n_prompt = plen,
                .gen = toks[s] + plen, .n_gen = ngen};
        }
        struct kv_cuda_counters c0, c1;
        kv_cuda_counters_get(&c0);
        if (be->ops->forward_sample(be, &b, bs, bo, err, sizeof err)) fail_msg("forward_sample: %s", err);
        kv_cuda_counters_get(&c1);
        if (step >= 2) { /* graph steps, scratch grown */
            assert_int_equal(c1.stream_syncs - c0.stream_syncs, 1);
            assert_int_equal(c1.d2h_copies - c0.d2h_copies, 1);
            assert_int_equal(c1.h2d_copies - c0.h2d_copies, 0);
            assert_int_equal(c1.memsets - c0.memsets, 0);
            assert_int_equal(c1.graph_launches - c0.graph_launches, 1);
        }
        for (int s = 0; s < SR; s++) {
            struct token_logprob chosen, top[20];
            bool lp = bs[s].logprob;
            int32_t id = sampler_sample(&sps[s], lg + (size_t)s * V, V, toks[s], plen, toks[s] + plen, ngen, &rng[s],
                                        &scr, lp ? &chosen : NULL, top, sps[s].top_logprobs);
            n++;
            sampled += sps[s].temperature > 0;
            if (bo[s].id != id && bad_id++ < 5)
                fprintf(stderr, "  step %d row %d: device sampled %d, host %d\n", step, s, bo[s].id, id);
            if (lp) {
                double d = fabs((double)bo[s].logprob - chosen.logprob);
                if (d > worst_lp) worst_lp = d;
                if (!(d <= 2e-5) && bad_lp++ < 5)
                    fprintf(stderr, "  step %d row %d: logprob %g vs host %g\n", step, s, bo[s].logprob, chosen.logprob);
                for (int k = 0; k < sps[s].top_logprobs; k++) {
                    double dk = fabs((double)bo[s].top_logprob[k] - top[k].logprob);
                    if (dk > worst_lp) worst_lp = dk;
                    if ((bo[s].top_id[k] != top[k].id || !(dk <= 2e-5)) && bad_top++ < 5)
                        fprintf(stderr, "  step %d row %d top %d: (%d, %g) vs host (%d, %g)\n", step, s, k,
                                bo[s].top_id[k], bo[s].top_logprob[k], top[k].id, top[k].logprob);
                }
            }
            toks[s][plen + step] = id; /* the next step's token */
        }
    }
    fprintf(stderr, "  device sampling vs host sampler: %d rows (%d drawn), ids differ %d, logprobs off %d, top "
                    "alternatives off %d, worst |logprob difference| %.3g\n", n, sampled, bad_id, bad_lp, bad_top,
            worst_lp);
    /* a bad request is refused before any work */
    bs[0].n_top = 21;
    assert_int_equal(be->ops->forward_sample(be, &(struct batch){seqs, SR}, bs, bo, err, sizeof err), KV_EINVAL);
    sampler_scratch_free(&scr);
    free(lg);
    backend_free(be);
    model_free(m);
    assert_int_equal(bad_id + bad_lp + bad_top, 0);
}

/* ---- sticky faults: the backend reports itself unhealthy ---- */

/* KVSERVE_CUDA_FAULT=forward:2;sticky:4: forward 2 fails (non-sticky, injected) and the
 * backend stays healthy and computes forward 3 as before; forward 4 launches a trapping kernel
 * (a real sticky error): it fails, healthy() turns false with the reason, and every later
 * forward fails at once with KV_EIO naming it. */
static void test_cuda_sticky_fault(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    struct model_config cfg = {.n_vocab = 256, .dim = 64, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1,
                               .head_dim = 32, .ffn_dim = 128, .rms_eps = 1e-5f, .rope_theta = 10000.f,
                               .max_ctx = 64};
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, 5, 0.1f);
    setenv("KVSERVE_CUDA_FAULT", "forward:2;sticky:4", 1);
    backend_t *be = make_be(m, 1, false);
    unsetenv("KVSERVE_CUDA_FAULT");
    struct kv_geometry g = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 32, .tokens_per_block = 16};
    assert_int_equal(be->ops->kv_alloc(be, 4, &g), KV_OK);
    int32_t tok[4] = {1, 2, 3, 4}, bt[1] = {0};
    float lg[2][256];
    char err[512], why[320];
    struct batch_seq sq = {.tokens = tok, .n_tokens = 4, .n_past = 0, .block_table = bt, .n_blocks = 1,
                           .logits = BATCH_LOGITS_LAST};
    struct batch b = {&sq, 1};
    assert_true(be->ops->healthy(be, why, sizeof why));
    assert_int_equal(be->ops->forward(be, &b, lg[0], err, sizeof err), KV_OK);
    assert_int_equal(be->ops->forward(be, &b, lg[1], err, sizeof err), KV_EIO);
    assert_true(be->ops->healthy(be, why, sizeof why));
    assert_int_equal(be->ops->forward(be, &b, lg[1], err, sizeof err), KV_OK);
    assert_memory_equal(lg[0], lg[1], sizeof lg[0]);
    kv_status s4 = be->ops->forward(be, &b, lg[1], err, sizeof err);
    fprintf(stderr, "  sticky forward: %s: %s\n", kv_status_str(s4), err);
    assert_int_equal(s4, KV_EIO);
    assert_false(be->ops->healthy(be, why, sizeof why));
    fprintf(stderr, "  healthy() false: %s\n", why);
    assert_int_equal(be->ops->forward(be, &b, lg[1], err, sizeof err), KV_EIO);
    assert_non_null(strstr(err, "unhealthy"));
    backend_free(be);
    model_free(m);
}

/* ---- the batch-1 decode megakernel ---- */

/* Decodes toks[0 .. n) one token a step from position 0 on be (bf16 pool), every step's
 * logits into out[p * V]. mk: the megakernel serves the steps: each step's CUDA calls are
 * checked against backend_cuda.h's counts (graphs: one graph launch once the step's graph
 * exists, no memset, no host->device copy; eager: 2 launches (the embedding, the megakernel
 * with the output head; 4 with KVSERVE_CUDA_MK_LM=0: the head's norm and product after it),
 * 1 metadata upload). */
static void mk_run(backend_t *be, const model_t *m, const int32_t *toks, int n, float *out, bool mk, bool graphs) {
    int V = m->cfg.n_vocab, tpb = 16, per = (n + tpb - 1) / tpb, nb = per + 3;
    const char *lme = getenv("KVSERVE_CUDA_MK_LM");
    const unsigned launches = lme && *lme == '0' ? 4 : 2;
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim,
                            .tokens_per_block = tpb, .kv_dtype = KV_DTYPE_BF16};
    assert_int_equal(be->ops->kv_alloc(be, nb, &g), KV_OK);
    int32_t *bt = malloc((size_t)per * sizeof *bt);
    assert_non_null(bt);
    for (int i = 0; i < per; i++) bt[i] = nb - 1 - ((i * 7) % nb); /* scattered, distinct (7 coprime to nb) */
    char err[512];
    for (int p = 0; p < n; p++) {
        struct batch_seq sq = {.tokens = toks + p, .n_tokens = 1, .n_past = p, .block_table = bt, .n_blocks = per,
                               .logits = BATCH_LOGITS_LAST};
        struct batch b = {&sq, 1};
        struct kv_cuda_counters c0, c1;
        kv_cuda_counters_get(&c0);
        if (be->ops->forward(be, &b, out + (size_t)p * V, err, sizeof err)) fail_msg("forward (position %d): %s", p, err);
        kv_cuda_counters_get(&c1);
        if (!mk) continue;
        assert_int_equal(c1.stream_syncs - c0.stream_syncs, 1);
        assert_int_equal(c1.d2h_copies - c0.d2h_copies, 1);
        if (!graphs) {
            assert_int_equal(c1.launches - c0.launches, launches);
            assert_int_equal(c1.h2d_copies - c0.h2d_copies, 1);
        } else if (c1.graph_instantiations == c0.graph_instantiations) {
            assert_int_equal(c1.graph_launches - c0.graph_launches, 1);
            assert_int_equal(c1.launches - c0.launches, 0);
            assert_int_equal(c1.h2d_copies - c0.h2d_copies, 0);
            assert_int_equal(c1.memsets - c0.memsets, 0);
        } else {
            assert_int_equal(c1.captured_launches - c0.captured_launches, launches);
        }
    }
    free(bt);
}

static int mk_shape(const char *name, model_arch arch, bool bias, int n_heads, int n_kv, int hd, int dim, int ffn, int n,
                    bool graphs) {
    struct model_config cfg = {0};
    cfg.arch = arch;
    /* a vocabulary of 5003: an uneven split over the SMs, and on an H200 (132 SMs) 37-38 rows a
     * CTA, more than one run of the megakernel's output head at these shapes (24 / 16 rows) */
    cfg.n_vocab = 5003, cfg.dim = dim, cfg.n_layers = 2, cfg.n_heads = n_heads, cfg.n_kv_heads = n_kv;
    cfg.head_dim = hd, cfg.ffn_dim = ffn, cfg.rms_eps = 1e-5f, cfg.rope_theta = 500000.0f, cfg.rope_neox = true;
    cfg.qk_norm = arch == MODEL_ARCH_QWEN3, cfg.attn_bias = bias, cfg.tied_embeddings = true;
    cfg.max_ctx = 8192, cfg.bos_id = 1, cfg.eos_id = 2;
    model_t *m = NULL, *mr = NULL;
    model_pair(&cfg, 900 + (uint64_t)hd, &m, &mr);
    int V = cfg.n_vocab, bad = 0;
    int32_t *toks = malloc((size_t)n * sizeof *toks);
    kv_rng rng;
    kv_rng_seed(&rng, 31 + (uint64_t)hd);
    for (int i = 0; i < n; i++) toks[i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
    float *ref = malloc((size_t)n * V * sizeof(float)), *got = malloc((size_t)n * V * sizeof(float));
    float *off = malloc((size_t)n * V * sizeof(float));
    assert_true(ref && got && off);
    { /* the CPU: one prefill of every token, all logits */
        backend_t *cpu = make_be(mr, 0, false);
        int tpb = 16, per = (n + tpb - 1) / tpb;
        struct kv_geometry g = {.n_layers = cfg.n_layers, .n_kv_heads = n_kv, .head_dim = hd, .tokens_per_block = tpb,
                                .kv_dtype = KV_DTYPE_F32};
        assert_int_equal(cpu->ops->kv_alloc(cpu, per, &g), KV_OK);
        int32_t *bt = malloc((size_t)per * sizeof *bt);
        for (int i = 0; i < per; i++) bt[i] = i;
        struct batch_seq sq = {.tokens = toks, .n_tokens = n, .n_past = 0, .block_table = bt, .n_blocks = per,
                               .logits = BATCH_LOGITS_ALL};
        struct batch b = {&sq, 1};
        char err[512];
        if (cpu->ops->forward(cpu, &b, ref, err, sizeof err)) fail_msg("cpu forward: %s", err);
        free(bt);
        backend_free(cpu);
    }
    if (!graphs) setenv("KVSERVE_CUDA_GRAPHS", "0", 1);
    setenv("KVSERVE_CUDA_MK", "1", 1);
    backend_t *gpu = make_be(m, 1, false);
    if (!kv_cuda_megakernel(gpu)) fail_msg("%s: the decode megakernel does not serve this model on this device", name);
    mk_run(gpu, m, toks, n, got, true, graphs);
    backend_free(gpu);
    setenv("KVSERVE_CUDA_MK", "0", 1);
    gpu = make_be(m, 1, false);
    unsetenv("KVSERVE_CUDA_MK");
    unsetenv("KVSERVE_CUDA_GRAPHS");
    assert_int_equal(kv_cuda_megakernel(gpu), 0);
    mk_run(gpu, m, toks, n, off, false, graphs);
    backend_free(gpu);
    char what[200];
    snprintf(what, sizeof what, "%s megakernel%s vs cpu", name, graphs ? " (graphs)" : "");
    bad += score_rows(what, got, ref, n, V, false, 1.5e-2);
    snprintf(what, sizeof what, "%s eight-kernel layers vs cpu", name);
    bad += score_rows(what, off, ref, n, V, false, 1.5e-2);
    snprintf(what, sizeof what, "%s megakernel vs eight-kernel layers", name);
    bad += score_rows(what, got, off, n, V, false, 1e-2);
    /* greedy tokens: where the two runs pick different tokens, it must be a near-tie in the
     * eight-kernel run's logits (their gap <= 2e-2 max|logit| of the row: a different
     * summation order may flip those, nothing else) */
    int diff = 0, far = 0;
    for (int p = 0; p < n; p++) {
        const float *a = got + (size_t)p * V, *b = off + (size_t)p * V;
        int ia = argmax(a, V), ib = argmax(b, V);
        if (ia == ib) continue;
        diff++;
        double mx = 0;
        for (int i = 0; i < V; i++) mx = fmax(mx, fabs(b[i]));
        if (!((double)b[ib] - b[ia] <= 2e-2 * mx) && far++ < 3)
            fprintf(stderr, "  %s position %d: tokens %d / %d, gap %g of max %g\n", name, p, ia, ib, b[ib] - b[ia], mx);
    }
    fprintf(stderr, "  %s: greedy tokens differ at %d of %d positions (near-ties), %d not near-ties\n", name, diff, n,
            far);
    bad += far;
    free(ref), free(got), free(off), free(toks);
    model_free(m), model_free(mr);
    return bad;
}

static void test_cuda_decode_megakernel(void **st) {
    (void)st;
    if (!gpu_ok()) skip();
    int bad = 0;
    bad += mk_shape("llama hd128 g2", MODEL_ARCH_LLAMA, false, 8, 4, 128, 1024, 1536, 2200, true);
    bad += mk_shape("qwen3 hd64 g4 bias", MODEL_ARCH_QWEN3, true, 8, 2, 64, 512, 1024, 300, false);
    assert_int_equal(bad, 0);
}

#else /* !KVSERVE_HAVE_CUDA */
static void test_cuda_flash_prefill(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_sample(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_decode_attn(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_sticky_fault(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_decode_megakernel(void **st) { (void)st; gpu_ok(); skip(); }
#endif

int main(void) {
    /* the backend's tuning variables would change what the tests compare (backend_cuda.h) */
    unsetenv("KVSERVE_CUDA_WEIGHTS"), unsetenv("KVSERVE_CUDA_GRAPHS"), unsetenv("KVSERVE_CUDA_ATTN");
    unsetenv("KVSERVE_CUDA_GEMV_MAX"), unsetenv("KVSERVE_CUDA_CAPTURE"), unsetenv("KVSERVE_CUDA_FLASH");
    unsetenv("KVSERVE_CUDA_FAULT"), unsetenv("KVSERVE_CUDA_FLASH_MT");
    unsetenv("KVSERVE_CUDA_DEC_ROWS"), unsetenv("KVSERVE_CUDA_DEC_CTAS"), unsetenv("KVSERVE_CUDA_DEC_HALF");
    unsetenv("KVSERVE_CUDA_ATTN_SPLIT"), unsetenv("KVSERVE_CUDA_MK");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_flash_prefill),
        cmocka_unit_test(test_cuda_sample),
        cmocka_unit_test(test_cuda_decode_attn),
        cmocka_unit_test(test_cuda_decode_megakernel),
        cmocka_unit_test(test_cuda_sticky_fault), /* last: it leaves the process's CUDA context unusable */
    };
    const char *only = getenv("KVSERVE_CUDA_TESTS");
    if (only && *only) cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
