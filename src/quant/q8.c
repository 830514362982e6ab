/*
 * q8: activation quantization, the scalar reference of the integer dot contract (q8.h), the
 * generic kernel and the per-ISA dispatch. The AVX2 / AVX-512 kernels are in q8_x86.c.
 *
 * Integer bounds (why no sum can overflow and every (float)P is exact, |q| <= 127):
 *   Q8_0 lane: 4 * 128 * 127 = 65,024          Q4_0 lane: 4 * 8 * 127 = 4,064
 *   Q4_K lane: 16 * 63 * 15 * 127 = 1.92e6     Q5_K lane: 16 * 63 * 31 * 127 = 3.97e6
 *   Q6_K lane: 16 * 128 * 32 * 127 = 8.32e6    min term: 8 * 63 * 32 * 127 = 2.05e6
 * all below 2^24, so the int32 -> float conversions are exact too.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "q8.h"
#include "q8_internal.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

int kv_q8_group(int type) {
    switch (type) {
    case KV_QTYPE_Q8_0: case KV_QTYPE_Q4_0: return 32;
    case KV_QTYPE_Q4_K: case KV_QTYPE_Q5_K: case KV_QTYPE_Q6_K: return 256;
    default: return 0;
    }
}

#define ALIGN64(n) (((n) + 63) & ~(size_t)63)

size_t kv_q8_act_bytes(int M, int K, int group) {
    if (M < 1 || K < 1 || (group != 32 && group != 256) || K % group) return 0;
    size_t m = (size_t)M, k = (size_t)K;
    return ALIGN64(m * k) + ALIGN64(m * (k / (size_t)group) * sizeof(float)) + ALIGN64(m * (k / 32) * sizeof(int16_t));
}

int kv_q8_act_init(struct kv_q8_act *a, void *buf, int M, int K, int group) {
    if (!kv_q8_act_bytes(M, K, group)) return -1;
    size_t m = (size_t)M, k = (size_t)K;
    char *p = buf;
    a->M = M;
    a->K = K;
    a->group = group;
    a->q = (int8_t *)p;
    p += ALIGN64(m * k);
    a->d = (float *)(void *)p;
    p += ALIGN64(m * (k / (size_t)group) * sizeof(float));
    a->s32 = (int16_t *)(void *)p;
    return 0;
}

/* ---- quantization (scalar; the vector versions are in q8_x86.c and give the same bytes) ---- */

void kv_q8_quantize_group_generic(const float *x, int G, int8_t *q, float *d) {
    float amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < G; i++) {
        if (!isfinite(x[i])) bad = 1;
        float a = fabsf(x[i]);
        if (a > amax) amax = a;
    }
    if (bad) {
        memset(q, 0, (size_t)G);
        *d = NAN;
        return;
    }
    *d = amax / 127.0f;
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < G; i++) q[i] = (int8_t)lrintf(x[i] * id); /* nearest even (default mode) */
}

void kv_q8_quantize(struct kv_q8_act *a, int m0, int n, const float *X, size_t ldx) {
    if (!a || m0 < 0 || n < 1 || m0 + n > a->M) return;
    const int K = a->K, G = a->group;
    kv_q8_quant_fn fn = kv_q8_quantize_group_generic;
#ifdef KV_QUANT_X86
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX512: fn = kv_q8_quantize_group_avx512; break;
    case KV_QUANT_ISA_AVX2: fn = kv_q8_quantize_group_avx2; break;
    default: break;
    }
#endif
    for (int m = m0; m < m0 + n; m++) {
        const float *x = X + (size_t)(m - m0) * ldx;
        int8_t *q = a->q + (size_t)m * K;
        for (int g = 0; g < K / G; g++) fn(x + (size_t)g * G, G, q + (size_t)g * G, a->d + (size_t)m * (K / G) + g);
        int16_t *s = a->s32 + (size_t)m * (K / 32);
        for (int j = 0; j < K / 32; j++) {
            int t = 0;
            for (int i = 0; i < 32; i++) t += q[32 * j + i];
            s[j] = (int16_t)t;
        }
    }
}

/* ---- the contract, literally ---- */

static float h2f(const uint8_t *p) { return kv_quant_h2f(kv_quant_ld16(p)); }

/* tree of matmul.h over 16 lanes */
static float tree16(const float *acc) {
    float l8[8], l4[4], l2[2];
    for (int j = 0; j < 8; j++) l8[j] = acc[j] + acc[j + 8];
    for (int j = 0; j < 4; j++) l4[j] = l8[j] + l8[j + 4];
    for (int j = 0; j < 2; j++) l2[j] = l4[j] + l4[j + 2];
    return l2[0] + l2[1];
}

/* Super-block s of a K-quant row as integers: u[e] (the unsigned quant, minus 32 for Q6_K),
 * sc[e] (the integer scale of e's sub-block), m8[j] (Q4_K/Q5_K mins), and d / dmin. */
static void kquant_ints(int type, const uint8_t *b, int u[256], int sc[256], int m8[8], float *d, float *dmin) {
    if (type == KV_QTYPE_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *s = (const int8_t *)(b + 192);
        *d = h2f(b + 208);
        *dmin = 0.0f;
        for (int e = 0; e < 256; e++) {
            int h = e / 128, g = (e % 128) / 32, l = e % 32;
            int lo = (g & 1) ? ql[64 * h + 32 + l] : ql[64 * h + l];
            lo = (g & 2) ? lo >> 4 : lo & 15;
            int hi = (qh[32 * h + l] >> (2 * g)) & 3;
            u[e] = (lo | hi << 4) - 32;
            sc[e] = s[e / 16];
        }
        memset(m8, 0, 8 * sizeof(int));
        return;
    }
    *d = h2f(b);
    *dmin = h2f(b + 2);
    const uint8_t *scales = b + 4;
    const uint8_t *qh = type == KV_QTYPE_Q5_K ? b + 16 : NULL;
    const uint8_t *qs = b + (type == KV_QTYPE_Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int scj, mj;
        kv_quant_scale_min_k4(j, scales, &scj, &mj);
        m8[j] = mj;
        for (int i = 0; i < 32; i++) {
            int e = 32 * j + i;
            int byte = qs[32 * (j / 2) + i];
            int v = (j & 1) ? byte >> 4 : byte & 15;
            if (qh) v |= ((qh[i] >> j) & 1) << 4;
            u[e] = v;
            sc[e] = scj;
        }
    }
}

/* One output of the contract. */
static float ref_one(int type, const uint8_t *row, const int8_t *q, const float *dx, const int16_t *s32, int K) {
    float acc[16] = {0}, mn = 0.0f;
    if (kv_q8_group(type) == 32) {
        const size_t bb = type == KV_QTYPE_Q8_0 ? 34 : 18;
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (size_t)b * bb;
            int v[32];
            for (int i = 0; i < 32; i++)
                v[i] = type == KV_QTYPE_Q8_0 ? (int8_t)blk[2 + i]
                                             : (i < 16 ? (blk[2 + i] & 15) : (blk[2 + i - 16] >> 4)) - 8;
            float s = h2f(blk) * dx[b];
            for (int l = 0; l < 8; l++) {
                int32_t P = 0;
                for (int i = 0; i < 4; i++) P += v[4 * l + i] * q[32 * b + 4 * l + i];
                acc[8 * (b % 2) + l] = fmaf((float)P, s, acc[8 * (b % 2) + l]);
            }
        }
        return tree16(acc);
    }
    const size_t bb = kv_qtype_block_bytes(type);
    for (int sb = 0; sb < K / 256; sb++) {
        int u[256], sc[256], m8[8];
        float d, dmin;
        kquant_ints(type, row + (size_t)sb * bb, u, sc, m8, &d, &dmin);
        const int8_t *qq = q + 256 * sb;
        float s = d * dx[sb];
        for (int l = 0; l < 16; l++) {
            int32_t P = 0;
            for (int c = 0; c < 4; c++)
                for (int i = 0; i < 4; i++) {
                    int e = 64 * c + 4 * l + i;
                    P += sc[e] * u[e] * qq[e];
                }
            acc[l] = fmaf((float)P, s, acc[l]);
        }
        if (type != KV_QTYPE_Q6_K) {
            int32_t Mi = 0;
            for (int j = 0; j < 8; j++) Mi += m8[j] * s32[8 * sb + j];
            mn = fmaf((float)Mi, dmin * dx[sb], mn);
        }
    }
    float y = tree16(acc);
    if (type != KV_QTYPE_Q6_K) y = y - mn;
    return y;
}

static int args_ok(int type, int n_rows, const struct kv_q8_act *a, int m0, int M) {
    int G = kv_q8_group(type);
    return G && a && a->group == G && n_rows >= 1 && M >= 1 && m0 >= 0 && m0 + M <= a->M && a->K % G == 0;
}

void kv_q8_dot_rows_ref(int type, const void *w, size_t row_bytes, int n_rows, const struct kv_q8_act *a, int m0,
                        int M, float *Y, size_t ldy) {
    if (!args_ok(type, n_rows, a, m0, M)) return;
    const int K = a->K, G = a->group;
    for (int m = 0; m < M; m++) {
        const int8_t *q = a->q + (size_t)(m0 + m) * K;
        const float *dx = a->d + (size_t)(m0 + m) * (K / G);
        const int16_t *s32 = a->s32 + (size_t)(m0 + m) * (K / 32);
        for (int r = 0; r < n_rows; r++)
            Y[(size_t)m * ldy + r] = ref_one(type, (const uint8_t *)w + (size_t)r * row_bytes, q, dx, s32, K);
    }
}

/* ---- dispatch ---- */

static atomic_int g_no_vnni;
void kv_q8_set_no_vnni(int on) { atomic_store(&g_no_vnni, on ? 1 : 0); }

void kv_q8_dot_rows(int type, const void *w, size_t row_bytes, int n_rows, const struct kv_q8_act *a, int m0, int M,
                    float *Y, size_t ldy) {
    if (!args_ok(type, n_rows, a, m0, M)) return;
#ifdef KV_QUANT_X86
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX512:
        kv_q8_dot_avx512(type, w, row_bytes, n_rows, a, m0, M, Y, ldy, !atomic_load_explicit(&g_no_vnni, memory_order_relaxed) && kv_q8_cpu_has_vnni());
        return;
    case KV_QUANT_ISA_AVX2: kv_q8_dot_avx2(type, w, row_bytes, n_rows, a, m0, M, Y, ldy); return;
    default: break;
    }
#endif
    kv_q8_dot_rows_ref(type, w, row_bytes, n_rows, a, m0, M, Y, ldy);
}
