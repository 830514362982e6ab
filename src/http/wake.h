/*
 * wake: handing items from other threads to the loop thread without a lock the loop takes.
 *
 * libevent's event_active() from another thread takes the event_base's lock, which the loop
 * thread also takes between callbacks: a producer preempted while holding it (two cores shared
 * by the engine, the prep workers, the clients and other processes) parks the loop for a whole
 * scheduling period (3-15 ms seen under `perf trace -e futex` with bench/http_stall.py; the
 * loop's largest stalls). The same holds for a queue under a mutex both sides take. So:
 *
 *   loop_wake   an eventfd the loop has a persistent read event on; a producer writes to it
 *               (one system call, no user-space lock).
 *   wake_stack  an intrusive lock-free stack (Treiber): producers push (one compare-and-swap),
 *               the loop takes the whole stack at once (one exchange) and gets it oldest first.
 *               There is no single pop, so no ABA problem: a node is only reused after the
 *               loop took it.
 *
 *   producer:  wake_stack_push(&s, &item->node) --was empty--> loop_wake_signal(w)
 *              (loop_wake_push does both)
 *   loop:      fn(arg) (the eventfd already read) --> for (n = wake_stack_take_all(&s); n; ...)
 *              handle WAKE_ITEM(n, struct item, node)
 *
 * A push onto a non-empty stack does not signal: a wakeup is pending (the first push signalled
 * and the loop has not taken the stack yet), and the callback takes everything. A push after
 * the take finds the stack empty and signals again. The order of two producers' pushes is the
 * order their compare-and-swaps succeeded in; one producer's items come out in its order.
 *
 * Thread-safety: loop_wake_new / loop_wake_free on the loop thread (before it runs / after it
 * stopped); loop_wake_signal from any thread (also async-signal-safe). wake_stack_push from
 * any thread; wake_stack_take_all from any thread too (each node is taken once), in practice
 * the loop thread and shutdown. wake_stack_init only while no other thread uses the stack.
 */
#ifndef KV_HTTP_WAKE_H
#define KV_HTTP_WAKE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include <event2/event.h>

struct loop_wake;

/* fn(arg) runs on base's loop after one or more signals. NULL when out of memory or
 * descriptors (nothing is left registered). */
struct loop_wake *loop_wake_new(struct event_base *base, void (*fn)(void *arg), void *arg);
void loop_wake_signal(struct loop_wake *w);
/* NULL is a no-op. */
void loop_wake_free(struct loop_wake *w);

/* A link embedded in each item that travels through a wake_stack (the item owns it; it is
 * the stack's from the push until take_all returns it). */
struct wake_node {
    struct wake_node *next; /* after take_all: the next newer item, NULL at the end */
};

/* The item that embeds node n as its member `member`. */
#define WAKE_ITEM(n, type, member) ((type *)(void *)((char *)(n) - offsetof(type, member)))

/* The stack: empty when zero-initialized or after wake_stack_init. Holds borrowed nodes. */
struct wake_stack {
    _Atomic(struct wake_node *) top; /* newest first */
};

void wake_stack_init(struct wake_stack *s);
/* Pushes n (any thread, lock-free). True when the stack was empty before: the caller then
 * owes the consumer a wakeup. */
bool wake_stack_push(struct wake_stack *s, struct wake_node *n);
/* Takes every node pushed so far, leaving the stack empty; returns them oldest first, linked
 * by next (NULL: the stack was empty). */
struct wake_node *wake_stack_take_all(struct wake_stack *s);
/* wake_stack_push, then loop_wake_signal(w) when the stack was empty. */
void loop_wake_push(struct loop_wake *w, struct wake_stack *s, struct wake_node *n);

#endif
