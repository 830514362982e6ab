/*
 * Decode attention for single-token rows over the paged KV pool: split-K ("flash-decoding",
 * Dao et al. 2023), many positions in flight. Included by forward.cu only. Two kernels with the
 * same grid, parts and combine:
 *  - k_attn_dec_tc (the backend's choice: bf16 pool, GQA group <= 8, head_dim 64 / 128): the
 *    products on the tensor cores (mma.sync), see its comment below;
 *  - k_attn_dec (SIMT; any head_dim % 8 == 0, f32 or bf16 pool): KVSERVE_CUDA_DEC_TC=0 and
 *    tests only, since it is issue-bound (docs/benchmarks.md).
 *
 * One CTA = (row, KV head, part of the row's positions). It serves every query head of the KV
 * head's GQA group, so each K/V byte is read once per row. Each tile of DEC_TILE positions
 * arrives by cp.async, 16 bytes per copy, straight from the block table (all copies of a tile
 * in flight at once, the next tiles issued before this one is used: no per-position
 * dependency chain), then from shared memory: scores, an online softmax per head (one warp per
 * head, exp2, q pre-scaled by log2(e)/sqrt(hd)) and P.V. A part writes its unnormalised
 * output, max and sum in the split kernels' part format (m and l in log2 units); the last CTA
 * of a (row, KV head) to finish (a counter, reset by that CTA for the next launch) combines
 * the parts (dec_last_combine) and writes the attention output. A row with one part writes
 * its output directly.
 *
 * k_attn_dec's shared memory (dec_smem_bytes): q (G * hd f32) | S (G * DEC_TILE f32) | ml
 * (3 G f32) | 2 stages x {K, V} x DEC_TILE rows of hd * sizeof(TK) + 16 bytes (the 16-byte pad
 * keeps the row-per-thread K reads of a quarter warp on distinct banks), reused by the combine
 * for the parts' weights (max_parts * G f32).
 */
#ifndef KV_CUDA_ATTN_DECODE_CUH
#define KV_CUDA_ATTN_DECODE_CUH

#include "kernels.cuh"
#include "attn_flash.cuh" /* fl_mma, fl_pack */

#define DEC_THREADS 128
#define DEC_TILE 32 /* positions per tile (= warp size: the softmax keeps one per lane) */

__host__ __device__ constexpr size_t dec_row_bytes(int hd, int tk_size) { return (size_t)hd * tk_size + 16; }
/* Dynamic shared memory of k_attn_dec for GQA group G, head_dim hd, pool element size tk_size
 * and max_parts parts per row. */
__host__ __device__ inline size_t dec_smem_bytes(int G, int hd, int tk_size, int max_parts) {
    size_t head = ((size_t)G * hd + (size_t)G * DEC_TILE + 3 * (size_t)G) * sizeof(float);
    head = (head + 15) / 16 * 16;
    size_t bufs = 2 * 2 * DEC_TILE * dec_row_bytes(hd, tk_size), comb = (size_t)max_parts * G * sizeof(float);
    return head + (bufs > comb ? bufs : comb);
}

__device__ __forceinline__ float dec_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void dec_cp16(void *smem, const void *g) {
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g));
}
/* The barrier of one decode-attention CTA's DEC_THREADS threads (named barrier 1): the same as
 * __syncthreads in the kernels below, and usable by the first DEC_THREADS threads of a larger
 * CTA (the batch-1 decode megakernel, decode_mk.cuh) while its other threads do other work. */
__device__ __forceinline__ void dec_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(DEC_THREADS) : "memory"); }
/* 8 consecutive pool elements from shared memory (16-byte aligned) as f32 */
__device__ __forceinline__ void dec_ld8(const __nv_bfloat16 *p, float o[8]) {
    uint4 u = *(const uint4 *)p;
    const __nv_bfloat162 *b = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(b[i]);
        o[2 * i] = f.x, o[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void dec_ld8(const float *p, float o[8]) {
    float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
    o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}

/* One head's online-softmax step over a tile (called by a whole warp; lane = position):
 * score sc (log2 units, -inf past the tile's n valid positions), state m = ml[0], l = ml[1]
 * updated by lane 0 (after every lane read ml[0]), the old-state factor into *cr; returns
 * this lane's probability 2^(sc - m_new) (0 past n). */
__device__ __forceinline__ float dec_softmax_step(float sc, int lane, int n, float *ml, float *cr) {
    float mx = sc;
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float mo = ml[0], mn = fmaxf(mo, mx);
    float pw = lane < n ? dec_exp2(sc - mn) : 0.f, sum = pw;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    float corr = mo == -INFINITY ? 0.f : dec_exp2(mo - mn);
    __syncwarp();
    if (lane == 0) ml[0] = mn, ml[1] = ml[1] * corr + sum, *cr = corr;
    return pw;
}

/* A part CTA's start: the programmatic-launch trigger (unless late_trigger) and wait, then the
 * positions it covers: [p_begin, p_end) of row r (at position pos) and its row's part count
 * nparts; false when the part is past the row's end (the CTA exits). */
struct dec_span {
    int r, pos, p_begin, p_end, nparts;
};
__device__ __forceinline__ bool dec_begin(int late_trigger, const int32_t *rows, const int32_t *row_pos,
                                          int split_len, dec_span *sp) {
    if (!late_trigger) pdl_trigger();
    pdl_wait();
    sp->r = rows ? rows[blockIdx.x] : (int)blockIdx.x;
    sp->pos = row_pos[sp->r];
    sp->p_begin = blockIdx.z * split_len;
    if (sp->p_begin > sp->pos) return false;
    sp->p_end = min(sp->pos + 1, sp->p_begin + split_len), sp->nparts = sp->pos / split_len + 1;
    return true;
}

/* After every thread of the CTA wrote its part (slots of row r, heads kvh * G ..): counts the
 * part in *cnt; the last of the row's nparts parts resets *cnt and writes the combined output
 * out[r, h, :] = sum_z part_z * 2^(m_z - M) / sum_z l_z 2^(m_z - M) (m in log2 units).
 * wz: shared scratch of nparts * G floats; cr: shared, >= G floats. Block-wide (barriers). */
template <typename TA>
__device__ __forceinline__ void dec_last_combine(int r, int kvh, int G, int hd, int nh, int nparts, int max_parts,
                                                 const float *part, const float *part_ml, unsigned *cnt, float *wz,
                                                 float *cr, TA *out) {
    __threadfence();
    dec_sync();
    __shared__ int last;
    const int t = threadIdx.x, w = t / 32, lane = t % 32, h0 = kvh * G;
    if (t == 0) {
        unsigned *c = cnt;
        last = atomicAdd(c, 1u) == (unsigned)nparts - 1;
        if (last) *c = 0; /* every part has counted: reset for the next launch */
    }
    dec_sync();
    if (!last) return;
    __threadfence();
    /* combine: weights 2^(m_z - M_g) into buf (z-major), 1 / sum_z l_z w_z into cr */
    for (int i = t; i < nparts * G; i += DEC_THREADS) {
        int zz = i / G, g = i % G;
        wz[i] = __ldcg(part_ml + (((size_t)r * nh + h0 + g) * max_parts + zz) * 2);
    }
    dec_sync();
    for (int g = w; g < G; g += DEC_THREADS / 32) {
        float M = -INFINITY;
        for (int zz = lane; zz < nparts; zz += 32) M = fmaxf(M, wz[zz * G + g]);
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float L = 0.f;
        for (int zz = lane; zz < nparts; zz += 32) {
            float f = dec_exp2(wz[zz * G + g] - M);
            wz[zz * G + g] = f;
            L += f * __ldcg(part_ml + (((size_t)r * nh + h0 + g) * max_parts + zz) * 2 + 1);
        }
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        if (lane == 0) cr[g] = 1.f / L;
    }
    dec_sync();
    const int hd4 = hd / 4;
    for (int it = t; it < G * hd4; it += DEC_THREADS) {
        int g = it / hd4, d0 = (it % hd4) * 4;
        const float *pp = part + ((size_t)r * nh + h0 + g) * max_parts * hd + d0;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int zz = 0; zz < nparts; zz += 16) { /* 16 loads in flight */
            float4 u[16];
#pragma unroll
            for (int j = 0; j < 16; j++)
                u[j] = zz + j < nparts ? __ldcg((const float4 *)(pp + (size_t)(zz + j) * hd)) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < 16; j++) {
                float f = zz + j < nparts ? wz[(zz + j) * G + g] : 0.f;
                a.x += f * u[j].x, a.y += f * u[j].y, a.z += f * u[j].z, a.w += f * u[j].w;
            }
        }
        float inv = cr[g];
        TA *o = out + ((size_t)r * nh + h0 + g) * hd + d0;
        o[0] = from_f32<TA>(a.x * inv), o[1] = from_f32<TA>(a.y * inv);
        o[2] = from_f32<TA>(a.z * inv), o[3] = from_f32<TA>(a.w * inv);
    }
}

/* grid (rows, n_kv, max_parts), block DEC_THREADS, dynamic shared memory dec_smem_bytes.
 * Positions of part z: [z * split_len, min(pos + 1, (z + 1) * split_len)); split_len a
 * multiple of DEC_TILE or DEC_TILE / 2 (any value > 0 works). Requires hd % 8 == 0 and
 * G * hd / 8 <= NI * DEC_THREADS. cnt: (gridDim.x * n_kv) zeroed counters (left zeroed).
 * sl2 = log2(e) / sqrt(hd). out: (rows of the step, n_heads * hd) in TA. late_trigger: the
 * programmatic-launch trigger after the tile loop instead of at the start (the dependent
 * kernel's CTAs, launched early, would share the SMs with the parts still loading). Other arguments as
 * k_attn_part (the part slots use the same layout; m and l are in log2 units here). */
template <typename TK, typename TA, int NI>
__global__ void __launch_bounds__(DEC_THREADS)
    k_attn_dec(const float *qkv, int stride, const TK *pool, size_t block_floats, int layer, int n_kv, int hd, int tpb,
               int G, const int32_t *row_pos, const int32_t *row_bt, const int32_t *bt, const int32_t *rows,
               int split_len, int max_parts, float sl2, float *part, float *part_ml, unsigned *cnt, TA *out,
               int late_trigger) {
    extern __shared__ __align__(16) unsigned char dsm[];
    dec_span sp;
    if (!dec_begin(late_trigger, rows, row_pos, split_len, &sp)) return;
    const int r = sp.r, p_begin = sp.p_begin, p_end = sp.p_end, nparts = sp.nparts;
    const int kvh = blockIdx.y, z = blockIdx.z, t = threadIdx.x;
    const int nh = n_kv * G, h0 = kvh * G;
    float *qs = (float *)dsm, *S = qs + G * hd, *ml = S + G * DEC_TILE, *cr = ml + 2 * G;
    size_t head = ((size_t)G * hd + (size_t)G * DEC_TILE + 3 * (size_t)G) * sizeof(float);
    unsigned char *buf = dsm + (head + 15) / 16 * 16;
    const int rb = (int)dec_row_bytes(hd, sizeof(TK)), cr16 = hd * (int)sizeof(TK) / 16;
    const size_t stage_bytes = 2 * DEC_TILE * (size_t)rb;

    const int32_t *rbt = bt + row_bt[r];
    const size_t koff = (((size_t)layer * 2 + 0) * n_kv + kvh) * tpb * hd;
    const size_t voff = (((size_t)layer * 2 + 1) * n_kv + kvh) * tpb * hd;
    /* issues the copies of the tile starting at position p0 into stage s (one commit group) */
    auto issue = [&](int p0, int s) {
        int n = min(DEC_TILE, p_end - p0), per = n * cr16;
        unsigned char *kb = buf + s * stage_bytes, *vb = kb + DEC_TILE * (size_t)rb;
        for (int i = t; i < 2 * per; i += DEC_THREADS) {
            int isv = i >= per, j = isv ? i - per : i, p = j / cr16, c = j % cr16;
            int ap = p0 + p;
            const TK *g = pool + (size_t)rbt[ap / tpb] * block_floats + (isv ? voff : koff) + (size_t)(ap % tpb) * hd;
            dec_cp16((isv ? vb : kb) + (size_t)p * rb + c * 16, (const unsigned char *)g + c * 16);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    issue(p_begin, 0);
    /* q of the group's heads, pre-scaled */
    const float *qr = qkv + (size_t)r * stride + (size_t)h0 * hd;
    for (int i = t; i < G * hd; i += DEC_THREADS) qs[i] = qr[i] * sl2;
    for (int g = t; g < G; g += DEC_THREADS) ml[2 * g] = -INFINITY, ml[2 * g + 1] = 0.f;
    const int items = G * hd / 8, hd8 = hd / 8;
    float acc[NI][8];
#pragma unroll
    for (int k = 0; k < NI; k++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[k][e] = 0.f;
    const int w = t / 32, lane = t % 32;

    int s = 0;
    for (int p0 = p_begin; p0 < p_end; p0 += DEC_TILE, s ^= 1) {
        int n = min(DEC_TILE, p_end - p0);
        if (p0 + DEC_TILE < p_end) {
            issue(p0 + DEC_TILE, s ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads();
        const unsigned char *kb = buf + s * stage_bytes, *vb = kb + DEC_TILE * (size_t)rb;
        /* scores: pair i = (head g, position p) */
        for (int i = t; i < G * DEC_TILE; i += DEC_THREADS) {
            int g = i / DEC_TILE, p = i % DEC_TILE;
            float d = -INFINITY;
            if (p < n) {
                const TK *kr = (const TK *)(kb + (size_t)p * rb);
                const float *q = qs + g * hd;
                float a0 = 0.f, a1 = 0.f;
                for (int c = 0; c < hd8; c++) {
                    float kf[8];
                    dec_ld8(kr + c * 8, kf);
                    float4 qa = *(const float4 *)(q + c * 8), qb = *(const float4 *)(q + c * 8 + 4);
                    a0 += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3];
                    a1 += qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                }
                d = a0 + a1;
            }
            S[i] = d;
        }
        __syncthreads();
        /* online softmax, one warp per head */
        for (int g = w; g < G; g += DEC_THREADS / 32)
            S[g * DEC_TILE + lane] = dec_softmax_step(S[g * DEC_TILE + lane], lane, n, ml + 2 * g, cr + g);
        __syncthreads();
        /* P.V: item = (head g, 8 dims) */
#pragma unroll
        for (int k = 0; k < NI; k++) {
            int it = t + k * DEC_THREADS;
            if (it < items) {
                int g = it / hd8, d0 = (it % hd8) * 8;
                float c = cr[g];
#pragma unroll
                for (int e = 0; e < 8; e++) acc[k][e] *= c;
                const float *pw = S + g * DEC_TILE;
                for (int p = 0; p < n; p++) {
                    float vf[8], wp = pw[p];
                    dec_ld8((const TK *)(vb + (size_t)p * rb) + d0, vf);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[k][e] += wp * vf[e];
                }
            }
        }
        __syncthreads(); /* the stage is refilled by the next iteration's issue */
    }
    if (late_trigger) pdl_trigger(); /* the next kernel's CTAs launch once every part is done loading */

    if (nparts == 1) { /* the whole row in this CTA */
#pragma unroll
        for (int k = 0; k < NI; k++) {
            int it = t + k * DEC_THREADS;
            if (it < items) {
                int g = it / hd8, d0 = (it % hd8) * 8;
                float inv = 1.f / ml[2 * g + 1];
                TA *o = out + ((size_t)r * nh + h0 + g) * hd + d0;
#pragma unroll
                for (int e = 0; e < 8; e++) o[e] = from_f32<TA>(acc[k][e] * inv);
            }
        }
        return;
    }
    /* this part into its slots */
#pragma unroll
    for (int k = 0; k < NI; k++) {
        int it = t + k * DEC_THREADS;
        if (it < items) {
            int g = it / hd8, d0 = (it % hd8) * 8;
            float *pp = part + (((size_t)r * nh + h0 + g) * max_parts + z) * hd + d0;
            *(float4 *)pp = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
            *(float4 *)(pp + 4) = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
        }
    }
    for (int g = t; g < G; g += DEC_THREADS) {
        float *pm = part_ml + (((size_t)r * nh + h0 + g) * max_parts + z) * 2;
        pm[0] = ml[2 * g], pm[1] = ml[2 * g + 1];
    }
    dec_last_combine<TA>(r, kvh, G, hd, nh, nparts, max_parts, part, part_ml, cnt + (size_t)blockIdx.x * n_kv + kvh,
                         (float *)buf, cr, out);
}

/* ---- tensor-core variant (bf16 pool, GQA group G <= 8, head_dim HD in {64, 128}) ----
 * Same grid, parts, combine and part format as k_attn_dec. Per tile the four warps compute
 * S = Q K^T (mma.sync m16n8k16: M = 16 query rows, one n tile of 8 positions per warp) and
 * O += P V (each warp HD / 32 n tiles of dims, K = the tile's 32 positions). Q and P enter the
 * bf16 products split in two: rows 0..7 hold bf16(x) and rows 8..15 bf16(x - bf16(x)) of head
 * g = row % 8 (rows of heads >= G are zero), and row g + row g + 8 of the f32 result is the
 * product with ~16 mantissa bits (K and V are bf16 already: exact), so the scores and the
 * output keep f32-like accuracy. The instruction count per K/V byte is a small fraction of
 * k_attn_dec's, which was issue-bound (ncu, H200: 0.45 warp instructions issued per cycle
 * per scheduler and 15% of DRAM bandwidth at batch 8, context 4096). The B fragments come
 * from shared memory by ldmatrix (K rows as stored; V transposed by ldmatrix.trans), and
 * each thread copies one position's chunks, so a tile costs one block-table lookup per
 * thread (per-chunk lookups with their divisions by tpb and the 16-bit V gathers made the
 * kernel issue-bound at long contexts: H200, batch 128 at 4096, 38.4 -> 30.0 ms a step). */
#define DTC_ROWB(HD) ((HD) * 2 + 16) /* bytes per K/V row in shared memory */
#define DTC_PST 40                   /* bf16 per P row in shared memory (32 + 8 pad) */
#define DTC_NS 3      /* K/V stages: DTC_NS - 1 tiles in flight while one is used */
#define DTC_MAXB 256  /* block ids of a part kept in shared memory (more: read from the table) */
__host__ __device__ inline size_t dec_tc_head_bytes() {
    size_t h = (size_t)(8 * DEC_TILE + 2 * 8 + 8) * sizeof(float) + 16 * DTC_PST * 2 + DTC_MAXB * sizeof(int32_t);
    return (h + 15) / 16 * 16;
}
__host__ __device__ inline size_t dec_tc_smem_bytes(int hd, int G, int max_parts, int ns = DTC_NS) {
    size_t bufs = (size_t)ns * 2 * DEC_TILE * DTC_ROWB(hd), comb = (size_t)max_parts * G * sizeof(float);
    return dec_tc_head_bytes() + (bufs > comb ? bufs : comb);
}

/* k_attn_dec_tc's fused q/k post-processing (on: k_qkv_post did not run for the step): the
 * kernel reads the raw q / k / v of its rows from qkv, applies qk_head to its q heads and, in
 * the CTA whose part holds the row's position, to its k head, and stores that K and V into the
 * pool (the bits k_qkv_post would have stored) before the part's tiles are copied. */
struct dec_qkv_t {
    const float *bqkv, *qn, *kn, *inv_freq;
    float eps;
    int neox, on;
};

/* k_attn_dec_tc's work for one (row bx, KV head kvh, part z) whose span sp dec_begin computed,
 * by threads t = 0 .. DEC_THREADS - 1 (dec_sync between them) on dsm (dec_tc_smem_bytes).
 * Reads the q / k / v rows with ld.global.cg (the megakernel's other CTAs write them in the
 * same launch: L1 is not coherent). */
template <int HD, typename TA, int NS = DTC_NS>
__device__ __forceinline__ void dec_tc_run(const dec_span &sp, int bx, int kvh, int z, int t, unsigned char *dsm,
                                           const float *qkv, int stride, __nv_bfloat16 *pool, size_t block_floats,
                                           int layer, int n_kv, int tpb, int G, const int32_t *row_bt,
                                           const int32_t *bt, int max_parts, float sl2, float *part, float *part_ml,
                                           unsigned *cnt, TA *out, int late_trigger, const dec_qkv_t &qp) {
    constexpr int RB = DTC_ROWB(HD), KS = HD / 16, NTW = HD / 32; /* k steps of S; dim n tiles per warp */
    const int r = sp.r, p_begin = sp.p_begin, p_end = sp.p_end, nparts = sp.nparts;
    const int nh = n_kv * G, h0 = kvh * G, w = t / 32, lane = t % 32, gi = lane / 4, ti = lane % 4;
    float *S = (float *)dsm, *ml = S + 8 * DEC_TILE, *cr = ml + 16;
    __nv_bfloat16 *Ps = (__nv_bfloat16 *)(cr + 8);
    int32_t *sbt = (int32_t *)(Ps + 16 * DTC_PST);
    unsigned char *buf = dsm + dec_tc_head_bytes();
    constexpr size_t stage_bytes = 2 * DEC_TILE * (size_t)RB;

    const int32_t *rbt = bt + row_bt[r];
    /* the part's block ids into shared memory (one round trip instead of one per tile) */
    const int b_first = p_begin / tpb, nblk = (p_end - 1) / tpb - b_first + 1;
    const bool sb = nblk <= DTC_MAXB;
    if (sb)
        for (int i = t; i < nblk; i += DEC_THREADS) sbt[i] = rbt[b_first + i];
    const size_t koff = (((size_t)layer * 2 + 0) * n_kv + kvh) * tpb * HD;
    const size_t voff = (((size_t)layer * 2 + 1) * n_kv + kvh) * tpb * HD;
    const float *qrow = qkv + (size_t)r * stride + (size_t)h0 * HD; /* the row's q of head h0 */
    /* fused: the G q heads and the k head (9 x HD floats), in the last K/V stage, which no copy
     * fills before the tile loop's first issue */
    float(*qks)[HD] = (float(*)[HD])(buf + (NS - 1) * stage_bytes);
    if (qp.on && p_end == sp.pos + 1) { /* this part holds the row's position: its K and V */
        const float *kr = qkv + (size_t)r * stride + (size_t)n_kv * G * HD + (size_t)kvh * HD;
        const float *vr = kr + (size_t)n_kv * HD;
        const size_t slot = (size_t)rbt[sp.pos / tpb] * block_floats + (size_t)(sp.pos % tpb) * HD;
        const int kb0 = n_kv * G * HD + kvh * HD, vb0 = kb0 + n_kv * HD;
        if (w == 0) {
            qk_head(kr, qp.bqkv ? qp.bqkv + kb0 : nullptr, qp.kn, qp.inv_freq, sp.pos, HD, qp.eps, qp.neox, lane,
                    qks[8]);
            for (int e = lane; e < HD; e += 32) kv_st(pool + slot + koff + e, qks[8][e]);
        } else {
            for (int e = t - 32; e < HD; e += DEC_THREADS - 32) {
                float v = __ldcg(vr + e);
                if (qp.bqkv) v += qp.bqkv[vb0 + e];
                kv_st(pool + slot + voff + e, v);
            }
        }
    }
    dec_sync(); /* block ids; the stored K / V row before the tiles are copied */
    constexpr int CR = HD * 2 / 16; /* 16-byte chunks per row */
    /* the tile at p0 into stage s: thread t copies position t / TPP's chunks t % TPP + TPP j
     * of its K row (positions < n) and V row (zero-filled past n: P is 0 there, and 0 * a
     * stale NaN would not be); one block-table lookup per thread; one commit group (empty
     * past the part) */
    constexpr int TPP = DEC_THREADS / DEC_TILE; /* threads per position */
    static_assert(CR % TPP == 0, "chunks per row");
    auto issue = [&](int p0, int s) {
        if (p0 < p_end) {
            const int p = t / TPP, ap = p0 + p, c0 = t % TPP;
            const bool real = ap < p_end;
            unsigned char *kd = buf + s * stage_bytes + (size_t)p * RB, *vd = kd + DEC_TILE * (size_t)RB;
            const unsigned char *g = (const unsigned char *)pool;
            if (real) {
                int blk = sb ? sbt[ap / tpb - b_first] : rbt[ap / tpb];
                g = (const unsigned char *)(pool + (size_t)blk * block_floats + (size_t)(ap % tpb) * HD);
            }
#pragma unroll
            for (int j = 0; j < CR / TPP; j++) {
                int c = c0 + TPP * j;
                if (real) {
                    unsigned sa = (unsigned)__cvta_generic_to_shared(kd + c * 16);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g + koff * 2 + c * 16));
                }
                unsigned sa = (unsigned)__cvta_generic_to_shared(vd + c * 16);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa),
                             "l"(real ? g + voff * 2 + c * 16 : g), "r"(real ? 16 : 0));
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
#pragma unroll
    for (int j = 0; j < NS - 1; j++) issue(p_begin + j * DEC_TILE, j);
    if (qp.on) { /* the G q heads, post-processed into shared memory */
        for (int g = w; g < G; g += DEC_THREADS / 32)
            qk_head(qrow + (size_t)g * HD, qp.bqkv ? qp.bqkv + (size_t)(h0 + g) * HD : nullptr, qp.qn, qp.inv_freq, sp.pos,
                    HD, qp.eps, qp.neox, lane, qks[g]);
        dec_sync();
    }
    /* A fragments of Q (rows gi: hi, gi + 8: lo, of head gi; zero for gi >= G), pre-scaled */
    uint32_t qa[KS][4];
    {
        const float *qr = qp.on ? qks[gi < 8 ? gi : 0] : qrow + (size_t)gi * HD;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            float v[4] = {0.f, 0.f, 0.f, 0.f};
            if (gi < G) {
                float2 x0 = *(const float2 *)(qr + ks * 16 + ti * 2), x1 = *(const float2 *)(qr + ks * 16 + ti * 2 + 8);
                v[0] = x0.x * sl2, v[1] = x0.y * sl2, v[2] = x1.x * sl2, v[3] = x1.y * sl2;
            }
            float hi[4], lo[4];
#pragma unroll
            for (int e = 0; e < 4; e++) hi[e] = __bfloat162float(__float2bfloat16_rn(v[e])), lo[e] = v[e] - hi[e];
            qa[ks][0] = fl_pack(hi[0], hi[1], __nv_bfloat16());
            qa[ks][1] = fl_pack(lo[0], lo[1], __nv_bfloat16());
            qa[ks][2] = fl_pack(hi[2], hi[3], __nv_bfloat16());
            qa[ks][3] = fl_pack(lo[2], lo[3], __nv_bfloat16());
        }
    }
    for (int i = t; i < 16 * DTC_PST; i += DEC_THREADS) Ps[i] = __float2bfloat16_rn(0.f);
    if (t < 8) ml[2 * t] = -INFINITY, ml[2 * t + 1] = 0.f, cr[t] = 0.f;
    float o[NTW][4];
#pragma unroll
    for (int i = 0; i < NTW; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    if (qp.on) dec_sync(); /* every fragment read qks before the first issue refills its stage */

    int s = 0;
    for (int p0 = p_begin; p0 < p_end; p0 += DEC_TILE, s = s + 1 == NS ? 0 : s + 1) {
        int n = min(DEC_TILE, p_end - p0);
        issue(p0 + (NS - 1) * DEC_TILE, s == 0 ? NS - 1 : s - 1);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(NS - 1) : "memory");
        dec_sync();
        const unsigned char *kb = buf + s * stage_bytes, *vb = kb + DEC_TILE * (size_t)RB;
        { /* S for positions 8w .. 8w + 7; B fragments of two k steps per ldmatrix.x4: lane l
           * points at position 8w + l % 8, dims 16 ks + 8 (l / 8) */
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            const unsigned char *krow = kb + (size_t)(8 * w + lane % 8) * RB + (lane / 8) * 16;
#pragma unroll
            for (int ks = 0; ks < KS; ks += 2) {
                uint32_t b[4];
                fl_ldsm_x4(b, krow + ks * 32);
                fl_mma(c, qa[ks], b[0], b[1], __nv_bfloat16());
                fl_mma(c, qa[ks + 1], b[2], b[3], __nv_bfloat16());
            }
            if (gi < G) {
                int p = 8 * w + ti * 2;
                S[gi * DEC_TILE + p] = p < n ? c[0] + c[2] : -INFINITY;
                S[gi * DEC_TILE + p + 1] = p + 1 < n ? c[1] + c[3] : -INFINITY;
            }
        }
        dec_sync();
        for (int g = w; g < G; g += DEC_THREADS / 32) { /* online softmax, one warp per head */
            float pw = dec_softmax_step(S[g * DEC_TILE + lane], lane, n, ml + 2 * g, cr + g);
            __nv_bfloat16 hi = __float2bfloat16_rn(pw);
            Ps[g * DTC_PST + lane] = hi;
            Ps[(g + 8) * DTC_PST + lane] = __float2bfloat16_rn(pw - __bfloat162float(hi));
        }
        dec_sync();
        { /* O += P V: this warp's dims n tiles j = w + 4 i */
            float c = cr[gi]; /* rows gi and gi + 8 are both head gi */
            uint32_t pa[2][4];
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                const __nv_bfloat16 *pr = Ps + gi * DTC_PST + kk * 16 + ti * 2;
                pa[kk][0] = *(const uint32_t *)pr;
                pa[kk][1] = *(const uint32_t *)(pr + 8 * DTC_PST);
                pa[kk][2] = *(const uint32_t *)(pr + 8);
                pa[kk][3] = *(const uint32_t *)(pr + 8 * DTC_PST + 8);
            }
            /* B fragments of both k halves by one ldmatrix.x4.trans: lane l points at position l,
             * dims 8 (w + 4 i) .. + 7 */
            const unsigned char *vrow = vb + (size_t)lane * RB;
#pragma unroll
            for (int i = 0; i < NTW; i++) {
                o[i][0] *= c, o[i][1] *= c, o[i][2] *= c, o[i][3] *= c;
                uint32_t b[4];
                fl_ldsm_x4_t(b, vrow + (size_t)(8 * (w + 4 * i)) * 2);
                fl_mma(o[i], pa[0], b[0], b[1], __nv_bfloat16());
                fl_mma(o[i], pa[1], b[2], b[3], __nv_bfloat16());
            }
        }
        dec_sync(); /* the stage and P are rewritten by the next iteration */
    }
    if (late_trigger) pdl_trigger();

    /* row gi (hi) + row gi + 8 (lo) = head gi; dims 8 (w + 4 i) + 2 ti + {0, 1} */
    if (nparts == 1) {
        if (gi < G) {
            float inv = 1.f / ml[2 * gi + 1];
            TA *op = out + ((size_t)r * nh + h0 + gi) * HD + 2 * ti;
#pragma unroll
            for (int i = 0; i < NTW; i++) {
                op[8 * (w + 4 * i)] = from_f32<TA>((o[i][0] + o[i][2]) * inv);
                op[8 * (w + 4 * i) + 1] = from_f32<TA>((o[i][1] + o[i][3]) * inv);
            }
        }
        return;
    }
    if (gi < G) {
        float *pp = part + (((size_t)r * nh + h0 + gi) * max_parts + z) * HD + 2 * ti;
#pragma unroll
        for (int i = 0; i < NTW; i++)
            *(float2 *)(pp + 8 * (w + 4 * i)) = make_float2(o[i][0] + o[i][2], o[i][1] + o[i][3]);
    }
    for (int g = t; g < G; g += DEC_THREADS) {
        float *pm = part_ml + (((size_t)r * nh + h0 + g) * max_parts + z) * 2;
        pm[0] = ml[2 * g], pm[1] = ml[2 * g + 1];
    }
    dec_last_combine<TA>(r, kvh, G, HD, nh, nparts, max_parts, part, part_ml, cnt + (size_t)bx * n_kv + kvh,
                         (float *)buf, cr, out);
}

/* grid (rows, n_kv, max_parts), block DEC_THREADS, dynamic shared memory dec_tc_smem_bytes;
 * arguments as k_attn_dec, plus qp (the fused q/k post-processing). */
template <int HD, typename TA>
__global__ void __launch_bounds__(DEC_THREADS)
    k_attn_dec_tc(const float *qkv, int stride, __nv_bfloat16 *pool, size_t block_floats, int layer, int n_kv,
                  int tpb, int G, const int32_t *row_pos, const int32_t *row_bt, const int32_t *bt,
                  const int32_t *rows, int split_len, int max_parts, float sl2, float *part, float *part_ml,
                  unsigned *cnt, TA *out, int late_trigger, dec_qkv_t qp) {
    extern __shared__ __align__(16) unsigned char dsm[];
    dec_span sp;
    if (!dec_begin(late_trigger, rows, row_pos, split_len, &sp)) return;
    dec_tc_run<HD, TA>(sp, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, dsm, qkv, stride, pool, block_floats, layer,
                       n_kv, tpb, G, row_bt, bt, max_parts, sl2, part, part_ml, cnt, out, late_trigger, qp);
}

#endif
