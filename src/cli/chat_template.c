/* placeholder: replaced by the module that implements this subcommand */
#include <stdio.h>
#include "cli.h"
int cmd_chat_template(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvserve: chat_template is not implemented yet\n");
    return 1;
}
