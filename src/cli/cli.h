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

/* Reads all of standard input into b (appends). KV_ENOMEM / KV_EIO on failure. */
kv_status cli_read_stdin(kv_buf *b);
/* Loads the tokenizer at path (tokenizer.json, model dir or GGUF); on failure prints
 * "kvserve <cmd>: <status>: <message>" to stderr and returns NULL. Caller frees with tok_free. */
tokenizer_t *cli_load_tokenizer(const char *cmd, const char *path);
#endif
