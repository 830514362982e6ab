/*
 * CUDA backend (issue 10) against the CPU backend, on a GPU. Every GPU test skips with a
 * visible "SKIP:" line when the build has no CUDA backend or no GPU is usable (this is what
 * CI and the development machine do); scripts/gpu-test.sh runs it on the device.
 *  - registry: backend_kind_parse / backend_create("cuda") answers cleanly (always runs).
 *  - stories260K greedy: the 12 public reference prompts, batched (12 sequences, scattered
 *    block tables), 64 greedy tokens each: CPU tokens == llama.cpp's; CUDA with f32 weights
 *    == CPU for every token; CUDA with bf16 weights == CPU on the same bf16-rounded weights
 *    for the first 16 tokens of every prompt (later divergences are printed).
 *  - random Llama-3 / Qwen2 / Qwen3 shapes: every logit row of a chunked prefill + decode of
 *    two batched sequences (up to 300 positions: several attention parts): f32 weights
 *    max|d| <= 1e-4 max|ref| against the CPU; bf16 weights ||d||_2 / ||ref||_2 <= 1e-2 on
 *    average over the rows and <= 2e-2 on every row, against the CPU on the same bf16-rounded
 *    weights (the error against unrounded f32 weights is printed). See compare_shape.
 *  - page copies: 64 KiB .. 512 MiB, H2D / D2H / D2D, 1..300 pages (across the 256-page launch
 *    limit and the 16-CTA split limit), zero bytes, bad sizes; checksums and memcmp against
 *    cudaMemcpy. Backend copy_to_host / copy_from_host / copy_blocks round trips.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "test_util.h"
#include "wmat_util.h"
#ifdef KVSERVE_HAVE_CUDA
#include "backend/cuda/backend_cuda.h"
#endif

/* True when a GPU test can run; otherwise prints why (once per test). */
static int gpu_ok(void) {
#ifdef KVSERVE_HAVE_CUDA
    char why[256];
    if (kv_cuda_device_check(why, sizeof why) != KV_OK) {
        fprintf(stderr, "SKIP: %s\n", why);
        return 0;
    }
    return 1;
#else
    fprintf(stderr, "SKIP: built without the CUDA backend (KVSERVE_CUDA=OFF or no nvcc)\n");
    return 0;
#endif
}

static void test_cuda_registry(void **st) {
    (void)st;
    enum backend_kind k = BACKEND_KIND_CPU;
    assert_int_equal(backend_kind_parse("cuda", &k), KV_OK);
    assert_int_equal(k, BACKEND_KIND_CUDA);
    assert_int_equal(backend_kind_parse("cpu", &k), KV_OK);
    assert_int_equal(k, BACKEND_KIND_CPU);
    assert_int_equal(backend_kind_parse("gpu", &k), KV_EINVAL);
    assert_int_equal(k, BACKEND_KIND_CPU);
    assert_string_equal(backend_kind_name(BACKEND_KIND_CUDA), "cuda");
    assert_null(backend_kind_name((enum backend_kind)7));
    struct model_config cfg = {.n_vocab = 16, .dim = 8, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1,
                               .head_dim = 4, .ffn_dim = 8, .rms_eps = 1e-5f, .rope_theta = 10000.f,
                               .max_ctx = 64};
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, 1, 0.1f);
    struct backend_options o = {.kind = BACKEND_KIND_CUDA};
    backend_t *be = (backend_t *)0x1;
    char err[256] = "";
    kv_status s = backend_create(m, &o, &be, err, sizeof err);
    if (s == KV_OK) { /* a GPU is here */
        assert_true(be && be->ops && !strcmp(be->ops->name, "cuda"));
        assert_null(be->ops->block_ptr);
        backend_free(be);
    } else {
        assert_int_equal(s, KV_EUNSUPPORTED);
        assert_true(be == (backend_t *)0x1);
        assert_true(strlen(err) > 0);
        fprintf(stderr, "  backend_create(cuda): %s\n", err);
    }
    o.kind = (enum backend_kind)9;
    assert_int_equal(backend_create(m, &o, &be, err, sizeof err), KV_EINVAL);
    o.kind = BACKEND_KIND_CPU;
    o.n_threads = 1;
    assert_int_equal(backend_create(m, &o, &be, err, sizeof err), KV_OK);
    assert_string_equal(be->ops->name, "cpu");
    backend_free(be);
    model_free(m);
}

#ifdef KVSERVE_HAVE_CUDA

static backend_t *make_be(const model_t *m, int cuda, bool f32w) {
    backend_t *be = NULL;
    char err[512];
    struct backend_options o = {.kind = cuda ? BACKEND_KIND_CUDA : BACKEND_KIND_CPU, .n_threads = 2,
                                .f32_weights = f32w};
    if (backend_create(m, &o, &be, err, sizeof err)) fail_msg("backend_create(%s): %s", cuda ? "cuda" : "cpu", err);
    return be;
}

static int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

/* Rounds the matrices the CUDA backend stores as bf16 (embeddings, output, projections;
 * not norms or biases) to bf16 in place, round-to-nearest-even as __float2bfloat16_rn: a
 * CPU reference on the same weights, so a comparison measures the device arithmetic. */
static void round_bf16(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &p[i], 4);
        if ((u & 0x7f800000u) != 0x7f800000u) u += 0x7fffu + ((u >> 16) & 1u);
        u &= 0xffff0000u;
        memcpy(&p[i], &u, 4);
    }
}
static void model_round_bf16(model_t *m) {
    const struct model_config *c = &m->cfg;
    size_t d = (size_t)c->dim, q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
    size_t f = (size_t)c->ffn_dim;
    /* model_alloc's F32 matrices (kv_wmat_f32 is writable there) */
    round_bf16(kv_wmat_f32(&m->w.tok_embd), (size_t)c->n_vocab * d);
    if (m->w.output.data != m->w.tok_embd.data) round_bf16(kv_wmat_f32(&m->w.output), (size_t)c->n_vocab * d);
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_weights *L = &m->w.layers[l];
        round_bf16(kv_wmat_f32(&L->wq), q * d), round_bf16(kv_wmat_f32(&L->wk), kv * d);
        round_bf16(kv_wmat_f32(&L->wv), kv * d), round_bf16(kv_wmat_f32(&L->wo), d * q);
        round_bf16(kv_wmat_f32(&L->w_gate), f * d), round_bf16(kv_wmat_f32(&L->w_up), f * d);
        round_bf16(kv_wmat_f32(&L->w_down), d * f);
    }
}

/* ---- stories260K greedy ---- */

#define MAXP 12
#define GEN 64
struct ref {
    int n;
    int32_t prompt[MAXP][256];
    int plen[MAXP];
    int32_t want[MAXP][GEN];
};

static int load_refs(struct ref *R) {
    char path[4096];
    if (!test_data_path(path, sizeof path, "references/stories260K/llamacpp_greedy.public.jsonl")) return 0;
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[1 << 16];
    R->n = 0;
    while (R->n < MAXP && fgets(line, sizeof line, f)) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        if (!j) continue;
        json_t *p = json_object_get(j, "prompt_ids"), *c = json_object_get(j, "completion_ids");
        assert_true(json_is_array(p) && json_is_array(c));
        assert_true(json_array_size(p) <= 256 && json_array_size(c) >= GEN);
        R->plen[R->n] = (int)json_array_size(p);
        for (size_t i = 0; i < json_array_size(p); i++) R->prompt[R->n][i] = (int32_t)json_integer_value(json_array_get(p, i));
        for (int i = 0; i < GEN; i++) R->want[R->n][i] = (int32_t)json_integer_value(json_array_get(c, (size_t)i));
        json_decref(j);
        R->n++;
    }
    fclose(f);
    return R->n > 0;
}

/* All prompts batched: one prefill forward, then GEN-1 decode forwards; out[s][i]. */
static void greedy(backend_t *be, const model_t *m, const struct ref *R, int32_t out[MAXP][GEN], int kv_dtype) {
    int tpb = 16, per = (256 + GEN + tpb - 1) / tpb, nb = per * R->n + 5;
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim,
                            .tokens_per_block = tpb, .kv_dtype = kv_dtype};
    assert_int_equal(be->ops->kv_alloc(be, nb, &g), KV_OK);
    int32_t bt[MAXP][24];
    for (int s = 0; s < R->n; s++) /* interleaved and reversed: block i of seq s = nb-1 - (i*n + s) */
        for (int i = 0; i < per; i++) bt[s][i] = nb - 1 - (i * R->n + s);
    struct batch_seq seqs[MAXP];
    int V = m->cfg.n_vocab;
    float *lg = malloc((size_t)MAXP * V * sizeof(float));
    int32_t cur[MAXP];
    char err[512];
    for (int step = 0; step < GEN; step++) {
        for (int s = 0; s < R->n; s++) {
            seqs[s] = (struct batch_seq){.tokens = step ? &cur[s] : R->prompt[s], .n_tokens = step ? 1 : R->plen[s],
                                         .n_past = step ? R->plen[s] + step - 1 : 0, .block_table = bt[s],
                                         .n_blocks = per, .logits = BATCH_LOGITS_LAST};
        }
        struct batch b = {seqs, R->n};
        if (be->ops->forward(be, &b, lg, err, sizeof err)) fail_msg("forward: %s", err);
        for (int s = 0; s < R->n; s++) out[s][step] = cur[s] = argmax(lg + (size_t)s * V, V);
    }
    free(lg);
}

static void test_cuda_stories_greedy(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    char path[4096];
    static struct ref R;
    if (!test_data_path(path, sizeof path, "models/stories260K/stories260K.gguf") || !load_refs(&R)) { skip(); return; }
    model_t *m = NULL;
    char err[256];
    if (model_load(path, &m, err, sizeof err)) fail_msg("model_load: %s", err);
    static int32_t cpu[MAXP][GEN], cpu_r[MAXP][GEN], gf32[MAXP][GEN], gbf16[MAXP][GEN], gkv[MAXP][GEN];
    backend_t *be = make_be(m, 0, false);
    greedy(be, m, &R, cpu, KV_DTYPE_F32);
    backend_free(be);
    model_t *mr = test_model_clone_f32(m); /* writable copy: the loaded file is mapped read-only */
    if (!mr) fail_msg("out of memory");
    model_round_bf16(mr);
    be = make_be(mr, 0, false);
    greedy(be, mr, &R, cpu_r, KV_DTYPE_F32);
    backend_free(be);
    model_free(mr);
    be = make_be(m, 1, true);
    greedy(be, m, &R, gf32, KV_DTYPE_F32);
    backend_free(be);
    be = make_be(m, 1, false);
    greedy(be, m, &R, gbf16, KV_DTYPE_F32);
    greedy(be, m, &R, gkv, KV_DTYPE_BF16); /* bf16 weights and bf16 KV (serve's cuda default) */
    backend_free(be);
    /* f32 weights: every token identical. bf16 weights: greedy decoding amplifies the last
     * bits (a near tie flips, then the texts part), so only the first 16 tokens are asserted
     * identical to the CPU on the same (bf16-rounded) weights; divergences are printed. */
    int bad_ref = 0, bad_f32 = 0, bad_bf16 = 0, bad_bf16_r = 0, early = 0, bad_kv = 0, kv_first = GEN;
    for (int s = 0; s < R.n; s++) {
        for (int i = 0; i < GEN; i++)
            if (cpu_r[s][i] != gkv[s][i]) {
                bad_kv++;
                if (i < kv_first) kv_first = i;
                break;
            }
        if (memcmp(cpu[s], R.want[s], sizeof cpu[s])) bad_ref++;
        if (memcmp(cpu[s], gf32[s], sizeof cpu[s])) bad_f32++;
        int first = -1, first_r = -1;
        for (int i = 0; i < GEN; i++) {
            if (first < 0 && cpu[s][i] != gbf16[s][i]) first = i;
            if (first_r < 0 && cpu_r[s][i] != gbf16[s][i]) first_r = i;
        }
        bad_bf16 += first >= 0;
        bad_bf16_r += first_r >= 0;
        early += first_r >= 0 && first_r < 16;
        if (first >= 0 || first_r >= 0)
            fprintf(stderr, "  prompt %d: cuda bf16 parts from the CPU at generated token %d (f32 weights), %d (bf16-rounded "
                            "weights; -1 = never)\n", s, first, first_r);
    }
    fprintf(stderr, "  stories260K, %d prompts x %d greedy tokens: cpu != llama.cpp %d, cuda f32 != cpu %d, "
                    "cuda bf16 != cpu %d, cuda bf16 != cpu on bf16 weights %d\n", R.n, GEN, bad_ref, bad_f32, bad_bf16,
            bad_bf16_r);
    /* bf16 KV: reported, not asserted (greedy texts part at a near tie; the logits tests
     * below bound the error) */
    fprintf(stderr, "  cuda bf16 weights + bf16 KV != cpu on bf16 weights: %d prompts (earliest at token %d)\n",
            bad_kv, bad_kv ? kv_first : -1);
    assert_int_equal(bad_ref, 0);
    assert_int_equal(bad_f32, 0);
    assert_int_equal(early, 0);
    model_free(m);
}

/* ---- random-shape logits ---- */

/* Two sequences (lengths n0, n1) in chunks (prefill chunks 77 and 60, then decode 1 token
 * at a time for the last 10), batched together; returns all logits rows of both, in
 * position order: out[(s * maxn + p) * V]. */
static float *run_chunks(backend_t *be, const model_t *m, const int32_t *toks, int n0, int n1, int kv_dtype) {
    int V = m->cfg.n_vocab, tpb = 16, maxn = n0 > n1 ? n0 : n1, per = (maxn + tpb - 1) / tpb, nb = 2 * per + 3;
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim,
                            .tokens_per_block = tpb, .kv_dtype = kv_dtype};
    assert_int_equal(be->ops->kv_alloc(be, nb, &g), KV_OK);
    int32_t bt[2][64];
    for (int i = 0; i < per; i++) bt[0][i] = 2 * i + 1, bt[1][i] = nb - 1 - 2 * i;
    float *out = calloc((size_t)2 * maxn * V, sizeof(float));
    float *lg = malloc((size_t)2 * 80 * V * sizeof(float));
    int n[2] = {n0, n1}, done[2] = {0, 0};
    char err[512];
    while (done[0] < n[0] || done[1] < n[1]) {
        struct batch_seq seqs[2];
        int ns = 0, which[2];
        for (int s = 0; s < 2; s++) {
            if (done[s] >= n[s]) continue;
            int left = n[s] - done[s];
            int c = left <= 10 ? 1 : (done[s] == 0 ? 77 : 60);
            if (c > left - 10 && left > 10) c = left - 10;
            seqs[ns] = (struct batch_seq){.tokens = toks + (size_t)s * maxn + done[s], .n_tokens = c,
                                          .n_past = done[s], .block_table = bt[s], .n_blocks = per,
                                          .logits = BATCH_LOGITS_ALL};
            which[ns++] = s;
        }
        struct batch b = {seqs, ns};
        if (be->ops->forward(be, &b, lg, err, sizeof err)) fail_msg("forward: %s", err);
        size_t row = 0;
        for (int i = 0; i < ns; i++) {
            int s = which[i];
            memcpy(out + ((size_t)s * maxn + done[s]) * V, lg + row * V, (size_t)seqs[i].n_tokens * V * sizeof(float));
            row += (size_t)seqs[i].n_tokens;
            done[s] += seqs[i].n_tokens;
        }
    }
    free(lg);
    return out;
}

/* f32 weights: returns the number of rows with max|d| / max|ref| > tol. bf16 weights
 * (activations into the GEMMs rounded to bf16 too, as every bf16 engine does): with e the
 * row's ||d||_2 / ||ref||_2 (METHOD.md's metric) against the CPU on the same bf16-rounded
 * weights, fails when the mean of e over the rows > tol or a row's e > 2 tol; measured on
 * the H200 (2026-12-01): mean ~5e-3, worst 1.3e-2 .. 1.5e-2; against the CPU on unrounded f32
 * weights worst ~2.2e-2 (printed). kv_dtype: the GPU's KV pool (the CPU reference is f32).
 * bf16 KV (checked with bf16 weights): same per-row limit 2 tol, mean limit 1.5 tol. Measured
 * on the H200 (2026-12-01, llama / qwen2 / qwen3): mean 1.10e-2 / 1.11e-2 / 1.05e-2, worst
 * 1.70e-2 / 1.54e-2 / 1.45e-2, so bf16 KV does NOT meet the bf16-weight mean limit of 1 tol
 * (same run, f32 KV: mean 9.6e-3 / 9.6e-3 / 9.2e-3). */
static int compare_shape(model_arch arch, bool f32w, double tol, int kv_dtype) {
    struct model_config cfg = {0};
    cfg.arch = arch;
    cfg.n_vocab = 2048;
    cfg.dim = 512;
    cfg.n_layers = 4;
    cfg.n_heads = 8;
    cfg.n_kv_heads = 2;
    cfg.head_dim = arch == MODEL_ARCH_QWEN3 ? 40 : 64; /* qwen3: != dim / n_heads, not a multiple of 32 */
    cfg.ffn_dim = 1408;
    cfg.rms_eps = 1e-5f;
    cfg.rope_theta = 500000.0f;
    cfg.rope_neox = true;
    if (arch == MODEL_ARCH_LLAMA) /* Llama-3 rope scaling, original length small enough to matter */
        cfg.rope_scaling = (struct rope_scaling){.type = 1, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                                                 .original_max_pos = 64};
    cfg.max_ctx = 4096;
    cfg.attn_bias = arch == MODEL_ARCH_QWEN2;
    cfg.qk_norm = arch == MODEL_ARCH_QWEN3;
    cfg.tied_embeddings = arch != MODEL_ARCH_LLAMA;
    cfg.bos_id = 1;
    cfg.eos_id = 2;
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, 77 + (uint64_t)arch, 0.05f);
    int n0 = 300, n1 = 97, maxn = 300, V = cfg.n_vocab;
    int32_t *toks = malloc((size_t)2 * maxn * sizeof *toks);
    kv_rng rng;
    kv_rng_seed(&rng, 5 + (uint64_t)arch);
    for (int i = 0; i < 2 * maxn; i++) toks[i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
    backend_t *cpu = make_be(m, 0, false), *gpu = make_be(m, 1, f32w);
    float *exact = run_chunks(cpu, m, toks, n0, n1, KV_DTYPE_F32), *got = run_chunks(gpu, m, toks, n0, n1, kv_dtype),
          *ref = exact;
    backend_free(cpu);
    if (!f32w) { /* reference on the same bf16-rounded weights */
        model_t *mr = NULL;
        assert_int_equal(model_alloc(&cfg, &mr), KV_OK);
        model_randomize(mr, 77 + (uint64_t)arch, 0.05f);
        model_round_bf16(mr);
        cpu = make_be(mr, 0, false);
        ref = run_chunks(cpu, mr, toks, n0, n1, KV_DTYPE_F32);
        backend_free(cpu);
        model_free(mr);
    }
    double we = 0; /* vs the exact f32 CPU, reported */
    for (int s = 0; s < 2; s++)
        for (int p = 0; p < (s ? n1 : n0); p++) {
            const float *a = got + ((size_t)s * maxn + p) * V, *r = exact + ((size_t)s * maxn + p) * V;
            double dd = 0, rr = 0;
            for (int i = 0; i < V; i++) dd += ((double)a[i] - r[i]) * ((double)a[i] - r[i]), rr += (double)r[i] * r[i];
            if (!(sqrt(dd / rr) <= we)) we = sqrt(dd / rr);
        }
    double worst_max = 0, worst_norm = 0, sum_norm = 0;
    int bad = 0, rows = 0;
    for (int s = 0; s < 2; s++)
        for (int p = 0; p < (s ? n1 : n0); p++) {
            const float *a = got + ((size_t)s * maxn + p) * V, *r = ref + ((size_t)s * maxn + p) * V;
            double md = 0, mr = 0, dd = 0, rr = 0;
            for (int i = 0; i < V; i++) {
                double d = fabs((double)a[i] - r[i]);
                if (!(d <= md)) md = d; /* NaN propagates */
                if (fabs(r[i]) > mr) mr = fabs(r[i]);
                dd += d * d, rr += (double)r[i] * r[i];
            }
            double em = md / mr, en = sqrt(dd / rr);
            if (!(em <= worst_max)) worst_max = em;
            if (!(en <= worst_norm)) worst_norm = en;
            sum_norm += en, rows++;
            double e = f32w ? em : en, lim = f32w ? tol : 2 * tol;
            if (!(e <= lim) && bad++ < 3)
                fprintf(stderr, "  %s %s (%s KV) seq %d pos %d: error %g > %g\n", model_arch_name(arch),
                        f32w ? "f32" : "bf16", kv_dtype_name(kv_dtype), s, p, e, lim);
        }
    double mean_norm = sum_norm / rows, mean_lim = kv_dtype == KV_DTYPE_BF16 ? 1.5 * tol : tol;
    if (!f32w && !(mean_norm <= mean_lim)) bad++;
    fprintf(stderr, "  %s, %s weights, %s KV: %d + %d positions, ||d||/||ref|| mean %.3g worst %.3g, worst "
                    "max|d|/max|ref| %.3g (tol %g, mean limit %g)%s; vs the f32 CPU on unrounded weights: worst ||d||/||ref|| %.3g\n",
            model_arch_name(arch), f32w ? "f32" : "bf16", kv_dtype_name(kv_dtype), n0, n1, mean_norm, worst_norm, worst_max, tol,
            f32w ? 0.0 : mean_lim, bad ? " FAIL" : "", we);
    if (ref != exact) free(ref);
    free(exact), free(got), free(toks);
    backend_free(gpu);
    model_free(m);
    return bad;
}

static void test_cuda_llama3_logits(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    int bad = compare_shape(MODEL_ARCH_LLAMA, false, 1e-2, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_LLAMA, true, 1e-4, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_LLAMA, false, 1e-2, KV_DTYPE_BF16);
    assert_int_equal(bad, 0);
}
static void test_cuda_qwen_logits(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    int bad = compare_shape(MODEL_ARCH_QWEN2, false, 1e-2, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_QWEN2, true, 1e-4, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_QWEN2, false, 1e-2, KV_DTYPE_BF16);
    bad += compare_shape(MODEL_ARCH_QWEN3, false, 1e-2, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_QWEN3, true, 1e-4, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_QWEN3, false, 1e-2, KV_DTYPE_BF16);
    assert_int_equal(bad, 0);
}

/* ---- errors ---- */

static void test_cuda_errors(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    struct model_config cfg = {.n_vocab = 64, .dim = 32, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2,
                               .head_dim = 8, .ffn_dim = 48, .rms_eps = 1e-5f, .rope_theta = 10000.f,
                               .max_ctx = 64};
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, 3, 0.1f);
    backend_t *be = make_be(m, 1, false);
    char err[256];
    int32_t tok[2] = {1, 2}, bt[2] = {0, 1};
    struct batch_seq s = {.tokens = tok, .n_tokens = 2, .n_past = 0, .block_table = bt, .n_blocks = 1,
                          .logits = BATCH_LOGITS_LAST};
    struct batch b = {&s, 1};
    float lg[64];
    assert_int_equal(be->ops->forward(be, &b, lg, err, sizeof err), KV_EINVAL); /* no pool */
    struct kv_geometry bad = {.n_layers = 3, .n_kv_heads = 2, .head_dim = 8, .tokens_per_block = 4};
    assert_int_equal(be->ops->kv_alloc(be, 4, &bad), KV_EINVAL);
    bad = (struct kv_geometry){.n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .tokens_per_block = 4,
                               .kv_dtype = KV_DTYPE_F16};
    assert_int_equal(be->ops->kv_alloc(be, 4, &bad), KV_EINVAL); /* f16 KV: not supported */
    bad.kv_dtype = 7;
    assert_int_equal(be->ops->kv_alloc(be, 4, &bad), KV_EINVAL);
    /* f32 then bf16 KV: forward, host round trips with that dtype's block size */
    for (int dt = KV_DTYPE_F32; dt <= KV_DTYPE_BF16; dt++) {
        struct kv_geometry g = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .tokens_per_block = 4, .kv_dtype = dt};
        assert_int_equal(kv_block_bytes(&g), (size_t)2 * 2 * 2 * 4 * 8 * (dt == KV_DTYPE_BF16 ? 2 : 4));
        assert_int_equal(be->ops->kv_alloc(be, 4, &g), KV_OK);
        assert_int_equal(kv_block_bytes(&be->geom), kv_block_bytes(&g));
        bt[0] = 4;
        assert_int_equal(be->ops->forward(be, &b, lg, err, sizeof err), KV_EINVAL);
        bt[0] = 0;
        tok[1] = 64;
        assert_int_equal(be->ops->forward(be, &b, lg, err, sizeof err), KV_EINVAL);
        tok[1] = 2;
        assert_int_equal(be->ops->forward(be, &b, lg, err, sizeof err), KV_OK);
        for (int i = 0; i < 64; i++) assert_true(isfinite(lg[i]));
        /* host copies and copy_blocks round trip, pageable and pinned */
        size_t bb = kv_block_bytes(&g);
        char *h1 = malloc(bb), *h2 = malloc(bb), *pin = kv_cuda_host_alloc(bb);
        assert_non_null(pin);
        void *hp[1] = {h1};
        int32_t b0[1] = {0}, b3[1] = {3}, b2[1] = {2};
        assert_int_equal(backend_copy_to_host(be, b0, hp, 1), KV_OK);
        int nz = 0;
        for (size_t i = 0; i < bb; i++) nz += h1[i] != 0;
        assert_true(nz > 0); /* the forward wrote K/V there */
        const void *hs[1] = {h1};
        assert_int_equal(backend_copy_from_host(be, hs, b3, 1), KV_OK);
        assert_int_equal(be->ops->copy_blocks(be, b3, b2, 1), KV_OK);
        void *pp[1] = {pin};
        assert_int_equal(backend_copy_to_host(be, b2, pp, 1), KV_OK);
        assert_memory_equal(pin, h1, bb);
        hp[0] = h2;
        assert_int_equal(backend_copy_to_host(be, b3, hp, 1), KV_OK);
        assert_memory_equal(h2, h1, bb);
        int32_t oob[1] = {4};
        assert_int_equal(backend_copy_to_host(be, oob, hp, 1), KV_EINVAL);
        assert_int_equal(backend_copy_to_host(be, oob, hp, 0), KV_OK);
        /* the next forward reads what came back from the host: same logits as from block 0 */
        float lg2[64];
        int32_t bt3[1] = {3};
        struct batch_seq s3 = {.tokens = tok + 1, .n_tokens = 1, .n_past = 1, .block_table = bt, .n_blocks = 1,
                               .logits = BATCH_LOGITS_LAST};
        struct batch b3b = {&s3, 1};
        assert_int_equal(be->ops->forward(be, &b3b, lg, err, sizeof err), KV_OK);
        s3.block_table = bt3;
        assert_int_equal(backend_copy_from_host(be, hs, bt3, 1), KV_OK); /* block 3 = block 0 after the 1st forward */
        assert_int_equal(be->ops->forward(be, &b3b, lg2, err, sizeof err), KV_OK);
        assert_memory_equal(lg, lg2, sizeof lg);
        free(h1), free(h2);
        kv_cuda_host_free(pin);
    }
    backend_free(be);
    model_free(m);
}

/* ---- page copies ---- */

static uint64_t checksum(const void *p, size_t n) {
    const uint64_t *q = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n / 8; i++) h = (h ^ q[i]) * 1099511628211ull;
    return h;
}
static void fill(void *p, size_t n, uint64_t seed) {
    uint64_t *q = p, x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n / 8; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        q[i] = x;
    }
}

static void page_case(size_t bytes, int n) {
    char err[256];
    void **hs = calloc((size_t)n, sizeof(void *)), **hd = calloc((size_t)n, sizeof(void *));
    void **d1 = calloc((size_t)n, sizeof(void *)), **d2 = calloc((size_t)n, sizeof(void *));
    uint64_t *ck = calloc((size_t)n, sizeof(uint64_t));
    char *chk = malloc(bytes);
    assert_true(hs && hd && d1 && d2 && ck && chk);
    for (int i = 0; i < n; i++) {
        hs[i] = kv_cuda_host_alloc(bytes), hd[i] = kv_cuda_host_alloc(bytes);
        d1[i] = kv_cuda_malloc(bytes), d2[i] = kv_cuda_malloc(bytes);
        assert_true(hs[i] && hd[i] && d1[i] && d2[i]);
        fill(hs[i], bytes, (uint64_t)i * 31 + bytes);
        memset(hd[i], 0xA5, bytes);
        ck[i] = checksum(hs[i], bytes);
    }
    /* H2D with the kernel, checked through cudaMemcpy */
    if (kv_cuda_copy_pages(KV_CUDA_H2D, d1, (const void *const *)hs, n, bytes, err, sizeof err)) fail_msg("%s", err);
    for (int i = 0; i < n; i++) {
        assert_int_equal(kv_cuda_memcpy(chk, d1[i], bytes), KV_OK);
        if (checksum(chk, bytes) != ck[i] || memcmp(chk, hs[i], bytes))
            fail_msg("H2D %zu bytes x %d: page %d differs", bytes, n, i);
    }
    /* D2D, then D2H with the kernel */
    if (kv_cuda_copy_pages(KV_CUDA_D2D, d2, (const void *const *)d1, n, bytes, err, sizeof err)) fail_msg("%s", err);
    if (kv_cuda_copy_pages(KV_CUDA_D2H, hd, (const void *const *)d2, n, bytes, err, sizeof err)) fail_msg("%s", err);
    for (int i = 0; i < n; i++)
        if (checksum(hd[i], bytes) != ck[i] || memcmp(hd[i], hs[i], bytes))
            fail_msg("D2D+D2H %zu bytes x %d: page %d differs", bytes, n, i);
    for (int i = 0; i < n; i++) {
        kv_cuda_host_free(hs[i]), kv_cuda_host_free(hd[i]);
        kv_cuda_free(d1[i]), kv_cuda_free(d2[i]);
    }
    fprintf(stderr, "  page copy %10zu bytes x %3d pages (host splits %2d): ok\n", bytes, n,
            kv_cuda_copy_splits(KV_CUDA_H2D, bytes));
    free(hs), free(hd), free(d1), free(d2), free(ck), free(chk);
}

static void test_cuda_page_copy(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    char err[256];
    /* zero bytes / zero pages: success without a launch (NULL tables are never read) */
    assert_int_equal(kv_cuda_copy_pages(KV_CUDA_H2D, NULL, NULL, 5, 0, err, sizeof err), KV_OK);
    assert_int_equal(kv_cuda_copy_pages(KV_CUDA_D2H, NULL, NULL, 0, 4096, err, sizeof err), KV_OK);
    void *a = kv_cuda_malloc(64), *b = kv_cuda_malloc(64);
    assert_int_equal(kv_cuda_copy_pages(KV_CUDA_D2D, &b, (const void *const *)&a, 1, 24, err, sizeof err),
                     KV_EUNSUPPORTED);
    kv_cuda_free(a), kv_cuda_free(b);
    assert_int_equal(kv_cuda_copy_splits(KV_CUDA_H2D, 0), 0);
    assert_int_equal(kv_cuda_copy_splits(KV_CUDA_H2D, 64 << 10), 1);
    assert_int_equal(kv_cuda_copy_splits(KV_CUDA_H2D, 8 << 20), 1);
    assert_int_equal(kv_cuda_copy_splits(KV_CUDA_H2D, (8 << 20) + 16), 2);
    assert_int_equal(kv_cuda_copy_splits(KV_CUDA_D2H, 128 << 20), 16);
    assert_int_equal(kv_cuda_copy_splits(KV_CUDA_D2H, (size_t)512 << 20), 16);
    assert_int_equal(kv_cuda_copy_splits(KV_CUDA_D2D, 8192 + 16), 3);
    struct { size_t bytes; int n; } cases[] = {
        {64 << 10, 1},          {64 << 10, 300},         {(64 << 10) + 16, 7}, {2 << 20, 33},
        {8 << 20, 3},           {(8 << 20) + 2048, 2},   {(40 << 20) + 48, 2}, {128 << 20, 1},
        {(136 << 20) + 16, 1},  {(size_t)512 << 20, 1},  {16, 257},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) page_case(cases[i].bytes, cases[i].n);
}

#else /* !KVSERVE_HAVE_CUDA */
static void test_cuda_stories_greedy(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_llama3_logits(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_qwen_logits(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_errors(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_page_copy(void **st) { (void)st; gpu_ok(); skip(); }
#endif

int main(void) {
    /* the backend's tuning variables would change what the tests compare (backend_cuda.h) */
    unsetenv("KVSERVE_CUDA_WEIGHTS"), unsetenv("KVSERVE_CUDA_GRAPHS"), unsetenv("KVSERVE_CUDA_ATTN");
    unsetenv("KVSERVE_CUDA_GEMV_MAX");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_registry),
        cmocka_unit_test(test_cuda_errors),
        cmocka_unit_test(test_cuda_page_copy),
        cmocka_unit_test(test_cuda_stories_greedy),
        cmocka_unit_test(test_cuda_llama3_logits),
        cmocka_unit_test(test_cuda_qwen_logits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
