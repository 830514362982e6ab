/*
 * Engine tests against a FAKE backend (defined here): the fake stores the token id of each
 * KV slot in its pool and produces logits from a hash of the whole sequence read back
 * through the block table, so any block-table or KV bookkeeping mistake (a block freed
 * while in use, a wrong n_past, a missing chunk) changes the output. It also records
 * every batch. Text goes through the real stories260K tokenizer when it is available.
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

#include "engine/engine.h"
#include "test_util.h"

#define VOCAB 512
#define EOS 2

/* ---------------------------------------------------------------- fake backend */

struct step_log {
    int n_tokens, n_past, logits;
};

struct fake {
    struct backend be;
    struct backend_ops ops;
    int T, n_blocks;
    int32_t *kv; /* (n_blocks * T) token id per slot, -1 = never written */
    int eos_pos; /* position whose logits put EOS on top (-1: EOS never likely) */
    /* records (engine thread writes; read after the requests finished) */
    int n_calls, max_step_tokens, max_step_seqs, n_mixed, n_bad;
    char bad[256];
    struct step_log log[512];
    int n_log;
    /* hooks */
    engine_t *eng;
    uint64_t cancel_id;
    int cancel_at_call;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool gated, in_forward;
};

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static kv_status fake_kv_alloc(backend_t *be, int n_blocks, const struct kv_geometry *g) {
    struct fake *f = be->ctx;
    free(f->kv);
    f->kv = malloc((size_t)n_blocks * (size_t)g->tokens_per_block * sizeof *f->kv);
    if (!f->kv) return KV_ENOMEM;
    for (int i = 0; i < n_blocks * g->tokens_per_block; i++) f->kv[i] = -1;
    f->T = g->tokens_per_block;
    f->n_blocks = n_blocks;
    be->geom = *g;
    be->n_blocks = n_blocks;
    return KV_OK;
}

static int32_t *slot(struct fake *f, const struct batch_seq *s, int pos) {
    return &f->kv[(size_t)s->block_table[pos / f->T] * (size_t)f->T + (size_t)(pos % f->T)];
}

static kv_status fake_forward(backend_t *be, const struct batch *b, float *logits, char *err,
                              size_t errlen) {
    struct fake *f = be->ctx;
    pthread_mutex_lock(&f->mu);
    f->in_forward = true;
    pthread_cond_broadcast(&f->cv);
    while (f->gated) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);

    f->n_calls++;
    int tot = 0, row = 0;
    bool has_chunk = false, has_decode = false;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct batch_seq *s = &b->seqs[i];
        tot += s->n_tokens;
        if (s->n_tokens > 1) has_chunk = true;
        else has_decode = true;
        if (s->n_tokens < 1 || s->n_blocks * f->T < s->n_past + s->n_tokens) {
            f->n_bad++;
            return kv_errf(KV_EINVAL, err, errlen, "block table too short");
        }
        for (int k = 0; k < s->n_blocks; k++)
            if (s->block_table[k] < 0 || s->block_table[k] >= f->n_blocks) {
                f->n_bad++;
                return kv_errf(KV_EINVAL, err, errlen, "block id out of range");
            }
        for (int k = 0; k < s->n_tokens; k++) *slot(f, s, s->n_past + k) = s->tokens[k];
        if (f->n_log < 512)
            f->log[f->n_log++] = (struct step_log){s->n_tokens, s->n_past, (int)s->logits};
        if (s->logits == BATCH_LOGITS_NONE) continue;
        int last = s->n_past + s->n_tokens - 1;
        uint64_t h = 1469598103934665603ULL;
        for (int p = 0; p <= last; p++) {
            int32_t t = *slot(f, s, p);
            if (t < 0) f->n_bad++;
            h = mix64(h ^ (uint64_t)(uint32_t)t ^ ((uint64_t)p << 32));
        }
        float *l = logits + (size_t)row++ * VOCAB;
        for (int v = 0; v < VOCAB; v++)
            l[v] = (float)(mix64(h + (uint64_t)v * 0x9e3779b97f4a7c15ULL) >> 40) / 16777216.0f * 8.0f;
        l[0] = l[1] = l[2] = -100.0f; /* no <unk>/<s>/</s> unless asked */
        if (last == f->eos_pos) l[EOS] = 100.0f;
    }
    if (tot > f->max_step_tokens) f->max_step_tokens = tot;
    if (b->n_seqs > f->max_step_seqs) f->max_step_seqs = b->n_seqs;
    if (has_chunk && has_decode) f->n_mixed++;
    if (f->cancel_at_call && f->n_calls == f->cancel_at_call) engine_cancel(f->eng, f->cancel_id);
    return KV_OK;
}

static void fake_free(backend_t *be) { (void)be; }

static void fake_init(struct fake *f) {
    memset(f, 0, sizeof *f);
    f->ops.name = "fake";
    f->ops.kv_alloc = fake_kv_alloc;
    f->ops.forward = fake_forward;
    f->ops.free = fake_free;
    f->be.ops = &f->ops;
    f->be.ctx = f;
    f->eos_pos = -1;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
}

static void fake_destroy(struct fake *f) {
    free(f->kv);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
}

static void fake_gate(struct fake *f, bool on) {
    pthread_mutex_lock(&f->mu);
    f->gated = on;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void fake_wait_in_forward(struct fake *f) {
    pthread_mutex_lock(&f->mu);
    while (!f->in_forward) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

/* ---------------------------------------------------------------- model, tokenizer */

static model_t g_model;
static tokenizer_t *g_tok; /* NULL: tests run without text */

static int group_setup(void **st) {
    (void)st;
    memset(&g_model, 0, sizeof g_model);
    g_model.cfg.n_vocab = VOCAB;
    g_model.cfg.n_layers = 1;
    g_model.cfg.n_heads = g_model.cfg.n_kv_heads = 1;
    g_model.cfg.head_dim = 4;
    g_model.cfg.dim = 4;
    g_model.cfg.bos_id = 1;
    g_model.cfg.eos_id = EOS;
    g_model.cfg.max_ctx = 512;
    char path[4096], err[256];
    if (test_data_path(path, sizeof path, "models/stories260K/stories260K.gguf")) {
        if (tok_load(path, &g_tok, err, sizeof err) != KV_OK) {
            fprintf(stderr, "NOTE: tok_load failed (%s); engine tests run without text\n", err);
            g_tok = NULL;
        }
    }
    return 0;
}

static int group_teardown(void **st) {
    (void)st;
    if (g_tok) tok_free(g_tok);
    return 0;
}

/* ---------------------------------------------------------------- event collector */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

struct coll {
    uint64_t id;
    int32_t ids[600];
    struct token_logprob lp[600];
    struct token_logprob top[600 * 3];
    int n_ids, n_deltas, n_term, n_after_term, completion_tokens, n_top;
    char text[8192];
    size_t text_len;
    enum engine_event_type term;
    enum finish_reason fin;
    kv_status status;
};

static void on_event(const struct engine_event *ev, void *user) {
    struct coll *c = user;
    pthread_mutex_lock(&g_mu);
    if (c->n_term) c->n_after_term++;
    if (ev->type == ENGINE_EV_DELTA || ev->text_len) {
        for (int i = 0; i < ev->n_ids && c->n_ids < 600; i++) {
            if (ev->logprobs) c->lp[c->n_ids] = ev->logprobs[i];
            for (int j = 0; j < ev->n_top && j < 3; j++) c->top[c->n_ids * 3 + j] = ev->top[i * ev->n_top + j];
            c->ids[c->n_ids++] = ev->ids[i];
        }
        c->n_top = ev->n_top;
        if (c->text_len + ev->text_len < sizeof c->text) {
            memcpy(c->text + c->text_len, ev->text, ev->text_len);
            c->text_len += ev->text_len;
            c->text[c->text_len] = 0;
        }
    }
    if (ev->type == ENGINE_EV_DELTA) c->n_deltas++;
    else {
        c->n_term++;
        c->term = ev->type;
        c->fin = ev->finish;
        c->status = ev->status;
        c->completion_tokens = ev->completion_tokens;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static void wait_done(struct coll *c, int n) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 30;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < n; i++)
        while (c[i].n_term == 0)
            if (pthread_cond_timedwait(&g_cv, &g_mu, &ts) != 0) {
                pthread_mutex_unlock(&g_mu);
                fail_msg("timed out waiting for request %d's terminal event", i);
            }
    pthread_mutex_unlock(&g_mu);
}

/* ---------------------------------------------------------------- helpers */

struct req_spec {
    int32_t prompt[300];
    int n_prompt;
    struct engine_request_params p;
};

static void make_specs(struct req_spec *r, int n, int min_len, int max_len, int max_tokens,
                       uint64_t seed) {
    kv_rng g;
    kv_rng_seed(&g, seed);
    for (int i = 0; i < n; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].n_prompt = min_len + (int)(kv_rng_next(&g) % (uint64_t)(max_len - min_len + 1));
        r[i].prompt[0] = 1;
        for (int k = 1; k < r[i].n_prompt; k++) r[i].prompt[k] = 3 + (int32_t)(kv_rng_next(&g) % (VOCAB - 3));
        struct engine_request_params *p = &r[i].p;
        p->prompt_ids = r[i].prompt;
        p->n_prompt = (size_t)r[i].n_prompt;
        p->max_tokens = max_tokens > 0 ? max_tokens : 5 + (int)(kv_rng_next(&g) % 30);
        sampling_params_default(&p->sp);
        switch (i % 3) {
        case 0: p->sp.temperature = 0.0f; break;
        case 1:
            p->sp.temperature = 0.8f;
            p->sp.top_k = 50;
            p->sp.has_seed = true;
            p->sp.seed = 1000 + (uint64_t)i;
            break;
        default:
            p->sp.temperature = 1.2f;
            p->sp.top_p = 0.9f;
            p->sp.min_p = 0.05f;
            p->sp.presence_penalty = 0.5f;
            p->sp.repetition_penalty = 1.3f;
            p->sp.logprobs = true;
            p->sp.top_logprobs = 3;
            p->sp.has_seed = true;
            p->sp.seed = 77 + (uint64_t)i;
            break;
        }
    }
}

static engine_t *start(struct fake *f, struct engine_config *cfg) {
    engine_t *e = NULL;
    char err[256] = "";
    kv_status st = engine_start(cfg, &g_model, g_tok, &f->be, &e, err, sizeof err);
    if (st) fail_msg("engine_start: %s", err);
    f->eng = e;
    return e;
}

static void submit_ok(engine_t *e, const struct engine_request_params *p, struct coll *c) {
    char err[256] = "";
    kv_status st = engine_submit(e, p, on_event, c, &c->id, err, sizeof err);
    if (st) fail_msg("engine_submit: %s (%s)", kv_status_str(st), err);
}

static void wait_blocks_free(engine_t *e) {
    struct engine_stats s;
    assert_int_equal(engine_wait_idle(e, 60000), KV_OK);
    engine_get_stats(e, &s);
    assert_int_equal(s.kv_blocks_used, 0);
    assert_int_equal(s.kv_blocks_free, s.kv_blocks_total);
}

/* Runs each spec alone (one at a time) into alone[]. */
static void run_alone(struct req_spec *r, int n, struct coll *alone) {
    struct fake f;
    fake_init(&f);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 64, .max_batch_size = 64,
                                .max_num_tokens = 512, .max_model_len = 512, .max_queue = 64};
    engine_t *e = start(&f, &cfg);
    for (int i = 0; i < n; i++) {
        memset(&alone[i], 0, sizeof alone[i]);
        submit_ok(e, &r[i].p, &alone[i]);
        wait_done(&alone[i], 1);
        assert_int_equal(alone[i].term, ENGINE_EV_FINISH);
    }
    wait_blocks_free(e);
    engine_stop(e);
    assert_int_equal(f.n_bad, 0);
    fake_destroy(&f);
}

static void assert_same(const struct coll *a, const struct coll *b) {
    assert_int_equal(a->n_ids, b->n_ids);
    assert_memory_equal(a->ids, b->ids, (size_t)a->n_ids * sizeof a->ids[0]);
    assert_int_equal(a->fin, b->fin);
    assert_int_equal(a->completion_tokens, b->completion_tokens);
    assert_int_equal(a->text_len, b->text_len);
    assert_memory_equal(a->text, b->text, a->text_len);
    assert_memory_equal(a->lp, b->lp, (size_t)a->n_ids * sizeof a->lp[0]);
    assert_memory_equal(a->top, b->top, (size_t)a->n_ids * 3 * sizeof a->top[0]);
    assert_int_equal(a->n_term, 1);
    assert_int_equal(a->n_after_term, 0);
}

/* The streamed text equals the one-shot decode of the generated ids as a continuation of
 * a prompt (tokenizer.h: the server keeps the leading space of the first SPM piece, like
 * llama.cpp): decode([x] + ids) == decode([x]) + streamed text, for a plain token x. */
static void assert_text_matches_decode(const struct coll *c) {
    if (!g_tok) return;
    int x = tok_find(g_tok, "a");
    assert_true(x >= 0);
    int n_ids = c->n_ids;
    if (n_ids && c->ids[n_ids - 1] == EOS && c->fin == FINISH_STOP) n_ids--;
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)(n_ids + 1));
    seq[0] = x;
    memcpy(seq + 1, c->ids, sizeof(int32_t) * (size_t)n_ids);
    char *full = NULL, *pre = NULL;
    size_t nf = 0, np = 0;
    assert_int_equal(tok_decode(g_tok, seq, (size_t)n_ids + 1, true, &full, &nf), KV_OK);
    assert_int_equal(tok_decode(g_tok, seq, 1, true, &pre, &np), KV_OK);
    assert_true(nf >= np);
    assert_memory_equal(full, pre, np);
    assert_int_equal(nf - np, c->text_len);
    assert_memory_equal(full + np, c->text, c->text_len);
    free(full);
    free(pre);
    free(seq);
}

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
