/* Tokenizer tests: exact ids against llama.cpp and Hugging Face references, decode round
 * trips, streaming guarantees, chat rendering, the byte-only demo vocabulary. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

/* ---- shared tokenizers, each loaded once per binary ---- */
enum { T_STORIES_GGUF, T_STORIES_HF, T_SPM_GGUF, T_GPT2_GGUF, T_DSC_GGUF, T_LLAMA3, T_QWEN3, T_MISTRAL, T_GPT2, T_LLAMA2,
       T_FALCON_GGUF, T_MPT_GGUF, T_PHI3_GGUF, T_REFACT_GGUF, T_STARCODER_GGUF, T_NEOX_GGUF, T_BAICHUAN_GGUF, T_N };
static const char *k_paths[T_N] = {
    "models/stories260K/stories260K.gguf",
    "models/stories260K/hf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-llama-spm.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-gpt-2.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-deepseek-coder.gguf",
    "tokenizers/llama3",
    "tokenizers/qwen3",
    "tokenizers/mistral",
    "tokenizers/gpt2",
    "tokenizers/llama2",
    "tokenizer-vectors/llama.cpp/ggml-vocab-falcon.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-mpt.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-phi-3.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-refact.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-starcoder.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-gpt-neox.gguf",
    "tokenizer-vectors/llama.cpp/ggml-vocab-baichuan.gguf",
};
static tokenizer_t *g_tok[T_N];
static bool g_tried[T_N];

static tokenizer_t *get_tok(int which) {
    if (!g_tried[which]) {
        g_tried[which] = true;
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", test_data_dir(), k_paths[which]);
        char err[512] = "";
        FILE *f = fopen(p, "rb");
        if (!f) {
            fprintf(stderr, "SKIP: test data %s not found (set KVSERVE_TEST_DATA)\n", p);
            return NULL;
        }
        fclose(f);
        kv_status st = tok_load(p, &g_tok[which], err, sizeof err);
        if (st) fprintf(stderr, "load %s: %s: %s\n", p, kv_status_str(st), err);
        assert_int_equal(st, KV_OK);
    }
    return g_tok[which];
}

static char *read_all(const char *rel, size_t *len) {
    char p[1024];
    if (!test_data_path(p, sizeof p, rel)) return NULL;
    char *s;
    char err[256];
    if (kv_read_file(p, &s, len, err, sizeof err)) return NULL;
    return s;
}

static bool ids_equal(const int32_t *a, size_t na, const json_t *arr) {
    if (na != json_array_size(arr)) return false;
    for (size_t i = 0; i < na; i++)
        if (a[i] != json_integer_value(json_array_get(arr, i))) return false;
    return true;
}

static void print_mismatch(const char *what, const char *text, const int32_t *a, size_t na, const json_t *arr) {
    fprintf(stderr, "MISMATCH %s: text=\"%.80s\"\n  got:", what, text);
    for (size_t i = 0; i < na && i < 40; i++) fprintf(stderr, " %d", a[i]);
    fprintf(stderr, "\n  exp:");
    for (size_t i = 0; i < json_array_size(arr) && i < 40; i++)
        fprintf(stderr, " %lld", (long long)json_integer_value(json_array_get(arr, i)));
    fprintf(stderr, "\n");
}

/* Checks decode round trip and the stream guarantees for ids; returns false on failure. */
static bool check_decode_stream(const tokenizer_t *t, const char *text, size_t len, const int32_t *ids, size_t n,
                                bool roundtrip) {
    char *dec;
    size_t dl;
    assert_int_equal(tok_decode(t, ids, n, true, &dec, &dl), KV_OK);
    bool ok = true;
    if (roundtrip && (dl != len || memcmp(dec, text, len) != 0)) {
        fprintf(stderr, "ROUNDTRIP mismatch: \"%.60s\" -> \"%.60s\"\n", text, dec);
        ok = false;
    }
    tok_stream_t *s = tok_stream_new(t, NULL, 0);
    assert_non_null(s);
    kv_buf acc;
    kv_buf_init(&acc);
    for (size_t i = 0; i < n; i++) {
        kv_buf chunk;
        kv_buf_init(&chunk);
        assert_int_equal(tok_stream_push(s, ids[i], &chunk), KV_OK);
        if (!kv_utf8_valid(chunk.data ? chunk.data : "", chunk.len)) ok = false;
        kv_buf_append(&acc, chunk.data, chunk.len);
        kv_buf_free(&chunk);
    }
    assert_int_equal(tok_stream_flush(s, &acc), KV_OK);
    if (acc.len != dl || memcmp(acc.data ? acc.data : "", dec, dl) != 0) {
        fprintf(stderr, "STREAM mismatch: \"%.60s\" vs \"%.60s\"\n", kv_buf_cstr(&acc), dec);
        ok = false;
    }
    kv_buf_free(&acc);
    tok_stream_free(s);
    free(dec);
    return ok;
}

/* ---- stories260K: llama.cpp ids for GGUF and HF tokenizer ---- */
static void run_stories(int which) {
    tokenizer_t *t = get_tok(which);
    size_t len;
    char *all = read_all("references/stories260K/tokenizer_vectors.jsonl", &len);
    if (!t || !all) {
        free(all);
        skip();
        return;
    }
    int n = 0, bad = 0;
    for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        assert_non_null(j);
        const char *text = json_string_value(json_object_get(j, "text"));
        size_t tl = json_string_length(json_object_get(j, "text"));
        for (int ps = 0; ps < 2; ps++) {
            int32_t *ids;
            size_t ni;
            assert_int_equal(tok_encode(t, text, tl, false, ps == 0, &ids, &ni), KV_OK);
            const json_t *exp = json_object_get(j, ps == 0 ? "ids" : "ids_no_parse_special");
            if (!ids_equal(ids, ni, exp)) {
                print_mismatch(ps == 0 ? "stories parse_special" : "stories no_parse", text, ids, ni, exp);
                bad++;
            }
            if (ps == 1 && !check_decode_stream(t, text, tl, ids, ni, json_is_true(json_object_get(j, "hf_decode_roundtrip"))))
                bad++;
            free(ids);
        }
        n++;
        json_decref(j);
    }
    free(all);
    fprintf(stderr, "stories260K %s: %d strings, %d failures\n", which == T_STORIES_GGUF ? "gguf" : "hf", n, bad);
    assert_true(n >= 60);
    assert_int_equal(bad, 0);
}
static void test_stories_gguf(void **st) { (void)st; run_stories(T_STORIES_GGUF); }
static void test_stories_hf(void **st) { (void)st; run_stories(T_STORIES_HF); }

/* ---- llama.cpp tokenizer vectors (.inp/.out) ---- */
static void run_vectors(int which, const char *name) {
    tokenizer_t *t = get_tok(which);
    char rel[256];
    size_t il, ol;
    snprintf(rel, sizeof rel, "tokenizer-vectors/llama.cpp/ggml-vocab-%s.gguf.inp", name);
    char *inp = read_all(rel, &il);
    snprintf(rel, sizeof rel, "tokenizer-vectors/llama.cpp/ggml-vocab-%s.gguf.out", name);
    char *out = read_all(rel, &ol);
    if (!t || !inp || !out) {
        free(inp);
        free(out);
        skip();
        return;
    }
    const char *sep = "\n__ggml_vocab_test__\n";
    char *p = inp, *o = out;
    int n = 0, bad = 0;
    while (*p) {
        char *e = strstr(p, sep);
        size_t tl = e ? (size_t)(e - p) : strlen(p);
        char *oe = strchr(o, '\n');
        if (!oe) break;
        *oe = 0;
        json_t *exp = json_array();
        for (char *q = o; *q;) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q) break;
            json_array_append_new(exp, json_integer(v));
            q = end;
        }
        int32_t *ids;
        size_t ni;
        assert_int_equal(tok_encode(t, p, tl, false, false, &ids, &ni), KV_OK);
        if (!ids_equal(ids, ni, exp)) {
            char tmp[100];
            snprintf(tmp, sizeof tmp, "%.*s", (int)(tl < 80 ? tl : 80), p);
            print_mismatch(name, tmp, ids, ni, exp);
            bad++;
        }
        if (!check_decode_stream(t, p, tl, ids, ni, false)) bad++;
        free(ids);
        json_decref(exp);
        n++;
        o = oe + 1;
        if (!e) break;
        p = e + strlen(sep);
    }
    free(inp);
    free(out);
    fprintf(stderr, "llama.cpp vectors %s: %d strings, %d failures\n", name, n, bad);
    assert_int_equal(n, 46);
    assert_int_equal(bad, 0);
}
static void test_vec_llama_spm(void **st) { (void)st; run_vectors(T_SPM_GGUF, "llama-spm"); }
static void test_vec_gpt2(void **st) { (void)st; run_vectors(T_GPT2_GGUF, "gpt-2"); }
static void test_vec_deepseek_coder(void **st) { (void)st; run_vectors(T_DSC_GGUF, "deepseek-coder"); }
static void test_vec_llama_bpe(void **st) { (void)st; run_vectors(T_LLAMA3, "llama-bpe"); }
static void test_vec_qwen2(void **st) { (void)st; run_vectors(T_QWEN3, "qwen2"); }
static void test_vec_falcon(void **st) { (void)st; run_vectors(T_FALCON_GGUF, "falcon"); }
static void test_vec_mpt(void **st) { (void)st; run_vectors(T_MPT_GGUF, "mpt"); }
static void test_vec_phi3(void **st) { (void)st; run_vectors(T_PHI3_GGUF, "phi-3"); }
static void test_vec_refact(void **st) { (void)st; run_vectors(T_REFACT_GGUF, "refact"); }
static void test_vec_starcoder(void **st) { (void)st; run_vectors(T_STARCODER_GGUF, "starcoder"); }

/* gpt-neox (no tokenizer.ggml.pre: GPT-2 split) and baichuan (SPM) ship no vectors: they
 * must load and round-trip text exactly through encode + decode. */
static void check_roundtrip_only(int which) {
    tokenizer_t *t = get_tok(which);
    if (!t) skip();
    const char *texts[] = {"Hello world", "  two  spaces\n\tand tabs", "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac 123456",
                           "don't 'LL \xf0\x9f\xa6\x99"};
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        int32_t *ids;
        size_t n;
        assert_int_equal(tok_encode(t, texts[k], strlen(texts[k]), false, false, &ids, &n), KV_OK);
        assert_true(n > 0 && n <= strlen(texts[k]));
        char *dec;
        assert_int_equal(tok_decode(t, ids, n, false, &dec, NULL), KV_OK);
        assert_string_equal(dec, texts[k]);
        free(dec);
        free(ids);
    }
}
static void test_load_gpt_neox(void **st) { (void)st; check_roundtrip_only(T_NEOX_GGUF); }
static void test_load_baichuan(void **st) { (void)st; check_roundtrip_only(T_BAICHUAN_GGUF); }

/* ---- HF tokenizers on War and Peace paragraphs ---- */
static void run_wap(int which, const char *name) {
    tokenizer_t *t = get_tok(which);
    char rel[256];
    size_t len;
    snprintf(rel, sizeof rel, "references/tokenizers/%s.war-and-peace.jsonl", name);
    char *all = read_all(rel, &len);
    if (!t || !all) {
        free(all);
        skip();
        return;
    }
    int n = 0, bad = 0, bad_rt = 0;
    for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        assert_non_null(j);
        const char *text = json_string_value(json_object_get(j, "text"));
        size_t tl = json_string_length(json_object_get(j, "text"));
        int32_t *ids;
        size_t ni;
        assert_int_equal(tok_encode(t, text, tl, false, false, &ids, &ni), KV_OK);
        if (!ids_equal(ids, ni, json_object_get(j, "ids"))) {
            if (bad < 3) print_mismatch(name, text, ids, ni, json_object_get(j, "ids"));
            bad++;
        }
        /* decode round trip (exact for these texts) and the stream guarantees */
        if (!check_decode_stream(t, text, tl, ids, ni, true)) bad_rt++;
        free(ids);
        json_decref(j);
        n++;
    }
    free(all);
    fprintf(stderr, "war-and-peace %s: %d/%d match (%.1f%%), %d decode/stream failures\n", name, n - bad, n,
            100.0 * (n - bad) / (n ? n : 1), bad_rt);
    assert_int_equal(n, 1000);
    assert_int_equal(bad, 0);
    assert_int_equal(bad_rt, 0);
}
static void test_wap_qwen3(void **st) { (void)st; run_wap(T_QWEN3, "qwen3"); }
static void test_wap_llama3(void **st) { (void)st; run_wap(T_LLAMA3, "llama3"); }
static void test_wap_mistral(void **st) { (void)st; run_wap(T_MISTRAL, "mistral"); }
static void test_wap_gpt2(void **st) { (void)st; run_wap(T_GPT2, "gpt2"); }
static void test_wap_llama2(void **st) { (void)st; run_wap(T_LLAMA2, "llama2"); }


/* ---- chat templates ----
 * Expected strings were generated with @huggingface/jinja (npm) rendering each model's own
 * chat_template from the data folder: new Template(cfg.chat_template).render({messages,
 * add_generation_prompt, bos_token: cfg.bos_token, eos_token: cfg.eos_token}). */
static const struct chat_message k_conv[] = {
    {"system", "You are a helpful assistant."},
    {"user", "Hi there!"},
    {"assistant", "Hello! How can I help?"},
    {"user", "  Tell me a joke.\n"},
};
static const struct chat_message k_conv2[] = {
    {"user", "What is 2+2?"},
    {"assistant", "<think>\nsimple\n</think>\n\n4"},
    {"user", "And 3+3?"},
    {"assistant", "6"},
};

static void check_render(const tokenizer_t *t, const struct chat_message *m, size_t n, bool gen, const char *exp) {
    char *out = NULL, err[256] = "";
    assert_int_equal(tok_chat_render(t, m, n, gen, &out, err, sizeof err), KV_OK);
    if (strcmp(out, exp)) fprintf(stderr, "RENDER got:\n%s\nexpected:\n%s\n", out, exp);
    assert_string_equal(out, exp);
    free(out);
}

static void test_chat_qwen3(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_QWEN3);
    if (!t) skip();
    assert_int_equal(tok_chat_format(t), CHAT_FMT_CHATML);
    check_render(t, k_conv, 4, true,
                 "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
                 "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\n  Tell me a joke.\n"
                 "<|im_end|>\n<|im_start|>assistant\n");
    check_render(t, k_conv2, 4, false,
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n"
                 "And 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>\n");
    /* rendered + encoded: the markers are single special tokens; Qwen adds no BOS */
    char *out, err[128];
    assert_int_equal(tok_chat_render(t, k_conv, 2, true, &out, err, sizeof err), KV_OK);
    int32_t *ids;
    size_t n;
    assert_int_equal(tok_encode(t, out, strlen(out), true, true, &ids, &n), KV_OK);
    assert_int_equal(ids[0], tok_find(t, "<|im_start|>"));
    assert_true(tok_is_eog(t, tok_find(t, "<|im_end|>")));
    assert_true(tok_is_special(t, tok_find(t, "<|im_end|>")));
    free(ids);
    free(out);
}

static void test_chat_llama3(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_LLAMA3);
    if (!t) skip();
    assert_int_equal(tok_chat_format(t), CHAT_FMT_LLAMA3);
    const char *e1 =
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
        "\n\nHello! How can I help?<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n";
    check_render(t, k_conv, 4, true, e1);
    /* this (Llama-3-8B) template emits the generation prompt even when not asked */
    check_render(t, k_conv2, 4, false,
                 "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n<think>\nsimple\n</think>\n\n4<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|><|start_header_id|>assistant"
                 "<|end_header_id|>\n\n6<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    /* exactly one BOS after encoding with add_special */
    int32_t *ids;
    size_t n;
    assert_int_equal(tok_encode(t, e1, strlen(e1), true, true, &ids, &n), KV_OK);
    assert_int_equal(ids[0], tok_find(t, "<|begin_of_text|>"));
    assert_int_not_equal(ids[1], ids[0]);
    assert_int_equal(ids[1], tok_find(t, "<|start_header_id|>"));
    assert_true(tok_is_eog(t, tok_find(t, "<|eot_id|>")));
    assert_true(tok_is_eog(t, tok_find(t, "<|end_of_text|>")));
    /* without parse_special the markers are plain text */
    int32_t *ids2;
    size_t n2;
    assert_int_equal(tok_encode(t, e1, strlen(e1), false, false, &ids2, &n2), KV_OK);
    for (size_t i = 0; i < n2; i++) assert_false(tok_is_special(t, ids2[i]));
    free(ids2);
    free(ids);
}

/* stories260K has no template: ChatML like llama.cpp, tokenized with BOS, markers as text */
static void test_chat_stories(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_STORIES_GGUF);
    size_t len;
    char *js = read_all("references/stories260K/llamacpp_chat.json", &len);
    if (!t || !js) {
        free(js);
        skip();
        return;
    }
    json_error_t je;
    json_t *root = json_loads(js, 0, &je);
    assert_non_null(root);
    assert_int_equal(tok_chat_format(t), CHAT_FMT_CHATML);
    const char *k;
    json_t *c;
    int n_cases = 0;
    json_object_foreach(root, k, c) {
        const json_t *msgs = json_object_get(c, "messages");
        struct chat_message m[16];
        size_t nm = json_array_size(msgs);
        assert_true(nm > 0 && nm <= 16);
        for (size_t i = 0; i < nm; i++) {
            m[i].role = json_string_value(json_object_get(json_array_get(msgs, i), "role"));
            m[i].content = json_string_value(json_object_get(json_array_get(msgs, i), "content"));
        }
        char *out, err[128];
        assert_int_equal(tok_chat_render(t, m, nm, true, &out, err, sizeof err), KV_OK);
        assert_string_equal(out, json_string_value(json_object_get(c, "rendered_prompt")));
        int32_t *ids;
        size_t n;
        assert_int_equal(tok_encode(t, out, strlen(out), tok_add_bos(t), true, &ids, &n), KV_OK);
        const json_t *exp = json_object_get(c, "prompt_ids");
        if (!ids_equal(ids, n, exp)) print_mismatch(k, out, ids, n, exp);
        assert_true(ids_equal(ids, n, exp));
        /* the stream of the completion reproduces llama.cpp's text minus at most the
         * leading space that a standalone decode strips */
        const json_t *cids = json_object_get(c, "completion_ids");
        size_t nc = json_array_size(cids);
        int32_t *gen = malloc(nc * sizeof *gen);
        for (size_t i = 0; i < nc; i++) gen[i] = (int32_t)json_integer_value(json_array_get(cids, i));
        const char *content = json_string_value(json_object_get(c, "content"));
        char *dec;
        assert_int_equal(tok_decode(t, gen, nc, true, &dec, NULL), KV_OK);
        const char *cmp = content;
        if (content[0] == ' ' && dec[0] != ' ') cmp++;
        assert_string_equal(dec, cmp);
        assert_true(check_decode_stream(t, dec, strlen(dec), gen, nc, false));
        free(dec);
        free(gen);
        free(ids);
        free(out);
        n_cases++;
    }
    assert_int_equal(n_cases, 3);
    json_decref(root);
    free(js);
}

static void test_chat_errors(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_STORIES_HF);
    if (!t) skip();
    char *out = NULL, err[128] = "";
    assert_int_equal(tok_chat_render(t, k_conv, 0, true, &out, err, sizeof err), KV_EINVAL);
    assert_null(out);
    assert_string_equal(chat_format_name(CHAT_FMT_LLAMA3), "llama3");
}

/* ---- the demo model's vocabulary: <unk>, <s>, </s> and 256 byte tokens ---- */
static void test_byte_vocab(void **st) {
    (void)st;
    const char *path = "/tmp/kvserve_test_byte_vocab.gguf";
    gguf_writer_t *w = gguf_writer_new();
    assert_non_null(w);
    char names[259][8];
    const char *tokens[259];
    float scores[259];
    int32_t types[259];
    strcpy(names[0], "<unk>");
    strcpy(names[1], "<s>");
    strcpy(names[2], "</s>");
    for (int i = 0; i < 259; i++) {
        if (i >= 3) snprintf(names[i], sizeof names[i], "<0x%02X>", i - 3);
        tokens[i] = names[i];
        scores[i] = 0;
        types[i] = i == 0 ? 2 : i < 3 ? 3 : 6;
    }
    assert_int_equal(gguf_w_str(w, "general.architecture", "llama"), KV_OK);
    assert_int_equal(gguf_w_str(w, "tokenizer.ggml.model", "llama"), KV_OK);
    assert_int_equal(gguf_w_arr_str(w, "tokenizer.ggml.tokens", tokens, 259), KV_OK);
    assert_int_equal(gguf_w_arr_f32(w, "tokenizer.ggml.scores", scores, 259), KV_OK);
    assert_int_equal(gguf_w_arr_i32(w, "tokenizer.ggml.token_type", types, 259), KV_OK);
    assert_int_equal(gguf_w_u32(w, "tokenizer.ggml.bos_token_id", 1), KV_OK);
    assert_int_equal(gguf_w_u32(w, "tokenizer.ggml.eos_token_id", 2), KV_OK);
    assert_int_equal(gguf_w_bool(w, "tokenizer.ggml.add_space_prefix", false), KV_OK);
    char err[256];
    assert_int_equal(gguf_writer_save(w, path, err, sizeof err), KV_OK);
    gguf_writer_free(w);
    tokenizer_t *t;
    assert_int_equal(tok_load(path, &t, err, sizeof err), KV_OK);
    remove(path);
    assert_int_equal(tok_n_vocab(t), 259);
    assert_int_equal(tok_bos(t), 1);
    assert_int_equal(tok_eos(t), 2);
    assert_true(tok_add_bos(t));
    assert_true(tok_is_eog(t, 2));
    const char *texts[] = {"Hello world", " leading space", "héllo ½ 日本語 🦙", "a\nb\tc  ", "", "\xff\xfe invalid \xc3"};
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        const char *s = texts[k];
        size_t l = strlen(s);
        int32_t *ids;
        size_t n;
        assert_int_equal(tok_encode(t, s, l, true, true, &ids, &n), KV_OK);
        assert_int_equal(n, l + 1);
        assert_int_equal(ids[0], 1);
        for (size_t i = 0; i < l; i++) assert_int_equal(ids[i + 1], 3 + (unsigned char)s[i]);
        char *dec;
        size_t dl;
        assert_int_equal(tok_decode(t, ids, n, true, &dec, &dl), KV_OK);
        if (kv_utf8_valid(s, l)) {
            assert_int_equal(dl, l);
            assert_memory_equal(dec, s, l);
            assert_true(check_decode_stream(t, s, l, ids, n, true));
        } else {
            assert_true(kv_utf8_valid(dec, dl)); /* invalid bytes become U+FFFD */
            assert_true(check_decode_stream(t, s, l, ids, n, false));
        }
        char b[8];
        assert_int_equal(tok_token_bytes(t, 3 + 0xE6, b, sizeof b), 1);
        assert_int_equal((unsigned char)b[0], 0xE6);
        free(dec);
        free(ids);
    }
    tok_free(t);
}

/* ---- tokenizer.json ids: a gap up to 65536 unused ids loads, a wider one is refused ---- */
static kv_status load_json_text(const char *json, tokenizer_t **t, char *err, size_t errlen) {
    char path[] = "/tmp/kvserve_test_tokXXXXXX.json";
    int fd = mkstemps(path, 5);
    assert_true(fd >= 0);
    size_t len = strlen(json);
    assert_int_equal(write(fd, json, len), (ssize_t)len);
    close(fd);
    kv_status st = tok_load(path, t, err, errlen);
    unlink(path);
    return st;
}

static void test_json_sparse_ids(void **st) {
    (void)st;
    static const char fmt[] =
        "{\"added_tokens\": [{\"id\": %d, \"content\": \"<eos>\", \"special\": true}],"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": %d}, \"merges\": [\"a b\"]}}";
    char json[512], err[256];
    tokenizer_t *t = NULL;
    /* 4 entries (3 in the vocab, 1 added): the largest id may be at most 4 + 65536 - 1 */
    snprintf(json, sizeof json, fmt, 65539, 2);
    assert_int_equal(load_json_text(json, &t, err, sizeof err), KV_OK);
    assert_int_equal(tok_n_vocab(t), 65540);
    int32_t *ids;
    size_t n;
    assert_int_equal(tok_encode(t, "ab<eos>", 7, false, true, &ids, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 65539);
    free(ids);
    tok_free(t);
    t = NULL;
    snprintf(json, sizeof json, fmt, 65540, 2);
    assert_int_equal(load_json_text(json, &t, err, sizeof err), KV_EFORMAT);
    assert_null(t);
    assert_non_null(strstr(err, "sparse"));
    snprintf(json, sizeof json, fmt, 3, 44444263); /* the fuzzer's input: one huge vocab id */
    assert_int_equal(load_json_text(json, &t, err, sizeof err), KV_EFORMAT);
    assert_null(t);
}

/* Malformed ids are refused at load with a message, not left to fail requests later: an added
 * token whose id is a string, a float or missing; an empty vocabulary; a post-processor special
 * token outside the vocabulary. */
static void test_json_bad_ids(void **st) {
    (void)st;
    static const char *const bad[] = {
        "{\"added_tokens\": [{\"id\": \"2\", \"content\": \"<eos>\"}],"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}}",
        "{\"added_tokens\": [{\"id\": 2.0, \"content\": \"<eos>\"}],"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}}",
        "{\"added_tokens\": [{\"content\": \"<eos>\"}],"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}}",
        "{\"added_tokens\": [], \"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []},"
        " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<s>\"}},"
        " {\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<s>\": {\"ids\": [7]}}}}",
    };
    const char *want[] = {"added token 0", "added token 0", "added token 0", "empty", "outside the vocabulary"};
    char err[256];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tokenizer_t *t = NULL;
        err[0] = 0;
        assert_int_equal(load_json_text(bad[i], &t, err, sizeof err), KV_EFORMAT);
        assert_null(t);
        if (!strstr(err, want[i])) fail_msg("case %zu: error '%s' lacks '%s'", i, err, want[i]);
    }
    /* the same post-processor with an id inside the vocabulary loads and prefixes it */
    tokenizer_t *t = NULL;
    const char *ok = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []},"
                     " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<s>\"}},"
                     " {\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<s>\": {\"ids\": [1]}}}}";
    assert_int_equal(load_json_text(ok, &t, err, sizeof err), KV_OK);
    int32_t *ids;
    size_t n;
    assert_int_equal(tok_encode(t, "a", 1, true, false, &ids, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 0);
    free(ids);
    tok_free(t);
}

/* ---- streaming: multi-byte characters split over tokens, special tokens skipped ---- */
static void test_stream_pieces(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_LLAMA3);
    if (!t) skip();
    const char *text = "Hi 🦙 日本語 <|eot_id|> done";
    int32_t *ids;
    size_t n;
    assert_int_equal(tok_encode(t, text, strlen(text), true, true, &ids, &n), KV_OK);
    char *dec;
    assert_int_equal(tok_decode(t, ids, n, true, &dec, NULL), KV_OK);
    assert_string_equal(dec, "Hi 🦙 日本語  done");
    free(dec);
    assert_int_equal(tok_decode(t, ids, n, false, &dec, NULL), KV_OK);
    assert_string_equal(dec, text);
    free(dec);
    assert_true(check_decode_stream(t, "", 0, ids, n, false));
    /* the llama emoji is split over several byte-level tokens: no chunk is partial UTF-8 */
    char b[64];
    int total = 0;
    for (size_t i = 0; i < n; i++) {
        int l = tok_token_bytes(t, ids[i], b, sizeof b);
        assert_true(l >= 0);
        total += l;
    }
    assert_int_equal(total, (int)strlen(text));
    assert_int_equal(tok_decode(t, (int32_t[]){tok_n_vocab(t)}, 1, true, &dec, NULL), KV_EINVAL);
    free(ids);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stories_gguf),     cmocka_unit_test(test_stories_hf),
        cmocka_unit_test(test_vec_llama_spm),    cmocka_unit_test(test_vec_gpt2),
        cmocka_unit_test(test_vec_deepseek_coder), cmocka_unit_test(test_vec_llama_bpe),
        cmocka_unit_test(test_vec_qwen2),        cmocka_unit_test(test_vec_falcon),
        cmocka_unit_test(test_vec_mpt),          cmocka_unit_test(test_vec_phi3),
        cmocka_unit_test(test_vec_refact),       cmocka_unit_test(test_vec_starcoder),
        cmocka_unit_test(test_load_gpt_neox),    cmocka_unit_test(test_load_baichuan),
              cmocka_unit_test(test_wap_qwen3),
        cmocka_unit_test(test_wap_llama3),       cmocka_unit_test(test_wap_mistral),
        cmocka_unit_test(test_wap_gpt2),         cmocka_unit_test(test_wap_llama2),
        cmocka_unit_test(test_chat_qwen3),       cmocka_unit_test(test_chat_llama3),
        cmocka_unit_test(test_chat_stories),     cmocka_unit_test(test_chat_errors),
        cmocka_unit_test(test_byte_vocab),       cmocka_unit_test(test_stream_pieces),
        cmocka_unit_test(test_json_sparse_ids),
        cmocka_unit_test(test_json_bad_ids),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < T_N; i++) tok_free(g_tok[i]);
    return rc;
}
