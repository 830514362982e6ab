/*
 * http: the OpenAI-compatible HTTP front of a worker (libevent evhttp, one loop thread).
 * Routes: POST /v1/completions, POST /v1/chat/completions (stream and non-stream),
 * GET /v1/models, GET /v1/models/{model}, GET /health (liveness), GET /ready (readiness),
 * POST /tokenize, POST /detokenize, GET /metrics,
 * GET /server_info, GET /kv_events (an SSE stream of KV block events; ?poll=1 for one JSON
 * page). The wire format of every route, field and error is in docs/api.md.
 * The loop never blocks on the engine: requests are validated, rendered and tokenized
 * here, handed to engine_submit, and engine events come back through a locked queue and
 * event_active(). A client disconnect cancels the request.
 * Errors: OpenAI error JSON {"error":{"message","type","param","code"}} with 400 (bad JSON,
 * invalid parameter, prompt too long), 401 (API key), 404 (unknown route/model), 413 (body
 * too large), 503 (queue full, draining; with Retry-After). After the first streamed byte, an
 * error is a `data: {"error":...}` event followed by `data: [DONE]`. SIGTERM drains (server.c).
 */
#ifndef KV_HTTP_H
#define KV_HTTP_H

#include "../engine/engine.h"

/* Connection limits of an HTTP front (the worker's and the router's; conn_gate.h enforces
 * them before a request reaches a handler). 0 in any field = its default. */
struct http_conn_limits {
    size_t max_buffered_bytes; /* request bytes being read or answered, all connections;
                                  default 256 MiB; a request that does not fit gets 503 */
    int max_connections;       /* default 4096 (at most RLIMIT_NOFILE - 64); more get 503 */
    int header_timeout_ms;     /* request head within, body reads at most this far apart;
                                  default 60000 (nginx's client_header/body_timeout); 408 */
    int keepalive_timeout_ms;  /* idle keep-alive connections closed; default 75000 (nginx) */
};

struct http_config {
    const char *host;        /* default "127.0.0.1" */
    int port;                /* default 8000; 0 = pick a free port (logged) */
    size_t max_body_bytes;   /* default 16 MiB; larger bodies get 413 */
    struct http_conn_limits conn; /* connection limits (zeros = defaults) */
    int max_kv_subscribers;  /* GET /kv_events streams at once; more get 503; 0 = 64 */
    int prep_threads;        /* threads that parse, render and tokenize requests; 0 = 2 */
    const char *served_model_name; /* id in /v1/models and responses; default model name */
    const char *port_file;   /* optional: write the bound port here once listening */
    const char *tool_call_parser; /* tool-call format: "hermes" | "llama3_json" | "mistral";
                                     NULL = detected from the chat template (grammar.h) */
    /* optional, borrowed (outlives http_serve): prompts of /v1/completions,
     * /v1/chat/completions and /tokenize are tokenized through this prefix token cache
     * (tokenizer/prefix_cache.h; same ids as tok_encode), and /metrics reports its counters.
     * NULL (the default) = plain tok_encode. */
    struct prefix_cache *prefix_cache;
    /* disaggregated serving (docs/disaggregation.md); all optional, borrowed */
    const char *role;          /* "aggregated" (NULL = this) | "context" | "generation" */
    const char *kv_endpoint;   /* the KV-transfer agent's "host:port" (ctx_info_endpoint) */
    const char *kv_transport;  /* "tcp" | "ucx" | "cuda_ipc" */
    const char *kv_pool_json;  /* the KV page table as JSON text (sent as disaggregated_params.pool) */
    /* optional hooks (loop thread): once listening (host, bound port; before the port file is
     * written; a non-KV_OK return stops http_serve with that status and the message in err),
     * and when stopping begins (before requests are cancelled): etcd registration */
    kv_status (*on_listening)(const char *host, int port, void *arg, char *err, size_t errlen);
    void (*on_stopping)(void *arg);
    void *hook_arg;
    /* ---- serving names, access, drain (docs/api.md); zero = defaults ---- */
    const char *const *model_aliases; /* (n_model_aliases) more names the model answers to and
                                        /v1/models lists (--served-model-name A B C: B, C) */
    int n_model_aliases;
    const char *const *api_keys;     /* (n_api_keys) accepted keys (Authorization: Bearer KEY)
                                        on every route but /health, /ready, /metrics and CORS
                                        preflights; none = no authentication */
    int n_api_keys;
    const char *const *allowed_origins; /* (n_allowed_origins) CORS origins, "*" = any; none =
                                        no CORS headers and preflights answer 403 */
    int n_allowed_origins;
    int shutdown_timeout_s;          /* SIGTERM/SIGINT: stop taking new work, let in-flight
                                        requests finish this long, then fail them with 503.
                                        0 = the default 30 s; < 0 = fail them at once */
};

/* Serves until SIGINT/SIGTERM (or http_server_stop from another thread); returns KV_OK on a
 * clean stop, KV_EIO if the address cannot be bound (message in err). Borrowed: engine,
 * model, tokenizer. */
kv_status http_serve(const struct http_config *cfg, engine_t *e, const model_t *m,
                     const tokenizer_t *t, char *err, size_t errlen);
void http_server_stop(void);
#define HTTP_DEFAULT_SHUTDOWN_TIMEOUT_S 30

/* The prompt of a completions (chat false) or chat body as token ids, exactly as a worker with
 * tokenizer t computes them (the router hashes these: kv_aware block hashes, conversation
 * content keys). t may be NULL when the prompt is given as ids. *ids heap (caller frees);
 * *cache_salt (may be NULL) gets a heap copy of the request's cache_salt or NULL.
 * KV_EINVAL: the body is not a valid request, or a text prompt without a tokenizer (message
 * in err); KV_ENOMEM. Thread-safe (t is read-only). */
kv_status http_prompt_ids(const tokenizer_t *t, bool chat, const char *body, size_t len, int32_t **ids,
                          size_t *n, char **cache_salt, char *err, size_t errlen);

#endif
