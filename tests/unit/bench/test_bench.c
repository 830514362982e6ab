/* bench: SSE parser, statistics, trace generation/IO, datasets, and the load generator
 * against a fake OpenAI-style server (libevent evhttp, own thread) that injects delays
 * and errors. The timing tests run on a virtual clock (bench_config.now_ns) that the fake
 * server advances in lockstep with the client, so measured TTFT / ITL / durations are exact
 * whatever the machine's load (see "virtual time" below). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench.h"
#include "test_util.h"

/* ------------------------------------------------------------------ SSE ---- */
typedef struct {
    char ev[16][128];
    int n;
} sse_sink;
static int sink_cb(void *ud, const char *d, size_t n) {
    sse_sink *s = ud;
    assert_int_equal(strlen(d), n);
    snprintf(s->ev[s->n++], 128, "%s", d);
    return 0;
}

static void test_sse_splits(void **st) {
    (void)st;
    const char *in = ": comment\r\ndata: {\"a\":1}\r\n\r\ndata:x\ndata: y\n\nevent: e\ndata: [DONE]\n\n";
    size_t n = strlen(in);
    for (size_t cut = 0; cut <= n; cut++) {
        for (size_t step = 1; step <= 3; step++) {
            bench_sse p;
            bench_sse_init(&p);
            sse_sink s = {.n = 0};
            assert_int_equal(bench_sse_feed(&p, in, cut, sink_cb, &s), 0);
            for (size_t i = cut; i < n; i += step)
                assert_int_equal(bench_sse_feed(&p, in + i, i + step <= n ? step : n - i, sink_cb, &s), 0);
            assert_int_equal(bench_sse_finish(&p, sink_cb, &s), 0);
            assert_int_equal(s.n, 3);
            assert_string_equal(s.ev[0], "{\"a\":1}");
            assert_string_equal(s.ev[1], "x\ny");
            assert_string_equal(s.ev[2], "[DONE]");
            bench_sse_free(&p);
        }
    }
    /* an event without a trailing blank line is delivered by finish */
    bench_sse p;
    bench_sse_init(&p);
    sse_sink s = {.n = 0};
    bench_sse_feed(&p, "data: tail", 10, sink_cb, &s);
    assert_int_equal(s.n, 0);
    bench_sse_finish(&p, sink_cb, &s);
    assert_int_equal(s.n, 1);
    assert_string_equal(s.ev[0], "tail");
    bench_sse_free(&p);
}

/* ------------------------------------------------------------- statistics ---- */
static void test_percentile(void **st) {
    (void)st;
    double v[] = {1, 2, 3, 4};
    /* linear interpolation between closest ranks: pos = p/100*(n-1) */
    assert_true(fabs(bench_percentile(v, 4, 50) - 2.5) < 1e-12);
    assert_true(fabs(bench_percentile(v, 4, 90) - 3.7) < 1e-12);
    assert_true(fabs(bench_percentile(v, 4, 0) - 1) < 1e-12);
    assert_true(fabs(bench_percentile(v, 4, 100) - 4) < 1e-12);
    assert_true(isnan(bench_percentile(v, 0, 50)));
}

/* ------------------------------------------------------------------ traces ---- */
static void test_synth_reproducible(void **st) {
    (void)st;
    bench_synth_params p = bench_synth_defaults();
    p.n_sessions = 30;
    p.turns = 3;
    p.shared_fraction = 0.5;
    p.think_ms_mean = 200;
    p.seed = 42;
    char err[256];
    bench_trace a, b, c;
    assert_int_equal(bench_trace_synth(&p, &a, err, sizeof err), KV_OK);
    assert_int_equal(bench_trace_synth(&p, &b, err, sizeof err), KV_OK);
    p.seed = 43;
    assert_int_equal(bench_trace_synth(&p, &c, err, sizeof err), KV_OK);
    char *ja = bench_trace_to_jsonl(&a), *jb = bench_trace_to_jsonl(&b), *jc = bench_trace_to_jsonl(&c);
    assert_string_equal(ja, jb);
    assert_true(strcmp(ja, jc) != 0);
    /* shape: N sessions of T turns, o tokens, think time 0 on turn 0, word counts */
    assert_int_equal(a.n_sessions, 30);
    size_t shared = 0, thinks = 0;
    for (size_t i = 0; i < a.n_sessions; i++) {
        assert_int_equal(a.sessions[i].n_turns, 3);
        assert_int_equal(a.sessions[i].turns[0].think_ms, 0);
        shared += !strcmp(a.sessions[i].system, a.sessions[0].system) ||
                  !strcmp(a.sessions[i].system, a.sessions[1].system);
        for (size_t j = 0; j < 3; j++) {
            assert_int_equal(a.sessions[i].turns[j].max_tokens, p.output_tokens);
            thinks += a.sessions[i].turns[j].think_ms > 0;
        }
    }
    assert_true(thinks > 30); /* 60 turns with exponential think times */
    /* system prompt: "You are an agent. " + S words */
    size_t words = 0;
    for (const char *c2 = a.sessions[0].system; *c2; c2++) words += *c2 == ' ';
    assert_true(words == p.system_words + 3 || words == p.system_words + 4);
    /* save -> load -> same bytes */
    char path[] = "/tmp/kv_bench_trace_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(bench_trace_save(&a, path, err, sizeof err), KV_OK);
    bench_trace d;
    assert_int_equal(bench_trace_load(path, &d, err, sizeof err), KV_OK);
    char *jd = bench_trace_to_jsonl(&d);
    assert_string_equal(ja, jd);
    char *file;
    size_t flen;
    assert_int_equal(kv_read_file(path, &file, &flen, err, sizeof err), KV_OK);
    assert_int_equal(flen, strlen(ja));
    assert_memory_equal(file, ja, flen);
    free(file);
    unlink(path);
    (void)shared;
    free(ja), free(jb), free(jc), free(jd);
    bench_trace_free(&a), bench_trace_free(&b), bench_trace_free(&c), bench_trace_free(&d);

    /* f = 1: one system prompt for all; f = 0: all different */
    p.shared_fraction = 1;
    assert_int_equal(bench_trace_synth(&p, &a, err, sizeof err), KV_OK);
    for (size_t i = 1; i < a.n_sessions; i++) assert_string_equal(a.sessions[i].system, a.sessions[0].system);
    bench_trace_free(&a);
    p.shared_fraction = 0;
    assert_int_equal(bench_trace_synth(&p, &a, err, sizeof err), KV_OK);
    for (size_t i = 1; i < a.n_sessions; i++) assert_true(strcmp(a.sessions[i].system, a.sessions[0].system) != 0);
    bench_trace_free(&a);
    p.shared_fraction = 2;
    assert_int_equal(bench_trace_synth(&p, &a, err, sizeof err), KV_EINVAL);
}

static void test_datasets(void **st) {
    (void)st;
    char p1[4096], p2[4096], p3[4096], p4[4096];
    if (!test_data_path(p1, sizeof p1, "datasets/fastchat_mt_bench_question.jsonl") ||
        !test_data_path(p2, sizeof p2, "datasets/hh-rlhf-harmless-base-test.jsonl.gz") ||
        !test_data_path(p3, sizeof p3, "datasets/mlenergy_ShareGPT_V3_filtered_1000.json") ||
        !test_data_path(p4, sizeof p4, "datasets/war-and-peace.txt")) {
        skip();
        return;
    }
    char err[512];
    bench_trace t;
    /* MT-Bench: every line, both turns, text as in the file */
    assert_int_equal(bench_trace_dataset("mtbench", p1, 0, 0, 1, &t, err, sizeof err), KV_OK);
    FILE *f = fopen(p1, "r");
    char line[65536];
    size_t n = 0;
    while (fgets(line, sizeof line, f)) {
        json_t *j = json_loads(line, 0, NULL);
        json_t *turns = json_object_get(j, "turns");
        assert_true(n < t.n_sessions);
        assert_int_equal(t.sessions[n].n_turns, json_array_size(turns));
        for (size_t k = 0; k < json_array_size(turns); k++)
            assert_string_equal(t.sessions[n].turns[k].user, json_string_value(json_array_get(turns, k)));
        json_decref(j);
        n++;
    }
    fclose(f);
    assert_int_equal(n, t.n_sessions);
    assert_int_equal(n, 80);
    bench_trace_free(&t);

    /* hh-rlhf: Human turns of "chosen", checked against an independent split of the first record */
    assert_int_equal(bench_trace_dataset("hh-rlhf", p2, 5, 0, 1, &t, err, sizeof err), KV_OK);
    assert_int_equal(t.n_sessions, 5);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "gzip -dc '%s' | head -n 1", p2);
    f = popen(cmd, "r");
    char *big = malloc(1 << 20);
    size_t bl = fread(big, 1, (1 << 20) - 1, f);
    big[bl] = 0;
    pclose(f);
    json_t *j = json_loads(big, 0, NULL);
    const char *chosen = json_string_value(json_object_get(j, "chosen"));
    size_t humans = 0;
    for (const char *c = chosen; (c = strstr(c, "\n\nHuman: ")); c++) humans++;
    assert_int_equal(t.sessions[0].n_turns, humans);
    const char *h0 = strstr(chosen, "\n\nHuman: ") + 9;
    size_t l0 = (size_t)(strstr(h0, "\n\nAssistant:") - h0);
    assert_int_equal(strlen(t.sessions[0].turns[0].user), l0);
    assert_memory_equal(t.sessions[0].turns[0].user, h0, l0);
    for (size_t k = 0; k < t.sessions[0].n_turns; k++) assert_null(strstr(t.sessions[0].turns[k].user, "Assistant:"));
    json_decref(j);
    free(big);
    bench_trace_free(&t);

    assert_int_equal(bench_trace_dataset("sharegpt", p3, 0, 0, 1, &t, err, sizeof err), KV_OK);
    assert_true(t.n_sessions > 900 && t.n_sessions <= 1000);
    assert_int_equal(t.sessions[0].n_turns, 1);
    assert_non_null(strstr(t.sessions[0].turns[0].user, "A blog is a type of website"));
    bench_trace_free(&t);

    assert_int_equal(bench_trace_dataset("war-and-peace", p4, 7, 100, 3, &t, err, sizeof err), KV_OK);
    assert_int_equal(t.n_sessions, 7);
    for (size_t i = 0; i < 7; i++) {
        size_t w = 0;
        const char *u = t.sessions[i].turns[0].user;
        for (size_t k = 0; u[k]; k++)
            w += (u[k] != ' ' && u[k] != '\n' && u[k] != '\r' && u[k] != '\t') &&
                 (k == 0 || u[k - 1] == ' ' || u[k - 1] == '\n' || u[k - 1] == '\r' || u[k - 1] == '\t');
        assert_int_equal(w, 100);
    }
    bench_trace_free(&t);
    assert_int_equal(bench_trace_dataset("nope", p4, 7, 100, 3, &t, err, sizeof err), KV_EINVAL);
}

/* ------------------------------------------------------------ fake server ---- */
/* Behaviour is chosen by the last user message:
 *   "ok <ttft_ms> <itl_ms> <n>"  n chunks "t0 ", "t1 ", ...: first after ttft_ms, then every itl_ms;
 *                                 then a usage chunk (prompt 10, completion n, cached 4), [DONE]
 *   "http500" / "http429"        that status with an OpenAI error body
 *   "streamerr"                   one chunk, then an error event, then [DONE]
 *   "nodone"                      one chunk, then the stream ends without [DONE]
 *   "badjson"                     an unparsable data line, then [DONE]
 * Replies carry X-Kvserve-Worker: w<k % 2> (k = request number). Every request body is kept. */
typedef struct fake_stream {
    struct evhttp_request *req;
    struct event *tm;
    int sent, n, itl_ms;
    int mode; /* 0 ok, 1 streamerr, 2 nodone, 3 badjson */
    int k;    /* request number */
    uint64_t due; /* virtual time of the next chunk */
    struct fake_stream *next; /* virtual time: pending streams */
} fake_stream;

#define FAKE_MAX_CHUNKS 16
static struct {
    struct event_base *base;
    int port;
    pthread_t th;
    int n_requests;
    char *bodies[256];
    /* when the server really received request k and sent its content chunks (monotonic ns,
     * the clock bench uses): the client's measurements are checked against these, so the
     * check holds even when a loaded machine delays the server's timers */
    uint64_t recv_ns[256];
    uint64_t sent_ns[256][FAKE_MAX_CHUNKS];
} fk;

/* ---- virtual time: the fake server owns the clock the client reads (bench_config.now_ns).
 * Instead of timers, each stream's next chunk has a virtual due time; a sequencer on the
 * fake's loop sends the earliest one, setting the clock to its due time, but only when the
 * client has recorded every chunk sent so far (on_chunk) and the server has received every
 * request the client started (on_request_start). So the client reads the clock exactly
 * when the chunk it records was "sent", and a request's start time is the time the server
 * schedules it from: TTFT and ITL come out exactly as injected. Replies the server ended
 * must also be recorded by the client first, and the client must be blocked on the network
 * (a finished session's successor starts at the virtual time its predecessor ended). */
static struct {
    pthread_mutex_t mu;
    bool on;
    uint64_t now;                 /* ns */
    int started, received;        /* requests: client side, server side */
    int sent, consumed;           /* content chunks */
    int ended, finished;          /* replies: ended by the server, recorded by the client */
    bool waiting;                 /* the client is blocked on the network (nothing to do) */
    fake_stream *pending;
    struct event *seq;            /* the sequencer (persistent, 1 ms) */
} vt = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t vt_clock(void *arg) {
    (void)arg;
    pthread_mutex_lock(&vt.mu);
    uint64_t v = vt.now;
    pthread_mutex_unlock(&vt.mu);
    return v;
}
static void vt_on_start(void *arg) {
    (void)arg;
    pthread_mutex_lock(&vt.mu);
    vt.started++;
    pthread_mutex_unlock(&vt.mu);
}
static void vt_on_done(void *arg) {
    (void)arg;
    pthread_mutex_lock(&vt.mu);
    vt.finished++;
    pthread_mutex_unlock(&vt.mu);
}
static void vt_on_wait(void *arg, bool waiting) {
    (void)arg;
    pthread_mutex_lock(&vt.mu);
    vt.waiting = waiting;
    pthread_mutex_unlock(&vt.mu);
}
static void vt_ended(void) {
    pthread_mutex_lock(&vt.mu);
    vt.ended++;
    pthread_mutex_unlock(&vt.mu);
}
static void vt_on_chunk(void *arg) {
    (void)arg;
    pthread_mutex_lock(&vt.mu);
    vt.consumed++;
    pthread_mutex_unlock(&vt.mu);
}
/* The fake's clock: virtual when on, else the monotonic clock. */
static uint64_t fake_now(void) { return vt.on ? vt_clock(NULL) : kv_now_ns(); }

static void send_data(struct evhttp_request *req, const char *s) {
    struct evbuffer *b = evbuffer_new();
    evbuffer_add_printf(b, "data: %s\n\n", s);
    evhttp_send_reply_chunk(req, b);
    evbuffer_free(b);
}

static void fake_tick(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    fake_stream *fs = arg;
    char buf[256];
    if (fs->sent < fs->n) {
        /* each chunk holds a U+0000 (a <0x00> byte token's text; valid JSON, which jansson
         * reads only with JSON_ALLOW_NUL) */
        snprintf(buf, sizeof buf, "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\\u0000 \"}}]}", fs->sent);
        if (fs->k < 256 && fs->sent < FAKE_MAX_CHUNKS) fk.sent_ns[fs->k][fs->sent] = fake_now();
        send_data(fs->req, buf);
        fs->sent++;
        if (fs->sent < fs->n && fs->mode == 0) {
            if (vt.on) { /* back to the pending list, due one ITL later */
                fs->due += (uint64_t)fs->itl_ms * 1000000ull;
                fs->next = vt.pending;
                vt.pending = fs;
                return;
            }
            struct timeval tv = {fs->itl_ms / 1000, (fs->itl_ms % 1000) * 1000};
            evtimer_add(fs->tm, &tv);
            return;
        }
    }
    if (fs->mode == 1) send_data(fs->req, "{\"error\":{\"message\":\"injected\",\"type\":\"server_error\"}}");
    if (fs->mode == 3) send_data(fs->req, "{not json");
    if (fs->mode == 0) {
        snprintf(buf, sizeof buf,
                 "{\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":%d,"
                 "\"prompt_tokens_details\":{\"cached_tokens\":4}}}", fs->n);
        send_data(fs->req, buf);
    }
    if (fs->mode != 2) send_data(fs->req, "[DONE]");
    evhttp_connection_set_closecb(evhttp_request_get_connection(fs->req), NULL, NULL);
    evhttp_send_reply_end(fs->req);
    vt_ended();
    event_free(fs->tm);
    free(fs);
}

/* Virtual time: sends the earliest due chunk once the client is caught up (see vt). */
static void vt_sequence(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what, (void)arg;
    pthread_mutex_lock(&vt.mu);
    bool ready = vt.pending && vt.waiting && vt.consumed == vt.sent &&
                 vt.started == vt.received && vt.finished == vt.ended;
    fake_stream **best = NULL;
    for (fake_stream **p = &vt.pending; ready && *p; p = &(*p)->next)
        if (!best || (*p)->due < (*best)->due || ((*p)->due == (*best)->due && (*p)->k < (*best)->k))
            best = p;
    fake_stream *fs = NULL;
    if (best) {
        fs = *best;
        *best = fs->next;
        if (fs->due > vt.now) vt.now = fs->due;
        if (fs->sent < fs->n) vt.sent++; /* a content chunk goes out */
    }
    pthread_mutex_unlock(&vt.mu);
    if (fs) fake_tick(-1, 0, fs);
}

/* The client went away mid-stream (cancelled run): drop the pending timer. */
static void fake_closed(struct evhttp_connection *conn, void *arg) {
    (void)conn;
    fake_stream *fs = arg;
    for (fake_stream **p = &vt.pending; *p; p = &(*p)->next)
        if (*p == fs) {
            *p = fs->next;
            break;
        }
    /* libevent detached the unfinished request from the dead connection; ending the
     * reply frees it */
    evhttp_send_reply_end(fs->req);
    event_free(fs->tm);
    free(fs);
}

static void fake_handler(struct evhttp_request *req, void *arg) {
    (void)arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    char *body = calloc(1, len + 1);
    evbuffer_remove(in, body, len);
    int k = fk.n_requests++;
    if (k < 256) {
        fk.bodies[k] = body;
        fk.recv_ns[k] = fake_now();
    }
    pthread_mutex_lock(&vt.mu);
    vt.received++;
    pthread_mutex_unlock(&vt.mu);
    json_t *j = json_loads(body, 0, NULL);
    json_t *msgs = json_object_get(j, "messages");
    const char *last = json_string_value(json_object_get(json_array_get(msgs, json_array_size(msgs) - 1), "content"));
    if (!last) last = "";
    struct evkeyvalq *oh = evhttp_request_get_output_headers(req);
    evhttp_add_header(oh, "X-Kvserve-Worker", k % 2 ? "w1" : "w0");
    int code = !strcmp(last, "http500") ? 500 : !strcmp(last, "http429") ? 429 : 0;
    if (code) {
        struct evbuffer *b = evbuffer_new();
        evbuffer_add_printf(b, "{\"error\":{\"message\":\"injected %d\"}}", code);
        evhttp_send_reply(req, code, "Err", b);
        evbuffer_free(b);
        vt_ended();
    } else {
        fake_stream *fs = calloc(1, sizeof *fs);
        fs->req = req;
        fs->k = k;
        int ttft = 0;
        if (sscanf(last, "ok %d %d %d", &ttft, &fs->itl_ms, &fs->n) != 3) {
            fs->n = 1;
            fs->mode = !strcmp(last, "streamerr") ? 1 : !strcmp(last, "nodone") ? 2 : 3;
        }
        evhttp_add_header(oh, "Content-Type", "text/event-stream");
        evhttp_send_reply_start(req, 200, "OK");
        fs->tm = evtimer_new(fk.base, fake_tick, fs);
        evhttp_connection_set_closecb(evhttp_request_get_connection(req), fake_closed, fs);
        if (vt.on) { /* first chunk due ttft after the request's (virtual) arrival */
            fs->due = fk.recv_ns[k < 256 ? k : 0] + (uint64_t)ttft * 1000000ull;
            fs->next = vt.pending;
            vt.pending = fs;
        } else {
            struct timeval tv = {ttft / 1000, (ttft % 1000) * 1000};
            evtimer_add(fs->tm, &tv);
        }
    }
    json_decref(j);
    if (k >= 256) free(body);
}

static void *fake_loop(void *arg) {
    (void)arg;
    event_base_dispatch(fk.base);
    return NULL;
}

static int fake_setup(void **st) {
    (void)st;
    fk.base = event_base_new();
    struct evhttp *h = evhttp_new(fk.base);
    evhttp_set_gencb(h, fake_handler, NULL);
    struct evhttp_bound_socket *s = evhttp_bind_socket_with_handle(h, "127.0.0.1", 0);
    assert_non_null(s);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(evhttp_bound_socket_get_fd(s), (struct sockaddr *)&ss, &sl);
    fk.port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    vt.seq = event_new(fk.base, -1, EV_PERSIST, vt_sequence, NULL);
    struct timeval tv = {0, 1000};
    evtimer_add(vt.seq, &tv);
    pthread_create(&fk.th, NULL, fake_loop, NULL);
    return 0;
}

static void reset_fake(void) {
    for (int i = 0; i < 256; i++) {
        free(fk.bodies[i]);
        fk.bodies[i] = NULL;
    }
    fk.n_requests = 0; /* only touched between runs, when the server is idle */
    pthread_mutex_lock(&vt.mu);
    vt.on = false;
    vt.started = vt.received = vt.sent = vt.consumed = vt.ended = vt.finished = 0;
    vt.waiting = false;
    pthread_mutex_unlock(&vt.mu);
}

/* Switches the fake and c to virtual time (after reset_fake; the server is idle). */
static void use_virtual_time(bench_config *c) {
    pthread_mutex_lock(&vt.mu);
    vt.on = true;
    vt.now = 1000000000ull; /* any origin */
    pthread_mutex_unlock(&vt.mu);
    c->now_ns = vt_clock;
    c->on_request_start = vt_on_start;
    c->on_chunk = vt_on_chunk;
    c->on_request_done = vt_on_done;
    c->on_wait = vt_on_wait;
}

static void add_session(bench_trace *t, const char *sys, int nturns, const char **users) {
    t->sessions = realloc(t->sessions, (t->n_sessions + 1) * sizeof *t->sessions);
    bench_session *s = &t->sessions[t->n_sessions++];
    s->system = sys ? strdup(sys) : NULL;
    s->n_turns = (size_t)nturns;
    s->turns = calloc((size_t)nturns, sizeof *s->turns);
    for (int i = 0; i < nturns; i++) s->turns[i].user = strdup(users[i]);
}

static bench_config fake_config(char *url, size_t cap) {
    snprintf(url, cap, "http://127.0.0.1:%d", fk.port);
    bench_config c = bench_config_defaults();
    c.url = url;
    c.model = "fake";
    c.progress = 0;
    return c;
}

static void test_fake_delays_and_errors(void **st) {
    (void)st;
    reset_fake();
    bench_trace t = {0};
    const char *ok1[] = {"ok 150 40 5"}, *ok2[] = {"ok 60 25 8"}, *e1[] = {"http500"}, *e2[] = {"http429"},
               *e3[] = {"streamerr"}, *e4[] = {"nodone"}, *e5[] = {"badjson"}, *e6[] = {"http500"};
    add_session(&t, NULL, 1, ok1);
    add_session(&t, NULL, 1, e1);
    add_session(&t, NULL, 1, ok2);
    add_session(&t, NULL, 1, e2);
    add_session(&t, NULL, 1, e3);
    add_session(&t, NULL, 1, e4);
    add_session(&t, NULL, 1, e5);
    add_session(&t, NULL, 1, e6);
    char url[64], err[256];
    bench_config c = fake_config(url, sizeof url);
    c.concurrency = 3;
    use_virtual_time(&c);
    bench_result r;
    assert_int_equal(bench_run(&c, &t, &r, err, sizeof err), KV_OK);
    assert_int_equal(r.n_records, 8);
    assert_int_equal(fk.n_requests, 8);
    for (size_t i = 0; i < r.n_records; i++) {
        bench_record *q = &r.records[i];
        const char *u = t.sessions[q->trace_session].turns[0].user;
        int ttft, itl, n;
        if (sscanf(u, "ok %d %d %d", &ttft, &itl, &n) == 3) {
            assert_null(q->error_kind);
            assert_int_equal(q->n_chunks, n);
            assert_int_equal(q->completion_tokens, n);
            assert_int_equal(q->prompt_tokens, 10);
            assert_int_equal(q->cached_tokens, 4);
            /* the request the server saw for this record */
            int sk = -1;
            for (int j = 0; j < fk.n_requests && j < 256; j++)
                if (fk.bodies[j] && strstr(fk.bodies[j], u)) sk = j;
            assert_true(sk >= 0);
            /* virtual time: the client's measurements are exactly the injected delays, and
             * exactly what the server did */
            assert_true(fabs(q->ttft_s - ttft * 1e-3) < 1e-9);
            assert_true(fabs(q->ttft_s - (fk.sent_ns[sk][0] - fk.recv_ns[sk]) * 1e-9) < 1e-9);
            for (size_t k = 1; k < q->n_chunks; k++) {
                assert_true(fabs(q->chunk_s[k] - q->chunk_s[k - 1] - itl * 1e-3) < 1e-9);
                assert_true(fabs(q->chunk_s[k] - q->chunk_s[k - 1] -
                                 (fk.sent_ns[sk][k] - fk.sent_ns[sk][k - 1]) * 1e-9) < 1e-9);
            }
            assert_true(q->ttft_s <= q->e2e_s);
            assert_true(q->e2e_s >= q->chunk_s[n - 1]);
        } else {
            assert_non_null(q->error_kind);
        }
    }
    bench_summary s;
    bench_summarize(&r, &s);
    assert_int_equal(s.requests, 8);
    assert_int_equal(s.ok, 2);
    assert_int_equal(s.failed, 6);
    struct { const char *k; size_t n; } want[] = {{"http_500", 2}, {"http_429", 1}, {"stream_error", 1},
                                                  {"incomplete_stream", 1}, {"bad_json", 1}};
    assert_int_equal(s.n_error_kinds, 5);
    for (size_t w = 0; w < 5; w++) {
        size_t got = 0;
        for (size_t i = 0; i < s.n_error_kinds; i++)
            if (!strcmp(s.errors[i].name, want[w].k)) got = s.errors[i].count;
        assert_int_equal(got, want[w].n);
    }
    assert_int_equal(s.n_workers, 2);
    assert_int_equal(s.workers[0].count + s.workers[1].count, 8);
    assert_int_equal(s.workers[0].count, 4);
    /* ITL pooled over both ok requests: 4 gaps of 40 ms and 7 of 25 ms */
    assert_int_equal(s.itl.n, 11);
    assert_true(fabs(s.itl.mean * 1e3 - (4 * 40 + 7 * 25) / 11.0) < 1e-6);
    assert_true(fabs(s.cached_ratio - 0.4) < 1e-12);
    assert_int_equal(s.output_tokens, 13);
    /* JSON out round trip: every request present */
    char path[] = "/tmp/kv_bench_out_XXXXXX";
    close(mkstemp(path));
    assert_int_equal(bench_write_json(path, &c, &r, &s, err, sizeof err), KV_OK);
    json_t *j = json_load_file(path, 0, NULL);
    assert_int_equal(json_array_size(json_object_get(j, "requests")), 8);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(json_object_get(j, "summary"), "errors"), "http_500")), 2);
    json_decref(j);
    unlink(path);
    bench_result_free(&r);
    bench_trace_free(&t);
}

static void test_fake_multiturn_history(void **st) {
    (void)st;
    reset_fake();
    bench_trace t = {0};
    const char *u[] = {"ok 5 5 3", "ok 5 5 2", "ok 5 5 1"};
    add_session(&t, "sys prompt", 3, u);
    add_session(&t, NULL, 3, u);
    char url[64], err[256];
    bench_config c = fake_config(url, sizeof url);
    c.concurrency = 2;
    c.conversation_id = true;
    c.max_tokens = 7;
    bench_result r;
    assert_int_equal(bench_run(&c, &t, &r, err, sizeof err), KV_OK);
    assert_int_equal(r.n_records, 6);
    assert_int_equal(r.sessions_completed, 2);
    for (size_t i = 0; i < r.n_records; i++) /* "tK\0 ": 4 bytes a chunk, NUL counted */
        assert_int_equal(r.records[i].output_chars, 4 * r.records[i].n_chunks);
    /* the third turn of each session carries both earlier replies as assistant messages (their
     * NULs dropped: servers refuse U+0000 in a prompt) */
    int seen = 0;
    for (int k = 0; k < fk.n_requests; k++) {
        json_t *j = json_loads(fk.bodies[k], 0, NULL);
        json_t *m = json_object_get(j, "messages");
        assert_int_equal(json_integer_value(json_object_get(j, "max_tokens")), 7);
        assert_true(json_is_true(json_object_get(json_object_get(j, "stream_options"), "include_usage")));
        assert_non_null(json_string_value(json_object_get(j, "conversation_id")));
        bool sys = !strcmp(json_string_value(json_object_get(json_array_get(m, 0), "role")), "system");
        size_t base = sys ? 1 : 0;
        if (json_array_size(m) == base + 5) {
            assert_string_equal(json_string_value(json_object_get(json_array_get(m, base + 1), "content")), "t0 t1 t2 ");
            assert_string_equal(json_string_value(json_object_get(json_array_get(m, base + 1), "role")), "assistant");
            assert_string_equal(json_string_value(json_object_get(json_array_get(m, base + 3), "content")), "t0 t1 ");
            assert_string_equal(json_string_value(json_object_get(json_array_get(m, base + 4), "content")), "ok 5 5 1");
            seen++;
        }
        json_decref(j);
    }
    assert_int_equal(seen, 2);
    bench_result_free(&r);
    bench_trace_free(&t);
}

/* A failed turn ends its session: later turns are not sent, and the record is kept. */
static void test_fake_abort_session(void **st) {
    (void)st;
    reset_fake();
    bench_trace t = {0};
    const char *u[] = {"ok 5 5 2", "http500", "ok 5 5 2"};
    add_session(&t, NULL, 3, u);
    char url[64], err[256];
    bench_config c = fake_config(url, sizeof url);
    bench_result r;
    assert_int_equal(bench_run(&c, &t, &r, err, sizeof err), KV_OK);
    assert_int_equal(r.n_records, 2);
    assert_int_equal(fk.n_requests, 2);
    assert_int_equal(r.sessions_aborted, 1);
    assert_string_equal(r.records[1].error_kind, "http_500");
    bench_result_free(&r);
    bench_trace_free(&t);
}

/* Closed loop concurrency, and the stop flag: in-flight requests become "cancelled" records. */
static volatile int g_stop;
static int g_started;
static void stop_at_third_start(void *arg) { /* the runner's thread */
    (void)arg;
    if (++g_started == 3) g_stop = 1;
}

static void test_fake_concurrency_and_stop(void **st) {
    (void)st;
    reset_fake();
    bench_trace t = {0};
    const char *u[] = {"ok 100 5 2"};
    for (int i = 0; i < 8; i++) add_session(&t, NULL, 1, u);
    char url[64], err[256];
    bench_config c = fake_config(url, sizeof url);
    c.concurrency = 4;
    use_virtual_time(&c);
    bench_result r;
    assert_int_equal(bench_run(&c, &t, &r, err, sizeof err), KV_OK);
    assert_int_equal(r.n_records, 8);
    /* two waves of 100 + 5 ms (virtual time: exactly) */
    assert_true(fabs(r.duration_s - 0.210) < 1e-9);
    for (size_t i = 0; i < 8; i++) assert_true(fabs(r.records[i].start_s - (i < 4 ? 0 : 0.105)) < 1e-9);
    bench_result_free(&r);
    bench_trace_free(&t);

    reset_fake();
    memset(&t, 0, sizeof t);
    const char *slow[] = {"ok 5000 5 2"};
    for (int i = 0; i < 5; i++) add_session(&t, NULL, 1, slow);
    c = fake_config(url, sizeof url); /* the real clock */
    c.concurrency = 3;
    g_stop = 0;
    g_started = 0;
    c.stop_flag = &g_stop;
    c.on_request_start = stop_at_third_start; /* the stop lands with 3 requests in flight */
    double t0 = kv_now_s();
    assert_int_equal(bench_run(&c, &t, &r, err, sizeof err), KV_OK);
    assert_true(kv_now_s() - t0 < 4.5); /* liveness: it did not wait for the 5 s replies */
    assert_true(r.interrupted);
    assert_int_equal(r.n_records, 3);
    for (size_t i = 0; i < 3; i++) assert_string_equal(r.records[i].error_kind, "cancelled");
    bench_result_free(&r);
    bench_trace_free(&t);
}

/* Open loop: session starts follow a seeded Poisson process. */
static void test_fake_open_loop(void **st) {
    (void)st;
    reset_fake();
    bench_trace t = {0};
    const char *u[] = {"ok 1 1 1"};
    add_session(&t, NULL, 1, u);
    char url[64], err[256];
    bench_config c = fake_config(url, sizeof url);
    c.request_rate = 40;
    c.concurrency = 0;
    c.num_sessions = 20;
    bench_result r;
    assert_int_equal(bench_run(&c, &t, &r, err, sizeof err), KV_OK);
    assert_int_equal(r.n_records, 20);
    /* 20 arrivals at 40/s: last start near the sum of 20 exponential gaps (mean 0.5 s) */
    double last = 0;
    for (size_t i = 0; i < r.n_records; i++)
        if (r.records[i].start_s > last) last = r.records[i].start_s;
    assert_true(last > 0.15 && last < 1.5);
    bench_result_free(&r);
    bench_trace_free(&t);
}

/* A refused connection is a counted error, not a crash or a silent drop. */
static void test_connect_error(void **st) {
    (void)st;
    bench_trace t = {0};
    const char *u[] = {"ok 1 1 1"};
    add_session(&t, NULL, 1, u);
    add_session(&t, NULL, 1, u);
    bench_config c = bench_config_defaults();
    c.url = "http://127.0.0.1:1";
    c.model = "m";
    c.progress = 0;
    bench_result r;
    char err[256];
    assert_int_equal(bench_run(&c, &t, &r, err, sizeof err), KV_OK);
    assert_int_equal(r.n_records, 2);
    assert_string_equal(r.records[0].error_kind, "connect");
    bench_result_free(&r);
    bench_trace_free(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sse_splits),
        cmocka_unit_test(test_percentile),
        cmocka_unit_test(test_synth_reproducible),
        cmocka_unit_test(test_datasets),
        cmocka_unit_test_setup(test_fake_delays_and_errors, fake_setup),
        cmocka_unit_test(test_fake_multiturn_history),
        cmocka_unit_test(test_fake_abort_session),
        cmocka_unit_test(test_fake_concurrency_and_stop),
        cmocka_unit_test(test_fake_open_loop),
        cmocka_unit_test(test_connect_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
