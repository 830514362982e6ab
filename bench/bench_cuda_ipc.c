/*
 * bench_cuda_ipc: KV-transfer GB/s of the CUDA IPC transport (src/backend/cuda/
 * transport_cuda_ipc.h) between two processes on one GPU, against a raw cudaMemcpyAsync
 * device-to-device copy of the same byte count measured in the same run (issue 10 / issue 14:
 * goal >= 90%).
 *
 *   bench_cuda_ipc [--block-kib K] [--sizes-mib 4,64,512] [--reps N]
 *
 * The exposing process (this binary again, --exposer) holds a 1 GiB pool of K KiB blocks
 * (default 2048: one Llama-3-8B bf16 block of 16 tokens, 32 layers x 2 x 8 heads x 128);
 * this process connects once (cudaIpcOpenMemHandle) and, for each size, reads size/K blocks
 * from scattered source blocks into scattered destination blocks of its own 1 GiB pool (one
 * fragment per block, as the agent sends them) -- and once as one contiguous fragment. Each
 * figure is the median over N reps of the wall time from the read() call to its completion
 * seen by progress() (polled without sleeping, as the agent's thread does). The baseline is
 * cudaMemcpyAsync(D2D) of the same bytes between two allocations of this process followed by
 * cudaStreamSynchronize, timed the same way. One line per size, plus the GPU name.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cuda/backend_cuda.h"
#include "backend/cuda/transport_cuda_ipc.h"

#define POOL (1ull << 30)


static int exposer(void) {
    char err[256];
    void *dev = kv_cuda_malloc(POOL);
    kvx_transport_t *t = NULL;
    kv_buf desc;
    kv_buf_init(&desc);
    if (!dev || kvx_transport_cuda_ipc_new(0, &t, err, sizeof err) != KV_OK ||
        t->ops->expose(t, dev, POOL, &desc, err, sizeof err) != KV_OK) {
        fprintf(stderr, "exposer: %s\n", dev ? err : "cudaMalloc failed");
        return 1;
    }
    uint32_t n = (uint32_t)desc.len;
    kv_write_all(1, &n, 4), kv_write_all(1, desc.data, n);
    char c;
    while (read(0, &c, 1) > 0) {
    }
    t->ops->destroy(t);
    kv_cuda_free(dev);
    kv_buf_free(&desc);
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* median ns of reps reads of frags[0..n) */
static uint64_t time_reads(kvx_transport_t *t, kvx_peer_t *p, const struct kvx_frag *fr, int n, int reps) {
    uint64_t *ts = calloc((size_t)reps, sizeof *ts);
    char err[256];
    for (int r = -2; r < reps; r++) { /* two warm-ups */
        uint64_t t0 = kv_now_ns();
        if (t->ops->read(t, p, 0, fr, n, (uint64_t)r + 100, err, sizeof err) != KV_OK) {
            fprintf(stderr, "read: %s\n", err);
            exit(1);
        }
        struct kvx_completion c;
        while (t->ops->progress(t, &c, 1, 0) == 0) {
        }
        if (c.status != KV_OK) {
            fprintf(stderr, "read failed: %s\n", c.message);
            exit(1);
        }
        if (r >= 0) ts[r] = kv_now_ns() - t0;
    }
    qsort(ts, (size_t)reps, sizeof *ts, cmp_u64);
    uint64_t m = ts[reps / 2];
    free(ts);
    return m;
}

static uint64_t time_memcpy(void *dst, const void *src, size_t bytes, cudaStream_t st, int reps) {
    uint64_t *ts = calloc((size_t)reps, sizeof *ts);
    for (int r = -2; r < reps; r++) {
        uint64_t t0 = kv_now_ns();
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st);
        cudaStreamSynchronize(st);
        if (r >= 0) ts[r] = kv_now_ns() - t0;
    }
    qsort(ts, (size_t)reps, sizeof *ts, cmp_u64);
    uint64_t m = ts[reps / 2];
    free(ts);
    return m;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--exposer")) return exposer();
    size_t block = 2048u << 10;
    int reps = 20;
    char sizes[128] = "4,64,512";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--block-kib")) block = (size_t)atol(argv[i + 1]) << 10;
        else if (!strcmp(argv[i], "--sizes-mib")) snprintf(sizes, sizeof sizes, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--block-kib K] [--sizes-mib 4,64,512] [--reps N]\n", argv[0]);
            return 2;
        }
    }
    if (block < 16 || block % 16 || POOL / block < 2 || reps < 1) {
        fprintf(stderr, "bench_cuda_ipc: bad --block-kib / --reps\n");
        return 2;
    }
    /* the exposer first: exec'd, so its CUDA context is its own */
    int in[2], out[2];
    if (pipe(in) || pipe(out)) return 1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(in[0], 0), dup2(out[1], 1);
        close(in[0]), close(in[1]), close(out[0]), close(out[1]);
        execl("/proc/self/exe", argv[0], "--exposer", (char *)NULL);
        _exit(127);
    }
    close(in[0]), close(out[1]);
    uint32_t n = 0;
    uint8_t desc[4096];
    if (kv_read_all(out[0], &n, 4) || n > sizeof desc || kv_read_all(out[0], desc, n)) {
        fprintf(stderr, "bench_cuda_ipc: the exposer failed\n");
        return 1;
    }
    char err[256], name[256];
    kv_cuda_device_name(0, name, sizeof name);
    kvx_transport_t *t = NULL;
    kvx_peer_t *p = NULL;
    char *local = kv_cuda_malloc(POOL), *other = kv_cuda_malloc(POOL);
    if (!local || !other || kvx_transport_cuda_ipc_new(0, &t, err, sizeof err) != KV_OK ||
        t->ops->connect(t, desc, n, &p, err, sizeof err) != KV_OK) {
        fprintf(stderr, "bench_cuda_ipc: %s\n", err);
        return 1;
    }
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    int nb = (int)(POOL / block);
    printf("bench_cuda_ipc: %s; two processes on GPU 0; blocks of %zu KiB; median of %d reps\n", name,
           block >> 10, reps);
    printf("%10s %7s %16s %16s %16s %8s %8s\n", "bytes", "blocks", "ipc_scatter_GB/s", "ipc_contig_GB/s",
           "memcpy_d2d_GB/s", "ratio", "ratio_c");
    struct kvx_frag *fr = calloc((size_t)nb, sizeof *fr);
    for (char *save = NULL, *tok = strtok_r(sizes, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        size_t bytes = (size_t)atol(tok) << 20;
        int k = (int)(bytes / block);
        if (k < 1 || k > nb / 2) {
            fprintf(stderr, "bench_cuda_ipc: %s MiB does not fit (1 .. %d blocks)\n", tok, nb / 2);
            continue;
        }
        /* scattered: source block (i * 2 + 1) * 7919 mod nb, destination the reverse order of
         * the even blocks: no two fragments adjacent on both sides */
        for (int i = 0; i < k; i++) {
            size_t sb = ((size_t)i * 2 + 1) * 7919 % (size_t)nb, db = (size_t)(k - 1 - i) * 2;
            fr[i] = (struct kvx_frag){sb * block, local + db * block, block};
        }
        uint64_t ns_s = time_reads(t, p, fr, k, reps);
        struct kvx_frag one = {0, local, (size_t)k * block};
        uint64_t ns_c = time_reads(t, p, &one, 1, reps);
        uint64_t ns_m = time_memcpy(local, other, (size_t)k * block, st, reps);
        double b = (double)k * (double)block;
        printf("%10zu %7d %16.1f %16.1f %16.1f %8.3f %8.3f\n", (size_t)k * block, k, b / ns_s, b / ns_c, b / ns_m,
               (double)ns_m / (double)ns_s, (double)ns_m / (double)ns_c);
    }
    free(fr);
    t->ops->disconnect(t, p);
    t->ops->destroy(t);
    cudaStreamDestroy(st);
    kv_cuda_free(local);
    kv_cuda_free(other);
    close(in[1]);
    int status;
    waitpid(pid, &status, 0);
    close(out[0]);
    return 0;
}
