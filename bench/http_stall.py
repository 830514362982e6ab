#!/usr/bin/env python3
"""HTTP loop stalls under a huge request (issue 13): while a 15 MB /tokenize and a 15 MB
completion are in flight, how long do /health and 4 streaming completions wait? Prints the
largest /health latency and the largest inter-token gap of the streams during the big
requests, and how long each big request took to be answered.

  bench/http_stall.py KVSERVE_BIN MODEL [--runs N] [--in-process] [extra serve args...]

Goal: both maxima under 50 ms (docs/benchmarks.md has the figures, base vs branch).

The measuring side runs in processes of its own (since 2026-12-02; before, every part was a
thread of one Python process): one process reads the 4 streams (one thread, a selector loop),
another probes /health every 10 ms; the main process only builds and sends the two 15 MB bodies
and reads their answers. So the GIL held by the senders (json.dumps of 15 MB, 20 MB answers)
no longer delays the readers. Timestamps are taken in the reader process right after each
socket read (time.monotonic_ns, one clock for all processes).

Telling the client's stalls from the server's (lines 2-4 of each run):
  - arrival times: every measuring socket has SO_TIMESTAMPNS, so each read also gives the
    kernel's arrival time of the newest bytes it returned (on loopback: the server's write
    plus the kernel's delivery; none of the client's time). A stream's "arrival gap" is that
    time minus the previous read's: for a read that holds one SSE event it is exactly the gap
    between the server's two writes, whatever the client did meanwhile. (The kernel merges
    queued segments and keeps the newest time, so for a read of several events it is only an
    upper bound.) /health "at the socket": sent -> the answer's last bytes arrived.
  - reader stalls: the reader's selector loop also has a 2 ms timer; how late it fires is
    how long the reader thread could not run (descheduled, or waiting for the GIL in
    --in-process mode). The /health prober's 10 ms pause is timed the same way.
  - a stream gap's server part: its arrival gap when the read held one event; otherwise the
    gap minus the reader's stall inside it (while the reader could run, no byte came), at most
    the arrival gap. The client part is the rest. "largest stream gap" splits the worst gap.
  The server has no loop-lag metric of its own (src/http/metrics.c has none), so these
  arrival times are the server-side view.

--runs N repeats the whole measurement (a fresh server each time) and ends with the maxima
of every run. --in-process runs the same readers and prober as threads of the sending process
(the old layout) for comparison. Leading options only; the rest goes to `kvserve serve`."""
import bisect
import json
import multiprocessing as mp
import os
import queue
import select
import selectors
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../tests/e2e"))
from e2e_util import start_kvserve  # noqa: E402

BIG = 15 << 20
N_STREAMS = 4
TICK_NS = 2_000_000          # the reader loop's own timer (client-stall probe)
HEALTH_PAUSE_NS = 10_000_000  # between /health probes
# Linux: kernel receive timestamps (struct timespec, CLOCK_REALTIME) as ancillary data
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
ANC = socket.CMSG_SPACE(16)
STREAM_BODY = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                          "ignore_eos": True}).encode()


def serve(bin_, model, extra):
    return start_kvserve(bin_, ["serve", "--model", model, "--max-model-len", "512",
                                "--max-body-size", "32MiB", *extra])


def request(port, method, path, body=None):
    s = socket.create_connection(("127.0.0.1", port))
    data = b"" if body is None else body
    s.sendall(b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % (
        method.encode(), path.encode(), len(data)) + data)
    out = []  # joined once: `out += b` over a 20 MB answer copies quadratically with the GIL
    while True:  # held, which delayed the stream and /health threads (inflated their figures)
        b = s.recv(1 << 20)
        if not b:
            break
        out.append(b)
    s.close()
    return b"".join(out)


def stream(port, gaps, stop):
    """Streams completions back to back until stop; gaps between reads within a stream.
    (A thread of the caller's process: bench/grammar_stall.py uses it.)"""
    while not stop.is_set():
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(STREAM_BODY) + STREAM_BODY)
        last = None
        while not stop.is_set():
            b = s.recv(1 << 16)
            if not b:
                break
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            last = now
        s.close()


# ------------------------------------------------------------------ the measuring side

def _kernel_ns(anc):
    """The kernel's arrival time (ns, CLOCK_REALTIME) of a read's newest bytes, or None."""
    for lvl, typ, d in anc:
        if lvl == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS and len(d) >= 16:
            sec, nsec = struct.unpack("qq", d[:16])
            return sec * 1_000_000_000 + nsec
    return None


def _connect(port, head, body=b""):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(head + body)
    return s


def _open_stream(port):
    return _connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(STREAM_BODY), STREAM_BODY)


def readers(port, n, stop_fd, out):
    """N_STREAMS streaming completions back to back in one thread (a selector loop) until
    stop_fd is readable. Puts ("streams", reads, stalls) on out:
      reads:  (t_ns, gap_ns, arrival_gap_ns, n_events) per read after a stream's first
              (t_ns: monotonic right after the read; arrival_gap_ns -1 when unknown)
      stalls: (t_ns, late_ns) per wakeup of the loop's own timer that came more than 1 ms
              late (t_ns: monotonic when the loop woke; late_ns: how late; the thread could
              not run from t_ns - late_ns to t_ns)."""
    sel = selectors.DefaultSelector()
    sel.register(stop_fd, selectors.EVENT_READ, None)
    for _ in range(n):
        sel.register(_open_stream(port), selectors.EVENT_READ, [None, None])  # last t, last arrival
    reads, stalls = [], []
    mono = time.monotonic_ns
    deadline = mono() + TICK_NS
    running = True
    while running:
        timeout = max(0, deadline - mono()) / 1e9
        ready = sel.select(timeout)
        woke = mono()
        for key, _ in ready:
            if key.data is None:
                running = False
                break
            s = key.fileobj
            try:
                data, anc, _, _ = s.recvmsg(1 << 16, ANC)
            except BlockingIOError:
                continue
            except OSError:
                data, anc = b"", []
            t = mono()
            if not data:  # the stream ended: the next one starts at once
                sel.unregister(s)
                s.close()
                sel.register(_open_stream(port), selectors.EVENT_READ, [None, None])
                continue
            k = _kernel_ns(anc)
            last_t, last_k = key.data
            if last_t is not None:
                reads.append((t, t - last_t, k - last_k if k is not None and last_k is not None else -1,
                              data.count(b"data: ")))
            key.data[0], key.data[1] = t, k
        if woke >= deadline:
            if woke - deadline > TICK_NS // 2:
                stalls.append((woke, woke - deadline))
            deadline = woke + TICK_NS
    for key in list(sel.get_map().values()):
        if key.data is not None:
            key.fileobj.close()
    out.put(("streams", reads, stalls))


def prober(port, stop_fd, out):
    """GET /health, a 10 ms pause, again, until stop_fd is readable. Puts ("health", probes,
    stalls) on out: probes (t0_ns, latency_ns, arrival_ns): t0 monotonic at the start,
    latency to the end of the answer as read, arrival = the kernel's arrival time of the
    answer's last bytes minus the send time (-1 unknown); stalls (t_ns, late_ns): how late
    the pause ended, when late."""
    probes, stalls = [], []
    mono, real = time.monotonic_ns, time.time_ns
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    while True:
        t0, r0 = mono(), real()
        s = _connect(port, head)
        k = None
        while True:
            data, anc, _, _ = s.recvmsg(1 << 16, ANC)
            if not data:
                break
            k = _kernel_ns(anc) or k
        t1 = mono()
        s.close()
        probes.append((t0, t1 - t0, k - r0 if k is not None else -1))
        r, _, _ = select.select([stop_fd], [], [], HEALTH_PAUSE_NS / 1e9)
        if r:
            break
        late = mono() - (t1 + HEALTH_PAUSE_NS)
        if late > TICK_NS // 2:
            stalls.append((t1 + HEALTH_PAUSE_NS, late))
    out.put(("health", probes, stalls))


# ------------------------------------------------------------------ one run

def pct(v, q):
    """v sorted, in ns -> ms at quantile q (-1 when empty)."""
    return v[min(len(v) - 1, int(q * len(v)))] / 1e6 if v else -1


def run(bin_, model, extra, in_process):
    """One measurement with a fresh server; prints it, returns its maxima (ms)."""
    p, port = serve(bin_, model, extra)
    try:
        stop_r, stop_w = os.pipe()
        if in_process:
            out = queue.Queue()
            workers = [threading.Thread(target=readers, args=(port, N_STREAMS, stop_r, out), daemon=True),
                       threading.Thread(target=prober, args=(port, stop_r, out), daemon=True)]
        else:  # forked before this process starts any thread
            ctx = mp.get_context("fork")
            out = ctx.Queue()
            workers = [ctx.Process(target=readers, args=(port, N_STREAMS, stop_r, out), daemon=True),
                       ctx.Process(target=prober, args=(port, stop_r, out), daemon=True)]
        for w in workers:
            w.start()
        time.sleep(1.0)  # streams running (setup, not measured)
        big_done = {}

        def big(name, path, body):
            t0 = time.perf_counter()
            request(port, "POST", path, body)
            big_done[name] = time.perf_counter() - t0

        text = ("Once upon a time there was a little girl. " * (BIG // 43 + 1))[:BIG]
        bigs = [threading.Thread(target=big, args=("tokenize", "/tokenize", json.dumps({"prompt": text}).encode())),
                threading.Thread(target=big, args=("completion", "/v1/completions",
                                                   json.dumps({"prompt": text, "max_tokens": 4}).encode()))]
        del text
        t_start = time.monotonic_ns()
        for b in bigs:
            b.start()
        for b in bigs:
            b.join()
        t_end = time.monotonic_ns()
        os.write(stop_w, b"x")
        got = dict((r[0], r[1:]) for r in (out.get(timeout=60) for _ in workers))
        for w in workers:
            w.join(timeout=10)
        os.close(stop_r)
        os.close(stop_w)
    finally:
        p.terminate()
        p.wait()

    reads, r_stalls = got["streams"]
    probes, h_stalls = got["health"]

    def inside(t):
        return t_start <= t <= t_end

    during = [r for r in reads if inside(r[0])]
    gaps = sorted(r[1] for r in during)
    arr1 = sorted(r[2] for r in during if r[2] >= 0 and r[3] == 1)  # one event: exact
    arr = sorted(r[2] for r in during if r[2] >= 0)
    health = sorted(h[1] for h in probes if inside(h[0]))
    h_arr = sorted(h[2] for h in probes if inside(h[0]) and h[2] >= 0)
    rs = [s for s in r_stalls if inside(s[0])]
    hs = [s for s in h_stalls if inside(s[0])]

    ends = [t for (t, _) in r_stalls]  # in time order

    def stall_in(t0, t1):  # the longest part of (t0, t1] the reader could not run
        best = 0
        for i in range(bisect.bisect_right(ends, t0), len(ends)):
            t, late = r_stalls[i]
            if t - late >= t1:
                break
            best = max(best, min(t, t1) - max(t - late, t0))
        return best

    def server_gap(g, a, ne, stall):
        """The server's part of a stream gap g: the arrival gap a when the read held one event
        (exact); else g minus the reader's stall (while the reader could run, no byte came),
        at most a (an upper bound when the read held several events)."""
        if a >= 0 and ne == 1:
            return min(a, g)  # (g < a: the client was later on the previous read than on this)
        lb = max(0, g - stall)
        return min(lb, a) if a >= 0 else lb

    parts = []  # (gap, the server's part, the reader's stall inside it, arrival gap, events, t)
    for (t, g, a, ne) in during:
        st = min(g, stall_in(t - g, t))
        parts.append((g, server_gap(g, a, ne, st), st, a, ne, t))
    server = sorted(p[1] for p in parts)
    worst = max(parts, default=None)
    label = bin_ + " " + " ".join(extra) + (" [in-process client]" if in_process else "")
    r_max = max((s[1] for s in rs), default=0)
    print("%s: /health p50 %.1f p99 %.1f max %.1f ms (n=%d); stream gaps p50 %.1f p99 %.1f max %.1f ms "
          "(n=%d) during the big requests; tokenize answered in %.2f s, completion in %.2f s" % (
              label, pct(health, .5), pct(health, .99), pct(health, 1), len(health),
              pct(gaps, .5), pct(gaps, .99), pct(gaps, 1), len(gaps),
              big_done["tokenize"], big_done["completion"]))
    print("  server side (kernel arrival times at the client's sockets): /health sent -> answer "
          "arrived p99 %.1f max %.1f ms; stream gaps' server part p99 %.1f max %.1f ms (arrival "
          "gaps of single-event reads, exact: max %.1f ms, n=%d of %d)" % (
              pct(h_arr, .99), pct(h_arr, 1), pct(server, .99), pct(server, 1), pct(arr1, 1),
              len(arr1), len(during)))
    print("  client side: reader loop stalls (its 2 ms timer late by > 1 ms) n=%d max %.1f ms; "
          "/health prober's pause late n=%d max %.1f ms" % (
              len(rs), r_max / 1e6, len(hs), max((s[1] for s in hs), default=0) / 1e6))
    if worst:
        g, sv, st, a, ne, t = worst
        print("  largest stream gap %.1f ms at +%.2f s: server part %.1f ms, client part %.1f ms "
              "(arrival gap %s, %d event(s) in the read; the reader stalled %.1f ms of it)" % (
                  g / 1e6, (t - t_start) / 1e9, sv / 1e6, (g - sv) / 1e6,
                  "%.1f ms" % (a / 1e6) if a >= 0 else "unknown", ne, st / 1e6))
    sys.stdout.flush()
    return {"health": pct(health, 1), "gap": pct(gaps, 1), "server": pct(server, 1),
            "health_arrival": pct(h_arr, 1), "reader_stall": r_max / 1e6}


def main():
    if len(sys.argv) < 3 or sys.argv[1].startswith("-") or sys.argv[2].startswith("-"):
        sys.exit("usage: bench/http_stall.py KVSERVE_BIN MODEL [--runs N] [--in-process] [extra serve args...]")
    bin_, model = sys.argv[1], sys.argv[2]
    extra = sys.argv[3:]
    runs, in_process = 1, False
    while extra[:1] in (["--runs"], ["--in-process"]):
        if extra[0] == "--runs":
            if len(extra) < 2 or not extra[1].isdigit() or int(extra[1]) < 1:
                sys.exit("http_stall.py: --runs needs a positive integer")
            runs = int(extra[1])
            extra = extra[2:]
        else:
            in_process = True
            extra = extra[1:]
    late = [a for a in extra if a in ("--runs", "--in-process")]
    if late:
        sys.exit("http_stall.py: %s must come before the serve arguments" % late[0])
    res = [run(bin_, model, extra, in_process) for _ in range(runs)]
    if runs > 1:
        def col(k):
            return ", ".join("%.1f" % r[k] for r in res)
        print("%d runs, maxima (ms): /health %s; stream gaps %s; server side: /health %s, stream "
              "gaps %s; reader stalls %s" % (
                  runs, col("health"), col("gap"), col("health_arrival"), col("server"),
                  col("reader_stall")))


if __name__ == "__main__":
    main()
