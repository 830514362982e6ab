/*
 * serve_disagg: the disaggregated-serving options of `kvserve serve` (--role and --kv-*) and the
 * glue between the engine's KV-transfer seam (engine.h) and the transfer agent (transfer.h).
 */
#ifndef KV_CLI_SERVE_DISAGG_H
#define KV_CLI_SERVE_DISAGG_H

#include <stdio.h>

#include "backend/backend.h"
#include "engine/engine.h"
#include "http/http.h"

struct serve_disagg {
    /* options */
    const char *role;            /* "aggregated" | "context" | "generation" */
    const char *kv_host;         /* transfer agent listen address (default: --host) */
    int kv_port;                 /* 0 = any free port */
    const char *kv_transport;    /* "tcp" | "ucx" (default ucx when built with UCX, else tcp) */
    double kv_timeout_s;         /* --kv-transfer-timeout (60) */
    double kv_stale_ttl_s;       /* --kv-stale-ttl (120) */
    unsigned long long kv_bounce_min_bytes; /* --kv-bounce-min-bytes (2 MiB) */
    const char *kv_opt;          /* the last --kv-* transfer option given (refused with --role aggregated) */
    /* state */
    void *agent;                 /* kvx_agent_t */
    char *pool_json;             /* owned: the page table as JSON */
    char endpoint[128];
};

void serve_disagg_defaults(struct serve_disagg *d);
/* Prints the options' help lines. */
void serve_disagg_usage(FILE *f);
/* Handles option a with value v if it is one of ours: returns 1 (taken), 0 (not ours) or 2
 * (bad value: message printed). */
int serve_disagg_option(struct serve_disagg *d, const char *a, const char *v);
/* For --role context|generation: starts the transfer agent over the backend's KV pool and
 * plugs it into the engine; fills the http_config fields (role, kv_endpoint, kv_transport,
 * kv_pool_json). For aggregated: sets hc->role only. KV_OK, or an error with a message (the
 * agent is not running then). */
kv_status serve_disagg_start(struct serve_disagg *d, engine_t *e, backend_t *be,
                             const model_t *m, int tokens_per_block, const char *host,
                             struct http_config *hc, char *err, size_t errlen);
/* Stops the agent (live transfers end as cancelled); call before engine_stop. */
void serve_disagg_stop(struct serve_disagg *d);

#endif
