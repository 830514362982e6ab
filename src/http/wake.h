/*
 * wake: a wakeup of the loop thread from other threads that takes no lock the loop takes.
 *
 * libevent's event_active() from another thread takes the event_base's lock, which the loop
 * thread also takes between callbacks: a producer preempted while holding it (two cores shared
 * by the engine, the prep workers, the clients and other processes) parks the loop for a whole
 * scheduling period (3-15 ms seen under `perf trace -e futex` with bench/http_stall.py; the
 * loop's largest stalls). Here a producer writes to an eventfd instead (one system call, no
 * user-space lock); the loop has a persistent read event on it.
 *
 * Use: the producer queues its item under its own short lock and calls loop_wake_signal when
 * the queue was empty before; the callback, run on the loop, has already read the eventfd
 * when it runs, so it takes the whole queue (a push after that signals again).
 *
 * Thread-safety: loop_wake_new / loop_wake_free on the loop thread (before it runs / after it
 * stopped); loop_wake_signal from any thread (also async-signal-safe).
 */
#ifndef KV_HTTP_WAKE_H
#define KV_HTTP_WAKE_H

#include <event2/event.h>

struct loop_wake;

/* fn(arg) runs on base's loop after one or more signals. NULL when out of memory or
 * descriptors (nothing is left registered). */
struct loop_wake *loop_wake_new(struct event_base *base, void (*fn)(void *arg), void *arg);
void loop_wake_signal(struct loop_wake *w);
/* NULL is a no-op. */
void loop_wake_free(struct loop_wake *w);

#endif
