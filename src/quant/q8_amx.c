/*
 * q8_amx: the AMX-INT8 kernel of kv_q8_dot_packed (q8.h): 16 activation rows a tile; fewer
 * rows left over run the AVX-512 VNNI kernel (q8_avx512.c). Per-function target attributes,
 * as in q8_x86_internal.h.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "q8_x86_internal.h"

#ifdef KV_QUANT_X86

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

/* AMX-INT8: the CPU has it, Linux granted this process the tile data state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, Linux >= 5.16), and KVSERVE_CPU_AMX is not 0. Decided once. */
#define KV_ARCH_REQ_XCOMP_PERM 0x1023
#define KV_XFEATURE_XTILEDATA 18
static int g_amx;
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;
static void amx_probe(void) {
    __builtin_cpu_init();
    if (kv_q8_amx_env() == 0) return;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("avx512vnni"))
        return;
    g_amx = syscall(SYS_arch_prctl, KV_ARCH_REQ_XCOMP_PERM, KV_XFEATURE_XTILEDATA) == 0;
}
int kv_q8_cpu_has_amx(void) {
    pthread_once(&g_amx_once, amx_probe);
    return g_amx;
}

/* ---------------- AMX (prefill, 16 activation rows at a time) ---------------- */

#define AMXT __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Tile configuration (64 bytes, palette 1): two sets of (C = 16 x 16 int32, A = 16 activation
 * rows x S bytes, B = S / 4 rows x 64 bytes of the panel): tmm0-2 and tmm3-5, so the product of
 * the next sub-block runs while the previous one's result is read back (amx_tile). Loaded per
 * thread when the sub-block size S changes (AMX state is per thread). */
struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static __thread int t_amx_s; /* S of the configuration loaded on this thread, 0 = none */

AMXT static void amx_config(int S) {
    if (t_amx_s == S) return;
    struct amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = 16, c.colsb[t] = 64;
        c.rows[t + 1] = 16, c.colsb[t + 1] = (uint16_t)S;
        c.rows[t + 2] = (uint8_t)(S / 4), c.colsb[t + 2] = 64;
    }
    /* GCC 12 does not see that ldtilecfg reads c and drops the stores above without this */
    __asm__ volatile("" : : "m"(c) : "memory");
    _tile_loadconfig(&c);
    t_amx_s = S;
}

/* Sub-block t (= group s, sub-block j) of a 16-row panel group rg x 16 activation rows: the
 * tile product into C from A, B (tile numbers: compile-time), its 16 x 16 int32 result stored
 * to cb. */
#define AMX_PRODUCT(C, A, B, t, cb)                                                                 \
    do {                                                                                           \
        const int s_ = (t) / g.J, j_ = (t) % g.J;                                                  \
        const uint8_t *sub_ = rg + (size_t)s_ * g.grp + g.hdr + (size_t)j_ * g.sub;                \
        _tile_zero(C);                                                                             \
        _tile_loadd(A, q0 + (size_t)s_ * g.G + (size_t)j_ * g.S, K);                               \
        _tile_loadd(B, sub_ + (g.kq ? 64 : 0), 64);                                                \
        _tile_dpbssd(C, A, B);                                                                     \
        _tile_stored(C, cb, 64);                                                                   \
    } while (0)

/* Adds sub-block t's int32 products cb into I (scaled by the sub-block scales for K-quants);
 * after a group's last sub-block, adds the group into acc / mn in float and clears I. */
AMXT static ALWAYS void amx_consume(int type, const uint8_t *rg, const struct kv_q8_act *a, int m0, int t,
                                    int32_t cb[16][16], __m512i I[16], __m512 acc[16], __m512 mn[16]) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int K = a->K, ng = K / g.G, s = t / g.J, j = t % g.J;
    const uint8_t *grp = rg + (size_t)s * g.grp;
    if (g.kq) {
        const __m512i sc = _mm512_load_si512((const void *)(grp + g.hdr + (size_t)j * g.sub));
        _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++)
            I[m] = _mm512_add_epi32(I[m], _mm512_mullo_epi32(_mm512_load_si512((const void *)cb[m]), sc));
    } else {
        _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++) I[m] = _mm512_load_si512((const void *)cb[m]);
    }
    if (j != g.J - 1) return;
    const __m512 dv = _mm512_load_ps((const float *)grp);
    __m512 dmv = _mm512_setzero_ps();
    /* the mins term sum_j min_j * bsum_j (8 sub-blocks) in vpmaddwd pairs instead of 8
     * vpmulld a row (2 uops each on one port: they were half the kernel's vector work): mins
     * (6-bit, >= 0) of sub-blocks 2i, 2i+1 as the int16 halves of each lane, the row's two
     * 32-element sums (|.| <= 32 * 128) as the broadcast int16 pair; exact, like the products */
    __m512i mp[4];
    if (g.mins) {
        dmv = _mm512_load_ps((const float *)(grp + 64));
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
            mp[i] = _mm512_or_si512(_mm512_load_si512((const void *)(grp + 128 + 128 * i)),
                                    _mm512_slli_epi32(_mm512_load_si512((const void *)(grp + 192 + 128 * i)), 16));
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++) {
        const float dxs = a->d[(size_t)(m0 + m) * ng + s];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[m]), _mm512_mul_ps(dv, _mm512_set1_ps(dxs)), acc[m]);
        I[m] = _mm512_setzero_si512();
        if (g.mins) {
            const int16_t *s16 = a->s16 + (size_t)(m0 + m) * (K / 16) + 16 * (size_t)s;
            __m512i Mi = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                const uint32_t b0 = (uint16_t)(s16[4 * i] + s16[4 * i + 1]), b1 = (uint16_t)(s16[4 * i + 2] + s16[4 * i + 3]);
                Mi = _mm512_add_epi32(Mi, _mm512_madd_epi16(mp[i], _mm512_set1_epi32((int)(b0 | b1 << 16))));
            }
            mn[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mi), _mm512_mul_ps(dmv, _mm512_set1_ps(dxs)), mn[m]);
        }
    }
}

/* One 16-row group of the panel (nr valid) x 16 activation rows from m0. The sub-blocks' tile
 * products alternate between the two tile sets, one ahead of the vector work that reads them
 * back: reading a tile's stored result right after its store waited for the store (perf put a
 * quarter of the prefill on that load). The integer sums are exact, the float steps keep their
 * order: the same bits as one product at a time. */
AMXT static ALWAYS void amx_tile(int type, const uint8_t *rg, int nr, const struct kv_q8_act *a, int m0, float *Y,
                                 size_t ldy) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const int K = a->K, T = K / g.G * g.J;
    int32_t cb[2][16][16] __attribute__((aligned(64)));
    __m512 acc[16], mn[16];
    __m512i I[16];
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++) {
        acc[m] = mn[m] = _mm512_setzero_ps();
        I[m] = _mm512_setzero_si512();
    }
    const int8_t *q0 = a->q + (size_t)m0 * K;
    if (T > 0) AMX_PRODUCT(0, 1, 2, 0, cb[0]);
    for (int t = 0; t < T; t += 2) {
        if (t + 1 < T) AMX_PRODUCT(3, 4, 5, t + 1, cb[1]);
        amx_consume(type, rg, a, m0, t, cb[0], I, acc, mn);
        if (t + 1 < T) {
            if (t + 2 < T) AMX_PRODUCT(0, 1, 2, t + 2, cb[0]);
            amx_consume(type, rg, a, m0, t + 1, cb[1], I, acc, mn);
        }
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; m++)
        _mm512_mask_storeu_ps(Y + (size_t)m * ldy, k, g.mins ? _mm512_sub_ps(acc[m], mn[m]) : acc[m]);
}

AMXT static ALWAYS void amx_t(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                              float *Y, size_t ldy) {
    const struct kv_q8_geo g = kv_q8_geo(type);
    const size_t rgb = (size_t)(a->K / g.G) * g.grp;
    const int M16 = M - M % 16;
    amx_config(g.S);
    for (int r = 0; r < n_rows; r += 16) {
        const int nr = n_rows - r < 16 ? n_rows - r : 16;
        const uint8_t *rg = panel + (size_t)(r / 16) * rgb;
        for (int m = 0; m < M16; m += 16) amx_tile(type, rg, nr, a, m0 + m, Y + (size_t)m * ldy + r, ldy);
    }
    /* fewer than 16 rows left: the VNNI kernel (same bits) */
    if (M16 < M) kv_q8_packed_avx512vnni(type, panel, n_rows, a, m0 + M16, M - M16, Y + (size_t)M16 * ldy, ldy);
}

AMXT void kv_q8_packed_amx(int type, const uint8_t *panel, int n_rows, const struct kv_q8_act *a, int m0, int M,
                           float *Y, size_t ldy) {
    Q8_DISPATCH(type, amx_t, panel, n_rows, a, m0, M, Y, ldy);
}

#endif /* KV_QUANT_X86 */
