/* kvcache unit tests: free list, refcounts, all-or-nothing alloc_n, randomized invariants. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"

static void test_new_bad_args(void **state) {
    (void)state;
    assert_null(kv_pool_new(0, 16));
    assert_null(kv_pool_new(4, 0));
    assert_null(kv_pool_new(-1, 16));
}

static void test_basic(void **state) {
    (void)state;
    kv_pool_t *p = kv_pool_new(3, 16);
    assert_non_null(p);
    assert_int_equal(kv_pool_n_blocks(p), 3);
    assert_int_equal(kv_pool_n_free(p), 3);
    assert_int_equal(kv_pool_tokens_per_block(p), 16);
    int a = kv_pool_alloc(p), b = kv_pool_alloc(p), c = kv_pool_alloc(p);
    assert_true(a >= 0 && a < 3 && b >= 0 && b < 3 && c >= 0 && c < 3);
    assert_true(a != b && b != c && a != c);
    assert_int_equal(kv_pool_n_free(p), 0);
    assert_int_equal(kv_pool_alloc(p), -1);
    assert_int_equal(kv_pool_refcount(p, b), 1);
    kv_pool_ref(p, b);
    assert_int_equal(kv_pool_refcount(p, b), 2);
    kv_pool_release(p, b);
    assert_int_equal(kv_pool_n_free(p), 0);
    kv_pool_release(p, b);
    assert_int_equal(kv_pool_refcount(p, b), 0);
    assert_int_equal(kv_pool_n_free(p), 1);
    assert_int_equal(kv_pool_alloc(p), b); /* the only free block */
    kv_pool_release(p, a);
    kv_pool_release(p, b);
    kv_pool_release(p, c);
    assert_int_equal(kv_pool_n_free(p), 3);
    kv_pool_free(p);
}

static void test_alloc_n_all_or_nothing(void **state) {
    (void)state;
    kv_pool_t *p = kv_pool_new(5, 4);
    int32_t out[8];
    for (int i = 0; i < 8; i++) out[i] = -7;
    assert_int_equal(kv_pool_alloc_n(p, 6, out), KV_NO_SPACE);
    assert_int_equal(kv_pool_n_free(p), 5);
    for (int i = 0; i < 8; i++) assert_int_equal(out[i], -7);
    assert_int_equal(kv_pool_alloc_n(p, 0, out), KV_OK);
    assert_int_equal(kv_pool_alloc_n(p, 3, out), KV_OK);
    assert_int_equal(kv_pool_n_free(p), 2);
    int32_t more[3];
    assert_int_equal(kv_pool_alloc_n(p, 3, more), KV_NO_SPACE);
    assert_int_equal(kv_pool_n_free(p), 2);
    assert_int_equal(kv_pool_alloc_n(p, 2, more), KV_OK);
    assert_int_equal(kv_pool_n_free(p), 0);
    int seen[5] = {0};
    for (int i = 0; i < 3; i++) seen[out[i]]++;
    for (int i = 0; i < 2; i++) seen[more[i]]++;
    for (int i = 0; i < 5; i++) assert_int_equal(seen[i], 1);
    for (int i = 0; i < 5; i++) assert_int_equal(kv_pool_refcount(p, i), 1);
    kv_pool_free(p);
}

static void test_blocks_for_tokens(void **state) {
    (void)state;
    assert_int_equal(kv_blocks_for_tokens(0, 16), 0);
    assert_int_equal(kv_blocks_for_tokens(1, 16), 1);
    assert_int_equal(kv_blocks_for_tokens(16, 16), 1);
    assert_int_equal(kv_blocks_for_tokens(17, 16), 2);
}

/* Random alloc / alloc_n / ref / release against a shadow refcount array. */
static void test_randomized(void **state) {
    (void)state;
    kv_rng rng;
    for (int trial = 0; trial < 20; trial++) {
        kv_rng_seed(&rng, 1234 + (uint64_t)trial);
        int nb = 1 + (int)(kv_rng_next(&rng) % 64);
        kv_pool_t *p = kv_pool_new(nb, 16);
        assert_non_null(p);
        int *shadow = calloc((size_t)nb, sizeof *shadow);
        int32_t *tmp = malloc((size_t)(nb + 8) * sizeof *tmp);
        for (int step = 0; step < 5000; step++) {
            int op = (int)(kv_rng_next(&rng) % 4);
            int nfree = 0;
            for (int i = 0; i < nb; i++) nfree += shadow[i] == 0;
            if (op == 0) {
                int b = kv_pool_alloc(p);
                if (nfree == 0) {
                    assert_int_equal(b, -1);
                } else {
                    assert_true(b >= 0 && b < nb);
                    assert_int_equal(shadow[b], 0);
                    shadow[b] = 1;
                }
            } else if (op == 1) {
                int n = (int)(kv_rng_next(&rng) % (uint64_t)(nb + 3));
                kv_status s = kv_pool_alloc_n(p, n, tmp);
                if (n > nfree) {
                    assert_int_equal(s, KV_NO_SPACE);
                } else {
                    assert_int_equal(s, KV_OK);
                    for (int i = 0; i < n; i++) {
                        assert_true(tmp[i] >= 0 && tmp[i] < nb);
                        assert_int_equal(shadow[tmp[i]], 0);
                        shadow[tmp[i]] = 1; /* also catches duplicates inside one call */
                    }
                }
            } else {
                /* ref (op 2) or release (op 3) a random held block */
                int held = nb - nfree;
                if (held == 0) continue;
                int k = (int)(kv_rng_next(&rng) % (uint64_t)held), b = -1;
                for (int i = 0; i < nb; i++)
                    if (shadow[i] > 0 && k-- == 0) { b = i; break; }
                if (op == 2) { kv_pool_ref(p, b); shadow[b]++; }
                else { kv_pool_release(p, b); shadow[b]--; }
            }
            nfree = 0;
            for (int i = 0; i < nb; i++) {
                assert_int_equal(kv_pool_refcount(p, i), shadow[i]);
                nfree += shadow[i] == 0;
            }
            assert_int_equal(kv_pool_n_free(p), nfree);
        }
        /* release everything: the pool must be whole again */
        for (int i = 0; i < nb; i++)
            while (shadow[i] > 0) { kv_pool_release(p, i); shadow[i]--; }
        assert_int_equal(kv_pool_n_free(p), nb);
        assert_int_equal(kv_pool_alloc_n(p, nb, tmp), KV_OK);
        free(shadow);
        free(tmp);
        kv_pool_free(p);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_new_bad_args),
        cmocka_unit_test(test_basic),
        cmocka_unit_test(test_alloc_n_all_or_nothing),
        cmocka_unit_test(test_blocks_for_tokens),
        cmocka_unit_test(test_randomized),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
