/* wake: an eventfd-based wakeup of the loop thread and the lock-free stack (wake.h). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "wake.h"

struct loop_wake {
    int fd;
    struct event *ev;
    void (*fn)(void *arg);
    void *arg;
};

static void on_readable(evutil_socket_t fd, short what, void *arg) {
    (void)what;
    struct loop_wake *w = arg;
    uint64_t n;
    /* read first: a signal sent while fn runs is then seen by the next callback */
    while (read(fd, &n, sizeof n) < 0 && errno == EINTR) {}
    w->fn(w->arg);
}

struct loop_wake *loop_wake_new(struct event_base *base, void (*fn)(void *arg), void *arg) {
    struct loop_wake *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->fn = fn;
    w->arg = arg;
    w->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->fd < 0) {
        free(w);
        return NULL;
    }
    w->ev = event_new(base, w->fd, EV_READ | EV_PERSIST, on_readable, w);
    if (!w->ev || event_add(w->ev, NULL) != 0) {
        if (w->ev) event_free(w->ev);
        close(w->fd);
        free(w);
        return NULL;
    }
    return w;
}

void loop_wake_signal(struct loop_wake *w) {
    uint64_t one = 1;
    /* EAGAIN: the counter is at its maximum, a wakeup is pending anyway */
    while (write(w->fd, &one, sizeof one) < 0 && errno == EINTR) {}
}

void loop_wake_free(struct loop_wake *w) {
    if (!w) return;
    event_free(w->ev);
    close(w->fd);
    free(w);
}

void wake_stack_init(struct wake_stack *s) { atomic_store(&s->top, NULL); }

bool wake_stack_push(struct wake_stack *s, struct wake_node *n) {
    struct wake_node *old = atomic_load(&s->top);
    do n->next = old;
    while (!atomic_compare_exchange_weak(&s->top, &old, n));
    return old == NULL;
}

struct wake_node *wake_stack_take_all(struct wake_stack *s) {
    struct wake_node *list = atomic_exchange(&s->top, NULL), *fifo = NULL;
    while (list) { /* newest first -> the order the nodes were pushed in */
        struct wake_node *n = list->next;
        list->next = fifo;
        fifo = list;
        list = n;
    }
    return fifo;
}

void loop_wake_push(struct loop_wake *w, struct wake_stack *s, struct wake_node *n) {
    if (wake_stack_push(s, n)) loop_wake_signal(w); /* else a wakeup is pending: the loop takes all */
}
