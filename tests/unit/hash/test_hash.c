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

/* One serializer: the bytes kv_hash_root hashes are kv_extra_keys_serialize's (the engine
 * hashes serialized bytes, the router calls kv_hash_root: both must agree). */
static void test_extra_serializer_shared(void **st) {
    (void)st;
    kv_hash_key k = key_of(3);
    char big[300];
    memset(big, 'z', sizeof big);
    struct kv_extra_key x[2] = {{KV_EXTRA_CACHE_SALT, "tenant", 6}, {KV_EXTRA_ADAPTER, big, sizeof big}};
    size_t n = kv_extra_keys_serialize(x, 2, NULL);
    assert_int_equal(n, 5 + 6 + 5 + 300);
    uint8_t *buf = malloc(n);
    assert_non_null(buf);
    assert_int_equal(kv_extra_keys_serialize(x, 2, buf), n);
    assert_int_equal(buf[0], 1);
    assert_int_equal(buf[1], 6);
    assert_int_equal(buf[11], 2);
    assert_int_equal(buf[12] | buf[13] << 8, 300);
    kv_hash a, b;
    kv_hash_root(&k, x, 2, &a);
    kv_hash_root_bytes(&k, buf, n, &b);
    assert_memory_equal(a.b, b.b, 32);
    kv_hash_root(&k, NULL, 0, &a);
    kv_hash_root_bytes(&k, NULL, 0, &b);
    assert_memory_equal(a.b, b.b, 32);
    free(buf);
}

/* Content keys (decision 1): k0 from the salt, one key per complete group of 8 blocks,
 * chained; independent computation with the BLAKE3 reference API. */
static void test_content_keys(void **st) {
    (void)st;
    kv_hash_key k = key_of(9);
    int32_t ids[200];
    for (int i = 0; i < 200; i++) ids[i] = 1000 + i * 37;
    kv_hash out[8];
    /* tpb 4: a group = 32 ids; 200 ids = 6 complete groups (the partial one is not hashed) */
    assert_int_equal(kv_content_keys(&k, NULL, 0, ids, 200, 4, out, 8), 6);
    assert_int_equal(kv_content_keys(&k, NULL, 0, ids, 31, 4, out, 8), 0);
    assert_int_equal(kv_content_keys(&k, NULL, 0, ids, 200, 4, out, 2), 2);
    kv_hash all[8];
    assert_int_equal(kv_content_keys(&k, "s", 1, ids, 200, 4, all, 8), 6);
    blake3_hasher h;
    uint8_t prev[32], want[32];
    blake3_hasher_init_keyed(&h, k.key);
    blake3_hasher_update(&h, "kvserve.content.v1s", 19);
    blake3_hasher_finalize(&h, prev, 32);
    for (int g = 0; g < 6; g++) {
        blake3_hasher_init_keyed(&h, k.key);
        blake3_hasher_update(&h, prev, 32);
        for (int i = 0; i < 32; i++) {
            uint32_t v = (uint32_t)ids[g * 32 + i];
            uint8_t le[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
            blake3_hasher_update(&h, le, 4);
        }
        blake3_hasher_finalize(&h, want, 32);
        assert_memory_equal(all[g].b, want, 32);
        memcpy(prev, want, 32);
    }
    /* the salt changes every key; a shared prefix gives shared leading keys */
    assert_memory_not_equal(all[0].b, out[0].b, 32);
    int32_t ids2[200];
    memcpy(ids2, ids, sizeof ids);
    ids2[100] = 7; /* group 3 */
    kv_hash o2[8];
    assert_int_equal(kv_content_keys(&k, NULL, 0, ids2, 200, 4, o2, 8), 6);
    kv_content_keys(&k, NULL, 0, ids, 200, 4, out, 8);
    assert_memory_equal(o2[2].b, out[2].b, 32);
    assert_memory_not_equal(o2[3].b, out[3].b, 32);
    assert_memory_not_equal(o2[5].b, out[5].b, 32);
}

static void test_key_id(void **st) {
    (void)st;
    kv_hash_key a = key_of(1), b = key_of(2);
    char ia[17], ia2[17], ib[17];
    kv_hash_key_id(&a, ia);
    kv_hash_key_id(&a, ia2);
    kv_hash_key_id(&b, ib);
    assert_int_equal(strlen(ia), 16);
    assert_string_equal(ia, ia2);
    assert_string_not_equal(ia, ib);
    /* hex -> index key round trip (the router parses the workers' event hashes with it) */
    kv_hash h;
    kv_hash_root(&a, NULL, 0, &h);
    char hx[65];
    kv_hash_hex(&h, hx);
    uint64_t v = 0;
    assert_true(kv_hash_u64_from_hex(hx, &v));
    assert_true(v == kv_hash_u64(&h));
    assert_true(kv_hash_u64_from_hex("0123456789ABCDEF", &v));
    assert_true(v == 0xefcdab8967452301ull);
    assert_false(kv_hash_u64_from_hex("0123456789abcde", &v));
    assert_false(kv_hash_u64_from_hex("0123456789abcdeg", &v));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_blake3_keyed), cmocka_unit_test(test_sensitivity),
        cmocka_unit_test(test_extra_keys_type_tagged), cmocka_unit_test(test_truncation_and_hex),
        cmocka_unit_test(test_key_file), cmocka_unit_test(test_extra_serializer_shared),
        cmocka_unit_test(test_content_keys), cmocka_unit_test(test_key_id),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
