/* model: private helpers shared by the model loaders (not part of the public API). */
#ifndef KV_MODEL_INTERNAL_H
#define KV_MODEL_INTERNAL_H

#include "gguf.h"
#include "model.h"

/* model_t.priv: what the model owns. */
struct model_priv {
    float *arena;   /* f32 vectors (and matrices of model_alloc's models) */
    gguf_t *gguf;   /* open GGUF whose map the matrices point into, or NULL */
    void **owned;   /* further owned buffers (HF 16-bit matrices), freed with the model */
    int n_owned, cap_owned;
};
/* model_alloc, or (matrices false) a model whose arena holds only the f32 vectors: the
 * loader then points every struct kv_wmat at the file's data (or an owned buffer). */
kv_status model_alloc_ex(const struct model_config *cfg, bool matrices, model_t **out);
/* Adds p to the buffers freed with m (p freed and KV_ENOMEM if that fails). */
kv_status model_own(model_t *m, void *p);

/* Checks that cfg is internally consistent and small enough that every size fits. */
kv_status model_config_check(const struct model_config *cfg, const char *what, char *err, size_t errlen);
/* Base name of path without directory and (if strip_ext) without extension, into out. */
void model_base_name(const char *path, bool strip_ext, char *out, size_t outlen);
/* The name of a Hugging Face directory without a name in its config (model.h, name): the
 * hub cache's "org/name" (.../models--org--name/snapshots/REV), else the directory's base
 * name, or its parent's when the base name is generic (hf, model, checkpoint, weights, a
 * 7..64-digit hex revision). */
void model_dir_name(const char *dir, char *out, size_t outlen);
/* Copies s[0..n) into out when it is a usable model id (printable, no quotes or control
 * characters, shorter than outlen); returns false (out untouched) otherwise. */
bool model_set_name(char *out, size_t outlen, const char *s, size_t n);
/* Reads the config of an opened GGUF file (no weights). */
kv_status model_gguf_config(const gguf_t *g, struct model_config *cfg, char *err, size_t errlen);
kv_status model_load_gguf(const char *path, model_t **out, char *err, size_t errlen);
kv_status model_load_hf(const char *dir, model_t **out, char *err, size_t errlen);
kv_status model_hf_config(const char *dir, struct model_config *cfg, char *err, size_t errlen);
kv_status model_hf_list_tensors(const char *dir, model_tensor_fn cb, void *user, char *err, size_t errlen);

#endif
