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

enum router_style { ROUTER_CONTEXT_FIRST = 0, ROUTER_GENERATION_FIRST };

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
};

/* Serves until SIGINT/SIGTERM. Returns KV_OK on a clean stop; KV_EINVAL for a bad config,
 * KV_EIO if the address cannot be bound (message in err). Not thread-safe: one router per
 * process (libcurl global init). */
kv_status router_run(const struct router_config *cfg, char *err, size_t errlen);

#endif
