#!/usr/bin/env python3
"""ASan soak (issue 13; not in CI): a sanitizer build of `kvserve serve` on stories260K under
64 concurrent clients for a fixed time. Each client loops over: streaming and non-streaming
completions and chats (some dropped mid-stream, some half-closed), /tokenize, a bad input,
/health and /metrics. At the end: every request answered or deliberately dropped, no 5xx other
than 503 (limits), KV blocks all free, RSS growth printed, and the server exits 0 on SIGTERM
(ASan/LSan reports make it exit non-zero).

  tests/soak/soak.py [--bin build-asan/kvserve] [--minutes 10] [--streams 64]
Results go to docs/testing.md (last run)."""
import argparse
import http.client
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "../e2e"))
from e2e_util import start_kvserve, wait_for  # noqa: E402

DATA = os.environ.get("KVSERVE_TEST_DATA", os.path.join(here, "../../../shared/data"))
GGUF = os.path.join(DATA, "models/stories260K/stories260K.gguf")
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a bird", "Tom and Sue"]


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(f.read().split("VmRSS:")[1].split()[0])


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k.split("{", 1)[0]] = float(v)  # the name without its labels
    c.close()
    return out


def client(port, end, rng, stats, lock):
    while time.time() < end:
        kind = rng.random()
        prompt = rng.choice(PROMPTS) + " %d" % rng.randrange(1000)
        try:
            if kind < 0.35:  # streaming completion, maybe dropped
                body = json.dumps({"prompt": prompt, "max_tokens": rng.randint(8, 120), "stream": True,
                                   "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(99)}).encode()
                s = socket.create_connection(("127.0.0.1", port), timeout=120)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)  # read until the close
                want = rng.choice([0, 200, 2000, 10 ** 9])
                got = b""
                while len(got) < want:
                    b = s.recv(4096)
                    if not b:
                        break
                    got += b
                s.close()
                key = "stream_dropped" if want < 10 ** 9 else "stream"
            elif kind < 0.55:  # chat, non-stream, sometimes half-closed
                body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 16}).encode()
                s = socket.create_connection(("127.0.0.1", port), timeout=120)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
                if rng.random() < 0.3:
                    s.shutdown(socket.SHUT_WR)
                got = b""
                while True:
                    b = s.recv(65536)
                    if not b:
                        break
                    got += b
                s.close()
                while got.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in got:  # interim 100 Continue
                    got = got.split(b"\r\n\r\n", 1)[1]                      # (half-closed: docs/api.md)
                st = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0
                key = "chat_%d" % st
            elif kind < 0.7:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("POST", "/tokenize", json.dumps({"prompt": prompt * rng.randint(1, 200)}))
                key = "tokenize_%d" % c.getresponse().status
                c.close()
            elif kind < 0.85:  # bad inputs
                bad = rng.choice([b'{"prompt":', b'{"prompt":"x","max_tokens":-5}', b'{"messages":7}',
                                  b'{"prompt":"x","temperature":"hot"}', b"\xff\xfe"])
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("POST", rng.choice(["/v1/completions", "/v1/chat/completions"]), bad)
                key = "bad_%d" % c.getresponse().status
                c.close()
            else:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("GET", rng.choice(["/health", "/metrics", "/v1/models", "/server_info"]))
                key = "get_%d" % c.getresponse().status
                c.close()
        except OSError as e:
            key = "oserror_" + type(e).__name__
        with lock:
            stats[key] = stats.get(key, 0) + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(here, "../../build-asan/kvserve"))
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--streams", type=int, default=64)
    a = ap.parse_args()
    if not os.path.exists(GGUF):
        print("SKIP: %s not found" % GGUF)
        return 77
    d = tempfile.mkdtemp(prefix="kvserve-soak-")
    log = open(os.path.join(d, "server.log"), "w")
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1", UBSAN_OPTIONS="print_stacktrace=1")
    p, port = start_kvserve(a.bin, ["serve", "--model", GGUF, "--max-model-len", "512",
                                    "--kv-cache-memory", "64MiB"], log=log, env=env)
    rss0 = rss_kb(p.pid)
    end = time.time() + a.minutes * 60
    stats, lock = {}, threading.Lock()
    th = [threading.Thread(target=client, args=(port, end, random.Random(i), stats, lock)) for i in range(a.streams)]
    t0 = time.time()
    for t in th:
        t.start()
    peak = rss0
    while any(t.is_alive() for t in th):
        time.sleep(5)
        peak = max(peak, rss_kb(p.pid))
        print("  %.0fs rss %d MB, %d requests" % (time.time() - t0, rss_kb(p.pid) >> 10, sum(stats.values())), flush=True)
    for t in th:
        t.join()
    wait_for(lambda: metrics(port)["kvserve_kv_blocks_used"] == 0, 120, "KV blocks to be freed")
    m = metrics(port)
    rss1 = rss_kb(p.pid)
    p.terminate()
    rc = p.wait(timeout=120)
    fails = []
    if rc != 0:
        fails.append("server exit status %s (see %s/server.log)" % (rc, d))
    bad5 = {k: v for k, v in stats.items() if k.split("_")[-1].startswith("5") and not k.endswith("503")}
    if bad5:
        fails.append("5xx answers: %s" % bad5)
    print("soak: %d streams, %.1f min, %d requests: %s" % (a.streams, (time.time() - t0) / 60,
                                                            sum(stats.values()), json.dumps(stats, sort_keys=True)))
    print("soak: rss %d MB at start, %d MB peak, %d MB at the end; kv_blocks_used %d; requests cancelled %d; exit %s"
          % (rss0 >> 10, peak >> 10, rss1 >> 10, m["kvserve_kv_blocks_used"],
             m.get("kvserve_requests_cancelled_total", -1), rc))
    for f in fails:
        print("FAIL:", f)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
