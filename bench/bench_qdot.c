/*
 * bench_qdot: ns per weight of the fused dequantize+dot kernels (kv_qdot_rows, src/quant/
 * qdot.h) against what the CPU matmul did before them for decode: dequantize 4 weight rows
 * with kv_dequant_row into an f32 panel, then the f32 FMA tile over the panel (here the F32
 * kernel of kv_qdot_rows, the same 16-lane register tile as matmul_x86.c's). Per type, per ISA
 * this CPU has, for M = 1 and M = 4 activation rows, one thread:
 *   hot     the packed weights fit in L2 (512 KiB, cycled): compute-bound throughput
 *   stream  the weights cycle through 320 MiB (> any LLC), as a decode step reads them
 * Rows of K (default 4096) elements, 64 rows per kv_qdot_rows call. Each number is the
 * median of --runs (default 5) runs of >= --ms (default 100) ms. For F32/F16/BF16 also the same
 * rows in the grouped layout (kv_fgroup_pack, kv_qdot_grouped: what the CPU backend reads
 * after repacking F16/BF16 at load).
 * --int8: instead, the integer path of the quantized types (kv_q8_dot_rows over the file's rows,
 * activations quantized by kv_q8_quantize: what decode runs in the default --quant-matmul int8)
 * in ns per weight and GB/s of weights read. --rows N: rows per call (default 64; the CPU matmul's
 * decode tasks are 64 rows at K = 2048 and 16 at K = 5632; a multiple of 4 without --int8, whose
 * panel path writes 4 rows at a time). --m LIST: the activation row counts (default 1,4; up to 16
 * numbers of 1..512); with --int8 and M > 4 also "pack", what the CPU matmul runs for such M where
 * the rows path is not preferred (kv_q8_rows_preferred): each call's rows repacked (kv_q8_pack)
 * then kv_q8_dot_packed.
 *
 *   bench_qdot [--k 4096] [--runs 5] [--ms 100] [--hot] [--types Q8_0,Q4_K,...] [--isa avx512]
 *              [--int8] [--rows 64] [--m 1,4]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/base.h"
#include "bench_util.h"
#include "quant/q8.h"
#include "quant/qdot.h"

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
        case KV_QTYPE_BF16: blk[1] = (uint8_t)((blk[1] & 0x80) | (0x3c + rnd() % 4)); break;
        case KV_QTYPE_F32: blk[3] = (uint8_t)((blk[3] & 0x80) | (0x3c + rnd() % 4)); break; /* |x| in 2^-7..2: no subnormal products */
        case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: blk[1] = 0x20; break;
        case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: blk[1] = 0x20; blk[3] = 0x20; break;
        case KV_QTYPE_Q6_K: blk[209] = 0x20; break;
        default: break;
        }
    }
}

static int GROUP = 64; /* rows per call */

struct ctx {
    int type, K, M;
    size_t rb, nrows;
    const uint8_t *w;
    const uint8_t *g; /* the same rows in the grouped layout (kv_fgroup_pack), or NULL */
    const float *X;
    float *Y, *panel;
    const struct kv_q8_act *qa; /* X quantized for the integer path (--int8), or NULL */
    void *pk;                   /* the repack's panel (way 4) */
};

/* the old way: per 4 rows, kv_dequant_row into the panel, then the f32 tile */
static void panel_group(const struct ctx *c, size_t row) {
    for (int r = 0; r < GROUP; r += 4) {
        const uint8_t *p = c->w + (row + (size_t)r) * c->rb;
        if (c->type == KV_QTYPE_F32) {
            kv_qdot_rows(KV_QTYPE_F32, p, c->rb, 4, c->K, c->X, (size_t)c->K, c->M, c->Y + r, GROUP);
            continue;
        }
        for (int j = 0; j < 4; j++) kv_dequant_row(c->type, p + (size_t)j * c->rb, c->panel + (size_t)j * c->K, c->K);
        kv_qdot_rows(KV_QTYPE_F32, c->panel, (size_t)c->K * 4, 4, c->K, c->X, (size_t)c->K, c->M, c->Y + r, GROUP);
    }
}

static void fused_group(const struct ctx *c, size_t row) {
    kv_qdot_rows(c->type, c->w + row * c->rb, c->rb, GROUP, c->K, c->X, (size_t)c->K, c->M, c->Y, GROUP);
}

static void int8_group(const struct ctx *c, size_t row) {
    kv_q8_dot_rows(c->type, c->w + row * c->rb, c->rb, GROUP, c->qa, 0, c->M, c->Y, (size_t)GROUP);
}

static void pack_group(const struct ctx *c, size_t row) {
    kv_q8_pack(c->type, c->w + row * c->rb, c->rb, GROUP, c->K, c->pk);
    kv_q8_dot_packed(c->type, c->pk, GROUP, c->qa, 0, c->M, c->Y, (size_t)GROUP);
}

static void grouped_group(const struct ctx *c, size_t row) {
    kv_qdot_grouped(c->type, c->g + row * c->rb, GROUP, c->K, c->X, (size_t)c->K, c->M, c->Y, GROUP);
}

/* median ns per weight; way: 0 the old panel path, 1 fused (kv_qdot_rows), 2 grouped, 3 the
 * integer path (kv_q8_dot_rows), 4 the integer path's repack + packed product */
static double measure(const struct ctx *c, int way, int runs, int ms) {
    double t[101];
    size_t row = 0;
    for (int r = 0; r < runs; r++) {
        long groups = 0;
        double t0 = kv_now_s(), el;
        do {
            for (int j = 0; j < 8; j++) {
                if (way == 1) fused_group(c, row);
                else if (way == 2) grouped_group(c, row);
                else if (way == 3) int8_group(c, row);
                else if (way == 4) pack_group(c, row);
                else panel_group(c, row);
                row += (size_t)GROUP;
                if (row + (size_t)GROUP > c->nrows) row = 0;
            }
            groups += 8;
            el = kv_now_s() - t0;
        } while (el < ms * 1e-3);
        __asm__ volatile("" : : "r"(c->Y) : "memory");
        t[r] = el / ((double)groups * GROUP * c->K) * 1e9;
    }
    qsort(t, (size_t)runs, sizeof t[0], bench_cmp_d);
    return t[runs / 2];
}

int main(int argc, char **argv) {
    int K = 4096, runs = 5, ms = 100;
    bool hot_only = false, int8 = false;
    const char *types_arg = NULL, *isa_arg = NULL, *m_arg = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--k") && i + 1 < argc) K = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ms") && i + 1 < argc) ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hot")) hot_only = true;
        else if (!strcmp(argv[i], "--types") && i + 1 < argc) types_arg = argv[++i];
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) isa_arg = argv[++i];
        else if (!strcmp(argv[i], "--int8")) int8 = true;
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) GROUP = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--m") && i + 1 < argc) m_arg = argv[++i];
        else {
            fprintf(stderr,
                    "usage: %s [--k 4096] [--runs 5] [--ms 100] [--hot] [--types Q8_0,Q4_K,...] [--isa avx512] [--int8] "
                    "[--rows 64] [--m 1,4]\n",
                    argv[0]);
            return 2;
        }
    }
    enum { MAXM = 512, MAXL = 16 };
    int ms_list[MAXL] = {1, 4}, n_m = 2;
    if (m_arg) { /* numbers 1..MAXM separated by single commas, at most MAXL of them */
        n_m = 0;
        for (const char *q = m_arg;;) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q || *q < '0' || *q > '9' || v < 1 || v > MAXM || (*end && *end != ',') || n_m == MAXL) {
                n_m = -1;
                break;
            }
            ms_list[n_m++] = (int)v;
            if (!*end) break;
            q = end + 1;
        }
    }
    const size_t stream_bytes = (size_t)320 << 20, hot_bytes = (size_t)512 << 10;
    if (K <= 0 || K % 256 || runs < 1 || runs > 101 || ms < 1 || GROUP < 1 || GROUP > 4096 || n_m < 1 ||
        (!int8 && GROUP % 4) || (size_t)GROUP * sizeof(float) * (size_t)K > stream_bytes) {
        fprintf(stderr, "--k must be a positive multiple of 256 with --rows x 4 x K <= 320 MiB; --runs 1..101; "
                        "--ms >= 1; --rows 1..4096 (a multiple of 4 without --int8); --m: a list of at most 16 "
                        "numbers 1..512\n");
        return 2;
    }
    int max_m = 1;
    for (int i = 0; i < n_m; i++) max_m = ms_list[i] > max_m ? ms_list[i] : max_m;
    static const int types[] = {KV_QTYPE_F32,  KV_QTYPE_F16,  KV_QTYPE_BF16, KV_QTYPE_Q8_0,
                                KV_QTYPE_Q4_0, KV_QTYPE_Q4_K, KV_QTYPE_Q5_K, KV_QTYPE_Q6_K};
    enum kv_quant_isa auto_isa = kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    printf("# bench_qdot: K=%d, %d rows per call, one thread, median of %d runs >= %d ms; AUTO ISA here: %s\n"
           "# fused = kv_qdot_rows; panel = kv_dequant_row 4 rows into an f32 panel + the f32 tile (the old "
           "matmul decode path; for F32 both are the f32 tile)\n",
           K, GROUP, runs, ms, kv_quant_isa_name(auto_isa));
    printf("%-8s %-6s %2s %-7s %10s %10s %8s %10s %12s %12s\n", "isa", "type", "M", "mode", "fused ns/w", "panel ns/w",
           "gain", "fused GB/s", "grouped ns/w", "grouped GB/s");
    uint8_t *src = malloc(stream_bytes), *grp = malloc(stream_bytes);
    const size_t nx = (size_t)max_m * (size_t)K, ny = ((size_t)max_m * (size_t)GROUP + 15) / 16 * 16;
    float *X = aligned_alloc(64, sizeof(float) * nx), *Y = aligned_alloc(64, sizeof(float) * ny);
    float *panel = aligned_alloc(64, sizeof(float) * 4 * (size_t)K);
    if (!src || !grp || !X || !Y || !panel) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < nx; i++) X[i] = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;
    for (int ii = KV_QUANT_ISA_GENERIC; ii <= KV_QUANT_ISA_AVX512; ii++) {
        enum kv_quant_isa isa = (enum kv_quant_isa)ii;
        if (isa_arg && strcmp(isa_arg, kv_quant_isa_name(isa))) continue;
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
                size_t nrows = span / rb / (size_t)GROUP * (size_t)GROUP;
                if (nrows < (size_t)GROUP) nrows = (size_t)GROUP;
                if (nrows * rb > stream_bytes) {
                    fprintf(stderr, "--k too large\n");
                    return 2;
                }
                fill(type, src, nrows * rb);
                bool grouped = kv_fgroup_ok(type, K);
                if (grouped) kv_fgroup_pack(type, src, rb, (int)nrows, K, grp);
                for (int mi = 0; mi < n_m; mi++) {
                    const int M = ms_list[mi];
                    struct ctx c = {type, K, M, rb, nrows, src, grouped ? grp : NULL, X, Y, panel, NULL, NULL};
                    if (int8) {
                        int gs = kv_q8_group(type);
                        if (!gs) break;
                        struct kv_q8_act qa;
                        void *qb = aligned_alloc(64, (kv_q8_act_bytes(M, K, gs) + 63) / 64 * 64);
                        if (!qb || kv_q8_act_init(&qa, qb, M, K, gs)) {
                            fprintf(stderr, "out of memory\n");
                            return 1;
                        }
                        kv_q8_quantize(&qa, 0, M, X, (size_t)K);
                        c.qa = &qa;
                        double q = measure(&c, 3, runs, ms), pq = 0;
                        if (M > 4 && kv_q8_packed_fast(type)) {
                            c.pk = aligned_alloc(64, (kv_q8_pack_bytes(type, GROUP, K) + 63) / 64 * 64);
                            if (!c.pk) {
                                fprintf(stderr, "out of memory\n");
                                return 1;
                            }
                            pq = measure(&c, 4, runs, ms);
                            free(c.pk);
                        }
                        printf("%-8s %-6s %2d %-7s %10s %10s %8s %10s %12s %12s   int8 %.4f ns/w %.2f GB/s",
                               kv_quant_isa_name(isa), kv_qtype_name(type), M, mode ? "stream" : "hot", "-", "-", "-",
                               "-", "-", "-", q, (double)rb / K / q);
                        if (pq > 0) printf("   pack %.4f ns/w (%.2fx)", pq, pq / q);
                        printf("\n");
                        fflush(stdout);
                        free(qb);
                        continue;
                    }
                    double f = measure(&c, 1, runs, ms), p = measure(&c, 0, runs, ms);
                    double g = grouped ? measure(&c, 2, runs, ms) : 0;
                    printf("%-8s %-6s %2d %-7s %10.4f %10.4f %7.2fx %10.2f", kv_quant_isa_name(isa), kv_qtype_name(type),
                           M, mode ? "stream" : "hot", f, p, p / f, (double)rb / K / f);
                    if (grouped) printf(" %12.4f %12.2f\n", g, (double)rb / K / g);
                    else printf(" %12s %12s\n", "-", "-");
                    fflush(stdout);
                }
            }
        }
    }
    kv_quant_set_isa(KV_QUANT_ISA_AUTO);
    free(src);
    free(grp);
    free(X);
    free(Y);
    free(panel);
    return 0;
}
