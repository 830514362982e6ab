/* kv_mirror: mirrored block sets, in-flight predictions and the kv_aware score (kv_mirror.h). */
#include "kv_mirror.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../hash/hash.h"

/* ---- a small open-addressing map u64 -> u64 (linear probing, tombstones) ---- */

struct u64map {
    uint64_t *k, *v;
    uint8_t *st; /* 0 empty, 1 used, 2 tombstone */
    size_t cap, n, used;
};

static uint64_t mix64(uint64_t x) {
    x ^= x >> 31;
    x *= 0x7fb5d329728ea185ull;
    x ^= x >> 27;
    return x;
}

static void map_free(struct u64map *m) {
    free(m->k);
    free(m->v);
    free(m->st);
    memset(m, 0, sizeof *m);
}

static long map_find(const struct u64map *m, uint64_t key) {
    if (!m->cap) return -1;
    for (size_t i = mix64(key) & (m->cap - 1), t = 0; t < m->cap; i = (i + 1) & (m->cap - 1), t++) {
        if (m->st[i] == 0) return -1;
        if (m->st[i] == 1 && m->k[i] == key) return (long)i;
    }
    return -1;
}

/* keep(v, arg): entries for which it returns false are dropped while rehashing (may be NULL). */
static kv_status map_rehash(struct u64map *m, size_t cap, bool (*keep)(uint64_t v, void *arg), void *arg) {
    struct u64map n = {calloc(cap, 8), calloc(cap, 8), calloc(cap, 1), cap, 0, 0};
    if (!n.k || !n.v || !n.st) {
        map_free(&n);
        return KV_ENOMEM;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->st[i] != 1 || (keep && !keep(m->v[i], arg))) continue;
        size_t j = mix64(m->k[i]) & (cap - 1);
        while (n.st[j]) j = (j + 1) & (cap - 1);
        n.st[j] = 1;
        n.k[j] = m->k[i];
        n.v[j] = m->v[i];
        n.n++;
        n.used++;
    }
    map_free(m);
    *m = n;
    return KV_OK;
}

static kv_status map_put(struct u64map *m, uint64_t key, uint64_t v, bool (*keep)(uint64_t, void *), void *arg) {
    long f = map_find(m, key);
    if (f >= 0) {
        m->v[f] = v;
        return KV_OK;
    }
    if ((m->used + 1) * 10 > m->cap * 7) {
        size_t cap = m->cap ? m->cap : 1024;
        if ((m->n + 1) * 10 > cap * 4) cap *= 2;
        if (map_rehash(m, cap, keep, arg)) return KV_ENOMEM;
    }
    size_t i = mix64(key) & (m->cap - 1);
    while (m->st[i] == 1) i = (i + 1) & (m->cap - 1);
    if (m->st[i] == 0) m->used++;
    m->st[i] = 1;
    m->k[i] = key;
    m->v[i] = v;
    m->n++;
    return KV_OK;
}

static void map_del(struct u64map *m, uint64_t key) {
    long f = map_find(m, key);
    if (f < 0) return;
    m->st[f] = 2;
    m->n--;
}

/* ---- mirror ---- */

struct kv_mirror {
    struct u64map set; /* block hash (first 8 bytes) -> tier (1 device, 2 host) */
    char worker_id[40];
};

struct kv_mirror *kv_mirror_new(void) { return calloc(1, sizeof(struct kv_mirror)); }

void kv_mirror_free(struct kv_mirror *m) {
    if (!m) return;
    map_free(&m->set);
    free(m);
}

void kv_mirror_clear(struct kv_mirror *m) { map_free(&m->set); }

int kv_mirror_tier(const struct kv_mirror *m, uint64_t hash) {
    long f = map_find(&m->set, hash);
    return f < 0 ? 0 : (int)m->set.v[f];
}

long kv_mirror_size(const struct kv_mirror *m) { return (long)m->set.n; }

const char *kv_mirror_worker_id(const struct kv_mirror *m) { return m->worker_id; }

/* A 64-hex-digit block hash -> its 64-bit index key. */
static bool hex_u64(const char *s, uint64_t *out) {
    return s && strlen(s) == 2 * KV_HASH_LEN && kv_hash_u64_from_hex(s, out);
}

enum kv_mirror_result kv_mirror_apply(struct kv_mirror *m, const json_t *ev,
                                      const struct kv_mirror_expect *ex, uint64_t *last_seq,
                                      char *err, size_t errlen) {
    const char *type = json_string_value(json_object_get(ev, "type"));
    json_t *seq = json_object_get(ev, "seq");
    if (json_is_integer(seq)) *last_seq = (uint64_t)json_integer_value(seq);
    if (!type) {
        snprintf(err, errlen, "an event without a type");
        return KV_MIRROR_BAD;
    }
    if (!strcmp(type, "start")) {
        json_t *tpb = json_object_get(ev, "tokens_per_block");
        const char *scheme = json_string_value(json_object_get(ev, "hash_scheme"));
        const char *kid = json_string_value(json_object_get(ev, "hash_key_id"));
        const char *wid = json_string_value(json_object_get(ev, "worker_id"));
        if (!json_is_integer(tpb) || json_integer_value(tpb) != ex->tokens_per_block) {
            snprintf(err, errlen, "tokens_per_block %lld differs from the router's %d (set the router's "
                     "--tokens-per-block to the workers')", json_is_integer(tpb) ? (long long)json_integer_value(tpb) : -1LL,
                     ex->tokens_per_block);
            return KV_MIRROR_REFUSED;
        }
        if (!scheme || strcmp(scheme, ex->hash_scheme)) {
            snprintf(err, errlen, "hash_scheme %s differs from the router's %s", scheme ? scheme : "(none)",
                     ex->hash_scheme);
            return KV_MIRROR_REFUSED;
        }
        if (!kid || strcmp(kid, ex->hash_key_id)) {
            snprintf(err, errlen, "hash key fingerprint %s differs from the router's %s (give the router and "
                     "every worker the same --hash-key-file)", kid ? kid : "(none)", ex->hash_key_id);
            return KV_MIRROR_REFUSED;
        }
        bool changed = wid && strcmp(wid, m->worker_id) != 0;
        snprintf(m->worker_id, sizeof m->worker_id, "%s", wid ? wid : "");
        kv_mirror_clear(m); /* a (re)connected stream starts from scratch */
        return changed ? KV_MIRROR_RESYNC : KV_MIRROR_OK;
    }
    if (!strcmp(type, "lost")) {
        kv_mirror_clear(m);
        return json_is_true(json_object_get(ev, "final")) ? KV_MIRROR_END : KV_MIRROR_RESYNC;
    }
    if (!strcmp(type, "cleared")) {
        kv_mirror_clear(m);
        return KV_MIRROR_OK;
    }
    const char *wid = json_string_value(json_object_get(ev, "worker_id"));
    if (wid && m->worker_id[0] && strcmp(wid, m->worker_id)) { /* a new worker behind the URL */
        kv_mirror_clear(m);
        snprintf(m->worker_id, sizeof m->worker_id, "%s", wid);
        return KV_MIRROR_RESYNC;
    }
    uint64_t h;
    if (!hex_u64(json_string_value(json_object_get(ev, "block_hash")), &h)) {
        snprintf(err, errlen, "a %s event without a valid block_hash", type);
        return KV_MIRROR_BAD;
    }
    if (!strcmp(type, "stored")) {
        const char *tier = json_string_value(json_object_get(ev, "tier"));
        if (map_put(&m->set, h, tier && !strcmp(tier, "host") ? 2 : 1, NULL, NULL)) {
            snprintf(err, errlen, "out of memory");
            return KV_MIRROR_BAD;
        }
        return KV_MIRROR_OK;
    }
    if (!strcmp(type, "removed")) {
        map_del(&m->set, h);
        return KV_MIRROR_OK;
    }
    if (!strcmp(type, "tier")) { /* offloaded to the host tier, or back on the device */
        const char *tier = json_string_value(json_object_get(ev, "tier"));
        if (kv_mirror_tier(m, h) && map_put(&m->set, h, tier && !strcmp(tier, "host") ? 2 : 1, NULL, NULL)) {
            snprintf(err, errlen, "out of memory");
            return KV_MIRROR_BAD;
        }
        return KV_MIRROR_OK;
    }
    snprintf(err, errlen, "unknown event type %s", type);
    return KV_MIRROR_BAD;
}

/* ---- predictions: (block hash, worker) -> (expiry ms << 12 | worker); branches ---- */

struct rt_predict {
    struct u64map map;
    uint64_t ttl_ms;
    /* block hash -> the hash of the block that followed it in the first request placed with
     * it (low bit cleared), low bit set once a request continued it with another block: the
     * prefix up to it is shared by several chains (sessions), not one session's history */
    struct u64map next;
};

/* Branch memory bound (entries); past it the map is cleared (shared prefixes are found again
 * by the next requests that diverge from them). */
#define RT_KV_BRANCH_MAX (1u << 20)

struct rt_predict *rt_predict_new(double ttl_s) {
    struct rt_predict *pr = calloc(1, sizeof *pr);
    if (pr) pr->ttl_ms = ttl_s > 0 ? (uint64_t)(ttl_s * 1000.0) : 0;
    return pr;
}

void rt_predict_free(struct rt_predict *pr) {
    if (!pr) return;
    map_free(&pr->map);
    map_free(&pr->next);
    free(pr);
}

/* Blocks of bh[0..n) before the deepest one another placed chain continued differently (0 =
 * nothing shared with a diverging chain). */
static int common_depth(const struct rt_predict *pr, const uint64_t *bh, int n) {
    int d = 0;
    for (int j = 0; pr && j + 1 < n; j++) {
        long f = map_find(&pr->next, bh[j]);
        if (f < 0) break; /* chained hashes: nothing deeper was placed */
        uint64_t v = pr->next.v[f];
        if ((v & 1) || (v & ~1ull) != (bh[j + 1] & ~1ull)) d = j + 1;
    }
    return d;
}

/* Records the chain bh[0..n): each block's successor, or that it now has two. */
static void record_chain(struct rt_predict *pr, const uint64_t *bh, int n) {
    if (!pr) return;
    if (pr->next.n + (size_t)n > RT_KV_BRANCH_MAX) map_free(&pr->next);
    for (int j = 0; j + 1 < n; j++) {
        long f = map_find(&pr->next, bh[j]);
        uint64_t child = bh[j + 1] & ~1ull;
        if (f < 0) {
            if (map_put(&pr->next, bh[j], child, NULL, NULL)) return;
        } else if ((pr->next.v[f] & ~1ull) != child) {
            pr->next.v[f] |= 1;
        }
    }
}

static bool not_expired(uint64_t v, void *arg) { return (v >> 12) > *(const uint64_t *)arg; }

/* Predictions are keyed by (block, worker): a prefix sent to two workers is predicted on both. */
static uint64_t pred_key(uint64_t h, int worker) { return h ^ (0x9e3779b97f4a7c15ull * (uint64_t)(worker + 1)); }

static bool predicted_on(const struct rt_predict *pr, uint64_t h, int worker, uint64_t now_ms) {
    long f = pr ? map_find(&pr->map, pred_key(h, worker)) : -1;
    return f >= 0 && (pr->map.v[f] >> 12) > now_ms && (int)(pr->map.v[f] & 0xfff) == worker;
}

void rt_predict_forget_worker(struct rt_predict *pr, int worker) {
    if (!pr) return;
    for (size_t i = 0; i < pr->map.cap; i++)
        if (pr->map.st[i] == 1 && (int)(pr->map.v[i] & 0xfff) == worker) {
            pr->map.st[i] = 2;
            pr->map.n--;
        }
}

/* ---- kv_aware ---- */

/* Tier of block j of rq on worker w: 1 device, 2 host, 3 predicted (sent there within the
 * TTL, not yet reported), 0 none. */
static int block_tier(const struct rt_pool *p, int w, const struct rt_route *rq, int j, uint64_t now_ms) {
    const struct kv_mirror *m = p->w[w]->mirror;
    int t = m ? kv_mirror_tier(m, rq->bh[j]) : 0;
    if (t) return t;
    return predicted_on(p->pred, rq->bh[j], w, now_ms) ? 3 : 0;
}

/* Credit of one block of tpb tokens in quarter tokens: device and predicted 4, host 3
 * (Dynamo's 1.0 / 0.75). */
static long tier_q(int tier, int tpb) { return (tier == 2 ? 3L : 4L) * tpb; }

struct kv_cand {
    int depth;      /* leading blocks the worker has (any tier) */
    long raw_q;     /* credit of those blocks (quarter tokens) */
    long spec_q;    /* credit of those held by no other candidate */
    long inflight;  /* tokens of those sent there and not yet reported stored */
    bool follow;    /* joins the prefill of that in-flight prefix (load 0) */
    double cost;
};

static int cmp3(double a, double b) { return a < b - 1e-9 ? -1 : a > b + 1e-9 ? 1 : 0; }

/* < 0 when candidate a ranks before b, 0 when tied (see step 3 below). */
static int kv_order(const struct rt_pool *p, const struct kv_cand *c, int a, int b, bool affinity) {
    int o;
    double la = (double)rt_pool_load(p, a), lb = (double)rt_pool_load(p, b);
    if (affinity) {
        if ((o = cmp3(c[a].cost, c[b].cost))) return o;
        if ((o = cmp3((double)c[b].raw_q, (double)c[a].raw_q))) return o;
        return cmp3(la, lb);
    }
    if ((o = cmp3(la, lb))) return o;
    if ((o = cmp3((double)c[b].raw_q, (double)c[a].raw_q))) return o;
    if ((o = cmp3((double)p->w[a]->requests, (double)p->w[b]->requests))) return o;
    return cmp3((double)p->w[a]->work, (double)p->w[b]->work);
}

int rt_kv_select(struct rt_pool *p, const struct rt_route *rq, int exclude, enum rt_reason *why,
                 long *predicted) {
    uint64_t now_ms = rq->now_ns / 1000000u;
    int tpb = rq->tokens_per_block > 0 ? rq->tokens_per_block : 1, nb = rq->n_blocks > 0 ? rq->n_blocks : 0;
    bool many = rt_pool_n_live(p) > 1;
    struct kv_cand *c = calloc((size_t)(p->n > 0 ? p->n : 1), sizeof *c);
    int *holders = calloc(2 * ((size_t)nb + 1), sizeof *holders), *at_depth = holders ? holders + nb + 1 : NULL;
    if (!c || !holders) { /* out of memory: a least-loaded choice (never a failed request) */
        free(c);
        free(holders);
        *why = RT_WHY_LOAD;
        return rt_pool_least_loaded(p, exclude);
    }
#define KV_CANDIDATE(i) (rt_worker_live(p->w[i]) && !((i) == exclude && many))
    /* 1. how deep each candidate holds the prompt's chain; holders[j] = candidates holding block j */
    for (int i = 0; i < p->n; i++) {
        if (!KV_CANDIDATE(i)) continue;
        int d = 0;
        while (d < nb && block_tier(p, i, rq, d, now_ms)) d++;
        c[i].depth = d;
        at_depth[d]++;
    }
    for (int j = nb - 1; j >= 0; j--) holders[j] = holders[j + 1] + at_depth[j + 1]; /* depth > j */
    int common = common_depth(p->pred, rq->bh, nb);
    /* 2. cost = load - W x saved tokens (docs/routing.md "kv_aware"):
     *  saved: blocks the worker holds that are specific to this request's chain: held by no
     *    other candidate (a prefix two workers hold is replicated) and below no point where
     *    another placed request continued differently (a prefix several sessions share, a
     *    system prompt). A shared prefix is no reason to prefer a worker: load spreads it,
     *    and each worker prefills it once (BUG-14). One session's history is specific.
     *  load: legs in flight there x the pool's mean work per leg in flight. Legs, not the work
     *    queued this instant: a request's later turns follow it, so the sessions a worker runs
     *    predict its load; a cold leg (a prefix being replicated) counts as one leg.
     *  follow: a worker now prefilling a prefix of this request (blocks sent there within
     *    the TTL, not yet reported stored) has load 0 when that prefix is at least
     *    RT_KV_FOLLOW_RATIO x the request's own new tokens: such a request mostly waits for
     *    that one prefill, so a cold burst of short tails on a long prefix is prefilled once
     *    (bounded by the balance guard); one with a long tail of its own is placed by load. */
    long sum_work = 0, sum_legs = 0;
    for (int i = 0; i < p->n; i++)
        if (KV_CANDIDATE(i)) sum_work += p->w[i]->work, sum_legs += p->w[i]->active;
    double per_leg = sum_legs > 0 ? (double)sum_work / (double)sum_legs : (double)(rq->tokens > 0 ? rq->tokens : 1);
    bool affinity = false;
    for (int i = 0; i < p->n; i++) {
        if (!KV_CANDIDATE(i)) continue;
        for (int j = 0; j < c[i].depth; j++) {
            int t = block_tier(p, i, rq, j, now_ms);
            c[i].raw_q += tier_q(t, tpb);
            if (t == 3) c[i].inflight += tpb;
            if (holders[j] == 1 && j >= common) c[i].spec_q += tier_q(t, tpb);
        }
        long own = rq->tokens - (long)c[i].depth * tpb;
        c[i].follow = c[i].inflight > 0 && c[i].inflight >= RT_KV_FOLLOW_RATIO * (own > 0 ? own : 0);
        double load = c[i].follow ? 0.0 : (double)p->w[i]->active * per_leg;
        c[i].cost = load - p->overlap_weight * (double)c[i].spec_q / 4.0;
        affinity |= c[i].spec_q > 0 || c[i].follow;
    }
    /* 3. the lowest cost; ties: more of the prompt held (no needless replication), then the
     * least loaded (--load-metric), then round robin. Without affinity (nothing specific
     * held, nothing to follow: a new session, or only a shared prefix matches) the least
     * loaded first, then more held, then the fewest legs sent so far, then the least work. */
    int best = -1, tied[256], nt = 0;
    for (int i = 0; i < p->n; i++) {
        if (!KV_CANDIDATE(i)) continue;
        int o = best < 0 ? -1 : kv_order(p, c, i, best, affinity);
        if (o < 0) best = i, nt = 0;
        if (o <= 0 && nt < 256) tied[nt++] = i;
    }
    if (best < 0) {
        free(c);
        free(holders);
        return -1;
    }
    if (nt > 1) best = tied[p->next++ % (unsigned)nt];
#undef KV_CANDIDATE
    *why = c[best].follow ? RT_WHY_PREDICTED : c[best].spec_q > 0 ? RT_WHY_KV : RT_WHY_LOAD;
    /* BUG-14 guard (SGLang's balance threshold): a worker chosen for blocks only it holds may
     * not run more than balance legs beyond the least loaded one; past that the least loaded
     * worker takes the request (and then holds the prefix too: it is replicated). */
    if ((c[best].spec_q > 0 || c[best].follow) && p->balance > 0) {
        int ll = rt_pool_least_loaded(p, exclude);
        if (ll >= 0 && p->w[best]->active > p->w[ll]->active + p->balance) {
            best = ll;
            *why = RT_WHY_LOAD;
        }
    }
    *predicted = c[best].raw_q / 4;
    char dbg[512];
    size_t dl = 0;
    for (int i = 0; i < p->n && i < 16 && dl < sizeof dbg; i++)
        if (rt_worker_live(p->w[i]))
            dl += (size_t)snprintf(dbg + dl, sizeof dbg - dl, " [%d] legs %ld work %ld saved %ld%s held %ld cost %.0f", i,
                                   p->w[i]->active, p->w[i]->work, c[i].spec_q / 4, c[i].follow ? " (follows)" : "",
                                   c[i].raw_q / 4, c[i].cost);
    KV_DEBUG("router kv_aware: %d blocks -> [%d] (%s):%s", nb, best, rt_reason_name(*why), dbg);
    free(c);
    free(holders);
    record_chain(p->pred, rq->bh, rq->n_blocks);
    if (p->pred && p->pred->ttl_ms > 0) { /* in-flight awareness: this prefix follows best a while */
        uint64_t v = ((now_ms + p->pred->ttl_ms) << 12) | (uint64_t)(best & 0xfff);
        for (int i = 0; i < rq->n_blocks; i++)
            if (map_put(&p->pred->map, pred_key(rq->bh[i], best), v, not_expired, &now_ms)) break;
    }
    return best;
}
