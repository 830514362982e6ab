/* Prometheus text exposition (format 0.0.4) of engine and HTTP counters. */
#include "http_internal.h"
#include "tokenizer/prefix_cache.h"

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
                         const char *model_name) {
    char model[128];
    label_value(model, sizeof model, model_name);
    kv_status st = KV_OK;
#define C(name, help, v) st |= metric(out, "kvserve_" name, "counter", help, model, (double)(v))
#define G(name, help, v) st |= metric(out, "kvserve_" name, "gauge", help, model, (double)(v))
    C("requests_total", "Requests accepted by the engine.", s->requests_total);
    C("requests_finished_total", "Requests that finished (stop or length).", s->requests_finished);
    C("requests_failed_total", "Requests that ended with an error.", s->requests_failed);
    C("requests_cancelled_total", "Requests cancelled (client disconnect or shutdown).",
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
    if (c) {
        C("http_requests_total", "HTTP requests received.", c->http_requests_total);
        C("http_responses_4xx_total", "HTTP responses with a 4xx status.", c->http_errors_4xx);
        C("http_responses_5xx_total", "HTTP responses with a 5xx status.", c->http_errors_5xx);
        C("client_disconnects_total", "Generation requests whose client went away.",
          c->client_disconnects);
    }
#undef C
#undef G
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
