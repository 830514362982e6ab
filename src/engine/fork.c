/*
 * fork: n > 1 choices of one prompt (engine_request_params.n).
 *
 * The request is scheduled, admitted and prefilled as one sequence. When its prompt is
 * computed and the first logits row is ready, it forks:
 *
 *   choice 0 (the request)  blocks [ b0 | b1 | b2* ]      * = partial last prompt block
 *   choice i (a clone)      blocks [ b0 | b1 | c_i ]      b0, b1 shared (kv_pool_ref);
 *                                                         c_i = a copy of b2 (backend
 *                                                         copy_blocks), so each choice
 *                                                         appends its own tokens to it
 *
 * Without a free block or a backend that copies blocks, choice i holds only the full blocks
 * and recomputes its partial block's prompt tokens in its next step (bitwise the same K/V).
 * Every choice samples its first token from its own copy of the same logits row, with its
 * own RNG seeded seed_base + i (vLLM: child i of a parent with seed s uses s + i), so choice
 * i equals the request run alone with n = 1 and seed s + i. After the fork the choices are
 * independent running requests (each preempted, finished or cancelled on its own) sharing
 * the group id for cancellation and events.
 *
 * Full shared blocks are never written after the fork (a choice writes only from position
 * n_prompt on, which lies in its own partial-block copy or in blocks it allocates), which is
 * what the pin contract of kvcache.h requires of shared (and registered) blocks.
 */
#include "engine_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kv_status fork_request_init(struct request *r, const struct engine_request_params *p) {
    r->n_choices = p->n > 1 ? p->n : 1;
    r->min_tokens = p->min_tokens;
    r->priority = p->priority;
    if (p->n_logit_bias > 0) {
        r->bias = kv_malloc((size_t)p->n_logit_bias * sizeof *r->bias);
        if (!r->bias) return KV_ENOMEM;
        memcpy(r->bias, p->logit_bias, (size_t)p->n_logit_bias * sizeof *r->bias);
        r->n_bias = p->n_logit_bias;
    }
    if (p->n_stop_token_ids > 0) {
        r->stop_ids = kv_malloc((size_t)p->n_stop_token_ids * sizeof *r->stop_ids);
        if (!r->stop_ids) return KV_ENOMEM;
        memcpy(r->stop_ids, p->stop_token_ids, (size_t)p->n_stop_token_ids * sizeof *r->stop_ids);
        r->n_stop_ids = p->n_stop_token_ids;
    }
    return KV_OK;
}

static void *dup_bytes(const void *src, size_t n) {
    if (!src || n == 0) return NULL;
    void *d = kv_malloc(n);
    if (d) memcpy(d, src, n);
    return d;
}

/* A clone of r (tokens: the prompt; no blocks yet) as choice index. NULL on ENOMEM. */
static struct request *clone_choice(struct engine *e, const struct request *r, int index) {
    struct request *c = kv_calloc(1, sizeof *c);
    if (!c) return NULL;
    c->cb = r->cb;
    c->user = r->user;
    c->n_prompt = c->n_tokens = r->n_prompt;
    c->cap = r->cap;
    c->blocks_cap = r->blocks_cap;
    c->max_gen = r->max_gen;
    c->sp = r->sp;
    c->ignore_eos = r->ignore_eos;
    c->seed_base = r->seed_base;
    kv_rng_seed(&c->rng, r->seed_base + (uint64_t)index);
    c->n_choices = 1;
    c->index = index;
    c->group = r->group;
    c->min_tokens = r->min_tokens;
    c->priority = r->priority;
    c->t_arrival_ns = r->t_arrival_ns;
    c->t_admitted_ns = r->t_admitted_ns;
    c->state = REQ_PREFILL;
    c->cached_tokens = r->cached_tokens;
    c->wait_passes = r->wait_passes;
    c->n_bias = r->n_bias;
    c->n_stop_ids = r->n_stop_ids;
    c->root_len = r->root_len;
    c->root_done = r->root_done;
    c->root_hash = r->root_hash;
    c->root_uid = r->root_uid;
    c->tokens = kv_malloc((size_t)c->cap * sizeof *c->tokens);
    c->blocks = kv_malloc((size_t)c->blocks_cap * sizeof *c->blocks);
    c->bhash = kv_malloc((size_t)c->blocks_cap * sizeof *c->bhash);
    c->buid = kv_calloc((size_t)c->blocks_cap, sizeof *c->buid);
    c->bias = dup_bytes(r->bias, (size_t)r->n_bias * sizeof *r->bias);
    c->stop_ids = dup_bytes(r->stop_ids, (size_t)r->n_stop_ids * sizeof *r->stop_ids);
    c->root_bytes = dup_bytes(r->root_bytes, r->root_len);
    c->gm = r->gm ? gram_matcher_clone(r->gm) : NULL; /* its own grammar state, at the start */
    if (!c->tokens || !c->blocks || !c->bhash || !c->buid || (r->n_bias && !c->bias) || (r->gm && !c->gm) ||
        (r->n_stop_ids && !c->stop_ids) || (r->root_len && !c->root_bytes) ||
        stop_init(&c->stop, (const char *const *)r->stop.stops, r->stop.n_stops) != KV_OK) {
        engine_request_free(c);
        return NULL;
    }
    memcpy(c->tokens, r->tokens, (size_t)r->n_prompt * sizeof *c->tokens);
    pthread_mutex_lock(&e->mu);
    c->id = ++e->next_id;
    pthread_mutex_unlock(&e->mu);
    return c;
}

/* Gives c r's prompt blocks: the full ones shared, the partial one copied when a block and
 * the backend's copy_blocks are available (else c recomputes those tokens). */
static void share_blocks(struct engine *e, const struct request *r, struct request *c) {
    int T = e->cfg.tokens_per_block;
    int full = r->n_prompt / T;
    if (full > r->n_blocks) full = r->n_blocks;
    for (int i = 0; i < full; i++) {
        kv_pool_ref(e->pool, r->blocks[i]);
        c->blocks[i] = r->blocks[i];
    }
    c->n_blocks = full;
    c->n_computed = full * T;
    int nh = r->n_hashed < full ? r->n_hashed : full;
    memcpy(c->bhash, r->bhash, (size_t)nh * sizeof *c->bhash);
    c->n_hashed = nh;
    c->n_reg = r->n_reg < full ? r->n_reg : full;
    memcpy(c->buid, r->buid, (size_t)c->n_reg * sizeof *c->buid);
    if (full == r->n_blocks || r->n_computed < r->n_prompt || !e->be->ops->copy_blocks) return;
    int b = kv_pool_alloc(e->pool);
    if (b < 0) return;
    /* an eviction to the host tier queued a copy out of b: it must run before b is written */
    kv_status st = reuse_flush_copies(e);
    if (st == KV_OK) st = e->be->ops->copy_blocks(e->be, &r->blocks[full], &b, 1);
    if (st != KV_OK) {
        KV_ERROR("engine: block copy for a choice failed (%s); it recomputes its prompt tail",
                 kv_status_str(st));
        kv_pool_release(e->pool, b);
        return;
    }
    c->blocks[c->n_blocks++] = b;
    c->n_computed = r->n_prompt;
}

/* A choice that could not be created still gets its terminal event. */
static void fail_unborn(struct engine *e, const struct request *r, int index) {
    struct request u = *r;
    u.n_choices = 1;
    u.index = index;
    u.terminal_sent = false;
    u.unborn = true;
    engine_post_terminal(e, &u, ENGINE_EV_ERROR, FINISH_NONE, KV_ENOMEM,
                         "out of memory while creating a choice");
}

int fork_choices(struct engine *e, struct request *r, const float *logits) {
    int n = r->n_choices, sampled = 0;
    r->n_choices = 1;
    for (int i = 1; i < n; i++) {
        struct request *c = clone_choice(e, r, i);
        if (!c || engine_vec_grow((void **)&e->running, &e->cap_running, e->n_running + 1,
                                  sizeof *e->running)) {
            engine_request_free(c);
            fail_unborn(e, r, i);
            continue;
        }
        pthread_mutex_lock(&e->stats_mu);
        e->stats.requests_total++;
        pthread_mutex_unlock(&e->stats_mu);
        share_blocks(e, r, c);
        e->running[e->n_running++] = c;
        memcpy(e->fork_row, logits, (size_t)e->n_vocab * sizeof *e->fork_row);
        if (engine_sample(e, c, e->fork_row)) sampled++;
    }
    return sampled;
}
