#!/usr/bin/env python3
"""HTTP loop stalls under a huge request (issue 13): while a 15 MB /tokenize and a 15 MB
completion are in flight, how long do /health and 4 streaming completions wait? Prints the
largest /health latency and the largest inter-token gap of the streams during the big
requests, and how long each big request took to be answered.

  bench/http_stall.py KVSERVE_BIN MODEL [extra serve args...]
Goal: both maxima under 50 ms (docs/benchmarks.md has the figures, base vs branch)."""
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../tests/e2e"))
from e2e_util import start_kvserve  # noqa: E402

BIG = 15 << 20


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
    """Streams completions back to back until stop; gaps between reads within a stream."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                       "ignore_eos": True}).encode()
    while not stop.is_set():
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
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


def main():
    bin_, model = sys.argv[1], sys.argv[2]
    p, port = serve(bin_, model, sys.argv[3:])
    stop = threading.Event()
    gaps = []
    th = [threading.Thread(target=stream, args=(port, gaps, stop)) for _ in range(4)]
    for t in th:
        t.start()
    time.sleep(1.0)  # streams running (setup, not measured)
    health = []
    big_done = {}

    def big(name, path, body):
        t0 = time.perf_counter()
        request(port, "POST", path, body)
        big_done[name] = (t0, time.perf_counter())

    text = ("Once upon a time there was a little girl. " * (BIG // 43 + 1))[:BIG]
    bigs = [threading.Thread(target=big, args=("tokenize", "/tokenize", json.dumps({"prompt": text}).encode())),
            threading.Thread(target=big, args=("completion", "/v1/completions",
                                               json.dumps({"prompt": text, "max_tokens": 4}).encode()))]
    t_start = time.perf_counter()
    for b in bigs:
        b.start()
    while any(b.is_alive() for b in bigs):
        t0 = time.perf_counter()
        request(port, "GET", "/health")
        health.append(time.perf_counter() - t0)
        time.sleep(0.01)
    t_end = time.perf_counter()
    stop.set()
    for t in th:
        t.join(timeout=5)
    p.terminate()
    p.wait()
    during = sorted(g for (t, g) in gaps if t_start <= t <= t_end)
    health.sort()

    def pct(v, q):
        return v[min(len(v) - 1, int(q * len(v)))] * 1e3 if v else -1

    print("%s: /health p50 %.1f p99 %.1f max %.1f ms (n=%d); stream gaps p50 %.1f p99 %.1f max %.1f ms "
          "(n=%d) during the big requests; tokenize answered in %.2f s, completion in %.2f s" % (
              bin_ + " " + " ".join(sys.argv[3:]),
              pct(health, .5), pct(health, .99), pct(health, 1), len(health),
              pct(during, .5), pct(during, .99), pct(during, 1), len(during),
              big_done["tokenize"][1] - big_done["tokenize"][0],
              big_done["completion"][1] - big_done["completion"][0]))


if __name__ == "__main__":
    main()
