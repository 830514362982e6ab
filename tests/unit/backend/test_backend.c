/*
 * CPU backend unit tests (no reference needed):
 *  - input validation (bad block ids, short block tables, bad token ids -> KV_EINVAL + message)
 *  - K/V land in the block slot backend.h documents
 *  - DETERMINISM: a sequence's logits and K/V are bitwise identical whether it runs alone,
 *    batched with others, in one chunk, token by token or in random chunks (chunked prefill).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/matmul.h"
#include "quant/q8.h"
#include "test_util.h"
#include "wmat_util.h"

static model_t *random_model_hd(model_arch arch, uint64_t seed, int head_dim) {
    struct model_config cfg = {0};
    cfg.arch = arch;
    cfg.n_vocab = 97;
    cfg.dim = 48;
    cfg.n_layers = 2;
    cfg.n_heads = 6;
    cfg.n_kv_heads = 2;
    cfg.head_dim = head_dim ? head_dim : arch == MODEL_ARCH_QWEN3 ? 12 : 8;
    cfg.ffn_dim = 80;
    cfg.rms_eps = 1e-6f;
    cfg.rope_theta = 10000.0f;
    cfg.rope_neox = arch != MODEL_ARCH_LLAMA;
    cfg.max_ctx = 256;
    cfg.attn_bias = arch == MODEL_ARCH_QWEN2;
    cfg.qk_norm = arch == MODEL_ARCH_QWEN3;
    cfg.tied_embeddings = arch != MODEL_ARCH_QWEN2;
    cfg.bos_id = 1;
    cfg.eos_id = 2;
    model_t *m = NULL;
    assert_int_equal(model_alloc(&cfg, &m), KV_OK);
    model_randomize(m, seed, 0.2f);
    return m;
}
static model_t *random_model(model_arch arch, uint64_t seed) { return random_model_hd(arch, seed, 0); }

/* ---- a tiny scheduler over S sequences ---- */
#define MAXS 6
#define MAXLEN 70
struct seqs {
    int n;
    int len[MAXS];
    int32_t tok[MAXS][MAXLEN];
};

struct run {
    int tpb, n_blocks;
    int kv_dtype;         /* enum kv_dtype of the pool (0 = f32) */
    int32_t bt[MAXS][32]; /* block tables */
    float *logits[MAXS];  /* (len, vocab) per position */
    float *kv[MAXS];      /* gathered K/V per position: (len, layers*2*kvh*hd) */
};

/* mode 0: each seq alone, one chunk. 1: all together, one chunk. 2: each alone, token by
 * token. 3: random chunks of random subsets of sequences per step. */
static void run_schedule(backend_t *be, const struct seqs *S, int mode, uint64_t seed, struct run *R) {
    const struct model_config *cfg = &be->model->cfg;
    int V = cfg->n_vocab;
    struct kv_geometry g = {.n_layers = cfg->n_layers, .n_kv_heads = cfg->n_kv_heads, .head_dim = cfg->head_dim,
                            .tokens_per_block = R->tpb, .kv_dtype = R->kv_dtype};
    assert_int_equal(be->ops->kv_alloc(be, R->n_blocks, &g), KV_OK);
    /* disjoint, shuffled block ids per sequence */
    kv_rng rng;
    kv_rng_seed(&rng, seed);
    int perm[256];
    for (int i = 0; i < R->n_blocks; i++) perm[i] = i;
    for (int i = R->n_blocks - 1; i > 0; i--) {
        int k = (int)(kv_rng_next(&rng) % (uint64_t)(i + 1));
        int t = perm[i]; perm[i] = perm[k]; perm[k] = t;
    }
    int used = 0;
    for (int s = 0; s < S->n; s++) {
        int nb = (S->len[s] + R->tpb - 1) / R->tpb;
        for (int k = 0; k < nb; k++) R->bt[s][k] = perm[used++];
        assert_true(used <= R->n_blocks);
        R->logits[s] = calloc((size_t)S->len[s] * V, sizeof(float));
    }
    int done[MAXS] = {0};
    float *out = malloc((size_t)MAXS * MAXLEN * V * sizeof(float));
    struct batch_seq bs[MAXS];
    char err[256];
    for (;;) {
        int n = 0, remaining = 0;
        for (int s = 0; s < S->n; s++) remaining += S->len[s] - done[s];
        if (!remaining) break;
        int chunk[MAXS] = {0};
        for (int s = 0; s < S->n; s++) {
            int left = S->len[s] - done[s];
            if (!left) continue;
            if (mode == 1) {
                chunk[s] = left;
            } else if (mode == 0 || mode == 2) { /* first unfinished sequence only */
                chunk[s] = mode == 0 ? left : 1;
                break;
            } else if (kv_rng_next(&rng) % 10 < 7) {
                chunk[s] = 1 + (int)(kv_rng_next(&rng) % (uint64_t)left);
            }
        }
        n = 0;
        int any = 0;
        for (int s = 0; s < S->n; s++) any |= chunk[s] > 0;
        if (!any) continue;
        for (int s = 0; s < S->n; s++) {
            if (!chunk[s]) continue;
            bs[n] = (struct batch_seq){.tokens = S->tok[s] + done[s], .n_tokens = chunk[s], .n_past = done[s],
                                       .block_table = R->bt[s], .n_blocks = (done[s] + chunk[s] + R->tpb - 1) / R->tpb,
                                       .logits = BATCH_LOGITS_ALL};
            n++;
        }
        struct batch b = {bs, n};
        kv_status frc = be->ops->forward(be, &b, out, err, sizeof err);
        if (frc) fail_msg("forward: %s", err);
        int row = 0;
        for (int s = 0; s < S->n; s++) {
            if (!chunk[s]) continue;
            memcpy(R->logits[s] + (size_t)done[s] * V, out + (size_t)row * V, (size_t)chunk[s] * V * sizeof(float));
            row += chunk[s];
            done[s] += chunk[s];
        }
    }
    free(out);
    /* gather K/V of every position through the documented layout */
    int hd = cfg->head_dim, kvh = cfg->n_kv_heads, per = cfg->n_layers * 2 * kvh * hd;
    size_t es = kv_dtype_size(R->kv_dtype);
    for (int s = 0; s < S->n; s++) {
        R->kv[s] = malloc((size_t)S->len[s] * per * sizeof(float));
        char *dst = (char *)R->kv[s];
        for (int p = 0; p < S->len[s]; p++) {
            const char *blk = (const char *)be->ops->block_ptr(be, R->bt[s][p / R->tpb]);
            assert_non_null(blk);
            for (int l = 0; l < cfg->n_layers; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (int h = 0; h < kvh; h++)
                        memcpy(dst + ((size_t)p * per + ((size_t)(l * 2 + kv) * kvh + h) * hd) * es,
                               blk + (((size_t)(l * 2 + kv) * kvh + h) * R->tpb + p % R->tpb) * hd * es, hd * es);
        }
    }
}

static void free_run(struct run *R, int n) {
    for (int s = 0; s < n; s++) free(R->logits[s]), free(R->kv[s]);
}

static void check_determinism_dt(model_t *m, int n_threads, uint64_t seed, int kv_dtype) {
    backend_t *be = NULL;
    char err[256];
    assert_int_equal(backend_cpu_new(m, n_threads, &be, err, sizeof err), KV_OK);
    kv_rng rng;
    kv_rng_seed(&rng, seed);
    struct seqs S = {.n = 5};
    for (int s = 0; s < S.n; s++) {
        S.len[s] = 1 + (int)(kv_rng_next(&rng) % 60);
        for (int i = 0; i < S.len[s]; i++) S.tok[s][i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)m->cfg.n_vocab);
    }
    S.len[0] = 37; /* more than two blocks of 16 and not a multiple of the gemm tile */
    int V = m->cfg.n_vocab, per = m->cfg.n_layers * 2 * m->cfg.n_kv_heads * m->cfg.head_dim;
    struct run ref = {.tpb = 16, .n_blocks = 40, .kv_dtype = kv_dtype};
    run_schedule(be, &S, 0, seed, &ref);
    for (int mode = 1; mode <= 5; mode++) {
        struct run r = {.tpb = 16, .n_blocks = 40, .kv_dtype = kv_dtype};
        run_schedule(be, &S, mode >= 3 ? 3 : mode, seed * 31 + (uint64_t)mode, &r);
        for (int s = 0; s < S.n; s++) {
            for (int p = 0; p < S.len[s]; p++) {
                if (memcmp(ref.logits[s] + (size_t)p * V, r.logits[s] + (size_t)p * V, V * sizeof(float))) {
                    fail_msg("mode %d seq %d pos %d: logits differ from the alone/one-chunk run", mode, s, p);
                }
            }
            if (memcmp(ref.kv[s], r.kv[s], (size_t)S.len[s] * per * kv_dtype_size(kv_dtype)))
                fail_msg("mode %d seq %d: K/V differ", mode, s);
        }
        free_run(&r, S.n);
    }
    /* sanity: logits are finite and not all equal */
    int finite = 1;
    for (int i = 0; i < S.len[0] * V; i++) finite &= ref.logits[0][i] == ref.logits[0][i];
    assert_true(finite);
    assert_true(ref.logits[0][0] != ref.logits[0][1] || ref.logits[0][1] != ref.logits[0][2]);
    free_run(&ref, S.n);
    backend_free(be);
}

static void check_determinism(model_t *m, int n_threads, uint64_t seed) {
    check_determinism_dt(m, n_threads, seed, KV_DTYPE_F32);
}

static void test_determinism_llama(void **st) {
    (void)st;
    model_t *m = random_model(MODEL_ARCH_LLAMA, 11);
    check_determinism(m, 1, 5);
    check_determinism(m, 2, 6);
    model_free(m);
}
/* head_dim 40: the attention dot product's 16-lane part and its scalar tail */
static void test_determinism_llama_hd40(void **st) {
    (void)st;
    model_t *m = random_model_hd(MODEL_ARCH_LLAMA, 14, 40);
    check_determinism(m, 2, 10);
    model_free(m);
}
/* f16 and bf16 KV pools: the same guarantee (K/V rounded once at store, widened exactly). */
static void test_determinism_kv16(void **st) {
    (void)st;
    model_t *m = random_model(MODEL_ARCH_LLAMA, 15);
    check_determinism_dt(m, 2, 21, KV_DTYPE_F16);
    check_determinism_dt(m, 2, 22, KV_DTYPE_BF16);
    model_free(m);
    m = random_model(MODEL_ARCH_QWEN3, 16); /* GQA */
    check_determinism_dt(m, 2, 23, KV_DTYPE_F16);
    /* and the 16-bit pools compute the same attention as f32 up to their rounding */
    backend_t *be = NULL;
    char err[256];
    assert_int_equal(backend_cpu_new(m, 2, &be, err, sizeof err), KV_OK);
    struct seqs S = {.n = 1, .len = {50}};
    for (int i = 0; i < 50; i++) S.tok[0][i] = (int32_t)((i * 37 + 5) % m->cfg.n_vocab);
    int dts[3] = {KV_DTYPE_F32, KV_DTYPE_F16, KV_DTYPE_BF16};
    double tol[3] = {0, 2e-3, 2e-2}; /* f16: 11-bit, bf16: 8-bit mantissa */
    struct run r[3];
    for (int d = 0; d < 3; d++) {
        r[d] = (struct run){.tpb = 16, .n_blocks = 40, .kv_dtype = dts[d]};
        run_schedule(be, &S, 0, 1, &r[d]);
    }
    size_t n = (size_t)50 * m->cfg.n_vocab;
    for (int d = 1; d < 3; d++) {
        double maxd = 0, maxa = 0;
        for (size_t i = 0; i < n; i++) {
            double e = fabs((double)r[d].logits[0][i] - r[0].logits[0][i]);
            if (e > maxd) maxd = e;
            if (fabs(r[0].logits[0][i]) > maxa) maxa = fabs(r[0].logits[0][i]);
        }
        fprintf(stderr, "kv %s: max |logit - f32 KV logit| = %.3g (max |logit| %.3g)\n", kv_dtype_name(dts[d]), maxd, maxa);
        assert_true(maxd > 0);               /* really rounded */
        assert_true(maxd <= tol[d] * maxa);  /* and still the same attention */
    }
    for (int d = 0; d < 3; d++) free_run(&r[d], 1);
    backend_free(be);
    model_free(m);
}
static void test_determinism_qwen2(void **st) {
    (void)st;
    model_t *m = random_model(MODEL_ARCH_QWEN2, 12);
    check_determinism(m, 2, 7);
    model_free(m);
}
static void test_determinism_qwen3(void **st) {
    (void)st;
    model_t *m = random_model(MODEL_ARCH_QWEN3, 13);
    check_determinism(m, 2, 8);
    model_free(m);
}
static void test_determinism_stories(void **st) {
    (void)st;
    char path[4096];
    if (!test_data_path(path, sizeof path, "models/stories260K/stories260K.gguf")) { skip(); return; }
    model_t *m = NULL;
    char err[256];
    assert_int_equal(model_load(path, &m, err, sizeof err), KV_OK);
    check_determinism(m, 2, 9);
    model_free(m);
}

/* ---- weights in their stored precision (models/tiny-quant: llama.cpp's quantizations of one
 * random model and llama.cpp's own dequantization of each back to F32) ---- */

static void random_seqs(struct seqs *S, int n_vocab, uint64_t seed) {
    kv_rng rng;
    kv_rng_seed(&rng, seed);
    S->n = 4;
    for (int s = 0; s < S->n; s++) {
        S->len[s] = s == 0 ? 37 : 1 + (int)(kv_rng_next(&rng) % 40);
        for (int i = 0; i < S->len[s]; i++) S->tok[s][i] = (int32_t)(kv_rng_next(&rng) % (uint64_t)n_vocab);
    }
}

/* Logits of every position of S, each sequence alone in one chunk (mode 0). */
static void run_alone(model_t *m, const struct seqs *S, struct run *R) {
    backend_t *be = NULL;
    char err[256];
    assert_int_equal(backend_cpu_new(m, 2, &be, err, sizeof err), KV_OK);
    R->tpb = 16, R->n_blocks = 40;
    run_schedule(be, S, 0, 3, R);
    backend_free(be);
}

static const char *const g_qtypes[] = {"F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"};

/* Loads tiny-<tag>.gguf into *q and its llama.cpp dequant-f32 twin into *f (both must exist). */
static void load_quant_pair(const char *tag, model_t **q, model_t **f) {
    char p1[4096], p2[4096], rel[256], err[256];
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", tag);
    assert_non_null(test_data_path(p1, sizeof p1, rel));
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.dequant-f32.gguf", tag);
    assert_non_null(test_data_path(p2, sizeof p2, rel));
    if (model_load(p1, q, err, sizeof err)) fail_msg("%s: %s", p1, err);
    if (model_load(p2, f, err, sizeof err)) fail_msg("%s: %s", p2, err);
}

/* The reduced-precision modes (mode INT8: 8-bit activations for quantized weights, bf16
 * activations for BF16 weights, the defaults) or the exact ones (F32 for both), or AUTO. */
static void set_modes(int mode) {
    kv_matmul_set_quant((enum kv_matmul_quant)mode);
    kv_matmul_set_bf16(mode == KV_MATMUL_QUANT_INT8 ? KV_MATMUL_BF16_BF16
                       : mode == KV_MATMUL_QUANT_F32 ? KV_MATMUL_BF16_F32
                                                     : KV_MATMUL_BF16_AUTO);
}

/* A model loaded from each quantized file keeps its matrices in the stored type, and in the
 * f32 quantized-matmul (and BF16-matmul) mode its logits are bitwise those of the F32 file holding llama.cpp's
 * dequantization of it (the kernels compute with exactly the dequantized floats, matmul.h). */
static void test_quant_equals_dequant_f32(void **st) {
    (void)st;
    set_modes(KV_MATMUL_QUANT_F32);
    char p1[4096], rel[256];
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", g_qtypes[0]);
    if (!test_data_path(p1, sizeof p1, rel)) { skip(); return; }
    for (size_t t = 0; t < sizeof g_qtypes / sizeof g_qtypes[0]; t++) {
        model_t *q = NULL, *f = NULL;
        load_quant_pair(g_qtypes[t], &q, &f);
        assert_int_not_equal(q->w.layers[0].w_up.type, KV_QTYPE_F32); /* not widened at load */
        assert_int_equal(f->w.layers[0].w_up.type, KV_QTYPE_F32);
        assert_true(model_weight_bytes(q) < model_weight_bytes(f));
        struct seqs S;
        random_seqs(&S, q->cfg.n_vocab, 100 + t);
        struct run rq = {0}, rf = {0};
        run_alone(q, &S, &rq);
        run_alone(f, &S, &rf);
        int V = q->cfg.n_vocab;
        for (int s = 0; s < S.n; s++)
            if (memcmp(rq.logits[s], rf.logits[s], (size_t)S.len[s] * V * sizeof(float)))
                fail_msg("%s: seq %d: logits differ from the dequant-f32 model's", g_qtypes[t], s);
        free_run(&rq, S.n);
        free_run(&rf, S.n);
        model_free(q);
        model_free(f);
    }
    set_modes(KV_MATMUL_QUANT_AUTO);
}

/* The int8 mode (the default; src/quant/q8.h) stays within the documented tolerance of the
 * dequant-f32 model: per position ||d|| / ||ref|| over the logits, mean and worst, and the
 * same argmax at (nearly) every position. So does the BF16 file in the bf16 matmul mode (the
 * default on AMD CPUs with AVX512_BF16; matmul_bf16.h). F16 files have neither: bitwise. */
static void test_quant_int8_close_to_f32(void **st) {
    (void)st;
    char p1[4096], rel[256], err[256];
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", g_qtypes[0]);
    if (!test_data_path(p1, sizeof p1, rel)) { skip(); return; }
    assert_int_equal(kv_matmul_set_quant(KV_MATMUL_QUANT_INT8), KV_MATMUL_QUANT_INT8);
    assert_int_equal(kv_matmul_set_bf16(KV_MATMUL_BF16_BF16), KV_MATMUL_BF16_BF16);
    for (size_t t = 0; t < sizeof g_qtypes / sizeof g_qtypes[0]; t++) {
        model_t *q = NULL, *f = NULL;
        load_quant_pair(g_qtypes[t], &q, &f);
        char p0[4096];
        assert_non_null(test_data_path(p0, sizeof p0, "models/tiny-quant/tiny-f32.gguf"));
        model_t *o = NULL;
        if (model_load(p0, &o, err, sizeof err)) fail_msg("%s: %s", p0, err);
        struct seqs S;
        random_seqs(&S, q->cfg.n_vocab, 100 + t);
        struct run rq = {0}, rf = {0}, ro = {0};
        run_alone(q, &S, &rq);
        run_alone(f, &S, &rf);
        run_alone(o, &S, &ro);
        int V = q->cfg.n_vocab, pos = 0, argmax_same = 0, bitwise = 1, argmax_wq = 0;
        double sum_rel = 0, worst = 0, sum_wq = 0;
        for (int s = 0; s < S.n; s++)
            for (int i = 0; i < S.len[s]; i++) {
                const float *a = rq.logits[s] + (size_t)i * V, *b = rf.logits[s] + (size_t)i * V;
                double num = 0, den = 0;
                int ia = 0, ib = 0;
                for (int v = 0; v < V; v++) {
                    num += ((double)a[v] - b[v]) * ((double)a[v] - b[v]);
                    den += (double)b[v] * b[v];
                    if (a[v] > a[ia]) ia = v;
                    if (b[v] > b[ib]) ib = v;
                }
                if (memcmp(a, b, (size_t)V * sizeof(float))) bitwise = 0;
                const float *c = ro.logits[s] + (size_t)i * V; /* the unquantized model */
                double numq = 0, denq = 0;
                int ic = 0;
                for (int v = 0; v < V; v++) {
                    numq += ((double)c[v] - b[v]) * ((double)c[v] - b[v]);
                    denq += (double)c[v] * c[v];
                    if (c[v] > c[ic]) ic = v;
                }
                sum_wq += sqrt(numq / denq);
                argmax_wq += ic == ib;
                double r = sqrt(num / den);
                sum_rel += r;
                if (r > worst) worst = r;
                argmax_same += ia == ib;
                pos++;
            }
        fprintf(stderr, "int8 %s vs dequant-f32: %d positions, ||d||/||ref|| mean %.2e worst %.2e, argmax equal %d/%d"
                        " (the weight quantization itself, dequant-f32 vs f32 original: mean %.2e, argmax equal %d/%d)\n",
                g_qtypes[t], pos, sum_rel / pos, worst, argmax_same, pos, sum_wq / pos, argmax_wq, pos);
        if (!strcmp(g_qtypes[t], "F16")) {
            assert_true(bitwise);
        } else if (!strcmp(g_qtypes[t], "BF16")) { /* bf16 activations: a much smaller error */
            assert_false(bitwise); /* the bf16 path really ran */
            assert_true(sum_rel / pos < 1e-2);
            assert_true(worst < 2e-2);
            assert_true(argmax_same * 20 >= pos * 19);
        } else {
            assert_false(bitwise); /* the integer path really ran */
            assert_true(sum_rel / pos < 2e-2);
            assert_true(worst < 3e-2);
            assert_true(sum_rel < sum_wq); /* smaller than the weight quantization's own error */
            assert_true(argmax_same * 10 >= pos * 9);
        }
        free_run(&rq, S.n);
        free_run(&rf, S.n);
        free_run(&ro, S.n);
        model_free(q);
        model_free(f);
        model_free(o);
    }
    set_modes(KV_MATMUL_QUANT_AUTO);
}

/* Alone == batched == chunked, bitwise, for every stored weight type. */
static void test_quant_determinism(void **st) {
    (void)st;
    char path[4096], rel[256], err[256];
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", g_qtypes[0]);
    if (!test_data_path(path, sizeof path, rel)) { skip(); return; }
    for (size_t t = 0; t < sizeof g_qtypes / sizeof g_qtypes[0]; t++) {
        snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", g_qtypes[t]);
        assert_non_null(test_data_path(path, sizeof path, rel));
        model_t *m = NULL;
        if (model_load(path, &m, err, sizeof err)) fail_msg("%s: %s", path, err);
        for (int mode = KV_MATMUL_QUANT_INT8; mode <= KV_MATMUL_QUANT_F32; mode++) {
            set_modes(mode);
            fprintf(stderr, "determinism with %s weights, %s quantized / %s BF16 matmul\n", g_qtypes[t],
                    kv_matmul_quant_name((enum kv_matmul_quant)mode), kv_matmul_bf16_name(kv_matmul_get_bf16()));
            check_determinism(m, 2, 40 + t);
        }
        set_modes(KV_MATMUL_QUANT_AUTO);
        model_free(m);
    }
}

/* Matrices repacked whole at backend creation (the default: Q8_0 on the integer path into the
 * q8 panels, F16/BF16 as rows copied or in qdot.h's grouped layout) give the bits of the in-place layout, for
 * decode and prefill rows, and the file pages they replace may be dropped: the model's own
 * bytes still read back unchanged (a private read-only map refaults them). */
static void check_prepack_same_bits(const char *file, int type) {
    char path[4096], rel[256], err[256];
    snprintf(rel, sizeof rel, "models/tiny-quant/%s", file);
    if (!test_data_path(path, sizeof path, rel)) { skip(); return; }
    model_t *m = NULL;
    if (model_load(path, &m, err, sizeof err)) fail_msg("%s: %s", path, err);
    assert_int_equal(m->w.layers[0].w_up.type, type);
    size_t nb = m->w.layers[0].w_up.row_bytes * (size_t)m->w.layers[0].w_up.rows;
    void *copy = malloc(nb);
    assert_non_null(copy);
    memcpy(copy, m->w.layers[0].w_up.data, nb);
    kv_matmul_set_quant(KV_MATMUL_QUANT_INT8);
    struct seqs S;
    random_seqs(&S, m->cfg.n_vocab, 77);
    /* runs: 0 the file layout (no_prepack), 1 F16/BF16 rows copied, 2 F16/BF16 grouped (for
     * Q8_0 runs 1 and 2 are the same repack) */
    struct run R[3] = {{0}, {0}, {0}};
    bool packs = type == KV_QTYPE_Q8_0 ? kv_q8_packed_fast(KV_QTYPE_Q8_0) : true;
    const enum backend_cpu_float_layout fls[3] = {BACKEND_CPU_FLOAT_AUTO, BACKEND_CPU_FLOAT_ROWS,
                                                  BACKEND_CPU_FLOAT_GROUPED};
    for (int v = 0; v < 3; v++) {
        struct backend_cpu_options o = {.n_threads = 2, .no_prepack = v == 0, .float_layout = fls[v]};
        backend_t *be = NULL;
        assert_int_equal(backend_cpu_new_ex(m, &o, &be, err, sizeof err), KV_OK);
        if (packs && v) assert_true(backend_cpu_panel_bytes(be) >= nb);
        else assert_int_equal(backend_cpu_panel_bytes(be), 0);
        R[v].tpb = 16, R[v].n_blocks = 40;
        run_schedule(be, &S, 3, 5, &R[v]); /* random chunks: decode and prefill rows */
        if (v) backend_cpu_wait_pages(be); /* then free joins nothing twice */
        backend_free(be);
    }
    for (int v = 1; v < 3; v++)
        for (int s = 0; s < S.n; s++)
            if (memcmp(R[0].logits[s], R[v].logits[s], (size_t)S.len[s] * m->cfg.n_vocab * sizeof(float)))
                fail_msg("%s seq %d: repacked weights (%s) give other logits than the file layout", file, s,
                         v == 1 ? "rows" : "grouped");
    assert_memory_equal(copy, m->w.layers[0].w_up.data, nb);
    for (int v = 0; v < 3; v++) free_run(&R[v], S.n);
    free(copy);
    kv_matmul_set_quant(KV_MATMUL_QUANT_AUTO);
    model_free(m);
}
static void test_prepack_same_bits(void **st) {
    (void)st;
    check_prepack_same_bits("tiny-Q8_0.gguf", KV_QTYPE_Q8_0);
    check_prepack_same_bits("tiny-F16.gguf", KV_QTYPE_F16);
    check_prepack_same_bits("tiny-BF16.gguf", KV_QTYPE_BF16);
}

/* Every kernel family the CPU has (generic, AVX2, AVX-512: kv_matmul_set_isa, which also
 * switches the dequantization kernels) gives the same logits, for every weight type. */
static void test_isa_families_agree(void **st) {
    (void)st;
    char path[4096], rel[256], err[256];
    const char *types[] = {"f32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"};
    snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", types[0]);
    if (!test_data_path(path, sizeof path, rel)) { skip(); return; }
    enum kv_matmul_isa isas[] = {KV_MATMUL_ISA_AVX512, KV_MATMUL_ISA_AVX2, KV_MATMUL_ISA_GENERIC};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        snprintf(rel, sizeof rel, "models/tiny-quant/tiny-%s.gguf", types[t]);
        assert_non_null(test_data_path(path, sizeof path, rel));
        model_t *m = NULL;
        if (model_load(path, &m, err, sizeof err)) fail_msg("%s: %s", path, err);
        struct seqs S;
        random_seqs(&S, m->cfg.n_vocab, 200 + t);
        S.n = 2;
        for (int mode = KV_MATMUL_QUANT_INT8; mode <= KV_MATMUL_QUANT_F32; mode++) {
        set_modes(mode);
        struct run ref = {0};
        int have = 0;
        for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
            if (kv_matmul_set_isa(isas[i]) != isas[i]) {
                fprintf(stderr, "SKIP part: this CPU lacks kernel family %d\n", (int)isas[i]);
                continue;
            }
            struct run r = {0};
            run_alone(m, &S, &r);
            if (!have++) {
                ref = r;
                continue;
            }
            for (int s = 0; s < S.n; s++)
                if (memcmp(ref.logits[s], r.logits[s], (size_t)S.len[s] * m->cfg.n_vocab * sizeof(float)))
                    fail_msg("%s weights, %s quantized matmul: kernel family %s differs from the first one", types[t],
                             kv_matmul_quant_name((enum kv_matmul_quant)mode), kv_matmul_isa_name());
            free_run(&r, S.n);
        }
        kv_matmul_set_isa(KV_MATMUL_ISA_AUTO);
        assert_true(have >= 2); /* generic is always there, plus at least one vector family on x86 */
        free_run(&ref, S.n);
        }
        set_modes(KV_MATMUL_QUANT_AUTO);
        model_free(m);
    }
}

static void test_validation(void **st) {
    (void)st;
    model_t *m = random_model(MODEL_ARCH_LLAMA, 3);
    backend_t *be = NULL;
    char err[256];
    assert_int_equal(backend_cpu_new(m, 2, &be, err, sizeof err), KV_OK);
    assert_string_equal(be->ops->name, "cpu");
    int32_t toks[20] = {5, 6, 7, 8};
    int32_t bt[3] = {0, 1, 2};
    float logits[4 * 97];
    struct batch_seq s = {.tokens = toks, .n_tokens = 4, .n_past = 0, .block_table = bt, .n_blocks = 1,
                          .logits = BATCH_LOGITS_LAST};
    struct batch b = {&s, 1};
    /* no pool yet */
    err[0] = 0;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    assert_true(strlen(err) > 0);
    struct kv_geometry bad = {.n_layers = m->cfg.n_layers + 1, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim, .tokens_per_block = 4};
    assert_int_equal(be->ops->kv_alloc(be, 3, &bad), KV_EINVAL);
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads, .head_dim = m->cfg.head_dim, .tokens_per_block = 4};
    /* unknown dtypes are refused, no pool left */
    int dts[2] = {9, -1};
    for (int i = 0; i < 2; i++) {
        bad = g;
        bad.kv_dtype = dts[i];
        assert_int_equal(be->ops->kv_alloc(be, 3, &bad), KV_EINVAL);
        assert_int_equal(be->n_blocks, 0);
        assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    }
    bad = g;
    bad.kv_dtype = KV_DTYPE_BF16;
    assert_int_equal(kv_block_bytes(&bad) * 2, kv_block_bytes(&g));
    bad.kv_dtype = 9;
    assert_int_equal(kv_block_bytes(&bad), 0);
    int dt = -1;
    assert_int_equal(kv_dtype_parse("bf16", &dt), KV_OK);
    assert_int_equal(dt, KV_DTYPE_BF16);
    assert_int_equal(kv_dtype_parse("f32", &dt), KV_OK);
    assert_int_equal(dt, KV_DTYPE_F32);
    assert_int_equal(kv_dtype_parse("fp8", &dt), KV_EINVAL);
    assert_int_equal(dt, KV_DTYPE_F32);
    assert_string_equal(kv_dtype_name(KV_DTYPE_BF16), "bf16");
    assert_int_equal(be->ops->kv_alloc(be, 3, &g), KV_OK);
    assert_int_equal(kv_block_bytes(&g), (size_t)m->cfg.n_layers * 2 * m->cfg.n_kv_heads * 4 * m->cfg.head_dim * 4);
    assert_int_equal(batch_n_logits(&b), 1);
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_OK);
    /* block id outside the pool */
    bt[0] = 3;
    err[0] = 0;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "block id 3"));
    bt[0] = -1;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    bt[0] = 0;
    /* table too short: 5 positions need 2 blocks of 4 */
    s.n_past = 1;
    err[0] = 0;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "block table"));
    s.n_blocks = 2;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_OK);
    /* token ids */
    toks[2] = 97;
    err[0] = 0;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "token id 97"));
    toks[2] = -4;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    toks[2] = 7;
    s.n_tokens = 0;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    s.n_tokens = 4;
    s.n_past = -1;
    assert_int_equal(be->ops->forward(be, &b, logits, err, sizeof err), KV_EINVAL);
    s.n_past = 0;
    /* empty batch is fine */
    struct batch e = {NULL, 0};
    assert_int_equal(be->ops->forward(be, &e, logits, err, sizeof err), KV_OK);
    /* block_ptr / copy_blocks */
    assert_null(be->ops->block_ptr(be, 3));
    float *b0 = be->ops->block_ptr(be, 0), *b2 = be->ops->block_ptr(be, 2);
    assert_non_null(b0);
    int32_t src = 0, dst = 2, oob = 7;
    assert_int_equal(be->ops->copy_blocks(be, &src, &dst, 1), KV_OK);
    assert_memory_equal(b0, b2, kv_block_bytes(&g));
    assert_int_equal(be->ops->copy_blocks(be, &src, &oob, 1), KV_EINVAL);
    backend_free(be);
    model_free(m);
}

/* The K of position p for layer 0 equals RoPE(W_k * rmsnorm(embedding)), computed here
 * naively; checks the documented slot layout and the K projection. */
static void test_kv_layout(void **st) {
    (void)st;
    model_t *m = random_model(MODEL_ARCH_LLAMA, 21);
    const struct model_config *c = &m->cfg;
    backend_t *be = NULL;
    char err[256];
    assert_int_equal(backend_cpu_new(m, 1, &be, err, sizeof err), KV_OK);
    struct kv_geometry g = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .tokens_per_block = 4};
    assert_int_equal(be->ops->kv_alloc(be, 4, &g), KV_OK);
    int32_t toks[6] = {3, 9, 27, 81, 50, 60}, bt[2] = {2, 0};
    struct batch_seq s = {.tokens = toks, .n_tokens = 6, .block_table = bt, .n_blocks = 2};
    struct batch b = {&s, 1};
    assert_int_equal(be->ops->forward(be, &b, NULL, err, sizeof err), KV_OK);
    int hd = c->head_dim;
    const float *wk = kv_wmat_f32(&m->w.layers[0].wk), *wv = kv_wmat_f32(&m->w.layers[0].wv);
    for (int p = 0; p < 6; p++) {
        const float *e = kv_wmat_f32(&m->w.tok_embd) + (size_t)toks[p] * c->dim;
        double ss = 0;
        for (int i = 0; i < c->dim; i++) ss += (double)e[i] * e[i];
        double inv = 1.0 / sqrt(ss / c->dim + c->rms_eps);
        for (int h = 0; h < c->n_kv_heads; h++) {
            double k[64], v[64];
            for (int o = 0; o < hd; o++) {
                double sk = 0, sv = 0;
                for (int i = 0; i < c->dim; i++) {
                    double xn = e[i] * inv * m->w.layers[0].attn_norm[i];
                    sk += wk[(size_t)(h * hd + o) * c->dim + i] * xn;
                    sv += wv[(size_t)(h * hd + o) * c->dim + i] * xn;
                }
                k[o] = sk, v[o] = sv;
            }
            for (int i = 0; i < hd / 2; i++) { /* adjacent-pair RoPE (llama GGUF convention) */
                double th = p * pow(c->rope_theta, -2.0 * i / hd);
                double a = k[2 * i], bb = k[2 * i + 1];
                k[2 * i] = a * cos(th) - bb * sin(th);
                k[2 * i + 1] = a * sin(th) + bb * cos(th);
            }
            const float *blk = be->ops->block_ptr(be, bt[p / 4]);
            const float *ks = blk + ((size_t)(0 * c->n_kv_heads + h) * 4 + p % 4) * hd;
            const float *vs = blk + ((size_t)(1 * c->n_kv_heads + h) * 4 + p % 4) * hd;
            for (int o = 0; o < hd; o++) {
                assert_float_equal(ks[o], k[o], 1e-4);
                assert_float_equal(vs[o], v[o], 1e-4);
            }
        }
    }
    /* block 1 was never used by the table: still zero */
    const float *b1 = be->ops->block_ptr(be, 1);
    for (size_t i = 0; i < kv_block_bytes(&g) / 4; i++) assert_true(b1[i] == 0.0f);
    backend_free(be);
    model_free(m);
}

/* Gemm modes: names round-trip, bad options are refused, and the OpenBLAS mode (one sgemm
 * over all rows, not batch-invariant) computes the same logits as the default invariant
 * kernel up to f32 rounding. */
static void test_gemm_modes(void **st) {
    (void)st;
    enum backend_cpu_gemm g = BACKEND_CPU_GEMM_OPENBLAS;
    assert_int_equal(backend_cpu_gemm_parse("invariant", &g), KV_OK);
    assert_int_equal(g, BACKEND_CPU_GEMM_INVARIANT);
    assert_int_equal(backend_cpu_gemm_parse("openblas", &g), KV_OK);
    assert_int_equal(g, BACKEND_CPU_GEMM_OPENBLAS);
    assert_int_equal(backend_cpu_gemm_parse("blas", &g), KV_EINVAL);
    assert_int_equal(g, BACKEND_CPU_GEMM_OPENBLAS);
    assert_string_equal(backend_cpu_gemm_name(BACKEND_CPU_GEMM_INVARIANT), "invariant");
    assert_string_equal(backend_cpu_gemm_name(BACKEND_CPU_GEMM_OPENBLAS), "openblas");
    assert_null(backend_cpu_gemm_name((enum backend_cpu_gemm)7));

    model_t *m = random_model(MODEL_ARCH_QWEN2, 31); /* with q/k/v biases */
    const struct model_config *c = &m->cfg;
    char err[256];
    backend_t *be[2] = {NULL, NULL};
    struct backend_cpu_options bad = {.n_threads = 2, .gemm = (enum backend_cpu_gemm)7};
    assert_int_equal(backend_cpu_new_ex(m, &bad, &be[0], err, sizeof err), KV_EINVAL);
    assert_null(be[0]);
    assert_int_equal(backend_cpu_new_ex(m, NULL, &be[0], err, sizeof err), KV_EINVAL);
    struct backend_cpu_options o = {.n_threads = 2};
    assert_int_equal(backend_cpu_new_ex(m, &o, &be[0], err, sizeof err), KV_OK);
    o.gemm = BACKEND_CPU_GEMM_OPENBLAS;
    assert_int_equal(backend_cpu_new_ex(m, &o, &be[1], err, sizeof err), KV_OK);
    int32_t toks[40], bt[3] = {0, 1, 2};
    for (int i = 0; i < 40; i++) toks[i] = (int32_t)((i * 37 + 5) % c->n_vocab);
    float *lg[2];
    for (int i = 0; i < 2; i++) {
        struct kv_geometry geo = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .tokens_per_block = 16};
        assert_int_equal(be[i]->ops->kv_alloc(be[i], 3, &geo), KV_OK);
        struct batch_seq s = {.tokens = toks, .n_tokens = 40, .block_table = bt, .n_blocks = 3,
                              .logits = BATCH_LOGITS_ALL};
        struct batch b = {&s, 1};
        lg[i] = malloc((size_t)40 * c->n_vocab * sizeof(float));
        assert_int_equal(be[i]->ops->forward(be[i], &b, lg[i], err, sizeof err), KV_OK);
    }
    double maxabs = 0, maxdiff = 0;
    for (int i = 0; i < 40 * c->n_vocab; i++) {
        double d = fabs((double)lg[0][i] - lg[1][i]);
        maxdiff = d > maxdiff ? d : maxdiff;
        maxabs = fabs(lg[0][i]) > maxabs ? fabs(lg[0][i]) : maxabs;
    }
    assert_true(maxabs > 1e-3);
    if (maxdiff > 1e-4 * maxabs) fail_msg("openblas vs invariant logits: max diff %g (max |logit| %g)", maxdiff, maxabs);
    free(lg[0]), free(lg[1]);
    backend_free(be[0]), backend_free(be[1]);
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_validation),
        cmocka_unit_test(test_kv_layout),
        cmocka_unit_test(test_gemm_modes),
        cmocka_unit_test(test_determinism_llama),
        cmocka_unit_test(test_determinism_llama_hd40),
        cmocka_unit_test(test_determinism_kv16),
        cmocka_unit_test(test_determinism_qwen2),
        cmocka_unit_test(test_determinism_qwen3),
        cmocka_unit_test(test_determinism_stories),
        cmocka_unit_test(test_quant_equals_dequant_f32),
        cmocka_unit_test(test_quant_int8_close_to_f32),
        cmocka_unit_test(test_quant_determinism),
        cmocka_unit_test(test_isa_families_agree),
        cmocka_unit_test(test_prepack_same_bits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
