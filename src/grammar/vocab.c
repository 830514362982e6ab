/*
 * Vocabulary tries, token masks and the per-grammar mask cache (grammar.h).
 *
 * The trie holds every allowed-able token's output bytes, nodes in preorder:
 *
 *   node i: byte, depth, end (first node after i's subtree), tokens ending here
 *     ""  -> 'a' -> 'b' (tok 7) -> 'c' (tok 9)        preorder: a(0) b(1) c(2) x(3)
 *         -> 'x' (tok 3)                              end:      3    3    3    4
 *
 * A mask is one pass over the nodes: the state at depth d is advanced from the state at
 * depth d-1 by the node's byte; an empty state skips the whole subtree (i = end).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

struct gram_vocab {
    uint64_t uid;              /* process-unique: keys the masks cached in grammars */
    int n_vocab;
    int words;                 /* ceil(n_vocab / 64) */
    char *bytes;               /* all tokens' bytes */
    int32_t *off, *len;        /* (n_vocab) */
    int32_t *eog;              /* (n_eog) */
    int n_eog;
    /* trie, preorder */
    int n_nodes;
    uint8_t *nbyte;            /* (n_nodes) */
    uint16_t *ndepth;          /* (n_nodes) 1-based */
    int32_t *nend;             /* (n_nodes) */
    int32_t *ntok;             /* (n_nodes) first index into sorted[] of the tokens ending here */
    uint16_t *nntok;           /* (n_nodes) how many */
    int32_t *sorted;           /* token ids in byte order */
    int max_depth;
};

static _Atomic uint64_t g_vocab_uid = 1;
static _Atomic uint64_t g_hits, g_misses, g_walk_ns, g_nodes, g_work, g_over_budget;

void gram_get_stats(struct gram_stats *out) {
    out->mask_hits = atomic_load(&g_hits);
    out->mask_misses = atomic_load(&g_misses);
    out->walk_ns = atomic_load(&g_walk_ns);
    out->trie_nodes_visited = atomic_load(&g_nodes);
    out->work_units = atomic_load(&g_work);
    out->over_budget = atomic_load(&g_over_budget);
}

void gram_vocab_free(gram_vocab_t *v) {
    if (!v) return;
    free(v->bytes);
    free(v->off);
    free(v->len);
    free(v->eog);
    free(v->nbyte);
    free(v->ndepth);
    free(v->nend);
    free(v->ntok);
    free(v->nntok);
    free(v->sorted);
    free(v);
}

int gram_vocab_size(const gram_vocab_t *v) { return v ? v->n_vocab : 0; }

const char *gram_vocab_token(const gram_vocab_t *v, int32_t id, int *len) {
    if (!v || id < 0 || id >= v->n_vocab) {
        *len = 0;
        return "";
    }
    *len = v->len[id];
    return v->bytes + v->off[id];
}

static int tok_cmp(const void *a, const void *b, void *arg) {
    const gram_vocab_t *v = arg;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    int lx = v->len[x], ly = v->len[y];
    int c = memcmp(v->bytes + v->off[x], v->bytes + v->off[y], (size_t)(lx < ly ? lx : ly));
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

static bool build_trie(gram_vocab_t *v) {
    int n = 0;
    size_t total = 0;
    for (int i = 0; i < v->n_vocab; i++)
        if (v->len[i] > 0) {
            n++;
            total += (size_t)v->len[i];
        }
    v->sorted = kv_malloc((size_t)(n ? n : 1) * sizeof *v->sorted);
    size_t cap = total + 1;
    v->nbyte = kv_malloc(cap);
    v->ndepth = kv_malloc(cap * sizeof *v->ndepth);
    v->nend = kv_malloc(cap * sizeof *v->nend);
    v->ntok = kv_malloc(cap * sizeof *v->ntok);
    v->nntok = kv_calloc(cap, sizeof *v->nntok);
    int32_t *path = kv_malloc((size_t)(65536 + 1) * sizeof *path);
    if (!v->sorted || !v->nbyte || !v->ndepth || !v->nend || !v->ntok || !v->nntok || !path) {
        free(path);
        return false;
    }
    for (int i = 0, k = 0; i < v->n_vocab; i++)
        if (v->len[i] > 0) v->sorted[k++] = i;
    qsort_r(v->sorted, (size_t)n, sizeof *v->sorted, tok_cmp, v);
    int depth = 0, nn = 0;
    const char *prev = NULL;
    int prev_len = 0;
    for (int k = 0; k < n; k++) {
        int32_t id = v->sorted[k];
        const char *s = v->bytes + v->off[id];
        int l = v->len[id];
        int lcp = 0;
        while (prev && lcp < l && lcp < prev_len && s[lcp] == prev[lcp]) lcp++;
        while (depth > lcp) v->nend[path[--depth]] = nn;
        for (int i = lcp; i < l; i++) {
            v->nbyte[nn] = (uint8_t)s[i];
            v->ndepth[nn] = (uint16_t)(i + 1);
            v->ntok[nn] = 0;
            path[depth++] = nn++;
        }
        int last = path[depth - 1];
        if (v->nntok[last] == 0) v->ntok[last] = k;
        if (v->nntok[last] < UINT16_MAX) v->nntok[last]++;
        if (l > v->max_depth) v->max_depth = l;
        prev = s;
        prev_len = l;
    }
    while (depth > 0) v->nend[path[--depth]] = nn;
    v->n_nodes = nn;
    free(path);
    return true;
}

gram_vocab_t *gram_vocab_new_bytes(const char *const *tok_bytes, const int *tok_len, int n_vocab,
                                   const int32_t *eog, int n_eog) {
    gram_vocab_t *v = kv_calloc(1, sizeof *v);
    if (!v) return NULL;
    v->uid = atomic_fetch_add(&g_vocab_uid, 1);
    v->n_vocab = n_vocab;
    v->words = (n_vocab + 63) / 64;
    size_t total = 0;
    for (int i = 0; i < n_vocab; i++)
        if (tok_bytes[i] && tok_len[i] > 0 && tok_len[i] < 65536) total += (size_t)tok_len[i];
    v->bytes = kv_malloc(total + 1);
    v->off = kv_calloc((size_t)(n_vocab ? n_vocab : 1), sizeof *v->off);
    v->len = kv_calloc((size_t)(n_vocab ? n_vocab : 1), sizeof *v->len);
    v->eog = kv_malloc((size_t)(n_eog ? n_eog : 1) * sizeof *v->eog);
    if (!v->bytes || !v->off || !v->len || !v->eog) goto oom;
    size_t o = 0;
    for (int i = 0; i < n_vocab; i++) {
        v->off[i] = (int32_t)o;
        if (!tok_bytes[i] || tok_len[i] <= 0 || tok_len[i] >= 65536) continue;
        memcpy(v->bytes + o, tok_bytes[i], (size_t)tok_len[i]);
        v->len[i] = tok_len[i];
        o += (size_t)tok_len[i];
    }
    for (int i = 0; i < n_eog; i++)
        if (eog[i] >= 0 && eog[i] < n_vocab) {
            v->eog[v->n_eog++] = eog[i];
            v->len[eog[i]] = 0; /* an end token is EOS, never text */
        }
    if (!build_trie(v)) goto oom;
    return v;
oom:
    gram_vocab_free(v);
    return NULL;
}

gram_vocab_t *gram_vocab_new(const tokenizer_t *t, int n_vocab, const int32_t *eog, int n_eog) {
    int nt = tok_n_vocab(t);
    char **b = kv_calloc((size_t)(n_vocab ? n_vocab : 1), sizeof *b);
    int *l = kv_calloc((size_t)(n_vocab ? n_vocab : 1), sizeof *l);
    gram_vocab_t *v = NULL;
    char buf[1024];
    if (!b || !l) goto out;
    for (int i = 0; i < n_vocab && i < nt; i++) {
        if (tok_is_special(t, i)) continue;
        int n = tok_token_bytes(t, i, buf, sizeof buf);
        if (n <= 0) continue;
        b[i] = kv_malloc((size_t)n);
        if (!b[i]) goto out;
        memcpy(b[i], buf, (size_t)n);
        l[i] = n;
    }
    v = gram_vocab_new_bytes((const char *const *)b, l, n_vocab, eog, n_eog);
out:
    if (b)
        for (int i = 0; i < n_vocab; i++) free(b[i]);
    free(b);
    free(l);
    return v;
}

/* ---------------------------------------------------------------- mask cache */

struct mc_entry {
    uint64_t hash;
    int32_t *key;              /* owned (key_len ints); NULL = empty slot */
    int key_len;
    uint64_t *bits;            /* owned (words) */
    int n_allowed;
    uint64_t work;             /* work units the trie walk took (charged again on a hit) */
};

struct gram_mask_cache {
    uint64_t vocab_uid;
    int words;
    struct mc_entry *tab;      /* (cap) open addressing, linear probing */
    int cap, n;
    size_t bytes;
};

/* Mask memory: at most MC_MAX_BYTES per grammar and MC_GLOBAL_BYTES in all grammars
 * together (compiled grammars live in an LRU of 64); a grammar over its share starts its cache
 * over, an insertion over the global budget is skipped. */
#define MC_MAX_BYTES ((size_t)32 << 20)
#define MC_GLOBAL_BYTES ((size_t)256 << 20)
static _Atomic size_t g_mc_bytes;

static void mc_clear(struct gram_mask_cache *c) {
    for (int i = 0; i < c->cap; i++) {
        free(c->tab[i].key);
        free(c->tab[i].bits);
    }
    memset(c->tab, 0, (size_t)c->cap * sizeof *c->tab);
    c->n = 0;
    atomic_fetch_sub(&g_mc_bytes, c->bytes);
    c->bytes = 0;
}

void gram_mask_cache_free(struct gram_mask_cache *c) {
    if (!c) return;
    mc_clear(c);
    free(c->tab);
    free(c);
}

static uint64_t key_hash(const int32_t *k, int n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (int i = 0; i < n; i++) {
        h ^= (uint32_t)k[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    return h ? h : 1;
}

/* Under g->mu. The cache for v (a cache built for another vocabulary is dropped). */
static struct gram_mask_cache *mc_for(gram_t *g, const gram_vocab_t *v) {
    struct gram_mask_cache *c = g->cache;
    if (c && c->vocab_uid == v->uid) return c;
    if (c) {
        gram_mask_cache_free(c);
        g->cache = NULL;
    }
    c = kv_calloc(1, sizeof *c);
    if (!c) return NULL;
    c->cap = 256;
    c->tab = kv_calloc((size_t)c->cap, sizeof *c->tab);
    if (!c->tab) {
        free(c);
        return NULL;
    }
    c->vocab_uid = v->uid;
    c->words = v->words;
    g->cache = c;
    return c;
}

static struct mc_entry *mc_find(struct gram_mask_cache *c, const int32_t *k, int n, uint64_t h) {
    for (int i = (int)(h & (uint64_t)(c->cap - 1));; i = (i + 1) & (c->cap - 1)) {
        struct mc_entry *e = &c->tab[i];
        if (!e->key) return e;
        if (e->hash == h && e->key_len == n && !memcmp(e->key, k, (size_t)n * sizeof *k)) return e;
    }
}

static void mc_insert(struct gram_mask_cache *c, const int32_t *k, int n, uint64_t h, uint64_t work,
                      const uint64_t *bits, int n_allowed) {
    size_t sz = (size_t)n * sizeof *k + (size_t)c->words * sizeof *bits;
    if (c->bytes + sz > MC_MAX_BYTES) mc_clear(c); /* simple and rare: start over */
    if (atomic_load(&g_mc_bytes) + sz > MC_GLOBAL_BYTES) return;
    if ((c->n + 1) * 2 > c->cap) {
        int nc = c->cap * 2;
        struct mc_entry *nt = kv_calloc((size_t)nc, sizeof *nt);
        if (!nt) return;
        struct mc_entry *old = c->tab;
        int oc = c->cap;
        c->tab = nt;
        c->cap = nc;
        for (int i = 0; i < oc; i++)
            if (old[i].key) *mc_find(c, old[i].key, old[i].key_len, old[i].hash) = old[i];
        free(old);
    }
    struct mc_entry *e = mc_find(c, k, n, h);
    if (e->key) return; /* another matcher inserted it meanwhile */
    int32_t *kc = kv_malloc((size_t)(n ? n : 1) * sizeof *kc);
    uint64_t *bc = kv_malloc((size_t)c->words * sizeof *bc);
    if (!kc || !bc) {
        free(kc);
        free(bc);
        return;
    }
    memcpy(kc, k, (size_t)n * sizeof *k);
    memcpy(bc, bits, (size_t)c->words * sizeof *bits);
    *e = (struct mc_entry){h, kc, n, bc, n_allowed, work};
    c->n++;
    c->bytes += sz;
    atomic_fetch_add(&g_mc_bytes, sz);
}

/* ---------------------------------------------------------------- matcher */

struct gram_matcher {
    gram_t *g;
    const gram_vocab_t *v;
    struct gstate st, next, spare;
    bool final;                /* an end-of-generation token was accepted */
    uint64_t *mask;            /* (v->words) */
    bool mask_valid;
    int n_allowed;
    /* trie walk scratch: states by depth in one arena */
    int32_t *arena;
    int arena_cap;
    int32_t *doff, *dlen, *dn;  /* (max_depth + 1) */
    uint64_t work;             /* work units of the last trie walk */
    kv_status fail;            /* why the last gram_matcher_mask returned NULL */
};

gram_matcher_t *gram_matcher_new(gram_t *g, const gram_vocab_t *v) {
    if (!g || !v) return NULL;
    gram_matcher_t *m = kv_calloc(1, sizeof *m);
    if (!m) return NULL;
    m->g = gram_ref(g);
    m->v = v;
    m->mask = kv_malloc((size_t)(v->words ? v->words : 1) * sizeof *m->mask);
    m->st.v = kv_malloc((size_t)(g->n_start ? g->n_start : 1) * sizeof *m->st.v);
    if (!m->mask || !m->st.v) {
        gram_matcher_free(m);
        return NULL;
    }
    m->st.cap = g->n_start ? g->n_start : 1;
    memcpy(m->st.v, g->start, (size_t)g->n_start * sizeof *g->start);
    m->st.len = g->n_start;
    for (int off = 0; off < m->st.len; off += m->st.v[off] + 1) {
        m->st.n_stacks++;
        if (m->st.v[off] == 0) m->st.accept = true;
    }
    gstate_canon(&m->st);
    return m;
}

gram_matcher_t *gram_matcher_clone(const gram_matcher_t *src) {
    gram_matcher_t *m = kv_calloc(1, sizeof *m);
    if (!m) return NULL;
    m->g = gram_ref(src->g);
    m->v = src->v;
    m->final = src->final;
    m->mask = kv_malloc((size_t)(src->v->words ? src->v->words : 1) * sizeof *m->mask);
    if (!m->mask || !gstate_copy(&m->st, &src->st)) {
        gram_matcher_free(m);
        return NULL;
    }
    return m;
}

void gram_matcher_free(gram_matcher_t *m) {
    if (!m) return;
    gram_unref(m->g);
    gstate_free(&m->st);
    gstate_free(&m->next);
    gstate_free(&m->spare);
    free(m->mask);
    free(m->arena);
    free(m->doff);
    free(m->dlen);
    free(m->dn);
    free(m);
}

bool gram_matcher_is_complete(const gram_matcher_t *m) { return m->final || m->st.accept; }

bool gram_matcher_is_final(const gram_matcher_t *m) {
    return m->final || (m->st.accept && m->st.n_stacks == 1);
}

static bool is_eog(const gram_vocab_t *v, int32_t id) {
    for (int i = 0; i < v->n_eog; i++)
        if (v->eog[i] == id) return true;
    return false;
}

/* ---------------------------------------------------------------- the trie walk
 * Two ways to walk: walk_memo interns every parser state it reaches and memoizes the
 * transition (state, byte) -> state, so a state that loops on itself (inside a string every
 * plain character leads back to the same state) costs one table lookup per trie node;
 * walk_plain recomputes every transition and is used when a walk meets more than
 * WALK_MAX_STATES distinct states. Both give the same bits. */

#define WALK_MAX_STATES 4096
static int g_walk_max_states = WALK_MAX_STATES;
void gram_walk_set_max_states(int n) { g_walk_max_states = n > 0 && n <= WALK_MAX_STATES ? n : WALK_MAX_STATES; }
#define T_UNKNOWN (-2)
#define T_DEAD (-1)

struct walk_scratch {
    int32_t *arena;            /* interned state contents, back to back */
    int arena_len, arena_cap;
    int32_t *soff, *slen;      /* (cap_states) per state: offset, ints */
    int n_states, cap_states;
    int32_t *trans;            /* (cap_states * 256) next state, T_UNKNOWN or T_DEAD */
    int32_t *htab;             /* (hcap) state ids by content hash, -1 empty */
    uint64_t *shash;           /* (cap_states) */
    int hcap;
    int32_t *sid;              /* (cap_sid) state id by trie depth */
    int cap_sid;
};

static pthread_key_t g_ws_key;
static pthread_once_t g_ws_once = PTHREAD_ONCE_INIT;

static void ws_free(void *p) {
    struct walk_scratch *w = p;
    if (!w) return;
    free(w->arena);
    free(w->soff);
    free(w->slen);
    free(w->trans);
    free(w->htab);
    free(w->shash);
    free(w->sid);
    free(w);
}

static void ws_key_init(void) { pthread_key_create(&g_ws_key, ws_free); }

/* The calling thread's scratch (freed when the thread exits). */
static struct walk_scratch *ws_get(void) {
    pthread_once(&g_ws_once, ws_key_init);
    struct walk_scratch *w = pthread_getspecific(g_ws_key);
    if (!w) {
        w = kv_calloc(1, sizeof *w);
        if (w && pthread_setspecific(g_ws_key, w) != 0) {
            free(w);
            w = NULL;
        }
    }
    return w;
}

static bool ws_reserve_arena(struct walk_scratch *w, int need) {
    if (w->arena_len + need <= w->arena_cap) return true;
    int nc = w->arena_cap ? w->arena_cap : 65536;
    while (nc < w->arena_len + need) nc *= 2;
    int32_t *na = kv_realloc(w->arena, (size_t)nc * sizeof *na);
    if (!na) return false;
    w->arena = na;
    w->arena_cap = nc;
    return true;
}

/* Interns the state at arena[arena_len .. arena_len + len) (just written there). Returns its
 * id (an existing one: the copy is dropped), -3 when over WALK_MAX_STATES, -4 on ENOMEM. */
static int ws_intern(struct walk_scratch *w, int len) {
    const int32_t *c = w->arena + w->arena_len;
    uint64_t h = key_hash(c, len);
    int mask = w->hcap - 1;
    int slot = (int)(h & (uint64_t)mask);
    for (; w->htab[slot] >= 0; slot = (slot + 1) & mask) {
        int id = w->htab[slot];
        if (w->shash[id] == h && w->slen[id] == len && !memcmp(w->arena + w->soff[id], c, (size_t)len * sizeof *c))
            return id;
    }
    if (w->n_states >= g_walk_max_states) return -3;
    if (w->n_states == w->cap_states) {
        int nc = w->cap_states ? w->cap_states * 2 : 64;
        int32_t *so = kv_realloc(w->soff, (size_t)nc * sizeof *so);
        if (!so) return -4;
        w->soff = so;
        int32_t *sl = kv_realloc(w->slen, (size_t)nc * sizeof *sl);
        if (!sl) return -4;
        w->slen = sl;
        uint64_t *sh = kv_realloc(w->shash, (size_t)nc * sizeof *sh);
        if (!sh) return -4;
        w->shash = sh;
        int32_t *tr = kv_realloc(w->trans, (size_t)nc * 256 * sizeof *tr);
        if (!tr) return -4;
        w->trans = tr;
        w->cap_states = nc;
    }
    int id = w->n_states++;
    w->soff[id] = w->arena_len;
    w->slen[id] = len;
    w->shash[id] = h;
    for (int k = 0; k < 256; k++) w->trans[(size_t)id * 256 + (size_t)k] = T_UNKNOWN;
    w->arena_len += len;
    w->htab[slot] = id;
    return id;
}

static void set_tokens(const gram_vocab_t *v, int node, uint64_t *mask, int *n_allowed) {
    for (int k = 0; k < v->nntok[node]; k++) {
        int32_t id = v->sorted[v->ntok[node] + k];
        mask[id >> 6] |= 1ull << (id & 63);
        (*n_allowed)++;
    }
}

static _Atomic uint64_t g_mask_budget = GRAM_MASK_BUDGET;
void gram_set_mask_budget(uint64_t units) { atomic_store(&g_mask_budget, units ? units : GRAM_MASK_BUDGET); }
uint64_t gram_mask_budget(void) { return atomic_load(&g_mask_budget); }

/* 1 done, 0 too many states (use walk_plain), -1 ENOMEM, -2 over the work budget. */
static int walk_memo(gram_matcher_t *m, int *n_allowed, uint64_t *visited, uint64_t budget) {
    const gram_vocab_t *v = m->v;
    const gram_t *g = m->g;
    struct walk_scratch *w = ws_get();
    if (!w) return -1;
    if (w->cap_sid < v->max_depth + 1) {
        int32_t *ns = kv_realloc(w->sid, (size_t)(v->max_depth + 1) * sizeof *ns);
        if (!ns) return -1;
        w->sid = ns;
        w->cap_sid = v->max_depth + 1;
    }
    if (!w->htab) {
        w->hcap = 2 * WALK_MAX_STATES;
        w->htab = kv_malloc((size_t)w->hcap * sizeof *w->htab);
        if (!w->htab) return -1;
    }
    memset(w->htab, 0xff, (size_t)w->hcap * sizeof *w->htab);
    w->n_states = 0;
    w->arena_len = 0;
    if (!ws_reserve_arena(w, m->st.len + 1)) return -1;
    memcpy(w->arena, m->st.v, (size_t)m->st.len * sizeof *w->arena);
    int id0 = ws_intern(w, m->st.len);
    if (id0 < 0) return id0 == -3 ? 0 : -1;
    w->sid[0] = id0;
    for (int i = 0; i < v->n_nodes;) {
        int d = v->ndepth[i];
        int p = w->sid[d - 1];
        int32_t *tp = &w->trans[(size_t)p * 256 + v->nbyte[i]];
        int t = *tp;
        (*visited)++;
        if (++m->work > budget) return -2;
        if (t == T_UNKNOWN) {
            int n_out = 0, len;
            bool acc = false, ovf = false;
            for (;;) {
                int room = w->arena_cap - w->arena_len;
                len = gstate_advance_raw(g, w->arena + w->soff[p], w->slen[p], v->nbyte[i], w->arena + w->arena_len,
                                         room, &n_out, &acc, &ovf, &m->work);
                if (len >= 0) break;
                if (!ws_reserve_arena(w, w->arena_cap)) return -1;
            }
            if (n_out == 0) t = T_DEAD;
            else {
                t = ws_intern(w, len);
                if (t == -3) return 0;
                if (t < 0) return -1;
            }
            w->trans[(size_t)p * 256 + v->nbyte[i]] = t; /* tp may have moved */
        }
        if (t == T_DEAD) {
            i = v->nend[i];
            continue;
        }
        w->sid[d] = t;
        set_tokens(v, i, m->mask, n_allowed);
        i++;
    }
    return 1;
}

/* The walk without memoization: states by depth in a stack-like arena. 1 done, -1 ENOMEM,
 * -2 over the work budget. */
static int walk_plain(gram_matcher_t *m, int *n_allowed, uint64_t *visited, uint64_t budget) {
    const gram_vocab_t *v = m->v;
    const gram_t *g = m->g;
    if (!m->doff) {
        m->doff = kv_malloc((size_t)(v->max_depth + 2) * sizeof *m->doff);
        m->dlen = kv_malloc((size_t)(v->max_depth + 2) * sizeof *m->dlen);
        m->dn = kv_malloc((size_t)(v->max_depth + 2) * sizeof *m->dn);
        if (!m->doff || !m->dlen || !m->dn) return -1;
    }
    if (m->arena_cap < m->st.len + 4096) {
        int nc = m->st.len + 65536;
        int32_t *na = kv_realloc(m->arena, (size_t)nc * sizeof *na);
        if (!na) return -1;
        m->arena = na;
        m->arena_cap = nc;
    }
    memcpy(m->arena, m->st.v, (size_t)m->st.len * sizeof *m->arena);
    m->doff[0] = 0;
    m->dlen[0] = m->st.len;
    m->dn[0] = m->st.n_stacks;
    for (int i = 0; i < v->n_nodes;) {
        int d = v->ndepth[i];
        int po = m->doff[d - 1], pl = m->dlen[d - 1];
        int o = po + pl;
        int n_out = 0;
        bool acc = false, ovf = false;
        int w;
        (*visited)++;
        if (++m->work > budget) return -2;
        while ((w = gstate_advance_raw(g, m->arena + po, pl, v->nbyte[i], m->arena + o,
                                       m->arena_cap - o, &n_out, &acc, &ovf, &m->work)) < 0) {
            int nc = m->arena_cap * 2;
            int32_t *na = kv_realloc(m->arena, (size_t)nc * sizeof *na);
            if (!na) return -1;
            m->arena = na;
            m->arena_cap = nc;
        }
        if (n_out == 0) {
            i = v->nend[i];
            continue;
        }
        m->doff[d] = o;
        m->dlen[d] = w;
        m->dn[d] = n_out;
        set_tokens(v, i, m->mask, n_allowed);
        i++;
    }
    return 1;
}

/* Fills m->mask for m->st. KV_ENOMEM, or KV_ETOOLONG when the walk needs more than the
 * work budget (both walks together: the budget bounds the whole mask). */
static kv_status walk(gram_matcher_t *m, uint64_t budget) {
    const gram_vocab_t *v = m->v;
    int n_allowed = 0;
    uint64_t visited = 0;
    m->work = 0;
    memset(m->mask, 0, (size_t)v->words * sizeof *m->mask);
    int r = walk_memo(m, &n_allowed, &visited, budget);
    if (r == 0) {
        memset(m->mask, 0, (size_t)v->words * sizeof *m->mask);
        n_allowed = 0;
        r = walk_plain(m, &n_allowed, &visited, budget);
    }
    atomic_fetch_add(&g_nodes, visited);
    atomic_fetch_add(&g_work, m->work);
    if (r == -2) {
        atomic_fetch_add(&g_over_budget, 1);
        return KV_ETOOLONG;
    }
    if (r < 0) return KV_ENOMEM;
    if (m->st.accept)
        for (int k = 0; k < v->n_eog; k++) {
            int32_t id = v->eog[k];
            if (!((m->mask[id >> 6] >> (id & 63)) & 1)) n_allowed++;
            m->mask[id >> 6] |= 1ull << (id & 63);
        }
    m->n_allowed = n_allowed;
    return KV_OK;
}

const uint64_t *gram_matcher_mask(gram_matcher_t *m, int *n_allowed) {
    return gram_matcher_mask_within(m, gram_mask_budget(), n_allowed);
}

const uint64_t *gram_matcher_mask_within(gram_matcher_t *m, uint64_t budget, int *n_allowed) {
    uint64_t def = gram_mask_budget();
    if (budget > def) budget = def;
    m->fail = KV_OK;
    if (m->mask_valid) { /* the same state as the last call: m->work is its cost */
        if (n_allowed) *n_allowed = m->n_allowed;
        return m->mask;
    }
    const gram_vocab_t *v = m->v;
    if (m->final) {
        memset(m->mask, 0, (size_t)v->words * sizeof *m->mask);
        m->n_allowed = 0;
        m->mask_valid = true;
        m->work = 0;
        if (n_allowed) *n_allowed = 0;
        return m->mask;
    }
    uint64_t h = key_hash(m->st.v, m->st.len);
    gram_t *g = m->g;
    pthread_mutex_lock(&g->mu);
    struct gram_mask_cache *c = mc_for(g, v);
    struct mc_entry *e = c ? mc_find(c, m->st.v, m->st.len, h) : NULL;
    if (e && e->key) {
        /* a hit is charged what the walk cost, so whether a mask is over the budget never
         * depends on which request computed it first */
        m->work = e->work;
        if (e->work > budget) {
            pthread_mutex_unlock(&g->mu);
            atomic_fetch_add(&g_over_budget, 1);
            m->fail = KV_ETOOLONG;
            return NULL;
        }
        memcpy(m->mask, e->bits, (size_t)v->words * sizeof *m->mask);
        m->n_allowed = e->n_allowed;
        pthread_mutex_unlock(&g->mu);
        atomic_fetch_add(&g_hits, 1);
    } else {
        pthread_mutex_unlock(&g->mu);
        uint64_t t0 = kv_now_ns();
        kv_status st = walk(m, budget);
        if (st) {
            m->fail = st;
            return NULL;
        }
        atomic_fetch_add(&g_walk_ns, kv_now_ns() - t0);
        atomic_fetch_add(&g_misses, 1);
        pthread_mutex_lock(&g->mu);
        c = mc_for(g, v);
        if (c) mc_insert(c, m->st.v, m->st.len, h, m->work, m->mask, m->n_allowed);
        pthread_mutex_unlock(&g->mu);
    }
    m->mask_valid = true;
    if (n_allowed) *n_allowed = m->n_allowed;
    return m->mask;
}

kv_status gram_matcher_status(const gram_matcher_t *m) { return m->fail; }
uint64_t gram_matcher_last_work(const gram_matcher_t *m) { return m->work; }
uint64_t gram_matcher_state_key(const gram_matcher_t *m) { return key_hash(m->st.v, m->st.len) ^ (uint64_t)m->final; }

bool gram_matcher_accept_bytes(gram_matcher_t *m, const char *s, size_t n) {
    if (m->final) return n == 0;
    if (n == 0) return true;
    /* ping-pong between m->next and m->spare (kept between calls: no allocation per token) */
    struct gstate *cur = &m->st, *out = &m->next;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        if (!gstate_advance(m->g, cur, (uint8_t)s[i], out) || out->n_stacks == 0) {
            ok = false;
            break;
        }
        cur = out;
        out = out == &m->next ? &m->spare : &m->next;
    }
    if (!ok) return false;
    struct gstate t = m->st; /* cur holds the result: swap it into st */
    m->st = *cur;
    *cur = t;
    gstate_canon(&m->st);
    m->mask_valid = false;
    return true;
}

bool gram_matcher_accept(gram_matcher_t *m, int32_t id) {
    const gram_vocab_t *v = m->v;
    if (m->final || id < 0 || id >= v->n_vocab) return false;
    if (is_eog(v, id)) {
        if (!m->st.accept) return false;
        m->final = true;
        m->mask_valid = false;
        return true;
    }
    if (v->len[id] == 0) return false;
    return gram_matcher_accept_bytes(m, v->bytes + v->off[id], (size_t)v->len[id]);
}
