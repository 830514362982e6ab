/* CUDA backend internals shared by its .cu files (C++; not a public header). */
#ifndef KV_CUDA_INTERNAL_H
#define KV_CUDA_INTERNAL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "backend_cuda.h"

extern "C" {
#include "../../base/base.h"
}

/* Evaluates a CUDA runtime call; on failure formats "<what>: <cuda error>" into err and
 * returns KV_EIO (KV_ENOMEM for cudaErrorMemoryAllocation) from the enclosing function. */
#define CU_TRY(call, what)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return kv_errf(e_ == cudaErrorMemoryAllocation ? KV_ENOMEM : KV_EIO, err, errlen,      \
                           "cuda: %s: %s", (what), cudaGetErrorString(e_));                        \
    } while (0)

/* Page-copy launcher on a given stream (no synchronisation); see backend_cuda.h. */
kv_status kv_cuda_copy_pages_async(int dir, void *const *dst, const void *const *src, int n, size_t nbytes,
                                   cudaStream_t stream, char *err, size_t errlen);

/* ---- counted CUDA calls (struct kv_cuda_counters in backend_cuda.h) ----
 * Every call of src/backend/cuda that synchronises, copies, sets, allocates, frees or
 * launches goes through one of these; the raw names are poisoned below, so a new uncounted
 * call does not compile. kvc_capturing (per thread) is set while this thread captures a
 * graph: copies and launches made then are counted as captured, not as host calls. */
extern struct kv_cuda_counters kvc_counters;
extern thread_local int kvc_capturing;
static inline void kvc_inc(uint64_t *f) { __atomic_fetch_add(f, 1, __ATOMIC_RELAXED); }
static inline cudaError_t kvc_stream_sync(cudaStream_t s) {
    kvc_inc(&kvc_counters.stream_syncs);
    return cudaStreamSynchronize(s);
}
static inline cudaError_t kvc_memcpy_async(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st) {
    kvc_inc(kvc_capturing                   ? &kvc_counters.captured_copies
            : k == cudaMemcpyHostToDevice   ? &kvc_counters.h2d_copies
            : k == cudaMemcpyDeviceToHost   ? &kvc_counters.d2h_copies
                                            : &kvc_counters.other_copies);
    return cudaMemcpyAsync(d, s, n, k, st);
}
static inline cudaError_t kvc_memcpy_sync(void *d, const void *s, size_t n, cudaMemcpyKind k) {
    kvc_inc(&kvc_counters.sync_copies);
    return cudaMemcpy(d, s, n, k);
}
static inline cudaError_t kvc_memset_async(void *d, int v, size_t n, cudaStream_t st) {
    kvc_inc(&kvc_counters.memsets);
    return cudaMemsetAsync(d, v, n, st);
}
static inline cudaError_t kvc_malloc(void **p, size_t n) {
    kvc_inc(&kvc_counters.allocs);
    return cudaMalloc(p, n);
}
static inline cudaError_t kvc_host_alloc(void **p, size_t n, unsigned flags) {
    kvc_inc(&kvc_counters.allocs);
    return cudaHostAlloc(p, n, flags);
}
static inline cudaError_t kvc_free(void *p) {
    kvc_inc(&kvc_counters.frees);
    return cudaFree(p);
}
static inline cudaError_t kvc_free_host(void *p) {
    kvc_inc(&kvc_counters.frees);
    return cudaFreeHost(p);
}
/* after each kernel launch or cuBLAS call (the launch itself is the <<<>>> before it) */
static inline void kvc_launched(void) {
    kvc_inc(kvc_capturing ? &kvc_counters.captured_launches : &kvc_counters.launches);
}
static inline cudaError_t kvc_graph_instantiate(cudaGraphExec_t *e, cudaGraph_t g) {
    kvc_inc(&kvc_counters.graph_instantiations);
    return cudaGraphInstantiate(e, g, 0);
}
static inline cudaError_t kvc_graph_launch(cudaGraphExec_t e, cudaStream_t st) {
    kvc_inc(&kvc_counters.graph_launches);
    return cudaGraphLaunch(e, st);
}
#define cudaStreamSynchronize(...) kvc_use_kvc_stream_sync_instead
#define cudaDeviceSynchronize(...) kvc_not_used_in_the_backend
#define cudaEventSynchronize(...) kvc_not_used_in_the_backend
#define cudaMemcpyAsync(...) kvc_use_kvc_memcpy_async_instead
#define cudaMemcpy(...) kvc_use_kvc_memcpy_sync_instead
#define cudaMemset(...) kvc_not_used_in_the_backend
#define cudaMemsetAsync(...) kvc_use_kvc_memset_async_instead
#define cudaMalloc(...) kvc_use_kvc_malloc_instead
#define cudaMallocHost(...) kvc_use_kvc_host_alloc_instead
#define cudaMallocManaged(...) kvc_not_used_in_the_backend
#define cudaHostAlloc(...) kvc_use_kvc_host_alloc_instead
#define cudaFree(...) kvc_use_kvc_free_instead
#define cudaFreeHost(...) kvc_use_kvc_free_host_instead
#define cudaGraphInstantiate(...) kvc_use_kvc_graph_instantiate_instead
#define cudaGraphLaunch(...) kvc_use_kvc_graph_launch_instead

#endif
