/* cli: the kvserve binary's subcommands, one file each. Each returns the process exit
 * code (0 ok, 1 runtime failure, 2 usage error) and prints errors to stderr. */
#ifndef KV_CLI_H
#define KV_CLI_H
int cmd_serve(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_detokenize(int argc, char **argv);
int cmd_chat_template(int argc, char **argv);
#endif
