/*
 * openai_sampling: the request fields that shape sampling and scheduling beyond the basic
 * ones of openai.c: n (with best_of), logit_bias, stop_token_ids, min_tokens and priority.
 * Ranges follow OpenAI (n <= 128, logit_bias values in [-100, 100]) and vLLM (stop_token_ids,
 * min_tokens <= max_tokens, priority: any integer, lower = more urgent); each field reaches
 * the engine (engine_request_params), none is accepted and ignored.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

#define BAD(param, ...) oai_errf(err, 400, "invalid_request_error", param, NULL, __VA_ARGS__)
#define OOM() oai_errf(err, 500, "server_error", NULL, NULL, "out of memory")

static int64_t vocab_end(const struct oai_limits *lim) {
    return lim && lim->n_vocab > 0 ? lim->n_vocab : (int64_t)INT32_MAX + 1;
}

/* logit_bias: {"<token id>": bias, ...} (OpenAI: string keys; ids in the vocabulary, biases
 * in [-100, 100]). */
static kv_status parse_logit_bias(json_t *o, const struct oai_limits *lim, struct oai_request *r,
                                  struct oai_error *err) {
    json_t *lb = oai_field(o, "logit_bias");
    if (!lb) return KV_OK;
    if (!json_is_object(lb))
        return BAD("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
    size_t n = json_object_size(lb);
    if (n == 0) return KV_OK;
    r->logit_bias = kv_malloc(n * sizeof *r->logit_bias);
    if (!r->logit_bias) return OOM();
    const char *k;
    json_t *v;
    int64_t end = vocab_end(lim);
    json_object_foreach(lb, k, v) {
        char *tail = NULL;
        errno = 0;
        long long id = strtoll(k, &tail, 10);
        if (!*k || *tail || errno || id < 0 || id >= end)
            return BAD("logit_bias", "'logit_bias' key '%.40s' is not a token id in [0, %lld)", k,
                       (long long)end);
        if (!json_is_number(v))
            return BAD("logit_bias", "'logit_bias' value of token %lld must be a number", id);
        double b = json_number_value(v);
        if (!isfinite(b) || b < -100.0 || b > 100.0)
            return BAD("logit_bias", "'logit_bias' value of token %lld must be in [-100, 100], got %g",
                       id, b);
        r->logit_bias[r->n_logit_bias].id = (int32_t)id;
        r->logit_bias[r->n_logit_bias].bias = (float)b;
        r->n_logit_bias++;
    }
    return KV_OK;
}

static kv_status parse_stop_token_ids(json_t *o, const struct oai_limits *lim,
                                      struct oai_request *r, struct oai_error *err) {
    json_t *a = oai_field(o, "stop_token_ids");
    if (!a) return KV_OK;
    if (!json_is_array(a)) return BAD("stop_token_ids", "'stop_token_ids' must be an array of token ids");
    size_t n = json_array_size(a);
    if (n > OAI_MAX_STOP_TOKEN_IDS)
        return BAD("stop_token_ids", "at most %d stop_token_ids are supported", OAI_MAX_STOP_TOKEN_IDS);
    if (n == 0) return KV_OK;
    r->stop_token_ids = kv_malloc(n * sizeof *r->stop_token_ids);
    if (!r->stop_token_ids) return OOM();
    int64_t end = vocab_end(lim);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= end)
            return BAD("stop_token_ids", "'stop_token_ids[%zu]' must be a token id in [0, %lld)", i,
                       (long long)end);
        r->stop_token_ids[r->n_stop_token_ids++] = (int32_t)json_integer_value(v);
    }
    return KV_OK;
}

kv_status oai_parse_sampling(json_t *o, const struct oai_limits *lim, struct oai_request *r,
                             struct oai_error *err) {
    bool present;
    int64_t x;
    r->n = 1;
    if (oai_get_int(o, "n", 1, ENGINE_MAX_CHOICES, &present, &x, err)) return KV_EINVAL;
    if (present) r->n = (int)x;
    json_t *bo = oai_field(o, "best_of");
    if (bo && !(json_is_integer(bo) && json_integer_value(bo) == r->n))
        return BAD("best_of", "'best_of' must equal 'n' (%d): choosing the best of more "
                   "choices is not supported", r->n);
    if (parse_logit_bias(o, lim, r, err) || parse_stop_token_ids(o, lim, r, err)) return KV_EINVAL;
    int64_t hi = r->max_tokens > 0 ? r->max_tokens : lim && lim->max_model_len > 0 ? lim->max_model_len : INT32_MAX;
    if (oai_get_int(o, "min_tokens", 0, hi, &present, &x, err)) {
        if (err->status == 400 && r->max_tokens > 0) /* name the field the client sent */
            snprintf(err->message, sizeof err->message, "'min_tokens' must be between 0 and '%s' (%d)",
                     r->kind == OAI_CHAT && oai_field(o, "max_completion_tokens") ? "max_completion_tokens"
                                                                                         : "max_tokens",
                     r->max_tokens);
        return KV_EINVAL;
    }
    if (present) r->min_tokens = (int)x;
    if (oai_get_int(o, "priority", INT32_MIN, INT32_MAX, &present, &x, err)) return KV_EINVAL;
    if (present) r->priority = (int)x;
    return KV_OK;
}
