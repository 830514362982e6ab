/* reply: plain (non-streamed) HTTP answers of the server: JSON bodies, OpenAI error JSON,
 * the common headers and the 4xx/5xx counters (see server_internal.h). */
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include "server_internal.h"

void http_count_status(int status) {
    if (status >= 500) srv.ctr.http_errors_5xx++;
    else if (status >= 400) srv.ctr.http_errors_4xx++;
}

void http_common_headers(struct evhttp_request *req, const char *ctype) {
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", ctype);
    evhttp_add_header(h, "X-Kvserve-Worker", srv.worker_id);
}

void http_send_body(struct evhttp_request *req, int status, const char *ctype, const char *body,
                    size_t len) {
    http_count_status(status);
    http_common_headers(req, ctype);
    struct evbuffer *b = evbuffer_new();
    if (b) evbuffer_add(b, body, len);
    evhttp_send_reply(req, status, NULL, b);
    if (b) evbuffer_free(b);
}

void http_send_json_str(struct evhttp_request *req, int status, const char *s) {
    http_send_body(req, status, "application/json", s ? s : "{}", s ? strlen(s) : 2);
}

void http_send_json(struct evhttp_request *req, int status, json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) {
        http_send_json_str(req, 500, "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                                     "\"param\":null,\"code\":null}}");
        return;
    }
    http_send_json_str(req, status, s);
    free(s);
}

void http_send_error(struct evhttp_request *req, const struct oai_error *e) {
    char *s = resp_error_json(e);
    http_send_json_str(req, e->status, s);
    free(s);
}

void http_send_errf(struct evhttp_request *req, int status, const char *type, const char *param,
                    const char *code, const char *msg) {
    struct oai_error e;
    oai_errf(&e, status, type, param, code, "%s", msg);
    http_send_error(req, &e);
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
