/* model: allocation, random init, GGUF save, load dispatch and the demo model. */
#include "model_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

const char *model_arch_name(model_arch a) {
    switch (a) {
    case MODEL_ARCH_LLAMA: return "llama";
    case MODEL_ARCH_QWEN2: return "qwen2";
    case MODEL_ARCH_QWEN3: return "qwen3";
    }
    return "unknown";
}

void model_base_name(const char *path, bool strip_ext, char *out, size_t outlen) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* "dir/" -> "dir" */
    size_t b = n;
    while (b > 0 && path[b - 1] != '/') b--;
    size_t e = n;
    if (strip_ext) {
        for (size_t i = n; i > b + 1; i--)
            if (path[i - 1] == '.') {
                e = i - 1;
                break;
            }
    }
    size_t len = e - b;
    if (len >= outlen) len = outlen - 1;
    memcpy(out, path + b, len);
    out[len] = 0;
}

bool model_set_name(char *out, size_t outlen, const char *s, size_t n) {
    while (n && (*s == ' ' || *s == '\t')) s++, n--;
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t')) n--;
    if (n == 0 || n >= outlen) return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f || s[i] == '"' || s[i] == '\\') return false;
    memcpy(out, s, n);
    out[n] = 0;
    return true;
}

static bool generic_dir_name(const char *b) {
    static const char *const generic[] = {"hf", "model", "models", "checkpoint", "weights",
                                          "hf_model", "snapshot", "main", "final"};
    for (size_t i = 0; i < sizeof generic / sizeof *generic; i++)
        if (!strcasecmp(b, generic[i])) return true;
    size_t n = strlen(b), hex = strspn(b, "0123456789abcdef");
    return n >= 7 && n <= 64 && hex == n;
}

void model_dir_name(const char *dir, char *out, size_t outlen) {
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') path[--n] = 0;
    /* Hugging Face cache: .../models--org--name/snapshots/<revision> */
    const char *m = strstr(path, "/models--");
    const char *snap = m ? strstr(m, "/snapshots/") : NULL;
    if (snap) {
        char repo[256];
        size_t rl = (size_t)(snap - (m + 9));
        if (rl < sizeof repo) {
            memcpy(repo, m + 9, rl);
            repo[rl] = 0;
            char *sep = strstr(repo, "--");
            if (sep) {
                *sep = '/';
                memmove(sep + 1, sep + 2, strlen(sep + 2) + 1);
            }
            if (model_set_name(out, outlen, repo, strlen(repo))) return;
        }
    }
    model_base_name(path, false, out, outlen);
    char *slash = strrchr(path, '/');
    if (generic_dir_name(out) && slash && slash != path) {
        *slash = 0;
        char parent[256];
        model_base_name(path, false, parent, sizeof parent);
        if (*parent && strcmp(parent, ".") && strcmp(parent, "..")) snprintf(out, outlen, "%s", parent);
    }
}

#define MAX_DIM (1 << 20)
kv_status model_config_check(const struct model_config *c, const char *what, char *err, size_t errlen) {
#define CHK(cond, ...) if (!(cond)) return kv_errf(KV_EFORMAT, err, errlen, __VA_ARGS__)
    CHK(c->arch >= MODEL_ARCH_LLAMA && c->arch <= MODEL_ARCH_QWEN3, "%s: invalid architecture %d", what, (int)c->arch);
    CHK(c->n_vocab > 0 && c->n_vocab <= (1 << 24), "%s: invalid vocabulary size %d", what, c->n_vocab);
    CHK(c->dim > 0 && c->dim <= MAX_DIM, "%s: invalid hidden size %d", what, c->dim);
    CHK(c->n_layers > 0 && c->n_layers <= 1024, "%s: invalid layer count %d", what, c->n_layers);
    CHK(c->n_heads > 0 && c->n_heads <= 4096, "%s: invalid head count %d", what, c->n_heads);
    CHK(c->n_kv_heads > 0 && c->n_kv_heads <= c->n_heads && c->n_heads % c->n_kv_heads == 0,
        "%s: invalid kv head count %d (heads %d)", what, c->n_kv_heads, c->n_heads);
    CHK(c->head_dim > 0 && c->head_dim % 2 == 0 && c->head_dim <= 4096, "%s: invalid head_dim %d", what, c->head_dim);
    CHK((int64_t)c->n_heads * c->head_dim <= MAX_DIM, "%s: n_heads*head_dim too large", what);
    CHK(c->ffn_dim > 0 && c->ffn_dim <= 4 * MAX_DIM, "%s: invalid feed-forward size %d", what, c->ffn_dim);
    CHK(c->max_ctx > 0, "%s: invalid context length %d", what, c->max_ctx);
    CHK(isfinite(c->rms_eps) && c->rms_eps > 0 && c->rms_eps < 1, "%s: invalid rms_norm_eps %g", what, (double)c->rms_eps);
    CHK(isfinite(c->rope_theta) && c->rope_theta > 0, "%s: invalid rope_theta %g", what, (double)c->rope_theta);
    CHK(c->n_eos_ids >= 0 && c->n_eos_ids <= 8, "%s: invalid eos id count", what);
    /* total parameter count must stay well inside size_t and float indexing */
    double per_layer = 2.0 * c->dim + (double)c->dim * c->head_dim * (2.0 * c->n_heads + 2.0 * c->n_kv_heads) +
                       3.0 * c->dim * c->ffn_dim;
    CHK(per_layer * c->n_layers + 2.0 * c->n_vocab * c->dim < 1e12, "%s: model too large", what);
#undef CHK
    return KV_OK;
}

static size_t layer_floats(const struct model_config *c, bool matrices) {
    size_t d = (size_t)c->dim, q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
    size_t n = 2 * d;
    if (matrices) n += q * d + 2 * kv * d + d * q + 3 * (size_t)c->ffn_dim * d;
    if (c->attn_bias) n += q + 2 * kv;
    if (c->qk_norm) n += 2 * (size_t)c->head_dim;
    return n;
}

static struct kv_wmat take_mat(float **p, int rows, int cols, bool matrices) {
    struct kv_wmat w = {0};
    if (!matrices) return w;
    w = kv_wmat_from_f32(*p, rows, cols);
    *p += (size_t)rows * cols;
    return w;
}

kv_status model_alloc_ex(const struct model_config *cfg, bool matrices, model_t **out) {
    if (!cfg || !out) return KV_EINVAL;
    if (model_config_check(cfg, "model_alloc", NULL, 0)) return KV_EINVAL;
    const struct model_config *c = cfg;
    size_t vd = (size_t)c->n_vocab * c->dim;
    size_t total = c->dim + (matrices ? vd + (c->tied_embeddings ? 0 : vd) : 0) +
                   (size_t)c->n_layers * layer_floats(c, matrices);
    model_t *m = kv_calloc(1, sizeof *m);
    struct model_priv *pv = kv_calloc(1, sizeof *pv);
    float *a = kv_calloc(total, sizeof(float));
    if (m) m->w.layers = kv_calloc((size_t)c->n_layers, sizeof *m->w.layers);
    if (!a || !pv || !m || !m->w.layers) {
        free(a);
        free(pv);
        if (m) free(m->w.layers);
        free(m);
        return KV_ENOMEM;
    }
    m->cfg = *cfg;
    pv->arena = a;
    m->priv = pv;
    float *p = a;
#define TAKE(n) (p += (n), p - (n))
    int V = c->n_vocab, D = c->dim, Q = c->n_heads * c->head_dim, KV = c->n_kv_heads * c->head_dim, F = c->ffn_dim;
    m->w.tok_embd = take_mat(&p, V, D, matrices);
    m->w.out_norm = TAKE((size_t)D);
    m->w.output = c->tied_embeddings ? m->w.tok_embd : take_mat(&p, V, D, matrices);
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_weights *L = &m->w.layers[l];
        L->attn_norm = TAKE((size_t)D);
        L->wq = take_mat(&p, Q, D, matrices);
        L->wk = take_mat(&p, KV, D, matrices);
        L->wv = take_mat(&p, KV, D, matrices);
        if (c->attn_bias) {
            L->bq = TAKE((size_t)Q);
            L->bk = TAKE((size_t)KV);
            L->bv = TAKE((size_t)KV);
        }
        if (c->qk_norm) {
            L->q_norm = TAKE((size_t)c->head_dim);
            L->k_norm = TAKE((size_t)c->head_dim);
        }
        L->wo = take_mat(&p, D, Q, matrices);
        L->ffn_norm = TAKE((size_t)D);
        L->w_gate = take_mat(&p, F, D, matrices);
        L->w_up = take_mat(&p, F, D, matrices);
        L->w_down = take_mat(&p, D, F, matrices);
    }
#undef TAKE
    if ((size_t)(p - a) != total) abort(); /* layout bug */
    *out = m;
    return KV_OK;
}

kv_status model_alloc(const struct model_config *cfg, model_t **out) { return model_alloc_ex(cfg, true, out); }

void model_free(model_t *m) {
    if (!m) return;
    struct model_priv *pv = m->priv;
    if (pv) {
        free(pv->arena);
        for (int i = 0; i < pv->n_owned; i++) free(pv->owned[i]);
        free(pv->owned);
        if (pv->gguf) gguf_close(pv->gguf);
        free(pv);
    }
    free(m->w.layers);
    free(m);
}

bool model_pages_releasable(const model_t *m, const void *p, size_t n) {
    const struct model_priv *pv = m ? m->priv : NULL;
    return pv && pv->gguf && gguf_in_map(pv->gguf, p, n);
}

void model_release_pages(const model_t *m, const void *p, size_t n) {
    if (!model_pages_releasable(m, p, n)) return;
    long ps = sysconf(_SC_PAGESIZE);
    if (ps <= 0) return;
    uintptr_t a = ((uintptr_t)p + (uintptr_t)ps - 1) & ~((uintptr_t)ps - 1), b = ((uintptr_t)p + n) & ~((uintptr_t)ps - 1);
    if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED); /* a private read-only file map: pages refault from the file */
}

void model_matrix_types(const model_t *m, char *out, size_t outlen) {
    int count[64] = {0};
    const struct kv_wmat *all[2] = {&m->w.tok_embd, &m->w.output};
    for (int i = 0; i < (m->cfg.tied_embeddings ? 1 : 2); i++)
        if (all[i]->type >= 0 && all[i]->type < 64) count[all[i]->type]++;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const struct layer_weights *L = &m->w.layers[l];
        const struct kv_wmat *w[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int i = 0; i < 7; i++)
            if (w[i]->type >= 0 && w[i]->type < 64) count[w[i]->type]++;
    }
    size_t o = 0;
    if (outlen) out[0] = 0;
    for (int t = 0; t < 64; t++)
        if (count[t] && o < outlen) {
            int n = snprintf(out + o, outlen - o, "%s%s x%d", o ? ", " : "", kv_qtype_name(t), count[t]);
            if (n < 0) break;
            o += (size_t)n;
        }
}

kv_status model_own(model_t *m, void *p) {
    struct model_priv *pv = m->priv;
    if (pv->n_owned == pv->cap_owned) {
        int cap = pv->cap_owned ? 2 * pv->cap_owned : 16;
        void **np = kv_realloc(pv->owned, (size_t)cap * sizeof *np);
        if (!np) {
            free(p);
            return KV_ENOMEM;
        }
        pv->owned = np;
        pv->cap_owned = cap;
    }
    pv->owned[pv->n_owned++] = p;
    return KV_OK;
}

static size_t wmat_bytes(const struct kv_wmat *w) { return (size_t)w->rows * w->row_bytes; }

size_t model_weight_bytes(const model_t *m) {
    if (!m) return 0;
    const struct model_config *c = &m->cfg;
    size_t d = (size_t)c->dim, q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
    size_t vec = d + (size_t)c->n_layers * (2 * d + (c->attn_bias ? q + 2 * kv : 0) +
                                            (c->qk_norm ? 2 * (size_t)c->head_dim : 0));
    size_t n = vec * sizeof(float) + wmat_bytes(&m->w.tok_embd);
    if (m->w.output.data != m->w.tok_embd.data) n += wmat_bytes(&m->w.output);
    for (int l = 0; l < c->n_layers; l++) {
        const struct layer_weights *L = &m->w.layers[l];
        n += wmat_bytes(&L->wq) + wmat_bytes(&L->wk) + wmat_bytes(&L->wv) + wmat_bytes(&L->wo) +
             wmat_bytes(&L->w_gate) + wmat_bytes(&L->w_up) + wmat_bytes(&L->w_down);
    }
    return n;
}

static float rand_normal(kv_rng *r) {
    /* Box-Muller; u1 in (0, 1] */
    double u1 = 1.0 - kv_rng_f64(r), u2 = kv_rng_f64(r);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
static void fill_normal(kv_rng *r, float *p, size_t n, float mean, float std) {
    if (!p) return;
    for (size_t i = 0; i < n; i++) p[i] = mean + std * rand_normal(r);
}

void model_randomize(model_t *m, uint64_t seed, float std) {
    const struct model_config *c = &m->cfg;
    kv_rng r;
    kv_rng_seed(&r, seed);
    size_t vd = (size_t)c->n_vocab * c->dim, d = (size_t)c->dim;
    size_t q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim, f = (size_t)c->ffn_dim;
    fill_normal(&r, kv_wmat_f32(&m->w.tok_embd), vd, 0, std);
    fill_normal(&r, m->w.out_norm, d, 1.0f, 0.1f);
    if (!c->tied_embeddings) fill_normal(&r, kv_wmat_f32(&m->w.output), vd, 0, std);
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_weights *L = &m->w.layers[l];
        fill_normal(&r, L->attn_norm, d, 1.0f, 0.1f);
        fill_normal(&r, kv_wmat_f32(&L->wq), q * d, 0, std);
        fill_normal(&r, kv_wmat_f32(&L->wk), kv * d, 0, std);
        fill_normal(&r, kv_wmat_f32(&L->wv), kv * d, 0, std);
        fill_normal(&r, L->bq, c->attn_bias ? q : 0, 0, std);
        fill_normal(&r, L->bk, c->attn_bias ? kv : 0, 0, std);
        fill_normal(&r, L->bv, c->attn_bias ? kv : 0, 0, std);
        fill_normal(&r, L->q_norm, c->qk_norm ? (size_t)c->head_dim : 0, 1.0f, 0.1f);
        fill_normal(&r, L->k_norm, c->qk_norm ? (size_t)c->head_dim : 0, 1.0f, 0.1f);
        fill_normal(&r, kv_wmat_f32(&L->wo), d * q, 0, std);
        fill_normal(&r, L->ffn_norm, d, 1.0f, 0.1f);
        fill_normal(&r, kv_wmat_f32(&L->w_gate), f * d, 0, std);
        fill_normal(&r, kv_wmat_f32(&L->w_up), f * d, 0, std);
        fill_normal(&r, kv_wmat_f32(&L->w_down), d * f, 0, std);
    }
}

/* ---- GGUF save ---- */

/* Rotate-half (HF) row order -> adjacent-pair (GGUF llama) order, per head. */
static float *permute_to_pairs(const float *w, int n_heads, int head_dim, int cols) {
    size_t rows = (size_t)n_heads * head_dim;
    float *o = kv_malloc(rows * cols * sizeof(float));
    if (!o) return NULL;
    int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++)
        for (int i = 0; i < half; i++)
            for (int p = 0; p < 2; p++)
                memcpy(o + ((size_t)h * head_dim + 2 * i + p) * cols, w + ((size_t)h * head_dim + p * half + i) * cols,
                       (size_t)cols * sizeof(float));
    return o;
}

static kv_status w_mat(gguf_writer_t *w, const char *name, const float *data, int rows, int cols) {
    uint64_t ne[2] = {(uint64_t)cols, (uint64_t)rows};
    return gguf_w_tensor_f32(w, name, 2, ne, data);
}

/* The matrix as floats: its own data when F32 (*owned = NULL), else a dequantized copy that
 * the caller frees (*owned). NULL when out of memory. */
static const float *wmat_as_f32(const struct kv_wmat *m, float **owned) {
    *owned = NULL;
    if (m->type == KV_QTYPE_F32) return m->data;
    float *f = kv_malloc((size_t)m->rows * m->cols * sizeof(float));
    if (!f) return NULL;
    for (int r = 0; r < m->rows; r++)
        kv_dequant_row(m->type, (const char *)m->data + (size_t)r * m->row_bytes, f + (size_t)r * m->cols, m->cols);
    *owned = f;
    return f;
}

static kv_status w_wmat(gguf_writer_t *w, const char *name, const struct kv_wmat *m) {
    float *own;
    const float *f = wmat_as_f32(m, &own);
    if (!f) return KV_ENOMEM;
    kv_status rc = w_mat(w, name, f, m->rows, m->cols);
    free(own);
    return rc;
}
static kv_status w_vec(gguf_writer_t *w, const char *name, const float *data, int n) {
    uint64_t ne[1] = {(uint64_t)n};
    return gguf_w_tensor_f32(w, name, 1, ne, data);
}

kv_status model_save_gguf(const model_t *m, const char *path, model_gguf_extra_fn extra, void *user, char *err,
                          size_t errlen) {
    if (!m || !path) return kv_errf(KV_EINVAL, err, errlen, "model_save_gguf: invalid argument");
    const struct model_config *c = &m->cfg;
    gguf_writer_t *w = gguf_writer_new();
    if (!w) return kv_errf(KV_ENOMEM, err, errlen, "%s: out of memory", path);
    const char *a = model_arch_name(c->arch);
    char k[256];
    kv_status rc = gguf_w_str(w, "general.architecture", a);
    if (!rc) rc = gguf_w_str(w, "general.name", c->name[0] ? c->name : "kvserve-model");
#define KU32(suffix, v) if (!rc) { snprintf(k, sizeof k, "%s." suffix, a); rc = gguf_w_u32(w, k, (uint32_t)(v)); }
#define KF32(suffix, v) if (!rc) { snprintf(k, sizeof k, "%s." suffix, a); rc = gguf_w_f32(w, k, (float)(v)); }
    KU32("context_length", c->max_ctx);
    KU32("embedding_length", c->dim);
    KU32("block_count", c->n_layers);
    KU32("feed_forward_length", c->ffn_dim);
    KU32("attention.head_count", c->n_heads);
    KU32("attention.head_count_kv", c->n_kv_heads);
    KU32("attention.key_length", c->head_dim);
    KU32("attention.value_length", c->head_dim);
    KF32("attention.layer_norm_rms_epsilon", c->rms_eps);
    KF32("rope.freq_base", c->rope_theta);
    KU32("rope.dimension_count", c->head_dim);
    KU32("vocab_size", c->n_vocab);
    if (c->rope_scaling.type == 1 || c->rope_scaling.type == 2) {
        if (!rc) {
            snprintf(k, sizeof k, "%s.rope.scaling.type", a);
            rc = gguf_w_str(w, k, c->rope_scaling.type == 1 ? "llama3" : "linear");
        }
        KF32("rope.scaling.factor", c->rope_scaling.factor);
        if (c->rope_scaling.type == 1) {
            KF32("rope.scaling.low_freq_factor", c->rope_scaling.low_freq_factor);
            KF32("rope.scaling.high_freq_factor", c->rope_scaling.high_freq_factor);
            KU32("rope.scaling.original_context_length", c->rope_scaling.original_max_pos);
        }
    }
#undef KU32
#undef KF32
    if (!rc && c->bos_id >= 0) rc = gguf_w_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)c->bos_id);
    if (!rc && c->eos_id >= 0) rc = gguf_w_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)c->eos_id);
    if (!rc && c->n_eos_ids > 0) {
        int32_t ids[8];
        for (int i = 0; i < c->n_eos_ids; i++) ids[i] = c->eos_ids[i];
        rc = gguf_w_arr_i32(w, "kvserve.eos_token_ids", ids, (uint64_t)c->n_eos_ids);
    }
    if (rc) {
        gguf_writer_free(w);
        return kv_errf(rc, err, errlen, "%s: building metadata: %s", path, kv_status_str(rc));
    }
    if (extra) {
        rc = extra(w, user);
        if (rc) {
            gguf_writer_free(w);
            return kv_errf(rc, err, errlen, "%s: extra metadata writer failed: %s", path, kv_status_str(rc));
        }
    }
    /* GGUF llama is the adjacent-pair RoPE convention: permute rotate-half q/k rows. */
    bool permute = c->arch == MODEL_ARCH_LLAMA && c->rope_neox;
    int d = c->dim, q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
    rc = w_wmat(w, "token_embd.weight", &m->w.tok_embd);
    if (!rc) rc = w_vec(w, "output_norm.weight", m->w.out_norm, d);
    if (!rc && !c->tied_embeddings) rc = w_wmat(w, "output.weight", &m->w.output);
    char n[96];
    for (int l = 0; !rc && l < c->n_layers; l++) {
        const struct layer_weights *L = &m->w.layers[l];
#define NM(s) (snprintf(n, sizeof n, "blk.%d." s, l), n)
        rc = w_vec(w, NM("attn_norm.weight"), L->attn_norm, d);
        if (!rc) {
            if (permute) {
                float *oq, *ok;
                const float *fq = wmat_as_f32(&L->wq, &oq), *fk = wmat_as_f32(&L->wk, &ok);
                float *pq = fq ? permute_to_pairs(fq, c->n_heads, c->head_dim, d) : NULL;
                float *pk = fk ? permute_to_pairs(fk, c->n_kv_heads, c->head_dim, d) : NULL;
                rc = pq && pk ? KV_OK : KV_ENOMEM;
                if (!rc) rc = w_mat(w, NM("attn_q.weight"), pq, q, d);
                if (!rc) rc = w_mat(w, NM("attn_k.weight"), pk, kv, d);
                free(pq);
                free(pk);
                free(oq);
                free(ok);
            } else {
                rc = w_wmat(w, NM("attn_q.weight"), &L->wq);
                if (!rc) rc = w_wmat(w, NM("attn_k.weight"), &L->wk);
            }
        }
        if (!rc) rc = w_wmat(w, NM("attn_v.weight"), &L->wv);
        if (!rc && c->attn_bias) {
            rc = w_vec(w, NM("attn_q.bias"), L->bq, q);
            if (!rc) rc = w_vec(w, NM("attn_k.bias"), L->bk, kv);
            if (!rc) rc = w_vec(w, NM("attn_v.bias"), L->bv, kv);
        }
        if (!rc && c->qk_norm) {
            rc = w_vec(w, NM("attn_q_norm.weight"), L->q_norm, c->head_dim);
            if (!rc) rc = w_vec(w, NM("attn_k_norm.weight"), L->k_norm, c->head_dim);
        }
        if (!rc) rc = w_wmat(w, NM("attn_output.weight"), &L->wo);
        if (!rc) rc = w_vec(w, NM("ffn_norm.weight"), L->ffn_norm, d);
        if (!rc) rc = w_wmat(w, NM("ffn_gate.weight"), &L->w_gate);
        if (!rc) rc = w_wmat(w, NM("ffn_up.weight"), &L->w_up);
        if (!rc) rc = w_wmat(w, NM("ffn_down.weight"), &L->w_down);
#undef NM
    }
    if (rc) {
        gguf_writer_free(w);
        return kv_errf(rc, err, errlen, "%s: building tensors: %s", path, kv_status_str(rc));
    }
    rc = gguf_writer_save(w, path, err, errlen);
    gguf_writer_free(w);
    return rc;
}

/* ---- load dispatch ---- */
static bool is_hf_path(const char *path, char *dir, size_t dirlen);

kv_status model_load(const char *path, model_t **out, char *err, size_t errlen) {
    if (!path || !out) return kv_errf(KV_EINVAL, err, errlen, "model_load: invalid argument");
    char dir[4096];
    if (is_hf_path(path, dir, sizeof dir)) return model_load_hf(dir, out, err, errlen);
    if (!kv_path_exists(path)) return kv_errf(KV_ENOTFOUND, err, errlen, "%s: no such file or directory", path);
    return model_load_gguf(path, out, err, errlen);
}

/* ---- demo model ---- */
#define DEMO_FILE "demo-llama-v1.gguf"
#define DEMO_SEED 0x6b7673657276ull /* "kvserv" */

static kv_status demo_tokenizer(gguf_writer_t *w, void *user) {
    (void)user;
    enum { NV = 259 };
    static char bytes[256][8];
    const char *toks[NV];
    float scores[NV];
    int32_t types[NV];
    toks[0] = "<unk>";
    toks[1] = "<s>";
    toks[2] = "</s>";
    types[0] = 2;
    types[1] = 3;
    types[2] = 3;
    for (int i = 0; i < 256; i++) {
        snprintf(bytes[i], sizeof bytes[i], "<0x%02X>", i);
        toks[3 + i] = bytes[i];
        types[3 + i] = 6;
    }
    for (int i = 0; i < NV; i++) scores[i] = 0.0f;
    kv_status rc = gguf_w_str(w, "tokenizer.ggml.model", "llama");
    if (!rc) rc = gguf_w_arr_str(w, "tokenizer.ggml.tokens", toks, NV);
    if (!rc) rc = gguf_w_arr_f32(w, "tokenizer.ggml.scores", scores, NV);
    if (!rc) rc = gguf_w_arr_i32(w, "tokenizer.ggml.token_type", types, NV);
    if (!rc) rc = gguf_w_u32(w, "tokenizer.ggml.bos_token_id", 1);
    if (!rc) rc = gguf_w_u32(w, "tokenizer.ggml.eos_token_id", 2);
    if (!rc) rc = gguf_w_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    if (!rc) rc = gguf_w_bool(w, "tokenizer.ggml.add_bos_token", true);
    if (!rc) rc = gguf_w_bool(w, "tokenizer.ggml.add_space_prefix", false);
    return rc;
}

kv_status model_demo_path(char *out, size_t outlen, char *err, size_t errlen) {
    char dir[4096];
    const char *e;
    if ((e = getenv("KVSERVE_CACHE_DIR")) && *e) snprintf(dir, sizeof dir, "%s", e);
    else if ((e = getenv("XDG_CACHE_HOME")) && *e) snprintf(dir, sizeof dir, "%s/kvserve", e);
    else if ((e = getenv("HOME")) && *e) snprintf(dir, sizeof dir, "%s/.cache/kvserve", e);
    else return kv_errf(KV_ENOTFOUND, err, errlen, "no cache directory: set KVSERVE_CACHE_DIR or HOME");
    int n = snprintf(out, outlen, "%s/%s", dir, DEMO_FILE);
    if (n < 0 || (size_t)n >= outlen) return kv_errf(KV_EINVAL, err, errlen, "demo model path too long");
    if (kv_path_exists(out)) return KV_OK;
    if (kv_mkdirs(dir)) return kv_errf(KV_EIO, err, errlen, "%s: cannot create directory: %s", dir, strerror(errno));
    struct model_config c = {0};
    c.arch = MODEL_ARCH_LLAMA;
    c.n_vocab = 259;
    c.dim = 256;
    c.n_layers = 4;
    c.n_heads = 8;
    c.n_kv_heads = 4;
    c.head_dim = 32;
    c.ffn_dim = 688;
    c.rms_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.rope_neox = false;
    c.max_ctx = 2048;
    c.tied_embeddings = false;
    c.bos_id = 1;
    c.eos_id = 2;
    c.eos_ids[0] = 2;
    c.n_eos_ids = 1;
    snprintf(c.name, sizeof c.name, "kvserve-demo (random weights)");
    model_t *m;
    kv_status rc = model_alloc(&c, &m);
    if (rc) return kv_errf(rc, err, errlen, "demo model: %s", kv_status_str(rc));
    model_randomize(m, DEMO_SEED, 0.05f);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", out, (long)getpid());
    rc = model_save_gguf(m, tmp, demo_tokenizer, NULL, err, errlen);
    model_free(m);
    if (rc) {
        unlink(tmp);
        return rc;
    }
    if (rename(tmp, out) != 0) {
        int e2 = errno;
        unlink(tmp);
        return kv_errf(KV_EIO, err, errlen, "%s: rename failed: %s", out, strerror(e2));
    }
    return KV_OK;
}

/* ---- config-only reading and tensor listing (kvserve inspect) ---- */
static bool is_hf_path(const char *path, char *dir, size_t dirlen) {
    if (kv_path_is_dir(path)) {
        snprintf(dir, dirlen, "%s", path);
        return true;
    }
    char base[256];
    model_base_name(path, false, base, sizeof base);
    size_t bl = strlen(base);
    if (strcmp(base, "config.json") == 0 || (bl > 12 && strcmp(base + bl - 12, ".safetensors") == 0) ||
        strcmp(base, "model.safetensors.index.json") == 0) {
        snprintf(dir, dirlen, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else snprintf(dir, dirlen, ".");
        return true;
    }
    return false;
}

kv_status model_read_config(const char *path, struct model_config *cfg, model_format *fmt, char *err,
                            size_t errlen) {
    if (!path || !cfg) return kv_errf(KV_EINVAL, err, errlen, "model_read_config: invalid argument");
    char dir[4096];
    if (is_hf_path(path, dir, sizeof dir)) {
        struct model_config c;
        kv_status rc = model_hf_config(dir, &c, err, errlen);
        if (rc) return rc;
        if (c.n_vocab <= 1) c.n_vocab = 0; /* unknown without reading the weights */
        if (fmt) *fmt = MODEL_FORMAT_HF_DIR;
        *cfg = c;
        return KV_OK;
    }
    if (!kv_path_exists(path)) return kv_errf(KV_ENOTFOUND, err, errlen, "%s: no such file or directory", path);
    gguf_t *g;
    kv_status rc = gguf_open(path, &g, err, errlen);
    if (rc) return rc;
    rc = model_gguf_config(g, cfg, err, errlen);
    gguf_close(g);
    if (!rc && fmt) *fmt = MODEL_FORMAT_GGUF;
    return rc;
}

kv_status model_list_tensors(const char *path, model_tensor_fn cb, void *user, char *err, size_t errlen) {
    if (!path || !cb) return kv_errf(KV_EINVAL, err, errlen, "model_list_tensors: invalid argument");
    char dir[4096];
    if (is_hf_path(path, dir, sizeof dir)) return model_hf_list_tensors(dir, cb, user, err, errlen);
    gguf_t *g;
    kv_status rc = gguf_open(path, &g, err, errlen);
    if (rc) return rc;
    for (int i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        uint64_t s[4];
        for (int d = 0; d < t->n_dims; d++) s[d] = t->ne[t->n_dims - 1 - d];
        cb(user, t->name, ggml_dtype_name(t->type), t->n_dims, s);
    }
    gguf_close(g);
    return KV_OK;
}
