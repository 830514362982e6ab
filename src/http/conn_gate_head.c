/* conn_gate_head: the request side of the connection gate (conn_gate.h): the request head is
 * collected, validated and normalized (request line, header names and bytes, Content-Length,
 * Transfer-Encoding, Expect), then the body is passed on by Content-Length or re-framed from
 * chunked encoding, with the limits and timers of conn_gate.c. */
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
        gate_refuse(g, 400, "bad_request_line", "malformed request line (want METHOD SP target SP HTTP/1.1)");
        return false;
    }
    for (const char *p = h; p < sp1; p++)
        if (!is_tchar((unsigned char)*p)) {
            gate_refuse(g, 400, "bad_request_line", "malformed method in the request line");
            return false;
        }
    for (const char *p = sp1 + 1; p < sp2; p++)
        if ((unsigned char)*p <= 0x20 || *p == 0x7f) {
            gate_refuse(g, 400, "bad_request_line", "control byte in the request target");
            return false;
        }
    size_t vlen = (size_t)(rl_end - sp2 - 1);
    const char *ver = sp2 + 1;
    if (vlen != 8 || strncmp(ver, "HTTP/1.", 7) != 0 || (ver[7] != '0' && ver[7] != '1')) {
        if (vlen >= 5 && strncmp(ver, "HTTP/", 5) == 0)
            gate_refuse(g, 505, "http_version_not_supported", "HTTP version %.*s is not supported (HTTP/1.0 and HTTP/1.1 are)",
                   (int)(vlen > 16 ? 16 : vlen), ver);
        else gate_refuse(g, 400, "bad_request_line", "malformed HTTP version in the request line");
        return false;
    }
    bool http10 = ver[7] == '0';
    g->http10 = http10;
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
            gate_refuse(g, 400, "bad_request_line", "malformed request target");
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
        gate_refuse(g, 501, "method_not_supported", "method %.*s is not supported",
               (int)(sp1 - h > 32 ? 32 : sp1 - h), h);
        return false;
    }
    g->head_method = (size_t)(sp1 - h) == 4 && strncmp(h, "HEAD", 4) == 0;
    if (g->head_method) { /* no route answers HEAD, and evhttp 2.1 sends a body with it */
        gate_refuse(g, 405, "method_not_allowed", "method HEAD is not supported (use GET)");
        return false;
    }
    if (g->probe_only) { /* past the connection cap: liveness / readiness probes only */
        size_t tl = (size_t)(sp2 - sp1 - 1);
        const char *q = memchr(sp1 + 1, '?', tl);
        size_t pl = q ? (size_t)(q - sp1 - 1) : tl;
        bool get = sp1 - h == 3 && strncmp(h, "GET", 3) == 0;
        bool probe = (pl == 7 && memcmp(sp1 + 1, "/health", 7) == 0) ||
                     (pl == 6 && memcmp(sp1 + 1, "/ready", 6) == 0);
        if (!get || !probe) {
            g->refuse_conn = true;
            gate_refuse(g, 503, "too_many_connections", "too many open connections (limit %d); retry shortly",
                        gs->lim.max_connections);
            return false;
        }
        gs->st.probes_over_cap++;
    }
    evbuffer_add(dst, h, (size_t)(rl_end - h));
    evbuffer_add(dst, "\r\n", 2);
    if (g->probe_only) evbuffer_add(dst, "Connection: close\r\n", 19); /* the first one counts */
    /* header lines */
    int64_t cl = -1;
    bool chunked = false, te = false, cl_written = false;
    for (const char *p = le + 1; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *e = nl > p && nl[-1] == '\r' ? nl - 1 : nl;
        if (e == p) break; /* the empty line */
        if (*p == ' ' || *p == '\t') {
            gate_refuse(g, 400, "bad_header", "obsolete line folding in the request headers");
            return false;
        }
        const char *colon = memchr(p, ':', (size_t)(e - p));
        if (!colon || colon == p) {
            gate_refuse(g, 400, "bad_header", "malformed header line (want Name: value)");
            return false;
        }
        for (const char *q = p; q < colon; q++)
            if (!is_tchar((unsigned char)*q)) {
                gate_refuse(g, 400, "bad_header", "invalid character in a header name");
                return false;
            }
        for (const char *q = colon + 1; q < e; q++) {
            unsigned char c = (unsigned char)*q;
            if ((c < 0x20 && c != '\t') || c == 0x7f) {
                gate_refuse(g, 400, "bad_header", "%s byte in the value of header %.*s",
                       c == 0 ? "NUL" : "control", (int)(colon - p > 64 ? 64 : colon - p), p);
                return false;
            }
        }
        const char *ve, *v = trim(colon + 1, e, &ve);
        size_t nlen = (size_t)(colon - p);
        if (ieq(p, nlen, "Content-Length")) {
            if (!merge_content_length(v, ve, &cl)) {
                gate_refuse(g, 400, "bad_content_length", "invalid or conflicting Content-Length");
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
            gate_refuse(g, 417, "expectation_failed", "only Expect: 100-continue is supported");
            return false;
        }
        if (ieq(p, nlen, "Transfer-Encoding")) {
            if (te || !ieq(v, (size_t)(ve - v), "chunked")) {
                gate_refuse(g, 501, "unsupported_transfer_encoding",
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
        gate_refuse(g, 400, "bad_transfer_encoding",
               cl >= 0 ? "Transfer-Encoding together with Content-Length"
                       : "chunked Transfer-Encoding in an HTTP/1.0 request");
        return false;
    }
    if (cl > 0 && (uint64_t)cl > gs->lim.max_body_bytes) {
        gate_refuse(g, 413, "request_too_large",
               "request body of %lld bytes exceeds the limit of %zu bytes", (long long)cl,
               gs->lim.max_body_bytes);
        return false;
    }
    if (cl > 0 && !gate_reserve(g, (size_t)cl)) {
        gate_refuse(g, 503, "server_busy",
               "too many request bytes buffered on this server; retry shortly");
        return false;
    }
    g->body_total = 0;
    if (chunked) g->rs = R_CHUNK_LINE;
    else if (cl > 0) {
        g->rs = R_BODY;
        g->body_left = (uint64_t)cl;
    } else gate_request_complete(g);
    return true;
}

/* Collects head bytes from src; true when the head is complete (and forwarded). */
static bool read_head(struct gate *g, struct evbuffer *src, struct evbuffer *dst) {
    struct http_gates *gs = g->gs;
    while (evbuffer_get_length(src) > 0) {
        if (!g->begun) { /* the first byte of a request: the head timeout runs */
            g->begun = true;
            gate_idle(g, false);
            gate_arm(g, gs->lim.header_timeout_ms);
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
            gate_refuse(g, 431, "headers_too_large", "request headers exceed %zu bytes",
                   gs->lim.max_head_bytes);
            return false;
        }
        size_t old = g->head.len;
        evbuffer_copyout(src, tmp, n);
        if (kv_buf_append(&g->head, tmp, n) != KV_OK) {
            gate_refuse(g, 503, "server_busy", "out of memory reading the request head");
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
                    else gate_arm(g, gs->lim.header_timeout_ms); /* body: between reads */
                }
                return ok;
            }
            if (memchr(g->head.data + ls, 0, le - ls)) {
                gate_refuse(g, 400, "bad_header", "NUL byte in the request head");
                return false;
            }
            if (++g->n_lines > gs->lim.max_headers + 1) {
                gate_refuse(g, 431, "headers_too_large", "more than %d request header lines",
                       gs->lim.max_headers);
                return false;
            }
            g->line_start = i + 1;
        }
        evbuffer_drain(src, n);
        if (g->head.len > gs->lim.max_head_bytes) {
            gate_refuse(g, 431, "headers_too_large", "request headers exceed %zu bytes",
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

enum bufferevent_filter_result gate_in(struct evbuffer *src, struct evbuffer *dst,
                                              ev_ssize_t limit, enum bufferevent_flush_mode mode,
                                              void *ctx) {
    (void)limit;
    (void)mode;
    struct gate *g = ctx;
    struct http_gates *gs = g->gs;
    size_t before = evbuffer_get_length(src);
    if (g->refuse_conn)
        gate_refuse(g, 503, "too_many_connections", "too many open connections (limit %d); retry shortly",
               gs->lim.max_connections);
    for (;;) {
        switch (g->rs) {
        case R_CLOSING: {
            size_t n = evbuffer_get_length(src);
            evbuffer_drain(src, n);
            g->linger_left = n < g->linger_left ? g->linger_left - n : 0;
            if (g->linger_left == 0 || kv_now_ns() - g->linger_start_ns > GATE_LINGER_TOTAL_NS) gate_finish(g);
            else if (n && !g->want_finish) gate_arm(g, GATE_LINGER_MS);
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
            if (g->body_left == 0) gate_request_complete(g);
            else gate_arm(g, gs->lim.header_timeout_ms);
            break;
        }
        case R_CHUNK_LINE: {
            int r = read_line(g, src);
            if (r < 0) {
                gate_refuse(g, 400, "bad_chunk", "chunk-size line longer than %d bytes", GATE_LINE_MAX);
                continue;
            }
            if (r == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            gate_arm(g, gs->lim.header_timeout_ms);
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
                gate_refuse(g, 400, "bad_chunk", "malformed chunk-size line");
                KV_DEBUG("chunk line: %s", kv_buf_cstr(&g->line));
                continue;
            }
            /* chunk extensions (after ';') are dropped */
            if (sz > gs->lim.max_body_bytes - g->body_total) {
                gate_refuse(g, 413, "request_too_large",
                       "chunked request body exceeds the limit of %zu bytes", gs->lim.max_body_bytes);
                continue;
            }
            if (!gate_reserve(g, (size_t)sz)) {
                gate_refuse(g, 503, "server_busy", "too many request bytes buffered on this server; retry shortly");
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
            gate_arm(g, gs->lim.header_timeout_ms);
            if (g->body_left == 0) g->rs = R_CHUNK_END;
            break;
        }
        case R_CHUNK_END: {
            int r = read_line(g, src);
            if (r == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            bool empty = r > 0 && g->line.len == 0;
            g->line.len = 0;
            if (!empty) {
                gate_refuse(g, 400, "bad_chunk", "chunk data not followed by CRLF");
                continue;
            }
            evbuffer_add(dst, "\r\n", 2);
            g->rs = R_CHUNK_LINE;
            break;
        }
        case R_TRAILER: { /* trailer fields are read and dropped */
            int r = read_line(g, src);
            if (r < 0) {
                gate_refuse(g, 431, "headers_too_large", "trailer line longer than %d bytes", GATE_LINE_MAX);
                continue;
            }
            if (r == 0) return evbuffer_get_length(src) < before ? BEV_OK : BEV_NEED_MORE;
            bool empty = g->line.len == 0;
            g->line.len = 0;
            if (empty) {
                evbuffer_add(dst, "\r\n", 2);
                gate_request_complete(g);
            }
            break;
        }
        }
    }
}
