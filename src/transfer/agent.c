/*
 * agent: the transfer thread, the command queue from the engine, offers, deadlines, the stale
 * sweep and completions (transfer.h has the contract; agent_conn.c the connections).
 */
#include "agent_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>


const char *kvx_transport_name(enum kvx_transport_kind k) {
    return k == KVX_TRANSPORT_UCX ? "ucx" : k == KVX_TRANSPORT_CUDA_IPC ? "cuda_ipc" : "tcp";
}

kv_status kvx_transport_parse(const char *s, enum kvx_transport_kind *out) {
    if (s && !strcmp(s, "tcp")) {
        *out = KVX_TRANSPORT_TCP;
        return KV_OK;
    }
    if (s && !strcmp(s, "ucx")) {
        if (!kvx_transport_ucx_available()) return KV_EUNSUPPORTED;
        *out = KVX_TRANSPORT_UCX;
        return KV_OK;
    }
    if (s && !strcmp(s, "cuda_ipc")) {
        *out = KVX_TRANSPORT_CUDA_IPC;
        return KV_OK;
    }
    return KV_EINVAL;
}

kv_status kvx_fault_parse(const char *s, struct kvx_faults *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!s) return KV_OK;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        if (!*tok) continue;
        if (!strcmp(tok, "drop_done")) out->drop_done = true;
        else if (!strcmp(tok, "drop_ready")) out->drop_ready = true;
        else if (!strcmp(tok, "fail_read")) out->fail_read = true;
        else if (!strncmp(tok, "delay_request_ms=", 17)) {
            int64_t x;
            if (kv_parse_i64(tok + 17, 0, 3600000, &x) != KV_OK)
                return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_KVX_FAULT: bad delay '%s'", tok);
            out->delay_request_ms = (int)x;
        } else {
            return kv_errf(KV_EINVAL, err, errlen, "KVSERVE_KVX_FAULT: unknown item '%s' (drop_done, "
                           "drop_ready, fail_read, delay_request_ms=N)", tok);
        }
    }
    return KV_OK;
}

/* ---------------------------------------------------------------- helpers (thread) */

void agent_stat(struct kvx_agent *a, uint64_t *field, uint64_t add) {
    pthread_mutex_lock(&a->mu);
    *field += add;
    pthread_mutex_unlock(&a->mu);
}

void agent_complete(struct kvx_agent *a, uint64_t id, bool is_send, kv_status st,
                    const struct kvx_aux *aux, uint64_t bytes, const char *fmt, ...) {
    struct kvx_result r;
    memset(&r, 0, sizeof r);
    r.disagg_id = id;
    r.is_send = is_send;
    r.status = st;
    r.bytes = bytes;
    if (aux) r.aux = *aux;
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r.message, sizeof r.message, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_lock(&a->mu);
    if (is_send) {
        if (st == KV_OK) a->stats.sends_ok++, a->stats.bytes_sent += bytes;
        else a->stats.sends_failed++;
    } else {
        if (st == KV_OK) a->stats.recvs_ok++, a->stats.bytes_received += bytes;
        else a->stats.recvs_failed++;
    }
    pthread_mutex_unlock(&a->mu);
    if (st != KV_OK)
        KV_INFO("kv transfer: %s of %llu ended: %s (%s)", is_send ? "send" : "receive",
                (unsigned long long)id, kv_status_str(st), r.message);
    a->cfg.cb(&r, a->cfg.user);
}

struct offer *agent_find_offer(struct kvx_agent *a, uint64_t id) {
    for (struct offer *o = a->offers; o; o = o->next)
        if (o->id == id) return o;
    return NULL;
}

void agent_drop_offer(struct kvx_agent *a, struct offer *o) {
    for (struct offer **pp = &a->offers; *pp; pp = &(*pp)->next)
        if (*pp == o) {
            *pp = o->next;
            break;
        }
    agent_mark_finished(a, o->id);
    free(o->blocks);
    free(o);
}

int agent_was_finished(const struct kvx_agent *a, uint64_t id) {
    int n = a->n_finished < 1024 ? a->n_finished : 1024;
    for (int k = 1; k <= n; k++) { /* newest first: the last end of id decides */
        int i = (a->n_finished - k) % 1024;
        if (a->finished[i] == id) return a->finished_cancelled[i] ? 2 : 1;
    }
    return 0;
}

void agent_mark_finished(struct kvx_agent *a, uint64_t id) {
    a->finished_cancelled[a->n_finished % 1024] = false;
    a->finished[a->n_finished++ % 1024] = id;
}

void agent_mark_cancelled(struct kvx_agent *a, uint64_t id) {
    int n = a->n_finished < 1024 ? a->n_finished : 1024;
    for (int k = 1; k <= n; k++) { /* newest first */
        int i = (a->n_finished - k) % 1024;
        if (a->finished[i] == id) {
            a->finished_cancelled[i] = true;
            return;
        }
    }
}

static bool memo_take(struct kvx_agent *a, uint64_t id) {
    uint64_t now = kv_now_ns();
    for (int i = 0; i < a->n_memo; i++) {
        if (a->memo[i].id == id && a->memo[i].until_ns > now) {
            a->memo[i] = a->memo[--a->n_memo];
            return true;
        }
    }
    return false;
}

static void memo_add(struct kvx_agent *a, uint64_t id) {
    uint64_t now = kv_now_ns();
    for (int i = 0; i < a->n_memo;) /* expire old ones first */
        if (a->memo[i].until_ns <= now) a->memo[i] = a->memo[--a->n_memo];
        else i++;
    if (a->n_memo == a->cap_memo) {
        int nc = a->cap_memo ? a->cap_memo * 2 : 64;
        if (nc > 65536) return; /* bounded: the oldest cancels are forgotten */
        void *p = kv_realloc(a->memo, (size_t)nc * sizeof *a->memo);
        if (!p) return;
        a->memo = p;
        a->cap_memo = nc;
    }
    a->memo[a->n_memo++] = (struct cancel_memo){id, now + (uint64_t)(2 * a->cfg.timeout_s * 1e9)};
}

static uint64_t timeout_ns(const struct kvx_agent *a) { return (uint64_t)(a->cfg.timeout_s * 1e9); }

/* ---------------------------------------------------------------- UCX peers */

kvx_peer_t *agent_ucx_peer(struct kvx_agent *a, const char *endpoint, const uint8_t *desc, size_t n,
                           char *why, size_t whylen) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a: tells a restarted peer's descriptor apart */
    for (size_t i = 0; i < n; i++) h = (h ^ desc[i]) * 1099511628211ull;
    char key[208];
    snprintf(key, sizeof key, "%s#%016llx", endpoint, (unsigned long long)h);
    for (int i = 0; i < a->n_peers; i++)
        if (!strcmp(a->peers[i].key, key)) return a->peers[i].p;
    kvx_peer_t *p = NULL;
    if (a->tp->ops->connect(a->tp, desc, n, &p, why, whylen) != KV_OK) return NULL;
    if (a->n_peers == 32) { /* bounded cache: drop the oldest */
        a->tp->ops->disconnect(a->tp, a->peers[0].p);
        memmove(a->peers, a->peers + 1, 31 * sizeof a->peers[0]);
        a->n_peers--;
    }
    snprintf(a->peers[a->n_peers].key, sizeof a->peers[0].key, "%s", key);
    a->peers[a->n_peers++].p = p;
    return p;
}

void agent_ucx_forget(struct kvx_agent *a, kvx_peer_t *p) {
    for (int i = 0; i < a->n_peers; i++)
        if (a->peers[i].p == p) {
            a->tp->ops->disconnect(a->tp, p);
            a->peers[i] = a->peers[--a->n_peers];
            return;
        }
}

static void ucx_progress(struct kvx_agent *a) {
    if (!a->tp) return;
    struct kvx_completion done[32];
    for (int guard = 0; guard < 64; guard++) {
        int n = a->tp->ops->progress(a->tp, done, 32, 0);
        if (n <= 0) return;
        for (int i = 0; i < n; i++) conn_read_done(a, &done[i]);
    }
}

/* ---------------------------------------------------------------- commands */

static void do_offer(struct kvx_agent *a, struct cmd *c) {
    if (memo_take(a, c->id)) {
        agent_mark_finished(a, c->id);
        agent_mark_cancelled(a, c->id);
        agent_complete(a, c->id, true, KV_ECANCELLED, NULL, 0, "cancelled before the offer");
        /* a REQ stored since the cancel (it came before this offer) hears it now rather than
         * at the stale sweep */
        for (struct conn *k = a->conns; k; k = k->next)
            if (!k->is_recv && k->st == CS_WAIT_OFFER && k->id == c->id) conn_cancel(a, k);
        return;
    }
    struct offer *o = kv_calloc(1, sizeof *o);
    if (!o) {
        agent_complete(a, c->id, true, KV_ENOMEM, NULL, 0, "out of memory");
        return;
    }
    o->id = c->id;
    o->blocks = c->blocks;
    c->blocks = NULL;
    o->n_blocks = c->n;
    o->aux = c->aux;
    o->deadline_ns = kv_now_ns() + timeout_ns(a);
    o->next = a->offers;
    a->offers = o;
    /* a REQ that came first (generation first, or a fast receiver) is served now */
    for (struct conn *k = a->conns; k; k = k->next)
        if (!k->is_recv && k->st == CS_WAIT_OFFER && k->id == o->id && !k->ignored) {
            conn_serve(a, k, o);
            break;
        }
}

void agent_cancel_local(struct kvx_agent *a, uint64_t id);

static void do_cancel(struct kvx_agent *a, uint64_t id) {
    bool found = false, stored = false;
    for (struct conn *k = a->conns; k; k = k->next) {
        if (k->st == CS_CLOSED || k->id != id) continue;
        if (k->is_recv || k->offer) {
            conn_cancel(a, k);
            found = true;
        } else if (k->st == CS_WAIT_OFFER) {
            /* a stored REQ (no offer yet): tell its receiver now instead of letting it wait for
             * its deadline; the id stays remembered below for an offer that may still come */
            conn_cancel(a, k);
            stored = true;
        }
    }
    struct offer *o = agent_find_offer(a, id);
    if (o) { /* offered, not (or no longer) being served */
        agent_drop_offer(a, o);
        agent_mark_cancelled(a, id);
        agent_complete(a, id, true, KV_ECANCELLED, NULL, 0, "cancelled");
        found = true;
    }
    if (!found || stored) memo_add(a, id);
}

static void run_cmds(struct kvx_agent *a) {
    pthread_mutex_lock(&a->mu);
    struct cmd *c = a->cmds;
    a->cmds = a->cmds_tail = NULL;
    pthread_mutex_unlock(&a->mu);
    while (c) {
        struct cmd *next = c->next;
        if (c->type == CMD_OFFER) do_offer(a, c);
        else if (c->type == CMD_CANCEL) do_cancel(a, c->id);
        else if (c->type == CMD_CANCEL_REMOTE) conn_open_notify(a, c);
        else if (memo_take(a, c->id))
            agent_complete(a, c->id, false, KV_ECANCELLED, NULL, 0, "cancelled before the receive");
        else conn_open_recv(a, c);
        free(c->blocks);
        free(c);
        c = next;
    }
}

/* ---------------------------------------------------------------- deadlines, sweep */

static void check_deadlines(struct kvx_agent *a, uint64_t now) {
    for (struct offer *o = a->offers, *next; o; o = next) {
        next = o->next;
        if (!o->conn && now >= o->deadline_ns) {
            uint64_t id = o->id;
            agent_drop_offer(a, o);
            agent_complete(a, id, true, KV_EBUSY, NULL, 0, "no generation worker asked for the KV "
                           "within %.0f s", a->cfg.timeout_s);
        }
    }
    for (struct conn *c = a->conns; c; c = c->next) {
        if (c->st == CS_CLOSED) {
            if (c->read_inflight && now >= c->deadline_ns + 2 * timeout_ns(a)) {
                KV_ERROR("kv transfer: a read for %llu never completed; giving up on it",
                         (unsigned long long)c->id);
                struct kvx_completion k = {.cookie = c->cookie, .status = KV_EIO};
                snprintf(k.message, sizeof k.message, "transport read never completed");
                conn_read_done(a, &k);
            }
            continue;
        }
        if (c->is_recv && c->st == CS_DONE_SENT) { /* lingering (drop_done): bounded */
            if (now >= c->deadline_ns + timeout_ns(a)) conn_close(c);
            continue;
        }
        if (!c->is_recv && (c->st == CS_WAIT_OFFER || c->st == CS_ACCEPTED)) {
            /* stored REQs live until the stale sweep; an idle accepted socket until its deadline */
            if (c->st == CS_ACCEPTED && now >= c->deadline_ns) conn_close(c);
            if (c->ignored && now >= c->t_start_ns + (uint64_t)(a->cfg.stale_ttl_s * 1e9) + timeout_ns(a))
                conn_close(c);
            continue;
        }
        if (c->deadline_ns && now >= c->deadline_ns) {
            if (c->is_recv) {
                if (!c->completed) {
                    c->completed = true;
                    agent_complete(a, c->id, false, KV_EBUSY, NULL, c->moved, "KV transfer from %s "
                                   "timed out after %.0f s (%s)", c->peer, a->cfg.timeout_s,
                                   c->st == CS_RECV_DATA ? "while reading" : "waiting for the sender");
                }
                conn_fail(a, c, "receiver deadline passed");
            } else if (c->offer) {
                struct offer *o = c->offer;
                uint64_t id = o->id;
                c->offer = NULL;
                agent_drop_offer(a, o);
                agent_complete(a, id, true, KV_EBUSY, NULL, c->moved, "KV transfer to the "
                               "generation worker timed out after %.0f s (%s)", a->cfg.timeout_s,
                               c->st == CS_WAIT_DONE ? "no DONE" : "while writing");
                conn_fail(a, c, "sender deadline passed");
            } else {
                conn_close(c);
            }
        }
    }
}

/* Spec §4 / decision 4: REQs no offer claimed within stale_ttl: FAILED if context first,
 * dropped silently otherwise. */
void agent_stale_sweep(struct kvx_agent *a, uint64_t now) {
    uint64_t ttl = (uint64_t)(a->cfg.stale_ttl_s * 1e9);
    for (struct conn *c = a->conns; c; c = c->next) {
        if (c->is_recv || c->st != CS_WAIT_OFFER || c->ignored || now < c->t_start_ns + ttl) continue;
        if (c->context_first) {
            agent_stat(a, &a->stats.stale_failed, 1);
            KV_INFO("kv transfer: stale request for %llu (no offer within %.0f s): FAILED",
                    (unsigned long long)c->id, a->cfg.stale_ttl_s);
            conn_fail(a, c, "stale: no context request offered this KV in time");
        } else {
            agent_stat(a, &a->stats.stale_dropped, 1);
            KV_DEBUG("kv transfer: stale generation-first request for %llu dropped",
                     (unsigned long long)c->id);
            c->ignored = true;
        }
    }
}

static void unlink_closed(struct kvx_agent *a) {
    for (struct conn **pp = &a->conns; *pp;) {
        struct conn *c = *pp;
        if (c->st == CS_CLOSED && !c->read_inflight) {
            *pp = c->next;
            conn_free(c);
        } else {
            pp = &c->next;
        }
    }
}

/* ---------------------------------------------------------------- the thread */

static void *agent_main(void *arg) {
    struct kvx_agent *a = arg;
    struct pollfd *pfd = NULL;
    struct conn **pc = NULL;
    int cap = 0;
    for (;;) {
        pthread_mutex_lock(&a->mu);
        bool stop = a->stopping;
        pthread_mutex_unlock(&a->mu);
        run_cmds(a);
        if (stop) break;
        ucx_progress(a);
        uint64_t now = kv_now_ns();
        check_deadlines(a, now);
        if (now - a->last_sweep_ns >= 1000000000ull) {
            agent_stale_sweep(a, now);
            a->last_sweep_ns = now;
        }
        /* delayed REQs (fault injection) */
        for (struct conn *c = a->conns; c; c = c->next)
            if (c->start_at_ns && now >= c->start_at_ns && c->st != CS_CLOSED) conn_io(a, c, 0);
        unlink_closed(a);
        int n = 3;
        for (struct conn *c = a->conns; c; c = c->next) n++;
        if (n > cap) {
            int nc = n * 2;
            void *p1 = kv_realloc(pfd, (size_t)nc * sizeof *pfd), *p2 = NULL;
            if (p1) pfd = p1;
            if (p1) p2 = kv_realloc(pc, (size_t)nc * sizeof *pc);
            if (p2) pc = p2;
            if (!p1 || !p2) { /* out of memory: poll what fits, retry soon */
                struct timespec d = {0, 10000000};
                nanosleep(&d, NULL);
                continue;
            }
            cap = nc;
        }
        pfd[0] = (struct pollfd){a->wake[0], POLLIN, 0};
        pfd[1] = (struct pollfd){a->listen_fd, POLLIN, 0};
        int k = 2;
        int timeout = 200;
        int efd = a->tp && a->tp->ops->event_fd ? a->tp->ops->event_fd(a->tp) : -1;
        for (struct conn *c = a->conns; c; c = c->next) {
            /* UCX reads complete only through progress (and RMA over tcp needs the exposing
             * side to progress too): poll briskly while any UCX transfer is live */
            if (c->ucx && (c->read_inflight || c->st == CS_WAIT_DONE)) timeout = c->read_inflight ? 0 : 1;
            if (c->st == CS_CLOSED) continue;
            if (c->start_at_ns) {
                int64_t ms = (int64_t)(c->start_at_ns - now) / 1000000 + 1;
                if (ms < timeout) timeout = ms > 0 ? (int)ms : 0;
                continue;
            }
            pc[k] = c;
            pfd[k++] = (struct pollfd){c->fd, conn_events(c), 0};
        }
        {
            int ns = 0, nr = 0;
            for (struct offer *o = a->offers; o; o = o->next) ns++;
            for (struct conn *c = a->conns; c; c = c->next) {
                nr += c->is_recv && !c->completed;
            }
            int nst = 0;
            for (struct conn *c = a->conns; c; c = c->next) nst += !c->is_recv && c->st == CS_WAIT_OFFER;
            pthread_mutex_lock(&a->mu);
            a->stats.live_sends = ns;
            a->stats.live_recvs = nr;
            a->stats.stored_requests = nst;
            pthread_mutex_unlock(&a->mu);
        }
        int first_conn = 2;
        if (efd >= 0) {
            pfd[k] = pfd[1];
            pc[k] = NULL;
            pfd[1] = (struct pollfd){efd, POLLIN, 0};
            pfd[k].revents = 0;
            k++;
            first_conn = 2;
        }
        int r = poll(pfd, (nfds_t)k, timeout);
        if (r < 0 && errno != EINTR) {
            KV_ERROR("kv transfer: poll failed: %s", strerror(errno));
            struct timespec d = {0, 10000000};
            nanosleep(&d, NULL);
            continue;
        }
        if (r <= 0) continue;
        if (pfd[0].revents) {
            char buf[256];
            while (read(a->wake[0], buf, sizeof buf) > 0) {
            }
        }
        for (int i = 1; i < k; i++) {
            if (pfd[i].fd != a->listen_fd || !(pfd[i].revents & POLLIN)) continue;
            for (int j = 0; j < 64; j++) {
                int fd = accept(a->listen_fd, NULL, NULL);
                if (fd < 0) break;
                conn_accept(a, fd);
            }
        }
        for (int i = first_conn; i < k; i++)
            if (pc[i] && pfd[i].revents && pc[i]->st != CS_CLOSED) conn_io(a, pc[i], pfd[i].revents);
    }
    /* stop: every live transfer ends as cancelled */
    for (struct conn *c = a->conns; c; c = c->next)
        if (c->st != CS_CLOSED && (c->is_recv ? !c->completed : c->offer != NULL)) conn_cancel(a, c);
    while (a->offers) {
        uint64_t id = a->offers->id;
        agent_drop_offer(a, a->offers);
        agent_complete(a, id, true, KV_ECANCELLED, NULL, 0, "transfer agent stopped");
    }
    for (struct conn *c = a->conns; c; c = c->next) conn_close(c);
    if (a->tp) { /* reads still in flight end (cancelled) before the transport goes */
        uint64_t end = kv_now_ns() + 2000000000ull;
        for (;;) {
            bool live = false;
            for (struct conn *c = a->conns; c; c = c->next) live |= c->read_inflight;
            if (!live || kv_now_ns() > end) break;
            ucx_progress(a);
        }
        for (int i = 0; i < a->n_peers; i++) a->tp->ops->disconnect(a->tp, a->peers[i].p);
        a->n_peers = 0;
        a->tp->ops->destroy(a->tp);
        a->tp = NULL;
        for (struct conn *c = a->conns; c; c = c->next)
            if (c->read_inflight) {
                c->read_inflight = false;
                if (c->is_recv && !c->completed) {
                    c->completed = true;
                    agent_complete(a, c->id, false, c->abort_pending ? c->abort_st : KV_ECANCELLED,
                                   NULL, 0, "transfer agent stopped");
                }
            }
    }
    unlink_closed(a);
    free(pfd);
    free(pc);
    return NULL;
}

/* ---------------------------------------------------------------- API */

static void wake(struct kvx_agent *a) {
    char c = 1;
    ssize_t w = write(a->wake[1], &c, 1);
    (void)w;
}

static kv_status push(struct kvx_agent *a, struct cmd *c) {
    pthread_mutex_lock(&a->mu);
    if (a->stopping) {
        pthread_mutex_unlock(&a->mu);
        free(c->blocks);
        free(c);
        return KV_ECANCELLED;
    }
    if (a->cmds_tail) a->cmds_tail->next = c;
    else a->cmds = c;
    a->cmds_tail = c;
    pthread_mutex_unlock(&a->mu);
    wake(a);
    return KV_OK;
}

/* A command with its own copy of blocks[0..n) (NULL on ENOMEM). */
static struct cmd *cmd_new(int type, uint64_t id, const int32_t *blocks, int n) {
    struct cmd *c = kv_calloc(1, sizeof *c);
    int32_t *b = kv_malloc((size_t)(n ? n : 1) * sizeof *b);
    if (!c || !b) {
        free(c);
        free(b);
        return NULL;
    }
    if (n) memcpy(b, blocks, (size_t)n * sizeof *b);
    c->type = type;
    c->id = id;
    c->blocks = b;
    c->n = n;
    return c;
}

kv_status kvx_send_offer(kvx_agent_t *a, uint64_t id, const int32_t *blocks, int n_blocks,
                         const struct kvx_aux *aux) {
    if (!a || !aux || n_blocks < 0 || (n_blocks && !blocks) || aux->n_tokens < 1 ||
        aux->n_first < 0 || aux->n_first > KVX_MAX_FIRST_TOKENS)
        return KV_EINVAL;
    int T = a->pt.views[0].tokens_per_block;
    if (n_blocks != (aux->n_tokens + T - 1) / T) return KV_EINVAL;
    for (int i = 0; i < n_blocks; i++)
        if (blocks[i] < 0 || blocks[i] >= a->cfg.n_blocks) return KV_EINVAL;
    struct cmd *c = cmd_new(CMD_OFFER, id, blocks, n_blocks);
    if (!c) return KV_ENOMEM;
    c->aux = *aux;
    return push(a, c);
}

kv_status kvx_recv_start(kvx_agent_t *a, uint64_t id, const char *peer, bool context_first,
                         const int32_t *dst, int n_dst, int n_tokens) {
    if (!a || !peer || !*peer || strlen(peer) >= 160 || n_tokens < 1 || n_dst < 0 || (n_dst && !dst))
        return KV_EINVAL;
    int T = a->pt.views[0].tokens_per_block;
    if (n_dst > (n_tokens + T - 1) / T) return KV_EINVAL;
    for (int i = 0; i < n_dst; i++)
        if (dst[i] < 0 || dst[i] >= a->cfg.n_blocks) return KV_EINVAL;
    if (!kv_hostport_ok(peer)) return KV_EINVAL;
    struct cmd *c = cmd_new(CMD_RECV, id, dst, n_dst);
    if (!c) return KV_ENOMEM;
    c->context_first = context_first;
    c->n_tokens = n_tokens;
    snprintf(c->peer, sizeof c->peer, "%s", peer);
    return push(a, c);
}

void kvx_cancel(kvx_agent_t *a, uint64_t id) {
    if (!a) return;
    struct cmd *c = kv_calloc(1, sizeof *c);
    if (!c) return;
    c->type = CMD_CANCEL;
    c->id = id;
    push(a, c);
}

void agent_cancel_local(struct kvx_agent *a, uint64_t id) { do_cancel(a, id); }

void agent_refuse_offer(struct kvx_agent *a, uint64_t id, const char *why) {
    struct offer *o = agent_find_offer(a, id);
    if (o && o->conn) return; /* another receiver is being served: its own outcome decides */
    if (!o) {
        if (!agent_was_finished(a, id)) memo_add(a, id);
        return;
    }
    agent_drop_offer(a, o);
    agent_complete(a, id, true, KV_EINVAL, NULL, 0, "the generation worker was refused: %s", why);
}

void kvx_cancel_remote(kvx_agent_t *a, uint64_t id, const char *peer) {
    if (!a || !peer || strlen(peer) >= 160 || !kv_hostport_ok(peer)) return;
    struct cmd *c = cmd_new(CMD_CANCEL_REMOTE, id, NULL, 0);
    if (!c) return;
    snprintf(c->peer, sizeof c->peer, "%s", peer);
    push(a, c);
}

void kvx_get_stats(kvx_agent_t *a, struct kvx_stats *out) {
    pthread_mutex_lock(&a->mu);
    *out = a->stats;
    pthread_mutex_unlock(&a->mu);
}

const char *kvx_agent_endpoint(const kvx_agent_t *a) { return a->endpoint; }

static int listen_on(const char *host, int port, char *ep, size_t eplen, char *err, size_t errlen) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc != 0) {
        kv_errf(KV_EIO, err, errlen, "kv transfer: cannot resolve %s: %s", host, gai_strerror(rc));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 256) == 0) {
            struct sockaddr_storage ss;
            socklen_t sl = sizeof ss;
            getsockname(fd, (struct sockaddr *)&ss, &sl);
            int bound = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                                 : ntohs(((struct sockaddr_in *)&ss)->sin_port);
            snprintf(ep, eplen, "%s:%d", host, bound);
            break;
        }
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) kv_errf(KV_EIO, err, errlen, "kv transfer: cannot listen on %s:%d: %s", host, port,
                        strerror(errno));
    return fd;
}

kv_status kvx_agent_start(const struct kvx_config *cfg, kvx_agent_t **out, char *err, size_t errlen) {
    kvx_transport_t *given = cfg && cfg->transport == KVX_TRANSPORT_CUDA_IPC ? cfg->tp : NULL;
    if (!cfg || !out || !cfg->cb || !cfg->pt || cfg->pt->n_views != 1 || !cfg->pool_base ||
        cfg->n_blocks < 1 || (cfg->transport == KVX_TRANSPORT_CUDA_IPC && !cfg->tp)) {
        if (given) given->ops->destroy(given);
        return kv_errf(KV_EINVAL, err, errlen, "kv transfer: bad agent config (one pool view, a "
                       "pool and a callback are required; cuda_ipc: a transport)");
    }
    if (cfg->transport == KVX_TRANSPORT_UCX && !kvx_transport_ucx_available())
        return kv_errf(KV_EUNSUPPORTED, err, errlen, "kv transfer: this build has no UCX transport");
    struct kvx_agent *a = kv_calloc(1, sizeof *a);
    if (!a) {
        if (given) given->ops->destroy(given);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    a->tp = given; /* owned from here (kvx_agent_stop destroys it) */
    a->device_pool = given != NULL;
    a->cfg = *cfg;
    a->cfg.host = NULL; /* not kept */
    if (a->cfg.timeout_s <= 0) a->cfg.timeout_s = 60;
    if (a->cfg.stale_ttl_s <= 0) a->cfg.stale_ttl_s = 120;
    if (a->cfg.bounce_min_bytes == 0) a->cfg.bounce_min_bytes = 2u << 20;
    a->listen_fd = a->wake[0] = a->wake[1] = -1;
    pthread_mutex_init(&a->mu, NULL);
    if (kvx_page_table_copy(&a->pt, cfg->pt) != KV_OK) {
        kvx_agent_stop(a);
        return kv_errf(KV_ENOMEM, err, errlen, "out of memory");
    }
    a->listen_fd = listen_on(cfg->host && *cfg->host ? cfg->host : "127.0.0.1", cfg->port, a->endpoint,
                             sizeof a->endpoint, err, errlen);
    if (a->listen_fd < 0 || pipe2(a->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        kv_status st = a->listen_fd < 0 ? KV_EIO : kv_errf(KV_EIO, err, errlen, "pipe failed");
        kvx_agent_stop(a);
        return st;
    }
    if (cfg->transport == KVX_TRANSPORT_UCX || a->tp) {
        const char *h = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";
        kv_buf desc;
        kv_buf_init(&desc);
        kv_status st = a->tp ? KV_OK : kvx_transport_ucx_new(h, &a->tp, err, errlen);
        if (st == KV_OK)
            st = a->tp->ops->expose(a->tp, cfg->pool_base, (size_t)cfg->n_blocks * a->pt.views[0].block_bytes,
                                    &desc, err, errlen);
        if (st == KV_OK) {
            a->desc_hex = kv_malloc(desc.len * 2 + 1);
            if (!a->desc_hex) st = kv_errf(KV_ENOMEM, err, errlen, "out of memory");
            for (size_t i = 0; a->desc_hex && i < desc.len; i++)
                snprintf(a->desc_hex + 2 * i, 3, "%02x", (unsigned)(uint8_t)desc.data[i]);
        }
        kv_buf_free(&desc);
        if (st != KV_OK) {
            kvx_agent_stop(a);
            return st;
        }
    }
    a->last_sweep_ns = kv_now_ns();
    if (pthread_create(&a->thread, NULL, agent_main, a) != 0) {
        kvx_agent_stop(a);
        return kv_errf(KV_ENOMEM, err, errlen, "kv transfer: cannot start the thread");
    }
    a->started = true;
    *out = a;
    return KV_OK;
}

void kvx_agent_stop(kvx_agent_t *a) {
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->stopping = true;
    pthread_mutex_unlock(&a->mu);
    if (a->started) {
        wake(a);
        pthread_join(a->thread, NULL);
    }
    /* commands that arrived after the thread's last pass */
    for (struct cmd *c = a->cmds, *n; c; c = n) {
        n = c->next;
        if (c->type != CMD_CANCEL)
            agent_complete(a, c->id, c->type == CMD_OFFER, KV_ECANCELLED, NULL, 0,
                           "transfer agent stopped");
        free(c->blocks);
        free(c);
    }
    if (a->listen_fd >= 0) close(a->listen_fd);
    if (a->wake[0] >= 0) close(a->wake[0]);
    if (a->wake[1] >= 0) close(a->wake[1]);
    if (a->tp) a->tp->ops->destroy(a->tp); /* (a failed start) */
    free(a->desc_hex);
    kvx_page_table_free(&a->pt);
    free(a->memo);
    pthread_mutex_destroy(&a->mu);
    free(a);
}
