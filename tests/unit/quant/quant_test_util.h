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

#endif
