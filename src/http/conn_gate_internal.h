/*
 * conn_gate internals shared by its three files (not an API; conn_gate.h is):
 *
 *   conn_gate.c       lifecycle (evhttp's bevcb), budget, timers, refusals, socket events
 *   conn_gate_head.c  the request side: head parsing and validation, body framing (gate_in)
 *   conn_gate_out.c   the response side: framing of evhttp's replies, written straight to
 *                     the socket (gate_out, gate_on_reply_queued, gate_on_writable)
 *
 * Everything runs on the listener's loop thread.
 */
#ifndef KV_HTTP_CONN_GATE_INTERNAL_H
#define KV_HTTP_CONN_GATE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <event2/bufferevent.h>
#include <event2/event.h>

#include "conn_gate.h"
#include "http_internal.h"

#define GATE_SOCKET_READ_MAX ((size_t)64 << 10) /* socket bytes held while a request is answered */
#define GATE_LINE_MAX 8192                        /* chunk-size and trailer lines */
#define GATE_OUT_HEAD_MAX ((size_t)64 << 10)      /* our own response heads */
/* After a refusal the client's bytes are read and dropped (nginx's lingering close: up to 5 s
 * between reads, 30 s in all), so a client still sending its body reads the answer instead of
 * a reset. */
#define GATE_LINGER_MS 5000
#define GATE_LINGER_TOTAL_NS 30000000000ull
/* While the end of a client's input is held (a half-close), the socket is checked this often
 * for a reset (the client had closed it completely: our first bytes drew the RST) */
#define GATE_WATCH_MS 100

/* Connections past max_connections that may still send a liveness or readiness probe
 * (GET /health, GET /ready): they are answered, then closed; other requests get 503. */
#define GATE_PROBE_RESERVE 16
#define GATE_PROBE_HEAD_MS 5000 /* such a connection's head must arrive within this */

struct http_gates {
    struct event_base *base;
    struct gate *idle_old, *idle_new; /* connections waiting for a request's first byte, the
                                         longest waiting first (shed at the cap) */
    struct http_gate_limits lim;
    const struct http_reply_ctx *reply;
    char name[32];
    int refs; /* the owner's + one per live gate */
    int shedding; /* connections closed to make room that libevent has not freed yet */
    struct http_gate_stats st;
};

enum rstate { R_HEAD, R_BODY, R_CHUNK_LINE, R_CHUNK_DATA, R_CHUNK_END, R_TRAILER, R_WAIT, R_CLOSING };
/* response side: O_HEAD (find and parse a head) -> O_HEADBYTES (write it) -> what it announced;
 * O_REST finishes a line element (chunk size, chunk end, trailer) the socket took in part */
enum ostate { O_HEAD, O_HEADBYTES, O_BODY, O_CHUNK_LINE, O_CHUNK_DATA, O_CHUNK_END, O_TRAILER,
              O_UNTIL_CLOSE, O_DONE, O_REST };

struct gate {
    struct http_gates *gs;
    struct bufferevent *under, *filt;
    bufferevent_data_cb f_rcb, f_wcb;
    bufferevent_event_cb f_ecb;
    void *f_arg;
    struct event *timer;
    struct event *defer;  /* runs on_defer from the loop (never inside evhttp's own calls) */
    struct event *wev;    /* the socket is writable again (a reply was written in part) */
    bool want_finish;     /* on_defer: hand the end of input to evhttp */
    bool want_error;      /* on_defer: hand a write error to evhttp */
    bool want_kick;       /* on_defer: run a request that waited in the socket buffer */
    /* request side */
    enum rstate rs;
    kv_buf head;        /* the head being read */
    bool begun;         /* a byte of the next request has arrived */
    size_t line_start;
    int n_lines;
    uint64_t body_left; /* R_BODY: bytes to pass; R_CHUNK_DATA: bytes of this chunk */
    uint64_t body_total;
    kv_buf line;        /* a chunk-size or trailer line */
    size_t reserved;    /* bytes of the budget held by the current request */
    bool head_method;   /* the request being answered is a HEAD */
    bool http10;        /* ... is HTTP/1.0 (no interim 1xx answers may be sent) */
    bool half_closed;   /* the client's input ended while its request was answered, and the
                           client still reads (no reset seen): the answer is still sent */
    bool eof_held;      /* ... and that end is kept from evhttp until the answer is out */
    bool refuse_conn;   /* over max_connections: answer 503 once the socket is set */
    bool probe_only;    /* over max_connections, within GATE_PROBE_RESERVE: probes only */
    bool idle;          /* on the gates' idle list (idle_prev / idle_next) */
    bool shed;          /* closed to make room at the connection cap (counted in shedding) */
    struct gate *idle_prev, *idle_next;
    bool finished;      /* EOF handed to evhttp: the connection is being freed */
    uint64_t linger_start_ns;
    uint64_t linger_left; /* bytes still dropped after a refusal before closing */
    int64_t declared;     /* Content-Length of the request being read; -1 none */
    /* response side */
    enum ostate os, onext, pend_os;
    int ostatus;
    kv_buf ohead;
    uint64_t oleft, ohead_left, orest;
    char pend_line[64];   /* O_REST: the line being finished */
    size_t pend_line_len;
    bool streaming;     /* a chunked response is under way */
};

/* ---- conn_gate.c ---- */
bool gate_reserve(struct gate *g, size_t n);     /* from the budget; false: over it */
void gate_release_all(struct gate *g);            /* the request's reservation back */
void gate_arm(struct gate *g, int ms);            /* the gate's timer; ms <= 0 stops it */
void gate_finish(struct gate *g);                 /* end of input to evhttp, from the loop */
/* Answers status with an OpenAI error JSON and closes (linger); counts it. */
void gate_refuse(struct gate *g, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
bool gate_alive(struct gate *g);                  /* evhttp still owns the connection */
void gate_request_complete(struct gate *g);       /* the request's last byte went to evhttp */
void gate_idle(struct gate *g, bool on);          /* joins (as the newest) or leaves the idle list */
/* The client's input ended while its request is answered (rs == R_WAIT): true when that is
 * taken as a half-close (the answer is still sent; a reset seen later ends it), false when the
 * client is gone. */
bool gate_input_ended(struct gate *g);

/* ---- conn_gate_head.c ---- */
enum bufferevent_filter_result gate_in(struct evbuffer *src, struct evbuffer *dst,
                                       ev_ssize_t limit, enum bufferevent_flush_mode mode,
                                       void *ctx);

/* ---- conn_gate_out.c ---- */
void gate_response_done(struct gate *g);
enum bufferevent_filter_result gate_out(struct evbuffer *src, struct evbuffer *dst,
                                        ev_ssize_t limit, enum bufferevent_flush_mode mode,
                                        void *ctx);
void gate_on_reply_queued(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg);
void gate_on_writable(evutil_socket_t fd, short what, void *arg);

#endif
