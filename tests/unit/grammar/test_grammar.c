/*
 * Constrained-decoding engine tests (src/grammar/):
 *  - regexes (fixed and random) against PCRE2: full-match decisions agree on random strings,
 *    and every string sampled from our grammar matches;
 *  - masks: the trie walk's bitset equals, token by token, what advancing a copy of the
 *    matcher by that token decides (byte vocabularies and real tokenizers);
 *  - JSON schemas (fixed and random): every sampled output parses and validates with an
 *    independent validator (tests/schema_check.h); unsupported keywords are refused by name;
 *  - GBNF grammars, choices, UTF-8 classes split across tokens, end-of-generation handling.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "grammar/gram_internal.h"
#include "grammar_gen.h"
#include "schema_check.h"
#include "test_util.h"

/* ---------------------------------------------------------------- helpers */

static bool full_match(gram_t *g, const gram_vocab_t *v, const char *s, size_t n) {
    gram_matcher_t *m = gram_matcher_new(g, v);
    assert_non_null(m);
    bool ok = gram_matcher_accept_bytes(m, s, n) && gram_matcher_is_complete(m);
    gram_matcher_free(m);
    return ok;
}

/* A vocabulary of single bytes 0x01..0xFF plus extra multi-byte tokens; EOS = last id. */
static gram_vocab_t *byte_vocab(const char *const *extra, int n_extra, int *eos) {
    int n = 256 + n_extra + 1;
    const char **b = calloc((size_t)n, sizeof *b);
    int *l = calloc((size_t)n, sizeof *l);
    static char bytes[256];
    for (int i = 1; i < 256; i++) {
        bytes[i] = (char)i;
        b[i] = &bytes[i];
        l[i] = 1;
    }
    for (int i = 0; i < n_extra; i++) {
        b[256 + i] = extra[i];
        l[256 + i] = (int)strlen(extra[i]);
    }
    *eos = n - 1;
    int32_t e = n - 1;
    gram_vocab_t *v = gram_vocab_new_bytes(b, l, n, &e, 1);
    free(b);
    free(l);
    assert_non_null(v);
    return v;
}

static const char *const JSON_TOKENS[] = {
    "\"", "\",", "\":", "\": ", "{\"", "\"}", "[", "]", "{}", "[]", "true", "false", "null",
    "12", "0.5", "-3", "e+1", ", ", ",\n  ", "ab", "hello", " world", "é", "日本", "\\n", "\\u00e9",
    "\\\"", "2024-", "-01-", "T12:", ":00Z", "abc-", "0123", "4567", "89ab", "cdef",
};

/* Samples one output by a random walk over the masks (a token whose bytes hold a structural
 * character is 20x more likely, so walks end). Returns true if it ended complete; *out has
 * the bytes. Asserts that no state is a dead end. */
static bool sample(gram_t *g, const gram_vocab_t *v, int eos, struct rng *r, int max_steps, char *out,
                   size_t cap, size_t *out_len) {
    gram_matcher_t *m = gram_matcher_new(g, v);
    assert_non_null(m);
    size_t n = 0;
    int nv = gram_vocab_size(v);
    int32_t *ids = malloc((size_t)nv * sizeof *ids);
    double *w = malloc((size_t)nv * sizeof *w);
    bool done = false;
    for (int step = 0; step < max_steps && !done; step++) {
        if (gram_matcher_is_final(m)) {
            done = true;
            break;
        }
        int na = 0;
        const uint64_t *mask = gram_matcher_mask(m, &na);
        assert_non_null(mask);
        int k = 0;
        double tot = 0;
        for (int i = 0; i < nv; i++)
            if ((mask[i >> 6] >> (i & 63)) & 1) {
                int tl;
                const char *tb = gram_vocab_token(v, i, &tl);
                double wi = 1.0;
                for (int j = 0; j < tl; j++)
                    if (strchr("\"]},:0123456789", tb[j])) wi = 20.0;
                if (i == eos) wi = 50.0;
                ids[k] = i;
                w[k++] = wi;
                tot += wi;
            }
        assert_int_equal(k, na);
        if (k == 0) {
            fprintf(stderr, "dead end after %zu bytes: %.*s\n", n, (int)n, out);
            fail();
        }
        double u = (double)(rnext(r) >> 11) / 9007199254740992.0 * tot, acc = 0;
        int pick = ids[k - 1];
        for (int j = 0; j < k; j++) {
            acc += w[j];
            if (u < acc) {
                pick = ids[j];
                break;
            }
        }
        assert_true(gram_matcher_accept(m, pick));
        if (pick == eos) {
            done = true;
            break;
        }
        int tl;
        const char *tb = gram_vocab_token(v, pick, &tl);
        if (n + (size_t)tl < cap) {
            memcpy(out + n, tb, (size_t)tl);
            n += (size_t)tl;
        }
    }
    if (!done && gram_matcher_is_final(m)) done = true;
    out[n] = 0;
    *out_len = n;
    free(ids);
    free(w);
    gram_matcher_free(m);
    return done;
}

/* ---------------------------------------------------------------- regex vs PCRE2 */

static const char *const ALPHA[] = {"a", "b", "c", "\n", "\xc3\xa9" /* é */, "\xe2\x82\xac" /* € */, "-", "1"};

static void random_string(struct rng *r, char *buf, size_t *n) {
    int len = rint_(r, 8);
    size_t o = 0;
    for (int i = 0; i < len; i++) {
        const char *a = ALPHA[rint_(r, 8)];
        memcpy(buf + o, a, strlen(a));
        o += strlen(a);
    }
    buf[o] = 0;
    *n = o;
}

static void check_regex(const char *re, struct rng *r, gram_vocab_t *v, int eos, int n_strings) {
    gram_t *g = NULL;
    char err[256];
    kv_status st = gram_compile_regex(re, strlen(re), &g, err, sizeof err);
    if (st) {
        fprintf(stderr, "regex %s: %s\n", re, err);
        fail();
    }
    char buf[256];
    size_t n;
    for (int i = 0; i < n_strings; i++) {
        random_string(r, buf, &n);
        int want = sc_pcre_match(re, strlen(re), buf, n, true);
        if (want < 0) {
            fprintf(stderr, "pcre2 cannot compile /%s/\n", re);
            fail();
        }
        bool got = full_match(g, v, buf, n);
        if (got != (want == 1)) {
            fprintf(stderr, "regex /%s/ on \"%s\": pcre2 %d, ours %d\n", re, buf, want, got);
            fail();
        }
    }
    char out[2048];
    for (int i = 0; i < 8; i++) {
        if (!sample(g, v, eos, r, 200, out, sizeof out, &n)) continue;
        if (sc_pcre_match(re, strlen(re), out, n, true) != 1) {
            fprintf(stderr, "regex /%s/ sampled \"%s\" which pcre2 rejects\n", re, out);
            fail();
        }
    }
    gram_unref(g);
}

static void test_regex_fixed(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(JSON_TOKENS, (int)(sizeof JSON_TOKENS / sizeof *JSON_TOKENS), &eos);
    struct rng r = {0x1234};
    static const char *const res[] = {
        "a", "abc", "a|b|c", "a*", "(ab)+", "a?b?c?", "[a-c]{2,3}", "[^a]*", ".*", "a.c",
        "(a|b)*c", "\\d+", "\\D\\w?\\s*", "[\\d\\-]+", "(a?)*", "(a*)*b", "(a|)+", "((a|b)c?){1,3}",
        "\xc3\xa9+", "[\xc3\xa9\xe2\x82\xac]{2}", "[^\xc3\xa9]+", "^a+$", "(?:a|b)c", "(?P<x>a)b",
        "a{0}", "a{2,}", "[a\\n]+", "\\u00e9", "\\x61+", "[a-]*", "-?1+", "(a|b|)(c|)",
    };
    for (size_t i = 0; i < sizeof res / sizeof *res; i++) check_regex(res[i], &r, v, eos, 200);
    gram_vocab_free(v);
}

static void test_regex_random(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(JSON_TOKENS, (int)(sizeof JSON_TOKENS / sizeof *JSON_TOKENS), &eos);
    struct rng r = {0xC0FFEE};
    for (int i = 0; i < 150; i++) {
        char re[1024];
        gen_regex(&r, 4, re, sizeof re);
        check_regex(re, &r, v, eos, 60);
    }
    gram_vocab_free(v);
}

static void test_regex_refused(void **st) {
    (void)st;
    /* nested repetitions are lowered once per level (not multiplied out): these compile */
    static const char *const big[] = {"((a{10000}){10000}){10000}", "((a|b){0,100}){0,100}", "(((x?){0,9999})*)+"};
    for (size_t i = 0; i < sizeof big / sizeof *big; i++) {
        gram_t *g = NULL;
        char err[256] = "";
        if (gram_compile_regex(big[i], strlen(big[i]), &g, err, sizeof err)) fail_msg("%s: %s", big[i], err);
        assert_true(gram_n_elems(g) < 100000);
        gram_unref(g);
    }
    static const char *const bad[][2] = {
        {"(a)\\1", "backreference"}, {"a(?=b)", "lookahead"}, {"\\bword", "\\b"}, {"(?i)a", "inline flags"},
        {"a*+", "possessive"}, {"\\p{L}", "property"}, {"a^b", "'^'"}, {"a$b", "'$'"}, {"(a", "missing ')'"},
        {"a)", "unbalanced"}, {"[a", "unterminated"}, {"*a", "follows nothing"}, {"a{3,1}", "n < m"},
        {"a{20000}", "limit"}, {"[[:alpha:]]", "POSIX"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        gram_t *g = NULL;
        char err[256] = "";
        kv_status s = gram_compile_regex(bad[i][0], strlen(bad[i][0]), &g, err, sizeof err);
        if (s == KV_OK || !strstr(err, bad[i][1])) {
            fprintf(stderr, "regex %s: status %d, message '%s' (want '%s')\n", bad[i][0], s, err, bad[i][1]);
            fail();
        }
        assert_null(g);
    }
}

/* ---------------------------------------------------------------- pathological constraints
 * (tester finding F2): nested quantifiers are merged where that is exact, grammars that would
 * keep too many parses open are refused when compiled, and a mask costs at most the budget. */

static gram_t *compile_kind(const char *kind, const char *src, kv_status *st, char *err, size_t errlen) {
    gram_t *g = NULL;
    if (!strcmp(kind, "regex")) *st = gram_compile_regex(src, strlen(src), &g, err, errlen);
    else if (!strcmp(kind, "gbnf")) *st = gram_compile_ebnf(src, strlen(src), &g, err, errlen);
    else {
        json_t *j = json_loads(src, 0, NULL);
        assert_non_null(j);
        *st = gram_compile_json_schema(j, false, &g, err, errlen);
        json_decref(j);
    }
    return g;
}

/* Work units of the first mask of g (a fresh grammar: a cache miss). */
static uint64_t first_mask_work(gram_t *g, const gram_vocab_t *v, int *na) {
    gram_matcher_t *m = gram_matcher_new(g, v);
    assert_non_null(gram_matcher_mask(m, na));
    uint64_t w = gram_matcher_last_work(m);
    gram_matcher_free(m);
    return w;
}

static void test_pathological(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(JSON_TOKENS, (int)(sizeof JSON_TOKENS / sizeof *JSON_TOKENS), &eos);
    char err[512];
    kv_status s;
    /* merged nests: the same rules and the same mask work as the plain form */
    static const char *const same[][2] = {
        {"(.*){10000}", ".*"}, {"((((.*)*)*)*)*x", ".*x"}, {"((a+)+)+b", "a+b"}, {"(x?){0,50}y", "x{0,50}y"},
        {"((ab){2}){3}c", "(ab){6}c"}, {"(((z*)+)?)*", "z*"},
    };
    for (size_t i = 0; i < sizeof same / sizeof *same; i++) {
        gram_t *a = compile_kind("regex", same[i][0], &s, err, sizeof err);
        if (s) fail_msg("%s: %s", same[i][0], err);
        gram_t *b = compile_kind("regex", same[i][1], &s, err, sizeof err);
        assert_int_equal(s, KV_OK);
        assert_int_equal(gram_n_rules(a), gram_n_rules(b));
        assert_int_equal(gram_n_elems(a), gram_n_elems(b));
        int na = 0, nb = 0;
        assert_int_equal(first_mask_work(a, v, &na), first_mask_work(b, v, &nb));
        assert_int_equal(na, nb);
        gram_unref(a);
        gram_unref(b);
    }
    /* a nest whose counts have gaps is not merged: (a{3}){0,2} is "", aaa, aaaaaa */
    gram_t *g = compile_kind("regex", "(a{3}){0,2}", &s, err, sizeof err);
    assert_int_equal(s, KV_OK);
    assert_true(full_match(g, v, "aaaaaa", 6));
    assert_false(full_match(g, v, "aaaa", 4));
    gram_unref(g);
    /* the GBNF and JSON schema forms of a nest are merged too */
    g = compile_kind("gbnf", "root ::= ((\"ab\"*)*)* \"x\"", &s, err, sizeof err);
    if (s) fail_msg("%s", err);
    assert_true(full_match(g, v, "ababx", 5));
    gram_unref(g);
    /* refused when compiled, with the limit in the message: every form of "a repeated group
     * whose iterations can end in many places" and too many alternatives that begin alike */
    kv_buf many;
    kv_buf_init(&many);
    kv_buf_puts(&many, "{\"anyOf\":[");
    for (int i = 0; i < 300; i++)
        kv_buf_printf(&many, "%s{\"type\":\"object\",\"properties\":{\"k%d\":{\"type\":\"integer\"}},\"required\":[\"k%d\"]}",
                      i ? "," : "", i, i);
    kv_buf_puts(&many, "]}");
    const char *bad[][2] = {
        {"regex", "(.*a){1000}"}, {"regex", "(.*x.*){1,1000}"}, {"regex", "((a|b){0,10000}){0,10000}"},
        {"regex", "(a|ab|b)*(.*b){500}"}, {"gbnf", "root ::= item{1,1000}\nitem ::= [^\\n]* \"a\""},
        {"schema", "{\"type\":\"string\",\"pattern\":\"^(.*a){1000}$\"}"}, {"schema", kv_buf_cstr(&many)},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err[0] = 0;
        g = compile_kind(bad[i][0], bad[i][1], &s, err, sizeof err);
        if (s != KV_ETOOLONG || !strstr(err, "too ambiguous") || !strstr(err, "255")) {
            fprintf(stderr, "%s %.60s: status %d, '%s'\n", bad[i][0], bad[i][1], s, err);
            fail();
        }
        assert_null(g);
    }
    kv_buf_free(&many);
    /* the runtime bound: a grammar that passes the compile-time probe but whose masks are
     * expensive fails its mask when over the budget (counted work, not time), and only then */
    g = compile_kind("regex", "(.*.*.*)*x", &s, err, sizeof err);
    assert_int_equal(s, KV_OK);
    int na = 0;
    uint64_t need = first_mask_work(g, v, &na);
    gram_unref(g);
    assert_true(need > 1000);
    gram_set_mask_budget(need / 2);
    g = compile_kind("regex", "(.*.*.*)*x|never", &s, err, sizeof err); /* fresh: an empty mask cache */
    assert_int_equal(s, KV_OK);
    struct gram_stats a, b;
    gram_get_stats(&a);
    gram_matcher_t *m = gram_matcher_new(g, v);
    assert_null(gram_matcher_mask(m, NULL));
    assert_int_equal(gram_matcher_status(m), KV_ETOOLONG);
    /* it stopped at the budget (the last trie node's transition may pass it) */
    assert_true(gram_matcher_last_work(m) > need / 2 && gram_matcher_last_work(m) < need);
    gram_get_stats(&b);
    assert_int_equal(b.over_budget - a.over_budget, 1);
    gram_matcher_free(m);
    gram_set_mask_budget(0);
    m = gram_matcher_new(g, v);
    assert_non_null(gram_matcher_mask(m, NULL));
    assert_int_equal(gram_matcher_status(m), KV_OK);
    uint64_t w = gram_matcher_last_work(m);
    assert_true(w > need / 2);
    /* a cached mask is charged what its walk cost: over a smaller budget it fails as a fresh
     * walk would (the outcome never depends on who filled the cache); the same state has the
     * same key in another matcher */
    gram_matcher_t *m2 = gram_matcher_new(g, v);
    assert_true(gram_matcher_state_key(m2) == gram_matcher_state_key(m));
    gram_get_stats(&a);
    assert_null(gram_matcher_mask_within(m2, w - 1, NULL));
    assert_int_equal(gram_matcher_status(m2), KV_ETOOLONG);
    assert_non_null(gram_matcher_mask_within(m2, w, NULL));
    assert_int_equal(gram_matcher_last_work(m2), w);
    gram_get_stats(&b);
    assert_int_equal(b.mask_misses, a.mask_misses); /* both from the cache */
    assert_true(gram_matcher_accept_bytes(m2, "ab", 2));
    assert_true(gram_matcher_state_key(m2) != gram_matcher_state_key(m));
    gram_matcher_free(m2);
    gram_matcher_free(m);
    gram_unref(g);
    gram_vocab_free(v);
}

/* Thousands of alternatives (tester finding F5): a trie, so the start state holds one parse
 * per distinct first byte, not one per choice. */
static void test_many_choices(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(NULL, 0, &eos);
    enum { N = 5000 };
    static char buf[N][16];
    const char *ch[N];
    size_t len[N];
    for (int i = 0; i < N; i++) {
        len[i] = (size_t)snprintf(buf[i], sizeof buf[i], "item-%d", i * 7);
        ch[i] = buf[i];
    }
    gram_t *g = NULL;
    char err[256];
    assert_int_equal(gram_compile_choice(ch, len, N, &g, err, sizeof err), KV_OK);
    for (int i = 0; i < N; i += 97) assert_true(full_match(g, v, ch[i], len[i]));
    assert_false(full_match(g, v, "item-1", 6));
    assert_false(full_match(g, v, "item-", 5));
    /* "item-7" and "item-70" both: complete after the first, with more allowed */
    gram_matcher_t *m = gram_matcher_new(g, v);
    assert_true(gram_matcher_accept_bytes(m, "item-7", 6));
    assert_true(gram_matcher_is_complete(m));
    assert_false(gram_matcher_is_final(m));
    int na = 0;
    gram_matcher_mask(m, &na);
    assert_int_equal(na, 11); /* 0-9 and the end */
    gram_matcher_free(m);
    gram_unref(g);
    /* choices that are prefixes of one another: a chain as deep as the list; past 4096
     * levels a clear refusal (never a deep recursion) */
    for (int deep = 0; deep < 2; deep++) {
        int nc = deep ? 5000 : 3000;
        char *as = malloc((size_t)nc + 1);
        memset(as, 'a', (size_t)nc);
        const char **cs = calloc((size_t)nc, sizeof *cs);
        size_t *cl = calloc((size_t)nc, sizeof *cl);
        for (int i = 0; i < nc; i++) cs[i] = as, cl[i] = (size_t)i + 1;
        kv_status cst = gram_compile_choice(cs, cl, nc, &g, err, sizeof err);
        if (!deep) {
            assert_int_equal(cst, KV_OK);
            assert_true(full_match(g, v, as, 2999));
            assert_true(full_match(g, v, as, 3000));
            assert_false(full_match(g, v, "ab", 2));
            gram_matcher_t *cm = gram_matcher_new(g, v);
            assert_true(gram_matcher_accept_bytes(cm, as, 3000));
            assert_true(gram_matcher_is_final(cm)); /* the longest: nothing may follow */
            gram_matcher_free(cm);
            gram_unref(g);
        } else {
            assert_int_equal(cst, KV_ETOOLONG);
            assert_non_null(strstr(err, "4096"));
        }
        free(as);
        free(cs);
        free(cl);
    }
    /* the limit, named */
    size_t n_over = GRAM_MAX_CHOICES + 1;
    const char **many = calloc(n_over, sizeof *many);
    size_t *ml = calloc(n_over, sizeof *ml);
    for (size_t i = 0; i < n_over; i++) many[i] = "x", ml[i] = 1;
    assert_int_equal(gram_compile_choice(many, ml, (int)n_over, &g, err, sizeof err), KV_ETOOLONG);
    assert_non_null(strstr(err, "65536"));
    free(many);
    free(ml);
    /* JSON schema: an enum and an anyOf of consts of 3000 values */
    for (int form = 0; form < 2; form++) {
        kv_buf sb;
        kv_buf_init(&sb);
        kv_buf_puts(&sb, form ? "{\"anyOf\":[" : "{\"enum\":[");
        for (int i = 0; i < 3000; i++)
            kv_buf_printf(&sb, form ? "%s{\"const\":\"v%d\"}" : "%s\"v%d\"", i ? "," : "", i);
        kv_buf_puts(&sb, "]}");
        kv_status s;
        g = compile_kind("schema", kv_buf_cstr(&sb), &s, err, sizeof err);
        if (s) fail_msg("%s", err);
        assert_true(full_match(g, v, "\"v2999\"", 7));
        assert_false(full_match(g, v, "\"v3000\"", 7));
        gram_unref(g);
        kv_buf_free(&sb);
    }
    gram_vocab_free(v);
}

/* ---------------------------------------------------------------- masks vs per-token advance */

static void check_masks(gram_t *g, const gram_vocab_t *v, int eos, uint64_t seed, int steps) {
    gram_matcher_t *m = gram_matcher_new(g, v);
    struct rng r = {seed};
    int nv = gram_vocab_size(v);
    for (int s = 0; s < steps && !gram_matcher_is_final(m); s++) {
        int na;
        const uint64_t *mask = gram_matcher_mask(m, &na);
        int cnt = 0, last = -1;
        for (int i = 0; i < nv; i++) {
            gram_matcher_t *c = gram_matcher_clone(m);
            bool want = gram_matcher_accept(c, i);
            gram_matcher_free(c);
            bool got = (mask[i >> 6] >> (i & 63)) & 1;
            if (want != got) {
                int tl;
                const char *tb = gram_vocab_token(v, i, &tl);
                fprintf(stderr, "token %d '%.*s': mask %d, accept %d\n", i, tl, tb, got, want);
                fail();
            }
            if (want) {
                cnt++;
                if (i != eos && rint_(&r, cnt) == 0) last = i; /* reservoir pick */
            }
        }
        assert_int_equal(cnt, na);
        if (last < 0) break;
        assert_true(gram_matcher_accept(m, last));
    }
    gram_matcher_free(m);
}

static void test_masks_byte_vocab(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(JSON_TOKENS, (int)(sizeof JSON_TOKENS / sizeof *JSON_TOKENS), &eos);
    gram_t *g = NULL;
    char err[256];
    assert_int_equal(gram_compile_json_object(&g, err, sizeof err), KV_OK);
    for (int i = 0; i < 4; i++) check_masks(g, v, eos, 100 + (uint64_t)i, 40);
    gram_unref(g);
    const char *re = "(ab|\xc3\xa9|\xe2\x82\xac)*c";
    assert_int_equal(gram_compile_regex(re, strlen(re), &g, err, sizeof err), KV_OK);
    check_masks(g, v, eos, 7, 30);
    /* the plain walk (taken when a walk meets too many states) gives the same bits */
    gram_walk_set_max_states(2);
    check_masks(g, v, eos, 8, 30);
    gram_walk_set_max_states(0);
    gram_unref(g);
    /* alternatives that can match nothing are pruned: no dead end after "a" */
    json_t *sf = json_loads("{\"type\":\"object\",\"properties\":{\"a\":false,\"b\":{\"type\":\"integer\"}}}", 0, NULL);
    assert_int_equal(gram_compile_json_schema(sf, true, &g, err, sizeof err), KV_OK);
    gram_matcher_t *m = gram_matcher_new(g, v);
    assert_true(gram_matcher_accept_bytes(m, "{\"", 2));
    assert_false(gram_matcher_accept_bytes(m, "a", 1));
    gram_matcher_free(m);
    gram_unref(g);
    json_decref(sf);
    gram_vocab_free(v);
}

static gram_vocab_t *tok_vocab(const char *rel, tokenizer_t **tp) {
    char path[1024];
    if (!test_data_path(path, sizeof path, rel)) return NULL;
    char err[256];
    if (tok_load(path, tp, err, sizeof err)) {
        fprintf(stderr, "tok_load %s: %s\n", path, err);
        fail();
    }
    int n = tok_n_vocab(*tp);
    int32_t eog[8];
    int ne = 0;
    for (int i = 0; i < n && ne < 8; i++)
        if (tok_is_eog(*tp, i)) eog[ne++] = i;
    gram_vocab_t *v = gram_vocab_new(*tp, n, eog, ne);
    assert_non_null(v);
    return v;
}

static void test_masks_tokenizers(void **st) {
    (void)st;
    static const char *const files[] = {"models/stories260K/stories260K.gguf",
                                        "models/llama-2-tiny-random/llama-2-tiny-random.gguf"};
    int ran = 0;
    for (int f = 0; f < 2; f++) {
        tokenizer_t *t = NULL;
        gram_vocab_t *v = tok_vocab(files[f], &t);
        if (!v) continue;
        ran++;
        int eos = tok_eos(t);
        gram_t *g = NULL;
        char err[256];
        json_error_t je;
        json_t *schema = json_loads("{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":6},"
                                    "\"n\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"x\",\"y z\"]}}},"
                                    "\"required\":[\"name\",\"n\"],\"additionalProperties\":false}", 0, &je);
        assert_int_equal(gram_compile_json_schema(schema, true, &g, err, sizeof err), KV_OK);
        check_masks(g, v, eos, 11 + (uint64_t)f, f == 0 ? 25 : 6);
        gram_unref(g);
        json_decref(schema);
        gram_vocab_free(v);
        tok_free(t);
    }
    if (!ran) skip();
}

/* ---------------------------------------------------------------- JSON schemas */

static void check_schema_samples(const char *schema_txt, bool strict, int n, uint64_t seed) {
    json_error_t je;
    json_t *schema = json_loads(schema_txt, JSON_DECODE_ANY, &je);
    if (!schema) {
        fprintf(stderr, "bad test schema %s: %s\n", schema_txt, je.text);
        fail();
    }
    gram_t *g = NULL;
    char err[256];
    kv_status s = gram_compile_json_schema(schema, strict, &g, err, sizeof err);
    if (s) {
        fprintf(stderr, "schema %s: %s\n", schema_txt, err);
        fail();
    }
    int eos;
    gram_vocab_t *v = byte_vocab(JSON_TOKENS, (int)(sizeof JSON_TOKENS / sizeof *JSON_TOKENS), &eos);
    struct rng r = {seed};
    static char out[1 << 16];
    int done = 0;
    for (int i = 0; i < n; i++) {
        size_t len;
        if (!sample(g, v, eos, &r, 3000, out, sizeof out, &len)) continue;
        done++;
        char why[256];
        if (!sc_check_text(schema, out, len, why, sizeof why)) {
            fprintf(stderr, "schema %s\noutput %s\ninvalid: %s\n", schema_txt, out, why);
            fail();
        }
    }
    assert_true(done >= n / 2);
    gram_vocab_free(v);
    gram_unref(g);
    json_decref(schema);
}

static void test_schema_fixed(void **st) {
    (void)st;
    static const char *const schemas[] = {
        "{\"type\":\"string\"}",
        "{\"type\":\"string\",\"minLength\":2,\"maxLength\":5}",
        "{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}",
        "{\"type\":\"integer\",\"exclusiveMinimum\":5,\"exclusiveMaximum\":9}",
        "{\"type\":\"integer\",\"minimum\":100}",
        "{\"type\":\"number\",\"minimum\":-2,\"maximum\":3}",
        "{\"type\":\"number\",\"exclusiveMinimum\":0}",
        "{\"type\":\"number\"}",
        "{\"type\":[\"string\",\"null\"]}",
        "{\"enum\":[\"red\",\"green\",1,null,{\"a\":[1,2]}]}",
        "{\"const\":\"fixed \\\"q\\\"\"}",
        "{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":2,\"maxItems\":4}",
        "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\"},{\"type\":\"string\",\"maxLength\":3}],\"items\":false}",
        "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\"}],\"items\":{\"type\":\"null\"},\"minItems\":3}",
        "{\"items\":[{\"type\":\"integer\"},{\"type\":\"boolean\"}],\"additionalItems\":false}",
        "{\"type\":\"array\",\"items\":[{\"const\":1}],\"additionalItems\":{\"type\":\"string\",\"maxLength\":1},\"maxItems\":3}",
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\",\"maxLength\":4},"
        "\"c\":{\"type\":\"boolean\"}},\"required\":[\"b\"],\"additionalProperties\":false}",
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}}}",
        "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}",
        "{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\",\"maxLength\":2}]}",
        "{\"oneOf\":[{\"type\":\"null\"},{\"type\":\"array\",\"maxItems\":1}]}",
        "{\"type\":\"string\",\"pattern\":\"^[a-z]{2,4}-[0-9]+$\"}",
        "{\"type\":\"string\",\"pattern\":\"ab\"}",
        "{\"type\":\"string\",\"format\":\"date\"}",
        "{\"type\":\"string\",\"format\":\"date-time\"}",
        "{\"type\":\"string\",\"format\":\"uuid\"}",
        "{\"type\":\"string\",\"format\":\"ipv4\"}",
        "{\"type\":\"string\",\"format\":\"time\"}",
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"next\":"
        "{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"],"
        "\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",
        "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\",\"nullable\":true}},\"required\":[\"x\"]}",
        "{\"title\":\"t\",\"description\":\"d\",\"type\":\"object\",\"properties\":{\"q\":{\"title\":\"Q\",\"type\":\"string\","
        "\"maxLength\":3,\"default\":\"x\"}},\"required\":[\"q\"]}",
        "{\"type\":\"object\",\"required\":[\"extra\"]}",
        "true",
        "{}",
    };
    for (size_t i = 0; i < sizeof schemas / sizeof *schemas; i++) check_schema_samples(schemas[i], true, 12, 1000 + i);
    check_schema_samples("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}", false, 12, 5);
}

static void test_schema_instances(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(NULL, 0, &eos);
    struct { const char *schema, *inst; bool ok; } cases[] = {
        {"{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}", "-17", true},
        {"{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}", "-18", false},
        {"{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}", "1234", true},
        {"{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}", "1235", false},
        {"{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}", "007", false},
        {"{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}", "0", true},
        {"{\"type\":\"integer\",\"minimum\":-17,\"maximum\":1234}", "-0", false},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":5,\"exclusiveMaximum\":9}", "5", false},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":5,\"exclusiveMaximum\":9}", "8", true},
        {"{\"type\":\"number\",\"minimum\":-2,\"maximum\":3}", "2.5", true},
        {"{\"type\":\"number\",\"minimum\":-2,\"maximum\":3}", "-1.99", true},
        {"{\"type\":\"number\",\"minimum\":-2,\"maximum\":3}", "3.5", false},
        {"{\"type\":\"number\",\"minimum\":-2,\"maximum\":3}", "-2.5", false},
        {"{\"type\":\"string\",\"maxLength\":2}", "\"\xc3\xa9\xc3\xa9\"", true},
        {"{\"type\":\"string\",\"maxLength\":2}", "\"abc\"", false},
        {"{\"type\":\"string\"}", "\"a\\u00e9\\n\"", true},
        {"{\"type\":\"string\"}", "\"\\ud800\"", false},
        {"{\"type\":\"string\"}", "\"\\u0000\"", false},
        {"{\"type\":\"string\"}", "\"tab\there\"", false},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}},\"required\":[\"b\"]}", "{\"b\": 1}", true},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}},\"required\":[\"b\"]}", "{\"a\":1,\"b\":2}", true},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}},\"required\":[\"b\"]}", "{\"a\":1}", false},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}},\"required\":[\"b\"]}", "{}", false},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}},\"required\":[\"b\"]}",
         "{\n  \"a\": 1,\n  \"b\": 2\n}", true},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":2}", "[]", false},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":2}", "[1, 2]", true},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":2}", "[1,2,3]", false},
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-02-29\"", false}, /* subset: Feb <= 28 */
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-04-30\"", true},
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-04-31\"", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *schema = json_loads(cases[i].schema, 0, NULL);
        gram_t *g = NULL;
        char err[256];
        assert_int_equal(gram_compile_json_schema(schema, true, &g, err, sizeof err), KV_OK);
        bool got = full_match(g, v, cases[i].inst, strlen(cases[i].inst));
        if (got != cases[i].ok) {
            fprintf(stderr, "schema %s instance %s: got %d\n", cases[i].schema, cases[i].inst, got);
            fail();
        }
        gram_unref(g);
        json_decref(schema);
    }
    gram_vocab_free(v);
}

static void test_schema_random(void **st) {
    (void)st;
    struct rng r = {0xBEEF};
    for (int i = 0; i < 60; i++) {
        json_t *s = gen_schema(&r, 3);
        char *txt = json_dumps(s, JSON_COMPACT);
        check_schema_samples(txt, true, 6, 77 + (uint64_t)i);
        free(txt);
        json_decref(s);
    }
}

static void test_schema_refused(void **st) {
    (void)st;
    static const char *const bad[][2] = {
        {"{\"type\":\"object\",\"patternProperties\":{\"a\":{}}}", "patternProperties"},
        {"{\"type\":\"array\",\"contains\":{}}", "contains"},
        {"{\"type\":\"number\",\"multipleOf\":2}", "multipleOf"},
        {"{\"not\":{\"type\":\"null\"}}", "'not'"},
        {"{\"if\":{},\"then\":{}}", "'if'"},
        {"{\"type\":\"object\",\"minProperties\":1}", "minProperties"},
        {"{\"type\":\"array\",\"uniqueItems\":true}", "uniqueItems"},
        {"{\"type\":\"string\",\"format\":\"hostname\"}", "hostname"},
        {"{\"type\":\"number\",\"minimum\":0.5}", "minimum"},
        {"{\"allOf\":[{\"type\":\"string\"},{\"maxLength\":2}]}", "allOf"},
        {"{\"$ref\":\"http://example.com/s.json\"}", "$ref"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"dependentRequired\":{}}}}", "#/properties/a"},
        {"{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", "backreference"},
        {"{\"type\":\"strin\"}", "strin"},
        {"{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"null\"}]}", "left recursion"},
        {"{\"type\":\"array\",\"minItems\":50000}", "minItems"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        json_t *s = json_loads(bad[i][0], 0, NULL);
        assert_non_null(s);
        gram_t *g = NULL;
        char err[256] = "";
        kv_status rc = gram_compile_json_schema(s, true, &g, err, sizeof err);
        if (rc == KV_OK || !strstr(err, bad[i][1])) {
            fprintf(stderr, "schema %s: status %d, message '%s' (want '%s')\n", bad[i][0], rc, err, bad[i][1]);
            fail();
        }
        json_decref(s);
    }
}

/* ---------------------------------------------------------------- GBNF, choice, EOS */

static void test_ebnf(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(NULL, 0, &eos);
    const char *src =
        "# a tiny arithmetic language\n"
        "root ::= expr\n"
        "expr ::= term ( [-+] term )*\n"
        "term ::= num\n"
        "       | \"(\" expr \")\"\n"
        "num  ::= [0-9]{1,3} # up to three digits\n";
    gram_t *g = NULL;
    char err[256];
    assert_int_equal(gram_compile_ebnf(src, strlen(src), &g, err, sizeof err), KV_OK);
    assert_true(full_match(g, v, "1+(22-333)", 10));
    assert_true(full_match(g, v, "7", 1));
    assert_false(full_match(g, v, "1+", 2));
    assert_false(full_match(g, v, "1234", 4));
    assert_false(full_match(g, v, "(1", 2));
    gram_unref(g);
    struct { const char *src, *want; } bad[] = {
        {"root ::= root \"a\" | \"b\"\n", "left recursion"},
        {"root ::= x\n", "'x' is used but not defined"},
        {"start ::= \"a\"\n", "no rule named 'root'"},
        {"root ::= \"a\n", "unterminated string"},
        {"root ::= \"a\"\nroot ::= \"b\"\n", "defined twice"},
        {"root ::= a\na ::= b? a \"x\" | \"z\"\nb ::= \"y\"\n", "left recursion"},
        {"root ::= \"a\" root\n", "matches nothing"},
        {"root = \"a\"\n", "expected a rule"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char e2[256] = "";
        gram_t *g2 = NULL;
        kv_status s = gram_compile_ebnf(bad[i].src, strlen(bad[i].src), &g2, e2, sizeof e2);
        if (!s || !strstr(e2, bad[i].want)) {
            fprintf(stderr, "gbnf %s: %d '%s' (want '%s')\n", bad[i].src, s, e2, bad[i].want);
            fail();
        }
    }
    gram_vocab_free(v);
}

static void test_choice_and_eos(void **st) {
    (void)st;
    static const char *const extra[] = {"yes", "no", "ye"};
    int eos;
    gram_vocab_t *v = byte_vocab(extra, 3, &eos);
    const char *ch[] = {"yes", "no", "yes please"};
    size_t len[] = {3, 2, 10};
    gram_t *g = NULL;
    char err[128];
    assert_int_equal(gram_compile_choice(ch, len, 3, &g, err, sizeof err), KV_OK);
    gram_matcher_t *m = gram_matcher_new(g, v);
    int na;
    const uint64_t *mask = gram_matcher_mask(m, &na);
    /* 'y', 'n', "yes", "no", "ye" */
    assert_int_equal(na, 5);
    assert_false((mask[eos >> 6] >> (eos & 63)) & 1);
    assert_true(gram_matcher_accept(m, 256)); /* "yes" */
    assert_true(gram_matcher_is_complete(m));
    assert_false(gram_matcher_is_final(m)); /* " please" may follow */
    mask = gram_matcher_mask(m, &na);
    assert_int_equal(na, 2); /* ' ' and EOS */
    assert_true((mask[eos >> 6] >> (eos & 63)) & 1);
    gram_matcher_t *c = gram_matcher_clone(m);
    assert_true(gram_matcher_accept(m, eos));
    assert_true(gram_matcher_is_final(m));
    assert_false(gram_matcher_accept(m, ' '));
    assert_true(gram_matcher_accept(c, ' ')); /* the clone is independent */
    assert_false(gram_matcher_accept(c, eos));
    gram_matcher_free(c);
    gram_matcher_free(m);
    m = gram_matcher_new(g, v);
    assert_true(gram_matcher_accept(m, 257)); /* "no": complete, nothing may follow */
    assert_true(gram_matcher_is_final(m));
    gram_matcher_free(m);
    gram_unref(g);
    /* the cache hands back the same compiled grammar for the same source */
    gram_t *g1 = NULL, *g2 = NULL;
    assert_int_equal(gram_compile_regex("x+", 2, &g1, err, sizeof err), KV_OK);
    assert_int_equal(gram_compile_regex("x+", 2, &g2, err, sizeof err), KV_OK);
    assert_ptr_equal(g1, g2);
    gram_unref(g1);
    gram_unref(g2);
    gram_vocab_free(v);
}

/* Multi-byte characters split across tokens: "€" = E2 82 AC as three byte tokens. */
static void test_utf8_split(void **st) {
    (void)st;
    int eos;
    gram_vocab_t *v = byte_vocab(NULL, 0, &eos);
    gram_t *g = NULL;
    char err[128];
    const char *re = "[\xe2\x82\xac\xc3\xa9]+";
    assert_int_equal(gram_compile_regex(re, strlen(re), &g, err, sizeof err), KV_OK);
    gram_matcher_t *m = gram_matcher_new(g, v);
    int na;
    gram_matcher_mask(m, &na);
    assert_int_equal(na, 2); /* lead bytes E2, C3 */
    assert_true(gram_matcher_accept(m, 0xE2));
    gram_matcher_mask(m, &na);
    assert_int_equal(na, 1); /* 0x82 */
    assert_false(gram_matcher_accept(m, 0x83));
    assert_true(gram_matcher_accept(m, 0x82));
    assert_true(gram_matcher_accept(m, 0xAC));
    assert_true(gram_matcher_is_complete(m));
    gram_matcher_free(m);
    gram_unref(g);
    /* '.' never produces invalid UTF-8 */
    assert_int_equal(gram_compile_regex(".{3}", 4, &g, err, sizeof err), KV_OK);
    assert_false(full_match(g, v, "\xff\xfe\xfd", 3));
    assert_false(full_match(g, v, "\xed\xa0\x80", 3)); /* a surrogate */
    assert_true(full_match(g, v, "a\xf0\x9f\x98\x80z", 6));
    gram_unref(g);
    gram_vocab_free(v);
}

/* ---------------------------------------------------------------- tool calls */

/* Feeds text to a fresh stream in pieces of `step` bytes; returns content and calls. */
static int tool_run(enum gram_tool_fmt f, const char *text, size_t step, kv_buf *content,
                    struct gram_tool_call **all) {
    gram_tool_stream_t *s = gram_tool_stream_new(f);
    int n_all = 0;
    *all = NULL;
    size_t n = strlen(text);
    for (size_t i = 0; i <= n; i += step) {
        struct gram_tool_call *c = NULL;
        int k = 0;
        size_t len = i + step <= n ? step : n - i;
        if (i < n) assert_int_equal(gram_tool_stream_push(s, text + i, len, content, &c, &k), KV_OK);
        else assert_int_equal(gram_tool_stream_finish(s, content, &c, &k), KV_OK);
        if (k) {
            *all = realloc(*all, (size_t)(n_all + k) * sizeof **all);
            memcpy(*all + n_all, c, (size_t)k * sizeof *c);
            n_all += k;
            free(c);
        }
        if (i >= n) break;
        if (i + step > n) {
            i = n - step; /* next round finishes */
        }
    }
    gram_tool_stream_free(s);
    return n_all;
}

static void test_tool_parse(void **st) {
    (void)st;
    struct { enum gram_tool_fmt f; const char *text, *content; int n; const char *name0, *args0; } cases[] = {
        {GRAM_TOOLS_HERMES, "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
         "Let me check.\n", 1, "get_weather", "{\"city\":\"Paris\"}"},
        {GRAM_TOOLS_HERMES, "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>\n",
         "", 2, "a", "{}"},
        {GRAM_TOOLS_HERMES, "no calls here, just a < sign and <tool", "no calls here, just a < sign and <tool", 0, NULL, NULL},
        {GRAM_TOOLS_HERMES, "<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", 0, NULL, NULL},
        {GRAM_TOOLS_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": [1, 2]}}", "", 1, "f", "{\"q\":[1,2]}"},
        /* the closing tag inside a string argument does not end the call (F4a) */
        {GRAM_TOOLS_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"a </tool_call> b \\\" </tool_call>\"}}\n</tool_call> done",
         " done", 1, "f", "{\"q\":\"a </tool_call> b \\\" </tool_call>\"}"},
        {GRAM_TOOLS_LLAMA3_JSON, "  {\"name\": \"f\", \"parameters\": {\"a\": 1}}; {\"name\": \"g\", \"parameters\": {}}", "", 2, "f", "{\"a\":1}"},
        {GRAM_TOOLS_LLAMA3_JSON, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}", "", 1, "f", "{}"},
        {GRAM_TOOLS_LLAMA3_JSON, "Hello {there}", "Hello {there}", 0, NULL, NULL},
        {GRAM_TOOLS_LLAMA3_JSON, "{not a call}", "{not a call}", 0, NULL, NULL},
        {GRAM_TOOLS_MISTRAL, "Sure. [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": \"b\"}}, {\"name\": \"g\", \"arguments\": {}}]",
         "Sure. ", 2, "f", "{\"a\":\"b\"}"},
        {GRAM_TOOLS_MISTRAL, "[TOOL_CALLS] broken", "[TOOL_CALLS] broken", 0, NULL, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        for (size_t step = 1; step <= strlen(cases[i].text); step = step * 2 + 1) {
            kv_buf content;
            kv_buf_init(&content);
            struct gram_tool_call *c = NULL;
            int n = tool_run(cases[i].f, cases[i].text, step, &content, &c);
            const char *got = kv_buf_cstr(&content);
            if (n != cases[i].n || strcmp(got, cases[i].content) ||
                (n && (strcmp(c[0].name, cases[i].name0) || strcmp(c[0].arguments, cases[i].args0)))) {
                fprintf(stderr, "case %zu step %zu: %d calls (%s %s), content '%s'\n", i, step, n, n ? c[0].name : "",
                        n ? c[0].arguments : "", got);
                fail();
            }
            gram_tool_calls_free(c, n);
            kv_buf_free(&content);
        }
}

static void test_tool_grammar(void **st) {
    (void)st;
    json_t *tools = json_loads(
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":8},\"unit\":{\"enum\":[\"c\",\"f\"]}},"
        "\"required\":[\"city\",\"unit\"],\"additionalProperties\":false}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]", 0, NULL);
    assert_non_null(tools);
    int eos;
    gram_vocab_t *v = byte_vocab(JSON_TOKENS, (int)(sizeof JSON_TOKENS / sizeof *JSON_TOKENS), &eos);
    enum gram_tool_fmt fmts[] = {GRAM_TOOLS_HERMES, GRAM_TOOLS_LLAMA3_JSON, GRAM_TOOLS_MISTRAL};
    struct rng r = {99};
    static char out[1 << 16];
    json_t *params = json_object_get(json_object_get(json_array_get(tools, 0), "function"), "parameters");
    for (int f = 0; f < 3; f++)
        for (int mode = 0; mode < 3; mode++) {
            const char *only = mode == 2 ? "get_weather" : NULL;
            bool parallel = mode == 1;
            gram_t *g = NULL;
            char err[256];
            if (gram_compile_tool_calls(fmts[f], tools, only, parallel, &g, err, sizeof err)) fail_msg("%s", err);
            int seen_multi = 0;
            for (int k = 0; k < 10; k++) {
                size_t len;
                if (!sample(g, v, eos, &r, 3000, out, sizeof out, &len)) continue;
                kv_buf content;
                kv_buf_init(&content);
                struct gram_tool_call *c = NULL;
                int n = tool_run(fmts[f], out, 7, &content, &c);
                if (n < 1 || content.len) fail_msg("fmt %d output '%s': %d calls, content '%s'", f, out, n, kv_buf_cstr(&content));
                if (!parallel) assert_int_equal(n, 1);
                seen_multi += n > 1;
                for (int j = 0; j < n; j++) {
                    if (only) assert_string_equal(c[j].name, only);
                    if (!strcmp(c[j].name, "get_weather")) {
                        char why[256];
                        if (!sc_check_text(params, c[j].arguments, strlen(c[j].arguments), why, sizeof why))
                            fail_msg("arguments %s: %s", c[j].arguments, why);
                    } else {
                        assert_string_equal(c[j].name, "now");
                    }
                }
                gram_tool_calls_free(c, n);
                kv_buf_free(&content);
            }
            gram_unref(g);
        }
    char err[256];
    gram_t *g = NULL;
    assert_int_equal(gram_compile_tool_calls(GRAM_TOOLS_HERMES, tools, "nope", false, &g, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "nope"));
    json_t *bad = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"x\",\"parameters\":{\"type\":\"object\","
                             "\"patternProperties\":{}}}}]", 0, NULL);
    assert_int_equal(gram_compile_tool_calls(GRAM_TOOLS_HERMES, bad, NULL, true, &g, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "patternProperties"));
    assert_non_null(strstr(err, "tools[0]"));
    json_decref(bad);
    assert_int_equal(gram_tool_fmt_detect("{{'<tool_call>'}}"), GRAM_TOOLS_HERMES);
    assert_int_equal(gram_tool_fmt_detect("[TOOL_CALLS] {{x}}"), GRAM_TOOLS_MISTRAL);
    assert_int_equal(gram_tool_fmt_detect("<|start_header_id|> {\"name\": function name, \"parameters\": ...}"), GRAM_TOOLS_LLAMA3_JSON);
    assert_int_equal(gram_tool_fmt_detect(NULL), GRAM_TOOLS_HERMES);
    gram_vocab_free(v);
    json_decref(tools);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_regex_fixed),
        cmocka_unit_test(test_regex_random),
        cmocka_unit_test(test_regex_refused),
        cmocka_unit_test(test_pathological),
        cmocka_unit_test(test_many_choices),
        cmocka_unit_test(test_masks_byte_vocab),
        cmocka_unit_test(test_masks_tokenizers),
        cmocka_unit_test(test_schema_fixed),
        cmocka_unit_test(test_schema_instances),
        cmocka_unit_test(test_schema_random),
        cmocka_unit_test(test_schema_refused),
        cmocka_unit_test(test_ebnf),
        cmocka_unit_test(test_choice_and_eos),
        cmocka_unit_test(test_utf8_split),
        cmocka_unit_test(test_tool_parse),
        cmocka_unit_test(test_tool_grammar),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
