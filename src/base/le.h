/*
 * Little-endian integers in byte buffers and 64-bit FNV-1a, for the transports' descriptors
 * (transfer/transport_ucx.c, backend/cuda/transport_cuda_ipc.cu): the checksum guards against
 * corrupted bytes, it is not a cryptographic hash. Header-only; C and C++.
 */
#ifndef KV_BASE_LE_H
#define KV_BASE_LE_H

#include <stddef.h>
#include <stdint.h>

static inline void kv_put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kv_put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t kv_get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t kv_get_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static inline uint64_t kv_fnv1a64(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

#endif
