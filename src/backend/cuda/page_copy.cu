/*
 * Page copies between host (pinned) and device memory, and inside device memory, by our own
 * kernel: seed-features section 6 ("Host<->device page copy") and decision 6 (zero bytes
 * return success without a launch; device-to-device splits unchanged). See backend_cuda.h.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "cuda_internal.h"

#define PC_THREADS 128
#define PC_MAX_TASKS 256 /* pages per launch (gridDim.y) */
#define PC_GRAIN 2048    /* a CTA's range is a multiple of this */
#define PC_UNROLL 8      /* 16-byte loads in flight per thread */

struct pc_tasks {
    const void *src[PC_MAX_TASKS];
    void *dst[PC_MAX_TASKS];
};

/* blockIdx.y: page; blockIdx.x: split. Each CTA copies [x*chunk, min(nbytes, (x+1)*chunk)). */
__global__ void __launch_bounds__(PC_THREADS) k_page_copy(const __grid_constant__ pc_tasks t, size_t nbytes,
                                                           size_t chunk) {
    size_t begin = (size_t)blockIdx.x * chunk;
    if (begin >= nbytes) return;
    size_t end = begin + chunk < nbytes ? begin + chunk : nbytes;
    const uint4 *s = (const uint4 *)((const char *)t.src[blockIdx.y] + begin);
    uint4 *d = (uint4 *)((char *)t.dst[blockIdx.y] + begin);
    size_t n16 = (end - begin) / 16;
    size_t i = threadIdx.x;
    for (; i + (PC_UNROLL - 1) * PC_THREADS < n16; i += PC_UNROLL * PC_THREADS) {
        uint4 v[PC_UNROLL];
#pragma unroll
        for (int u = 0; u < PC_UNROLL; u++) v[u] = s[i + (size_t)u * PC_THREADS];
#pragma unroll
        for (int u = 0; u < PC_UNROLL; u++) d[i + (size_t)u * PC_THREADS] = v[u];
    }
    for (; i < n16; i += PC_THREADS) d[i] = s[i];
}

extern "C" int kv_cuda_copy_splits(enum kv_cuda_copy_dir dir, size_t nbytes) {
    if (nbytes == 0) return 0;
    if (dir == KV_CUDA_D2D) {
        size_t s = (nbytes + 4095) / 4096;
        return s > (size_t)INT32_MAX ? INT32_MAX : (int)s;
    }
    size_t s = (nbytes + (8u << 20) - 1) / (8u << 20);
    if (s < 1) s = 1;
    if (s > 16) s = 16;
    return (int)s;
}

extern "C" size_t kv_cuda_copy_engine_min(void) {
    const char *v = getenv("KVSERVE_CUDA_COPY_CE_MIN");
    if (!v || !*v) return (size_t)8 << 20;
    char *end = NULL;
    unsigned long long b = strtoull(v, &end, 10);
    if (end == v || *end || b == 0) return 0; /* malformed or 0: the kernel for every size */
    return (size_t)b;
}

kv_status kv_cuda_copy_pages_async(int dir, void *const *dst, const void *const *src, int n, size_t nbytes,
                                   cudaStream_t stream, char *err, size_t errlen) {
    if (n == 0 || nbytes == 0) return KV_OK; /* decision 6: success, no launch, nothing else checked */
    if (n < 0 || dir < KV_CUDA_H2D || dir > KV_CUDA_D2D)
        return kv_errf(KV_EINVAL, err, errlen, "page copy: bad direction %d or page count %d", dir, n);
    if (!dst || !src) return kv_errf(KV_EINVAL, err, errlen, "page copy: NULL pointer table");
    if (nbytes % 16)
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "page copy: %zu bytes per page is not a multiple of 16",
                       nbytes);
    for (int i = 0; i < n; i++)
        if (!dst[i] || !src[i] || ((uintptr_t)dst[i] | (uintptr_t)src[i]) % 16)
            return kv_errf(KV_EUNSUPPORTED, err, errlen, "page copy: page %d pointer NULL or not 16-byte aligned",
                           i);
    size_t ce_min = dir == KV_CUDA_D2D ? 0 : kv_cuda_copy_engine_min();
    if (ce_min && nbytes >= ce_min) { /* the copy engines: faster than SM reads of pinned memory here */
        cudaMemcpyKind kind = dir == KV_CUDA_H2D ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
        for (int i = 0; i < n; i++) CU_TRY(kvc_memcpy_async(dst[i], src[i], nbytes, kind, stream), "page copy (copy engine)");
        return KV_OK;
    }
    int splits = kv_cuda_copy_splits((enum kv_cuda_copy_dir)dir, nbytes);
    size_t grains = (nbytes + PC_GRAIN - 1) / PC_GRAIN;
    size_t chunk = (grains + (size_t)splits - 1) / (size_t)splits * PC_GRAIN;
    pc_tasks local; /* 4 KiB, passed by value as the kernel's parameter */
    for (int i0 = 0; i0 < n; i0 += PC_MAX_TASKS) {
        int k = n - i0 < PC_MAX_TASKS ? n - i0 : PC_MAX_TASKS;
        memset(&local, 0, sizeof local);
        for (int i = 0; i < k; i++) {
            local.src[i] = src[i0 + i];
            local.dst[i] = dst[i0 + i];
        }
        dim3 grid((unsigned)splits, (unsigned)k);
        k_page_copy<<<grid, PC_THREADS, 0, stream>>>(local, nbytes, chunk);
        kvc_launched();
        CU_TRY(cudaGetLastError(), "page copy launch");
    }
    return KV_OK;
}

extern "C" kv_status kv_cuda_copy_pages_on(enum kv_cuda_copy_dir dir, void *const *dst, const void *const *src, int n,
                                           size_t nbytes, void *stream, char *err, size_t errlen) {
    return kv_cuda_copy_pages_async((int)dir, dst, src, n, nbytes, (cudaStream_t)stream, err, errlen);
}

extern "C" kv_status kv_cuda_copy_pages(enum kv_cuda_copy_dir dir, void *const *dst, const void *const *src, int n,
                                        size_t nbytes, char *err, size_t errlen) {
    if (n == 0 || nbytes == 0) return KV_OK; /* before making a stream */
    cudaStream_t s;
    CU_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream create");
    kv_status st = kv_cuda_copy_pages_async((int)dir, dst, src, n, nbytes, s, err, errlen);
    cudaError_t e = kvc_stream_sync(s);
    cudaStreamDestroy(s);
    if (st) return st;
    if (e != cudaSuccess) return kv_errf(KV_EIO, err, errlen, "cuda: page copy: %s", cudaGetErrorString(e));
    return KV_OK;
}

/* ---- helpers ---- */

struct kv_cuda_counters kvc_counters;
thread_local int kvc_capturing;

extern "C" void kv_cuda_counters_get(struct kv_cuda_counters *out) {
    if (!out) return;
    const uint64_t *src = (const uint64_t *)&kvc_counters;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++) dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

extern "C" kv_status kv_cuda_device_check(char *err, size_t errlen) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "no usable CUDA device: %s", cudaGetErrorString(e));
    if (n < 1) return kv_errf(KV_EUNSUPPORTED, err, errlen, "no CUDA device found");
    return KV_OK;
}

extern "C" void kv_cuda_device_name(int dev, char *out, size_t outlen) {
    if (!out || !outlen) return;
    out[0] = 0;
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) return;
    snprintf(out, outlen, "%s (%d SMs, %.1f GiB, cc %d.%d)", p.name, p.multiProcessorCount,
             (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), p.major, p.minor);
}

extern "C" void *kv_cuda_malloc(size_t n) {
    void *p = NULL;
    cudaError_t e = kvc_malloc(&p, n);
    if (e != cudaSuccess) {
        KV_ERROR("cuda: kvc_malloc(%zu): %s", n, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}
extern "C" void kv_cuda_free(void *p) {
    if (p) kvc_free(p);
}
extern "C" void *kv_cuda_host_alloc(size_t n) {
    void *p = NULL;
    cudaError_t e = kvc_host_alloc(&p, n, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        KV_ERROR("cuda: kvc_host_alloc(%zu): %s", n, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}
extern "C" void kv_cuda_host_free(void *p) {
    if (p) kvc_free_host(p);
}
extern "C" kv_status kv_cuda_memcpy(void *dst, const void *src, size_t n) {
    cudaError_t e = kvc_memcpy_sync(dst, src, n, cudaMemcpyDefault);
    if (e != cudaSuccess) {
        KV_ERROR("cuda: kvc_memcpy_sync(%zu): %s", n, cudaGetErrorString(e));
        return KV_EIO;
    }
    return KV_OK;
}
