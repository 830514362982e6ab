/*
 * The batch-1 decode megakernel: every layer of a one-row decode step in one persistent
 * launch (grid = one CTA per SM, all resident: a cooperative launch), instead of eight
 * kernels a layer. Included by decode_mk.cu only (the host side).
 *
 * Why: at batch 1 the step is the weight stream (16 GB for Llama-3-8B), and each kernel
 * boundary costs a few microseconds in which DRAM idles (the norms, the attention's latency,
 * each product's ramp and tail: 1.19-1.24x the HBM floor with eight kernels a layer, see
 * docs/benchmarks.md). Here one producer warp per CTA streams the CTA's share of the weights
 * of every product of every layer, in order, into a ring of shared-memory stages by bulk
 * copies (cp.async.bulk, mbarrier completion), and never waits for anything but a free stage:
 * weights do not depend on activations, so the stream runs ahead through the grid barriers,
 * the norms and the attention (the idea of the "megakernel" decoders: Hazy Research's
 * Llama-1B megakernel, 2025; Mirage MPK, Cheng et al. 2025).
 *
 * Consumer warps (MK_CW of them) run the phases of each layer, a grid barrier between two:
 *   1. RMSNorm of x (every CTA computes it, in the same order: same bits everywhere) into the
 *      CTA's x buffer (the bf16-rounded values as f32, shared memory); its rows of
 *      [q k v] = W_qkv xn into qkv (f32);
 *   2. decode attention: k_attn_dec_tc's work (dec_tc_run, with the q/k post-processing and
 *      the K/V store) for the (KV head, part) pairs of this CTA, by warps 0-3;
 *   3. its rows of o = W_o attn; x += o;
 *   4. RMSNorm of x; its j range of gate and up rows, a[j] = silu(gate_j) * up_j (bf16);
 *   5. its rows of down = W_down a; x += down;
 * and after the last layer, when the step wants the row's logits, the output head: RMSNorm of
 * x, its rows of logits = W_out xn (in runs of rows the product slots hold).
 * The products: CTA c owns rows [c N / C, (c + 1) N / C) of each (gate/up: the same j range of
 * both halves), contiguous in W, streamed in MK_CHUNK-byte stages. A stage is cut into
 * MK_PIECE-byte pieces (512 consecutive elements of one row: K % 512 == 0); warp i takes
 * pieces i and i + MK_CW, loads them, releases the stage, and multiplies them with the x
 * buffer (lane l: elements 8 l .. 8 l + 7 and 256 + 8 l .. + 7); one butterfly sums both
 * pieces over the lanes, and each piece's sum goes to its own slot (row, k / 512); after the
 * product, row n's output is its slots summed in k order. So every output's bits depend on
 * K and the data only, not on timing, the grid or the ring.
 * Data other CTAs wrote in this launch (x, qkv, a, the attention parts) is read with
 * ld.global.cg (L2), never through the SM's L1.
 *
 * H200, Llama-3-8B shape, batch 1 (docs/benchmarks.md, thirteenth session): 4.04-4.09 /
 * 4.32 ms a step at 512 / 4096 positions (1.06-1.07x / 1.10x the HBM floor) against 4.55 / 4.82
 * with eight kernels a layer. On by default (MK_DEFAULT; KVSERVE_CUDA_MK=0 off).
 *
 * Not batch-invariant against the multi-row kernels (a different summation order than
 * k_gemv_bf16 / cuBLAS): the deterministic mode never runs it.
 */
#ifndef KV_CUDA_DECODE_MK_CUH
#define KV_CUDA_DECODE_MK_CUH

#include "kernels.cuh"
#include "attn_decode.cuh"

/* consumer warps: 14 (15 warps in all) ran 13-20 us a step faster than 15 on the H200
 * (docs/benchmarks.md, thirteenth session). Either way a thread has <= 128 registers: each of
 * an SM's four sub-partitions holds 16K registers and up to 4 of the warps (11 consumer warps,
 * 3 a sub-partition, would allow 168) */
#ifndef MK_CW /* -DMK_CW=N: a variant for experiments (docs/patches/README.md) */
#define MK_CW 14
#endif
#define MK_THREADS (32 * (MK_CW + 1)) /* + one producer warp */
#define MK_PIECE 1024                 /* bytes of W per warp step */
#define MK_PPW 2                      /* pieces per warp in a stage */
#define MK_CHUNK (MK_PIECE * MK_PPW * MK_CW) /* bytes per ring stage (28 KiB) */
#define MK_KQ 512                     /* elements per piece: K % MK_KQ == 0 */
#define MK_MAX_NST 32
/* ring stages (when shared memory has room) and the attention's K/V stages (dec_tc_run's NS):
 * measured on the H200 (docs/benchmarks.md, eleventh session), 4 and 4 beat 5 and 3 (the
 * stand-alone kernel's) by 35-55 us a step, and 4 and 5 equal; KVSERVE_CUDA_MK_NST changes
 * the ring's (an experiment) */
#define MK_NST 4
#define MK_ANS 4
/* On unless KVSERVE_CUDA_MK=0: faster on the H200 (docs/benchmarks.md), and the whole device
 * suite (the server's e2e API tests, fault injection, det_serve, disagg) passes with it. */
#ifndef MK_DEFAULT
#define MK_DEFAULT 1
#endif
#define MK_HEAD 1024 /* shared-memory bytes before the ring: the stage mbarriers */

/* One layer's weights (bf16) and norm / bias vectors (f32; bqkv, q_norm, k_norm may be NULL). */
struct mk_layer {
    const __nv_bfloat16 *wqkv, *wo, *wgu, *wdown;
    const float *attn_norm, *ffn_norm, *bqkv, *q_norm, *k_norm;
};

/* Everything the kernel reads; built by forward.cu for one step shape. */
struct mk_params {
    const mk_layer *layers; /* device array, n_layers */
    int n_layers, dim, ffn, nh, nkv, G, tpb, neox;
    float eps, sl2;
    const float *inv_freq;
    float *x;          /* (dim) residual stream, in / out */
    float *qkv;        /* (nh + 2 nkv) * hd raw q / k / v */
    __nv_bfloat16 *a;  /* attention output (nh * hd), then the SwiGLU output (ffn) */
    __nv_bfloat16 *pool;
    size_t block_floats;
    const int32_t *row_pos, *row_bt, *bt;
    int split_len, max_parts;
    float *part, *part_ml;
    /* the output head, when lm (the step wants the row's logits): RMSNorm by out_norm, then
     * logits (vocab, f32) = wout (vocab x dim, bf16) xn, a CTA's rows in runs of at most
     * lm_rows (what the product slots hold) */
    const __nv_bfloat16 *wout;
    const float *out_norm;
    float *logits;
    int vocab, lm, lm_rows;
    unsigned *cnt;      /* k_attn_dec_tc's combine counters (zero, left zero) */
    unsigned *bar;      /* grid-barrier counter: zero before the launch, left zero */
    int nst;            /* ring stages */
    unsigned u_off;     /* byte offset of the region the attention and the x buffer share */
    unsigned part_off;  /* byte offset of the product slots in that region */
    int dbg;            /* timing experiments only (KVSERVE_CUDA_MK_DBG; results wrong): 1 no product math, 2 no
                         * attention, 16 no weight stream (consumers reuse the ring); 32 (results right) the
                         * weight stream without its L2 evict-first hint; 64 no grid barriers; 128 grid barriers without
                         * release / acquire */
    long long *prof;    /* k_decode_mk<HD, true>: (gridDim.x, MK_NPROF) clock64 cycles per phase kind (KVSERVE_CUDA_MK_PROF) */
};
/* phase kinds of the profile: norms, activation loads, products (of which waiting for a
 * stage), epilogues, grid barriers, attention, the whole kernel (thread 0's cycles), each of
 * the five barriers of a layer (from MKP_G0), the attention pairs that hold the step's
 * position and the others (MKP_APOS, + 1), and the producer's idle cycles (every stage of
 * the ring landed, none free: the CTA asks DRAM for nothing) while it held the next stage of
 * product 0-3 or of the output head (from MKP_P0) */
enum { MKP_NORM, MKP_LOAD, MKP_PROD, MKP_STARVE, MKP_EPI, MKP_GRID, MKP_ATTN, MKP_ALL, MKP_G0, MKP_APOS = MKP_G0 + 5,
       MKP_P0 = MKP_APOS + 2, MK_NPROF = MKP_P0 + 5 };

__device__ __forceinline__ unsigned mk_sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mk_bar_init(uint64_t *b, unsigned n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mk_sa(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mk_bar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(mk_sa(b)) : "memory");
}
__device__ __forceinline__ void mk_bar_wait(uint64_t *b, unsigned parity) {
    unsigned ok;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok)
                     : "r"(mk_sa(b)), "r"(parity)
                     : "memory");
    } while (!ok);
}
/* whether phase `parity` of b completed (no wait) */
__device__ __forceinline__ bool mk_bar_test(uint64_t *b, unsigned parity) {
    unsigned ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(mk_sa(b)), "r"(parity)
                 : "memory");
    return ok;
}
/* bytes (a multiple of 16) from global src into shared dst, completion counted on mbarrier b;
 * with hint, the global reads marked with L2 cache policy pol (createpolicy) */
__device__ __forceinline__ void mk_bulk(void *dst, const void *src, unsigned bytes, uint64_t *b, bool hint,
                                        uint64_t pol) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mk_sa(b)), "r"(bytes) : "memory");
    if (hint)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
                     "[%3], %4;\n" ::"r"(mk_sa(dst)),
                     "l"(src), "r"(bytes), "r"(mk_sa(b)), "l"(pol)
                     : "memory");
    else
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                         mk_sa(dst)),
                     "l"(src), "r"(bytes), "r"(mk_sa(b))
                     : "memory");
}
/* the consumer warps' barrier (named barrier 2; the attention uses 1, the producer none) */
__device__ __forceinline__ void mk_csync() { asm volatile("bar.sync 2, %0;\n" ::"n"(MK_CW * 32) : "memory"); }
/* every CTA's consumers reach the same barrier number (target = number x gridDim.x): thread 0
 * counts with release semantics (the CTA's writes, ordered before it by the bar.sync) and
 * polls with acquire semantics (the other CTAs' writes, for the threads after the bar.sync) */
__device__ __forceinline__ void mk_grid(unsigned *bar, unsigned target, int relaxed = 0) {
    mk_csync();
    if (threadIdx.x == 0) {
        unsigned v;
        if (relaxed) { /* timing experiment (KVSERVE_CUDA_MK_DBG & 128): no release / acquire */
            asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;\n" ::"l"(bar) : "memory");
            do {
                asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(bar) : "memory");
            } while (v < target);
        } else {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(bar) : "memory");
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(bar) : "memory");
            } while (v < target);
        }
    }
    mk_csync();
}

/* A product's share of CTA cta: up to two runs of rows (K elements each, contiguous in W). */
struct mk_seg {
    const __nv_bfloat16 *w;
    int rows;
};
/* the output head's runs of CTA cta (mk_params.lm_rows rows at most; none when vocab < nc) */
__device__ __forceinline__ int mk_lm_runs(const mk_params &P, int cta, int nc) {
    const int rows = (int)((long)(cta + 1) * P.vocab / nc) - (int)((long)cta * P.vocab / nc);
    return P.lm ? (rows + P.lm_rows - 1) / P.lm_rows : 0;
}
/* products: 0 qkv, 1 o, 2 gate/up, 3 down, 4 + j the output head's run j. Returns the run
 * count; K and the first output row. */
__device__ __forceinline__ int mk_segs(const mk_params &P, const mk_layer &Ly, int p, int hd, int cta, int nc,
                                       mk_seg s[2], int *K, int *row0) {
    int N, k;
    const __nv_bfloat16 *W;
    if (p >= 4) {
        const int v0 = (int)((long)cta * P.vocab / nc), v1 = (int)((long)(cta + 1) * P.vocab / nc);
        const int r0 = v0 + (p - 4) * P.lm_rows, r1 = min(v1, r0 + P.lm_rows);
        *K = P.dim, *row0 = r0;
        s[0].w = P.wout + (size_t)r0 * P.dim, s[0].rows = r1 - r0;
        return 1;
    }
    if (p == 0) N = (P.nh + 2 * P.nkv) * hd, k = P.dim, W = Ly.wqkv;
    else if (p == 1) N = P.dim, k = P.nh * hd, W = Ly.wo;
    else if (p == 2) N = P.ffn, k = P.dim, W = Ly.wgu;
    else N = P.dim, k = P.ffn, W = Ly.wdown;
    int r0 = (int)((long)cta * N / nc), r1 = (int)((long)(cta + 1) * N / nc);
    *K = k, *row0 = r0;
    s[0].w = W + (size_t)r0 * k, s[0].rows = r1 - r0;
    if (p != 2) return 1;
    s[1].w = W + ((size_t)P.ffn + r0) * k, s[1].rows = r1 - r0; /* the up half, same j range */
    return 2;
}

/* x in shared memory as f32 (the bf16 activation's values), in two planes so that a lane's
 * float4 reads are consecutive: element k at plane (k % 8) / 4, index (k / 8) * 4 + k % 4. */
/* the 16 products of a lane's share of a piece: w0 (8 bf16) with x elements e .. e + 7 and w1
 * with e + 256 .. e + 263, e = 8 lane (xa / xb4: the two planes as float4, at index e / 8),
 * in two chains, a fixed order */
__device__ __forceinline__ float mk_dot(uint4 w0, uint4 w1, const float4 *xa, const float4 *xb4, int e8) {
    const float4 a0 = xa[e8], b0 = xb4[e8], a1 = xa[e8 + 32], b1 = xb4[e8 + 32];
    const unsigned u0[4] = {w0.x, w0.y, w0.z, w0.w}, u1[4] = {w1.x, w1.y, w1.z, w1.w};
    const float x0[8] = {a0.x, a0.y, a0.z, a0.w, b0.x, b0.y, b0.z, b0.w};
    const float x1[8] = {a1.x, a1.y, a1.z, a1.w, b1.x, b1.y, b1.z, b1.w};
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        s0 = fmaf(__uint_as_float(u0[q] << 16), x0[2 * q], s0);
        s0 = fmaf(__uint_as_float(u0[q] & 0xffff0000u), x0[2 * q + 1], s0);
        s1 = fmaf(__uint_as_float(u1[q] << 16), x1[2 * q], s1);
        s1 = fmaf(__uint_as_float(u1[q] & 0xffff0000u), x1[2 * q + 1], s1);
    }
    return s0 + s1;
}

/* The consumer side of one product: every stage of the CTA's runs, in the producer's order
 * (stage counter *q), into the slots; ends with the consumers' barrier. Warp w takes pieces w
 * and w + MK_CW of a stage (fewer in a run's last stage), multiplied together; the stage is
 * released once its pieces are in registers; the two sums are reduced across the warp in one
 * butterfly (lanes 0-15 finish piece 0, lanes 16-31 piece 1). */
__device__ __forceinline__ void mk_consume(const mk_seg *sg, int nseg, int K, const unsigned char *ring,
                                           uint64_t *full, uint64_t *empty, int nst, unsigned *q,
                                           const float *xs, float *slots, int warp, int lane,
                                           long long *starve, int nomath, int nowait = 0) {
    static_assert(MK_PPW == 2, "two pieces per warp and stage");
    const int ppr = K / MK_KQ; /* pieces per row = slots per row */
    const float4 *xa = (const float4 *)xs, *xb4 = xa + K / 8;
    int rb = 0, R = 0; /* R: the rows of all runs (the slots are k-major: slot kp of row i at kp R + i) */
    for (int si = 0; si < nseg; si++) R += sg[si].rows;
    for (int si = 0; si < nseg; si++) {
        const int npieces = sg[si].rows * ppr;
        /* piece j of this warp: index g[j] in the run, row[j] / kp[j] = g / ppr, g % ppr */
        int g[2], row[2], kp[2];
#pragma unroll
        for (int j = 0; j < 2; j++) g[j] = warp + j * MK_CW, row[j] = g[j] / ppr, kp[j] = g[j] - row[j] * ppr;
        /* a stage advances each piece by MK_PPW * MK_CW: dr rows and dk pieces (then one more row
         * when kp wraps) */
        const int dr = MK_PPW * MK_CW / ppr, dk = MK_PPW * MK_CW - dr * ppr;
        unsigned s = *q % (unsigned)nst, ph = (*q / (unsigned)nst) & 1u; /* stage and its phase parity */
        for (int pb = 0; pb < npieces; pb += MK_PPW * MK_CW, (*q)++) {
            long long t0 = starve ? clock64() : 0;
            if (!nowait) mk_bar_wait(&full[s], ph);
            if (starve) *starve += clock64() - t0;
            const uint4 *cb = (const uint4 *)(ring + (size_t)s * MK_CHUNK);
            uint4 w[2][2];
#pragma unroll
            for (int j = 0; j < 2; j++)
                if (g[j] < npieces) {
                    const uint4 *wp = cb + (size_t)(warp + j * MK_CW) * (MK_PIECE / 16);
                    w[j][0] = wp[lane], w[j][1] = wp[32 + lane];
                } else {
                    w[j][0] = w[j][1] = make_uint4(0u, 0u, 0u, 0u);
                }
            __syncwarp();
            if (lane == 0) mk_bar_arrive(&empty[s]); /* release: the loads above are done with the stage */
            float a[2];
#pragma unroll
            for (int j = 0; j < 2; j++)
                a[j] = nomath ? __uint_as_float(w[j][0].x ^ w[j][1].w) : mk_dot(w[j][0], w[j][1], xa, xb4, kp[j] * 64 + lane);
            float v = lane & 16 ? a[1] : a[0], o = lane & 16 ? a[0] : a[1];
            v += __shfl_xor_sync(0xffffffffu, o, 16);
#pragma unroll
            for (int m = 8; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
            const bool hi = lane & 16; /* no dynamic index into g / row / kp: they stay in registers */
            const int gj = hi ? g[1] : g[0], rj = hi ? row[1] : row[0], kj = hi ? kp[1] : kp[0];
            if ((lane & 15) == 0 && gj < npieces) slots[(size_t)kj * R + rb + rj] = v;
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                g[jj] += MK_PPW * MK_CW, kp[jj] += dk, row[jj] += dr;
                if (kp[jj] >= ppr) kp[jj] -= ppr, row[jj]++;
            }
            if (++s == (unsigned)nst) s = 0, ph ^= 1u;
        }
        rb += sg[si].rows;
    }
    mk_csync();
}

/* row i's output: its ns slots summed in k order (k-major slots of R rows: consecutive threads'
 * rows in consecutive banks) */
__device__ __forceinline__ float mk_row(const float *slots, int i, int ns, int R) {
    const float *p = slots + i;
    float y = p[0];
    for (int s = 1; s < ns; s++) y += p[(size_t)s * R];
    return y;
}

/* xs (f32 planes, see mk_dot) = bf16(w * x / rms(x)) as f32; the same bits in every CTA. For
 * dim <= 4 x 4 x threads, x (L2) and w are read in one round trip (x parked in xs, w in
 * registers, until the sum is known); else x is read twice. */
#define MK_NV 4
__device__ __forceinline__ void mk_norm(const float *x, const float *w, int dim, float eps, float *xs,
                                        double *red) {
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, n4 = dim / 4;
    const bool cached = n4 <= MK_NV * MK_CW * 32;
    auto at = [&](int i) -> float4 & { return ((float4 *)xs)[(i & 1) * (dim / 8) + i / 2]; }; /* elements 4 i .. + 3 */
    float4 wv[MK_NV];
    double ss = 0;
    if (cached) {
        float4 v[MK_NV];
#pragma unroll
        for (int j = 0; j < MK_NV; j++) {
            const int i = t + j * MK_CW * 32;
            v[j] = i < n4 ? __ldcg((const float4 *)x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
            wv[j] = i < n4 ? *((const float4 *)w + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < MK_NV; j++) {
            ss += (double)v[j].x * v[j].x + (double)v[j].y * v[j].y + (double)v[j].z * v[j].z + (double)v[j].w * v[j].w;
            if (t + j * MK_CW * 32 < n4) at(t + j * MK_CW * 32) = v[j];
        }
    } else {
        for (int i = t; i < n4; i += MK_CW * 32) {
            float4 a = __ldcg((const float4 *)x + i);
            ss += (double)a.x * a.x + (double)a.y * a.y + (double)a.z * a.z + (double)a.w * a.w;
        }
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[warp] = ss;
    mk_csync();
    double tot = 0;
    for (int i = 0; i < MK_CW; i++) tot += red[i];
    const float inv = (float)(1.0 / sqrt(tot / dim + (double)eps));
    auto put = [&](int i, float4 a, float4 g) {
        auto r = [](float f) { return __bfloat162float(__float2bfloat16_rn(f)); };
        at(i) = make_float4(r(g.x * (a.x * inv)), r(g.y * (a.y * inv)), r(g.z * (a.z * inv)), r(g.w * (a.w * inv)));
    };
    if (cached) {
#pragma unroll
        for (int j = 0; j < MK_NV; j++)
            if (t + j * MK_CW * 32 < n4) put(t + j * MK_CW * 32, at(t + j * MK_CW * 32), wv[j]);
    } else {
        for (int i = t; i < n4; i += MK_CW * 32) put(i, __ldcg((const float4 *)x + i), *((const float4 *)w + i));
    }
    mk_csync();
}
/* xs (f32 planes) = n bf16 values from a (L2) */
__device__ __forceinline__ void mk_load(const __nv_bfloat16 *a, int n, float *xs) {
    for (int i = threadIdx.x; i < n / 8; i += MK_CW * 32) {
        uint4 u = __ldcg((const uint4 *)a + i);
        ((float4 *)xs)[i] = make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                                        __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
        ((float4 *)xs)[n / 8 + i] = make_float4(__uint_as_float(u.z << 16), __uint_as_float(u.z & 0xffff0000u),
                                                __uint_as_float(u.w << 16), __uint_as_float(u.w & 0xffff0000u));
    }
    mk_csync();
}

/* The producer's position in the stage sequence: layer l, product p, run si, byte offset off. */
struct mk_cur {
    int l, p, si, nseg, K, r0;
    unsigned off, bytes;
    bool done;
    mk_seg sg[2];
};
__device__ __forceinline__ void mk_cur_load(mk_cur *c, const mk_params &P, int hd, int cta, int nc) {
    c->nseg = mk_segs(P, P.layers[c->l < P.n_layers ? c->l : 0], c->p, hd, cta, nc, c->sg, &c->K, &c->r0);
    c->si = 0, c->off = 0, c->bytes = (unsigned)c->sg[0].rows * (unsigned)c->K * 2u;
}
__device__ __forceinline__ void mk_cur_init(mk_cur *c, const mk_params &P, int hd, int cta, int nc) {
    c->l = 0, c->p = 0, c->done = false;
    mk_cur_load(c, P, hd, cta, nc);
}
__device__ __forceinline__ unsigned mk_cur_size(const mk_cur *c) {
    return c->bytes - c->off < MK_CHUNK ? c->bytes - c->off : MK_CHUNK;
}
/* the next stage (the consumers' order: mk_consume); done past the last layer and the output
 * head's runs */
__device__ __forceinline__ void mk_cur_next(mk_cur *c, const mk_params &P, int hd, int cta, int nc) {
    c->off += MK_CHUNK;
    if (c->off < c->bytes) return;
    if (++c->si < c->nseg) {
        c->off = 0, c->bytes = (unsigned)c->sg[c->si].rows * (unsigned)c->K * 2u;
        return;
    }
    if (c->p >= 4) { /* the output head (l == n_layers) */
        if (++c->p - 4 >= mk_lm_runs(P, cta, nc)) c->done = true;
        else mk_cur_load(c, P, hd, cta, nc);
        return;
    }
    if (++c->p == 4) c->p = 0, c->l++;
    if (c->l == P.n_layers) {
        if (mk_lm_runs(P, cta, nc) == 0) {
            c->done = true;
            return;
        }
        c->p = 4;
    }
    mk_cur_load(c, P, hd, cta, nc);
}
/* grid = the SM count (every CTA resident: cooperative launch), block MK_THREADS, dynamic
 * shared memory MK_HEAD + nst * MK_CHUNK + the shared region (mk_smem_bytes in forward.cu). */
template <int HD, bool PROF>
__global__ void __launch_bounds__(MK_THREADS, 1) k_decode_mk(const mk_params P) {
    extern __shared__ __align__(128) unsigned char mk_smem[];
    __shared__ double red[MK_CW];
    uint64_t *full = (uint64_t *)mk_smem, *empty = full + MK_MAX_NST;
    unsigned char *ring = mk_smem + MK_HEAD, *U = mk_smem + P.u_off;
    float *xb = (float *)U; /* the product's x, f32 planes */
    float *slots = (float *)(U + P.part_off);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nc = gridDim.x, cta = blockIdx.x;
    const int nst = P.nst;
    if (threadIdx.x == 0) {
        for (int s = 0; s < nst; s++) mk_bar_init(&full[s], 1), mk_bar_init(&empty[s], MK_CW);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == MK_CW) { /* the producer: every stage of every product of every layer, in order */
        if (lane == 0 && !(P.dbg & 16)) {
            mk_cur ld;
            mk_cur_init(&ld, P, HD, cta, nc);
            /* the weights are read once a step: marked evict-first they leave L2 to what is read
             * again (x, the q/k/v and attention rows, the K/V just written; docs/benchmarks.md:
             * 4-5% faster a step than without the hint) */
            uint64_t pol;
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
            long long ps[5] = {}; /* PROF: idle cycles by the product of the stage held */
            for (unsigned q = 0; !ld.done; q++, mk_cur_next(&ld, P, HD, cta, nc)) {
                const int s = (int)(q % (unsigned)nst);
                const unsigned pe = (q / (unsigned)nst - 1) & 1u; /* (q >= nst) */
                if (q >= (unsigned)nst && !PROF) mk_bar_wait(&empty[s], pe);
                if (q >= (unsigned)nst && PROF) {
                    /* idle: every stage of the ring landed and none consumed yet (the CTA asks
                     * DRAM for nothing); not: waiting while copies are in flight */
                    const int sl = (int)((q - 1) % (unsigned)nst);
                    const unsigned pl = ((q - 1) / (unsigned)nst) & 1u;
                    long long tl = -1;
                    while (!mk_bar_test(&empty[s], pe))
                        if (tl < 0 && mk_bar_test(&full[sl], pl)) tl = clock64();
                    if (tl >= 0) ps[ld.p < 4 ? ld.p : 4] += clock64() - tl;
                }
                const unsigned char *src = (const unsigned char *)ld.sg[ld.si].w + ld.off;
                mk_bulk(ring + (size_t)s * MK_CHUNK, src, mk_cur_size(&ld), &full[s], !(P.dbg & 32), pol);
            }
            if (PROF)
                for (int i = 0; i < 5; i++) P.prof[(size_t)cta * MK_NPROF + MKP_P0 + i] = ps[i];
        }
        return;
    }
    unsigned q = 0, nbar = 0;
    const int qkvw = (P.nh + 2 * P.nkv) * HD;
    /* the profile: thread 0's cycles per phase kind */
    const bool prof = PROF && threadIdx.x == 0;
    long long pa[MK_NPROF] = {}, tp = prof ? clock64() : 0, *starve = prof ? &pa[MKP_STARVE] : nullptr;
    const long long t_start = tp;
    auto mark = [&](int kind) {
        if (prof) {
            long long t = clock64();
            pa[kind] += t - tp, tp = t;
        }
    };
    mk_seg sg[2];
    int K, r0;
    /* product p of layer Ly: this CTA's runs (sg, K, r0) into the slots */
    auto product = [&](const mk_layer &Ly, int p) {
        const int nseg = mk_segs(P, Ly, p, HD, cta, nc, sg, &K, &r0);
        mk_consume(sg, nseg, K, ring, full, empty, nst, &q, xb, slots, warp, lane, starve, P.dbg & 1, P.dbg & 16);
        mark(MKP_PROD);
    };
    auto grid = [&](int i) { /* i: which of the layer's barriers (the profile) */
        if (!(P.dbg & 64)) mk_grid(P.bar, ++nbar * nc, P.dbg & 128);
        if (prof) pa[MKP_G0 + i] += clock64() - tp;
        mark(MKP_GRID);
    };
    for (int l = 0; l < P.n_layers; l++) {
        const mk_layer Ly = P.layers[l];
        /* 1: norm, q / k / v */
        mk_norm(P.x, Ly.attn_norm, P.dim, P.eps, xb, red);
        mark(MKP_NORM);
        product(Ly, 0);
        for (int i = threadIdx.x; i < sg[0].rows; i += MK_CW * 32)
            P.qkv[r0 + i] = mk_row(slots, i, K / MK_KQ, sg[0].rows);
        mark(MKP_EPI);
        grid(0);
        /* 2: attention, (KV head, part) pairs over the CTAs */
        if (warp < DEC_THREADS / 32 && !(P.dbg & 2)) {
            const dec_qkv_t qp = {Ly.bqkv, Ly.q_norm, Ly.k_norm, P.inv_freq, P.eps, P.neox, 1};
            const int nv = P.nkv * P.max_parts, pos = P.row_pos[0];
            for (int v = cta; v < nv; v += nc) {
                dec_span sp;
                sp.r = 0, sp.pos = pos, sp.p_begin = (v / P.nkv) * P.split_len;
                if (sp.p_begin > pos) continue;
                sp.p_end = min(pos + 1, sp.p_begin + P.split_len), sp.nparts = pos / P.split_len + 1;
                const long long ta = prof ? clock64() : 0;
                dec_tc_run<HD, __nv_bfloat16, MK_ANS>(sp, 0, v % P.nkv, v / P.nkv, threadIdx.x, U, P.qkv, qkvw,
                                                   P.pool, P.block_floats, l, P.nkv, P.tpb, P.G, P.row_bt, P.bt,
                                                   P.max_parts, P.sl2, P.part, P.part_ml, P.cnt, P.a, 0, qp);
                dec_sync(); /* the region is reused by the next pair */
                if (prof) pa[sp.p_end == pos + 1 ? MKP_APOS : MKP_APOS + 1] += clock64() - ta;
            }
        }
        mark(MKP_ATTN);
        grid(1);
        /* 3: o, x += o */
        mk_load(P.a, P.nh * HD, xb);
        mark(MKP_LOAD);
        /* the CTA's residual rows (o and down own the same rows of x), read before the product */
        mk_segs(P, Ly, 1, HD, cta, nc, sg, &K, &r0);
        float xo = threadIdx.x < sg[0].rows ? __ldcg(P.x + r0 + threadIdx.x) : 0.f;
        product(Ly, 1);
        if (threadIdx.x < sg[0].rows) P.x[r0 + threadIdx.x] = xo + mk_row(slots, threadIdx.x, K / MK_KQ, sg[0].rows);
        mark(MKP_EPI);
        grid(2);
        /* 4: norm, gate / up, SwiGLU */
        mk_norm(P.x, Ly.ffn_norm, P.dim, P.eps, xb, red);
        mark(MKP_NORM);
        product(Ly, 2);
        for (int i = threadIdx.x; i < sg[0].rows; i += MK_CW * 32) {
            const int R = 2 * sg[0].rows; /* gate rows, then up rows */
            float g = mk_row(slots, i, K / MK_KQ, R), u = mk_row(slots, sg[0].rows + i, K / MK_KQ, R);
            P.a[r0 + i] = __float2bfloat16_rn(silu_mul(g, u));
        }
        mark(MKP_EPI);
        grid(3);
        /* 5: down, x += down */
        mk_load(P.a, P.ffn, xb);
        mark(MKP_LOAD);
        mk_segs(P, Ly, 3, HD, cta, nc, sg, &K, &r0);
        xo = threadIdx.x < sg[0].rows ? __ldcg(P.x + r0 + threadIdx.x) : 0.f;
        product(Ly, 3);
        if (threadIdx.x < sg[0].rows) P.x[r0 + threadIdx.x] = xo + mk_row(slots, threadIdx.x, K / MK_KQ, sg[0].rows);
        mark(MKP_EPI);
        if (l + 1 < P.n_layers || P.lm) grid(4);
    }
    if (P.lm) { /* the output head: every CTA's rows of the last x are in */
        mk_norm(P.x, P.out_norm, P.dim, P.eps, xb, red);
        mark(MKP_NORM);
        for (int j = 0, nr = mk_lm_runs(P, cta, nc); j < nr; j++) {
            product(P.layers[0], 4 + j);
            for (int i = threadIdx.x; i < sg[0].rows; i += MK_CW * 32)
                P.logits[r0 + i] = mk_row(slots, i, K / MK_KQ, sg[0].rows);
            mk_csync(); /* the slots are rewritten by the next run */
            mark(MKP_EPI);
        }
    }
    if (prof) {
        pa[MKP_ALL] = clock64() - t_start;
        for (int i = 0; i < MKP_P0; i++) P.prof[(size_t)cta * MK_NPROF + i] = pa[i];
    }
    /* leave the counter zero for the next launch: the last CTA to count resets it (no CTA
     * reads it after counting here) */
    mk_csync();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(P.bar, 1u) == (nbar + 1) * (unsigned)nc - 1) atomicExch(P.bar, 0u);
    }
}

#endif
