#!/usr/bin/python3
"""End-to-end test of disaggregated serving with real processes (stories260K): context workers,
generation workers, KV transfer between them and `kvserve router` in front.

Groups (run all, or name some on the command line):
  flow        1 context + 1 generation worker: greedy outputs through the router equal the
              aggregated worker's for every public reference prompt, stream and not, context
              first and generation first, over tcp and (when built) ucx; chat too
  scale       2 context + 2 generation workers, 16 concurrent clients, same outputs
  faults      refused generation worker (retried, same id); a generation worker that closes after
              reading (not retried, error, no zombie); context worker killed mid-transfer; DONE
              dropped; transfer never starts; receiver delayed before it asks (sender holds, other
              requests go on); sender's blocks under eviction pressure; client disconnect
              mid-stream; SIGTERM to a context worker whose KV offer is not pulled yet (the
              client still gets its answer; --shutdown-timeout bounds the wait). After each: both workers' used blocks return to idle and the next
              request succeeds
  stale       --kv-stale-ttl 2: a context-first receive with no offer fails; a generation-first
              one is dropped silently (the receiver times out); a normal transfer still works
  kvdtype     f16 / bf16 KV pools on both workers == aggregated; mixed dtypes refused
  edges       requests that end at their first token (both styles), a prompt with room for one
              token, a leg for the other role, a disagg_request_id offered twice
  conditional --max-local-prefill-tokens: a second turn with a short uncached tail sends no
              context leg and gives the same output
  netns       the same flow between two network namespaces joined by a veth pair (root only)
  release     KV held for a generation leg that will never pull it is freed at once (transfer
              timeout 60 s, freed < 10 s): POST /kv_release, a refused receiver (mismatched
              page tables), the router's release after kill -9 of the generation worker and
              after a client leaves
  cancel      a client that leaves during a long prefill (context leg, plain stream, through
              the router) or while its generation leg waits for KV (TRANSFER_IN in generation
              first, WAITING for blocks): cancelled at the next step, blocks freed
              (KVSERVE_TEST_HOLD_PREFILL keeps the prefill in progress)
env: KVSERVE_BIN, KVSERVE_TEST_DATA. Exit 0 = all passed, 77 = skipped (data missing).
"""
import concurrent.futures
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as E  # noqa: E402
import http_api as H  # noqa: E402

check = H.check
BIN = H.BIN
GGUF = H.GGUF


class Proc:
    """A kvserve process (serve or router) with --port 0 --port-file."""

    def __init__(self, args, env=None, netns=None, name="kvserve", port=0):
        self.tmp = tempfile.mkdtemp(prefix="kvserve-disagg-")
        self.port_file = os.path.join(self.tmp, "port")
        self.log = open(os.path.join(self.tmp, "log"), "w+")
        self.name = name
        e = dict(os.environ)
        e.update(env or {})
        pre = ["ip", "netns", "exec", netns] if netns else []
        self.host = "127.0.0.1"
        self.proc = subprocess.Popen(pre + [BIN] + args + ["--port", str(port), "--port-file", self.port_file],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + 60
        while not os.path.exists(self.port_file) or not open(self.port_file).read().strip():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("%s did not start:\n%s" % (name, self.logtext()))
            time.sleep(0.05)
        self.port = int(open(self.port_file).read())

    @property
    def url(self):
        return "http://%s:%d" % (self.host, self.port)

    def logtext(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def request(self, method, path, body=None, timeout=120):
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        payload = r.read()
        c.close()
        return r.status, payload

    def post(self, path, body, timeout=120):
        st, payload = self.request("POST", path, body, timeout)
        try:
            return st, json.loads(payload)
        except ValueError:
            return st, payload

    def stream(self, path, body, timeout=120):
        st, payload = self.request("POST", path, body, timeout)
        text = payload.decode(errors="replace")
        if st != 200:
            return st, [], text
        events = []
        for block in text.split("\n\n"):
            if block.strip():
                d = block[len("data: "):] if block.startswith("data: ") else block
                events.append(d if d == "[DONE]" else json.loads(d))
        return st, events, text

    def metrics(self):
        st, payload = self.request("GET", "/metrics")
        out = {}
        for line in payload.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, val = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(val)  # labelled series summed
        return out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                rc = "killed"
            # a clean stop (and, under ASan, no leak or error report) exits 0
            check(rc == 0, "%s exits 0 on SIGTERM (rc=%s)%s" % (self.name, rc, "" if rc == 0 else ":\n" + self.logtext()))
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


WORKER_ARGS = ["--max-model-len", "512", "--threads", "1"]


def worker(role, transport="tcp", extra=(), env=None, netns=None, host=None, port=0):
    args = ["serve", "--model", GGUF, "--role", role] + WORKER_ARGS
    if role != "aggregated":
        args += ["--kv-transport", transport]
    if host:
        args += ["--host", host]
    p = Proc(args + list(extra), env=env, netns=netns, name=role, port=port)
    if host:
        p.host = host
    return p


def router(ctx, gen, extra=(), env=None):
    args = ["router"]
    for c in ctx:
        args += ["--context", c.url if hasattr(c, "url") else c]
    for g in gen:
        args += ["--generation", g.url if hasattr(g, "url") else g]
    return Proc(args + list(extra), env=env, name="router")


def completion_body(rec, max_tokens=32, stream=False):
    b = dict(prompt=rec["prompt_ids"], max_tokens=max_tokens, temperature=0, ignore_eos=True,
             logprobs=0, return_tokens_as_token_ids=True)
    if stream:
        b["stream"] = True
    return b


def ids_of(resp):
    return H.token_ids_of(resp["choices"][0]["logprobs"])


def stream_ids(events):
    ids = []
    for e in events:
        if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("logprobs"):
            ids += H.token_ids_of(e["choices"][0]["logprobs"])
    return ids


def used_blocks(p):
    m = p.metrics()
    return int(m.get("kvserve_kv_blocks_used", -1)), int(m.get("kvserve_num_requests_transfer_out", 0) +
                                                          m.get("kvserve_num_requests_transfer_in", 0))


def wait_idle(procs, what, timeout=30):
    deadline = time.time() + timeout
    while True:
        state = [used_blocks(p) for p in procs]
        if all(u == 0 and x == 0 for u, x in state):
            return True
        if time.time() > deadline:
            check(False, "%s: workers idle again (used blocks, transfers) = %s" % (what, state))
            return False
        time.sleep(0.1)


def references(agg, recs, max_tokens=32):
    out = []
    for r in recs:
        st, resp = agg.post("/v1/completions", completion_body(r, max_tokens))
        assert st == 200, resp
        out.append(ids_of(resp))
    return out


# ---------------------------------------------------------------- groups

def run_flow(agg_ref, recs, rt, label, stream=True):
    bad = 0
    for r, want in zip(recs, agg_ref):
        st, resp = rt.post("/v1/completions", completion_body(r))
        if st != 200 or ids_of(resp) != want:
            bad += 1
            print("  %s %s: status %s %s" % (label, r["id"], st, str(resp)[:300]))
            continue
        check(resp["choices"][0]["finish_reason"] == "length", "%s finish_reason length" % label)
        check("disaggregated_params" not in resp["choices"][0], "%s: no disaggregated_params leak" % label)
        if stream:
            st, ev, text = rt.stream("/v1/completions", completion_body(r, stream=True))
            if st != 200 or stream_ids(ev) != want or ev[-1] != "[DONE]":
                bad += 1
                print("  %s stream %s: status %s %s" % (label, r["id"], st, text[:300]))
    check(bad == 0, "%s: outputs equal the aggregated worker's (%d of %d differ)" % (label, bad, len(recs)))


def test_flow(agg, refs, recs, transports):
    for tr in transports:
        ctx, gen = worker("context", tr), worker("generation", tr)
        try:
            st, info = gen.request("GET", "/server_info")
            info = json.loads(info)
            check(info.get("role") == "generation", "server_info role")
            st, info = ctx.request("GET", "/server_info")
            info = json.loads(info)
            check(info["disaggregated_params"]["kv_transport"] == tr, "server_info kv_transport")
            for style in ("context_first", "generation_first"):
                rt = router([ctx], [gen], ["--schedule-style", style])
                try:
                    run_flow(refs, recs, rt, "%s/%s" % (tr, style))
                    # chat through the router equals chat on the aggregated worker
                    body = dict(messages=[{"role": "user", "content": "Once upon a time"}],
                                max_tokens=24, temperature=0)
                    st1, a = agg.post("/v1/chat/completions", body)
                    st2, b = rt.post("/v1/chat/completions", body)
                    check(st1 == 200 and st2 == 200 and a["choices"][0]["message"]["content"] ==
                          b["choices"][0]["message"]["content"], "%s/%s chat equals aggregated" % (tr, style))
                finally:
                    rt.stop()
            wait_idle([ctx, gen], "flow %s" % tr)
            m = gen.metrics()
            check(m.get("kvserve_kv_transfer_recvs_ok_total", 0) >= 2 * len(recs), "gen counted received transfers")
        finally:
            ctx.stop()
            gen.stop()


def test_kvdtype(recs):
    """16-bit KV pools: f16 and bf16 context + generation workers give the aggregated f16 / bf16
    worker's tokens (the page table carries the dtype, so blocks are the pool's real size); a
    generation worker whose KV dtype differs from the context worker's refuses the transfer
    with an error instead of reading mis-sized blocks (no garbage 200)."""
    for dt in ("f16", "bf16"):
        a = worker("aggregated", extra=["--kv-cache-dtype", dt])
        try:
            refs = references(a, recs[:4])
        finally:
            a.stop()
        ctx = worker("context", extra=["--kv-cache-dtype", dt])
        gen = worker("generation", extra=["--kv-cache-dtype", dt])
        rt = router([ctx], [gen])
        try:
            run_flow(refs, recs[:4], rt, "kv %s" % dt, stream=False)
            wait_idle([ctx, gen], "kv %s" % dt)
        finally:
            rt.stop()
            ctx.stop()
            gen.stop()
    # the refused offer is dropped at once (group release checks it against a 60 s deadline)
    ctx = worker("context", extra=["--kv-cache-dtype", "f16", "--kv-transfer-timeout", "3"])
    gen = worker("generation")  # f32
    rt = router([ctx], [gen], env=dict(os.environ, KVSERVE_DISAGG_NO_RETRY="1"))
    try:
        st, resp = rt.post("/v1/completions", completion_body(recs[0], 8))
        check(st >= 400, "mixed KV dtypes (f16 context, f32 generation): an error, not text (status %s)" % st)
        check("dtype" in json.dumps(resp) or "page table" in json.dumps(resp) or st >= 500,
              "mixed KV dtypes: the error says why: %s" % str(resp)[:300])
        wait_idle([ctx, gen], "kv mixed")
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()


def test_scale(refs, recs):
    ctxs = [worker("context"), worker("context")]
    gens = [worker("generation"), worker("generation")]
    rt = router(ctxs, gens)
    try:
        jobs = [(i % len(recs)) for i in range(32)]

        def one(i):
            st, resp = rt.post("/v1/completions", completion_body(recs[i]))
            return st, ids_of(resp) if st == 200 else resp

        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            res = list(ex.map(one, jobs))
        bad = [j for j, (st, ids) in zip(jobs, res) if st != 200 or ids != refs[j]]
        check(not bad, "2+2 workers, 16 concurrent clients: outputs equal (%d bad)" % len(bad))
        wait_idle(ctxs + gens, "scale")
        for w in gens:
            check(w.metrics().get("kvserve_kv_transfer_recvs_ok_total", 0) > 0, "both generation workers used")
    finally:
        rt.stop()
        for w in ctxs + gens:
            w.stop()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class ClosingServer(threading.Thread):
    """Reads one HTTP request, then closes the connection (a generation worker that died after
    reading it). Counts the requests it saw."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sk = socket.socket()
        self.sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sk.bind(("127.0.0.1", 0))
        self.sk.listen(16)
        self.port = self.sk.getsockname()[1]
        self.seen = 0
        self.start()

    def run(self):
        while True:
            try:
                c, _ = self.sk.accept()
            except OSError:
                return
            c.settimeout(10)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    data += c.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                while len(body) < n:
                    body += c.recv(65536)
                if b"disaggregated_params" in body or b"prompt" in body:
                    self.seen += 1
            except OSError:
                pass
            c.close()

    def close(self):
        self.sk.close()


def test_faults(refs, recs):
    r0, want = recs[0], refs[0]
    T = ["--kv-transfer-timeout", "3"]

    # 1. a refused generation worker: retried on the next one with the same id, succeeds
    ctx, gen = worker("context", extra=T), worker("generation", extra=T)
    dead = "http://127.0.0.1:%d" % free_port()
    rt = router([ctx], [dead, gen])
    try:
        for _ in range(2):  # round robin: one of the two requests hits the dead worker first
            st, resp = rt.post("/v1/completions", completion_body(r0))
            check(st == 200 and ids_of(resp) == want, "refused generation worker: retried and correct")
        m = rt.metrics()
        check(sum(v for k, v in m.items() if "retr" in k) >= 1, "router counted a retry (%s)" %
              {k: v for k, v in m.items() if "retr" in k})
        wait_idle([ctx, gen], "refused generation worker")
    finally:
        rt.stop()

    # 2. a generation worker that closes after reading the request: NOT retried, client error,
    #    the context worker's blocks are released by the transfer deadline
    closer = ClosingServer()
    rt = router([ctx], ["http://127.0.0.1:%d" % closer.port, gen])
    try:
        st, resp = rt.post("/v1/completions", completion_body(r0))
        check(st >= 500 and isinstance(resp, dict) and "error" in resp,
              "closed-after-read generation leg: client gets an error (%s %s)" % (st, str(resp)[:200]))
        check(closer.seen == 1, "closed-after-read: the leg was not re-posted (seen %d)" % closer.seen)
        wait_idle([ctx, gen], "closed-after-read", timeout=3 * 3 + 10)
        st, resp = rt.post("/v1/completions", completion_body(r0))
        check(st == 200 and ids_of(resp) == want, "next request after closed-after-read succeeds")
    finally:
        rt.stop()
        closer.close()
    ctx.stop()
    gen.stop()

    # 3. context worker killed mid-transfer (the receiver waits 1.5 s before it asks)
    ctx = worker("context", extra=T)
    gen = worker("generation", extra=T, env={"KVSERVE_KVX_FAULT": "delay_request_ms=1500"})
    rt = router([ctx], [gen])
    try:
        res = {}
        th = threading.Thread(target=lambda: res.update(r=rt.post("/v1/completions", completion_body(r0))))
        th.start()
        deadline = time.time() + 20
        while time.time() < deadline and used_blocks(gen)[1] == 0:
            time.sleep(0.02)
        ctx.kill()
        th.join(60)
        st, resp = res.get("r", (0, None))
        check(st >= 500, "context worker killed mid-transfer: client gets an error (%s)" % st)
        wait_idle([gen], "context killed")
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()

    # 4. DONE dropped by the receiver: the client still gets its answer, the sender frees its
    #    blocks at its deadline
    ctx = worker("context", extra=T)
    gen = worker("generation", extra=T, env={"KVSERVE_KVX_FAULT": "drop_done"})
    rt = router([ctx], [gen])
    try:
        st, resp = rt.post("/v1/completions", completion_body(r0))
        check(st == 200 and ids_of(resp) == want, "drop_done: output correct")
        wait_idle([ctx, gen], "drop_done", timeout=3 + 15)
        check(ctx.metrics().get("kvserve_kv_transfer_sends_failed_total", 0) >= 1, "drop_done: sender timed out")
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()

    # 5. the transfer never starts (the sender never answers): error by the deadline, both idle
    ctx = worker("context", extra=T, env={"KVSERVE_KVX_FAULT": "drop_ready"})
    gen = worker("generation", extra=T)
    rt = router([ctx], [gen])
    try:
        t0 = time.time()
        st, resp = rt.post("/v1/completions", completion_body(r0))
        check(st >= 500 and time.time() - t0 < 3 + 20, "drop_ready: error within the deadline (%s)" % st)
        wait_idle([ctx, gen], "drop_ready", timeout=3 + 15)
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()

    # 6. receiver delayed 10 s before it asks; meanwhile the context worker keeps serving
    #    and its pinned blocks survive eviction pressure (tiny pool)
    ctx = worker("context", extra=["--kv-cache-blocks", "64", "--kv-transfer-timeout", "60"])
    gen = worker("generation", extra=["--kv-transfer-timeout", "60"],
                 env={"KVSERVE_KVX_FAULT": "delay_request_ms=10000"})
    rt = router([ctx], [gen])
    try:
        res = {}
        t0 = time.time()
        th = threading.Thread(target=lambda: res.update(r=rt.post("/v1/completions", completion_body(r0))))
        th.start()
        while time.time() - t0 < 20 and used_blocks(ctx)[1] == 0:
            time.sleep(0.02)
        # eviction pressure on the context worker while the transfer waits
        for r in recs[1:6]:
            st, _ = ctx.post("/v1/completions", completion_body(r, 64))
            check(st == 200, "context worker serves other requests while a transfer waits")
        th.join(60)
        st, resp = res.get("r", (0, None))
        check(st == 200 and ids_of(resp) == want, "delayed receiver: output correct after %.1fs" % (time.time() - t0))
        wait_idle([ctx, gen], "delayed receiver")
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()

    # 7. client disconnect mid-stream: both legs cancelled, all blocks back
    ctx, gen = worker("context", extra=T), worker("generation", extra=T)
    rt = router([ctx], [gen])
    try:
        body = completion_body(recs[-1], 400, stream=True)
        sk = socket.create_connection(("127.0.0.1", rt.port))
        data = json.dumps(body).encode()
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(data) + data)
        got = b""
        sk.settimeout(30)
        while got.count(b"data: ") < 3:
            chunk = sk.recv(4096)
            if not chunk:
                break
            got += chunk
        sk.close()
        check(got.count(b"data: ") >= 3, "disconnect: stream started")
        wait_idle([ctx, gen], "client disconnect mid-stream")
        st, resp = rt.post("/v1/completions", completion_body(r0))
        check(st == 200 and ids_of(resp) == want, "next request after a disconnect succeeds")
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()

    # 8. SIGTERM to the context worker while its KV offer waits for the generation worker (the
    #    receiver asks after 3 s): no HTTP request is live there, yet the drain waits for the
    #    pull, so the client gets its full answer (before, the worker exited at once and the
    #    client got "cannot connect to the context worker"); with --shutdown-timeout 1 and a
    #    receiver that never asks in time, the drain still ends at its timeout
    for delay, tmo in ((3000, 30), (60000, 1)):
        ctx = worker("context", extra=["--kv-transfer-timeout", "60", "--shutdown-timeout", str(tmo)])
        gen = worker("generation", extra=["--kv-transfer-timeout", "60"],
                     env={"KVSERVE_KVX_FAULT": "delay_request_ms=%d" % delay})
        rt = router([ctx], [gen])
        try:
            res = {}
            th = threading.Thread(target=lambda: res.update(r=rt.post("/v1/completions", completion_body(r0))))
            th.start()
            poll("SIGTERM with a KV offer pending (delay %d): the offer is up" % delay,
                 lambda: used_blocks(ctx)[1] == 1 and used_blocks(gen)[1] == 1)
            t0 = time.time()
            ctx.proc.send_signal(signal.SIGTERM)
            if delay == 3000:
                th.join(60)
                st, resp = res.get("r", (0, None))
                check(st == 200 and ids_of(resp) == want,
                      "SIGTERM with a KV offer pending: the client gets its answer (%s %s)" % (st, str(resp)[:200]))
                ctx.stop()
            else:
                rc = ctx.proc.wait(30)
                check(rc == 0 and time.time() - t0 < 20,
                      "--shutdown-timeout 1: the drain does not wait for an offer nobody pulls (rc %s, %.1f s)"
                      % (rc, time.time() - t0))
                ctx.stop()
                gen.kill()
                th.join(60)
        finally:
            rt.stop()
            ctx.stop()
            gen.kill()
            gen.stop()


def direct_gen_leg(gen, ctx_endpoint, rec, did, style):
    body = completion_body(rec, 8)
    body["disaggregated_params"] = {"request_type": "generation_only", "disagg_request_id": did,
                                    "ctx_request_id": did, "schedule_style": style,
                                    "ctx_info_endpoint": ctx_endpoint}
    if style == "context_first":
        body["disaggregated_params"]["first_gen_tokens"] = [5]
        body["disaggregated_params"]["prompt_token_ids"] = rec["prompt_ids"]
    return gen.post("/v1/completions", body, timeout=60)


def direct_ctx_leg(ctx, rec, did):
    """A context leg sent straight to the context worker; its disaggregated_params."""
    body = completion_body(rec, 8)
    body["disaggregated_params"] = {"request_type": "context_only", "disagg_request_id": did,
                                    "schedule_style": "context_first"}
    st, resp = ctx.post("/v1/completions", body, timeout=60)
    check(st == 200 and resp["choices"][0]["finish_reason"] == "not_finished",
          "direct context leg %d kept its KV (%s)" % (did, st))
    return resp["choices"][0]["disaggregated_params"]


def wait_freed(p, what, bound=10):
    """The KV p holds for transfer is freed well within its transfer deadline (60 s here)."""
    t0 = time.time()
    ok = wait_idle([p], what, timeout=bound)
    if ok:
        check(True, "%s: freed after %.1f s (transfer deadline 60 s)" % (what, time.time() - t0))
    return ok


def test_release(recs):
    """KV a context worker holds for a generation leg that will never pull it is freed at once,
    not at --kv-transfer-timeout (60 s here; every check allows 10 s): POST /kv_release; a
    receiver refused for mismatched page tables; the router's release after the generation
    worker is killed (kill -9) with transfers pending, and after a client leaves."""
    T60 = ["--kv-transfer-timeout", "60"]
    ctx = worker("context", extra=T60)
    gen = worker("generation", extra=T60)
    try:
        dp = direct_ctx_leg(ctx, recs[0], 515151)
        t0 = time.time()
        while time.time() - t0 < 10 and used_blocks(ctx)[1] != 1:
            time.sleep(0.02)
        check(used_blocks(ctx)[1] == 1, "the context worker holds the KV for transfer")
        st, resp = ctx.post("/kv_release", {"disagg_request_id": 515151})
        check(st == 200 and resp.get("released") is True, "POST /kv_release answers 200 (%s %s)" % (st, resp))
        wait_freed(ctx, "/kv_release")
        st, resp = gen.post("/v1/completions", dict(completion_body(recs[0], 8), disaggregated_params=dict(
            dp, request_type="generation_only")), timeout=60)
        check(st == 503, "a generation leg for released KV fails as cancelled (%s %s)" % (st, str(resp)[:200]))
        # the context worker answers its late request CANCEL (it was released), not FAILED:
        # a leg whose KV the router released (its client left) is a cancellation on both sides
        m = gen.metrics()
        check(m.get("kvserve_requests_cancelled_total") == 1 and m.get("kvserve_requests_failed_total") == 0,
              "released KV: the late generation leg counts as cancelled, not failed (cancelled %s, failed %s)"
              % (m.get("kvserve_requests_cancelled_total"), m.get("kvserve_requests_failed_total")))
        for bad in ({}, {"disagg_request_id": "x"}, {"disagg_request_id": -1}, []):
            st, resp = ctx.post("/kv_release", bad)
            check(st == 400 and "disagg_request_id" in json.dumps(resp), "/kv_release %r: 400" % (bad,))
        st, resp = gen.post("/kv_release", {"disagg_request_id": 1})
        check(st == 400, "/kv_release on a generation worker: 400 (%s)" % st)
        wait_idle([ctx, gen], "release: bad calls")
    finally:
        ctx.stop()
        gen.stop()

    # a receiver refused at the handshake (f16 context, f32 generation): freed at once
    ctx = worker("context", extra=T60 + ["--kv-cache-dtype", "f16"])
    gen = worker("generation", extra=T60)
    try:
        dp = direct_ctx_leg(ctx, recs[0], 525252)
        st, resp = gen.post("/v1/completions", dict(completion_body(recs[0], 8), disaggregated_params=dict(
            dp, request_type="generation_only")), timeout=60)
        check(st >= 400, "mismatched page tables: the generation leg fails (%s)" % st)
        wait_freed(ctx, "refused receiver")
        wait_idle([gen], "refused receiver (generation side)")
    finally:
        ctx.stop()
        gen.stop()

    # kill -9 of the generation worker while transfers wait (its REQs are held back), then a
    # client that leaves while its generation leg waits: the router releases the KV (workers
    # with --api-key: the release carries the router's --worker-api-key)
    key = ["--api-key", "release-test-key"]
    ctx = worker("context", extra=T60 + key)
    slow = {"KVSERVE_KVX_FAULT": "delay_request_ms=60000"}
    for case in ("kill", "kill, generation first", "client gone"):
        gen = worker("generation", extra=T60 + key, env=slow)
        style = "generation_first" if "generation first" in case else "context_first"
        rt = router([ctx], [gen], ["--worker-api-key", "release-test-key", "--schedule-style", style])
        try:
            n = 3 if case.startswith("kill") else 1
            res = []
            body = lambda i: completion_body(recs[i], 32, stream=True)  # noqa: E731
            if case.startswith("kill"):
                ths = [threading.Thread(target=lambda i=i: res.append(rt.stream("/v1/completions", body(i), 60)))
                       for i in range(n)]
                for th in ths:
                    th.start()
            else:
                sk = socket.create_connection(("127.0.0.1", rt.port))
                data = json.dumps(body(0)).encode()
                sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(data) + data)
            t0 = time.time()
            while time.time() - t0 < 30 and used_blocks(ctx)[1] < n:
                time.sleep(0.02)
            check(used_blocks(ctx)[1] == n, "%s: the context worker holds %d transfer(s)" % (case, n))
            if case.startswith("kill"):
                gen.kill()
                for th in ths:
                    th.join(60)
                check(len(res) == n and all(st >= 500 for st, _, _ in res),
                      "kill: every client gets an error (%s)" % [st for st, _, _ in res])
            else:
                sk.close()
            wait_freed(ctx, "release after %s" % case)
            text = rt.request("GET", "/metrics")[1].decode()
            ok = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                  if x.startswith('kvserve_router_kv_releases_total{outcome="ok"}')]
            check(ok and ok[0] >= n, "%s: the router counted %s answered release(s)" % (case, ok))
            st, _ = ctx.post("/kv_release", {"disagg_request_id": 1})
            check(st == 401, "/kv_release without the key: 401 (%s)" % st)
            if case == "client gone":
                # the generation leg waiting for its transfer sees the router abort it too
                # (it used to keep its blocks until the transfer deadline and hold SIGTERM)
                poll("client gone: the generation leg in TRANSFER_IN is cancelled, its blocks freed",
                     lambda: freed(gen, 1), 10)
        finally:
            rt.stop()
            gen.stop()
    ctx.stop()


def test_stale(refs, recs):
    ctx = worker("context", extra=["--kv-stale-ttl", "2"])
    gen = worker("generation", extra=["--kv-transfer-timeout", "6"])
    try:
        ep = json.loads(ctx.request("GET", "/server_info")[1])["disaggregated_params"]["ctx_info_endpoint"]
        t0 = time.time()
        st, resp = direct_gen_leg(gen, ep, recs[0], 424242, "context_first")
        dt = time.time() - t0
        check(st >= 500 and dt < 5.5, "stale context-first receive answered FAILED by the sweep (%s after %.1fs)" % (st, dt))
        t0 = time.time()
        st, resp = direct_gen_leg(gen, ep, recs[0], 434343, "generation_first")
        dt = time.time() - t0
        check(st >= 500 and dt >= 5.0, "stale generation-first receive dropped silently: the receiver "
              "times out by itself (%s after %.1fs)" % (st, dt))
        wait_idle([ctx, gen], "stale")
        rt = router([ctx], [gen])
        try:
            st, resp = rt.post("/v1/completions", completion_body(recs[0]))
            check(st == 200 and ids_of(resp) == refs[0], "ordinary transfer after the stale sweep")
        finally:
            rt.stop()
    finally:
        ctx.stop()
        gen.stop()


def test_edges(agg, recs):
    """Requests that end at their first token, prompts that leave room for one token, legs sent
    to the wrong role, a disagg_request_id offered twice: answered at once and correctly."""
    # a transfer flag on an aggregated worker would do nothing: refused at start, naming it
    for flag, val in (("--kv-transport", "tcp"), ("--kv-transfer-port", "0"), ("--kv-transfer-timeout", "5")):
        out = subprocess.run([BIN, "serve", "--model", GGUF, flag, val], capture_output=True, text=True, timeout=60)
        check(out.returncode == 2 and flag in out.stderr and "--role" in out.stderr,
              "aggregated serve %s %s: exit 2 naming it (rc %s: %s)" % (flag, val, out.returncode, out.stderr[-200:]))
    ctx, gen = worker("context"), worker("generation")
    try:
        long_ids = (recs[-1]["prompt_ids"] * 4)[:511]
        cases = [("max_tokens 1", dict(prompt="Once upon a time", max_tokens=1, temperature=0)),
                 ("stop at the first token", dict(prompt="Once upon a time", max_tokens=8, temperature=0, stop=[","])),
                 ("room for one token", dict(prompt=long_ids, max_tokens=5, temperature=0)),
                 # token 3 is <0x00>: the text is U+0000, which the answer carries as \u0000 (a
                 # context worker ending the request at its first token re-read its own answer
                 # and failed it with "out of memory")
                 ("a <0x00> byte token, max_tokens 1", dict(prompt="Once upon a time", max_tokens=1, temperature=0,
                                                            logit_bias={"3": 100})),
                 ("<0x00> byte tokens, max_tokens 3", dict(prompt="Once upon a time", max_tokens=3, temperature=0,
                                                           logit_bias={"3": 100}))]
        for style in ("context_first", "generation_first"):
            rt = router([ctx], [gen], ["--schedule-style", style])
            try:
                lpb = dict(prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
                st1, a = agg.post("/v1/completions", lpb)
                st2, b = rt.post("/v1/completions", lpb)
                la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
                same = st2 == 200 and la["tokens"] == lb["tokens"] and all(
                    abs(x - y) < 1e-5 for x, y in zip(la["token_logprobs"], lb["token_logprobs"])) and [
                    sorted(t) for t in la["top_logprobs"]] == [sorted(t) for t in lb["top_logprobs"]]
                check(same, "%s: logprobs (first token included) equal the aggregated worker's (%s / %s)" %
                      (style, str(la)[:200], str(lb)[:200]))
                for label, body in cases:
                    t0 = time.time()
                    st1, a = agg.post("/v1/completions", body)
                    st2, b = rt.post("/v1/completions", body, timeout=30)
                    dt = time.time() - t0
                    check(st1 == 200 and st2 == 200 and dt < 10 and
                          a["choices"][0]["text"] == b["choices"][0]["text"] and
                          a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"],
                          "%s, %s: same answer as aggregated, at once (%s %.1fs %s / %s)" %
                          (style, label, st2, dt, str(a)[:120], str(b)[:120]))
            finally:
                rt.stop()
        wait_idle([ctx, gen], "edges")
        # generation first: a context worker restarted on the same HTTP port (its KV-transfer
        # port changes) is picked up again after at most one failed request
        hp = free_port()
        c2 = worker("context", port=hp)
        rt = router(["http://127.0.0.1:%d" % hp], [gen], ["--schedule-style", "generation_first"])
        try:
            body = completion_body(recs[0], 8)
            st, _ = rt.post("/v1/completions", body)
            check(st == 200, "restart: first request")
            c2.kill()
            c2.stop()
            c2 = worker("context", port=hp)
            sts = [rt.post("/v1/completions", body, timeout=30)[0] for _ in range(3)]
            check(sts[-1] == 200 and sts[1] == 200, "restarted context worker is found again (%s)" % sts)
        finally:
            rt.stop()
            c2.stop()
        # a leg for the other role is refused
        leg = dict(prompt="Once upon a time", max_tokens=4,
                   disaggregated_params={"request_type": "context_only", "disagg_request_id": 5})
        st, resp = gen.post("/v1/completions", leg)
        check(st == 400 and "role" in resp["error"]["message"], "context_only leg on a generation worker: 400")
        # the same disagg_request_id offered twice: the second context leg is refused
        leg["disaggregated_params"]["disagg_request_id"] = 77
        st1, r1 = ctx.post("/v1/completions", leg)
        st2, r2 = ctx.post("/v1/completions", leg)
        check(st1 == 200 and st2 == 400, "duplicate disagg_request_id: second context leg refused (%s %s)" % (st1, st2))
        # nobody pulls the first one: release it (a draining worker waits for offers it holds)
        st, _ = ctx.post("/kv_release", {"disagg_request_id": 77})
        check(st == 200, "duplicate disagg_request_id: the kept offer released (%s)" % st)
        wait_idle([ctx], "duplicate disagg_request_id released")
    finally:
        ctx.stop()
        gen.stop()


def test_conditional(agg):
    ctx, gen = worker("context"), worker("generation")
    rt = router([ctx], [gen], ["--max-local-prefill-tokens", "64"])
    try:
        msgs = [{"role": "user", "content": "Once upon a time there was a little girl named Lily."}]
        body = dict(messages=msgs, max_tokens=48, temperature=0)
        st, a = rt.post("/v1/chat/completions", body)
        check(st == 200, "conditional: turn 1")
        legs1 = ctx.metrics().get("kvserve_requests_total", 0)
        reply = a["choices"][0]["message"]["content"]
        msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        body2 = dict(messages=msgs2, max_tokens=24, temperature=0)
        st, b = rt.post("/v1/chat/completions", body2)
        check(st == 200, "conditional: turn 2")
        legs2 = ctx.metrics().get("kvserve_requests_total", 0)
        check(legs2 == legs1, "conditional: turn 2 sent no context leg (%d -> %d)" % (legs1, legs2))
        st, ref = agg.post("/v1/chat/completions", body2)
        check(b["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"],
              "conditional: turn 2 output equals the aggregated worker's")
        m = rt.metrics()
        check(sum(v for k, v in m.items() if "local" in k) >= 1, "router /metrics counts the local prefill")
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()


def test_netns(refs, recs):
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("SKIP netns: needs root and iproute2 (ip)")
        return
    a, b = "kvs-a-%d" % os.getpid(), "kvs-b-%d" % os.getpid()
    va, vb = "kva%d" % (os.getpid() % 10000), "kvb%d" % (os.getpid() % 10000)
    sh = lambda *c: subprocess.run(c, check=True, capture_output=True)  # noqa: E731
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        sh("ip", "link", "set", va, "netns", a)
        sh("ip", "link", "set", vb, "netns", b)
        sh("ip", "-n", a, "addr", "add", "10.251.0.1/30", "dev", va)
        sh("ip", "-n", b, "addr", "add", "10.251.0.2/30", "dev", vb)
        for ns, v in ((a, va), (b, vb)):
            sh("ip", "-n", ns, "link", "set", v, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        print("SKIP netns: cannot create namespaces (%s)" % getattr(e, "stderr", e))
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)
        return
    try:
        env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "all"}
        transports = ["tcp"] + (["ucx"] if ucx_built() else [])
        for tr in transports:
            ctx = worker("context", tr, env=env, netns=a, host="10.251.0.1")
            gen = worker("generation", tr, env=env, netns=b, host="10.251.0.2")
            try:
                # the test talks to each worker inside its namespace through the router, which
                # runs in the generation worker's namespace and reaches the context worker over veth
                rt_args = ["router", "--context", ctx.url, "--generation", gen.url, "--host", "10.251.0.2"]
                rt = Proc(rt_args, env=env, netns=b, name="router")
                rt.host = "10.251.0.2"
                try:
                    bad = 0
                    for r, want in zip(recs[:4], refs[:4]):
                        st, resp = netns_post(b, rt, completion_body(r))
                        if st != 200 or ids_of(resp) != want:
                            bad += 1
                    check(bad == 0, "two hosts (netns + veth, %s): outputs equal (%d bad)" % (tr, bad))
                finally:
                    rt.stop()
            finally:
                ctx.stop()
                gen.stop()
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def netns_post(ns, p, body):
    """POST from inside namespace ns (the test process stays in the root namespace)."""
    code = ("import json,sys,http.client\n"
            "c=http.client.HTTPConnection(%r,%d,timeout=120)\n"
            "c.request('POST','/v1/completions',body=sys.stdin.read(),headers={'Content-Type':'application/json'})\n"
            "r=c.getresponse();print(r.status);print(r.read().decode())\n") % (p.host, p.port)
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], input=json.dumps(body),
                         capture_output=True, text=True, timeout=180)
    lines = out.stdout.split("\n", 1)
    try:
        return int(lines[0]), json.loads(lines[1])
    except (ValueError, IndexError):
        return 0, out.stdout + out.stderr


def ucx_built():
    out = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True).stdout
    return "ucx" in out and os.environ.get("KVSERVE_TEST_NO_UCX") != "1" and ucx_works()


def ucx_works():
    try:
        w = worker("context", "ucx")
    except RuntimeError as e:
        print("SKIP ucx: a ucx worker does not start here (%s)" % str(e)[-300:])
        return False
    w.stop()
    return True


# ---------------------------------------------------------------- cancel (client gone)

HOLD = 64  # KVSERVE_TEST_HOLD_PREFILL: no engine step once this many prompt tokens were computed
LONG = 400  # prompt tokens of a "long prefill" (--max-num-tokens 16: 25 steps, held after 4)


def long_prompt(n=LONG):
    return [1] + [10 + (7 * i) % 480 for i in range(n - 1)]  # BOS + ids of the 512-token vocab


def raw_post(p, body, path="/v1/completions"):
    """Sends body on a socket of its own and returns the socket (the answer is not read)."""
    sk = socket.create_connection((p.host, p.port))
    data = json.dumps(body).encode()
    sk.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    return sk


def poll(what, cond, limit=20):
    """A bounded poll (never a sleep as synchronisation): check(cond() within limit seconds)."""
    try:
        E.wait_for(cond, limit, what)
        check(True, what)
        return True
    except AssertionError:
        check(False, what)
        return False


def mval(p, name):
    return p.metrics().get(name, 0.0)


def mid_prefill(p, n_running=1):
    """p holds n_running request(s) mid-prefill: HOLD prompt tokens computed, blocks held."""
    m = p.metrics()
    return (m.get("kvserve_prefill_tokens_computed_total", 0) >= HOLD and
            m.get("kvserve_num_requests_running", 0) == n_running and m.get("kvserve_kv_blocks_used", 0) > 0)


def freed(p, cancelled):
    m = p.metrics()
    return (m.get("kvserve_requests_cancelled_total", 0) >= cancelled and m.get("kvserve_kv_blocks_used", -1) == 0
            and m.get("kvserve_num_requests_running", -1) == 0 and m.get("kvserve_num_requests_waiting", -1) == 0
            and m.get("kvserve_num_requests_transfer_in", -1) == 0
            and m.get("kvserve_num_requests_transfer_out", -1) == 0)


def test_cancel(recs):
    """A client that leaves while its request computes a long prefill, or while its generation
    leg waits for KV, is cancelled at the next engine step and frees every block (F5/F6 of the
    disaggregation review). Prefill is kept in progress with the engine test hook
    KVSERVE_TEST_HOLD_PREFILL (no step after HOLD prompt tokens) instead of timing: before the
    fix the worker never noticed these clients (nothing was written to them), so every
    "cancelled" poll below timed out."""
    held = ["--max-num-tokens", "16"]
    hold = {"KVSERVE_TEST_HOLD_PREFILL": str(HOLD)}
    T60 = ["--kv-transfer-timeout", "60"]
    r0 = recs[0]
    prompt = long_prompt()

    # 1. F5 on the worker itself: a context leg (non-stream) whose client closes mid-prefill,
    #    then a plain stream whose client read the head and closed (a FIN either way)
    ctx = worker("context", extra=held + T60, env=hold)
    try:
        body = dict(completion_body(r0, 8), prompt=prompt)
        body["disaggregated_params"] = {"request_type": "context_only", "disagg_request_id": 616161,
                                        "schedule_style": "context_first"}
        sk = raw_post(ctx, body)
        poll("context leg: held mid-prefill", lambda: mid_prefill(ctx))
        sk.close()
        poll("context leg: the closed client is seen, the leg cancelled, its blocks freed",
             lambda: freed(ctx, 1))
        m = ctx.metrics()
        check(m["kvserve_prefill_tokens_computed_total"] < LONG and m["kvserve_client_disconnects_total"] >= 1,
              "context leg: cancelled before its prefill ended (%d of %d prompt tokens computed)"
              % (m["kvserve_prefill_tokens_computed_total"], LONG))
        sk = raw_post(ctx, dict(completion_body(r0, 8, stream=True), prompt=prompt))
        head = b""
        sk.settimeout(30)
        while b"\r\n\r\n" not in head:
            chunk = sk.recv(4096)
            if not chunk:
                break
            head += chunk
        check(head.startswith(b"HTTP/1.1 200"), "plain stream: head received (%r)" % head[:40])
        sk.close()
        poll("plain stream whose client closed after the head (a FIN, no reset): cancelled, blocks freed",
             lambda: freed(ctx, 2))
        # n = 3 whose client leaves before the fork: one request, one cancel (the unborn choices'
        # terminal events used to count 3 cancels against 1 request)
        t0, c0 = mval(ctx, "kvserve_requests_total"), mval(ctx, "kvserve_requests_cancelled_total")
        sk = raw_post(ctx, dict(completion_body(r0, 8), prompt=prompt, n=3, temperature=0.8, seed=5))
        poll("n=3: admitted", lambda: mval(ctx, "kvserve_requests_total") >= t0 + 1)
        sk.close()
        poll("n=3 request whose client left: cancelled, blocks freed", lambda: freed(ctx, c0 + 1))
        check(mval(ctx, "kvserve_requests_cancelled_total") == c0 + 1 and mval(ctx, "kvserve_requests_total") == t0 + 1,
              "n=3 cancelled before its fork counts one request, one cancel (%d, %d)"
              % (mval(ctx, "kvserve_requests_total") - t0, mval(ctx, "kvserve_requests_cancelled_total") - c0))
        # the cancelled answers written to clients that left are not the server's 5xx
        check(mval(ctx, "kvserve_http_responses_5xx_total") == 0,
              "clients that left are not counted as 5xx answers (%d)" % mval(ctx, "kvserve_http_responses_5xx_total"))
    finally:
        ctx.stop()

    # 2. F5 through the router (context first): the router aborts the context leg, the worker
    #    cancels it mid-prefill
    ctx = worker("context", extra=held + T60, env=hold)
    gen = worker("generation", extra=T60)
    rt = router([ctx], [gen])
    try:
        sk = raw_post(rt, dict(completion_body(r0, 8), prompt=prompt))
        poll("router, context first: context leg held mid-prefill", lambda: mid_prefill(ctx))
        sk.close()
        poll("router, context first: the context leg is cancelled, its blocks freed", lambda: freed(ctx, 1))
        check(mval(ctx, "kvserve_prefill_tokens_computed_total") < LONG, "router: cancelled before its prefill ended")
        check(mval(rt, "kvserve_router_client_disconnects_total") >= 1, "router counted the disconnect")
        check(mval(gen, "kvserve_requests_total") == 0, "no generation leg was sent")
    finally:
        rt.stop()
        ctx.stop()
        gen.stop()

    # 3. F6, generation first: the generation leg waits in TRANSFER_IN for a context leg that
    #    is held mid-prefill; the client (stream and not) leaves: both legs are cancelled, the
    #    generation worker frees its blocks at once (not at its transfer deadline). Its request
    #    for the KV is held back (delay_request_ms), so the context worker never learns of it
    #    and the router's /kv_release cannot end it there: the generation worker must see the
    #    router's abort itself.
    for stream in (True, False):
        ctx = worker("context", extra=held + T60, env=hold)
        gen = worker("generation", extra=T60, env={"KVSERVE_KVX_FAULT": "delay_request_ms=60000"})
        rt = router([ctx], [gen], ["--schedule-style", "generation_first"])
        try:
            sk = raw_post(rt, dict(completion_body(r0, 8, stream=stream), prompt=prompt))
            poll("generation first (stream %s): generation leg in TRANSFER_IN, context leg mid-prefill" % stream,
                 lambda: mval(gen, "kvserve_num_requests_transfer_in") == 1 and mid_prefill(ctx))
            check(mval(gen, "kvserve_kv_blocks_used") > 0, "the generation leg holds blocks for the KV")
            sk.close()
            poll("generation first (stream %s): the generation leg is cancelled, its blocks freed" % stream,
                 lambda: freed(gen, 1))
            check(mval(gen, "kvserve_client_disconnects_total") >= 1, "the generation worker saw the abort")
            poll("generation first (stream %s): the context leg is cancelled, its blocks freed" % stream,
                 lambda: freed(ctx, 1))
        finally:
            rt.stop()
            ctx.stop()
            gen.stop()

    # 4. F6, a generation leg still waiting for blocks (WAITING; the generation worker is held
    #    by a plain long prefill) whose client leaves: it tells the context worker
    #    (kvx_cancel_remote), which drops the offer and its blocks at once (no router here, so
    #    no /kv_release: the remote cancel is the only way they are freed before 60 s)
    ctx = worker("context", extra=T60)
    gen = worker("generation", extra=held + T60, env=hold)
    try:
        plain = raw_post(gen, dict(completion_body(r0, 8), prompt=prompt))
        poll("generation worker held by a plain prefill", lambda: mid_prefill(gen))
        dp = direct_ctx_leg(ctx, recs[1], 626262)
        poll("the context worker holds the KV for transfer",
             lambda: mval(ctx, "kvserve_num_requests_transfer_out") == 1)
        sk = raw_post(gen, dict(completion_body(recs[1], 8),
                                disaggregated_params=dict(dp, request_type="generation_only")))
        poll("the generation leg waits", lambda: mval(gen, "kvserve_num_requests_waiting") == 1)
        sk.close()
        poll("waiting generation leg whose client left: cancelled", lambda: mval(gen, "kvserve_num_requests_waiting") == 0
             and mval(gen, "kvserve_requests_cancelled_total") >= 1)
        poll("... and the context worker dropped the offer and its blocks (remote cancel)", lambda: freed(ctx, 0), 10)
        plain.close()
        poll("the plain request is cancelled too, every block of the generation worker free",
             lambda: freed(gen, 2))
    finally:
        ctx.stop()
        gen.stop()


def main():
    if not os.path.exists(GGUF):
        print("SKIP: test data %s not found (set KVSERVE_TEST_DATA)" % GGUF)
        return 77
    only = set(sys.argv[1:])
    want = lambda n: not only or n in only  # noqa: E731
    recs = H.greedy_records()
    agg = worker("aggregated")
    try:
        refs = references(agg, recs)
        transports = ["tcp"] + (["ucx"] if ucx_built() else [])
        groups = [("flow", lambda: test_flow(agg, refs, recs, transports)),
                  ("scale", lambda: test_scale(refs, recs)),
                  ("faults", lambda: test_faults(refs, recs)),
                  ("stale", lambda: test_stale(refs, recs)),
                  ("edges", lambda: test_edges(agg, recs)),
                  ("conditional", lambda: test_conditional(agg)),
                  ("netns", lambda: test_netns(refs, recs)),
                  ("kvdtype", lambda: test_kvdtype(recs)),
                  ("release", lambda: test_release(recs)),
                  ("cancel", lambda: test_cancel(recs))]
        for name, fn in groups:
            if not want(name):
                continue
            t0 = time.time()
            before = len(H.failures)
            try:
                fn()
            except Exception as e:  # one group's crash must not hide the others
                import traceback
                traceback.print_exc()
                check(False, "%s raised %r" % (name, e))
            print("%-12s %s (%.1fs)" % (name, "ok" if len(H.failures) == before else "FAILED",
                                        time.time() - t0), flush=True)
    finally:
        agg.stop()
    if H.failures:
        print("%d checks passed, %d failed" % (H.passed, len(H.failures)))
        return 1
    print("%d checks passed, 0 failed" % H.passed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
