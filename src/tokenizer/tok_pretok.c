/*
 * tok_pretok: the text stages before the model: the GPT-2 byte-level byte<->char table,
 * normalizers (NFC/NFD/NFKC/NFKD, Lowercase, Prepend, Replace, Strip) and pre-tokenizers
 * (Split by PCRE2 regex or literal with HF's split behaviours, ByteLevel, Metaspace, Digits),
 * including regex matching over possibly invalid UTF-8. Added tokens, the BPE model and the
 * encode driver live in tok_encode.c.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tok_internal.h"

/* Rust char::is_numeric (HF Digits): general category Nd, Nl or No, Unicode 16. */
static bool cp_is_num(int32_t cp) {
    if (cp < 0) return false;
    if (cp < 128) return cp >= '0' && cp <= '9';
    utf8proc_category_t c = utf8proc_category(cp);
    return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO ||
           tok_cp_extra_numeric(cp);
}

/* ---- byte-level (GPT-2) byte <-> char table ---- */
static char g_bl_enc[256][3];
static uint8_t g_bl_len[256];
static int16_t g_bl_dec[512]; /* codepoint -> byte, -1 if not a byte-level char */
static pthread_once_t g_bl_once = PTHREAD_ONCE_INIT;

static void bl_init(void) {
    for (int i = 0; i < 512; i++) g_bl_dec[i] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int cp;
        if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) cp = b;
        else cp = 256 + extra++;
        g_bl_dec[cp] = (int16_t)b;
        if (cp < 0x80) {
            g_bl_enc[b][0] = (char)cp;
            g_bl_len[b] = 1;
        } else {
            g_bl_enc[b][0] = (char)(0xC0 | (cp >> 6));
            g_bl_enc[b][1] = (char)(0x80 | (cp & 0x3F));
            g_bl_len[b] = 2;
        }
    }
}

void tok_bytelevel_init(void) { pthread_once(&g_bl_once, bl_init); }

void tok_bytelevel_tables(const int16_t **dec) {
    pthread_once(&g_bl_once, bl_init);
    *dec = g_bl_dec;
}

/* ---- pieces (tok_pieces in tok_internal.h) ---- */
static kv_status pieces_add(tok_pieces *p, const char *data, size_t len, bool first) {
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 16;
        struct tok_span *s = kv_realloc(p->s, cap * sizeof *s);
        if (!s) return KV_ENOMEM;
        p->s = s;
        p->cap = cap;
    }
    size_t off = p->buf.len;
    if (len && kv_buf_append(&p->buf, data, len)) return KV_ENOMEM;
    p->s[p->n++] = (struct tok_span){off, len, first};
    return KV_OK;
}

void tok_pieces_free(tok_pieces *p) {
    kv_buf_free(&p->buf);
    free(p->s);
}

/* ---- regex matching over possibly invalid UTF-8 ----
 * Calls cb for each match [s,e) in text[0..n). Invalid bytes never match. */
typedef kv_status (*match_cb)(void *ctx, size_t s, size_t e);

static kv_status regex_each(const pcre2_code *re, const char *text, size_t n, match_cb cb, void *ctx) {
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) return KV_ENOMEM;
    kv_status st = KV_OK;
    size_t run = 0;
    while (run < n && st == KV_OK) {
        /* one maximal valid UTF-8 run [run, end) */
        size_t end = run;
        while (end < n) {
            size_t l = tok_u8len(text + end, n - end);
            if (l == 1 && (unsigned char)text[end] >= 0x80) break;
            end += l;
        }
        size_t pos = run;
        while (pos < end) {
            int rc = pcre2_jit_match(re, (PCRE2_SPTR)text + run, end - run, pos - run, PCRE2_NO_UTF_CHECK,
                                     md, NULL);
            if (rc == PCRE2_ERROR_JIT_BADOPTION || rc == PCRE2_ERROR_JIT_STACKLIMIT)
                rc = pcre2_match(re, (PCRE2_SPTR)text + run, end - run, pos - run, PCRE2_NO_UTF_CHECK, md,
                                 NULL);
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc < 0) {
                st = KV_EINTERNAL;
                break;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            size_t s = run + ov[0], e = run + ov[1];
            if (e == s) { /* empty match: step one character */
                pos = s + tok_u8len(text + s, end - s);
                continue;
            }
            if ((st = cb(ctx, s, e))) break;
            pos = e;
        }
        run = end;
        if (run < n) run++; /* skip the invalid byte (never part of a match) */
    }
    pcre2_match_data_free(md);
    return st;
}

/* ---- Split with a behaviour ---- */
struct split_ctx {
    size_t *m; /* pairs */
    size_t n, cap;
};
static kv_status split_cb(void *ctx, size_t s, size_t e) {
    struct split_ctx *c = ctx;
    if (c->n + 2 > c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 64;
        size_t *m = kv_realloc(c->m, cap * sizeof *m);
        if (!m) return KV_ENOMEM;
        c->m = m;
        c->cap = cap;
    }
    c->m[c->n++] = s;
    c->m[c->n++] = e;
    return KV_OK;
}

static kv_status literal_each(const char *lit, size_t ll, const char *text, size_t n, match_cb cb, void *ctx) {
    if (!ll) return KV_OK;
    for (size_t i = 0; i + ll <= n;) {
        if (memcmp(text + i, lit, ll) == 0) {
            kv_status st = cb(ctx, i, i + ll);
            if (st) return st;
            i += ll;
        } else {
            i++;
        }
    }
    return KV_OK;
}

/* Splits text[0..n) into pieces according to match spans and behaviour. */
static kv_status split_apply(const char *text, size_t n, bool first, const size_t *m, size_t nm,
                             enum split_behavior b, bool invert, tok_pieces *out) {
    /* build alternating list of (start,end,is_match) */
    kv_status st = KV_OK;
    size_t pos = 0;
    size_t pend_s = 0, pend_len = 0; /* pending span for merges */
    bool have_pend = false;
    size_t i = 0;
    bool cur_first = first;
#define EMIT(S, L)                                                           \
    do {                                                                     \
        if ((L) > 0) {                                                       \
            if ((st = pieces_add(out, text + (S), (L), cur_first && (S) == 0))) return st; \
        }                                                                    \
    } while (0)
    while (pos < n || i < nm) {
        size_t s, e;
        bool is_match;
        if (i < nm && m[i] == pos) {
            s = m[i];
            e = m[i + 1];
            is_match = true;
            i += 2;
        } else {
            s = pos;
            e = i < nm ? m[i] : n;
            is_match = false;
        }
        pos = e;
        if (invert) is_match = !is_match;
        switch (b) {
        case SB_ISOLATED: EMIT(s, e - s); break;
        case SB_REMOVED:
            if (!is_match) EMIT(s, e - s);
            break;
        case SB_MERGED_PREV:
            if (is_match) {
                if (have_pend) {
                    EMIT(pend_s, e - pend_s);
                    have_pend = false;
                } else {
                    EMIT(s, e - s);
                }
            } else {
                if (have_pend) EMIT(pend_s, pend_len);
                pend_s = s;
                pend_len = e - s;
                have_pend = true;
            }
            break;
        case SB_MERGED_NEXT:
            if (is_match) {
                if (have_pend) EMIT(pend_s, pend_len);
                pend_s = s;
                pend_len = e - s;
                have_pend = true;
            } else {
                if (have_pend) {
                    EMIT(pend_s, e - pend_s);
                    have_pend = false;
                } else {
                    EMIT(s, e - s);
                }
            }
            break;
        case SB_CONTIGUOUS:
            if (is_match) {
                if (have_pend) pend_len = e - pend_s;
                else {
                    pend_s = s;
                    pend_len = e - s;
                    have_pend = true;
                }
            } else {
                if (have_pend) {
                    EMIT(pend_s, pend_len);
                    have_pend = false;
                }
                EMIT(s, e - s);
            }
            break;
        }
    }
    if (have_pend) EMIT(pend_s, pend_len);
#undef EMIT
    return st;
}

static kv_status split_piece(const pcre2_code *re, const char *lit, size_t litlen, const char *text, size_t n,
                             bool first, enum split_behavior b, bool invert, tok_pieces *out) {
    struct split_ctx c = {0};
    kv_status st = re ? regex_each(re, text, n, split_cb, &c) : literal_each(lit, litlen, text, n, split_cb, &c);
    if (st == KV_OK) st = split_apply(text, n, first, c.m, c.n, b, invert, out);
    free(c.m);
    return st;
}

/* ---- normalizers ---- */

static kv_status buf_replace(kv_buf *out, const char *s, size_t n, const char *a, size_t al, const char *b,
                             size_t bl) {
    size_t i = 0, last = 0;
    while (al && i + al <= n) {
        if (memcmp(s + i, a, al) == 0) {
            if (kv_buf_append(out, s + last, i - last) || kv_buf_append(out, b, bl)) return KV_ENOMEM;
            i += al;
            last = i;
        } else {
            i++;
        }
    }
    return kv_buf_append(out, s + last, n - last) ? KV_ENOMEM : KV_OK;
}

struct repl_ctx {
    kv_buf *out;
    const char *s;
    size_t last;
    const char *b;
    size_t bl;
};
static kv_status repl_cb(void *ctx, size_t s, size_t e) {
    struct repl_ctx *c = ctx;
    if (kv_buf_append(c->out, c->s + c->last, s - c->last) || kv_buf_append(c->out, c->b, c->bl))
        return KV_ENOMEM;
    c->last = e;
    return KV_OK;
}

/* Combining marks (Unicode 11-15) that HF tokenizers' normalizers (the unicode-normalization
 * crate's tables) treat as canonical-combining-class 0 with no compositions, while utf8proc
 * reorders/blocks them by their real class. Found by probing every code point against HF's
 * NFC with marks of classes 7..240 before and after it; splitting the text around them
 * reproduces HF exactly. */
static const uint32_t k_hf_ccc0[][2] = {
    {0x7FD, 0x7FD}, {0x898, 0x89F}, {0x8CA, 0x8D3}, {0x9FE, 0x9FE}, {0xC3C, 0xC3C}, {0xD3B, 0xD3C},
    {0xEBA, 0xEBA}, {0x1715, 0x1715}, {0x1ABF, 0x1ACE}, {0x1DF6, 0x1DFA}, {0xA82C, 0xA82C},
    {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50}, {0x10F82, 0x10F85},
    {0x11070, 0x11070}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E}, {0x11839, 0x1183A}, {0x1193D, 0x1193E},
    {0x11943, 0x11943}, {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47}, {0x11A99, 0x11A99},
    {0x11D42, 0x11D42}, {0x11D44, 0x11D45}, {0x11D97, 0x11D97}, {0x11F41, 0x11F42}, {0x16FF0, 0x16FF1},
    {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1E4EC, 0x1E4EF}
};

static bool hf_norm_starter(int32_t cp) {
    if (cp < 0x7fd) return false;
    for (size_t i = 0; i < sizeof k_hf_ccc0 / sizeof k_hf_ccc0[0]; i++) {
        if ((uint32_t)cp < k_hf_ccc0[i][0]) return false;
        if ((uint32_t)cp <= k_hf_ccc0[i][1]) return true;
    }
    return false;
}

/* Applies a utf8proc transformation to each valid run; invalid bytes pass through, and so
 * do the marks of hf_norm_starter() (the runs are split around them). */
static bool has_byte_ge(const char *s, size_t n, unsigned char lim) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= lim) return true;
    return false;
}

static kv_status u8map_runs(kv_buf *out, const char *s, size_t n, int opts, bool lower) {
    size_t i = 0;
    while (i < n) {
        size_t end = i, brk = 0; /* brk: length of the pass-through unit at end */
        while (end < n) {
            size_t l = tok_u8len(s + end, n - end);
            if (l == 1 && (unsigned char)s[end] >= 0x80) {
                brk = 1;
                break;
            }
            if (l >= 3 && !lower && hf_norm_starter(tok_u8decode(s + end, l))) {
                brk = l;
                break;
            }
            end += l;
        }
        if (end > i) {
            if (lower) {
                for (size_t k = i; k < end;) {
                    size_t l = tok_u8len(s + k, end - k);
                    int32_t cp = utf8proc_tolower(tok_u8decode(s + k, l));
                    utf8proc_uint8_t enc[4];
                    utf8proc_ssize_t el = utf8proc_encode_char(cp, enc);
                    if (kv_buf_append(out, enc, (size_t)el)) return KV_ENOMEM;
                    k += l;
                }
            } else if (!(opts & UTF8PROC_COMPAT) && !has_byte_ge(s + i, end - i, 0xCC)) {
                /* below U+0300 every character is NFC and NFD-stable except the Latin-1/
                 * Latin Extended composites, which only NFD changes */
                bool nfd = (opts & UTF8PROC_DECOMPOSE) != 0;
                if (nfd && has_byte_ge(s + i, end - i, 0xC3)) goto slow;
                if (kv_buf_append(out, s + i, end - i)) return KV_ENOMEM;
            } else {
            slow:;
                utf8proc_uint8_t *r = NULL;
                utf8proc_ssize_t rl = utf8proc_map((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(end - i), &r,
                                                   (utf8proc_option_t)opts);
                if (rl < 0) return KV_EINTERNAL;
                kv_status st = kv_buf_append(out, r, (size_t)rl) ? KV_ENOMEM : KV_OK;
                free(r);
                if (st) return st;
            }
        }
        if (brk && kv_buf_append(out, s + end, brk)) return KV_ENOMEM;
        i = end + brk;
    }
    return KV_OK;
}

/* Normalizes s[0..n) into out (out is reset). */
kv_status tok_normalize(const tokenizer_t *t, const char *s, size_t n, kv_buf *out) {
    out->len = 0;
    if (kv_buf_append(out, s, n)) return KV_ENOMEM;
    kv_buf tmp;
    kv_buf_init(&tmp);
    kv_status st = KV_OK;
    for (int k = 0; k < t->n_norm && st == KV_OK; k++) {
        const struct norm_step *ns = &t->norm[k];
        tmp.len = 0;
        const char *cur = out->data ? out->data : "";
        size_t cl = out->len;
        switch (ns->kind) {
        case N_NFC: st = u8map_runs(&tmp, cur, cl, UTF8PROC_STABLE | UTF8PROC_COMPOSE, false); break;
        case N_NFD: st = u8map_runs(&tmp, cur, cl, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE, false); break;
        case N_NFKC:
            st = u8map_runs(&tmp, cur, cl, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT, false);
            break;
        case N_NFKD:
            st = u8map_runs(&tmp, cur, cl, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, false);
            break;
        case N_LOWERCASE: st = u8map_runs(&tmp, cur, cl, 0, true); break;
        case N_PREPEND:
            if (cl && (kv_buf_append(&tmp, ns->a, ns->alen) || kv_buf_append(&tmp, cur, cl))) st = KV_ENOMEM;
            break;
        case N_REPLACE:
            if (ns->re) {
                struct repl_ctx c = {&tmp, cur, 0, ns->b, ns->blen};
                st = regex_each(ns->re, cur, cl, repl_cb, &c);
                if (!st && kv_buf_append(&tmp, cur + c.last, cl - c.last)) st = KV_ENOMEM;
            } else {
                st = buf_replace(&tmp, cur, cl, ns->a, ns->alen, ns->b, ns->blen);
            }
            break;
        case N_STRIP: {
            size_t a = 0, b = cl;
            while (ns->left && a < b) {
                size_t l = tok_u8len(cur + a, b - a);
                if (!tok_cp_is_space(tok_u8decode(cur + a, l))) break;
                a += l;
            }
            while (ns->right && b > a) {
                size_t l = 1;
                while (l < 4 && b - l > a && ((unsigned char)cur[b - l] & 0xC0) == 0x80) l++;
                if (!tok_cp_is_space(tok_u8decode(cur + b - l, l))) break;
                b -= l;
            }
            if (kv_buf_append(&tmp, cur + a, b - a)) st = KV_ENOMEM;
            break;
        }
        }
        kv_buf sw = *out;
        *out = tmp;
        tmp = sw;
    }
    kv_buf_free(&tmp);
    return st;
}

/* ---- pre-tokenizers ---- */

static kv_status pre_step_apply(const tokenizer_t *t, const struct pre_step *ps, const tok_pieces *in,
                                tok_pieces *out) {
    kv_status st = KV_OK;
    kv_buf tmp;
    kv_buf_init(&tmp);
    for (size_t i = 0; i < in->n && st == KV_OK; i++) {
        const char *s = in->buf.data + in->s[i].off;
        size_t n = in->s[i].len;
        bool first = in->s[i].first;
        switch (ps->kind) {
        case P_SPLIT: st = split_piece(ps->re, ps->lit, ps->litlen, s, n, first, ps->behavior, ps->invert, out); break;
        case P_DIGITS: {
            size_t a = 0;
            while (a < n && st == KV_OK) {
                size_t l = tok_u8len(s + a, n - a);
                bool dig = cp_is_num(tok_u8decode(s + a, l));
                size_t b = a + l;
                if (!dig || !ps->individual_digits)
                    while (b < n) {
                        size_t l2 = tok_u8len(s + b, n - b);
                        if (cp_is_num(tok_u8decode(s + b, l2)) != dig) break;
                        b += l2;
                    }
                st = pieces_add(out, s + a, b - a, first && a == 0);
                a = b;
            }
            break;
        }
        case P_METASPACE: {
            tmp.len = 0;
            bool pre = ps->prepend == 2 || (ps->prepend == 1 && first);
            if (pre && n > 0 && !(n >= ps->repl_len && memcmp(s, ps->repl, ps->repl_len) == 0))
                if (kv_buf_append(&tmp, ps->repl, ps->repl_len)) st = KV_ENOMEM;
            if (!st) st = buf_replace(&tmp, s, n, " ", 1, ps->repl, ps->repl_len);
            if (st) break;
            if (ps->split)
                st = split_piece(NULL, ps->repl, ps->repl_len, tmp.data ? tmp.data : "", tmp.len, first, SB_MERGED_NEXT,
                                 false, out);
            else
                st = pieces_add(out, tmp.data, tmp.len, first);
            break;
        }
        case P_BYTELEVEL: {
            tmp.len = 0;
            if (ps->add_prefix_space && n > 0 && s[0] != ' ')
                if (kv_buf_append(&tmp, " ", 1)) st = KV_ENOMEM;
            if (!st && kv_buf_append(&tmp, s, n)) st = KV_ENOMEM;
            if (st) break;
            tok_pieces sub = {0};
            kv_buf_init(&sub.buf);
            if (ps->re) st = split_piece(ps->re, NULL, 0, tmp.data ? tmp.data : "", tmp.len, first, SB_ISOLATED, false, &sub);
            else st = pieces_add(&sub, tmp.data, tmp.len, first);
            for (size_t k = 0; k < sub.n && !st; k++) {
                kv_buf enc;
                kv_buf_init(&enc);
                const unsigned char *p = (const unsigned char *)sub.buf.data + sub.s[k].off;
                for (size_t j = 0; j < sub.s[k].len && !st; j++)
                    if (kv_buf_append(&enc, g_bl_enc[p[j]], g_bl_len[p[j]])) st = KV_ENOMEM;
                if (!st) st = pieces_add(out, enc.data, enc.len, sub.s[k].first);
                kv_buf_free(&enc);
            }
            tok_pieces_free(&sub);
            break;
        }
        }
    }
    kv_buf_free(&tmp);
    (void)t;
    return st;
}

kv_status tok_pretokenize(const tokenizer_t *t, const char *s, size_t n, bool first, tok_pieces *out) {
    tok_pieces a = {0}, b = {0};
    kv_buf_init(&a.buf);
    kv_buf_init(&b.buf);
    kv_status st = pieces_add(&a, s, n, first);
    for (int k = 0; k < t->n_pre && !st; k++) {
        b.n = 0;
        b.buf.len = 0;
        st = pre_step_apply(t, &t->pre[k], &a, &b);
        tok_pieces sw = a;
        a = b;
        b = sw;
    }
    tok_pieces_free(&b);
    *out = a;
    return st;
}
