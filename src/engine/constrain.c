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

void constrain_step_begin(struct engine *e) {
    e->n_gwork = 0;
    e->n_gstates = 0;
}

/* Whether (group, key) was charged in this step; records it when not. A failed allocation
 * answers false (the state is charged again: a stricter count, never a looser one). */
static bool state_charged(struct engine *e, uint64_t group, uint64_t key) {
    for (int i = 0; i < e->n_gstates; i++)
        if (e->gstates[i].group == group && e->gstates[i].key == key) return true;
    if (e->n_gstates == e->cap_gstates) {
        int nc = e->cap_gstates ? 2 * e->cap_gstates : 16;
        struct constrain_state *ns = kv_realloc(e->gstates, (size_t)nc * sizeof *ns);
        if (!ns) return false;
        e->gstates = ns;
        e->cap_gstates = nc;
    }
    e->gstates[e->n_gstates++] = (struct constrain_state){group, key};
    return false;
}

/* The work r's request has spent on masks in this step (an entry per request with a grammar
 * in the step: a few). NULL on ENOMEM (the mask then gets a whole budget). */
static uint64_t *group_work(struct engine *e, uint64_t group) {
    for (int i = 0; i < e->n_gwork; i++)
        if (e->gwork[i].group == group) return &e->gwork[i].work;
    if (e->n_gwork == e->cap_gwork) {
        int nc = e->cap_gwork ? 2 * e->cap_gwork : 16;
        struct constrain_work *nw = kv_realloc(e->gwork, (size_t)nc * sizeof *nw);
        if (!nw) return NULL;
        e->gwork = nw;
        e->cap_gwork = nc;
    }
    e->gwork[e->n_gwork] = (struct constrain_work){group, 0};
    return &e->gwork[e->n_gwork++].work;
}

int constrain_mask_logits(struct engine *e, struct request *r, float *logits) {
    uint64_t t0 = kv_now_ns();
    int n = 0;
    /* one budget per request and step, shared by its n > 1 sequences: each distinct parser
     * state is charged once, what its mask's walk costs (also when the mask is cached), so
     * the outcome depends only on the request's own sequences, never on other requests or on
     * what the cache holds; and the real work of a step is at most what is charged */
    uint64_t budget = gram_mask_budget();
    const uint64_t *mask;
    if (state_charged(e, r->group, gram_matcher_state_key(r->gm))) {
        mask = gram_matcher_mask_within(r->gm, budget, &n); /* a sibling's mask, in budget */
    } else {
        uint64_t *used = group_work(e, r->group);
        uint64_t left = !used ? budget : *used < budget ? budget - *used : 0;
        mask = gram_matcher_mask_within(r->gm, left, &n);
        if (used) *used += gram_matcher_last_work(r->gm);
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
    free(e->gstates);
    e->gstates = NULL;
    e->n_gstates = e->cap_gstates = 0;
    gram_vocab_free(e->gvocab);
    e->gvocab = NULL;
}
