#!/usr/bin/env python3
"""Batch invariance end to end (issue 10, serve --deterministic), for a GPU machine.

    det_serve.py KVSERVE MODEL [extra serve args...]

Starts `KVSERVE serve --model MODEL --port 0 --port-file F [extra...]`, sends 16 greedy
completions (temperature 0, 48 tokens, different prompts) one at a time, then the same 16 at
once from 16 threads, and compares the texts. Prints one line per differing prompt and a
summary; exit 0 when every concurrent answer equals the one given alone, 1 otherwise, 2 when
the server did not come up. Used by scripts/gpu-test.sh (DET_E2E=1) with --backend cuda
--deterministic (must pass) and without --deterministic (reported only).
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

PROMPTS = [
    "Once upon a time", "The little dog", "Lily wanted to", "One day, a boy named Tom",
    "The sun was", "In the park there was", "Mom said", "The big red ball",
    "Sam and Anna", "It was a rainy day", "The cat saw a bird", "Tim had a toy car",
    "Under the tree,", "The girl found a", "They went to the beach", "At night the moon",
]


def complete(port, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 48, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    kvserve, model, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    pf = tempfile.mktemp()
    log = open(tempfile.mktemp(suffix=".log"), "w+")
    srv = subprocess.Popen([kvserve, "serve", "--model", model, "--port", "0", "--port-file", pf] + extra,
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while not (os.path.exists(pf) and os.path.getsize(pf) > 0):
            if srv.poll() is not None or time.time() > deadline:
                log.seek(0)
                print("det_serve: server did not start:\n" + log.read()[-2000:], file=sys.stderr)
                return 2
            time.sleep(0.05)
        port = int(open(pf).read().strip())
        alone = [complete(port, p) for p in PROMPTS]
        together = [None] * len(PROMPTS)
        start = threading.Barrier(len(PROMPTS))

        def worker(i):
            start.wait()
            together[i] = complete(port, PROMPTS[i])

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        bad = 0
        for i, p in enumerate(PROMPTS):
            if alone[i] != together[i]:
                bad += 1
                print(f"  differs: {p!r}: alone {alone[i]!r} / concurrent {together[i]!r}")
        log.seek(0)
        mode = [l.strip() for l in log if "cuda backend:" in l and "weights" in l]
        print(f"det_serve ({' '.join(extra)}): {len(PROMPTS) - bad}/{len(PROMPTS)} concurrent greedy "
              f"completions == alone" + (f"; {mode[0]}" if mode else ""))
        return 1 if bad else 0
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            srv.kill()
        try:
            os.unlink(pf)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
