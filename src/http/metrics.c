/*
 * Prometheus text exposition (format 0.0.4) of engine and HTTP counters: kvserve's own
 * kvserve_* names, then the same quantities under the vLLM names that gateways and dashboards
 * already read (the Gateway API Inference Extension's endpoint picker defaults to
 * vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc and
 * vllm:cache_config_info; docs/metrics.md lists every name).
 */
#include <stdio.h>
#include <time.h>

#include "http_internal.h"
#include "tokenizer/prefix_cache.h"

/* Bucket upper bounds in seconds (vLLM's, with finer low buckets for TPOT: CPU decode steps of
 * small models take well under 10 ms). */
static const double B_TTFT[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double B_TPOT[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
static const double B_E2E[] = {0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                               20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const struct {
    const char *name, *help;
    const double *bounds;
    int n;
} HIST[MH_COUNT] = {
    [MH_TTFT] = {"time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                 B_TTFT, (int)(sizeof B_TTFT / sizeof *B_TTFT)},
    [MH_TPOT] = {"time_per_output_token_seconds",
                 "Histogram of time per output token in seconds (per choice: (last - first token) "
                 "/ (tokens - 1)).", B_TPOT, (int)(sizeof B_TPOT / sizeof *B_TPOT)},
    [MH_E2E] = {"e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
                B_E2E, (int)(sizeof B_E2E / sizeof *B_E2E)},
    [MH_QUEUE] = {"request_queue_time_seconds",
                  "Histogram of time requests spent waiting for admission in seconds.", B_TTFT,
                  (int)(sizeof B_TTFT / sizeof *B_TTFT)},
};
_Static_assert(sizeof B_E2E / sizeof *B_E2E <= METRICS_MAX_BUCKETS, "METRICS_MAX_BUCKETS");
_Static_assert(sizeof B_TPOT / sizeof *B_TPOT <= METRICS_MAX_BUCKETS, "METRICS_MAX_BUCKETS");
_Static_assert(sizeof B_TTFT / sizeof *B_TTFT <= METRICS_MAX_BUCKETS, "METRICS_MAX_BUCKETS");

void metrics_observe(struct http_latency *l, enum metrics_hist_kind k, double seconds) {
    if (!l || k < 0 || k >= MH_COUNT || !(seconds >= 0.0)) return;
    struct metrics_hist *h = &l->h[k];
    int i = 0;
    while (i < HIST[k].n && seconds > HIST[k].bounds[i]) i++;
    if (i < HIST[k].n) h->bucket[i]++;
    h->count++;
    h->sum += seconds;
}

static kv_status render_hist(kv_buf *b, const char *prefix, enum metrics_hist_kind k,
                             const struct metrics_hist *h, const char *model) {
    kv_status st = kv_buf_printf(b, "# HELP %s%s %s\n# TYPE %s%s histogram\n", prefix, HIST[k].name,
                                 HIST[k].help, prefix, HIST[k].name);
    uint64_t cum = 0;
    for (int i = 0; i < HIST[k].n; i++) {
        cum += h->bucket[i];
        st |= kv_buf_printf(b, "%s%s_bucket{model_name=\"%s\",le=\"%g\"} %llu\n", prefix,
                            HIST[k].name, model, HIST[k].bounds[i], (unsigned long long)cum);
    }
    st |= kv_buf_printf(b, "%s%s_bucket{model_name=\"%s\",le=\"+Inf\"} %llu\n", prefix,
                        HIST[k].name, model, (unsigned long long)h->count);
    st |= kv_buf_printf(b, "%s%s_sum{model_name=\"%s\"} %.17g\n%s%s_count{model_name=\"%s\"} %llu\n",
                        prefix, HIST[k].name, model, h->sum, prefix, HIST[k].name, model,
                        (unsigned long long)h->count);
    return st;
}

static kv_status metric(kv_buf *b, const char *name, const char *type, const char *help,
                        const char *model, double v) {
    return kv_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s{model_name=\"%s\"} %.17g\n", name, help,
                         name, type, name, model, v);
}

/* A label value safe to print between quotes (model names come from file names). */
static void label_value(char *out, size_t cap, const char *name) {
    size_t j = 0;
    for (const char *p = name ? name : ""; *p && j + 1 < cap; p++)
        out[j++] = (*p == '"' || *p == '\\' || *p == '\n') ? '_' : *p;
    out[j] = 0;
}

kv_status metrics_render(kv_buf *out, const struct engine_stats *s, const struct http_counters *c,
                         const struct metrics_info *info, const char *model_name) {
    char model[128];
    label_value(model, sizeof model, model_name);
    kv_status st = KV_OK;
#define C(name, help, v) st |= metric(out, "kvserve_" name, "counter", help, model, (double)(v))
#define G(name, help, v) st |= metric(out, "kvserve_" name, "gauge", help, model, (double)(v))
    C("requests_total", "Requests accepted by the engine (each choice of n > 1 once forked after the prompt).", s->requests_total);
    C("requests_finished_total", "Requests that finished (stop or length).", s->requests_finished);
    C("requests_failed_total", "Requests that ended with an error (cancellations not included).",
      s->requests_failed);
    C("requests_cancelled_total",
      "Requests cancelled (client disconnect, shutdown, a KV transfer the peer worker cancelled).",
      s->requests_cancelled);
    C("prompt_tokens_total", "Prompt tokens of accepted requests.", s->prompt_tokens_total);
    C("generation_tokens_total", "Generated tokens.", s->generation_tokens_total);
    C("prefill_tokens_computed_total", "Prompt tokens run through the model (incl. recompute).",
      s->prefill_tokens_computed);
    C("preemptions_total", "Running requests preempted for lack of KV blocks.", s->preemptions_total);
    C("engine_steps_total", "Engine steps.", s->steps_total);
    G("num_requests_waiting", "Requests waiting for admission.", s->n_waiting);
    G("num_requests_running", "Requests in prefill or decode.", s->n_running);
    G("kv_blocks_total", "KV cache blocks in the pool.", s->kv_blocks_total);
    G("kv_blocks_used", "KV cache blocks in use.", s->kv_blocks_used);
    G("kv_blocks_free", "Free KV cache blocks.", s->kv_blocks_free);
    G("kv_cache_usage_ratio", "Fraction of KV blocks in use.",
      s->kv_blocks_total > 0 ? (double)s->kv_blocks_used / s->kv_blocks_total : 0.0);
    /* KV reuse */
    G("prefix_cache_enabled", "1 if KV block reuse is on.", s->prefix_cache_enabled ? 1 : 0);
    C("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
      s->prefix_cache_query_tokens);
    C("prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
      s->prefix_cache_hit_tokens);
    G("prefix_cache_hit_rate", "prefix_cache_hits_total / prefix_cache_queries_total.",
      s->prefix_cache_query_tokens ? (double)s->prefix_cache_hit_tokens / (double)s->prefix_cache_query_tokens : 0.0);
    G("kv_blocks_cached", "Unused KV blocks kept for reuse (counted as free).", s->kv_blocks_cached);
    C("kv_evictions_total", "Cached KV blocks evicted from the device pool.", s->kv_evictions);
    C("kv_offloads_total", "Evicted KV blocks copied to the host tier.", s->kv_offloads);
    G("kv_host_blocks_total", "Host tier size in blocks.", s->kv_host_blocks_total);
    G("kv_host_blocks_cached", "KV blocks held in the host tier.", s->kv_host_blocks_cached);
    C("kv_host_evictions_total", "KV blocks dropped from the host tier.", s->kv_host_evictions);
    C("kv_cache_hits_device_total", "KV blocks reused from the device pool.", s->kv_hits_device);
    C("kv_cache_hits_host_total", "KV blocks reused from the host tier.", s->kv_hits_host);
    G("num_requests_transfer_out", "Context legs whose blocks a KV transfer still holds.",
      s->n_transfer_out);
    G("num_requests_transfer_in", "Generation legs waiting for their KV transfer.", s->n_transfer_in);
    C("kv_transfer_sends_ok_total", "KV transfers this context worker completed.", s->kv_sends_ok);
    C("kv_transfer_sends_failed_total", "KV transfers that failed, were cancelled or timed out (sender).",
      s->kv_sends_failed);
    C("kv_transfer_recvs_ok_total", "KV transfers this generation worker received.", s->kv_recvs_ok);
    C("kv_transfer_recvs_failed_total", "KV transfers that failed or were cancelled (receiver).",
      s->kv_recvs_failed);
    C("kv_transfer_deadlines_total", "Engine-side KV-transfer deadlines that fired.",
      s->kv_transfer_timeouts);
    C("prefix_waits_total", "Scheduler passes requests spent waiting for an in-flight prefix.",
      s->prefix_waits_total);
    C("scheduler_deadlock_failures_total", "Requests failed by the no-progress detector.",
      s->deadlock_failures);
    /* constrained decoding (docs/structured-output.md) */
    struct gram_stats gs;
    gram_get_stats(&gs);
    C("grammar_steps_total", "Sampling steps masked by a request's grammar.", s->grammar_steps);
    C("grammar_seconds_total", "Engine time in the grammar hooks (masks, applying them, advancing).",
      (double)s->grammar_ns / 1e9);
    C("grammar_mask_cache_hits_total", "Token masks served from a grammar's mask cache.", gs.mask_hits);
    C("grammar_mask_cache_misses_total", "Token masks computed by a vocabulary trie walk.", gs.mask_misses);
    C("grammar_mask_walk_seconds_total", "Time spent in vocabulary trie walks.", (double)gs.walk_ns / 1e9);
    if (c) {
        C("http_requests_total", "HTTP requests received.", c->http_requests_total);
        C("http_responses_4xx_total", "HTTP responses with a 4xx status.", c->http_errors_4xx);
        C("http_responses_5xx_total", "HTTP responses with a 5xx status.", c->http_errors_5xx);
        C("client_disconnects_total", "Generation requests whose client went away.",
          c->client_disconnects);
        for (int k = 0; k < MH_COUNT; k++) st |= render_hist(out, "kvserve_", k, &c->lat.h[k], model);
    }
    if (info) G("draining", "1 while the server drains after SIGTERM (/ready answers 503).", info->draining);
#undef C
#undef G
    /* the vLLM names (gateways, dashboards) */
    double usage = s->kv_blocks_total > 0 ? (double)s->kv_blocks_used / s->kv_blocks_total : 0.0;
#define V(name, type, help, v) st |= metric(out, "vllm:" name, type, help, model, (double)(v))
    V("num_requests_running", "gauge", "Number of requests in model execution batches.", s->n_running);
    V("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", s->n_waiting);
    V("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage);
    V("gpu_cache_usage_perc", "gauge", "KV-cache usage (the older name). 1 means 100 percent usage.", usage);
    V("prompt_tokens_total", "counter", "Number of prefill tokens processed.", s->prompt_tokens_total);
    V("generation_tokens_total", "counter", "Number of generation tokens processed.",
      s->generation_tokens_total);
    V("num_preemptions_total", "counter", "Cumulative number of preemptions from the engine.",
      s->preemptions_total);
    V("prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
      s->prefix_cache_query_tokens);
    V("prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
      s->prefix_cache_hit_tokens);
#undef V
    if (c) {
        st |= kv_buf_printf(out, "# HELP vllm:request_success_total Count of successfully processed requests.\n"
                                 "# TYPE vllm:request_success_total counter\n"
                                 "vllm:request_success_total{model_name=\"%s\",finished_reason=\"stop\"} %llu\n"
                                 "vllm:request_success_total{model_name=\"%s\",finished_reason=\"length\"} %llu\n",
                            model, (unsigned long long)c->lat.finished_stop, model,
                            (unsigned long long)c->lat.finished_length);
        for (int k = 0; k < MH_COUNT; k++) st |= render_hist(out, "vllm:", k, &c->lat.h[k], model);
    }
    st |= kv_buf_printf(out, "# HELP vllm:cache_config_info Information of the KV cache configuration.\n"
                             "# TYPE vllm:cache_config_info gauge\n"
                             "vllm:cache_config_info{model_name=\"%s\",block_size=\"%d\",num_gpu_blocks=\"%d\","
                             "enable_prefix_caching=\"%s\",cache_dtype=\"auto\"} 1\n",
                        model, info ? info->tokens_per_block : 0, s->kv_blocks_total,
                        s->prefix_cache_enabled ? "True" : "False");
    /* no LoRA adapters: an empty info series (an endpoint picker reads it when present) */
    st |= kv_buf_printf(out, "# HELP vllm:lora_requests_info Running stats on LoRA requests.\n"
                             "# TYPE vllm:lora_requests_info gauge\n"
                             "vllm:lora_requests_info{max_lora=\"0\",running_lora_adapters=\"\","
                             "waiting_lora_adapters=\"\"} %lld\n", (long long)time(NULL));
    return st ? KV_ENOMEM : KV_OK;
}

kv_status metrics_render_prefix_token_cache(kv_buf *out, const struct prefix_cache_stats *s,
                                            const char *model_name) {
    char model[128];
    label_value(model, sizeof model, model_name);
    kv_status st = KV_OK;
#define C(name, help, v) st |= metric(out, "kvserve_prefix_token_cache_" name, "counter", help, model, (double)(v))
#define G(name, help, v) st |= metric(out, "kvserve_prefix_token_cache_" name, "gauge", help, model, (double)(v))
    C("hits_total", "Prompts tokenized from a cached prefix plus the tail.", s->hits);
    C("misses_total", "Looked-up prompts tokenized in full (incl. resync failures).", s->misses);
    C("resync_failures_total", "Splices rejected because the re-tokenized ids did not match.",
      s->resync_failures);
    C("errors_total", "Internal failures that fell back to plain tokenization.", s->errors);
    C("evictions_total", "Entries evicted (LRU).", s->evictions);
    G("entries", "Cached prompts.", s->entries);
    G("bytes", "Bytes of cached prompt text.", s->total_bytes);
#undef C
#undef G
    return st ? KV_ENOMEM : KV_OK;
}
