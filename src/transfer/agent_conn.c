/*
 * agent_conn: one connection per transfer (protocol in agent_internal.h). Non-blocking sockets
 * driven by the agent's poll loop; the raw KV bytes go straight from the sender's pool to the
 * receiver's blocks (readv/sendmsg over the mapped runs), or through a staging buffer on both
 * sides when a transfer is fragmented and large (the bounce path).
 */
#include "agent_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <jansson.h>

#define IOV_MAX_BATCH 64

/* ---------------------------------------------------------------- frames */

static kv_status queue_json(struct conn *c, json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return KV_ENOMEM;
    size_t n = strlen(s);
    uint8_t h[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    kv_status st = kv_buf_append(&c->out, h, 4);
    if (!st) st = kv_buf_append(&c->out, s, n);
    free(s);
    return st;
}

/* Best effort, now, without blocking (the connection is closed right after). */
static void send_now(struct conn *c, const char *type, const char *msg) {
    if (c->fd < 0) return;
    json_t *o = msg ? json_pack("{s:s, s:s}", "t", type, "msg", msg) : json_pack("{s:s}", "t", type);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return;
    size_t n = strlen(s);
    uint8_t buf[4 + 512];
    if (n > 512) n = 512;
    buf[0] = (uint8_t)(n >> 24), buf[1] = (uint8_t)(n >> 16), buf[2] = (uint8_t)(n >> 8), buf[3] = (uint8_t)n;
    memcpy(buf + 4, s, n);
    free(s);
    if (c->out.len == c->out_off && c->st != CS_SEND_DATA) {
        ssize_t w = send(c->fd, buf, 4 + n, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w;
    }
}

void conn_close(struct conn *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    free(c->msg);
    c->msg = NULL;
    kv_buf_free(&c->out);
    free(c->runs);
    c->runs = NULL;
    free(c->staging);
    c->staging = NULL;
    free(c->scatter);
    c->scatter = NULL;
    free(c->dst);
    c->dst = NULL;
    kvx_page_table_free(&c->peer_pt);
    c->st = CS_CLOSED;
}

void conn_free(struct conn *c) {
    if (c->st != CS_CLOSED) conn_close(c);
    free(c);
}

void conn_fail(struct kvx_agent *a, struct conn *c, const char *msg) {
    (void)a;
    send_now(c, "failed", msg);
    conn_close(c);
}

/* Completes the sender side of c's offer (if any) and forgets the offer. */
static void send_done(struct kvx_agent *a, struct conn *c, kv_status st, const char *msg) {
    struct offer *o = c->offer;
    if (!o) return;
    c->offer = NULL;
    uint64_t id = o->id;
    agent_drop_offer(a, o);
    agent_complete(a, id, true, st, NULL, c->moved, "%s", msg ? msg : "");
}

static void recv_done(struct kvx_agent *a, struct conn *c, kv_status st, const char *fmt, const char *arg) {
    if (c->completed) return;
    if (c->read_inflight && st != KV_OK) { /* the read may still land: complete when it drained */
        if (!c->abort_pending) {
            c->abort_pending = true;
            c->abort_st = st;
            /* truncation is fine: a message for humans (the result is checked so -O2 -Wformat-truncation
             * knows it was considered) */
            if (snprintf(c->abort_msg, sizeof c->abort_msg, fmt ? fmt : "%s", arg ? arg : "") < 0) c->abort_msg[0] = 0;
        }
        return;
    }
    c->completed = true;
    agent_complete(a, c->id, false, st, st == KV_OK ? &c->aux : NULL, c->moved, fmt, arg ? arg : "");
}

void conn_cancel(struct kvx_agent *a, struct conn *c) {
    send_now(c, "cancel", NULL);
    if (c->is_recv) recv_done(a, c, KV_ECANCELLED, "cancelled%s", "");
    else send_done(a, c, KV_ECANCELLED, "cancelled");
    conn_close(c);
}

static struct conn *conn_new(struct kvx_agent *a, int fd, bool is_recv) {
    struct conn *c = kv_calloc(1, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->is_recv = is_recv;
    kv_buf_init(&c->out);
    c->t_start_ns = kv_now_ns();
    c->deadline_ns = c->t_start_ns + (uint64_t)(a->cfg.timeout_s * 1e9);
    c->next = a->conns;
    a->conns = c;
    return c;
}

/* ---------------------------------------------------------------- runs */

/* Local runs of the byte stream: for each block pair, each mapped segment, in order. src: true on
 * the sender (source offsets into our pool), false on the receiver (destination offsets). */
static kv_status build_runs(struct kvx_agent *a, const struct kvx_map *m, const int32_t *blocks,
                            int n, bool src, struct run **out, int *n_out, uint64_t *total) {
    size_t cap = (size_t)(n > 0 ? n : 1) * (size_t)(m->n_seg > 0 ? m->n_seg : 1);
    struct run *r = kv_malloc(cap * sizeof *r);
    if (!r) return KV_ENOMEM;
    uint8_t *base = a->cfg.pool_base;
    size_t stride = src ? m->src_block_bytes : m->dst_block_bytes;
    int k = 0;
    uint64_t t = 0;
    for (int b = 0; b < n; b++)
        for (int s = 0; s < m->n_seg; s++) {
            uint8_t *p = base + (size_t)blocks[b] * stride + (src ? m->seg[s].src_off : m->seg[s].dst_off);
            size_t len = m->seg[s].len;
            if (k && r[k - 1].p + r[k - 1].len == p) r[k - 1].len += len;
            else r[k++] = (struct run){p, len};
            t += len;
        }
    *out = r;
    *n_out = k;
    *total = t;
    return KV_OK;
}

static bool use_bounce(const struct kvx_agent *a, int n_runs, uint64_t total, size_t block_bytes) {
    return n_runs > 1 && a->cfg.bounce_min_bytes != SIZE_MAX && total >= a->cfg.bounce_min_bytes &&
           total >= block_bytes;
}

/* ---------------------------------------------------------------- receiver */

static kv_status start_connect(struct kvx_agent *a, struct conn *c, char *why, size_t whylen) {
    char host[160];
    snprintf(host, sizeof host, "%s", c->peer);
    char *colon = strrchr(host, ':');
    if (!colon) return kv_errf(KV_EINVAL, why, whylen, "bad endpoint '%s'", c->peer);
    *colon = 0;
    const char *port = colon + 1, *h = host;
    if (host[0] == '[') { /* [v6]:port */
        h = host + 1;
        char *rb = strchr(host, ']');
        if (rb) *rb = 0;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(h, port, &hints, &res);
    if (rc) return kv_errf(KV_EIO, why, whylen, "cannot resolve %s: %s", c->peer, gai_strerror(rc));
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        freeaddrinfo(res);
        return kv_errf(KV_EIO, why, whylen, "socket: %s", strerror(errno));
    }
    rc = connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (rc != 0 && errno != EINPROGRESS) {
        kv_status st = kv_errf(KV_EIO, why, whylen, "cannot connect to %s: %s", c->peer, strerror(errno));
        close(fd);
        return st;
    }
    c->fd = fd;
    c->st = CS_CONNECTING;
    json_t *pt = kvx_page_table_to_json(&a->pt);
    char ids[24];
    snprintf(ids, sizeof ids, "%llu", (unsigned long long)c->id);
    json_t *o = pt ? json_pack("{s:s, s:s, s:b, s:i, s:i, s:o, s:s}", "t", "req", "id", ids,
                               "context_first", c->context_first, "n_dst", c->n_dst, "n_tokens",
                               c->n_tokens, "pt", pt, "tp", a->tp ? a->tp->ops->name : "tcp")
                   : NULL;
    if (queue_json(c, o) != KV_OK) return kv_errf(KV_ENOMEM, why, whylen, "out of memory");
    return KV_OK;
}

void conn_open_notify(struct kvx_agent *a, const struct cmd *cmd) {
    struct conn *c = conn_new(a, -1, true);
    if (!c) return;
    c->id = cmd->id;
    c->notify = true;
    c->completed = true; /* no completion for a notification */
    snprintf(c->peer, sizeof c->peer, "%s", cmd->peer);
    char why[256];
    if (start_connect(a, c, why, sizeof why) != KV_OK) {
        conn_close(c);
        return;
    }
    kv_buf_free(&c->out); /* start_connect queued a REQ: replace it */
    kv_buf_init(&c->out);
    c->out_off = 0;
    char ids[24];
    snprintf(ids, sizeof ids, "%llu", (unsigned long long)c->id);
    queue_json(c, json_pack("{s:s, s:s}", "t", "cancel_id", "id", ids));
    c->close_after_flush = true;
}

void conn_open_recv(struct kvx_agent *a, const struct cmd *cmd) {
    struct conn *c = conn_new(a, -1, true);
    if (!c) {
        agent_complete(a, cmd->id, false, KV_ENOMEM, NULL, 0, "out of memory");
        return;
    }
    c->id = cmd->id;
    c->context_first = cmd->context_first;
    c->n_dst = cmd->n;
    c->n_tokens = cmd->n_tokens;
    snprintf(c->peer, sizeof c->peer, "%s", cmd->peer);
    c->dst = kv_malloc((size_t)(cmd->n ? cmd->n : 1) * sizeof *c->dst);
    if (!c->dst) {
        recv_done(a, c, KV_ENOMEM, "out of memory%s", "");
        conn_close(c);
        return;
    }
    memcpy(c->dst, cmd->blocks, (size_t)cmd->n * sizeof *c->dst);
    if (a->cfg.faults.delay_request_ms > 0) {
        c->start_at_ns = kv_now_ns() + (uint64_t)a->cfg.faults.delay_request_ms * 1000000ull;
        c->st = CS_CONNECTING;
        return;
    }
    char why[256];
    if (start_connect(a, c, why, sizeof why) != KV_OK) {
        recv_done(a, c, KV_EIO, "KV transfer: %s", why);
        conn_close(c);
    }
}

static void recv_finish(struct kvx_agent *a, struct conn *c);

/* UCX: read the sender's blocks (READY's "src" ids) straight into ours. */
static kv_status ucx_start_read(struct kvx_agent *a, struct conn *c, json_t *o, const char *hex,
                                char *why, size_t whylen) {
    size_t hl = strlen(hex);
    json_t *src = json_object_get(o, "src");
    if (hl % 2 || hl > (8u << 20) || !json_is_array(src) || (int)json_array_size(src) != c->n_dst)
        return kv_errf(KV_EIO, why, whylen, "malformed UCX READY");
    uint8_t *desc = kv_malloc(hl / 2 + 1);
    if (!desc) return kv_errf(KV_ENOMEM, why, whylen, "out of memory");
    for (size_t i = 0; i < hl / 2; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) {
            free(desc);
            return kv_errf(KV_EIO, why, whylen, "malformed UCX descriptor");
        }
        desc[i] = (uint8_t)v;
    }
    struct kvx_page_table ppt;
    if (kvx_page_table_from_json(json_object_get(o, "pt"), &ppt, why, whylen) != KV_OK) {
        free(desc);
        return KV_EIO;
    }
    struct kvx_map m;
    kv_status st = kvx_page_table_match(&a->pt, &ppt, &m, why, whylen);
    kvx_page_table_free(&ppt);
    if (st) {
        free(desc);
        return KV_EINVAL;
    }
    int32_t *sb = kv_malloc((size_t)(c->n_dst ? c->n_dst : 1) * sizeof *sb);
    struct kvx_run *runs = NULL;
    int n_runs = 0;
    if (!sb) st = KV_ENOMEM;
    for (int i = 0; !st && i < c->n_dst; i++) {
        json_t *v = json_array_get(src, (size_t)i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) st = KV_EIO;
        else sb[i] = (int32_t)json_integer_value(v);
    }
    if (!st) st = kvx_map_runs(&m, sb, c->dst, c->n_dst, a->cfg.pool_base, &runs, &n_runs);
    kvx_map_free(&m);
    free(sb);
    if (st) {
        free(desc);
        return kv_errf(st, why, whylen, "bad UCX READY (%s)", kv_status_str(st));
    }
    kvx_peer_t *p = agent_ucx_peer(a, c->peer, desc, hl / 2, why, whylen);
    free(desc);
    struct kvx_frag *fr = p ? kv_malloc((size_t)(n_runs ? n_runs : 1) * sizeof *fr) : NULL;
    if (!p || !fr) {
        free(runs);
        free(fr);
        return p ? kv_errf(KV_ENOMEM, why, whylen, "out of memory") : KV_EIO;
    }
    for (int i = 0; i < n_runs; i++) fr[i] = (struct kvx_frag){runs[i].src_off, runs[i].dst, runs[i].len};
    free(runs);
    c->cookie = ++a->cookie_seq;
    c->ucx = true;
    st = a->tp->ops->read(a->tp, p, 0, fr, n_runs, c->cookie, why, whylen);
    free(fr);
    if (st != KV_OK) {
        agent_ucx_forget(a, p);
        return KV_EIO;
    }
    c->read_inflight = true;
    return KV_OK;
}

void conn_read_done(struct kvx_agent *a, const struct kvx_completion *k) {
    struct conn *c = a->conns;
    while (c && !(c->is_recv && c->read_inflight && c->cookie == k->cookie)) c = c->next;
    if (!c) return;
    c->read_inflight = false;
    if (c->abort_pending) { /* failed or cancelled meanwhile: now the blocks are ours again */
        c->completed = true;
        agent_complete(a, c->id, false, c->abort_st, NULL, 0, "%s", c->abort_msg);
        if (c->st != CS_CLOSED) conn_fail(a, c, c->abort_msg);
        return;
    }
    if (c->st == CS_CLOSED) return;
    if (k->status != KV_OK) {
        recv_done(a, c, KV_EIO, a->device_pool ? "KV transfer: cuda_ipc read failed: %s"
                                                : "KV transfer: UCX read failed: %s", k->message);
        conn_fail(a, c, "read failed");
        return;
    }
    c->moved = c->total;
    recv_finish(a, c);
}

static kv_status on_ready(struct kvx_agent *a, struct conn *c, json_t *o, char *why, size_t whylen) {
    struct kvx_page_table ppt;
    if (kvx_page_table_from_json(json_object_get(o, "pt"), &ppt, why, whylen) != KV_OK) return KV_EIO;
    struct kvx_map m;
    kv_status st = kvx_page_table_match(&a->pt, &ppt, &m, why, whylen);
    kvx_page_table_free(&ppt);
    if (st != KV_OK) return KV_EINVAL;
    json_t *aux = json_object_get(o, "aux"), *first = json_object_get(aux, "first");
    memset(&c->aux, 0, sizeof c->aux);
    c->aux.n_tokens = (int)json_integer_value(json_object_get(aux, "n_tokens"));
    c->aux.cached_tokens = (int)json_integer_value(json_object_get(aux, "cached_tokens"));
    const char *th = json_string_value(json_object_get(aux, "tokens_hash"));
    c->aux.tokens_hash = th ? strtoull(th, NULL, 16) : 0;
    json_t *lp = json_object_get(aux, "lp"), *lpt = json_object_get(lp, "top");
    if (json_is_object(lp) && json_is_integer(json_object_get(lp, "id"))) {
        c->aux.has_lp = true;
        c->aux.lp.id = (int32_t)json_integer_value(json_object_get(lp, "id"));
        c->aux.lp.logprob = (float)json_number_value(json_object_get(lp, "logprob"));
        size_t i;
        json_t *v;
        json_array_foreach(lpt, i, v) {
            if (i >= 20) break;
            c->aux.top[i].id = (int32_t)json_integer_value(json_array_get(v, 0));
            c->aux.top[i].logprob = (float)json_number_value(json_array_get(v, 1));
            c->aux.n_top = (int)i + 1;
        }
    }
    size_t i;
    json_t *v;
    json_array_foreach(first, i, v) if (i < KVX_MAX_FIRST_TOKENS) c->aux.first[c->aux.n_first++] =
        (int32_t)json_integer_value(v);
    uint64_t bytes = (uint64_t)json_integer_value(json_object_get(o, "bytes"));
    bool staged = json_is_true(json_object_get(o, "staged"));
    if (c->aux.n_tokens != c->n_tokens) {
        kvx_map_free(&m);
        return kv_errf(KV_EINVAL, why, whylen, "the context worker's prompt has %d tokens, this "
                       "request %d", c->aux.n_tokens, c->n_tokens);
    }
    st = build_runs(a, &m, c->dst, c->n_dst, false, &c->runs, &c->n_runs, &c->total);
    kvx_map_free(&m);
    if (st) return kv_errf(KV_ENOMEM, why, whylen, "out of memory");
    if (bytes != c->total)
        return kv_errf(KV_EIO, why, whylen, "the sender announced %llu bytes, %llu expected",
                       (unsigned long long)bytes, (unsigned long long)c->total);
    const char *hex = json_string_value(json_object_get(o, "ucx"));
    if (hex && a->tp) return ucx_start_read(a, c, o, hex, why, whylen);
    if (a->device_pool) /* (the sender refuses this first; never stream into device memory) */
        return kv_errf(KV_EINVAL, why, whylen, "the context worker did not offer a cuda_ipc read (its KV pool "
                       "is in host memory); this worker's pool is in GPU memory");
    if (staged) { /* read one run into staging, scatter when complete */
        c->staging = kv_malloc(c->total ? c->total : 1);
        if (!c->staging) return kv_errf(KV_ENOMEM, why, whylen, "out of memory (staging)");
        c->scatter = c->runs;
        c->n_scatter = c->n_runs;
        c->runs = kv_malloc(sizeof *c->runs);
        if (!c->runs) return kv_errf(KV_ENOMEM, why, whylen, "out of memory");
        c->runs[0] = (struct run){c->staging, c->total};
        c->n_runs = 1;
        agent_stat(a, &a->stats.bounce_transfers, 1);
    }
    return KV_OK;
}

static void recv_finish(struct kvx_agent *a, struct conn *c) {
    if (c->scatter) {
        const uint8_t *p = c->staging;
        for (int i = 0; i < c->n_scatter; i++) {
            memcpy(c->scatter[i].p, p, c->scatter[i].len);
            p += c->scatter[i].len;
        }
    }
    c->st = CS_DONE_SENT;
    if (!a->cfg.faults.drop_done) {
        queue_json(c, json_pack("{s:s}", "t", "done"));
        c->close_after_flush = true;
    }
    recv_done(a, c, KV_OK, NULL, NULL);
}

/* ---------------------------------------------------------------- sender */

void conn_accept(struct kvx_agent *a, int fd) {
    int fl = fcntl(fd, F_GETFL, 0);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) {
        close(fd);
        return;
    }
    struct conn *c = conn_new(a, fd, false);
    if (!c) {
        close(fd);
        return;
    }
    c->st = CS_ACCEPTED;
}

void conn_serve(struct kvx_agent *a, struct conn *c, struct offer *o) {
    char why[256] = "";
    if (c->n_tokens != o->aux.n_tokens) {
        snprintf(why, sizeof why, "prompt length mismatch: the generation worker has %d tokens, "
                 "the context worker %d", c->n_tokens, o->aux.n_tokens);
        conn_fail(a, c, why);
        agent_refuse_offer(a, o->id, why); /* never deliverable: unpin now, not at the deadline */
        return;
    }
    if (c->n_dst > o->n_blocks) {
        conn_fail(a, c, "the receiver asks for more blocks than the prompt has");
        agent_refuse_offer(a, o->id, "the receiver asks for more blocks than the prompt has");
        return;
    }
    struct kvx_map m;
    if (kvx_page_table_match(&c->peer_pt, &a->pt, &m, why, sizeof why) != KV_OK) {
        conn_fail(a, c, why);
        agent_refuse_offer(a, o->id, why);
        return;
    }
    /* end alignment (BUG-17): the receiver lacks the LAST n_dst blocks */
    const int32_t *src = o->blocks + (o->n_blocks - c->n_dst);
    kv_status st = build_runs(a, &m, src, c->n_dst, true, &c->runs, &c->n_runs, &c->total);
    size_t bb = m.src_block_bytes;
    kvx_map_free(&m);
    if (st) {
        conn_fail(a, c, "out of memory");
        return;
    }
    bool staged = !c->ucx && use_bounce(a, c->n_runs, c->total, bb);
    if (staged) {
        c->staging = kv_malloc(c->total);
        if (c->staging) {
            uint8_t *p = c->staging;
            for (int i = 0; i < c->n_runs; i++) {
                memcpy(p, c->runs[i].p, c->runs[i].len);
                p += c->runs[i].len;
            }
            c->runs[0] = (struct run){c->staging, c->total};
            c->n_runs = 1;
            agent_stat(a, &a->stats.bounce_transfers, 1);
        } else {
            staged = false; /* direct is always possible */
        }
    }
    json_t *first = json_array();
    for (int i = 0; i < o->aux.n_first; i++) json_array_append_new(first, json_integer(o->aux.first[i]));
    json_t *pt = kvx_page_table_to_json(&a->pt);
    char th[24];
    snprintf(th, sizeof th, "%016llx", (unsigned long long)o->aux.tokens_hash);
    json_t *msg = first && pt ? json_pack("{s:s, s:I, s:b, s:{s:i, s:i, s:o, s:s}, s:o}", "t", "ready",
                                          "bytes", (json_int_t)c->total, "staged", staged, "aux",
                                          "n_tokens", o->aux.n_tokens, "cached_tokens",
                                          o->aux.cached_tokens, "first", first, "tokens_hash", th,
                                          "pt", pt)
                              : NULL;
    if (msg && o->aux.has_lp) {
        json_t *top = json_array();
        for (int i = 0; top && i < o->aux.n_top && i < 20; i++)
            json_array_append_new(top, json_pack("[i, f]", o->aux.top[i].id, (double)o->aux.top[i].logprob));
        json_object_set_new(json_object_get(msg, "aux"), "lp",
                            json_pack("{s:i, s:f, s:o}", "id", o->aux.lp.id, "logprob",
                                      (double)o->aux.lp.logprob, "top", top ? top : json_array()));
    }
    if (msg && c->ucx) { /* the receiver reads; we only tell it where */
        json_t *ids = json_array();
        for (int i = 0; i < c->n_dst && ids; i++) json_array_append_new(ids, json_integer(src[i]));
        json_object_set_new(msg, "src", ids ? ids : json_null());
        json_object_set_new(msg, "ucx", json_string(a->desc_hex));
    }
    if (queue_json(c, msg) != KV_OK) {
        conn_fail(a, c, "out of memory");
        return;
    }
    o->conn = c;
    c->offer = o;
    c->deadline_ns = kv_now_ns() + (uint64_t)(a->cfg.timeout_s * 1e9);
    c->st = c->total && !c->ucx ? CS_SEND_DATA : CS_WAIT_DONE;
    if (c->ucx) c->moved = c->total; /* counted as sent once DONE arrives */
}

static void on_req(struct kvx_agent *a, struct conn *c, json_t *o) {
    char why[256] = "";
    const char *ids = json_string_value(json_object_get(o, "id"));
    char *end = NULL;
    unsigned long long id = ids ? strtoull(ids, &end, 10) : 0;
    json_t *nd = json_object_get(o, "n_dst"), *nt = json_object_get(o, "n_tokens");
    if (!ids || !end || *end || !json_is_integer(nd) || !json_is_integer(nt) ||
        json_integer_value(nd) < 0 || json_integer_value(nd) > (1 << 24) || json_integer_value(nt) < 1) {
        conn_fail(a, c, "malformed request");
        return;
    }
    c->id = id;
    c->context_first = json_is_true(json_object_get(o, "context_first"));
    c->n_dst = (int)json_integer_value(nd);
    c->n_tokens = (int)json_integer_value(nt);
    const char *tp = json_string_value(json_object_get(o, "tp"));
    /* both sides on the same transport (ucx, cuda_ipc), else the TCP stream */
    c->ucx = a->tp && tp && !strcmp(tp, a->tp->ops->name);
    bool peer_dev = tp && !strcmp(tp, "cuda_ipc");
    if (a->device_pool != peer_dev) { /* GPU pool on one side only: never stream device memory */
        const char *host_tp = a->device_pool ? (tp ? tp : "tcp") : (a->tp ? a->tp->ops->name : "tcp");
        snprintf(why, sizeof why, "KV transports do not match: context %s (%s KV pool), generation %s (%s KV "
                 "pool); pair --backend cuda workers with each other", a->device_pool ? "cuda_ipc" : host_tp,
                 a->device_pool ? "GPU" : "host", a->device_pool ? host_tp : "cuda_ipc", a->device_pool ? "host" : "GPU");
        KV_WARN("kv transfer: refusing a receiver for %llu: %s", id, why);
        conn_fail(a, c, why);
        agent_refuse_offer(a, id, why);
        return;
    }
    if (kvx_page_table_from_json(json_object_get(o, "pt"), &c->peer_pt, why, sizeof why) != KV_OK) {
        conn_fail(a, c, why);
        return;
    }
    struct kvx_map m; /* refuse a mismatched receiver at the handshake, before any byte moves */
    if (kvx_page_table_match(&c->peer_pt, &a->pt, &m, why, sizeof why) != KV_OK) {
        KV_WARN("kv transfer: refusing a receiver for %llu: %s", id, why);
        conn_fail(a, c, why);
        agent_refuse_offer(a, id, why); /* the KV can never reach it: unpin now */
        return;
    }
    kvx_map_free(&m);
    c->t_start_ns = kv_now_ns(); /* the stale timer starts at the first REQ */
    agent_stale_sweep(a, c->t_start_ns); /* (before this one is stored: it is fresh anyway) */
    c->st = CS_WAIT_OFFER;
    if (a->cfg.faults.drop_ready) {
        c->ignored = true;
        return;
    }
    struct offer *of = agent_find_offer(a, id);
    if (of && !of->conn) {
        conn_serve(a, c, of);
        return;
    }
    int ended = agent_was_finished(a, id);
    if (ended == 2 && !of) { /* cancelled here (the router released it): the receiver's leg
                              * is a cancellation, not a failure */
        conn_cancel(a, c);
        return;
    }
    if (ended || of) {
        conn_fail(a, c, "this KV was already sent, or its send failed or was cancelled");
        return;
    }
    /* no offer yet: kept until one comes or the stale sweep (agent.c) */
}

/* ---------------------------------------------------------------- I/O */

short conn_events(const struct conn *c) {
    if (c->st == CS_CONNECTING) return POLLOUT;
    short ev = POLLIN;
    if (c->out.len > c->out_off || c->st == CS_SEND_DATA) ev |= POLLOUT;
    return ev;
}

static void handle_frame(struct kvx_agent *a, struct conn *c) {
    json_t *o = json_loadb((const char *)c->msg, c->msg_len, 0, NULL);
    const char *t = json_string_value(json_object_get(o, "t"));
    const char *msg = json_string_value(json_object_get(o, "msg"));
    char why[300];
    if (!t) {
        if (c->is_recv) recv_done(a, c, KV_EIO, "KV transfer: malformed message from %s", c->peer);
        else send_done(a, c, KV_EIO, "malformed message from the receiver");
        conn_close(c);
    } else if (!strcmp(t, "cancel")) {
        if (c->is_recv) recv_done(a, c, KV_ECANCELLED, "cancelled by the context worker%s", "");
        else send_done(a, c, KV_ECANCELLED, "cancelled by the generation worker");
        conn_close(c);
    } else if (!strcmp(t, "failed")) {
        if (c->is_recv) recv_done(a, c, KV_EIO, "the context worker refused: %s", msg ? msg : "?");
        else send_done(a, c, KV_EIO, msg ? msg : "the receiver failed");
        conn_close(c);
    } else if (c->is_recv && c->st == CS_REQ_SENT && !strcmp(t, "ready")) {
        kv_status st = on_ready(a, c, o, why, sizeof why);
        if (st == KV_OK && a->cfg.faults.fail_read) {
            st = KV_EIO;
            snprintf(why, sizeof why, "injected read failure (KVSERVE_KVX_FAULT=fail_read)");
        }
        if (st != KV_OK) {
            recv_done(a, c, st, "KV transfer: %s", why);
            conn_fail(a, c, why);
        } else if (c->total == 0) {
            recv_finish(a, c);
        } else {
            c->st = CS_RECV_DATA;
        }
    } else if (!c->is_recv && c->st == CS_ACCEPTED && !strcmp(t, "req")) {
        on_req(a, c, o);
    } else if (!c->is_recv && c->st == CS_ACCEPTED && !strcmp(t, "cancel_id")) {
        const char *ids = json_string_value(json_object_get(o, "id"));
        char *end = NULL;
        unsigned long long id = ids ? strtoull(ids, &end, 10) : 0;
        if (ids && end && !*end) {
            KV_DEBUG("kv transfer: the receiver of %llu gave up before asking", id);
            agent_cancel_local(a, id);
        }
        conn_close(c);
    } else if (!c->is_recv && c->st == CS_WAIT_DONE && !strcmp(t, "done")) {
        send_done(a, c, KV_OK, NULL);
        conn_close(c);
    } else {
        if (c->is_recv) recv_done(a, c, KV_EIO, "KV transfer: unexpected message '%s'", t);
        else send_done(a, c, KV_EIO, "unexpected message from the receiver");
        conn_fail(a, c, "protocol error");
    }
    json_decref(o);
    free(c->msg);
    c->msg = NULL;
    c->msg_len = c->msg_got = c->hdr_got = 0;
}

/* The peer closed or the socket failed. */
static void on_eof(struct kvx_agent *a, struct conn *c, const char *what) {
    if (c->is_recv) {
        if (c->st != CS_DONE_SENT)
            recv_done(a, c, KV_EIO, "KV transfer: the context worker closed the connection (%s)", what);
    } else if (c->offer) {
        send_done(a, c, KV_EIO, c->st == CS_WAIT_DONE ? "the receiver closed before DONE"
                                                      : "the receiver closed while data was sent");
    }
    conn_close(c);
}

/* The next pieces of the byte stream (from the current position) as an iovec. */
static int runs_iov(const struct conn *c, struct iovec *iov) {
    int n = 0;
    for (int i = c->run_i; i < c->n_runs && n < IOV_MAX_BATCH; i++) {
        size_t off = i == c->run_i ? c->run_off : 0;
        iov[n++] = (struct iovec){c->runs[i].p + off, c->runs[i].len - off};
    }
    return n;
}

/* n more bytes of the stream moved. */
static void runs_advance(struct conn *c, size_t n) {
    c->moved += (uint64_t)n;
    while (n) {
        size_t room = c->runs[c->run_i].len - c->run_off;
        size_t k = n < room ? n : room;
        c->run_off += k;
        n -= k;
        if (c->run_off == c->runs[c->run_i].len) c->run_i++, c->run_off = 0;
    }
}

static void do_read(struct kvx_agent *a, struct conn *c) {
    for (int guard = 0; guard < 256 && c->st != CS_CLOSED; guard++) {
        if (c->st == CS_RECV_DATA && !c->ucx) {
            struct iovec iov[IOV_MAX_BATCH];
            int n = runs_iov(c, iov);
            ssize_t r = readv(c->fd, iov, n);
            if (r == 0) return on_eof(a, c, "EOF while reading KV bytes");
            if (r < 0) {
                if (errno == EAGAIN || errno == EINTR) return;
                return on_eof(a, c, strerror(errno));
            }
            runs_advance(c, (size_t)r);
            if (c->moved == c->total) {
                recv_finish(a, c);
                return;
            }
            continue;
        }
        /* frames */
        if (c->hdr_got < 4) {
            ssize_t r = recv(c->fd, c->hdr + c->hdr_got, 4 - c->hdr_got, 0);
            if (r == 0) return on_eof(a, c, "EOF");
            if (r < 0) {
                if (errno == EAGAIN || errno == EINTR) return;
                return on_eof(a, c, strerror(errno));
            }
            c->hdr_got += (size_t)r;
            if (c->hdr_got < 4) continue;
            c->msg_len = (size_t)c->hdr[0] << 24 | (size_t)c->hdr[1] << 16 | (size_t)c->hdr[2] << 8 | c->hdr[3];
            /* (a sender still streaming may get the receiver's cancel / failed: handled) */
            if (c->msg_len == 0 || c->msg_len > KVX_MAX_FRAME || c->st == CS_DONE_SENT) {
                if (c->st == CS_DONE_SENT) return on_eof(a, c, "data after the end");
                if (c->is_recv) recv_done(a, c, KV_EIO, "KV transfer: bad frame from %s", c->peer);
                else send_done(a, c, KV_EIO, "bad frame from the receiver");
                conn_close(c);
                return;
            }
            c->msg = kv_malloc(c->msg_len);
            c->msg_got = 0;
            if (!c->msg) return on_eof(a, c, "out of memory");
        }
        ssize_t r = recv(c->fd, c->msg + c->msg_got, c->msg_len - c->msg_got, 0);
        if (r == 0) return on_eof(a, c, "EOF");
        if (r < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            return on_eof(a, c, strerror(errno));
        }
        c->msg_got += (size_t)r;
        if (c->msg_got == c->msg_len) handle_frame(a, c);
    }
}

static void do_write(struct kvx_agent *a, struct conn *c) {
    while (c->out.len > c->out_off) {
        ssize_t w = send(c->fd, c->out.data + c->out_off, c->out.len - c->out_off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            return on_eof(a, c, strerror(errno));
        }
        c->out_off += (size_t)w;
    }
    c->out.len = c->out_off = 0;
    if (c->close_after_flush) {
        conn_close(c);
        return;
    }
    if (c->st != CS_SEND_DATA) return;
    for (int guard = 0; guard < 1024 && c->moved < c->total; guard++) {
        struct iovec iov[IOV_MAX_BATCH];
        int n = runs_iov(c, iov);
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            int e = errno;
            /* the receiver may have said why before it closed (failed / cancel): read that
             * first so the completion carries its reason, not just "closed" */
            do_read(a, c);
            if (c->st == CS_CLOSED) return;
            return on_eof(a, c, strerror(e));
        }
        runs_advance(c, (size_t)w);
    }
    if (c->moved == c->total) c->st = CS_WAIT_DONE;
}

void conn_io(struct kvx_agent *a, struct conn *c, short revents) {
    if (c->start_at_ns) { /* delayed REQ (fault injection): connect now */
        c->start_at_ns = 0;
        char why[256];
        if (start_connect(a, c, why, sizeof why) != KV_OK) {
            recv_done(a, c, KV_EIO, "KV transfer: %s", why);
            conn_close(c);
        }
        return;
    }
    if (c->st == CS_CONNECTING) {
        int e = 0;
        socklen_t l = sizeof e;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &e, &l) != 0) e = errno;
        if (e == EINPROGRESS) return;
        if (e) {
            char why[256];
            snprintf(why, sizeof why, "cannot connect to the context worker at %s: %s", c->peer, strerror(e));
            recv_done(a, c, KV_EIO, "KV transfer: %s", why);
            conn_close(c);
            return;
        }
        c->st = CS_REQ_SENT;
    }
    if (revents & (POLLIN | POLLERR | POLLHUP)) do_read(a, c);
    if (c->st != CS_CLOSED && (revents & POLLOUT || c->out.len > c->out_off)) do_write(a, c);
}
