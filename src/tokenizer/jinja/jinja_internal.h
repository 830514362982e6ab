/* jinja_internal: arena, tokens, AST and runtime values shared by the interpreter's files.
 *
 * Memory: everything a parse or a render allocates comes from one arena (struct jarena)
 * freed in one call; errors unwind with longjmp to the entry point (jinja_parse or
 * jinja_render), which frees the arena, so no partial state survives a failure. */
#ifndef KV_JINJA_INTERNAL_H
#define KV_JINJA_INTERNAL_H

#include <setjmp.h>

#include "jinja.h"

/* ---- arena with a byte limit; on exhaustion or error, longjmp to *jb ---- */
struct jchunk;
struct jarena {
    struct jchunk *head;
    size_t used, limit; /* bytes */
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

#endif
