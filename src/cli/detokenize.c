/* placeholder: replaced by the module that implements this subcommand */
#include <stdio.h>
#include "cli.h"
int cmd_detokenize(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvserve: detokenize is not implemented yet\n");
    return 1;
}
