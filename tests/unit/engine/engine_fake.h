/*
 * engine_fake.h: the FAKE backend and helpers shared by the engine tests (test_engine.c,
 * test_engine_choices.c). The fake stores the token id of each KV slot in its pool and
 * produces logits from a hash of the whole sequence read back through the block table, so
 * any block-table or KV bookkeeping mistake (a block freed while in use, a wrong n_past, a
 * missing chunk, a shared block written) changes the output. It also records every batch.
 * Text goes through the real stories260K tokenizer when it is available. Include once per
 * test binary, after cmocka.h.
 */
#ifndef KV_TEST_ENGINE_FAKE_H
#define KV_TEST_ENGINE_FAKE_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline kv_status fake_kv_alloc(backend_t *be, int n_blocks, const struct kv_geometry *g) {
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

static inline int32_t *slot(struct fake *f, const struct batch_seq *s, int pos) {
    return &f->kv[(size_t)s->block_table[pos / f->T] * (size_t)f->T + (size_t)(pos % f->T)];
}

static inline kv_status fake_forward(backend_t *be, const struct batch *b, float *logits, char *err,
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

static inline void fake_free(backend_t *be) { (void)be; }

static inline void fake_init(struct fake *f) {
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

static inline void fake_destroy(struct fake *f) {
    free(f->kv);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
}

static inline void fake_gate(struct fake *f, bool on) {
    pthread_mutex_lock(&f->mu);
    f->gated = on;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static inline void fake_wait_in_forward(struct fake *f) {
    pthread_mutex_lock(&f->mu);
    while (!f->in_forward) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

/* ---------------------------------------------------------------- model, tokenizer */

static model_t g_model;
static tokenizer_t *g_tok; /* NULL: tests run without text */

static inline int group_setup(void **st) {
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

static inline int group_teardown(void **st) {
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
    int index, term_seq;      /* choice index of the events; order of the terminal event */
    uint64_t t_admitted;
};
static int g_term_seq;        /* terminal events so far (under g_mu) */

static inline void on_event(const struct engine_event *ev, void *user) {
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
        c->index = ev->index;
        c->t_admitted = ev->t_admitted_ns;
        c->term_seq = ++g_term_seq;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static inline void wait_done(struct coll *c, int n) {
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

static inline void make_specs(struct req_spec *r, int n, int min_len, int max_len, int max_tokens,
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

static inline engine_t *start(struct fake *f, struct engine_config *cfg) {
    engine_t *e = NULL;
    char err[256] = "";
    kv_status st = engine_start(cfg, &g_model, g_tok, &f->be, &e, err, sizeof err);
    if (st) fail_msg("engine_start: %s", err);
    f->eng = e;
    return e;
}

static inline void submit_ok(engine_t *e, const struct engine_request_params *p, struct coll *c) {
    char err[256] = "";
    kv_status st = engine_submit(e, p, on_event, c, &c->id, err, sizeof err);
    if (st) fail_msg("engine_submit: %s (%s)", kv_status_str(st), err);
}

static inline void wait_blocks_free(engine_t *e) {
    struct engine_stats s;
    assert_int_equal(engine_wait_idle(e, 60000), KV_OK);
    engine_get_stats(e, &s);
    assert_int_equal(s.kv_blocks_used, 0);
    assert_int_equal(s.kv_blocks_free, s.kv_blocks_total);
}

/* Runs each spec alone (one at a time) into alone[]. */
static inline void run_alone(struct req_spec *r, int n, struct coll *alone) {
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

static inline void assert_same(const struct coll *a, const struct coll *b) {
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
static inline void assert_text_matches_decode(const struct coll *c) {
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


#endif
