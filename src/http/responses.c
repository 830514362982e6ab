/* OpenAI response bodies: full JSON, SSE chunks, logprobs, error objects. */
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "http_internal.h"

/* A logprob as JSON: JSON has no NaN or infinity (jansson's json_real refuses them), so -inf
 * becomes -9999.0 (vLLM's clamp) and NaN (a model whose logits overflowed) becomes null; the
 * arrays keep one entry per token either way. */
static json_t *lp_json(float v) {
    if (isnan(v)) return json_null();
    if (isinf(v)) return json_real(v < 0 ? -9999.0 : 9999.0);
    return json_real((double)v);
}

/* s as valid UTF-8 into out (cap bytes, NUL-terminated): a byte that does not start a valid
 * sequence becomes the text \xNN. Error messages quote client input (a path, a parameter
 * name) and may cut a character; jansson refuses invalid UTF-8 (the answer was {}). */
static const char *utf8_clean(const char *s, char *out, size_t cap) {
    size_t o = 0, n = strlen(s);
    for (size_t i = 0; i < n && o + 5 < cap;) {
        int l = kv_utf8_seq_len((unsigned char)s[i]);
        if (l > 0 && i + (size_t)l <= n && kv_utf8_valid(s + i, (size_t)l)) {
            if (o + (size_t)l + 1 > cap) break;
            memcpy(out + o, s + i, (size_t)l);
            o += (size_t)l;
            i += (size_t)l;
        } else {
            o += (size_t)snprintf(out + o, cap - o, "\\x%02X", (unsigned char)s[i]);
            i++;
        }
    }
    out[o] = 0;
    return out;
}

static json_t *error_obj(const struct oai_error *e) {
    char msg[4 * sizeof e->message + 8], param[4 * sizeof e->param + 8];
    return json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message",
                     utf8_clean(e->message, msg, sizeof msg), "type",
                     e->type ? e->type : "invalid_request_error", "param",
                     e->param[0] ? json_string(utf8_clean(e->param, param, sizeof param)) : json_null(),
                     "code", e->code ? json_string(e->code) : json_null());
}

char *resp_error_json(const struct oai_error *e) {
    json_t *o = error_obj(e);
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* A token's text for logprobs: raw bytes when valid UTF-8, else "bytes:\xNN..." (as OpenAI).
 * bytes_out receives the raw bytes as a JSON array. */
static json_t *token_json_str(const tokenizer_t *t, int id, bool as_ids, json_t **bytes_out) {
    char buf[256];
    int n = t ? tok_token_bytes(t, id, buf, sizeof buf) : -1;
    if (n < 0) n = 0;
    if (bytes_out) {
        *bytes_out = json_array();
        for (int i = 0; i < n; i++) json_array_append_new(*bytes_out, json_integer((unsigned char)buf[i]));
    }
    char s[1100];
    if (as_ids) {
        snprintf(s, sizeof s, "token_id:%d", id);
        return json_string(s);
    }
    if (kv_utf8_valid(buf, (size_t)n)) return json_stringn(buf, (size_t)n);
    size_t o = (size_t)snprintf(s, sizeof s, "bytes:");
    for (int i = 0; i < n && o + 5 < sizeof s; i++)
        o += (size_t)snprintf(s + o, sizeof s - o, "\\x%02x", (unsigned char)buf[i]);
    return json_string(s);
}

json_t *resp_logprobs_new(enum oai_kind kind) {
    if (kind == OAI_CHAT) return json_pack("{s:[]}", "content");
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs",
                     "text_offset");
}

void resp_logprobs_append(json_t *acc, enum oai_kind kind, const tokenizer_t *t, bool as_ids,
                          const struct token_logprob *lp, const struct token_logprob *top,
                          int n, int n_top, size_t *offset) {
    if (!acc || !lp) return;
    for (int i = 0; i < n; i++) {
        if (kind == OAI_CHAT) {
            json_t *bytes = NULL;
            json_t *tok = token_json_str(t, lp[i].id, as_ids, &bytes);
            json_t *tops = json_array();
            for (int j = 0; top && j < n_top; j++) {
                const struct token_logprob *a = &top[(size_t)i * n_top + j];
                json_t *ab = NULL;
                json_t *at = token_json_str(t, a->id, as_ids, &ab);
                json_array_append_new(tops, json_pack("{s:o, s:o, s:o}", "token", at, "logprob",
                                                      lp_json(a->logprob), "bytes", ab));
            }
            json_array_append_new(json_object_get(acc, "content"),
                                  json_pack("{s:o, s:o, s:o, s:o}", "token", tok, "logprob",
                                            lp_json(lp[i].logprob), "bytes", bytes,
                                            "top_logprobs", tops));
        } else {
            json_t *bytes = NULL;
            json_t *tok = token_json_str(t, lp[i].id, as_ids, &bytes);
            size_t nb = json_array_size(bytes);
            json_decref(bytes);
            json_array_append_new(json_object_get(acc, "tokens"), tok);
            json_array_append_new(json_object_get(acc, "token_logprobs"),
                                  lp_json(lp[i].logprob));
            json_array_append_new(json_object_get(acc, "text_offset"),
                                  json_integer((json_int_t)(offset ? *offset : 0)));
            /* special tokens (BOS, EOS...) are not in the returned text: they take no room */
            if (offset && !(t && tok_is_special(t, lp[i].id))) *offset += nb;
            /* the alternatives plus the sampled token (OpenAI: "up to logprobs+1 elements";
             * vLLM): logprobs 0 gives {sampled: logprob}, never {} */
            json_t *tops = json_object();
            for (int j = 0; j <= n_top; j++) {
                const struct token_logprob *a = j < n_top ? (top ? &top[(size_t)i * n_top + j] : NULL) : &lp[i];
                if (!a) continue;
                json_t *at = token_json_str(t, a->id, as_ids, NULL);
                if (json_is_string(at) && !json_object_get(tops, json_string_value(at)))
                    json_object_set_new(tops, json_string_value(at), lp_json(a->logprob));
                json_decref(at);
            }
            json_array_append_new(json_object_get(acc, "top_logprobs"), tops);
        }
    }
}

static json_t *usage_obj(const struct resp_usage *u) {
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", u->prompt_tokens,
                     "completion_tokens", u->completion_tokens, "total_tokens",
                     u->prompt_tokens + u->completion_tokens, "prompt_tokens_details",
                     "cached_tokens", u->cached_tokens);
}

static json_t *head(const struct resp_meta *m, const char *object) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", m->id, "object", object, "created",
                     (json_int_t)m->created, "model", m->model);
}

static json_t *choice_obj(const struct resp_meta *m, int index, const char *text, size_t text_len,
                          json_t *logprobs, const char *finish) {
    bool chat = m->kind == OAI_CHAT;
    json_t *choice = json_pack("{s:i}", "index", index);
    json_t *content = json_stringn(text ? text : "", text ? text_len : 0);
    if (!content) content = json_string(""); /* cannot happen: engine text is valid UTF-8 */
    if (chat)
        json_object_set_new(choice, "message",
                            json_pack("{s:s, s:o}", "role", "assistant", "content", content));
    else
        json_object_set_new(choice, "text", content);
    json_object_set_new(choice, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    return choice;
}

char *resp_full_json(const struct resp_meta *m, const char *text, size_t text_len,
                     json_t *logprobs, const char *finish, const struct resp_usage *u) {
    struct resp_choice c = {text, text_len, logprobs, finish};
    return resp_full_json_n(m, &c, 1, u);
}

char *resp_full_json_n(const struct resp_meta *m, const struct resp_choice *ch, int n,
                       const struct resp_usage *u) {
    json_t *o = head(m, m->kind == OAI_CHAT ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(choices, choice_obj(m, i, ch[i].text, ch[i].text_len, ch[i].logprobs,
                                                  ch[i].finish));
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", usage_obj(u));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static kv_status append_sse(kv_buf *out, json_t *o) {
    if (!o) return KV_ENOMEM;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return KV_ENOMEM;
    kv_status st = kv_buf_printf(out, "data: %s\n\n", s);
    free(s);
    return st;
}

kv_status resp_chunk_sse(kv_buf *out, const struct resp_meta *m, const char *role,
                         const char *text, size_t text_len, json_t *logprobs, const char *finish) {
    bool chat = m->kind == OAI_CHAT;
    json_t *o = head(m, chat ? "chat.completion.chunk" : "text_completion");
    json_t *choice = json_pack("{s:i}", "index", m->index);
    if (chat) {
        json_t *delta = json_object();
        if (role) json_object_set_new(delta, "role", json_string(role));
        if (text) json_object_set_new(delta, "content", json_stringn(text, text_len));
        json_object_set_new(choice, "delta", delta);
    } else {
        json_object_set_new(choice, "text", json_stringn(text ? text : "", text ? text_len : 0));
    }
    json_object_set_new(choice, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    json_object_set_new(o, "choices", json_pack("[o]", choice));
    return append_sse(out, o);
}

kv_status resp_usage_sse(kv_buf *out, const struct resp_meta *m, const struct resp_usage *u) {
    json_t *o = head(m, m->kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion");
    json_object_set_new(o, "choices", json_array());
    json_object_set_new(o, "usage", usage_obj(u));
    return append_sse(out, o);
}

kv_status resp_error_sse(kv_buf *out, const struct oai_error *e) {
    return append_sse(out, error_obj(e));
}
