/*
 * GBNF (llama.cpp's grammar format) -> grammar rules (gram_internal.h).
 *
 *   root  ::= greeting " " name ("!" | ".")?     # comments run to the end of the line
 *   greeting ::= "hello" | "hi"
 *   name  ::= [A-Z] [a-z]{1,12}
 *
 * Rules `name ::= alternatives`; a rule runs until the next `name ::=` (so alternatives may
 * continue on the next lines). Terms: "string" (escapes \n \r \t \\ \" \xHH \uHHHH
 * \UHHHHHHHH), [class] with ranges and ^ (the regex class syntax), `.` (any character), rule
 * names, ( groups ), and the postfix operators * + ? {m} {m,} {m,n}. The start rule is
 * `root`. Left recursion is refused (the recognizer is top-down).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

struct ep {
    struct gb *b;
    const char *s;
    size_t n, i;
    kv_status st;
    char *err;
    size_t errlen;
    int depth;
};

static void ep_pos(const struct ep *p, int *line, int *col) {
    *line = 1;
    *col = 1;
    for (size_t k = 0; k < p->i && k < p->n; k++) {
        if (p->s[k] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

static struct gn *ep_fail(struct ep *p, kv_status st, const char *msg) {
    if (!p->st) {
        p->st = st;
        int line, col;
        ep_pos(p, &line, &col);
        snprintf(p->err, p->errlen, "grammar line %d, column %d: %s", line, col, msg);
    }
    return NULL;
}

static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

static void skip_ws(struct ep *p) {
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') p->i++;
        else if (c == '#') {
            while (p->i < p->n && p->s[p->i] != '\n') p->i++;
        } else break;
    }
}

/* At a rule head "name ::=" (after whitespace)? */
static bool at_rule_head(struct ep *p) {
    size_t i = p->i;
    if (i >= p->n || !is_name_char(p->s[i])) return false;
    while (i < p->n && is_name_char(p->s[i])) i++;
    while (i < p->n && (p->s[i] == ' ' || p->s[i] == '\t')) i++;
    return i + 3 <= p->n && !memcmp(p->s + i, "::=", 3);
}

static int hexv(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool put_utf8(kv_buf *o, uint32_t c) {
    char t[4];
    int n;
    if (c < 0x80) { t[0] = (char)c; n = 1; }
    else if (c < 0x800) { t[0] = (char)(0xC0 | (c >> 6)); t[1] = (char)(0x80 | (c & 0x3F)); n = 2; }
    else if (c < 0x10000) {
        t[0] = (char)(0xE0 | (c >> 12)); t[1] = (char)(0x80 | ((c >> 6) & 0x3F)); t[2] = (char)(0x80 | (c & 0x3F)); n = 3;
    } else {
        t[0] = (char)(0xF0 | (c >> 18)); t[1] = (char)(0x80 | ((c >> 12) & 0x3F));
        t[2] = (char)(0x80 | ((c >> 6) & 0x3F)); t[3] = (char)(0x80 | (c & 0x3F)); n = 4;
    }
    return kv_buf_append(o, t, (size_t)n) == KV_OK;
}

static struct gn *string_lit(struct ep *p) {
    p->i++; /* opening quote */
    kv_buf o;
    kv_buf_init(&o);
    for (;;) {
        if (p->i >= p->n || p->s[p->i] == '\n') {
            kv_buf_free(&o);
            return ep_fail(p, KV_EINVAL, "unterminated string");
        }
        char c = p->s[p->i++];
        if (c == '"') break;
        if (c != '\\') {
            if (kv_buf_append(&o, &c, 1)) goto oom;
            continue;
        }
        if (p->i >= p->n) {
            kv_buf_free(&o);
            return ep_fail(p, KV_EINVAL, "unterminated string");
        }
        char e = p->s[p->i++];
        uint32_t v = 0;
        int nd = 0;
        switch (e) {
        case 'n': v = '\n'; break;
        case 'r': v = '\r'; break;
        case 't': v = '\t'; break;
        case '\\': case '"': case '[': case ']': v = (unsigned char)e; break;
        case 'x': nd = 2; break;
        case 'u': nd = 4; break;
        case 'U': nd = 8; break;
        default:
            kv_buf_free(&o);
            return ep_fail(p, KV_EINVAL, "unknown escape in a string");
        }
        for (int k = 0; k < nd; k++) {
            int h = p->i < p->n ? hexv(p->s[p->i]) : -1;
            if (h < 0) {
                kv_buf_free(&o);
                return ep_fail(p, KV_EINVAL, "bad hex escape in a string");
            }
            v = v * 16 + (uint32_t)h;
            p->i++;
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
            kv_buf_free(&o);
            return ep_fail(p, KV_EINVAL, "escape is not a Unicode scalar value");
        }
        if (!put_utf8(&o, v)) goto oom;
    }
    struct gn *n = gn_bytes(p->b, o.data ? o.data : "", o.len);
    kv_buf_free(&o);
    return n;
oom:
    kv_buf_free(&o);
    return ep_fail(p, KV_ENOMEM, "out of memory");
}

static struct gn *char_class(struct ep *p) {
    size_t start = p->i;
    size_t i = p->i + 1;
    if (i < p->n && p->s[i] == '^') i++;
    if (i < p->n && p->s[i] == ']') i++; /* a leading ']' is literal */
    while (i < p->n && p->s[i] != ']') {
        if (p->s[i] == '\\') i++;
        if (i < p->n && p->s[i] == '\n') break;
        i++;
    }
    if (i >= p->n || p->s[i] != ']') return ep_fail(p, KV_EINVAL, "unterminated character class");
    p->i = i + 1;
    struct gn *n = NULL;
    char e[200];
    kv_status st = gram_regex_parse(p->b, p->s + start, p->i - start, NULL, false, &n, e, sizeof e);
    if (st) {
        p->i = start;
        return ep_fail(p, st, e);
    }
    return n;
}

static struct gn *alternatives(struct ep *p, bool nested);

static bool read_int(struct ep *p, int *out) {
    size_t i0 = p->i;
    long v = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        if (v < 1000000) v = v * 10 + (p->s[p->i] - '0');
        p->i++;
    }
    *out = (int)v;
    return p->i > i0;
}

static struct gn *sequence(struct ep *p, bool nested) {
    struct gn *seq = gn_seq(p->b);
    for (;;) {
        skip_ws(p);
        if (p->st || p->i >= p->n) break;
        char c = p->s[p->i];
        if (c == '|' || c == ')') break;
        if (!nested && at_rule_head(p)) break;
        struct gn *t = NULL;
        if (c == '"') t = string_lit(p);
        else if (c == '[') t = char_class(p);
        else if (c == '.') {
            p->i++;
            t = gn_range(p->b, 0, 0x10FFFF);
        } else if (c == '(') {
            p->i++;
            if (++p->depth > 200) return ep_fail(p, KV_ETOOLONG, "groups nest too deeply");
            t = alternatives(p, true);
            p->depth--;
            skip_ws(p);
            if (!t) return NULL;
            if (p->i >= p->n || p->s[p->i] != ')') return ep_fail(p, KV_EINVAL, "missing ')'");
            p->i++;
        } else if (is_name_char(c)) {
            size_t s0 = p->i;
            while (p->i < p->n && is_name_char(p->s[p->i])) p->i++;
            char name[128];
            size_t nl = p->i - s0;
            if (nl >= sizeof name) return ep_fail(p, KV_EINVAL, "rule name too long");
            memcpy(name, p->s + s0, nl);
            name[nl] = 0;
            int r = gb_rule_find(p->b, name);
            if (r < 0) r = gb_rule_new(p->b, name);
            if (r < 0) return ep_fail(p, KV_ENOMEM, "out of memory");
            t = gn_ref(p->b, r);
        } else {
            char m[64];
            snprintf(m, sizeof m, "unexpected character '%c'", c);
            return ep_fail(p, KV_EINVAL, m);
        }
        if (!t) return NULL;
        for (;;) { /* postfix operators (no whitespace before them, as in GBNF) */
            if (p->i >= p->n) break;
            char q = p->s[p->i];
            int mn, mx;
            if (q == '*') { mn = 0; mx = -1; p->i++; }
            else if (q == '+') { mn = 1; mx = -1; p->i++; }
            else if (q == '?') { mn = 0; mx = 1; p->i++; }
            else if (q == '{') {
                p->i++;
                skip_ws(p);
                if (!read_int(p, &mn)) return ep_fail(p, KV_EINVAL, "expected a count after '{'");
                skip_ws(p);
                mx = mn;
                if (p->i < p->n && p->s[p->i] == ',') {
                    p->i++;
                    skip_ws(p);
                    if (!read_int(p, &mx)) mx = -1;
                    skip_ws(p);
                }
                if (p->i >= p->n || p->s[p->i] != '}') return ep_fail(p, KV_EINVAL, "expected '}'");
                p->i++;
                if (mx >= 0 && mx < mn) return ep_fail(p, KV_EINVAL, "{m,n} with n < m");
                if (mn > GRAM_MAX_REPEAT || mx > GRAM_MAX_REPEAT)
                    return ep_fail(p, KV_ETOOLONG, "a repetition count is above the limit of 10000");
            } else break;
            t = gn_rep(p->b, t, mn, mx);
            if (!t) return ep_fail(p, p->b->st ? p->b->st : KV_ENOMEM, p->b->err[0] ? p->b->err : "out of memory");
        }
        gn_add(p->b, seq, t);
    }
    return seq;
}

static struct gn *alternatives(struct ep *p, bool nested) {
    struct gn *first = sequence(p, nested);
    if (!first) return NULL;
    skip_ws(p);
    if (p->i >= p->n || p->s[p->i] != '|') return first;
    struct gn *alt = gn_alt(p->b);
    gn_add(p->b, alt, first);
    while (p->i < p->n && p->s[p->i] == '|' && !p->st) {
        p->i++;
        struct gn *s = sequence(p, nested);
        if (!s) return NULL;
        gn_add(p->b, alt, s);
        skip_ws(p);
    }
    return alt;
}

kv_status gram_ebnf_parse(struct gb *b, const char *src, size_t len, int *root, char *err, size_t errlen) {
    struct ep p = {.b = b, .s = src, .n = len, .err = err, .errlen = errlen};
    uint8_t *defined = NULL;
    int cap_def = 0;
    for (;;) {
        skip_ws(&p);
        if (p.st || p.i >= p.n) break;
        if (!at_rule_head(&p)) {
            ep_fail(&p, KV_EINVAL, "expected a rule 'name ::= ...'");
            break;
        }
        size_t s0 = p.i;
        while (p.i < p.n && is_name_char(p.s[p.i])) p.i++;
        char name[128];
        size_t nl = p.i - s0;
        if (nl >= sizeof name) {
            ep_fail(&p, KV_EINVAL, "rule name too long");
            break;
        }
        memcpy(name, p.s + s0, nl);
        name[nl] = 0;
        while (p.s[p.i] != ':') p.i++;
        p.i += 3;
        int r = gb_rule_find(b, name);
        if (r < 0) r = gb_rule_new(b, name);
        if (r < 0) {
            ep_fail(&p, KV_ENOMEM, "out of memory");
            break;
        }
        if (r >= cap_def) {
            int nc = cap_def ? cap_def * 2 : 64;
            while (nc <= r) nc *= 2;
            uint8_t *nd = kv_realloc(defined, (size_t)nc);
            if (!nd) {
                ep_fail(&p, KV_ENOMEM, "out of memory");
                break;
            }
            memset(nd + cap_def, 0, (size_t)(nc - cap_def));
            defined = nd;
            cap_def = nc;
        }
        if (defined[r]) {
            char m[200];
            snprintf(m, sizeof m, "rule '%s' is defined twice", name);
            ep_fail(&p, KV_EINVAL, m);
            break;
        }
        defined[r] = 1;
        struct gn *body = alternatives(&p, false);
        if (!body) break;
        skip_ws(&p);
        if (p.i < p.n && p.s[p.i] == ')') {
            ep_fail(&p, KV_EINVAL, "unbalanced ')'");
            break;
        }
        gb_rule_set(b, r, body);
    }
    free(defined);
    if (p.st) return p.st;
    int r = gb_rule_find(b, "root");
    if (r < 0) return kv_errf(KV_EINVAL, err, errlen, "the grammar has no rule named 'root'");
    *root = r;
    return KV_OK;
}
