/* backend: shared helpers of the backend interface (see backend.h). */
#include "backend.h"

#include <math.h>

#include <string.h>

#ifdef KVSERVE_HAVE_CUDA
#include "cuda/backend_cuda.h"
#endif

size_t kv_dtype_size(int d) {
    switch (d) {
    case KV_DTYPE_F32: return 4;
    case KV_DTYPE_BF16: return 2;
    case KV_DTYPE_F16: return 2;
    default: return 0;
    }
}

const char *kv_dtype_name(int d) {
    switch (d) {
    case KV_DTYPE_F32: return "f32";
    case KV_DTYPE_BF16: return "bf16";
    case KV_DTYPE_F16: return "f16";
    default: return "?";
    }
}

kv_status kv_dtype_parse(const char *s, int *out) {
    if (!s) return KV_EINVAL;
    if (!strcmp(s, "f32")) *out = KV_DTYPE_F32;
    else if (!strcmp(s, "bf16")) *out = KV_DTYPE_BF16;
    else if (!strcmp(s, "f16")) *out = KV_DTYPE_F16;
    else return KV_EINVAL;
    return KV_OK;
}

size_t kv_block_bytes(const struct kv_geometry *g) {
    return (size_t)g->n_layers * 2 * (size_t)g->n_kv_heads * (size_t)g->tokens_per_block *
           (size_t)g->head_dim * kv_dtype_size(g->kv_dtype);
}

int batch_n_logits(const struct batch *b) {
    int n = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        if (s->logits == BATCH_LOGITS_LAST) n += 1;
        else if (s->logits == BATCH_LOGITS_ALL) n += s->n_tokens;
    }
    return n;
}

void backend_free(backend_t *be) {
    if (be && be->ops && be->ops->free) be->ops->free(be);
}

static kv_status check_blocks(const backend_t *be, const int32_t *blocks, int n) {
    if (n < 0) return KV_EINVAL;
    for (int i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= be->n_blocks) return KV_EINVAL;
    return KV_OK;
}

kv_status backend_copy_to_host(backend_t *be, const int32_t *blocks, void *const *host, int n) {
    if (n == 0) return KV_OK;
    if (check_blocks(be, blocks, n)) return KV_EINVAL;
    if (be->ops->copy_to_host) return be->ops->copy_to_host(be, blocks, host, n);
    if (!be->ops->block_ptr) return KV_EUNSUPPORTED;
    size_t bytes = kv_block_bytes(&be->geom);
    for (int i = 0; i < n; i++) memcpy(host[i], be->ops->block_ptr(be, blocks[i]), bytes);
    return KV_OK;
}

kv_status backend_copy_from_host(backend_t *be, const void *const *host, const int32_t *blocks,
                                 int n) {
    if (n == 0) return KV_OK;
    if (check_blocks(be, blocks, n)) return KV_EINVAL;
    if (be->ops->copy_from_host) return be->ops->copy_from_host(be, host, blocks, n);
    if (!be->ops->block_ptr) return KV_EUNSUPPORTED;
    size_t bytes = kv_block_bytes(&be->geom);
    for (int i = 0; i < n; i++) memcpy(be->ops->block_ptr(be, blocks[i]), host[i], bytes);
    return KV_OK;
}

/* ---- registry ---- */

const char *backend_kind_name(enum backend_kind k) {
    switch (k) {
    case BACKEND_KIND_CPU: return "cpu";
    case BACKEND_KIND_CUDA: return "cuda";
    }
    return NULL;
}

kv_status backend_kind_parse(const char *s, enum backend_kind *out) {
    if (!s || !out) return KV_EINVAL;
    if (!strcmp(s, "cpu")) *out = BACKEND_KIND_CPU;
    else if (!strcmp(s, "cuda")) *out = BACKEND_KIND_CUDA;
    else return KV_EINVAL;
    return KV_OK;
}

bool backend_cuda_compiled(void) {
#ifdef KVSERVE_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

kv_status backend_create(const model_t *m, const struct backend_options *opt, backend_t **out, char *err,
                         size_t errlen) {
    if (!m || !opt || !out) return kv_errf(KV_EINVAL, err, errlen, "backend_create: NULL argument");
    switch (opt->kind) {
    case BACKEND_KIND_CPU: {
        struct backend_cpu_options o = {.n_threads = opt->n_threads, .gemm = opt->gemm};
        if (opt->deterministic) {
            if (opt->gemm != BACKEND_CPU_GEMM_INVARIANT)
                return kv_errf(KV_EINVAL, err, errlen,
                               "backend cpu: deterministic mode needs the invariant gemm (not %s)",
                               backend_cpu_gemm_name(opt->gemm) ? backend_cpu_gemm_name(opt->gemm) : "?");
            KV_INFO("cpu backend: always batch-invariant (--deterministic changes nothing)");
        }
        return backend_cpu_new_ex(m, &o, out, err, errlen);
    }
    case BACKEND_KIND_CUDA: {
#ifdef KVSERVE_HAVE_CUDA
        struct backend_cuda_options o = {
            .device = opt->device, .f32_weights = opt->f32_weights, .deterministic = opt->deterministic};
        return backend_cuda_new(m, &o, out, err, errlen);
#else
        return kv_errf(KV_EUNSUPPORTED, err, errlen,
                       "backend cuda: this kvserve was built without CUDA (configure with -DKVSERVE_CUDA=ON "
                       "on a machine with nvcc)");
#endif
    }
    }
    return kv_errf(KV_EINVAL, err, errlen, "backend_create: unknown backend kind %d", (int)opt->kind);
}

void backend_rope_inv_freq(const struct model_config *cfg, float *inv_freq) {
    int hd = cfg->head_dim;
    const struct rope_scaling *rs = &cfg->rope_scaling;
    for (int i = 0; i < hd / 2; i++) {
        float f = 1.0f / powf(cfg->rope_theta, (float)(2 * i) / (float)hd);
        if (rs->type == 2 && rs->factor > 0) {
            f /= rs->factor;
        } else if (rs->type == 1 && rs->factor > 0) {
            double lo_wl = rs->original_max_pos / rs->low_freq_factor;
            double hi_wl = rs->original_max_pos / rs->high_freq_factor;
            double wl = 2.0 * M_PI / f;
            if (wl > lo_wl) {
                f = f / rs->factor;
            } else if (wl >= hi_wl) {
                double smooth = (rs->original_max_pos / wl - rs->low_freq_factor) /
                                (rs->high_freq_factor - rs->low_freq_factor);
                f = (float)((1.0 - smooth) * f / rs->factor + smooth * f);
            }
        }
        inv_freq[i] = f;
    }
}

kv_status backend_check_batch(const backend_t *be, const struct batch *b, bool pool_ready, int tpb, int n_vocab,
                              long max_tokens, char *err, size_t errlen) {
    if (!b || b->n_seqs < 0 || (b->n_seqs > 0 && !b->seqs))
        return kv_errf(KV_EINVAL, err, errlen, "forward: bad batch");
    if (b->n_seqs > 0 && (!pool_ready || be->n_blocks < 1))
        return kv_errf(KV_EINVAL, err, errlen, "forward: KV pool not allocated");
    long total = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        if (s->n_tokens < 1 || !s->tokens || s->n_past < 0 || s->n_tokens > INT32_MAX / 2 ||
            s->n_past > INT32_MAX / 2)
            return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: n_tokens %d / n_past %d invalid", i,
                           s->n_tokens, s->n_past);
        if (s->logits != BATCH_LOGITS_NONE && s->logits != BATCH_LOGITS_LAST && s->logits != BATCH_LOGITS_ALL)
            return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: bad logits mode %d", i, (int)s->logits);
        int need = (s->n_past + s->n_tokens + tpb - 1) / tpb;
        if (s->n_blocks < need || !s->block_table)
            return kv_errf(KV_EINVAL, err, errlen,
                           "forward: seq %d: block table has %d blocks, %d needed for %d positions", i,
                           s->n_blocks, need, s->n_past + s->n_tokens);
        for (int k = 0; k < need; k++)
            if (s->block_table[k] < 0 || s->block_table[k] >= be->n_blocks)
                return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: block id %d (entry %d) outside pool of %d",
                               i, (int)s->block_table[k], k, be->n_blocks);
        for (int k = 0; k < s->n_tokens; k++)
            if (s->tokens[k] < 0 || s->tokens[k] >= n_vocab)
                return kv_errf(KV_EINVAL, err, errlen, "forward: seq %d: token id %d outside vocabulary of %d",
                               i, (int)s->tokens[k], n_vocab);
        total += s->n_tokens;
        if (total > max_tokens) return kv_errf(KV_EINVAL, err, errlen, "forward: batch too large");
    }
    return KV_OK;
}
