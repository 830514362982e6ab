/* threadpool: fixed pthread pool with a generation-counted parallel-for (see threadpool.h). */
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

struct kv_threadpool {
    int n_threads;
    pthread_t *workers;      /* (n_threads - 1) */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t wake;     /* workers wait for a new generation */
    pthread_cond_t done;     /* caller waits for n_active == 0 */
    uint64_t generation;
    bool stop;
    int n_active;            /* workers still inside the current job */
    /* current job */
    kv_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next;
};

struct worker_arg { kv_threadpool_t *tp; int id; };

static void run_tasks(kv_threadpool_t *tp, int thread) {
    for (;;) {
        int t = atomic_fetch_add(&tp->next, 1);
        if (t >= tp->n_tasks) break;
        tp->fn(tp->ctx, t, thread);
    }
}

static void *worker_main(void *p) {
    struct worker_arg *a = p;
    kv_threadpool_t *tp = a->tp;
    int id = a->id;
    free(a);
    uint64_t seen = 0;
    pthread_mutex_lock(&tp->mu);
    for (;;) {
        while (!tp->stop && tp->generation == seen) pthread_cond_wait(&tp->wake, &tp->mu);
        if (tp->stop) break;
        seen = tp->generation;
        pthread_mutex_unlock(&tp->mu);
        run_tasks(tp, id);
        pthread_mutex_lock(&tp->mu);
        if (--tp->n_active == 0) pthread_cond_signal(&tp->done);
    }
    pthread_mutex_unlock(&tp->mu);
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
    atomic_init(&tp->next, 0);
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
    tp->stop = true;
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
    if (tp->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&tp->mu);
    tp->fn = fn;
    tp->ctx = ctx;
    tp->n_tasks = n_tasks;
    atomic_store(&tp->next, 0);
    tp->n_active = tp->n_started;
    tp->generation++;
    pthread_cond_broadcast(&tp->wake);
    pthread_mutex_unlock(&tp->mu);
    run_tasks(tp, 0);
    pthread_mutex_lock(&tp->mu);
    while (tp->n_active > 0) pthread_cond_wait(&tp->done, &tp->mu);
    pthread_mutex_unlock(&tp->mu);
}
