/* discovery_etcd: the router's etcd watch (discovery_etcd.c; the protocol is in etcd.h). */
#ifndef KV_ROUTER_DISCOVERY_ETCD_H
#define KV_ROUTER_DISCOVERY_ETCD_H

#include <stdint.h>

#include "../base/base.h"

struct router;
struct etcd_watch;
/* Starts watching r->cfg.etcd under r->cfg.etcd_prefix (ranges first; workers are added to
 * their role's pool as they are found). KV_EINVAL for a bad URL. Loop thread. */
kv_status etcd_watch_start(struct router *r, struct etcd_watch **out, char *err, size_t errlen);
/* Reconnects a watch that ended (called from the router's maintenance tick). */
void etcd_watch_tick(struct etcd_watch *w);
void etcd_watch_stop(struct etcd_watch *w);
int etcd_watch_count(const struct etcd_watch *w);     /* workers registered now */
uint64_t etcd_watch_events(const struct etcd_watch *w); /* PUT/DELETE events seen */

#endif
