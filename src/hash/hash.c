/* hash: keyed BLAKE3 block-hash chain (see hash.h). */
#include "hash.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "blake3.h"

static atomic_int g_trunc_bits;

void kv_hash_test_truncate_bits(int bits) {
    if (bits < 0 || bits >= 256) bits = 0;
    atomic_store(&g_trunc_bits, bits);
}

static void finish(blake3_hasher *h, kv_hash *out) {
    blake3_hasher_finalize(h, out->b, KV_HASH_LEN);
    int bits = atomic_load(&g_trunc_bits);
    if (bits > 0) {
        int full = bits / 8, rem = bits % 8;
        if (rem) out->b[full] &= (uint8_t)(0xffu << (8 - rem)), full++;
        memset(out->b + full, 0, (size_t)(KV_HASH_LEN - full));
    }
}

static void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* The tag of one extra key: kind byte, LE32 length (the bytes follow). */
static void put_tag(uint8_t tag[5], const struct kv_extra_key *x) {
    tag[0] = (uint8_t)x->kind;
    put_le32(tag + 1, (uint32_t)x->len);
}

size_t kv_extra_keys_serialize(const struct kv_extra_key *extras, int n, uint8_t *out) {
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        if (out) {
            put_tag(out + len, &extras[i]);
            if (extras[i].len) memcpy(out + len + 5, extras[i].data, extras[i].len);
        }
        len += 5 + extras[i].len;
    }
    return len;
}

static void root_begin(blake3_hasher *h, const kv_hash_key *k) {
    static const char domain[] = "kvserve.block.v1";
    blake3_hasher_init_keyed(h, k->key);
    blake3_hasher_update(h, domain, sizeof domain - 1);
}

void kv_hash_root_bytes(const kv_hash_key *k, const uint8_t *bytes, size_t len, kv_hash *out) {
    blake3_hasher h;
    root_begin(&h, k);
    if (len) blake3_hasher_update(&h, bytes, len);
    finish(&h, out);
}

void kv_hash_root(const kv_hash_key *k, const struct kv_extra_key *extras, int n, kv_hash *out) {
    blake3_hasher h;
    root_begin(&h, k);
    for (int i = 0; i < n; i++) { /* the bytes of kv_extra_keys_serialize, streamed */
        uint8_t tag[5];
        put_tag(tag, &extras[i]);
        blake3_hasher_update(&h, tag, sizeof tag);
        if (extras[i].len) blake3_hasher_update(&h, extras[i].data, extras[i].len);
    }
    finish(&h, out);
}

void kv_hash_key_id(const kv_hash_key *k, char out[17]) {
    static const char domain[] = "kvserve.key-id";
    blake3_hasher h;
    blake3_hasher_init_keyed(&h, k->key);
    blake3_hasher_update(&h, domain, sizeof domain - 1);
    uint8_t b[8];
    blake3_hasher_finalize(&h, b, sizeof b);
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < 8; i++) {
        out[2 * i] = hx[b[i] >> 4];
        out[2 * i + 1] = hx[b[i] & 15];
    }
    out[16] = 0;
}

int kv_content_keys(const kv_hash_key *k, const void *salt, size_t salt_len, const int32_t *elems,
                    size_t n, int tokens_per_block, kv_hash *out, int max) {
    static const char domain[] = "kvserve.content.v1";
    if (tokens_per_block < 1 || max <= 0) return 0;
    size_t group = (size_t)KV_CONTENT_GROUP_BLOCKS * (size_t)tokens_per_block;
    blake3_hasher h;
    blake3_hasher_init_keyed(&h, k->key);
    blake3_hasher_update(&h, domain, sizeof domain - 1);
    if (salt_len) blake3_hasher_update(&h, salt, salt_len);
    kv_hash prev;
    finish(&h, &prev);
    int m = 0;
    for (size_t g = 0; g + group <= n && m < max; g += group) {
        kv_hash_block(k, &prev, elems + g, (int)group, &out[m]); /* key || LE32 elements */
        prev = out[m++];
    }
    return m;
}

void kv_hash_block(const kv_hash_key *k, const kv_hash *parent, const int32_t *tokens, int n,
                   kv_hash *out) {
    blake3_hasher h;
    blake3_hasher_init_keyed(&h, k->key);
    blake3_hasher_update(&h, parent->b, KV_HASH_LEN);
    uint8_t buf[256];
    int used = 0;
    for (int i = 0; i < n; i++) {
        put_le32(buf + used, (uint32_t)tokens[i]);
        used += 4;
        if (used == (int)sizeof buf) {
            blake3_hasher_update(&h, buf, (size_t)used);
            used = 0;
        }
    }
    if (used) blake3_hasher_update(&h, buf, (size_t)used);
    finish(&h, out);
}

bool kv_hash_u64_from_hex(const char *s, uint64_t *out) {
    if (!s) return false;
    kv_hash h = {{0}};
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return false; /* also the NUL of a short string */
        h.b[i / 2] = (uint8_t)(h.b[i / 2] << 4 | d);
    }
    *out = kv_hash_u64(&h);
    return true;
}

void kv_hash_hex(const kv_hash *h, char out[2 * KV_HASH_LEN + 1]) {
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < KV_HASH_LEN; i++) {
        out[2 * i] = hx[h->b[i] >> 4];
        out[2 * i + 1] = hx[h->b[i] & 15];
    }
    out[2 * KV_HASH_LEN] = 0;
}

kv_status kv_hash_key_random(kv_hash_key *k) {
    size_t got = 0;
    while (got < sizeof k->key) {
        ssize_t n = getrandom(k->key + got, sizeof k->key - got, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return KV_EIO;
        }
        got += (size_t)n;
    }
    return KV_OK;
}

kv_status kv_hash_key_load_or_create(const char *path, kv_hash_key *k, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (f) {
        uint8_t buf[KV_HASH_LEN + 1];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        if (n != KV_HASH_LEN)
            return kv_errf(KV_EINVAL, err, errlen, "hash key file %s must hold exactly %d bytes (has %zu%s)",
                           path, KV_HASH_LEN, n, n > KV_HASH_LEN ? " or more" : "");
        memcpy(k->key, buf, KV_HASH_LEN);
        return KV_OK;
    }
    if (errno != ENOENT)
        return kv_errf(KV_EIO, err, errlen, "cannot read hash key file %s: %s", path, strerror(errno));
    if (kv_hash_key_random(k) != KV_OK)
        return kv_errf(KV_EIO, err, errlen, "no randomness for a new hash key");
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return kv_errf(KV_EIO, err, errlen, "cannot create hash key file %s: %s", path, strerror(errno));
    ssize_t w = write(fd, k->key, KV_HASH_LEN);
    close(fd);
    if (w != KV_HASH_LEN)
        return kv_errf(KV_EIO, err, errlen, "cannot write hash key file %s", path);
    return KV_OK;
}

uint64_t kv_checksum64(const void *data, size_t n) {
    blake3_hasher h;
    blake3_hasher_init(&h);
    blake3_hasher_update(&h, data, n);
    kv_hash out;
    blake3_hasher_finalize(&h, out.b, KV_HASH_LEN);
    return kv_hash_u64(&out);
}
