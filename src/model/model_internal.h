/* model: private helpers shared by the model loaders (not part of the public API). */
#ifndef KV_MODEL_INTERNAL_H
#define KV_MODEL_INTERNAL_H

#include "gguf.h"
#include "model.h"

/* Checks that cfg is internally consistent and small enough that every size fits. */
kv_status model_config_check(const struct model_config *cfg, const char *what, char *err, size_t errlen);
/* Base name of path without directory and (if strip_ext) without extension, into out. */
void model_base_name(const char *path, bool strip_ext, char *out, size_t outlen);
/* Reads the config of an opened GGUF file (no weights). */
kv_status model_gguf_config(const gguf_t *g, struct model_config *cfg, char *err, size_t errlen);
kv_status model_load_gguf(const char *path, model_t **out, char *err, size_t errlen);
kv_status model_load_hf(const char *dir, model_t **out, char *err, size_t errlen);
kv_status model_hf_config(const char *dir, struct model_config *cfg, char *err, size_t errlen);
kv_status model_hf_list_tensors(const char *dir, model_tensor_fn cb, void *user, char *err, size_t errlen);

#endif
