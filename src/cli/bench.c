/* placeholder: replaced by the module that implements 'kvserve bench' */
#include <stdio.h>
#include "cli.h"
int cmd_bench(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvserve bench: not implemented yet\n");
    return 1;
}
