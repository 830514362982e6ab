/* CUDA backend internals shared by its .cu files (C++; not a public header). */
#ifndef KV_CUDA_INTERNAL_H
#define KV_CUDA_INTERNAL_H

#include <cuda_runtime.h>
#include <stddef.h>

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

#endif
