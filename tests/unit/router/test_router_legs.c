/* router legs unit tests: the JSON of context / generation legs (docs/disaggregation.md), the
 * context-response checks (spec §3 step 4/5), SSE conversion and re-framing, probe decisions. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "router/router_internal.h"

static json_t *J(const char *s) {
    json_error_t e;
    json_t *j = json_loads(s, 0, &e);
    if (!j) fail_msg("bad test JSON: %s", e.text);
    return j;
}

static void test_context_leg(void **st) {
    (void)st;
    json_t *client = J("{\"prompt\":\"hi\",\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                       "\"max_tokens\":5,\"disaggregated_params\":{\"conversation_id\":\"c1\","
                       "\"request_type\":\"bogus\"}}");
    char *conv = NULL;
    json_t *base = rt_client_base(client, &conv);
    assert_non_null(base);
    assert_string_equal(conv, "c1");
    assert_null(json_object_get(base, "disaggregated_params"));
    assert_non_null(json_object_get(client, "disaggregated_params")); /* input untouched */
    json_t *leg = rt_context_leg(base, 12345, "context_first", conv);
    assert_true(json_is_false(json_object_get(leg, "stream")));
    assert_null(json_object_get(leg, "stream_options"));
    assert_int_equal(json_integer_value(json_object_get(leg, "max_tokens")), 5);
    json_t *dp = json_object_get(leg, "disaggregated_params");
    assert_string_equal(json_string_value(json_object_get(dp, "request_type")), "context_only");
    assert_int_equal(json_integer_value(json_object_get(dp, "disagg_request_id")), 12345);
    assert_string_equal(json_string_value(json_object_get(dp, "schedule_style")), "context_first");
    assert_string_equal(json_string_value(json_object_get(dp, "conversation_id")), "c1");
    assert_true(json_is_true(json_object_get(base, "stream"))); /* base untouched */
    json_decref(leg);
    /* no conversation id -> null */
    leg = rt_context_leg(base, 1, "generation_first", NULL);
    assert_true(json_is_null(json_object_get(json_object_get(leg, "disaggregated_params"), "conversation_id")));
    json_decref(leg);
    json_decref(base);
    json_decref(client);
    free(conv);
}

static const char *CTX_OK =
    "{\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"A\","
    "\"finish_reason\":\"not_finished\",\"disaggregated_params\":{\"request_type\":\"context_only\","
    "\"disagg_request_id\":9,\"ctx_request_id\":77,\"first_gen_tokens\":[5],\"prompt_token_ids\":[1,2],"
    "\"ctx_info_endpoint\":\"h:1\",\"schedule_style\":\"context_first\"}}],"
    "\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}";

static void test_context_check(void **st) {
    (void)st;
    char err[256];
    json_t *ok = J(CTX_OK);
    assert_non_null(rt_context_check(ok, err, sizeof err));
    const char *bad[] = {
        "[]",
        "{\"choices\":[]}",
        "{\"choices\":[{\"disaggregated_params\":{\"ctx_request_id\":1,\"disagg_request_id\":2}},{}]}",
        "{\"choices\":[{\"text\":\"x\"}]}",
        "{\"choices\":[{\"disaggregated_params\":{\"ctx_request_id\":null,\"disagg_request_id\":2}}]}",
        "{\"choices\":[{\"disaggregated_params\":{\"ctx_request_id\":1}}]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *b = J(bad[i]);
        err[0] = 0;
        assert_null(rt_context_check(b, err, sizeof err));
        assert_true(strlen(err) > 0);
        json_decref(b);
    }
    /* finished? */
    json_t *client = J("{\"prompt\":\"x\",\"max_tokens\":4}");
    assert_false(rt_context_finished(ok, client));
    json_object_set_new(json_array_get(json_object_get(ok, "choices"), 0), "finish_reason", json_string("stop"));
    assert_true(rt_context_finished(ok, client));
    json_object_set_new(json_array_get(json_object_get(ok, "choices"), 0), "finish_reason", json_string("length"));
    assert_false(rt_context_finished(ok, client)); /* 1 of 4 tokens: the generation leg goes on */
    json_t *one = J("{\"prompt\":\"x\",\"max_tokens\":1}");
    assert_true(rt_context_finished(ok, one));     /* max_tokens reached at the first token */
    json_decref(one);
    json_decref(client);
    json_decref(ok);
}

static void test_generation_legs(void **st) {
    (void)st;
    json_t *ok = J(CTX_OK);
    json_t *base = J("{\"prompt\":\"hi\",\"stream\":true,\"max_tokens\":4}");
    char err[128];
    const json_t *dp = rt_context_check(ok, err, sizeof err);
    json_t *g = rt_generation_leg(base, dp, "conv");
    json_t *gdp = json_object_get(g, "disaggregated_params");
    assert_string_equal(json_string_value(json_object_get(gdp, "request_type")), "generation_only");
    assert_int_equal(json_integer_value(json_object_get(gdp, "disagg_request_id")), 9);
    assert_int_equal(json_integer_value(json_object_get(gdp, "ctx_request_id")), 77);
    assert_int_equal(json_array_size(json_object_get(gdp, "prompt_token_ids")), 2);
    assert_string_equal(json_string_value(json_object_get(gdp, "conversation_id")), "conv");
    assert_true(json_is_true(json_object_get(g, "stream")));
    assert_string_equal(json_string_value(json_object_get(dp, "request_type")), "context_only");
    json_decref(g);
    g = rt_generation_first_leg(base, 42, "h:9", NULL);
    gdp = json_object_get(g, "disaggregated_params");
    assert_string_equal(json_string_value(json_object_get(gdp, "schedule_style")), "generation_first");
    assert_int_equal(json_integer_value(json_object_get(gdp, "disagg_request_id")), 42);
    assert_int_equal(json_integer_value(json_object_get(gdp, "ctx_request_id")), 42);
    assert_string_equal(json_string_value(json_object_get(gdp, "ctx_info_endpoint")), "h:9");
    json_decref(g);
    json_t *info = J("{\"disaggregated_params\":{\"ctx_info_endpoint\":[\"a:1\",\"b:2\"]}}");
    assert_string_equal(rt_server_info_endpoint(info), "a:1");
    json_decref(info);
    info = J("{\"role\":\"context\"}");
    assert_null(rt_server_info_endpoint(info));
    json_decref(info);
    json_decref(base);
    json_decref(ok);
}

static void test_response_to_sse(void **st) {
    (void)st;
    json_t *ok = J(CTX_OK);
    json_t *clean = rt_strip_disagg(ok);
    assert_null(json_object_get(json_array_get(json_object_get(clean, "choices"), 0), "disaggregated_params"));
    kv_buf b;
    kv_buf_init(&b);
    assert_int_equal(rt_response_to_sse(clean, false, true, &b), KV_OK);
    const char *s = kv_buf_cstr(&b);
    assert_non_null(strstr(s, "\"text\":\"A\""));
    assert_non_null(strstr(s, "\"object\":\"text_completion\""));
    assert_non_null(strstr(s, "\"usage\""));
    assert_true(b.len > 14 && !strcmp(s + b.len - 14, "data: [DONE]\n\n"));
    assert_int_equal(rt_sse_complete(b.data, b.len), b.len);
    kv_buf_free(&b);
    json_t *chat = J("{\"id\":\"x\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\","
                     "\"content\":\"hey\"},\"finish_reason\":\"stop\"}]}");
    kv_buf_init(&b);
    assert_int_equal(rt_response_to_sse(chat, true, false, &b), KV_OK);
    s = kv_buf_cstr(&b);
    assert_non_null(strstr(s, "\"delta\":{\"role\":\"assistant\",\"content\":\"hey\"}"));
    assert_non_null(strstr(s, "\"finish_reason\":\"stop\""));
    assert_null(strstr(s, "usage"));
    kv_buf_free(&b);
    json_t *notresp = J("{\"a\":1}");
    kv_buf_init(&b);
    assert_int_equal(rt_response_to_sse(notresp, false, false, &b), KV_EINVAL);
    kv_buf_free(&b);
    json_decref(notresp);
    json_decref(chat);
    json_decref(clean);
    json_decref(ok);
}

static void test_sse_framing(void **st) {
    (void)st;
    const char *s = "data: {\"a\":1}\n\ndata: {\"b\"";
    assert_int_equal(rt_sse_complete(s, strlen(s)), 15);
    assert_int_equal(rt_sse_complete("data: x\n", 8), 0);
    assert_int_equal(rt_sse_complete("data: x\r\n\r\n", 11), 11);
    assert_true(rt_sse_has_done("data: 1\n\ndata: [DONE]\n\n", 23));
    assert_false(rt_sse_has_done("data: {\"t\":\"data: [DONE]\"}\n\n", 28));
}

static void test_probe(void **st) {
    (void)st;
    json_t *p = J("{\"prompt_tokens\":100,\"cached_tokens\":90}");
    assert_true(rt_probe_local(p, 10));
    assert_false(rt_probe_local(p, 9));
    assert_false(rt_probe_local(p, -1));
    json_decref(p);
    p = J("{\"prompt_tokens\":5,\"cached_tokens\":0}"); /* nothing cached: disaggregate (spec §3) */
    assert_false(rt_probe_local(p, 1000));
    json_decref(p);
    p = J("{\"prompt_tokens\":\"x\"}");
    assert_false(rt_probe_local(p, 1000));
    json_decref(p);
    assert_false(rt_probe_local(NULL, 1000));
    char *e = rt_error_json("server_error", NULL, "boom \"q\"");
    json_t *ej = J(e);
    assert_string_equal(json_string_value(json_object_get(json_object_get(ej, "error"), "message")), "boom \"q\"");
    assert_true(json_is_null(json_object_get(json_object_get(ej, "error"), "param")));
    json_decref(ej);
    free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_context_leg),      cmocka_unit_test(test_context_check),
        cmocka_unit_test(test_generation_legs),  cmocka_unit_test(test_response_to_sse),
        cmocka_unit_test(test_sse_framing),      cmocka_unit_test(test_probe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
