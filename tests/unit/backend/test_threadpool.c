/* base/threadpool: every task runs exactly once per call, thread ids are in range, and the
 * pool survives many back-to-back calls. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "base/threadpool.h"

struct ctx { atomic_int *hits; int n_threads; atomic_int bad_thread; };

static void task(void *p, int t, int th) {
    struct ctx *c = p;
    atomic_fetch_add(&c->hits[t], 1);
    if (th < 0 || th >= c->n_threads) atomic_fetch_add(&c->bad_thread, 1);
}

static void test_parallel_for(void **st) {
    (void)st;
    assert_null(kv_threadpool_new(0));
    for (int nt = 1; nt <= 4; nt++) {
        kv_threadpool_t *tp = kv_threadpool_new(nt);
        assert_non_null(tp);
        assert_int_equal(kv_threadpool_size(tp), nt);
        atomic_int hits[257];
        struct ctx c = {hits, nt, 0};
        for (int iter = 0; iter < 300; iter++) {
            int n = iter % 257;
            for (int i = 0; i < 257; i++) atomic_init(&hits[i], 0);
            kv_threadpool_for(tp, n, task, &c);
            for (int i = 0; i < 257; i++) assert_int_equal(atomic_load(&hits[i]), i < n ? 1 : 0);
        }
        assert_int_equal(atomic_load(&c.bad_thread), 0);
        kv_threadpool_free(tp);
    }
    kv_threadpool_free(NULL);
}

struct slow_ctx { atomic_int *hits; };

static void slow_task(void *p, int t, int th) {
    (void)th;
    struct slow_ctx *c = p;
    if (t % 3 == 0) {
        struct timespec ts = {0, 200 * 1000}; /* longer than the pool's spin window */
        nanosleep(&ts, NULL);
    }
    atomic_fetch_add(&c->hits[t], 1);
}

/* The sleep paths: pauses between calls longer than the spin window put workers to sleep on
 * the condvar, and slow tasks make the caller sleep waiting for them; every task still runs
 * exactly once and nothing hangs. */
static void test_sleep_paths(void **st) {
    (void)st;
    for (int nt = 2; nt <= 3; nt++) {
        kv_threadpool_t *tp = kv_threadpool_new(nt);
        assert_non_null(tp);
        atomic_int hits[16];
        struct slow_ctx c = {hits};
        for (int iter = 0; iter < 60; iter++) {
            int n = 1 + iter % 16;
            for (int i = 0; i < 16; i++) atomic_init(&hits[i], 0);
            kv_threadpool_for(tp, n, slow_task, &c);
            for (int i = 0; i < 16; i++) assert_int_equal(atomic_load(&hits[i]), i < n ? 1 : 0);
            if (iter % 4 == 0) {
                struct timespec ts = {0, 2 * 1000 * 1000}; /* idle: workers go to sleep */
                nanosleep(&ts, NULL);
            }
        }
        kv_threadpool_free(tp);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_parallel_for),
                                       cmocka_unit_test(test_sleep_paths)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
