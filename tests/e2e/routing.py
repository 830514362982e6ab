#!/usr/bin/env python3
"""e2e tests of `kvserve router` placement over real workers (issue 9 acceptance, docs/routing.md).

Usage: routing.py [all|sticky|content|burst|health|refuse|coordinator|hashes|replicas|policies|etcd] (env KVSERVE_BIN,
KVSERVE_TEST_DATA). Four `kvserve serve` workers on stories260K (--tokens-per-block 4, one
shared --hash-key-file, 1 thread each) serve every case; each case starts its own router.
Prompts are token ids (exact block arithmetic) unless a case says otherwise. Waits are bounded
polls, never fixed sleeps.
  sticky       50 conversations x 4 turns: turns 2-4 land on the first turn's worker and report
               the previous prompt's full blocks as cached (id as a body field or X-Conversation-Id)
  content      a new conversation id extending an earlier one by >= 32 blocks lands on its worker;
               200 conversations sharing a long system prompt spread within 25% of the mean;
               text prompts hashed through the router's --tokenizer place the same way
  burst        kv_aware: 32 requests sharing a cold 256-token prefix sent at once: the workers'
               prefilled tokens total about prefix + 32 x suffix (in-flight predictions); then
               200 requests sharing a system prompt, 8 at a time, spread within 25% of the mean
               (BUG-14 at low concurrency), the prompt prefilled about once per worker
  health       a killed worker stops receiving requests, its conversations move, no request
               fails; a stopped (SIGSTOP) worker's stalled request fails within a second of
               the health verdict; it comes back after SIGCONT
  refuse       kv_aware refuses a worker with another tokens-per-block or hash key, with a
               clear error (BUG-13)
  hashes       kv_aware's prediction from its mirror equals the worker's reported cached tokens
               for a text prompt, a salted one and a chat prompt (same ids, same block hashes)
  replicas     two routers placing through a third (--coordinator): conversations stay on their
               worker across replicas, every reservation is finished, local placement without it
  coordinator  POST /select + /finish: content required, no reservation, retry with the
               content key, exclusion of the pinned server
  policies     round_robin / least_loaded (requests, tokens) spread; X-Kvserve-Worker and the
               router's per-worker metrics
  etcd         (a throwaway etcd on loopback; skipped when etcd is missing) workers registered with
               `serve --etcd` join the router's pool, a clean stop deregisters at once, a killed
               worker leaves when its lease expires; conversations move, no request fails
"""
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_util import parse_metrics, read_port, wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("KVSERVE_BIN", os.path.join(HERE, "../../build/kvserve"))
DATA = os.environ.get("KVSERVE_TEST_DATA", os.path.join(HERE, "../../../shared/data"))
GGUF = os.path.join(DATA, "models/stories260K/stories260K.gguf")
TMP = tempfile.mkdtemp(prefix="kvserve-routing-")
KEY = os.path.join(TMP, "hash.key")
T = 4  # tokens per block of the workers
PROCS = []
FAILS = []
SKIPS = []


def call(port, method, path, body=None, headers=None, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request(method, path, json.dumps(body) if body is not None else None, h)
    r = c.getresponse()
    data = r.read()
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    try:
        data = json.loads(data)
    except ValueError:
        data = data.decode(errors="replace")
    return r.status, data, hd


def metrics(port):
    st, text, _ = call(port, "GET", "/metrics")
    return parse_metrics(text)


class Worker:
    def __init__(self, name, extra=()):
        self.name = name
        pf = os.path.join(TMP, name + ".port")
        self.log = open(os.path.join(TMP, name + ".log"), "w")
        self.p = subprocess.Popen([BIN, "serve", "--model", GGUF, "--port", "0", "--port-file", pf,
                                   "--max-model-len", "512", "--threads", "1", "--tokens-per-block",
                                   str(T), "--hash-key-file", KEY, *extra],
                                  stdout=self.log, stderr=subprocess.STDOUT)
        PROCS.append(self.p)
        self.port = read_port(pf, self.p, 60.0)
        self.url = "http://127.0.0.1:%d" % self.port

    def prefilled(self):
        st, text, _ = call(self.port, "GET", "/metrics")
        for line in text.splitlines():
            if line.startswith("kvserve_prefill_tokens_computed_total"):
                return float(line.split()[-1])
        raise AssertionError("no kvserve_prefill_tokens_computed_total in the worker's metrics")


class Router:
    def __init__(self, workers, args=()):
        # Cases that do not test health checks get a 5 s period (and timeout): on a loaded 2-core
        # CI machine two /health answers slower than the default 1 s took a worker out of the
        # pool and moved a sticky repeat (seen 4 times in 25 loaded runs of case_same_hashes).
        if "--health-interval" not in args:
            args = [*args, "--health-interval", "5"]
        self.pf = os.path.join(TMP, "router%d.port" % time.time_ns())
        self.log = open(os.path.join(TMP, "router.log"), "a+")
        self.p = subprocess.Popen([BIN, "router", "--port", "0", "--port-file", self.pf,
                                   "--tokens-per-block", str(T), "--hash-key-file", KEY,
                                   *(["--workers", *[w.url for w in workers]] if workers else []), *args],
                                  stdout=self.log, stderr=self.log)
        PROCS.append(self.p)
        self.port = read_port(self.pf, self.p, 60.0)

    def complete(self, prompt, conv=None, header_conv=None, max_tokens=2, **extra):
        body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)
        if conv is not None:
            body["conversation_id"] = conv
        h = {"X-Conversation-Id": header_conv} if header_conv else None
        return call(self.port, "POST", "/v1/completions", body, h)

    def metric(self, name):
        return metrics(self.port).get(name, 0.0)

    def logtext(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError("the router did not stop on SIGTERM")
        check(rc == 0, "the router exited with %s (sanitizer report or unclean stop: %s)" % (rc, self.logtext()[-800:]))


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def cached(resp):
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def ok_answer(st, resp, hd, what):
    check(st == 200, "%s: HTTP %s %s" % (what, st, resp))
    check("x-kvserve-worker" in hd, "%s: no X-Kvserve-Worker header" % what)
    return hd["x-kvserve-worker"]


def worker_last_seq(port):
    """The seq of a worker's newest /kv_events event (its polling form, page by page)."""
    after = 0
    while True:
        st, page, _ = call(port, "GET", "/kv_events?poll=1&max=1024&after=%d" % after)
        check(st == 200, "kv_events poll: HTTP %s %s" % (st, page))
        if not page["events"] and not page["lost"]:
            return after
        after = page["last_seq"]


def rand_ids(rng, n):
    return [rng.randrange(3, 500) for _ in range(n)]


# ------------------------------------------------------------------------------ cases


def shared_prompt_shares(r, system, seed, extra, symmetric=True):
    """200 requests `system` + 16 own ids (seeded from seed + i), 8 at a time through router
    r (extra(i): more complete() arguments); checks that all succeed and that every one of the 4
    workers got within 25% of the mean (symmetric=False: no worker above 1.25x the mean and every
    worker used -- the issue's bound for kv_aware, whose load term follows the requests in flight
    and so the timing of a loaded machine: seen [26, 58, 58, 58] in a CI run); returns the shares."""
    share, errors, lock = {}, [], threading.Lock()

    def one(i):
        st, resp, hd = r.complete(system + rand_ids(random.Random(seed + i), 16), **extra(i))
        with lock:
            if st != 200:
                errors.append((st, resp))
            else:
                share[hd["x-kvserve-worker"]] = share.get(hd["x-kvserve-worker"], 0) + 1
    for base in range(0, 200, 8):
        th = [threading.Thread(target=one, args=(base + k,)) for k in range(8)]
        [t.start() for t in th]
        [t.join() for t in th]
    check(not errors, "shared-prompt requests failed: %s" % errors[:2])
    if symmetric:
        check(len(share) == 4 and all(abs(v - 50) <= 12.5 for v in share.values()),
              "shared system prompt shares %s not within 25%% of 50" % sorted(share.values()))
    else:
        check(len(share) == 4 and all(v <= 62.5 for v in share.values()),
              "shared system prompt shares %s: a worker above 1.25x the mean of 50, or one unused"
              % sorted(share.values()))
    return share


def case_sticky(ws):
    r = Router(ws, ["--policy", "conversation"])
    rng = random.Random(1)
    convs = {}
    try:
        for turn in range(4):
            for c in range(50):
                hist = convs.get(c, (None, []))[1]
                prompt = hist + rand_ids(rng, 12 if turn == 0 else 6)
                use_header = c % 2 == 1
                st, resp, hd = r.complete(prompt, conv=None if use_header else "conv-%d" % c,
                                          header_conv="conv-%d" % c if use_header else None)
                w = ok_answer(st, resp, hd, "sticky conv %d turn %d" % (c, turn))
                if turn == 0:
                    convs[c] = (w, prompt)
                    continue
                check(w == convs[c][0], "conv %d turn %d moved from %s to %s" % (c, turn, convs[c][0], w))
                want = (len(hist) - 1) // T * T  # the full blocks of the previous prompt
                check(cached(resp) >= want, "conv %d turn %d: cached %d < %d" % (c, turn, cached(resp), want))
                convs[c] = (w, prompt)
        used = {w for w, _ in convs.values()}
        check(len(used) == 4, "50 new conversations used %d of 4 workers" % len(used))
        m = metrics(r.port)
        check(m['kvserve_router_placements_total{role="aggregated",reason="sticky"}'] == 150,
              "sticky placements %s != 150" % m.get('kvserve_router_placements_total{role="aggregated",reason="sticky"}'))
        rep = sum(v for k, v in m.items() if k.startswith("kvserve_router_worker_cached_tokens_total") and 'source="reported"' in k)
        check(rep > 0, "no reported cached tokens in the router's metrics")
    finally:
        r.stop()


def case_content(ws):
    r = Router(ws, ["--policy", "conversation", "--tokenizer", GGUF])
    rng = random.Random(2)
    try:
        # a new id whose prompt extends an earlier conversation by >= 32 blocks follows it
        olds = []
        for i in range(8):
            p = rand_ids(rng, 40 * T)
            st, resp, hd = r.complete(p, conv="old-%d" % i)
            olds.append((ok_answer(st, resp, hd, "old %d" % i), p))
        check(len({w for w, _ in olds}) >= 3, "8 unrelated conversations were not spread")
        for i, (w, p) in enumerate(olds):
            st, resp, hd = r.complete(p + rand_ids(rng, 10), conv="new-%d" % i)
            got = ok_answer(st, resp, hd, "new %d" % i)
            check(got == w, "new conversation %d went to %s, not to its prefix's worker %s" % (i, got, w))
            check(cached(resp) >= 32 * T, "new %d: cached %d < 32 blocks" % (i, cached(resp)))
        # a shorter shared prefix (< 32 blocks) is not followed: load decides
        m0 = metrics(r.port)['kvserve_router_placements_total{role="aggregated",reason="content"}']
        w0, p0 = olds[0]
        r.complete(p0[:24 * T] + rand_ids(rng, 40), conv="short")
        m1 = metrics(r.port)['kvserve_router_placements_total{role="aggregated",reason="content"}']
        check(m1 == m0, "a 24-block shared prefix was followed")
        # 200 conversations sharing one long system prompt spread evenly (the 1/N rule)
        share = shared_prompt_shares(r, rand_ids(rng, 48 * T), 100, lambda i: {"conv": "sys-%d" % i})
        # text prompts hashed through the router's tokenizer place like ids
        story = " ".join("Once upon a time there was a little dog named Tim who liked to run." for _ in range(14))
        st, resp, hd = r.complete(story, conv="text-a")
        wa = ok_answer(st, resp, hd, "text a")
        check(resp["usage"]["prompt_tokens"] >= 40 * T, "the text prompt is too short for the case")
        st, resp, hd = r.complete(story + " The end of the story came.", conv="text-b")
        check(ok_answer(st, resp, hd, "text b") == wa, "a text continuation did not follow its prefix")
        print("     shared-prompt shares %s" % sorted(share.values()))
    finally:
        r.stop()


def case_burst(ws):
    r = Router(ws, ["--policy", "kv_aware", "--tokenizer", GGUF])
    try:
        wait_for(lambda: sum(v for k, v in metrics(r.port).items()
                             if k.startswith("kvserve_router_worker_live")) == 4, 15, "4 mirrored workers")
        rng = random.Random(3)
        prefix = rand_ids(rng, 256)
        suffixes = [rand_ids(rng, 8) for _ in range(32)]
        before = sum(w.prefilled() for w in ws)
        res = [None] * 32
        go = threading.Event()

        def one(i):
            go.wait()
            res[i] = r.complete(prefix + suffixes[i], max_tokens=1)
        th = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        [t.start() for t in th]
        t0 = time.time()
        go.set()
        [t.join() for t in th]
        for i, (st, resp, hd) in enumerate(res):
            ok_answer(st, resp, hd, "burst %d" % i)
        total = sum(w.prefilled() for w in ws) - before
        ideal = 256 + 32 * 8
        where = {}
        for st, resp, hd in res:
            where[hd["x-kvserve-worker"]] = where.get(hd["x-kvserve-worker"], 0) + 1
        print("     burst: %d prefilled tokens (ideal %d, round robin ~%d), placements %s, all answered in %.1f ms"
              % (total, ideal, 4 * 256 + 32 * 8, sorted(where.values()), (time.time() - t0) * 1000))
        # one block of slack per request (the block holding the last prompt token is recomputed)
        check(total <= ideal + 32 * T + 256 // 4, "burst prefilled %d tokens, want about %d" % (total, ideal))
        m = metrics(r.port)
        check(m['kvserve_router_placements_total{role="aggregated",reason="predicted"}'] >= 16,
              "fewer than 16 predicted placements: %s" % {k: v for k, v in m.items() if "placements" in k})
        # BUG-14 at low concurrency: 200 requests sharing a long system prompt, 8 at a time,
        # no worker above 1.25x the mean; the prompt is prefilled about once per worker
        system = rand_ids(rng, 48 * T)
        before = sum(w.prefilled() for w in ws)
        share = shared_prompt_shares(r, system, 300, lambda i: {}, symmetric=False)
        total = sum(w.prefilled() for w in ws) - before
        print("     shared system prompt: shares %s, %d prefilled tokens (%d x the prompt beyond the suffixes)"
              % (sorted(share.values()), total, round((total - 200 * 16) / len(system))))
        # each worker prefills the prompt once; a replication racing in-flight copies may
        # repeat it (one block of slack per request for the block holding the last token)
        check(total <= 8 * len(system) + 200 * (16 + T), "shared prompt prefilled %d tokens" % total)
    finally:
        r.stop()


def case_same_hashes(ws):
    """kv_aware hashes prompts exactly as the workers do: after a text prompt and a chat prompt
    (rendered by the chat template, BOS rule, cache_salt) are cached, the tokens the router
    predicts from its mirror equal the cached_tokens the worker reports."""
    r = Router(ws, ["--policy", "kv_aware", "--tokenizer", GGUF, "--predicted-prefix-ttl", "0"])
    try:
        wait_for(lambda: sum(v for k, v in metrics(r.port).items()
                             if k.startswith("kvserve_router_worker_live")) == 4, 15, "4 mirrored workers")
        story = " ".join("Lily found a red ball in the park and gave it to her friend Sam." for _ in range(8))
        msgs = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": story}]
        cases = [("/v1/completions", {"prompt": story}),
                 ("/v1/completions", {"prompt": story, "cache_salt": "tenant-a"}),
                 ("/v1/chat/completions", {"messages": msgs})]
        for path, body in cases:
            b = dict(body, max_tokens=2, temperature=0)
            st, resp, hd = call(r.port, "POST", path, b)
            w = ok_answer(st, resp, hd, "first " + path)
            # the new blocks reach the router's mirror through the worker's event stream: wait
            # until the mirror applied the worker's latest event (a count of mirrored blocks
            # can be reached by the replay of older events instead)
            key = 'kvserve_router_worker_kv_events_seq{role="aggregated",worker="%s"}' % w
            seq = worker_last_seq(int(w.rsplit(":", 1)[1]))
            wait_for(lambda: metrics(r.port).get(key, 0) >= seq, 10, "the worker's events in the mirror")
            m0 = metrics(r.port)
            st, resp2, hd2 = call(r.port, "POST", path, b)
            check(ok_answer(st, resp2, hd2, "second " + path) == w, "the repeat left its worker")
            m1 = metrics(r.port)
            pk = 'kvserve_router_worker_cached_tokens_total{role="aggregated",worker="%s",source="%s"}'
            pred = m1[pk % (w, "predicted")] - m0[pk % (w, "predicted")]
            rep = m1[pk % (w, "reported")] - m0[pk % (w, "reported")]
            check(rep > 0 and pred == rep, "%s %s: router predicted %d cached tokens, the worker reported %d"
                  % (path, list(body), pred, rep))
        # a different cache_salt shares nothing: the router predicts 0 there
        m0 = metrics(r.port)
        st, resp, hd = call(r.port, "POST", "/v1/completions", {"prompt": story, "cache_salt": "tenant-b",
                                                                 "max_tokens": 2, "temperature": 0})
        w = ok_answer(st, resp, hd, "salted")
        m1 = metrics(r.port)
        check(cached(resp) == 0, "another salt reused blocks")
        pk = 'kvserve_router_worker_cached_tokens_total{role="aggregated",worker="%s",source="predicted"}' % w
        check(m1[pk] == m0[pk], "the router predicted reuse across salts")
    finally:
        r.stop()


def case_replicas(ws):
    """Two router replicas placing through a coordinator (--coordinator) share one placement
    state: a conversation stays on its worker whichever replica a turn goes through; every
    reservation is finished; a coordinator that goes away leaves the replicas placing locally."""
    c = Router(ws, ["--policy", "conversation"])
    curl = "http://127.0.0.1:%d" % c.port
    reps = [Router(ws, ["--policy", "conversation", "--coordinator", curl]) for _ in range(2)]
    rng = random.Random(7)
    try:
        where, hist = {}, {}
        for turn in range(3):
            for k in range(20):
                rep = reps[(k + turn) % 2]  # alternate replicas between turns
                p = hist.get(k, []) + rand_ids(rng, 10)
                st, resp, hd = rep.complete(p, conv="rep-%d" % k)
                w = ok_answer(st, resp, hd, "replica turn %d conv %d" % (turn, k))
                if turn:
                    check(w == where[k], "conv %d moved from %s to %s across replicas" % (k, where[k], w))
                    check(cached(resp) >= (len(hist[k]) - 1) // T * T, "conv %d: history not reused" % k)
                where[k], hist[k] = w, p
        check(len(set(where.values())) == 4, "20 conversations did not use every worker")
        placed = sum(rep.metric("kvserve_router_coordinator_placements_total") for rep in reps)
        check(placed == 60, "coordinator placements %s != 60" % placed)
        wait_for(lambda: c.metric("kvserve_router_reservations") == 0, 5, "every reservation finished")
        check(c.metric('kvserve_router_placements_total{role="aggregated",reason="sticky"}') == 40,
              "the coordinator did not see the later turns as sticky")
        # the coordinator goes away: the replicas place locally, no request fails
        c.stop()
        for k in range(8):
            st, resp, hd = reps[k % 2].complete(rand_ids(rng, 12), conv="alone-%d" % k)
            ok_answer(st, resp, hd, "without a coordinator")
        check(sum(rep.metric("kvserve_router_coordinator_errors_total") for rep in reps) >= 8,
              "coordinator errors not counted")
    finally:
        for rep in reps:
            rep.stop()
        if c.p.poll() is None:
            c.stop()


def case_health():
    ws = [Worker("h%d" % i) for i in range(3)]
    r = Router(ws, ["--policy", "conversation", "--health-interval", "0.25"])
    rng = random.Random(4)
    try:
        conv = {}
        for c in range(12):
            p = rand_ids(rng, 20)
            st, resp, hd = r.complete(p, conv="h-%d" % c)
            conv[c] = (ok_answer(st, resp, hd, "health first turn"), p)
        victim = ws[0]
        on_victim = [c for c in conv if conv[c][0] == victim.url]
        check(on_victim, "no conversation on the first worker")
        victim.p.send_signal(signal.SIGKILL)
        victim.p.wait()
        t_kill = time.time()
        # every request still succeeds (refused connections are retried elsewhere)
        for c in conv:
            p = conv[c][1] + rand_ids(rng, 4)
            st, resp, hd = r.complete(p, conv="h-%d" % c)
            w = ok_answer(st, resp, hd, "after kill conv %d" % c)
            check(w != victim.url, "conv %d still sent to the killed worker" % c)
            if c not in on_victim:
                check(w == conv[c][0], "conv %d on a live worker moved" % c)
            conv[c] = (w, p)
        key = 'kvserve_router_worker_live{role="aggregated",worker="%s"}' % victim.url
        wait_for(lambda: metrics(r.port).get(key) == 0.0, 5, "the killed worker to leave the pool")
        print("     killed worker out of the pool after %.2f s" % (time.time() - t_kill))
        # moved conversations stay on their new worker
        for c in on_victim:
            p = conv[c][1] + rand_ids(rng, 4)
            st, resp, hd = r.complete(p, conv="h-%d" % c)
            check(ok_answer(st, resp, hd, "moved conv") == conv[c][0], "moved conv %d did not stay" % c)
        # a stopped worker: the request stalled on it fails fast once it is out of the pool
        stalled = ws[1]
        cs = [c for c in conv if conv[c][0] == stalled.url]
        check(cs, "no conversation on the second worker")
        stalled.p.send_signal(signal.SIGSTOP)
        try:
            t0 = time.time()
            st, resp, hd = r.complete(conv[cs[0]][1] + [5, 6], conv="h-%d" % cs[0], max_tokens=4)
            dt = time.time() - t0
            check(st == 502 and "left the pool" in json.dumps(resp), "stalled request: %s %s" % (st, resp))
            check(dt < 0.25 * 2 + 1.5, "the stalled request took %.2f s to fail" % dt)
            print("     stalled request failed after %.2f s" % dt)
        finally:
            stalled.p.send_signal(signal.SIGCONT)
        key = 'kvserve_router_worker_live{role="aggregated",worker="%s"}' % stalled.url
        wait_for(lambda: metrics(r.port).get(key) == 1.0, 5, "the resumed worker to come back")
    finally:
        r.stop()
        for w in ws:
            if w.p.poll() is None:
                w.p.kill()


def case_refuse(ws):
    bad_tpb = Worker("tpb8", ["--tokens-per-block", "8"])  # the later option wins
    other_key = os.path.join(TMP, "other.key")
    bad_key = Worker("key2", ["--hash-key-file", other_key])
    try:
        for bad, want in ((bad_tpb, "tokens_per_block 8"), (bad_key, "hash key")):
            r = Router([bad], ["--policy", "kv_aware"])
            try:
                wait_for(lambda: r.metric("kvserve_router_workers_refused_total") >= 1, 10, "a refusal")
                st, resp, hd = r.complete([5, 6, 7, 8, 9, 10, 11, 12, 13])
                msg = json.dumps(resp)
                check(st == 503 and want in msg and "refused" in msg, "refusal answer: %s %s" % (st, msg))
                check("REFUSING" in r.logtext(), "no loud refusal in the router's log")
            finally:
                r.stop()
        # a matching worker next to a refused one takes every request
        r = Router([bad_tpb, ws[0]], ["--policy", "kv_aware"])
        try:
            wait_for(lambda: r.metric('kvserve_router_worker_live{role="aggregated",worker="%s"}' % ws[0].url) == 1,
                     10, "the good worker mirrored")
            for i in range(6):
                st, resp, hd = r.complete([5, 6, 7, 8, 9, 10, i + 20])
                check(ok_answer(st, resp, hd, "mixed") == ws[0].url, "a request went to the refused worker")
        finally:
            r.stop()
        # a kv_aware router without the workers' key file is refused at start
        p = subprocess.run([BIN, "router", "--port", "0", "--policy", "kv_aware", "--workers", ws[0].url],
                           capture_output=True, text=True, timeout=30)
        check(p.returncode == 2 and "--hash-key-file" in p.stderr, "kv_aware without a key: %s" % p.stderr)
    finally:
        for w in (bad_tpb, bad_key):
            w.p.kill()


def case_coordinator(ws):
    r = Router(ws, ["--policy", "conversation"])
    try:
        keys = ["%016x" % (0xa0 + i) + "0" * 48 for i in range(6)]

        def sel(key, exclude=None, rid="r1"):
            return call(r.port, "POST", "/select", {"role": "aggregated", "routing_key": key,
                                                     "req_id": rid, "exclude_server": exclude})
        # place t::sa:a by its content key: placed, pinned, reserved
        st, a, _ = sel({"conversation_id": "t::sa:a", "content_keys": keys}, rid="r1")
        check(st == 200 and a["server"], "content select: %s %s" % (st, a))
        check(r.metric("kvserve_router_reservations") == 1, "no reservation after a placement")
        # the id-only key is sticky without exclusion
        st, b, _ = sel({"conversation_id": "t::sa:a"}, rid="r2")
        check(st == 200 and b["server"] == a["server"], "id-only sticky select: %s" % b)
        # with exclude = its server: content required, nothing reserved
        load_key = 'kvserve_router_worker_in_flight{role="aggregated",worker="%s"}' % a["server"]
        before = metrics(r.port)
        st, c, _ = sel({"conversation_id": "t::sa:a"}, exclude=a["server"], rid="r3")
        check(st == 200 and c["server"] is None and c["info"].get("routing_content_required") is True,
              "id-only select with exclusion: %s" % c)
        after = metrics(r.port)
        check(after["kvserve_router_reservations"] == before["kvserve_router_reservations"] and
              after[load_key] == before[load_key], "the content-required answer reserved something")
        # an unknown id-only key needs content too
        st, d, _ = sel({"conversation_id": "never-seen"}, rid="r4")
        check(d["server"] is None and d["info"]["routing_content_required"], "unknown id-only: %s" % d)
        # retry with the content key: a server other than the excluded one, reserved
        st, e, _ = sel({"conversation_id": "t::sa:a", "content_keys": keys}, exclude=a["server"], rid="r3")
        check(st == 200 and e["server"] and e["server"] != a["server"], "retry with content: %s" % e)
        check(r.metric("kvserve_router_reservations") == 3, "reservations %s != 3" % r.metric("kvserve_router_reservations"))
        for rid in ("r1", "r2", "r3"):
            st, f, _ = call(r.port, "POST", "/finish", {"role": "aggregated", "req_id": rid, "success": True})
            check(st == 200 and f["released"] is True, "finish %s: %s" % (rid, f))
        st, f, _ = call(r.port, "POST", "/finish", {"role": "aggregated", "req_id": "r1", "success": True})
        check(f["released"] is False, "a second finish released something")
        m = metrics(r.port)
        check(m["kvserve_router_reservations"] == 0 and
              all(v == 0 for k, v in m.items() if k.startswith("kvserve_router_worker_in_flight")),
              "load left after every finish")
        st, g, _ = call(r.port, "POST", "/select", {"role": "context", "req_id": "x", "routing_key": "a"})
        check(st == 400, "a role without a pool: %s %s" % (st, g))
    finally:
        r.stop()


def case_policies(ws):
    for pol, extra in (("round_robin", []), ("least_loaded", []), ("least_loaded", ["--load-metric", "tokens"])):
        r = Router(ws, ["--policy", pol, *extra])
        try:
            seen = {}
            for i in range(16):
                st, resp, hd = r.complete([7, 8, 9, i + 10])
                w = ok_answer(st, resp, hd, pol)
                seen[w] = seen.get(w, 0) + 1
            check(sorted(seen.values()) == [4, 4, 4, 4], "%s %s: shares %s" % (pol, extra, seen))
            m = metrics(r.port)
            reqs = [v for k, v in m.items() if k.startswith("kvserve_router_worker_requests_total")]
            check(sorted(reqs) == [4, 4, 4, 4], "per-worker request metrics %s" % reqs)
            reason = "round_robin" if pol == "round_robin" else "load"
            check(m['kvserve_router_placements_total{role="aggregated",reason="%s"}' % reason] == 16,
                  "placement reason %s not counted" % reason)
        finally:
            r.stop()
    # least loaded avoids a busy worker: 3 long streams pin three workers, the rest go to the 4th
    r = Router(ws, ["--policy", "least_loaded"])
    try:
        busy, conns = set(), []
        for i in range(3):
            c = http.client.HTTPConnection("127.0.0.1", r.port, timeout=60)
            c.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6, i + 7], "max_tokens": 400,
                                                             "temperature": 0, "ignore_eos": True,
                                                             "stream": True}),
                      {"Content-Type": "application/json"})
            resp = c.getresponse()
            busy.add(resp.getheader("X-Kvserve-Worker"))
            conns.append((c, resp))
        check(len(busy) == 3, "three concurrent streams did not use three workers")
        for i in range(4):
            st, resp, hd = r.complete([9, 9, i + 3])
            check(ok_answer(st, resp, hd, "ll") not in busy, "least_loaded picked a busy worker")
        for c, resp in conns:
            resp.read()
            c.close()
    finally:
        r.stop()


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Etcd:
    """A throwaway single-member etcd on loopback (Debian etcd-server), or None when unavailable."""

    def __init__(self):
        import shutil
        self.p = None
        exe = shutil.which("etcd")
        if not exe:
            self.why = "etcd not installed (scripts/install-deps.sh --test installs etcd-server)"
            return
        cp, pp = free_port(), free_port()
        self.url = "http://127.0.0.1:%d" % cp
        d = tempfile.mkdtemp(prefix="etcd-", dir=TMP)
        self.log = open(os.path.join(TMP, "etcd.log"), "w")
        self.p = subprocess.Popen([exe, "--name", "t", "--data-dir", d, "--listen-client-urls", self.url,
                                   "--advertise-client-urls", self.url, "--listen-peer-urls",
                                   "http://127.0.0.1:%d" % pp, "--initial-advertise-peer-urls",
                                   "http://127.0.0.1:%d" % pp, "--initial-cluster", "t=http://127.0.0.1:%d" % pp],
                                  stdout=self.log, stderr=subprocess.STDOUT)
        PROCS.append(self.p)
        end = time.time() + 20
        while time.time() < end and self.p.poll() is None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", cp, timeout=1)
                c.request("POST", "/v3/kv/range", json.dumps({"key": "AA=="}))
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.why = "etcd did not start (see %s/etcd.log)" % TMP
        self.stop()
        self.p = None

    def stop(self):
        if self.p and self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()


class SkipCase(Exception):
    pass


def case_etcd():
    e = Etcd()
    if not e.p:
        if os.environ.get("KVSERVE_TESTS_REQUIRED") == "1" and not shutil.which("etcd"):
            # `make test` installs etcd-server: its absence there is a broken setup, not a skip
            raise RuntimeError(e.why)
        raise SkipCase(e.why)
    ws, r = [], None
    try:
        # health checks off: only etcd decides membership here
        r = Router([], ["--etcd", e.url, "--policy", "conversation", "--health-interval", "0"])
        reg = ["--etcd", e.url, "--etcd-ttl", "2"]
        ws = [Worker("e%d" % i, reg) for i in range(2)]
        wait_for(lambda: r.metric("kvserve_router_etcd_workers") == 2, 10, "two registered workers")
        rng = random.Random(6)
        conv = {}

        def turn(c, extra=4):
            p = conv.get(c, (None, rand_ids(rng, 16)))[1] + rand_ids(rng, extra)
            st, resp, hd = r.complete(p, conv="e-%d" % c)
            conv[c] = (ok_answer(st, resp, hd, "etcd conv %d" % c), p)
            return conv[c][0]
        for c in range(8):
            turn(c)
        check({w for w, _ in conv.values()} == {ws[0].url, ws[1].url}, "8 conversations did not use both workers")
        # a worker that registers later joins the pool
        ws.append(Worker("e2", reg))
        wait_for(lambda: r.metric("kvserve_router_etcd_workers") == 3, 10, "the third worker")
        for c in range(8, 14):
            turn(c)
        check(any(conv[c][0] == ws[2].url for c in range(8, 14)), "the new worker got no new conversation")
        # a clean stop revokes the lease: gone at once, its conversations move, nothing fails
        gone = ws[0]
        t0 = time.time()
        gone.p.send_signal(signal.SIGTERM)
        wait_for(lambda: r.metric("kvserve_router_etcd_workers") == 2, 5, "the stopped worker's deregistration")
        print("     stopped worker deregistered after %.2f s" % (time.time() - t0))
        gone.p.wait(10)
        for c in list(conv):
            check(turn(c) != gone.url, "conv %d sent to the stopped worker" % c)
        # a killed worker's lease expires (TTL 2 s): it leaves the pool without health checks
        dead = ws[1]
        dead.p.send_signal(signal.SIGKILL)
        dead.p.wait()
        t0 = time.time()
        for c in list(conv):  # refused connections are retried on the other worker
            turn(c)
        wait_for(lambda: r.metric("kvserve_router_etcd_workers") == 1, 10, "the killed worker's lease to expire")
        dt = time.time() - t0
        print("     killed worker's lease expired after %.2f s (TTL 2 s)" % dt)
        check(dt < 2 + 3, "lease expiry took %.2f s" % dt)
        for c in list(conv):
            check(turn(c) == ws[2].url, "conv %d not on the last worker" % c)
        check(r.metric("kvserve_router_requests_total{outcome=\"upstream_error\"}") == 0,
              "client requests failed during membership changes")
    finally:
        if r:
            r.stop()
        for w in ws:
            if w.p.poll() is None:
                w.p.kill()
        e.stop()


def main():
    groups = sys.argv[1:] or ["all"]
    known = {"all", "policies", "sticky", "content", "burst", "coordinator", "refuse", "hashes", "replicas",
             "health", "etcd"}
    if set(groups) - known:
        print("FAIL: unknown case(s) %s (known: %s)" % (sorted(set(groups) - known), sorted(known)))
        return 2
    want = lambda g: "all" in groups or g in groups  # noqa: E731
    if not os.path.exists(GGUF):
        print("SKIP: %s not found (KVSERVE_TEST_DATA)" % GGUF)
        return 77
    ws = []
    try:
        if any(want(g) for g in ("sticky", "content", "burst", "refuse", "coordinator", "policies", "hashes",
                                 "replicas")):
            ws = [Worker("w%d" % i) for i in range(4)]
        cases = [("policies", lambda: case_policies(ws)), ("sticky", lambda: case_sticky(ws)),
                 ("content", lambda: case_content(ws)), ("burst", lambda: case_burst(ws)),
                 ("coordinator", lambda: case_coordinator(ws)), ("refuse", lambda: case_refuse(ws)),
                 ("hashes", lambda: case_same_hashes(ws)), ("replicas", lambda: case_replicas(ws)),
                 ("health", case_health), ("etcd", case_etcd)]
        for name, fn in cases:
            if not want(name):
                continue
            t0 = time.time()
            try:
                fn()
                print("ok   %s (%.2f s)" % (name, time.time() - t0))
            except SkipCase as e:
                SKIPS.append(name)
                print("SKIP %s: %s" % (name, e))
            except Exception as e:  # noqa: BLE001
                FAILS.append(name)
                print("FAIL %s: %s" % (name, e))
            sys.stdout.flush()
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    if FAILS:
        print("FAILED: %s (logs in %s)" % (", ".join(FAILS), TMP))
        return 1
    if SKIPS and len(SKIPS) == sum(1 for g in groups if g != "all") and "all" not in groups:
        return 77  # every case asked for was skipped: ctest reports the test as skipped
    print("all routing cases passed%s" % (" (skipped: %s)" % ", ".join(SKIPS) if SKIPS else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
