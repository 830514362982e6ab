/*
 * Sampling on the device (issue 10; backend.h forward_sample): the host sampler's pipeline
 * (src/engine/sampler.c) on the logits rows the forward left in device memory, so that only
 * the sampled ids and the logprobs asked for cross PCIe.
 *
 * Per step: k_sample_prep (one CTA of 1024 threads per row: penalties in place, argmax, log-sum-
 * exp, top-n alternatives, and the sort keys of the rows that need sorted candidates), a
 * radix sort of those keys (cub::DeviceRadixSort, stable: ties keep id order), k_sample_pick
 * (temperature rows: top_k / top_p / min_p and the draw), one copy of the results.
 *
 * Same semantics as the host; where the arithmetic differs (documented in backend_cuda.h):
 * sums of probabilities (double) and the log-sum-exp are reduced in a different order, and
 * the device's exp / log (double) may differ from glibc's in the last bit. So a logprob can
 * differ in the last float bits, and a draw that lands within rounding of a boundary between
 * two candidates can pick the neighbour. Greedy ids and the penalised logits are bitwise the
 * host's (the same float operations, no contraction).
 */
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <math.h>
#include <string.h>

#include "cuda_internal.h"

#define KVS_THREADS 1024
#define KVS_NONE 0x7fffffff

/* Orderable key of (logit, id): larger key = earlier in the sampler's order (logit desc, id
 * asc). -0 is taken as +0 (equal logits), NaN as the smallest key. */
__device__ __forceinline__ uint64_t kvs_key(float l, int id) {
    if (l != l) return 0;
    if (l == 0.f) l = 0.f;
    uint32_t u = __float_as_uint(l);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)u << 32) | (uint32_t)(0xffffffffu - (uint32_t)id);
}
__device__ __forceinline__ int kvs_key_id(uint64_t k) { return (int)(0xffffffffu - (uint32_t)k); }

struct kvs_stat {
    double lse; /* log-sum-exp of the penalised logits (when logprobs are asked for) */
    float mx;   /* the max penalised logit */
    int32_t amax;
};

typedef cub::BlockReduce<double, KVS_THREADS> kvs_rd;
typedef cub::BlockReduce<unsigned long long, KVS_THREADS> kvs_rk;
typedef cub::BlockReduce<int, KVS_THREADS> kvs_ri;
typedef cub::BlockScan<double, KVS_THREADS> kvs_sd;
union kvs_tmp {
    typename kvs_rd::TempStorage d;
    typename kvs_rk::TempStorage k;
    typename kvs_ri::TempStorage i;
    typename kvs_sd::TempStorage s;
};
struct kvs_max_op {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return a > b ? a : b; }
};
struct kvs_min_op {
    __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};
/* block-wide reductions, the result in every thread (tmp reused: a barrier before each use) */
__device__ double kvs_sum(double v, kvs_tmp &t, double *bc) {
    __syncthreads();
    double r = kvs_rd(t.d).Sum(v);
    if (threadIdx.x == 0) *bc = r;
    __syncthreads();
    return *bc;
}
__device__ unsigned long long kvs_kmax(unsigned long long v, kvs_tmp &t, unsigned long long *bc) {
    __syncthreads();
    unsigned long long r = kvs_rk(t.k).Reduce(v, kvs_max_op());
    if (threadIdx.x == 0) *bc = r;
    __syncthreads();
    return *bc;
}
__device__ int kvs_imin(int v, kvs_tmp &t, int *bc) {
    __syncthreads();
    int r = kvs_ri(t.i).Reduce(v, kvs_min_op());
    if (threadIdx.x == 0) *bc = r;
    __syncthreads();
    return *bc;
}

/* grid L, block KVS_THREADS, dynamic shared memory ceil(V / 32) words (the seen bitmap).
 * rows: the requests (struct kvs_row), toks: their token histories, cnt: (L, V) counts, zero
 * between calls (left zero). */
__global__ void __launch_bounds__(KVS_THREADS)
    k_sample_prep(float *__restrict__ logits, int V, const struct kvs_row *__restrict__ rows,
                  const int32_t *__restrict__ toks, int32_t *__restrict__ cnt, struct kvs_stat *__restrict__ stat,
                  struct kvs_out *__restrict__ out, unsigned long long *__restrict__ keys, int32_t *__restrict__ vals) {
    extern __shared__ uint32_t seen[];
    __shared__ kvs_tmp tmp;
    __shared__ double bcd;
    __shared__ unsigned long long bck;
    const int r = blockIdx.x, tid = threadIdx.x;
    const struct kvs_row q = rows[r];
    float *l = logits + (size_t)r * V;
    const int nw = (V + 31) / 32;
    const int32_t *prompt = toks + q.tok_off, *gen = prompt + q.n_prompt;
    /* repetition penalty: one application per distinct id of prompt + gen (the first thread to
     * set the id's bit applies it; every occurrence would apply the same operation) */
    if (q.rep > 0.f && q.rep != 1.f) {
        for (int i = tid; i < nw; i += blockDim.x) seen[i] = 0;
        __syncthreads();
        for (int i = tid; i < q.n_prompt + q.n_gen; i += blockDim.x) {
            int id = i < q.n_prompt ? prompt[i] : gen[i - q.n_prompt];
            if (id < 0 || id >= V) continue;
            uint32_t bit = 1u << (id & 31);
            if (atomicOr(&seen[id >> 5], bit) & bit) continue;
            float v = l[id];
            l[id] = v > 0.f ? __fdiv_rn(v, q.rep) : __fmul_rn(v, q.rep);
        }
        __syncthreads();
    }
    /* presence / frequency: counts of the generated ids, then one subtraction per distinct id
     * (count * freq + pres rounded as the host does: no fused multiply-add) */
    if (q.pres != 0.f || q.freq != 0.f) {
        int32_t *c = cnt + (size_t)r * V;
        for (int i = tid; i < nw; i += blockDim.x) seen[i] = 0;
        for (int i = tid; i < q.n_gen; i += blockDim.x)
            if (gen[i] >= 0 && gen[i] < V) atomicAdd(&c[gen[i]], 1);
        __syncthreads();
        for (int i = tid; i < q.n_gen; i += blockDim.x) {
            int id = gen[i];
            if (id < 0 || id >= V) continue;
            uint32_t bit = 1u << (id & 31);
            if (atomicOr(&seen[id >> 5], bit) & bit) continue;
            int n = c[id];
            c[id] = 0;
            l[id] = __fsub_rn(l[id], __fadd_rn(__fmul_rn((float)n, q.freq), q.pres));
        }
        __syncthreads();
    }
    /* argmax (ties -> lowest id) */
    unsigned long long best = 0;
    for (int i = tid; i < V; i += blockDim.x) {
        unsigned long long k = kvs_key(l[i], i);
        if (k > best) best = k;
    }
    best = kvs_kmax(best, tmp, &bck);
    const int amax = kvs_key_id(best);
    const float mx = l[amax];
    double lse = 0;
    if (q.want_lp || q.n_top > 0) {
        double s = 0;
        for (int i = tid; i < V; i += blockDim.x) s += exp((double)l[i] - mx);
        lse = (double)mx + log(kvs_sum(s, tmp, &bcd));
    }
    /* top-n alternatives: n rounds, each the best key below the previous one */
    unsigned long long prev = ~0ull;
    for (int k = 0; k < q.n_top; k++) {
        unsigned long long b = 0;
        for (int i = tid; i < V; i += blockDim.x) {
            unsigned long long key = kvs_key(l[i], i);
            if (key < prev && key > b) b = key;
        }
        b = kvs_kmax(b, tmp, &bck);
        if (!b) break;
        prev = b;
        if (tid == 0) {
            int id = kvs_key_id(b);
            out[r].top_id[k] = id;
            out[r].top_lp[k] = (float)((double)l[id] - lse);
        }
    }
    if (tid == 0) {
        stat[r].lse = lse, stat[r].mx = mx, stat[r].amax = amax;
        out[r].id = amax; /* greedy; k_sample_pick overwrites it for temperature rows */
        out[r].logprob = (float)((double)mx - lse);
    }
    /* sort keys of a row that needs sorted candidates: (slot, logit desc, id asc) ascending */
    if (q.sort_slot >= 0) {
        unsigned long long *kk = keys + (size_t)q.sort_slot * V;
        int32_t *vv = vals + (size_t)q.sort_slot * V;
        for (int i = tid; i < V; i += blockDim.x) {
            uint64_t k = kvs_key(l[i], i) >> 32;
            kk[i] = ((unsigned long long)q.sort_slot << 32) | (uint32_t)~(uint32_t)k;
            vv[i] = i;
        }
    }
}

/* grid L, block KVS_THREADS. Temperature rows only (others return at once). sorted: the
 * candidate ids of the sorted rows, (slot, V). Candidates i < n in order: the sorted ids, or
 * 0 .. V-1 when the row needs no sort. Each thread owns a contiguous segment of candidates,
 * so prefix sums are a block scan of the segment sums plus a walk inside the segment. */
__global__ void __launch_bounds__(KVS_THREADS)
    k_sample_pick(const float *__restrict__ logits, int V, const struct kvs_row *__restrict__ rows,
                  const struct kvs_stat *__restrict__ stat, const int32_t *__restrict__ sorted,
                  struct kvs_out *__restrict__ out) {
    __shared__ kvs_tmp tmp;
    __shared__ double bcd;
    __shared__ int bci;
    __shared__ double found_acc;
    const int r = blockIdx.x, tid = threadIdx.x;
    const struct kvs_row q = rows[r];
    if (!(q.temperature > 0.f)) return;
    const float *l = logits + (size_t)r * V;
    const float mx = stat[r].mx;
    const int32_t *cand = q.sort_slot >= 0 ? sorted + (size_t)q.sort_slot * V : nullptr;
    int n = V;
    if (cand && q.top_k > 0 && q.top_k < V) n = q.top_k;
    const double inv_t = 1.0 / (double)q.temperature;
    const int seg = (n + KVS_THREADS - 1) / KVS_THREADS, b0 = min(n, tid * seg), b1 = min(n, b0 + seg);
    auto id_of = [&](int i) { return cand ? cand[i] : i; };
    auto prob = [&](int i) { return exp(((double)l[id_of(i)] - mx) * inv_t); };
    double loc = 0;
    for (int i = b0; i < b1; i++) loc += prob(i);
    double sum = kvs_sum(loc, tmp, &bcd);
    int keep = n;
    if (q.top_p > 0.f && q.top_p < 1.f) { /* smallest prefix whose mass reaches top_p */
        double target = (double)q.top_p * sum, acc;
        __syncthreads();
        kvs_sd(tmp.s).ExclusiveSum(loc, acc);
        int mine = KVS_NONE;
        double macc = 0;
        for (int i = b0; i < b1; i++) {
            acc += prob(i);
            if (acc >= target) {
                mine = i, macc = acc;
                break;
            }
        }
        int idx = kvs_imin(mine, tmp, &bci);
        if (idx != KVS_NONE) {
            if (mine == idx) found_acc = macc;
            __syncthreads();
            keep = idx + 1, sum = found_acc;
        }
    }
    double thr = (double)q.min_p;
    bool minp = q.min_p > 0.f;
    int last = keep - 1;
    if (minp) { /* survivors: weight >= min_p (the max has weight 1) */
        double s = 0;
        int lst = -1;
        for (int i = b0; i < min(b1, keep); i++) {
            double p = prob(i);
            if (p >= thr) s += p, lst = i;
        }
        sum = kvs_sum(s, tmp, &bcd);
        last = -kvs_imin(-lst, tmp, &bci);
    }
    /* the draw: the first candidate whose running mass exceeds u * sum */
    double x = q.u * sum, s = 0;
    for (int i = b0; i < min(b1, keep); i++) {
        double p = prob(i);
        if (!minp || p >= thr) s += p;
    }
    double acc;
    __syncthreads();
    kvs_sd(tmp.s).ExclusiveSum(s, acc);
    int mine = KVS_NONE;
    for (int i = b0; i < min(b1, keep); i++) {
        double p = prob(i);
        if (minp && !(p >= thr)) continue;
        acc += p;
        if (x < acc) {
            mine = i;
            break;
        }
    }
    int idx = kvs_imin(mine, tmp, &bci);
    if (tid == 0) {
        int id = id_of(idx != KVS_NONE ? idx : (last >= 0 ? last : 0));
        out[r].id = id;
        out[r].logprob = (float)((double)l[id] - stat[r].lse);
    }
}

/* ---- host side ---- */

static bool kvs_penalised(const struct backend_sampling *s) {
    return (s->repetition_penalty > 0.f && s->repetition_penalty != 1.f) || s->presence_penalty != 0.f ||
           s->frequency_penalty != 0.f;
}
static bool kvs_rep(const struct backend_sampling *s) {
    return s->repetition_penalty > 0.f && s->repetition_penalty != 1.f;
}
static bool kvs_needs_sort(const struct backend_sampling *s, int V) {
    return s->temperature > 0.f && ((s->top_k > 0 && s->top_k < V) || (s->top_p > 0.f && s->top_p < 1.f));
}

size_t kvs_meta_len(const struct backend_sampling *sp, int L) {
    size_t n = (size_t)L * (sizeof(struct kvs_row) / sizeof(int32_t));
    for (int i = 0; i < L; i++)
        if (kvs_penalised(&sp[i])) n += (size_t)(kvs_rep(&sp[i]) ? sp[i].n_prompt : 0) + (size_t)sp[i].n_gen;
    return n;
}

kv_status kvs_meta_fill(const struct backend_sampling *sp, int L, int V, int32_t *h, int *n_sort, char *err,
                        size_t errlen) {
    struct kvs_row *rows = (struct kvs_row *)h;
    int32_t *tok = h + (size_t)L * (sizeof(struct kvs_row) / sizeof(int32_t));
    int32_t off = 0;
    *n_sort = 0;
    for (int i = 0; i < L; i++) {
        const struct backend_sampling *s = &sp[i];
        if (s->n_top < 0 || s->n_top > BACKEND_MAX_TOP)
            return kv_errf(KV_EINVAL, err, errlen, "sample: row %d: n_top %d outside 0..%d", i, s->n_top,
                           BACKEND_MAX_TOP);
        bool pen = kvs_penalised(s), rep = kvs_rep(s);
        if (pen && ((rep && s->n_prompt > 0 && !s->prompt) || (s->n_gen > 0 && !s->gen) || s->n_prompt < 0 ||
                    s->n_gen < 0))
            return kv_errf(KV_EINVAL, err, errlen, "sample: row %d: a penalty is on but the token history is missing",
                           i);
        struct kvs_row *q = &rows[i];
        memset(q, 0, sizeof *q);
        q->u = s->u;
        q->temperature = s->temperature, q->top_p = s->top_p, q->min_p = s->min_p;
        q->rep = s->repetition_penalty, q->freq = s->frequency_penalty, q->pres = s->presence_penalty;
        q->top_k = s->top_k, q->n_top = s->n_top, q->want_lp = s->logprob;
        q->sort_slot = kvs_needs_sort(s, V) ? (*n_sort)++ : -1;
        q->tok_off = off;
        if (pen) {
            q->n_prompt = rep ? s->n_prompt : 0, q->n_gen = s->n_gen;
            if (q->n_prompt) memcpy(tok + off, s->prompt, (size_t)q->n_prompt * sizeof(int32_t));
            if (q->n_gen) memcpy(tok + off + q->n_prompt, s->gen, (size_t)q->n_gen * sizeof(int32_t));
            off += q->n_prompt + q->n_gen;
        }
    }
    return KV_OK;
}

static kv_status kvs_grow(void **p, size_t *cap, size_t need, bool zero, cudaStream_t st, char *err, size_t errlen) {
    if (need <= *cap) return KV_OK;
    if (*p) kvc_free(*p);
    *p = NULL, *cap = 0;
    CU_TRY(kvc_malloc(p, need), "cudaMalloc (sampling scratch)");
    if (zero) CU_TRY(kvc_memset_async(*p, 0, need, st), "memset (sampling scratch)");
    *cap = need;
    return KV_OK;
}

cudaError_t kvs_setup(void) {
    /* the seen bitmap: up to 200 KiB (vocabularies up to 1.6M ids) */
    return cudaFuncSetAttribute(k_sample_prep, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10);
}

kv_status kvs_enqueue(struct kvs_state *s, cudaStream_t st, float *d_logits, int L, int V, const int32_t *d_samp,
                      int n_sort, char *err, size_t errlen) {
    if (L <= 0) return KV_OK;
    size_t bm = (size_t)((V + 31) / 32) * 4;
    if (bm > (200u << 10)) return kv_errf(KV_EINVAL, err, errlen, "sample: vocabulary of %d ids is too large", V);
    kv_status r;
    if ((r = kvs_grow((void **)&s->cnt, &s->cap_cnt, (size_t)L * V * sizeof(int32_t), true, st, err, errlen)) ||
        (r = kvs_grow(&s->stat, &s->cap_stat, (size_t)L * sizeof(struct kvs_stat), false, st, err, errlen)) ||
        (r = kvs_grow((void **)&s->d_out, &s->cap_out, (size_t)L * sizeof(struct kvs_out), false, st, err, errlen)))
        return r;
    if (s->cap_h_out < (size_t)L * sizeof(struct kvs_out)) {
        if (s->h_out) kvc_free_host(s->h_out);
        s->h_out = NULL, s->cap_h_out = 0;
        CU_TRY(kvc_host_alloc((void **)&s->h_out, (size_t)L * 2 * sizeof(struct kvs_out), cudaHostAllocDefault),
               "cudaHostAlloc (sampling)");
        s->cap_h_out = (size_t)L * 2 * sizeof(struct kvs_out);
    }
    size_t ns = (size_t)n_sort * V;
    if (n_sort > 0) {
        size_t tb = 0;
        int end_bit = 32;
        while ((1ll << (end_bit - 32)) < n_sort) end_bit++;
        CU_TRY(cub::DeviceRadixSort::SortPairs(nullptr, tb, (const unsigned long long *)nullptr,
                                               (unsigned long long *)nullptr, (const int32_t *)nullptr,
                                               (int32_t *)nullptr, (int64_t)ns, 0, end_bit, st),
               "sort size");
        if ((r = kvs_grow((void **)&s->keys, &s->cap_keys, ns * 8, false, st, err, errlen)) ||
            (r = kvs_grow((void **)&s->keys2, &s->cap_keys2, ns * 8, false, st, err, errlen)) ||
            (r = kvs_grow((void **)&s->vals, &s->cap_vals, ns * 4, false, st, err, errlen)) ||
            (r = kvs_grow((void **)&s->vals2, &s->cap_vals2, ns * 4, false, st, err, errlen)) ||
            (r = kvs_grow(&s->cub_tmp, &s->cap_cub, tb, false, st, err, errlen)))
            return r;
    }
    const struct kvs_row *rows = (const struct kvs_row *)d_samp;
    const int32_t *toks = d_samp + (size_t)L * (sizeof(struct kvs_row) / sizeof(int32_t));
    k_sample_prep<<<L, KVS_THREADS, bm, st>>>(d_logits, V, rows, toks, s->cnt, (struct kvs_stat *)s->stat, s->d_out,
                                              s->keys, s->vals);
    kvc_launched();
    CU_TRY(cudaGetLastError(), "sample (prep)");
    if (n_sort > 0) {
        size_t tb = s->cap_cub;
        int end_bit = 32;
        while ((1ll << (end_bit - 32)) < n_sort) end_bit++;
        kvc_launched(); /* the sort's own launches are not counted (as cuBLAS's) */
        CU_TRY(cub::DeviceRadixSort::SortPairs(s->cub_tmp, tb, (const unsigned long long *)s->keys, s->keys2,
                                               (const int32_t *)s->vals, s->vals2, (int64_t)ns, 0, end_bit, st),
               "sample (sort)");
    }
    k_sample_pick<<<L, KVS_THREADS, 0, st>>>(d_logits, V, rows, (const struct kvs_stat *)s->stat, s->vals2, s->d_out);
    kvc_launched();
    CU_TRY(cudaGetLastError(), "sample (pick)");
    CU_TRY(kvc_memcpy_async(s->h_out, s->d_out, (size_t)L * sizeof(struct kvs_out), cudaMemcpyDeviceToHost, st),
           "sample results download");
    return KV_OK;
}

void kvs_collect(const struct kvs_state *s, const struct backend_sampling *sp, int L, struct backend_sample_out *out) {
    for (int i = 0; i < L; i++) {
        const struct kvs_out *o = &s->h_out[i];
        out[i].id = o->id;
        out[i].logprob = o->logprob;
        for (int k = 0; k < sp[i].n_top; k++) out[i].top_id[k] = o->top_id[k], out[i].top_logprob[k] = o->top_lp[k];
    }
}

void kvs_free(struct kvs_state *s) {
    void *d[] = {s->cnt, s->stat, s->d_out, s->keys, s->keys2, s->vals, s->vals2, s->cub_tmp};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        if (d[i]) kvc_free(d[i]);
    if (s->h_out) kvc_free_host(s->h_out);
    memset(s, 0, sizeof *s);
}
