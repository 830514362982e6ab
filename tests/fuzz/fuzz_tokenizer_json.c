/* libFuzzer target: the tokenizer.json loader (src/tokenizer/tok_load_json.c and the
 * normalizer / pre-tokenizer / model / decoder it builds) on arbitrary bytes written to a
 * memfd; a tokenizer that loads then encodes and decodes a fixed text. Refusals are fine;
 * crashes, leaks and hangs are not. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* tok_load decides by name: a directory, *.gguf, or a tokenizer.json file */
    char dir[] = "/tmp/fuzz_tokXXXXXX";
    if (!mkdtemp(dir)) return 0;
    char path[128], err[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(data, 1, size, f);
        fclose(f);
        tokenizer_t *t = NULL;
        if (tok_load(path, &t, err, sizeof err) == KV_OK) {
            static const char text[] = "Hello, world! 123 \xc3\xa9t\xc3\xa9 <s> \xe4\xbd\xa0\xe5\xa5\xbd\n\t  end";
            int32_t *ids = NULL;
            size_t n = 0;
            if (tok_encode(t, text, sizeof text - 1, true, true, &ids, &n) == KV_OK) {
                char *out = NULL;
                size_t on = 0;
                if (tok_decode(t, ids, n, false, &out, &on) == KV_OK) free(out);
                free(ids);
            }
            tok_free(t);
        }
        unlink(path);
    }
    rmdir(dir);
    return 0;
}
