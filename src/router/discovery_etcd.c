/*
 * discovery_etcd: the router's watch of the workers registered in etcd (etcd.h picture).
 *
 *   start / stream ended (1 s later): POST /v3/kv/range {prefix} -> the registered set: add
 *   every worker in it, remove every etcd worker not in it; then POST /v3/watch from the
 *   range's revision + 1: each line is one JSON message; PUT adds, DELETE removes.
 *   A value is {"url": base URL, "role": "aggregated"|"context"|"generation"}.
 * Removal = the worker leaves its pool (router_state.h rt_worker_left: conversations forgotten,
 * legs in flight failed at once). All on the router's loop through the libcurl multi handle.
 */
#include "discovery_etcd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd.h"
#include "router_state.h"

struct etcd_entry {
    char *key; /* owned, decoded */
    int pool, idx;
};

struct etcd_watch {
    struct router *r;
    char *url;             /* etcd base URL, no trailing slash */
    char *key_b64, *end_b64;
    struct upx *range, *watch;
    kv_buf buf;            /* incomplete watch line */
    long long revision;
    uint64_t retry_ns;
    struct etcd_entry *e;
    int n, cap;
    uint64_t events;
};

static int find_key(const struct etcd_watch *w, const char *key) {
    for (int i = 0; i < w->n; i++)
        if (!strcmp(w->e[i].key, key)) return i;
    return -1;
}

static void remove_at(struct etcd_watch *w, int i, const char *why) {
    struct router *r = w->r;
    struct etcd_entry x = w->e[i];
    w->e[i] = w->e[--w->n];
    struct rt_worker *wk = r->pools[x.pool].w[x.idx];
    if (wk->present) {
        bool was_live = rt_worker_live(wk);
        wk->present = false;
        if (was_live) rt_worker_left(r, x.pool, x.idx, why);
    }
    free(x.key);
}

static void add_kv(struct etcd_watch *w, const char *key, const char *val_b64) {
    size_t n;
    char *v = val_b64 ? etcd_b64_decode(val_b64, &n) : NULL;
    json_t *j = v ? json_loads(v, 0, NULL) : NULL;
    free(v);
    const char *url = json_string_value(json_object_get(j, "url"));
    const char *role = json_string_value(json_object_get(j, "role"));
    int pool = !role || !strcmp(role, "aggregated") ? POOL_AGG
               : !strcmp(role, "context")           ? POOL_CTX
               : !strcmp(role, "generation")        ? POOL_GEN
                                                    : -1;
    if (!url || pool < 0 || (strncmp(url, "http://", 7) && strncmp(url, "https://", 8))) {
        KV_WARN("router: etcd key %s: ignored (value is not {\"url\": \"http://...\", \"role\": ...})", key);
        json_decref(j);
        return;
    }
    int k = find_key(w, key);
    if (k >= 0 && w->r->pools[w->e[k].pool].w[w->e[k].idx]->present) {
        json_decref(j);
        return;
    }
    int idx = rt_pool_add(&w->r->pools[pool], url);
    if (idx >= 0 && k < 0 && w->n == w->cap) {
        int cap = w->cap ? w->cap * 2 : 8;
        struct etcd_entry *e = realloc(w->e, (size_t)cap * sizeof *e);
        if (e) w->e = e, w->cap = cap;
    }
    char *kd = idx >= 0 && k < 0 && w->n < w->cap ? strdup(key) : NULL;
    if (idx < 0 || (k < 0 && !kd)) {
        KV_ERROR("router: out of memory adding etcd worker %s", url);
        json_decref(j);
        return;
    }
    if (k < 0) w->e[w->n++] = (struct etcd_entry){kd, pool, idx};
    else w->e[k].pool = pool, w->e[k].idx = idx;
    rt_worker_joined(w->r, pool, idx);
    KV_INFO("router: etcd: %s worker %s joined", w->r->pools[pool].role, url);
    json_decref(j);
}

static char *key_of(const json_t *kv) {
    size_t n;
    const char *k = json_string_value(json_object_get(kv, "key"));
    return k ? etcd_b64_decode(k, &n) : NULL;
}

static long long ll_of(const json_t *v) {
    if (json_is_integer(v)) return (long long)json_integer_value(v);
    const char *s = json_string_value(v);
    return s ? strtoll(s, NULL, 10) : 0;
}

static void start_range(struct etcd_watch *w);

static void on_watch_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct etcd_watch *w = u->owner;
    w->watch = NULL;
    KV_WARN("router: etcd watch ended (%s, HTTP %ld); resyncing in 1 s", rtq_curl_reason(u, rc), o->http_status);
    upx_free(u);
    w->retry_ns = kv_now_ns() + 1000000000ull;
}

static void watch_line(struct etcd_watch *w, const char *p, size_t n) {
    json_t *j = json_loadb(p, n, 0, NULL);
    json_t *res = json_object_get(j, "result");
    size_t i;
    json_t *ev;
    json_array_foreach(json_object_get(res, "events"), i, ev) {
        json_t *kv = json_object_get(ev, "kv");
        char *key = key_of(kv);
        if (!key) continue;
        w->events++;
        const char *type = json_string_value(json_object_get(ev, "type"));
        if (type && !strcmp(type, "DELETE")) {
            int k = find_key(w, key);
            if (k >= 0) {
                KV_INFO("router: etcd: %s deregistered (lease expired or revoked)", key);
                remove_at(w, k, "its etcd registration ended (lease expired or revoked)");
            }
        } else {
            add_kv(w, key, json_string_value(json_object_get(kv, "value")));
        }
        long long rev = ll_of(json_object_get(kv, "mod_revision"));
        if (rev > w->revision) w->revision = rev;
        free(key);
    }
    json_decref(j);
}

static size_t on_watch_data(struct upx *u, const char *p, size_t n) {
    struct etcd_watch *w = u->owner;
    if (kv_buf_append(&w->buf, p, n)) return 0;
    size_t off = 0;
    for (size_t i = 0; i < w->buf.len; i++)
        if (w->buf.data[i] == '\n') {
            if (i > off) watch_line(w, w->buf.data + off, i - off);
            off = i + 1;
        }
    /* the gateway may not end a message with a newline: try the rest as one message */
    if (off < w->buf.len) {
        json_t *j = json_loadb(w->buf.data + off, w->buf.len - off, 0, NULL);
        if (j) {
            json_decref(j);
            watch_line(w, w->buf.data + off, w->buf.len - off);
            off = w->buf.len;
        }
    }
    memmove(w->buf.data, w->buf.data + off, w->buf.len - off);
    w->buf.len -= off;
    return n;
}

static void start_watch(struct etcd_watch *w) {
    char body[600], url[1100];
    snprintf(body, sizeof body, "{\"create_request\":{\"key\":\"%s\",\"range_end\":\"%s\",\"start_revision\":\"%lld\"}}",
             w->key_b64, w->end_b64, w->revision + 1);
    snprintf(url, sizeof url, "%s/v3/watch", w->url);
    w->buf.len = 0;
    w->watch = upx_start(&w->r->up, url, body, strlen(body), 0, w);
    if (!w->watch) {
        w->retry_ns = kv_now_ns() + 1000000000ull;
        return;
    }
    w->watch->on_data = on_watch_data;
    w->watch->on_done = on_watch_done;
    w->watch->kind = UPX_ETCD;
}

static void on_range_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct etcd_watch *w = u->owner;
    w->range = NULL;
    json_t *j = rt_classify(o) == RT_COMPLETED ? json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, 0, NULL) : NULL;
    if (!j) {
        KV_WARN("router: etcd %s: range failed (%s, HTTP %ld); retrying in 1 s", w->url,
                rtq_curl_reason(u, rc), o->http_status);
        upx_free(u);
        w->retry_ns = kv_now_ns() + 1000000000ull;
        return;
    }
    upx_free(u);
    json_t *kvs = json_object_get(j, "kvs");
    for (int i = w->n - 1; i >= 0; i--) { /* registrations that ended while we were not watching */
        bool found = false;
        size_t k;
        json_t *kv;
        json_array_foreach(kvs, k, kv) {
            char *key = key_of(kv);
            found = found || (key && !strcmp(key, w->e[i].key));
            free(key);
        }
        if (!found) remove_at(w, i, "its etcd registration ended");
    }
    size_t k;
    json_t *kv;
    json_array_foreach(kvs, k, kv) {
        char *key = key_of(kv);
        if (key) add_kv(w, key, json_string_value(json_object_get(kv, "value")));
        free(key);
    }
    w->revision = ll_of(json_object_get(json_object_get(j, "header"), "revision"));
    json_decref(j);
    start_watch(w);
}

static void start_range(struct etcd_watch *w) {
    char body[600], url[1100];
    snprintf(body, sizeof body, "{\"key\":\"%s\",\"range_end\":\"%s\"}", w->key_b64, w->end_b64);
    snprintf(url, sizeof url, "%s/v3/kv/range", w->url);
    w->range = upx_start(&w->r->up, url, body, strlen(body), 5, w);
    if (!w->range) {
        w->retry_ns = kv_now_ns() + 1000000000ull;
        return;
    }
    w->range->on_done = on_range_done;
    w->range->kind = UPX_ETCD;
}

void etcd_watch_tick(struct etcd_watch *w) {
    if (!w->range && !w->watch && kv_now_ns() >= w->retry_ns) start_range(w);
}

int etcd_watch_count(const struct etcd_watch *w) { return w ? w->n : 0; }
uint64_t etcd_watch_events(const struct etcd_watch *w) { return w ? w->events : 0; }

kv_status etcd_watch_start(struct router *r, struct etcd_watch **out, char *err, size_t errlen) {
    const char *prefix = r->cfg.etcd_prefix ? r->cfg.etcd_prefix : ETCD_DEFAULT_PREFIX;
    if (strncmp(r->cfg.etcd, "http://", 7) && strncmp(r->cfg.etcd, "https://", 8))
        return kv_errf(KV_EINVAL, err, errlen, "--etcd %s: expected a URL like http://127.0.0.1:2379", r->cfg.etcd);
    struct etcd_watch *w = calloc(1, sizeof *w);
    if (!w) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    w->r = r;
    w->url = strdup(r->cfg.etcd);
    w->key_b64 = etcd_b64_encode(prefix, strlen(prefix));
    w->end_b64 = etcd_prefix_end_b64(prefix);
    kv_buf_init(&w->buf);
    if (!w->url || !w->key_b64 || !w->end_b64) {
        etcd_watch_stop(w);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    size_t ul = strlen(w->url);
    while (ul > 0 && w->url[ul - 1] == '/') w->url[--ul] = 0;
    KV_INFO("router: watching etcd %s prefix %s", w->url, prefix);
    start_range(w);
    *out = w;
    return KV_OK;
}

void etcd_watch_stop(struct etcd_watch *w) {
    if (!w) return;
    upx_free(w->range);
    upx_free(w->watch);
    for (int i = 0; i < w->n; i++) free(w->e[i].key);
    free(w->e);
    kv_buf_free(&w->buf);
    free(w->url);
    free(w->key_b64);
    free(w->end_b64);
    free(w);
}
