#!/usr/bin/env python3
"""A pathological constraint next to an unconstrained stream (issue 13, tester finding F2):
how much does one hostile structured-output request (n = 8) slow a concurrent stream?

One unconstrained stream runs back to back the whole time (http_stall.stream: one SSE event,
one token, per read); the gaps between its reads are taken
(1) alone, (2) while unconstrained n = 8 requests run one after another (the control: the
batch grows the same way), then (3) while hostile requests are sent one after another (each:
n = 8, max_tokens 32, one guided_regex / guided_grammar from HOSTILE below), a third of
--seconds each. Prints the stream's gap
p50 / p99 / max in both phases and what the hostile requests got (status, seconds).

  bench/grammar_stall.py KVSERVE_BIN MODEL [--seconds S] [--regex RE]... [extra serve args...]

(--regex replaces the built-in list.)

docs/benchmarks.md has the figures (base vs branch, same run)."""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../tests/e2e"))
from e2e_util import start_kvserve  # noqa: E402
from http_stall import request, stream  # noqa: E402  (stream: unconstrained, back to back; gaps between reads)

HOSTILE = [
    {"guided_regex": "(.*){10000}"},
    {"guided_regex": "((((.*)*)*)*)*x"},
    {"guided_regex": "(.*a){1000}"},
    {"guided_regex": "(.*.*.*)*x"},
    {"guided_grammar": "root ::= ((\"a\" | [^a]*)*)* \"x\""},
]


def post(port, body):
    """POST /v1/completions; returns (status, seconds, response bytes)."""
    t0 = time.perf_counter()
    out = request(port, "POST", "/v1/completions", json.dumps(body).encode())
    status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/") else 0
    return status, time.perf_counter() - t0, out


def pct(v, q):
    return v[min(len(v) - 1, int(q * len(v)))] * 1e3 if v else -1


def main():
    bin_, model = sys.argv[1], sys.argv[2]
    extra = sys.argv[3:]
    secs = 20.0
    hostile = HOSTILE
    while extra[:1] in (["--seconds"], ["--regex"]):
        if extra[0] == "--seconds":
            secs = float(extra[1])
        else:
            hostile = (hostile if hostile is not HOSTILE else []) + [{"guided_regex": extra[1]}]
        extra = extra[2:]
    p, port = start_kvserve(bin_, ["serve", "--model", model, "--max-model-len", "512", *extra])
    try:
        post(port, {"prompt": "warm", "max_tokens": 2, "guided_regex": "[a-z]+"})  # builds the vocab trie
        stop = threading.Event()
        gaps = []
        th = threading.Thread(target=stream, args=(port, gaps, stop))
        th.start()
        time.sleep(1.0)  # the stream is running (not measured)
        t_alone = time.perf_counter()
        time.sleep(secs / 3)
        # control: the same requests without a constraint (the batch grows the same way)
        t_control = time.perf_counter()
        i = 0
        while time.perf_counter() - t_control < secs / 3:
            post(port, {"prompt": "Once upon a time", "max_tokens": 32, "n": 8, "temperature": 1.0, "seed": i})
            i += 1
        t_hostile = time.perf_counter()
        results = []
        i = 0
        while time.perf_counter() - t_hostile < secs / 3:
            h = dict(hostile[i % len(hostile)], prompt="Once upon a time", max_tokens=32, n=8,
                     temperature=1.0, seed=i)
            st, dt, out = post(port, h)
            msg = ""
            if st != 200:
                try:
                    msg = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["message"][:70]
                except Exception:  # noqa: BLE001
                    msg = out[-70:].decode(errors="replace")
            results.append((list(h.values())[0], st, dt, msg))
            i += 1
        t_end = time.perf_counter()
        stop.set()
        th.join(timeout=30)
    finally:
        p.terminate()
        p.wait()
    alone = sorted(g for (t, g) in gaps if t_alone <= t < t_control)
    control = sorted(g for (t, g) in gaps if t_control <= t < t_hostile)
    during = sorted(g for (t, g) in gaps if t_hostile <= t <= t_end)
    print("%s" % (bin_ + " " + " ".join(extra)))
    print("  stream alone:           gap p50 %.1f p99 %.1f max %.1f ms (n=%d)" % (
        pct(alone, .5), pct(alone, .99), pct(alone, 1), len(alone)))
    print("  with unconstrained n=8: gap p50 %.1f p99 %.1f max %.1f ms (n=%d)" % (
        pct(control, .5), pct(control, .99), pct(control, 1), len(control)))
    print("  with hostile requests:  gap p50 %.1f p99 %.1f max %.1f ms (n=%d)" % (
        pct(during, .5), pct(during, .99), pct(during, 1), len(during)))
    seen = {}
    for src, st, dt, msg in results:
        k = (src, st)
        c, tot, mx, m = seen.get(k, (0, 0.0, 0.0, msg))
        seen[k] = (c + 1, tot + dt, max(mx, dt), m)
    for (src, st), (c, tot, mx, m) in seen.items():
        print("  hostile %-34s -> %d x%d, %.2f s mean, %.2f s max %s" % (src, st, c, tot / c, mx,
                                                                        ("(" + m + ")") if m else ""))


if __name__ == "__main__":
    main()
