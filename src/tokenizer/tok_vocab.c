/* tok_vocab: vocabulary storage, hash maps, loading entry point and simple queries. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h ^ (h >> 29);
}

kv_status tok_vocab_alloc(tokenizer_t *t, int n_tok) {
    t->tok = kv_calloc((size_t)n_tok, sizeof *t->tok);
    if (!t->tok) return KV_ENOMEM;
    t->n_tok = n_tok;
    return KV_OK;
}

/* During loading tok[id].s holds the arena offset (cast); tok_finalize resolves it. */
kv_status tok_vocab_set(tokenizer_t *t, int id, const char *s, size_t len) {
    if (id < 0 || id >= t->n_tok) return KV_EINVAL;
    if (t->arena_len + len + 1 > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap * 2 : 1 << 16;
        while (cap < t->arena_len + len + 1) cap *= 2;
        char *a = kv_realloc(t->arena, cap);
        if (!a) return KV_ENOMEM;
        t->arena = a;
        t->arena_cap = cap;
    }
    memcpy(t->arena + t->arena_len, s, len);
    t->arena[t->arena_len + len] = 0;
    t->tok[id].s = (const char *)(uintptr_t)(t->arena_len + 1); /* +1: 0 means unset */
    t->tok[id].len = (uint32_t)len;
    t->arena_len += len + 1;
    return KV_OK;
}

int tok_lookup(const tokenizer_t *t, const char *s, size_t len) {
    if (!t->vmap.slots) return -1;
    uint32_t i = (uint32_t)hash_bytes(s, len) & t->vmap.mask;
    for (;;) {
        int32_t id = t->vmap.slots[i];
        if (id < 0) return -1;
        if (t->tok[id].len == len && memcmp(t->tok[id].s, s, len) == 0) return id;
        i = (i + 1) & t->vmap.mask;
    }
}

kv_status pairmap_init(struct pairmap *m, size_t n) {
    uint32_t cap = 16;
    while (cap < n * 2 + 16) cap <<= 1;
    m->keys = kv_calloc(cap, sizeof *m->keys);
    m->rank = kv_malloc(cap * sizeof *m->rank);
    m->merged = kv_malloc(cap * sizeof *m->merged);
    if (!m->keys || !m->rank || !m->merged) return KV_ENOMEM;
    m->mask = cap - 1;
    return KV_OK;
}

static inline uint32_t pair_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (uint32_t)k;
}

/* First insertion wins (HF keeps the lowest rank for duplicate merges). */
kv_status pairmap_put(struct pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged) {
    uint64_t k = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    uint32_t i = pair_hash(k) & m->mask;
    while (m->keys[i]) {
        if (m->keys[i] == k) return KV_OK;
        i = (i + 1) & m->mask;
    }
    m->keys[i] = k;
    m->rank[i] = rank;
    m->merged[i] = merged;
    return KV_OK;
}

bool tok_pair_get(const tokenizer_t *t, int32_t a, int32_t b, int32_t *rank, int32_t *merged);
bool tok_pair_get(const tokenizer_t *t, int32_t a, int32_t b, int32_t *rank, int32_t *merged) {
    const struct pairmap *m = &t->merges;
    if (!m->keys) return false;
    uint64_t k = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    uint32_t i = pair_hash(k) & m->mask;
    while (m->keys[i]) {
        if (m->keys[i] == k) {
            *rank = m->rank[i];
            *merged = m->merged[i];
            return true;
        }
        i = (i + 1) & m->mask;
    }
    return false;
}

pcre2_code *tok_regex_compile(const char *pat, size_t len, char *err, size_t errlen) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof msg);
        kv_errf(KV_EFORMAT, err, errlen, "regex /%.*s/ at offset %zu: %s", (int)(len > 200 ? 200 : len),
                pat, (size_t)eo, (char *)msg);
        return NULL;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort; interpreter otherwise */
    return re;
}

static int cmp_added_len(const void *a, const void *b) {
    const struct added_token *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id - y->id;
}

static const char *const k_eog_names[] = {
    "<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>", "<end_of_turn>",
    "<|end|>", "<｜end▁of▁sentence｜>", NULL,
};

kv_status tok_finalize_map_only(tokenizer_t *t) {
    if (t->strings_resolved) return KV_OK;
    for (int i = 0; i < t->n_tok; i++) {
        if (!t->tok[i].s) { /* holes in the id space (rare): empty string, not in the model */
            kv_status st = tok_vocab_set(t, i, "", 0);
            if (st) return st;
            t->tok[i].flags &= (uint8_t)~TF_MODEL;
        }
    }
    for (int i = 0; i < t->n_tok; i++) t->tok[i].s = t->arena + ((uintptr_t)t->tok[i].s - 1);
    uint32_t cap = 16;
    while (cap < (uint32_t)t->n_tok * 2 + 16) cap <<= 1;
    t->vmap.slots = kv_malloc(cap * sizeof(int32_t));
    if (!t->vmap.slots) return KV_ENOMEM;
    memset(t->vmap.slots, 0xff, cap * sizeof(int32_t));
    t->vmap.mask = cap - 1;
    for (int id = 0; id < t->n_tok; id++) {
        /* the lowest id wins when two tokens share a text */
        const struct tok_entry *e = &t->tok[id];
        uint32_t i = (uint32_t)hash_bytes(e->s, e->len) & t->vmap.mask;
        bool dup = false;
        while (t->vmap.slots[i] >= 0) {
            const struct tok_entry *o = &t->tok[t->vmap.slots[i]];
            if (o->len == e->len && memcmp(o->s, e->s, e->len) == 0) {
                dup = true;
                break;
            }
            i = (i + 1) & t->vmap.mask;
        }
        if (!dup) t->vmap.slots[i] = id;
    }
    t->strings_resolved = true;
    return KV_OK;
}

kv_status tok_finalize(tokenizer_t *t, char *err, size_t errlen) {
    kv_status st = tok_finalize_map_only(t);
    if (st) return st;
    for (int b = 0; b < 256; b++) t->byte_tok[b] = -1;
    for (int id = 0; id < t->n_tok; id++) {
        struct tok_entry *e = &t->tok[id];
        unsigned v;
        char tail;
        if (e->len == 6 && memcmp(e->s, "<0x", 3) == 0 && e->s[5] == '>' &&
            sscanf(e->s + 3, "%2x%c", &v, &tail) == 2 && tail == '>') {
            if (t->byte_tok[v] < 0) t->byte_tok[v] = id;
            e->flags |= TF_BYTE;
            e->byte = (uint8_t)v;
        }
    }
    for (int i = 0; i < t->n_added; i++) {
        struct added_token *a = &t->added[i];
        a->s = t->tok[a->id].s;
        a->len = t->tok[a->id].len;
    }
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, cmp_added_len);
    t->eog = kv_calloc((size_t)t->n_tok, 1);
    if (!t->eog) return KV_ENOMEM;
    if (t->eos >= 0 && t->eos < t->n_tok) t->eog[t->eos] = 1;
    if (t->eot >= 0 && t->eot < t->n_tok) t->eog[t->eot] = 1;
    for (int i = 0; k_eog_names[i]; i++) {
        int id = tok_lookup(t, k_eog_names[i], strlen(k_eog_names[i]));
        if (id >= 0 && (t->tok[id].flags & TF_SPECIAL)) t->eog[id] = 1;
    }
    (void)err;
    (void)errlen;
    tok_chat_detect(t);
    return KV_OK;
}

static bool has_suffix(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

kv_status tok_load(const char *path, tokenizer_t **out, char *err, size_t errlen) {
    if (!path || !out) return kv_errf(KV_EINVAL, err, errlen, "tok_load: NULL argument");
    tokenizer_t *t = kv_calloc(1, sizeof *t);
    if (!t) return KV_ENOMEM;
    t->bos = t->eos = t->unk = t->eot = -1;
    kv_status st;
    if (kv_path_is_dir(path)) {
        size_t n = strlen(path) + 32;
        char *j = kv_malloc(n), *c = kv_malloc(n);
        if (!j || !c) {
            free(j);
            free(c);
            tok_free(t);
            return KV_ENOMEM;
        }
        snprintf(j, n, "%s/tokenizer.json", path);
        snprintf(c, n, "%s/tokenizer_config.json", path);
        st = tok_load_json(t, j, kv_path_exists(c) ? c : NULL, err, errlen);
        free(j);
        free(c);
    } else if (has_suffix(path, ".json")) {
        /* a sibling tokenizer_config.json is used when present */
        size_t n = strlen(path) + 32;
        char *c = kv_malloc(n);
        if (!c) {
            tok_free(t);
            return KV_ENOMEM;
        }
        snprintf(c, n, "%s", path);
        char *slash = strrchr(c, '/');
        snprintf(slash ? slash + 1 : c, n - (size_t)(slash ? slash + 1 - c : 0), "tokenizer_config.json");
        st = tok_load_json(t, path, kv_path_exists(c) ? c : NULL, err, errlen);
        free(c);
    } else {
        st = tok_load_gguf(t, path, err, errlen);
    }
    if (st == KV_OK) st = tok_finalize(t, err, errlen);
    if (st != KV_OK) {
        tok_free(t);
        return st;
    }
    *out = t;
    return KV_OK;
}

void tok_free(tokenizer_t *t) {
    if (!t) return;
    free(t->tok);
    free(t->arena);
    free(t->vmap.slots);
    free(t->merges.keys);
    free(t->merges.rank);
    free(t->merges.merged);
    free(t->added);
    for (int i = 0; i < t->n_norm; i++) {
        free(t->norm[i].a);
        free(t->norm[i].b);
        pcre2_code_free(t->norm[i].re);
    }
    free(t->norm);
    for (int i = 0; i < t->n_pre; i++) {
        pcre2_code_free(t->pre[i].re);
        free(t->pre[i].lit);
    }
    free(t->pre);
    for (int i = 0; i < t->n_dec; i++) {
        free(t->dec[i].a);
        free(t->dec[i].b);
    }
    free(t->dec);
    free(t->eog);
    free(t->chat_template);
    free(t);
}

int tok_n_vocab(const tokenizer_t *t) { return t->n_tok; }
int tok_bos(const tokenizer_t *t) { return t->bos; }
int tok_eos(const tokenizer_t *t) { return t->eos; }
bool tok_add_bos(const tokenizer_t *t) { return t->add_bos; }
bool tok_is_special(const tokenizer_t *t, int id) {
    return id >= 0 && id < t->n_tok && (t->tok[id].flags & TF_SPECIAL);
}
bool tok_is_eog(const tokenizer_t *t, int id) { return id >= 0 && id < t->n_tok && t->eog[id]; }
const char *tok_token_str(const tokenizer_t *t, int id) {
    return id >= 0 && id < t->n_tok ? t->tok[id].s : NULL;
}
int tok_find(const tokenizer_t *t, const char *s) { return s ? tok_lookup(t, s, strlen(s)) : -1; }
