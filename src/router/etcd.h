/*
 * etcd: worker discovery through etcd's v3 JSON gateway (libcurl; docs/routing.md "Discovery").
 *
 *   worker (kvserve serve --etcd URL [--advertise URL])          router (kvserve router --etcd URL)
 *     POST /v3/lease/grant {TTL}                                   POST /v3/kv/range {prefix}
 *     POST /v3/kv/put {<prefix><role>/<url>: {"url","role"}, lease}   -> the workers now registered
 *     POST /v3/lease/keepalive every TTL/3                         POST /v3/watch {prefix, start_revision}
 *     (lease gone -> grant + put again)                              PUT -> add, DELETE -> remove
 *     stop: POST /v3/kv/deleterange + /v3/lease/revoke             (stream ends -> range again)
 *
 * Keys and values travel base64-encoded (the gateway's JSON mapping of bytes). A worker whose
 * process dies disappears when its lease expires (TTL seconds); one that stops cleanly revokes
 * its lease at once.
 */
#ifndef KV_ROUTER_ETCD_H
#define KV_ROUTER_ETCD_H

#include <stdbool.h>
#include <stddef.h>

#include "../base/base.h"

#define ETCD_DEFAULT_PREFIX "kvserve/workers/"

/* The worker side: a thread that keeps "<prefix><role>/<advertise>" registered under a lease. */
struct etcd_registrar;
/* Registers synchronously once (grant + put: KV_EIO with the reason in err when etcd cannot be
 * reached), then keeps the lease alive on a thread. etcd_url, prefix, advertise, role copied.
 * ttl_s >= 1. */
kv_status etcd_register_start(const char *etcd_url, const char *prefix, const char *advertise,
                              const char *role, int ttl_s, struct etcd_registrar **out, char *err,
                              size_t errlen);
/* Deletes the key, revokes the lease (best effort, 2 s limit) and joins the thread. NULL no-op. */
void etcd_register_stop(struct etcd_registrar *g);

/* Base64 (RFC 4648, padded) of n bytes; heap, NUL-terminated; NULL on ENOMEM. */
char *etcd_b64_encode(const void *p, size_t n);
/* Decodes NUL-terminated s into a heap NUL-terminated buffer (*n bytes); NULL when malformed. */
char *etcd_b64_decode(const char *s, size_t *n);
/* The range_end that selects every key starting with prefix (prefix with its last byte + 1),
 * base64; heap. */
char *etcd_prefix_end_b64(const char *prefix);

#endif
