/*
 * gguf: reader and writer for GGUF v2/v3 (ggml's single-file model format).
 * Spec: ggml docs/gguf.md. Layout: magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
 * kv pairs (string key, u32 type, value), tensor infos (name, u32 n_dims, u64 ne[n_dims],
 * u32 ggml_type, u64 offset), padding to `general.alignment` (default 32), tensor data.
 *
 * The reader memory-maps the file and validates every length and offset against the
 * file size: a truncated or corrupt file gives KV_EFORMAT with a message, never a crash.
 */
#ifndef KV_GGUF_H
#define KV_GGUF_H

#include "../base/base.h"
#include "../quant/quant.h"

enum gguf_type {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2, GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4, GGUF_TYPE_INT32 = 5, GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8, GGUF_TYPE_ARRAY = 9, GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
};

/* ggml tensor types we compute with: the same numbers as enum kv_qtype (quant/quant.h), which
 * is the authority (kv_qtype_supported). Every other type ggml defines still opens (its size is
 * checked from ggml's block table) and is reported as unsupported, by name, on conversion. */
enum ggml_dtype {
    GGML_F32 = KV_QTYPE_F32,
    GGML_F16 = KV_QTYPE_F16,
    GGML_Q4_0 = KV_QTYPE_Q4_0,
    GGML_Q8_0 = KV_QTYPE_Q8_0,
    GGML_Q4_K = KV_QTYPE_Q4_K,
    GGML_Q5_K = KV_QTYPE_Q5_K,
    GGML_Q6_K = KV_QTYPE_Q6_K,
    GGML_BF16 = KV_QTYPE_BF16,
};

typedef struct gguf gguf_t;

kv_status gguf_open(const char *path, gguf_t **out, char *err, size_t errlen);
void gguf_close(gguf_t *g);
uint32_t gguf_version(const gguf_t *g);
const char *gguf_path(const gguf_t *g);
/* True when [p, p + n) lies inside g's file map. */
bool gguf_in_map(const gguf_t *g, const void *p, size_t n);

/* ---- metadata lookups: return false if the key is absent or has another type ---- */
int gguf_find_key(const gguf_t *g, const char *key); /* index or -1 */
int gguf_n_keys(const gguf_t *g);
const char *gguf_key_name(const gguf_t *g, int i);
enum gguf_type gguf_key_type(const gguf_t *g, int i);
/* Integer of any integer type (and bool) converted to int64. */
bool gguf_get_int(const gguf_t *g, const char *key, int64_t *out);
/* FLOAT32/FLOAT64 (and integers) converted to double. */
bool gguf_get_float(const gguf_t *g, const char *key, double *out);
bool gguf_get_bool(const gguf_t *g, const char *key, bool *out);
/* Borrowed pointer into the map, NOT NUL-terminated: use *len. */
bool gguf_get_str(const gguf_t *g, const char *key, const char **s, size_t *len);
/* Arrays: element type and count. */
bool gguf_get_arr_info(const gguf_t *g, const char *key, enum gguf_type *elem_type, uint64_t *n);
/* i-th string of a string array (borrowed, not NUL-terminated). */
bool gguf_get_arr_str(const gguf_t *g, const char *key, uint64_t i, const char **s, size_t *len);
/* Pointer to the raw elements of a numeric array (little-endian, packed; may be unaligned, so
 * read elements with memcpy). NULL for absent keys, non-arrays and string/nested arrays. */
const void *gguf_get_arr_data(const gguf_t *g, const char *key);

/* ---- tensors ----
 * gguf_open checks every tensor's data against the file: a type ggml does not define is
 * KV_EUNSUPPORTED; ne[0] not a multiple of the type's block size, or data running past the end
 * of the file, is KV_EFORMAT naming the tensor. nbytes is exact for the type
 * (kv_qtype_row_bytes(type, ne[0]) * rows for the supported types). */
struct gguf_tensor {
    const char *name;    /* borrowed, NUL-terminated copy */
    int n_dims;
    uint64_t ne[4];      /* ne[0] is the fastest-varying (row length) */
    uint32_t type;       /* ggml type number (enum ggml_dtype / enum kv_qtype when supported) */
    const void *data;    /* borrowed pointer into the mapping */
    uint64_t nbytes;
};
int gguf_n_tensors(const gguf_t *g);
const struct gguf_tensor *gguf_tensor_at(const gguf_t *g, int i);
const struct gguf_tensor *gguf_find_tensor(const gguf_t *g, const char *name);
/* Converts a tensor of any type kv_qtype_supported accepts (F32, F16, BF16, Q8_0, Q4_0, Q4_K,
 * Q5_K, Q6_K) to n_elems f32 values in dst (n_elems floats), through kv_dequant_row: bitwise
 * what llama.cpp's dequantization gives. KV_EUNSUPPORTED for other types (the message names the
 * tensor, the type and the supported set), KV_EFORMAT if n_elems is not the tensor's element
 * count; dst is untouched on error. */
kv_status gguf_tensor_to_f32(const struct gguf_tensor *t, float *dst, uint64_t n_elems, char *err,
                             size_t errlen);
/* "Q4_K", "Q2_K", ... for any ggml type number; "unknown" otherwise (= kv_qtype_name). */
const char *ggml_dtype_name(uint32_t type);

/* ---- writer (all in memory, then one write) ---- */
typedef struct gguf_writer gguf_writer_t;
gguf_writer_t *gguf_writer_new(void);
void gguf_writer_free(gguf_writer_t *w);
kv_status gguf_w_str(gguf_writer_t *w, const char *key, const char *val);
kv_status gguf_w_u32(gguf_writer_t *w, const char *key, uint32_t val);
kv_status gguf_w_i32(gguf_writer_t *w, const char *key, int32_t val);
kv_status gguf_w_f32(gguf_writer_t *w, const char *key, float val);
kv_status gguf_w_bool(gguf_writer_t *w, const char *key, bool val);
kv_status gguf_w_arr_str(gguf_writer_t *w, const char *key, const char *const *vals, uint64_t n);
kv_status gguf_w_arr_f32(gguf_writer_t *w, const char *key, const float *vals, uint64_t n);
kv_status gguf_w_arr_i32(gguf_writer_t *w, const char *key, const int32_t *vals, uint64_t n);
/* F32 tensor, shape ne[0..n_dims) with ne[0] fastest; data is copied. */
kv_status gguf_w_tensor_f32(gguf_writer_t *w, const char *name, int n_dims, const uint64_t *ne,
                            const float *data);
/* Tensor of any ggml type with raw, already-encoded bytes (nbytes must match the type's
 * block layout; e.g. Q8_0: ne[0] % 32 == 0, 34 bytes per block). Data is copied. For tests
 * and converters. */
kv_status gguf_w_tensor_raw(gguf_writer_t *w, const char *name, int n_dims, const uint64_t *ne, uint32_t type,
                            const void *data, uint64_t nbytes);
/* Writes the GGUF v3 file (alignment 32; a later key set twice keeps the last value).
 * KV_EIO on write failure. */
kv_status gguf_writer_save(gguf_writer_t *w, const char *path, char *err, size_t errlen);

#endif
