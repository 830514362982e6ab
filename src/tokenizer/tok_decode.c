/* tok_decode: decoder chain, lossy UTF-8, token bytes, streaming detokenizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

static const char k_fffd[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Appends s[0..n) to out replacing each maximal invalid subsequence by U+FFFD (like
 * Rust's String::from_utf8_lossy). */
static kv_status append_lossy(kv_buf *out, const unsigned char *s, size_t n) {
    size_t i = 0, last = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else {
            if (kv_buf_append(out, s + last, i - last) || kv_buf_append(out, k_fffd, 3)) return KV_ENOMEM;
            last = ++i;
            continue;
        }
        size_t k = 1;
        bool ok = true;
        for (; k <= need; k++) {
            if (i + k >= n) {
                ok = false;
                break;
            }
            unsigned char d = s[i + k];
            unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
            if (d < l || d > h) {
                ok = false;
                break;
            }
        }
        if (ok) {
            i += need + 1;
            continue;
        }
        if (kv_buf_append(out, s + last, i - last) || kv_buf_append(out, k_fffd, 3)) return KV_ENOMEM;
        i += k; /* the valid prefix is one maximal subpart */
        last = i;
    }
    return kv_buf_append(out, s + last, n - last) ? KV_ENOMEM : KV_OK;
}

/* token list used by the decoder chain */
struct dtoks {
    kv_buf buf;
    size_t *off, *len;
    size_t n, cap;
};

static kv_status dt_add(struct dtoks *d, const void *s, size_t n) {
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 32;
        size_t *o = kv_realloc(d->off, cap * sizeof *o);
        if (!o) return KV_ENOMEM;
        d->off = o;
        size_t *l = kv_realloc(d->len, cap * sizeof *l);
        if (!l) return KV_ENOMEM;
        d->len = l;
        d->cap = cap;
    }
    d->off[d->n] = d->buf.len;
    d->len[d->n] = n;
    d->n++;
    return n && kv_buf_append(&d->buf, s, n) ? KV_ENOMEM : KV_OK;
}
static void dt_free(struct dtoks *d) {
    kv_buf_free(&d->buf);
    free(d->off);
    free(d->len);
}
static void dt_reset(struct dtoks *d) {
    d->n = 0;
    d->buf.len = 0;
}

static kv_status replace_into(kv_buf *o, const char *s, size_t n, const char *a, size_t al, const char *b, size_t bl) {
    size_t i = 0, last = 0;
    while (al && i + al <= n) {
        if (memcmp(s + i, a, al) == 0) {
            if (kv_buf_append(o, s + last, i - last) || kv_buf_append(o, b, bl)) return KV_ENOMEM;
            i += al;
            last = i;
        } else {
            i++;
        }
    }
    return kv_buf_append(o, s + last, n - last) ? KV_ENOMEM : KV_OK;
}

/* Runs the decoder chain on token strings; result bytes (not yet lossy-repaired) in out.
 * cont: the first token continues earlier output (no leading-space stripping). */
static kv_status run_decoders(const tokenizer_t *t, struct dtoks *a, bool cont, kv_buf *out) {
    struct dtoks b = {0};
    kv_buf_init(&b.buf);
    kv_status st = KV_OK;
    bool joined = false;
    for (int k = 0; k < t->n_dec && !st; k++) {
        const struct dec_step *ds = &t->dec[k];
        dt_reset(&b);
        const char *base = a->buf.data;
        switch (ds->kind) {
        case D_REPLACE:
            for (size_t i = 0; i < a->n && !st; i++) {
                size_t o0 = b.buf.len;
                st = replace_into(&b.buf, base + a->off[i], a->len[i], ds->a, ds->alen, ds->b, ds->blen);
                if (!st) {
                    size_t l = b.buf.len - o0;
                    b.buf.len = o0;
                    /* re-add through dt_add to keep the index arrays in sync */
                    char *tmp = kv_strndup(b.buf.data + o0, l);
                    if (!tmp) st = KV_ENOMEM;
                    else st = dt_add(&b, tmp, l);
                    free(tmp);
                }
            }
            break;
        case D_BYTEFALLBACK: {
            kv_buf run;
            kv_buf_init(&run);
            size_t nrun = 0;
            for (size_t i = 0; i <= a->n && !st; i++) {
                int v = i < a->n ? tok_parse_byte_token(base + a->off[i], a->len[i]) : -1;
                if (v >= 0) {
                    unsigned char c = (unsigned char)v;
                    if (kv_buf_append(&run, &c, 1)) st = KV_ENOMEM;
                    nrun++;
                    continue;
                }
                if (nrun) {
                    if (kv_utf8_valid(run.data, run.len)) st = dt_add(&b, run.data, run.len);
                    else
                        for (size_t r = 0; r < nrun && !st; r++) st = dt_add(&b, k_fffd, 3);
                    run.len = 0;
                    nrun = 0;
                }
                if (i < a->n && !st) st = dt_add(&b, base + a->off[i], a->len[i]);
            }
            kv_buf_free(&run);
            break;
        }
        case D_FUSE: {
            kv_buf j;
            kv_buf_init(&j);
            for (size_t i = 0; i < a->n && !st; i++)
                if (kv_buf_append(&j, base + a->off[i], a->len[i])) st = KV_ENOMEM;
            if (!st) st = dt_add(&b, j.data, j.len);
            kv_buf_free(&j);
            break;
        }
        case D_STRIP:
            for (size_t i = 0; i < a->n && !st; i++) {
                const char *s = base + a->off[i];
                size_t n = a->len[i];
                int sc = (i == 0 && cont) ? 0 : ds->start;
                for (int r = 0; r < sc && n >= ds->alen && ds->alen && memcmp(s, ds->a, ds->alen) == 0; r++) {
                    s += ds->alen;
                    n -= ds->alen;
                }
                for (int r = 0; r < ds->stop && n >= ds->alen && ds->alen && memcmp(s + n - ds->alen, ds->a, ds->alen) == 0;
                     r++)
                    n -= ds->alen;
                st = dt_add(&b, s, n);
            }
            break;
        case D_METASPACE:
            for (size_t i = 0; i < a->n && !st; i++) {
                kv_buf tmp;
                kv_buf_init(&tmp);
                st = replace_into(&tmp, base + a->off[i], a->len[i], ds->a, ds->alen, " ", 1);
                size_t skip = (!st && i == 0 && !cont && ds->prepend && tmp.len && tmp.data[0] == ' ') ? 1 : 0;
                if (!st) st = dt_add(&b, tmp.data ? tmp.data + skip : "", tmp.len - skip);
                kv_buf_free(&tmp);
            }
            break;
        case D_BYTELEVEL: {
            const int16_t *dec;
            tok_bytelevel_tables(&dec);
            kv_buf j;
            kv_buf_init(&j);
            for (size_t i = 0; i < a->n && !st; i++) {
                const unsigned char *s = (const unsigned char *)base + a->off[i];
                size_t n = a->len[i];
                for (size_t p = 0; p < n && !st;) {
                    int cp = -1;
                    size_t l = 1;
                    if (s[p] < 0x80) cp = s[p];
                    else if ((s[p] & 0xE0) == 0xC0 && p + 1 < n && (s[p + 1] & 0xC0) == 0x80) {
                        cp = ((s[p] & 0x1F) << 6) | (s[p + 1] & 0x3F);
                        l = 2;
                    }
                    if (cp >= 0 && cp < 512 && dec[cp] >= 0) {
                        unsigned char c = (unsigned char)dec[cp];
                        if (kv_buf_append(&j, &c, 1)) st = KV_ENOMEM;
                    } else {
                        if (cp < 0) { /* other multi-byte char: copy it whole */
                            int sl = kv_utf8_seq_len(s[p]);
                            l = sl > 0 && p + (size_t)sl <= n ? (size_t)sl : 1;
                        }
                        if (kv_buf_append(&j, s + p, l)) st = KV_ENOMEM;
                    }
                    p += l;
                }
            }
            if (!st) st = dt_add(&b, j.data, j.len);
            kv_buf_free(&j);
            break;
        }
        }
        struct dtoks sw = *a;
        *a = b;
        b = sw;
    }
    (void)joined;
    dt_free(&b);
    for (size_t i = 0; i < a->n && !st; i++)
        if (kv_buf_append(out, a->buf.data + a->off[i], a->len[i])) st = KV_ENOMEM;
    return st;
}

/* Decodes ids into raw bytes (before the final lossy repair). *open: the output may still
 * change when more ids follow (trailing byte-fallback run or incomplete UTF-8). *any: some
 * id was not skipped. */
static kv_status decode_raw(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special, bool cont,
                            kv_buf *out, bool *open, bool *any) {
    struct dtoks a = {0};
    kv_buf_init(&a.buf);
    kv_status st = KV_OK;
    int last = -1;
    for (size_t i = 0; i < n && !st; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_tok) {
            st = KV_EINVAL;
            break;
        }
        const struct tok_entry *e = &t->tok[ids[i]];
        if (skip_special && (e->flags & TF_SPECIAL)) continue;
        st = dt_add(&a, e->s, e->len);
        last = ids[i];
    }
    size_t o0 = out->len;
    if (!st) st = t->n_dec ? run_decoders(t, &a, cont, out) : kv_buf_append(out, a.buf.data, a.buf.len);
    dt_free(&a);
    if (any) *any = last >= 0;
    if (open) {
        bool bf = false;
        for (int k = 0; k < t->n_dec; k++) bf |= t->dec[k].kind == D_BYTEFALLBACK;
        *open = (last >= 0 && bf && (t->tok[last].flags & TF_BYTE)) ||
                kv_utf8_incomplete_tail(out->data ? out->data + o0 : "", out->len - o0) > 0;
    }
    return st;
}

kv_status tok_decode(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special, char **out,
                     size_t *out_len) {
    if (!t || (!ids && n) || !out) return KV_EINVAL;
    kv_buf raw, res;
    kv_buf_init(&raw);
    kv_buf_init(&res);
    kv_status st = decode_raw(t, ids, n, skip_special, false, &raw, NULL, NULL);
    if (!st) st = append_lossy(&res, (const unsigned char *)raw.data, raw.len);
    kv_buf_free(&raw);
    if (!st && !res.data && kv_buf_append(&res, "", 1) == 0) res.len = 0;
    if (st) {
        kv_buf_free(&res);
        return st;
    }
    kv_buf_cstr(&res);
    *out = res.data;
    if (out_len) *out_len = res.len;
    return KV_OK;
}

int tok_token_bytes(const tokenizer_t *t, int id, char *buf, size_t cap) {
    if (!t || id < 0 || id >= t->n_tok) return -1;
    const struct tok_entry *e = &t->tok[id];
    kv_buf raw;
    kv_buf_init(&raw);
    bool bf = false;
    for (int k = 0; k < t->n_dec; k++) bf |= t->dec[k].kind == D_BYTEFALLBACK;
    if ((e->flags & TF_BYTE) && bf) {
        if (kv_buf_append(&raw, &e->byte, 1)) return -1;
    } else if (decode_raw(t, &id, 1, false, true, &raw, NULL, NULL)) {
        kv_buf_free(&raw);
        return -1;
    }
    int n = (int)raw.len;
    if ((size_t)n > cap) n = -1;
    else if (n) memcpy(buf, raw.data, (size_t)n);
    kv_buf_free(&raw);
    return n;
}

/* ---- streaming ----
 * The ids since the last emission form a window; the window is decoded (as a continuation
 * once something was emitted) and emitted whole when its end is stable: no trailing byte
 * fallback run and no incomplete UTF-8 character. Decoding is concatenative at such points,
 * so the emitted text equals tok_decode(all generated ids, skip_special = true). */
struct tok_stream {
    const tokenizer_t *t;
    int32_t *win;
    size_t n, cap;
    bool emitted_any; /* a non-skipped id was emitted: later windows are continuations */
};

tok_stream_t *tok_stream_new(const tokenizer_t *t, const int32_t *prompt_ids, size_t n_prompt) {
    /* The prompt never contributes text; a non-empty prompt only makes the generated ids a
     * continuation (no leading-space strip), as llama.cpp renders completions (tokenizer.h). */
    (void)prompt_ids;
    if (!t) return NULL;
    tok_stream_t *s = kv_calloc(1, sizeof *s);
    if (s) {
        s->t = t;
        s->emitted_any = n_prompt > 0;
    }
    return s;
}

void tok_stream_free(tok_stream_t *s) {
    if (!s) return;
    free(s->win);
    free(s);
}

static kv_status stream_emit(tok_stream_t *s, kv_buf *out, bool final) {
    kv_buf raw;
    kv_buf_init(&raw);
    bool open = false, any = false;
    kv_status st = decode_raw(s->t, s->win, s->n, true, s->emitted_any, &raw, &open, &any);
    if (!st && (final || !open)) {
        st = append_lossy(out, (const unsigned char *)raw.data, raw.len);
        s->emitted_any |= any;
        s->n = 0;
    }
    kv_buf_free(&raw);
    return st;
}

kv_status tok_stream_push(tok_stream_t *s, int32_t id, kv_buf *out) {
    if (!s || !out || id < 0 || id >= s->t->n_tok) return KV_EINVAL;
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        int32_t *w = kv_realloc(s->win, cap * sizeof *w);
        if (!w) return KV_ENOMEM;
        s->win = w;
        s->cap = cap;
    }
    s->win[s->n++] = id;
    return stream_emit(s, out, false);
}

kv_status tok_stream_flush(tok_stream_t *s, kv_buf *out) {
    if (!s || !out) return KV_EINVAL;
    if (!s->n) return KV_OK;
    return stream_emit(s, out, true);
}
