/* cli_util: helpers shared by the small tokenizer subcommands. */
#include <stdio.h>

#include "cli.h"

kv_status cli_read_stdin(kv_buf *b) {
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, stdin)) > 0)
        if (kv_buf_append(b, chunk, n)) return KV_ENOMEM;
    return ferror(stdin) ? KV_EIO : KV_OK;
}

tokenizer_t *cli_load_tokenizer(const char *cmd, const char *path) {
    char err[512] = "";
    tokenizer_t *t = NULL;
    kv_status st = tok_load(path, &t, err, sizeof err);
    if (st) {
        fprintf(stderr, "kvserve %s: %s: %s\n", cmd, kv_status_str(st), err[0] ? err : path);
        return NULL;
    }
    return t;
}
