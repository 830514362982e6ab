/* kvserve detokenize --tokenizer PATH: token ids on stdin -> text on stdout.
 *
 *   echo '1 15043 3186' | kvserve detokenize --tokenizer tokenizers/llama2 --skip-special
 *   Hello world
 *
 * Ids may be separated by spaces, newlines or commas and may be wrapped in one JSON array
 * ("[1, 15043, 3186]"). The text is written exactly as tok_decode() returns it (no newline
 * added). --lines: each stdin line is one JSON array of ids, decoded on its own and printed
 * as one JSON string per line (the differential test's batch mode). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tokenizer/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvserve detokenize --tokenizer PATH [--skip-special] [--lines]\n"
            "\n"
            "Decodes the token ids read from stdin (separated by spaces, commas or newlines, or one\n"
            "JSON array) and writes the text to stdout.\n"
            "PATH is a tokenizer.json, a model directory holding one, or a GGUF file.\n"
            "\n"
            "options:\n"
            "  --tokenizer PATH  the tokenizer to use (required)\n"
            "  --skip-special    drop control tokens (BOS, EOS, <|im_end|>, ...)\n"
            "  --lines           each stdin line is a JSON array of ids; prints one JSON string per line\n"
            "  -h, --help        show this help\n");
}

/* Parses "1 2,3" or "[1, 2, 3]" in s[0..n) into *ids. Returns false with a message in err. */
static bool parse_ids(const tokenizer_t *t, const char *s, size_t n, int32_t **ids, size_t *n_ids, char *err,
                      size_t errlen) {
    size_t cap = 64, cnt = 0;
    int32_t *v = kv_malloc(cap * sizeof *v);
    if (!v) return snprintf(err, errlen, "out of memory"), false;
    size_t i = 0;
    bool open = false, closed = false;
    while (i < n) {
        char c = s[i];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == ',') {
            i++;
            continue;
        }
        if (c == '[' && !open && cnt == 0) {
            open = true;
            i++;
            continue;
        }
        if (c == ']' && open && !closed) {
            closed = true;
            i++;
            continue;
        }
        if (closed || !((c >= '0' && c <= '9') || c == '-')) {
            snprintf(err, errlen, "unexpected character '%c' at byte %zu", c, i);
            free(v);
            return false;
        }
        long long x = 0;
        size_t j = i + (c == '-');
        bool digits = false;
        while (j < n && s[j] >= '0' && s[j] <= '9') {
            if (x < 1000000000LL) x = x * 10 + (s[j] - '0');
            j++;
            digits = true;
        }
        if (c == '-') x = -x;
        if (!digits || x < 0 || x >= tok_n_vocab(t)) {
            snprintf(err, errlen, "token id '%.*s' at byte %zu is not in [0, %d)", (int)(j - i > 20 ? 20 : j - i),
                     s + i, i, tok_n_vocab(t));
            free(v);
            return false;
        }
        if (cnt == cap) {
            cap *= 2;
            int32_t *nv = kv_realloc(v, cap * sizeof *nv);
            if (!nv) {
                free(v);
                return snprintf(err, errlen, "out of memory"), false;
            }
            v = nv;
        }
        v[cnt++] = (int32_t)x;
        i = j;
    }
    if (open && !closed) {
        snprintf(err, errlen, "unterminated JSON array");
        free(v);
        return false;
    }
    *ids = v;
    *n_ids = cnt;
    return true;
}

int cmd_detokenize(int argc, char **argv) {
    const char *path = NULL;
    bool skip = false, lines = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) path = argv[++i];
        else if (!strcmp(argv[i], "--skip-special")) skip = true;
        else if (!strcmp(argv[i], "--lines")) lines = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "kvserve detokenize: unknown or incomplete option '%s'\n\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "kvserve detokenize: --tokenizer PATH is required\n\n");
        usage(stderr);
        return 2;
    }
    tokenizer_t *t = cli_load_tokenizer("detokenize", path);
    if (!t) return 1;
    kv_status st;
    kv_buf in;
    kv_buf_init(&in);
    int rc = 0;
    if ((st = cli_read_stdin(&in))) {
        fprintf(stderr, "kvserve detokenize: reading stdin: %s\n", kv_status_str(st));
        rc = 1;
    }
    const char *data = in.data ? in.data : "";
    size_t pos = 0, lineno = 0;
    while (!rc && (lines ? pos < in.len : pos == 0)) {
        size_t ll = in.len;
        if (lines) {
            const char *nl = memchr(data + pos, '\n', in.len - pos);
            ll = nl ? (size_t)(nl - (data + pos)) : in.len - pos;
            lineno++;
        }
        int32_t *ids;
        size_t n;
        char err[256] = "";
        if (!parse_ids(t, data + pos, ll, &ids, &n, err, sizeof err)) {
            if (lines) fprintf(stderr, "kvserve detokenize: stdin line %zu: %s\n", lineno, err);
            else fprintf(stderr, "kvserve detokenize: stdin: %s\n", err);
            rc = 1;
            break;
        }
        pos = lines ? pos + ll + 1 : 1;
        char *text;
        size_t tl;
        st = tok_decode(t, ids, n, skip, &text, &tl);
        free(ids);
        if (st) {
            fprintf(stderr, "kvserve detokenize: decode failed: %s\n", kv_status_str(st));
            rc = 1;
            break;
        }
        bool ok;
        if (lines) {
            json_t *js = json_stringn(text, tl); /* decode output is valid UTF-8 */
            char *d = js ? json_dumps(js, JSON_ENCODE_ANY) : NULL;
            ok = d && fputs(d, stdout) >= 0 && putchar('\n') != EOF;
            free(d);
            json_decref(js);
        } else {
            ok = fwrite(text, 1, tl, stdout) == tl;
        }
        free(text);
        if (!ok) {
            fprintf(stderr, "kvserve detokenize: writing stdout failed\n");
            rc = 1;
        }
    }
    if (!rc && fflush(stdout)) rc = 1;
    kv_buf_free(&in);
    tok_free(t);
    return rc;
}
