/*
 * bench_grammar: cost of a token mask (src/grammar/) for a tokenizer's vocabulary: the trie
 * walk (a cache miss) in representative states of a JSON schema and of json_object, and a
 * cached mask (a hit).
 *
 *   bench_grammar --tokenizer MODEL.gguf|tokenizer.json [--reps 5]
 *   bench_grammar --tokenizer T --regex RE | --gbnf G [--steps 12] [--prefix P --repeat K]
 *
 * The second form follows one sequence through a constraint (pathological ones, tester
 * finding F2): compile time, then per step the mask's time and work units with a token drawn
 * at random from the mask (fixed seed), after P repeated K times when given.
 *
 * Walk times are the minimum over --reps fresh compilations (an empty mask cache each).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"

/* A schema compiled afresh (a nonce in "description"): its mask cache is empty. */
static gram_t *fresh(const char *schema_txt, bool strict, int nonce) {
    json_t *s = json_loads(schema_txt, 0, NULL);
    char d[32], err[256];
    snprintf(d, sizeof d, "nonce %d", nonce);
    json_object_set_new(s, "description", json_string(d));
    gram_t *g = NULL;
    if (gram_compile_json_schema(s, strict, &g, err, sizeof err)) {
        fprintf(stderr, "compile: %s\n", err);
        exit(1);
    }
    json_decref(s);
    return g;
}

/* Minimum over reps of one trie walk (a mask cache miss) after prefix. */
static double walk_ms(const char *schema_txt, bool strict, const gram_vocab_t *v, const char *prefix, int reps,
                      int *n_allowed, uint64_t *work) {
    static int nonce;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        gram_t *g = fresh(schema_txt, strict, ++nonce);
        gram_matcher_t *m = gram_matcher_new(g, v);
        if (!gram_matcher_accept_bytes(m, prefix, strlen(prefix))) {
            fprintf(stderr, "prefix '%s' is outside the grammar\n", prefix);
            exit(1);
        }
        struct gram_stats a, b;
        gram_get_stats(&a);
        gram_matcher_mask(m, n_allowed);
        gram_get_stats(&b);
        double ms = (double)(b.walk_ns - a.walk_ns) / 1e6;
        if (b.mask_misses > a.mask_misses && ms < best) best = ms;
        *work = b.work_units - a.work_units;
        gram_matcher_free(m);
        gram_unref(g);
    }
    return best;
}

/* --regex / --gbnf: one sequence through the constraint. */
static int follow(const gram_vocab_t *v, const char *kind, const char *src, int steps, const char *prefix, int repeat) {
    char err[512];
    gram_t *g = NULL;
    uint64_t t0 = kv_now_ns();
    kv_status st = !strcmp(kind, "regex") ? gram_compile_regex(src, strlen(src), &g, err, sizeof err)
                                          : gram_compile_ebnf(src, strlen(src), &g, err, sizeof err);
    double cms = (double)(kv_now_ns() - t0) / 1e6;
    if (st) {
        printf("%s %s: refused in %.2f ms: %s\n", kind, src, cms, err);
        return 0;
    }
    printf("%s %s: compiled in %.2f ms (%d rules, %d elements)\n", kind, src, cms, gram_n_rules(g), gram_n_elems(g));
    gram_matcher_t *m = gram_matcher_new(g, v);
    for (int i = 0; prefix && i < repeat; i++)
        if (!gram_matcher_accept_bytes(m, prefix, strlen(prefix))) {
            printf("  the prefix leaves the grammar after %d repeats\n", i);
            break;
        }
    uint64_t seed = 1;
    double tot = 0, mx = 0;
    uint64_t wmax = 0;
    int n = gram_vocab_size(v), s;
    for (s = 0; s < steps && !gram_matcher_is_final(m); s++) {
        int na = 0;
        t0 = kv_now_ns();
        const uint64_t *mask = gram_matcher_mask(m, &na);
        double ms = (double)(kv_now_ns() - t0) / 1e6;
        tot += ms;
        if (ms > mx) mx = ms;
        if (gram_matcher_last_work(m) > wmax) wmax = gram_matcher_last_work(m);
        if (!mask) {
            printf("  step %d: mask refused after %.2f ms, %llu work units (status %d)\n", s, ms,
                   (unsigned long long)gram_matcher_last_work(m), gram_matcher_status(m));
            break;
        }
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        int k = (int)((seed >> 33) % (uint64_t)na), id = -1;
        for (int i = 0; i < n && id < 0; i++)
            if (((mask[i >> 6] >> (i & 63)) & 1) && k-- == 0) id = i;
        if (id < 0 || !gram_matcher_accept(m, id)) break;
    }
    printf("  %d masks: %.2f ms in all, max %.2f ms, max %llu work units\n", s, tot, mx, (unsigned long long)wmax);
    gram_matcher_free(m);
    gram_unref(g);
    return 0;
}

int main(int argc, char **argv) {
    const char *tokp = NULL, *fkind = NULL, *fsrc = NULL, *prefix = NULL;
    int reps = 5, steps = 12, repeat = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) tokp = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if ((!strcmp(argv[i], "--regex") || !strcmp(argv[i], "--gbnf")) && i + 1 < argc) {
            fkind = argv[i] + 2;
            fsrc = argv[++i];
        } else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prefix") && i + 1 < argc) prefix = argv[++i];
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_grammar --tokenizer PATH [--reps N]\n");
            return 2;
        }
    }
    if (!tokp) {
        fprintf(stderr, "usage: bench_grammar --tokenizer PATH [--reps N]\n");
        return 2;
    }
    tokenizer_t *t;
    char err[256];
    if (tok_load(tokp, &t, err, sizeof err)) {
        fprintf(stderr, "bench_grammar: %s\n", err);
        return 1;
    }
    int n = tok_n_vocab(t);
    int32_t eog[8];
    int ne = 0;
    for (int i = 0; i < n && ne < 8; i++)
        if (tok_is_eog(t, i)) eog[ne++] = i;
    uint64_t t0 = kv_now_ns();
    gram_vocab_t *v = gram_vocab_new(t, n, eog, ne);
    printf("vocab %d tokens, trie built in %.1f ms\n", n, (double)(kv_now_ns() - t0) / 1e6);
    if (fkind) {
        int rc = follow(v, fkind, fsrc, steps, prefix, repeat);
        gram_vocab_free(v);
        tok_free(t);
        return rc;
    }
    const char *schema_txt =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},\"required\":[\"name\",\"age\",\"tags\"],"
        "\"additionalProperties\":false}";
    const char *object_txt = "{\"type\":\"object\"}";
    struct { const char *txt; bool strict; const char *what, *prefix; } cases[] = {
        {schema_txt, true, "schema: start", ""},
        {schema_txt, true, "schema: inside a string", "{\"name\": \"Jo"},
        {schema_txt, true, "schema: inside an integer", "{\"name\": \"Jo\", \"age\": 4"},
        {schema_txt, true, "schema: after an array item", "{\"name\": \"Jo\", \"age\": 4, \"tags\": [\"a\""},
        {object_txt, false, "json_object: inside a string value", "{\"k\": \"v"},
        {object_txt, false, "json_object: after a value", "{\"k\": 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int na = 0;
        uint64_t work = 0;
        double ms = walk_ms(cases[i].txt, cases[i].strict, v, cases[i].prefix, reps, &na, &work);
        printf("%-40s walk %8.3f ms  allowed %6d  work %9llu units\n", cases[i].what, ms, na,
               (unsigned long long)work);
    }
    gram_t *gs = fresh(schema_txt, true, 0);
    /* hits: the same state again and again */
    gram_matcher_t *m = gram_matcher_new(gs, v);
    gram_matcher_accept_bytes(m, "{\"name\": \"Jo", 12);
    gram_matcher_mask(m, NULL);
    uint64_t h0 = kv_now_ns();
    int iters = reps * 200;
    for (int i = 0; i < iters; i++) {
        gram_matcher_t *c = gram_matcher_clone(m);
        gram_matcher_mask(c, NULL);
        gram_matcher_free(c);
    }
    printf("cached mask (clone + lookup + copy): %.2f us\n", (double)(kv_now_ns() - h0) / 1e3 / iters);
    gram_matcher_free(m);
    gram_unref(gs);
    gram_vocab_free(v);
    tok_free(t);
    return 0;
}
