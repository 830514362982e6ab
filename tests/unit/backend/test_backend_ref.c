/*
 * CPU backend vs the PyTorch reference (tools/torch_ref.py, run with /usr/bin/python3):
 *  - stories260K GGUF and HF copies: |diff| <= 1e-4 on every logit of every position,
 *    prompts of 1..100 tokens (several blocks of 16), computed in chunks.
 *  - stories260K with llama3 RoPE scaling and with linear scaling forced on both sides.
 *  - random-weight Qwen2 (q/k/v bias) and Qwen3 (q/k norm, head_dim != dim/n_heads)
 *    models written with model_save_gguf: max|diff| <= 1e-3 * max|ref| per row.
 * Skips visibly when /usr/bin/python3 + torch or the test data are missing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "test_util.h"

#define PY "/usr/bin/python3"

static int have_torch(void) {
    static int cached = -1;
    if (cached < 0) {
        cached = access(PY, X_OK) == 0 && system(PY " -c 'import torch, numpy' >/dev/null 2>&1") == 0;
        if (!cached) fprintf(stderr, "SKIP: %s with torch+numpy not available\n", PY);
    }
    return cached;
}

static const char *src_dir(void) {
    const char *s = getenv("KVSERVE_SRC");
    return s && *s ? s : ".";
}

/* Runs the reference; returns (n, n_vocab) logits (caller frees). */
static float *ref_logits(const char *model, const int32_t *toks, int n, int n_vocab, const char *rope) {
    char out[] = "/tmp/kvserve_ref_XXXXXX";
    int fd = mkstemp(out);
    assert_true(fd >= 0);
    close(fd);
    size_t cap = (size_t)n * 12 + 8192;
    char *cmd = malloc(cap);
    int k = snprintf(cmd, cap, PY " %s/tools/torch_ref.py --model '%s' --out %s %s%s --tokens ", src_dir(), model,
                     out, rope ? "--rope-scaling " : "", rope ? rope : "");
    for (int i = 0; i < n; i++) k += snprintf(cmd + k, cap - (size_t)k, "%s%d", i ? "," : "", (int)toks[i]);
    snprintf(cmd + k, cap - (size_t)k, " >/dev/null");
    int rc = system(cmd);
    free(cmd);
    if (rc != 0) fail_msg("reference failed (rc %d) for %s", rc, model);
    float *buf = malloc((size_t)n * n_vocab * sizeof(float));
    FILE *f = fopen(out, "rb");
    assert_non_null(f);
    assert_int_equal(fread(buf, sizeof(float), (size_t)n * n_vocab, f), (size_t)n * n_vocab);
    fclose(f);
    unlink(out);
    return buf;
}

/* Backend logits of all n positions, computed in chunks (3, 13, then 32 at a time) with
 * a shuffled block table of 16-token blocks. */
static float *backend_logits(const model_t *m, const int32_t *toks, int n) {
    backend_t *be = NULL;
    char err[256];
    assert_int_equal(backend_cpu_new(m, 2, &be, err, sizeof err), KV_OK);
    int tpb = 16, nb = (n + tpb - 1) / tpb;
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim, .tokens_per_block = tpb};
    assert_int_equal(be->ops->kv_alloc(be, nb + 3, &g), KV_OK);
    int32_t *bt = malloc((size_t)nb * sizeof *bt);
    for (int i = 0; i < nb; i++) bt[i] = (int32_t)((i * 5 + 2) % (nb + 3)); /* distinct when gcd(5, nb+3) = 1 */
    if ((nb + 3) % 5 == 0)
        for (int i = 0; i < nb; i++) bt[i] = nb + 2 - i;
    float *lg = malloc((size_t)n * m->cfg.n_vocab * sizeof(float));
    int done = 0, step = 0;
    while (done < n) {
        int c = step == 0 ? 3 : step == 1 ? 13 : 32;
        if (c > n - done) c = n - done;
        struct batch_seq s = {.tokens = toks + done, .n_tokens = c, .n_past = done, .block_table = bt,
                              .n_blocks = nb, .logits = BATCH_LOGITS_ALL};
        struct batch b = {&s, 1};
        kv_status st = be->ops->forward(be, &b, lg + (size_t)done * m->cfg.n_vocab, err, sizeof err);
        if (st) fail_msg("forward: %s", err);
        done += c;
        step++;
    }
    free(bt);
    backend_free(be);
    return lg;
}

/* abs_tol > 0: absolute; else rel_tol: per row max|d| <= rel_tol * max|ref|. */
static void compare(const model_t *m, const char *ref_model, int n, uint64_t seed, double abs_tol, double rel_tol,
                    const char *rope) {
    int V = m->cfg.n_vocab;
    int32_t *toks = malloc((size_t)n * sizeof *toks);
    kv_rng rng;
    kv_rng_seed(&rng, seed);
    for (int i = 0; i < n; i++) toks[i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)V);
    toks[0] = m->cfg.bos_id >= 0 && m->cfg.bos_id < V ? m->cfg.bos_id : 0;
    float *ref = ref_logits(ref_model, toks, n, V, rope);
    float *got = backend_logits(m, toks, n);
    double worst = 0;
    for (int p = 0; p < n; p++) {
        double md = 0, mr = 0;
        for (int i = 0; i < V; i++) {
            double d = fabs((double)got[(size_t)p * V + i] - ref[(size_t)p * V + i]);
            if (!(d <= md)) md = d; /* NaN propagates */
            if (fabs(ref[(size_t)p * V + i]) > mr) mr = fabs(ref[(size_t)p * V + i]);
        }
        double lim = abs_tol > 0 ? abs_tol : rel_tol * mr;
        if (!(md <= lim)) fail_msg("%s n=%d pos %d: max diff %g > %g", ref_model, n, p, md, lim);
        if (md > worst) worst = md;
    }
    fprintf(stderr, "  %s: %d tokens%s%s, max |diff| %.3g\n", ref_model, n, rope ? " rope " : "", rope ? rope : "", worst);
    free(toks), free(ref), free(got);
}

static void stories(const char *rel) {
    char path[4096];
    if (!have_torch() || !test_data_path(path, sizeof path, rel)) { skip(); return; }
    model_t *m = NULL;
    char err[256];
    if (model_load(path, &m, err, sizeof err)) fail_msg("model_load: %s", err);
    int lens[] = {1, 5, 40, 100};
    for (int i = 0; i < 4; i++) compare(m, path, lens[i], 100 + (uint64_t)i, 1e-4, 0, NULL);
    model_free(m);
}
static void test_ref_stories_gguf(void **st) { (void)st; stories("models/stories260K/stories260K.gguf"); }
static void test_ref_stories_hf(void **st) { (void)st; stories("models/stories260K/hf"); }

static void test_ref_rope_scaling(void **st) {
    (void)st;
    char path[4096];
    if (!have_torch() || !test_data_path(path, sizeof path, "models/stories260K/stories260K.gguf")) { skip(); return; }
    model_t *m = NULL;
    char err[256];
    if (model_load(path, &m, err, sizeof err)) fail_msg("model_load: %s", err);
    /* orig 64 with head_dim 8: one low, one medium (smoothed), two high-wavelength pairs */
    m->cfg.rope_scaling = (struct rope_scaling){.type = 1, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                                                .original_max_pos = 64};
    compare(m, path, 90, 7, 1e-4, 0, "llama3,8,1,4,64");
    m->cfg.rope_scaling = (struct rope_scaling){.type = 2, .factor = 4};
    compare(m, path, 60, 8, 1e-4, 0, "linear,4");
    model_free(m);
}

static void random_arch(model_arch arch) {
    if (!have_torch()) { skip(); return; }
    struct model_config cfg = {0};
    cfg.arch = arch;
    cfg.n_vocab = 300;
    cfg.dim = 64;
    cfg.n_layers = 3;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 2;
    cfg.head_dim = arch == MODEL_ARCH_QWEN3 ? 24 : 16; /* qwen3: != dim / n_heads */
    cfg.ffn_dim = 112;
    cfg.rms_eps = 1e-6f;
    cfg.rope_theta = 1000000.0f;
    cfg.rope_neox = true;
    cfg.max_ctx = 512;
    cfg.attn_bias = arch == MODEL_ARCH_QWEN2;
    cfg.qk_norm = arch == MODEL_ARCH_QWEN3;
    cfg.tied_embeddings = arch == MODEL_ARCH_QWEN3;
    cfg.bos_id = -1;
    cfg.eos_id = 2;
    model_t *m = NULL, *m2 = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, arch == MODEL_ARCH_QWEN2 ? 42 : 43, 0.1f);
    char path[] = "/tmp/kvserve_rand_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    char err[256];
    if (model_save_gguf(m, path, NULL, NULL, err, sizeof err)) fail_msg("model_save_gguf: %s", err);
    if (model_load(path, &m2, err, sizeof err)) fail_msg("model_load: %s", err);
    assert_int_equal(m2->cfg.arch, arch);
    assert_int_equal(m2->cfg.head_dim, cfg.head_dim);
    compare(m2, path, 1, 1, 0, 1e-3, NULL);
    compare(m2, path, 45, 2, 0, 1e-3, NULL);
    compare(m, path, 20, 3, 0, 1e-3, NULL); /* in-memory model == saved file */
    unlink(path);
    model_free(m);
    model_free(m2);
}
static void test_ref_qwen2_random(void **st) { (void)st; random_arch(MODEL_ARCH_QWEN2); }
static void test_ref_qwen3_random(void **st) { (void)st; random_arch(MODEL_ARCH_QWEN3); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ref_stories_gguf),
        cmocka_unit_test(test_ref_stories_hf),
        cmocka_unit_test(test_ref_rope_scaling),
        cmocka_unit_test(test_ref_qwen2_random),
        cmocka_unit_test(test_ref_qwen3_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
