/*
 * bench: a load generator that replays multi-turn conversation traces against any
 * OpenAI-compatible server (kvserve, llama.cpp's llama-server, vLLM, ...) and measures
 * what users feel: time to first token (TTFT), time per output token (TPOT),
 * inter-token latency (ITL), end-to-end latency, throughput, cached-token ratio.
 *
 * Pieces:
 *   trace   a list of sessions; each session = optional system prompt + turns; each turn
 *           = a user message, a generation length and a think time. Sources: datasets
 *           (MT-Bench, hh-rlhf, ShareGPT, war-and-peace cuts), a seeded synthetic
 *           agentic generator, or a saved trace file (JSON lines, one session a line).
 *   run     one thread drives every request through libcurl multi; every request
 *           streams (SSE) and every content chunk is timestamped with CLOCK_MONOTONIC.
 *           Turn k of a session sends the whole history, including the replies the
 *           server actually gave to turns 0..k-1.
 *   report  per-request records -> summary (mean/p50/p90/p99), table, JSON, gnuplot charts.
 *
 * Example:
 *   bench_synth_params sp = bench_synth_defaults();
 *   bench_trace t; bench_trace_synth(&sp, &t, err, sizeof err);
 *   bench_config c = bench_config_defaults(); c.url = "http://127.0.0.1:8000";
 *   bench_result r; bench_run(&c, &t, &r, err, sizeof err);
 *   bench_summary s; bench_summarize(&r, &s); bench_print_summary(stdout, &s);
 *   bench_result_free(&r); bench_trace_free(&t);
 *
 * "Tokens" in trace sizes are whitespace-separated words (no tokenizer on the client);
 * measured token counts come from the server's `usage` when it reports one.
 */
#ifndef KV_BENCH_H
#define KV_BENCH_H

#include <stdio.h>

#include "base/base.h"

/* ---------------------------------------------------------------- traces ---- */

typedef struct {
    char *user;     /* owned, UTF-8: the user message of this turn */
    int max_tokens; /* tokens to generate for this turn; 0 = the run's default */
    int think_ms;   /* pause after the previous turn's reply before this turn is sent */
} bench_turn;

typedef struct {
    char *system;      /* owned system prompt, or NULL */
    bench_turn *turns; /* owned, n_turns entries (>= 1) */
    size_t n_turns;
} bench_session;

typedef struct {
    bench_session *sessions; /* owned, n_sessions entries */
    size_t n_sessions;
} bench_trace;

void bench_trace_free(bench_trace *t); /* frees everything; leaves *t zeroed */

/* Synthetic agentic trace. All sizes in words ("tokens" approximated by words).
 * Session i gets the shared system prompt when the seeded draw < shared_fraction,
 * else a system prompt of its own of the same length. Turn 0's user message is a
 * task of first_user_words words; every turn (0 included) then carries a
 * tool-output-like block of tool_words words. think_ms is exponential with mean
 * think_ms_mean (0 = no pause; turn 0 always 0). Same params + seed -> same trace. */
typedef struct {
    size_t n_sessions;      /* N */
    size_t system_words;    /* S */
    double shared_fraction; /* f in [0,1] */
    size_t turns;           /* T per session */
    size_t first_user_words;
    size_t tool_words;      /* u per turn */
    int output_tokens;      /* o per turn (max_tokens) */
    double think_ms_mean;
    uint64_t seed;
} bench_synth_params;

bench_synth_params bench_synth_defaults(void);
/* Fills *out (owned by caller, free with bench_trace_free). KV_EINVAL on bad params
 * (n_sessions or turns 0, fraction outside [0,1]); *out zeroed on failure. */
kv_status bench_trace_synth(const bench_synth_params *p, bench_trace *out, char *err, size_t errlen);

/* Dataset trace. kind: "mtbench" (two-turn questions, JSON lines with "turns"),
 * "hh-rlhf" (.jsonl or .jsonl.gz, "chosen" split into Human turns; gzip read by
 * piping through `gzip -dc`), "sharegpt" (JSON array, conversations[0].value, one turn),
 * "war-and-peace" (any text file: prompts of prompt_words words cut at seeded offsets).
 * path NULL -> $KVSERVE_TEST_DATA/datasets/<default file>. At most max_sessions
 * sessions (0 = all; war-and-peace defaults to 100). Turns get max_tokens 0 (the run's
 * default). KV_ENOTFOUND / KV_EFORMAT / KV_EINVAL with a message; *out zeroed on failure. */
kv_status bench_trace_dataset(const char *kind, const char *path, size_t max_sessions,
                              size_t prompt_words, uint64_t seed, bench_trace *out, char *err,
                              size_t errlen);

/* Trace files: JSON lines, one session per line:
 *   {"system":"...","turns":[{"user":"...","max_tokens":16,"think_ms":0},...]}
 * Keys sorted, compact; the bytes depend only on the trace (reproducible). */
kv_status bench_trace_save(const bench_trace *t, const char *path, char *err, size_t errlen);
kv_status bench_trace_load(const char *path, bench_trace *out, char *err, size_t errlen);
/* The same serialization into a heap string (caller frees), NULL on ENOMEM. */
char *bench_trace_to_jsonl(const bench_trace *t);

/* ---------------------------------------------------------------- SSE ---- */

/* Incremental Server-Sent Events parser: feed bytes as they arrive in any split; the
 * callback gets each event's data (multi-line data joined with '\n', NUL-terminated,
 * borrowed for the call). Comments and non-data fields are ignored. A callback
 * returning non-zero stops parsing and is returned by bench_sse_feed. */
typedef int (*bench_sse_cb)(void *ud, const char *data, size_t len);
typedef struct {
    kv_buf line;  /* partial line */
    kv_buf data;  /* data of the event being assembled */
    bool has_data;
    bool skip_lf; /* last byte was '\r' */
} bench_sse;
void bench_sse_init(bench_sse *p);
void bench_sse_free(bench_sse *p);
int bench_sse_feed(bench_sse *p, const char *buf, size_t n, bench_sse_cb cb, void *ud);
/* Delivers a pending event that the stream ended without a blank line after. */
int bench_sse_finish(bench_sse *p, bench_sse_cb cb, void *ud);

/* ---------------------------------------------------------------- run ---- */

typedef enum { BENCH_API_CHAT = 0, BENCH_API_COMPLETIONS = 1 } bench_api;

typedef struct {
    const char *url;     /* borrowed: base URL, e.g. "http://127.0.0.1:8000" (no /v1) */
    const char *model;   /* borrowed; NULL = ask GET /v1/models and use the first id */
    const char *api_key; /* borrowed; NULL = no Authorization header */
    bench_api api;
    int concurrency;     /* closed loop: sessions in progress at once (>=1); with a request
                            rate: a cap on sessions in progress (0 = none) */
    double request_rate; /* > 0: open loop, session starts arrive as Poisson(rate)/s */
    double duration_s;   /* > 0: stop starting requests after this; in-flight ones finish */
    size_t num_sessions; /* sessions to run (trace reused cyclically); 0 = trace size,
                            or unlimited when duration_s > 0 */
    int max_tokens;      /* > 0: overrides every turn's max_tokens; default for turns with 0 */
    int default_max_tokens; /* used for turns with max_tokens 0 when max_tokens is 0 */
    bool ignore_eos;
    bool conversation_id;   /* send "conversation_id":"bench-<run>-<session>" */
    double temperature;     /* < 0: not sent */
    double timeout_s;       /* per request, 0 = none */
    uint64_t seed;          /* arrivals */
    int progress;           /* 0 none, 1 auto (stderr tty -> live line, else periodic) */
    double progress_interval_s; /* for the non-tty lines */
    FILE *progress_out;     /* borrowed; NULL = stderr */
    volatile int *stop_flag; /* borrowed; when it becomes non-zero the run stops: in-flight
                                requests are aborted and recorded as "cancelled" */
    /* Clock of every time the runner reads (request start, chunk arrivals, end, scheduling):
     * monotonic ns; NULL = kv_now_ns. Tests inject a virtual clock so measured TTFT / ITL are
     * exact instead of compared with the wall clock on a loaded machine. */
    uint64_t (*now_ns)(void *arg);
    void *clock_arg;
    /* Observers (tests; NULL = none), called on the runner's thread: a request is about to
     * start (before its start time is read), a content chunk was recorded (after its arrival
     * time was read), a request's record is complete (after its end time was read). */
    void (*on_request_start)(void *arg);
    void (*on_chunk)(void *arg);
    void (*on_request_done)(void *arg);
    /* The runner blocks waiting for the network (true) / has woken up (false). */
    void (*on_wait)(void *arg, bool waiting);
    void *observer_arg;
} bench_config;

bench_config bench_config_defaults(void);

/* One request's record. Times are seconds, CLOCK_MONOTONIC, relative to the run start
 * (start_s) or to the request's own send time (the rest). */
typedef struct {
    uint32_t session;   /* sequence number of the session in this run */
    uint32_t turn;
    uint32_t trace_session; /* index into the trace */
    double start_s;     /* when the request was handed to curl */
    double ttft_s;      /* first non-empty content chunk; -1 if none */
    double e2e_s;       /* transfer finished (ok or not); -1 never */
    double *chunk_s;    /* owned: arrival of each non-empty content chunk, n_chunks */
    size_t n_chunks;
    int prompt_tokens;     /* from usage; -1 if not reported */
    int completion_tokens; /* from usage; -1 if not reported */
    int cached_tokens;     /* usage.prompt_tokens_details.cached_tokens; -1 if absent */
    int max_tokens;        /* what was asked */
    size_t prompt_chars;   /* bytes of the prompt / messages' contents sent */
    size_t output_chars;   /* bytes of content received */
    int http_status;       /* 0 if no response */
    char worker[64];       /* X-Kvserve-Worker response header, "" if absent */
    char *error_kind;      /* owned, NULL = ok: "http_500", "connect", "timeout",
                              "stream_error", "incomplete_stream", "bad_json",
                              "connection_closed", "cancelled", "curl_<n>" */
    char *error_msg;       /* owned, NULL if ok */
} bench_record;

/* Output tokens of a record: usage.completion_tokens when reported, else n_chunks. */
int bench_record_output_tokens(const bench_record *r);

typedef struct {
    bench_record *records; /* owned, in completion order */
    size_t n_records;
    double duration_s;     /* first send to last completion */
    char *model;           /* owned: the model name used */
    bool interrupted;      /* stopped by stop_flag */
    size_t sessions_started, sessions_completed;
    size_t sessions_aborted; /* a turn failed, so its later turns were not sent */
} bench_result;

/* Runs the trace. Returns KV_OK when the run happened (even if requests failed: they are
 * records with error_kind set), KV_EINVAL for bad config, KV_EIO when the model list
 * could not be fetched. *out is filled in either case of KV_OK; free with
 * bench_result_free. Not thread-safe with other curl users calling curl_global_init. */
kv_status bench_run(const bench_config *c, const bench_trace *t, bench_result *out, char *err,
                    size_t errlen);
void bench_result_free(bench_result *r);

/* ---------------------------------------------------------------- report ---- */

typedef struct {
    double mean, p50, p90, p99, min, max; /* seconds (NaN when n == 0) */
    size_t n;
} bench_dist;

#define BENCH_MAX_KINDS 16
#define BENCH_MAX_WORKERS 32
typedef struct {
    size_t requests, ok, failed;
    double duration_s;
    double req_per_s, output_tok_per_s, total_tok_per_s;
    long long prompt_tokens, output_tokens, cached_tokens; /* sums over ok requests */
    double cached_ratio; /* cached_tokens / prompt_tokens over requests reporting both; NaN if none */
    bench_dist ttft, tpot, itl, e2e;
    struct { char name[64]; size_t count; } errors[BENCH_MAX_KINDS];
    size_t n_error_kinds;
    struct { char name[64]; size_t count; } workers[BENCH_MAX_WORKERS];
    size_t n_workers;
    bool interrupted;
} bench_summary;

/* Percentile p in [0,100] of sorted v[0..n) with linear interpolation (numpy's default). */
double bench_percentile(const double *sorted, size_t n, double p);
void bench_summarize(const bench_result *r, bench_summary *s);
void bench_print_summary(FILE *f, const bench_summary *s);
/* {"config":{...},"summary":{...},"requests":[...]}; KV_EIO with a message on failure. */
kv_status bench_write_json(const char *path, const bench_config *c, const bench_result *r,
                           const bench_summary *s, char *err, size_t errlen);
/* Prints the summaries of n (2..16) --out files side by side with ratios against the first
 * (two files: columns A, B, B/A), plus the busiest worker's share over the mean: for every
 * file but the first (the baseline, e.g. one worker alone) over max(pool, workers seen)
 * workers (a worker of the pool that got no request counts as 0), else over those seen. plot_dir (or NULL): also compare.dat, compare.gp and compare.svg/.png there (bars of
 * req/s, cached ratio, TTFT p50/p90, busiest-worker share per file with the workers used;
 * gnuplot as bench_plot). KV_EFORMAT for a file without a summary, KV_EIO when gnuplot fails. */
kv_status bench_compare(FILE *f, const char *const *paths, int n, const char *plot_dir, int pool, char *err,
                        size_t errlen);
/* Writes data files, a gnuplot script and SVG + PNG charts into dir (created) by
 * running `gnuplot` (path from $GNUPLOT, default "gnuplot"). KV_EIO if gnuplot fails
 * (the data files and script are still there). */
kv_status bench_plot(const char *dir, const bench_result *r, char *err, size_t errlen);

#endif
