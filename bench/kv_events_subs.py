#!/usr/bin/env python3
"""Cost of /kv_events subscribers that do not read (issue 13): wall time of 10 sequential
completions (200-token prompts, 8 tokens) on stories260K with 0 and with N stalled streams.

  bench/kv_events_subs.py KVSERVE_BIN MODEL [N] [extra serve args...]
Prints one line per case; quote the ratio (stalled / none) measured in the same run."""
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../tests/e2e"))
from e2e_util import start_kvserve  # noqa: E402


def serve(bin_, model, extra):
    return start_kvserve(bin_, ["serve", "--model", model, "--max-model-len", "512", "--threads", "1",
                                *extra])


def post(port, body):
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    out = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        out += b
    s.close()
    return out


def run(bin_, model, n_subs, extra):
    p, port = serve(bin_, model, extra)
    subs = []
    for _ in range(n_subs):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /kv_events?after=0 HTTP/1.1\r\nHost: x\r\n\r\n")
        subs.append(s)
    time.sleep(0.5)  # let the server accept them (setup, not measured)
    t0 = time.time()
    for k in range(10):
        post(port, {"prompt": [1] + [3 + (k * 37 + j * 11) % 500 for j in range(200)], "max_tokens": 8,
                    "temperature": 0})
    dt = time.time() - t0
    for s in subs:
        s.close()
    p.terminate()
    p.wait()
    return dt


def main():
    bin_, model = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    extra = sys.argv[4:]
    a = run(bin_, model, 0, extra)
    b = run(bin_, model, n, extra)
    print("10 completions: %.2f s alone, %.2f s with %d stalled /kv_events streams (ratio %.2f)" % (a, b, n, b / a))


if __name__ == "__main__":
    main()
