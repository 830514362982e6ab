/*
 * Constrained decoding hooks of the engine (engine_internal.h): the grammar matcher of each
 * request masks its logits before sampling and advances with every token it gets.
 *
 *   submit: constrain_request_init -> r->gm (vocabulary trie built once per engine)
 *   step:   constrain_mask_logits (disallowed -> -inf) -> sampler_sample -> constrain_check
 *   token:  constrain_accept (engine_on_token): advance; final -> FINISH_STOP
 *
 * The matcher follows the generated tokens only, never the KV cache, so preemption,
 * recompute, prefix reuse and batching leave it untouched: a request's output depends only on
 * its own logits, as without a grammar.
 */
#include <math.h>
#include <stdlib.h>

#include "engine_internal.h"

static kv_status ensure_vocab(struct engine *e, char *err, size_t errlen) {
    pthread_mutex_lock(&e->gv_mu);
    if (!e->gvocab) {
        int32_t *eog = kv_malloc(64 * sizeof *eog);
        int n = 0;
        for (int32_t id = 0; eog && id < e->n_vocab && n < 64; id++)
            if (engine_is_eog(e, id)) eog[n++] = id;
        uint64_t t0 = kv_now_ns();
        e->gvocab = eog ? gram_vocab_new(e->t, e->n_vocab, eog, n) : NULL;
        free(eog);
        if (e->gvocab)
            KV_INFO("engine: constrained decoding vocabulary ready (%d tokens, %d end tokens, %.0f ms)",
                    e->n_vocab, n, (double)(kv_now_ns() - t0) / 1e6);
    }
    kv_status st = e->gvocab ? KV_OK : kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    pthread_mutex_unlock(&e->gv_mu);
    return st;
}

kv_status constrain_request_init(struct engine *e, struct request *r, gram_t *g, char *err, size_t errlen) {
    if (!g) return KV_OK;
    if (!e->t)
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "constrained decoding needs the model's tokenizer");
    kv_status st = ensure_vocab(e, err, errlen);
    if (st) return st;
    r->gm = gram_matcher_new(g, e->gvocab);
    return r->gm ? KV_OK : kv_errf(KV_ENOMEM, err, errlen, "out of memory");
}

void constrain_step_begin(struct engine *e) { e->n_gwork = 0; }

/* The step's entry for a request (is_state false, key 0) or for a (request, state) pair;
 * added with work 0 (*fresh set) when absent. A few entries per constrained request in the
 * step. NULL on ENOMEM. */
static struct constrain_work *step_entry(struct engine *e, uint64_t group, uint64_t key, bool is_state,
                                         bool *fresh) {
    *fresh = false;
    for (int i = 0; i < e->n_gwork; i++)
        if (e->gwork[i].group == group && e->gwork[i].key == key && e->gwork[i].is_state == is_state)
            return &e->gwork[i];
    if (e->n_gwork == e->cap_gwork) {
        int nc = e->cap_gwork ? 2 * e->cap_gwork : 16;
        struct constrain_work *nw = kv_realloc(e->gwork, (size_t)nc * sizeof *nw);
        if (!nw) return NULL;
        e->gwork = nw;
        e->cap_gwork = nc;
    }
    *fresh = true;
    e->gwork[e->n_gwork] = (struct constrain_work){group, key, 0, is_state};
    return &e->gwork[e->n_gwork++];
}

int constrain_mask_logits(struct engine *e, struct request *r, float *logits) {
    uint64_t t0 = kv_now_ns();
    int n = 0;
    /* one budget per request and step, shared by its n > 1 sequences: each distinct parser
     * state is charged once, what its mask's walk costs (also when the mask is cached), so
     * the outcome depends only on the request's own sequences, never on other requests or on
     * what the cache holds; and the real work of a step is at most what is charged */
    /* (a failed allocation charges the state again, or gives a whole budget: never more
     * than one request's budget is spent per entry) */
    uint64_t budget = gram_mask_budget();
    const uint64_t *mask;
    bool fresh;
    if (step_entry(e, r->group, gram_matcher_state_key(r->gm), true, &fresh) && !fresh) {
        mask = gram_matcher_mask_within(r->gm, budget, &n); /* a sibling's mask, in budget */
    } else {
        struct constrain_work *req = step_entry(e, r->group, 0, false, &fresh);
        uint64_t left = !req ? budget : req->work < budget ? budget - req->work : 0;
        mask = gram_matcher_mask_within(r->gm, left, &n);
        if (req) req->work += gram_matcher_last_work(r->gm);
    }
    e->grammar_ns += kv_now_ns() - t0;
    if (!mask) return gram_matcher_status(r->gm) == KV_ETOOLONG ? -2 : -1;
    sampler_apply_mask(logits, e->n_vocab, mask);
    e->grammar_steps++;
    return n;
}

int32_t constrain_check(struct engine *e, struct request *r, const float *logits, int32_t id) {
    const uint64_t *mask = gram_matcher_mask(r->gm, NULL); /* cached: same state as the mask */
    if (mask && id >= 0 && id < e->n_vocab && ((mask[id >> 6] >> (id & 63)) & 1)) return id;
    int32_t best = -1;
    for (int32_t i = 0; mask && i < e->n_vocab; i++)
        if (((mask[i >> 6] >> (i & 63)) & 1) && (best < 0 || logits[i] > logits[best] || isnan(logits[best])))
            best = i;
    return best >= 0 ? best : id;
}

bool constrain_accept(struct engine *e, struct request *r, int32_t id, bool *final) {
    uint64_t t0 = kv_now_ns();
    *final = false;
    bool ok = gram_matcher_accept(r->gm, id);
    if (ok) *final = gram_matcher_is_final(r->gm);
    e->grammar_ns += kv_now_ns() - t0;
    return ok;
}

void constrain_destroy(struct engine *e) {
    free(e->gwork);
    e->gwork = NULL;
    e->n_gwork = e->cap_gwork = 0;

    gram_vocab_free(e->gvocab);
    e->gvocab = NULL;
}
