/* Stop-string matcher tests: split across deltas, overlapping stops, multi-byte UTF-8,
 * hold-back and release, nothing leaks after a stop. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/stop.h"

/* Feeds text in pieces of `step` bytes (0: whole UTF-8 characters one at a time); returns
 * the emitted text (static buffer), *stopped, and checks every emission is valid UTF-8. */
static const char *run(const char *const *stops, int n, const char *text, size_t step,
                       bool *stopped) {
    static char res[1024];
    struct stop_matcher m;
    assert_int_equal(stop_init(&m, stops, n), KV_OK);
    kv_buf out;
    kv_buf_init(&out);
    size_t len = strlen(text), i = 0;
    *stopped = false;
    while (i < len) {
        size_t k = step ? step : (size_t)kv_utf8_seq_len((unsigned char)text[i]);
        if (k > len - i) k = len - i;
        size_t before = out.len;
        kv_status st;
        bool s = stop_feed(&m, text + i, k, &out, &st);
        assert_int_equal(st, KV_OK);
        if (!step) assert_true(kv_utf8_valid(out.data + before, out.len - before));
        if (s) *stopped = true;
        i += k;
    }
    assert_int_equal(stop_flush(&m, &out), KV_OK);
    snprintf(res, sizeof res, "%s", kv_buf_cstr(&out));
    kv_buf_free(&out);
    stop_free(&m);
    return res;
}

static void test_no_stops(void **st) {
    (void)st;
    bool s;
    assert_string_equal(run(NULL, 0, "hello world", 3, &s), "hello world");
    assert_false(s);
    const char *empty[] = {""}; /* empty stop strings are ignored */
    assert_string_equal(run(empty, 1, "hello", 1, &s), "hello");
    assert_false(s);
}

static void test_split_across_deltas(void **st) {
    (void)st;
    const char *stops[] = {"\nUser:"};
    bool s;
    for (size_t step = 1; step <= 8; step++) {
        assert_string_equal(run(stops, 1, "Hello there\nUser: more text", step, &s), "Hello there");
        assert_true(s);
    }
    /* a near miss is released, not swallowed */
    assert_string_equal(run(stops, 1, "a\nUse b\nUs", 1, &s), "a\nUse b\nUs");
    assert_false(s);
    /* stop right at the start */
    assert_string_equal(run(stops, 1, "\nUser: x", 2, &s), "");
    assert_true(s);
}

static void test_hold_back_then_release(void **st) {
    (void)st;
    const char *stops[] = {"abc"};
    struct stop_matcher m;
    assert_int_equal(stop_init(&m, stops, 1), KV_OK);
    kv_buf out;
    kv_buf_init(&out);
    assert_false(stop_feed(&m, "xab", 3, &out, NULL));
    assert_int_equal(out.len, 1); /* "ab" held back */
    assert_memory_equal(out.data, "x", 1);
    assert_false(stop_feed(&m, "d", 1, &out, NULL));
    assert_string_equal(kv_buf_cstr(&out), "xabd");
    assert_false(stop_feed(&m, "a", 1, &out, NULL));
    assert_string_equal(kv_buf_cstr(&out), "xabd");
    assert_int_equal(stop_flush(&m, &out), KV_OK); /* end of stream: held text released */
    assert_string_equal(kv_buf_cstr(&out), "xabda");
    kv_buf_free(&out);
    stop_free(&m);
}

static void test_overlapping_stops(void **st) {
    (void)st;
    bool s;
    const char *a[] = {"bcd", "abcx"}; /* "abcx" pending keeps "abc" held; "bcd" completes */
    assert_string_equal(run(a, 2, "zabcd and more", 1, &s), "za");
    assert_true(s);
    const char *b[] = {"b", "ab"}; /* earliest start wins */
    assert_string_equal(run(b, 2, "xab", 1, &s), "x");
    assert_true(s);
    assert_string_equal(run(b, 2, "xab", 3, &s), "x");
    const char *c[] = {"aab"}; /* self-overlapping prefix */
    assert_string_equal(run(c, 1, "aaaab!", 1, &s), "aa");
    assert_true(s);
    /* after a stop, later input never leaks */
    struct stop_matcher m;
    stop_init(&m, c, 1);
    kv_buf out;
    kv_buf_init(&out);
    assert_true(stop_feed(&m, "qaab", 4, &out, NULL));
    assert_true(stop_feed(&m, "more", 4, &out, NULL));
    stop_flush(&m, &out);
    assert_string_equal(kv_buf_cstr(&out), "q");
    kv_buf_free(&out);
    stop_free(&m);
}

static void test_utf8(void **st) {
    (void)st;
    bool s;
    const char *a[] = {"é!"};
    assert_string_equal(run(a, 1, "café! au lait", 0, &s), "caf");
    assert_true(s);
    const char *b[] = {"日本"};
    assert_string_equal(run(b, 1, "今日は日本です", 0, &s), "今日は");
    assert_true(s);
    assert_string_equal(run(b, 1, "今日は日曜日", 0, &s), "今日は日曜日");
    assert_false(s);
    /* byte-wise feeding of multi-byte text still finds the stop */
    assert_string_equal(run(b, 1, "今日は日本です", 1, &s), "今日は");
    const char *c[] = {"éx"};
    assert_string_equal(run(c, 1, "aéyé", 0, &s), "aéyé");
    assert_false(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_stops),
        cmocka_unit_test(test_split_across_deltas),
        cmocka_unit_test(test_hold_back_then_release),
        cmocka_unit_test(test_overlapping_stops),
        cmocka_unit_test(test_utf8),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
