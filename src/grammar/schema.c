/*
 * JSON schema -> grammar (a draft 2020-12 subset; docs/structured-output.md lists it).
 *
 * The output is compact-ish JSON: between tokens an optional single space, or a newline and
 * any run of spaces/tabs (pretty printing); object members in schema order; integers of at
 * most 16 digits (they fit an int64), exponents of at most 2 digits. Every output validates
 * against the schema; the schema's full language may be larger (documented per keyword).
 * Anything that would constrain the output and is not implemented is refused with the
 * keyword and its JSON pointer.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

struct gsc {
    struct gb *b;
    const json_t *root;
    bool strict;
    kv_status st;
    char *err;
    size_t errlen;
    struct { char *ref; int rule; } *refs;
    int n_refs, cap_refs;
    int depth;
};

static struct gn *sc_fail(struct gsc *c, kv_status st, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static struct gn *sc_fail(struct gsc *c, kv_status st, const char *path, const char *fmt, ...) {
    if (!c->st) {
        c->st = st;
        char m[300];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m, sizeof m, fmt, ap);
        va_end(ap);
        snprintf(c->err, c->errlen, "%s at %s", m, path && *path ? path : "#");
    }
    return NULL;
}

/* A shared rule by name, built from a regex the first time (same builder = shared). */
static struct gn *shared_regex(struct gsc *c, const char *name, const char *re) {
    int r = gb_rule_find(c->b, name);
    if (r < 0) {
        r = gb_rule_new(c->b, name);
        if (r < 0) return NULL;
        struct gn *n = NULL;
        char e[256];
        if (gram_regex_parse(c->b, re, strlen(re), NULL, false, &n, e, sizeof e))
            return sc_fail(c, KV_EINVAL, "", "internal regex error: %s", e);
        gb_rule_set(c->b, r, n);
    }
    return gn_ref(c->b, r);
}

/* Whitespace between JSON tokens: nothing, one space, or a newline and an indentation of at
 * most 16 spaces/tabs (bounded: small models otherwise fill max_tokens with blanks). */
static struct gn *ws(struct gsc *c) { return shared_regex(c, "ws", "( |\n[ \t]{0,16})?"); }

/* One string character: printable without escaping, or an escape (\u never a surrogate or
 * U+0000, so every parser accepts the result). */
#define STRCHAR_RE                                                                                \
    "[^\"\\\\\\x00-\\x1f]|\\\\([\"\\\\/bfnrt]|u([1-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}|" \
    "0([1-9a-fA-F][0-9a-fA-F]{2}|0([1-9a-fA-F][0-9a-fA-F]|0[1-9a-fA-F]))))"
static struct gn *strchar(struct gsc *c) { return shared_regex(c, "json-char", STRCHAR_RE); }
static struct gn *string_any(struct gsc *c) {
    return shared_regex(c, "json-string", "\"(" STRCHAR_RE ")*\"");
}
#define INT_RE "-?(0|[1-9][0-9]{0,15})"
static struct gn *number_any(struct gsc *c) {
    return shared_regex(c, "json-number", INT_RE "(\\.[0-9]+)?([eE][-+]?[0-9]{1,2})?");
}
static struct gn *integer_any(struct gsc *c) { return shared_regex(c, "json-integer", INT_RE); }

/* Pieces of JSON syntax: sep = ws "," ws; member = key ws ":" ws value; list1 = item (sep
 * item)* ws; wrap = open ws body close. */
static struct gn *sep(struct gsc *c) { return gn_seq3(c->b, ws(c), gn_str(c->b, ","), ws(c)); }
static struct gn *member(struct gsc *c, struct gn *key, struct gn *value) {
    return gn_seq3(c->b, key, gn_seq3(c->b, ws(c), gn_str(c->b, ":"), ws(c)), value);
}
static struct gn *list1(struct gsc *c, struct gn *item) {
    return gn_seq3(c->b, item, gn_rep(c->b, gn_seq2(c->b, sep(c), item), 0, -1), ws(c));
}
static struct gn *wrap(struct gsc *c, const char *open, struct gn *body, const char *close) {
    return gn_seq3(c->b, gn_seq2(c->b, gn_str(c->b, open), ws(c)), body, gn_str(c->b, close));
}

/* value ::= object | array | string | number | true | false | null (any JSON). */
static struct gn *value_any(struct gsc *c) {
    int r = gb_rule_find(c->b, "json-value");
    if (r >= 0) return gn_ref(c->b, r);
    struct gb *b = c->b;
    r = gb_rule_new(b, "json-value");
    int ro = gb_rule_new(b, "json-object");
    int ra = gb_rule_new(b, "json-array");
    if (r < 0 || ro < 0 || ra < 0) return NULL;
    gb_rule_set(b, ro, wrap(c, "{", gn_opt(b, list1(c, member(c, string_any(c), gn_ref(b, r)))), "}"));
    gb_rule_set(b, ra, wrap(c, "[", gn_opt(b, list1(c, gn_ref(b, r))), "]"));
    struct gn *v = gn_alt(b);
    gn_add(b, v, gn_ref(b, ro));
    gn_add(b, v, gn_ref(b, ra));
    gn_add(b, v, string_any(c));
    gn_add(b, v, number_any(c));
    gn_add(b, v, gn_str(b, "true"));
    gn_add(b, v, gn_str(b, "false"));
    gn_add(b, v, gn_str(b, "null"));
    gb_rule_set(b, r, v);
    return gn_ref(b, r);
}

/* ---------------------------------------------------------------- integer ranges */

/* Decimal strings of [lo, hi] (same digit count n, as strings) without leading zeros beyond
 * what lo/hi have. */
static struct gn *digits_range(struct gsc *c, const char *lo, const char *hi, int n) {
    struct gb *b = c->b;
    if (n == 0) return gn_empty(b);
    if (lo[0] == hi[0]) return gn_seq2(b, gn_bytes(b, lo, 1), digits_range(c, lo + 1, hi + 1, n - 1));
    bool lo_zero = true, hi_nine = true;
    for (int i = 1; i < n; i++) {
        lo_zero &= lo[i] == '0';
        hi_nine &= hi[i] == '9';
    }
    struct gn *alt = gn_alt(b);
    char nines[24], zeros[24];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    char a = lo[0], z = hi[0];
    if (!lo_zero) {
        gn_add(b, alt, gn_seq2(b, gn_bytes(b, lo, 1), digits_range(c, lo + 1, nines, n - 1)));
        a++;
    }
    if (!hi_nine) z--;
    if (a <= z)
        gn_add(b, alt, gn_seq2(b, gn_range(b, (uint32_t)a, (uint32_t)z), gn_rep(b, gn_range(b, '0', '9'), n - 1, n - 1)));
    if (!hi_nine) gn_add(b, alt, gn_seq2(b, gn_bytes(b, hi, 1), digits_range(c, zeros, hi + 1, n - 1)));
    return alt;
}

#define INT_MAX_DIGITS 16
static const uint64_t POW10[] = {1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull,
                                 10000000ull, 100000000ull, 1000000000ull, 10000000000ull,
                                 100000000000ull, 1000000000000ull, 10000000000000ull,
                                 100000000000000ull, 1000000000000000ull, 10000000000000000ull};

/* Non-negative integers in [lo, hi] (hi capped at 16 digits), canonical decimal. */
static struct gn *uint_range(struct gsc *c, uint64_t lo, uint64_t hi) {
    struct gb *b = c->b;
    uint64_t cap = POW10[INT_MAX_DIGITS] - 1;
    if (hi > cap) hi = cap;
    struct gn *alt = gn_alt(b);
    if (lo > hi) return alt;
    for (int n = 1; n <= INT_MAX_DIGITS; n++) {
        uint64_t a = n == 1 ? 0 : POW10[n - 1], z = POW10[n] - 1;
        if (a < lo) a = lo;
        if (z > hi) z = hi;
        if (a > z) continue;
        char sa[24], sz[24];
        snprintf(sa, sizeof sa, "%llu", (unsigned long long)a);
        snprintf(sz, sizeof sz, "%llu", (unsigned long long)z);
        gn_add(b, alt, digits_range(c, sa, sz, n));
    }
    return alt;
}

/* Integers in [lo, hi]; has_lo / has_hi false = unbounded (then 16 digits at most). */
static struct gn *int_range(struct gsc *c, bool has_lo, int64_t lo, bool has_hi, int64_t hi) {
    struct gb *b = c->b;
    const int64_t big = (int64_t)POW10[INT_MAX_DIGITS] - 1;
    if (!has_lo || lo < -big) lo = -big;
    if (!has_hi || hi > big) hi = big;
    struct gn *alt = gn_alt(b);
    if (lo > hi) return alt;
    if (hi >= 0) gn_add(b, alt, uint_range(c, lo > 0 ? (uint64_t)lo : 0, (uint64_t)hi));
    if (lo < 0) {
        uint64_t a = hi < 0 ? (uint64_t)(-hi) : 1, z = (uint64_t)(-lo);
        gn_add(b, alt, gn_seq2(b, gn_str(b, "-"), uint_range(c, a, z)));
    }
    return alt;
}

/* ---------------------------------------------------------------- keywords */

static const char *const ANNOTATIONS[] = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "contentEncoding", "contentMediaType",
    "discriminator", NULL};
static const char *const KNOWN[] = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf",
    "$ref", "nullable", "uniqueItems", "additionalItems", NULL};

static bool in_list(const char *const *l, const char *k) {
    for (; *l; l++)
        if (!strcmp(*l, k)) return true;
    return false;
}

static void subpath(char *out, size_t cap, const char *path, const char *a, const char *bk) {
    snprintf(out, cap, "%s/%s%s%s", path, a, bk ? "/" : "", bk ? bk : "");
}

static struct gn *node(struct gsc *c, const json_t *s, const char *path);

/* The JSON text of a constant value (enum / const), compact. */
static struct gn *const_node(struct gsc *c, const json_t *v) {
    char *txt = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!txt) return sc_fail(c, KV_ENOMEM, "", "out of memory");
    struct gn *n = gn_str(c->b, txt);
    free(txt);
    return n;
}

static bool type_matches(const json_t *v, const char *t) {
    if (!strcmp(t, "string")) return json_is_string(v);
    if (!strcmp(t, "integer"))
        return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (!strcmp(t, "number")) return json_is_number(v);
    if (!strcmp(t, "boolean")) return json_is_boolean(v);
    if (!strcmp(t, "null")) return json_is_null(v);
    if (!strcmp(t, "object")) return json_is_object(v);
    if (!strcmp(t, "array")) return json_is_array(v);
    return false;
}

static bool num_field(struct gsc *c, const json_t *s, const char *k, const char *path, bool *has, double *out) {
    json_t *v = json_object_get(s, k);
    *has = false;
    if (!v) return true;
    if (!json_is_number(v)) {
        sc_fail(c, KV_EINVAL, path, "'%s' must be a number", k);
        return false;
    }
    *has = true;
    *out = json_number_value(v);
    return true;
}

static bool count_field(struct gsc *c, const json_t *s, const char *k, const char *path, int *out) {
    json_t *v = json_object_get(s, k);
    if (!v) return true;
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        sc_fail(c, KV_EINVAL, path, "'%s' must be a non-negative integer", k);
        return false;
    }
    if (json_integer_value(v) > GRAM_MAX_REPEAT) {
        sc_fail(c, KV_ETOOLONG, path, "'%s' is above the supported limit of %d", k, GRAM_MAX_REPEAT);
        return false;
    }
    *out = (int)json_integer_value(v);
    return true;
}

static const char *format_re(const char *f) {
#define DATE_RE                                                                          \
    "[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|" \
    "02-(0[1-9]|1[0-9]|2[0-8]))"
#define TIME_RE "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[-+]([01][0-9]|2[0-3]):[0-5][0-9])"
    if (!strcmp(f, "date")) return DATE_RE;
    if (!strcmp(f, "time")) return TIME_RE;
    if (!strcmp(f, "date-time")) return DATE_RE "T" TIME_RE;
    if (!strcmp(f, "uuid")) return "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}";
    if (!strcmp(f, "ipv4"))
        return "((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
    if (!strcmp(f, "email")) return "[a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9-]{1,63}(\\.[a-zA-Z0-9-]{1,63}){0,4}\\.[a-zA-Z]{2,8}";
    return NULL;
}

static struct gn *string_node(struct gsc *c, const json_t *s, const char *path) {
    struct gb *b = c->b;
    int mn = 0, mx = -1;
    if (!count_field(c, s, "minLength", path, &mn) || !count_field(c, s, "maxLength", path, &mx)) return NULL;
    if (json_object_get(s, "maxLength") && mx < mn)
        return sc_fail(c, KV_EINVAL, path, "maxLength is below minLength");
    json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    if (pat && !json_is_string(pat)) return sc_fail(c, KV_EINVAL, path, "'pattern' must be a string");
    if (fmt && !json_is_string(fmt)) return sc_fail(c, KV_EINVAL, path, "'format' must be a string");
    bool lengths = json_object_get(s, "minLength") || json_object_get(s, "maxLength");
    if (pat && fmt) return sc_fail(c, KV_EINVAL, path, "unsupported: 'pattern' together with 'format'");
    if ((pat || fmt) && lengths)
        return sc_fail(c, KV_EINVAL, path, "unsupported: '%s' together with 'minLength'/'maxLength'",
                       pat ? "pattern" : "format");
    if (fmt) {
        const char *re = format_re(json_string_value(fmt));
        if (!re) return sc_fail(c, KV_EINVAL, path, "unsupported JSON schema format '%s' (keyword 'format')",
                                json_string_value(fmt));
        char name[64];
        snprintf(name, sizeof name, "format-%s", json_string_value(fmt));
        return gn_seq3(b, gn_str(b, "\""), shared_regex(c, name, re), gn_str(b, "\""));
    }
    if (pat) {
        /* the pattern's characters are emitted unescaped: classes lose '"', '\' and controls */
        struct gcset u = {0};
        if (gcset_add(&u, 0x20, 0x21) || gcset_add(&u, 0x23, 0x5B) || gcset_add(&u, 0x5D, 0x10FFFF)) {
            gcset_free(&u);
            return sc_fail(c, KV_ENOMEM, path, "out of memory");
        }
        struct gn *n = NULL;
        char e[256];
        kv_status st = gram_regex_parse(b, json_string_value(pat), json_string_length(pat), &u, true, &n, e, sizeof e);
        gcset_free(&u);
        if (st) return sc_fail(c, st, path, "unsupported 'pattern': %s", e);
        return gn_seq3(b, gn_str(b, "\""), n, gn_str(b, "\""));
    }
    if (!lengths) return string_any(c);
    return gn_seq3(b, gn_str(b, "\""), gn_rep(b, strchar(c), mn, mx), gn_str(b, "\""));
}

static bool integral(double d) { return isfinite(d) && d == floor(d) && fabs(d) < 9e18; }

static struct gn *number_node(struct gsc *c, const json_t *s, const char *path, bool integer) {
    struct gb *b = c->b;
    bool hmin, hmax, hxmin, hxmax;
    double vmin = 0, vmax = 0, vxmin = 0, vxmax = 0;
    if (!num_field(c, s, "minimum", path, &hmin, &vmin) || !num_field(c, s, "maximum", path, &hmax, &vmax) ||
        !num_field(c, s, "exclusiveMinimum", path, &hxmin, &vxmin) ||
        !num_field(c, s, "exclusiveMaximum", path, &hxmax, &vxmax))
        return NULL;
    if (!hmin && !hmax && !hxmin && !hxmax) return integer ? integer_any(c) : number_any(c);
    /* the stricter of each pair; then the integer range [ilo, ihi] */
    bool has_lo = hmin || hxmin, has_hi = hmax || hxmax, lo_x = false, hi_x = false;
    double lo = -INFINITY, hi = INFINITY;
    if (hmin) lo = vmin;
    if (hxmin && (!hmin || vxmin >= vmin)) {
        lo = vxmin;
        lo_x = true;
    }
    if (hmax) hi = vmax;
    if (hxmax && (!hmax || vxmax <= vmax)) {
        hi = vxmax;
        hi_x = true;
    }
    if (!integer) {
        const char *k = (hmin && !integral(vmin)) ? "minimum" : (hmax && !integral(vmax)) ? "maximum"
                        : (hxmin && !integral(vxmin)) ? "exclusiveMinimum"
                        : (hxmax && !integral(vxmax)) ? "exclusiveMaximum" : NULL;
        if (k) return sc_fail(c, KV_EINVAL, path, "unsupported: a non-integer '%s' on a number", k);
    }
    int64_t ilo = 0, ihi = 0;
    if (has_lo) {
        double l = lo_x ? floor(lo) + 1 : ceil(lo);
        if (l < -9e18) has_lo = false;
        else if (l > 9e18) return gn_alt(b);
        else ilo = (int64_t)l;
    }
    if (has_hi) {
        double h = hi_x ? ceil(hi) - 1 : floor(hi);
        if (h > 9e18) has_hi = false;
        else if (h < -9e18) return gn_alt(b);
        else ihi = (int64_t)h;
    }
    struct gn *ints = int_range(c, has_lo, ilo, has_hi, ihi);
    if (integer) return ints;
    /* numbers: the integers, or m.f with f a fraction without trailing zeros (value strictly
     * between m and m+1 for m >= 0, between -k-1 and -k for "-k.f") */
    struct gn *frac = shared_regex(c, "json-fraction", "\\.[0-9]{0,15}[1-9]");
    struct gn *alt = gn_alt(b);
    gn_add(b, alt, ints);
    /* non-negative k with [k, k+1] inside [lo, hi]: k >= lo, k + 1 <= hi */
    double klo = has_lo ? ceil(lo) : 0, khi = has_hi ? floor(hi) - 1 : 9e18;
    if (klo < 0) klo = 0;
    if (klo <= khi) gn_add(b, alt, gn_seq2(b, uint_range(c, (uint64_t)klo, khi > 9e18 ? UINT64_MAX : (uint64_t)khi), frac));
    /* "-k.f" in (-k-1, -k): -k-1 >= lo and -k <= hi */
    double nlo = has_hi ? ceil(-hi) : 0, nhi = has_lo ? floor(-lo) - 1 : 9e18;
    if (nlo < 0) nlo = 0;
    if (nlo <= nhi)
        gn_add(b, alt, gn_seq3(b, gn_str(b, "-"), uint_range(c, (uint64_t)nlo, nhi > 9e18 ? UINT64_MAX : (uint64_t)nhi), frac));
    return alt;
}

static struct gn *array_node(struct gsc *c, const json_t *s, const char *path) {
    struct gb *b = c->b;
    int mn = 0, mx = -1;
    if (!count_field(c, s, "minItems", path, &mn) || !count_field(c, s, "maxItems", path, &mx)) return NULL;
    if (json_object_get(s, "maxItems") && mx < mn) return sc_fail(c, KV_EINVAL, path, "maxItems is below minItems");
    json_t *u = json_object_get(s, "uniqueItems");
    if (u && !json_is_false(u))
        return sc_fail(c, KV_EINVAL, path, "unsupported JSON schema keyword 'uniqueItems' (only false)");
    json_t *pre = json_object_get(s, "prefixItems"), *items = json_object_get(s, "items");
    json_t *addi = json_object_get(s, "additionalItems");
    if (json_is_array(items)) { /* draft-07 tuples: items [...] + additionalItems */
        if (pre) return sc_fail(c, KV_EINVAL, path, "unsupported: 'prefixItems' together with an array 'items'");
        pre = items;
        items = addi;
    } else if (addi) {
        return sc_fail(c, KV_EINVAL, path, "'additionalItems' without an array 'items' is not supported");
    }
    if (pre && !json_is_array(pre)) return sc_fail(c, KV_EINVAL, path, "'prefixItems' must be an array");
    if (items && !json_is_object(items) && !json_is_boolean(items))
        return sc_fail(c, KV_EINVAL, path, "'items' must be a schema");
    int k = pre ? (int)json_array_size(pre) : 0;
    if (k > GRAM_MAX_REPEAT) return sc_fail(c, KV_ETOOLONG, path, "too many prefixItems");
    bool rest_ok = !(items && json_is_false(items));
    if (!rest_ok && (mx < 0 || mx > k)) mx = k;
    if (mn > mx && mx >= 0) return sc_fail(c, KV_EINVAL, path, "the array cannot have minItems items");
    /* item(i): prefix schema i, or the items schema */
    struct gn **pn = k ? gb_alloc(b, (size_t)k * sizeof *pn) : NULL;
    char sp[600];
    const char *pre_name = json_object_get(s, "prefixItems") ? "prefixItems" : "items";
    for (int i = 0; i < k; i++) {
        char ix[16];
        snprintf(ix, sizeof ix, "%d", i);
        subpath(sp, sizeof sp, path, pre_name, ix);
        if (!pn || !(pn[i] = node(c, json_array_get(pre, (size_t)i), sp))) return NULL;
    }
    struct gn *rest = NULL;
    if (rest_ok) {
        subpath(sp, sizeof sp, path, pre == json_object_get(s, "items") ? "additionalItems" : "items", NULL);
        rest = items ? node(c, items, sp) : value_any(c);
        if (!rest) return NULL;
    }
    /* after(i): the items after the first i (i >= 1); positions below `top` are explicit
     * (prefix schemas, or items still needed for minItems), from `top` on they are uniform */
    struct gn *comma = sep(c);
    int top = k > mn ? k : mn;
    if (mx >= 0 && top > mx) top = mx;
    if (top < 1) top = 1;
    struct gn *after;
    if (mx >= 0 && top >= mx) after = gn_empty(b);
    else after = gn_rep(b, gn_seq2(b, comma, rest), 0, mx < 0 ? -1 : mx - top);
    for (int i = top - 1; i >= 1; i--) {
        struct gn *step = gn_seq3(b, comma, i < k ? pn[i] : rest, after);
        after = i >= mn ? gn_opt(b, step) : step;
    }
    struct gn *body;
    if (mx == 0) {
        body = gn_empty(b);
    } else {
        struct gn *items_seq = gn_seq3(b, k > 0 ? pn[0] : rest, after, ws(c));
        body = mn == 0 ? gn_opt(b, items_seq) : items_seq;
    }
    return wrap(c, "[", body, "]");
}

static struct gn *object_node(struct gsc *c, const json_t *s, const char *path) {
    struct gb *b = c->b;
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *add = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return sc_fail(c, KV_EINVAL, path, "'properties' must be an object");
    if (req && !json_is_array(req)) return sc_fail(c, KV_EINVAL, path, "'required' must be an array");
    if (add && !json_is_object(add) && !json_is_boolean(add))
        return sc_fail(c, KV_EINVAL, path, "'additionalProperties' must be a schema");
    size_t i;
    json_t *rv;
    json_array_foreach(req, i, rv) if (!json_is_string(rv)) return sc_fail(c, KV_EINVAL, path, "'required' must list strings");
    bool add_allowed = add ? !json_is_false(add) : !c->strict;
    size_t np = props ? json_object_size(props) : 0;
    /* members: the listed properties in schema order, then required names not listed */
    size_t nreq_extra = 0;
    json_array_foreach(req, i, rv) if (!props || !json_object_get(props, json_string_value(rv))) nreq_extra++;
    /* a required name that is not listed is generated unless additionalProperties is false */
    if (nreq_extra && add && json_is_false(add))
        return sc_fail(c, KV_EINVAL, path, "a 'required' property is not in 'properties' and additional properties are not allowed");
    size_t n = np + nreq_extra;
    if (n > GRAM_MAX_REPEAT) return sc_fail(c, KV_ETOOLONG, path, "too many properties");
    struct gn **kv = n ? gb_alloc(b, n * sizeof *kv) : NULL;
    bool *required = n ? gb_alloc(b, n * sizeof *required) : NULL;
    if (n && (!kv || !required)) return NULL;
    char sp[600];
    const char *key;
    json_t *ps;
    size_t k = 0;
    json_object_foreach(props, key, ps) {
        subpath(sp, sizeof sp, path, "properties", key);
        json_t *ks = json_string(key);
        struct gn *kn = ks ? const_node(c, ks) : NULL;
        json_decref(ks);
        struct gn *vn = node(c, ps, sp);
        if (!kn || !vn) return NULL;
        kv[k] = member(c, kn, vn);
        required[k] = false;
        json_array_foreach(req, i, rv) if (!strcmp(json_string_value(rv), key)) required[k] = true;
        k++;
    }
    json_array_foreach(req, i, rv) {
        if (props && json_object_get(props, json_string_value(rv))) continue;
        struct gn *kn = const_node(c, rv);
        subpath(sp, sizeof sp, path, "additionalProperties", NULL);
        struct gn *vn = add && json_is_object(add) ? node(c, add, sp) : value_any(c);
        if (!kn || !vn) return NULL;
        kv[k] = member(c, kn, vn);
        required[k++] = true;
    }
    struct gn *body;
    if (n == 0) {
        if (!add_allowed) body = gn_empty(b);
        else { /* a map: any members whose values follow additionalProperties */
            subpath(sp, sizeof sp, path, "additionalProperties", NULL);
            struct gn *vn = add && json_is_object(add) ? node(c, add, sp) : value_any(c);
            if (!vn) return NULL;
            body = gn_opt(b, list1(c, member(c, string_any(c), vn)));
        }
    } else {
        /* tail(j) = members j.. after at least one was written */
        struct gn **tail = gb_alloc(b, (n + 1) * sizeof *tail);
        if (!tail) return NULL;
        tail[n] = gn_empty(b);
        for (size_t j = n; j-- > 0;) {
            struct gn *step = gn_seq3(b, sep(c), kv[j], tail[j + 1]);
            if (!required[j]) step = gn_add(b, gn_add(b, gn_alt(b), step), tail[j + 1]);
            /* share tail[j] through a rule: tails are referenced from several places */
            int r = gb_rule_new(b, "object-tail");
            gb_rule_set(b, r, step);
            tail[j] = gn_ref(b, r);
        }
        size_t first_req = n;
        for (size_t j = 0; j < n; j++)
            if (required[j]) {
                first_req = j;
                break;
            }
        struct gn *alt = gn_alt(b);
        for (size_t j = 0; j < n && j <= first_req; j++) gn_add(b, alt, gn_seq3(b, kv[j], tail[j + 1], ws(c)));
        if (first_req == n) gn_add(b, alt, gn_empty(b));
        body = alt;
    }
    return wrap(c, "{", body, "}");
}

/* JSON pointer "#/a/b" resolved in the root document (~0 ~1 decoded). */
static const json_t *resolve(const json_t *root, const char *ref) {
    if (strcmp(ref, "#") == 0) return root;
    if (strncmp(ref, "#/", 2) != 0) return NULL;
    const json_t *cur = root;
    const char *p = ref + 2;
    char tok[256];
    while (cur) {
        size_t n = 0;
        while (*p && *p != '/' && n + 1 < sizeof tok) {
            if (p[0] == '~' && p[1] == '0') { tok[n++] = '~'; p += 2; }
            else if (p[0] == '~' && p[1] == '1') { tok[n++] = '/'; p += 2; }
            else tok[n++] = *p++;
        }
        tok[n] = 0;
        if (json_is_object(cur)) cur = json_object_get(cur, tok);
        else if (json_is_array(cur)) {
            char *end;
            long ix = strtol(tok, &end, 10);
            cur = *end || ix < 0 ? NULL : json_array_get(cur, (size_t)ix);
        } else cur = NULL;
        if (!*p) break;
        p++;
    }
    return cur;
}

static struct gn *ref_node(struct gsc *c, const char *ref, const char *path) {
    for (int i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i].ref, ref)) return gn_ref(c->b, c->refs[i].rule);
    const json_t *t = resolve(c->root, ref);
    if (!t) return sc_fail(c, KV_EINVAL, path, "unsupported or unresolvable '$ref' \"%s\" (only local #/... references)", ref);
    if (c->n_refs == c->cap_refs) {
        int nc = c->cap_refs ? c->cap_refs * 2 : 8;
        void *np = kv_realloc(c->refs, (size_t)nc * sizeof *c->refs);
        if (!np) return sc_fail(c, KV_ENOMEM, path, "out of memory");
        c->refs = np;
        c->cap_refs = nc;
    }
    char name[300];
    snprintf(name, sizeof name, "ref %s", ref);
    int r = gb_rule_new(c->b, name);
    char *dup = kv_strdup(ref);
    if (r < 0 || !dup) {
        free(dup);
        return sc_fail(c, KV_ENOMEM, path, "out of memory");
    }
    c->refs[c->n_refs].ref = dup;
    c->refs[c->n_refs++].rule = r;
    gb_rule_set(c->b, r, node(c, t, ref));
    return c->st ? NULL : gn_ref(c->b, r);
}

static struct gn *typed_node(struct gsc *c, const json_t *s, const char *type, const char *path) {
    struct gb *b = c->b;
    if (!strcmp(type, "string")) return string_node(c, s, path);
    if (!strcmp(type, "number")) return number_node(c, s, path, false);
    if (!strcmp(type, "integer")) return number_node(c, s, path, true);
    if (!strcmp(type, "boolean")) return gn_add(b, gn_add(b, gn_alt(b), gn_str(b, "true")), gn_str(b, "false"));
    if (!strcmp(type, "null")) return gn_str(b, "null");
    if (!strcmp(type, "object")) return object_node(c, s, path);
    if (!strcmp(type, "array")) return array_node(c, s, path);
    return sc_fail(c, KV_EINVAL, path, "unknown JSON schema type '%s'", type);
}

static struct gn *node(struct gsc *c, const json_t *s, const char *path) {
    struct gb *b = c->b;
    if (c->st) return NULL;
    if (json_is_true(s)) return value_any(c);
    if (json_is_false(s)) return gn_alt(b);
    if (!json_is_object(s)) return sc_fail(c, KV_EINVAL, path, "a schema must be an object or a boolean");
    if (++c->depth > 64) return sc_fail(c, KV_ETOOLONG, path, "the schema nests too deeply");
    struct gn *res = NULL;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)s, k, v) {
        if (in_list(ANNOTATIONS, k)) continue;
        if (!in_list(KNOWN, k)) {
            res = sc_fail(c, KV_EINVAL, path, "unsupported JSON schema keyword '%s'", k);
            goto out;
        }
    }
    json_t *ref = json_object_get(s, "$ref");
    json_t *comb = NULL;
    const char *comb_name = NULL;
    static const char *const combs[] = {"anyOf", "oneOf", "allOf"};
    for (int i = 0; i < 3; i++)
        if (json_object_get(s, combs[i])) {
            if (comb) {
                res = sc_fail(c, KV_EINVAL, path, "unsupported: '%s' together with '%s'", comb_name, combs[i]);
                goto out;
            }
            comb = json_object_get(s, combs[i]);
            comb_name = combs[i];
        }
    bool nullable = json_is_true(json_object_get(s, "nullable"));
    if (ref) {
        if (!json_is_string(ref)) {
            res = sc_fail(c, KV_EINVAL, path, "'$ref' must be a string");
            goto out;
        }
        const char *other = NULL;
        json_object_foreach((json_t *)s, k, v) if (strcmp(k, "$ref") && !in_list(ANNOTATIONS, k) && strcmp(k, "nullable")) other = k;
        if (other) {
            res = sc_fail(c, KV_EINVAL, path, "unsupported: '$ref' together with '%s'", other);
            goto out;
        }
        res = ref_node(c, json_string_value(ref), path);
    } else if (comb) {
        const char *other = NULL;
        json_object_foreach((json_t *)s, k, v) if (strcmp(k, comb_name) && !in_list(ANNOTATIONS, k) && strcmp(k, "nullable")) other = k;
        if (other) {
            res = sc_fail(c, KV_EINVAL, path, "unsupported: '%s' together with '%s'", comb_name, other);
            goto out;
        }
        if (!json_is_array(comb) || json_array_size(comb) == 0) {
            res = sc_fail(c, KV_EINVAL, path, "'%s' must be a non-empty array", comb_name);
            goto out;
        }
        if (!strcmp(comb_name, "allOf") && json_array_size(comb) > 1) {
            res = sc_fail(c, KV_EINVAL, path, "unsupported: 'allOf' with more than one schema");
            goto out;
        }
        if (json_array_size(comb) > GRAM_MAX_CHOICES) {
            res = sc_fail(c, KV_ETOOLONG, path, "'%s' has %zu schemas: the limit is %d", comb_name,
                          json_array_size(comb), GRAM_MAX_CHOICES);
            goto out;
        }
        struct gn *alt = gn_alt(b);
        size_t i;
        json_t *e;
        json_array_foreach(comb, i, e) {
            char ix[24], sp[600];
            snprintf(ix, sizeof ix, "%zu", i);
            subpath(sp, sizeof sp, path, comb_name, ix);
            struct gn *n = node(c, e, sp);
            if (!n) goto out;
            gn_add(b, alt, n);
        }
        res = alt;
    } else if (json_object_get(s, "enum") || json_object_get(s, "const")) {
        json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
        if (en && cn) {
            res = sc_fail(c, KV_EINVAL, path, "unsupported: 'enum' together with 'const'");
            goto out;
        }
        if (en && (!json_is_array(en) || json_array_size(en) == 0)) {
            res = sc_fail(c, KV_EINVAL, path, "'enum' must be a non-empty array");
            goto out;
        }
        if (en && json_array_size(en) > GRAM_MAX_CHOICES) {
            res = sc_fail(c, KV_ETOOLONG, path, "'enum' has %zu values: the limit is %d", json_array_size(en),
                          GRAM_MAX_CHOICES);
            goto out;
        }
        json_t *types = json_object_get(s, "type");
        struct gn *alt = gn_alt(b);
        size_t n = en ? json_array_size(en) : 1;
        for (size_t i = 0; i < n; i++) {
            json_t *val = en ? json_array_get(en, i) : cn;
            bool ok = !types;
            if (json_is_string(types)) ok = type_matches(val, json_string_value(types));
            else if (json_is_array(types)) {
                size_t j;
                json_t *t;
                json_array_foreach(types, j, t) if (json_is_string(t) && type_matches(val, json_string_value(t))) ok = true;
            }
            if (ok) gn_add(b, alt, const_node(c, val));
        }
        if (alt && alt->n_kids == 0) {
            res = sc_fail(c, KV_EINVAL, path, "no 'enum'/'const' value matches 'type'");
            goto out;
        }
        res = alt;
    } else {
        json_t *t = json_object_get(s, "type");
        if (t && json_is_string(t)) {
            res = typed_node(c, s, json_string_value(t), path);
        } else if (t && json_is_array(t)) {
            if (json_array_size(t) == 0) {
                res = sc_fail(c, KV_EINVAL, path, "'type' must not be an empty array");
                goto out;
            }
            struct gn *alt = gn_alt(b);
            size_t i;
            json_t *e;
            json_array_foreach(t, i, e) {
                if (!json_is_string(e)) {
                    res = sc_fail(c, KV_EINVAL, path, "'type' entries must be strings");
                    goto out;
                }
                struct gn *n = typed_node(c, s, json_string_value(e), path);
                if (!n) goto out;
                gn_add(b, alt, n);
            }
            res = alt;
        } else if (t) {
            res = sc_fail(c, KV_EINVAL, path, "'type' must be a string or an array");
        } else {
            /* no type: the keywords present say which type is meant (a subset of what the
             * schema admits); none -> any value */
            static const char *const objk[] = {"properties", "required", "additionalProperties", NULL};
            static const char *const arrk[] = {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "additionalItems", NULL};
            static const char *const strk[] = {"minLength", "maxLength", "pattern", "format", NULL};
            static const char *const numk[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};
            const char *ty = NULL;
            json_object_foreach((json_t *)s, k, v) {
                const char *t2 = in_list(objk, k) ? "object" : in_list(arrk, k) ? "array"
                                 : in_list(strk, k) ? "string" : in_list(numk, k) ? "number" : NULL;
                if (!t2) continue;
                if (ty && strcmp(ty, t2)) {
                    res = sc_fail(c, KV_EINVAL, path, "unsupported: keywords of several types without 'type'");
                    goto out;
                }
                ty = t2;
            }
            res = ty ? typed_node(c, s, ty, path) : value_any(c);
        }
    }
    if (res && nullable) res = gn_add(b, gn_add(b, gn_alt(b), res), gn_str(b, "null"));
out:
    c->depth--;
    return c->st ? NULL : res;
}

struct gsc *gsc_new(struct gb *b, const json_t *root, bool strict, char *err, size_t errlen) {
    struct gsc *c = kv_calloc(1, sizeof *c);
    if (!c) return NULL;
    c->b = b;
    c->root = root;
    c->strict = strict;
    c->err = err;
    c->errlen = errlen;
    return c;
}

void gsc_free(struct gsc *c) {
    if (!c) return;
    for (int i = 0; i < c->n_refs; i++) free(c->refs[i].ref);
    free(c->refs);
    free(c);
}

struct gn *gsc_node(struct gsc *c, const json_t *schema, const char *path) {
    struct gn *n = node(c, schema, path ? path : "#");
    if (!n && !c->st) {
        c->st = c->b->st ? c->b->st : KV_ENOMEM;
        snprintf(c->err, c->errlen, "%s", c->b->err[0] ? c->b->err : "out of memory");
    }
    return n;
}

kv_status gsc_status(const struct gsc *c) { return c->st; }
struct gn *gsc_ws(struct gsc *c) { return ws(c); }
struct gn *gsc_string(struct gsc *c) { return string_any(c); }
struct gn *gsc_value(struct gsc *c) { return value_any(c); }
