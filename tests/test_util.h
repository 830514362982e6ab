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

/* A private temporary directory per test binary: test_tmpdir_make(prefix) creates
 * /tmp/<prefix>_XXXXXX into buf; test_tmpdir_remove(buf) deletes it recursively. 0 on success. */
static inline int test_tmpdir_make(char *buf, size_t cap, const char *prefix) {
    snprintf(buf, cap, "/tmp/%s_XXXXXX", prefix);
    return mkdtemp(buf) ? 0 : -1;
}
static inline int test_tmpdir_remove(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}
#endif
