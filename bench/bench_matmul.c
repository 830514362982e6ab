/*
 * bench_matmul: GFLOP/s of Y = X W^T for the shapes of the 12x768 benchmark Llama, comparing
 *   inv    the batch-invariant kernel (src/backend/cpu/matmul.c), the CPU backend's default
 *   blas   one cblas_sgemm over all M rows (the backend's non-invariant "openblas" mode)
 *   tile16 the old scheme: cblas_sgemm in fixed 16-row tiles, zero-padded
 * for M = 1, 4, 16, 64, 256 and 1 and 2 threads. Weights are cycled through enough copies to
 * exceed the last-level cache (as in a real forward, where every layer's weights come from
 * DRAM), unless --hot. Each number is the median of 5 timed runs of >= 40 ms each.
 *
 *   bench_matmul [--threads 1,2] [--m 1,4,16,64,256] [--hot] [--runs 5]
 */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/base.h"
#include "bench_util.h"
#include "backend/cpu/matmul.h"

static int parse_list(const char *s, int *out, int cap) {
    int n = 0;
    while (*s && n < cap) {
        out[n++] = atoi(s);
        const char *c = strchr(s, ',');
        if (!c) break;
        s = c + 1;
    }
    return n;
}

enum method { M_INV, M_BLAS, M_TILE16 };
static const char *method_name[] = {"inv", "blas", "tile16"};

struct ctx {
    float *X, *Xpad, *Y;
    float **W;
    int n_copies, cur;
    int M, N, K;
    kv_threadpool_t *tp;
};

static void run_once(struct ctx *c, enum method m) {
    const float *W = c->W[c->cur];
    c->cur = (c->cur + 1) % c->n_copies;
    if (m == M_INV) {
        kv_matmul(c->X, c->M, c->K, W, c->N, NULL, c->Y, c->tp);
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
    int threads[4] = {1, 2}, n_threads = 2, Ms[16] = {1, 4, 16, 64, 256}, n_m = 5, runs = 5, hot = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) n_threads = parse_list(argv[++i], threads, 4);
        else if (!strcmp(argv[i], "--m") && i + 1 < argc) n_m = parse_list(argv[++i], Ms, 16);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hot")) hot = 1;
        else {
            fprintf(stderr, "usage: bench_matmul [--threads 1,2] [--m 1,4,16,64,256] [--hot] [--runs 5]\n");
            return 2;
        }
    }
    if (runs < 1 || runs > 64) runs = 5;
    const int shapes[][2] = {{2048, 768}, {768, 768}, {768, 2048}, {32000, 768}}; /* N x K */
    int maxM = 0;
    for (int i = 0; i < n_m; i++) maxM = Ms[i] > maxM ? Ms[i] : maxM;
    if (maxM < 1) return 2;
    printf("# openblas core %s, kernel isa %s, weights %s, median of %d runs\n", openblas_get_corename(),
           kv_matmul_isa_name(), hot ? "hot (one copy)" : "cold (copies > 64 MiB cycled)", runs);
    printf("%-7s %5s %5s %4s %3s | %9s %9s %9s | %6s %6s\n", "method", "N", "K", "M", "thr", "GFLOP/s", "ms/call",
           "GB/s(W)", "vsblas", "vstile");
    srand(1);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int N = shapes[s][0], K = shapes[s][1];
        size_t wbytes = (size_t)N * K * sizeof(float);
        int n_copies = hot ? 1 : (int)((64u << 20) / wbytes + 1);
        struct ctx c = {.N = N, .K = K, .n_copies = n_copies};
        c.W = calloc((size_t)n_copies, sizeof *c.W);
        int Mp = (maxM + 15) / 16 * 16;
        c.X = malloc((size_t)maxM * K * sizeof(float));
        c.Xpad = malloc((size_t)Mp * K * sizeof(float));
        c.Y = malloc((size_t)Mp * N * sizeof(float));
        if (!c.W || !c.X || !c.Xpad || !c.Y) return 1;
        for (int i = 0; i < n_copies; i++) {
            c.W[i] = malloc(wbytes);
            if (!c.W[i]) return 1;
            for (size_t k = 0; k < (size_t)N * K; k++) c.W[i][k] = (float)rand() / RAND_MAX - 0.5f;
        }
        for (size_t k = 0; k < (size_t)maxM * K; k++) c.X[k] = (float)rand() / RAND_MAX - 0.5f;
        for (int ti = 0; ti < n_threads; ti++) {
            openblas_set_num_threads(threads[ti]);
            c.tp = kv_threadpool_new(threads[ti]);
            for (int mi = 0; mi < n_m; mi++) {
                c.M = Ms[mi];
                double gf[3];
                for (int meth = 0; meth < 3; meth++) {
                    double t[64];
                    run_once(&c, meth); /* warm up */
                    double t0 = kv_now_s();
                    int reps = 1;
                    run_once(&c, meth);
                    double one = kv_now_s() - t0;
                    reps = one > 0.04 ? 1 : (int)(0.04 / (one > 1e-7 ? one : 1e-7)) + 1;
                    for (int r = 0; r < runs; r++) {
                        t0 = kv_now_s();
                        for (int k = 0; k < reps; k++) run_once(&c, meth);
                        t[r] = (kv_now_s() - t0) / reps;
                    }
                    qsort(t, (size_t)runs, sizeof t[0], bench_cmp_d);
                    double med = t[runs / 2];
                    gf[meth] = 2.0 * c.M * N * K / med * 1e-9;
                    printf("%-7s %5d %5d %4d %3d | %9.2f %9.4f %9.2f |", method_name[meth], N, K, c.M, threads[ti],
                           gf[meth], med * 1e3, wbytes / med * 1e-9);
                    if (meth == M_INV) printf("\n");
                    else if (meth == M_BLAS) printf(" %6.2f\n", gf[M_INV] / gf[M_BLAS]);
                    else printf(" %6.2f %6.2f\n", gf[M_INV] / gf[M_BLAS], gf[M_INV] / gf[M_TILE16]);
                }
                fflush(stdout);
            }
            kv_threadpool_free(c.tp);
        }
        for (int i = 0; i < n_copies; i++) free(c.W[i]);
        free(c.W), free(c.X), free(c.Xpad), free(c.Y);
    }
    return 0;
}
