#!/usr/bin/env python3
"""e2e tests of `kvserve router` against fake workers (tests/e2e/fake_worker.py).

Usage: router_e2e.py [flows|retries|streams|all]   (env KVSERVE_BIN)
Each case starts its own router (a few ms) over long-lived fake workers whose failure mode is
switched per case; waits are bounded polls, never fixed sleeps.
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_util import read_port, wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("KVSERVE_BIN", os.path.join(HERE, "../../build/kvserve"))
TMP = tempfile.mkdtemp(prefix="kvserve-router-e2e-")
PROCS = []
FAILS = []


def start_fake(name, role):
    pf = os.path.join(TMP, name + ".port")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_worker.py"), "--role", role,
                          "--port-file", pf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    PROCS.append(p)
    return "http://127.0.0.1:%d" % read_port(pf, p)


def closed_port_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return "http://127.0.0.1:%d" % port


class Router:
    def __init__(self, args, env=None):
        self.pf = os.path.join(TMP, "router%d.port" % time.time_ns())
        self.log = open(os.path.join(TMP, "router.log"), "a+")
        e = dict(os.environ)
        e.update(env or {})
        self.p = subprocess.Popen([BIN, "router", "--port", "0", "--port-file", self.pf] + args,
                                  stdout=self.log, stderr=self.log, env=e)
        self.port = read_port(self.pf, self.p)

    def conn(self, timeout=20):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, path, body):
        c = self.conn()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, r.getheader("Content-Type") or "", data

    def get(self, path):
        c = self.conn()
        c.request("GET", path)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def metric(self, line_prefix):
        st, data = self.get("/metrics")
        assert st == 200
        for line in data.decode().splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.split()[-1])
        raise AssertionError("metric %s not found" % line_prefix)

    def stop(self):
        self.p.terminate()
        try:
            rc = self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError("router did not stop on SIGTERM")
        assert rc == 0, "router exit code %s" % rc


def fake_mode(url, mode, **opts):
    c = http.client.HTTPConnection(url[7:].split(":")[0], int(url.rsplit(":", 1)[1]), timeout=10)
    o = dict(opts)
    o["mode"] = mode
    c.request("POST", "/_mode", json.dumps(o))
    c.getresponse().read()
    c.close()


def fake_log(url):
    c = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
    c.request("GET", "/_log")
    d = json.loads(c.getresponse().read())
    c.close()
    return d


def legs(url, path=None):
    return [r for r in fake_log(url)["requests"] if path is None or r["path"] == path]


def sse_events(data):
    out = []
    for block in data.decode().split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            out.append(block[6:])
    return out


CASES = {}


def case(group):
    def deco(fn):
        CASES.setdefault(group, []).append(fn)
        return fn
    return deco


W = {}  # fake workers


def reset(*modes):
    for name in ("ctx0", "gen0", "gen1", "agg0", "agg1"):
        fake_mode(W[name], "normal")
    for name, mode, opts in modes:
        fake_mode(W[name], mode, **opts)


# ------------------------------------------------------------------ flows

@case("flows")
def context_first_nonstream():
    reset()
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        body = {"model": "fake", "prompt": "hello", "max_tokens": 8, "stream": False,
                "stream_options": {"include_usage": True}}
        st, ct, data = r.post("/v1/completions", body)
        assert st == 200, (st, data)
        resp = json.loads(data)
        ctx = legs(W["ctx0"], "/v1/completions")
        gen = legs(W["gen0"], "/v1/completions")
        assert len(ctx) == 1 and len(gen) == 1, (ctx, gen)
        cb = ctx[0]["body"]
        assert cb["stream"] is False and "stream_options" not in cb, cb
        cdp = cb["disaggregated_params"]
        assert cdp["request_type"] == "context_only" and cdp["schedule_style"] == "context_first", cdp
        rid = cdp["disagg_request_id"]
        assert isinstance(rid, int) and 0 < rid < 2 ** 53, rid
        gdp = gen[0]["body"]["disaggregated_params"]
        assert gdp["request_type"] == "generation_only", gdp
        assert gdp["disagg_request_id"] == rid and gdp["ctx_request_id"] == 7000 + rid % 1000, gdp
        assert gdp["prompt_token_ids"] == [1, 2, 3] and gdp["first_gen_tokens"] == [42], gdp
        assert gen[0]["body"]["prompt"] == "hello" and gen[0]["body"]["max_tokens"] == 8
        assert resp["choices"][0]["text"] == "gen-%s-%d" % (W["gen0"][7:], rid), resp
        assert r.metric("kvserve_router_context_legs_total") == 1
        assert r.metric('kvserve_router_requests_total{outcome="ok"}') == 1
    finally:
        r.stop()


@case("flows")
def context_first_stream_chat():
    reset()
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}, "conversation_id": "conv-1"}
        st, ct, data = r.post("/v1/chat/completions", body)
        assert st == 200 and ct.startswith("text/event-stream"), (st, ct, data)
        ev = sse_events(data)
        assert ev[-1] == "[DONE]" and len(ev) == 4, ev
        first = json.loads(ev[0])
        assert first["choices"][0]["delta"]["content"].startswith("gen-"), first
        cb = legs(W["ctx0"], "/v1/chat/completions")[0]["body"]
        assert cb["stream"] is False and "stream_options" not in cb
        assert cb["disaggregated_params"]["conversation_id"] == "conv-1", cb
        gb = legs(W["gen0"], "/v1/chat/completions")[0]["body"]
        assert gb["stream"] is True and gb["stream_options"] == {"include_usage": True}, gb
        assert gb["disaggregated_params"]["conversation_id"] == "conv-1"
    finally:
        r.stop()


@case("flows")
def generation_first():
    reset()
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"], "--schedule-style",
                "generation_first"])
    try:
        for i in range(2):
            st, ct, data = r.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": i == 1})
            assert st == 200, (st, data)
        info = legs(W["ctx0"], "/server_info")
        assert len(info) == 1, "server_info must be cached: %r" % info
        ctx = legs(W["ctx0"], "/v1/completions")
        gen = legs(W["gen0"], "/v1/completions")
        assert len(ctx) == 2 and len(gen) == 2
        # the two legs of a request go out at once: pair them by id, not by arrival order (a
        # context leg can reach its worker after the next request's)
        by_id = {c["body"]["disaggregated_params"]["disagg_request_id"]: c for c in ctx}
        assert len(by_id) == 2, ctx
        for g in gen:
            gdp = g["body"]["disaggregated_params"]
            assert gdp["ctx_request_id"] in by_id, (gdp, ctx)
            cdp = by_id[gdp["ctx_request_id"]]["body"]["disaggregated_params"]
            assert gdp["request_type"] == "generation_only" and gdp["schedule_style"] == "generation_first"
            assert gdp["ctx_request_id"] == gdp["disagg_request_id"] == cdp["disagg_request_id"], (gdp, cdp)
            assert gdp["ctx_info_endpoint"] == W["ctx0"][7:] + ":kvx", gdp
            assert cdp["request_type"] == "context_only" and cdp["schedule_style"] == "generation_first"
    finally:
        r.stop()


@case("flows")
def generation_first_context_fails():
    reset(("ctx0", "status500", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"], "--schedule-style",
                "generation_first", "--max-retries", "0"])
    try:
        fake_mode(W["gen0"], "stall")
        st, ct, data = r.post("/v1/completions", {"prompt": "x", "stream": True})
        assert st == 500, (st, data)
        assert "error" in json.loads(data)
        wait_for(lambda: any(e["event"] == "client_closed" for e in fake_log(W["gen0"])["events"]),
                 10, "the generation leg to be cancelled")
    finally:
        r.stop()


@case("flows")
def round_robin_and_aggregated():
    reset()
    r = Router(["--workers", W["agg0"], W["agg1"]])
    try:
        for _ in range(4):
            st, _, data = r.post("/v1/completions", {"prompt": "p"})
            assert st == 200, data
        a, b = legs(W["agg0"], "/v1/completions"), legs(W["agg1"], "/v1/completions")
        assert len(a) == 2 and len(b) == 2, (len(a), len(b))
        assert "disaggregated_params" not in a[0]["body"]
        st, data = r.get("/v1/models")
        assert st == 200 and json.loads(data)["data"][0]["id"] == "fake"
        st, data = r.get("/health")
        assert st == 200
        st, data = r.get("/nope")
        assert st == 404 and "error" in json.loads(data)
    finally:
        r.stop()
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"], W["gen1"]])
    try:
        for _ in range(4):
            assert r.post("/v1/completions", {"prompt": "p"})[0] == 200
        assert len(legs(W["gen0"], "/v1/completions")) == 2
        assert len(legs(W["gen1"], "/v1/completions")) == 2
    finally:
        r.stop()


@case("flows")
def policy_per_role():
    """--policy applies inside each role of a disaggregated pool: a conversation's generation
    legs stay on one generation worker (the header names it), two conversations spread."""
    reset()
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"], W["gen1"], "--policy", "conversation"])
    try:
        seen = {}
        for i in range(6):
            conv = "ab"[i % 2]
            c = r.conn()
            c.request("POST", "/v1/completions", json.dumps({"prompt": "p", "conversation_id": conv}),
                      {"Content-Type": "application/json"})
            resp = c.getresponse()
            resp.read()
            c.close()
            assert resp.status == 200, resp.status
            w = resp.getheader("X-Kvserve-Worker")
            assert w in (W["gen0"], W["gen1"]), w
            seen.setdefault(conv, set()).add(w)
        assert len(seen["a"]) == 1 and len(seen["b"]) == 1 and seen["a"] != seen["b"], seen
        gl = legs(W[[k for k in ("gen0", "gen1") if W[k] in seen["a"]][0]], "/v1/completions")
        assert len(gl) == 3 and all(g["body"]["disaggregated_params"]["conversation_id"] == "a" for g in gl)
        m = r.get("/metrics")[1].decode()
        assert 'kvserve_router_placements_total{role="generation",reason="sticky"} 4' in m, m
        assert 'kvserve_router_placements_total{role="context",reason="sticky"} 4' in m, m
    finally:
        r.stop()


@case("flows")
def context_checks():
    reset(("ctx0", "malformed", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 500 and "disaggregated_params" in json.loads(data)["error"]["message"], data
        assert legs(W["gen0"], "/v1/completions") == []
        # 4xx passes through unchanged
        fake_mode(W["ctx0"], "status400")
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 400, (st, data)
        assert json.loads(data) == {"error": {"message": "fake bad request", "type": "invalid_request_error",
                                              "param": "prompt", "code": "fake_code"}}, data
        assert len(legs(W["ctx0"], "/v1/completions")) == 1, "a 4xx is never retried"
        # finished at the first token: answered from the context leg
        fake_mode(W["ctx0"], "finished")
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        resp = json.loads(data)
        assert st == 200 and resp["choices"][0]["text"] == "ctx", resp
        assert "disaggregated_params" not in resp["choices"][0]
        st, ct, data = r.post("/v1/completions", {"prompt": "p", "stream": True,
                                                  "stream_options": {"include_usage": True}})
        ev = sse_events(data)
        assert st == 200 and ev[-1] == "[DONE]" and json.loads(ev[0])["choices"][0]["text"] == "ctx", ev
        assert "usage" in json.loads(ev[-2]), ev
        assert legs(W["gen0"], "/v1/completions") == []
        # not JSON
        st, _, data = r.post("/v1/completions", "not json")
        assert st == 400
    finally:
        r.stop()


@case("flows")
def conditional_disaggregation():
    reset(("gen0", "probe", {"prompt_tokens": 100, "cached_tokens": 95}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"], "--max-local-prefill-tokens", "10"])
    try:
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 200, data
        assert legs(W["ctx0"], "/v1/completions") == [], "a local prefill sends no context leg"
        g = legs(W["gen0"], "/v1/completions")
        assert len(g) == 1 and "disaggregated_params" not in g[0]["body"], g
        assert len(legs(W["gen0"], "/kv_probe")) == 1
        assert r.metric("kvserve_router_local_prefills_total") == 1
        fake_mode(W["gen0"], "probe", prompt_tokens=100, cached_tokens=50)
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 200 and len(legs(W["ctx0"], "/v1/completions")) == 1
        fake_mode(W["gen0"], "normal")  # probe answers 404: the normal flow
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 200 and len(legs(W["ctx0"], "/v1/completions")) == 2
        assert r.metric("kvserve_router_local_prefills_total") == 1
    finally:
        r.stop()


# ------------------------------------------------------------------ retries

@case("retries")
def refused_generation_retried():
    reset()
    dead = closed_port_url()
    r = Router(["--context", W["ctx0"], "--generation", dead, W["gen1"]])
    try:
        st, _, data = r.post("/v1/completions", {"prompt": "p", "stream": True})
        assert st == 200, data
        rid = legs(W["ctx0"], "/v1/completions")[0]["body"]["disaggregated_params"]["disagg_request_id"]
        g = legs(W["gen1"], "/v1/completions")
        assert len(g) == 1 and g[0]["body"]["disaggregated_params"]["disagg_request_id"] == rid, g
        assert r.metric('kvserve_router_retries_total{leg="generation",class="undelivered"}') == 1
    finally:
        r.stop()


@case("retries")
def close_after_read_not_retried():
    reset(("gen0", "close_after_read", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"], W["gen1"], "--max-retries", "3"])
    try:
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 502 and "error" in json.loads(data), (st, data)
        assert len(legs(W["gen0"], "/v1/completions")) == 1
        assert legs(W["gen1"], "/v1/completions") == [], "a possibly delivered leg must not be retried"
        assert r.metric('kvserve_router_retries_total{leg="generation",class="possibly_delivered"}') == 0
        assert r.metric('kvserve_router_upstream_errors_total{leg="generation"}') == 1
    finally:
        r.stop()


@case("retries")
def no_retry_env():
    reset()
    dead = closed_port_url()
    r = Router(["--context", W["ctx0"], "--generation", dead, W["gen1"]],
               env={"KVSERVE_DISAGG_NO_RETRY": "1"})
    try:
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 502, (st, data)
        assert legs(W["gen1"], "/v1/completions") == []
        assert r.metric('kvserve_router_retries_total{leg="generation",class="undelivered"}') == 0
    finally:
        r.stop()
    with open(os.path.join(TMP, "router.log")) as f:
        assert "KVSERVE_DISAGG_NO_RETRY=1" in f.read()


@case("retries")
def context_5xx_retried_with_fresh_id():
    reset(("ctx0", "status500", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"], "--max-retries", "1"])
    try:
        st, _, data = r.post("/v1/completions", {"prompt": "p"})
        assert st == 500, (st, data)
        c = legs(W["ctx0"], "/v1/completions")
        assert len(c) == 2, "one retry of a 5xx context leg (max_retries 1): %d" % len(c)
        ids = [x["body"]["disaggregated_params"]["disagg_request_id"] for x in c]
        assert ids[0] != ids[1], ids
    finally:
        r.stop()


# ------------------------------------------------------------------ streams

@case("streams")
def first_chunk_failure_is_http_error():
    reset(("gen0", "close_after_read", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        st, ct, data = r.post("/v1/completions", {"prompt": "p", "stream": True})
        assert st == 502 and ct.startswith("application/json"), (st, ct, data)
        assert "error" in json.loads(data)
        fake_mode(W["gen0"], "status500")
        st, ct, data = r.post("/v1/completions", {"prompt": "p", "stream": True})
        assert st == 500 and json.loads(data)["error"]["message"] == "fake failure", (st, data)
    finally:
        r.stop()


@case("streams")
def midstream_failure_is_error_event():
    reset(("gen0", "fail_midstream", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        st, ct, data = r.post("/v1/completions", {"prompt": "p", "stream": True})
        assert st == 200, (st, data)
        ev = sse_events(data)
        assert ev[-1] == "[DONE]" and "error" in json.loads(ev[-2]), ev
        assert json.loads(ev[0])["choices"][0]["text"].startswith("gen-"), ev
    finally:
        r.stop()


@case("streams")
def client_disconnect_cancels_legs():
    reset(("gen0", "slow_stream", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        c = r.conn()
        c.request("POST", "/v1/completions", json.dumps({"prompt": "p", "stream": True}))
        resp = c.getresponse()
        assert resp.status == 200
        resp.fp.readline()  # the first bytes of the stream
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        wait_for(lambda: any(e["event"] == "client_closed" for e in fake_log(W["gen0"])["events"]),
                 10, "the generation worker to see its connection closed")
        wait_for(lambda: r.metric("kvserve_router_requests_in_flight") == 0, 5, "in-flight 0")
        # non-stream, while the context leg is running
        fake_mode(W["ctx0"], "stall")
        fake_mode(W["gen0"], "normal")
        c = r.conn()
        c.request("POST", "/v1/completions", json.dumps({"prompt": "p"}))
        wait_for(lambda: len(legs(W["ctx0"], "/v1/completions")) == 1, 5, "the context leg")
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        wait_for(lambda: any(e["event"] == "client_closed" for e in fake_log(W["ctx0"])["events"]),
                 10, "the context worker to see its connection closed")
        assert legs(W["gen0"], "/v1/completions") == []
        wait_for(lambda: r.metric('kvserve_router_requests_total{outcome="cancelled"}') == 2, 5, "cancelled 2")
    finally:
        r.stop()


@case("streams")
def slow_client_backpressure():
    reset(("gen0", "slow_stream", {}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        st, ct, data = r.post("/v1/completions", {"prompt": "p", "stream": True})
        ev = sse_events(data)
        assert st == 200 and len(ev) == 51 and ev[-1] == "[DONE]", (st, len(ev))
    finally:
        r.stop()


@case("streams")
def slow_client_backpressure_pauses_upstream():
    # 1000 events of 64 KiB (64 MiB): a client that stops reading must stall the worker
    # (the router pauses the upstream transfer) instead of the router buffering it all
    reset(("gen0", "big_stream", {"events": 1000, "event_bytes": 65536}))
    r = Router(["--context", W["ctx0"], "--generation", W["gen0"]])
    try:
        c = r.conn(timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "p", "stream": True}))
        resp = c.getresponse()
        assert resp.status == 200
        head = resp.read(100)
        last = [-1, time.time()]

        def settled():  # the worker's progress stopped for 0.5 s
            w = fake_log(W["gen0"])["written"]
            if w != last[0]:
                last[0], last[1] = w, time.time()
                return False
            return time.time() - last[1] > 0.5
        wait_for(settled, 30, "the worker to stall behind the slow client")
        total = 1000 * 65536
        assert last[0] < total // 2, "the worker wrote %d of %d bytes to a client that reads nothing" % (
            last[0], total)
        print("     worker stalled after %.1f MiB of %.1f MiB" % (last[0] / 2**20, total / 2**20))
        data = head + resp.read()
        ev = sse_events(data)
        assert ev[-1] == "[DONE]" and len(ev) == 1001, len(ev)
        assert len(data) > total, len(data)
        c.close()
    finally:
        r.stop()


def main():
    groups = [g for g in sys.argv[1:] if not g.startswith("-k=")] or ["all"]
    only = [g[3:] for g in sys.argv[1:] if g.startswith("-k=")]
    if not os.access(BIN, os.X_OK):
        print("FAIL: kvserve binary not found at %s" % BIN)
        return 1
    try:
        for name, role in (("ctx0", "context"), ("gen0", "generation"), ("gen1", "generation"),
                           ("agg0", "aggregated"), ("agg1", "aggregated")):
            W[name] = start_fake(name, role)
        for g, fns in CASES.items():
            if "all" not in groups and g not in groups:
                continue
            for fn in fns:
                if only and fn.__name__ not in only:
                    continue
                t0 = time.time()
                try:
                    fn()
                    print("ok   %s (%.2f s)" % (fn.__name__, time.time() - t0), flush=True)
                except Exception as e:  # noqa: BLE001 - report every failing case
                    FAILS.append(fn.__name__)
                    import traceback
                    print("FAIL %s: %r\n%s" % (fn.__name__, e, traceback.format_exc(limit=-1)),
                          flush=True)
    finally:
        for p in PROCS:
            p.terminate()
        for p in PROCS:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
    if FAILS:
        with open(os.path.join(TMP, "router.log")) as f:
            print("---- router log (tail) ----\n" + "".join(f.readlines()[-40:]))
        print("FAILED: %s" % ", ".join(FAILS))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
