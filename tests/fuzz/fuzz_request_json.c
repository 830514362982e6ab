/* libFuzzer target: an OpenAI request body through oai_parse (src/http/openai.c) for every
 * endpoint kind, then oai_engine_params on what parsed. Must never crash, leak or hang; a
 * body either parses or yields an error with a status. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http/http_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const enum oai_kind kinds[] = {OAI_COMPLETION, OAI_CHAT, OAI_TOKENIZE, OAI_DETOKENIZE};
    struct oai_limits lim = {.served_name = "m", .n_vocab = 512, .max_model_len = 256};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        struct oai_request r;
        struct oai_error e;
        memset(&e, 0, sizeof e);
        if (oai_parse(kinds[k], (const char *)data, size, &lim, &r, &e) == KV_OK) {
            int32_t ids[4] = {1, 2, 3, 4};
            struct engine_request_params p;
            oai_engine_params(&r, ids, 4, 256, &p);
            oai_request_free(&r);
        } else if (e.status < 400 || e.status > 599) {
            abort(); /* every refusal carries an HTTP error status */
        }
    }
    return 0;
}
