/*
 * prompt: a parsed request's prompt as token ids, the one implementation the worker
 * (handlers.c) and the router (kv_aware block hashes, conversation content keys) share, so
 * that both hash exactly the same ids (http.h http_prompt_ids, http_internal.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "http_internal.h"
#include "tokenizer/prefix_cache.h"

/* A copy of msgs with null contents replaced by "" (NULL if there were none, or on ENOMEM):
 * the built-in renderers (a model without a usable template) need string contents, while a
 * real template should see the null the client sent (e.g. an assistant turn that only has
 * tool_calls). */
static json_t *msgs_null_to_empty(const json_t *msgs) {
    bool any = false;
    size_t i;
    json_t *m;
    json_array_foreach((json_t *)msgs, i, m) any = any || json_is_null(json_object_get(m, "content"));
    if (!any) return NULL;
    json_t *c = json_deep_copy(msgs);
    if (!c) return NULL;
    json_array_foreach(c, i, m) {
        json_t *ct = json_object_get(m, "content");
        if (json_is_null(ct)) json_object_set_new(m, "content", json_string(""));
    }
    return c;
}

static kv_status render_chat(const tokenizer_t *t, const struct oai_request *r, char **out, char *err,
                             size_t errlen) {
    kv_status st = tok_chat_render_json(t, r->chat_msgs, r->chat_kwargs, r->add_generation_prompt, out,
                                        err, errlen);
    if (st == KV_EINVAL) {
        json_t *alt = msgs_null_to_empty(r->chat_msgs);
        if (alt) {
            char err2[512] = "";
            if (tok_chat_render_json(t, alt, r->chat_kwargs, r->add_generation_prompt, out, err2,
                                     sizeof err2) == KV_OK)
                st = KV_OK;
            json_decref(alt);
        }
    }
    return st;
}

/* continue_final_message (vLLM, Hugging Face's apply_chat_template): the rendered prompt ends
 * right after the last occurrence of the final message's content (whitespace-stripped), so
 * the template's end-of-turn markup is cut and the model continues that message. KV_EINVAL if
 * the template does not reproduce the content. */
static bool is_ws(char ch) { return ch == ' ' || (ch >= '\t' && ch <= '\r'); }

static kv_status cut_after_final(const struct oai_request *r, char *rendered, char *err,
                                 size_t errlen) {
    json_t *last = json_array_get(r->chat_msgs, json_array_size(r->chat_msgs) - 1);
    const char *c = json_string_value(json_object_get(last, "content"));
    if (!c) return kv_errf(KV_EINVAL, err, errlen, "continue_final_message needs a final message with text content");
    size_t n = strlen(c);
    while (n && is_ws(c[n - 1])) n--;
    while (n && is_ws(*c)) c++, n--;
    char *hit = NULL;
    if (n == 0) hit = rendered + strlen(rendered); /* empty final message: keep everything */
    else
        for (char *p = rendered; (p = memmem(p, strlen(p), c, n)) != NULL; p++) hit = p;
    if (!hit)
        return kv_errf(KV_EINVAL, err, errlen, "continue_final_message: the final message does not "
                       "appear in the prompt rendered by the chat template");
    if (n) hit[n] = 0;
    return KV_OK;
}

static kv_status copy_ids(const int32_t *src, size_t n, int32_t **ids, size_t *n_out) {
    *ids = kv_malloc((n ? n : 1) * sizeof **ids);
    if (!*ids) return KV_ENOMEM;
    if (n) memcpy(*ids, src, n * sizeof **ids);
    *n_out = n;
    return KV_OK;
}

kv_status oai_prompt_ids(const tokenizer_t *t, struct prefix_cache *pc, const struct oai_request *r,
                         bool add_special, int32_t **ids, size_t *n, char *err, size_t errlen) {
    return oai_prompt_ids_bounded(t, pc, r, add_special, 0, ids, n, err, errlen);
}

kv_status oai_prompt_ids_bounded(const tokenizer_t *t, struct prefix_cache *pc,
                                 const struct oai_request *r, bool add_special, size_t max_bytes,
                                 int32_t **ids, size_t *n, char *err, size_t errlen) {
    if (r->disagg.prompt_ids) /* generation leg: the context worker's prompt, as it was run */
        return copy_ids(r->disagg.prompt_ids, r->disagg.n_prompt_ids, ids, n);
    if (r->ids) return copy_ids(r->ids, r->n_ids, ids, n);
    char *rendered = NULL;
    const char *text = r->text;
    size_t len = r->text_len;
    if (r->chat_msgs) {
        kv_status st = render_chat(t, r, &rendered, err, errlen);
        if (!st && r->continue_final_message) st = cut_after_final(r, rendered, err, errlen);
        if (st) {
            free(rendered);
            return st;
        }
        text = rendered;
        len = strlen(rendered);
        if (max_bytes && len > max_bytes) {
            free(rendered);
            return KV_ETOOLONG;
        }
        /* the template may write BOS itself: then no second one (tokenizer.h, llama.cpp) */
        if (add_special && tok_text_starts_with_bos(t, text, len)) add_special = false;
    }
    kv_status st = pc ? prefix_cache_encode(pc, text ? text : "", len, add_special, true, ids, n)
                      : tok_encode(t, text ? text : "", len, add_special, true, ids, n);
    free(rendered);
    return st ? KV_ENOMEM : KV_OK;
}

kv_status http_prompt_ids(const tokenizer_t *t, bool chat, const char *body, size_t len, int32_t **ids,
                          size_t *n, char **cache_salt, char *err, size_t errlen) {
    struct oai_request r;
    struct oai_error e;
    struct oai_limits lim = {.served_name = NULL, .n_vocab = t ? tok_n_vocab(t) : 1 << 30};
    *ids = NULL;
    *n = 0;
    if (cache_salt) *cache_salt = NULL;
    if (oai_parse(chat ? OAI_CHAT : OAI_COMPLETION, body, len, &lim, &r, &e)) {
        snprintf(err, errlen, "%s", e.message);
        return KV_EINVAL;
    }
    kv_status st = KV_EINVAL;
    if (t || r.ids) st = oai_prompt_ids(t, NULL, &r, true, ids, n, err, errlen);
    else snprintf(err, errlen, "a text prompt needs a tokenizer");
    if (!st && cache_salt && r.cache_salt && !(*cache_salt = strdup(r.cache_salt))) {
        free(*ids);
        *ids = NULL;
        st = KV_ENOMEM;
    }
    oai_request_free(&r);
    return st;
}
