/*
 * CUDA IPC transport: KV blocks GPU to GPU between two processes of one host (contract in
 * transport_cuda_ipc.h and ../../transfer/transport.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_internal.h"
#include "transport_cuda_ipc.h"
extern "C" {
#include "../../base/le.h"
}

#define IPCT_MAGIC "KVXC"
#define IPCT_VERSION 1
#define IPCT_BOOT 40
#define IPCT_HOST 64
/* magic(4) ver(1) region(1) pad(2) pid(4) pad(4) base(8) len(8) off(8) uuid(16) boot host handle(64) sum(8) */
#define IPCT_REC (4 + 1 + 1 + 2 + 4 + 4 + 8 + 8 + 8 + 16 + IPCT_BOOT + IPCT_HOST + 64 + 8)

#define IPC_THREADS 256
#define IPC_MAX_SEGS 1024        /* segments per launch (24 KiB of kernel parameters) */
#define IPC_SMALL_SEGS 128       /* a launch of at most this many passes 3 KiB */
#define IPC_SEG_MAX (1u << 30)   /* longer runs are cut into several segments */
#define IPC_CHUNK_MIN (16u << 10)
#define IPC_CHUNK_MAX (1u << 20)
#define IPC_CTAS 4096            /* a read is cut into about this many chunks (bench_cuda_ipc: 4096 beat 512 / 1024 / 2048 on the H200) */
#define IPC_UNROLL 8

/* One launch's work: segment i copies len[i] bytes src[i] -> dst[i]; it is cut into chunks of
 * `chunk` bytes, one CTA each; first[i] = the index of its first chunk (ascending). */
template <int N> struct ipc_segs_n {
    const char *src[N];
    char *dst[N];
    uint32_t len[N];
    uint32_t first[N];
    int n;
    uint32_t chunk;
};
typedef ipc_segs_n<IPC_MAX_SEGS> ipc_segs;

/* blockIdx.x: chunk (its segment found by binary search over first[]). 16-byte vector copies,
 * IPC_UNROLL loads in flight per thread (predicated, so a short chunk keeps them in flight too),
 * when the chunk's addresses and length are 16-byte aligned, else byte copies. */
template <int N>
__global__ void __launch_bounds__(IPC_THREADS) k_ipc_gather(const __grid_constant__ ipc_segs_n<N> t) {
    uint32_t b = blockIdx.x;
    int lo = 0, hi = t.n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (t.first[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    uint32_t off = (b - t.first[lo]) * t.chunk;
    uint32_t n = t.len[lo] - off < t.chunk ? t.len[lo] - off : t.chunk;
    const char *s = t.src[lo] + off;
    char *d = t.dst[lo] + off;
    if ((((uintptr_t)s | (uintptr_t)d | (uintptr_t)n) & 15u) == 0) {
        const uint4 *s4 = (const uint4 *)s;
        uint4 *d4 = (uint4 *)d;
        uint32_t n16 = n / 16;
        for (uint32_t base = threadIdx.x; base < n16; base += IPC_UNROLL * IPC_THREADS) {
            uint4 v[IPC_UNROLL];
#pragma unroll
            for (int u = 0; u < IPC_UNROLL; u++)
                if (base + u * IPC_THREADS < n16) v[u] = s4[base + u * IPC_THREADS];
#pragma unroll
            for (int u = 0; u < IPC_UNROLL; u++)
                if (base + u * IPC_THREADS < n16) d4[base + u * IPC_THREADS] = v[u];
        }
    } else {
        for (uint32_t i = threadIdx.x; i < n; i += IPC_THREADS) d[i] = s[i];
    }
}

struct ipc_read {
    uint64_t cookie;
    cudaEvent_t ev;          /* NULL: finished when posted (no bytes) */
    struct ipc_read *next;
};

struct kvx_peer {
    struct ipct *t;
    char *base;              /* the peer's region in our address space */
    uint64_t len;
    bool opened;             /* cudaIpcOpenMemHandle'd (else the exporter's pointer, same process) */
    char *mapped;            /* what cudaIpcOpenMemHandle returned */
    struct kvx_peer *next;
};

struct ipct {
    int dev;
    cudaStream_t st;
    bool exposed;
    void *base;
    size_t len;
    uint8_t rec[IPCT_REC];
    struct kvx_peer *peers;
    struct ipc_read *head, *tail; /* posted reads, FIFO (one stream: they finish in order) */
    ipc_segs *segs;               /* host staging of one launch's parameters */
    uint32_t n_cta;               /* chunks (CTAs) of the staged segments */
    size_t chunk;                 /* this read's chunk size */
    int ctas;                     /* chunks a read aims at (KVSERVE_CUDA_IPC_CTAS, default IPC_CTAS) */
    bool batch;                   /* KVSERVE_CUDA_IPC_COPY=batch: cudaMemcpyBatchAsync instead */
    void **b_dst;                 /* batch mode: the runs (grown as needed) */
    const void **b_src;
    size_t *b_len;
    int b_n, b_cap;
    cudaEvent_t free_ev[16];      /* completed events kept for reuse */
    int n_free_ev;
};

static struct ipct *T(kvx_transport_t *t) { return (struct ipct *)t->ctx; }


/* boot id (kernel boot) and host name, NUL padded */
static void host_identity(char boot[IPCT_BOOT], char host[IPCT_HOST]) {
    memset(boot, 0, IPCT_BOOT);
    memset(host, 0, IPCT_HOST);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (fgets(boot, IPCT_BOOT, f)) boot[strcspn(boot, "\r\n")] = 0;
        fclose(f);
    }
    if (gethostname(host, IPCT_HOST - 1) != 0) host[0] = 0;
    host[IPCT_HOST - 1] = 0;
}

extern "C" void kvx_cuda_ipc_host_id(char *out, size_t outlen) {
    char boot[IPCT_BOOT], host[IPCT_HOST];
    host_identity(boot, host);
    snprintf(out, outlen, "%s/%s", boot, host);
}

static kv_status cu_err(kv_status s, char *err, size_t errlen, const char *what, cudaError_t e) {
    return kv_errf(s, err, errlen, "cuda_ipc transport: %s: %s", what, cudaGetErrorString(e));
}

/* ---- expose ---- */
static kv_status ipct_expose(kvx_transport_t *t, void *base, size_t len, kv_buf *desc, char *err, size_t errlen) {
    struct ipct *u = T(t);
    if (!desc || !base || !len)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: expose: empty region");
    if (u->exposed) return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: expose: already exposed");
    cudaError_t e = cudaSetDevice(u->dev);
    if (e != cudaSuccess) return cu_err(KV_EIO, err, errlen, "cudaSetDevice", e);
    cudaPointerAttributes pa;
    e = cudaPointerGetAttributes(&pa, base);
    if (e != cudaSuccess || pa.type != cudaMemoryTypeDevice) {
        cudaGetLastError();
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: expose: %p is not device memory", base);
    }
    cudaIpcMemHandle_t h;
    e = cudaIpcGetMemHandle(&h, base);
    if (e != cudaSuccess) return cu_err(KV_EIO, err, errlen, "cudaIpcGetMemHandle", e);
    cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, pa.device);
    if (e != cudaSuccess) return cu_err(KV_EIO, err, errlen, "cudaGetDeviceProperties", e);
    uint8_t *r = u->rec;
    memset(r, 0, sizeof u->rec);
    memcpy(r, IPCT_MAGIC, 4);
    r[4] = IPCT_VERSION;
    r[5] = 0;
    kv_put_le32(r + 8, (uint32_t)getpid());
    kv_put_le64(r + 16, (uint64_t)(uintptr_t)base);
    kv_put_le64(r + 24, (uint64_t)len);
    kv_put_le64(r + 32, 0);
    memcpy(r + 40, p.uuid.bytes, 16);
    host_identity((char *)r + 56, (char *)r + 56 + IPCT_BOOT);
    memcpy(r + 56 + IPCT_BOOT + IPCT_HOST, &h, 64);
    kv_put_le64(r + IPCT_REC - 8, kv_fnv1a64(r, IPCT_REC - 8));
    if (kv_buf_append(desc, r, IPCT_REC) != KV_OK)
        return kv_errf(KV_ENOMEM, err, errlen, "cuda_ipc transport: out of memory");
    u->exposed = true;
    u->base = base;
    u->len = len;
    return KV_OK;
}

/* ---- connect ---- */
static kv_status ipct_connect(kvx_transport_t *t, const void *desc, size_t len, kvx_peer_t **out, char *err,
                              size_t errlen) {
    struct ipct *u = T(t);
    if (!out) return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: connect: NULL out");
    *out = NULL;
    const uint8_t *d = (const uint8_t *)desc;
    if (!d || len != IPCT_REC)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: descriptor of %zu bytes (a CUDA IPC record "
                       "has %d): the peer uses another transport", len, IPCT_REC);
    if (memcmp(d, IPCT_MAGIC, 4) != 0)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: not a CUDA IPC descriptor (bad magic)");
    if (d[4] != IPCT_VERSION || d[5] != 0)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: descriptor version %u region %u (this build "
                       "reads version %d, region 0)", d[4], d[5], IPCT_VERSION);
    if (kv_fnv1a64(d, IPCT_REC - 8) != kv_get_le64(d + IPCT_REC - 8))
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: descriptor checksum mismatch (corrupted bytes)");
    char boot[IPCT_BOOT], host[IPCT_HOST];
    host_identity(boot, host);
    const char *pboot = (const char *)d + 56, *phost = (const char *)d + 56 + IPCT_BOOT;
    if (memchr(pboot, 0, IPCT_BOOT) == NULL || memchr(phost, 0, IPCT_HOST) == NULL)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: malformed host identity in the descriptor");
    if (strcmp(boot, pboot) != 0 || strcmp(host, phost) != 0)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: the peer runs on another host (%s/%s, this is "
                       "%s/%s): CUDA IPC works between processes of one host only", phost, pboot, host, boot);
    uint64_t rbase = kv_get_le64(d + 16), rlen = kv_get_le64(d + 24), roff = kv_get_le64(d + 32);
    uint32_t pid = kv_get_le32(d + 8);
    if (!rbase || !rlen || roff || rbase + rlen < rbase)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: descriptor has a bad region");
    cudaError_t e = cudaSetDevice(u->dev);
    if (e != cudaSuccess) return cu_err(KV_EIO, err, errlen, "cudaSetDevice", e);
    int n = 0, peer_dev = -1;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    for (int i = 0; i < n && peer_dev < 0; i++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) == cudaSuccess && memcmp(p.uuid.bytes, d + 40, 16) == 0) peer_dev = i;
    }
    if (peer_dev < 0)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: the peer's GPU is not visible to this process "
                       "(CUDA_VISIBLE_DEVICES?)");
    struct kvx_peer *pr = (struct kvx_peer *)kv_calloc(1, sizeof *pr);
    if (!pr) return kv_errf(KV_ENOMEM, err, errlen, "cuda_ipc transport: out of memory");
    pr->t = u;
    pr->len = rlen;
    if (pid == (uint32_t)getpid()) { /* our own region: CUDA does not open a handle in its exporter */
        pr->base = (char *)(uintptr_t)rbase;
    } else {
        cudaIpcMemHandle_t h;
        memcpy(&h, d + 56 + IPCT_BOOT + IPCT_HOST, 64);
        void *p = NULL;
        e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            cudaGetLastError();
            free(pr);
            return cu_err(KV_EIO, err, errlen, "cudaIpcOpenMemHandle", e);
        }
        pr->opened = true;
        pr->mapped = (char *)p;
        pr->base = (char *)p + roff;
    }
    pr->next = u->peers;
    u->peers = pr;
    *out = pr;
    return KV_OK;
}

static void ipct_disconnect(kvx_transport_t *t, kvx_peer_t *p) {
    struct ipct *u = T(t);
    if (!p) return;
    cudaSetDevice(u->dev);
    kvc_stream_sync(u->st); /* no copy may read the mapping once it is closed */
    for (struct kvx_peer **pp = &u->peers; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    if (p->opened) cudaIpcCloseMemHandle(p->mapped);
    free(p);
}

/* ---- read ---- */
static kv_status flush_segs(struct ipct *u, char *err, size_t errlen) {
    ipc_segs *g = u->segs;
    if (!g->n) return KV_OK;
    g->chunk = (uint32_t)u->chunk;
    if (g->n <= IPC_SMALL_SEGS) { /* small parameter block: a cheaper launch */
        ipc_segs_n<IPC_SMALL_SEGS> sm;
        memcpy(sm.src, g->src, sizeof sm.src);
        memcpy(sm.dst, g->dst, sizeof sm.dst);
        memcpy(sm.len, g->len, sizeof sm.len);
        memcpy(sm.first, g->first, sizeof sm.first);
        sm.n = g->n;
        sm.chunk = g->chunk;
        k_ipc_gather<IPC_SMALL_SEGS><<<u->n_cta, IPC_THREADS, 0, u->st>>>(sm);
    } else {
        k_ipc_gather<IPC_MAX_SEGS><<<u->n_cta, IPC_THREADS, 0, u->st>>>(*g);
    }
    kvc_launched();
    g->n = 0;
    u->n_cta = 0;
    CU_TRY(cudaGetLastError(), "cuda_ipc transport: copy launch");
    return KV_OK;
}

static kv_status flush_batch(struct ipct *u, char *err, size_t errlen) {
    if (!u->b_n) return KV_OK;
    struct cudaMemcpyAttributes at;
    memset(&at, 0, sizeof at);
    at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
    kvc_inc(&kvc_counters.other_copies);
    cudaError_t e = cudaMemcpyBatchAsync(u->b_dst, u->b_src, u->b_len, (size_t)u->b_n, &at, &idx, 1, u->st);
    u->b_n = 0;
    CU_TRY(e, "cuda_ipc transport: cudaMemcpyBatchAsync");
    return KV_OK;
}

static kv_status add_run(struct ipct *u, const char *src, char *dst, size_t len, char *err, size_t errlen) {
    if (u->batch) {
        if (u->b_n == u->b_cap) {
            int nc = u->b_cap ? 2 * u->b_cap : 256;
            void *a = kv_realloc(u->b_dst, (size_t)nc * sizeof *u->b_dst);
            if (a) u->b_dst = (void **)a;
            void *b = a ? kv_realloc(u->b_src, (size_t)nc * sizeof *u->b_src) : NULL;
            if (b) u->b_src = (const void **)b;
            void *c = b ? kv_realloc(u->b_len, (size_t)nc * sizeof *u->b_len) : NULL;
            if (!c) return kv_errf(KV_ENOMEM, err, errlen, "cuda_ipc transport: out of memory");
            u->b_len = (size_t *)c;
            u->b_cap = nc;
        }
        u->b_dst[u->b_n] = dst, u->b_src[u->b_n] = src, u->b_len[u->b_n] = len;
        u->b_n++;
        return KV_OK;
    }
    ipc_segs *g = u->segs;
    for (size_t off = 0; off < len; off += IPC_SEG_MAX) {
        size_t n = len - off < IPC_SEG_MAX ? len - off : IPC_SEG_MAX;
        uint32_t k = (uint32_t)((n + u->chunk - 1) / u->chunk);
        if (g->n == IPC_MAX_SEGS || u->n_cta + k > (1u << 30)) {
            kv_status s = flush_segs(u, err, errlen);
            if (s) return s;
        }
        g->src[g->n] = src + off;
        g->dst[g->n] = dst + off;
        g->len[g->n] = (uint32_t)n;
        g->first[g->n] = u->n_cta;
        g->n++;
        u->n_cta += k;
    }
    return KV_OK;
}

static kv_status ipct_read(kvx_transport_t *t, kvx_peer_t *p, int region, const struct kvx_frag *frags, int n,
                           uint64_t cookie, char *err, size_t errlen) {
    struct ipct *u = T(t);
    if (!p) return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: read: NULL peer");
    if (region != 0)
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: read: region %d (only 0, the pool)", region);
    if (n < 0 || (n > 0 && !frags))
        return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: read: bad fragment list (n=%d)", n);
    for (int i = 0; i < n; i++) {
        const struct kvx_frag *f = &frags[i];
        if (f->len == 0) continue;
        if (!f->local)
            return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: read: fragment %d has no local buffer", i);
        if (f->remote_off > p->len || f->len > p->len - f->remote_off)
            return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: read: fragment %d [%llu, +%zu) is outside "
                           "the peer's region (%llu bytes)", i, (unsigned long long)f->remote_off, f->len,
                           (unsigned long long)p->len);
    }
    struct ipc_read *r = (struct ipc_read *)kv_calloc(1, sizeof *r);
    if (!r) return kv_errf(KV_ENOMEM, err, errlen, "cuda_ipc transport: out of memory");
    r->cookie = cookie;
    cudaError_t e = cudaSetDevice(u->dev);
    kv_status s = e == cudaSuccess ? KV_OK : cu_err(KV_EIO, err, errlen, "cudaSetDevice", e);
    size_t total = 0;
    u->segs->n = 0, u->n_cta = 0, u->b_n = 0;
    /* chunk size: about u->ctas chunks for the whole read (one CTA each), 16 KiB .. 1 MiB, a
     * multiple of 4 KiB */
    size_t want = 0;
    for (int i = 0; i < n; i++) want += frags[i].len;
    want = (want / (size_t)u->ctas + 4095) / 4096 * 4096;
    u->chunk = want < IPC_CHUNK_MIN ? IPC_CHUNK_MIN : want > IPC_CHUNK_MAX ? IPC_CHUNK_MAX : want;
    for (int i = 0; s == KV_OK && i < n; i++) {
        /* merge runs that are contiguous on both sides */
        uint64_t roff = frags[i].remote_off;
        char *local = (char *)frags[i].local;
        size_t len = frags[i].len;
        while (i + 1 < n && frags[i + 1].len && frags[i + 1].remote_off == roff + len &&
               (char *)frags[i + 1].local == local + len) {
            len += frags[i + 1].len;
            i++;
        }
        if (!len) continue;
        s = add_run(u, p->base + roff, local, len, err, errlen);
        total += len;
    }
    if (s == KV_OK) s = u->batch ? flush_batch(u, err, errlen) : flush_segs(u, err, errlen);
    if (s == KV_OK && total) {
        if (u->n_free_ev) r->ev = u->free_ev[--u->n_free_ev];
        else e = cudaEventCreateWithFlags(&r->ev, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventRecord(r->ev, u->st);
        if (e != cudaSuccess) s = cu_err(KV_EIO, err, errlen, "event", e);
    }
    if (s != KV_OK) {
        if (r->ev) cudaEventDestroy(r->ev);
        free(r);
        return s;
    }
    if (u->tail) u->tail->next = r;
    else u->head = r;
    u->tail = r;
    return KV_OK;
}

/* ---- progress ---- */
static int ipct_progress(kvx_transport_t *t, struct kvx_completion *out, int cap, int timeout_ms) {
    struct ipct *u = T(t);
    if (cap < 0 || (cap > 0 && !out)) return KV_EINVAL;
    uint64_t end = kv_now_ns() + (timeout_ms > 0 ? (uint64_t)timeout_ms * 1000000ull : 0);
    for (;;) {
        int k = 0;
        while (k < cap && u->head) {
            struct ipc_read *r = u->head;
            kv_status st = KV_OK;
            char msg[128] = "";
            if (r->ev) {
                cudaError_t e = cudaEventQuery(r->ev);
                if (e == cudaErrorNotReady) break;
                if (e != cudaSuccess) {
                    cudaGetLastError();
                    st = KV_EIO;
                    snprintf(msg, sizeof msg, "cuda_ipc transport: copy failed: %s", cudaGetErrorString(e));
                }
                if (st == KV_OK && u->n_free_ev < 16) u->free_ev[u->n_free_ev++] = r->ev;
                else cudaEventDestroy(r->ev);
            }
            u->head = r->next;
            if (!u->head) u->tail = NULL;
            out[k].cookie = r->cookie;
            out[k].status = st;
            snprintf(out[k].message, sizeof out[k].message, "%s", msg);
            k++;
            free(r);
        }
        if (k || !u->head || timeout_ms <= 0 || kv_now_ns() >= end) return k;
        struct timespec ts = {0, 20000}; /* 20 us: a copy in flight */
        nanosleep(&ts, NULL);
    }
}

static void ipct_destroy(kvx_transport_t *t) {
    if (!t) return;
    struct ipct *u = T(t);
    cudaSetDevice(u->dev);
    if (u->st) kvc_stream_sync(u->st);
    while (u->peers) ipct_disconnect(t, u->peers);
    while (u->head) {
        struct ipc_read *r = u->head;
        u->head = r->next;
        if (r->ev) cudaEventDestroy(r->ev);
        free(r);
    }
    while (u->n_free_ev) cudaEventDestroy(u->free_ev[--u->n_free_ev]);
    if (u->st) cudaStreamDestroy(u->st);
    free(u->segs);
    free(u->b_dst), free(u->b_src), free(u->b_len);
    free(u);
    free(t);
}

static const struct kvx_transport_ops ipct_ops = {
    /* .name = */ "cuda_ipc",
    /* .expose = */ ipct_expose,
    /* .expose_staging = */ NULL,
    /* .connect = */ ipct_connect,
    /* .disconnect = */ ipct_disconnect,
    /* .read = */ ipct_read,
    /* .progress = */ ipct_progress,
    /* .event_fd = */ NULL,
    /* .destroy = */ ipct_destroy,
};

extern "C" kv_status kvx_transport_cuda_ipc_new(int device, kvx_transport_t **out, char *err, size_t errlen) {
    if (!out) return kv_errf(KV_EINVAL, err, errlen, "cuda_ipc transport: NULL out");
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "cuda_ipc transport: device %d: %s", device,
                       cudaGetErrorString(e));
    }
    kvx_transport_t *t = (kvx_transport_t *)kv_calloc(1, sizeof *t);
    struct ipct *u = (struct ipct *)kv_calloc(1, sizeof *u);
    ipc_segs *c = (ipc_segs *)kv_calloc(1, sizeof *c);
    if (!t || !u || !c) {
        free(t), free(u), free(c);
        return kv_errf(KV_ENOMEM, err, errlen, "cuda_ipc transport: out of memory");
    }
    u->dev = device;
    u->segs = c;
    const char *cp = getenv("KVSERVE_CUDA_IPC_COPY"), *ct = getenv("KVSERVE_CUDA_IPC_CTAS");
    u->batch = cp && !strcmp(cp, "batch");
    u->ctas = ct ? atoi(ct) : IPC_CTAS;
    if (u->ctas < 1 || u->ctas > (1 << 20)) u->ctas = IPC_CTAS;
    e = cudaStreamCreateWithFlags(&u->st, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(t), free(u), free(c);
        return cu_err(KV_EIO, err, errlen, "stream create", e);
    }
    t->ops = &ipct_ops;
    t->ctx = u;
    *out = t;
    return KV_OK;
}
