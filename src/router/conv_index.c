/* conv_index: conversations (LRU) and their content-key nodes (conv_index.h). */
#include "conv_index.h"

#include <stdlib.h>
#include <string.h>

struct conv {
    char *id;        /* owned; NULL = free slot */
    int worker;
    uint64_t *keys;  /* (max_keys) owned */
    int n_keys;
    int prev, next;  /* LRU list (head = MRU) */
    int hnext;       /* id hash chain */
};

struct node {
    uint64_t key;
    uint32_t convs;  /* tracked conversations holding this key */
    int last;        /* conversation slot of the latest one, -1 when it is gone */
    int hnext;       /* key hash chain; free list link when unused */
};

struct conv_index {
    int max_convs, max_keys;
    struct conv *c;  /* (max_convs) */
    int n, free_c;   /* live conversations; free slot list through .next */
    int head, tail;
    int *chead;      /* (cbuckets) id hash heads */
    int cbuckets;
    struct node *nd; /* (ncap) */
    int ncap, nlive, free_n;
    int *nhead;      /* (nbuckets) */
    int nbuckets;
};

static uint64_t str_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

conv_index_t *conv_index_new(int max_convs, int max_keys) {
    if (max_convs < 1 || max_keys < 1) return NULL;
    conv_index_t *ci = calloc(1, sizeof *ci);
    if (!ci) return NULL;
    ci->max_convs = max_convs;
    ci->max_keys = max_keys;
    ci->cbuckets = 64;
    while (ci->cbuckets < max_convs && ci->cbuckets < (1 << 20)) ci->cbuckets <<= 1;
    ci->c = calloc((size_t)max_convs, sizeof *ci->c);
    ci->chead = malloc((size_t)ci->cbuckets * sizeof *ci->chead);
    ci->nbuckets = 1024;
    ci->nhead = malloc((size_t)ci->nbuckets * sizeof *ci->nhead);
    if (!ci->c || !ci->chead || !ci->nhead) {
        conv_index_free(ci);
        return NULL;
    }
    for (int i = 0; i < ci->cbuckets; i++) ci->chead[i] = -1;
    for (int i = 0; i < ci->nbuckets; i++) ci->nhead[i] = -1;
    for (int i = 0; i < max_convs; i++) ci->c[i].next = i + 1 < max_convs ? i + 1 : -1;
    ci->free_c = 0;
    ci->head = ci->tail = -1;
    ci->free_n = -1;
    return ci;
}

void conv_index_free(conv_index_t *ci) {
    if (!ci) return;
    if (ci->c)
        for (int i = 0; i < ci->max_convs; i++) {
            free(ci->c[i].id);
            free(ci->c[i].keys);
        }
    free(ci->c);
    free(ci->chead);
    free(ci->nd);
    free(ci->nhead);
    free(ci);
}

int conv_index_size(const conv_index_t *ci) { return ci->n; }

int conv_index_count_worker(const conv_index_t *ci, int worker) {
    int k = 0;
    for (int i = ci->head; i >= 0; i = ci->c[i].next) k += ci->c[i].worker == worker;
    return k;
}

/* ---- key nodes ---- */

static int node_find(const conv_index_t *ci, uint64_t key) {
    for (int i = ci->nhead[mix(key) & (uint64_t)(ci->nbuckets - 1)]; i >= 0; i = ci->nd[i].hnext)
        if (ci->nd[i].key == key) return i;
    return -1;
}

static kv_status node_grow(conv_index_t *ci) {
    if (ci->nlive >= ci->nbuckets) { /* rehash at load 1 */
        int nb = ci->nbuckets * 2;
        int *h = malloc((size_t)nb * sizeof *h);
        if (!h) return KV_ENOMEM;
        for (int i = 0; i < nb; i++) h[i] = -1;
        for (int b = 0; b < ci->nbuckets; b++)
            for (int i = ci->nhead[b], nx; i >= 0; i = nx) {
                nx = ci->nd[i].hnext;
                int s = (int)(mix(ci->nd[i].key) & (uint64_t)(nb - 1));
                ci->nd[i].hnext = h[s];
                h[s] = i;
            }
        free(ci->nhead);
        ci->nhead = h;
        ci->nbuckets = nb;
    }
    if (ci->free_n < 0) {
        int cap = ci->ncap ? ci->ncap * 2 : 256;
        struct node *nd = realloc(ci->nd, (size_t)cap * sizeof *nd);
        if (!nd) return KV_ENOMEM;
        ci->nd = nd;
        for (int i = cap - 1; i >= ci->ncap; i--) {
            nd[i].hnext = ci->free_n;
            ci->free_n = i;
        }
        ci->ncap = cap;
    }
    return KV_OK;
}

/* Adds one reference of conversation slot c to key; KV_ENOMEM leaves nothing changed. */
static kv_status node_ref(conv_index_t *ci, uint64_t key, int c) {
    int i = node_find(ci, key);
    if (i < 0) {
        if (node_grow(ci)) return KV_ENOMEM;
        i = ci->free_n;
        ci->free_n = ci->nd[i].hnext;
        int b = (int)(mix(key) & (uint64_t)(ci->nbuckets - 1));
        ci->nd[i] = (struct node){key, 0, -1, ci->nhead[b]};
        ci->nhead[b] = i;
        ci->nlive++;
    }
    ci->nd[i].convs++;
    ci->nd[i].last = c;
    return KV_OK;
}

static void node_unref(conv_index_t *ci, uint64_t key, int c) {
    int b = (int)(mix(key) & (uint64_t)(ci->nbuckets - 1));
    for (int *pp = &ci->nhead[b]; *pp >= 0; pp = &ci->nd[*pp].hnext) {
        struct node *n = &ci->nd[*pp];
        if (n->key != key) continue;
        if (n->last == c) n->last = -1;
        if (--n->convs == 0) {
            int i = *pp;
            *pp = n->hnext;
            n->hnext = ci->free_n;
            ci->free_n = i;
            ci->nlive--;
        }
        return;
    }
}

/* ---- conversations ---- */

static int conv_find(const conv_index_t *ci, const char *id, uint64_t h) {
    for (int i = ci->chead[h & (uint64_t)(ci->cbuckets - 1)]; i >= 0; i = ci->c[i].hnext)
        if (!strcmp(ci->c[i].id, id)) return i;
    return -1;
}

static void lru_unlink(conv_index_t *ci, int i) {
    struct conv *c = &ci->c[i];
    if (c->prev >= 0) ci->c[c->prev].next = c->next;
    else ci->head = c->next;
    if (c->next >= 0) ci->c[c->next].prev = c->prev;
    else ci->tail = c->prev;
}

static void lru_push_front(conv_index_t *ci, int i) {
    ci->c[i].prev = -1;
    ci->c[i].next = ci->head;
    if (ci->head >= 0) ci->c[ci->head].prev = i;
    ci->head = i;
    if (ci->tail < 0) ci->tail = i;
}

static void drop_keys(conv_index_t *ci, int i) {
    struct conv *c = &ci->c[i];
    for (int k = 0; k < c->n_keys; k++) node_unref(ci, c->keys[k], i);
    c->n_keys = 0;
}

static void conv_remove(conv_index_t *ci, int i) {
    struct conv *c = &ci->c[i];
    drop_keys(ci, i);
    uint64_t h = str_hash(c->id) & (uint64_t)(ci->cbuckets - 1);
    for (int *pp = &ci->chead[h]; *pp >= 0; pp = &ci->c[*pp].hnext)
        if (*pp == i) {
            *pp = c->hnext;
            break;
        }
    lru_unlink(ci, i);
    free(c->id);
    c->id = NULL;
    c->next = ci->free_c;
    ci->free_c = i;
    ci->n--;
}

int conv_index_lookup(conv_index_t *ci, const char *id) {
    int i = conv_find(ci, id, str_hash(id));
    if (i < 0) return -1;
    lru_unlink(ci, i);
    lru_push_front(ci, i);
    return ci->c[i].worker;
}

int conv_index_match(conv_index_t *ci, const uint64_t *keys, int n, bool (*ok)(int worker, void *arg),
                     void *arg, int *worker, int *convs) {
    int best = 0;
    *worker = -1;
    *convs = 0;
    for (int k = 0; k < n; k++) {
        int i = node_find(ci, keys[k]);
        if (i < 0) break; /* chained keys: nothing deeper can match */
        const struct node *nd = &ci->nd[i];
        int w = nd->last >= 0 ? ci->c[nd->last].worker : -1;
        if (w >= 0 && (!ok || ok(w, arg))) {
            best = k + 1;
            *worker = w;
            *convs = (int)nd->convs;
        }
    }
    return best;
}

const char *conv_index_match_id(const conv_index_t *ci, const uint64_t *keys, int depth) {
    if (depth <= 0) return NULL;
    int i = node_find(ci, keys[depth - 1]);
    return i >= 0 && ci->nd[i].last >= 0 ? ci->c[ci->nd[i].last].id : NULL;
}

kv_status conv_index_pin(conv_index_t *ci, const char *id, int worker, const uint64_t *keys, int n) {
    if (n > ci->max_keys) n = ci->max_keys;
    if (n < 0) n = 0;
    uint64_t h = str_hash(id);
    int i = conv_find(ci, id, h);
    if (i >= 0) {
        drop_keys(ci, i);
        lru_unlink(ci, i);
    } else {
        if (ci->free_c < 0) conv_remove(ci, ci->tail); /* LRU eviction */
        i = ci->free_c;
        struct conv *c = &ci->c[i];
        char *dup = strdup(id);
        if (!c->keys) c->keys = malloc((size_t)ci->max_keys * sizeof *c->keys);
        if (!dup || !c->keys) {
            free(dup);
            return KV_ENOMEM;
        }
        ci->free_c = c->next;
        c->id = dup;
        c->n_keys = 0;
        int b = (int)(h & (uint64_t)(ci->cbuckets - 1));
        c->hnext = ci->chead[b];
        ci->chead[b] = i;
        ci->n++;
    }
    struct conv *c = &ci->c[i];
    c->worker = worker;
    lru_push_front(ci, i);
    for (int k = 0; k < n; k++) {
        if (node_ref(ci, keys[k], i)) {
            conv_remove(ci, i); /* drops the keys added so far */
            return KV_ENOMEM;
        }
        c->keys[c->n_keys++] = keys[k];
    }
    return KV_OK;
}

int conv_index_forget_worker(conv_index_t *ci, int worker) {
    int k = 0;
    for (int i = ci->head, nx; i >= 0; i = nx) {
        nx = ci->c[i].next;
        if (ci->c[i].worker == worker) {
            conv_remove(ci, i);
            k++;
        }
    }
    return k;
}
