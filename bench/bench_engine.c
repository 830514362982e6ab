/*
 * bench_engine: prefill and decode throughput of the engine + CPU backend, without HTTP.
 *
 *   bench_engine --model PATH [--threads N] [--prompt-len 256] [--gen-len 64]
 *                [--concurrency 1,16] [--tokens-per-block 16] [--max-num-tokens 2048]
 *                [--kv-dtype f32|f16|bf16] [--depth 16] [--grammar json|FILE.json [--grammar-reps 3]]
 *                [--prefetch-ab N]
 *   bench_engine --make-model OUT.gguf --vocab-from VOCAB.gguf [--layers 12 --dim 768 ...]
 *
 * Prefill: C requests with prompt_len random-but-valid token ids and max_tokens 1, submitted at
 * once; rate = C * prompt_len / wall time, of the second such batch (the first, other prompts,
 * is a warm-up as llama-bench's: the KV pool's pages, the step scratch of prompt_len rows and
 * the per-thread panels are faulted in by it, not by the measured run). Decode: C requests with a --depth-token prompt
 * (default 16; e.g. 8192 for decode at 8k context, as llama-bench -d) generating gen_len tokens
 * (ignore_eos); rate = tokens generated after each request's first token / (last finish -
 * earliest first token). Logs the kernel ISA (KVSERVE_CPU_ISA forces one),
 * openblas_get_corename() and OPENBLAS_CORETYPE (left as the environment sets it).
 *
 * --grammar: the decode pass constrained to a JSON schema (FILE, or "json": a built-in schema
 * of 100+ records with strings, integers, arrays, booleans) against the same greedy requests
 * unconstrained: once with a cold mask cache (a schema never seen before), then --grammar-reps
 * pairs (unconstrained, constrained warm) in turn. Reported per decode step of the batch:
 * median ms/step, the median of the per-pair ratios, and the engine's own time in the grammar
 * hooks (mask, apply, accept) per sequence-step and as a share of the unconstrained step (the
 * figure machine noise does not move). Constrained requests may end early when their grammar
 * completes (the built-in schema never does before --gen-len).
 *
 * --prefetch-ab N (1..1000): instead of the table, the decode pass (prompts of --depth tokens;
 * --prompt-len plays no part) N times in each software-prefetch mode (KVSERVE_CPU_PREFETCH
 * cache / nta, quant.h) alternated inside one process; prints the pairs and the median ratio
 * nta / cache (prefetch_ab below). On a tiny model a decode pass lasts about a millisecond and
 * single pairs swing widely: measure on real-sized files.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "backend/cpu/matmul.h"
#include "quant/q8.h"
#include "engine/engine.h"
#include "grammar/grammar.h"
#include "kvcache/kvcache.h"
#include "model/gguf.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

char *openblas_get_corename(void);

struct run {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int pending;
    int failed;
    uint64_t first_token_min, finish_max;
    long gen_tokens_after_first;
    long steps_after_first;     /* decode steps after the first token: max over requests */
    gram_t *grammar;            /* NULL = unconstrained */
};

struct req_state {
    struct run *run;
    int n_tokens;
    uint64_t t_first;
};

static void on_event(const struct engine_event *ev, void *user) {
    struct req_state *rs = user;
    struct run *r = rs->run;
    uint64_t now = kv_now_ns();
    if (ev->type == ENGINE_EV_DELTA || ev->type == ENGINE_EV_FINISH) {
        if (ev->n_ids > 0 && rs->n_tokens == 0) rs->t_first = now;
        rs->n_tokens += ev->n_ids;
    }
    if (ev->type == ENGINE_EV_FINISH || ev->type == ENGINE_EV_ERROR) {
        pthread_mutex_lock(&r->mu);
        if (ev->type == ENGINE_EV_ERROR) r->failed++;
        if (rs->t_first && (r->first_token_min == 0 || rs->t_first < r->first_token_min))
            r->first_token_min = rs->t_first;
        if (now > r->finish_max) r->finish_max = now;
        if (rs->n_tokens > 1) r->gen_tokens_after_first += rs->n_tokens - 1;
        if (rs->n_tokens - 1 > r->steps_after_first) r->steps_after_first = rs->n_tokens - 1;
        r->pending--;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
    }
}

/* Submits n requests and waits; returns wall seconds (or -1 on failure). */
static double run_batch(engine_t *e, int n, int prompt_len, int gen_len, int n_vocab, uint64_t seed,
                        struct run *r) {
    gram_t *g = r->grammar;
    memset(r, 0, sizeof *r);
    r->grammar = g;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    struct req_state *rs = calloc((size_t)n, sizeof *rs);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)prompt_len);
    kv_rng rng;
    kv_rng_seed(&rng, seed);
    r->pending = n;
    double t0 = kv_now_s();
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < prompt_len; j++) ids[j] = 3 + (int32_t)(kv_rng_next(&rng) % (uint64_t)(n_vocab - 3));
        struct engine_request_params p = {0};
        p.prompt_ids = ids;
        p.n_prompt = (size_t)prompt_len;
        sampling_params_default(&p.sp);
        p.sp.temperature = 0;
        p.max_tokens = gen_len;
        p.ignore_eos = true;
        p.grammar = r->grammar;
        rs[i].run = r;
        uint64_t id;
        char err[256];
        if (engine_submit(e, &p, on_event, &rs[i], &id, err, sizeof err) != KV_OK) {
            fprintf(stderr, "submit failed: %s\n", err);
            pthread_mutex_lock(&r->mu);
            r->pending--;
            r->failed++;
            pthread_mutex_unlock(&r->mu);
        }
    }
    pthread_mutex_lock(&r->mu);
    while (r->pending > 0) pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    double dt = kv_now_s() - t0;
    free(ids);
    free(rs);
    return r->failed ? -1 : dt;
}

static kv_status copy_vocab(struct gguf_writer *w, void *user) {
    const gguf_t *g = user;
    for (int i = 0; i < gguf_n_keys(g); i++) {
        const char *k = gguf_key_name(g, i);
        if (strncmp(k, "tokenizer.", 10) != 0) continue;
        enum gguf_type t = gguf_key_type(g, i);
        kv_status s = KV_OK;
        if (t == GGUF_TYPE_STRING) {
            const char *v;
            size_t n;
            gguf_get_str(g, k, &v, &n);
            char *c = kv_strndup(v, n);
            s = gguf_w_str(w, k, c);
            free(c);
        } else if (t == GGUF_TYPE_BOOL) {
            bool b;
            gguf_get_bool(g, k, &b);
            s = gguf_w_bool(w, k, b);
        } else if (t == GGUF_TYPE_ARRAY) {
            enum gguf_type et;
            uint64_t n;
            gguf_get_arr_info(g, k, &et, &n);
            if (et == GGUF_TYPE_STRING) {
                char **v = calloc(n, sizeof *v);
                for (uint64_t j = 0; j < n; j++) {
                    const char *sp;
                    size_t sl;
                    gguf_get_arr_str(g, k, j, &sp, &sl);
                    v[j] = kv_strndup(sp, sl);
                }
                s = gguf_w_arr_str(w, k, (const char *const *)v, n);
                for (uint64_t j = 0; j < n; j++) free(v[j]);
                free(v);
            } else if (et == GGUF_TYPE_FLOAT32) {
                s = gguf_w_arr_f32(w, k, gguf_get_arr_data(g, k), n);
            } else if (et == GGUF_TYPE_INT32) {
                s = gguf_w_arr_i32(w, k, gguf_get_arr_data(g, k), n);
            }
        } else {
            int64_t v;
            if (gguf_get_int(g, k, &v)) s = gguf_w_u32(w, k, (uint32_t)v);
        }
        if (s != KV_OK) return s;
    }
    return KV_OK;
}

static int make_model(const char *out, const char *vocab_path, int layers, int dim, int heads,
                      int kv_heads, int ffn) {
    char err[512];
    gguf_t *g;
    if (gguf_open(vocab_path, &g, err, sizeof err)) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    uint64_t n_vocab = 0;
    enum gguf_type et;
    if (!gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n_vocab)) {
        fprintf(stderr, "bench_engine: %s has no tokenizer.ggml.tokens\n", vocab_path);
        gguf_close(g);
        return 1;
    }
    struct model_config cfg = {0};
    cfg.arch = MODEL_ARCH_LLAMA;
    cfg.n_vocab = (int)n_vocab;
    cfg.dim = dim;
    cfg.n_layers = layers;
    cfg.n_heads = heads;
    cfg.n_kv_heads = kv_heads;
    cfg.head_dim = dim / heads;
    cfg.ffn_dim = ffn;
    cfg.rms_eps = 1e-5f;
    cfg.rope_theta = 10000.0f;
    cfg.max_ctx = 4096;
    cfg.bos_id = 1;
    cfg.eos_id = 2;
    snprintf(cfg.name, sizeof cfg.name, "bench-llama-%dx%d", layers, dim);
    model_t *m;
    if (model_alloc(&cfg, &m)) {
        gguf_close(g);
        return 1;
    }
    model_randomize(m, 1234, 0.02f);
    kv_status s = model_save_gguf(m, out, copy_vocab, g, err, sizeof err);
    model_free(m);
    gguf_close(g);
    if (s) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    printf("wrote %s (%d layers, dim %d, vocab %d)\n", out, layers, dim, (int)n_vocab);
    return 0;
}

/* The built-in schema for --grammar json: a list of at least 100 records with strings,
 * integers, nested arrays and booleans, so every request runs to --gen-len. */
static const char *const BENCH_SCHEMA =
    "{\"type\":\"array\",\"minItems\":100,\"items\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
    "\"age\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}},"
    "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"age\",\"tags\",\"ok\"],\"additionalProperties\":false}}";

static gram_t *bench_grammar(const char *spec, int nonce) {
    char err[512];
    json_error_t je;
    json_t *s = !strcmp(spec, "json") ? json_loads(BENCH_SCHEMA, 0, &je) : json_load_file(spec, 0, &je);
    if (!s) {
        fprintf(stderr, "bench_engine: --grammar %s: %s\n", spec, je.text);
        return NULL;
    }
    /* a description differing per nonce: a schema the grammar cache has not seen (cold masks) */
    char d[32];
    snprintf(d, sizeof d, "bench %d", nonce);
    json_object_set_new(s, "description", json_string(d));
    gram_t *g = NULL;
    if (gram_compile_json_schema(s, true, &g, err, sizeof err)) fprintf(stderr, "bench_engine: --grammar %s: %s\n", spec, err);
    json_decref(s);
    return g;
}

/* Stats after the last request's events (the engine publishes them right after its step). */
static void settled_stats(engine_t *e, struct engine_stats *s) {
    for (int i = 0; i < 1000; i++) {
        engine_get_stats(e, s);
        if (s->kv_blocks_used == 0) return;
        struct timespec d = {0, 1000000};
        nanosleep(&d, NULL);
    }
}

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* --grammar: per concurrency, a cold constrained pass, then `reps` pairs (unconstrained,
 * constrained warm) in turn; medians of ms/step and of the per-pair ratio, and the engine's
 * own time in the grammar hooks per masked step (independent of machine noise). */
static int grammar_passes(engine_t *e, int n_vocab, const char *conc, int depth, int gen_len, const char *spec,
                          int reps) {
    printf("%-12s %-18s %8s %10s %12s %12s %14s %8s\n", "concurrency", "pass", "tokens", "ms/step", "vs unconstr.",
           "grammar us", "grammar/step", "walks");
    int nonce = (int)(kv_now_ns() % 1000000);
    for (const char *p = conc; *p;) {
        int c = atoi(p);
        double *ratio = calloc((size_t)reps, sizeof *ratio), *mu = calloc((size_t)reps, sizeof *mu),
               *mw = calloc((size_t)reps, sizeof *mw);
        double g_us_warm = 0, g_us_cold = 0, ms_cold = 0;
        long tok_warm = 0, tok_cold = 0;
        uint64_t walks_warm = 0, walks_cold = 0;
        for (int k = -1; k < reps; k++)
            for (int pass = k < 0 ? 1 : 0; pass < 2; pass++) { /* k = -1: the cold pass only */
                struct run r = {0};
                if (pass) r.grammar = bench_grammar(spec, k < 0 ? nonce : nonce);
                if (pass && !r.grammar) return 1;
                struct gram_stats a, b;
                struct engine_stats sa, sb;
                settled_stats(e, &sa);
                gram_get_stats(&a);
                double td = run_batch(e, c, depth, gen_len, n_vocab, 2, &r);
                settled_stats(e, &sb);
                gram_get_stats(&b);
                gram_unref(r.grammar);
                if (td < 0) return 1;
                double span = (double)(r.finish_max - r.first_token_min) / 1e9;
                double ms = r.steps_after_first > 0 ? span * 1e3 / (double)r.steps_after_first : 0;
                uint64_t gsteps = sb.grammar_steps - sa.grammar_steps;
                double g_us = gsteps ? (double)(sb.grammar_ns - sa.grammar_ns) / 1e3 / (double)gsteps : 0;
                uint64_t walks = b.mask_misses - a.mask_misses;
                if (k < 0) {
                    ms_cold = ms;
                    g_us_cold = g_us;
                    tok_cold = r.gen_tokens_after_first + c;
                    walks_cold = walks;
                } else if (!pass) {
                    mu[k] = ms;
                } else {
                    mw[k] = ms;
                    ratio[k] = mu[k] > 0 ? ms / mu[k] : 0;
                    g_us_warm += g_us / reps;
                    tok_warm = r.gen_tokens_after_first + c;
                    walks_warm += walks;
                }
                fflush(stdout);
            }
        qsort(mu, (size_t)reps, sizeof *mu, cmp_dbl);
        qsort(mw, (size_t)reps, sizeof *mw, cmp_dbl);
        qsort(ratio, (size_t)reps, sizeof *ratio, cmp_dbl);
        /* the grammar time of one batch step (c masked sequences) against the unconstrained step */
        double base = mu[reps / 2];
        char rel[32], rel_cold[32];
        snprintf(rel, sizeof rel, "%+.1f%%", (ratio[reps / 2] - 1) * 100);
        snprintf(rel_cold, sizeof rel_cold, "%+.1f%%", base > 0 ? (ms_cold / base - 1) * 100 : 0);
        printf("%-12d %-18s %8d %10.2f %12s %12s %14s %8s\n", c, "unconstrained", gen_len * c, base, "", "", "", "");
        printf("%-12d %-18s %8ld %10.2f %12s %12.1f %13.1f%% %8llu\n", c, "schema, cold", tok_cold, ms_cold, rel_cold,
               g_us_cold, base > 0 ? g_us_cold * c / 1e3 / base * 100 : 0, (unsigned long long)walks_cold);
        printf("%-12d %-18s %8ld %10.2f %12s %12.1f %13.1f%% %8llu\n", c, "schema, warm", tok_warm, mw[reps / 2], rel,
               g_us_warm, base > 0 ? g_us_warm * c / 1e3 / base * 100 : 0, (unsigned long long)walks_warm);
        free(ratio);
        free(mu);
        free(mw);
        nonce++;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    return 0;
}

/* --prefetch-ab N: the decode pass (depth-token prompts, gen_len tokens) run N times in each
 * software-prefetch mode (quant.h: KV_PREFETCH_CACHE, KV_PREFETCH_NTA) in turn inside this one
 * process -- same weight pages, same KV blocks -- so a VM's per-process memory placement and
 * drift hit both modes alike; prints each pair and the median of the per-pair ratios nta / cache
 * (the order inside a pair alternates). Leaves the mode AUTO. 0 on success. */
static int prefetch_ab(engine_t *e, int n_vocab, const char *conc, int depth, int gen_len, int reps) {
    printf("%-12s %-6s %14s %14s %8s\n", "concurrency", "pair", "cache tok/s", "nta tok/s", "nta/cache");
    for (const char *p = conc; *p;) {
        int c = atoi(p);
        double *ratio = calloc((size_t)reps, sizeof *ratio);
        if (!ratio) return 1;
        struct run r = {0};
        for (int k = 0; k < reps; k++) {
            double rate[2] = {0, 0}; /* [0] cache, [1] nta */
            for (int h = 0; h < 2; h++) {
                int nta = h ^ (k & 1);
                kv_quant_set_prefetch(nta ? KV_PREFETCH_NTA : KV_PREFETCH_CACHE);
                double td = run_batch(e, c, depth, gen_len, n_vocab, 2, &r);
                double span = (double)(r.finish_max - r.first_token_min) / 1e9;
                if (td <= 0 || span <= 0) {
                    free(ratio);
                    kv_quant_set_prefetch(KV_PREFETCH_AUTO);
                    return 1;
                }
                rate[nta] = (double)r.gen_tokens_after_first / span;
            }
            ratio[k] = rate[1] / rate[0];
            printf("%-12d %-6d %14.1f %14.1f %8.3f\n", c, k + 1, rate[0], rate[1], ratio[k]);
            fflush(stdout);
        }
        qsort(ratio, (size_t)reps, sizeof *ratio, cmp_dbl);
        double med = reps % 2 ? ratio[reps / 2] : (ratio[reps / 2 - 1] + ratio[reps / 2]) / 2;
        printf("%-12d median nta/cache %.3f (min %.3f, max %.3f)\n", c, med, ratio[0], ratio[reps - 1]);
        free(ratio);
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    kv_quant_set_prefetch(KV_PREFETCH_AUTO);
    return 0;
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *make = NULL, *vocab = NULL, *conc = "1,16", *grammar = NULL;
    int grammar_reps = 3, prefetch_reps = 0;
    bool prefetch_ab_given = false;
    int depth = 16, kv_dtype = KV_DTYPE_F32, threads = 0, prompt_len = 256, gen_len = 64, tpb = 16, max_num_tokens = 2048;
    int layers = 12, dim = 768, heads = 12, kv_heads = 12, ffn = 2048;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && ++i)
        if (OPT("--model")) model_path = v;
        else if (OPT("--make-model")) make = v;
        else if (OPT("--vocab-from")) vocab = v;
        else if (OPT("--threads")) threads = atoi(v);
        else if (OPT("--prompt-len")) prompt_len = atoi(v);
        else if (OPT("--gen-len")) gen_len = atoi(v);
        else if (OPT("--concurrency")) conc = v;
        else if (OPT("--tokens-per-block")) tpb = atoi(v);
        else if (OPT("--max-num-tokens")) max_num_tokens = atoi(v);
        else if (OPT("--layers")) layers = atoi(v);
        else if (OPT("--dim")) dim = atoi(v);
        else if (OPT("--heads")) heads = atoi(v);
        else if (OPT("--kv-heads")) kv_heads = atoi(v);
        else if (OPT("--ffn")) ffn = atoi(v);
        else if (OPT("--depth")) depth = atoi(v);
        else if (OPT("--grammar")) grammar = v;
        else if (OPT("--grammar-reps")) grammar_reps = atoi(v);
        else if (OPT("--prefetch-ab")) {
            char *end = NULL;
            long n = strtol(v, &end, 10);
            prefetch_ab_given = true;
            prefetch_reps = end != v && !*end && n >= 1 && n <= 1000 ? (int)n : 0; /* 0: refused below */
        }
        else if (OPT("--kv-dtype")) {
            if (kv_dtype_parse(v, &kv_dtype)) {
                fprintf(stderr, "bench_engine: --kv-dtype %s: expected f32, f16 or bf16\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "bench_engine: unknown or incomplete option '%s'\n", a);
            return 2;
        }
#undef OPT
    }
    if (make) {
        if (!vocab) {
            fprintf(stderr, "bench_engine: --make-model needs --vocab-from VOCAB.gguf\n");
            return 2;
        }
        return make_model(make, vocab, layers, dim, heads, kv_heads, ffn);
    }
    if (prefetch_ab_given && (prefetch_reps == 0 || grammar)) {
        fprintf(stderr, "bench_engine: --prefetch-ab takes a pair count of 1..1000 and does not combine with --grammar\n");
        return 2;
    }
    if (!model_path || prompt_len < 1 || gen_len < 2) {
        fprintf(stderr, "usage: bench_engine --model PATH [--threads N] [--prompt-len N] [--gen-len N>=2] "
                        "[--concurrency 1,16] [--kv-dtype f32|f16|bf16] [--depth N] [--prefetch-ab N]\n");
        return 2;
    }
    kv_log_set_level(KV_LOG_WARN);
    char err[512];
    {
        if (kv_cpu_env_check(err, sizeof err) != KV_OK) {
            fprintf(stderr, "bench_engine: %s\n", err);
            return 2;
        }
    }
    model_t *m;
    tokenizer_t *tok;
    backend_t *be;
    if (model_load(model_path, &m, err, sizeof err) || tok_load(model_path, &tok, err, sizeof err) ||
        backend_cpu_new(m, threads, &be, err, sizeof err)) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    backend_cpu_wait_pages(be); /* the weight panels in 2 MiB pages: measure the steady state */
    int max_c = 1;
    for (const char *p = conc; *p;) {
        int c = atoi(p);
        if (c > max_c) max_c = c;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    if (depth < 1) depth = 1;
    int max_len = (prompt_len > depth ? prompt_len : depth) + gen_len + 16;
    struct engine_config ec = {.tokens_per_block = tpb,
                               .max_batch_size = max_c,
                               .max_num_tokens = max_num_tokens,
                               .max_model_len = max_len,
                               .max_queue = 4096,
                               .kv_dtype = kv_dtype};
    ec.n_blocks = max_c * kv_blocks_for_tokens(max_len, tpb) + 8;
    engine_t *e;
    if (engine_start(&ec, m, tok, be, &e, err, sizeof err)) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    const char *ct = getenv("OPENBLAS_CORETYPE");
    printf("model %s: %d layers, dim %d, heads %d/%d, ffn %d, vocab %d\n", m->cfg.name, m->cfg.n_layers,
           m->cfg.dim, m->cfg.n_heads, m->cfg.n_kv_heads, m->cfg.ffn_dim, m->cfg.n_vocab);
    const char *fi = getenv("KVSERVE_CPU_ISA");
    printf("kernel %s (KVSERVE_CPU_ISA=%s), quantized matmul %s (KVSERVE_CPU_QUANT_MATMUL), prefill %s, BF16 matmul %s "
           "(%s, KVSERVE_CPU_BF16_MATMUL), prefetch %s (KVSERVE_CPU_PREFETCH), openblas core: %s (OPENBLAS_CORETYPE=%s), "
           "threads %d, KV %s\n",
           kv_matmul_isa_name(), fi ? fi : "unset", kv_matmul_quant_name(kv_matmul_get_quant()), kv_q8_packed_name(),
           kv_matmul_bf16_name(kv_matmul_get_bf16()),
           kv_matmul_bf16_family_name(), kv_quant_prefetch_name(kv_quant_get_prefetch()), openblas_get_corename(),
           ct ? ct : "unset", threads, kv_dtype_name(kv_dtype));
    struct run r = {0};
    run_batch(e, 1, 32, 4, m->cfg.n_vocab, 99, &r); /* warm-up */
    if (prefetch_reps > 0) {
        int rc = prefetch_ab(e, m->cfg.n_vocab, conc, depth, gen_len, prefetch_reps);
        engine_stop(e);
        backend_free(be);
        tok_free(tok);
        model_free(m);
        return rc;
    }
    printf("%-12s %-12s %14s %14s\n", "concurrency", "prompt_len", "prefill tok/s", "decode tok/s");
    if (grammar) {
        int rc = grammar_passes(e, m->cfg.n_vocab, conc, depth, gen_len, grammar, grammar_reps);
        engine_stop(e);
        backend_free(be);
        tok_free(tok);
        model_free(m);
        return rc;
    }
    for (const char *p = conc; *p;) {
        int c = atoi(p);
        run_batch(e, c, prompt_len, 1, m->cfg.n_vocab, 3, &r); /* warm-up of the same size, other prompts */
        double tp = run_batch(e, c, prompt_len, 1, m->cfg.n_vocab, 1, &r);
        double prefill = tp > 0 ? (double)c * prompt_len / tp : 0;
        double td = run_batch(e, c, depth, gen_len, m->cfg.n_vocab, 2, &r);
        double span = (double)(r.finish_max - r.first_token_min) / 1e9;
        double decode = td > 0 && span > 0 ? (double)r.gen_tokens_after_first / span : 0;
        printf("%-12d %-12d %14.1f %14.1f\n", c, prompt_len, prefill, decode);
        fflush(stdout);
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    engine_stop(e);
    backend_free(be);
    tok_free(tok);
    model_free(m);
    return 0;
}
