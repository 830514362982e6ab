/* hash unit tests: the keyed BLAKE3 chain against an independent computation with the
 * BLAKE3 reference API, key / parent / token / extra-key sensitivity, type tags, truncation. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blake3.h"
#include "hash/hash.h"

static kv_hash_key key_of(uint8_t seed) {
    kv_hash_key k;
    for (int i = 0; i < KV_HASH_LEN; i++) k.key[i] = (uint8_t)(seed + 7 * i);
    return k;
}

static void test_matches_blake3_keyed(void **st) {
    (void)st;
    kv_hash_key k = key_of(1);
    const char salt[] = "tenant";
    struct kv_extra_key x = {KV_EXTRA_CACHE_SALT, salt, 6};
    kv_hash root, b0;
    kv_hash_root(&k, &x, 1, &root);
    /* independent: BLAKE3_keyed(key, "kvserve.block.v1" || 0x01 || LE32(6) || "tenant") */
    uint8_t msg[64];
    size_t n = 0;
    memcpy(msg, "kvserve.block.v1", 16), n = 16;
    msg[n++] = 1, msg[n++] = 6, msg[n++] = 0, msg[n++] = 0, msg[n++] = 0;
    memcpy(msg + n, salt, 6), n += 6;
    blake3_hasher h;
    uint8_t want[32];
    blake3_hasher_init_keyed(&h, k.key);
    blake3_hasher_update(&h, msg, n);
    blake3_hasher_finalize(&h, want, 32);
    assert_memory_equal(root.b, want, 32);
    int32_t toks[3] = {1, 300, 0x01020304};
    kv_hash_block(&k, &root, toks, 3, &b0);
    uint8_t m2[32 + 12];
    memcpy(m2, root.b, 32);
    uint8_t le[12] = {1, 0, 0, 0, 0x2c, 1, 0, 0, 4, 3, 2, 1};
    memcpy(m2 + 32, le, 12);
    blake3_hasher_init_keyed(&h, k.key);
    blake3_hasher_update(&h, m2, sizeof m2);
    blake3_hasher_finalize(&h, want, 32);
    assert_memory_equal(b0.b, want, 32);
}

static void test_sensitivity(void **st) {
    (void)st;
    kv_hash_key k1 = key_of(1), k2 = key_of(2);
    kv_hash r1, r2, a, b;
    kv_hash_root(&k1, NULL, 0, &r1);
    kv_hash_root(&k2, NULL, 0, &r2);
    assert_memory_not_equal(r1.b, r2.b, 32); /* per-worker secret */
    int32_t t[16];
    for (int i = 0; i < 16; i++) t[i] = i;
    kv_hash_block(&k1, &r1, t, 16, &a);
    kv_hash_block(&k1, &r1, t, 16, &b);
    assert_memory_equal(a.b, b.b, 32); /* deterministic */
    t[15] = 99;
    kv_hash_block(&k1, &r1, t, 16, &b);
    assert_memory_not_equal(a.b, b.b, 32);
    t[15] = 15;
    kv_hash_block(&k1, &a, t, 16, &b); /* other parent */
    assert_memory_not_equal(a.b, b.b, 32);
}

/* BUG-02: an adapter named X and a cache_salt X must give different roots. */
static void test_extra_keys_type_tagged(void **st) {
    (void)st;
    kv_hash_key k = key_of(3);
    struct kv_extra_key salt = {KV_EXTRA_CACHE_SALT, "COLLIDE_SALT", 12};
    struct kv_extra_key ad = {KV_EXTRA_ADAPTER, "COLLIDE_SALT", 12};
    kv_hash a, b, none;
    kv_hash_root(&k, &salt, 1, &a);
    kv_hash_root(&k, &ad, 1, &b);
    kv_hash_root(&k, NULL, 0, &none);
    assert_memory_not_equal(a.b, b.b, 32);
    assert_memory_not_equal(a.b, none.b, 32);
    /* lengths are part of the input: ("ab","c") != ("a","bc") */
    struct kv_extra_key x1[2] = {{KV_EXTRA_CACHE_SALT, "ab", 2}, {KV_EXTRA_ADAPTER, "c", 1}};
    struct kv_extra_key x2[2] = {{KV_EXTRA_CACHE_SALT, "a", 1}, {KV_EXTRA_ADAPTER, "bc", 2}};
    kv_hash_root(&k, x1, 2, &a);
    kv_hash_root(&k, x2, 2, &b);
    assert_memory_not_equal(a.b, b.b, 32);
}

static void test_truncation_and_hex(void **st) {
    (void)st;
    kv_hash_key k = key_of(4);
    kv_hash full, tr;
    kv_hash_root(&k, NULL, 0, &full);
    kv_hash_test_truncate_bits(8);
    kv_hash_root(&k, NULL, 0, &tr);
    kv_hash_test_truncate_bits(0);
    assert_int_equal(tr.b[0], full.b[0]);
    for (int i = 1; i < 32; i++) assert_int_equal(tr.b[i], 0);
    char hx[65];
    kv_hash_hex(&tr, hx);
    assert_int_equal(strlen(hx), 64);
    assert_string_equal(hx + 2, "00000000000000000000000000000000000000000000000000000000000000");
}

static void test_key_file(void **st) {
    (void)st;
    char path[] = "/tmp/kv_hash_keyXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    unlink(path);
    kv_hash_key a, b;
    char err[256];
    assert_int_equal(kv_hash_key_load_or_create(path, &a, err, sizeof err), KV_OK); /* created */
    assert_int_equal(kv_hash_key_load_or_create(path, &b, err, sizeof err), KV_OK); /* loaded */
    assert_memory_equal(a.key, b.key, 32);
    FILE *f = fopen(path, "ab");
    fputc(0, f);
    fclose(f);
    assert_int_equal(kv_hash_key_load_or_create(path, &b, err, sizeof err), KV_EINVAL);
    unlink(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_blake3_keyed), cmocka_unit_test(test_sensitivity),
        cmocka_unit_test(test_extra_keys_type_tagged), cmocka_unit_test(test_truncation_and_hex),
        cmocka_unit_test(test_key_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
