/* Prefix token cache tests: ids byte-identical to tok_encode on every turn of real multi-turn
 * conversations (MT-Bench, hh-rlhf) with the Llama-3, Qwen3 and Mistral tokenizers and the
 * stories260K GGUF; forced resync failures; 8 threads on one cache; eviction bounds, LRU order,
 * repeats, bypass, option keys, setting validation. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "tokenizer/prefix_cache.h"
#include "tokenizer/tokenizer.h"

/* ---- tokenizers, loaded once ---- */
enum { T_LLAMA3, T_QWEN3, T_MISTRAL, T_STORIES, T_N };
static const char *k_tok_paths[T_N] = {"tokenizers/llama3/tokenizer.json",
                                       "tokenizers/qwen3/tokenizer.json",
                                       "tokenizers/mistral/tokenizer.json",
                                       "models/stories260K/stories260K.gguf"};
static tokenizer_t *g_tok[T_N];
static bool g_tried[T_N];

static tokenizer_t *get_tok(int which) {
    if (!g_tried[which]) {
        g_tried[which] = true;
        char p[1024];
        if (!test_data_path(p, sizeof p, k_tok_paths[which])) return NULL;
        char err[512] = "";
        kv_status st = tok_load(p, &g_tok[which], err, sizeof err);
        if (st) fprintf(stderr, "load %s: %s\n", p, err);
        assert_int_equal(st, KV_OK);
    }
    return g_tok[which];
}

/* ---- growable string vector ---- */
struct strv {
    char **v;
    size_t *len;
    size_t n, cap;
};
static void strv_push(struct strv *s, const char *p, size_t n) {
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->v = realloc(s->v, s->cap * sizeof *s->v);
        s->len = realloc(s->len, s->cap * sizeof *s->len);
        assert_non_null(s->v);
        assert_non_null(s->len);
    }
    s->v[s->n] = malloc(n + 1);
    assert_non_null(s->v[s->n]);
    memcpy(s->v[s->n], p, n);
    s->v[s->n][n] = 0;
    s->len[s->n++] = n;
}
static void strv_free(struct strv *s) {
    for (size_t i = 0; i < s->n; i++) free(s->v[i]);
    free(s->v);
    free(s->len);
    memset(s, 0, sizeof *s);
}

/* ---- datasets ---- */
static struct strv g_mt;      /* MT-Bench: 2 turns per question, flattened q0t0 q0t1 q1t0 ... */
static bool g_mt_tried;
static struct strv g_hh;      /* hh-rlhf "chosen" dialogues */
static bool g_hh_tried;

static bool load_mt(void) {
    if (g_mt_tried) return g_mt.n > 0;
    g_mt_tried = true;
    char p[1024];
    if (!test_data_path(p, sizeof p, "datasets/fastchat_mt_bench_question.jsonl")) return false;
    FILE *f = fopen(p, "rb");
    assert_non_null(f);
    char line[65536];
    while (fgets(line, sizeof line, f)) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        assert_non_null(o);
        json_t *turns = json_object_get(o, "turns");
        assert_int_equal(json_array_size(turns), 2);
        for (size_t i = 0; i < 2; i++) {
            json_t *s = json_array_get(turns, i);
            strv_push(&g_mt, json_string_value(s), json_string_length(s));
        }
        json_decref(o);
    }
    fclose(f);
    assert_int_equal(g_mt.n, 160);
    return true;
}

static bool load_hh(void) {
    if (g_hh_tried) return g_hh.n > 0;
    g_hh_tried = true;
    char p[1024];
    if (!test_data_path(p, sizeof p, "datasets/hh-rlhf-harmless-base-test.jsonl.gz")) return false;
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "gzip -dc '%s'", p);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t cap = 1 << 20;
    char *line = malloc(cap);
    assert_non_null(line);
    while (fgets(line, (int)cap, f)) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        assert_non_null(o);
        json_t *s = json_object_get(o, "chosen");
        strv_push(&g_hh, json_string_value(s), json_string_length(s));
        json_decref(o);
    }
    free(line);
    assert_int_equal(pclose(f), 0);
    assert_true(g_hh.n > 2000);
    return true;
}

/* ---- chat renderings written by the test (the formats' published text) ---- */
enum fmt { F_LLAMA3, F_CHATML, F_MISTRAL };
static void render(enum fmt f, char **msgs, size_t n, kv_buf *b) {
    b->len = 0;
    if (f == F_LLAMA3) kv_buf_puts(b, "<|begin_of_text|>");
    if (f == F_MISTRAL) kv_buf_puts(b, "<s>");
    for (size_t i = 0; i < n; i++) {
        bool user = i % 2 == 0;
        if (f == F_LLAMA3)
            kv_buf_printf(b, "<|start_header_id|>%s<|end_header_id|>\n\n%s<|eot_id|>",
                          user ? "user" : "assistant", msgs[i]);
        else if (f == F_CHATML)
            kv_buf_printf(b, "<|im_start|>%s\n%s<|im_end|>\n", user ? "user" : "assistant", msgs[i]);
        else if (user)
            kv_buf_printf(b, "[INST] %s [/INST]", msgs[i]);
        else
            kv_buf_printf(b, "%s</s>", msgs[i]);
    }
    if (f == F_LLAMA3) kv_buf_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    if (f == F_CHATML) kv_buf_puts(b, "<|im_start|>assistant\n");
}

/* Growing prompts of conversations: after every user turn. */
static void add_chat_prompts(struct strv *out, enum fmt f, char **msgs, size_t n) {
    kv_buf b;
    kv_buf_init(&b);
    for (size_t k = 1; k <= n; k += 2) {
        render(f, msgs, k, &b);
        strv_push(out, b.data, b.len);
    }
    kv_buf_free(&b);
}

/* Growing prompts of a raw hh-rlhf dialogue: cut after every "\n\nAssistant:", then whole. */
static void add_hh_prompts(struct strv *out, const char *d, size_t n, const char *prefix,
                           size_t prefix_len) {
    kv_buf b;
    kv_buf_init(&b);
    const char *mk = "\n\nAssistant:";
    for (const char *p = d; (p = strstr(p, mk)); p += strlen(mk)) {
        b.len = 0;
        kv_buf_append(&b, prefix, prefix_len);
        kv_buf_append(&b, d, (size_t)(p - d) + strlen(mk));
        strv_push(out, b.data, b.len);
    }
    b.len = 0;
    kv_buf_append(&b, prefix, prefix_len);
    kv_buf_append(&b, d, n);
    strv_push(out, b.data, b.len);
    kv_buf_free(&b);
}

/* ---- checks ---- */
static bool same_ids(const int32_t *a, size_t na, const int32_t *b, size_t nb, const char *what,
                     size_t idx) {
    if (na == nb && memcmp(a, b, na * sizeof *a) == 0) return true;
    size_t i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    fprintf(stderr, "MISMATCH %s prompt %zu: cached %zu ids, full %zu ids, first difference at %zu\n",
            what, idx, na, nb, i);
    return false;
}

/* Encodes every prompt through the cache and in full; all must match. */
static void replay(const tokenizer_t *t, prefix_cache_t *pc, const struct strv *ps, bool as,
                   bool parse, const char *what) {
    for (size_t i = 0; i < ps->n; i++) {
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        assert_int_equal(prefix_cache_encode(pc, ps->v[i], ps->len[i], as, parse, &a, &na), KV_OK);
        assert_int_equal(tok_encode(t, ps->v[i], ps->len[i], as, parse, &b, &nb), KV_OK);
        assert_true(same_ids(a, na, b, nb, what, i));
        free(a);
        free(b);
    }
}

static prefix_cache_t *make_cache(const tokenizer_t *t, const struct prefix_cache_config *c) {
    prefix_cache_t *pc = NULL;
    char err[256] = "";
    kv_status st = prefix_cache_new(t, c, &pc, err, sizeof err);
    if (st) fprintf(stderr, "prefix_cache_new: %s\n", err);
    assert_int_equal(st, KV_OK);
    return pc;
}

static void small_config(struct prefix_cache_config *c) {
    prefix_cache_config_default(c);
    c->min_bytes = 0;
    c->bucket_bytes = 32;
    c->overlap_tokens = 16;
    c->resync_tokens = 8;
}

static void print_stats(const char *what, prefix_cache_t *pc) {
    struct prefix_cache_stats s;
    prefix_cache_get_stats(pc, &s);
    fprintf(stderr, "  %-28s hits %4llu misses %4llu resync_failures %llu entries %llu inserts %llu "
                    "evictions %llu\n",
            what, (unsigned long long)s.hits, (unsigned long long)s.misses,
            (unsigned long long)s.resync_failures, (unsigned long long)s.entries,
            (unsigned long long)s.inserts, (unsigned long long)s.evictions);
}

/* MT-Bench, every conversation replayed as growing prompts (small settings so that the
 * 2-turn prompts use the cache), then all questions as one long conversation with the default
 * settings (the assistant's replies are other questions' text). */
static void mt_bench(int which, enum fmt f, bool as) {
    tokenizer_t *t = get_tok(which);
    if (!t || !load_mt()) {
        skip();
        return;
    }
    struct strv ps = {0};
    for (size_t q = 0; q < 80; q++) {
        char *msgs[3] = {g_mt.v[2 * q], g_mt.v[(2 * q + 81) % 160], g_mt.v[2 * q + 1]};
        add_chat_prompts(&ps, f, msgs, 3);
    }
    struct prefix_cache_config c;
    small_config(&c);
    prefix_cache_t *pc = make_cache(t, &c);
    replay(t, pc, &ps, as, true, "mt-bench (per question)");
    struct prefix_cache_stats s;
    prefix_cache_get_stats(pc, &s);
    print_stats("mt-bench per question", pc);
    assert_int_equal(s.hits + s.misses, ps.n);
    assert_true(s.hits >= 60); /* most second turns extend their first */
    prefix_cache_free(pc);
    /* the spec's split (any token boundary), guarded by the resync check alone */
    c.strict_split = false;
    pc = make_cache(t, &c);
    replay(t, pc, &ps, as, true, "mt-bench (non-strict split)");
    print_stats("mt-bench non-strict split", pc);
    prefix_cache_get_stats(pc, &s);
    assert_true(s.hits >= 60);
    prefix_cache_free(pc);
    strv_free(&ps);

    /* one long conversation, default settings */
    char *msgs[320];
    for (size_t i = 0; i < 160; i++) {
        msgs[2 * i] = g_mt.v[i];
        msgs[2 * i + 1] = g_mt.v[(i + 37) % 160];
    }
    add_chat_prompts(&ps, f, msgs, 319);
    prefix_cache_config_default(&c);
    pc = make_cache(t, &c);
    replay(t, pc, &ps, as, true, "mt-bench (one conversation)");
    prefix_cache_get_stats(pc, &s);
    print_stats("mt-bench one conversation", pc);
    assert_true(s.hits >= ps.n * 3 / 4);
    prefix_cache_free(pc);
    strv_free(&ps);
}

static void test_mt_llama3(void **st) { (void)st; mt_bench(T_LLAMA3, F_LLAMA3, true); }
static void test_mt_qwen3(void **st) { (void)st; mt_bench(T_QWEN3, F_CHATML, true); }
static void test_mt_mistral(void **st) { (void)st; mt_bench(T_MISTRAL, F_MISTRAL, true); }
static void test_mt_stories(void **st) { (void)st; mt_bench(T_STORIES, F_CHATML, true); }

/* hh-rlhf dialogues as raw "\n\nHuman: ... \n\nAssistant: ..." text, growing per turn: a
 * subset of dialogues each on its own (small settings), and a run of dialogues concatenated
 * into one long history (default settings). Both option settings of add_special. */
static void hh(int which) {
    tokenizer_t *t = get_tok(which);
    if (!t || !load_hh()) {
        skip();
        return;
    }
    struct strv ps = {0};
    for (size_t d = 0; d < g_hh.n; d += 8) add_hh_prompts(&ps, g_hh.v[d], g_hh.len[d], "", 0);
    struct prefix_cache_config c;
    small_config(&c);
    prefix_cache_t *pc = make_cache(t, &c);
    replay(t, pc, &ps, true, false, "hh-rlhf (per dialogue, BOS)");
    replay(t, pc, &ps, false, true, "hh-rlhf (per dialogue, no BOS)");
    struct prefix_cache_stats s;
    prefix_cache_get_stats(pc, &s);
    print_stats("hh per dialogue", pc);
    assert_true(s.hits > ps.n / 2);
    prefix_cache_free(pc);
    strv_free(&ps);

    /* long history: dialogues 1000.. appended one after another */
    kv_buf hist;
    kv_buf_init(&hist);
    prefix_cache_config_default(&c);
    pc = make_cache(t, &c);
    for (size_t d = 1000; d < 1060; d++) {
        add_hh_prompts(&ps, g_hh.v[d], g_hh.len[d], hist.data ? hist.data : "", hist.len);
        kv_buf_append(&hist, g_hh.v[d], g_hh.len[d]);
    }
    replay(t, pc, &ps, true, false, "hh-rlhf (long history)");
    prefix_cache_get_stats(pc, &s);
    print_stats("hh long history", pc);
    assert_true(s.hits >= ps.n * 3 / 4);
    kv_buf_free(&hist);
    prefix_cache_free(pc);
    strv_free(&ps);
}

static void test_hh_llama3(void **st) { (void)st; hh(T_LLAMA3); }
static void test_hh_qwen3(void **st) { (void)st; hh(T_QWEN3); }
static void test_hh_mistral(void **st) { (void)st; hh(T_MISTRAL); }
static void test_hh_stories(void **st) { (void)st; hh(T_STORIES); }

/* ---- forced resync failure ----
 * In '--"I' the quote belongs to the punctuation pre-token, but a tail that starts at the
 * quote makes '"I' one pre-token: a split point there (possible with strict_split = false)
 * re-tokenizes differently, the resync check rejects the splice, and the result is still the
 * full tokenization. The test finds the split point by tokenizing, it does not assume ids. */
static void test_resync_failure(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_LLAMA3);
    if (!t || !load_hh()) {
        skip();
        return;
    }
    const char *filler = g_hh.v[3];
    size_t flen = g_hh.len[3] < 300 ? g_hh.len[3] : 300;
    while (flen && ((unsigned char)filler[flen] & 0xC0) == 0x80) flen--;
    const char *after = " conversation--\"I often think how the story goes on with many more words "
                        "so that the cache has a long enough stretch of tokens after the split "
                        "point to back off from, which is what this test needs.";
    kv_buf P;
    kv_buf_init(&P);
    bool found = false;
    size_t split = 0, nbody = 0;
    const int32_t resync = 4;
    kv_buf_append(&P, filler, flen);
    kv_buf_puts(&P, after);
    int32_t *ids;
    size_t n;
    assert_int_equal(tok_encode(t, P.data, P.len, false, false, &ids, &n), KV_OK);
    size_t c = 0;
    char buf[512];
    for (size_t i = 0; i < n && !found; i++) {
        if (c > flen && c < flen + 40) {
            int32_t *tail;
            size_t nt;
            assert_int_equal(tok_encode(t, P.data + c, P.len - c, false, false, &tail, &nt), KV_OK);
            if (nt >= (size_t)resync && n - i >= (size_t)resync &&
                memcmp(tail, ids + i, resync * sizeof *ids) != 0) {
                found = true;
                split = i;
                nbody = n;
            }
            free(tail);
        }
        c += (size_t)tok_token_bytes(t, ids[i], buf, sizeof buf);
    }
    free(ids);
    assert_true(found);
    kv_buf T;
    kv_buf_init(&T);
    kv_buf_append(&T, P.data, P.len);
    kv_buf_puts(&T, " And one more sentence follows here.");
    for (int strict = 0; strict < 2; strict++) {
        struct prefix_cache_config cf;
        small_config(&cf);
        cf.strict_split = strict;
        cf.overlap_tokens = nbody - split; /* lands the split inside the run of spaces */
        cf.resync_tokens = resync;
        prefix_cache_t *pc = make_cache(t, &cf);
        struct strv ps = {0};
        strv_push(&ps, P.data, P.len);
        strv_push(&ps, T.data, T.len);
        replay(t, pc, &ps, false, false, strict ? "resync (strict)" : "resync (forced)");
        struct prefix_cache_stats s;
        prefix_cache_get_stats(pc, &s);
        print_stats(strict ? "strict split" : "forced resync failure", pc);
        if (!strict) {
            assert_int_equal(s.resync_failures, 1);
            assert_int_equal(s.hits, 0);
            assert_int_equal(s.misses, 2);
        } else { /* the word-start split before the run re-synchronizes */
            assert_int_equal(s.resync_failures, 0);
            assert_int_equal(s.hits, 1);
        }
        prefix_cache_free(pc);
        strv_free(&ps);
    }
    kv_buf_free(&P);
    kv_buf_free(&T);
}

/* ---- 8 threads, one cache ---- */
struct thr {
    const tokenizer_t *t;
    prefix_cache_t *pc;
    const struct strv *ps;
    int32_t **ref;
    size_t *nref;
    size_t first, step;
    int bad;
};

static void *thr_main(void *arg) {
    struct thr *a = arg;
    for (int round = 0; round < 2; round++)
        for (size_t i = a->first; i < a->ps->n; i += a->step) {
            int32_t *ids;
            size_t n;
            if (prefix_cache_encode(a->pc, a->ps->v[i], a->ps->len[i], true, true, &ids, &n)) {
                a->bad++;
                continue;
            }
            if (n != a->nref[i] || memcmp(ids, a->ref[i], n * sizeof *ids)) a->bad++;
            free(ids);
        }
    return NULL;
}

static void test_threads(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_LLAMA3);
    if (!t || !load_hh()) {
        skip();
        return;
    }
    struct strv ps = {0};
    for (size_t d = 0; d < 48; d++) add_hh_prompts(&ps, g_hh.v[d * 3], g_hh.len[d * 3], "", 0);
    int32_t **ref = calloc(ps.n, sizeof *ref);
    size_t *nref = calloc(ps.n, sizeof *nref);
    for (size_t i = 0; i < ps.n; i++)
        assert_int_equal(tok_encode(t, ps.v[i], ps.len[i], true, true, &ref[i], &nref[i]), KV_OK);
    struct prefix_cache_config c;
    small_config(&c);
    c.max_entries = 64; /* evictions happen while other threads use entries */
    prefix_cache_t *pc = make_cache(t, &c);
    pthread_t th[8];
    struct thr a[8];
    for (int k = 0; k < 8; k++) {
        /* threads walk the same prompts in different orders and strides: shared prefixes */
        a[k] = (struct thr){t, pc, &ps, ref, nref, (size_t)k % 3, 1 + (size_t)k % 2, 0};
        assert_int_equal(pthread_create(&th[k], NULL, thr_main, &a[k]), 0);
    }
    for (int k = 0; k < 8; k++) {
        pthread_join(th[k], NULL);
        assert_int_equal(a[k].bad, 0);
    }
    struct prefix_cache_stats s;
    prefix_cache_get_stats(pc, &s);
    print_stats("8 threads", pc);
    assert_true(s.hits > 0);
    assert_true(s.entries <= 64);
    assert_int_equal(s.errors, 0);
    prefix_cache_free(pc);
    for (size_t i = 0; i < ps.n; i++) free(ref[i]);
    free(ref);
    free(nref);
    strv_free(&ps);
}

/* ---- bounds, LRU, repeats, bypass, keys ---- */

/* n distinct prompts of about len bytes each (hh text, distinct first bytes). */
static void distinct_prompts(struct strv *out, size_t n, size_t len) {
    kv_buf b;
    kv_buf_init(&b);
    for (size_t i = 0; i < n; i++) {
        b.len = 0;
        kv_buf_printf(&b, "Story number %zu. ", i);
        for (size_t d = 10 + i; b.len < len; d++) kv_buf_append(&b, g_hh.v[d], g_hh.len[d]);
        strv_push(out, b.data, b.len);
    }
    kv_buf_free(&b);
}

static void encode_ok(const tokenizer_t *t, prefix_cache_t *pc, const char *s, size_t n) {
    struct strv one = {0};
    strv_push(&one, s, n);
    replay(t, pc, &one, true, false, "single");
    strv_free(&one);
}

static void stats(prefix_cache_t *pc, struct prefix_cache_stats *s) { prefix_cache_get_stats(pc, s); }

static void test_lru_entries(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_STORIES);
    if (!t || !load_hh()) {
        skip();
        return;
    }
    struct strv ps = {0};
    distinct_prompts(&ps, 5, 1500);
    struct prefix_cache_config c;
    small_config(&c);
    c.max_entries = 3;
    prefix_cache_t *pc = make_cache(t, &c);
    struct prefix_cache_stats s;
    for (int i = 0; i < 3; i++) encode_ok(t, pc, ps.v[i], ps.len[i]); /* A B C */
    stats(pc, &s);
    assert_int_equal(s.entries, 3);
    assert_int_equal(s.misses, 3);
    encode_ok(t, pc, ps.v[0], ps.len[0]); /* A hit -> MRU; LRU is now B */
    stats(pc, &s);
    assert_int_equal(s.hits, 1);
    encode_ok(t, pc, ps.v[3], ps.len[3]); /* D evicts B */
    stats(pc, &s);
    assert_int_equal(s.entries, 3);
    assert_int_equal(s.evictions, 1);
    encode_ok(t, pc, ps.v[0], ps.len[0]); /* A still there */
    encode_ok(t, pc, ps.v[2], ps.len[2]); /* C still there */
    stats(pc, &s);
    assert_int_equal(s.hits, 3);
    assert_int_equal(s.misses, 4);
    encode_ok(t, pc, ps.v[1], ps.len[1]); /* B was evicted: a miss; evicts D (LRU) */
    stats(pc, &s);
    assert_int_equal(s.misses, 5);
    assert_int_equal(s.evictions, 2);
    encode_ok(t, pc, ps.v[3], ps.len[3]); /* D gone */
    stats(pc, &s);
    assert_int_equal(s.misses, 6);
    assert_int_equal(s.entries, 3);
    prefix_cache_free(pc);
    strv_free(&ps);
}

static void test_bytes_bound(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_STORIES);
    if (!t || !load_hh()) {
        skip();
        return;
    }
    struct strv ps = {0};
    distinct_prompts(&ps, 6, 2000);
    size_t maxlen = 0;
    for (size_t i = 0; i < ps.n; i++) { /* all about 2000 bytes: room for two */
        while (ps.len[i] > 2000 || ((unsigned char)ps.v[i][ps.len[i]] & 0xC0) == 0x80) ps.len[i]--;
        maxlen = ps.len[i] > maxlen ? ps.len[i] : maxlen;
    }
    struct prefix_cache_config c;
    small_config(&c);
    c.max_entries = 100;
    c.max_total_bytes = maxlen * 5 / 2; /* room for two */
    prefix_cache_t *pc = make_cache(t, &c);
    struct prefix_cache_stats s;
    for (size_t i = 0; i < ps.n; i++) {
        encode_ok(t, pc, ps.v[i], ps.len[i]);
        stats(pc, &s);
        assert_true(s.total_bytes <= c.max_total_bytes);
        assert_int_equal(s.entries, i + 1 < 2 ? i + 1 : 2);
    }
    stats(pc, &s);
    assert_int_equal(s.total_bytes, ps.len[4] + ps.len[5]);
    assert_int_equal(s.evictions, 4);
    /* a prompt larger than the whole budget is answered, never stored */
    c.max_total_bytes = ps.len[0] - 1;
    prefix_cache_t *pc2 = make_cache(t, &c);
    encode_ok(t, pc2, ps.v[0], ps.len[0]);
    stats(pc2, &s);
    assert_int_equal(s.entries, 0);
    assert_int_equal(s.misses, 1);
    prefix_cache_free(pc2);
    prefix_cache_free(pc);
    strv_free(&ps);
}

static void test_repeat_once_and_bypass(void **st) {
    (void)st;
    tokenizer_t *t = get_tok(T_LLAMA3);
    if (!t || !load_hh()) {
        skip();
        return;
    }
    struct strv ps = {0};
    distinct_prompts(&ps, 1, 6000);
    struct prefix_cache_config c;
    prefix_cache_config_default(&c);
    prefix_cache_t *pc = make_cache(t, &c);
    struct prefix_cache_stats s;
    for (int k = 0; k < 3; k++) encode_ok(t, pc, ps.v[0], ps.len[0]);
    stats(pc, &s);
    assert_int_equal(s.inserts, 1);
    assert_int_equal(s.entries, 1);
    assert_int_equal(s.misses, 1);
    assert_int_equal(s.hits, 2);
    /* shorter than min_bytes (4096): plain tokenization, counters untouched */
    struct prefix_cache_stats before = s;
    encode_ok(t, pc, ps.v[0], 4000);
    encode_ok(t, pc, ps.v[0], 100);
    stats(pc, &s);
    assert_memory_equal(&s, &before, sizeof s);
    /* every option combination is its own key: ids match, one entry each */
    for (int as = 0; as < 2; as++)
        for (int pspec = 0; pspec < 2; pspec++) {
            struct strv one = {0};
            kv_buf b;
            kv_buf_init(&b);
            kv_buf_puts(&b, "<|begin_of_text|>");
            kv_buf_append(&b, ps.v[0], ps.len[0]);
            strv_push(&one, b.data, b.len);
            kv_buf_free(&b);
            replay(t, pc, &one, as, pspec, "options");
            replay(t, pc, &one, as, pspec, "options (repeat)");
            strv_free(&one);
        }
    stats(pc, &s);
    assert_int_equal(s.entries, 5);
    assert_int_equal(s.hits, 2 + 4);
    prefix_cache_free(pc);
    strv_free(&ps);
}

static void test_config(void **st) {
    (void)st;
    struct prefix_cache_config c;
    char err[256];
    prefix_cache_config_default(&c);
    assert_int_equal(c.max_entries, 512);
    assert_int_equal(c.max_total_bytes, 64u << 20);
    assert_int_equal(c.overlap_tokens, 64);
    assert_int_equal(c.resync_tokens, 32);
    assert_int_equal(c.min_bytes, 4096);
    assert_int_equal(c.bucket_bytes, 2048);
    assert_int_equal(prefix_cache_config_validate(&c, err, sizeof err), KV_OK);
    struct {
        size_t *field;
        size_t value;
        const char *word;
    } bad[] = {
        {&c.max_entries, 0, "entries"},   {&c.max_total_bytes, 0, "max-chars"},
        {&c.overlap_tokens, 0, "overlap"}, {&c.resync_tokens, 0, "resync"},
        {&c.resync_tokens, 65, "resync"}, {&c.bucket_bytes, 0, "bucket"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        prefix_cache_config_default(&c);
        *bad[i].field = bad[i].value;
        err[0] = 0;
        assert_int_equal(prefix_cache_config_validate(&c, err, sizeof err), KV_EINVAL);
        assert_non_null(strstr(err, bad[i].word));
        tokenizer_t *t = get_tok(T_STORIES);
        if (t) {
            prefix_cache_t *pc = NULL;
            assert_int_equal(prefix_cache_new(t, &c, &pc, err, sizeof err), KV_EINVAL);
            assert_null(pc);
        }
    }
    prefix_cache_config_default(&c);
    c.min_bytes = 0; /* zero is allowed for min_bytes only */
    assert_int_equal(prefix_cache_config_validate(&c, err, sizeof err), KV_OK);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config),         cmocka_unit_test(test_resync_failure),
        cmocka_unit_test(test_mt_llama3),      cmocka_unit_test(test_mt_qwen3),
        cmocka_unit_test(test_mt_mistral),     cmocka_unit_test(test_mt_stories),
        cmocka_unit_test(test_hh_llama3),      cmocka_unit_test(test_hh_qwen3),
        cmocka_unit_test(test_hh_mistral),     cmocka_unit_test(test_hh_stories),
        cmocka_unit_test(test_threads),        cmocka_unit_test(test_lru_entries),
        cmocka_unit_test(test_bytes_bound),    cmocka_unit_test(test_repeat_once_and_bypass),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < T_N; i++) tok_free(g_tok[i]);
    strv_free(&g_mt);
    strv_free(&g_hh);
    return rc;
}
