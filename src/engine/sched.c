/*
 * sched: one step's plan. Order (after vLLM v1): running decodes (1 token each), then
 * prefill chunks of running requests, then admission of WAITING requests in order, all
 * under the step's token budget (max_num_tokens) and batch slots (max_batch_size).
 *
 * Priority (vLLM's priority policy): WAITING is ordered by (priority, arrival), lower values
 * first; a new request goes behind every waiting one of the same or a lower value, a
 * preempted one in front of every waiting one of the same or a higher value.
 *
 * Blocks: a request holds blocks covering n_computed + chunk positions. When a running
 * request needs a block and the pool is empty, the least urgent (highest priority value),
 * then newest, running request not already in this step's plan is preempted (blocks freed,
 * put back in WAITING, it recomputes prompt + generated later), unless every candidate is
 * more urgent than the one asking. With no victim a decode preempts itself and a prefill
 * shrinks its chunk to what fits. The oldest of the most urgent running requests can always
 * take every block from the others and the pool holds one max_model_len sequence
 * (engine_start checks), so it always progresses: no deadlock. Choices of an n > 1 request
 * (fork.c) share their prompt's full blocks: preempting one frees only its own blocks.
 *
 * Reuse: kv_pool_n_free counts cached (refcount 0) blocks, which kv_pool_alloc evicts LRU,
 * so cached blocks never keep a request out. At admission a request first pins its cached
 * prefix (reuse_match), so only its uncached tokens need room and budget.
 */
#include "engine_internal.h"

#include <stdlib.h>
#include <string.h>

kv_status engine_vec_grow(void **arr, int *cap, int need, size_t elt) {
    if (need <= *cap) return KV_OK;
    int nc = *cap ? *cap * 2 : 16;
    while (nc < need) nc *= 2;
    void *p = kv_realloc(*arr, (size_t)nc * elt);
    if (!p) return KV_ENOMEM;
    *arr = p;
    *cap = nc;
    return KV_OK;
}

void sched_free_blocks(struct engine *e, struct request *r) {
    /* last block first: cached blocks are evicted LRU, so a chain loses its tail before its
     * head (a chain without its head can never be matched) */
    for (int i = r->n_blocks - 1; i >= 0; i--) kv_pool_release(e->pool, r->blocks[i]);
    r->n_blocks = 0;
    r->n_computed = 0;
    r->n_reg = 0;
}

static bool remove_from(struct request **arr, int *n, struct request *r) {
    for (int i = 0; i < *n; i++)
        if (arr[i] == r) {
            memmove(arr + i, arr + i + 1, (size_t)(*n - i - 1) * sizeof *arr);
            (*n)--;
            return true;
        }
    return false;
}

void sched_remove(struct engine *e, struct request *r) {
    if (remove_from(e->running, &e->n_running, r)) return;
    if (remove_from(e->waiting, &e->n_waiting, r)) engine_queued_add(e, -1);
}

/* Tokens r can still place in the blocks it holds plus every free block. */
static int room_tokens(struct engine *e, const struct request *r) {
    int T = e->cfg.tokens_per_block;
    return (r->n_blocks + kv_pool_n_free(e->pool)) * T - r->n_computed;
}

static void grow_blocks(struct engine *e, struct request *r, int n_tokens_total) {
    int need = kv_blocks_for_tokens(n_tokens_total, e->cfg.tokens_per_block);
    while (r->n_blocks < need) {
        int b = kv_pool_alloc(e->pool);
        /* callers checked room_tokens; blocks_cap covers the request's maximum length */
        if (b < 0 || r->n_blocks >= r->blocks_cap) abort();
        r->blocks[r->n_blocks++] = b;
    }
}

/* Moves a running request back to WAITING (front of its priority class); on ENOMEM the
 * request is failed instead. */
static void preempt(struct engine *e, struct request *v) {
    remove_from(e->running, &e->n_running, v);
    sched_free_blocks(e, v);
    v->chunk = 0;
    v->state = REQ_WAITING;
    if (engine_vec_grow((void **)&e->waiting, &e->cap_waiting, e->n_waiting + 1, sizeof *e->waiting)) {
        engine_fail_request(e, v, KV_ENOMEM, "out of memory while preempting the request");
        return;
    }
    sched_insert_waiting(e, v, true);
    engine_queued_add(e, 1);
    e->n_preempt_step++;
    KV_DEBUG("engine: preempted request %llu (%d tokens)", (unsigned long long)v->id,
             v->n_tokens);
}

void sched_insert_waiting(struct engine *e, struct request *r, bool front) {
    int i = 0;
    if (front)
        while (i < e->n_waiting && e->waiting[i]->priority < r->priority) i++;
    else
        i = e->n_waiting;
    while (!front && i > 0 && e->waiting[i - 1]->priority > r->priority) i--;
    memmove(e->waiting + i + 1, e->waiting + i, (size_t)(e->n_waiting - i) * sizeof *e->waiting);
    e->waiting[i] = r;
    e->n_waiting++;
}

/* The running request to preempt for self: the least urgent (highest priority value), newest
 * among those not planned this step, unless it is more urgent than self (vLLM's priority
 * policy preempts max(priority, arrival)); NULL = none. */
static struct request *pick_victim(struct engine *e, const struct request *self) {
    struct request *v = NULL;
    for (int i = e->n_running - 1; i >= 0; i--) {
        struct request *c = e->running[i];
        if (c == self || c->chunk != 0) continue;
        if (!v || c->priority > v->priority) v = c;
    }
    return v && v->priority >= self->priority ? v : NULL;
}

static int index_of(struct engine *e, const struct request *r) {
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i] == r) return i;
    return -1;
}

static void plan_add(struct engine *e, struct request *r, int chunk) {
    grow_blocks(e, r, r->n_computed + chunk);
    r->chunk = chunk;
    struct sched_entry *p = &e->plan[e->n_plan++];
    p->r = r;
    p->n_tokens = chunk;
    p->logits = r->n_computed + chunk == r->n_tokens;
}

int sched_step(struct engine *e) {
    int budget = e->cfg.max_num_tokens, slots = e->cfg.max_batch_size;
    uint64_t preempt_before = e->n_preempt_step;
    e->n_plan = 0;
    for (int i = 0; i < e->n_running; i++) e->running[i]->chunk = 0;

    for (int phase = 0; phase < 2; phase++) { /* 0: decodes, 1: prefill chunks */
        for (int i = 0; i < e->n_running && budget > 0 && slots > 0; i++) {
            struct request *r = e->running[i];
            bool decode = r->n_tokens - r->n_computed == 1;
            if (r->chunk || decode != (phase == 0)) continue;
            int want = r->n_tokens - r->n_computed;
            if (want > budget) want = budget;
            struct request *v;
            while (room_tokens(e, r) < want && (v = pick_victim(e, r)) != NULL) preempt(e, v);
            int room = room_tokens(e, r);
            if (room <= 0) { /* nothing left to take from: r waits for the older ones */
                preempt(e, r);
                i = -1; /* indices shifted; restart (scheduled ones are skipped) */
                continue;
            }
            int chunk = want < room ? want : room;
            plan_add(e, r, chunk);
            budget -= chunk;
            slots--;
            i = index_of(e, r); /* preemptions may have shifted r */
        }
    }

    /* Admission: not in a step that preempted (the freed blocks go to the older ones).
     * Arrival order; a request in a prefix wait (reuse.c, bounded to ENGINE_WAIT_PASSES
     * passes) is skipped for this pass and keeps its place. */
    int wi = 0;
    while (e->n_preempt_step == preempt_before && wi < e->n_waiting && budget > 0 && slots > 0) {
        struct request *r = e->waiting[wi];
        int T = e->cfg.tokens_per_block;
        if (kv_blocks_for_tokens(r->n_prompt + r->max_gen, T) > kv_pool_n_blocks(e->pool)) {
            remove_from(e->waiting, &e->n_waiting, r);
            engine_queued_add(e, -1);
            engine_fail_request(e, r, KV_ETOOLONG,
                                "request needs more KV blocks than the whole pool holds");
            continue;
        }
        if (r->disagg == ENGINE_DISAGG_GENERATION_ONLY) {
            /* no compute, no budget: blocks for the prompt, then the transfer (disagg.c) */
            if (disagg_admit_recv(e, r)) continue;
            break; /* arrival order: later requests do not overtake it for blocks */
        }
        if (reuse_should_wait(e, r)) {
            wi++;
            continue;
        }
        if (engine_vec_grow((void **)&e->running, &e->cap_running, e->n_running + 1, sizeof *e->running))
            break;
        reuse_match(e, r); /* pins cached blocks: n_blocks, n_computed */
        int room = room_tokens(e, r);
        if (room <= 0) { /* not even one token fits: unpin and wait for blocks */
            sched_free_blocks(e, r);
            break;
        }
        int want = r->n_tokens - r->n_computed;
        if (want > budget) want = budget;
        int chunk = want < room ? want : room;
        remove_from(e->waiting, &e->n_waiting, r);
        engine_queued_add(e, -1);
        e->running[e->n_running++] = r;
        r->state = REQ_PREFILL;
        if (!r->t_admitted_ns) r->t_admitted_ns = kv_now_ns();
        plan_add(e, r, chunk);
        budget -= chunk;
        slots--;
    }
    return e->n_plan;
}
