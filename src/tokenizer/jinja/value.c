/* value: the arena and error unwinding, text helpers (JavaScript whitespace, UTF-8), and the
 * runtime values: constructors, containers, the string builder, truthiness, equality and order. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "jinja_internal.h"

void *ja_alloc(struct jarena *a, size_t n) {
    kv_status why = KV_OK;
    void *p = kv_arena_alloc(&a->mem, n, &why);
    if (!p && why == KV_ETOOLONG) ja_fail(a, KV_ETOOLONG, 0, 0, "template uses more than %zu MiB of memory", a->mem.limit >> 20);
    if (!p) ja_fail(a, KV_ENOMEM, 0, 0, "out of memory");
    return p;
}

char *ja_strndup(struct jarena *a, const char *s, size_t n) {
    char *p = ja_alloc(a, n + 1);
    if (n) memcpy(p, s, n);
    return p;
}

void ja_free(struct jarena *a) { kv_arena_free(&a->mem); }

void ja_fail(struct jarena *a, kv_status st, int line, int col, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line > 0) kv_errf(st, a->err, a->errlen, "jinja: line %d, column %d: %s", line, col, msg);
    else kv_errf(st, a->err, a->errlen, "jinja: %s", msg);
    a->st = st;
    longjmp(*a->jb, 1);
}

size_t ju_decode(const char *s, size_t n, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    int len = kv_utf8_seq_len(u[0]);
    if (len <= 1 || (size_t)len > n || !kv_utf8_valid(s, (size_t)len)) {
        *cp = u[0];
        return 1;
    }
    uint32_t c = len == 2 ? u[0] & 0x1F : len == 3 ? u[0] & 0x0F : u[0] & 0x07;
    for (int i = 1; i < len; i++) c = (c << 6) | (u[i] & 0x3F);
    *cp = c;
    return (size_t)len;
}

size_t ju_encode(uint32_t cp, char *p) {
    if (cp < 0x80) {
        p[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        p[0] = (char)(0xC0 | (cp >> 6));
        p[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        p[0] = (char)(0xE0 | (cp >> 12));
        p[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        p[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    p[0] = (char)(0xF0 | (cp >> 18));
    p[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    p[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    p[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t ju_space(const char *s, size_t n) {
    if (!n) return 0;
    unsigned char c = (unsigned char)s[0];
    if (c < 0x80) return (c == ' ' || (c >= 0x09 && c <= 0x0D)) ? 1 : 0;
    uint32_t cp;
    size_t l = ju_decode(s, n, &cp);
    if (l == 1) return 0;
    if (cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
        cp == 0x202F || cp == 0x205F || cp == 0x3000 || cp == 0xFEFF)
        return l;
    return 0;
}

void ju_trim(const char *s, size_t n, bool left, bool right, size_t *start, size_t *end) {
    size_t a = 0, e = n, k;
    if (left)
        while (a < e && (k = ju_space(s + a, e - a))) a += k;
    if (right)
        while (e > a) {
            size_t st = e - 1;
            while (st > a && ((unsigned char)s[st] & 0xC0) == 0x80) st--;
            if ((k = ju_space(s + st, e - st)) && st + k == e) e = st;
            else break;
        }
    *start = a;
    *end = e;
}

/* ---- runtime values ---- */
#define OUTPUT_LIMIT ((size_t)64 << 20) /* bytes of one rendered string */

const char *const jv_type_names[] = {"UndefinedValue", "NullValue", "BooleanValue", "IntegerValue", "FloatValue",
                                     "StringValue", "ArrayValue", "TupleValue", "ObjectValue",
                                     "KeywordArgumentsValue", "NamespaceValue", "FunctionValue"};

val jv_undef_v = {.t = V_UNDEF}, jv_null_v = {.t = V_NULL}, jv_true_v = {.t = V_BOOL, .b = true},
    jv_false_v = {.t = V_BOOL, .b = false};

void jv_fail(struct ctx *C, const struct node *at, const char *fmt, ...) {
    char msg[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ja_fail(C->a, KV_EINVAL, at ? at->line : 0, at ? at->col : 0, "%s", msg);
}

/* ---- constructors ---- */
val *jv_new(struct ctx *C, enum vt t) {
    val *v = ja_alloc(C->a, sizeof *v);
    v->t = t;
    return v;
}
val *jv_int(struct ctx *C, int64_t i) {
    val *v = jv_new(C, V_INT);
    v->i = i;
    return v;
}
val *jv_float(struct ctx *C, double f) {
    val *v = jv_new(C, V_FLOAT);
    v->f = f;
    return v;
}
val *jv_str(struct ctx *C, const char *s, size_t n) {
    val *v = jv_new(C, V_STR);
    v->s = s;
    v->n = n;
    return v;
}
val *jv_strdup(struct ctx *C, const char *s, size_t n) { return jv_str(C, ja_strndup(C->a, s, n), n); }
val *jv_arr(struct ctx *C, enum vt t) {
    val *v = jv_new(C, t);
    v->a = ja_alloc(C->a, sizeof *v->a);
    return v;
}
val *jv_obj(struct ctx *C, enum vt t) {
    val *v = jv_new(C, t);
    v->o = ja_alloc(C->a, sizeof *v->o);
    return v;
}
val *jv_fn(struct ctx *C, enum fk kind, const char *name, val *self) {
    val *v = jv_new(C, V_FUNC);
    v->fn = ja_alloc(C->a, sizeof *v->fn);
    v->fn->kind = kind;
    v->fn->name = name;
    v->fn->self = self;
    return v;
}
void jv_push(struct ctx *C, struct arr *a, val *x) {
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 8;
        val **nv = ja_alloc(C->a, nc * sizeof *nv);
        if (a->n) memcpy(nv, a->v, a->n * sizeof *nv);
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = x;
}
val *jv_get(const struct obj *o, const char *k, size_t kn) {
    for (size_t i = 0; i < o->n; i++)
        if (o->kn[i] == kn && !memcmp(o->k[i], k, kn)) return o->v[i];
    return NULL;
}
void jv_set_all(struct ctx *C, struct obj *dst, const struct obj *src) {
    for (size_t i = 0; i < src->n; i++) jv_set(C, dst, src->k[i], src->kn[i], src->v[i]);
}
void jv_set(struct ctx *C, struct obj *o, const char *k, size_t kn, val *x) {
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

/* ---- string builder ---- */
void jv_sb_put(struct ctx *C, struct sb *b, const char *s, size_t n) {
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
void jv_sb_puts(struct ctx *C, struct sb *b, const char *s) { jv_sb_put(C, b, s, strlen(s)); }
val *jv_sb_val(struct ctx *C, struct sb *b) { return jv_str(C, b->s ? b->s : "", b->n); }

/* ---- truthiness, equality ---- */
bool jv_truthy(const val *v) {
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

/* JavaScript ===  on the underlying values */
bool jv_strict_eq(const val *x, const val *y) {
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
bool jv_loose_eq(const val *x, const val *y) {
    if (is_nullish(x) || is_nullish(y)) return is_nullish(x) && is_nullish(y);
    bool xp = is_num(x) || x->t == V_BOOL, yp = is_num(y) || y->t == V_BOOL;
    if (xp && yp) return num(x) == num(y);
    if (xp && y->t == V_STR) return num(x) == ju_to_number(y->s, y->n);
    if (yp && x->t == V_STR) return num(y) == ju_to_number(x->s, x->n);
    return jv_strict_eq(x, y);
}

/* ---- unicode helpers on values ---- */
size_t ju_utf16_len(const char *s, size_t n) {
    size_t len = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += ju_decode(s + i, n - i, &cp);
        len += cp >= 0x10000 ? 2 : 1;
    }
    return len;
}
/* code point boundaries: offsets of each code point start, plus n at the end */
size_t *jv_cp_offsets(struct ctx *C, const char *s, size_t n, size_t *count) {
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
val *jv_case_map(struct ctx *C, const val *v, bool upper) {
    struct sb b = {0};
    for (size_t i = 0; i < v->n;) {
        uint32_t cp;
        size_t l = ju_decode(v->s + i, v->n - i, &cp);
        char enc[4];
        if (l == 1 && (unsigned char)v->s[i] >= 0x80) {
            jv_sb_put(C, &b, v->s + i, 1);
        } else {
            uint32_t m = (uint32_t)(upper ? utf8proc_toupper((utf8proc_int32_t)cp) : utf8proc_tolower((utf8proc_int32_t)cp));
            jv_sb_put(C, &b, enc, ju_encode(m, enc));
        }
        i += l;
    }
    return jv_sb_val(C, &b);
}
val *jv_trim(struct ctx *C, const val *v, bool left, bool right) {
    size_t a, e;
    ju_trim(v->s, v->n, left, right, &a, &e);
    return jv_str(C, v->s + a, e - a);
}
const char *ju_find(const char *s, size_t n, const char *p, size_t pn) {
    if (pn == 0) return s;
    if (pn > n) return NULL;
    return memmem(s, n, p, pn);
}

int jv_compare(struct ctx *C, const val *x, const val *y, bool case_sensitive, const struct node *at) {
    if (x->t == V_NULL && y->t == V_NULL) return 0;
    if (x->t == V_NULL || y->t == V_NULL) jv_fail(C, at, "cannot compare %s with %s", jv_type_names[x->t], jv_type_names[y->t]);
    if (x->t == V_UNDEF && y->t == V_UNDEF) return 0;
    if (x->t == V_UNDEF || y->t == V_UNDEF) jv_fail(C, at, "cannot compare %s with %s", jv_type_names[x->t], jv_type_names[y->t]);
    bool xn = is_num(x) || x->t == V_BOOL, yn = is_num(y) || y->t == V_BOOL;
    if (xn && yn) return num(x) < num(y) ? -1 : num(x) > num(y) ? 1 : 0;
    if (x->t != y->t) jv_fail(C, at, "cannot compare different types: %s and %s", jv_type_names[x->t], jv_type_names[y->t]);
    if (x->t != V_STR) jv_fail(C, at, "cannot compare type: %s", jv_type_names[x->t]);
    const val *a = x, *b = y;
    if (!case_sensitive) {
        a = jv_case_map(C, x, false);
        b = jv_case_map(C, y, false);
    }
    /* UTF-16 code unit order equals code point order except for astral vs U+E000..U+FFFF;
     * byte order is code point order */
    size_t ml = a->n < b->n ? a->n : b->n;
    int c = memcmp(a->s, b->s, ml);
    if (c) return c < 0 ? -1 : 1;
    return a->n < b->n ? -1 : a->n > b->n ? 1 : 0;
}

void jv_sort(struct ctx *C, val **v, size_t n, const val *const *keys, bool cs, bool rev, const struct node *at) {
    /* stable insertion sort with an index array (template lists are small) */
    size_t *ord = ja_alloc(C->a, (n + 1) * sizeof *ord);
    for (size_t i = 0; i < n; i++) ord[i] = i;
    for (size_t i = 1; i < n; i++) {
        size_t x = ord[i], j = i;
        while (j > 0) {
            int c = jv_compare(C, keys[x], keys[ord[j - 1]], cs, at);
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
