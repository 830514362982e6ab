/* placeholder: replaced by the module that implements this subcommand */
#include <stdio.h>
#include "cli.h"
int cmd_tokenize(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvserve: tokenize is not implemented yet\n");
    return 1;
}
