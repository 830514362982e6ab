/*
 * conn_gate: the per-connection guard in front of libevent's evhttp (listener.c installs it
 * with evhttp_set_bevcb). Every byte a client sends passes through the gate, a bufferevent
 * filter over the socket, before evhttp sees it:
 *
 *   socket --> [gate: frame + validate + limits] --> evhttp (parses the normalized request)
 *   socket <-- [gate: watch response framing]    <-- evhttp (our handlers' replies)
 *
 * What the gate enforces (each refusal is an OpenAI error JSON answer followed by a close; the
 * client's unread bytes are read and dropped, up to 5 s between reads and 30 s in all, so the
 * answer is not lost to a TCP reset):
 *   - the request head (request line + headers): at most max_head_bytes (431) and max_headers
 *     lines (431), read within header_timeout_ms of its first byte (408); request line
 *     "METHOD SP target SP HTTP/1.x" (400, 505 for other versions); header names of token
 *     characters followed directly by ':'; no NUL or other control bytes (TAB excepted), no
 *     obsolete line folding (400);
 *   - Content-Length: digits only; repeated or listed values must agree (400: differing values
 *     are a request-smuggling vector behind proxies); a declared length over max_body_bytes is
 *     answered 413 at once, before any body byte is read; Transfer-Encoding other than
 *     "chunked", or together with Content-Length, is refused (501 / 400);
 *   - chunked bodies are re-framed for evhttp (chunk extensions and trailers, valid HTTP that
 *     libevent 2.1 refuses with an HTML page, are dropped) and counted against max_body_bytes;
 *   - a body must keep arriving: header_timeout_ms between reads (408);
 *   - buffered request bytes: each request reserves its head and declared body from the
 *     listener-wide budget max_buffered_bytes until its response is complete; a request that
 *     does not fit is answered 503 (Retry-After: 1) at once;
 *   - connections: at max_connections a new connection closes the one that has waited longest
 *     for a request's first byte (fresh or idle keep-alive; nginx's reusable connections);
 *     without such a one, up to GATE_PROBE_RESERVE (16) more connections may send one
 *     GET /health or GET /ready (answered, then closed; other requests 503), and past those a
 *     new connection is answered 503 and closed;
 *   - keep-alive: a connection idle between requests for keepalive_timeout_ms is closed.
 * One request at a time per connection: the next pipelined request is held (at most 64 KiB of
 * it is read from the socket) until the previous response is complete.
 *
 * Half-closed clients: a client that shuts down its sending side after its request, at any
 * time before the answer is complete, still gets the answer: the end of input is held back
 * from evhttp until the response is complete, then the connection is closed. A client that
 * closed its socket completely looks the same until we send it a byte, which it answers with
 * a reset: so bytes go out at once (the answer's, or an interim "HTTP/1.1 100 Continue" when
 * the answer has not begun), and a reset (watched every GATE_WATCH_MS, and seen by writes and
 * http_gate_client_gone) closes the connection, which cancels the request. HTTP/1.0 clients
 * get no 1xx: an end of input before their answer began means they left (it is cancelled).
 *
 * Thread-safety: the loop thread of the listener's event_base only.
 */
#ifndef KV_HTTP_CONN_GATE_H
#define KV_HTTP_CONN_GATE_H

#include <stddef.h>
#include <stdint.h>

#include <event2/event.h>
#include <event2/http.h>

struct http_reply_ctx;

/* Limits; 0 in any field picks its default (shown). */
struct http_gate_limits {
    size_t max_head_bytes;     /* request line + headers; default 1 MiB */
    int max_headers;           /* header lines; default 256 */
    size_t max_body_bytes;     /* default 16 MiB */
    size_t max_buffered_bytes; /* all requests of the listener being read or answered; default 256 MiB */
    int max_connections;       /* default 4096, at most RLIMIT_NOFILE - 64 */
    int header_timeout_ms;     /* whole head; also between body reads; default 60000 (nginx) */
    int keepalive_timeout_ms;  /* idle between requests; default 75000 (nginx) */
};

/* What the gates did (loop thread; read with http_gates_stats). */
struct http_gate_stats {
    int connections;              /* open now */
    size_t buffered_bytes;        /* reserved now */
    uint64_t refused_connections; /* over max_connections (503) */
    uint64_t refused_busy;        /* over max_buffered_bytes (503) */
    uint64_t refused_bad;         /* malformed heads / bodies (400, 431, 501, 505) */
    uint64_t refused_too_large;   /* bodies over max_body_bytes (413) */
    uint64_t timeouts;            /* 408 answers */
    uint64_t idle_closed;         /* keep-alive connections closed after the idle timeout */
    uint64_t idle_shed;           /* idle connections closed to make room at max_connections */
    uint64_t probes_over_cap;     /* /health, /ready answered past max_connections */
};

struct http_gates;

/* Creates the gate set of one listener and installs it on http (evhttp_set_bevcb). lim is
 * copied; reply (borrowed, outlives the gates) counts the refusals' statuses and gives the
 * identity header; name prefixes log lines. NULL when out of memory (nothing installed). */
struct http_gates *http_gates_new(struct event_base *base, struct evhttp *http,
                                  const struct http_gate_limits *lim,
                                  const struct http_reply_ctx *reply, const char *name);
/* The effective limits (defaults resolved). */
const struct http_gate_limits *http_gates_limits(const struct http_gates *gs);
void http_gates_stats(const struct http_gates *gs, struct http_gate_stats *out);
/* Is the client of conn gone while its request is answered? For requests computed without
 * writing (libevent does not read the connection meanwhile): peeks at the socket. True on a
 * reset or error, and on an end of input that is not a half-close (gate_input_ended in
 * conn_gate.c: an HTTP/1.1 client whose input ended is sent an interim "100 Continue" and is
 * gone only once it resets the connection). False while it may still read. Loop thread. */
#include <stdbool.h>
bool http_gate_client_gone(struct evhttp_connection *conn);
/* Has the client of conn ended its input (a FIN) while its request is answered, with no reset
 * seen yet? It may have half-closed (it still reads) or closed its socket (its next received
 * byte draws a reset, which the gate then sees within GATE_WATCH_MS and turns into a close).
 * A caller whose answer has begun and that has nothing to write for a while (a stream whose
 * request is still in prefill) sends a byte that costs a half-closed client nothing (an SSE
 * comment) to tell the two apart. Loop thread. */
bool http_gate_input_held(struct evhttp_connection *conn);

/* Drops the owner's reference. Call after evhttp_free: connections libevent frees later
 * (deferred finalizers) still find their gate set; the last one frees it. NULL is a no-op. */
void http_gates_release(struct http_gates *gs);

#endif
