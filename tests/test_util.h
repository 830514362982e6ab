/* Shared helpers for the cmocka unit tests. */
#ifndef KV_TEST_UTIL_H
#define KV_TEST_UTIL_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Directory of the shared test data ($KVSERVE_TEST_DATA, default ../shared/data). */
static inline const char *test_data_dir(void) {
    const char *d = getenv("KVSERVE_TEST_DATA");
    return d && *d ? d : "../shared/data";
}
/* Joins test_data_dir() and rel into buf; returns buf, or NULL (and prints a visible SKIP
 * message) if the file does not exist. */
static inline const char *test_data_path(char *buf, size_t cap, const char *rel) {
    snprintf(buf, cap, "%s/%s", test_data_dir(), rel);
    FILE *f = fopen(buf, "rb");
    if (!f) {
        fprintf(stderr, "SKIP: test data %s not found (set KVSERVE_TEST_DATA)\n", buf);
        return NULL;
    }
    fclose(f);
    return buf;
}
#endif
