/* Helpers shared by the quant tests (test_quant.c, test_qdot.c). */
#ifndef KV_TESTS_QUANT_TEST_UTIL_H
#define KV_TESTS_QUANT_TEST_UTIL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "quant/quant.h"

static const enum kv_quant_isa k_isas[] = {KV_QUANT_ISA_GENERIC, KV_QUANT_ISA_AVX2, KV_QUANT_ISA_AVX512};
#define N_ISAS 3

/* Forces isa; false (with a note, once) when the CPU lacks it. */
static inline bool use_isa(enum kv_quant_isa isa) {
    static bool noted[4];
    if (kv_quant_set_isa(isa) == isa) return true;
    if (!noted[isa]) {
        noted[isa] = true;
        fprintf(stderr, "NOTE: this CPU has no %s: that ISA is not exercised\n", kv_quant_isa_name(isa));
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    return false;
}

/* xorshift64 step of the state *s. */
static inline uint64_t qt_xorshift(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* f16 block scales for "extreme" random rows: zeros, subnormals, the largest finite, 1.0, ... */
static const uint16_t qt_scales[] = {0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff,
                                     0xfbff, 0x1234, 0xa5a5, 0x2e66, 0x2400, 0xa400, 0x1800};
#define QT_N_SCALES (sizeof qt_scales / sizeof qt_scales[0])
/* A random f16 block scale from *s: one of qt_scales when extreme, else a moderate one. */
static inline uint16_t qt_scale(uint64_t *s, bool extreme) {
    return extreme ? qt_scales[qt_xorshift(s) % QT_N_SCALES] : (uint16_t)(0x2000 + qt_xorshift(s) % 0x1800);
}
/* Little-endian u16 store. */
static inline void qt_put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

#endif
