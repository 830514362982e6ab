/* kvserve inspect PATH: prints a model's architecture, configuration, tokenizer kind and
 * tensor list (GGUF file or Hugging Face directory) without converting any weights. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "model/gguf.h"
#include "model/model.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvserve inspect PATH\n"
            "\n"
            "Prints the architecture, configuration, tokenizer kind and every tensor (name, dtype,\n"
            "shape outermost first) of a GGUF file or a Hugging Face model directory.\n"
            "\n"
            "options:\n"
            "  -h, --help   show this help\n");
}

struct tcount {
    int n;
};
static void print_tensor(void *user, const char *name, const char *dtype, int n_dims, const uint64_t *shape) {
    struct tcount *c = user;
    printf("  %-48s %-6s [", name, dtype ? dtype : "?");
    for (int d = 0; d < n_dims; d++) printf("%s%llu", d ? ", " : "", (unsigned long long)shape[d]);
    printf("]\n");
    c->n++;
}

/* Tokenizer kind: GGUF tokenizer.ggml.model, or the HF tokenizer.json model type. */
static void print_tokenizer(const char *path, model_format fmt) {
    if (fmt == MODEL_FORMAT_GGUF) {
        gguf_t *g;
        if (gguf_open(path, &g, NULL, 0)) return;
        const char *s;
        size_t len;
        uint64_t n = 0;
        gguf_get_arr_info(g, "tokenizer.ggml.tokens", NULL, &n);
        if (gguf_get_str(g, "tokenizer.ggml.model", &s, &len))
            printf("tokenizer: %.*s (gguf, %llu tokens)\n", (int)len, s, (unsigned long long)n);
        else
            printf("tokenizer: none in file\n");
        gguf_close(g);
        return;
    }
    char p[4200];
    snprintf(p, sizeof p, "%s/tokenizer.json", path);
    if (!kv_path_is_dir(path)) { /* a file inside the directory */
        snprintf(p, sizeof p, "%s", path);
        char *sl = strrchr(p, '/');
        snprintf(sl ? sl + 1 : p, sizeof p - (size_t)(sl ? sl + 1 - p : 0), "tokenizer.json");
    }
    char *d;
    size_t n;
    if (kv_read_file(p, &d, &n, NULL, 0)) {
        printf("tokenizer: none (no tokenizer.json)\n");
        return;
    }
    /* cheap look at "model": {"type": "BPE" ...} without a full parse */
    const char *m = strstr(d, "\"model\"");
    const char *t = m ? strstr(m, "\"type\"") : NULL;
    const char *q = t ? strchr(t + 6, '"') : NULL;
    const char *e = q ? strchr(q + 1, '"') : NULL;
    if (e && e - q < 32) printf("tokenizer: %.*s (tokenizer.json)\n", (int)(e - q - 1), q + 1);
    else printf("tokenizer: tokenizer.json (unknown model type)\n");
    free(d);
}

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        }
        if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "kvserve inspect: unknown option %s\n", argv[i]);
            usage(stderr);
            return 2;
        }
        if (path) {
            fprintf(stderr, "kvserve inspect: only one PATH may be given\n");
            return 2;
        }
        path = argv[i];
    }
    if (!path) {
        usage(stderr);
        return 2;
    }
    struct model_config c;
    model_format fmt;
    char err[512];
    if (model_read_config(path, &c, &fmt, err, sizeof err)) {
        fprintf(stderr, "kvserve inspect: %s\n", err);
        return 1;
    }
    printf("path: %s\n", path);
    printf("format: %s\n", fmt == MODEL_FORMAT_GGUF ? "gguf" : "huggingface");
    printf("name: %s\n", c.name);
    printf("arch: %s\n", model_arch_name(c.arch));
    if (c.n_vocab > 0) printf("n_vocab: %d\n", c.n_vocab);
    printf("dim: %d\nn_layers: %d\nn_heads: %d\nn_kv_heads: %d\nhead_dim: %d\nffn_dim: %d\n", c.dim, c.n_layers,
           c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim);
    printf("rms_eps: %g\nrope_theta: %g\nrope: %s\n", (double)c.rms_eps, (double)c.rope_theta,
           c.rope_neox ? "neox (rotate halves)" : "norm (adjacent pairs)");
    if (c.rope_scaling.type == 1)
        printf("rope_scaling: llama3 factor=%g low_freq_factor=%g high_freq_factor=%g original_max_pos=%d\n",
               (double)c.rope_scaling.factor, (double)c.rope_scaling.low_freq_factor,
               (double)c.rope_scaling.high_freq_factor, c.rope_scaling.original_max_pos);
    else if (c.rope_scaling.type == 2)
        printf("rope_scaling: linear factor=%g\n", (double)c.rope_scaling.factor);
    else
        printf("rope_scaling: none\n");
    printf("max_ctx: %d\nattn_bias: %s\nqk_norm: %s\ntied_embeddings: %s\n", c.max_ctx, c.attn_bias ? "yes" : "no",
           c.qk_norm ? "yes" : "no", c.tied_embeddings ? "yes" : "no");
    printf("bos_id: %d\neos_id: %d\neos_ids:", c.bos_id, c.eos_id);
    for (int i = 0; i < c.n_eos_ids; i++) printf(" %d", c.eos_ids[i]);
    printf("\n");
    print_tokenizer(path, fmt);
    printf("tensors:\n");
    struct tcount tc = {0};
    if (model_list_tensors(path, print_tensor, &tc, err, sizeof err)) {
        fprintf(stderr, "kvserve inspect: %s\n", err);
        return 1;
    }
    printf("n_tensors: %d\n", tc.n);
    return 0;
}
