/* kvserve serve: load a model, start the engine, serve the OpenAI-compatible HTTP API. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/matmul.h"
#include "base/base.h"
#include "cli.h"
#include "engine/engine.h"
#include "http/http.h"
#include "model/model.h"
#include "router/etcd.h"
#include "serve_disagg.h"
#include "tokenizer/prefix_cache.h"
#include "tokenizer/tokenizer.h"

#define DEFAULT_KV_MEMORY (256ull << 20)

static void serve_usage(FILE *f) {
    fprintf(f,
            "usage: kvserve serve [options]\n\n"
            "Serves a model over the OpenAI-compatible HTTP API (/v1/completions,\n"
            "/v1/chat/completions, /v1/models, /health, /tokenize, /detokenize, /metrics).\n\n"
            "options:\n"
            "  --model PATH             GGUF file or Hugging Face directory (default: the built-in\n"
            "                           random-weight demo model)\n"
            "  --host ADDR              listen address (default 127.0.0.1)\n"
            "  --port N                 listen port (default 8000; 0 = any free port)\n"
            "  --port-file PATH         write the bound port to PATH once listening\n"
            "  --served-model-name NAME [NAME...]  model id(s) in the API: the first is reported in\n"
            "                           responses, every one is accepted in \"model\" and listed by\n"
            "                           /v1/models (default: the model's own name: GGUF general.name,\n"
            "                           HF config _name_or_path, else the file/directory name)\n"
            "  --api-key KEY            require \"Authorization: Bearer KEY\" on every route but /health,\n"
            "                           /ready and /metrics (repeatable; env KVSERVE_API_KEY, comma-\n"
            "                           separated keys)\n"
            "  --allowed-origins LIST   CORS: browser origins allowed to call the API, comma-separated\n"
            "                           (repeatable; \"*\" = any); default none\n"
            "  --shutdown-timeout S     on SIGTERM/SIGINT, new requests get 503 and in-flight ones get S\n"
            "                           seconds to finish before they fail with 503 (default 30; 0 = fail\n"
            "                           them at once; a second Ctrl-C ends the wait)\n"
            "  --tool-call-parser FMT   how the model writes tool calls: auto (from the chat\n"
            "                           template, the default), hermes, llama3_json or mistral\n"
            "  --tokens-per-block N     KV cache block size in tokens (default 16)\n"
            "  --kv-cache-memory SIZE   KV cache size, e.g. 512MiB, 2GiB (default 256MiB, capped at\n"
            "                           max-batch-size full-length sequences)\n"
            "  --kv-cache-blocks N      KV cache size in blocks (overrides --kv-cache-memory)\n"
            "  --max-num-tokens N       token budget per engine step (default 512)\n"
            "  --max-batch-size N       sequences per engine step (default 64)\n"
            "  --max-model-len N        prompt + generated tokens per request (default: the\n"
            "                           model's context length)\n"
            "  --max-queue N            waiting requests before 503 (default 1024)\n"
            "  --max-body-size SIZE     largest request body (default 16MiB; larger gets 413)\n"
            CLI_CONN_LIMITS_HELP
            "  --max-kv-subscribers N   GET /kv_events streams at once; more get 503 (default 64)\n"
            "  --prep-threads N         threads that parse, render and tokenize requests off the\n"
            "                           HTTP thread (default 2)\n"
            "  --no-prefix-cache        do not reuse KV blocks across requests (A/B runs, tests)\n"
            "  --host-cache-memory SIZE host-memory tier for evicted KV blocks, e.g. 4GiB (default 0)\n"
            "  --prefix-wait-blocks N   a request waits for an in-flight prefill that will cover >= N\n"
            "                           more of its blocks (default: max-model-len / 8 in blocks,\n"
            "                           at most 64; 0 disables)\n"
            "  --hash-key-file PATH     32-byte block-hash secret (created if absent; default: random\n"
            "                           per start)\n"
            "  --prefix-token-cache     reuse the ids of the longest cached prompt prefix and\n"
            "                           tokenize only the tail (multi-turn chats; ids identical)\n"
            "  --prefix-token-cache-entries N    cached prompts (default 512)\n"
            "  --prefix-token-cache-max-chars N  bytes of cached prompt text (default 64MiB)\n"
            "  --prefix-token-cache-overlap N    tokens re-tokenized before the new text (default 64)\n"
            "  --prefix-token-cache-resync N     re-tokenized ids that must match (default 32)\n"
            "  --prefix-token-cache-min-chars N  shorter prompts bypass the cache (default 4096)\n"
            "  --prefix-token-cache-bucket-chars N  prompts shorter than N bytes are never stored;\n"
            "                                   entries are keyed by their first N bytes (default 2048)\n"
            "                           (\"chars\" are bytes of UTF-8)\n"
            "  --backend cpu|cuda       compute backend (default cpu; cuda: bf16 weights on GPU 0)\n"
            "  --kv-cache-dtype f32|f16|bf16  KV cache element type (default f32; cpu: all three,\n"
            "                           f16/bf16 halve the KV bytes and attention traffic;\n"
            "                           cuda: f32 or bf16, bf16 logits are ~10%% further from the\n"
            "                           f32 reference, see docs/benchmarks.md)\n"
            "  --threads N              compute threads (default 0 = all cores)\n"
            "  --gemm invariant|openblas  matrix kernel: 'invariant' (default) gives bitwise-identical\n"
            "                           results whatever the batch; 'openblas' is one sgemm per\n"
            "                           projection (results may differ in the last bits with batching)\n"
            "  --quant-matmul int8|f32  how the CPU multiplies quantized weights (Q8_0/Q4_0/Q4_K/Q5_K/\n"
            "                           Q6_K): int8 (default) quantizes activations to 8 bits and\n"
            "                           uses integer dot products, like llama.cpp (logits within ~2%%\n"
            "                           of f32, docs/benchmarks.md); f32 multiplies the exactly\n"
            "                           dequantized weights (bitwise the dequant-F32 file's logits;\n"
            "                           slower). Both are batch-invariant. Env KVSERVE_CPU_QUANT_MATMUL\n"
            "  --bf16-matmul auto|bf16|f32  how the CPU multiplies BF16 weights: bf16 rounds the\n"
            "                           activations to bf16 and multiplies pairs (vdpbf16ps where the\n"
            "                           CPU has AVX512_BF16, emulated bit for bit elsewhere; like\n"
            "                           llama.cpp; logits within ~0.4%% of f32, docs/benchmarks.md);\n"
            "                           f32 multiplies in f32 (bitwise the F32 file's logits). auto\n"
            "                           (default): KVSERVE_CPU_BF16_MATMUL when set, else bf16 on AMD\n"
            "                           CPUs with AVX512_BF16 (Zen 4/5: 1.6x prefill) and f32\n"
            "                           elsewhere (faster there). Both are batch-invariant.\n"
            "  --deterministic          batch-invariant mode: a sequence's tokens do not depend on what\n"
            "                           it is batched with or on cache hits (cuda: our fixed-order GEMM\n"
            "                           instead of cuBLAS, slower, see docs/benchmarks.md; cpu: always\n"
            "                           the case with --gemm invariant, refused with --gemm openblas)\n"
            "  --host-sampling          sample on the host from the full logits rows (cuda samples on\n"
            "                           the device by default: only ids and logprobs come back)\n"
            "  --etcd URL               register this worker in etcd (v3 JSON gateway) under a lease\n"
            "                           kept alive; routers started with --etcd find it\n"
            "  --advertise URL          the URL routers reach this worker at (default\n"
            "                           http://HOST:PORT as bound)\n"
            "  --etcd-prefix P          key prefix (default kvserve/workers/)\n"
            "  --etcd-ttl S             lease TTL: a dead worker disappears after S seconds (default 5)\n"
            "  --log-level LEVEL        debug | info | warn | error (default info)\n"
            "  --help                   show this help\n");
    serve_disagg_usage(f);
}

/* etcd registration (router/etcd.h): started once the listener is bound, stopped (lease
 * revoked) when stopping begins, so routers stop sending before requests are cancelled. */
struct serve_etcd {
    const char *url, *advertise, *prefix, *role;
    int ttl_s;
    struct etcd_registrar *reg;
};

static kv_status serve_etcd_register(const char *host, int port, void *arg, char *err, size_t errlen) {
    struct serve_etcd *se = arg;
    char adv[600];
    if (se->advertise) snprintf(adv, sizeof adv, "%s", se->advertise);
    else snprintf(adv, sizeof adv, "http://%s:%d", host, port);
    return etcd_register_start(se->url, se->prefix, adv, se->role, se->ttl_s, &se->reg, err, errlen);
}

static void serve_etcd_deregister(void *arg) {
    struct serve_etcd *se = arg;
    etcd_register_stop(se->reg);
    se->reg = NULL;
}

static int bad_opt(const char *opt, const char *val, const char *why) {
    fprintf(stderr, "kvserve serve: invalid value '%s' for %s: %s\n", val ? val : "", opt, why);
    return 2;
}

static int parse_int_opt(const char *opt, const char *val, int64_t lo, int64_t hi, int *out) {
    int64_t x;
    if (kv_parse_i64(val, lo, hi, &x) != KV_OK) {
        char why[96];
        snprintf(why, sizeof why, "expected an integer in [%lld, %lld]", (long long)lo, (long long)hi);
        return bad_opt(opt, val, why);
    }
    *out = (int)x;
    return 0;
}

#define SERVE_MAX_LIST 64 /* names, keys, origins */

/* Appends the comma-separated items of v to list (empty items skipped). 0, or 2 (too many). */
static int add_list(const char *opt, char *v, const char **list, int *n) {
    for (char *save = NULL, *tok = strtok_r(v, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        size_t len = strlen(tok);
        while (len && tok[len - 1] == ' ') tok[--len] = 0;
        if (!*tok) continue;
        if (*n >= SERVE_MAX_LIST) return bad_opt(opt, tok, "too many values (at most 64)");
        list[(*n)++] = tok;
    }
    return 0;
}

int cmd_serve(int argc, char **argv) {
    const char *model_path = NULL, *host = "127.0.0.1", *served = NULL, *port_file = NULL;
    const char *names[SERVE_MAX_LIST], *keys[SERVE_MAX_LIST], *origins[SERVE_MAX_LIST];
    int n_names = 0, n_keys = 0, n_origins = 0, shutdown_timeout = HTTP_DEFAULT_SHUTDOWN_TIMEOUT_S;
    char env_keys[4096];
    int port = 8000, tpb = 16, kv_blocks = 0, max_num_tokens = 512, max_batch = 64;
    int max_model_len = 0, max_queue = 1024, threads = 0;
    enum backend_cpu_gemm gemm = BACKEND_CPU_GEMM_INVARIANT;
    enum backend_kind be_kind = BACKEND_KIND_CPU;
    int kv_dtype = -1; /* -1: not given (f32 for every backend) */
    uint64_t kv_mem = 0, max_body = 16ull << 20, host_mem = 0;
    struct http_conn_limits conn_limits = {0};
    int max_kv_subs = 0, prep_threads = 0;
    bool kv_mem_set = false, no_prefix_cache = false, deterministic = false, qmode_set = false;
    bool host_sampling = false;
    enum kv_matmul_quant qmode = KV_MATMUL_QUANT_AUTO;
    enum kv_matmul_bf16 bmode = KV_MATMUL_BF16_AUTO;
    bool bmode_set = false;
    int prefix_wait = -1; /* not given: the engine's scaled default */
    const char *hash_key_file = NULL, *tool_parser = NULL;
    struct serve_etcd se = {.prefix = ETCD_DEFAULT_PREFIX, .ttl_s = 5};
    bool ptc_on = false, ptc_set = false;
    struct prefix_cache_config ptc;
    prefix_cache_config_default(&ptc);
    prefix_cache_t *pcache = NULL;
    struct serve_disagg sd;
    serve_disagg_defaults(&sd);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            serve_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--prefix-token-cache")) {
            ptc_on = true;
            continue;
        }
        if (!strcmp(a, "--no-prefix-cache")) {
            no_prefix_cache = true;
            continue;
        }
        if (!strcmp(a, "--deterministic")) {
            deterministic = true;
            continue;
        }
        if (!strcmp(a, "--host-sampling")) {
            host_sampling = true;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "kvserve serve: unexpected argument '%s' (see --help)\n", a);
            return 2;
        }
        if (strchr(a, '=')) { /* --opt=VALUE: options take their value as the next argument */
            fprintf(stderr, "kvserve serve: unknown option '%s' (write '--option VALUE'; see --help)\n", a);
            return 2;
        }
        if (i + 1 >= argc) { /* the last argument: a value-taking option without it, or no option at all */
            fprintf(stderr, "kvserve serve: option %s needs a value, or is not an option (see --help)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        int rc = serve_disagg_option(&sd, a, v);
        if (rc == 1) continue;
        if (rc) return rc;
        if ((rc = cli_conn_limit_opt("serve", a, v, &conn_limits)) != 0) {
            if (rc < 0) return 2;
            continue;
        }
        if (!strcmp(a, "--prep-threads")) {
            if ((rc = parse_int_opt(a, v, 1, 16, &prep_threads)) != 0) return rc;
            continue;
        }
        if (!strcmp(a, "--max-kv-subscribers")) {
            if ((rc = parse_int_opt(a, v, 1, 100000, &max_kv_subs)) != 0) return rc;
            continue;
        }
        if (!strcmp(a, "--model")) model_path = v;
        else if (!strcmp(a, "--host")) host = v;
        else if (!strcmp(a, "--served-model-name")) {
            /* NAME [NAME...] (vLLM): the values up to the next option */
            for (;;) {
                if (!*v) return bad_opt(a, v, "must not be empty");
                if (n_names >= SERVE_MAX_LIST) return bad_opt(a, v, "too many names (at most 64)");
                names[n_names++] = v;
                if (i + 1 >= argc || !strncmp(argv[i + 1], "--", 2)) break;
                v = argv[++i];
            }
            served = names[0];
        }
        else if (!strcmp(a, "--api-key")) {
            if (!*v) return bad_opt(a, v, "must not be empty");
            if (n_keys >= SERVE_MAX_LIST) return bad_opt(a, "", "too many keys (at most 64)");
            keys[n_keys++] = v;
        }
        else if (!strcmp(a, "--allowed-origins")) rc = add_list(a, argv[i], origins, &n_origins);
        else if (!strcmp(a, "--shutdown-timeout")) rc = parse_int_opt(a, v, 0, 1 << 20, &shutdown_timeout);
        else if (!strcmp(a, "--port-file")) port_file = v;
        else if (!strcmp(a, "--tool-call-parser")) tool_parser = v;
        else if (!strcmp(a, "--port")) rc = parse_int_opt(a, v, 0, 65535, &port);
        else if (!strcmp(a, "--tokens-per-block")) rc = parse_int_opt(a, v, 1, 4096, &tpb);
        else if (!strcmp(a, "--kv-cache-blocks")) rc = parse_int_opt(a, v, 1, 1 << 30, &kv_blocks);
        else if (!strcmp(a, "--max-num-tokens")) rc = parse_int_opt(a, v, 1, 1 << 24, &max_num_tokens);
        else if (!strcmp(a, "--max-batch-size")) rc = parse_int_opt(a, v, 1, 1 << 16, &max_batch);
        else if (!strcmp(a, "--max-model-len")) rc = parse_int_opt(a, v, 2, 1 << 24, &max_model_len);
        else if (!strcmp(a, "--max-queue")) rc = parse_int_opt(a, v, 1, 1 << 24, &max_queue);
        else if (!strcmp(a, "--threads")) rc = parse_int_opt(a, v, 0, 4096, &threads);
        else if (!strcmp(a, "--kv-cache-dtype")) {
            if (kv_dtype_parse(v, &kv_dtype) != KV_OK) rc = bad_opt(a, v, "expected f32, f16 or bf16");
        } else if (!strcmp(a, "--backend")) {
            if (backend_kind_parse(v, &be_kind) != KV_OK) rc = bad_opt(a, v, "expected cpu or cuda");
        }
        else if (!strcmp(a, "--gemm")) {
            if (backend_cpu_gemm_parse(v, &gemm) != KV_OK) rc = bad_opt(a, v, "expected invariant or openblas");
        }
        else if (!strcmp(a, "--quant-matmul")) {
            char qerr[160];
            if (kv_matmul_quant_parse(v, &qmode, qerr, sizeof qerr) != KV_OK) rc = bad_opt(a, v, "expected int8 or f32");
            qmode_set = true;
        }
        else if (!strcmp(a, "--bf16-matmul")) {
            char berr[160];
            if (kv_matmul_bf16_parse(v, &bmode, berr, sizeof berr) != KV_OK) rc = bad_opt(a, v, "expected auto, bf16 or f32");
            bmode_set = true;
        }
        else if (!strcmp(a, "--prefix-wait-blocks")) rc = parse_int_opt(a, v, 0, 1 << 24, &prefix_wait);
        else if (!strcmp(a, "--hash-key-file")) hash_key_file = v;
        else if (!strcmp(a, "--etcd")) se.url = v;
        else if (!strcmp(a, "--advertise")) se.advertise = v;
        else if (!strcmp(a, "--etcd-prefix")) se.prefix = v;
        else if (!strcmp(a, "--etcd-ttl")) rc = parse_int_opt(a, v, 1, 3600, &se.ttl_s);
        else if (!strncmp(a, "--prefix-token-cache-", 21)) {
            const char *k = a + 21;
            size_t *f = !strcmp(k, "entries") ? &ptc.max_entries
                      : !strcmp(k, "max-chars") ? &ptc.max_total_bytes
                      : !strcmp(k, "overlap") ? &ptc.overlap_tokens
                      : !strcmp(k, "resync") ? &ptc.resync_tokens
                      : !strcmp(k, "min-chars") ? &ptc.min_bytes
                      : !strcmp(k, "bucket-chars") ? &ptc.bucket_bytes : NULL;
            uint64_t x;
            if (!f) {
                fprintf(stderr, "kvserve serve: unknown option '%s' (see --help)\n", a);
                return 2;
            }
            if (kv_parse_size(v, &x) != KV_OK || x > (1ull << 40))
                rc = bad_opt(a, v, "expected a non-negative integer (sizes such as 64MiB allowed)");
            *f = (size_t)x;
            ptc_set = true;
        }
        else if (!strcmp(a, "--host-cache-memory")) {
            if (kv_parse_size(v, &host_mem) != KV_OK)
                rc = bad_opt(a, v, "expected a size such as 0, 512MiB or 4GiB");
        }
        else if (!strcmp(a, "--kv-cache-memory")) {
            if (kv_parse_size(v, &kv_mem) != KV_OK || kv_mem == 0)
                rc = bad_opt(a, v, "expected a positive size such as 512MiB or 2GiB");
            kv_mem_set = true;
        } else if (!strcmp(a, "--max-body-size")) {
            if (kv_parse_size(v, &max_body) != KV_OK || max_body == 0 || max_body > (1ull << 32))
                rc = bad_opt(a, v, "expected a size between 1 byte and 4GiB, such as 16MiB");
        } else if (!strcmp(a, "--log-level")) {
            if (!strcmp(v, "debug")) kv_log_set_level(KV_LOG_DEBUG);
            else if (!strcmp(v, "info")) kv_log_set_level(KV_LOG_INFO);
            else if (!strcmp(v, "warn")) kv_log_set_level(KV_LOG_WARN);
            else if (!strcmp(v, "error")) kv_log_set_level(KV_LOG_ERROR);
            else rc = bad_opt(a, v, "expected debug, info, warn or error");
        } else {
            fprintf(stderr, "kvserve serve: unknown option '%s' (see --help)\n", a);
            return 2;
        }
        if (rc) return rc;
    }
    if (!*host) return bad_opt("--host", host, "must not be empty");
    {
        char ierr[200];
        if (kv_cpu_env_check(ierr, sizeof ierr) != KV_OK) {
            fprintf(stderr, "kvserve serve: %s\n", ierr);
            return 2;
        }
        if (qmode_set && be_kind == BACKEND_KIND_CUDA) {
            fprintf(stderr, "kvserve serve: --quant-matmul applies to the cpu backend only\n");
            return 2;
        }
        kv_matmul_set_quant(qmode); /* AUTO: KVSERVE_CPU_QUANT_MATMUL, else int8 */
        if (bmode_set && be_kind == BACKEND_KIND_CUDA) {
            fprintf(stderr, "kvserve serve: --bf16-matmul applies to the cpu backend only\n");
            return 2;
        }
        kv_matmul_set_bf16(bmode); /* AUTO: KVSERVE_CPU_BF16_MATMUL, else per CPU */
    }
    if (kv_dtype < 0) kv_dtype = KV_DTYPE_F32; /* cuda too: bf16 KV missed the test tolerance (see test_cuda.c) */
    else if (be_kind == BACKEND_KIND_CUDA && kv_dtype == KV_DTYPE_F16)
        return bad_opt("--kv-cache-dtype", kv_dtype_name(kv_dtype), "the cuda backend supports f32 or bf16");
    if (served && !*served) return bad_opt("--served-model-name", served, "must not be empty");
    const char *ek = getenv("KVSERVE_API_KEY");
    if (ek && *ek) {
        if (strlen(ek) >= sizeof env_keys) return bad_opt("KVSERVE_API_KEY", "", "longer than 4 KiB");
        snprintf(env_keys, sizeof env_keys, "%s", ek);
        int before = n_keys;
        if (add_list("KVSERVE_API_KEY", env_keys, keys, &n_keys)) return 2;
        if (n_keys == before) /* e.g. "${K1},${K2}" with both empty: never serve open by accident */
            return bad_opt("KVSERVE_API_KEY", ek, "holds no key (only commas and blanks)");
    }
    if (tool_parser && strcmp(tool_parser, "auto") && !gram_tool_fmt_from_name(tool_parser))
        return bad_opt("--tool-call-parser", tool_parser, "must be auto, hermes, llama3_json or mistral");
    if (tool_parser && !strcmp(tool_parser, "auto")) tool_parser = NULL;
    {
        char perr[256];
        if (prefix_cache_config_validate(&ptc, perr, sizeof perr) != KV_OK) {
            fprintf(stderr, "kvserve serve: invalid --prefix-token-cache-* settings: %s\n", perr);
            return 2;
        }
        if (ptc_set && !ptc_on)
            KV_WARN("--prefix-token-cache-* settings given without --prefix-token-cache: the "
                    "prefix token cache stays off");
    }

    char err[1024] = "", demo[4096];
    if (!model_path) {
        if (model_demo_path(demo, sizeof demo, err, sizeof err) != KV_OK) {
            fprintf(stderr, "kvserve serve: cannot create the demo model: %s\n", err);
            return 1;
        }
        model_path = demo;
        KV_WARN("no --model given: serving the built-in RANDOM-WEIGHT DEMO model (%s); its output "
                "is meaningless. Serve a real model with `make serve MODEL=/path/to/model.gguf` or "
                "`kvserve serve --model PATH` (GGUF file or Hugging Face directory).", demo);
    }
    model_t *m = NULL;
    tokenizer_t *t = NULL;
    backend_t *be = NULL;
    engine_t *e = NULL;
    int ret = 1;
    if (model_load(model_path, &m, err, sizeof err) != KV_OK) {
        fprintf(stderr, "kvserve serve: cannot load model: %s\n", err);
        goto out;
    }
    if (tok_load(model_path, &t, err, sizeof err) != KV_OK) {
        fprintf(stderr, "kvserve serve: cannot load tokenizer: %s\n", err);
        goto out;
    }
    if (tok_n_vocab(t) > m->cfg.n_vocab) { /* ids the embedding has no row for (llama.cpp refuses too) */
        fprintf(stderr, "kvserve serve: %s: the tokenizer has %d tokens but the model's embedding only %d rows\n",
                model_path, tok_n_vocab(t), m->cfg.n_vocab);
        goto out;
    }
    if (tok_n_vocab(t) < m->cfg.n_vocab)
        KV_INFO("tokenizer: %d tokens for %d embedding rows (padded vocabulary)", tok_n_vocab(t), m->cfg.n_vocab);
    if (max_model_len == 0) max_model_len = m->cfg.max_ctx > 1 ? m->cfg.max_ctx : 2048;
    else if (m->cfg.max_ctx > 0 && max_model_len > m->cfg.max_ctx)
        KV_WARN("--max-model-len %d is above the model's declared context length %d", max_model_len,
                m->cfg.max_ctx);
    struct kv_geometry g = {.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads,
                            .head_dim = m->cfg.head_dim, .tokens_per_block = tpb, .kv_dtype = kv_dtype};
    size_t block_bytes = kv_block_bytes(&g);
    int64_t per_seq = ((int64_t)max_model_len + tpb - 1) / tpb;
    if (kv_blocks == 0) {
        uint64_t mem = kv_mem_set ? kv_mem : DEFAULT_KV_MEMORY;
        uint64_t nb = block_bytes ? mem / block_bytes : 0;
        if (!kv_mem_set && nb > (uint64_t)(per_seq * max_batch)) nb = (uint64_t)(per_seq * max_batch);
        if (nb > (1u << 30)) nb = 1u << 30;
        kv_blocks = (int)nb;
    }
    if (kv_blocks < per_seq) {
        fprintf(stderr,
                "kvserve serve: the KV cache (%d blocks of %zu bytes; see --kv-cache-memory / "
                "--kv-cache-blocks) cannot hold one sequence of --max-model-len %d tokens "
                "(%lld blocks needed)\n",
                kv_blocks, block_bytes, max_model_len, (long long)per_seq);
        ret = 2;
        goto out;
    }
    char mtypes[256];
    model_matrix_types(m, mtypes, sizeof mtypes);
    KV_INFO("model %s (%s, %d layers, dim %d, vocab %d; weights %.1f MiB, matrices %s%s); KV cache "
            "(%s): %d blocks x %d tokens x %zu bytes = %.1f MiB (%lld tokens); max_model_len %d",
            m->cfg.name, model_arch_name(m->cfg.arch), m->cfg.n_layers, m->cfg.dim, m->cfg.n_vocab,
            (double)model_weight_bytes(m) / (1024.0 * 1024.0), mtypes,
            m->format == MODEL_FORMAT_GGUF ? ", mapped from the file; what the CPU backend repacks is logged next" : "",
            kv_dtype_name(kv_dtype), kv_blocks, tpb, block_bytes,
            (double)kv_blocks * (double)block_bytes / (1024.0 * 1024.0), (long long)kv_blocks * tpb, max_model_len);
    struct backend_options bopt = {.kind = be_kind, .n_threads = threads, .gemm = gemm, .deterministic = deterministic};
    if (backend_create(m, &bopt, &be, err, sizeof err) != KV_OK) {
        fprintf(stderr, "kvserve serve: cannot create the %s backend: %s\n", backend_kind_name(be_kind), err);
        goto out;
    }
    kv_hash_key hkey;
    if (hash_key_file && kv_hash_key_load_or_create(hash_key_file, &hkey, err, sizeof err) != KV_OK) {
        fprintf(stderr, "kvserve serve: %s\n", err);
        ret = 2;
        goto out;
    }
    uint64_t host_blocks = block_bytes ? host_mem / block_bytes : 0;
    if (host_blocks > (1u << 28)) host_blocks = 1u << 28;
    if (host_blocks)
        KV_INFO("KV host tier: %llu blocks (%.1f MiB)", (unsigned long long)host_blocks,
                (double)host_blocks * (double)block_bytes / (1024.0 * 1024.0));
    struct engine_config ec = {.tokens_per_block = tpb, .n_blocks = kv_blocks,
                               .max_batch_size = max_batch, .max_num_tokens = max_num_tokens,
                               .max_model_len = max_model_len, .max_queue = max_queue,
                               .no_prefix_cache = no_prefix_cache,
                               .host_cache_blocks = (int)host_blocks,
                               .prefix_wait_blocks = prefix_wait < 0 ? 0 : prefix_wait > 0 ? prefix_wait : -1,
                               .hash_key = hash_key_file ? &hkey : NULL,
                               .kv_dtype = kv_dtype, .host_sampling = host_sampling};
    const char *hold = getenv("KVSERVE_TEST_HOLD_PREFILL"); /* test hook: docs/testing.md */
    if (hold && *hold) {
        char *end = NULL;
        unsigned long long v = strtoull(hold, &end, 10);
        if (*end || !v) {
            fprintf(stderr, "kvserve serve: KVSERVE_TEST_HOLD_PREFILL=%s: expected a token count > 0\n", hold);
            ret = 2;
            goto out;
        }
        ec.test_hold_prefill_tokens = v;
        KV_WARN("test hook KVSERVE_TEST_HOLD_PREFILL: no engine step after %llu prompt tokens", v);
    }
    kv_status st = engine_start(&ec, m, t, be, &e, err, sizeof err);
    if (st != KV_OK) {
        fprintf(stderr, "kvserve serve: cannot start the engine: %s\n", err);
        ret = st == KV_EINVAL ? 2 : 1;
        goto out;
    }
    if (ptc_on) {
        if (prefix_cache_new(t, &ptc, &pcache, err, sizeof err) != KV_OK) {
            fprintf(stderr, "kvserve serve: %s\n", err);
            goto out;
        }
        KV_INFO("prefix token cache: on (%zu entries, %zu bytes, overlap %zu, resync %zu, "
                "min %zu bytes)", ptc.max_entries, ptc.max_total_bytes, ptc.overlap_tokens,
                ptc.resync_tokens, ptc.min_bytes);
    }
    struct http_config hc = {.host = host, .port = port, .max_body_bytes = (size_t)max_body,
                             .conn = conn_limits, .max_kv_subscribers = max_kv_subs,
                             .prep_threads = prep_threads,
                             .served_model_name = served, .port_file = port_file,
                             .tool_call_parser = tool_parser,
                             .prefix_cache = pcache,
                             .model_aliases = n_names > 1 ? names + 1 : NULL,
                             .n_model_aliases = n_names > 1 ? n_names - 1 : 0,
                             .api_keys = keys, .n_api_keys = n_keys,
                             .allowed_origins = origins, .n_allowed_origins = n_origins,
                             .shutdown_timeout_s = shutdown_timeout > 0 ? shutdown_timeout : -1};
    if (n_keys) KV_INFO("http: API keys required (%d key(s))", n_keys);
    st = serve_disagg_start(&sd, e, be, m, tpb, host, &hc, err, sizeof err);
    if (st != KV_OK) {
        fprintf(stderr, "kvserve serve: %s\n", err);
        ret = st == KV_EINVAL || st == KV_EUNSUPPORTED ? 2 : 1;
        goto out;
    }
    if (se.url) {
        se.role = hc.role ? hc.role : "aggregated";
        hc.on_listening = serve_etcd_register;
        hc.on_stopping = serve_etcd_deregister;
        hc.hook_arg = &se;
    } else if (se.advertise) {
        fprintf(stderr, "kvserve serve: --advertise needs --etcd\n");
        ret = 2;
        goto out;
    }
    if (m->is_demo)
        KV_WARN("serving the random-weight demo model: use `kvserve serve --model PATH` for a real one");
    st = http_serve(&hc, e, m, t, err, sizeof err);
    if (st != KV_OK) {
        fprintf(stderr, "kvserve serve: %s\n", err);
        goto out;
    }
    ret = 0;
out:
    serve_etcd_deregister(&se);
    serve_disagg_stop(&sd);
    if (e) engine_stop(e);
    if (be) backend_free(be);
    prefix_cache_free(pcache);
    if (t) tok_free(t);
    if (m) model_free(m);
    if (ret == 0) KV_INFO("kvserve serve: stopped cleanly");
    return ret;
}
