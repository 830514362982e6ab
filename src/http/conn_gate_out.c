/* conn_gate_out: the response side of the connection gate (conn_gate.h): evhttp's replies are
 * written straight from its output buffer to the socket while their framing (head, length or
 * chunks) is followed, so the gate knows when a response is complete. */
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

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <jansson.h>

#include "conn_gate_internal.h"
#include "listener.h"

/* A response has been written completely: the connection is idle (or closes, if the client
 * ended its input and sent nothing more), and a pipelined request may proceed (both from the
 * loop, after evhttp has finished its own bookkeeping of the response). */
void gate_response_done(struct gate *g) {
    struct http_gates *gs = g->gs;
    g->streaming = false;
    if (g->rs != R_WAIT) return;
    g->half_closed = false;
    gate_release_all(g);
    g->rs = R_HEAD;
    g->begun = false;
    g->declared = -1;
    gate_arm(g, gs->lim.keepalive_timeout_ms);
    /* a client that ended its input after pipelining more requests gets them answered first:
     * the held end is handed on only once no request bytes are left */
    const bool more = evbuffer_get_length(bufferevent_get_input(g->under)) > 0;
    if (!g->probe_only && !g->eof_held) gate_idle(g, true);
    if (g->eof_held && !more) {
        g->eof_held = false;
        gate_finish(g);
    } else {
        g->want_kick = true;
        event_active(g->defer, EV_READ, 0);
    }
}

/* Parses the response head in g->ohead: what follows it (g->onext, g->oleft). */
static void take_response_head(struct gate *g) {
    const char *h = kv_buf_cstr(&g->ohead);
    int status = 0;
    sscanf(h, "HTTP/%*d.%*d %d", &status);
    int64_t cl = -1;
    bool chunked = false;
    for (const char *p = strchr(h, '\n'); p && p[1];) {
        p++;
        const char *e = strchr(p, '\n');
        if (!e) break;
        if (strncasecmp(p, "Content-Length:", 15) == 0) cl = strtoll(p + 15, NULL, 10);
        else if (strncasecmp(p, "Transfer-Encoding:", 18) == 0) {
            const char *c = strstr(p, "chunked");
            chunked = chunked || (c && c < e);
        }
        p = e;
    }
    g->ohead.len = 0;
    g->ostatus = status;
    if (status >= 100 && status < 200) g->onext = O_HEAD; /* interim: the final one follows */
    else if (g->head_method || status == 204 || status == 304 || cl == 0) g->onext = O_DONE;
    else if (chunked) g->onext = O_CHUNK_LINE;
    else if (cl > 0) {
        g->onext = O_BODY;
        g->oleft = (uint64_t)cl;
    } else g->onext = O_UNTIL_CLOSE;
}

/* The head bytes are out: enter what follows. */
static void head_written(struct gate *g) {
    g->os = g->onext;
    if (g->os == O_DONE) {
        g->os = O_HEAD;
        gate_response_done(g);
    } else if (g->os == O_CHUNK_LINE) {
        g->streaming = true;
    }
}


/* How many bytes of src belong to the current framing element (0: wait for more). */
static size_t out_segment(struct gate *g, struct evbuffer *src) {
    size_t len = evbuffer_get_length(src);
    switch (g->os) {
    case O_HEAD: {
        struct evbuffer_ptr p = evbuffer_search(src, "\r\n\r\n", 4, NULL);
        size_t n = p.pos >= 0 ? (size_t)p.pos + 4 : 0;
        if (n == 0 || n > GATE_OUT_HEAD_MAX) { /* not a head we made: pass bytes on as they are */
            g->os = O_UNTIL_CLOSE;
            return len;
        }
        char *tmp = malloc(n);
        g->ohead.len = 0;
        if (!tmp || kv_buf_append(&g->ohead, (evbuffer_copyout(src, tmp, n), tmp), n) != KV_OK) {
            free(tmp);
            g->os = O_UNTIL_CLOSE;
            return len;
        }
        free(tmp);
        take_response_head(g);
        g->os = O_HEADBYTES;
        g->ohead_left = n;
        return n;
    }
    case O_HEADBYTES: return g->ohead_left < len ? (size_t)g->ohead_left : len;
    case O_REST: return g->orest < len ? (size_t)g->orest : len;
    case O_BODY:
    case O_CHUNK_DATA: return g->oleft < len ? (size_t)g->oleft : len;
    case O_CHUNK_LINE:
    case O_CHUNK_END:
    case O_TRAILER: {
        struct evbuffer_ptr p = evbuffer_search(src, "\n", 1, NULL);
        return p.pos >= 0 ? (size_t)p.pos + 1 : len; /* evhttp writes whole lines */
    }
    default: return len;
    }
}

/* n bytes of the current element were written. */
static void out_advance(struct gate *g, size_t n, const char *line, size_t line_len, bool whole) {
    switch (g->os) {
    case O_HEADBYTES:
        g->ohead_left -= n;
        if (g->ohead_left == 0) head_written(g);
        break;
    case O_BODY:
        g->oleft -= n;
        if (g->oleft == 0) {
            g->os = O_HEAD;
            gate_response_done(g);
        }
        break;
    case O_CHUNK_DATA:
        g->oleft -= n;
        if (g->oleft == 0) g->os = O_CHUNK_END;
        break;
    case O_CHUNK_LINE:
        if (whole) {
            g->oleft = strtoull(line, NULL, 16);
            g->os = g->oleft ? O_CHUNK_DATA : O_TRAILER;
        }
        break;
    case O_CHUNK_END:
        if (whole) g->os = O_CHUNK_LINE;
        break;
    case O_TRAILER:
        if (whole && line_len <= 2) {
            g->os = O_HEAD;
            gate_response_done(g);
        }
        break;
    case O_REST:
        g->orest -= n;
        if (g->orest == 0) {
            g->os = g->pend_os;
            out_advance(g, 0, g->pend_line, g->pend_line_len, true);
        }
        break;
    default: break;
    }
}

/* Response bytes go straight from evhttp's output buffer (the filter's) to the socket, from
 * the loop (gate_on_writable), and evhttp's write callback runs when that buffer is empty, as with
 * a plain socket: evhttp learns that a write is complete (the next stream chunk, the end of a
 * response and maybe the close) only when the bytes are in the kernel. (libevent 2.1's filter
 * would move them into the socket bufferevent's buffer and report completion at once, inside
 * the call that queued them: streams would lose their backpressure, a close could drop the
 * tail of a reply, and a completion reported before evhttp registered its callback is lost.)
 * So the filter's own output function moves nothing. */
enum bufferevent_filter_result gate_out(struct evbuffer *src, struct evbuffer *dst,
                                               ev_ssize_t limit, enum bufferevent_flush_mode mode,
                                               void *ctx) {
    (void)src;
    (void)dst;
    (void)limit;
    (void)mode;
    (void)ctx;
    return BEV_NEED_MORE;
}

/* evhttp queued reply bytes: write them from the loop. */
void gate_on_reply_queued(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg) {
    (void)buf;
    struct gate *g = arg;
    if (info->n_added == 0 || g->finished || g->want_finish || g->want_error) return;
    if (!g->wev) {
        evutil_socket_t fd = bufferevent_getfd(g->under);
        if (fd < 0 || !(g->wev = event_new(g->gs->base, fd, EV_WRITE, gate_on_writable, g))) {
            g->want_error = true;
            event_active(g->defer, EV_READ, 0);
            return;
        }
    }
    if (!event_pending(g->wev, EV_WRITE, NULL)) event_add(g->wev, NULL);
}

/* Writes queued reply bytes with one writev (a head and its body in one segment, as a plain
 * bufferevent does: separate small writes meet Nagle's algorithm and the client's delayed
 * ACK, 40 ms each), then follows the framing over what the kernel took. 0, or -1 when the
 * client is gone. */
static int write_out(struct gate *g) {
    struct evbuffer *src = bufferevent_get_output(g->filt);
    evutil_socket_t fd = bufferevent_getfd(g->under);
    while (evbuffer_get_length(src) > 0) {
        struct evbuffer_iovec v[64];
        struct iovec iov[64];
        int nv = evbuffer_peek(src, -1, NULL, v, 64);
        if (nv > 64) nv = 64;
        for (int i = 0; i < nv; i++) {
            iov[i].iov_base = v[i].iov_base;
            iov[i].iov_len = v[i].iov_len;
        }
        ssize_t w = writev(fd, iov, nv);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                event_add(g->wev, NULL);
                return 0;
            }
            return -1;
        }
        size_t left = (size_t)w;
        while (left > 0) {
            size_t seg = out_segment(g, src);
            if (seg == 0) seg = left;
            size_t take = seg < left ? seg : left;
            char line[64];
            size_t line_len = 0;
            bool line_el = g->os == O_CHUNK_LINE || g->os == O_CHUNK_END || g->os == O_TRAILER;
            if (line_el) {
                line_len = seg < sizeof line - 1 ? seg : sizeof line - 1;
                evbuffer_copyout(src, line, line_len);
                line[line_len] = 0;
            }
            evbuffer_drain(src, take);
            left -= take;
            if (line_el && take < seg) { /* a partial line: its transition waits for the rest */
                memcpy(g->pend_line, line, line_len + 1);
                g->pend_line_len = line_len;
                g->pend_os = g->os;
                g->orest = seg - take;
                g->os = O_REST;
            } else {
                out_advance(g, take, line, line_len, true);
            }
        }
        if (evbuffer_get_length(src) > 0 && (size_t)w < evbuffer_get_length(src) + (size_t)w) {
            /* the kernel took less than we had: wait until it is writable */
            size_t had = 0;
            for (int i = 0; i < nv; i++) had += v[i].iov_len;
            if ((size_t)w < had) {
                event_add(g->wev, NULL);
                return 0;
            }
        }
    }
    return 0;
}

void gate_on_writable(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct gate *g = arg;
    if (!gate_alive(g) || g->want_finish || g->want_error) return;
    if (g->rs == R_CLOSING) {
        evbuffer_drain(bufferevent_get_output(g->filt), evbuffer_get_length(bufferevent_get_output(g->filt)));
        return;
    }
    if (write_out(g) < 0) { /* the client is gone */
        evbuffer_drain(bufferevent_get_output(g->filt), evbuffer_get_length(bufferevent_get_output(g->filt)));
        g->finished = true;
        g->f_ecb(g->under, BEV_EVENT_ERROR | BEV_EVENT_WRITING, g->f_arg);
        return;
    }
    /* all out: evhttp's write callback (next chunk, or the end of the response) */
    if (evbuffer_get_length(bufferevent_get_output(g->filt)) == 0)
        bufferevent_trigger(g->filt, EV_WRITE, 0);
}
