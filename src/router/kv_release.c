/*
 * kv_release: the router tells a context worker to drop the KV it keeps pinned for a generation
 * leg that will never pull it (docs/disaggregation.md "Releasing held KV").
 *
 *   rreq freed with a context leg sent and no generation leg that completed (it failed for
 *   good, was never delivered, or the client left)
 *     -> POST {context worker}/kv_release {"disagg_request_id": id}   (fire and forget, 5 s)
 *   a context-first context leg retried under a fresh id -> the same for the old id
 * Without it the context worker would hold the blocks until --kv-transfer-timeout. The call
 * carries the --worker-api-key header like every upstream call; a failure is logged and
 * counted (kvserve_router_kv_releases_total{outcome="failed"}), the worker's own deadline is
 * then the fallback. Runs on the router's loop thread only.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router_state.h"

#define RELEASE_TIMEOUT_S 5.0

static void on_release_done(struct upx *u, const struct rt_outcome *o, CURLcode rc) {
    struct router *r = u->owner;
    if (rt_classify(o) == RT_COMPLETED) {
        r->kv_releases[0]++;
    } else {
        r->kv_releases[1]++;
        KV_WARN("router: POST /kv_release to a context worker failed (%s, HTTP %ld): it frees the "
                "KV at its transfer deadline instead", rtq_curl_reason(u, rc), o->http_status);
    }
    upx_set_done(&r->rel, u);
}

void rt_kv_release(struct router *r, int ctx_idx, uint64_t id) {
    const struct rt_pool *p = R_CTX(r);
    if (ctx_idx < 0 || ctx_idx >= p->n || r->stopping) return;
    char url[2048], body[64];
    snprintf(url, sizeof url, "%s/kv_release", p->w[ctx_idx]->url);
    snprintf(body, sizeof body, "{\"disagg_request_id\":%llu}", (unsigned long long)id);
    struct upx *u = upx_start(&r->up, url, body, strlen(body), RELEASE_TIMEOUT_S, r);
    if (!u) return;
    u->on_done = on_release_done;
    u->kind = UPX_KV_RELEASE;
    u->worker = ctx_idx;
    if (!upx_set_add(&r->rel, u)) return;
    KV_DEBUG("router: releasing the KV of %llu on %s", (unsigned long long)id, p->w[ctx_idx]->url);
}

void rt_kv_release_stop(struct router *r) { upx_set_free_all(&r->rel); }
