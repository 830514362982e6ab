/*
 * The CUDA IPC KV transport (src/backend/cuda/transport_cuda_ipc.h) between two processes on
 * one GPU. The exposing process is this binary run again ("--exposer", fork + exec, so its
 * CUDA context is its own): it fills a 32 MiB device pool with a known byte pattern, exposes
 * it and writes the descriptor to a pipe. This process connects (cudaIpcOpenMemHandle) and
 * reads fragment lists into its own device pool, then copies that pool back and checks every
 * byte (FNV-1a checksums of the fragments, and the untouched bytes still zero):
 *   - one 4 MiB fragment; 64 blocks of 64 KiB from permuted (non-contiguous) source blocks
 *     into reversed destinations; a fragment across the 256 KiB chunk cut (1 MiB + 48 bytes);
 *     1100 non-contiguous 4 KiB fragments (more chunks than one launch takes); 37 fragments of
 *     odd lengths at unaligned offsets (the byte-copy path); three reads in flight at once
 *     (completions in order, each with its cookie); an empty read (a completion, no copy);
 *   - refusals: a fragment outside the peer's region (KV_EINVAL, no completion), corrupted,
 *     truncated and foreign-host descriptors (KV_EINVAL with the reason), and this process's
 *     own descriptor (read through its pointer: CUDA opens no handle in its exporter).
 * Skips (exit 77, a SKIP: line) in a build without CUDA or on a machine without a usable GPU.
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
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "cuda_test_util.h"
#include "test_util.h"

#ifdef KVSERVE_HAVE_CUDA
#include "backend/cuda/transport_cuda_ipc.h"

#define POOL (32u << 20)
#define SEED 0x5au

static uint8_t pat(uint64_t off, unsigned seed) {
    uint64_t x = (off + seed) * 0x9E3779B97F4A7C15ull;
    return (uint8_t)(x >> 56 ^ x >> 29 ^ off);
}

static uint64_t fnv(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}


/* The exposing process: 'S' + reason (skip), or 'D' + u32 length + descriptor; then it waits
 * for EOF on stdin and cleans up. */
static int exposer_main(void) {
    char why[256];
    if (kv_cuda_device_check(why, sizeof why) != KV_OK) {
        uint32_t n = (uint32_t)strlen(why);
        kv_write_all(1, "S", 1), kv_write_all(1, &n, 4), kv_write_all(1, why, n);
        return 0;
    }
    uint8_t *host = malloc(POOL);
    void *dev = kv_cuda_malloc(POOL);
    if (!host || !dev) return 3;
    for (size_t i = 0; i < POOL; i++) host[i] = pat(i, SEED);
    if (kv_cuda_memcpy(dev, host, POOL) != KV_OK) return 3;
    kvx_transport_t *t = NULL;
    kv_buf desc;
    kv_buf_init(&desc);
    if (kvx_transport_cuda_ipc_new(0, &t, why, sizeof why) != KV_OK ||
        t->ops->expose(t, dev, POOL, &desc, why, sizeof why) != KV_OK) {
        fprintf(stderr, "exposer: %s\n", why);
        return 3;
    }
    uint32_t n = (uint32_t)desc.len;
    kv_write_all(1, "D", 1), kv_write_all(1, &n, 4), kv_write_all(1, desc.data, n);
    char c;
    while (read(0, &c, 1) > 0) {
    }
    t->ops->destroy(t);
    kv_buf_free(&desc);
    kv_cuda_free(dev);
    free(host);
    return 0;
}

struct peer_proc {
    pid_t pid;
    int to, from; /* its stdin (we close it to end it), its stdout */
    uint8_t desc[4096];
    uint32_t n;
};

/* Starts the exposer; false + skip() when it has no GPU. */
static bool start_exposer(struct peer_proc *pp) {
    int in[2], out[2];
    assert_int_equal(pipe(in), 0);
    assert_int_equal(pipe(out), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(in[0], 0), dup2(out[1], 1);
        close(in[0]), close(in[1]), close(out[0]), close(out[1]);
        execl("/proc/self/exe", "test_cuda_ipc", "--exposer", (char *)NULL);
        _exit(127);
    }
    close(in[0]), close(out[1]);
    pp->pid = pid, pp->to = in[1], pp->from = out[0];
    char kind = 0;
    assert_int_equal(kv_read_all(pp->from, &kind, 1), 0);
    assert_int_equal(kv_read_all(pp->from, &pp->n, 4), 0);
    assert_true(pp->n < sizeof pp->desc);
    assert_int_equal(kv_read_all(pp->from, pp->desc, pp->n), 0);
    if (kind == 'S') {
        pp->desc[pp->n] = 0;
        fprintf(stderr, "SKIP: exposer: %s\n", (char *)pp->desc);
        return false;
    }
    assert_int_equal(kind, 'D');
    return true;
}

static void stop_exposer(struct peer_proc *pp) {
    close(pp->to);
    int status = 0;
    assert_int_equal(waitpid(pp->pid, &status, 0), pp->pid);
    close(pp->from);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Waits for the completion of cookie (the only read in flight, or the next in order). */
static struct kvx_completion wait_done(kvx_transport_t *t) {
    struct kvx_completion c;
    for (int i = 0; i < 20000; i++) {
        int n = t->ops->progress(t, &c, 1, 1);
        assert_true(n >= 0);
        if (n == 1) return c;
    }
    fail_msg("no completion within 20 s");
    return c;
}

/* Reads frags (remote offsets into the peer's pattern) into the local pool (zeroed first),
 * then checks every fragment's bytes and that nothing else changed. */
static void read_check(kvx_transport_t *t, kvx_peer_t *p, void *local, uint8_t *host, struct kvx_frag *fr, int n,
                       const char *what) {
    memset(host, 0, POOL);
    assert_int_equal(kv_cuda_memcpy(local, host, POOL), KV_OK);
    char err[256];
    assert_int_equal(t->ops->read(t, p, 0, fr, n, 77, err, sizeof err), KV_OK);
    struct kvx_completion c = wait_done(t);
    assert_int_equal(c.cookie, 77);
    if (c.status != KV_OK) fail_msg("%s: %s", what, c.message);
    assert_int_equal(kv_cuda_memcpy(host, local, POOL), KV_OK);
    uint8_t *want = calloc(1, POOL);
    assert_non_null(want);
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        size_t lo = (size_t)((uint8_t *)fr[i].local - (uint8_t *)local);
        for (size_t k = 0; k < fr[i].len; k++) want[lo + k] = pat(fr[i].remote_off + k, SEED);
        uint64_t a = fnv(host + lo, fr[i].len), b = fnv(want + lo, fr[i].len);
        if (a != b) fail_msg("%s: fragment %d (%zu bytes at remote %llu): checksum %016llx, expected %016llx", what, i,
                             fr[i].len, (unsigned long long)fr[i].remote_off, (unsigned long long)a,
                             (unsigned long long)b);
        bytes += fr[i].len;
    }
    assert_memory_equal(host, want, POOL); /* also: nothing outside the fragments was written */
    fprintf(stderr, "  %s: %d fragments, %zu bytes, checksum %016llx: exact\n", what, n, bytes,
            (unsigned long long)fnv(host, POOL));
    free(want);
}

static void test_cuda_ipc_reads(void **st) {
    (void)st;
    if (!gpu_ok()) skip();
    struct peer_proc pp;
    if (!start_exposer(&pp)) skip();
    char err[256];
    kvx_transport_t *t = NULL;
    assert_int_equal(kvx_transport_cuda_ipc_new(0, &t, err, sizeof err), KV_OK);
    assert_string_equal(t->ops->name, "cuda_ipc");
    kvx_peer_t *p = NULL;
    if (t->ops->connect(t, pp.desc, pp.n, &p, err, sizeof err) != KV_OK) fail_msg("connect: %s", err);
    uint8_t *local = kv_cuda_malloc(POOL), *host = malloc(POOL);
    assert_non_null(local);
    assert_non_null(host);
    struct kvx_frag *fr = calloc(2048, sizeof *fr);
    assert_non_null(fr);

    fr[0] = (struct kvx_frag){1u << 20, local, 4u << 20};
    read_check(t, p, local, host, fr, 1, "one 4 MiB fragment");

    for (int i = 0; i < 64; i++) /* source block (i * 37) % 64 (non-contiguous) -> dest 63 - i */
        fr[i] = (struct kvx_frag){(uint64_t)((i * 37) % 64) * 65536 + (8u << 20), local + (size_t)(63 - i) * 65536, 65536};
    read_check(t, p, local, host, fr, 64, "64 permuted 64 KiB blocks");

    fr[0] = (struct kvx_frag){3u << 20, local + 4096, (1u << 20) + 48};
    fr[1] = (struct kvx_frag){(3u << 20) + (1u << 20) + 48, local + 4096 + (1u << 20) + 48, 4096}; /* merges */
    read_check(t, p, local, host, fr, 2, "1 MiB + 48 bytes across chunk cuts (+ a contiguous one)");

    for (int i = 0; i < 1100; i++) /* every other 4 KiB source block, every third destination */
        fr[i] = (struct kvx_frag){(uint64_t)i * 8192, local + (size_t)i * 12288, 4096};
    read_check(t, p, local, host, fr, 1100, "1100 non-contiguous 4 KiB fragments");

    size_t lo = 100, ro = 7;
    for (int i = 0; i < 37; i++) { /* odd lengths, unaligned on both sides */
        size_t len = 1 + (size_t)i * 113 % 4099;
        fr[i] = (struct kvx_frag){ro, local + lo, len};
        ro += len + 3 + (size_t)i;
        lo += len + 5;
    }
    read_check(t, p, local, host, fr, 37, "37 odd-length unaligned fragments");

    /* three reads in flight: completions in order with their cookies */
    struct kvx_frag a = {0, local, 2u << 20}, b = {5u << 20, local + (4u << 20), 1u << 20},
                    c = {9u << 20, local + (8u << 20), 3u << 20};
    assert_int_equal(t->ops->read(t, p, 0, &a, 1, 1, err, sizeof err), KV_OK);
    assert_int_equal(t->ops->read(t, p, 0, &b, 1, 2, err, sizeof err), KV_OK);
    assert_int_equal(t->ops->read(t, p, 0, &c, 1, 3, err, sizeof err), KV_OK);
    for (uint64_t k = 1; k <= 3; k++) {
        struct kvx_completion d = wait_done(t);
        assert_int_equal(d.cookie, k);
        assert_int_equal(d.status, KV_OK);
    }
    assert_int_equal(kv_cuda_memcpy(host, local + (8u << 20), 3u << 20), KV_OK);
    for (size_t k = 0; k < (3u << 20); k += 4093) assert_int_equal(host[k], pat((9u << 20) + k, SEED));

    /* an empty read completes; a fragment outside the region is refused before any copy */
    assert_int_equal(t->ops->read(t, p, 0, NULL, 0, 9, err, sizeof err), KV_OK);
    struct kvx_completion e0 = wait_done(t);
    assert_int_equal(e0.cookie, 9);
    assert_int_equal(e0.status, KV_OK);
    struct kvx_frag bad = {POOL - 16, local, 32};
    assert_int_equal(t->ops->read(t, p, 0, &bad, 1, 10, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "outside"));
    struct kvx_completion none;
    assert_int_equal(t->ops->progress(t, &none, 1, 0), 0);

    t->ops->disconnect(t, p);
    t->ops->destroy(t);
    stop_exposer(&pp);
    kv_cuda_free(local);
    free(host);
    free(fr);
}

static void test_cuda_ipc_refusals(void **st) {
    (void)st;
    if (!gpu_ok()) skip();
    char err[256];
    kvx_transport_t *t = NULL;
    assert_int_equal(kvx_transport_cuda_ipc_new(0, &t, err, sizeof err), KV_OK);
    uint8_t *pool = kv_cuda_malloc(1u << 20), *host = malloc(1u << 20);
    assert_non_null(pool);
    for (size_t i = 0; i < (1u << 20); i++) host[i] = pat(i, 3);
    assert_int_equal(kv_cuda_memcpy(pool, host, 1u << 20), KV_OK);
    kv_buf desc;
    kv_buf_init(&desc);
    assert_int_equal(t->ops->expose(t, pool, 1u << 20, &desc, err, sizeof err), KV_OK);
    kvx_peer_t *p = NULL;
    uint8_t *d = malloc(desc.len);
    memcpy(d, desc.data, desc.len);

    d[100] ^= 1; /* corrupted */
    assert_int_equal(t->ops->connect(t, d, desc.len, &p, err, sizeof err), KV_EINVAL);
    assert_non_null(strstr(err, "checksum"));
    d[100] ^= 1;
    assert_int_equal(t->ops->connect(t, d, desc.len - 1, &p, err, sizeof err), KV_EINVAL); /* truncated */
    assert_int_equal(t->ops->connect(t, "KVXU....", 8, &p, err, sizeof err), KV_EINVAL);  /* another transport */
    /* another host: host name changed, checksum made valid again */
    d[56 + 40] ^= 0x20;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < desc.len - 8; i++) h = (h ^ d[i]) * 1099511628211ull;
    for (int i = 0; i < 8; i++) d[desc.len - 8 + (size_t)i] = (uint8_t)(h >> (8 * i));
    assert_int_equal(t->ops->connect(t, d, desc.len, &p, err, sizeof err), KV_EINVAL);
    fprintf(stderr, "  foreign host: %s\n", err);
    assert_non_null(strstr(err, "another host"));
    assert_null(p);

    /* our own descriptor: read through the exporter's pointer */
    assert_int_equal(t->ops->connect(t, desc.data, desc.len, &p, err, sizeof err), KV_OK);
    uint8_t *dst = kv_cuda_malloc(1u << 20);
    struct kvx_frag f = {4096, dst, 65536};
    assert_int_equal(t->ops->read(t, p, 0, &f, 1, 5, err, sizeof err), KV_OK);
    struct kvx_completion c = wait_done(t);
    assert_int_equal(c.status, KV_OK);
    assert_int_equal(kv_cuda_memcpy(host, dst, 65536), KV_OK);
    for (size_t i = 0; i < 65536; i++) assert_int_equal(host[i], pat(4096 + i, 3));
    t->ops->disconnect(t, p);
    t->ops->destroy(t);
    kv_buf_free(&desc);
    free(d);
    free(host);
    kv_cuda_free(pool);
    kv_cuda_free(dst);
}

#else /* !KVSERVE_HAVE_CUDA */
static int exposer_main(void) { return 0; }
static void test_cuda_ipc_reads(void **st) { (void)st; gpu_ok(); skip(); }
static void test_cuda_ipc_refusals(void **st) { (void)st; gpu_ok(); skip(); }
#endif

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--exposer")) return exposer_main();
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_ipc_reads),
        cmocka_unit_test(test_cuda_ipc_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
