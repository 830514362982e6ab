/* gguf: GGUF v2/v3 reader (mmap, fully bounds-checked) and in-memory writer. */
#include "gguf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- ggml type table (block size in elements, bytes per block): the types kvserve computes
 * with are sized by kv_qtype_row_bytes (src/quant); this table sizes the others, so a file
 * holding them still opens and a conversion names the type. ---- */
struct ggml_type_info {
    const char *name;
    uint32_t blck;
    uint32_t size;
};
static const struct ggml_type_info k_types[] = {
    [0] = {"F32", 1, 4},        [1] = {"F16", 1, 2},         [2] = {"Q4_0", 32, 18},
    [3] = {"Q4_1", 32, 20},     [6] = {"Q5_0", 32, 22},      [7] = {"Q5_1", 32, 24},
    [8] = {"Q8_0", 32, 34},     [9] = {"Q8_1", 32, 36},      [10] = {"Q2_K", 256, 84},
    [11] = {"Q3_K", 256, 110},  [12] = {"Q4_K", 256, 144},   [13] = {"Q5_K", 256, 176},
    [14] = {"Q6_K", 256, 210},  [15] = {"Q8_K", 256, 292},   [16] = {"IQ2_XXS", 256, 66},
    [17] = {"IQ2_XS", 256, 74}, [18] = {"IQ3_XXS", 256, 98}, [19] = {"IQ1_S", 256, 50},
    [20] = {"IQ4_NL", 32, 18},  [21] = {"IQ3_S", 256, 110},  [22] = {"IQ2_S", 256, 82},
    [23] = {"IQ4_XS", 256, 136}, [24] = {"I8", 1, 1},        [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},       [27] = {"I64", 1, 8},        [28] = {"F64", 1, 8},
    [29] = {"IQ1_M", 256, 56},  [30] = {"BF16", 1, 2},       [34] = {"TQ1_0", 256, 54},
    [35] = {"TQ2_0", 256, 66},  [39] = {"MXFP4", 32, 17},    [40] = {"NVFP4", 64, 36},
};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

static const struct ggml_type_info *type_info(uint32_t t) {
    if (t >= N_TYPES || !k_types[t].name) return NULL;
    return &k_types[t];
}

const char *ggml_dtype_name(uint32_t type) { return type > INT32_MAX ? "unknown" : kv_qtype_name((int)type); }

/* The supported set, for error messages. */
#define SUPPORTED_TYPES "F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K"

/* ---- reader ---- */
struct gguf_kv {
    char *key;              /* owned, NUL-terminated */
    enum gguf_type type;
    size_t off;             /* offset of the value payload in the map */
    /* strings: len; arrays: element type/count, data offset, string offsets */
    uint64_t len;
    enum gguf_type elem_type;
    uint64_t n;
    uint64_t *str_offs;     /* owned; string arrays only: offset of each u64 length prefix */
};

struct gguf {
    kv_mmap_t map;
    char *path;
    uint32_t version;
    int n_kv;
    struct gguf_kv *kv;
    int n_tensors;
    struct gguf_tensor *tensors;
    char **tensor_names;
    uint32_t alignment;
    size_t data_off;
};

struct cursor {
    const uint8_t *p;
    size_t size;
    size_t off;
};

static bool cur_need(const struct cursor *c, uint64_t n) { return n <= c->size - c->off; }
static bool cur_u32(struct cursor *c, uint32_t *v) {
    if (!cur_need(c, 4)) return false;
    memcpy(v, c->p + c->off, 4);
    c->off += 4;
    return true;
}
static bool cur_u64(struct cursor *c, uint64_t *v) {
    if (!cur_need(c, 8)) return false;
    memcpy(v, c->p + c->off, 8);
    c->off += 8;
    return true;
}
/* string: u64 length + bytes; returns offset of the bytes */
static bool cur_str(struct cursor *c, size_t *soff, uint64_t *len) {
    if (!cur_u64(c, len)) return false;
    if (!cur_need(c, *len)) return false;
    *soff = c->off;
    c->off += (size_t)*len;
    return true;
}

static size_t scalar_size(enum gguf_type t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

/* Skips a value of type t (for nested arrays); depth-limited. */
static bool skip_value(struct cursor *c, uint32_t t, int depth) {
    if (depth > 4) return false;
    size_t ss = scalar_size((enum gguf_type)t);
    if (ss) {
        if (!cur_need(c, ss)) return false;
        c->off += ss;
        return true;
    }
    if (t == GGUF_TYPE_STRING) {
        size_t so;
        uint64_t l;
        return cur_str(c, &so, &l);
    }
    if (t == GGUF_TYPE_ARRAY) {
        uint32_t et;
        uint64_t n;
        if (!cur_u32(c, &et) || !cur_u64(c, &n)) return false;
        size_t es = scalar_size((enum gguf_type)et);
        if (es) {
            if (n > (c->size - c->off) / es) return false;
            c->off += (size_t)(n * es);
            return true;
        }
        if (et != GGUF_TYPE_STRING && et != GGUF_TYPE_ARRAY) return false;
        for (uint64_t i = 0; i < n; i++)
            if (!skip_value(c, et, depth + 1)) return false;
        return true;
    }
    return false;
}

void gguf_close(gguf_t *g) {
    if (!g) return;
    for (int i = 0; i < g->n_kv; i++) {
        free(g->kv[i].key);
        free(g->kv[i].str_offs);
    }
    free(g->kv);
    if (g->tensor_names)
        for (int i = 0; i < g->n_tensors; i++) free(g->tensor_names[i]);
    free(g->tensor_names);
    free(g->tensors);
    free(g->path);
    kv_munmap(&g->map);
    free(g);
}

#define FAIL(st, ...) do { rc = kv_errf((st), err, errlen, __VA_ARGS__); goto fail; } while (0)

struct off_ix {
    uint64_t off, nbytes;
    uint32_t ix;
};
static int cmp_off_ix(const void *a, const void *b) {
    const struct off_ix *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off;
}

kv_status gguf_open(const char *path, gguf_t **out, char *err, size_t errlen) {
    kv_status rc;
    uint64_t *offs = NULL; /* tensor data offsets, relative to the data section */
    gguf_t *g = kv_calloc(1, sizeof *g);
    if (!g) return kv_errf(KV_ENOMEM, err, errlen, "%s: out of memory", path);
    rc = kv_mmap_file(path, &g->map, err, errlen);
    if (rc) {
        free(g);
        return rc;
    }
    g->path = kv_strdup(path);
    if (!g->path) FAIL(KV_ENOMEM, "%s: out of memory", path);
    struct cursor c = {g->map.data, g->map.size, 0};
    uint32_t magic;
    if (!cur_u32(&c, &magic) || memcmp(&magic, "GGUF", 4) != 0)
        FAIL(KV_EFORMAT, "%s: not a GGUF file (bad magic)", path);
    if (!cur_u32(&c, &g->version)) FAIL(KV_EFORMAT, "%s: truncated header", path);
    if (g->version != 2 && g->version != 3)
        FAIL(g->version == 1 ? KV_EUNSUPPORTED : KV_EFORMAT, "%s: unsupported GGUF version %u", path,
             g->version);
    uint64_t n_tensors, n_kv;
    if (!cur_u64(&c, &n_tensors) || !cur_u64(&c, &n_kv)) FAIL(KV_EFORMAT, "%s: truncated header", path);
    /* every kv is at least 8+4+1 bytes and every tensor info at least 8+4+8+4+8 */
    if (n_kv > (c.size - c.off) / 13 || n_kv > 1000000)
        FAIL(KV_EFORMAT, "%s: metadata count %llu exceeds the file size", path, (unsigned long long)n_kv);
    if (n_tensors > (c.size - c.off) / 32 || n_tensors > 1000000)
        FAIL(KV_EFORMAT, "%s: tensor count %llu exceeds the file size", path,
             (unsigned long long)n_tensors);
    g->kv = kv_calloc(n_kv ? n_kv : 1, sizeof *g->kv);
    if (!g->kv) FAIL(KV_ENOMEM, "%s: out of memory", path);
    g->alignment = 32;
    for (uint64_t i = 0; i < n_kv; i++) {
        struct gguf_kv *kv = &g->kv[i];
        size_t koff;
        uint64_t klen;
        if (!cur_str(&c, &koff, &klen)) FAIL(KV_EFORMAT, "%s: truncated metadata key #%llu", path, (unsigned long long)i);
        kv->key = kv_strndup((const char *)c.p + koff, (size_t)klen);
        if (!kv->key) FAIL(KV_ENOMEM, "%s: out of memory", path);
        g->n_kv = (int)i + 1;
        uint32_t t;
        if (!cur_u32(&c, &t)) FAIL(KV_EFORMAT, "%s: truncated metadata value for %s", path, kv->key);
        kv->type = (enum gguf_type)t;
        size_t ss = scalar_size(kv->type);
        if (ss) {
            if (!cur_need(&c, ss)) FAIL(KV_EFORMAT, "%s: truncated metadata value for %s", path, kv->key);
            kv->off = c.off;
            c.off += ss;
        } else if (t == GGUF_TYPE_STRING) {
            if (!cur_str(&c, &kv->off, &kv->len))
                FAIL(KV_EFORMAT, "%s: truncated string value for %s", path, kv->key);
        } else if (t == GGUF_TYPE_ARRAY) {
            uint32_t et;
            if (!cur_u32(&c, &et) || !cur_u64(&c, &kv->n))
                FAIL(KV_EFORMAT, "%s: truncated array header for %s", path, kv->key);
            kv->elem_type = (enum gguf_type)et;
            kv->off = c.off;
            size_t es = scalar_size(kv->elem_type);
            if (es) {
                if (kv->n > (c.size - c.off) / es)
                    FAIL(KV_EFORMAT, "%s: array %s (%llu elements) exceeds the file size", path, kv->key,
                         (unsigned long long)kv->n);
                c.off += (size_t)(kv->n * es);
            } else if (et == GGUF_TYPE_STRING) {
                if (kv->n > (c.size - c.off) / 8)
                    FAIL(KV_EFORMAT, "%s: array %s (%llu strings) exceeds the file size", path, kv->key,
                         (unsigned long long)kv->n);
                kv->str_offs = kv_malloc((kv->n ? kv->n : 1) * sizeof *kv->str_offs);
                if (!kv->str_offs) FAIL(KV_ENOMEM, "%s: out of memory", path);
                for (uint64_t j = 0; j < kv->n; j++) {
                    kv->str_offs[j] = c.off;
                    size_t so;
                    uint64_t sl;
                    if (!cur_str(&c, &so, &sl))
                        FAIL(KV_EFORMAT, "%s: truncated string %llu of array %s", path, (unsigned long long)j,
                             kv->key);
                }
            } else if (et == GGUF_TYPE_ARRAY) {
                for (uint64_t j = 0; j < kv->n; j++)
                    if (!skip_value(&c, et, 1))
                        FAIL(KV_EFORMAT, "%s: malformed nested array %s", path, kv->key);
            } else {
                FAIL(KV_EFORMAT, "%s: array %s has invalid element type %u", path, kv->key, et);
            }
        } else {
            FAIL(KV_EFORMAT, "%s: metadata %s has invalid type %u", path, kv->key, t);
        }
        if (strcmp(kv->key, "general.alignment") == 0) {
            uint32_t a = 0;
            if (kv->type != GGUF_TYPE_UINT32) FAIL(KV_EFORMAT, "%s: general.alignment is not a uint32", path);
            memcpy(&a, c.p + kv->off, 4);
            if (a == 0 || (a & (a - 1)) || a > (1u << 20))
                FAIL(KV_EFORMAT, "%s: invalid general.alignment %u", path, a);
            g->alignment = a;
        }
    }
    g->tensors = kv_calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    g->tensor_names = kv_calloc(n_tensors ? n_tensors : 1, sizeof *g->tensor_names);
    if (!g->tensors || !g->tensor_names) FAIL(KV_ENOMEM, "%s: out of memory", path);
    offs = kv_calloc(n_tensors ? n_tensors : 1, sizeof *offs);
    if (!offs) FAIL(KV_ENOMEM, "%s: out of memory", path);
    for (uint64_t i = 0; i < n_tensors; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        size_t noff;
        uint64_t nlen;
        if (!cur_str(&c, &noff, &nlen)) {
            FAIL(KV_EFORMAT, "%s: truncated tensor info #%llu", path, (unsigned long long)i);
        }
        g->tensor_names[i] = kv_strndup((const char *)c.p + noff, (size_t)nlen);
        g->n_tensors = (int)i + 1;
        if (!g->tensor_names[i]) {
            FAIL(KV_ENOMEM, "%s: out of memory", path);
        }
        t->name = g->tensor_names[i];
        uint32_t nd;
        if (!cur_u32(&c, &nd)) {
            FAIL(KV_EFORMAT, "%s: truncated tensor info for %s", path, t->name);
        }
        if (nd < 1 || nd > 4) {
            FAIL(KV_EFORMAT, "%s: tensor %s has %u dimensions (1..4 allowed)", path, t->name, nd);
        }
        t->n_dims = (int)nd;
        uint64_t nelem = 1;
        for (int d = 0; d < 4; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < nd; d++) {
            if (!cur_u64(&c, &t->ne[d])) {
                FAIL(KV_EFORMAT, "%s: truncated tensor info for %s", path, t->name);
            }
            if (t->ne[d] == 0 || t->ne[d] > (1ull << 40) || nelem > (1ull << 48) / t->ne[d]) {
                FAIL(KV_EFORMAT, "%s: tensor %s has invalid dimension ne[%u]=%llu", path, t->name, d,
                     (unsigned long long)t->ne[d]);
            }
            nelem *= t->ne[d];
        }
        if (!cur_u32(&c, &t->type) || !cur_u64(&c, &offs[i])) {
            FAIL(KV_EFORMAT, "%s: truncated tensor info for %s", path, t->name);
        }
        const struct ggml_type_info *ti = type_info(t->type);
        if (!ti) {
            FAIL(KV_EUNSUPPORTED, "%s: tensor %s has unknown ggml type %u", path, t->name, t->type);
        }
        if (t->ne[0] % ti->blck) {
            FAIL(KV_EFORMAT, "%s: tensor %s row length %llu is not a multiple of the %s block size %u", path,
                 t->name, (unsigned long long)t->ne[0], ti->name, ti->blck);
        }
        if (kv_qtype_supported((int)t->type)) { /* the block table of the kernels */
            size_t rb = kv_qtype_row_bytes((int)t->type, (int64_t)t->ne[0]);
            uint64_t rows = nelem / t->ne[0];
            if (rb == 0 || rows > UINT64_MAX / rb) {
                FAIL(KV_EFORMAT, "%s: tensor %s of type %s has an invalid size", path, t->name, ti->name);
            }
            t->nbytes = (uint64_t)rb * rows;
        } else {
            t->nbytes = nelem / ti->blck * ti->size;
        }
        for (uint64_t j = 0; j < i; j++)
            if (strcmp(g->tensor_names[j], t->name) == 0) {
                FAIL(KV_EFORMAT, "%s: duplicate tensor %s", path, t->name);
            }
    }
    size_t data_off = c.off;
    if (data_off % g->alignment) data_off += g->alignment - data_off % g->alignment;
    if (n_tensors > 0 && data_off > c.size) {
        FAIL(KV_EFORMAT, "%s: truncated before tensor data", path);
    }
    g->data_off = data_off;
    size_t data_size = data_off <= c.size ? c.size - data_off : 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        if (offs[i] % g->alignment) {
            FAIL(KV_EFORMAT, "%s: tensor %s data offset %llu is not aligned to %u", path, t->name,
                 (unsigned long long)offs[i], g->alignment);
        }
        if (offs[i] > data_size || t->nbytes > data_size - offs[i]) {
            FAIL(KV_EFORMAT, "%s: tensor %s data [%llu, +%llu) extends past the end of the file (%llu data bytes)",
                 path, t->name, (unsigned long long)offs[i], (unsigned long long)t->nbytes,
                 (unsigned long long)data_size);
        }
        t->data = c.p + data_off + offs[i];
    }
    /* No two tensors may share bytes (llama.cpp requires them back to back): a relabelled type
     * or an aliasing offset would otherwise be served as garbage. */
    if (n_tensors > 1) {
        struct off_ix *ox = kv_malloc((size_t)n_tensors * sizeof *ox);
        if (!ox) FAIL(KV_ENOMEM, "%s: out of memory", path);
        for (uint64_t i = 0; i < n_tensors; i++) ox[i] = (struct off_ix){offs[i], g->tensors[i].nbytes, (uint32_t)i};
        qsort(ox, (size_t)n_tensors, sizeof *ox, cmp_off_ix);
        for (uint64_t i = 1; i < n_tensors; i++)
            if (ox[i - 1].nbytes && ox[i].nbytes && ox[i - 1].off + ox[i - 1].nbytes > ox[i].off) {
                const char *a = g->tensors[ox[i - 1].ix].name, *b = g->tensors[ox[i].ix].name;
                free(ox);
                FAIL(KV_EFORMAT, "%s: tensor %s data overlaps tensor %s (wrong type, shape or offset)", path, a, b);
            }
        free(ox);
    }
    free(offs);
    *out = g;
    return KV_OK;
fail:
    free(offs);
    gguf_close(g);
    return rc;
}

uint32_t gguf_version(const gguf_t *g) { return g->version; }
const char *gguf_path(const gguf_t *g) { return g->path; }
bool gguf_in_map(const gguf_t *g, const void *p, size_t n) {
    if (!g || !g->map.data || !p) return false;
    uintptr_t a = (uintptr_t)g->map.data, x = (uintptr_t)p;
    return x >= a && x - a <= g->map.size && n <= g->map.size - (x - a);
}
int gguf_n_keys(const gguf_t *g) { return g->n_kv; }
const char *gguf_key_name(const gguf_t *g, int i) { return i >= 0 && i < g->n_kv ? g->kv[i].key : NULL; }
enum gguf_type gguf_key_type(const gguf_t *g, int i) {
    return i >= 0 && i < g->n_kv ? g->kv[i].type : (enum gguf_type)-1;
}
int gguf_find_key(const gguf_t *g, const char *key) {
    for (int i = 0; i < g->n_kv; i++)
        if (strcmp(g->kv[i].key, key) == 0) return i;
    return -1;
}
static const struct gguf_kv *find_kv(const gguf_t *g, const char *key) {
    int i = gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i];
}
static const uint8_t *kv_ptr(const gguf_t *g, const struct gguf_kv *kv) {
    return (const uint8_t *)g->map.data + kv->off;
}

static bool read_int(const uint8_t *p, enum gguf_type t, int64_t *out) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_BOOL: *out = *p; return true;
    case GGUF_TYPE_INT8: *out = (int8_t)*p; return true;
    case GGUF_TYPE_UINT16: { uint16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case GGUF_TYPE_INT16: { int16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case GGUF_TYPE_UINT32: { uint32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case GGUF_TYPE_INT32: { int32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case GGUF_TYPE_UINT64: { uint64_t v; memcpy(&v, p, 8); if (v > INT64_MAX) return false; *out = (int64_t)v; return true; }
    case GGUF_TYPE_INT64: { int64_t v; memcpy(&v, p, 8); *out = v; return true; }
    default: return false;
    }
}

bool gguf_get_int(const gguf_t *g, const char *key, int64_t *out) {
    const struct gguf_kv *kv = find_kv(g, key);
    return kv && read_int(kv_ptr(g, kv), kv->type, out);
}
bool gguf_get_float(const gguf_t *g, const char *key, double *out) {
    const struct gguf_kv *kv = find_kv(g, key);
    if (!kv) return false;
    if (kv->type == GGUF_TYPE_FLOAT32) {
        float f;
        memcpy(&f, kv_ptr(g, kv), 4);
        *out = f;
        return true;
    }
    if (kv->type == GGUF_TYPE_FLOAT64) {
        memcpy(out, kv_ptr(g, kv), 8);
        return true;
    }
    int64_t v;
    if (kv->type != GGUF_TYPE_BOOL && read_int(kv_ptr(g, kv), kv->type, &v)) {
        *out = (double)v;
        return true;
    }
    return false;
}
bool gguf_get_bool(const gguf_t *g, const char *key, bool *out) {
    const struct gguf_kv *kv = find_kv(g, key);
    if (!kv || kv->type != GGUF_TYPE_BOOL) return false;
    *out = *kv_ptr(g, kv) != 0;
    return true;
}
bool gguf_get_str(const gguf_t *g, const char *key, const char **s, size_t *len) {
    const struct gguf_kv *kv = find_kv(g, key);
    if (!kv || kv->type != GGUF_TYPE_STRING) return false;
    *s = (const char *)kv_ptr(g, kv);
    *len = (size_t)kv->len;
    return true;
}
bool gguf_get_arr_info(const gguf_t *g, const char *key, enum gguf_type *elem_type, uint64_t *n) {
    const struct gguf_kv *kv = find_kv(g, key);
    if (!kv || kv->type != GGUF_TYPE_ARRAY) return false;
    if (elem_type) *elem_type = kv->elem_type;
    if (n) *n = kv->n;
    return true;
}
bool gguf_get_arr_str(const gguf_t *g, const char *key, uint64_t i, const char **s, size_t *len) {
    const struct gguf_kv *kv = find_kv(g, key);
    if (!kv || kv->type != GGUF_TYPE_ARRAY || kv->elem_type != GGUF_TYPE_STRING || i >= kv->n) return false;
    const uint8_t *p = (const uint8_t *)g->map.data + kv->str_offs[i];
    uint64_t l;
    memcpy(&l, p, 8);
    *s = (const char *)p + 8;
    *len = (size_t)l;
    return true;
}
const void *gguf_get_arr_data(const gguf_t *g, const char *key) {
    const struct gguf_kv *kv = find_kv(g, key);
    if (!kv || kv->type != GGUF_TYPE_ARRAY || !scalar_size(kv->elem_type)) return NULL;
    return kv_ptr(g, kv);
}

int gguf_n_tensors(const gguf_t *g) { return g->n_tensors; }
const struct gguf_tensor *gguf_tensor_at(const gguf_t *g, int i) {
    return i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}
const struct gguf_tensor *gguf_find_tensor(const gguf_t *g, const char *name) {
    for (int i = 0; i < g->n_tensors; i++)
        if (strcmp(g->tensors[i].name, name) == 0) return &g->tensors[i];
    return NULL;
}

kv_status gguf_tensor_to_f32(const struct gguf_tensor *t, float *dst, uint64_t n_elems, char *err,
                             size_t errlen) {
    uint64_t n = 1;
    for (int d = 0; d < t->n_dims; d++) n *= t->ne[d];
    if (n != n_elems)
        return kv_errf(KV_EFORMAT, err, errlen, "tensor %s has %llu elements, expected %llu", t->name,
                       (unsigned long long)n, (unsigned long long)n_elems);
    if (t->type > INT32_MAX || !kv_qtype_supported((int)t->type))
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "tensor %s has unsupported type %s (%u); supported: " SUPPORTED_TYPES,
                       t->name, ggml_dtype_name(t->type), t->type);
    /* gguf_open checked ne[0] against the block size and nbytes against the file */
    kv_dequant_row((int)t->type, t->data, dst, (int64_t)n);
    return KV_OK;
}

/* ---- writer ---- */
struct w_kv {
    char *key;
    kv_buf val; /* u32 type + payload */
};
struct w_tensor {
    char *name;
    int n_dims;
    uint64_t ne[4];
    uint32_t type;
    void *data;
    uint64_t nbytes;
};
struct gguf_writer {
    struct w_kv *kv;
    int n_kv, cap_kv;
    struct w_tensor *t;
    int n_t, cap_t;
};

gguf_writer_t *gguf_writer_new(void) { return kv_calloc(1, sizeof(gguf_writer_t)); }

void gguf_writer_free(gguf_writer_t *w) {
    if (!w) return;
    for (int i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        kv_buf_free(&w->kv[i].val);
    }
    free(w->kv);
    for (int i = 0; i < w->n_t; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->t);
    free(w);
}

/* Returns the (emptied) value buffer for key, replacing any earlier value. */
static kv_buf *w_slot(gguf_writer_t *w, const char *key) {
    for (int i = 0; i < w->n_kv; i++)
        if (strcmp(w->kv[i].key, key) == 0) {
            w->kv[i].val.len = 0;
            return &w->kv[i].val;
        }
    if (w->n_kv == w->cap_kv) {
        int nc = w->cap_kv ? w->cap_kv * 2 : 32;
        struct w_kv *nk = kv_realloc(w->kv, (size_t)nc * sizeof *nk);
        if (!nk) return NULL;
        w->kv = nk;
        w->cap_kv = nc;
    }
    struct w_kv *e = &w->kv[w->n_kv];
    e->key = kv_strdup(key);
    if (!e->key) return NULL;
    kv_buf_init(&e->val);
    w->n_kv++;
    return &e->val;
}

static kv_status put_u32(kv_buf *b, uint32_t v) { return kv_buf_append(b, &v, 4); }
static kv_status put_u64(kv_buf *b, uint64_t v) { return kv_buf_append(b, &v, 8); }
static kv_status put_str(kv_buf *b, const char *s) {
    size_t n = strlen(s);
    kv_status rc = put_u64(b, n);
    return rc ? rc : kv_buf_append(b, s, n);
}

static kv_status w_scalar(gguf_writer_t *w, const char *key, enum gguf_type t, const void *v, size_t n) {
    if (!w || !key) return KV_EINVAL;
    kv_buf *b = w_slot(w, key);
    if (!b) return KV_ENOMEM;
    kv_status rc = put_u32(b, t);
    return rc ? rc : kv_buf_append(b, v, n);
}
kv_status gguf_w_u32(gguf_writer_t *w, const char *key, uint32_t val) {
    return w_scalar(w, key, GGUF_TYPE_UINT32, &val, 4);
}
kv_status gguf_w_i32(gguf_writer_t *w, const char *key, int32_t val) {
    return w_scalar(w, key, GGUF_TYPE_INT32, &val, 4);
}
kv_status gguf_w_f32(gguf_writer_t *w, const char *key, float val) {
    return w_scalar(w, key, GGUF_TYPE_FLOAT32, &val, 4);
}
kv_status gguf_w_bool(gguf_writer_t *w, const char *key, bool val) {
    uint8_t v = val ? 1 : 0;
    return w_scalar(w, key, GGUF_TYPE_BOOL, &v, 1);
}
kv_status gguf_w_str(gguf_writer_t *w, const char *key, const char *val) {
    if (!w || !key || !val) return KV_EINVAL;
    kv_buf *b = w_slot(w, key);
    if (!b) return KV_ENOMEM;
    kv_status rc = put_u32(b, GGUF_TYPE_STRING);
    return rc ? rc : put_str(b, val);
}
static kv_status w_arr(gguf_writer_t *w, const char *key, enum gguf_type et, const void *vals, uint64_t n,
                       size_t es) {
    if (!w || !key || (n && !vals)) return KV_EINVAL;
    kv_buf *b = w_slot(w, key);
    if (!b) return KV_ENOMEM;
    kv_status rc = put_u32(b, GGUF_TYPE_ARRAY);
    if (!rc) rc = put_u32(b, et);
    if (!rc) rc = put_u64(b, n);
    if (!rc && n) rc = kv_buf_append(b, vals, (size_t)n * es);
    return rc;
}
kv_status gguf_w_arr_f32(gguf_writer_t *w, const char *key, const float *vals, uint64_t n) {
    return w_arr(w, key, GGUF_TYPE_FLOAT32, vals, n, 4);
}
kv_status gguf_w_arr_i32(gguf_writer_t *w, const char *key, const int32_t *vals, uint64_t n) {
    return w_arr(w, key, GGUF_TYPE_INT32, vals, n, 4);
}
kv_status gguf_w_arr_str(gguf_writer_t *w, const char *key, const char *const *vals, uint64_t n) {
    if (!w || !key || (n && !vals)) return KV_EINVAL;
    kv_buf *b = w_slot(w, key);
    if (!b) return KV_ENOMEM;
    kv_status rc = put_u32(b, GGUF_TYPE_ARRAY);
    if (!rc) rc = put_u32(b, GGUF_TYPE_STRING);
    if (!rc) rc = put_u64(b, n);
    for (uint64_t i = 0; !rc && i < n; i++) rc = put_str(b, vals[i]);
    return rc;
}

kv_status gguf_w_tensor_raw(gguf_writer_t *w, const char *name, int n_dims, const uint64_t *ne, uint32_t type,
                            const void *data, uint64_t nbytes) {
    if (!w || !name || n_dims < 1 || n_dims > 4 || !ne || (nbytes && !data)) return KV_EINVAL;
    if (w->n_t == w->cap_t) {
        int nc = w->cap_t ? w->cap_t * 2 : 64;
        struct w_tensor *nt = kv_realloc(w->t, (size_t)nc * sizeof *nt);
        if (!nt) return KV_ENOMEM;
        w->t = nt;
        w->cap_t = nc;
    }
    struct w_tensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    t->name = kv_strdup(name);
    t->data = kv_malloc(nbytes ? (size_t)nbytes : 1);
    if (!t->name || !t->data) {
        free(t->name);
        free(t->data);
        return KV_ENOMEM;
    }
    if (nbytes) memcpy(t->data, data, (size_t)nbytes);
    t->n_dims = n_dims;
    for (int d = 0; d < 4; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->type = type;
    t->nbytes = nbytes;
    w->n_t++;
    return KV_OK;
}

kv_status gguf_w_tensor_f32(gguf_writer_t *w, const char *name, int n_dims, const uint64_t *ne,
                            const float *data) {
    if (!ne || n_dims < 1 || n_dims > 4) return KV_EINVAL;
    uint64_t n = 1;
    for (int d = 0; d < n_dims; d++) n *= ne[d];
    return gguf_w_tensor_raw(w, name, n_dims, ne, GGML_F32, data, n * 4);
}

#define ALIGN 32
static uint64_t align_up(uint64_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

kv_status gguf_writer_save(gguf_writer_t *w, const char *path, char *err, size_t errlen) {
    if (!w || !path) return kv_errf(KV_EINVAL, err, errlen, "gguf_writer_save: invalid argument");
    kv_buf b;
    kv_buf_init(&b);
    kv_status rc = kv_buf_append(&b, "GGUF", 4);
    if (!rc) rc = put_u32(&b, 3);
    if (!rc) rc = put_u64(&b, (uint64_t)w->n_t);
    if (!rc) rc = put_u64(&b, (uint64_t)w->n_kv);
    for (int i = 0; !rc && i < w->n_kv; i++) {
        rc = put_str(&b, w->kv[i].key);
        if (!rc) rc = kv_buf_append(&b, w->kv[i].val.data, w->kv[i].val.len);
    }
    uint64_t off = 0;
    for (int i = 0; !rc && i < w->n_t; i++) {
        const struct w_tensor *t = &w->t[i];
        rc = put_str(&b, t->name);
        if (!rc) rc = put_u32(&b, (uint32_t)t->n_dims);
        for (int d = 0; !rc && d < t->n_dims; d++) rc = put_u64(&b, t->ne[d]);
        if (!rc) rc = put_u32(&b, t->type);
        if (!rc) rc = put_u64(&b, off);
        off = align_up(off + t->nbytes);
    }
    static const char zeros[ALIGN];
    if (!rc && b.len % ALIGN) rc = kv_buf_append(&b, zeros, ALIGN - b.len % ALIGN);
    if (rc) {
        kv_buf_free(&b);
        return kv_errf(KV_ENOMEM, err, errlen, "%s: out of memory building GGUF header", path);
    }
    FILE *f = fopen(path, "wb");
    if (!f) {
        kv_buf_free(&b);
        return kv_errf(KV_EIO, err, errlen, "%s: %s", path, strerror(errno));
    }
    bool ok = fwrite(b.data, 1, b.len, f) == b.len;
    kv_buf_free(&b);
    for (int i = 0; ok && i < w->n_t; i++) {
        const struct w_tensor *t = &w->t[i];
        ok = fwrite(t->data, 1, (size_t)t->nbytes, f) == t->nbytes;
        uint64_t pad = align_up(t->nbytes) - t->nbytes;
        if (ok && pad && i + 1 < w->n_t) ok = fwrite(zeros, 1, (size_t)pad, f) == pad;
    }
    if (fclose(f) != 0) ok = false;
    if (!ok) return kv_errf(KV_EIO, err, errlen, "%s: write failed: %s", path, strerror(errno));
    return KV_OK;
}
