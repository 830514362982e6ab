/* chat: chat-template rendering. A model's own chat_template is rendered by the Jinja
 * interpreter (jinja/); models without one (and templates the interpreter cannot parse, with
 * a warning) use the built-in family renderers below (ChatML, Llama-3, Mistral/Llama-2).
 *
 * The built-in renderers reproduce what the vendors' Jinja templates emit for plain conversations
 * (string contents, roles system/user/assistant, Qwen's tool role), including the BOS text
 * when the template writes it (Llama-3: "<|begin_of_text|>", Llama-2/Mistral: "<s>").
 * tok_encode(add_special = true) does not add a second BOS when the text already starts
 * with it, so rendering + encoding yields exactly one BOS. */
#include <stdlib.h>
#include <string.h>

#include "jinja/jinja.h"
#include "tok_internal.h"

static const char *k_names[] = {"chatml", "llama3", "mistral"};

const char *chat_format_name(chat_format f) {
    return (unsigned)f < 3 ? k_names[f] : "unknown";
}

chat_format tok_chat_format(const tokenizer_t *t) { return t->chat_fmt; }
const char *tok_chat_template(const tokenizer_t *t) { return t ? t->chat_template : NULL; }

void tok_chat_detect(tokenizer_t *t) {
    const char *s = t->chat_template;
    t->chat_fmt = CHAT_FMT_CHATML;
    if (!s) return;
    {
        jinja_template_t *tpl;
        char err[256];
        if (jinja_parse(s, strlen(s), &tpl, err, sizeof err) == KV_OK) jinja_free(tpl);
        else KV_WARN("tokenizer: the model's chat template is not supported (%s); using the built-in renderer", err);
    }
    if (strstr(s, "<|im_start|>")) {
        t->chat_qwen_think = strstr(s, "</think>") != NULL;
    } else if (strstr(s, "<|start_header_id|>")) {
        t->chat_fmt = CHAT_FMT_LLAMA3;
        t->chat_gen_always = strstr(s, "add_generation_prompt") == NULL;
    } else if (strstr(s, "[INST]")) {
        t->chat_fmt = CHAT_FMT_MISTRAL;
        t->chat_llama2_sys = strstr(s, "<<SYS>>") != NULL;
    }
}

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* Python str.strip(chars) subset: whitespace (chars == NULL) or a single char set. */
static void strip_span(const char **s, size_t *n, const char *chars, bool left, bool right) {
    while (left && *n && (chars ? strchr(chars, **s) != NULL : is_ws(**s))) {
        (*s)++;
        (*n)--;
    }
    while (right && *n && (chars ? strchr(chars, (*s)[*n - 1]) != NULL : is_ws((*s)[*n - 1]))) (*n)--;
}

static kv_status put(kv_buf *b, const char *s, size_t n) { return kv_buf_append(b, s, n) ? KV_ENOMEM : KV_OK; }
#define PUTS(b, s) put((b), (s), strlen(s))

static const char *rfind(const char *s, const char *pat) {
    const char *r = NULL, *p = s;
    while ((p = strstr(p, pat))) r = p++;
    return r;
}

static kv_status render_chatml(const tokenizer_t *t, const struct chat_message *m, size_t n, bool gen, kv_buf *b) {
    kv_status st = KV_OK;
    size_t last_query = n - 1;
    if (t->chat_qwen_think) {
        for (size_t k = n; k-- > 0;) {
            const char *c = m[k].content;
            size_t cl = strlen(c);
            bool tool_resp = cl >= 15 && !strncmp(c, "<tool_response>", 15) && cl >= 16 &&
                             !strcmp(c + cl - 16, "</tool_response>");
            if (!strcmp(m[k].role, "user") && !tool_resp) {
                last_query = k;
                break;
            }
        }
    }
    for (size_t i = 0; i < n && !st; i++) {
        const char *role = m[i].role, *c = m[i].content;
        if (t->chat_qwen_think && !strcmp(role, "tool")) {
            if (i == 0 || strcmp(m[i - 1].role, "tool")) st = PUTS(b, "<|im_start|>user");
            if (!st) st = PUTS(b, "\n<tool_response>\n");
            if (!st) st = PUTS(b, c);
            if (!st) st = PUTS(b, "\n</tool_response>");
            if (!st && (i + 1 == n || strcmp(m[i + 1].role, "tool"))) st = PUTS(b, "<|im_end|>\n");
            continue;
        }
        if (t->chat_qwen_think && !strcmp(role, "assistant")) {
            const char *content = c, *reason = "";
            size_t cl = strlen(c), rl = 0;
            const char *end = strstr(c, "</think>");
            if (end) {
                const char *after = rfind(c, "</think>") + 8; /* split('</think>')[-1] */
                content = after;
                cl = strlen(after);
                strip_span(&content, &cl, "\n", true, false);
                /* split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') */
                size_t fl = (size_t)(end - c);
                const char *f = c;
                strip_span(&f, &fl, "\n", false, true);
                const char *th = NULL;
                for (const char *p = f; p + 7 <= f + fl; p++)
                    if (!strncmp(p, "<think>", 7)) th = p;
                if (th) {
                    fl -= (size_t)(th + 7 - f);
                    f = th + 7;
                }
                strip_span(&f, &fl, "\n", true, false);
                reason = f;
                rl = fl;
            }
            st = PUTS(b, "<|im_start|>assistant\n");
            if (!st && i > last_query && (i + 1 == n || rl > 0)) {
                const char *r = reason;
                size_t r2 = rl;
                strip_span(&r, &r2, "\n", true, true);
                const char *cc = content;
                size_t c2 = cl;
                strip_span(&cc, &c2, "\n", true, false);
                st = PUTS(b, "<think>\n");
                if (!st) st = put(b, r, r2);
                if (!st) st = PUTS(b, "\n</think>\n\n");
                if (!st) st = put(b, cc, c2);
            } else if (!st) {
                st = put(b, content, cl);
            }
            if (!st) st = PUTS(b, "<|im_end|>\n");
            continue;
        }
        st = PUTS(b, "<|im_start|>");
        if (!st) st = PUTS(b, role);
        if (!st) st = PUTS(b, "\n");
        if (!st) st = PUTS(b, c);
        if (!st) st = PUTS(b, "<|im_end|>\n");
    }
    if (!st && gen) st = PUTS(b, "<|im_start|>assistant\n");
    return st;
}

static kv_status render_llama3(const tokenizer_t *t, const struct chat_message *m, size_t n, bool gen, kv_buf *b) {
    kv_status st = KV_OK;
    if (t->bos >= 0) st = PUTS(b, t->tok[t->bos].s);
    for (size_t i = 0; i < n && !st; i++) {
        const char *c = m[i].content;
        size_t cl = strlen(c);
        strip_span(&c, &cl, NULL, true, true); /* Jinja | trim */
        st = PUTS(b, "<|start_header_id|>");
        if (!st) st = PUTS(b, m[i].role);
        if (!st) st = PUTS(b, "<|end_header_id|>\n\n");
        if (!st) st = put(b, c, cl);
        if (!st) st = PUTS(b, "<|eot_id|>");
    }
    if (!st && (gen || t->chat_gen_always)) st = PUTS(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return st;
}

/* Llama-2-chat: [bos][INST] (<<SYS>>\n..\n<</SYS>>\n\n)user [/INST] assistant [eos]...
 * Mistral-Instruct: [bos][INST] user [/INST]assistant[eos]... (a system message is put in
 * front of the first user turn, separated by a blank line). */
static kv_status render_mistral(const tokenizer_t *t, const struct chat_message *m, size_t n, kv_buf *b, char *err,
                                size_t errlen) {
    const char *bos = t->bos >= 0 ? t->tok[t->bos].s : "", *eos = t->eos >= 0 ? t->tok[t->eos].s : "";
    const char *sys = NULL;
    size_t start = 0;
    if (!strcmp(m[0].role, "system")) {
        sys = m[0].content;
        start = 1;
    }
    kv_status st = KV_OK;
    if (!t->chat_llama2_sys) st = PUTS(b, bos);
    for (size_t i = start; i < n && !st; i++) {
        bool user = !strcmp(m[i].role, "user");
        if (user != ((i - start) % 2 == 0) || (!user && strcmp(m[i].role, "assistant")))
            return kv_errf(KV_EINVAL, err, errlen,
                           "chat: role '%s' at message %zu: this template needs alternating user/assistant turns "
                           "(after an optional first system message)",
                           m[i].role, i);
        kv_buf c;
        kv_buf_init(&c);
        if (i == start && sys) {
            if (t->chat_llama2_sys) st = PUTS(&c, "<<SYS>>\n");
            if (!st) st = PUTS(&c, sys);
            if (!st) st = PUTS(&c, t->chat_llama2_sys ? "\n<</SYS>>\n\n" : "\n\n");
        }
        if (!st) st = PUTS(&c, m[i].content);
        const char *cs = c.data ? c.data : "";
        size_t cl = c.len;
        if (t->chat_llama2_sys) strip_span(&cs, &cl, NULL, true, true);
        if (!st && user) {
            if (t->chat_llama2_sys) st = PUTS(b, bos);
            if (!st) st = PUTS(b, "[INST] ");
            if (!st) st = put(b, cs, cl);
            if (!st) st = PUTS(b, " [/INST]");
        } else if (!st) {
            if (t->chat_llama2_sys) st = PUTS(b, " ");
            if (!st) st = put(b, cs, cl);
            if (!st && t->chat_llama2_sys) st = PUTS(b, " ");
            if (!st) st = PUTS(b, eos);
        }
        kv_buf_free(&c);
    }
    return st;
}

static kv_status render_builtin(const tokenizer_t *t, const struct chat_message *msgs, size_t n,
                                bool add_generation_prompt, char **out, char *err, size_t errlen) {
    kv_buf b;
    kv_buf_init(&b);
    kv_status st;
    switch (t->chat_fmt) {
    case CHAT_FMT_LLAMA3: st = render_llama3(t, msgs, n, add_generation_prompt, &b); break;
    case CHAT_FMT_MISTRAL: st = render_mistral(t, msgs, n, &b, err, errlen); break;
    default: st = render_chatml(t, msgs, n, add_generation_prompt, &b); break;
    }
    if (st) {
        kv_buf_free(&b);
        return st;
    }
    if (!b.data && kv_buf_append(&b, "", 1) == 0) b.len = 0;
    kv_buf_cstr(&b);
    *out = b.data;
    return KV_OK;
}

/* ---- the model's template through the interpreter ---- */

static bool template_usable(const char *src) {
    jinja_template_t *tpl;
    if (jinja_parse(src, strlen(src), &tpl, NULL, 0) != KV_OK) return false;
    jinja_free(tpl);
    return true;
}

kv_status tok_chat_render_template(const char *template_src, const char *bos, const char *eos,
                                   const struct json_t *messages, const struct json_t *kwargs,
                                   bool add_generation_prompt, char **out, char *err, size_t errlen) {
    if (!template_src || !messages || !out) return kv_errf(KV_EINVAL, err, errlen, "chat: NULL argument");
    if (!json_is_array(messages)) return kv_errf(KV_EINVAL, err, errlen, "chat: messages must be a JSON array");
    if (kwargs && !json_is_object(kwargs)) return kv_errf(KV_EINVAL, err, errlen, "chat: template kwargs must be a JSON object");
    jinja_template_t *tpl;
    kv_status st = jinja_parse(template_src, strlen(template_src), &tpl, err, errlen);
    if (st) return st;
    json_t *ctx = json_object();
    if (!ctx) {
        jinja_free(tpl);
        return kv_errf(KV_ENOMEM, err, errlen, "chat: out of memory");
    }
    const char *k;
    json_t *v;
    if (kwargs)
        json_object_foreach((json_t *)kwargs, k, v) json_object_set(ctx, k, v);
    json_object_set(ctx, "messages", (json_t *)messages);
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(add_generation_prompt));
    json_object_set_new(ctx, "bos_token", bos ? json_string(bos) : json_null());
    json_object_set_new(ctx, "eos_token", eos ? json_string(eos) : json_null());
    size_t len;
    st = jinja_render(tpl, ctx, out, &len, err, errlen);
    json_decref(ctx);
    jinja_free(tpl);
    return st;
}

static const char *special_str(const tokenizer_t *t, int id) {
    return id >= 0 && id < t->n_tok ? t->tok[id].s : NULL;
}

kv_status tok_chat_render_json(const tokenizer_t *t, const struct json_t *messages, const struct json_t *kwargs,
                               bool add_generation_prompt, char **out, char *err, size_t errlen) {
    if (!t || !messages || !out) return kv_errf(KV_EINVAL, err, errlen, "chat: NULL argument");
    if (!json_is_array(messages) || json_array_size(messages) == 0)
        return kv_errf(KV_EINVAL, err, errlen, "chat: empty message list");
    if (t->chat_template && template_usable(t->chat_template))
        return tok_chat_render_template(t->chat_template, special_str(t, t->bos), special_str(t, t->eos), messages,
                                        kwargs, add_generation_prompt, out, err, errlen);
    /* built-in renderer: plain role/content string pairs only */
    size_t n = json_array_size(messages);
    struct chat_message *m = calloc(n, sizeof *m);
    if (!m) return kv_errf(KV_ENOMEM, err, errlen, "chat: out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *msg = json_array_get(messages, i);
        m[i].role = json_string_value(json_object_get(msg, "role"));
        m[i].content = json_string_value(json_object_get(msg, "content"));
        if (!m[i].role || !m[i].content) {
            free(m);
            return kv_errf(KV_EINVAL, err, errlen,
                           "chat: message %zu needs string role and content (the built-in renderer supports nothing else)", i);
        }
    }
    kv_status st = render_builtin(t, m, n, add_generation_prompt, out, err, errlen);
    free(m);
    return st;
}

kv_status tok_chat_render(const tokenizer_t *t, const struct chat_message *msgs, size_t n, bool add_generation_prompt,
                          char **out, char *err, size_t errlen) {
    if (!t || !out) return kv_errf(KV_EINVAL, err, errlen, "chat: NULL argument");
    if (!msgs || n == 0) return kv_errf(KV_EINVAL, err, errlen, "chat: empty message list");
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return kv_errf(KV_EINVAL, err, errlen, "chat: message %zu has no role or content", i);
    if (!t->chat_template || !template_usable(t->chat_template))
        return render_builtin(t, msgs, n, add_generation_prompt, out, err, errlen);
    json_t *arr = json_array();
    kv_status st = arr ? KV_OK : KV_ENOMEM;
    for (size_t i = 0; i < n && !st; i++) {
        json_t *o = json_pack("{s:s,s:s}", "role", msgs[i].role, "content", msgs[i].content);
        if (!o || json_array_append_new(arr, o)) st = KV_ENOMEM;
    }
    if (st) {
        json_decref(arr);
        return kv_errf(st, err, errlen, "chat: out of memory (or a message is not valid UTF-8)");
    }
    st = tok_chat_render_json(t, arr, NULL, add_generation_prompt, out, err, errlen);
    json_decref(arr);
    return st;
}
