/* bench_tokenizer: single-thread encode throughput of kvserve's tokenizer.
 *
 *   bench_tokenizer TOKENIZER TEXT_FILE [--repeat N] [--ids OUT.jsonl]
 *
 * The text is split into paragraphs at blank lines (the same split bench_tokenizer.mjs uses
 * for HF tokenizers); each paragraph is encoded on its own with add_special = false,
 * parse_special = false, N times; the best pass counts. Prints one JSON line:
 *   {"impl":"kvserve","paragraphs":P,"bytes":B,"tokens":T,"seconds":S,"tokens_per_s":X,"mb_per_s":Y}
 * --ids writes each paragraph's ids as one JSON array per line (to check identity with HF). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

struct para {
    const char *s;
    size_t n;
};

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: bench_tokenizer TOKENIZER TEXT_FILE [--repeat N] [--ids OUT.jsonl]\n");
        return 2;
    }
    int repeat = 3;
    const char *ids_out = NULL;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ids") && i + 1 < argc) ids_out = argv[++i];
        else {
            fprintf(stderr, "bench_tokenizer: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (repeat < 1) repeat = 1;
    char err[512] = "";
    tokenizer_t *t;
    kv_status st = tok_load(argv[1], &t, err, sizeof err);
    if (st) {
        fprintf(stderr, "bench_tokenizer: %s\n", err);
        return 1;
    }
    char *text;
    size_t len;
    if (kv_read_file(argv[2], &text, &len, err, sizeof err)) {
        fprintf(stderr, "bench_tokenizer: %s\n", err);
        tok_free(t);
        return 1;
    }
    /* paragraphs: maximal runs between "\n\n" (separators excluded, empty ones skipped) */
    size_t cap = 1024, np = 0;
    struct para *p = malloc(cap * sizeof *p);
    for (size_t i = 0; i < len && p;) {
        const char *e = memmem(text + i, len - i, "\n\n", 2);
        size_t end = e ? (size_t)(e - text) : len;
        if (end > i) {
            if (np == cap) p = realloc(p, (cap *= 2) * sizeof *p);
            if (!p) break;
            p[np++] = (struct para){text + i, end - i};
        }
        i = end + 2;
    }
    if (!p) return 1;
    double best = 1e30;
    size_t tokens = 0, bytes = 0;
    FILE *f = ids_out ? fopen(ids_out, "w") : NULL;
    for (int r = 0; r < repeat; r++) {
        tokens = bytes = 0;
        double t0 = kv_now_s();
        for (size_t i = 0; i < np; i++) {
            int32_t *ids;
            size_t n;
            if (tok_encode(t, p[i].s, p[i].n, false, false, &ids, &n)) return 1;
            tokens += n;
            bytes += p[i].n;
            if (f && r == 0) {
                double tp = kv_now_s(); /* not timed */
                fputc('[', f);
                for (size_t k = 0; k < n; k++) fprintf(f, k ? ",%d" : "%d", ids[k]);
                fputs("]\n", f);
                t0 += kv_now_s() - tp;
            }
            free(ids);
        }
        double dt = kv_now_s() - t0;
        if (dt < best) best = dt;
    }
    if (f) fclose(f);
    printf("{\"impl\":\"kvserve\",\"paragraphs\":%zu,\"bytes\":%zu,\"tokens\":%zu,\"seconds\":%.4f,"
           "\"tokens_per_s\":%.0f,\"mb_per_s\":%.2f}\n",
           np, bytes, tokens, best, tokens / best, bytes / best / 1e6);
    free(p);
    free(text);
    tok_free(t);
    return 0;
}
