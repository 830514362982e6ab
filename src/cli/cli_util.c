/* cli_util: helpers shared by the small tokenizer subcommands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "http/http.h"

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

int cli_conn_limit_opt(const char *cmd, const char *a, const char *v, struct http_conn_limits *l) {
    char *end = NULL;
    if (!strcmp(a, "--max-connections")) {
        long n = v ? strtol(v, &end, 10) : 0;
        if (!v || !*v || *end || n < 1 || n > 1000000) {
            fprintf(stderr, "kvserve %s: --max-connections %s: expected an integer in [1, 1000000]\n",
                    cmd, v ? v : "(missing)");
            return -1;
        }
        l->max_connections = (int)n;
        return 1;
    }
    if (!strcmp(a, "--max-buffered-bytes")) {
        uint64_t n = 0;
        if (!v || kv_parse_size(v, &n) != KV_OK || n == 0) {
            fprintf(stderr, "kvserve %s: --max-buffered-bytes %s: expected a positive size such as 256MiB\n",
                    cmd, v ? v : "(missing)");
            return -1;
        }
        l->max_buffered_bytes = (size_t)n;
        return 1;
    }
    int *ms = !strcmp(a, "--header-timeout") ? &l->header_timeout_ms
            : !strcmp(a, "--keepalive-timeout") ? &l->keepalive_timeout_ms : NULL;
    if (!ms) return 0;
    double s = v ? strtod(v, &end) : 0;
    if (!v || !*v || *end || !(s >= 0.001 && s <= 86400)) {
        fprintf(stderr, "kvserve %s: %s %s: expected seconds in [0.001, 86400]\n", cmd, a,
                v ? v : "(missing)");
        return -1;
    }
    *ms = (int)(s * 1000 + 0.5);
    return 1;
}
