/* eval: the tree-walking interpreter. Statements (if, for, set, macro, call, filter blocks),
 * expression evaluation and operators, environments and macro calls, and jinja_render. Values,
 * scoping and operators follow @huggingface/jinja's runtime (see jinja.h for notable quirks). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

#define MAX_CALL_DEPTH 200

struct env {
    struct env *parent;
    struct obj vars;
};

/* ---- environments ---- */
static val *env_lookup(struct env *e, const char *k, size_t n) {
    for (; e; e = e->parent) {
        val *v = jv_get(&e->vars, k, n);
        if (v) return v;
    }
    return UNDEF;
}
static struct env *env_new(struct ctx *C, struct env *parent) {
    struct env *e = ja_alloc(C->a, sizeof *e);
    e->parent = parent;
    return e;
}

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
    if (step == 0) jv_fail(C, NULL, "slice step cannot be zero");
    size_t cnt = 0;
    size_t *idx = ja_alloc(C->a, (len + 1) * sizeof *idx);
    for (int64_t i = start; dir * i < dir * stop; i += step) idx[cnt++] = (size_t)i;
    *out = idx;
    return cnt;
}

/* ---- argument evaluation ---- */
void jinja_eval_args(struct ctx *C, struct node *const *l, size_t n, struct env *e, struct args *out) {
    struct arr pos = {0};
    val *kw = NULL;
    for (size_t i = 0; i < n; i++) {
        const struct node *x = l[i];
        if (x->kind == N_SPREAD) {
            val *v = jinja_eval(C, x->a, e);
            if (!is_arr(v)) jv_fail(C, x, "cannot unpack non-iterable type: %s", jv_type_names[v->t]);
            for (size_t k = 0; k < v->a->n; k++) jv_push(C, &pos, v->a->v[k]);
        } else if (x->kind != N_KWARG && x->kind != N_KWSPREAD) {
            jv_push(C, &pos, jinja_eval(C, x, e));
        }
    }
    for (size_t i = 0; i < n; i++) {
        const struct node *x = l[i];
        if (x->kind == N_KWARG) {
            if (!kw) kw = jv_obj(C, V_KWARGS);
            if (jv_get(kw->o, x->s, x->n)) jv_fail(C, x, "got multiple values for keyword argument '%.*s'", (int)x->n, x->s);
            jv_set(C, kw->o, x->s, x->n, jinja_eval(C, x->a, e));
        } else if (x->kind == N_KWSPREAD) {
            val *v = jinja_eval(C, x->a, e);
            if (!is_obj(v)) jv_fail(C, x, "argument after ** must be a mapping, not %s", jv_type_names[v->t]);
            if (!kw) kw = jv_obj(C, V_KWARGS);
            for (size_t k = 0; k < v->o->n; k++) {
                if (jv_get(kw->o, v->o->k[k], v->o->kn[k])) jv_fail(C, x, "got multiple values for a keyword argument");
                jv_set(C, kw->o, v->o->k[k], v->o->kn[k], v->o->v[k]);
            }
        }
    }
    out->pos = pos.v;
    out->npos = pos.n;
    out->kw = kw;
}

val **jinja_args_flat(struct ctx *C, const struct args *A, bool always_kw, size_t *n) {
    val **args = ja_alloc(C->a, (A->npos + 2) * sizeof *args);
    for (size_t i = 0; i < A->npos; i++) args[i] = A->pos[i];
    *n = A->npos;
    if (A->kw || always_kw) args[(*n)++] = A->kw ? A->kw : jv_obj(C, V_KWARGS);
    return args;
}

/* ---- operators ---- */
/* String(l) + String(r): `~`, and `+` with a string operand. */
static val *concat(struct ctx *C, const val *l, const val *r, const struct node *at) {
    struct sb b = {0};
    jv_raw_str(C, &b, l, at);
    jv_raw_str(C, &b, r, at);
    return jv_sb_val(C, &b);
}

static val *binary(struct ctx *C, const struct node *x, struct env *e) {
    val *l = jinja_eval(C, x->a, e);
    if (x->op == OP_AND) return jv_truthy(l) ? jinja_eval(C, x->b, e) : l;
    if (x->op == OP_OR) return jv_truthy(l) ? l : jinja_eval(C, x->b, e);
    val *r = jinja_eval(C, x->b, e);
    if (x->op == OP_EQ) return BOOLV(jv_loose_eq(l, r));
    if (x->op == OP_NE) return BOOLV(!jv_loose_eq(l, r));
    if (l->t == V_UNDEF || r->t == V_UNDEF) {
        if (r->t == V_UNDEF && (x->op == OP_IN || x->op == OP_NOTIN)) return BOOLV(x->op == OP_NOTIN);
        jv_fail(C, x, "cannot perform this operation on undefined values");
    }
    if (l->t == V_NULL || r->t == V_NULL) jv_fail(C, x, "cannot perform operation on null values");
    if (x->op == OP_CONCAT) {
        return concat(C, l, r, x);
    }
    bool ln = is_num(l) || l->t == V_BOOL, rn = is_num(r) || r->t == V_BOOL;
    if (x->op == OP_POW && ln && rn) {
        double a = num(l), b = num(r);
        if (a == 0 && b < 0) jv_fail(C, x, "0.0 cannot be raised to a negative power");
        double res = pow(a, b);
        if (!isfinite(res)) jv_fail(C, x, "exponentiation result is not a finite real number");
        if (l->t == V_FLOAT || r->t == V_FLOAT || b < 0) return jv_float(C, res);
        if (fabs(res) > 9.2e18) jv_fail(C, x, "integer result out of range");
        return jv_int(C, (int64_t)res);
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
                if (ov) jv_fail(C, x, "integer overflow");
                return jv_int(C, res);
            } else {
                double a = num(l), b = num(r);
                return jv_float(C, x->op == OP_ADD ? a + b : x->op == OP_SUB ? a - b : a * b);
            }
        case OP_DIV: return jv_float(C, num(l) / num(r));
        case OP_FLOORDIV: {
            double res = floor(num(l) / num(r));
            if (fl) return jv_float(C, res);
            if (!isfinite(res)) jv_fail(C, x, "integer division by zero");
            return jv_int(C, (int64_t)res);
        }
        case OP_MOD:
            if (fl) return jv_float(C, fmod(num(l), num(r)));
            if (r->i == 0) jv_fail(C, x, "integer modulo by zero");
            if (r->i == -1) return jv_int(C, 0);
            return jv_int(C, l->i % r->i);
        case OP_LT: return BOOLV(num(l) < num(r));
        case OP_GT: return BOOLV(num(l) > num(r));
        case OP_LE: return BOOLV(num(l) <= num(r));
        case OP_GE: return BOOLV(num(l) >= num(r));
        default: break;
        }
    } else if (is_arr(l) && is_arr(r)) {
        if (x->op == OP_ADD) {
            val *res = jv_arr(C, V_ARRAY);
            for (size_t i = 0; i < l->a->n; i++) jv_push(C, res->a, l->a->v[i]);
            for (size_t i = 0; i < r->a->n; i++) jv_push(C, res->a, r->a->v[i]);
            return res;
        }
    } else if (is_arr(r)) {
        bool member = false;
        for (size_t i = 0; i < r->a->n && !member; i++) member = jv_strict_eq(r->a->v[i], l);
        if (x->op == OP_IN) return BOOLV(member);
        if (x->op == OP_NOTIN) return BOOLV(!member);
    }
    if ((l->t == V_STR || r->t == V_STR) && x->op == OP_ADD) {
        return concat(C, l, r, x);
    }
    if (l->t == V_STR && r->t == V_STR && (x->op == OP_IN || x->op == OP_NOTIN)) {
        bool in = ju_find(r->s, r->n, l->s, l->n) != NULL;
        return BOOLV(x->op == OP_IN ? in : !in);
    }
    if (l->t == V_STR && is_obj(r) && (x->op == OP_IN || x->op == OP_NOTIN)) {
        bool in = jv_get(r->o, l->s, l->n) != NULL;
        return BOOLV(x->op == OP_IN ? in : !in);
    }
    static const char *opn[] = {"and", "or", "not", "==", "!=", "<", ">", "<=", ">=", "in", "not in", "+", "-", "~",
                                "*", "/", "//", "%", "**"};
    jv_fail(C, x, "unsupported operator \"%s\" between %s and %s", opn[x->op], jv_type_names[l->t], jv_type_names[r->t]);
}

/* ---- statements ---- */
static void set_target(struct ctx *C, const struct node *t, val *v, struct env *e, const struct node *at) {
    if (t->kind == N_IDENT) {
        jv_set(C, &e->vars, t->s, t->n, v);
    } else if (t->kind == N_TUPLE) {
        if (!is_arr(v)) jv_fail(C, at, "cannot unpack non-iterable type: %s", jv_type_names[v->t]);
        if (v->a->n != t->n1) jv_fail(C, at, "too %s items to unpack", t->n1 > v->a->n ? "few" : "many");
        for (size_t i = 0; i < t->n1; i++) {
            if (t->l1[i]->kind != N_IDENT) jv_fail(C, at, "cannot unpack to a non-identifier");
        }
        for (size_t i = 0; i < t->n1; i++) jv_set(C, &e->vars, t->l1[i]->s, t->l1[i]->n, v->a->v[i]);
    } else {
        jv_fail(C, at, "invalid assignment target");
    }
}

static val *eval_set(struct ctx *C, const struct node *x, struct env *e) {
    val *rhs = x->b ? jinja_eval(C, x->b, e) : jinja_eval_block(C, x->l1, x->n1, e);
    const struct node *t = x->a;
    if (t->kind == N_MEMBER) {
        val *o = jinja_eval(C, t->a, e);
        if (o->t != V_NS) jv_fail(C, x, "cannot assign attribute on non-namespace object");
        if (t->flag || t->b->kind != N_IDENT) jv_fail(C, x, "cannot assign to member with non-identifier property");
        jv_set(C, o->o, t->b->s, t->b->n, rhs);
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
    val *iter = jinja_eval(C, it, scope);
    if (!is_arr(iter) && !is_obj(iter))
        jv_fail(C, x->b, "expected iterable or object type in for loop: got %s", jv_type_names[iter->t]);
    if (is_obj(iter)) iter = jv_obj_items(C, iter, 1);
    struct arr items = {0};
    for (size_t i = 0; i < iter->a->n; i++) {
        val *cur = iter->a->v[i];
        if (x->a->kind == N_TUPLE) {
            if (!is_arr(cur)) jv_fail(C, x->a, "cannot unpack non-iterable type: %s", jv_type_names[cur->t]);
            if (cur->a->n != x->a->n1) jv_fail(C, x->a, "too %s items to unpack", x->a->n1 > cur->a->n ? "few" : "many");
        }
        if (test) {
            struct env *ls = env_new(C, scope);
            set_target(C, x->a, cur, ls, x);
            if (!jv_truthy(jinja_eval(C, test, ls))) continue;
        }
        jv_push(C, &items, cur);
    }
    struct sb out = {0};
    bool none = true;
    for (size_t i = 0; i < items.n; i++) {
        val *loop = jv_obj(C, V_OBJECT);
        jv_set(C, loop->o, "index", 5, jv_int(C, (int64_t)i + 1));
        jv_set(C, loop->o, "index0", 6, jv_int(C, (int64_t)i));
        jv_set(C, loop->o, "revindex", 8, jv_int(C, (int64_t)(items.n - i)));
        jv_set(C, loop->o, "revindex0", 9, jv_int(C, (int64_t)(items.n - i - 1)));
        jv_set(C, loop->o, "first", 5, BOOLV(i == 0));
        jv_set(C, loop->o, "last", 4, BOOLV(i == items.n - 1));
        jv_set(C, loop->o, "length", 6, jv_int(C, (int64_t)items.n));
        jv_set(C, loop->o, "previtem", 8, i > 0 ? items.v[i - 1] : UNDEF);
        jv_set(C, loop->o, "nextitem", 8, i + 1 < items.n ? items.v[i + 1] : UNDEF);
        jv_set(C, &scope->vars, "loop", 4, loop);
        set_target(C, x->a, items.v[i], scope, x);
        val *body = jinja_eval_block(C, x->l1, x->n1, scope);
        if (C->ctl) {
            int ctl = C->ctl;
            C->ctl = 0;
            if (ctl == 2) continue;
            break;
        }
        jv_sb_put(C, &out, body->s, body->n);
        none = false;
    }
    if (none && x->n2) {
        val *d = jinja_eval_block(C, x->l2, x->n2, scope);
        if (!C->ctl) jv_sb_put(C, &out, d->s, d->n);
    }
    return jv_sb_val(C, &out);
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
        kw = jv_obj(C, V_OBJECT);
        jv_set_all(C, kw->o, src->o);
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
        jv_set(C, &scope->vars, p->s, p->n, v ? v : UNDEF);
    }
    if (body_owner && body_uses(body_owner, "kwargs")) jv_set(C, &scope->vars, "kwargs", 6, kw ? kw : jv_obj(C, V_OBJECT));
    else if (kw && kw->o->n) jv_fail(C, at, "macro %s takes no keyword argument '%.*s'", disp, (int)kw->o->kn[0], kw->o->k[0]);
    if (body_owner && body_uses(body_owner, "varargs")) {
        val *va = jv_arr(C, V_ARRAY);
        for (size_t i = np; i < nargs; i++) jv_push(C, va->a, args[i]);
        jv_set(C, &scope->vars, "varargs", 7, va);
    } else if (nargs > np) {
        jv_fail(C, at, "macro %s takes not more than %zu argument(s)", disp, np);
    }
    for (size_t i = 0; i < np; i++)
        if (pending[i]) jv_set(C, &scope->vars, params[i]->s, params[i]->n, jinja_eval(C, params[i]->a, scope));
}

static val *call_fn(struct ctx *C, val *fnv, val **args, size_t nargs, struct env *e, const struct node *at) {
    if (fnv->t != V_FUNC) jv_fail(C, at, "cannot call something that is not a function: got %s", jv_type_names[fnv->t]);
    struct fn *fn = fnv->fn;
    switch (fn->kind) {
    case F_MACRO:
    case F_CALLER: {
        if (++C->depth > MAX_CALL_DEPTH) jv_fail(C, at, "macro recursion too deep");
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
        r = jinja_eval_block(C, m->l1, m->n1, scope);
        C->depth--;
        return r;
    }
    default: return jv_call_builtin(C, fn, args, nargs, at);
    }
}

/* The N_CALL x: its arguments, then its callee, evaluated in e; the call runs with caller
 * environment ce (a call block passes one holding `caller`, and always a keyword dict). */
static val *eval_call(struct ctx *C, const struct node *x, struct env *e, struct env *ce, bool always_kw,
                      const struct node *at) {
    struct args A;
    jinja_eval_args(C, x->l1, x->n1, e, &A);
    size_t n;
    val **args = jinja_args_flat(C, &A, always_kw, &n);
    val *fn = jinja_eval(C, x->a, e);
    return call_fn(C, fn, args, n, ce, at);
}

static val *eval_member(struct ctx *C, const struct node *x, struct env *e) {
    val *o = jinja_eval(C, x->a, e);
    val *prop;
    if (x->flag) {
        if (x->b->kind == N_SLICE) {
            const struct node *s = x->b;
            if (!is_arr(o) && o->t != V_STR) jv_fail(C, x, "slice object must be an array or string");
            val *vs = s->a ? jinja_eval(C, s->a, e) : UNDEF, *ve = s->b ? jinja_eval(C, s->b, e) : UNDEF,
                *vst = s->c ? jinja_eval(C, s->c, e) : UNDEF;
            if ((vs->t != V_INT && vs->t != V_UNDEF) || (ve->t != V_INT && ve->t != V_UNDEF) ||
                (vst->t != V_INT && vst->t != V_UNDEF))
                jv_fail(C, x, "slice indices must be integers or undefined");
            size_t *idx;
            if (is_arr(o)) {
                size_t cnt = slice_idx(C, o->a->n, vs, ve, vst, &idx);
                val *r = jv_arr(C, V_ARRAY);
                for (size_t i = 0; i < cnt; i++) jv_push(C, r->a, o->a->v[idx[i]]);
                return r;
            }
            size_t nc;
            size_t *off = jv_cp_offsets(C, o->s, o->n, &nc);
            size_t cnt = slice_idx(C, nc, vs, ve, vst, &idx);
            struct sb b = {0};
            for (size_t i = 0; i < cnt; i++) jv_sb_put(C, &b, o->s + off[idx[i]], off[idx[i] + 1] - off[idx[i]]);
            return jv_sb_val(C, &b);
        }
        prop = jinja_eval(C, x->b, e);
    } else if (x->b->kind == N_INT) {
        prop = jv_int(C, x->b->i);
    } else {
        prop = jv_str(C, x->b->s, x->b->n);
    }
    return jv_member(C, o, prop, x);
}

val *jinja_eval(struct ctx *C, const struct node *x, struct env *e) {
    if (!x) return UNDEF;
    jv_step(C, x);
    switch (x->kind) {
    case N_TEXT:
    case N_STR: return jv_str(C, x->s, x->n);
    case N_COMMENT: return NUL;
    case N_INT: return jv_int(C, x->i);
    case N_FLOAT: return jv_float(C, x->f);
    case N_SET: return eval_set(C, x, e);
    case N_IF: {
        bool c = jv_truthy(jinja_eval(C, x->a, e));
        return jinja_eval_block(C, c ? x->l1 : x->l2, c ? x->n1 : x->n2, e);
    }
    case N_FOR: return eval_for(C, x, e);
    case N_MACRO: {
        val *f = jv_fn(C, F_MACRO, NULL, NULL);
        f->fn->node = x;
        jv_set(C, &e->vars, x->a->s, x->a->n, f);
        return NUL;
    }
    case N_CALLBLOCK: {
        val *caller = jv_fn(C, F_CALLER, NULL, NULL);
        caller->fn->node = x;
        caller->fn->env = e;
        struct env *ne = env_new(C, e);
        jv_set(C, &ne->vars, "caller", 6, caller);
        return eval_call(C, x->a, e, ne, true, x);
    }
    case N_FILTERBLOCK: return jinja_filter(C, jinja_eval_block(C, x->l1, x->n1, e), x->a, e);
    case N_BREAK:
    case N_CONTINUE:
        C->ctl = x->kind == N_BREAK ? 1 : 2;
        C->ctl_node = x;
        return NUL;
    case N_ARRAY:
    case N_TUPLE: {
        val *r = jv_arr(C, x->kind == N_ARRAY ? V_ARRAY : V_TUPLE);
        for (size_t i = 0; i < x->n1; i++) jv_push(C, r->a, jinja_eval(C, x->l1[i], e));
        return r;
    }
    case N_OBJECT: {
        val *r = jv_obj(C, V_OBJECT);
        for (size_t i = 0; i < x->n1; i++) {
            val *k = jinja_eval(C, x->l1[i], e);
            if (k->t != V_STR) jv_fail(C, x->l1[i], "object keys must be strings: got %s", jv_type_names[k->t]);
            jv_set(C, r->o, k->s, k->n, jinja_eval(C, x->l2[i], e));
        }
        return r;
    }
    case N_IDENT: return env_lookup(e, x->s, x->n);
    case N_CALL: return eval_call(C, x, e, e, false, x);
    case N_MEMBER: return eval_member(C, x, e);
    case N_UNARY: {
        val *v = jinja_eval(C, x->a, e);
        if (x->op == OP_NOT) return BOOLV(!jv_truthy(v));
        if (!is_num(v) && v->t != V_BOOL) jv_fail(C, x, "unary %c needs a number, got %s", x->op == OP_SUB ? '-' : '+', jv_type_names[v->t]);
        if (v->t == V_FLOAT) return jv_float(C, x->op == OP_SUB ? -v->f : v->f);
        int64_t i = v->t == V_BOOL ? v->b : v->i;
        return jv_int(C, x->op == OP_SUB ? -i : i);
    }
    case N_BINARY: return binary(C, x, e);
    case N_FILTER: return jinja_filter(C, jinja_eval(C, x->a, e), x->b, e);
    case N_TEST: {
        val *v = jinja_eval(C, x->a, e);
        bool r = jv_test(C, x->b->s, x->b->n, v, x);
        return BOOLV(x->flag ? !r : r);
    }
    case N_SELECT: return jv_truthy(jinja_eval(C, x->b, e)) ? jinja_eval(C, x->a, e) : UNDEF;
    case N_TERNARY: return jv_truthy(jinja_eval(C, x->a, e)) ? jinja_eval(C, x->b, e) : jinja_eval(C, x->c, e);
    case N_SLICE:
    case N_KWARG:
    case N_SPREAD:
    case N_KWSPREAD: jv_fail(C, x, "unexpected expression here");
    }
    jv_fail(C, x, "unknown node");
}

val *jinja_eval_block(struct ctx *C, struct node *const *body, size_t n, struct env *e) {
    struct sb b = {0};
    for (size_t i = 0; i < n; i++) {
        const struct node *x = body[i];
        if (x->kind == N_TEXT) {
            jv_sb_put(C, &b, x->s, x->n);
            continue;
        }
        val *v = jinja_eval(C, x, e);
        if (C->ctl) return jv_str(C, "", 0);
        if (!is_nullish(v)) jv_to_str(C, &b, v, x);
    }
    return jv_sb_val(C, &b);
}

kv_status jinja_render(const jinja_template_t *t, const json_t *ctxj, char **out, size_t *out_len, char *err,
                       size_t errlen) {
    if (!t || !out) return kv_errf(KV_EINVAL, err, errlen, "jinja: NULL argument");
    if (ctxj && !json_is_object(ctxj)) return kv_errf(KV_EINVAL, err, errlen, "jinja: the render context must be a JSON object");
    jmp_buf jb;
    struct jarena arena = {.mem = {.limit = JINJA_ARENA_LIMIT}, .jb = &jb, .err = err, .errlen = errlen};
    struct ctx C = {.a = &arena};
    if (setjmp(jb)) {
        kv_status st = arena.st;
        ja_free(&arena);
        return st;
    }
    struct env *g = env_new(&C, NULL);
    jv_set(&C, &g->vars, "namespace", 9, jv_fn(&C, F_NAMESPACE, NULL, NULL));
    jv_set(&C, &g->vars, "false", 5, BOOLV(false));
    jv_set(&C, &g->vars, "true", 4, BOOLV(true));
    jv_set(&C, &g->vars, "none", 4, NUL);
    jv_set(&C, &g->vars, "raise_exception", 15, jv_fn(&C, F_RAISE, NULL, NULL));
    jv_set(&C, &g->vars, "range", 5, jv_fn(&C, F_RANGE, NULL, NULL));
    jv_set(&C, &g->vars, "strftime_now", 12, jv_fn(&C, F_STRFTIME, NULL, NULL));
    jv_set(&C, &g->vars, "True", 4, BOOLV(true));
    jv_set(&C, &g->vars, "False", 5, BOOLV(false));
    jv_set(&C, &g->vars, "None", 4, NUL);
    if (ctxj) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)ctxj, k, v) {
            size_t kl = strlen(k);
            if (jv_get(&g->vars, k, kl)) ja_fail(&arena, KV_EINVAL, 0, 0, "variable already declared: %s", k);
            jv_set(&C, &g->vars, ja_strndup(&arena, k, kl), kl, jv_from_json(&C, v, 0));
        }
    }
    val *r = jinja_eval_block(&C, t->body, t->n, g);
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
