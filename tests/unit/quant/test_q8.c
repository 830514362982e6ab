/* q8: the integer path (src/quant/q8.h). kv_q8_dot_rows on every ISA this CPU has (and the
 * AVX-512 kernels without VNNI) against the contract written out in kv_q8_dot_rows_ref,
 * bitwise: random rows of Q8_0/Q4_0/Q4_K/Q5_K/Q6_K (extreme scales included), M = 1..9, n_rows
 * 1..9, odd block counts, odd strides and alignments; the activation quantization gives the
 * same bytes on every ISA and follows q8.h's rule; a non-finite activation makes its outputs
 * NaN; the result is independent of M and of the row grouping; accuracy against the f32
 * product with the dequantized weights on the real rows of the tiny-quant files. The ISA runs
 * repeat in both software-prefetch modes (quant.h: cache, nta). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "model/gguf.h"
#include "quant/q8.h"
#include "test_util.h"
#include "quant_test_util.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return qt_xorshift(&g_rng); }
static uint32_t f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static bool same(float a, float b) { return f_bits(a) == f_bits(b) || (isnan(a) && isnan(b)); }

static const int k_types[] = {KV_QTYPE_Q8_0, KV_QTYPE_Q4_0, KV_QTYPE_Q4_K, KV_QTYPE_Q5_K, KV_QTYPE_Q6_K};


static void fill_rows(int type, uint8_t *w, size_t rb, int n_rows, int K, bool extreme) {
    size_t bb = kv_qtype_block_bytes(type);
    int blck = kv_qtype_block_elems(type);
    for (int r = 0; r < n_rows; r++) {
        uint8_t *row = w + (size_t)r * rb;
        for (size_t i = 0; i < rb; i++) row[i] = (uint8_t)rnd();
        for (int b = 0; b < K / blck; b++) {
            uint8_t *blk = row + (size_t)b * bb;
            uint16_t s1 = qt_scale(&g_rng, extreme);
            uint16_t s2 = qt_scale(&g_rng, extreme);
            switch (type) {
            case KV_QTYPE_Q8_0:
                qt_put16(blk, s1);
                if (extreme && rnd() % 4 == 0) memset(blk + 2, 0x80, 32); /* -128: the sign trick's edge */
                break;
            case KV_QTYPE_Q4_0: qt_put16(blk, s1); break;
            case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K:
                qt_put16(blk, s1);
                qt_put16(blk + 2, s2);
                if (extreme && rnd() % 4 == 0) memset(blk + 4, 0xff, 12);
                if (extreme && rnd() % 4 == 0) memset(blk + 16, 0xff, bb - 16); /* every quant at its max */
                break;
            case KV_QTYPE_Q6_K:
                qt_put16(blk + 208, s1);
                if (extreme && rnd() % 4 == 0)
                    for (int j = 0; j < 16; j++) blk[192 + j] = 0x80; /* scale -128 */
                if (extreme && rnd() % 4 == 0) memset(blk, 0, 192); /* every quant -32 */
                break;
            default: break;
            }
        }
    }
}

static void fill_x(float *X, size_t n, bool extreme) {
    for (size_t i = 0; i < n; i++) {
        float u = (float)(rnd() >> 40) * 0x1p-24f;
        X[i] = (rnd() & 1 ? -1.0f : 1.0f) * u * (rnd() % 8 == 0 ? 64.0f : 1.0f);
        if (rnd() % 64 == 0) X[i] = 0.0f;
        if (extreme && rnd() % 97 == 0) X[i] = (rnd() & 1) ? 3e38f : -1e-40f;
    }
}

/* quantizes with every ISA and checks the bytes agree; leaves the act quantized (generic) */
static void quantize_all(struct kv_q8_act *a, const float *X, size_t ldx) {
    size_t nb = kv_q8_act_bytes(a->M, a->K, a->group);
    void *ref = malloc(nb);
    assert_non_null(ref);
    for (int i = N_ISAS - 1; i >= 0; i--) {
        if (!use_isa(k_isas[i])) continue;
        memset(a->q, 0x55, nb);
        kv_q8_quantize(a, 0, a->M, X, ldx);
        if (k_isas[i] == KV_QUANT_ISA_GENERIC) continue;
        memcpy(ref, a->q, nb);
        use_isa(KV_QUANT_ISA_GENERIC);
        memset(a->q, 0x55, nb);
        kv_q8_quantize(a, 0, a->M, X, ldx);
        /* q and d and s32: the whole buffer except padding must agree */
        assert_memory_equal(a->q, ref, (size_t)a->M * a->K);
        for (int m = 0; m < a->M * (a->K / a->group); m++) assert_true(same(a->d[m], ((float *)((char *)ref + ((char *)a->d - (char *)a->q)))[m]));
        assert_memory_equal(a->s16, (char *)ref + ((char *)a->s16 - (char *)a->q), sizeof(int16_t) * (size_t)a->M * (a->K / 16));
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    free(ref);
}

/* the quantization rule of q8.h, checked on a's rows */
static void check_rule(const struct kv_q8_act *a, const float *X, size_t ldx) {
    for (int m = 0; m < a->M; m++)
        for (int g = 0; g < a->K / a->group; g++) {
            const float *x = X + (size_t)m * ldx + (size_t)g * a->group;
            const int8_t *q = a->q + (size_t)m * a->K + (size_t)g * a->group;
            float amax = 0.0f;
            bool bad = false;
            for (int i = 0; i < a->group; i++) {
                if (!isfinite(x[i])) bad = true;
                if (fabsf(x[i]) > amax) amax = fabsf(x[i]);
            }
            float d = a->d[(size_t)m * (a->K / a->group) + g];
            if (bad) {
                assert_true(isnan(d));
                for (int i = 0; i < a->group; i++) assert_int_equal(q[i], 0);
                continue;
            }
            assert_true(same(d, amax / 127.0f));
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < a->group; i++) {
                assert_true(q[i] >= -127 && q[i] <= 127);
                assert_int_equal(q[i], (int)nearbyintf(x[i] * id));
            }
        }
    for (int m = 0; m < a->M; m++)
        for (int j = 0; j < a->K / 16; j++) {
            int t = 0;
            for (int i = 0; i < 16; i++) t += a->q[(size_t)m * a->K + 16 * j + i];
            assert_int_equal(a->s16[(size_t)m * (a->K / 16) + j], t);
        }
}

/* every ISA (and AVX-512 without VNNI) against the reference; Y outside the results untouched */
static int compare_all(int type, const uint8_t *w, size_t rb, int n_rows, const struct kv_q8_act *a, size_t ldy) {
    const int M = a->M;
    size_t ny = ldy * (size_t)M + 8;
    float *ref = malloc(ny * sizeof(float)), *got = malloc(ny * sizeof(float));
    assert_non_null(ref);
    assert_non_null(got);
    for (size_t i = 0; i < ny; i++) ref[i] = -7.25f;
    kv_q8_dot_rows_ref(type, w, rb, n_rows, a, 0, M, ref, ldy);
    int n = 0;
    for (int i = 0; i < N_ISAS + 1; i++) {
        enum kv_quant_isa isa = k_isas[i < N_ISAS ? i : N_ISAS - 1];
        if (!use_isa(isa)) continue;
        kv_q8_set_limits(i == N_ISAS);
        for (int pf = 0; pf < 2; pf++) { /* both software-prefetch modes (quant.h) */
            kv_quant_set_prefetch(pf ? KV_PREFETCH_NTA : KV_PREFETCH_CACHE);
            for (size_t j = 0; j < ny; j++) got[j] = -7.25f;
            kv_q8_dot_rows(type, w, rb, n_rows, a, 0, M, got, ldy);
            for (size_t j = 0; j < ny; j++) {
                if (!same(got[j], ref[j]))
                    fail_msg("%s isa %s%s prefetch %s n_rows %d M %d K %d: Y[%zu] = %a, contract %a", kv_qtype_name(type),
                             kv_quant_isa_name(isa), i == N_ISAS ? " (no VNNI)" : "",
                             kv_quant_prefetch_name(kv_quant_get_prefetch()), n_rows, M, a->K, j, (double)got[j],
                             (double)ref[j]);
            }
            n++;
        }
    }
    /* the prefill path: repacked panel, every ISA and every limit (no AMX, no VNNI) */
    size_t pb = kv_q8_pack_bytes(type, n_rows, a->K);
    assert_true(pb > 0);
    void *panel = aligned_alloc(64, (pb + 63) & ~(size_t)63);
    assert_non_null(panel);
    /* every ISA's packing gives the same bytes (the generic one is the plain transcription) */
    void *panel2 = aligned_alloc(64, (pb + 63) & ~(size_t)63);
    assert_non_null(panel2);
    use_isa(KV_QUANT_ISA_GENERIC);
    memset(panel, 0xa5, pb);
    assert_int_equal(kv_q8_pack(type, w, rb, n_rows, a->K, panel), 0);
    for (int i = 1; i < N_ISAS; i++) {
        if (!use_isa(k_isas[i])) continue;
        memset(panel2, 0x5a, pb);
        assert_int_equal(kv_q8_pack(type, w, rb, n_rows, a->K, panel2), 0);
        assert_memory_equal(panel, panel2, pb);
    }
    free(panel2);
    for (int i = 0; i < N_ISAS; i++) {
        if (!use_isa(k_isas[i])) continue;
        for (int lim = 0; lim < 4; lim++) {
            if (k_isas[i] != KV_QUANT_ISA_AVX512 && lim) break;
            kv_q8_set_limits(lim);
            for (int pf = 0; pf < 2; pf++) {
                kv_quant_set_prefetch(pf ? KV_PREFETCH_NTA : KV_PREFETCH_CACHE);
                for (size_t j = 0; j < ny; j++) got[j] = -7.25f;
                kv_q8_dot_packed(type, panel, n_rows, a, 0, M, got, ldy);
                for (size_t j = 0; j < ny; j++)
                    if (!same(got[j], ref[j]))
                        fail_msg("%s packed isa %s limits %d prefetch %s n_rows %d M %d K %d: Y[%zu] = %a, contract %a",
                                 kv_qtype_name(type), kv_quant_isa_name(k_isas[i]), lim,
                                 kv_quant_prefetch_name(kv_quant_get_prefetch()), n_rows, M, a->K, j, (double)got[j],
                                 (double)ref[j]);
                n++;
            }
        }
    }
    free(panel);
    kv_q8_set_limits(0);
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    kv_quant_set_prefetch(KV_PREFETCH_AUTO);
    /* one row at a time and one activation row at a time: the same bits (batch invariance) */
    for (int m = 0; m < M; m++)
        for (int r = 0; r < n_rows; r++) {
            float y1;
            kv_q8_dot_rows(type, w + (size_t)r * rb, rb, 1, a, m, 1, &y1, 1);
            assert_true(same(y1, ref[(size_t)m * ldy + r]));
        }
    free(ref);
    free(got);
    return n;
}

static void check_type(int type) {
    static const int k_block[] = {32, 64, 96, 160, 768};
    static const int k_super[] = {256, 512, 768};
    const bool sup = kv_q8_group(type) == 256;
    const int *Ks = sup ? k_super : k_block;
    const int nK = sup ? 3 : 5;
    long runs = 0;
    for (int ki = 0; ki < nK; ki++) {
        int K = Ks[ki];
        static const int k_M[] = {1, 2, 3, 4, 5, 9, 16, 35}; /* 16, 35: AMX tiles of 16 rows + a tail */
        for (size_t mi = 0; mi < sizeof k_M / sizeof k_M[0]; mi++) {
            const int M = k_M[mi];
            struct kv_q8_act a;
            void *abuf = aligned_alloc(64, (kv_q8_act_bytes(M, K, kv_q8_group(type)) + 63) & ~(size_t)63);
            assert_non_null(abuf);
            assert_int_equal(kv_q8_act_init(&a, abuf, M, K, kv_q8_group(type)), 0);
            /* 65, 120, 137: decode's chunks of up to 4 row groups side by side (AVX-512: 3 + 2,
             * 4 + 4, 3 + 3 + 3 groups, the last one partial; AVX2: 4, 4 + 3, 3 + 3 + 3 groups,
             * a last group of 8 rows or fewer by itself) */
            static const int k_rows[] = {1, 2, 3, 5, 8, 9, 16, 17, 33, 65, 120, 137};
            for (size_t ri = 0; ri < sizeof k_rows / sizeof k_rows[0]; ri++) {
                const int n_rows = k_rows[ri];
                if (n_rows > 9 && M != 1 && M != 3 && M != 9 && M != 35) continue;
                bool extreme = (n_rows + M) % 2 == 0;
                size_t rb = kv_qtype_row_bytes(type, K) + (size_t)(rnd() % 3) * 3;
                size_t ldx = (size_t)K + rnd() % 5, ldy = (size_t)n_rows + rnd() % 3;
                uint8_t *wbuf = malloc(rb * (size_t)n_rows + 8);
                float *X = malloc(sizeof(float) * ldx * (size_t)M);
                assert_non_null(wbuf);
                assert_non_null(X);
                uint8_t *w = wbuf + rnd() % 8;
                fill_rows(type, w, rb, n_rows, K, extreme);
                fill_x(X, ldx * (size_t)M, extreme);
                quantize_all(&a, X, ldx);
                check_rule(&a, X, ldx);
                runs += compare_all(type, w, rb, n_rows, &a, ldy);
                free(wbuf);
                free(X);
            }
            free(abuf);
        }
    }
    assert_true(runs > 0);
}

static void test_random_q8_0(void **s) { (void)s; check_type(KV_QTYPE_Q8_0); }
static void test_random_q4_0(void **s) { (void)s; check_type(KV_QTYPE_Q4_0); }
static void test_random_q4_k(void **s) { (void)s; check_type(KV_QTYPE_Q4_K); }
static void test_random_q5_k(void **s) { (void)s; check_type(KV_QTYPE_Q5_K); }
static void test_random_q6_k(void **s) { (void)s; check_type(KV_QTYPE_Q6_K); }

/* A NaN or inf activation: every output of that row is NaN (on every ISA); others are finite. */
static void test_nonfinite(void **s) {
    (void)s;
    for (size_t t = 0; t < sizeof k_types / sizeof k_types[0]; t++) {
        int type = k_types[t], K = 512, M = 3, n_rows = 5;
        size_t rb = kv_qtype_row_bytes(type, K);
        uint8_t *w = malloc(rb * (size_t)n_rows);
        float *X = malloc(sizeof(float) * (size_t)(K * M)), Y[15];
        assert_non_null(w);
        assert_non_null(X);
        fill_rows(type, w, rb, n_rows, K, false);
        fill_x(X, (size_t)(K * M), false);
        X[K + 77] = NAN;
        X[2 * K + 300] = INFINITY;
        struct kv_q8_act a;
        void *abuf = aligned_alloc(64, (kv_q8_act_bytes(M, K, kv_q8_group(type)) + 63) & ~(size_t)63);
        assert_int_equal(kv_q8_act_init(&a, abuf, M, K, kv_q8_group(type)), 0);
        quantize_all(&a, X, (size_t)K);
        compare_all(type, w, rb, n_rows, &a, (size_t)n_rows);
        kv_q8_dot_rows(type, w, rb, n_rows, &a, 0, M, Y, (size_t)n_rows);
        for (int r = 0; r < n_rows; r++) {
            assert_true(isfinite(Y[r]));
            assert_true(isnan(Y[n_rows + r]));
            assert_true(isnan(Y[2 * n_rows + r]));
        }
        free(abuf);
        free(w);
        free(X);
    }
}

/* Invalid arguments write nothing; act init refuses bad shapes. */
static void test_invalid(void **s) {
    (void)s;
    struct kv_q8_act a;
    char buf[4096] __attribute__((aligned(64)));
    assert_int_equal(kv_q8_act_init(&a, buf, 1, 100, 32), -1);
    assert_int_equal(kv_q8_act_init(&a, buf, 0, 256, 256), -1);
    assert_int_equal(kv_q8_act_init(&a, buf, 1, 256, 64), -1);
    assert_int_equal(kv_q8_act_bytes(1, 96, 256), 0);
    assert_int_equal(kv_q8_group(KV_QTYPE_F16), 0);
    assert_int_equal(kv_q8_act_init(&a, buf, 1, 256, 32), 0);
    float X[256] = {1.0f}, Y[4] = {-1.0f, -1.0f, -1.0f, -1.0f};
    kv_q8_quantize(&a, 0, 1, X, 256);
    uint8_t w[1024] = {0};
    kv_q8_dot_rows(KV_QTYPE_F16, w, 512, 1, &a, 0, 1, Y, 1);      /* no integer path */
    kv_q8_dot_rows(KV_QTYPE_Q4_K, w, 144, 1, &a, 0, 1, Y, 1);     /* group mismatch */
    kv_q8_dot_rows(KV_QTYPE_Q8_0, w, 272, 0, &a, 0, 1, Y, 1);     /* no rows */
    kv_q8_dot_rows(KV_QTYPE_Q8_0, w, 272, 1, &a, 0, 2, Y, 1);     /* rows beyond a */
    for (int i = 0; i < 4; i++) assert_true(Y[i] == -1.0f);
    kv_q8_dot_rows(KV_QTYPE_Q8_0, w, 272, 1, &a, 0, 1, Y, 1);
    assert_true(Y[0] == 0.0f); /* zero weights */
}

/* The real rows of the tiny-quant files: the integer product stays close to the f32 product
 * with llama.cpp's dequantized weights (relative error of the output vector per file, for
 * activations shaped like a transformer's: roughly normal with a few outliers). */
static void check_file(void **state) {
    const char *name = *state;
    char rel[256], path[1024], err[512];
    snprintf(rel, sizeof rel, "models/tiny-quant/%s", name);
    if (!test_data_path(path, sizeof path, rel)) {
        fprintf(stderr, "SKIP: %s not found (KVSERVE_TEST_DATA)\n", rel);
        skip();
    }
    gguf_t *g = NULL;
    if (gguf_open(path, &g, err, sizeof err) != KV_OK) fail_msg("%s", err);
    int checked = 0;
    double worst[2] = {0};
    for (int i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        if (t->n_dims != 2 || !kv_q8_group((int)t->type)) continue;
        int K = (int)t->ne[0], N = (int)t->ne[1], type = (int)t->type;
        size_t rb = kv_qtype_row_bytes(type, K);
        const uint8_t *data = t->data;
        const int M = 2;
        float *X = malloc(sizeof(float) * (size_t)K * M), *row = malloc(sizeof(float) * (size_t)K);
        float *Y = malloc(sizeof(float) * (size_t)N * M);
        assert_non_null(X);
        assert_non_null(row);
        assert_non_null(Y);
        for (int k = 0; k < K * M; k++) {
            double u1 = ((double)(rnd() >> 11) + 1) * 0x1p-53, u2 = (double)(rnd() >> 11) * 0x1p-53;
            X[k] = (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2)) * (k >= K && rnd() % 50 == 0 ? 8.0f : 1.0f);
        }
        struct kv_q8_act a;
        void *abuf = aligned_alloc(64, (kv_q8_act_bytes(M, K, kv_q8_group(type)) + 63) & ~(size_t)63);
        assert_int_equal(kv_q8_act_init(&a, abuf, M, K, kv_q8_group(type)), 0);
        quantize_all(&a, X, (size_t)K);
        compare_all(type, data, rb, N < 9 ? N : 9, &a, (size_t)(N < 9 ? N : 9));
        kv_q8_dot_rows(type, data, rb, N, &a, 0, M, Y, (size_t)N);
        /* row 0: normal activations; row 1: 2% of them 8x larger (outliers widen the scale) */
        double num[2] = {0}, den[2] = {0};
        for (int n = 0; n < N; n++) {
            kv_dequant_row(type, data + (size_t)n * rb, row, K);
            for (int m = 0; m < M; m++) {
                double ref = 0;
                for (int k = 0; k < K; k++) ref += (double)X[(size_t)m * K + k] * row[k];
                double dlt = Y[(size_t)m * N + n] - ref;
                num[m] += dlt * dlt;
                den[m] += ref * ref;
            }
        }
        const double lim[2] = {1.5e-2, 4e-2};
        for (int m = 0; m < M; m++) {
            double rel = sqrt(num[m] / den[m]);
            if (rel > worst[m]) worst[m] = rel;
            if (rel >= lim[m]) fail_msg("%s %s: relative error %.3e (limit %.0e)", name, t->name, rel, lim[m]);
        }
        checked++;
        free(abuf);
        free(X);
        free(row);
        free(Y);
    }
    fprintf(stderr, "%s: %d matrices, worst relative error of the integer product %.2e (normal activations), %.2e (2%% outliers)\n",
            name, checked, worst[0], worst[1]);
    assert_true(checked > 0);
    gguf_close(g);
}

int main(void) {
    static const char *files[] = {"tiny-Q8_0.gguf", "tiny-Q4_0.gguf", "tiny-Q4_K_M.gguf", "tiny-Q5_K_M.gguf",
                                  "tiny-Q6_K.gguf"};
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invalid),
        cmocka_unit_test(test_random_q8_0),
        cmocka_unit_test(test_random_q4_0),
        cmocka_unit_test(test_random_q4_k),
        cmocka_unit_test(test_random_q5_k),
        cmocka_unit_test(test_random_q6_k),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test_prestate(check_file, (void *)files[0]),
        cmocka_unit_test_prestate(check_file, (void *)files[1]),
        cmocka_unit_test_prestate(check_file, (void *)files[2]),
        cmocka_unit_test_prestate(check_file, (void *)files[3]),
        cmocka_unit_test_prestate(check_file, (void *)files[4]),
    };
    fprintf(stderr, "prefill kernel of this CPU: %s (every other one available is also compared)\n", kv_q8_packed_name());
    return cmocka_run_group_tests(tests, NULL, NULL);
}
