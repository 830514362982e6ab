/*
 * Disaggregated serving at the engine seam, on the real model: a context engine and a
 * generation engine (two CPU backends over stories260K) joined by an in-process MOCK transfer
 * that copies block bytes from the sender's pool to the receiver's (end-aligned, as the real
 * agent does). Checks: both schedule styles reproduce llama.cpp's greedy ids for every public
 * reference prompt; a receiver with a partial prefix hit pulls only the blocks it lacks (a
 * front-aligned copy would change the output: BUG-17); a lost send completion, a failed
 * receive, a cancel during the transfer (blocks stay pinned until the transfer ends: BUG-08)
 * and a transfer that never completes (engine-side deadline) all leave both pools idle; the
 * probe reports the cached prefix.
 */
#include <jansson.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "engine/engine.h"
#include "test_util.h"

#define MAX_REC 32
#define MAX_IDS 128
#define T 16

struct rec {
    int32_t prompt[512];
    int n_prompt;
    int32_t want[MAX_IDS];
    int n_want;
};
static struct rec g_ref[MAX_REC];
static int g_n;
static model_t *g_model;
static tokenizer_t *g_tok;
static backend_t *g_be_ctx, *g_be_gen;

/* ---------------------------------------------------------------- results */

struct out {
    int32_t ids[MAX_IDS + 1];
    int n_ids, n_term;
    enum engine_event_type term;
    enum finish_reason fin;
    int cached, prompt_tokens;
    uint64_t req_id;
};
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

static void on_event(const struct engine_event *ev, void *user) {
    struct out *o = user;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < ev->n_ids && o->n_ids < MAX_IDS; i++) o->ids[o->n_ids++] = ev->ids[i];
    if (ev->type != ENGINE_EV_DELTA) {
        o->n_term++;
        o->term = ev->type;
        o->fin = ev->finish;
        o->cached = ev->cached_tokens;
        o->prompt_tokens = ev->prompt_tokens;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static void wait_term(struct out *o) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 60;
    pthread_mutex_lock(&g_mu);
    while (!o->n_term)
        if (pthread_cond_timedwait(&g_cv, &g_mu, &ts)) {
            pthread_mutex_unlock(&g_mu);
            fail_msg("timeout waiting for a terminal event");
        }
    pthread_mutex_unlock(&g_mu);
}

/* Waits (bounded) until the engine's used-block count is `want`. */
static void wait_used(engine_t *e, int want, double max_s) {
    struct engine_stats s;
    if (engine_wait_idle(e, (int)(max_s * 1000)) != KV_OK) fail_msg("engine not idle after %.0f s", max_s);
    engine_get_stats(e, &s);
    if (s.kv_blocks_used != want || s.n_transfer_in + s.n_transfer_out != 0)
        fail_msg("kv_blocks_used %d (want %d), transfers %d/%d", s.kv_blocks_used, want,
                 s.n_transfer_out, s.n_transfer_in);
}

/* ---------------------------------------------------------------- mock transfer */

enum { M_NORMAL = 0, M_DROP_SEND_DONE, M_FAIL_RECV, M_HOLD_RECV, M_IGNORE_ALL };

struct offer {
    uint64_t id;
    int32_t blocks[64];
    int n_blocks, n_tokens;
    int32_t first;
    uint64_t tokens_hash;
    bool used;
};
struct pending {
    uint64_t id;
    int32_t dst[64];
    int n_dst, n_tokens;
    bool used;
};
static struct {
    pthread_mutex_t mu;
    engine_t *ctx, *gen;
    int mode;
    struct offer offers[64];
    int n_offers;
    struct pending recvs[64];
    int n_recvs;
    int last_n_dst;
    int n_cancel_calls;
} g_mock = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Copies the sender's LAST n_dst blocks into dst (under g_mock.mu). */
static void mock_serve(struct offer *o, struct pending *p) {
    size_t bb = kv_block_bytes(&g_be_ctx->geom);
    int from = o->n_blocks - p->n_dst;
    for (int i = 0; i < p->n_dst; i++)
        memcpy(g_be_gen->ops->block_ptr(g_be_gen, p->dst[i]),
               g_be_ctx->ops->block_ptr(g_be_ctx, o->blocks[from + i]), bb);
    o->used = p->used = true;
    g_mock.last_n_dst = p->n_dst;
    if (g_mock.mode == M_HOLD_RECV) return; /* completion later (mock_release) */
    if (g_mock.mode == M_FAIL_RECV)
        engine_kv_transfer_done(g_mock.gen, p->id, false, KV_EIO, "mock: read failed", NULL, 0);
    else
        engine_kv_transfer_done_ex(g_mock.gen, p->id, false, KV_OK, NULL, &o->first, 1, o->tokens_hash,
                                   NULL, NULL, 0);
    if (g_mock.mode != M_DROP_SEND_DONE)
        engine_kv_transfer_done(g_mock.ctx, o->id, true,
                                g_mock.mode == M_FAIL_RECV ? KV_EIO : KV_OK, NULL, NULL, 0);
}

static void mock_try(void) {
    for (int i = 0; i < g_mock.n_offers; i++)
        for (int j = 0; j < g_mock.n_recvs; j++)
            if (!g_mock.offers[i].used && !g_mock.recvs[j].used &&
                g_mock.offers[i].id == g_mock.recvs[j].id)
                mock_serve(&g_mock.offers[i], &g_mock.recvs[j]);
}

static kv_status mock_offer(void *ctx, uint64_t id, const int32_t *blocks, int n_blocks,
                            int n_tokens, const int32_t *first, int n_first, int cached,
                            uint64_t tokens_hash, const struct token_logprob *lp,
                            const struct token_logprob *top, int n_top) {
    (void)ctx;
    (void)lp;
    (void)top;
    (void)n_top;
    (void)cached;
    assert_true(tokens_hash != 0);
    assert_int_equal(n_first, 1);
    assert_int_equal(n_blocks, (n_tokens + T - 1) / T);
    pthread_mutex_lock(&g_mock.mu);
    struct offer *o = &g_mock.offers[g_mock.n_offers++ % 64];
    memset(o, 0, sizeof *o);
    o->id = id;
    memcpy(o->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
    o->n_blocks = n_blocks;
    o->n_tokens = n_tokens;
    o->first = first[0];
    o->tokens_hash = tokens_hash;
    if (g_mock.mode != M_IGNORE_ALL) mock_try();
    pthread_mutex_unlock(&g_mock.mu);
    return KV_OK;
}

static kv_status mock_recv(void *ctx, uint64_t id, const char *peer, bool context_first,
                           const int32_t *dst, int n_dst, int n_tokens) {
    (void)ctx;
    (void)context_first;
    assert_string_equal(peer, "mock:1");
    pthread_mutex_lock(&g_mock.mu);
    struct pending *p = &g_mock.recvs[g_mock.n_recvs++ % 64];
    memset(p, 0, sizeof *p);
    p->id = id;
    memcpy(p->dst, dst, (size_t)n_dst * sizeof *dst);
    p->n_dst = n_dst;
    p->n_tokens = n_tokens;
    if (g_mock.mode != M_IGNORE_ALL) mock_try();
    pthread_mutex_unlock(&g_mock.mu);
    return KV_OK;
}

/* A cancel ends the transfer on both sides, as the agent does (unless told to ignore it). */
static void mock_cancel(void *ctx, uint64_t id) {
    engine_t *self = ctx;
    pthread_mutex_lock(&g_mock.mu);
    g_mock.n_cancel_calls++;
    int mode = g_mock.mode;
    pthread_mutex_unlock(&g_mock.mu);
    if (mode == M_IGNORE_ALL || mode == M_HOLD_RECV) return; /* HOLD: the test completes it */
    engine_kv_transfer_done(self, id, self == g_mock.ctx, KV_ECANCELLED, "cancelled", NULL, 0);
}

/* M_HOLD_RECV: the transfer "lands" now. */
static void mock_release(uint64_t id) {
    engine_kv_transfer_done(g_mock.gen, id, false, KV_OK, NULL, &g_mock.offers[0].first, 1);
    engine_kv_transfer_done(g_mock.ctx, id, true, KV_OK, NULL, NULL, 0);
}

/* ---------------------------------------------------------------- setup */

static int load_refs(const char *path) {
    json_error_t je;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0 && g_n < MAX_REC) {
        json_t *o = json_loads(line, 0, &je);
        if (!o) continue;
        struct rec *r = &g_ref[g_n];
        memset(r, 0, sizeof *r);
        json_t *a = json_object_get(o, "prompt_ids"), *v;
        size_t i;
        json_array_foreach(a, i, v) if (i < 512) r->prompt[r->n_prompt++] = (int32_t)json_integer_value(v);
        a = json_object_get(o, "completion_ids");
        json_array_foreach(a, i, v) if (i < MAX_IDS) r->want[r->n_want++] = (int32_t)json_integer_value(v);
        json_decref(o);
        g_n++;
    }
    free(line);
    fclose(f);
    return g_n > 0 ? 0 : -1;
}

static int setup(void **st) {
    (void)st;
    char mpath[4096], rpath[4096], err[512];
    if (!test_data_path(mpath, sizeof mpath, "models/stories260K/stories260K.gguf") ||
        !test_data_path(rpath, sizeof rpath, "references/stories260K/llamacpp_greedy.public.jsonl"))
        return 0;
    if (load_refs(rpath) || model_load(mpath, &g_model, err, sizeof err) != KV_OK ||
        tok_load(mpath, &g_tok, err, sizeof err) != KV_OK ||
        backend_cpu_new(g_model, 1, &g_be_ctx, err, sizeof err) != KV_OK ||
        backend_cpu_new(g_model, 1, &g_be_gen, err, sizeof err) != KV_OK) {
        fprintf(stderr, "SKIP: stories260K not loadable: %s\n", err);
        g_n = 0;
    }
    return 0;
}

static int teardown(void **st) {
    (void)st;
    if (g_be_ctx) backend_free(g_be_ctx);
    if (g_be_gen) backend_free(g_be_gen);
    if (g_tok) tok_free(g_tok);
    if (g_model) model_free(g_model);
    return 0;
}

static void require_data(void) {
    if (!g_n || !g_be_gen) {
        fprintf(stderr, "SKIP: stories260K model/tokenizer/reference not available\n");
        skip();
    }
}

static void start_pair(double timeout_s, int mode) {
    char err[512] = "";
    struct engine_config cfg = {.tokens_per_block = T, .n_blocks = 256, .max_batch_size = 16,
                                .max_num_tokens = 64, .max_model_len = 512, .max_queue = 64,
                                .prefix_wait_blocks = -1};
    assert_int_equal(engine_start(&cfg, g_model, g_tok, g_be_ctx, &g_mock.ctx, err, sizeof err), KV_OK);
    assert_int_equal(engine_start(&cfg, g_model, g_tok, g_be_gen, &g_mock.gen, err, sizeof err), KV_OK);
    struct engine_kv_transfer xc = {.ctx = g_mock.ctx, .offer = mock_offer, .recv = mock_recv,
                                    .cancel = mock_cancel, .timeout_s = timeout_s};
    struct engine_kv_transfer xg = xc;
    xg.ctx = g_mock.gen;
    engine_set_kv_transfer(g_mock.ctx, &xc);
    engine_set_kv_transfer(g_mock.gen, &xg);
    pthread_mutex_lock(&g_mock.mu);
    g_mock.mode = mode;
    g_mock.n_offers = g_mock.n_recvs = 0;
    g_mock.last_n_dst = -1;
    g_mock.n_cancel_calls = 0;
    pthread_mutex_unlock(&g_mock.mu);
}

static void stop_pair(void) {
    engine_stop(g_mock.ctx);
    engine_stop(g_mock.gen);
    g_mock.ctx = g_mock.gen = NULL;
}

static void params(struct engine_request_params *p, const struct rec *r, int max_tokens) {
    memset(p, 0, sizeof *p);
    p->prompt_ids = r->prompt;
    p->n_prompt = (size_t)r->n_prompt;
    p->max_tokens = max_tokens;
    p->ignore_eos = true;
    sampling_params_default(&p->sp);
    p->sp.temperature = 0.0f;
}

/* One request through both engines; returns the generation leg's output in *g. */
static void run_disagg(const struct rec *r, uint64_t id, bool context_first, struct out *c,
                       struct out *g, int max_tokens) {
    char err[256];
    struct engine_request_params pc, pg;
    params(&pc, r, max_tokens);
    pc.disagg = ENGINE_DISAGG_CONTEXT_ONLY;
    pc.disagg_id = id;
    pc.context_first = context_first;
    params(&pg, r, max_tokens);
    pg.disagg = ENGINE_DISAGG_GENERATION_ONLY;
    pg.disagg_id = id;
    pg.context_first = context_first;
    pg.peer_endpoint = "mock:1";
    memset(c, 0, sizeof *c);
    memset(g, 0, sizeof *g);
    if (context_first) {
        assert_int_equal(engine_submit(g_mock.ctx, &pc, on_event, c, &c->req_id, err, sizeof err), KV_OK);
        wait_term(c);
        assert_int_equal(c->term, ENGINE_EV_FINISH);
        assert_int_equal(c->fin, FINISH_NOT_FINISHED);
        assert_int_equal(c->n_ids, 1);
        pg.first_tokens = c->ids;
        pg.n_first = 1;
        assert_int_equal(engine_submit(g_mock.gen, &pg, on_event, g, &g->req_id, err, sizeof err), KV_OK);
    } else {
        assert_int_equal(engine_submit(g_mock.gen, &pg, on_event, g, &g->req_id, err, sizeof err), KV_OK);
        assert_int_equal(engine_submit(g_mock.ctx, &pc, on_event, c, &c->req_id, err, sizeof err), KV_OK);
        wait_term(c);
    }
}

static void check_ref(const struct rec *r, const struct out *g, int n) {
    assert_int_equal(g->term, ENGINE_EV_FINISH);
    assert_int_equal(g->n_ids, n);
    for (int k = 0; k < n; k++)
        if (g->ids[k] != r->want[k]) fail_msg("token %d: got %d want %d", k, g->ids[k], r->want[k]);
}

/* ---------------------------------------------------------------- tests */

static void flow_matches_reference(bool context_first) {
    start_pair(10.0, M_NORMAL);
    for (int i = 0; i < g_n; i++) {
        struct out c, g;
        run_disagg(&g_ref[i], 1000 + (uint64_t)i, context_first, &c, &g, 32);
        wait_term(&g);
        check_ref(&g_ref[i], &g, 32);
        assert_int_equal(g.fin, FINISH_LENGTH);
    }
    wait_used(g_mock.ctx, 0, 10);
    wait_used(g_mock.gen, 0, 10);
    struct engine_stats s;
    engine_get_stats(g_mock.ctx, &s);
    assert_int_equal((int)s.kv_sends_ok, g_n);
    engine_get_stats(g_mock.gen, &s);
    assert_int_equal((int)s.kv_recvs_ok, g_n);
    stop_pair();
}

static void test_context_first_matches_reference(void **st) {
    (void)st;
    require_data();
    flow_matches_reference(true);
}

static void test_generation_first_matches_reference(void **st) {
    (void)st;
    require_data();
    flow_matches_reference(false);
}

/* The generation engine already caches the prompt's full blocks: only the last block moves,
 * and it must be the sender's LAST block (end alignment). */
static void test_partial_prefix_hit_pulls_suffix(void **st) {
    (void)st;
    require_data();
    int k = 0;
    for (int i = 0; i < g_n; i++)
        if (g_ref[i].n_prompt > 3 * T) k = i;
    const struct rec *r = &g_ref[k];
    if (r->n_prompt <= 3 * T) skip();
    start_pair(10.0, M_NORMAL);
    struct out c, g;
    run_disagg(r, 1, true, &c, &g, 16);
    wait_term(&g);
    check_ref(r, &g, 16);
    int nb = (r->n_prompt + T - 1) / T;
    assert_int_equal(g_mock.last_n_dst, nb);
    run_disagg(r, 2, true, &c, &g, 16);
    wait_term(&g);
    check_ref(r, &g, 16);
    assert_int_equal(g_mock.last_n_dst, nb - (r->n_prompt - 1) / T); /* just the last block */
    assert_int_equal(g.cached, ((r->n_prompt - 1) / T) * T);
    wait_used(g_mock.ctx, 0, 10);
    wait_used(g_mock.gen, 0, 10);
    stop_pair();
}

/* The receiver never confirms: the sender's engine deadline cancels and frees the blocks. */
static void test_lost_send_completion_releases_sender(void **st) {
    (void)st;
    require_data();
    start_pair(0.3, M_DROP_SEND_DONE);
    struct out c, g;
    run_disagg(&g_ref[0], 7, true, &c, &g, 8);
    wait_term(&g);
    check_ref(&g_ref[0], &g, 8);
    wait_used(g_mock.gen, 0, 10);
    wait_used(g_mock.ctx, 0, 10); /* deadline 0.3 s + grace, then the cancel completes it */
    struct engine_stats s;
    engine_get_stats(g_mock.ctx, &s);
    assert_true(s.kv_transfer_timeouts >= 1);
    assert_true(s.kv_sends_failed >= 1);
    /* the next request still works */
    pthread_mutex_lock(&g_mock.mu);
    g_mock.mode = M_NORMAL;
    pthread_mutex_unlock(&g_mock.mu);
    run_disagg(&g_ref[1], 8, true, &c, &g, 8);
    wait_term(&g);
    check_ref(&g_ref[1], &g, 8);
    stop_pair();
}

/* Waits (10 s at most) until the generation engine has started a receive. */
static void wait_recv_started(void) {
    uint64_t end = kv_now_ns() + 10000000000ull;
    for (;;) {
        pthread_mutex_lock(&g_mock.mu);
        int n = g_mock.n_recvs;
        pthread_mutex_unlock(&g_mock.mu);
        if (n) break;
        if (kv_now_ns() > end) fail_msg("receive never started");
        struct timespec d = {0, 1000000};
        nanosleep(&d, NULL);
    }
}

static void test_failed_receive_fails_request(void **st) {
    (void)st;
    require_data();
    start_pair(10.0, M_FAIL_RECV);
    struct out c, g;
    run_disagg(&g_ref[0], 9, false, &c, &g, 8);
    wait_term(&g);
    assert_int_equal(g.term, ENGINE_EV_ERROR);
    assert_int_equal(g.n_ids, 0);
    wait_used(g_mock.ctx, 0, 10);
    wait_used(g_mock.gen, 0, 10);
    struct engine_stats s;
    engine_get_stats(g_mock.gen, &s);
    assert_int_equal(s.requests_failed, 1); /* a transfer error is a failure */
    assert_int_equal(s.requests_cancelled, 0);
    stop_pair();
}

/* The context worker cancels the transfer (the router's /kv_release or the context leg's
 * client left, reaching it before the generation worker sees its own client go): the
 * generation leg ends with an error event (status KV_ECANCELLED), counted as cancelled, not
 * failed, and every block comes back. */
static void test_peer_cancel_counts_as_cancelled(void **st) {
    (void)st;
    require_data();
    start_pair(10.0, M_HOLD_RECV);
    struct out c, g;
    run_disagg(&g_ref[0], 15, true, &c, &g, 8);
    wait_recv_started();
    engine_kv_transfer_done(g_mock.gen, 15, false, KV_ECANCELLED, "cancelled by the context worker", NULL, 0);
    wait_term(&g);
    assert_int_equal(g.term, ENGINE_EV_ERROR);
    engine_kv_transfer_done(g_mock.ctx, 15, true, KV_ECANCELLED, "cancelled", NULL, 0);
    wait_used(g_mock.gen, 0, 10);
    wait_used(g_mock.ctx, 0, 10);
    struct engine_stats s;
    engine_get_stats(g_mock.gen, &s);
    assert_int_equal(s.requests_cancelled, 1);
    assert_int_equal(s.requests_failed, 0);
    stop_pair();
}

/* Cancel during the transfer: the client hears CANCELLED at once, but the blocks stay pinned
 * until the transfer has drained (a peer may still be writing them: BUG-08). */
static void test_cancel_during_transfer_keeps_blocks_pinned(void **st) {
    (void)st;
    require_data();
    start_pair(10.0, M_HOLD_RECV);
    struct out c, g;
    run_disagg(&g_ref[0], 11, true, &c, &g, 8);
    wait_recv_started();
    engine_cancel(g_mock.gen, g.req_id);
    wait_term(&g);
    assert_int_equal(g.fin, FINISH_CANCELLED);
    /* the transfer has not drained: the receiver's blocks are still pinned */
    struct engine_stats s;
    engine_get_stats(g_mock.gen, &s);
    assert_int_equal(s.n_transfer_in, 1);
    assert_true(s.kv_blocks_used > 0);
    int nb = (g_ref[0].n_prompt + T - 1) / T;
    assert_int_equal(g_mock.n_cancel_calls, 1);
    /* it drains now (the receive completes as cancelled, the sender's send as done) */
    engine_kv_transfer_done(g_mock.gen, 11, false, KV_ECANCELLED, "cancelled", NULL, 0);
    mock_release(11); /* late receive success for the same id is ignored: the error is sticky */
    wait_used(g_mock.gen, 0, 10);
    wait_used(g_mock.ctx, 0, 10);
    (void)nb;
    stop_pair();
}

/* A transfer layer that never completes anything: the engine deadline fires twice (cancel,
 * then forced release) and nothing leaks or hangs. */
static void test_transfer_that_never_completes(void **st) {
    (void)st;
    require_data();
    start_pair(0.2, M_IGNORE_ALL);
    struct out c, g;
    run_disagg(&g_ref[0], 13, true, &c, &g, 8);
    wait_term(&g);
    assert_int_equal(g.term, ENGINE_EV_ERROR);
    wait_used(g_mock.gen, 0, 10);
    wait_used(g_mock.ctx, 0, 10);
    assert_true(g_mock.n_cancel_calls >= 2);
    stop_pair();
}

static void test_probe_reports_cached_prefix(void **st) {
    (void)st;
    require_data();
    start_pair(10.0, M_NORMAL);
    const struct rec *r = &g_ref[0];
    for (int i = 0; i < g_n; i++)
        if (g_ref[i].n_prompt > r->n_prompt) r = &g_ref[i];
    char err[256];
    struct engine_request_params p;
    struct out o;
    params(&p, r, 1);
    p.disagg = ENGINE_DISAGG_PROBE;
    memset(&o, 0, sizeof o);
    assert_int_equal(engine_submit(g_mock.gen, &p, on_event, &o, NULL, err, sizeof err), KV_OK);
    wait_term(&o);
    assert_int_equal(o.cached, 0);
    assert_int_equal(o.prompt_tokens, r->n_prompt);
    params(&p, r, 2);
    memset(&o, 0, sizeof o);
    assert_int_equal(engine_submit(g_mock.gen, &p, on_event, &o, NULL, err, sizeof err), KV_OK);
    wait_term(&o);
    params(&p, r, 1);
    p.disagg = ENGINE_DISAGG_PROBE;
    memset(&o, 0, sizeof o);
    assert_int_equal(engine_submit(g_mock.gen, &p, on_event, &o, NULL, err, sizeof err), KV_OK);
    wait_term(&o);
    assert_int_equal(o.cached, ((r->n_prompt - 1) / T) * T);
    wait_used(g_mock.gen, 0, 10);
    stop_pair();
}

/* A generation leg whose prompt is not the one the context worker computed (forged or stale
 * prompt_token_ids of the same length) fails: it never decodes from, nor caches, that KV. */
static void test_prompt_mismatch_fails(void **st) {
    (void)st;
    require_data();
    start_pair(10.0, M_NORMAL);
    const struct rec *r = &g_ref[0];
    char err[256];
    struct engine_request_params pc, pg;
    struct out c, g;
    memset(&c, 0, sizeof c);
    memset(&g, 0, sizeof g);
    params(&pc, r, 8);
    pc.disagg = ENGINE_DISAGG_CONTEXT_ONLY;
    pc.disagg_id = 21;
    pc.context_first = true;
    assert_int_equal(engine_submit(g_mock.ctx, &pc, on_event, &c, &c.req_id, err, sizeof err), KV_OK);
    wait_term(&c);
    struct rec forged = *r;
    forged.prompt[forged.n_prompt - 1] = forged.prompt[forged.n_prompt - 1] == 5 ? 6 : 5;
    params(&pg, &forged, 8);
    pg.disagg = ENGINE_DISAGG_GENERATION_ONLY;
    pg.disagg_id = 21;
    pg.context_first = true;
    pg.peer_endpoint = "mock:1";
    pg.first_tokens = c.ids;
    pg.n_first = 1;
    assert_int_equal(engine_submit(g_mock.gen, &pg, on_event, &g, &g.req_id, err, sizeof err), KV_OK);
    wait_term(&g);
    assert_int_equal(g.term, ENGINE_EV_ERROR);
    assert_int_equal(g.n_ids, 0);
    wait_used(g_mock.gen, 0, 10);
    wait_used(g_mock.ctx, 0, 10);
    /* nothing of it was indexed: the forged prompt finds no cached block */
    struct engine_request_params pp;
    struct out o;
    params(&pp, &forged, 1);
    pp.disagg = ENGINE_DISAGG_PROBE;
    memset(&o, 0, sizeof o);
    assert_int_equal(engine_submit(g_mock.gen, &pp, on_event, &o, NULL, err, sizeof err), KV_OK);
    wait_term(&o);
    assert_int_equal(o.cached, 0);
    stop_pair();
}

static void test_disagg_without_transfer_is_refused(void **st) {
    (void)st;
    require_data();
    char err[256] = "";
    engine_t *e = NULL;
    struct engine_config cfg = {.tokens_per_block = T, .n_blocks = 64, .max_model_len = 512};
    assert_int_equal(engine_start(&cfg, g_model, g_tok, g_be_ctx, &e, err, sizeof err), KV_OK);
    struct engine_request_params p;
    params(&p, &g_ref[0], 4);
    p.disagg = ENGINE_DISAGG_CONTEXT_ONLY;
    struct out o;
    assert_int_equal(engine_submit(e, &p, on_event, &o, NULL, err, sizeof err), KV_EUNSUPPORTED);
    assert_non_null(strstr(err, "--role"));
    engine_stop(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_context_first_matches_reference),
        cmocka_unit_test(test_generation_first_matches_reference),
        cmocka_unit_test(test_partial_prefix_hit_pulls_suffix),
        cmocka_unit_test(test_lost_send_completion_releases_sender),
        cmocka_unit_test(test_failed_receive_fails_request),
        cmocka_unit_test(test_peer_cancel_counts_as_cancelled),
        cmocka_unit_test(test_cancel_during_transfer_keeps_blocks_pinned),
        cmocka_unit_test(test_transfer_that_never_completes),
        cmocka_unit_test(test_probe_reports_cached_prefix),
        cmocka_unit_test(test_prompt_mismatch_fails),
        cmocka_unit_test(test_disagg_without_transfer_is_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
