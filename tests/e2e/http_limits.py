"""HTTP hardening e2e (issue 13): the connection gate in front of evhttp (src/http/conn_gate.c).

Against real `kvserve serve` processes (and one `kvserve router`) on stories260K, over raw
sockets: every refusal is an OpenAI error JSON with the right status (never libevent's HTML);
a declared Content-Length over the limit gets 413 before any body byte is sent; duplicate
differing Content-Length, NUL bytes, obsolete folding, unknown methods, other HTTP versions,
malformed targets and Expect values are refused; chunk extensions and trailers are accepted;
a half-closed client still gets its answer; pipelined requests are answered in order; head
and body timeouts answer 408, idle keep-alive connections are closed; the connection cap
answers 503 and frees its slot when a client leaves; the buffered-bytes budget answers 503
and is released when the request that held it is answered; 20 clients declaring 60 MiB each
do not grow the server; /health is answered while a 4 MB /tokenize is being tokenized, and a
prompt that cannot fit is refused before tokenization. Waits are bounded polls on socket events, never fixed sleeps.

env: KVSERVE_BIN, KVSERVE_TEST_DATA. Exit 0 = passed, 77 = skipped (data missing).
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from e2e_util import Checks, start_kvserve, wait_for  # noqa: E402

BIN = os.environ.get("KVSERVE_BIN", "build/kvserve")
DATA = os.environ.get("KVSERVE_TEST_DATA", os.path.join(os.path.dirname(__file__), "../../../shared/data"))
GGUF = os.path.join(DATA, "models/stories260K/stories260K.gguf")
BODY = b'{"prompt":"Once upon a time","max_tokens":4,"temperature":0}'
WANT_TEXT = ", there was a"

check = Checks()
failures = check.failures


class Proc:
    def __init__(self, args, env=None):
        self.args = args
        self.log = open(os.path.join(tempfile.mkdtemp(prefix="kvserve-limits-"), "log"), "w+")
        self.proc, self.port = start_kvserve(BIN, args, log=self.log, env=env)

    def rss_kb(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            return int(f.read().split("VmRSS:")[1].split()[0])

    def stop(self):
        """SIGTERM; the process must exit 0 (a sanitizer report or a hang fails the test)."""
        self.proc.terminate()
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "hung"
            self.proc.wait()
        if rc != 0:
            self.log.flush()
            self.log.seek(0)
            check(False, "%s exited %s:\n%s" % (self.args[0], rc, self.log.read()[-3000:]))


def server(*extra, env=None):
    return Proc(["serve", "--model", GGUF, "--max-model-len", "256", "--threads", "1", *extra], env=env)


def connect(port, timeout=20):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_all(s):
    """Everything until the server closes (or the socket's timeout: then b"<TIMEOUT>" ends it)."""
    out = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                return out
            out += b
    except socket.timeout:
        return out + b"<TIMEOUT>"
    except ConnectionResetError:
        return out + b"<RESET>"


def read_response(s, buf=b""):
    """One HTTP response (Content-Length or chunked) from s; returns (status, headers, body, rest)."""
    while b"\r\n\r\n" not in buf:
        b = s.recv(65536)
        if not b:
            raise AssertionError("connection closed before a response head: %r" % buf[:200])
        buf += b
    head, buf = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
    if status < 200:
        return read_response(s, buf)
    if "content-length" in hdrs:
        n = int(hdrs["content-length"])
        while len(buf) < n:
            b = s.recv(65536)
            if not b:
                break
            buf += b
        return status, hdrs, buf[:n], buf[n:]
    if hdrs.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in buf:
                buf += s.recv(65536)
            line, buf = buf.split(b"\r\n", 1)
            n = int(line.split(b";")[0], 16)
            while len(buf) < n + 2:
                buf += s.recv(65536)
            body += buf[:n]
            buf = buf[n + 2:]
            if n == 0:
                return status, hdrs, body, buf
    return status, hdrs, buf + read_all(s), b""


def exchange(port, data, shut=False):
    """Sends data (then, with shut, ends the sending side: corked, so the end of input travels
    in the same segment as the request's last bytes, as a client that half-closes right after
    its request) and reads one response."""
    s = connect(port)
    try:
        if shut:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        return read_response(s)
    finally:
        s.close()


def is_error_json(status, hdrs, body, want_status, want_code=None):
    try:
        e = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (status == want_status and hdrs.get("content-type") == "application/json"
            and isinstance(e.get("message"), str) and (want_code is None or e.get("code") == want_code))


def post_head(path, n, extra=b""):
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n" % (
        path.encode(), extra, n)


def completion_ok(status, body):
    try:
        return status == 200 and json.loads(body)["choices"][0]["text"] == WANT_TEXT
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def test_framing(port):
    # a declared body over the limit: 413 at once, the body is never sent
    st, h, b, _ = exchange(port, post_head("/v1/completions", 100_000_000))
    check(is_error_json(st, h, b, 413, "request_too_large"), "Content-Length 1e8: 413 JSON before the body (%s %r)" % (st, b[:120]))
    # request smuggling vectors
    st, h, b, _ = exchange(port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\nContent-Length: 16\r\n\r\n" + b'{"prompt":"hi"} ')
    check(is_error_json(st, h, b, 400, "bad_content_length"), "two different Content-Length: 400 JSON (%s)" % st)
    st, h, b, _ = exchange(port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 15, 16\r\n\r\n" + b'{"prompt":"hi"} ')
    check(is_error_json(st, h, b, 400, "bad_content_length"), "Content-Length list with different values: 400 JSON")
    st, h, b, _ = exchange(port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\nContent-Length: 15\r\nConnection: close\r\n\r\n" + b'{"prompt":"hi"}')
    check(st == 200 and json.loads(b)["tokens"] == [1, 270, 417], "two equal Content-Length: accepted (%s %r)" % (st, b[:80]))
    st, h, b, _ = exchange(port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    check(is_error_json(st, h, b, 400), "Content-Length with Transfer-Encoding: 400 JSON (%s)" % st)
    st, h, b, _ = exchange(port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n")
    check(is_error_json(st, h, b, 501), "Transfer-Encoding gzip: 501 JSON (%s)" % st)
    for name, raw, want in [
            ("NUL in a header value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
            ("obsolete line folding", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n", 400),
            ("space before the colon", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A : a\r\n\r\n", 400),
            ("unknown method", b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n", 501),
            ("HTTP/2.0 request line", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
            ("malformed request line", b"GET /health\r\nHost: x\r\n\r\n", 400),
            ("malformed target", b"GET http://[::1 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
            ("Expect: other than 100-continue", b"POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: bogus\r\nContent-Length: 2\r\n\r\n{}", 417),
            ("bad chunk size", b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400)]:
        st, h, b, _ = exchange(port, raw)
        check(is_error_json(st, h, b, want), "%s: %d JSON (got %s %r)" % (name, want, st, b[:100]))
    # a path that is not UTF-8: a 404 whose message escapes the bytes (was "{}")
    st, h, b, _ = exchange(port, b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    check(is_error_json(st, h, b, 404) and "\\xFF" in json.loads(b)["error"]["message"],
          "a non-UTF-8 path: 404 JSON naming the bytes (%r)" % b[:120])
    # a valid chunked body with a chunk extension and a trailer (was an HTML 413)
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
           b"5;name=value\r\n" + BODY[:5] + b"\r\n%x\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n0\r\nX-Trailer: 1\r\n\r\n")
    st, h, b, _ = exchange(port, raw)
    check(completion_ok(st, b), "chunked body with an extension and a trailer: 200 (%s %r)" % (st, b[:100]))
    # a chunked body over the limit (the server was started with --max-body-size 64KiB)
    s = connect(port)
    s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    try:
        for _ in range(20):
            s.sendall(b"4000\r\n" + b"a" * 0x4000 + b"\r\n")
    except OSError:
        pass
    st, h, b, _ = read_response(s)
    s.close()
    check(is_error_json(st, h, b, 413, "request_too_large"), "chunked body over the limit: 413 JSON (%s)" % st)
    # HEAD: refused with a head and no body
    s = connect(port)
    s.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    out = read_all(s)
    s.close()
    check(out.startswith(b"HTTP/1.1 405") and out.endswith(b"\r\n\r\n"), "HEAD: 405 without a body (%r)" % out[-60:])


def test_mutated_heads(port):
    """400 seeded random mutations (byte flips, insertions, deletions, duplicated lines) of
    valid requests: every answer is a JSON body or a plain close, never libevent's HTML."""
    import random
    rng = random.Random(13)
    bases = [post_head("/tokenize", 15) + b'{"prompt":"hi"}',
             b"GET /health HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"5\r\n{\"pro\r\n0\r\n\r\n"]
    alphabet = b" :\r\n\t\x00\x7f\xff;,0123456789abcdefABCDEF/%?#[]-"
    html = []
    for k in range(400):
        d = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(4)
            i = rng.randrange(len(d))
            if op == 0:
                d[i] = rng.choice(alphabet)
            elif op == 1:
                d[i:i] = bytes([rng.choice(alphabet)])
            elif op == 2 and len(d) > 1:
                del d[i]
            else:
                lines = bytes(d).split(b"\r\n")
                j = rng.randrange(len(lines))
                lines.insert(j, lines[j])
                d = bytearray(b"\r\n".join(lines))
        s = connect(port, timeout=5)
        try:
            s.sendall(bytes(d))
            s.shutdown(socket.SHUT_WR)
            out = read_all(s)
        except OSError:
            out = b""
        s.close()
        for resp in out.split(b"HTTP/1.1 ")[1:]:
            head = resp.split(b"\r\n\r\n", 1)[0].lower()
            if b"content-type: text/html" in head or b"<html" in resp.lower():
                html.append(bytes(d[:80]))
    check(not html, "mutated requests: no HTML answers (%d, e.g. %r)" % (len(html), html[:2]))


def test_half_close_and_pipelining(port):
    st, h, b, _ = exchange(port, post_head("/v1/completions", len(BODY)) + BODY, shut=True)
    check(completion_ok(st, b), "half-closed client gets its completion (%s %r)" % (st, b[:400]))
    s = connect(port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post_head("/v1/completions", len(BODY)) + BODY +
              b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    r1 = read_response(s)
    r2 = read_response(s, r1[3])
    r3 = read_response(s, r2[3])
    s.close()
    check(r1[0] == 200 and b"ok" in r1[2] and completion_ok(r2[0], r2[2]) and r3[0] == 200 and b"stories260K" in r3[2],
          "three pipelined requests answered in order")
    # pipelined requests and then the end of input (shutdown(SHUT_WR)): every one is answered
    # (the end used to close the connection after the first answer)
    s = connect(port)
    s.sendall((post_head("/v1/completions", len(BODY)) + BODY) * 3)
    s.shutdown(socket.SHUT_WR)
    out = read_all(s)
    s.close()
    check(out.count(b"HTTP/1.1 200") == 3 and out.count(b'"text_completion"') == 3,
          "three pipelined requests, then a half-close: three answers (%d)" % out.count(b"HTTP/1.1 200"))
    # a half-closed client of a stream reads it to the end too
    body = b'{"prompt":"Once upon a time","max_tokens":4,"temperature":0,"stream":true}'
    st, h, b, _ = exchange(port, post_head("/v1/completions", len(body)) + body, shut=True)
    check(st == 200 and b.rstrip().endswith(b"data: [DONE]") and b.count(b"data: ") == 6,
          "half-closed client gets its whole stream (%s %r)" % (st, b[-80:]))
    # a client that leaves while its request is answered: cancelled, the server stays fine
    s = connect(port)
    body = b'{"prompt":"Once upon a time","max_tokens":200,"stream":true}'
    s.sendall(post_head("/v1/completions", len(body)) + body)
    s.close()
    st, h, b, _ = exchange(port, post_head("/v1/completions", len(BODY), b"Connection: close\r\n") + BODY)
    check(completion_ok(st, b), "a normal request after a dropped stream")


TCP_FIN_WAIT2 = 5  # linux/tcp_states.h


def tcp_state(s):
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def metric(port, name):
    st, h, b, _ = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    for line in b.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[1])
    raise AssertionError("metric %s missing" % name)


def _try_open(fifo):
    """The FIFO's write end once a prep job waits on it (opening fails with ENXIO before)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


def test_end_of_input_in_prep():
    """The end of a client's input arrives while its request is being prepared: the request is
    held on a prep thread by the test gate (KVSERVE_TEST_PREP_GATE, a FIFO: the job waits until
    it is opened and written) until the server's kernel has acknowledged the client's FIN, then
    released. A half-closed client gets its whole answer (non-streamed and streamed: an interim
    100 Continue may come first); a client that closed its socket is noticed (the interim
    answer draws its reset) and cancelled, and nothing is held. No sleeps: the waits are bounded polls on the FIFO and
    on the client socket's TCP state."""
    fifo = os.path.join(tempfile.mkdtemp(prefix="kvserve-prepgate-"), "gate")
    os.mkfifo(fifo)
    srv = server("--max-model-len", "512", env=dict(os.environ, KVSERVE_TEST_PREP_GATE=fifo))

    def in_prep(body, how):
        """Sends body to /v1/completions, ends the input (how: "half" or "close") while the
        request waits in preparation, then lets preparation go on. Returns the socket (half)."""
        s = connect(srv.port)
        s.sendall(post_head("/v1/completions", len(body)) + body)
        w = wait_for(lambda: _try_open(fifo), 30, "the request to wait in preparation")
        s.shutdown(socket.SHUT_WR)
        wait_for(lambda: tcp_state(s) == TCP_FIN_WAIT2, 10, "the server to acknowledge the FIN")
        if how == "close":
            s.close()
        os.write(w, b"x")
        os.close(w)
        return s

    try:
        for rnd in range(3):
            s = in_prep(BODY, "half")
            st, h, b, _ = read_response(s)
            rest = read_all(s)
            s.close()
            check(completion_ok(st, b) and rest == b"",
                  "end of input during prep (%d): the half-closed client gets its completion, then the close (%s %r %r)"
                  % (rnd, st, b[:200], rest[:40]))
            body = b'{"prompt":"Once upon a time","max_tokens":4,"temperature":0,"stream":true}'
            s = in_prep(body, "half")
            st, h, b, _ = read_response(s)
            s.close()
            check(st == 200 and b.rstrip().endswith(b"data: [DONE]") and b.count(b"data: ") == 6,
                  "end of input during prep (%d): the half-closed client gets its whole stream (%s %r)" % (rnd, st, b[-80:]))
        # a client that closed its socket: noticed and cancelled (max_tokens 480 with ignore_eos
        # leaves it running long after its first token, where it is seen at the latest)
        for stream in (False, True):
            gone0 = metric(srv.port, "kvserve_client_disconnects_total")
            body = json.dumps({"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True,
                               "stream": stream}).encode()
            in_prep(body, "close")
            wait_for(lambda: metric(srv.port, "kvserve_client_disconnects_total") == gone0 + 1, 30,
                     "the closed client to be noticed")
            wait_for(lambda: metric(srv.port, "kvserve_kv_blocks_used") == 0 and
                     metric(srv.port, "kvserve_num_requests_running") == 0, 30, "its blocks to be freed")
            check(True, "a client that closed its socket during prep (stream %s): noticed, blocks freed" % stream)
        # the end of a half-closed client's input arrives while its stream is under way
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                           "temperature": 0, "stream": True}).encode()
        s = connect(srv.port)
        s.sendall(post_head("/v1/completions", len(body)) + body)
        w = wait_for(lambda: _try_open(fifo), 30, "the request to wait in preparation")
        os.write(w, b"x")
        os.close(w)
        first = s.recv(65536)  # the head and the first chunks
        s.shutdown(socket.SHUT_WR)
        st, h, b, _ = read_response(s, first)
        s.close()
        check(st == 200 and b.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in b,
              "half-close during a stream: read to the end (%s %r)" % (st, b[-200:]))
    finally:
        srv.stop()


def test_timeouts():
    srv = server("--header-timeout", "0.3", "--keepalive-timeout", "0.3")
    try:
        s = connect(srv.port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        st, h, b, _ = read_response(s)
        rest = read_all(s)
        s.close()
        check(is_error_json(st, h, b, 408, "request_timeout") and rest == b"",
              "unfinished head: 408 JSON, then closed (%s %r)" % (st, rest[:40]))
        s = connect(srv.port)
        s.sendall(post_head("/tokenize", 15) + b'{"pro')  # the body stalls
        st, h, b, _ = read_response(s)
        s.close()
        check(is_error_json(st, h, b, 408), "stalled body: 408 JSON (%s)" % st)
        s = connect(srv.port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        st, h, b, rest = read_response(s)
        tail = read_all(s)  # nothing more is sent: the idle keep-alive connection is closed
        s.close()
        check(st == 200 and rest + tail == b"", "idle keep-alive connection closed by the server (%r)" % tail[:40])
        s = connect(srv.port)  # a connection that never sends a byte is closed too
        out = read_all(s)
        s.close()
        check(not out.endswith(b"<TIMEOUT>"), "silent connection closed (%r)" % out[:60])
    finally:
        srv.stop()


def test_connection_cap():
    """--max-connections 4. Idle connections (never sent a byte, or idle keep-alive) are closed
    to make room, the longest waiting first; busy ones are not: then a few more connections
    may still send GET /health or /ready (answered, then closed), other requests get 503, and
    past that reserve (16) a new connection gets 503 at once."""
    srv = server("--max-connections", "4")
    try:
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        held = [connect(srv.port) for _ in range(4)]
        for c in held[1:]:  # held[0] never sends a byte; the others are idle keep-alive ones
            c.sendall(health)
            check(read_response(c)[0] == 200, "connection within the cap is served")
        a = connect(srv.port)
        a.sendall(health)
        st, h, b, _ = read_response(a)
        check(st == 200, "at the cap with idle connections: /health served (%s %r)" % (st, b[:100]))
        check(read_all(held[0]) == b"", "the longest idle connection (never sent a byte) was closed for it")
        st, h, b, _ = exchange(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        check(st == 200, "and again: /v1/models served (%s)" % st)
        check(read_all(held[1]) == b"", "the oldest idle keep-alive connection was closed for it")
        for c in held + [a]:
            c.close()

        def busy_conn():  # in the middle of a request (its head read: evhttp sent 100 Continue)
            c = connect(srv.port)
            c.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 15\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got:
                d = c.recv(4096)
                if not d:
                    break
                got += d
            check(got.startswith(b"HTTP/1.1 100"), "a busy connection within the cap (%r)" % got[:60])
            return c
        busy = [busy_conn() for _ in range(4)]  # nothing idle to close now
        for path, want in [(b"/health", 200), (b"/ready", 200), (b"/health?x=1", 200), (b"/v1/models", 503)]:
            s = connect(srv.port)
            s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            st, h, b, rest = read_response(s)
            tail = read_all(s)
            s.close()
            ok = st == want and rest + tail == b"" and (
                want == 200 or (is_error_json(st, h, b, 503, "too_many_connections") and h.get("retry-after") == "1"))
            check(ok, "over the cap, busy connections: GET %s -> %d, then closed (%s %r %r)" % (path.decode(), want, st, b[:80], tail[:40]))
        silent = [connect(srv.port) for _ in range(16)]  # the probe reserve, taken by silent ones
        st, h, b, _ = exchange(srv.port, health)
        check(is_error_json(st, h, b, 503, "too_many_connections") and h.get("retry-after") == "1",
              "past the probe reserve: 503 JSON with Retry-After (%s %r)" % (st, b[:100]))
        for c in silent + busy:
            c.close()

        def served():
            try:
                return exchange(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 200
            except OSError:
                return False
        check(wait_for(served, 20, "freed connection slots"), "slots freed by leaving clients are reused")
    finally:
        srv.stop()


def test_buffered_budget():
    srv = server("--max-buffered-bytes", "1MiB", "--max-body-size", "800KiB")
    try:
        big = b'{"prompt":"' + b"a" * 600000 + b'"}'
        a = connect(srv.port)
        a.sendall(post_head("/tokenize", len(big)) + big[:1000])  # holds 600 kB of the budget
        b_ = connect(srv.port)
        b_.sendall(post_head("/tokenize", len(big)))

        st, h, b, _ = read_response(b_)
        b_.close()
        check(is_error_json(st, h, b, 503, "server_busy"), "request over the buffered-bytes budget: 503 JSON (%s %r)" % (st, b[:100]))
        a.sendall(big[1000:])
        st, h, b, _ = read_response(a)
        a.close()
        check(st == 200 and json.loads(b)["count"] > 1000, "the request holding the budget completes (%s)" % st)
        st, h, b, _ = exchange(srv.port, post_head("/tokenize", len(big), b"Connection: close\r\n") + big)
        check(st == 200, "budget released after the answer: a large request fits again (%s)" % st)
    finally:
        srv.stop()


def test_memory_bound(port, srv):
    rss0 = srv.rss_kb()
    socks = []
    for _ in range(20):
        s = connect(port)
        s.sendall(post_head("/v1/completions", 60 << 20))
        socks.append(s)
    answers = [read_response(s) for s in socks]
    for s in socks:
        s.close()
    check(all(is_error_json(a[0], a[1], a[2], 413) for a in answers), "20 clients declaring 60 MiB: all 413 at once")
    check(srv.rss_kb() - rss0 < 64 * 1024, "RSS grew by %d kB (want < 64 MiB)" % (srv.rss_kb() - rss0))


def test_prep_off_loop():
    """Parsing, rendering and tokenizing run on worker threads (src/http/prep.c): /health is
    answered while a 4 MB /tokenize is still being tokenized (it used to wait for it), and a
    prompt that cannot fit max_model_len is refused before it is tokenized."""
    import select
    srv = server("--max-body-size", "16MiB")
    try:
        text = ("Once upon a time there was a little girl. " * 100000)[:4 << 20]
        body = json.dumps({"prompt": text}).encode()
        big = connect(srv.port, timeout=120)
        big.sendall(post_head("/tokenize", len(body)) + body)

        def unacked():  # bytes the server's kernel has not acknowledged yet (SIOCOUTQ)
            import fcntl
            import struct
            import termios
            return struct.unpack("i", fcntl.ioctl(big.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        wait_for(lambda: unacked() == 0, 30, "the 4 MB body to reach the server")
        st, h, b, _ = exchange(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        pending = not select.select([big], [], [], 0)[0]
        check(st == 200 and pending, "/health answered while a 4 MB /tokenize is in progress (%s, pending %s)" % (st, pending))
        st, h, b, _ = read_response(big)
        big.close()
        check(st == 200 and json.loads(b)["count"] > 100000, "the 4 MB /tokenize completes (%s)" % st)
        body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
        st, h, b, _ = exchange(srv.port, post_head("/v1/completions", len(body)) + body)
        check(is_error_json(st, h, b, 400, "context_length_exceeded") and b"before tokenization" in b,
              "a 4 MB prompt is refused before tokenization (%s %r)" % (st, b[:160]))
        msgs = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
        st, h, b, _ = exchange(srv.port, post_head("/v1/chat/completions", len(msgs)) + msgs)
        # the rendered chat prompt stops at the bound: the message says "more than" it, not a
        # made-up size (tester finding)
        check(is_error_json(st, h, b, 400, "context_length_exceeded") and b"the prompt has more than" in b,
              "a 4 MB chat prompt: 400, more than the bound (%s %r)" % (st, b[:200]))
    finally:
        srv.stop()


def test_router():
    w = server()
    r = Proc(["router", "--workers", "http://127.0.0.1:%d" % w.port, "--max-body-size", "65536"])
    try:
        st, h, b, _ = exchange(r.port, post_head("/v1/completions", 100_000_000))
        check(is_error_json(st, h, b, 413), "router: declared body over the limit: 413 JSON (%s)" % st)
        st, h, b, _ = exchange(r.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00\r\n\r\n")
        check(is_error_json(st, h, b, 400), "router: NUL in a header: 400 JSON (%s)" % st)
        st, h, b, _ = exchange(r.port, post_head("/v1/completions", len(BODY)) + BODY, shut=True)
        check(completion_ok(st, b), "router: half-closed client gets its completion (%s %r)" % (st, b[:100]))
    finally:
        r.stop()
        w.stop()


def main():
    if not os.path.exists(GGUF):
        print("SKIP: test data %s not found (set KVSERVE_TEST_DATA)" % GGUF)
        return 77
    srv = server("--max-body-size", "64KiB")
    try:
        for name, fn in [("framing", lambda: test_framing(srv.port)),
                         ("mutations", lambda: test_mutated_heads(srv.port)),
                         ("half_close_pipelining", lambda: test_half_close_and_pipelining(srv.port)),
                         ("memory", lambda: test_memory_bound(srv.port, srv))]:
            before = len(failures)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - one group's crash must not hide the others
                check(False, "%s raised %r" % (name, e))
            print("%-22s %s" % (name, "ok" if len(failures) == before else "FAILED"), flush=True)
        check(srv.proc.poll() is None, "server alive after the bad inputs")
    finally:
        srv.stop()
    for name, fn in [("end_of_input_in_prep", test_end_of_input_in_prep), ("prep", test_prep_off_loop), ("timeouts", test_timeouts), ("connection_cap", test_connection_cap),
                     ("buffered_budget", test_buffered_budget), ("router", test_router)]:
        before = len(failures)
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            check(False, "%s raised %r" % (name, e))
        print("%-22s %s" % (name, "ok" if len(failures) == before else "FAILED"), flush=True)
    print("%d passed, %d failed" % (check.passed, len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
