/*
 * q8: activation quantization, the scalar reference of the integer dot contract (q8.h), the
 * generic kernel and the per-ISA dispatch. The x86 kernels are in q8_avx2.c, q8_avx512.c and q8_amx.c.
 *
 * Integer bounds (why no sum can overflow int32, |q| <= 127):
 *   block / sub-block sums: 32 * 128 * 127 = 520,192
 *   K-quant super-block S: Q4_K 8 * 63 * 32 * 15 * 127 = 3.1e7, Q5_K 6.4e7, Q6_K 16 * 128 * 16 *
 *   32 * 127 = 1.3e8; the min term 8 * 63 * 32 * 127 = 2.0e6; panel sums with the +128 offset
 *   add at most 32 * 128 * 127 more. All below 2^31.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "q8.h"
#include "q8_internal.h"

#include <math.h>
#include <stdlib.h>
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
    return ALIGN64(m * k) + ALIGN64(m * (k / (size_t)group) * sizeof(float)) + ALIGN64(m * (k / 16) * sizeof(int16_t));
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
    a->s16 = (int16_t *)(void *)p;
    return 0;
}

/* ---- quantization (scalar; the vector versions are in q8_avx2.c / q8_avx512.c and give the same bytes) ---- */

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
        int16_t *s = a->s16 + (size_t)m * (K / 16);
        for (int j = 0; j < K / 16; j++) {
            int t = 0;
            for (int i = 0; i < 16; i++) t += q[16 * j + i];
            s[j] = (int16_t)t;
        }
    }
}

/* ---- the contract, literally ---- */

static float h2f(const uint8_t *p) { return kv_quant_h2f(kv_quant_ld16(p)); }

/* Element i (0..31) of a Q8_0 / Q4_0 block as the contract's signed integer (quant, nibble - 8). */
static int g32_int(int type, const uint8_t *blk, int i) {
    if (type == KV_QTYPE_Q8_0) return (int8_t)blk[2 + i];
    return (i < 16 ? (blk[2 + i] & 15) : (blk[2 + i - 16] >> 4)) - 8;
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
static float ref_one(int type, const uint8_t *row, const int8_t *q, const float *dx, const int16_t *s16, int K) {
    float acc = 0.0f, mn = 0.0f;
    if (kv_q8_group(type) == 32) {
        const size_t bb = type == KV_QTYPE_Q8_0 ? 34 : 18;
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (size_t)b * bb;
            int32_t S = 0;
            for (int i = 0; i < 32; i++) {
                S += g32_int(type, blk, i) * q[32 * b + i];
            }
            acc = fmaf((float)S, h2f(blk) * dx[b], acc);
        }
        return acc;
    }
    const size_t bb = kv_qtype_block_bytes(type);
    for (int sb = 0; sb < K / 256; sb++) {
        int u[256], sc[256], m8[8];
        float d, dmin;
        kquant_ints(type, row + (size_t)sb * bb, u, sc, m8, &d, &dmin);
        const int8_t *qq = q + 256 * sb;
        const int sub = type == KV_QTYPE_Q6_K ? 16 : 32;
        int32_t S = 0;
        for (int j = 0; j < 256 / sub; j++) {
            int32_t t = 0;
            for (int i = 0; i < sub; i++) t += u[sub * j + i] * qq[sub * j + i];
            S += sc[sub * j] * t;
        }
        acc = fmaf((float)S, d * dx[sb], acc);
        if (type != KV_QTYPE_Q6_K) {
            int32_t Mi = 0;
            for (int j = 0; j < 8; j++) Mi += m8[j] * (s16[16 * sb + 2 * j] + s16[16 * sb + 2 * j + 1]);
            mn = fmaf((float)Mi, dmin * dx[sb], mn);
        }
    }
    return type == KV_QTYPE_Q6_K ? acc : acc - mn;
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
        const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16);
        for (int r = 0; r < n_rows; r++)
            Y[(size_t)m * ldy + r] = ref_one(type, (const uint8_t *)w + (size_t)r * row_bytes, q, dx, s16, K);
    }
}

/* ---- panels (prefill) ---- */

size_t kv_q8_pack_bytes(int type, int n_rows, int K) {
    struct kv_q8_geo g = kv_q8_geo(type);
    if (!g.G || n_rows < 1 || K < 1 || K % g.G) return 0;
    return (size_t)((n_rows + 15) / 16) * (size_t)(K / g.G) * g.grp;
}

int kv_q8_pack(int type, const void *w, size_t row_bytes, int n_rows, int K, void *panel) {
    struct kv_q8_geo g = kv_q8_geo(type);
    size_t total = kv_q8_pack_bytes(type, n_rows, K);
    if (!total) return -1;
    if (n_rows % 16) memset(panel, 0, total); /* pad rows (full groups are written whole) */
#ifdef KV_QUANT_X86
    if (kv_quant_get_isa() == KV_QUANT_ISA_AVX512) {
        kv_q8_pack_avx512(type, w, row_bytes, n_rows, K, panel);
        return 0;
    }
    if (kv_quant_get_isa() == KV_QUANT_ISA_AVX2) {
        kv_q8_pack_avx2(type, w, row_bytes, n_rows, K, panel);
        return 0;
    }
#endif
    const size_t bb = kv_qtype_block_bytes(type);
    const int ng = K / g.G;
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *row = (const uint8_t *)w + (size_t)r * row_bytes;
        uint8_t *rg = (uint8_t *)panel + (size_t)(r / 16) * (size_t)ng * g.grp;
        const int n = r % 16;
        for (int s = 0; s < ng; s++) {
            uint8_t *grp = rg + (size_t)s * g.grp;
            const uint8_t *blk = row + (size_t)s * bb;
            int u[256], sc[256], m8[8];
            float d, dmin;
            if (!g.kq) {
                d = h2f(blk);
                dmin = 0.0f;
                for (int i = 0; i < 32; i++) {
                    u[i] = g32_int(type, blk, i);
                    sc[i] = 1;
                }
            } else {
                kquant_ints(type, blk, u, sc, m8, &d, &dmin);
            }
            memcpy(grp + 4 * n, &d, 4);
            if (g.kq) memcpy(grp + 64 + 4 * n, &dmin, 4);
            if (g.mins)
                for (int j = 0; j < 8; j++) memcpy(grp + 128 + 64 * j + 4 * n, &m8[j], 4);
            for (int j = 0; j < g.J; j++) {
                uint8_t *sub = grp + g.hdr + (size_t)j * g.sub;
                if (g.kq) {
                    int32_t scj = sc[g.S * j];
                    memcpy(sub + 4 * n, &scj, 4);
                }
                uint8_t *v = sub + (g.kq ? 64 : 0);
                for (int i = 0; i < g.S; i++) v[(i / 4) * 64 + 4 * n + i % 4] = (uint8_t)(int8_t)u[g.S * j + i];
            }
        }
    }
    return 0;
}

static int32_t ld32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
static float ldf(const uint8_t *p) {
    float v;
    memcpy(&v, p, 4);
    return v;
}

/* The packed contract in scalar C (the generic family's prefill kernel). */
static void packed_generic(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                           float *Y, size_t ldy) {
    struct kv_q8_geo g = kv_q8_geo(type);
    const int K = a->K, ng = K / g.G;
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *rg = panel + (size_t)(r / 16) * (size_t)ng * g.grp;
        const int n = r % 16;
        for (int m = 0; m < M; m++) {
            const int8_t *q = a->q + (size_t)(m0 + m) * K;
            const float *dx = a->d + (size_t)(m0 + m) * ng;
            const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16);
            float acc = 0.0f, mn = 0.0f;
            for (int s = 0; s < ng; s++) {
                const uint8_t *grp = rg + (size_t)s * g.grp;
                int32_t S = 0;
                for (int j = 0; j < g.J; j++) {
                    const uint8_t *sub = grp + g.hdr + (size_t)j * g.sub;
                    const uint8_t *v = sub + (g.kq ? 64 : 0);
                    const int e0 = s * g.G + j * g.S;
                    int32_t t = 0;
                    for (int i = 0; i < g.S; i++) t += (int8_t)v[(i / 4) * 64 + 4 * n + i % 4] * q[e0 + i];
                    S += g.kq ? ld32(sub + 4 * n) * t : t;
                }
                acc = fmaf((float)S, ldf(grp + 4 * n) * dx[s], acc);
                if (g.mins) {
                    int32_t Mi = 0;
                    for (int j = 0; j < 8; j++)
                        Mi += ld32(grp + 128 + 64 * j + 4 * n) * (s16[16 * s + 2 * j] + s16[16 * s + 2 * j + 1]);
                    mn = fmaf((float)Mi, ldf(grp + 64 + 4 * n) * dx[s], mn);
                }
            }
            Y[(size_t)m * ldy + r] = g.mins ? acc - mn : acc;
        }
    }
}

int kv_q8_amx_env(void) {
    const char *e = getenv("KVSERVE_CPU_AMX");
    if (!e || !*e || !strcmp(e, "1")) return 1;
    return !strcmp(e, "0") ? 0 : -1;
}

/* ---- dispatch ---- */

static atomic_int g_limits; /* bit 0: no VNNI, bit 1: no AMX */
void kv_q8_set_limits(int bits) { atomic_store(&g_limits, bits); }
static int limits(void) { return atomic_load_explicit(&g_limits, memory_order_relaxed); }

void kv_q8_dot_rows(int type, const void *w, size_t row_bytes, int n_rows, const struct kv_q8_act *a, int m0, int M,
                    float *Y, size_t ldy) {
    if (!args_ok(type, n_rows, a, m0, M)) return;
#ifdef KV_QUANT_X86
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX512:
        kv_q8_dot_avx512(type, w, row_bytes, n_rows, a, m0, M, Y, ldy, !(limits() & 1) && kv_q8_cpu_has_vnni());
        return;
    case KV_QUANT_ISA_AVX2: kv_q8_dot_avx2(type, w, row_bytes, n_rows, a, m0, M, Y, ldy); return;
    default: break;
    }
#endif
    kv_q8_dot_rows_ref(type, w, row_bytes, n_rows, a, m0, M, Y, ldy);
}

int kv_q8_packed_fast(int type) {
#ifdef KV_QUANT_X86
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX512:
        if ((!(limits() & 2) && kv_q8_cpu_has_amx()) || (!(limits() & 1) && kv_q8_cpu_has_vnni())) return 1;
        return kv_q8_group(type) != 0;
    case KV_QUANT_ISA_AVX2: return kv_q8_group(type) != 0;
    default: break;
    }
#endif
    (void)type;
    return 0;
}

int kv_q8_rows_preferred(int type, int M) {
#ifdef KV_QUANT_X86
    const int kq = type == KV_QTYPE_Q4_K || type == KV_QTYPE_Q5_K || type == KV_QTYPE_Q6_K;
    switch (kv_quant_get_isa()) {
    case KV_QUANT_ISA_AVX2: return kq && M <= KV_Q8_ROWS_MAX_M;
    case KV_QUANT_ISA_AVX512: /* against AMX tiles the repack pays off sooner: not measured, keep it */
        return kq && M <= KV_Q8_ROWS_MAX_M_512 && !(!(limits() & 2) && kv_q8_cpu_has_amx());
    default: break;
    }
#endif
    (void)type;
    (void)M;
    return 0;
}

const char *kv_q8_packed_name(void) {
#ifdef KV_QUANT_X86
    if (kv_quant_get_isa() == KV_QUANT_ISA_AVX512) {
        if (!(limits() & 2) && kv_q8_cpu_has_amx()) return "amx";
        if (!(limits() & 1) && kv_q8_cpu_has_vnni()) return "avx512-vnni";
    }
    if (kv_quant_get_isa() >= KV_QUANT_ISA_AVX2) return "avx2";
#endif
    return "none";
}

void kv_q8_dot_packed(int type, const void *panel, int n_rows, const struct kv_q8_act *a, int m0, int M, float *Y,
                      size_t ldy) {
    if (!args_ok(type, n_rows, a, m0, M) || !panel) return;
#ifdef KV_QUANT_X86
    if (kv_quant_get_isa() == KV_QUANT_ISA_AVX512) {
        if (!(limits() & 2) && kv_q8_cpu_has_amx()) {
            kv_q8_packed_amx(type, panel, n_rows, a, m0, M, Y, ldy);
            return;
        }
        if (!(limits() & 1) && kv_q8_cpu_has_vnni()) {
            kv_q8_packed_avx512vnni(type, panel, n_rows, a, m0, M, Y, ldy);
            return;
        }
    }
    if (kv_quant_get_isa() >= KV_QUANT_ISA_AVX2) {
        kv_q8_packed_avx2(type, panel, n_rows, a, m0, M, Y, ldy);
        return;
    }
#endif
    packed_generic(type, panel, n_rows, a, m0, M, Y, ldy);
}
