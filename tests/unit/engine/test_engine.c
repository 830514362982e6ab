/*
 * Engine tests against the FAKE backend of engine_fake.h (block-table bookkeeping, batching
 * invariance, chunked prefill, preemption, cancellation, queue limits, validation, EOS and
 * stop strings).
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "engine_fake.h"

/* ---------------------------------------------------------------- tests */

static void test_batching_invariance(void **st) {
    (void)st;
    enum { N = 12 };
    static struct req_spec r[N];
    static struct coll alone[N], conc[N];
    make_specs(r, N, 1, 60, 0, 11);
    run_alone(r, N, alone);

    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 128, .max_batch_size = 6,
                                .max_num_tokens = 24, .max_model_len = 256, .max_queue = 64};
    engine_t *e = start(&f, &cfg);
    memset(conc, 0, sizeof conc);
    for (int i = 0; i < N; i++) submit_ok(e, &r[i].p, &conc[i]);
    wait_done(conc, N);
    wait_blocks_free(e);
    struct engine_stats s;
    engine_get_stats(e, &s);
    engine_stop(e);
    for (int i = 0; i < N; i++) {
        assert_same(&alone[i], &conc[i]);
        assert_int_equal(conc[i].fin, FINISH_LENGTH);
        assert_int_equal(conc[i].n_ids, r[i].p.max_tokens);
        assert_text_matches_decode(&conc[i]);
        if (r[i].p.sp.top_logprobs) {
            assert_int_equal(conc[i].n_top, 3);
            for (int k = 0; k < conc[i].n_ids; k++) {
                const struct token_logprob *t = &conc[i].top[k * 3];
                assert_true(t[0].logprob >= t[1].logprob && t[1].logprob >= t[2].logprob);
                assert_true(conc[i].lp[k].logprob <= t[0].logprob);
                assert_int_equal(conc[i].lp[k].id, conc[i].ids[k]);
            }
        }
    }
    assert_int_equal(f.n_bad, 0);
    assert_true(f.max_step_tokens <= 24);
    assert_true(f.max_step_seqs <= 6);
    assert_true(f.n_mixed > 0); /* prefill chunks shared steps with decodes */
    assert_int_equal(s.requests_total, N);
    assert_int_equal(s.requests_finished, N);
    fake_destroy(&f);
}

static void test_chunked_prefill(void **st) {
    (void)st;
    struct req_spec r;
    make_specs(&r, 1, 100, 100, 3, 5);
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 32, .max_batch_size = 8,
                                .max_num_tokens = 16, .max_model_len = 256, .max_queue = 8};
    engine_t *e = start(&f, &cfg);
    struct coll c;
    memset(&c, 0, sizeof c);
    submit_ok(e, &r.p, &c);
    wait_done(&c, 1);
    wait_blocks_free(e);
    engine_stop(e);
    /* 100 prompt tokens in chunks of 16 (only the last wants logits), then 2 decodes */
    const struct step_log want[] = {{16, 0, 0},  {16, 16, 0}, {16, 32, 0}, {16, 48, 0}, {16, 64, 0},
                                    {16, 80, 0}, {4, 96, 1},  {1, 100, 1}, {1, 101, 1}};
    assert_int_equal(f.n_log, 9);
    for (int i = 0; i < 9; i++) {
        assert_int_equal(f.log[i].n_tokens, want[i].n_tokens);
        assert_int_equal(f.log[i].n_past, want[i].n_past);
        assert_int_equal(f.log[i].logits, want[i].logits);
    }
    assert_int_equal(c.n_ids, 3);
    assert_int_equal(c.fin, FINISH_LENGTH);
    fake_destroy(&f);
}

static void test_preemption(void **st) {
    (void)st;
    enum { N = 6 };
    static struct req_spec r[N];
    static struct coll alone[N], conc[N];
    make_specs(r, N, 20, 30, 30, 23);
    run_alone(r, N, alone);

    struct fake f;
    fake_init(&f);
    /* 16 blocks x 4 tokens = one 64-token sequence; 6 requests of ~55 tokens each */
    struct engine_config cfg = {.tokens_per_block = 4, .n_blocks = 16, .max_batch_size = 8,
                                .max_num_tokens = 64, .max_model_len = 64, .max_queue = 64};
    engine_t *e = start(&f, &cfg);
    memset(conc, 0, sizeof conc);
    for (int i = 0; i < N; i++) submit_ok(e, &r[i].p, &conc[i]);
    wait_done(conc, N);
    wait_blocks_free(e);
    struct engine_stats s;
    engine_get_stats(e, &s);
    engine_stop(e);
    for (int i = 0; i < N; i++) {
        assert_same(&alone[i], &conc[i]);
        assert_text_matches_decode(&conc[i]);
    }
    assert_true(s.preemptions_total > 0);
    assert_int_equal(s.kv_blocks_free, 16);
    assert_int_equal(s.requests_finished, N);
    assert_int_equal(f.n_bad, 0);
    fake_destroy(&f);
}

static void test_cancel_mid_prefill(void **st) {
    (void)st;
    struct req_spec r;
    make_specs(&r, 1, 200, 200, 10, 9);
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 32, .max_batch_size = 8,
                                .max_num_tokens = 8, .max_model_len = 256, .max_queue = 8};
    engine_t *e = start(&f, &cfg);
    struct coll c;
    memset(&c, 0, sizeof c);
    f.cancel_at_call = 5;
    fake_gate(&f, true); /* so cancel_id is set before the first forward */
    submit_ok(e, &r.p, &c);
    f.cancel_id = c.id;
    fake_gate(&f, false);
    wait_done(&c, 1);
    wait_blocks_free(e);
    struct engine_stats s;
    engine_get_stats(e, &s);
    engine_stop(e);
    assert_int_equal(c.term, ENGINE_EV_FINISH);
    assert_int_equal(c.fin, FINISH_CANCELLED);
    assert_int_equal(c.n_deltas, 0);
    assert_int_equal(c.completion_tokens, 0);
    assert_int_equal(f.n_calls, 5); /* no step ran for it after the cancel */
    assert_int_equal(s.requests_cancelled, 1);
    /* cancel of an unknown / finished id is ignored */
    fake_destroy(&f);
}

static void test_queue_full(void **st) {
    (void)st;
    struct req_spec r[4];
    make_specs(r, 4, 5, 10, 4, 3);
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 32, .max_batch_size = 8,
                                .max_num_tokens = 64, .max_model_len = 128, .max_queue = 2};
    engine_t *e = start(&f, &cfg);
    struct coll c[4];
    memset(c, 0, sizeof c);
    fake_gate(&f, true);
    submit_ok(e, &r[0].p, &c[0]);
    fake_wait_in_forward(&f); /* A is running, blocked in forward */
    submit_ok(e, &r[1].p, &c[1]);
    submit_ok(e, &r[2].p, &c[2]);
    char err[256] = "";
    uint64_t id = 0;
    assert_int_equal(engine_submit(e, &r[3].p, on_event, &c[3], &id, err, sizeof err), KV_EBUSY);
    assert_true(strlen(err) > 0);
    fake_gate(&f, false);
    wait_done(c, 3);
    wait_blocks_free(e);
    engine_cancel(e, c[0].id); /* finished: ignored */
    engine_cancel(e, 987654);  /* unknown: ignored */
    engine_stop(e);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(c[i].n_term, 1);
        assert_int_equal(c[i].n_after_term, 0);
        assert_int_equal(c[i].fin, FINISH_LENGTH);
    }
    assert_int_equal(c[3].n_term + c[3].n_deltas, 0);
    fake_destroy(&f);
}

static void test_validation(void **st) {
    (void)st;
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 8, .max_batch_size = 8,
                                .max_num_tokens = 64, .max_model_len = 128, .max_queue = 8};
    engine_t *e = start(&f, &cfg);
    static int32_t prompt[200];
    for (int i = 0; i < 200; i++) prompt[i] = 5 + i;
    struct engine_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt_ids = prompt;
    p.n_prompt = 128;
    p.max_tokens = 10;
    sampling_params_default(&p.sp);
    struct coll c;
    memset(&c, 0, sizeof c);
    char err[256] = "";
    uint64_t id;
    assert_int_equal(engine_submit(e, &p, on_event, &c, &id, err, sizeof err), KV_ETOOLONG);
    assert_non_null(strstr(err, "prompt has 128 tokens, max_model_len is 128"));
    p.n_prompt = 0;
    assert_int_equal(engine_submit(e, &p, on_event, &c, &id, err, sizeof err), KV_EINVAL);
    p.n_prompt = 4;
    prompt[2] = VOCAB;
    assert_int_equal(engine_submit(e, &p, on_event, &c, &id, err, sizeof err), KV_EINVAL);
    prompt[2] = 7;
    struct { int field; float v; } bad[] = {{0, -0.5f}, {1, 0.0f}, {1, 1.5f}, {2, -0.1f}, {2, 1.1f},
                                            {3, 2.5f}, {4, -3.0f}, {5, 0.0f}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct engine_request_params q = p;
        switch (bad[i].field) {
        case 0: q.sp.temperature = bad[i].v; break;
        case 1: q.sp.top_p = bad[i].v; break;
        case 2: q.sp.min_p = bad[i].v; break;
        case 3: q.sp.presence_penalty = bad[i].v; break;
        case 4: q.sp.frequency_penalty = bad[i].v; break;
        case 5: q.sp.repetition_penalty = bad[i].v; break;
        }
        assert_int_equal(engine_submit(e, &q, on_event, &c, &id, err, sizeof err), KV_EINVAL);
    }
    struct engine_request_params q = p;
    q.sp.top_k = -2;
    assert_int_equal(engine_submit(e, &q, on_event, &c, &id, err, sizeof err), KV_EINVAL);
    q = p;
    q.sp.top_logprobs = 21;
    assert_int_equal(engine_submit(e, &q, on_event, &c, &id, err, sizeof err), KV_EINVAL);
    q = p;
    q.max_tokens = 0;
    assert_int_equal(engine_submit(e, &q, on_event, &c, &id, err, sizeof err), KV_EINVAL);
    assert_int_equal(c.n_term + c.n_deltas, 0); /* rejected requests never call back */

    /* a prompt of max_model_len - 1 fits and is capped at one generated token */
    p.n_prompt = 127;
    p.max_tokens = 50;
    p.sp.temperature = 0.0f;
    submit_ok(e, &p, &c);
    wait_done(&c, 1);
    assert_int_equal(c.fin, FINISH_LENGTH);
    assert_int_equal(c.completion_tokens, 1);
    wait_blocks_free(e);
    engine_stop(e);
    /* a pool that cannot hold one max_model_len sequence is a config error */
    cfg.n_blocks = 7;
    engine_t *e2 = NULL;
    assert_int_equal(engine_start(&cfg, &g_model, g_tok, &f.be, &e2, err, sizeof err), KV_EINVAL);
    fake_destroy(&f);
}

static void test_eos(void **st) {
    (void)st;
    struct req_spec r;
    make_specs(&r, 1, 10, 10, 40, 4);
    r.p.sp.temperature = 0.0f;
    struct fake f;
    fake_init(&f);
    f.eos_pos = 10 + 5 - 1; /* logits at this position make the 6th generated token EOS */
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 32, .max_batch_size = 8,
                                .max_num_tokens = 64, .max_model_len = 128, .max_queue = 8};
    engine_t *e = start(&f, &cfg);
    struct coll c, d;
    memset(&c, 0, sizeof c);
    memset(&d, 0, sizeof d);
    submit_ok(e, &r.p, &c);
    wait_done(&c, 1);
    r.p.ignore_eos = true;
    submit_ok(e, &r.p, &d);
    wait_done(&d, 1);
    wait_blocks_free(e);
    engine_stop(e);
    assert_int_equal(c.fin, FINISH_STOP);
    assert_int_equal(c.n_ids, 6);
    assert_int_equal(c.ids[5], EOS);
    assert_int_equal(c.completion_tokens, 6);
    assert_text_matches_decode(&c); /* EOS contributes no text */
    assert_int_equal(d.fin, FINISH_LENGTH);
    assert_int_equal(d.n_ids, 40);
    assert_memory_equal(d.ids, c.ids, 6 * sizeof c.ids[0]);
    fake_destroy(&f);
}

static void test_stop_strings(void **st) {
    (void)st;
    if (!g_tok) {
        fprintf(stderr, "SKIP: no tokenizer (stories260K.gguf missing or tok_load failed)\n");
        skip();
    }
    struct req_spec r;
    make_specs(&r, 1, 8, 8, 60, 8);
    r.p.sp.temperature = 0.0f;
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 32, .max_batch_size = 8,
                                .max_num_tokens = 64, .max_model_len = 128, .max_queue = 8};
    engine_t *e = start(&f, &cfg);
    struct coll full;
    memset(&full, 0, sizeof full);
    submit_ok(e, &r.p, &full);
    wait_done(&full, 1);
    assert_true(full.text_len > 40);
    /* stop strings: a 5-byte piece from the middle of the text, and one that never occurs */
    size_t at = full.text_len / 2, end;
    for (;; at++) { /* a NUL-free piece starting and ending on character boundaries */
        assert_true(at + 5 < full.text_len);
        if (kv_utf8_seq_len((unsigned char)full.text[at]) == 0) continue;
        end = at + 5;
        while (end < full.text_len && kv_utf8_seq_len((unsigned char)full.text[end]) == 0) end++;
        if (!memchr(full.text + at, 0, end - at)) break;
    }
    char stop[32];
    snprintf(stop, sizeof stop, "%.*s", (int)(end - at), full.text + at);
    const char *stops[] = {"\x01never\x02", stop};
    size_t want = (size_t)((const char *)memmem(full.text, full.text_len, stop, strlen(stop)) - full.text);
    r.p.stop = stops;
    r.p.n_stop = 2;
    struct coll c;
    memset(&c, 0, sizeof c);
    submit_ok(e, &r.p, &c);
    wait_done(&c, 1);
    wait_blocks_free(e);
    engine_stop(e);
    assert_int_equal(c.fin, FINISH_STOP);
    assert_int_equal(c.text_len, want);
    assert_memory_equal(c.text, full.text, want);
    assert_null(memmem(c.text, c.text_len, stop, strlen(stop)));
    assert_true(c.n_ids < full.n_ids);
    assert_memory_equal(c.ids, full.ids, (size_t)c.n_ids * sizeof c.ids[0]);
    fake_destroy(&f);
}

static void test_stop_engine_with_live_requests(void **st) {
    (void)st;
    enum { N = 5 };
    struct req_spec r[N];
    make_specs(r, N, 5, 50, 400, 31);
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 64, .max_batch_size = 2,
                                .max_num_tokens = 64, .max_model_len = 512, .max_queue = 8};
    engine_t *e = start(&f, &cfg);
    static struct coll c[N];
    memset(c, 0, sizeof c);
    for (int i = 0; i < N; i++) submit_ok(e, &r[i].p, &c[i]);
    engine_stop(e);
    int n_err = 0;
    for (int i = 0; i < N; i++) {
        assert_int_equal(c[i].n_term, 1);
        assert_int_equal(c[i].n_after_term, 0);
        if (c[i].term == ENGINE_EV_ERROR) {
            assert_int_equal(c[i].status, KV_ECANCELLED);
            n_err++;
        }
    }
    assert_true(n_err > 0);
    fake_destroy(&f);
}

/* Every allocation failure over whole request lifetimes (SQLite's N-th allocation sweep):
 * with the N-th kv_* allocation after the engine started failing, for N = 1, 2, ... until a
 * run no longer reaches it, three requests (logprobs, stop strings, a shared prefix for the
 * reuse index, a small pool for preemption) each end with exactly one terminal event or a
 * refused submit, nothing hangs, every block comes back, and the engine serves a normal
 * request afterwards. Leaks show up in the ASan build (make test-asan). */
static void test_alloc_failure_sweep(void **st) {
    (void)st;
    struct req_spec r[3];
    make_specs(r, 3, 40, 120, 12, 77);
    memcpy(r[1].prompt, r[0].prompt, 32 * sizeof(int32_t)); /* two full blocks shared */
    const char *stops[] = {"zz", "\n\n"};
    r[2].p.stop = stops;
    r[2].p.n_stop = 2;
    r[0].p.sp.logprobs = true;
    r[0].p.sp.top_logprobs = 3;
    long n = 1, last_calls = 0;
    for (; n < 100000; n++) {
        struct fake f;
        fake_init(&f);
        struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 24, .max_batch_size = 4,
                                    .max_num_tokens = 48, .max_model_len = 256, .max_queue = 8};
        engine_t *e = start(&f, &cfg);
        struct coll c[3];
        memset(c, 0, sizeof c);
        kv_alloc_fail_at(n);
        bool submitted[3];
        for (int i = 0; i < 3; i++) {
            char err[256] = "";
            submitted[i] = engine_submit(e, &r[i].p, on_event, &c[i], &c[i].id, err, sizeof err) == KV_OK;
        }
        for (int i = 0; i < 3; i++)
            if (submitted[i]) wait_done(&c[i], 1); /* a hang fails here */
        assert_int_equal(engine_wait_idle(e, 30000), KV_OK);
        last_calls = kv_alloc_calls();
        kv_alloc_fail_at(0);
        for (int i = 0; i < 3; i++) assert_int_equal(c[i].n_after_term, 0); /* one terminal */
        struct engine_stats s;
        engine_get_stats(e, &s);
        assert_int_equal(s.kv_blocks_used, 0);
        struct coll after;
        memset(&after, 0, sizeof after);
        submit_ok(e, &r[1].p, &after);
        wait_done(&after, 1);
        assert_int_equal(after.term, ENGINE_EV_FINISH);
        engine_stop(e);
        fake_destroy(&f);
        if (last_calls < n) break; /* the whole lifetime made fewer allocations: swept */
    }
    fprintf(stderr, "allocation failures swept: %ld points\n", n - 1);
    assert_true(n > 10);
}

/* worker ids are random and non-zero with and without the reuse index (with
 * --no-prefix-cache every worker used to report 0 and collided in routers); the default
 * prefix wait scales with max_model_len (a fixed 64 blocks never triggered at <= 1024). */
static void test_worker_id_and_wait_default(void **st) {
    (void)st;
    struct fake f1, f2;
    fake_init(&f1);
    fake_init(&f2);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 32, .max_batch_size = 8,
                                .max_num_tokens = 64, .max_model_len = 256, .max_queue = 8,
                                .no_prefix_cache = true};
    engine_t *a = start(&f1, &cfg);
    cfg.no_prefix_cache = false;
    engine_t *b = start(&f2, &cfg);
    assert_true(engine_worker_id(a) != 0);
    assert_true(engine_worker_id(b) != 0);
    assert_true(engine_worker_id(a) != engine_worker_id(b));
    engine_stop(a);
    engine_stop(b);
    fake_destroy(&f1);
    fake_destroy(&f2);
    struct { int len, T, want; } w[] = {{512, 16, 4}, {480, 16, 3}, {128, 16, 1}, {16, 16, 1},
                                        {8192, 16, 64}, {131072, 16, 64}, {4096, 64, 8}};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
        struct engine_config c = {.tokens_per_block = w[i].T, .max_model_len = w[i].len};
        assert_int_equal(engine_default_wait_blocks(&c), w[i].want);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batching_invariance),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_preemption),
        cmocka_unit_test(test_cancel_mid_prefill),
        cmocka_unit_test(test_queue_full),
        cmocka_unit_test(test_validation),
        cmocka_unit_test(test_eos),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_stop_engine_with_live_requests),
        cmocka_unit_test(test_worker_id_and_wait_default),
        cmocka_unit_test(test_alloc_failure_sweep),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
