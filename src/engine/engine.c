/*
 * engine: the engine thread, its queues, the step loop and event delivery (see engine.h);
 * submit.c checks and queues requests (engine_submit, engine_cancel).
 *
 *   submit()/cancel() --(mu: incoming[], cancels[], cv)--> engine thread:
 *       drain queues -> cancels -> sched_step() -> backend forward -> sample ->
 *       detokenize (tok_stream) -> stop strings -> callbacks -> stats snapshot
 */
#include "engine_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *finish_reason_str(enum finish_reason r) {
    switch (r) {
    case FINISH_STOP: return "stop";
    case FINISH_LENGTH: return "length";
    case FINISH_CANCELLED: return "cancelled";
    case FINISH_NOT_FINISHED: return "not_finished";
    default: return "none";
    }
}

const struct engine_config *engine_config(const engine_t *e) { return &e->cfg; }

void engine_queued_add(struct engine *e, int delta) {
    pthread_mutex_lock(&e->mu);
    e->n_queued += delta;
    pthread_mutex_unlock(&e->mu);
}

/* ---------------------------------------------------------------- requests */

void engine_request_free(struct request *r) {
    if (!r) return;
    free(r->peer);
    free(r->bias);
    free(r->stop_ids);
    free(r->tokens);
    free(r->blocks);
    reuse_request_free(r);
    stop_free(&r->stop);
    if (r->stream) tok_stream_free(r->stream);
    gram_matcher_free(r->gm);
    free(r);
}

void engine_post_terminal(struct engine *e, struct request *r, enum engine_event_type type,
                          enum finish_reason fin, kv_status st, const char *msg) {
    if (r->terminal_sent) return;
    r->terminal_sent = true;
    if (r->state != REQ_TRANSFER_OUT && r->state != REQ_TRANSFER_IN) /* those keep blocks */
        r->state = type == ENGINE_EV_ERROR ? REQ_FAILED
                   : fin == FINISH_CANCELLED ? REQ_CANCELLED
                                             : REQ_FINISHED;
    struct engine_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = type;
    ev.req_id = r->group;
    ev.index = r->index;
    ev.text = "";
    ev.finish = fin;
    ev.prompt_tokens = r->n_prompt;
    ev.completion_tokens = req_n_gen(r);
    ev.cached_tokens = r->cached_tokens > 0 ? r->cached_tokens : 0;
    ev.status = st;
    ev.message = msg;
    ev.t_arrival_ns = r->t_arrival_ns;
    ev.t_admitted_ns = r->t_admitted_ns;
    ev.t_first_token_ns = r->t_first_ns;
    /* counted before the event goes out: a client that has its answer must find it in
     * /metrics (the HTTP thread may reply as soon as the callback returns) */
    if (!r->unborn) {
        pthread_mutex_lock(&e->stats_mu);
        /* an error with KV_ECANCELLED is a cancellation (shutdown, a KV transfer the peer
         * cancelled: the router released the context leg before this leg heard its client
         * leave), not a failure */
        if (type == ENGINE_EV_ERROR && st != KV_ECANCELLED) e->stats.requests_failed++;
        else if (fin == FINISH_CANCELLED || st == KV_ECANCELLED) e->stats.requests_cancelled++;
        else e->stats.requests_finished++;
        pthread_mutex_unlock(&e->stats_mu);
    }
    r->cb(&ev, r->user);
    /* n > 1 ended before its fork (cancel, failure, shutdown): every choice still gets its
     * terminal event */
    for (int i = 1; i < r->n_choices; i++) {
        struct request u = *r;
        u.n_choices = 1;
        u.index = i;
        u.terminal_sent = false;
        u.unborn = true;
        engine_post_terminal(e, &u, type, fin, st, msg);
    }
    r->n_choices = 1;
}

void engine_fail_request(struct engine *e, struct request *r, kv_status st, const char *msg) {
    sched_free_blocks(e, r);
    engine_post_terminal(e, r, ENGINE_EV_ERROR, FINISH_NONE, st, msg);
    engine_request_free(r);
}

/* Ends a request that is already out of the lists. */
static void finish_request(struct engine *e, struct request *r, enum finish_reason fin) {
    sched_free_blocks(e, r);
    engine_post_terminal(e, r, ENGINE_EV_FINISH, fin, KV_OK, NULL);
    engine_request_free(r);
}

bool engine_is_eog(const struct engine *e, int32_t id) {
    const struct model_config *c = &e->m->cfg;
    if (e->t && tok_is_eog(e->t, id)) return true;
    if (id == c->eos_id) return true;
    for (int i = 0; i < c->n_eos_ids && i < 8; i++)
        if (id == c->eos_ids[i]) return true;
    return false;
}

bool engine_healthy(engine_t *e, char *why, size_t whylen) {
    if (!e->be->ops->healthy) return true;
    return e->be->ops->healthy(e->be, why, whylen);
}

void engine_get_stats(engine_t *e, struct engine_stats *out) {
    pthread_mutex_lock(&e->stats_mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->stats_mu);
}

/* ---------------------------------------------------------------- engine thread */

void engine_publish_stats(struct engine *e, bool step) {
    int nfree = kv_pool_n_free(e->pool), ntot = kv_pool_n_blocks(e->pool);
    pthread_mutex_lock(&e->stats_mu);
    if (step) e->stats.steps_total++;
    e->stats.preemptions_total += e->n_preempt_step;
    e->n_preempt_step = 0;
    e->stats.n_waiting = e->n_waiting;
    e->stats.n_running = e->n_running;
    e->stats.kv_blocks_total = ntot;
    e->stats.kv_blocks_free = nfree;
    e->stats.kv_blocks_used = ntot - nfree;
    reuse_fill_stats(e, &e->stats);
    int nout = 0;
    for (int i = 0; i < e->n_xfer; i++) nout += e->xfer[i]->state == REQ_TRANSFER_OUT;
    e->stats.n_transfer_out = nout;
    e->stats.n_transfer_in = e->n_xfer - nout;
    e->stats.kv_sends_ok = e->xstats[0];
    e->stats.kv_sends_failed = e->xstats[1];
    e->stats.kv_recvs_ok = e->xstats[2];
    e->stats.kv_recvs_failed = e->xstats[3];
    e->stats.kv_transfer_timeouts = e->xstats[4];
    e->stats.grammar_ns = e->grammar_ns;
    e->stats.grammar_steps = e->grammar_steps;
    pthread_mutex_unlock(&e->stats_mu);
}

struct request *engine_find_live(struct engine *e, uint64_t id) {
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i]->group == id) return e->running[i];
    for (int i = 0; i < e->n_waiting; i++)
        if (e->waiting[i]->group == id) return e->waiting[i];
    return NULL;
}

/* Appends the newly sampled token id to r, emits its DELTA and, if r is done, its FINISH.
 * Returns true if r was finished (and freed). */
bool engine_on_token(struct engine *e, struct request *r, int32_t id,
                     const struct token_logprob *chosen, const struct token_logprob *top,
                     int n_top) {
    r->tokens[r->n_tokens++] = id;
    r->state = REQ_DECODE;
    if (!r->t_first_ns) r->t_first_ns = kv_now_ns();
    /* with a grammar, an end token is only ever allowed when the output is complete: it
     * ends the request even with ignore_eos, as does a complete output nothing may extend */
    bool gfinal = false;
    if (r->gm && !constrain_accept(e, r, id, &gfinal)) {
        sched_remove(e, r);
        engine_fail_request(e, r, KV_EINTERNAL, "a token outside the request's grammar reached the output");
        return true;
    }
    bool eog = (!r->ignore_eos || r->gm) && engine_is_eog(e, id);
    bool stop_id = !eog && r->n_stop_ids > 0 && logits_is_stop_id(r, id);
    bool length = req_n_gen(r) >= r->max_gen;
    kv_status st = KV_OK;

    e->text.len = 0;
    e->text2.len = 0;
    if (e->t) {
        if (!r->stream) {
            r->stream = tok_stream_new(e->t, r->tokens, (size_t)r->n_prompt);
            if (!r->stream) st = KV_ENOMEM;
        }
        if (!st && !eog) st = tok_stream_push(r->stream, id, &e->text);
        if (!st && (eog || length || stop_id || gfinal)) st = tok_stream_flush(r->stream, &e->text);
    }
    kv_status st2 = KV_OK;
    bool stopped = false;
    if (req_n_gen(r) <= r->min_tokens) /* min_tokens: no stop string can end it yet (vLLM) */
        st2 = kv_buf_append(&e->text2, e->text.data ? e->text.data : "", e->text.len);
    else
        stopped = stop_feed(&r->stop, e->text.data ? e->text.data : "", e->text.len, &e->text2,
                            &st2);
    if (!st) st = st2;
    if (!st && !stopped && (eog || length || stop_id || gfinal)) st = stop_flush(&r->stop, &e->text2);
    if (st) {
        sched_remove(e, r);
        engine_fail_request(e, r, st, "detokenization failed (out of memory or bad token)");
        return true;
    }

    struct engine_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = ENGINE_EV_DELTA;
    ev.req_id = r->group;
    ev.index = r->index;
    ev.text = e->text2.len ? e->text2.data : "";
    ev.text_len = e->text2.len;
    ev.ids = &r->tokens[r->n_tokens - 1];
    ev.n_ids = 1;
    if (chosen) {
        ev.logprobs = chosen;
        ev.top = n_top ? top : NULL;
        ev.n_top = n_top;
    }
    ev.prompt_tokens = r->n_prompt;
    ev.completion_tokens = req_n_gen(r);
    ev.t_arrival_ns = r->t_arrival_ns;
    ev.t_admitted_ns = r->t_admitted_ns;
    ev.t_first_token_ns = r->t_first_ns;
    r->cb(&ev, r->user);

    if (r->disagg == ENGINE_DISAGG_CONTEXT_ONLY && chosen) { /* travels with the KV */
        r->has_first_lp = true;
        r->first_lp = *chosen;
        r->n_first_top = top ? (n_top < 20 ? n_top : 20) : 0;
        for (int i = 0; i < r->n_first_top; i++) r->first_top[i] = top[i];
    }
    if (stopped || eog || stop_id || length || gfinal) {
        enum finish_reason fin = (stopped || eog || stop_id || gfinal) ? FINISH_STOP : FINISH_LENGTH;
        if (r->disagg == ENGINE_DISAGG_CONTEXT_ONLY && !r->context_first) {
            /* generation first: the generation leg already waits for this KV and its first
             * token, so it is offered even though the request ends here */
            disagg_begin_send(e, r, fin);
            return true;
        }
        sched_remove(e, r);
        finish_request(e, r, fin);
        return true;
    }
    if (r->disagg == ENGINE_DISAGG_CONTEXT_ONLY) {
        disagg_begin_send(e, r, FINISH_NOT_FINISHED);
        return true;
    }
    return false;
}

bool engine_sample(struct engine *e, struct request *r, float *lg) {
    struct token_logprob chosen;
    logits_apply(e, r, lg);
    bool want_lp = r->sp.logprobs || r->sp.top_logprobs > 0;
    int n_top = r->sp.top_logprobs;
    if (r->gm) {
        int n_ok = constrain_mask_logits(e, r, lg);
        if (n_ok <= 0) {
            /* a mask over the work budget: the constraint is pathological (its cost per step
             * is bounded, so other sequences are not held up); a 400 for the request */
            char msg[512];
            snprintf(msg, sizeof msg,
                     "the output constraint is too complex: the token masks after %d generated tokens needed "
                     "more than the limit of %llu work units per step (an ambiguous regex or grammar, e.g. "
                     "repeated unbounded quantifiers such as (.*a){1000}); simplify it "
                     "(docs/structured-output.md)",
                     req_n_gen(r), (unsigned long long)gram_mask_budget());
            sched_remove(e, r);
            engine_fail_request(e, r, n_ok == -2 ? KV_EINVAL : n_ok < 0 ? KV_ENOMEM : KV_EINTERNAL,
                                n_ok == -2 ? msg
                                : n_ok < 0 ? "out of memory (grammar mask)"
                                           : "the grammar allows no token of this vocabulary here");
            return false;
        }
    }
    int32_t id = sampler_sample(&r->sp, lg, e->n_vocab, r->tokens, r->n_prompt, r->tokens + r->n_prompt,
                                req_n_gen(r), &r->rng, &e->scratch, want_lp ? &chosen : NULL, e->top, n_top);
    if (r->gm) {
        int32_t ok = constrain_check(e, r, lg, id);
        if (ok != id && want_lp) {
            chosen.id = ok;
            chosen.logprob = sampler_logprob(lg, e->n_vocab, ok, e->top, n_top);
        }
        id = ok;
    }
    engine_on_token(e, r, id, want_lp ? &chosen : NULL, e->top, n_top);
    return true;
}

/* Deadlock detection: no request progressed for ENGINE_STALL_PASSES passes while some
 * exist (planned prefix waits are not progress): fail them all with a clear error. */
static void note_progress(struct engine *e, int n_planned) {
    if (n_planned > 0 || (e->n_waiting == 0 && e->n_running == 0) || e->n_xfer > 0) {
        e->stall_passes = 0;
        return;
    }
    if (++e->stall_passes < ENGINE_STALL_PASSES) return;
    KV_ERROR("engine: no request made progress for %d scheduler passes; failing %d stalled "
             "requests", ENGINE_STALL_PASSES, e->n_waiting + e->n_running);
    const char *msg = "scheduler deadlock: no request made progress for 1000 scheduler passes";
    while (e->n_running) {
        struct request *r = e->running[--e->n_running];
        e->deadlock_failures++;
        engine_fail_request(e, r, KV_EINTERNAL, msg);
    }
    while (e->n_waiting) {
        struct request *r = e->waiting[--e->n_waiting];
        engine_queued_add(e, -1);
        e->deadlock_failures++;
        engine_fail_request(e, r, KV_EINTERNAL, msg);
    }
    e->stall_passes = 0;
}

static int run_step(struct engine *e) {
    constrain_step_begin(e);
    int n = sched_step(e);
    kv_status cst = reuse_flush_copies(e);
    note_progress(e, n);
    if (cst != KV_OK) { /* the blocks the copies targeted hold garbage: drop the cache */
        KV_ERROR("engine: host tier copy failed (%s); clearing the KV cache", kv_status_str(cst));
        for (int i = 0; i < n; i++) {
            sched_remove(e, e->plan[i].r);
            engine_fail_request(e, e->plan[i].r, KV_EINTERNAL, "KV host tier copy failed");
        }
        kv_pool_clear_cache(e->pool);
        engine_publish_stats(e, true);
        return n;
    }
    if (n == 0) {
        engine_publish_stats(e, false);
        return 0;
    }
    uint64_t prefill_tokens = 0;
    for (int i = 0; i < n; i++) {
        struct sched_entry *p = &e->plan[i];
        struct request *r = p->r;
        struct batch_seq *s = &e->seqs[i];
        s->tokens = r->tokens + r->n_computed;
        s->n_tokens = p->n_tokens;
        s->n_past = r->n_computed;
        s->block_table = r->blocks;
        s->n_blocks = r->n_blocks;
        s->logits = p->logits ? BATCH_LOGITS_LAST : BATCH_LOGITS_NONE;
        if (!(p->logits && p->n_tokens == 1 && r->n_tokens > r->n_prompt))
            prefill_tokens += (uint64_t)p->n_tokens;
    }
    struct batch b = {.seqs = e->seqs, .n_seqs = n};
    char err[256] = "";
    kv_status st;
    if (e->dev_sampling) { /* the backend samples: one request per logits row, in row order */
        int nr = 0;
        for (int i = 0; i < n; i++) {
            struct request *r = e->plan[i].r;
            if (!e->plan[i].logits) continue;
            const struct sampling_params *sp = &r->sp;
            e->bsamp[nr++] = (struct backend_sampling){
                .temperature = sp->temperature, .top_k = sp->top_k, .top_p = sp->top_p, .min_p = sp->min_p,
                .presence_penalty = sp->presence_penalty, .frequency_penalty = sp->frequency_penalty,
                .repetition_penalty = sp->repetition_penalty, .n_top = sp->top_logprobs,
                .logprob = sp->logprobs || sp->top_logprobs > 0,
                /* the host sampler's one draw per non-greedy token, taken before the step */
                .u = sp->temperature > 0.0f ? kv_rng_f64(&r->rng) : 0.0,
                .prompt = r->tokens, .n_prompt = r->n_prompt, .gen = r->tokens + r->n_prompt,
                .n_gen = req_n_gen(r)};
        }
        st = e->be->ops->forward_sample(e->be, &b, e->bsamp, e->bout, err, sizeof err);
    } else {
        st = e->be->ops->forward(e->be, &b, e->logits, err, sizeof err);
    }
    if (st != KV_OK) {
        char msg[400];
        snprintf(msg, sizeof msg, "backend forward failed: %s (%s)", err, kv_status_str(st));
        KV_ERROR("engine: %s", msg);
        for (int i = 0; i < n; i++) {
            sched_remove(e, e->plan[i].r);
            engine_fail_request(e, e->plan[i].r, KV_EINTERNAL, msg);
        }
        engine_publish_stats(e, true);
        return n;
    }
    uint64_t gen_tokens = 0;
    int row = 0;
    for (int i = 0; i < n; i++) {
        struct sched_entry *p = &e->plan[i];
        struct request *r = p->r;
        r->n_computed += p->n_tokens;
        r->chunk = 0;
        reuse_register(e, r);
        if (!p->logits) continue;
        bool want_lp = r->sp.logprobs || r->sp.top_logprobs > 0;
        int n_top = r->sp.top_logprobs;
        if (e->dev_sampling) { /* no grammar, logit_bias, min_tokens or n > 1 here (engine_submit) */
            struct token_logprob chosen;
            const struct backend_sample_out *o = &e->bout[row++];
            int32_t id = o->id;
            chosen = (struct token_logprob){.id = id, .logprob = o->logprob};
            for (int k = 0; k < n_top; k++)
                e->top[k] = (struct token_logprob){.id = o->top_id[k], .logprob = o->top_logprob[k]};
            gen_tokens++;
            engine_on_token(e, r, id, want_lp ? &chosen : NULL, e->top, n_top);
            continue;
        }
        float *lg = e->logits + (size_t)row++ * (size_t)e->n_vocab;
        if (r->n_choices > 1) gen_tokens += (uint64_t)fork_choices(e, r, lg);
        if (engine_sample(e, r, lg)) gen_tokens++;
    }
    pthread_mutex_lock(&e->stats_mu);
    e->stats.prefill_tokens_computed += prefill_tokens;
    e->stats.generation_tokens_total += gen_tokens;
    pthread_mutex_unlock(&e->stats_mu);
    engine_publish_stats(e, true);
    return n;
}

/* Takes the queued transfer completions (under mu) into a private array. */
static int take_xdone(struct engine *e, struct xfer_done **buf, int *cap) {
    int n = e->n_xdone;
    if (n > *cap) {
        void *np = kv_realloc(*buf, (size_t)n * sizeof **buf);
        if (!np) n = *cap; /* the rest waits for the next pass */
        else {
            *buf = np;
            *cap = n;
        }
    }
    if (n) {
        memcpy(*buf, e->xdone, (size_t)n * sizeof **buf);
        e->n_xdone -= n;
        memmove(e->xdone, e->xdone + n, (size_t)e->n_xdone * sizeof *e->xdone);
    }
    return n;
}

/* The CLOCK_REALTIME instant ns nanoseconds from now (pthread_cond_timedwait's deadline). */
static struct timespec realtime_in(uint64_t ns) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ns += (uint64_t)ts.tv_nsec;
    ts.tv_sec += (time_t)(ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    return ts;
}

/* The test hook engine_config.test_hold_prefill_tokens: once that many prompt tokens were
 * computed, publish the stats and wait (up to 20 ms, or until a submit, cancel or transfer
 * completion wakes us) instead of stepping. True while holding. */
static bool test_hold(struct engine *e) {
    uint64_t lim = e->cfg.test_hold_prefill_tokens;
    if (!lim) return false;
    pthread_mutex_lock(&e->stats_mu);
    bool hold = e->stats.prefill_tokens_computed >= lim;
    pthread_mutex_unlock(&e->stats_mu);
    if (!hold) return false;
    engine_publish_stats(e, false);
    pthread_mutex_lock(&e->mu);
    if (!e->stopping && e->n_incoming == 0 && e->n_cancels == 0 && e->n_xdone == 0) {
        struct timespec ts = realtime_in(20000000ull);
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    pthread_mutex_unlock(&e->mu);
    return true;
}

static void *engine_main(void *arg) {
    struct engine *e = arg;
    uint64_t *cancels = NULL;
    int n_cancels = 0, cap_cancels = 0;
    struct xfer_done *xd = NULL;
    int cap_xd = 0;
    bool stop = false;
    uint64_t next_deadline = 0;
    int last_plan = 1;
    while (!stop) {
        pthread_mutex_lock(&e->mu);
        /* sleep when nothing can run: also when the waiting requests only wait for blocks
         * that transfers hold (their completions wake us) */
        while (!e->stopping && e->n_incoming == 0 && e->n_cancels == 0 && e->n_xdone == 0 &&
               e->n_running == 0 && (e->n_waiting == 0 || (last_plan == 0 && e->n_xfer > 0))) {
            if (e->n_xfer == 0) {
                e->idle = true; /* every step's stats were published before this point */
                pthread_cond_broadcast(&e->idle_cv);
                pthread_cond_wait(&e->cv, &e->mu);
                e->idle = false;
                continue;
            }
            /* only transfers in flight: sleep until their nearest deadline (or a wakeup) */
            uint64_t now = kv_now_ns();
            if (next_deadline && now >= next_deadline) break;
            uint64_t until = next_deadline ? next_deadline : now + 1000000000ull;
            uint64_t wait = until - now;
            struct timespec ts = realtime_in(wait > 1000000000ull ? 1000000000ull : wait);
            if (pthread_cond_timedwait(&e->cv, &e->mu, &ts) != 0) break;
        }
        stop = e->stopping;
        int leak = e->fault_leak;
        e->fault_leak = 0;
        /* incoming -> tail of waiting */
        if (e->n_incoming && e->n_waiting + e->n_incoming > e->cap_waiting) {
            int nc = e->cap_waiting ? e->cap_waiting : 64;
            while (nc < e->n_waiting + e->n_incoming) nc *= 2;
            void *np = kv_realloc(e->waiting, (size_t)nc * sizeof *e->waiting);
            if (np) {
                e->waiting = np;
                e->cap_waiting = nc;
            }
        }
        int take = e->n_incoming;
        if (e->n_waiting + take > e->cap_waiting) take = e->cap_waiting - e->n_waiting;
        struct request *probes[64];
        int n_probes = 0;
        if (take > 0) {
            for (int i = 0; i < take; i++) {
                struct request *r = e->incoming[i];
                if (r->disagg == ENGINE_DISAGG_PROBE) {
                    if (n_probes == 64) { /* the rest waits for the next pass */
                        take = i;
                        break;
                    }
                    probes[n_probes++] = r; /* answered below, never scheduled */
                    e->n_queued--;
                } else {
                    sched_insert_waiting(e, r, false);
                }
            }
            e->n_incoming -= take;
            memmove(e->incoming, e->incoming + take, (size_t)e->n_incoming * sizeof *e->incoming);
        }
        if (e->n_cancels > cap_cancels) {
            void *np = kv_realloc(cancels, (size_t)e->n_cancels * sizeof *cancels);
            if (np) {
                cancels = np;
                cap_cancels = e->n_cancels;
            }
        }
        n_cancels = e->n_cancels <= cap_cancels ? e->n_cancels : cap_cancels;
        if (n_cancels) {
            memcpy(cancels, e->cancels, (size_t)n_cancels * sizeof *cancels);
            e->n_cancels -= n_cancels;
            memmove(e->cancels, e->cancels + n_cancels, (size_t)e->n_cancels * sizeof *cancels);
        }
        int n_xd = take_xdone(e, &xd, &cap_xd);
        pthread_mutex_unlock(&e->mu);
        if (leak > 0) { /* fault injection: blocks that never come back (a leak) */
            int32_t *nl = kv_realloc(e->leaked, (size_t)(e->n_leaked + leak) * sizeof *nl);
            if (nl) {
                e->leaked = nl;
                for (int i = 0; i < leak; i++) {
                    int b = kv_pool_alloc(e->pool);
                    if (b < 0) break;
                    e->leaked[e->n_leaked++] = b;
                }
            }
        }

        for (int i = 0; i < n_probes; i++) disagg_answer_probe(e, probes[i]);
        if (n_xd) disagg_apply_done(e, xd, n_xd);
        for (int i = 0; i < n_cancels; i++) {
            if (disagg_cancel(e, cancels[i])) continue;
            struct request *r;
            while ((r = engine_find_live(e, cancels[i])) != NULL) { /* every choice */
                sched_remove(e, r);
                finish_request(e, r, FINISH_CANCELLED);
            }
        }
        next_deadline = disagg_check_deadlines(e);
        if (stop) break;
        if (test_hold(e)) continue;
        last_plan = run_step(e);
    }
    free(cancels);
    free(xd);

    /* shutdown: every live request gets its terminal event */
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->n_incoming; i++) {
        struct request *r = e->incoming[i];
        engine_fail_request(e, r, KV_ECANCELLED, "engine stopped");
    }
    e->n_incoming = 0;
    e->n_queued = 0;
    e->n_xdone = 0;
    pthread_mutex_unlock(&e->mu);
    while (e->n_running) {
        struct request *r = e->running[--e->n_running];
        engine_fail_request(e, r, KV_ECANCELLED, "engine stopped");
    }
    while (e->n_waiting) {
        struct request *r = e->waiting[--e->n_waiting];
        engine_fail_request(e, r, KV_ECANCELLED, "engine stopped");
    }
    disagg_shutdown(e);
    engine_publish_stats(e, false);
    return NULL;
}

/* ---------------------------------------------------------------- start / stop */

static void engine_destroy(struct engine *e) {
    if (!e) return;
    reuse_destroy(e);
    for (int i = 0; i < e->n_leaked; i++) kv_pool_release(e->pool, e->leaked[i]);
    free(e->leaked);
    kv_pool_free(e->pool);
    pthread_mutex_destroy(&e->ev_mu);
    free(e->waiting);
    free(e->running);
    free(e->incoming);
    free(e->cancels);
    free(e->xdone);
    free(e->xfer);
    free(e->plan);
    free(e->seqs);
    free(e->logits);
    free(e->top);
    free(e->bsamp);
    free(e->bout);
    free(e->fork_row);
    free(e->eog_ids);
    sampler_scratch_free(&e->scratch);
    constrain_destroy(e);
    pthread_mutex_destroy(&e->gv_mu);
    kv_buf_free(&e->text);
    kv_buf_free(&e->text2);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->stats_mu);
    pthread_cond_destroy(&e->cv);
    pthread_cond_destroy(&e->idle_cv);
    free(e);
}

kv_status engine_start(const struct engine_config *cfg_in, const model_t *m, const tokenizer_t *t,
                       backend_t *be, engine_t **out, char *err, size_t errlen) {
    if (!cfg_in || !m || !be || !be->ops || !be->ops->forward || !be->ops->kv_alloc || !out)
        return kv_errf(KV_EINVAL, err, errlen, "engine_start: NULL argument");
    struct engine_config c = *cfg_in;
    if (c.tokens_per_block == 0) c.tokens_per_block = 16;
    if (c.max_batch_size == 0) c.max_batch_size = 64;
    if (c.max_num_tokens == 0) c.max_num_tokens = 512;
    if (c.max_queue == 0) c.max_queue = 1024;
    if (c.max_model_len == 0) c.max_model_len = m->cfg.max_ctx;
    if (c.n_blocks == 0) c.n_blocks = 4 * kv_blocks_for_tokens(c.max_model_len, c.tokens_per_block);
    if (c.tokens_per_block < 1 || c.max_batch_size < 1 || c.max_num_tokens < 1 || c.max_queue < 1 ||
        c.max_model_len < 2 || c.n_blocks < 1)
        return kv_errf(KV_EINVAL, err, errlen,
                       "engine config: tokens_per_block, max_batch_size, max_num_tokens, "
                       "max_queue and n_blocks must be >= 1 and max_model_len >= 2");
    int need = kv_blocks_for_tokens(c.max_model_len, c.tokens_per_block);
    if (c.n_blocks < need)
        return kv_errf(KV_EINVAL, err, errlen,
                       "engine config: KV pool of %d blocks x %d tokens cannot hold one "
                       "max_model_len=%d sequence (needs %d blocks)",
                       c.n_blocks, c.tokens_per_block, c.max_model_len, need);
    if (m->cfg.n_vocab < 1)
        return kv_errf(KV_EINVAL, err, errlen, "engine: model has no vocabulary");

    struct engine *e = kv_calloc(1, sizeof *e);
    if (!e) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->stats_mu, NULL);
    pthread_mutex_init(&e->ev_mu, NULL);
    pthread_mutex_init(&e->gv_mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_cond_init(&e->idle_cv, NULL);
    e->cfg = c;
    e->m = m;
    e->t = t;
    e->be = be;
    e->n_vocab = m->cfg.n_vocab;
    kv_rng_seed(&e->seed_rng, kv_now_ns() ^ ((uint64_t)(uintptr_t)e << 17));
    kv_buf_init(&e->text);
    kv_buf_init(&e->text2);
    e->pool = kv_pool_new(c.n_blocks, c.tokens_per_block);
    e->plan = kv_calloc((size_t)c.max_batch_size, sizeof *e->plan);
    e->seqs = kv_calloc((size_t)c.max_batch_size, sizeof *e->seqs);
    e->logits = kv_malloc((size_t)c.max_batch_size * (size_t)e->n_vocab * sizeof *e->logits);
    e->top = kv_calloc(ENGINE_MAX_TOP_LOGPROBS, sizeof *e->top);
    e->dev_sampling = be->ops->forward_sample && !c.host_sampling;
    if (e->dev_sampling) {
        e->bsamp = kv_calloc((size_t)c.max_batch_size, sizeof *e->bsamp);
        e->bout = kv_calloc((size_t)c.max_batch_size, sizeof *e->bout);
    }
    e->fork_row = kv_malloc((size_t)e->n_vocab * sizeof *e->fork_row);
    if (!e->pool || !e->plan || !e->seqs || !e->logits || !e->top || !e->fork_row ||
        (e->dev_sampling && (!e->bsamp || !e->bout)) ||
        sampler_scratch_init(&e->scratch, e->n_vocab) != KV_OK || logits_init(e) != KV_OK) {
        engine_destroy(e);
        return kv_errf(KV_ENOMEM, err, errlen, "engine: out of memory");
    }
    struct kv_geometry g = {
        .n_layers = m->cfg.n_layers,
        .n_kv_heads = m->cfg.n_kv_heads,
        .head_dim = m->cfg.head_dim,
        .tokens_per_block = c.tokens_per_block,
        .kv_dtype = c.kv_dtype,
    };
    kv_status st = be->ops->kv_alloc(be, c.n_blocks, &g);
    if (st != KV_OK) {
        engine_destroy(e);
        return kv_errf(st, err, errlen, "engine: cannot allocate a KV pool of %d blocks (%s)",
                       c.n_blocks, kv_status_str(st));
    }
    st = reuse_init(e, err, errlen);
    if (st != KV_OK) {
        engine_destroy(e);
        return st;
    }
    engine_publish_stats(e, false);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        engine_destroy(e);
        return kv_errf(KV_ENOMEM, err, errlen, "engine: cannot start the engine thread");
    }
    e->thread_started = true;
    *out = e;
    return KV_OK;
}

void engine_fault_leak_blocks(engine_t *e, int n) {
    pthread_mutex_lock(&e->mu);
    e->fault_leak += n > 0 ? n : 0;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

kv_status engine_wait_idle(engine_t *e, int timeout_ms) {
    struct timespec ts = realtime_in((uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull);
    kv_status st = KV_OK;
    pthread_mutex_lock(&e->mu);
    while (!(e->idle && e->n_incoming == 0 && e->n_cancels == 0 && e->n_xdone == 0)) {
        if (pthread_cond_timedwait(&e->idle_cv, &e->mu, &ts) != 0) {
            st = KV_EBUSY;
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

void engine_stop(engine_t *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->thread_started) pthread_join(e->thread, NULL);
    engine_destroy(e);
}
