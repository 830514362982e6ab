/* kv_endpoints: /server_info, /kv_events and the cache_salt pass-through (see the header). */
#include "kv_endpoints.h"

#include <stdlib.h>
#include <string.h>

#include <event2/http.h>
#include <event2/keyvalq_struct.h>

static json_t *hex_hash(const kv_hash *h) {
    char hx[2 * KV_HASH_LEN + 1];
    kv_hash_hex(h, hx);
    return json_string(hx);
}

static json_t *worker_id_json(engine_t *e) {
    char wid[17];
    snprintf(wid, sizeof wid, "%016llx", (unsigned long long)engine_worker_id(e));
    return json_string(wid);
}

json_t *kvapi_server_info(engine_t *e, const char *model_name) {
    const struct engine_config *c = engine_config(e);
    struct engine_stats s;
    engine_get_stats(e, &s);
    json_t *o = json_object();
    if (!o) return NULL;
    json_object_set_new(o, "model", json_string(model_name ? model_name : ""));
    json_object_set_new(o, "tokens_per_block", json_integer(c->tokens_per_block));
    json_object_set_new(o, "hash_scheme", json_string(KV_HASH_SCHEME));
    json_object_set_new(o, "worker_id", worker_id_json(e));
    json_object_set_new(o, "prefix_cache", json_boolean(s.prefix_cache_enabled));
    json_object_set_new(o, "host_cache_blocks", json_integer(s.kv_host_blocks_total));
    json_object_set_new(o, "kv_blocks", json_integer(s.kv_blocks_total));
    json_object_set_new(o, "max_model_len", json_integer(c->max_model_len));
    json_object_set_new(o, "kv_events_ring", json_integer(ENGINE_KV_EVENTS_RING));
    return o;
}

static bool parse_u64(const char *s, uint64_t max, uint64_t *out) {
    if (!s || !*s) return false;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || s[0] == '-' || v > max) return false;
    *out = v;
    return true;
}

json_t *kvapi_kv_events(engine_t *e, const char *query, char *err, size_t errlen) {
    uint64_t after = 0, max = 256;
    if (query && *query) {
        struct evkeyvalq q;
        if (evhttp_parse_query_str(query, &q) != 0) {
            snprintf(err, errlen, "malformed query string");
            return NULL;
        }
        const char *a = evhttp_find_header(&q, "after"), *m = evhttp_find_header(&q, "max");
        bool ok = (!a || parse_u64(a, UINT64_MAX, &after)) && (!m || parse_u64(m, 1024, &max));
        evhttp_clear_headers(&q);
        if (!ok || max == 0) {
            snprintf(err, errlen, "'after' must be an integer >= 0 and 'max' in [1, 1024]");
            return NULL;
        }
    }
    int T = engine_config(e)->tokens_per_block;
    struct engine_kv_event *ev = malloc(max * sizeof *ev);
    int32_t *tok = malloc(max * (size_t)T * sizeof *tok);
    json_t *o = json_object(), *arr = json_array();
    if (!ev || !tok || !o || !arr) {
        free(ev);
        free(tok);
        json_decref(o);
        json_decref(arr);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    uint64_t lost = 0;
    int n = engine_kv_events(e, after, ev, tok, (int)max, &lost);
    uint64_t last = after;
    static const char *const names[] = {"stored", "removed", "cleared"};
    for (int i = 0; i < n; i++) {
        json_t *x = json_object();
        json_object_set_new(x, "seq", json_integer((json_int_t)ev[i].seq));
        json_object_set_new(x, "type", json_string(names[ev[i].type]));
        if (ev[i].type != ENGINE_KV_CLEARED) json_object_set_new(x, "block_hash", hex_hash(&ev[i].hash));
        if (ev[i].type == ENGINE_KV_STORED) {
            json_object_set_new(x, "parent_hash", hex_hash(&ev[i].parent_hash));
            json_object_set_new(x, "parent_is_root", json_boolean(ev[i].parent_is_root));
            json_t *t = json_array();
            for (int k = 0; k < ev[i].n_tokens; k++) json_array_append_new(t, json_integer(ev[i].tokens[k]));
            json_object_set_new(x, "tokens", t);
        }
        json_array_append_new(arr, x);
        last = ev[i].seq;
    }
    if (n == 0 && lost) last = after + lost;
    free(ev);
    free(tok);
    json_object_set_new(o, "worker_id", worker_id_json(e));
    json_object_set_new(o, "tokens_per_block", json_integer(T));
    json_object_set_new(o, "hash_scheme", json_string(KV_HASH_SCHEME));
    json_object_set_new(o, "last_seq", json_integer((json_int_t)last));
    json_object_set_new(o, "lost", json_integer((json_int_t)lost));
    json_object_set_new(o, "events", arr);
    return o;
}

char *kvapi_cache_salt(const char *body, size_t len) {
    if (!body || !len || !memmem(body, len, "cache_salt", 10)) return NULL;
    json_t *o = json_loadb(body, len, 0, NULL);
    json_t *v = o ? json_object_get(o, "cache_salt") : NULL;
    char *s = json_is_string(v) ? kv_strdup(json_string_value(v)) : NULL;
    json_decref(o);
    return s;
}
