/* placeholder: replaced by the module that implements 'kvserve serve' */
#include <stdio.h>
#include "cli.h"
int cmd_serve(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvserve serve: not implemented yet\n");
    return 1;
}
