/* base/threadpool: every task runs exactly once per call, thread ids are in range, and the
 * pool survives many back-to-back calls. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdatomic.h>
#include <stdlib.h>

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

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_parallel_for)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
