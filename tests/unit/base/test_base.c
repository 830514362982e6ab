#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "base/base.h"

static void test_parse_size(void **st) {
    (void)st;
    uint64_t v;
    assert_int_equal(kv_parse_size("512MiB", &v), KV_OK);
    assert_true(v == 512ull << 20);
    assert_int_equal(kv_parse_size("2G", &v), KV_OK);
    assert_true(v == 2ull << 30);
    assert_int_equal(kv_parse_size("1000", &v), KV_OK);
    assert_true(v == 1000);
    assert_int_equal(kv_parse_size("1MB", &v), KV_OK);
    assert_true(v == 1000000);
    assert_int_equal(kv_parse_size("abc", &v), KV_EINVAL);
    assert_int_equal(kv_parse_size("-5M", &v), KV_EINVAL);
    assert_int_equal(kv_parse_size("5 parsecs", &v), KV_EINVAL);
    assert_int_equal(kv_parse_size("", &v), KV_EINVAL);
}

static void test_utf8(void **st) {
    (void)st;
    assert_true(kv_utf8_valid("h\xc3\xa9llo", 6));
    assert_false(kv_utf8_valid("\xc3", 1));
    assert_false(kv_utf8_valid("\xc0\xaf", 2));        /* overlong */
    assert_false(kv_utf8_valid("\xed\xa0\x80", 3));    /* surrogate */
    assert_int_equal(kv_utf8_incomplete_tail("ab\xe2\x96", 4), 2);
    assert_int_equal(kv_utf8_incomplete_tail("ab\xe2\x96\x81", 5), 0);
    assert_int_equal(kv_utf8_incomplete_tail("ab\xf0", 3), 1);
    assert_int_equal(kv_utf8_incomplete_tail("abc", 3), 0);
}

static void test_half(void **st) {
    (void)st;
    float vals[] = {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++)
        assert_true(kv_f16_to_f32(kv_f32_to_f16(vals[i])) == vals[i]);
    assert_true(kv_bf16_to_f32(0x3f80) == 1.0f);
}

static void test_rng(void **st) {
    (void)st;
    kv_rng a, b;
    kv_rng_seed(&a, 42);
    kv_rng_seed(&b, 42);
    for (int i = 0; i < 100; i++) assert_true(kv_rng_next(&a) == kv_rng_next(&b));
    for (int i = 0; i < 1000; i++) {
        float f = kv_rng_f32(&a);
        assert_true(f >= 0.0f && f < 1.0f);
    }
}

static void test_buf(void **st) {
    (void)st;
    kv_buf b;
    kv_buf_init(&b);
    assert_string_equal(kv_buf_cstr(&b), "");
    for (int i = 0; i < 1000; i++) kv_buf_printf(&b, "%d,", i);
    assert_true(strncmp(b.data, "0,1,2,", 6) == 0);
    assert_int_equal(b.len, strlen(b.data));
    kv_buf_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_size), cmocka_unit_test(test_utf8), cmocka_unit_test(test_half),
        cmocka_unit_test(test_rng), cmocka_unit_test(test_buf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
