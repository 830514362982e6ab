/*
 * transfer: KV-cache transfer between a context (prefill) worker and a generation (decode)
 * worker. One agent per worker process; it owns a transfer thread (control sockets, the data
 * transport's progress, deadlines, the stale sweep) and never touches engine state: the engine
 * hands it pinned block ids and gets every outcome back through one completion callback.
 *
 * Model: PULL. The context worker ("sender") keeps the blocks of a finished prefill pinned and
 * offers them under the request's disagg_request_id. The generation worker ("receiver") has
 * allocated the blocks it lacks and asks the sender for them (REQUEST_DATA); the sender answers
 * with the source block list (the suffix of its blocks, aligned on the end, see below) and the
 * auxiliary data (first generated token, prompt length); the receiver reads the bytes through
 * the data transport (UCX RMA get, CUDA IPC device copies, or the TCP data stream) straight into its own blocks, checks
 * the byte count, then tells the sender DONE so it can unpin. Why pull: docs/disaggregation.md.
 *
 * Per request, on each side:
 *
 *   sender:   OFFERED --REQUEST_DATA--> SENDING --DONE from receiver--> (completion OK)
 *                |  (no peer yet)           |  error / cancel / deadline --> (completion error)
 *                +-- deadline, cancel ------+
 *   receiver: REQUESTED --READY (src blocks + aux)--> READING --all bytes--> (completion OK)
 *                |  FAILED / cancel / deadline / peer lost -------------> (completion error)
 *
 * Every state has a deadline (kvx_config.timeout_s overall, default 60 s). The first error of
 * a request is sticky: a later DONE or READY never turns it into success. A cancel for an id
 * the agent has not seen yet is remembered (for 2 x timeout_s) and applied when it appears.
 *
 * Stale sweep (spec §4, decision 4): a REQUEST_DATA for an id that has no offer yet is kept,
 * timestamped at its first arrival. Entries not claimed by an offer within stale_ttl_s
 * (default 120 s) are answered FAILED when the receiver said context_first, and dropped
 * silently otherwise (generation-first). Sweeps run every second and on each REQUEST_DATA.
 *
 * Block alignment (spec §4, BUG-17): the sender's blocks cover tokens [0, n_tokens); a receiver
 * that already caches the first k blocks asks for the n_dst = ceil(n_tokens/T) - k blocks it
 * lacks, and the sender sends the LAST n_dst of its blocks (end-aligned), never the first.
 *
 * Memory: the agent reads/writes the KV pool in place: block b of the pool is the
 * block_bytes-long region at pool_base + b * block_bytes (CPU backend: backend_cpu block_ptr(0)).
 * The layout inside a block is described by the page table (page_table.h); peers whose page
 * tables do not match (dtype, tokens per block, head geometry, no overlapping layers) are
 * refused with a message, before any byte moves.
 *
 * Thread-safety: every kvx_* call below is thread-safe. The completion callback runs on the
 * transfer thread, must not block and must not call back into the agent.
 */
#ifndef KV_TRANSFER_H
#define KV_TRANSFER_H

#include "../base/base.h"
#include "page_table.h"
#include "transport.h"

typedef struct kvx_agent kvx_agent_t;

/* cuda_ipc: KV pools in GPU memory, both workers on one host (the CUDA backend's transport,
 * src/backend/cuda/transport_cuda_ipc.h; the caller creates it and passes it in kvx_config.tp).
 * A worker whose pool is in GPU memory moves bytes only through it: a peer that asks for
 * another transport is refused at the handshake with a message (never a TCP byte stream out of
 * or into device memory), and so is a cuda_ipc peer of a worker whose pool is in host memory. */
enum kvx_transport_kind { KVX_TRANSPORT_TCP = 0, KVX_TRANSPORT_UCX = 1, KVX_TRANSPORT_CUDA_IPC = 2 };
/* "tcp" / "ucx" / "cuda_ipc"; parse returns KV_EINVAL for anything else (and KV_EUNSUPPORTED for
 * "ucx" in a build without UCX; "cuda_ipc" parses in every build: whether the backend has it is
 * the caller's check). */
const char *kvx_transport_name(enum kvx_transport_kind k);
kv_status kvx_transport_parse(const char *s, enum kvx_transport_kind *out);

/* Auxiliary data the sender gives the receiver with the block list. */
#define KVX_MAX_FIRST_TOKENS 4
struct kvx_aux {
    int n_tokens;             /* tokens whose K/V the blocks hold (the prompt length) */
    int n_first;              /* first generated tokens sampled by the context worker (1) */
    int32_t first[KVX_MAX_FIRST_TOKENS];
    int cached_tokens;        /* prompt tokens the context worker took from its own cache */
    uint64_t tokens_hash;     /* the sender's hash of the prompt ids (0 = none), for the
                                 receiver to check against its own prompt */
    bool has_lp;              /* the first token's logprob and alternatives, when asked for */
    struct kvx_token_lp { int32_t id; float logprob; } lp, top[20];
    int n_top;
};

/* One outcome. is_send: the sender side of disagg_id (blocks may now be unpinned); else the
 * receiver side (on KV_OK the destination blocks hold the bytes and aux is filled). */
struct kvx_result {
    uint64_t disagg_id;
    bool is_send;
    kv_status status;         /* KV_OK, KV_ECANCELLED, KV_EIO (peer/transport), KV_EINVAL
                                 (page-table mismatch, bad block counts), KV_EBUSY (deadline) */
    char message[160];        /* human reason when status != KV_OK */
    struct kvx_aux aux;       /* receiver, KV_OK only */
    uint64_t bytes;           /* bytes moved */
};
typedef void (*kvx_result_cb)(const struct kvx_result *r, void *user);

/* Fault injection for tests (also set from KVSERVE_KVX_FAULT, see kvx_fault_parse). */
struct kvx_faults {
    bool drop_done;           /* receiver never sends DONE (sender must time out and unpin) */
    bool drop_ready;          /* sender never answers REQUEST_DATA (receiver times out) */
    bool fail_read;           /* receiver's data read fails (one transfer) */
    int delay_request_ms;     /* receiver waits this long before it sends REQUEST_DATA */
};
/* Parses "drop_done,drop_ready,fail_read,delay_request_ms=10000" (any subset, comma
 * separated; "" = none). KV_EINVAL with a message naming the bad item. */
kv_status kvx_fault_parse(const char *s, struct kvx_faults *out, char *err, size_t errlen);

struct kvx_config {
    const char *host;         /* listen address for the control (and TCP data) socket; "127.0.0.1" */
    int port;                 /* 0 = any free port (see kvx_agent_endpoint) */
    enum kvx_transport_kind transport;
    double timeout_s;         /* overall deadline of one transfer, each side (default 60) */
    double stale_ttl_s;       /* unclaimed REQUEST_DATA lifetime (default 120) */
    size_t bounce_min_bytes;  /* coalesce fragmented transfers of at least this many bytes
                                 through a staging buffer (default 2 MiB; 0 = default;
                                 SIZE_MAX = never) */
    const struct kvx_page_table *pt; /* local pool layout (copied) */
    void *pool_base;          /* borrowed: n_blocks * pt->block_bytes, outlives the agent; a
                                 device pointer with KVX_TRANSPORT_CUDA_IPC (the agent then
                                 never reads or writes it itself) */
    kvx_transport_t *tp;      /* KVX_TRANSPORT_CUDA_IPC only: the transport, made by the caller
                                 (kvx_transport_cuda_ipc_new); owned by the agent from the
                                 kvx_agent_start call on, also when the start fails */
    int n_blocks;
    kvx_result_cb cb;         /* required */
    void *user;
    struct kvx_faults faults;
};

/* Starts the agent and its thread, listening on host:port. KV_EIO (bind/listen failed, message),
 * KV_EINVAL (bad config), KV_EUNSUPPORTED (transport not built), KV_ENOMEM. */
kv_status kvx_agent_start(const struct kvx_config *cfg, kvx_agent_t **out, char *err,
                          size_t errlen);
/* Fails every live transfer (KV_ECANCELLED completions, delivered before it returns), stops
 * the thread, frees. NULL is a no-op. */
void kvx_agent_stop(kvx_agent_t *a);
/* "host:port" of the control socket (what goes into ctx_info_endpoint). Valid for the agent's
 * life. */
const char *kvx_agent_endpoint(const kvx_agent_t *a);

/* Sender: offers the pinned blocks[0..n_blocks) (position order, covering aux->n_tokens tokens)
 * under disagg_id. The caller keeps them pinned until the is_send completion for disagg_id.
 * A stored REQUEST_DATA for the id is served at once. KV_EINVAL (id already offered, bad
 * counts), KV_ENOMEM; on error no completion will come. */
kv_status kvx_send_offer(kvx_agent_t *a, uint64_t disagg_id, const int32_t *blocks, int n_blocks,
                         const struct kvx_aux *aux);

/* Receiver: pulls from the sender at peer_endpoint ("host:port") the blocks this worker lacks
 * into dst_blocks[0..n_dst) (position order; they hold tokens from (n_blocks_total - n_dst)*T on,
 * where n_blocks_total = ceil(n_tokens / T)). n_tokens is the prompt length the receiver
 * expects (checked against the sender's aux). n_dst == 0 is legal (everything cached: only the
 * aux data moves). The destination blocks must stay allocated and unread until the completion.
 * KV_EINVAL (bad counts, malformed endpoint), KV_ENOMEM; on error no completion will come. */
kv_status kvx_recv_start(kvx_agent_t *a, uint64_t disagg_id, const char *peer_endpoint,
                         bool context_first, const int32_t *dst_blocks, int n_dst, int n_tokens);

/* Cancels disagg_id on this side (either role; the peer is told). Idempotent; an unknown id
 * is remembered. Completion: KV_ECANCELLED (unless the transfer already ended). */
void kvx_cancel(kvx_agent_t *a, uint64_t disagg_id);

/* Receiver: tells the sender at peer_endpoint that disagg_id will never be asked for (the
 * generation leg was cancelled before its transfer started), so the sender drops the offer now
 * (or remembers the cancel if the offer has not come yet). Best effort, asynchronous, no
 * completion; a bad endpoint is ignored. */
void kvx_cancel_remote(kvx_agent_t *a, uint64_t disagg_id, const char *peer_endpoint);

struct kvx_stats {
    uint64_t sends_ok, sends_failed, recvs_ok, recvs_failed, stale_failed, stale_dropped;
    uint64_t bytes_sent, bytes_received, bounce_transfers;
    int live_sends, live_recvs, stored_requests;
};
void kvx_get_stats(kvx_agent_t *a, struct kvx_stats *out);

#endif
