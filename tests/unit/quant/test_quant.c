/* quant: the GGUF block formats against llama.cpp's own dequantization (every tensor of every
 * models/tiny-quant file, bitwise, reference and every ISA of this CPU), the type table, F16 /
 * BF16 special values against computed expectations, and random blocks (extreme scales
 * included) comparing the fast path of each ISA with the scalar reference; also the GGUF
 * reader's handling of these types (gguf_open size checks, gguf_tensor_to_f32). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "model/gguf.h"
#include "quant/quant.h"
#include "test_util.h"
#include "quant_test_util.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return qt_xorshift(&g_rng); }

/* Index of the first differing float (bitwise), or -1. */
static long first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0) return (long)i;
    return -1;
}

static float bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* ---- type table ---- */

static void test_qtype_table(void **s) {
    (void)s;
    static const struct {
        int type;
        const char *name;
        int blck;
        size_t bytes;
    } k[] = {{KV_QTYPE_F32, "F32", 1, 4},     {KV_QTYPE_F16, "F16", 1, 2},       {KV_QTYPE_BF16, "BF16", 1, 2},
             {KV_QTYPE_Q8_0, "Q8_0", 32, 34}, {KV_QTYPE_Q4_0, "Q4_0", 32, 18},   {KV_QTYPE_Q4_K, "Q4_K", 256, 144},
             {KV_QTYPE_Q5_K, "Q5_K", 256, 176}, {KV_QTYPE_Q6_K, "Q6_K", 256, 210}};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        assert_true(kv_qtype_supported(k[i].type));
        assert_string_equal(kv_qtype_name(k[i].type), k[i].name);
        assert_int_equal(kv_qtype_block_elems(k[i].type), k[i].blck);
        assert_int_equal(kv_qtype_block_bytes(k[i].type), k[i].bytes);
        assert_int_equal(kv_qtype_row_bytes(k[i].type, 0), 0);
        assert_int_equal(kv_qtype_row_bytes(k[i].type, 4096), 4096 / k[i].blck * k[i].bytes);
        assert_int_equal(kv_qtype_row_bytes(k[i].type, -(int64_t)k[i].blck), 0);
        if (k[i].blck > 1) {
            assert_int_equal(kv_qtype_row_bytes(k[i].type, k[i].blck + 1), 0);
            assert_int_equal(kv_qtype_row_bytes(k[i].type, k[i].blck / 2), 0);
            assert_int_equal(kv_qtype_row_bytes(k[i].type, 4096 + 16), 0);
        } else {
            assert_int_equal(kv_qtype_row_bytes(k[i].type, 7), 7 * k[i].bytes);
        }
    }
    /* huge sizes: 0 when the byte count does not fit size_t */
    assert_int_equal(kv_qtype_row_bytes(KV_QTYPE_F32, INT64_MAX), 0);
    assert_int_equal(kv_qtype_row_bytes(KV_QTYPE_Q8_0, INT64_MAX / 32 * 32), (size_t)(INT64_MAX / 32) * 34);
    assert_int_equal(kv_qtype_row_bytes(KV_QTYPE_F16, INT64_MAX), (size_t)INT64_MAX * 2); /* just fits */
    /* known to ggml but not computed with here */
    static const struct {
        int type;
        const char *name;
    } u[] = {{3, "Q4_1"}, {6, "Q5_0"}, {7, "Q5_1"}, {9, "Q8_1"}, {10, "Q2_K"}, {11, "Q3_K"}, {15, "Q8_K"},
             {16, "IQ2_XXS"}, {20, "IQ4_NL"}, {23, "IQ4_XS"}, {28, "F64"}, {35, "TQ2_0"}};
    for (size_t i = 0; i < sizeof u / sizeof u[0]; i++) {
        assert_false(kv_qtype_supported(u[i].type));
        assert_string_equal(kv_qtype_name(u[i].type), u[i].name);
        assert_int_equal(kv_qtype_block_elems(u[i].type), 0);
        assert_int_equal(kv_qtype_block_bytes(u[i].type), 0);
        assert_int_equal(kv_qtype_row_bytes(u[i].type, 256), 0);
    }
    int bad[] = {-1, 4, 5, 31, 99, 1 << 20};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_false(kv_qtype_supported(bad[i]));
        assert_string_equal(kv_qtype_name(bad[i]), "unknown");
        assert_int_equal(kv_qtype_row_bytes(bad[i], 256), 0);
    }
}

/* Unsupported types, n not a multiple of the block and n <= 0 write nothing (every ISA). */
static void test_dequant_writes_nothing(void **s) {
    (void)s;
    uint8_t src[1024];
    for (size_t i = 0; i < sizeof src; i++) src[i] = (uint8_t)rnd();
    float dst[512];
    for (int ii = -1; ii < N_ISAS; ii++) {
        if (ii >= 0 && !use_isa(k_isas[ii])) continue;
        struct {
            int type;
            int64_t n;
        } c[] = {{10, 256}, {99, 32}, {-1, 32}, {KV_QTYPE_Q8_0, 31}, {KV_QTYPE_Q4_K, 255}, {KV_QTYPE_Q6_K, 300},
                 {KV_QTYPE_Q4_0, 48}, {KV_QTYPE_F16, 0}, {KV_QTYPE_F32, -4}};
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
            memset(dst, 0x5a, sizeof dst);
            if (ii < 0) kv_dequant_row_ref(c[i].type, src, dst, c[i].n);
            else kv_dequant_row(c[i].type, src, dst, c[i].n);
            for (size_t j = 0; j < sizeof dst; j++) assert_int_equal(((uint8_t *)dst)[j], 0x5a);
        }
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
}

static void test_isa_select(void **s) {
    (void)s;
    assert_int_equal(kv_quant_set_isa(KV_QUANT_ISA_GENERIC), KV_QUANT_ISA_GENERIC);
    assert_int_equal(kv_quant_get_isa(), KV_QUANT_ISA_GENERIC);
    assert_string_equal(kv_quant_isa_name(KV_QUANT_ISA_GENERIC), "generic");
    assert_string_equal(kv_quant_isa_name(KV_QUANT_ISA_AVX2), "avx2");
    assert_string_equal(kv_quant_isa_name(KV_QUANT_ISA_AVX512), "avx512");
    enum kv_quant_isa a = kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    assert_true(a >= KV_QUANT_ISA_GENERIC && a <= KV_QUANT_ISA_AVX512);
    assert_int_equal(kv_quant_get_isa(), a);
    /* KVSERVE_CPU_ISA lowers AUTO's choice (run e.g. KVSERVE_CPU_ISA=avx2 test_quant) */
    const char *env = getenv("KVSERVE_CPU_ISA");
    if (env && strcmp(env, "generic") == 0) assert_int_equal(a, KV_QUANT_ISA_GENERIC);
    if (env && strcmp(env, "avx2") == 0) assert_true(a <= KV_QUANT_ISA_AVX2);
    /* a forced set the CPU lacks falls back to the best it has, never above it */
    enum kv_quant_isa top = kv_quant_set_isa(KV_QUANT_ISA_AVX512);
    assert_true(top >= a || getenv("KVSERVE_CPU_ISA"));
    assert_true(kv_quant_set_isa(KV_QUANT_ISA_AVX2) <= top);
    fprintf(stderr, "NOTE: AUTO picks %s here; best available %s (KVSERVE_CPU_ISA=%s)\n", kv_quant_isa_name(a),
            kv_quant_isa_name(top), getenv("KVSERVE_CPU_ISA") ? getenv("KVSERVE_CPU_ISA") : "(unset)");
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
}

/* The software-prefetch mode (quant.h): the KVSERVE_CPU_PREFETCH parser, forcing, and AUTO =
 * NTA exactly on AMD CPUs (the vendor read independently from /proc/cpuinfo, where it exists)
 * unless the variable names a mode. */
static void test_prefetch_mode(void **s) {
    (void)s;
    const char *saved = getenv("KVSERVE_CPU_PREFETCH");
    char *keep = saved ? strdup(saved) : NULL;
    static const struct { const char *v; int want; } cases[] = {
        {"", KV_PREFETCH_AUTO},   {"auto", KV_PREFETCH_AUTO}, {"cache", KV_PREFETCH_CACHE}, {"CACHE", KV_PREFETCH_CACHE},
        {"nta", KV_PREFETCH_NTA}, {"Nta", KV_PREFETCH_NTA},   {"t0", -1},                   {"nta ", -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        setenv("KVSERVE_CPU_PREFETCH", cases[i].v, 1);
        assert_int_equal(kv_quant_prefetch_env(), cases[i].want);
    }
    unsetenv("KVSERVE_CPU_PREFETCH");
    assert_int_equal(kv_quant_prefetch_env(), KV_PREFETCH_AUTO);
    assert_int_equal(kv_quant_set_prefetch(KV_PREFETCH_CACHE), KV_PREFETCH_CACHE);
    assert_int_equal(kv_quant_get_prefetch(), KV_PREFETCH_CACHE);
    assert_int_equal(kv_quant_set_prefetch(KV_PREFETCH_NTA), KV_PREFETCH_NTA);
    assert_int_equal(kv_quant_get_prefetch(), KV_PREFETCH_NTA);
    assert_string_equal(kv_quant_prefetch_name(KV_PREFETCH_CACHE), "cache");
    assert_string_equal(kv_quant_prefetch_name(KV_PREFETCH_NTA), "nta");
    assert_string_equal(kv_quant_prefetch_name(KV_PREFETCH_AUTO), "auto");
    /* AUTO: the variable when it names a mode, else the vendor's default */
    setenv("KVSERVE_CPU_PREFETCH", "cache", 1);
    assert_int_equal(kv_quant_set_prefetch(KV_PREFETCH_AUTO), KV_PREFETCH_CACHE);
    setenv("KVSERVE_CPU_PREFETCH", "nta", 1);
    assert_int_equal(kv_quant_set_prefetch(KV_PREFETCH_AUTO), KV_PREFETCH_NTA);
    setenv("KVSERVE_CPU_PREFETCH", "bogus", 1); /* the CLIs refuse it; the library falls back to AUTO */
    enum kv_prefetch bogus = kv_quant_set_prefetch(KV_PREFETCH_AUTO);
    unsetenv("KVSERVE_CPU_PREFETCH");
    enum kv_prefetch dflt = kv_quant_set_prefetch(KV_PREFETCH_AUTO);
    assert_int_equal(bogus, dflt);
    assert_true(dflt == KV_PREFETCH_CACHE || dflt == KV_PREFETCH_NTA);
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[256];
        int amd = -1;
        while (amd < 0 && fgets(line, sizeof line, f))
            if (!strncmp(line, "vendor_id", 9)) amd = strstr(line, "AuthenticAMD") != NULL;
        fclose(f);
        if (amd >= 0) assert_int_equal(dflt, amd ? KV_PREFETCH_NTA : KV_PREFETCH_CACHE);
    }
    fprintf(stderr, "NOTE: prefetch mode AUTO picks %s here\n", kv_quant_prefetch_name(dflt));
    if (keep) setenv("KVSERVE_CPU_PREFETCH", keep, 1);
    free(keep);
    kv_quant_set_prefetch(KV_PREFETCH_AUTO);
}

/* ---- F16 / BF16: every bit pattern against an independently computed value ---- */

static void put16le(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static uint32_t f16_expect(uint16_t h) {
    int e = h >> 10 & 31, m = h & 1023;
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    if (e == 31) return sign | 0x7f800000u | (m ? 0x00400000u | (uint32_t)m << 13 : 0);
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return sign | f_bits((float)v); /* v is exact in binary32 */
}

static void test_f16_all_values(void **s) {
    (void)s;
    const int n = 65536;
    uint8_t *src = malloc(2 * n + 64);
    float *want = malloc(4 * n), *got = malloc(4 * n + 64);
    assert_non_null(src);
    assert_non_null(want);
    assert_non_null(got);
    for (int i = 0; i < n; i++) {
        src[2 * i] = (uint8_t)i;
        src[2 * i + 1] = (uint8_t)(i >> 8);
        want[i] = bits_f(f16_expect((uint16_t)i));
    }
    /* spot checks of the expectation itself */
    assert_true(want[0x3c00] == 1.0f && want[0xc000] == -2.0f && want[0x7bff] == 65504.0f);
    assert_true(want[0x0001] == 0x1p-24f && want[0x03ff] == 1023 * 0x1p-24f && want[0x0400] == 0x1p-14f);
    assert_true(f_bits(want[0x8000]) == 0x80000000u && f_bits(want[0x8001]) == 0x80000000u + f_bits(0x1p-24f));
    assert_true(isinf(want[0x7c00]) && want[0x7c00] > 0 && isinf(want[0xfc00]) && want[0xfc00] < 0);
    assert_true(isnan(want[0x7c01]) && isnan(want[0x7e00]) && isnan(want[0xffff]));
    for (int ii = -1; ii < N_ISAS; ii++) {
        if (ii >= 0 && !use_isa(k_isas[ii])) continue;
        if (ii < 0) kv_dequant_row_ref(KV_QTYPE_F16, src, got, n);
        else kv_dequant_row(KV_QTYPE_F16, src, got, n);
        long d = first_diff(got, want, (size_t)n);
        if (d >= 0) fail_msg("%s: f16 0x%04lx -> 0x%08x, want 0x%08x", ii < 0 ? "ref" : kv_quant_isa_name(k_isas[ii]),
                             d, f_bits(got[d]), f_bits(want[d]));
        /* every length 1..80 from an odd source address into an odd destination (vector
         * tails, masked loads/stores): nothing outside the row is written */
        if (ii >= 0)
            for (int len = 1; len <= 80; len++) {
                uint8_t sb[2 * 80 + 1];
                float out[82];
                int base = (len * 7919) % 65536;
                for (int j = 0; j < len; j++) put16le(sb + 1 + 2 * j, (uint16_t)(base + j * 977));
                memset(out, 0x77, sizeof out);
                kv_dequant_row(KV_QTYPE_F16, sb + 1, out + 1, len);
                for (int j = 0; j < len; j++)
                    assert_int_equal(f_bits(out[1 + j]), f16_expect((uint16_t)(base + j * 977)));
                assert_int_equal(f_bits(out[0]), 0x77777777u);
                assert_int_equal(f_bits(out[1 + len]), 0x77777777u);
            }
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    free(src);
    free(want);
    free(got);
}

static void test_bf16_values(void **s) {
    (void)s;
    const int n = 65536;
    uint8_t *src = malloc(2 * n + 2);
    float *got = malloc(4 * n + 8);
    assert_non_null(src);
    assert_non_null(got);
    for (int i = 0; i < n; i++) {
        src[1 + 2 * i] = (uint8_t)i;
        src[1 + 2 * i + 1] = (uint8_t)(i >> 8);
    }
    for (int ii = -1; ii < N_ISAS; ii++) {
        if (ii >= 0 && !use_isa(k_isas[ii])) continue;
        for (int len = n; len > n - 19; len--) { /* tails of every length mod 16 */
            memset(got, 0x77, 4 * (size_t)n + 8);
            if (ii < 0) kv_dequant_row_ref(KV_QTYPE_BF16, src + 1, got + 1, len);
            else kv_dequant_row(KV_QTYPE_BF16, src + 1, got + 1, len);
            for (int i = 0; i < len; i++)
                if (f_bits(got[1 + i]) != (uint32_t)i << 16) fail_msg("bf16 0x%04x -> 0x%08x", i, f_bits(got[1 + i]));
            assert_int_equal(f_bits(got[0]), 0x77777777u);
            assert_int_equal(f_bits(got[1 + len]), 0x77777777u);
        }
    }
    assert_true(bits_f(0x3f80u << 16) == 1.0f);
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    free(src);
    free(got);
}

/* ---- random blocks: fast path of every ISA == reference, bitwise ---- */

/* f16 scales worth trying: zero, -0, subnormals, tiny/huge normals, max, inf, NaNs. */
static const uint16_t k_scales[] = {0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0xfbff,
                                    0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xfe3f, 0x1234, 0xa5a5, 0x2e66};

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void check_random(int type, int max_blocks, int rounds) {
    size_t bb = kv_qtype_block_bytes(type);
    int blck = kv_qtype_block_elems(type);
    size_t cap_b = bb * (size_t)max_blocks;
    int64_t cap_n = (int64_t)blck * max_blocks;
    uint8_t *src = malloc(cap_b + 64);
    float *want = malloc(sizeof(float) * (size_t)cap_n + 64), *got = malloc(sizeof(float) * (size_t)cap_n + 64);
    assert_non_null(src);
    assert_non_null(want);
    assert_non_null(got);
    long compared = 0;
    for (int r = 0; r < rounds; r++) {
        int nb = 1 + (int)(rnd() % (uint64_t)max_blocks);
        int64_t n = (int64_t)nb * blck;
        int soff = (int)(rnd() % 8), doff = (int)(rnd() % 4);
        uint8_t *sp = src + soff;
        for (size_t i = 0; i < (size_t)nb * bb; i++) sp[i] = (uint8_t)rnd();
        /* scales: half the rounds keep random bytes, the rest pick from the extreme list */
        if (r % 2) {
            for (int b = 0; b < nb; b++) {
                uint8_t *blk = sp + (size_t)b * bb;
                uint16_t s1 = k_scales[rnd() % (sizeof k_scales / 2)], s2 = k_scales[rnd() % (sizeof k_scales / 2)];
                switch (type) {
                case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: put16(blk, s1); break;
                case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: put16(blk, s1); put16(blk + 2, s2); break;
                case KV_QTYPE_Q6_K: put16(blk + 208, s1); break;
                default: break;
                }
                if (r % 4 == 1 && type == KV_QTYPE_Q6_K) /* extreme sub-scales too */
                    for (int j = 0; j < 16; j++) blk[192 + j] = (uint8_t)(j % 2 ? 0x80 : 0x7f);
                if (r % 4 == 1 && (type == KV_QTYPE_Q4_K || type == KV_QTYPE_Q5_K)) memset(blk + 4, 0xff, 12);
            }
        }
        kv_dequant_row_ref(type, sp, want + doff, n);
        for (int ii = 0; ii < N_ISAS; ii++) {
            if (!use_isa(k_isas[ii])) continue;
            memset(got, 0x77, sizeof(float) * (size_t)cap_n + 64);
            kv_dequant_row(type, sp, got + doff, n);
            long d = first_diff(got + doff, want + doff, (size_t)n);
            if (d >= 0)
                fail_msg("%s %s round %d (%d blocks): element %ld = 0x%08x, reference 0x%08x", kv_qtype_name(type),
                         kv_quant_isa_name(k_isas[ii]), r, nb, d, f_bits(got[doff + d]), f_bits(want[doff + d]));
            assert_int_equal(f_bits(got[doff + n]), 0x77777777u); /* nothing past the row */
            if (doff) assert_int_equal(f_bits(got[doff - 1]), 0x77777777u);
            compared += n;
        }
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    assert_true(compared > 0);
    free(src);
    free(want);
    free(got);
}

static void test_random_q8_0(void **s) { (void)s; check_random(KV_QTYPE_Q8_0, 40, 400); }
static void test_random_q4_0(void **s) { (void)s; check_random(KV_QTYPE_Q4_0, 40, 400); }
static void test_random_q4_k(void **s) { (void)s; check_random(KV_QTYPE_Q4_K, 6, 400); }
static void test_random_q5_k(void **s) { (void)s; check_random(KV_QTYPE_Q5_K, 6, 400); }
static void test_random_q6_k(void **s) { (void)s; check_random(KV_QTYPE_Q6_K, 6, 400); }
static void test_random_f16(void **s) { (void)s; check_random(KV_QTYPE_F16, 300, 300); }
static void test_random_bf16(void **s) { (void)s; check_random(KV_QTYPE_BF16, 300, 300); }
static void test_random_f32(void **s) { (void)s; check_random(KV_QTYPE_F32, 300, 100); }

/* Known values of each format built by hand (the layout, independent of llama.cpp's files). */
static void test_known_blocks(void **s) {
    (void)s;
    float y[256];
    /* Q4_0: d = 0.5, qs[j] = j | (15 - j) << 4 -> x[j] = (j - 8) / 2, x[16 + j] = (7 - j) / 2 */
    uint8_t q4[18];
    put16(q4, 0x3800);
    for (int j = 0; j < 16; j++) q4[2 + j] = (uint8_t)(j | (15 - j) << 4);
    kv_dequant_row(KV_QTYPE_Q4_0, q4, y, 32);
    for (int j = 0; j < 16; j++) {
        assert_true(y[j] == (float)(j - 8) * 0.5f);
        assert_true(y[16 + j] == (float)(7 - j) * 0.5f);
    }
    /* Q4_K: d = 1, dmin = 0.25; sub-block s has scale s + 1 and min 2s (j < 4: low 6 bits of
     * bytes 0..3 / 4..7; j >= 4: nibbles of bytes 8..11 plus the top 2 bits of 0..3 / 4..7) */
    uint8_t k4[144] = {0};
    put16(k4, 0x3c00);
    put16(k4 + 2, 0x3400);
    for (int sb = 0; sb < 8; sb++) {
        int sc = sb + 1 + (sb >= 4 ? 16 : 0), mn = 2 * sb + (sb >= 4 ? 32 : 0);
        if (sb < 4) {
            k4[4 + sb] = (uint8_t)sc;
            k4[8 + sb] = (uint8_t)mn;
        } else {
            k4[8 + sb] = (uint8_t)((sc & 15) | (mn & 15) << 4);
            k4[4 + sb - 4] |= (uint8_t)((sc >> 4) << 6);
            k4[8 + sb - 4] |= (uint8_t)((mn >> 4) << 6);
        }
    }
    for (int l = 0; l < 128; l++) k4[16 + l] = (uint8_t)((l % 16) | (15 - l % 16) << 4);
    for (int ii = -1; ii < N_ISAS; ii++) {
        if (ii >= 0 && !use_isa(k_isas[ii])) continue;
        if (ii < 0) kv_dequant_row_ref(KV_QTYPE_Q4_K, k4, y, 256);
        else kv_dequant_row(KV_QTYPE_Q4_K, k4, y, 256);
        for (int e = 0; e < 256; e++) {
            int sb = e / 32, l = e % 32, sc = sb + 1 + (sb >= 4 ? 16 : 0), mn = 2 * sb + (sb >= 4 ? 32 : 0);
            int q = sb % 2 ? 15 - l % 16 : l % 16;
            assert_true(y[e] == (float)(sc * q) - 0.25f * (float)mn);
        }
    }
    /* Q6_K: d = 2, scales[i] = i - 8; element e = 128h + 32g + l has q = (e * 7) % 64 */
    uint8_t k6[210] = {0};
    put16(k6 + 208, 0x4000);
    for (int i = 0; i < 16; i++) k6[192 + i] = (uint8_t)(int8_t)(i - 8);
    for (int e = 0; e < 256; e++) {
        int h = e / 128, g = e % 128 / 32, l = e % 32, q = (e * 7) % 64;
        uint8_t *lb = &k6[64 * h + 32 * (g & 1) + l];
        *lb |= (uint8_t)(g < 2 ? q & 15 : (q & 15) << 4);
        k6[128 + 32 * h + l] |= (uint8_t)((q >> 4) << (2 * g));
    }
    for (int ii = -1; ii < N_ISAS; ii++) {
        if (ii >= 0 && !use_isa(k_isas[ii])) continue;
        if (ii < 0) kv_dequant_row_ref(KV_QTYPE_Q6_K, k6, y, 256);
        else kv_dequant_row(KV_QTYPE_Q6_K, k6, y, 256);
        for (int e = 0; e < 256; e++) {
            int h = e / 128, g = e % 128 / 32, l = e % 32;
            int sc = 8 * h + 2 * g + l / 16 - 8;
            assert_true(y[e] == 2.0f * (float)sc * (float)((e * 7) % 64 - 32));
        }
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
}

/* ---- llama.cpp's dequantization of the tiny-quant models, bitwise ---- */

static void check_llamacpp(void **state) {
    const char *tag = *state;
    char rel[256], p1[1024], p2[1024], err[512];
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", tag);
    if (!test_data_path(p1, sizeof p1, rel)) skip();
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.dequant-f32.gguf", tag);
    if (!test_data_path(p2, sizeof p2, rel)) skip();
    gguf_t *g = NULL, *r = NULL;
    if (gguf_open(p1, &g, err, sizeof err) != KV_OK) fail_msg("%s", err);
    if (gguf_open(p2, &r, err, sizeof err) != KV_OK) fail_msg("%s", err);
    int per_type[64] = {0};
    long elems = 0;
    for (int i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i), *rt = gguf_find_tensor(r, t->name);
        if (!rt) fail_msg("%s: %s missing from the reference", tag, t->name);
        assert_int_equal(rt->type, KV_QTYPE_F32);
        assert_int_equal(rt->n_dims, t->n_dims);
        uint64_t n = 1;
        for (int d = 0; d < t->n_dims; d++) {
            assert_int_equal(rt->ne[d], t->ne[d]);
            n *= t->ne[d];
        }
        if (!kv_qtype_supported((int)t->type)) fail_msg("%s: %s has type %s", tag, t->name, kv_qtype_name((int)t->type));
        int64_t row = (int64_t)t->ne[0], rows = (int64_t)(n / t->ne[0]);
        size_t rb = kv_qtype_row_bytes((int)t->type, row);
        assert_true(rb > 0);
        assert_int_equal((uint64_t)rb * (uint64_t)rows, t->nbytes);
        assert_int_equal(rt->nbytes, n * 4);
        float *out = malloc(n * 4);
        assert_non_null(out);
        const float *want = rt->data;
        /* the reference, whole tensor in one call */
        memset(out, 0x77, n * 4);
        kv_dequant_row_ref((int)t->type, t->data, out, (int64_t)n);
        long d = first_diff(out, want, n);
        if (d >= 0)
            fail_msg("%s: %s (%s) ref: element %ld = %a (0x%08x), llama.cpp %a (0x%08x)", tag, t->name,
                     kv_qtype_name((int)t->type), d, (double)out[d], f_bits(out[d]), (double)want[d], f_bits(want[d]));
        /* every ISA, row by row as the matmul kernels call it */
        for (int ii = 0; ii < N_ISAS; ii++) {
            if (!use_isa(k_isas[ii])) continue;
            memset(out, 0x77, n * 4);
            for (int64_t rr = 0; rr < rows; rr++)
                kv_dequant_row((int)t->type, (const uint8_t *)t->data + rr * rb, out + rr * row, row);
            d = first_diff(out, want, n);
            if (d >= 0)
                fail_msg("%s: %s (%s) %s: element %ld = %a, llama.cpp %a", tag, t->name, kv_qtype_name((int)t->type),
                         kv_quant_isa_name(k_isas[ii]), d, (double)out[d], (double)want[d]);
        }
        kv_quant_set_isa(KV_QUANT_ISA_AUTO);
        /* and through the GGUF reader */
        memset(out, 0x77, n * 4);
        if (gguf_tensor_to_f32(t, out, n, err, sizeof err) != KV_OK) fail_msg("%s", err);
        assert_int_equal(first_diff(out, want, n), -1);
        free(out);
        per_type[t->type & 63]++;
        elems += (long)n;
    }
    char seen[256] = "";
    for (int ty = 0; ty < 64; ty++)
        if (per_type[ty]) {
            size_t l = strlen(seen);
            snprintf(seen + l, sizeof seen - l, " %s x%d", kv_qtype_name(ty), per_type[ty]);
        }
    fprintf(stderr, "NOTE: tiny-%s: %d tensors, %ld elements bitwise equal to llama.cpp:%s\n", tag,
            gguf_n_tensors(g), elems, seen);
    /* the file's own quant type must be among the tensors checked */
    static const struct {
        const char *tag;
        int type;
    } k_main[] = {{"F16", KV_QTYPE_F16},     {"BF16", KV_QTYPE_BF16},   {"Q8_0", KV_QTYPE_Q8_0},
                  {"Q4_0", KV_QTYPE_Q4_0},   {"Q4_K_M", KV_QTYPE_Q4_K}, {"Q4_K_M", KV_QTYPE_Q6_K},
                  {"Q5_K_M", KV_QTYPE_Q5_K}, {"Q5_K_M", KV_QTYPE_Q6_K}, {"Q6_K", KV_QTYPE_Q6_K}};
    for (size_t k = 0; k < sizeof k_main / sizeof k_main[0]; k++)
        if (strcmp(k_main[k].tag, tag) == 0) assert_true(per_type[k_main[k].type] > 0);
    gguf_close(g);
    gguf_close(r);
}

/* ---- the GGUF reader with these types ---- */

static char g_tmp[256];

static void test_gguf_quant_types(void **s) {
    (void)s;
    char path[512], err[256];
    snprintf(path, sizeof path, "%s/qtypes.gguf", g_tmp);
    /* one 2 x 256 tensor of every supported type, random contents with sane scales */
    static const int types[] = {KV_QTYPE_F32,  KV_QTYPE_F16,  KV_QTYPE_BF16, KV_QTYPE_Q8_0,
                                KV_QTYPE_Q4_0, KV_QTYPE_Q4_K, KV_QTYPE_Q5_K, KV_QTYPE_Q6_K};
    uint8_t *bufs[8];
    gguf_writer_t *w = gguf_writer_new();
    assert_non_null(w);
    uint64_t ne[2] = {256, 2};
    for (int i = 0; i < 8; i++) {
        size_t nb = 2 * kv_qtype_row_bytes(types[i], 256);
        bufs[i] = malloc(nb);
        assert_non_null(bufs[i]);
        for (size_t j = 0; j < nb; j++) bufs[i][j] = (uint8_t)(rnd() & 0x3b); /* finite f16/bf16/f32 */
        char name[32];
        snprintf(name, sizeof name, "t.%s", kv_qtype_name(types[i]));
        assert_int_equal(gguf_w_tensor_raw(w, name, 2, ne, (uint32_t)types[i], bufs[i], nb), KV_OK);
    }
    assert_int_equal(gguf_writer_save(w, path, err, sizeof err), KV_OK);
    gguf_writer_free(w);
    gguf_t *g;
    if (gguf_open(path, &g, err, sizeof err) != KV_OK) fail_msg("%s", err);
    float want[512], got[512];
    for (int i = 0; i < 8; i++) {
        char name[32];
        snprintf(name, sizeof name, "t.%s", kv_qtype_name(types[i]));
        const struct gguf_tensor *t = gguf_find_tensor(g, name);
        assert_non_null(t);
        assert_int_equal(t->type, (uint32_t)types[i]);
        assert_int_equal(t->nbytes, 2 * kv_qtype_row_bytes(types[i], 256));
        assert_memory_equal(t->data, bufs[i], t->nbytes);
        kv_dequant_row_ref(types[i], bufs[i], want, 512);
        assert_int_equal(gguf_tensor_to_f32(t, got, 512, err, sizeof err), KV_OK);
        assert_memory_equal(got, want, sizeof got);
        assert_int_equal(gguf_tensor_to_f32(t, got, 511, err, sizeof err), KV_EFORMAT);
        free(bufs[i]);
    }
    gguf_close(g);

    /* a row length that is not a multiple of the block: KV_EFORMAT naming the tensor */
    uint64_t bad_ne[2] = {96, 2};
    uint8_t raw[2 * 144] = {0};
    w = gguf_writer_new();
    assert_int_equal(gguf_w_tensor_raw(w, "blk.7.bad_rows", 2, bad_ne, KV_QTYPE_Q4_K, raw, sizeof raw), KV_OK);
    assert_int_equal(gguf_writer_save(w, path, err, sizeof err), KV_OK);
    gguf_writer_free(w);
    g = NULL;
    assert_int_equal(gguf_open(path, &g, err, sizeof err), KV_EFORMAT);
    assert_null(g);
    assert_non_null(strstr(err, "blk.7.bad_rows"));
    assert_non_null(strstr(err, "Q4_K"));

    /* data shorter than the type needs: KV_EFORMAT naming the tensor */
    uint64_t ne6[2] = {256, 4};
    w = gguf_writer_new();
    assert_int_equal(gguf_w_tensor_raw(w, "short.q6", 2, ne6, KV_QTYPE_Q6_K, raw, 210), KV_OK);
    assert_int_equal(gguf_writer_save(w, path, err, sizeof err), KV_OK);
    gguf_writer_free(w);
    assert_int_equal(gguf_open(path, &g, err, sizeof err), KV_EFORMAT);
    assert_non_null(strstr(err, "short.q6"));

    /* a type ggml knows but we do not compute with: opens, conversion says which are supported */
    uint64_t ne2[1] = {256};
    w = gguf_writer_new();
    assert_int_equal(gguf_w_tensor_raw(w, "q2", 1, ne2, 10 /* Q2_K */, raw, 84), KV_OK);
    assert_int_equal(gguf_writer_save(w, path, err, sizeof err), KV_OK);
    gguf_writer_free(w);
    if (gguf_open(path, &g, err, sizeof err) != KV_OK) fail_msg("%s", err);
    const struct gguf_tensor *t = gguf_find_tensor(g, "q2");
    assert_int_equal(gguf_tensor_to_f32(t, got, 256, err, sizeof err), KV_EUNSUPPORTED);
    assert_non_null(strstr(err, "Q2_K"));
    assert_non_null(strstr(err, "Q6_K"));
    assert_non_null(strstr(err, "Q4_0"));
    gguf_close(g);
}

static int setup(void **s) {
    (void)s;
    return test_tmpdir_make(g_tmp, sizeof g_tmp, "kv_quant");
}
static int teardown(void **s) {
    (void)s;
    return test_tmpdir_remove(g_tmp);
}

#define LLAMACPP(tag) {"llamacpp_" tag, check_llamacpp, NULL, NULL, (void *)tag}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qtype_table),
        cmocka_unit_test(test_isa_select),
        cmocka_unit_test(test_prefetch_mode),
        cmocka_unit_test(test_dequant_writes_nothing),
        cmocka_unit_test(test_f16_all_values),
        cmocka_unit_test(test_bf16_values),
        cmocka_unit_test(test_known_blocks),
        cmocka_unit_test(test_random_q8_0),
        cmocka_unit_test(test_random_q4_0),
        cmocka_unit_test(test_random_q4_k),
        cmocka_unit_test(test_random_q5_k),
        cmocka_unit_test(test_random_q6_k),
        cmocka_unit_test(test_random_f16),
        cmocka_unit_test(test_random_bf16),
        cmocka_unit_test(test_random_f32),
        LLAMACPP("F16"),
        LLAMACPP("BF16"),
        LLAMACPP("Q8_0"),
        LLAMACPP("Q4_0"),
        LLAMACPP("Q4_K_M"),
        LLAMACPP("Q5_K_M"),
        LLAMACPP("Q6_K"),
        cmocka_unit_test(test_gguf_quant_types),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
