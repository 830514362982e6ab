/*
 * The KV-transfer agent (src/transfer/transfer.h) with two agents in one process over loopback,
 * on malloc'd pools filled with a per-block pattern: bytes exact, end-aligned suffix pulls
 * (BUG-17), zero blocks, fragmented blocks through the bounce path, every fault of the transfer
 * state machine (DONE dropped, READY never sent, a failed read, a delayed request), cancels from
 * each side and before the id was seen, the stale sweep (context first FAILED, generation first
 * dropped silently), a page-table mismatch refused at the handshake, and stop with live
 * transfers. Completions are awaited on a condition variable with a bounded deadline.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "transfer/transfer.h"
#include "transfer/transport.h"

#define NB 64
#define T 16

struct side {
    kvx_agent_t *a;
    uint8_t *pool;
    size_t bb;
    struct kvx_page_table pt;
};

static enum kvx_transport_kind g_tp = KVX_TRANSPORT_TCP;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static struct kvx_result g_res[256];
static int g_n;

static void on_result(const struct kvx_result *r, void *user) {
    (void)user;
    pthread_mutex_lock(&g_mu);
    if (g_n < 256) g_res[g_n++] = *r;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* Waits for the completion (id, is_send); fails the test after max_s. */
static struct kvx_result wait_res(uint64_t id, bool is_send, double max_s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)max_s + 1;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        for (int i = 0; i < g_n; i++)
            if (g_res[i].disagg_id == id && g_res[i].is_send == is_send) {
                struct kvx_result r = g_res[i];
                pthread_mutex_unlock(&g_mu);
                return r;
            }
        if (pthread_cond_timedwait(&g_cv, &g_mu, &ts)) {
            pthread_mutex_unlock(&g_mu);
            fail_msg("no %s completion for %llu within %.0f s", is_send ? "send" : "recv",
                     (unsigned long long)id, max_s);
        }
    }
}

static int count_res(uint64_t id, bool is_send) {
    pthread_mutex_lock(&g_mu);
    int n = 0;
    for (int i = 0; i < g_n; i++) n += g_res[i].disagg_id == id && g_res[i].is_send == is_send;
    pthread_mutex_unlock(&g_mu);
    return n;
}

static void side_start(struct side *s, int heads, double timeout, double ttl, const char *faults,
                       size_t bounce) {
    char err[256];
    assert_int_equal(kvx_page_table_dense_kv(&s->pt, 0, 3, heads, 8, T, KVX_DTYPE_F32, err, sizeof err), KV_OK);
    s->bb = s->pt.views[0].block_bytes;
    s->pool = calloc(NB, s->bb);
    assert_non_null(s->pool);
    struct kvx_config c = {.host = "127.0.0.1", .port = 0, .transport = g_tp,
                           .timeout_s = timeout, .stale_ttl_s = ttl, .bounce_min_bytes = bounce,
                           .pt = &s->pt, .pool_base = s->pool, .n_blocks = NB, .cb = on_result};
    if (faults) assert_int_equal(kvx_fault_parse(faults, &c.faults, err, sizeof err), KV_OK);
    assert_int_equal(kvx_agent_start(&c, &s->a, err, sizeof err), KV_OK);
}

static void side_stop(struct side *s) {
    kvx_agent_stop(s->a);
    kvx_page_table_free(&s->pt);
    free(s->pool);
    memset(s, 0, sizeof *s);
}

static void fill(struct side *s, int b, uint8_t seed) {
    for (size_t i = 0; i < s->bb; i++) s->pool[(size_t)b * s->bb + i] = (uint8_t)(seed * 31 + i * 7 + (i >> 8));
}

static bool same(const struct side *x, int bx, const struct side *y, int by) {
    return memcmp(x->pool + (size_t)bx * x->bb, y->pool + (size_t)by * y->bb, x->bb) == 0;
}

static void reset(void) {
    pthread_mutex_lock(&g_mu);
    g_n = 0;
    pthread_mutex_unlock(&g_mu);
}

/* Waits (bounded, 2 s) until the sender holds n stored requests (REQs without an offer). */
static void wait_stored(struct side *s, int n) {
    struct kvx_stats stt;
    for (int i = 0; i < 2000; i++) {
        kvx_get_stats(s->a, &stt);
        if (stt.stored_requests == n) break;
        struct timespec d = {0, 1000000};
        nanosleep(&d, NULL);
    }
    assert_int_equal(stt.stored_requests, n);
}

static struct kvx_aux aux_of(int n_tokens, int32_t first) {
    struct kvx_aux a = {.n_tokens = n_tokens, .n_first = 1, .first = {first}};
    return a;
}

/* ---------------------------------------------------------------- tests */

/* Context first: offer, then the receiver pulls everything; bytes exact, aux delivered. */
static void test_full_transfer(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 5, 60, NULL, 0);
    side_start(&r, 2, 5, 60, NULL, 0);
    int32_t src[5] = {3, 9, 10, 11, 40}, dst[5] = {0, 1, 2, 50, 7};
    for (int i = 0; i < 5; i++) fill(&s, src[i], (uint8_t)(i + 1));
    struct kvx_aux ax = aux_of(5 * T - 3, 42);
    ax.cached_tokens = 16;
    assert_int_equal(kvx_send_offer(s.a, 1, src, 5, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 1, kvx_agent_endpoint(s.a), true, dst, 5, 5 * T - 3), KV_OK);
    struct kvx_result rr = wait_res(1, false, 10), rs = wait_res(1, true, 10);
    assert_int_equal(rr.status, KV_OK);
    assert_int_equal(rs.status, KV_OK);
    assert_int_equal(rr.aux.n_first, 1);
    assert_int_equal(rr.aux.first[0], 42);
    assert_int_equal(rr.aux.cached_tokens, 16);
    assert_int_equal(rr.bytes, 5 * s.bb);
    for (int i = 0; i < 5; i++) assert_true(same(&s, src[i], &r, dst[i]));
    assert_int_equal(count_res(1, false), 1);
    side_stop(&s);
    side_stop(&r);
}

/* A receiver that caches the first 3 of 5 blocks gets the sender's LAST 2 (BUG-17); with nothing
 * missing only the aux data moves. Generation first: the REQ waits for the offer. */
static void test_suffix_and_generation_first(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 5, 60, NULL, 0);
    side_start(&r, 2, 5, 60, NULL, 0);
    int32_t src[5] = {1, 2, 3, 4, 5}, dst[2] = {20, 30};
    for (int i = 0; i < 5; i++) fill(&s, src[i], (uint8_t)(10 + i));
    /* generation first: the receiver asks before the offer exists */
    assert_int_equal(kvx_recv_start(r.a, 2, kvx_agent_endpoint(s.a), false, dst, 2, 5 * T), KV_OK);
    wait_stored(&s, 1);
    struct kvx_aux ax = aux_of(5 * T, 7);
    assert_int_equal(kvx_send_offer(s.a, 2, src, 5, &ax), KV_OK);
    assert_int_equal(wait_res(2, false, 10).status, KV_OK);
    assert_int_equal(wait_res(2, true, 10).status, KV_OK);
    assert_true(same(&s, 4, &r, 20));
    assert_true(same(&s, 5, &r, 30));
    assert_false(same(&s, 1, &r, 20));
    /* zero blocks missing */
    assert_int_equal(kvx_send_offer(s.a, 3, src, 5, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 3, kvx_agent_endpoint(s.a), true, NULL, 0, 5 * T), KV_OK);
    struct kvx_result rr = wait_res(3, false, 10);
    assert_int_equal(rr.status, KV_OK);
    assert_int_equal(rr.bytes, 0);
    assert_int_equal(rr.aux.first[0], 7);
    assert_int_equal(wait_res(3, true, 10).status, KV_OK);
    /* a prompt-length mismatch is refused */
    assert_int_equal(kvx_send_offer(s.a, 4, src, 5, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 4, kvx_agent_endpoint(s.a), true, dst, 2, 5 * T - 1), KV_OK);
    rr = wait_res(4, false, 10);
    assert_int_equal(rr.status, KV_EIO);
    assert_non_null(strstr(rr.message, "prompt length"));
    /* the KV can never be delivered: the sender drops the offer at once (not at its deadline) */
    struct kvx_result rs = wait_res(4, true, 10);
    assert_int_equal(rs.status, KV_EINVAL);
    assert_non_null(strstr(rs.message, "prompt length"));
    side_stop(&s);
    side_stop(&r);
}

/* Fragmented blocks of a large transfer go through the staging buffer; bytes stay exact. */
static void test_bounce_path(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 5, 60, NULL, 1); /* any fragmented transfer of >= 1 block */
    side_start(&r, 2, 5, 60, NULL, 1);
    int32_t src[6] = {5, 1, 9, 3, 7, 11}, dst[6] = {60, 2, 33, 8, 21, 0};
    for (int i = 0; i < 6; i++) fill(&s, src[i], (uint8_t)(77 + i));
    struct kvx_aux ax = aux_of(6 * T, 1);
    assert_int_equal(kvx_send_offer(s.a, 5, src, 6, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 5, kvx_agent_endpoint(s.a), true, dst, 6, 6 * T), KV_OK);
    assert_int_equal(wait_res(5, false, 10).status, KV_OK);
    assert_int_equal(wait_res(5, true, 10).status, KV_OK);
    for (int i = 0; i < 6; i++) assert_true(same(&s, src[i], &r, dst[i]));
    struct kvx_stats a, b;
    kvx_get_stats(s.a, &a);
    kvx_get_stats(r.a, &b);
    /* the bounce path is the TCP stream's; UCX reads the fragments directly */
    assert_int_equal(a.bounce_transfers, g_tp == KVX_TRANSPORT_TCP ? 1 : 0);
    assert_int_equal(b.bounce_transfers, g_tp == KVX_TRANSPORT_TCP ? 1 : 0);
    side_stop(&s);
    side_stop(&r);
}

static void test_page_table_mismatch_refused(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 5, 60, NULL, 0);
    side_start(&r, 4, 5, 60, NULL, 0); /* 4 kv heads vs 2 */
    int32_t b[1] = {0};
    struct kvx_aux ax = aux_of(T, 1);
    assert_int_equal(kvx_send_offer(s.a, 6, b, 1, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 6, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    struct kvx_result rr = wait_res(6, false, 10);
    assert_int_equal(rr.status, KV_EIO);
    assert_non_null(strstr(rr.message, "do not match"));
    /* refused at the handshake: the sender drops the offer at once, naming why (the agent's
     * 60 s deadline is far away) */
    struct kvx_result rs = wait_res(6, true, 10);
    assert_int_equal(rs.status, KV_EINVAL);
    assert_non_null(strstr(rs.message, "refused"));
    /* a refused receiver whose offer has not come yet: the offer is cancelled when it comes */
    assert_int_equal(kvx_recv_start(r.a, 16, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    assert_int_equal(wait_res(16, false, 10).status, KV_EIO);
    assert_int_equal(kvx_send_offer(s.a, 16, b, 1, &ax), KV_OK);
    assert_int_equal(wait_res(16, true, 10).status, KV_ECANCELLED);
    side_stop(&s);
    side_stop(&r);
}

/* DONE dropped: the receiver has its bytes; the sender fails by its deadline (then unpins). */
static void test_drop_done(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 1, 60, NULL, 0);
    side_start(&r, 2, 1, 60, "drop_done", 0);
    int32_t b[2] = {1, 2};
    fill(&s, 1, 1);
    fill(&s, 2, 2);
    struct kvx_aux ax = aux_of(2 * T, 1);
    assert_int_equal(kvx_send_offer(s.a, 7, b, 2, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 7, kvx_agent_endpoint(s.a), true, b, 2, 2 * T), KV_OK);
    assert_int_equal(wait_res(7, false, 5).status, KV_OK);
    struct kvx_result rs = wait_res(7, true, 5);
    assert_int_equal(rs.status, KV_EBUSY);
    assert_non_null(strstr(rs.message, "no DONE"));
    side_stop(&s);
    side_stop(&r);
}

/* The sender never answers: the receiver fails by its deadline; the offer times out too. */
static void test_drop_ready_and_fail_read(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 1, 60, "drop_ready", 0);
    side_start(&r, 2, 1, 60, NULL, 0);
    int32_t b[1] = {3};
    struct kvx_aux ax = aux_of(T, 1);
    assert_int_equal(kvx_send_offer(s.a, 8, b, 1, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 8, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    struct kvx_result rr = wait_res(8, false, 5);
    assert_int_equal(rr.status, KV_EBUSY);
    assert_int_equal(wait_res(8, true, 5).status, KV_EBUSY);
    side_stop(&s);
    side_stop(&r);
    reset();
    side_start(&s, 2, 5, 60, NULL, 0);
    side_start(&r, 2, 5, 60, "fail_read", 0);
    assert_int_equal(kvx_send_offer(s.a, 9, b, 1, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 9, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    rr = wait_res(9, false, 5);
    assert_int_equal(rr.status, KV_EIO);
    assert_non_null(strstr(rr.message, "injected"));
    assert_int_equal(wait_res(9, true, 5).status, KV_EIO); /* the receiver told the sender */
    side_stop(&s);
    side_stop(&r);
}

/* The receiver fails while the sender is still streaming a transfer larger than the socket
 * buffers (~19 MB): the sender's completion carries the receiver's reason (its FAILED frame is
 * read even mid-stream or after a write error), not a protocol error. */
static void test_fail_read_while_streaming(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 128, 5, 60, NULL, SIZE_MAX);
    side_start(&r, 128, 5, 60, "fail_read", SIZE_MAX);
    int32_t b[48];
    for (int i = 0; i < 48; i++) b[i] = i;
    struct kvx_aux ax = aux_of(48 * T, 1);
    assert_int_equal(kvx_send_offer(s.a, 40, b, 48, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 40, kvx_agent_endpoint(s.a), true, b, 48, 48 * T), KV_OK);
    struct kvx_result rr = wait_res(40, false, 5), rs = wait_res(40, true, 5);
    assert_int_equal(rr.status, KV_EIO);
    assert_int_equal(rs.status, KV_EIO);
    if (!strstr(rs.message, "injected")) fail_msg("sender message: '%s'", rs.message);
    side_stop(&s);
    side_stop(&r);
}

/* A receiver that waits before it asks: the sender just holds the pinned blocks (no memory per
 * byte), then serves. */
static void test_delayed_request(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 5, 60, NULL, 0);
    side_start(&r, 2, 5, 60, "delay_request_ms=300", 0);
    int32_t b[1] = {4};
    fill(&s, 4, 9);
    struct kvx_aux ax = aux_of(T, 1);
    assert_int_equal(kvx_send_offer(s.a, 10, b, 1, &ax), KV_OK);
    uint64_t t0 = kv_now_ns();
    assert_int_equal(kvx_recv_start(r.a, 10, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    assert_int_equal(wait_res(10, false, 5).status, KV_OK);
    assert_true(kv_now_ns() - t0 >= 300000000ull);
    assert_true(same(&s, 4, &r, 4));
    assert_int_equal(wait_res(10, true, 5).status, KV_OK);
    side_stop(&s);
    side_stop(&r);
}

static void test_cancels(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 5, 60, NULL, 0);
    side_start(&r, 2, 5, 60, "delay_request_ms=200", 0);
    int32_t b[1] = {4};
    struct kvx_aux ax = aux_of(T, 1);
    /* receiver cancels while it waits: both sides end */
    assert_int_equal(kvx_send_offer(s.a, 11, b, 1, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 11, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    kvx_cancel(r.a, 11);
    assert_int_equal(wait_res(11, false, 5).status, KV_ECANCELLED);
    kvx_cancel(s.a, 11); /* (the receiver never connected: the sender cancels its own offer) */
    assert_int_equal(wait_res(11, true, 5).status, KV_ECANCELLED);
    /* a cancel for an id not seen yet is remembered */
    kvx_cancel(s.a, 12);
    assert_int_equal(kvx_send_offer(s.a, 12, b, 1, &ax), KV_OK);
    assert_int_equal(wait_res(12, true, 5).status, KV_ECANCELLED);
    kvx_cancel(r.a, 13);
    assert_int_equal(kvx_recv_start(r.a, 13, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    assert_int_equal(wait_res(13, false, 5).status, KV_ECANCELLED);
    /* sender cancels while the receiver's request is stored: the receiver hears it at once
     * (long before its 5 s deadline), and an offer that still comes is cancelled */
    side_stop(&r);
    side_start(&r, 2, 5, 60, NULL, 0);
    assert_int_equal(kvx_recv_start(r.a, 16, kvx_agent_endpoint(s.a), false, b, 1, T), KV_OK);
    wait_stored(&s, 1);
    uint64_t t0 = kv_now_ns();
    kvx_cancel(s.a, 16);
    struct kvx_result rc = wait_res(16, false, 5);
    assert_int_equal(rc.status, KV_ECANCELLED);
    assert_non_null(strstr(rc.message, "context worker"));
    assert_true(kv_now_ns() - t0 < 2000000000ull);
    assert_int_equal(kvx_send_offer(s.a, 16, b, 1, &ax), KV_OK);
    assert_int_equal(wait_res(16, true, 5).status, KV_ECANCELLED);
    /* the receiver's request for 14 is stored, an unrelated offer is cancelled meanwhile */
    assert_int_equal(kvx_recv_start(r.a, 14, kvx_agent_endpoint(s.a), false, b, 1, T), KV_OK);
    wait_stored(&s, 1);
    assert_int_equal(kvx_send_offer(s.a, 15, b, 1, &ax), KV_OK); /* unrelated offer */
    kvx_cancel(s.a, 15);
    assert_int_equal(wait_res(15, true, 5).status, KV_ECANCELLED);
    assert_int_equal(kvx_send_offer(s.a, 14, b, 1, &ax), KV_OK);
    assert_int_equal(wait_res(14, false, 5).status, KV_OK);
    assert_int_equal(wait_res(14, true, 5).status, KV_OK);
    /* completion once, and a late cancel changes nothing (sticky) */
    kvx_cancel(s.a, 14);
    kvx_cancel(r.a, 14);
    side_stop(&s);
    side_stop(&r);
    assert_int_equal(count_res(14, true), 1);
    assert_int_equal(count_res(14, false), 1);
}

/* Stale sweep: context-first requests no offer claims get FAILED; generation-first ones are
 * dropped silently (the receiver times out by itself); a later ordinary transfer works. */
static void test_stale_sweep(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 30, 1, NULL, 0);
    side_start(&r, 2, 3, 60, NULL, 0);
    int32_t b[1] = {5};
    uint64_t t0 = kv_now_ns();
    assert_int_equal(kvx_recv_start(r.a, 20, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 21, kvx_agent_endpoint(s.a), false, b, 1, T), KV_OK);
    struct kvx_result a = wait_res(20, false, 5);
    assert_int_equal(a.status, KV_EIO);
    assert_non_null(strstr(a.message, "stale"));
    assert_true(kv_now_ns() - t0 < 2900000000ull); /* by the sweep, not the 3 s deadline */
    struct kvx_result g = wait_res(21, false, 6);
    assert_int_equal(g.status, KV_EBUSY); /* its own deadline */
    assert_true(kv_now_ns() - t0 >= 2900000000ull);
    struct kvx_stats stt;
    kvx_get_stats(s.a, &stt);
    assert_int_equal(stt.stale_failed, 1);
    assert_int_equal(stt.stale_dropped, 1);
    struct kvx_aux ax = aux_of(T, 1);
    fill(&s, 5, 3);
    assert_int_equal(kvx_send_offer(s.a, 22, b, 1, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 22, kvx_agent_endpoint(s.a), true, b, 1, T), KV_OK);
    assert_int_equal(wait_res(22, false, 5).status, KV_OK);
    assert_true(same(&s, 5, &r, 5));
    side_stop(&s);
    side_stop(&r);
}

/* Stop with transfers in flight: every offer and receive completes (cancelled), exactly once;
 * a peer that is gone fails the other side; bad arguments are refused. */
static void test_stop_and_bad_args(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 5, 60, NULL, 0);
    side_start(&r, 2, 5, 60, NULL, 0);
    int32_t b[2] = {1, 2};
    struct kvx_aux ax = aux_of(2 * T, 1);
    assert_int_equal(kvx_send_offer(s.a, 30, b, 2, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 31, kvx_agent_endpoint(s.a), false, b, 2, 2 * T), KV_OK);
    assert_int_equal(kvx_send_offer(s.a, 30, b, 1, &ax), KV_EINVAL); /* counts */
    assert_int_equal(kvx_recv_start(r.a, 32, "nohostport", true, b, 1, T), KV_EINVAL);
    int32_t badb[1] = {NB};
    assert_int_equal(kvx_send_offer(s.a, 33, badb, 1, &(struct kvx_aux){.n_tokens = T}), KV_EINVAL);
    side_stop(&s);
    assert_int_equal(wait_res(30, true, 5).status, KV_ECANCELLED);
    assert_true(wait_res(31, false, 5).status != KV_OK); /* the sender went away */
    /* nothing listens there any more */
    assert_int_equal(kvx_recv_start(r.a, 34, "127.0.0.1:1", true, b, 1, T), KV_OK);
    struct kvx_result rr = wait_res(34, false, 5);
    assert_int_equal(rr.status, KV_EIO);
    assert_non_null(strstr(rr.message, "connect"));
    side_stop(&r);
    assert_int_equal(count_res(30, true), 1);
    assert_int_equal(count_res(31, false), 1);
    char err[128];
    struct kvx_faults f;
    assert_int_equal(kvx_fault_parse("drop_done,delay_request_ms=5", &f, err, sizeof err), KV_OK);
    assert_true(f.drop_done);
    assert_int_equal(f.delay_request_ms, 5);
    assert_int_equal(kvx_fault_parse("explode", &f, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "explode"));
    enum kvx_transport_kind k;
    assert_int_equal(kvx_transport_parse("tcp", &k), KV_OK);
    assert_int_equal(kvx_transport_parse("carrier-pigeon", &k), KV_EINVAL);
}

/* A receiver that gives up before it asks tells the sender: the offer ends now (not at its
 * deadline), and an offer that has not come yet is cancelled when it comes. */
static void test_cancel_remote(void **st) {
    (void)st;
    reset();
    struct side s, r;
    side_start(&s, 2, 30, 60, NULL, 0);
    side_start(&r, 2, 30, 60, NULL, 0);
    int32_t b[1] = {2};
    struct kvx_aux ax = aux_of(T, 1);
    assert_int_equal(kvx_send_offer(s.a, 40, b, 1, &ax), KV_OK);
    uint64_t t0 = kv_now_ns();
    kvx_cancel_remote(r.a, 40, kvx_agent_endpoint(s.a));
    assert_int_equal(wait_res(40, true, 10).status, KV_ECANCELLED);
    assert_true(kv_now_ns() - t0 < 10000000000ull); /* well before the 30 s deadline */
    /* generation first: the offer may come before or after the notification; either way it
     * ends cancelled (dropped if it was there, remembered if not) */
    kvx_cancel_remote(r.a, 41, kvx_agent_endpoint(s.a));
    assert_int_equal(kvx_send_offer(s.a, 41, b, 1, &ax), KV_OK);
    assert_int_equal(wait_res(41, true, 10).status, KV_ECANCELLED);
    assert_int_equal(count_res(40, false) + count_res(41, false), 0); /* no receiver completion */
    kvx_cancel_remote(r.a, 42, "nohostport"); /* ignored */
    side_stop(&s);
    side_stop(&r);
}

/* ---------------------------------------------------------------- a caller-made transport */

/* A stand-in for the CUDA IPC transport (kvx_config.tp, KVX_TRANSPORT_CUDA_IPC) on host memory:
 * named "cuda_ipc", its descriptor is the exposed pointer and length, a read is memcpy per
 * fragment, the completion comes from the next progress(). The agent's plumbing of a transport
 * it did not make (and its refusal of a peer on another transport) is then tested without a GPU;
 * the real transport is tested by tests/unit/backend/test_cuda_ipc.c on the device. */
struct fake_tp {
    uint8_t *base;
    size_t len;
    uint64_t done[64];
    int n_done;
    int destroyed_flag;
};
static int g_fake_destroyed;

static kv_status fake_expose(kvx_transport_t *t, void *base, size_t len, kv_buf *desc, char *err, size_t errlen) {
    (void)err, (void)errlen;
    struct fake_tp *f = t->ctx;
    f->base = base, f->len = len;
    uint64_t rec[2] = {(uint64_t)(uintptr_t)base, len};
    return kv_buf_append(desc, rec, sizeof rec);
}
static kv_status fake_connect(kvx_transport_t *t, const void *desc, size_t len, kvx_peer_t **out, char *err,
                              size_t errlen) {
    (void)t;
    if (len != 16) return kv_errf(KV_EINVAL, err, errlen, "fake transport: bad descriptor");
    uint64_t *rec = malloc(16);
    memcpy(rec, desc, 16);
    *out = (kvx_peer_t *)rec;
    return KV_OK;
}
static void fake_disconnect(kvx_transport_t *t, kvx_peer_t *p) { (void)t, free(p); }
static kv_status fake_read(kvx_transport_t *t, kvx_peer_t *p, int region, const struct kvx_frag *fr, int n,
                           uint64_t cookie, char *err, size_t errlen) {
    struct fake_tp *f = t->ctx;
    const uint64_t *rec = (const uint64_t *)p;
    if (region || f->n_done == 64) return kv_errf(KV_EINVAL, err, errlen, "fake transport: bad read");
    for (int i = 0; i < n; i++) {
        assert_true(fr[i].remote_off + fr[i].len <= rec[1]);
        memcpy(fr[i].local, (uint8_t *)(uintptr_t)rec[0] + fr[i].remote_off, fr[i].len);
    }
    f->done[f->n_done++] = cookie;
    return KV_OK;
}
static int fake_progress(kvx_transport_t *t, struct kvx_completion *out, int cap, int timeout_ms) {
    (void)timeout_ms;
    struct fake_tp *f = t->ctx;
    int k = 0;
    for (; k < cap && k < f->n_done; k++) out[k] = (struct kvx_completion){.cookie = f->done[k], .status = KV_OK};
    memmove(f->done, f->done + k, (size_t)(f->n_done - k) * sizeof f->done[0]);
    f->n_done -= k;
    return k;
}
static void fake_destroy(kvx_transport_t *t) {
    g_fake_destroyed++;
    free(t->ctx);
    free(t);
}
static const struct kvx_transport_ops fake_ops = {"cuda_ipc", fake_expose, NULL, fake_connect, fake_disconnect,
                                                  fake_read, fake_progress, NULL, fake_destroy};

static void side_start_dev(struct side *s) {
    char err[256];
    assert_int_equal(kvx_page_table_dense_kv(&s->pt, 0, 3, 2, 8, T, KVX_DTYPE_BF16, err, sizeof err), KV_OK);
    s->bb = s->pt.views[0].block_bytes;
    s->pool = calloc(NB, s->bb);
    kvx_transport_t *t = calloc(1, sizeof *t);
    t->ops = &fake_ops;
    t->ctx = calloc(1, sizeof(struct fake_tp));
    struct kvx_config c = {.host = "127.0.0.1", .transport = KVX_TRANSPORT_CUDA_IPC, .timeout_s = 5,
                           .pt = &s->pt, .pool_base = s->pool, .n_blocks = NB, .cb = on_result, .tp = t};
    assert_int_equal(kvx_agent_start(&c, &s->a, err, sizeof err), KV_OK);
}

/* Both sides on the caller's "cuda_ipc" transport: bytes exact (one read, no TCP stream); a
 * device-pool side paired with a host-pool (tcp) side is refused at the handshake either way,
 * with the reason, and no byte moves; the agent destroys the transport it was given (also when
 * its start fails). */
static void test_device_transport(void **st) {
    (void)st;
    reset();
    g_fake_destroyed = 0;
    struct side s, r;
    side_start_dev(&s);
    side_start_dev(&r);
    int32_t src[4] = {5, 6, 30, 2}, dst[4] = {1, 40, 41, 9};
    for (int i = 0; i < 4; i++) fill(&s, src[i], (uint8_t)(i + 9));
    struct kvx_aux ax = aux_of(4 * T - 1, 7);
    assert_int_equal(kvx_send_offer(s.a, 80, src, 4, &ax), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 80, kvx_agent_endpoint(s.a), true, dst, 4, 4 * T - 1), KV_OK);
    struct kvx_result rr = wait_res(80, false, 10), rs = wait_res(80, true, 10);
    assert_int_equal(rr.status, KV_OK);
    assert_int_equal(rs.status, KV_OK);
    assert_int_equal(rr.aux.first[0], 7);
    for (int i = 0; i < 4; i++) assert_true(same(&s, src[i], &r, dst[i]));
    struct kvx_stats sst;
    kvx_get_stats(r.a, &sst);
    assert_int_equal(sst.bounce_transfers, 0);
    side_stop(&r);

    /* device sender, host (tcp) receiver with the same page table */
    enum kvx_transport_kind keep = g_tp;
    g_tp = KVX_TRANSPORT_TCP;
    struct side h;
    char err[256];
    assert_int_equal(kvx_page_table_dense_kv(&h.pt, 0, 3, 2, 8, T, KVX_DTYPE_BF16, err, sizeof err), KV_OK);
    h.bb = h.pt.views[0].block_bytes;
    h.pool = calloc(NB, h.bb);
    struct kvx_config hc = {.host = "127.0.0.1", .transport = KVX_TRANSPORT_TCP, .timeout_s = 5, .pt = &h.pt,
                            .pool_base = h.pool, .n_blocks = NB, .cb = on_result};
    assert_int_equal(kvx_agent_start(&hc, &h.a, err, sizeof err), KV_OK);
    assert_int_equal(kvx_send_offer(s.a, 81, src, 1, &(struct kvx_aux){.n_tokens = T, .n_first = 1}), KV_OK);
    assert_int_equal(kvx_recv_start(h.a, 81, kvx_agent_endpoint(s.a), true, dst, 1, T), KV_OK);
    rr = wait_res(81, false, 10);
    assert_int_equal(rr.status, KV_EIO);
    fprintf(stderr, "  device sender, tcp receiver: %s\n", rr.message);
    assert_non_null(strstr(rr.message, "transports do not match"));
    uint8_t zero[64] = {0};
    assert_memory_equal(h.pool + (size_t)dst[0] * h.bb, zero, sizeof zero);
    /* host (tcp) sender, device receiver */
    side_start_dev(&r);
    assert_int_equal(kvx_send_offer(h.a, 82, src, 1, &(struct kvx_aux){.n_tokens = T, .n_first = 1}), KV_OK);
    assert_int_equal(kvx_recv_start(r.a, 82, kvx_agent_endpoint(h.a), true, dst, 1, T), KV_OK);
    rr = wait_res(82, false, 10);
    assert_int_equal(rr.status, KV_EIO);
    assert_non_null(strstr(rr.message, "transports do not match"));
    g_tp = keep;
    side_stop(&s);
    side_stop(&r);
    side_stop(&h);
    assert_int_equal(g_fake_destroyed, 3);
    /* a start that fails still destroys the given transport */
    kvx_transport_t *t = calloc(1, sizeof *t);
    t->ops = &fake_ops;
    t->ctx = calloc(1, sizeof(struct fake_tp));
    struct kvx_config bad = {.transport = KVX_TRANSPORT_CUDA_IPC, .tp = t, .cb = on_result};
    kvx_agent_t *a = NULL;
    assert_int_equal(kvx_agent_start(&bad, &a, err, sizeof err), KV_EINVAL);
    assert_int_equal(g_fake_destroyed, 4);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_transfer),
        cmocka_unit_test(test_suffix_and_generation_first),
        cmocka_unit_test(test_bounce_path),
        cmocka_unit_test(test_page_table_mismatch_refused),
        cmocka_unit_test(test_drop_done),
        cmocka_unit_test(test_drop_ready_and_fail_read),
        cmocka_unit_test(test_fail_read_while_streaming),
        cmocka_unit_test(test_delayed_request),
        cmocka_unit_test(test_cancels),
        cmocka_unit_test(test_stale_sweep),
        cmocka_unit_test(test_stop_and_bad_args),
        cmocka_unit_test(test_cancel_remote),
    };
    const struct CMUnitTest dev_tests[] = {cmocka_unit_test(test_device_transport)};
    int failed = cmocka_run_group_tests_name("transport tcp", tests, NULL, NULL);
    failed += cmocka_run_group_tests_name("caller-made cuda_ipc-style transport", dev_tests, NULL, NULL);
    if (!kvx_transport_ucx_available()) {
        fprintf(stderr, "SKIP: UCX transport not built: the agent tests ran over tcp only\n");
        return failed;
    }
    g_tp = KVX_TRANSPORT_UCX;
    return failed + cmocka_run_group_tests_name("transport ucx", tests, NULL, NULL);
}
