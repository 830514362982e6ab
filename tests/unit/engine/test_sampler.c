/* Sampler tests: greedy, seeded reproducibility, top_k/top_p/min_p support, penalties,
 * logprobs. Pure functions, no model needed. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/sampler.h"

static struct sampler_scratch S;
static int setup(void **st) {
    (void)st;
    return sampler_scratch_init(&S, 4096);
}
static int teardown(void **st) {
    (void)st;
    sampler_scratch_free(&S);
    return 0;
}

static struct sampling_params sp_temp(float t) {
    struct sampling_params sp;
    sampling_params_default(&sp);
    sp.temperature = t;
    return sp;
}

/* logits[i] = log(p[i]) */
static void logits_from_probs(float *l, const double *p, int n) {
    for (int i = 0; i < n; i++) l[i] = (float)log(p[i]);
}

static void test_greedy_argmax(void **st) {
    (void)st;
    struct sampling_params sp = sp_temp(0.0f);
    kv_rng rng;
    kv_rng_seed(&rng, 1);
    float l[6] = {0.5f, 3.0f, -1.0f, 2.9f, 3.0f, 1.0f};
    assert_int_equal(sampler_pick(&sp, l, 6, &rng, &S), 1); /* tie 1 vs 4 -> lowest id */
    l[4] = 3.5f;
    assert_int_equal(sampler_pick(&sp, l, 6, &rng, &S), 4);
    /* greedy consumes no randomness */
    kv_rng a, b;
    kv_rng_seed(&a, 7);
    kv_rng_seed(&b, 7);
    sampler_pick(&sp, l, 6, &a, &S);
    assert_true(kv_rng_next(&a) == kv_rng_next(&b));
}

static void test_seeded_reproducible(void **st) {
    (void)st;
    enum { V = 512, N = 64 };
    float l[V];
    kv_rng g;
    kv_rng_seed(&g, 123);
    for (int i = 0; i < V; i++) l[i] = kv_rng_f32(&g) * 4.0f;
    struct sampling_params sp = sp_temp(1.0f);
    sp.top_p = 0.9f;
    int32_t a[N], b[N], c[N];
    kv_rng r1, r2, r3;
    kv_rng_seed(&r1, 42);
    kv_rng_seed(&r2, 42);
    kv_rng_seed(&r3, 43);
    for (int i = 0; i < N; i++) a[i] = sampler_pick(&sp, l, V, &r1, &S);
    for (int i = 0; i < N; i++) b[i] = sampler_pick(&sp, l, V, &r2, &S);
    for (int i = 0; i < N; i++) c[i] = sampler_pick(&sp, l, V, &r3, &S);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_not_equal(a, c, sizeof a);
}

/* Draws n samples and returns the histogram in hist[0..V). */
static void histogram(const struct sampling_params *sp, const float *l, int V, int n, int *hist) {
    kv_rng rng;
    kv_rng_seed(&rng, 99);
    memset(hist, 0, (size_t)V * sizeof *hist);
    for (int i = 0; i < n; i++) {
        int32_t id = sampler_pick(sp, l, V, &rng, &S);
        assert_true(id >= 0 && id < V);
        hist[id]++;
    }
}

static void test_distribution(void **st) {
    (void)st;
    const double p[4] = {0.5, 0.3, 0.15, 0.05};
    float l[4];
    logits_from_probs(l, p, 4);
    int h[4];
    struct sampling_params sp = sp_temp(1.0f);
    histogram(&sp, l, 4, 40000, h);
    for (int i = 0; i < 4; i++) assert_true(fabs(h[i] / 40000.0 - p[i]) < 0.01);
    /* temperature 2: p^(1/2) renormalised */
    sp.temperature = 2.0f;
    histogram(&sp, l, 4, 40000, h);
    double z = 0;
    for (int i = 0; i < 4; i++) z += sqrt(p[i]);
    for (int i = 0; i < 4; i++) assert_true(fabs(h[i] / 40000.0 - sqrt(p[i]) / z) < 0.01);
}

static void test_top_k_top_p_min_p_support(void **st) {
    (void)st;
    const double p[6] = {0.05, 0.4, 0.25, 0.15, 0.1, 0.05};
    float l[6];
    logits_from_probs(l, p, 6);
    int h[6];
    struct sampling_params sp = sp_temp(1.0f);
    sp.top_k = 3; /* {1, 2, 3} */
    histogram(&sp, l, 6, 20000, h);
    assert_int_equal(h[0] + h[4] + h[5], 0);
    assert_true(h[1] > 0 && h[2] > 0 && h[3] > 0);
    /* renormalised over the kept set */
    assert_true(fabs(h[1] / 20000.0 - 0.4 / 0.8) < 0.015);

    sampling_params_default(&sp);
    sp.top_p = 0.6f; /* 0.4 + 0.25 = 0.65 >= 0.6 -> {1, 2} */
    histogram(&sp, l, 6, 20000, h);
    assert_int_equal(h[0] + h[3] + h[4] + h[5], 0);
    assert_true(h[1] > 0 && h[2] > 0);
    sp.top_p = 0.3f; /* the top token alone */
    histogram(&sp, l, 6, 1000, h);
    assert_int_equal(h[1], 1000);

    sampling_params_default(&sp);
    sp.min_p = 0.3f; /* keep p >= 0.3 * 0.4 = 0.12 -> {1, 2, 3} */
    histogram(&sp, l, 6, 20000, h);
    assert_int_equal(h[0] + h[4] + h[5], 0);
    assert_true(h[1] > 0 && h[2] > 0 && h[3] > 0);

    /* top_k = -1 and 0 disable: every token appears */
    sampling_params_default(&sp);
    sp.top_k = -1;
    histogram(&sp, l, 6, 20000, h);
    for (int i = 0; i < 6; i++) assert_true(h[i] > 0);
}

static void test_penalties(void **st) {
    (void)st;
    struct sampling_params sp;
    sampling_params_default(&sp);
    sp.repetition_penalty = 2.0f;
    float l[6] = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f, -1.0f};
    const int32_t prompt[] = {0, 0, 3};
    const int32_t gen[] = {1, 3};
    sampler_apply_penalties(&sp, l, 6, prompt, 3, gen, 2, &S);
    /* positive divided, negative multiplied, each distinct token once */
    const float want1[6] = {1.0f, -4.0f, 1.0f, 0.25f, 3.0f, -1.0f};
    for (int i = 0; i < 6; i++) assert_float_equal(l[i], want1[i], 0.0f);

    sampling_params_default(&sp);
    sp.presence_penalty = 0.5f;
    sp.frequency_penalty = 0.25f;
    float m[6] = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f, -1.0f};
    const int32_t gen2[] = {2, 4, 2, 2};
    sampler_apply_penalties(&sp, m, 6, prompt, 3, gen2, 4, &S);
    /* generated only: prompt tokens 0 and 3 untouched */
    const float want2[6] = {2.0f, -2.0f, 1.0f - 3 * 0.25f - 0.5f, 0.5f, 3.0f - 0.25f - 0.5f, -1.0f};
    for (int i = 0; i < 6; i++) assert_float_equal(m[i], want2[i], 1e-6f);
    /* scratch left clean: applying to fresh logits again gives the same result */
    float m2[6] = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f, -1.0f};
    sampler_apply_penalties(&sp, m2, 6, prompt, 3, gen2, 4, &S);
    assert_memory_equal(m, m2, sizeof m);
    for (int i = 0; i < 4096; i++) assert_int_equal(S.count[i], 0);

    /* the penalty changes the greedy choice: 4 was the argmax, now 0 */
    sp.temperature = 0.0f;
    float n[6] = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f, -1.0f};
    kv_rng rng;
    kv_rng_seed(&rng, 0);
    sp.presence_penalty = 2.0f;
    sp.frequency_penalty = 0.0f;
    assert_int_equal(sampler_sample(&sp, n, 6, prompt, 3, gen2, 4, &rng, &S, NULL, NULL, 0), 0);
}

static void test_logprobs(void **st) {
    (void)st;
    enum { V = 16 };
    float l[V];
    kv_rng g;
    kv_rng_seed(&g, 5);
    for (int i = 0; i < V; i++) l[i] = kv_rng_f32(&g) * 10.0f - 5.0f;
    l[7] = l[3]; /* a tie */
    struct token_logprob top[V];
    double total = 0;
    for (int id = 0; id < V; id++) {
        float lp = sampler_logprob(l, V, id, top, V);
        total += exp((double)lp);
        assert_int_equal(top[0].id == id || top[0].logprob >= lp, 1);
    }
    assert_true(fabs(total - 1.0) < 1e-5);
    sampler_logprob(l, V, 0, top, V);
    double s2 = 0;
    for (int j = 0; j < V; j++) {
        s2 += exp((double)top[j].logprob);
        if (j) {
            assert_true(top[j - 1].logprob >= top[j].logprob);
            if (top[j - 1].logprob == top[j].logprob) assert_true(top[j - 1].id < top[j].id);
        }
        /* reference: log_softmax in double */
        double mx = -1e30, z = 0;
        for (int i = 0; i < V; i++) mx = l[i] > mx ? l[i] : mx;
        for (int i = 0; i < V; i++) z += exp(l[i] - mx);
        assert_true(fabs(top[j].logprob - (l[top[j].id] - mx - log(z))) < 1e-5);
    }
    assert_true(fabs(s2 - 1.0) < 1e-5);

    /* logprobs are pre-temperature: same with T = 0.3 and T = 0 */
    struct sampling_params sp = sp_temp(0.3f);
    kv_rng rng;
    kv_rng_seed(&rng, 1);
    struct token_logprob c1, c2, t1[3], t2[3];
    float la[V], lb[V];
    memcpy(la, l, sizeof l);
    memcpy(lb, l, sizeof l);
    int32_t id1 = sampler_sample(&sp, la, V, NULL, 0, NULL, 0, &rng, &S, &c1, t1, 3);
    sp.temperature = 0.0f;
    int32_t id2 = sampler_sample(&sp, lb, V, NULL, 0, NULL, 0, &rng, &S, &c2, t2, 3);
    assert_int_equal(c1.id, id1);
    assert_int_equal(c2.id, id2);
    assert_int_equal(id2, t2[0].id);
    assert_memory_equal(t1, t2, sizeof t1);
    assert_float_equal(c2.logprob, t2[0].logprob, 0.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_argmax),
        cmocka_unit_test(test_seeded_reproducible),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_top_k_top_p_min_p_support),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_logprobs),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
