/*
 * grammar internals: the expression tree every front end (JSON schema, regex, GBNF, choices)
 * builds, and the compiled form the matcher runs.
 *
 *   front end --gb_* builders--> rules of expression trees (code points, byte strings,
 *   sequences, alternatives, bounded/unbounded repetition, rule references)
 *   --gb_compile--> struct gram: flat element array of byte sets and rule references
 *
 * Compiled layout (after llama.cpp's GBNF representation; our own code):
 *
 *   elems[]:  | C0 C1 R7 END | C2 END | R3 C4 END | ...     C = byte set, R = rule ref
 *              ^alt 0 of r0   ^alt 1   ^alt 0 of r1
 *   rule r's alternatives start at alt_start[rule_off[r] .. rule_off[r+1])
 *
 * Every code point class is lowered to UTF-8 byte sequences (one alternative per run of lead
 * bytes), so the matcher works on bytes and only ever accepts valid UTF-8 where the grammar
 * is written in code points. Unbounded repetition becomes a right-recursive rule whose
 * recursive reference is the last element of its alternative: the matcher drops such return
 * frames (tail call), so `x*` runs in constant stack depth.
 */
#ifndef KV_GRAMMAR_INTERNAL_H
#define KV_GRAMMAR_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "grammar.h"

/* ---------------------------------------------------------------- expression trees */

enum gn_type {
    GN_EMPTY = 0, /* matches "" */
    GN_CHARS,     /* one code point from a class */
    GN_BYTES,     /* a literal byte string (UTF-8 text, or raw bytes) */
    GN_SEQ,
    GN_ALT,
    GN_REP,       /* kids[0] repeated [min, max] times; max < 0 = unbounded */
    GN_REF,       /* a rule */
    GN_BYTESET,   /* one byte from a 256-bit set (produced by the UTF-8 lowering) */
};

/* A code point class: sorted, disjoint, non-adjacent ranges [lo, hi] within [0, 0x10FFFF]
 * (surrogates are dropped when lowered). */
struct gcset {
    int n;
    uint32_t (*r)[2];
};

struct gn {
    enum gn_type type;
    int min, max;          /* GN_REP */
    int rule;              /* GN_REF */
    struct gn **kids;      /* GN_SEQ / GN_ALT (n_kids), GN_REP (1) */
    int n_kids, cap_kids;
    struct gcset cs;       /* GN_CHARS */
    char *bytes;           /* GN_BYTES */
    int n_bytes;
    uint8_t *bset;         /* GN_BYTESET: 32 bytes */
};

/* Grammar builder: owns every node (arena) and the rule table. Not thread-safe; one per
 * compile. A builder error (out of memory, too large) is sticky: gb_compile then fails. */
struct gb_rule {
    char *name;            /* owned; for error messages */
    struct gn *body;       /* NULL until defined */
};
struct gb {
    struct kv_arena arena;
    struct gb_rule *rules;
    int n_rules, cap_rules;
    size_t n_nodes;        /* node count (size limit) */
    int n_merged_reps;     /* nested repetitions merged into one (gn_rep; tests) */
    kv_status st;          /* sticky: KV_ENOMEM or KV_ETOOLONG */
    char err[256];
};

void gb_init(struct gb *b);
/* Records the first error (later ones are dropped): b->st, b->err. */
void gb_fail(struct gb *b, kv_status st, const char *msg);
void gb_free(struct gb *b);
/* Arena allocation (zeroed); NULL and sticky KV_ENOMEM on failure. */
void *gb_alloc(struct gb *b, size_t n);
char *gb_strdup(struct gb *b, const char *s, size_t n);

struct gn *gn_empty(struct gb *b);
struct gn *gn_bytes(struct gb *b, const char *s, size_t n);
struct gn *gn_str(struct gb *b, const char *s); /* gn_bytes of a NUL-terminated string */
struct gn *gn_chars(struct gb *b, const struct gcset *cs); /* copies cs */
struct gn *gn_range(struct gb *b, uint32_t lo, uint32_t hi); /* one range */
struct gn *gn_seq(struct gb *b);
struct gn *gn_alt(struct gb *b);  /* an ALT without kids matches nothing */
struct gn *gn_byteset(struct gb *b, const uint8_t set[32]);
/* Appends kid to a GN_SEQ/GN_ALT node; returns parent (NULL if either is NULL). */
struct gn *gn_add(struct gb *b, struct gn *parent, struct gn *kid);
struct gn *gn_rep(struct gb *b, struct gn *kid, int min, int max);
struct gn *gn_ref(struct gb *b, int rule);
struct gn *gn_seq2(struct gb *b, struct gn *a, struct gn *c);
struct gn *gn_seq3(struct gb *b, struct gn *a, struct gn *c, struct gn *d);
struct gn *gn_opt(struct gb *b, struct gn *kid);
/* An ALT matching exactly the given GN_BYTES / GN_EMPTY nodes, as a trie whose branching
 * nodes are rules (ast.c); duplicates are merged. NULL (sticky error) on ENOMEM or a chain
 * of prefixes deeper than 4096. */
struct gn *gn_literal_trie(struct gb *b, struct gn *const *lits, int n);

/* Rules: gb_rule_new adds an undefined rule (name copied); gb_rule_set defines it. */
int gb_rule_new(struct gb *b, const char *name);
void gb_rule_set(struct gb *b, int rule, struct gn *body);
int gb_rule_find(const struct gb *b, const char *name); /* -1 if absent */

/* Code point classes (heap, owned by the caller unless copied into a node). */
void gcset_free(struct gcset *s);
kv_status gcset_add(struct gcset *s, uint32_t lo, uint32_t hi); /* merges */
kv_status gcset_negate(const struct gcset *s, struct gcset *out); /* complement in [0, 0x10FFFF] */
kv_status gcset_union(struct gcset *dst, const struct gcset *s);

/* Parses a regex (regex.c) into a node of b. universe: NULL, or the code points every class
 * is restricted to (a literal outside it matches nothing). search: each top-level alternative
 * without '^' / '$' gets an unbounded run of universe code points before / after it (JSON
 * schema "pattern" semantics); otherwise the regex must match the whole text. KV_EINVAL with
 * a message naming the unsupported construct, KV_ETOOLONG, KV_ENOMEM. */
kv_status gram_regex_parse(struct gb *b, const char *re, size_t len, const struct gcset *universe,
                           bool search, struct gn **out, char *err, size_t errlen);

/* JSON schema front end (schema.c): a context per root document ($ref resolution), sharing
 * the builder's common JSON rules (by name) with other contexts in the same builder. */
struct gsc;
struct gsc *gsc_new(struct gb *b, const json_t *root, bool strict, char *err, size_t errlen);
void gsc_free(struct gsc *c);
/* The node for schema (path: its JSON pointer for messages); NULL on error (gsc_status). */
struct gn *gsc_node(struct gsc *c, const json_t *schema, const char *path);
kv_status gsc_status(const struct gsc *c);
struct gn *gsc_ws(struct gsc *c);     /* optional whitespace between JSON tokens */
struct gn *gsc_string(struct gsc *c); /* any JSON string */
struct gn *gsc_value(struct gsc *c);  /* any JSON value */

/* GBNF front end (ebnf.c): defines the rules of src in b; *root the rule named "root". */
kv_status gram_ebnf_parse(struct gb *b, const char *src, size_t len, int *root, char *err, size_t errlen);

/* Compiled-grammar cache (compile.c): build(b, arg, &root, err) fills a fresh builder; the
 * result is cached under key. */
typedef kv_status (*gram_build_fn)(struct gb *b, void *arg, int *root, char *err, size_t errlen);
kv_status gram_compile_cached(const char *key, size_t key_len, gram_build_fn build, void *arg,
                              gram_t **out, char *err, size_t errlen);

/* Compiles rule `root` of b (every referenced rule must be defined) into a gram. Errors:
 * KV_EINVAL (an undefined rule, left recursion: message in err), KV_ETOOLONG (over the size
 * limits), KV_ENOMEM. */
kv_status gb_compile(struct gb *b, int root, gram_t **out, char *err, size_t errlen);

/* Size limits of one compiled grammar. */
#define GRAM_MAX_ELEMS (1 << 20)
#define GRAM_MAX_NODES (1 << 21)
#define GRAM_MAX_REPEAT 10000 /* bounded repetition counts ({m,n}, maxLength, maxItems) */

/* ---------------------------------------------------------------- compiled grammar */

enum { GE_END = 0, GE_CHARS = 1, GE_RULE = 2 };
#define GE_TYPE(e) ((e) & 3u)
#define GE_ARG(e) ((e) >> 2)
#define GE_MAKE(t, a) ((uint32_t)(t) | ((uint32_t)(a) << 2))

struct gram_mask_cache; /* vocab.c */

struct gram {
    atomic_int refs;
    uint32_t *elems;       /* (n_elems) */
    int n_elems;
    int32_t *rule_off;     /* (n_rules + 1) into alt_start */
    int32_t *alt_start;    /* (n_alts) element index of each alternative */
    int n_rules, n_alts;
    uint8_t (*sets)[32];   /* (n_sets) 256-bit byte sets */
    int n_sets;
    int root;
    char **rule_names;     /* (n_rules) owned, for messages */
    /* byte-dispatched rules: lazy[r] = the index in sets of the bytes r can start with, or
     * -1. A rule of several alternatives that each start with a byte set (or with another
     * such rule) stays one stack whose top is the rule reference until the next byte picks
     * the alternatives it fits (a UTF-8 class is one parse position, not eight; a trie node
     * one, not one per child). (n_rules) owned. */
    int32_t *lazy;
    /* the start state (stacks after expanding root), computed at compile time */
    int32_t *start;
    int n_start;
    /* per-vocabulary mask cache (vocab.c), under mu */
    pthread_mutex_t mu;
    struct gram_mask_cache *cache;
};

/* ---------------------------------------------------------------- parser states
 * A state is a set of stacks stored flat: for each stack [len, p_0, ..., p_{len-1}] (p_{len-1}
 * the top: a GE_CHARS element, or a GE_RULE element of a byte-dispatched rule (gram.lazy);
 * the others are return positions). A stack of length 0 means the grammar is complete
 * (accepting). */
struct gstate {
    int32_t *v;            /* owned (cap) */
    int len, cap;          /* ints used */
    int n_stacks;
    bool accept;           /* holds the empty stack */
    bool overflow;         /* a path was dropped at the depth / stack-count limits */
    bool wide;             /* ... at the stack-count limit (GRAM_MAX_STACKS) */
};
#define GRAM_MAX_DEPTH 512
#define GRAM_MAX_STACKS 256

/* Computes the states reachable from `in` by one byte into out (cleared first). False on
 * ENOMEM. */
bool gstate_advance(const gram_t *g, const struct gstate *in, uint8_t byte, struct gstate *out);
/* The same, adding the work units spent to *work. */
bool gstate_advance_w(const gram_t *g, const struct gstate *in, uint8_t byte, struct gstate *out, uint64_t *work);

/* Compile-time bound on the state-set size (probe.c): follows the output that opens the most
 * parses at once (at every byte, the byte class whose next state has the most stacks; at
 * most GRAM_PROBE_DEPTH bytes or GRAM_PROBE_BUDGET work units, stopping when the path comes
 * back to a state it saw). KV_ETOOLONG with a message naming the limit and the output prefix
 * when a state reaches GRAM_MAX_STACKS stacks (a matcher would have to drop parses there,
 * and masks in such states cost up to the mask budget), KV_ENOMEM. A heuristic: grammars it
 * passes are still bounded at run time by GRAM_MASK_BUDGET per mask. *work_out (optional):
 * the units spent (tests). */
#define GRAM_PROBE_DEPTH 4096
kv_status gram_probe(const gram_t *g, char *err, size_t errlen, uint64_t *work_out);
/* Initial state of g into out. */
bool gstate_start(const gram_t *g, struct gstate *out);
void gstate_free(struct gstate *s);
bool gstate_copy(struct gstate *dst, const struct gstate *src);
/* Sorts the stacks (canonical form for cache keys). */
void gstate_canon(struct gstate *s);
/* The union of the byte sets at the stack tops (bytes that may come next). */
void gstate_next_bytes(const gram_t *g, const struct gstate *s, uint8_t out[32]);

/* Same transition on a caller-provided flat buffer (the trie walk's arena): in = (in_v,
 * in_len ints, in_n stacks); writes stacks to out_v (capacity out_cap ints). Returns the
 * number of ints written, or -1 when out_cap is too small; *n_out stacks, *acc accepting. */
int gstate_advance_raw(const gram_t *g, const int32_t *in_v, int in_len, uint8_t byte,
                       int32_t *out_v, int out_cap, int *n_out, bool *acc, bool *ovf, uint64_t *work);

/* Work units: the cost measure of matching, counted instead of timed so that limits are
 * deterministic (the same request fails or passes alone and batched). One unit is one stack
 * advanced, one expansion step of the closure, one stack compared when deduplicating, or one
 * trie node visited by a mask walk; a unit is a few nanoseconds. *work += the units spent
 * (also when the result is -1). */
#define GRAM_PROBE_BUDGET 4000000ull   /* compile-time exploration (gram_probe) */

/* Tests: caps the memoized trie walk at n distinct states (default and maximum 4096), so the
 * plain walk that takes over beyond the cap can be exercised. */
void gram_walk_set_max_states(int n);

static inline bool gset_has(const uint8_t set[32], unsigned b) { return (set[b >> 3] >> (b & 7)) & 1; }

#endif
