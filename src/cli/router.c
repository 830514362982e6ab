/* kvserve router: the front door of disaggregated serving (src/router/router.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "cli.h"
#include "router/router.h"

static void router_usage(FILE *f) {
    fprintf(f,
            "usage: kvserve router --port N --context URL... --generation URL... [options]\n"
            "       kvserve router --port N --workers URL... [options]\n\n"
            "Front door of disaggregated serving: each request's context leg (prefill + first token)\n"
            "goes to a context worker, its generation leg (decode, relayed to the client) to a\n"
            "generation worker; the --policy places them inside each role. With only --workers it\n"
            "is a proxy over one aggregated pool. Routes: POST /v1/completions, POST\n"
            "/v1/chat/completions, GET /v1/models, GET /health, GET /metrics, POST /select and\n"
            "POST /finish (coordinator). Docs: docs/disaggregation.md, docs/routing.md.\n\n"
            "options:\n"
            "  --host ADDR              listen address (default 127.0.0.1)\n"
            "  --port N                 listen port (default 8000; 0 = any free port)\n"
            "  --port-file PATH         write the bound port to PATH once listening\n"
            "  --context URL...         context workers (http://host:port; repeat or list)\n"
            "  --generation URL...      generation workers\n"
            "  --workers URL...         aggregated workers (used when no context/generation pool)\n"
            "  --schedule-style S       context_first (default) | generation_first\n"
            "  --max-retries N          retries of failed legs (default 1; spec rules: generation\n"
            "                           legs retry only when certainly undelivered, up to max(N, 5))\n"
            "  --max-local-prefill-tokens N  conditional disaggregation: ask the generation worker\n"
            "                           (/kv_probe) and let it prefill itself when at most N prompt\n"
            "                           tokens are not cached there (default off)\n"
            "  --timeout SECONDS        limit of one upstream leg (default 180; 0 = none)\n"
            "  --max-body-size BYTES    largest client body (default 16777216)\n"
            CLI_CONN_LIMITS_HELP
            "  --policy P               round_robin (default) | least_loaded | kv_aware | conversation;\n"
            "                           applied to --workers and to each role (docs/routing.md)\n"
            "  --load-metric M          requests (default) | tokens: the load least-loaded choices use\n"
            "  --new-conversation-min-match-blocks N  conversation: a new conversation follows the\n"
            "                           earlier one sharing >= N prompt blocks (default 32; 0 = off)\n"
            "  --max-conversations N    conversation history, LRU (default 100000)\n"
            "  --tokens-per-block N     the workers' KV block size (default 16)\n"
            "  --hash-key-file PATH     the workers' 32-byte block-hash secret (kv_aware: required;\n"
            "                           conversation: keys content with it, else a random key)\n"
            "  --tokenizer PATH         the served model (GGUF or tokenizer.json): prompts are hashed\n"
            "                           as token ids exactly as the workers tokenize them\n"
            "  --predicted-prefix-ttl S kv_aware: a prefix just sent to a worker follows it for S\n"
            "                           seconds before its KV events arrive (default 5; 0 = off)\n"
            "  --etcd URL               discover workers registered in etcd (v3 JSON gateway, e.g.\n"
            "                           http://127.0.0.1:2379; kvserve serve --etcd registers them)\n"
            "  --etcd-prefix P          key prefix (default kvserve/workers/)\n"
            "  --coordinator URL        place through another router's POST /select (same workers,\n"
            "                           --hash-key-file, --tokens-per-block): replicas share one\n"
            "                           placement state; local placement when it does not answer\n"
            "  --kv-balance-threshold N kv_aware: a worker chosen for its cached blocks may run at\n"
            "                           most N legs more than the least loaded one (default 32; 0 = off)\n"
            "  --kv-overlap-weight W    kv_aware: cost = W x prompt tokens to prefill there + tokens of\n"
            "                           work in flight there; the lowest wins (default 1; 0 = load only)\n"
            "  --health-interval S      GET /health period; 2 failures in a row take a worker out\n"
            "                           (default 1; 0 = off)\n"
            "  --worker-api-key KEY     sent as \"Authorization: Bearer KEY\" to the workers (started\n"
            "                           with --api-key); env KVSERVE_WORKER_API_KEY\n"
            "  --log-level LEVEL        debug | info | warn | error (default info)\n"
            "environment: KVSERVE_DISAGG_NO_RETRY=1 disables every retry.\n");
}

static bool parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

static bool parse_double(const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) return false;
    *out = v;
    return true;
}

/* Appends the URLs of a repeatable option: "--context A B" and "--context A,B" both work. */
static int take_urls(int argc, char **argv, int i, const char ***list, int *n) {
    int j = i + 1;
    for (; j < argc && strncmp(argv[j], "--", 2) != 0; j++) {
        char *s = argv[j];
        for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
            const char **nl = realloc(*list, (size_t)(*n + 1) * sizeof *nl);
            if (!nl) return -1;
            *list = nl;
            (*list)[(*n)++] = tok;
        }
    }
    return j - 1;
}

int cmd_router(int argc, char **argv) {
    struct router_config c = {.host = "127.0.0.1", .port = 8000, .max_retries = 1,
                              .max_local_prefill_tokens = -1, .timeout_s = 180,
                              .max_body_bytes = (size_t)16 << 20, .min_match_blocks = 32,
                              .max_conversations = 100000, .max_conversation_keys = 512,
                              .tokens_per_block = 16, .predicted_prefix_ttl_s = 5,
                              .kv_balance_threshold = 32, .kv_overlap_weight = 1.0,
                              .health_interval_s = 1,
                              .worker_api_key = getenv("KVSERVE_WORKER_API_KEY")};
    const char **ctx = NULL, **gen = NULL, **wk = NULL;
    int nctx = 0, ngen = 0, nwk = 0, rc = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            router_usage(stdout);
            rc = 0;
            goto out;
        }
        if (!strcmp(a, "--context") || !strcmp(a, "--generation") || !strcmp(a, "--workers")) {
            const char ***l = a[2] == 'c' ? &ctx : a[2] == 'g' ? &gen : &wk;
            int *n = a[2] == 'c' ? &nctx : a[2] == 'g' ? &ngen : &nwk;
            int before = *n;
            int j = take_urls(argc, argv, i, l, n);
            if (j < 0) {
                fprintf(stderr, "kvserve router: out of memory\n");
                rc = 1;
                goto out;
            }
            if (*n == before) {
                fprintf(stderr, "kvserve router: %s needs at least one URL\n", a);
                goto out;
            }
            i = j;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvserve router: unknown option or missing value: %s\n\n", a);
            router_usage(stderr);
            goto out;
        }
        const char *v = argv[++i];
        long n;
        int lrc = cli_conn_limit_opt("router", a, v, &c.conn);
        if (lrc < 0) goto out;
        if (lrc > 0) continue;
        double d;
        if (!strcmp(a, "--host")) c.host = v;
        else if (!strcmp(a, "--port") && parse_long(v, 0, 65535, &n)) c.port = (int)n;
        else if (!strcmp(a, "--port-file")) c.port_file = v;
        else if (!strcmp(a, "--max-retries") && parse_long(v, 0, 1000, &n)) c.max_retries = (int)n;
        else if (!strcmp(a, "--max-local-prefill-tokens") && parse_long(v, 0, 1L << 40, &n))
            c.max_local_prefill_tokens = n;
        else if (!strcmp(a, "--timeout") && parse_long(v, 0, 1L << 30, &n)) c.timeout_s = (double)n;
        else if (!strcmp(a, "--max-body-size") && parse_long(v, 1, 1L << 40, &n)) c.max_body_bytes = (size_t)n;
        else if (!strcmp(a, "--schedule-style") && !strcmp(v, "context_first")) c.style = ROUTER_CONTEXT_FIRST;
        else if (!strcmp(a, "--schedule-style") && !strcmp(v, "generation_first")) c.style = ROUTER_GENERATION_FIRST;
        else if (!strcmp(a, "--policy") && !strcmp(v, "round_robin")) c.policy = ROUTER_ROUND_ROBIN;
        else if (!strcmp(a, "--policy") && !strcmp(v, "least_loaded")) c.policy = ROUTER_LEAST_LOADED;
        else if (!strcmp(a, "--policy") && !strcmp(v, "kv_aware")) c.policy = ROUTER_KV_AWARE;
        else if (!strcmp(a, "--policy") && !strcmp(v, "conversation")) c.policy = ROUTER_CONVERSATION;
        else if (!strcmp(a, "--load-metric") && !strcmp(v, "requests")) c.load_tokens = false;
        else if (!strcmp(a, "--load-metric") && !strcmp(v, "tokens")) c.load_tokens = true;
        else if (!strcmp(a, "--new-conversation-min-match-blocks") && parse_long(v, 0, 1 << 20, &n))
            c.min_match_blocks = (int)n;
        else if (!strcmp(a, "--max-conversations") && parse_long(v, 1, 100000000, &n)) c.max_conversations = (int)n;
        else if (!strcmp(a, "--tokens-per-block") && parse_long(v, 1, 4096, &n)) c.tokens_per_block = (int)n;
        else if (!strcmp(a, "--hash-key-file")) c.hash_key_file = v;
        else if (!strcmp(a, "--tokenizer")) c.tokenizer = v;
        else if (!strcmp(a, "--etcd")) c.etcd = v;
        else if (!strcmp(a, "--coordinator")) c.coordinator = v;
        else if (!strcmp(a, "--etcd-prefix")) c.etcd_prefix = v;
        else if (!strcmp(a, "--predicted-prefix-ttl") && parse_double(v, 0, 3600, &d)) c.predicted_prefix_ttl_s = d;
        else if (!strcmp(a, "--kv-balance-threshold") && parse_long(v, 0, 1 << 20, &n))
            c.kv_balance_threshold = (int)n;
        else if (!strcmp(a, "--kv-overlap-weight") && parse_double(v, 0, 1000, &d)) c.kv_overlap_weight = d;
        else if (!strcmp(a, "--health-interval") && parse_double(v, 0, 3600, &d)) c.health_interval_s = d;
        else if (!strcmp(a, "--worker-api-key") && *v) c.worker_api_key = v;
        else if (!strcmp(a, "--log-level") && !strcmp(v, "debug")) kv_log_set_level(KV_LOG_DEBUG);
        else if (!strcmp(a, "--log-level") && !strcmp(v, "info")) kv_log_set_level(KV_LOG_INFO);
        else if (!strcmp(a, "--log-level") && !strcmp(v, "warn")) kv_log_set_level(KV_LOG_WARN);
        else if (!strcmp(a, "--log-level") && !strcmp(v, "error")) kv_log_set_level(KV_LOG_ERROR);
        else {
            fprintf(stderr, "kvserve router: bad option or value: %s %s\n\n", a, v);
            router_usage(stderr);
            goto out;
        }
    }
    c.context = ctx;
    c.n_context = nctx;
    c.generation = gen;
    c.n_generation = ngen;
    c.workers = wk;
    c.n_workers = nwk;
    char err[1024] = "";
    kv_status st = router_run(&c, err, sizeof err);
    if (st) {
        fprintf(stderr, "kvserve router: %s\n", err);
        rc = st == KV_EINVAL ? 2 : 1;
        goto out;
    }
    rc = 0;
out:
    free(ctx);
    free(gen);
    free(wk);
    return rc;
}
