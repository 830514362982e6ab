/* value: the arena, error unwinding, and text helpers (JavaScript whitespace, UTF-8). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

struct jchunk {
    struct jchunk *next;
    size_t used, cap;
    max_align_t data[];
};

void *ja_alloc(struct jarena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (!n) n = 16;
    struct jchunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->used + cap > a->limit) ja_fail(a, KV_ETOOLONG, 0, 0, "template uses more than %zu MiB of memory", a->limit >> 20);
        c = malloc(sizeof *c + cap);
        if (!c) ja_fail(a, KV_ENOMEM, 0, 0, "out of memory");
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->used += cap;
    }
    void *p = (char *)c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *ja_strndup(struct jarena *a, const char *s, size_t n) {
    char *p = ja_alloc(a, n + 1);
    if (n) memcpy(p, s, n);
    return p;
}

void ja_free(struct jarena *a) {
    for (struct jchunk *c = a->head, *nx; c; c = nx) {
        nx = c->next;
        free(c);
    }
    a->head = NULL;
    a->used = 0;
}

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
