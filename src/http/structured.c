/*
 * Structured output and tool choice of OpenAI / vLLM requests (http_internal.h):
 *
 *   oai_parse (openai.c) --oai_parse_structured / oai_parse_tool_choice--> r->so (validated
 *   shape: which constraint, its source JSON, the tool choice)
 *   prep.c (a preparation thread) --oai_structured_compile--> r->so.grammar (grammar/grammar.h),
 *   compiled on the worker only (a router parses bodies too and never needs the grammar); the
 *   compiled-grammar cache (grammar/compile.c) is locked, so prep threads may compile at once
 *
 * Fields: response_format {text | json_object | json_schema {name, schema, strict}},
 * vLLM's guided_json / guided_regex / guided_choice / guided_grammar and
 * structured_outputs {json | regex | choice | grammar | json_object}; at most one of them.
 * Chat: tool_choice none | auto | required | {"type": "function", "function": {"name"}},
 * parallel_tool_calls. docs/structured-output.md.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

#define BAD(param, ...) oai_errf(err, 400, "invalid_request_error", param, NULL, __VA_ARGS__)
#define OOM() oai_errf(err, 500, "server_error", NULL, NULL, "out of memory")

static json_t *present(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return v && !json_is_null(v) ? v : NULL;
}

/* One constraint source found: records it, or refuses a second one. */
static kv_status set_kind(struct oai_structured *so, enum oai_so_kind kind, json_t *spec, bool strict,
                          const char *param, const char *where, struct oai_error *err) {
    if (so->kind != OAI_SO_NONE)
        return BAD(param, "'%s' cannot be combined with '%s': give one way to constrain the output", param,
                   so->param);
    so->kind = kind;
    so->spec = json_incref(spec);
    so->strict = strict;
    so->param = param;
    so->where = where;
    return KV_OK;
}

/* A schema given as an object, a boolean, or (vLLM) the JSON text of one. */
static kv_status schema_value(json_t *v, const char *param, json_t **out, struct oai_error *err) {
    if (json_is_object(v) || json_is_boolean(v)) {
        *out = json_incref(v);
        return KV_OK;
    }
    if (json_is_string(v)) {
        json_error_t je;
        json_t *s = json_loadb(json_string_value(v), json_string_length(v), JSON_DECODE_ANY, &je);
        if (!s || !(json_is_object(s) || json_is_boolean(s))) {
            json_decref(s);
            return BAD(param, "'%s' is not a JSON schema (%s)", param, s ? "not an object" : je.text);
        }
        *out = s;
        return KV_OK;
    }
    return BAD(param, "'%s' must be a JSON schema (an object)", param);
}

/* A schema source field (guided_json, json_schema, structured_outputs.json ...). */
static kv_status schema_field(struct oai_structured *so, json_t *v, const char *param, const char *value_param,
                              bool strict, struct oai_error *err) {
    json_t *s = NULL;
    if (schema_value(v, value_param, &s, err)) return KV_EINVAL;
    kv_status st = set_kind(so, OAI_SO_JSON_SCHEMA, s, strict, param, value_param, err);
    json_decref(s);
    return st;
}

static kv_status choice_value(json_t *v, const char *param, struct oai_error *err) {
    if (!json_is_array(v) || json_array_size(v) == 0)
        return BAD(param, "'%s' must be a non-empty array of strings", param);
    size_t i;
    json_t *c;
    json_array_foreach(v, i, c) if (!json_is_string(c)) return BAD(param, "'%s' must be a non-empty array of strings", param);
    return KV_OK;
}

static kv_status response_format(json_t *rf, struct oai_structured *so, struct oai_error *err) {
    const char *P = "response_format";
    json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
    if (!json_is_string(t)) return BAD(P, "'response_format' must be an object with a string 'type'");
    const char *ts = json_string_value(t);
    if (!strcmp(ts, "text")) return KV_OK;
    if (!strcmp(ts, "json_object")) {
        json_t *schema = present(rf, "schema"); /* llama.cpp's extension: json_object with a schema */
        if (!schema) return set_kind(so, OAI_SO_JSON_OBJECT, NULL, false, P, P, err);
        return schema_field(so, schema, P, "response_format.schema", false, err);
    }
    if (strcmp(ts, "json_schema"))
        return BAD(P, "response_format type '%s' is not supported (text, json_object or json_schema)", ts);
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js))
        return BAD("response_format.json_schema", "response_format type json_schema needs a 'json_schema' object");
    json_t *name = present(js, "name"), *strict = present(js, "strict"), *schema = present(js, "schema");
    if (name && !json_is_string(name))
        return BAD("response_format.json_schema.name", "'response_format.json_schema.name' must be a string");
    if (strict && !json_is_boolean(strict))
        return BAD("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean");
    if (!schema) return set_kind(so, OAI_SO_JSON_OBJECT, NULL, false, P, P, err);
    return schema_field(so, schema, P, "response_format.json_schema.schema", strict && json_is_true(strict), err);
}

kv_status oai_parse_structured(json_t *o, struct oai_request *r, struct oai_error *err) {
    struct oai_structured *so = &r->so;
    json_t *v;
    if ((v = present(o, "response_format")) && response_format(v, so, err)) return KV_EINVAL;
    if ((v = present(o, "guided_json")) && schema_field(so, v, "guided_json", "guided_json", false, err))
        return KV_EINVAL;
    if ((v = present(o, "guided_regex"))) {
        if (!json_is_string(v)) return BAD("guided_regex", "'guided_regex' must be a string");
        if (set_kind(so, OAI_SO_REGEX, v, false, "guided_regex", "guided_regex", err)) return KV_EINVAL;
    }
    if ((v = present(o, "guided_choice"))) {
        if (choice_value(v, "guided_choice", err) || set_kind(so, OAI_SO_CHOICE, v, false, "guided_choice", "guided_choice", err))
            return KV_EINVAL;
    }
    if ((v = present(o, "guided_grammar"))) {
        if (!json_is_string(v)) return BAD("guided_grammar", "'guided_grammar' must be a string (GBNF)");
        if (set_kind(so, OAI_SO_GRAMMAR, v, false, "guided_grammar", "guided_grammar", err)) return KV_EINVAL;
    }
    /* llama.cpp's own fields: "json_schema" (a schema) and "grammar" (GBNF) */
    if ((v = present(o, "json_schema")) && schema_field(so, v, "json_schema", "json_schema", false, err))
        return KV_EINVAL;
    if ((v = present(o, "grammar"))) {
        if (!json_is_string(v)) return BAD("grammar", "'grammar' must be a string (GBNF)");
        if (set_kind(so, OAI_SO_GRAMMAR, v, false, "grammar", "grammar", err)) return KV_EINVAL;
    }
    if ((v = present(o, "guided_whitespace_pattern")))
        return BAD("guided_whitespace_pattern", "'guided_whitespace_pattern' is not supported (JSON whitespace is "
                   "fixed: docs/structured-output.md)");
    if ((v = present(o, "structured_outputs"))) {
        const char *P = "structured_outputs";
        if (!json_is_object(v)) return BAD(P, "'structured_outputs' must be an object");
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x) {
            if (json_is_null(x)) continue;
            if (!strcmp(k, "json")) {
                if (schema_field(so, x, P, "structured_outputs.json", false, err)) return KV_EINVAL;
            } else if (!strcmp(k, "regex")) {
                if (!json_is_string(x)) return BAD("structured_outputs.regex", "'structured_outputs.regex' must be a string");
                if (set_kind(so, OAI_SO_REGEX, x, false, P, "structured_outputs.regex", err)) return KV_EINVAL;
            } else if (!strcmp(k, "choice")) {
                if (choice_value(x, "structured_outputs.choice", err) || set_kind(so, OAI_SO_CHOICE, x, false, P, "structured_outputs.choice", err))
                    return KV_EINVAL;
            } else if (!strcmp(k, "grammar")) {
                if (!json_is_string(x))
                    return BAD("structured_outputs.grammar", "'structured_outputs.grammar' must be a string (GBNF)");
                if (set_kind(so, OAI_SO_GRAMMAR, x, false, P, "structured_outputs.grammar", err)) return KV_EINVAL;
            } else if (!strcmp(k, "json_object")) {
                if (!json_is_boolean(x))
                    return BAD("structured_outputs.json_object", "'structured_outputs.json_object' must be a boolean");
                if (json_is_true(x) && set_kind(so, OAI_SO_JSON_OBJECT, NULL, false, P, "structured_outputs.json_object", err)) return KV_EINVAL;
            } else {
                return BAD(P, "'structured_outputs.%s' is not supported (json, regex, choice, grammar, json_object)", k);
            }
        }
    }
    return KV_OK;
}

kv_status oai_parse_tool_choice(json_t *o, json_t *tools, struct oai_request *r, struct oai_error *err) {
    struct oai_structured *so = &r->so;
    so->parallel_tool_calls = true;
    json_t *ptc = present(o, "parallel_tool_calls");
    if (ptc && !json_is_boolean(ptc)) return BAD("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
    if (ptc) so->parallel_tool_calls = json_is_true(ptc);
    bool have_tools = tools && json_array_size(tools) > 0;
    if (have_tools) so->tools = json_incref(tools);
    so->tool_choice = OAI_TOOLS_AUTO;
    json_t *tc = present(o, "tool_choice");
    if (!tc) return KV_OK;
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (!strcmp(s, "none")) so->tool_choice = OAI_TOOLS_NONE;
        else if (!strcmp(s, "auto")) so->tool_choice = OAI_TOOLS_AUTO;
        else if (!strcmp(s, "required")) so->tool_choice = OAI_TOOLS_REQUIRED;
        else return BAD("tool_choice", "tool_choice '%s' is not supported (none, auto, required, or a named function)", s);
    } else if (json_is_object(tc)) {
        json_t *type = json_object_get(tc, "type"), *fn = json_object_get(tc, "function");
        json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
        if (!json_is_string(type) || strcmp(json_string_value(type), "function") || !json_is_string(name))
            return BAD("tool_choice", "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}");
        bool found = false;
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
            if (n && !strcmp(n, json_string_value(name))) found = true;
        }
        if (!found) return BAD("tool_choice", "tool_choice names '%s', which is not in 'tools'", json_string_value(name));
        so->tool_choice = OAI_TOOLS_NAMED;
        so->tool_name = kv_strdup(json_string_value(name));
        if (!so->tool_name) return OOM();
    } else {
        return BAD("tool_choice", "'tool_choice' must be a string or an object");
    }
    if ((so->tool_choice == OAI_TOOLS_REQUIRED || so->tool_choice == OAI_TOOLS_NAMED) && !have_tools)
        return BAD("tool_choice", "tool_choice '%s' needs 'tools'",
                   so->tool_choice == OAI_TOOLS_REQUIRED ? "required" : "function");
    return KV_OK;
}

kv_status oai_structured_compile(struct oai_request *r, enum gram_tool_fmt fmt, struct oai_error *err) {
    struct oai_structured *so = &r->so;
    bool forced = r->kind == OAI_CHAT && so->tools &&
                  (so->tool_choice == OAI_TOOLS_REQUIRED || so->tool_choice == OAI_TOOLS_NAMED);
    if (forced && so->kind != OAI_SO_NONE)
        return BAD("tool_choice", "tool_choice '%s' cannot be combined with '%s'",
                   so->tool_choice == OAI_TOOLS_REQUIRED ? "required" : "function", so->param);
    char msg[400] = "";
    kv_status st = KV_OK;
    const char *param = so->where ? so->where : so->param;
    switch (so->kind) {
    case OAI_SO_NONE:
        if (forced) {
            param = "tools";
            st = gram_compile_tool_calls(fmt ? fmt : GRAM_TOOLS_HERMES, so->tools,
                                         so->tool_choice == OAI_TOOLS_NAMED ? so->tool_name : NULL,
                                         so->parallel_tool_calls, &so->grammar, msg, sizeof msg);
        }
        break;
    case OAI_SO_JSON_OBJECT: st = gram_compile_json_object(&so->grammar, msg, sizeof msg); break;
    case OAI_SO_JSON_SCHEMA: st = gram_compile_json_schema(so->spec, so->strict, &so->grammar, msg, sizeof msg); break;
    case OAI_SO_REGEX:
        st = gram_compile_regex(json_string_value(so->spec), json_string_length(so->spec), &so->grammar, msg, sizeof msg);
        break;
    case OAI_SO_GRAMMAR:
        st = gram_compile_ebnf(json_string_value(so->spec), json_string_length(so->spec), &so->grammar, msg, sizeof msg);
        break;
    case OAI_SO_CHOICE: {
        size_t n = json_array_size(so->spec);
        const char **s = kv_calloc(n, sizeof *s);
        size_t *len = kv_calloc(n, sizeof *len);
        if (!s || !len) st = KV_ENOMEM;
        for (size_t i = 0; !st && i < n; i++) {
            s[i] = json_string_value(json_array_get(so->spec, i));
            len[i] = json_string_length(json_array_get(so->spec, i));
        }
        if (!st) st = gram_compile_choice(s, len, (int)n, &so->grammar, msg, sizeof msg);
        free(s);
        free(len);
        break;
    }
    }
    if (st == KV_ENOMEM) return OOM();
    if (st) return BAD(param, "%s: %s", param, msg);
    /* tool calls are extracted from unconstrained and forced output, not from a response_format */
    so->parse_tool_calls = r->kind == OAI_CHAT && so->tools && so->tool_choice != OAI_TOOLS_NONE &&
                           so->kind == OAI_SO_NONE;
    return KV_OK;
}

void oai_structured_free(struct oai_structured *so) {
    json_decref(so->spec);
    json_decref(so->tools);
    free(so->tool_name);
    gram_unref(so->grammar);
    memset(so, 0, sizeof *so);
}
