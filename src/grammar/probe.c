/* The compile-time bound on how many parses a grammar keeps open at once (gram_internal.h:
 * gram_probe). A regex such as (.*a){1000} is unambiguous to a backtracking engine's user but
 * not to a recognizer that follows every parse: after k letters 'a' it holds k parses (k
 * iterations may have ended), each costing work at every byte of every token of a mask. Such
 * grammars are refused when compiled, as vLLM's xgrammar and llguidance refuse grammars past
 * their own limits, instead of being matched slowly (or lossily) at every decode step.
 *
 *   state s0 --(byte class with the widest next state)--> s1 --> ... (<= GRAM_PROBE_DEPTH)
 *   refuse when a state holds GRAM_MAX_STACKS stacks; stop at a repeated state or budget.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

/* Bytes that every byte set of g treats alike form a class (one transition serves them
 * all): class[b] = the partition refined by each set in turn. Returns the number of classes
 * and one representative byte per class in rep. */
static int byte_classes(const gram_t *g, uint8_t cls[256], uint8_t rep[256]) {
    memset(cls, 0, 256);
    int n = 1;
    for (int si = 0; si < g->n_sets && n < 256; si++) {
        int map[512];
        for (int i = 0; i < 512; i++) map[i] = -1;
        int m = 0;
        uint8_t nc[256];
        for (int b = 0; b < 256; b++) {
            int key = cls[b] * 2 + (int)gset_has(g->sets[si], (unsigned)b);
            if (map[key] < 0) map[key] = m++;
            nc[b] = (uint8_t)map[key];
        }
        memcpy(cls, nc, 256);
        n = m;
    }
    int seen = 0;
    bool have[256] = {0};
    for (int b = 0; b < 256; b++)
        if (!have[cls[b]]) {
            have[cls[b]] = true;
            rep[seen++] = (uint8_t)b;
        }
    return seen;
}

static uint64_t state_hash(const struct gstate *s) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)s->len;
    for (int i = 0; i < s->len; i++) h = (h ^ (uint32_t)s->v[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

/* The first bytes of the path, printable (for the message). */
static void show_prefix(const uint8_t *p, int n, char *out, size_t cap) {
    size_t o = 0;
    int shown = n < 24 ? n : 24;
    for (int i = 0; i < shown && o + 5 < cap; i++) {
        uint8_t c = p[i];
        if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') out[o++] = (char)c;
        else o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    }
    if (n > shown && o + 4 < cap) o += (size_t)snprintf(out + o, cap - o, "...");
    out[o < cap ? o : cap - 1] = 0;
}

kv_status gram_probe(const gram_t *g, char *err, size_t errlen, uint64_t *work_out) {
    uint8_t cls[256], rep[256];
    int n_cls = byte_classes(g, cls, rep);
    struct gstate cur = {0}, nxt = {0}, best = {0};
    uint64_t *seen = kv_calloc(2 * GRAM_PROBE_DEPTH, sizeof *seen);
    uint8_t *path = kv_malloc(GRAM_PROBE_DEPTH);
    uint64_t work = 0;
    kv_status st = KV_OK;
    if (!seen || !path || !gstate_start(g, &cur)) {
        st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        goto out;
    }
    gstate_canon(&cur);
    for (int depth = 0;; depth++) {
        if (cur.wide || cur.n_stacks >= GRAM_MAX_STACKS) {
            char pre[200] = "at its start";
            if (depth) {
                char p[128];
                show_prefix(path, depth, p, sizeof p);
                snprintf(pre, sizeof pre, "after the %d-byte output '%s'", depth, p);
            }
            st = kv_errf(KV_ETOOLONG, err, errlen,
                         "the constraint is too ambiguous: %s it keeps more than %d parses open at once (the "
                         "limit; e.g. a repeated group whose iterations can end in many places, such as "
                         "(.*a){1000}, or more than %d alternatives that begin alike and are not plain strings)",
                         pre, GRAM_MAX_STACKS - 1, GRAM_MAX_STACKS - 1);
            break;
        }
        if (depth >= GRAM_PROBE_DEPTH || work > GRAM_PROBE_BUDGET) break;
        /* a state seen before: the widest path cycles from here */
        uint64_t h = state_hash(&cur) | 1;
        size_t slot = (size_t)(h % (2 * GRAM_PROBE_DEPTH));
        bool again = false;
        for (; seen[slot]; slot = (slot + 1) % (2 * GRAM_PROBE_DEPTH))
            if (seen[slot] == h) {
                again = true;
                break;
            }
        if (again) break;
        seen[slot] = h;
        uint8_t next[32];
        gstate_next_bytes(g, &cur, next);
        int best_n = 0, best_b = -1;
        for (int c = 0; c < n_cls; c++) {
            uint8_t b = rep[c];
            if (!gset_has(next, b)) continue;
            if (!gstate_advance_w(g, &cur, b, &nxt, &work)) {
                st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
                goto out;
            }
            if (nxt.n_stacks > best_n || (nxt.wide && !best.wide)) {
                best_n = nxt.n_stacks;
                best_b = b;
                struct gstate t = best;
                best = nxt;
                nxt = t;
            }
        }
        if (best_b < 0) break; /* complete: nothing may follow */
        path[depth] = (uint8_t)best_b;
        struct gstate t = cur;
        cur = best;
        best = t;
        best.n_stacks = 0;
        best.wide = false;
        gstate_canon(&cur);
    }
out:
    if (work_out) *work_out = work;
    gstate_free(&cur);
    gstate_free(&nxt);
    gstate_free(&best);
    free(seen);
    free(path);
    return st;
}
