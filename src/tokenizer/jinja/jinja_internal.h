/* jinja_internal: arena, tokens, AST and runtime values shared by the interpreter's files.
 *
 * Files: value.c (arena, text helpers, runtime values), lexer.c, parser.c (AST, jinja_parse),
 * eval.c (statements, expressions, environments, jinja_render), filters.c (the `|` filters),
 * methods.c (member access, str/dict methods, `is` tests, global functions), convert.c
 * (values to text: printing, tojson; text to numbers; JSON context to values).
 *
 * Memory: everything a parse or a render allocates comes from one arena (struct jarena)
 * freed in one call; errors unwind with longjmp to the entry point (jinja_parse or
 * jinja_render), which frees the arena, so no partial state survives a failure. */
#ifndef KV_JINJA_INTERNAL_H
#define KV_JINJA_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stdint.h>

#include "jinja.h"

#define JINJA_ARENA_LIMIT ((size_t)256 << 20) /* bytes, per parse and per render */

/* ---- arena with a byte limit; on exhaustion or error, longjmp to *jb ---- */
struct jarena {
    struct kv_arena mem; /* mem.limit: bytes */
    jmp_buf *jb;
    char *err; size_t errlen;
    kv_status st;
};
void *ja_alloc(struct jarena *a, size_t n);          /* zeroed */
char *ja_strndup(struct jarena *a, const char *s, size_t n);
void ja_free(struct jarena *a);
_Noreturn void ja_fail(struct jarena *a, kv_status st, int line, int col, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* ---- text helpers (value.c) ---- */
/* Byte length of the JavaScript whitespace character (\s) at s[0..n), 0 if none. */
size_t ju_space(const char *s, size_t n);
/* [*start, *end): s[0..n) without leading (left) and/or trailing (right) ju_space characters. */
void ju_trim(const char *s, size_t n, bool left, bool right, size_t *start, size_t *end);
/* Decodes one UTF-8 code point (invalid bytes decode as themselves, length 1). */
size_t ju_decode(const char *s, size_t n, uint32_t *cp);
/* Appends the UTF-8 encoding of cp (1..4 bytes) to p; returns the length. */
size_t ju_encode(uint32_t cp, char *p);

/* ---- tokens (the reference lexer's token types) ---- */
enum tk {
    TK_TEXT, TK_NUM, TK_STR, TK_IDENT, TK_EQUALS, TK_LPAREN, TK_RPAREN, TK_OPEN_STMT, TK_CLOSE_STMT,
    TK_OPEN_EXPR, TK_CLOSE_EXPR, TK_LBRACKET, TK_RBRACKET, TK_LBRACE, TK_RBRACE, TK_COMMA, TK_DOT,
    TK_COLON, TK_PIPE, TK_ADD, TK_MUL, TK_POW, TK_CMP, TK_UNARY, TK_COMMENT
};
struct token {
    enum tk type;
    const char *s; size_t n; /* value (arena) */
    int line, col;
};
/* Tokenizes (after trim_blocks/lstrip_blocks preprocessing). */
void jinja_lex(struct jarena *a, const char *src, size_t len, struct token **out, size_t *n);

/* ---- AST ---- */
enum nk {
    N_TEXT, N_IF, N_FOR, N_SET, N_MACRO, N_CALLBLOCK, N_FILTERBLOCK, N_BREAK, N_CONTINUE, N_COMMENT,
    N_INT, N_FLOAT, N_STR, N_ARRAY, N_TUPLE, N_OBJECT, N_IDENT, N_MEMBER, N_SLICE, N_CALL, N_UNARY,
    N_BINARY, N_FILTER, N_TEST, N_SELECT, N_TERNARY, N_KWARG, N_SPREAD, N_KWSPREAD
};
enum op {
    OP_AND, OP_OR, OP_NOT, OP_EQ, OP_NE, OP_LT, OP_GT, OP_LE, OP_GE, OP_IN, OP_NOTIN, OP_ADD, OP_SUB,
    OP_CONCAT, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW
};
struct node {
    enum nk kind;
    int line, col;
    const char *s; size_t n; /* N_STR/N_TEXT value, N_IDENT name, N_KWARG key, N_COMMENT */
    int64_t i;               /* N_INT */
    double f;                /* N_FLOAT */
    enum op op;              /* N_UNARY / N_BINARY */
    bool flag;               /* N_MEMBER: computed; N_TEST: negated; N_OBJECT: - */
    struct node *a, *b, *c;  /* operands: member (obj, prop), slice (start, stop, step), if test,
                                for (loopvar, iterable), set (assignee, value), ternary (cond, t, f),
                                filter (operand, filter), test (operand, name ident), call (callee),
                                macro (name), callblock (call), filterblock (filter) */
    struct node **l1; size_t n1; /* body, args, elements, object keys */
    struct node **l2; size_t n2; /* else / for-else body, object values, call-block caller params */
};
struct jinja_template {
    struct jarena arena;
    struct node **body; size_t n;
};
void jinja_parse_tokens(struct jarena *a, struct token *toks, size_t n, struct node ***body, size_t *nbody);


/* ---- runtime values (value.c) ----
 * Every value, container and string a render creates lives in the render's arena; values
 * are never freed one by one. Strings are byte ranges (s, n), not NUL-terminated. */
enum vt { V_UNDEF, V_NULL, V_BOOL, V_INT, V_FLOAT, V_STR, V_ARRAY, V_TUPLE, V_OBJECT, V_KWARGS, V_NS, V_FUNC };
extern const char *const jv_type_names[]; /* the reference engine's class names, by enum vt */

typedef struct val val;
struct arr {
    val **v;
    size_t n, cap;
};
struct obj { /* insertion-ordered map; keys are borrowed (arena or template text) */
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
    struct arr *a; /* V_ARRAY, V_TUPLE */
    struct obj *o; /* V_OBJECT, V_KWARGS, V_NS */
    struct fn *fn; /* V_FUNC */
};
/* One render's state. */
struct ctx {
    struct jarena *a;
    uint64_t steps;
    int depth;
    int ctl; /* 1 break, 2 continue */
    const struct node *ctl_node;
};
/* Growable string in the arena; {0} is empty. Fails with KV_ETOOLONG past the output limit. */
struct sb {
    char *s;
    size_t n, cap;
};

/* Shared constants: never modified. */
extern val jv_undef_v, jv_null_v, jv_true_v, jv_false_v;
#define UNDEF (&jv_undef_v)
#define NUL (&jv_null_v)
#define BOOLV(x) ((x) ? &jv_true_v : &jv_false_v)

static inline bool is_arr(const val *v) { return v->t == V_ARRAY || v->t == V_TUPLE; }
static inline bool is_obj(const val *v) { return v->t == V_OBJECT || v->t == V_KWARGS; }
static inline bool is_attr_container(const val *v) { return is_obj(v) || v->t == V_NS; }
static inline bool is_num(const val *v) { return v->t == V_INT || v->t == V_FLOAT; }
static inline bool is_nullish(const val *v) { return v->t == V_UNDEF || v->t == V_NULL; }
static inline double num(const val *v) { return v->t == V_INT ? (double)v->i : v->t == V_FLOAT ? v->f : v->t == V_BOOL ? v->b : 0; }

/* Counts one evaluation step; past JINJA_MAX_STEPS the render fails with KV_ETOOLONG. */
#define JINJA_MAX_STEPS 20000000ull
static inline void jv_step(struct ctx *C, const struct node *at) {
    if (++C->steps > JINJA_MAX_STEPS) ja_fail(C->a, KV_ETOOLONG, at->line, at->col, "template exceeds the evaluation step limit");
}

/* Template error (KV_EINVAL) at node `at` (NULL: no position); unwinds the render. */
_Noreturn void jv_fail(struct ctx *C, const struct node *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

val *jv_new(struct ctx *C, enum vt t);
val *jv_int(struct ctx *C, int64_t i);
val *jv_float(struct ctx *C, double f);
val *jv_str(struct ctx *C, const char *s, size_t n); /* borrows s */
val *jv_strdup(struct ctx *C, const char *s, size_t n);
val *jv_arr(struct ctx *C, enum vt t); /* empty V_ARRAY / V_TUPLE */
val *jv_obj(struct ctx *C, enum vt t); /* empty V_OBJECT / V_KWARGS / V_NS */
val *jv_fn(struct ctx *C, enum fk kind, const char *name, val *self);
void jv_push(struct ctx *C, struct arr *a, val *x);
val *jv_get(const struct obj *o, const char *k, size_t kn); /* NULL when absent */
void jv_set(struct ctx *C, struct obj *o, const char *k, size_t kn, val *x);
void jv_set_all(struct ctx *C, struct obj *dst, const struct obj *src); /* jv_set of each entry */

void jv_sb_put(struct ctx *C, struct sb *b, const char *s, size_t n);
void jv_sb_puts(struct ctx *C, struct sb *b, const char *s);
val *jv_sb_val(struct ctx *C, struct sb *b);

bool jv_truthy(const val *v);
bool jv_strict_eq(const val *x, const val *y); /* JavaScript === */
bool jv_loose_eq(const val *x, const val *y);  /* JavaScript ==, what `==` does */
/* <0, 0, >0 as the reference's sort comparator; fails on incomparable types. */
int jv_compare(struct ctx *C, const val *x, const val *y, bool case_sensitive, const struct node *at);
/* Stable sort of v[0..n) by keys[i] (the key of the item originally at i). */
void jv_sort(struct ctx *C, val **v, size_t n, const val *const *keys, bool cs, bool rev, const struct node *at);

/* Text operations on values. */
size_t ju_utf16_len(const char *s, size_t n);   /* JavaScript .length */
const char *ju_find(const char *s, size_t n, const char *p, size_t pn); /* memmem; "" found at s */
/* Byte offsets of each code point start, plus n at [*count]. */
size_t *jv_cp_offsets(struct ctx *C, const char *s, size_t n, size_t *count);
val *jv_case_map(struct ctx *C, const val *v, bool upper);
val *jv_trim(struct ctx *C, const val *v, bool left, bool right); /* JavaScript trim (\s) */

/* ---- conversions (convert.c) ---- */
void jv_to_str(struct ctx *C, struct sb *b, const val *v, const struct node *at);  /* {{ v }} */
void jv_raw_str(struct ctx *C, struct sb *b, const val *v, const struct node *at); /* JS String(v): ~ and + */
/* tojson with Python's json.dumps options; undefined prints as null. */
val *jv_tojson(struct ctx *C, const val *v, int indent, bool ascii, bool sort, const char *isep, const char *ksep,
               const struct node *at);
double ju_to_number(const char *s, size_t n);               /* JavaScript Number(s) */
int64_t ju_parse_int(const char *s, size_t n, bool *ok);   /* parseInt(s, 10) */
double ju_parse_float(const char *s, size_t n, bool *ok);  /* parseFloat(s) */
val *jv_from_json(struct ctx *C, const json_t *j, int depth);

/* ---- members, methods, tests, global functions (methods.c) ---- */
val *jv_member(struct ctx *C, val *o, val *prop, const struct node *at); /* o.prop / o[prop]; UNDEF if absent */
val *jv_str_method(struct ctx *C, val *self, const char *name, val **args, size_t nargs, const struct node *at);
val *jv_obj_method(struct ctx *C, val *self, const char *name, val **args, size_t nargs, const struct node *at);
const char *jv_obj_method_name(const char *s, size_t n); /* interned name, or NULL if not a dict method */
val *jv_obj_items(struct ctx *C, const val *o, int which);   /* 0 (key, value) pairs, 1 keys, 2 values */
bool jv_test(struct ctx *C, const char *name, size_t n, val *v, const struct node *at); /* v is <name> */
/* Calls a builtin function value (kinds other than F_MACRO / F_CALLER). */
val *jv_call_builtin(struct ctx *C, struct fn *fn, val **args, size_t nargs, const struct node *at);

/* ---- evaluation (eval.c) and filters (filters.c) ---- */
/* Call arguments: positional in order (spreads expanded), keywords in a V_KWARGS (NULL if none). */
struct args {
    val **pos;
    size_t npos;
    val *kw;
};
val *jinja_eval(struct ctx *C, const struct node *x, struct env *e);
val *jinja_eval_block(struct ctx *C, struct node *const *body, size_t n, struct env *e); /* V_STR */
void jinja_eval_args(struct ctx *C, struct node *const *l, size_t n, struct env *e, struct args *out);
/* The flat argument vector builtins take: positional, then the V_KWARGS when there is one (or,
 * with always_kw, an empty one). *n receives the count. */
val **jinja_args_flat(struct ctx *C, const struct args *A, bool always_kw, size_t *n);
/* v | f, where f is the filter's N_IDENT or N_CALL node. */
val *jinja_filter(struct ctx *C, val *v, const struct node *f, struct env *e);

#endif
