/* kvserve bench: replay multi-turn traces against any OpenAI-compatible server.
 * See docs/bench.md. */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "cli.h"

static volatile int g_stop;
static void on_sigint(int sig) {
    (void)sig;
    g_stop = 1;
}

static void usage(FILE *f) {
    fprintf(f,
        "usage: kvserve bench [options]\n"
        "       kvserve bench --compare A.json B.json [C.json ...] [--plot DIR] [--pool-workers N]\n"
        "\nserver:\n"
        "  --url URL               base URL of the server (default http://127.0.0.1:8000)\n"
        "  --model NAME            model name (default: first id of GET /v1/models)\n"
        "  --api-key KEY           Bearer token (default $OPENAI_API_KEY, if set)\n"
        "  --api chat|completions  endpoint (default chat)\n"
        "\nworkload (sizes in words: the client approximates tokens by words):\n"
        "  --dataset NAME          synthetic (default), mtbench, hh-rlhf, sharegpt, war-and-peace\n"
        "  --dataset-path PATH     dataset file (default $KVSERVE_TEST_DATA/datasets/<file>)\n"
        "  --prompt-words N        war-and-peace: words per prompt (default 256)\n"
        "  --dataset-sessions N    read at most N sessions from the dataset (default all; war-and-peace 100)\n"
        "  --trace FILE            replay a saved trace (JSON lines)\n"
        "  --save-trace FILE       write the trace used\n"
        "  --dry-run               build (and save) the trace, send nothing\n"
        "  synthetic agentic trace:\n"
        "  --sessions N            sessions (default 20)\n"
        "  --system-tokens S       system prompt words (default 64)\n"
        "  --shared-fraction F     fraction of sessions sharing one system prompt (default 0.8)\n"
        "  --turns T               turns per session (default 4)\n"
        "  --user-tokens W         words of the first user message (default 16)\n"
        "  --tool-tokens U         tool-output words appended per turn (default 32)\n"
        "  --output-tokens O       tokens generated per turn (default 32)\n"
        "  --think-time-ms MS      mean think time between turns, exponential (default 0)\n"
        "  --seed N                trace and arrival seed (default 1)\n"
        "\nload:\n"
        "  --concurrency C         closed loop: C sessions in progress at once (default 1);\n"
        "                          with --request-rate: cap on sessions in progress\n"
        "  --request-rate R        open loop: session starts arrive Poisson at R per second\n"
        "  --duration S            stop sending after S seconds (in-flight requests finish)\n"
        "  --num-sessions N        sessions to run (trace reused cyclically; default trace size)\n"
        "  --max-tokens N          max_tokens for every request (overrides the trace)\n"
        "  --default-max-tokens N  for dataset turns without one (default 128)\n"
        "  --ignore-eos            send ignore_eos: true\n"
        "  --temperature T         send temperature T\n"
        "  --conversation-id       send conversation_id per session\n"
        "  --timeout S             per-request timeout in seconds (default none)\n"
        "\noutput:\n"
        "  --out FILE.json         every request's timings and the summary\n"
        "  --plot DIR              charts (SVG + PNG) with gnuplot\n"
        "  --pool-workers N        --compare: the busiest worker's share of every file but the first\n"
        "                          is over N workers (routed pools: one that got nothing counts as 0)\n"
        "  --quiet                 no progress output\n"
        "  --progress-interval S   seconds between progress lines when not on a terminal (default 5)\n");
}

static int need(int i, int argc, char **argv) {
    if (i + 1 >= argc) {
        fprintf(stderr, "kvserve bench: %s needs a value, or is not an option (see --help)\n", argv[i]);
        return 0;
    }
    return 1;
}

static int parse_num(const char *opt, const char *s, double lo, double hi, double *out) {
    char *e;
    double v = strtod(s, &e);
    if (!*s || *e || !(v >= lo && v <= hi)) {
        fprintf(stderr, "kvserve bench: bad value '%s' for %s (expected %g..%g)\n", s, opt, lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

int cmd_bench(int argc, char **argv) {
    bench_config c = bench_config_defaults();
    bench_synth_params sp = bench_synth_defaults();
    const char *dataset = "synthetic", *dataset_path = NULL, *trace_in = NULL, *trace_out = NULL;
    const char *out_json = NULL, *plot_dir = NULL;
    size_t prompt_words = 256, dataset_sessions = 0;
    bool dry = false;
    c.api_key = getenv("OPENAI_API_KEY");
    if (c.api_key && !*c.api_key) c.api_key = NULL;
    char err[512];

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        double v;
#define NUM(name, lo, hi, dst)                                                              \
    else if (!strcmp(a, name)) {                                                            \
        if (!need(i, argc, argv) || !parse_num(a, argv[++i], lo, hi, &v)) return 2;         \
        dst;                                                                                \
    }
#define STR(name, dst)                                                                      \
    else if (!strcmp(a, name)) {                                                            \
        if (!need(i, argc, argv)) return 2;                                                 \
        dst = argv[++i];                                                                    \
    }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--compare")) {
            const char *files[16], *plot = NULL;
            int nf = 0, pool = 0;
            for (int j = i + 1; j < argc; j++) {
                if (!strcmp(argv[j], "--plot") && j + 1 < argc) {
                    plot = argv[++j];
                } else if (!strcmp(argv[j], "--pool-workers") && j + 1 < argc) {
                    char *end;
                    long v = strtol(argv[++j], &end, 10);
                    if (*end || v < 1 || v > 4096) {
                        fprintf(stderr, "kvserve bench: --pool-workers %s: expected 1..4096\n", argv[j]);
                        return 2;
                    }
                    pool = (int)v;
                } else if (nf < 16 && strncmp(argv[j], "--", 2)) {
                    files[nf++] = argv[j];
                } else {
                    fprintf(stderr, "kvserve bench: --compare takes 2 to 16 files, an optional --plot DIR "
                                    "and --pool-workers N (got %s)\n", argv[j]);
                    return 2;
                }
            }
            if (nf < 2) {
                fprintf(stderr, "kvserve bench: --compare needs at least two files\n");
                return 2;
            }
            if (bench_compare(stdout, files, nf, plot, pool, err, sizeof err)) {
                fprintf(stderr, "kvserve bench: %s\n", err);
                return 1;
            }
            return 0;
        }
        STR("--url", c.url)
        STR("--model", c.model)
        STR("--api-key", c.api_key)
        else if (!strcmp(a, "--api")) {
            if (!need(i, argc, argv)) return 2;
            const char *m = argv[++i];
            if (!strcmp(m, "chat")) c.api = BENCH_API_CHAT;
            else if (!strcmp(m, "completions")) c.api = BENCH_API_COMPLETIONS;
            else {
                fprintf(stderr, "kvserve bench: --api must be chat or completions\n");
                return 2;
            }
        }
        STR("--dataset", dataset)
        STR("--dataset-path", dataset_path)
        STR("--trace", trace_in)
        STR("--save-trace", trace_out)
        STR("--out", out_json)
        STR("--plot", plot_dir)
        NUM("--prompt-words", 1, 1e7, prompt_words = (size_t)v)
        NUM("--dataset-sessions", 0, 1e9, dataset_sessions = (size_t)v)
        NUM("--sessions", 1, 1e7, sp.n_sessions = (size_t)v)
        NUM("--system-tokens", 0, 1e7, sp.system_words = (size_t)v)
        NUM("--shared-fraction", 0, 1, sp.shared_fraction = v)
        NUM("--turns", 1, 1e5, sp.turns = (size_t)v)
        NUM("--user-tokens", 0, 1e7, sp.first_user_words = (size_t)v)
        NUM("--tool-tokens", 0, 1e7, sp.tool_words = (size_t)v)
        NUM("--output-tokens", 1, 1e7, sp.output_tokens = (int)v)
        NUM("--think-time-ms", 0, 1e8, sp.think_ms_mean = v)
        NUM("--seed", 0, 9007199254740992.0, sp.seed = c.seed = (uint64_t)v)
        NUM("--concurrency", 0, 1e6, c.concurrency = (int)v)
        NUM("--request-rate", 0, 1e7, c.request_rate = v)
        NUM("--duration", 0, 1e9, c.duration_s = v)
        NUM("--num-sessions", 0, 1e9, c.num_sessions = (size_t)v)
        NUM("--max-tokens", 1, 1e7, c.max_tokens = (int)v)
        NUM("--default-max-tokens", 1, 1e7, c.default_max_tokens = (int)v)
        NUM("--temperature", 0, 100, c.temperature = v)
        NUM("--timeout", 0, 1e7, c.timeout_s = v)
        NUM("--progress-interval", 0.01, 1e6, c.progress_interval_s = v)
        else if (!strcmp(a, "--ignore-eos")) c.ignore_eos = true;
        else if (!strcmp(a, "--conversation-id")) c.conversation_id = true;
        else if (!strcmp(a, "--quiet")) c.progress = 0;
        else if (!strcmp(a, "--dry-run")) dry = true;
        else {
            fprintf(stderr, "kvserve bench: unknown option '%s' (see --help)\n", a);
            return 2;
        }
#undef NUM
#undef STR
    }
    if (c.request_rate <= 0 && c.concurrency < 1) {
        fprintf(stderr, "kvserve bench: --concurrency must be >= 1 (or use --request-rate)\n");
        return 2;
    }
    if (c.request_rate > 0 && c.concurrency == 1) {
        /* default concurrency means "no cap" in open loop unless given explicitly */
        bool given = false;
        for (int i = 1; i < argc; i++) given |= !strcmp(argv[i], "--concurrency");
        if (!given) c.concurrency = 0;
    }

    bench_trace t;
    kv_status st;
    if (trace_in) st = bench_trace_load(trace_in, &t, err, sizeof err);
    else if (!strcmp(dataset, "synthetic")) st = bench_trace_synth(&sp, &t, err, sizeof err);
    else st = bench_trace_dataset(dataset, dataset_path, dataset_sessions, prompt_words, sp.seed, &t, err, sizeof err);
    if (st) {
        fprintf(stderr, "kvserve bench: %s\n", err);
        return st == KV_EINVAL ? 2 : 1;
    }
    if (trace_out && bench_trace_save(&t, trace_out, err, sizeof err)) {
        fprintf(stderr, "kvserve bench: %s\n", err);
        bench_trace_free(&t);
        return 1;
    }
    if (dry) {
        size_t turns = 0;
        for (size_t i = 0; i < t.n_sessions; i++) turns += t.sessions[i].n_turns;
        printf("trace: %zu sessions, %zu turns\n", t.n_sessions, turns);
        bench_trace_free(&t);
        return 0;
    }

    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sa.sa_flags = SA_RESETHAND; /* a second Ctrl-C kills the process */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    signal(SIGPIPE, SIG_IGN);
    c.stop_flag = &g_stop;

    bench_result r;
    st = bench_run(&c, &t, &r, err, sizeof err);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (st && st != KV_ENOMEM) {
        fprintf(stderr, "kvserve bench: %s\n", err);
        bench_trace_free(&t);
        return 1;
    }
    if (st) fprintf(stderr, "kvserve bench: %s\n", err);
    int rc = st ? 1 : 0;
    bench_summary s;
    bench_summarize(&r, &s);
    bench_print_summary(stdout, &s);
    if (rc == 0 && !g_stop && s.requests > 0 && s.ok == 0) {
        fprintf(stderr, "kvserve bench: every request failed (see errors above)\n");
        rc = 3;
    }
    if (out_json) {
        if (bench_write_json(out_json, &c, &r, &s, err, sizeof err)) {
            fprintf(stderr, "kvserve bench: %s\n", err);
            rc = 1;
        }
    }
    if (plot_dir) {
        if (bench_plot(plot_dir, &r, err, sizeof err)) {
            fprintf(stderr, "kvserve bench: %s\n", err);
            rc = 1;
        } else {
            fprintf(stderr, "kvserve bench: charts in %s\n", plot_dir);
        }
    }
    bench_result_free(&r);
    bench_trace_free(&t);
    if (g_stop && rc == 0) rc = 130;
    return rc;
}
