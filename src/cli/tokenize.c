/* kvserve tokenize --tokenizer PATH: text on stdin -> token ids on stdout.
 *
 *   printf 'Hello world' | kvserve tokenize --tokenizer tokenizers/llama2
 *   1 15043 3186
 *   printf '"a\\nb"\n"<s>x"\n' | kvserve tokenize --tokenizer tokenizers/llama2 --lines --with-special
 *   [1,263,13,29890]
 *   [1,921]              (the text's own <s> is the BOS: never doubled, see tokenizer.h)
 *
 * Whole-stdin mode encodes the bytes exactly (a trailing newline is text too). --lines reads
 * one JSON string per line (so inputs may hold any character) and prints one JSON array of
 * ids (or, with --json, one {"ids":[...],"tokens":[...]} object) per line, in order; an
 * empty line is an error. The differential test against HF tokenizers drives this mode. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tokenizer/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvserve tokenize --tokenizer PATH [--with-special] [--no-bos] [--json] [--lines]\n"
            "\n"
            "Encodes the text read from stdin (exact bytes, UTF-8) and prints the token ids.\n"
            "PATH is a tokenizer.json, a model directory holding one, or a GGUF file.\n"
            "\n"
            "options:\n"
            "  --tokenizer PATH  the tokenizer to use (required)\n"
            "  --with-special    text such as \"<|im_end|>\" or \"<s>\" becomes the special token\n"
            "                    (otherwise it is encoded as plain text)\n"
            "  --no-bos          do not add BOS (or whatever the post-processor adds)\n"
            "  --json            print {\"ids\":[...],\"tokens\":[...]} instead of space-separated ids\n"
            "  --lines           each stdin line is a JSON string encoded on its own; prints one JSON\n"
            "                    array of ids (or --json object) per line\n"
            "  -h, --help        show this help\n");
}

/* Prints ids (and token strings with json) for one encoding; returns false on write error. */
static bool print_ids(const tokenizer_t *t, const int32_t *ids, size_t n, bool json, bool lines) {
    if (!json && !lines) {
        for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        putchar('\n');
        return !ferror(stdout);
    }
    kv_buf o;
    kv_buf_init(&o);
    bool ok = kv_buf_puts(&o, json ? "{\"ids\":[" : "[") == KV_OK;
    for (size_t i = 0; i < n && ok; i++) ok = kv_buf_printf(&o, i ? ",%d" : "%d", ids[i]) == KV_OK;
    if (json && ok) {
        ok = kv_buf_puts(&o, "],\"tokens\":[") == KV_OK;
        for (size_t i = 0; i < n && ok; i++) {
            const char *s = tok_token_str(t, ids[i]);
            json_t *js = json_string(s ? s : "");
            if (!js) js = json_stringn_nocheck(s ? s : "", s ? strlen(s) : 0);
            char *d = js ? json_dumps(js, JSON_ENCODE_ANY | JSON_ENSURE_ASCII) : NULL;
            ok = d && !(i && kv_buf_puts(&o, ",")) && !kv_buf_puts(&o, d);
            free(d);
            json_decref(js);
        }
        if (ok) ok = kv_buf_puts(&o, "]}") == KV_OK;
    } else if (ok) {
        ok = kv_buf_puts(&o, "]") == KV_OK;
    }
    if (ok) ok = kv_buf_puts(&o, "\n") == KV_OK;
    if (ok) ok = fwrite(o.data, 1, o.len, stdout) == o.len;
    kv_buf_free(&o);
    return ok;
}

int cmd_tokenize(int argc, char **argv) {
    const char *path = NULL;
    bool with_special = false, no_bos = false, json = false, lines = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) path = argv[++i];
        else if (!strcmp(argv[i], "--with-special")) with_special = true;
        else if (!strcmp(argv[i], "--no-bos")) no_bos = true;
        else if (!strcmp(argv[i], "--json")) json = true;
        else if (!strcmp(argv[i], "--lines")) lines = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "kvserve tokenize: unknown or incomplete option '%s'\n\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "kvserve tokenize: --tokenizer PATH is required\n\n");
        usage(stderr);
        return 2;
    }
    tokenizer_t *t = cli_load_tokenizer("tokenize", path);
    if (!t) return 1;
    kv_status st;
    kv_buf in;
    kv_buf_init(&in);
    int rc = 0;
    if ((st = cli_read_stdin(&in))) {
        fprintf(stderr, "kvserve tokenize: reading stdin: %s\n", kv_status_str(st));
        rc = 1;
    }
    const char *data = in.data ? in.data : "";
    size_t pos = 0, lineno = 0;
    while (!rc && (lines ? pos < in.len : pos == 0)) {
        const char *text = data;
        size_t tl = in.len;
        json_t *js = NULL;
        if (lines) {
            const char *nl = memchr(data + pos, '\n', in.len - pos);
            size_t ll = nl ? (size_t)(nl - (data + pos)) : in.len - pos;
            lineno++;
            json_error_t je;
            js = json_loadb(data + pos, ll, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            pos += ll + 1;
            if (!json_is_string(js)) {
                fprintf(stderr, "kvserve tokenize: stdin line %zu: expected a JSON string (%s)\n", lineno,
                        js ? "not a string" : je.text);
                json_decref(js);
                rc = 1;
                break;
            }
            text = json_string_value(js);
            tl = json_string_length(js);
        } else {
            pos = 1;
        }
        int32_t *ids;
        size_t n;
        st = tok_encode(t, text, tl, !no_bos, with_special, &ids, &n);
        json_decref(js);
        if (st) {
            fprintf(stderr, "kvserve tokenize: encode failed: %s\n", kv_status_str(st));
            rc = 1;
            break;
        }
        if (!print_ids(t, ids, n, json, lines)) {
            fprintf(stderr, "kvserve tokenize: writing stdout failed\n");
            rc = 1;
        }
        free(ids);
    }
    if (!rc && fflush(stdout)) rc = 1;
    kv_buf_free(&in);
    tok_free(t);
    return rc;
}
