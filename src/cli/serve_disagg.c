/* serve_disagg: --role / --kv-* options and the engine <-> transfer agent glue (see header). */
#include "serve_disagg.h"

#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "transfer/transfer.h"
#include "transfer/transport.h"
#ifdef KVSERVE_HAVE_CUDA
#include "backend/cuda/transport_cuda_ipc.h"
#endif

void serve_disagg_defaults(struct serve_disagg *d) {
    memset(d, 0, sizeof *d);
    d->role = "aggregated";
    d->kv_transport = NULL; /* default picked at start */
    d->kv_timeout_s = 60.0;
    d->kv_stale_ttl_s = 120.0;
    d->kv_bounce_min_bytes = 2ull << 20;
}

void serve_disagg_usage(FILE *f) {
    fprintf(f,
            "disaggregated serving (docs/disaggregation.md):\n"
            "  --role ROLE              aggregated (default) | context (prefill; offers KV) |\n"
            "                           generation (decode; pulls KV from context workers)\n"
            "  --kv-transfer-host ADDR  KV-transfer listen/advertised address (default: --host)\n"
            "  --kv-transfer-port N     KV-transfer port (default 0 = any free port)\n"
            "  --kv-transport T         ucx | tcp | cuda_ipc (default: cuda_ipc with --backend cuda,\n"
            "                           else ucx when built with UCX, else tcp)\n"
            "  --kv-transfer-timeout S  deadline of one KV transfer, each side (default 60)\n"
            "  --kv-stale-ttl S         unclaimed KV requests are failed/dropped after S (default 120)\n"
            "  --kv-bounce-min-bytes SIZE  coalesce fragmented transfers of at least SIZE through a\n"
            "                           staging buffer (default 2MiB)\n");
}

static int bad(const char *a, const char *v, const char *why) {
    fprintf(stderr, "kvserve serve: invalid value '%s' for %s: %s\n", v, a, why);
    return 2;
}

static int parse_seconds(const char *a, const char *v, double *out) {
    char *end = NULL;
    double x = strtod(v, &end);
    if (!end || end == v || *end || !(x > 0) || x > 86400.0)
        return bad(a, v, "expected seconds in (0, 86400]");
    *out = x;
    return 1;
}

static int kv_option(struct serve_disagg *d, const char *a, const char *v) {
    if (!strcmp(a, "--kv-transfer-host")) {
        if (!*v) return bad(a, v, "must not be empty");
        d->kv_host = v;
        return 1;
    }
    if (!strcmp(a, "--kv-transfer-port")) {
        int64_t x;
        if (kv_parse_i64(v, 0, 65535, &x) != KV_OK) return bad(a, v, "expected a port in [0, 65535]");
        d->kv_port = (int)x;
        return 1;
    }
    if (!strcmp(a, "--kv-transport")) {
        enum kvx_transport_kind k;
        kv_status st = kvx_transport_parse(v, &k);
        if (st == KV_EUNSUPPORTED) return bad(a, v, "this build has no UCX (install libucx-dev and rebuild)");
        if (st != KV_OK) return bad(a, v, "expected ucx, tcp or cuda_ipc");
        d->kv_transport = v;
        return 1;
    }
    if (!strcmp(a, "--kv-transfer-timeout")) return parse_seconds(a, v, &d->kv_timeout_s);
    if (!strcmp(a, "--kv-stale-ttl")) return parse_seconds(a, v, &d->kv_stale_ttl_s);
    if (!strcmp(a, "--kv-bounce-min-bytes")) {
        uint64_t x;
        if (kv_parse_size(v, &x) != KV_OK || x == 0) return bad(a, v, "expected a positive size such as 2MiB");
        d->kv_bounce_min_bytes = x;
        return 1;
    }
    return 0;
}

int serve_disagg_option(struct serve_disagg *d, const char *a, const char *v) {
    if (!strcmp(a, "--role")) {
        if (strcmp(v, "aggregated") && strcmp(v, "context") && strcmp(v, "generation"))
            return bad(a, v, "expected aggregated, context or generation");
        d->role = v;
        return 1;
    }
    int r = kv_option(d, a, v);
    if (r == 1) d->kv_opt = a;
    return r;
}

/* ---------------------------------------------------------------- engine seam -> agent */

static kv_status x_offer(void *ctx, uint64_t id, const int32_t *blocks, int n_blocks, int n_tokens,
                         const int32_t *first, int n_first, int cached_tokens, uint64_t tokens_hash,
                         const struct token_logprob *first_lp, const struct token_logprob *first_top,
                         int n_first_top) {
    struct kvx_aux aux;
    memset(&aux, 0, sizeof aux);
    aux.n_tokens = n_tokens;
    aux.n_first = n_first > KVX_MAX_FIRST_TOKENS ? KVX_MAX_FIRST_TOKENS : n_first;
    for (int i = 0; i < aux.n_first; i++) aux.first[i] = first[i];
    aux.cached_tokens = cached_tokens;
    aux.tokens_hash = tokens_hash;
    if (first_lp) {
        aux.has_lp = true;
        aux.lp.id = first_lp->id;
        aux.lp.logprob = first_lp->logprob;
        aux.n_top = n_first_top < 20 ? n_first_top : 20;
        for (int i = 0; i < aux.n_top; i++) {
            aux.top[i].id = first_top[i].id;
            aux.top[i].logprob = first_top[i].logprob;
        }
    }
    return kvx_send_offer(ctx, id, blocks, n_blocks, &aux);
}

static kv_status x_recv(void *ctx, uint64_t id, const char *peer, bool context_first,
                        const int32_t *dst, int n_dst, int n_tokens) {
    return kvx_recv_start(ctx, id, peer, context_first, dst, n_dst, n_tokens);
}

static void x_cancel(void *ctx, uint64_t id) { kvx_cancel(ctx, id); }

static void x_cancel_remote(void *ctx, uint64_t id, const char *peer) { kvx_cancel_remote(ctx, id, peer); }

/* Agent thread -> engine inbox. */
static void on_result(const struct kvx_result *r, void *user) {
    bool got = r->status == KV_OK && !r->is_send;
    struct token_logprob lp = {r->aux.lp.id, r->aux.lp.logprob}, top[20];
    for (int i = 0; i < r->aux.n_top && i < 20; i++) top[i] = (struct token_logprob){r->aux.top[i].id,
                                                                                    r->aux.top[i].logprob};
    engine_kv_transfer_done_ex(user, r->disagg_id, r->is_send, r->status, r->message, r->aux.first,
                               got ? r->aux.n_first : 0, got ? r->aux.tokens_hash : 0,
                               got && r->aux.has_lp ? &lp : NULL, top, got ? r->aux.n_top : 0);
}

kv_status serve_disagg_start(struct serve_disagg *d, engine_t *e, backend_t *be,
                             const model_t *m, int tokens_per_block, const char *host,
                             struct http_config *hc, char *err, size_t errlen) {
    hc->role = d->role;
    if (!strcmp(d->role, "aggregated")) {
        if (d->kv_opt) /* a flag we accept must take effect: an aggregated worker transfers no KV */
            return kv_errf(KV_EINVAL, err, errlen, "%s applies to disaggregated workers only (--role context or "
                           "--role generation); this worker is aggregated", d->kv_opt);
        return KV_OK;
    }
    /* where the pool is: host memory (block_ptr: tcp / ucx) or GPU memory (device_pool: the
     * backend's own transport, cuda_ipc) */
    void *pool_base = be->ops->block_ptr ? be->ops->block_ptr(be, 0) : NULL;
    void *dev_base = NULL;
    size_t dev_len = 0;
    int dev = -1;
    if (!pool_base && (!be->ops->device_pool || be->ops->device_pool(be, &dev_base, &dev_len, &dev) != KV_OK))
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "--role %s: the %s backend's KV pool can be neither read in "
                       "host memory nor exported from the device", d->role, be->ops->name);
    enum kvx_transport_kind kind = KVX_TRANSPORT_TCP;
    if (d->kv_transport) {
        if (kvx_transport_parse(d->kv_transport, &kind) != KV_OK)
            return kv_errf(KV_EINVAL, err, errlen, "bad --kv-transport %s", d->kv_transport);
    } else if (!pool_base) {
        kind = KVX_TRANSPORT_CUDA_IPC;
    } else if (kvx_transport_ucx_available()) {
        kind = KVX_TRANSPORT_UCX;
    }
    if (!pool_base && kind != KVX_TRANSPORT_CUDA_IPC)
        return kv_errf(KV_EINVAL, err, errlen, "--kv-transport %s moves KV blocks in host memory; the %s backend's "
                       "pool is in GPU memory: use cuda_ipc (the default with --backend %s)", kvx_transport_name(kind),
                       be->ops->name, be->ops->name);
    if (pool_base && kind == KVX_TRANSPORT_CUDA_IPC)
        return kv_errf(KV_EINVAL, err, errlen, "--kv-transport cuda_ipc needs a KV pool in GPU memory (--backend "
                       "cuda); the %s backend's pool is in host memory", be->ops->name);
    /* the page table describes the pool as it is: its element type decides the block bytes
     * and peers with another KV dtype are refused by kvx_page_table_match */
    enum kvx_dtype pdt;
    switch (be->geom.kv_dtype) {
    case KV_DTYPE_F32: pdt = KVX_DTYPE_F32; break;
    case KV_DTYPE_F16: pdt = KVX_DTYPE_F16; break;
    case KV_DTYPE_BF16: pdt = KVX_DTYPE_BF16; break;
    default:
        return kv_errf(KV_EINVAL, err, errlen, "--role %s: KV cache dtype %d has no page-table type", d->role,
                       be->geom.kv_dtype);
    }
    struct kvx_page_table pt;
    kv_status st = kvx_page_table_dense_kv(&pt, 0, m->cfg.n_layers, m->cfg.n_kv_heads,
                                           m->cfg.head_dim, tokens_per_block, pdt, err, errlen);
    if (st != KV_OK) return st;
    if (pt.views[0].block_bytes != kv_block_bytes(&be->geom) ||
        (!pool_base && dev_len != (size_t)be->n_blocks * pt.views[0].block_bytes)) {
        kvx_page_table_free(&pt);
        return kv_errf(KV_EINVAL, err, errlen, "--role %s: page table block of %zu bytes != KV pool block of %zu bytes",
                       d->role, pt.views[0].block_bytes, kv_block_bytes(&be->geom));
    }
    json_t *pj = kvx_page_table_to_json(&pt);
    d->pool_json = pj ? json_dumps(pj, JSON_COMPACT) : NULL;
    json_decref(pj);
    struct kvx_config c;
    memset(&c, 0, sizeof c);
    c.host = d->kv_host ? d->kv_host : host;
    c.port = d->kv_port;
    c.transport = kind;
    c.timeout_s = d->kv_timeout_s;
    c.stale_ttl_s = d->kv_stale_ttl_s;
    c.bounce_min_bytes = (size_t)d->kv_bounce_min_bytes;
    c.pt = &pt;
    c.pool_base = pool_base ? pool_base : dev_base;
    c.n_blocks = be->n_blocks;
    c.cb = on_result;
    c.user = e;
    const char *fault = getenv("KVSERVE_KVX_FAULT");
    if (fault && *fault) {
        st = kvx_fault_parse(fault, &c.faults, err, errlen);
        if (st != KV_OK) {
            kvx_page_table_free(&pt);
            return st;
        }
        KV_WARN("KV transfer fault injection on: KVSERVE_KVX_FAULT=%s", fault);
    }
    if (kind == KVX_TRANSPORT_CUDA_IPC) {
#ifdef KVSERVE_HAVE_CUDA
        st = kvx_transport_cuda_ipc_new(dev, &c.tp, err, errlen);
#else
        st = kv_errf(KV_EUNSUPPORTED, err, errlen, "--kv-transport cuda_ipc: this kvserve was built without CUDA");
#endif
        if (st != KV_OK) {
            kvx_page_table_free(&pt);
            return st;
        }
    }
    kvx_agent_t *a = NULL;
    st = kvx_agent_start(&c, &a, err, errlen);
    kvx_page_table_free(&pt);
    if (st != KV_OK) return st;
    d->agent = a;
    snprintf(d->endpoint, sizeof d->endpoint, "%s", kvx_agent_endpoint(a));
    struct engine_kv_transfer xt = {.ctx = a, .offer = x_offer, .recv = x_recv,
                                    .cancel = x_cancel, .cancel_remote = x_cancel_remote,
                                    .timeout_s = d->kv_timeout_s};
    engine_set_kv_transfer(e, &xt);
    hc->kv_endpoint = d->endpoint;
    hc->kv_transport = kvx_transport_name(kind);
    hc->kv_pool_json = d->pool_json;
    KV_INFO("role %s: KV transfer over %s at %s (timeout %.0f s, stale ttl %.0f s)", d->role,
            kvx_transport_name(kind), d->endpoint, d->kv_timeout_s, d->kv_stale_ttl_s);
    return KV_OK;
}

void serve_disagg_stop(struct serve_disagg *d) {
    if (d->agent) kvx_agent_stop(d->agent);
    d->agent = NULL;
    free(d->pool_json);
    d->pool_json = NULL;
}
