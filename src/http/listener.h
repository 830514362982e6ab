/*
 * listener: the generic HTTP server pieces shared by the worker (server.c) and the router
 * (src/router/): an instance-based evhttp listener and plain replies bound to a reply context.
 *
 *   http_listener_start: evhttp on the caller's event_base, bind (port 0 = a free port, written
 *   to the port file), connection gates in front of evhttp (conn_gate.h: request framing and
 *   validation, head/body/buffered-bytes/connection limits, header and keep-alive timeouts,
 *   each refusal an OpenAI error JSON),
 *   accept() backoff on descriptor exhaustion, SIGINT/SIGTERM -> a clean stop. Requests within
 *   the limits go to the owner's on_request; a stop (signal or http_listener_stop) closes the
 *   listening socket and calls the owner's on_stop once; the owner breaks its loop when done.
 *
 *   http_reply_*: JSON bodies / OpenAI error JSON / common headers, counting 4xx/5xx into the
 *   reply context's counters (each instance has its own).
 *
 * Thread-safety: everything runs on the thread of the listener's event_base, except
 * http_listener_stop (any thread; needs evthread_use_pthreads when called from another one).
 */
#ifndef KV_HTTP_LISTENER_H
#define KV_HTTP_LISTENER_H

#include <stdbool.h>
#include <stddef.h>

#include <event2/event.h>
#include <event2/http.h>

#include "http.h"
#include "http_internal.h"

/* Where a server's replies are counted and which identity header they carry. Borrowed by
 * every http_reply_* call; one per server instance. */
struct http_reply_ctx {
    struct http_counters *ctr; /* borrowed, may be NULL (no counting) */
    const char *id_header;     /* header name, e.g. "X-Kvserve-Worker"; NULL = none */
    const char *id_value;      /* its value (borrowed) */
};

/* ---- replies (loop thread; every call answers req and counts the status) ---- */
void http_reply_count(const struct http_reply_ctx *c, int status);
/* Content-Type + the identity header (no reply sent). */
void http_reply_headers(const struct http_reply_ctx *c, struct evhttp_request *req,
                        const char *ctype);
void http_reply_body(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                     const char *ctype, const char *body, size_t len);
void http_reply_json_str(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                         const char *s);
/* Steals o (NULL -> 500 out of memory). */
void http_reply_json(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                     json_t *o);
void http_reply_error(const struct http_reply_ctx *c, struct evhttp_request *req,
                      const struct oai_error *e);
void http_reply_errf(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                     const char *type, const char *param, const char *code, const char *msg);

/* "GET", "POST", ... ("?" for others). */
const char *http_method_name(enum evhttp_cmd_type c);

/* ---- listener ---- */
struct http_listener;

struct http_listener_config {
    const char *name;            /* log prefix ("http", "router"); default "http" */
    const char *host;            /* default "127.0.0.1" */
    int port;                    /* < 0 -> 8000; 0 = a free port (see http_listener_port) */
    const char *port_file;       /* optional: the bound port is written here (atomically) */
    size_t max_body_bytes;       /* default 16 MiB; larger bodies get 413 JSON */
    int timeout_s;               /* evhttp read/write timeout; default 3600 */
    /* Connection limits enforced before evhttp sees a byte (conn_gate.h); 0 = default:
     * 256 MiB, 4096 (or RLIMIT_NOFILE - 64), 60000 ms, 75000 ms. max_body_bytes above is
     * the gate's body limit too. */
    struct http_conn_limits conn;
    bool handle_signals;         /* SIGINT/SIGTERM start a stop */
    const struct http_reply_ctx *reply; /* for the listener's own answers (413); borrowed */
    /* Called for every request within the limits (counted in reply->ctr->http_requests_total
     * before); the callee answers it now or later. */
    void (*on_request)(struct evhttp_request *req, void *arg);
    /* Called once when a stop begins (the listening socket is already closed, unless
     * keep_accepting); the owner cancels its work and breaks its loop when done.
     * NULL -> event_base_loopbreak. */
    void (*on_stop)(void *arg);
    /* Optional: a SIGINT/SIGTERM arriving after the stop began (sig = its number). */
    void (*on_signal_again)(void *arg, int sig);
    /* A stop leaves the listening socket open (a draining owner answers new requests itself,
     * e.g. 503) until the owner calls http_listener_unbind. */
    bool keep_accepting;
    void *arg;
};

/* Creates the evhttp on base (borrowed, outlives the listener), binds and listens. On error
 * returns KV_EIO (cannot bind / resolve / write the port file) or KV_ENOMEM with a message in
 * err, and *out = NULL (nothing to free). cfg is copied (its strings are borrowed). */
kv_status http_listener_start(struct event_base *base, const struct http_listener_config *cfg,
                              struct http_listener **out, char *err, size_t errlen);
/* The bound port (after port 0 resolution) and host. */
int http_listener_port(const struct http_listener *l);
const char *http_listener_host(const struct http_listener *l);
struct evhttp *http_listener_evhttp(struct http_listener *l);
/* Closes the listening socket (new connections are refused; open ones stay). Idempotent;
 * NULL is a no-op. Loop thread. */
void http_listener_unbind(struct http_listener *l);
/* Asks for a stop (any thread): on_stop runs on the loop thread. Idempotent. */
void http_listener_stop(struct http_listener *l);
/* A stop has begun / was started by a signal. */
bool http_listener_stopping(const struct http_listener *l);
bool http_listener_signalled(const struct http_listener *l);
/* Frees the evhttp (closing every connection) and the listener's events. If a signal asked for
 * the stop, later SIGINT/SIGTERM are ignored (process managers send several; the process must
 * not die mid-teardown). NULL is a no-op. */
void http_listener_free(struct http_listener *l);

/* What the listener's connection gates did (conn_gate.h); zeros before start. */
struct http_gate_stats;
void http_listener_gate_stats(const struct http_listener *l, struct http_gate_stats *out);

/* Writes "<port>\n" to path atomically (temp file + rename). KV_EIO on failure. */
kv_status http_write_port_file(const char *path, int port, char *err, size_t errlen);

#endif
