/* Incremental Server-Sent Events parser (the subset OpenAI streams use: data lines,
 * comments, blank-line event ends; CR, LF and CRLF line ends). */
#include <string.h>

#include "bench/bench.h"

void bench_sse_init(bench_sse *p) {
    memset(p, 0, sizeof *p);
    kv_buf_init(&p->line);
    kv_buf_init(&p->data);
}

void bench_sse_free(bench_sse *p) {
    kv_buf_free(&p->line);
    kv_buf_free(&p->data);
    memset(p, 0, sizeof *p);
}

static int dispatch(bench_sse *p, bench_sse_cb cb, void *ud) {
    if (!p->has_data) return 0;
    const char *d = kv_buf_cstr(&p->data);
    size_t n = p->data.len;
    int rc = cb(ud, d, n);
    p->data.len = 0;
    p->has_data = false;
    return rc;
}

/* One complete line (without its terminator). */
static int on_line(bench_sse *p, bench_sse_cb cb, void *ud) {
    const char *l = kv_buf_cstr(&p->line);
    size_t n = p->line.len;
    int rc = 0;
    if (n == 0) {
        rc = dispatch(p, cb, ud);
    } else if (l[0] == ':') {
        /* comment */
    } else {
        const char *colon = memchr(l, ':', n);
        size_t fl = colon ? (size_t)(colon - l) : n;
        if (fl == 4 && !memcmp(l, "data", 4)) {
            const char *v = colon ? colon + 1 : l + n;
            if (v < l + n && *v == ' ') v++;
            if (p->has_data && kv_buf_append(&p->data, "\n", 1)) rc = -1;
            if (!rc && kv_buf_append(&p->data, v, (size_t)(l + n - v))) rc = -1;
            p->has_data = true;
        }
    }
    p->line.len = 0;
    return rc;
}

int bench_sse_feed(bench_sse *p, const char *buf, size_t n, bench_sse_cb cb, void *ud) {
    size_t i = 0;
    while (i < n) {
        char c = buf[i];
        if (p->skip_lf) {
            p->skip_lf = false;
            if (c == '\n') { i++; continue; }
        }
        if (c == '\r' || c == '\n') {
            p->skip_lf = c == '\r';
            int rc = on_line(p, cb, ud);
            if (rc) return rc;
            i++;
            continue;
        }
        /* copy the run of ordinary bytes in one go */
        size_t j = i;
        while (j < n && buf[j] != '\r' && buf[j] != '\n') j++;
        if (kv_buf_append(&p->line, buf + i, j - i)) return -1;
        i = j;
    }
    return 0;
}

int bench_sse_finish(bench_sse *p, bench_sse_cb cb, void *ud) {
    int rc = 0;
    if (p->line.len) rc = on_line(p, cb, ud);
    if (!rc) rc = dispatch(p, cb, ud);
    return rc;
}
