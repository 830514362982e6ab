/* libFuzzer target: the bench client's Server-Sent-Events parser (src/bench/sse.c). The input
 * is fed whole and again split at every position derived from its first byte; both ways must
 * deliver the same events (a parser's output may not depend on how the network splits the
 * stream), and nothing may crash or leak. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"

struct sink {
    char *all;
    size_t len, n;
};

static int on_event(void *ud, const char *d, size_t n) {
    struct sink *s = ud;
    if (d[n] != 0) abort(); /* NUL-terminated at n */
    char *p = realloc(s->all, s->len + n + 1);
    if (!p) return 1;
    s->all = p;
    memcpy(s->all + s->len, d, n);
    s->all[s->len + n] = '\x1e';
    s->len += n + 1;
    s->n++;
    return 0;
}

static void run(const uint8_t *data, size_t size, size_t step, struct sink *s) {
    bench_sse p;
    bench_sse_init(&p);
    int rc = 0;
    for (size_t i = 0; i < size && rc == 0; i += step)
        rc = bench_sse_feed(&p, (const char *)data + i, i + step <= size ? step : size - i, on_event, s);
    if (rc == 0) bench_sse_finish(&p, on_event, s);
    bench_sse_free(&p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct sink a = {0}, b = {0};
    run(data, size, size ? size : 1, &a);
    run(data, size, size ? (size_t)(data[0] % 7) + 1 : 1, &b);
    if (a.n != b.n || a.len != b.len || (a.len && memcmp(a.all, b.all, a.len))) abort();
    free(a.all);
    free(b.all);
    return 0;
}
