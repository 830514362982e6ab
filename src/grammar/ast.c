/* grammar builder: the node arena, expression trees, rules and code point classes
 * (gram_internal.h); lower.c turns them into the compiled form. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

/* ---------------------------------------------------------------- arena */

void gb_init(struct gb *b) { memset(b, 0, sizeof *b); }

void gb_free(struct gb *b) {
    kv_arena_free(&b->arena);
    for (int i = 0; i < b->n_rules; i++) free(b->rules[i].name);
    free(b->rules);
    memset(b, 0, sizeof *b);
}

void gb_fail(struct gb *b, kv_status st, const char *msg) {
    if (b->st) return;
    b->st = st;
    snprintf(b->err, sizeof b->err, "%s", msg);
}

void *gb_alloc(struct gb *b, size_t n) {
    kv_status why;
    void *p = kv_arena_alloc(&b->arena, n, &why); /* no limit set: only out of memory fails */
    if (!p) gb_fail(b, KV_ENOMEM, "out of memory");
    return p;
}

char *gb_strdup(struct gb *b, const char *s, size_t n) {
    char *p = gb_alloc(b, n + 1);
    if (p) memcpy(p, s, n);
    return p;
}

/* ---------------------------------------------------------------- nodes */

static struct gn *node(struct gb *b, enum gn_type t) {
    if (++b->n_nodes > GRAM_MAX_NODES) {
        gb_fail(b, KV_ETOOLONG, "the grammar is too large");
        return NULL;
    }
    struct gn *n = gb_alloc(b, sizeof *n);
    if (n) n->type = t;
    return n;
}

struct gn *gn_empty(struct gb *b) { return node(b, GN_EMPTY); }

struct gn *gn_bytes(struct gb *b, const char *s, size_t len) {
    if (len == 0) return gn_empty(b);
    struct gn *n = node(b, GN_BYTES);
    if (!n) return NULL;
    n->bytes = gb_strdup(b, s, len);
    n->n_bytes = (int)len;
    return n->bytes ? n : NULL;
}

struct gn *gn_str(struct gb *b, const char *s) { return gn_bytes(b, s, strlen(s)); }

struct gn *gn_chars(struct gb *b, const struct gcset *cs) {
    struct gn *n = node(b, GN_CHARS);
    if (!n) return NULL;
    n->cs.n = cs->n;
    n->cs.r = gb_alloc(b, (size_t)(cs->n ? cs->n : 1) * sizeof *cs->r);
    if (!n->cs.r) return NULL;
    memcpy(n->cs.r, cs->r, (size_t)cs->n * sizeof *cs->r);
    return n;
}

struct gn *gn_range(struct gb *b, uint32_t lo, uint32_t hi) {
    uint32_t r[1][2] = {{lo, hi}};
    struct gcset cs = {1, r};
    return gn_chars(b, &cs);
}

struct gn *gn_byteset(struct gb *b, const uint8_t set[32]) {
    struct gn *n = node(b, GN_BYTESET);
    if (!n) return NULL;
    n->bset = gb_alloc(b, 32);
    if (!n->bset) return NULL;
    memcpy(n->bset, set, 32);
    return n;
}

struct gn *gn_seq(struct gb *b) { return node(b, GN_SEQ); }
struct gn *gn_alt(struct gb *b) { return node(b, GN_ALT); }

struct gn *gn_add(struct gb *b, struct gn *parent, struct gn *kid) {
    if (!parent || !kid) return NULL;
    if (parent->n_kids == parent->cap_kids) {
        int nc = parent->cap_kids ? parent->cap_kids * 2 : 4;
        struct gn **nk = gb_alloc(b, (size_t)nc * sizeof *nk);
        if (!nk) return NULL;
        if (parent->n_kids) memcpy(nk, parent->kids, (size_t)parent->n_kids * sizeof *nk);
        parent->kids = nk;
        parent->cap_kids = nc;
    }
    parent->kids[parent->n_kids++] = kid;
    return parent;
}

/* Nested repetitions (x{a,b}){m,M} denote x^k for k in the union of [ka, kb] over k in
 * [m, M]. When that union is one interval, the nest is the single repetition of x over it:
 * (x*)* == x*, (x+){3,} == x{3,}, (x{2}){3} == x{6}, (x?){0,5} == x{0,5}. This is exact (a
 * concatenation of copies of x only depends on how many there are) and removes the ambiguity
 * that makes nested quantifiers expensive to match: ((.*)*)* reads a byte in one way, not in
 * one way per split into iterations. Returns false (no rewrite) when the union has gaps
 * ((x{3}){0,2} = x{0} | x{3} | x{6}) or the merged counts would pass GRAM_MAX_REPEAT. */
static bool rep_merge(int a, int b, int m, int M, int *lo, int *hi) {
    if (b == 0 || M == 0) return false; /* x{0} or ""{..}: left as is (matches "") */
    bool contiguous;
    if (M == m) contiguous = true;                    /* one k: [ma, mb] */
    else if (b < 0) contiguous = m >= 1 || a <= 1;   /* [ka, inf) overlap from k >= 1 */
    else contiguous = (long)a - 1 <= (long)m * (b - a); /* (k+1)a <= kb + 1 for k = m (worst) */
    if (!contiguous) return false;
    long l = (long)m * a;
    long h = (b < 0 || M < 0) ? -1 : (long)M * b;
    if (l > GRAM_MAX_REPEAT || h > GRAM_MAX_REPEAT) return false;
    *lo = (int)l;
    *hi = (int)h;
    return true;
}

struct gn *gn_rep(struct gb *b, struct gn *kid, int min, int max) {
    if (!kid) return NULL;
    if (min > GRAM_MAX_REPEAT || max > GRAM_MAX_REPEAT) {
        gb_fail(b, KV_ETOOLONG, "a repetition count is above the limit of 10000");
        return NULL;
    }
    /* a group of one item is that item: ((x*)) */
    while ((kid->type == GN_SEQ || kid->type == GN_ALT) && kid->n_kids == 1) kid = kid->kids[0];
    int lo, hi;
    if (kid->type == GN_REP && rep_merge(kid->min, kid->max, min, max, &lo, &hi)) {
        kid = kid->kids[0];
        min = lo;
        max = hi;
        b->n_merged_reps++;
    }
    struct gn *n = node(b, GN_REP);
    if (!n || !gn_add(b, n, kid)) return NULL;
    n->min = min;
    n->max = max;
    return n;
}

struct gn *gn_ref(struct gb *b, int rule) {
    struct gn *n = node(b, GN_REF);
    if (n) n->rule = rule;
    return n;
}

struct gn *gn_seq2(struct gb *b, struct gn *a, struct gn *c) {
    struct gn *s = gn_seq(b);
    return gn_add(b, gn_add(b, s, a), c);
}

struct gn *gn_seq3(struct gb *b, struct gn *a, struct gn *c, struct gn *d) {
    return gn_add(b, gn_seq2(b, a, c), d);
}

struct gn *gn_opt(struct gb *b, struct gn *kid) { return gn_rep(b, kid, 0, 1); }

int gb_rule_new(struct gb *b, const char *name) {
    if (b->st) return -1;
    if (b->n_rules == b->cap_rules) {
        int nc = b->cap_rules ? b->cap_rules * 2 : 32;
        void *np = kv_realloc(b->rules, (size_t)nc * sizeof *b->rules);
        if (!np) {
            gb_fail(b, KV_ENOMEM, "out of memory");
            return -1;
        }
        b->rules = np;
        b->cap_rules = nc;
    }
    char *nm = kv_strdup(name ? name : "");
    if (!nm) {
        gb_fail(b, KV_ENOMEM, "out of memory");
        return -1;
    }
    b->rules[b->n_rules] = (struct gb_rule){nm, NULL};
    return b->n_rules++;
}

void gb_rule_set(struct gb *b, int rule, struct gn *body) {
    if (rule < 0 || rule >= b->n_rules) return;
    if (!body) gb_fail(b, KV_ENOMEM, "out of memory");
    b->rules[rule].body = body;
}

int gb_rule_find(const struct gb *b, const char *name) {
    for (int i = 0; i < b->n_rules; i++)
        if (!strcmp(b->rules[i].name, name)) return i;
    return -1;
}

/* ---------------------------------------------------------------- code point classes */

void gcset_free(struct gcset *s) {
    free(s->r);
    s->r = NULL;
    s->n = 0;
}

kv_status gcset_add(struct gcset *s, uint32_t lo, uint32_t hi) {
    if (lo > hi) return KV_OK;
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    if (lo > 0x10FFFF) return KV_OK;
    void *np = kv_realloc(s->r, (size_t)(s->n + 1) * sizeof *s->r);
    if (!np) return KV_ENOMEM;
    s->r = np;
    /* insert in order, then merge overlapping/adjacent ranges */
    int i = s->n;
    while (i > 0 && s->r[i - 1][0] > lo) {
        s->r[i][0] = s->r[i - 1][0];
        s->r[i][1] = s->r[i - 1][1];
        i--;
    }
    s->r[i][0] = lo;
    s->r[i][1] = hi;
    s->n++;
    int w = 0;
    for (int k = 1; k < s->n; k++) {
        if (s->r[k][0] <= s->r[w][1] + 1) {
            if (s->r[k][1] > s->r[w][1]) s->r[w][1] = s->r[k][1];
        } else {
            w++;
            s->r[w][0] = s->r[k][0];
            s->r[w][1] = s->r[k][1];
        }
    }
    s->n = w + 1;
    return KV_OK;
}

kv_status gcset_union(struct gcset *dst, const struct gcset *s) {
    for (int i = 0; i < s->n; i++)
        if (gcset_add(dst, s->r[i][0], s->r[i][1])) return KV_ENOMEM;
    return KV_OK;
}

kv_status gcset_negate(const struct gcset *s, struct gcset *out) {
    memset(out, 0, sizeof *out);
    uint32_t next = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->r[i][0] > next && gcset_add(out, next, s->r[i][0] - 1)) goto oom;
        next = s->r[i][1] + 1;
    }
    if (next <= 0x10FFFF && gcset_add(out, next, 0x10FFFF)) goto oom;
    return KV_OK;
oom:
    gcset_free(out);
    return KV_ENOMEM;
}


/* ---------------------------------------------------------------- literal tries
 * Alternatives that are all literal strings (guided_choice, enum, anyOf of consts, "a" | "b"
 * in GBNF, foo|bar in a regex) become a trie: one alternative per distinct next byte, common
 * runs as one byte string, each branching node its own rule reached by a tail call:
 *
 *   "cat" | "car" | "dog"  ->  T0 ::= "ca" T1 | "dog";  T1 ::= "t" | "r"
 *
 * A matcher then holds one parse per distinct prefix instead of one per alternative, so
 * thousands of choices cost what their branching costs (at most 256 + 1 parses at a node). */

struct lit {
    const char *s;
    int n;
};

static int lit_cmp(const void *a, const void *b) {
    const struct lit *x = a, *y = b;
    int n = x->n < y->n ? x->n : y->n;
    int c = n ? memcmp(x->s, y->s, (size_t)n) : 0;
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

#define TRIE_MAX_DEPTH 4096

/* The trie of l[lo, hi) (sorted, distinct, sharing their first d bytes). */
static struct gn *trie_node(struct gb *b, const struct lit *l, int lo, int hi, int d, int depth) {
    if (depth > TRIE_MAX_DEPTH) {
        gb_fail(b, KV_ETOOLONG, "the alternatives nest too deeply (a chain of more than 4096 strings that are "
                                "prefixes of one another)");
        return NULL;
    }
    struct gn *alt = gn_alt(b);
    int i = lo;
    if (l[i].n == d) { /* a string ends here: sorted first */
        gn_add(b, alt, gn_empty(b));
        i++;
        if (hi - i >= 2 && l[i].s[d] != l[hi - 1].s[d]) {
            /* "" | R, R the children (two or more): R stays one parse (byte-dispatched) */
            char name[32];
            snprintf(name, sizeof name, "trie-%d", b->n_rules);
            int r = gb_rule_new(b, name);
            if (r < 0) return NULL;
            gb_rule_set(b, r, trie_node(b, l, i, hi, d, depth + 1));
            gn_add(b, alt, gn_ref(b, r));
            return b->st ? NULL : alt;
        }
    }
    while (i < hi && !b->st) {
        unsigned char c = (unsigned char)l[i].s[d];
        int j = i + 1;
        while (j < hi && (unsigned char)l[j].s[d] == c) j++;
        /* common prefix of the group: that of its first and last strings */
        int e = d + 1;
        while (e < l[i].n && e < l[j - 1].n && l[i].s[e] == l[j - 1].s[e]) e++;
        struct gn *run = gn_bytes(b, l[i].s + d, (size_t)(e - d));
        if (j - i == 1 && e == l[i].n) {
            gn_add(b, alt, run);
        } else {
            char name[32];
            snprintf(name, sizeof name, "trie-%d", b->n_rules);
            int r = gb_rule_new(b, name);
            if (r < 0) return NULL;
            gb_rule_set(b, r, trie_node(b, l, i, j, e, depth + 1));
            gn_add(b, alt, gn_seq2(b, run, gn_ref(b, r)));
        }
        i = j;
    }
    return b->st ? NULL : alt;
}

struct gn *gn_literal_trie(struct gb *b, struct gn *const *lits, int n) {
    struct lit *l = kv_malloc((size_t)(n ? n : 1) * sizeof *l);
    if (!l) {
        gb_fail(b, KV_ENOMEM, "out of memory");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        l[i].s = lits[i]->type == GN_BYTES ? lits[i]->bytes : "";
        l[i].n = lits[i]->type == GN_BYTES ? lits[i]->n_bytes : 0;
    }
    qsort(l, (size_t)n, sizeof *l, lit_cmp);
    int w = 0;
    for (int i = 0; i < n; i++)
        if (!w || lit_cmp(&l[w - 1], &l[i])) l[w++] = l[i];
    struct gn *t = w ? trie_node(b, l, 0, w, 0, 0) : gn_alt(b);
    free(l);
    return t;
}
