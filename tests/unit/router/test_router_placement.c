/* router placement unit tests: the conversation index (sticky ids, longest shared content
 * prefix, the 1/N rule, LRU bound, a removed worker forgotten), the conversation policy, the
 * kv_aware mirror (start-event checks: BUG-13 refusals; stored/removed/cleared/lost; a new
 * worker_id), its cost (device 1.0 vs host 0.75 saved tokens against tokens of work in flight,
 * replicated prefixes neutral, the balance guard, in-flight predictions). */
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
    p->overlap_weight = 1.0;
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
    rt_pool_charge(&p, w1, 100, 100);
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
    rt_pool_release(&p, w1, 100, 100); /* equal loads: the fewest sent, then round robin */
    /* the 1/N rule: 40 conversations sharing a 4-key prefix are spread, not followed */
    int share[4] = {0};
    for (int i = 0; i < 40; i++) {
        char id[32];
        snprintf(id, sizeof id, "s%d", i);
        uint64_t k[6];
        keys_of(9, 4, k);
        k[4] = 5000 + (uint64_t)i, k[5] = 6000 + (uint64_t)i;
        struct rt_route sq = {id, k, 6, NULL, 0, 16, 100, 0};
        int w = rt_select(&p, &sq, -1, &why, &pred);
        share[w]++;
        rt_pool_charge(&p, w, 100, 100); /* sent and answered */
        rt_pool_release(&p, w, 100, 100);
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

static void legs(struct rt_pool *p, long a0, long a1, long a2, long a3, long work_each) {
    long a[4] = {a0, a1, a2, a3};
    for (int i = 0; i < 4; i++) p->w[i]->active = a[i], p->w[i]->work = a[i] * work_each;
}

static void test_kv_aware(void **st) {
    (void)st;
    struct rt_pool p;
    pool4(&p, RT_POLICY_KV_AWARE);
    for (int i = 0; i < 4; i++) p.w[i]->mirror = kv_mirror_new();
    enum rt_reason why;
    long pred;
    uint64_t t0 = 1000000000000ull, x[8], y[8], z[8];
    for (int i = 0; i < 8; i++) x[i] = 100 + (uint64_t)i, y[i] = 200 + (uint64_t)i, z[i] = 300 + (uint64_t)i;
    /* worker 1 holds 4 leading blocks of x on device, worker 2 5 of y in its host tier;
     * worker 3 holds x's second block only: not a prefix, counts nothing */
    for (int i = 0; i < 4; i++) store(p.w[1]->mirror, x[i], false);
    for (int i = 0; i < 5; i++) store(p.w[2]->mirror, y[i], true);
    store(p.w[3]->mirror, x[1], false);
    rt_predict_free(p.pred); /* no predictions until the in-flight part below */
    p.pred = rt_predict_new(0);
    struct rt_route rx = {NULL, NULL, 0, x, 8, 16, 128, t0}, ry = {NULL, NULL, 0, y, 8, 16, 128, t0};
    assert_int_equal(rt_select(&p, &rx, -1, &why, &pred), 1);
    assert_int_equal(why, RT_WHY_KV);
    assert_int_equal(pred, 64);
    assert_int_equal(rt_select(&p, &ry, -1, &why, &pred), 2);
    assert_int_equal(pred, 60); /* 5 host blocks x 16 x 0.75 */
    /* saved tokens against load = legs x the pool's mean work per leg: one leg of 50 costs less
     * than the 64 saved, one of 80 more */
    legs(&p, 0, 1, 0, 0, 50);
    assert_int_equal(rt_select(&p, &rx, -1, &why, &pred), 1);
    legs(&p, 0, 1, 0, 0, 80);
    int g = rt_select(&p, &rx, -1, &why, &pred);
    assert_true(g == 0 || g == 2 || g == 3);
    assert_int_equal(why, RT_WHY_LOAD);
    /* legs, not the work queued now: worker 1's one costly leg counts as the mean leg (45) */
    p.w[0]->active = 1, p.w[0]->work = 10;
    assert_int_equal(rt_select(&p, &rx, -1, &why, &pred), 1);
    /* host credit: 60 saved against two legs of 40 (80) loses to worker 3 with none */
    legs(&p, 0, 0, 2, 0, 40);
    assert_int_not_equal(rt_select(&p, &ry, -1, &why, &pred), 2);
    legs(&p, 1, 1, 1, 1, 40); /* one leg each: the overlap decides */
    assert_int_equal(rt_select(&p, &ry, -1, &why, &pred), 2);
    legs(&p, 0, 2, 0, 0, 50); /* 100 - 64 > 0, but 100 - 2 x 64 < 0 */
    assert_int_not_equal(rt_select(&p, &rx, -1, &why, &pred), 1);
    p.overlap_weight = 2.0;
    assert_int_equal(rt_select(&p, &rx, -1, &why, &pred), 1);
    p.overlap_weight = 1.0;
    legs(&p, 0, 0, 0, 0, 0);
    /* a prefix two workers hold (replicated: a shared system prompt) is no reason to prefer
     * either: z[0..3] on workers 1 and 2, z[4] on worker 1 only */
    for (int i = 0; i < 4; i++) store(p.w[1]->mirror, z[i], false), store(p.w[2]->mirror, z[i], false);
    store(p.w[1]->mirror, z[4], false);
    struct rt_route rz = {NULL, NULL, 0, z, 8, 16, 128, t0};
    assert_int_equal(rt_select(&p, &rz, -1, &why, &pred), 1); /* its one specific block */
    assert_int_equal(pred, 80);
    legs(&p, 0, 1, 0, 0, 17); /* 17 - 16 > 0: the replicated blocks count for nobody */
    g = rt_select(&p, &rz, -1, &why, &pred);
    assert_true(g == 0 || g == 2 || g == 3);
    assert_int_equal(why, RT_WHY_LOAD);
    /* no affinity (only the replicated prefix matches): the least loaded first, then the one
     * holding more of the prompt (no needless replication) */
    struct rt_route rz4 = {NULL, NULL, 0, z, 4, 16, 64, t0};
    legs(&p, 0, 0, 0, 0, 0);
    for (int k = 0; k < 4; k++) {
        g = rt_select(&p, &rz4, -1, &why, &pred);
        assert_true(g == 1 || g == 2);
        assert_int_equal(pred, 64);
    }
    legs(&p, 1, 2, 1, 1, 10);
    assert_int_equal(rt_select(&p, &rz4, -1, &why, &pred), 2);
    legs(&p, 0, 2, 1, 1, 10);
    assert_int_equal(rt_select(&p, &rz4, -1, &why, &pred), 0);
    legs(&p, 0, 0, 0, 0, 0);
    /* chains: a prefix that placed requests continued in two ways (sessions sharing a system
     * prompt) is shared, even on one worker: no reason to prefer it; a chain that only grows
     * (one session's turns) stays specific */
    uint64_t s1[8], s2[8], s3[8];
    for (int i = 0; i < 8; i++) s1[i] = s2[i] = s3[i] = 500 + (uint64_t)i;
    s2[5] = 611, s2[6] = 612, s2[7] = 613; /* s2 leaves s1 after 5 blocks */
    for (int i = 0; i < 8; i++) store(p.w[3]->mirror, s1[i], false);
    struct rt_route r1 = {NULL, NULL, 0, s1, 6, 16, 97, t0}, r2 = {NULL, NULL, 0, s2, 8, 16, 129, t0},
                    r3 = {NULL, NULL, 0, s3, 8, 16, 129, t0};
    legs(&p, 0, 0, 0, 1, 20); /* worker 3: one leg of 20 < its 96 specific tokens */
    assert_int_equal(rt_select(&p, &r1, -1, &why, &pred), 3); /* first placement of the chain */
    assert_int_equal(rt_select(&p, &r3, -1, &why, &pred), 3); /* the same chain, longer: a turn */
    assert_int_equal(why, RT_WHY_KV);
    g = rt_select(&p, &r2, -1, &why, &pred); /* diverges after 5 blocks: 80 shared tokens */
    assert_int_not_equal(g, 3);
    assert_int_equal(why, RT_WHY_LOAD);
    assert_int_not_equal(rt_select(&p, &r1, -1, &why, &pred), 3); /* now s1's first 5 are shared too */
    legs(&p, 0, 0, 0, 0, 0);
    /* BUG-14 guard: 3 legs beyond the least loaded with balance 2: the least loaded takes it */
    p.balance = 2;
    legs(&p, 0, 3, 0, 0, 1);
    p.overlap_weight = 1000; /* the cost alone would keep worker 1 */
    g = rt_select(&p, &rx, -1, &why, &pred);
    assert_int_not_equal(g, 1);
    assert_int_equal(why, RT_WHY_LOAD);
    p.w[1]->active = 2; /* within the threshold: the overlap wins */
    assert_int_equal(rt_select(&p, &rx, -1, &why, &pred), 1);
    p.balance = 0;
    p.overlap_weight = 1.0;
    legs(&p, 0, 0, 0, 0, 0);
    /* in-flight awareness: a cold prefix sent to W follows W within the TTL while W has not
     * reported it stored (the requests wait for that one prefill), whatever W's legs */
    rt_predict_free(p.pred);
    p.pred = rt_predict_new(5.0);
    uint64_t cold[6];
    for (int i = 0; i < 6; i++) cold[i] = 900 + (uint64_t)i;
    struct rt_route cq = {NULL, NULL, 0, cold, 6, 16, 97, t0};
    int w = rt_select(&p, &cq, -1, &why, &pred);
    assert_int_equal(why, RT_WHY_LOAD);
    for (int i = 0; i < 8; i++) {
        p.w[w]->active++, p.w[w]->work += 100;
        cq.now_ns = t0 + (uint64_t)i * 1000000ull;
        assert_int_equal(rt_select(&p, &cq, -1, &why, &pred), w);
        assert_int_equal(why, RT_WHY_PREDICTED);
        assert_int_equal(pred, 96);
    }
    /* a request with a long tail of its own (104 new tokens > 96 / RT_KV_FOLLOW_RATIO) is
     * placed by the cost: W's 9 legs outweigh the 96 saved tokens */
    struct rt_route lq = {NULL, NULL, 0, cold, 6, 16, 200, cq.now_ns};
    assert_int_not_equal(rt_select(&p, &lq, -1, &why, &pred), w);
    /* stored there now: no longer in flight, the cost decides for short tails too */
    for (int i = 0; i < 6; i++) store(p.w[w]->mirror, cold[i], false);
    g = rt_select(&p, &cq, -1, &why, &pred);
    assert_int_not_equal(g, w);
    /* after the TTL a prediction is gone: a cold prefix goes by load */
    uint64_t cold2[6];
    for (int i = 0; i < 6; i++) cold2[i] = 950 + (uint64_t)i;
    struct rt_route cq2 = {NULL, NULL, 0, cold2, 6, 16, 97, t0 + 10000000ull};
    w = rt_select(&p, &cq2, -1, &why, &pred);
    p.w[w]->active++, p.w[w]->work += 100;
    cq2.now_ns = t0 + 6000000000ull;
    assert_int_not_equal(rt_select(&p, &cq2, -1, &why, &pred), w);
    assert_int_equal(why, RT_WHY_LOAD);
    legs(&p, 0, 0, 0, 0, 0);
    /* exclusion is honoured */
    rx.now_ns = t0 + 7000000000ull;
    assert_int_not_equal(rt_select(&p, &rx, 1, &why, &pred), 1);
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
