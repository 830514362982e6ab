/*
 * workers: the router's side of its workers (router_state.h, docs/routing.md):
 *   - health: GET /health every --health-interval; two failures in a row take a worker out of
 *     its pool (its conversations and predictions are forgotten, legs in flight on it fail at
 *     once); the first success brings it back.
 *   - kv_aware mirrors: one GET /kv_events stream per worker, parsed event by event into its
 *     kv_mirror; the start event is checked (tokens per block, hash scheme, hash key
 *     fingerprint) and a mismatch refuses the worker loudly; a lost marker or a new worker_id
 *     resyncs; a stream that ends is reopened (after the last seq seen) within a second.
 *   - the coordinator path: POST /select, POST /finish (spec §1.3).
 *   - per-worker metrics.
 * Loop thread only.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>

#include "conv_index.h"
#include "discovery_etcd.h"
#include "kv_mirror.h"
#include "router_state.h"

#define MAINT_US 100000 /* maintenance tick: health schedule, stream reconnects */

struct kv_watch {
    struct upx *u;
    kv_buf buf;         /* bytes of an incomplete SSE event */
    uint64_t last_seq;
    bool have_seq;
    uint64_t retry_ns;  /* do not reconnect before */
};

static uint64_t g_next_health_ns;

static bool pool_kv(const struct rt_pool *p) { return p->policy == RT_POLICY_KV_AWARE; }

uint64_t rt_worker_events_seq(const struct rt_worker *w) {
    const struct kv_watch *kw = w->watch;
    return kw && kw->have_seq ? kw->last_seq : 0;
}

/* ------------------------------------------------------------------ leaving and joining */

void rt_worker_left(struct router *r, int pool, int idx, const char *why) {
    struct rt_pool *p = &r->pools[pool];
    struct rt_worker *w = p->w[idx];
    KV_WARN("router: %s worker %s left the pool: %s", p->role, w->url, why);
    rt_pool_worker_gone(p, idx);
    rt_predict_forget_worker(p->pred, idx);
    if (w->mirror) kv_mirror_clear(w->mirror);
    /* the legs in flight on it fail on the next maintenance tick (<= 100 ms): this may run
     * inside a libcurl data callback, where other transfers must not be removed */
    w->fail_legs = true;
    snprintf(w->why_left, sizeof w->why_left, "%s", why);
}

/* Fails every leg in flight on a worker that left (fail fast: never leave them hanging). */
static void fail_legs_of(struct router *r, int pool, int idx) {
    struct rt_pool *p = &r->pools[pool];
    struct rt_worker *w = p->w[idx];
    w->fail_legs = false;
    struct kv_watch *kw = w->watch;
    if (kw && kw->u) { /* its mirror was cleared: rebuild it from a fresh stream when it is back */
        upx_free(kw->u);
        kw->u = NULL;
        kw->have_seq = false;
        kw->buf.len = 0;
    }
    if (rt_worker_live(w)) return; /* it came back meanwhile */
    for (struct rreq *q = r->live, *next; q; q = next) {
        next = q->next;
        bool on = (q->final && q->final_pool == pool && q->final->worker == idx) ||
                  (q->ctx && pool == POOL_CTX && q->ctx->worker == idx) ||
                  (q->info && pool == POOL_CTX && q->info->worker == idx) ||
                  (q->probe && pool == POOL_GEN && q->probe->worker == idx);
        if (!on) continue;
        char msg[700];
        snprintf(msg, sizeof msg, "%s worker %s left the pool while serving this request (%s)", p->role,
                 w->url, w->why_left);
        r->worker_left_failures++;
        rtq_fail_client(q, 502, "server_error", "worker_gone", msg, OUT_UPSTREAM_ERROR);
    }
}

void rt_worker_joined(struct router *r, int pool, int idx) {
    struct rt_pool *p = &r->pools[pool];
    struct rt_worker *w = p->w[idx];
    w->healthy = true;
    w->health_fails = 0;
    if (pool_kv(p)) {
        if (!w->mirror) w->mirror = kv_mirror_new();
        if (!w->watch) w->watch = calloc(1, sizeof(struct kv_watch));
        w->refused = true; /* until its /kv_events start event proves the same hashing (BUG-13) */
        w->why_refused_final = false;
        snprintf(w->why_refused, sizeof w->why_refused, "its /kv_events stream has not started yet");
        if (!w->mirror || !w->watch) KV_ERROR("router: out of memory for the mirror of %s", w->url);
    }
}

/* ------------------------------------------------------------------ health */

static void on_health_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct router *r = u->owner;
    int pool = u->kind - 100, idx = u->worker;
    struct rt_worker *w = r->pools[pool].w[idx];
    w->health_busy = false;
    w->health_u = NULL;
    bool ok = rt_classify(o) == RT_COMPLETED;
    if (ok) {
        if (!w->healthy && w->present) KV_INFO("router: %s worker %s is healthy again", r->pools[pool].role, w->url);
        w->healthy = true;
        w->health_fails = 0;
    } else if (w->present) {
        r->health_failures++;
        if (++w->health_fails >= 2 && w->healthy) {
            w->healthy = false;
            char why[300];
            snprintf(why, sizeof why, "2 failed health checks in a row (%s)",
                     o->http_status ? "HTTP error" : rtq_curl_reason(u, rc));
            rt_worker_left(r, pool, idx, why);
        }
    }
    upx_free(u);
}

static void check_health(struct router *r) {
    double iv = r->cfg.health_interval_s;
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++) {
            struct rt_worker *w = r->pools[pl].w[i];
            if (!w->present || w->health_busy) continue;
            char url[2048];
            snprintf(url, sizeof url, "%s/health", w->url);
            struct upx *u = upx_start(&r->up, url, NULL, 0, iv > 0.2 ? iv : 0.2, r);
            if (!u) continue;
            u->on_done = on_health_done;
            u->worker = i;
            u->kind = 100 + pl;
            w->health_busy = true;
            w->health_u = u;
        }
}

/* ------------------------------------------------------------------ /kv_events mirrors */

static void watch_failed(struct router *r, struct rt_worker *w, const char *why) {
    struct kv_watch *kw = w->watch;
    (void)r;
    kw->retry_ns = kv_now_ns() + (w->refused ? 2000000000ull : 500000000ull);
    kw->buf.len = 0;
    if (why) KV_DEBUG("router: /kv_events of %s: %s", w->url, why);
}

/* One event block (lines up to a blank line). Returns false to end the stream. */
static bool watch_event(struct router *r, int pool, int idx, const char *ev, size_t n) {
    struct rt_pool *p = &r->pools[pool];
    struct rt_worker *w = p->w[idx];
    struct kv_watch *kw = w->watch;
    const char *d = NULL;
    for (size_t i = 0; i + 5 <= n; i++)
        if ((i == 0 || ev[i - 1] == '\n') && !memcmp(ev + i, "data:", 5)) {
            d = ev + i + 5;
            break;
        }
    if (!d) return true; /* comments (keepalive), ids */
    size_t dl = (size_t)(ev + n - d);
    json_t *j = json_loadb(d, dl, JSON_DISABLE_EOF_CHECK, NULL);
    if (!j) return true;
    char err[400] = "";
    struct kv_mirror_expect ex = {r->cfg.tokens_per_block, KV_HASH_SCHEME, r->key_id};
    uint64_t seq = kw->last_seq;
    enum kv_mirror_result res = kv_mirror_apply(w->mirror, j, &ex, &seq, err, sizeof err);
    bool start = !strcmp(json_string_value(json_object_get(j, "type")) ? json_string_value(json_object_get(j, "type")) : "", "start");
    json_decref(j);
    if (seq != kw->last_seq) kw->last_seq = seq, kw->have_seq = true;
    switch (res) {
    case KV_MIRROR_REFUSED:
        if (!w->refused || strcmp(w->why_refused, err)) {
            KV_ERROR("router: REFUSING %s worker %s: %s", p->role, w->url, err);
            r->workers_refused++;
        }
        bool was_live = rt_worker_live(w);
        w->refused = true;
        w->why_refused_final = true;
        snprintf(w->why_refused, sizeof w->why_refused, "%s", err);
        if (was_live) rt_worker_left(r, pool, idx, err);
        return false;
    case KV_MIRROR_END: kw->have_seq = false; return false;
    case KV_MIRROR_RESYNC:
        KV_INFO("router: %s worker %s: KV mirror resync (%s)", p->role, w->url,
                start ? "new worker_id" : "events lost");
        rt_predict_forget_worker(p->pred, idx);
        break;
    case KV_MIRROR_BAD: KV_DEBUG("router: /kv_events of %s: %s", w->url, err); break;
    case KV_MIRROR_OK: break;
    }
    if (start && w->refused) {
        w->refused = false;
        w->why_refused_final = false;
        w->why_refused[0] = 0;
        KV_INFO("router: %s worker %s mirrored (worker_id %s, %d tokens per block)", p->role, w->url,
                kv_mirror_worker_id(w->mirror), r->cfg.tokens_per_block);
    }
    return true;
}

static size_t on_events_data(struct upx *u, const char *p, size_t n) {
    struct router *r = u->owner;
    int pool = u->kind - 200, idx = u->worker;
    struct kv_watch *kw = r->pools[pool].w[idx]->watch;
    if (kv_buf_append(&kw->buf, p, n)) return 0;
    size_t k = rt_sse_complete(kw->buf.data, kw->buf.len), off = 0;
    while (off < k) { /* split the complete prefix into events at blank lines */
        const char *s = kw->buf.data + off;
        size_t rest = k - off, e = 0;
        while (e + 1 < rest && !(s[e] == '\n' && s[e + 1] == '\n')) e++;
        size_t len = e + 1 < rest ? e + 2 : rest;
        if (!watch_event(r, pool, idx, s, len)) return 0;
        off += len;
    }
    memmove(kw->buf.data, kw->buf.data + k, kw->buf.len - k);
    kw->buf.len -= k;
    return n;
}

static void on_events_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct router *r = u->owner;
    struct rt_worker *w = r->pools[u->kind - 200].w[u->worker];
    struct kv_watch *kw = w->watch;
    kw->u = NULL;
    char why[300];
    snprintf(why, sizeof why, "stream ended (%s, HTTP %ld)", rtq_curl_reason(u, rc), o->http_status);
    /* 400: our resume point is beyond the worker's last event (it restarted): start over */
    if (o->http_status == 400) kw->have_seq = false;
    upx_free(u);
    watch_failed(r, w, why);
}

static void start_watch(struct router *r, int pool, int idx) {
    struct rt_worker *w = r->pools[pool].w[idx];
    struct kv_watch *kw = w->watch;
    char url[2100];
    if (kw->have_seq) snprintf(url, sizeof url, "%s/kv_events?after=%llu", w->url, (unsigned long long)kw->last_seq);
    else snprintf(url, sizeof url, "%s/kv_events", w->url);
    kw->buf.len = 0;
    kw->u = upx_start(&r->up, url, NULL, 0, 0, r);
    if (!kw->u) {
        watch_failed(r, w, "out of memory");
        return;
    }
    kw->u->on_data = on_events_data;
    kw->u->on_done = on_events_done;
    kw->u->worker = idx;
    kw->u->kind = 200 + pool;
}

/* ------------------------------------------------------------------ maintenance tick */

static void on_maint(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct router *r = arg;
    uint64_t now = kv_now_ns();
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++)
            if (r->pools[pl].w[i]->fail_legs) fail_legs_of(r, pl, i);
    if (r->cfg.health_interval_s > 0 && now >= g_next_health_ns) {
        g_next_health_ns = now + (uint64_t)(r->cfg.health_interval_s * 1e9);
        check_health(r);
    }
    for (int pl = 0; pl < POOL_N; pl++) {
        if (!pool_kv(&r->pools[pl])) continue;
        for (int i = 0; i < r->pools[pl].n; i++) {
            struct rt_worker *w = r->pools[pl].w[i];
            struct kv_watch *kw = w->watch;
            if (kw && w->mirror && !kw->u && w->present && w->healthy && now >= kw->retry_ns) start_watch(r, pl, i);
        }
    }
    if (r->etcd) etcd_watch_tick(r->etcd);
}

kv_status rt_workers_start(struct router *r, char *err, size_t errlen) {
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++) rt_worker_joined(r, pl, i);
    r->health = event_new(r->base, -1, EV_PERSIST, on_maint, r);
    if (!r->health) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    struct timeval tv = {0, MAINT_US};
    evtimer_add(r->health, &tv);
    g_next_health_ns = kv_now_ns() + (uint64_t)(r->cfg.health_interval_s * 1e9);
    if (r->cfg.etcd) {
        kv_status st = etcd_watch_start(r, &r->etcd, err, errlen);
        if (st) return st;
    }
    on_maint(-1, 0, r); /* open the mirrors now */
    return KV_OK;
}

void rt_workers_stop(struct router *r) {
    rt_coord_stop(r);
    rt_kv_release_stop(r);
    etcd_watch_stop(r->etcd);
    r->etcd = NULL;
    if (r->health) event_free(r->health);
    r->health = NULL;
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++) {
            struct rt_worker *w = r->pools[pl].w[i];
            struct kv_watch *kw = w->watch;
            if (kw) {
                upx_free(kw->u);
                kv_buf_free(&kw->buf);
                free(kw);
            }
            w->watch = NULL;
            upx_free(w->health_u);
            w->health_u = NULL;
            kv_mirror_free(w->mirror);
            w->mirror = NULL;
        }
    while (r->resv) {
        struct rt_reservation *x = r->resv;
        r->resv = x->next;
        free(x->req_id);
        free(x);
    }
}
