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

/* ---- regex classes as HF tokenizers (Oniguruma, Unicode 16) sees them ----
 * PCRE2 10.42 (Debian 12) carries Unicode 14 tables and counts U+180E as \s; HF's
 * Oniguruma does not, and knows the letters/digits/punctuation added in Unicode 15-16.
 * Patterns are rewritten so that \s, \S, \p{L}, \p{N}, \p{P} (and \P{..}) mean exactly what
 * they mean to HF. The extra ranges were found by probing every code point with HF's
 * Split pre-tokenizer and PCRE2 (tests/e2e/test_tok_diff.sh finds any new drift). */
#define HF_SPACE "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define EXTRA_L                                                                                 \
    "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}"               \
    "\\x{10D4A}-\\x{10D65}\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}"         \
    "\\x{11380}-\\x{11389}\\x{1138B}\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}"           \
    "\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}"          \
    "\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}\\x{16100}-\\x{1611D}"                    \
    "\\x{16D40}-\\x{16D6C}\\x{18CFF}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}"                     \
    "\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}"          \
    "\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}"
#define EXTRA_N                                                                                 \
    "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"         \
    "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}"         \
    "\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}"
#define EXTRA_P                                                                                 \
    "\\x{1B4E}-\\x{1B4F}\\x{1B7F}\\x{10D6E}\\x{113D4}-\\x{113D5}\\x{113D7}-\\x{113D8}"             \
    "\\x{11B00}-\\x{11B09}\\x{11BE1}\\x{11F43}-\\x{11F4F}\\x{16D6D}-\\x{16D6F}\\x{1E5FF}"

static const uint32_t k_extra_n[][2] = {{0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9},
                                        {0x11F50, 0x11F59}, {0x16130, 0x16139}, {0x16D70, 0x16D79},
                                        {0x1CCF0, 0x1CCF9}, {0x1D2C0, 0x1D2D3}, {0x1E4F0, 0x1E4F9},
                                        {0x1E5F1, 0x1E5FA}};

bool tok_cp_extra_numeric(int32_t cp) {
    for (size_t i = 0; i < sizeof k_extra_n / sizeof k_extra_n[0]; i++)
        if ((uint32_t)cp >= k_extra_n[i][0] && (uint32_t)cp <= k_extra_n[i][1]) return true;
    return false;
}

/* Rewrites pat into out (see above). Escapes other than these pass through unchanged. */
static kv_status regex_rewrite(const char *pat, size_t len, kv_buf *out) {
    int depth = 0; /* inside [...] (POSIX [:name:] does not nest further here) */
    for (size_t i = 0; i < len; i++) {
        char c = pat[i];
        const char *rep = NULL;
        size_t skip = 0;
        if (c == '\\' && i + 1 < len) {
            char d = pat[i + 1];
            bool in = depth > 0;
            if (d == 's') rep = in ? HF_SPACE : "[" HF_SPACE "]", skip = 2;
            else if (d == 'S' && !in) rep = "[^" HF_SPACE "]", skip = 2;
            else if ((d == 'p' || d == 'P') && i + 4 < len && pat[i + 2] == '{' && pat[i + 4] == '}' &&
                     (pat[i + 3] == 'L' || pat[i + 3] == 'N' || pat[i + 3] == 'P') && (d == 'p' || !in)) {
                char k = pat[i + 3];
                rep = k == 'L'   ? (in ? "\\p{L}" EXTRA_L : d == 'p' ? "[\\p{L}" EXTRA_L "]" : "[^\\p{L}" EXTRA_L "]")
                      : k == 'N' ? (in ? "\\p{N}" EXTRA_N : d == 'p' ? "[\\p{N}" EXTRA_N "]" : "[^\\p{N}" EXTRA_N "]")
                                 : (in ? "\\p{P}" EXTRA_P : d == 'p' ? "[\\p{P}" EXTRA_P "]" : "[^\\p{P}" EXTRA_P "]");
                skip = 5;
            }
            if (!rep) { /* any other escape: copy both characters */
                if (kv_buf_append(out, pat + i, 2)) return KV_ENOMEM;
                i++;
                continue;
            }
            if (kv_buf_puts(out, rep)) return KV_ENOMEM;
            i += skip - 1;
            continue;
        }
        if (c == '[') {
            if (depth == 0) {
                depth = 1;
                /* a ']' right after '[' or '[^' is a literal member */
                size_t j = i + 1;
                if (j < len && pat[j] == '^') j++;
                if (j < len && pat[j] == ']') {
                    if (kv_buf_append(out, pat + i, j + 1 - i)) return KV_ENOMEM;
                    i = j;
                    continue;
                }
            } else if (i + 1 < len && pat[i + 1] == ':') {
                const char *e = memchr(pat + i, ']', len - i);
                if (e) {
                    if (kv_buf_append(out, pat + i, (size_t)(e - (pat + i)) + 1)) return KV_ENOMEM;
                    i = (size_t)(e - pat);
                    continue;
                }
            }
        } else if (c == ']' && depth > 0) {
            depth = 0;
        }
        if (kv_buf_append(out, &c, 1)) return KV_ENOMEM;
    }
    return KV_OK;
}

pcre2_code *tok_regex_compile(const char *pat, size_t len, char *err, size_t errlen) {
    int ec;
    PCRE2_SIZE eo;
    kv_buf rw;
    kv_buf_init(&rw);
    if (regex_rewrite(pat, len, &rw)) {
        kv_buf_free(&rw);
        kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        return NULL;
    }
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)kv_buf_cstr(&rw), rw.len, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    kv_buf_free(&rw);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof msg);
        kv_errf(KV_EFORMAT, err, errlen, "regex /%.*s/: %s", (int)(len > 200 ? 200 : len), pat, (char *)msg);
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

int tok_parse_byte_token(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

kv_status tok_finalize(tokenizer_t *t, char *err, size_t errlen) {
    kv_status st = tok_finalize_map_only(t);
    if (st) return st;
    for (int b = 0; b < 256; b++) t->byte_tok[b] = -1;
    for (int id = 0; id < t->n_tok; id++) {
        struct tok_entry *e = &t->tok[id];
        /* "<0xHH>", exactly two hex digits (sscanf's %2x took "<0x-7>" and indexed byte_tok
         * with 0xFFFFFFF9: found by fuzz_tokenizer_json) */
        const int v = tok_parse_byte_token(e->s, e->len);
        if (v >= 0) {
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
    bool any_mark = false, crossing = false;
    for (int id = 0; id < t->n_tok && !crossing; id++) {
        const struct tok_entry *e = &t->tok[id];
        if (!(e->flags & TF_MODEL) || e->len < 3) continue;
        for (const char *m = e->s; (m = memmem(m, e->len - (size_t)(m - e->s), "\xe2\x96\x81", 3)); m += 3) {
            any_mark = true;
            if (m > e->s && !(m - e->s >= 3 && !memcmp(m - 3, "\xe2\x96\x81", 3))) crossing = true;
        }
    }
    t->spm_split = any_mark && !crossing && !t->ignore_merges;
    t->added_idx = kv_malloc(((size_t)t->n_added + 1) * sizeof *t->added_idx);
    if (!t->added_idx) return KV_ENOMEM;
    memset(t->added_first, 0, sizeof t->added_first);
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len) t->added_first[(unsigned char)t->added[i].s[0] + 1]++;
    for (int b = 0; b < 256; b++) t->added_first[b + 1] += t->added_first[b];
    int32_t fill[256];
    memcpy(fill, t->added_first, sizeof fill);
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len) t->added_idx[fill[(unsigned char)t->added[i].s[0]]++] = i;
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
    free(t->added_idx);
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

bool tok_text_starts_with_bos(const tokenizer_t *t, const char *text, size_t len) {
    int bos = t ? tok_bos(t) : -1;
    const char *s = bos >= 0 ? tok_token_str(t, bos) : NULL;
    size_t n = s ? strlen(s) : 0;
    return n > 0 && text && len >= n && memcmp(text, s, n) == 0;
}
