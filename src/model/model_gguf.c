/* model: loading a model from a GGUF file (llama, qwen2, qwen3 architectures). */
#include "model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static bool str_eq(const char *s, size_t n, const char *lit) { return strlen(lit) == n && memcmp(s, lit, n) == 0; }

static kv_status get_req_int(const gguf_t *g, const char *fname, const char *arch, const char *suffix, int *out,
                             char *err, size_t errlen) {
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    int64_t v;
    if (!gguf_get_int(g, k, &v)) {
        if (gguf_find_key(g, k) >= 0)
            return kv_errf(KV_EFORMAT, err, errlen, "%s: metadata %s is not an integer", fname, k);
        return kv_errf(KV_EFORMAT, err, errlen, "%s: missing metadata key %s", fname, k);
    }
    if (v <= 0 || v > INT32_MAX) return kv_errf(KV_EFORMAT, err, errlen, "%s: invalid %s = %lld", fname, k, (long long)v);
    *out = (int)v;
    return KV_OK;
}

static bool get_opt_float(const gguf_t *g, const char *arch, const char *suffix, float *out) {
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    double v;
    if (!gguf_get_float(g, k, &v)) return false;
    *out = (float)v;
    return true;
}
static bool get_opt_int(const gguf_t *g, const char *arch, const char *suffix, int64_t *out) {
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    return gguf_get_int(g, k, out);
}

/* Llama-3 GGUFs carry the llama3 RoPE scaling only as rope_freqs.weight (head_dim/2 divisors
 * of the base frequencies, written by llama.cpp's converter). Recover the parameters: factor is
 * the largest divisor; low/high_freq_factor and original_max_pos are the Llama 3.x values
 * (1, 4, 8192), accepted only if they reproduce every divisor to 1e-4. */
static kv_status infer_llama3_scaling(const struct gguf_tensor *rf, struct model_config *c, const char *fname,
                                      char *err, size_t errlen) {
    int half = c->head_dim / 2;
    if (rf->type != GGML_F32 || rf->n_dims != 1 || rf->ne[0] != (uint64_t)half || half <= 0 || half > 2048)
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: rope_freqs.weight has an unsupported type or shape", fname);
    float fac[2048];
    memcpy(fac, rf->data, (size_t)half * 4);
    float factor = 1.0f;
    for (int i = 0; i < half; i++) {
        if (!isfinite(fac[i]) || fac[i] <= 0)
            return kv_errf(KV_EFORMAT, err, errlen, "%s: rope_freqs.weight has invalid values", fname);
        if (fac[i] > factor) factor = fac[i];
    }
    const double low = 1.0, high = 4.0, orig = 8192.0;
    double low_wl = orig / low, high_wl = orig / high;
    for (int i = 0; i < half; i++) {
        double freq = pow((double)c->rope_theta, -2.0 * i / c->head_dim);
        double wl = 2.0 * M_PI / freq, want;
        if (wl < high_wl) want = 1.0;
        else if (wl > low_wl) want = factor;
        else {
            double sm = (orig / wl - low) / (high - low);
            want = 1.0 / ((1.0 - sm) / factor + sm);
        }
        if (fabs(want - fac[i]) > 1e-4 * want)
            return kv_errf(KV_EUNSUPPORTED, err, errlen,
                           "%s: rope_freqs.weight does not match llama3 RoPE scaling (index %d: %g, expected %g)",
                           fname, i, (double)fac[i], want);
    }
    if (factor > 1.0f) {
        c->rope_scaling.type = 1;
        c->rope_scaling.factor = factor;
        c->rope_scaling.low_freq_factor = (float)low;
        c->rope_scaling.high_freq_factor = (float)high;
        c->rope_scaling.original_max_pos = (int)orig;
    }
    return KV_OK;
}

kv_status model_gguf_config(const gguf_t *g, struct model_config *cfg, char *err, size_t errlen) {
    char fname[256];
    model_base_name(gguf_path(g), false, fname, sizeof fname);
    struct model_config c;
    memset(&c, 0, sizeof c);
    const char *as;
    size_t al;
    if (!gguf_get_str(g, "general.architecture", &as, &al))
        return kv_errf(KV_EFORMAT, err, errlen, "%s: missing metadata key general.architecture", fname);
    char arch[32];
    if (str_eq(as, al, "llama")) c.arch = MODEL_ARCH_LLAMA;
    else if (str_eq(as, al, "qwen2")) c.arch = MODEL_ARCH_QWEN2;
    else if (str_eq(as, al, "qwen3")) c.arch = MODEL_ARCH_QWEN3;
    else
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: unsupported architecture '%.*s' (supported: llama, qwen2, qwen3)",
                       fname, (int)(al > 64 ? 64 : al), as);
    snprintf(arch, sizeof arch, "%s", model_arch_name(c.arch));
    kv_status rc;
    if ((rc = get_req_int(g, fname, arch, "embedding_length", &c.dim, err, errlen))) return rc;
    if ((rc = get_req_int(g, fname, arch, "block_count", &c.n_layers, err, errlen))) return rc;
    if ((rc = get_req_int(g, fname, arch, "feed_forward_length", &c.ffn_dim, err, errlen))) return rc;
    if ((rc = get_req_int(g, fname, arch, "attention.head_count", &c.n_heads, err, errlen))) return rc;
    if ((rc = get_req_int(g, fname, arch, "context_length", &c.max_ctx, err, errlen))) return rc;
    int64_t v;
    c.n_kv_heads = c.n_heads;
    if (get_opt_int(g, arch, "attention.head_count_kv", &v)) {
        if (v <= 0 || v > INT32_MAX) return kv_errf(KV_EFORMAT, err, errlen, "%s: invalid %s.attention.head_count_kv", fname, arch);
        c.n_kv_heads = (int)v;
    }
    c.head_dim = c.dim / c.n_heads;
    if (get_opt_int(g, arch, "attention.key_length", &v)) {
        if (v <= 0 || v > 4096) return kv_errf(KV_EFORMAT, err, errlen, "%s: invalid %s.attention.key_length", fname, arch);
        c.head_dim = (int)v;
    }
    if (get_opt_int(g, arch, "attention.value_length", &v) && v != c.head_dim)
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: value_length %lld != key_length %d is not supported", fname,
                       (long long)v, c.head_dim);
    if (get_opt_int(g, arch, "rope.dimension_count", &v) && v != c.head_dim)
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: partial RoPE (dimension_count %lld, head_dim %d) is not supported",
                       fname, (long long)v, c.head_dim);
    c.rms_eps = 1e-5f;
    if (!get_opt_float(g, arch, "attention.layer_norm_rms_epsilon", &c.rms_eps))
        return kv_errf(KV_EFORMAT, err, errlen, "%s: missing metadata key %s.attention.layer_norm_rms_epsilon", fname, arch);
    c.rope_theta = 10000.0f;
    get_opt_float(g, arch, "rope.freq_base", &c.rope_theta);
    char k[128];
    snprintf(k, sizeof k, "%s.rope.scaling.type", arch);
    const char *st;
    size_t sl;
    if (gguf_get_str(g, k, &st, &sl) && !str_eq(st, sl, "none")) {
        if (str_eq(st, sl, "linear")) c.rope_scaling.type = 2;
        else if (str_eq(st, sl, "llama3")) c.rope_scaling.type = 1;
        else
            return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: unsupported rope scaling type '%.*s'", fname,
                           (int)(sl > 32 ? 32 : sl), st);
        c.rope_scaling.factor = 1.0f;
        get_opt_float(g, arch, "rope.scaling.factor", &c.rope_scaling.factor);
        if (c.rope_scaling.type == 1) {
            c.rope_scaling.low_freq_factor = 1.0f;
            c.rope_scaling.high_freq_factor = 4.0f;
            c.rope_scaling.original_max_pos = 8192;
            get_opt_float(g, arch, "rope.scaling.low_freq_factor", &c.rope_scaling.low_freq_factor);
            get_opt_float(g, arch, "rope.scaling.high_freq_factor", &c.rope_scaling.high_freq_factor);
            if (get_opt_int(g, arch, "rope.scaling.original_context_length", &v) && v > 0 && v < INT32_MAX)
                c.rope_scaling.original_max_pos = (int)v;
        }
        if (!(c.rope_scaling.factor > 0) || !isfinite(c.rope_scaling.factor))
            return kv_errf(KV_EFORMAT, err, errlen, "%s: invalid rope scaling factor", fname);
    }
    const struct gguf_tensor *rf = gguf_find_tensor(g, "rope_freqs.weight");
    if (rf && c.rope_scaling.type == 0 && (rc = infer_llama3_scaling(rf, &c, fname, err, errlen))) return rc;
    c.rope_neox = c.arch != MODEL_ARCH_LLAMA;
    c.attn_bias = gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
    c.qk_norm = c.arch == MODEL_ARCH_QWEN3 || gguf_find_tensor(g, "blk.0.attn_q_norm.weight") != NULL;
    const struct gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight");
    if (!te) return kv_errf(KV_EFORMAT, err, errlen, "%s: missing tensor token_embd.weight", fname);
    if (te->n_dims != 2 || te->ne[1] > (1u << 24))
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor token_embd.weight has an invalid shape", fname);
    c.n_vocab = (int)te->ne[1];
    if (get_opt_int(g, arch, "vocab_size", &v) && v != c.n_vocab)
        return kv_errf(KV_EFORMAT, err, errlen, "%s: %s.vocab_size %lld does not match token_embd.weight rows %d", fname,
                       arch, (long long)v, c.n_vocab);
    /* absent output.weight, or a byte-identical copy (llama2.c converter), means tied */
    const struct gguf_tensor *to = gguf_find_tensor(g, "output.weight");
    c.tied_embeddings = !to || (to->type == te->type && to->nbytes == te->nbytes && to->n_dims == te->n_dims &&
                                to->ne[0] == te->ne[0] && memcmp(to->data, te->data, te->nbytes) == 0);
    c.bos_id = c.eos_id = -1;
    if (gguf_get_int(g, "tokenizer.ggml.bos_token_id", &v) && v >= 0 && v < c.n_vocab) c.bos_id = (int)v;
    if (gguf_get_int(g, "tokenizer.ggml.eos_token_id", &v) && v >= 0 && v < c.n_vocab) c.eos_id = (int)v;
    if (c.eos_id >= 0) c.eos_ids[c.n_eos_ids++] = c.eos_id;
    enum gguf_type et;
    uint64_t ne;
    const void *ed = gguf_get_arr_data(g, "kvserve.eos_token_ids");
    if (ed && gguf_get_arr_info(g, "kvserve.eos_token_ids", &et, &ne) && et == GGUF_TYPE_INT32) {
        for (uint64_t i = 0; i < ne && c.n_eos_ids < 8; i++) {
            int32_t id;
            memcpy(&id, (const char *)ed + 4 * i, 4);
            bool dup = false;
            for (int j = 0; j < c.n_eos_ids; j++) dup |= c.eos_ids[j] == id;
            if (!dup && id >= 0 && id < c.n_vocab) c.eos_ids[c.n_eos_ids++] = id;
        }
    }
    /* general.name, unless it merely repeats the architecture (llama.cpp's llama2.c converter
     * writes "llama"): then the file name */
    const char *gn;
    size_t gnl;
    if (!gguf_get_str(g, "general.name", &gn, &gnl) || (gnl == al && !strncasecmp(gn, as, al)) ||
        !model_set_name(c.name, sizeof c.name, gn, gnl))
        model_base_name(gguf_path(g), true, c.name, sizeof c.name);
    if ((rc = model_config_check(&c, fname, err, errlen))) return rc;
    *cfg = c;
    return KV_OK;
}

static void fmt_shape(char *buf, size_t n, int nd, const uint64_t *ne) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "[");
    for (int d = 0; d < nd && o < n; d++)
        o += (size_t)snprintf(buf + o, n - o, "%s%llu", d ? ", " : "", (unsigned long long)ne[d]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

/* Loads tensor `name` with expected GGUF shape [ne0] (ne1 == 0) or [ne0, ne1] into dst. */
static kv_status load_t(const gguf_t *g, const char *fname, const char *name, float *dst, int ne0, int ne1, char *err,
                        size_t errlen) {
    const struct gguf_tensor *t = gguf_find_tensor(g, name);
    if (!t) return kv_errf(KV_EFORMAT, err, errlen, "%s: missing tensor %s", fname, name);
    uint64_t exp[2] = {(uint64_t)ne0, (uint64_t)ne1};
    int nd = ne1 ? 2 : 1;
    bool ok = t->n_dims == nd && t->ne[0] == exp[0] && (nd == 1 || t->ne[1] == exp[1]);
    if (!ok) {
        char got[96], want[96];
        fmt_shape(got, sizeof got, t->n_dims, t->ne);
        fmt_shape(want, sizeof want, nd, exp);
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has shape %s, expected %s", fname, name, got, want);
    }
    char e2[200];
    kv_status rc = gguf_tensor_to_f32(t, dst, (uint64_t)ne0 * (ne1 ? (uint64_t)ne1 : 1), e2, sizeof e2);
    if (rc) return kv_errf(rc, err, errlen, "%s: %s", fname, e2);
    return KV_OK;
}

/* Points *w at matrix `name` of the map (no copy) after checking its type and GGUF shape
 * [cols, rows]. */
static kv_status map_t(const gguf_t *g, const char *fname, const char *name, struct kv_wmat *w, int cols, int rows,
                       char *err, size_t errlen) {
    const struct gguf_tensor *t = gguf_find_tensor(g, name);
    if (!t) return kv_errf(KV_EFORMAT, err, errlen, "%s: missing tensor %s", fname, name);
    uint64_t exp[2] = {(uint64_t)cols, (uint64_t)rows};
    if (t->n_dims != 2 || t->ne[0] != exp[0] || t->ne[1] != exp[1]) {
        char got[96], want[96];
        fmt_shape(got, sizeof got, t->n_dims, t->ne);
        fmt_shape(want, sizeof want, 2, exp);
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has shape %s, expected %s", fname, name, got, want);
    }
    if (!kv_qtype_supported((int)t->type))
        return kv_errf(KV_EUNSUPPORTED, err, errlen,
                       "%s: tensor %s has unsupported type %s (%u); supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, "
                       "Q5_K, Q6_K",
                       fname, name, kv_qtype_name((int)t->type), t->type);
    size_t rb = kv_qtype_row_bytes((int)t->type, cols);
    if (!rb || (uint64_t)rb * (uint64_t)rows != t->nbytes)
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s: %llu bytes do not hold %d rows of %d %s elements",
                       fname, name, (unsigned long long)t->nbytes, rows, cols, kv_qtype_name((int)t->type));
    w->data = t->data;
    w->type = (int)t->type;
    w->rows = rows;
    w->cols = cols;
    w->row_bytes = rb;
    return KV_OK;
}

kv_status model_load_gguf(const char *path, model_t **out, char *err, size_t errlen) {
    gguf_t *g;
    kv_status rc = gguf_open(path, &g, err, errlen);
    if (rc) return rc;
    char fname[256];
    model_base_name(path, false, fname, sizeof fname);
    struct model_config c;
    model_t *m = NULL;
    if ((rc = model_gguf_config(g, &c, err, errlen))) goto done;
    if ((rc = model_alloc_ex(&c, false, &m))) {
        kv_errf(rc, err, errlen, "%s: cannot allocate the model: %s", fname, kv_status_str(rc));
        goto done;
    }
    int d = c.dim, q = c.n_heads * c.head_dim, kv = c.n_kv_heads * c.head_dim, f = c.ffn_dim;
    if ((rc = map_t(g, fname, "token_embd.weight", &m->w.tok_embd, d, c.n_vocab, err, errlen))) goto done;
    if ((rc = load_t(g, fname, "output_norm.weight", m->w.out_norm, d, 0, err, errlen))) goto done;
    if (c.tied_embeddings) m->w.output = m->w.tok_embd;
    else if ((rc = map_t(g, fname, "output.weight", &m->w.output, d, c.n_vocab, err, errlen))) goto done;
    char n[96];
    for (int l = 0; l < c.n_layers; l++) {
        struct layer_weights *L = &m->w.layers[l];
#define LD(s, dst, a, b) \
    do { \
        snprintf(n, sizeof n, "blk.%d." s, l); \
        if ((rc = load_t(g, fname, n, dst, a, b, err, errlen))) goto done; \
    } while (0)
#define MP(s, dst, a, b) \
    do { \
        snprintf(n, sizeof n, "blk.%d." s, l); \
        if ((rc = map_t(g, fname, n, &(dst), a, b, err, errlen))) goto done; \
    } while (0)
        LD("attn_norm.weight", L->attn_norm, d, 0);
        MP("attn_q.weight", L->wq, d, q);
        MP("attn_k.weight", L->wk, d, kv);
        MP("attn_v.weight", L->wv, d, kv);
        if (c.attn_bias) {
            LD("attn_q.bias", L->bq, q, 0);
            LD("attn_k.bias", L->bk, kv, 0);
            LD("attn_v.bias", L->bv, kv, 0);
        }
        if (c.qk_norm) {
            LD("attn_q_norm.weight", L->q_norm, c.head_dim, 0);
            LD("attn_k_norm.weight", L->k_norm, c.head_dim, 0);
        }
        MP("attn_output.weight", L->wo, q, d);
        LD("ffn_norm.weight", L->ffn_norm, d, 0);
        MP("ffn_gate.weight", L->w_gate, d, f);
        MP("ffn_up.weight", L->w_up, d, f);
        MP("ffn_down.weight", L->w_down, f, d);
#undef LD
#undef MP
    }
    m->format = MODEL_FORMAT_GGUF;
    snprintf(m->path, sizeof m->path, "%s", path);
    const char *gn;
    size_t gl;
    if (gguf_get_str(g, "general.name", &gn, &gl) && memmem(gn, gl, "kvserve-demo", 12)) m->is_demo = true;
done:
    if (rc) {
        gguf_close(g);
        model_free(m);
        return rc;
    }
    ((struct model_priv *)m->priv)->gguf = g; /* the matrices point into its map */
    *out = m;
    return KV_OK;
}
