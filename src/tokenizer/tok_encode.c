/*
 * tok_encode: the encode driver: added/special-token matching on the raw and normalized
 * text, the BPE model (by merge rank or by SPM score) and the post-processor (BOS/EOS ids).
 * Normalizers and pre-tokenizers are in tok_pretok.c.
 */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tok_internal.h"

bool tok_pair_get(const tokenizer_t *t, int32_t a, int32_t b, int32_t *rank, int32_t *merged);

/* ---- small helpers ---- */

typedef struct {
    int32_t *v;
    size_t n, cap;
} idvec;

static kv_status idvec_push(idvec *a, int32_t id) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = kv_realloc(a->v, cap * sizeof *v);
        if (!v) return KV_ENOMEM;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return KV_OK;
}

static bool cp_is_word(int32_t cp) {
    if (cp == '_') return true;
    utf8proc_category_t c = utf8proc_category(cp);
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
           (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO) ||
           (c >= UTF8PROC_CATEGORY_MN && c <= UTF8PROC_CATEGORY_ME);
}

/* ---- BPE model ---- */

struct sym {
    int32_t id;
    int32_t prev, next;
    uint32_t start, len; /* byte span in the word */
};
struct cand {
    uint64_t key; /* (priority as an order-preserving uint32) << 32 | pos: smaller first */
    uint32_t pos;
    int32_t a, b; /* rank mode: ids expected at pos / next; score mode: a = total length */
    int32_t merged;
};
typedef struct {
    struct cand *h;
    size_t n, cap;
} heap;

static inline bool cand_less(const struct cand *x, const struct cand *y) { return x->key < y->key; }

/* float -> uint32 with the same order (no NaNs in scores) */
static inline uint32_t f32_order(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
static kv_status heap_push(heap *h, struct cand c) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        struct cand *v = kv_realloc(h->h, cap * sizeof *v);
        if (!v) return KV_ENOMEM;
        h->h = v;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h->h[p])) break;
        h->h[i] = h->h[p];
        i = p;
    }
    h->h[i] = c;
    return KV_OK;
}
static struct cand heap_pop(heap *h) {
    struct cand top = h->h[0], last = h->h[--h->n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const struct cand *best = &last;
        if (l < h->n && cand_less(&h->h[l], best)) {
            m = l;
            best = &h->h[l];
        }
        if (r < h->n && cand_less(&h->h[r], best)) m = r;
        if (m == i) break;
        h->h[i] = h->h[m];
        i = m;
    }
    if (h->n) h->h[i] = last;
    return top;
}

static inline int model_lookup(const tokenizer_t *t, const char *s, size_t n) {
    int id = tok_lookup(t, s, n);
    return id >= 0 && (t->tok[id].flags & TF_MODEL) ? id : -1;
}

struct bpe_scratch {
    struct sym *sy;
    size_t cap;
    heap h;
};

static kv_status add_cand(const tokenizer_t *t, const char *w, struct sym *sy, int32_t l, heap *h) {
    if (l < 0) return KV_OK;
    int32_t r = sy[l].next;
    if (r < 0) return KV_OK;
    if (t->model == M_BPE_RANK) {
        int32_t rank, merged;
        if (sy[l].id < 0 || sy[r].id < 0 || !tok_pair_get(t, sy[l].id, sy[r].id, &rank, &merged)) return KV_OK;
        return heap_push(h, (struct cand){((uint64_t)(uint32_t)rank << 32) | (uint32_t)l, (uint32_t)l, sy[l].id,
                                          sy[r].id, merged});
    }
    uint32_t tot = sy[l].len + sy[r].len;
    int id = model_lookup(t, w + sy[l].start, tot);
    if (id < 0) return KV_OK;
    return heap_push(h, (struct cand){((uint64_t)f32_order(-t->tok[id].score) << 32) | (uint32_t)l, (uint32_t)l,
                                      (int32_t)tot, 0, id});
}

static kv_status emit_bytes(const tokenizer_t *t, const char *s, size_t n, idvec *out) {
    for (size_t i = 0; i < n; i++) {
        int id = t->byte_tok[(unsigned char)s[i]];
        if (id < 0) id = t->unk;
        if (id >= 0 && idvec_push(out, id)) return KV_ENOMEM;
    }
    return KV_OK;
}

static kv_status bpe_word(const tokenizer_t *t, const char *w, size_t n, struct bpe_scratch *sc, idvec *out) {
    if (n == 0) return KV_OK;
    if (t->ignore_merges) {
        int id = model_lookup(t, w, n);
        if (id >= 0) return idvec_push(out, id);
    }
    if (sc->cap < n) {
        struct sym *s = kv_realloc(sc->sy, n * sizeof *s);
        if (!s) return KV_ENOMEM;
        sc->sy = s;
        sc->cap = n;
    }
    struct sym *sy = sc->sy;
    int32_t ns = 0;
    for (size_t i = 0; i < n;) {
        size_t l = tok_u8len(w + i, n - i);
        int id = model_lookup(t, w + i, l);
        if (id < 0 && t->model == M_BPE_RANK) {
            bool all = t->byte_fallback;
            for (size_t k = 0; all && k < l; k++) all = t->byte_tok[(unsigned char)w[i + k]] >= 0;
            if (all) {
                for (size_t k = 0; k < l; k++, ns++)
                    sy[ns] = (struct sym){t->byte_tok[(unsigned char)w[i + k]], ns - 1, ns + 1, (uint32_t)(i + k), 1};
                i += l;
                continue;
            }
            if (t->unk < 0) { /* HF would fail; we drop nothing: byte tokens or skip */
                i += l;
                continue;
            }
            if (t->fuse_unk && ns > 0 && sy[ns - 1].id == t->unk) {
                sy[ns - 1].len += (uint32_t)l;
                i += l;
                continue;
            }
            id = t->unk;
        }
        sy[ns] = (struct sym){id, ns - 1, ns + 1, (uint32_t)i, (uint32_t)l};
        ns++;
        i += l;
    }
    if (ns == 0) return KV_OK;
    sy[ns - 1].next = -1;
    sc->h.n = 0;
    kv_status st = KV_OK;
    for (int32_t i = 0; i + 1 < ns && !st; i++) st = add_cand(t, w, sy, i, &sc->h);
    while (!st && sc->h.n) {
        struct cand c = heap_pop(&sc->h);
        struct sym *L = &sy[c.pos];
        if (L->len == 0 || L->next < 0) continue;
        struct sym *R = &sy[L->next];
        if (t->model == M_BPE_RANK) {
            if (L->id != c.a || R->id != c.b) continue;
        } else {
            if (R->len == 0 || L->len + R->len != (uint32_t)c.a) continue;
        }
        L->id = c.merged;
        L->len += R->len;
        R->len = 0;
        L->next = R->next;
        if (R->next >= 0) sy[R->next].prev = (int32_t)c.pos;
        st = add_cand(t, w, sy, L->prev, &sc->h);
        if (!st) st = add_cand(t, w, sy, (int32_t)c.pos, &sc->h);
    }
    for (int32_t i = 0; i >= 0 && !st; i = sy[i].next) {
        if (sy[i].id >= 0) st = idvec_push(out, sy[i].id);
        else st = emit_bytes(t, w + sy[i].start, sy[i].len, out); /* score mode: no token for char */
    }
    return st;
}

/* ---- one plain-text segment (already normalized): pre-tokenize, model ---- */
static kv_status encode_plain(const tokenizer_t *t, const char *s, size_t n, bool first, struct bpe_scratch *sc,
                              idvec *out) {
    tok_pieces a;
    kv_status st = tok_pretokenize(t, s, n, first, &a);
    for (size_t i = 0; i < a.n && !st; i++) {
        const char *w = a.buf.data + a.s[i].off;
        size_t wn = a.s[i].len;
        if (!t->spm_split) {
            st = bpe_word(t, w, wn, sc, out);
            continue;
        }
        /* split before each U+2581 run that follows another character (see tok_internal.h) */
        size_t start = 0;
        for (size_t k = 1; k + 3 <= wn && !st; k++) {
            if (memcmp(w + k, "\xe2\x96\x81", 3) != 0) continue;
            if (k >= 3 && !memcmp(w + k - 3, "\xe2\x96\x81", 3)) {
                k += 2;
                continue;
            }
            st = bpe_word(t, w + start, k - start, sc, out);
            start = k;
            k += 2;
        }
        if (!st) st = bpe_word(t, w + start, wn - start, sc, out);
    }
    tok_pieces_free(&a);
    return st;
}

/* ---- added tokens ---- */

static bool added_active(const struct added_token *a, bool parse_special, int pass) {
    if (a->special && !parse_special) return false;
    /* pass 0: raw text, tokens with normalized=false; pass 1: normalized text */
    return pass == 0 ? !a->normalized : a->normalized;
}

/* Finds the leftmost-longest active added token in s[from..n). Returns its index or -1 and
 * the matched span (with lstrip/rstrip extension) in *ms, *me; *ts, *te: token itself. */
static int find_added(const tokenizer_t *t, const char *s, size_t n, size_t from, bool parse_special, int pass,
                      size_t *ms, size_t *me) {
    if (!t->n_added) return -1;
    for (size_t i = from; i < n; i++) {
        unsigned char c0 = (unsigned char)s[i];
        for (int32_t q = t->added_first[c0]; q < t->added_first[c0 + 1]; q++) { /* longest first */
            int k = t->added_idx[q];
            const struct added_token *a = &t->added[k];
            if (a->len > n - i || !added_active(a, parse_special, pass)) continue;
            if (memcmp(s + i, a->s, a->len) != 0) continue;
            size_t e = i + a->len;
            if (a->single_word) {
                bool okl = true, okr = true;
                if (i > 0) {
                    size_t b = i - 1;
                    while (b > 0 && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
                    okl = !cp_is_word(tok_u8decode(s + b, i - b));
                }
                if (e < n) okr = !cp_is_word(tok_u8decode(s + e, tok_u8len(s + e, n - e)));
                if (!okl || !okr) continue;
            }
            size_t b = i;
            if (a->lstrip)
                while (b > from) {
                    size_t p = b - 1;
                    while (p > from && ((unsigned char)s[p] & 0xC0) == 0x80) p--;
                    if (!tok_cp_is_space(tok_u8decode(s + p, b - p))) break;
                    b = p;
                }
            if (a->rstrip)
                while (e < n) {
                    size_t l = tok_u8len(s + e, n - e);
                    if (!tok_cp_is_space(tok_u8decode(s + e, l))) break;
                    e += l;
                }
            *ms = b;
            *me = e;
            return k;
        }
    }
    return -1;
}

static bool any_added(const tokenizer_t *t, bool parse_special, int pass) {
    for (int k = 0; k < t->n_added; k++)
        if (added_active(&t->added[k], parse_special, pass)) return true;
    return false;
}

/* pass-1 handling of a raw (not yet normalized) segment */
static kv_status encode_raw(const tokenizer_t *t, const char *s, size_t n, bool first, bool parse_special,
                            struct bpe_scratch *sc, kv_buf *nb, idvec *out) {
    kv_status st = tok_normalize(t, s, n, nb);
    if (st) return st;
    const char *ns = nb->data ? nb->data : "";
    size_t nn = nb->len;
    if (!any_added(t, parse_special, 1)) return encode_plain(t, ns, nn, first, sc, out);
    /* copy: nb is reused by nobody below, but keep it simple and safe */
    char *cp = kv_strndup(ns, nn);
    if (!cp) return KV_ENOMEM;
    size_t pos = 0;
    while (!st) {
        size_t ms, me;
        int k = find_added(t, cp, nn, pos, parse_special, 1, &ms, &me);
        size_t end = k >= 0 ? ms : nn;
        if (end > pos) st = encode_plain(t, cp + pos, end - pos, first && pos == 0, sc, out);
        if (k < 0 || st) break;
        st = idvec_push(out, t->added[k].id);
        pos = me;
    }
    free(cp);
    return st;
}

kv_status tok_encode(const tokenizer_t *t, const char *text, size_t len, bool add_special, bool parse_special,
                     int32_t **ids, size_t *n_ids) {
    if (!t || (!text && len) || !ids || !n_ids) return KV_EINVAL;
    tok_bytelevel_init();
    idvec out = {0};
    struct bpe_scratch sc = {0};
    kv_buf nb;
    kv_buf_init(&nb);
    kv_status st = KV_OK;
    if (add_special)
        for (int i = 0; i < t->n_prefix && !st; i++) st = idvec_push(&out, t->prefix_ids[i]);
    size_t pos = 0;
    while (!st) {
        size_t ms = len, me = len;
        int k = text ? find_added(t, text, len, pos, parse_special, 0, &ms, &me) : -1;
        size_t end = k >= 0 ? ms : len;
        if (end > pos) st = encode_raw(t, text + pos, end - pos, pos == 0, parse_special, &sc, &nb, &out);
        if (k < 0 || st) break;
        st = idvec_push(&out, t->added[k].id);
        pos = me;
    }
    if (add_special)
        for (int i = 0; i < t->n_suffix && !st; i++) st = idvec_push(&out, t->suffix_ids[i]);
    free(sc.sy);
    free(sc.h.h);
    kv_buf_free(&nb);
    if (st) {
        free(out.v);
        return st;
    }
    if (!out.v) {
        out.v = kv_malloc(sizeof(int32_t));
        if (!out.v) return KV_ENOMEM;
    }
    *ids = out.v;
    *n_ids = out.n;
    return KV_OK;
}