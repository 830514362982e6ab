/*
 * Regular expressions -> grammar expression trees (gram_internal.h).
 *
 * Syntax (the common subset of Python `re` and ECMAScript): literals (UTF-8), `.` (any code
 * point but "\n"), classes `[a-z\d]` / `[^...]`, escapes \d \D \w \W \s \S \n \r \t \f \v \0
 * \xHH \uHHHH \u{H...} and escaped punctuation, groups `( )` `(?: )` `(?P<n> )` `(?<n> )`,
 * `|`, quantifiers `* + ? {m} {m,} {m,n}` (lazy `?` suffix accepted: same language), `^` at
 * the start and `$` at the end. Refused with a message naming the construct: backreferences,
 * lookaround, \b \B, inline flags, possessive quantifiers, \p{...}, POSIX classes, anchors
 * elsewhere.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

struct rx {
    struct gb *b;
    const char *s;
    size_t n, i;
    const struct gcset *universe; /* NULL: every code point */
    bool search;                  /* unanchored ends match anything (JSON schema "pattern") */
    int depth;
    kv_status st;
    char *err;
    size_t errlen;
};

static struct gn *rx_fail(struct rx *x, kv_status st, const char *fmt, const char *what) {
    if (!x->st) {
        x->st = st;
        char m[300];
        snprintf(m, sizeof m, fmt, what);
        snprintf(x->err, x->errlen, "%s (at offset %zu of the regex)", m, x->i);
    }
    return NULL;
}

static bool at_end(struct rx *x) { return x->i >= x->n; }
static char peek(struct rx *x) { return x->i < x->n ? x->s[x->i] : 0; }

/* One UTF-8 code point from the pattern. */
static uint32_t next_cp(struct rx *x) {
    const unsigned char *p = (const unsigned char *)x->s + x->i;
    size_t left = x->n - x->i;
    int l = kv_utf8_seq_len(p[0]);
    if (l <= 0 || (size_t)l > left) {
        x->i++;
        return p[0];
    }
    uint32_t c = l == 1 ? p[0] : l == 2 ? p[0] & 0x1Fu : l == 3 ? p[0] & 0x0Fu : p[0] & 0x07u;
    for (int k = 1; k < l; k++) c = (c << 6) | (p[k] & 0x3Fu);
    x->i += (size_t)l;
    return c;
}

static kv_status cset_intersect(const struct gcset *a, const struct gcset *u, struct gcset *out) {
    memset(out, 0, sizeof *out);
    for (int i = 0; i < a->n; i++)
        for (int j = 0; j < u->n; j++) {
            uint32_t lo = a->r[i][0] > u->r[j][0] ? a->r[i][0] : u->r[j][0];
            uint32_t hi = a->r[i][1] < u->r[j][1] ? a->r[i][1] : u->r[j][1];
            if (lo <= hi && gcset_add(out, lo, hi)) {
                gcset_free(out);
                return KV_ENOMEM;
            }
        }
    return KV_OK;
}

/* A node for class cs (consumed), restricted to the universe. */
static struct gn *class_node(struct rx *x, struct gcset *cs) {
    struct gn *n = NULL;
    if (x->universe) {
        struct gcset r;
        if (cset_intersect(cs, x->universe, &r)) {
            gcset_free(cs);
            return rx_fail(x, KV_ENOMEM, "%s", "out of memory");
        }
        n = gn_chars(x->b, &r);
        gcset_free(&r);
    } else {
        n = gn_chars(x->b, cs);
    }
    gcset_free(cs);
    return n;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool read_hex(struct rx *x, int digits, uint32_t *out) {
    uint32_t v = 0;
    for (int k = 0; k < digits; k++) {
        int h = x->i < x->n ? hexval(x->s[x->i]) : -1;
        if (h < 0) return false;
        v = v * 16 + (uint32_t)h;
        x->i++;
    }
    *out = v;
    return true;
}

/* Adds the class of a backslash escape (after the backslash) to cs; for a single code point
 * escape sets *cp instead and returns 1. 0 on a class, -1 on error. */
static int escape(struct rx *x, struct gcset *cs, uint32_t *cp, bool in_class) {
    if (at_end(x)) {
        rx_fail(x, KV_EINVAL, "%s", "the regex ends with a lone backslash");
        return -1;
    }
    char c = x->s[x->i++];
    kv_status st = KV_OK;
    switch (c) {
    case 'd': st = gcset_add(cs, '0', '9'); break;
    case 'w':
        st = gcset_add(cs, '0', '9') || gcset_add(cs, 'A', 'Z') || gcset_add(cs, 'a', 'z') ||
             gcset_add(cs, '_', '_');
        break;
    case 's':
        st = gcset_add(cs, '\t', '\r') || gcset_add(cs, ' ', ' ');
        break;
    case 'n': *cp = '\n'; return 1;
    case 'r': *cp = '\r'; return 1;
    case 't': *cp = '\t'; return 1;
    case 'f': *cp = '\f'; return 1;
    case 'v': *cp = '\v'; return 1;
    case '0': *cp = 0; return 1;
    case 'x':
        if (!read_hex(x, 2, cp)) {
            rx_fail(x, KV_EINVAL, "%s", "\\x needs two hex digits");
            return -1;
        }
        return 1;
    case 'u':
        if (peek(x) == '{') {
            x->i++;
            uint32_t v = 0;
            int nd = 0, h;
            while (!at_end(x) && (h = hexval(peek(x))) >= 0 && nd < 6) {
                v = v * 16 + (uint32_t)h;
                x->i++;
                nd++;
            }
            if (nd == 0 || peek(x) != '}' || v > 0x10FFFF) {
                rx_fail(x, KV_EINVAL, "%s", "bad \\u{...} escape");
                return -1;
            }
            x->i++;
            *cp = v;
            return 1;
        }
        if (!read_hex(x, 4, cp)) {
            rx_fail(x, KV_EINVAL, "%s", "\\u needs four hex digits");
            return -1;
        }
        return 1;
    case 'b':
        if (in_class) { *cp = '\b'; return 1; }
        rx_fail(x, KV_EINVAL, "%s", "word boundaries (\\b) are not supported");
        return -1;
    case 'B': rx_fail(x, KV_EINVAL, "%s", "\\B is not supported"); return -1;
    case 'p': case 'P': rx_fail(x, KV_EINVAL, "%s", "Unicode property classes (\\p{...}) are not supported"); return -1;
    case 'A': case 'Z': case 'z': case 'G':
        rx_fail(x, KV_EINVAL, "%s", "anchors other than a leading ^ and a trailing $ are not supported");
        return -1;
    case 'k': rx_fail(x, KV_EINVAL, "%s", "backreferences are not supported"); return -1;
    default:
        if (c >= '1' && c <= '9') {
            rx_fail(x, KV_EINVAL, "%s", "backreferences are not supported");
            return -1;
        }
        if ((unsigned char)c >= 0x80 || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            char m[8] = {'\\', c, 0};
            rx_fail(x, KV_EINVAL, "the escape %s is not supported", m);
            return -1;
        }
        *cp = (unsigned char)c; /* escaped punctuation */
        return 1;
    }
    if (st) {
        rx_fail(x, KV_ENOMEM, "%s", "out of memory");
        return -1;
    }
    return 0;
}

/* Escape handling with the negated classes (\D \W \S) built from the positive ones. */
static int escape_full(struct rx *x, struct gcset *cs, uint32_t *cp, bool in_class) {
    char c = peek(x);
    if (c == 'D' || c == 'W' || c == 'S') {
        x->i++;
        struct gcset pos = {0}, neg;
        kv_status st = KV_OK;
        if (c == 'D') st = gcset_add(&pos, '0', '9');
        else if (c == 'W')
            st = gcset_add(&pos, '0', '9') || gcset_add(&pos, 'A', 'Z') || gcset_add(&pos, 'a', 'z') ||
                 gcset_add(&pos, '_', '_');
        else st = gcset_add(&pos, '\t', '\r') || gcset_add(&pos, ' ', ' ');
        if (st || gcset_negate(&pos, &neg)) {
            gcset_free(&pos);
            rx_fail(x, KV_ENOMEM, "%s", "out of memory");
            return -1;
        }
        gcset_free(&pos);
        st = gcset_union(cs, &neg);
        gcset_free(&neg);
        if (st) {
            rx_fail(x, KV_ENOMEM, "%s", "out of memory");
            return -1;
        }
        return 0;
    }
    return escape(x, cs, cp, in_class);
}

static struct gn *parse_class(struct rx *x) {
    /* at '[' */
    x->i++;
    bool neg = false;
    if (peek(x) == '^') {
        neg = true;
        x->i++;
    }
    struct gcset cs = {0};
    bool first = true;
    for (;;) {
        if (at_end(x)) {
            gcset_free(&cs);
            return rx_fail(x, KV_EINVAL, "%s", "unterminated character class");
        }
        char c = peek(x);
        if (c == ']' && !first) {
            x->i++;
            break;
        }
        first = false;
        if (c == '[' && x->i + 1 < x->n && (x->s[x->i + 1] == ':' || x->s[x->i + 1] == '=' || x->s[x->i + 1] == '.')) {
            gcset_free(&cs);
            return rx_fail(x, KV_EINVAL, "%s", "POSIX classes ([:alpha:]) are not supported");
        }
        uint32_t lo;
        if (c == '\\') {
            x->i++;
            int r = escape_full(x, &cs, &lo, true);
            if (r < 0) {
                gcset_free(&cs);
                return NULL;
            }
            if (r == 0) continue; /* a class escape: cannot start a range */
        } else {
            lo = next_cp(x);
        }
        uint32_t hi = lo;
        if (peek(x) == '-' && x->i + 1 < x->n && x->s[x->i + 1] != ']') {
            x->i++;
            if (peek(x) == '\\') {
                x->i++;
                struct gcset dummy = {0};
                int r = escape_full(x, &dummy, &hi, true);
                gcset_free(&dummy);
                if (r != 1) {
                    gcset_free(&cs);
                    return r < 0 ? NULL : rx_fail(x, KV_EINVAL, "%s", "a class escape cannot end a range");
                }
            } else {
                hi = next_cp(x);
            }
            if (hi < lo) {
                gcset_free(&cs);
                return rx_fail(x, KV_EINVAL, "%s", "a character range is out of order");
            }
        }
        if (gcset_add(&cs, lo, hi)) {
            gcset_free(&cs);
            return rx_fail(x, KV_ENOMEM, "%s", "out of memory");
        }
    }
    if (neg) {
        struct gcset n2;
        if (gcset_negate(&cs, &n2)) {
            gcset_free(&cs);
            return rx_fail(x, KV_ENOMEM, "%s", "out of memory");
        }
        gcset_free(&cs);
        cs = n2;
    }
    return class_node(x, &cs);
}

static struct gn *literal(struct rx *x, uint32_t cp) {
    struct gcset cs = {0};
    if (gcset_add(&cs, cp, cp)) return rx_fail(x, KV_ENOMEM, "%s", "out of memory");
    return class_node(x, &cs);
}

static struct gn *parse_alt(struct rx *x, bool top);

/* Reads {m}, {m,}, {m,n} at x->i ('{'); false (nothing consumed) if it is not one. */
static bool read_braces(struct rx *x, int *min, int *max) {
    size_t i = x->i + 1;
    long m = 0, n = -1;
    int nd = 0;
    while (i < x->n && x->s[i] >= '0' && x->s[i] <= '9') {
        if (m < 1000000) m = m * 10 + (x->s[i] - '0');
        i++;
        nd++;
    }
    if (nd == 0) return false;
    if (i < x->n && x->s[i] == '}') {
        n = m;
    } else if (i < x->n && x->s[i] == ',') {
        i++;
        int nd2 = 0;
        long v = 0;
        while (i < x->n && x->s[i] >= '0' && x->s[i] <= '9') {
            if (v < 1000000) v = v * 10 + (x->s[i] - '0');
            i++;
            nd2++;
        }
        if (i >= x->n || x->s[i] != '}') return false;
        n = nd2 ? v : -1;
    } else {
        return false;
    }
    x->i = i + 1;
    *min = m > 1000000 ? 1000000 : (int)m;
    *max = n > 1000000 ? 1000000 : (int)n;
    return true;
}

static struct gn *any_run(struct rx *x) {
    struct gcset cs = {0};
    if (gcset_add(&cs, 0, 0x10FFFF)) return rx_fail(x, KV_ENOMEM, "%s", "out of memory");
    return gn_rep(x->b, class_node(x, &cs), 0, -1);
}

static struct gn *parse_seq(struct rx *x, bool top) {
    struct gn *seq = gn_seq(x->b);
    bool first = true, anch_start = false, anch_end = false;
    while (!at_end(x) && !x->st) {
        char c = peek(x);
        if (c == '|' || c == ')') break;
        struct gn *atom = NULL;
        if (c == '^') {
            if (!(top && first && !anch_start))
                return rx_fail(x, KV_EINVAL, "%s", "'^' is only supported at the start of the regex");
            x->i++;
            anch_start = true;
            continue;
        }
        if (c == '$') {
            x->i++;
            if (!(top && (at_end(x) || peek(x) == '|')))
                return rx_fail(x, KV_EINVAL, "%s", "'$' is only supported at the end of the regex");
            anch_end = true;
            continue;
        }
        first = false;
        if (c == '(') {
            x->i++;
            if (peek(x) == '?') {
                x->i++;
                char k = peek(x);
                if (k == ':') {
                    x->i++;
                } else if (k == 'P' && x->i + 1 < x->n && x->s[x->i + 1] == '<') {
                    while (!at_end(x) && peek(x) != '>') x->i++;
                    x->i++;
                } else if (k == '<' && x->i + 1 < x->n && x->s[x->i + 1] != '=' && x->s[x->i + 1] != '!') {
                    while (!at_end(x) && peek(x) != '>') x->i++;
                    x->i++;
                } else if (k == '=' || k == '!' || k == '<') {
                    return rx_fail(x, KV_EINVAL, "%s", "lookahead and lookbehind are not supported");
                } else if (k == 'P' && x->i + 1 < x->n && x->s[x->i + 1] == '=') {
                    return rx_fail(x, KV_EINVAL, "%s", "backreferences are not supported");
                } else {
                    return rx_fail(x, KV_EINVAL, "%s", "inline flags and other (?...) groups are not supported");
                }
            }
            if (++x->depth > 200) return rx_fail(x, KV_ETOOLONG, "%s", "the regex nests groups too deeply");
            atom = parse_alt(x, false);
            x->depth--;
            if (!atom) return NULL;
            if (peek(x) != ')') return rx_fail(x, KV_EINVAL, "%s", "missing ')'");
            x->i++;
        } else if (c == '[') {
            atom = parse_class(x);
        } else if (c == '.') {
            x->i++;
            struct gcset cs = {0};
            if (gcset_add(&cs, 0, '\n' - 1) || gcset_add(&cs, '\n' + 1, 0x10FFFF))
                return rx_fail(x, KV_ENOMEM, "%s", "out of memory");
            atom = class_node(x, &cs);
        } else if (c == '\\') {
            x->i++;
            struct gcset cs = {0};
            uint32_t cp = 0;
            int r = escape_full(x, &cs, &cp, false);
            if (r < 0) {
                gcset_free(&cs);
                return NULL;
            }
            if (r == 1) {
                gcset_free(&cs);
                atom = literal(x, cp);
            } else {
                atom = class_node(x, &cs);
            }
        } else if (c == '*' || c == '+' || c == '?') {
            return rx_fail(x, KV_EINVAL, "%s", "a quantifier follows nothing");
        } else if (c == '{') {
            int mn, mx;
            size_t save = x->i;
            if (read_braces(x, &mn, &mx)) {
                x->i = save;
                return rx_fail(x, KV_EINVAL, "%s", "a quantifier follows nothing");
            }
            x->i++;
            atom = literal(x, '{');
        } else {
            atom = literal(x, next_cp(x));
        }
        if (!atom) return NULL;
        /* quantifiers (several in a row apply in turn, as in Python) */
        for (;;) {
            char q = peek(x);
            int mn, mx;
            if (q == '*') { x->i++; mn = 0; mx = -1; }
            else if (q == '+') { x->i++; mn = 1; mx = -1; }
            else if (q == '?') { x->i++; mn = 0; mx = 1; }
            else if (q == '{' && read_braces(x, &mn, &mx)) {
                if (mx >= 0 && mx < mn)
                    return rx_fail(x, KV_EINVAL, "%s", "a {m,n} quantifier has n < m");
                if (mn > GRAM_MAX_REPEAT || mx > GRAM_MAX_REPEAT)
                    return rx_fail(x, KV_ETOOLONG, "%s", "a repetition count is above the limit of 10000");
            } else break;
            if (peek(x) == '?') x->i++; /* lazy: same language */
            else if (peek(x) == '+')
                return rx_fail(x, KV_EINVAL, "%s", "possessive quantifiers are not supported");
            atom = gn_rep(x->b, atom, mn, mx);
            if (!atom) return rx_fail(x, x->b->st ? x->b->st : KV_ENOMEM, "%.200s", x->b->err[0] ? x->b->err : "out of memory");
        }
        gn_add(x->b, seq, atom);
    }
    if (top && x->search && !x->st) {
        struct gn *w = gn_seq(x->b);
        if (!anch_start) gn_add(x->b, w, any_run(x));
        gn_add(x->b, w, seq);
        if (!anch_end) gn_add(x->b, w, any_run(x));
        return w;
    }
    return seq;
}

static struct gn *parse_alt(struct rx *x, bool top) {
    struct gn *first = parse_seq(x, top);
    if (!first) return NULL;
    if (peek(x) != '|') return first;
    struct gn *alt = gn_alt(x->b);
    gn_add(x->b, alt, first);
    while (peek(x) == '|' && !x->st) {
        x->i++;
        struct gn *s = parse_seq(x, top);
        if (!s) return NULL;
        gn_add(x->b, alt, s);
    }
    return alt;
}

kv_status gram_regex_parse(struct gb *b, const char *re, size_t len, const struct gcset *universe,
                           bool search, struct gn **out, char *err, size_t errlen) {
    struct rx x = {.b = b, .s = re, .n = len, .universe = universe, .search = search, .err = err,
                   .errlen = errlen};
    struct gn *n = parse_alt(&x, true);
    if (!x.st && !at_end(&x)) rx_fail(&x, KV_EINVAL, "%s", "unbalanced ')'");
    if (!x.st && b->st) {
        x.st = b->st;
        snprintf(err, errlen, "%s", b->err);
    }
    if (x.st) return x.st;
    *out = n;
    return KV_OK;
}
