/* The public compile functions (grammar.h) and the compiled-grammar cache. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

/* ---------------------------------------------------------------- cache
 * A small LRU of compiled grammars keyed by kind + source: requests that repeat a schema (the
 * usual case for an application) share one gram_t and so its mask cache. */
#define GRAM_CACHE_N 64

static struct {
    char *key;
    size_t len;
    gram_t *g;
    uint64_t used;
} g_cache[GRAM_CACHE_N];
static uint64_t g_cache_clock;
static pthread_mutex_t g_cache_mu = PTHREAD_MUTEX_INITIALIZER;

static gram_t *cache_get(const char *key, size_t len) {
    gram_t *g = NULL;
    pthread_mutex_lock(&g_cache_mu);
    for (int i = 0; i < GRAM_CACHE_N; i++)
        if (g_cache[i].key && g_cache[i].len == len && !memcmp(g_cache[i].key, key, len)) {
            g = gram_ref(g_cache[i].g);
            g_cache[i].used = ++g_cache_clock;
            break;
        }
    pthread_mutex_unlock(&g_cache_mu);
    return g;
}

static void cache_put(const char *key, size_t len, gram_t *g) {
    char *k = kv_malloc(len ? len : 1);
    if (!k) return;
    memcpy(k, key, len);
    pthread_mutex_lock(&g_cache_mu);
    int victim = 0;
    for (int i = 0; i < GRAM_CACHE_N; i++) {
        if (!g_cache[i].key) {
            victim = i;
            break;
        }
        if (g_cache[i].used < g_cache[victim].used) victim = i;
    }
    gram_t *old = g_cache[victim].g;
    free(g_cache[victim].key);
    g_cache[victim].key = k;
    g_cache[victim].len = len;
    g_cache[victim].g = gram_ref(g);
    g_cache[victim].used = ++g_cache_clock;
    pthread_mutex_unlock(&g_cache_mu);
    gram_unref(old);
}

kv_status gram_compile_cached(const char *key, size_t key_len, gram_build_fn build, void *arg,
                              gram_t **out, char *err, size_t errlen) {
    gram_t *g = cache_get(key, key_len);
    if (g) {
        *out = g;
        return KV_OK;
    }
    struct gb b;
    gb_init(&b);
    int root = -1;
    kv_status st = build(&b, arg, &root, err, errlen);
    if (!st && b.st) st = kv_errf(b.st, err, errlen, "%s", b.err);
    if (!st) st = gb_compile(&b, root, &g, err, errlen);
    gb_free(&b);
    if (st) return st;
    cache_put(key, key_len, g);
    *out = g;
    return KV_OK;
}

/* Key = tag + source bytes. */
static char *make_key(const char *tag, const char *src, size_t len, size_t *klen) {
    size_t tl = strlen(tag);
    char *k = kv_malloc(tl + len + 1);
    if (!k) return NULL;
    memcpy(k, tag, tl);
    if (len) memcpy(k + tl, src, len);
    *klen = tl + len;
    return k;
}

static kv_status compile_keyed(const char *tag, const char *src, size_t len, gram_build_fn build,
                               void *arg, gram_t **out, char *err, size_t errlen) {
    size_t kl;
    char *k = make_key(tag, src, len, &kl);
    if (!k) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    kv_status st = gram_compile_cached(k, kl, build, arg, out, err, errlen);
    free(k);
    return st;
}

/* ---------------------------------------------------------------- JSON schema */

struct schema_arg {
    const json_t *schema;
    bool strict;
};

static kv_status build_schema(struct gb *b, void *arg, int *root, char *err, size_t errlen) {
    struct schema_arg *a = arg;
    struct gsc *c = gsc_new(b, a->schema, a->strict, err, errlen);
    if (!c) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    int r = gb_rule_new(b, "root");
    struct gn *n = gsc_node(c, a->schema, "#");
    kv_status st = gsc_status(c);
    gsc_free(c);
    if (st) return st;
    gb_rule_set(b, r, n);
    *root = r;
    return KV_OK;
}

kv_status gram_compile_json_schema(const json_t *schema, bool strict, gram_t **out, char *err,
                                   size_t errlen) {
    if (!schema || (!json_is_object(schema) && !json_is_boolean(schema)))
        return kv_errf(KV_EINVAL, err, errlen, "the JSON schema must be an object");
    char *txt = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!txt) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    struct schema_arg a = {schema, strict};
    kv_status st = compile_keyed(strict ? "schema-strict:" : "schema:", txt, strlen(txt), build_schema, &a,
                                 out, err, errlen);
    free(txt);
    return st;
}

static kv_status build_object(struct gb *b, void *arg, int *root, char *err, size_t errlen) {
    (void)arg;
    json_t *schema = json_pack("{s:s}", "type", "object");
    if (!schema) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    struct schema_arg a = {schema, false};
    kv_status st = build_schema(b, &a, root, err, errlen);
    json_decref(schema);
    return st;
}

kv_status gram_compile_json_object(gram_t **out, char *err, size_t errlen) {
    return compile_keyed("json-object", "", 0, build_object, NULL, out, err, errlen);
}

/* ---------------------------------------------------------------- regex, choice, GBNF */

struct src_arg {
    const char *s;
    size_t n;
};

static kv_status build_regex(struct gb *b, void *arg, int *root, char *err, size_t errlen) {
    struct src_arg *a = arg;
    struct gn *n = NULL;
    kv_status st = gram_regex_parse(b, a->s, a->n, NULL, false, &n, err, errlen);
    if (st) return st;
    int r = gb_rule_new(b, "root");
    gb_rule_set(b, r, n);
    *root = r;
    return KV_OK;
}

kv_status gram_compile_regex(const char *re, size_t len, gram_t **out, char *err, size_t errlen) {
    struct src_arg a = {re, len};
    return compile_keyed("regex:", re, len, build_regex, &a, out, err, errlen);
}

struct choice_arg {
    const char *const *s;
    const size_t *len;
    int n;
};

static kv_status build_choice(struct gb *b, void *arg, int *root, char *err, size_t errlen) {
    struct choice_arg *a = arg;
    (void)err;
    (void)errlen;
    struct gn *alt = gn_alt(b);
    for (int i = 0; i < a->n; i++) gn_add(b, alt, gn_bytes(b, a->s[i], a->len[i]));
    int r = gb_rule_new(b, "root");
    gb_rule_set(b, r, alt);
    *root = r;
    return KV_OK;
}

kv_status gram_compile_choice(const char *const *s, const size_t *len, int n, gram_t **out,
                              char *err, size_t errlen) {
    if (n < 1) return kv_errf(KV_EINVAL, err, errlen, "the choice list is empty");
    if (n > GRAM_MAX_CHOICES)
        return kv_errf(KV_ETOOLONG, err, errlen, "%d choices: the limit is %d", n, GRAM_MAX_CHOICES);
    kv_buf key;
    kv_buf_init(&key);
    kv_status st = kv_buf_puts(&key, "choice:");
    for (int i = 0; i < n && !st; i++) {
        char lenb[24];
        snprintf(lenb, sizeof lenb, "%zu:", len[i]);
        st = kv_buf_puts(&key, lenb);
        if (!st) st = kv_buf_append(&key, s[i], len[i]);
    }
    if (st) {
        kv_buf_free(&key);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    struct choice_arg a = {s, len, n};
    st = gram_compile_cached(key.data, key.len, build_choice, &a, out, err, errlen);
    kv_buf_free(&key);
    return st;
}

static kv_status build_ebnf(struct gb *b, void *arg, int *root, char *err, size_t errlen) {
    struct src_arg *a = arg;
    return gram_ebnf_parse(b, a->s, a->n, root, err, errlen);
}

kv_status gram_compile_ebnf(const char *src, size_t len, gram_t **out, char *err, size_t errlen) {
    struct src_arg a = {src, len};
    return compile_keyed("gbnf:", src, len, build_ebnf, &a, out, err, errlen);
}
