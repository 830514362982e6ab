/*
 * upstream: the router's HTTP client, libcurl multi driven from a libevent loop.
 * One struct upx per attempt: a GET (body NULL) or a JSON POST to one URL, its response
 * accumulated in resp, or (on_data set) its 2xx body handed over as it arrives. Every request
 * byte that reaches the socket is counted (libcurl's debug callback), so a failure can be
 * classified as undelivered or possibly delivered (router_internal.h, spec decision 3).
 * Each attempt uses a fresh connection that is closed at its end: aborting an attempt
 * (upx_free before it is done) closes its connection, which a worker takes as a cancel.
 * Loop thread only.
 */
#ifndef KV_ROUTER_UPSTREAM_H
#define KV_ROUTER_UPSTREAM_H

#include <stdbool.h>

#include <curl/curl.h>
#include <event2/event.h>

#include "router_internal.h"

struct upstream {
    struct event_base *base; /* borrowed */
    const char *auth_header; /* borrowed, NULL = none: "Authorization: Bearer KEY" added to
                                every request (workers started with --api-key) */
    CURLM *multi;
    struct event *timer;
};
kv_status upstream_init(struct upstream *up, struct event_base *base);
/* Call after every upx is freed. */
void upstream_free(struct upstream *up);

struct upx;
/* Receives n bytes of a 2xx body; returns n, CURL_WRITEFUNC_PAUSE (set u->paused first; the
 * same bytes come again after upx_resume) or 0 to abort the transfer. */
typedef size_t (*upx_data_fn)(struct upx *u, const char *p, size_t n);
/* The attempt ended (u->done); the callee owns u and frees it with upx_free (may start other
 * transfers). rc = libcurl's result. */
typedef void (*upx_done_fn)(struct upx *u, const struct rt_outcome *o, CURLcode rc);

struct upx {
    struct upstream *up;
    CURL *easy;
    struct curl_slist *hdrs;
    char *body;              /* owned copy of the request body */
    size_t body_len;
    size_t hdr_out, data_out; /* request bytes written to the socket */
    long status;             /* 0 until the first body byte */
    bool got_bytes, in_multi, done, paused;
    curl_socket_t sock;      /* the attempt's socket while libcurl holds it open, else
                                CURL_SOCKET_BAD (set and cleared by libcurl's callbacks) */
    kv_buf resp;             /* response body (everything when on_data is NULL or not 2xx) */
    char ctype[128];         /* response Content-Type */
    char errbuf[CURL_ERROR_SIZE];
    upx_data_fn on_data;     /* set by the caller after upx_start (before the loop runs) */
    upx_done_fn on_done;
    void *owner;             /* the caller's */
    int worker;              /* the caller's: index of the worker in its pool */
    int kind;                /* the caller's: enum rt_leg_kind or a private tag */
};

/* Starts an attempt (the body is copied). NULL on ENOMEM / libcurl failure. */
struct upx *upx_start(struct upstream *up, const char *url, const char *body, size_t body_len,
                      double timeout_s, void *owner);
/* Aborts the transfer if still running (closing its connection with a reset, so the worker
 * sees the abort at once) and frees u. NULL no-op. */
void upx_free(struct upx *u);
/* Continues a transfer paused by on_data. */
void upx_resume(struct upx *u);

/* Fire-and-forget transfers an owner keeps only to free them if it stops first (the router's
 * coordinator /finish calls and its /kv_release calls). Zero-initialised = empty; loop thread. */
struct upx_set {
    struct upx **a;
    int n, cap;
};
/* Adds u (started by upx_start). On ENOMEM frees u (the transfer never runs) and returns false. */
bool upx_set_add(struct upx_set *s, struct upx *u);
/* From u's on_done: takes u out of the set and frees it. */
void upx_set_done(struct upx_set *s, struct upx *u);
/* Aborts and frees every transfer still in the set; the set is empty. */
void upx_set_free_all(struct upx_set *s);
bool upx_request_written(const struct upx *u);

#endif
