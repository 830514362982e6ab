/*
 * router: `kvserve router`, the front door of disaggregated serving (docs/disaggregation.md,
 * "Router"). One libevent loop: the client side is an http_listener (src/http/listener.h), the
 * upstream side a libcurl multi handle driven from the same loop (socket + timer callbacks).
 * Each client request becomes a context leg and a generation leg (context first or
 * generation first), or one plain leg when only an aggregated pool is configured or the
 * generation worker can prefill locally (conditional disaggregation). Streams are relayed
 * event by event with backpressure (the upstream transfer pauses while the client lags).
 * Retries follow the delivery classes of spec decision 3 (router_internal.h).
 */
#ifndef KV_ROUTER_H
#define KV_ROUTER_H

#include <stdbool.h>
#include <stddef.h>

#include "../base/base.h"
#include "../http/http.h"

enum router_style { ROUTER_CONTEXT_FIRST = 0, ROUTER_GENERATION_FIRST };
/* Placement policies (docs/routing.md); the values equal router_internal.h's rt_policy_kind. */
enum router_policy { ROUTER_ROUND_ROBIN = 0, ROUTER_LEAST_LOADED, ROUTER_KV_AWARE, ROUTER_CONVERSATION };

struct router_config {
    const char *host;           /* default 127.0.0.1 */
    int port;                   /* 0 = a free port (see port_file) */
    const char *port_file;      /* optional */
    const char *const *context; /* worker base URLs ("http://host:port"), borrowed */
    int n_context;
    const char *const *generation;
    int n_generation;
    const char *const *workers; /* aggregated pool (plain proxy when no context/generation) */
    int n_workers;
    enum router_style style;
    int max_retries;            /* spec §2 max_retries (default 1) */
    long max_local_prefill_tokens; /* < 0 = conditional disaggregation off */
    double timeout_s;           /* per upstream leg, 0 = none (default 180) */
    size_t max_body_bytes;      /* client bodies; default 16 MiB */
    struct http_conn_limits conn; /* client connection limits (http.h; zeros = defaults) */
    /* placement (docs/routing.md); applied to the aggregated pool and to each role */
    enum router_policy policy;  /* default round robin */
    bool load_tokens;           /* --load-metric tokens (default requests) */
    int min_match_blocks;       /* conversation: --new-conversation-min-match-blocks (32; 0 = off) */
    int max_conversations;      /* conversation history (100000) */
    int max_conversation_keys;  /* content keys kept per conversation (512) */
    int tokens_per_block;       /* the workers' block size (16); checked against kv_aware workers */
    const char *hash_key_file;  /* the workers' --hash-key-file (kv_aware: required; conversation:
                                   optional, else a random key per router) */
    const char *tokenizer;      /* GGUF / tokenizer.json of the served model, or NULL */
    double predicted_prefix_ttl_s; /* kv_aware in-flight awareness window (5 s; 0 = off) */
    int kv_balance_threshold;   /* kv_aware BUG-14 guard: legs beyond the least loaded (32; 0 = off) */
    double kv_overlap_weight;   /* kv_aware: weight of a prefill token against a token of load (1) */
    double health_interval_s;   /* GET /health period (1 s; 0 = off) */
    const char *worker_api_key; /* sent as "Authorization: Bearer KEY" on every request to a
                                   worker (workers started with --api-key); NULL = none */
    const char *etcd;           /* etcd base URL (v3 JSON gateway): discover workers, or NULL */
    const char *etcd_prefix;    /* default ETCD_DEFAULT_PREFIX "kvserve/workers/" */
    const char *coordinator;    /* another router's base URL: place through its /select, or NULL */
};

/* Serves until SIGINT/SIGTERM. Returns KV_OK on a clean stop; KV_EINVAL for a bad config,
 * KV_EIO if the address cannot be bound (message in err). Not thread-safe: one router per
 * process (libcurl global init). */
kv_status router_run(const struct router_config *cfg, char *err, size_t errlen);

#endif
