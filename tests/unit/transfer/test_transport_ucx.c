/*
 * The UCX transport (transport.h, transport_ucx.c): two transports in one process (two UCP
 * workers; shared memory / CMA by default) and the same cases again under UCX_TLS=tcp (RMA
 * emulated over TCP: the exposing side is progressed by the pump below, as the agent does).
 *  - bytes exact: one contiguous read, many small odd-sized reads, shuffled blocks, zero
 *    fragments, several reads in flight with their own cookies, the staging region (1)
 *  - refused: truncated / garbage / bit-flipped descriptors, reads outside the region, an
 *    unexposed region, a bad rkey behind a valid checksum
 *  - a peer process that dies: the read fails with a status (fork), nothing hangs
 * Builds without UCX: every case skips with a message.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <sys/wait.h>
#include <unistd.h>

#include "transfer/transport.h"

#define DEADLINE_S 20.0

struct mode {
    const char *tls;      /* NULL: UCX's default transports */
    const char *err_mode; /* KVSERVE_UCX_ERR_MODE (NULL: the default, none) */
};

struct pair {
    kvx_transport_t *a, *b; /* a exposes, b reads */
    uint8_t *src;
    size_t len;
    kv_buf desc;
    kvx_peer_t *peer;
};

static kvx_transport_t *new_ucx(const struct mode *m, char *err, size_t errlen) {
    if (m && m->tls) setenv("UCX_TLS", m->tls, 1);
    else unsetenv("UCX_TLS");
    if (m && m->err_mode) setenv("KVSERVE_UCX_ERR_MODE", m->err_mode, 1);
    kvx_transport_t *t = NULL;
    kv_status s = kvx_transport_ucx_new("127.0.0.1", &t, err, errlen);
    unsetenv("UCX_TLS");
    unsetenv("KVSERVE_UCX_ERR_MODE");
    return s == KV_OK ? t : NULL;
}

static void fill_pattern(uint8_t *p, size_t n, uint64_t seed) {
    kv_rng r;
    kv_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(kv_rng_next(&r) >> 56);
}

/* Sets up a + b, exposes a pattern buffer of len bytes on a and connects b. Skips when UCX
 * cannot run here. */
static void pair_open(struct pair *p, const struct mode *m, size_t len) {
    memset(p, 0, sizeof *p);
    char err[256] = "";
    if (!kvx_transport_ucx_available()) {
        print_message("SKIP: this build has no UCX transport\n");
        skip();
    }
    p->a = new_ucx(m, err, sizeof err);
    if (!p->a) {
        print_message("SKIP: UCX cannot create a context here (%s): %s\n",
                      m && m->tls ? m->tls : "default", err);
        skip();
    }
    p->b = new_ucx(m, err, sizeof err);
    assert_non_null(p->b);
    assert_string_equal(p->a->ops->name, "ucx");
    p->len = len;
    p->src = malloc(len);
    assert_non_null(p->src);
    fill_pattern(p->src, len, 42 + len);
    kv_buf_init(&p->desc);
    assert_int_equal(p->a->ops->expose(p->a, p->src, len, &p->desc, err, sizeof err), KV_OK);
    assert_true(p->desc.len > 0);
    assert_int_equal(p->b->ops->connect(p->b, p->desc.data, p->desc.len, &p->peer, err,
                                        sizeof err), KV_OK);
    assert_non_null(p->peer);
}

static void pair_close(struct pair *p) {
    if (p->peer) p->b->ops->disconnect(p->b, p->peer);
    if (p->b) p->b->ops->destroy(p->b);
    if (p->a) p->a->ops->destroy(p->a);
    kv_buf_free(&p->desc);
    free(p->src);
    memset(p, 0, sizeof *p);
}

/* Progresses both sides until b reported `want` completions (into got[]) or the deadline. */
static int pump(struct pair *p, struct kvx_completion *got, int want) {
    int have = 0;
    double end = kv_now_s() + DEADLINE_S;
    while (have < want && kv_now_s() < end) {
        struct kvx_completion none[1];
        assert_int_equal(p->a->ops->progress(p->a, none, 1, 0), 0); /* the exposer reads nothing */
        int n = p->b->ops->progress(p->b, got + have, want - have, 1);
        assert_true(n >= 0);
        have += n;
    }
    return have;
}

/* Reads frags from region 0, expects one OK completion with the cookie. */
static void read_ok(struct pair *p, const struct kvx_frag *f, int n, uint64_t cookie) {
    char err[256] = "";
    assert_int_equal(p->b->ops->read(p->b, p->peer, 0, f, n, cookie, err, sizeof err), KV_OK);
    struct kvx_completion c[1];
    assert_int_equal(pump(p, c, 1), 1);
    if (c[0].status != KV_OK) print_message("read failed: %s\n", c[0].message);
    assert_int_equal(c[0].status, KV_OK);
    assert_int_equal(c[0].cookie, cookie);
}

static const struct mode *mode_of(void **state) { return *state; }

static void test_contiguous(void **state) {
    struct pair p;
    pair_open(&p, mode_of(state), 3u << 20);
    uint8_t *dst = calloc(1, p.len);
    struct kvx_frag f = {0, dst, p.len};
    read_ok(&p, &f, 1, 7);
    assert_memory_equal(dst, p.src, p.len);
    /* A second read of a middle piece, into an offset destination. */
    memset(dst, 0, p.len);
    f = (struct kvx_frag){12345, dst + 3, 777777};
    read_ok(&p, &f, 1, 8);
    assert_memory_equal(dst + 3, p.src + 12345, 777777);
    assert_int_equal(dst[0], 0);
    assert_int_equal(dst[3 + 777777], 0);
    free(dst);
    pair_close(&p);
}

static void test_many_small(void **state) {
    struct pair p;
    pair_open(&p, mode_of(state), 1u << 20);
    enum { N = 3000 };
    struct kvx_frag *f = calloc(N, sizeof *f);
    uint8_t *dst = calloc(1, (size_t)N * 97);
    kv_rng r;
    kv_rng_seed(&r, 5);
    for (int i = 0; i < N; i++) {
        size_t len = 1 + kv_rng_next(&r) % 97;
        f[i].remote_off = kv_rng_next(&r) % (p.len - len + 1);
        f[i].local = dst + (size_t)i * 97;
        f[i].len = len;
    }
    read_ok(&p, f, N, 99);
    for (int i = 0; i < N; i++)
        assert_memory_equal(f[i].local, p.src + f[i].remote_off, f[i].len);
    free(dst);
    free(f);
    pair_close(&p);
}

static void test_shuffled_blocks(void **state) {
    struct pair p;
    enum { NB = 64, BS = 16384 };
    pair_open(&p, mode_of(state), (size_t)NB * BS);
    uint8_t *dst = calloc(NB, BS);
    int perm[NB];
    for (int i = 0; i < NB; i++) perm[i] = i;
    kv_rng r;
    kv_rng_seed(&r, 11);
    for (int i = NB - 1; i > 0; i--) {
        int j = (int)(kv_rng_next(&r) % (uint64_t)(i + 1));
        int x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    /* Remote block perm[i] -> local block i, posted in reverse order; plus one run of three
     * contiguous blocks (merged into one get by the transport). */
    struct kvx_frag f[NB + 3];
    for (int i = 0; i < NB; i++)
        f[NB - 1 - i] = (struct kvx_frag){(uint64_t)perm[i] * BS, dst + (size_t)i * BS, BS};
    uint8_t *run = calloc(3, BS);
    for (int i = 0; i < 3; i++)
        f[NB + i] = (struct kvx_frag){(uint64_t)(10 + i) * BS, run + (size_t)i * BS, BS};
    read_ok(&p, f, NB + 3, 1234);
    for (int i = 0; i < NB; i++)
        assert_memory_equal(dst + (size_t)i * BS, p.src + (size_t)perm[i] * BS, BS);
    assert_memory_equal(run, p.src + (size_t)10 * BS, 3 * BS);
    free(run);
    free(dst);
    pair_close(&p);
}

static void test_zero_fragments_and_cookies(void **state) {
    struct pair p;
    pair_open(&p, mode_of(state), 1u << 16);
    char err[256];
    read_ok(&p, NULL, 0, 55);
    /* A zero-length fragment only. */
    struct kvx_frag z = {0, NULL, 0};
    read_ok(&p, &z, 1, 56);
    /* Three reads in flight: three completions, each cookie once. */
    uint8_t d[3][100];
    for (int i = 0; i < 3; i++) {
        struct kvx_frag f = {(uint64_t)i * 1000, d[i], 100};
        assert_int_equal(p.b->ops->read(p.b, p.peer, 0, &f, 1, 100 + i, err, sizeof err), KV_OK);
    }
    struct kvx_completion c[3];
    assert_int_equal(pump(&p, c, 3), 3);
    int seen = 0;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(c[i].status, KV_OK);
        assert_true(c[i].cookie >= 100 && c[i].cookie < 103);
        seen |= 1 << (c[i].cookie - 100);
    }
    assert_int_equal(seen, 7);
    for (int i = 0; i < 3; i++) assert_memory_equal(d[i], p.src + i * 1000, 100);
    assert_true(p.b->ops->event_fd(p.b) >= -1);
    pair_close(&p);
}

static void test_staging_region(void **state) {
    struct pair p;
    pair_open(&p, mode_of(state), 1u << 16);
    char err[256];
    /* A second exposer with both regions in one descriptor. */
    kvx_transport_t *a2 = new_ucx(mode_of(state), err, sizeof err);
    assert_non_null(a2);
    uint8_t *pool = malloc(8192), *stage = malloc(4096);
    fill_pattern(pool, 8192, 1);
    fill_pattern(stage, 4096, 2);
    kv_buf d;
    kv_buf_init(&d);
    assert_int_equal(a2->ops->expose(a2, pool, 8192, &d, err, sizeof err), KV_OK);
    assert_int_not_equal(a2->ops->expose(a2, pool, 8192, &d, err, sizeof err), KV_OK);
    assert_int_equal(a2->ops->expose_staging(a2, stage, 4096, &d, err, sizeof err), KV_OK);
    kvx_peer_t *peer = NULL;
    assert_int_equal(p.b->ops->connect(p.b, d.data, d.len, &peer, err, sizeof err), KV_OK);
    uint8_t out[4096] = {0};
    struct kvx_frag f = {100, out, 3000};
    assert_int_equal(p.b->ops->read(p.b, peer, 1, &f, 1, 9, err, sizeof err), KV_OK);
    struct kvx_completion c;
    int got = 0;
    double end = kv_now_s() + DEADLINE_S;
    while (!got && kv_now_s() < end) {
        a2->ops->progress(a2, &c, 1, 0);
        got = p.b->ops->progress(p.b, &c, 1, 1);
    }
    assert_int_equal(got, 1);
    assert_int_equal(c.status, KV_OK);
    assert_memory_equal(out, stage + 100, 3000);
    /* Region 1 of the first peer was never exposed. */
    assert_int_equal(p.b->ops->read(p.b, p.peer, 1, &f, 1, 10, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "region 1"));
    p.b->ops->disconnect(p.b, peer);
    a2->ops->destroy(a2);
    kv_buf_free(&d);
    free(pool);
    free(stage);
    pair_close(&p);
}

static void expect_refused(struct pair *p, const void *d, size_t n) {
    char err[256] = "";
    kvx_peer_t *peer = (kvx_peer_t *)(uintptr_t)1;
    kv_status s = p->b->ops->connect(p->b, d, n, &peer, err, sizeof err);
    assert_int_not_equal(s, KV_OK);
    assert_null(peer);
    assert_non_null(strstr(err, "ucx transport"));
}

static void test_bad_descriptors(void **state) {
    struct pair p;
    pair_open(&p, mode_of(state), 4096);
    size_t n = p.desc.len;
    uint8_t *d = malloc(n + 16);
    memcpy(d, p.desc.data, n);
    /* Every truncation. */
    for (size_t k = 0; k < n; k++) expect_refused(&p, d, k);
    /* Trailing garbage after a good record. */
    memcpy(d + n, "garbage!garbage!", 16);
    expect_refused(&p, d, n + 16);
    /* Every single-byte corruption (the checksum or a field check catches each). */
    for (size_t k = 0; k < n; k++) {
        d[k] ^= 0x5a;
        expect_refused(&p, d, n);
        d[k] ^= 0x5a;
    }
    /* Random garbage. */
    kv_rng r;
    kv_rng_seed(&r, 3);
    for (int it = 0; it < 200; it++) {
        for (size_t k = 0; k < n; k++) d[k] = (uint8_t)kv_rng_next(&r);
        expect_refused(&p, d, n);
    }
    /* Two records for the same region. */
    uint8_t *two = malloc(2 * n);
    memcpy(two, p.desc.data, n);
    memcpy(two + n, p.desc.data, n);
    expect_refused(&p, two, 2 * n);
    free(two);
    /* NULL / empty. */
    expect_refused(&p, NULL, 0);
    expect_refused(&p, d, 0);
    free(d);
    pair_close(&p);
}

/* A record with a valid checksum but a nonsense rkey: refused at connect or the read fails;
 * never a crash. */
static uint64_t fnv(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void test_bad_rkey(void **state) {
    struct pair p;
    pair_open(&p, mode_of(state), 4096);
    size_t n = p.desc.len;
    uint8_t *d = malloc(n);
    memcpy(d, p.desc.data, n);
    uint32_t al = (uint32_t)d[8] | (uint32_t)d[9] << 8 | (uint32_t)d[10] << 16 |
                  (uint32_t)d[11] << 24;
    uint32_t rl = (uint32_t)d[12] | (uint32_t)d[13] << 8 | (uint32_t)d[14] << 16 |
                  (uint32_t)d[15] << 24;
    assert_true(rl >= 8);
    /* An empty memory-domain map: UCX has nothing to unpack for this peer. */
    memset(d + 32 + al, 0, rl);
    uint64_t h = fnv(d, n - 8);
    for (int i = 0; i < 8; i++) d[n - 8 + i] = (uint8_t)(h >> (8 * i));
    char err[256] = "";
    kvx_peer_t *peer = NULL;
    kv_status s = p.b->ops->connect(p.b, d, n, &peer, err, sizeof err);
    if (s != KV_OK) {
        assert_null(peer);
        print_message("bad rkey refused at connect: %s\n", err);
    } else {
        uint8_t out[64];
        struct kvx_frag f = {0, out, sizeof out};
        s = p.b->ops->read(p.b, peer, 0, &f, 1, 5, err, sizeof err);
        if (s == KV_OK) {
            struct kvx_completion c;
            int got = 0;
            double end = kv_now_s() + DEADLINE_S;
            while (!got && kv_now_s() < end) {
                p.a->ops->progress(p.a, &c, 1, 0);
                got = p.b->ops->progress(p.b, &c, 1, 1);
            }
            assert_int_equal(got, 1);
            assert_int_equal(c.cookie, 5);
            /* UCX may serve the get without the rkey (software RMA over active messages):
             * then it succeeds; what matters is that nothing crashed or hung. */
            print_message("bad rkey: the read completed: %s %s\n", kv_status_str(c.status),
                          c.message);
        } else {
            print_message("bad rkey refused at read: %s\n", err);
        }
        p.b->ops->disconnect(p.b, peer);
    }
    free(d);
    pair_close(&p);
}

static void test_out_of_range(void **state) {
    struct pair p;
    pair_open(&p, mode_of(state), 8192);
    char err[256];
    uint8_t out[64];
    struct kvx_frag bad[] = {
        {8192 - 10, out, 11},       /* one byte past the end */
        {8193, out, 1},             /* starts past the end */
        {UINT64_MAX - 2, out, 8},   /* offset + len overflows */
        {0, NULL, 8},               /* no local buffer */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err[0] = 0;
        struct kvx_frag two[2] = {{0, out, 8}, bad[i]}; /* a good one first: nothing posted */
        assert_int_equal(p.b->ops->read(p.b, p.peer, 0, two, 2, 1, err, sizeof err), KV_EINVAL);
        assert_true(strlen(err) > 0);
    }
    assert_int_equal(p.b->ops->read(p.b, p.peer, 2, bad, 1, 1, err, sizeof err), KV_EINVAL);
    assert_int_equal(p.b->ops->read(p.b, p.peer, 0, NULL, 3, 1, err, sizeof err), KV_EINVAL);
    assert_int_equal(p.b->ops->read(p.b, p.peer, 0, bad, -1, 1, err, sizeof err), KV_EINVAL);
    /* Refused reads left no completion behind; the exact last byte is fine. */
    struct kvx_completion c[2];
    assert_int_equal(p.b->ops->progress(p.b, c, 2, 0), 0);
    struct kvx_frag last = {8192 - 1, out, 1};
    read_ok(&p, &last, 1, 77);
    assert_int_equal(out[0], p.src[8191]);
    pair_close(&p);
}

/* The child of test_dead_peer (a fresh exec): exposes a pattern buffer, writes the descriptor
 * to fd `out` (u32 length + bytes; length 0: no UCX here), serves until fd `in` is readable,
 * then exits without cleanup (a dying peer). */
static int serve_child(int out, int in) {
    char err[256];
    kvx_transport_t *t = NULL;
    uint32_t n = 0;
    if (kvx_transport_ucx_new("127.0.0.1", &t, err, sizeof err) != KV_OK) {
        (void)!write(out, &n, 4);
        return 0;
    }
    static uint8_t buf[65536];
    fill_pattern(buf, sizeof buf, 9);
    kv_buf d;
    kv_buf_init(&d);
    if (t->ops->expose(t, buf, sizeof buf, &d, err, sizeof err) != KV_OK) return 1;
    n = (uint32_t)d.len;
    (void)!write(out, &n, 4);
    (void)!write(out, d.data, d.len);
    for (;;) {
        struct kvx_completion c;
        t->ops->progress(t, &c, 1, 5);
        fd_set rs;
        FD_ZERO(&rs);
        FD_SET(in, &rs);
        struct timeval tv = {0, 0};
        if (select(in + 1, &rs, NULL, NULL, &tv) > 0) break;
    }
    _exit(0);
}

/* A peer process that exits: the next read fails (completion or refusal), within the deadline. */
static void test_dead_peer(void **state) {
    const struct mode *m = mode_of(state);
    if (!kvx_transport_ucx_available()) skip();
    int to_parent[2], to_child[2];
    assert_int_equal(pipe(to_parent), 0);
    assert_int_equal(pipe(to_child), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* A fresh image: UCX state does not survive fork(). */
        close(to_parent[0]);
        close(to_child[1]);
        char a1[16], a2[16];
        snprintf(a1, sizeof a1, "%d", to_parent[1]);
        snprintf(a2, sizeof a2, "%d", to_child[0]);
        if (m->tls) setenv("UCX_TLS", m->tls, 1);
        if (m->err_mode) setenv("KVSERVE_UCX_ERR_MODE", m->err_mode, 1);
        execl("/proc/self/exe", "test_transport_ucx", "--serve", a1, a2, (char *)NULL);
        _exit(127);
    }
    close(to_parent[1]);
    close(to_child[0]);
    uint32_t n = 0;
    assert_int_equal(read(to_parent[0], &n, 4), 4);
    if (n == 0) {
        waitpid(pid, NULL, 0);
        print_message("SKIP: UCX cannot create a context here\n");
        skip();
    }
    uint8_t *d = malloc(n);
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(to_parent[0], d + got, n - got);
        assert_true(k > 0);
        got += (size_t)k;
    }
    char err[256] = "";
    /* The transport's own read deadline (error mode none): 3 s here instead of 30. */
    setenv("KVSERVE_UCX_READ_TIMEOUT_MS", "3000", 1);
    kvx_transport_t *b = new_ucx(m, err, sizeof err);
    unsetenv("KVSERVE_UCX_READ_TIMEOUT_MS");
    assert_non_null(b);
    kvx_peer_t *peer = NULL;
    assert_int_equal(b->ops->connect(b, d, n, &peer, err, sizeof err), KV_OK);
    uint8_t out[65536], want[65536];
    fill_pattern(want, sizeof want, 9);
    struct kvx_frag f = {0, out, sizeof out};
    struct kvx_completion c;
    assert_int_equal(b->ops->read(b, peer, 0, &f, 1, 1, err, sizeof err), KV_OK);
    int k = 0;
    double end = kv_now_s() + DEADLINE_S;
    while (!k && kv_now_s() < end) k = b->ops->progress(b, &c, 1, 10);
    assert_int_equal(k, 1);
    assert_int_equal(c.status, KV_OK);
    assert_memory_equal(out, want, sizeof out);
    /* Kill the peer, then read again. */
    (void)!write(to_child[1], "x", 1);
    waitpid(pid, NULL, 0);
    kv_status s = b->ops->read(b, peer, 0, &f, 1, 2, err, sizeof err);
    if (s == KV_OK) {
        k = 0;
        end = kv_now_s() + DEADLINE_S;
        while (!k && kv_now_s() < end) k = b->ops->progress(b, &c, 1, 10);
        assert_int_equal(k, 1);
        assert_int_equal(c.cookie, 2);
        print_message("dead peer: read completion %s: %s\n", kv_status_str(c.status),
                      c.message);
        assert_int_not_equal(c.status, KV_OK);
        /* The peer is failed now: further reads are refused at once. */
        assert_int_equal(b->ops->read(b, peer, 0, &f, 1, 3, err, sizeof err), KV_EIO);
    } else {
        print_message("dead peer: read refused: %s\n", err);
    }
    b->ops->disconnect(b, peer);
    b->ops->destroy(b);
    free(d);
    close(to_parent[0]);
    close(to_child[1]);
}

static void test_create_destroy_unused(void **state) {
    char err[256];
    kvx_transport_t *t = new_ucx(mode_of(state), err, sizeof err);
    if (!t) {
        print_message("SKIP: %s\n", err);
        skip();
    }
    t->ops->destroy(t);
    assert_int_equal(kvx_transport_ucx_new("127.0.0.1", NULL, err, sizeof err), KV_EINVAL);
}

static struct mode m_default = {NULL, NULL}, m_tcp = {"tcp", NULL}, m_peer = {NULL, "peer"};

static void test_bad_env(void **state) {
    (void)state;
    if (!kvx_transport_ucx_available()) {
        fprintf(stderr, "SKIP: this build has no UCX transport\n");
        skip();
    }
    char err[256] = "";
    kvx_transport_t *t = NULL;
    setenv("KVSERVE_UCX_ERR_MODE", "sometimes", 1);
    assert_int_equal(kvx_transport_ucx_new("127.0.0.1", &t, err, sizeof err), KV_EINVAL);
    unsetenv("KVSERVE_UCX_ERR_MODE");
    assert_null(t);
    assert_non_null(strstr(err, "KVSERVE_UCX_ERR_MODE"));
    setenv("KVSERVE_UCX_READ_TIMEOUT_MS", "-5", 1);
    assert_int_equal(kvx_transport_ucx_new("127.0.0.1", &t, err, sizeof err), KV_EINVAL);
    unsetenv("KVSERVE_UCX_READ_TIMEOUT_MS");
    assert_null(t);
}

#define BOTH(fn)                                                                           \
    cmocka_unit_test_prestate(fn, &m_default), cmocka_unit_test_prestate(fn, &m_tcp)

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--serve") == 0)
        return serve_child(atoi(argv[2]), atoi(argv[3]));
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        BOTH(test_create_destroy_unused), BOTH(test_contiguous),  BOTH(test_many_small),
        BOTH(test_shuffled_blocks),       BOTH(test_zero_fragments_and_cookies),
        BOTH(test_staging_region),        BOTH(test_bad_descriptors), BOTH(test_bad_rkey),
        BOTH(test_out_of_range),          BOTH(test_dead_peer),
        cmocka_unit_test_prestate(test_contiguous, &m_peer),
        cmocka_unit_test_prestate(test_dead_peer, &m_peer),
        cmocka_unit_test(test_bad_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
