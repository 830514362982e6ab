/* kvcache reuse: exact lookup (hash + parent + tokens), LRU of cached blocks, pin contract,
 * host tier offload/promotion copy ops, events. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"

#define T 4

static kv_hash hh(int x) {
    kv_hash h;
    memset(&h, 0, sizeof h);
    h.b[0] = (uint8_t)x; /* deliberately tiny: collisions everywhere */
    return h;
}

static int n_stored, n_removed, n_cleared, n_to_host, n_to_device;
static void on_ev(const struct kv_pool_event *ev, void *u) {
    (void)u;
    if (ev->type == KV_POOL_EV_STORED) n_stored++;
    else if (ev->type == KV_POOL_EV_REMOVED) n_removed++;
    else if (ev->type == KV_POOL_EV_TIER) *(ev->host ? &n_to_host : &n_to_device) += 1;
    else n_cleared++;
}

static void test_lookup_is_exact(void **st) {
    (void)st;
    kv_pool_t *p = kv_pool_new(8, T);
    assert_int_equal(kv_pool_enable_reuse(p, 0), KV_OK);
    kv_pool_set_event_cb(p, on_ev, NULL);
    n_stored = n_removed = n_cleared = 0;
    uint64_t root = kv_pool_root_uid(p, NULL, 0), root_b = kv_pool_root_uid(p, "\1\1\0\0\0x", 6);
    assert_true(root && root_b && root != root_b);
    assert_int_equal(kv_pool_root_uid(p, NULL, 0), root);
    int32_t t1[T] = {1, 2, 3, 4}, t2[T] = {1, 2, 3, 5};
    kv_hash h = hh(7), r = hh(0);
    int b = kv_pool_alloc(p);
    uint64_t u = kv_pool_register(p, b, root, &r, &h, t1);
    assert_true(u != 0);
    assert_int_equal(n_stored, 1);
    uint64_t got = 0;
    assert_int_equal(kv_pool_lookup(p, root, &h, t1, &got), b);
    assert_true(got == u);
    assert_int_equal(kv_pool_lookup(p, root, &h, t2, NULL), -1);   /* same hash, other tokens */
    assert_int_equal(kv_pool_lookup(p, root_b, &h, t1, NULL), -1); /* other salt root */
    kv_hash h2 = hh(8);
    assert_int_equal(kv_pool_lookup(p, root, &h2, t1, NULL), -1);  /* other hash */
    /* same hash, other tokens: a second entry in the same bucket */
    int b2 = kv_pool_alloc(p);
    uint64_t u2 = kv_pool_register(p, b2, root, &r, &h, t2);
    assert_true(u2 && u2 != u);
    assert_int_equal(kv_pool_lookup(p, root, &h, t2, NULL), b2);
    assert_int_equal(kv_pool_lookup(p, root, &h, t1, NULL), b);
    /* child of b only matches under b's uid */
    int c = kv_pool_alloc(p);
    kv_pool_register(p, c, u, &h, &h2, t1);
    assert_int_equal(kv_pool_lookup(p, u, &h2, t1, NULL), c);
    assert_int_equal(kv_pool_lookup(p, u2, &h2, t1, NULL), -1);
    /* duplicate registration returns the existing uid and leaves the block unindexed */
    int d = kv_pool_alloc(p);
    assert_true(kv_pool_register(p, d, root, &r, &h, t1) == u);
    kv_pool_release(p, d);
    assert_int_equal(kv_pool_n_cached(p), 0);
    kv_pool_free(p);
}

static void test_lru_and_pins(void **st) {
    (void)st;
    kv_pool_t *p = kv_pool_new(3, T);
    assert_int_equal(kv_pool_enable_reuse(p, 0), KV_OK);
    kv_pool_set_event_cb(p, on_ev, NULL);
    n_stored = n_removed = n_cleared = 0;
    uint64_t root = kv_pool_root_uid(p, NULL, 0);
    kv_hash r = hh(0), h[3] = {hh(1), hh(2), hh(3)};
    int32_t t[3][T] = {{1, 1, 1, 1}, {2, 2, 2, 2}, {3, 3, 3, 3}};
    int b[3];
    for (int i = 0; i < 3; i++) {
        b[i] = kv_pool_alloc(p);
        kv_pool_register(p, b[i], root, &r, &h[i], t[i]);
    }
    assert_int_equal(kv_pool_n_free(p), 0);
    kv_pool_release(p, b[1]); /* LRU order: 1, 0 */
    kv_pool_release(p, b[0]);
    assert_int_equal(kv_pool_n_free(p), 2);
    assert_int_equal(kv_pool_n_cached(p), 2);
    /* pin 1 again: only 0 is evictable */
    int e1 = kv_pool_lookup(p, root, &h[1], t[1], NULL);
    assert_int_equal(kv_pool_acquire(p, e1), b[1]);
    assert_int_equal(kv_pool_refcount(p, b[1]), 1);
    assert_int_equal(kv_pool_n_free(p), 1);
    int x = kv_pool_alloc(p); /* evicts b[0] */
    assert_int_equal(x, b[0]);
    assert_int_equal(n_removed, 1);
    assert_int_equal(kv_pool_lookup(p, root, &h[0], t[0], NULL), -1);
    assert_int_equal(kv_pool_alloc(p), -1); /* b[1], b[2] pinned, x in use */
    assert_int_equal(kv_pool_lookup(p, root, &h[1], t[1], NULL), b[1]);
    kv_pool_release(p, x);
    kv_pool_release(p, b[1]);
    kv_pool_release(p, b[2]);
    assert_int_equal(kv_pool_n_free(p), 3);
    kv_pool_clear_cache(p);
    assert_int_equal(n_cleared, 1);
    assert_int_equal(kv_pool_n_cached(p), 0);
    assert_int_equal(kv_pool_lookup(p, root, &h[2], t[2], NULL), -1);
    kv_pool_free(p);
}

static void test_host_tier(void **st) {
    (void)st;
    kv_pool_t *p = kv_pool_new(2, T);
    assert_int_equal(kv_pool_enable_reuse(p, 2), KV_OK);
    kv_pool_set_event_cb(p, on_ev, NULL);
    n_stored = n_removed = n_cleared = n_to_host = n_to_device = 0;
    uint64_t root = kv_pool_root_uid(p, NULL, 0);
    kv_hash r = hh(0), h[4] = {hh(1), hh(2), hh(3), hh(4)};
    int32_t t[4][T] = {{1, 1, 1, 1}, {2, 2, 2, 2}, {3, 3, 3, 3}, {4, 4, 4, 4}};
    for (int i = 0; i < 2; i++) {
        int b = kv_pool_alloc(p);
        kv_pool_register(p, b, root, &r, &h[i], t[i]);
        kv_pool_release(p, b);
    }
    /* two more blocks evict both to the host */
    int n = 0;
    int a = kv_pool_alloc(p), b = kv_pool_alloc(p);
    const struct kv_copy_op *ops = kv_pool_pending_copies(p, &n);
    assert_int_equal(n, 2);
    assert_true(ops[0].to_host && ops[1].to_host);
    assert_int_equal(ops[0].block, 0); /* LRU: block 0 released first */
    assert_int_equal(kv_pool_n_host_cached(p), 2);
    int e0 = kv_pool_lookup(p, root, &h[0], t[0], NULL);
    assert_true(e0 >= 2); /* a host entry */
    /* offloads are tier events (routers score host blocks lower), not removals */
    assert_int_equal(n_to_host, 2);
    assert_int_equal(n_removed, 0);
    kv_pool_clear_copies(p);
    kv_pool_release(p, a); /* a is unindexed: free */
    int d = kv_pool_acquire(p, e0);
    assert_int_equal(d, a);
    ops = kv_pool_pending_copies(p, &n);
    assert_int_equal(n, 1);
    assert_false(ops[0].to_host);
    assert_int_equal(ops[0].block, a);
    assert_int_equal(kv_pool_lookup(p, root, &h[0], t[0], NULL), a); /* back on the device */
    assert_int_equal(n_to_device, 1);
    assert_int_equal(kv_pool_n_host_cached(p), 1);
    struct kv_pool_stats s;
    kv_pool_get_stats(p, &s);
    assert_int_equal(s.offloads, 2);
    assert_int_equal(s.hits_host, 1);
    /* no device block left: a host hit fails without changing anything */
    kv_pool_clear_copies(p);
    int e1 = kv_pool_lookup(p, root, &h[1], t[1], NULL);
    assert_int_equal(kv_pool_acquire(p, e1), -1);
    assert_int_equal(kv_pool_lookup(p, root, &h[1], t[1], NULL), e1);
    kv_pool_release(p, b);
    kv_pool_release(p, d);
    kv_pool_free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lookup_is_exact),
        cmocka_unit_test(test_lru_and_pins),
        cmocka_unit_test(test_host_tier),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
