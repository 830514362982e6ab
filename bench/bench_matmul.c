/*
 * bench_matmul: GFLOP/s of Y = X W^T for the shapes of the 12x768 benchmark Llama, comparing
 *   inv    the batch-invariant kernel (src/backend/cpu/matmul.c), the CPU backend's default
 *   blas   one cblas_sgemm over all M rows (the backend's non-invariant "openblas" mode)
 *   tile16 the old scheme: cblas_sgemm in fixed 16-row tiles, zero-padded
 * for M = 1, 4, 16, 64, 256 and 1 and 2 threads. Weights are cycled through enough copies to
 * exceed the last-level cache (as in a real forward, where every layer's weights come from
 * DRAM), unless --hot. Each number is the median of 5 timed runs of >= 40 ms each.
 * --type f16|bf16 stores the weights in that precision (the kernel's dequantization panel
 * path; the OpenBLAS methods are skipped then), --shapes NxK,... picks the shapes, --inv-only
 * skips the OpenBLAS methods. --cpu-time times with the process's CPU time instead of the wall
 * clock (for tuning kernels on a shared machine: the figure then ignores time the process spent
 * waiting for a core; meaningful with --threads 1, where no pool thread spins).
 * --peak first measures the kernel family's fused multiply-add peak on one thread (12
 * independent accumulators, no loads: the most the family's f32 arithmetic can do on this core)
 * and adds each inv row's share of it per thread (column "peak%"), so "near the peak" is a
 * measurement, not an estimate (not for BF16 weights in the bf16 mode, whose dpbf16ps does two
 * products a lane). GB/s(W) counts the stored weight bytes (2 a weight for f16/bf16).
 *
 *   bench_matmul [--threads 1,2] [--m 1,4,16,64,256] [--hot] [--runs 5] [--shapes 2048x768,...]
 *                [--type f32|f16|bf16] [--inv-only] [--cpu-time] [--peak]
 */
#include <cblas.h>
#include <math.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "base/base.h"
#include "bench_util.h"
#include "backend/cpu/matmul.h"
#include "quant/qdot.h"
#include "quant/quant.h"

/* Parses a comma-separated list of integers in [lo, hi] into out (at most cap): the count, or
 * -1 (message printed) for an empty list, a value out of range, trailing junk or too many. */
static int parse_list(const char *opt, const char *s, int *out, int cap, long lo, long hi) {
    int n = 0;
    for (;;) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || (*end && *end != ',') || v < lo || v > hi || n == cap) {
            if (cap == 1)
                fprintf(stderr, "bench_matmul: %s: expected an integer in [%ld, %ld]\n", opt, lo, hi);
            else
                fprintf(stderr, "bench_matmul: %s: expected up to %d comma-separated integers in [%ld, %ld]\n", opt,
                        cap, lo, hi);
            return -1;
        }
        out[n++] = (int)v;
        if (!*end) return n;
        s = end + 1;
    }
}

static int cpu_time; /* --cpu-time */
static double now(void) {
    if (!cpu_time) return kv_now_s();
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* GFLOP/s of n_iter turns of 12 independent fmas of the kernel family's width (16 floats for
 * avx512, 8 for avx2, 1 for generic), timed with now(); the sums are printed into sink so the
 * compiler keeps them. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static double peak512(long n_iter, float *sink) {
    __m512 a[12], x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(0.001f * (float)i);
    double t0 = now();
    for (long n = 0; n < n_iter; n++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], x, y);
        __asm__("" : "+v"(x)); /* x opaque: the loop is not folded */
    }
    double dt = now() - t0;
    for (int i = 0; i < 12; i++) *sink += _mm512_reduce_add_ps(a[i]);
    return (double)n_iter * 12 * 32 / dt * 1e-9;
}
__attribute__((target("avx2,fma"))) static double peak256(long n_iter, float *sink) {
    __m256 a[12], x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-4f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(0.001f * (float)i);
    double t0 = now();
    for (long n = 0; n < n_iter; n++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
        __asm__("" : "+x"(x));
    }
    double dt = now() - t0;
    float t[8];
    for (int i = 0; i < 12; i++) {
        _mm256_storeu_ps(t, a[i]);
        *sink += t[0];
    }
    return (double)n_iter * 12 * 16 / dt * 1e-9;
}
#endif
static double peak_generic(long n_iter, float *sink) {
    volatile float x = 0.999f;
    float a[12];
    for (int i = 0; i < 12; i++) a[i] = 0.001f * (float)i;
    double t0 = now();
    for (long n = 0; n < n_iter; n++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = fmaf(a[i], x, 1e-4f);
    double dt = now() - t0;
    for (int i = 0; i < 12; i++) *sink += a[i];
    return (double)n_iter * 12 * 2 / dt * 1e-9;
}
/* The best of 10 runs of ~0.1 s: the family's fma peak on this thread, GFLOP/s. */
static double fma_peak(const char *isa) {
    double best = 0;
    float sink = 0;
    for (int r = 0; r < 10; r++) {
        double g;
#if defined(__x86_64__) && defined(__GNUC__)
        if (!strcmp(isa, "avx512")) g = peak512(10000000, &sink);
        else if (!strcmp(isa, "avx2")) g = peak256(10000000, &sink);
        else
#endif
            g = peak_generic(4000000, &sink);
        if (g > best) best = g;
    }
    if (sink == 12345.0f) printf("#\n"); /* keeps the sums */
    return best;
}

enum method { M_INV, M_BLAS, M_TILE16 };
static const char *method_name[] = {"inv", "blas", "tile16"};

struct ctx {
    float *X, *Xpad, *Y;
    float **W;
    struct kv_wmat *Wm; /* per copy: the weights as the kernel sees them (F32 views or F16/BF16) */
    int n_copies, cur;
    int M, N, K;
    kv_threadpool_t *tp;
};

static void run_once(struct ctx *c, enum method m) {
    const float *W = c->W[c->cur];
    const struct kv_wmat *Wm = &c->Wm[c->cur];
    c->cur = (c->cur + 1) % c->n_copies;
    if (m == M_INV) {
        kv_matmul_w(c->X, c->M, Wm, NULL, c->Y, c->tp);
    } else if (m == M_BLAS) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, c->M, c->N, c->K, 1.0f, c->X, c->K, W, c->K, 0.0f,
                    c->Y, c->N);
    } else {
        int Mp = (c->M + 15) / 16 * 16;
        memcpy(c->Xpad, c->X, (size_t)c->M * c->K * sizeof(float));
        memset(c->Xpad + (size_t)c->M * c->K, 0, (size_t)(Mp - c->M) * c->K * sizeof(float));
        for (int r = 0; r < Mp; r += 16)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 16, c->N, c->K, 1.0f, c->Xpad + (size_t)r * c->K,
                        c->K, W, c->K, 0.0f, c->Y + (size_t)r * c->N, c->N);
    }
}

int main(int argc, char **argv) {
    int threads[4] = {1, 2}, n_threads = 2, Ms[16] = {1, 4, 16, 64, 256}, n_m = 5, runs = 5, hot = 0, inv_only = 0,
        peak = 0;
    int shapes[16][2] = {{2048, 768}, {768, 768}, {768, 2048}, {32000, 768}}, n_shapes = 4; /* N x K */
    int wtype = KV_QTYPE_F32;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if ((n_threads = parse_list("--threads", argv[++i], threads, 4, 1, 256)) < 0) return 2;
        } else if (!strcmp(argv[i], "--m") && i + 1 < argc) {
            if ((n_m = parse_list("--m", argv[++i], Ms, 16, 1, 65536)) < 0) return 2;
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            int r[1];
            if (parse_list("--runs", argv[++i], r, 1, 1, 64) < 0) return 2;
            runs = r[0];
        } else if (!strcmp(argv[i], "--hot")) hot = 1;
        else if (!strcmp(argv[i], "--inv-only")) inv_only = 1;
        else if (!strcmp(argv[i], "--cpu-time")) cpu_time = 1;
        else if (!strcmp(argv[i], "--peak")) peak = 1;
        else if (!strcmp(argv[i], "--type") && i + 1 < argc) {
            const char *t = argv[++i];
            wtype = !strcmp(t, "f32") ? KV_QTYPE_F32 : !strcmp(t, "f16") ? KV_QTYPE_F16 : !strcmp(t, "bf16") ? KV_QTYPE_BF16 : -1;
            if (wtype < 0) {
                fprintf(stderr, "bench_matmul: --type %s: expected f32, f16 or bf16\n", t);
                return 2;
            }
        } else if (!strcmp(argv[i], "--shapes") && i + 1 < argc) {
            n_shapes = 0;
            for (const char *p = argv[++i];;) {
                char *e1, *e2;
                long n = strtol(p, &e1, 10), k = *e1 == 'x' ? strtol(e1 + 1, &e2, 10) : 0;
                if (*e1 != 'x' || e2 == e1 + 1 || (*e2 && *e2 != ',') || n < 1 || k < 1 || n > 1 << 20 || k > 1 << 20 ||
                    n_shapes == 16) {
                    fprintf(stderr, "bench_matmul: --shapes: expected up to 16 NxK,... (e.g. 2048x768)\n");
                    return 2;
                }
                shapes[n_shapes][0] = (int)n, shapes[n_shapes][1] = (int)k, n_shapes++;
                if (!*e2) break;
                p = e2 + 1;
            }
        }
        else {
            fprintf(stderr, "usage: bench_matmul [--threads 1,2] [--m 1,4,16,64,256] [--hot] [--runs 5] "
                            "[--shapes NxK,...] [--type f32|f16|bf16] [--inv-only] [--cpu-time] [--peak]\n");
            return 2;
        }
    }
    if (wtype != KV_QTYPE_F32) inv_only = 1; /* OpenBLAS takes f32 only */
    int maxM = 0;
    for (int i = 0; i < n_m; i++) maxM = Ms[i] > maxM ? Ms[i] : maxM;
    const char *ct = getenv("OPENBLAS_CORETYPE");
    printf("# openblas core %s (OPENBLAS_CORETYPE=%s), kernel isa %s, weights %s %s, median of %d runs, %s\n",
           openblas_get_corename(), ct ? ct : "unset", kv_matmul_isa_name(), kv_qtype_name(wtype),
           hot ? "hot (one copy)" : "cold (copies > 64 MiB cycled)", runs, cpu_time ? "process CPU time" : "wall clock");
    double pk = 0;
    if (peak && wtype == KV_QTYPE_BF16 && kv_matmul_get_bf16() == KV_MATMUL_BF16_BF16) {
        /* dpbf16ps does two products a lane: the f32 fma peak is not this kernel's ceiling */
        printf("# no peak%%: BF16 weights run the bf16 kernels (KVSERVE_CPU_BF16_MATMUL=f32 for the f32 ones)\n");
        peak = 0;
    } else if (peak) {
        pk = fma_peak(kv_matmul_isa_name());
        printf("# fma peak of the %s family, one thread: %.1f GFLOP/s (%s; the best of 10 runs: a busy sibling "
               "hyperthread or a throttled core lowers it, so compare peak%% within one run)\n",
               kv_matmul_isa_name(), pk, cpu_time ? "process CPU time" : "wall clock");
    }
    printf("%-7s %5s %5s %4s %3s | %9s %9s %9s | %6s %6s%s\n", "method", "N", "K", "M", "thr", "GFLOP/s", "ms/call",
           "GB/s(W)", "vsblas", "vstile", peak ? " | peak%" : "");
    srand(1);
    for (int s = 0; s < n_shapes; s++) {
        int N = shapes[s][0], K = shapes[s][1];
        size_t wbytes = (size_t)N * K * sizeof(float);
        int n_copies = hot ? 1 : (int)((64u << 20) / wbytes + 1);
        struct ctx c = {.N = N, .K = K, .n_copies = n_copies};
        c.W = calloc((size_t)n_copies, sizeof *c.W);
        c.Wm = calloc((size_t)n_copies, sizeof *c.Wm);
        int Mp = (maxM + 15) / 16 * 16;
        c.X = malloc((size_t)maxM * K * sizeof(float));
        c.Xpad = malloc((size_t)Mp * K * sizeof(float));
        c.Y = malloc((size_t)Mp * N * sizeof(float));
        if (!c.W || !c.X || !c.Xpad || !c.Y) return 1;
        for (int i = 0; i < n_copies; i++) {
            /* on transparent huge pages, as the backend's weight panels (backend_cpu.c): on 4 KiB
             * pages a cold decode step pays nested page walks the server does not */
            size_t huge = (size_t)2 << 20, alloc = (wbytes + huge - 1) / huge * huge;
            c.W[i] = aligned_alloc(huge, alloc);
            if (!c.W[i]) return 1;
#ifdef MADV_HUGEPAGE
            (void)madvise(c.W[i], alloc, MADV_HUGEPAGE); /* advisory */
#endif
            for (size_t k = 0; k < (size_t)N * K; k++) c.W[i][k] = (float)rand() / RAND_MAX - 0.5f;
            c.Wm[i] = kv_wmat_from_f32(c.W[i], N, K);
            if (wtype != KV_QTYPE_F32) { /* 16-bit copy in place: the first half of the f32 buffer */
                uint16_t *h = (uint16_t *)c.W[i];
                for (size_t k = 0; k < (size_t)N * K; k++) {
                    float f = c.W[i][k];
                    uint32_t u;
                    memcpy(&u, &f, 4);
                    h[k] = wtype == KV_QTYPE_F16 ? kv_f32_to_f16(f) : (uint16_t)(u >> 16);
                }
                size_t rb = kv_qtype_row_bytes(wtype, K);
                c.Wm[i] = (struct kv_wmat){c.W[i], wtype, N, K, rb, NULL};
                /* the CPU backend's layout: 16-bit rows grouped at load (qdot.h), in the f32
                 * buffer's second half */
                if (kv_fgroup_ok(wtype, K)) {
                    char *g = (char *)c.W[i] + (size_t)N * rb;
                    kv_fgroup_pack(wtype, c.W[i], rb, N, K, g);
                    c.Wm[i].panel = g;
                }
            }
        }
        for (size_t k = 0; k < (size_t)maxM * K; k++) c.X[k] = (float)rand() / RAND_MAX - 0.5f;
        for (int ti = 0; ti < n_threads; ti++) {
            openblas_set_num_threads(threads[ti]);
            c.tp = kv_threadpool_new(threads[ti]);
            for (int mi = 0; mi < n_m; mi++) {
                c.M = Ms[mi];
                double gf[3];
                for (int meth = 0; meth < (inv_only ? 1 : 3); meth++) {
                    double t[64];
                    run_once(&c, meth); /* warm up */
                    double t0 = now();
                    int reps = 1;
                    run_once(&c, meth);
                    double one = now() - t0;
                    reps = one > 0.04 ? 1 : (int)(0.04 / (one > 1e-7 ? one : 1e-7)) + 1;
                    for (int r = 0; r < runs; r++) {
                        t0 = now();
                        for (int k = 0; k < reps; k++) run_once(&c, meth);
                        t[r] = (now() - t0) / reps;
                    }
                    qsort(t, (size_t)runs, sizeof t[0], bench_cmp_d);
                    double med = t[runs / 2];
                    gf[meth] = 2.0 * c.M * N * K / med * 1e-9;
                    printf("%-7s %5d %5d %4d %3d | %9.2f %9.4f %9.2f |", method_name[meth], N, K, c.M, threads[ti],
                           gf[meth], med * 1e3, (double)N * kv_qtype_row_bytes(wtype, K) / med * 1e-9);
                    if (meth == M_INV && peak)
                        printf(" %6s %6s | %5.1f\n", "", "", 100.0 * gf[meth] / threads[ti] / pk);
                    else if (meth == M_INV) printf("\n");
                    else if (meth == M_BLAS) printf(" %6.2f\n", gf[M_INV] / gf[M_BLAS]);
                    else printf(" %6.2f %6.2f\n", gf[M_INV] / gf[M_BLAS], gf[M_INV] / gf[M_TILE16]);
                }
                fflush(stdout);
            }
            kv_threadpool_free(c.tp);
        }
        for (int i = 0; i < n_copies; i++) free(c.W[i]);
        free(c.W), free(c.Wm), free(c.X), free(c.Xpad), free(c.Y);
    }
    return 0;
}
