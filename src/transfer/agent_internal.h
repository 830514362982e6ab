/*
 * Agent internals shared by agent.c (thread, commands, deadlines, the stale sweep) and
 * agent_conn.c (one control/data connection per transfer: framing, the protocol, streaming).
 *
 * Wire protocol (one TCP connection per transfer, opened by the receiver):
 *   frame   = 4-byte big-endian length + JSON object (at most 16 MiB)
 *   R -> S  {"t":"req","id":"<u64>","context_first":b,"n_dst":n,"n_tokens":n,"pt":{page table}}
 *   S -> R  {"t":"ready","bytes":B,"staged":b,"aux":{...},"pt":{page table}}  then B raw bytes
 *           | {"t":"failed","msg":"..."}            (mismatch, stale, already finished, ...)
 *   R -> S  {"t":"done"} after the B bytes landed   | {"t":"failed","msg"} | {"t":"cancel"}
 *   either  {"t":"cancel"}; a close before the end = the peer is gone (KV_EIO)
 * The bytes are the receiver's blocks in order, each block's mapped segments in order
 * (page_table.h kvx_map): both sides derive the same order from the two page tables.
 */
#ifndef KV_TRANSFER_AGENT_INTERNAL_H
#define KV_TRANSFER_AGENT_INTERNAL_H

#include <pthread.h>

#include "transfer.h"
#include "transport.h"

#define KVX_MAX_FRAME (16u << 20)

enum conn_state {
    CS_CONNECTING = 0, /* receiver: non-blocking connect in progress */
    CS_REQ_SENT,       /* receiver: waiting for READY / FAILED */
    CS_RECV_DATA,      /* receiver: reading the raw bytes */
    CS_DONE_SENT,      /* receiver: finished (drop_done: lingering without DONE) */
    CS_ACCEPTED,       /* sender: waiting for REQ */
    CS_WAIT_OFFER,     /* sender: REQ stored, no offer yet (stale sweep applies) */
    CS_SEND_DATA,      /* sender: READY sent, writing the raw bytes */
    CS_WAIT_DONE,      /* sender: bytes written, waiting for DONE */
    CS_CLOSED,
};

struct offer {
    struct offer *next;
    uint64_t id;
    int32_t *blocks;           /* owned (n_blocks) */
    int n_blocks;
    struct kvx_aux aux;
    uint64_t deadline_ns;
    struct conn *conn;         /* serving connection, or NULL */
};

struct run {                   /* one contiguous piece of the byte stream in local memory */
    uint8_t *p;
    size_t len;
};

struct conn {
    struct conn *next;
    int fd;
    enum conn_state st;
    bool is_recv;              /* we opened it (receiver side) */
    uint64_t id;
    bool context_first;
    int n_dst, n_tokens;
    int32_t *dst;              /* receiver: owned (n_dst) */
    char peer[160];
    uint64_t t_start_ns, deadline_ns, start_at_ns; /* start_at: delayed REQ (fault) */
    bool completed;            /* our side's completion was delivered */
    bool ignored;              /* sender: never served (drop_ready, silently dropped stale) */
    struct offer *offer;       /* sender: the offer being served */
    /* framing */
    uint8_t hdr[4];
    size_t hdr_got;
    uint8_t *msg;
    size_t msg_len, msg_got;
    kv_buf out;                /* frames to write */
    size_t out_off;
    /* raw byte stream */
    struct run *runs;
    int n_runs, run_i;
    size_t run_off;
    uint64_t total, moved;
    uint8_t *staging;          /* bounce buffer (owned) */
    struct run *scatter;       /* receiver, staged: where the staging bytes go */
    int n_scatter;
    struct kvx_aux aux;        /* receiver: from READY */
    struct kvx_page_table peer_pt; /* sender: the receiver's page table (from REQ) */
    bool close_after_flush;
    bool notify;               /* receiver: only carries a cancel_id frame, then closes */
    /* UCX data path (both sides use UCX): the receiver reads with the transport, the sender
     * only waits for DONE */
    bool ucx;
    uint64_t cookie;           /* receiver: the transport read's cookie */
    bool read_inflight;        /* receiver: a read may still be writing our blocks */
    bool abort_pending;        /* a failure/cancel waits for the read to drain (BUG-08) */
    kv_status abort_st;
    char abort_msg[160];
};

struct cmd {
    struct cmd *next;
    enum { CMD_OFFER, CMD_RECV, CMD_CANCEL, CMD_CANCEL_REMOTE } type;
    uint64_t id;
    int32_t *blocks;           /* owned */
    int n;
    struct kvx_aux aux;
    bool context_first;
    int n_tokens;
    char peer[160];
};

struct cancel_memo {
    uint64_t id;
    uint64_t until_ns;
};

struct kvx_agent {
    struct kvx_config cfg;
    struct kvx_page_table pt;  /* owned copy */
    char endpoint[192];
    int listen_fd;
    int wake[2];
    pthread_t thread;
    bool started;
    /* shared, under mu */
    pthread_mutex_t mu;
    struct cmd *cmds, *cmds_tail;
    bool stopping;
    struct kvx_stats stats;
    /* transfer thread only */
    struct offer *offers;
    struct conn *conns;
    struct cancel_memo *memo;
    int n_memo, cap_memo;
    uint64_t finished[1024];   /* ids whose send ended (REQ for them gets FAILED, or CANCEL
                                  when finished_cancelled says the offer was cancelled) */
    bool finished_cancelled[1024];
    int n_finished;
    uint64_t last_sweep_ns;
    /* the data-plane transport (cfg.transport ucx or cuda_ipc; NULL: tcp streaming) */
    kvx_transport_t *tp;
    bool device_pool;          /* the pool is in GPU memory (cuda_ipc): no byte of it is ever
                                  streamed over the control socket */
    char *desc_hex;            /* our exposed pool's descriptor, hex */
    struct {
        char key[208];         /* endpoint + "#" + descriptor hash */
        kvx_peer_t *p;
    } peers[32];
    int n_peers;
    uint64_t cookie_seq;
};

/* ---- agent.c ---- */
void agent_complete(struct kvx_agent *a, uint64_t id, bool is_send, kv_status st,
                    const struct kvx_aux *aux, uint64_t bytes, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
struct offer *agent_find_offer(struct kvx_agent *a, uint64_t id);
void agent_drop_offer(struct kvx_agent *a, struct offer *o);
/* 0: id not remembered as ended; 1: its send ended; 2: it ended by a cancel (the router's
 * /kv_release, the receiver's cancel): a late REQ for it is answered CANCEL, not FAILED. */
int agent_was_finished(const struct kvx_agent *a, uint64_t id);
void agent_mark_finished(struct kvx_agent *a, uint64_t id);
/* Marks the most recent ended entry of id as cancelled (after agent_mark_finished). */
void agent_mark_cancelled(struct kvx_agent *a, uint64_t id);
void agent_stat(struct kvx_agent *a, uint64_t *field, uint64_t add);
/* Stale sweep (spec §4, decision 4): every second from the loop and on each REQ. */
void agent_stale_sweep(struct kvx_agent *a, uint64_t now);

void agent_cancel_local(struct kvx_agent *a, uint64_t id);
/* Sender: the receiver of id was refused (page tables or transports do not match, prompt
 * length differs): the KV can never be delivered, so an offer no connection serves is dropped
 * now (KV_EINVAL completion naming why) and an id not offered yet is remembered as cancelled,
 * instead of holding the blocks until the transfer deadline. */
void agent_refuse_offer(struct kvx_agent *a, uint64_t id, const char *why);

/* ---- agent_conn.c ---- */
/* Receiver: a one-frame connection telling the sender that id is cancelled. */
void conn_open_notify(struct kvx_agent *a, const struct cmd *c);
/* Receiver: opens a connection for a recv command (completion on failure). */
void conn_open_recv(struct kvx_agent *a, const struct cmd *c);
/* Sender: a new accepted socket. */
void conn_accept(struct kvx_agent *a, int fd);
/* Poll events for conn (POLLIN/POLLOUT). */
short conn_events(const struct conn *c);
/* Handles readiness; may close c (st = CS_CLOSED). */
void conn_io(struct kvx_agent *a, struct conn *c, short revents);
/* Starts serving a stored REQ (sender) now that offer o exists. */
void conn_serve(struct kvx_agent *a, struct conn *c, struct offer *o);
/* Sends {"t":"failed"} (best effort) and closes. */
void conn_fail(struct kvx_agent *a, struct conn *c, const char *msg);
/* Cancels: tells the peer, completes our side with KV_ECANCELLED, closes. */
void conn_cancel(struct kvx_agent *a, struct conn *c);
/* Closes the socket and frees buffers (the struct stays until the sweep unlinks it). */
void conn_close(struct conn *c);
void conn_free(struct conn *c);
/* A transport read finished (receiver, UCX). */
void conn_read_done(struct kvx_agent *a, const struct kvx_completion *k);
/* UCX: the cached transport peer for endpoint/descriptor (connects on first use); NULL + why. */
kvx_peer_t *agent_ucx_peer(struct kvx_agent *a, const char *endpoint, const uint8_t *desc, size_t n,
                           char *why, size_t whylen);
void agent_ucx_forget(struct kvx_agent *a, kvx_peer_t *p);

#endif
