/*
 * The UCX data-plane transport (transport.h): one UCP context + one worker (single-thread
 * mode, driven by the agent's transfer thread), regions registered with ucp_mem_map, reads
 * are ucp_get_nbx per fragment with a per-read completion counter.
 *
 * Descriptor (the bytes expose / expose_staging append; all integers little-endian): one
 * record per region,
 *   "KVXU" | u8 version (1) | u8 region (0 pool, 1 staging) | u16 0 | u32 addr_len |
 *   u32 rkey_len | u64 base | u64 len | addr bytes | rkey bytes | u64 FNV-1a of all before
 * Records concatenate: pass the same kv_buf to expose and expose_staging (or concatenate the
 * two) and connect() takes all of them. The checksum keeps random / bit-flipped bytes away
 * from UCX's own address and rkey parsers, which do not validate their input.
 *
 * UCX settings: UCX_* environment variables are honoured (UCX_TLS, UCX_NET_DEVICES, ...).
 * When UCX_NET_DEVICES is not set, the device is picked from `host`: "127.x"/"localhost" ->
 * "lo", an address of a local interface -> that interface; otherwise UCX's default (all).
 *
 * RMA over TCP (UCX_TLS=tcp) is emulated by UCX: the exposing side's worker must progress
 * for reads to complete. The agent calls progress() on both sides; so do the tests. With UCX
 * 1.13 this holds on one host too: ucp_get of malloc'd memory is "software emulation" over the
 * sysv/posix shared-memory lanes (UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y shows it; CMA is used
 * only by tag/AM rendezvous), so a read never completes while the exposing worker sleeps: it
 * wakes on the event fd (below), and its scheduling bounds the throughput on a busy host.
 *
 * Peer failure: endpoints use UCP_ERR_HANDLING_MODE_NONE by default, because UCX 1.13 keeps
 * shared memory and CMA off endpoints in PEER mode (keepalive): in PEER mode a same-host read
 * goes over tcp/lo at about 0.6-0.9 GB/s instead of 6-9 GB/s through CMA (bench_transfer).
 * So the transport bounds every read itself: a read not finished after
 * KVSERVE_UCX_READ_TIMEOUT_MS (default 30000) fails with KV_EIO "read timed out", and its peer
 * is marked failed and its endpoint force-closed (further reads: KV_EIO; disconnect frees it).
 * KVSERVE_UCX_ERR_MODE=peer selects PEER mode (UCX reports a dead peer by itself, typically
 * within seconds: "Endpoint timeout"; set it on both sides), at that cost.
 *
 * event_fd: the worker's wakeup fd. progress() arms it whenever it returns with no live read,
 * so a caller that poll()s it after progress() wakes on the next UCX event.
 */
#ifdef KVSERVE_HAVE_UCX
#include "transport.h"
#include "../base/le.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

#define UCXT_MAGIC "KVXU"
#define UCXT_VERSION 1
#define UCXT_HDR 32           /* magic..len */
#define UCXT_MAX_ADDR (1u << 20)
#define UCXT_MAX_RKEY (1u << 20)
#define UCXT_CLOSE_WAIT_MS 2000

struct ucxt_region {
    bool exposed;
    void *base;
    size_t len;
    ucp_mem_h memh;
    void *rkey_buf;
    size_t rkey_len;
};

struct ucxt_read;

struct ucxt {
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_address_t *addr;
    size_t addr_len;
    int efd;
    struct ucxt_region regions[2];
    struct ucxt_read *done_head, *done_tail; /* finished reads, not yet reported */
    struct ucxt_read *live_head, *live_tail; /* posted, not finished (FIFO = deadline order) */
    struct ucxt_peer *peers;                 /* all connected peers (for destroy) */
    int live_reads;                          /* posted, not finished, not yet reported */
    ucp_err_handling_mode_t err_mode;
    uint64_t read_timeout_ns;
};

struct kvx_peer {
    struct ucxt *t;
    ucp_ep_h ep;
    bool failed;
    char why[128];
    struct {
        bool present;
        uint64_t base, len;
        ucp_rkey_h rkey;
    } r[2];
    struct ucxt_peer *self;
};

struct ucxt_peer {
    struct kvx_peer p;
    struct ucxt_peer *next, *prev;
};

struct ucxt_read {
    struct ucxt *t;
    struct kvx_peer *peer;  /* NULL once the peer is gone */
    uint64_t deadline_ns;
    struct ucxt_read *lprev, *lnext; /* live list */
    bool reported;          /* timed out: reported already, kept until UCX lets go of it */
    uint64_t cookie;
    int outstanding;   /* gets in flight + 1 while posting */
    kv_status status;
    char message[128];
    struct ucxt_read *next;
};

static struct ucxt *T(kvx_transport_t *t) { return (struct ucxt *)t->ctx; }

/* ---- little-endian helper (the others: ../base/le.h) ---- */
static void put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

static kv_status ucs_err(kv_status s, char *err, size_t errlen, const char *what,
                         ucs_status_t st) {
    return kv_errf(s, err, errlen, "ucx transport: %s: %s", what, ucs_status_string(st));
}

/* ---- completions ---- */
static void read_finish(struct ucxt_read *r) {
    struct ucxt *t = r->t;
    if (r->lprev) r->lprev->lnext = r->lnext;
    else t->live_head = r->lnext;
    if (r->lnext) r->lnext->lprev = r->lprev;
    else t->live_tail = r->lprev;
    if (r->reported) { /* a timed-out read whose gets finally let go */
        free(r);
        return;
    }
    t->live_reads--;
    r->next = NULL;
    if (t->done_tail) t->done_tail->next = r;
    else t->done_head = r;
    t->done_tail = r;
}

static void read_put(struct ucxt_read *r) {
    if (--r->outstanding == 0) read_finish(r);
}

static void read_fail(struct ucxt_read *r, kv_status s, const char *fmt, const char *arg) {
    if (r->status != KV_OK) return; /* the first error sticks */
    r->status = s;
    snprintf(r->message, sizeof r->message, fmt, arg);
}

static void get_cb(void *request, ucs_status_t status, void *user) {
    struct ucxt_read *r = user;
    if (status != UCS_OK)
        read_fail(r, status == UCS_ERR_CANCELED ? KV_ECANCELLED : KV_EIO,
                  "ucx transport: get failed: %s", ucs_status_string(status));
    ucp_request_free(request);
    read_put(r);
}

/* ---- expose ---- */
static kv_status append_record(struct ucxt *u, int region, kv_buf *desc, char *err,
                               size_t errlen) {
    struct ucxt_region *rg = &u->regions[region];
    size_t n = UCXT_HDR + u->addr_len + rg->rkey_len + 8;
    uint8_t *p = kv_malloc(n);
    if (!p) return kv_errf(KV_ENOMEM, err, errlen, "ucx transport: out of memory");
    memcpy(p, UCXT_MAGIC, 4);
    p[4] = UCXT_VERSION;
    p[5] = (uint8_t)region;
    put_u16(p + 6, 0);
    kv_put_le32(p + 8, (uint32_t)u->addr_len);
    kv_put_le32(p + 12, (uint32_t)rg->rkey_len);
    kv_put_le64(p + 16, (uint64_t)(uintptr_t)rg->base);
    kv_put_le64(p + 24, (uint64_t)rg->len);
    memcpy(p + UCXT_HDR, u->addr, u->addr_len);
    memcpy(p + UCXT_HDR + u->addr_len, rg->rkey_buf, rg->rkey_len);
    kv_put_le64(p + n - 8, kv_fnv1a64(p, n - 8));
    kv_status s = kv_buf_append(desc, p, n);
    free(p);
    if (s != KV_OK) return kv_errf(s, err, errlen, "ucx transport: out of memory");
    return KV_OK;
}

static kv_status expose_region(kvx_transport_t *t, int region, void *base, size_t len,
                               kv_buf *desc, char *err, size_t errlen) {
    struct ucxt *u = T(t);
    struct ucxt_region *rg = &u->regions[region];
    const char *what = region ? "expose_staging" : "expose";
    if (!desc || (!base && len))
        return kv_errf(KV_EINVAL, err, errlen, "ucx transport: %s: NULL buffer", what);
    if (rg->exposed)
        return kv_errf(KV_EINVAL, err, errlen, "ucx transport: %s: region %d already exposed",
                       what, region);
    if (len == 0) {
        /* Nothing to register: an empty region; every non-empty read of it is refused. */
        rg->exposed = true;
        rg->base = base;
        rg->len = 0;
    } else {
        ucp_mem_map_params_t mp = {
            .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            .address = base,
            .length = len,
        };
        ucs_status_t st = ucp_mem_map(u->ctx, &mp, &rg->memh);
        if (st != UCS_OK) return ucs_err(KV_EIO, err, errlen, "ucp_mem_map", st);
        void *rk = NULL;
        size_t rkl = 0;
        st = ucp_rkey_pack(u->ctx, rg->memh, &rk, &rkl);
        if (st != UCS_OK) {
            ucp_mem_unmap(u->ctx, rg->memh);
            rg->memh = NULL;
            return ucs_err(KV_EIO, err, errlen, "ucp_rkey_pack", st);
        }
        rg->rkey_buf = rk;
        rg->rkey_len = rkl;
        rg->base = base;
        rg->len = len;
        rg->exposed = true;
    }
    size_t before = desc->len;
    kv_status s = append_record(u, region, desc, err, errlen);
    if (s != KV_OK) {
        desc->len = before;
        if (rg->memh) {
            ucp_rkey_buffer_release(rg->rkey_buf);
            ucp_mem_unmap(u->ctx, rg->memh);
        }
        memset(rg, 0, sizeof *rg);
    }
    return s;
}

static kv_status ucxt_expose(kvx_transport_t *t, void *base, size_t len, kv_buf *desc, char *err,
                             size_t errlen) {
    return expose_region(t, 0, base, len, desc, err, errlen);
}

static kv_status ucxt_expose_staging(kvx_transport_t *t, void *base, size_t len, kv_buf *desc,
                                     char *err, size_t errlen) {
    return expose_region(t, 1, base, len, desc, err, errlen);
}

/* ---- connect ---- */
static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    struct kvx_peer *p = arg;
    if (!p->failed)
        snprintf(p->why, sizeof p->why, "ucx transport: peer failed: %s",
                 ucs_status_string(status));
    p->failed = true;
}

static void peer_release(struct ucxt *u, struct kvx_peer *p);

static kv_status ucxt_connect(kvx_transport_t *t, const void *desc, size_t len, kvx_peer_t **out,
                              char *err, size_t errlen) {
    struct ucxt *u = T(t);
    if (!out) return kv_errf(KV_EINVAL, err, errlen, "ucx transport: connect: NULL out");
    *out = NULL;
    if (!desc || len == 0)
        return kv_errf(KV_EINVAL, err, errlen, "ucx transport: connect: empty descriptor");
    const uint8_t *d = desc;
    /* Pass 1: validate every record before handing any byte to UCX. */
    struct rec {
        int region;
        const uint8_t *addr, *rkey;
        uint32_t addr_len, rkey_len;
        uint64_t base, len;
    } recs[2];
    int nrec = 0;
    size_t off = 0;
    while (off < len) {
        size_t left = len - off;
        const uint8_t *p = d + off;
        if (left < UCXT_HDR + 8)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor truncated at byte "
                           "%zu (%zu bytes left, a record needs >= %d)", off, left, UCXT_HDR + 8);
        if (memcmp(p, UCXT_MAGIC, 4) != 0)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor byte %zu: not a "
                           "UCX transport record (bad magic)", off);
        if (p[4] != UCXT_VERSION)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor version %u (this "
                           "build reads %d)", p[4], UCXT_VERSION);
        if (p[5] > 1)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor region %u (0 or 1)",
                           p[5]);
        uint32_t al = kv_get_le32(p + 8), rl = kv_get_le32(p + 12);
        if (al == 0 || al > UCXT_MAX_ADDR || rl > UCXT_MAX_RKEY)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor lengths out of "
                           "range (address %u, rkey %u bytes)", al, rl);
        size_t n = (size_t)UCXT_HDR + al + rl + 8;
        if (n > left)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor truncated (record "
                           "of %zu bytes, %zu left)", n, left);
        if (kv_fnv1a64(p, n - 8) != kv_get_le64(p + n - 8))
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor checksum mismatch "
                           "(corrupted bytes)");
        uint64_t rbase = kv_get_le64(p + 16), rlen = kv_get_le64(p + 24);
        if (rlen && (rl == 0 || rbase + rlen < rbase))
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor region %u: bad "
                           "range or missing rkey", p[5]);
        for (int i = 0; i < nrec; i++) {
            if (recs[i].region == p[5])
                return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor has region %u "
                               "twice", p[5]);
            if (recs[i].addr_len != al || memcmp(recs[i].addr, p + UCXT_HDR, al) != 0)
                return kv_errf(KV_EINVAL, err, errlen, "ucx transport: descriptor records come "
                               "from different workers");
        }
        recs[nrec++] = (struct rec){p[5], p + UCXT_HDR, p + UCXT_HDR + al, al, rl, rbase, rlen};
        off += n;
    }

    struct ucxt_peer *node = kv_calloc(1, sizeof *node);
    if (!node) return kv_errf(KV_ENOMEM, err, errlen, "ucx transport: out of memory");
    struct kvx_peer *pr = &node->p;
    pr->t = u;
    pr->self = node;
    /* UCX may keep a pointer into the address during ep creation only; copy to be safe with
     * unaligned input. */
    void *addr = kv_malloc(recs[0].addr_len);
    if (!addr) {
        free(node);
        return kv_errf(KV_ENOMEM, err, errlen, "ucx transport: out of memory");
    }
    memcpy(addr, recs[0].addr, recs[0].addr_len);
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = addr,
        .err_mode = u->err_mode,
        .err_handler = {.cb = ep_err_cb, .arg = pr},
    };
    ucs_status_t st = ucp_ep_create(u->worker, &ep, &pr->ep);
    free(addr);
    if (st != UCS_OK) {
        free(node);
        return ucs_err(KV_EIO, err, errlen, "connect (ucp_ep_create)", st);
    }
    /* Link first so peer_release can undo everything from here on. */
    node->next = u->peers;
    if (u->peers) u->peers->prev = node;
    u->peers = node;
    for (int i = 0; i < nrec; i++) {
        int r = recs[i].region;
        pr->r[r].present = true;
        pr->r[r].base = recs[i].base;
        pr->r[r].len = recs[i].len;
        if (recs[i].len == 0) continue;
        void *rk = kv_malloc(recs[i].rkey_len);
        if (!rk) {
            peer_release(u, pr);
            return kv_errf(KV_ENOMEM, err, errlen, "ucx transport: out of memory");
        }
        memcpy(rk, recs[i].rkey, recs[i].rkey_len);
        st = ucp_ep_rkey_unpack(pr->ep, rk, &pr->r[r].rkey);
        free(rk);
        if (st != UCS_OK) {
            pr->r[r].rkey = NULL;
            peer_release(u, pr);
            return ucs_err(KV_EIO, err, errlen, "connect (rkey unpack)", st);
        }
    }
    *out = pr;
    return KV_OK;
}

/* Force-closes the endpoint (outstanding gets complete with UCS_ERR_CANCELED) and destroys
 * the rkeys; the peer stays allocated (failed) until disconnect. */
static void peer_close_ep(struct ucxt *u, struct kvx_peer *p) {
    for (int r = 0; r < 2; r++)
        if (p->r[r].rkey) {
            ucp_rkey_destroy(p->r[r].rkey);
            p->r[r].rkey = NULL;
        }
    if (!p->ep) return;
    ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t req = ucp_ep_close_nbx(p->ep, &cp);
    p->ep = NULL;
    if (UCS_PTR_IS_PTR(req)) {
        uint64_t end = kv_now_ns() + (uint64_t)UCXT_CLOSE_WAIT_MS * 1000000ull;
        while (ucp_request_check_status(req) == UCS_INPROGRESS && kv_now_ns() < end)
            ucp_worker_progress(u->worker);
        if (ucp_request_check_status(req) == UCS_INPROGRESS)
            KV_WARN("ucx transport: endpoint close did not finish in %d ms", UCXT_CLOSE_WAIT_MS);
        ucp_request_free(req);
    }
}

/* A read passed its deadline: fail every live read of its peer and close the endpoint (the
 * peer stays failed; the agent disconnects it). */
static void peer_timeout(struct ucxt *u, struct kvx_peer *p) {
    char why[128];
    snprintf(why, sizeof why, "ucx transport: read timed out after %llu ms (peer not "
             "answering)", (unsigned long long)(u->read_timeout_ns / 1000000));
    for (struct ucxt_read *r = u->live_head; r; r = r->lnext)
        if (r->peer == p) read_fail(r, KV_EIO, "%s", why);
    if (!p->failed) snprintf(p->why, sizeof p->why, "%s", why);
    p->failed = true;
    peer_close_ep(u, p);
    /* Gets that even a forced close did not complete (error mode none: UCX does not cancel
     * them): report the read now and keep its record until UCX calls back (or destroy). */
    for (struct ucxt_read *r = u->live_head; r; r = r->lnext) {
        if (r->peer != p || r->reported) continue;
        struct ucxt_read *c = kv_calloc(1, sizeof *c);
        if (!c) continue; /* stays live; retried on the next progress */
        c->t = u;
        c->cookie = r->cookie;
        c->status = r->status;
        snprintf(c->message, sizeof c->message, "%s", r->message);
        r->reported = true;
        r->peer = NULL;
        u->live_reads--;
        c->next = NULL;
        if (u->done_tail) u->done_tail->next = c;
        else u->done_head = c;
        u->done_tail = c;
    }
}

/* Closes the endpoint, unlinks and frees the peer. */
static void peer_release(struct ucxt *u, struct kvx_peer *p) {
    peer_close_ep(u, p);
    for (struct ucxt_read *r = u->live_head; r; r = r->lnext)
        if (r->peer == p) r->peer = NULL;
    struct ucxt_peer *n = p->self;
    if (n->prev) n->prev->next = n->next;
    else u->peers = n->next;
    if (n->next) n->next->prev = n->prev;
    free(n);
}

static void ucxt_disconnect(kvx_transport_t *t, kvx_peer_t *p) {
    if (!p) return;
    peer_release(T(t), p);
}

/* ---- read ---- */
static kv_status ucxt_read(kvx_transport_t *t, kvx_peer_t *p, int region,
                           const struct kvx_frag *frags, int n, uint64_t cookie, char *err,
                           size_t errlen) {
    struct ucxt *u = T(t);
    if (!p) return kv_errf(KV_EINVAL, err, errlen, "ucx transport: read: NULL peer");
    if (region < 0 || region > 1)
        return kv_errf(KV_EINVAL, err, errlen, "ucx transport: read: region %d (0 or 1)",
                       region);
    if (n < 0 || (n > 0 && !frags))
        return kv_errf(KV_EINVAL, err, errlen, "ucx transport: read: bad fragment list (n=%d)",
                       n);
    if (p->failed) return kv_errf(KV_EIO, err, errlen, "%s", p->why);
    if (!p->r[region].present)
        return kv_errf(KV_EINVAL, err, errlen, "ucx transport: read: the peer did not expose "
                       "region %d", region);
    uint64_t rlen = p->r[region].len;
    for (int i = 0; i < n; i++) {
        const struct kvx_frag *f = &frags[i];
        if (f->len == 0) continue;
        if (!f->local)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: read: fragment %d has no "
                           "local buffer", i);
        if (f->remote_off > rlen || f->len > rlen - f->remote_off)
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: read: fragment %d [%llu, "
                           "+%zu) is outside region %d (%llu bytes)", i,
                           (unsigned long long)f->remote_off, f->len, region,
                           (unsigned long long)rlen);
    }
    struct ucxt_read *r = kv_calloc(1, sizeof *r);
    if (!r) return kv_errf(KV_ENOMEM, err, errlen, "ucx transport: out of memory");
    r->t = u;
    r->peer = p;
    r->deadline_ns = kv_now_ns() + u->read_timeout_ns;
    r->cookie = cookie;
    r->outstanding = 1;
    u->live_reads++;
    r->lprev = u->live_tail;
    if (u->live_tail) u->live_tail->lnext = r;
    else u->live_head = r;
    u->live_tail = r;
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = get_cb,
        .user_data = r,
    };
    for (int i = 0; i < n && r->status == KV_OK; i++) {
        /* Merge runs that are contiguous on both sides into one get. */
        uint64_t roff = frags[i].remote_off;
        char *local = frags[i].local;
        size_t len = frags[i].len;
        while (i + 1 < n && frags[i + 1].len &&
               frags[i + 1].remote_off == roff + len && (char *)frags[i + 1].local == local + len) {
            len += frags[i + 1].len;
            i++;
        }
        if (len == 0) continue;
        ucs_status_ptr_t req = ucp_get_nbx(p->ep, local, len, p->r[region].base + roff,
                                           p->r[region].rkey, &rp);
        if (req == NULL) continue; /* completed in place */
        if (UCS_PTR_IS_ERR(req)) {
            read_fail(r, KV_EIO, "ucx transport: get failed: %s",
                      ucs_status_string(UCS_PTR_STATUS(req)));
            break;
        }
        r->outstanding++;
    }
    read_put(r); /* the posting reference; completions come from progress() */
    return KV_OK;
}

/* ---- progress ---- */
static int drain(struct ucxt *u, struct kvx_completion *out, int cap) {
    int k = 0;
    while (k < cap && u->done_head) {
        struct ucxt_read *r = u->done_head;
        u->done_head = r->next;
        if (!u->done_head) u->done_tail = NULL;
        out[k].cookie = r->cookie;
        out[k].status = r->status;
        snprintf(out[k].message, sizeof out[k].message, "%s", r->message);
        k++;
        free(r);
    }
    return k;
}

static int ucxt_progress(kvx_transport_t *t, struct kvx_completion *out, int cap,
                         int timeout_ms) {
    struct ucxt *u = T(t);
    if (cap < 0 || (cap > 0 && !out)) return KV_EINVAL;
    uint64_t end = kv_now_ns() + (timeout_ms > 0 ? (uint64_t)timeout_ms * 1000000ull : 0);
    int busy = 0;
    for (;;) {
        while (ucp_worker_progress(u->worker)) {
        }
        if (u->live_reads > 0) {
            uint64_t now = kv_now_ns();
            for (struct ucxt_read *r = u->live_head; r; r = r->lnext)
                if (!r->reported && r->peer && now > r->deadline_ns) {
                    peer_timeout(u, r->peer);
                    break; /* the list changed; the rest is checked on the next round */
                }
        }
        if (u->done_head && cap > 0) return drain(u, out, cap);
        /* Idle: arm the event fd before returning or sleeping, so that a caller's poll() on
         * event_fd() (the agent's loop) wakes on the next event. */
        bool armed = false;
        if (u->live_reads == 0 && u->efd >= 0) {
            ucs_status_t st = ucp_worker_arm(u->worker);
            if (st == UCS_ERR_BUSY) {
                if (timeout_ms > 0 || ++busy < 16) continue; /* events pending: progress again */
                return 0;
            }
            if (st != UCS_OK) return KV_EIO;
            armed = true;
        }
        uint64_t now = kv_now_ns();
        if (timeout_ms <= 0 || now >= end) return 0;
        /* Live reads (shared memory / CMA gets complete only by progressing): spin. */
        if (!armed) {
            if (u->live_reads == 0) { /* no event fd: 1 ms naps */
                struct timespec ts = {0, 1000000};
                nanosleep(&ts, NULL);
            }
            continue;
        }
        uint64_t left_ms = (end - now + 999999) / 1000000;
        struct pollfd pfd = {.fd = u->efd, .events = POLLIN};
        int rc = poll(&pfd, 1, (int)(left_ms > 1000 ? 1000 : left_ms));
        if (rc < 0 && errno != EINTR) return KV_EIO;
    }
}

static int ucxt_event_fd(kvx_transport_t *t) { return T(t)->efd; }

/* ---- destroy ---- */
static void ucxt_destroy(kvx_transport_t *t) {
    if (!t) return;
    struct ucxt *u = T(t);
    while (u->peers) peer_release(u, &u->peers->p);
    /* Force-closed endpoints complete their gets with UCS_ERR_CANCELED; reap them. */
    uint64_t end = kv_now_ns() + (uint64_t)UCXT_CLOSE_WAIT_MS * 1000000ull;
    while (u->live_reads > 0 && kv_now_ns() < end) ucp_worker_progress(u->worker);
    while (u->done_head) {
        struct ucxt_read *r = u->done_head;
        u->done_head = r->next;
        free(r);
    }
    for (int i = 0; i < 2; i++) {
        struct ucxt_region *rg = &u->regions[i];
        if (rg->rkey_buf) ucp_rkey_buffer_release(rg->rkey_buf);
        if (rg->memh) ucp_mem_unmap(u->ctx, rg->memh);
    }
    if (u->addr) ucp_worker_release_address(u->worker, u->addr);
    if (u->worker) ucp_worker_destroy(u->worker);
    if (u->ctx) ucp_cleanup(u->ctx);
    /* Reads UCX never let go of (timed out, or not cancelled in time): UCX is gone now. */
    while (u->live_head) {
        struct ucxt_read *r = u->live_head;
        u->live_head = r->lnext;
        free(r);
    }
    free(u);
    free(t);
}

static const struct kvx_transport_ops ucxt_ops = {
    .name = "ucx",
    .expose = ucxt_expose,
    .expose_staging = ucxt_expose_staging,
    .connect = ucxt_connect,
    .disconnect = ucxt_disconnect,
    .read = ucxt_read,
    .progress = ucxt_progress,
    .event_fd = ucxt_event_fd,
    .destroy = ucxt_destroy,
};

bool kvx_transport_ucx_available(void) { return true; }

/* The network device for `host` (see the top of the file) into dev; false: leave UCX's
 * default. */
static bool pick_net_device(const char *host, char *dev, size_t devlen) {
    if (!host || !*host) return false;
    if (strncmp(host, "127.", 4) == 0 || strcmp(host, "localhost") == 0 ||
        strcmp(host, "::1") == 0) {
        snprintf(dev, devlen, "lo");
        return true;
    }
    struct in_addr a4;
    struct in6_addr a6;
    bool is4 = inet_pton(AF_INET, host, &a4) == 1;
    bool is6 = !is4 && inet_pton(AF_INET6, host, &a6) == 1;
    if (!is4 && !is6) return false;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0) return false;
    bool found = false;
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
        if (!i->ifa_addr || !i->ifa_name) continue;
        if (is4 && i->ifa_addr->sa_family == AF_INET)
            found = memcmp(&((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, &a4,
                           sizeof a4) == 0;
        else if (is6 && i->ifa_addr->sa_family == AF_INET6)
            found = memcmp(&((struct sockaddr_in6 *)(void *)i->ifa_addr)->sin6_addr, &a6,
                           sizeof a6) == 0;
        if (found) snprintf(dev, devlen, "%s", i->ifa_name);
    }
    freeifaddrs(ifs);
    return found;
}

kv_status kvx_transport_ucx_new(const char *host, kvx_transport_t **out, char *err,
                                size_t errlen) {
    if (!out) return kv_errf(KV_EINVAL, err, errlen, "ucx transport: NULL out");
    *out = NULL;
    kvx_transport_t *t = kv_calloc(1, sizeof *t);
    struct ucxt *u = kv_calloc(1, sizeof *u);
    if (!t || !u) {
        free(t);
        free(u);
        return kv_errf(KV_ENOMEM, err, errlen, "ucx transport: out of memory");
    }
    t->ops = &ucxt_ops;
    t->ctx = u;
    u->efd = -1;
    u->err_mode = UCP_ERR_HANDLING_MODE_NONE;
    u->read_timeout_ns = 30000ull * 1000000ull;
    const char *em = getenv("KVSERVE_UCX_ERR_MODE");
    if (em && *em) {
        if (!strcmp(em, "peer")) u->err_mode = UCP_ERR_HANDLING_MODE_PEER;
        else if (strcmp(em, "none")) {
            free(u);
            free(t);
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: KVSERVE_UCX_ERR_MODE=%s "
                           "(none or peer)", em);
        }
    }
    const char *to = getenv("KVSERVE_UCX_READ_TIMEOUT_MS");
    if (to && *to) {
        int64_t ms;
        if (kv_parse_i64(to, 1, 86400000, &ms) != KV_OK) {
            free(u);
            free(t);
            return kv_errf(KV_EINVAL, err, errlen, "ucx transport: KVSERVE_UCX_READ_TIMEOUT_MS="
                           "%s (1..86400000)", to);
        }
        u->read_timeout_ns = (uint64_t)ms * 1000000ull;
    }

    ucp_config_t *cfg = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        free(u);
        free(t);
        return ucs_err(KV_EIO, err, errlen, "ucp_config_read", st);
    }
    char dev[IF_NAMESIZE + 1];
    if (!getenv("UCX_NET_DEVICES") && pick_net_device(host, dev, sizeof dev)) {
        st = ucp_config_modify(cfg, "NET_DEVICES", dev);
        if (st != UCS_OK) KV_WARN("ucx transport: NET_DEVICES=%s: %s", dev, ucs_status_string(st));
    }
    ucp_params_t pp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
    };
    st = ucp_init(&pp, cfg, &u->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        u->ctx = NULL;
        ucxt_destroy(t);
        return ucs_err(KV_EIO, err, errlen, "ucp_init", st);
    }
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    st = ucp_worker_create(u->ctx, &wp, &u->worker);
    if (st != UCS_OK) {
        u->worker = NULL;
        ucxt_destroy(t);
        return ucs_err(KV_EIO, err, errlen, "ucp_worker_create", st);
    }
    st = ucp_worker_get_address(u->worker, &u->addr, &u->addr_len);
    if (st != UCS_OK) {
        u->addr = NULL;
        ucxt_destroy(t);
        return ucs_err(KV_EIO, err, errlen, "ucp_worker_get_address", st);
    }
    int fd = -1;
    if (ucp_worker_get_efd(u->worker, &fd) == UCS_OK) u->efd = fd;
    *out = t;
    return KV_OK;
}

#else
typedef int kvx_transport_ucx_unused;
#endif
