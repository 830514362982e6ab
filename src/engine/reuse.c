/*
 * reuse: the engine side of KV block reuse (kvcache.h has the index and the host tier).
 *
 *   admission:  hashes of the full blocks of r's tokens -> kv_pool_lookup/acquire, block by
 *               block from the root, stopping at the first miss and before the block that
 *               holds the last token (its logits are needed, so it is always computed);
 *   after a forward: every newly full block (prompt or generated tokens) is registered;
 *   before a forward: queued host<->device copies run through the backend, in order.
 *
 * Matching is exact: the index checks the parent uid and the token ids, so a hit reuses K/V
 * computed for exactly the same token prefix (and extra keys), and the CPU backend's K/V
 * for a position does not depend on batching or chunking: a hit is bitwise identical to a
 * recompute.
 */
#include "engine_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- events */

static void on_pool_event(const struct kv_pool_event *pe, void *user) {
    struct engine *e = user;
    int T = e->cfg.tokens_per_block;
    pthread_mutex_lock(&e->ev_mu);
    uint64_t seq = ++e->ev_seq;
    int slot = (int)(seq % ENGINE_EV_RING);
    struct engine_kv_event *ev = &e->ev_ring[slot];
    memset(ev, 0, sizeof *ev);
    ev->seq = seq;
    ev->type = pe->type == KV_POOL_EV_STORED    ? ENGINE_KV_STORED
               : pe->type == KV_POOL_EV_REMOVED ? ENGINE_KV_REMOVED
               : pe->type == KV_POOL_EV_TIER    ? ENGINE_KV_TIER
                                                : ENGINE_KV_CLEARED;
    ev->host = pe->host;
    if (pe->hash) ev->hash = *pe->hash;
    if (pe->parent_hash) ev->parent_hash = *pe->parent_hash;
    ev->parent_is_root = pe->parent_is_root;
    if (pe->tokens) {
        ev->n_tokens = pe->n_tokens < T ? pe->n_tokens : T;
        memcpy(e->ev_tok + (size_t)slot * (size_t)T, pe->tokens, (size_t)ev->n_tokens * sizeof(int32_t));
    }
    if (e->ev_notify && !e->ev_notified) { /* one wakeup until the reader comes */
        e->ev_notified = true;
        e->ev_notify(e->ev_notify_arg);
    }
    pthread_mutex_unlock(&e->ev_mu);
}

void engine_set_kv_notify(engine_t *e, void (*fn)(void *arg), void *arg) {
    pthread_mutex_lock(&e->ev_mu);
    e->ev_notify = fn;
    e->ev_notify_arg = arg;
    e->ev_notified = false;
    pthread_mutex_unlock(&e->ev_mu);
}

uint64_t engine_kv_last_seq(engine_t *e) {
    pthread_mutex_lock(&e->ev_mu);
    uint64_t s = e->ev_seq;
    pthread_mutex_unlock(&e->ev_mu);
    return s;
}

int engine_kv_events(engine_t *e, uint64_t after, struct engine_kv_event *out, int32_t *tok,
                     int cap, uint64_t *lost) {
    int T = e->cfg.tokens_per_block, n = 0;
    if (lost) *lost = 0;
    if (!e->ev_ring) return 0;
    pthread_mutex_lock(&e->ev_mu);
    e->ev_notified = false;
    uint64_t first = e->ev_seq >= ENGINE_EV_RING ? e->ev_seq - ENGINE_EV_RING + 1 : 1;
    if (after < first - 1) { /* (not after + 1 < first: after may be UINT64_MAX) */
        if (lost) *lost = first - (after + 1);
        after = first - 1;
    }
    for (uint64_t s = after + 1; after < e->ev_seq && s <= e->ev_seq && n < cap; s++, n++) {
        int slot = (int)(s % ENGINE_EV_RING);
        out[n] = e->ev_ring[slot];
        memcpy(tok + (size_t)n * (size_t)T, e->ev_tok + (size_t)slot * (size_t)T,
               (size_t)out[n].n_tokens * sizeof(int32_t));
        out[n].tokens = tok + (size_t)n * (size_t)T;
    }
    pthread_mutex_unlock(&e->ev_mu);
    return n;
}

uint64_t engine_worker_id(const engine_t *e) { return e->worker_id; }

void engine_hash_key_id(const engine_t *e, char out[17]) { kv_hash_key_id(&e->key, out); }

/* ---------------------------------------------------------------- setup */

int engine_default_wait_blocks(const struct engine_config *c) {
    int T = c->tokens_per_block > 0 ? c->tokens_per_block : 16;
    int blocks = c->max_model_len > 0 ? c->max_model_len / T : 0;
    int w = blocks / 8;
    return w < 1 ? 1 : w > 64 ? 64 : w;
}

kv_status reuse_init(struct engine *e, char *err, size_t errlen) {
    const struct engine_config *c = &e->cfg;
    e->reuse = !c->no_prefix_cache;
    e->wait_blocks = c->prefix_wait_blocks == 0 ? engine_default_wait_blocks(c) : c->prefix_wait_blocks;
    /* the worker id is random for every engine, with or without reuse: routers key workers by
     * it (with --no-prefix-cache every worker used to report 0 and they collided) */
    kv_hash_key wid;
    if (kv_hash_key_random(&wid) == KV_OK) memcpy(&e->worker_id, wid.key, sizeof e->worker_id);
    if (e->worker_id == 0) /* no randomness: time, process and address still tell workers apart */
        e->worker_id = (kv_now_ns() * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)getpid() << 40) ^
                       (uint64_t)(uintptr_t)e;
    if (e->worker_id == 0) e->worker_id = 1;
    if (!e->reuse) return KV_OK;
    if (c->hash_key) e->key = *c->hash_key;
    else if (kv_hash_key_random(&e->key) != KV_OK)
        return kv_errf(KV_EIO, err, errlen, "engine: no randomness for the block-hash key");
    int nh = c->host_cache_blocks > 0 ? c->host_cache_blocks : 0;
    if (kv_pool_enable_reuse(e->pool, nh) != KV_OK)
        return kv_errf(KV_ENOMEM, err, errlen, "engine: out of memory for the reuse index");
    struct kv_geometry g = {.n_layers = e->m->cfg.n_layers, .n_kv_heads = e->m->cfg.n_kv_heads,
                            .head_dim = e->m->cfg.head_dim, .tokens_per_block = c->tokens_per_block,
                            .kv_dtype = c->kv_dtype};
    e->block_bytes = kv_block_bytes(&g);
    if (nh > 0) {
        e->host_mem = kv_malloc((size_t)nh * e->block_bytes);
        if (!e->host_mem)
            return kv_errf(KV_ENOMEM, err, errlen, "engine: cannot allocate a host KV tier of %d "
                           "blocks (%zu bytes each)", nh, e->block_bytes);
    }
    e->ev_ring = kv_calloc(ENGINE_EV_RING, sizeof *e->ev_ring);
    e->ev_tok = kv_calloc((size_t)ENGINE_EV_RING * (size_t)c->tokens_per_block, sizeof *e->ev_tok);
    if (!e->ev_ring || !e->ev_tok) return kv_errf(KV_ENOMEM, err, errlen, "engine: out of memory");
    kv_pool_set_event_cb(e->pool, on_pool_event, e);
    return KV_OK;
}

void reuse_destroy(struct engine *e) {
    free(e->host_mem);
    free(e->ev_ring);
    free(e->ev_tok);
}

kv_status reuse_request_init(struct request *r, const struct engine_request_params *p) {
    r->cached_tokens = -1;
    r->bhash = kv_malloc((size_t)r->blocks_cap * sizeof *r->bhash);
    r->buid = kv_calloc((size_t)r->blocks_cap, sizeof *r->buid);
    if (!r->bhash || !r->buid) return KV_ENOMEM;
    if (p->cache_salt) { /* the extra keys of the chain root, serialized once (hash.h) */
        struct kv_extra_key x = {KV_EXTRA_CACHE_SALT, p->cache_salt, strlen(p->cache_salt)};
        r->root_len = kv_extra_keys_serialize(&x, 1, NULL);
        r->root_bytes = kv_malloc(r->root_len);
        if (!r->root_bytes) return KV_ENOMEM;
        kv_extra_keys_serialize(&x, 1, r->root_bytes);
    }
    return KV_OK;
}

void reuse_request_free(struct request *r) {
    free(r->root_bytes);
    free(r->bhash);
    free(r->buid);
}

/* ---------------------------------------------------------------- matching */

static void ensure_root(struct engine *e, struct request *r) {
    if (!r->root_done) {
        kv_hash_root_bytes(&e->key, r->root_bytes, r->root_len, &r->root_hash);
        r->root_done = true;
    }
    r->root_uid = kv_pool_root_uid(e->pool, r->root_bytes, r->root_len);
}

static void ensure_hashes(struct engine *e, struct request *r, int n) {
    int T = e->cfg.tokens_per_block;
    if (n > r->blocks_cap) n = r->blocks_cap;
    for (int i = r->n_hashed; i < n; i++)
        kv_hash_block(&e->key, i ? &r->bhash[i - 1] : &r->root_hash, r->tokens + (size_t)i * T, T,
                      &r->bhash[i]);
    if (n > r->n_hashed) r->n_hashed = n;
}

static int max_match_blocks(const struct engine *e, const struct request *r) {
    return (r->n_tokens - 1) / e->cfg.tokens_per_block;
}

void reuse_match(struct engine *e, struct request *r) {
    if (!e->reuse || r->n_blocks != 0) return;
    int T = e->cfg.tokens_per_block, max = max_match_blocks(e, r);
    ensure_root(e, r);
    ensure_hashes(e, r, max);
    uint64_t parent = r->root_uid;
    for (int i = 0; i < max && parent; i++) {
        uint64_t uid = 0;
        int ent = kv_pool_lookup(e->pool, parent, &r->bhash[i], r->tokens + (size_t)i * T, &uid);
        if (ent < 0) break;
        int b = kv_pool_acquire(e->pool, ent);
        if (b < 0) break;
        r->blocks[r->n_blocks++] = b;
        r->buid[i] = uid;
        parent = uid;
    }
    r->n_reg = r->n_blocks;
    r->n_computed = r->n_blocks * T;
    if (r->cached_tokens < 0) {
        r->cached_tokens = r->n_computed < r->n_prompt ? r->n_computed : r->n_prompt;
        e->query_tokens += (uint64_t)r->n_prompt;
        e->hit_tokens += (uint64_t)r->cached_tokens;
    }
}

int reuse_probe(struct engine *e, struct request *r) {
    if (!e->reuse) return 0;
    int T = e->cfg.tokens_per_block, max = max_match_blocks(e, r), n = 0;
    ensure_root(e, r);
    ensure_hashes(e, r, max);
    uint64_t parent = r->root_uid;
    while (n < max && parent) {
        uint64_t uid = 0;
        if (kv_pool_lookup(e->pool, parent, &r->bhash[n], r->tokens + (size_t)n * T, &uid) < 0)
            break;
        parent = uid;
        n++;
    }
    return n;
}

void reuse_register(struct engine *e, struct request *r) {
    if (!e->reuse) return;
    int T = e->cfg.tokens_per_block, full = r->n_computed / T;
    if (full > r->n_blocks) full = r->n_blocks;
    if (full <= r->n_reg) return;
    if (!r->root_done || !r->root_uid) ensure_root(e, r);
    ensure_hashes(e, r, full);
    for (int i = r->n_reg; i < full; i++) {
        uint64_t parent = i ? r->buid[i - 1] : r->root_uid;
        if (!parent) return;
        r->buid[i] = kv_pool_register(e->pool, r->blocks[i], parent,
                                      i ? &r->bhash[i - 1] : &r->root_hash, &r->bhash[i],
                                      r->tokens + (size_t)i * T);
        r->n_reg = i + 1;
    }
}

/* ---------------------------------------------------------------- prefix waits */

/* Full blocks of prefix that a and b share (by token ids and extra keys), at most max. */
static int shared_blocks(const struct request *a, const struct request *b, int T, int max) {
    if (a->root_len != b->root_len ||
        (a->root_len && memcmp(a->root_bytes, b->root_bytes, a->root_len) != 0))
        return 0;
    int n = a->n_tokens < b->n_tokens ? a->n_tokens : b->n_tokens;
    if (n > max * T) n = max * T;
    int k = 0;
    while (k < n && a->tokens[k] == b->tokens[k]) k++;
    return k / T;
}

bool reuse_should_wait(struct engine *e, struct request *r) {
    if (!e->reuse || e->wait_blocks <= 0 || r->wait_passes >= ENGINE_WAIT_PASSES) return false;
    int T = e->cfg.tokens_per_block, max = max_match_blocks(e, r);
    if (max < e->wait_blocks) return false;
    /* the deepest in-flight owner: running, still prefilling, admitted ahead of r */
    int owner = 0;
    for (int i = 0; i < e->n_running; i++) {
        const struct request *o = e->running[i];
        if (o->n_computed >= o->n_prompt) continue;
        int ob = o->n_prompt / T;
        int d = shared_blocks(r, o, T, ob < max ? ob : max);
        if (d > owner) owner = d;
    }
    if (owner < e->wait_blocks) return false;
    /* what the index already offers */
    ensure_root(e, r);
    ensure_hashes(e, r, owner);
    int tree = 0;
    uint64_t parent = r->root_uid;
    while (tree < owner && parent) {
        uint64_t uid = 0;
        if (kv_pool_lookup(e->pool, parent, &r->bhash[tree], r->tokens + (size_t)tree * T, &uid) < 0)
            break;
        parent = uid;
        tree++;
    }
    if (owner - tree < e->wait_blocks) return false;
    r->wait_passes++;
    e->waits_step++;
    return true;
}

/* ---------------------------------------------------------------- host copies */

#define COPY_BATCH 256

kv_status reuse_flush_copies(struct engine *e) {
    int n = 0;
    const struct kv_copy_op *ops = kv_pool_pending_copies(e->pool, &n);
    kv_status st = KV_OK;
    int32_t blocks[COPY_BATCH];
    void *host[COPY_BATCH];
    for (int i = 0; i < n && st == KV_OK;) {
        bool to_host = ops[i].to_host;
        int k = 0;
        while (i + k < n && k < COPY_BATCH && ops[i + k].to_host == to_host) {
            blocks[k] = ops[i + k].block;
            host[k] = e->host_mem + (size_t)ops[i + k].host_slot * e->block_bytes;
            k++;
        }
        st = to_host ? backend_copy_to_host(e->be, blocks, host, k)
                     : backend_copy_from_host(e->be, (const void *const *)host, blocks, k);
#ifndef NDEBUG
        for (int j = 0; j < k && st == KV_OK; j++) {
            uint64_t *ck = kv_pool_host_checksum(e->pool, ops[i + j].host_slot);
            if (to_host) {
                *ck = kv_checksum64(host[j], e->block_bytes);
            } else if (e->be->ops->block_ptr) {
                uint64_t got = kv_checksum64(e->be->ops->block_ptr(e->be, blocks[j]), e->block_bytes);
                if (got != *ck) {
                    e->checksum_failures++;
                    KV_ERROR("engine: host tier round trip changed block %d (checksum %016llx, "
                             "expected %016llx)", blocks[j], (unsigned long long)got,
                             (unsigned long long)*ck);
                }
            }
        }
#endif
        i += k;
    }
    kv_pool_clear_copies(e->pool);
    return st;
}

void reuse_fill_stats(struct engine *e, struct engine_stats *s) {
    struct kv_pool_stats ps;
    kv_pool_get_stats(e->pool, &ps);
    s->prefix_cache_enabled = e->reuse;
    s->prefix_cache_query_tokens = e->query_tokens;
    s->prefix_cache_hit_tokens = e->hit_tokens;
    s->kv_blocks_cached = kv_pool_n_cached(e->pool);
    s->kv_host_blocks_total = kv_pool_n_host_blocks(e->pool);
    s->kv_host_blocks_cached = kv_pool_n_host_cached(e->pool);
    s->kv_evictions = ps.evictions;
    s->kv_offloads = ps.offloads;
    s->kv_host_evictions = ps.host_evictions;
    s->kv_hits_device = ps.hits_device;
    s->kv_hits_host = ps.hits_host;
    s->prefix_waits_total += e->waits_step;
    e->waits_step = 0;
    s->kv_checksum_failures = e->checksum_failures;
    s->deadlock_failures = e->deadlock_failures;
}
