/*
 * disagg: the engine side of disaggregated serving (engine.h "the KV-transfer seam").
 *
 *   context leg:     ... PREFILL -> first token -> TRANSFER_OUT (blocks pinned, offered)
 *                    -> send completion (any status) -> blocks released, request freed
 *   generation leg:  WAITING -> blocks for the prompt (cached prefix pinned, the rest fresh)
 *                    -> TRANSFER_IN (recv started) -> completion OK: blocks registered in the
 *                    reuse index, first token emitted, DECODE | error: FAILED
 *
 * The engine never waits on a peer: transfers are admitted by block availability alone and
 * their completions arrive through the inbox (engine_kv_transfer_done) like cancels do.
 * Blocks a transfer may still read or write stay pinned until its completion, also after a
 * cancel (BUG-08); an engine-side deadline (transfer timeout + grace) cancels a transfer the
 * agent forgot, and a second one frees its blocks with an error in the log (BUG-09/10).
 */
#include "engine_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Engine-side grace after the transfer timeout: 5 s, or half the timeout when it is short. */
static uint64_t xfer_grace_ns(const struct engine *e) {
    double t = e->xt.timeout_s > 0 ? e->xt.timeout_s : 60.0;
    return t < 10.0 ? (uint64_t)(t * 0.5e9) : 5000000000ull;
}

const char *req_state_name(enum req_state s) {
    static const char *n[] = {"WAITING", "PREFILL", "DECODE", "TRANSFER_OUT", "TRANSFER_IN",
                              "FINISHED", "FAILED", "CANCELLED"};
    return (unsigned)s < sizeof n / sizeof *n ? n[s] : "?";
}

static uint64_t xfer_timeout_ns(const struct engine *e) {
    double t = e->xt.timeout_s > 0 ? e->xt.timeout_s : 60.0;
    return (uint64_t)(t * 1e9);
}

void engine_set_kv_transfer(engine_t *e, const struct engine_kv_transfer *xt) {
    if (!e) return;
    if (xt) {
        e->xt = *xt;
        e->has_xt = xt->offer && xt->recv && xt->cancel;
    } else {
        memset(&e->xt, 0, sizeof e->xt);
        e->has_xt = false;
    }
}

bool engine_kv_release(engine_t *e, uint64_t disagg_id) {
    if (!e || !e->has_xt) return false;
    e->xt.cancel(e->xt.ctx, disagg_id); /* thread-safe: the agent queues it */
    return true;
}

uint64_t engine_tokens_hash(const int32_t *ids, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) {
        uint32_t v = (uint32_t)ids[i];
        for (int k = 0; k < 4; k++) h = (h ^ ((v >> (8 * k)) & 0xff)) * 1099511628211ull;
    }
    return h ? h : 1;
}

void engine_kv_transfer_done(engine_t *e, uint64_t disagg_id, bool is_send, kv_status status,
                             const char *message, const int32_t *first, int n_first) {
    engine_kv_transfer_done_ex(e, disagg_id, is_send, status, message, first, n_first, 0, NULL,
                               NULL, 0);
}

void engine_kv_transfer_done_ex(engine_t *e, uint64_t disagg_id, bool is_send, kv_status status,
                                const char *message, const int32_t *first, int n_first,
                                uint64_t tokens_hash, const struct token_logprob *first_lp,
                                const struct token_logprob *first_top, int n_first_top) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    if (engine_vec_grow((void **)&e->xdone, &e->cap_xdone, e->n_xdone + 1, sizeof *e->xdone)) {
        /* cannot queue it: the engine-side deadline will release the request */
        pthread_mutex_unlock(&e->mu);
        KV_ERROR("engine: out of memory queueing a KV-transfer completion for %llu",
                 (unsigned long long)disagg_id);
        return;
    }
    struct xfer_done *d = &e->xdone[e->n_xdone++];
    memset(d, 0, sizeof *d);
    d->disagg_id = disagg_id;
    d->is_send = is_send;
    d->status = status;
    if (message) snprintf(d->message, sizeof d->message, "%s", message);
    if (n_first > 4) n_first = 4;
    for (int i = 0; i < n_first && first; i++) d->first[i] = first[i];
    d->n_first = first ? (n_first > 0 ? n_first : 0) : 0;
    d->tokens_hash = tokens_hash;
    if (first_lp) {
        d->has_lp = true;
        d->lp = *first_lp;
        d->n_top = first_top ? (n_first_top < 20 ? n_first_top : 20) : 0;
        for (int i = 0; i < d->n_top; i++) d->top[i] = first_top[i];
    }
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static bool xfer_add(struct engine *e, struct request *r) {
    if (engine_vec_grow((void **)&e->xfer, &e->cap_xfer, e->n_xfer + 1, sizeof *e->xfer))
        return false;
    e->xfer[e->n_xfer++] = r;
    return true;
}

static void xfer_remove_at(struct engine *e, int i) {
    memmove(e->xfer + i, e->xfer + i + 1, (size_t)(e->n_xfer - i - 1) * sizeof *e->xfer);
    e->n_xfer--;
}

static int xfer_find(struct engine *e, uint64_t disagg_id, bool is_send) {
    enum req_state want = is_send ? REQ_TRANSFER_OUT : REQ_TRANSFER_IN;
    for (int i = 0; i < e->n_xfer; i++)
        if (e->xfer[i]->disagg_id == disagg_id && e->xfer[i]->state == want) return i;
    return -1;
}

/* ---------------------------------------------------------------- context leg */

bool disagg_begin_send(struct engine *e, struct request *r, enum finish_reason fin) {
    sched_remove(e, r);
    if (xfer_find(e, r->disagg_id, true) >= 0) { /* one offer per id (the transfer key) */
        engine_fail_request(e, r, KV_EINVAL, "disagg_request_id is already offered by another "
                            "context leg on this worker");
        return false;
    }
    int T = e->cfg.tokens_per_block;
    int nb = kv_blocks_for_tokens(r->n_prompt, T);
    /* blocks past the prompt (none today: the first token's K/V is not computed) go back */
    while (r->n_blocks > nb) kv_pool_release(e->pool, r->blocks[--r->n_blocks]);
    if (!xfer_add(e, r)) {
        engine_fail_request(e, r, KV_ENOMEM, "out of memory (KV transfer list)");
        return false;
    }
    r->state = REQ_TRANSFER_OUT;
    r->deadline_ns = kv_now_ns() + xfer_timeout_ns(e) + xfer_grace_ns(e);
    int32_t first = r->tokens[r->n_prompt];
    kv_status st = e->xt.offer(e->xt.ctx, r->disagg_id, r->blocks, r->n_blocks, r->n_prompt,
                               &first, 1, r->cached_tokens > 0 ? r->cached_tokens : 0,
                               engine_tokens_hash(r->tokens, r->n_prompt),
                               r->has_first_lp ? &r->first_lp : NULL, r->first_top, r->n_first_top);
    if (st != KV_OK) {
        xfer_remove_at(e, e->n_xfer - 1);
        char msg[200];
        snprintf(msg, sizeof msg, "KV transfer: cannot offer the blocks of disagg_request_id "
                 "%llu (%s)", (unsigned long long)r->disagg_id, kv_status_str(st));
        engine_fail_request(e, r, st == KV_EINVAL ? KV_EINVAL : KV_EINTERNAL, msg);
        return false;
    }
    /* the client's answer: the first token went out as a DELTA; this ends the leg */
    engine_post_terminal(e, r, ENGINE_EV_FINISH, fin, KV_OK, NULL);
    return true;
}

/* ---------------------------------------------------------------- generation leg */

bool disagg_admit_recv(struct engine *e, struct request *r) {
    int T = e->cfg.tokens_per_block;
    if (xfer_find(e, r->disagg_id, false) >= 0) { /* one receive per id */
        sched_remove(e, r);
        engine_fail_request(e, r, KV_EINVAL, "disagg_request_id is already being received here");
        return true;
    }
    int nb = kv_blocks_for_tokens(r->n_prompt, T);
    reuse_match(e, r); /* pins the cached prefix: n_blocks full blocks, n_computed */
    int need = nb - r->n_blocks;
    if (need > kv_pool_n_free(e->pool)) { /* wait (unpinned) for blocks */
        sched_free_blocks(e, r);
        return false;
    }
    if (need > 0 && kv_pool_alloc_n(e->pool, need, r->blocks + r->n_blocks) != KV_OK) {
        sched_free_blocks(e, r);
        return false;
    }
    int from = r->n_blocks;
    r->n_blocks = nb;
    r->n_recv_from = from;
    r->n_computed = from * T; /* what the cache gave; the rest is written by the transfer */
    sched_remove(e, r);
    if (!xfer_add(e, r)) {
        engine_fail_request(e, r, KV_ENOMEM, "out of memory (KV transfer list)");
        return true;
    }
    r->state = REQ_TRANSFER_IN;
    r->deadline_ns = kv_now_ns() + xfer_timeout_ns(e) + xfer_grace_ns(e);
    kv_status st = e->xt.recv(e->xt.ctx, r->disagg_id, r->peer, r->context_first,
                              r->blocks + from, nb - from, r->n_prompt);
    if (st != KV_OK) {
        xfer_remove_at(e, e->n_xfer - 1);
        char msg[300];
        snprintf(msg, sizeof msg, "KV transfer: cannot start receiving disagg_request_id %llu "
                 "from %s (%s)", (unsigned long long)r->disagg_id, r->peer, kv_status_str(st));
        engine_fail_request(e, r, st == KV_EINVAL ? KV_EINVAL : KV_EIO, msg);
    }
    return true;
}

/* The transfer of generation leg r checked out: register its blocks, emit the first token,
 * decode on. */
static void recv_ok(struct engine *e, struct request *r, const struct xfer_done *d) {
    if (d->tokens_hash && d->tokens_hash != engine_tokens_hash(r->tokens, r->n_prompt)) {
        /* the blocks hold another prompt's K/V: never decode from or index them */
        engine_fail_request(e, r, KV_EINVAL, "the prompt differs from the one the context worker "
                            "computed (prompt_token_ids do not match its KV cache)");
        return;
    }
    int32_t first;
    if (r->n_first > 0) first = r->first[0];
    else if (d->n_first > 0) {
        first = d->first[0];
        if (!r->has_first_lp && d->has_lp && d->lp.id == first) { /* generation first */
            bool ids_ok = true;
            for (int i = 0; i < d->n_top; i++) ids_ok &= d->top[i].id >= 0 && d->top[i].id < e->n_vocab;
            if (ids_ok) {
                r->has_first_lp = true;
                r->first_lp = d->lp;
                r->n_first_top = d->n_top;
                for (int i = 0; i < d->n_top; i++) r->first_top[i] = d->top[i];
            }
        }
    }
    else {
        engine_fail_request(e, r, KV_EIO, "KV transfer brought no first token");
        return;
    }
    if (first < 0 || first >= e->n_vocab) {
        engine_fail_request(e, r, KV_EIO, "KV transfer brought a first token outside the vocabulary");
        return;
    }
    if (engine_vec_grow((void **)&e->running, &e->cap_running, e->n_running + 1, sizeof *e->running)) {
        engine_fail_request(e, r, KV_ENOMEM, "out of memory");
        return;
    }
    r->n_computed = r->n_prompt;
    r->deadline_ns = 0;
    r->disagg = ENGINE_DISAGG_NONE; /* from here on an ordinary request (preemption recomputes) */
    reuse_register(e, r);           /* received blocks become visible only now */
    if (r->cached_tokens < 0) r->cached_tokens = r->n_recv_from * e->cfg.tokens_per_block;
    /* the context worker's sampler drew once for this token: keep the stream of draws equal */
    if (r->sp.temperature > 0.0f) (void)kv_rng_f64(&r->rng);
    e->running[e->n_running++] = r;
    r->state = REQ_DECODE;
    bool want_lp = r->sp.logprobs || r->sp.top_logprobs > 0;
    struct token_logprob lp = r->first_lp;
    if (!r->has_first_lp || lp.id != first) {
        lp.id = first;
        lp.logprob = 0.0f; /* unknown: the context worker did not send it */
    }
    int n_top = r->has_first_lp && r->first_lp.id == first ? r->n_first_top : 0;
    if (n_top > r->sp.top_logprobs) n_top = r->sp.top_logprobs;
    pthread_mutex_lock(&e->stats_mu);
    e->stats.generation_tokens_total++;
    pthread_mutex_unlock(&e->stats_mu);
    engine_on_token(e, r, first, want_lp ? &lp : NULL, r->first_top, n_top);
}

void disagg_apply_done(struct engine *e, struct xfer_done *d, int n) {
    for (int k = 0; k < n; k++) {
        int i = xfer_find(e, d[k].disagg_id, d[k].is_send);
        if (i < 0) {
            KV_DEBUG("engine: KV-transfer completion for unknown disagg_request_id %llu (%s)",
                     (unsigned long long)d[k].disagg_id, d[k].is_send ? "send" : "recv");
            continue;
        }
        struct request *r = e->xfer[i];
        xfer_remove_at(e, i);
        bool ok = d[k].status == KV_OK;
        if (d[k].is_send) {
            e->xstats[ok ? 0 : 1]++;
            if (!ok)
                KV_INFO("engine: KV send of disagg_request_id %llu ended: %s (%s)",
                        (unsigned long long)r->disagg_id, kv_status_str(d[k].status),
                        d[k].message);
            sched_free_blocks(e, r); /* terminal event was sent with the first token */
            engine_request_free(r);
            continue;
        }
        e->xstats[ok ? 2 : 3]++;
        if (r->terminal_sent || r->xfer_cancelled) { /* cancelled: only the blocks remained */
            sched_free_blocks(e, r);
            engine_post_terminal(e, r, ENGINE_EV_FINISH, FINISH_CANCELLED, KV_OK, NULL);
            engine_request_free(r);
            continue;
        }
        if (!ok) {
            char msg[300];
            snprintf(msg, sizeof msg, "KV transfer failed: %s",
                     d[k].message[0] ? d[k].message : kv_status_str(d[k].status));
            engine_fail_request(e, r, d[k].status == KV_ECANCELLED ? KV_ECANCELLED : KV_EIO, msg);
            continue;
        }
        recv_ok(e, r, &d[k]);
    }
}

bool disagg_cancel(struct engine *e, uint64_t req_id) {
    /* a generation leg still waiting for blocks: its sender keeps the KV pinned for it */
    for (int i = 0; i < e->n_waiting; i++) {
        struct request *r = e->waiting[i];
        if (r->id == req_id && r->disagg == ENGINE_DISAGG_GENERATION_ONLY && e->xt.cancel_remote)
            e->xt.cancel_remote(e->xt.ctx, r->disagg_id, r->peer);
        if (r->id == req_id) return false; /* the caller ends it as an ordinary request */
    }
    for (int i = 0; i < e->n_xfer; i++) {
        struct request *r = e->xfer[i];
        if (r->id != req_id) continue;
        if (!r->xfer_cancelled) {
            r->xfer_cancelled = true;
            e->xt.cancel(e->xt.ctx, r->disagg_id);
        }
        /* the client is done with it now; the blocks wait for the completion */
        engine_post_terminal(e, r, ENGINE_EV_FINISH, FINISH_CANCELLED, KV_OK, NULL);
        return true;
    }
    return false;
}

uint64_t disagg_check_deadlines(struct engine *e) {
    uint64_t now = kv_now_ns(), next = 0;
    for (int i = 0; i < e->n_xfer;) {
        struct request *r = e->xfer[i];
        if (r->deadline_ns && now >= r->deadline_ns) {
            e->xstats[4]++;
            if (!r->xfer_cancelled) { /* the agent missed its own deadline: cancel, wait more */
                KV_WARN("engine: KV transfer of disagg_request_id %llu (%s) passed its deadline; "
                        "cancelling", (unsigned long long)r->disagg_id, req_state_name(r->state));
                r->xfer_cancelled = true;
                e->xt.cancel(e->xt.ctx, r->disagg_id);
                if (r->state == REQ_TRANSFER_IN)
                    engine_post_terminal(e, r, ENGINE_EV_ERROR, FINISH_NONE, KV_EIO,
                                         "KV transfer timed out");
                r->deadline_ns = now + xfer_grace_ns(e);
            } else { /* no completion even after the cancel: release anyway */
                KV_ERROR("engine: KV transfer of disagg_request_id %llu never completed; "
                         "releasing its %d blocks", (unsigned long long)r->disagg_id, r->n_blocks);
                xfer_remove_at(e, i);
                sched_free_blocks(e, r);
                engine_post_terminal(e, r, ENGINE_EV_ERROR, FINISH_NONE, KV_EIO,
                                     "KV transfer timed out");
                engine_request_free(r);
                continue;
            }
        }
        if (r->deadline_ns && (!next || r->deadline_ns < next)) next = r->deadline_ns;
        i++;
    }
    /* generation legs still waiting for blocks: their sender will not wait forever either */
    for (int i = 0; i < e->n_waiting;) {
        struct request *r = e->waiting[i];
        if (r->disagg == ENGINE_DISAGG_GENERATION_ONLY && r->deadline_ns && now >= r->deadline_ns) {
            sched_remove(e, r);
            e->xstats[4]++;
            e->xt.cancel(e->xt.ctx, r->disagg_id);
            if (e->xt.cancel_remote) e->xt.cancel_remote(e->xt.ctx, r->disagg_id, r->peer);
            engine_fail_request(e, r, KV_EBUSY,
                                "no KV blocks became free for the generation leg within the "
                                "KV transfer timeout");
            continue;
        }
        if (r->deadline_ns && (!next || r->deadline_ns < next)) next = r->deadline_ns;
        i++;
    }
    return next;
}

void disagg_shutdown(struct engine *e) {
    while (e->n_xfer) {
        struct request *r = e->xfer[--e->n_xfer];
        sched_free_blocks(e, r);
        engine_post_terminal(e, r, ENGINE_EV_ERROR, FINISH_NONE, KV_ECANCELLED, "engine stopped");
        engine_request_free(r);
    }
}

void disagg_answer_probe(struct engine *e, struct request *r) {
    int T = e->cfg.tokens_per_block;
    int cached = reuse_probe(e, r) * T;
    if (cached > r->n_prompt) cached = r->n_prompt;
    r->cached_tokens = cached;
    engine_post_terminal(e, r, ENGINE_EV_FINISH, FINISH_STOP, KV_OK, NULL);
    engine_request_free(r);
}
