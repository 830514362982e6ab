/* OpenAI request parsing and validation (no engine/tokenizer symbols: see http_internal.h). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

#define INVALID "invalid_request_error"

kv_status oai_errf(struct oai_error *e, int status, const char *type, const char *param,
                   const char *code, const char *fmt, ...) {
    if (!e) return KV_EINVAL;
    e->status = status;
    e->type = type;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return KV_EINVAL;
}

#define BAD(param, ...) oai_errf(err, 400, INVALID, param, NULL, __VA_ARGS__)

/* Field present and not null. */
static json_t *field(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return (v && !json_is_null(v)) ? v : NULL;
}

static kv_status get_bool(json_t *o, const char *k, bool *out, struct oai_error *err) {
    json_t *v = field(o, k);
    if (!v) return KV_OK;
    if (!json_is_boolean(v)) return BAD(k, "'%s' must be a boolean", k);
    *out = json_is_true(v);
    return KV_OK;
}

/* Integer (or a real with an integral value) within [lo, hi]. */
static kv_status get_int(json_t *o, const char *k, int64_t lo, int64_t hi, bool *present,
                         int64_t *out, struct oai_error *err) {
    json_t *v = field(o, k);
    if (present) *present = v != NULL;
    if (!v) return KV_OK;
    int64_t x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v)) {
        double d = json_real_value(v);
        if (!isfinite(d) || d != floor(d) || d < -9.2e18 || d > 9.2e18)
            return BAD(k, "'%s' must be an integer", k);
        x = (int64_t)d;
    } else {
        return BAD(k, "'%s' must be an integer", k);
    }
    if (x < lo || x > hi)
        return BAD(k, "'%s' must be between %lld and %lld, got %lld", k, (long long)lo,
                   (long long)hi, (long long)x);
    *out = x;
    return KV_OK;
}

/* Number within [lo, hi] (lo_open: lo excluded). */
static kv_status get_num(json_t *o, const char *k, double lo, bool lo_open, double hi, float *out,
                         struct oai_error *err) {
    json_t *v = field(o, k);
    if (!v) return KV_OK;
    if (!json_is_number(v)) return BAD(k, "'%s' must be a number", k);
    double d = json_number_value(v);
    float f = (float)d; /* judged after the conversion: 1e-300 is > 0 but (float) 0 */
    if (!isfinite(d) || d > hi || (lo_open ? d <= lo || f <= lo : d < lo))
        return BAD(k, "'%s' must be in %s%g, %g], got %g", k, lo_open ? "(" : "[", lo, hi, d);
    *out = f;
    return KV_OK;
}

json_t *oai_field(json_t *o, const char *k) { return field(o, k); }
kv_status oai_get_int(json_t *o, const char *k, int64_t lo, int64_t hi, bool *present,
                      int64_t *out, struct oai_error *err) {
    return get_int(o, k, lo, hi, present, out, err);
}

static kv_status parse_ids(json_t *arr, const char *param, const struct oai_limits *lim,
                           int32_t **out, size_t *n, struct oai_error *err) {
    size_t cnt = json_array_size(arr);
    int32_t *ids = kv_malloc((cnt ? cnt : 1) * sizeof *ids);
    if (!ids) return oai_errf(err, 500, "server_error", NULL, NULL, "out of memory");
    for (size_t i = 0; i < cnt; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v)) {
            free(ids);
            return BAD(param, "'%s' must be a string or an array of token ids (integers)", param);
        }
        json_int_t x = json_integer_value(v);
        int64_t end = lim && lim->n_vocab > 0 ? lim->n_vocab : (int64_t)INT32_MAX + 1;
        if (x < 0 || x >= end) {
            free(ids);
            return BAD(param, "token id %lld in '%s' is out of range [0, %lld)", (long long)x,
                       param, (long long)end);
        }
        ids[i] = (int32_t)x;
    }
    *out = ids;
    *n = cnt;
    return KV_OK;
}

/* prompt: "text" | [ids] | ["text"] | [[ids]]; one prompt only. */
static kv_status parse_prompt(json_t *o, const struct oai_limits *lim, struct oai_request *r,
                              struct oai_error *err) {
    json_t *p = json_object_get(o, "prompt");
    if (!p || json_is_null(p)) return BAD("prompt", "'prompt' is required");
    if (json_is_array(p)) {
        size_t n = json_array_size(p);
        if (n == 0) return BAD("prompt", "'prompt' must not be an empty array");
        json_t *first = json_array_get(p, 0);
        if (json_is_string(first) || json_is_array(first)) {
            if (n > 1) return BAD("prompt", "only one prompt is supported");
            p = first;
        }
    }
    if (json_is_string(p)) {
        r->text = kv_strndup(json_string_value(p), json_string_length(p));
        if (!r->text) return oai_errf(err, 500, "server_error", NULL, NULL, "out of memory");
        r->text_len = json_string_length(p);
        r->has_text = true;
        return KV_OK;
    }
    if (json_is_array(p)) {
        if (json_array_size(p) == 0) return BAD("prompt", "'prompt' must not be empty");
        if (parse_ids(p, "prompt", lim, &r->ids, &r->n_ids, err)) return KV_EINVAL;
        if (lim && lim->max_model_len > 0 && r->n_ids >= (size_t)lim->max_model_len)
            return oai_errf(err, 400, INVALID, "prompt", "context_length_exceeded",
                            "the prompt has %zu tokens; this model's maximum context length is "
                            "%d tokens (prompt + at least 1 generated token)",
                            r->n_ids, lim->max_model_len);
        return KV_OK;
    }
    return BAD("prompt", "'prompt' must be a string or an array of token ids");
}

#define OOM() oai_errf(err, 500, "server_error", NULL, NULL, "out of memory")

/* content: "text" | [{type:"text", text}] (parts joined with "\n", as vLLM and TensorRT-LLM
 * do) | null / absent (only when null_ok: an assistant turn; *out = JSON null). *out: a new
 * JSON string (or null). */
static kv_status parse_content(json_t *c, size_t idx, const char *role, bool null_ok,
                               json_t **out, struct oai_error *err) {
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].content", idx);
    if (!c || json_is_null(c)) {
        if (!null_ok) return BAD(param, "'%s' is required for a '%s' message", param, role);
        *out = json_null();
        return *out ? KV_OK : OOM();
    }
    if (json_is_string(c)) {
        *out = json_incref(c);
        return KV_OK;
    }
    if (!json_is_array(c)) return BAD(param, "'%s' must be a string or an array of parts", param);
    kv_buf b;
    kv_buf_init(&b);
    size_t i;
    json_t *part;
    json_array_foreach(c, i, part) {
        json_t *type = json_object_get(part, "type");
        json_t *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type)) {
            kv_buf_free(&b);
            return BAD(param, "each part of '%s' must be an object with a 'type'", param);
        }
        if (strcmp(json_string_value(type), "text") != 0) {
            kv_buf_free(&b);
            return BAD(param, "content part type '%s' is not supported (only 'text')",
                       json_string_value(type));
        }
        if (!json_is_string(text)) {
            kv_buf_free(&b);
            return BAD(param, "a text part of '%s' needs a string 'text'", param);
        }
        if ((i > 0 && kv_buf_append(&b, "\n", 1)) ||
            kv_buf_append(&b, json_string_value(text), json_string_length(text))) {
            kv_buf_free(&b);
            return OOM();
        }
    }
    *out = json_stringn(b.data ? b.data : "", b.len);
    kv_buf_free(&b);
    return *out ? KV_OK : OOM();
}

/* Optional string member k of o (null = absent); copied into dst when present. */
static kv_status copy_opt_string(json_t *o, const char *k, json_t *dst, const char *param,
                                 struct oai_error *err) {
    json_t *v = field(o, k);
    if (!v) return KV_OK;
    if (!json_is_string(v)) return BAD(param, "'%s' must be a string", param);
    return json_object_set(dst, k, v) ? OOM() : KV_OK;
}

/* assistant tool_calls: [{"id"?, "type":"function"?, "function":{"name","arguments"?}}].
 * arguments: a JSON text (parsed, as vLLM does, so templates can iterate it), an object,
 * or null/""/absent (-> {}). */
static kv_status parse_tool_calls(json_t *tc, size_t idx, json_t **out, struct oai_error *err) {
    char param[80];
    snprintf(param, sizeof param, "messages[%zu].tool_calls", idx);
    if (!json_is_array(tc)) return BAD(param, "'%s' must be an array", param);
    json_t *arr = json_array();
    if (!arr) return OOM();
    *out = arr;
    size_t i;
    json_t *c;
    json_array_foreach(tc, i, c) {
        snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu]", idx, i);
        if (!json_is_object(c)) return BAD(param, "'%s' must be an object", param);
        json_t *type = field(c, "type");
        if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "function")))
            return BAD(param, "'%s.type' must be \"function\"", param);
        json_t *fn = json_object_get(c, "function");
        json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
        if (!json_is_string(name) || json_string_length(name) == 0)
            return BAD(param, "'%s.function' must be an object with a non-empty string 'name'", param);
        json_t *args = field(fn, "arguments"), *a = NULL;
        if (!args || (json_is_string(args) && json_string_length(args) == 0)) {
            a = json_object();
        } else if (json_is_string(args)) {
            json_error_t je;
            a = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, &je);
            if (!a) return BAD(param, "'%s.function.arguments' is not valid JSON: %s", param, je.text);
        } else if (json_is_object(args) || json_is_array(args)) {
            a = json_incref(args);
        } else {
            return BAD(param, "'%s.function.arguments' must be a JSON string or an object", param);
        }
        json_t *call = json_pack("{s:s, s:{s:O, s:o}}", "type", "function", "function", "name", name,
                                 "arguments", a);
        if (!call || json_array_append_new(arr, call)) return OOM();
        json_t *id = field(c, "id");
        if (id && !json_is_string(id)) return BAD(param, "'%s.id' must be a string", param);
        if (id && json_object_set(call, "id", id)) return OOM();
    }
    return KV_OK;
}

static kv_status parse_message(json_t *msg, size_t i, json_t *out, struct oai_error *err) {
    char param[64];
    snprintf(param, sizeof param, "messages[%zu]", i);
    if (!json_is_object(msg)) return BAD(param, "'%s' must be an object", param);
    json_t *role = json_object_get(msg, "role");
    snprintf(param, sizeof param, "messages[%zu].role", i);
    if (!json_is_string(role) || json_string_length(role) == 0)
        return BAD(param, "'%s' must be a non-empty string", param);
    const char *rs = json_string_value(role);
    if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") &&
        strcmp(rs, "tool") && strcmp(rs, "developer"))
        return BAD(param, "unknown role '%s' (system, developer, user, assistant or tool)", rs);
    bool assistant = !strcmp(rs, "assistant");
    json_t *content = NULL;
    /* only an assistant turn may have no content (it may carry tool_calls instead) */
    if (parse_content(json_object_get(msg, "content"), i, rs, assistant, &content, err)) return KV_EINVAL;
    if (json_object_set(out, "role", role) || json_object_set_new(out, "content", content)) return OOM();
    snprintf(param, sizeof param, "messages[%zu].name", i);
    if (copy_opt_string(msg, "name", out, param, err)) return KV_EINVAL;
    snprintf(param, sizeof param, "messages[%zu].tool_call_id", i);
    if (copy_opt_string(msg, "tool_call_id", out, param, err)) return KV_EINVAL;
    snprintf(param, sizeof param, "messages[%zu].reasoning_content", i);
    if (copy_opt_string(msg, "reasoning_content", out, param, err)) return KV_EINVAL;
    json_t *tc = field(msg, "tool_calls");
    if (tc) {
        snprintf(param, sizeof param, "messages[%zu].tool_calls", i);
        if (!assistant) return BAD(param, "only assistant messages may have 'tool_calls'");
        json_t *calls = NULL;
        kv_status st = parse_tool_calls(tc, i, &calls, err);
        if (!st && json_object_set(out, "tool_calls", calls)) st = OOM();
        json_decref(calls);
        if (st) return st;
    }
    return KV_OK;
}

static kv_status parse_messages(json_t *o, struct oai_request *r, struct oai_error *err) {
    json_t *m = json_object_get(o, "messages");
    if (!m || json_is_null(m)) return BAD("messages", "'messages' is required");
    if (!json_is_array(m)) return BAD("messages", "'messages' must be an array");
    size_t n = json_array_size(m);
    if (n == 0) return BAD("messages", "'messages' must not be empty");
    r->chat_msgs = json_array();
    if (!r->chat_msgs) return OOM();
    for (size_t i = 0; i < n; i++) {
        json_t *out = json_object();
        if (!out || json_array_append_new(r->chat_msgs, out)) return OOM();
        if (parse_message(json_array_get(m, i), i, out, err)) return KV_EINVAL;
    }
    return KV_OK;
}

/* tools: [{"type":"function","function":{"name","description"?,"parameters"?,"strict"?}}]. */
static kv_status check_tools(json_t *tools, struct oai_error *err) {
    if (!json_is_array(tools)) return BAD("tools", "'tools' must be an array");
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *type = json_is_object(t) ? json_object_get(t, "type") : NULL;
        if (!json_is_string(type) || strcmp(json_string_value(type), "function"))
            return BAD("tools", "tools[%zu] must be an object with \"type\": \"function\"", i);
        json_t *fn = json_object_get(t, "function");
        json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
        if (!json_is_string(name) || json_string_length(name) == 0)
            return BAD("tools", "tools[%zu].function must be an object with a non-empty string 'name'", i);
        json_t *d = field(fn, "description"), *p = field(fn, "parameters"), *s = field(fn, "strict");
        if (d && !json_is_string(d)) return BAD("tools", "tools[%zu].function.description must be a string", i);
        if (p && !json_is_object(p)) return BAD("tools", "tools[%zu].function.parameters must be an object", i);
        json_t *pt = p ? json_object_get(p, "type") : NULL; /* arguments are a JSON object (OpenAI) */
        if (pt && !(json_is_string(pt) && !strcmp(json_string_value(pt), "object")))
            return BAD("tools", "tools[%zu].function.parameters must be a JSON schema of type \"object\" "
                       "(a call's arguments are an object)", i);
        if (s && !json_is_boolean(s)) return BAD("tools", "tools[%zu].function.strict must be a boolean", i);
    }
    return KV_OK;
}

/* The template inputs besides messages: tools, tool_choice, chat_template_kwargs,
 * add_generation_prompt (chat and tokenize-with-messages). */
static kv_status parse_chat_extras(json_t *o, struct oai_request *r, struct oai_error *err) {
    /* continue_final_message (vLLM): the prompt ends inside the final message; it excludes
     * add_generation_prompt (400 when both are true; an absent add_generation_prompt then
     * defaults to false) */
    if (get_bool(o, "continue_final_message", &r->continue_final_message, err)) return KV_EINVAL;
    r->add_generation_prompt = !r->continue_final_message;
    if (get_bool(o, "add_generation_prompt", &r->add_generation_prompt, err)) return KV_EINVAL;
    if (r->continue_final_message && r->add_generation_prompt)
        return BAD("continue_final_message",
                   "cannot set both 'continue_final_message' and 'add_generation_prompt' to true");
    if (r->continue_final_message) {
        json_t *last = json_array_get(r->chat_msgs, json_array_size(r->chat_msgs) - 1);
        if (!json_is_string(json_object_get(last, "content")))
            return BAD("continue_final_message",
                       "'continue_final_message' needs a final message with text content");
    }
    json_t *tools = field(o, "tools");
    if (tools && check_tools(tools, err)) return KV_EINVAL;
    if (oai_parse_tool_choice(o, tools, r, err)) return KV_EINVAL; /* structured.c */
    json_t *kw = field(o, "chat_template_kwargs");
    if (kw && !json_is_object(kw)) return BAD("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    if (!(tools && json_array_size(tools) > 0) && !(kw && json_object_size(kw) > 0)) return KV_OK;
    r->chat_kwargs = json_object();
    if (!r->chat_kwargs) return OOM();
    /* as vLLM: tools first, chat_template_kwargs may override */
    if (tools && json_array_size(tools) > 0 && json_object_set(r->chat_kwargs, "tools", tools)) return OOM();
    if (kw && json_object_update(r->chat_kwargs, kw)) return OOM();
    return KV_OK;
}

static kv_status parse_stop(json_t *o, struct oai_request *r, struct oai_error *err) {
    json_t *s = field(o, "stop");
    if (!s) return KV_OK;
    json_t *one = NULL;
    size_t n;
    if (json_is_string(s)) {
        one = s;
        n = 1;
    } else if (json_is_array(s)) {
        n = json_array_size(s);
        if (n > OAI_MAX_STOP) return BAD("stop", "at most %d stop strings are supported", OAI_MAX_STOP);
    } else {
        return BAD("stop", "'stop' must be a string or an array of strings");
    }
    if (n == 0) return KV_OK;
    r->stop = kv_calloc(n, sizeof *r->stop);
    if (!r->stop) return oai_errf(err, 500, "server_error", NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *v = one ? one : json_array_get(s, i);
        if (!json_is_string(v)) return BAD("stop", "'stop' must be a string or an array of strings");
        if (json_string_length(v) == 0) return BAD("stop", "stop strings must not be empty");
        r->stop[i] = kv_strndup(json_string_value(v), json_string_length(v));
        if (!r->stop[i]) return oai_errf(err, 500, "server_error", NULL, NULL, "out of memory");
        r->n_stop = (int)i + 1;
    }
    return KV_OK;
}

static void sp_defaults(struct sampling_params *sp) {
    memset(sp, 0, sizeof *sp);
    sp->temperature = 1.0f; /* OpenAI default */
    sp->top_k = 0;
    sp->top_p = 1.0f;
    sp->min_p = 0.0f;
    sp->repetition_penalty = 1.0f;
}

static kv_status parse_generation(json_t *o, const struct oai_limits *lim, struct oai_request *r,
                                  struct oai_error *err) {
    struct sampling_params *sp = &r->sp;
    bool present;
    int64_t x;
    if (get_num(o, "temperature", 0, false, 2, &sp->temperature, err)) return KV_EINVAL;
    if (get_num(o, "top_p", 0, true, 1, &sp->top_p, err)) return KV_EINVAL;
    if (get_num(o, "min_p", 0, false, 1, &sp->min_p, err)) return KV_EINVAL;
    if (get_num(o, "presence_penalty", -2, false, 2, &sp->presence_penalty, err)) return KV_EINVAL;
    if (get_num(o, "frequency_penalty", -2, false, 2, &sp->frequency_penalty, err)) return KV_EINVAL;
    if (get_num(o, "repetition_penalty", 0, true, 10, &sp->repetition_penalty, err)) return KV_EINVAL;
    if (get_int(o, "top_k", -1, 1 << 30, &present, &x, err)) return KV_EINVAL;
    if (present) sp->top_k = x < 0 ? 0 : (int)x;
    if (get_int(o, "seed", INT64_MIN, INT64_MAX, &present, &x, err)) return KV_EINVAL;
    if (present) {
        sp->has_seed = true;
        sp->seed = (uint64_t)x;
    }
    /* any positive int: one that does not fit beside the prompt (max_model_len - prompt tokens)
     * is refused after tokenizing, as context_length_exceeded (prep.c), as vLLM does */
    const char *mt_name = "max_tokens";
    if (r->kind == OAI_CHAT && field(o, "max_completion_tokens")) {
        mt_name = "max_completion_tokens";
        /* both given: max_completion_tokens wins (vLLM), but max_tokens must still be valid */
        if (get_int(o, "max_tokens", 1, INT32_MAX, &present, &x, err)) return KV_EINVAL;
    }
    r->max_tokens = r->kind == OAI_COMPLETION ? 16 : -1;
    if (get_int(o, mt_name, 1, INT32_MAX, &present, &x, err)) return KV_EINVAL;
    if (present) r->max_tokens = (int)x, r->max_tokens_given = true;
    if (oai_parse_sampling(o, lim, r, err)) return KV_EINVAL;
    if (get_bool(o, "ignore_eos", &r->ignore_eos, err)) return KV_EINVAL;
    if (get_bool(o, "return_tokens_as_token_ids", &r->tokens_as_ids, err)) return KV_EINVAL;
    if (parse_stop(o, r, err)) return KV_EINVAL;
    if (get_bool(o, "stream", &r->stream, err)) return KV_EINVAL;
    json_t *so = field(o, "stream_options");
    if (so) {
        if (!json_is_object(so)) return BAD("stream_options", "'stream_options' must be an object");
        if (!r->stream)
            return BAD("stream_options", "'stream_options' is only allowed when 'stream' is true");
        if (get_bool(so, "include_usage", &r->include_usage, err)) {
            snprintf(err->param, sizeof err->param, "stream_options.include_usage");
            return KV_EINVAL;
        }
    }
    if (r->kind == OAI_COMPLETION) {
        if (get_int(o, "logprobs", 0, OAI_MAX_LOGPROBS_COMPLETION, &present, &x, err)) return KV_EINVAL;
        if (present) {
            sp->logprobs = true;
            sp->top_logprobs = (int)x;
        }
        bool echo = false;
        if (get_bool(o, "echo", &echo, err)) return KV_EINVAL;
        if (echo) return BAD("echo", "'echo' is not supported");
        json_t *suffix = field(o, "suffix");
        if (suffix && !(json_is_string(suffix) && json_string_length(suffix) == 0))
            return BAD("suffix", "'suffix' is not supported");
    } else {
        if (get_bool(o, "logprobs", &sp->logprobs, err)) return KV_EINVAL;
        if (get_int(o, "top_logprobs", 0, OAI_MAX_TOP_LOGPROBS_CHAT, &present, &x, err))
            return KV_EINVAL;
        if (present) {
            if (!sp->logprobs && x > 0)
                return BAD("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
            sp->top_logprobs = (int)x;
        }
    }
    return KV_OK;
}

bool oai_model_matches(const struct oai_limits *lim, const char *name) {
    if (!lim || !lim->served_name) return true;
    if (!strcmp(name, lim->served_name)) return true;
    for (int i = 0; i < lim->n_aliases; i++)
        if (lim->aliases[i] && !strcmp(name, lim->aliases[i])) return true;
    return false;
}

static kv_status check_model(json_t *o, const struct oai_limits *lim, struct oai_error *err) {
    json_t *m = field(o, "model");
    if (!m) return KV_OK;
    if (!json_is_string(m)) return BAD("model", "'model' must be a string");
    const char *s = json_string_value(m);
    if (!*s || !lim || !lim->served_name) return KV_OK;
    if (!oai_model_matches(lim, s))
        return oai_errf(err, 404, INVALID, "model", "model_not_found",
                        "The model '%s' does not exist; this server serves '%s'", s,
                        lim->served_name);
    return KV_OK;
}

static kv_status check_ignored_strings(json_t *o, struct oai_error *err) {
    static const char *const keys[] = {"user", "conversation_id"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        json_t *v = field(o, keys[i]);
        if (v && !json_is_string(v)) return BAD(keys[i], "'%s' must be a string", keys[i]);
    }
    return KV_OK;
}

/* cache_salt: a non-empty string of at most OAI_MAX_CACHE_SALT bytes (vLLM's extension:
 * requests with different salts never share KV blocks). */
static kv_status parse_cache_salt(json_t *o, struct oai_request *r, struct oai_error *err) {
    json_t *v = field(o, "cache_salt");
    if (!v) return KV_OK;
    if (!json_is_string(v) || json_string_length(v) == 0)
        return BAD("cache_salt", "'cache_salt' must be a non-empty string");
    if (json_string_length(v) > OAI_MAX_CACHE_SALT)
        return BAD("cache_salt", "'cache_salt' is longer than %d bytes", OAI_MAX_CACHE_SALT);
    r->cache_salt = kv_strndup(json_string_value(v), json_string_length(v));
    return r->cache_salt ? KV_OK : OOM();
}

/* disaggregated_params (docs/disaggregation.md): strict, every key known. */
static kv_status parse_disagg(json_t *o, const struct oai_limits *lim, struct oai_request *r,
                              struct oai_error *err) {
    json_t *d = field(o, "disaggregated_params");
    if (!d) return KV_OK;
    struct oai_disagg *g = &r->disagg;
    if (!json_is_object(d)) return BAD("disaggregated_params", "'disaggregated_params' must be an object");
    static const char *const known[] = {"request_type", "disagg_request_id", "ctx_request_id",
                                        "schedule_style", "first_gen_tokens", "ctx_info_endpoint",
                                        "prompt_token_ids", "first_gen_logprobs", "conversation_id",
                                        "pool", "kv_transport", "ctx_usage", "kv_offered"};
    const char *k;
    json_t *v;
    json_object_foreach(d, k, v) {
        size_t i = 0;
        while (i < sizeof known / sizeof *known && strcmp(k, known[i])) i++;
        if (i == sizeof known / sizeof *known)
            return BAD("disaggregated_params", "unknown field 'disaggregated_params.%s'", k);
    }
    json_t *t = field(d, "request_type");
    const char *ts = json_is_string(t) ? json_string_value(t) : "";
    if (!strcmp(ts, "context_only")) g->type = OAI_DISAGG_CONTEXT_ONLY;
    else if (!strcmp(ts, "generation_only")) g->type = OAI_DISAGG_GENERATION_ONLY;
    else
        return BAD("disaggregated_params.request_type",
                   "'disaggregated_params.request_type' must be \"context_only\" or "
                   "\"generation_only\"");
    bool present;
    int64_t x;
    const int64_t max53 = ((int64_t)1 << 53) - 1;
    if (get_int(d, "disagg_request_id", 0, max53, &present, &x, err)) goto param;
    if (!present)
        return BAD("disaggregated_params.disagg_request_id",
                   "'disaggregated_params.disagg_request_id' is required");
    g->disagg_id = (uint64_t)x;
    if (get_int(d, "ctx_request_id", 0, max53, &g->has_ctx_id, &x, err)) goto param;
    if (g->has_ctx_id) g->ctx_request_id = (uint64_t)x;
    g->context_first = true;
    json_t *ss = field(d, "schedule_style");
    if (ss) {
        const char *s2 = json_is_string(ss) ? json_string_value(ss) : "";
        if (!strcmp(s2, "generation_first")) g->context_first = false;
        else if (strcmp(s2, "context_first"))
            return BAD("disaggregated_params.schedule_style",
                       "'disaggregated_params.schedule_style' must be \"context_first\" or "
                       "\"generation_first\"");
    }
    json_t *ft = field(d, "first_gen_tokens");
    if (ft) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (!json_is_array(ft) || json_array_size(ft) > 1)
            return BAD("disaggregated_params.first_gen_tokens",
                       "'disaggregated_params.first_gen_tokens' must be an array of one token id");
        if (parse_ids(ft, "disaggregated_params.first_gen_tokens", lim, &ids, &n, err)) return KV_EINVAL;
        for (size_t i = 0; i < n; i++) g->first[i] = ids[i];
        g->n_first = (int)n;
        free(ids);
    }
    json_t *ep = field(d, "ctx_info_endpoint");
    if (ep && json_is_array(ep)) ep = json_array_get(ep, 0); /* TRT-LLM: a list -> its first */
    if (ep) {
        if (!json_is_string(ep) || !json_string_length(ep) || json_string_length(ep) > 255 ||
            !kv_hostport_ok(json_string_value(ep)))
            return BAD("disaggregated_params.ctx_info_endpoint",
                       "'disaggregated_params.ctx_info_endpoint' must be a \"host:port\" string (port 1-65535)");
        g->endpoint = kv_strdup(json_string_value(ep));
        if (!g->endpoint) return OOM();
    }
    json_t *pi = field(d, "prompt_token_ids");
    if (pi) {
        if (!json_is_array(pi) || json_array_size(pi) == 0)
            return BAD("disaggregated_params.prompt_token_ids",
                       "'disaggregated_params.prompt_token_ids' must be a non-empty array of token ids");
        if (parse_ids(pi, "disaggregated_params.prompt_token_ids", lim, &g->prompt_ids,
                      &g->n_prompt_ids, err))
            return KV_EINVAL;
    }
    json_t *lp = field(d, "first_gen_logprobs");
    if (lp) {
        json_t *id = json_object_get(lp, "id"), *l = json_object_get(lp, "logprob"),
               *top = json_object_get(lp, "top");
        if (!json_is_object(lp) || !json_is_integer(id) || !json_is_number(l) ||
            (top && !json_is_array(top)) || json_array_size(top) > 20)
            return BAD("disaggregated_params.first_gen_logprobs",
                       "'disaggregated_params.first_gen_logprobs' must be {\"id\", \"logprob\", "
                       "\"top\": [[id, logprob], ...]}");
        int64_t nv = lim && lim->n_vocab > 0 ? lim->n_vocab : (int64_t)INT32_MAX + 1;
        if (json_integer_value(id) < 0 || json_integer_value(id) >= nv)
            return BAD("disaggregated_params.first_gen_logprobs",
                       "'disaggregated_params.first_gen_logprobs.id' is outside the vocabulary");
        g->has_first_lp = true;
        g->first_lp.id = (int32_t)json_integer_value(id);
        g->first_lp.logprob = (float)json_number_value(l);
        size_t i;
        json_t *e2;
        json_array_foreach(top, i, e2) {
            json_t *a = json_array_get(e2, 0), *b = json_array_get(e2, 1);
            if (!json_is_integer(a) || !json_is_number(b) || json_integer_value(a) < 0 ||
                json_integer_value(a) >= nv)
                return BAD("disaggregated_params.first_gen_logprobs",
                           "'disaggregated_params.first_gen_logprobs.top' entries are [id, logprob] "
                           "with ids in the vocabulary");
            g->first_top[i].id = (int32_t)json_integer_value(a);
            g->first_top[i].logprob = (float)json_number_value(b);
            g->n_first_top = (int)i + 1;
        }
    }
    json_t *cv = field(d, "conversation_id");
    if (cv) {
        if (!json_is_string(cv))
            return BAD("disaggregated_params.conversation_id",
                       "'disaggregated_params.conversation_id' must be a string");
        g->conversation_id = kv_strdup(json_string_value(cv));
        if (!g->conversation_id) return OOM();
    }
    if (g->type == OAI_DISAGG_CONTEXT_ONLY && r->stream)
        return BAD("stream", "a context_only leg is not streamed (send 'stream': false)");
    if (g->type == OAI_DISAGG_GENERATION_ONLY && !g->endpoint)
        return BAD("disaggregated_params.ctx_info_endpoint",
                   "a generation_only leg needs 'disaggregated_params.ctx_info_endpoint'");
    if (g->type == OAI_DISAGG_GENERATION_ONLY && g->context_first && g->n_first == 0)
        return BAD("disaggregated_params.first_gen_tokens",
                   "a context_first generation_only leg needs 'disaggregated_params.first_gen_tokens'");
    return KV_OK;
param:
    if (err->param[0] && strncmp(err->param, "disaggregated_params.", 21)) {
        char tmp[64];
        snprintf(tmp, sizeof tmp, "%s", err->param);
        snprintf(err->param, sizeof err->param, "disaggregated_params.%.40s", tmp);
    }
    return KV_EINVAL;
}

/* The top-level fields each request kind reads (docs/api.md). Any other field (not null) is a
 * 400 naming it, as OpenAI's API answers "Unrecognized request argument supplied": a typo such
 * as 'max_token' or 'temprature' must not quietly leave a default in place. Message objects are
 * not checked (the chat template receives them whole and may read any field); stream_options is
 * (its one key). */
static const char *const k_sampling[] = {
    "model", "user", "conversation_id", "cache_salt", "max_tokens", "temperature", "top_p", "min_p", "top_k",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stream", "stream_options", "stop",
    "n", "best_of", "logprobs", "ignore_eos", "return_tokens_as_token_ids", "logit_bias", "stop_token_ids",
    "min_tokens", "priority", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_whitespace_pattern", "structured_outputs", "json_schema", "grammar",
    "disaggregated_params", NULL};
static const char *const k_completion[] = {"prompt", "echo", "suffix", NULL};
static const char *const k_chat_extras[] = {"messages", "tools", "tool_choice", "parallel_tool_calls",
                                            "add_generation_prompt", "continue_final_message",
                                            "chat_template_kwargs", NULL};
static const char *const k_chat[] = {"max_completion_tokens", "top_logprobs", NULL};
static const char *const k_tokenize[] = {"model", "prompt", "add_special_tokens", NULL};
static const char *const k_detokenize[] = {"model", "tokens", NULL};

static bool in_list(const char *k, const char *const *l) {
    for (; l && *l; l++)
        if (!strcmp(k, *l)) return true;
    return false;
}

static kv_status check_known(enum oai_kind kind, json_t *o, struct oai_error *err) {
    const char *const *lists[3] = {NULL, NULL, NULL};
    switch (kind) {
    case OAI_COMPLETION: lists[0] = k_sampling, lists[1] = k_completion; break;
    case OAI_CHAT: lists[0] = k_sampling, lists[1] = k_chat_extras, lists[2] = k_chat; break;
    case OAI_TOKENIZE: lists[0] = k_tokenize, lists[1] = k_chat_extras; break;
    case OAI_DETOKENIZE: lists[0] = k_detokenize; break;
    }
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) {
        if (json_is_null(v) || in_list(k, lists[0]) || in_list(k, lists[1]) || in_list(k, lists[2])) continue;
        return BAD(k, "Unrecognized request argument supplied: %.100s", k);
    }
    json_t *so = field(o, "stream_options"); /* known on completions and chat only (above) */
    if (json_is_object(so)) {
        json_object_foreach(so, k, v) {
            if (json_is_null(v) || !strcmp(k, "include_usage")) continue;
            char p[sizeof err->param];
            snprintf(p, sizeof p, "stream_options.%.40s", k);
            return BAD(p, "Unrecognized request argument supplied: stream_options.%.100s", k);
        }
    }
    return KV_OK;
}

static kv_status parse_obj(enum oai_kind kind, json_t *o, const struct oai_limits *lim,
                           struct oai_request *r, struct oai_error *err) {
    r->kind = kind;
    sp_defaults(&r->sp);
    r->n = 1;
    r->max_tokens = -1;
    r->add_special = true;
    switch (kind) {
    case OAI_COMPLETION:
        if (check_model(o, lim, err) || check_ignored_strings(o, err) || parse_cache_salt(o, r, err))
            return KV_EINVAL;
        if (parse_prompt(o, lim, r, err)) return KV_EINVAL;
        return parse_generation(o, lim, r, err) || parse_disagg(o, lim, r, err) ||
                       oai_parse_structured(o, r, err)
                   ? KV_EINVAL
                   : KV_OK;
    case OAI_CHAT:
        if (check_model(o, lim, err) || check_ignored_strings(o, err) || parse_cache_salt(o, r, err))
            return KV_EINVAL;
        if (parse_messages(o, r, err) || parse_chat_extras(o, r, err)) return KV_EINVAL;
        return parse_generation(o, lim, r, err) || parse_disagg(o, lim, r, err) ||
                       oai_parse_structured(o, r, err)
                   ? KV_EINVAL
                   : KV_OK;
    case OAI_TOKENIZE:
        if (check_model(o, lim, err)) return KV_EINVAL;
        if (get_bool(o, "add_special_tokens", &r->add_special, err)) return KV_EINVAL;
        if (field(o, "messages")) return parse_messages(o, r, err) || parse_chat_extras(o, r, err) ? KV_EINVAL : KV_OK;
        if (!field(o, "prompt")) return BAD("prompt", "'prompt' or 'messages' is required");
        if (!lim) return parse_prompt(o, NULL, r, err);
        /* ids are checked against the vocabulary; no context-length limit for tokenize */
        struct oai_limits tl = *lim;
        tl.max_model_len = 0;
        return parse_prompt(o, &tl, r, err);
    case OAI_DETOKENIZE: {
        if (check_model(o, lim, err)) return KV_EINVAL;
        json_t *t = field(o, "tokens");
        if (!t) return BAD("tokens", "'tokens' is required");
        if (!json_is_array(t)) return BAD("tokens", "'tokens' must be an array of token ids");
        return parse_ids(t, "tokens", lim, &r->ids, &r->n_ids, err);
    }
    }
    return BAD(NULL, "unknown request kind");
}

kv_status oai_parse(enum oai_kind kind, const char *body, size_t len,
                    const struct oai_limits *lim, struct oai_request *out, struct oai_error *err) {
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    json_error_t je;
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!o && strstr(je.text, "\\u0000")) /* jansson refuses U+0000 unless JSON_ALLOW_NUL */
        return BAD(NULL, "request body holds the character U+0000 (\\u0000) in a string (line %d, column %d): "
                   "not supported", je.line, je.column);
    if (!o)
        return BAD(NULL, "request body is not valid JSON (line %d, column %d: %s)", je.line,
                   je.column, je.text);
    if (!json_is_object(o)) {
        json_decref(o);
        return BAD(NULL, "request body must be a JSON object");
    }
    kv_status st = parse_obj(kind, o, lim, out, err);
    if (!st) st = check_known(kind, o, err); /* after the fields' own checks: those name the better error */
    json_decref(o);
    if (st) {
        oai_request_free(out);
        memset(out, 0, sizeof *out);
    }
    return st;
}

void oai_request_free(struct oai_request *r) {
    if (!r) return;
    free(r->text);
    free(r->ids);
    json_decref(r->chat_msgs);
    json_decref(r->chat_kwargs);
    free(r->cache_salt);
    free(r->logit_bias);
    free(r->stop_token_ids);
    free(r->disagg.endpoint);
    free(r->disagg.prompt_ids);
    free(r->disagg.conversation_id);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    oai_structured_free(&r->so);
    memset(r, 0, sizeof *r);
}

void oai_engine_params(const struct oai_request *r, const int32_t *ids, size_t n_ids,
                       int max_model_len, struct engine_request_params *p) {
    memset(p, 0, sizeof *p);
    p->prompt_ids = ids;
    p->n_prompt = n_ids;
    p->sp = r->sp;
    int mt = r->max_tokens;
    if (mt < 0) {
        long left = (long)max_model_len - (long)n_ids;
        mt = left >= 1 ? (int)left : 1;
    }
    p->max_tokens = mt;
    p->stop = (const char *const *)r->stop;
    p->n_stop = r->n_stop;
    p->ignore_eos = r->ignore_eos;
    p->cache_salt = r->cache_salt;
    p->n = r->n;
    p->logit_bias = r->logit_bias;
    p->n_logit_bias = r->n_logit_bias;
    p->stop_token_ids = r->stop_token_ids;
    p->n_stop_token_ids = r->n_stop_token_ids;
    p->min_tokens = r->min_tokens;
    p->priority = r->priority;
    p->grammar = r->so.grammar;
    const struct oai_disagg *g = &r->disagg;
    if (g->type == OAI_DISAGG_CONTEXT_ONLY) p->disagg = ENGINE_DISAGG_CONTEXT_ONLY;
    else if (g->type == OAI_DISAGG_GENERATION_ONLY) p->disagg = ENGINE_DISAGG_GENERATION_ONLY;
    p->disagg_id = g->disagg_id;
    p->context_first = g->context_first;
    p->peer_endpoint = g->endpoint;
    p->first_tokens = g->n_first ? g->first : NULL;
    p->n_first = g->n_first;
    if (g->has_first_lp) {
        p->first_logprob = &g->first_lp;
        p->first_top = g->first_top;
        p->n_first_top = g->n_first_top;
    }
}
