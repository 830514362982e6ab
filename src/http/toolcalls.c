/*
 * Tool calls in chat responses (gen.c): the output text goes through the model's tool-call
 * extraction (grammar/toolcall.c); calls become OpenAI `message.tool_calls` (non-stream) or
 * `delta.tool_calls` chunks (stream, one chunk per completed call with its whole arguments),
 * and a request that produced calls and ended with "stop" finishes with "tool_calls".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

/* "call_" + 24 alphanumerics, or 9 alphanumerics for Mistral (its templates require them). */
static void call_id(char *out, size_t cap, int fmt, kv_rng *rng) {
    static const char al[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    size_t o = 0;
    int n = 9;
    if (fmt != GRAM_TOOLS_MISTRAL) {
        o = (size_t)snprintf(out, cap, "call_");
        n = 24;
    }
    for (int i = 0; i < n && o + 1 < cap; i++) out[o++] = al[kv_rng_next(rng) % (sizeof al - 1)];
    out[o] = 0;
}

static json_t *call_json(const struct gram_tool_call *c, int index, bool with_index, int fmt, kv_rng *rng) {
    char id[40];
    call_id(id, sizeof id, fmt, rng);
    json_t *o = json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function", "function", "name", c->name,
                          "arguments", c->arguments);
    if (o && with_index) json_object_set_new(o, "index", json_integer(index));
    return o;
}

const char *tools_marker_text(const tokenizer_t *t, int fmt, int32_t id) {
    static const char *const hermes[] = {"<tool_call>", "</tool_call>", NULL};
    static const char *const mistral[] = {"[TOOL_CALLS]", NULL};
    static const char *const llama3[] = {"<|python_tag|>", NULL};
    if (!t || id < 0 || !tok_is_special(t, id)) return NULL;
    const char *s = tok_token_str(t, id);
    const char *const *m = fmt == GRAM_TOOLS_MISTRAL ? mistral : fmt == GRAM_TOOLS_LLAMA3_JSON ? llama3 : hermes;
    for (; s && *m; m++)
        if (!strcmp(s, *m)) return *m;
    return NULL;
}

const char *tools_finish_reason(const gram_tool_stream_t *ts, const char *fin) {
    return ts && gram_tool_stream_n_calls(ts) > 0 && fin && !strcmp(fin, "stop") ? "tool_calls" : fin;
}

kv_status tools_stream_event(gram_tool_stream_t *ts, kv_buf *out, const struct resp_meta *m, const char *text,
                             size_t len, json_t *lp, const char *fin, int fmt, int max_calls, kv_rng *rng) {
    kv_buf content;
    kv_buf_init(&content);
    struct gram_tool_call *calls = NULL, *more = NULL;
    int n = 0, n_more = 0, first = gram_tool_stream_n_calls(ts);
    kv_status st = gram_tool_stream_push(ts, text ? text : "", len, &content, &calls, &n);
    if (!st && fin) st = gram_tool_stream_finish(ts, &content, &more, &n_more);
    if (!st && (content.len || lp)) st = resp_chunk_sse(out, m, NULL, content.len ? content.data : NULL, content.len, lp, NULL);
    else json_decref(lp);
    for (int pass = 0; pass < 2 && !st; pass++) {
        struct gram_tool_call *c = pass ? more : calls;
        int k = pass ? n_more : n;
        if (max_calls > 0 && first + k > max_calls) k = max_calls > first ? max_calls - first : 0;
        if (!k) continue;
        json_t *arr = json_array();
        for (int i = 0; arr && i < k; i++) json_array_append_new(arr, call_json(&c[i], first++, true, fmt, rng));
        json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[{s:i, s:{s:o}, s:n, s:n}]}", "id", m->id, "object",
                              "chat.completion.chunk", "created", (json_int_t)m->created, "model", m->model, "choices",
                              "index", m->index, "delta", "tool_calls", arr, "logprobs", "finish_reason");
        char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        st = s ? kv_buf_printf(out, "data: %s\n\n", s) : KV_ENOMEM;
        free(s);
    }
    if (!st && fin) st = resp_chunk_sse(out, m, NULL, NULL, 0, NULL, tools_finish_reason(ts, fin));
    gram_tool_calls_free(calls, n);
    gram_tool_calls_free(more, n_more);
    kv_buf_free(&content);
    return st;
}

char *tools_rewrite_body(gram_tool_stream_t *ts, const char *body, int index, const char *text, size_t len,
                         int fmt, int max_calls, kv_rng *rng) {
    kv_buf content;
    kv_buf_init(&content);
    struct gram_tool_call *a = NULL, *b = NULL;
    int na = 0, nb = 0;
    char *out = NULL;
    json_t *o = NULL;
    if (gram_tool_stream_push(ts, text ? text : "", len, &content, &a, &na) ||
        gram_tool_stream_finish(ts, &content, &b, &nb))
        goto done;
    o = json_loads(body, JSON_ALLOW_NUL, NULL); /* the text may hold U+0000 (a <0x00> byte token) */
    json_t *ch = o ? json_array_get(json_object_get(o, "choices"), (size_t)index) : NULL;
    json_t *msg = ch ? json_object_get(ch, "message") : NULL;
    if (!msg) goto done;
    if (na + nb == 0) {
        out = kv_strdup(body);
        goto done;
    }
    json_t *arr = json_array();
    int idx = 0;
    for (int i = 0; arr && i < na + nb && (max_calls <= 0 || idx < max_calls); i++)
        json_array_append_new(arr, call_json(i < na ? &a[i] : &b[i - na], idx++, false, fmt, rng));
    json_object_set_new(msg, "content", content.len ? json_stringn(content.data, content.len) : json_null());
    json_object_set_new(msg, "tool_calls", arr);
    json_t *fin = json_object_get(ch, "finish_reason");
    if (json_is_string(fin) && !strcmp(json_string_value(fin), "stop"))
        json_object_set_new(ch, "finish_reason", json_string("tool_calls"));
    out = json_dumps(o, JSON_COMPACT);
done:
    json_decref(o);
    gram_tool_calls_free(a, na);
    gram_tool_calls_free(b, nb);
    kv_buf_free(&content);
    return out;
}
