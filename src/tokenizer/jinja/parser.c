/* parser: recursive descent over the reference engine's grammar (same precedence:
 * if-expr < or < and < not < comparison/in < + - ~ < * / // % < ** < is-test < |filter <
 * unary sign < call/member < primary). Errors name the token's line and column. Also the
 * public entry points jinja_parse (lex + parse into one arena) and jinja_free. */
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

#define MAX_DEPTH 256

struct parser {
    struct jarena *a;
    struct token *t;
    size_t n, cur;
    int depth;
};

static const char *tk_name(enum tk t) {
    static const char *names[] = {"text", "number", "string", "identifier", "'='", "'('", "')'", "'{%'", "'%}'",
                                  "'{{'", "'}}'", "'['", "']'", "'{'", "'}'", "','", "'.'", "':'", "'|'",
                                  "additive operator", "multiplicative operator", "'**'", "comparison operator",
                                  "unary operator", "comment"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "token";
}

_Noreturn static void perr(struct parser *P, const char *msg, const char *arg) {
    int line = 0, col = 0;
    if (P->cur < P->n) {
        line = P->t[P->cur].line;
        col = P->t[P->cur].col;
    } else if (P->n) {
        line = P->t[P->n - 1].line;
        col = P->t[P->n - 1].col;
    }
    if (P->cur >= P->n)
        ja_fail(P->a, KV_EINVAL, line, col, "unexpected end of template (%s%s)", msg, arg ? arg : "");
    ja_fail(P->a, KV_EINVAL, line, col, "%s%s", msg, arg ? arg : "");
}

static struct token *peek(struct parser *P, size_t k) { return P->cur + k < P->n ? &P->t[P->cur + k] : NULL; }
static bool is(struct parser *P, enum tk type) {
    struct token *t = peek(P, 0);
    return t && t->type == type;
}
static bool tok_eq(const struct token *t, const char *s) {
    return t && t->type == TK_IDENT && t->n == strlen(s) && !memcmp(t->s, s, t->n);
}
static bool is_ident(struct parser *P, const char *name) { return tok_eq(peek(P, 0), name); }
static bool is_ident2(struct parser *P, const char *a, const char *b) {
    return tok_eq(peek(P, 0), a) && tok_eq(peek(P, 1), b);
}
static bool is_stmt(struct parser *P, const char *name) {
    return is(P, TK_OPEN_STMT) && tok_eq(peek(P, 1), name);
}
static struct token *next(struct parser *P, const char *ctx) {
    if (P->cur >= P->n) perr(P, ctx, NULL);
    return &P->t[P->cur++];
}
static struct token *expect(struct parser *P, enum tk type, const char *what) {
    struct token *t = peek(P, 0);
    if (!t) perr(P, "expected ", what);
    if (t->type != type) {
        char msg[128];
        snprintf(msg, sizeof msg, "expected %s, got %s", what, tk_name(t->type));
        perr(P, msg, NULL);
    }
    P->cur++;
    return t;
}
static void expect_ident(struct parser *P, const char *name) {
    if (!is_ident(P, name)) perr(P, "expected ", name);
    P->cur++;
}

static struct node *mk(struct parser *P, enum nk kind, const struct token *at) {
    struct node *n = ja_alloc(P->a, sizeof *n);
    n->kind = kind;
    if (!at) at = peek(P, 0) ? peek(P, 0) : (P->cur ? &P->t[P->cur - 1] : NULL);
    if (at) {
        n->line = at->line;
        n->col = at->col;
    }
    return n;
}

/* growable node lists in the arena */
struct nlist {
    struct node **v;
    size_t n, cap;
};
static void nl_push(struct parser *P, struct nlist *l, struct node *x) {
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 8;
        struct node **v = ja_alloc(P->a, nc * sizeof *v);
        if (l->n) memcpy(v, l->v, l->n * sizeof *v);
        l->v = v;
        l->cap = nc;
    }
    l->v[l->n++] = x;
}

static struct node *parse_any(struct parser *P);
static struct node *parse_expr(struct parser *P);
static struct node *parse_primary(struct parser *P);
static struct node *parse_or(struct parser *P);

static void enter(struct parser *P) {
    if (++P->depth > MAX_DEPTH) perr(P, "template nested too deeply", NULL);
}

static void parse_until(struct parser *P, struct nlist *body, const char *s1, const char *s2, const char *s3) {
    for (;;) {
        if (P->cur >= P->n) {
            char msg[96];
            snprintf(msg, sizeof msg, "missing {%% %s %%}", s1);
            perr(P, msg, NULL);
        }
        if (is_stmt(P, s1) || (s2 && is_stmt(P, s2)) || (s3 && is_stmt(P, s3))) return;
        nl_push(P, body, parse_any(P));
    }
}

static struct node *parse_expr_seq(struct parser *P, bool primary) {
    struct token *at = peek(P, 0);
    struct node *first = primary ? parse_primary(P) : parse_expr(P);
    if (!is(P, TK_COMMA)) return first;
    struct nlist l = {0};
    nl_push(P, &l, first);
    while (is(P, TK_COMMA)) {
        P->cur++;
        nl_push(P, &l, primary ? parse_primary(P) : parse_expr(P));
        if (!is(P, TK_COMMA)) break;
    }
    struct node *t = mk(P, N_TUPLE, at);
    t->l1 = l.v;
    t->n1 = l.n;
    return t;
}

/* mode: 0 call, 1 parameters */
static void parse_args(struct parser *P, int mode, struct node ***out, size_t *nout) {
    expect(P, TK_LPAREN, "'(' for arguments");
    struct nlist l = {0};
    bool saw_kw = false, saw_spread = false;
    while (!is(P, TK_RPAREN)) {
        if (P->cur >= P->n) perr(P, "expected ')'", NULL);
        struct token *at = peek(P, 0);
        bool kwspread = is(P, TK_POW);
        bool spread = is(P, TK_MUL) && at->n == 1 && at->s[0] == '*';
        if (mode == 1 && (kwspread || spread)) perr(P, "argument unpacking is not allowed in parameter declarations", NULL);
        if (kwspread) {
            P->cur++;
            struct node *x = mk(P, N_KWSPREAD, at);
            x->a = parse_expr(P);
            nl_push(P, &l, x);
            if (is(P, TK_COMMA)) P->cur++;
            if (!is(P, TK_RPAREN)) perr(P, "`**` must be applied to the final argument", NULL);
            break;
        }
        struct node *arg;
        if (spread) {
            if (saw_spread) perr(P, "only one `*` argument unpacking is allowed", NULL);
            saw_spread = true;
            P->cur++;
            arg = mk(P, N_SPREAD, at);
            arg->a = parse_expr(P);
        } else {
            arg = parse_expr(P);
            if (is(P, TK_EQUALS)) {
                P->cur++;
                if (arg->kind != N_IDENT)
                    perr(P, mode ? "expected identifier for parameter declaration" : "expected identifier for keyword argument", NULL);
                struct node *kw = mk(P, N_KWARG, at);
                kw->s = arg->s;
                kw->n = arg->n;
                kw->a = parse_expr(P);
                arg = kw;
            }
            if (mode == 1) {
                if (arg->kind != N_IDENT && arg->kind != N_KWARG) perr(P, "expected identifier for parameter declaration", NULL);
                for (size_t k = 0; k < l.n; k++)
                    if (l.v[k]->n == arg->n && !memcmp(l.v[k]->s, arg->s, arg->n)) perr(P, "duplicate parameter name", NULL);
            }
            if (arg->kind == N_KWARG) saw_kw = true;
            else if (saw_kw) perr(P, mode ? "non-default argument follows default argument" : "positional arguments must come before keyword arguments", NULL);
            else if (saw_spread) perr(P, "positional arguments must not follow `*` argument unpacking", NULL);
        }
        nl_push(P, &l, arg);
        if (is(P, TK_COMMA)) P->cur++;
    }
    expect(P, TK_RPAREN, "')'");
    *out = l.v;
    *nout = l.n;
}

static struct node *parse_member(struct parser *P, struct node *obj);

static struct node *parse_call(struct parser *P, struct node *callee) {
    enter(P);
    struct node *c = mk(P, N_CALL, NULL);
    c->line = callee->line;
    c->col = callee->col;
    c->a = callee;
    parse_args(P, 0, &c->l1, &c->n1);
    struct node *e = parse_member(P, c);
    if (is(P, TK_LPAREN)) e = parse_call(P, e);
    P->depth--;
    return e;
}

static struct node *parse_member_args(struct parser *P) {
    struct node *sl[4] = {0};
    size_t n = 0;
    bool slice = false;
    struct token *at = peek(P, 0);
    while (!is(P, TK_RBRACKET)) {
        if (P->cur >= P->n) perr(P, "expected ']'", NULL);
        if (n >= 4) perr(P, "expected 0-3 arguments for slice expression", NULL);
        if (is(P, TK_COLON)) {
            sl[n++] = NULL;
            P->cur++;
            slice = true;
        } else {
            sl[n++] = parse_expr(P);
            if (is(P, TK_COLON)) {
                P->cur++;
                slice = true;
            }
        }
    }
    if (n == 0) perr(P, "expected at least one argument for member/slice expression", NULL);
    if (!slice) return sl[0];
    if (n > 3) perr(P, "expected 0-3 arguments for slice expression", NULL);
    struct node *s = mk(P, N_SLICE, at);
    s->a = sl[0];
    s->b = n > 1 ? sl[1] : NULL;
    s->c = n > 2 ? sl[2] : NULL;
    return s;
}

static struct node *parse_member(struct parser *P, struct node *obj) {
    while (is(P, TK_DOT) || is(P, TK_LBRACKET)) {
        struct token *op = next(P, "member");
        struct node *m = mk(P, N_MEMBER, op);
        m->a = obj;
        m->flag = op->type == TK_LBRACKET;
        if (m->flag) {
            enter(P);
            m->b = parse_member_args(P);
            P->depth--;
            expect(P, TK_RBRACKET, "']'");
        } else {
            m->b = parse_primary(P);
            if (m->b->kind != N_IDENT && m->b->kind != N_INT) perr(P, "expected identifier or integer following '.'", NULL);
        }
        obj = m;
    }
    return obj;
}

static struct node *parse_call_member(struct parser *P) {
    struct node *m = parse_member(P, parse_primary(P));
    if (is(P, TK_LPAREN)) return parse_call(P, m);
    return m;
}

static struct node *parse_unary_sign(struct parser *P) {
    struct token *t = peek(P, 0);
    if (t && (t->type == TK_UNARY || t->type == TK_ADD) && t->n == 1 && (t->s[0] == '-' || t->s[0] == '+')) {
        enter(P);
        P->cur++;
        struct node *u = mk(P, N_UNARY, t);
        u->op = t->s[0] == '-' ? OP_SUB : OP_ADD;
        u->a = parse_unary_sign(P);
        P->depth--;
        return u;
    }
    return parse_call_member(P);
}

static struct node *parse_filter(struct parser *P) {
    struct node *operand = parse_unary_sign(P);
    while (is(P, TK_PIPE)) {
        struct token *at = next(P, "filter");
        struct node *f = parse_primary(P);
        if (f->kind != N_IDENT) perr(P, "expected identifier for the filter", NULL);
        if (is(P, TK_LPAREN)) f = parse_call(P, f);
        struct node *x = mk(P, N_FILTER, at);
        x->a = operand;
        x->b = f;
        operand = x;
    }
    return operand;
}

static struct node *parse_test(struct parser *P) {
    struct node *operand = parse_filter(P);
    while (is_ident(P, "is")) {
        struct token *at = next(P, "test");
        bool neg = is_ident(P, "not");
        if (neg) P->cur++;
        struct node *name = parse_primary(P);
        if (name->kind != N_IDENT) perr(P, "expected identifier for the test", NULL);
        struct node *x = mk(P, N_TEST, at);
        x->a = operand;
        x->b = name;
        x->flag = neg;
        operand = x;
    }
    return operand;
}

static struct node *binary(struct parser *P, struct token *at, enum op op, struct node *l, struct node *r) {
    struct node *b = mk(P, N_BINARY, at);
    b->op = op;
    b->a = l;
    b->b = r;
    return b;
}

static struct node *parse_pow(struct parser *P) {
    struct node *l = parse_test(P);
    while (is(P, TK_POW)) {
        struct token *at = next(P, "**");
        l = binary(P, at, OP_POW, l, parse_test(P));
    }
    return l;
}

static struct node *parse_mul(struct parser *P) {
    struct node *l = parse_pow(P);
    while (is(P, TK_MUL)) {
        struct token *at = next(P, "operator");
        enum op op = at->n == 2 ? OP_FLOORDIV : at->s[0] == '*' ? OP_MUL : at->s[0] == '/' ? OP_DIV : OP_MOD;
        l = binary(P, at, op, l, parse_pow(P));
    }
    return l;
}

static struct node *parse_add(struct parser *P) {
    struct node *l = parse_mul(P);
    while (is(P, TK_ADD)) {
        struct token *at = next(P, "operator");
        enum op op = at->s[0] == '+' ? OP_ADD : at->s[0] == '-' ? OP_SUB : OP_CONCAT;
        l = binary(P, at, op, l, parse_mul(P));
    }
    return l;
}

static struct node *parse_cmp(struct parser *P) {
    struct node *l = parse_add(P);
    for (;;) {
        struct token *at = peek(P, 0);
        enum op op;
        if (is_ident2(P, "not", "in")) {
            op = OP_NOTIN;
            P->cur += 2;
        } else if (is_ident(P, "in")) {
            op = OP_IN;
            P->cur++;
        } else if (is(P, TK_CMP)) {
            P->cur++;
            op = at->s[0] == '=' ? OP_EQ : at->s[0] == '!' ? OP_NE : at->s[0] == '<' ? (at->n == 2 ? OP_LE : OP_LT)
                                                                                  : (at->n == 2 ? OP_GE : OP_GT);
        } else {
            break;
        }
        l = binary(P, at, op, l, parse_add(P));
    }
    return l;
}

static struct node *parse_not(struct parser *P) {
    struct node *right = NULL;
    while (is_ident(P, "not")) {
        enter(P);
        struct token *at = next(P, "not");
        struct node *u = mk(P, N_UNARY, at);
        u->op = OP_NOT;
        u->a = parse_not(P);
        P->depth--;
        right = u;
    }
    return right ? right : parse_cmp(P);
}

static struct node *parse_and(struct parser *P) {
    struct node *l = parse_not(P);
    while (is_ident(P, "and")) {
        struct token *at = next(P, "and");
        l = binary(P, at, OP_AND, l, parse_not(P));
    }
    return l;
}

static struct node *parse_or(struct parser *P) {
    struct node *l = parse_and(P);
    while (is_ident(P, "or")) {
        struct token *at = next(P, "or");
        l = binary(P, at, OP_OR, l, parse_and(P));
    }
    return l;
}

static struct node *parse_ifexpr(struct parser *P) {
    enter(P);
    struct node *a = parse_or(P);
    if (is_ident(P, "if")) {
        struct token *at = next(P, "if");
        struct node *test = parse_or(P);
        if (is_ident(P, "else")) {
            P->cur++;
            struct node *t = mk(P, N_TERNARY, at);
            t->a = test;
            t->b = a;
            t->c = parse_ifexpr(P);
            a = t;
        } else {
            struct node *s = mk(P, N_SELECT, at);
            s->a = a;
            s->b = test;
            a = s;
        }
    }
    P->depth--;
    return a;
}

static struct node *parse_expr(struct parser *P) { return parse_ifexpr(P); }

static struct node *parse_primary(struct parser *P) {
    struct token *t = next(P, "expected an expression");
    switch (t->type) {
    case TK_NUM: {
        char buf[64];
        size_t n = t->n < sizeof buf - 1 ? t->n : sizeof buf - 1;
        memcpy(buf, t->s, n);
        buf[n] = 0;
        if (memchr(t->s, '.', t->n)) {
            struct node *x = mk(P, N_FLOAT, t);
            x->f = strtod(buf, NULL);
            return x;
        }
        struct node *x = mk(P, N_INT, t);
        double d = strtod(buf, NULL);
        if (d > 9.2e18 || d < -9.2e18) {
            x->kind = N_FLOAT; /* beyond int64: a JavaScript number anyway */
            x->f = d;
        } else {
            x->i = strtoll(buf, NULL, 10);
        }
        return x;
    }
    case TK_STR: {
        size_t total = t->n;
        size_t k = P->cur;
        while (k < P->n && P->t[k].type == TK_STR) total += P->t[k++].n;
        struct node *x = mk(P, N_STR, t);
        if (k == P->cur) {
            x->s = t->s;
            x->n = t->n;
            return x;
        }
        char *s = ja_alloc(P->a, total + 1);
        memcpy(s, t->s, t->n);
        size_t o = t->n;
        while (P->cur < k) {
            memcpy(s + o, P->t[P->cur].s, P->t[P->cur].n);
            o += P->t[P->cur++].n;
        }
        x->s = s;
        x->n = o;
        return x;
    }
    case TK_IDENT: {
        struct node *x = mk(P, N_IDENT, t);
        x->s = t->s;
        x->n = t->n;
        return x;
    }
    case TK_LPAREN: {
        enter(P);
        struct node *e = parse_expr_seq(P, false);
        expect(P, TK_RPAREN, "')'");
        P->depth--;
        return e;
    }
    case TK_LBRACKET: {
        enter(P);
        struct nlist l = {0};
        while (!is(P, TK_RBRACKET)) {
            if (P->cur >= P->n) perr(P, "expected ']'", NULL);
            nl_push(P, &l, parse_expr(P));
            if (is(P, TK_COMMA)) P->cur++;
        }
        P->cur++;
        P->depth--;
        struct node *x = mk(P, N_ARRAY, t);
        x->l1 = l.v;
        x->n1 = l.n;
        return x;
    }
    case TK_LBRACE: {
        enter(P);
        struct nlist k = {0}, v = {0};
        while (!is(P, TK_RBRACE)) {
            if (P->cur >= P->n) perr(P, "expected '}'", NULL);
            nl_push(P, &k, parse_expr(P));
            expect(P, TK_COLON, "':' between key and value in a dict literal");
            nl_push(P, &v, parse_expr(P));
            if (is(P, TK_COMMA)) P->cur++;
        }
        P->cur++;
        P->depth--;
        struct node *x = mk(P, N_OBJECT, t);
        x->l1 = k.v;
        x->n1 = k.n;
        x->l2 = v.v;
        x->n2 = v.n;
        return x;
    }
    default: P->cur--; perr(P, "unexpected token: ", tk_name(t->type));
    }
}

static void close_block(struct parser *P, const char *end) {
    expect(P, TK_OPEN_STMT, "'{%'");
    expect_ident(P, end);
    expect(P, TK_CLOSE_STMT, "'%}'");
}

static struct node *parse_if(struct parser *P, struct token *at) {
    enter(P);
    struct node *x = mk(P, N_IF, at);
    x->a = parse_expr(P);
    expect(P, TK_CLOSE_STMT, "'%}'");
    struct nlist body = {0}, alt = {0};
    parse_until(P, &body, "endif", "elif", "else");
    if (is_stmt(P, "elif")) {
        struct token *el = peek(P, 1);
        P->cur += 2;
        nl_push(P, &alt, parse_if(P, el));
    } else if (is_stmt(P, "else")) {
        P->cur += 2;
        expect(P, TK_CLOSE_STMT, "'%}'");
        parse_until(P, &alt, "endif", NULL, NULL);
    }
    x->l1 = body.v;
    x->n1 = body.n;
    x->l2 = alt.v;
    x->n2 = alt.n;
    P->depth--;
    return x;
}

static struct node *parse_stmt(struct parser *P) {
    expect(P, TK_OPEN_STMT, "'{%'");
    struct token *t = peek(P, 0);
    if (!t || t->type != TK_IDENT) perr(P, "expected a statement name after '{%'", NULL);
    P->cur++;
    enter(P);
    struct node *x;
    struct nlist body = {0}, alt = {0};
    if (tok_eq(t, "set")) {
        x = mk(P, N_SET, t);
        x->a = parse_expr_seq(P, false);
        if (is(P, TK_EQUALS)) {
            P->cur++;
            x->b = parse_expr_seq(P, false);
        } else {
            expect(P, TK_CLOSE_STMT, "'%}' or '='");
            parse_until(P, &body, "endset", NULL, NULL);
            expect(P, TK_OPEN_STMT, "'{%'");
            expect_ident(P, "endset");
        }
        expect(P, TK_CLOSE_STMT, "'%}'");
    } else if (tok_eq(t, "if")) {
        x = parse_if(P, t);
        close_block(P, "endif");
    } else if (tok_eq(t, "macro")) {
        x = mk(P, N_MACRO, t);
        x->a = parse_primary(P);
        if (x->a->kind != N_IDENT) perr(P, "expected identifier following macro", NULL);
        parse_args(P, 1, &x->l2, &x->n2);
        expect(P, TK_CLOSE_STMT, "'%}'");
        parse_until(P, &body, "endmacro", NULL, NULL);
        close_block(P, "endmacro");
    } else if (tok_eq(t, "for")) {
        x = mk(P, N_FOR, t);
        x->a = parse_expr_seq(P, true);
        if (x->a->kind != N_IDENT && x->a->kind != N_TUPLE) perr(P, "expected identifier/tuple for the loop variable", NULL);
        if (!is_ident(P, "in")) perr(P, "expected 'in' after the loop variable", NULL);
        P->cur++;
        x->b = parse_expr(P);
        expect(P, TK_CLOSE_STMT, "'%}'");
        parse_until(P, &body, "endfor", "else", NULL);
        if (is_stmt(P, "else")) {
            P->cur += 2;
            expect(P, TK_CLOSE_STMT, "'%}'");
            parse_until(P, &alt, "endfor", NULL, NULL);
        }
        close_block(P, "endfor");
    } else if (tok_eq(t, "call")) {
        x = mk(P, N_CALLBLOCK, t);
        if (is(P, TK_LPAREN)) parse_args(P, 1, &x->l2, &x->n2);
        struct node *callee = parse_primary(P);
        if (callee->kind != N_IDENT) perr(P, "expected identifier following call", NULL);
        struct node *c = mk(P, N_CALL, t);
        c->a = callee;
        parse_args(P, 0, &c->l1, &c->n1);
        x->a = c;
        expect(P, TK_CLOSE_STMT, "'%}'");
        parse_until(P, &body, "endcall", NULL, NULL);
        close_block(P, "endcall");
    } else if (tok_eq(t, "break") || tok_eq(t, "continue")) {
        x = mk(P, tok_eq(t, "break") ? N_BREAK : N_CONTINUE, t);
        expect(P, TK_CLOSE_STMT, "'%}'");
    } else if (tok_eq(t, "filter")) {
        x = mk(P, N_FILTERBLOCK, t);
        struct node *f = parse_primary(P);
        if (f->kind == N_IDENT && is(P, TK_LPAREN)) f = parse_call(P, f);
        x->a = f;
        expect(P, TK_CLOSE_STMT, "'%}'");
        parse_until(P, &body, "endfilter", NULL, NULL);
        close_block(P, "endfilter");
    } else {
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)(t->n < 60 ? t->n : 60), t->s);
        P->cur--;
        perr(P, "unsupported statement: ", name);
    }
    if (body.n) {
        x->l1 = body.v;
        x->n1 = body.n;
    }
    if (alt.n) {
        x->l2 = alt.v;
        x->n2 = alt.n;
    }
    P->depth--;
    return x;
}

static struct node *parse_any(struct parser *P) {
    struct token *t = peek(P, 0);
    switch (t->type) {
    case TK_COMMENT: {
        P->cur++;
        return mk(P, N_COMMENT, t);
    }
    case TK_TEXT: {
        P->cur++;
        struct node *x = mk(P, N_TEXT, t);
        x->s = t->s;
        x->n = t->n;
        return x;
    }
    case TK_OPEN_STMT: return parse_stmt(P);
    case TK_OPEN_EXPR: {
        P->cur++;
        struct node *e = parse_expr(P);
        expect(P, TK_CLOSE_EXPR, "'}}'");
        return e;
    }
    default: perr(P, "unexpected token: ", tk_name(t->type));
    }
}

void jinja_parse_tokens(struct jarena *a, struct token *toks, size_t n, struct node ***body, size_t *nbody) {
    struct parser P = {.a = a, .t = toks, .n = n};
    struct nlist l = {0};
    while (P.cur < P.n) nl_push(&P, &l, parse_any(&P));
    *body = l.v;
    *nbody = l.n;
}

/* ---- entry points ---- */
kv_status jinja_parse(const char *src, size_t len, jinja_template_t **out, char *err, size_t errlen) {
    if (!src || !out) return kv_errf(KV_EINVAL, err, errlen, "jinja: NULL argument");
    jinja_template_t *t = calloc(1, sizeof *t);
    if (!t) return kv_errf(KV_ENOMEM, err, errlen, "jinja: out of memory");
    jmp_buf jb;
    t->arena.mem.limit = JINJA_ARENA_LIMIT;
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
