/* reply: plain (non-streamed) HTTP answers: JSON bodies, OpenAI error JSON, the common
 * headers and the 4xx/5xx counters, bound to a reply context (listener.h) so the worker and
 * the router share them; the http_send_* / http_count_status forms answer for the worker
 * (server_internal.h). */
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include "listener.h"
#include "server_internal.h"

void http_reply_count(const struct http_reply_ctx *c, int status) {
    if (!c || !c->ctr) return;
    if (status >= 500) c->ctr->http_errors_5xx++;
    else if (status >= 400) c->ctr->http_errors_4xx++;
}

void http_reply_headers(const struct http_reply_ctx *c, struct evhttp_request *req,
                        const char *ctype) {
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    if (ctype) evhttp_add_header(h, "Content-Type", ctype);
    if (c && c->id_header && c->id_value && *c->id_value)
        evhttp_add_header(h, c->id_header, c->id_value);
}

void http_reply_body(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                     const char *ctype, const char *body, size_t len) {
    http_reply_count(c, status);
    http_reply_headers(c, req, ctype);
    /* every 503 (queue full, shutting down, no worker) tells the client when to retry */
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    if (status == 503 && !evhttp_find_header(h, "Retry-After")) evhttp_add_header(h, "Retry-After", "1");
    struct evbuffer *b = evbuffer_new();
    if (b) evbuffer_add(b, body, len);
    evhttp_send_reply(req, status, NULL, b);
    if (b) evbuffer_free(b);
}

void http_reply_json_str(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                         const char *s) {
    http_reply_body(c, req, status, "application/json", s ? s : "{}", s ? strlen(s) : 2);
}

void http_reply_json(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                     json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) {
        http_reply_json_str(c, req, 500,
                            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                            "\"param\":null,\"code\":null}}");
        return;
    }
    http_reply_json_str(c, req, status, s);
    free(s);
}

void http_reply_error(const struct http_reply_ctx *c, struct evhttp_request *req,
                      const struct oai_error *e) {
    char *s = resp_error_json(e);
    if (!s) {
        http_reply_json(c, req, 500, NULL);
        return;
    }
    http_reply_json_str(c, req, e->status, s);
    free(s);
}

void http_reply_errf(const struct http_reply_ctx *c, struct evhttp_request *req, int status,
                     const char *type, const char *param, const char *code, const char *msg) {
    struct oai_error e;
    oai_errf(&e, status, type, param, code, "%s", msg);
    http_reply_error(c, req, &e);
}

/* ---- the worker's forms (its singleton's reply context) ---- */

void http_count_status(int status) { http_reply_count(&srv.reply, status); }

void http_common_headers(struct evhttp_request *req, const char *ctype) {
    http_reply_headers(&srv.reply, req, ctype);
}

void http_send_body(struct evhttp_request *req, int status, const char *ctype, const char *body,
                    size_t len) {
    http_reply_body(&srv.reply, req, status, ctype, body, len);
}

void http_send_json_str(struct evhttp_request *req, int status, const char *s) {
    http_reply_json_str(&srv.reply, req, status, s);
}

void http_send_json(struct evhttp_request *req, int status, json_t *o) {
    http_reply_json(&srv.reply, req, status, o);
}

void http_send_error(struct evhttp_request *req, const struct oai_error *e) {
    http_reply_error(&srv.reply, req, e);
}

void http_send_errf(struct evhttp_request *req, int status, const char *type, const char *param,
                    const char *code, const char *msg) {
    http_reply_errf(&srv.reply, req, status, type, param, code, msg);
}

const char *http_method_name(enum evhttp_cmd_type c) {
    switch (c) {
    case EVHTTP_REQ_GET: return "GET";
    case EVHTTP_REQ_POST: return "POST";
    case EVHTTP_REQ_HEAD: return "HEAD";
    case EVHTTP_REQ_PUT: return "PUT";
    case EVHTTP_REQ_DELETE: return "DELETE";
    case EVHTTP_REQ_OPTIONS: return "OPTIONS";
    case EVHTTP_REQ_PATCH: return "PATCH";
    default: return "?";
    }
}
