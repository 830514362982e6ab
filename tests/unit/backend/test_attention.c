/*
 * CPU attention kernel (src/backend/cpu/attention.h): every kernel family the CPU has (AVX-512,
 * AVX2) gives bitwise the output of the generic one (the contract in scalar C), for head
 * sizes with and without a head_dim % 16 tail, GQA groups, prefill tiles of several rows,
 * position counts around the vector kernels' 16- and 8-position score chunks and the block
 * size, f32 / f16 / bf16 KV elements and a block table that is not in order; and the
 * generic output is within 1e-5 of a double-precision softmax-attention. kv_store_row to f16
 * gives kv_f32_to_f16's bits on every family.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/attention.h"
#include "backend/cpu/matmul.h"

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float frand(void) { /* xorshift64, uniform in [-1, 1) */
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

#define TPB 16

/* Element e of a stored K/V row, widened. */
static float stored(const char *row, int e, int dt) {
    float f;
    if (dt == KV_DTYPE_F32) {
        memcpy(&f, row + 4 * (size_t)e, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)e, 2);
    return dt == KV_DTYPE_F16 ? kv_f16_to_f32(h) : kv_bf16_to_f32(h);
}

/* One case: returns the generic output in ref (n_rows * n_group * hd) and checks the other
 * families against it. */
static void run_case(int hd, int G, int R, int n_pos, int dt) {
    int n_last = n_pos + R - 1, n_blocks = (n_last + TPB - 1) / TPB + 2;
    size_t esz = kv_dtype_size(dt), run = (size_t)TPB * hd * esz, bb = 2 * run;
    char *pool = calloc((size_t)n_blocks, bb);
    int32_t *bt = malloc(sizeof(int32_t) * (size_t)n_blocks);
    for (int b = 0; b < n_blocks; b++) bt[b] = n_blocks - 1 - b; /* not in order */
    float row[320];
    for (int p = 0; p < n_last; p++)
        for (int kv = 0; kv < 2; kv++) {
            for (int e = 0; e < hd; e++) row[e] = frand() * 2.0f;
            kv_store_row(pool + (size_t)bt[p / TPB] * bb + kv * run + (size_t)(p % TPB) * hd * esz, row, hd, dt);
        }
    size_t qs = (size_t)G * hd;
    float *q = malloc(sizeof(float) * qs * R), *ref = malloc(sizeof(float) * qs * R), *out = malloc(sizeof(float) * qs * R);
    for (size_t i = 0; i < qs * R; i++) q[i] = frand();
    float *scores = malloc(sizeof(float) * (size_t)R * G * (size_t)(n_pos + R - 1));
    struct kv_attn_args a = {.q = q, .n_group = G, .head_dim = hd, .n_rows = R, .q_stride = qs, .out_stride = qs,
                             .n_pos = n_pos, .block_table = bt, .tpb = TPB, .pool = pool, .block_bytes = bb,
                             .k_off = 0, .v_off = run, .kv_dtype = dt, .scale = 1.0f / sqrtf((float)hd),
                             .scores = scores, .out = ref};
    assert_int_equal(kv_matmul_set_isa(KV_MATMUL_ISA_GENERIC), KV_MATMUL_ISA_GENERIC);
    kv_attention(&a);
    /* the generic output against double precision */
    for (int j = 0; j < R; j++)
        for (int g = 0; g < G; g++) {
            int np = n_pos + j;
            double *s = malloc(sizeof(double) * (size_t)np), mx = -1e300, sum = 0;
            const float *qq = q + (size_t)j * qs + (size_t)g * hd;
            for (int p = 0; p < np; p++) {
                const char *kr = pool + (size_t)bt[p / TPB] * bb + (size_t)(p % TPB) * hd * esz;
                double d = 0;
                for (int e = 0; e < hd; e++) d += (double)qq[e] * stored(kr, e, dt);
                s[p] = d / sqrt((double)hd);
                if (s[p] > mx) mx = s[p];
            }
            for (int p = 0; p < np; p++) sum += (s[p] = exp(s[p] - mx));
            for (int e = 0; e < hd; e++) {
                double o = 0;
                for (int p = 0; p < np; p++) {
                    const char *vr = pool + (size_t)bt[p / TPB] * bb + run + (size_t)(p % TPB) * hd * esz;
                    o += s[p] / sum * stored(vr, e, dt);
                }
                double got = ref[(size_t)j * qs + (size_t)g * hd + e];
                if (fabs(got - o) > 1e-5 * 2.0)
                    fail_msg("hd %d G %d R %d n_pos %d dt %d: out[%d][%d][%d] = %.9g, double %.9g", hd, G, R, n_pos, dt,
                             j, g, e, got, o);
            }
            free(s);
        }
    enum kv_matmul_isa isas[] = {KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512};
    for (int i = 0; i < 4; i++) { /* each family in both software-prefetch modes (quant.h) */
        if (kv_matmul_set_isa(isas[i / 2]) != isas[i / 2]) continue;
        kv_quant_set_prefetch(i % 2 ? KV_PREFETCH_NTA : KV_PREFETCH_CACHE);
        a.out = out;
        memset(out, 0xff, sizeof(float) * qs * R);
        kv_attention(&a);
        if (memcmp(out, ref, sizeof(float) * qs * R))
            fail_msg("hd %d G %d R %d n_pos %d dt %s: family %s (prefetch %s) differs from generic", hd, G, R, n_pos,
                     kv_dtype_name(dt), kv_matmul_isa_name(), kv_quant_prefetch_name(kv_quant_get_prefetch()));
    }
    kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
    kv_quant_set_prefetch(KV_PREFETCH_AUTO);
    free(pool), free(bt), free(q), free(ref), free(out), free(scores);
}

static void test_families_equal_generic(void **st) {
    (void)st;
    static const int hds[] = {64, 40, 16, 24, 128, 8, 80, 96};
    static const int npos[] = {1, 5, 16, 17, 40, 100};
    static const int rows[] = {1, 3, 8};
    int dts[] = {KV_DTYPE_F32, KV_DTYPE_F16, KV_DTYPE_BF16};
    for (size_t h = 0; h < sizeof hds / sizeof hds[0]; h++)
        for (int G = 1; G <= 4; G += 3)
            for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
                for (size_t p = 0; p < sizeof npos / sizeof npos[0]; p++)
                    for (int d = 0; d < 3; d++) run_case(hds[h], G, rows[r], npos[p], dts[d]);
}

/* More than 256 (row, head) pairs in one call: 1/sum is recomputed from the e_i (attn_inv)
 * with the contract's lane sums, so it still equals generic (and double precision). */
static void test_large_group(void **st) {
    (void)st;
    run_case(16, 40, 8, 37, KV_DTYPE_F16);
    run_case(24, 33, 8, 5, KV_DTYPE_F32);
    /* head_dim past what the vector families widen to f32 on the stack (256): K read in place */
    run_case(272, 2, 3, 40, KV_DTYPE_F16);
    run_case(320, 1, 3, 17, KV_DTYPE_BF16);
}

/* n_kv heads in one call (runs head_stride apart, block by block with the heads inside) give
 * each (row, head) the bits of a call of its own, on every family. */
static void test_heads_in_one_call(void **st) {
    (void)st;
    static const int cases[][5] = {/* hd, G, R, n_pos, n_kv */ {64, 1, 1, 300, 3}, {64, 2, 3, 40, 8}, {40, 1, 8, 17, 5},
                                   {128, 4, 1, 33, 2}, {16, 1, 2, 1, 7}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int dt = KV_DTYPE_F32; dt <= KV_DTYPE_BF16; dt++) {
            int hd = cases[c][0], G = cases[c][1], R = cases[c][2], n_pos = cases[c][3], H = cases[c][4];
            int n_last = n_pos + R - 1, n_blocks = (n_last + TPB - 1) / TPB + 1;
            size_t esz = kv_dtype_size(dt), run = (size_t)TPB * hd * esz, bb = 2 * (size_t)H * run;
            char *pool = calloc((size_t)n_blocks, bb);
            int32_t *bt = malloc(sizeof(int32_t) * (size_t)n_blocks);
            for (int b = 0; b < n_blocks; b++) bt[b] = (b * 7 + 3) % n_blocks;
            float row[256];
            for (size_t i = 0; i < (size_t)n_blocks * bb / esz; i++) {
                row[0] = frand() * 2.0f;
                kv_store_row(pool + i * esz, row, 1, dt);
            }
            size_t qs = (size_t)H * G * hd, per = (size_t)R * G * (size_t)(n_pos + R - 1);
            float *q = malloc(sizeof(float) * qs * R), *ref = malloc(sizeof(float) * qs * R),
                  *out = malloc(sizeof(float) * qs * R), *scores = malloc(sizeof(float) * per * (size_t)H);
            for (size_t i = 0; i < qs * R; i++) q[i] = frand();
            struct kv_attn_args a = {.q = q, .n_group = G, .head_dim = hd, .n_rows = R, .q_stride = qs,
                                     .out_stride = qs, .n_pos = n_pos, .block_table = bt, .tpb = TPB, .pool = pool,
                                     .block_bytes = bb, .k_off = 0, .v_off = (size_t)H * run, .kv_dtype = dt,
                                     .scale = 1.0f / sqrtf((float)hd), .scores = scores, .out = ref};
            assert_int_equal(kv_matmul_set_isa(KV_MATMUL_ISA_GENERIC), KV_MATMUL_ISA_GENERIC);
            for (int x = 0; x < H; x++) { /* one call per head */
                struct kv_attn_args b = a;
                b.k_off = (size_t)x * run, b.v_off = (size_t)(H + x) * run;
                b.q = q + (size_t)x * G * hd, b.out = ref + (size_t)x * G * hd;
                kv_attention(&b);
            }
            enum kv_matmul_isa isas[] = {KV_MATMUL_ISA_GENERIC, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512};
            for (int i = 0; i < 3; i++) {
                if (kv_matmul_set_isa(isas[i]) != isas[i]) continue;
                a.out = out, a.n_kv = H, a.head_stride = run;
                memset(out, 0xff, sizeof(float) * qs * R);
                kv_attention(&a);
                if (memcmp(out, ref, sizeof(float) * qs * R))
                    fail_msg("hd %d G %d R %d n_pos %d n_kv %d dt %s: family %s, heads in one call differ", hd, G, R,
                             n_pos, H, kv_dtype_name(dt), kv_matmul_isa_name());
            }
            kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
            free(pool), free(bt), free(q), free(ref), free(out), free(scores);
        }
}

/* kv_store_row to f16 gives kv_f32_to_f16's bits on every family: random values over the
 * whole exponent range (normal, subnormal and overflowing results, ties), f32 subnormals,
 * zeros, infinities and NaNs (with payloads) in groups of 8 and in the scalar tail. */
static void test_store_f16_every_family(void **st) {
    (void)st;
    enum { N = 4099 };
    float *src = malloc(sizeof(float) * N);
    uint16_t *got = malloc(2 * N), *want = malloc(2 * N);
    for (int i = 0; i < N; i++) {
        uint32_t u;
        g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
        u = (uint32_t)(g_rng >> 20);
        /* exponents 0x60..0x9f (2^-31 .. 2^32): f16 subnormals, normals and overflow */
        u = (u & 0x807fffffu) | ((uint32_t)(0x60 + (g_rng >> 58)) << 23);
        if (i % 7 == 0) u &= ~0x1fffu, u |= 0x1000u; /* a tie at f16 precision */
        memcpy(&src[i], &u, 4);
    }
    const uint32_t special[] = {0, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc12345u,
                                0x00000001u, 0x807fffffu, 0x477fefffu, 0x477ff000u, 0x33000000u, 0x33000001u};
    for (size_t k = 0; k < sizeof special / sizeof special[0]; k++) {
        memcpy(&src[37 * k + 5], &special[k], 4);
        memcpy(&src[N - 1 - k], &special[k], 4);
    }
    for (int i = 0; i < N; i++) want[i] = kv_f32_to_f16(src[i]);
    enum kv_matmul_isa isas[] = {KV_MATMUL_ISA_GENERIC, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_AVX512};
    for (int f = 0; f < 3; f++) {
        if (kv_matmul_set_isa(isas[f]) != isas[f]) continue;
        for (int n = N; n > N - 9; n--) {
            memset(got, 0, 2 * N);
            kv_store_row(got, src, n, KV_DTYPE_F16);
            for (int i = 0; i < n; i++)
                if (got[i] != want[i])
                    fail_msg("family %s, n %d: element %d (%a) stored as 0x%04x, kv_f32_to_f16 gives 0x%04x",
                             kv_matmul_isa_name(), n, i, (double)src[i], got[i], want[i]);
        }
    }
    kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
    free(src), free(got), free(want);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_families_equal_generic),
        cmocka_unit_test(test_large_group),
        cmocka_unit_test(test_heads_in_one_call),
        cmocka_unit_test(test_store_f16_every_family),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
