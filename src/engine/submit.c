/*
 * submit: the caller's side of the engine queues (see engine.h for the contract). engine_submit
 * checks a request's parameters (a bad field: KV_EINVAL / KV_ETOOLONG / KV_EUNSUPPORTED with a
 * message naming it; a full queue KV_EBUSY, a stopping engine KV_ECANCELLED, an unusable backend
 * KV_EIO), builds the request and queues it on incoming[] under mu, nothing queued or leaked on
 * failure; engine_cancel queues a cancellation. The engine thread (engine.c) drains both. Any
 * thread.
 */
#include "engine_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kv_status check_params(const struct engine *e, const struct engine_request_params *p,
                              char *err, size_t errlen) {
    const struct sampling_params *sp = &p->sp;
    if (!p->prompt_ids || p->n_prompt < 1)
        return kv_errf(KV_EINVAL, err, errlen, "prompt is empty (at least one token is required)");
    if (p->n_prompt + 1 > (size_t)e->cfg.max_model_len)
        return kv_errf(KV_ETOOLONG, err, errlen,
                       "prompt has %zu tokens, max_model_len is %d (the prompt plus at least one "
                       "generated token must fit)",
                       p->n_prompt, e->cfg.max_model_len);
    for (size_t i = 0; i < p->n_prompt; i++)
        if (p->prompt_ids[i] < 0 || p->prompt_ids[i] >= e->n_vocab)
            return kv_errf(KV_EINVAL, err, errlen,
                           "prompt token %zu has id %d, outside the vocabulary [0, %d)", i,
                           (int)p->prompt_ids[i], e->n_vocab);
    if (p->max_tokens < 1)
        return kv_errf(KV_EINVAL, err, errlen, "max_tokens must be >= 1 (got %d)", p->max_tokens);
    if (!(sp->temperature >= 0.0f) || isinf(sp->temperature))
        return kv_errf(KV_EINVAL, err, errlen, "temperature must be >= 0 (got %g)",
                       (double)sp->temperature);
    if (!(sp->top_p > 0.0f && sp->top_p <= 1.0f))
        return kv_errf(KV_EINVAL, err, errlen, "top_p must be in (0, 1] (got %g)",
                       (double)sp->top_p);
    if (sp->top_k < -1)
        return kv_errf(KV_EINVAL, err, errlen, "top_k must be >= 0 or -1 (got %d)", sp->top_k);
    if (!(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        return kv_errf(KV_EINVAL, err, errlen, "min_p must be in [0, 1] (got %g)",
                       (double)sp->min_p);
    if (!(sp->presence_penalty >= -2.0f && sp->presence_penalty <= 2.0f))
        return kv_errf(KV_EINVAL, err, errlen, "presence_penalty must be in [-2, 2] (got %g)",
                       (double)sp->presence_penalty);
    if (!(sp->frequency_penalty >= -2.0f && sp->frequency_penalty <= 2.0f))
        return kv_errf(KV_EINVAL, err, errlen, "frequency_penalty must be in [-2, 2] (got %g)",
                       (double)sp->frequency_penalty);
    if (!(sp->repetition_penalty > 0.0f) || isinf(sp->repetition_penalty))
        return kv_errf(KV_EINVAL, err, errlen, "repetition_penalty must be > 0 (got %g)",
                       (double)sp->repetition_penalty);
    if (sp->top_logprobs < 0 || sp->top_logprobs > ENGINE_MAX_TOP_LOGPROBS)
        return kv_errf(KV_EINVAL, err, errlen, "top_logprobs must be in [0, %d] (got %d)",
                       ENGINE_MAX_TOP_LOGPROBS, sp->top_logprobs);
    if (p->n_stop < 0 || (p->n_stop > 0 && !p->stop))
        return kv_errf(KV_EINVAL, err, errlen, "invalid stop list");
    if (p->n < 0 || p->n > ENGINE_MAX_CHOICES)
        return kv_errf(KV_EINVAL, err, errlen, "n must be in [1, %d] (got %d)", ENGINE_MAX_CHOICES, p->n);
    if (p->n > 1 && p->disagg != ENGINE_DISAGG_NONE && p->disagg != ENGINE_DISAGG_PROBE)
        return kv_errf(KV_EINVAL, err, errlen, "n > 1 is not supported on a disaggregated leg");
    if (p->n_logit_bias < 0 || (p->n_logit_bias > 0 && !p->logit_bias))
        return kv_errf(KV_EINVAL, err, errlen, "invalid logit_bias list");
    for (int i = 0; i < p->n_logit_bias; i++)
        if (p->logit_bias[i].id < 0 || p->logit_bias[i].id >= e->n_vocab ||
            !(p->logit_bias[i].bias >= -100.0f && p->logit_bias[i].bias <= 100.0f))
            return kv_errf(KV_EINVAL, err, errlen, "logit_bias entry %d (token %d, bias %g) is "
                           "outside the vocabulary [0, %d) or [-100, 100]", i,
                           (int)p->logit_bias[i].id, (double)p->logit_bias[i].bias, e->n_vocab);
    if (p->n_stop_token_ids < 0 || (p->n_stop_token_ids > 0 && !p->stop_token_ids))
        return kv_errf(KV_EINVAL, err, errlen, "invalid stop_token_ids list");
    for (int i = 0; i < p->n_stop_token_ids; i++)
        if (p->stop_token_ids[i] < 0 || p->stop_token_ids[i] >= e->n_vocab)
            return kv_errf(KV_EINVAL, err, errlen, "stop_token_ids[%d] = %d is outside the "
                           "vocabulary [0, %d)", i, (int)p->stop_token_ids[i], e->n_vocab);
    if (e->dev_sampling && (p->n > 1 || p->n_logit_bias > 0 || p->min_tokens > 0 || p->grammar))
        return kv_errf(KV_EUNSUPPORTED, err, errlen,
                       "%s needs the host sampler, and this worker samples on the device (start it "
                       "with --host-sampling)",
                       p->n > 1 ? "n > 1" : p->n_logit_bias ? "logit_bias" : p->min_tokens ? "min_tokens"
                                                                                  : "structured output");
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return kv_errf(KV_EINVAL, err, errlen, "min_tokens must be in [0, max_tokens = %d] (got %d)",
                       p->max_tokens, p->min_tokens);
    for (int i = 0; i < p->n_stop; i++)
        if (!p->stop[i]) return kv_errf(KV_EINVAL, err, errlen, "stop string %d is NULL", i);
    return KV_OK;
}

kv_status engine_submit(engine_t *e, const struct engine_request_params *p, engine_event_cb cb,
                        void *user, uint64_t *req_id, char *err, size_t errlen) {
    if (!e || !p || !cb) return kv_errf(KV_EINVAL, err, errlen, "engine_submit: NULL argument");
    kv_status st = check_params(e, p, err, errlen);
    if (st) return st;
    char why[256];
    if (!engine_healthy(e, why, sizeof why))
        return kv_errf(KV_EIO, err, errlen, "the compute backend is unusable (%s); restart the server", why);
    if (p->disagg == ENGINE_DISAGG_CONTEXT_ONLY || p->disagg == ENGINE_DISAGG_GENERATION_ONLY) {
        if (!e->has_xt)
            return kv_errf(KV_EUNSUPPORTED, err, errlen,
                           "this worker has no KV transfer (start it with --role context or "
                           "--role generation) and cannot serve disaggregated_params");
        if (p->disagg == ENGINE_DISAGG_GENERATION_ONLY && (!p->peer_endpoint || !*p->peer_endpoint))
            return kv_errf(KV_EINVAL, err, errlen,
                           "a generation_only request needs the context worker's endpoint "
                           "(disaggregated_params.ctx_info_endpoint)");
        if (p->n_first < 0 || p->n_first > 1 || (p->n_first && !p->first_tokens))
            return kv_errf(KV_EINVAL, err, errlen,
                           "first_gen_tokens must hold at most one token (got %d)", p->n_first);
        for (int i = 0; i < p->n_first; i++)
            if (p->first_tokens[i] < 0 || p->first_tokens[i] >= e->n_vocab)
                return kv_errf(KV_EINVAL, err, errlen,
                               "first_gen_tokens[%d] = %d is outside the vocabulary [0, %d)", i,
                               (int)p->first_tokens[i], e->n_vocab);
        if (p->n_first_top < 0 || p->n_first_top > ENGINE_MAX_TOP_LOGPROBS)
            return kv_errf(KV_EINVAL, err, errlen, "bad first-token top logprobs count");
        if (p->first_logprob && (p->first_logprob->id < 0 || p->first_logprob->id >= e->n_vocab))
            return kv_errf(KV_EINVAL, err, errlen, "first-token logprob id outside the vocabulary");
        for (int i = 0; p->first_top && i < p->n_first_top; i++)
            if (p->first_top[i].id < 0 || p->first_top[i].id >= e->n_vocab)
                return kv_errf(KV_EINVAL, err, errlen, "first-token top logprob id %d outside the "
                               "vocabulary", (int)p->first_top[i].id);
    } else if (p->disagg != ENGINE_DISAGG_NONE && p->disagg != ENGINE_DISAGG_PROBE) {
        return kv_errf(KV_EINVAL, err, errlen, "unknown disaggregation mode %d", (int)p->disagg);
    }

    struct request *r = kv_calloc(1, sizeof *r);
    if (!r) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    r->n_prompt = (int)p->n_prompt;
    r->max_gen = p->max_tokens;
    if (r->max_gen > e->cfg.max_model_len - r->n_prompt)
        r->max_gen = e->cfg.max_model_len - r->n_prompt;
    r->cap = r->n_prompt + r->max_gen;
    r->blocks_cap = kv_blocks_for_tokens(r->cap, e->cfg.tokens_per_block);
    r->tokens = kv_malloc((size_t)r->cap * sizeof *r->tokens);
    r->blocks = kv_malloc((size_t)r->blocks_cap * sizeof *r->blocks);
    if (!r->tokens || !r->blocks || reuse_request_init(r, p) != KV_OK ||
        stop_init(&r->stop, p->stop, p->n_stop) != KV_OK || fork_request_init(r, p) != KV_OK) {
        engine_request_free(r);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    kv_status gst = constrain_request_init(e, r, p->grammar, err, errlen);
    if (gst) {
        engine_request_free(r);
        return gst;
    }
    memcpy(r->tokens, p->prompt_ids, p->n_prompt * sizeof *r->tokens);
    r->n_tokens = r->n_prompt;
    r->sp = p->sp;
    r->ignore_eos = p->ignore_eos;
    r->cb = cb;
    r->user = user;
    r->t_arrival_ns = kv_now_ns();
    r->state = REQ_WAITING;
    r->disagg = p->disagg;
    r->disagg_id = p->disagg_id;
    r->context_first = p->context_first;
    if (p->disagg == ENGINE_DISAGG_GENERATION_ONLY) {
        r->peer = kv_strdup(p->peer_endpoint);
        if (!r->peer) {
            engine_request_free(r);
            return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        }
        r->n_first = p->n_first;
        for (int i = 0; i < p->n_first; i++) r->first[i] = p->first_tokens[i];
        if (p->first_logprob) {
            r->has_first_lp = true;
            r->first_lp = *p->first_logprob;
            r->n_first_top = p->first_top ? p->n_first_top : 0;
            for (int i = 0; i < r->n_first_top; i++) r->first_top[i] = p->first_top[i];
        }
        /* a generation leg waits for blocks at most as long as its sender keeps them */
        r->deadline_ns = r->t_arrival_ns + (uint64_t)((e->xt.timeout_s > 0 ? e->xt.timeout_s : 60.0) * 1e9);
    }

    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        engine_request_free(r);
        return kv_errf(KV_ECANCELLED, err, errlen, "engine is shutting down");
    }
    if (e->n_queued >= e->cfg.max_queue) {
        pthread_mutex_unlock(&e->mu);
        engine_request_free(r);
        return kv_errf(KV_EBUSY, err, errlen, "server busy: %d requests are already waiting",
                       e->cfg.max_queue);
    }
    if (e->n_incoming == e->cap_incoming) {
        int nc = e->cap_incoming ? e->cap_incoming * 2 : 64;
        void *np = kv_realloc(e->incoming, (size_t)nc * sizeof *e->incoming);
        if (!np) {
            pthread_mutex_unlock(&e->mu);
            engine_request_free(r);
            return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        }
        e->incoming = np;
        e->cap_incoming = nc;
    }
    r->id = r->group = ++e->next_id;
    r->seed_base = p->sp.has_seed ? p->sp.seed : kv_rng_next(&e->seed_rng);
    kv_rng_seed(&r->rng, r->seed_base);
    e->incoming[e->n_incoming++] = r;
    e->n_queued++;
    if (req_id) *req_id = r->id;
    pthread_mutex_lock(&e->stats_mu);
    e->stats.requests_total++;
    e->stats.prompt_tokens_total += p->n_prompt;
    pthread_mutex_unlock(&e->stats_mu);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return KV_OK;
}

void engine_cancel(engine_t *e, uint64_t req_id) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    if (e->n_cancels == e->cap_cancels) {
        int nc = e->cap_cancels ? e->cap_cancels * 2 : 16;
        void *np = kv_realloc(e->cancels, (size_t)nc * sizeof *e->cancels);
        if (!np) { /* logged by kv_realloc; the request runs to completion */
            pthread_mutex_unlock(&e->mu);
            return;
        }
        e->cancels = np;
        e->cap_cancels = nc;
    }
    e->cancels[e->n_cancels++] = req_id;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}
