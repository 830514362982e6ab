/*
 * CUDA backend (issue 10) against the CPU backend, on a GPU. Every GPU test skips with a
 * visible "SKIP:" line when the build has no CUDA backend or no GPU is usable (this is what
 * CI and the development machine do); scripts/gpu-test.sh runs it on the device.
 * KVSERVE_CUDA_TESTS=PATTERN (cmocka wildcards) runs only the matching tests.
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
 *  - quantized GGUFs (models/tiny-quant F16, Q8_0, Q4_K_M; dequantized on the host at upload):
 *    every logit row against the CPU backend on the same file (its f32 matmul mode: the exactly
 *    dequantized weights), f32 weights max|d| <= 1e-4
 *    max|ref|, bf16 weights the bf16 limits against the CPU on the bf16-rounded weights.
 *  - decode loop host syncs (issue 10): exact CUDA call counts per forward (kv_cuda_counters:
 *    one sync and one logits copy per step, no host->device copy, memset or allocation once a
 *    step's graph exists), graphs captured in cudaStreamCaptureModeGlobal; graphs off shows the
 *    eager counts; graph and eager logits agree.
 *  - batch-invariant mode (issue 10, --deterministic): test_cuda_gemm_invariant, row r of the
 *    product bitwise the same for M = 1..64 (3 row offsets) and M = 100, 200, 320 (every tile
 *    shape), three (K, N) shapes; the default mode's differing rows are printed.
 *    test_cuda_deterministic: 16 sequences (1..300-token prompts, 8 greedy tokens) on a random
 *    Llama-3-shaped model, batched / alone / alone in chunks of 7 / groups of 4 with mixed
 *    chunks, f32 and bf16 KV: every position's logits bitwise equal and the same tokens; the
 *    default mode's differences printed; the mode's accuracy against the CPU (compare_shape).
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
#include "backend/cpu/matmul.h"
#include "cuda_test_util.h"
#include "test_util.h"

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

/* ---- quantized GGUFs (models/tiny-quant: llama.cpp's quantizations of one random Llama
 * model) on the CUDA backend: the upload dequantizes every matrix on the host (kv_dequant_row,
 * the CPU backend's exact floats) and stores f32 or bf16 on the device ---- */

/* For F16, Q8_0 and Q4_K_M files: every logit row of a chunked prefill + decode of two
 * batched sequences (run_chunks, 300 + 97 positions) on the CUDA backend against the CPU
 * backend on the same file. f32 weights (the upload keeps the dequantized floats): max|d| <=
 * 1e-4 max|ref| per row; bf16 weights: against the CPU on the dequantized weights rounded to
 * bf16, the bf16 limits of compare_shape (mean 1e-2, row 2e-2); the error against the CPU on
 * the file itself is printed. */
/* Steps whose rows all run k_attn_dec_tc do k_qkv_post's work (bias, q/k-norm, RoPE, the K/V
 * store) inside it (KVSERVE_CUDA_QKV_FUSE, default on): the same bits as with the separate
 * launch, on the llama shape (RoPE scaling), qwen2 (bias) and qwen3 with head_dim 64 (q/k-norm),
 * bf16 weights and bf16 KV, two sequences whose last 10 tokens decode together. */
static void test_cuda_qkv_fused(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    model_arch archs[3] = {MODEL_ARCH_LLAMA, MODEL_ARCH_QWEN2, MODEL_ARCH_QWEN3};
    int bad = 0;
    for (int a = 0; a < 3; a++) {
        struct model_config cfg = {.arch = archs[a], .n_vocab = 1024, .dim = 512, .n_layers = 2, .n_heads = 8,
                                   .n_kv_heads = 2, .head_dim = 64, .ffn_dim = 768, .rms_eps = 1e-5f,
                                   .rope_theta = 500000.0f, .rope_neox = a != 0, .max_ctx = 512,
                                   .attn_bias = archs[a] == MODEL_ARCH_QWEN2, .qk_norm = archs[a] == MODEL_ARCH_QWEN3};
        if (a == 0)
            cfg.rope_scaling = (struct rope_scaling){.type = 1, .factor = 8, .low_freq_factor = 1,
                                                     .high_freq_factor = 4, .original_max_pos = 64};
        model_t *m = NULL;
        assert_int_equal(model_alloc(&cfg, &m), KV_OK);
        model_randomize(m, 303 + (uint64_t)a, 0.05f);
        int n0 = 130, n1 = 70, V = cfg.n_vocab;
        int32_t toks[2 * 130];
        kv_rng rng;
        kv_rng_seed(&rng, 31 + (uint64_t)a);
        for (int i = 0; i < 2 * n0; i++) toks[i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
        float *got[2];
        for (int v = 0; v < 2; v++) {
            setenv("KVSERVE_CUDA_QKV_FUSE", v ? "0" : "1", 1);
            backend_t *be = make_be(m, 1, false);
            got[v] = run_chunks(be, m, toks, n0, n1, KV_DTYPE_BF16);
            backend_free(be);
        }
        unsetenv("KVSERVE_CUDA_QKV_FUSE");
        size_t n = (size_t)2 * n0 * V, diff = 0, nz = 0;
        for (size_t i = 0; i < n; i++) diff += memcmp(&got[0][i], &got[1][i], sizeof(float)) != 0, nz += got[0][i] != 0;
        fprintf(stderr, "  %s: fused vs separate q/k post-processing: %zu of %zu logits differ\n",
                model_arch_name(archs[a]), diff, n);
        assert_true(nz > 0);
        bad += diff != 0;
        free(got[0]), free(got[1]);
        model_free(m);
    }
    assert_int_equal(bad, 0);
}

static void test_cuda_quant_gguf(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    const char *types[] = {"F16", "Q8_0", "Q4_K_M"};
    char path[4096], rel[256], err[256];
    /* the CPU reference multiplies the exactly dequantized weights (its default for Q8_0 / Q4_K
     * files is the integer path, which quantizes the activations: cpu/matmul.h) */
    kv_matmul_set_quant(KV_MATMUL_QUANT_F32);
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", types[0]);
    if (!test_data_path(path, sizeof path, rel)) { skip(); return; }
    int bad = 0;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", types[t]);
        assert_non_null(test_data_path(path, sizeof path, rel));
        model_t *m = NULL;
        if (model_load(path, &m, err, sizeof err)) fail_msg("%s: %s", path, err);
        assert_int_not_equal(m->w.layers[0].w_up.type, KV_QTYPE_F32); /* stored type kept at load */
        int n0 = 300, n1 = 97, maxn = 300, V = m->cfg.n_vocab;
        int32_t *toks = malloc((size_t)2 * maxn * sizeof *toks);
        kv_rng rng;
        kv_rng_seed(&rng, 300 + t);
        for (int i = 0; i < 2 * maxn; i++) toks[i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
        backend_t *be = make_be(m, 0, false);
        float *cpu = run_chunks(be, m, toks, n0, n1, KV_DTYPE_F32);
        backend_free(be);
        model_t *mr = test_model_clone_f32(m);
        if (!mr) fail_msg("out of memory");
        model_round_bf16(mr);
        be = make_be(mr, 0, false);
        float *cpu_r = run_chunks(be, mr, toks, n0, n1, KV_DTYPE_F32);
        backend_free(be);
        model_free(mr);
        be = make_be(m, 1, true);
        float *g32 = run_chunks(be, m, toks, n0, n1, KV_DTYPE_F32);
        backend_free(be);
        be = make_be(m, 1, false);
        float *g16 = run_chunks(be, m, toks, n0, n1, KV_DTYPE_F32);
        backend_free(be);
        char what[128];
        for (int s = 0; s < 2; s++) {
            size_t o = (size_t)s * maxn * V;
            int n = s ? n1 : n0;
            snprintf(what, sizeof what, "%s seq %d, cuda f32 weights vs cpu", types[t], s);
            bad += score_rows(what, g32 + o, cpu + o, n, V, true, 1e-4);
            snprintf(what, sizeof what, "%s seq %d, cuda bf16 weights vs cpu on bf16-rounded weights", types[t], s);
            bad += score_rows(what, g16 + o, cpu_r + o, n, V, false, 1e-2);
            snprintf(what, sizeof what, "%s seq %d, cuda bf16 weights vs cpu (reported)", types[t], s);
            score_rows(what, g16 + o, cpu + o, n, V, false, 1e9);
        }
        free(cpu), free(cpu_r), free(g32), free(g16), free(toks);
        model_free(m);
    }
    kv_matmul_set_quant(KV_MATMUL_QUANT_AUTO);
    assert_int_equal(bad, 0);
}

/* ---- host syncs and host->device writes in the decode loop (issue 10) ---- */

#define NCNT (sizeof(struct kv_cuda_counters) / sizeof(uint64_t))
static struct kv_cuda_counters cnt_delta(const struct kv_cuda_counters *a, const struct kv_cuda_counters *b) {
    struct kv_cuda_counters d;
    const uint64_t *x = (const uint64_t *)a, *y = (const uint64_t *)b;
    uint64_t *o = (uint64_t *)&d;
    for (size_t i = 0; i < NCNT; i++) o[i] = y[i] - x[i];
    return d;
}
static const char *const g_cnt_names[NCNT] = {"stream_syncs", "sync_copies", "h2d_copies", "d2h_copies",
                                               "other_copies", "captured_copies", "memsets", "allocs", "frees",
                                               "launches", "captured_launches", "graph_instantiations",
                                               "graph_launches"};
/* Fails unless every counter of got equals want's; with any_alloc, allocs and frees are not
 * compared (steps that grow scratch buffers). */
static void cnt_expect(const char *what, int step, const struct kv_cuda_counters *got,
                       const struct kv_cuda_counters *want, bool any_alloc) {
    const uint64_t *g = (const uint64_t *)got, *w = (const uint64_t *)want;
    int bad = 0;
    for (size_t i = 0; i < NCNT; i++) {
        if (any_alloc && (i == offsetof(struct kv_cuda_counters, allocs) / 8 ||
                          i == offsetof(struct kv_cuda_counters, frees) / 8))
            continue;
        if (g[i] != w[i]) {
            fprintf(stderr, "  %s step %d: %s = %llu, expected %llu\n", what, step, g_cnt_names[i],
                    (unsigned long long)g[i], (unsigned long long)w[i]);
            bad++;
        }
    }
    if (bad) fail_msg("%s step %d: %d CUDA call counts differ from the documented ones (backend_cuda.h)", what, step,
                      bad);
}

struct sync_run {
    int steps;      /* forwards made */
    float *logits;  /* (steps, 4 rows, V) */
};

/* A prefill of 4 sequences x 40 tokens (160 rows: above the graph limit, so eager), decode
 * steps of all 4 (positions 40 .. 40 + n4 - 1), then of sequence 0 alone (n1 steps): every
 * forward's counter deltas checked against backend_cuda.h's documented counts. graphs:
 * whether the backend was created with graphs on. Logits of every step into R. */
static void sync_decode(backend_t *be, const model_t *m, bool graphs, int n4, int n1, struct sync_run *R) {
    int V = m->cfg.n_vocab, nl = m->cfg.n_layers, tpb = 16, per = 6, nb = 4 * per;
    struct kv_geometry g = {.n_layers = nl, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim,
                            .tokens_per_block = tpb, .kv_dtype = KV_DTYPE_F32};
    assert_int_equal(be->ops->kv_alloc(be, nb, &g), KV_OK);
    int32_t bt[4][6], prompt[4][40], tok[4];
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < per; i++) bt[s][i] = nb - 1 - (i * 4 + s);
    kv_rng rng;
    kv_rng_seed(&rng, 4242);
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < 40; i++) prompt[s][i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
    R->steps = 0;
    R->logits = malloc((size_t)(1 + n4 + n1) * 4 * V * sizeof(float));
    assert_non_null(R->logits);
    char err[512];
    uint64_t per_step = 10 * (uint64_t)nl + 3;
    const char *what = graphs ? "graphs" : "no graphs";
    for (int step = 0; step < 1 + n4 + n1; step++) {
        int ns = step <= n4 ? 4 : 1, np = step == 0 ? 0 : 40 + step - 1;
        struct batch_seq seqs[4];
        for (int s = 0; s < ns; s++) {
            tok[s] = (int32_t)((step * 7 + s * 13) % V);
            seqs[s] = (struct batch_seq){.tokens = step ? &tok[s] : prompt[s], .n_tokens = step ? 1 : 40,
                                         .n_past = np, .block_table = bt[s], .n_blocks = per,
                                         .logits = BATCH_LOGITS_LAST};
        }
        struct batch b = {seqs, ns};
        struct kv_cuda_counters c0, c1;
        kv_cuda_counters_get(&c0);
        float *lg = R->logits + (size_t)step * 4 * V;
        if (be->ops->forward(be, &b, lg, err, sizeof err)) fail_msg("forward (step %d): %s", step, err);
        kv_cuda_counters_get(&c1);
        R->steps++;
        struct kv_cuda_counters d = cnt_delta(&c0, &c1), want = {0};
        want.stream_syncs = 1, want.d2h_copies = 1; /* the logits rows, then the one sync */
        /* graphs: the first step of each batch shape (step 1: 4 rows, step 1 + n4: 1 row) captures */
        bool eager = !graphs || step == 0, capture = graphs && (step == 1 || step == 1 + n4);
        /* step 0 (160 prefill rows, bf16 weights, head_dim 64) runs k_attn_flash: one
         * attention launch per layer instead of attention + combine */
        if (eager) want.h2d_copies = 1, want.launches = step == 0 ? per_step - (uint64_t)nl : per_step;
        else {
            want.graph_launches = 1;
            if (capture) want.graph_instantiations = 1, want.captured_copies = 1, want.captured_launches = per_step;
        }
        cnt_expect(what, step, &d, &want, eager || capture);
    }
    /* the counters see a sync outside forward: copy_blocks synchronises once */
    struct kv_cuda_counters c0, c1;
    kv_cuda_counters_get(&c0);
    int32_t src[1] = {bt[0][0]}, dst[1] = {bt[3][5]};
    assert_int_equal(be->ops->copy_blocks(be, src, dst, 1), KV_OK);
    kv_cuda_counters_get(&c1);
    struct kv_cuda_counters d = cnt_delta(&c0, &c1);
    assert_int_equal(d.stream_syncs, 1);
    assert_int_equal(d.launches, 1);
}

/* Issue 10: the decode loop makes no host syncs beyond the one per step that returns the
 * logits rows, and writes nothing into device memory from the host (no host->device copy
 * call, no memset) once its graph exists: every forward of sync_decode has exactly the
 * counts backend_cuda.h documents, with graphs captured in cudaStreamCaptureModeGlobal
 * (KVSERVE_CUDA_CAPTURE=global: an unsafe call during a capture fails it, and the forward).
 * The same loop with graphs off must show the eager counts (1 metadata upload and
 * 10 n_layers + 3 launches per step), and the graph steps' logits must equal the eager ones
 * (max|d| <= 1e-4 max|ref|): the replays compute, they are not stale. */
static void test_cuda_decode_syncs(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    struct model_config cfg = {.n_vocab = 1024, .dim = 256, .n_layers = 3, .n_heads = 4, .n_kv_heads = 2,
                               .head_dim = 64, .ffn_dim = 512, .rms_eps = 1e-5f, .rope_theta = 10000.f,
                               .max_ctx = 256, .rope_neox = true};
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, 11, 0.05f);
    /* positions stay <= 64 so one attention grid (one graph per batch shape) serves every step */
    int n4 = 17, n1 = 6;
    setenv("KVSERVE_CUDA_CAPTURE", "global", 1);
    backend_t *be = make_be(m, 1, false);
    struct sync_run rg, re;
    sync_decode(be, m, true, n4, n1, &rg);
    backend_free(be);
    unsetenv("KVSERVE_CUDA_CAPTURE");
    setenv("KVSERVE_CUDA_GRAPHS", "0", 1);
    be = make_be(m, 1, false);
    sync_decode(be, m, false, n4, n1, &re);
    backend_free(be);
    unsetenv("KVSERVE_CUDA_GRAPHS");
    int V = cfg.n_vocab, bad = 0;
    for (int step = 0; step < rg.steps; step++)
        for (int s = 0; s < (step <= n4 ? 4 : 1); s++) {
            const float *a = rg.logits + ((size_t)step * 4 + s) * V, *r = re.logits + ((size_t)step * 4 + s) * V;
            double md = 0, mr = 0;
            for (int i = 0; i < V; i++) {
                double d = fabs((double)a[i] - r[i]);
                if (!(d <= md)) md = d;
                if (fabs(r[i]) > mr) mr = fabs(r[i]);
            }
            if (!(md <= 1e-4 * mr) && bad++ < 3)
                fprintf(stderr, "  step %d seq %d: graph logits differ from eager: max|d| %g, max|ref| %g\n", step,
                        s, md, mr);
        }
    fprintf(stderr, "  decode loop: %d forwards with graphs (global capture mode) and without, CUDA call counts as "
                    "documented; graph vs eager logits: %d rows differ\n", rg.steps, bad);
    free(rg.logits), free(re.logits);
    model_free(m);
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
    /* H2D (the kernel or the copy engines: kv_cuda_copy_engine_min), checked through cudaMemcpy */
    if (kv_cuda_copy_pages(KV_CUDA_H2D, d1, (const void *const *)hs, n, bytes, err, sizeof err)) fail_msg("%s", err);
    for (int i = 0; i < n; i++) {
        assert_int_equal(kv_cuda_memcpy(chk, d1[i], bytes), KV_OK);
        if (checksum(chk, bytes) != ck[i] || memcmp(chk, hs[i], bytes))
            fail_msg("H2D %zu bytes x %d: page %d differs", bytes, n, i);
    }
    /* the same H2D enqueued on the default stream (kv_cuda_copy_pages_on), checked again */
    for (int i = 0; i < n; i++) assert_int_equal(kv_cuda_memcpy(d1[i], hd[i], bytes), KV_OK); /* 0xA5 pages */
    if (kv_cuda_copy_pages_on(KV_CUDA_H2D, d1, (const void *const *)hs, n, bytes, NULL, err, sizeof err))
        fail_msg("%s", err);
    for (int i = 0; i < n; i++) {
        assert_int_equal(kv_cuda_memcpy(chk, d1[i], bytes), KV_OK); /* synchronous: after the stream's work */
        if (memcmp(chk, hs[i], bytes)) fail_msg("H2D on a stream %zu bytes x %d: page %d differs", bytes, n, i);
    }
    /* D2D (always the kernel), then D2H */
    if (kv_cuda_copy_pages(KV_CUDA_D2D, d2, (const void *const *)d1, n, bytes, err, sizeof err)) fail_msg("%s", err);
    if (kv_cuda_copy_pages(KV_CUDA_D2H, hd, (const void *const *)d2, n, bytes, err, sizeof err)) fail_msg("%s", err);
    for (int i = 0; i < n; i++)
        if (checksum(hd[i], bytes) != ck[i] || memcmp(hd[i], hs[i], bytes))
            fail_msg("D2D+D2H %zu bytes x %d: page %d differs", bytes, n, i);
    for (int i = 0; i < n; i++) {
        kv_cuda_host_free(hs[i]), kv_cuda_host_free(hd[i]);
        kv_cuda_free(d1[i]), kv_cuda_free(d2[i]);
    }
    size_t ce = kv_cuda_copy_engine_min();
    fprintf(stderr, "  page copy %10zu bytes x %3d pages (host: %s, splits %2d): ok\n", bytes, n,
            ce && bytes >= ce ? "copy engine" : "kernel", kv_cuda_copy_splits(KV_CUDA_H2D, bytes));
    free(hs), free(hd), free(d1), free(d2), free(ck), free(chk);
}

static void test_cuda_page_copy(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    char err[256];
    /* zero bytes / zero pages: success without a launch (NULL tables are never read) */
    assert_int_equal(kv_cuda_copy_pages(KV_CUDA_H2D, NULL, NULL, 5, 0, err, sizeof err), KV_OK);
    assert_int_equal(kv_cuda_copy_pages(KV_CUDA_D2H, NULL, NULL, 0, 4096, err, sizeof err), KV_OK);
    assert_int_equal(kv_cuda_copy_pages_on((enum kv_cuda_copy_dir)7, NULL, NULL, 0, 4096, NULL, err, sizeof err), KV_OK);
    assert_int_equal(kv_cuda_copy_pages_on((enum kv_cuda_copy_dir)7, NULL, NULL, 2, 4096, NULL, err, sizeof err),
                     KV_EINVAL);
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
    /* the default (host pages >= 8 MiB on the copy engines), then the kernel for every size */
    assert_int_equal(kv_cuda_copy_engine_min(), (size_t)8 << 20);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) page_case(cases[i].bytes, cases[i].n);
    setenv("KVSERVE_CUDA_COPY_CE_MIN", "0", 1);
    assert_int_equal(kv_cuda_copy_engine_min(), 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (cases[i].bytes >= (8u << 20)) page_case(cases[i].bytes, cases[i].n);
    setenv("KVSERVE_CUDA_COPY_CE_MIN", "12x", 1);
    assert_int_equal(kv_cuda_copy_engine_min(), 0); /* malformed: never */
    setenv("KVSERVE_CUDA_COPY_CE_MIN", "65536", 1);
    assert_int_equal(kv_cuda_copy_engine_min(), 65536);
    page_case(64 << 10, 3); /* on the copy engines now */
    unsetenv("KVSERVE_CUDA_COPY_CE_MIN");
}


/* ---- batch-invariant mode (issue 10, --deterministic) ---- */

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Kernel level: X (R x K) and W (N x K) random bf16; row r of X[off .. off+M) W^T must be
 * bitwise the same for M = 1..64 and several offsets, and for M = 100, 200, R (the other
 * tile shapes), as in the product of all R rows. Returns the rows that differ; *maxrel gets
 * the largest relative difference to the default mode's product (a sanity check of the
 * arithmetic, both accumulate the same bf16 products in f32). */
static long gemm_invariance(int mode, int K, int N, double *maxrel) {
    const int R = 320;
    uint16_t *hx = malloc((size_t)R * K * 2), *hw = malloc((size_t)N * K * 2);
    kv_rng rng;
    kv_rng_seed(&rng, (uint64_t)K * 31 + (uint64_t)N);
    for (size_t i = 0; i < (size_t)R * K; i++) hx[i] = f2bf((float)((double)(kv_rng_next(&rng) % 20001) / 10000.0 - 1.0));
    for (size_t i = 0; i < (size_t)N * K; i++)
        hw[i] = f2bf((float)((double)(kv_rng_next(&rng) % 20001) / 10000.0 - 1.0) * 0.05f);
    void *dx = kv_cuda_malloc((size_t)R * K * 2), *dw = kv_cuda_malloc((size_t)N * K * 2);
    float *dy = kv_cuda_malloc((size_t)R * N * 4);
    assert_non_null(dx), assert_non_null(dw), assert_non_null(dy);
    assert_int_equal(kv_cuda_memcpy(dx, hx, (size_t)R * K * 2), KV_OK);
    assert_int_equal(kv_cuda_memcpy(dw, hw, (size_t)N * K * 2), KV_OK);
    float *ref = malloc((size_t)R * N * 4), *got = malloc((size_t)R * N * 4), *other = malloc((size_t)R * N * 4);
    char err[256];
    if (kv_cuda_gemm(mode, 0, dx, R, K, dw, N, dy, err, sizeof err)) fail_msg("kv_cuda_gemm: %s", err);
    assert_int_equal(kv_cuda_memcpy(ref, dy, (size_t)R * N * 4), KV_OK);
    if (kv_cuda_gemm(!mode, 0, dx, R, K, dw, N, dy, err, sizeof err)) fail_msg("kv_cuda_gemm: %s", err);
    assert_int_equal(kv_cuda_memcpy(other, dy, (size_t)R * N * 4), KV_OK);
    double mr = 0;
    for (size_t i = 0; i < (size_t)R * N; i++) {
        double d = fabs((double)ref[i] - other[i]) / (fabs((double)other[i]) + 1e-2);
        if (!(d <= mr)) mr = d;
    }
    *maxrel = mr;
    long bad = 0;
    int Ms[64 + 3];
    int nm = 0;
    for (int M = 1; M <= 64; M++) Ms[nm++] = M;
    Ms[nm++] = 100, Ms[nm++] = 200, Ms[nm++] = R;
    for (int mi = 0; mi < nm; mi++)
        for (int t = 0; t < 3; t++) {
            int M = Ms[mi];
            int off = M == R ? 0 : (int)((M * 37u + (unsigned)t * 101u) % (unsigned)(R - M + 1));
            if (kv_cuda_gemm(mode, 0, (const uint16_t *)dx + (size_t)off * K, M, K, dw, N, dy, err, sizeof err))
                fail_msg("kv_cuda_gemm: %s", err);
            assert_int_equal(kv_cuda_memcpy(got, dy, (size_t)M * N * 4), KV_OK);
            for (int r = 0; r < M; r++)
                if (memcmp(got + (size_t)r * N, ref + (size_t)(off + r) * N, (size_t)N * 4)) bad++;
        }
    kv_cuda_free(dx), kv_cuda_free(dw), kv_cuda_free(dy);
    free(hx), free(hw), free(ref), free(got), free(other);
    return bad;
}

static void test_cuda_gemm_invariant(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    const int shapes[][2] = {{4096, 512}, {520, 200}, {1408, 1000}}; /* K, N: tails in K and N */
    long bad_inv = 0, bad_def = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        double rel_i, rel_d;
        long bi = gemm_invariance(1, shapes[i][0], shapes[i][1], &rel_i);
        long bd = gemm_invariance(0, shapes[i][0], shapes[i][1], &rel_d);
        fprintf(stderr, "  gemm K %d N %d: rows differing from the all-rows product (of 3 x (64 + 3) products): "
                        "invariant %ld, default (gemv / cuBLAS) %ld; max rel. difference invariant vs default %.2g\n",
                shapes[i][0], shapes[i][1], bi, bd, rel_i);
        assert_true(rel_i < 1e-3); /* same bf16 products, f32 sums: only the order differs */
        bad_inv += bi, bad_def += bd;
    }
    fprintf(stderr, "  default mode %s the kernel-level invariance check (%ld rows differ)\n",
            bad_def ? "FAILS" : "happened to pass", bad_def);
    assert_int_equal(bad_inv, 0);
}

#define DS 16   /* sequences */
#define DGEN 8  /* greedy tokens generated per sequence */
#define DMAXP 300
/* Runs DS sequences (prompt lengths len[i], then DGEN greedy tokens) with schedule sched:
 * 0 all together (whole prompts in one step, then batched decode), 1 each alone (whole
 * prompt), 2 each alone in chunks of 7, 3 groups of 4 with chunks of 5, 16 or 27 tokens
 * (i % 3) and decode in those groups. Every position's logits go to store[i][pos]; the
 * generated tokens to toks[i][len[i] ..]. */
static void det_schedule(backend_t *be, const model_t *m, int sched, int kv_dtype, const int *len,
                         int32_t toks[DS][DMAXP + DGEN], float *store) {
    int V = m->cfg.n_vocab, tpb = 16, per = (DMAXP + DGEN + tpb - 1) / tpb;
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads,
                            .head_dim = m->cfg.head_dim, .tokens_per_block = tpb, .kv_dtype = kv_dtype};
    assert_int_equal(be->ops->kv_alloc(be, DS * per, &g), KV_OK);
    static int32_t bt[DS][(DMAXP + DGEN + 15) / 16];
    for (int i = 0; i < DS; i++)
        for (int k = 0; k < per; k++) bt[i][k] = (int32_t)(k * DS + (i * 5 + sched) % DS); /* scattered */
    int done[DS] = {0};
    float *lg = malloc((size_t)DS * (DMAXP + DGEN) * V * sizeof(float));
    char err[512];
    for (;;) {
        struct batch_seq seqs[DS];
        int which[DS], ns = 0, first = -1;
        for (int i = 0; i < DS && first < 0; i++)
            if (done[i] < len[i] + DGEN - 1) first = i;
        if (first < 0) break;
        for (int i = 0; i < DS; i++) {
            if (done[i] >= len[i] + DGEN - 1) continue;
            if ((sched == 1 || sched == 2) && i != first) continue;
            if (sched == 3 && i / 4 != first / 4) continue;
            int avail = done[i] < len[i] ? len[i] : done[i] + 1;
            int chunk = sched == 2 ? 7 : sched == 3 ? (i % 3 == 0 ? 5 : i % 3 == 1 ? 16 : 27) : 1 << 30;
            int n = avail - done[i] < chunk ? avail - done[i] : chunk;
            seqs[ns] = (struct batch_seq){.tokens = toks[i] + done[i], .n_tokens = n, .n_past = done[i],
                                          .block_table = bt[i], .n_blocks = per, .logits = BATCH_LOGITS_ALL};
            which[ns++] = i;
        }
        struct batch b = {seqs, ns};
        if (be->ops->forward(be, &b, lg, err, sizeof err)) fail_msg("forward (schedule %d): %s", sched, err);
        size_t row = 0;
        for (int j = 0; j < ns; j++) {
            int i = which[j], n = seqs[j].n_tokens;
            memcpy(store + ((size_t)i * (DMAXP + DGEN) + done[i]) * V, lg + row * V, (size_t)n * V * sizeof(float));
            row += (size_t)n;
            done[i] += n;
            if (done[i] >= len[i]) /* greedy next token from the last row */
                toks[i][done[i]] = argmax(store + ((size_t)i * (DMAXP + DGEN) + done[i] - 1) * V, V);
        }
    }
    free(lg);
}

/* Rows (sequence, position) whose logits differ bitwise between two schedules, and
 * generated tokens that differ. */
static long det_compare(const float *a, const float *b, int32_t ta[DS][DMAXP + DGEN], int32_t tb[DS][DMAXP + DGEN],
                        const int *len, int V, long *tok_diff) {
    long bad = 0;
    *tok_diff = 0;
    for (int i = 0; i < DS; i++) {
        for (int p = 0; p < len[i] + DGEN - 1; p++)
            if (memcmp(a + ((size_t)i * (DMAXP + DGEN) + p) * V, b + ((size_t)i * (DMAXP + DGEN) + p) * V,
                       (size_t)V * sizeof(float)))
                bad++;
        for (int p = len[i]; p < len[i] + DGEN; p++) *tok_diff += ta[i][p] != tb[i][p];
    }
    return bad;
}

/* Backend level: 16 sequences (prompts of 1 .. 300 tokens: 1 to 3 attention parts) on a
 * random Llama-3-shaped model, bf16 weights, f32 and bf16 KV: batched, alone, chunked and in
 * groups give bitwise the same logits at every position and the same greedy tokens in the
 * deterministic mode (graphs on: steps of <= 64 rows replay graphs). The default mode is run
 * the same way and its differences printed. The deterministic mode's logits are also checked
 * against the CPU (compare_shape's bf16 and f32 limits). */
static void test_cuda_deterministic(void **st) {
    (void)st;
    if (!gpu_ok()) { skip(); return; }
    struct model_config cfg = {0};
    cfg.arch = MODEL_ARCH_LLAMA;
    cfg.n_vocab = 2048, cfg.dim = 512, cfg.n_layers = 4, cfg.n_heads = 8, cfg.n_kv_heads = 2, cfg.head_dim = 64;
    cfg.ffn_dim = 1408, cfg.rms_eps = 1e-5f, cfg.rope_theta = 500000.0f, cfg.rope_neox = true;
    cfg.rope_scaling = (struct rope_scaling){.type = 1, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                                             .original_max_pos = 64};
    cfg.max_ctx = 4096, cfg.bos_id = 1, cfg.eos_id = 2;
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, 4242, 0.05f);
    int V = cfg.n_vocab, len[DS];
    static int32_t toks[5][DS][DMAXP + DGEN];
    kv_rng rng;
    kv_rng_seed(&rng, 99);
    for (int i = 0; i < DS; i++) {
        len[i] = i == 0 ? 1 : i == 1 ? DMAXP : 1 + (int)(kv_rng_next(&rng) % DMAXP);
        for (int p = 0; p < len[i]; p++) toks[0][i][p] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
    }
    size_t sz = (size_t)DS * (DMAXP + DGEN) * V * sizeof(float);
    float *lg[4];
    for (int k = 0; k < 4; k++) lg[k] = malloc(sz);
    long total_bad = 0;
    for (int det = 1; det >= 0; det--)
        for (int kvd = 0; kvd < 2; kvd++) {
            if (!det && kvd) continue; /* default mode: f32 KV is enough to show it */
            struct backend_options o = {.kind = BACKEND_KIND_CUDA, .deterministic = det};
            backend_t *be = NULL;
            char err[512];
            if (backend_create(m, &o, &be, err, sizeof err)) fail_msg("backend_create: %s", err);
            for (int sched = 0; sched < 4; sched++) {
                memcpy(toks[sched + 1], toks[0], sizeof toks[0]);
                memset(lg[sched], 0xff, sz);
                det_schedule(be, m, sched, kvd ? KV_DTYPE_BF16 : KV_DTYPE_F32, len, toks[sched + 1], lg[sched]);
            }
            for (int sched = 1; sched < 4; sched++) {
                long td, bad = det_compare(lg[0], lg[sched], toks[1], toks[sched + 1], len, V, &td);
                fprintf(stderr, "  %s mode, %s KV: batched vs %s: %ld logit rows differ, %ld greedy tokens differ\n",
                        det ? "deterministic" : "default", kvd ? "bf16" : "f32",
                        sched == 1 ? "each alone" : sched == 2 ? "alone in chunks of 7" : "groups of 4, mixed chunks",
                        bad, td);
                if (det) total_bad += bad + td;
            }
            backend_free(be);
        }
    for (int k = 0; k < 4; k++) free(lg[k]);
    model_free(m);
    assert_int_equal(total_bad, 0);
    /* accuracy of the deterministic mode against the CPU (bf16 and f32 weights, f32 and bf16 KV) */
    g_det = true;
    int bad = compare_shape(MODEL_ARCH_LLAMA, false, 1e-2, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_LLAMA, true, 1e-4, KV_DTYPE_F32);
    bad += compare_shape(MODEL_ARCH_QWEN3, false, 1e-2, KV_DTYPE_BF16);
    g_det = false;
    assert_int_equal(bad, 0);
}
#else /* !KVSERVE_HAVE_CUDA */
static void test_cuda_stories_greedy(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_llama3_logits(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_qwen_logits(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_errors(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_page_copy(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_quant_gguf(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_decode_syncs(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_gemm_invariant(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_deterministic(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_qkv_fused(void **st) { (void)st; gpu_ok(); skip(); }
#endif

int main(void) {
    /* the backend's tuning variables would change what the tests compare (backend_cuda.h) */
    unsetenv("KVSERVE_CUDA_WEIGHTS"), unsetenv("KVSERVE_CUDA_GRAPHS"), unsetenv("KVSERVE_CUDA_ATTN");
    unsetenv("KVSERVE_CUDA_COPY_CE_MIN");
    unsetenv("KVSERVE_CUDA_GEMV_MAX"), unsetenv("KVSERVE_CUDA_CAPTURE"), unsetenv("KVSERVE_CUDA_FLASH");
    unsetenv("KVSERVE_CUDA_QKV_FUSE"), unsetenv("KVSERVE_CUDA_GEMV_LATE"), unsetenv("KVSERVE_CUDA_DEC_CTAS");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_registry),
        cmocka_unit_test(test_cuda_errors),
        cmocka_unit_test(test_cuda_page_copy),
        cmocka_unit_test(test_cuda_decode_syncs),
        cmocka_unit_test(test_cuda_gemm_invariant),
        cmocka_unit_test(test_cuda_deterministic),
        cmocka_unit_test(test_cuda_quant_gguf),
        cmocka_unit_test(test_cuda_stories_greedy),
        cmocka_unit_test(test_cuda_llama3_logits),
        cmocka_unit_test(test_cuda_qwen_logits),
        cmocka_unit_test(test_cuda_qkv_fused),
    };
    /* KVSERVE_CUDA_TESTS=PATTERN (cmocka wildcards * and ?): run only the matching tests */
    const char *only = getenv("KVSERVE_CUDA_TESTS");
    if (only && *only) cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
