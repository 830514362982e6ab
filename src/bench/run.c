/* bench run: one thread, libcurl multi, every request streamed and timestamped.
 *
 *   session lifecycle:  start -> [send turn k -> in flight -> reply] -> think -> send k+1 ...
 *                                                     \-> error: session aborted (later turns unsent)
 *   closed loop: `concurrency` sessions in progress at any time (a finished one is replaced).
 *   open loop:   session starts arrive as a Poisson process of `request_rate` per second.
 */
#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "bench/bench.h"

bench_config bench_config_defaults(void) {
    bench_config c;
    memset(&c, 0, sizeof c);
    c.url = "http://127.0.0.1:8000";
    c.api = BENCH_API_CHAT;
    c.concurrency = 1;
    c.default_max_tokens = 128;
    c.temperature = -1;
    c.seed = 1;
    c.progress = 1;
    c.progress_interval_s = 5;
    return c;
}

int bench_record_output_tokens(const bench_record *r) {
    return r->completion_tokens >= 0 ? r->completion_tokens : (int)r->n_chunks;
}

void bench_result_free(bench_result *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n_records; i++) {
        free(r->records[i].chunk_s);
        free(r->records[i].error_kind);
        free(r->records[i].error_msg);
    }
    free(r->records);
    free(r->model);
    memset(r, 0, sizeof *r);
}

typedef struct sess_st {
    uint32_t seq, tidx;
    const bench_session *s;
    size_t turn;      /* next turn to send */
    char **replies;   /* owned, replies[k] for k < turn */
    double ready_at;  /* run-relative seconds */
    bool in_flight;
    void *req;        /* the req_st in flight, or NULL */
    struct sess_st *next; /* active list */
} sess_st;

struct runner;
typedef struct {
    struct runner *run;
    CURL *h;
    struct curl_slist *hdrs;
    char *body;
    sess_st *sess;
    bench_record rec;
    size_t chunk_cap;
    bench_sse sse;
    kv_buf reply;
    kv_buf errbody;
    uint64_t t0_ns;
    bool done_seen;
    char *err_kind, *err_msg; /* first stream-level problem */
} req_st;

typedef struct runner {
    const bench_config *c;
    const bench_trace *t;
    CURLM *m;
    uint64_t t0_ns;
    sess_st *active;
    size_t n_active, n_inflight;
    size_t started, target_sessions; /* target 0 = unlimited */
    size_t planned_requests;         /* 0 = unknown */
    bench_result *res;
    size_t rec_cap;
    double next_arrival;
    kv_rng rng;
    bool stopping;    /* no new requests */
    bool oom;
    char run_tag[32];
    /* progress */
    bool tty;
    double last_progress;
    FILE *pout;
} runner;

static double rel_s(const runner *r, uint64_t ns) { return (double)(ns - r->t0_ns) * 1e-9; }

/* The run's clock (bench_config.now_ns, default the monotonic clock). */
static uint64_t clk(const runner *r) { return r->c->now_ns ? r->c->now_ns(r->c->clock_arg) : kv_now_ns(); }

static void set_err(char **kind, char **msg, const char *k, const char *m) {
    if (*kind) return;
    *kind = kv_strdup(k);
    *msg = kv_strdup(m ? m : k);
}

/* ---- SSE event handling ---- */
static int on_event(void *ud, const char *data, size_t len) {
    req_st *q = ud;
    (void)len;
    if (!strcmp(data, "[DONE]")) {
        q->done_seen = true;
        return 0;
    }
    json_error_t je;
    /* JSON_ALLOW_NUL: a text chunk may be U+0000 (a <0x00> byte token; valid JSON) */
    json_t *j = json_loads(data, JSON_ALLOW_NUL, &je);
    if (!j) {
        char m[200];
        snprintf(m, sizeof m, "unparsable SSE data: %.120s", data);
        set_err(&q->err_kind, &q->err_msg, "bad_json", m);
        return 0;
    }
    json_t *e = json_object_get(j, "error");
    if (e && !json_is_null(e)) {
        const char *m = json_string_value(json_object_get(e, "message"));
        if (!m) m = json_string_value(e);
        set_err(&q->err_kind, &q->err_msg, "stream_error", m ? m : "error event in stream");
    }
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    if (ch) {
        const json_t *tj = q->run->c->api == BENCH_API_CHAT ? json_object_get(json_object_get(ch, "delta"), "content")
                                                             : json_object_get(ch, "text");
        const char *txt = json_string_value(tj);
        const size_t tl = json_string_length(tj);
        if (txt && tl) {
            double ts = (double)(clk(q->run) - q->t0_ns) * 1e-9;
            if (q->rec.n_chunks == q->chunk_cap) {
                size_t nc = q->chunk_cap ? q->chunk_cap * 2 : 64;
                double *n2 = kv_realloc(q->rec.chunk_s, nc * sizeof *n2);
                if (!n2) { json_decref(j); q->run->oom = true; return -1; }
                q->rec.chunk_s = n2;
                q->chunk_cap = nc;
            }
            q->rec.chunk_s[q->rec.n_chunks++] = ts;
            if (q->rec.ttft_s < 0) q->rec.ttft_s = ts;
            q->rec.output_chars += tl;
            /* the reply returns in the next turn's prompt, where servers refuse U+0000: kept without NULs */
            for (size_t i0 = 0, i1; i0 < tl; i0 = i1 + 1) {
                for (i1 = i0; i1 < tl && txt[i1]; i1++) {}
                if (i1 > i0 && kv_buf_append(&q->reply, txt + i0, i1 - i0)) { json_decref(j); q->run->oom = true; return -1; }
            }
            if (q->run->c->on_chunk) q->run->c->on_chunk(q->run->c->observer_arg);
        }
    }
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        json_t *v;
        if (json_is_integer(v = json_object_get(u, "prompt_tokens"))) q->rec.prompt_tokens = (int)json_integer_value(v);
        if (json_is_integer(v = json_object_get(u, "completion_tokens"))) q->rec.completion_tokens = (int)json_integer_value(v);
        v = json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens");
        if (json_is_integer(v)) q->rec.cached_tokens = (int)json_integer_value(v);
    }
    json_decref(j);
    return 0;
}

static size_t on_write(char *ptr, size_t size, size_t nmemb, void *ud) {
    req_st *q = ud;
    size_t n = size * nmemb;
    long code = 0;
    curl_easy_getinfo(q->h, CURLINFO_RESPONSE_CODE, &code);
    q->rec.http_status = (int)code;
    if (code != 200) {
        if (q->errbody.len < 4096) kv_buf_append(&q->errbody, ptr, n);
        return n;
    }
    if (bench_sse_feed(&q->sse, ptr, n, on_event, q)) return 0; /* aborts the transfer */
    return n;
}

static size_t on_header(char *ptr, size_t size, size_t nmemb, void *ud) {
    req_st *q = ud;
    size_t n = size * nmemb;
    static const char key[] = "x-kvserve-worker:";
    if (n > sizeof key - 1 && !strncasecmp(ptr, key, sizeof key - 1)) {
        const char *v = ptr + sizeof key - 1;
        const char *e = ptr + n;
        while (v < e && (*v == ' ' || *v == '\t')) v++;
        while (e > v && (e[-1] == '\r' || e[-1] == '\n' || e[-1] == ' ')) e--;
        size_t l = (size_t)(e - v);
        if (l >= sizeof q->rec.worker) l = sizeof q->rec.worker - 1;
        memcpy(q->rec.worker, v, l);
        q->rec.worker[l] = 0;
    }
    return n;
}

/* ---- requests ---- */
static json_t *msg(const char *role, const char *content) {
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string(role));
    json_object_set_new(m, "content", json_string(content ? content : ""));
    return m;
}

static char *build_body(runner *r, sess_st *s, int max_tokens, size_t *prompt_chars) {
    const bench_config *c = r->c;
    json_t *o = json_object();
    json_object_set_new(o, "model", json_string(r->res->model));
    size_t pc = 0;
    if (c->api == BENCH_API_CHAT) {
        json_t *msgs = json_array();
        if (s->s->system) { json_array_append_new(msgs, msg("system", s->s->system)); pc += strlen(s->s->system); }
        for (size_t k = 0; k <= s->turn; k++) {
            json_array_append_new(msgs, msg("user", s->s->turns[k].user));
            pc += strlen(s->s->turns[k].user);
            if (k < s->turn) { json_array_append_new(msgs, msg("assistant", s->replies[k])); pc += strlen(s->replies[k]); }
        }
        json_object_set_new(o, "messages", msgs);
    } else {
        kv_buf b;
        kv_buf_init(&b);
        if (s->s->system) kv_buf_printf(&b, "%s\n\n", s->s->system);
        for (size_t k = 0; k <= s->turn; k++) {
            kv_buf_printf(&b, "User: %s\n\nAssistant:", s->s->turns[k].user);
            if (k < s->turn) kv_buf_printf(&b, "%s\n\n", s->replies[k]);
        }
        pc = b.len;
        json_object_set_new(o, "prompt", json_string(kv_buf_cstr(&b)));
        kv_buf_free(&b);
    }
    json_object_set_new(o, "max_tokens", json_integer(max_tokens));
    json_object_set_new(o, "stream", json_true());
    json_t *so = json_object();
    json_object_set_new(so, "include_usage", json_true());
    json_object_set_new(o, "stream_options", so);
    if (c->ignore_eos) json_object_set_new(o, "ignore_eos", json_true());
    if (c->temperature >= 0) json_object_set_new(o, "temperature", json_real(c->temperature));
    if (c->conversation_id) {
        char id[96];
        snprintf(id, sizeof id, "bench-%s-%u", r->run_tag, s->seq);
        json_object_set_new(o, "conversation_id", json_string(id));
    }
    char *body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    *prompt_chars = pc;
    return body;
}

static void req_free(req_st *q) {
    if (!q) return;
    if (q->h) curl_easy_cleanup(q->h);
    curl_slist_free_all(q->hdrs);
    free(q->body);
    bench_sse_free(&q->sse);
    kv_buf_free(&q->reply);
    kv_buf_free(&q->errbody);
    free(q->err_kind);
    free(q->err_msg);
    free(q->rec.chunk_s);
    free(q->rec.error_kind);
    free(q->rec.error_msg);
    free(q);
}

static bool push_record(runner *r, bench_record *rec) {
    bench_result *res = r->res;
    if (res->n_records == r->rec_cap) {
        size_t nc = r->rec_cap ? r->rec_cap * 2 : 256;
        bench_record *n2 = kv_realloc(res->records, nc * sizeof *n2);
        if (!n2) return false;
        res->records = n2;
        r->rec_cap = nc;
    }
    res->records[res->n_records++] = *rec;
    memset(rec, 0, sizeof *rec);
    return true;
}

static void sess_remove(runner *r, sess_st *s) {
    for (sess_st **pp = &r->active; *pp; pp = &(*pp)->next)
        if (*pp == s) { *pp = s->next; break; }
    for (size_t k = 0; k < s->turn; k++) free(s->replies[k]);
    free(s->replies);
    free(s);
    r->n_active--;
}

static bool send_turn(runner *r, sess_st *s) {
    const bench_config *c = r->c;
    req_st *q = kv_calloc(1, sizeof *q);
    if (!q) return false;
    q->run = r;
    q->sess = s;
    bench_sse_init(&q->sse);
    kv_buf_init(&q->reply);
    kv_buf_init(&q->errbody);
    const bench_turn *tu = &s->s->turns[s->turn];
    int mt = c->max_tokens > 0 ? c->max_tokens : tu->max_tokens > 0 ? tu->max_tokens : c->default_max_tokens;
    q->rec.session = s->seq;
    q->rec.turn = (uint32_t)s->turn;
    q->rec.trace_session = s->tidx;
    q->rec.ttft_s = -1;
    q->rec.e2e_s = -1;
    q->rec.prompt_tokens = q->rec.completion_tokens = q->rec.cached_tokens = -1;
    q->rec.max_tokens = mt;
    q->body = build_body(r, s, mt, &q->rec.prompt_chars);
    q->h = curl_easy_init();
    char url[2048];
    snprintf(url, sizeof url, "%s/v1/%s", c->url, c->api == BENCH_API_CHAT ? "chat/completions" : "completions");
    q->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    q->hdrs = curl_slist_append(q->hdrs, "Accept: text/event-stream");
    q->hdrs = curl_slist_append(q->hdrs, "Expect:");
    if (c->api_key) {
        char a[512];
        snprintf(a, sizeof a, "Authorization: Bearer %s", c->api_key);
        q->hdrs = curl_slist_append(q->hdrs, a);
    }
    if (!q->body || !q->h || !q->hdrs) { req_free(q); return false; }
    curl_easy_setopt(q->h, CURLOPT_URL, url);
    curl_easy_setopt(q->h, CURLOPT_POSTFIELDS, q->body);
    curl_easy_setopt(q->h, CURLOPT_HTTPHEADER, q->hdrs);
    curl_easy_setopt(q->h, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(q->h, CURLOPT_WRITEDATA, q);
    curl_easy_setopt(q->h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(q->h, CURLOPT_HEADERDATA, q);
    curl_easy_setopt(q->h, CURLOPT_PRIVATE, q);
    curl_easy_setopt(q->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(q->h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(q->h, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    if (c->timeout_s > 0) curl_easy_setopt(q->h, CURLOPT_TIMEOUT_MS, (long)(c->timeout_s * 1000));
    if (r->c->on_request_start) r->c->on_request_start(r->c->observer_arg);
    q->t0_ns = clk(r);
    q->rec.start_s = rel_s(r, q->t0_ns);
    if (curl_multi_add_handle(r->m, q->h) != CURLM_OK) { req_free(q); return false; }
    s->in_flight = true;
    s->req = q;
    r->n_inflight++;
    return true;
}

static const char *curl_kind(CURLcode rc, char *tmp, size_t n) {
    switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST: return "connect";
    case CURLE_OPERATION_TIMEDOUT: return "timeout";
    case CURLE_GOT_NOTHING:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE: return "connection_closed";
    default: snprintf(tmp, n, "curl_%d", (int)rc); return tmp;
    }
}

/* Finishes a request (rc from curl, or cancelled); moves its record to the result and
 * advances or ends its session. */
static void finish_req(runner *r, req_st *q, CURLcode rc, bool cancelled) {
    uint64_t now = clk(r);
    curl_multi_remove_handle(r->m, q->h);
    r->n_inflight--;
    q->rec.e2e_s = (double)(now - q->t0_ns) * 1e-9;
    long code = 0;
    curl_easy_getinfo(q->h, CURLINFO_RESPONSE_CODE, &code);
    q->rec.http_status = (int)code;
    if (!cancelled && rc == CURLE_OK && code == 200) bench_sse_finish(&q->sse, on_event, q);
    char tmp[64], m[512];
    if (cancelled) {
        set_err(&q->rec.error_kind, &q->rec.error_msg, "cancelled", "run interrupted");
    } else if (rc != CURLE_OK && !(rc == CURLE_WRITE_ERROR && r->oom)) {
        snprintf(m, sizeof m, "%s", curl_easy_strerror(rc));
        set_err(&q->rec.error_kind, &q->rec.error_msg, curl_kind(rc, tmp, sizeof tmp), m);
    } else if (code != 200) {
        snprintf(tmp, sizeof tmp, "http_%ld", code);
        snprintf(m, sizeof m, "%.400s", kv_buf_cstr(&q->errbody));
        set_err(&q->rec.error_kind, &q->rec.error_msg, tmp, m);
    } else if (q->err_kind) {
        set_err(&q->rec.error_kind, &q->rec.error_msg, q->err_kind, q->err_msg);
    } else if (!q->done_seen) {
        set_err(&q->rec.error_kind, &q->rec.error_msg, "incomplete_stream", "stream ended without data: [DONE]");
    }
    sess_st *s = q->sess;
    s->in_flight = false;
    s->req = NULL;
    bool ok = q->rec.error_kind == NULL;
    if (!push_record(r, &q->rec)) r->oom = true;
    if (ok) {
        s->replies[s->turn] = kv_strdup(kv_buf_cstr(&q->reply));
        if (!s->replies[s->turn]) r->oom = true;
        s->turn++;
        if (s->turn == s->s->n_turns) {
            r->res->sessions_completed++;
            sess_remove(r, s);
        } else {
            s->ready_at = rel_s(r, now) + s->s->turns[s->turn].think_ms * 1e-3;
        }
    } else {
        if (!cancelled) r->res->sessions_aborted++;
        sess_remove(r, s);
    }
    req_free(q);
    if (r->c->on_request_done) r->c->on_request_done(r->c->observer_arg);
}

static bool start_session(runner *r, double now) {
    sess_st *s = kv_calloc(1, sizeof *s);
    if (!s) return false;
    s->seq = (uint32_t)r->started;
    s->tidx = (uint32_t)(r->started % r->t->n_sessions);
    s->s = &r->t->sessions[s->tidx];
    s->replies = kv_calloc(s->s->n_turns, sizeof *s->replies);
    if (!s->replies) { free(s); return false; }
    s->ready_at = now;
    s->next = r->active;
    r->active = s;
    r->n_active++;
    r->started++;
    r->res->sessions_started++;
    return true;
}

static bool can_start(const runner *r) {
    return !r->stopping && (!r->target_sessions || r->started < r->target_sessions);
}

static void progress(runner *r, double now, bool final) {
    const bench_config *c = r->c;
    if (!c->progress) return;
    double iv = r->tty ? 0.25 : (c->progress_interval_s > 0 ? c->progress_interval_s : 5);
    if (!final && now - r->last_progress < iv) return;
    if (final && !r->tty) return;
    r->last_progress = now;
    size_t done = r->res->n_records, errs = 0;
    for (size_t i = 0; i < done; i++) errs += r->res->records[i].error_kind != NULL;
    double rps = now > 0 ? (double)done / now : 0;
    char total[32] = "?", eta[32] = "?";
    if (r->planned_requests) {
        snprintf(total, sizeof total, "%zu", r->planned_requests);
        if (rps > 0 && done > 0) {
            double left = (double)(r->planned_requests > done ? r->planned_requests - done : 0) / rps;
            snprintf(eta, sizeof eta, "%.1fs", left);
        }
    } else if (c->duration_s > 0) {
        snprintf(eta, sizeof eta, "%.1fs", now < c->duration_s ? c->duration_s - now : 0.0);
    }
    fprintf(r->pout, "%s[bench] %zu/%s requests  %.2f req/s  %zu errors  %zu in flight  elapsed %.1fs  ETA %s%s",
            r->tty ? "\r\033[K" : "", done, total, rps, errs, r->n_inflight, now, eta,
            r->tty ? (final ? "\n" : "") : "\n");
    fflush(r->pout);
}

static kv_status fetch_model(const bench_config *c, char **model, char *err, size_t errlen) {
    CURL *h = curl_easy_init();
    if (!h) return kv_errf(KV_ENOMEM, err, errlen, "curl_easy_init failed");
    char url[2048];
    snprintf(url, sizeof url, "%s/v1/models", c->url);
    kv_buf b;
    kv_buf_init(&b);
    struct curl_slist *hd = NULL;
    if (c->api_key) {
        char a[512];
        snprintf(a, sizeof a, "Authorization: Bearer %s", c->api_key);
        hd = curl_slist_append(hd, a);
    }
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, 30L);
    FILE *mem = open_memstream(&b.data, &b.len);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, mem);
    CURLcode rc = curl_easy_perform(h);
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(h);
    curl_slist_free_all(hd);
    fclose(mem);
    kv_status st = KV_OK;
    if (rc != CURLE_OK || code != 200) {
        st = kv_errf(KV_EIO, err, errlen, "GET %s: %s (HTTP %ld); pass --model", url,
                     rc != CURLE_OK ? curl_easy_strerror(rc) : "bad status", code);
    } else {
        json_error_t je;
        json_t *j = json_loads(b.data ? b.data : "", 0, &je);
        const char *id = json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
        if (!id) st = kv_errf(KV_EIO, err, errlen, "GET %s: no data[0].id in the reply; pass --model", url);
        else if (!(*model = kv_strdup(id))) st = KV_ENOMEM;
        json_decref(j);
    }
    free(b.data);
    return st;
}

kv_status bench_run(const bench_config *c, const bench_trace *t, bench_result *out, char *err,
                    size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!c->url || !t || !t->n_sessions) return kv_errf(KV_EINVAL, err, errlen, "bench: no url or empty trace");
    if (c->request_rate <= 0 && c->concurrency < 1)
        return kv_errf(KV_EINVAL, err, errlen, "bench: --concurrency must be >= 1 without --request-rate");
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
        return kv_errf(KV_EIO, err, errlen, "curl_global_init failed");
    kv_status st = KV_OK;
    if (c->model) {
        out->model = kv_strdup(c->model);
        if (!out->model) st = KV_ENOMEM;
    } else {
        st = fetch_model(c, &out->model, err, errlen);
    }
    if (st) {
        curl_global_cleanup();
        return st;
    }
    runner r;
    memset(&r, 0, sizeof r);
    r.c = c;
    r.t = t;
    r.res = out;
    r.pout = c->progress_out ? c->progress_out : stderr;
    r.tty = isatty(fileno(r.pout));
    r.m = curl_multi_init();
    kv_rng_seed(&r.rng, c->seed ^ 0x9e3779b97f4a7c15ull);
    snprintf(r.run_tag, sizeof r.run_tag, "%llx", (unsigned long long)(kv_now_ns() & 0xffffffffffull));
    r.target_sessions = c->num_sessions ? c->num_sessions : (c->duration_s > 0 ? 0 : t->n_sessions);
    if (r.target_sessions)
        for (size_t i = 0; i < r.target_sessions; i++) r.planned_requests += t->sessions[i % t->n_sessions].n_turns;
    r.t0_ns = clk(&r);
    r.last_progress = 0;
    r.next_arrival = 0;
    bool open_loop = c->request_rate > 0;
    double end_t = 0;
    for (;;) {
        double now = rel_s(&r, clk(&r));
        if (c->stop_flag && *c->stop_flag) {
            out->interrupted = true;
            r.stopping = true;
            for (sess_st *s = r.active, *nx; s; s = nx) {
                nx = s->next;
                if (s->req) finish_req(&r, s->req, CURLE_OK, true);
            }
        }
        if (c->duration_s > 0 && now >= c->duration_s) r.stopping = true;
        if (r.oom) r.stopping = true;
        /* new sessions */
        if (!open_loop) {
            while (can_start(&r) && r.n_active < (size_t)c->concurrency)
                if (!start_session(&r, now)) { r.oom = true; r.stopping = true; }
        } else {
            while (can_start(&r) && r.next_arrival <= now &&
                   (c->concurrency <= 0 || r.n_active < (size_t)c->concurrency)) {
                if (!start_session(&r, r.next_arrival)) { r.oom = true; r.stopping = true; break; }
                r.next_arrival += -log(1.0 - kv_rng_f64(&r.rng)) / c->request_rate;
            }
        }
        /* due turns; sessions that can no longer send are dropped */
        double next_due = INFINITY;
        for (sess_st *s = r.active, *nx; s; s = nx) {
            nx = s->next;
            if (s->in_flight) continue;
            if (r.stopping) { sess_remove(&r, s); continue; }
            if (s->ready_at <= now) {
                if (!send_turn(&r, s)) { r.oom = true; r.stopping = true; sess_remove(&r, s); }
            } else if (s->ready_at < next_due) {
                next_due = s->ready_at;
            }
        }
        if (open_loop && can_start(&r) && r.next_arrival < next_due) next_due = r.next_arrival;
        if (r.n_inflight == 0 && r.n_active == 0 && !can_start(&r)) break;
        int running = 0;
        curl_multi_perform(r.m, &running);
        CURLMsg *msg;
        int left;
        bool finished_any = false;
        while ((msg = curl_multi_info_read(r.m, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            req_st *q = NULL;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&q);
            finish_req(&r, q, msg->data.result, false);
            end_t = rel_s(&r, clk(&r));
            finished_any = true;
        }
        now = rel_s(&r, clk(&r));
        progress(&r, now, false);
        double wait = next_due - now;
        if (c->duration_s > 0 && !r.stopping && c->duration_s - now < wait) wait = c->duration_s - now;
        int wait_ms = wait > 0.05 ? 50 : wait <= 0 ? 0 : (int)ceil(wait * 1e3);
        /* a request just finished: its session may send its next turn, or a new session may
         * start, at once (waiting here delayed the next turn by up to 50 ms) */
        if (finished_any) wait_ms = 0;
        if (r.n_inflight > 0 || wait_ms > 0) {
            if (c->on_wait) c->on_wait(c->observer_arg, true);
            curl_multi_poll(r.m, NULL, 0, wait_ms, NULL);
            if (c->on_wait) c->on_wait(c->observer_arg, false);
        }
    }
    if (c->stop_flag && *c->stop_flag) out->interrupted = true;
    out->duration_s = end_t > 0 ? end_t : rel_s(&r, clk(&r));
    progress(&r, rel_s(&r, clk(&r)), true);
    curl_multi_cleanup(r.m);
    curl_global_cleanup();
    if (r.oom) return kv_errf(KV_ENOMEM, err, errlen, "bench: out of memory (partial results kept)");
    return KV_OK;
}
