/* model: Hugging Face directory loading (config.json + safetensors), compared with the GGUF
 * conversion of the same weights (stories260K). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/model.h"
#include "test_util.h"
#include "wmat_util.h"

static char g_tmp[256];

static int setup(void **state) {
    (void)state;
    return test_tmpdir_make(g_tmp, sizeof g_tmp, "kv_test_hf");
}
static int teardown(void **state) {
    (void)state;
    return test_tmpdir_remove(g_tmp);
}

/* GGUF llama q/k rows are in adjacent-pair RoPE order; HF rows are in rotate-half order:
 * HF row h*hd + p*hd/2 + i  ==  GGUF row h*hd + 2*i + p  (p in {0,1}, i < hd/2). */
static void assert_permuted(const float *hf, const float *gg, int n_heads, int hd, int cols) {
    for (int h = 0; h < n_heads; h++)
        for (int i = 0; i < hd / 2; i++)
            for (int p = 0; p < 2; p++)
                assert_memory_equal(hf + ((size_t)h * hd + p * hd / 2 + i) * cols,
                                    gg + ((size_t)h * hd + 2 * i + p) * cols, (size_t)cols * 4);
}

static void test_stories_hf_matches_gguf(void **s) {
    (void)s;
    char b1[1024], b2[1024], err[256];
    const char *gp = test_data_path(b1, sizeof b1, "models/stories260K/stories260K.gguf");
    const char *hp = test_data_path(b2, sizeof b2, "models/stories260K/hf/config.json");
    if (!gp || !hp) skip();
    *strrchr(b2, '/') = 0; /* the directory */
    model_t *g, *h;
    assert_int_equal(model_load(gp, &g, err, sizeof err), KV_OK);
    kv_status rc = model_load(hp, &h, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, KV_OK);
    const struct model_config *c = &h->cfg;
    assert_int_equal(h->format, MODEL_FORMAT_HF_DIR);
    /* no name in config.json and a generic directory name (hf/): the parent's name */
    assert_string_equal(c->name, "stories260K");
    assert_int_equal(c->arch, MODEL_ARCH_LLAMA);
    assert_int_equal(c->dim, 64);
    assert_int_equal(c->ffn_dim, 172);
    assert_int_equal(c->n_layers, 5);
    assert_int_equal(c->n_heads, 8);
    assert_int_equal(c->n_kv_heads, 4);
    assert_int_equal(c->head_dim, 8);
    assert_int_equal(c->n_vocab, 512);
    assert_true(c->tied_embeddings);
    assert_true(c->rope_neox);
    assert_false(g->cfg.rope_neox);
    assert_int_equal(c->bos_id, 1);
    assert_int_equal(c->eos_id, 2);
    assert_int_equal(c->n_eos_ids, 1);
    assert_int_equal(c->max_ctx, 512);
    assert_true(c->rms_eps == g->cfg.rms_eps);
    assert_true(c->rope_theta == g->cfg.rope_theta);
    assert_ptr_equal(h->w.output.data, h->w.tok_embd.data);
    size_t d = 64, f = 172, q = 64, kv = 32;
    assert_memory_equal(h->w.tok_embd.data, g->w.tok_embd.data, 512 * d * 4);
    assert_memory_equal(h->w.out_norm, g->w.out_norm, d * 4);
    for (int l = 0; l < 5; l++) {
        const struct layer_weights *a = &h->w.layers[l], *b = &g->w.layers[l];
        assert_memory_equal(a->attn_norm, b->attn_norm, d * 4);
        assert_permuted(a->wq.data, b->wq.data, 8, 8, 64);
        assert_permuted(a->wk.data, b->wk.data, 4, 8, 64);
        /* the rows really are reordered (not identical) */
        assert_true(memcmp(a->wq.data, b->wq.data, q * d * 4) != 0);
        assert_memory_equal(a->wv.data, b->wv.data, kv * d * 4);
        assert_memory_equal(a->wo.data, b->wo.data, d * q * 4);
        assert_memory_equal(a->ffn_norm, b->ffn_norm, d * 4);
        assert_memory_equal(a->w_gate.data, b->w_gate.data, f * d * 4);
        assert_memory_equal(a->w_up.data, b->w_up.data, f * d * 4);
        assert_memory_equal(a->w_down.data, b->w_down.data, d * f * 4);
    }
    /* Saving the HF model as GGUF permutes q/k back: the file loads equal to the original GGUF. */
    char out[512];
    snprintf(out, sizeof out, "%s/from-hf.gguf", g_tmp);
    assert_int_equal(model_save_gguf(h, out, NULL, NULL, err, sizeof err), KV_OK);
    model_t *r;
    assert_int_equal(model_load(out, &r, err, sizeof err), KV_OK);
    assert_false(r->cfg.rope_neox);
    for (int l = 0; l < 5; l++) {
        assert_memory_equal(r->w.layers[l].wq.data, g->w.layers[l].wq.data, q * d * 4);
        assert_memory_equal(r->w.layers[l].wk.data, g->w.layers[l].wk.data, kv * d * 4);
    }
    model_free(r);
    /* config-only read agrees */
    struct model_config rc2;
    model_format fmt;
    assert_int_equal(model_read_config(hp, &rc2, &fmt, err, sizeof err), KV_OK);
    assert_int_equal(fmt, MODEL_FORMAT_HF_DIR);
    assert_int_equal(rc2.n_vocab, 512);
    assert_int_equal(rc2.ffn_dim, 172);
    model_free(g);
    model_free(h);
}

/* ---- synthetic HF directories ---- */
static void write_file(const char *dir, const char *name, const void *data, size_t n) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

/* Builds a safetensors file from (name, dtype, shape, bytes) entries. */
struct st_ent {
    const char *name, *dtype;
    int nd;
    int64_t shape[2];
    const void *data;
    size_t n;
};
static void write_st(const char *dir, const char *fname, const struct st_ent *e, int n) {
    char hdr[8192];
    size_t o = 0, off = 0;
    o += (size_t)snprintf(hdr + o, sizeof hdr - o, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        o += (size_t)snprintf(hdr + o, sizeof hdr - o, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", e[i].name, e[i].dtype);
        for (int d = 0; d < e[i].nd; d++) o += (size_t)snprintf(hdr + o, sizeof hdr - o, "%s%lld", d ? "," : "", (long long)e[i].shape[d]);
        o += (size_t)snprintf(hdr + o, sizeof hdr - o, "],\"data_offsets\":[%zu,%zu]}", off, off + e[i].n);
        off += e[i].n;
    }
    o += (size_t)snprintf(hdr + o, sizeof hdr - o, "}");
    size_t total = 8 + o + off;
    char *buf = malloc(total);
    uint64_t hl = o;
    memcpy(buf, &hl, 8);
    memcpy(buf + 8, hdr, o);
    size_t p = 8 + o;
    for (int i = 0; i < n; i++) {
        memcpy(buf + p, e[i].data, e[i].n);
        p += e[i].n;
    }
    write_file(dir, fname, buf, total);
    free(buf);
}

/* A 1-layer Qwen2 (biases) with BF16/F16 weights in two shards, or Qwen3 (q/k norm). */
static void test_qwen_synthetic(void **s) {
    (void)s;
    char dir[512], err[256];
    snprintf(dir, sizeof dir, "%s/qwen2-tiny", g_tmp);
    assert_int_equal(kv_mkdirs(dir), KV_OK);
    const char *cfg =
        "{\"architectures\":[\"Qwen2ForCausalLM\"],\"hidden_size\":4,\"intermediate_size\":6,"
        "\"num_hidden_layers\":1,\"num_attention_heads\":2,\"num_key_value_heads\":1,\"vocab_size\":3,"
        "\"rms_norm_eps\":1e-6,\"rope_theta\":1000000.0,\"max_position_embeddings\":64,"
        "\"tie_word_embeddings\":false,\"bos_token_id\":0,\"eos_token_id\":[2,1],"
        "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,"
        "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192}}";
    write_file(dir, "config.json", cfg, strlen(cfg));
    const char *gen = "{\"eos_token_id\":[2,0]}";
    write_file(dir, "generation_config.json", gen, strlen(gen));
    /* values: bf16 0x3F80=1.0, 0xC000=-2.0, 0x3E00=0.125; f16 0x3C00=1.0, 0xC000=-2.0, 0x3555~0.33325 */
    uint16_t bf[24], hf16[24];
    float f32[32];
    for (int i = 0; i < 32; i++) f32[i] = (float)i * 0.5f;
    for (int i = 0; i < 24; i++) {
        bf[i] = (uint16_t[]){0x3F80, 0xC000, 0x3E00}[i % 3];
        hf16[i] = (uint16_t[]){0x3C00, 0xC000, 0x3555}[i % 3];
    }
    struct st_ent a[] = {
        {"model.embed_tokens.weight", "BF16", 2, {3, 4}, bf, 24},
        {"model.norm.weight", "F32", 1, {4, 0}, f32, 16},
        {"lm_head.weight", "F16", 2, {3, 4}, hf16, 24},
        {"model.layers.0.input_layernorm.weight", "F32", 1, {4, 0}, f32, 16},
        {"model.layers.0.self_attn.q_proj.weight", "F32", 2, {4, 4}, f32, 64},
        {"model.layers.0.self_attn.q_proj.bias", "F32", 1, {4, 0}, f32 + 4, 16},
        {"model.layers.0.self_attn.k_proj.weight", "F32", 2, {2, 4}, f32, 32},
        {"model.layers.0.self_attn.k_proj.bias", "BF16", 1, {2, 0}, bf, 4},
    };
    struct st_ent b[] = {
        {"model.layers.0.self_attn.v_proj.weight", "F32", 2, {2, 4}, f32, 32},
        {"model.layers.0.self_attn.v_proj.bias", "F16", 1, {2, 0}, hf16 + 1, 4},
        {"model.layers.0.self_attn.o_proj.weight", "F32", 2, {4, 4}, f32, 64},
        {"model.layers.0.post_attention_layernorm.weight", "F32", 1, {4, 0}, f32, 16},
        {"model.layers.0.mlp.gate_proj.weight", "F32", 2, {6, 4}, f32, 96},
        {"model.layers.0.mlp.up_proj.weight", "BF16", 2, {6, 4}, bf, 48},
        {"model.layers.0.mlp.down_proj.weight", "F16", 2, {4, 6}, hf16, 48},
    };
    write_st(dir, "model-00001-of-00002.safetensors", a, 8);
    write_st(dir, "model-00002-of-00002.safetensors", b, 7);
    char idx[4096];
    size_t o = (size_t)snprintf(idx, sizeof idx, "{\"metadata\":{},\"weight_map\":{");
    for (int i = 0; i < 8; i++) o += (size_t)snprintf(idx + o, sizeof idx - o, "%s\"%s\":\"model-00001-of-00002.safetensors\"", i ? "," : "", a[i].name);
    for (int i = 0; i < 7; i++) o += (size_t)snprintf(idx + o, sizeof idx - o, ",\"%s\":\"model-00002-of-00002.safetensors\"", b[i].name);
    o += (size_t)snprintf(idx + o, sizeof idx - o, "}}");
    write_file(dir, "model.safetensors.index.json", idx, o);
    model_t *m;
    kv_status rc = model_load(dir, &m, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, KV_OK);
    const struct model_config *c = &m->cfg;
    assert_int_equal(c->arch, MODEL_ARCH_QWEN2);
    assert_true(c->attn_bias);
    assert_false(c->qk_norm);
    assert_false(c->tied_embeddings);
    assert_true(c->rope_neox);
    assert_int_equal(c->head_dim, 2);
    assert_int_equal(c->n_vocab, 3);
    assert_int_equal(c->rope_scaling.type, 1);
    assert_true(c->rope_scaling.factor == 8.0f);
    assert_int_equal(c->rope_scaling.original_max_pos, 8192);
    assert_true(c->rope_theta == 1000000.0f);
    assert_int_equal(c->bos_id, 0);
    assert_int_equal(c->eos_id, 2);
    assert_int_equal(c->n_eos_ids, 3);
    assert_int_equal(c->eos_ids[1], 1);
    assert_int_equal(c->eos_ids[2], 0);
    assert_string_equal(c->name, "qwen2-tiny");
    assert_true(wmat_at(&m->w.tok_embd, 0) == 1.0f && wmat_at(&m->w.tok_embd, 1) == -2.0f &&
                wmat_at(&m->w.tok_embd, 2) == 0.125f);
    assert_true(wmat_at(&m->w.output, 0) == 1.0f && wmat_at(&m->w.output, 1) == -2.0f);
    assert_float_equal(wmat_at(&m->w.output, 2), 0.333251953125, 0);
    assert_true(m->w.layers[0].bq[0] == 2.0f);
    assert_true(m->w.layers[0].bk[1] == -2.0f);
    assert_true(m->w.layers[0].bv[0] == -2.0f);
    assert_true(wmat_at(&m->w.layers[0].w_down, 23) == 0.333251953125f);
    /* 16-bit matrices keep their precision (not widened to f32) */
    assert_int_equal(m->w.layers[0].w_down.type, KV_QTYPE_F16);
    assert_int_equal(m->w.layers[0].w_up.type, KV_QTYPE_BF16);
    model_free(m);

    /* Qwen3: explicit head_dim and q/k norms; a missing k_norm is reported by name. */
    snprintf(dir, sizeof dir, "%s/qwen3-tiny", g_tmp);
    assert_int_equal(kv_mkdirs(dir), KV_OK);
    const char *cfg3 =
        "{\"architectures\":[\"Qwen3ForCausalLM\"],\"hidden_size\":4,\"intermediate_size\":6,"
        "\"num_hidden_layers\":1,\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":4,"
        "\"vocab_size\":3,\"tie_word_embeddings\":true,\"eos_token_id\":2}";
    write_file(dir, "config.json", cfg3, strlen(cfg3));
    struct st_ent q3[] = {
        {"model.embed_tokens.weight", "F32", 2, {3, 4}, f32, 48},
        {"model.norm.weight", "F32", 1, {4, 0}, f32, 16},
        {"model.layers.0.input_layernorm.weight", "F32", 1, {4, 0}, f32, 16},
        {"model.layers.0.self_attn.q_proj.weight", "F32", 2, {8, 4}, f32, 128},
        {"model.layers.0.self_attn.k_proj.weight", "F32", 2, {4, 4}, f32, 64},
        {"model.layers.0.self_attn.v_proj.weight", "F32", 2, {4, 4}, f32, 64},
        {"model.layers.0.self_attn.q_norm.weight", "F32", 1, {4, 0}, f32 + 1, 16},
        {"model.layers.0.self_attn.k_norm.weight", "F32", 1, {4, 0}, f32 + 2, 16},
        {"model.layers.0.self_attn.o_proj.weight", "F32", 2, {4, 8}, f32, 128},
        {"model.layers.0.post_attention_layernorm.weight", "F32", 1, {4, 0}, f32, 16},
        {"model.layers.0.mlp.gate_proj.weight", "F32", 2, {6, 4}, f32, 96},
        {"model.layers.0.mlp.up_proj.weight", "F32", 2, {6, 4}, f32, 96},
        {"model.layers.0.mlp.down_proj.weight", "F32", 2, {4, 6}, f32, 96},
    };
    write_st(dir, "model.safetensors", q3, 13);
    rc = model_load(dir, &m, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, KV_OK);
    assert_int_equal(m->cfg.arch, MODEL_ARCH_QWEN3);
    assert_true(m->cfg.qk_norm);
    assert_false(m->cfg.attn_bias);
    assert_int_equal(m->cfg.head_dim, 4);
    assert_true(m->cfg.tied_embeddings);
    assert_int_equal(m->cfg.bos_id, -1);
    assert_true(m->w.layers[0].q_norm[0] == 0.5f);
    assert_true(m->w.layers[0].k_norm[3] == 2.5f);
    model_free(m);
    write_st(dir, "model.safetensors", q3, 7); /* drops k_norm onwards */
    m = (model_t *)0x1;
    assert_int_equal(model_load(dir, &m, err, sizeof err), KV_EFORMAT);
    assert_ptr_equal(m, (model_t *)0x1);
    assert_non_null(strstr(err, "model.layers.0.self_attn.k_norm.weight"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stories_hf_matches_gguf),
        cmocka_unit_test(test_qwen_synthetic),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
