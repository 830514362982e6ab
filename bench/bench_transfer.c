/*
 * bench_transfer: KV-transfer throughput between two processes on loopback (this process and
 * a fork()ed child that exposes / sends), against the raw transports underneath.
 *
 * Rows (each: warm-up, then --reps timed repetitions; the table gives the median GB/s,
 * 1 GB = 1e9 bytes, timed on the receiving side):
 *   memcpy          memcpy of the same bytes in one process (the ceiling)
 *   raw ucx get     ucp_get_nbx of the whole region, one request   (baseline of "ucx read")
 *   raw ucx put     ucp_put_nbx of the whole region + ep flush
 *   raw ucx tag     ucp_tag_send_nbx / ucp_tag_recv_nbx of the whole region
 *   raw tcp socket  one TCP stream over 127.0.0.1, send()/recv() loops (baseline of "tcp")
 *   ucx read contig our UCX transport (transport.h): --block blocks, remote i -> local i
 *   ucx read frag   the same blocks in a shuffled remote order (no two adjacent)
 *   tcp read ...    our TCP transport, when transport_tcp.c is in the tree (else "pending")
 *   agent ucx/tcp   the whole agent (transfer.h): kvx_send_offer in the child, kvx_recv_start
 *                   here, until the receive completion; 64 MiB of 256 KiB blocks (contiguous and
 *                   shuffled destination blocks)
 * UCX rows run once per entry of --ucx-tls (UCX_TLS set in both processes before each context
 * is created; "default" = unset). Bytes are checked after the timed repetitions.
 *
 * Usage: bench_transfer [--sizes 4M,64M,512M] [--reps 5] [--warmup 2] [--block 64K]
 *                       [--ucx-tls default,tcp] [--no-agent]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "base/base.h"
#include "transfer/transfer.h"
#include "transfer/transport.h"
#ifdef KVSERVE_HAVE_UCX
#include <ucp/api/ucp.h>
#endif

#define MAX_REPS 64

enum op { OP_QUIT = 0, OP_RAW_RMA, OP_RAW_TAG, OP_TCP, OP_OURS, OP_AGENT };

struct cmd {
    int op;
    int kind;          /* OP_OURS / OP_AGENT: 0 tcp, 1 ucx */
    uint64_t size;
    uint64_t block;
    char tls[32];      /* UCX_TLS ("" = unset) */
};

static int g_ctl = -1; /* socketpair end (each side) */

static void die(const char *fmt, const char *arg) {
    fprintf(stderr, "bench_transfer: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(1);
}

static void wr(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("write failed: %s", strerror(errno));
        c += k;
        n -= (size_t)k;
    }
}

static void rd(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t k = read(fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("read failed: %s", k ? strerror(errno) : "peer closed");
        c += k;
        n -= (size_t)k;
    }
}

static void send_blob(const void *p, uint32_t n) {
    wr(g_ctl, &n, 4);
    if (n) wr(g_ctl, p, n);
}

static void *recv_blob(uint32_t *n) {
    rd(g_ctl, n, 4);
    void *p = malloc(*n ? *n : 1);
    if (!p) die("%s", "out of memory");
    if (*n) rd(g_ctl, p, *n);
    return p;
}

/* True if fd has a byte to read (no wait). */
static bool readable(int fd, int timeout_ms) {
    struct pollfd p = {fd, POLLIN, 0};
    return poll(&p, 1, timeout_ms) > 0;
}

static void set_tls(const char *tls) {
    if (tls && *tls) setenv("UCX_TLS", tls, 1);
    else unsetenv("UCX_TLS");
}

/* Pattern: 64-bit word i of the source region is pat(i). */
static uint64_t pat(uint64_t i) { return (i + 1) * 0x9E3779B97F4A7C15ull ^ 0x5bd1e995u; }

static uint8_t *alloc_touched(size_t n, bool fill) {
    uint8_t *p = NULL;
    if (posix_memalign((void **)&p, 4096, n ? n : 1)) die("%s", "out of memory");
    if (fill) {
        uint64_t *w = (uint64_t *)p;
        for (size_t i = 0; i < n / 8; i++) w[i] = pat(i);
    } else {
        memset(p, 0, n);
    }
    return p;
}

/* dst block i must hold source block perm[i] (perm NULL: identity). */
static bool check(const uint8_t *dst, size_t size, size_t block, const int *perm) {
    const uint64_t *w = (const uint64_t *)dst;
    size_t wpb = block / 8;
    for (size_t i = 0; i < size / 8; i++) {
        size_t b = i / wpb, src = perm ? (size_t)perm[b] * wpb + i % wpb : i;
        if (w[i] != pat(src)) return false;
    }
    return true;
}

/* A permutation of 0..n-1 in which no two consecutive entries are adjacent blocks. */
static int *shuffled(int n) {
    int *p = malloc(sizeof(int) * (size_t)(n ? n : 1));
    kv_rng r;
    kv_rng_seed(&r, 12345);
    for (int i = 0; i < n; i++) p[i] = i;
    for (int tries = 0; tries < 100; tries++) {
        for (int i = n - 1; i > 0; i--) {
            int j = (int)(kv_rng_next(&r) % (uint64_t)(i + 1));
            int x = p[i];
            p[i] = p[j];
            p[j] = x;
        }
        bool ok = true;
        for (int i = 1; i < n && ok; i++) ok = p[i] != p[i - 1] + 1;
        if (ok) break;
    }
    return p;
}

struct result {
    double med, lo, hi; /* GB/s; med < 0: not measured */
    bool ok;            /* bytes checked */
    char note[96];
};

static struct result summarize(double *gbps, int n, bool ok) {
    struct result r = {.med = -1, .ok = ok};
    if (n <= 0) return r;
    qsort(gbps, (size_t)n, sizeof *gbps, bench_cmp_d);
    r.med = n % 2 ? gbps[n / 2] : (gbps[n / 2 - 1] + gbps[n / 2]) / 2;
    r.lo = gbps[0];
    r.hi = gbps[n - 1];
    return r;
}

static int g_reps = 5, g_warmup = 2;

/* ================================================================ raw UCX */
#ifdef KVSERVE_HAVE_UCX
struct raw {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_address_t *addr;
    size_t addr_len;
};

static void raw_open(struct raw *r, uint64_t features, const char *tls) {
    memset(r, 0, sizeof *r);
    set_tls(tls);
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) die("%s", "ucp_config_read");
    if (!getenv("UCX_NET_DEVICES")) ucp_config_modify(cfg, "NET_DEVICES", "lo");
    ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = features};
    ucs_status_t st = ucp_init(&pp, cfg, &r->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) die("ucp_init: %s", ucs_status_string(st));
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(r->ctx, &wp, &r->w) != UCS_OK) die("%s", "ucp_worker_create");
    if (ucp_worker_get_address(r->w, &r->addr, &r->addr_len) != UCS_OK) die("%s", "address");
    unsetenv("UCX_TLS");
}

static void raw_close(struct raw *r) {
    ucp_worker_release_address(r->w, r->addr);
    ucp_worker_destroy(r->w);
    ucp_cleanup(r->ctx);
}

static ucp_ep_h raw_ep(struct raw *r, const void *addr) {
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = addr};
    ucp_ep_h e;
    if (ucp_ep_create(r->w, &ep, &e) != UCS_OK) die("%s", "ucp_ep_create");
    return e;
}

static void raw_wait(struct raw *r, ucs_status_ptr_t req, const char *what) {
    if (req == NULL) return;
    if (UCS_PTR_IS_ERR(req)) die("%s failed", what);
    while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(r->w);
    if (ucp_request_check_status(req) != UCS_OK) die("%s failed", what);
    ucp_request_free(req);
}

static void raw_ep_close(struct raw *r, ucp_ep_h e) {
    ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t req = ucp_ep_close_nbx(e, &cp);
    if (UCS_PTR_IS_PTR(req)) {
        while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(r->w);
        ucp_request_free(req);
    }
}

/* child: exposes a pattern region, progresses until the parent says stop */
static void child_raw_rma(const struct cmd *c) {
    struct raw r;
    raw_open(&r, UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP, c->tls);
    uint8_t *buf = alloc_touched(c->size, true);
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                             UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = buf, .length = c->size};
    ucp_mem_h mh;
    if (ucp_mem_map(r.ctx, &mp, &mh) != UCS_OK) die("%s", "ucp_mem_map");
    void *rk;
    size_t rkl;
    if (ucp_rkey_pack(r.ctx, mh, &rk, &rkl) != UCS_OK) die("%s", "ucp_rkey_pack");
    uint64_t base = (uint64_t)(uintptr_t)buf;
    send_blob(r.addr, (uint32_t)r.addr_len);
    send_blob(&base, 8);
    send_blob(rk, (uint32_t)rkl);
    /* The exposing side sleeps on the worker's event fd between events (as the agent and
     * the ucx transport do): RMA over tcp needs it to answer, shared memory / CMA do not. */
    int efd = -1;
    if (ucp_worker_get_efd(r.w, &efd) != UCS_OK) efd = -1;
    for (;;) {
        while (ucp_worker_progress(r.w)) {
        }
        if (efd >= 0 && ucp_worker_arm(r.w) == UCS_ERR_BUSY) continue;
        struct pollfd p[2] = {{g_ctl, POLLIN, 0}, {efd, POLLIN, 0}};
        if (poll(p, efd >= 0 ? 2 : 1, efd >= 0 ? 100 : 0) > 0 && (p[0].revents & POLLIN)) break;
    }
    char x;
    rd(g_ctl, &x, 1);
    ucp_rkey_buffer_release(rk);
    ucp_mem_unmap(r.ctx, mh);
    raw_close(&r);
    free(buf);
    wr(g_ctl, "k", 1);
}

static void child_raw_tag(const struct cmd *c) {
    struct raw r;
    raw_open(&r, UCP_FEATURE_TAG, c->tls);
    uint8_t *buf = alloc_touched(c->size, true);
    uint32_t n;
    void *paddr = recv_blob(&n);
    ucp_ep_h e = raw_ep(&r, paddr);
    free(paddr);
    ucp_request_param_t rp = {0};
    for (;;) {
        char x;
        while (!readable(g_ctl, 0)) ucp_worker_progress(r.w);
        rd(g_ctl, &x, 1);
        if (x != 'g') break;
        raw_wait(&r, ucp_tag_send_nbx(e, buf, c->size, 7, &rp), "tag send");
    }
    raw_ep_close(&r, e);
    raw_close(&r);
    free(buf);
    wr(g_ctl, "k", 1);
}

enum raw_kind { RAW_GET, RAW_PUT };

static struct result parent_raw_rma(uint64_t size, const char *tls, enum raw_kind kind) {
    struct cmd c = {.op = OP_RAW_RMA, .size = size};
    snprintf(c.tls, sizeof c.tls, "%s", tls);
    wr(g_ctl, &c, sizeof c);
    struct raw r;
    raw_open(&r, UCP_FEATURE_RMA, tls);
    uint32_t n;
    void *addr = recv_blob(&n), *bp = recv_blob(&n), *rkb = recv_blob(&n);
    uint64_t base;
    memcpy(&base, bp, 8);
    ucp_ep_h e = raw_ep(&r, addr);
    ucp_rkey_h rkey;
    if (ucp_ep_rkey_unpack(e, rkb, &rkey) != UCS_OK) die("%s", "rkey unpack");
    uint8_t *dst = alloc_touched(size, kind == RAW_PUT);
    double g[MAX_REPS];
    int ng = 0;
    ucp_request_param_t rp = {0};
    for (int it = 0; it < g_warmup + g_reps; it++) {
        uint64_t t0 = kv_now_ns();
        if (kind == RAW_GET) {
            raw_wait(&r, ucp_get_nbx(e, dst, size, base, rkey, &rp), "get");
        } else {
            raw_wait(&r, ucp_put_nbx(e, dst, size, base, rkey, &rp), "put");
            raw_wait(&r, ucp_ep_flush_nbx(e, &rp), "flush");
        }
        double s = (double)(kv_now_ns() - t0) / 1e9;
        if (it >= g_warmup) g[ng++] = (double)size / s / 1e9;
    }
    bool ok = kind == RAW_PUT || check(dst, size, size, NULL);
    ucp_rkey_destroy(rkey);
    raw_ep_close(&r, e);
    wr(g_ctl, "x", 1);
    char k;
    rd(g_ctl, &k, 1);
    raw_close(&r);
    free(addr);
    free(bp);
    free(rkb);
    free(dst);
    return summarize(g, ng, ok);
}

static struct result parent_raw_tag(uint64_t size, const char *tls) {
    struct cmd c = {.op = OP_RAW_TAG, .size = size};
    snprintf(c.tls, sizeof c.tls, "%s", tls);
    wr(g_ctl, &c, sizeof c);
    struct raw r;
    raw_open(&r, UCP_FEATURE_TAG, tls);
    send_blob(r.addr, (uint32_t)r.addr_len);
    uint8_t *dst = alloc_touched(size, false);
    double g[MAX_REPS];
    int ng = 0;
    ucp_request_param_t rp = {0};
    for (int it = 0; it < g_warmup + g_reps; it++) {
        uint64_t t0 = kv_now_ns();
        ucs_status_ptr_t req = ucp_tag_recv_nbx(r.w, dst, size, 7, (ucp_tag_t)-1, &rp);
        wr(g_ctl, "g", 1);
        raw_wait(&r, req, "tag recv");
        double s = (double)(kv_now_ns() - t0) / 1e9;
        if (it >= g_warmup) g[ng++] = (double)size / s / 1e9;
    }
    bool ok = check(dst, size, size, NULL);
    wr(g_ctl, "x", 1);
    char k;
    while (!readable(g_ctl, 0)) ucp_worker_progress(r.w);
    rd(g_ctl, &k, 1);
    raw_close(&r);
    free(dst);
    return summarize(g, ng, ok);
}
#endif

/* ================================================================ plain TCP socket */
static void child_tcp(const struct cmd *c) {
    uint8_t *buf = alloc_touched(c->size, true);
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1) ||
        getsockname(ls, (struct sockaddr *)&a, &al))
        die("tcp listen: %s", strerror(errno));
    uint16_t port = ntohs(a.sin_port);
    send_blob(&port, 2);
    int s = accept(ls, NULL, NULL);
    close(ls);
    for (;;) {
        char x;
        rd(s, &x, 1);
        if (x != 'g') break;
        wr(s, buf, c->size);
    }
    close(s);
    free(buf);
    wr(g_ctl, "k", 1);
}

static struct result parent_tcp(uint64_t size) {
    struct cmd c = {.op = OP_TCP, .size = size};
    wr(g_ctl, &c, sizeof c);
    uint32_t n;
    uint16_t *port = recv_blob(&n);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(*port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    free(port);
    if (connect(s, (struct sockaddr *)&a, sizeof a)) die("tcp connect: %s", strerror(errno));
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint8_t *dst = alloc_touched(size, false);
    double g[MAX_REPS];
    int ng = 0;
    for (int it = 0; it < g_warmup + g_reps; it++) {
        uint64_t t0 = kv_now_ns();
        wr(s, "g", 1);
        rd(s, dst, size);
        double sec = (double)(kv_now_ns() - t0) / 1e9;
        if (it >= g_warmup) g[ng++] = (double)size / sec / 1e9;
    }
    bool ok = check(dst, size, size, NULL);
    wr(s, "x", 1);
    close(s);
    char k;
    rd(g_ctl, &k, 1);
    free(dst);
    return summarize(g, ng, ok);
}

/* ================================================================ memcpy */
static struct result run_memcpy(uint64_t size) {
    uint8_t *src = alloc_touched(size, true), *dst = alloc_touched(size, false);
    double g[MAX_REPS];
    int ng = 0;
    for (int it = 0; it < g_warmup + g_reps; it++) {
        uint64_t t0 = kv_now_ns();
        memcpy(dst, src, size);
        double s = (double)(kv_now_ns() - t0) / 1e9;
        if (it >= g_warmup) g[ng++] = (double)size / s / 1e9;
    }
    bool ok = check(dst, size, size, NULL);
    free(src);
    free(dst);
    return summarize(g, ng, ok);
}

/* ================================================================ our transports */
static kv_status transport_new(int kind, kvx_transport_t **t, char *err, size_t errlen) {
    if (kind == 1) return kvx_transport_ucx_new("127.0.0.1", t, err, errlen);
#ifdef KVSERVE_HAVE_TCP_TRANSPORT
    return kvx_transport_tcp_new("127.0.0.1", t, err, errlen);
#else
    return kv_errf(KV_EUNSUPPORTED, err, errlen, "transport_tcp.c is not in this tree");
#endif
}

/* child: exposes a pattern region and drives the transport as the agent does (progress, then
 * poll on the event fd and the control socket with a 1 ms cap) until told to stop. */
static void child_ours(const struct cmd *c) {
    set_tls(c->tls);
    char err[256] = "";
    kvx_transport_t *t = NULL;
    kv_status st = transport_new(c->kind, &t, err, sizeof err);
    unsetenv("UCX_TLS");
    uint8_t *buf = alloc_touched(c->size, true);
    kv_buf d;
    kv_buf_init(&d);
    if (st == KV_OK) st = t->ops->expose(t, buf, c->size, &d, err, sizeof err);
    if (st != KV_OK) {
        send_blob(NULL, 0);
        send_blob(err, (uint32_t)strlen(err) + 1);
    } else {
        send_blob(d.data, (uint32_t)d.len);
        int efd = t->ops->event_fd ? t->ops->event_fd(t) : -1;
        for (;;) {
            struct kvx_completion comp[8];
            t->ops->progress(t, comp, 8, 0);
            struct pollfd p[2] = {{g_ctl, POLLIN, 0}, {efd, POLLIN, 0}};
            if (poll(p, efd >= 0 ? 2 : 1, 1) > 0 && (p[0].revents & POLLIN)) break;
        }
        char x;
        rd(g_ctl, &x, 1);
    }
    if (t) t->ops->destroy(t);
    kv_buf_free(&d);
    free(buf);
    wr(g_ctl, "k", 1);
}

static struct result parent_ours(int kind, uint64_t size, uint64_t block, bool frag,
                                 const char *tls) {
    struct result res = {.med = -1};
    struct cmd c = {.op = OP_OURS, .kind = kind, .size = size, .block = block};
    snprintf(c.tls, sizeof c.tls, "%s", tls);
    wr(g_ctl, &c, sizeof c);
    uint32_t n;
    void *desc = recv_blob(&n);
    if (n == 0) {
        free(desc);
        char *e = recv_blob(&n);
        snprintf(res.note, sizeof res.note, "%s", e);
        free(e);
        char k;
        rd(g_ctl, &k, 1);
        return res;
    }
    set_tls(tls);
    char err[256] = "";
    kvx_transport_t *t = NULL;
    kv_status st = transport_new(kind, &t, err, sizeof err);
    unsetenv("UCX_TLS");
    kvx_peer_t *peer = NULL;
    if (st == KV_OK) st = t->ops->connect(t, desc, n, &peer, err, sizeof err);
    int nb = (int)(size / block);
    int *perm = frag ? shuffled(nb) : NULL;
    struct kvx_frag *f = calloc((size_t)nb, sizeof *f);
    uint8_t *dst = alloc_touched(size, false);
    for (int i = 0; i < nb; i++)
        f[i] = (struct kvx_frag){(uint64_t)(perm ? perm[i] : i) * block, dst + (size_t)i * block,
                                 block};
    double g[MAX_REPS];
    int ng = 0;
    for (int it = 0; st == KV_OK && it < g_warmup + g_reps; it++) {
        uint64_t t0 = kv_now_ns();
        st = t->ops->read(t, peer, 0, f, nb, (uint64_t)it, err, sizeof err);
        struct kvx_completion comp;
        int got = 0;
        while (st == KV_OK && !got) {
            got = t->ops->progress(t, &comp, 1, 0);
            if (got < 0) st = kv_errf(got, err, sizeof err, "progress failed");
            else if (got && comp.status != KV_OK) st = kv_errf(comp.status, err, sizeof err, "%s",
                                                               comp.message);
        }
        double s = (double)(kv_now_ns() - t0) / 1e9;
        if (st == KV_OK && it >= g_warmup) g[ng++] = (double)size / s / 1e9;
    }
    if (st == KV_OK) res = summarize(g, ng, check(dst, size, block, perm));
    else snprintf(res.note, sizeof res.note, "%.90s", err);
    if (peer) t->ops->disconnect(t, peer);
    wr(g_ctl, "x", 1);
    char k;
    rd(g_ctl, &k, 1);
    if (t) t->ops->destroy(t);
    free(desc);
    free(perm);
    free(f);
    free(dst);
    return res;
}

/* ================================================================ the agent */
#define AG_LAYERS 4
#define AG_HEADS 8
#define AG_HDIM 64
#define AG_T 16 /* block = 2 * 8 * 16 * 64 * 4 B * 4 layers = 256 KiB */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static struct kvx_result g_last;
static uint64_t g_want;
static bool g_have;

static void on_result(const struct kvx_result *r, void *user) {
    (void)user;
    pthread_mutex_lock(&g_mu);
    if (r->disagg_id == g_want && !r->is_send) {
        g_last = *r;
        g_have = true;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static kv_status agent_new(int kind, uint8_t *pool, int nblocks, struct kvx_page_table *pt,
                           kvx_agent_t **a, char *err, size_t errlen) {
    kv_status st = kvx_page_table_dense_kv(pt, 0, AG_LAYERS, AG_HEADS, AG_HDIM, AG_T,
                                           KVX_DTYPE_F32, err, errlen);
    if (st != KV_OK) return st;
    struct kvx_config c = {.host = "127.0.0.1", .transport = kind ? KVX_TRANSPORT_UCX
                                                                   : KVX_TRANSPORT_TCP,
                           .timeout_s = 60, .pt = pt, .pool_base = pool, .n_blocks = nblocks,
                           .cb = on_result};
    return kvx_agent_start(&c, a, err, errlen);
}

static void child_agent(const struct cmd *c) {
    set_tls(c->tls);
    struct kvx_page_table pt;
    memset(&pt, 0, sizeof pt);
    uint8_t *pool = alloc_touched(c->size, true);
    int nb = (int)(c->size / c->block);
    kvx_agent_t *a = NULL;
    char err[256] = "";
    kv_status st = agent_new(c->kind, pool, nb, &pt, &a, err, sizeof err);
    unsetenv("UCX_TLS");
    if (st != KV_OK) {
        send_blob(NULL, 0);
        send_blob(err, (uint32_t)strlen(err) + 1);
    } else {
        const char *ep = kvx_agent_endpoint(a);
        send_blob(ep, (uint32_t)strlen(ep) + 1);
        int32_t *blocks = malloc(sizeof(int32_t) * (size_t)nb);
        for (int i = 0; i < nb; i++) blocks[i] = i;
        struct kvx_aux aux = {.n_tokens = nb * AG_T, .n_first = 1, .first = {42}};
        for (;;) {
            uint64_t id;
            rd(g_ctl, &id, 8);
            if (id == 0) break;
            kv_status s = kvx_send_offer(a, id, blocks, nb, &aux);
            wr(g_ctl, &s, sizeof s);
        }
        free(blocks);
        kvx_agent_stop(a);
    }
    kvx_page_table_free(&pt);
    free(pool);
    wr(g_ctl, "k", 1);
}

static struct result parent_agent(int kind, uint64_t size, bool frag, const char *tls) {
    struct result res = {.med = -1};
    struct cmd c = {.op = OP_AGENT, .kind = kind, .size = size, .block = 0};
    struct kvx_page_table pt;
    memset(&pt, 0, sizeof pt);
    char err[256] = "";
    if (kvx_page_table_dense_kv(&pt, 0, AG_LAYERS, AG_HEADS, AG_HDIM, AG_T, KVX_DTYPE_F32, err,
                                sizeof err) != KV_OK)
        die("page table: %s", err);
    c.block = pt.views[0].block_bytes;
    kvx_page_table_free(&pt);
    snprintf(c.tls, sizeof c.tls, "%s", tls);
    wr(g_ctl, &c, sizeof c);
    uint32_t n;
    char *ep = recv_blob(&n);
    if (n == 0) {
        free(ep);
        char *e = recv_blob(&n);
        snprintf(res.note, sizeof res.note, "%s", e);
        free(e);
        char k;
        rd(g_ctl, &k, 1);
        return res;
    }
    int nb = (int)(size / c.block);
    uint8_t *pool = alloc_touched(size, false);
    set_tls(tls);
    kvx_agent_t *a = NULL;
    kv_status st = agent_new(kind, pool, nb, &pt, &a, err, sizeof err);
    unsetenv("UCX_TLS");
    int *perm = frag ? shuffled(nb) : NULL;
    int32_t *dst = malloc(sizeof(int32_t) * (size_t)nb);
    /* dst block perm[i] receives source block i: invert for the check (dst j holds src inv[j]) */
    int *inv = malloc(sizeof(int) * (size_t)nb);
    for (int i = 0; i < nb; i++) {
        dst[i] = perm ? perm[i] : i;
        inv[dst[i]] = i;
    }
    double g[MAX_REPS];
    int ng = 0;
    for (int it = 0; st == KV_OK && it < g_warmup + g_reps; it++) {
        uint64_t id = 1000 + (uint64_t)it;
        kv_status os;
        wr(g_ctl, &id, 8);
        rd(g_ctl, &os, sizeof os);
        if (os != KV_OK) {
            st = kv_errf(os, err, sizeof err, "offer failed");
            break;
        }
        pthread_mutex_lock(&g_mu);
        g_want = id;
        g_have = false;
        pthread_mutex_unlock(&g_mu);
        uint64_t t0 = kv_now_ns();
        st = kvx_recv_start(a, id, ep, true, dst, nb, nb * AG_T);
        if (st != KV_OK) {
            snprintf(err, sizeof err, "recv_start: %s", kv_status_str(st));
            break;
        }
        pthread_mutex_lock(&g_mu);
        while (!g_have) pthread_cond_wait(&g_cv, &g_mu); /* the agent's deadline bounds this */
        struct kvx_result r = g_last;
        pthread_mutex_unlock(&g_mu);
        double s = (double)(kv_now_ns() - t0) / 1e9;
        if (r.status != KV_OK) {
            st = r.status;
            snprintf(err, sizeof err, "%s", r.message);
            break;
        }
        if (it >= g_warmup) g[ng++] = (double)size / s / 1e9;
    }
    uint64_t zero = 0;
    wr(g_ctl, &zero, 8);
    char k;
    rd(g_ctl, &k, 1);
    if (st == KV_OK) res = summarize(g, ng, check(pool, size, c.block, inv));
    else snprintf(res.note, sizeof res.note, "%.90s", err);
    kvx_agent_stop(a);
    kvx_page_table_free(&pt);
    free(ep);
    free(perm);
    free(inv);
    free(dst);
    free(pool);
    return res;
}

/* ================================================================ child main */
static void child_main(void) {
    for (;;) {
        struct cmd c;
        rd(g_ctl, &c, sizeof c);
        switch (c.op) {
#ifdef KVSERVE_HAVE_UCX
        case OP_RAW_RMA: child_raw_rma(&c); break;
        case OP_RAW_TAG: child_raw_tag(&c); break;
#endif
        case OP_TCP: child_tcp(&c); break;
        case OP_OURS: child_ours(&c); break;
        case OP_AGENT: child_agent(&c); break;
        default: _exit(0);
        }
    }
}

/* ================================================================ report */
static void print_row(const char *name, const char *tls, uint64_t size, uint64_t block,
                      struct result r, double base) {
    char sz[32], bl[32];
    snprintf(sz, sizeof sz, "%llu MiB", (unsigned long long)(size >> 20));
    if (block) snprintf(bl, sizeof bl, "%llu KiB", (unsigned long long)(block >> 10));
    else snprintf(bl, sizeof bl, "-");
    if (r.med < 0) {
        printf("| %-22s | %-7s | %8s | %7s | %8s | %-17s | %6s | %s |\n", name, tls, sz, bl,
               "-", "-", "-", r.note[0] ? r.note : "pending");
        fflush(stdout);
        return;
    }
    char range[40], ratio[16];
    snprintf(range, sizeof range, "%.2f-%.2f", r.lo, r.hi);
    if (base > 0) snprintf(ratio, sizeof ratio, "%.0f%%", 100 * r.med / base);
    else snprintf(ratio, sizeof ratio, "-");
    printf("| %-22s | %-7s | %8s | %7s | %8.2f | %-17s | %6s | %s |\n", name, tls, sz, bl, r.med,
           range, ratio, r.ok ? "bytes ok" : "BYTES WRONG");
    fflush(stdout);
}

static void log_env(void) {
    struct utsname u;
    uname(&u);
    char model[256] = "?";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10)) {
                char *p = strchr(line, ':');
                if (p) snprintf(model, sizeof model, "%s", p + 2);
                model[strcspn(model, "\n")] = 0;
                break;
            }
        fclose(f);
    }
    printf("# machine: %s %s, %ld cpus, %s\n", u.sysname, u.machine, sysconf(_SC_NPROCESSORS_ONLN),
           model);
#ifdef KVSERVE_HAVE_UCX
    printf("# UCX %s; UCX_TLS=%s UCX_NET_DEVICES=%s (unset: lo, as the transport picks for "
           "127.0.0.1)\n", ucp_get_version_string(), getenv("UCX_TLS") ? getenv("UCX_TLS") : "(unset)",
           getenv("UCX_NET_DEVICES") ? getenv("UCX_NET_DEVICES") : "(unset)");
#else
    printf("# built without UCX\n");
#endif
}

static int parse_list(const char *s, uint64_t *out, int cap) {
    int n = 0;
    char *dup = kv_strdup(s), *save = NULL;
    for (char *tok = strtok_r(dup, ",", &save); tok && n < cap; tok = strtok_r(NULL, ",", &save)) {
        if (kv_parse_size(tok, &out[n]) != KV_OK || out[n] == 0) die("bad size %s", tok);
        n++;
    }
    free(dup);
    return n;
}

int main(int argc, char **argv) {
    uint64_t sizes[8] = {4u << 20, 64u << 20, 512u << 20};
    int nsizes = 3;
    uint64_t block = 64 << 10;
    const char *tls_arg = "default,tcp";
    bool agent = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--sizes") && v) nsizes = parse_list(argv[++i], sizes, 8);
        else if (!strcmp(a, "--reps") && v) g_reps = atoi(argv[++i]);
        else if (!strcmp(a, "--warmup") && v) g_warmup = atoi(argv[++i]);
        else if (!strcmp(a, "--block") && v) {
            if (kv_parse_size(argv[++i], &block) != KV_OK || block == 0 || block % 8)
                die("bad --block %s", argv[i]);
        } else if (!strcmp(a, "--ucx-tls") && v) tls_arg = argv[++i];
        else if (!strcmp(a, "--no-agent")) agent = false;
        else {
            fprintf(stderr, "usage: %s [--sizes 4M,64M,512M] [--reps 5] [--warmup 2] "
                            "[--block 64K] [--ucx-tls default,tcp] [--no-agent]\n", argv[0]);
            return 2;
        }
    }
    if (g_reps < 1 || g_reps > MAX_REPS - 1 || g_warmup < 0 || g_warmup > 100)
        die("%s", "--reps must be 1..63, --warmup 0..100");
    for (int i = 0; i < nsizes; i++)
        if (sizes[i] % block) die("%s", "every size must be a multiple of --block");
    signal(SIGPIPE, SIG_IGN);
    kv_log_set_level(KV_LOG_WARN);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) die("socketpair: %s", strerror(errno));
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid == 0) {
        close(sv[0]);
        g_ctl = sv[1];
        child_main();
        _exit(0);
    }
    close(sv[1]);
    g_ctl = sv[0];

    log_env();
    printf("# %d warm-up + %d timed repetitions per row; median GB/s (1e9 B/s), min-max; "
           "ratio = median / the row's baseline\n\n", g_warmup, g_reps);
    printf("| %-22s | %-7s | %8s | %7s | %8s | %-17s | %6s | %s |\n", "row", "UCX_TLS", "size",
           "block", "GB/s", "min-max", "ratio", "note");
    printf("|%s|%s|%s|%s|%s|%s|%s|%s|\n", "------------------------", "---------", "----------",
           "---------", "----------", "-------------------", "--------", "------");
    char tlsbuf[128];
    snprintf(tlsbuf, sizeof tlsbuf, "%s", tls_arg);
    char *tls_list[8];
    int ntls = 0;
    char *save = NULL;
    for (char *tok = strtok_r(tlsbuf, ",", &save); tok && ntls < 8; tok = strtok_r(NULL, ",", &save))
        tls_list[ntls++] = tok;

    double sock64 = -1, get64[8] = {-1, -1, -1, -1, -1, -1, -1, -1}; /* agent baselines */
    for (int si = 0; si < nsizes; si++) {
        uint64_t size = sizes[si];
        struct result mc = run_memcpy(size);
        print_row("memcpy", "-", size, 0, mc, 0);
        struct result sock = parent_tcp(size);
        print_row("raw tcp socket", "-", size, 0, sock, 0);
        if (size == 64u << 20) sock64 = sock.med;
#ifdef KVSERVE_HAVE_TCP_TRANSPORT
        print_row("tcp read contig", "-", size, block, parent_ours(0, size, block, false, ""),
                  sock.med);
        print_row("tcp read frag", "-", size, block, parent_ours(0, size, block, true, ""),
                  sock.med);
#else
        struct result pend = {.med = -1};
        snprintf(pend.note, sizeof pend.note, "pending: transport_tcp.c not in the tree yet");
        print_row("tcp read contig", "-", size, block, pend, 0);
        print_row("tcp read frag", "-", size, block, pend, 0);
#endif
#ifdef KVSERVE_HAVE_UCX
        for (int ti = 0; ti < ntls; ti++) {
            const char *tls = strcmp(tls_list[ti], "default") ? tls_list[ti] : "";
            const char *tname = *tls ? tls : "default";
            struct result get = parent_raw_rma(size, tls, RAW_GET);
            print_row("raw ucx get", tname, size, 0, get, 0);
            if (size == 64u << 20) get64[ti] = get.med;
            print_row("raw ucx put+flush", tname, size, 0, parent_raw_rma(size, tls, RAW_PUT), 0);
            print_row("raw ucx tag", tname, size, 0, parent_raw_tag(size, tls), 0);
            print_row("ucx read contig", tname, size, block,
                      parent_ours(1, size, block, false, tls), get.med);
            print_row("ucx read frag", tname, size, block, parent_ours(1, size, block, true, tls),
                      get.med);
        }
#endif
    }
    if (agent) {
        uint64_t size = 64u << 20;
        print_row("agent tcp contig", "-", size, 256 << 10, parent_agent(0, size, false, ""),
                  sock64);
        print_row("agent tcp frag", "-", size, 256 << 10, parent_agent(0, size, true, ""),
                  sock64);
#ifdef KVSERVE_HAVE_UCX
        for (int ti = 0; ti < ntls; ti++) {
            const char *tls = strcmp(tls_list[ti], "default") ? tls_list[ti] : "";
            const char *tname = *tls ? tls : "default";
            print_row("agent ucx contig", tname, size, 256 << 10,
                      parent_agent(1, size, false, tls), get64[ti]);
            print_row("agent ucx frag", tname, size, 256 << 10, parent_agent(1, size, true, tls),
                      get64[ti]);
        }
#endif
    }
    struct cmd q = {.op = OP_QUIT};
    wr(g_ctl, &q, sizeof q);
    waitpid(pid, NULL, 0);
    return 0;
}
