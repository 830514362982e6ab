/* gguf: writer/reader round trip of metadata, typed tensors (F16, BF16, Q8_0 against known
 * values), GGUF v2, unsupported types, and the real files' metadata. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/model.h"
#include "test_util.h"

static char g_tmp[256];

static int setup(void **state) {
    (void)state;
    return test_tmpdir_make(g_tmp, sizeof g_tmp, "kv_test_gguf");
}
static int teardown(void **state) {
    (void)state;
    return test_tmpdir_remove(g_tmp);
}

static void test_metadata_roundtrip(void **s) {
    (void)s;
    char path[512], err[256];
    snprintf(path, sizeof path, "%s/meta.gguf", g_tmp);
    gguf_writer_t *w = gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(gguf_w_str(w, "general.architecture", "llama"), KV_OK);
    assert_int_equal(gguf_w_u32(w, "a.u32", 4000000000u), KV_OK);
    assert_int_equal(gguf_w_i32(w, "a.i32", -7), KV_OK);
    assert_int_equal(gguf_w_f32(w, "a.f32", 1.5f), KV_OK);
    assert_int_equal(gguf_w_bool(w, "a.bool", true), KV_OK);
    const char *strs[] = {"", "hello", "\xe2\x96\x81world"};
    assert_int_equal(gguf_w_arr_str(w, "a.strs", strs, 3), KV_OK);
    float fa[] = {0.25f, -3.0f};
    assert_int_equal(gguf_w_arr_f32(w, "a.fa", fa, 2), KV_OK);
    int32_t ia[] = {1, -2, 3};
    assert_int_equal(gguf_w_arr_i32(w, "a.ia", ia, 3), KV_OK);
    assert_int_equal(gguf_w_i32(w, "a.i32", -8), KV_OK); /* replaces */
    uint64_t ne[2] = {3, 2};
    float t[6] = {1, 2, 3, 4, 5, 6};
    assert_int_equal(gguf_w_tensor_f32(w, "t", 2, ne, t), KV_OK);
    assert_int_equal(gguf_writer_save(w, path, err, sizeof err), KV_OK);
    gguf_writer_free(w);

    gguf_t *g;
    assert_int_equal(gguf_open(path, &g, err, sizeof err), KV_OK);
    assert_int_equal(gguf_version(g), 3);
    assert_int_equal(gguf_n_keys(g), 8);
    int64_t v;
    double d;
    bool b;
    assert_true(gguf_get_int(g, "a.u32", &v));
    assert_int_equal(v, 4000000000ll);
    assert_true(gguf_get_int(g, "a.i32", &v));
    assert_int_equal(v, -8);
    assert_true(gguf_get_float(g, "a.f32", &d));
    assert_true(d == 1.5);
    assert_false(gguf_get_int(g, "a.f32", &v));
    assert_true(gguf_get_bool(g, "a.bool", &b) && b);
    assert_false(gguf_get_int(g, "missing", &v));
    const char *str;
    size_t len;
    assert_true(gguf_get_str(g, "general.architecture", &str, &len));
    assert_int_equal(len, 5);
    assert_memory_equal(str, "llama", 5);
    enum gguf_type et;
    uint64_t n;
    assert_true(gguf_get_arr_info(g, "a.strs", &et, &n));
    assert_int_equal(et, GGUF_TYPE_STRING);
    assert_int_equal(n, 3);
    assert_true(gguf_get_arr_str(g, "a.strs", 2, &str, &len));
    assert_int_equal(len, 8);
    assert_memory_equal(str, "\xe2\x96\x81world", 8);
    assert_true(gguf_get_arr_str(g, "a.strs", 0, &str, &len));
    assert_int_equal(len, 0);
    assert_false(gguf_get_arr_str(g, "a.strs", 3, &str, &len));
    assert_null(gguf_get_arr_data(g, "a.strs"));
    const char *ip = gguf_get_arr_data(g, "a.ia");
    assert_non_null(ip);
    int32_t i1;
    memcpy(&i1, ip + 4, 4); /* packed in the file: may be unaligned */
    assert_int_equal(i1, -2);
    assert_int_equal(gguf_key_type(g, gguf_find_key(g, "a.fa")), GGUF_TYPE_ARRAY);
    assert_int_equal(gguf_n_tensors(g), 1);
    const struct gguf_tensor *tt = gguf_find_tensor(g, "t");
    assert_non_null(tt);
    assert_int_equal(tt->n_dims, 2);
    assert_int_equal(tt->ne[0], 3);
    assert_int_equal(tt->ne[1], 2);
    assert_int_equal(tt->nbytes, 24);
    assert_int_equal(((uintptr_t)tt->data) % 32, 0);
    float o[6];
    assert_int_equal(gguf_tensor_to_f32(tt, o, 6, err, sizeof err), KV_OK);
    assert_memory_equal(o, t, 24);
    assert_int_equal(gguf_tensor_to_f32(tt, o, 5, err, sizeof err), KV_EFORMAT);
    gguf_close(g);

    /* GGUF v2 has the same layout (64-bit counts): patch the version and read again. */
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    uint32_t ver = 2;
    fseek(f, 4, SEEK_SET);
    fwrite(&ver, 4, 1, f);
    fclose(f);
    assert_int_equal(gguf_open(path, &g, err, sizeof err), KV_OK);
    assert_int_equal(gguf_version(g), 2);
    assert_true(gguf_get_int(g, "a.i32", &v) && v == -8);
    gguf_close(g);
    f = fopen(path, "r+b");
    ver = 1;
    fseek(f, 4, SEEK_SET);
    fwrite(&ver, 4, 1, f);
    fclose(f);
    assert_int_equal(gguf_open(path, &g, err, sizeof err), KV_EUNSUPPORTED);
    assert_non_null(strstr(err, "version 1"));
}

/* F16 / BF16 / Q8_0 tensors written as raw bytes, decoded against known IEEE values. */
static void test_typed_tensors(void **s) {
    (void)s;
    char path[512], err[256];
    snprintf(path, sizeof path, "%s/typed.gguf", g_tmp);
    gguf_writer_t *w = gguf_writer_new();
    uint16_t f16[8] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x3555, 0x8000, 0x7C00, 0x0400};
    float f16_want[8] = {1.0f, -2.0f, 65504.0f, 5.9604644775390625e-08f, 0.333251953125f, -0.0f, INFINITY,
                         6.103515625e-05f};
    uint16_t bf[6] = {0x3F80, 0x4049, 0xC2F7, 0x0000, 0xFF80, 0x3E00};
    float bf_want[6] = {1.0f, 3.140625f, -123.5f, 0.0f, -INFINITY, 0.125f};
    uint64_t ne1[1] = {8}, ne2[1] = {6};
    assert_int_equal(gguf_w_tensor_raw(w, "f16", 1, ne1, GGML_F16, f16, sizeof f16), KV_OK);
    assert_int_equal(gguf_w_tensor_raw(w, "bf16", 1, ne2, GGML_BF16, bf, sizeof bf), KV_OK);
    /* Q8_0: 2 blocks of (f16 scale, 32 x int8). scale 0.5 (0x3800) and 0.0999755859375 (0x2E66). */
    uint8_t q8[68];
    uint16_t d0 = 0x3800, d1 = 0x2E66;
    memcpy(q8, &d0, 2);
    memcpy(q8 + 34, &d1, 2);
    for (int j = 0; j < 32; j++) {
        q8[2 + j] = (uint8_t)(int8_t)(j - 16);
        q8[36 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    }
    uint64_t ne3[2] = {32, 2};
    assert_int_equal(gguf_w_tensor_raw(w, "q8", 2, ne3, GGML_Q8_0, q8, sizeof q8), KV_OK);
    uint8_t q2[84] = {0}; /* a type ggml has and kvserve does not compute with */
    uint64_t ne4[1] = {256};
    assert_int_equal(gguf_w_tensor_raw(w, "q2", 1, ne4, 10 /* Q2_K */, q2, sizeof q2), KV_OK);
    assert_int_equal(gguf_writer_save(w, path, err, sizeof err), KV_OK);
    gguf_writer_free(w);

    gguf_t *g;
    assert_int_equal(gguf_open(path, &g, err, sizeof err), KV_OK);
    float o[64];
    const struct gguf_tensor *t = gguf_find_tensor(g, "f16");
    assert_int_equal(t->type, GGML_F16);
    assert_int_equal(gguf_tensor_to_f32(t, o, 8, err, sizeof err), KV_OK);
    for (int i = 0; i < 8; i++) assert_memory_equal(&o[i], &f16_want[i], 4); /* bitwise, incl. -0 */
    t = gguf_find_tensor(g, "bf16");
    assert_int_equal(gguf_tensor_to_f32(t, o, 6, err, sizeof err), KV_OK);
    for (int i = 0; i < 6; i++) assert_memory_equal(&o[i], &bf_want[i], 4);
    t = gguf_find_tensor(g, "q8");
    assert_int_equal(t->nbytes, 68);
    assert_int_equal(gguf_tensor_to_f32(t, o, 64, err, sizeof err), KV_OK);
    for (int j = 0; j < 32; j++) {
        assert_true(o[j] == 0.5f * (float)(j - 16));
        assert_true(o[32 + j] == 0.0999755859375f * (float)(j * 8 - 128));
    }
    t = gguf_find_tensor(g, "q2");
    assert_string_equal(ggml_dtype_name(t->type), "Q2_K");
    assert_int_equal(gguf_tensor_to_f32(t, o, 256, err, sizeof err), KV_EUNSUPPORTED);
    assert_non_null(strstr(err, "Q2_K"));
    gguf_close(g);
}

/* A model whose weights are F16 / Q8_0 loads (converted), and a Q4_1 weight (a type kvserve
 * does not compute with) is refused by name. */
static kv_status q_extra(struct gguf_writer *w, void *user) {
    (void)user;
    (void)w;
    return KV_OK;
}
static void test_model_with_unsupported_type(void **s) {
    (void)s;
    char path[512], err[256];
    snprintf(path, sizeof path, "%s/q4model.gguf", g_tmp);
    struct model_config c = {0};
    c.arch = MODEL_ARCH_LLAMA;
    c.n_vocab = 8;
    c.dim = 32;
    c.n_layers = 1;
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.head_dim = 8;
    c.ffn_dim = 32;
    c.rms_eps = 1e-5f;
    c.rope_theta = 10000;
    c.max_ctx = 16;
    c.bos_id = c.eos_id = -1;
    model_t *m;
    assert_int_equal(model_alloc(&c, &m), KV_OK);
    model_randomize(m, 1, 0.1f);
    assert_int_equal(model_save_gguf(m, path, q_extra, NULL, err, sizeof err), KV_OK);
    model_free(m);
    /* Rewrite blk.0.ffn_up.weight's type field from F32 (0) to Q4_1 (3): the data size shrinks,
     * so it still fits; the loader must refuse it by name. */
    char *buf;
    size_t n;
    assert_int_equal(kv_read_file(path, &buf, &n, NULL, 0), KV_OK);
    const char *name = "blk.0.ffn_up.weight";
    char *p = memmem(buf, n, name, strlen(name));
    assert_non_null(p);
    p += strlen(name) + 4 + 16; /* n_dims, ne[0], ne[1] */
    uint32_t ty = 3;
    memcpy(p, &ty, 4);
    FILE *f = fopen(path, "wb");
    fwrite(buf, 1, n, f);
    fclose(f);
    free(buf);
    m = NULL;
    assert_int_equal(model_load(path, &m, err, sizeof err), KV_EUNSUPPORTED);
    assert_null(m);
    assert_non_null(strstr(err, "blk.0.ffn_up.weight"));
    assert_non_null(strstr(err, "Q4_1"));
}

/* rope_freqs.weight as llama.cpp's converter writes it for Llama 3.2 (factor 32, low 1, high 4,
 * original context 8192): the llama3 scaling parameters are recovered. */
static float g_rf[32];
static kv_status rf_extra(struct gguf_writer *w, void *user) {
    (void)user;
    uint64_t ne[1] = {32};
    return gguf_w_tensor_f32(w, "rope_freqs.weight", 1, ne, g_rf);
}
static void test_rope_freqs(void **s) {
    (void)s;
    char path[512], err[256];
    snprintf(path, sizeof path, "%s/l32.gguf", g_tmp);
    struct model_config c = {0};
    c.arch = MODEL_ARCH_LLAMA;
    c.n_vocab = 4;
    c.dim = 128;
    c.n_layers = 1;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 64;
    c.ffn_dim = 8;
    c.rms_eps = 1e-5f;
    c.rope_theta = 500000.0f;
    c.max_ctx = 131072;
    c.bos_id = c.eos_id = -1;
    for (int i = 0; i < 32; i++) { /* convert_hf_to_gguf.py LlamaModel.generate_extra_tensors */
        double freq = 1.0 / pow(500000.0, 2.0 * i / 64), wl = 2 * M_PI / freq;
        if (wl < 8192.0 / 4) g_rf[i] = 1.0f;
        else if (wl > 8192.0 / 1) g_rf[i] = 32.0f;
        else {
            double sm = (8192.0 / wl - 1) / (4 - 1);
            g_rf[i] = (float)(1 / ((1 - sm) / 32 + sm));
        }
    }
    model_t *m;
    assert_int_equal(model_alloc(&c, &m), KV_OK);
    assert_int_equal(model_save_gguf(m, path, rf_extra, NULL, err, sizeof err), KV_OK);
    model_t *l;
    kv_status rc = model_load(path, &l, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, KV_OK);
    assert_int_equal(l->cfg.rope_scaling.type, 1);
    assert_true(l->cfg.rope_scaling.factor == 32.0f);
    assert_true(l->cfg.rope_scaling.low_freq_factor == 1.0f);
    assert_true(l->cfg.rope_scaling.high_freq_factor == 4.0f);
    assert_int_equal(l->cfg.rope_scaling.original_max_pos, 8192);
    model_free(l);
    g_rf[20] *= 1.5f; /* not llama3-shaped */
    assert_int_equal(model_save_gguf(m, path, rf_extra, NULL, err, sizeof err), KV_OK);
    assert_int_equal(model_load(path, &l, err, sizeof err), KV_EUNSUPPORTED);
    assert_non_null(strstr(err, "rope_freqs.weight"));
    model_free(m);
}

static void test_real_metadata(void **s) {
    (void)s;
    char buf[1024], err[256];
    const char *p = test_data_path(buf, sizeof buf, "models/stories260K/stories260K.gguf");
    if (!p) skip();
    gguf_t *g;
    assert_int_equal(gguf_open(p, &g, err, sizeof err), KV_OK);
    assert_int_equal(gguf_version(g), 3);
    assert_int_equal(gguf_n_tensors(g), 48);
    int64_t v;
    assert_true(gguf_get_int(g, "llama.embedding_length", &v) && v == 64);
    enum gguf_type et;
    uint64_t n;
    assert_true(gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n));
    assert_int_equal(n, 512);
    const char *str;
    size_t len;
    assert_true(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 1, &str, &len));
    assert_int_equal(len, 3);
    assert_memory_equal(str, "<s>", 3);
    const struct gguf_tensor *t = gguf_find_tensor(g, "blk.3.attn_k.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 32);
    gguf_close(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metadata_roundtrip),
        cmocka_unit_test(test_typed_tensors),
        cmocka_unit_test(test_model_with_unsupported_type),
        cmocka_unit_test(test_rope_freqs),
        cmocka_unit_test(test_real_metadata),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
