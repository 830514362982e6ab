/* legs: the JSON of the router's legs (docs/disaggregation.md wire format) and the SSE helpers
 * (router_internal.h). Inputs are never modified; results are new references. */
#include <stdlib.h>
#include <string.h>

#include "router_internal.h"

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

json_t *rt_client_base(const json_t *client, char **conv_id) {
    *conv_id = NULL;
    json_t *c = json_deep_copy(client);
    if (!c) return NULL;
    const json_t *dp = json_object_get(client, "disaggregated_params");
    const json_t *cv = json_object_get(dp, "conversation_id");
    if (!json_is_string(cv)) cv = json_object_get(client, "conversation_id");
    if (json_is_string(cv)) *conv_id = dup_str(json_string_value(cv));
    json_object_del(c, "disaggregated_params");
    return c;
}

static int set_conv(json_t *dp, const char *conv_id) {
    return json_object_set_new(dp, "conversation_id", conv_id ? json_string(conv_id) : json_null());
}

json_t *rt_context_leg(const json_t *base, uint64_t id, const char *style, const char *conv_id) {
    json_t *c = json_deep_copy(base);
    json_t *dp = json_object();
    if (!c || !dp) goto fail;
    int bad = json_object_set_new(c, "stream", json_false());
    json_object_del(c, "stream_options");
    bad |= json_object_set_new(dp, "request_type", json_string("context_only"));
    bad |= json_object_set_new(dp, "disagg_request_id", json_integer((json_int_t)id));
    bad |= json_object_set_new(dp, "schedule_style", json_string(style));
    bad |= set_conv(dp, conv_id);
    bad |= json_object_set_new(c, "disaggregated_params", dp);
    dp = NULL;
    if (bad) goto fail;
    return c;
fail:
    json_decref(dp);
    json_decref(c);
    return NULL;
}

static const json_t *only_choice(const json_t *resp) {
    const json_t *ch = json_object_get(resp, "choices");
    if (!json_is_array(ch) || json_array_size(ch) != 1) return NULL;
    const json_t *c = json_array_get(ch, 0);
    return json_is_object(c) ? c : NULL;
}

const json_t *rt_context_check(const json_t *resp, char *err, size_t errlen) {
    if (!json_is_object(resp)) {
        kv_errf(KV_EINVAL, err, errlen, "the context response is not a JSON object");
        return NULL;
    }
    const json_t *ch = json_object_get(resp, "choices");
    if (!json_is_array(ch) || json_array_size(ch) != 1) {
        kv_errf(KV_EINVAL, err, errlen, "the context response must have exactly one choice (has %zu)",
                json_is_array(ch) ? json_array_size(ch) : (size_t)0);
        return NULL;
    }
    const json_t *dp = json_object_get(json_array_get(ch, 0), "disaggregated_params");
    if (!json_is_object(dp)) {
        kv_errf(KV_EINVAL, err, errlen, "the context response has no disaggregated_params");
        return NULL;
    }
    const json_t *a = json_object_get(dp, "ctx_request_id"), *b = json_object_get(dp, "disagg_request_id");
    if (!a || json_is_null(a) || !b || json_is_null(b)) {
        kv_errf(KV_EINVAL, err, errlen,
                "the context response's disaggregated_params lack ctx_request_id or disagg_request_id");
        return NULL;
    }
    return dp;
}

bool rt_context_finished(const json_t *resp, const json_t *client) {
    const json_t *c = only_choice(resp);
    const char *fr = json_string_value(json_object_get(c, "finish_reason"));
    if (!fr || !strcmp(fr, "not_finished")) return false;
    /* kvserve's context worker says whether it kept the KV for a generation leg; without the
     * field (another peer) a "length" ends the request only when max_tokens was reached */
    const json_t *off = json_object_get(json_object_get(c, "disaggregated_params"), "kv_offered");
    if (json_is_boolean(off)) return !json_is_true(off);
    if (strcmp(fr, "length") != 0) return true;
    const json_t *mt = json_object_get(client, "max_completion_tokens");
    if (!json_is_integer(mt)) mt = json_object_get(client, "max_tokens");
    if (!json_is_integer(mt)) return false;
    const json_t *ct = json_object_get(json_object_get(resp, "usage"), "completion_tokens");
    json_int_t done = json_is_integer(ct) ? json_integer_value(ct) : 1;
    return done >= json_integer_value(mt);
}

json_t *rt_generation_leg(const json_t *base, const json_t *ctx_params, const char *conv_id) {
    json_t *c = json_deep_copy(base);
    json_t *dp = json_deep_copy(ctx_params);
    if (!c || !dp) goto fail;
    int bad = json_object_set_new(dp, "request_type", json_string("generation_only"));
    if (conv_id || !json_object_get(dp, "conversation_id")) bad |= set_conv(dp, conv_id);
    bad |= json_object_set_new(c, "disaggregated_params", dp);
    dp = NULL;
    if (bad) goto fail;
    return c;
fail:
    json_decref(dp);
    json_decref(c);
    return NULL;
}

json_t *rt_generation_first_leg(const json_t *base, uint64_t id, const char *ctx_endpoint,
                                const char *conv_id) {
    json_t *c = json_deep_copy(base);
    json_t *dp = json_object();
    if (!c || !dp) goto fail;
    int bad = json_object_set_new(dp, "request_type", json_string("generation_only"));
    bad |= json_object_set_new(dp, "schedule_style", json_string("generation_first"));
    bad |= json_object_set_new(dp, "disagg_request_id", json_integer((json_int_t)id));
    bad |= json_object_set_new(dp, "ctx_request_id", json_integer((json_int_t)id));
    bad |= json_object_set_new(dp, "ctx_info_endpoint", ctx_endpoint ? json_string(ctx_endpoint) : json_null());
    bad |= set_conv(dp, conv_id);
    bad |= json_object_set_new(c, "disaggregated_params", dp);
    dp = NULL;
    if (bad) goto fail;
    return c;
fail:
    json_decref(dp);
    json_decref(c);
    return NULL;
}

const char *rt_server_info_endpoint(const json_t *info) {
    const json_t *e = json_object_get(json_object_get(info, "disaggregated_params"), "ctx_info_endpoint");
    if (json_is_array(e)) e = json_array_get(e, 0);
    const char *s = json_string_value(e);
    return s && *s ? s : NULL;
}

json_t *rt_strip_disagg(const json_t *resp) {
    json_t *c = json_deep_copy(resp);
    if (!c) return NULL;
    size_t i;
    json_t *ch;
    json_array_foreach(json_object_get(c, "choices"), i, ch) json_object_del(ch, "disaggregated_params");
    return c;
}

/* data: <o>\n\n (steals o) */
static kv_status add_event(kv_buf *out, json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return KV_ENOMEM;
    kv_status st = kv_buf_printf(out, "data: %s\n\n", s);
    free(s);
    return st;
}

/* A chunk with the response's id/created/model and one choice (stolen). */
static json_t *chunk_of(const json_t *resp, bool chat, json_t *choice) {
    json_t *o = json_object();
    if (!o) {
        json_decref(choice);
        return NULL;
    }
    const char *keys[] = {"id", "created", "model", "system_fingerprint"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        json_t *v = json_object_get(resp, keys[i]);
        if (v) json_object_set(o, keys[i], v);
    }
    json_object_set_new(o, "object", json_string(chat ? "chat.completion.chunk" : "text_completion"));
    json_t *arr = json_array();
    if (choice) json_array_append_new(arr, choice);
    json_object_set_new(o, "choices", arr);
    return o;
}

kv_status rt_response_to_sse(const json_t *resp, bool chat, bool include_usage, kv_buf *out) {
    const json_t *chs = json_object_get(resp, "choices");
    if (!json_is_array(chs)) return KV_EINVAL;
    kv_status st = KV_OK;
    size_t i;
    const json_t *c;
    json_array_foreach(chs, i, c) {
        json_t *idx = json_object_get(c, "index");
        json_t *fr = json_object_get(c, "finish_reason");
        json_t *lp = json_object_get(c, "logprobs");
        if (chat) {
            const json_t *msg = json_object_get(c, "message");
            json_t *delta = json_object();
            json_object_set_new(delta, "role", json_string("assistant"));
            const char *keys[] = {"content", "reasoning_content", "tool_calls"};
            for (size_t k = 0; k < 3; k++) {
                json_t *v = json_object_get(msg, keys[k]);
                if (v && !json_is_null(v)) json_object_set(delta, keys[k], v);
            }
            json_t *ch1 = json_pack("{s:O?, s:o, s:O?, s:n}", "index", idx, "delta", delta, "logprobs", lp,
                                    "finish_reason");
            st |= add_event(out, chunk_of(resp, chat, ch1));
            json_t *ch2 = json_pack("{s:O?, s:{}, s:n, s:O?}", "index", idx, "delta", "logprobs",
                                    "finish_reason", fr);
            st |= add_event(out, chunk_of(resp, chat, ch2));
        } else {
            json_t *ch1 = json_pack("{s:O?, s:O?, s:O?, s:O?}", "index", idx, "text",
                                    json_object_get(c, "text"), "logprobs", lp, "finish_reason", fr);
            st |= add_event(out, chunk_of(resp, chat, ch1));
        }
    }
    json_t *u = json_object_get(resp, "usage");
    if (include_usage && u) {
        json_t *o = chunk_of(resp, chat, NULL);
        if (o) json_object_set(o, "usage", u);
        st |= add_event(out, o);
    }
    st |= kv_buf_puts(out, "data: [DONE]\n\n");
    return st ? KV_ENOMEM : KV_OK;
}

bool rt_probe_local(const json_t *probe, long max_local) {
    const json_t *p = json_object_get(probe, "prompt_tokens"), *c = json_object_get(probe, "cached_tokens");
    if (!json_is_integer(p) || !json_is_integer(c) || max_local < 0) return false;
    /* spec §3: a context leg is needed iff nothing is cached or the uncached tail is too long */
    if (json_integer_value(c) <= 0) return false;
    json_int_t need = json_integer_value(p) - json_integer_value(c);
    return need <= (json_int_t)max_local;
}

char *rt_error_json(const char *type, const char *code, const char *msg) {
    json_t *o = json_pack("{s:{s:s, s:s, s:n, s:s?}}", "error", "message", msg ? msg : "",
                          "type", type ? type : "server_error", "param", "code", code);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

size_t rt_sse_complete(const char *buf, size_t len) {
    size_t end = 0;
    for (size_t i = 0; i + 1 < len; i++) {
        if (buf[i] == '\n' && buf[i + 1] == '\n') end = i + 2;
        else if (i + 3 < len && buf[i] == '\r' && buf[i + 1] == '\n' && buf[i + 2] == '\r' &&
                 buf[i + 3] == '\n')
            end = i + 4;
    }
    return end;
}

bool rt_sse_has_done(const char *buf, size_t len) {
    static const char pat[] = "data: [DONE]";
    size_t n = sizeof pat - 1;
    for (size_t i = 0; i + n <= len; i++)
        if ((i == 0 || buf[i - 1] == '\n') && memcmp(buf + i, pat, n) == 0) return true;
    return false;
}
