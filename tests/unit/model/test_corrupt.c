/* model: corrupted copies of the real checkpoints (truncations, byte flips, huge counts,
 * bad offsets, bad safetensors headers, missing tensors/files, wrong shapes) each give a
 * negative status and a message, never a crash. Copies live in a temp dir. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
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
    return test_tmpdir_make(g_tmp, sizeof g_tmp, "kv_test_corrupt");
}
static int teardown(void **state) {
    (void)state;
    return test_tmpdir_remove(g_tmp);
}

static void write_all(const char *path, const void *d, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(d, 1, n, f), n);
    fclose(f);
}

/* Loads path expecting failure: negative status, non-empty message, *out untouched. */
static kv_status expect_fail(const char *path, char *err, size_t errlen) {
    model_t *m = (model_t *)0x1;
    err[0] = 0;
    kv_status rc = model_load(path, &m, err, errlen);
    if (rc == KV_OK) fprintf(stderr, "unexpectedly loaded %s\n", path);
    assert_true(rc < 0);
    assert_ptr_equal(m, (model_t *)0x1);
    assert_true(strlen(err) > 0);
    return rc;
}

/* Either loads (and frees) or fails with a message. */
static void load_any(const char *path) {
    char err[512] = "";
    model_t *m = NULL;
    kv_status rc = model_load(path, &m, err, sizeof err);
    if (rc == KV_OK) {
        model_free(m);
    } else {
        assert_true(rc < 0);
        assert_true(strlen(err) > 0);
    }
}

static char *read_real(const char *rel, size_t *n) {
    char buf[1024];
    const char *p = test_data_path(buf, sizeof buf, rel);
    if (!p) return NULL;
    char *d;
    assert_int_equal(kv_read_file(p, &d, n, NULL, 0), KV_OK);
    return d;
}

static void test_gguf_truncated(void **s) {
    (void)s;
    size_t n;
    char *d = read_real("models/stories260K/stories260K.gguf", &n);
    if (!d) skip();
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/stories260K.gguf", g_tmp);
    int count = 0;
    for (size_t cut = 0; cut + 32 < n; cut += cut < 256 ? 1 : cut < 16384 ? 61 : 40009) {
        write_all(path, d, cut);
        kv_status rc = expect_fail(path, err, sizeof err);
        assert_true(rc == KV_EFORMAT || (cut == 0 && rc == KV_EFORMAT));
        count++;
    }
    assert_true(count > 400);
    /* one message spot check: cut inside the tensor data */
    write_all(path, d, n - 1000);
    expect_fail(path, err, sizeof err);
    assert_non_null(strstr(err, "past the end of the file"));
    free(d);
}

static void patch_u64(char *d, size_t off, uint64_t v) { memcpy(d + off, &v, 8); }
static void patch_u32(char *d, size_t off, uint32_t v) { memcpy(d + off, &v, 4); }

static void test_gguf_bad_fields(void **s) {
    (void)s;
    size_t n;
    char *orig = read_real("models/stories260K/stories260K.gguf", &n);
    if (!orig) skip();
    char *d = malloc(n);
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/stories260K.gguf", g_tmp);
#define RESET() memcpy(d, orig, n)
#define CHECK(st, needle) \
    do { \
        write_all(path, d, n); \
        assert_int_equal(expect_fail(path, err, sizeof err), st); \
        if (!strstr(err, needle)) fprintf(stderr, "message: %s\n", err); \
        assert_non_null(strstr(err, needle)); \
    } while (0)
    RESET();
    memcpy(d, "GGUX", 4);
    CHECK(KV_EFORMAT, "magic");
    RESET();
    patch_u64(d, 8, UINT64_MAX); /* n_tensors */
    CHECK(KV_EFORMAT, "tensor count");
    RESET();
    patch_u64(d, 16, 1ull << 40); /* n_kv */
    CHECK(KV_EFORMAT, "metadata count");
    RESET();
    patch_u64(d, 24, 1ull << 62); /* first key length */
    CHECK(KV_EFORMAT, "truncated metadata key");
    /* tokens array: key, u32 type (9), u32 elem type (8), u64 count */
    const char *tk = "tokenizer.ggml.tokens";
    size_t toff = (size_t)((char *)memmem(orig, n, tk, strlen(tk)) - orig) + strlen(tk);
    RESET();
    patch_u64(d, toff + 8, 1ull << 61);
    CHECK(KV_EFORMAT, "tokenizer.ggml.tokens");
    RESET();
    patch_u32(d, toff + 4, 77); /* invalid element type */
    CHECK(KV_EFORMAT, "invalid element type");
    RESET();
    patch_u32(d, toff, 200); /* invalid value type */
    CHECK(KV_EFORMAT, "invalid type");
    /* first string of the array with a huge length */
    RESET();
    patch_u64(d, toff + 16, UINT64_MAX - 3);
    CHECK(KV_EFORMAT, "truncated string");
    /* tensor info of blk.3.attn_q.weight: name, u32 n_dims, u64 ne[0], u64 ne[1], u32 type, u64 offset */
    const char *qn = "blk.3.attn_q.weight";
    size_t qoff = (size_t)((char *)memmem(orig, n, qn, strlen(qn)) - orig) + strlen(qn);
    RESET();
    patch_u32(d, qoff, 5);
    CHECK(KV_EFORMAT, "dimensions");
    RESET();
    patch_u64(d, qoff + 4, 1ull << 50);
    CHECK(KV_EFORMAT, "invalid dimension");
    RESET();
    patch_u64(d, qoff + 4 + 8, 0);
    CHECK(KV_EFORMAT, "invalid dimension");
    RESET();
    patch_u64(d, qoff + 4 + 16 + 4, 1ull << 60); /* offset far past EOF */
    CHECK(KV_EFORMAT, "past the end");
    RESET();
    patch_u64(d, qoff + 4 + 16 + 4, 3); /* misaligned */
    CHECK(KV_EFORMAT, "not aligned");
    RESET();
    patch_u64(d, qoff + 4 + 16 + 4, 0); /* aliases the first tensor's bytes */
    CHECK(KV_EFORMAT, "overlaps");
    RESET();
    patch_u32(d, qoff + 4 + 16, 99); /* unknown ggml type */
    CHECK(KV_EUNSUPPORTED, "unknown ggml type 99");
    /* wrong shape with consistent sizes: ne[1] 64 -> 32 */
    RESET();
    patch_u64(d, qoff + 4 + 8, 32);
    CHECK(KV_EFORMAT, "x");
    assert_string_equal(err, "stories260K.gguf: tensor blk.3.attn_q.weight has shape [64, 32], expected [64, 64]");
    /* missing tensor: rename in place */
    RESET();
    const char *un = "blk.2.ffn_up.weight";
    char *up = memmem(d, n, un, strlen(un));
    up[10] = 'x';
    CHECK(KV_EFORMAT, "missing tensor blk.2.ffn_up.weight");
    /* missing metadata / unsupported architecture */
    RESET();
    char *bc = memmem(d, n, "llama.block_count", 17);
    bc[6] = 'X';
    CHECK(KV_EFORMAT, "missing metadata key llama.block_count");
    RESET();
    char *ga = memmem(d, n, "general.architecture", 20);
    memcpy(ga + 20 + 4 + 8, "gpt2x", 5);
    CHECK(KV_EUNSUPPORTED, "unsupported architecture");
    /* inconsistent heads: head_count_kv 3 does not divide 8 */
    RESET();
    const char *hk = "llama.attention.head_count_kv";
    char *hp = memmem(d, n, hk, strlen(hk));
    patch_u32(d, (size_t)(hp - d) + strlen(hk) + 4, 3);
    CHECK(KV_EFORMAT, "kv head count");

    /* Random byte flips in the header region: never crash (ASan build checks memory). */
    size_t hdr_end = qoff + 4096 < n ? qoff + 4096 : n;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    int fd;
    RESET();
    write_all(path, d, n);
    fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    for (int it = 0; it < 300; it++) {
        size_t offs[4];
        char saved[4];
        for (int k = 0; k < 4; k++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            offs[k] = (size_t)(x % hdr_end);
            saved[k] = d[offs[k]];
            char nb = (char)(saved[k] ^ (char)(1 + (x >> 32) % 255));
            assert_int_equal(pwrite(fd, &nb, 1, (off_t)offs[k]), 1);
        }
        load_any(path);
        for (int k = 3; k >= 0; k--) assert_int_equal(pwrite(fd, &saved[k], 1, (off_t)offs[k]), 1);
    }
    close(fd);
    free(d);
    free(orig);
#undef RESET
#undef CHECK
}

/* ---- HF directory corruptions ---- */
static char *g_st, *g_cfg, *g_gen;
static size_t g_st_n, g_cfg_n, g_gen_n;

static void make_hf(const char *dir, const char *st, size_t st_n, const char *cfg, size_t cfg_n) {
    char p[1024];
    assert_int_equal(kv_mkdirs(dir), KV_OK);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    if (st) write_all(p, st, st_n);
    else unlink(p);
    snprintf(p, sizeof p, "%s/config.json", dir);
    if (cfg) write_all(p, cfg, cfg_n);
    else unlink(p);
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    write_all(p, g_gen, g_gen_n);
}

/* Replaces the first occurrence of a with b (same length) in a copy of src. */
static char *subst(const char *src, size_t n, const char *a, const char *b) {
    assert_int_equal(strlen(a), strlen(b));
    char *d = malloc(n + 1);
    memcpy(d, src, n);
    d[n] = 0;
    char *p = memmem(d, n, a, strlen(a));
    assert_non_null(p);
    memcpy(p, b, strlen(b));
    return d;
}

static void test_hf_corrupt(void **s) {
    (void)s;
    g_st = read_real("models/stories260K/hf/model.safetensors", &g_st_n);
    g_cfg = read_real("models/stories260K/hf/config.json", &g_cfg_n);
    g_gen = read_real("models/stories260K/hf/generation_config.json", &g_gen_n);
    if (!g_st || !g_cfg || !g_gen) skip();
    char dir[512], err[512];
    snprintf(dir, sizeof dir, "%s/hfc", g_tmp);
    /* the pristine copy loads */
    make_hf(dir, g_st, g_st_n, g_cfg, g_cfg_n);
    model_t *m;
    assert_int_equal(model_load(dir, &m, err, sizeof err), KV_OK);
    model_free(m);
#define HF_CHECK(st, needle) \
    do { \
        assert_int_equal(expect_fail(dir, err, sizeof err), st); \
        if (!strstr(err, needle)) fprintf(stderr, "message: %s\n", err); \
        assert_non_null(strstr(err, needle)); \
    } while (0)
    /* missing config.json / weights */
    make_hf(dir, g_st, g_st_n, NULL, 0);
    HF_CHECK(KV_ENOTFOUND, "config.json");
    make_hf(dir, NULL, 0, g_cfg, g_cfg_n);
    HF_CHECK(KV_ENOTFOUND, "model.safetensors");
    /* truncations */
    uint64_t hl;
    memcpy(&hl, g_st, 8);
    for (size_t cut = 0; cut < g_st_n - 4; cut += cut < 64 ? 1 : cut < 8 + hl + 64 ? 37 : 30011) {
        make_hf(dir, g_st, cut, g_cfg, g_cfg_n);
        expect_fail(dir, err, sizeof err);
    }
    /* huge header length */
    char *d = malloc(g_st_n);
    memcpy(d, g_st, g_st_n);
    patch_u64(d, 0, 1ull << 62);
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "header length");
    free(d);
    /* bad JSON */
    d = subst(g_st, g_st_n, "{\"__metadata__\"", "[\"__metadata__\"");
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "bad safetensors header JSON");
    free(d);
    d = subst(g_st, g_st_n, "\"dtype\":\"F32\"", "\"dtype\":7.000");
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "malformed header entry");
    free(d);
    /* offsets past the data / inconsistent with the shape */
    d = subst(g_st, g_st_n, "\"data_offsets\":[131072,131328]", "\"data_offsets\":[13107,9131328]");
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "outside the file");
    free(d);
    d = subst(g_st, g_st_n, "\"data_offsets\":[0,131072]", "\"data_offsets\":[0,131070]");
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "data bytes");
    free(d);
    /* unsupported dtype with a matching size */
    d = subst(g_st, g_st_n, "\"dtype\":\"F32\"", "\"dtype\":\"I32\"");
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EUNSUPPORTED, "unsupported dtype I32");
    free(d);
    /* wrong shape, same element count */
    d = subst(g_st, g_st_n, "\"shape\":[512,64]", "\"shape\":[64,512]");
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "x");
    assert_string_equal(err, "model.safetensors: tensor model.embed_tokens.weight has shape [64, 512], expected [512, 64]");
    free(d);
    /* missing tensor */
    d = subst(g_st, g_st_n, "model.layers.4.mlp.up_proj.weight", "model.layers.4.mlp.up_prox.weight");
    make_hf(dir, d, g_st_n, g_cfg, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "missing tensor model.layers.4.mlp.up_proj.weight");
    free(d);
    /* config.json problems */
    make_hf(dir, g_st, g_st_n, "{\"hidden_size\": 64,", 19);
    HF_CHECK(KV_EFORMAT, "config.json");
    d = subst(g_cfg, g_cfg_n, "\"hidden_size\"", "\"hidden_sizX\"");
    make_hf(dir, g_st, g_st_n, d, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "missing hidden_size");
    free(d);
    d = subst(g_cfg, g_cfg_n, "\"num_key_value_heads\": 4", "\"num_key_value_heads\": 3");
    make_hf(dir, g_st, g_st_n, d, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "kv head count");
    free(d);
    d = subst(g_cfg, g_cfg_n, "\"intermediate_size\": 172", "\"intermediate_size\": 173");
    make_hf(dir, g_st, g_st_n, d, g_cfg_n);
    HF_CHECK(KV_EFORMAT, "expected [173, 64]");
    free(d);
    d = subst(g_cfg, g_cfg_n, "LlamaForCausalLM", "GemmaForCausalLM");
    make_hf(dir, g_st, g_st_n, d, g_cfg_n);
    HF_CHECK(KV_EUNSUPPORTED, "GemmaForCausalLM");
    free(d);
    /* random byte flips in the safetensors header: no crash */
    make_hf(dir, g_st, g_st_n, g_cfg, g_cfg_n);
    char p[1024];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    int fd = open(p, O_RDWR);
    assert_true(fd >= 0);
    uint64_t x = 12345;
    for (int it = 0; it < 200; it++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        size_t off = (size_t)((x >> 33) % (8 + hl));
        char nb = (char)(g_st[off] ^ (char)(1 + (x >> 20) % 255));
        assert_int_equal(pwrite(fd, &nb, 1, (off_t)off), 1);
        load_any(dir);
        assert_int_equal(pwrite(fd, &g_st[off], 1, (off_t)off), 1);
    }
    close(fd);
    free(g_st);
    free(g_cfg);
    free(g_gen);
#undef HF_CHECK
}

static void test_missing_paths(void **s) {
    (void)s;
    char err[512], p[512];
    snprintf(p, sizeof p, "%s/does-not-exist.gguf", g_tmp);
    assert_int_equal(expect_fail(p, err, sizeof err), KV_ENOTFOUND);
    snprintf(p, sizeof p, "%s/empty-dir", g_tmp);
    assert_int_equal(kv_mkdirs(p), KV_OK);
    assert_int_equal(expect_fail(p, err, sizeof err), KV_ENOTFOUND);
    snprintf(p, sizeof p, "%s/empty.gguf", g_tmp);
    write_all(p, "", 0);
    assert_int_equal(expect_fail(p, err, sizeof err), KV_EFORMAT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_missing_paths),
        cmocka_unit_test(test_gguf_truncated),
        cmocka_unit_test(test_gguf_bad_fields),
        cmocka_unit_test(test_hf_corrupt),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
