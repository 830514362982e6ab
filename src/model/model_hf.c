/* model: loading a Hugging Face directory (config.json, generation_config.json, one
 * model.safetensors or shards listed by model.safetensors.index.json).
 *
 * safetensors layout: u64 LE header length N, N bytes of JSON
 *   {"name": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]}, "__metadata__": {...}}
 * then the data; offsets are relative to the byte after the header. */
#include "model_internal.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct st_file {
    char name[256];  /* file name inside the directory */
    kv_mmap_t map;
    json_t *hdr;     /* owned */
    size_t data_off; /* 8 + header length */
};

struct hf_ctx {
    char dir[4096];
    char dname[256]; /* directory base name, for messages */
    struct st_file *files;
    int n_files;
    json_t *weight_map; /* owned; sharded checkpoints only */
};

static size_t st_dtype_size(const char *dt) {
    static const struct { const char *n; size_t s; } t[] = {
        {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
        {"I8", 1}, {"U8", 1}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"U16", 2}, {"U32", 4}, {"U64", 8},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (strcmp(dt, t[i].n) == 0) return t[i].s;
    return 0;
}

/* Validates one header entry against the data size; fills the element count. */
static kv_status st_check_entry(const char *fname, const char *tname, json_t *e, size_t data_size, char *err,
                                size_t errlen) {
    json_t *dt = json_object_get(e, "dtype"), *sh = json_object_get(e, "shape"), *of = json_object_get(e, "data_offsets");
    if (!json_is_object(e) || !json_is_string(dt) || !json_is_array(sh) || !json_is_array(of) || json_array_size(of) != 2)
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has a malformed header entry", fname, tname);
    if (json_array_size(sh) > 8) return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has too many dimensions", fname, tname);
    uint64_t n = 1;
    for (size_t i = 0; i < json_array_size(sh); i++) {
        json_t *d = json_array_get(sh, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0 || json_integer_value(d) > (1ll << 40))
            return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has an invalid shape", fname, tname);
        uint64_t v = (uint64_t)json_integer_value(d);
        if (v && n > (1ull << 48) / v) return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s is too large", fname, tname);
        n *= v;
    }
    json_t *b = json_array_get(of, 0), *en = json_array_get(of, 1);
    if (!json_is_integer(b) || !json_is_integer(en) || json_integer_value(b) < 0 ||
        json_integer_value(en) < json_integer_value(b) || (uint64_t)json_integer_value(en) > data_size)
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s data_offsets are outside the file (%zu data bytes)", fname,
                       tname, data_size);
    size_t es = st_dtype_size(json_string_value(dt));
    if (es && (uint64_t)(json_integer_value(en) - json_integer_value(b)) != n * es)
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has %lld data bytes, expected %llu for its shape and dtype %s",
                       fname, tname, (long long)(json_integer_value(en) - json_integer_value(b)),
                       (unsigned long long)(n * es), json_string_value(dt));
    return KV_OK;
}

static kv_status st_open(struct hf_ctx *x, const char *fname, struct st_file *f, char *err, size_t errlen) {
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", x->dir, fname);
    snprintf(f->name, sizeof f->name, "%s", fname);
    kv_status rc = kv_mmap_file(path, &f->map, err, errlen);
    if (rc) return rc;
    const uint8_t *p = f->map.data;
    uint64_t hl;
    if (f->map.size < 8) return kv_errf(KV_EFORMAT, err, errlen, "%s: truncated safetensors header", fname);
    memcpy(&hl, p, 8);
    if (hl < 2 || hl > f->map.size - 8 || hl > (100u << 20))
        return kv_errf(KV_EFORMAT, err, errlen, "%s: safetensors header length %llu exceeds the file size %zu", fname,
                       (unsigned long long)hl, f->map.size);
    json_error_t je;
    f->hdr = json_loadb((const char *)p + 8, (size_t)hl, JSON_REJECT_DUPLICATES, &je);
    if (!f->hdr) return kv_errf(KV_EFORMAT, err, errlen, "%s: bad safetensors header JSON: %s", fname, je.text);
    if (!json_is_object(f->hdr)) return kv_errf(KV_EFORMAT, err, errlen, "%s: safetensors header is not an object", fname);
    f->data_off = (size_t)(8 + hl);
    size_t data_size = f->map.size - f->data_off;
    const char *k;
    json_t *v;
    json_object_foreach(f->hdr, k, v) {
        if (strcmp(k, "__metadata__") == 0) continue;
        if ((rc = st_check_entry(fname, k, v, data_size, err, errlen))) return rc;
    }
    return KV_OK;
}

static void hf_close(struct hf_ctx *x) {
    for (int i = 0; i < x->n_files; i++) {
        json_decref(x->files[i].hdr);
        kv_munmap(&x->files[i].map);
    }
    free(x->files);
    json_decref(x->weight_map);
    x->files = NULL;
    x->n_files = 0;
    x->weight_map = NULL;
}

static kv_status hf_open_weights(struct hf_ctx *x, char *err, size_t errlen) {
    char path[4400];
    snprintf(path, sizeof path, "%s/model.safetensors", x->dir);
    if (kv_path_exists(path)) {
        x->files = kv_calloc(1, sizeof *x->files);
        if (!x->files) return KV_ENOMEM;
        x->n_files = 1;
        return st_open(x, "model.safetensors", &x->files[0], err, errlen);
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", x->dir);
    if (!kv_path_exists(path))
        return kv_errf(KV_ENOTFOUND, err, errlen, "%s: no model.safetensors or model.safetensors.index.json", x->dname);
    json_error_t je;
    json_t *idx = json_load_file(path, 0, &je);
    if (!idx) return kv_errf(KV_EFORMAT, err, errlen, "%s/model.safetensors.index.json: %s (line %d)", x->dname, je.text, je.line);
    json_t *wm = json_object_get(idx, "weight_map");
    if (!json_is_object(wm)) {
        json_decref(idx);
        return kv_errf(KV_EFORMAT, err, errlen, "%s/model.safetensors.index.json: missing weight_map object", x->dname);
    }
    x->weight_map = json_incref(wm);
    json_decref(idx);
    size_t nmax = json_object_size(wm);
    x->files = kv_calloc(nmax ? nmax : 1, sizeof *x->files);
    if (!x->files) return KV_ENOMEM;
    const char *k;
    json_t *v;
    json_object_foreach(wm, k, v) {
        const char *fn = json_string_value(v);
        if (!fn || !*fn || strchr(fn, '/') || strcmp(fn, "..") == 0 || strlen(fn) >= 256)
            return kv_errf(KV_EFORMAT, err, errlen, "%s/model.safetensors.index.json: invalid shard name for %s", x->dname, k);
        bool have = false;
        for (int i = 0; i < x->n_files && !have; i++) have = strcmp(x->files[i].name, fn) == 0;
        if (have) continue;
        kv_status rc = st_open(x, fn, &x->files[x->n_files++], err, errlen);
        if (rc) return rc;
    }
    return KV_OK;
}

/* Finds tensor `name`: its file and header entry, or NULL. */
static json_t *hf_find(const struct hf_ctx *x, const char *name, const struct st_file **file) {
    const char *fn = NULL;
    if (x->weight_map) {
        fn = json_string_value(json_object_get(x->weight_map, name));
        if (!fn) return NULL;
    }
    for (int i = 0; i < x->n_files; i++) {
        if (fn && strcmp(fn, x->files[i].name) != 0) continue;
        json_t *e = json_object_get(x->files[i].hdr, name);
        if (e) {
            *file = &x->files[i];
            return e;
        }
    }
    return NULL;
}

/* Finds `name`, checks its shape [rows] (cols == 0) or [rows, cols]; *data / *dtype: its
 * bytes in the map and its safetensors dtype. */
static kv_status hf_find_t(const struct hf_ctx *x, const char *name, int rows, int cols, const uint8_t **data,
                           const char **dtype, char *err, size_t errlen) {
    const struct st_file *f;
    json_t *e = hf_find(x, name, &f);
    if (!e) return kv_errf(KV_EFORMAT, err, errlen, "%s: missing tensor %s", x->dname, name);
    json_t *sh = json_object_get(e, "shape");
    int nd = cols ? 2 : 1;
    bool ok = (int)json_array_size(sh) == nd && json_integer_value(json_array_get(sh, 0)) == rows &&
              (nd == 1 || json_integer_value(json_array_get(sh, 1)) == cols);
    if (!ok) {
        char got[128];
        size_t o = 0;
        o += (size_t)snprintf(got + o, sizeof got - o, "[");
        for (size_t i = 0; i < json_array_size(sh) && i < 8; i++)
            o += (size_t)snprintf(got + o, sizeof got - o, "%s%lld", i ? ", " : "", (long long)json_integer_value(json_array_get(sh, i)));
        snprintf(got + o, sizeof got - o, "]");
        if (cols)
            return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has shape %s, expected [%d, %d]", f->name, name, got, rows, cols);
        return kv_errf(KV_EFORMAT, err, errlen, "%s: tensor %s has shape %s, expected [%d]", f->name, name, got, rows);
    }
    *dtype = json_string_value(json_object_get(e, "dtype"));
    *data = (const uint8_t *)f->map.data + f->data_off +
            (size_t)json_integer_value(json_array_get(json_object_get(e, "data_offsets"), 0));
    if (strcmp(*dtype, "F32") && strcmp(*dtype, "F16") && strcmp(*dtype, "BF16"))
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: tensor %s has unsupported dtype %s (supported: F32, F16, BF16)",
                       f->name, name, *dtype);
    return KV_OK;
}

/* Loads `name` with expected shape [rows] (cols == 0) or [rows, cols] into dst (f32). */
static kv_status hf_load_t(const struct hf_ctx *x, const char *name, float *dst, int rows, int cols, char *err,
                           size_t errlen) {
    const uint8_t *p;
    const char *dt;
    kv_status rc = hf_find_t(x, name, rows, cols, &p, &dt, err, errlen);
    if (rc) return rc;
    size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
    if (strcmp(dt, "F32") == 0) {
        memcpy(dst, p, n * 4);
    } else if (strcmp(dt, "F16") == 0 || strcmp(dt, "BF16") == 0) {
        bool bf = dt[0] == 'B';
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = bf ? kv_bf16_to_f32(h) : kv_f16_to_f32(h);
        }
    }
    return KV_OK;
}

/* Loads matrix `name` [rows, cols] into *w, keeping its precision (F32, F16 or BF16) in a
 * buffer the model owns (the checkpoint's map is closed after loading). */
static kv_status hf_load_m(const struct hf_ctx *x, model_t *m, const char *name, struct kv_wmat *w, int rows, int cols,
                           char *err, size_t errlen) {
    const uint8_t *p;
    const char *dt;
    kv_status rc = hf_find_t(x, name, rows, cols, &p, &dt, err, errlen);
    if (rc) return rc;
    int type = !strcmp(dt, "F32") ? KV_QTYPE_F32 : !strcmp(dt, "F16") ? KV_QTYPE_F16 : KV_QTYPE_BF16;
    size_t rb = kv_qtype_row_bytes(type, cols), nb = rb * (size_t)rows;
    void *buf = kv_malloc(nb ? nb : 1);
    if (!buf || model_own(m, buf)) return kv_errf(KV_ENOMEM, err, errlen, "%s: out of memory loading %s", x->dname, name);
    memcpy(buf, p, nb);
    w->data = buf;
    w->type = type;
    w->rows = rows;
    w->cols = cols;
    w->row_bytes = rb;
    return KV_OK;
}

/* ---- config.json ---- */

static kv_status j_int(json_t *o, const char *key, bool required, int def, int *out, const char *what, char *err,
                       size_t errlen) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required) return kv_errf(KV_EFORMAT, err, errlen, "%s: missing %s", what, key);
        *out = def;
        return KV_OK;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
        return kv_errf(KV_EFORMAT, err, errlen, "%s: %s must be a non-negative integer", what, key);
    *out = (int)json_integer_value(v);
    return KV_OK;
}
static kv_status j_float(json_t *o, const char *key, float def, float *out, const char *what, char *err, size_t errlen) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return KV_OK;
    }
    if (!json_is_number(v)) return kv_errf(KV_EFORMAT, err, errlen, "%s: %s must be a number", what, key);
    *out = (float)json_number_value(v);
    return KV_OK;
}
/* Appends ids from an int or a list of ints to cfg->eos_ids (dedup). */
static void add_eos(struct model_config *c, json_t *v) {
    if (json_is_integer(v)) {
        int id = (int)json_integer_value(v);
        if (json_integer_value(v) < 0 || json_integer_value(v) >= c->n_vocab) return;
        for (int j = 0; j < c->n_eos_ids; j++)
            if (c->eos_ids[j] == id) return;
        if (c->n_eos_ids < 8) c->eos_ids[c->n_eos_ids++] = id;
    } else if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) add_eos(c, json_array_get(v, i));
    }
}

kv_status model_hf_config(const char *dir, struct model_config *cfg, char *err, size_t errlen) {
    char dname[256], what[300], path[4400];
    model_base_name(dir, false, dname, sizeof dname);
    snprintf(what, sizeof what, "%s/config.json", dname);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!kv_path_exists(path)) return kv_errf(KV_ENOTFOUND, err, errlen, "%s: no config.json in the directory", dname);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) return kv_errf(KV_EFORMAT, err, errlen, "%s: %s (line %d)", what, je.text, je.line);
    kv_status rc = KV_OK;
    struct model_config c;
    memset(&c, 0, sizeof c);
    if (!json_is_object(j)) {
        rc = kv_errf(KV_EFORMAT, err, errlen, "%s: not a JSON object", what);
        goto done;
    }
    const char *an = json_string_value(json_array_get(json_object_get(j, "architectures"), 0));
    const char *mt = json_string_value(json_object_get(j, "model_type"));
    if (an) {
        if (!strcmp(an, "LlamaForCausalLM") || !strcmp(an, "MistralForCausalLM")) c.arch = MODEL_ARCH_LLAMA;
        else if (!strcmp(an, "Qwen2ForCausalLM")) c.arch = MODEL_ARCH_QWEN2;
        else if (!strcmp(an, "Qwen3ForCausalLM")) c.arch = MODEL_ARCH_QWEN3;
        else {
            rc = kv_errf(KV_EUNSUPPORTED, err, errlen,
                         "%s: unsupported architecture %s (supported: LlamaForCausalLM, MistralForCausalLM, "
                         "Qwen2ForCausalLM, Qwen3ForCausalLM)", what, an);
            goto done;
        }
    } else if (mt && (!strcmp(mt, "llama") || !strcmp(mt, "mistral"))) c.arch = MODEL_ARCH_LLAMA;
    else if (mt && !strcmp(mt, "qwen2")) c.arch = MODEL_ARCH_QWEN2;
    else if (mt && !strcmp(mt, "qwen3")) c.arch = MODEL_ARCH_QWEN3;
    else {
        rc = kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: unknown architecture (architectures/model_type)", what);
        goto done;
    }
#define TRY(x) if ((rc = (x))) goto done
    TRY(j_int(j, "hidden_size", true, 0, &c.dim, what, err, errlen));
    TRY(j_int(j, "intermediate_size", true, 0, &c.ffn_dim, what, err, errlen));
    TRY(j_int(j, "num_hidden_layers", true, 0, &c.n_layers, what, err, errlen));
    TRY(j_int(j, "num_attention_heads", true, 0, &c.n_heads, what, err, errlen));
    TRY(j_int(j, "num_key_value_heads", false, c.n_heads, &c.n_kv_heads, what, err, errlen));
    if (c.n_heads == 0) {
        rc = kv_errf(KV_EFORMAT, err, errlen, "%s: num_attention_heads must be positive", what);
        goto done;
    }
    TRY(j_int(j, "head_dim", false, c.dim / c.n_heads, &c.head_dim, what, err, errlen));
    TRY(j_int(j, "vocab_size", false, 0, &c.n_vocab, what, err, errlen));
    TRY(j_int(j, "max_position_embeddings", false, 2048, &c.max_ctx, what, err, errlen));
    TRY(j_float(j, "rms_norm_eps", 1e-6f, &c.rms_eps, what, err, errlen));
    TRY(j_float(j, "rope_theta", 10000.0f, &c.rope_theta, what, err, errlen));
    const char *act = json_string_value(json_object_get(j, "hidden_act"));
    if (act && strcmp(act, "silu") != 0) {
        rc = kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: hidden_act %s is not supported (silu only)", what, act);
        goto done;
    }
    if (json_is_true(json_object_get(j, "mlp_bias"))) {
        rc = kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: mlp_bias is not supported", what);
        goto done;
    }
    json_t *rs = json_object_get(j, "rope_scaling");
    if (json_is_object(rs)) {
        const char *t = json_string_value(json_object_get(rs, "rope_type"));
        if (!t) t = json_string_value(json_object_get(rs, "type"));
        if (t && !strcmp(t, "llama3")) c.rope_scaling.type = 1;
        else if (t && !strcmp(t, "linear")) c.rope_scaling.type = 2;
        else if (t && !strcmp(t, "default")) c.rope_scaling.type = 0;
        else {
            rc = kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: unsupported rope_scaling type %s", what, t ? t : "(none)");
            goto done;
        }
        if (c.rope_scaling.type) {
            TRY(j_float(rs, "factor", 1.0f, &c.rope_scaling.factor, what, err, errlen));
            TRY(j_float(rs, "low_freq_factor", 1.0f, &c.rope_scaling.low_freq_factor, what, err, errlen));
            TRY(j_float(rs, "high_freq_factor", 4.0f, &c.rope_scaling.high_freq_factor, what, err, errlen));
            TRY(j_int(rs, "original_max_position_embeddings", false, 8192, &c.rope_scaling.original_max_pos, what, err, errlen));
            if (!(c.rope_scaling.factor > 0) || !isfinite(c.rope_scaling.factor)) {
                rc = kv_errf(KV_EFORMAT, err, errlen, "%s: invalid rope_scaling factor", what);
                goto done;
            }
        }
    } else if (rs && !json_is_null(rs)) {
        rc = kv_errf(KV_EFORMAT, err, errlen, "%s: rope_scaling must be an object or null", what);
        goto done;
    }
    if (c.arch == MODEL_ARCH_LLAMA && json_is_integer(json_object_get(j, "sliding_window")) &&
        json_integer_value(json_object_get(j, "sliding_window")) < c.max_ctx)
        KV_WARN("%s: sliding_window attention is not implemented; attending to the full context", what);
    c.rope_neox = true;
    c.attn_bias = c.arch == MODEL_ARCH_QWEN2 || json_is_true(json_object_get(j, "attention_bias"));
    c.qk_norm = c.arch == MODEL_ARCH_QWEN3;
    c.tied_embeddings = json_is_true(json_object_get(j, "tie_word_embeddings"));
    c.bos_id = c.eos_id = -1;
    json_t *b = json_object_get(j, "bos_token_id");
    if (json_is_array(b)) b = json_array_get(b, 0);
    if (json_is_integer(b) && json_integer_value(b) >= 0 && json_integer_value(b) < INT32_MAX) c.bos_id = (int)json_integer_value(b);
    /* eos: config first, then generation_config (its list is what ends generation) */
    int nv_save = c.n_vocab;
    c.n_vocab = nv_save ? nv_save : INT32_MAX; /* range check for add_eos before the embedding is seen */
    add_eos(&c, json_object_get(j, "eos_token_id"));
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (kv_path_exists(path)) {
        json_t *gj = json_load_file(path, 0, &je);
        if (!gj) {
            rc = kv_errf(KV_EFORMAT, err, errlen, "%s/generation_config.json: %s (line %d)", dname, je.text, je.line);
            goto done;
        }
        add_eos(&c, json_object_get(gj, "eos_token_id"));
        json_decref(gj);
    }
    c.n_vocab = nv_save;
    if (c.n_eos_ids) c.eos_id = c.eos_ids[0];
    /* the model's own name: _name_or_path (a hub id as is; a local path: its last component) */
    json_t *nop = json_object_get(j, "_name_or_path");
    const char *ns = json_string_value(nop);
    if (ns && (*ns == '/' || *ns == '.' || *ns == '~')) {
        char b[128];
        model_base_name(ns, false, b, sizeof b);
        if (!model_set_name(c.name, sizeof c.name, b, strlen(b))) model_dir_name(dir, c.name, sizeof c.name);
    } else if (!ns || !model_set_name(c.name, sizeof c.name, ns, strlen(ns))) {
        model_dir_name(dir, c.name, sizeof c.name);
    }
    if (c.n_vocab == 0) c.n_vocab = 1; /* filled from the embedding by the loader */
    TRY(model_config_check(&c, what, err, errlen));
#undef TRY
    *cfg = c;
done:
    json_decref(j);
    return rc;
}

kv_status model_load_hf(const char *dir, model_t **out, char *err, size_t errlen) {
    struct hf_ctx x;
    memset(&x, 0, sizeof x);
    snprintf(x.dir, sizeof x.dir, "%s", dir);
    model_base_name(dir, false, x.dname, sizeof x.dname);
    struct model_config c;
    kv_status rc = model_hf_config(dir, &c, err, errlen);
    if (rc) return rc;
    model_t *m = NULL;
    if ((rc = hf_open_weights(&x, err, errlen))) {
        if (rc == KV_ENOMEM) kv_errf(rc, err, errlen, "%s: out of memory", x.dname);
        goto done;
    }
    const struct st_file *f;
    json_t *emb = hf_find(&x, "model.embed_tokens.weight", &f);
    if (!emb) {
        rc = kv_errf(KV_EFORMAT, err, errlen, "%s: missing tensor model.embed_tokens.weight", x.dname);
        goto done;
    }
    json_t *sh = json_object_get(emb, "shape");
    if (c.n_vocab <= 1) { /* vocab_size absent in config.json */
        if (json_array_size(sh) != 2 || json_integer_value(json_array_get(sh, 0)) <= 0 ||
            json_integer_value(json_array_get(sh, 0)) > (1 << 24)) {
            rc = kv_errf(KV_EFORMAT, err, errlen, "%s: model.embed_tokens.weight has an invalid shape", f->name);
            goto done;
        }
        c.n_vocab = (int)json_integer_value(json_array_get(sh, 0));
    }
    if (!c.tied_embeddings && !hf_find(&x, "lm_head.weight", &f)) c.tied_embeddings = true;
    for (int i = 0; i < c.n_eos_ids; i++)
        if (c.eos_ids[i] >= c.n_vocab) {
            rc = kv_errf(KV_EFORMAT, err, errlen, "%s: eos_token_id %d >= vocab size %d", x.dname, c.eos_ids[i], c.n_vocab);
            goto done;
        }
    if (c.bos_id >= c.n_vocab) c.bos_id = -1;
    if ((rc = model_alloc_ex(&c, false, &m))) {
        kv_errf(rc, err, errlen, "%s: cannot allocate the model: %s", x.dname, kv_status_str(rc));
        goto done;
    }
    int d = c.dim, q = c.n_heads * c.head_dim, kv = c.n_kv_heads * c.head_dim, ff = c.ffn_dim;
    if ((rc = hf_load_m(&x, m, "model.embed_tokens.weight", &m->w.tok_embd, c.n_vocab, d, err, errlen))) goto done;
    if ((rc = hf_load_t(&x, "model.norm.weight", m->w.out_norm, d, 0, err, errlen))) goto done;
    if (c.tied_embeddings) m->w.output = m->w.tok_embd;
    else if ((rc = hf_load_m(&x, m, "lm_head.weight", &m->w.output, c.n_vocab, d, err, errlen))) goto done;
    char n[128];
    for (int l = 0; l < c.n_layers; l++) {
        struct layer_weights *L = &m->w.layers[l];
#define LD(s, dst, a, b) \
    do { \
        snprintf(n, sizeof n, "model.layers.%d." s, l); \
        if ((rc = hf_load_t(&x, n, dst, a, b, err, errlen))) goto done; \
    } while (0)
#define LM(s, dst, a, b) \
    do { \
        snprintf(n, sizeof n, "model.layers.%d." s, l); \
        if ((rc = hf_load_m(&x, m, n, &(dst), a, b, err, errlen))) goto done; \
    } while (0)
        LD("input_layernorm.weight", L->attn_norm, d, 0);
        LM("self_attn.q_proj.weight", L->wq, q, d);
        LM("self_attn.k_proj.weight", L->wk, kv, d);
        LM("self_attn.v_proj.weight", L->wv, kv, d);
        if (c.attn_bias) {
            LD("self_attn.q_proj.bias", L->bq, q, 0);
            LD("self_attn.k_proj.bias", L->bk, kv, 0);
            LD("self_attn.v_proj.bias", L->bv, kv, 0);
        }
        if (c.qk_norm) {
            LD("self_attn.q_norm.weight", L->q_norm, c.head_dim, 0);
            LD("self_attn.k_norm.weight", L->k_norm, c.head_dim, 0);
        }
        LM("self_attn.o_proj.weight", L->wo, d, q);
        snprintf(n, sizeof n, "model.layers.%d.self_attn.o_proj.bias", l);
        if (hf_find(&x, n, &f)) {
            rc = kv_errf(KV_EUNSUPPORTED, err, errlen, "%s: tensor %s (output projection bias) is not supported", f->name, n);
            goto done;
        }
        LD("post_attention_layernorm.weight", L->ffn_norm, d, 0);
        LM("mlp.gate_proj.weight", L->w_gate, ff, d);
        LM("mlp.up_proj.weight", L->w_up, ff, d);
        LM("mlp.down_proj.weight", L->w_down, d, ff);
#undef LD
#undef LM
    }
    m->format = MODEL_FORMAT_HF_DIR;
    snprintf(m->path, sizeof m->path, "%s", dir);
done:
    hf_close(&x);
    if (rc) {
        model_free(m);
        return rc;
    }
    *out = m;
    return KV_OK;
}

/* ---- listing for `kvserve inspect` ---- */
kv_status model_hf_list_tensors(const char *dir, model_tensor_fn cb, void *user, char *err, size_t errlen) {
    struct hf_ctx x;
    memset(&x, 0, sizeof x);
    snprintf(x.dir, sizeof x.dir, "%s", dir);
    model_base_name(dir, false, x.dname, sizeof x.dname);
    kv_status rc = hf_open_weights(&x, err, errlen);
    for (int i = 0; !rc && i < x.n_files; i++) {
        const char *k;
        json_t *v;
        json_object_foreach(x.files[i].hdr, k, v) {
            if (strcmp(k, "__metadata__") == 0) continue;
            json_t *sh = json_object_get(v, "shape");
            uint64_t s[8];
            int nd = (int)json_array_size(sh);
            for (int d = 0; d < nd && d < 8; d++) s[d] = (uint64_t)json_integer_value(json_array_get(sh, d));
            cb(user, k, json_string_value(json_object_get(v, "dtype")), nd, s);
        }
    }
    hf_close(&x);
    return rc;
}
