/*
 * Tool-call formats (grammar.h): which format a chat template uses, the grammar that forces
 * calls (tool_choice "required" or a named function), and the streaming extraction of calls
 * from a model's output text.
 *
 *   hermes:       text <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> ...
 *   llama3_json:  {"name": ..., "parameters": {...}}; {"name": ...}      (the whole output)
 *   mistral:      text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
 *
 * Extraction state machine (one per request):
 *
 *   CONTENT --marker seen--> IN_CALL --end seen (hermes)--> CONTENT
 *      text passes through, except a tail that may be the start of the marker (held back);
 *      llama3_json decides at the first non-blank character ('{' = calls) and then holds
 *      everything; mistral holds everything after [TOOL_CALLS]. A held region that does not
 *      parse as calls is released as content at the end, so no text is ever lost.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

enum gram_tool_fmt gram_tool_fmt_detect(const char *t) {
    if (!t) return GRAM_TOOLS_HERMES;
    if (strstr(t, "[TOOL_CALLS]")) return GRAM_TOOLS_MISTRAL;
    if (strstr(t, "<tool_call>")) return GRAM_TOOLS_HERMES;
    if (strstr(t, "<|python_tag|>") || (strstr(t, "<|start_header_id|>") && strstr(t, "\"parameters\"")))
        return GRAM_TOOLS_LLAMA3_JSON;
    return GRAM_TOOLS_HERMES;
}

const char *gram_tool_fmt_name(enum gram_tool_fmt f) {
    switch (f) {
    case GRAM_TOOLS_HERMES: return "hermes";
    case GRAM_TOOLS_LLAMA3_JSON: return "llama3_json";
    case GRAM_TOOLS_MISTRAL: return "mistral";
    default: return "none";
    }
}

enum gram_tool_fmt gram_tool_fmt_from_name(const char *s) {
    if (!s) return GRAM_TOOLS_NONE;
    if (!strcmp(s, "hermes")) return GRAM_TOOLS_HERMES;
    if (!strcmp(s, "llama3_json")) return GRAM_TOOLS_LLAMA3_JSON;
    if (!strcmp(s, "mistral")) return GRAM_TOOLS_MISTRAL;
    return GRAM_TOOLS_NONE;
}

/* ---------------------------------------------------------------- forced calls */

struct tools_arg {
    enum gram_tool_fmt fmt;
    const json_t *tools;
    const char *only;
    bool parallel;
};

static kv_status build_tools(struct gb *b, void *arg, int *root, char *err, size_t errlen) {
    struct tools_arg *a = arg;
    struct gn *calls = gn_alt(b);
    size_t i;
    json_t *t;
    struct gsc *base = gsc_new(b, NULL, false, err, errlen);
    if (!base) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    json_array_foreach(a->tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || (a->only && strcmp(name, a->only))) continue;
        /* arguments follow "parameters" with strict semantics (members not listed are never
         * generated); no parameters = an empty object */
        json_t *params = json_object_get(fn, "parameters");
        json_t *any = NULL;
        if (!params) params = any = json_pack("{s:s}", "type", "object");
        struct gsc *c = gsc_new(b, params, true, err, errlen);
        char path[300];
        snprintf(path, sizeof path, "tools[%zu].function.parameters#", i);
        struct gn *args = c ? gsc_node(c, params, path) : NULL;
        kv_status st = c ? gsc_status(c) : KV_ENOMEM;
        gsc_free(c);
        json_decref(any);
        if (st) {
            gsc_free(base);
            return st == KV_ENOMEM ? kv_errf(st, err, errlen, "out of memory") : st;
        }
        json_t *js = json_string(name);
        char *qn = js ? json_dumps(js, JSON_ENCODE_ANY) : NULL;
        json_decref(js);
        if (!qn) {
            gsc_free(base);
            return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
        }
        /* {"name": "f", "arguments": ARGS} with JSON whitespace between tokens */
        struct gn *call = gn_seq(b);
        gn_add(b, call, gn_str(b, "{"));
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, gn_str(b, "\"name\""));
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, gn_str(b, ":"));
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, gn_str(b, qn));
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, gn_str(b, ","));
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, gn_str(b, a->fmt == GRAM_TOOLS_LLAMA3_JSON ? "\"parameters\"" : "\"arguments\""));
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, gn_str(b, ":"));
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, args);
        gn_add(b, call, gsc_ws(base));
        gn_add(b, call, gn_str(b, "}"));
        free(qn);
        gn_add(b, calls, call);
    }
    gsc_free(base);
    if (!calls || calls->n_kids == 0)
        return kv_errf(KV_EINVAL, err, errlen, "no tool named '%s' in 'tools'", a->only ? a->only : "");
    int rc = gb_rule_new(b, "tool-call");
    gb_rule_set(b, rc, calls);
    struct gn *one, *sep;
    switch (a->fmt) {
    case GRAM_TOOLS_LLAMA3_JSON:
        one = gn_ref(b, rc);
        sep = gn_str(b, "; ");
        break;
    case GRAM_TOOLS_MISTRAL:
        one = gn_ref(b, rc);
        sep = gn_str(b, ", ");
        break;
    default:
        one = gn_seq3(b, gn_str(b, "<tool_call>\n"), gn_ref(b, rc), gn_str(b, "\n</tool_call>"));
        sep = gn_str(b, "\n");
        break;
    }
    struct gn *list = a->parallel ? gn_seq2(b, one, gn_rep(b, gn_seq2(b, sep, one), 0, -1)) : one;
    if (a->fmt == GRAM_TOOLS_MISTRAL) list = gn_seq3(b, gn_str(b, "[TOOL_CALLS]["), list, gn_str(b, "]"));
    int r = gb_rule_new(b, "root");
    gb_rule_set(b, r, list);
    *root = r;
    return KV_OK;
}

kv_status gram_compile_tool_calls(enum gram_tool_fmt fmt, const json_t *tools, const char *only_name,
                                  bool parallel, gram_t **out, char *err, size_t errlen) {
    if (fmt == GRAM_TOOLS_NONE) return kv_errf(KV_EINVAL, err, errlen, "no tool-call format");
    if (!json_is_array(tools) || json_array_size(tools) == 0)
        return kv_errf(KV_EINVAL, err, errlen, "'tools' is empty");
    char *txt = json_dumps(tools, JSON_COMPACT);
    if (!txt) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    kv_buf key;
    kv_buf_init(&key);
    kv_status st = kv_buf_printf(&key, "tools:%d:%d:%s:%s", (int)fmt, parallel ? 1 : 0, only_name ? only_name : "", txt);
    free(txt);
    if (st) {
        kv_buf_free(&key);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    struct tools_arg a = {fmt, tools, only_name, parallel};
    st = gram_compile_cached(key.data, key.len, build_tools, &a, out, err, errlen);
    kv_buf_free(&key);
    return st;
}

/* ---------------------------------------------------------------- extraction */

void gram_tool_calls_free(struct gram_tool_call *c, int n) {
    for (int i = 0; c && i < n; i++) {
        free(c[i].name);
        free(c[i].arguments);
    }
    free(c);
}

enum { TS_CONTENT = 0, TS_IN_CALL, TS_UNDECIDED, TS_PLAIN };

struct gram_tool_stream {
    enum gram_tool_fmt fmt;
    int state;
    kv_buf held;               /* text not yet released (marker prefix, call body) */
    kv_buf ws;                 /* blanks after a call, released only if content follows */
    int n_calls;
};

gram_tool_stream_t *gram_tool_stream_new(enum gram_tool_fmt fmt) {
    gram_tool_stream_t *s = kv_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->fmt = fmt;
    s->state = fmt == GRAM_TOOLS_LLAMA3_JSON ? TS_UNDECIDED : TS_CONTENT;
    kv_buf_init(&s->held);
    kv_buf_init(&s->ws);
    return s;
}

void gram_tool_stream_free(gram_tool_stream_t *s) {
    if (!s) return;
    kv_buf_free(&s->held);
    kv_buf_free(&s->ws);
    free(s);
}

int gram_tool_stream_n_calls(const gram_tool_stream_t *s) { return s->n_calls; }

static bool blank(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

static const char *memfind(const char *h, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(h + i, needle, k)) return h + i;
    return NULL;
}

/* Length of the longest suffix of s[0..n) that is a proper prefix of marker. */
static size_t partial_tail(const char *s, size_t n, const char *marker) {
    size_t k = strlen(marker);
    for (size_t l = k - 1 < n ? k - 1 : n; l > 0; l--)
        if (!memcmp(s + n - l, marker, l)) return l;
    return 0;
}

static void drop_front(kv_buf *b, size_t n) {
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
}

/* Content out, with the blanks held after a call released first (only when real text
 * follows them). */
static kv_status emit(gram_tool_stream_t *s, kv_buf *out, const char *p, size_t n) {
    if (n == 0) return KV_OK;
    if (s->n_calls > 0) {
        size_t k = 0;
        while (k < n && blank(p[k])) k++;
        if (k == n) return kv_buf_append(&s->ws, p, n);
        if (s->ws.len && kv_buf_append(out, s->ws.data, s->ws.len)) return KV_ENOMEM;
        s->ws.len = 0;
    }
    return kv_buf_append(out, p, n);
}

/* A call from a parsed object: {"name": string, "arguments"|"parameters": object or JSON
 * text of one}. false if it is not one. */
static bool call_from(json_t *o, struct gram_tool_call *c) {
    json_t *name = json_object_get(o, "name");
    if (!json_is_object(o) || !json_is_string(name) || json_string_length(name) == 0) return false;
    json_t *args = json_object_get(o, "arguments");
    if (!args) args = json_object_get(o, "parameters");
    json_t *parsed = NULL;
    if (json_is_string(args)) {
        parsed = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
        if (!json_is_object(parsed)) {
            json_decref(parsed);
            return false;
        }
        args = parsed;
    }
    if (args && !json_is_object(args)) return false;
    c->name = kv_strdup(json_string_value(name));
    c->arguments = args ? json_dumps(args, JSON_COMPACT) : kv_strdup("{}");
    json_decref(parsed);
    if (!c->name || !c->arguments) {
        free(c->name);
        free(c->arguments);
        return false;
    }
    return true;
}

static kv_status add_calls(struct gram_tool_call **calls, int *n, struct gram_tool_call *add, int n_add) {
    if (n_add == 0) return KV_OK;
    struct gram_tool_call *nc = kv_realloc(*calls, (size_t)(*n + n_add) * sizeof *nc);
    if (!nc) return KV_ENOMEM;
    memcpy(nc + *n, add, (size_t)n_add * sizeof *add);
    *calls = nc;
    *n += n_add;
    return KV_OK;
}

/* Parses s[0..n) as a sequence of call objects separated by sep (';' or ','), optionally
 * inside one JSON array. Returns the count (heap array in *out) or -1 if it is not that. */
static int parse_call_list(const char *s, size_t n, struct gram_tool_call **out) {
    while (n && blank(*s)) s++, n--;
    while (n && blank(s[n - 1])) n--;
    if (n == 0) return -1;
    json_error_t je;
    json_t *v = json_loadb(s, n, 0, &je);
    struct gram_tool_call *c = NULL;
    int k = 0;
    if (v) { /* one object or one array of objects */
        size_t m = json_is_array(v) ? json_array_size(v) : 1;
        c = kv_calloc(m ? m : 1, sizeof *c);
        for (size_t i = 0; c && i < m; i++) {
            if (!call_from(json_is_array(v) ? json_array_get(v, i) : v, &c[k])) {
                json_decref(v);
                gram_tool_calls_free(c, k);
                return -1;
            }
            k++;
        }
        json_decref(v);
        if (!c || k == 0) {
            free(c);
            return -1;
        }
        *out = c;
        return k;
    }
    /* objects separated by ';' (llama3_json parallel calls) */
    size_t off = 0;
    while (off < n) {
        json_t *o = json_loadb(s + off, n - off, JSON_DISABLE_EOF_CHECK, &je);
        struct gram_tool_call one;
        if (!o || !call_from(o, &one)) {
            json_decref(o);
            gram_tool_calls_free(c, k);
            return -1;
        }
        json_decref(o);
        struct gram_tool_call *nc = kv_realloc(c, (size_t)(k + 1) * sizeof *nc);
        if (!nc) {
            free(one.name);
            free(one.arguments);
            gram_tool_calls_free(c, k);
            return -1;
        }
        c = nc;
        c[k++] = one;
        off += je.position;
        while (off < n && blank(s[off])) off++;
        if (off < n && s[off] == ';') off++;
        while (off < n && blank(s[off])) off++;
    }
    *out = c;
    return k;
}

/* The "</tool_call>" that ends a hermes call body: the first one outside a JSON string, so
 * an argument whose text contains the tag ({"q": "</tool_call>"}) does not cut the call.
 * NULL while there is none yet (a body whose quotes never balance ends at the end of the
 * output, where gram_tool_stream_finish parses or releases it). */
static const char *close_tag(const char *s, size_t n) {
    static const char tag[] = "</tool_call>";
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '<' && n - i >= sizeof tag - 1 && !memcmp(s + i, tag, sizeof tag - 1)) {
            return s + i;
        }
    }
    return NULL;
}

static const char *start_marker(enum gram_tool_fmt f) { return f == GRAM_TOOLS_MISTRAL ? "[TOOL_CALLS]" : "<tool_call>"; }

kv_status gram_tool_stream_push(gram_tool_stream_t *s, const char *text, size_t len, kv_buf *content,
                                struct gram_tool_call **calls, int *n_calls) {
    *calls = NULL;
    *n_calls = 0;
    if (kv_buf_append(&s->held, text, len)) return KV_ENOMEM;
    for (;;) {
        kv_buf *h = &s->held;
        if (s->state == TS_PLAIN) {
            kv_status st = emit(s, content, h->data, h->len);
            h->len = 0;
            return st;
        }
        if (s->state == TS_UNDECIDED) { /* llama3_json: the first non-blank character decides */
            size_t k = 0;
            while (k < h->len && blank(h->data[k])) k++;
            if (k == h->len) return KV_OK;
            const char *tag = "<|python_tag|>";
            size_t rest = h->len - k;
            if (h->data[k] == '{' || (rest >= strlen(tag) && !memcmp(h->data + k, tag, strlen(tag)))) {
                s->state = TS_IN_CALL;
                return KV_OK;
            }
            if (rest < strlen(tag) && !memcmp(h->data + k, tag, rest)) return KV_OK;
            s->state = TS_PLAIN;
            continue;
        }
        if (s->state == TS_CONTENT) {
            const char *mk = start_marker(s->fmt);
            const char *p = memfind(h->data, h->len, mk);
            if (!p) {
                size_t keep = partial_tail(h->data, h->len, mk);
                kv_status st = emit(s, content, h->data, h->len - keep);
                drop_front(h, h->len - keep);
                return st;
            }
            size_t at = (size_t)(p - h->data);
            if (emit(s, content, h->data, at)) return KV_ENOMEM;
            drop_front(h, at + strlen(mk));
            s->state = TS_IN_CALL;
            continue;
        }
        /* TS_IN_CALL: hermes closes each call; the others run to the end of the output */
        if (s->fmt != GRAM_TOOLS_HERMES) return KV_OK;
        const char *end = close_tag(h->data, h->len);
        if (!end) return KV_OK;
        size_t body = (size_t)(end - h->data);
        struct gram_tool_call *c = NULL;
        int k = parse_call_list(h->data, body, &c);
        if (k > 0) {
            if (add_calls(calls, n_calls, c, k)) {
                gram_tool_calls_free(c, k);
                return KV_ENOMEM;
            }
            free(c);
            s->n_calls += k;
            s->ws.len = 0;
        } else { /* not a call: the whole region is content */
            if (emit(s, content, "<tool_call>", 11) || emit(s, content, h->data, body + 12)) return KV_ENOMEM;
        }
        drop_front(h, body + 12);
        s->state = TS_CONTENT;
    }
}

kv_status gram_tool_stream_finish(gram_tool_stream_t *s, kv_buf *content, struct gram_tool_call **calls,
                                  int *n_calls) {
    *calls = NULL;
    *n_calls = 0;
    kv_buf *h = &s->held;
    kv_status st = KV_OK;
    if (s->state == TS_IN_CALL) {
        const char *p = h->data ? h->data : "";
        size_t n = h->len;
        const char *tag = "<|python_tag|>";
        if (s->fmt == GRAM_TOOLS_LLAMA3_JSON) {
            while (n && blank(*p)) p++, n--;
            if (n >= strlen(tag) && !memcmp(p, tag, strlen(tag))) p += strlen(tag), n -= strlen(tag);
        }
        /* hermes: a call whose closing tag never came (the model ended right after the JSON) */
        int k = parse_call_list(p, n, calls);
        if (k > 0) {
            *n_calls = k;
            s->n_calls += k;
        } else {
            if (s->fmt != GRAM_TOOLS_LLAMA3_JSON) st = emit(s, content, start_marker(s->fmt), strlen(start_marker(s->fmt)));
            if (!st) st = emit(s, content, h->data, h->len);
        }
    } else if (h->len) {
        st = emit(s, content, h->data, h->len);
    }
    h->len = 0;
    s->ws.len = 0; /* blanks after the last call are dropped */
    s->state = TS_PLAIN;
    return st;
}
