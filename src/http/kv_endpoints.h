/*
 * kv_endpoints: the KV-reuse endpoints of the HTTP front (server.c routes them).
 *
 *   GET /server_info            {"model","tokens_per_block","hash_scheme","worker_id",
 *                                "prefix_cache","host_cache_blocks","max_model_len",
 *                                "kv_events_ring"} -- a router with other settings must
 *                                refuse to mirror this worker.
 *   GET /kv_events?after=SEQ&max=N
 *                               {"worker_id","tokens_per_block","hash_scheme","last_seq",
 *                                "lost","events":[{"seq","type":"stored"|"removed"|"cleared",
 *                                "block_hash","parent_hash","parent_is_root","tokens":[...]}]}
 *                                Events with seq > after, oldest first (N <= 1024, default
 *                                256). A router polls with after = the last seq it saw;
 *                                lost > 0 means it missed events (resync: treat the worker as
 *                                cleared). Hashes are lower-case hex of 32 bytes.
 */
#ifndef KV_HTTP_KV_ENDPOINTS_H
#define KV_HTTP_KV_ENDPOINTS_H

#include <jansson.h>

#include "../engine/engine.h"

/* New reference, or NULL on ENOMEM. */
json_t *kvapi_server_info(engine_t *e, const char *model_name);
/* New reference; NULL with a message in err for a bad query (answer 400). */
json_t *kvapi_kv_events(engine_t *e, const char *query, char *err, size_t errlen);
/* The request body's "cache_salt" string (heap copy), or NULL if absent / not a string. */
char *kvapi_cache_salt(const char *body, size_t len);

#endif
