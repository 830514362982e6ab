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

/* ---- predictions: block hash -> (expiry ms << 12 | worker) ---- */

struct rt_predict {
    struct u64map map;
    uint64_t ttl_ms;
};

struct rt_predict *rt_predict_new(double ttl_s) {
    struct rt_predict *pr = calloc(1, sizeof *pr);
    if (pr) pr->ttl_ms = ttl_s > 0 ? (uint64_t)(ttl_s * 1000.0) : 0;
    return pr;
}

void rt_predict_free(struct rt_predict *pr) {
    if (!pr) return;
    map_free(&pr->map);
    free(pr);
}

static bool not_expired(uint64_t v, void *arg) { return (v >> 12) > *(const uint64_t *)arg; }

static int predicted_worker(const struct rt_predict *pr, uint64_t h, uint64_t now_ms) {
    long f = pr ? map_find(&pr->map, h) : -1;
    if (f < 0 || (pr->map.v[f] >> 12) <= now_ms) return -1;
    return (int)(pr->map.v[f] & 0xfff);
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

/* Matched tokens of rq on worker w (x4 fixed point: device 4, host 3 per token). */
static long matched_q(const struct rt_pool *p, int w, const struct rt_route *rq, uint64_t now_ms,
                      bool *used_pred) {
    const struct kv_mirror *m = p->w[w]->mirror;
    long q = 0;
    *used_pred = false;
    for (int i = 0; i < rq->n_blocks; i++) {
        int t = m ? kv_mirror_tier(m, rq->bh[i]) : 0;
        if (t == 1) q += 4L * rq->tokens_per_block;
        else if (t == 2) q += 3L * rq->tokens_per_block; /* host tier: 0.75 (Dynamo's credit) */
        else if (predicted_worker(p->pred, rq->bh[i], now_ms) == w) {
            q += 4L * rq->tokens_per_block;
            *used_pred = true;
        } else break;
    }
    return q;
}

int rt_kv_select(struct rt_pool *p, const struct rt_route *rq, int exclude, enum rt_reason *why,
                 long *predicted) {
    uint64_t now_ms = rq->now_ns / 1000000u;
    double denom = (double)(rq->n_blocks > 0 ? rq->n_blocks : 1) * (rq->tokens_per_block > 0 ? rq->tokens_per_block : 1);
    int max_batch = p->max_batch > 0 ? p->max_batch : 64;
    int best = -1, tied[256], nt = 0;
    double best_s = 0;
    long best_q = 0;
    bool best_pred = false;
    for (int i = 0; i < p->n; i++) {
        if (!rt_worker_live(p->w[i]) || (i == exclude && rt_pool_n_live(p) > 1)) continue;
        bool up;
        long q = matched_q(p, i, rq, now_ms, &up);
        double s = (double)q / 4.0 / denom - (double)p->w[i]->active / max_batch;
        if (best < 0 || s > best_s + 1e-12) {
            best = i;
            best_s = s;
            best_q = q;
            best_pred = up;
            nt = 0;
        }
        if (s >= best_s - 1e-12 && nt < 256) tied[nt++] = i;
    }
    if (best < 0) return -1;
    if (nt > 1) { /* ties: least loaded, then round robin (BUG-14) */
        long lo = -1;
        int k = 0;
        for (int t = 0; t < nt; t++) {
            long l = rt_pool_load(p, tied[t]);
            if (lo < 0 || l < lo) lo = l, k = 0;
            if (l == lo) tied[k++] = tied[t];
        }
        best = tied[p->next++ % (unsigned)k];
        bool up;
        best_q = matched_q(p, best, rq, now_ms, &up);
        best_pred = up;
    }
    /* BUG-14 guard (SGLang's balance threshold): a worker chosen for blocks it has STORED
     * may not run more than balance legs beyond the least loaded one; past that the least
     * loaded worker takes the request and will hold the prefix too (a hot prefix is then
     * replicated once per worker and load decides between equals). Predicted placements are
     * exempt: a burst on a cold prefix is prefilled once. */
    if (best_q > 0 && !best_pred && p->balance > 0) {
        int ll = rt_pool_least_loaded(p, exclude);
        if (ll >= 0 && p->w[best]->active > p->w[ll]->active + p->balance) {
            bool up;
            best = ll;
            best_q = matched_q(p, best, rq, now_ms, &up);
            best_pred = up;
            *why = RT_WHY_LOAD;
            *predicted = best_q / 4;
            goto record;
        }
    }
    *predicted = best_q / 4;
    *why = best_q == 0 ? RT_WHY_LOAD : best_pred ? RT_WHY_PREDICTED : RT_WHY_KV;
record:
    if (p->pred && p->pred->ttl_ms > 0) { /* in-flight awareness: this prefix follows best a while */
        uint64_t v = ((now_ms + p->pred->ttl_ms) << 12) | (uint64_t)(best & 0xfff);
        for (int i = 0; i < rq->n_blocks; i++)
            if (map_put(&p->pred->map, rq->bh[i], v, not_expired, &now_ms)) break;
    }
    return best;
}
