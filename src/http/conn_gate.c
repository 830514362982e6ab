/* conn_gate: per-connection framing, validation and limits in front of evhttp (conn_gate.h).
 *
 * Each accepted connection gets a socket bufferevent ("under") wrapped in a filter bufferevent
 * ("filt") that evhttp uses as its connection. gate_in sees the client's bytes, gate_out the
 * replies. The under's callbacks are the filter's own, called through wrappers, so the gate
 * also sees end-of-input and write-drained events first.
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

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <jansson.h>

#include "conn_gate.h"
#include "listener.h"

#define GATE_SOCKET_READ_MAX ((size_t)64 << 10) /* socket bytes held while a request is answered */
#define GATE_LINE_MAX 8192                        /* chunk-size and trailer lines */
#define GATE_OUT_HEAD_MAX ((size_t)64 << 10)      /* our own response heads */
/* After a refusal the client's bytes are read and dropped (nginx's lingering close: up to 5 s
 * between reads, 30 s in all), so a client still sending its body reads the answer instead of
 * a reset. */
#define GATE_LINGER_MS 5000
#define GATE_LINGER_TOTAL_NS 30000000000ull

struct http_gates {
    struct event_base *base;
    struct http_gate_limits lim;
    const struct http_reply_ctx *reply;
    char name[32];
    int refs; /* the owner's + one per live gate */
    struct http_gate_stats st;
};

enum rstate { R_HEAD, R_BODY, R_CHUNK_LINE, R_CHUNK_DATA, R_CHUNK_END, R_TRAILER, R_WAIT, R_CLOSING };
/* response side: O_HEAD (find and parse a head) -> O_HEADBYTES (write it) -> what it announced;
 * O_REST finishes a line element (chunk size, chunk end, trailer) the socket took in part */
enum ostate { O_HEAD, O_HEADBYTES, O_BODY, O_CHUNK_LINE, O_CHUNK_DATA, O_CHUNK_END, O_TRAILER,
              O_UNTIL_CLOSE, O_DONE, O_REST };

struct gate {
    struct http_gates *gs;
    struct bufferevent *under, *filt;
    bufferevent_data_cb f_rcb, f_wcb;
    bufferevent_event_cb f_ecb;
    void *f_arg;
    struct event *timer;
    struct event *defer;  /* runs on_defer from the loop (never inside evhttp's own calls) */
    struct event *wev;    /* the socket is writable again (a reply was written in part) */
    bool want_finish;     /* on_defer: hand the end of input to evhttp */
    bool want_error;      /* on_defer: hand a write error to evhttp */
    bool want_kick;       /* on_defer: run a request that waited in the socket buffer */
    /* request side */
    enum rstate rs;
    kv_buf head;        /* the head being read */
    bool begun;         /* a byte of the next request has arrived */
    size_t line_start;
    int n_lines;
    uint64_t body_left; /* R_BODY: bytes to pass; R_CHUNK_DATA: bytes of this chunk */
    uint64_t body_total;
    kv_buf line;        /* a chunk-size or trailer line */
    size_t reserved;    /* bytes of the budget held by the current request */
    bool head_method;   /* the request being answered is a HEAD */
    bool half_closed;   /* the client's input had ended when its request was complete */
    bool eof_held;      /* ... and that end is kept from evhttp until the answer is out */
    bool refuse_conn;   /* over max_connections: answer 503 once the socket is set */
    bool finished;      /* EOF handed to evhttp: the connection is being freed */
    uint64_t linger_start_ns;
    uint64_t linger_left; /* bytes still dropped after a refusal before closing */
    int64_t declared;     /* Content-Length of the request being read; -1 none */
    /* response side */
    enum ostate os, onext, pend_os;
    int ostatus;
    kv_buf ohead;
    uint64_t oleft, ohead_left, orest;
    char pend_line[64];   /* O_REST: the line being finished */
    size_t pend_line_len;
    bool streaming;     /* a chunked response is under way */
};

/* ------------------------------------------------------------------ budget, timers */

static void gates_unref(struct http_gates *gs) {
    if (--gs->refs == 0) free(gs);
}

static bool reserve(struct gate *g, size_t n) {
    struct http_gates *gs = g->gs;
    if (n > gs->lim.max_buffered_bytes - gs->st.buffered_bytes) return false;
    gs->st.buffered_bytes += n;
    g->reserved += n;
    return true;
}

static void release_all(struct gate *g) {
    g->gs->st.buffered_bytes -= g->reserved;
    g->reserved = 0;
}

static void arm(struct gate *g, int ms) {
    if (ms <= 0) {
        evtimer_del(g->timer);
        return;
    }
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    evtimer_add(g->timer, &tv);
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
static void finish(struct gate *g) {
    if (g->finished || g->want_finish) return;
    g->want_finish = true;
    evtimer_del(g->timer);
    release_all(g);
    event_active(g->defer, EV_READ, 0);
}

/* Writes an OpenAI error answer on the socket (after whatever is queued there) and closes
 * the connection once it is flushed: shutdown of our side, then the client's remaining
 * bytes are read and dropped for up to GATE_LINGER_MS (closing with unread input would
 * reset the connection and could destroy the answer before the client reads it). */
static void refuse(struct gate *g, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void refuse(struct gate *g, int status, const char *code, const char *fmt, ...) {
    if (g->rs == R_CLOSING || g->finished) return;
    struct http_gates *gs = g->gs;
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
    release_all(g);
    arm(g, GATE_LINGER_MS);
    bufferevent_enable(g->under, EV_WRITE);
}

/* Is the connection still evhttp's? When evhttp frees it (inside one of its callbacks),
 * libevent clears the socket bufferevent's callbacks at once and frees the memory later. */
static bool alive(struct gate *g) {
    if (g->finished) return false;
    bufferevent_data_cb r = NULL;
    bufferevent_getcb(g->under, &r, NULL, NULL, NULL);
    if (r != NULL) return true;
    g->finished = true;
    return false;
}

/* The request is complete (its last byte is passed to evhttp). A client that shut down its
 * sending side right after it (the end of input is already queued behind the request) wants
 * the answer: remember it, so that end of input is not taken for a disconnect. An end that
 * arrives later, while the request is answered, is one. */
static void request_complete(struct gate *g) {
    g->rs = R_WAIT;
    evtimer_del(g->timer);
    g->half_closed = false;
    evutil_socket_t fd = bufferevent_getfd(g->under);
    if (fd >= 0 && evbuffer_get_length(bufferevent_get_input(g->under)) == 0) {
        char c;
        g->half_closed = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
    }
}

/* ------------------------------------------------------------------ head parsing */

static bool is_tchar(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

static bool ieq(const char *a, size_t n, const char *b) {
    return strlen(b) == n && strncasecmp(a, b, n) == 0;
}

static const char *trim(const char *s, const char *e, const char **end) {
    while (s < e && (*s == ' ' || *s == '\t')) s++;
    while (e > s && (e[-1] == ' ' || e[-1] == '\t')) e--;
    *end = e;
    return s;
}

/* Adds every value of a Content-Length field ("5" or "5, 5") to *cl; false when a value is
 * not digits or differs from one seen before. */
static bool merge_content_length(const char *v, const char *e, int64_t *cl) {
    while (v < e) {
        const char *c = memchr(v, ',', (size_t)(e - v));
        const char *ve, *vs = trim(v, c ? c : e, &ve);
        if (vs == ve || ve - vs > 18) return false;
        int64_t x = 0;
        for (const char *p = vs; p < ve; p++) {
            if (*p < '0' || *p > '9') return false;
            x = x * 10 + (*p - '0');
        }
        if (*cl >= 0 && *cl != x) return false;
        *cl = x;
        v = c ? c + 1 : e;
    }
    return true;
}

/* Validates the complete head in g->head (lines end in LF, optional CR before it) and writes
 * the normalized head to dst. Returns false after refusing. */
static bool take_head(struct gate *g, struct evbuffer *dst) {
    struct http_gates *gs = g->gs;
    const char *h = g->head.data, *end = h + g->head.len;
    /* request line */
    const char *le = memchr(h, '\n', (size_t)(end - h));
    const char *rl_end = le > h && le[-1] == '\r' ? le - 1 : le;
    const char *sp1 = memchr(h, ' ', (size_t)(rl_end - h));
    const char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(rl_end - sp1 - 1)) : NULL;
    if (!sp1 || !sp2 || sp1 == h || sp2 == sp1 + 1 || memchr(sp2 + 1, ' ', (size_t)(rl_end - sp2 - 1))) {
        refuse(g, 400, "bad_request_line", "malformed request line (want METHOD SP target SP HTTP/1.1)");
        return false;
    }
    for (const char *p = h; p < sp1; p++)
        if (!is_tchar((unsigned char)*p)) {
            refuse(g, 400, "bad_request_line", "malformed method in the request line");
            return false;
        }
    for (const char *p = sp1 + 1; p < sp2; p++)
        if ((unsigned char)*p <= 0x20 || *p == 0x7f) {
            refuse(g, 400, "bad_request_line", "control byte in the request target");
            return false;
        }
    size_t vlen = (size_t)(rl_end - sp2 - 1);
    const char *ver = sp2 + 1;
    if (vlen != 8 || strncmp(ver, "HTTP/1.", 7) != 0 || (ver[7] != '0' && ver[7] != '1')) {
        if (vlen >= 5 && strncmp(ver, "HTTP/", 5) == 0)
            refuse(g, 505, "http_version_not_supported", "HTTP version %.*s is not supported (HTTP/1.0 and HTTP/1.1 are)",
                   (int)(vlen > 16 ? 16 : vlen), ver);
        else refuse(g, 400, "bad_request_line", "malformed HTTP version in the request line");
        return false;
    }
    bool http10 = ver[7] == '0';
    {   /* the target must parse as evhttp parses it (else libevent answers an HTML 400) */
        size_t tl = (size_t)(sp2 - sp1 - 1);
        char *tgt = malloc(tl + 1);
        struct evhttp_uri *u = NULL;
        if (tgt) {
            memcpy(tgt, sp1 + 1, tl);
            tgt[tl] = 0;
            u = evhttp_uri_parse_with_flags(tgt, EVHTTP_URI_NONCONFORMANT);
            free(tgt);
        }
        if (!u) {
            refuse(g, 400, "bad_request_line", "malformed request target");
            return false;
        }
        evhttp_uri_free(u);
    }
    static const char *const methods[] = {"GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"};
    bool known = false;
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        known = known || ((size_t)(sp1 - h) == strlen(methods[i]) &&
                          memcmp(h, methods[i], strlen(methods[i])) == 0);
    if (!known) {
        refuse(g, 501, "method_not_supported", "method %.*s is not supported",
               (int)(sp1 - h > 32 ? 32 : sp1 - h), h);
        return false;
    }
    g->head_method = (size_t)(sp1 - h) == 4 && strncmp(h, "HEAD", 4) == 0;
    if (g->head_method) { /* no route answers HEAD, and evhttp 2.1 sends a body with it */
        refuse(g, 405, "method_not_allowed", "method HEAD is not supported (use GET)");
        return false;
    }
    evbuffer_add(dst, h, (size_t)(rl_end - h));
    evbuffer_add(dst, "\r\n", 2);
    /* header lines */
    int64_t cl = -1;
    bool chunked = false, te = false, cl_written = false;
    for (const char *p = le + 1; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *e = nl > p && nl[-1] == '\r' ? nl - 1 : nl;
        if (e == p) break; /* the empty line */
        if (*p == ' ' || *p == '\t') {
            refuse(g, 400, "bad_header", "obsolete line folding in the request headers");
            return false;
        }
        const char *colon = memchr(p, ':', (size_t)(e - p));
        if (!colon || colon == p) {
            refuse(g, 400, "bad_header", "malformed header line (want Name: value)");
            return false;
        }
        for (const char *q = p; q < colon; q++)
            if (!is_tchar((unsigned char)*q)) {
                refuse(g, 400, "bad_header", "invalid character in a header name");
                return false;
            }
        for (const char *q = colon + 1; q < e; q++) {
            unsigned char c = (unsigned char)*q;
            if ((c < 0x20 && c != '\t') || c == 0x7f) {
                refuse(g, 400, "bad_header", "%s byte in the value of header %.*s",
                       c == 0 ? "NUL" : "control", (int)(colon - p > 64 ? 64 : colon - p), p);
                return false;
            }
        }
        const char *ve, *v = trim(colon + 1, e, &ve);
        size_t nlen = (size_t)(colon - p);
        if (ieq(p, nlen, "Content-Length")) {
            if (!merge_content_length(v, ve, &cl)) {
                refuse(g, 400, "bad_content_length", "invalid or conflicting Content-Length");
                return false;
            }
            if (cl_written) {
                p = nl + 1;
                continue; /* equal duplicates collapse into one */
            }
            cl_written = true;
            evbuffer_add_printf(dst, "Content-Length: %lld\r\n", (long long)cl);
            p = nl + 1;
            continue;
        }
        if (ieq(p, nlen, "Expect") && !ieq(v, (size_t)(ve - v), "100-continue")) {
            refuse(g, 417, "expectation_failed", "only Expect: 100-continue is supported");
            return false;
        }
        if (ieq(p, nlen, "Transfer-Encoding")) {
            if (te || !ieq(v, (size_t)(ve - v), "chunked")) {
                refuse(g, 501, "unsupported_transfer_encoding",
                       "only Transfer-Encoding: chunked is supported");
                return false;
            }
            te = chunked = true;
        }
        evbuffer_add(dst, p, (size_t)(e - p));
        evbuffer_add(dst, "\r\n", 2);
        p = nl + 1;
    }
    evbuffer_add(dst, "\r\n", 2);
    g->declared = cl;
    if (chunked && (cl >= 0 || http10)) {
        refuse(g, 400, "bad_transfer_encoding",
               cl >= 0 ? "Transfer-Encoding together with Content-Length"
                       : "chunked Transfer-Encoding in an HTTP/1.0 request");
        return false;
    }
    if (cl > 0 && (uint64_t)cl > gs->lim.max_body_bytes) {
        refuse(g, 413, "request_too_large",
               "request body of %lld bytes exceeds the limit of %zu bytes", (long long)cl,
               gs->lim.max_body_bytes);
        return false;
    }
    if (cl > 0 && !reserve(g, (size_t)cl)) {
        refuse(g, 503, "server_busy",
               "too many request bytes buffered on this server; retry shortly");
        return false;
    }
    g->body_total = 0;
    if (chunked) g->rs = R_CHUNK_LINE;
    else if (cl > 0) {
        g->rs = R_BODY;
        g->body_left = (uint64_t)cl;
    } else request_complete(g);
    return true;
}

/* Collects head bytes from src; true when the head is complete (and forwarded). */
static bool read_head(struct gate *g, struct evbuffer *src, struct evbuffer *dst) {
    struct http_gates *gs = g->gs;
    while (evbuffer_get_length(src) > 0) {
        if (!g->begun) { /* the first byte of a request: the head timeout runs */
            g->begun = true;
            arm(g, gs->lim.header_timeout_ms);
        }
        if (g->head.len == 0) { /* empty lines before a request line are ignored */
            unsigned char c;
            evbuffer_copyout(src, &c, 1);
            if (c == '\r' || c == '\n') {
                evbuffer_drain(src, 1);
                continue;
            }
            g->line_start = 0;
            g->n_lines = 0;
        }
        size_t room = gs->lim.max_head_bytes + 2 - g->head.len;
        char tmp[16384];
        size_t n = evbuffer_get_length(src);
        if (n > room) n = room;
        if (n > sizeof tmp) n = sizeof tmp;
        if (n == 0) {
            refuse(g, 431, "headers_too_large", "request headers exceed %zu bytes",
                   gs->lim.max_head_bytes);
            return false;
        }
        size_t old = g->head.len;
        evbuffer_copyout(src, tmp, n);
        if (kv_buf_append(&g->head, tmp, n) != KV_OK) {
            refuse(g, 503, "server_busy", "out of memory reading the request head");
            return false;
        }
        for (size_t i = old; i < g->head.len; i++) {
            if (g->head.data[i] != '\n') continue;
            size_t ls = g->line_start, le = i;
            if (le > ls && g->head.data[le - 1] == '\r') le--;
            if (le == ls && g->n_lines > 0) { /* the empty line: end of head */
                evbuffer_drain(src, i + 1 - old);
                g->head.len = i + 1;
                bool ok = take_head(g, dst);
                g->head.len = 0;
                if (ok) {
                    if (g->rs == R_WAIT) evtimer_del(g->timer);
                    else arm(g, gs->lim.header_timeout_ms); /* body: between reads */
                }
                return ok;
            }
            if (memchr(g->head.data + ls, 0, le - ls)) {
                refuse(g, 400, "bad_header", "NUL byte in the request head");
                return false;
            }
            if (++g->n_lines > gs->lim.max_headers + 1) {
                refuse(g, 431, "headers_too_large", "more than %d request header lines",
                       gs->lim.max_headers);
                return false;
            }
            g->line_start = i + 1;
        }
        evbuffer_drain(src, n);
        if (g->head.len > gs->lim.max_head_bytes) {
            refuse(g, 431, "headers_too_large", "request headers exceed %zu bytes",
                   gs->lim.max_head_bytes);
            return false;
        }
    }
    return false;
}

/* One line (chunk size or trailer) from src into g->line; true when complete (without the
 * line end). */
static int read_line(struct gate *g, struct evbuffer *src) {
    while (evbuffer_get_length(src) > 0) {
        struct evbuffer_ptr p = evbuffer_search(src, "\n", 1, NULL);
        size_t n = p.pos >= 0 ? (size_t)p.pos + 1 : evbuffer_get_length(src);
        if (g->line.len + n > GATE_LINE_MAX) return -1;
        char tmp[GATE_LINE_MAX];
        evbuffer_remove(src, tmp, n);
        if (kv_buf_append(&g->line, tmp, n) != KV_OK) return -1;
        if (p.pos >= 0) {
            g->line.len--; /* LF */
            if (g->line.len && g->line.data[g->line.len - 1] == '\r') g->line.len--;
            g->line.data[g->line.len] = 0;
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ filters */

static enum bufferevent_filter_result gate_in(struct evbuffer *src, struct evbuffer *dst,
                                              ev_ssize_t limit, enum bufferevent_flush_mode mode,
                                              void *ctx) {
    (void)limit;
    (void)mode;
    struct gate *g = ctx;
    struct http_gates *gs = g->gs;
    size_t before = evbuffer_get_length(src);
    if (g->refuse_conn)
        refuse(g, 503, "too_many_connections", "too many open connections (limit %d); retry shortly",
               gs->lim.max_connections);
    for (;;) {
        switch (g->rs) {
        case R_CLOSING: {
            size_t n = evbuffer_get_length(src);
            evbuffer_drain(src, n);
            g->linger_left = n < g->linger_left ? g->linger_left - n : 0;
            if (g->linger_left == 0 || kv_now_ns() - g->linger_start_ns > GATE_LINGER_TOTAL_NS) finish(g);
            else if (n && !g->want_finish) arm(g, GATE_LINGER_MS);
            return BEV_NEED_MORE;
        }
        case R_WAIT: /* one request at a time: the next one waits in the socket buffer */
            return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
        case R_HEAD:
            if (!read_head(g, src, dst)) {
                if (g->rs == R_CLOSING) continue;
                return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            }
            break;
        case R_BODY: {
            size_t n = evbuffer_get_length(src);
            if (n == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            if (n > g->body_left) n = (size_t)g->body_left;
            evbuffer_remove_buffer(src, dst, n);
            g->body_left -= n;
            if (g->body_left == 0) request_complete(g);
            else arm(g, gs->lim.header_timeout_ms);
            break;
        }
        case R_CHUNK_LINE: {
            int r = read_line(g, src);
            if (r < 0) {
                refuse(g, 400, "bad_chunk", "chunk-size line longer than %d bytes", GATE_LINE_MAX);
                continue;
            }
            if (r == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            arm(g, gs->lim.header_timeout_ms);
            const char *s = kv_buf_cstr(&g->line);
            uint64_t sz = 0;
            int digits = 0;
            for (; *s && digits <= 16; s++, digits++) {
                int v = *s >= '0' && *s <= '9' ? *s - '0' : *s >= 'a' && *s <= 'f' ? *s - 'a' + 10
                      : *s >= 'A' && *s <= 'F' ? *s - 'A' + 10 : -1;
                if (v < 0) break;
                sz = sz * 16 + (uint64_t)v;
            }
            while (*s == ' ' || *s == '\t') s++;
            g->line.len = 0;
            if (digits == 0 || digits > 16 || (*s && *s != ';')) {
                refuse(g, 400, "bad_chunk", "malformed chunk-size line");
                KV_DEBUG("chunk line: %s", kv_buf_cstr(&g->line));
                continue;
            }
            /* chunk extensions (after ';') are dropped */
            if (sz > gs->lim.max_body_bytes - g->body_total) {
                refuse(g, 413, "request_too_large",
                       "chunked request body exceeds the limit of %zu bytes", gs->lim.max_body_bytes);
                continue;
            }
            if (!reserve(g, (size_t)sz)) {
                refuse(g, 503, "server_busy", "too many request bytes buffered on this server; retry shortly");
                continue;
            }
            g->body_total += sz;
            evbuffer_add_printf(dst, "%llx\r\n", (unsigned long long)sz);
            g->body_left = sz;
            g->rs = sz ? R_CHUNK_DATA : R_TRAILER;
            break;
        }
        case R_CHUNK_DATA: {
            size_t n = evbuffer_get_length(src);
            if (n == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            if (n > g->body_left) n = (size_t)g->body_left;
            evbuffer_remove_buffer(src, dst, n);
            g->body_left -= n;
            arm(g, gs->lim.header_timeout_ms);
            if (g->body_left == 0) g->rs = R_CHUNK_END;
            break;
        }
        case R_CHUNK_END: {
            int r = read_line(g, src);
            if (r == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            bool empty = r > 0 && g->line.len == 0;
            g->line.len = 0;
            if (!empty) {
                refuse(g, 400, "bad_chunk", "chunk data not followed by CRLF");
                continue;
            }
            evbuffer_add(dst, "\r\n", 2);
            g->rs = R_CHUNK_LINE;
            break;
        }
        case R_TRAILER: { /* trailer fields are read and dropped */
            int r = read_line(g, src);
            if (r < 0) {
                refuse(g, 431, "headers_too_large", "trailer line longer than %d bytes", GATE_LINE_MAX);
                continue;
            }
            if (r == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            bool empty = g->line.len == 0;
            g->line.len = 0;
            if (empty) {
                evbuffer_add(dst, "\r\n", 2);
                request_complete(g);
            }
            break;
        }
        }
    }
}

/* A response has been written completely: the connection is idle (or closes, if the client
 * ended its input), and a pipelined request may proceed (both from the loop, after evhttp
 * has finished its own bookkeeping of the response). */
static void response_done(struct gate *g) {
    struct http_gates *gs = g->gs;
    g->streaming = false;
    if (g->rs != R_WAIT) return;
    g->half_closed = false;
    release_all(g);
    g->rs = R_HEAD;
    g->begun = false;
    g->declared = -1;
    arm(g, gs->lim.keepalive_timeout_ms);
    if (g->eof_held) {
        g->eof_held = false;
        finish(g);
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
        response_done(g);
    } else if (g->os == O_CHUNK_LINE) {
        g->streaming = true;
    }
}

static void on_writable(evutil_socket_t fd, short what, void *arg);

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
            response_done(g);
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
            response_done(g);
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
 * the loop (on_writable), and evhttp's write callback runs when that buffer is empty, as with
 * a plain socket: evhttp learns that a write is complete (the next stream chunk, the end of a
 * response and maybe the close) only when the bytes are in the kernel. (libevent 2.1's filter
 * would move them into the socket bufferevent's buffer and report completion at once, inside
 * the call that queued them: streams would lose their backpressure, a close could drop the
 * tail of a reply, and a completion reported before evhttp registered its callback is lost.)
 * So the filter's own output function moves nothing. */
static enum bufferevent_filter_result gate_out(struct evbuffer *src, struct evbuffer *dst,
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
static void on_reply_queued(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg) {
    (void)buf;
    struct gate *g = arg;
    if (info->n_added == 0 || g->finished || g->want_finish || g->want_error) return;
    if (!g->wev) {
        evutil_socket_t fd = bufferevent_getfd(g->under);
        if (fd < 0 || !(g->wev = event_new(g->gs->base, fd, EV_WRITE, on_writable, g))) {
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

static void on_writable(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct gate *g = arg;
    if (!alive(g) || g->want_finish || g->want_error) return;
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
        finish(g);
        return;
    }
    /* the client ended its input after a complete request that is still being answered
     * (not streamed): hold the end back so the answer is still sent */
    if ((what & BEV_EVENT_EOF) && !(what & BEV_EVENT_ERROR) && g->rs == R_WAIT && g->half_closed) {
        g->eof_held = true;
        return;
    }
    g->f_ecb(bev, what, g->f_arg);
}

static void on_defer(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct gate *g = arg;
    if (!alive(g)) return;
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
        refuse(g, 503, "too_many_connections", "too many open connections (limit %d); retry shortly",
               gs->lim.max_connections);
        return;
    }
    switch (g->rs) {
    case R_CLOSING: finish(g); return;
    case R_WAIT: return;
    case R_HEAD:
        if (!g->begun) { /* idle between requests */
            gs->st.idle_closed++;
            finish(g);
            return;
        }
        refuse(g, 408, "request_timeout", "request head not received within %d ms",
               gs->lim.header_timeout_ms);
        return;
    default:
        refuse(g, 408, "request_timeout", "request body stalled for %d ms", gs->lim.header_timeout_ms);
        return;
    }
}

/* ------------------------------------------------------------------ lifecycle */

static void gate_free_ctx(void *ctx) {
    struct gate *g = ctx;
    struct http_gates *gs = g->gs;
    release_all(g);
    gs->st.connections--;
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
    evbuffer_add_cb(bufferevent_get_output(g->filt), on_reply_queued, g);
    if (gs->st.connections > gs->lim.max_connections) {
        g->refuse_conn = true;
        arm(g, 1); /* the socket is set after we return */
    } else {
        arm(g, gs->lim.header_timeout_ms);
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

bool http_gate_half_closed(struct evhttp_connection *conn) {
    struct bufferevent *filt = conn ? evhttp_connection_get_bufferevent(conn) : NULL;
    struct bufferevent *under = filt ? bufferevent_get_underlying(filt) : NULL;
    if (!under) return false;
    bufferevent_data_cb r = NULL;
    void *arg = NULL;
    bufferevent_getcb(under, &r, NULL, NULL, &arg);
    return r == on_under_read && ((struct gate *)arg)->half_closed;
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
