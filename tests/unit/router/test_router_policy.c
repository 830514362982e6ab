/* router policy unit tests: round robin with exclusion, delivery classes (spec decision 3),
 * retry rules of generation, context and plain legs (spec §2), KVSERVE_DISAGG_NO_RETRY. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <curl/curl.h>

#include <string.h>

#include "router/router_internal.h"

static void pool_of(struct rt_pool *p, int n) {
    static const char *const u[] = {"http://a", "http://b", "http://c", "http://d"};
    memset(p, 0, sizeof *p);
    p->role = "aggregated";
    for (int i = 0; i < n; i++) assert_int_equal(rt_pool_add(p, u[i]), i);
}

static void test_round_robin(void **st) {
    (void)st;
    struct rt_pool p;
    pool_of(&p, 3);
    assert_int_equal(rt_pool_pick(&p, -1), 0);
    assert_int_equal(rt_pool_pick(&p, -1), 1);
    assert_int_equal(rt_pool_pick(&p, -1), 2);
    assert_int_equal(rt_pool_pick(&p, -1), 0);
    /* the next pick (1) is excluded: skip to 2 */
    assert_int_equal(rt_pool_pick(&p, 1), 2);
    /* a worker out of the pool (unhealthy) is skipped */
    p.w[0]->healthy = false;
    for (int i = 0; i < 6; i++) assert_int_not_equal(rt_pool_pick(&p, -1), 0);
    assert_int_equal(rt_pool_add(&p, "http://a"), 0); /* re-adding revives, same index */
    rt_pool_free(&p);
    struct rt_pool one;
    pool_of(&one, 1);
    assert_int_equal(rt_pool_pick(&one, 0), 0); /* a single worker is retried on itself */
    one.w[0]->present = false;
    assert_int_equal(rt_pool_pick(&one, -1), -1);
    rt_pool_free(&one);
    struct rt_pool none;
    pool_of(&none, 0);
    assert_int_equal(rt_pool_pick(&none, -1), -1);
}

static void test_least_loaded(void **st) {
    (void)st;
    struct rt_pool p;
    pool_of(&p, 3);
    p.policy = RT_POLICY_LEAST_LOADED;
    struct rt_route rq = {0};
    enum rt_reason why;
    long pred;
    /* ties round robin */
    int seen[3] = {0};
    for (int i = 0; i < 3; i++) seen[rt_select(&p, &rq, -1, &why, &pred)]++;
    assert_int_equal(seen[0] + seen[1] + seen[2], 3);
    assert_true(seen[0] == 1 && seen[1] == 1 && seen[2] == 1);
    assert_int_equal(why, RT_WHY_LOAD);
    rt_pool_charge(&p, 0, 100, 150);
    rt_pool_charge(&p, 1, 10, 20);
    assert_int_equal(rt_select(&p, &rq, -1, &why, &pred), 2);
    rt_pool_charge(&p, 2, 10, 20);
    /* requests: 1 and 2 tie (one each) below... all three have one: exclusion decides */
    assert_int_not_equal(rt_select(&p, &rq, 1, &why, &pred), 1);
    /* tokens metric: worker 0 carries 100 tokens */
    p.metric = RT_LOAD_TOKENS;
    for (int i = 0; i < 4; i++) assert_int_not_equal(rt_select(&p, &rq, -1, &why, &pred), 0);
    rt_pool_release(&p, 0, 100, 150);
    rt_pool_release(&p, 0, 100, 150); /* clamped at 0 */
    assert_int_equal(p.w[0]->active, 0);
    assert_int_equal(p.w[0]->tokens, 0);
    assert_int_equal(p.w[0]->work, 0);
    assert_int_equal(p.w[1]->work, 20);
    /* a leg's work: prompt tokens not predicted cached + max_tokens (default, cap) */
    assert_int_equal(rt_leg_work(100, 60, 10), 50);
    assert_int_equal(rt_leg_work(100, 200, 10), 10);
    assert_int_equal(rt_leg_work(100, 0, 0), 100 + RT_OUT_DEFAULT);
    assert_int_equal(rt_leg_work(100, 0, 1L << 30), 100 + RT_OUT_CAP);
    assert_int_equal(rt_select(&p, &rq, -1, &why, &pred), 0);
    assert_int_equal(p.reasons[RT_WHY_LOAD], 10);
    /* equal loads: the worker sent the fewest legs so far (0: 1 + 2 more, 1: 1, 2: 1) */
    p.metric = RT_LOAD_REQUESTS;
    rt_pool_release(&p, 1, 10, 20);
    rt_pool_release(&p, 2, 10, 20);
    for (int i = 0; i < 2; i++) rt_pool_charge(&p, 0, 1, 1), rt_pool_release(&p, 0, 1, 1);
    for (int i = 0; i < 4; i++) {
        int w = rt_select(&p, &rq, -1, &why, &pred);
        assert_int_not_equal(w, 0);
        rt_pool_charge(&p, w, 1, 1), rt_pool_release(&p, w, 1, 1);
    }
    assert_int_equal(p.w[1]->requests, 3);
    assert_int_equal(p.w[2]->requests, 3);
    rt_pool_free(&p);
}

static struct rt_outcome oc(int code, long status, bool written, bool any, bool got) {
    return (struct rt_outcome){code, status, written, any, got};
}

static void test_classify(void **st) {
    (void)st;
    struct rt_outcome o;
    o = oc(CURLE_OK, 200, true, true, true);
    assert_int_equal(rt_classify(&o), RT_COMPLETED);
    o = oc(CURLE_COULDNT_CONNECT, 0, false, false, false);
    assert_int_equal(rt_classify(&o), RT_UNDELIVERED);
    o = oc(CURLE_COULDNT_RESOLVE_HOST, 0, false, false, false);
    assert_int_equal(rt_classify(&o), RT_UNDELIVERED);
    /* send error: depends on whether the whole request went out */
    o = oc(CURLE_SEND_ERROR, 0, false, true, false);
    assert_int_equal(rt_classify(&o), RT_UNDELIVERED);
    o = oc(CURLE_SEND_ERROR, 0, true, true, false);
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
    /* the worker closed after reading (empty reply), recv errors, partial bodies, timeouts */
    o = oc(CURLE_GOT_NOTHING, 0, true, true, false);
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
    o = oc(CURLE_RECV_ERROR, 0, true, true, false);
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
    o = oc(CURLE_PARTIAL_FILE, 200, true, true, true);
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
    o = oc(CURLE_OPERATION_TIMEDOUT, 0, true, true, false);
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
    /* a timeout before any request byte went out (connect timeout): nothing was delivered */
    o = oc(CURLE_OPERATION_TIMEDOUT, 0, false, false, false);
    assert_int_equal(rt_classify(&o), RT_UNDELIVERED);
    /* any HTTP status was delivered */
    o = oc(CURLE_OK, 500, true, true, true);
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
    o = oc(CURLE_OK, 400, true, true, true);
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
    o = oc(CURLE_OK, 0, true, true, false); /* completed without any byte: an oddity */
    assert_int_equal(rt_classify(&o), RT_POSSIBLY_DELIVERED);
}

static void test_generation_retries(void **st) {
    (void)st;
    struct rt_retry_policy p = {.max_retries = 1, .no_retry = false};
    struct rt_outcome refused = oc(CURLE_COULDNT_CONNECT, 0, false, false, false);
    struct rt_outcome empty = oc(CURLE_GOT_NOTHING, 0, true, true, false);
    struct rt_outcome s500 = oc(CURLE_OK, 500, true, true, true);
    /* undelivered: budget max(max_retries, 5) = 5 */
    for (int i = 0; i < 5; i++) assert_true(rt_should_retry(RT_LEG_GENERATION, &refused, &p, i, false));
    assert_false(rt_should_retry(RT_LEG_GENERATION, &refused, &p, 5, false));
    p.max_retries = 8;
    assert_true(rt_should_retry(RT_LEG_GENERATION, &refused, &p, 7, false));
    assert_false(rt_should_retry(RT_LEG_GENERATION, &refused, &p, 8, false));
    p.max_retries = 0; /* still 5: only NO_RETRY turns it off (decision 3) */
    assert_true(rt_should_retry(RT_LEG_GENERATION, &refused, &p, 4, false));
    /* possibly delivered: never */
    assert_false(rt_should_retry(RT_LEG_GENERATION, &empty, &p, 0, false));
    assert_false(rt_should_retry(RT_LEG_GENERATION, &s500, &p, 0, false));
    p.no_retry = true;
    assert_false(rt_should_retry(RT_LEG_GENERATION, &refused, &p, 0, false));
}

static void test_context_retries(void **st) {
    (void)st;
    struct rt_retry_policy p = {.max_retries = 1, .no_retry = false};
    struct rt_outcome s400 = oc(CURLE_OK, 400, true, true, true);
    struct rt_outcome s503 = oc(CURLE_OK, 503, true, true, true);
    struct rt_outcome refused = oc(CURLE_COULDNT_CONNECT, 0, false, false, false);
    struct rt_outcome empty = oc(CURLE_GOT_NOTHING, 0, true, true, false);
    struct rt_outcome tmo = oc(CURLE_OPERATION_TIMEDOUT, 0, true, true, false);
    for (int k = RT_LEG_CONTEXT; k <= RT_LEG_PLAIN; k += 2) {
        assert_false(rt_should_retry(k, &s400, &p, 0, false)); /* 4xx never */
        assert_true(rt_should_retry(k, &s503, &p, 0, false));
        assert_false(rt_should_retry(k, &s503, &p, 1, false));
        assert_true(rt_should_retry(k, &refused, &p, 0, false));
        assert_false(rt_should_retry(k, &refused, &p, 1, false));
        assert_true(rt_should_retry(k, &tmo, &p, 0, false));
        /* server disconnected: the transient budget max(max_retries, 5) */
        assert_true(rt_should_retry(k, &empty, &p, 4, false));
        assert_false(rt_should_retry(k, &empty, &p, 5, false));
        /* nothing after the first streamed byte */
        assert_false(rt_should_retry(k, &refused, &p, 0, true));
    }
    p.no_retry = true;
    assert_false(rt_should_retry(RT_LEG_CONTEXT, &refused, &p, 0, false));
    assert_false(rt_should_retry(RT_LEG_CONTEXT, &s503, &p, 0, false));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_robin), cmocka_unit_test(test_least_loaded),
        cmocka_unit_test(test_classify),
        cmocka_unit_test(test_generation_retries),
        cmocka_unit_test(test_context_retries),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
