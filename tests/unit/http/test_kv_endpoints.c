/* Unit tests of the /kv_events query parser and event JSON (src/http/kv_endpoints.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "http/kv_endpoints.h"

static void test_query(void **state) {
    (void)state;
    struct kvapi_query q;
    char err[128];
    assert_int_equal(kvapi_parse_query(NULL, &q, err, sizeof err), KV_OK);
    assert_false(q.poll);
    assert_false(q.has_after);
    assert_int_equal(q.max, 256);
    assert_int_equal(kvapi_parse_query("after=18446744073709551615&max=1024&poll=1", &q, err, sizeof err), KV_OK);
    assert_true(q.poll && q.has_after);
    assert_true(q.after == UINT64_MAX);
    assert_int_equal(q.max, 1024);
    assert_int_equal(kvapi_parse_query("poll=false&after=0", &q, err, sizeof err), KV_OK);
    assert_false(q.poll);
    assert_true(q.has_after && q.after == 0);
    static const char *const bad[] = {"after=-1", "after=x", "after=", "after=18446744073709551616",
                                      "max=0", "max=1025", "max=2.5", "poll=yes", "after=+3"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        assert_int_equal(kvapi_parse_query(bad[i], &q, err, sizeof err), KV_EINVAL);
        assert_true(strlen(err) > 0);
    }
    uint64_t v;
    assert_true(kvapi_parse_u64("42", &v) && v == 42);
    assert_false(kvapi_parse_u64(" 42", &v));
    assert_false(kvapi_parse_u64("42 ", &v));
}

static void test_event_json(void **state) {
    (void)state;
    int32_t toks[3] = {1, 403, 407};
    struct engine_kv_event ev;
    memset(&ev, 0, sizeof ev);
    ev.seq = 7;
    ev.type = ENGINE_KV_STORED;
    memset(ev.hash.b, 0xab, sizeof ev.hash.b);
    memset(ev.parent_hash.b, 0x01, sizeof ev.parent_hash.b);
    ev.parent_is_root = true;
    ev.n_tokens = 3;
    ev.tokens = toks;
    json_t *o = kvapi_event_json(&ev, "00000000000000ff");
    assert_non_null(o);
    assert_int_equal(json_integer_value(json_object_get(o, "seq")), 7);
    assert_string_equal(json_string_value(json_object_get(o, "type")), "stored");
    assert_string_equal(json_string_value(json_object_get(o, "worker_id")), "00000000000000ff");
    const char *h = json_string_value(json_object_get(o, "block_hash"));
    assert_int_equal(strlen(h), 64);
    assert_memory_equal(h, "abababab", 8);
    assert_memory_equal(json_string_value(json_object_get(o, "parent_hash")), "0101", 4);
    assert_true(json_is_true(json_object_get(o, "parent_is_root")));
    json_t *t = json_object_get(o, "tokens");
    assert_int_equal(json_array_size(t), 3);
    assert_int_equal(json_integer_value(json_array_get(t, 1)), 403);
    json_decref(o);
    ev.type = ENGINE_KV_REMOVED;
    o = kvapi_event_json(&ev, NULL);
    assert_string_equal(json_string_value(json_object_get(o, "type")), "removed");
    assert_null(json_object_get(o, "worker_id"));
    assert_null(json_object_get(o, "tokens"));
    assert_null(json_object_get(o, "parent_hash"));
    assert_non_null(json_object_get(o, "block_hash"));
    json_decref(o);
    ev.type = ENGINE_KV_TIER;
    ev.host = true;
    o = kvapi_event_json(&ev, NULL);
    assert_string_equal(json_string_value(json_object_get(o, "type")), "tier");
    assert_string_equal(json_string_value(json_object_get(o, "tier")), "host");
    assert_non_null(json_object_get(o, "block_hash"));
    assert_null(json_object_get(o, "tokens"));
    json_decref(o);
    ev.host = false;
    o = kvapi_event_json(&ev, NULL);
    assert_string_equal(json_string_value(json_object_get(o, "tier")), "device");
    json_decref(o);
    ev.type = ENGINE_KV_CLEARED;
    o = kvapi_event_json(&ev, NULL);
    assert_string_equal(json_string_value(json_object_get(o, "type")), "cleared");
    assert_null(json_object_get(o, "block_hash"));
    json_decref(o);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_query),
        cmocka_unit_test(test_event_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
