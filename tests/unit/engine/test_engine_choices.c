/*
 * Engine tests of n > 1 choices (fork.c), logit_bias, stop_token_ids, min_tokens (logits.c)
 * and priority scheduling (sched.c), against the FAKE backend of engine_fake.h (whose logits
 * hash the whole sequence read back through the block table: a shared block written by a
 * choice, or a wrong partial-block copy, changes every later token) and, for the bitwise
 * check with the real kernels and block copies, the CPU backend on stories260K.
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

#define NCH 4

static int g_copies; /* blocks copied by fake_copy_blocks (engine thread; read after) */

static kv_status fake_copy_blocks(backend_t *be, const int32_t *src, const int32_t *dst, int n) {
    struct fake *f = be->ctx;
    for (int i = 0; i < n; i++)
        memcpy(&f->kv[(size_t)dst[i] * (size_t)f->T], &f->kv[(size_t)src[i] * (size_t)f->T],
               (size_t)f->T * sizeof *f->kv);
    g_copies += n;
    return KV_OK;
}

/* Events of every choice of one request: user points at coll[0], choice i goes to coll[i]. */
static void on_choice_event(const struct engine_event *ev, void *user) {
    on_event(ev, (struct coll *)user + ev->index);
}

static struct engine_config small_cfg(int n_blocks, int max_batch) {
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = n_blocks, .max_batch_size = max_batch,
                                .max_num_tokens = 512, .max_model_len = n_blocks >= 32 ? 512 : n_blocks * 16,
                                .max_queue = 64};
    return cfg;
}

/* A sampled request with logprobs: prompt of n_prompt tokens, seed. */
static void sampled_spec(struct req_spec *r, int n_prompt, uint64_t seed, int max_tokens) {
    make_specs(r, 1, n_prompt, n_prompt, max_tokens, seed);
    struct sampling_params *sp = &r->p.sp;
    sp->temperature = 0.9f;
    sp->top_p = 0.95f;
    sp->presence_penalty = 0.3f;
    sp->logprobs = true;
    sp->top_logprobs = 3;
    sp->has_seed = true;
    sp->seed = seed;
}

/* Choice i of (n = NCH, seed s) equals the request alone with n = 1 and seed s + i, bitwise;
 * with block copies (partial last block) or without (the choice recomputes it), with the
 * prompt ending inside a block or on a block boundary, and in a pool small enough that the
 * choices preempt each other. */
static void check_choices(bool copies, int n_prompt, int n_blocks) {
    struct req_spec spec, alone_spec;
    sampled_spec(&spec, n_prompt, 500, 40);
    struct coll ch[NCH], alone[NCH];
    memset(ch, 0, sizeof ch);
    for (int i = 0; i < NCH; i++) {
        alone_spec = spec;
        alone_spec.p.prompt_ids = alone_spec.prompt;
        alone_spec.p.sp.seed = 500 + (uint64_t)i;
        run_alone(&alone_spec, 1, &alone[i]);
    }
    struct fake f;
    fake_init(&f);
    if (copies) f.ops.copy_blocks = fake_copy_blocks;
    g_copies = 0;
    struct engine_config cfg = small_cfg(n_blocks, 64);
    engine_t *e = start(&f, &cfg);
    spec.p.prompt_ids = spec.prompt;
    spec.p.n = NCH;
    char err[256] = "";
    uint64_t id = 0;
    assert_int_equal(engine_submit(e, &spec.p, on_choice_event, ch, &id, err, sizeof err), KV_OK);
    wait_done(ch, NCH);
    for (int i = 0; i < NCH; i++) {
        assert_int_equal(ch[i].term, ENGINE_EV_FINISH);
        assert_int_equal(ch[i].index, i);
        assert_same(&ch[i], &alone[i]);
    }
    int distinct = 0;
    for (int i = 1; i < NCH; i++)
        distinct += ch[i].n_ids != ch[0].n_ids || memcmp(ch[i].ids, ch[0].ids, sizeof(int32_t) * (size_t)ch[0].n_ids);
    assert_true(distinct > 0); /* the seeds differ, so do the choices */
    struct engine_stats s;
    engine_get_stats(e, &s);
    /* the prompt was prefilled once, unless a choice recomputed its partial block or the
     * pool forced preemptions (then each recompute is counted too) */
    if (n_blocks >= 64 && (copies || n_prompt % 16 == 0))
        assert_int_equal(s.prefill_tokens_computed, (uint64_t)n_prompt);
    if (n_blocks < 64) assert_true(s.preemptions_total > 0);
    if (copies && n_prompt % 16 && n_blocks >= 64) assert_int_equal(g_copies, NCH - 1);
    wait_blocks_free(e);
    engine_stop(e);
    assert_int_equal(f.n_bad, 0);
    fake_destroy(&f);
}

static void test_choices_equal_alone(void **st) {
    (void)st;
    check_choices(true, 21, 64);  /* partial last block copied */
    check_choices(false, 21, 64); /* partial last block recomputed by each choice */
    check_choices(true, 32, 64);  /* the prompt ends on a block boundary */
    check_choices(true, 21, 5);   /* 5 blocks: the 4 choices of 61 tokens preempt each other */
}

/* The CPU backend on stories260K: the same identity with the real kernels and block copies. */
static void test_choices_real_model(void **st) {
    (void)st;
    char mpath[4096], err[512];
    if (!test_data_path(mpath, sizeof mpath, "models/stories260K/stories260K.gguf")) {
        skip();
        return;
    }
    model_t *m = NULL;
    tokenizer_t *t = NULL;
    backend_t *be = NULL;
    assert_int_equal(model_load(mpath, &m, err, sizeof err), KV_OK);
    assert_int_equal(tok_load(mpath, &t, err, sizeof err), KV_OK);
    assert_int_equal(backend_cpu_new(m, 1, &be, err, sizeof err), KV_OK);
    struct engine_config cfg = small_cfg(64, 64);
    engine_t *e = NULL;
    assert_int_equal(engine_start(&cfg, m, t, be, &e, err, sizeof err), KV_OK);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tok_encode(t, "Once upon a time, there was a little dog", 40, true, false, &ids, &n), KV_OK);
    assert_true(n % 16 != 0);
    struct engine_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt_ids = ids;
    p.n_prompt = n;
    p.max_tokens = 24;
    sampling_params_default(&p.sp);
    p.sp.temperature = 1.0f;
    p.sp.logprobs = true;
    p.sp.top_logprobs = 3;
    p.sp.has_seed = true;
    p.sp.seed = 42;
    struct coll ch[3], alone[3];
    memset(ch, 0, sizeof ch);
    memset(alone, 0, sizeof alone);
    p.n = 3;
    assert_int_equal(engine_submit(e, &p, on_choice_event, ch, NULL, err, sizeof err), KV_OK);
    wait_done(ch, 3);
    p.n = 1;
    for (int i = 0; i < 3; i++) {
        p.sp.seed = 42 + (uint64_t)i;
        assert_int_equal(engine_submit(e, &p, on_event, &alone[i], NULL, err, sizeof err), KV_OK);
        wait_done(&alone[i], 1);
        assert_same(&ch[i], &alone[i]);
    }
    wait_blocks_free(e);
    engine_stop(e);
    free(ids);
    backend_free(be);
    tok_free(t);
    model_free(m);
}

/* Cancel before the fork (every choice still gets a terminal event) and after it. */
static void test_choices_cancel(void **st) {
    (void)st;
    for (int after = 0; after < 2; after++) {
        struct fake f;
        fake_init(&f);
        f.ops.copy_blocks = fake_copy_blocks;
        struct engine_config cfg = small_cfg(64, 64);
        cfg.max_num_tokens = 16; /* the 40-token prompt takes 3 steps: cancel in the first */
        engine_t *e = start(&f, &cfg);
        struct req_spec spec;
        sampled_spec(&spec, 40, 9, 300);
        spec.p.prompt_ids = spec.prompt;
        spec.p.n = 3;
        spec.p.ignore_eos = true;
        struct coll ch[3];
        memset(ch, 0, sizeof ch);
        char err[256];
        uint64_t id = 0;
        fake_gate(&f, true);
        assert_int_equal(engine_submit(e, &spec.p, on_choice_event, ch, &id, err, sizeof err), KV_OK);
        fake_wait_in_forward(&f); /* the first prefill chunk (before the fork) */
        if (after) {
            f.cancel_id = id;
            f.cancel_at_call = 6; /* three decode steps after the fork */
        } else {
            engine_cancel(e, id);
        }
        fake_gate(&f, false);
        wait_done(ch, 3);
        for (int i = 0; i < 3; i++) {
            assert_int_equal(ch[i].term, ENGINE_EV_FINISH);
            assert_int_equal(ch[i].fin, FINISH_CANCELLED);
            assert_int_equal(ch[i].index, i);
            assert_int_equal(ch[i].n_term, 1);
            if (after) assert_true(ch[i].n_ids >= 1);
            else assert_int_equal(ch[i].n_ids, 0);
        }
        wait_blocks_free(e);
        engine_stop(e);
        fake_destroy(&f);
    }
}

static void run_one(struct engine_request_params *p, struct coll *c) {
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = small_cfg(64, 64);
    engine_t *e = start(&f, &cfg);
    memset(c, 0, sizeof *c);
    submit_ok(e, p, c);
    wait_done(c, 1);
    wait_blocks_free(e);
    engine_stop(e);
    fake_destroy(&f);
}

static void greedy_spec(struct req_spec *r, int max_tokens) {
    make_specs(r, 1, 20, 20, max_tokens, 3);
    r->p.prompt_ids = r->prompt;
    r->p.sp.temperature = 0.0f;
    r->p.sp.logprobs = true;
}

static void test_logit_bias(void **st) {
    (void)st;
    struct req_spec r;
    struct coll base, c;
    greedy_spec(&r, 12);
    run_one(&r.p, &base);
    /* banning the greedy first token changes it */
    struct logit_bias ban = {base.ids[0], -100.0f};
    r.p.logit_bias = &ban;
    r.p.n_logit_bias = 1;
    run_one(&r.p, &c);
    assert_true(c.ids[0] != base.ids[0]);
    /* +100 on a token makes it win every step */
    struct logit_bias force[2] = {{77, 100.0f}, {base.ids[0], -3.0f}};
    r.p.logit_bias = force;
    r.p.n_logit_bias = 2;
    run_one(&r.p, &c);
    for (int i = 0; i < c.n_ids; i++) assert_int_equal(c.ids[i], 77);
    /* the reported logprob is the biased one: ~0 for the forced token */
    assert_true(c.lp[0].logprob > -1e-3f);
    /* ids outside the vocabulary and biases outside [-100, 100] are refused */
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = small_cfg(64, 64);
    engine_t *e = start(&f, &cfg);
    char err[256];
    struct logit_bias bad1 = {VOCAB, 1.0f}, bad2 = {5, 100.5f};
    r.p.logit_bias = &bad1;
    r.p.n_logit_bias = 1;
    assert_int_equal(engine_submit(e, &r.p, on_event, &c, NULL, err, sizeof err), KV_EINVAL);
    r.p.logit_bias = &bad2;
    assert_int_equal(engine_submit(e, &r.p, on_event, &c, NULL, err, sizeof err), KV_EINVAL);
    engine_stop(e);
    fake_destroy(&f);
}

static void test_stop_token_ids_min_tokens(void **st) {
    (void)st;
    struct req_spec r;
    struct coll base, c;
    greedy_spec(&r, 30);
    run_one(&r.p, &base);
    int32_t t = base.ids[6];
    int k = 0;
    while (base.ids[k] != t) k++;
    /* stop_token_ids: ends at the first t, which is part of the output */
    r.p.stop_token_ids = &t;
    r.p.n_stop_token_ids = 1;
    run_one(&r.p, &c);
    assert_int_equal(c.fin, FINISH_STOP);
    assert_int_equal(c.n_ids, k + 1);
    assert_memory_equal(c.ids, base.ids, sizeof(int32_t) * (size_t)(k + 1));
    /* also with ignore_eos */
    r.p.ignore_eos = true;
    run_one(&r.p, &c);
    assert_int_equal(c.n_ids, k + 1);
    r.p.ignore_eos = false;
    /* min_tokens: t cannot come (logit -inf) before min_tokens tokens */
    r.p.min_tokens = k + 3;
    run_one(&r.p, &c);
    assert_true(c.n_ids >= k + 3);
    for (int i = 0; i < k + 3; i++) assert_true(c.ids[i] != t);
    if (c.fin == FINISH_STOP) assert_int_equal(c.ids[c.n_ids - 1], t);
    else assert_int_equal(c.fin, FINISH_LENGTH);
    /* min_tokens holds EOS back too (the fake puts EOS on top at eos_pos) */
    r.p.stop_token_ids = NULL;
    r.p.n_stop_token_ids = 0;
    r.p.min_tokens = 0;
    struct fake f;
    fake_init(&f);
    f.eos_pos = r.p.n_prompt + 2 - 1; /* the 3rd generated token's logits */
    struct engine_config cfg = small_cfg(64, 64);
    engine_t *e = start(&f, &cfg);
    memset(&c, 0, sizeof c);
    submit_ok(e, &r.p, &c);
    wait_done(&c, 1);
    assert_int_equal(c.fin, FINISH_STOP);
    assert_int_equal(c.n_ids, 3);
    assert_int_equal(c.ids[2], EOS);
    r.p.min_tokens = 6;
    memset(&c, 0, sizeof c);
    submit_ok(e, &r.p, &c);
    wait_done(&c, 1);
    assert_true(c.n_ids >= 6);
    for (int i = 0; i < 6; i++) assert_true(c.ids[i] != EOS);
    /* min_tokens > max_tokens is refused */
    char err[256];
    r.p.min_tokens = r.p.max_tokens + 1;
    assert_int_equal(engine_submit(e, &r.p, on_event, &c, NULL, err, sizeof err), KV_EINVAL);
    engine_stop(e);
    fake_destroy(&f);
}

/* Stop strings do not end a choice before min_tokens (needs the tokenizer for text). */
static void test_min_tokens_stop_string(void **st) {
    (void)st;
    if (!g_tok) {
        skip();
        return;
    }
    struct req_spec r;
    struct coll base, c;
    greedy_spec(&r, 30);
    run_one(&r.p, &base);
    assert_true(base.text_len > 4);
    char stop[3] = {base.text[1], base.text[2], 0};
    const char *stops[1] = {stop};
    r.p.stop = stops;
    r.p.n_stop = 1;
    run_one(&r.p, &c);
    assert_int_equal(c.fin, FINISH_STOP);
    assert_true(c.text_len <= 1);
    r.p.min_tokens = 10;
    run_one(&r.p, &c);
    assert_true(c.n_ids >= 10);
    assert_true(c.text_len >= 3);
    assert_memory_equal(c.text, base.text, 3); /* the early stop string is kept */
}

/* Admission follows (priority, arrival): with one batch slot, requests queued behind a
 * running one finish in priority order. */
static void test_priority_admission(void **st) {
    (void)st;
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = small_cfg(64, 1);
    engine_t *e = start(&f, &cfg);
    struct req_spec r[5];
    make_specs(r, 5, 10, 20, 6, 11);
    static const int prio[5] = {0, 5, 0, -3, 0};
    struct coll c[5];
    memset(c, 0, sizeof c);
    fake_gate(&f, true);
    r[0].p.prompt_ids = r[0].prompt;
    submit_ok(e, &r[0].p, &c[0]);
    fake_wait_in_forward(&f);
    for (int i = 1; i < 5; i++) {
        r[i].p.prompt_ids = r[i].prompt;
        r[i].p.priority = prio[i];
        submit_ok(e, &r[i].p, &c[i]);
    }
    fake_gate(&f, false);
    wait_done(c, 5);
    /* order: 0 (running), 3 (-3), 2 and 4 (0, arrival order), 1 (5) */
    static const int order[5] = {0, 3, 2, 4, 1};
    for (int k = 1; k < 5; k++) assert_true(c[order[k - 1]].term_seq < c[order[k]].term_seq);
    for (int k = 1; k < 5; k++) assert_true(c[order[k - 1]].t_admitted <= c[order[k]].t_admitted);
    engine_stop(e);
    fake_destroy(&f);
}

/* Preemption takes the least urgent running request, not the newest: a (priority 1) is
 * admitted first, b (priority 0) after it; the pool cannot hold both, so a is preempted and
 * b finishes first (with equal priorities the newest, b, would be preempted). */
static void test_priority_preemption(void **st) {
    (void)st;
    for (int equal = 0; equal < 2; equal++) {
        struct fake f;
        fake_init(&f);
        struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 8, .max_batch_size = 4,
                                    .max_num_tokens = 512, .max_model_len = 128, .max_queue = 64};
        engine_t *e = start(&f, &cfg);
        struct req_spec r[2];
        make_specs(r, 2, 30, 30, 60, 21);
        struct coll c[2];
        memset(c, 0, sizeof c);
        for (int i = 0; i < 2; i++) {
            r[i].p.prompt_ids = r[i].prompt;
            r[i].p.ignore_eos = true;
            r[i].p.priority = equal ? 0 : 1 - i;
        }
        fake_gate(&f, true);
        submit_ok(e, &r[0].p, &c[0]);
        fake_wait_in_forward(&f);
        submit_ok(e, &r[1].p, &c[1]);
        fake_gate(&f, false);
        wait_done(c, 2);
        struct engine_stats s;
        engine_get_stats(e, &s);
        assert_true(s.preemptions_total > 0);
        if (equal) assert_true(c[0].term_seq < c[1].term_seq);
        else assert_true(c[1].term_seq < c[0].term_seq);
        assert_int_equal(c[0].completion_tokens, 60);
        assert_int_equal(c[1].completion_tokens, 60);
        wait_blocks_free(e);
        engine_stop(e);
        fake_destroy(&f);
    }
}

static kv_status fake_forward_sample(backend_t *be, const struct batch *b, const struct backend_sampling *sp,
                                     struct backend_sample_out *out, char *err, size_t errlen) {
    (void)be, (void)b, (void)sp, (void)out;
    return kv_errf(KV_EINTERNAL, err, errlen, "not called by this test");
}

/* A backend that samples on the device never sees host logits rows: n > 1, logit_bias and
 * min_tokens are refused at submit (KV_EUNSUPPORTED), unless the engine samples on the host. */
static void test_device_sampling_refuses(void **st) {
    (void)st;
    for (int host = 0; host < 2; host++) {
        struct fake f;
        fake_init(&f);
        f.ops.forward_sample = fake_forward_sample;
        struct engine_config cfg = small_cfg(64, 64);
        cfg.host_sampling = host;
        engine_t *e = start(&f, &cfg);
        struct req_spec r;
        greedy_spec(&r, 4);
        struct logit_bias lb = {5, 1.0f};
        char err[256];
        struct coll c[2];
        for (int k = 0; k < 3; k++) {
            struct engine_request_params p = r.p;
            if (k == 0) p.n = 2;
            if (k == 1) {
                p.logit_bias = &lb;
                p.n_logit_bias = 1;
            }
            if (k == 2) p.min_tokens = 2;
            memset(c, 0, sizeof c);
            kv_status s = engine_submit(e, &p, host ? on_choice_event : on_event, c, NULL, err, sizeof err);
            if (host) {
                assert_int_equal(s, KV_OK);
                wait_done(c, p.n > 1 ? 2 : 1);
            } else {
                assert_int_equal(s, KV_EUNSUPPORTED);
                assert_non_null(strstr(err, "--host-sampling"));
            }
        }
        engine_stop(e);
        fake_destroy(&f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choices_equal_alone),
        cmocka_unit_test(test_choices_real_model),
        cmocka_unit_test(test_choices_cancel),
        cmocka_unit_test(test_logit_bias),
        cmocka_unit_test(test_stop_token_ids_min_tokens),
        cmocka_unit_test(test_min_tokens_stop_string),
        cmocka_unit_test(test_priority_admission),
        cmocka_unit_test(test_priority_preemption),
        cmocka_unit_test(test_device_sampling_refuses),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
