/*
 * threadpool: a tiny fixed-size pthread pool for parallel-for loops (attention heads,
 * element-wise ops). One caller at a time: tp_parallel_for is not reentrant and must not
 * be called concurrently on the same pool.
 *
 * Example:
 *   kv_threadpool_t *tp = kv_threadpool_new(4);           // caller + 3 workers
 *   kv_threadpool_for(tp, n_rows, row_fn, &args);          // row_fn(args, i, thread) for i < n_rows
 *   kv_threadpool_free(tp);
 *
 * Work distribution: tasks are claimed one at a time from a shared atomic counter, so the
 * mapping task -> thread varies between runs. Callers that need deterministic results must
 * make each task's result independent of which thread runs it (use `thread` only to pick a
 * per-thread scratch buffer).
 */
#ifndef KV_THREADPOOL_H
#define KV_THREADPOOL_H

#include "base.h"

typedef struct kv_threadpool kv_threadpool_t;

/* fn(ctx, task, thread): task in [0, n_tasks), thread in [0, kv_threadpool_size(tp)). */
typedef void (*kv_task_fn)(void *ctx, int task, int thread);

/* n_threads >= 1 (the calling thread counts as one; n_threads-1 workers are started).
 * NULL on failure (allocation or pthread_create; nothing left running). */
kv_threadpool_t *kv_threadpool_new(int n_threads);
/* Joins the workers. NULL is a no-op. */
void kv_threadpool_free(kv_threadpool_t *tp);
int kv_threadpool_size(const kv_threadpool_t *tp);
/* Runs fn for every task in [0, n_tasks) over all threads; returns when all are done.
 * Runs inline when n_tasks <= 1 or the pool has one thread. */
void kv_threadpool_for(kv_threadpool_t *tp, int n_tasks, kv_task_fn fn, void *ctx);

#endif
