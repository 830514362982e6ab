#!/usr/bin/env python3
"""Where a routed replay loses prefix reuse against one worker (issue 9 instrumentation).

    bench/routing_reuse.py SINGLE.json POLICY.json [POLICY.json ...] [--per-request]

Both files are `kvserve bench --out` results of the same saved trace at temperature 0, so every
request (trace session, turn) has the same prompt in each run (checked: prompt_tokens must agree).
For each request the single worker's cached_tokens is the reference; the routed run's shortfall
(single - routed, in prompt tokens) is put in one class:

  first-turn     turn 0 of a session: the worker it went to had not yet cached the shared
                 prefix (system prompt) the single worker had (one prefill per worker that
                 serves the prefix is the floor of any placement that uses that worker)
  moved          a later turn placed on another worker than the session's previous turn
                 (placement lost the history)
  same-worker    a later turn on the previous turn's worker that still found less cached than
                 the single worker did (eviction on the worker, or a prefill of the previous
                 turn still in flight)
  gain           the routed run found more cached than the single worker (the single worker
                 evicted: its pool is 1/N of the pool's total)

Prints one block per policy file: totals, the cached ratio against the single worker's, the
shortfall by class, and the floor: a prefix shared by every session (the single worker's
cached tokens on first turns, their median) must be prefilled once on each worker that serves
any session, so a placement using W workers loses at least (W - 1) x that prefix against one
worker; "of the achievable" is the cached tokens over single - floor. --per-request lists every
request with a shortfall.
"""
import json
import sys


def load(path):
    d = json.load(open(path))
    by = {}
    for r in d["requests"]:
        by[(r["trace_session"], r["turn"])] = r
    return d, by


def main(argv):
    per_request = "--per-request" in argv
    files = [a for a in argv if not a.startswith("--")]
    if len(files) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    _, single = load(files[0])
    firsts = sorted(r["cached_tokens"] or 0 for k, r in single.items() if k[1] == 0 and not r["error"])
    shared = firsts[len(firsts) // 2] if firsts else 0  # the median first turn's cached prefix
    for path in files[1:]:
        d, run = load(path)
        tot_p = tot_c = tot_s = 0
        cls = {"first-turn": [0, 0], "moved": [0, 0], "same-worker": [0, 0], "gain": [0, 0]}
        mismatch = errors = 0
        rows = []
        for key in sorted(run):
            r = run[key]
            s = single.get(key)
            if r["error"] or s is None or s["error"]:
                errors += 1
                continue
            if r["prompt_tokens"] != s["prompt_tokens"]:
                mismatch += 1
            rc, sc = r["cached_tokens"] or 0, s["cached_tokens"] or 0
            tot_p += r["prompt_tokens"] or 0
            tot_c += rc
            tot_s += sc
            short = sc - rc
            if short == 0:
                continue
            prev = run.get((key[0], key[1] - 1))
            if short < 0:
                c = "gain"
            elif key[1] == 0:
                c = "first-turn"
            elif prev and prev["worker"] != r["worker"]:
                c = "moved"
            else:
                c = "same-worker"
            cls[c][0] += 1
            cls[c][1] += short
            rows.append((key, r["worker"], prev["worker"] if prev else None, r["prompt_tokens"], sc, rc, c))
        workers = sorted({r["worker"] for r in run.values() if r["worker"]})
        print("%s: %d requests, %d prompt tokens; cached %d (ratio %.4f) vs single %d (%.4f): %.2f%% of single"
              % (path, len(run), tot_p, tot_c, tot_c / max(tot_p, 1), tot_s, tot_s / max(tot_p, 1),
                 100.0 * tot_c / max(tot_s, 1)))
        if mismatch or errors:
            print("  WARNING: %d prompts differ from the single run's, %d requests failed or missing"
                  % (mismatch, errors))
        for c, (n, t) in cls.items():
            print("  %-12s %4d requests  %7d tokens  (%.2f%% of single's cached)" % (c, n, t, 100.0 * t / max(tot_s, 1)))
        floor = max(len(workers) - 1, 0) * shared
        print("  workers used %d; floor %d tokens ((%d - 1) x a shared prefix of %d); of the achievable %.2f%%"
              % (len(workers), floor, len(workers), shared, 100.0 * tot_c / max(tot_s - floor, 1)))
        if per_request:
            for key, w, pw, p, sc, rc, c in rows:
                print("    session %d turn %d: %s (prev %s) prompt %d cached single %d here %d: %s"
                      % (key[0], key[1], w, pw, p, sc, rc, c))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
