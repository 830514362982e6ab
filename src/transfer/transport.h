/*
 * transport: the data plane under the transfer agent (transfer.h). A transport moves bytes
 * from a peer's exposed memory region into local memory (PULL: the reader initiates). The
 * control plane (REQUEST_DATA, READY, DONE, CANCEL) is the agent's own TCP socket protocol and
 * is not part of this interface.
 *
 * Implementation: ucx (transport_ucx.c, built when libucx-dev is found): the region is
 * registered with ucp_mem_map, its packed rkey + the worker address form the descriptor, a read
 * is ucp_get_nbx per fragment. UCX picks the lanes (UCX_TLS / UCX_NET_DEVICES are honoured);
 * with UCX 1.13 a same-host get is emulated over shared memory, so the exposing side must keep
 * calling progress() too (the agent does). Without UCX the agent streams the bytes over its own
 * TCP control connection instead (agent_conn.c), so there is no separate tcp transport.
 * cuda_ipc (src/backend/cuda/transport_cuda_ipc.h, CUDA builds): KV pools in GPU memory on one
 * host; the caller creates it and hands it to the agent (kvx_config.tp); no expose_staging, no
 * event fd.
 *
 * Threading: a transport instance is driven by ONE thread (the agent's transfer thread): every
 * call below, including progress, comes from that thread. The tcp exposing side may run its
 * own server thread internally.
 *
 * Errors: kv_status + err message; a failed read reports its cookie with a non-OK status in
 * progress(); the peer handle stays usable only if the status is KV_OK.
 */
#ifndef KV_TRANSFER_TRANSPORT_H
#define KV_TRANSFER_TRANSPORT_H

#include "../base/base.h"

typedef struct kvx_transport kvx_transport_t;
typedef struct kvx_peer kvx_peer_t;

/* One contiguous piece of a read: remote bytes [remote_off, remote_off+len) of the peer's
 * exposed region -> local. */
struct kvx_frag {
    uint64_t remote_off;
    void *local;
    size_t len;
};

struct kvx_completion {
    uint64_t cookie;
    kv_status status;
    char message[128];
};

struct kvx_transport_ops {
    const char *name;               /* "ucx" / "cuda_ipc" (the REQ's "tp": peers must match) */
    /* Exposes [base, base+len) for remote reads (once per transport, before any connect from a
     * peer). Appends the descriptor peers need (opaque bytes; tcp: "host:port" of the data
     * listener; ucx: worker address + packed rkey + base) to desc. */
    kv_status (*expose)(kvx_transport_t *t, void *base, size_t len, kv_buf *desc, char *err,
                        size_t errlen);
    /* Also exposes a second region (the bounce/staging buffer), same descriptor rules; region
     * id 1. Optional (NULL: no bounce path over this transport). */
    kv_status (*expose_staging)(kvx_transport_t *t, void *base, size_t len, kv_buf *desc,
                                char *err, size_t errlen);
    /* Connects to a peer from its descriptor. KV_EIO / KV_EINVAL with a message. */
    kv_status (*connect)(kvx_transport_t *t, const void *desc, size_t len, kvx_peer_t **out,
                         char *err, size_t errlen);
    void (*disconnect)(kvx_transport_t *t, kvx_peer_t *p);
    /* Starts reading frags[0..n) from region `region` (0 = pool, 1 = staging) of peer p. One
     * completion with `cookie` comes from progress() when every fragment landed or one failed.
     * Fragments may be served in any order. */
    kv_status (*read)(kvx_transport_t *t, kvx_peer_t *p, int region, const struct kvx_frag *frags,
                      int n, uint64_t cookie, char *err, size_t errlen);
    /* Drives the transport for at most timeout_ms (0 = poll). Writes up to cap completions into
     * out; returns their count (>= 0), or a negative kv_status on a fatal transport error. */
    int (*progress)(kvx_transport_t *t, struct kvx_completion *out, int cap, int timeout_ms);
    /* Optional: a file descriptor that becomes readable when progress() has work (for poll()).
     * -1 if none (the agent then polls with a short timeout). */
    int (*event_fd)(kvx_transport_t *t);
    void (*destroy)(kvx_transport_t *t);
};

struct kvx_transport {
    const struct kvx_transport_ops *ops;
    void *ctx;
};

/* Creates the UCX transport. host: the address whose interface UCX should use ("127.0.0.1" ->
 * lo). KV_EUNSUPPORTED in a build without UCX. */
kv_status kvx_transport_ucx_new(const char *host, kvx_transport_t **out, char *err, size_t errlen);
/* True if this build has the UCX transport. */
bool kvx_transport_ucx_available(void);

#endif
