#!/usr/bin/env python3
"""A CUDA fault fails the affected requests with a 500 error and the server keeps serving
(issue 10 acceptance), for a GPU machine.

    fault_serve.py KVSERVE MODEL [extra serve args...]

Starts `KVSERVE serve --backend cuda --model MODEL ...` with KVSERVE_CUDA_FAULT=forward:3,8
(backend_cuda.h: those forward calls fail as if their stream sync had reported
cudaErrorLaunchFailure). The server runs no forward before the first request, and each
request below runs alone, so the forward numbers are known:
  A  non-stream completion "Once upon a time", 8 tokens: forwards 1 (prefill), 2, 3 -> fails
     at 3: status 500, OpenAI error JSON (type server_error, message naming the injection);
  B  streaming completion, 16 tokens: forwards 4 .. 8 -> fails at 8 after 4 deltas: status
     200, the deltas, then an SSE `error` event and [DONE];
  C  the same request as A again (forwards 9..): status 200, the same text as a healthy
     server gives (D, a second server without the variable, same model and flags);
and after them: the server process is alive, /health is 200, /metrics shows no KV block in
use and no running or waiting request, kvserve_http_responses_5xx_total counts A.
Then a third server with KVSERVE_CUDA_FAULT=sticky:3 (forward 3 starts with a kernel that
traps: a real sticky error, the CUDA context is unusable afterwards):
  E  request A: status 500 (server_error JSON);
  F  /health: 503 with an error JSON (code backend_unhealthy) naming the sticky error;
  G  a new request: 503 backend_unhealthy at once (not queued, not computed);
  and the process stays up, no KV block is left in use, and it exits 0 on SIGTERM.
Exit 0 when every check passes, 1 otherwise, 2 when a server did not start.
"""
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time

checks = []


def check(cond, what):
    checks.append((bool(cond), what))
    print(("ok   " if cond else "FAIL ") + what, flush=True)


def start(kvserve, model, extra, env):
    pf = tempfile.mktemp()
    log = open(tempfile.mktemp(suffix=".log"), "w+")
    p = subprocess.Popen([kvserve, "serve", "--backend", "cuda", "--model", model, "--port", "0", "--port-file", pf]
                         + extra, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 60
    while not (os.path.exists(pf) and os.path.getsize(pf) > 0):
        if p.poll() is not None or time.time() > deadline:
            log.seek(0)
            print("fault_serve: server did not start:\n" + log.read()[-2000:], file=sys.stderr)
            return None, None, log
        time.sleep(0.05)
    return p, int(open(pf).read().strip()), log


def post(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    return r.status, data


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    return r.status, data


def metrics(port):
    out = {}
    for line in get(port, "/metrics")[1].splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, val = line.rsplit(" ", 1)
        out[name.split("{")[0]] = float(val)
    return out


def error_of(body):
    """The "error" object of an OpenAI error JSON body, or {}."""
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return {}


def stop(p):
    p.terminate()
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    kvserve, model, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    A = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    B = {"prompt": "The little dog", "max_tokens": 16, "temperature": 0, "stream": True}
    env = dict(os.environ)
    env.pop("KVSERVE_CUDA_FAULT", None)
    ref, port, log = start(kvserve, model, extra, env)
    if not ref:
        return 2
    try:
        st, d = post(port, A)
        healthy = json.loads(d)["choices"][0]["text"] if st == 200 else None
        check(st == 200, "D: healthy server answers A (%s)" % st)
    finally:
        stop(ref)
    env["KVSERVE_CUDA_FAULT"] = "forward:3,8"
    p, port, log = start(kvserve, model, extra, env)
    if not p:
        return 2
    try:
        st, d = post(port, A)
        e = error_of(d)
        check(st == 500 and e.get("type") == "server_error" and "KVSERVE_CUDA_FAULT" in e.get("message", ""),
              "A: status 500 with an OpenAI error JSON naming the fault (%s %s)" % (st, d[:300]))
        st, d = post(port, B)
        events = [b[len("data: "):] for b in d.split("\n\n") if b.startswith("data: ")]
        deltas = [json.loads(x) for x in events if x != "[DONE]" and "choices" in json.loads(x)]
        errs = [json.loads(x)["error"] for x in events if x != "[DONE]" and "error" in json.loads(x)]
        check(st == 200 and len(deltas) >= 1 and len(errs) == 1 and events[-1] == "[DONE]"
              and "KVSERVE_CUDA_FAULT" in errs[0].get("message", ""),
              "B: stream of %d deltas, then one error event and [DONE] (%s)" % (len(deltas), d[-300:]))
        st, d = post(port, A)
        text = json.loads(d)["choices"][0]["text"] if st == 200 else None
        check(st == 200 and text == healthy, "C: after the faults A answers 200 with the healthy text (%r vs %r)"
              % (text, healthy))
        check(p.poll() is None, "server process alive")
        check(get(port, "/health")[0] == 200, "/health 200")
        m = metrics(port)
        check(m.get("kvserve_kv_blocks_used") == 0 and m.get("kvserve_num_requests_running") == 0
              and m.get("kvserve_num_requests_waiting") == 0,
              "no KV block in use, no running / waiting request (%s %s %s)" % (
                  m.get("kvserve_kv_blocks_used"), m.get("kvserve_num_requests_running"),
                  m.get("kvserve_num_requests_waiting")))
        check(m.get("kvserve_http_responses_5xx_total", 0) >= 1,
              "kvserve_http_responses_5xx_total counts A (%s)" % m.get("kvserve_http_responses_5xx_total"))
        log.seek(0)
        txt = log.read()
        check(txt.count("injected by KVSERVE_CUDA_FAULT") >= 2, "server log names both injected faults")
    finally:
        stop(p)
        check(p.returncode == 0, "server exits 0 on SIGTERM (%s)" % p.returncode)
    env["KVSERVE_CUDA_FAULT"] = "sticky:3"
    p, port, log = start(kvserve, model, extra, env)
    if not p:
        return 2
    try:
        st, d = post(port, A)
        check(st == 500 and '"server_error"' in d, "E: sticky fault: A gets 500 server_error (%s %s)" % (st, d[:300]))
        st, d = get(port, "/health")
        e = error_of(d)
        check(st == 503 and e.get("code") == "backend_unhealthy" and "unusable" in e.get("message", ""),
              "F: /health 503 backend_unhealthy (%s %s)" % (st, d[:300]))
        t0 = time.time()
        st, d = post(port, A)
        check(st == 503 and "backend_unhealthy" in d and time.time() - t0 < 5,
              "G: a new request is refused with 503 backend_unhealthy (%s %s)" % (st, d[:200]))
        check(p.poll() is None, "server process alive after the sticky fault")
        m = metrics(port)
        check(m.get("kvserve_kv_blocks_used") == 0 and m.get("kvserve_num_requests_running") == 0,
              "sticky: no KV block in use, no running request (%s %s)" % (
                  m.get("kvserve_kv_blocks_used"), m.get("kvserve_num_requests_running")))
    finally:
        stop(p)
        check(p.returncode == 0, "sticky: server exits 0 on SIGTERM (%s)" % p.returncode)
    bad = [w for ok, w in checks if not ok]
    print("fault_serve: %d/%d checks pass" % (len(checks) - len(bad), len(checks)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
