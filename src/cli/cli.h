/* cli: the kvserve binary's subcommands, one file each. Each returns the process exit
 * code (0 ok, 1 runtime failure, 2 usage error) and prints errors to stderr. */
#ifndef KV_CLI_H
#define KV_CLI_H
#include "base/base.h"
#include "tokenizer/tokenizer.h"
int cmd_serve(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_detokenize(int argc, char **argv);
int cmd_chat_template(int argc, char **argv);

/* The connection-limit options shared by serve and router (http.h struct http_conn_limits):
 * --max-connections N, --max-buffered-bytes SIZE, --header-timeout SECONDS,
 * --keepalive-timeout SECONDS (fractions allowed). Returns 1 when a is one of them and v was
 * valid (stored in l), -1 after printing an error about v, 0 when a is another option. */
struct http_conn_limits;
int cli_conn_limit_opt(const char *cmd, const char *a, const char *v, struct http_conn_limits *l);
#define CLI_CONN_LIMITS_HELP \
    "  --max-connections N      open client connections (default 4096); at the cap the\n" \
    "                           longest idle one is closed, else 16 more may send\n" \
    "                           GET /health or /ready, else 503\n" \
    "  --max-buffered-bytes SIZE  request bytes being read or answered, all connections\n" \
    "                           together; a request over it gets 503 (default 256MiB)\n" \
    "  --header-timeout SEC     request head within, body reads at most this far apart;\n" \
    "                           else 408 (default 60)\n" \
    "  --keepalive-timeout SEC  idle keep-alive connections are closed (default 75)\n"

/* Reads all of standard input into b (appends). KV_ENOMEM / KV_EIO on failure. */
kv_status cli_read_stdin(kv_buf *b);
/* Loads the tokenizer at path (tokenizer.json, model dir or GGUF); on failure prints
 * "kvserve <cmd>: <status>: <message>" to stderr and returns NULL. Caller frees with tok_free. */
tokenizer_t *cli_load_tokenizer(const char *cmd, const char *path);
#endif
