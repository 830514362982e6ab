/*
 * prep: request preparation off the loop thread. Parsing a request body, rendering a chat
 * template and tokenizing a prompt cost time in proportion to the request (a 15 MB prompt:
 * seconds), so they run on a small pool of worker threads; the loop thread only moves the
 * body into a job, and later answers or submits what the job produced. /health, streams'
 * tokens and every other request keep flowing meanwhile.
 *
 *   loop: prep_submit(req) -- body moved (no copy) --> queue --> worker: parse, checks,
 *         render, early length check, tokenize, length checks --> done queue + wake (wake.h)
 *   loop: on_done --> client gone? free the request : error JSON | gen_start | /tokenize reply
 *
 * Early length check (completions, chat, kv_probe; not /tokenize, which counts any text): a
 * prompt (chat: the rendered one) longer than PREP_SLACK x max_model_len x (the longest token
 * in bytes) cannot fit and is refused before it is tokenized (normalizers may shrink text a
 * little, hence the slack); the exact check follows tokenization.
 *
 * Test hook: with KVSERVE_TEST_PREP_GATE naming a FIFO, each job waits before its work until
 * the FIFO is opened for writing and a byte is written to it (tests/e2e/http_limits.py holds a
 * request in preparation this way, deterministically). Unset in production.
 *
 * Threads: the workers read srv.t (immutable), srv.lim, srv.cfg (fixed while serving) and the
 * prefix cache (thread-safe); nothing of libevent. The request object is only touched on the
 * loop thread.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <event2/buffer.h>

#include "conn_gate.h"
#include "server_internal.h"
#include "tokenizer/prefix_cache.h"

#define PREP_SLACK 4
#define PREP_NICE 5

struct prep_job {
    struct prep_job *next;   /* the waiting queue (under P.mu) */
    struct wake_node node;   /* the done stack (P.done) */
    struct evhttp_request *req;
    enum prep_what what;
    enum oai_kind kind;
    struct evbuffer *body;   /* owned: the request body, moved out of req */
    /* results */
    bool failed;
    struct oai_error err;
    bool has_r;
    struct oai_request r;
    int32_t *ids;            /* owned (n) */
    size_t n;
    kv_buf reply;            /* /tokenize: the JSON answer, built by the worker */
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct prep_job *qhead, *qtail;   /* waiting for a worker */
    struct wake_stack done;           /* finished, for the loop: lock-free (a worker preempted
                                         under a lock the loop takes would stall it; wake.h) */
    bool stop;
    pthread_t th[PREP_MAX_THREADS];
    int n_threads;
    struct loop_wake *wake;           /* signalled by the workers (wake.h) */
    size_t max_prompt_bytes;          /* early length check */
    int pending;                      /* submitted, not yet answered (loop thread) */
    const char *test_gate;            /* KVSERVE_TEST_PREP_GATE (a FIFO) or NULL */
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void job_free(struct prep_job *j) {
    if (j->body) evbuffer_free(j->body);
    if (j->has_r) oai_request_free(&j->r);
    free(j->ids);
    kv_buf_free(&j->reply);
    free(j);
}

static void fail(struct prep_job *j, int status, const char *type, const char *param,
                 const char *code, const char *msg) {
    j->failed = true;
    oai_errf(&j->err, status, type, param, code, "%s", msg);
}

/* the request field that holds the prompt: what a prompt error names */
static const char *prompt_param(const struct prep_job *j) { return j->kind == OAI_CHAT ? "messages" : "prompt"; }

/* bytes: the prompt's size; known false: rendering stopped at the bound (more than it) */
static bool too_long_early(struct prep_job *j, size_t bytes, bool known) {
    if (!P.max_prompt_bytes || (known && bytes <= P.max_prompt_bytes)) return false;
    char msg[300], size[64];
    if (known) snprintf(size, sizeof size, "%zu bytes", bytes);
    else snprintf(size, sizeof size, "more than %zu bytes", P.max_prompt_bytes);
    snprintf(msg, sizeof msg,
             "This model's maximum context length is %d tokens; the prompt has %s, more "
             "than any prompt of that many tokens (refused before tokenization)",
             srv.lim.max_model_len, size);
    fail(j, 400, "invalid_request_error", prompt_param(j),
         "context_length_exceeded", msg);
    return true;
}

/* The worker's part of POST /v1/completions, /v1/chat/completions, /kv_probe, /tokenize. */
static void prepare(struct prep_job *j) {
    size_t len = evbuffer_get_length(j->body);
    const char *body = len ? (const char *)evbuffer_pullup(j->body, -1) : "";
    if (len && !body) {
        fail(j, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    if (j->what == PREP_PROBE) { /* a completions body (prompt) or a chat body (messages) */
        json_t *o = json_loadb(body, len, 0, NULL);
        j->kind = o && json_object_get(o, "messages") ? OAI_CHAT : OAI_COMPLETION;
        json_decref(o);
    }
    if (oai_parse(j->kind, body, len, &srv.lim, &j->r, &j->err)) {
        j->failed = true;
        return;
    }
    j->has_r = true;
    evbuffer_free(j->body); /* the request holds what it needs */
    j->body = NULL;
    struct oai_request *r = &j->r;
    if (j->what != PREP_TOKENIZE) {
        const char *role = srv.cfg && srv.cfg->role ? srv.cfg->role : "aggregated";
        if ((r->disagg.type == OAI_DISAGG_CONTEXT_ONLY && strcmp(role, "context")) ||
            (r->disagg.type == OAI_DISAGG_GENERATION_ONLY && strcmp(role, "generation"))) {
            char msg[200];
            snprintf(msg, sizeof msg, "this worker runs --role %s and does not serve %s legs", role,
                     r->disagg.type == OAI_DISAGG_CONTEXT_ONLY ? "context_only" : "generation_only");
            fail(j, 400, "invalid_request_error", "disaggregated_params.request_type", NULL, msg);
            return;
        }
        if (j->what == PREP_PROBE) {
            r->probe = true;
            r->stream = false;
            if (r->disagg.type != OAI_DISAGG_NONE) {
                fail(j, 400, "invalid_request_error", "disaggregated_params", NULL,
                     "/kv_probe takes an ordinary completions or chat body (no disaggregated_params)");
                return;
            }
        }
    }
    if (j->what == PREP_GENERATE) { /* response_format / guided_* / tool_choice -> grammar (structured.c) */
        struct oai_error se;
        if (oai_structured_compile(r, (enum gram_tool_fmt)srv.lim.tool_fmt, &se)) {
            j->err = se;
            j->failed = true;
            return;
        }
    }
    /* /tokenize counts any text (clients use it to measure prompts); generation refuses what
     * cannot fit before tokenizing it */
    size_t bound = j->what == PREP_TOKENIZE ? 0 : P.max_prompt_bytes;
    if (bound && r->has_text && too_long_early(j, r->text_len, true)) return;
    char err[512] = "";
    struct prefix_cache *pc = srv.cfg ? srv.cfg->prefix_cache : NULL;
    bool add_special = j->what == PREP_TOKENIZE ? r->add_special : true;
    kv_status st = oai_prompt_ids_bounded(srv.t, pc, r, add_special, bound, &j->ids, &j->n, err,
                                          sizeof err);
    if (st == KV_ETOOLONG) {
        too_long_early(j, 0, false); /* the rendered chat prompt passed the bound: its size is unknown */
        return;
    }
    if (st == KV_EINVAL) {
        fail(j, 400, "invalid_request_error", "messages", NULL,
             *err ? err : "the messages cannot be rendered with this model's chat template");
        return;
    }
    if (st) {
        fail(j, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    if (j->what == PREP_TOKENIZE) { /* millions of ids: formatted here, not on the loop */
        kv_status bst = kv_buf_puts(&j->reply, "{\"tokens\":[");
        char num[16];
        for (size_t i = 0; !bst && i < j->n; i++) {
            int l = snprintf(num, sizeof num, i ? ",%d" : "%d", (int)j->ids[i]);
            bst = kv_buf_append(&j->reply, num, (size_t)l);
        }
        if (!bst) bst = kv_buf_printf(&j->reply, "],\"count\":%zu,\"max_model_len\":%d}", j->n,
                                      srv.lim.max_model_len);
        if (bst) fail(j, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    int mml = srv.lim.max_model_len;
    if (j->n == 0) {
        fail(j, 400, "invalid_request_error", prompt_param(j), NULL,
             "the prompt is empty (no tokens)");
    } else if (mml > 0 && j->n >= (size_t)mml) {
        char msg[256];
        snprintf(msg, sizeof msg,
                 "This model's maximum context length is %d tokens; the prompt has %zu tokens "
                 "(at least 1 token must be left for the completion)", mml, j->n);
        fail(j, 400, "invalid_request_error", prompt_param(j),
             "context_length_exceeded", msg);
    } else if (mml > 0 && j->r.max_tokens_given && j->n + (size_t)j->r.max_tokens > (size_t)mml) {
        /* vLLM refuses an explicit max_tokens that does not fit beside the prompt (its
         * serving_engine's input validation; the message follows its wording) */
        char msg[320];
        snprintf(msg, sizeof msg,
                 "This model's maximum context length is %d tokens. However, you requested %zu tokens "
                 "(%zu in the %s, %d in the completion). Please reduce the length of the %s or completion.",
                 mml, j->n + (size_t)j->r.max_tokens, j->n, prompt_param(j),
                 j->r.max_tokens, prompt_param(j));
        fail(j, 400, "invalid_request_error", prompt_param(j),
             "context_length_exceeded", msg);
    } else if (mml > 0 && j->r.min_tokens > 0 && j->n + (size_t)j->r.min_tokens > (size_t)mml) {
        /* min_tokens cannot be honoured: refused on both endpoints, naming it (a default
         * max_tokens capped at the context would otherwise end the choice before it) */
        char msg[320];
        snprintf(msg, sizeof msg,
                 "min_tokens (%d) does not fit beside the prompt: this model's maximum context length is "
                 "%d tokens and the %s has %zu",
                 j->r.min_tokens, mml, prompt_param(j), j->n);
        fail(j, 400, "invalid_request_error", "min_tokens", "context_length_exceeded", msg);
    }
}

static void *worker(void *arg) {
    (void)arg;
    /* below the loop and engine threads: when cores are short, a bulk tokenization waits,
     * not the streams and health checks (Linux: nice is per thread) */
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), PREP_NICE) != 0) { /* best effort */ }
    pthread_mutex_lock(&P.mu);
    for (;;) {
        while (!P.stop && !P.qhead) pthread_cond_wait(&P.cv, &P.mu);
        if (P.stop) break;
        struct prep_job *j = P.qhead;
        P.qhead = j->next;
        if (!P.qhead) P.qtail = NULL;
        pthread_mutex_unlock(&P.mu);
        if (P.test_gate) { /* the test hook (see above): open blocks until the test's writer */
            int fd = open(P.test_gate, O_RDONLY);
            char c;
            if (fd >= 0 && read(fd, &c, 1) < 0) { /* released either way */ }
            if (fd >= 0) close(fd);
        }
        prepare(j);
        loop_wake_push(P.wake, &P.done, &j->node);
        pthread_mutex_lock(&P.mu);
    }
    pthread_mutex_unlock(&P.mu);
    return NULL;
}

static void free_reply(const void *data, size_t len, void *arg) {
    (void)len;
    (void)arg;
    free((void *)data);
}

/* The loop's part: answer, or hand the prepared request to the engine. */
static void finish(struct prep_job *j) {
    struct evhttp_request *req = j->req;
    struct evhttp_connection *conn = evhttp_request_get_connection(req);
    if (conn == NULL) { /* the client left: libevent gave it to us */
        evhttp_request_free(req);
        return;
    }
    if (http_gate_client_gone(conn)) { /* known gone (a reset, or an HTTP/1.0 end of input) while
                                          its request was prepared: not started (freeing the
                                          connection frees the request); a closed socket still
                                          unknown is cancelled once its reset is seen */
        srv.ctr.client_disconnects++;
        evhttp_connection_free(conn);
        return;
    }
    if (j->failed) {
        http_send_error(req, &j->err);
        return;
    }
    if (j->what == PREP_TOKENIZE) { /* the worker's bytes, handed over without a copy */
        struct evbuffer *b = evbuffer_new();
        char *data = j->reply.data;
        size_t len = j->reply.len;
        if (!b || evbuffer_add_reference(b, data, len, free_reply, NULL) != 0) {
            if (b) evbuffer_free(b);
            http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
            return;
        }
        kv_buf_init(&j->reply); /* the evbuffer owns the bytes now */
        http_count_status(200);
        http_common_headers(req, "application/json");
        evhttp_send_reply(req, 200, NULL, b);
        evbuffer_free(b);
        return;
    }
    /* accepted before a drain began: it still runs, unless the drain time is already over */
    if (srv.stopping && server_drain_failing()) {
        http_send_errf(req, 503, "server_error", NULL, "shutting_down", "the server is shutting down");
        return;
    }
    gen_start(req, &j->r, j->ids, j->n);
}

static void on_done(void *arg) {
    (void)arg;
    for (struct wake_node *n = wake_stack_take_all(&P.done), *next; n; n = next) { /* oldest first */
        next = n->next;
        struct prep_job *j = WAKE_ITEM(n, struct prep_job, node);
        P.pending--;
        finish(j);
        job_free(j);
    }
    /* a stop waits for prepared requests too (server.c begin_stop) */
    server_maybe_drained();
}

void prep_submit(struct evhttp_request *req, enum prep_what what, enum oai_kind kind) {
    struct prep_job *j = calloc(1, sizeof *j);
    struct evbuffer *b = j ? evbuffer_new() : NULL;
    if (!j || !b || evbuffer_add_buffer(b, evhttp_request_get_input_buffer(req)) != 0) {
        free(j);
        if (b) evbuffer_free(b);
        http_send_errf(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    j->req = req;
    j->what = what;
    j->kind = kind;
    j->body = b;
    P.pending++;
    pthread_mutex_lock(&P.mu);
    if (P.qtail) P.qtail->next = j;
    else P.qhead = j;
    P.qtail = j;
    pthread_cond_signal(&P.cv);
    pthread_mutex_unlock(&P.mu);
}

int prep_pending(void) { return P.pending; }

kv_status prep_init(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > PREP_MAX_THREADS) n_threads = PREP_MAX_THREADS;
    P.stop = false;
    P.pending = 0;
    P.qhead = P.qtail = NULL;
    wake_stack_init(&P.done);
    P.test_gate = getenv("KVSERVE_TEST_PREP_GATE");
    if (P.test_gate && !*P.test_gate) P.test_gate = NULL;
    /* the longest token in bytes bounds how many bytes max_model_len tokens can cover */
    size_t longest = 1;
    char buf[1024];
    for (int id = 0; id < tok_n_vocab(srv.t); id++) {
        int n = tok_token_bytes(srv.t, id, buf, sizeof buf);
        if (n > (int)longest) longest = (size_t)n;
    }
    P.max_prompt_bytes = srv.lim.max_model_len > 0
                             ? (size_t)PREP_SLACK * (size_t)srv.lim.max_model_len * longest
                             : 0;
    P.wake = loop_wake_new(srv.base, on_done, NULL);
    if (!P.wake) return KV_ENOMEM;
    for (P.n_threads = 0; P.n_threads < n_threads; P.n_threads++)
        if (pthread_create(&P.th[P.n_threads], NULL, worker, NULL) != 0) break;
    if (P.n_threads == 0) {
        loop_wake_free(P.wake);
        P.wake = NULL;
        return KV_ENOMEM;
    }
    return KV_OK;
}

/* Shutdown: a job never started or never answered; its request dies with its connection
 * (evhttp_free), unless libevent already handed it to us. */
static void drop(struct prep_job *j) {
    if (evhttp_request_get_connection(j->req) == NULL) evhttp_request_free(j->req);
    job_free(j);
}

void prep_shutdown(void) {
    pthread_mutex_lock(&P.mu);
    P.stop = true;
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.n_threads; i++) pthread_join(P.th[i], NULL);
    P.n_threads = 0;
    for (struct prep_job *j = P.qhead, *n; j; j = n) {
        n = j->next;
        drop(j);
    }
    for (struct wake_node *n = wake_stack_take_all(&P.done), *next; n; n = next) {
        next = n->next;
        drop(WAKE_ITEM(n, struct prep_job, node));
    }
    P.qhead = P.qtail = NULL;
    P.pending = 0;
    loop_wake_free(P.wake);
    P.wake = NULL;
}
