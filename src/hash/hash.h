/*
 * hash: keyed BLAKE3 hashes of KV blocks (the reuse index, KV events, prefix waits and
 * KV-aware routing all use them; spec "Decisions" 1 and 2).
 *
 *   root   = BLAKE3_keyed(secret, "kvserve.block.v1" || extra keys)
 *   h_0    = BLAKE3_keyed(secret, root || LE32 token ids of block 0)
 *   h_i    = BLAKE3_keyed(secret, h_{i-1} || LE32 token ids of block i)
 *
 * Extra keys are type-tagged (kind byte, LE32 length, bytes) so that e.g. an adapter
 * named "X" and a cache_salt "X" can never produce the same root (BUG-02). The secret is
 * per worker (random at startup unless loaded from --hash-key-file), so hashes cannot be
 * predicted by clients (BUG-01). Hashes are 32 bytes; a hash is never trusted alone: the
 * reuse index also compares token ids and the parent chain (see kvcache.h).
 *
 * Test hook: kv_hash_test_truncate_bits(8) keeps only the first 8 bits of every hash
 * computed afterwards (process-wide; for collision tests only).
 */
#ifndef KV_HASH_H
#define KV_HASH_H

#include "../base/base.h"

#define KV_HASH_LEN 32
#define KV_HASH_SCHEME "blake3-keyed-chain-v1"

typedef struct {
    uint8_t b[KV_HASH_LEN];
} kv_hash;

/* The per-worker secret. */
typedef struct {
    uint8_t key[KV_HASH_LEN];
} kv_hash_key;

enum kv_extra_kind {
    KV_EXTRA_CACHE_SALT = 1, /* the request's cache_salt (bytes of the string) */
    KV_EXTRA_ADAPTER = 2,    /* adapter (LoRA) id */
    KV_EXTRA_MM = 3,         /* multimodal payload hash */
};

struct kv_extra_key {
    enum kv_extra_kind kind;
    const void *data; /* (len) bytes, borrowed */
    size_t len;
};

/* Fills k with 32 random bytes (getrandom/urandom). KV_EIO if no randomness. */
kv_status kv_hash_key_random(kv_hash_key *k);
/* Loads a 32-byte secret from path; if the file does not exist, generates one and writes
 * it (mode 0600). KV_EIO / KV_EINVAL (file of another size) with a message in err. */
kv_status kv_hash_key_load_or_create(const char *path, kv_hash_key *k, char *err, size_t errlen);

/* The one serializer of extra keys (the engine's reuse index, its pool root ids and the
 * router all use it, so router and workers hash identically): for each key, in order,
 * kind (1 byte) || LE32 length || bytes. Writes to out (may be NULL) and returns the byte
 * count (sum of 5 + len). */
size_t kv_extra_keys_serialize(const struct kv_extra_key *extras, int n, uint8_t *out);

/* Root of a chain: the extra keys in the given order (n may be 0, extras may then be NULL).
 * = BLAKE3_keyed(secret, "kvserve.block.v1" || kv_extra_keys_serialize(extras)). */
void kv_hash_root(const kv_hash_key *k, const struct kv_extra_key *extras, int n, kv_hash *out);
/* The same root from already serialized extra keys (bytes[0..len), len may be 0). */
void kv_hash_root_bytes(const kv_hash_key *k, const uint8_t *bytes, size_t len, kv_hash *out);

/* Public fingerprint of a secret: the first 8 bytes of BLAKE3_keyed(secret, "kvserve.key-id")
 * as 16 hex digits (+ NUL). Reveals nothing usable about the key; equal fingerprints mean the
 * router and a worker hash blocks alike (workers publish it in /server_info and /kv_events). */
void kv_hash_key_id(const kv_hash_key *k, char out[17]);

/* Content keys of conversation routing (spec seed-features.md §1.3, decision 1):
 *   k0  = BLAKE3_keyed(secret, "kvserve.content.v1" || salt)
 *   k_i = BLAKE3_keyed(secret, k_{i-1} || LE32 elements of group i), i = 1, 2, ...
 * where a group is 8 blocks x tokens_per_block elements (token ids, or UTF-32 code points
 * when the router has no tokenizer); only complete groups are hashed. Writes k_1.. (k0 is not
 * returned) to out, at most max of them, and returns how many: min(n / (8 * tpb), max).
 * salt may be NULL (salt_len 0). tokens_per_block >= 1. Thread-safe. */
#define KV_CONTENT_GROUP_BLOCKS 8
int kv_content_keys(const kv_hash_key *k, const void *salt, size_t salt_len, const int32_t *elems,
                    size_t n, int tokens_per_block, kv_hash *out, int max);
/* Hash of one block: parent (the root for block 0) and its n token ids. */
void kv_hash_block(const kv_hash_key *k, const kv_hash *parent, const int32_t *tokens, int n,
                   kv_hash *out);
/* 64-bit index key of a hash (its first 8 bytes, little endian). */
static inline uint64_t kv_hash_u64(const kv_hash *h) {
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--) x = (x << 8) | h->b[i];
    return x;
}
/* The 64-bit index key (kv_hash_u64) of a hash given in hex: the first 16 hex digits of s
 * (either case; more may follow). False when s has fewer or a non-hex one among them. */
bool kv_hash_u64_from_hex(const char *s, uint64_t *out);
/* Lower-case hex of h (65 bytes with the NUL). */
void kv_hash_hex(const kv_hash *h, char out[2 * KV_HASH_LEN + 1]);

/* Unkeyed 64-bit BLAKE3 checksum of n bytes (debug round-trip checks of KV blocks). */
uint64_t kv_checksum64(const void *data, size_t n);

/* Test only: keep the first `bits` bits (1..256; 0 or 256 = full hashes) of every hash. */
void kv_hash_test_truncate_bits(int bits);

#endif
