/* page_table: pool views, their JSON form, receiver-side matching and copy runs (see header). */
#include "page_table.h"

#include <stdlib.h>
#include <string.h>

size_t kvx_dtype_size(int dtype) {
    switch (dtype) {
    case KVX_DTYPE_F32: return 4;
    case KVX_DTYPE_F16: case KVX_DTYPE_BF16: return 2;
    case KVX_DTYPE_U8: return 1;
    default: return 0;
    }
}

static const char *const DTYPES[] = {"f32", "f16", "bf16", "u8"};
static const char *const ROLES[] = {"kv", "indexer_k", "recurrent_state"};

const char *kvx_dtype_name(int d) { return d >= 0 && d < 4 ? DTYPES[d] : "?"; }
const char *kvx_role_name(int r) { return r >= 0 && r < 3 ? ROLES[r] : "?"; }

static int lookup(const char *s, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (s && !strcmp(s, names[i])) return i;
    return -1;
}

static int cmp_int(const void *x, const void *y) {
    int a = *(const int *)x, b = *(const int *)y;
    return (a > b) - (a < b);
}

/* True if a layer id appears twice in v (O(n log n); n <= 65536). */
static bool has_duplicate_layer(const struct kvx_pool_view *v) {
    int *ids = kv_malloc((size_t)v->n_entries * sizeof *ids);
    if (!ids) return true; /* refused (the caller reports it as malformed) */
    for (int i = 0; i < v->n_entries; i++) ids[i] = v->entries[i].layer;
    qsort(ids, (size_t)v->n_entries, sizeof *ids, cmp_int);
    bool dup = false;
    for (int i = 1; i < v->n_entries && !dup; i++) dup = ids[i] == ids[i - 1];
    free(ids);
    return dup;
}

kv_status kvx_page_table_add_view(struct kvx_page_table *pt, int role, int dtype, int tpb,
                                  int heads, int head_dim, int kv_factor, const int *layers,
                                  int n_layers, const bool *mask, int pool_rows, size_t pool_offset,
                                  char *err, size_t errlen) {
    size_t es = kvx_dtype_size(dtype);
    if (!pt || role < 0 || role > 2 || !es || tpb < 1 || heads < 1 || head_dim < 1 ||
        kv_factor < 1 || n_layers < 0 || (n_layers && !layers))
        return kv_errf(KV_EINVAL, err, errlen, "page table: invalid view (role %d, dtype %d, "
                       "T %d, heads %d, head_dim %d, kv_factor %d)", role, dtype, tpb, heads,
                       head_dim, kv_factor);
    int owning = 0;
    for (int i = 0; i < n_layers; i++) owning += !mask || mask[i];
    if (pool_rows >= 0 && pool_rows != owning)
        return kv_errf(KV_EINVAL, err, errlen, "page table: the pool has %d rows per block but "
                       "%d layers own one", pool_rows, owning);
    if (owning == 0) return KV_OK; /* spec §8: no view for a group without owners */
    if (pt->n_views >= KVX_MAX_VIEWS)
        return kv_errf(KV_EINVAL, err, errlen, "page table: more than %d views", KVX_MAX_VIEWS);
    struct kvx_pool_view v;
    memset(&v, 0, sizeof v);
    v.entries = kv_calloc((size_t)owning, sizeof *v.entries);
    if (!v.entries) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    size_t row = (size_t)kv_factor * (size_t)heads * (size_t)tpb * (size_t)head_dim * es;
    v.role = role;
    v.dtype = dtype;
    v.tokens_per_block = tpb;
    v.n_kv_heads = heads;
    v.head_dim = head_dim;
    v.kv_factor = kv_factor;
    v.pool_offset = pool_offset;
    v.block_bytes = row * (size_t)owning;
    for (int i = 0, r = 0; i < n_layers; i++) {
        if (mask && !mask[i]) continue; /* shared layer: no row, no entry */
        v.entries[r] = (struct kvx_layer_entry){layers[i], (size_t)r * row, row};
        r++;
    }
    v.n_entries = owning;
    if (has_duplicate_layer(&v)) {
        free(v.entries);
        return kv_errf(KV_EINVAL, err, errlen, "page table: a layer id appears twice in the view");
    }
    pt->views[pt->n_views++] = v;
    return KV_OK;
}

kv_status kvx_page_table_dense_kv(struct kvx_page_table *pt, int first_layer, int n_layers,
                                  int n_kv_heads, int head_dim, int tokens_per_block, int dtype,
                                  char *err, size_t errlen) {
    if (!pt) return KV_EINVAL;
    memset(pt, 0, sizeof *pt);
    if (n_layers < 1 || first_layer < 0)
        return kv_errf(KV_EINVAL, err, errlen, "page table: %d layers from %d", n_layers, first_layer);
    int *ids = kv_malloc((size_t)n_layers * sizeof *ids);
    if (!ids) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    for (int i = 0; i < n_layers; i++) ids[i] = first_layer + i;
    kv_status st = kvx_page_table_add_view(pt, KVX_ROLE_KV, dtype, tokens_per_block, n_kv_heads,
                                           head_dim, 2, ids, n_layers, NULL, -1, 0, err, errlen);
    free(ids);
    return st;
}

void kvx_page_table_free(struct kvx_page_table *pt) {
    if (!pt) return;
    for (int i = 0; i < pt->n_views; i++) free(pt->views[i].entries);
    memset(pt, 0, sizeof *pt);
}

kv_status kvx_page_table_copy(struct kvx_page_table *dst, const struct kvx_page_table *src) {
    memset(dst, 0, sizeof *dst);
    for (int i = 0; i < src->n_views; i++) {
        struct kvx_pool_view v = src->views[i];
        v.entries = kv_malloc((size_t)(v.n_entries ? v.n_entries : 1) * sizeof *v.entries);
        if (!v.entries) {
            kvx_page_table_free(dst);
            return KV_ENOMEM;
        }
        memcpy(v.entries, src->views[i].entries, (size_t)v.n_entries * sizeof *v.entries);
        dst->views[dst->n_views++] = v;
    }
    return KV_OK;
}

/* ---------------------------------------------------------------- JSON */

json_t *kvx_page_table_to_json(const struct kvx_page_table *pt) {
    json_t *views = json_array();
    if (!views) return NULL;
    for (int i = 0; i < pt->n_views; i++) {
        const struct kvx_pool_view *v = &pt->views[i];
        json_t *ents = json_array();
        for (int k = 0; k < v->n_entries && ents; k++)
            json_array_append_new(ents, json_pack("[i, I, I]", v->entries[k].layer,
                                                  (json_int_t)v->entries[k].offset,
                                                  (json_int_t)v->entries[k].bytes));
        json_t *o = json_pack("{s:s, s:s, s:i, s:i, s:i, s:i, s:I, s:I, s:o}", "role",
                              kvx_role_name(v->role), "dtype", kvx_dtype_name(v->dtype),
                              "tokens_per_block", v->tokens_per_block, "n_kv_heads", v->n_kv_heads,
                              "head_dim", v->head_dim, "kv_factor", v->kv_factor, "pool_offset",
                              (json_int_t)v->pool_offset, "block_bytes", (json_int_t)v->block_bytes,
                              "entries", ents ? ents : json_null());
        if (!o || json_array_append_new(views, o)) {
            json_decref(views);
            return NULL;
        }
    }
    return json_pack("{s:o}", "views", views);
}

static bool get_i64(const json_t *o, const char *k, int64_t lo, int64_t hi, int64_t *out) {
    json_t *v = json_object_get(o, k);
    if (!json_is_integer(v)) return false;
    int64_t x = json_integer_value(v);
    if (x < lo || x > hi) return false;
    *out = x;
    return true;
}

kv_status kvx_page_table_from_json(const json_t *j, struct kvx_page_table *pt, char *err,
                                   size_t errlen) {
    memset(pt, 0, sizeof *pt);
    json_t *views = json_object_get(j, "views");
    if (!json_is_array(views) || json_array_size(views) > KVX_MAX_VIEWS)
        return kv_errf(KV_EFORMAT, err, errlen, "page table: 'views' must be an array of at most %d",
                       KVX_MAX_VIEWS);
    size_t i;
    json_t *o;
    json_array_foreach(views, i, o) {
        struct kvx_pool_view *v = &pt->views[pt->n_views];
        int64_t x[7];
        json_t *role = json_object_get(o, "role"), *dt = json_object_get(o, "dtype");
        int r = lookup(json_string_value(role), ROLES, 3), d = lookup(json_string_value(dt), DTYPES, 4);
        const int64_t G = (int64_t)1 << 40;
        if (r < 0 || d < 0 || !get_i64(o, "tokens_per_block", 1, 1 << 20, &x[0]) ||
            !get_i64(o, "n_kv_heads", 1, 1 << 20, &x[1]) || !get_i64(o, "head_dim", 1, 1 << 20, &x[2]) ||
            !get_i64(o, "kv_factor", 1, 16, &x[3]) || !get_i64(o, "pool_offset", 0, G, &x[4]) ||
            !get_i64(o, "block_bytes", 1, G, &x[5])) {
            kvx_page_table_free(pt);
            return kv_errf(KV_EFORMAT, err, errlen, "page table: view %zu has a missing or bad "
                           "role/dtype/geometry field", i);
        }
        json_t *ents = json_object_get(o, "entries");
        size_t n = json_array_size(ents);
        if (!json_is_array(ents) || n == 0 || n > 65536) {
            kvx_page_table_free(pt);
            return kv_errf(KV_EFORMAT, err, errlen, "page table: view %zu needs 1..65536 entries", i);
        }
        v->entries = kv_calloc(n, sizeof *v->entries);
        if (!v->entries) {
            kvx_page_table_free(pt);
            return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        }
        pt->n_views++;
        v->role = r;
        v->dtype = d;
        v->tokens_per_block = (int)x[0];
        v->n_kv_heads = (int)x[1];
        v->head_dim = (int)x[2];
        v->kv_factor = (int)x[3];
        v->pool_offset = (size_t)x[4];
        v->block_bytes = (size_t)x[5];
        size_t end = 0;
        for (size_t k = 0; k < n; k++) {
            json_t *e = json_array_get(ents, k);
            json_t *a = json_array_get(e, 0), *b = json_array_get(e, 1), *c = json_array_get(e, 2);
            if (!json_is_array(e) || json_array_size(e) != 3 || !json_is_integer(a) ||
                !json_is_integer(b) || !json_is_integer(c) || json_integer_value(a) < 0 ||
                json_integer_value(a) > (1 << 24) || json_integer_value(b) < (json_int_t)end ||
                json_integer_value(b) > (json_int_t)v->block_bytes || json_integer_value(c) < 1 ||
                json_integer_value(c) > (json_int_t)v->block_bytes - json_integer_value(b)) {
                kvx_page_table_free(pt);
                return kv_errf(KV_EFORMAT, err, errlen, "page table: view %zu entry %zu is not "
                               "[layer, offset, bytes] inside the block, in ascending order", i, k);
            }
            v->entries[k] = (struct kvx_layer_entry){(int)json_integer_value(a),
                                                     (size_t)json_integer_value(b),
                                                     (size_t)json_integer_value(c)};
            end = v->entries[k].offset + v->entries[k].bytes;
        }
        v->n_entries = (int)n;
        if (has_duplicate_layer(v)) {
            kvx_page_table_free(pt);
            return kv_errf(KV_EFORMAT, err, errlen, "page table: view %zu lists a layer twice", i);
        }
    }
    return KV_OK;
}

/* ---------------------------------------------------------------- matching */

static const struct kvx_layer_entry *find_layer(const struct kvx_pool_view *v, int layer) {
    for (int i = 0; i < v->n_entries; i++)
        if (v->entries[i].layer == layer) return &v->entries[i];
    return NULL;
}

static int overlap(const struct kvx_pool_view *a, const struct kvx_pool_view *b) {
    int n = 0;
    for (int i = 0; i < a->n_entries; i++) n += find_layer(b, a->entries[i].layer) != NULL;
    return n;
}

static kv_status match(const struct kvx_page_table *local, const struct kvx_page_table *peer,
                       bool partial, struct kvx_map *out, int *n_layers, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (local->n_views != 1)
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "page table: %d local views (one is supported)",
                       local->n_views);
    const struct kvx_pool_view *l = &local->views[0], *p = NULL;
    for (int i = 0; i < peer->n_views && !p; i++)
        if (peer->views[i].role == l->role && overlap(l, &peer->views[i]) > 0) p = &peer->views[i];
    if (!p)
        return kv_errf(KV_EINVAL, err, errlen, "KV page tables do not match: the sender has no %s "
                       "pool holding any of the receiver's layers %d..%d", kvx_role_name(l->role),
                       l->entries[0].layer, l->entries[l->n_entries - 1].layer);
    if (p->dtype != l->dtype || p->tokens_per_block != l->tokens_per_block ||
        p->n_kv_heads != l->n_kv_heads || p->head_dim != l->head_dim || p->kv_factor != l->kv_factor)
        return kv_errf(KV_EINVAL, err, errlen, "KV page tables do not match: sender (context) %s, %d "
                       "tokens per block, %d kv heads x %d, kv_factor %d; receiver (generation) %s, %d, %d x %d, %d",
                       kvx_dtype_name(p->dtype), p->tokens_per_block, p->n_kv_heads, p->head_dim,
                       p->kv_factor, kvx_dtype_name(l->dtype), l->tokens_per_block,
                       l->n_kv_heads, l->head_dim, l->kv_factor);
    out->seg = kv_calloc((size_t)l->n_entries, sizeof *out->seg);
    if (!out->seg) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    out->src_block_bytes = p->block_bytes;
    out->dst_block_bytes = l->block_bytes;
    int n = 0;
    for (int i = 0; i < l->n_entries; i++) {
        const struct kvx_layer_entry *d = &l->entries[i], *s = find_layer(p, d->layer);
        if (!s) {
            if (partial) continue;
            kvx_map_free(out);
            return kv_errf(KV_EINVAL, err, errlen, "KV page tables do not match: the sender does "
                           "not hold layer %d", d->layer);
        }
        if (s->bytes != d->bytes) {
            kvx_map_free(out);
            return kv_errf(KV_EINVAL, err, errlen, "KV page tables do not match: layer %d has "
                           "%zu bytes per block at the sender, %zu at the receiver", d->layer, s->bytes, d->bytes);
        }
        struct kvx_segment sg = {p->pool_offset + s->offset, l->pool_offset + d->offset, d->bytes};
        if (n && out->seg[n - 1].src_off + out->seg[n - 1].len == sg.src_off &&
            out->seg[n - 1].dst_off + out->seg[n - 1].len == sg.dst_off)
            out->seg[n - 1].len += sg.len; /* adjacent layers on both sides: one segment */
        else
            out->seg[n++] = sg;
        if (n_layers) (*n_layers)++;
    }
    out->n_seg = n;
    out->whole_block = n == 1 && out->seg[0].len == p->block_bytes && p->block_bytes == l->block_bytes &&
                       out->seg[0].src_off == p->pool_offset && out->seg[0].dst_off == l->pool_offset;
    return KV_OK;
}

kv_status kvx_page_table_match(const struct kvx_page_table *local, const struct kvx_page_table *peer,
                               struct kvx_map *out, char *err, size_t errlen) {
    return match(local, peer, false, out, NULL, err, errlen);
}

kv_status kvx_page_table_match_partial(const struct kvx_page_table *local,
                                       const struct kvx_page_table *peer, struct kvx_map *out,
                                       int *n_layers, char *err, size_t errlen) {
    *n_layers = 0;
    return match(local, peer, true, out, n_layers, err, errlen);
}

void kvx_map_free(struct kvx_map *m) {
    if (!m) return;
    free(m->seg);
    memset(m, 0, sizeof *m);
}

size_t kvx_map_bytes_per_block(const struct kvx_map *m) {
    size_t n = 0;
    for (int i = 0; i < m->n_seg; i++) n += m->seg[i].len;
    return n;
}

kv_status kvx_map_runs(const struct kvx_map *m, const int32_t *src_blocks, const int32_t *dst_blocks,
                       int n, uint8_t *dst_base, struct kvx_run **runs, int *n_runs) {
    size_t cap = (size_t)(n > 0 ? n : 1) * (size_t)(m->n_seg > 0 ? m->n_seg : 1);
    struct kvx_run *r = kv_malloc(cap * sizeof *r);
    if (!r) return KV_ENOMEM;
    int k = 0;
    for (int b = 0; b < n; b++)
        for (int s = 0; s < m->n_seg; s++) {
            const struct kvx_segment *g = &m->seg[s];
            uint64_t so = (uint64_t)src_blocks[b] * m->src_block_bytes + g->src_off;
            uint8_t *d = dst_base + (size_t)dst_blocks[b] * m->dst_block_bytes + g->dst_off;
            if (k && r[k - 1].src_off + r[k - 1].len == so && r[k - 1].dst + r[k - 1].len == d)
                r[k - 1].len += g->len; /* contiguous on both sides (e.g. consecutive block ids) */
            else
                r[k++] = (struct kvx_run){so, d, g->len};
        }
    *runs = r;
    *n_runs = k;
    return KV_OK;
}
