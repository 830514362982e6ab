/* bench_prefix_cache: per-request prompt tokenization time of a growing multi-turn
 * conversation, plain tok_encode vs the prefix token cache (default settings).
 *
 * The conversation is Llama-3 chat text (rendered here, as the server's chat template
 * writes it) whose turns are consecutive War and Peace passages; each request adds a user and
 * an assistant turn of 2-4 KB each (1-2k tokens together). Requests are measured once the
 * prompt reaches --from tokens (default 34000), for --turns requests (default 8): a ~38k-token
 * prompt growing by 1-2k tokens per turn. Each time is the median of --reps runs (default 5);
 * the cached runs use --reps independent caches fed the same conversation, so every run is a
 * genuine "previous turn cached" request. Every cached result is checked against tok_encode
 * (byte-identical ids), exit status 1 otherwise.
 *
 * usage: bench_prefix_cache [--tokenizer PATH] [--text PATH] [--from N] [--turns N] [--reps N]
 *   defaults: $KVSERVE_TEST_DATA (or ../shared/data)/tokenizers/llama3/tokenizer.json and
 *   datasets/war-and-peace.txt.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "base/base.h"
#include "tokenizer/prefix_cache.h"
#include "tokenizer/tokenizer.h"

int main(int argc, char **argv) {
    const char *data = getenv("KVSERVE_TEST_DATA");
    if (!data || !*data) data = "../shared/data";
    char tok_path[1024], text_path[1024];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizers/llama3/tokenizer.json", data);
    snprintf(text_path, sizeof text_path, "%s/datasets/war-and-peace.txt", data);
    long from = 34000, turns = 8, reps = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--tokenizer")) snprintf(tok_path, sizeof tok_path, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--text")) snprintf(text_path, sizeof text_path, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--from")) from = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--turns")) turns = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atol(argv[i + 1]);
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (turns < 1 || reps < 1) return 2;
    char err[512];
    tokenizer_t *t;
    if (tok_load(tok_path, &t, err, sizeof err)) {
        fprintf(stderr, "bench_prefix_cache: %s\n", err);
        return 1;
    }
    char *book;
    size_t book_len;
    if (kv_read_file(text_path, &book, &book_len, err, sizeof err)) {
        fprintf(stderr, "bench_prefix_cache: %s\n", err);
        return 1;
    }
    struct prefix_cache_config cfg;
    prefix_cache_config_default(&cfg);
    prefix_cache_t **pcs = calloc((size_t)reps, sizeof *pcs);
    for (long r = 0; r < reps; r++)
        if (prefix_cache_new(t, &cfg, &pcs[r], err, sizeof err)) {
            fprintf(stderr, "bench_prefix_cache: %s\n", err);
            return 1;
        }
    prefix_cache_t *pc = pcs[0];
    kv_rng rng;
    kv_rng_seed(&rng, 7);
    kv_buf hist, prompt;
    kv_buf_init(&hist);
    kv_buf_init(&prompt);
    kv_buf_puts(&hist, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                       "You are a helpful reading companion.<|eot_id|>");
    size_t pos = 0;
    double *tu = calloc((size_t)turns, sizeof *tu), *tc = calloc((size_t)turns, sizeof *tc);
    size_t *ntok = calloc((size_t)turns, sizeof *ntok), *added = calloc((size_t)turns, sizeof *added);
    double *samp = calloc((size_t)reps, sizeof *samp);
    long measured = 0;
    size_t prev_n = 0;
    int bad = 0;
    for (int turn = 0; measured < turns; turn++) {
        /* one turn: 2-4 KB of the book, user/assistant alternating */
        size_t want = 2000 + (size_t)(kv_rng_next(&rng) % 2000);
        if (pos + want + 1 >= book_len) pos = 0;
        size_t end = pos + want;
        while (end < book_len && ((unsigned char)book[end] & 0xC0) == 0x80) end++;
        kv_buf_printf(&hist, "<|start_header_id|>%s<|end_header_id|>\n\n%.*s<|eot_id|>",
                      turn % 2 ? "assistant" : "user", (int)(end - pos), book + pos);
        pos = end;
        if (turn % 2) continue; /* requests follow user turns */
        prompt.len = 0;
        kv_buf_append(&prompt, hist.data, hist.len);
        kv_buf_puts(&prompt, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        int32_t *full = NULL, *got = NULL;
        size_t nf = 0, ng = 0;
        /* the server's call: add_special and parse_special */
        for (long r = 0; r < reps; r++) {
            free(full);
            uint64_t t0 = kv_now_ns();
            tok_encode(t, prompt.data, prompt.len, true, true, &full, &nf);
            samp[r] = (double)(kv_now_ns() - t0) / 1e6;
        }
        qsort(samp, (size_t)reps, sizeof *samp, bench_cmp_d);
        double u = samp[reps / 2];
        for (long r = 0; r < reps; r++) {
            free(got);
            uint64_t t0 = kv_now_ns();
            prefix_cache_encode(pcs[r], prompt.data, prompt.len, true, true, &got, &ng);
            samp[r] = (double)(kv_now_ns() - t0) / 1e6;
            if (ng != nf || memcmp(got, full, nf * sizeof *full)) {
                fprintf(stderr, "MISMATCH at turn %d (%zu vs %zu ids)\n", turn, ng, nf);
                bad = 1;
            }
        }
        qsort(samp, (size_t)reps, sizeof *samp, bench_cmp_d);
        double c = samp[reps / 2];
        if (nf >= (size_t)from) {
            tu[measured] = u;
            tc[measured] = c;
            ntok[measured] = nf;
            added[measured] = nf - prev_n;
            measured++;
        }
        prev_n = nf;
        free(full);
        free(got);
    }
    double su = 0, sc = 0;
    printf("%-6s %8s %8s %12s %12s %7s\n", "req", "tokens", "new", "uncached_ms", "cached_ms", "ratio");
    for (long i = 0; i < measured; i++) {
        printf("%-6ld %8zu %8zu %12.3f %12.3f %7.4f\n", i, ntok[i], added[i], tu[i], tc[i],
               tc[i] / tu[i]);
        su += tu[i];
        sc += tc[i];
    }
    struct prefix_cache_stats s;
    prefix_cache_get_stats(pc, &s);
    printf("mean over %ld requests: uncached %.3f ms, cached %.3f ms, ratio %.4f "
           "(hits %llu, misses %llu, resync failures %llu)\n",
           measured, su / (double)measured, sc / (double)measured, sc / su,
           (unsigned long long)s.hits, (unsigned long long)s.misses,
           (unsigned long long)s.resync_failures);
    for (long r = 0; r < reps; r++) prefix_cache_free(pcs[r]);
    free(pcs);
    tok_free(t);
    free(book);
    kv_buf_free(&hist);
    kv_buf_free(&prompt);
    free(tu);
    free(tc);
    free(ntok);
    free(added);
    free(samp);
    return bad;
}
