/* Prefix token cache (see prefix_cache.h for the contract and the picture). Uses only the
 * public tokenizer API: token byte strings come from tok_token_bytes, built once per cache. */
#include "prefix_cache.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PC_MAX_AFFIX 8      /* ids add_special may put before / after the body */
#define PC_NO_BYTES UINT32_MAX

struct pc_entry {
    struct pc_entry *hnext;            /* bucket chain, longest text first */
    struct pc_entry *prev, *next;      /* LRU list: prev toward MRU */
    uint64_t h;                        /* hash of (options, text[0..bucket_bytes)) */
    bool add_special, parse_special;
    bool linked;                       /* in the index (false once evicted) */
    int refs;                          /* lookups using it outside the lock */
    char *text;                        /* owned, len bytes */
    size_t len;
    int32_t *ids;                      /* owned: tok_encode(text) incl. add_special affixes */
    size_t n_ids, n_post;              /* n_post: trailing add_special ids */
    size_t split_tok, split_byte;      /* ids[split_tok] starts at text[split_byte] */
};

struct prefix_cache {
    const tokenizer_t *t;              /* borrowed */
    struct prefix_cache_config c;
    int n_vocab;
    uint32_t *tb_off;                  /* (n_vocab + 1) offsets into tb; tb_len PC_NO_BYTES = unknown */
    uint32_t *tb_len;                  /* (n_vocab) */
    char *tb;                          /* concatenated raw token bytes */
    uint8_t *special;                  /* (n_vocab) tok_is_special */
    bool dummy_prefix;                 /* "a" encodes as " a" (SentencePiece dummy prefix) */
    int32_t pre[PC_MAX_AFFIX], post[PC_MAX_AFFIX];
    size_t n_pre, n_post;
    bool affix_ok;                     /* add_special = pre + body + post (probe agreed) */

    pthread_mutex_t mu;
    struct pc_entry **tab;             /* (nb) bucket heads */
    size_t nb;
    struct pc_entry *mru, *lru;
    size_t n_entries, total_bytes;
    struct prefix_cache_stats st;
};

void prefix_cache_config_default(struct prefix_cache_config *c) {
    c->max_entries = 512;
    c->max_total_bytes = (size_t)64 << 20;
    c->overlap_tokens = 64;
    c->resync_tokens = 32;
    c->min_bytes = 4096;
    c->bucket_bytes = 2048;
    c->strict_split = true;
}

kv_status prefix_cache_config_validate(const struct prefix_cache_config *c, char *err,
                                       size_t errlen) {
    if (!c) return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: no configuration");
    if (c->max_entries == 0)
        return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: entries must be > 0");
    if (c->max_entries > ((size_t)1 << 24))
        return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: entries must be <= %zu",
                       (size_t)1 << 24);
    if (c->max_total_bytes == 0)
        return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: max-chars must be > 0");
    if (c->overlap_tokens == 0)
        return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: overlap must be > 0");
    if (c->resync_tokens == 0)
        return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: resync must be > 0");
    if (c->resync_tokens > c->overlap_tokens)
        return kv_errf(KV_EINVAL, err, errlen,
                       "prefix token cache: resync (%zu) must not exceed overlap (%zu): the ids "
                       "compared must lie before the end of the cached prompt",
                       c->resync_tokens, c->overlap_tokens);
    if (c->bucket_bytes == 0)
        return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: bucket size must be > 0");
    return KV_OK;
}

/* ---- token byte table ---- */

static bool tb_get(const prefix_cache_t *pc, int32_t id, const char **p, size_t *n) {
    if (id < 0 || id >= pc->n_vocab || pc->tb_len[id] == PC_NO_BYTES) return false;
    *p = pc->tb + pc->tb_off[id];
    *n = pc->tb_len[id];
    return true;
}

static kv_status build_table(prefix_cache_t *pc) {
    int nv = pc->n_vocab;
    pc->tb_off = kv_malloc(((size_t)nv + 1) * sizeof *pc->tb_off);
    pc->tb_len = kv_malloc(((size_t)nv + 1) * sizeof *pc->tb_len);
    pc->special = kv_calloc((size_t)nv + 1, 1);
    kv_buf b;
    kv_buf_init(&b);
    if (!pc->tb_off || !pc->tb_len || !pc->special) return KV_ENOMEM;
    char buf[4096];
    for (int id = 0; id < nv; id++) {
        pc->tb_off[id] = (uint32_t)b.len;
        pc->special[id] = tok_is_special(pc->t, id);
        int n = tok_token_bytes(pc->t, id, buf, sizeof buf);
        if (n < 0) {
            pc->tb_len[id] = PC_NO_BYTES;
            continue;
        }
        pc->tb_len[id] = (uint32_t)n;
        if (n && kv_buf_append(&b, buf, (size_t)n)) {
            kv_buf_free(&b);
            return KV_ENOMEM;
        }
    }
    pc->tb_off[nv] = (uint32_t)b.len;
    if (b.len >= UINT32_MAX) {
        kv_buf_free(&b);
        return KV_ENOMEM;
    }
    pc->tb = b.data ? b.data : kv_malloc(1);
    return pc->tb ? KV_OK : KV_ENOMEM;
}

/* What add_special adds around the body, and whether the tokenizer has a dummy prefix. */
static kv_status probe(prefix_cache_t *pc) {
    static const char probe_text[] = "a";
    int32_t *w = NULL, *v = NULL;
    size_t nw = 0, nv = 0;
    kv_status st = tok_encode(pc->t, probe_text, 1, true, false, &w, &nw);
    if (!st) st = tok_encode(pc->t, probe_text, 1, false, false, &v, &nv);
    if (st) {
        free(w);
        return st;
    }
    pc->affix_ok = false;
    for (size_t pre = 0; pre + nv <= nw && pre <= PC_MAX_AFFIX; pre++) {
        size_t post = nw - nv - pre;
        if (post > PC_MAX_AFFIX) continue;
        if (memcmp(w + pre, v, nv * sizeof *v) != 0) continue;
        memcpy(pc->pre, w, pre * sizeof *w);
        memcpy(pc->post, w + pre + nv, post * sizeof *w);
        pc->n_pre = pre;
        pc->n_post = post;
        pc->affix_ok = true;
        break;
    }
    /* dummy prefix: the body's bytes spell " a" */
    size_t tot = 0;
    char sp[8];
    bool ok = true;
    for (size_t i = 0; i < nv && ok; i++) {
        const char *p;
        size_t n;
        if (!tb_get(pc, v[i], &p, &n) || tot + n > sizeof sp) ok = false;
        else {
            memcpy(sp + tot, p, n);
            tot += n;
        }
    }
    pc->dummy_prefix = ok && tot == 2 && sp[0] == ' ' && sp[1] == 'a';
    free(w);
    free(v);
    return KV_OK;
}

kv_status prefix_cache_new(const tokenizer_t *t, const struct prefix_cache_config *c,
                           prefix_cache_t **out, char *err, size_t errlen) {
    if (!t || !out) return kv_errf(KV_EINVAL, err, errlen, "prefix token cache: no tokenizer");
    kv_status st = prefix_cache_config_validate(c, err, errlen);
    if (st) return st;
    prefix_cache_t *pc = kv_calloc(1, sizeof *pc);
    if (!pc) return kv_errf(KV_ENOMEM, err, errlen, "prefix token cache: out of memory");
    pc->t = t;
    pc->c = *c;
    pc->n_vocab = tok_n_vocab(t);
    pthread_mutex_init(&pc->mu, NULL);
    pc->nb = 64;
    while (pc->nb < 2 * c->max_entries) pc->nb <<= 1;
    pc->tab = kv_calloc(pc->nb, sizeof *pc->tab);
    st = pc->tab && pc->n_vocab > 0 ? build_table(pc) : KV_ENOMEM;
    if (!st) st = probe(pc);
    if (st) {
        prefix_cache_free(pc);
        return kv_errf(st, err, errlen, "prefix token cache: cannot probe the tokenizer: %s",
                       kv_status_str(st));
    }
    *out = pc;
    return KV_OK;
}

static void entry_free(struct pc_entry *e) {
    if (!e) return;
    free(e->text);
    free(e->ids);
    free(e);
}

void prefix_cache_free(prefix_cache_t *pc) {
    if (!pc) return;
    for (struct pc_entry *e = pc->mru, *nx; e; e = nx) {
        nx = e->next;
        entry_free(e);
    }
    free(pc->tab);
    free(pc->tb_off);
    free(pc->tb_len);
    free(pc->tb);
    free(pc->special);
    pthread_mutex_destroy(&pc->mu);
    free(pc);
}

const struct prefix_cache_config *prefix_cache_get_config(const prefix_cache_t *pc) {
    return pc ? &pc->c : NULL;
}

void prefix_cache_get_stats(prefix_cache_t *pc, struct prefix_cache_stats *s) {
    memset(s, 0, sizeof *s);
    if (!pc) return;
    pthread_mutex_lock(&pc->mu);
    *s = pc->st;
    s->entries = pc->n_entries;
    s->total_bytes = pc->total_bytes;
    pthread_mutex_unlock(&pc->mu);
}

/* ---- index (caller holds mu) ---- */

static uint64_t key_hash(const prefix_cache_t *pc, const char *text, size_t len, bool as, bool ps) {
    uint64_t h = 1469598103934665603ull ^ ((uint64_t)as << 1 | (uint64_t)ps);
    size_t n = len < pc->c.bucket_bytes ? len : pc->c.bucket_bytes;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)text[i];
        h *= 1099511628211ull;
    }
    h ^= h >> 29;
    return h;
}

static void lru_unlink(prefix_cache_t *pc, struct pc_entry *e) {
    if (e->prev) e->prev->next = e->next;
    else pc->mru = e->next;
    if (e->next) e->next->prev = e->prev;
    else pc->lru = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push_front(prefix_cache_t *pc, struct pc_entry *e) {
    e->prev = NULL;
    e->next = pc->mru;
    if (pc->mru) pc->mru->prev = e;
    pc->mru = e;
    if (!pc->lru) pc->lru = e;
}

static void index_remove(prefix_cache_t *pc, struct pc_entry *e) {
    struct pc_entry **pp = &pc->tab[e->h & (pc->nb - 1)];
    while (*pp && *pp != e) pp = &(*pp)->hnext;
    if (*pp) *pp = e->hnext;
    e->hnext = NULL;
    lru_unlink(pc, e);
    e->linked = false;
    pc->n_entries--;
    pc->total_bytes -= e->len;
    if (e->refs == 0) entry_free(e);
}

static struct pc_entry *lookup(prefix_cache_t *pc, uint64_t h, const char *text, size_t len,
                               bool as, bool ps) {
    for (struct pc_entry *e = pc->tab[h & (pc->nb - 1)]; e; e = e->hnext) {
        if (e->h != h || e->len > len || e->add_special != as || e->parse_special != ps) continue;
        if (memcmp(e->text, text, e->len) == 0) return e; /* chain is longest first */
    }
    return NULL;
}

/* ---- alignment of ids with the text ---- */

static inline bool ascii_alpha(unsigned char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
}

/* Whether ids[i], starting at text[c], may be a split point. */
static bool eligible(const prefix_cache_t *pc, const char *text, size_t len, int32_t id, size_t c) {
    if (c == 0 || c >= len || pc->special[id]) return false;
    unsigned char ch = (unsigned char)text[c];
    if ((ch & 0xC0) == 0x80) return false; /* inside a UTF-8 character */
    if (pc->dummy_prefix && (ch != ' ' || c + 1 >= len)) return false;
    if (pc->c.strict_split) {
        unsigned char before = (unsigned char)text[c - 1];
        if (ch != ' ' || c + 1 >= len || !ascii_alpha((unsigned char)text[c + 1])) return false;
        if (before <= 0x20 || before >= 0x7F) return false;
    }
    return true;
}

/* Walks ids[from..to) against text[pos..len) and returns true when their bytes spell it
 * exactly. With a dummy-prefix tokenizer every segment (the start when dummy0, and the text
 * after each special token) gets one extra leading space, which the walk expects and skips.
 * starts (optional, indexed i - from) receives each token's start offset in the text, or
 * SIZE_MAX for a token that carries a dummy space (never a split point). */
static bool walk(const prefix_cache_t *pc, const int32_t *ids, size_t from, size_t to,
                 const char *text, size_t pos, size_t len, bool dummy0, size_t *starts) {
    bool need = pc->dummy_prefix && dummy0;
    for (size_t i = from; i < to; i++) {
        const char *p;
        size_t n;
        if (!tb_get(pc, ids[i], &p, &n)) return false;
        size_t start = pos;
        if (pc->special[ids[i]]) {
            need = pc->dummy_prefix;
        } else if (need && n) {
            if (p[0] != ' ') return false;
            p++;
            n--;
            need = false;
            start = SIZE_MAX;
        }
        if (n > len - pos || memcmp(text + pos, p, n) != 0) return false;
        if (starts) starts[i - from] = start;
        pos += n;
    }
    return pos == len;
}

/* Picks the split of a new entry: the last eligible token at or before body_end - overlap
 * and not before lo. starts[i - lo] is token i's start (from walk). */
static bool pick_split(const prefix_cache_t *pc, const int32_t *ids, size_t lo, size_t body_end,
                       const size_t *starts, const char *text, size_t len, size_t *split_tok,
                       size_t *split_byte) {
    if (body_end <= pc->c.overlap_tokens) return false;
    size_t target = body_end - pc->c.overlap_tokens;
    if (target >= body_end) return false;
    for (size_t i = target + 1; i-- > lo;) {
        size_t c = starts[i - lo];
        if (c != SIZE_MAX && eligible(pc, text, len, ids[i], c)) {
            *split_tok = i;
            *split_byte = c;
            return true;
        }
    }
    return false;
}

/* ---- insertion ---- */

static void insert(prefix_cache_t *pc, uint64_t h, const char *text, size_t len, bool as, bool ps,
                   const int32_t *ids, size_t n_ids, size_t n_post, size_t split_tok,
                   size_t split_byte) {
    if (len < pc->c.bucket_bytes || len > pc->c.max_total_bytes) return;
    struct pc_entry *e = kv_calloc(1, sizeof *e);
    if (e) {
        e->text = kv_malloc(len);
        e->ids = kv_malloc(n_ids * sizeof *ids);
    }
    if (!e || !e->text || !e->ids) {
        entry_free(e);
        pthread_mutex_lock(&pc->mu);
        pc->st.errors++;
        pthread_mutex_unlock(&pc->mu);
        return;
    }
    memcpy(e->text, text, len);
    memcpy(e->ids, ids, n_ids * sizeof *ids);
    e->len = len;
    e->n_ids = n_ids;
    e->n_post = n_post;
    e->split_tok = split_tok;
    e->split_byte = split_byte;
    e->h = h;
    e->add_special = as;
    e->parse_special = ps;
    pthread_mutex_lock(&pc->mu);
    struct pc_entry **pp = &pc->tab[h & (pc->nb - 1)];
    for (struct pc_entry *x = *pp; x; x = x->hnext) {
        if (x->h == h && x->len == len && x->add_special == as && x->parse_special == ps &&
            memcmp(x->text, text, len) == 0) { /* stored by another thread meanwhile */
            pthread_mutex_unlock(&pc->mu);
            entry_free(e);
            return;
        }
    }
    while (*pp && (*pp)->len > len) pp = &(*pp)->hnext;
    e->hnext = *pp;
    *pp = e;
    e->linked = true;
    lru_push_front(pc, e);
    pc->n_entries++;
    pc->total_bytes += len;
    pc->st.inserts++;
    while ((pc->n_entries > pc->c.max_entries || pc->total_bytes > pc->c.max_total_bytes) &&
           pc->lru && pc->lru != e) {
        index_remove(pc, pc->lru);
        pc->st.evictions++;
    }
    pthread_mutex_unlock(&pc->mu);
}

/* Stores a fully tokenized prompt if its ids can be aligned with the text. */
static void insert_full(prefix_cache_t *pc, uint64_t h, const char *text, size_t len, bool as,
                        bool ps, const int32_t *ids, size_t n) {
    if (len < pc->c.bucket_bytes || len > pc->c.max_total_bytes) return;
    size_t post = 0, from = 0;
    if (as) {
        if (!pc->affix_ok || n < pc->n_post) return;
        post = pc->n_post;
        if (memcmp(ids + n - post, pc->post, post * sizeof *ids) != 0) return;
    }
    size_t body_end = n - post;
    size_t *starts = kv_malloc((body_end + 1) * sizeof *starts);
    if (!starts) return;
    /* the BOS that add_special put in front is not in the text; one parsed from it is */
    if (as && pc->n_pre && body_end >= pc->n_pre &&
        memcmp(ids, pc->pre, pc->n_pre * sizeof *ids) == 0 &&
        walk(pc, ids, pc->n_pre, body_end, text, 0, len, true, starts))
        from = pc->n_pre;
    else if (!walk(pc, ids, 0, body_end, text, 0, len, true, starts)) {
        free(starts);
        return;
    }
    size_t st, sb;
    bool ok = pick_split(pc, ids + from, 0, body_end - from, starts, text, len, &st, &sb);
    free(starts);
    if (!ok) return;
    st += from;
    insert(pc, h, text, len, as, ps, ids, n, post, st, sb);
}

/* ---- encode ---- */

static void release(prefix_cache_t *pc, struct pc_entry *e) {
    pthread_mutex_lock(&pc->mu);
    if (--e->refs == 0 && !e->linked) entry_free(e);
    pthread_mutex_unlock(&pc->mu);
}

kv_status prefix_cache_encode(prefix_cache_t *pc, const char *text, size_t len, bool add_special,
                              bool parse_special, int32_t **ids, size_t *n_ids) {
    if (!pc || (!text && len) || !ids || !n_ids) return KV_EINVAL;
    if (len < pc->c.min_bytes || (add_special && !pc->affix_ok))
        return tok_encode(pc->t, text, len, add_special, parse_special, ids, n_ids);

    uint64_t h = key_hash(pc, text, len, add_special, parse_special);
    pthread_mutex_lock(&pc->mu);
    struct pc_entry *e = lookup(pc, h, text, len, add_special, parse_special);
    if (e) {
        e->refs++;
        lru_unlink(pc, e);
        lru_push_front(pc, e);
    }
    pthread_mutex_unlock(&pc->mu);

    bool resync_failed = false, error = false;
    if (e) {
        if (e->len == len) { /* exact repeat: the entry's ids are the answer */
            int32_t *r = kv_malloc((e->n_ids ? e->n_ids : 1) * sizeof *r);
            if (r) {
                size_t n = e->n_ids;
                memcpy(r, e->ids, n * sizeof *r);
                release(pc, e);
                pthread_mutex_lock(&pc->mu);
                pc->st.hits++;
                pthread_mutex_unlock(&pc->mu);
                *ids = r;
                *n_ids = n;
                return KV_OK;
            }
            error = true;
        } else {
            size_t c = e->split_byte, t0 = c + (pc->dummy_prefix ? 1 : 0);
            int32_t *tail = NULL;
            size_t nt = 0, *starts = NULL;
            kv_status st = tok_encode(pc->t, text + t0, len - t0, false, parse_special, &tail, &nt);
            size_t body_e = e->n_ids - e->n_post;
            size_t span = pc->c.resync_tokens;
            if (span > nt) span = nt;
            if (span > body_e - e->split_tok) span = body_e - e->split_tok;
            if (!st && !(starts = kv_malloc((nt + 1) * sizeof *starts))) st = KV_ENOMEM;
            if (st) error = true;
            else if (span == 0 || memcmp(tail, e->ids + e->split_tok, span * sizeof *tail) != 0 ||
                     !walk(pc, tail, 0, nt, text, t0, len, true, starts))
                resync_failed = true;
            else {
                size_t n = e->split_tok + nt + e->n_post;
                int32_t *r = kv_malloc(n * sizeof *r);
                if (!r) error = true;
                else {
                    memcpy(r, e->ids, e->split_tok * sizeof *r);
                    memcpy(r + e->split_tok, tail, nt * sizeof *r);
                    memcpy(r + e->split_tok + nt, e->ids + body_e, e->n_post * sizeof *r);
                    size_t n_post = e->n_post;
                    /* the new entry's split: in the tail (whose starts are known), else the
                     * old split (known eligible) */
                    size_t s2, b2;
                    if (pick_split(pc, tail, 0, nt, starts, text, len, &s2, &b2)) s2 += e->split_tok;
                    else {
                        s2 = e->split_tok;
                        b2 = c;
                    }
                    release(pc, e);
                    free(tail);
                    free(starts);
                    pthread_mutex_lock(&pc->mu);
                    pc->st.hits++;
                    pthread_mutex_unlock(&pc->mu);
                    insert(pc, h, text, len, add_special, parse_special, r, n, n_post, s2, b2);
                    *ids = r;
                    *n_ids = n;
                    return KV_OK;
                }
            }
            free(starts);
            free(tail);
        }
        release(pc, e);
    }

    kv_status st = tok_encode(pc->t, text, len, add_special, parse_special, ids, n_ids);
    pthread_mutex_lock(&pc->mu);
    pc->st.misses++;
    if (resync_failed) pc->st.resync_failures++;
    if (error) pc->st.errors++;
    pthread_mutex_unlock(&pc->mu);
    if (st) return st;
    insert_full(pc, h, text, len, add_special, parse_special, *ids, *n_ids);
    return KV_OK;
}
