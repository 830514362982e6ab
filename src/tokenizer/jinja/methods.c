/* methods: what `x.name`, `x[i]` and `x is name` mean. Property and index access, the str and
 * dict methods, the `is` tests, and the global functions (range, namespace, raise_exception,
 * strftime_now). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "jinja_internal.h"

/* ---- string methods ---- */
static bool is_ascii_word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
static val *kwarg(val **args, size_t *nargs, const char *name) {
    if (*nargs && args[*nargs - 1]->t == V_KWARGS) {
        val *v = jv_get(args[*nargs - 1]->o, name, strlen(name));
        return v;
    }
    return NULL;
}
static size_t npos(val **args, size_t nargs) { return nargs && args[nargs - 1]->t == V_KWARGS ? nargs - 1 : nargs; }

static val *str_replace(struct ctx *C, const val *s, const val *old, const val *nw, const val *count, const struct node *at) {
    if (count->t != V_INT && !is_nullish(count)) jv_fail(C, at, "replace() count argument must be a number or null");
    if (count->t == V_INT && count->i == 0) return (val *)s;
    int64_t remaining = count->t != V_INT || count->i < 0 ? INT64_MAX : count->i;
    struct sb b = {0};
    if (old->n == 0) {
        size_t nc;
        size_t *off = jv_cp_offsets(C, s->s, s->n, &nc);
        for (size_t i = 0; i <= nc; i++) {
            if (remaining > 0) {
                jv_sb_put(C, &b, nw->s, nw->n);
                remaining--;
            }
            if (i < nc) jv_sb_put(C, &b, s->s + off[i], off[i + 1] - off[i]);
        }
        return jv_sb_val(C, &b);
    }
    size_t i = 0;
    while (i < s->n) {
        const char *p = remaining > 0 ? ju_find(s->s + i, s->n - i, old->s, old->n) : NULL;
        if (!p) break;
        size_t at2 = (size_t)(p - s->s);
        jv_sb_put(C, &b, s->s + i, at2 - i);
        jv_sb_put(C, &b, nw->s, nw->n);
        remaining--;
        i = at2 + old->n;
    }
    jv_sb_put(C, &b, s->s + i, s->n - i);
    return jv_sb_val(C, &b);
}

val *jv_str_method(struct ctx *C, val *self, const char *name, val **args, size_t nargs, const struct node *at) {
    if (!strcmp(name, "upper")) return jv_case_map(C, self, true);
    if (!strcmp(name, "lower")) return jv_case_map(C, self, false);
    if (!strcmp(name, "strip")) return jv_trim(C, self, true, true);
    if (!strcmp(name, "lstrip")) return jv_trim(C, self, true, false);
    if (!strcmp(name, "rstrip")) return jv_trim(C, self, false, true);
    if (!strcmp(name, "title")) {
        char *s = ja_strndup(C->a, self->s, self->n);
        for (size_t i = 0; i < self->n; i++)
            if (is_ascii_word(s[i]) && (i == 0 || !is_ascii_word(self->s[i - 1])) && s[i] >= 'a' && s[i] <= 'z') s[i] -= 32;
        return jv_str(C, s, self->n);
    }
    if (!strcmp(name, "capitalize")) {
        if (!self->n) return self;
        uint32_t cp;
        size_t l = ju_decode(self->s, self->n, &cp);
        val first = {.t = V_STR, .s = self->s, .n = l};
        val *u = jv_case_map(C, &first, true);
        struct sb b = {0};
        jv_sb_put(C, &b, u->s, u->n);
        jv_sb_put(C, &b, self->s + l, self->n - l);
        return jv_sb_val(C, &b);
    }
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        bool sw = name[0] == 's';
        if (nargs == 0) jv_fail(C, at, "%s() requires at least one argument", name);
        val *p = args[0];
        val **cands = &p;
        size_t nc = 1;
        if (is_arr(p)) {
            cands = p->a->v;
            nc = p->a->n;
        } else if (p->t != V_STR) {
            jv_fail(C, at, "%s() argument must be a string or tuple of strings", name);
        }
        for (size_t i = 0; i < nc; i++) {
            if (cands[i]->t != V_STR) jv_fail(C, at, "%s() tuple elements must be strings", name);
            const val *q = cands[i];
            if (q->n <= self->n && !memcmp(sw ? self->s : self->s + self->n - q->n, q->s, q->n)) return BOOLV(true);
        }
        return BOOLV(false);
    }
    if (!strcmp(name, "split")) {
        val *sep = nargs > 0 ? args[0] : NUL;
        if (sep->t != V_STR && !is_nullish(sep)) jv_fail(C, at, "sep argument must be a string or null");
        val *maxs = nargs > 1 ? args[1] : NULL;
        if (maxs && maxs->t != V_INT) jv_fail(C, at, "maxsplit argument must be a number");
        int64_t ms = maxs ? maxs->i : -1;
        val *r = jv_arr(C, V_ARRAY);
        if (sep->t != V_STR) {
            val *t = jv_trim(C, self, true, false);
            size_t i = 0, k;
            while (i < t->n) {
                size_t st = i;
                while (i < t->n && !ju_space(t->s + i, t->n - i)) i++;
                if (ms != -1 && (int64_t)r->a->n >= ms) {
                    jv_push(C, r->a, jv_str(C, t->s + st, t->n - st));
                    break;
                }
                jv_push(C, r->a, jv_str(C, t->s + st, i - st));
                while (i < t->n && (k = ju_space(t->s + i, t->n - i))) i += k;
            }
            return r;
        }
        if (sep->n == 0) jv_fail(C, at, "empty separator");
        size_t i = 0;
        for (;;) {
            const char *p = ju_find(self->s + i, self->n - i, sep->s, sep->n);
            if (!p) break;
            size_t pos = (size_t)(p - self->s);
            jv_push(C, r->a, jv_str(C, self->s + i, pos - i));
            i = pos + sep->n;
        }
        jv_push(C, r->a, jv_str(C, self->s + i, self->n - i));
        if (ms != -1 && (int64_t)r->a->n > ms) {
            /* rejoin the tail: it is the text after the ms-th separator */
            size_t off = 0;
            for (int64_t q = 0; q < ms; q++) off += r->a->v[q]->n + sep->n;
            r->a->v[ms] = jv_str(C, self->s + off, self->n - off);
            r->a->n = (size_t)ms + 1;
        }
        return r;
    }
    if (!strcmp(name, "replace")) {
        if (nargs < 2) jv_fail(C, at, "replace() requires at least two arguments");
        if (args[0]->t != V_STR || args[1]->t != V_STR) jv_fail(C, at, "replace() arguments must be strings");
        val *count = NUL;
        if (nargs > 2) {
            if (args[2]->t == V_KWARGS) {
                val *c = jv_get(args[2]->o, "count", 5);
                count = c ? c : NUL;
            } else {
                count = args[2];
            }
        }
        return str_replace(C, self, args[0], args[1], count, at);
    }
    jv_fail(C, at, "unknown string method %s", name);
}

val *jv_obj_items(struct ctx *C, const val *o, int which) {
    val *r = jv_arr(C, V_ARRAY);
    for (size_t i = 0; i < o->o->n; i++) {
        val *k = jv_str(C, o->o->k[i], o->o->kn[i]);
        if (which == 1) jv_push(C, r->a, k);
        else if (which == 2) jv_push(C, r->a, o->o->v[i]);
        else {
            val *p = jv_arr(C, V_ARRAY);
            jv_push(C, p->a, k);
            jv_push(C, p->a, o->o->v[i]);
            jv_push(C, r->a, p);
        }
    }
    return r;
}

val *jv_obj_method(struct ctx *C, val *self, const char *name, val **args, size_t nargs, const struct node *at) {
    if (!strcmp(name, "get")) {
        val *key = nargs > 0 ? args[0] : UNDEF;
        if (key->t != V_STR) jv_fail(C, at, "object key must be a string: got %s", jv_type_names[key->t]);
        val *v = jv_get(self->o, key->s, key->n);
        if (v) return v;
        return nargs > 1 ? args[1] : NUL;
    }
    if (!strcmp(name, "items")) return jv_obj_items(C, self, 0);
    if (!strcmp(name, "keys")) return jv_obj_items(C, self, 1);
    if (!strcmp(name, "values")) return jv_obj_items(C, self, 2);
    if (!strcmp(name, "dictsort")) {
        size_t np = npos(args, nargs);
        val *cs = np > 0 ? args[0] : kwarg(args, &nargs, "case_sensitive");
        if (!cs) cs = BOOLV(false);
        if (cs->t != V_BOOL) jv_fail(C, at, "case_sensitive must be a boolean");
        val *by = np > 1 ? args[1] : kwarg(args, &nargs, "by");
        if (!by) by = jv_str(C, "key", 3);
        if (by->t != V_STR) jv_fail(C, at, "by must be a string");
        bool byval;
        if (by->n == 3 && !memcmp(by->s, "key", 3)) byval = false;
        else if (by->n == 5 && !memcmp(by->s, "value", 5)) byval = true;
        else jv_fail(C, at, "by must be either 'key' or 'value'");
        val *rev = np > 2 ? args[2] : kwarg(args, &nargs, "reverse");
        if (!rev) rev = BOOLV(false);
        if (rev->t != V_BOOL) jv_fail(C, at, "reverse must be a boolean");
        val *items = jv_obj_items(C, self, 0);
        const val **keys = ja_alloc(C->a, (items->a->n + 1) * sizeof *keys);
        for (size_t i = 0; i < items->a->n; i++) keys[i] = items->a->v[i]->a->v[byval ? 1 : 0];
        jv_sort(C, items->a->v, items->a->n, keys, cs->b, rev->b, at);
        return items;
    }
    jv_fail(C, at, "unknown object method %s", name);
}

static bool is_str_method(const char *s, size_t n) {
    static const char *names[] = {"upper", "lower", "strip", "title", "capitalize", "rstrip", "lstrip",
                                  "startswith", "endswith", "split", "replace"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && !memcmp(names[i], s, n)) return true;
    return false;
}
const char *jv_obj_method_name(const char *s, size_t n) {
    static const char *names[] = {"get", "items", "keys", "values", "dictsort"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && !memcmp(names[i], s, n)) return names[i];
    return NULL;
}

/* ---- member access ---- */
static val *str_at(struct ctx *C, const val *s, int64_t idx) {
    int64_t len = (int64_t)ju_utf16_len(s->s, s->n);
    if (idx < 0) idx += len;
    if (idx < 0 || idx >= len) return UNDEF;
    int64_t u = 0;
    for (size_t i = 0; i < s->n;) {
        uint32_t cp;
        size_t l = ju_decode(s->s + i, s->n - i, &cp);
        int w = cp >= 0x10000 ? 2 : 1;
        if (idx < u + w) {
            if (w == 2) return jv_str(C, "\xEF\xBF\xBD", 3); /* half of a surrogate pair */
            return jv_str(C, s->s + i, l);
        }
        u += w;
        i += l;
    }
    return UNDEF;
}

val *jv_member(struct ctx *C, val *o, val *prop, const struct node *at) {
    val *r = NULL;
    if (is_attr_container(o)) {
        if (prop->t != V_STR) jv_fail(C, at, "cannot access property with non-string: got %s", jv_type_names[prop->t]);
        r = jv_get(o->o, prop->s, prop->n);
        if (!r && is_obj(o)) {
            const char *m = jv_obj_method_name(prop->s, prop->n);
            if (m) r = jv_fn(C, F_OBJM, m, o);
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
                r = jv_int(C, (int64_t)(o->t == V_STR ? ju_utf16_len(o->s, o->n) : o->a->n));
            else if (o->t == V_STR && is_str_method(prop->s, prop->n))
                r = jv_fn(C, F_STRM, ja_strndup(C->a, prop->s, prop->n), o);
        } else {
            jv_fail(C, at, "cannot access property with non-string/non-number: got %s", jv_type_names[prop->t]);
        }
    } else {
        if (prop->t != V_STR) jv_fail(C, at, "cannot access property with non-string: got %s", jv_type_names[prop->t]);
        jv_fail(C, at, "cannot read property '%.*s' of %s", (int)(prop->n > 60 ? 60 : prop->n), prop->s,
             o->t == V_UNDEF ? "an undefined value" : jv_type_names[o->t]);
    }
    return r ? r : UNDEF;
}

/* ---- tests ---- */
bool jv_test(struct ctx *C, const char *name, size_t n, val *v, const struct node *at) {
#define T(s) (n == strlen(s) && !memcmp(name, s, n))
    if (T("boolean")) return v->t == V_BOOL;
    if (T("callable")) return v->t == V_FUNC;
    if (T("odd") || T("even")) {
        if (v->t != V_INT) jv_fail(C, at, "cannot %s on %s", T("odd") ? "odd" : "even", jv_type_names[v->t]);
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
        val *m = jv_case_map(C, v, T("upper"));
        return m->n == v->n && !memcmp(m->s, v->s, v->n);
    }
    if (T("defined")) return v->t != V_UNDEF;
    if (T("undefined")) return v->t == V_UNDEF;
    if (T("equalto") || T("eq")) jv_fail(C, at, "test '%.*s' needs an argument, which this engine does not support", (int)n, name);
    jv_fail(C, at, "unknown test: %.*s", (int)(n > 60 ? 60 : n), name);
#undef T
}

static val *builtin_range(struct ctx *C, val **args, size_t nargs, const struct node *at) {
    for (size_t i = 0; i < nargs; i++)
        if (!is_num(args[i])) jv_fail(C, at, "range() arguments must be numbers");
    double start = 0, stop, step = 1;
    if (nargs == 0) jv_fail(C, at, "range() needs at least one argument");
    if (nargs == 1) stop = num(args[0]);
    else {
        start = num(args[0]);
        stop = num(args[1]);
        if (nargs > 2) step = num(args[2]);
    }
    if (step == 0) jv_fail(C, at, "range() step must not be zero");
    val *r = jv_arr(C, V_ARRAY);
    for (double i = start; step > 0 ? i < stop : i > stop; i += step) {
        jv_step(C, at);
        jv_push(C, r->a, i == floor(i) && fabs(i) < 9e15 ? jv_int(C, (int64_t)i) : jv_float(C, i));
    }
    return r;
}

static val *builtin_strftime(struct ctx *C, val **args, size_t nargs, const struct node *at) {
    if (nargs < 1 || args[0]->t != V_STR) jv_fail(C, at, "strftime_now() needs a format string");
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
            jv_sb_puts(C, &b, buf);
        } else {
            jv_sb_put(C, &b, f->s + i, 1);
        }
    }
    return jv_sb_val(C, &b);
}

static _Noreturn void builtin_raise(struct ctx *C, val **args, size_t nargs, const struct node *at) {
    struct sb b = {0};
    for (size_t i = 0; i < nargs; i++) {
        if (i) jv_sb_puts(C, &b, ",");
        if (!is_nullish(args[i])) jv_raw_str(C, &b, args[i], at);
    }
    jv_fail(C, at, "raise_exception: %.*s", (int)(b.n > 250 ? 250 : b.n), b.s ? b.s : "");
}

static val *builtin_namespace(struct ctx *C, val **args, size_t nargs, const struct node *at) {
    size_t np = npos(args, nargs);
    if (np > 1) jv_fail(C, at, "namespace expected at most 1 argument, got %zu", np);
    val *ns = jv_obj(C, V_NS);
    if (np == 1) {
        val *src = args[0];
        if (is_obj(src)) {
            jv_set_all(C, ns->o, src->o);
        } else if (is_arr(src)) {
            for (size_t i = 0; i < src->a->n; i++) {
                val *p = src->a->v[i];
                if (!is_arr(p) || p->a->n != 2 || p->a->v[0]->t != V_STR)
                    jv_fail(C, at, "namespace expected an object or an iterable of [key, value] pairs");
                jv_set(C, ns->o, p->a->v[0]->s, p->a->v[0]->n, p->a->v[1]);
            }
        } else {
            jv_fail(C, at, "'%s' object is not iterable", jv_type_names[src->t]);
        }
    }
    if (np < nargs) jv_set_all(C, ns->o, args[nargs - 1]->o);
    return ns;
}

val *jv_call_builtin(struct ctx *C, struct fn *fn, val **args, size_t nargs, const struct node *at) {
    switch (fn->kind) {
    case F_STRM: return jv_str_method(C, fn->self, fn->name, args, nargs, at);
    case F_OBJM: return jv_obj_method(C, fn->self, fn->name, args, nargs, at);
    case F_RANGE: return builtin_range(C, args, nargs, at);
    case F_STRFTIME: return builtin_strftime(C, args, nargs, at);
    case F_RAISE: builtin_raise(C, args, nargs, at);
    case F_NAMESPACE: return builtin_namespace(C, args, nargs, at);
    default: jv_fail(C, at, "bad function");
    }
}
