/*
 * bench_cuda: the CUDA backend on a random-weight Llama-3-8B shape (generated on the device,
 * nothing shipped), and the page-copy kernel against cudaMemcpyAsync. GPU only.
 *
 *   bench_cuda [--layers 32] [--batches 1,8,32] [--ctxs 512,4096] [--steps 20] [--kv-dtype bf16|f32]
 *              [--no-copy] [--no-decode] [--deterministic] [--prefill 512,4096]
 *              [--sample greedy|topp [--host-sample]]
 *   bench_cuda --torch-dump DIR     (random small models + their CPU / CUDA logits for
 *              tests/gpu/torch_ref.py, the PyTorch reference of issue 10; see torch_dump)
 *
 * Prints: measured device-to-device copy bandwidth (bytes read + written), then per (batch,
 * context) the median decode-step time (one forward of `batch` sequences, one new token
 * each, logits of every sequence copied back), the HBM floor (bf16 weight bytes + KV bytes
 * read, of --kv-dtype: default bf16 like serve --backend cuda) / copy bandwidth, and
 * tokens/s; with --prefill N,... the median time of one forward of one sequence of N new
 * tokens (n_past 0, logits of the last one) as prefill tokens/s; then page-copy GB/s per
 * direction: kv_cuda_copy_pages (its path: the kernel, or the copy engines for host pages of
 * >= kv_cuda_copy_engine_min() bytes) against one cudaMemcpyAsync per page, and one
 * cudaMemcpyBatchAsync of all pages (CUDA 12.8+; 0 when built with an older toolkit).
 * --deterministic runs the backend in its batch-invariant mode (backend_cuda_options.
 * deterministic) for the same measurements.
 */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/base.h"
#include "bench_util.h"
#include "backend/backend.h"
#include "backend/cuda/backend_cuda.h"
#include "engine/sampler.h"


static bool g_det;                 /* --deterministic */
/* --sample greedy|topp: decode steps sample every row: on the device (forward_sample), or with
 * --host-sample on the host (forward, then sampler_sample per row); topp = temperature 0.8,
 * top_p 0.95 (sorted candidates) */
static int g_sample;      /* 0 none, 1 greedy, 2 topp */
static bool g_host_sample;
static int g_prefill[8], g_nprefill; /* --prefill N,... */
static int g_tpb = 16;                 /* --tpb N: tokens per KV block of the decode table */

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

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "bench_cuda: %s: %s\n", #x, cudaGetErrorString(e_));                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Median seconds of 10 runs of op(arg) on the default stream, event-timed, after 3 warm-ups. */
static double time_median10(void (*op)(void *), void *arg) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    double ts[10];
    for (int i = 0; i < 13; i++) {
        cudaEventRecord(e0, 0);
        op(arg);
        cudaEventRecord(e1, 0);
        CK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 3) ts[i - 3] = ms / 1e3;
    }
    qsort(ts, 10, sizeof ts[0], bench_cmp_d);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return ts[5];
}

struct copy_op { void *dst; const void *src; size_t n; };
static void do_copy_op(void *arg) {
    struct copy_op *o = arg;
    CK(cudaMemcpyAsync(o->dst, o->src, o->n, cudaMemcpyDeviceToDevice, 0));
}

/* Device-to-device copy bandwidth (read + write bytes / s) over a 2 GiB buffer. */
static double copy_bw(void) {
    size_t n = (size_t)2 << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 1, n));
    struct copy_op o = {b, a, n};
    double t = time_median10(do_copy_op, &o);
    cudaFree(a), cudaFree(b);
    return 2.0 * (double)n / t;
}

struct gemm_op { cublasHandle_t h; int n; void *a, *b, *c; };
static void do_gemm_op(void *arg) {
    struct gemm_op *o = arg;
    float one = 1.f, zero = 0.f;
    if (cublasGemmEx(o->h, CUBLAS_OP_N, CUBLAS_OP_N, o->n, o->n, o->n, &one, o->a, CUDA_R_16BF, o->n, o->b, CUDA_R_16BF,
                     o->n, &zero, o->c, CUDA_R_16BF, o->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
        CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_cuda: cublasGemmEx failed\n");
        exit(1);
    }
}

/* bf16 matrix rate (FLOP/s) of cuBLAS on this device: C = A B, 8192^3, bf16 in and out, f32
 * accumulation, random inputs (never zeros), median of 10 after 3 warm-ups (event-timed).
 * The ceiling the prefill's "% of bf16 peak" is taken against. */
static double gemm_peak(void) {
    int n = 8192;
    size_t el = (size_t)n * n;
    uint16_t *h = malloc(el * 2);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < el; i++) { /* uniform in [-1, 1), bf16 by truncation */
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        float v = (float)(x >> 40) / 8388608.0f - 1.0f;
        uint32_t u;
        memcpy(&u, &v, 4);
        h[i] = (uint16_t)(u >> 16);
    }
    void *a, *b, *c;
    CK(cudaMalloc(&a, el * 2));
    CK(cudaMalloc(&b, el * 2));
    CK(cudaMalloc(&c, el * 2));
    CK(cudaMemcpy(a, h, el * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, h, el * 2, cudaMemcpyHostToDevice));
    free(h);
    cublasHandle_t hb;
    if (cublasCreate(&hb) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_cuda: cublasCreate failed\n");
        exit(1);
    }
    struct gemm_op o = {hb, n, a, b, c};
    double t = time_median10(do_gemm_op, &o);
    cublasDestroy(hb);
    cudaFree(a), cudaFree(b), cudaFree(c);
    return 2.0 * n * (double)n * n / t;
}

static void bench_decode(int layers, const int *batches, int nb, const int *ctxs, int nc, int steps, double bw,
                         int kv_dtype) {
    struct model_config cfg = {0};
    cfg.arch = MODEL_ARCH_LLAMA;
    cfg.n_vocab = 128256, cfg.dim = 4096, cfg.n_layers = layers, cfg.n_heads = 32, cfg.n_kv_heads = 8;
    cfg.head_dim = 128, cfg.ffn_dim = 14336, cfg.rms_eps = 1e-5f, cfg.rope_theta = 500000.f, cfg.rope_neox = true;
    cfg.rope_scaling = (struct rope_scaling){.type = 1, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                                             .original_max_pos = 8192};
    cfg.max_ctx = 8192, cfg.bos_id = 1, cfg.eos_id = 2;
    model_t m;
    memset(&m, 0, sizeof m);
    m.cfg = cfg; /* no host weights: generated on the device */
    struct backend_cuda_options o = {.device = 0, .random_weights_seed = 1234, .deterministic = g_det};
    backend_t *be = NULL;
    char err[512];
    double t0 = kv_now_s();
    if (backend_cuda_new(&m, &o, &be, err, sizeof err)) {
        fprintf(stderr, "bench_cuda: %s\n", err);
        exit(1);
    }
    double dim = 4096, qw = 4096, kw = 1024, ffn = 14336, V = 128256;
    double wbytes = 2.0 * (layers * (dim * (qw + 2 * kw) + qw * dim + 2 * ffn * dim + ffn * dim) + 2 * V * dim);
    fprintf(stderr, "model: %d layers, weights %.2f GB bf16 (made in %.1f s)\n", layers, wbytes / 1e9, kv_now_s() - t0);
    printf("\nKV cache: %s; batch-1 decode megakernel: %s; mode: %s; sampling: %s\n", kv_dtype_name(kv_dtype),
           kv_cuda_megakernel(be) ? "on (one-row steps, bf16 KV)" : "off",
           g_det ? "deterministic (batch-invariant GEMM + attention split)" : "default (cuBLAS)",
           !g_sample ? "none (logits rows downloaded)"
                     : g_host_sample ? (g_sample == 1 ? "host, greedy" : "host, temperature 0.8 top_p 0.95")
                                     : (g_sample == 1 ? "device, greedy" : "device, temperature 0.8 top_p 0.95"));
    printf("\n| batch | context | step ms (median) | HBM floor ms | step / floor | tokens/s |\n|---|---|---|---|---|---|\n");
    int tpb = g_tpb;
    for (int ci = 0; ci < nc; ci++)
        for (int bi = 0; bi < nb; bi++) {
            int B = batches[bi], ctx = ctxs[ci];
            int per = (ctx + steps + 8 + tpb - 1) / tpb;
            struct kv_geometry g = {.n_layers = layers, .n_kv_heads = 8, .head_dim = 128, .tokens_per_block = tpb,
                                    .kv_dtype = kv_dtype};
            size_t blk = kv_block_bytes(&g);
            if ((double)per * B * blk > 90e9) {
                printf("| %d | %d | skipped (%s KV %.0f GB) | | | |\n", B, ctx, kv_dtype_name(kv_dtype),
                       (double)per * B * blk / 1e9);
                continue;
            }
            if (be->ops->kv_alloc(be, per * B, &g)) {
                printf("| %d | %d | kv_alloc failed | | | |\n", B, ctx);
                continue;
            }
            /* random KV content (no zeros): one pinned random block copied everywhere */
            void *hb = kv_cuda_host_alloc(blk);
            size_t es = kv_dtype_size(kv_dtype);
            for (size_t i = 0; i < blk / es; i++) {
                float v = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
                uint32_t u;
                memcpy(&u, &v, 4);
                if (es == 4) ((float *)hb)[i] = v;
                else ((uint16_t *)hb)[i] = (uint16_t)(u >> 16); /* bf16 by truncation */
            }
            int32_t *ids = malloc(sizeof(int32_t) * 256);
            const void *hs[256];
            for (int i = 0; i < 256; i++) hs[i] = hb;
            for (int b0 = 0; b0 < per * B; b0 += 256) {
                int k = per * B - b0 < 256 ? per * B - b0 : 256;
                for (int i = 0; i < k; i++) ids[i] = b0 + i;
                if (backend_copy_from_host(be, hs, ids, k)) {
                    fprintf(stderr, "bench_cuda: KV fill failed\n");
                    exit(1);
                }
            }
            free(ids);
            kv_cuda_host_free(hb);
            int32_t *bt = malloc(sizeof(int32_t) * (size_t)per * B), *tok = malloc(sizeof(int32_t) * B);
            for (int i = 0; i < per * B; i++) bt[i] = i;
            struct batch_seq *seqs = calloc((size_t)B, sizeof *seqs);
            float *lg = malloc((size_t)B * cfg.n_vocab * sizeof(float));
            double *ts = malloc(sizeof(double) * (size_t)steps);
            struct backend_sampling *bs = calloc((size_t)B, sizeof *bs);
            struct backend_sample_out *bo = calloc((size_t)B, sizeof *bo);
            struct sampler_scratch scr;
            kv_rng srng;
            kv_rng_seed(&srng, 5);
            if (sampler_scratch_init(&scr, cfg.n_vocab)) exit(1);
            for (int s = -3; s < steps; s++) {
                int step = s < 0 ? 0 : s;
                for (int i = 0; i < B; i++) {
                    tok[i] = (int32_t)((i * 7919 + step * 31) % cfg.n_vocab);
                    seqs[i] = (struct batch_seq){.tokens = &tok[i], .n_tokens = 1, .n_past = ctx + step,
                                                 .block_table = bt + (size_t)i * per, .n_blocks = per,
                                                 .logits = BATCH_LOGITS_LAST};
                }
                struct batch b = {seqs, B};
                double a = kv_now_s();
                kv_status fst;
                if (g_sample && !g_host_sample) {
                    for (int i = 0; i < B; i++)
                        bs[i] = (struct backend_sampling){.temperature = g_sample == 2 ? 0.8f : 0.f,
                                                          .top_p = g_sample == 2 ? 0.95f : 1.f,
                                                          .repetition_penalty = 1.f,
                                                          .u = (double)((i * 7 + step) % 97) / 97.0};
                    fst = be->ops->forward_sample(be, &b, bs, bo, err, sizeof err);
                } else {
                    fst = be->ops->forward(be, &b, lg, err, sizeof err);
                    for (int i = 0; g_sample && !fst && i < B; i++) {
                        struct sampling_params sp;
                        sampling_params_default(&sp);
                        sp.temperature = g_sample == 2 ? 0.8f : 0.f, sp.top_p = g_sample == 2 ? 0.95f : 1.f;
                        (void)sampler_sample(&sp, lg + (size_t)i * cfg.n_vocab, cfg.n_vocab, NULL, 0, NULL, 0, &srng,
                                             &scr, NULL, NULL, 0);
                    }
                }
                if (fst) {
                    fprintf(stderr, "bench_cuda: forward: %s\n", err);
                    exit(1);
                }
                if (s >= 0) ts[s] = kv_now_s() - a;
            }
            qsort(ts, (size_t)steps, sizeof ts[0], bench_cmp_d);
            double med = ts[steps / 2];
            double kvb = (double)B * (ctx + steps / 2) * layers * 2 * kw * (double)es; /* K+V read */
            double floor_s = (wbytes + kvb) / bw;
            printf("| %d | %d | %.3f | %.3f | %.2fx | %.0f |\n", B, ctx, med * 1e3, floor_s * 1e3, med / floor_s,
                   B / med);
            fflush(stdout);
            free(bt), free(tok), free(seqs), free(lg), free(ts), free(bs), free(bo);
            sampler_scratch_free(&scr);
        }
    double peak = 0;
    if (g_nprefill) {
        peak = gemm_peak();
        printf("\nbf16 matrix rate (cuBLAS 8192^3, bf16 in/out, f32 accumulation, random data): %.0f TFLOP/s\n"
               "FLOPs counted: 2 x tokens x projection weights (q/k/v, o, gate/up, down of every layer) + causal "
               "attention 2 x tokens^2 x head_dim x heads per layer (QK^T and PV, half the square each); the "
               "output head runs on one row\n",
               peak / 1e12);
        printf("\n| prefill tokens (one chunk) | ms (median of 5) | tokens/s | TFLOP/s | %% of bf16 rate |\n"
               "|---|---|---|---|---|\n");
    }
    for (int pi = 0; pi < g_nprefill; pi++) {
        int N = g_prefill[pi], per = (N + tpb - 1) / tpb;
        struct kv_geometry g = {.n_layers = layers, .n_kv_heads = 8, .head_dim = 128, .tokens_per_block = tpb,
                                .kv_dtype = kv_dtype};
        if (N < 1 || be->ops->kv_alloc(be, per, &g)) {
            printf("| %d | kv_alloc failed | |\n", N);
            continue;
        }
        int32_t *bt = malloc(sizeof(int32_t) * (size_t)per), *tok = malloc(sizeof(int32_t) * (size_t)N);
        for (int i = 0; i < per; i++) bt[i] = i;
        for (int i = 0; i < N; i++) tok[i] = (int32_t)((i * 7919) % cfg.n_vocab);
        float *lg = malloc((size_t)cfg.n_vocab * sizeof(float));
        double ts[5];
        for (int s = -1; s < 5; s++) {
            struct batch_seq sq = {.tokens = tok, .n_tokens = N, .n_past = 0, .block_table = bt, .n_blocks = per,
                                   .logits = BATCH_LOGITS_LAST};
            struct batch b = {&sq, 1};
            double a = kv_now_s();
            if (be->ops->forward(be, &b, lg, err, sizeof err)) {
                fprintf(stderr, "bench_cuda: prefill forward: %s\n", err);
                exit(1);
            }
            if (s >= 0) ts[s] = kv_now_s() - a;
        }
        qsort(ts, 5, sizeof ts[0], bench_cmp_d);
        double fl = 2.0 * N * layers * (dim * (qw + 2 * kw) + qw * dim + 3 * ffn * dim) +
                    2.0 * (double)N * N * 128 * 32 * layers;
        printf("| %d | %.2f | %.0f | %.0f | %.1f%% |\n", N, ts[2] * 1e3, N / ts[2], fl / ts[2] / 1e12,
               100.0 * fl / ts[2] / peak);
        fflush(stdout);
        free(bt), free(tok), free(lg);
    }
    backend_free(be);
}

static void bench_copy(void) {
    size_t sizes[] = {64 << 10, 2 << 20, 8 << 20, 128 << 20, (size_t)512 << 20};
    size_t ce = kv_cuda_copy_engine_min();
    printf("\n| page | pages | dir | path | ours GB/s | ours, kv_cuda_copy_pages GB/s | cudaMemcpyAsync GB/s | ratio | "
           "cudaMemcpyBatchAsync GB/s |\n|---|---|---|---|---|---|---|---|---|\n");
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t bytes = sizes[si];
        int n = bytes <= (2 << 20) ? 256 : bytes <= (8 << 20) ? 16 : bytes <= (128 << 20) ? 2 : 1;
        void **h = calloc((size_t)n, sizeof(void *)), **d = calloc((size_t)n, sizeof(void *));
        for (int i = 0; i < n; i++) {
            h[i] = kv_cuda_host_alloc(bytes), d[i] = kv_cuda_malloc(bytes);
            if (!h[i] || !d[i]) exit(1);
            memset(h[i], i + 1, bytes);
        }
        cudaStream_t st;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        for (int dir = 0; dir < 2; dir++) {
            char err[256];
            double ours[7], sync[7], theirs[7], batch[7];
            size_t *szs = malloc((size_t)n * sizeof(size_t));
            for (int i = 0; i < n; i++) szs[i] = bytes;
            for (int r = 0; r < 8; r++) {
                /* ours on the same kind of stream cudaMemcpyAsync gets (what the backend does:
                 * its copies go on its own stream), then the self-contained call (makes and
                 * synchronises a stream of its own), then one cudaMemcpyAsync per page */
                double a = kv_now_s();
                kv_status s = kv_cuda_copy_pages_on(dir == 0 ? KV_CUDA_H2D : KV_CUDA_D2H, dir == 0 ? d : h,
                                                    (const void *const *)(dir == 0 ? h : d), n, bytes, st, err,
                                                    sizeof err);
                if (!s) CK(cudaStreamSynchronize(st));
                double t0 = kv_now_s() - a;
                a = kv_now_s();
                if (!s)
                    s = dir == 0 ? kv_cuda_copy_pages(KV_CUDA_H2D, d, (const void *const *)h, n, bytes, err, sizeof err)
                                 : kv_cuda_copy_pages(KV_CUDA_D2H, h, (const void *const *)d, n, bytes, err, sizeof err);
                if (s) {
                    fprintf(stderr, "bench_cuda: %s\n", err);
                    exit(1);
                }
                double t1 = kv_now_s() - a;
                a = kv_now_s();
                for (int i = 0; i < n; i++)
                    CK(cudaMemcpyAsync(dir == 0 ? d[i] : h[i], dir == 0 ? h[i] : d[i], bytes,
                                       dir == 0 ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, st));
                CK(cudaStreamSynchronize(st));
                double t2 = kv_now_s() - a;
                /* the same pages in one batched call (CUDA 12.8+; the copy engines) */
                double t3 = 0;
#if CUDART_VERSION >= 12080
                struct cudaMemcpyAttributes at;
                memset(&at, 0, sizeof at);
                at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
                size_t ai = 0;
                a = kv_now_s();
                CK(cudaMemcpyBatchAsync(dir == 0 ? d : h, (const void *const *)(dir == 0 ? h : d), szs, (size_t)n, &at,
                                        &ai, 1, st));
                CK(cudaStreamSynchronize(st));
                t3 = kv_now_s() - a;
#endif
                if (r) ours[r - 1] = t0, sync[r - 1] = t1, theirs[r - 1] = t2, batch[r - 1] = t3;
            }
            free(szs);
            qsort(batch, 7, sizeof(double), bench_cmp_d);
            qsort(ours, 7, sizeof(double), bench_cmp_d);
            qsort(sync, 7, sizeof(double), bench_cmp_d);
            qsort(theirs, 7, sizeof(double), bench_cmp_d);
            double tot = (double)bytes * n;
            printf("| %zu KiB | %d | %s | %s | %.1f | %.1f | %.1f | %.2fx | %.1f |\n", bytes >> 10, n, dir ? "D2H" : "H2D",
                   ce && bytes >= ce ? "copy engine" : "kernel", tot / ours[3] / 1e9, tot / sync[3] / 1e9,
                   tot / theirs[3] / 1e9, theirs[3] / ours[3], batch[3] > 0 ? tot / batch[3] / 1e9 : 0.0);
            fflush(stdout);
        }
        cudaStreamDestroy(st);
        for (int i = 0; i < n; i++) kv_cuda_host_free(h[i]), kv_cuda_free(d[i]);
        free(h), free(d);
    }
}

/* ---- --torch-dump DIR: random small models and their logits for tests/gpu/torch_ref.py ----
 * For each of llama (Llama-3 shape: GQA 8/2, head_dim 64, Llama-3 RoPE scaling with an
 * original length of 64 so it matters, untied), qwen2 (q/k/v bias, tied) and qwen3 (q/k norm,
 * head_dim 80 so heads * head_dim != dim, tied), all HF rotate-half RoPE: writes DIR/<arch>/
 * config.json, weights.bin (every tensor f32, little-endian, in the order torch_ref.py reads:
 * tok_embd, out_norm, [output], then per layer attn_norm wq wk wv [bq bk bv] [q_norm k_norm] wo
 * ffn_norm w_gate w_up w_down; matrices (out, in) row-major), tokens.bin (int32, N_TOK) and
 * logits_<variant>.bin (float32, N_TOK x n_vocab: every position's logits) for the variants
 * cpu, cuda_f32w, cuda_bf16w, cuda_bf16w_bf16kv, cuda_bf16w_split (bf16 weights, f32 KV,
 * KVSERVE_CUDA_FLASH=0: the chunks on the split attention kernels instead of k_attn_flash). One
 * sequence, fed as a prefill chunk of 100
 * (eager: more rows than a graph takes), one of 40 (graph), then 20 single-token decodes
 * (graphs), in a scattered block table. Returns 0, or 1 with a message. */
#define DUMP_TOK 160
static int dump_write(const char *dir, const char *name, const void *p, size_t bytes) {
    char path[4200];
    int n = snprintf(path, sizeof path, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof path) {
        fprintf(stderr, "bench_cuda: path too long: %s/%s\n", dir, name);
        return 1;
    }
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != bytes || fclose(f)) {
        fprintf(stderr, "bench_cuda: cannot write %s\n", path);
        return 1;
    }
    return 0;
}
static int dump_logits(backend_t *be, const model_t *m, const int32_t *toks, int kv_dtype, float *out) {
    int V = m->cfg.n_vocab, tpb = 16, per = (DUMP_TOK + tpb - 1) / tpb, nb = 2 * per + 1;
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads,
                            .head_dim = m->cfg.head_dim, .tokens_per_block = tpb, .kv_dtype = kv_dtype};
    if (be->ops->kv_alloc(be, nb, &g)) return 1;
    int32_t bt[64];
    for (int i = 0; i < per; i++) bt[i] = nb - 1 - 2 * i;
    char err[512];
    for (int done = 0; done < DUMP_TOK;) {
        int c = done == 0 ? 100 : done == 100 ? 40 : 1;
        struct batch_seq s = {.tokens = toks + done, .n_tokens = c, .n_past = done, .block_table = bt,
                              .n_blocks = per, .logits = BATCH_LOGITS_ALL};
        struct batch b = {&s, 1};
        if (be->ops->forward(be, &b, out + (size_t)done * V, err, sizeof err)) {
            fprintf(stderr, "bench_cuda: forward: %s\n", err);
            return 1;
        }
        done += c;
    }
    return 0;
}
static int torch_dump(const char *root) {
    const model_arch archs[] = {MODEL_ARCH_LLAMA, MODEL_ARCH_QWEN2, MODEL_ARCH_QWEN3};
    mkdir(root, 0755);
    for (size_t ai = 0; ai < sizeof archs / sizeof archs[0]; ai++) {
        model_arch arch = archs[ai];
        struct model_config cfg = {0};
        cfg.arch = arch, cfg.n_vocab = 2048, cfg.dim = 512, cfg.n_layers = 4, cfg.n_heads = 8, cfg.n_kv_heads = 2;
        cfg.head_dim = arch == MODEL_ARCH_QWEN3 ? 80 : 64;
        cfg.ffn_dim = 1408, cfg.rms_eps = arch == MODEL_ARCH_LLAMA ? 1e-5f : 1e-6f;
        cfg.rope_theta = arch == MODEL_ARCH_LLAMA ? 500000.0f : 1000000.0f;
        cfg.rope_neox = true;
        if (arch == MODEL_ARCH_LLAMA)
            cfg.rope_scaling = (struct rope_scaling){.type = 1, .factor = 8, .low_freq_factor = 1,
                                                     .high_freq_factor = 4, .original_max_pos = 64};
        cfg.max_ctx = 4096, cfg.bos_id = 1, cfg.eos_id = 2;
        cfg.attn_bias = arch == MODEL_ARCH_QWEN2;
        cfg.qk_norm = arch == MODEL_ARCH_QWEN3;
        cfg.tied_embeddings = arch != MODEL_ARCH_LLAMA;
        model_t *m = NULL;
        if (model_alloc(&cfg, &m)) return 1;
        model_randomize(m, 9000 + (uint64_t)arch, 0.05f);
        char dir[4200];
        snprintf(dir, sizeof dir, "%s/%s", root, model_arch_name(arch));
        mkdir(dir, 0755);
        char js[1024];
        const struct rope_scaling *rs = &cfg.rope_scaling;
        int n = snprintf(js, sizeof js,
                         "{\"arch\": \"%s\", \"n_vocab\": %d, \"dim\": %d, \"n_layers\": %d, \"n_heads\": %d, "
                         "\"n_kv_heads\": %d, \"head_dim\": %d, \"ffn_dim\": %d, \"rms_eps\": %.9g, \"rope_theta\": %.9g, "
                         "\"rope_neox\": %s, \"rope_scaling\": {\"type\": %d, \"factor\": %.9g, \"low_freq_factor\": %.9g, "
                         "\"high_freq_factor\": %.9g, \"original_max_pos\": %.9g}, \"attn_bias\": %s, \"qk_norm\": %s, "
                         "\"tied_embeddings\": %s, \"n_tok\": %d, \"variants\": [\"cpu\", \"cuda_f32w\", \"cuda_bf16w\", "
                         "\"cuda_bf16w_bf16kv\", \"cuda_bf16w_split\"]}\n",
                         model_arch_name(arch), cfg.n_vocab, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, cfg.ffn_dim, (double)cfg.rms_eps, (double)cfg.rope_theta,
                         cfg.rope_neox ? "true" : "false", rs->type, (double)rs->factor, (double)rs->low_freq_factor,
                         (double)rs->high_freq_factor, (double)rs->original_max_pos, cfg.attn_bias ? "true" : "false",
                         cfg.qk_norm ? "true" : "false", cfg.tied_embeddings ? "true" : "false", DUMP_TOK);
        if (dump_write(dir, "config.json", js, (size_t)n)) return 1;
        char path[4300];
        snprintf(path, sizeof path, "%s/weights.bin", dir);
        FILE *f = fopen(path, "wb");
        if (!f) return fprintf(stderr, "bench_cuda: cannot write %s\n", path), 1;
        size_t d = (size_t)cfg.dim, V = (size_t)cfg.n_vocab, q = (size_t)cfg.n_heads * cfg.head_dim;
        size_t kv = (size_t)cfg.n_kv_heads * cfg.head_dim, ff = (size_t)cfg.ffn_dim, hd = (size_t)cfg.head_dim;
#define W(p, cnt) fwrite((p), sizeof(float), (cnt), f)
        W(kv_wmat_f32(&m->w.tok_embd), V * d);
        W(m->w.out_norm, d);
        if (!cfg.tied_embeddings) W(kv_wmat_f32(&m->w.output), V * d);
        for (int l = 0; l < cfg.n_layers; l++) {
            const struct layer_weights *L = &m->w.layers[l];
            W(L->attn_norm, d);
            W(kv_wmat_f32(&L->wq), q * d), W(kv_wmat_f32(&L->wk), kv * d), W(kv_wmat_f32(&L->wv), kv * d);
            if (cfg.attn_bias) W(L->bq, q), W(L->bk, kv), W(L->bv, kv);
            if (cfg.qk_norm) W(L->q_norm, hd), W(L->k_norm, hd);
            W(kv_wmat_f32(&L->wo), d * q);
            W(L->ffn_norm, d);
            W(kv_wmat_f32(&L->w_gate), ff * d), W(kv_wmat_f32(&L->w_up), ff * d), W(kv_wmat_f32(&L->w_down), d * ff);
        }
#undef W
        if (fclose(f)) return fprintf(stderr, "bench_cuda: cannot write %s\n", path), 1;
        int32_t toks[DUMP_TOK];
        uint64_t x = 77 + (uint64_t)arch;
        for (int i = 0; i < DUMP_TOK; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            toks[i] = (int32_t)(x % V);
        }
        if (dump_write(dir, "tokens.bin", toks, sizeof toks)) return 1;
        float *lg = malloc((size_t)DUMP_TOK * V * sizeof(float));
        if (!lg) return 1;
        const char *names[] = {"cpu", "cuda_f32w", "cuda_bf16w", "cuda_bf16w_bf16kv", "cuda_bf16w_split"};
        for (int v = 0; v < 5; v++) {
            struct backend_options o = {.kind = v ? BACKEND_KIND_CUDA : BACKEND_KIND_CPU, .f32_weights = v == 1};
            backend_t *be = NULL;
            char err[512];
            if (v == 4) setenv("KVSERVE_CUDA_FLASH", "0", 1); /* the split attention kernels for the chunks too */
            kv_status cst = backend_create(m, &o, &be, err, sizeof err);
            unsetenv("KVSERVE_CUDA_FLASH");
            if (cst) return fprintf(stderr, "bench_cuda: %s\n", err), 1;
            memset(lg, 0xff, (size_t)DUMP_TOK * V * sizeof(float)); /* NaN: unwritten rows fail the comparison */
            int rc = dump_logits(be, m, toks, v == 3 ? KV_DTYPE_BF16 : KV_DTYPE_F32, lg);
            backend_free(be);
            char nm[64];
            snprintf(nm, sizeof nm, "logits_%s.bin", names[v]);
            if (rc || dump_write(dir, nm, lg, (size_t)DUMP_TOK * V * sizeof(float))) return 1;
        }
        free(lg);
        model_free(m);
        printf("torch dump: %s (%s, %d tokens)\n", dir, model_arch_name(arch), DUMP_TOK);
    }
    return 0;
}

int main(int argc, char **argv) {
    int layers = 32, steps = 20, do_copy = 1, do_decode = 1, kv_dtype = KV_DTYPE_BF16;
    const char *dump = NULL;
    int batches[8] = {1, 8, 32}, nb = 3, ctxs[8] = {512, 4096}, nc = 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batches") && i + 1 < argc) nb = parse_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--ctxs") && i + 1 < argc) nc = parse_list(argv[++i], ctxs, 8);
        else if (!strcmp(argv[i], "--kv-dtype") && i + 1 < argc &&
                 kv_dtype_parse(argv[i + 1], &kv_dtype) == KV_OK && kv_dtype != KV_DTYPE_F16)
            i++;
        else if (!strcmp(argv[i], "--no-copy")) do_copy = 0;
        else if (!strcmp(argv[i], "--no-decode")) do_decode = 0;
        else if (!strcmp(argv[i], "--deterministic")) g_det = true;
        else if (!strcmp(argv[i], "--sample") && i + 1 < argc && (!strcmp(argv[i + 1], "greedy") || !strcmp(argv[i + 1], "topp")))
            g_sample = !strcmp(argv[++i], "greedy") ? 1 : 2;
        else if (!strcmp(argv[i], "--host-sample")) g_host_sample = true;
        else if (!strcmp(argv[i], "--tpb") && i + 1 < argc && atoi(argv[i + 1]) > 0) g_tpb = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prefill") && i + 1 < argc) g_nprefill = parse_list(argv[++i], g_prefill, 8);
        else if (!strcmp(argv[i], "--torch-dump") && i + 1 < argc) dump = argv[++i];
        else {
            fprintf(stderr, "usage: bench_cuda [--layers N] [--batches 1,8,32] [--ctxs 512,4096] [--steps N] "
                            "[--kv-dtype bf16|f32] [--no-copy] [--no-decode] [--deterministic] [--prefill N,...] [--tpb N] "
                            "[--sample greedy|topp [--host-sample]] "
                            "[--torch-dump DIR]\n");
            return 2;
        }
    }
    if (steps < 1) steps = 1;
    char err[256];
    if (kv_cuda_device_check(err, sizeof err)) {
        fprintf(stderr, "bench_cuda: %s\n", err);
        return 77;
    }
    if (dump) return torch_dump(dump);
    char name[256];
    kv_cuda_device_name(0, name, sizeof name);
    double bw = copy_bw();
    printf("device: %s\ndevice-to-device copy: %.0f GB/s (read + write)\n", name, bw / 1e9);
    if (do_decode || g_nprefill) bench_decode(layers, batches, do_decode ? nb : 0, ctxs, nc, steps, bw, kv_dtype);
    if (do_copy) bench_copy();
    return 0;
}
