/* qdot: kv_qdot_rows (src/quant/qdot.h) against a scalar transcription of the matmul contract
 * (kv_dequant_row_ref, then the 16-lane fmaf dot, tree and tail written out below), bitwise,
 * for every ISA this CPU has: random packed rows of every type (extreme finite scales
 * included), M = 1..9, n_rows 1..9, K multiples of the block (and odd K for F32/F16/BF16),
 * odd strides; the real rows of the tiny-quant files (each also against its llama.cpp
 * dequant-f32 twin through the F32 kernel); invalid arguments write nothing. The random rows
 * and the grouped layout run in both software-prefetch modes (quant.h: cache, nta). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "model/gguf.h"
#include "quant/qdot.h"
#include "test_util.h"
#include "quant_test_util.h"

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void) { return qt_xorshift(&g_rng); }
static uint32_t f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* The contract, scalar: Y[m*ldy + r] = dot(X[m*ldx ..], dequant_ref(row r)). */
static void ref_qdot(int type, const uint8_t *w, size_t rb, int n_rows, int K, const float *X, size_t ldx, int M,
                     float *Y, size_t ldy) {
    float *row = malloc(sizeof(float) * (size_t)(K + 1));
    assert_non_null(row);
    int K16 = K - K % 16;
    for (int r = 0; r < n_rows; r++) {
        if (K) kv_dequant_row_ref(type, w + (size_t)r * rb, row, K);
        for (int m = 0; m < M; m++) {
            const float *x = X + (size_t)m * ldx;
            float lane[16] = {0}, l8[8], l4[4], l2[2];
            for (int j = 0; j < 16; j++)
                for (int k = j; k < K16; k += 16) lane[j] = fmaf(x[k], row[k], lane[j]);
            for (int j = 0; j < 8; j++) l8[j] = lane[j] + lane[j + 8];
            for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
            for (int j = 0; j < 2; j++) l2[j] = l4[j] + l4[j + 2];
            float s = l2[0] + l2[1];
            for (int k = K16; k < K; k++) s = fmaf(x[k], row[k], s);
            Y[(size_t)m * ldy + r] = s;
        }
    }
    free(row);
}

/* bitwise, except that two NaNs are equal (payloads may differ, qdot.h) */
static bool same(float a, float b) { return f_bits(a) == f_bits(b) || (isnan(a) && isnan(b)); }

#define SENT 0x7f7f7f7fu /* FLT_MAX-ish sentinel: never a result here */

/* Runs kv_qdot_rows with every ISA and compares with ref_qdot; also checks that nothing of
 * Y outside the n_rows x M results changed. Returns the number of ISAs compared. */
static int compare_all(const char *what, int type, const uint8_t *w, size_t rb, int n_rows, int K, const float *X,
                       size_t ldx, int M, size_t ldy) {
    size_t ny = ldy * (size_t)M + 8;
    float *want = malloc(sizeof(float) * ny), *got = malloc(sizeof(float) * ny);
    assert_non_null(want);
    assert_non_null(got);
    ref_qdot(type, w, rb, n_rows, K, X, ldx, M, want, ldy);
    int n = 0;
    for (int ip = 0; ip < 2 * N_ISAS; ip++) { /* every ISA in both prefetch modes (quant.h) */
        const int ii = ip / 2;
        if (!use_isa(k_isas[ii])) continue;
        kv_quant_set_prefetch(ip % 2 ? KV_PREFETCH_NTA : KV_PREFETCH_CACHE);
        uint32_t s = SENT;
        for (size_t i = 0; i < ny; i++) memcpy(&got[i], &s, 4);
        kv_qdot_rows(type, w, rb, n_rows, K, X, ldx, M, got, ldy);
        for (int m = 0; m < M; m++)
            for (size_t r = 0; r < ldy; r++) {
                size_t i = (size_t)m * ldy + r;
                if ((int)r < n_rows) {
                    if (!same(got[i], want[i]))
                        fail_msg("%s %s %s (prefetch %s) K=%d M=%d n_rows=%d: Y[%d][%zu] = %a (0x%08x), reference %a (0x%08x)",
                                 what, kv_qtype_name(type), kv_quant_isa_name(k_isas[ii]),
                                 kv_quant_prefetch_name(kv_quant_get_prefetch()), K, M, n_rows, m, r, (double)got[i],
                                 f_bits(got[i]), (double)want[i], f_bits(want[i]));
                } else if (f_bits(got[i]) != SENT) {
                    fail_msg("%s %s %s: Y[%d][%zu] (past n_rows) written", what, kv_qtype_name(type),
                             kv_quant_isa_name(k_isas[ii]), m, r);
                }
            }
        for (size_t i = ldy * (size_t)M; i < ny; i++) assert_int_equal(f_bits(got[i]), SENT);
        n++;
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    kv_quant_set_prefetch(KV_PREFETCH_AUTO);
    free(want);
    free(got);
    return n;
}

/* finite f16 scales: zero, -0, subnormals, tiny and huge normals, max */

/* n_rows random rows of K elements, row stride rb; finite values (scales from qt_scales in
 * `extreme` mode, else moderate) */
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
            case KV_QTYPE_F32: blk[3] = (uint8_t)((blk[3] & 0x80) | (0x3a + rnd() % 8)); break; /* |x| ~ 1e-3..1e1 */
            case KV_QTYPE_F16: blk[1] = (uint8_t)((blk[1] & 0x83) | ((extreme ? rnd() % 31 : 8 + rnd() % 12) << 2)); break;
            case KV_QTYPE_BF16: blk[1] = (uint8_t)((blk[1] & 0x80) | (0x3a + rnd() % 8)); break;
            case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: qt_put16(blk, s1); break;
            case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K:
                qt_put16(blk, s1);
                qt_put16(blk + 2, s2);
                if (extreme && rnd() % 4 == 0) memset(blk + 4, 0xff, 12);
                break;
            case KV_QTYPE_Q6_K:
                qt_put16(blk + 208, s1);
                if (extreme && rnd() % 4 == 0)
                    for (int j = 0; j < 16; j++) blk[192 + j] = (uint8_t)(j % 2 ? 0x80 : 0x7f);
                break;
            default: break;
            }
        }
    }
}

static void fill_x(float *X, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float u = (float)(rnd() >> 40) * 0x1p-24f; /* [0, 1) */
        X[i] = (rnd() & 1 ? -1.0f : 1.0f) * u * (rnd() % 8 == 0 ? 64.0f : 1.0f);
        if (rnd() % 64 == 0) X[i] = 0.0f;
    }
}

static void check_type(int type) {
    static const int k_block[] = {32, 64, 96, 256, 768, 1024};
    static const int k_super[] = {256, 512, 768, 1024};
    static const int k_float[] = {0, 1, 15, 16, 17, 31, 40, 100, 256, 257, 768, 1024, 1037};
    const int *Ks;
    int nK;
    switch (kv_qtype_block_elems(type)) {
    case 256: Ks = k_super; nK = 4; break;
    case 32: Ks = k_block; nK = 6; break;
    default: Ks = k_float; nK = 13; break;
    }
    long runs = 0;
    for (int ki = 0; ki < nK; ki++) {
        int K = Ks[ki];
        for (int M = 1; M <= 9; M++) {
            if (M > 5 && M != 9) continue;
            for (int n_rows = 1; n_rows <= 9; n_rows++) {
                size_t rb = kv_qtype_row_bytes(type, K) + (size_t)(rnd() % 3) * 3; /* stride >= packed row */
                size_t ldx = (size_t)K + rnd() % 5, ldy = (size_t)n_rows + rnd() % 3;
                uint8_t *wbuf = malloc(rb * (size_t)n_rows + 8);
                float *xbuf = malloc(sizeof(float) * (ldx * (size_t)M + 4));
                assert_non_null(wbuf);
                assert_non_null(xbuf);
                uint8_t *w = wbuf + rnd() % 8; /* any alignment */
                float *X = xbuf + rnd() % 4;
                fill_rows(type, w, rb, n_rows, K, (n_rows + M) % 2 == 0);
                fill_x(X, ldx * (size_t)M);
                int n = compare_all("random", type, w, rb, n_rows, K, X, ldx, M, ldy);
                assert_true(n >= 1);
                runs += n;
                free(wbuf);
                free(xbuf);
            }
        }
    }
    assert_true(runs > 0);
}

/* The grouped layout (kv_fgroup_*, kv_qdot_grouped): for every ISA, bitwise the reference on
 * the packed rows, for whole matrices and for ranges starting at a group (the tasks of the
 * CPU matmul), with partial last groups; kv_fgroup_rows gives the packed rows' floats; Y past
 * the rows is untouched; layouts it does not exist for write nothing. */
static void check_grouped(int type) {
    static const int Ks[] = {16, 32, 64, 96, 768, 1024};
    static const int Ns[] = {1, 3, 7, 8, 9, 16, 17, 29};
    long runs = 0;
    for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++) {
        int K = Ks[ki];
        if (!kv_fgroup_ok(type, K)) {
            assert_true(type != KV_QTYPE_F32 && K % 32 != 0); /* F16/BF16 rows of 16 elements: 32 bytes */
            continue;
        }
        size_t RB = kv_qtype_row_bytes(type, K);
        for (size_t ni = 0; ni < sizeof Ns / sizeof Ns[0]; ni++) {
            int N = Ns[ni];
            size_t rb = RB + (size_t)(rnd() % 3) * 4;
            uint8_t *w = malloc(rb * (size_t)N), *g = malloc(RB * (size_t)N + 64);
            float *row = malloc(sizeof(float) * (size_t)K), *want_row = malloc(sizeof(float) * (size_t)K);
            assert_non_null(w), assert_non_null(g), assert_non_null(row), assert_non_null(want_row);
            fill_rows(type, w, rb, N, K, N % 2 == 1);
            memset(g, 0xa5, RB * (size_t)N + 64);
            kv_fgroup_pack(type, w, rb, N, K, g);
            for (size_t i = RB * (size_t)N; i < RB * (size_t)N + 64; i++) assert_int_equal(g[i], 0xa5);
            for (int r0 = 0; r0 < N; r0 += KV_FGROUP_ROWS) { /* the whole matrix, then each tail range */
                size_t ldo = (size_t)K + 3;
                float *rows = malloc(sizeof(float) * ldo * (size_t)(N - r0));
                assert_non_null(rows);
                for (size_t i = 0; i < ldo * (size_t)(N - r0); i++) rows[i] = -7.0f;
                kv_fgroup_rows(type, g + (size_t)r0 * RB, N - r0, K, rows, ldo);
                for (int r = r0; r < N; r++) {
                    kv_dequant_row_ref(type, w + (size_t)r * rb, want_row, K);
                    memcpy(row, rows + (size_t)(r - r0) * ldo, sizeof(float) * (size_t)K);
                    for (int k = 0; k < K; k++)
                        if (f_bits(row[k]) != f_bits(want_row[k]))
                            fail_msg("%s K=%d N=%d r0=%d: kv_fgroup_rows row %d [%d] = %a, packed %a", kv_qtype_name(type),
                                     K, N, r0, r, k, (double)row[k], (double)want_row[k]);
                    for (size_t k = (size_t)K; k < ldo; k++) assert_true(rows[(size_t)(r - r0) * ldo + k] == -7.0f);
                }
                free(rows);
            }
            for (int M = 1; M <= 5; M++) {
                for (int r0 = 0; r0 < N; r0 += KV_FGROUP_ROWS) { /* the whole matrix, then each tail range */
                    int n = N - r0;
                    size_t ldx = (size_t)K + rnd() % 3, ldy = (size_t)n + rnd() % 3, ny = ldy * (size_t)M;
                    float *X = malloc(sizeof(float) * ldx * (size_t)M), *want = malloc(sizeof(float) * ny),
                          *got = malloc(sizeof(float) * ny);
                    assert_non_null(X), assert_non_null(want), assert_non_null(got);
                    fill_x(X, ldx * (size_t)M);
                    ref_qdot(type, w + (size_t)r0 * rb, rb, n, K, X, ldx, M, want, ldy);
                    for (int ip = 0; ip < 2 * N_ISAS; ip++) { /* every ISA in both prefetch modes */
                        const int ii = ip / 2;
                        if (!use_isa(k_isas[ii])) continue;
                        kv_quant_set_prefetch(ip % 2 ? KV_PREFETCH_NTA : KV_PREFETCH_CACHE);
                        uint32_t sent = SENT;
                        for (size_t i = 0; i < ny; i++) memcpy(&got[i], &sent, 4);
                        kv_qdot_grouped(type, g + (size_t)r0 * RB, n, K, X, ldx, M, got, ldy);
                        for (int m = 0; m < M; m++)
                            for (size_t r = 0; r < ldy; r++) {
                                size_t i = (size_t)m * ldy + r;
                                if ((int)r >= n) {
                                    assert_int_equal(f_bits(got[i]), SENT);
                                } else if (!same(got[i], want[i])) {
                                    fail_msg("grouped %s %s (prefetch %s) K=%d N=%d r0=%d M=%d: Y[%d][%zu] = %a, "
                                             "reference %a", kv_qtype_name(type), kv_quant_isa_name(k_isas[ii]),
                                             kv_quant_prefetch_name(kv_quant_get_prefetch()), K, N, r0, M, m, r,
                                             (double)got[i], (double)want[i]);
                                }
                            }
                        runs++;
                    }
                    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
                    kv_quant_set_prefetch(KV_PREFETCH_AUTO);
                    free(X), free(want), free(got);
                }
            }
            free(w), free(g), free(row), free(want_row);
        }
    }
    assert_true(runs > 0);
    /* no grouped layout: block types, K = 0, rows of 32 bytes; nothing written */
    float y = 1.0f, x[64] = {0};
    uint8_t buf[256] = {0}, out[256];
    memset(out, 0x5a, sizeof out);
    assert_false(kv_fgroup_ok(KV_QTYPE_Q8_0, 64));
    assert_false(kv_fgroup_ok(type, 0));
    kv_fgroup_pack(KV_QTYPE_Q8_0, buf, 68, 2, 64, out);
    kv_fgroup_pack(type, buf, 64, 0, 32, out);
    for (size_t i = 0; i < sizeof out; i++) assert_int_equal(out[i], 0x5a);
    kv_qdot_grouped(type, buf, 1, 0, x, 64, 1, &y, 1);
    kv_qdot_grouped(type, buf, 0, 32, x, 64, 1, &y, 1);
    kv_qdot_grouped(type, buf, 1, 32, x, 64, 0, &y, 1);
    assert_true(y == 1.0f);
}

static void test_grouped_f32(void **s) { (void)s; check_grouped(KV_QTYPE_F32); }
static void test_grouped_f16(void **s) { (void)s; check_grouped(KV_QTYPE_F16); }
static void test_grouped_bf16(void **s) { (void)s; check_grouped(KV_QTYPE_BF16); }

static void test_random_f32(void **s) { (void)s; check_type(KV_QTYPE_F32); }
static void test_random_f16(void **s) { (void)s; check_type(KV_QTYPE_F16); }
static void test_random_bf16(void **s) { (void)s; check_type(KV_QTYPE_BF16); }
static void test_random_q8_0(void **s) { (void)s; check_type(KV_QTYPE_Q8_0); }
static void test_random_q4_0(void **s) { (void)s; check_type(KV_QTYPE_Q4_0); }
static void test_random_q4_k(void **s) { (void)s; check_type(KV_QTYPE_Q4_K); }
static void test_random_q5_k(void **s) { (void)s; check_type(KV_QTYPE_Q5_K); }
static void test_random_q6_k(void **s) { (void)s; check_type(KV_QTYPE_Q6_K); }

/* Invalid arguments write nothing, on every ISA. */
static void test_invalid_writes_nothing(void **s) {
    (void)s;
    uint8_t w[4096];
    for (size_t i = 0; i < sizeof w; i++) w[i] = (uint8_t)rnd();
    float X[1024], Y[64];
    fill_x(X, 1024);
    for (int ii = 0; ii < N_ISAS; ii++) {
        if (!use_isa(k_isas[ii])) continue;
        struct {
            int type, n_rows, K, M;
        } c[] = {{10, 1, 256, 1}, {99, 1, 32, 1}, {-1, 1, 32, 1}, {KV_QTYPE_Q8_0, 1, 31, 1}, {KV_QTYPE_Q4_K, 1, 255, 1},
                 {KV_QTYPE_Q6_K, 1, 300, 1}, {KV_QTYPE_Q4_0, 1, 48, 1}, {KV_QTYPE_F32, 1, -4, 1},
                 {KV_QTYPE_F16, 0, 16, 1}, {KV_QTYPE_F16, -1, 16, 1}, {KV_QTYPE_F16, 1, 16, 0}, {KV_QTYPE_BF16, 1, 16, -2}};
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
            memset(Y, 0x5a, sizeof Y);
            kv_qdot_rows(c[i].type, w, 512, c[i].n_rows, c[i].K, X, 64, c[i].M, Y, 4);
            for (size_t j = 0; j < sizeof Y; j++) assert_int_equal(((uint8_t *)Y)[j], 0x5a);
        }
        /* K = 0: every result is +0 */
        memset(Y, 0x5a, sizeof Y);
        kv_qdot_rows(KV_QTYPE_Q4_K, w, 0, 3, 0, X, 0, 2, Y, 3);
        for (int j = 0; j < 6; j++) assert_int_equal(f_bits(Y[j]), 0);
        assert_int_equal(((uint8_t *)Y)[24], 0x5a);
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
}

/* Real rows: up to 9 rows of every matrix of tiny-<tag>.gguf, M = 1..4, against the
 * reference; and the same rows of the llama.cpp dequant-f32 twin through the F32 kernel give
 * the same bits (a quantized model == its F32 dequantization). */
static void check_file(void **state) {
    const char *tag = *state;
    char rel[256], p1[1024], p2[1024], err[512];
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", tag);
    if (!test_data_path(p1, sizeof p1, rel)) {
        fprintf(stderr, "SKIP: %s not found (KVSERVE_TEST_DATA)\n", rel);
        skip();
    }
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.dequant-f32.gguf", tag);
    if (!test_data_path(p2, sizeof p2, rel)) {
        fprintf(stderr, "SKIP: %s not found (KVSERVE_TEST_DATA)\n", rel);
        skip();
    }
    gguf_t *g = NULL, *f = NULL;
    if (gguf_open(p1, &g, err, sizeof err) != KV_OK) fail_msg("%s", err);
    if (gguf_open(p2, &f, err, sizeof err) != KV_OK) fail_msg("%s", err);
    int mats = 0;
    for (int i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i), *ft = gguf_find_tensor(f, t->name);
        if (t->n_dims != 2 || !ft) continue;
        int type = (int)t->type, K = (int)t->ne[0];
        int n_rows = t->ne[1] < 9 ? (int)t->ne[1] : 9;
        size_t rb = kv_qtype_row_bytes(type, K);
        assert_true(rb > 0);
        float *X = malloc(sizeof(float) * (size_t)K * 4), *y1 = malloc(sizeof(float) * 36),
              *y2 = malloc(sizeof(float) * 36);
        assert_non_null(X);
        fill_x(X, (size_t)K * 4);
        for (int M = 1; M <= 4; M++) {
            assert_true(compare_all(t->name, type, t->data, rb, n_rows, K, X, (size_t)K, M, (size_t)n_rows) >= 1);
            for (int ii = 0; ii < N_ISAS; ii++) {
                if (!use_isa(k_isas[ii])) continue;
                kv_qdot_rows(type, t->data, rb, n_rows, K, X, (size_t)K, M, y1, (size_t)n_rows);
                kv_qdot_rows(KV_QTYPE_F32, ft->data, (size_t)K * 4, n_rows, K, X, (size_t)K, M, y2, (size_t)n_rows);
                for (int j = 0; j < M * n_rows; j++)
                    if (f_bits(y1[j]) != f_bits(y2[j]))
                        fail_msg("%s: %s (%s) %s: Y[%d] = %a, on the dequant-f32 twin %a", tag, t->name,
                                 kv_qtype_name(type), kv_quant_isa_name(k_isas[ii]), j, (double)y1[j], (double)y2[j]);
            }
            kv_quant_set_isa(KV_QUANT_ISA_AUTO);
        }
        free(X);
        free(y1);
        free(y2);
        mats++;
    }
    fprintf(stderr, "NOTE: tiny-%s: %d matrices checked\n", tag, mats);
    assert_true(mats > 0);
    gguf_close(g);
    gguf_close(f);
}

#define FILE_TEST(tag) {"file_" tag, check_file, NULL, NULL, (void *)tag}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invalid_writes_nothing),
        cmocka_unit_test(test_random_f32),
        cmocka_unit_test(test_grouped_f32),
        cmocka_unit_test(test_grouped_f16),
        cmocka_unit_test(test_grouped_bf16),
        cmocka_unit_test(test_random_f16),
        cmocka_unit_test(test_random_bf16),
        cmocka_unit_test(test_random_q8_0),
        cmocka_unit_test(test_random_q4_0),
        cmocka_unit_test(test_random_q4_k),
        cmocka_unit_test(test_random_q5_k),
        cmocka_unit_test(test_random_q6_k),
        FILE_TEST("F16"),
        FILE_TEST("BF16"),
        FILE_TEST("Q8_0"),
        FILE_TEST("Q4_0"),
        FILE_TEST("Q4_K_M"),
        FILE_TEST("Q5_K_M"),
        FILE_TEST("Q6_K"),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
