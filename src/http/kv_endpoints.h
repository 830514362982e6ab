/*
 * kv_endpoints: the KV-reuse endpoints of the HTTP front (handlers.c and kv_stream.c answer
 * them; the full wire format is in docs/api.md).
 *
 *   GET /server_info            {"model","tokens_per_block","hash_scheme","worker_id",
 *                                "prefix_cache","host_cache_blocks","kv_blocks",
 *                                "max_model_len","kv_events_ring"} -- a router with other
 *                                settings must refuse to mirror this worker.
 *   GET /kv_events[?after=SEQ]  Server-Sent Events (text/event-stream), pushed as the engine
 *                                stores / removes blocks (kv_stream.c):
 *                                  data: {"type":"start","worker_id","tokens_per_block",
 *                                         "hash_scheme","after"}
 *                                  id: SEQ
 *                                  data: {"seq","type":"stored"|"removed"|"cleared",
 *                                         "worker_id","block_hash","parent_hash",
 *                                         "parent_is_root","tokens":[...]}
 *                                  data: {"type":"lost","worker_id","lost","after","final"}
 *                                Starts after SEQ (or the Last-Event-ID header), else with
 *                                the oldest retained event; SEQ beyond the last event is a 400
 *                                carrying "last_seq". "lost" (final false) when the ring
 *                                already dropped events the client asked for; a client whose
 *                                queue (1 MiB) fills up gets a final "lost" and the stream ends
 *                                (resync: treat the worker as cleared, reconnect without
 *                                after). ": keepalive" comments every 15 s of silence. At most
 *                                max_kv_subscribers streams (503 beyond).
 *   GET /kv_events?poll=1&after=SEQ&max=N
 *                               {"worker_id","tokens_per_block","hash_scheme","last_seq",
 *                                "lost","events":[...same event objects, no worker_id...]}
 *                                Events with seq > after, oldest first (N <= 1024, default
 *                                256). Hashes are lower-case hex of 32 bytes.
 */
#ifndef KV_HTTP_KV_ENDPOINTS_H
#define KV_HTTP_KV_ENDPOINTS_H

#include <jansson.h>

#include "../engine/engine.h"

/* New reference, or NULL on ENOMEM. */
json_t *kvapi_server_info(engine_t *e, const char *model_name);

/* The query of GET /kv_events. */
struct kvapi_query {
    bool poll;        /* poll=1 (or true): one JSON page instead of the stream */
    bool has_after;   /* after= given */
    uint64_t after;   /* default 0 */
    int max;          /* poll page size, [1, 1024], default 256 */
};
/* Parses query (NULL or "" = defaults). KV_EINVAL with a client message in err. */
kv_status kvapi_parse_query(const char *query, struct kvapi_query *q, char *err, size_t errlen);
/* Decimal unsigned integer, whole string; false if malformed. */
bool kvapi_parse_u64(const char *s, uint64_t *out);

/* The poll page (see above). New reference; NULL with a message in err on ENOMEM. */
json_t *kvapi_kv_events(engine_t *e, uint64_t after, int max, char *err, size_t errlen);
/* One event as JSON; worker_id (16 hex digits) is added when not NULL. New reference or
 * NULL on ENOMEM. */
json_t *kvapi_event_json(const struct engine_kv_event *ev, const char *worker_id);
/* The worker id as 16 lower-case hex digits + NUL. */
void kvapi_worker_id(engine_t *e, char out[17]);

#endif
