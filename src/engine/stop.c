/* stop: stop-string matcher (see stop.h). */
#include "stop.h"

#include <stdlib.h>
#include <string.h>

kv_status stop_init(struct stop_matcher *m, const char *const *stops, int n) {
    memset(m, 0, sizeof *m);
    kv_buf_init(&m->held);
    if (n <= 0) return KV_OK;
    m->stops = kv_calloc((size_t)n, sizeof *m->stops);
    m->lens = kv_calloc((size_t)n, sizeof *m->lens);
    if (!m->stops || !m->lens) {
        stop_free(m);
        return KV_ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        if (!stops[i] || !stops[i][0]) continue;
        char *c = kv_strdup(stops[i]);
        if (!c) {
            stop_free(m);
            return KV_ENOMEM;
        }
        m->stops[m->n_stops] = c;
        m->lens[m->n_stops] = strlen(c);
        m->n_stops++;
    }
    return KV_OK;
}

void stop_free(struct stop_matcher *m) {
    for (int i = 0; i < m->n_stops; i++) free(m->stops[i]);
    free(m->stops);
    free(m->lens);
    kv_buf_free(&m->held);
    memset(m, 0, sizeof *m);
}

/* Longest k < len(stop) such that s[n-k..n) == stop[0..k). */
static size_t partial_suffix(const char *s, size_t n, const char *stop, size_t sl) {
    size_t k = sl - 1 < n ? sl - 1 : n;
    for (; k > 0; k--)
        if (!memcmp(s + n - k, stop, k)) return k;
    return 0;
}

bool stop_feed(struct stop_matcher *m, const char *text, size_t len, kv_buf *out, kv_status *st) {
    if (st) *st = KV_OK;
    if (m->stopped) return true;
    if (m->n_stops == 0) {
        kv_status r = kv_buf_append(out, text, len);
        if (st) *st = r;
        return false;
    }
    kv_status r = kv_buf_append(&m->held, text, len);
    if (r != KV_OK) {
        if (st) *st = r;
        return false;
    }
    const char *h = m->held.data;
    size_t n = m->held.len;
    if (n == 0) return false;
    /* Earliest complete occurrence of any stop string. Text emitted earlier cannot contain
     * the start of one (it would have been held back), so searching `held` suffices. */
    size_t best = n;
    for (int i = 0; i < m->n_stops; i++) {
        if (m->lens[i] > n) continue;
        const char *p = memmem(h, n, m->stops[i], m->lens[i]);
        if (p && (size_t)(p - h) < best) best = (size_t)(p - h);
    }
    if (best < n) {
        r = kv_buf_append(out, h, best);
        if (st) *st = r;
        m->stopped = true;
        m->held.len = 0;
        return true;
    }
    size_t hold = 0;
    for (int i = 0; i < m->n_stops; i++) {
        size_t k = partial_suffix(h, n, m->stops[i], m->lens[i]);
        if (k > hold) hold = k;
    }
    r = kv_buf_append(out, h, n - hold);
    if (st) *st = r;
    if (hold) memmove(m->held.data, h + n - hold, hold);
    m->held.len = hold;
    if (m->held.data) m->held.data[hold] = '\0';
    return false;
}

kv_status stop_flush(struct stop_matcher *m, kv_buf *out) {
    if (m->stopped || m->held.len == 0) return KV_OK;
    kv_status r = kv_buf_append(out, m->held.data, m->held.len);
    m->held.len = 0;
    return r;
}
