/*
 * access: API keys and CORS for the worker's routes (server.c calls access_check first).
 *
 *   request --Origin allowed?--> + Access-Control-Allow-Origin / Vary / Expose-Headers
 *           --OPTIONS?--> preflight (Origin + Access-Control-Request-Method): 200 (as vLLM's
 *                         and llama.cpp's servers) with the allowed methods and the requested
 *                         headers echoed (a "*" would not cover Authorization, Fetch standard),
 *                         or 403 (origin or method not allowed); a plain OPTIONS: 204 with Allow
 *           --keys configured, route not open, no valid "Authorization: Bearer KEY"?--> 401
 *           --> routing
 *
 * Open routes (no key): /health and /ready (probes carry no credentials) and /metrics (what
 * Prometheus and gateway endpoint pickers scrape without credentials; it carries counters,
 * no request content). /kv_events and /server_info need the key: KV events carry the token
 * ids of cached prompts. Preflights never carry credentials (Fetch standard), so they are
 * answered before the key check. Keys are compared in constant time.
 */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include <event2/keyvalq_struct.h>

#include "server_internal.h"

#define CORS_METHODS "GET, POST" /* (HEAD and OPTIONS need no preflight) */
#define CORS_MAX_AGE "600"

static bool open_route(const char *path) {
    return !strcmp(path, "/health") || !strcmp(path, "/ready") || !strcmp(path, "/metrics");
}

/* Constant-time equality (the time depends on the lengths only). */
static bool same_secret(const char *a, size_t na, const char *b, size_t nb) {
    unsigned char d = na != nb;
    for (size_t i = 0; i < na; i++) d |= (unsigned char)a[i] ^ (unsigned char)(i < nb ? b[i] : 0);
    return d == 0;
}

static bool key_ok(struct evhttp_request *req) {
    const struct http_config *c = srv.cfg;
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    if (!h) return false;
    while (*h == ' ') h++;
    if (strncasecmp(h, "Bearer ", 7)) return false;
    h += 7;
    while (*h == ' ') h++;
    size_t n = strlen(h);
    while (n && (h[n - 1] == ' ' || h[n - 1] == '\t')) n--;
    bool ok = false;
    for (int i = 0; i < c->n_api_keys; i++)
        if (c->api_keys[i]) ok |= same_secret(h, n, c->api_keys[i], strlen(c->api_keys[i]));
    return ok;
}

static bool origin_allowed(const char *origin) {
    const struct http_config *c = srv.cfg;
    if (!origin || !c) return false;
    for (int i = 0; i < c->n_allowed_origins; i++)
        if (c->allowed_origins[i] &&
            (!strcmp(c->allowed_origins[i], "*") || !strcasecmp(c->allowed_origins[i], origin)))
            return true;
    return false;
}

bool access_check(struct evhttp_request *req, const char *path) {
    const struct http_config *c = srv.cfg;
    if (!c) return false;
    struct evkeyvalq *in = evhttp_request_get_input_headers(req);
    struct evkeyvalq *out = evhttp_request_get_output_headers(req);
    const char *origin = evhttp_find_header(in, "Origin");
    bool cors = origin_allowed(origin);
    if (cors) {
        evhttp_add_header(out, "Access-Control-Allow-Origin", origin);
        evhttp_add_header(out, "Vary", "Origin");
        evhttp_add_header(out, "Access-Control-Expose-Headers", "X-Kvserve-Worker, Retry-After");
    }
    if (evhttp_request_get_command(req) == EVHTTP_REQ_OPTIONS) {
        const char *method = evhttp_find_header(in, "Access-Control-Request-Method");
        if (!origin || !method) { /* not a preflight */
            evhttp_add_header(out, "Allow", "GET, POST, OPTIONS");
            http_send_body(req, 204, NULL, "", 0);
            return true;
        }
        if (!cors) {
            char msg[300];
            snprintf(msg, sizeof msg, "CORS: origin '%.200s' is not allowed (%s)", origin,
                     c->n_allowed_origins ? "--allowed-origins" : "start the server with --allowed-origins");
            http_send_errf(req, 403, "invalid_request_error", NULL, "cors_origin_not_allowed", msg);
            return true;
        }
        if (strcmp(method, "GET") && strcmp(method, "POST") && strcmp(method, "HEAD")) {
            char msg[160];
            snprintf(msg, sizeof msg, "CORS: method '%.40s' is not allowed (%s)", method, CORS_METHODS);
            http_send_errf(req, 403, "invalid_request_error", NULL, "cors_method_not_allowed", msg);
            return true;
        }
        const char *hdrs = evhttp_find_header(in, "Access-Control-Request-Headers");
        evhttp_add_header(out, "Access-Control-Allow-Methods", CORS_METHODS);
        evhttp_add_header(out, "Access-Control-Allow-Headers", hdrs && *hdrs ? hdrs : "Authorization, Content-Type");
        evhttp_add_header(out, "Access-Control-Max-Age", CORS_MAX_AGE);
        evhttp_add_header(out, "Vary", "Access-Control-Request-Method, Access-Control-Request-Headers");
        http_send_body(req, 200, "text/plain", "OK", 2);
        return true;
    }
    if (c->n_api_keys > 0 && !open_route(path) && !key_ok(req)) {
        evhttp_add_header(out, "WWW-Authenticate", "Bearer");
        http_send_errf(req, 401, "invalid_request_error", NULL, "invalid_api_key",
                       evhttp_find_header(in, "Authorization")
                           ? "Incorrect API key provided (Authorization: Bearer <key>)"
                           : "You didn't provide an API key (Authorization: Bearer <key>)");
        return true;
    }
    return false;
}
