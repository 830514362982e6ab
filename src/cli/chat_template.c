/* kvserve chat-template: renders a conversation with a model's chat template.
 *
 *   echo '[{"role":"user","content":"Hi"}]' | kvserve chat-template --tokenizer tokenizers/qwen3
 *   <|im_start|>user
 *   Hi<|im_end|>
 *   <|im_start|>assistant
 *
 * stdin holds a JSON array of messages, or an object {"messages": [...], ...} whose other
 * members become template variables (e.g. "tools", "enable_thinking", and
 * "add_generation_prompt", which overrides the flag). The prompt is printed exactly, with
 * no newline added. With --lines, every stdin line is one such document and one JSON line
 * is printed per input: {"text": "..."} or {"error": "..."} (the differential test against
 * @huggingface/jinja drives this mode). Errors: message on stderr, exit 1 (usage: exit 2). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tokenizer/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvserve chat-template (--tokenizer PATH | --config FILE | --template-file F) [options] < messages.json\n"
            "\n"
            "Renders the messages read from stdin (a JSON array, or an object with \"messages\" and\n"
            "extra template variables) with the model's Jinja chat template and prints the prompt.\n"
            "\n"
            "options:\n"
            "  --tokenizer PATH        tokenizer.json, model directory or GGUF (template + BOS/EOS strings)\n"
            "  --config FILE           a tokenizer_config.json: its chat_template and bos/eos_token\n"
            "  --template-file F       use the Jinja template in F instead of the model's\n"
            "  --no-generation-prompt  do not open an assistant turn (add_generation_prompt = false)\n"
            "  --lines                 one JSON document per stdin line; prints {\"text\":...} or\n"
            "                          {\"error\":...} per line\n"
            "  -h, --help              show this help\n");
}

static char *token_text(const json_t *v) {
    if (json_is_string(v)) return strdup(json_string_value(v));
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return strdup(json_string_value(json_object_get(v, "content")));
    return NULL;
}

struct opts {
    tokenizer_t *t;
    char *tmpl; /* override, or NULL */
    char *bos, *eos;
    bool gen;
};

/* Renders one document; *out or a message in err. */
static kv_status render_doc(const struct opts *o, const char *text, size_t len, char **out, char *err, size_t errlen) {
    json_error_t je;
    json_t *doc = json_loadb(text, len, JSON_DECODE_ANY, &je);
    if (!doc) return kv_errf(KV_EINVAL, err, errlen, "stdin: invalid JSON at line %d: %s", je.line, je.text);
    json_t *msgs = doc, *kwargs = NULL;
    bool gen = o->gen;
    if (json_is_object(doc)) {
        msgs = json_object_get(doc, "messages");
        kwargs = json_deep_copy(doc);
        json_object_del(kwargs, "messages");
        json_t *g = json_object_get(kwargs, "add_generation_prompt");
        if (g) {
            gen = json_is_true(g);
            json_object_del(kwargs, "add_generation_prompt");
        }
    }
    kv_status st;
    if (!json_is_array(msgs)) st = kv_errf(KV_EINVAL, err, errlen, "stdin: expected a JSON array of messages (or {\"messages\": [...]})");
    else if (o->tmpl) st = tok_chat_render_template(o->tmpl, o->bos, o->eos, msgs, kwargs, gen, out, err, errlen);
    else st = tok_chat_render_json(o->t, msgs, kwargs, gen, out, err, errlen);
    json_decref(kwargs);
    json_decref(doc);
    return st;
}

int cmd_chat_template(int argc, char **argv) {
    const char *tok_path = NULL, *cfg_path = NULL, *tmpl_path = NULL;
    bool lines = false;
    struct opts o = {.gen = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--no-generation-prompt")) {
            o.gen = false;
        } else if (!strcmp(a, "--lines")) {
            lines = true;
        } else if ((!strcmp(a, "--tokenizer") || !strcmp(a, "--config") || !strcmp(a, "--template-file")) && i + 1 < argc) {
            const char **dst = !strcmp(a, "--tokenizer") ? &tok_path : !strcmp(a, "--config") ? &cfg_path : &tmpl_path;
            *dst = argv[++i];
        } else {
            fprintf(stderr, "kvserve chat-template: unknown or incomplete option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!tok_path && !cfg_path && !tmpl_path) {
        fprintf(stderr, "kvserve chat-template: one of --tokenizer, --config or --template-file is required\n");
        usage(stderr);
        return 2;
    }
    char err[512];
    int rc = 1;
    json_t *cfg = NULL;
    kv_buf in;
    kv_buf_init(&in);
    if (tok_path && tok_load(tok_path, &o.t, err, sizeof err)) {
        fprintf(stderr, "kvserve chat-template: %s\n", err);
        goto done;
    }
    if (cfg_path) {
        json_error_t je;
        cfg = json_load_file(cfg_path, JSON_DECODE_INT_AS_REAL, &je);
        if (!cfg) {
            fprintf(stderr, "kvserve chat-template: %s: line %d: %s\n", cfg_path, je.line, je.text);
            goto done;
        }
        const json_t *ct = json_object_get(cfg, "chat_template");
        if (json_is_array(ct)) { /* [{name, template}, ...]: take "default" */
            size_t k;
            json_t *e;
            const json_t *pick = NULL;
            json_array_foreach(ct, k, e) if (!strcmp(json_string_value(json_object_get(e, "name")) ? json_string_value(json_object_get(e, "name")) : "", "default")) pick = json_object_get(e, "template");
            ct = pick;
        }
        if (!tmpl_path) {
            if (!json_is_string(ct)) {
                fprintf(stderr, "kvserve chat-template: %s has no chat_template\n", cfg_path);
                goto done;
            }
            o.tmpl = strdup(json_string_value(ct));
        }
        if (!o.t) {
            o.bos = token_text(json_object_get(cfg, "bos_token"));
            o.eos = token_text(json_object_get(cfg, "eos_token"));
        }
    }
    if (tmpl_path) {
        size_t n;
        if (kv_read_file(tmpl_path, &o.tmpl, &n, err, sizeof err)) {
            fprintf(stderr, "kvserve chat-template: %s\n", err);
            goto done;
        }
    }
    if (o.t && o.tmpl && !o.bos && !o.eos) {
        const char *b = tok_bos(o.t) >= 0 ? tok_token_str(o.t, tok_bos(o.t)) : NULL;
        const char *e = tok_eos(o.t) >= 0 ? tok_token_str(o.t, tok_eos(o.t)) : NULL;
        o.bos = b ? strdup(b) : NULL;
        o.eos = e ? strdup(e) : NULL;
    }
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, stdin)) > 0)
        if (kv_buf_append(&in, chunk, n)) {
            fprintf(stderr, "kvserve chat-template: out of memory\n");
            goto done;
        }
    const char *text = kv_buf_cstr(&in);
    if (!lines) {
        char *out = NULL;
        if (render_doc(&o, text, in.len, &out, err, sizeof err)) {
            fprintf(stderr, "kvserve chat-template: %s\n", err);
            goto done;
        }
        fwrite(out, 1, strlen(out), stdout);
        free(out);
        rc = fflush(stdout) ? 1 : 0;
        goto done;
    }
    rc = 0;
    for (const char *p = text, *end = text + in.len; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t l = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (l > 0) {
            char *out = NULL;
            json_t *res = render_doc(&o, p, l, &out, err, sizeof err) ? json_pack("{s:s}", "error", err)
                                                                        : json_pack("{s:s}", "text", out);
            char *line = res ? json_dumps(res, JSON_COMPACT) : NULL;
            if (line) puts(line);
            else rc = 1;
            free(line);
            json_decref(res);
            free(out);
        }
        p += l + 1;
    }
    if (fflush(stdout)) rc = 1;
done:
    kv_buf_free(&in);
    json_decref(cfg);
    free(o.tmpl);
    free(o.bos);
    free(o.eos);
    tok_free(o.t);
    return rc;
}
