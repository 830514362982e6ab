/* policy: worker pools, the placement policies (round robin, least loaded, conversation; kv_aware
 * in kv_mirror.c), delivery classes and retry rules of the router (router_internal.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>

#include "conv_index.h"
#include "kv_mirror.h"
#include "router_internal.h"

/* ------------------------------------------------------------------ pools */

int rt_pool_find(const struct rt_pool *p, const char *url) {
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->w[i]->url, url)) return i;
    return -1;
}

int rt_pool_add(struct rt_pool *p, const char *url) {
    int i = rt_pool_find(p, url);
    if (i >= 0) {
        p->w[i]->present = true;
        return i;
    }
    if (p->n == p->cap) {
        int cap = p->cap ? p->cap * 2 : 8;
        struct rt_worker **w = realloc(p->w, (size_t)cap * sizeof *w);
        if (!w) return -1;
        p->w = w;
        p->cap = cap;
    }
    struct rt_worker *w = calloc(1, sizeof *w);
    if (w) w->url = strdup(url);
    if (!w || !w->url) {
        free(w);
        return -1;
    }
    w->present = w->healthy = true;
    p->w[p->n] = w;
    return p->n++;
}

void rt_pool_free(struct rt_pool *p) {
    for (int i = 0; i < p->n; i++) {
        free(p->w[i]->url);
        free(p->w[i]->ctx_endpoint);
        free(p->w[i]);
    }
    free(p->w);
    conv_index_free(p->conv);
    rt_predict_free(p->pred);
    p->w = NULL;
    p->conv = NULL;
    p->pred = NULL;
    p->n = p->cap = 0;
}

int rt_pool_n_live(const struct rt_pool *p) {
    int k = 0;
    for (int i = 0; i < p->n; i++) k += rt_worker_live(p->w[i]);
    return k;
}

int rt_pool_pick(struct rt_pool *p, int exclude) {
    if (!p || p->n <= 0) return -1;
    int first = -1;
    for (int t = 0; t < p->n; t++) {
        int i = (int)(p->next++ % (unsigned)p->n);
        if (!rt_worker_live(p->w[i])) continue;
        if (i != exclude) return i;
        if (first < 0) first = i;
    }
    return first; /* only the excluded worker is live: it is retried on itself */
}

long rt_pool_load(const struct rt_pool *p, int idx) {
    return p->metric == RT_LOAD_TOKENS ? p->w[idx]->tokens : p->w[idx]->active;
}

int rt_pool_least_loaded(struct rt_pool *p, int exclude) {
    int tied[256], nt = 0, fallback = -1;
    long best = 0;
    uint64_t fewest = 0;
    for (int i = 0; i < p->n; i++) {
        if (!rt_worker_live(p->w[i])) continue;
        if (i == exclude) {
            fallback = i;
            continue;
        }
        long l = rt_pool_load(p, i);
        uint64_t sent = p->w[i]->requests;
        if (nt == 0 || l < best || (l == best && sent < fewest)) {
            best = l;
            fewest = sent;
            nt = 0;
        }
        if (l == best && sent == fewest && nt < (int)(sizeof tied / sizeof tied[0])) tied[nt++] = i;
    }
    if (nt == 0) return fallback;
    return tied[p->next++ % (unsigned)nt];
}

void rt_pool_charge(struct rt_pool *p, int idx, long tokens, long work) {
    if (idx < 0 || idx >= p->n) return;
    p->w[idx]->active++;
    p->w[idx]->tokens += tokens;
    p->w[idx]->work += work;
    p->w[idx]->requests++;
}

void rt_pool_release(struct rt_pool *p, int idx, long tokens, long work) {
    if (idx < 0 || idx >= p->n) return;
    struct rt_worker *w = p->w[idx];
    w->active = w->active > 0 ? w->active - 1 : 0; /* clamped at 0 (spec §1.2) */
    w->tokens = w->tokens > tokens ? w->tokens - tokens : 0;
    w->work = w->work > work ? w->work - work : 0;
}

long rt_leg_work(long prompt_tokens, long predicted, long max_tokens) {
    long out = max_tokens > 0 ? max_tokens : RT_OUT_DEFAULT;
    long pre = prompt_tokens > predicted ? prompt_tokens - predicted : 0;
    return pre + (out < RT_OUT_CAP ? out : RT_OUT_CAP);
}

void rt_pool_worker_gone(struct rt_pool *p, int idx) {
    if (p->conv) {
        int k = conv_index_forget_worker(p->conv, idx);
        if (k) KV_INFO("router: %s worker %s left: %d conversation(s) forgotten", p->role, p->w[idx]->url, k);
    }
}

/* ------------------------------------------------------------------ policies */

const char *rt_reason_name(enum rt_reason r) {
    static const char *const n[RT_WHY_N] = {"round_robin", "load", "sticky", "content", "kv", "predicted"};
    return r >= 0 && r < RT_WHY_N ? n[r] : "?";
}

const char *rt_policy_name(enum rt_policy_kind k) {
    static const char *const n[] = {"round_robin", "least_loaded", "kv_aware", "conversation"};
    return n[k];
}

struct live_arg {
    struct rt_pool *p;
    int exclude;
};
static bool live_not_excluded(int w, void *arg) {
    const struct live_arg *a = arg;
    return w >= 0 && w < a->p->n && w != a->exclude && rt_worker_live(a->p->w[w]);
}

bool rt_conv_routable(struct rt_pool *p, const char *conv_id, int exclude) {
    if (!p->conv || p->min_match_keys == 0) return true; /* decision 1: 0 never asks for content */
    int w = conv_id ? conv_index_lookup(p->conv, conv_id) : -1;
    struct live_arg a = {p, exclude};
    return w >= 0 && live_not_excluded(w, &a);
}

/* Conversation policy (spec §1.2-1.3): sticky, else content placement, else least loaded;
 * then the id (explicit, the matched implicit one, or a new implicit one) is pinned. */
static int select_conversation(struct rt_pool *p, const struct rt_route *rq, int exclude,
                               enum rt_reason *why) {
    struct live_arg a = {p, exclude};
    const char *pin_id = rq->conv_id;
    int idx = -1;
    if (rq->conv_id) {
        int w = conv_index_lookup(p->conv, rq->conv_id);
        if (w >= 0 && live_not_excluded(w, &a)) {
            idx = w;
            *why = RT_WHY_STICKY;
        }
    }
    const char *matched_id = NULL;
    if (idx < 0 && p->min_match_keys > 0 && rq->n_ckeys >= p->min_match_keys) {
        int w, convs;
        int depth = conv_index_match(p->conv, rq->ckeys, rq->n_ckeys, live_not_excluded, &a, &w, &convs);
        int n_live = rt_pool_n_live(p);
        int total = conv_index_size(p->conv);
        /* the 1/N rule (decided: N = live workers of the role): a prefix held by more than
         * total/N conversations is common (a system prompt) and load-balanced, not followed */
        if (depth >= p->min_match_keys && (long)convs * (n_live ? n_live : 1) <= (long)total) {
            idx = w;
            *why = RT_WHY_CONTENT;
            matched_id = conv_index_match_id(p->conv, rq->ckeys, depth);
        } else if (depth >= p->min_match_keys && convs == 1) {
            idx = w; /* specific to one conversation: always followed */
            *why = RT_WHY_CONTENT;
            matched_id = conv_index_match_id(p->conv, rq->ckeys, depth);
        }
    }
    if (idx < 0) {
        idx = rt_pool_least_loaded(p, exclude);
        *why = RT_WHY_LOAD;
        if (idx < 0) return -1;
    }
    char implicit[1024];
    if (!pin_id) { /* spec §1.2 "no id": replace the matched conversation's keys, or a new id */
        if (matched_id && strlen(matched_id) < sizeof implicit) {
            snprintf(implicit, sizeof implicit, "%s", matched_id);
        } else {
            snprintf(implicit, sizeof implicit, "conv:%s_%llu", p->role,
                     (unsigned long long)++p->implicit_ids);
        }
        pin_id = implicit;
    }
    if (*why != RT_WHY_STICKY || rq->n_ckeys > 0) /* sticky turns refresh the history */
        if (conv_index_pin(p->conv, pin_id, idx, rq->ckeys, rq->n_ckeys))
            KV_WARN("router: out of memory pinning conversation %s", pin_id);
    return idx;
}

int rt_select(struct rt_pool *p, const struct rt_route *rq, int exclude, enum rt_reason *why,
              long *predicted) {
    int idx = -1;
    *predicted = 0;
    *why = RT_WHY_LOAD;
    switch (p->policy) {
    case RT_POLICY_ROUND_ROBIN:
        idx = rt_pool_pick(p, exclude);
        *why = RT_WHY_ROUND_ROBIN;
        break;
    case RT_POLICY_LEAST_LOADED: idx = rt_pool_least_loaded(p, exclude); break;
    case RT_POLICY_CONVERSATION:
        idx = p->conv ? select_conversation(p, rq, exclude, why) : rt_pool_least_loaded(p, exclude);
        break;
    case RT_POLICY_KV_AWARE: idx = rt_kv_select(p, rq, exclude, why, predicted); break;
    }
    if (idx >= 0) p->reasons[*why]++;
    return idx;
}

enum rt_delivery rt_classify(const struct rt_outcome *o) {
    if (o->http_status > 0) { /* a status line came back: the worker had the request */
        if (o->curl_code == CURLE_OK && o->http_status >= 200 && o->http_status < 300)
            return RT_COMPLETED;
        return RT_POSSIBLY_DELIVERED;
    }
    if (o->curl_code != CURLE_OK && !o->any_written) return RT_UNDELIVERED;
    switch (o->curl_code) {
    case CURLE_OK: return o->got_bytes ? RT_COMPLETED : RT_POSSIBLY_DELIVERED;
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
        return RT_UNDELIVERED;
    case CURLE_SEND_ERROR:
        return o->request_written ? RT_POSSIBLY_DELIVERED : RT_UNDELIVERED;
    default: /* recv errors, empty replies, timeouts, partial bodies, anything unknown */
        return RT_POSSIBLY_DELIVERED;
    }
}

static int imax(int a, int b) { return a > b ? a : b; }

bool rt_should_retry(enum rt_leg_kind kind, const struct rt_outcome *o,
                     const struct rt_retry_policy *p, int retries_done, bool streamed) {
    if (p->no_retry || streamed) return false;
    enum rt_delivery d = rt_classify(o);
    if (d == RT_COMPLETED) return false;
    int transient = imax(p->max_retries, 5);
    if (kind == RT_LEG_GENERATION) return d == RT_UNDELIVERED && retries_done < transient;
    if (o->http_status >= 400 && o->http_status < 500) return false;
    if (o->http_status > 0) return retries_done < p->max_retries; /* 5xx and other statuses */
    switch (o->curl_code) {
    case CURLE_GOT_NOTHING: /* server disconnected */
    case CURLE_RECV_ERROR:  /* connection reset */
    case CURLE_SEND_ERROR:
        return retries_done < transient;
    default:
        return retries_done < p->max_retries;
    }
}

const char *rt_delivery_name(enum rt_delivery d) {
    switch (d) {
    case RT_COMPLETED: return "completed";
    case RT_UNDELIVERED: return "undelivered";
    default: return "possibly_delivered";
    }
}

const char *rt_leg_name(enum rt_leg_kind k) {
    switch (k) {
    case RT_LEG_CONTEXT: return "context";
    case RT_LEG_GENERATION: return "generation";
    default: return "plain";
    }
}
