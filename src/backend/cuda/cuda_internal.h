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

/* ---- sampling on the device (sample.cu) ---- */
#define KVS_MAX_TOP BACKEND_MAX_TOP
/* One logit row's request as uploaded with the step's metadata (64 bytes, 8-byte aligned). */
struct kvs_row {
    double u;
    float temperature, top_p, min_p, rep, freq, pres;
    int32_t top_k, n_top, want_lp;
    int32_t tok_off, n_prompt, n_gen; /* history in the token section (n_prompt 0 unless rep) */
    int32_t sort_slot;                /* >= 0: this row's candidates are sorted, in that slot */
    int32_t pad;
};
/* One row's result as downloaded. */
struct kvs_out {
    int32_t id;
    float logprob;
    int32_t top_id[KVS_MAX_TOP];
    float top_lp[KVS_MAX_TOP];
};
/* A backend's sampling scratch (device buffers grown on demand, pinned results). */
struct kvs_state {
    int32_t *cnt; /* (rows, V) generated-id counts, zero between calls */
    void *stat;   /* (rows) struct kvs_stat */
    struct kvs_out *d_out, *h_out;
    unsigned long long *keys, *keys2;
    int32_t *vals, *vals2;
    void *cub_tmp;
    size_t cap_cnt, cap_stat, cap_out, cap_h_out, cap_keys, cap_keys2, cap_vals, cap_vals2, cap_cub;
};
/* int32 entries of metadata the L requests take: L kvs_row, then the token histories of the
 * penalised rows. */
size_t kvs_meta_len(const struct backend_sampling *sp, int L);
/* Validates the requests (KV_EINVAL with the reason) and writes them at h (8-byte aligned);
 * *n_sort = rows whose candidates need sorting (top_k / top_p). */
kv_status kvs_meta_fill(const struct backend_sampling *sp, int L, int V, int32_t *h, int *n_sort, char *err,
                        size_t errlen);
/* Enqueues on st: the sampling of the L rows of d_logits (penalties applied in place) from the
 * device copy d_samp of kvs_meta_fill's output, and the download of the results into the
 * pinned s->h_out. No synchronisation; scratch grows as needed. */
kv_status kvs_enqueue(struct kvs_state *s, cudaStream_t st, float *d_logits, int L, int V, const int32_t *d_samp,
                      int n_sort, char *err, size_t errlen);
/* After the stream synchronised: the results into out (L entries). */
void kvs_collect(const struct kvs_state *s, const struct backend_sampling *sp, int L, struct backend_sample_out *out);
void kvs_free(struct kvs_state *s);
/* Raises k_sample_prep's dynamic shared memory limit (once per device use). */
cudaError_t kvs_setup(void);

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
