/* conn_gate: per-connection framing, validation and limits in front of evhttp (conn_gate.h).
 *
 * Each accepted connection gets a socket bufferevent ("under") wrapped in a filter bufferevent
 * ("filt") that evhttp uses as its connection. gate_in (conn_gate_head.c) sees the client's
 * bytes; the replies are written by conn_gate_out.c. The under's callbacks are the filter's
 * own, called through wrappers, so the gate also sees end-of-input and write-drained events
 * first. This file: the lifecycle, the budget, timers, refusals and socket events.
 *
 *   request side (rs):  HEAD --head ok, body--> BODY | CHUNK_* --body done--> WAIT
 *                         \--head ok, no body------------------------------>  WAIT
 *                       WAIT --response complete (gate_out)--> HEAD (keep-alive timer)
 *                       any --refusal--> CLOSING (answer written, then shutdown, linger, close)
 */
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <jansson.h>

#include "conn_gate_internal.h"
#include "listener.h"

/* ------------------------------------------------------------------ budget, timers */

static void gates_unref(struct http_gates *gs) {
    if (--gs->refs == 0) free(gs);
}

bool gate_reserve(struct gate *g, size_t n) {
    struct http_gates *gs = g->gs;
    if (n > gs->lim.max_buffered_bytes - gs->st.buffered_bytes) return false;
    gs->st.buffered_bytes += n;
    g->reserved += n;
    return true;
}

void gate_release_all(struct gate *g) {
    g->gs->st.buffered_bytes -= g->reserved;
    g->reserved = 0;
}

void gate_arm(struct gate *g, int ms) {
    if (ms <= 0) {
        evtimer_del(g->timer);
        return;
    }
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    evtimer_add(g->timer, &tv);
}

void gate_idle(struct gate *g, bool on) {
    struct http_gates *gs = g->gs;
    if (on == g->idle) return;
    if (on) {
        g->idle_prev = gs->idle_new;
        g->idle_next = NULL;
        if (gs->idle_new) gs->idle_new->idle_next = g;
        else gs->idle_old = g;
        gs->idle_new = g;
    } else {
        if (g->idle_prev) g->idle_prev->idle_next = g->idle_next;
        else gs->idle_old = g->idle_next;
        if (g->idle_next) g->idle_next->idle_prev = g->idle_prev;
        else gs->idle_new = g->idle_prev;
        g->idle_prev = g->idle_next = NULL;
    }
    g->idle = on;
}

/* ------------------------------------------------------------------ refusals */

static const char *reason_of(int status) {
    switch (status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
    }
}

/* Hands the end of input to evhttp, which frees the connection (and so this gate), from
 * the loop: never inside a call that evhttp or the filter is still running. */
void gate_finish(struct gate *g) {
    gate_idle(g, false);
    if (g->finished || g->want_finish) return;
    g->want_finish = true;
    evtimer_del(g->timer);
    gate_release_all(g);
    event_active(g->defer, EV_READ, 0);
}

/* Writes an OpenAI error answer on the socket (after whatever is queued there) and closes
 * the connection once it is flushed: shutdown of our side, then the client's remaining
 * bytes are read and dropped for up to GATE_LINGER_MS (closing with unread input would
 * reset the connection and could destroy the answer before the client reads it). */
void gate_refuse(struct gate *g, int status, const char *code, const char *fmt, ...) {
    if (g->rs == R_CLOSING || g->finished) return;
    struct http_gates *gs = g->gs;
    gate_idle(g, false);
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (status == 408) gs->st.timeouts++;
    else if (status == 413) gs->st.refused_too_large++;
    else if (status == 503) *(g->refuse_conn ? &gs->st.refused_connections : &gs->st.refused_busy) += 1;
    else gs->st.refused_bad++;
    http_reply_count(gs->reply, status);
    json_t *o = json_pack("{s:{s:s, s:s, s:n, s:s?}}", "error", "message", msg, "type",
                          status >= 500 ? "server_error" : "invalid_request_error", "param",
                          "code", code);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    const char *b = body ? body : "{\"error\":{\"message\":\"refused\",\"type\":\"server_error\"}}";
    struct evbuffer *out = bufferevent_get_output(g->under);
    evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                        "Content-Length: %zu\r\nConnection: close\r\n", status, reason_of(status),
                        strlen(b));
    if (gs->reply && gs->reply->id_header && gs->reply->id_value && *gs->reply->id_value)
        evbuffer_add_printf(out, "%s: %s\r\n", gs->reply->id_header, gs->reply->id_value);
    if (status == 503) evbuffer_add_printf(out, "Retry-After: 1\r\n");
    evbuffer_add_printf(out, "\r\n%s", g->head_method ? "" : b); /* HEAD: the head alone */
    free(body);
    KV_DEBUG("%s: refused a request: %d %s", gs->name, status, msg);
    g->rs = R_CLOSING;
    g->linger_start_ns = kv_now_ns();
    /* the declared body that is probably on its way, else a little: a client flooding us
     * with headers is not read for long */
    g->linger_left = (g->declared > 0 ? (uint64_t)g->declared : 0) + ((uint64_t)1 << 20);
    if (g->linger_left > ((uint64_t)1 << 30)) g->linger_left = (uint64_t)1 << 30;
    gate_release_all(g);
    gate_arm(g, GATE_LINGER_MS);
    bufferevent_enable(g->under, EV_WRITE);
}

/* Is the connection still evhttp's? When evhttp frees it (inside one of its callbacks),
 * libevent clears the socket bufferevent's callbacks at once and frees the memory later. */
bool gate_alive(struct gate *g) {
    if (g->finished) return false;
    bufferevent_data_cb r = NULL;
    bufferevent_getcb(g->under, &r, NULL, NULL, NULL);
    if (r != NULL) return true;
    g->finished = true;
    return false;
}

/* Has the client reset the connection? A client that closed its socket completely answers
 * our first bytes after its end of input with a reset; one that only shut down its sending
 * side takes them. Read from the TCP state (TCP_INFO): a peek would consume the pending error. */
static bool peer_reset(evutil_socket_t fd) {
#ifdef TCP_INFO
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0) return ti.tcpi_state == TCP_CLOSE;
#endif
    int err = 0;
    socklen_t el = sizeof err;
    return getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0;
}

/* Nothing of the current request's answer has been queued or written (an interim 1xx from
 * evhttp aside). */
static bool answer_not_begun(struct gate *g) {
    return g->os == O_HEAD && g->ohead.len == 0 &&
           evbuffer_get_length(bufferevent_get_output(g->filt)) == 0 &&
           evbuffer_get_length(bufferevent_get_output(g->under)) == 0;
}

/* The client's input ended while its request is being answered. TCP cannot tell a client that
 * shut down its sending side (it reads the answer: docs/api.md) from one that closed its socket
 * (gone: its request must be cancelled) until we send it something: the closed one answers
 * with a reset. So the end is held and taken for a half-close, and bytes go out at once: the
 * answer's own, or, when it has not begun (a request still being prepared or computed), an
 * interim "100 Continue" (RFC 9110 15.2: an HTTP/1.1 client must parse unexpected 1xx
 * answers). The gate's timer then watches for the reset (GATE_WATCH_MS), as do the writes
 * of the answer and http_gate_client_gone; a reset hands an error to evhttp, which closes
 * the connection (its close callback cancels the request). HTTP/1.0 allows no 1xx: an end of
 * input before its answer began is a disconnect, as it was. */
bool gate_input_ended(struct gate *g) {
    if (g->rs != R_WAIT || g->finished) return false;
    if (g->half_closed) return true;
    evutil_socket_t fd = bufferevent_getfd(g->under);
    if (fd < 0 || peer_reset(fd)) return false;
    if (answer_not_begun(g)) {
        if (g->http10) return false;
        static const char probe[] = "HTTP/1.1 100 Continue\r\n\r\n";
        if (send(fd, probe, sizeof probe - 1, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)(sizeof probe - 1))
            return false; /* a short write cannot happen on an idle socket: the client is gone */
    }
    g->half_closed = true;
    gate_arm(g, GATE_WATCH_MS);
    return true;
}

/* The request is complete (its last byte is passed to evhttp). A client that shut down its
 * sending side right after it (the end of input is already queued behind the request) is
 * handled by gate_input_ended at once; one whose end arrives later, when it is seen (on the
 * socket once evhttp reads again, or by http_gate_client_gone). */
void gate_request_complete(struct gate *g) {
    g->rs = R_WAIT;
    evtimer_del(g->timer);
    g->half_closed = false;
    evutil_socket_t fd = bufferevent_getfd(g->under);
    if (fd >= 0 && evbuffer_get_length(bufferevent_get_input(g->under)) == 0) {
        char c;
        if (recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0 && !gate_input_ended(g) && g->http10)
            g->half_closed = true; /* HTTP/1.0 with its end of input: read the answer (no probe) */
    }
}

/* ------------------------------------------------------------------ socket events */

static void on_under_read(struct bufferevent *bev, void *arg) {
    struct gate *g = arg;
    g->f_rcb(bev, g->f_arg);
}

static void on_under_write(struct bufferevent *bev, void *arg) {
    struct gate *g = arg;
    if (g->rs == R_CLOSING) { /* our refusal is flushed: stop sending, linger on input */
        if (!g->finished && evbuffer_get_length(bufferevent_get_output(bev)) == 0) {
            evutil_socket_t fd = bufferevent_getfd(bev);
            if (fd >= 0) shutdown(fd, SHUT_WR);
            bufferevent_enable(bev, EV_READ);
        }
        return;
    }
    g->f_wcb(bev, g->f_arg);
}

static void on_under_event(struct bufferevent *bev, short what, void *arg) {
    struct gate *g = arg;
    if (g->finished) return;
    if (g->rs == R_CLOSING) {
        gate_finish(g);
        return;
    }
    /* The client ended its input after a complete request that is still being answered
     * (evhttp reads again once it starts a reply): a half-close until a reset says otherwise
     * (gate_input_ended); the end is handed to evhttp when the answer is out. */
    if ((what & BEV_EVENT_EOF) && !(what & BEV_EVENT_ERROR) && g->rs == R_WAIT && gate_input_ended(g)) {
        g->eof_held = true;
        return;
    }
    g->f_ecb(bev, what, g->f_arg);
}

static void on_defer(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct gate *g = arg;
    if (!gate_alive(g)) return;
    if (g->want_error || g->want_finish) {
        g->finished = true;
        g->f_ecb(g->under, g->want_error ? BEV_EVENT_ERROR | BEV_EVENT_WRITING
                                         : BEV_EVENT_EOF | BEV_EVENT_READING, g->f_arg);
        return;
    }
    if (g->want_kick) {
        g->want_kick = false;
        if (g->rs == R_HEAD && evbuffer_get_length(bufferevent_get_input(g->under)))
            g->f_rcb(g->under, g->f_arg);
    }
}


static void on_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct gate *g = arg;
    struct http_gates *gs = g->gs;
    if (g->finished) return;
    if (g->refuse_conn && g->rs != R_CLOSING) {
        gate_refuse(g, 503, "too_many_connections", "too many open connections (limit %d); retry shortly",
               gs->lim.max_connections);
        return;
    }
    switch (g->rs) {
    case R_CLOSING: gate_finish(g); return;
    case R_WAIT: /* a held end of input: watch for the client's reset */
        if (!g->half_closed) return;
        if (peer_reset(bufferevent_getfd(g->under))) {
            KV_DEBUG("%s: a half-closed client reset the connection", gs->name);
            g->half_closed = false;
            g->want_error = true;
            event_active(g->defer, EV_READ, 0);
        } else {
            gate_arm(g, GATE_WATCH_MS);
        }
        return;
    case R_HEAD:
        if (!g->begun) { /* idle between requests */
            gs->st.idle_closed++;
            gate_finish(g);
            return;
        }
        gate_refuse(g, 408, "request_timeout", "request head not received within %d ms",
               gs->lim.header_timeout_ms);
        return;
    default:
        gate_refuse(g, 408, "request_timeout", "request body stalled for %d ms", gs->lim.header_timeout_ms);
        return;
    }
}

/* ------------------------------------------------------------------ lifecycle */

static void gate_free_ctx(void *ctx) {
    struct gate *g = ctx;
    struct http_gates *gs = g->gs;
    gate_idle(g, false);
    gate_release_all(g);
    gs->st.connections--;
    if (g->shed) gs->shedding--;
    if (g->timer) event_free(g->timer);
    if (g->defer) event_free(g->defer);
    if (g->wev) event_free(g->wev);
    kv_buf_free(&g->head);
    kv_buf_free(&g->line);
    kv_buf_free(&g->ohead);
    free(g);
    gates_unref(gs);
}

static struct bufferevent *gate_bevcb(struct event_base *base, void *arg) {
    struct http_gates *gs = arg;
    struct bufferevent *under = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    struct gate *g = calloc(1, sizeof *g);
    struct event *timer = NULL;
    if (!under || !g) goto fail;
    g->gs = gs;
    g->under = under;
    g->declared = -1;
    timer = evtimer_new(base, on_timer, g);
    g->defer = event_new(base, -1, 0, on_defer, g);
    if (!timer || !g->defer) goto fail;
    g->timer = timer;
    kv_buf_init(&g->head);
    kv_buf_init(&g->line);
    kv_buf_init(&g->ohead);
    g->filt = bufferevent_filter_new(under, gate_in, gate_out, BEV_OPT_CLOSE_ON_FREE, gate_free_ctx, g);
    if (!g->filt) goto fail;
    /* from here the filter owns under and g (gate_free_ctx) */
    gs->refs++;
    gs->st.connections++;
    bufferevent_getcb(under, &g->f_rcb, &g->f_wcb, &g->f_ecb, &g->f_arg);
    bufferevent_setcb(under, on_under_read, on_under_write, on_under_event, g);
    bufferevent_setwatermark(under, EV_READ, 0, GATE_SOCKET_READ_MAX);
    evbuffer_add_cb(bufferevent_get_output(g->filt), gate_on_reply_queued, g);
    /* At the cap: the connection that has waited longest for a request's first byte (a fresh
     * one or an idle keep-alive one) is closed to make room, as nginx reuses its "reusable"
     * connections; without one, a few more connections may still send a probe
     * (GATE_PROBE_RESERVE), and past those a new connection gets 503. */
    int over = gs->st.connections - gs->shedding - gs->lim.max_connections;
    struct gate *old = over > 0 ? gs->idle_old : NULL;
    while (old && evbuffer_get_length(bufferevent_get_input(old->under))) /* a request waits there */
        old = old->idle_next;
    if (old) {
        old->shed = true;
        gs->shedding++;
        gs->st.idle_shed++;
        KV_DEBUG("%s: at the connection cap (%d): closing the longest idle connection", gs->name,
                 gs->lim.max_connections);
        gate_finish(old);
        over = 0;
    }
    if (over > GATE_PROBE_RESERVE) {
        g->refuse_conn = true;
        gate_arm(g, 1); /* the socket is set after we return */
    } else if (over > 0) {
        g->probe_only = true;
        gate_arm(g, gs->lim.header_timeout_ms < GATE_PROBE_HEAD_MS ? gs->lim.header_timeout_ms : GATE_PROBE_HEAD_MS);
    } else {
        gate_idle(g, true);
        gate_arm(g, gs->lim.header_timeout_ms);
    }
    return g->filt;
fail:
    KV_WARN("%s: out of memory for a new connection", gs->name);
    if (timer) event_free(timer);
    if (g && g->defer) event_free(g->defer);
    free(g);
    if (under) bufferevent_free(under);
    return NULL; /* evhttp then makes a plain socket bufferevent itself */
}

/* The gate of an evhttp connection, or NULL (a plain connection, or one being freed). */
static struct gate *gate_of(struct evhttp_connection *conn) {
    struct bufferevent *filt = conn ? evhttp_connection_get_bufferevent(conn) : NULL;
    struct bufferevent *under = filt ? bufferevent_get_underlying(filt) : NULL;
    if (!under) return NULL;
    bufferevent_data_cb r = NULL;
    void *arg = NULL;
    bufferevent_getcb(under, &r, NULL, NULL, &arg);
    return r == on_under_read ? arg : NULL;
}

bool http_gate_client_gone(struct evhttp_connection *conn) {
    struct gate *g = gate_of(conn);
    struct bufferevent *bev = g ? g->under : conn ? evhttp_connection_get_bufferevent(conn) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1; /* the socket's, not the filter's */
    if (fd < 0) return false;
    if (g && g->half_closed) return peer_reset(fd);
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return false;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    return !(g && gate_input_ended(g));
}

bool http_gate_input_held(struct evhttp_connection *conn) {
    struct gate *g = gate_of(conn);
    return g && !g->finished && g->rs == R_WAIT && g->half_closed;
}

struct http_gates *http_gates_new(struct event_base *base, struct evhttp *http,
                                  const struct http_gate_limits *lim,
                                  const struct http_reply_ctx *reply, const char *name) {
    struct http_gates *gs = calloc(1, sizeof *gs);
    if (!gs) return NULL;
    gs->base = base;
    gs->reply = reply;
    gs->refs = 1;
    snprintf(gs->name, sizeof gs->name, "%s", name ? name : "http");
    struct http_gate_limits d = lim ? *lim : (struct http_gate_limits){0};
    if (!d.max_head_bytes) d.max_head_bytes = (size_t)1 << 20;
    if (d.max_headers <= 0) d.max_headers = 256;
    if (!d.max_body_bytes) d.max_body_bytes = (size_t)16 << 20;
    if (!d.max_buffered_bytes) d.max_buffered_bytes = (size_t)256 << 20;
    if (d.max_connections <= 0) {
        d.max_connections = 4096;
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
            rl.rlim_cur < (rlim_t)d.max_connections + 64)
            d.max_connections = rl.rlim_cur > 128 ? (int)rl.rlim_cur - 64 : 64;
    }
    if (d.header_timeout_ms <= 0) d.header_timeout_ms = 60000;
    if (d.keepalive_timeout_ms <= 0) d.keepalive_timeout_ms = 75000;
    gs->lim = d;
    evhttp_set_bevcb(http, gate_bevcb, gs);
    return gs;
}

const struct http_gate_limits *http_gates_limits(const struct http_gates *gs) { return &gs->lim; }

void http_gates_stats(const struct http_gates *gs, struct http_gate_stats *out) {
    if (gs) *out = gs->st;
    else memset(out, 0, sizeof *out);
}

void http_gates_release(struct http_gates *gs) {
    if (gs) gates_unref(gs);
}
