/* Unit tests of the lock-free stack and the loop wakeup (src/http/wake.c): order, no lost or
 * doubled item under concurrent producers, and no lost wakeup through loop_wake_push. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "http/wake.h"

struct item {
    int producer, seq;
    struct wake_node node;
};

static void test_stack_order(void **state) {
    (void)state;
    struct wake_stack s;
    wake_stack_init(&s);
    assert_null(wake_stack_take_all(&s));
    struct item it[5];
    for (int i = 0; i < 5; i++) {
        it[i] = (struct item){0, i, {NULL}};
        assert_int_equal(wake_stack_push(&s, &it[i].node), i == 0); /* true only when empty */
    }
    int want = 0;
    for (struct wake_node *n = wake_stack_take_all(&s); n; n = n->next)
        assert_int_equal(WAKE_ITEM(n, struct item, node)->seq, want++); /* oldest first */
    assert_int_equal(want, 5);
    assert_null(wake_stack_take_all(&s));
    assert_true(wake_stack_push(&s, &it[0].node)); /* empty again */
    struct wake_node *n = wake_stack_take_all(&s);
    assert_ptr_equal(n, &it[0].node);
    assert_null(n->next);
}

#define N_PROD 4
#define N_ITEMS 20000

struct prod {
    struct wake_stack *s;
    struct loop_wake *w; /* NULL: push only */
    struct item *items;  /* (N_ITEMS) */
    int id, n_empty;
};

static void *producer(void *arg) {
    struct prod *p = arg;
    for (int i = 0; i < N_ITEMS; i++) {
        p->items[i] = (struct item){p->id, i, {NULL}};
        if (p->w) loop_wake_push(p->w, p->s, &p->items[i].node);
        else p->n_empty += wake_stack_push(p->s, &p->items[i].node);
    }
    return NULL;
}

/* Consumes a taken list: each producer's items in its order, none twice. Returns the count. */
static int consume(struct wake_node *n, int *next_seq) {
    int k = 0;
    for (; n; n = n->next, k++) {
        struct item *it = WAKE_ITEM(n, struct item, node);
        assert_in_range(it->producer, 0, N_PROD - 1);
        assert_int_equal(it->seq, next_seq[it->producer]);
        next_seq[it->producer]++;
    }
    return k;
}

static void test_stack_concurrent(void **state) {
    (void)state;
    struct wake_stack s;
    wake_stack_init(&s);
    struct prod p[N_PROD];
    pthread_t th[N_PROD];
    for (int i = 0; i < N_PROD; i++) {
        p[i] = (struct prod){&s, NULL, calloc(N_ITEMS, sizeof(struct item)), i, 0};
        assert_non_null(p[i].items);
        assert_int_equal(pthread_create(&th[i], NULL, producer, &p[i]), 0);
    }
    int next_seq[N_PROD] = {0}, got = 0, takes = 0;
    while (got < N_PROD * N_ITEMS) { /* takes while the producers push */
        struct wake_node *n = wake_stack_take_all(&s);
        takes += n != NULL;
        got += consume(n, next_seq);
    }
    int n_empty = 0;
    for (int i = 0; i < N_PROD; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(next_seq[i], N_ITEMS);
        n_empty += p[i].n_empty;
        free(p[i].items);
    }
    assert_null(wake_stack_take_all(&s));
    /* every non-empty take took exactly one push onto an empty stack */
    assert_int_equal(n_empty, takes);
}

struct sink {
    struct wake_stack s;
    struct event_base *base;
    int next_seq[N_PROD], got, calls;
};

static void on_wake(void *arg) {
    struct sink *k = arg;
    k->calls++;
    k->got += consume(wake_stack_take_all(&k->s), k->next_seq);
    if (k->got == N_PROD * N_ITEMS) event_base_loopbreak(k->base);
}

static void test_loop_wake_push(void **state) {
    (void)state;
    struct sink k = {0};
    wake_stack_init(&k.s);
    k.base = event_base_new();
    assert_non_null(k.base);
    struct loop_wake *w = loop_wake_new(k.base, on_wake, &k);
    assert_non_null(w);
    struct prod p[N_PROD];
    pthread_t th[N_PROD];
    for (int i = 0; i < N_PROD; i++) {
        p[i] = (struct prod){&k.s, w, calloc(N_ITEMS, sizeof(struct item)), i, 0};
        assert_non_null(p[i].items);
        assert_int_equal(pthread_create(&th[i], NULL, producer, &p[i]), 0);
    }
    /* a lost wakeup leaves items on the stack and the loop waiting: the guard ends it */
    struct timeval guard = {30, 0};
    event_base_loopexit(k.base, &guard);
    event_base_dispatch(k.base);
    for (int i = 0; i < N_PROD; i++) pthread_join(th[i], NULL);
    assert_int_equal(k.got, N_PROD * N_ITEMS);
    assert_true(k.calls >= 1);
    assert_null(wake_stack_take_all(&k.s));
    for (int i = 0; i < N_PROD; i++) free(p[i].items);
    loop_wake_free(w);
    event_base_free(k.base);
}

/* Every push finds the stack empty (the producer waits for the loop to take each item), so
 * every push must signal: one lost wakeup stops the exchange. */
#define N_ROUNDS 2000

struct pingpong {
    struct wake_stack s;
    struct loop_wake *w;
    struct event_base *base;
    struct item items[N_ROUNDS];
    atomic_int taken;
    atomic_bool give_up;
};

static void on_ping(void *arg) {
    struct pingpong *pp = arg;
    for (struct wake_node *n = wake_stack_take_all(&pp->s); n; n = n->next) {
        assert_int_equal(WAKE_ITEM(n, struct item, node)->seq, atomic_load(&pp->taken));
        atomic_fetch_add(&pp->taken, 1);
    }
    if (atomic_load(&pp->taken) == N_ROUNDS) event_base_loopbreak(pp->base);
}

static void *pinger(void *arg) {
    struct pingpong *pp = arg;
    for (int i = 0; i < N_ROUNDS && !atomic_load(&pp->give_up); i++) {
        pp->items[i] = (struct item){0, i, {NULL}};
        loop_wake_push(pp->w, &pp->s, &pp->items[i].node);
        while (atomic_load(&pp->taken) <= i && !atomic_load(&pp->give_up)) sched_yield();
    }
    return NULL;
}

static void test_loop_wake_pingpong(void **state) {
    (void)state;
    struct pingpong *pp = calloc(1, sizeof *pp);
    assert_non_null(pp);
    wake_stack_init(&pp->s);
    pp->base = event_base_new();
    assert_non_null(pp->base);
    pp->w = loop_wake_new(pp->base, on_ping, pp);
    assert_non_null(pp->w);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, pinger, pp), 0);
    struct timeval guard = {30, 0}; /* a lost wakeup: the loop would wait forever */
    event_base_loopexit(pp->base, &guard);
    event_base_dispatch(pp->base);
    atomic_store(&pp->give_up, true);
    pthread_join(th, NULL);
    assert_int_equal(atomic_load(&pp->taken), N_ROUNDS);
    loop_wake_free(pp->w);
    event_base_free(pp->base);
    free(pp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stack_order),
        cmocka_unit_test(test_stack_concurrent),
        cmocka_unit_test(test_loop_wake_push),
        cmocka_unit_test(test_loop_wake_pingpong),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
