/*
 * CUDA backend (issue 10): the backend interface of ../backend.h on one NVIDIA GPU.
 *
 * Built only with -DKVSERVE_CUDA=ON (default when nvcc is found); the code lives in the CMake
 * target kv_backend_cuda, and kv_backend gets KVSERVE_HAVE_CUDA=1 when it is linked. Every
 * function here exists only in such a build; callers outside the backend go through
 * backend_create (../backend.h), which reports a build without CUDA.
 *
 * Storage on the device:
 *   - weights: bf16 (default) or f32 (backend_cuda_options.f32_weights). A matrix stored in
 *     another type (struct kv_wmat: F16, BF16, Q8_0, Q4_0, Q4_K, ...) is dequantized on the
 *     host row by row (kv_dequant_row: the CPU backend's exact floats) in chunks of up to
 *     64 MiB, copied, and (bf16) rounded to nearest-even on the device; the host weights are
 *     not kept. q/k/v are one (qw + 2 kw, dim) matrix,
 *     gate/up one (2 ffn, dim) matrix, so each layer runs 4 GEMMs. GEMMs: cuBLAS
 *     (cublasGemmEx) with f32 accumulation and f32 outputs; activations into a GEMM are in
 *     the weight dtype; the residual stream, norms, RoPE and softmax are f32.
 *   - KV pool: f32 or bf16 (geometry kv_dtype: KV_DTYPE_F32 / KV_DTYPE_BF16; F16 and others
 *     KV_EINVAL; bf16 needs head_dim % 4 == 0) in HBM, laid out exactly as ../backend.h says
 *     (so kv_block_bytes holds; f32 host copies are byte-compatible with the CPU backend's
 *     blocks, bf16 ones are not). bf16: K (after RoPE) and V rounded to nearest-even on store;
 *     attention converts them to f32 and accumulates in f32.
 * Per forward: one host->device copy of the step's metadata (tokens, positions, block
 * tables), the kernels and GEMMs on the backend's stream, and one device->host copy of the
 * logits rows asked for (batch_n_logits rows) followed by one stream synchronisation (with
 * a CUDA graph the metadata copy is a node of the graph; struct kv_cuda_counters below has
 * the exact call counts, which test_cuda_decode_syncs checks).
 * Attention: single-token rows (decode) split over the positions (16, 32 or 128 per part,
 * more when the batch has many rows) and combine (flash-decoding style), one CTA per (row,
 * group of query heads sharing a KV head, part), f32 arithmetic. Rows of sequences with more
 * than one new token (prefill chunks; bf16 weights, head_dim % 8 == 0 and <= 128, not
 * deterministic) run k_attn_flash (attn_flash.cuh: FlashAttention-2 on mma.sync bf16 (bf16
 * pool) or fp16 (f32 pool: K/V converted on load) tensor-core tiles, f32 softmax and
 * accumulation) straight into the o-projection input, in graph steps too; the split kernels
 * then take the step's single-token rows (a row list). Which kernel a row runs depends on its
 * own sequence's step only.
 * Sampling: forward_sample (backend.h) samples the logits rows on the device (sample.cu);
 * only ids and logprobs come back. Same pipeline and RNG stream as the host sampler (the
 * engine draws u = kv_rng_f64 per non-greedy token before the step, as the host sampler would
 * during it); greedy ids and the penalised logits are bitwise the host's; sums of
 * probabilities and the log-sum-exp (double) are reduced in another order and exp / log are
 * the device's, so logprobs may differ in the last float bits and a draw within rounding
 * (~1e-16 relative) of a boundary between two candidates may pick the neighbour.
 * block_ptr is NULL (device memory): host offload goes through copy_to_host /
 * copy_from_host, which use the page-copy kernel below (pinned host buffers are read and
 * written directly; other host memory is bounced through a pinned staging buffer).
 * Not batch-invariant by default: cuBLAS may pick a different kernel for a different row
 * count, the GEMV serves one row, and the attention split depends on the batch; the
 * deterministic option (below) makes it batch-invariant.
 * One forward at a time per backend (not thread-safe). A failed CUDA call makes the call
 * return KV_EIO with the CUDA error string in err. After a failed forward the backend probes
 * the context (a 4-byte memset and a sync): if that fails too the error was sticky (an
 * illegal address, a trap, ...: the CUDA context is unusable), the backend marks itself
 * unhealthy for good (ops->healthy false with the reason; every later forward KV_EIO at
 * once without touching the device) and the server answers /health and new requests with
 * 503 backend_unhealthy until it is restarted. Never crashes the process.
 */
#ifndef KV_BACKEND_CUDA_H
#define KV_BACKEND_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif

#include "../backend.h"

/* Environment (read by backend_cuda_new, for tests and comparisons): KVSERVE_CUDA_WEIGHTS=f32|bf16
 * overrides f32_weights; KVSERVE_CUDA_GRAPHS=0 turns CUDA graphs off; KVSERVE_CUDA_ATTN=1 keeps
 * the first attention kernel for every step; KVSERVE_CUDA_GEMV_MAX=N uses our GEMV for
 * products of <= N rows (default 1, 0 = cuBLAS always); KVSERVE_CUDA_CAPTURE=global captures
 * graphs in cudaStreamCaptureModeGlobal (then any potentially unsafe CUDA call in any thread
 * while a step is captured fails the capture and the forward, KV_EIO; the default is
 * cudaStreamCaptureModeThreadLocal, which checks this thread only, so that other threads of a
 * server, e.g. page copies, are not disturbed); KVSERVE_CUDA_FAULT=forward:N[,N...] (fault
 * injection, tests/gpu/fault_serve.py) makes the forward calls numbered N (1 = the first of
 * this backend) run normally and then fail as if their stream sync had reported
 * cudaErrorLaunchFailure: KV_EIO and a message ending in "(injected by KVSERVE_CUDA_FAULT)";
 * the backend stays usable, as after any non-sticky CUDA error; KVSERVE_CUDA_FAULT=sticky:N[,N...]
 * (also after forward:...;, separated by ';') makes those forward calls start with a kernel
 * that traps: a real sticky error (the backend turns unhealthy, see above);
 * KVSERVE_CUDA_PDL=0 launches the forward's kernels without programmatic dependent launch
 * (default on: each kernel may start launching while the previous one runs, kernels.cuh
 * pdl_wait); KVSERVE_CUDA_GEMV_LATE=0 lets the next kernel launch at the start of a
 * single-row product (k_gemv_bf16) instead of after its loads; KVSERVE_CUDA_QKV_FUSE=0
 * launches k_qkv_post for steps whose rows all run k_attn_dec_tc instead of doing its work
 * there; KVSERVE_CUDA_FLASH=0 keeps the split attention kernels for prefill steps too;
 * KVSERVE_CUDA_FLASH_MT=1 runs k_attn_flash with one 16-row m tile per warp (64 M rows per
 * CTA) instead of 2; KVSERVE_CUDA_SKIP=attn,norm,qkv,swiglu,gemm (timing only: results are
 * wrong) leaves those stages of every layer out; KVSERVE_CUDA_ATTN=2 takes k_attn_part2 for
 * every split step and KVSERVE_CUDA_ATTN_SPLIT=N (a multiple of 8; 32 for k_attn_part2) sets
 * the first split length tried (both for experiments: docs/benchmarks.md). Decode attention
 * (k_attn_dec_tc, attn_decode.cuh; bf16 KV pool, GQA group <= 8, head_dim 64 or 128, not
 * deterministic): KVSERVE_CUDA_DEC_ROWS=N serves steps of <= N split rows with it (default and
 * most 256; 0: the split kernels always), KVSERVE_CUDA_DEC_CTAS=N targets N CTAs per SM when
 * choosing its part length (default 4 for steps of 1-2 such rows, 8 for more),
 * KVSERVE_CUDA_DEC_HALF=0 never uses 16-position parts,
 * KVSERVE_CUDA_DEC_PDL=1 launches it with programmatic dependent launch (default off),
 * KVSERVE_CUDA_DEC_LATE=1 moves its launch trigger after the loads, KVSERVE_CUDA_DEC_TC=0 runs
 * the SIMT k_attn_dec instead (any head_dim % 8 == 0, f32 pools; experiments).
 * The batch-1 decode megakernel (decode_mk.cuh: every layer of a one-row step in one
 * persistent launch; bf16 weights and KV pool, head_dim 64 / 128, GQA group <= 8, dim,
 * n_heads * head_dim and ffn_dim multiples of 512, not deterministic; kv_cuda_megakernel):
 * KVSERVE_CUDA_MK=0 turns it off, 1 on (default on: MK_DEFAULT in decode_mk.cuh);
 * KVSERVE_CUDA_MK_PROF=1 (a timing tool: one blocking copy a step) prints each megakernel
 * step's phase times on stderr (the five grid barriers of a layer also one by one, the
 * attention pairs that hold the step's position apart from the others, and the
 * time each CTA's weight stream idled, its ring landed and full, by the product it waited to
 * stream next: the gaps where DRAM goes unused);
 * KVSERVE_CUDA_MK_NST=N ring stages (default 4, fewer where shared memory lacks room; an
 * experiment); KVSERVE_CUDA_MK_LM=0 the output head (final norm, logits) in two kernels after
 * the megakernel instead of inside it (an experiment); KVSERVE_CUDA_MK_DBG=N (timing
 * experiments, results wrong): bit 1 no product arithmetic, 2 no attention, 16 no weight
 * stream, 64 no grid barriers, 128 grid barriers without release / acquire; 32 (results
 * right) the weight stream without its L2 evict-first hint. */
struct backend_cuda_options {
    int device;       /* CUDA device ordinal */
    bool f32_weights; /* keep weights f32 (exact-ish reference mode); default bf16 */
    /* For benchmarks: when nonzero the weights are NOT read from the model (its weight
     * pointers may be NULL); they are filled on the device with deterministic pseudo-random
     * values from this seed (uniform, std ~0.02; norms ~1). */
    uint64_t random_weights_seed;
    /* Batch-invariant mode (issue 10, serve --deterministic): a row's logits and K/V are bitwise
     * the same whatever else is in the batch, the chunking of its prompt and the cache hits.
     * Every projection and the output head run on k_gemm_inv (kernels.cuh: our bf16 tensor-core
     * GEMM, fixed k order, no split-K, any tile shape gives the same bits; f32 weights: a scalar
     * fixed-order kernel) instead of cuBLAS / the M == 1 GEMV; attention always uses the same
     * kernel and cuts a row's positions into parts by the row's own position (det_split_len),
     * combined in part order. Norms, RoPE and SwiGLU are per row already. CUDA graphs work as in
     * the default mode. Cost: docs/benchmarks.md (CUDA). Default false: cuBLAS is faster. */
    bool deterministic;
};

/* Creates the CUDA backend for m (cfg and, unless random_weights_seed, weights). m must
 * outlive the backend; the host weights are not used after this returns.
 * Errors: KV_EINVAL (NULL argument, unsupported shape: odd head_dim or head_dim > 256,
 * n_heads % n_kv_heads), KV_EUNSUPPORTED (no usable CUDA device: the CUDA message is in
 * err), KV_ENOMEM (device memory), KV_EIO (another CUDA / cuBLAS failure). *out untouched
 * on failure; nothing leaks. */
kv_status backend_cuda_new(const model_t *m, const struct backend_cuda_options *opt, backend_t **out, char *err,
                           size_t errlen);

/* KV_OK when at least one CUDA device can be used; else KV_EUNSUPPORTED with the reason
 * (no driver, no device) in err. Safe to call on machines without a GPU. */
kv_status kv_cuda_device_check(char *err, size_t errlen);

/* Device name and memory of device dev (for logs / benches); "" on error. */
void kv_cuda_device_name(int dev, char *out, size_t outlen);

/* ---- page copies (seed-features section 6, decision 6) ----
 * Copies n pages of nbytes each, src[i] -> dst[i]. Host<->device pages of at least
 * kv_cuda_copy_engine_min() bytes (default 8 MiB) go to the copy engines (one
 * cudaMemcpyAsync per page): on the H200 no SM-issued read of pinned host memory passed
 * 51 GB/s host-to-device where the copy engines move 54-55 (plain and TMA kernels alike,
 * docs/benchmarks.md), and a copy engine leaves the SMs to the forward. Smaller pages, and
 * every device-to-device copy, use our kernel: 128 threads per CTA,
 * 16-byte grains, at most 256 pages per launch (more are split into several launches),
 * grid.x = splits: host<->device copies min(16, max(1, ceil(nbytes / 8 MiB))) CTAs per page
 * (each CTA a contiguous ceil(ceil(nbytes/2048)/splits)*2048-byte range), device-to-device
 * ceil(nbytes / 4096). Host pointers must be pinned (kv_cuda_host_alloc or
 * cudaHostRegister'ed) so the GPU can reach them; device pointers from kv_cuda_malloc.
 * nbytes == 0 or n == 0: KV_OK without any launch. nbytes not a multiple of 16, or
 * pointers not 16-byte aligned: KV_EUNSUPPORTED. The call returns when the copy is done
 * (stream synchronised); KV_EIO with the CUDA message on a failed launch. Ranges must
 * not overlap. Thread-safe (each call uses its own stream). */
enum kv_cuda_copy_dir { KV_CUDA_H2D = 0, KV_CUDA_D2H = 1, KV_CUDA_D2D = 2 };
kv_status kv_cuda_copy_pages(enum kv_cuda_copy_dir dir, void *const *dst, const void *const *src, int n,
                             size_t nbytes, char *err, size_t errlen);
/* kv_cuda_copy_pages enqueued on the caller's stream (a cudaStream_t; NULL: the legacy
 * default stream) without waiting: the copy is done when the stream reaches it. Same checks
 * and errors (n == 0 or nbytes == 0: KV_OK before any other check); nothing is launched when
 * a check fails. More than 256 pages take several launches: if a later launch fails
 * (KV_EIO), the earlier ones stay queued. Thread-safe per stream. */
kv_status kv_cuda_copy_pages_on(enum kv_cuda_copy_dir dir, void *const *dst, const void *const *src, int n,
                                size_t nbytes, void *stream, char *err, size_t errlen);
/* Splits (CTAs per page) the kernel uses for one page of nbytes in direction dir. */
int kv_cuda_copy_splits(enum kv_cuda_copy_dir dir, size_t nbytes);
/* Smallest host<->device page (bytes) that kv_cuda_copy_pages hands to the copy engines:
 * KVSERVE_CUDA_COPY_CE_MIN (bytes; 0 or malformed: never, the kernel for every size), default
 * 8 MiB. Read at each call; thread-safe. */
size_t kv_cuda_copy_engine_min(void);

/* ---- call counters (issue 10: no host syncs and no host->device scalar writes in the decode
 * loop; for tests) ----
 * Process-wide counts of the CUDA runtime calls made by this backend's code (every CUDA
 * backend and the page-copy / helper functions below, in every thread; relaxed atomics, so
 * a snapshot taken while other threads call in is not a consistent cut). Every such call in
 * src/backend/cuda goes through a counting wrapper (cuda_internal.h turns the raw names into
 * compile errors, so an uncounted call cannot be added). Not counted: work inside a graph
 * replay (its launch is counted once), calls cuBLAS makes internally, and calls that neither
 * synchronise, copy, set, allocate nor launch (cudaSetDevice, cudaGetLastError,
 * cudaPointerGetAttributes, stream create/destroy).
 *
 * A forward (backend.h) of T rows with L logit rows makes, by design:
 *   graphs (T <= 64 and KVSERVE_CUDA_GRAPHS != 0), graph already captured: graph_launches 1,
 *     d2h_copies 1 if L > 0 (the logits rows, one transfer), stream_syncs 1, and nothing else
 *     (the step's metadata -- tokens, positions, block tables -- is written by the host into a
 *     pinned buffer that the graph's own copy node uploads: no host->device copy call, no
 *     memset, no allocation);
 *   the first step of a new graph shape: in addition graph_instantiations 1, captured_copies 1
 *     (that metadata upload), captured_launches 10 * n_layers + 3 (the embedding; per layer
 *     2 norms, 4 GEMMs, q/k-norm + RoPE + KV store, attention, combine, SwiGLU; the output norm
 *     and head; 10 * n_layers + 1 when L == 0); growing scratch adds allocs / frees;
 *   no graph: h2d_copies 1 (metadata), launches 10 * n_layers + 3, d2h_copies 1 if L > 0,
 *     stream_syncs 1.
 *   A step whose attention runs without a combine launch makes 9 * n_layers + 3: all rows in
 *   prefill chunks (k_attn_flash), or single-token rows that k_attn_dec_tc serves (bf16 KV
 *   pool, GQA group <= 8, head_dim 64 or 128, at most 256 such rows, not deterministic: its
 *   combine is inside the kernel), and 8 * n_layers + 3 when every row is such a row (the
 *   q/k-norm + RoPE + KV store runs inside it too; KVSERVE_CUDA_QKV_FUSE=0: 9 * n_layers + 3);
 *   10 * n_layers + 3 when chunks are mixed with such rows and 11 * n_layers + 3 when mixed
 *   with rows of the split kernels + combine. A one-row step that the decode megakernel serves
 *   (kv_cuda_megakernel: bf16 KV pool) makes 4 launches: embedding, megakernel, output norm,
 *   head (2 when L == 0).
 * forward_sample: the same, except that the download is the sampling results (one d2h copy)
 *   and the sampling adds 2 launches (3 when a row needs sorted candidates: the radix sort's
 *   own launches are not counted); its requests travel with the step's metadata (no extra
 *   host->device copy).
 * copy_blocks / copy_to_host / copy_from_host: one stream_sync per call (per 64 MiB chunk when
 * bounced through the pinned staging buffer). */
struct kv_cuda_counters {
    uint64_t stream_syncs;         /* cudaStreamSynchronize */
    uint64_t sync_copies;          /* blocking cudaMemcpy (kv_cuda_memcpy) */
    uint64_t h2d_copies;           /* cudaMemcpyAsync host->device, issued by the host (not captured) */
    uint64_t d2h_copies;           /* cudaMemcpyAsync device->host, issued by the host */
    uint64_t other_copies;         /* cudaMemcpyAsync of another kind, issued by the host */
    uint64_t captured_copies;      /* cudaMemcpyAsync recorded into a graph being captured */
    uint64_t memsets;              /* cudaMemsetAsync */
    uint64_t allocs;               /* cudaMalloc, cudaHostAlloc */
    uint64_t frees;                /* cudaFree, cudaFreeHost */
    uint64_t launches;             /* our kernels and cuBLAS GEMM calls enqueued eagerly */
    uint64_t captured_launches;    /* the same, recorded into a graph being captured */
    uint64_t graph_instantiations; /* graphs captured and instantiated */
    uint64_t graph_launches;       /* cudaGraphLaunch */
};
/* Copies the counters (since process start) into *out. Thread-safe. */
void kv_cuda_counters_get(struct kv_cuda_counters *out);

/* 1 when the CUDA backend be runs one-row decode steps (bf16 weights and KV pool) with the
 * batch-1 decode megakernel (decode_mk.cuh: the model's shapes fit, not deterministic,
 * KVSERVE_CUDA_MK is not 0, the device launches cooperative grids), else 0. For tests and
 * benches; be must be a CUDA backend. */
int kv_cuda_megakernel(const backend_t *be);

/* One product Y[M,N] (f32, device) = X[M,K] W[N,K]^T (device; bf16, or f32 when f32w) as the
 * backend computes it: mode 1 the deterministic mode's batch-invariant kernel, mode 0 the
 * default mode's choice (k_gemv_bf16 for one bf16 row, else cuBLAS). For tests and benches;
 * synchronous (own stream). KV_EINVAL for a bad argument, KV_EIO for a CUDA failure. */
kv_status kv_cuda_gemm(int mode, int f32w, const void *X, int M, int K, const void *W, int N, float *Y, char *err,
                       size_t errlen);

/* Decode attention of T rows over one layer's paged K/V as the backend computes it, for
 * tests: mode 0 the split kernels (k_attn_part, split_len positions per part, + combine),
 * mode 1 the backend's k_attn_dec choice (k_attn_dec_tc for a bf16 pool, GQA group <= 8 and
 * hd 64 or 128, else k_attn_dec), mode 2 k_attn_dec (split_len positions per part; modes 1
 * and 2 launch twice, so the second launch checks that the counters were left zeroed). All pointers are device memory:
 * q (T, n_heads * hd) f32; pool (blocks of 2 * n_kv * tpb * hd elements: K heads then V
 * heads, each tpb rows of hd; bf16 when kv_bf16, else f32); row r attends to positions
 * 0..pos[r] through bt + bt_off[r]; out (T, n_heads * hd) f32. Synchronous (own stream).
 * KV_EINVAL for a bad argument (k_attn_dec: hd % 8, T > 256), KV_EIO for a CUDA failure. */
kv_status kv_cuda_attn_decode(int mode, int kv_bf16, int T, int n_heads, int n_kv, int hd, int tpb, const int32_t *pos,
                              const int32_t *bt_off, const int32_t *bt, const float *q, const void *pool,
                              int split_len, float *out, char *err, size_t errlen);

/* Thin helpers for tests and benches (NULL / KV_EIO on failure; the error is logged). */
void *kv_cuda_malloc(size_t n);           /* device memory */
void kv_cuda_free(void *p);
void *kv_cuda_host_alloc(size_t n);       /* pinned, mapped host memory */
void kv_cuda_host_free(void *p);
kv_status kv_cuda_memcpy(void *dst, const void *src, size_t n); /* cudaMemcpy(Default), synchronous */

#ifdef __cplusplus
}
#endif
#endif
