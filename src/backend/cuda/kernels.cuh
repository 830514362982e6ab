/*
 * Kernels of the CUDA backend's forward (see backend_cuda.h for the data layout).
 * TA: the dtype of GEMM inputs (float or __nv_bfloat16, the weight dtype).
 * All reductions that the CPU backend does in double (RMSNorm) are done in double here too.
 */
#ifndef KV_CUDA_KERNELS_CUH
#define KV_CUDA_KERNELS_CUH

#include <cuda_bf16.h>
#include <stdint.h>

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

/* ---- forward ---- */

/* x[r] = emb[tok[r]] (f32). grid T, block 256. */
template <typename TW> __global__ void k_embed(const TW *emb, const int32_t *tok, float *x, int dim) {
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
/* Per row (grid T, block 32*QKV_WARPS): q/k bias, q/k RMSNorm (Qwen3), RoPE on q (in
 * place in qkv) and k; K and V stored into the row's block slot of the pool. One warp
 * per head; grid (T, ceil((n_heads + n_kv) / QKV_WARPS)). hd <= 256. TK: the KV pool's element
 * type (K/V rounded to it on store; block_floats counts elements). */
template <typename TK>
__global__ void __launch_bounds__(32 * QKV_WARPS)
    k_qkv_post(float *qkv, int stride, const float *bqkv, const float *qn, const float *kn, const float *inv_freq,
               const int32_t *row_pos, const int32_t *row_bt, const int32_t *bt, TK *pool, size_t block_floats,
               int layer, int n_heads, int n_kv, int hd, int tpb, float eps, int neox) {
    __shared__ float sh[QKV_WARPS][256];
    int r = blockIdx.x, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int pos = row_pos[r];
    float *row = qkv + (size_t)r * stride;
    int qw = n_heads * hd, kw = n_kv * hd, half = hd / 2;
    size_t blk = (size_t)bt[row_bt[r] + pos / tpb] * block_floats;
    for (int hh = blockIdx.y * QKV_WARPS + w; hh < n_heads + n_kv; hh += QKV_WARPS * gridDim.y) {
        bool isq = hh < n_heads;
        int off = isq ? hh * hd : qw + (hh - n_heads) * hd;
        const float *nw = isq ? qn : kn;
        double ss = 0;
        for (int e = lane; e < hd; e += 32) {
            float v = row[off + e];
            if (bqkv) v += bqkv[off + e];
            sh[w][e] = v;
            ss += (double)v * v;
        }
        if (nw) {
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            float inv = (float)(1.0 / sqrt(ss / hd + (double)eps));
            for (int e = lane; e < hd; e += 32) sh[w][e] = nw[e] * (sh[w][e] * inv);
        }
        __syncwarp();
        float *qdst = row + off;
        TK *kdst = pool + blk + ((((size_t)layer * 2 + 0) * n_kv + (isq ? 0 : hh - n_heads)) * tpb + pos % tpb) * hd;
        for (int i = lane; i < half; i += 32) {
            int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
            float x0 = sh[w][i0], x1 = sh[w][i1];
            float ang = (float)pos * inv_freq[i];
            float s, c;
            sincosf(ang, &s, &c);
            float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
            if (isq) qdst[i0] = y0, qdst[i1] = y1;
            else kv_st(kdst + i0, y0), kv_st(kdst + i1, y1);
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
/* Partial attention of one (row, head chunk, part): positions [z*split_len, min(pos+1,
 * (z+1)*split_len)) of the row's sequence, online softmax per warp, combined across warps.
 * Writes unnormalised acc (hd), max m and sum l per head into the part slot.
 * grid (T, n_heads / hc, max_parts), block 32*ATT_WARPS. DPL = ceil(hd / 32). */
template <int DPL, typename TK>
__global__ void __launch_bounds__(32 * ATT_WARPS)
    k_attn_part(const float *qkv, int stride, const TK *pool, size_t block_floats, int layer, int n_kv, int hd,
                int tpb, int group, int hc, const int32_t *row_pos, const int32_t *row_bt, const int32_t *bt,
                int split_len, int max_parts, float scale, float *part, float *part_ml) {
    extern __shared__ float smem[]; /* ATT_WARPS * hc * (hd + 2) */
    int r = blockIdx.x, h0 = blockIdx.y * hc, z = blockIdx.z;
    int pos = row_pos[r];
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
                 int split_len, int max_parts, float scale, float *part, float *part_ml) {
    extern __shared__ float smem[]; /* q: hc*hd | weights: ATT_WARPS*ATT_HC*32 | per warp: ATT_WARPS*hc*(hd+2) */
    int r = blockIdx.x, h0 = blockIdx.y * hc, z = blockIdx.z;
    int pos = row_pos[r];
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

/* out[r, h] = sum_z acc_z * e^(m_z - M) / sum_z l_z * e^(m_z - M). grid (T, n_heads), block hd. */
template <typename TA>
__global__ void k_attn_combine(const float *part, const float *part_ml, const int32_t *row_pos, int split_len,
                               int max_parts, int n_heads, int hd, TA *out) {
    int r = blockIdx.x, h = blockIdx.y, e = threadIdx.x;
    int nparts = row_pos[r] / split_len + 1;
    size_t slot0 = ((size_t)r * n_heads + h) * max_parts;
    float M = -INFINITY;
    for (int z = 0; z < nparts; z++) M = fmaxf(M, part_ml[(slot0 + z) * 2]);
    float L = 0.f, a = 0.f;
    for (int z = 0; z < nparts; z++) {
        float f = expf(part_ml[(slot0 + z) * 2] - M);
        L += part_ml[(slot0 + z) * 2 + 1] * f;
        if (e < hd) a += part[(slot0 + z) * hd + e] * f;
    }
    if (e < hd) out[((size_t)r * n_heads + h) * hd + e] = from_f32<TA>(a / L);
}

/* out[r, i] = silu(gu[r, i]) * gu[r, ffn + i]. */
template <typename TA> __global__ void k_swiglu(const float *gu, TA *out, int T, int ffn) {
    size_t n = (size_t)T * ffn;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / ffn, k = i % ffn;
        float g = gu[r * 2 * ffn + k], u = gu[r * 2 * ffn + ffn + k];
        out[i] = from_f32<TA>(g / (1.0f + expf(-g)) * u);
    }
}

/* Small-M product for decode: Y[M,N] (f32) = X[M,K] W[N,K]^T, bf16 X and W, f32
 * accumulation, M <= GEMV_MAXM, K % 8 == 0, 16-byte aligned rows. One warp per output
 * column n: each lane streams 16-byte pieces of W[n] (4 in flight), multiplies them with
 * the M rows of X (read through L1/L2), then a warp reduction per row. Each Y[m, n] is
 * computed in the same order whatever M is. grid ceil(N / GEMV_WARPS), block 32*GEMV_WARPS. */
#define GEMV_WARPS 8
#define GEMV_MAXM 8
template <int M>
__global__ void __launch_bounds__(32 * GEMV_WARPS)
    k_gemv_bf16(const __nv_bfloat16 *__restrict__ X, const __nv_bfloat16 *__restrict__ W, float *__restrict__ Y,
                int N, int K) {
    int n = blockIdx.x * GEMV_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N) return;
    const uint4 *w = (const uint4 *)(W + (size_t)n * K);
    int K8 = K / 8;
    float acc[M];
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
    for (int m = 0; m < M; m++) {
        float v = acc[m];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) Y[(size_t)m * N + n] = v;
    }
}

#endif
