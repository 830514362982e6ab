/*
 * fault_backend: a backend that wraps another one (the CPU backend, or a test's fake) and, on
 * command, fails or holds its calls, so tests land faults and cancellations at exact engine
 * steps instead of sleeping (header-only: one test binary = one translation unit).
 *
 *   struct fault_be fb;
 *   fault_be_init(&fb, inner);              // fb.be is the backend to give engine_start
 *   fb.fail_forward_at = 3;                 // the 3rd forward call returns KV_EINTERNAL
 *   fb.fail_copy_at = 1;                    // the 1st host-tier copy (either way) fails
 *   fb.hold_forward_at = 2;                 // the 2nd forward call blocks ...
 *   fault_be_wait_held(&fb, 10000);         // ... the test sees it blocked (engine mid-step),
 *   engine_cancel(e, id);                   //     acts,
 *   fault_be_release(&fb);                  //     and lets it continue
 *
 * Counters (n_forward, n_copies) count every call, failed or not. The wrapper's ops table is
 * its own copy of the inner one with forward / kv_alloc / copy_to_host / copy_from_host
 * replaced (copies through block_ptr when the inner backend has no copy ops, as
 * backend_copy_to_host does). Thread-safety: the engine thread calls the ops, the test thread
 * the fault_be_* functions; the counters are under mu.
 */
#ifndef KV_TEST_FAULT_BACKEND_H
#define KV_TEST_FAULT_BACKEND_H

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"

struct fault_be {
    struct backend be;          /* give &fb.be to the engine */
    struct backend_ops ops;
    backend_t *inner;           /* borrowed */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_forward, n_copies;    /* calls so far (1-based numbers below) */
    int fail_forward_at;        /* 0 = never */
    int fail_forward_every;     /* > 0: every call from fail_forward_at on fails */
    int fail_copy_at;           /* host-tier copies, either direction; 0 = never */
    int hold_forward_at;        /* 0 = never */
    int held;                   /* a forward call is blocked in the hold */
    int released;
};

static inline struct fault_be *fault_be_of(backend_t *be) {
    return (struct fault_be *)((char *)be - offsetof(struct fault_be, be));
}

static inline kv_status fault_be_kv_alloc(backend_t *be, int n_blocks, const struct kv_geometry *g) {
    struct fault_be *f = fault_be_of(be);
    kv_status st = f->inner->ops->kv_alloc(f->inner, n_blocks, g);
    be->geom = f->inner->geom;
    be->n_blocks = f->inner->n_blocks;
    return st;
}

static inline kv_status fault_be_forward(backend_t *be, const struct batch *b, float *logits,
                                         char *err, size_t errlen) {
    struct fault_be *f = fault_be_of(be);
    pthread_mutex_lock(&f->mu);
    int k = ++f->n_forward;
    if (f->hold_forward_at && k == f->hold_forward_at) {
        f->held = 1;
        pthread_cond_broadcast(&f->cv);
        while (!f->released) pthread_cond_wait(&f->cv, &f->mu);
        f->held = 0;
    }
    bool fail = f->fail_forward_at && (k == f->fail_forward_at ||
                                       (f->fail_forward_every && k > f->fail_forward_at));
    pthread_mutex_unlock(&f->mu);
    if (fail) {
        snprintf(err, errlen, "injected forward failure (call %d)", k);
        return KV_EINTERNAL;
    }
    return f->inner->ops->forward(f->inner, b, logits, err, errlen);
}

static inline bool fault_be_copy_fails(struct fault_be *f) {
    pthread_mutex_lock(&f->mu);
    int k = ++f->n_copies;
    bool fail = f->fail_copy_at && k == f->fail_copy_at;
    pthread_mutex_unlock(&f->mu);
    return fail;
}

static inline kv_status fault_be_copy_to_host(backend_t *be, const int32_t *blocks,
                                              void *const *host, int n) {
    struct fault_be *f = fault_be_of(be);
    if (fault_be_copy_fails(f)) return KV_EIO;
    return backend_copy_to_host(f->inner, blocks, host, n);
}

static inline kv_status fault_be_copy_from_host(backend_t *be, const void *const *host,
                                                const int32_t *blocks, int n) {
    struct fault_be *f = fault_be_of(be);
    if (fault_be_copy_fails(f)) return KV_EIO;
    return backend_copy_from_host(f->inner, host, blocks, n);
}

static inline kv_status fault_be_copy_blocks(backend_t *be, const int32_t *src, const int32_t *dst,
                                             int n) {
    struct fault_be *f = fault_be_of(be);
    return f->inner->ops->copy_blocks(f->inner, src, dst, n);
}

static inline float *fault_be_block_ptr(backend_t *be, int b) {
    struct fault_be *f = fault_be_of(be);
    return f->inner->ops->block_ptr(f->inner, b);
}

static inline void fault_be_free_op(backend_t *be) { (void)be; /* the test frees inner */ }

static inline void fault_be_init(struct fault_be *f, backend_t *inner) {
    memset(f, 0, sizeof *f);
    f->inner = inner;
    f->ops = *inner->ops;
    f->ops.name = "fault";
    f->ops.kv_alloc = fault_be_kv_alloc;
    f->ops.forward = fault_be_forward;
    f->ops.copy_to_host = fault_be_copy_to_host;
    f->ops.copy_from_host = fault_be_copy_from_host;
    f->ops.copy_blocks = inner->ops->copy_blocks ? fault_be_copy_blocks : NULL;
    f->ops.block_ptr = inner->ops->block_ptr ? fault_be_block_ptr : NULL;
    f->ops.free = fault_be_free_op;
    f->be = *inner;
    f->be.ops = &f->ops;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
}

/* Waits (up to timeout_ms) until a forward call is blocked in the hold; 0 ok, -1 timeout. */
static inline int fault_be_wait_held(struct fault_be *f, int timeout_ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    int rc = 0;
    pthread_mutex_lock(&f->mu);
    while (!f->held && rc == 0) rc = pthread_cond_timedwait(&f->cv, &f->mu, &ts);
    pthread_mutex_unlock(&f->mu);
    return f->held ? 0 : -1;
}

static inline void fault_be_release(struct fault_be *f) {
    pthread_mutex_lock(&f->mu);
    f->released = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* Re-arms the hold for another call number (after a release). */
static inline void fault_be_hold_at(struct fault_be *f, int call) {
    pthread_mutex_lock(&f->mu);
    f->hold_forward_at = call;
    f->released = 0;
    pthread_mutex_unlock(&f->mu);
}

static inline void fault_be_destroy(struct fault_be *f) {
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
}

#endif
