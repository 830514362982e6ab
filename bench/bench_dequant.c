/*
 * bench_dequant: ns (and core cycles) per element of kv_dequant_row for every supported type
 * and every ISA this CPU has (src/quant/), in the way the matmul kernels use it: one row of
 * K elements (default 4096) at a time into a small destination buffer that stays in L1.
 *   hot     the packed source rows fit in L2 (pure decode throughput)
 *   stream  the source cycles through a 256 MiB matrix, as a decode step reads weights from DRAM
 * Each number is the median of --runs (default 5) timed runs of >= --ms (default 100) ms.
 * Core cycles come from timing a chain of dependent adds (one per cycle) at the start.
 *
 *   bench_dequant [--k 4096] [--runs 5] [--ms 100] [--hot] [--types Q8_0,Q4_K,...]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/base.h"
#include "bench_util.h"
#include "quant/quant.h"

/* GHz of this core: a chain of dependent adds retires one per cycle. */
static double core_ghz(void) {
    const long iters = 400000000;
    double best = 0;
    for (int r = 0; r < 3; r++) {
        unsigned long x = 0;
        double t0 = kv_now_s();
        for (long i = 0; i < iters; i++) __asm__ volatile("add $1, %0" : "+r"(x));
        double t = kv_now_s() - t0;
        double ghz = (double)iters / t * 1e-9;
        if (ghz > best) best = ghz;
    }
    return best;
}

static uint64_t g_rng = 88172645463325252ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

/* Random blocks with small finite scales. */
static void fill(int type, uint8_t *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)rnd();
    size_t bb = kv_qtype_block_bytes(type);
    for (size_t b = 0; b + bb <= bytes; b += bb) {
        uint8_t *blk = p + b;
        switch (type) {
        case KV_QTYPE_F16: blk[1] &= 0x3b; break;
        case KV_QTYPE_BF16: blk[1] &= 0x3f; break;
        case KV_QTYPE_F32: blk[3] &= 0x3f; break;
        case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: blk[1] = 0x20; break;
        case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: blk[1] = 0x20; blk[3] = 0x20; break;
        case KV_QTYPE_Q6_K: blk[209] = 0x20; break;
        default: break;
        }
    }
}

int main(int argc, char **argv) {
    int K = 4096, runs = 5, ms = 100;
    bool hot_only = false;
    const char *types_arg = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--k") && i + 1 < argc) K = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ms") && i + 1 < argc) ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hot")) hot_only = true;
        else if (!strcmp(argv[i], "--types") && i + 1 < argc) types_arg = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--k 4096] [--runs 5] [--ms 100] [--hot] [--types Q8_0,Q4_K,...]\n", argv[0]);
            return 2;
        }
    }
    if (K <= 0 || K % 256 || runs < 1 || runs > 101 || ms < 1) {
        fprintf(stderr, "--k must be a positive multiple of 256; --runs 1..101; --ms >= 1\n");
        return 2;
    }
    static const int types[] = {KV_QTYPE_F32,  KV_QTYPE_F16,  KV_QTYPE_BF16, KV_QTYPE_Q8_0,
                                KV_QTYPE_Q4_0, KV_QTYPE_Q4_K, KV_QTYPE_Q5_K, KV_QTYPE_Q6_K};
    enum kv_quant_isa auto_isa = kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    double ghz = core_ghz();
    printf("# bench_dequant: K=%d, median of %d runs >= %d ms; AUTO ISA here: %s; core clock %.2f GHz "
           "(dependent-add chain)\n",
           K, runs, ms, kv_quant_isa_name(auto_isa), ghz);
    printf("%-8s %-6s %-7s %10s %10s %10s\n", "isa", "type", "mode", "ns/elem", "cyc/elem", "src GB/s");
    float *dst = aligned_alloc(64, (size_t)K * sizeof(float));
    const size_t stream_bytes = (size_t)256 << 20, hot_bytes = (size_t)512 << 10;
    uint8_t *src = malloc(stream_bytes);
    if (!dst || !src) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    double *t = malloc(sizeof(double) * (size_t)runs);
    for (int ii = KV_QUANT_ISA_GENERIC; ii <= KV_QUANT_ISA_AVX512; ii++) {
        enum kv_quant_isa isa = (enum kv_quant_isa)ii;
        if (kv_quant_set_isa(isa) != isa) {
            printf("%-8s (not available on this CPU)\n", kv_quant_isa_name(isa));
            continue;
        }
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            int type = types[ti];
            if (types_arg && !strstr(types_arg, kv_qtype_name(type))) continue;
            size_t rb = kv_qtype_row_bytes(type, K);
            for (int mode = 0; mode < (hot_only ? 1 : 2); mode++) {
                size_t span = mode ? stream_bytes : hot_bytes;
                size_t nrows = span / rb;
                fill(type, src, nrows * rb);
                size_t row = 0;
                for (int r = 0; r < runs; r++) {
                    long calls = 0;
                    double t0 = kv_now_s(), el;
                    do {
                        for (int j = 0; j < 64; j++) {
                            kv_dequant_row(type, src + row * rb, dst, K);
                            if (++row == nrows) row = 0;
                        }
                        calls += 64;
                        el = kv_now_s() - t0;
                    } while (el < ms * 1e-3);
                    __asm__ volatile("" : : "r"(dst) : "memory");
                    t[r] = el / ((double)calls * K) * 1e9;
                }
                qsort(t, (size_t)runs, sizeof *t, bench_cmp_d);
                double ns = t[runs / 2];
                printf("%-8s %-6s %-7s %10.4f %10.3f %10.2f\n", kv_quant_isa_name(isa), kv_qtype_name(type),
                       mode ? "stream" : "hot", ns, ns * ghz, (double)rb / K / ns);
                fflush(stdout);
            }
        }
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    free(t);
    free(src);
    free(dst);
    return 0;
}
