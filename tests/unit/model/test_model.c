/* model: alloc/randomize/save/load round trips, real GGUF and HF checkpoints, demo model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/model.h"
#include "model/model_internal.h"
#include "test_util.h"

static char g_tmpdir[256];

static int setup_tmp(void **state) {
    (void)state;
    return test_tmpdir_make(g_tmpdir, sizeof g_tmpdir, "kv_test_model");
}
static int teardown_tmp(void **state) {
    (void)state;
    return test_tmpdir_remove(g_tmpdir);
}

static size_t layer_sizes(const struct model_config *c, size_t out[14]) {
    size_t d = (size_t)c->dim, q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim,
           f = (size_t)c->ffn_dim, hd = (size_t)c->head_dim;
    size_t s[14] = {d, q * d, kv * d, kv * d, c->attn_bias ? q : 0, c->attn_bias ? kv : 0, c->attn_bias ? kv : 0,
                    c->qk_norm ? hd : 0, c->qk_norm ? hd : 0, d * q, d, f * d, f * d, d * f};
    memcpy(out, s, sizeof s);
    return 14;
}
static const void *layer_ptr(const struct layer_weights *L, int i) {
    const void *p[14] = {L->attn_norm, L->wq.data, L->wk.data, L->wv.data, L->bq, L->bk, L->bv,
                         L->q_norm, L->k_norm, L->wo.data, L->ffn_norm, L->w_gate.data, L->w_up.data, L->w_down.data};
    return p[i];
}

/* Bitwise equality of every weight. */
static void assert_same_weights(const model_t *a, const model_t *b) {
    const struct model_config *c = &a->cfg;
    size_t vd = (size_t)c->n_vocab * c->dim;
    assert_memory_equal(a->w.tok_embd.data, b->w.tok_embd.data, vd * 4);
    assert_memory_equal(a->w.out_norm, b->w.out_norm, (size_t)c->dim * 4);
    assert_memory_equal(a->w.output.data, b->w.output.data, vd * 4);
    size_t sz[14];
    for (int l = 0; l < c->n_layers; l++) {
        layer_sizes(c, sz);
        for (int i = 0; i < 14; i++) {
            if (!sz[i]) {
                assert_null(layer_ptr(&b->w.layers[l], i));
                continue;
            }
            assert_memory_equal(layer_ptr(&a->w.layers[l], i), layer_ptr(&b->w.layers[l], i), sz[i] * 4);
        }
    }
}

static struct model_config small_cfg(model_arch arch) {
    struct model_config c = {0};
    c.arch = arch;
    c.n_vocab = 37;
    c.dim = 16;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = arch == MODEL_ARCH_QWEN3 ? 8 : 4;
    c.ffn_dim = 24;
    c.rms_eps = 1e-6f;
    c.rope_theta = 500000.0f;
    c.rope_neox = arch != MODEL_ARCH_LLAMA;
    c.max_ctx = 256;
    c.attn_bias = arch == MODEL_ARCH_QWEN2;
    c.qk_norm = arch == MODEL_ARCH_QWEN3;
    c.tied_embeddings = arch == MODEL_ARCH_QWEN3;
    c.bos_id = 1;
    c.eos_id = 2;
    c.eos_ids[0] = 2;
    c.eos_ids[1] = 5;
    c.n_eos_ids = 2;
    if (arch == MODEL_ARCH_LLAMA) {
        c.rope_scaling.type = 1;
        c.rope_scaling.factor = 8;
        c.rope_scaling.low_freq_factor = 1;
        c.rope_scaling.high_freq_factor = 4;
        c.rope_scaling.original_max_pos = 8192;
    }
    snprintf(c.name, sizeof c.name, "tiny");
    return c;
}

static void roundtrip(model_arch arch) {
    struct model_config c = small_cfg(arch);
    model_t *m;
    assert_int_equal(model_alloc(&c, &m), KV_OK);
    model_randomize(m, 42, 0.02f);
    /* randomize is deterministic and fills biases/norms when enabled */
    model_t *m2;
    assert_int_equal(model_alloc(&c, &m2), KV_OK);
    model_randomize(m2, 42, 0.02f);
    assert_same_weights(m, m2);
    model_free(m2);
    if (c.attn_bias) assert_true(m->w.layers[1].bv[0] != 0.0f);
    if (c.qk_norm) assert_true(m->w.layers[1].k_norm[0] > 0.3f);
    char path[512], err[256];
    snprintf(path, sizeof path, "%s/rt-%s.gguf", g_tmpdir, model_arch_name(arch));
    assert_int_equal(model_save_gguf(m, path, NULL, NULL, err, sizeof err), KV_OK);
    model_t *l;
    kv_status rc = model_load(path, &l, err, sizeof err);
    if (rc) fprintf(stderr, "load: %s\n", err);
    assert_int_equal(rc, KV_OK);
    const struct model_config *a = &m->cfg, *b = &l->cfg;
    assert_int_equal(b->arch, a->arch);
    assert_int_equal(b->n_vocab, a->n_vocab);
    assert_int_equal(b->dim, a->dim);
    assert_int_equal(b->n_layers, a->n_layers);
    assert_int_equal(b->n_heads, a->n_heads);
    assert_int_equal(b->n_kv_heads, a->n_kv_heads);
    assert_int_equal(b->head_dim, a->head_dim);
    assert_int_equal(b->ffn_dim, a->ffn_dim);
    assert_true(b->rms_eps == a->rms_eps);
    assert_true(b->rope_theta == a->rope_theta);
    assert_int_equal(b->rope_neox, a->rope_neox);
    assert_int_equal(b->rope_scaling.type, a->rope_scaling.type);
    assert_true(b->rope_scaling.factor == a->rope_scaling.factor);
    assert_int_equal(b->rope_scaling.original_max_pos, a->rope_scaling.original_max_pos);
    assert_int_equal(b->max_ctx, a->max_ctx);
    assert_int_equal(b->attn_bias, a->attn_bias);
    assert_int_equal(b->qk_norm, a->qk_norm);
    assert_int_equal(b->tied_embeddings, a->tied_embeddings);
    assert_int_equal(b->bos_id, 1);
    assert_int_equal(b->eos_id, 2);
    assert_int_equal(b->n_eos_ids, 2);
    assert_int_equal(b->eos_ids[1], 5);
    assert_string_equal(b->name, a->name); /* general.name survives the round trip */
    if (a->tied_embeddings) assert_ptr_equal(l->w.output.data, l->w.tok_embd.data);
    assert_int_equal(l->format, MODEL_FORMAT_GGUF);
    assert_false(l->is_demo);
    assert_same_weights(m, l);
    model_free(l);
    model_free(m);
}

static void test_roundtrip_llama(void **s) { (void)s; roundtrip(MODEL_ARCH_LLAMA); }
static void test_roundtrip_qwen2(void **s) { (void)s; roundtrip(MODEL_ARCH_QWEN2); }
static void test_roundtrip_qwen3(void **s) { (void)s; roundtrip(MODEL_ARCH_QWEN3); }

static void test_arch_name(void **s) {
    (void)s;
    assert_string_equal(model_arch_name(MODEL_ARCH_LLAMA), "llama");
    assert_string_equal(model_arch_name(MODEL_ARCH_QWEN2), "qwen2");
    assert_string_equal(model_arch_name(MODEL_ARCH_QWEN3), "qwen3");
}

static void test_alloc_rejects_bad_config(void **s) {
    (void)s;
    struct model_config c = small_cfg(MODEL_ARCH_LLAMA);
    model_t *m = (model_t *)0x1;
    c.n_kv_heads = 3; /* 4 % 3 != 0 */
    assert_int_equal(model_alloc(&c, &m), KV_EINVAL);
    assert_ptr_equal(m, (model_t *)0x1);
    c = small_cfg(MODEL_ARCH_LLAMA);
    c.dim = 0;
    assert_int_equal(model_alloc(&c, &m), KV_EINVAL);
}

static void check_stories_cfg(const struct model_config *c) {
    assert_int_equal(c->arch, MODEL_ARCH_LLAMA);
    assert_int_equal(c->dim, 64);
    assert_int_equal(c->ffn_dim, 172);
    assert_int_equal(c->n_layers, 5);
    assert_int_equal(c->n_heads, 8);
    assert_int_equal(c->n_kv_heads, 4);
    assert_int_equal(c->head_dim, 8);
    assert_int_equal(c->n_vocab, 512);
    assert_true(c->tied_embeddings);
    assert_int_equal(c->bos_id, 1);
    assert_int_equal(c->eos_id, 2);
    assert_false(c->attn_bias);
    assert_false(c->qk_norm);
}

static void test_load_stories_gguf(void **s) {
    (void)s;
    char buf[1024], err[256];
    const char *p = test_data_path(buf, sizeof buf, "models/stories260K/stories260K.gguf");
    if (!p) skip();
    model_t *m;
    kv_status rc = model_load(p, &m, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, KV_OK);
    check_stories_cfg(&m->cfg);
    assert_false(m->cfg.rope_neox);
    assert_string_equal(m->cfg.name, "stories260K");
    assert_ptr_equal(m->w.output.data, m->w.tok_embd.data);
    assert_false(m->is_demo);
    model_free(m);
}

static void test_load_llama2_tiny(void **s) {
    (void)s;
    char buf[1024], err[256];
    const char *p = test_data_path(buf, sizeof buf, "models/llama-2-tiny-random/llama-2-tiny-random.gguf");
    if (!p) skip();
    model_t *m;
    kv_status rc = model_load(p, &m, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, KV_OK);
    assert_int_equal(m->cfg.arch, MODEL_ARCH_LLAMA);
    assert_int_equal(m->cfg.n_vocab, 32000);
    assert_string_equal(m->cfg.name, "LLaMA v2"); /* its general.name */
    model_free(m);
}

/* The default name of a directory without a name in its config (model_internal.h). */
static void test_dir_name(void **s) {
    (void)s;
    static const struct {
        const char *dir, *want;
    } cases[] = {
        {"/data/models/Qwen3-8B", "Qwen3-8B"},
        {"/data/models/Qwen3-8B/", "Qwen3-8B"},
        {"/data/stories260K/hf", "stories260K"},
        {"stories260K/hf/", "stories260K"},
        {"hf", "hf"},
        {"/data/llama/checkpoint", "llama"},
        {"/c/hub/models--Qwen--Qwen3-0.6B/snapshots/e6de91484c29aa9480d55605af694f39b081c455", "Qwen/Qwen3-0.6B"},
        {"/c/hub/models--gpt2/snapshots/607a30d783dfa663caf39e06633721c8d4cfcd7e/", "gpt2"},
        {"/x/m/0123abc", "m"},
    };
    char out[128];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        model_dir_name(cases[i].dir, out, sizeof out);
        if (strcmp(out, cases[i].want)) fail_msg("%s -> '%s', want '%s'", cases[i].dir, out, cases[i].want);
    }
    assert_true(model_set_name(out, sizeof out, " Qwen3 8B ", 10));
    assert_string_equal(out, "Qwen3 8B");
    assert_false(model_set_name(out, sizeof out, "a\"b", 3));
    assert_false(model_set_name(out, sizeof out, "", 0));
}

/* Quantized GGUF matrices are used in place from the file's map: loading allocates only
 * the f32 vectors (a few KiB), never a widened copy of the weights. */
static void test_load_keeps_stored_precision(void **s) {
    (void)s;
    const char *types[] = {"f32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"};
    char path[1024], rel[128], err[256];
    if (!test_data_path(path, sizeof path, "models/tiny-quant/tiny-f32.gguf")) { skip(); return; }
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", types[i]);
        assert_non_null(test_data_path(path, sizeof path, rel));
        struct mallinfo2 before = mallinfo2();
        model_t *m = NULL;
        if (model_load(path, &m, err, sizeof err)) fail_msg("%s: %s", path, err);
        struct mallinfo2 after = mallinfo2();
        size_t heap = (after.uordblks + after.hblkhd) - (before.uordblks + before.hblkhd);
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        fseek(f, 0, SEEK_END);
        size_t file = (size_t)ftell(f);
        fclose(f);
        size_t wb = model_weight_bytes(m);
        fprintf(stderr, "%-8s file %zu B, weights %zu B, heap at load %zu B, w_up %s\n", types[i], file, wb, heap,
                kv_qtype_name(m->w.layers[0].w_up.type));
        assert_true(wb <= file && wb > file / 2); /* the stored bytes, not a widened copy */
        assert_true(heap < 64 * 1024);            /* vectors and tables only */
        if (i == 0) assert_int_equal(m->w.layers[0].w_up.type, KV_QTYPE_F32);
        else assert_int_not_equal(m->w.layers[0].w_up.type, KV_QTYPE_F32);
        model_free(m);
    }
}

static void test_demo(void **s) {
    (void)s;
    char dir[512], path[1024], err[256];
    snprintf(dir, sizeof dir, "%s/cache", g_tmpdir);
    setenv("KVSERVE_CACHE_DIR", dir, 1);
    assert_int_equal(model_demo_path(path, sizeof path, err, sizeof err), KV_OK);
    char want[1024];
    snprintf(want, sizeof want, "%s/demo-llama-v1.gguf", dir);
    assert_string_equal(path, want);
    model_t *m;
    assert_int_equal(model_load(path, &m, err, sizeof err), KV_OK);
    assert_true(m->is_demo);
    assert_int_equal(m->cfg.dim, 256);
    assert_int_equal(m->cfg.n_layers, 4);
    assert_int_equal(m->cfg.n_heads, 8);
    assert_int_equal(m->cfg.n_kv_heads, 4);
    assert_int_equal(m->cfg.ffn_dim, 688);
    assert_int_equal(m->cfg.max_ctx, 2048);
    assert_int_equal(m->cfg.n_vocab, 259);
    assert_int_equal(m->cfg.bos_id, 1);
    assert_int_equal(m->cfg.eos_id, 2);
    assert_false(m->cfg.rope_neox);
    gguf_t *g;
    assert_int_equal(gguf_open(path, &g, err, sizeof err), KV_OK);
    const char *str;
    size_t len;
    assert_true(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 3 + 0x41, &str, &len));
    assert_int_equal(len, 6);
    assert_memory_equal(str, "<0x41>", 6);
    assert_true(gguf_get_str(g, "tokenizer.ggml.model", &str, &len));
    assert_memory_equal(str, "llama", 5);
    bool b;
    assert_true(gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b));
    assert_false(b);
    gguf_close(g);
    /* second call reuses the file; regenerating elsewhere gives identical bytes */
    assert_int_equal(model_demo_path(path, sizeof path, err, sizeof err), KV_OK);
    char dir2[512], path2[1024];
    snprintf(dir2, sizeof dir2, "%s/cache2", g_tmpdir);
    setenv("KVSERVE_CACHE_DIR", dir2, 1);
    assert_int_equal(model_demo_path(path2, sizeof path2, err, sizeof err), KV_OK);
    char *a, *c;
    size_t al, cl;
    assert_int_equal(kv_read_file(path, &a, &al, NULL, 0), KV_OK);
    assert_int_equal(kv_read_file(path2, &c, &cl, NULL, 0), KV_OK);
    assert_int_equal(al, cl);
    assert_memory_equal(a, c, al);
    free(a);
    free(c);
    model_free(m);
    unsetenv("KVSERVE_CACHE_DIR");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arch_name),
        cmocka_unit_test(test_alloc_rejects_bad_config),
        cmocka_unit_test(test_roundtrip_llama),
        cmocka_unit_test(test_roundtrip_qwen2),
        cmocka_unit_test(test_roundtrip_qwen3),
        cmocka_unit_test(test_load_stories_gguf),
        cmocka_unit_test(test_load_llama2_tiny),
        cmocka_unit_test(test_dir_name),
        cmocka_unit_test(test_load_keeps_stored_precision),
        cmocka_unit_test(test_demo),
    };
    return cmocka_run_group_tests(tests, setup_tmp, teardown_tmp);
}
