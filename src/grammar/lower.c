/* Lowering of expression trees to the compiled grammar (gram_internal.h): UTF-8 byte
 * sequences for code point classes, repetitions as (tail-)recursive rules, alternatives as
 * rules; then the checks (unproductive alternatives pruned, left recursion refused), the start
 * state, and the gram_t lifetime. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

/* ---------------------------------------------------------------- UTF-8 lowering
 * A code point range becomes byte-range sequences: split it by encoded length, then at each
 * continuation-byte boundary where the high bits differ, until every byte position of the
 * piece is an independent range (the construction of RE2 / Rust regex-syntax's utf8 module). */

static int utf8_enc(uint32_t c, uint8_t *o) {
    if (c < 0x80) { o[0] = (uint8_t)c; return 1; }
    if (c < 0x800) { o[0] = (uint8_t)(0xC0 | (c >> 6)); o[1] = (uint8_t)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        o[0] = (uint8_t)(0xE0 | (c >> 12));
        o[1] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (uint8_t)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | (c >> 18));
    o[1] = (uint8_t)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
    o[3] = (uint8_t)(0x80 | (c & 0x3F));
    return 4;
}

static void set_range(uint8_t set[32], unsigned lo, unsigned hi) {
    for (unsigned c = lo; c <= hi; c++) set[c >> 3] |= (uint8_t)(1u << (c & 7));
}

/* Adds to alt the byte sequences of [lo, hi] (same encoded length). */
static void utf8_piece(struct gb *b, struct gn *alt, uint32_t lo, uint32_t hi) {
    if (!alt) return;
    int n = lo < 0x80 ? 1 : lo < 0x800 ? 2 : lo < 0x10000 ? 3 : 4;
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_piece(b, alt, lo, lo | m);
                utf8_piece(b, alt, (lo | m) + 1, hi);
                return;
            }
            if ((hi & m) != m) {
                utf8_piece(b, alt, lo, (hi & ~m) - 1);
                utf8_piece(b, alt, hi & ~m, hi);
                return;
            }
        }
    }
    uint8_t a[4], z[4];
    utf8_enc(lo, a);
    utf8_enc(hi, z);
    struct gn *seq = gn_seq(b);
    for (int i = 0; i < n; i++) {
        uint8_t set[32] = {0};
        set_range(set, a[i], z[i]);
        gn_add(b, seq, gn_byteset(b, set));
    }
    gn_add(b, alt, seq);
}

/* The byte-level alternatives of a code point class (surrogates dropped). */
static struct gn *utf8_lower(struct gb *b, const struct gcset *cs) {
    struct gn *alt = gn_alt(b);
    uint8_t ascii[32] = {0};
    bool any_ascii = false;
    static const uint32_t bounds[][2] = {{0, 0x7F}, {0x80, 0x7FF}, {0x800, 0xD7FF}, {0xE000, 0xFFFF},
                                         {0x10000, 0x10FFFF}};
    for (int i = 0; i < cs->n; i++)
        for (int k = 0; k < 5; k++) {
            uint32_t lo = cs->r[i][0] > bounds[k][0] ? cs->r[i][0] : bounds[k][0];
            uint32_t hi = cs->r[i][1] < bounds[k][1] ? cs->r[i][1] : bounds[k][1];
            if (lo > hi) continue;
            if (k == 0) {
                set_range(ascii, lo, hi);
                any_ascii = true;
            } else {
                utf8_piece(b, alt, lo, hi);
            }
        }
    if (any_ascii) gn_add(b, alt, gn_byteset(b, ascii));
    return alt;
}

/* ---------------------------------------------------------------- compile */

struct lower {
    struct gb *b;
    uint32_t *elems;
    int n_elems, cap_elems;
    int32_t *alt_start;        /* alternatives, grouped per rule in rule order */
    int n_alts, cap_alts;
    int32_t *rule_off;         /* (cap_rules + 1) */
    uint8_t (*sets)[32];
    int n_sets, cap_sets;
    int8_t *nullable;          /* per builder rule: -1 unknown (being computed), 0, 1 */
    int cap_null;
    int *nn_rule;              /* per builder rule: its non-nullable twin, -1 none yet */
    /* memo: code point class -> rule */
    struct { const struct gn *key; int rule; } *umemo;
    int n_umemo, cap_umemo;
    uint32_t *tmp;             /* one alternative being built */
    int n_tmp, cap_tmp;
    char *err;
    size_t errlen;
};

static bool grow(void **p, int *cap, int need, size_t elt) {
    if (need <= *cap) return true;
    int nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *np = kv_realloc(*p, (size_t)nc * elt);
    if (!np) return false;
    *p = np;
    *cap = nc;
    return true;
}

static int set_index(struct lower *L, const uint8_t set[32]) {
    for (int i = 0; i < L->n_sets; i++)
        if (!memcmp(L->sets[i], set, 32)) return i;
    if (!grow((void **)&L->sets, &L->cap_sets, L->n_sets + 1, 32)) return -1;
    memcpy(L->sets[L->n_sets], set, 32);
    return L->n_sets++;
}

static bool tmp_push(struct lower *L, uint32_t e) {
    if (L->n_tmp >= GRAM_MAX_ELEMS) {
        gb_fail(L->b, KV_ETOOLONG, "the grammar is too large");
        return false;
    }
    if (!grow((void **)&L->tmp, &L->cap_tmp, L->n_tmp + 1, sizeof *L->tmp)) {
        gb_fail(L->b, KV_ENOMEM, "out of memory");
        return false;
    }
    L->tmp[L->n_tmp++] = e;
    return true;
}

static bool rule_nullable(struct lower *L, int r);

static bool node_nullable(struct lower *L, const struct gn *n) {
    switch (n->type) {
    case GN_EMPTY: return true;
    case GN_CHARS: case GN_BYTESET: return false;
    case GN_BYTES: return n->n_bytes == 0;
    case GN_SEQ:
        for (int i = 0; i < n->n_kids; i++)
            if (!node_nullable(L, n->kids[i])) return false;
        return true;
    case GN_ALT:
        for (int i = 0; i < n->n_kids; i++)
            if (node_nullable(L, n->kids[i])) return true;
        return false;
    case GN_REP: return n->min == 0 || node_nullable(L, n->kids[0]);
    case GN_REF: return rule_nullable(L, n->rule);
    }
    return false;
}

static bool ensure_rule_arrays(struct lower *L) {
    int need = L->b->n_rules;
    if (need <= L->cap_null) return true;
    int nc = L->cap_null ? L->cap_null : 64;
    while (nc < need) nc *= 2;
    int8_t *nu = kv_realloc(L->nullable, (size_t)nc);
    if (!nu) return false;
    L->nullable = nu;
    int *nn = kv_realloc(L->nn_rule, (size_t)nc * sizeof *nn);
    if (!nn) return false;
    L->nn_rule = nn;
    for (int i = L->cap_null; i < nc; i++) {
        L->nullable[i] = -2; /* not computed */
        L->nn_rule[i] = -1;
    }
    L->cap_null = nc;
    return true;
}

/* Rule nullability by recursion with a fixpoint flavour: a rule being computed counts as not
 * nullable (least fixpoint); results are memoized. Correct for the rule shapes the front ends
 * build (a nullable rule always has a directly nullable alternative), and the compiled
 * grammar's own nullable analysis (left recursion check) is an exact fixpoint. */
static bool rule_nullable(struct lower *L, int r) {
    if (!ensure_rule_arrays(L)) {
        gb_fail(L->b, KV_ENOMEM, "out of memory");
        return false;
    }
    if (L->nullable[r] >= 0) return L->nullable[r];
    if (L->nullable[r] == -1) return false;
    L->nullable[r] = -1;
    bool v = L->b->rules[r].body && node_nullable(L, L->b->rules[r].body);
    L->nullable[r] = v;
    return v;
}

static struct gn *nonnull(struct lower *L, struct gn *n);

/* nn(a_i a_{i+1} ... a_{k-1}) for a sequence whose elements are all nullable. */
static struct gn *nonnull_seq(struct lower *L, struct gn **a, int k) {
    struct gb *b = L->b;
    if (k == 0) return gn_alt(b);
    struct gn *alt = gn_alt(b);
    struct gn *first = gn_seq(b);
    gn_add(b, first, nonnull(L, a[0]));
    for (int i = 1; i < k; i++) gn_add(b, first, a[i]);
    gn_add(b, alt, first);
    gn_add(b, alt, nonnull_seq(L, a + 1, k - 1));
    return alt;
}

/* A node for L(n) minus the empty string. */
static struct gn *nonnull(struct lower *L, struct gn *n) {
    struct gb *b = L->b;
    if (!n) return NULL;
    if (!node_nullable(L, n)) return n;
    switch (n->type) {
    case GN_EMPTY: case GN_BYTES: return gn_alt(b); /* only "" -> nothing */
    case GN_SEQ: return nonnull_seq(L, n->kids, n->n_kids);
    case GN_ALT: {
        struct gn *alt = gn_alt(b);
        for (int i = 0; i < n->n_kids; i++) gn_add(b, alt, nonnull(L, n->kids[i]));
        return alt;
    }
    case GN_REP: {
        /* X{m,M} with X nullable or m == 0: nn(X) X{0,M-1} */
        struct gn *x = n->kids[0];
        int max = n->max < 0 ? -1 : n->max - 1;
        struct gn *s = gn_seq(b);
        gn_add(b, s, nonnull(L, x));
        if (max != 0) gn_add(b, s, gn_rep(b, x, 0, max));
        return s;
    }
    case GN_REF: {
        int r = n->rule;
        if (!ensure_rule_arrays(L)) return NULL;
        if (L->nn_rule[r] < 0) {
            char name[300];
            snprintf(name, sizeof name, "%s-nonempty", b->rules[r].name);
            int nr = gb_rule_new(b, name);
            if (nr < 0 || !ensure_rule_arrays(L)) return NULL;
            L->nn_rule[r] = nr;
            L->nullable[nr] = 0;
            gb_rule_set(b, nr, nonnull(L, b->rules[r].body));
        }
        return gn_ref(b, L->nn_rule[r]);
    }
    default: return n;
    }
}

static int anon_rule(struct lower *L, const char *what, struct gn *body) {
    char name[64];
    snprintf(name, sizeof name, "%s-%d", what, L->b->n_rules);
    int r = gb_rule_new(L->b, name);
    if (r >= 0) gb_rule_set(L->b, r, body);
    return r;
}

static bool lower_seq(struct lower *L, struct gn *n);

static bool push_set(struct lower *L, const uint8_t set[32]) {
    int si = set_index(L, set);
    if (si < 0) {
        gb_fail(L->b, KV_ENOMEM, "out of memory");
        return false;
    }
    return tmp_push(L, GE_MAKE(GE_CHARS, si));
}

static bool lower_rep(struct lower *L, struct gn *n) {
    struct gb *b = L->b;
    struct gn *x = n->kids[0];
    int min = n->min, max = n->max;
    if (max >= 0 && max < min) {
        gb_fail(b, KV_EINVAL, "a repetition's maximum is below its minimum");
        return false;
    }
    if (node_nullable(L, x)) { /* X{m,M} == nn(X){0,M}: no empty iterations, no epsilon loops */
        x = nonnull(L, x);
        min = 0;
    }
    /* X is lowered once, as a rule, however many copies and chain rules refer to it (nested
     * repetitions would otherwise multiply) */
    if (x && x->type != GN_REF && x->type != GN_BYTESET && !(x->type == GN_CHARS && x->cs.n && x->cs.r[x->cs.n - 1][1] < 0x80) &&
        !(x->type == GN_BYTES && x->n_bytes == 1)) {
        int rx = anon_rule(L, "item", x);
        if (rx < 0) return false;
        x = gn_ref(b, rx);
    }
    for (int i = 0; i < min; i++)
        if (!lower_seq(L, x)) return false;
    if (max == min) return true;
    if (max < 0) { /* S ::= X S | "" */
        struct gn *alt = gn_alt(b);
        int s = anon_rule(L, "star", alt);
        if (s < 0) return false;
        gn_add(b, alt, gn_seq2(b, x, gn_ref(b, s)));
        gn_add(b, alt, gn_empty(b));
        return b->st ? false : tmp_push(L, GE_MAKE(GE_RULE, s));
    }
    /* O_1 ::= X | "";  O_j ::= X O_{j-1} | "" */
    int prev = -1;
    for (int j = 1; j <= max - min; j++) {
        struct gn *alt = gn_alt(b);
        gn_add(b, alt, prev < 0 ? x : gn_seq2(b, x, gn_ref(b, prev)));
        gn_add(b, alt, gn_empty(b));
        prev = anon_rule(L, "opt", alt);
        if (prev < 0) return false;
    }
    return b->st ? false : tmp_push(L, GE_MAKE(GE_RULE, prev));
}

static bool lower_seq(struct lower *L, struct gn *n) {
    struct gb *b = L->b;
    if (!n || b->st) return false;
    switch (n->type) {
    case GN_EMPTY: return true;
    case GN_BYTES:
        for (int i = 0; i < n->n_bytes; i++) {
            uint8_t set[32] = {0};
            unsigned c = (unsigned char)n->bytes[i];
            set[c >> 3] = (uint8_t)(1u << (c & 7));
            if (!push_set(L, set)) return false;
        }
        return true;
    case GN_BYTESET: return push_set(L, n->bset);
    case GN_CHARS: {
        if (n->cs.n == 0) { /* matches nothing */
            int r = anon_rule(L, "none", gn_alt(b));
            return r >= 0 && tmp_push(L, GE_MAKE(GE_RULE, r));
        }
        if (n->cs.r[n->cs.n - 1][1] < 0x80) {
            uint8_t set[32] = {0};
            for (int i = 0; i < n->cs.n; i++) set_range(set, n->cs.r[i][0], n->cs.r[i][1]);
            return push_set(L, set);
        }
        for (int i = 0; i < L->n_umemo; i++) {
            const struct gn *k = L->umemo[i].key;
            if (k->cs.n == n->cs.n && !memcmp(k->cs.r, n->cs.r, (size_t)n->cs.n * sizeof *n->cs.r))
                return tmp_push(L, GE_MAKE(GE_RULE, L->umemo[i].rule));
        }
        int r = anon_rule(L, "utf8", utf8_lower(b, &n->cs));
        if (r < 0 || !grow((void **)&L->umemo, &L->cap_umemo, L->n_umemo + 1, sizeof *L->umemo)) {
            gb_fail(b, KV_ENOMEM, "out of memory");
            return false;
        }
        L->umemo[L->n_umemo].key = n;
        L->umemo[L->n_umemo++].rule = r;
        return tmp_push(L, GE_MAKE(GE_RULE, r));
    }
    case GN_SEQ:
        for (int i = 0; i < n->n_kids; i++)
            if (!lower_seq(L, n->kids[i])) return false;
        return true;
    case GN_ALT: {
        if (n->n_kids == 1) return lower_seq(L, n->kids[0]);
        int r = anon_rule(L, "alt", n);
        return r >= 0 && tmp_push(L, GE_MAKE(GE_RULE, r));
    }
    case GN_REP: return lower_rep(L, n);
    case GN_REF:
        if (n->rule < 0 || n->rule >= b->n_rules) {
            gb_fail(b, KV_EINVAL, "internal: bad rule reference");
            return false;
        }
        return tmp_push(L, GE_MAKE(GE_RULE, n->rule));
    }
    return false;
}

/* Adds the alternatives of n to out (nested ALTs and one-item groups flattened). */
static void flatten_alt(struct gb *b, struct gn *out, struct gn *n, int depth) {
    while ((n->type == GN_SEQ || n->type == GN_ALT) && n->n_kids == 1) n = n->kids[0];
    if (n->type == GN_ALT && depth < 64) {
        for (int i = 0; i < n->n_kids; i++) flatten_alt(b, out, n->kids[i], depth + 1);
        return;
    }
    gn_add(b, out, n);
}

#define TRIE_MIN_LITERALS 4

/* A rule body with its literal alternatives merged into a trie (gn_literal_trie): a list of
 * thousands of strings then opens one parse per distinct prefix, not one per string. */
static struct gn *alt_with_trie(struct gb *b, struct gn *body) {
    if (body->type != GN_ALT) return body;
    struct gn *flat = gn_alt(b);
    for (int i = 0; i < body->n_kids && flat; i++) flatten_alt(b, flat, body->kids[i], 0);
    if (!flat) return body;
    int n_lit = 0;
    for (int i = 0; i < flat->n_kids; i++) n_lit += flat->kids[i]->type == GN_BYTES || flat->kids[i]->type == GN_EMPTY;
    if (n_lit < TRIE_MIN_LITERALS) return flat;
    struct gn **lits = gb_alloc(b, (size_t)n_lit * sizeof *lits);
    struct gn *out = gn_alt(b);
    if (!lits || !out) return NULL;
    int k = 0;
    for (int i = 0; i < flat->n_kids; i++) {
        struct gn *x = flat->kids[i];
        if (x->type == GN_BYTES || x->type == GN_EMPTY) lits[k++] = x;
        else gn_add(b, out, x);
    }
    struct gn *t = gn_literal_trie(b, lits, n_lit);
    if (!t) return NULL;
    for (int i = 0; i < t->n_kids; i++) gn_add(b, out, t->kids[i]);
    return out;
}

/* Lowers every alternative of rule r (alternatives are appended after the current ones). */
static bool lower_rule(struct lower *L, int r) {
    struct gn *body = alt_with_trie(L->b, L->b->rules[r].body);
    if (!body) return false;
    L->b->rules[r].body = body;
    struct gn *one[1] = {body};
    struct gn **alts = one;
    int n_alts = 1;
    if (body->type == GN_ALT) {
        alts = body->kids;
        n_alts = body->n_kids;
    }
    L->rule_off[r] = L->n_alts;
    for (int a = 0; a < n_alts; a++) {
        L->n_tmp = 0;
        if (!lower_seq(L, alts[a])) return false;
        /* nested lowering may have added rules: their offsets are set when reached */
        if (L->n_elems + L->n_tmp + 1 > GRAM_MAX_ELEMS) {
            gb_fail(L->b, KV_ETOOLONG, "the grammar is too large");
            return false;
        }
        if (!grow((void **)&L->elems, &L->cap_elems, L->n_elems + L->n_tmp + 2, sizeof *L->elems) ||
            !grow((void **)&L->alt_start, &L->cap_alts, L->n_alts + 1, sizeof *L->alt_start)) {
            gb_fail(L->b, KV_ENOMEM, "out of memory");
            return false;
        }
        L->alt_start[L->n_alts++] = L->n_elems;
        if (L->n_tmp) memcpy(L->elems + L->n_elems, L->tmp, (size_t)L->n_tmp * sizeof *L->tmp);
        L->n_elems += L->n_tmp;
        L->elems[L->n_elems++] = GE_MAKE(GE_END, 0);
    }
    return true;
}

void gstate_free(struct gstate *s);
static kv_status check_left_recursion(const gram_t *g, char *err, size_t errlen);
static kv_status prune_unproductive(gram_t *g, char *err, size_t errlen);

static void gram_destroy(gram_t *g);

#define LAZY_MAX_NEST 4 /* a byte-dispatched rule starts with at most this many nested ones */

/* gram.lazy: a rule is byte-dispatched when it has several alternatives and each starts with
 * a byte set or with a byte-dispatched rule (at most LAZY_MAX_NEST deep: advancing one costs
 * a recursion per level); its set is the union of those first sets. A fixpoint over the
 * rules (no left recursion: a rule never starts with itself). */
static kv_status find_lazy_rules(gram_t *g, char *err, size_t errlen) {
    int n = g->n_rules;
    g->lazy = kv_malloc((size_t)(n ? n : 1) * sizeof *g->lazy);
    int8_t *nest = kv_calloc((size_t)(n ? n : 1), 1);
    if (!g->lazy || !nest) {
        free(nest);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    for (int r = 0; r < n; r++) g->lazy[r] = -1;
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < n; r++) {
            int a0 = g->rule_off[r], a1 = g->rule_off[r + 1];
            if (g->lazy[r] >= 0 || a1 - a0 < 2) continue;
            uint8_t set[32] = {0};
            int depth = 1;
            bool ok = true;
            for (int a = a0; a < a1 && ok; a++) {
                uint32_t e = g->elems[g->alt_start[a]];
                const uint8_t *fs = NULL;
                if (GE_TYPE(e) == GE_CHARS) fs = g->sets[GE_ARG(e)];
                else if (GE_TYPE(e) == GE_RULE && g->lazy[GE_ARG(e)] >= 0 && nest[GE_ARG(e)] < LAZY_MAX_NEST) {
                    fs = g->sets[g->lazy[GE_ARG(e)]];
                    if (nest[GE_ARG(e)] + 1 > depth) depth = nest[GE_ARG(e)] + 1;
                }
                if (!fs) ok = false;
                else
                    for (int i = 0; i < 32; i++) set[i] |= fs[i];
            }
            if (!ok) continue;
            int si = -1;
            for (int i = 0; i < g->n_sets && si < 0; i++)
                if (!memcmp(g->sets[i], set, 32)) si = i;
            if (si < 0) {
                void *ns = kv_realloc(g->sets, (size_t)(g->n_sets + 1) * 32);
                if (!ns) {
                    free(nest);
                    return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
                }
                g->sets = ns;
                memcpy(g->sets[g->n_sets], set, 32);
                si = g->n_sets++;
            }
            g->lazy[r] = si;
            nest[r] = (int8_t)depth;
            changed = true;
        }
    }
    free(nest);
    return KV_OK;
}

kv_status gb_compile(struct gb *b, int root, gram_t **out, char *err, size_t errlen) {
    if (b->st) return kv_errf(b->st, err, errlen, "%s", b->err);
    for (int i = 0; i < b->n_rules; i++)
        if (!b->rules[i].body)
            return kv_errf(KV_EINVAL, err, errlen, "rule '%s' is used but not defined", b->rules[i].name);
    if (root < 0 || root >= b->n_rules) return kv_errf(KV_EINVAL, err, errlen, "no root rule");
    struct lower L;
    memset(&L, 0, sizeof L);
    L.b = b;
    L.err = err;
    L.errlen = errlen;
    kv_status st = KV_OK;
    /* rules created while lowering are lowered in turn; rule_off is sized as we go */
    int cap_off = 0;
    for (int r = 0; r < b->n_rules; r++) {
        if (!grow((void **)&L.rule_off, &cap_off, b->n_rules + 1, sizeof *L.rule_off)) {
            gb_fail(b, KV_ENOMEM, "out of memory");
            break;
        }
        if (!b->rules[r].body) {
            gb_fail(b, KV_EINVAL, "internal: a generated rule has no body");
            break;
        }
        if (!lower_rule(&L, r)) break;
    }
    if (!b->st && !grow((void **)&L.rule_off, &cap_off, b->n_rules + 1, sizeof *L.rule_off))
        gb_fail(b, KV_ENOMEM, "out of memory");
    gram_t *g = NULL;
    if (b->st) {
        st = kv_errf(b->st, err, errlen, "%s", b->err);
        goto done;
    }
    L.rule_off[b->n_rules] = L.n_alts;
    g = kv_calloc(1, sizeof *g);
    if (!g) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto done;
    }
    atomic_init(&g->refs, 1);
    pthread_mutex_init(&g->mu, NULL);
    g->elems = L.elems;
    g->n_elems = L.n_elems;
    g->alt_start = L.alt_start;
    g->n_alts = L.n_alts;
    g->rule_off = L.rule_off;
    g->n_rules = b->n_rules;
    g->sets = L.sets;
    g->n_sets = L.n_sets;
    g->root = root;
    L.elems = NULL;
    L.alt_start = NULL;
    L.rule_off = NULL;
    L.sets = NULL;
    g->rule_names = kv_calloc((size_t)b->n_rules, sizeof *g->rule_names);
    if (!g->rule_names) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto done;
    }
    for (int r = 0; r < b->n_rules; r++) {
        g->rule_names[r] = b->rules[r].name;
        b->rules[r].name = NULL;
    }
    st = prune_unproductive(g, err, errlen);
    if (!st) st = check_left_recursion(g, err, errlen);
    if (!st) st = find_lazy_rules(g, err, errlen);
    if (st) goto done;
    struct gstate s0 = {0};
    if (!gstate_start(g, &s0)) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto done;
    }
    if (s0.overflow && !s0.wide) { /* too many stacks: gram_probe below says so */
        gstate_free(&s0);
        st = kv_errf(KV_ETOOLONG, err, errlen, "the grammar nests too deeply at its start (more than 512 levels)");
        goto done;
    }
    if (s0.n_stacks == 0) {
        gstate_free(&s0);
        st = kv_errf(KV_EINVAL, err, errlen, "the grammar matches nothing");
        goto done;
    }
    g->start = s0.v;
    g->n_start = s0.len;
    st = gram_probe(g, err, errlen, NULL);
done:
    if (st && g) {
        gram_destroy(g);
        g = NULL;
    }
    free(L.elems);
    free(L.alt_start);
    free(L.rule_off);
    free(L.sets);
    free(L.nullable);
    free(L.nn_rule);
    free(L.umemo);
    free(L.tmp);
    if (!st) *out = g;
    return st;
}

/* Drops every alternative that cannot derive any string (it refers to a rule that matches
 * nothing, e.g. a `false` schema or a class emptied by a pattern's restrictions), so a
 * matcher never enters a path it cannot finish: with only productive alternatives left,
 * every stack of every state can be completed. */
static kv_status prune_unproductive(gram_t *g, char *err, size_t errlen) {
    uint8_t *prod = kv_calloc((size_t)g->n_rules, 1);
    int32_t *na = kv_malloc((size_t)(g->n_alts ? g->n_alts : 1) * sizeof *na);
    if (!prod || !na) {
        free(prod);
        free(na);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < g->n_rules; r++) {
            if (prod[r]) continue;
            for (int a = g->rule_off[r]; a < g->rule_off[r + 1]; a++) {
                bool ok = true;
                for (int p = g->alt_start[a]; GE_TYPE(g->elems[p]) != GE_END; p++)
                    if (GE_TYPE(g->elems[p]) == GE_RULE && !prod[GE_ARG(g->elems[p])]) {
                        ok = false;
                        break;
                    }
                if (ok) {
                    prod[r] = 1;
                    changed = true;
                    break;
                }
            }
        }
    }
    int w = 0;
    for (int r = 0; r < g->n_rules; r++) {
        int a0 = g->rule_off[r], a1 = g->rule_off[r + 1];
        g->rule_off[r] = w;
        for (int a = a0; a < a1; a++) {
            bool ok = true;
            for (int p = g->alt_start[a]; GE_TYPE(g->elems[p]) != GE_END; p++)
                if (GE_TYPE(g->elems[p]) == GE_RULE && !prod[GE_ARG(g->elems[p])]) {
                    ok = false;
                    break;
                }
            if (ok) na[w++] = g->alt_start[a];
        }
    }
    g->rule_off[g->n_rules] = w;
    memcpy(g->alt_start, na, (size_t)w * sizeof *na);
    g->n_alts = w;
    bool root_ok = prod[g->root];
    free(prod);
    free(na);
    if (!root_ok) return kv_errf(KV_EINVAL, err, errlen, "the grammar matches nothing");
    return KV_OK;
}

/* Exact nullable fixpoint on the compiled rules, then a cycle search in the left-corner
 * graph (r -> s when s can be the first thing r expands to without consuming a byte). A
 * cycle would make the matcher expand forever. */
static kv_status check_left_recursion(const gram_t *g, char *err, size_t errlen) {
    int n = g->n_rules;
    uint8_t *nul = kv_calloc((size_t)n, 1);
    uint8_t *color = kv_calloc((size_t)n, 1);
    int32_t *adj_off = kv_calloc((size_t)n + 1, sizeof *adj_off);
    int32_t *adj = kv_malloc((size_t)(g->n_elems + 1) * sizeof *adj);
    int32_t *stk = kv_malloc((size_t)(n + 1) * 2 * sizeof *stk);
    kv_status st = KV_OK;
    if (!nul || !color || !adj_off || !adj || !stk) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto out;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < n; r++) {
            if (nul[r]) continue;
            for (int a = g->rule_off[r]; a < g->rule_off[r + 1] && !nul[r]; a++) {
                bool ok = true;
                for (int p = g->alt_start[a]; GE_TYPE(g->elems[p]) != GE_END; p++) {
                    uint32_t e = g->elems[p];
                    if (GE_TYPE(e) == GE_CHARS || !nul[GE_ARG(e)]) {
                        ok = false;
                        break;
                    }
                }
                if (ok) {
                    nul[r] = 1;
                    changed = true;
                }
            }
        }
    }
    int na = 0;
    for (int r = 0; r < n; r++) {
        adj_off[r] = na;
        for (int a = g->rule_off[r]; a < g->rule_off[r + 1]; a++)
            for (int p = g->alt_start[a]; GE_TYPE(g->elems[p]) == GE_RULE; p++) {
                int s = (int)GE_ARG(g->elems[p]);
                adj[na++] = s;
                if (!nul[s]) break;
            }
    }
    adj_off[n] = na;
    for (int r0 = 0; r0 < n && !st; r0++) {
        if (color[r0]) continue;
        int sp = 1;
        stk[0] = r0;
        stk[1] = adj_off[r0];
        color[r0] = 1;
        while (sp > 0) {
            int r = stk[2 * (sp - 1)];
            int i = stk[2 * (sp - 1) + 1];
            if (i >= adj_off[r + 1]) {
                color[r] = 2;
                sp--;
                continue;
            }
            stk[2 * (sp - 1) + 1] = i + 1;
            int s = adj[i];
            if (color[s] == 1) {
                st = kv_errf(KV_EINVAL, err, errlen,
                             "left recursion: rule '%s' can reach itself without consuming input",
                             g->rule_names[s]);
                break;
            }
            if (color[s] == 0) {
                color[s] = 1;
                stk[2 * sp] = s;
                stk[2 * sp + 1] = adj_off[s];
                sp++;
            }
        }
    }
out:
    free(nul);
    free(color);
    free(adj_off);
    free(adj);
    free(stk);
    return st;
}

/* ---------------------------------------------------------------- gram_t lifetime */

void gram_mask_cache_free(struct gram_mask_cache *c); /* vocab.c */

static void gram_destroy(gram_t *g) {
    if (!g) return;
    free(g->elems);
    free(g->alt_start);
    free(g->rule_off);
    free(g->sets);
    if (g->rule_names)
        for (int r = 0; r < g->n_rules; r++) free(g->rule_names[r]);
    free(g->rule_names);
    free(g->start);
    free(g->lazy);
    gram_mask_cache_free(g->cache);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

gram_t *gram_ref(gram_t *g) {
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

void gram_unref(gram_t *g) {
    if (g && atomic_fetch_sub(&g->refs, 1) == 1) gram_destroy(g);
}

int gram_n_rules(const gram_t *g) { return g ? g->n_rules : 0; }
int gram_n_elems(const gram_t *g) { return g ? g->n_elems : 0; }
