/* lexer: the reference engine's preprocessing (trim_blocks, lstrip_blocks, generation tags)
 * and tokenizer, with positions mapped back to the original template text. */
#include <stdio.h>
#include <string.h>

#include "jinja_internal.h"

/* preprocessed text with the original offset of each byte */
struct ptext {
    char *s;
    size_t *orig;
    size_t n;
};

static void pt_alloc(struct jarena *a, struct ptext *p, size_t cap) {
    p->s = ja_alloc(a, cap + 1);
    p->orig = ja_alloc(a, (cap + 1) * sizeof(size_t));
    p->n = 0;
}
static void pt_put(struct ptext *p, const struct ptext *src, size_t i) {
    p->s[p->n] = src->s[i];
    p->orig[p->n++] = src->orig[i];
}

static bool is_line_term(const char *s, size_t n, size_t i, size_t *len) {
    if (s[i] == '\n' || s[i] == '\r') return *len = 1, true;
    /* U+2028 / U+2029 */
    if (i + 2 < n + 0 && (unsigned char)s[i] == 0xE2 && (unsigned char)s[i + 1] == 0x80 &&
        ((unsigned char)s[i + 2] == 0xA8 || (unsigned char)s[i + 2] == 0xA9))
        return *len = 3, true;
    return false;
}

/* matches "{%" "-"? \s* ("end")? "generation" \s* "-"? "%}" at i; returns the end or 0 */
static size_t gen_tag(const struct ptext *p, size_t i, bool *lstrip, bool *rstrip) {
    const char *s = p->s;
    size_t n = p->n, k;
    if (i + 1 >= n || s[i] != '{' || s[i + 1] != '%') return 0;
    i += 2;
    *lstrip = i < n && s[i] == '-';
    if (*lstrip) i++;
    while (i < n && (k = ju_space(s + i, n - i))) i += k;
    if (n - i >= 3 && !memcmp(s + i, "end", 3)) i += 3;
    if (n - i < 10 || memcmp(s + i, "generation", 10)) return 0;
    i += 10;
    while (i < n && (k = ju_space(s + i, n - i))) i += k;
    *rstrip = i < n && s[i] == '-';
    if (*rstrip) i++;
    if (n - i < 2 || s[i] != '%' || s[i + 1] != '}') return 0;
    return i + 2;
}

static void preprocess(struct jarena *a, const char *src, size_t len, struct ptext *out) {
    struct ptext p0, p1, p2, p3;
    pt_alloc(a, &p0, len);
    memcpy(p0.s, src, len);
    for (size_t i = 0; i < len; i++) p0.orig[i] = i;
    p0.n = len;
    if (p0.n && p0.s[p0.n - 1] == '\n') p0.n--;
    /* lstrip_blocks: /^[ \t]*({[#%-])/gm -> "$1" */
    pt_alloc(a, &p1, p0.n);
    bool bol = true;
    for (size_t i = 0; i < p0.n;) {
        if (bol) {
            size_t j = i;
            while (j < p0.n && (p0.s[j] == ' ' || p0.s[j] == '\t')) j++;
            if (j + 1 < p0.n && p0.s[j] == '{' && strchr("#%-", p0.s[j + 1])) i = j;
            bol = false;
            continue;
        }
        size_t tl;
        if (is_line_term(p0.s, p0.n, i, &tl)) {
            for (size_t k = 0; k < tl; k++) pt_put(&p1, &p0, i + k);
            i += tl;
            bol = true;
            continue;
        }
        pt_put(&p1, &p0, i++);
    }
    /* trim_blocks: /([#%-]})\n/g -> "$1" */
    pt_alloc(a, &p2, p1.n);
    for (size_t i = 0; i < p1.n;) {
        if (i + 2 < p1.n && strchr("#%-", p1.s[i]) && p1.s[i] && p1.s[i + 1] == '}' && p1.s[i + 2] == '\n') {
            pt_put(&p2, &p1, i);
            pt_put(&p2, &p1, i + 1);
            i += 3;
            continue;
        }
        pt_put(&p2, &p1, i++);
    }
    /* {% generation %} / {% endgeneration %} tags are dropped */
    pt_alloc(a, &p3, p2.n);
    size_t mark = 0;
    for (size_t i = 0; i < p2.n;) {
        bool ls, rs;
        size_t e = gen_tag(&p2, i, &ls, &rs);
        if (!e) {
            pt_put(&p3, &p2, i++);
            continue;
        }
        if (ls) {
            /* drop the whitespace run before the tag (emitted since the last match) */
            for (;;) {
                size_t k = p3.n, cl = 0;
                while (k > mark && ((unsigned char)p3.s[k - 1] & 0xC0) == 0x80) k--;
                if (k > mark) k--;
                else break;
                cl = ju_space(p3.s + k, p3.n - k);
                if (!cl || k + cl != p3.n) break;
                p3.n = k;
            }
        }
        i = e;
        size_t k;
        while (i < p2.n && (k = ju_space(p2.s + i, p2.n - i))) {
            if (!rs)
                for (size_t q = 0; q < k; q++) pt_put(&p3, &p2, i + q);
            i += k;
        }
        mark = p3.n;
    }
    p3.s[p3.n] = 0;
    p3.orig[p3.n] = len;
    *out = p3;
}

struct lexer {
    struct jarena *a;
    const char *src; /* original, for line/column */
    size_t *line_starts; size_t n_lines;
    struct ptext p;
    size_t pos;
    struct token *toks; size_t n, cap;
};

static void pos_of(const struct lexer *L, size_t ppos, int *line, int *col) {
    size_t off = L->p.orig[ppos < L->p.n ? ppos : L->p.n];
    size_t lo = 0, hi = L->n_lines; /* last line start <= off */
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (L->line_starts[mid] <= off) lo = mid;
        else hi = mid;
    }
    *line = (int)lo + 1;
    *col = (int)(off - L->line_starts[lo]) + 1;
}

_Noreturn static void lex_fail(struct lexer *L, const char *fmt, const char *arg) {
    int line, col;
    pos_of(L, L->pos, &line, &col);
    ja_fail(L->a, KV_EINVAL, line, col, fmt, arg);
}

static struct token *push(struct lexer *L, enum tk type, const char *s, size_t n, size_t at) {
    if (L->n == L->cap) {
        size_t nc = L->cap ? L->cap * 2 : 64;
        struct token *t = ja_alloc(L->a, nc * sizeof *t);
        if (L->n) memcpy(t, L->toks, L->n * sizeof *t);
        L->toks = t;
        L->cap = nc;
    }
    struct token *t = &L->toks[L->n++];
    t->type = type;
    t->s = s;
    t->n = n;
    pos_of(L, at, &t->line, &t->col);
    return t;
}

static bool is_word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* consumeWhile over a class of plain characters; reaching the end of input is an error, as
 * in the reference lexer */
static size_t consume_class(struct lexer *L, bool (*pred)(char)) {
    size_t start = L->pos;
    while (L->pos < L->p.n && pred(L->p.s[L->pos])) {
        L->pos++;
        if (L->pos >= L->p.n) lex_fail(L, "unexpected end of template%s", "");
    }
    return L->pos - start;
}

static size_t space_at(struct lexer *L) { return L->pos < L->p.n ? ju_space(L->p.s + L->pos, L->p.n - L->pos) : 0; }

static void lex_string(struct lexer *L, char q) {
    size_t at = L->pos;
    L->pos++;
    size_t start = L->pos;
    /* find the end first (escapes only shrink), then decode in place */
    size_t j = start;
    while (j < L->p.n && L->p.s[j] != q) {
        if (L->p.s[j] == '\\') j++;
        j++;
    }
    if (j >= L->p.n) lex_fail(L, "unterminated string literal%s", "");
    char *out = ja_alloc(L->a, j - start + 1);
    size_t o = 0;
    while (L->p.s[L->pos] != q) {
        char c = L->p.s[L->pos];
        if (c != '\\') {
            out[o++] = c;
            L->pos++;
            continue;
        }
        char e = L->p.s[++L->pos];
        L->pos++;
        if (e == 'x' || e == 'u') {
            int len = e == 'x' ? 2 : 4;
            uint32_t v = 0;
            for (int k = 0; k < len; k++) {
                int h = L->pos + (size_t)k < L->p.n ? hexval(L->p.s[L->pos + (size_t)k]) : -1;
                if (h < 0) lex_fail(L, "invalid hexadecimal escape sequence \\%c", (char[]){e, 0});
                v = v * 16 + (uint32_t)h;
            }
            L->pos += (size_t)len;
            if (v >= 0xD800 && v < 0xDC00 && L->pos + 6 <= L->p.n && L->p.s[L->pos] == '\\' &&
                L->p.s[L->pos + 1] == 'u') {
                uint32_t lo = 0;
                bool ok = true;
                for (int k = 0; k < 4; k++) {
                    int h = hexval(L->p.s[L->pos + 2 + (size_t)k]);
                    if (h < 0) ok = false;
                    lo = lo * 16 + (uint32_t)(h < 0 ? 0 : h);
                }
                if (ok && lo >= 0xDC00 && lo < 0xE000) {
                    v = 0x10000 + ((v - 0xD800) << 10) + (lo - 0xDC00);
                    L->pos += 6;
                }
            }
            if (v >= 0xD800 && v < 0xE000) v = 0xFFFD; /* a lone surrogate prints as U+FFFD */
            o += ju_encode(v, out + o);
            continue;
        }
        switch (e) {
        case 'n': out[o++] = '\n'; break;
        case 't': out[o++] = '\t'; break;
        case 'r': out[o++] = '\r'; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'v': out[o++] = '\v'; break;
        case '\'': case '"': case '\\': out[o++] = e; break;
        default: L->pos--; lex_fail(L, "unexpected escaped character '%s'", (char[]){e, 0});
        }
    }
    L->pos++;
    push(L, TK_STR, out, o, at);
}

static const struct { const char *s; enum tk t; } k_table[] = {
    {"{%", TK_OPEN_STMT}, {"%}", TK_CLOSE_STMT}, {"{{", TK_OPEN_EXPR}, {"}}", TK_CLOSE_EXPR},
    {"(", TK_LPAREN}, {")", TK_RPAREN}, {"{", TK_LBRACE}, {"}", TK_RBRACE}, {"[", TK_LBRACKET},
    {"]", TK_RBRACKET}, {",", TK_COMMA}, {".", TK_DOT}, {":", TK_COLON}, {"|", TK_PIPE},
    {"<=", TK_CMP}, {">=", TK_CMP}, {"==", TK_CMP}, {"!=", TK_CMP}, {"<", TK_CMP}, {">", TK_CMP},
    {"+", TK_ADD}, {"-", TK_ADD}, {"~", TK_ADD}, {"**", TK_POW}, {"*", TK_MUL}, {"//", TK_MUL},
    {"/", TK_MUL}, {"%", TK_MUL}, {"=", TK_EQUALS},
};

static bool starts(const struct lexer *L, const char *s) {
    size_t n = strlen(s);
    return L->p.n - L->pos >= n && !memcmp(L->p.s + L->pos, s, n);
}

static void strip_trailing_ws(struct lexer *L) {
    if (!L->n || L->toks[L->n - 1].type != TK_TEXT) return;
    struct token *t = &L->toks[L->n - 1];
    for (;;) {
        size_t k = t->n;
        if (!k) break;
        k--;
        while (k > 0 && ((unsigned char)t->s[k] & 0xC0) == 0x80) k--;
        size_t cl = ju_space(t->s + k, t->n - k);
        if (!cl || k + cl != t->n) break;
        t->n = k;
    }
    if (t->n == 0) L->n--;
}

static void skip_leading_ws(struct lexer *L) {
    size_t k;
    while ((k = space_at(L))) L->pos += k;
}

void jinja_lex(struct jarena *a, const char *src, size_t len, struct token **out, size_t *n) {
    struct lexer L = {.a = a, .src = src};
    size_t nl = 1;
    for (size_t i = 0; i < len; i++) nl += src[i] == '\n';
    L.line_starts = ja_alloc(a, nl * sizeof(size_t));
    L.line_starts[L.n_lines++] = 0;
    for (size_t i = 0; i < len; i++)
        if (src[i] == '\n') L.line_starts[L.n_lines++] = i + 1;
    preprocess(a, src, len, &L.p);
    int depth = 0;
    const char *s = L.p.s;
    while (L.pos < L.p.n) {
        enum tk last = L.n ? L.toks[L.n - 1].type : TK_TEXT;
        if (!L.n || last == TK_CLOSE_STMT || last == TK_CLOSE_EXPR || last == TK_COMMENT) {
            size_t st = L.pos;
            while (L.pos < L.p.n && !(s[L.pos] == '{' && L.pos + 1 < L.p.n &&
                                      (s[L.pos + 1] == '%' || s[L.pos + 1] == '{' || s[L.pos + 1] == '#')))
                L.pos++;
            if (L.pos > st) {
                push(&L, TK_TEXT, s + st, L.pos - st, st);
                continue;
            }
        }
        if (starts(&L, "{#")) {
            size_t at = L.pos;
            L.pos += 2;
            bool strip_before = L.pos < L.p.n && s[L.pos] == '-';
            if (strip_before) L.pos++;
            size_t cs = L.pos;
            while (!(L.pos + 1 < L.p.n && s[L.pos] == '#' && s[L.pos + 1] == '}')) {
                if (L.pos + 2 >= L.p.n) {
                    L.pos = at;
                    lex_fail(&L, "missing end of comment tag '#}'%s", "");
                }
                L.pos++;
            }
            size_t ce = L.pos;
            bool strip_after = ce > cs && s[ce - 1] == '-';
            if (strip_after) ce--;
            if (strip_before) strip_trailing_ws(&L);
            push(&L, TK_COMMENT, s + cs, ce - cs, at);
            L.pos += 2;
            if (strip_after) skip_leading_ws(&L);
            continue;
        }
        if (starts(&L, "{%-")) {
            strip_trailing_ws(&L);
            push(&L, TK_OPEN_STMT, "{%", 2, L.pos);
            L.pos += 3;
            continue;
        }
        if (starts(&L, "{{-")) {
            strip_trailing_ws(&L);
            push(&L, TK_OPEN_EXPR, "{{", 2, L.pos);
            depth = 0;
            L.pos += 3;
            continue;
        }
        /* consumeWhile(isWhitespace): JavaScript \s, one UTF-16 unit at a time */
        for (size_t k; (k = space_at(&L));) {
            L.pos += k;
            if (L.pos >= L.p.n) lex_fail(&L, "unexpected end of template%s", "");
        }
        if (starts(&L, "-%}")) {
            push(&L, TK_CLOSE_STMT, "%}", 2, L.pos);
            L.pos += 3;
            skip_leading_ws(&L);
            continue;
        }
        if (starts(&L, "-}}")) {
            push(&L, TK_CLOSE_EXPR, "}}", 2, L.pos);
            L.pos += 3;
            skip_leading_ws(&L);
            continue;
        }
        char c = s[L.pos];
        if (c == '-' || c == '+') {
            if (!L.n || last == TK_TEXT) lex_fail(&L, "unexpected character '%s'", (char[]){c, 0});
            if (!(last == TK_IDENT || last == TK_NUM || last == TK_STR || last == TK_RPAREN || last == TK_RBRACKET)) {
                size_t at = L.pos++;
                size_t nd = consume_class(&L, is_digit);
                if (nd > 0 && L.pos + 1 < L.p.n && s[L.pos] == '.' && is_digit(s[L.pos + 1])) {
                    L.pos++;
                    consume_class(&L, is_digit);
                }
                push(&L, nd ? TK_NUM : TK_UNARY, s + at, L.pos - at, at);
                continue;
            }
        }
        bool matched = false;
        for (size_t k = 0; k < sizeof k_table / sizeof k_table[0]; k++) {
            if (k_table[k].t == TK_CLOSE_EXPR && depth > 0) continue;
            if (starts(&L, k_table[k].s)) {
                size_t l = strlen(k_table[k].s);
                push(&L, k_table[k].t, k_table[k].s, l, L.pos);
                if (k_table[k].t == TK_OPEN_EXPR) depth = 0;
                else if (k_table[k].t == TK_LBRACE) depth++;
                else if (k_table[k].t == TK_RBRACE) depth--;
                L.pos += l;
                matched = true;
                break;
            }
        }
        if (matched) continue;
        if (c == '\'' || c == '"') {
            lex_string(&L, c);
            continue;
        }
        if (is_digit(c)) {
            size_t at = L.pos;
            consume_class(&L, is_digit);
            if (!(L.n && L.toks[L.n - 1].type == TK_DOT) && L.pos + 1 < L.p.n && s[L.pos] == '.' &&
                is_digit(s[L.pos + 1])) {
                L.pos++;
                consume_class(&L, is_digit);
            }
            push(&L, TK_NUM, s + at, L.pos - at, at);
            continue;
        }
        if (is_word(c)) {
            size_t at = L.pos;
            consume_class(&L, is_word);
            push(&L, TK_IDENT, s + at, L.pos - at, at);
            continue;
        }
        if ((unsigned char)c >= 0x80) {
            uint32_t cp;
            ju_decode(s + L.pos, L.p.n - L.pos, &cp);
            char buf[16];
            snprintf(buf, sizeof buf, "U+%04X", cp);
            lex_fail(&L, "unexpected character %s inside a tag", buf);
        }
        lex_fail(&L, "unexpected character '%s'", (char[]){c, 0});
    }
    *out = L.toks;
    *n = L.n;
}
