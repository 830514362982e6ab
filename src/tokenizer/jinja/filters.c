/* filters: the `|` filters, bare (`x | length`) and called (`x | join(", ")`), dispatched on the
 * operand's type as the reference engine does. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

static val *akw(const struct args *a, const char *name) { return a->kw ? jv_get(a->kw->o, name, strlen(name)) : NULL; }
/* Argument i, else the keyword `name`, else def. */
static val *arg(const struct args *a, size_t i, const char *name, val *def) {
    val *v = i < a->npos ? a->pos[i] : akw(a, name);
    return v ? v : def;
}

/* What {{ v }} prints, as a string value. */
static val *to_string(struct ctx *C, const val *v, const struct node *at) {
    struct sb b = {0};
    jv_to_str(C, &b, v, at);
    return jv_sb_val(C, &b);
}

/* Prefixes each line of v with width spaces; the first line only with `first`, empty lines
 * only with `blank`. */
static val *indent(struct ctx *C, const val *v, int64_t width, bool first, bool blank) {
    struct sb b = {0};
    size_t i = 0;
    for (size_t line = 0;; line++) {
        const char *nl = memchr(v->s + i, '\n', v->n - i);
        size_t end = nl ? (size_t)(nl - v->s) : v->n;
        if (line) jv_sb_puts(C, &b, "\n");
        if (!((!first && line == 0) || (!blank && end == i)))
            for (int64_t q = 0; q < width; q++) jv_sb_put(C, &b, " ", 1);
        jv_sb_put(C, &b, v->s + i, end - i);
        if (!nl) break;
        i = end + 1;
    }
    return jv_sb_val(C, &b);
}

static bool name_is(const struct node *x, const char *s) { return x->n == strlen(s) && !memcmp(x->s, s, x->n); }

static val *attr_path(struct ctx *C, val *item, const char *path, size_t n) {
    val *v = item;
    size_t i = 0;
    for (;;) {
        size_t j = i;
        while (j < n && path[j] != '.') j++;
        if (is_attr_container(v)) {
            v = jv_get(v->o, path + i, j - i);
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

val *jinja_filter(struct ctx *C, val *v, const struct node *f, struct env *e) {
    if (f->kind == N_IDENT) {
        if (name_is(f, "safe")) return v;
        if (name_is(f, "tojson")) return jv_tojson(C, v, 0, false, false, ", ", ": ", f);
        if (is_arr(v)) {
            if (name_is(f, "list")) return v;
            if (name_is(f, "first")) return v->a->n ? v->a->v[0] : UNDEF;
            if (name_is(f, "last")) return v->a->n ? v->a->v[v->a->n - 1] : UNDEF;
            if (name_is(f, "length")) return jv_int(C, (int64_t)v->a->n);
            if (name_is(f, "reverse")) {
                val *r = jv_arr(C, V_ARRAY);
                for (size_t i = v->a->n; i-- > 0;) jv_push(C, r->a, v->a->v[i]);
                return r;
            }
            if (name_is(f, "sort")) {
                val *r = jv_arr(C, V_ARRAY);
                for (size_t i = 0; i < v->a->n; i++) jv_push(C, r->a, v->a->v[i]);
                jv_sort(C, r->a->v, r->a->n, (const val *const *)r->a->v, false, false, f);
                return r;
            }
            if (name_is(f, "join")) {
                struct sb b = {0};
                for (size_t i = 0; i < v->a->n; i++) jv_raw_str(C, &b, v->a->v[i], f);
                return jv_sb_val(C, &b);
            }
            if (name_is(f, "string")) return to_string(C, v, f);
            if (name_is(f, "unique")) {
                val *r = jv_arr(C, V_ARRAY);
                for (size_t i = 0; i < v->a->n; i++) {
                    bool seen = false;
                    for (size_t k = 0; k < r->a->n && !seen; k++) seen = jv_strict_eq(r->a->v[k], v->a->v[i]);
                    if (!seen) jv_push(C, r->a, v->a->v[i]);
                }
                return r;
            }
            jv_fail(C, f, "unknown filter '%.*s' for an array", (int)f->n, f->s);
        }
        if (v->t == V_STR) {
            if (name_is(f, "length")) return jv_int(C, (int64_t)ju_utf16_len(v->s, v->n));
            if (name_is(f, "upper") || name_is(f, "lower") || name_is(f, "title") || name_is(f, "capitalize"))
                return jv_str_method(C, v, ja_strndup(C->a, f->s, f->n), NULL, 0, f);
            if (name_is(f, "trim")) return jv_trim(C, v, true, true);
            if (name_is(f, "indent")) return indent(C, v, 4, false, false);
            if (name_is(f, "join") || name_is(f, "string")) return v;
            if (name_is(f, "int")) {
                bool ok;
                int64_t x = ju_parse_int(v->s, v->n, &ok);
                return jv_int(C, ok ? x : 0);
            }
            if (name_is(f, "float")) {
                bool ok;
                double x = ju_parse_float(v->s, v->n, &ok);
                return jv_float(C, ok ? x : 0);
            }
            jv_fail(C, f, "unknown filter '%.*s' for a string", (int)f->n, f->s);
        }
        if (is_num(v)) {
            if (name_is(f, "abs")) return v->t == V_INT ? jv_int(C, v->i < 0 ? -v->i : v->i) : jv_float(C, fabs(v->f));
            if (name_is(f, "int")) return jv_int(C, v->t == V_INT ? v->i : (int64_t)floor(v->f));
            if (name_is(f, "float")) return jv_float(C, num(v));
            if (name_is(f, "string")) return to_string(C, v, f);
            jv_fail(C, f, "unknown filter '%.*s' for a number", (int)f->n, f->s);
        }
        if (is_obj(v)) {
            if (name_is(f, "items")) return jv_obj_items(C, v, 0);
            if (name_is(f, "length")) return jv_int(C, (int64_t)v->o->n);
            const char *m = jv_obj_method_name(f->s, f->n);
            if (m) return jv_obj_method(C, v, m, NULL, 0, f);
            jv_fail(C, f, "unknown filter '%.*s' for an object", (int)f->n, f->s);
        }
        if (v->t == V_BOOL) {
            if (name_is(f, "bool")) return v;
            if (name_is(f, "int")) return jv_int(C, v->b);
            if (name_is(f, "float")) return jv_float(C, v->b);
            if (name_is(f, "string")) return jv_str(C, v->b ? "true" : "false", v->b ? 4 : 5);
            jv_fail(C, f, "unknown filter '%.*s' for a boolean", (int)f->n, f->s);
        }
        jv_fail(C, f, "cannot apply filter '%.*s' to %s", (int)f->n, f->s, jv_type_names[v->t]);
    }
    if (f->kind != N_CALL || f->a->kind != N_IDENT) jv_fail(C, f, "unsupported filter expression");
    const struct node *fn = f->a;
    struct args A;
    if (name_is(fn, "tojson")) {
        jinja_eval_args(C, f->l1, f->n1, e, &A);
        val *ind = akw(&A, "indent");
        if (ind && ind->t != V_INT && !is_nullish(ind)) jv_fail(C, f, "if set, indent must be a number");
        val *asc = akw(&A, "ensure_ascii");
        if (asc && asc->t != V_BOOL) jv_fail(C, f, "if set, ensure_ascii must be a boolean");
        val *sk = akw(&A, "sort_keys");
        if (sk && sk->t != V_BOOL) jv_fail(C, f, "if set, sort_keys must be a boolean");
        val *sep = akw(&A, "separators");
        const char *is = NULL, *ks = NULL;
        if (sep && is_arr(sep)) {
            if (sep->a->n != 2 || sep->a->v[0]->t != V_STR || sep->a->v[1]->t != V_STR)
                jv_fail(C, f, "separators must be a tuple of two strings");
            is = ja_strndup(C->a, sep->a->v[0]->s, sep->a->v[0]->n);
            ks = ja_strndup(C->a, sep->a->v[1]->s, sep->a->v[1]->n);
        } else if (sep && !is_nullish(sep)) {
            jv_fail(C, f, "if set, separators must be a tuple of two strings");
        }
        int indent = ind && ind->t == V_INT ? (int)(ind->i > 64 ? 64 : ind->i < 0 ? 0 : ind->i) : 0;
        if (!is) {
            is = indent ? "," : ", ";
            ks = ": ";
        }
        return jv_tojson(C, v, indent, asc && asc->b, sk && sk->b, is, ks, f);
    }
    if (name_is(fn, "join")) {
        if (v->t != V_STR && !is_arr(v)) jv_fail(C, f, "cannot apply filter 'join' to %s", jv_type_names[v->t]);
        jinja_eval_args(C, f->l1, f->n1, e, &A);
        val *sep = arg(&A, 0, "separator", jv_str(C, "", 0));
        if (sep->t != V_STR) jv_fail(C, f, "separator must be a string");
        struct sb b = {0};
        if (v->t == V_STR) {
            size_t nc;
            size_t *off = jv_cp_offsets(C, v->s, v->n, &nc);
            for (size_t i = 0; i < nc; i++) {
                if (i) jv_sb_put(C, &b, sep->s, sep->n);
                jv_sb_put(C, &b, v->s + off[i], off[i + 1] - off[i]);
            }
        } else {
            for (size_t i = 0; i < v->a->n; i++) {
                if (i) jv_sb_put(C, &b, sep->s, sep->n);
                if (!is_nullish(v->a->v[i])) jv_raw_str(C, &b, v->a->v[i], f);
            }
        }
        return jv_sb_val(C, &b);
    }
    if (name_is(fn, "int") || name_is(fn, "float")) {
        bool is_int = name_is(fn, "int");
        jinja_eval_args(C, f->l1, f->n1, e, &A);
        val *def = arg(&A, 0, "default", is_int ? jv_int(C, 0) : jv_float(C, 0));
        if (v->t == V_STR) {
            bool ok;
            if (is_int) {
                int64_t x = ju_parse_int(v->s, v->n, &ok);
                return ok ? jv_int(C, x) : def;
            }
            double x = ju_parse_float(v->s, v->n, &ok);
            return ok ? jv_float(C, x) : def;
        }
        if (is_num(v)) return v;
        if (v->t == V_BOOL) return is_int ? jv_int(C, v->b) : jv_float(C, v->b);
        jv_fail(C, f, "cannot apply filter '%s' to %s", is_int ? "int" : "float", jv_type_names[v->t]);
    }
    if (name_is(fn, "default")) {
        jinja_eval_args(C, f->l1, f->n1, e, &A);
        val *def = A.npos > 0 ? A.pos[0] : jv_str(C, "", 0);
        val *bo = arg(&A, 1, "boolean", BOOLV(false));
        if (bo->t != V_BOOL) jv_fail(C, f, "`default` filter flag must be a boolean");
        if (v->t == V_UNDEF || (bo->b && !jv_truthy(v))) return def;
        return v;
    }
    if (is_arr(v)) {
        if (name_is(fn, "sort")) {
            jinja_eval_args(C, f->l1, f->n1, e, &A);
            val *rev = arg(&A, 0, "reverse", BOOLV(false));
            if (rev->t != V_BOOL) jv_fail(C, f, "reverse must be a boolean");
            val *cs = arg(&A, 1, "case_sensitive", BOOLV(false));
            if (cs->t != V_BOOL) jv_fail(C, f, "case_sensitive must be a boolean");
            val *attr = arg(&A, 2, "attribute", NUL);
            if (attr->t != V_STR && attr->t != V_INT && !is_nullish(attr)) jv_fail(C, f, "attribute must be a string, integer, or null");
            val *r = jv_arr(C, V_ARRAY);
            const val **keys = ja_alloc(C->a, (v->a->n + 1) * sizeof *keys);
            for (size_t i = 0; i < v->a->n; i++) {
                jv_push(C, r->a, v->a->v[i]);
                if (is_nullish(attr)) keys[i] = v->a->v[i];
                else if (attr->t == V_STR) keys[i] = attr_path(C, v->a->v[i], attr->s, attr->n);
                else {
                    char buf[32];
                    snprintf(buf, sizeof buf, "%lld", (long long)attr->i);
                    keys[i] = attr_path(C, v->a->v[i], buf, strlen(buf));
                }
            }
            jv_sort(C, r->a->v, r->a->n, keys, cs->b, rev->b, f);
            return r;
        }
        if (name_is(fn, "selectattr") || name_is(fn, "rejectattr")) {
            bool sel = name_is(fn, "selectattr");
            for (size_t i = 0; i < v->a->n; i++)
                if (!is_attr_container(v->a->v[i])) jv_fail(C, f, "`%.*s` can only be applied to array of objects", (int)fn->n, fn->s);
            for (size_t i = 0; i < f->n1; i++)
                if (f->l1[i]->kind != N_STR) jv_fail(C, f, "arguments of `%.*s` must be strings", (int)fn->n, fn->s);
            if (f->n1 < 1) jv_fail(C, f, "`%.*s` needs an attribute name", (int)fn->n, fn->s);
            const struct node *attr = f->l1[0], *test = f->n1 > 1 ? f->l1[1] : NULL;
            if (test && f->n1 > 2) {
                /* equalto/eq with a value: a.value === value.value */
                if (!(name_is(test, "equalto") || name_is(test, "eq")))
                    (void)jv_test(C, test->s, test->n, UNDEF, f); /* unknown test: error */
            }
            val *r = jv_arr(C, V_ARRAY);
            for (size_t i = 0; i < v->a->n; i++) {
                val *a = jv_get(v->a->v[i]->o, attr->s, attr->n);
                bool res = false;
                if (a) {
                    if (!test) res = jv_truthy(a);
                    else if (name_is(test, "equalto") || name_is(test, "eq")) {
                        val *cmp = f->n1 > 2 ? jv_str(C, f->l1[2]->s, f->l1[2]->n) : UNDEF;
                        res = jv_strict_eq(a, cmp);
                    } else res = jv_test(C, test->s, test->n, a, f);
                }
                if (res == sel) jv_push(C, r->a, v->a->v[i]);
            }
            return r;
        }
        if (name_is(fn, "map")) {
            jinja_eval_args(C, f->l1, f->n1, e, &A);
            val *attr = akw(&A, "attribute");
            if (!attr) jv_fail(C, f, "`map` expressions without `attribute` set are not supported");
            if (attr->t != V_STR) jv_fail(C, f, "attribute must be a string");
            val *def = akw(&A, "default");
            val *r = jv_arr(C, V_ARRAY);
            for (size_t i = 0; i < v->a->n; i++) {
                if (!is_attr_container(v->a->v[i])) jv_fail(C, f, "items in map must be an object");
                val *x = attr_path(C, v->a->v[i], attr->s, attr->n);
                jv_push(C, r->a, x->t == V_UNDEF && def ? def : x);
            }
            return r;
        }
        jv_fail(C, f, "unknown filter '%.*s' for an array", (int)fn->n, fn->s);
    }
    if (v->t == V_STR) {
        if (name_is(fn, "indent")) {
            jinja_eval_args(C, f->l1, f->n1, e, &A);
            val *w = arg(&A, 0, "width", jv_int(C, 4));
            if (w->t != V_INT) jv_fail(C, f, "width must be a number");
            val *first = arg(&A, 1, "first", NULL);
            val *blank = arg(&A, 2, "blank", NULL);
            int64_t width = w->i < 0 ? 0 : w->i > 1024 ? 1024 : w->i;
            return indent(C, v, width, first && jv_truthy(first), blank && jv_truthy(blank));
        }
        if (name_is(fn, "replace")) {
            jinja_eval_args(C, f->l1, f->n1, e, &A);
            size_t n;
            val **args = jinja_args_flat(C, &A, true, &n);
            return jv_str_method(C, v, "replace", args, n, f);
        }
        jv_fail(C, f, "unknown filter '%.*s' for a string", (int)fn->n, fn->s);
    }
    if (is_obj(v)) {
        const char *m = jv_obj_method_name(fn->s, fn->n);
        if (m) {
            jinja_eval_args(C, f->l1, f->n1, e, &A);
            size_t n;
            val **args = jinja_args_flat(C, &A, false, &n);
            return jv_obj_method(C, v, m, args, n, f);
        }
        jv_fail(C, f, "unknown filter '%.*s' for an object", (int)fn->n, fn->s);
    }
    jv_fail(C, f, "cannot apply filter '%.*s' to %s", (int)fn->n, fn->s, jv_type_names[v->t]);
}
