/*
 * upstream: libcurl multi transfers driven from the router's libevent loop
 * (CURLMOPT_SOCKETFUNCTION / CURLMOPT_TIMERFUNCTION), one struct upx per attempt
 * (upstream.h).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "upstream.h"

struct sockctx {
    struct event *ev;
    struct upstream *up;
};

static void check_done(struct upstream *up) {
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(up->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        struct upx *u = NULL;
        CURLcode rc = m->data.result;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&u);
        if (!u) continue;
        curl_multi_remove_handle(up->multi, u->easy);
        u->in_multi = false;
        struct rt_outcome o = {.curl_code = (int)rc, .http_status = 0,
                               .request_written = upx_request_written(u),
                               .any_written = u->hdr_out + u->data_out > 0,
                               .got_bytes = u->got_bytes};
        curl_easy_getinfo(u->easy, CURLINFO_RESPONSE_CODE, &o.http_status);
        u->done = true;
        if (u->on_done) u->on_done(u, &o, rc);
    }
}

static void on_sock_event(evutil_socket_t fd, short what, void *arg) {
    struct upstream *up = arg;
    int flags = (what & EV_READ ? CURL_CSELECT_IN : 0) | (what & EV_WRITE ? CURL_CSELECT_OUT : 0);
    int running;
    curl_multi_socket_action(up->multi, fd, flags, &running);
    check_done(up);
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    struct upstream *up = arg;
    int running;
    curl_multi_socket_action(up->multi, CURL_SOCKET_TIMEOUT, 0, &running);
    check_done(up);
}

static int on_curl_socket(CURL *e, curl_socket_t s, int what, void *userp, void *socketp) {
    (void)e;
    struct upstream *up = userp;
    struct sockctx *sc = socketp;
    if (what == CURL_POLL_REMOVE) {
        if (sc) {
            event_free(sc->ev);
            free(sc);
        }
        curl_multi_assign(up->multi, s, NULL);
        return 0;
    }
    if (!sc) {
        sc = calloc(1, sizeof *sc);
        if (!sc) return -1;
        sc->up = up;
        curl_multi_assign(up->multi, s, sc);
    } else if (sc->ev) {
        event_free(sc->ev);
        sc->ev = NULL;
    }
    short kind = EV_PERSIST | (what & CURL_POLL_IN ? EV_READ : 0) | (what & CURL_POLL_OUT ? EV_WRITE : 0);
    sc->ev = event_new(up->base, s, kind, on_sock_event, up);
    if (!sc->ev) return -1;
    event_add(sc->ev, NULL);
    return 0;
}

static int on_curl_timer(CURLM *m, long timeout_ms, void *userp) {
    (void)m;
    struct upstream *up = userp;
    if (timeout_ms < 0) {
        evtimer_del(up->timer);
        return 0;
    }
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    evtimer_add(up->timer, &tv);
    return 0;
}

kv_status upstream_init(struct upstream *up, struct event_base *base) {
    memset(up, 0, sizeof *up);
    up->base = base;
    up->multi = curl_multi_init();
    up->timer = evtimer_new(base, on_timer, up);
    if (!up->multi || !up->timer) {
        upstream_free(up);
        return KV_ENOMEM;
    }
    curl_multi_setopt(up->multi, CURLMOPT_SOCKETFUNCTION, on_curl_socket);
    curl_multi_setopt(up->multi, CURLMOPT_SOCKETDATA, up);
    curl_multi_setopt(up->multi, CURLMOPT_TIMERFUNCTION, on_curl_timer);
    curl_multi_setopt(up->multi, CURLMOPT_TIMERDATA, up);
    return KV_OK;
}

void upstream_free(struct upstream *up) {
    if (up->multi) curl_multi_cleanup(up->multi);
    if (up->timer) event_free(up->timer);
    up->multi = NULL;
    up->timer = NULL;
}

/* Counts the request bytes that went out on the socket (libcurl reports them to the debug
 * callback after each successful send; the text lines are ignored, nothing is printed). */
static int on_debug(CURL *e, curl_infotype type, char *data, size_t size, void *ud) {
    (void)e;
    (void)data;
    struct upx *u = ud;
    if (type == CURLINFO_HEADER_OUT) u->hdr_out += size;
    else if (type == CURLINFO_DATA_OUT) u->data_out += size;
    return 0;
}

bool upx_request_written(const struct upx *u) {
    return u->body_len > 0 ? u->data_out >= u->body_len : u->hdr_out > 0;
}

#define UPX_MAX_RESPONSE ((size_t)64 << 20)

static size_t on_write(char *p, size_t sz, size_t nm, void *ud) {
    struct upx *u = ud;
    size_t n = sz * nm;
    if (!u->status) curl_easy_getinfo(u->easy, CURLINFO_RESPONSE_CODE, &u->status);
    u->got_bytes = true;
    if (u->on_data && u->status >= 200 && u->status < 300) return u->on_data(u, p, n);
    if (u->resp.len + n > UPX_MAX_RESPONSE) return 0; /* aborts: CURLE_WRITE_ERROR */
    if (kv_buf_append(&u->resp, p, n)) return 0;
    return n;
}

static size_t on_header(char *p, size_t sz, size_t nm, void *ud) {
    struct upx *u = ud;
    size_t n = sz * nm;
    if (n > 13 && !strncasecmp(p, "content-type:", 13)) {
        const char *v = p + 13;
        while (*v == ' ' || *v == '\t') v++;
        size_t l = (size_t)(p + n - v);
        while (l > 0 && (v[l - 1] == '\r' || v[l - 1] == '\n' || v[l - 1] == ' ')) l--;
        if (l >= sizeof u->ctype) l = sizeof u->ctype - 1;
        memcpy(u->ctype, v, l);
        u->ctype[l] = 0;
    }
    return n;
}

/* An attempt aborted while running closes its connection with a reset (SO_LINGER 0), not a
 * FIN: a worker cannot tell a FIN from a client that only half-closed until it writes, and a
 * worker in a long prefill or waiting for KV writes nothing for a while; a reset is seen at
 * once (its peek or read fails), so it cancels at its next step (docs/disaggregation.md). */
static void abort_with_reset(struct upx *u) {
    if (u->sock == CURL_SOCKET_BAD) return; /* no socket: nothing reached a worker */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    (void)setsockopt(u->sock, SOL_SOCKET, SO_LINGER, &lg, sizeof lg); /* else a FIN, as before */
}

/* libcurl's socket callbacks: u->sock is the attempt's socket exactly while it is open
 * (CURLINFO_ACTIVESOCKET says nothing before the transfer ends in libcurl 7.88). With
 * CURLOPT_FORBID_REUSE libcurl closes the connection inside curl_multi_remove_handle or at
 * the transfer's end, so these run while u is alive. */
static int on_sockopt(void *clientp, curl_socket_t s, curlsocktype purpose) {
    struct upx *u = clientp;
    if (purpose == CURLSOCKTYPE_IPCXN) u->sock = s;
    return CURL_SOCKOPT_OK;
}

static int on_close_socket(void *clientp, curl_socket_t s) {
    struct upx *u = clientp;
    if (u->sock == s) u->sock = CURL_SOCKET_BAD;
    return close(s);
}

struct upx *upx_start(struct upstream *up, const char *url, const char *body, size_t body_len,
                      double timeout_s, void *owner) {
    struct upx *u = calloc(1, sizeof *u);
    if (!u) return NULL;
    u->up = up;
    u->owner = owner;
    u->sock = CURL_SOCKET_BAD;
    kv_buf_init(&u->resp);
    u->easy = curl_easy_init();
    if (body) {
        u->body = malloc(body_len + 1);
        if (u->body) memcpy(u->body, body, body_len);
        u->body_len = body_len;
    }
    u->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    struct curl_slist *h2 = u->hdrs ? curl_slist_append(u->hdrs, "Expect:") : NULL;
    if (!u->easy || (body && !u->body) || !h2) {
        upx_free(u);
        return NULL;
    }
    u->hdrs = h2;
    if (up->auth_header) {
        struct curl_slist *h3 = curl_slist_append(u->hdrs, up->auth_header);
        if (!h3) {
            upx_free(u);
            return NULL;
        }
        u->hdrs = h3;
    }
    CURL *e = u->easy;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_PRIVATE, (char *)u);
    curl_easy_setopt(e, CURLOPT_SOCKOPTFUNCTION, on_sockopt);
    curl_easy_setopt(e, CURLOPT_SOCKOPTDATA, u);
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETFUNCTION, on_close_socket);
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETDATA, u);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, u->hdrs);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, u);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, u);
    curl_easy_setopt(e, CURLOPT_DEBUGFUNCTION, on_debug);
    curl_easy_setopt(e, CURLOPT_DEBUGDATA, u);
    curl_easy_setopt(e, CURLOPT_VERBOSE, 1L);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, u->errbuf);
    /* one connection per attempt: a closed transfer is a closed connection the worker sees
     * (it cancels on disconnect), and no attempt rides a connection another one left */
    curl_easy_setopt(e, CURLOPT_FORBID_REUSE, 1L);
    curl_easy_setopt(e, CURLOPT_FRESH_CONNECT, 1L);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    if (timeout_s > 0) curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000.0));
    if (body) {
        curl_easy_setopt(e, CURLOPT_POST, 1L);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, u->body);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
    } else {
        curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
    }
    if (curl_multi_add_handle(up->multi, e) != CURLM_OK) {
        upx_free(u);
        return NULL;
    }
    u->in_multi = true;
    return u;
}

void upx_free(struct upx *u) {
    if (!u) return;
    if (u->easy) {
        if (u->in_multi && !u->done) abort_with_reset(u);
        if (u->in_multi) curl_multi_remove_handle(u->up->multi, u->easy);
        curl_easy_cleanup(u->easy);
    }
    curl_slist_free_all(u->hdrs);
    free(u->body);
    kv_buf_free(&u->resp);
    free(u);
}

void upx_resume(struct upx *u) {
    if (u && u->paused && u->easy && u->in_multi) {
        u->paused = false;
        curl_easy_pause(u->easy, CURLPAUSE_CONT);
    }
}

bool upx_set_add(struct upx_set *s, struct upx *u) {
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 16;
        struct upx **a = realloc(s->a, (size_t)cap * sizeof *a);
        if (!a) {
            upx_free(u);
            return false;
        }
        s->a = a;
        s->cap = cap;
    }
    s->a[s->n++] = u;
    return true;
}

void upx_set_done(struct upx_set *s, struct upx *u) {
    for (int i = 0; i < s->n; i++)
        if (s->a[i] == u) {
            s->a[i] = s->a[--s->n];
            break;
        }
    upx_free(u);
}

void upx_set_free_all(struct upx_set *s) {
    for (int i = 0; i < s->n; i++) upx_free(s->a[i]);
    free(s->a);
    s->a = NULL;
    s->n = s->cap = 0;
}
