/* Randomized model test of the KV pool's reuse index, host tier and root LRU
 * (src/kvcache/kvcache.c) against a plain reference written from kvcache.h's contract: tens
 * of thousands of random operations (roots, allocate + register, lookup + acquire, ref,
 * release, clear), with colliding hashes, more roots than the root LRU keeps, and a pool
 * small enough that evictions to and from the host tier happen all the time. After every
 * operation the pool must agree with the model: which blocks are handed out, every lookup
 * (hit, miss, tier, uid), refcounts, the free / cached / host counts, and the queued copies. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"

#define T 2          /* tokens per block */
#define NB 24        /* device blocks */
#define NH 10        /* host slots */
#define ALPHA 3      /* token alphabet: contents repeat */
#define MAX_ROOTS 4096 /* kvcache.c keeps this many roots (kv_pool_root_uid) */
#define MAXE 100000

/* ---- the reference ---- */
struct mentry {
    uint64_t uid, parent;
    int32_t tok[T];
    kv_hash h;
    bool live;       /* still indexed somewhere */
    bool host;       /* in the host tier (else on device block `block`) */
    int block;
};
static struct mentry E[MAXE];
static int nE;
static int refc[NB];        /* model refcount per device block */
static int dev_entry[NB];   /* entry indexed on block b, or -1 */
static int dlru[NB], n_dlru;        /* CACHED device blocks, oldest first */
static int hlru[NH], n_hlru;        /* host entries (entry ids), oldest first */
static struct { uint32_t key; uint64_t uid, last; } R[MAX_ROOTS];
static int nR;
static uint64_t use_clock, max_uid; /* uids are never reused: a new one exceeds all before */
static int held[4 * NB], n_held;    /* our holds (a block appears once per hold) */

static void arr_remove(int *a, int *n, int v) {
    for (int i = 0; i < *n; i++)
        if (a[i] == v) {
            memmove(a + i, a + i + 1, (size_t)(*n - i - 1) * sizeof *a);
            (*n)--;
            return;
        }
    fail_msg("model: %d not in list", v);
}

static int model_free(void) {
    int n = 0;
    for (int b = 0; b < NB; b++) n += refc[b] == 0 && dev_entry[b] < 0;
    return n;
}

static int model_find(uint64_t parent, const int32_t *tok, const kv_hash *h) {
    for (int i = 0; i < nE; i++)
        if (E[i].live && E[i].parent == parent && !memcmp(E[i].tok, tok, sizeof E[i].tok) &&
            !memcmp(E[i].h.b, h->b, KV_HASH_LEN))
            return i;
    return -1;
}

/* What kv_pool_alloc does when nothing is free: the oldest CACHED block goes, its entry to
 * the host tier (dropping the oldest host entry when the tier is full) or out of the index.
 * Returns the block the pool must hand out next (-1: any free one; -2: none). */
static int model_alloc_expect(int *to_host_entry) {
    *to_host_entry = -1;
    if (model_free() > 0) return -1;
    if (n_dlru == 0) return -2;
    int b = dlru[0];
    *to_host_entry = dev_entry[b];
    return b;
}

/* pinned_host: a host entry being acquired still holds its slot (out of the host LRU). */
static void model_take_block(int b, int moved_entry, int pinned_host) {
    if (moved_entry >= 0) { /* evicted from the device */
        arr_remove(dlru, &n_dlru, b);
        dev_entry[b] = -1;
        if (NH > 0) {
            if (n_hlru + pinned_host == NH) { /* no free slot: the oldest host entry is dropped */
                E[hlru[0]].live = false;
                arr_remove(hlru, &n_hlru, hlru[0]);
            }
            E[moved_entry].host = true;
            E[moved_entry].block = -1;
            hlru[n_hlru++] = moved_entry;
        } else {
            E[moved_entry].live = false;
        }
    }
    refc[b] = 1;
}

/* ---- the pool under test ---- */
static kv_pool_t *P;
static kv_rng G;
static uint32_t cold_pct = 20, root_pct = 15, cold_keys = 20000; /* operation mix */

static uint32_t rnd(uint32_t n) { return (uint32_t)(kv_rng_next(&G) % n); }

static kv_hash hash_of(uint64_t parent, const int32_t *tok, bool collide) {
    kv_hash h;
    memset(&h, 0, sizeof h);
    if (collide) return h; /* every colliding entry shares one hash: exact matching decides */
    uint64_t x = parent * 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < T; i++) x = (x ^ (uint64_t)tok[i]) * 0x100000001b3ull;
    memcpy(h.b, &x, sizeof x);
    h.b[8] = 1;
    return h;
}

static void check_copies(int n_to_host, int n_to_device) {
    int n = 0;
    const struct kv_copy_op *c = kv_pool_pending_copies(P, &n);
    int th = 0, td = 0;
    for (int i = 0; i < n; i++) *(c[i].to_host ? &th : &td) += 1;
    assert_int_equal(th, n_to_host);
    assert_int_equal(td, n_to_device);
    kv_pool_clear_copies(P);
}

/* Looks a random known entry up in the pool and in the model; they must agree. Returns the
 * model entry found (-1: a miss) and the pool's entry id in *e. */
static int lookup_both(int *e) {
    struct mentry *m = &E[rnd((uint32_t)nE)];
    uint64_t uid = 0;
    *e = kv_pool_lookup(P, m->parent, &m->h, m->tok, &uid);
    int w = model_find(m->parent, m->tok, &m->h);
    if (w < 0) {
        assert_int_equal(*e, -1);
        return -1;
    }
    assert_true(*e >= 0);
    assert_true(uid == E[w].uid);
    assert_int_equal(*e >= NB, E[w].host);
    if (!E[w].host) assert_int_equal(*e, E[w].block);
    return w;
}

static void check_state(void) {
    int cached = n_dlru;
    assert_int_equal(kv_pool_n_free(P), model_free() + cached);
    assert_int_equal(kv_pool_n_cached(P), cached);
    assert_int_equal(kv_pool_n_host_cached(P), n_hlru);
    for (int b = 0; b < NB; b++) assert_int_equal(kv_pool_refcount(P, b), refc[b]);
    int e;
    for (int k = 0; k < 8 && nE; k++) lookup_both(&e); /* sampled lookups agree */
}

static void op_root(void);

static uint64_t random_parent(void) {
    if (!nR && !nE) op_root();
    if (nR && (!nE || rnd(3) == 0)) return R[rnd((uint32_t)nR)].uid;
    return E[rnd((uint32_t)nE)].uid; /* possibly dropped: new children still register */
}

static void op_root(void) {
    /* a few hot roots, and cold ones (more than the pool keeps when cold_pct is high) */
    uint32_t key = rnd(100) >= cold_pct ? rnd(64) : 64 + rnd(cold_keys);
    uint64_t uid = kv_pool_root_uid(P, &key, sizeof key);
    use_clock++;
    for (int i = 0; i < nR; i++)
        if (R[i].key == key) {
            assert_true(uid == R[i].uid);
            R[i].last = use_clock;
            return;
        }
    int slot = nR;
    if (nR == MAX_ROOTS) { /* the least recently used root is forgotten */
        slot = 0;
        for (int i = 1; i < nR; i++)
            if (R[i].last < R[slot].last) slot = i;
    } else {
        nR++;
    }
    assert_true(uid > max_uid); /* a root the model forgot is forgotten by the pool too */
    max_uid = uid;
    R[slot].key = key;
    R[slot].uid = uid;
    R[slot].last = use_clock;
}

static void op_alloc_register(void) {
    if (n_held == (int)(sizeof held / sizeof held[0])) return;
    int moved = -1;
    int want = model_alloc_expect(&moved);
    int b = kv_pool_alloc(P);
    if (want == -2) {
        assert_int_equal(b, -1);
        return;
    }
    assert_true(b >= 0 && b < NB);
    if (want >= 0) assert_int_equal(b, want);
    else assert_true(refc[b] == 0 && dev_entry[b] < 0); /* a free block */
    model_take_block(b, moved, 0);
    check_copies(moved >= 0 && NH > 0 ? 1 : 0, 0);
    held[n_held++] = b;
    if (rnd(4) == 0) return; /* an unregistered block (still being computed) */
    int32_t tok[T];
    for (int i = 0; i < T; i++) tok[i] = (int32_t)rnd(ALPHA);
    uint64_t parent = random_parent();
    kv_hash h = hash_of(parent, tok, rnd(8) == 0), ph = {{0}};
    uint64_t uid = kv_pool_register(P, b, parent, &ph, &h, tok);
    int w = model_find(parent, tok, &h);
    if (w >= 0) {
        assert_true(uid == E[w].uid); /* an equal entry exists: b stays unindexed */
        return;
    }
    assert_true(uid > max_uid);
    max_uid = uid;
    assert_true(nE < MAXE);
    struct mentry *m = &E[nE];
    memset(m, 0, sizeof *m);
    m->uid = uid;
    m->parent = parent;
    memcpy(m->tok, tok, sizeof tok);
    m->h = h;
    m->live = true;
    m->block = b;
    dev_entry[b] = nE++;
}

static void op_acquire(void) {
    if (!nE || n_held == (int)(sizeof held / sizeof held[0])) return;
    int e, w = lookup_both(&e);
    if (w < 0) return;
    struct mentry *x = &E[w];
    if (!x->host) {
        assert_int_equal(kv_pool_acquire(P, e), x->block);
        if (refc[x->block] == 0) arr_remove(dlru, &n_dlru, x->block);
        refc[x->block]++;
        held[n_held++] = x->block;
        check_copies(0, 0);
        return;
    }
    /* from the host tier: out of the host LRU while a device block is found */
    arr_remove(hlru, &n_hlru, w);
    int moved = -1;
    int want = model_alloc_expect(&moved);
    int b = kv_pool_acquire(P, e);
    if (want == -2) {
        assert_int_equal(b, -1);
        hlru[n_hlru++] = w; /* back, as the newest */
        check_copies(0, 0);
        return;
    }
    assert_true(b >= 0);
    if (want >= 0) assert_int_equal(b, want);
    else assert_true(refc[b] == 0 && dev_entry[b] < 0);
    model_take_block(b, moved, 1);
    check_copies(moved >= 0 ? 1 : 0, 1);
    x->host = false;
    x->block = b;
    dev_entry[b] = w;
    held[n_held++] = b;
}

static void op_release(void) {
    if (!n_held) return;
    int i = (int)rnd((uint32_t)n_held);
    int b = held[i];
    held[i] = held[--n_held];
    kv_pool_release(P, b);
    if (--refc[b] == 0 && dev_entry[b] >= 0) dlru[n_dlru++] = b;
}

static void op_ref(void) {
    if (!n_held || n_held == (int)(sizeof held / sizeof held[0])) return;
    int b = held[rnd((uint32_t)n_held)];
    kv_pool_ref(P, b);
    refc[b]++;
    held[n_held++] = b;
}

static void op_clear(void) {
    kv_pool_clear_cache(P);
    for (int i = 0; i < n_dlru; i++) {
        E[dev_entry[dlru[i]]].live = false;
        dev_entry[dlru[i]] = -1;
    }
    n_dlru = 0;
    for (int i = 0; i < n_hlru; i++) E[hlru[i]].live = false;
    n_hlru = 0;
}

static void run(uint64_t seed, int n_ops) {
    kv_rng_seed(&G, seed);
    P = kv_pool_new(NB, T);
    assert_non_null(P);
    assert_int_equal(kv_pool_enable_reuse(P, NH), KV_OK);
    nE = nR = n_dlru = n_hlru = n_held = 0;
    use_clock = max_uid = 0;
    for (int b = 0; b < NB; b++) refc[b] = 0, dev_entry[b] = -1;
    for (int k = 0; k < n_ops; k++) {
        uint32_t r = rnd(100);
        if (r < root_pct) op_root();
        else if (r < root_pct + 30) op_alloc_register();
        else if (r < root_pct + 50) op_acquire();
        else if (r < root_pct + 77) op_release();
        else if (r < root_pct + 84) op_ref();
        else if (rnd(10) == 0) op_clear();
        check_state();
    }
    while (n_held) op_release();
    check_state();
    assert_int_equal(kv_pool_n_free(P), NB); /* every block free or cached */
    struct kv_pool_stats ps;
    kv_pool_get_stats(P, &ps);
    fprintf(stderr, "seed %llu: %d entries, %d roots; evictions %llu, offloads %llu, host hits %llu, "
            "host evictions %llu, device hits %llu\n", (unsigned long long)seed, nE, nR,
            (unsigned long long)ps.evictions, (unsigned long long)ps.offloads,
            (unsigned long long)ps.hits_host, (unsigned long long)ps.host_evictions,
            (unsigned long long)ps.hits_device);
    /* the run went through every path */
    assert_true(ps.offloads > 0 && ps.hits_host > 0 && ps.host_evictions > 0 && ps.hits_device > 0);
    kv_pool_free(P);
}

static void test_model_random_ops(void **st) {
    (void)st;
    for (uint64_t seed = 1; seed <= 6; seed++) run(seed, 8000);
}

/* More roots than the pool keeps (4096): forgotten roots get new uids, their chains stay
 * unreachable, and the rest still match. */
static void test_model_root_lru(void **st) {
    (void)st;
    cold_pct = 95;
    root_pct = 40;
    cold_keys = 4300; /* just over the 4096 the pool keeps: forgotten roots come back */
    run(99, 40000);
    assert_true(nR == MAX_ROOTS); /* the root LRU was full and evicting */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_random_ops),
        cmocka_unit_test(test_model_root_lru),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
