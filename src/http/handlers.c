/*
 * handlers: the route handlers of the HTTP server (routing itself is in server.c).
 *
 *   completions / chat / kv_probe / tokenize: handed to prep.c's worker threads (parse,
 *   render the chat template, tokenize, length checks), answered or submitted (gen_start)
 *   back on the loop thread.
 *   detokenize, models, metrics, server_info: answered at once.
 *   kv_events: ?poll=1 answers one JSON page; otherwise the SSE stream of kv_stream.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include "kv_endpoints.h"
#include "server_internal.h"
#include "tokenizer/prefix_cache.h"

static kv_status parse_body(struct evhttp_request *req, enum oai_kind kind, struct oai_request *r) {
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
    struct oai_error e;
    if (oai_parse(kind, body, len, &srv.lim, r, &e)) {
        http_send_error(req, &e);
        return KV_EINVAL;
    }
    return KV_OK;
}

void handle_generate(struct evhttp_request *req, enum oai_kind kind) {
    if (srv.stopping) {
        http_send_errf(req, 503, "server_error", NULL, "shutting_down",
                       "the server is shutting down and takes no new requests");
        return;
    }
    prep_submit(req, PREP_GENERATE, kind); /* parse, render, tokenize: prep.c */
}

/* POST /kv_probe: a completions body (with "prompt") or a chat body (with "messages");
 * answers {"prompt_tokens", "cached_tokens"} (docs/disaggregation.md). */
void handle_kv_probe(struct evhttp_request *req) {
    if (srv.stopping) {
        http_send_errf(req, 503, "server_error", NULL, NULL, "the server is shutting down");
        return;
    }
    prep_submit(req, PREP_PROBE, OAI_COMPLETION);
}

/* POST /kv_release {"disagg_request_id": N}: the router gave up on the generation leg of N, so
 * the KV this context worker keeps pinned for it goes now instead of at --kv-transfer-timeout.
 * Asynchronous (the transfer agent drops the offer, or remembers the id when the offer has not
 * come yet); answers 200 {"disagg_request_id": N, "released": true}. 400: malformed body, or a
 * worker that is not a context worker. Authenticated like every route (--api-key). */
void handle_kv_release(struct evhttp_request *req) {
    const struct http_config *c = srv.cfg;
    if (!c || !c->role || strcmp(c->role, "context") != 0) {
        http_send_errf(req, 400, "invalid_request_error", NULL, NULL,
                       "/kv_release is served by context workers only (this one is not --role context)");
        return;
    }
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    json_t *j = json_loadb(len ? (const char *)evbuffer_pullup(in, -1) : "", len, 0, NULL);
    json_t *id = json_object_get(j, "disagg_request_id");
    if (!json_is_integer(id) || json_integer_value(id) < 0) {
        json_decref(j);
        http_send_errf(req, 400, "invalid_request_error", "disagg_request_id", NULL,
                       "the body must be a JSON object with an unsigned integer disagg_request_id");
        return;
    }
    uint64_t did = (uint64_t)json_integer_value(id);
    json_decref(j);
    if (!engine_kv_release(srv.e, did)) {
        http_send_errf(req, 400, "invalid_request_error", NULL, NULL, "this worker has no KV transfer agent");
        return;
    }
    KV_DEBUG("http: /kv_release of disagg_request_id %llu", (unsigned long long)did);
    http_send_json(req, 200, json_pack("{s:I, s:b}", "disagg_request_id", (json_int_t)did, "released", 1));
}

void handle_tokenize(struct evhttp_request *req) { prep_submit(req, PREP_TOKENIZE, OAI_TOKENIZE); }

void handle_detokenize(struct evhttp_request *req) {
    struct oai_request r;
    if (parse_body(req, OAI_DETOKENIZE, &r)) return;
    char *s = NULL;
    size_t len = 0;
    kv_status st = tok_decode(srv.t, r.ids, r.n_ids, false, &s, &len);
    if (st == KV_EINVAL)
        http_send_errf(req, 400, "invalid_request_error", "tokens", NULL, "a token id is out of range");
    else if (st)
        http_send_errf(req, 500, "server_error", NULL, NULL, kv_status_str(st));
    else
        http_send_json(req, 200, json_pack("{s:s%}", "prompt", s, len));
    free(s);
    oai_request_free(&r);
}

/* The model object of one served name (OpenAI's Model, plus vLLM's root / max_model_len). */
static json_t *model_obj(const char *name) {
    json_t *m = json_pack("{s:s, s:s, s:I, s:s, s:s, s:n, s:i}", "id", name, "object", "model",
                          "created", (json_int_t)kv_unix_time(), "owned_by", "kvserve", "root",
                          srv.model_name, "parent", "max_model_len",
                          engine_config(srv.e)->max_model_len);
    if (m && srv.m->is_demo) {
        json_object_set_new(m, "demo", json_true());
        json_object_set_new(m, "note", json_string(
            "This is kvserve's built-in random-weight demo model: its output is meaningless. "
            "Serve a real model with `make serve MODEL=/path/to/model.gguf` or "
            "`kvserve serve --model PATH` (a GGUF file or a Hugging Face directory)."));
    }
    return m;
}

/* GET /v1/models: one entry per served name (--served-model-name A B: A and B, as vLLM). */
void handle_models(struct evhttp_request *req) {
    json_t *data = json_array();
    json_array_append_new(data, model_obj(srv.model_name));
    for (int i = 0; i < srv.lim.n_aliases; i++)
        if (srv.lim.aliases[i]) json_array_append_new(data, model_obj(srv.lim.aliases[i]));
    http_send_json(req, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

void handle_model(struct evhttp_request *req, const char *id) {
    char *name = evhttp_uridecode(id, 0, NULL);
    if (name && oai_model_matches(&srv.lim, name)) {
        http_send_json(req, 200, model_obj(name));
    } else {
        char msg[420];
        snprintf(msg, sizeof msg, "The model '%.200s' does not exist; this server serves '%.150s'",
                 name ? name : id, srv.model_name);
        http_send_errf(req, 404, "invalid_request_error", "model", "model_not_found", msg);
    }
    free(name);
}

void handle_metrics(struct evhttp_request *req) {
    struct engine_stats s;
    engine_get_stats(srv.e, &s);
    kv_buf b;
    kv_buf_init(&b);
    struct prefix_cache_stats pcs;
    struct prefix_cache *pc = srv.cfg ? srv.cfg->prefix_cache : NULL;
    if (pc) prefix_cache_get_stats(pc, &pcs);
    struct metrics_info info = {engine_config(srv.e)->tokens_per_block, srv.stopping};
    if (metrics_render(&b, &s, &srv.ctr, &info, srv.model_name) ||
        (pc && metrics_render_prefix_token_cache(&b, &pcs, srv.model_name))) {
        kv_buf_free(&b);
        http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    http_send_body(req, 200, "text/plain; version=0.0.4; charset=utf-8", b.data ? b.data : "", b.len);
    kv_buf_free(&b);
}

void handle_server_info(struct evhttp_request *req) {
    json_t *o = kvapi_server_info(srv.e, srv.model_name);
    const struct http_config *c = srv.cfg;
    if (o) {
        json_object_set_new(o, "role", json_string(c && c->role ? c->role : "aggregated"));
        if (c && c->kv_endpoint) {
            json_t *d = json_pack("{s:s, s:s}", "ctx_info_endpoint", c->kv_endpoint,
                                  "kv_transport", c->kv_transport ? c->kv_transport : "tcp");
            if (d && c->kv_pool_json) {
                json_t *pool = json_loads(c->kv_pool_json, 0, NULL);
                if (pool) json_object_set_new(d, "pool", pool);
            }
            json_object_set_new(o, "disaggregated_params", d);
        }
    }
    if (!o) http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
    else http_send_json(req, 200, o);
}

void handle_kv_events(struct evhttp_request *req) {
    char err[256] = "out of memory";
    const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(req);
    const char *query = u ? evhttp_uri_get_query(u) : NULL;
    struct kvapi_query q;
    if (kvapi_parse_query(query, &q, err, sizeof err)) {
        http_send_errf(req, 400, "invalid_request_error", NULL, NULL, err);
        return;
    }
    if (!q.poll && !q.has_after) { /* SSE reconnect: resume after the last id the client saw */
        const char *lei = evhttp_find_header(evhttp_request_get_input_headers(req), "Last-Event-ID");
        if (lei && kvapi_parse_u64(lei, &q.after)) q.has_after = true;
    }
    uint64_t last = engine_kv_last_seq(srv.e);
    if (q.has_after && q.after > last) { /* a restarted worker, or a bad resume point */
        char msg[200];
        snprintf(msg, sizeof msg, "after=%llu is beyond the last event (%llu): resubscribe "
                 "without after (the worker may have restarted)", (unsigned long long)q.after,
                 (unsigned long long)last);
        struct oai_error e;
        oai_errf(&e, 400, "invalid_request_error", "after", "after_beyond_last", "%s", msg);
        char *ej = resp_error_json(&e);
        json_t *o = ej ? json_loads(ej, 0, NULL) : NULL;
        free(ej);
        if (o) json_object_set_new(o, "last_seq", json_integer((json_int_t)last));
        http_send_json(req, 400, o);
        return;
    }
    if (!q.poll) {
        kvstream_start(req, q.has_after, q.after);
        return;
    }
    json_t *o = kvapi_kv_events(srv.e, q.after, q.max, err, sizeof err);
    if (!o) http_send_errf(req, 500, "server_error", NULL, NULL, err);
    else http_send_json(req, 200, o);
}
