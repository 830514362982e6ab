/* etcd helpers: base64 (RFC 4648 vectors, round trips, malformed input) and the prefix
 * range_end of the v3 gateway (the key prefix with its last byte + 1). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "router/etcd.h"

static void test_b64(void **st) {
    (void)st;
    static const char *const plain[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
    static const char *const enc[] = {"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
    for (int i = 0; i < 7; i++) {
        char *e = etcd_b64_encode(plain[i], strlen(plain[i]));
        assert_string_equal(e, enc[i]);
        size_t n;
        char *d = etcd_b64_decode(e, &n);
        assert_non_null(d);
        assert_int_equal(n, strlen(plain[i]));
        assert_memory_equal(d, plain[i], n);
        free(e);
        free(d);
    }
    unsigned char bin[256];
    for (int i = 0; i < 256; i++) bin[i] = (unsigned char)(255 - i);
    char *e = etcd_b64_encode(bin, sizeof bin);
    size_t n;
    char *d = etcd_b64_decode(e, &n);
    assert_int_equal(n, 256);
    assert_memory_equal(d, bin, 256);
    free(e);
    free(d);
    assert_null(etcd_b64_decode("Zm9", &n));     /* not a multiple of 4 */
    assert_null(etcd_b64_decode("Zm9*", &n));    /* not in the alphabet */
    assert_null(etcd_b64_decode("Z===", &n));    /* too much padding */
    assert_null(etcd_b64_decode("Zg==Zg==", &n)); /* padding inside */
}

static void test_prefix_end(void **st) {
    (void)st;
    char *e = etcd_prefix_end_b64("kvserve/workers/");
    size_t n;
    char *d = etcd_b64_decode(e, &n);
    assert_string_equal(d, "kvserve/workers0"); /* '/' + 1 = '0' */
    free(e);
    free(d);
    e = etcd_prefix_end_b64("a\xff");
    d = etcd_b64_decode(e, &n);
    assert_int_equal(n, 1);
    assert_int_equal(d[0], 'b');
    free(e);
    free(d);
    e = etcd_prefix_end_b64("");
    assert_string_equal(e, "AA=="); /* every key */
    free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_b64), cmocka_unit_test(test_prefix_end)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
