/* convert: values to text and back. JavaScript number printing, what {{ x }} and ~ print, the
 * tojson filter (Python json.dumps options), JavaScript Number()/parseInt()/parseFloat() on
 * strings, and the JSON render context converted to template values. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

/* ---- numbers as JavaScript prints them ---- */
static void js_num(double d, char *buf, size_t cap) {
    if (isnan(d)) {
        snprintf(buf, cap, "NaN");
        return;
    }
    if (isinf(d)) {
        snprintf(buf, cap, d < 0 ? "-Infinity" : "Infinity");
        return;
    }
    if (d == 0) {
        snprintf(buf, cap, "0");
        return;
    }
    char tmp[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, d);
        if (strtod(tmp, NULL) == d) break;
    }
    /* tmp = [-]d.ddde[+-]xx */
    const char *q = tmp;
    bool neg = *q == '-';
    if (neg) q++;
    char dig[24];
    int k = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') dig[k++] = *q;
    while (k > 1 && dig[k - 1] == '0') k--;
    dig[k] = 0;
    int e = atoi(q + 1);
    int n = e + 1;
    char *o = buf;
    size_t left = cap;
#define OUT(...) do { int w_ = snprintf(o, left, __VA_ARGS__); if (w_ > 0 && (size_t)w_ < left) { o += w_; left -= (size_t)w_; } } while (0)
    if (neg) OUT("-");
    if (k <= n && n <= 21) {
        OUT("%s", dig);
        for (int i = 0; i < n - k; i++) OUT("0");
    } else if (0 < n && n <= 21) {
        OUT("%.*s.%s", n, dig, dig + n);
    } else if (-6 < n && n <= 0) {
        OUT("0.");
        for (int i = 0; i < -n; i++) OUT("0");
        OUT("%s", dig);
    } else {
        if (k == 1) OUT("%c", dig[0]);
        else OUT("%c.%s", dig[0], dig + 1);
        OUT("e%c%d", n - 1 >= 0 ? '+' : '-', abs(n - 1));
    }
#undef OUT
}

static void float_str(double d, char *buf, size_t cap) {
    if (d == 0 && signbit(d)) snprintf(buf, cap, "-0.0");
    else if (isfinite(d) && d == floor(d) && fabs(d) < 1e21) snprintf(buf, cap, "%.1f", d);
    else js_num(d, buf, cap);
}

static void to_json(struct ctx *C, struct sb *b, const val *v, int indent, bool ascii, bool sort, const char *isep,
                    const char *ksep, int depth, bool undef_null, const struct node *at);

/* RuntimeValue.toString(): what {{ x }} prints */
void jv_to_str(struct ctx *C, struct sb *b, const val *v, const struct node *at) {
    char buf[64];
    switch (v->t) {
    case V_UNDEF:
    case V_NULL: jv_sb_puts(C, b, "undefined"); break; /* only reached inside arrays */
    case V_BOOL: jv_sb_puts(C, b, v->b ? "true" : "false"); break;
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->i); jv_sb_puts(C, b, buf); break;
    case V_FLOAT: float_str(v->f, buf, sizeof buf); jv_sb_puts(C, b, buf); break;
    case V_STR: jv_sb_put(C, b, v->s, v->n); break;
    case V_FUNC: jv_fail(C, at, "cannot convert a function to a string");
    default: to_json(C, b, v, 0, false, false, ", ", ": ", 0, false, at); break;
    }
}

/* JavaScript value.toString() on the raw value (used by ~ and string +) */
void jv_raw_str(struct ctx *C, struct sb *b, const val *v, const struct node *at) {
    char buf[64];
    switch (v->t) {
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->i); jv_sb_puts(C, b, buf); break;
    case V_FLOAT: js_num(v->f, buf, sizeof buf); jv_sb_puts(C, b, buf); break;
    case V_ARRAY:
    case V_TUPLE:
        for (size_t i = 0; i < v->a->n; i++) {
            if (i) jv_sb_puts(C, b, ",");
            jv_to_str(C, b, v->a->v[i], at);
        }
        break;
    case V_OBJECT:
    case V_KWARGS:
    case V_NS: jv_sb_puts(C, b, "[object Map]"); break;
    default: jv_to_str(C, b, v, at); break;
    }
}

static void json_str(struct ctx *C, struct sb *b, const char *s, size_t n, bool ascii) {
    jv_sb_put(C, b, "\"", 1);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        char buf[16];
        if (c == '"' || c == '\\') {
            buf[0] = '\\';
            buf[1] = (char)c;
            jv_sb_put(C, b, buf, 2);
            i++;
        } else if (c < 0x20) {
            const char *e = c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
            if (e) jv_sb_puts(C, b, e);
            else {
                snprintf(buf, sizeof buf, "\\u%04x", c);
                jv_sb_puts(C, b, buf);
            }
            i++;
        } else if (ascii && c >= 0x7f) {
            uint32_t cp;
            size_t l = ju_decode(s + i, n - i, &cp);
            if (l == 1 && c >= 0x80) cp = 0xFFFD;
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(buf, sizeof buf, "\\u%04x", cp);
            }
            jv_sb_puts(C, b, buf);
            i += l;
        } else {
            jv_sb_put(C, b, s + i, 1);
            i++;
        }
    }
    jv_sb_put(C, b, "\"", 1);
}

static void to_json(struct ctx *C, struct sb *b, const val *v, int indent, bool ascii, bool sort, const char *isep,
                    const char *ksep, int depth, bool undef_null, const struct node *at) {
    char buf[64];
    if (depth > 200) jv_fail(C, at, "value nested too deeply for tojson");
    switch (v->t) {
    case V_NULL: jv_sb_puts(C, b, "null"); return;
    case V_UNDEF: jv_sb_puts(C, b, undef_null ? "null" : "undefined"); return;
    case V_BOOL: jv_sb_puts(C, b, v->b ? "true" : "false"); return;
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->i); jv_sb_puts(C, b, buf); return;
    case V_FLOAT:
        if (!isfinite(v->f)) jv_sb_puts(C, b, "null");
        else {
            js_num(v->f, buf, sizeof buf);
            jv_sb_puts(C, b, buf);
        }
        return;
    case V_STR: json_str(C, b, v->s, v->n, ascii); return;
    case V_FUNC: jv_fail(C, at, "cannot convert to JSON: FunctionValue");
    default: break;
    }
    bool array = is_arr(v);
    size_t n = array ? v->a->n : v->o->n;
    #define PAD(d) do { jv_sb_puts(C, b, "\n"); for (int q_ = 0; q_ < (d) * indent; q_++) jv_sb_put(C, b, " ", 1); } while (0)
    jv_sb_puts(C, b, array ? "[" : "{");
    size_t *order = NULL;
    if (!array) {
        order = ja_alloc(C->a, (n + 1) * sizeof *order);
        for (size_t i = 0; i < n; i++) order[i] = i;
        if (sort) {
            /* insertion sort by key bytes (stable) */
            for (size_t i = 1; i < n; i++) {
                size_t x = order[i], j = i;
                while (j > 0) {
                    size_t y = order[j - 1];
                    size_t ml = v->o->kn[x] < v->o->kn[y] ? v->o->kn[x] : v->o->kn[y];
                    int c = memcmp(v->o->k[x], v->o->k[y], ml);
                    if (c > 0 || (c == 0 && v->o->kn[x] >= v->o->kn[y])) break;
                    order[j] = y;
                    j--;
                }
                order[j] = x;
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (i) jv_sb_puts(C, b, isep);
        if (indent) PAD(depth + 1);
        if (array) {
            to_json(C, b, v->a->v[i], indent, ascii, sort, isep, ksep, depth + 1, undef_null, at);
        } else {
            size_t k = order[i];
            json_str(C, b, v->o->k[k], v->o->kn[k], ascii);
            jv_sb_puts(C, b, ksep);
            to_json(C, b, v->o->v[k], indent, ascii, sort, isep, ksep, depth + 1, undef_null, at);
        }
    }
    if (indent && n) PAD(depth);
    jv_sb_puts(C, b, array ? "]" : "}");
    #undef PAD
}

double ju_to_number(const char *s, size_t n) {
    size_t a, e;
    ju_trim(s, n, true, true, &a, &e);
    if (a == e) return 0;
    char buf[64];
    if (e - a >= sizeof buf) return NAN;
    memcpy(buf, s + a, e - a);
    buf[e - a] = 0;
    if (!strcmp(buf, "Infinity") || !strcmp(buf, "+Infinity")) return INFINITY;
    if (!strcmp(buf, "-Infinity")) return -INFINITY;
    for (char *p = buf; *p; p++)
        if (*p == 'n' || *p == 'N' || *p == 'i' || *p == 'I' || *p == 'p' || *p == 'P') return NAN;
    char *end;
    double d = strtod(buf, &end);
    return *end ? NAN : d;
}

val *jv_tojson(struct ctx *C, const val *v, int indent, bool ascii, bool sort, const char *is, const char *ks,
               const struct node *at) {
    struct sb b = {0};
    to_json(C, &b, v, indent, ascii, sort, is, ks, 0, true, at);
    return jv_sb_val(C, &b);
}

int64_t ju_parse_int(const char *s, size_t n, bool *ok) {
    /* parseInt(s, 10): leading whitespace, sign, digits */
    size_t i, end;
    ju_trim(s, n, true, false, &i, &end);
    bool neg = false;
    if (i < n && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
    int64_t v = 0;
    size_t st = i;
    while (i < n && s[i] >= '0' && s[i] <= '9' && v < INT64_MAX / 10 - 10) v = v * 10 + (s[i++] - '0');
    *ok = i > st;
    return neg ? -v : v;
}
double ju_parse_float(const char *s, size_t n, bool *ok) {
    size_t i, end;
    ju_trim(s, n, true, false, &i, &end);
    char buf[128];
    size_t l = n - i < sizeof buf - 1 ? n - i : sizeof buf - 1;
    memcpy(buf, s + i, l);
    buf[l] = 0;
    /* parseFloat accepts a decimal prefix only (and "Infinity") */
    size_t j = 0;
    if (buf[j] == '-' || buf[j] == '+') j++;
    if (!strncmp(buf + j, "Infinity", 8)) {
        *ok = true;
        return buf[0] == '-' ? -INFINITY : INFINITY;
    }
    size_t d0 = j;
    while (buf[j] >= '0' && buf[j] <= '9') j++;
    if (buf[j] == '.') {
        j++;
        while (buf[j] >= '0' && buf[j] <= '9') j++;
    }
    if (j == d0 || (j == d0 + 1 && buf[d0] == '.')) {
        *ok = false;
        return 0;
    }
    if (buf[j] == 'e' || buf[j] == 'E') {
        size_t e = j + 1;
        if (buf[e] == '-' || buf[e] == '+') e++;
        if (buf[e] >= '0' && buf[e] <= '9') {
            while (buf[e] >= '0' && buf[e] <= '9') e++;
            j = e;
        }
    }
    buf[j] = 0;
    *ok = true;
    return strtod(buf, NULL);
}

/* ---- JSON context -> values ---- */
static bool array_index_key(const char *k) {
    if (!*k || (k[0] == '0' && k[1])) return false;
    size_t n = 0;
    for (const char *p = k; *p; p++, n++)
        if (*p < '0' || *p > '9') return false;
    return n < 10 || (n == 10 && strcmp(k, "4294967295") < 0);
}
val *jv_from_json(struct ctx *C, const json_t *j, int depth) {
    if (depth > 200) ja_fail(C->a, KV_EINVAL, 0, 0, "context JSON nested too deeply");
    switch (json_typeof(j)) {
    case JSON_NULL: return NUL;
    case JSON_TRUE: return BOOLV(true);
    case JSON_FALSE: return BOOLV(false);
    case JSON_INTEGER: return jv_int(C, json_integer_value(j));
    case JSON_REAL: {
        double d = json_real_value(j);
        if (d == floor(d) && fabs(d) < 9e15) return jv_int(C, (int64_t)d);
        return jv_float(C, d);
    }
    case JSON_STRING: return jv_strdup(C, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        val *r = jv_arr(C, V_ARRAY);
        for (size_t i = 0; i < json_array_size(j); i++) jv_push(C, r->a, jv_from_json(C, json_array_get(j, i), depth + 1));
        return r;
    }
    case JSON_OBJECT: {
        val *r = jv_obj(C, V_OBJECT);
        const char *k;
        json_t *v;
        /* JavaScript objects list integer-like keys first, ascending */
        size_t nint = 0;
        json_object_foreach((json_t *)j, k, v) nint += array_index_key(k);
        if (nint) {
            const char **ik = ja_alloc(C->a, nint * sizeof *ik);
            size_t q = 0;
            json_object_foreach((json_t *)j, k, v) if (array_index_key(k)) ik[q++] = k;
            for (size_t a = 1; a < nint; a++)
                for (size_t b = a; b > 0 && (strlen(ik[b]) < strlen(ik[b - 1]) ||
                                             (strlen(ik[b]) == strlen(ik[b - 1]) && strcmp(ik[b], ik[b - 1]) < 0));
                     b--) {
                    const char *t = ik[b];
                    ik[b] = ik[b - 1];
                    ik[b - 1] = t;
                }
            for (size_t a = 0; a < nint; a++)
                jv_set(C, r->o, ja_strndup(C->a, ik[a], strlen(ik[a])), strlen(ik[a]),
                        jv_from_json(C, json_object_get(j, ik[a]), depth + 1));
        }
        json_object_foreach((json_t *)j, k, v) {
            if (array_index_key(k)) continue;
            size_t kl = strlen(k);
            jv_set(C, r->o, ja_strndup(C->a, k, kl), kl, jv_from_json(C, v, depth + 1));
        }
        return r;
    }
    }
    return UNDEF;
}
