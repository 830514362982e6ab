/* eval: the tree-walking interpreter. Values, scoping, operators, filters, tests and
 * builtins follow @huggingface/jinja's runtime (see jinja.h for the notable quirks). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#include "jinja_internal.h"

#define ARENA_LIMIT ((size_t)256 << 20)
#define OUTPUT_LIMIT ((size_t)64 << 20)
#define MAX_STEPS 20000000ull
#define MAX_CALL_DEPTH 200

enum vt { V_UNDEF, V_NULL, V_BOOL, V_INT, V_FLOAT, V_STR, V_ARRAY, V_TUPLE, V_OBJECT, V_KWARGS, V_NS, V_FUNC };
static const char *k_vt_names[] = {"UndefinedValue", "NullValue", "BooleanValue", "IntegerValue", "FloatValue", "StringValue",
                                   "ArrayValue", "TupleValue", "ObjectValue", "KeywordArgumentsValue", "NamespaceValue",
                                   "FunctionValue"};

typedef struct val val;
struct arr {
    val **v;
    size_t n, cap;
};
struct obj {
    const char **k;
    size_t *kn;
    val **v;
    size_t n, cap;
};
enum fk { F_NAMESPACE, F_RAISE, F_RANGE, F_STRFTIME, F_MACRO, F_CALLER, F_STRM, F_OBJM };
struct env;
struct fn {
    enum fk kind;
    const char *name; /* method name */
    val *self;
    const struct node *node; /* macro / call block */
    struct env *env;         /* call block: its lexical environment */
};
struct val {
    enum vt t;
    bool b;
    int64_t i;
    double f;
    const char *s;
    size_t n;
    struct arr *a;
    struct obj *o;
    struct fn *fn;
};
struct env {
    struct env *parent;
    struct obj vars;
};
struct ctx {
    struct jarena *a;
    uint64_t steps;
    int depth;
    int ctl; /* 1 break, 2 continue */
    const struct node *ctl_node;
};
struct sb {
    char *s;
    size_t n, cap;
};

static val V_UNDEF_ = {.t = V_UNDEF}, V_NULL_ = {.t = V_NULL}, V_TRUE_ = {.t = V_BOOL, .b = true},
           V_FALSE_ = {.t = V_BOOL, .b = false};
#define UNDEF (&V_UNDEF_)
#define NUL (&V_NULL_)
#define BOOLV(x) ((x) ? &V_TRUE_ : &V_FALSE_)

_Noreturn static void fail(struct ctx *C, const struct node *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(struct ctx *C, const struct node *at, const char *fmt, ...) {
    char msg[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ja_fail(C->a, KV_EINVAL, at ? at->line : 0, at ? at->col : 0, "%s", msg);
}

/* ---- constructors ---- */
static val *mkv(struct ctx *C, enum vt t) {
    val *v = ja_alloc(C->a, sizeof *v);
    v->t = t;
    return v;
}
static val *mk_int(struct ctx *C, int64_t i) {
    val *v = mkv(C, V_INT);
    v->i = i;
    return v;
}
static val *mk_float(struct ctx *C, double f) {
    val *v = mkv(C, V_FLOAT);
    v->f = f;
    return v;
}
static val *mk_str(struct ctx *C, const char *s, size_t n) {
    val *v = mkv(C, V_STR);
    v->s = s;
    v->n = n;
    return v;
}
static val *mk_strdup(struct ctx *C, const char *s, size_t n) { return mk_str(C, ja_strndup(C->a, s, n), n); }
static val *mk_arr(struct ctx *C, enum vt t) {
    val *v = mkv(C, t);
    v->a = ja_alloc(C->a, sizeof *v->a);
    return v;
}
static val *mk_obj(struct ctx *C, enum vt t) {
    val *v = mkv(C, t);
    v->o = ja_alloc(C->a, sizeof *v->o);
    return v;
}
static val *mk_fn(struct ctx *C, enum fk kind, const char *name, val *self) {
    val *v = mkv(C, V_FUNC);
    v->fn = ja_alloc(C->a, sizeof *v->fn);
    v->fn->kind = kind;
    v->fn->name = name;
    v->fn->self = self;
    return v;
}
static void arr_push(struct ctx *C, struct arr *a, val *x) {
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 8;
        val **nv = ja_alloc(C->a, nc * sizeof *nv);
        if (a->n) memcpy(nv, a->v, a->n * sizeof *nv);
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = x;
}
static val *obj_get(const struct obj *o, const char *k, size_t kn) {
    for (size_t i = 0; i < o->n; i++)
        if (o->kn[i] == kn && !memcmp(o->k[i], k, kn)) return o->v[i];
    return NULL;
}
static void obj_set(struct ctx *C, struct obj *o, const char *k, size_t kn, val *x) {
    for (size_t i = 0; i < o->n; i++)
        if (o->kn[i] == kn && !memcmp(o->k[i], k, kn)) {
            o->v[i] = x;
            return;
        }
    if (o->n == o->cap) {
        size_t nc = o->cap ? o->cap * 2 : 8;
        const char **nk = ja_alloc(C->a, nc * sizeof *nk);
        size_t *nkn = ja_alloc(C->a, nc * sizeof *nkn);
        val **nv = ja_alloc(C->a, nc * sizeof *nv);
        if (o->n) {
            memcpy(nk, o->k, o->n * sizeof *nk);
            memcpy(nkn, o->kn, o->n * sizeof *nkn);
            memcpy(nv, o->v, o->n * sizeof *nv);
        }
        o->k = nk;
        o->kn = nkn;
        o->v = nv;
        o->cap = nc;
    }
    o->k[o->n] = k;
    o->kn[o->n] = kn;
    o->v[o->n++] = x;
}
static bool is_arr(const val *v) { return v->t == V_ARRAY || v->t == V_TUPLE; }
static bool is_obj(const val *v) { return v->t == V_OBJECT || v->t == V_KWARGS; }
static bool is_attr_container(const val *v) { return is_obj(v) || v->t == V_NS; }
static bool is_num(const val *v) { return v->t == V_INT || v->t == V_FLOAT; }
static double num(const val *v) { return v->t == V_INT ? (double)v->i : v->t == V_FLOAT ? v->f : v->t == V_BOOL ? v->b : 0; }

/* ---- string builder ---- */
static void sb_put(struct ctx *C, struct sb *b, const char *s, size_t n) {
    if (!n) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 64;
        while (nc < b->n + n + 1) nc *= 2;
        if (nc > OUTPUT_LIMIT) ja_fail(C->a, KV_ETOOLONG, 0, 0, "rendered text exceeds %zu MiB", OUTPUT_LIMIT >> 20);
        char *ns = ja_alloc(C->a, nc);
        if (b->n) memcpy(ns, b->s, b->n);
        b->s = ns;
        b->cap = nc;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
}
static void sb_puts(struct ctx *C, struct sb *b, const char *s) { sb_put(C, b, s, strlen(s)); }
static val *sb_val(struct ctx *C, struct sb *b) { return mk_str(C, b->s ? b->s : "", b->n); }

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
static void to_str(struct ctx *C, struct sb *b, const val *v, const struct node *at) {
    char buf[64];
    switch (v->t) {
    case V_UNDEF:
    case V_NULL: sb_puts(C, b, "undefined"); break; /* only reached inside arrays */
    case V_BOOL: sb_puts(C, b, v->b ? "true" : "false"); break;
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->i); sb_puts(C, b, buf); break;
    case V_FLOAT: float_str(v->f, buf, sizeof buf); sb_puts(C, b, buf); break;
    case V_STR: sb_put(C, b, v->s, v->n); break;
    case V_FUNC: fail(C, at, "cannot convert a function to a string");
    default: to_json(C, b, v, 0, false, false, ", ", ": ", 0, false, at); break;
    }
}

/* JavaScript value.toString() on the raw value (used by ~ and string +) */
static void raw_str(struct ctx *C, struct sb *b, const val *v, const struct node *at) {
    char buf[64];
    switch (v->t) {
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->i); sb_puts(C, b, buf); break;
    case V_FLOAT: js_num(v->f, buf, sizeof buf); sb_puts(C, b, buf); break;
    case V_ARRAY:
    case V_TUPLE:
        for (size_t i = 0; i < v->a->n; i++) {
            if (i) sb_puts(C, b, ",");
            to_str(C, b, v->a->v[i], at);
        }
        break;
    case V_OBJECT:
    case V_KWARGS:
    case V_NS: sb_puts(C, b, "[object Map]"); break;
    default: to_str(C, b, v, at); break;
    }
}

static void json_str(struct ctx *C, struct sb *b, const char *s, size_t n, bool ascii) {
    sb_put(C, b, "\"", 1);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        char buf[16];
        if (c == '"' || c == '\\') {
            buf[0] = '\\';
            buf[1] = (char)c;
            sb_put(C, b, buf, 2);
            i++;
        } else if (c < 0x20) {
            const char *e = c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
            if (e) sb_puts(C, b, e);
            else {
                snprintf(buf, sizeof buf, "\\u%04x", c);
                sb_puts(C, b, buf);
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
            sb_puts(C, b, buf);
            i += l;
        } else {
            sb_put(C, b, s + i, 1);
            i++;
        }
    }
    sb_put(C, b, "\"", 1);
}


static void to_json(struct ctx *C, struct sb *b, const val *v, int indent, bool ascii, bool sort, const char *isep,
                    const char *ksep, int depth, bool undef_null, const struct node *at) {
    char buf[64];
    if (depth > 200) fail(C, at, "value nested too deeply for tojson");
    switch (v->t) {
    case V_NULL: sb_puts(C, b, "null"); return;
    case V_UNDEF: sb_puts(C, b, undef_null ? "null" : "undefined"); return;
    case V_BOOL: sb_puts(C, b, v->b ? "true" : "false"); return;
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->i); sb_puts(C, b, buf); return;
    case V_FLOAT:
        if (!isfinite(v->f)) sb_puts(C, b, "null");
        else {
            js_num(v->f, buf, sizeof buf);
            sb_puts(C, b, buf);
        }
        return;
    case V_STR: json_str(C, b, v->s, v->n, ascii); return;
    case V_FUNC: fail(C, at, "cannot convert to JSON: FunctionValue");
    default: break;
    }
    bool array = is_arr(v);
    size_t n = array ? v->a->n : v->o->n;
    #define PAD(d) do { sb_puts(C, b, "\n"); for (int q_ = 0; q_ < (d) * indent; q_++) sb_put(C, b, " ", 1); } while (0)
    sb_puts(C, b, array ? "[" : "{");
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
        if (i) sb_puts(C, b, isep);
        if (indent) PAD(depth + 1);
        if (array) {
            to_json(C, b, v->a->v[i], indent, ascii, sort, isep, ksep, depth + 1, undef_null, at);
        } else {
            size_t k = order[i];
            json_str(C, b, v->o->k[k], v->o->kn[k], ascii);
            sb_puts(C, b, ksep);
            to_json(C, b, v->o->v[k], indent, ascii, sort, isep, ksep, depth + 1, undef_null, at);
        }
    }
    if (indent && n) PAD(depth);
    sb_puts(C, b, array ? "]" : "}");
    #undef PAD
}

/* ---- truthiness, equality ---- */
static bool truthy(const val *v) {
    switch (v->t) {
    case V_UNDEF:
    case V_NULL: return false;
    case V_BOOL: return v->b;
    case V_INT: return v->i != 0;
    case V_FLOAT: return v->f != 0 && !isnan(v->f);
    case V_STR: return v->n > 0;
    case V_ARRAY:
    case V_TUPLE: return v->a->n > 0;
    case V_OBJECT:
    case V_KWARGS: return v->o->n > 0;
    default: return true;
    }
}

static double js_to_number(const char *s, size_t n) {
    size_t a = 0, k;
    while (a < n && (k = ju_space(s + a, n - a))) a += k;
    size_t e = n;
    while (e > a) {
        size_t st = e - 1;
        while (st > a && ((unsigned char)s[st] & 0xC0) == 0x80) st--;
        if ((k = ju_space(s + st, e - st)) && st + k == e) e = st;
        else break;
    }
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

static bool is_nullish(const val *v) { return v->t == V_UNDEF || v->t == V_NULL; }

/* JavaScript ===  on the underlying values */
static bool strict_eq(const val *x, const val *y) {
    if (is_nullish(x) || is_nullish(y)) return is_nullish(x) && is_nullish(y);
    if (is_num(x) && is_num(y)) return num(x) == num(y);
    if (x->t != y->t && !(is_arr(x) && is_arr(y)) && !(is_obj(x) && is_obj(y))) return false;
    switch (x->t) {
    case V_BOOL: return x->b == y->b;
    case V_STR: return x->n == y->n && !memcmp(x->s, y->s, x->n);
    case V_ARRAY:
    case V_TUPLE: return x->a == y->a;
    case V_FUNC: return x->fn == y->fn;
    default: return x->o == y->o;
    }
}

/* JavaScript == on the underlying values */
static bool loose_eq(const val *x, const val *y) {
    if (is_nullish(x) || is_nullish(y)) return is_nullish(x) && is_nullish(y);
    bool xp = is_num(x) || x->t == V_BOOL, yp = is_num(y) || y->t == V_BOOL;
    if (xp && yp) return num(x) == num(y);
    if (xp && y->t == V_STR) return num(x) == js_to_number(y->s, y->n);
    if (yp && x->t == V_STR) return num(y) == js_to_number(x->s, x->n);
    return strict_eq(x, y);
}

/* ---- environments ---- */
static val *env_lookup(struct env *e, const char *k, size_t n) {
    for (; e; e = e->parent) {
        val *v = obj_get(&e->vars, k, n);
        if (v) return v;
    }
    return UNDEF;
}
static struct env *env_new(struct ctx *C, struct env *parent) {
    struct env *e = ja_alloc(C->a, sizeof *e);
    e->parent = parent;
    return e;
}

/* ---- unicode helpers on values ---- */
static size_t utf16_len(const char *s, size_t n) {
    size_t len = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += ju_decode(s + i, n - i, &cp);
        len += cp >= 0x10000 ? 2 : 1;
    }
    return len;
}
/* code point boundaries: offsets of each code point start, plus n at the end */
static size_t *cp_offsets(struct ctx *C, const char *s, size_t n, size_t *count) {
    size_t *off = ja_alloc(C->a, (n + 1) * sizeof *off);
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        off[k++] = i;
        i += ju_decode(s + i, n - i, &cp);
    }
    off[k] = n;
    *count = k;
    return off;
}
static val *case_map(struct ctx *C, const val *v, bool upper) {
    struct sb b = {0};
    for (size_t i = 0; i < v->n;) {
        uint32_t cp;
        size_t l = ju_decode(v->s + i, v->n - i, &cp);
        char enc[4];
        if (l == 1 && (unsigned char)v->s[i] >= 0x80) {
            sb_put(C, &b, v->s + i, 1);
        } else {
            uint32_t m = (uint32_t)(upper ? utf8proc_toupper((utf8proc_int32_t)cp) : utf8proc_tolower((utf8proc_int32_t)cp));
            sb_put(C, &b, enc, ju_encode(m, enc));
        }
        i += l;
    }
    return sb_val(C, &b);
}
static val *js_trim(struct ctx *C, const val *v, bool left, bool right) {
    size_t a = 0, e = v->n, k;
    if (left)
        while (a < e && (k = ju_space(v->s + a, e - a))) a += k;
    if (right)
        while (e > a) {
            size_t st = e - 1;
            while (st > a && ((unsigned char)v->s[st] & 0xC0) == 0x80) st--;
            if ((k = ju_space(v->s + st, e - st)) && st + k == e) e = st;
            else break;
        }
    return mk_str(C, v->s + a, e - a);
}
static bool is_ascii_word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
static const char *mem_find(const char *s, size_t n, const char *p, size_t pn) {
    if (pn == 0) return s;
    if (pn > n) return NULL;
    return memmem(s, n, p, pn);
}

/* ---- forward decls ---- */
static val *eval(struct ctx *C, const struct node *x, struct env *e);
static val *eval_block(struct ctx *C, struct node *const *body, size_t n, struct env *e);
static val *call_fn(struct ctx *C, val *fn, val **args, size_t nargs, struct env *e, const struct node *at);

/* python-style slice on n items -> indices */
static size_t slice_idx(struct ctx *C, size_t len, const val *vs, const val *ve, const val *vst, size_t **out) {
    int64_t L = (int64_t)len;
    int64_t step = vst->t == V_INT ? vst->i : 1;
    int64_t start, stop;
    int dir = step > 0 ? 1 : step < 0 ? -1 : 0;
    if (dir >= 0) {
        start = vs->t == V_INT ? vs->i : 0;
        start = start < 0 ? (L + start > 0 ? L + start : 0) : (start < L ? start : L);
        stop = ve->t == V_INT ? ve->i : L;
        stop = stop < 0 ? (L + stop > 0 ? L + stop : 0) : (stop < L ? stop : L);
    } else {
        start = vs->t == V_INT ? vs->i : L - 1;
        start = start < 0 ? (L + start > -1 ? L + start : -1) : (start < L - 1 ? start : L - 1);
        stop = ve->t == V_INT ? ve->i : -1;
        stop = stop < -1 ? (L + stop > -1 ? L + stop : -1) : (stop < L - 1 ? stop : L - 1);
    }
    if (step == 0) fail(C, NULL, "slice step cannot be zero");
    size_t cnt = 0;
    size_t *idx = ja_alloc(C->a, (len + 1) * sizeof *idx);
    for (int64_t i = start; dir * i < dir * stop; i += step) idx[cnt++] = (size_t)i;
    *out = idx;
    return cnt;
}

/* ---- string methods ---- */
static val *kwarg(val **args, size_t *nargs, const char *name) {
    if (*nargs && args[*nargs - 1]->t == V_KWARGS) {
        val *v = obj_get(args[*nargs - 1]->o, name, strlen(name));
        return v;
    }
    return NULL;
}
static size_t npos(val **args, size_t nargs) { return nargs && args[nargs - 1]->t == V_KWARGS ? nargs - 1 : nargs; }

static val *str_replace(struct ctx *C, const val *s, const val *old, const val *nw, const val *count, const struct node *at) {
    if (count->t != V_INT && !is_nullish(count)) fail(C, at, "replace() count argument must be a number or null");
    if (count->t == V_INT && count->i == 0) return (val *)s;
    int64_t remaining = count->t != V_INT || count->i < 0 ? INT64_MAX : count->i;
    struct sb b = {0};
    if (old->n == 0) {
        size_t nc;
        size_t *off = cp_offsets(C, s->s, s->n, &nc);
        for (size_t i = 0; i <= nc; i++) {
            if (remaining > 0) {
                sb_put(C, &b, nw->s, nw->n);
                remaining--;
            }
            if (i < nc) sb_put(C, &b, s->s + off[i], off[i + 1] - off[i]);
        }
        return sb_val(C, &b);
    }
    size_t i = 0;
    while (i < s->n) {
        const char *p = remaining > 0 ? mem_find(s->s + i, s->n - i, old->s, old->n) : NULL;
        if (!p) break;
        size_t at2 = (size_t)(p - s->s);
        sb_put(C, &b, s->s + i, at2 - i);
        sb_put(C, &b, nw->s, nw->n);
        remaining--;
        i = at2 + old->n;
    }
    sb_put(C, &b, s->s + i, s->n - i);
    return sb_val(C, &b);
}

static val *str_method(struct ctx *C, val *self, const char *name, val **args, size_t nargs, const struct node *at) {
    if (!strcmp(name, "upper")) return case_map(C, self, true);
    if (!strcmp(name, "lower")) return case_map(C, self, false);
    if (!strcmp(name, "strip")) return js_trim(C, self, true, true);
    if (!strcmp(name, "lstrip")) return js_trim(C, self, true, false);
    if (!strcmp(name, "rstrip")) return js_trim(C, self, false, true);
    if (!strcmp(name, "title")) {
        char *s = ja_strndup(C->a, self->s, self->n);
        for (size_t i = 0; i < self->n; i++)
            if (is_ascii_word(s[i]) && (i == 0 || !is_ascii_word(self->s[i - 1])) && s[i] >= 'a' && s[i] <= 'z') s[i] -= 32;
        return mk_str(C, s, self->n);
    }
    if (!strcmp(name, "capitalize")) {
        if (!self->n) return self;
        uint32_t cp;
        size_t l = ju_decode(self->s, self->n, &cp);
        val first = {.t = V_STR, .s = self->s, .n = l};
        val *u = case_map(C, &first, true);
        struct sb b = {0};
        sb_put(C, &b, u->s, u->n);
        sb_put(C, &b, self->s + l, self->n - l);
        return sb_val(C, &b);
    }
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        bool sw = name[0] == 's';
        if (nargs == 0) fail(C, at, "%s() requires at least one argument", name);
        val *p = args[0];
        val **cands = &p;
        size_t nc = 1;
        if (is_arr(p)) {
            cands = p->a->v;
            nc = p->a->n;
        } else if (p->t != V_STR) {
            fail(C, at, "%s() argument must be a string or tuple of strings", name);
        }
        for (size_t i = 0; i < nc; i++) {
            if (cands[i]->t != V_STR) fail(C, at, "%s() tuple elements must be strings", name);
            const val *q = cands[i];
            if (q->n <= self->n && !memcmp(sw ? self->s : self->s + self->n - q->n, q->s, q->n)) return BOOLV(true);
        }
        return BOOLV(false);
    }
    if (!strcmp(name, "split")) {
        val *sep = nargs > 0 ? args[0] : NUL;
        if (sep->t != V_STR && !is_nullish(sep)) fail(C, at, "sep argument must be a string or null");
        val *maxs = nargs > 1 ? args[1] : NULL;
        if (maxs && maxs->t != V_INT) fail(C, at, "maxsplit argument must be a number");
        int64_t ms = maxs ? maxs->i : -1;
        val *r = mk_arr(C, V_ARRAY);
        if (sep->t != V_STR) {
            val *t = js_trim(C, self, true, false);
            size_t i = 0, k;
            while (i < t->n) {
                size_t st = i;
                while (i < t->n && !ju_space(t->s + i, t->n - i)) i++;
                if (ms != -1 && (int64_t)r->a->n >= ms) {
                    arr_push(C, r->a, mk_str(C, t->s + st, t->n - st));
                    break;
                }
                arr_push(C, r->a, mk_str(C, t->s + st, i - st));
                while (i < t->n && (k = ju_space(t->s + i, t->n - i))) i += k;
            }
            return r;
        }
        if (sep->n == 0) fail(C, at, "empty separator");
        size_t i = 0;
        for (;;) {
            const char *p = mem_find(self->s + i, self->n - i, sep->s, sep->n);
            if (!p) break;
            size_t pos = (size_t)(p - self->s);
            arr_push(C, r->a, mk_str(C, self->s + i, pos - i));
            i = pos + sep->n;
        }
        arr_push(C, r->a, mk_str(C, self->s + i, self->n - i));
        if (ms != -1 && (int64_t)r->a->n > ms) {
            /* rejoin the tail: it is the text after the ms-th separator */
            size_t off = 0;
            for (int64_t q = 0; q < ms; q++) off += r->a->v[q]->n + sep->n;
            r->a->v[ms] = mk_str(C, self->s + off, self->n - off);
            r->a->n = (size_t)ms + 1;
        }
        return r;
    }
    if (!strcmp(name, "replace")) {
        if (nargs < 2) fail(C, at, "replace() requires at least two arguments");
        if (args[0]->t != V_STR || args[1]->t != V_STR) fail(C, at, "replace() arguments must be strings");
        val *count = NUL;
        if (nargs > 2) {
            if (args[2]->t == V_KWARGS) {
                val *c = obj_get(args[2]->o, "count", 5);
                count = c ? c : NUL;
            } else {
                count = args[2];
            }
        }
        return str_replace(C, self, args[0], args[1], count, at);
    }
    fail(C, at, "unknown string method %s", name);
}

static val *obj_items(struct ctx *C, const val *o, int which) {
    val *r = mk_arr(C, V_ARRAY);
    for (size_t i = 0; i < o->o->n; i++) {
        val *k = mk_str(C, o->o->k[i], o->o->kn[i]);
        if (which == 1) arr_push(C, r->a, k);
        else if (which == 2) arr_push(C, r->a, o->o->v[i]);
        else {
            val *p = mk_arr(C, V_ARRAY);
            arr_push(C, p->a, k);
            arr_push(C, p->a, o->o->v[i]);
            arr_push(C, r->a, p);
        }
    }
    return r;
}

static int compare(struct ctx *C, const val *x, const val *y, bool case_sensitive, const struct node *at) {
    if (x->t == V_NULL && y->t == V_NULL) return 0;
    if (x->t == V_NULL || y->t == V_NULL) fail(C, at, "cannot compare %s with %s", k_vt_names[x->t], k_vt_names[y->t]);
    if (x->t == V_UNDEF && y->t == V_UNDEF) return 0;
    if (x->t == V_UNDEF || y->t == V_UNDEF) fail(C, at, "cannot compare %s with %s", k_vt_names[x->t], k_vt_names[y->t]);
    bool xn = is_num(x) || x->t == V_BOOL, yn = is_num(y) || y->t == V_BOOL;
    if (xn && yn) return num(x) < num(y) ? -1 : num(x) > num(y) ? 1 : 0;
    if (x->t != y->t) fail(C, at, "cannot compare different types: %s and %s", k_vt_names[x->t], k_vt_names[y->t]);
    if (x->t != V_STR) fail(C, at, "cannot compare type: %s", k_vt_names[x->t]);
    const val *a = x, *b = y;
    if (!case_sensitive) {
        a = case_map(C, x, false);
        b = case_map(C, y, false);
    }
    /* UTF-16 code unit order equals code point order except for astral vs U+E000..U+FFFF;
     * byte order is code point order */
    size_t ml = a->n < b->n ? a->n : b->n;
    int c = memcmp(a->s, b->s, ml);
    if (c) return c < 0 ? -1 : 1;
    return a->n < b->n ? -1 : a->n > b->n ? 1 : 0;
}

static void sort_vals(struct ctx *C, val **v, size_t n, const val *const *keys, bool cs, bool rev, const struct node *at) {
    /* stable insertion sort with an index array (template lists are small) */
    size_t *ord = ja_alloc(C->a, (n + 1) * sizeof *ord);
    for (size_t i = 0; i < n; i++) ord[i] = i;
    for (size_t i = 1; i < n; i++) {
        size_t x = ord[i], j = i;
        while (j > 0) {
            int c = compare(C, keys[x], keys[ord[j - 1]], cs, at);
            if (rev) c = -c;
            if (c >= 0) break;
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = x;
    }
    val **tmp = ja_alloc(C->a, (n + 1) * sizeof *tmp);
    for (size_t i = 0; i < n; i++) tmp[i] = v[ord[i]];
    memcpy(v, tmp, n * sizeof *v);
}

static val *obj_method(struct ctx *C, val *self, const char *name, val **args, size_t nargs, const struct node *at) {
    if (!strcmp(name, "get")) {
        val *key = nargs > 0 ? args[0] : UNDEF;
        if (key->t != V_STR) fail(C, at, "object key must be a string: got %s", k_vt_names[key->t]);
        val *v = obj_get(self->o, key->s, key->n);
        if (v) return v;
        return nargs > 1 ? args[1] : NUL;
    }
    if (!strcmp(name, "items")) return obj_items(C, self, 0);
    if (!strcmp(name, "keys")) return obj_items(C, self, 1);
    if (!strcmp(name, "values")) return obj_items(C, self, 2);
    if (!strcmp(name, "dictsort")) {
        size_t np = npos(args, nargs);
        val *cs = np > 0 ? args[0] : kwarg(args, &nargs, "case_sensitive");
        if (!cs) cs = BOOLV(false);
        if (cs->t != V_BOOL) fail(C, at, "case_sensitive must be a boolean");
        val *by = np > 1 ? args[1] : kwarg(args, &nargs, "by");
        if (!by) by = mk_str(C, "key", 3);
        if (by->t != V_STR) fail(C, at, "by must be a string");
        bool byval;
        if (by->n == 3 && !memcmp(by->s, "key", 3)) byval = false;
        else if (by->n == 5 && !memcmp(by->s, "value", 5)) byval = true;
        else fail(C, at, "by must be either 'key' or 'value'");
        val *rev = np > 2 ? args[2] : kwarg(args, &nargs, "reverse");
        if (!rev) rev = BOOLV(false);
        if (rev->t != V_BOOL) fail(C, at, "reverse must be a boolean");
        val *items = obj_items(C, self, 0);
        const val **keys = ja_alloc(C->a, (items->a->n + 1) * sizeof *keys);
        for (size_t i = 0; i < items->a->n; i++) keys[i] = items->a->v[i]->a->v[byval ? 1 : 0];
        sort_vals(C, items->a->v, items->a->n, keys, cs->b, rev->b, at);
        return items;
    }
    fail(C, at, "unknown object method %s", name);
}

static bool is_str_method(const char *s, size_t n) {
    static const char *names[] = {"upper", "lower", "strip", "title", "capitalize", "rstrip", "lstrip",
                                  "startswith", "endswith", "split", "replace"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && !memcmp(names[i], s, n)) return true;
    return false;
}
static const char *obj_method_name(const char *s, size_t n) {
    static const char *names[] = {"get", "items", "keys", "values", "dictsort"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && !memcmp(names[i], s, n)) return names[i];
    return NULL;
}

/* ---- member access ---- */
static val *str_at(struct ctx *C, const val *s, int64_t idx) {
    int64_t len = (int64_t)utf16_len(s->s, s->n);
    if (idx < 0) idx += len;
    if (idx < 0 || idx >= len) return UNDEF;
    int64_t u = 0;
    for (size_t i = 0; i < s->n;) {
        uint32_t cp;
        size_t l = ju_decode(s->s + i, s->n - i, &cp);
        int w = cp >= 0x10000 ? 2 : 1;
        if (idx < u + w) {
            if (w == 2) return mk_str(C, "\xEF\xBF\xBD", 3); /* half of a surrogate pair */
            return mk_str(C, s->s + i, l);
        }
        u += w;
        i += l;
    }
    return UNDEF;
}

static val *member(struct ctx *C, val *o, val *prop, const struct node *at) {
    val *r = NULL;
    if (is_attr_container(o)) {
        if (prop->t != V_STR) fail(C, at, "cannot access property with non-string: got %s", k_vt_names[prop->t]);
        r = obj_get(o->o, prop->s, prop->n);
        if (!r && is_obj(o)) {
            const char *m = obj_method_name(prop->s, prop->n);
            if (m) r = mk_fn(C, F_OBJM, m, o);
        }
    } else if (is_arr(o) || o->t == V_STR) {
        if (prop->t == V_INT) {
            if (o->t == V_STR) r = str_at(C, o, prop->i);
            else {
                int64_t i = prop->i < 0 ? prop->i + (int64_t)o->a->n : prop->i;
                r = i >= 0 && i < (int64_t)o->a->n ? o->a->v[i] : NULL;
            }
        } else if (prop->t == V_STR) {
            if (prop->n == 6 && !memcmp(prop->s, "length", 6))
                r = mk_int(C, (int64_t)(o->t == V_STR ? utf16_len(o->s, o->n) : o->a->n));
            else if (o->t == V_STR && is_str_method(prop->s, prop->n))
                r = mk_fn(C, F_STRM, ja_strndup(C->a, prop->s, prop->n), o);
        } else {
            fail(C, at, "cannot access property with non-string/non-number: got %s", k_vt_names[prop->t]);
        }
    } else {
        if (prop->t != V_STR) fail(C, at, "cannot access property with non-string: got %s", k_vt_names[prop->t]);
        fail(C, at, "cannot read property '%.*s' of %s", (int)(prop->n > 60 ? 60 : prop->n), prop->s,
             o->t == V_UNDEF ? "an undefined value" : k_vt_names[o->t]);
    }
    return r ? r : UNDEF;
}

/* ---- tests ---- */
static bool run_test(struct ctx *C, const char *name, size_t n, val *v, const struct node *at) {
#define T(s) (n == strlen(s) && !memcmp(name, s, n))
    if (T("boolean")) return v->t == V_BOOL;
    if (T("callable")) return v->t == V_FUNC;
    if (T("odd") || T("even")) {
        if (v->t != V_INT) fail(C, at, "cannot %s on %s", T("odd") ? "odd" : "even", k_vt_names[v->t]);
        return (v->i % 2 != 0) == T("odd");
    }
    if (T("false")) return v->t == V_BOOL && !v->b;
    if (T("true")) return v->t == V_BOOL && v->b;
    if (T("none")) return v->t == V_NULL;
    if (T("string")) return v->t == V_STR;
    if (T("number")) return is_num(v);
    if (T("integer")) return v->t == V_INT;
    if (T("iterable")) return v->t == V_ARRAY || v->t == V_STR;
    if (T("mapping")) return is_obj(v);
    if (T("sequence")) return is_arr(v) || is_obj(v) || v->t == V_STR;
    if (T("lower") || T("upper")) {
        if (v->t != V_STR) return false;
        val *m = case_map(C, v, T("upper"));
        return m->n == v->n && !memcmp(m->s, v->s, v->n);
    }
    if (T("defined")) return v->t != V_UNDEF;
    if (T("undefined")) return v->t == V_UNDEF;
    if (T("equalto") || T("eq")) fail(C, at, "test '%.*s' needs an argument, which this engine does not support", (int)n, name);
    fail(C, at, "unknown test: %.*s", (int)(n > 60 ? 60 : n), name);
#undef T
}

/* ---- argument evaluation ---- */
struct args {
    val **pos;
    size_t npos;
    val *kw; /* V_KWARGS or NULL when none */
};
static void eval_args(struct ctx *C, struct node *const *l, size_t n, struct env *e, struct args *out) {
    struct arr pos = {0};
    val *kw = NULL;
    for (size_t i = 0; i < n; i++) {
        const struct node *x = l[i];
        if (x->kind == N_SPREAD) {
            val *v = eval(C, x->a, e);
            if (!is_arr(v)) fail(C, x, "cannot unpack non-iterable type: %s", k_vt_names[v->t]);
            for (size_t k = 0; k < v->a->n; k++) arr_push(C, &pos, v->a->v[k]);
        } else if (x->kind != N_KWARG && x->kind != N_KWSPREAD) {
            arr_push(C, &pos, eval(C, x, e));
        }
    }
    for (size_t i = 0; i < n; i++) {
        const struct node *x = l[i];
        if (x->kind == N_KWARG) {
            if (!kw) kw = mk_obj(C, V_KWARGS);
            if (obj_get(kw->o, x->s, x->n)) fail(C, x, "got multiple values for keyword argument '%.*s'", (int)x->n, x->s);
            obj_set(C, kw->o, x->s, x->n, eval(C, x->a, e));
        } else if (x->kind == N_KWSPREAD) {
            val *v = eval(C, x->a, e);
            if (!is_obj(v)) fail(C, x, "argument after ** must be a mapping, not %s", k_vt_names[v->t]);
            if (!kw) kw = mk_obj(C, V_KWARGS);
            for (size_t k = 0; k < v->o->n; k++) {
                if (obj_get(kw->o, v->o->k[k], v->o->kn[k])) fail(C, x, "got multiple values for a keyword argument");
                obj_set(C, kw->o, v->o->k[k], v->o->kn[k], v->o->v[k]);
            }
        }
    }
    out->pos = pos.v;
    out->npos = pos.n;
    out->kw = kw;
}
static val *akw(const struct args *a, const char *name) { return a->kw ? obj_get(a->kw->o, name, strlen(name)) : NULL; }
static val *apos(const struct args *a, size_t i) { return i < a->npos ? a->pos[i] : NULL; }

/* ---- filters ---- */
static bool name_is(const struct node *x, const char *s) { return x->n == strlen(s) && !memcmp(x->s, s, x->n); }

static val *attr_path(struct ctx *C, val *item, const char *path, size_t n) {
    val *v = item;
    size_t i = 0;
    for (;;) {
        size_t j = i;
        while (j < n && path[j] != '.') j++;
        if (is_attr_container(v)) {
            v = obj_get(v->o, path + i, j - i);
            if (!v) v = UNDEF;
        } else if (is_arr(v)) {
            char buf[32];
            size_t l = j - i < 31 ? j - i : 31;
            memcpy(buf, path + i, l);
            buf[l] = 0;
            char *end;
            long idx = strtol(buf, &end, 10);
            if (end == buf || idx < 0 || (size_t)idx >= v->a->n) return UNDEF;
            v = v->a->v[idx];
        } else {
            return UNDEF;
        }
        if (j >= n) break;
        i = j + 1;
    }
    (void)C;
    return v;
}

static val *to_json_val(struct ctx *C, val *v, int indent, bool ascii, bool sort, const char *is, const char *ks,
                        const struct node *at) {
    struct sb b = {0};
    to_json(C, &b, v, indent, ascii, sort, is, ks, 0, true, at);
    return sb_val(C, &b);
}

static int64_t js_parse_int(const char *s, size_t n, bool *ok) {
    /* parseInt(s, 10): leading whitespace, sign, digits */
    size_t i = 0, k;
    while (i < n && (k = ju_space(s + i, n - i))) i += k;
    bool neg = false;
    if (i < n && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
    int64_t v = 0;
    size_t st = i;
    while (i < n && s[i] >= '0' && s[i] <= '9' && v < INT64_MAX / 10 - 10) v = v * 10 + (s[i++] - '0');
    *ok = i > st;
    return neg ? -v : v;
}
static double js_parse_float(const char *s, size_t n, bool *ok) {
    size_t i = 0, k;
    while (i < n && (k = ju_space(s + i, n - i))) i += k;
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

static val *apply_filter(struct ctx *C, val *v, const struct node *f, struct env *e) {
    if (f->kind == N_IDENT) {
        if (name_is(f, "safe")) return v;
        if (name_is(f, "tojson")) return to_json_val(C, v, 0, false, false, ", ", ": ", f);
        if (is_arr(v)) {
            if (name_is(f, "list")) return v;
            if (name_is(f, "first")) return v->a->n ? v->a->v[0] : UNDEF;
            if (name_is(f, "last")) return v->a->n ? v->a->v[v->a->n - 1] : UNDEF;
            if (name_is(f, "length")) return mk_int(C, (int64_t)v->a->n);
            if (name_is(f, "reverse")) {
                val *r = mk_arr(C, V_ARRAY);
                for (size_t i = v->a->n; i-- > 0;) arr_push(C, r->a, v->a->v[i]);
                return r;
            }
            if (name_is(f, "sort")) {
                val *r = mk_arr(C, V_ARRAY);
                for (size_t i = 0; i < v->a->n; i++) arr_push(C, r->a, v->a->v[i]);
                sort_vals(C, r->a->v, r->a->n, (const val *const *)r->a->v, false, false, f);
                return r;
            }
            if (name_is(f, "join")) {
                struct sb b = {0};
                for (size_t i = 0; i < v->a->n; i++) raw_str(C, &b, v->a->v[i], f);
                return sb_val(C, &b);
            }
            if (name_is(f, "string")) {
                struct sb b = {0};
                to_json(C, &b, v, 0, false, false, ", ", ": ", 0, false, f);
                return sb_val(C, &b);
            }
            if (name_is(f, "unique")) {
                val *r = mk_arr(C, V_ARRAY);
                for (size_t i = 0; i < v->a->n; i++) {
                    bool seen = false;
                    for (size_t k = 0; k < r->a->n && !seen; k++) seen = strict_eq(r->a->v[k], v->a->v[i]);
                    if (!seen) arr_push(C, r->a, v->a->v[i]);
                }
                return r;
            }
            fail(C, f, "unknown filter '%.*s' for an array", (int)f->n, f->s);
        }
        if (v->t == V_STR) {
            if (name_is(f, "length")) return mk_int(C, (int64_t)utf16_len(v->s, v->n));
            if (name_is(f, "upper") || name_is(f, "lower") || name_is(f, "title") || name_is(f, "capitalize"))
                return str_method(C, v, ja_strndup(C->a, f->s, f->n), NULL, 0, f);
            if (name_is(f, "trim")) return js_trim(C, v, true, true);
            if (name_is(f, "indent")) {
                struct sb b = {0};
                size_t i = 0;
                bool first = true;
                for (;;) {
                    const char *nl = memchr(v->s + i, '\n', v->n - i);
                    size_t end = nl ? (size_t)(nl - v->s) : v->n;
                    if (!first) sb_puts(C, &b, "\n");
                    if (!first && end > i) sb_puts(C, &b, "    ");
                    sb_put(C, &b, v->s + i, end - i);
                    first = false;
                    if (!nl) break;
                    i = end + 1;
                }
                return sb_val(C, &b);
            }
            if (name_is(f, "join") || name_is(f, "string")) return v;
            if (name_is(f, "int")) {
                bool ok;
                int64_t x = js_parse_int(v->s, v->n, &ok);
                return mk_int(C, ok ? x : 0);
            }
            if (name_is(f, "float")) {
                bool ok;
                double x = js_parse_float(v->s, v->n, &ok);
                return mk_float(C, ok ? x : 0);
            }
            fail(C, f, "unknown filter '%.*s' for a string", (int)f->n, f->s);
        }
        if (is_num(v)) {
            if (name_is(f, "abs")) return v->t == V_INT ? mk_int(C, v->i < 0 ? -v->i : v->i) : mk_float(C, fabs(v->f));
            if (name_is(f, "int")) return mk_int(C, v->t == V_INT ? v->i : (int64_t)floor(v->f));
            if (name_is(f, "float")) return mk_float(C, num(v));
            if (name_is(f, "string")) {
                struct sb b = {0};
                to_str(C, &b, v, f);
                return sb_val(C, &b);
            }
            fail(C, f, "unknown filter '%.*s' for a number", (int)f->n, f->s);
        }
        if (is_obj(v)) {
            if (name_is(f, "items")) return obj_items(C, v, 0);
            if (name_is(f, "length")) return mk_int(C, (int64_t)v->o->n);
            const char *m = obj_method_name(f->s, f->n);
            if (m) return obj_method(C, v, m, NULL, 0, f);
            fail(C, f, "unknown filter '%.*s' for an object", (int)f->n, f->s);
        }
        if (v->t == V_BOOL) {
            if (name_is(f, "bool")) return v;
            if (name_is(f, "int")) return mk_int(C, v->b);
            if (name_is(f, "float")) return mk_float(C, v->b);
            if (name_is(f, "string")) return mk_str(C, v->b ? "true" : "false", v->b ? 4 : 5);
            fail(C, f, "unknown filter '%.*s' for a boolean", (int)f->n, f->s);
        }
        fail(C, f, "cannot apply filter '%.*s' to %s", (int)f->n, f->s, k_vt_names[v->t]);
    }
    if (f->kind != N_CALL || f->a->kind != N_IDENT) fail(C, f, "unsupported filter expression");
    const struct node *fn = f->a;
    struct args A;
    if (name_is(fn, "tojson")) {
        eval_args(C, f->l1, f->n1, e, &A);
        val *ind = akw(&A, "indent");
        if (ind && ind->t != V_INT && !is_nullish(ind)) fail(C, f, "if set, indent must be a number");
        val *asc = akw(&A, "ensure_ascii");
        if (asc && asc->t != V_BOOL) fail(C, f, "if set, ensure_ascii must be a boolean");
        val *sk = akw(&A, "sort_keys");
        if (sk && sk->t != V_BOOL) fail(C, f, "if set, sort_keys must be a boolean");
        val *sep = akw(&A, "separators");
        const char *is = NULL, *ks = NULL;
        if (sep && is_arr(sep)) {
            if (sep->a->n != 2 || sep->a->v[0]->t != V_STR || sep->a->v[1]->t != V_STR)
                fail(C, f, "separators must be a tuple of two strings");
            is = ja_strndup(C->a, sep->a->v[0]->s, sep->a->v[0]->n);
            ks = ja_strndup(C->a, sep->a->v[1]->s, sep->a->v[1]->n);
        } else if (sep && !is_nullish(sep)) {
            fail(C, f, "if set, separators must be a tuple of two strings");
        }
        int indent = ind && ind->t == V_INT ? (int)(ind->i > 64 ? 64 : ind->i < 0 ? 0 : ind->i) : 0;
        if (!is) {
            is = indent ? "," : ", ";
            ks = ": ";
        }
        return to_json_val(C, v, indent, asc && asc->b, sk && sk->b, is, ks, f);
    }
    if (name_is(fn, "join")) {
        if (v->t != V_STR && !is_arr(v)) fail(C, f, "cannot apply filter 'join' to %s", k_vt_names[v->t]);
        eval_args(C, f->l1, f->n1, e, &A);
        val *sep = apos(&A, 0);
        if (!sep) sep = akw(&A, "separator");
        if (!sep) sep = mk_str(C, "", 0);
        if (sep->t != V_STR) fail(C, f, "separator must be a string");
        struct sb b = {0};
        if (v->t == V_STR) {
            size_t nc;
            size_t *off = cp_offsets(C, v->s, v->n, &nc);
            for (size_t i = 0; i < nc; i++) {
                if (i) sb_put(C, &b, sep->s, sep->n);
                sb_put(C, &b, v->s + off[i], off[i + 1] - off[i]);
            }
        } else {
            for (size_t i = 0; i < v->a->n; i++) {
                if (i) sb_put(C, &b, sep->s, sep->n);
                if (!is_nullish(v->a->v[i])) raw_str(C, &b, v->a->v[i], f);
            }
        }
        return sb_val(C, &b);
    }
    if (name_is(fn, "int") || name_is(fn, "float")) {
        bool is_int = name_is(fn, "int");
        eval_args(C, f->l1, f->n1, e, &A);
        val *def = apos(&A, 0);
        if (!def) def = akw(&A, "default");
        if (!def) def = is_int ? mk_int(C, 0) : mk_float(C, 0);
        if (v->t == V_STR) {
            bool ok;
            if (is_int) {
                int64_t x = js_parse_int(v->s, v->n, &ok);
                return ok ? mk_int(C, x) : def;
            }
            double x = js_parse_float(v->s, v->n, &ok);
            return ok ? mk_float(C, x) : def;
        }
        if (is_num(v)) return v;
        if (v->t == V_BOOL) return is_int ? mk_int(C, v->b) : mk_float(C, v->b);
        fail(C, f, "cannot apply filter '%s' to %s", is_int ? "int" : "float", k_vt_names[v->t]);
    }
    if (name_is(fn, "default")) {
        eval_args(C, f->l1, f->n1, e, &A);
        val *def = apos(&A, 0);
        if (!def) def = mk_str(C, "", 0);
        val *bo = apos(&A, 1);
        if (!bo) bo = akw(&A, "boolean");
        if (!bo) bo = BOOLV(false);
        if (bo->t != V_BOOL) fail(C, f, "`default` filter flag must be a boolean");
        if (v->t == V_UNDEF || (bo->b && !truthy(v))) return def;
        return v;
    }
    if (is_arr(v)) {
        if (name_is(fn, "sort")) {
            eval_args(C, f->l1, f->n1, e, &A);
            val *rev = apos(&A, 0);
            if (!rev) rev = akw(&A, "reverse");
            if (!rev) rev = BOOLV(false);
            if (rev->t != V_BOOL) fail(C, f, "reverse must be a boolean");
            val *cs = apos(&A, 1);
            if (!cs) cs = akw(&A, "case_sensitive");
            if (!cs) cs = BOOLV(false);
            if (cs->t != V_BOOL) fail(C, f, "case_sensitive must be a boolean");
            val *attr = apos(&A, 2);
            if (!attr) attr = akw(&A, "attribute");
            if (!attr) attr = NUL;
            if (attr->t != V_STR && attr->t != V_INT && !is_nullish(attr)) fail(C, f, "attribute must be a string, integer, or null");
            val *r = mk_arr(C, V_ARRAY);
            const val **keys = ja_alloc(C->a, (v->a->n + 1) * sizeof *keys);
            for (size_t i = 0; i < v->a->n; i++) {
                arr_push(C, r->a, v->a->v[i]);
                if (is_nullish(attr)) keys[i] = v->a->v[i];
                else if (attr->t == V_STR) keys[i] = attr_path(C, v->a->v[i], attr->s, attr->n);
                else {
                    char buf[32];
                    snprintf(buf, sizeof buf, "%lld", (long long)attr->i);
                    keys[i] = attr_path(C, v->a->v[i], buf, strlen(buf));
                }
            }
            /* sort r by keys: sort indices through a parallel copy */
            size_t n = r->a->n;
            val **items = r->a->v;
            size_t *ord = ja_alloc(C->a, (n + 1) * sizeof *ord);
            for (size_t i = 0; i < n; i++) ord[i] = i;
            for (size_t i = 1; i < n; i++) {
                size_t x = ord[i], j = i;
                while (j > 0) {
                    int c = compare(C, keys[x], keys[ord[j - 1]], cs->b, f);
                    if (rev->b) c = -c;
                    if (c >= 0) break;
                    ord[j] = ord[j - 1];
                    j--;
                }
                ord[j] = x;
            }
            val *out = mk_arr(C, V_ARRAY);
            for (size_t i = 0; i < n; i++) arr_push(C, out->a, items[ord[i]]);
            return out;
        }
        if (name_is(fn, "selectattr") || name_is(fn, "rejectattr")) {
            bool sel = name_is(fn, "selectattr");
            for (size_t i = 0; i < v->a->n; i++)
                if (!is_attr_container(v->a->v[i])) fail(C, f, "`%.*s` can only be applied to array of objects", (int)fn->n, fn->s);
            for (size_t i = 0; i < f->n1; i++)
                if (f->l1[i]->kind != N_STR) fail(C, f, "arguments of `%.*s` must be strings", (int)fn->n, fn->s);
            if (f->n1 < 1) fail(C, f, "`%.*s` needs an attribute name", (int)fn->n, fn->s);
            const struct node *attr = f->l1[0], *test = f->n1 > 1 ? f->l1[1] : NULL;
            if (test && f->n1 > 2) {
                /* equalto/eq with a value: a.value === value.value */
                if (!(name_is(test, "equalto") || name_is(test, "eq")))
                    (void)run_test(C, test->s, test->n, UNDEF, f); /* unknown test: error */
            }
            val *r = mk_arr(C, V_ARRAY);
            for (size_t i = 0; i < v->a->n; i++) {
                val *a = obj_get(v->a->v[i]->o, attr->s, attr->n);
                bool res = false;
                if (a) {
                    if (!test) res = truthy(a);
                    else if (name_is(test, "equalto") || name_is(test, "eq")) {
                        val *cmp = f->n1 > 2 ? mk_str(C, f->l1[2]->s, f->l1[2]->n) : UNDEF;
                        res = strict_eq(a, cmp);
                    } else res = run_test(C, test->s, test->n, a, f);
                }
                if (res == sel) arr_push(C, r->a, v->a->v[i]);
            }
            return r;
        }
        if (name_is(fn, "map")) {
            eval_args(C, f->l1, f->n1, e, &A);
            val *attr = akw(&A, "attribute");
            if (!attr) fail(C, f, "`map` expressions without `attribute` set are not supported");
            if (attr->t != V_STR) fail(C, f, "attribute must be a string");
            val *def = akw(&A, "default");
            val *r = mk_arr(C, V_ARRAY);
            for (size_t i = 0; i < v->a->n; i++) {
                if (!is_attr_container(v->a->v[i])) fail(C, f, "items in map must be an object");
                val *x = attr_path(C, v->a->v[i], attr->s, attr->n);
                arr_push(C, r->a, x->t == V_UNDEF && def ? def : x);
            }
            return r;
        }
        fail(C, f, "unknown filter '%.*s' for an array", (int)fn->n, fn->s);
    }
    if (v->t == V_STR) {
        if (name_is(fn, "indent")) {
            eval_args(C, f->l1, f->n1, e, &A);
            val *w = apos(&A, 0);
            if (!w) w = akw(&A, "width");
            if (!w) w = mk_int(C, 4);
            if (w->t != V_INT) fail(C, f, "width must be a number");
            val *first = apos(&A, 1);
            if (!first) first = akw(&A, "first");
            val *blank = apos(&A, 2);
            if (!blank) blank = akw(&A, "blank");
            bool bf = first && truthy(first), bb = blank && truthy(blank);
            int64_t width = w->i < 0 ? 0 : w->i > 1024 ? 1024 : w->i;
            struct sb b = {0};
            size_t i = 0;
            for (size_t line = 0;; line++) {
                const char *nl = memchr(v->s + i, '\n', v->n - i);
                size_t end = nl ? (size_t)(nl - v->s) : v->n;
                if (line) sb_puts(C, &b, "\n");
                if (!((!bf && line == 0) || (!bb && end == i)))
                    for (int64_t q = 0; q < width; q++) sb_put(C, &b, " ", 1);
                sb_put(C, &b, v->s + i, end - i);
                if (!nl) break;
                i = end + 1;
            }
            return sb_val(C, &b);
        }
        if (name_is(fn, "replace")) {
            eval_args(C, f->l1, f->n1, e, &A);
            val **args = ja_alloc(C->a, (A.npos + 2) * sizeof *args);
            for (size_t i = 0; i < A.npos; i++) args[i] = A.pos[i];
            args[A.npos] = A.kw ? A.kw : mk_obj(C, V_KWARGS);
            return str_method(C, v, "replace", args, A.npos + 1, f);
        }
        fail(C, f, "unknown filter '%.*s' for a string", (int)fn->n, fn->s);
    }
    if (is_obj(v)) {
        const char *m = obj_method_name(fn->s, fn->n);
        if (m) {
            eval_args(C, f->l1, f->n1, e, &A);
            val **args = ja_alloc(C->a, (A.npos + 2) * sizeof *args);
            for (size_t i = 0; i < A.npos; i++) args[i] = A.pos[i];
            size_t n = A.npos;
            if (A.kw) args[n++] = A.kw;
            return obj_method(C, v, m, args, n, f);
        }
        fail(C, f, "unknown filter '%.*s' for an object", (int)fn->n, fn->s);
    }
    fail(C, f, "cannot apply filter '%.*s' to %s", (int)fn->n, fn->s, k_vt_names[v->t]);
}

/* ---- operators ---- */
static val *binary(struct ctx *C, const struct node *x, struct env *e) {
    val *l = eval(C, x->a, e);
    if (x->op == OP_AND) return truthy(l) ? eval(C, x->b, e) : l;
    if (x->op == OP_OR) return truthy(l) ? l : eval(C, x->b, e);
    val *r = eval(C, x->b, e);
    if (x->op == OP_EQ) return BOOLV(loose_eq(l, r));
    if (x->op == OP_NE) return BOOLV(!loose_eq(l, r));
    if (l->t == V_UNDEF || r->t == V_UNDEF) {
        if (r->t == V_UNDEF && (x->op == OP_IN || x->op == OP_NOTIN)) return BOOLV(x->op == OP_NOTIN);
        fail(C, x, "cannot perform this operation on undefined values");
    }
    if (l->t == V_NULL || r->t == V_NULL) fail(C, x, "cannot perform operation on null values");
    if (x->op == OP_CONCAT) {
        struct sb b = {0};
        raw_str(C, &b, l, x);
        raw_str(C, &b, r, x);
        return sb_val(C, &b);
    }
    bool ln = is_num(l) || l->t == V_BOOL, rn = is_num(r) || r->t == V_BOOL;
    if (x->op == OP_POW && ln && rn) {
        double a = num(l), b = num(r);
        if (a == 0 && b < 0) fail(C, x, "0.0 cannot be raised to a negative power");
        double res = pow(a, b);
        if (!isfinite(res)) fail(C, x, "exponentiation result is not a finite real number");
        if (l->t == V_FLOAT || r->t == V_FLOAT || b < 0) return mk_float(C, res);
        if (fabs(res) > 9.2e18) fail(C, x, "integer result out of range");
        return mk_int(C, (int64_t)res);
    }
    if (is_num(l) && is_num(r)) {
        bool fl = l->t == V_FLOAT || r->t == V_FLOAT;
        switch (x->op) {
        case OP_ADD:
        case OP_SUB:
        case OP_MUL:
            if (!fl) {
                int64_t res;
                bool ov = x->op == OP_ADD ? __builtin_add_overflow(l->i, r->i, &res)
                          : x->op == OP_SUB ? __builtin_sub_overflow(l->i, r->i, &res)
                                            : __builtin_mul_overflow(l->i, r->i, &res);
                if (ov) fail(C, x, "integer overflow");
                return mk_int(C, res);
            } else {
                double a = num(l), b = num(r);
                return mk_float(C, x->op == OP_ADD ? a + b : x->op == OP_SUB ? a - b : a * b);
            }
        case OP_DIV: return mk_float(C, num(l) / num(r));
        case OP_FLOORDIV: {
            double res = floor(num(l) / num(r));
            if (fl) return mk_float(C, res);
            if (!isfinite(res)) fail(C, x, "integer division by zero");
            return mk_int(C, (int64_t)res);
        }
        case OP_MOD:
            if (fl) return mk_float(C, fmod(num(l), num(r)));
            if (r->i == 0) fail(C, x, "integer modulo by zero");
            if (r->i == -1) return mk_int(C, 0);
            return mk_int(C, l->i % r->i);
        case OP_LT: return BOOLV(num(l) < num(r));
        case OP_GT: return BOOLV(num(l) > num(r));
        case OP_LE: return BOOLV(num(l) <= num(r));
        case OP_GE: return BOOLV(num(l) >= num(r));
        default: break;
        }
    } else if (is_arr(l) && is_arr(r)) {
        if (x->op == OP_ADD) {
            val *res = mk_arr(C, V_ARRAY);
            for (size_t i = 0; i < l->a->n; i++) arr_push(C, res->a, l->a->v[i]);
            for (size_t i = 0; i < r->a->n; i++) arr_push(C, res->a, r->a->v[i]);
            return res;
        }
    } else if (is_arr(r)) {
        bool member = false;
        for (size_t i = 0; i < r->a->n && !member; i++) member = strict_eq(r->a->v[i], l);
        if (x->op == OP_IN) return BOOLV(member);
        if (x->op == OP_NOTIN) return BOOLV(!member);
    }
    if ((l->t == V_STR || r->t == V_STR) && x->op == OP_ADD) {
        struct sb b = {0};
        raw_str(C, &b, l, x);
        raw_str(C, &b, r, x);
        return sb_val(C, &b);
    }
    if (l->t == V_STR && r->t == V_STR && (x->op == OP_IN || x->op == OP_NOTIN)) {
        bool in = mem_find(r->s, r->n, l->s, l->n) != NULL;
        return BOOLV(x->op == OP_IN ? in : !in);
    }
    if (l->t == V_STR && is_obj(r) && (x->op == OP_IN || x->op == OP_NOTIN)) {
        bool in = obj_get(r->o, l->s, l->n) != NULL;
        return BOOLV(x->op == OP_IN ? in : !in);
    }
    static const char *opn[] = {"and", "or", "not", "==", "!=", "<", ">", "<=", ">=", "in", "not in", "+", "-", "~",
                                "*", "/", "//", "%", "**"};
    fail(C, x, "unsupported operator \"%s\" between %s and %s", opn[x->op], k_vt_names[l->t], k_vt_names[r->t]);
}

/* ---- statements ---- */
static void set_target(struct ctx *C, const struct node *t, val *v, struct env *e, const struct node *at) {
    if (t->kind == N_IDENT) {
        obj_set(C, &e->vars, t->s, t->n, v);
    } else if (t->kind == N_TUPLE) {
        if (!is_arr(v)) fail(C, at, "cannot unpack non-iterable type: %s", k_vt_names[v->t]);
        if (v->a->n != t->n1) fail(C, at, "too %s items to unpack", t->n1 > v->a->n ? "few" : "many");
        for (size_t i = 0; i < t->n1; i++) {
            if (t->l1[i]->kind != N_IDENT) fail(C, at, "cannot unpack to a non-identifier");
        }
        for (size_t i = 0; i < t->n1; i++) obj_set(C, &e->vars, t->l1[i]->s, t->l1[i]->n, v->a->v[i]);
    } else {
        fail(C, at, "invalid assignment target");
    }
}

static val *eval_set(struct ctx *C, const struct node *x, struct env *e) {
    val *rhs = x->b ? eval(C, x->b, e) : eval_block(C, x->l1, x->n1, e);
    const struct node *t = x->a;
    if (t->kind == N_MEMBER) {
        val *o = eval(C, t->a, e);
        if (o->t != V_NS) fail(C, x, "cannot assign attribute on non-namespace object");
        if (t->flag || t->b->kind != N_IDENT) fail(C, x, "cannot assign to member with non-identifier property");
        obj_set(C, o->o, t->b->s, t->b->n, rhs);
    } else {
        set_target(C, t, rhs, e, x);
    }
    return NUL;
}

static val *eval_for(struct ctx *C, const struct node *x, struct env *e) {
    struct env *scope = env_new(C, e);
    const struct node *it = x->b, *test = NULL;
    if (it->kind == N_SELECT) {
        test = it->b;
        it = it->a;
    }
    val *iter = eval(C, it, scope);
    if (!is_arr(iter) && !is_obj(iter))
        fail(C, x->b, "expected iterable or object type in for loop: got %s", k_vt_names[iter->t]);
    if (is_obj(iter)) iter = obj_items(C, iter, 1);
    struct arr items = {0};
    for (size_t i = 0; i < iter->a->n; i++) {
        val *cur = iter->a->v[i];
        if (x->a->kind == N_TUPLE) {
            if (!is_arr(cur)) fail(C, x->a, "cannot unpack non-iterable type: %s", k_vt_names[cur->t]);
            if (cur->a->n != x->a->n1) fail(C, x->a, "too %s items to unpack", x->a->n1 > cur->a->n ? "few" : "many");
        }
        if (test) {
            struct env *ls = env_new(C, scope);
            set_target(C, x->a, cur, ls, x);
            if (!truthy(eval(C, test, ls))) continue;
        }
        arr_push(C, &items, cur);
    }
    struct sb out = {0};
    bool none = true;
    for (size_t i = 0; i < items.n; i++) {
        val *loop = mk_obj(C, V_OBJECT);
        obj_set(C, loop->o, "index", 5, mk_int(C, (int64_t)i + 1));
        obj_set(C, loop->o, "index0", 6, mk_int(C, (int64_t)i));
        obj_set(C, loop->o, "revindex", 8, mk_int(C, (int64_t)(items.n - i)));
        obj_set(C, loop->o, "revindex0", 9, mk_int(C, (int64_t)(items.n - i - 1)));
        obj_set(C, loop->o, "first", 5, BOOLV(i == 0));
        obj_set(C, loop->o, "last", 4, BOOLV(i == items.n - 1));
        obj_set(C, loop->o, "length", 6, mk_int(C, (int64_t)items.n));
        obj_set(C, loop->o, "previtem", 8, i > 0 ? items.v[i - 1] : UNDEF);
        obj_set(C, loop->o, "nextitem", 8, i + 1 < items.n ? items.v[i + 1] : UNDEF);
        obj_set(C, &scope->vars, "loop", 4, loop);
        set_target(C, x->a, items.v[i], scope, x);
        val *body = eval_block(C, x->l1, x->n1, scope);
        if (C->ctl) {
            int ctl = C->ctl;
            C->ctl = 0;
            if (ctl == 2) continue;
            break;
        }
        sb_put(C, &out, body->s, body->n);
        none = false;
    }
    if (none && x->n2) {
        val *d = eval_block(C, x->l2, x->n2, scope);
        if (!C->ctl) sb_put(C, &out, d->s, d->n);
    }
    return sb_val(C, &out);
}

static bool uses_name(const struct node *x, const char *name, int depth) {
    if (!x || depth > 300) return false;
    if (x->kind == N_IDENT && x->n == strlen(name) && !memcmp(x->s, name, x->n)) return true;
    if (uses_name(x->a, name, depth + 1) || uses_name(x->b, name, depth + 1) || uses_name(x->c, name, depth + 1)) return true;
    for (size_t i = 0; i < x->n1; i++)
        if (uses_name(x->l1[i], name, depth + 1)) return true;
    for (size_t i = 0; i < x->n2; i++)
        if (uses_name(x->l2[i], name, depth + 1)) return true;
    return false;
}
static bool body_uses(const struct node *m, const char *name) {
    for (size_t i = 0; i < m->n1; i++)
        if (uses_name(m->l1[i], name, 0)) return true;
    return false;
}

/* params: identifiers or N_KWARG (name = default) */
static void bind_args(struct ctx *C, const char *disp, struct node *const *params, size_t np, const struct node *body_owner,
                      val **args, size_t nargs, struct env *scope, const struct node *at) {
    val *kw = NULL;
    if (nargs && args[nargs - 1]->t == V_KWARGS) {
        val *src = args[--nargs];
        kw = mk_obj(C, V_OBJECT);
        for (size_t i = 0; i < src->o->n; i++) obj_set(C, kw->o, src->o->k[i], src->o->kn[i], src->o->v[i]);
    }
    bool *pending = ja_alloc(C->a, (np + 1) * sizeof *pending);
    for (size_t i = 0; i < np; i++) {
        const struct node *p = params[i];
        val *v = i < nargs ? args[i] : NULL;
        if (!v && kw) {
            for (size_t k = 0; k < kw->o->n; k++)
                if (kw->o->kn[k] == p->n && !memcmp(kw->o->k[k], p->s, p->n)) {
                    v = kw->o->v[k];
                    /* delete key k */
                    memmove(&kw->o->k[k], &kw->o->k[k + 1], (kw->o->n - k - 1) * sizeof *kw->o->k);
                    memmove(&kw->o->kn[k], &kw->o->kn[k + 1], (kw->o->n - k - 1) * sizeof *kw->o->kn);
                    memmove(&kw->o->v[k], &kw->o->v[k + 1], (kw->o->n - k - 1) * sizeof *kw->o->v);
                    kw->o->n--;
                    break;
                }
        }
        if (!v && p->kind == N_KWARG) pending[i] = true;
        obj_set(C, &scope->vars, p->s, p->n, v ? v : UNDEF);
    }
    if (body_owner && body_uses(body_owner, "kwargs")) obj_set(C, &scope->vars, "kwargs", 6, kw ? kw : mk_obj(C, V_OBJECT));
    else if (kw && kw->o->n) fail(C, at, "macro %s takes no keyword argument '%.*s'", disp, (int)kw->o->kn[0], kw->o->k[0]);
    if (body_owner && body_uses(body_owner, "varargs")) {
        val *va = mk_arr(C, V_ARRAY);
        for (size_t i = np; i < nargs; i++) arr_push(C, va->a, args[i]);
        obj_set(C, &scope->vars, "varargs", 7, va);
    } else if (nargs > np) {
        fail(C, at, "macro %s takes not more than %zu argument(s)", disp, np);
    }
    for (size_t i = 0; i < np; i++)
        if (pending[i]) obj_set(C, &scope->vars, params[i]->s, params[i]->n, eval(C, params[i]->a, scope));
}

static val *builtin_range(struct ctx *C, val **args, size_t nargs, const struct node *at) {
    for (size_t i = 0; i < nargs; i++)
        if (!is_num(args[i])) fail(C, at, "range() arguments must be numbers");
    double start = 0, stop, step = 1;
    if (nargs == 0) fail(C, at, "range() needs at least one argument");
    if (nargs == 1) stop = num(args[0]);
    else {
        start = num(args[0]);
        stop = num(args[1]);
        if (nargs > 2) step = num(args[2]);
    }
    if (step == 0) fail(C, at, "range() step must not be zero");
    val *r = mk_arr(C, V_ARRAY);
    for (double i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (++C->steps > MAX_STEPS) ja_fail(C->a, KV_ETOOLONG, at->line, at->col, "template exceeds the evaluation step limit");
        arr_push(C, r->a, i == floor(i) && fabs(i) < 9e15 ? mk_int(C, (int64_t)i) : mk_float(C, i));
    }
    return r;
}

static val *builtin_strftime(struct ctx *C, val **args, size_t nargs, const struct node *at) {
    if (nargs < 1 || args[0]->t != V_STR) fail(C, at, "strftime_now() needs a format string");
    static const char *mon_s[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    static const char *mon_l[] = {"January", "February", "March", "April", "May", "June", "July", "August",
                                  "September", "October", "November", "December"};
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    const val *f = args[0];
    struct sb b = {0};
    char buf[32];
    for (size_t i = 0; i < f->n; i++) {
        if (f->s[i] == '%' && i + 1 < f->n && strchr("YmdbBHM%", f->s[i + 1]) && f->s[i + 1]) {
            char c = f->s[++i];
            switch (c) {
            case 'Y': snprintf(buf, sizeof buf, "%d", tm.tm_year + 1900); break;
            case 'm': snprintf(buf, sizeof buf, "%02d", tm.tm_mon + 1); break;
            case 'd': snprintf(buf, sizeof buf, "%02d", tm.tm_mday); break;
            case 'b': snprintf(buf, sizeof buf, "%s", mon_s[tm.tm_mon]); break;
            case 'B': snprintf(buf, sizeof buf, "%s", mon_l[tm.tm_mon]); break;
            case 'H': snprintf(buf, sizeof buf, "%02d", tm.tm_hour); break;
            case 'M': snprintf(buf, sizeof buf, "%02d", tm.tm_min); break;
            default: snprintf(buf, sizeof buf, "%%"); break;
            }
            sb_puts(C, &b, buf);
        } else {
            sb_put(C, &b, f->s + i, 1);
        }
    }
    return sb_val(C, &b);
}

static val *call_fn(struct ctx *C, val *fnv, val **args, size_t nargs, struct env *e, const struct node *at) {
    if (fnv->t != V_FUNC) fail(C, at, "cannot call something that is not a function: got %s", k_vt_names[fnv->t]);
    struct fn *fn = fnv->fn;
    switch (fn->kind) {
    case F_STRM: return str_method(C, fn->self, fn->name, args, nargs, at);
    case F_OBJM: return obj_method(C, fn->self, fn->name, args, nargs, at);
    case F_RANGE: return builtin_range(C, args, nargs, at);
    case F_STRFTIME: return builtin_strftime(C, args, nargs, at);
    case F_RAISE: {
        struct sb b = {0};
        for (size_t i = 0; i < nargs; i++) {
            if (i) sb_puts(C, &b, ",");
            if (!is_nullish(args[i])) raw_str(C, &b, args[i], at);
        }
        fail(C, at, "raise_exception: %.*s", (int)(b.n > 250 ? 250 : b.n), b.s ? b.s : "");
    }
    case F_NAMESPACE: {
        size_t np = npos(args, nargs);
        if (np > 1) fail(C, at, "namespace expected at most 1 argument, got %zu", np);
        val *ns = mk_obj(C, V_NS);
        if (np == 1) {
            val *src = args[0];
            if (is_obj(src)) {
                for (size_t i = 0; i < src->o->n; i++) obj_set(C, ns->o, src->o->k[i], src->o->kn[i], src->o->v[i]);
            } else if (is_arr(src)) {
                for (size_t i = 0; i < src->a->n; i++) {
                    val *p = src->a->v[i];
                    if (!is_arr(p) || p->a->n != 2 || p->a->v[0]->t != V_STR)
                        fail(C, at, "namespace expected an object or an iterable of [key, value] pairs");
                    obj_set(C, ns->o, p->a->v[0]->s, p->a->v[0]->n, p->a->v[1]);
                }
            } else {
                fail(C, at, "'%s' object is not iterable", k_vt_names[src->t]);
            }
        }
        if (np < nargs)
            for (size_t i = 0; i < args[nargs - 1]->o->n; i++)
                obj_set(C, ns->o, args[nargs - 1]->o->k[i], args[nargs - 1]->o->kn[i], args[nargs - 1]->o->v[i]);
        return ns;
    }
    case F_MACRO:
    case F_CALLER: {
        if (++C->depth > MAX_CALL_DEPTH) fail(C, at, "macro recursion too deep");
        const struct node *m = fn->node;
        struct env *scope;
        val *r;
        if (fn->kind == F_MACRO) {
            char disp[80];
            snprintf(disp, sizeof disp, "'%.*s'", (int)(m->a->n > 60 ? 60 : m->a->n), m->a->s);
            scope = env_new(C, e); /* the caller's environment, as in the reference engine */
            bind_args(C, disp, m->l2, m->n2, m, args, nargs, scope, at);
        } else {
            scope = env_new(C, fn->env);
            bind_args(C, "None", m->l2, m->n2, m, args, nargs, scope, at);
        }
        r = eval_block(C, m->l1, m->n1, scope);
        C->depth--;
        return r;
    }
    }
    fail(C, at, "bad function");
}

static val *eval_call(struct ctx *C, const struct node *x, struct env *e) {
    struct args A;
    eval_args(C, x->l1, x->n1, e, &A);
    val **args = ja_alloc(C->a, (A.npos + 2) * sizeof *args);
    for (size_t i = 0; i < A.npos; i++) args[i] = A.pos[i];
    size_t n = A.npos;
    if (A.kw) args[n++] = A.kw;
    val *fn = eval(C, x->a, e);
    return call_fn(C, fn, args, n, e, x);
}

static val *eval_member(struct ctx *C, const struct node *x, struct env *e) {
    val *o = eval(C, x->a, e);
    val *prop;
    if (x->flag) {
        if (x->b->kind == N_SLICE) {
            const struct node *s = x->b;
            if (!is_arr(o) && o->t != V_STR) fail(C, x, "slice object must be an array or string");
            val *vs = s->a ? eval(C, s->a, e) : UNDEF, *ve = s->b ? eval(C, s->b, e) : UNDEF,
                *vst = s->c ? eval(C, s->c, e) : UNDEF;
            if ((vs->t != V_INT && vs->t != V_UNDEF) || (ve->t != V_INT && ve->t != V_UNDEF) ||
                (vst->t != V_INT && vst->t != V_UNDEF))
                fail(C, x, "slice indices must be integers or undefined");
            size_t *idx;
            if (is_arr(o)) {
                size_t cnt = slice_idx(C, o->a->n, vs, ve, vst, &idx);
                val *r = mk_arr(C, V_ARRAY);
                for (size_t i = 0; i < cnt; i++) arr_push(C, r->a, o->a->v[idx[i]]);
                return r;
            }
            size_t nc;
            size_t *off = cp_offsets(C, o->s, o->n, &nc);
            size_t cnt = slice_idx(C, nc, vs, ve, vst, &idx);
            struct sb b = {0};
            for (size_t i = 0; i < cnt; i++) sb_put(C, &b, o->s + off[idx[i]], off[idx[i] + 1] - off[idx[i]]);
            return sb_val(C, &b);
        }
        prop = eval(C, x->b, e);
    } else if (x->b->kind == N_INT) {
        prop = mk_int(C, x->b->i);
    } else {
        prop = mk_str(C, x->b->s, x->b->n);
    }
    return member(C, o, prop, x);
}

static val *eval(struct ctx *C, const struct node *x, struct env *e) {
    if (!x) return UNDEF;
    if (++C->steps > MAX_STEPS) ja_fail(C->a, KV_ETOOLONG, x->line, x->col, "template exceeds the evaluation step limit");
    switch (x->kind) {
    case N_TEXT:
    case N_STR: return mk_str(C, x->s, x->n);
    case N_COMMENT: return NUL;
    case N_INT: return mk_int(C, x->i);
    case N_FLOAT: return mk_float(C, x->f);
    case N_SET: return eval_set(C, x, e);
    case N_IF: {
        bool c = truthy(eval(C, x->a, e));
        return eval_block(C, c ? x->l1 : x->l2, c ? x->n1 : x->n2, e);
    }
    case N_FOR: return eval_for(C, x, e);
    case N_MACRO: {
        val *f = mk_fn(C, F_MACRO, NULL, NULL);
        f->fn->node = x;
        obj_set(C, &e->vars, x->a->s, x->a->n, f);
        return NUL;
    }
    case N_CALLBLOCK: {
        val *caller = mk_fn(C, F_CALLER, NULL, NULL);
        caller->fn->node = x;
        caller->fn->env = e;
        const struct node *call = x->a;
        struct args A;
        eval_args(C, call->l1, call->n1, e, &A);
        val **args = ja_alloc(C->a, (A.npos + 2) * sizeof *args);
        for (size_t i = 0; i < A.npos; i++) args[i] = A.pos[i];
        args[A.npos] = A.kw ? A.kw : mk_obj(C, V_KWARGS);
        val *fn = eval(C, call->a, e);
        struct env *ne = env_new(C, e);
        obj_set(C, &ne->vars, "caller", 6, caller);
        return call_fn(C, fn, args, A.npos + 1, ne, x);
    }
    case N_FILTERBLOCK: return apply_filter(C, eval_block(C, x->l1, x->n1, e), x->a, e);
    case N_BREAK:
    case N_CONTINUE:
        C->ctl = x->kind == N_BREAK ? 1 : 2;
        C->ctl_node = x;
        return NUL;
    case N_ARRAY:
    case N_TUPLE: {
        val *r = mk_arr(C, x->kind == N_ARRAY ? V_ARRAY : V_TUPLE);
        for (size_t i = 0; i < x->n1; i++) arr_push(C, r->a, eval(C, x->l1[i], e));
        return r;
    }
    case N_OBJECT: {
        val *r = mk_obj(C, V_OBJECT);
        for (size_t i = 0; i < x->n1; i++) {
            val *k = eval(C, x->l1[i], e);
            if (k->t != V_STR) fail(C, x->l1[i], "object keys must be strings: got %s", k_vt_names[k->t]);
            obj_set(C, r->o, k->s, k->n, eval(C, x->l2[i], e));
        }
        return r;
    }
    case N_IDENT: return env_lookup(e, x->s, x->n);
    case N_CALL: return eval_call(C, x, e);
    case N_MEMBER: return eval_member(C, x, e);
    case N_UNARY: {
        val *v = eval(C, x->a, e);
        if (x->op == OP_NOT) return BOOLV(!truthy(v));
        if (!is_num(v) && v->t != V_BOOL) fail(C, x, "unary %c needs a number, got %s", x->op == OP_SUB ? '-' : '+', k_vt_names[v->t]);
        if (v->t == V_FLOAT) return mk_float(C, x->op == OP_SUB ? -v->f : v->f);
        int64_t i = v->t == V_BOOL ? v->b : v->i;
        return mk_int(C, x->op == OP_SUB ? -i : i);
    }
    case N_BINARY: return binary(C, x, e);
    case N_FILTER: return apply_filter(C, eval(C, x->a, e), x->b, e);
    case N_TEST: {
        val *v = eval(C, x->a, e);
        bool r = run_test(C, x->b->s, x->b->n, v, x);
        return BOOLV(x->flag ? !r : r);
    }
    case N_SELECT: return truthy(eval(C, x->b, e)) ? eval(C, x->a, e) : UNDEF;
    case N_TERNARY: return truthy(eval(C, x->a, e)) ? eval(C, x->b, e) : eval(C, x->c, e);
    case N_SLICE:
    case N_KWARG:
    case N_SPREAD:
    case N_KWSPREAD: fail(C, x, "unexpected expression here");
    }
    fail(C, x, "unknown node");
}

static val *eval_block(struct ctx *C, struct node *const *body, size_t n, struct env *e) {
    struct sb b = {0};
    for (size_t i = 0; i < n; i++) {
        const struct node *x = body[i];
        if (x->kind == N_TEXT) {
            sb_put(C, &b, x->s, x->n);
            continue;
        }
        val *v = eval(C, x, e);
        if (C->ctl) return mk_str(C, "", 0);
        if (!is_nullish(v)) to_str(C, &b, v, x);
    }
    return sb_val(C, &b);
}

/* ---- JSON context -> values ---- */
static bool array_index_key(const char *k) {
    if (!*k || (k[0] == '0' && k[1])) return false;
    size_t n = 0;
    for (const char *p = k; *p; p++, n++)
        if (*p < '0' || *p > '9') return false;
    return n < 10 || (n == 10 && strcmp(k, "4294967295") < 0);
}
static val *from_json(struct ctx *C, const json_t *j, int depth) {
    if (depth > 200) ja_fail(C->a, KV_EINVAL, 0, 0, "context JSON nested too deeply");
    switch (json_typeof(j)) {
    case JSON_NULL: return NUL;
    case JSON_TRUE: return BOOLV(true);
    case JSON_FALSE: return BOOLV(false);
    case JSON_INTEGER: return mk_int(C, json_integer_value(j));
    case JSON_REAL: {
        double d = json_real_value(j);
        if (d == floor(d) && fabs(d) < 9e15) return mk_int(C, (int64_t)d);
        return mk_float(C, d);
    }
    case JSON_STRING: return mk_strdup(C, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        val *r = mk_arr(C, V_ARRAY);
        for (size_t i = 0; i < json_array_size(j); i++) arr_push(C, r->a, from_json(C, json_array_get(j, i), depth + 1));
        return r;
    }
    case JSON_OBJECT: {
        val *r = mk_obj(C, V_OBJECT);
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
                obj_set(C, r->o, ja_strndup(C->a, ik[a], strlen(ik[a])), strlen(ik[a]),
                        from_json(C, json_object_get(j, ik[a]), depth + 1));
        }
        json_object_foreach((json_t *)j, k, v) {
            if (array_index_key(k)) continue;
            size_t kl = strlen(k);
            obj_set(C, r->o, ja_strndup(C->a, k, kl), kl, from_json(C, v, depth + 1));
        }
        return r;
    }
    }
    return UNDEF;
}

kv_status jinja_render(const jinja_template_t *t, const json_t *ctxj, char **out, size_t *out_len, char *err,
                       size_t errlen) {
    if (!t || !out) return kv_errf(KV_EINVAL, err, errlen, "jinja: NULL argument");
    if (ctxj && !json_is_object(ctxj)) return kv_errf(KV_EINVAL, err, errlen, "jinja: the render context must be a JSON object");
    jmp_buf jb;
    struct jarena arena = {.limit = ARENA_LIMIT, .jb = &jb, .err = err, .errlen = errlen};
    struct ctx C = {.a = &arena};
    if (setjmp(jb)) {
        kv_status st = arena.st;
        ja_free(&arena);
        return st;
    }
    struct env *g = env_new(&C, NULL);
    obj_set(&C, &g->vars, "namespace", 9, mk_fn(&C, F_NAMESPACE, NULL, NULL));
    obj_set(&C, &g->vars, "false", 5, BOOLV(false));
    obj_set(&C, &g->vars, "true", 4, BOOLV(true));
    obj_set(&C, &g->vars, "none", 4, NUL);
    obj_set(&C, &g->vars, "raise_exception", 15, mk_fn(&C, F_RAISE, NULL, NULL));
    obj_set(&C, &g->vars, "range", 5, mk_fn(&C, F_RANGE, NULL, NULL));
    obj_set(&C, &g->vars, "strftime_now", 12, mk_fn(&C, F_STRFTIME, NULL, NULL));
    obj_set(&C, &g->vars, "True", 4, BOOLV(true));
    obj_set(&C, &g->vars, "False", 5, BOOLV(false));
    obj_set(&C, &g->vars, "None", 4, NUL);
    if (ctxj) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)ctxj, k, v) {
            size_t kl = strlen(k);
            if (obj_get(&g->vars, k, kl)) ja_fail(&arena, KV_EINVAL, 0, 0, "variable already declared: %s", k);
            obj_set(&C, &g->vars, ja_strndup(&arena, k, kl), kl, from_json(&C, v, 0));
        }
    }
    val *r = eval_block(&C, t->body, t->n, g);
    if (C.ctl)
        ja_fail(&arena, KV_EINVAL, C.ctl_node->line, C.ctl_node->col, "{%% %s %%} outside of a loop",
                C.ctl == 1 ? "break" : "continue");
    char *s = malloc(r->n + 1);
    if (!s) ja_fail(&arena, KV_ENOMEM, 0, 0, "out of memory");
    memcpy(s, r->s, r->n);
    s[r->n] = 0;
    *out = s;
    if (out_len) *out_len = r->n;
    ja_free(&arena);
    return KV_OK;
}

kv_status jinja_parse(const char *src, size_t len, jinja_template_t **out, char *err, size_t errlen) {
    if (!src || !out) return kv_errf(KV_EINVAL, err, errlen, "jinja: NULL argument");
    jinja_template_t *t = calloc(1, sizeof *t);
    if (!t) return kv_errf(KV_ENOMEM, err, errlen, "jinja: out of memory");
    jmp_buf jb;
    t->arena.limit = ARENA_LIMIT;
    t->arena.jb = &jb;
    t->arena.err = err;
    t->arena.errlen = errlen;
    if (setjmp(jb)) {
        kv_status st = t->arena.st;
        ja_free(&t->arena);
        free(t);
        return st;
    }
    struct token *toks;
    size_t n;
    jinja_lex(&t->arena, src, len, &toks, &n);
    jinja_parse_tokens(&t->arena, toks, n, &t->body, &t->n);
    t->arena.jb = NULL;
    t->arena.err = NULL;
    *out = t;
    return KV_OK;
}

void jinja_free(jinja_template_t *t) {
    if (!t) return;
    ja_free(&t->arena);
    free(t);
}
