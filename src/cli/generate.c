/* placeholder: replaced by the module that implements 'kvserve generate' */
#include <stdio.h>
#include "cli.h"
int cmd_generate(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvserve generate: not implemented yet\n");
    return 1;
}
