/* kv_endpoints: /server_info, the /kv_events query and event JSON (see the header). */
#include "kv_endpoints.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <event2/http.h>
#include <event2/keyvalq_struct.h>

static json_t *hex_hash(const kv_hash *h) {
    char hx[2 * KV_HASH_LEN + 1];
    kv_hash_hex(h, hx);
    return json_string(hx);
}

void kvapi_worker_id(engine_t *e, char out[17]) {
    snprintf(out, 17, "%016llx", (unsigned long long)engine_worker_id(e));
}

json_t *kvapi_server_info(engine_t *e, const char *model_name) {
    const struct engine_config *c = engine_config(e);
    struct engine_stats s;
    engine_get_stats(e, &s);
    char wid[17];
    kvapi_worker_id(e, wid);
    json_t *o = json_object();
    if (!o) return NULL;
    json_object_set_new(o, "model", json_string(model_name ? model_name : ""));
    json_object_set_new(o, "tokens_per_block", json_integer(c->tokens_per_block));
    json_object_set_new(o, "hash_scheme", json_string(KV_HASH_SCHEME));
    char kid[17];
    engine_hash_key_id(e, kid);
    json_object_set_new(o, "hash_key_id", json_string(kid));
    json_object_set_new(o, "worker_id", json_string(wid));
    json_object_set_new(o, "prefix_cache", json_boolean(s.prefix_cache_enabled));
    json_object_set_new(o, "host_cache_blocks", json_integer(s.kv_host_blocks_total));
    json_object_set_new(o, "kv_blocks", json_integer(s.kv_blocks_total));
    json_object_set_new(o, "max_model_len", json_integer(c->max_model_len));
    json_object_set_new(o, "kv_events_ring", json_integer(ENGINE_KV_EVENTS_RING));
    return o;
}

bool kvapi_parse_u64(const char *s, uint64_t *out) {
    if (!s || !*s || *s < '0' || *s > '9') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno) return false;
    *out = v;
    return true;
}

kv_status kvapi_parse_query(const char *query, struct kvapi_query *q, char *err, size_t errlen) {
    memset(q, 0, sizeof *q);
    q->max = 256;
    if (!query || !*query) return KV_OK;
    struct evkeyvalq kv;
    if (evhttp_parse_query_str(query, &kv) != 0)
        return kv_errf(KV_EINVAL, err, errlen, "malformed query string");
    const char *a = evhttp_find_header(&kv, "after"), *m = evhttp_find_header(&kv, "max"),
               *p = evhttp_find_header(&kv, "poll");
    uint64_t max = 256;
    kv_status st = KV_OK;
    if (a && !kvapi_parse_u64(a, &q->after)) st = kv_errf(KV_EINVAL, err, errlen, "'after' must be an integer >= 0");
    else if (m && (!kvapi_parse_u64(m, &max) || max < 1 || max > 1024))
        st = kv_errf(KV_EINVAL, err, errlen, "'max' must be an integer in [1, 1024]");
    else if (p && strcmp(p, "1") && strcmp(p, "true") && strcmp(p, "0") && strcmp(p, "false"))
        st = kv_errf(KV_EINVAL, err, errlen, "'poll' must be 1, 0, true or false");
    q->has_after = a != NULL;
    q->max = (int)max;
    q->poll = p && (!strcmp(p, "1") || !strcmp(p, "true"));
    evhttp_clear_headers(&kv);
    return st;
}

json_t *kvapi_event_json(const struct engine_kv_event *ev, const char *worker_id) {
    static const char *const names[] = {"stored", "removed", "cleared", "tier"};
    json_t *x = json_object();
    if (!x) return NULL;
    int bad = json_object_set_new(x, "seq", json_integer((json_int_t)ev->seq));
    bad |= json_object_set_new(x, "type", json_string(names[ev->type]));
    if (worker_id) bad |= json_object_set_new(x, "worker_id", json_string(worker_id));
    if (ev->type != ENGINE_KV_CLEARED) bad |= json_object_set_new(x, "block_hash", hex_hash(&ev->hash));
    if (ev->type == ENGINE_KV_TIER) bad |= json_object_set_new(x, "tier", json_string(ev->host ? "host" : "device"));
    if (ev->type == ENGINE_KV_STORED) {
        bad |= json_object_set_new(x, "parent_hash", hex_hash(&ev->parent_hash));
        bad |= json_object_set_new(x, "parent_is_root", json_boolean(ev->parent_is_root));
        json_t *t = json_array();
        for (int k = 0; t && k < ev->n_tokens; k++) bad |= json_array_append_new(t, json_integer(ev->tokens[k]));
        bad |= json_object_set_new(x, "tokens", t);
    }
    if (bad) {
        json_decref(x);
        return NULL;
    }
    return x;
}

json_t *kvapi_kv_events(engine_t *e, uint64_t after, int max, char *err, size_t errlen) {
    int T = engine_config(e)->tokens_per_block;
    struct engine_kv_event *ev = malloc((size_t)max * sizeof *ev);
    int32_t *tok = malloc((size_t)max * (size_t)T * sizeof *tok);
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
    int n = engine_kv_events(e, after, ev, tok, max, &lost);
    uint64_t last = after;
    for (int i = 0; i < n; i++) {
        json_array_append_new(arr, kvapi_event_json(&ev[i], NULL));
        last = ev[i].seq;
    }
    if (n == 0 && lost) last = after + lost;
    free(ev);
    free(tok);
    char wid[17];
    kvapi_worker_id(e, wid);
    json_object_set_new(o, "worker_id", json_string(wid));
    json_object_set_new(o, "tokens_per_block", json_integer(T));
    json_object_set_new(o, "hash_scheme", json_string(KV_HASH_SCHEME));
    json_object_set_new(o, "last_seq", json_integer((json_int_t)last));
    json_object_set_new(o, "lost", json_integer((json_int_t)lost));
    json_object_set_new(o, "events", arr);
    return o;
}
