/*
 * coordinator: POST /select and POST /finish, so that several router replicas (or workers
 * delegating their routing) share one placement state (spec seed-features.md §1.2 coordinator
 * path, §1.3 handshake; docs/routing.md). And the per-worker part of GET /metrics.
 *
 *   /select {role, req_id, exclude_server, routing_key: {conversation_id, content_keys?}}
 *     id routable (tracked, worker live, not excluded), or content placement off
 *         -> {server, info: {reason}, req_id}; load +1 reserved under req_id
 *     id not routable and no content keys
 *         -> {server: null, info: {routing_content_required: true}, req_id}; nothing reserved
 *     content keys given (hex, as kv_content_keys computes them with the shared secret)
 *         -> placed (content / load), pinned, reserved
 *   /finish {role, req_id, success} -> the reservation is released ({"released": bool})
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>

#include "conv_index.h"
#include "discovery_etcd.h"
#include "kv_mirror.h"
#include "router_state.h"

static json_t *read_body(struct router *r, struct evhttp_request *req) {
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    json_error_t je;
    json_t *j = json_loadb(len ? (const char *)evbuffer_pullup(in, -1) : "", len, 0, &je);
    if (!json_is_object(j)) {
        json_decref(j);
        http_reply_errf(&r->reply, req, 400, "invalid_request_error", NULL, NULL,
                        "the body must be a JSON object");
        return NULL;
    }
    return j;
}

/* The pool of a role name ("aggregated" default; with a disaggregated pool "context" /
 * "generation"). -1 when the router has no such pool. */
static int role_pool(struct router *r, const char *role) {
    int id = !role || !strcmp(role, "aggregated") ? POOL_AGG
             : !strcmp(role, "context")           ? POOL_CTX
             : !strcmp(role, "generation")        ? POOL_GEN
                                                  : -1;
    return id >= 0 && r->pools[id].n > 0 ? id : -1;
}

static const char *req_id_str(json_t *v, char *buf, size_t n) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_integer(v)) {
        snprintf(buf, n, "%lld", (long long)json_integer_value(v));
        return buf;
    }
    return NULL;
}

void rt_handle_select(struct router *r, struct evhttp_request *req) {
    json_t *j = read_body(r, req);
    if (!j) return;
    char idbuf[32], msg[300];
    const char *role = json_string_value(json_object_get(j, "role"));
    const char *rid = req_id_str(json_object_get(j, "req_id"), idbuf, sizeof idbuf);
    json_t *key = json_object_get(j, "routing_key");
    const char *conv = json_is_string(key) ? json_string_value(key)
                                           : json_string_value(json_object_get(key, "conversation_id"));
    json_t *ck = json_object_get(key, "content_keys");
    const char *excl = json_string_value(json_object_get(j, "exclude_server"));
    int pool = role_pool(r, role);
    if (pool < 0 || !rid || (!json_is_null(json_object_get(j, "exclude_server")) && json_object_get(j, "exclude_server") && !excl) ||
        (ck && !json_is_array(ck))) {
        snprintf(msg, sizeof msg, "%s", pool < 0 ? "'role' names no pool of this router"
                                         : !rid   ? "'req_id' (string or integer) is required"
                                         : !excl && json_object_get(j, "exclude_server") && !json_is_null(json_object_get(j, "exclude_server"))
                                             ? "'exclude_server' must be a URL string or null"
                                             : "'routing_key.content_keys' must be an array of hex strings");
        json_decref(j);
        http_reply_errf(&r->reply, req, 400, "invalid_request_error", NULL, NULL, msg);
        return;
    }
    struct rt_pool *p = &r->pools[pool];
    int exclude = excl ? rt_pool_find(p, excl) : -1;
    if (!ck && !rt_conv_routable(p, conv, exclude)) {
        /* content required: no reservation, no load, no pending entry (spec §1.3) */
        json_t *o = json_pack("{s:n, s:{s:b}, s:s}", "server", "info", "routing_content_required", 1,
                              "req_id", rid);
        json_decref(j);
        http_reply_json(&r->reply, req, 200, o);
        return;
    }
    size_t nk = json_array_size(ck);
    uint64_t *keys = nk ? malloc(nk * sizeof *keys) : NULL;
    int n_keys = 0;
    for (size_t i = 0; i < nk && keys; i++)
        if (kv_hash_u64_from_hex(json_string_value(json_array_get(ck, i)), &keys[n_keys])) n_keys++;
    long tokens = (long)n_keys * KV_CONTENT_GROUP_BLOCKS * r->cfg.tokens_per_block;
    struct rt_route rq = {conv, keys, n_keys, NULL, 0, r->cfg.tokens_per_block, tokens, kv_now_ns()};
    enum rt_reason why;
    long predicted;
    int idx = rt_select(p, &rq, exclude, &why, &predicted);
    free(keys);
    if (idx >= 0 && idx == exclude) idx = -1; /* the caller excluded the only live worker */
    if (idx < 0) {
        json_decref(j);
        snprintf(msg, sizeof msg, "no available %s worker%s%s", p->role, excl ? " after excluding " : "",
                 excl ? excl : "");
        http_reply_errf(&r->reply, req, 503, "server_error", NULL, "no_worker", msg);
        return;
    }
    struct rt_reservation *x = calloc(1, sizeof *x);
    if (x) x->req_id = strdup(rid);
    if (!x || !x->req_id) {
        free(x);
        json_decref(j);
        http_reply_errf(&r->reply, req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    x->pool = pool;
    x->idx = idx;
    x->tokens = tokens;
    x->work = rt_leg_work(tokens, predicted, 0);
    x->next = r->resv;
    r->resv = x;
    rt_pool_charge(p, idx, tokens, x->work);
    json_t *o = json_pack("{s:s, s:{s:s}, s:s}", "server", p->w[idx]->url, "info", "reason",
                          rt_reason_name(why), "req_id", rid);
    json_decref(j);
    http_reply_json(&r->reply, req, 200, o);
}

void rt_handle_finish(struct router *r, struct evhttp_request *req) {
    json_t *j = read_body(r, req);
    if (!j) return;
    char idbuf[32];
    const char *rid = req_id_str(json_object_get(j, "req_id"), idbuf, sizeof idbuf);
    int pool = role_pool(r, json_string_value(json_object_get(j, "role")));
    if (!rid || pool < 0) {
        json_decref(j);
        http_reply_errf(&r->reply, req, 400, "invalid_request_error", NULL, NULL,
                        !rid ? "'req_id' (string or integer) is required" : "'role' names no pool of this router");
        return;
    }
    bool released = false;
    for (struct rt_reservation **pp = &r->resv; *pp; pp = &(*pp)->next) {
        struct rt_reservation *x = *pp;
        if (x->pool != pool || strcmp(x->req_id, rid)) continue;
        rt_pool_release(&r->pools[pool], x->idx, x->tokens, x->work);
        *pp = x->next;
        free(x->req_id);
        free(x);
        released = true;
        break;
    }
    json_decref(j);
    http_reply_json(&r->reply, req, 200, json_pack("{s:b}", "released", released));
}

/* ------------------------------------------------------------------ metrics */

kv_status rt_workers_metrics(struct router *r, kv_buf *b) {
    kv_status st = KV_OK;
#define HDR(n, t, h) st |= kv_buf_printf(b, "# HELP kvserve_router_" n " " h "\n# TYPE kvserve_router_" n " " t "\n")
    HDR("placements_total", "counter", "Placements by role and reason.");
    for (int pl = 0; pl < POOL_N; pl++) {
        if (!r->pools[pl].n) continue;
        for (int k = 0; k < RT_WHY_N; k++)
            st |= kv_buf_printf(b, "kvserve_router_placements_total{role=\"%s\",reason=\"%s\"} %llu\n",
                                r->pools[pl].role, rt_reason_name(k), (unsigned long long)r->pools[pl].reasons[k]);
    }
    HDR("worker_requests_total", "counter", "Legs sent to each worker.");
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++)
            st |= kv_buf_printf(b, "kvserve_router_worker_requests_total{role=\"%s\",worker=\"%s\"} %llu\n",
                                r->pools[pl].role, r->pools[pl].w[i]->url,
                                (unsigned long long)r->pools[pl].w[i]->requests);
    HDR("worker_in_flight", "gauge", "Legs in flight (requests) per worker.");
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++)
            st |= kv_buf_printf(b, "kvserve_router_worker_in_flight{role=\"%s\",worker=\"%s\"} %ld\n",
                                r->pools[pl].role, r->pools[pl].w[i]->url, r->pools[pl].w[i]->active);
    HDR("worker_live", "gauge", "1 when the worker takes requests (present, healthy, not refused).");
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++)
            st |= kv_buf_printf(b, "kvserve_router_worker_live{role=\"%s\",worker=\"%s\"} %d\n",
                                r->pools[pl].role, r->pools[pl].w[i]->url, rt_worker_live(r->pools[pl].w[i]));
    HDR("worker_cached_tokens_total", "counter",
        "Cached prompt tokens per worker: predicted by the router at placement, reported in usage.");
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++) {
            const struct rt_worker *w = r->pools[pl].w[i];
            st |= kv_buf_printf(b,
                                "kvserve_router_worker_cached_tokens_total{role=\"%s\",worker=\"%s\",source=\"predicted\"} %llu\n"
                                "kvserve_router_worker_cached_tokens_total{role=\"%s\",worker=\"%s\",source=\"reported\"} %llu\n",
                                r->pools[pl].role, w->url, (unsigned long long)w->predicted_tokens,
                                r->pools[pl].role, w->url, (unsigned long long)w->reported_tokens);
        }
    HDR("worker_mirrored_blocks", "gauge", "kv_aware: blocks the router mirrors per worker.");
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++)
            if (r->pools[pl].w[i]->mirror)
                st |= kv_buf_printf(b, "kvserve_router_worker_mirrored_blocks{role=\"%s\",worker=\"%s\"} %ld\n",
                                    r->pools[pl].role, r->pools[pl].w[i]->url, kv_mirror_size(r->pools[pl].w[i]->mirror));
    HDR("worker_kv_events_seq", "gauge", "kv_aware: seq of the last /kv_events event mirrored per worker.");
    for (int pl = 0; pl < POOL_N; pl++)
        for (int i = 0; i < r->pools[pl].n; i++)
            if (r->pools[pl].w[i]->mirror)
                st |= kv_buf_printf(b, "kvserve_router_worker_kv_events_seq{role=\"%s\",worker=\"%s\"} %llu\n",
                                    r->pools[pl].role, r->pools[pl].w[i]->url,
                                    (unsigned long long)rt_worker_events_seq(r->pools[pl].w[i]));
    HDR("conversations", "gauge", "conversation: tracked conversations per role.");
    for (int pl = 0; pl < POOL_N; pl++)
        if (r->pools[pl].conv)
            st |= kv_buf_printf(b, "kvserve_router_conversations{role=\"%s\"} %d\n", r->pools[pl].role,
                                conv_index_size(r->pools[pl].conv));
    HDR("health_failures_total", "counter", "Failed health checks.");
    st |= kv_buf_printf(b, "kvserve_router_health_failures_total %llu\n", (unsigned long long)r->health_failures);
    HDR("workers_refused_total", "counter", "Workers refused for a different block hashing (kv_aware).");
    st |= kv_buf_printf(b, "kvserve_router_workers_refused_total %llu\n", (unsigned long long)r->workers_refused);
    HDR("worker_gone_failures_total", "counter", "Requests failed because their worker left the pool.");
    st |= kv_buf_printf(b, "kvserve_router_worker_gone_failures_total %llu\n",
                        (unsigned long long)r->worker_left_failures);
    if (r->etcd) {
        HDR("etcd_workers", "gauge", "Workers registered in etcd now.");
        st |= kv_buf_printf(b, "kvserve_router_etcd_workers %d\n", etcd_watch_count(r->etcd));
        HDR("etcd_events_total", "counter", "etcd PUT/DELETE events seen.");
        st |= kv_buf_printf(b, "kvserve_router_etcd_events_total %llu\n",
                            (unsigned long long)etcd_watch_events(r->etcd));
    }
    if (r->cfg.coordinator) {
        HDR("coordinator_placements_total", "counter", "Placements the coordinator (--coordinator) made.");
        st |= kv_buf_printf(b, "kvserve_router_coordinator_placements_total %llu\n",
                            (unsigned long long)r->coord_placements);
        HDR("coordinator_errors_total", "counter", "Failed coordinator /select or /finish calls.");
        st |= kv_buf_printf(b, "kvserve_router_coordinator_errors_total %llu\n", (unsigned long long)r->coord_errors);
    }
    HDR("reservations", "gauge", "Coordinator reservations (POST /select) not finished yet.");
    long nres = 0;
    for (const struct rt_reservation *x = r->resv; x; x = x->next) nres++;
    st |= kv_buf_printf(b, "kvserve_router_reservations %ld\n", nres);
#undef HDR
    return st;
}
