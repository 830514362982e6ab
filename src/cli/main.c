#include <stdio.h>
#include <string.h>

#include "cli.h"

int cmd_router(int argc, char **argv); /* router.c */

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} cmds[] = {
    {"serve", cmd_serve, "serve a model over the OpenAI-compatible HTTP API"},
    {"inspect", cmd_inspect, "print a model file's configuration and tensors"},
    {"generate", cmd_generate, "run one prompt through the engine and print the completion"},
    {"router", cmd_router, "front door of disaggregated serving (context + generation workers)"},
    {"bench", cmd_bench, "replay multi-turn traces against any OpenAI-compatible server"},
    {"tokenize", cmd_tokenize, "text on stdin -> token ids (--tokenizer PATH)"},
    {"detokenize", cmd_detokenize, "token ids on stdin -> text (--tokenizer PATH)"},
    {"chat-template", cmd_chat_template, "render messages JSON on stdin with the model's chat template"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: kvserve <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].help);
    fprintf(f, "\n'kvserve <command> --help' shows a command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("kvserve 0.1.0\n");
        return 0;
    }
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(argv[1], cmds[i].name)) return cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "kvserve: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
