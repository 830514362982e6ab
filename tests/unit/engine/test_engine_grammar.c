/*
 * Constrained decoding through the engine, as a property test: random JSON schemas and
 * regexes (tests/grammar_gen.h) plus json_object, choices and a GBNF grammar, sampled with
 * every sampling mode and many seeds on real small models (stories260K, the random-weight
 * tiny Q4_K_M model, the 32k-vocabulary llama-2-tiny-random). For every request:
 *   - each generated token is inside the grammar (replayed through an independent matcher)
 *     and every finite top logprob belongs to an allowed token;
 *   - an output that ends with "stop" parses and validates (tests/schema_check.h) or fully
 *     matches the regex (PCRE2); "length" only when max_tokens was reached;
 *   - the same request alone gives bitwise the same tokens as inside the batch, and as in an
 *     engine whose KV pool is so small that requests are preempted and recomputed;
 *   - with n > 1 every choice follows the grammar and equals the request alone with seed + i.
 */
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "engine/engine.h"
#include "grammar_gen.h"
#include "schema_check.h"
#include "test_util.h"

#define MAX_GEN 192
#define N_TOP 3

enum job_kind { J_SCHEMA = 0, J_REGEX, J_OBJECT, J_CHOICE, J_GBNF };

struct job {
    enum job_kind kind;
    json_t *schema;
    char re[1024];
    gram_t *g;
    struct sampling_params sp;
    /* results */
    char text[16384];
    size_t len;
    int32_t ids[MAX_GEN + 8];
    struct token_logprob lp[MAX_GEN + 8], top[(MAX_GEN + 8) * N_TOP];
    int n_ids, n_top;
    int n_term;
    enum engine_event_type term;
    enum finish_reason fin;
    char msg[400];             /* the error message */
    bool quiet;                /* an error is expected */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

static void on_event(const struct engine_event *ev, void *user) {
    struct job *j = user;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < ev->n_ids && j->n_ids < MAX_GEN + 8; i++) {
        if (ev->logprobs) j->lp[j->n_ids] = ev->logprobs[i];
        for (int k = 0; ev->top && k < ev->n_top && k < N_TOP; k++) j->top[j->n_ids * N_TOP + k] = ev->top[i * ev->n_top + k];
        j->n_top = ev->n_top < N_TOP ? ev->n_top : N_TOP;
        j->ids[j->n_ids++] = ev->ids[i];
    }
    if (j->len + ev->text_len < sizeof j->text) {
        memcpy(j->text + j->len, ev->text, ev->text_len);
        j->len += ev->text_len;
        j->text[j->len] = 0;
    }
    if (ev->type != ENGINE_EV_DELTA) {
        j->n_term++;
        j->term = ev->type;
        j->fin = ev->finish;
        if (ev->type == ENGINE_EV_ERROR) {
            snprintf(j->msg, sizeof j->msg, "%s", ev->message ? ev->message : "");
            if (!j->quiet) fprintf(stderr, "job error: %s\n", ev->message);
        }
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static void run_jobs(engine_t *e, struct job *jobs, int n, const int32_t *prompt, int n_prompt) {
    char err[256];
    for (int i = 0; i < n; i++) {
        struct job *j = &jobs[i];
        j->n_ids = j->n_term = 0;
        j->len = 0;
        j->text[0] = 0;
        struct engine_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt_ids = prompt;
        p.n_prompt = (size_t)n_prompt;
        p.max_tokens = MAX_GEN;
        p.sp = j->sp;
        p.grammar = j->g;
        uint64_t id;
        if (engine_submit(e, &p, on_event, j, &id, err, sizeof err) != KV_OK) fail_msg("submit: %s", err);
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 300;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < n; i++)
        while (!jobs[i].n_term)
            if (pthread_cond_timedwait(&g_cv, &g_mu, &ts)) {
                pthread_mutex_unlock(&g_mu);
                fail_msg("timeout");
            }
    pthread_mutex_unlock(&g_mu);
}

/* One request with n = n_ch choices; choice k's results go to ch[k] (ch[0]'s params). */
static void on_choice(const struct engine_event *ev, void *user) {
    struct job *ch = user;
    on_event(ev, &ch[ev->index]);
}

static void run_choices(engine_t *e, struct job *ch, int n_ch, const int32_t *prompt, int n_prompt) {
    char err[256];
    for (int k = 0; k < n_ch; k++) {
        ch[k].n_ids = ch[k].n_term = 0;
        ch[k].len = 0;
        ch[k].text[0] = 0;
    }
    struct engine_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt_ids = prompt;
    p.n_prompt = (size_t)n_prompt;
    p.max_tokens = MAX_GEN;
    p.sp = ch[0].sp;
    p.grammar = ch[0].g;
    p.n = n_ch;
    uint64_t id;
    if (engine_submit(e, &p, on_choice, ch, &id, err, sizeof err) != KV_OK) fail_msg("submit: %s", err);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 300;
    pthread_mutex_lock(&g_mu);
    for (int k = 0; k < n_ch; k++)
        while (!ch[k].n_term)
            if (pthread_cond_timedwait(&g_cv, &g_mu, &ts)) {
                pthread_mutex_unlock(&g_mu);
                fail_msg("timeout");
            }
    pthread_mutex_unlock(&g_mu);
}

static void make_jobs(struct job *jobs, int n, uint64_t seed) {
    struct rng r = {seed};
    for (int i = 0; i < n; i++) {
        struct job *j = &jobs[i];
        memset(j, 0, sizeof *j);
        char err[256];
        kv_status st;
        j->kind = i % 10 < 5 ? J_SCHEMA : i % 10 < 8 ? J_REGEX : i % 10 == 8 ? (i % 20 == 8 ? J_OBJECT : J_CHOICE) : J_GBNF;
        switch (j->kind) {
        case J_SCHEMA:
            j->schema = gen_schema(&r, 2);
            st = gram_compile_json_schema(j->schema, true, &j->g, err, sizeof err);
            break;
        case J_REGEX:
            gen_regex(&r, 4, j->re, sizeof j->re);
            st = gram_compile_regex(j->re, strlen(j->re), &j->g, err, sizeof err);
            break;
        case J_OBJECT:
            j->schema = json_pack("{s:s, s:{s:{s:s, s:i}}, s:b}", "type", "object", "properties", "a", "type",
                                  "string", "maxLength", 3, "additionalProperties", 0);
            st = gram_compile_json_object(&j->g, err, sizeof err);
            break;
        case J_CHOICE: {
            const char *ch[] = {"yes", "no", "maybe so", "\xc3\xa9t\xc3\xa9"};
            size_t len[] = {3, 2, 8, 5};
            snprintf(j->re, sizeof j->re, "yes|no|maybe so|\xc3\xa9t\xc3\xa9");
            st = gram_compile_choice(ch, len, 4, &j->g, err, sizeof err);
            break;
        }
        default: {
            const char *src = "root ::= item (\", \" item){0,3}\nitem ::= [a-z]{1,4} | [0-9]+ \"!\"?\n";
            snprintf(j->re, sizeof j->re, "([a-z]{1,4}|[0-9]+!?)(, ([a-z]{1,4}|[0-9]+!?)){0,3}");
            st = gram_compile_ebnf(src, strlen(src), &j->g, err, sizeof err);
            break;
        }
        }
        if (st) fail_msg("compile: %s", err);
        sampling_params_default(&j->sp);
        j->sp.has_seed = true;
        j->sp.seed = seed * 1000 + (uint64_t)i;
        j->sp.logprobs = true;
        j->sp.top_logprobs = N_TOP;
        switch (i % 7) {
        case 0: j->sp.temperature = 0.0f; break;
        case 1: j->sp.temperature = 1.0f; break;
        case 2: j->sp.temperature = 0.8f; j->sp.top_k = 40; break;
        case 3: j->sp.temperature = 1.2f; j->sp.top_p = 0.9f; break;
        case 4: j->sp.temperature = 1.0f; j->sp.min_p = 0.05f; break;
        case 5: j->sp.temperature = 0.9f; j->sp.presence_penalty = 0.7f; j->sp.frequency_penalty = 0.4f; break;
        default: j->sp.temperature = 0.7f; j->sp.repetition_penalty = 1.3f; break;
        }
    }
}

/* The checks of one finished job (see the file comment). Returns the number of "stop"s. */
static int check_job(struct job *j, const gram_vocab_t *v, int max_gen) {
    assert_int_equal(j->n_term, 1);
    assert_int_equal(j->term, ENGINE_EV_FINISH);
    gram_matcher_t *m = gram_matcher_new(j->g, v);
    for (int i = 0; i < j->n_ids; i++) {
        const uint64_t *mask = gram_matcher_mask(m, NULL);
        int32_t id = j->ids[i];
        assert_int_equal(j->lp[i].id, id);
        assert_true(j->lp[i].logprob <= 0.0f && isfinite(j->lp[i].logprob));
        for (int k = 0; k < j->n_top; k++) {
            struct token_logprob t = j->top[i * N_TOP + k];
            if (isfinite(t.logprob) && !((mask[t.id >> 6] >> (t.id & 63)) & 1))
                fail_msg("top logprob of token %d: id %d (%g) is outside the grammar", i, t.id, (double)t.logprob);
        }
        if (!gram_matcher_accept(m, id)) fail_msg("token %d (id %d) is outside the grammar; text '%s'", i, id, j->text);
    }
    bool complete = gram_matcher_is_complete(m);
    gram_matcher_free(m);
    if (j->fin == FINISH_LENGTH) {
        assert_int_equal(j->n_ids, max_gen);
        return 0;
    }
    assert_int_equal(j->fin, FINISH_STOP);
    assert_true(complete);
    char why[256];
    if (j->kind == J_SCHEMA || j->kind == J_OBJECT) {
        json_t *any = json_pack("{s:s}", "type", "object");
        bool ok = sc_check_text(j->kind == J_SCHEMA ? j->schema : any, j->text, j->len, why, sizeof why);
        json_decref(any);
        if (!ok) {
            char *s = json_dumps(j->schema, JSON_COMPACT);
            fail_msg("schema %s\noutput '%s'\ninvalid: %s", s, j->text, why);
        }
    } else if (sc_pcre_match(j->re, strlen(j->re), j->text, j->len, true) != 1) {
        for (size_t k = 0; k < j->len; k++) fprintf(stderr, "%02x ", (unsigned char)j->text[k]);
        fprintf(stderr, "\nids:");
        for (int k = 0; k < j->n_ids; k++) fprintf(stderr, " %d", j->ids[k]);
        fprintf(stderr, "\n");
        fail_msg("regex /%s/: output '%s' does not match", j->re, j->text);
    }
    return 1;
}

static void free_jobs(struct job *jobs, int n) {
    for (int i = 0; i < n; i++) {
        gram_unref(jobs[i].g);
        json_decref(jobs[i].schema);
    }
}

static void run_model(const char *rel, int n_jobs, uint64_t seed, bool preempt, int *ran) {
    char path[1024], err[512];
    if (!test_data_path(path, sizeof path, rel)) return;
    model_t *model = NULL;
    tokenizer_t *tok = NULL;
    backend_t *be = NULL;
    if (model_load(path, &model, err, sizeof err) || tok_load(path, &tok, err, sizeof err) ||
        backend_cpu_new(model, 1, &be, err, sizeof err))
        fail_msg("%s: %s", rel, err);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 1024, .max_batch_size = 16,
                                .max_num_tokens = 256, .max_model_len = 512, .max_queue = 256};
    engine_t *e = NULL;
    if (engine_start(&cfg, model, tok, be, &e, err, sizeof err)) fail_msg("engine: %s", err);
    int32_t *prompt = NULL;
    size_t n_prompt = 0;
    const char *ptxt = "Once upon a time, {\"answer\": ";
    assert_int_equal(tok_encode(tok, ptxt, strlen(ptxt), true, false, &prompt, &n_prompt), KV_OK);
    /* the test's own vocabulary: the same bytes and end tokens as the engine's */
    int nv = model->cfg.n_vocab;
    int32_t eog[16];
    int ne = 0;
    for (int i = 0; i < nv && ne < 16; i++)
        if (tok_is_eog(tok, i) || i == model->cfg.eos_id) eog[ne++] = i;
    gram_vocab_t *v = gram_vocab_new(tok, nv, eog, ne);
    struct job *jobs = calloc((size_t)n_jobs, sizeof *jobs);
    make_jobs(jobs, n_jobs, seed);
    run_jobs(e, jobs, n_jobs, prompt, (int)n_prompt); /* all at once: batched */
    int stops = 0;
    for (int i = 0; i < n_jobs; i++) stops += check_job(&jobs[i], v, MAX_GEN);
    fprintf(stderr, "%s: %d requests, %d ended complete (stop), %d at max_tokens\n", rel, n_jobs, stops, n_jobs - stops);
    assert_true(stops * 4 >= n_jobs * 3);
    /* alone == batched, bitwise */
    struct job *alone = calloc(1, sizeof *alone);
    for (int i = 0; i < 8 && i < n_jobs; i++) {
        *alone = jobs[i];
        run_jobs(e, alone, 1, prompt, (int)n_prompt);
        if (alone->n_ids != jobs[i].n_ids || memcmp(alone->ids, jobs[i].ids, (size_t)alone->n_ids * sizeof *alone->ids))
            fail_msg("job %d: alone '%s' != batched '%s'", i, alone->text, jobs[i].text);
    }
    free(alone);
    /* n > 1: each choice follows the grammar on its own and equals the request run alone with
     * n = 1 and seed + i (the engine's rule for choices) */
    if (preempt) {
        enum { NC = 3 };
        for (int i = 0; i < 6 && i < n_jobs; i++) {
            struct job *ch = calloc(NC, sizeof *ch);
            for (int k = 0; k < NC; k++) ch[k] = jobs[i];
            run_choices(e, ch, NC, prompt, (int)n_prompt);
            for (int k = 0; k < NC; k++) {
                check_job(&ch[k], v, MAX_GEN);
                struct job *one = calloc(1, sizeof *one);
                *one = jobs[i];
                one->sp.seed = jobs[i].sp.seed + (uint64_t)k;
                run_jobs(e, one, 1, prompt, (int)n_prompt);
                if (one->n_ids != ch[k].n_ids || memcmp(one->ids, ch[k].ids, (size_t)one->n_ids * sizeof *one->ids))
                    fail_msg("job %d choice %d: '%s' != alone with seed + %d: '%s'", i, k, ch[k].text, k, one->text);
                free(one);
            }
            free(ch);
        }
    }
    /* preempted and recomputed: the grammar state follows tokens, not the KV cache */
    if (preempt) {
        struct engine_config small = cfg;
        small.n_blocks = 33; /* one 512-token sequence (32 blocks) + 1: 16 requests cannot all fit
                                (the backend's KV pool is reallocated: e is not used after this) */
        engine_t *e2 = NULL;
        if (engine_start(&small, model, tok, be, &e2, err, sizeof err)) fail_msg("engine: %s", err);
        /* the 16 longest outputs */
        int n2 = n_jobs < 16 ? n_jobs : 16, pick[16];
        bool *used = calloc((size_t)n_jobs, sizeof *used);
        for (int k = 0; k < n2; k++) {
            int best = -1;
            for (int i = 0; i < n_jobs; i++)
                if (!used[i] && (best < 0 || jobs[i].n_ids > jobs[best].n_ids)) best = i;
            used[best] = true;
            pick[k] = best;
        }
        free(used);
        struct job *again = calloc((size_t)n2, sizeof *again);
        for (int k = 0; k < n2; k++) again[k] = jobs[pick[k]];
        run_jobs(e2, again, n2, prompt, (int)n_prompt);
        struct engine_stats st2;
        for (int w = 0; w < 1000; w++) { /* stats are published right after the last step */
            engine_get_stats(e2, &st2);
            if (st2.kv_blocks_used == 0) break;
            struct timespec d = {0, 1000000};
            nanosleep(&d, NULL);
        }
        for (int k = 0; k < n2; k++) {
            const struct job *j = &jobs[pick[k]];
            if (again[k].n_ids != j->n_ids || memcmp(again[k].ids, j->ids, (size_t)j->n_ids * sizeof *j->ids))
                fail_msg("job %d: preempted '%s' != batched '%s'", pick[k], again[k].text, j->text);
        }
        fprintf(stderr, "%s: %d requests again with %llu preemptions: identical\n", rel, n2,
                (unsigned long long)st2.preemptions_total);
        assert_true(st2.preemptions_total > 0);
        free(again);
        engine_stop(e2);
    }
    free_jobs(jobs, n_jobs);
    free(jobs);
    gram_vocab_free(v);
    free(prompt);
    engine_stop(e);
    backend_free(be);
    tok_free(tok);
    model_free(model);
    (*ran)++;
}

static void test_grammar_property_stories(void **st) {
    (void)st;
    int ran = 0;
    run_model("models/stories260K/stories260K.gguf", 120, 1, true, &ran);
    if (!ran) skip();
}

static void test_grammar_property_tiny_random(void **st) {
    (void)st;
    int ran = 0;
    run_model("models/tiny-quant/tiny-Q4_K_M.gguf", 60, 2, false, &ran);
    run_model("models/llama-2-tiny-random/llama-2-tiny-random.gguf", 60, 3, false, &ran);
    if (!ran) skip();
}

/* The per-mask work budget (tester finding F2): a request whose mask needs more than the
 * budget fails with a clear error (a 400 over HTTP), its n > 1 siblings too, and an
 * unconstrained request in the same batch is untouched (bitwise its output alone). The bound
 * is counted work, not time. */
static void test_grammar_budget(void **st) {
    (void)st;
    char path[1024], err[512];
    if (!test_data_path(path, sizeof path, "models/stories260K/stories260K.gguf")) skip();
    model_t *model = NULL;
    tokenizer_t *tok = NULL;
    backend_t *be = NULL;
    if (model_load(path, &model, err, sizeof err) || tok_load(path, &tok, err, sizeof err) ||
        backend_cpu_new(model, 1, &be, err, sizeof err))
        fail_msg("%s", err);
    struct engine_config cfg = {.tokens_per_block = 16, .n_blocks = 256, .max_batch_size = 8,
                                .max_num_tokens = 128, .max_model_len = 256, .max_queue = 16};
    engine_t *e = NULL;
    if (engine_start(&cfg, model, tok, be, &e, err, sizeof err)) fail_msg("engine: %s", err);
    int32_t *prompt = NULL;
    size_t n_prompt = 0;
    assert_int_equal(tok_encode(tok, "Once upon a time", 16, true, false, &prompt, &n_prompt), KV_OK);
    const char *re = "(.*.*.*)*x"; /* passes the compile-time bound; its masks are costly */
    gram_t *g = NULL;
    if (gram_compile_regex(re, strlen(re), &g, err, sizeof err)) fail_msg("%s", err);
    struct job *j = calloc(5, sizeof *j); /* 0: unconstrained alone; 1: the same batched; 2-4: hostile, n = 3 */
    for (int k = 0; k < 5; k++) sampling_params_default(&j[k].sp);
    j[0].sp.temperature = 0.8f;
    j[0].sp.seed = 5;
    j[0].sp.has_seed = true;
    j[1] = j[0];
    run_jobs(e, &j[0], 1, prompt, (int)n_prompt);
    assert_int_equal(j[0].term, ENGINE_EV_FINISH);
    struct gram_stats a, b;
    gram_get_stats(&a);
    gram_set_mask_budget(1000);
    for (int k = 2; k < 5; k++) {
        j[k].g = g;
        j[k].sp.temperature = 1.0f;
        j[k].sp.seed = 7;
        j[k].sp.has_seed = true;
        j[k].quiet = true;
    }
    /* the hostile request (n = 3) and the unconstrained one in one batch */
    char err2[256];
    struct engine_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt_ids = prompt;
    p.n_prompt = n_prompt;
    p.max_tokens = MAX_GEN;
    p.sp = j[2].sp;
    p.grammar = g;
    p.n = 3;
    uint64_t id;
    if (engine_submit(e, &p, on_choice, &j[2], &id, err2, sizeof err2) != KV_OK) fail_msg("submit: %s", err2);
    run_jobs(e, &j[1], 1, prompt, (int)n_prompt);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 60;
    pthread_mutex_lock(&g_mu);
    for (int k = 2; k < 5; k++)
        while (!j[k].n_term)
            if (pthread_cond_timedwait(&g_cv, &g_mu, &ts)) {
                pthread_mutex_unlock(&g_mu);
                fail_msg("timeout");
            }
    pthread_mutex_unlock(&g_mu);
    gram_set_mask_budget(0);
    gram_get_stats(&b);
    for (int k = 2; k < 5; k++) {
        assert_int_equal(j[k].term, ENGINE_EV_ERROR);
        assert_int_equal(j[k].n_ids, 0);
        if (!strstr(j[k].msg, "too complex") || !strstr(j[k].msg, "work units")) fail_msg("message '%s'", j[k].msg);
    }
    assert_true(b.over_budget - a.over_budget >= 3);
    assert_int_equal(j[1].term, ENGINE_EV_FINISH);
    if (j[1].n_ids != j[0].n_ids || memcmp(j[1].ids, j[0].ids, (size_t)j[0].n_ids * sizeof *j[0].ids))
        fail_msg("the unconstrained request changed next to the hostile one: '%s' != '%s'", j[1].text, j[0].text);
    /* the default budget: the same request runs */
    j[2].n_term = 0;
    j[2].n_ids = 0;
    run_jobs(e, &j[2], 1, prompt, (int)n_prompt);
    assert_int_equal(j[2].term, ENGINE_EV_FINISH);
    /* nothing leaked: every block is back once the engine is idle */
    assert_int_equal(engine_wait_idle(e, 10000), KV_OK);
    struct engine_stats es;
    engine_get_stats(e, &es);
    assert_int_equal(es.kv_blocks_used, 0);
    free(j);
    gram_unref(g);
    free(prompt);
    engine_stop(e);
    backend_free(be);
    tok_free(tok);
    model_free(model);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grammar_budget),
        cmocka_unit_test(test_grammar_property_stories),
        cmocka_unit_test(test_grammar_property_tiny_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
