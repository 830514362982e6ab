/*
 * Kernels of the CUDA backend's forward (see backend_cuda.h for the data layout).
 * TA: the dtype of GEMM inputs (float or __nv_bfloat16, the weight dtype).
 * All reductions that the CPU backend does in double (RMSNorm) are done in double here too.
 */
#ifndef KV_CUDA_KERNELS_CUH
#define KV_CUDA_KERNELS_CUH

#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

/* Batch-invariant attention split (deterministic mode, split_len argument 0): the positions
 * of a row at position pos are cut into parts of det_split_len(pos) positions: 128, doubled
 * while the row would have more than DET_MAX_PARTS parts. It depends only on the row's own
 * position, never on the batch. */
#define DET_MAX_PARTS 32
__host__ __device__ __forceinline__ int det_split_len(int pos) {
    int sl = 128;
    while (pos / sl + 1 > DET_MAX_PARTS) sl *= 2;
    return sl;
}

/* Programmatic dependent launch (sm_90; the host launches the forward's kernels with
 * cudaLaunchAttributeProgrammaticStreamSerialization unless KVSERVE_CUDA_PDL=0):
 * pdl_trigger() lets the next kernel of the stream start launching its CTAs now;
 * pdl_wait() blocks until every earlier kernel of the stream has completed and its writes
 * are visible. Every forward kernel calls pdl_wait() before it touches memory that an earlier
 * kernel writes or reads (only read-only weights may be read before it), so a kernel that
 * waits also orders everything before it transitively. Both are no-ops in a kernel launched
 * without the attribute. */
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

/* KV pool element access (TK: float or __nv_bfloat16; f32 arithmetic either way). */
__device__ __forceinline__ float kv_ld(const float *p) { return *p; }
__device__ __forceinline__ float kv_ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void kv_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void kv_st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
/* 4 consecutive elements; p 16-byte (f32) / 8-byte (bf16) aligned */
__device__ __forceinline__ float4 kv_ld4(const float *p) { return *(const float4 *)p; }
__device__ __forceinline__ float4 kv_ld4(const __nv_bfloat16 *p) {
    uint2 u = *(const uint2 *)p;
    float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&u.x);
    float2 b = __bfloat1622float2(*(const __nv_bfloat162 *)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ double block_sum_double(double v, double *sh /* >= 32 */) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = (blockDim.x + 31) / 32;
    __syncthreads(); /* sh may be in use by a previous call */
    if (l == 0) sh[w] = v;
    __syncthreads();
    double t = 0;
    for (int i = 0; i < nw; i++) t += sh[i];
    return t;
}

/* ---- weight conversion / generation ---- */

template <typename TW> __global__ void k_convert(TW *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f32<TW>(src[i]);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* dst[i] = mean + amp * u, u uniform in [-1, 1) from (seed, i). */
template <typename TW> __global__ void k_fill_random(TW *dst, size_t n, uint64_t seed, float mean, float amp) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = mix64(seed * 0x100000001b3ull ^ i);
        float u = (float)(h >> 40) * (1.0f / 8388608.0f) - 1.0f;
        dst[i] = from_f32<TW>(mean + amp * u);
    }
}

/* Fault injection (KVSERVE_CUDA_FAULT=sticky:N): a trap, which leaves the CUDA context
 * unusable (cudaErrorLaunchFailure on every later call), as a real illegal access would. */
static __global__ void k_trap() { __trap(); }

/* ---- forward ---- */

/* x[r] = emb[tok[r]] (f32). grid T, block 256. */
template <typename TW> __global__ void k_embed(const TW *emb, const int32_t *tok, float *x, int dim) {
    pdl_trigger();
    pdl_wait();
    const TW *e = emb + (size_t)tok[blockIdx.x] * dim;
    float *o = x + (size_t)blockIdx.x * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = to_f32(e[j]);
}

/* Output row i, input row r = rows ? rows[i] : i: v = x[r] + add[r] (add optional; written
 * back into x[r] when write_back), out[i] = w * (v * 1/sqrt(mean(v^2) + eps)).
 * grid n_out, block RMS_THREADS; one pass over x (values kept in registers) when
 * dim <= RMS_THREADS * RMS_MAXV, else a second read. */
#define RMS_THREADS 1024
#define RMS_MAXV 8
template <typename TA>
__global__ void __launch_bounds__(RMS_THREADS)
    k_add_rmsnorm(float *x, const float *add, const float *w, TA *out, int dim, float eps, const int32_t *rows,
                  int write_back) {
    __shared__ double sh[32];
    pdl_trigger();
    pdl_wait();
    int r = rows ? rows[blockIdx.x] : (int)blockIdx.x;
    float *xr = x + (size_t)r * dim;
    const float *ar = add ? add + (size_t)r * dim : nullptr;
    TA *o = out + (size_t)blockIdx.x * dim;
    bool cached = dim <= RMS_THREADS * RMS_MAXV;
    float v[RMS_MAXV];
    double ss = 0;
    if (cached) {
#pragma unroll
        for (int k = 0; k < RMS_MAXV; k++) {
            int j = threadIdx.x + k * RMS_THREADS;
            v[k] = 0.f;
            if (j < dim) v[k] = ar ? xr[j] + ar[j] : xr[j];
        }
#pragma unroll
        for (int k = 0; k < RMS_MAXV; k++) ss += (double)v[k] * v[k];
    } else {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            float t = ar ? xr[j] + ar[j] : xr[j];
            ss += (double)t * t;
        }
    }
    ss = block_sum_double(ss, sh);
    float inv = (float)(1.0 / sqrt(ss / dim + (double)eps));
    if (cached) {
#pragma unroll
        for (int k = 0; k < RMS_MAXV; k++) {
            int j = threadIdx.x + k * RMS_THREADS;
            if (j < dim) {
                if (write_back) xr[j] = v[k];
                o[j] = from_f32<TA>(w[j] * (v[k] * inv));
            }
        }
    } else {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            float t = ar ? xr[j] + ar[j] : xr[j];
            if (write_back) xr[j] = t; /* same thread read it above: no race */
            o[j] = from_f32<TA>(w[j] * (t * inv));
        }
    }
}

#define QKV_WARPS 4
/* One q or k head of a row, by a whole warp: sh[e] = src[e] (+ bias[e]), then with a norm
 * weight nw the head's RMSNorm (Qwen3 q/k-norm), then RoPE at position pos in place (pairs
 * (i, i + hd/2) when neox, else (2i, 2i + 1); angle pos * inv_freq[i]). hd <= 256; sh: hd
 * floats of shared memory. k_qkv_post and the fused path of k_attn_dec_tc both use it, so
 * their q and K are the same bits. */
__device__ __forceinline__ void qk_head(const float *src, const float *bias, const float *nw, const float *inv_freq,
                                        int pos, int hd, float eps, int neox, int lane, float *sh) {
    double ss = 0;
    for (int e = lane; e < hd; e += 32) {
        float v = __ldcg(src + e); /* written by other CTAs of the decode megakernel: not through L1 */
        if (bias) v += bias[e];
        sh[e] = v;
        ss += (double)v * v;
    }
    if (nw) {
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        float inv = (float)(1.0 / sqrt(ss / hd + (double)eps));
        for (int e = lane; e < hd; e += 32) sh[e] = nw[e] * (sh[e] * inv);
    }
    __syncwarp();
    const int half = hd / 2;
    for (int i = lane; i < half; i += 32) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = sh[i0], x1 = sh[i1];
        float ang = (float)pos * inv_freq[i];
        float s, c;
        sincosf(ang, &s, &c);
        sh[i0] = x0 * c - x1 * s, sh[i1] = x0 * s + x1 * c;
    }
    __syncwarp();
}

/* Per row (grid T, block 32*QKV_WARPS): q/k bias, q/k RMSNorm (Qwen3), RoPE on q (in
 * place in qkv) and k; K and V stored into the row's block slot of the pool. One warp
 * per head (qk_head); grid (T, ceil((n_heads + n_kv) / QKV_WARPS)). hd <= 256. TK: the KV
 * pool's element type (K/V rounded to it on store; block_floats counts elements). */
template <typename TK>
__global__ void __launch_bounds__(32 * QKV_WARPS)
    k_qkv_post(float *qkv, int stride, const float *bqkv, const float *qn, const float *kn, const float *inv_freq,
               const int32_t *row_pos, const int32_t *row_bt, const int32_t *bt, TK *pool, size_t block_floats,
               int layer, int n_heads, int n_kv, int hd, int tpb, float eps, int neox) {
    __shared__ float sh[QKV_WARPS][256];
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.x, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int pos = row_pos[r];
    float *row = qkv + (size_t)r * stride;
    int qw = n_heads * hd, kw = n_kv * hd;
    size_t blk = (size_t)bt[row_bt[r] + pos / tpb] * block_floats;
    for (int hh = blockIdx.y * QKV_WARPS + w; hh < n_heads + n_kv; hh += QKV_WARPS * gridDim.y) {
        bool isq = hh < n_heads;
        int off = isq ? hh * hd : qw + (hh - n_heads) * hd;
        qk_head(row + off, bqkv ? bqkv + off : nullptr, isq ? qn : kn, inv_freq, pos, hd, eps, neox, lane, sh[w]);
        float *qdst = row + off;
        TK *kdst = pool + blk + ((((size_t)layer * 2 + 0) * n_kv + (isq ? 0 : hh - n_heads)) * tpb + pos % tpb) * hd;
        for (int e = lane; e < hd; e += 32) {
            if (isq) qdst[e] = sh[w][e];
            else kv_st(kdst + e, sh[w][e]);
        }
        __syncwarp();
    }
    /* V */
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < kw; i += blockDim.x * gridDim.y) {
        float v = row[qw + kw + i];
        if (bqkv) v += bqkv[qw + kw + i];
        int h = i / hd, e = i % hd;
        kv_st(pool + blk + ((((size_t)layer * 2 + 1) * n_kv + h) * tpb + pos % tpb) * hd + e, v);
    }
}

#define ATT_WARPS 4
#define ATT_HC 8 /* max query heads per CTA */
/* rows: NULL (grid.x = the step's rows) or the list of rows to compute (grid.x entries: the
 * single-token rows of a step whose prefill rows run k_attn_flash).
 * Partial attention of one (row, head chunk, part): positions [z*split_len, min(pos+1,
 * (z+1)*split_len)) of the row's sequence, online softmax per warp, combined across warps.
 * Writes unnormalised acc (hd), max m and sum l per head into the part slot.
 * grid (T, n_heads / hc, max_parts), block 32*ATT_WARPS. DPL = ceil(hd / 32). */
template <int DPL, typename TK>
__global__ void __launch_bounds__(32 * ATT_WARPS)
    k_attn_part(const float *qkv, int stride, const TK *pool, size_t block_floats, int layer, int n_kv, int hd,
                int tpb, int group, int hc, const int32_t *row_pos, const int32_t *row_bt, const int32_t *bt,
                const int32_t *rows, int split_len, int max_parts, float scale, float *part, float *part_ml) {
    extern __shared__ float smem[]; /* ATT_WARPS * hc * (hd + 2) */
    pdl_trigger();
    pdl_wait();
    int r = rows ? rows[blockIdx.x] : (int)blockIdx.x, h0 = blockIdx.y * hc, z = blockIdx.z;
    int pos = row_pos[r];
    if (split_len <= 0) split_len = det_split_len(pos);
    int p_begin = z * split_len;
    if (p_begin > pos) return;
    int p_end = min(pos + 1, p_begin + split_len);
    int kvh = h0 / group;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    float q[ATT_HC][DPL], acc[ATT_HC][DPL], m[ATT_HC], l[ATT_HC];
    const float *qr = qkv + (size_t)r * stride;
#pragma unroll
    for (int g = 0; g < ATT_HC; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            int e = lane + 32 * j;
            q[g][j] = (g < hc && e < hd) ? qr[(h0 + g) * hd + e] : 0.f;
            acc[g][j] = 0.f;
        }
    }
    const int32_t *rbt = bt + row_bt[r];
    size_t koff = (((size_t)layer * 2 + 0) * n_kv + kvh) * tpb * hd;
    size_t voff = (((size_t)layer * 2 + 1) * n_kv + kvh) * tpb * hd;
    float k[DPL], v[DPL]; /* software pipelined: the next position's K/V load while this one computes */
    auto load_kv = [&](int p, float *kk, float *vv) {
        const TK *base = pool + (size_t)rbt[p / tpb] * block_floats + (size_t)(p % tpb) * hd;
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            int e = lane + 32 * j;
            kk[j] = e < hd ? kv_ld(base + koff + e) : 0.f;
            vv[j] = e < hd ? kv_ld(base + voff + e) : 0.f;
        }
    };
    if (p_begin + w < p_end) load_kv(p_begin + w, k, v);
    for (int p = p_begin + w; p < p_end; p += ATT_WARPS) {
        float kn[DPL], vn[DPL];
        if (p + ATT_WARPS < p_end) load_kv(p + ATT_WARPS, kn, vn);
#pragma unroll
        for (int g = 0; g < ATT_HC; g++) {
            if (g >= hc) break;
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < DPL; j++) d += q[g][j] * k[j];
            for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            float s = d * scale;
            float mn = fmaxf(m[g], s);
            float corr = expf(m[g] - mn), pw = expf(s - mn);
            l[g] = l[g] * corr + pw;
#pragma unroll
            for (int j = 0; j < DPL; j++) acc[g][j] = acc[g][j] * corr + pw * v[j];
            m[g] = mn;
        }
#pragma unroll
        for (int j = 0; j < DPL; j++) k[j] = kn[j], v[j] = vn[j];
    }
    /* combine the warps */
    int W = hd + 2;
    for (int g = 0; g < hc && g < ATT_HC; g++) {
        float *s = smem + ((size_t)w * hc + g) * W;
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            int e = lane + 32 * j;
            if (e < hd) s[e] = acc[g][j];
        }
        if (lane == 0) s[hd] = m[g], s[hd + 1] = l[g];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hc * (hd + 2); i += blockDim.x) {
        int g = i / (hd + 2), e = i % (hd + 2);
        float M = -INFINITY;
        for (int ww = 0; ww < ATT_WARPS; ww++) M = fmaxf(M, smem[((size_t)ww * hc + g) * W + hd]);
        float val;
        if (e == hd) {
            val = M;
        } else {
            val = 0.f;
            for (int ww = 0; ww < ATT_WARPS; ww++) {
                const float *s = smem + ((size_t)ww * hc + g) * W;
                float f = s[hd + 1] > 0.f ? expf(s[hd] - M) : 0.f;
                val += (e == hd + 1 ? s[hd + 1] : s[e]) * f;
            }
        }
        size_t slot = ((size_t)r * (gridDim.y * hc) + h0 + g) * max_parts + z;
        if (e < hd) part[slot * hd + e] = val;
        else part_ml[slot * 2 + (e - hd)] = val;
    }
}

/* Partial attention, "a lane per position" variant (hd % 4 == 0, hd <= 128 * CH): for each
 * 32-position slice a warp computes all 32 scores at once (each lane its own position's q.k
 * over 16-byte K loads, q broadcast from shared memory), one max/sum reduction per slice,
 * then accumulates V with lanes owning 4 dims each (coalesced 16-byte loads). Same
 * part/combine format as k_attn_part; split_len a multiple of 32. */
template <int CH, typename TK>
__global__ void __launch_bounds__(32 * ATT_WARPS)
    k_attn_part2(const float *qkv, int stride, const TK *pool, size_t block_floats, int layer, int n_kv, int hd,
                 int tpb, int group, int hc, const int32_t *row_pos, const int32_t *row_bt, const int32_t *bt,
                 const int32_t *rows, int split_len, int max_parts, float scale, float *part, float *part_ml) {
    extern __shared__ float smem[]; /* q: hc*hd | weights: ATT_WARPS*ATT_HC*32 | per warp: ATT_WARPS*hc*(hd+2) */
    pdl_trigger();
    pdl_wait();
    int r = rows ? rows[blockIdx.x] : (int)blockIdx.x, h0 = blockIdx.y * hc, z = blockIdx.z;
    int pos = row_pos[r];
    if (split_len <= 0) split_len = det_split_len(pos);
    int p_begin = z * split_len;
    if (p_begin > pos) return;
    int p_end = min(pos + 1, p_begin + split_len);
    int kvh = h0 / group;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *qs = smem, *ws = smem + hc * hd, *red = ws + ATT_WARPS * ATT_HC * 32;
    const float *qr = qkv + (size_t)r * stride + (size_t)h0 * hd;
    for (int i = threadIdx.x; i < hc * hd; i += blockDim.x) qs[i] = qr[i];
    __syncthreads();
    const int32_t *rbt = bt + row_bt[r];
    size_t koff = (((size_t)layer * 2 + 0) * n_kv + kvh) * tpb * hd;
    size_t voff = (((size_t)layer * 2 + 1) * n_kv + kvh) * tpb * hd;
    float m[ATT_HC], l[ATT_HC], acc[ATT_HC][CH][4];
#pragma unroll
    for (int g = 0; g < ATT_HC; g++) {
        m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
        for (int c = 0; c < CH; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[g][c][e] = 0.f;
    }
    float *wsw = ws + w * ATT_HC * 32;
    for (int base = p_begin + w * 32; base < p_end; base += 32 * ATT_WARPS) {
        int p = base + lane;
        bool valid = p < p_end;
        float sc[ATT_HC];
#pragma unroll
        for (int g = 0; g < ATT_HC; g++) sc[g] = 0.f;
        if (valid) {
            const TK *kr = pool + (size_t)rbt[p / tpb] * block_floats + koff + (size_t)(p % tpb) * hd;
            for (int d4 = 0; d4 < hd / 4; d4++) {
                float4 kv = kv_ld4(kr + 4 * d4);
#pragma unroll
                for (int g = 0; g < ATT_HC; g++) {
                    if (g < hc) {
                        float4 q = ((const float4 *)(qs + g * hd))[d4];
                        sc[g] += q.x * kv.x + q.y * kv.y + q.z * kv.z + q.w * kv.w;
                    }
                }
            }
        }
        int nvalid = min(32, p_end - base);
#pragma unroll
        for (int g = 0; g < ATT_HC; g++) {
            if (g >= hc) break;
            float s = valid ? sc[g] * scale : -INFINITY;
            float mx = s;
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float mn = fmaxf(m[g], mx);
            float pw = valid ? expf(s - mn) : 0.f;
            float sum = pw;
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            float corr = expf(m[g] - mn);
            l[g] = l[g] * corr + sum;
            m[g] = mn;
#pragma unroll
            for (int c = 0; c < CH; c++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[g][c][e] *= corr;
            wsw[g * 32 + lane] = pw;
        }
        __syncwarp();
        for (int j = 0; j < nvalid; j++) {
            int pj = base + j;
            const TK *vr = pool + (size_t)rbt[pj / tpb] * block_floats + voff + (size_t)(pj % tpb) * hd;
#pragma unroll
            for (int c = 0; c < CH; c++) {
                int d = c * 128 + lane * 4;
                if (d < hd) {
                    float4 vv = kv_ld4(vr + d);
#pragma unroll
                    for (int g = 0; g < ATT_HC; g++) {
                        if (g < hc) {
                            float pj_w = wsw[g * 32 + j];
                            acc[g][c][0] += pj_w * vv.x, acc[g][c][1] += pj_w * vv.y;
                            acc[g][c][2] += pj_w * vv.z, acc[g][c][3] += pj_w * vv.w;
                        }
                    }
                }
            }
        }
        __syncwarp();
    }
    /* combine the warps (same as k_attn_part) */
    int W = hd + 2;
    for (int g = 0; g < hc && g < ATT_HC; g++) {
        float *sp = red + ((size_t)w * hc + g) * W;
#pragma unroll
        for (int c = 0; c < CH; c++) {
            int d = c * 128 + lane * 4;
            if (d < hd) {
#pragma unroll
                for (int e = 0; e < 4; e++) sp[d + e] = acc[g][c][e];
            }
        }
        if (lane == 0) sp[hd] = m[g], sp[hd + 1] = l[g];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hc * (hd + 2); i += blockDim.x) {
        int g = i / (hd + 2), e = i % (hd + 2);
        float M = -INFINITY;
        for (int ww = 0; ww < ATT_WARPS; ww++) M = fmaxf(M, red[((size_t)ww * hc + g) * W + hd]);
        float val;
        if (e == hd) {
            val = M;
        } else {
            val = 0.f;
            for (int ww = 0; ww < ATT_WARPS; ww++) {
                const float *sp = red + ((size_t)ww * hc + g) * W;
                float f = sp[hd + 1] > 0.f ? expf(sp[hd] - M) : 0.f;
                val += (e == hd + 1 ? sp[hd + 1] : sp[e]) * f;
            }
        }
        size_t slot = ((size_t)r * (gridDim.y * hc) + h0 + g) * max_parts + z;
        if (e < hd) part[slot * hd + e] = val;
        else part_ml[slot * 2 + (e - hd)] = val;
    }
}

/* out[r, h] = sum_z acc_z * e^(m_z - M) / sum_z l_z * e^(m_z - M). grid (T, n_heads), block
 * hd rounded up to 32 (<= 1024), dynamic shared memory max_parts floats. The part weights
 * e^(m_z - M) are computed once per part (in parallel) into shared memory, M and the sum of
 * l_z * w_z by fixed-shape block reductions (the order depends only on the row's part count),
 * then each thread sums its dimension over the parts with 4 independent loads in flight. */
__device__ __forceinline__ float block_reduce_f(float v, float *sh /* >= 32 */, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = (blockDim.x + 31) / 32;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    float t = sh[0];
    for (int i = 1; i < nw; i++) t = is_max ? fmaxf(t, sh[i]) : t + sh[i];
    return t;
}
template <typename TA>
__global__ void k_attn_combine(const float *part, const float *part_ml, const int32_t *row_pos, const int32_t *rows,
                               int split_len,
                               int max_parts, int n_heads, int hd, TA *out) {
    extern __shared__ float cw[]; /* max_parts part weights */
    __shared__ float red[32];
    pdl_trigger();
    pdl_wait();
    int r = rows ? rows[blockIdx.x] : (int)blockIdx.x, h = blockIdx.y, e = threadIdx.x;
    int nparts = row_pos[r] / (split_len > 0 ? split_len : det_split_len(row_pos[r])) + 1;
    size_t slot0 = ((size_t)r * n_heads + h) * max_parts;
    float M = -INFINITY;
    for (int z = threadIdx.x; z < nparts; z += blockDim.x) M = fmaxf(M, part_ml[(slot0 + z) * 2]);
    M = block_reduce_f(M, red, true);
    float L = 0.f;
    for (int z = threadIdx.x; z < nparts; z += blockDim.x) {
        float f = expf(part_ml[(slot0 + z) * 2] - M);
        cw[z] = f;
        L += part_ml[(slot0 + z) * 2 + 1] * f;
    }
    L = block_reduce_f(L, red, false); /* its barriers also publish cw */
    if (e >= hd) return;
    const float *pp = part + slot0 * hd + e;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int z = 0;
    for (; z + 3 < nparts; z += 4) {
        float p0 = pp[(size_t)z * hd], p1 = pp[(size_t)(z + 1) * hd], p2 = pp[(size_t)(z + 2) * hd],
              p3 = pp[(size_t)(z + 3) * hd];
        a0 += p0 * cw[z], a1 += p1 * cw[z + 1], a2 += p2 * cw[z + 2], a3 += p3 * cw[z + 3];
    }
    for (; z < nparts; z++) a0 += pp[(size_t)z * hd] * cw[z];
    out[((size_t)r * n_heads + h) * hd + e] = from_f32<TA>(((a0 + a1) + (a2 + a3)) / L);
}

/* Four consecutive activations o[0..3] = a, b, c, d in TA (one 16- or 8-byte store; o aligned). */
__device__ __forceinline__ void st4(float *o, float a, float b, float c, float d) { *(float4 *)o = make_float4(a, b, c, d); }
__device__ __forceinline__ void st4(__nv_bfloat16 *o, float a, float b, float c, float d) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
    uint2 u;
    u.x = *(const uint32_t *)&lo, u.y = *(const uint32_t *)&hi;
    *(uint2 *)o = u;
}
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* out[r, i] = silu(gu[r, i]) * gu[r, ffn + i] (gu rows of 2 ffn f32, out rows of ffn TA).
 * grid (ceil(ffn / (4 SWIGLU_THREADS)), min(T, 65535)), block SWIGLU_THREADS: thread i0 =
 * 4 (blockIdx.x * blockDim.x + threadIdx.x) does i0 .. i0 + 3 of rows blockIdx.y + gridDim.y j,
 * by float4 loads and one store when ffn % 4 == 0. Index math stays 32-bit within a row: one
 * 64-bit division per element (the first version) made it issue-bound, 269 us per layer at 4096
 * rows on the H200. The same expression per element either way, so the same bits. */
#define SWIGLU_THREADS 256
template <typename TA> __global__ void __launch_bounds__(SWIGLU_THREADS) k_swiglu(const float *gu, TA *out, int T, int ffn) {
    pdl_trigger();
    pdl_wait();
    const int i0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i0 >= ffn) return;
    const bool vec = ffn % 4 == 0;
    for (int r = blockIdx.y; r < T; r += gridDim.y) {
        const float *g = gu + (size_t)r * 2 * ffn, *u = g + ffn;
        TA *o = out + (size_t)r * ffn;
        if (vec) {
            float4 gv = *(const float4 *)(g + i0), uv = *(const float4 *)(u + i0);
            st4(o + i0, silu_mul(gv.x, uv.x), silu_mul(gv.y, uv.y), silu_mul(gv.z, uv.z), silu_mul(gv.w, uv.w));
        } else {
            for (int e = i0; e < i0 + 4 && e < ffn; e++) o[e] = from_f32<TA>(silu_mul(g[e], u[e]));
        }
    }
}

#define GEMV_WARPS 8
#define GEMV_MAXM 8
/* One output column of the small-M product, computed by one warp: acc[m] = X[m] . w for the
 * M rows of X (bf16, K % 8 == 0, 16-byte aligned), f32 accumulation. Each lane streams the
 * 16-byte pieces lane, lane + 32, ... of w, 4 in flight, multiplies them with the rows of X
 * (read through L1/L2), then a warp reduction: on return every lane holds the sums. The order
 * of the operations depends on K only, never on M. */
template <int M>
__device__ __forceinline__ void gemv_col(const __nv_bfloat16 *__restrict__ X, const uint4 *__restrict__ w, int K,
                                         int lane, float acc[M]) {
    int K8 = K / 8;
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.f;
    int i = lane;
    for (; i + 3 * 32 < K8; i += 4 * 32) {
        uint4 wv[4];
#pragma unroll
        for (int u = 0; u < 4; u++) wv[u] = __ldcs(w + i + u * 32); /* streamed once: evict first */
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const __nv_bfloat162 *wp = (const __nv_bfloat162 *)&wv[u];
            float2 wf[4];
#pragma unroll
            for (int q = 0; q < 4; q++) wf[q] = __bfloat1622float2(wp[q]);
#pragma unroll
            for (int m = 0; m < M; m++) {
                uint4 xv = __ldg((const uint4 *)(X + (size_t)m * K) + i + u * 32);
                const __nv_bfloat162 *xp = (const __nv_bfloat162 *)&xv;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float2 xf = __bfloat1622float2(xp[q]);
                    acc[m] = fmaf(wf[q].x, xf.x, acc[m]);
                    acc[m] = fmaf(wf[q].y, xf.y, acc[m]);
                }
            }
        }
    }
    for (; i < K8; i += 32) {
        uint4 wv = __ldcs(w + i);
        const __nv_bfloat162 *wp = (const __nv_bfloat162 *)&wv;
#pragma unroll
        for (int m = 0; m < M; m++) {
            uint4 xv = __ldg((const uint4 *)(X + (size_t)m * K) + i);
            const __nv_bfloat162 *xp = (const __nv_bfloat162 *)&xv;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float2 wf = __bfloat1622float2(wp[q]), xf = __bfloat1622float2(xp[q]);
                acc[m] = fmaf(wf.x, xf.x, acc[m]);
                acc[m] = fmaf(wf.y, xf.y, acc[m]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++)
        for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
}

/* Small-M product for decode: Y[M,N] (f32) = X[M,K] W[N,K]^T, bf16 X and W, f32
 * accumulation, M <= GEMV_MAXM: one warp per output column n (gemv_col), so Y[m, n] is
 * computed in the same order whatever M is. grid ceil(N / GEMV_WARPS), block 32*GEMV_WARPS.
 * late: the programmatic-launch trigger after the CTA's products instead of at its start (the
 * next kernel's CTAs, launched early, would share the SMs with the stream of W: H200, Llama-3-8B
 * batch 1 / 512, 4.77 -> 4.44 ms per step).
 * (Tried on the H200 and not kept, 2026-12-02, Llama-3-8B step at batch 1 / 512, 5.02-5.04 ms
 * with this kernel: two 8-piece stages per lane with the first loaded before pdl_wait, 5.9 ms
 * at 96 registers; each column cut into 2-8 K parts for more CTAs, 5.1-6.3 ms; the gate/up
 * product and SwiGLU in one kernel (same bits), 5.06 vs 5.03 ms.) */
template <int M>
__global__ void __launch_bounds__(32 * GEMV_WARPS)
    k_gemv_bf16(const __nv_bfloat16 *__restrict__ X, const __nv_bfloat16 *__restrict__ W, float *__restrict__ Y,
                int N, int K, int late) {
    if (!late) pdl_trigger();
    pdl_wait();
    int n = blockIdx.x * GEMV_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n < N) {
        float acc[M];
        gemv_col<M>(X, (const uint4 *)(W + (size_t)n * K), K, lane, acc);
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < M; m++) Y[(size_t)m * N + n] = acc[m];
    }
    if (late) pdl_trigger();
}

/* ---- batch-invariant GEMM (deterministic mode) ----
 * Y[M,N] (f32) = X[M,K] W[N,K]^T, bf16 inputs, f32 accumulation on the tensor cores (wmma
 * 16x16x16, i.e. mma.sync m16n8k16). Element (m, n) is accumulated in one fp32 fragment
 * element, in the fixed order k = 0..15, 16..31, ... up to K rounded up to IG_BK (the
 * padding products are 0): the same instructions in the same order whatever M, the row's
 * tile or position in its tile, the tile shape (WM, WN, FM, FN, STAGES) or the batch. No
 * split-K. Tiles of BM = WM*FM*16 rows x BN = WN*FN*16 columns, one warp per WM x WN
 * sub-tile of FM x FN fragments; STAGES-deep cp.async pipeline over IG_BK-wide K slices
 * (rows past M / columns past N / K past K zero-filled). Needs K % 8 == 0 and 16-byte
 * aligned X and W (the host falls back to k_gemm_inv_scalar otherwise). */
#define IG_BK 64
#define IG_LD (IG_BK + 8) /* bf16 elements per shared-memory row (144 bytes: 16-byte aligned) */
__device__ __forceinline__ void ig_cp16(void *smem, const void *g, int src_bytes) {
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(g), "r"(src_bytes));
}
__device__ __forceinline__ void ig_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void ig_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int WM, int WN, int FM, int FN, int STAGES> struct ig_cfg {
    static constexpr int BM = WM * FM * 16, BN = WN * FN * 16, NT = WM * WN * 32;
    static constexpr size_t pipe_bytes = (size_t)STAGES * (BM + BN) * IG_LD * 2;
    static constexpr size_t c_bytes = (size_t)BM * (BN + 4) * 4;
    static constexpr size_t smem = pipe_bytes > c_bytes ? pipe_bytes : c_bytes;
};

template <int WM, int WN, int FM, int FN, int STAGES>
__global__ void __launch_bounds__(WM *WN * 32)
    k_gemm_inv(const __nv_bfloat16 *__restrict__ X, const __nv_bfloat16 *__restrict__ W, float *__restrict__ Y,
               int M, int N, int K) {
    using namespace nvcuda;
    typedef ig_cfg<WM, WN, FM, FN, STAGES> C;
    constexpr int BM = C::BM, BN = C::BN, NT = C::NT, CH = IG_BK / 8; /* 16-byte chunks per row slice */
    extern __shared__ __align__(128) unsigned char ig_smem[];
    __nv_bfloat16 *sA = (__nv_bfloat16 *)ig_smem, *sB = sA + (size_t)STAGES * BM * IG_LD;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int warp = threadIdx.x / 32, wm = warp / WN, wn = warp % WN;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    const int nk = (K + IG_BK - 1) / IG_BK;
    auto load = [&](int stage, int kt) {
        const int k0 = kt * IG_BK;
        for (int i = threadIdx.x; i < (BM + BN) * CH; i += NT) {
            int row = i / CH, c8 = (i % CH) * 8, k = k0 + c8;
            const __nv_bfloat16 *src;
            __nv_bfloat16 *dst;
            bool ok;
            if (row < BM) {
                int gm = m0 + row;
                ok = gm < M && k < K;
                src = ok ? X + (size_t)gm * K + k : X;
                dst = sA + ((size_t)stage * BM + row) * IG_LD + c8;
            } else {
                int gn = n0 + row - BM;
                ok = gn < N && k < K;
                src = ok ? W + (size_t)gn * K + k : W;
                dst = sB + ((size_t)stage * BN + row - BM) * IG_LD + c8;
            }
            ig_cp16(dst, src, ok ? 16 : 0);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) load(s, s);
        ig_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        ig_wait<STAGES - 2>();
        __syncthreads(); /* slice kt is in; every warp is done with slice kt-1's stage */
        if (kt + STAGES - 1 < nk) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        ig_commit();
        const __nv_bfloat16 *a = sA + (size_t)(kt % STAGES) * BM * IG_LD, *b = sB + (size_t)(kt % STAGES) * BN * IG_LD;
#pragma unroll
        for (int kk = 0; kk < IG_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[FN];
#pragma unroll
            for (int i = 0; i < FM; i++) wmma::load_matrix_sync(fa[i], a + (size_t)((wm * FM + i) * 16) * IG_LD + kk, IG_LD);
#pragma unroll
            for (int j = 0; j < FN; j++) wmma::load_matrix_sync(fb[j], b + (size_t)((wn * FN + j) * 16) * IG_LD + kk, IG_LD);
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
    }
    ig_wait<0>();
    __syncthreads();
    float *cs = (float *)ig_smem; /* (BM, BN + 4) */
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
            wmma::store_matrix_sync(cs + (size_t)((wm * FM + i) * 16) * (BN + 4) + (wn * FN + j) * 16, acc[i][j], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int i = threadIdx.x; i < BM * BN; i += NT) {
        int r = i / BN, cc = i % BN;
        if (m0 + r < M && n0 + cc < N) Y[(size_t)(m0 + r) * N + n0 + cc] = cs[(size_t)r * (BN + 4) + cc];
    }
}

/* Batch-invariant fallback (f32 weights, or K % 8 != 0 / unaligned bf16): one thread per
 * element, k = 0..K-1 in order with fmaf. Slow; invariant by construction. */
template <typename TW>
__global__ void k_gemm_inv_scalar(const TW *__restrict__ X, const TW *__restrict__ W, float *__restrict__ Y, int M,
                                  int N, int K) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    for (int m = blockIdx.y; m < M; m += gridDim.y) {
        const TW *x = X + (size_t)m * K, *w = W + (size_t)n * K;
        float acc = 0.f;
        for (int k = 0; k < K; k++) acc = fmaf(to_f32(x[k]), to_f32(w[k]), acc);
        Y[(size_t)m * N + n] = acc;
    }
}

#endif
