/* libFuzzer target: the GGUF reader (src/model/gguf.c) on arbitrary bytes: gguf_open through a
 * memfd (a real file mapping, as for a model), then every metadata key and tensor is read. A
 * malformed file must be refused with a message, never crash or read outside the map. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "model/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz.gguf", 0);
    if (fd < 0) return 0;
    if (size && write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    char path[64], err[512];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    gguf_t *g = NULL;
    if (gguf_open(path, &g, err, sizeof err) == KV_OK) {
        for (int i = 0; i < gguf_n_keys(g); i++) {
            const char *k = gguf_key_name(g, i);
            int64_t iv;
            double dv;
            bool bv;
            const char *s;
            size_t sl;
            enum gguf_type et;
            uint64_t n;
            (void)gguf_get_int(g, k, &iv);
            (void)gguf_get_float(g, k, &dv);
            (void)gguf_get_bool(g, k, &bv);
            if (gguf_get_str(g, k, &s, &sl) && sl && !gguf_in_map(g, s, sl)) abort();
            if (gguf_get_arr_info(g, k, &et, &n))
                for (uint64_t j = 0; j < n && j < 64; j++) (void)gguf_get_arr_str(g, k, j, &s, &sl);
            (void)gguf_get_arr_data(g, k);
        }
        for (int i = 0; i < gguf_n_tensors(g); i++) {
            const struct gguf_tensor *t = gguf_tensor_at(g, i);
            if (t->nbytes && !gguf_in_map(g, t->data, t->nbytes)) abort();
            uint64_t ne = 1;
            for (int d = 0; d < t->n_dims; d++) ne *= t->ne[d];
            if (ne > 0 && ne <= 4096) {
                float *f = malloc(ne * sizeof *f);
                if (f) (void)gguf_tensor_to_f32(t, f, ne, err, sizeof err);
                free(f);
            }
        }
        gguf_close(g);
    }
    close(fd);
    return 0;
}
