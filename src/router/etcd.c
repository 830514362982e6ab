/* etcd: base64 helpers and the worker's registrar thread (etcd.h). */
#include "etcd.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>
#include <jansson.h>

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *etcd_b64_encode(const void *p, size_t n) {
    const unsigned char *s = p;
    char *o = malloc(4 * ((n + 2) / 3) + 1), *q = o;
    if (!o) return NULL;
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)s[i] << 16 | (i + 1 < n ? (unsigned)s[i + 1] << 8 : 0) | (i + 2 < n ? s[i + 2] : 0);
        *q++ = B64[v >> 18 & 63];
        *q++ = B64[v >> 12 & 63];
        *q++ = i + 1 < n ? B64[v >> 6 & 63] : '=';
        *q++ = i + 2 < n ? B64[v & 63] : '=';
    }
    *q = 0;
    return o;
}

char *etcd_b64_decode(const char *s, size_t *n) {
    size_t len = strlen(s);
    if (len % 4) return NULL;
    char *o = malloc(len / 4 * 3 + 1);
    if (!o) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < len; i += 4) {
        unsigned v = 0;
        int pad = 0;
        for (int j = 0; j < 4; j++) {
            char c = s[i + j];
            const char *f = c ? strchr(B64, c) : NULL;
            if (c == '=' && i + 4 == len && j >= 2) {
                pad++;
                v <<= 6;
                continue;
            }
            if (!f || pad) {
                free(o);
                return NULL;
            }
            v = v << 6 | (unsigned)(f - B64);
        }
        o[k++] = (char)(v >> 16);
        if (pad < 2) o[k++] = (char)(v >> 8 & 255);
        if (pad < 1) o[k++] = (char)(v & 255);
    }
    o[k] = 0;
    *n = k;
    return o;
}

char *etcd_prefix_end_b64(const char *prefix) {
    size_t n = strlen(prefix);
    char *e = strdup(prefix);
    if (!e) return NULL;
    while (n > 0 && (unsigned char)e[n - 1] == 0xff) n--; /* etcd's prefix rule */
    if (n == 0) {
        free(e);
        return strdup("AA=="); /* "\0": every key */
    }
    e[n - 1] = (char)((unsigned char)e[n - 1] + 1);
    char *b = etcd_b64_encode(e, n);
    free(e);
    return b;
}

/* ------------------------------------------------------------------ registrar */

struct etcd_registrar {
    char *url, *key_b64, *val_b64;
    int ttl_s;
    long long lease;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop, started;
};

static size_t collect(char *p, size_t sz, size_t nm, void *arg) {
    kv_buf *b = arg;
    return kv_buf_append(b, p, sz * nm) ? 0 : sz * nm;
}

/* POST url+path with body; the parsed JSON answer (NULL on any failure, reason in err). */
static json_t *post(const char *base, const char *path, const char *body, long timeout_ms, char *err,
                    size_t errlen) {
    CURL *c = curl_easy_init();
    if (!c) {
        snprintf(err, errlen, "libcurl init failed");
        return NULL;
    }
    char url[1200];
    snprintf(url, sizeof url, "%s%s", base, path);
    kv_buf b;
    kv_buf_init(&b);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    CURLcode rc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    json_t *j = NULL;
    if (rc != CURLE_OK) snprintf(err, errlen, "etcd %s: %s", url, curl_easy_strerror(rc));
    else if (status != 200) snprintf(err, errlen, "etcd %s: HTTP %ld %.200s", url, status, b.len ? kv_buf_cstr(&b) : "");
    else if (!(j = json_loadb(b.data ? b.data : "", b.len, 0, NULL))) snprintf(err, errlen, "etcd %s: not JSON", url);
    kv_buf_free(&b);
    return j;
}

static long long json_ll(const json_t *v) { /* the gateway writes int64 as strings */
    if (json_is_integer(v)) return (long long)json_integer_value(v);
    const char *s = json_string_value(v);
    return s ? strtoll(s, NULL, 10) : 0;
}

/* grant + put; KV_EIO with err on failure. */
static kv_status do_register(struct etcd_registrar *g, char *err, size_t errlen) {
    char body[2400];
    snprintf(body, sizeof body, "{\"TTL\":%d}", g->ttl_s);
    json_t *j = post(g->url, "/v3/lease/grant", body, 3000, err, errlen);
    long long id = j ? json_ll(json_object_get(j, "ID")) : 0;
    json_decref(j);
    if (!id) {
        if (j) snprintf(err, errlen, "etcd %s: lease grant answered no ID", g->url);
        return KV_EIO;
    }
    snprintf(body, sizeof body, "{\"key\":\"%s\",\"value\":\"%s\",\"lease\":\"%lld\"}", g->key_b64, g->val_b64, id);
    j = post(g->url, "/v3/kv/put", body, 3000, err, errlen);
    if (!j) return KV_EIO;
    json_decref(j);
    g->lease = id;
    return KV_OK;
}

static void *keepalive_main(void *arg) {
    struct etcd_registrar *g = arg;
    long period_ms = g->ttl_s * 1000L / 3;
    if (period_ms < 200) period_ms = 200;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += period_ms / 1000;
        ts.tv_nsec += (period_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        if (g->stop) break;
        pthread_mutex_unlock(&g->mu);
        char err[600] = "", body[100];
        snprintf(body, sizeof body, "{\"ID\":\"%lld\"}", g->lease);
        json_t *j = post(g->url, "/v3/lease/keepalive", body, 2000, err, sizeof err);
        long long ttl = j ? json_ll(json_object_get(json_object_get(j, "result"), "TTL")) : -1;
        json_decref(j);
        if (ttl == 0) { /* the lease expired (we were away longer than TTL): register again */
            KV_WARN("etcd: lease %lld expired; registering again", g->lease);
            if (do_register(g, err, sizeof err)) KV_WARN("etcd: %s", err);
        } else if (ttl < 0) {
            KV_WARN("etcd: keepalive failed: %s", err);
        }
        pthread_mutex_lock(&g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

void etcd_register_stop(struct etcd_registrar *g) {
    if (!g) return;
    if (g->started) {
        pthread_mutex_lock(&g->mu);
        g->stop = true;
        pthread_cond_signal(&g->cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->th, NULL);
    }
    if (g->lease) {
        char err[600], body[2200];
        snprintf(body, sizeof body, "{\"key\":\"%s\"}", g->key_b64);
        json_decref(post(g->url, "/v3/kv/deleterange", body, 2000, err, sizeof err));
        snprintf(body, sizeof body, "{\"ID\":\"%lld\"}", g->lease);
        json_decref(post(g->url, "/v3/lease/revoke", body, 2000, err, sizeof err));
        KV_INFO("etcd: deregistered (lease %lld revoked)", g->lease);
    }
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g->url);
    free(g->key_b64);
    free(g->val_b64);
    free(g);
}

kv_status etcd_register_start(const char *etcd_url, const char *prefix, const char *advertise,
                              const char *role, int ttl_s, struct etcd_registrar **out, char *err,
                              size_t errlen) {
    *out = NULL;
    if (ttl_s < 1) return kv_errf(KV_EINVAL, err, errlen, "--etcd-ttl must be >= 1 second");
    struct etcd_registrar *g = calloc(1, sizeof *g);
    if (!g) return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->ttl_s = ttl_s;
    char key[1100];
    snprintf(key, sizeof key, "%s%s/%s", prefix, role, advertise);
    json_t *v = json_pack("{s:s, s:s}", "url", advertise, "role", role);
    char *vs = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    g->url = strdup(etcd_url);
    g->key_b64 = etcd_b64_encode(key, strlen(key));
    g->val_b64 = vs ? etcd_b64_encode(vs, strlen(vs)) : NULL;
    free(vs);
    size_t ul = g->url ? strlen(g->url) : 0;
    while (ul > 0 && g->url[ul - 1] == '/') g->url[--ul] = 0;
    if (!g->url || !g->key_b64 || !g->val_b64) {
        etcd_register_stop(g);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    kv_status st = do_register(g, err, errlen);
    if (st) {
        etcd_register_stop(g);
        return st;
    }
    if (pthread_create(&g->th, NULL, keepalive_main, g) != 0) {
        etcd_register_stop(g);
        return kv_errf(KV_ENOMEM, err, errlen, "cannot start the etcd keepalive thread");
    }
    g->started = true;
    KV_INFO("etcd: registered %s as %s%s/%s (lease %lld, TTL %d s)", advertise, prefix, role, advertise,
            g->lease, ttl_s);
    *out = g;
    return KV_OK;
}
