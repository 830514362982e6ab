/* router placement unit tests: the conversation index (sticky ids, longest shared content
 * prefix, the 1/N rule, LRU bound, a removed worker forgotten), the conversation policy, the
 * kv_aware mirror (start-event checks: BUG-13 refusals; stored/removed/cleared/lost; a new
 * worker_id), its score (device 1.0 vs host 0.75, load, in-flight predictions). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "hash/hash.h"
#include "router/conv_index.h"
#include "router/kv_mirror.h"
#include "router/router_internal.h"

static void keys_of(uint64_t base, int n, uint64_t *out) {
    for (int i = 0; i < n; i++) out[i] = base * 1000 + (uint64_t)i + 1;
}

static bool all_ok(int w, void *arg) {
    (void)arg;
    return w >= 0;
}
static bool not_one(int w, void *arg) {
    (void)arg;
    return w != 1;
}

static void test_conv_index(void **st) {
    (void)st;
    conv_index_t *ci = conv_index_new(3, 8);
    assert_non_null(ci);
    uint64_t a[10], b[6];
    keys_of(1, 10, a);
    assert_int_equal(conv_index_pin(ci, "A", 1, a, 10), KV_OK); /* cut to 8 keys */
    assert_int_equal(conv_index_lookup(ci, "A"), 1);
    assert_int_equal(conv_index_lookup(ci, "B"), -1);
    /* B shares A's first 5 keys then differs */
    memcpy(b, a, 5 * sizeof *b);
    b[5] = 99;
    int w, convs;
    assert_int_equal(conv_index_match(ci, b, 6, all_ok, NULL, &w, &convs), 5);
    assert_int_equal(w, 1);
    assert_int_equal(convs, 1);
    assert_string_equal(conv_index_match_id(ci, b, 5), "A");
    /* a worker that is not acceptable is passed over */
    assert_int_equal(conv_index_match(ci, b, 6, not_one, NULL, &w, &convs), 0);
    assert_int_equal(conv_index_pin(ci, "B", 2, b, 6), KV_OK);
    assert_int_equal(conv_index_match(ci, a, 3, all_ok, NULL, &w, &convs), 3);
    assert_int_equal(convs, 2); /* both hold the first 3 keys; the latest is B's worker */
    assert_int_equal(w, 2);
    /* LRU bound: C and D evict the least recently used (A was looked up after B's pin? no: B
     * is newer, A older) */
    uint64_t c[2], d[2];
    keys_of(3, 2, c);
    keys_of(4, 2, d);
    assert_int_equal(conv_index_pin(ci, "C", 0, c, 2), KV_OK);
    assert_int_equal(conv_index_size(ci), 3);
    assert_int_equal(conv_index_pin(ci, "D", 0, d, 2), KV_OK);
    assert_int_equal(conv_index_size(ci), 3);
    assert_int_equal(conv_index_lookup(ci, "A"), -1); /* evicted */
    assert_int_equal(conv_index_match(ci, a, 8, all_ok, NULL, &w, &convs), 5); /* via B only */
    assert_int_equal(convs, 1);
    /* re-pinning replaces the keys */
    assert_int_equal(conv_index_pin(ci, "B", 2, c, 1), KV_OK);
    assert_int_equal(conv_index_match(ci, a, 8, all_ok, NULL, &w, &convs), 0);
    /* a removed worker's conversations are forgotten */
    assert_int_equal(conv_index_count_worker(ci, 0), 2);
    assert_int_equal(conv_index_forget_worker(ci, 0), 2);
    assert_int_equal(conv_index_lookup(ci, "C"), -1);
    assert_int_equal(conv_index_lookup(ci, "B"), 2);
    assert_int_equal(conv_index_size(ci), 1);
    conv_index_free(ci);
}

static void pool4(struct rt_pool *p, enum rt_policy_kind k) {
    static const char *const u[] = {"http://a", "http://b", "http://c", "http://d"};
    memset(p, 0, sizeof *p);
    p->role = "aggregated";
    p->policy = k;
    p->max_batch = 64;
    p->min_match_keys = 4;
    for (int i = 0; i < 4; i++) assert_int_equal(rt_pool_add(p, u[i]), i);
    if (k == RT_POLICY_CONVERSATION) p->conv = conv_index_new(1000, 512);
    if (k == RT_POLICY_KV_AWARE) p->pred = rt_predict_new(5.0);
}

static void test_conversation_policy(void **st) {
    (void)st;
    struct rt_pool p;
    pool4(&p, RT_POLICY_CONVERSATION);
    enum rt_reason why;
    long pred;
    uint64_t hist[8];
    keys_of(7, 8, hist);
    /* a new id: least loaded, pinned */
    struct rt_route rq = {"c1", hist, 6, NULL, 0, 16, 100, 0};
    int w1 = rt_select(&p, &rq, -1, &why, &pred);
    assert_int_equal(why, RT_WHY_LOAD);
    rt_pool_charge(&p, w1, 100);
    /* the same id stays (sticky), whatever the load */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(rt_select(&p, &rq, -1, &why, &pred), w1);
        assert_int_equal(why, RT_WHY_STICKY);
    }
    /* excluded: moves, and the id is re-pinned to the new worker */
    int w2 = rt_select(&p, &rq, w1, &why, &pred);
    assert_int_not_equal(w2, w1);
    assert_int_equal(rt_select(&p, &rq, -1, &why, &pred), w2);
    assert_int_equal(why, RT_WHY_STICKY);
    /* a new id whose content extends c1's history by >= 4 keys follows it (content) */
    struct rt_route nq = {"c2", hist, 8, NULL, 0, 16, 100, 0};
    assert_int_equal(rt_select(&p, &nq, -1, &why, &pred), w2);
    assert_int_equal(why, RT_WHY_CONTENT);
    /* fewer shared keys than the minimum: load */
    uint64_t other[8];
    keys_of(7, 3, other);
    keys_of(8, 5, other + 3);
    struct rt_route oq = {"c3", other, 8, NULL, 0, 16, 100, 0};
    rt_select(&p, &oq, -1, &why, &pred);
    assert_int_equal(why, RT_WHY_LOAD);
    rt_pool_release(&p, w1, 100); /* equal loads: least loaded = round robin */
    /* the 1/N rule: 40 conversations sharing a 4-key prefix are spread, not followed */
    int share[4] = {0};
    for (int i = 0; i < 40; i++) {
        char id[32];
        snprintf(id, sizeof id, "s%d", i);
        uint64_t k[6];
        keys_of(9, 4, k);
        k[4] = 5000 + (uint64_t)i, k[5] = 6000 + (uint64_t)i;
        struct rt_route sq = {id, k, 6, NULL, 0, 16, 100, 0};
        share[rt_select(&p, &sq, -1, &why, &pred)]++;
    }
    for (int i = 0; i < 4; i++) assert_true(share[i] >= 8 && share[i] <= 12);
    /* a worker that leaves: its conversations are forgotten */
    rt_pool_worker_gone(&p, w2);
    assert_int_equal(conv_index_lookup(p.conv, "c1"), -1);
    /* content placement off (0): a new id never follows content */
    p.min_match_keys = 0;
    struct rt_route zq = {"c9", hist, 8, NULL, 0, 16, 100, 0};
    rt_select(&p, &zq, -1, &why, &pred);
    assert_int_equal(why, RT_WHY_LOAD);
    assert_true(rt_conv_routable(&p, "unknown", -1));
    p.min_match_keys = 4;
    assert_false(rt_conv_routable(&p, "unknown", -1));
    assert_true(rt_conv_routable(&p, "c9", -1));
    assert_false(rt_conv_routable(&p, "c9", conv_index_lookup(p.conv, "c9")));
    rt_pool_free(&p);
}

static json_t *ev(const char *fmt, ...) {
    char buf[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    json_t *j = json_loads(buf, 0, NULL);
    assert_non_null(j);
    return j;
}

/* hex of a hash whose first 8 bytes (LE) are v */
static void hex_of(uint64_t v, char out[65]) {
    kv_hash h = {{0}};
    for (int i = 0; i < 8; i++) h.b[i] = (uint8_t)(v >> (8 * i));
    kv_hash_hex(&h, out);
}

static enum kv_mirror_result apply(struct kv_mirror *m, json_t *j, const struct kv_mirror_expect *ex) {
    uint64_t seq = 0;
    char err[300];
    enum kv_mirror_result r = kv_mirror_apply(m, j, ex, &seq, err, sizeof err);
    json_decref(j);
    return r;
}

static void test_mirror(void **st) {
    (void)st;
    struct kv_mirror *m = kv_mirror_new();
    struct kv_mirror_expect ex = {16, KV_HASH_SCHEME, "00112233aabbccdd"};
    char err[300];
    uint64_t seq = 0;
    /* BUG-13: a different block size, scheme or key is refused with a reason, never matched */
    json_t *j = ev("{\"type\":\"start\",\"worker_id\":\"w1\",\"tokens_per_block\":64,\"hash_scheme\":\"%s\","
                   "\"hash_key_id\":\"00112233aabbccdd\"}", KV_HASH_SCHEME);
    assert_int_equal(kv_mirror_apply(m, j, &ex, &seq, err, sizeof err), KV_MIRROR_REFUSED);
    assert_non_null(strstr(err, "tokens_per_block 64"));
    json_decref(j);
    j = ev("{\"type\":\"start\",\"worker_id\":\"w1\",\"tokens_per_block\":16,\"hash_scheme\":\"sha256\","
           "\"hash_key_id\":\"00112233aabbccdd\"}");
    assert_int_equal(kv_mirror_apply(m, j, &ex, &seq, err, sizeof err), KV_MIRROR_REFUSED);
    json_decref(j);
    j = ev("{\"type\":\"start\",\"worker_id\":\"w1\",\"tokens_per_block\":16,\"hash_scheme\":\"%s\","
           "\"hash_key_id\":\"ffffffffffffffff\"}", KV_HASH_SCHEME);
    assert_int_equal(kv_mirror_apply(m, j, &ex, &seq, err, sizeof err), KV_MIRROR_REFUSED);
    assert_non_null(strstr(err, "--hash-key-file"));
    json_decref(j);
    assert_int_equal(apply(m, ev("{\"type\":\"start\",\"worker_id\":\"w1\",\"tokens_per_block\":16,\"hash_scheme\":\"%s\","
                                 "\"hash_key_id\":\"00112233aabbccdd\"}", KV_HASH_SCHEME), &ex), KV_MIRROR_RESYNC);
    char h1[65], h2[65];
    hex_of(11, h1);
    hex_of(22, h2);
    assert_int_equal(apply(m, ev("{\"seq\":1,\"type\":\"stored\",\"worker_id\":\"w1\",\"block_hash\":\"%s\"}", h1), &ex), KV_MIRROR_OK);
    assert_int_equal(apply(m, ev("{\"seq\":2,\"type\":\"stored\",\"block_hash\":\"%s\",\"tier\":\"host\"}", h2), &ex), KV_MIRROR_OK);
    assert_int_equal(kv_mirror_tier(m, 11), 1);
    assert_int_equal(kv_mirror_tier(m, 22), 2);
    assert_int_equal(kv_mirror_size(m), 2);
    /* tier moves: host <-> device; a tier event for an unknown block adds nothing */
    assert_int_equal(apply(m, ev("{\"type\":\"tier\",\"block_hash\":\"%s\",\"tier\":\"host\"}", h1), &ex), KV_MIRROR_OK);
    assert_int_equal(kv_mirror_tier(m, 11), 2);
    apply(m, ev("{\"type\":\"tier\",\"block_hash\":\"%s\",\"tier\":\"device\"}", h1), &ex);
    assert_int_equal(kv_mirror_tier(m, 11), 1);
    char h3[65];
    hex_of(33, h3);
    apply(m, ev("{\"type\":\"tier\",\"block_hash\":\"%s\",\"tier\":\"host\"}", h3), &ex);
    assert_int_equal(kv_mirror_tier(m, 33), 0);
    assert_int_equal(apply(m, ev("{\"seq\":3,\"type\":\"removed\",\"block_hash\":\"%s\"}", h1), &ex), KV_MIRROR_OK);
    assert_int_equal(kv_mirror_tier(m, 11), 0);
    /* lost: resync from scratch; final lost ends the stream */
    assert_int_equal(apply(m, ev("{\"type\":\"lost\",\"lost\":5,\"after\":3,\"final\":false}"), &ex), KV_MIRROR_RESYNC);
    assert_int_equal(kv_mirror_size(m), 0);
    assert_int_equal(apply(m, ev("{\"type\":\"lost\",\"lost\":5,\"after\":3,\"final\":true}"), &ex), KV_MIRROR_END);
    /* a different worker_id behind the URL is a new worker */
    apply(m, ev("{\"seq\":4,\"type\":\"stored\",\"worker_id\":\"w1\",\"block_hash\":\"%s\"}", h1), &ex);
    assert_int_equal(apply(m, ev("{\"seq\":1,\"type\":\"stored\",\"worker_id\":\"w2\",\"block_hash\":\"%s\"}", h2), &ex), KV_MIRROR_RESYNC);
    assert_int_equal(kv_mirror_tier(m, 11), 0);
    assert_string_equal(kv_mirror_worker_id(m), "w2");
    assert_int_equal(apply(m, ev("{\"type\":\"cleared\"}"), &ex), KV_MIRROR_OK);
    assert_int_equal(kv_mirror_size(m), 0);
    kv_mirror_free(m);
}

static void store(struct kv_mirror *m, uint64_t h, bool host) {
    struct kv_mirror_expect ex = {16, KV_HASH_SCHEME, "k"};
    char hx[65];
    hex_of(h, hx);
    apply(m, ev("{\"type\":\"stored\",\"block_hash\":\"%s\"%s}", hx, host ? ",\"tier\":\"host\"" : ""), &ex);
}

static void test_kv_aware(void **st) {
    (void)st;
    struct rt_pool p;
    pool4(&p, RT_POLICY_KV_AWARE);
    for (int i = 0; i < 4; i++) p.w[i]->mirror = kv_mirror_new();
    uint64_t bh[8];
    for (int i = 0; i < 8; i++) bh[i] = 100 + (uint64_t)i;
    /* worker 1 holds 4 leading blocks on device, worker 2 holds 5 in its host tier (3.75 < 4) */
    for (int i = 0; i < 4; i++) store(p.w[1]->mirror, bh[i], false);
    for (int i = 0; i < 5; i++) store(p.w[2]->mirror, bh[i], true);
    store(p.w[3]->mirror, bh[1], false); /* not a prefix: counts nothing */
    enum rt_reason why;
    long pred;
    uint64_t t0 = 1000000000000ull;
    struct rt_route rq = {NULL, NULL, 0, bh, 8, 16, 128, t0};
    assert_int_equal(rt_select(&p, &rq, -1, &why, &pred), 1);
    assert_int_equal(why, RT_WHY_KV);
    assert_int_equal(pred, 64);
    /* load: 40 requests on worker 1 cost 40/64 > its 0.5 overlap edge */
    p.w[1]->active = 40;
    assert_int_equal(rt_select(&p, &rq, -1, &why, &pred), 2);
    assert_int_equal(pred, 60); /* 5 host blocks x 16 x 0.75 */
    p.w[1]->active = 0;
    /* BUG-14 guard: 3 legs beyond the least loaded with balance 2: the least loaded takes it */
    p.balance = 2;
    p.w[1]->active = 3;
    p.max_batch = 1000000; /* the score alone would keep worker 1 */
    rq.now_ns = t0 + 10000000000ull; /* the predictions of the placements above have expired */
    int g = rt_select(&p, &rq, -1, &why, &pred);
    assert_int_not_equal(g, 1);
    assert_int_equal(why, RT_WHY_LOAD);
    p.w[1]->active = 2; /* within the threshold: the overlap wins */
    rq.now_ns = t0 + 20000000000ull;
    assert_int_equal(rt_select(&p, &rq, -1, &why, &pred), 1);
    p.balance = 0;
    p.max_batch = 64;
    p.w[1]->active = 0;
    /* in-flight awareness: a cold prefix sent to W follows W within the TTL */
    uint64_t cold[6];
    for (int i = 0; i < 6; i++) cold[i] = 900 + (uint64_t)i;
    struct rt_route cq = {NULL, NULL, 0, cold, 6, 16, 96, t0};
    int w = rt_select(&p, &cq, -1, &why, &pred);
    assert_int_equal(why, RT_WHY_LOAD);
    p.w[w]->active++;
    for (int i = 0; i < 8; i++) {
        cq.now_ns = t0 + (uint64_t)i * 1000000ull;
        assert_int_equal(rt_select(&p, &cq, -1, &why, &pred), w);
        assert_int_equal(why, RT_WHY_PREDICTED);
        p.w[w]->active++;
    }
    /* after the TTL the prediction is gone: back to load */
    cq.now_ns = t0 + 6000000000ull;
    rt_select(&p, &cq, -1, &why, &pred);
    assert_int_equal(why, RT_WHY_LOAD);
    /* exclusion is honoured */
    p.w[w]->active = 0;
    rq.now_ns = t0 + 7000000000ull;
    assert_int_not_equal(rt_select(&p, &rq, 1, &why, &pred), 1);
    for (int i = 0; i < 4; i++) kv_mirror_free(p.w[i]->mirror);
    rt_pool_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv_index), cmocka_unit_test(test_conversation_policy),
        cmocka_unit_test(test_mirror), cmocka_unit_test(test_kv_aware),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
