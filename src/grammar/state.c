/* Parser states: sets of stacks over the compiled grammar, and the byte transition
 * (gram_internal.h). */
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

/* Where expanded stacks go: a flat buffer, deduplicated. Growable when gs != NULL, else
 * bounded (full is set when it runs out of room). Duplicates are found by a linear scan while
 * there are few stacks, then by a hash table of offsets (a state of many stacks would
 * otherwise cost its square per byte). */
#define SINK_SCAN 16
#define SINK_HCAP (4 * GRAM_MAX_STACKS) /* power of two */
struct sink {
    int32_t *v;
    int len, cap;
    int n;
    bool acc, ovf, wide, full, oom;
    struct gstate *gs;
    uint64_t work;         /* work units spent (gram_internal.h) */
    bool hashed;           /* hoff holds every stack */
    int32_t *hoff;         /* (SINK_HCAP) offset + 1 of a stack, 0 empty; the thread's table */
};

/* One sink is filled at a time per thread: its table lives here (no 4 KiB to clear or zero
 * per advance while the state is small). */
static _Thread_local int32_t tl_hoff[SINK_HCAP];

static uint32_t stack_hash(const int32_t *s, int d) {
    uint32_t h = 2166136261u ^ (uint32_t)d;
    for (int i = 0; i < d; i++) h = (h ^ (uint32_t)s[i]) * 16777619u;
    return h ^ (h >> 15);
}

/* The hash slot of stack s: where it is, or the empty slot where it would go. */
static int32_t *sink_slot(struct sink *k, const int32_t *s, int d) {
    for (uint32_t i = stack_hash(s, d) & (SINK_HCAP - 1);; i = (i + 1) & (SINK_HCAP - 1)) {
        k->work++;
        int32_t o = k->hoff[i];
        if (!o) return &k->hoff[i];
        if (k->v[o - 1] == d && !memcmp(k->v + o, s, (size_t)d * sizeof *s)) return &k->hoff[i];
    }
}

static void sink_add(struct sink *k, const int32_t *s, int d) {
    int32_t *slot = NULL;
    if (k->hashed) {
        slot = sink_slot(k, s, d);
        if (*slot) return;
    } else {
        int off = 0;
        k->work += (uint64_t)k->n + 1; /* the duplicate scan */
        for (int i = 0; i < k->n; i++) {
            int l = k->v[off];
            if (l == d && !memcmp(k->v + off + 1, s, (size_t)d * sizeof *s)) return;
            off += l + 1;
        }
    }
    if (k->n >= GRAM_MAX_STACKS) {
        k->ovf = true;
        k->wide = true;
        return;
    }
    if (k->len + d + 1 > k->cap) {
        if (!k->gs) {
            k->full = true;
            return;
        }
        int nc = k->cap ? k->cap * 2 : 64;
        while (nc < k->len + d + 1) nc *= 2;
        int32_t *nv = kv_realloc(k->v, (size_t)nc * sizeof *nv);
        if (!nv) {
            k->oom = true;
            return;
        }
        k->v = nv;
        k->cap = nc;
    }
    k->v[k->len] = d;
    memcpy(k->v + k->len + 1, s, (size_t)d * sizeof *s);
    if (slot) *slot = k->len + 1;
    k->len += d + 1;
    k->n++;
    if (d == 0) k->acc = true;
    if (!k->hashed && k->n == SINK_SCAN) { /* switch to the table */
        k->hoff = tl_hoff;
        memset(k->hoff, 0, sizeof tl_hoff);
        k->work += SINK_HCAP / 64;
        for (int off = 0; off < k->len; off += k->v[off] + 1) *sink_slot(k, k->v + off + 1, k->v[off]) = off + 1;
        k->hashed = true;
    }
}

#define MAX_BRANCH_NEST 64
#define MAX_CLOSURE_STEPS 65536

/* Expands stack s[0..d) (top last) until its top is a byte set, or it is empty (complete),
 * adding each result to k. Alternatives other than the last are expanded on a copy. */
static void closure(const gram_t *g, int32_t *s, int d, struct sink *k, int nest, int *steps) {
    for (;;) {
        if (++*steps > MAX_CLOSURE_STEPS) {
            k->ovf = true;
            return;
        }
        k->work++;
        if (d == 0) {
            sink_add(k, s, 0);
            return;
        }
        int32_t p = s[d - 1];
        uint32_t e = g->elems[p];
        if (GE_TYPE(e) == GE_CHARS) {
            sink_add(k, s, d);
            return;
        }
        if (GE_TYPE(e) == GE_END) {
            d--; /* return to the caller's saved position */
            continue;
        }
        int r = (int)GE_ARG(e);
        if (g->lazy[r] >= 0) { /* byte-dispatched: the next byte expands it (advance_stack) */
            sink_add(k, s, d);
            return;
        }
        if (GE_TYPE(g->elems[p + 1]) == GE_END) d--; /* tail call: no return frame */
        else s[d - 1] = p + 1;
        int a0 = g->rule_off[r], a1 = g->rule_off[r + 1];
        if (a0 == a1) return; /* the rule matches nothing */
        if (d + 1 > GRAM_MAX_DEPTH) {
            k->ovf = true;
            return;
        }
        if (a1 - a0 > 1) {
            if (nest >= MAX_BRANCH_NEST) {
                k->ovf = true;
                return;
            }
            int32_t copy[GRAM_MAX_DEPTH];
            for (int a = a0; a < a1 - 1; a++) {
                memcpy(copy, s, (size_t)d * sizeof *s);
                copy[d] = g->alt_start[a];
                closure(g, copy, d + 1, k, nest + 1, steps);
            }
        }
        s[d] = g->alt_start[a1 - 1];
        d++;
    }
}

/* The bytes the top of stack s[0..d) (d > 0) accepts. */
static const uint8_t *top_set(const gram_t *g, const int32_t *s, int d) {
    uint32_t e = g->elems[s[d - 1]];
    return g->sets[GE_TYPE(e) == GE_CHARS ? GE_ARG(e) : (uint32_t)g->lazy[GE_ARG(e)]];
}

/* Advances stack s[0..d) (its top accepts byte; s is scratch, modified) by byte into k. A
 * byte-dispatched rule at the top is entered the way closure enters a rule (tail call or
 * return frame), then each alternative whose first set holds byte is advanced in turn. */
static void advance_stack(const gram_t *g, int32_t *s, int d, uint8_t byte, struct sink *k) {
    int32_t p = s[d - 1];
    uint32_t e = g->elems[p];
    if (GE_TYPE(e) == GE_CHARS) {
        s[d - 1]++;
        int steps = 0;
        closure(g, s, d, k, 0, &steps);
        return;
    }
    int r = (int)GE_ARG(e);
    if (GE_TYPE(g->elems[p + 1]) == GE_END) d--; /* tail call: no return frame */
    else s[d - 1] = p + 1;
    if (d + 1 > GRAM_MAX_DEPTH) {
        k->ovf = true;
        return;
    }
    int32_t copy[GRAM_MAX_DEPTH];
    for (int a = g->rule_off[r]; a < g->rule_off[r + 1]; a++) {
        k->work++;
        memcpy(copy, s, (size_t)d * sizeof *s);
        copy[d] = g->alt_start[a];
        if (!gset_has(top_set(g, copy, d + 1), byte)) continue;
        advance_stack(g, copy, d + 1, byte, k);
    }
}

/* Advances every stack of (v, len) whose top accepts byte into k. */
static void advance_into(const gram_t *g, const int32_t *v, int len, uint8_t byte, struct sink *k) {
    int32_t tmp[GRAM_MAX_DEPTH];
    for (int off = 0; off < len;) {
        int d = v[off];
        const int32_t *s = v + off + 1;
        off += d + 1;
        k->work++;
        if (d == 0 || !gset_has(top_set(g, s, d), byte)) continue;
        memcpy(tmp, s, (size_t)d * sizeof *s);
        advance_stack(g, tmp, d, byte, k);
    }
}

int gstate_advance_raw(const gram_t *g, const int32_t *in_v, int in_len, uint8_t byte,
                       int32_t *out_v, int out_cap, int *n_out, bool *acc, bool *ovf, uint64_t *work) {
    struct sink k = {.v = out_v, .cap = out_cap};
    advance_into(g, in_v, in_len, byte, &k);
    if (k.full) return -1; /* not counted: the caller retries with room (counts stay
                              independent of buffer sizes) */
    *work += k.work;
    *n_out = k.n;
    *acc = k.acc;
    *ovf = k.ovf;
    return k.len;
}

static bool finish(struct sink *k, struct gstate *out) {
    out->v = k->v;
    out->cap = k->cap;
    out->len = k->len;
    out->n_stacks = k->n;
    out->accept = k->acc;
    out->overflow = k->ovf;
    out->wide = k->wide;
    return !k->oom;
}

bool gstate_advance_w(const gram_t *g, const struct gstate *in, uint8_t byte, struct gstate *out, uint64_t *work) {
    struct sink k = {.v = out->v, .cap = out->cap, .gs = out};
    advance_into(g, in->v, in->len, byte, &k);
    if (work) *work += k.work;
    return finish(&k, out);
}

bool gstate_advance(const gram_t *g, const struct gstate *in, uint8_t byte, struct gstate *out) {
    return gstate_advance_w(g, in, byte, out, NULL);
}

bool gstate_start(const gram_t *g, struct gstate *out) {
    struct sink k = {.v = out->v, .cap = out->cap, .gs = out};
    int32_t tmp[GRAM_MAX_DEPTH];
    int r = g->root;
    for (int a = g->rule_off[r]; a < g->rule_off[r + 1]; a++) {
        tmp[0] = g->alt_start[a];
        int steps = 0;
        closure(g, tmp, 1, &k, 0, &steps);
    }
    return finish(&k, out);
}

void gstate_free(struct gstate *s) {
    free(s->v);
    memset(s, 0, sizeof *s);
}

bool gstate_copy(struct gstate *dst, const struct gstate *src) {
    if (dst->cap < src->len) {
        int32_t *nv = kv_realloc(dst->v, (size_t)(src->len ? src->len : 1) * sizeof *nv);
        if (!nv) return false;
        dst->v = nv;
        dst->cap = src->len ? src->len : 1;
    }
    if (src->len) memcpy(dst->v, src->v, (size_t)src->len * sizeof *src->v);
    dst->len = src->len;
    dst->n_stacks = src->n_stacks;
    dst->accept = src->accept;
    dst->overflow = src->overflow;
    dst->wide = src->wide;
    return true;
}

static int stack_cmp(const int32_t *a, const int32_t *b) {
    if (a[0] != b[0]) return a[0] < b[0] ? -1 : 1;
    for (int i = 1; i <= a[0]; i++)
        if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
    return 0;
}

void gstate_canon(struct gstate *s) {
    if (s->n_stacks < 2) return;
    /* insertion sort of stack offsets, then rewrite (states hold few stacks) */
    int n = s->n_stacks;
    int *off = kv_malloc((size_t)n * sizeof *off);
    int32_t *nv = kv_malloc((size_t)s->len * sizeof *nv);
    if (!off || !nv) { /* not canonical: only costs cache hits */
        free(off);
        free(nv);
        return;
    }
    for (int i = 0, o = 0; i < n; i++) {
        off[i] = o;
        o += s->v[o] + 1;
    }
    for (int i = 1; i < n; i++) {
        int x = off[i], j = i;
        while (j > 0 && stack_cmp(s->v + off[j - 1], s->v + x) > 0) {
            off[j] = off[j - 1];
            j--;
        }
        off[j] = x;
    }
    int w = 0;
    for (int i = 0; i < n; i++) {
        int l = s->v[off[i]] + 1;
        memcpy(nv + w, s->v + off[i], (size_t)l * sizeof *nv);
        w += l;
    }
    memcpy(s->v, nv, (size_t)w * sizeof *nv);
    free(off);
    free(nv);
}

void gstate_next_bytes(const gram_t *g, const struct gstate *s, uint8_t out[32]) {
    memset(out, 0, 32);
    for (int off = 0; off < s->len;) {
        int d = s->v[off];
        if (d > 0) {
            const uint8_t *set = top_set(g, s->v + off + 1, d);
            for (int i = 0; i < 32; i++) out[i] |= set[i];
        }
        off += d + 1;
    }
}
