/* placeholder: replaced by the module that implements 'kvserve inspect' */
#include <stdio.h>
#include "cli.h"
int cmd_inspect(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvserve inspect: not implemented yet\n");
    return 1;
}
