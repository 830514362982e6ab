/* policy: round robin, delivery classes and retry rules of the router (router_internal.h). */
#include <curl/curl.h>

#include "router_internal.h"

int rt_pool_pick(struct rt_pool *p, int exclude) {
    if (!p || p->n <= 0) return -1;
    int i = (int)(p->next++ % (unsigned)p->n);
    if (i == exclude && p->n > 1) i = (int)(p->next++ % (unsigned)p->n);
    return i;
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
