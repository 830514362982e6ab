/* threadpool: fixed pthread pool with a generation-counted parallel-for (see threadpool.h).
 *
 * Hand-off protocol (lock-free on the hot path):
 *  - The caller writes the job (fn, ctx, n_tasks, next = 0, n_active = n_workers) and then
 *    publishes it by incrementing the atomic generation counter `gen` (seq_cst).
 *  - Workers wait for `gen` to change: first a bounded spin (pause instruction, about
 *    KV_TP_SPIN_NS), then they sleep on the `wake` condvar. A sleeping worker registers in
 *    `n_sleeping` under `mu` before re-checking `gen`; the caller loads `n_sleeping` after
 *    bumping `gen` and only then takes `mu` and broadcasts. Both sides use seq_cst, so either
 *    the worker sees the new generation or the caller sees the sleeper (no lost wake-up).
 *  - Tasks are claimed from `claim` = (generation << 32 | next task index) with a CAS, so a
 *    worker that wakes late (descheduled by another process on a shared machine) can never
 *    claim a task of a finished job: its CAS fails once the generation moved on. The job's
 *    fields live in one of two slots (generation & 1): the caller rewrites a slot only two
 *    jobs later, after every task of the job that used it finished.
 *  - Completion counts finished TASKS (`n_done` of the slot), not workers: the caller never
 *    waits for a worker that did not get the CPU in time (it just runs more of the tasks
 *    itself). It spins on `n_done` for a bounded time, then sleeps on `done` after setting
 *    `caller_sleeping` under `mu`; the thread that finishes the last task signals when it
 *    sees the flag.
 *  - After the bounded spin nobody burns CPU: an idle pool has every worker blocked in
 *    pthread_cond_wait.
 */
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

/* How long a thread spins before falling back to a condvar. Back-to-back parallel-for calls
 * (one per op of a decode step) arrive well inside this window, so they never sleep. */
#define KV_TP_SPIN_NS 50000

struct kv_threadpool {
    int n_threads;
    pthread_t *workers;      /* (n_threads - 1) */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t wake;     /* workers sleep here waiting for a new generation */
    pthread_cond_t done;     /* caller sleeps here waiting for n_active == 0 */
    atomic_uint gen;         /* bumped by the caller to publish a job */
    atomic_bool stop;
    atomic_int n_sleeping;   /* workers registered to sleep on `wake` (guarded by mu to change) */
    atomic_bool caller_sleeping;
    _Atomic uint64_t claim;  /* (generation << 32) | index of the next unclaimed task */
    unsigned caller_gen;     /* last generation published (caller only) */
    struct job_slot {        /* written by the caller before `claim` publishes them (release) */
        _Atomic(kv_task_fn) fn;
        _Atomic(void *) ctx;
        atomic_int n_tasks;
        atomic_int n_done;   /* tasks finished */
    } jobs[2];
};

struct worker_arg { kv_threadpool_t *tp; int id; };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("pause" ::: "memory");
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claims and runs tasks of generation g until none is left (or g is over). */
static void run_tasks(kv_threadpool_t *tp, int thread, unsigned g) {
    struct job_slot *js = &tp->jobs[g & 1];
    for (;;) {
        uint64_t c = atomic_load_explicit(&tp->claim, memory_order_acquire);
        if ((unsigned)(c >> 32) != g) return;
        int n = atomic_load_explicit(&js->n_tasks, memory_order_relaxed);
        if ((int64_t)(uint32_t)c >= n) return;
        /* A successful CAS proves g was still current, so n (read above) was g's. */
        if (!atomic_compare_exchange_weak_explicit(&tp->claim, &c, c + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        kv_task_fn fn = atomic_load_explicit(&js->fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&js->ctx, memory_order_relaxed);
        fn(ctx, (int)(uint32_t)c, thread);
        if (atomic_fetch_add(&js->n_done, 1) + 1 == n && atomic_load(&tp->caller_sleeping)) {
            pthread_mutex_lock(&tp->mu);
            pthread_cond_signal(&tp->done);
            pthread_mutex_unlock(&tp->mu);
        }
    }
}

/* Spins until `gen` differs from `seen` or `stop` is set; false when the spin budget ran
 * out first. */
static bool spin_for_gen(kv_threadpool_t *tp, unsigned seen) {
    int64_t deadline = 0;
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(&tp->gen, memory_order_acquire) != seen ||
            atomic_load_explicit(&tp->stop, memory_order_relaxed))
            return true;
        cpu_relax();
        if ((i & 31) == 0) {
            int64_t t = now_ns();
            if (deadline == 0) deadline = t + KV_TP_SPIN_NS;
            else if (t >= deadline) return false;
        }
    }
}

static void *worker_main(void *p) {
    struct worker_arg *a = p;
    kv_threadpool_t *tp = a->tp;
    int id = a->id;
    free(a);
    unsigned seen = 0;
    for (;;) {
        if (!spin_for_gen(tp, seen)) {
            pthread_mutex_lock(&tp->mu);
            atomic_fetch_add(&tp->n_sleeping, 1);
            while (atomic_load(&tp->gen) == seen && !atomic_load(&tp->stop))
                pthread_cond_wait(&tp->wake, &tp->mu);
            atomic_fetch_sub(&tp->n_sleeping, 1);
            pthread_mutex_unlock(&tp->mu);
        }
        if (atomic_load(&tp->stop)) break;
        seen = atomic_load(&tp->gen);
        run_tasks(tp, id, seen); /* a late wake-up joins the newest job, or finds it over */
    }
    return NULL;
}

kv_threadpool_t *kv_threadpool_new(int n_threads) {
    if (n_threads < 1) return NULL;
    kv_threadpool_t *tp = kv_calloc(1, sizeof *tp);
    if (!tp) return NULL;
    tp->n_threads = n_threads;
    pthread_mutex_init(&tp->mu, NULL);
    pthread_cond_init(&tp->wake, NULL);
    pthread_cond_init(&tp->done, NULL);
    atomic_init(&tp->gen, 0);
    atomic_init(&tp->stop, false);
    atomic_init(&tp->n_sleeping, 0);
    atomic_init(&tp->caller_sleeping, false);
    atomic_init(&tp->claim, 0);
    for (int i = 0; i < 2; i++) {
        atomic_init(&tp->jobs[i].fn, NULL);
        atomic_init(&tp->jobs[i].ctx, NULL);
        atomic_init(&tp->jobs[i].n_tasks, 0);
        atomic_init(&tp->jobs[i].n_done, 0);
    }
    if (n_threads > 1) {
        tp->workers = kv_calloc((size_t)n_threads - 1, sizeof *tp->workers);
        if (!tp->workers) { kv_threadpool_free(tp); return NULL; }
        for (int i = 0; i < n_threads - 1; i++) {
            struct worker_arg *a = kv_malloc(sizeof *a);
            if (!a) { kv_threadpool_free(tp); return NULL; }
            a->tp = tp;
            a->id = i + 1;
            if (pthread_create(&tp->workers[i], NULL, worker_main, a) != 0) {
                free(a);
                KV_ERROR("threadpool: pthread_create failed");
                kv_threadpool_free(tp);
                return NULL;
            }
            tp->n_started++;
        }
    }
    return tp;
}

void kv_threadpool_free(kv_threadpool_t *tp) {
    if (!tp) return;
    pthread_mutex_lock(&tp->mu);
    atomic_store(&tp->stop, true);
    pthread_cond_broadcast(&tp->wake);
    pthread_mutex_unlock(&tp->mu);
    for (int i = 0; i < tp->n_started; i++) pthread_join(tp->workers[i], NULL);
    free(tp->workers);
    pthread_mutex_destroy(&tp->mu);
    pthread_cond_destroy(&tp->wake);
    pthread_cond_destroy(&tp->done);
    free(tp);
}

int kv_threadpool_size(const kv_threadpool_t *tp) { return tp->n_threads; }

void kv_threadpool_for(kv_threadpool_t *tp, int n_tasks, kv_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (tp->n_threads == 1 || tp->n_started == 0 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    /* Every task of the previous job finished, so slot g & 1 (last used two jobs ago) is ours. */
    unsigned g = ++tp->caller_gen;
    if (g == 0) g = ++tp->caller_gen; /* generation 0 is the initial "no job" */
    struct job_slot *js = &tp->jobs[g & 1];
    atomic_store_explicit(&js->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&js->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&js->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&js->n_done, 0, memory_order_relaxed);
    atomic_store_explicit(&tp->claim, (uint64_t)g << 32, memory_order_release);
    atomic_store(&tp->gen, g); /* seq_cst: wakes spinners, orders against n_sleeping */
    if (atomic_load(&tp->n_sleeping) > 0) {
        pthread_mutex_lock(&tp->mu);
        pthread_cond_broadcast(&tp->wake);
        pthread_mutex_unlock(&tp->mu);
    }
    run_tasks(tp, 0, g);

    /* Wait for the tasks still running on workers: bounded spin, then the condvar. */
    int64_t deadline = 0;
    for (unsigned i = 1; atomic_load_explicit(&js->n_done, memory_order_acquire) < n_tasks; i++) {
        cpu_relax();
        if ((i & 31) == 0) {
            int64_t t = now_ns();
            if (deadline == 0) {
                deadline = t + KV_TP_SPIN_NS;
            } else if (t >= deadline) {
                pthread_mutex_lock(&tp->mu);
                atomic_store(&tp->caller_sleeping, true);
                while (atomic_load(&js->n_done) < n_tasks) pthread_cond_wait(&tp->done, &tp->mu);
                atomic_store(&tp->caller_sleeping, false);
                pthread_mutex_unlock(&tp->mu);
                break;
            }
        }
    }
}
