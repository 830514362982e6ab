/*
 * Tensor-core paged attention for prefill / chunked-prefill steps (issue 10): the
 * FlashAttention-2 scheme (Dao, "FlashAttention-2: Faster Attention with Better Parallelism
 * and Work Partitioning", 2023: Q tile resident, loop over K/V tiles with an online softmax,
 * each warp owning 16 query rows so no inter-warp reduction is needed) on mma.sync
 * m16n8k16 with f32 accumulation, reading K/V through the block table.
 *
 * One CTA = one tile of up to FL_BM "M rows" x one KV head. A tile is up to
 * rpt = FL_BM / group consecutive rows of ONE sequence (consecutive positions pos0 ..
 * pos0 + nrows - 1); its M rows pack the group's query heads: M row m = query row m / group,
 * query head kvh * group + m % group (GQA: the K/V tile is read once for all heads of the
 * group). K/V tiles of FL_BN positions at absolute offsets 0, FL_BN, ... up to the tile's
 * last position, causal mask per element (key > row position: -inf).
 *
 * Element types: TK the pool's (bf16: K/V tiles arrive by cp.async, two stages; f32:
 * loaded, converted to fp16, one stage), TM the mma input type (bf16 for a bf16 pool; fp16
 * for an f32 pool: 11 significant bits instead of 8 for K, V, Q and P; values beyond
 * +-65504 are clamped). Q (f32 in the qkv buffer, after RoPE) is rounded to TM, the scores
 * S = Q K^T and the softmax statistics are f32, P is rounded to TM for the P V product, the
 * output sum and the normalisation are f32, the output is written as bf16 into out
 * (row r, head h: out[(r * n_heads + h) * hd + e], the layout k_attn_combine writes).
 *
 * head_dim: any multiple of 8 up to 128, computed as HDP = head_dim rounded up to 16 (the
 * padding columns of Q and K are zero in shared memory, so they add nothing to S; the
 * padding output columns are not written).
 *
 * Results do not depend on the other tiles (no split of the key range, no atomics) and a
 * row's result does not depend on which other rows share its tile: each score element is
 * one mma dot product, and the softmax state is per row. Not used in the deterministic
 * mode (that mode keeps one attention kernel for every step; see backend_cuda.h).
 */
#ifndef KV_CUDA_ATTN_FLASH_CUH
#define KV_CUDA_ATTN_FLASH_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FL_BM_OF(MT) (64 * (MT)) /* M rows per CTA: 4 warps x 16 MT */
#define FL_BN 64 /* key positions per K/V tile */
#define FL_WARPS 4

/* Shared memory of one CTA (bytes): Q tile + two stages of K and V tiles, rows of HDP + 8
 * elements (the 16-byte pad keeps ldmatrix free of bank conflicts). */
__host__ __device__ constexpr size_t fl_smem_bytes(int hdp, int mt) {
    return (size_t)(FL_BM_OF(mt) + 4 * FL_BN) * (hdp + 8) * 2;
}

__device__ __forceinline__ void fl_ldsm_x4(uint32_t r[4], const void *p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void fl_ldsm_x4_t(uint32_t r[4], const void *p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
/* c += a (16x16, row) * b (16x8, col), f32 accumulators */
__device__ __forceinline__ void fl_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void fl_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* two floats -> one 32-bit register of TM (lo = a: the lower column) */
__device__ __forceinline__ uint32_t fl_pack(float a, float b, __nv_bfloat16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *(uint32_t *)&v;
}
__device__ __forceinline__ uint32_t fl_pack(float a, float b, __half) {
    a = fminf(fmaxf(a, -65504.f), 65504.f), b = fminf(fmaxf(b, -65504.f), 65504.f);
    __half2 v = __floats2half2_rn(a, b);
    return *(uint32_t *)&v;
}
/* 2^x (MUFU.EX2; 2^-inf = 0) */
__device__ __forceinline__ float fl_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void fl_cp16(void *smem, const void *g, int src_bytes) {
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(g), "r"(src_bytes));
}

/* grid (n_tiles, n_kv), block 32 * FL_WARPS, dynamic shared memory fl_smem_bytes(HDP, MT).
 * MT: 16-row m tiles per warp (FL_BM = 64 MT M rows per CTA; each K/V fragment read from
 * shared memory feeds MT mma, and a K/V tile read from L2 serves FL_BM M rows).
 * tiles: (n_tiles) pairs (first row, row count); the rows of a pair belong to one sequence
 * and have consecutive positions. qkv: f32 rows of stride `stride` (q heads first, after
 * RoPE). scale_log2 = log2(e) / sqrt(head_dim). Other arguments as k_attn_part. */
template <int HDP, int MT, typename TK, typename TM>
__global__ void __launch_bounds__(32 * FL_WARPS)
    k_attn_flash(const float *__restrict__ qkv, int stride, const TK *__restrict__ pool, size_t block_floats,
                 int layer, int n_kv, int hd, int tpb, int group, const int32_t *__restrict__ row_pos,
                 const int32_t *__restrict__ row_bt, const int32_t *__restrict__ bt,
                 const int32_t *__restrict__ tiles, float scale_log2, __nv_bfloat16 *__restrict__ out) {
    constexpr int BM = FL_BM_OF(MT), LDS = HDP + 8, KT = HDP / 16, NS = FL_BN / 8, ND = HDP / 8;
    constexpr bool ASYNC = sizeof(TK) == 2; /* bf16 pool: cp.async, two stages */
    extern __shared__ __align__(128) unsigned char fl_smem[];
    TM *sQ = (TM *)fl_smem, *sK = sQ + BM * LDS, *sV = sK + 2 * FL_BN * LDS;
    pdl_trigger();
    pdl_wait();
    const int row0 = tiles[2 * blockIdx.x], nrows = tiles[2 * blockIdx.x + 1], kvh = blockIdx.y;
    const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
    const int mused = (BM / group) * group; /* M rows in use (rows of the tile x group) */
    const int pos0 = row_pos[row0], posmax = pos0 + nrows - 1;
    const int32_t *rbt = bt + row_bt[row0];
    const size_t koff = (((size_t)layer * 2 + 0) * n_kv + kvh) * (size_t)tpb * hd;
    const size_t voff = (((size_t)layer * 2 + 1) * n_kv + kvh) * (size_t)tpb * hd;
    const int n_kb = posmax / FL_BN + 1;

    /* padding columns hd..HDP of K (and V) stay zero: the loads below never write them */
    if (hd < HDP)
        for (int i = tid; i < 4 * FL_BN * (HDP - hd); i += blockDim.x) {
            int r = i / (HDP - hd), e = hd + i % (HDP - hd);
            sK[(size_t)r * LDS + e] = TM(0.f); /* sK and sV are contiguous: 4 * FL_BN rows */
        }
    auto load_kv = [&](int stage, int kb) {
        if (ASYNC) {
            const int cpr = hd / 8; /* 16-byte chunks per row */
            for (int i = tid; i < 2 * FL_BN * cpr; i += blockDim.x) {
                int isv = i >= FL_BN * cpr, rem = isv ? i - FL_BN * cpr : i, r = rem / cpr, ch = rem % cpr;
                int p = kb * FL_BN + r;
                bool ok = p <= posmax;
                const TK *src = ok ? pool + (size_t)rbt[p / tpb] * block_floats + (isv ? voff : koff) +
                                         (size_t)(p % tpb) * hd + ch * 8
                                   : pool;
                TM *dst = (isv ? sV : sK) + ((size_t)stage * FL_BN + r) * LDS + ch * 8;
                fl_cp16(dst, src, ok ? 16 : 0);
            }
        } else {
            const int cpr = hd / 4; /* float4 per row */
            const int n = 2 * FL_BN * cpr;
            for (int i0 = tid; i0 < n; i0 += 8 * blockDim.x) {
                float4 v[8];
#pragma unroll
                for (int u = 0; u < 8; u++) { /* 8 loads in flight before the first store */
                    int i = i0 + u * blockDim.x;
                    v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (i < n) {
                        int isv = i >= FL_BN * cpr, rem = isv ? i - FL_BN * cpr : i, r = rem / cpr, ch = rem % cpr;
                        int p = kb * FL_BN + r;
                        if (p <= posmax)
                            v[u] = *(const float4 *)(pool + (size_t)rbt[p / tpb] * block_floats + (isv ? voff : koff) +
                                                     (size_t)(p % tpb) * hd + ch * 4);
                    }
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    int i = i0 + u * blockDim.x;
                    if (i < n) {
                        int isv = i >= FL_BN * cpr, rem = isv ? i - FL_BN * cpr : i, r = rem / cpr, ch = rem % cpr;
                        uint2 pk = make_uint2(fl_pack(v[u].x, v[u].y, TM()), fl_pack(v[u].z, v[u].w, TM()));
                        *(uint2 *)((isv ? sV : sK) + ((size_t)stage * FL_BN + r) * LDS + ch * 4) = pk;
                    }
                }
            }
        }
    };
    if (ASYNC) {
        load_kv(0, 0);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    /* Q tile: M row m = (query row m / group, head kvh * group + m % group); the group's
     * heads are contiguous in the qkv row, so M rows i*group .. i*group+group-1 are one span */
    for (int i = tid; i < BM * (HDP / 4); i += blockDim.x) {
        int m = i / (HDP / 4), e = (i % (HDP / 4)) * 4, qi = m / group;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (m < mused && qi < nrows && e < hd)
            v = *(const float4 *)(qkv + (size_t)(row0 + qi) * stride + ((size_t)kvh * group + m % group) * hd + e);
        *(uint2 *)(sQ + (size_t)m * LDS + e) = make_uint2(fl_pack(v.x, v.y, TM()), fl_pack(v.z, v.w, TM()));
    }
    /* this thread's rows: m tile t, fragment rows lane/4 and lane/4 + 8 (h = 0, 1); padding
     * rows take the tile's last row (finite results, not written) */
    const int wm0 = w * 16 * MT; /* the warp's first M row */
    int pr[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int m = wm0 + t * 16 + lane / 4 + 8 * h, qi = m < mused ? m / group : nrows - 1;
            pr[t][h] = pos0 + (qi < nrows ? qi : nrows - 1);
        }
    const int wl = wm0 + 16 * MT - 1 < mused ? (wm0 + 16 * MT - 1) / group : nrows - 1;
    const int wmax = pos0 + (wl < nrows ? wl : nrows - 1); /* the warp's last position */
    const int wmin = pos0 + (wm0 / group < nrows ? wm0 / group : nrows - 1); /* and its first */
    const bool wact = wm0 < mused && wm0 / group < nrows;
    float o[MT][ND][4], mrow[MT][2], lrow[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++) {
        mrow[t][0] = mrow[t][1] = -INFINITY, lrow[t][0] = lrow[t][1] = 0.f;
#pragma unroll
        for (int j = 0; j < ND; j++) o[t][j][0] = o[t][j][1] = o[t][j][2] = o[t][j][3] = 0.f;
    }

    for (int kb = 0; kb < n_kb; kb++) {
        int stage = 0;
        if (ASYNC) {
            if (kb + 1 < n_kb) load_kv((kb + 1) & 1, kb + 1);
            asm volatile("cp.async.commit_group;\n" ::);
            asm volatile("cp.async.wait_group 1;\n" ::);
            stage = kb & 1;
        } else {
            load_kv(0, kb);
        }
        __syncthreads();
        if (wact && kb * FL_BN <= wmax) {
            const TM *k_s = sK + (size_t)stage * FL_BN * LDS, *v_s = sV + (size_t)stage * FL_BN * LDS;
            float s[MT][NS][4];
#pragma unroll
            for (int t = 0; t < MT; t++)
#pragma unroll
                for (int j = 0; j < NS; j++) s[t][j][0] = s[t][j][1] = s[t][j][2] = s[t][j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                uint32_t qf[MT][4];
#pragma unroll
                for (int t = 0; t < MT; t++)
                    fl_ldsm_x4(qf[t], sQ + (size_t)(wm0 + t * 16 + lane % 16) * LDS + kk * 16 + (lane / 16) * 8);
#pragma unroll
                for (int np = 0; np < NS / 2; np++) {
                    uint32_t b[4];
                    fl_ldsm_x4(b, k_s + (size_t)(np * 16 + lane % 8 + (lane / 16) * 8) * LDS + kk * 16 +
                                      ((lane / 8) % 2) * 8);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        fl_mma(s[t][2 * np], qf[t], b[0], b[1], TM());
                        fl_mma(s[t][2 * np + 1], qf[t], b[2], b[3], TM());
                    }
                }
            }
            /* causal mask (only a tile that reaches past the warp's first position needs it),
             * online softmax in the log2 domain: p = 2^(s * scale_log2 - m), m the running max
             * of s * scale_log2 (rows h = 0, 1 of a thread; a row's 4 threads are lanes
             * 4k .. 4k+3: reduced with xor 1, 2) */
            if ((kb + 1) * FL_BN - 1 > wmin) {
#pragma unroll
                for (int t = 0; t < MT; t++)
#pragma unroll
                    for (int j = 0; j < NS; j++)
#pragma unroll
                        for (int c = 0; c < 4; c++)
                            if (kb * FL_BN + j * 8 + (lane % 4) * 2 + (c & 1) > pr[t][c >> 1]) s[t][j][c] = -INFINITY;
            }
#pragma unroll
            for (int t = 0; t < MT; t++) {
                float mx[2] = {-INFINITY, -INFINITY}, corr[2], ms[2];
#pragma unroll
                for (int j = 0; j < NS; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) mx[c >> 1] = fmaxf(mx[c >> 1], s[t][j][c]);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                    /* finite: tile 0 holds position 0 <= every row */
                    float mn = fmaxf(mrow[t][h], mx[h] * scale_log2);
                    corr[h] = fl_exp2(mrow[t][h] - mn);
                    mrow[t][h] = mn;
                    ms[h] = -mn;
                }
                float rs[2] = {0.f, 0.f};
#pragma unroll
                for (int j = 0; j < NS; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        float p = fl_exp2(fmaf(s[t][j][c], scale_log2, ms[c >> 1]));
                        s[t][j][c] = p;
                        rs[c >> 1] += p;
                    }
#pragma unroll
                for (int h = 0; h < 2; h++) lrow[t][h] = lrow[t][h] * corr[h] + rs[h];
#pragma unroll
                for (int j = 0; j < ND; j++)
                    o[t][j][0] *= corr[0], o[t][j][1] *= corr[0], o[t][j][2] *= corr[1], o[t][j][3] *= corr[1];
            }
            /* O += P V: P's accumulator layout is the A layout of the next mma (two n8 tiles =
             * one k16 slice) */
#pragma unroll
            for (int kc = 0; kc < FL_BN / 16; kc++) {
                uint32_t pa[MT][4];
#pragma unroll
                for (int t = 0; t < MT; t++) {
                    pa[t][0] = fl_pack(s[t][2 * kc][0], s[t][2 * kc][1], TM());
                    pa[t][1] = fl_pack(s[t][2 * kc][2], s[t][2 * kc][3], TM());
                    pa[t][2] = fl_pack(s[t][2 * kc + 1][0], s[t][2 * kc + 1][1], TM());
                    pa[t][3] = fl_pack(s[t][2 * kc + 1][2], s[t][2 * kc + 1][3], TM());
                }
#pragma unroll
                for (int dp = 0; dp < ND / 2; dp++) {
                    uint32_t b[4];
                    fl_ldsm_x4_t(b, v_s + (size_t)(kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LDS + dp * 16 +
                                        (lane / 16) * 8);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        fl_mma(o[t][2 * dp], pa[t], b[0], b[1], TM());
                        fl_mma(o[t][2 * dp + 1], pa[t], b[2], b[3], TM());
                    }
                }
            }
        }
        __syncthreads(); /* every warp is done with this stage before it is loaded again */
    }
    if (ASYNC) asm volatile("cp.async.wait_group 0;\n" ::);
    if (!wact) return;
    const int n_heads = n_kv * group;
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float l = lrow[t][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float inv = 1.0f / l;
            int m = wm0 + t * 16 + lane / 4 + 8 * h, qi = m / group;
            if (m >= mused || qi >= nrows) continue;
            __nv_bfloat16 *orow = out + ((size_t)(row0 + qi) * n_heads + (size_t)kvh * group + m % group) * hd;
#pragma unroll
            for (int j = 0; j < ND; j++) {
                int e = j * 8 + (lane % 4) * 2;
                if (e < hd)
                    *(__nv_bfloat162 *)(orow + e) = __floats2bfloat162_rn(o[t][j][2 * h] * inv, o[t][j][2 * h + 1] * inv);
            }
        }
}

#endif
