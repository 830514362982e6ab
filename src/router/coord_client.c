/*
 * coord_client: a router replica placing through a coordinator (`--coordinator URL`, another
 * `kvserve router` with the same workers, --hash-key-file and --tokens-per-block), so that
 * several replicas share one placement state: one conversation index, one load count
 * (peers.md BUG-14: replicas that each see only their own load pile onto the same worker).
 *
 *   client request -> route inputs -> POST {coordinator}/select per pool role
 *       {role, req_id: "<replica>/<id>/<role>", routing_key: {conversation_id, content_keys}}
 *     -> {server}: that worker (added to the local pool if new), charged locally too
 *     -> {server: null} / error / timeout (2 s): placed locally by this replica's policy
 *   all answers in -> rtq_dispatch (the legs, as without a coordinator)
 *   request freed -> POST /finish {role, req_id, success} (fire and forget)
 * The content key is sent at once (this replica hashes anyway), so the id-only handshake of
 * spec §1.3 is not needed here. Retries of failed legs are placed locally.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router_state.h"

#define COORD_TIMEOUT_S 2.0

static const char *const role_names[POOL_N] = {"aggregated", "context", "generation"};

static enum rt_reason reason_of(const char *s) {
    for (int k = 0; k < RT_WHY_N; k++)
        if (s && !strcmp(s, rt_reason_name(k))) return (enum rt_reason)k;
    return RT_WHY_LOAD;
}

static void req_id_of(const struct rreq *q, int pool, char *out, size_t n) {
    snprintf(out, n, "%s/%llu/%s", q->r->self_id, (unsigned long long)q->id, role_names[pool]);
}

static void on_sel_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct rreq *q = u->owner;
    struct router *r = q->r;
    int pool = u->kind - UPX_COORD_SELECT_BASE;
    q->sel[pool] = NULL;
    q->sel_pending--;
    json_t *j = rt_classify(o) == RT_COMPLETED ? json_loadb(u->resp.data ? u->resp.data : "", u->resp.len, 0, NULL) : NULL;
    const char *server = json_string_value(json_object_get(j, "server"));
    if (!j) {
        r->coord_errors++;
        KV_WARN("router: coordinator /select failed (%s, HTTP %ld): placing locally",
                rt_classify(o) == RT_COMPLETED ? "not JSON" : rtq_curl_reason(u, rc), o->http_status);
    } else if (server) {
        struct rt_pool *p = &r->pools[pool];
        int idx = rt_pool_find(p, server);
        if (idx < 0 && (idx = rt_pool_add(p, server)) >= 0) rt_worker_joined(r, pool, idx);
        if (idx >= 0 && rt_worker_live(p->w[idx])) {
            rtq_assign(q, pool, idx, reason_of(json_string_value(json_object_get(json_object_get(j, "info"), "reason"))));
            q->coord[pool] = true;
            r->coord_placements++;
        } else {
            q->coord[pool] = true; /* reserved there: finish it even though we place elsewhere */
        }
    }
    json_decref(j);
    upx_free(u);
    if (q->client_gone || !q->req) {
        rtq_maybe_free(q);
        return;
    }
    if (q->sel_pending == 0) rtq_dispatch(q);
}

bool rt_coord_select(struct rreq *q) {
    struct router *r = q->r;
    bool disagg = R_CTX(r)->n && R_GEN(r)->n;
    int pools[2], np = 0;
    if (disagg) pools[np++] = POOL_CTX, pools[np++] = POOL_GEN;
    else pools[np++] = POOL_AGG;
    json_t *keys = json_array();
    for (int i = 0; keys && i < q->n_ckeys; i++) {
        char hx[17];
        static const char d[] = "0123456789abcdef";
        for (int b = 0; b < 8; b++) { /* the key's first 8 bytes (kv_hash_u64 is little endian) */
            unsigned v = (unsigned)(q->ckeys[i] >> (8 * b)) & 255u;
            hx[2 * b] = d[v >> 4];
            hx[2 * b + 1] = d[v & 15];
        }
        hx[16] = 0;
        json_array_append_new(keys, json_string(hx));
    }
    bool any = false;
    for (int k = 0; k < np; k++) {
        int pool = pools[k];
        char rid[400], url[1200];
        req_id_of(q, pool, rid, sizeof rid);
        json_t *key = json_pack("{s:O}", "content_keys", keys);
        if (key && q->conv_id) json_object_set_new(key, "conversation_id", json_string(q->conv_id));
        json_t *body = key ? json_pack("{s:s, s:s, s:o, s:n}", "role", role_names[pool], "req_id", rid,
                                       "routing_key", key, "exclude_server")
                           : NULL;
        char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
        json_decref(body);
        snprintf(url, sizeof url, "%s/select", r->cfg.coordinator);
        struct upx *u = s ? upx_start(&r->up, url, s, strlen(s), COORD_TIMEOUT_S, q) : NULL;
        free(s);
        if (!u) continue; /* placed locally */
        u->on_done = on_sel_done;
        u->kind = UPX_COORD_SELECT_BASE + pool;
        q->sel[pool] = u;
        q->sel_pending++;
        any = true;
    }
    json_decref(keys);
    return any;
}

static void on_finish_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct router *r = u->owner;
    if (rt_classify(o) != RT_COMPLETED) {
        r->coord_errors++;
        KV_WARN("router: coordinator /finish failed (%s, HTTP %ld)", rtq_curl_reason(u, rc), o->http_status);
    }
    upx_set_done(&r->coord_fin, u);
}

void rt_coord_finish(struct rreq *q) {
    struct router *r = q->r;
    for (int pool = 0; pool < POOL_N; pool++) {
        if (!q->coord[pool]) continue;
        q->coord[pool] = false;
        char rid[400], url[1200], body[600];
        req_id_of(q, pool, rid, sizeof rid);
        json_t *b = json_pack("{s:s, s:s, s:b}", "role", role_names[pool], "req_id", rid, "success",
                              q->counted_ok);
        char *s = b ? json_dumps(b, JSON_COMPACT) : NULL;
        json_decref(b);
        snprintf(body, sizeof body, "%s", s ? s : "");
        free(s);
        if (!body[0]) continue;
        snprintf(url, sizeof url, "%s/finish", r->cfg.coordinator);
        struct upx *u = upx_start(&r->up, url, body, strlen(body), COORD_TIMEOUT_S, r);
        if (!u) continue;
        u->on_done = on_finish_done;
        u->kind = UPX_COORD_FINISH;
        upx_set_add(&r->coord_fin, u);
    }
}

void rt_coord_stop(struct router *r) { upx_set_free_all(&r->coord_fin); }
