/*
 * logits: the per-request logits processors that run before the sampler's penalties
 * (sampler.h), in vLLM's order:
 *
 *   raw logits --logit_bias (l[id] += bias)--> --min_tokens: while fewer than min_tokens
 *   tokens were generated, EOS (unless ignore_eos) and stop_token_ids get -inf--> penalties ...
 *
 * Both depend only on the request (its parameters and how many tokens it generated), so
 * outputs stay independent of batching. The reported logprobs are those of the processed
 * logits (a banned token reports -inf, serialized as -9999).
 */
#include "engine_internal.h"

#include <math.h>
#include <stdlib.h>

kv_status logits_init(struct engine *e) {
    int n = 0;
    for (int32_t id = 0; id < e->n_vocab; id++) n += engine_is_eog(e, id);
    e->eog_ids = kv_malloc((size_t)(n ? n : 1) * sizeof *e->eog_ids);
    if (!e->eog_ids) return KV_ENOMEM;
    e->n_eog = 0;
    for (int32_t id = 0; id < e->n_vocab; id++)
        if (engine_is_eog(e, id)) e->eog_ids[e->n_eog++] = id;
    return KV_OK;
}

bool logits_is_stop_id(const struct request *r, int32_t id) {
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == id) return true;
    return false;
}

void logits_apply(const struct engine *e, const struct request *r, float *logits) {
    for (int i = 0; i < r->n_bias; i++) logits[r->bias[i].id] += r->bias[i].bias;
    if (req_n_gen(r) >= r->min_tokens) return;
    if (!r->ignore_eos)
        for (int i = 0; i < e->n_eog; i++) logits[e->eog_ids[i]] = -INFINITY;
    for (int i = 0; i < r->n_stop_ids; i++) logits[r->stop_ids[i]] = -INFINITY;
}
