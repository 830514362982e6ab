/* Page tables (src/transfer/page_table.h): dense and masked layouts (spec §8), split senders
 * with disjoint layer ranges, refused mismatches, JSON round trip and malformed JSON, runs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "transfer/page_table.h"

#define ROW(h, t, d, es) ((size_t)2 * (h) * (t) * (d) * (es))

static void test_dense_layout(void **st) {
    (void)st;
    struct kvx_page_table pt;
    char err[256];
    assert_int_equal(kvx_page_table_dense_kv(&pt, 0, 4, 2, 8, 16, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    assert_int_equal(pt.n_views, 1);
    const struct kvx_pool_view *v = &pt.views[0];
    size_t row = ROW(2, 16, 8, 4);
    assert_int_equal(v->n_entries, 4);
    assert_int_equal(v->block_bytes, 4 * row);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(v->entries[i].layer, i);
        assert_int_equal(v->entries[i].offset, (size_t)i * row);
        assert_int_equal(v->entries[i].bytes, row);
    }
    kvx_page_table_free(&pt);
    assert_int_equal(kvx_page_table_dense_kv(&pt, 0, 0, 2, 8, 16, KVX_DTYPE_F32, err, sizeof err), KV_EINVAL);
    assert_int_equal(kvx_page_table_dense_kv(&pt, 0, 2, 2, 8, 16, 99, err, sizeof err), KV_EINVAL);
}

/* Spec §8: mask [T,F,T,F] gives 2 entries (layers 0 and 2) at packed rows 0 and 1; no mask is
 * byte-identical to the dense layout; no owner -> no view; a row-count mismatch is an error. */
static void test_masked_pool(void **st) {
    (void)st;
    char err[256];
    int layers[4] = {0, 1, 2, 3};
    bool mask[4] = {true, false, true, false};
    struct kvx_page_table pt = {0};
    assert_int_equal(kvx_page_table_add_view(&pt, KVX_ROLE_INDEXER_K, KVX_DTYPE_U8, 64, 1, 128, 1,
                                             layers, 4, mask, 2, 0, err, sizeof err), KV_OK);
    assert_int_equal(pt.n_views, 1);
    const struct kvx_pool_view *v = &pt.views[0];
    size_t row = (size_t)1 * 1 * 64 * 128 * 1;
    assert_int_equal(v->n_entries, 2);
    assert_int_equal(v->entries[0].layer, 0);
    assert_int_equal(v->entries[0].offset, 0);
    assert_int_equal(v->entries[1].layer, 2);
    assert_int_equal(v->entries[1].offset, row);
    assert_int_equal(v->entries[1].bytes, row);
    assert_int_equal(v->block_bytes, 2 * row);
    /* the pool says 4 rows but only 2 layers own one */
    assert_int_equal(kvx_page_table_add_view(&pt, KVX_ROLE_INDEXER_K, KVX_DTYPE_U8, 64, 1, 128, 1,
                                             layers, 4, mask, 4, 0, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "rows"));
    assert_int_equal(pt.n_views, 1);
    bool none[4] = {false, false, false, false};
    assert_int_equal(kvx_page_table_add_view(&pt, KVX_ROLE_INDEXER_K, KVX_DTYPE_U8, 64, 1, 128, 1,
                                             layers, 4, none, -1, 0, err, sizeof err), KV_OK);
    assert_int_equal(pt.n_views, 1); /* no view for a group without owners */
    int twice[2] = {5, 5};
    assert_int_equal(kvx_page_table_add_view(&pt, KVX_ROLE_KV, KVX_DTYPE_U8, 64, 1, 128, 1, twice, 2,
                                             NULL, -1, 0, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "twice"));
    assert_int_equal(pt.n_views, 1);
    kvx_page_table_free(&pt);

    struct kvx_page_table a = {0}, b;
    assert_int_equal(kvx_page_table_add_view(&a, KVX_ROLE_KV, KVX_DTYPE_BF16, 16, 8, 128, 2, layers, 4,
                                             NULL, -1, 0, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_dense_kv(&b, 0, 4, 8, 128, 16, KVX_DTYPE_BF16, err, sizeof err), KV_OK);
    json_t *ja = kvx_page_table_to_json(&a), *jb = kvx_page_table_to_json(&b);
    char *sa = json_dumps(ja, JSON_SORT_KEYS), *sb = json_dumps(jb, JSON_SORT_KEYS);
    assert_string_equal(sa, sb);
    free(sa);
    free(sb);
    json_decref(ja);
    json_decref(jb);
    kvx_page_table_free(&a);
    kvx_page_table_free(&b);
}

/* A receiver holding layers 0..15 is filled by a sender with 0..7 and another with 8..15. */
static void test_split_senders(void **st) {
    (void)st;
    char err[256];
    struct kvx_page_table rx, s0, s1, s2;
    assert_int_equal(kvx_page_table_dense_kv(&rx, 0, 16, 2, 8, 16, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_dense_kv(&s0, 0, 8, 2, 8, 16, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_dense_kv(&s1, 8, 8, 2, 8, 16, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    size_t row = ROW(2, 16, 8, 4);
    struct kvx_map m0, m1;
    int n0, n1;
    assert_int_equal(kvx_page_table_match_partial(&rx, &s0, &m0, &n0, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_match_partial(&rx, &s1, &m1, &n1, err, sizeof err), KV_OK);
    assert_int_equal(n0 + n1, 16);
    /* adjacent layers merge into one segment each */
    assert_int_equal(m0.n_seg, 1);
    assert_int_equal(m1.n_seg, 1);
    assert_int_equal(m0.seg[0].src_off, 0);
    assert_int_equal(m0.seg[0].dst_off, 0);
    assert_int_equal(m0.seg[0].len, 8 * row);
    assert_int_equal(m1.seg[0].src_off, 0);        /* layer 8 is row 0 of the second sender */
    assert_int_equal(m1.seg[0].dst_off, 8 * row);  /* and row 8 of the receiver */
    assert_int_equal(kvx_map_bytes_per_block(&m0) + kvx_map_bytes_per_block(&m1), rx.views[0].block_bytes);
    assert_false(m0.whole_block);
    /* a full match needs every layer */
    struct kvx_map mf;
    assert_int_equal(kvx_page_table_match(&rx, &s0, &mf, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "layer 8"));
    /* disjoint ranges: nothing overlaps */
    assert_int_equal(kvx_page_table_dense_kv(&s2, 16, 8, 2, 8, 16, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_match_partial(&rx, &s2, &mf, &n0, err, sizeof err), KV_EINVAL);
    kvx_map_free(&m0);
    kvx_map_free(&m1);
    kvx_page_table_free(&rx);
    kvx_page_table_free(&s0);
    kvx_page_table_free(&s1);
    kvx_page_table_free(&s2);
}

static void test_mismatches_refused(void **st) {
    (void)st;
    char err[256];
    struct kvx_page_table a, b;
    struct kvx_map m;
    assert_int_equal(kvx_page_table_dense_kv(&a, 0, 4, 2, 8, 16, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_match(&a, &a, &m, err, sizeof err), KV_OK);
    assert_true(m.whole_block);
    kvx_map_free(&m);
    struct { int heads, dim, tpb, dtype; const char *what; } cases[] = {
        {2, 8, 16, KVX_DTYPE_BF16, "bf16"}, {2, 8, 32, KVX_DTYPE_F32, "32"},
        {4, 8, 16, KVX_DTYPE_F32, "4 kv heads"}, {2, 16, 16, KVX_DTYPE_F32, "x 16"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(kvx_page_table_dense_kv(&b, 0, 4, cases[i].heads, cases[i].dim, cases[i].tpb,
                                                 cases[i].dtype, err, sizeof err), KV_OK);
        err[0] = 0;
        assert_int_equal(kvx_page_table_match(&a, &b, &m, err, sizeof err), KV_EINVAL);
        if (!strstr(err, cases[i].what)) fail_msg("case %zu: '%s' lacks '%s'", i, err, cases[i].what);
        kvx_page_table_free(&b);
    }
    /* another role only */
    int layers[4] = {0, 1, 2, 3};
    struct kvx_page_table r = {0};
    assert_int_equal(kvx_page_table_add_view(&r, KVX_ROLE_INDEXER_K, KVX_DTYPE_F32, 16, 2, 8, 2,
                                             layers, 4, NULL, -1, 0, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_match(&a, &r, &m, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "kv pool"));
    kvx_page_table_free(&r);
    kvx_page_table_free(&a);
}

static void test_json(void **st) {
    (void)st;
    char err[256];
    struct kvx_page_table a, b;
    int layers[4] = {3, 5, 7, 9};
    bool mask[4] = {true, true, false, true};
    memset(&a, 0, sizeof a);
    assert_int_equal(kvx_page_table_add_view(&a, KVX_ROLE_KV, KVX_DTYPE_F16, 32, 4, 64, 2, layers, 4,
                                             mask, 3, 4096, err, sizeof err), KV_OK);
    json_t *j = kvx_page_table_to_json(&a);
    assert_non_null(j);
    assert_int_equal(kvx_page_table_from_json(j, &b, err, sizeof err), KV_OK);
    assert_int_equal(b.n_views, 1);
    assert_int_equal(b.views[0].dtype, KVX_DTYPE_F16);
    assert_int_equal(b.views[0].pool_offset, 4096);
    assert_int_equal(b.views[0].n_entries, 3);
    assert_int_equal(b.views[0].entries[2].layer, 9);
    assert_memory_equal(b.views[0].entries, a.views[0].entries, 3 * sizeof *a.views[0].entries);
    json_decref(j);
    kvx_page_table_free(&a);
    kvx_page_table_free(&b);
    const char *bad[] = {
        "{}", "{\"views\":5}", "{\"views\":[{}]}",
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f99\",\"tokens_per_block\":16,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[[0,0,1024]]}]}",
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f32\",\"tokens_per_block\":16,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[[0,0,2048]]}]}",
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f32\",\"tokens_per_block\":16,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[[0,512,512],[1,0,512]]}]}",
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f32\",\"tokens_per_block\":16,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[]}]}",
        /* layer 0 twice */
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f32\",\"tokens_per_block\":16,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[[0,0,512],[0,512,512]]}]}",
        /* offset + bytes would overflow int64 (must be refused, not undefined behaviour) */
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f32\",\"tokens_per_block\":16,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[[0,9223372036854775807,9223372036854775807]]}]}",
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f32\",\"tokens_per_block\":16,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[[0,512,9223372036854775807]]}]}",
        "{\"views\":[{\"role\":\"kv\",\"dtype\":\"f32\",\"tokens_per_block\":-1,\"n_kv_heads\":1,\"head_dim\":8,\"kv_factor\":2,\"pool_offset\":0,\"block_bytes\":1024,\"entries\":[[0,0,1]]}]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *o = json_loads(bad[i], 0, NULL);
        assert_non_null(o);
        if (kvx_page_table_from_json(o, &b, err, sizeof err) != KV_EFORMAT) fail_msg("bad JSON %zu accepted", i);
        assert_int_equal(b.n_views, 0);
        json_decref(o);
    }
}

/* Runs: consecutive blocks merge; the destination pointer follows the destination block ids. */
static void test_runs(void **st) {
    (void)st;
    char err[256];
    struct kvx_page_table a;
    struct kvx_map m;
    assert_int_equal(kvx_page_table_dense_kv(&a, 0, 2, 1, 4, 4, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    assert_int_equal(kvx_page_table_match(&a, &a, &m, err, sizeof err), KV_OK);
    size_t bb = a.views[0].block_bytes;
    uint8_t base[1];
    struct kvx_run *r;
    int n;
    int32_t src[3] = {4, 5, 9}, dst[3] = {0, 1, 7};
    assert_int_equal(kvx_map_runs(&m, src, dst, 3, base, &r, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(r[0].src_off, 4 * bb);
    assert_ptr_equal(r[0].dst, base);
    assert_int_equal(r[0].len, 2 * bb);
    assert_int_equal(r[1].src_off, 9 * bb);
    assert_ptr_equal(r[1].dst, base + 7 * bb);
    free(r);
    kvx_map_free(&m);
    kvx_page_table_free(&a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dense_layout),     cmocka_unit_test(test_masked_pool),
        cmocka_unit_test(test_split_senders),    cmocka_unit_test(test_mismatches_refused),
        cmocka_unit_test(test_json),             cmocka_unit_test(test_runs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
