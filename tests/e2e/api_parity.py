#!/usr/bin/python3
"""End-to-end test of the OpenAI/vLLM parity features of `kvserve serve` (issue 12) on stories260K.

Groups (run all, or name some on the command line):
  choices   n > 1: choice i of (n, seed s) == the request alone with n = 1 and seed s + i
            (text and logprobs, bitwise), also under concurrent load; streamed choices by index
            == non-stream; usage sums the choices
  sampling  logit_bias (banning the greedy token changes it, +100 forces one), stop_token_ids,
            min_tokens, priority, and their 400s
  chat      text parts joined with "\\n", continue_final_message (== the completion of the cut
            prompt) and its conflict with add_generation_prompt, the final chunk's delta {},
            logprobs with top_logprobs 0, a user message without content, logprobs 0 of
            completions
  models    --served-model-name a b: /v1/models lists both, GET /v1/models/{id}, both accepted,
            the first reported; the default names (GGUF general.name, the HF directory's)
  access    --api-key / KVSERVE_API_KEY: 401 OpenAI error JSON on every route but /health,
            /ready, /metrics; CORS (--allowed-origins): preflights, headers on answers and 401s
  metrics   vllm:* gauges and counters, latency histograms (consistent buckets, counts),
            prefix-cache queries/hits against usage.cached_tokens
  drain     SIGTERM with requests queued: /ready 503, /health 200, new requests 503 with
            Retry-After; in-flight requests finish until --shutdown-timeout, the rest get 503
            (streams: an error event and [DONE]); never finish_reason "cancelled"; exit 0
env: KVSERVE_BIN, KVSERVE_TEST_DATA. Exit 0 = all passed, 77 = skipped (data missing).
"""
import concurrent.futures
import http.client
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import http_api as H  # noqa: E402  (Server, check)
from e2e_util import parse_metrics, wait_for  # noqa: E402

check = H.check
P = "/v1/completions"
C = "/v1/chat/completions"


def ids_of(choice):
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def post(s, path, body, headers=None):
    return s.post(path, body, headers=headers)


# ---------------------------------------------------------------- choices

def test_choices(s):
    prompt = "Once upon a time, there was a little"
    base = {"prompt": prompt, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "logprobs": 3,
            "return_tokens_as_token_ids": True}
    st, multi, _ = post(s, P, dict(base, n=4, seed=123))
    check(st == 200 and len(multi["choices"]) == 4, "n=4: 4 choices (%s)" % st)
    if st != 200:
        return
    check([c["index"] for c in multi["choices"]] == [0, 1, 2, 3], "n=4: indexes 0..3")
    alone = []
    for i in range(4):
        st, a, _ = post(s, P, dict(base, seed=123 + i))
        alone.append(a["choices"][0])
    for i in range(4):
        got, want = multi["choices"][i], alone[i]
        check(got["text"] == want["text"] and got["logprobs"] == want["logprobs"]
              and got["finish_reason"] == want["finish_reason"],
              "n=4 choice %d == alone with seed 123+%d (%r vs %r)" % (i, i, got["text"], want["text"]))
    check(len(set(c["text"] for c in multi["choices"])) > 1, "the choices differ from each other")
    check(multi["usage"]["completion_tokens"] == sum(len(ids_of(c)) for c in multi["choices"])
          and multi["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"],
          "n=4: usage.completion_tokens sums the choices, prompt_tokens once (%s)" % multi["usage"])
    # under load: the same n=4 request among 8 concurrent others equals the first answer
    def one(k):
        if k == 0:
            return post(s, P, dict(base, n=4, seed=123))[1]
        return post(s, P, {"prompt": prompt + " %d" % k, "max_tokens": 30, "temperature": 0.7, "seed": k})[1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=9) as ex:
        res = list(ex.map(one, range(9)))
    check([c["text"] for c in res[0]["choices"]] == [c["text"] for c in multi["choices"]],
          "n=4 under concurrent load == alone")
    # stream: chunks by index; each index's deltas == the non-stream choice; one finish each
    st, ev, _ = s.stream(P, dict(base, n=4, seed=123, stream=True, stream_options={"include_usage": True}))
    texts, fins = ["" for _ in range(4)], [[] for _ in range(4)]
    for e in ev[:-1]:
        for c in e.get("choices", []):
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                fins[c["index"]].append(c["finish_reason"])
    check(st == 200 and ev[-1] == "[DONE]" and texts == [c["text"] for c in multi["choices"]]
          and all(len(f) == 1 for f in fins), "n=4 stream == non-stream per index (%s)" % texts)
    check(ev[-2].get("usage", {}).get("completion_tokens") == multi["usage"]["completion_tokens"],
          "n=4 stream usage chunk sums the choices")
    # chat n=2, streamed: a role chunk per index, then content, a delta {} finish per index
    msgs = [{"role": "user", "content": "Tell me a story"}]
    st, full, _ = post(s, C, {"messages": msgs, "max_tokens": 16, "n": 2, "seed": 9, "temperature": 1.0})
    st2, ev, _ = s.stream(C, {"messages": msgs, "max_tokens": 16, "n": 2, "seed": 9, "temperature": 1.0, "stream": True})
    roles, texts = [0, 0], ["", ""]
    for e in ev[:-1]:
        for c in e["choices"]:
            if c["delta"].get("role"):
                roles[c["index"]] += 1
            texts[c["index"]] += c["delta"].get("content") or ""
    check(st == 200 and st2 == 200 and roles == [1, 1]
          and texts == [c["message"]["content"] for c in full["choices"]],
          "chat n=2 stream == non-stream, one role chunk per choice")
    check(post(s, P, {"prompt": "a", "n": 129})[0] == 400, "n=129 -> 400")


# ---------------------------------------------------------------- sampling

def test_sampling(s):
    g = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "logprobs": 1,
         "return_tokens_as_token_ids": True}
    st, base, _ = post(s, P, g)
    ids = ids_of(base["choices"][0])
    st, r, _ = post(s, P, dict(g, logit_bias={str(ids[0]): -100}))
    check(st == 200 and ids_of(r["choices"][0])[0] != ids[0], "logit_bias -100 bans the greedy token")
    st, r, _ = post(s, P, dict(g, logit_bias={"300": 100}))
    check(st == 200 and set(ids_of(r["choices"][0])) == {300}, "logit_bias +100 forces a token")
    for bad in ({"512": 1}, {"5": 101}, {"x": 1}, [1]):
        st, r, _ = post(s, P, dict(g, logit_bias=bad))
        check(st == 400 and r["error"]["param"] == "logit_bias", "logit_bias %s -> 400" % (bad,))
    # token 3 is <0x00>: its text U+0000 goes out as \u0000, streamed, not streamed and through
    # the tool-call parser (which re-reads the answer; so does a context worker, tests/e2e/disagg.py)
    nul = {"max_tokens": 3, "temperature": 0, "logit_bias": {"3": 100}}
    st, r, _ = post(s, P, dict(nul, prompt="Once upon a time"))
    check(st == 200 and r["choices"][0]["text"] == "\x00" * 3, "U+0000 text, not streamed (%s)" % str(r)[:200])
    st, ev, _ = s.stream(P, dict(nul, prompt="Once upon a time", stream=True))
    check(st == 200 and "".join(c["text"] for e in ev[:-1] for c in e["choices"]) == "\x00" * 3,
          "U+0000 text, streamed")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    st, r, _ = post(s, C, dict(nul, messages=[{"role": "user", "content": "Hi"}], tools=[tool]))
    check(st == 200 and r["choices"][0]["message"]["content"] == "\x00" * 3,
          "U+0000 text through the tool-call parser (%s %s)" % (st, str(r)[:200]))
    st, r, _ = post(s, P, dict(nul, prompt="a\x00b"))
    check(st == 400 and "U+0000" in r["error"]["message"], "a prompt holding U+0000: 400 naming it (%s)" % str(r)[:200])
    t = ids[8]
    k = ids.index(t)
    st, r, _ = post(s, P, dict(g, stop_token_ids=[t]))
    got = ids_of(r["choices"][0])
    check(st == 200 and got == ids[:k + 1] and r["choices"][0]["finish_reason"] == "stop",
          "stop_token_ids ends at the first %d (kept in the output)" % t)
    st, r, _ = post(s, P, dict(g, stop_token_ids=[t], min_tokens=k + 2))
    got = ids_of(r["choices"][0])
    check(st == 200 and len(got) >= k + 2 and t not in got[:k + 2],
          "min_tokens holds stop_token_ids back (%s)" % got)
    st, r, _ = post(s, P, dict(g, min_tokens=21))
    check(st == 400 and r["error"]["param"] == "min_tokens", "min_tokens > max_tokens -> 400")
    st, r, _ = post(s, P, dict(g, stop_token_ids=[600]))
    check(st == 400 and r["error"]["param"] == "stop_token_ids", "stop_token_ids out of range -> 400")
    st, r, _ = post(s, P, dict(g, priority=-5))
    check(st == 200 and ids_of(r["choices"][0]) == ids, "priority accepted, output unchanged")
    st, r, _ = post(s, P, dict(g, priority="high"))
    check(st == 400 and r["error"]["param"] == "priority", "priority string -> 400")


# ---------------------------------------------------------------- chat details

def test_chat(s):
    u = lambda c: {"role": "user", "content": c}  # noqa: E731
    st, a, _ = post(s, "/tokenize", {"messages": [u([{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}])]})
    st2, b, _ = post(s, "/tokenize", {"messages": [u("Hi\nthere")]})
    check(st == 200 and a["tokens"] == b["tokens"], "text parts joined with \\n")
    st, r, _ = post(s, C, {"messages": [{"role": "user"}]})
    check(st == 400 and r["error"]["param"] == "messages[0].content", "user message without content -> 400")
    # continue_final_message: the ChatML fallback cut after the final message's content
    msgs = [u("Tell me a story"), {"role": "assistant", "content": "Once upon a time"}]
    st, cont, _ = post(s, "/tokenize", {"messages": msgs, "continue_final_message": True})
    text = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\nOnce upon a time"
    st2, want, _ = post(s, "/tokenize", {"prompt": text})
    check(st == 200 and cont["tokens"] == want["tokens"], "continue_final_message cuts after the final message")
    st, r1, _ = post(s, C, {"messages": msgs, "continue_final_message": True, "max_tokens": 12, "temperature": 0})
    st2, r2, _ = post(s, P, {"prompt": text, "max_tokens": 12, "temperature": 0})
    check(st == 200 and r1["choices"][0]["message"]["content"] == r2["choices"][0]["text"],
          "continue_final_message continues the message (%r)" % (r1.get("choices"),))
    st, r, _ = post(s, C, {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    check(st == 400 and r["error"]["param"] == "continue_final_message",
          "continue_final_message + add_generation_prompt -> 400")
    # stream: the final chunk carries delta {} and the finish reason
    st, ev, _ = s.stream(C, {"messages": [u("Hi")], "max_tokens": 5, "stream": True})
    last = ev[-2]["choices"][0]
    check(last["delta"] == {} and last["finish_reason"] in ("stop", "length")
          and all(e["choices"][0]["finish_reason"] is None for e in ev[:-2]),
          "final chat chunk: delta {} (%s)" % last)
    # logprobs true, top_logprobs 0: an entry per token with an empty top_logprobs list
    st, r, _ = post(s, C, {"messages": [u("Hi")], "max_tokens": 4, "logprobs": True, "top_logprobs": 0})
    lp = r["choices"][0]["logprobs"]["content"]
    check(st == 200 and len(lp) == 4 and all(set(e) >= {"token", "logprob", "bytes", "top_logprobs"}
                                              and e["top_logprobs"] == [] for e in lp),
          "chat logprobs with top_logprobs 0 (%s)" % lp[:1])
    # completions logprobs 0: each top_logprobs entry holds the sampled token
    st, r, _ = post(s, P, {"prompt": "Hi", "max_tokens": 4, "logprobs": 0})
    l = r["choices"][0]["logprobs"]
    check(st == 200 and all(len(d) == 1 and list(d.values())[0] == v
                            for d, v in zip(l["top_logprobs"], l["token_logprobs"])),
          "completions logprobs 0: top_logprobs hold the sampled token (%s)" % l["top_logprobs"][:2])


# ---------------------------------------------------------------- models

def test_models():
    s = H.Server(H.GGUF, ["--served-model-name", "tiny-story", "alias-2"])
    try:
        st, hdrs, body = s.request("GET", "/v1/models")
        ids = [m["id"] for m in json.loads(body)["data"]]
        check(ids == ["tiny-story", "alias-2"], "/v1/models lists the served names (%s)" % ids)
        st, hdrs, body = s.request("GET", "/v1/models/alias-2")
        check(st == 200 and json.loads(body)["id"] == "alias-2", "GET /v1/models/alias-2")
        st, hdrs, body = s.request("GET", "/v1/models/nope")
        e = json.loads(body)["error"]
        check(st == 404 and e["code"] == "model_not_found", "GET /v1/models/nope -> 404 model_not_found")
        st, r, _ = s.post(P, {"prompt": "a", "max_tokens": 2, "model": "alias-2"})
        check(st == 200 and r["model"] == "tiny-story", "an alias is accepted; the first name is reported")
        st, r, _ = s.post(P, {"prompt": "a", "max_tokens": 2, "model": "stories260K"})
        check(st == 404, "the file name is not served once names are given")
    finally:
        s.stop()
    if os.path.isdir(H.HF):  # no name in config.json: the directory's parent (hf/ is generic)
        h = H.Server(H.HF)
        try:
            st, hdrs, body = h.request("GET", "/v1/models")
            check(json.loads(body)["data"][0]["id"] == "stories260K", "HF directory stories260K/hf is served as stories260K")
        finally:
            h.stop()


# ---------------------------------------------------------------- access

def test_access():
    env_key = "env-key-2"
    os.environ["KVSERVE_API_KEY"] = "env-key-1, " + env_key
    try:
        s = H.Server(H.GGUF, ["--api-key", "cli-key", "--allowed-origins", "https://app.example,https://b.example"])
    finally:
        del os.environ["KVSERVE_API_KEY"]
    # a KVSERVE_API_KEY of commas and blanks only ("${K1},${K2}" with both unset) holds no key:
    # refused at start, never a server left open
    import subprocess
    p = subprocess.run([H.BIN, "serve", "--model", H.GGUF, "--port", "0"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, KVSERVE_API_KEY=" , ,"))
    check(p.returncode == 2 and "KVSERVE_API_KEY" in p.stderr,
          "KVSERVE_API_KEY without a key: exit %d, %r" % (p.returncode, p.stderr[-200:]))
    try:
        auth = lambda k: {"Authorization": "Bearer " + k}  # noqa: E731
        routes = [("GET", "/v1/models", None), ("GET", "/v1/models/stories260K", None),
                  ("POST", P, {"prompt": "a", "max_tokens": 1}),
                  ("POST", C, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
                  ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [5]}),
                  ("GET", "/server_info", None), ("GET", "/kv_events?poll=1", None),
                  ("POST", "/kv_probe", {"prompt": "a"})]
        for method, path, body in routes:
            raw = json.dumps(body).encode() if body is not None else None
            st, hdrs, payload = s.request(method, path, raw=raw)
            e = json.loads(payload).get("error", {})
            check(st == 401 and e.get("code") == "invalid_api_key" and e.get("type") == "invalid_request_error"
                  and "www-authenticate" in {k.lower() for k, _ in hdrs},
                  "%s %s without a key -> 401 (%s %s)" % (method, path, st, payload[:120]))
            st, _, payload = s.request(method, path, raw=raw, headers=auth("wrong"))
            check(st == 401, "%s %s with a wrong key -> 401" % (method, path))
            for k in ("cli-key", env_key):
                st, _, payload = s.request(method, path, raw=raw, headers=auth(k))
                check(st == 200, "%s %s with key %s -> 200 (%s %s)" % (method, path, k, st, payload[:120]))
        for path in ("/health", "/ready", "/metrics"):
            st, _, _ = s.request("GET", path)
            check(st == 200, "%s needs no key" % path)
        # CORS: a preflight is answered without credentials
        pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang"}
        st, hdrs, _ = s.request("OPTIONS", C, headers=pre)
        h = {k.lower(): v for k, v in hdrs}
        check(st == 200 and h.get("access-control-allow-origin") == "https://app.example"
              and "POST" in h.get("access-control-allow-methods", "")
              and "x-stainless-lang" in h.get("access-control-allow-headers", ""),
              "CORS preflight from an allowed origin -> 200 (%s %s)" % (st, h))
        st, _, payload = s.request("OPTIONS", C, headers=dict(pre, Origin="https://evil.example"))
        check(st == 403 and json.loads(payload)["error"]["code"] == "cors_origin_not_allowed",
              "CORS preflight from another origin -> 403")
        st, hdrs, _ = s.request("POST", P, raw=b'{"prompt":"a","max_tokens":1}',
                                headers=dict(auth("cli-key"), Origin="https://b.example"))
        h = {k.lower(): v for k, v in hdrs}
        check(st == 200 and h.get("access-control-allow-origin") == "https://b.example",
              "an allowed origin's request carries Access-Control-Allow-Origin")
        st, hdrs, _ = s.request("GET", "/v1/models", headers={"Origin": "https://app.example"})
        h = {k.lower(): v for k, v in hdrs}
        check(st == 401 and h.get("access-control-allow-origin") == "https://app.example",
              "a 401 carries the CORS headers (the browser can read the error)")
        st, hdrs, _ = s.request("GET", "/v1/models", headers=dict(auth("cli-key"), Origin="https://evil.example"))
        check(st == 200 and "access-control-allow-origin" not in {k.lower() for k, _ in hdrs},
              "no CORS headers for another origin")
        st, hdrs, _ = s.request("OPTIONS", "/v1/models")
        check(st == 204 and any(k.lower() == "allow" for k, _ in hdrs), "a plain OPTIONS -> 204 with Allow")
        test_router_key(s)
    finally:
        s.stop()


def test_router_key(s):
    """kvserve router --worker-api-key: every request to the worker (health checks included)
    carries the key; without it the worker answers 401 and never becomes live."""
    import subprocess
    import tempfile
    from e2e_util import read_port
    url = "http://127.0.0.1:%d" % s.port
    for key in ("cli-key", None):
        tmp = tempfile.mkdtemp(prefix="kvserve-rt-key-")
        pf = os.path.join(tmp, "port")
        env = dict(os.environ)
        env.pop("KVSERVE_WORKER_API_KEY", None)
        if key:
            env["KVSERVE_WORKER_API_KEY"] = key
        p = subprocess.Popen([H.BIN, "router", "--port", "0", "--port-file", pf, "--workers", url,
                              "--health-interval", "0.2"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        try:
            port = read_port(pf, p)
            def ask():
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                c.request("POST", P, body=json.dumps({"prompt": "Once", "max_tokens": 2}),
                          headers={"Content-Type": "application/json"})
                r = c.getresponse()
                st = r.status
                r.read()
                c.close()
                return st
            if key:
                check(ask() == 200, "router with KVSERVE_WORKER_API_KEY reaches a keyed worker")
            else:
                wait_for(lambda: ask() != 200, 10, "the worker refused without the key")
                check(ask() in (401, 502, 503), "router without the worker's key is refused")
        finally:
            p.terminate()
            p.wait(10)


# ---------------------------------------------------------------- metrics

def test_metrics(s):
    prompt = "Once upon a time, there was a little girl named Lily. " * 4
    usage = []
    for _ in range(2):
        st, r, _ = post(s, P, {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        usage.append(r["usage"])
    st, ev, _ = s.stream(P, {"prompt": "Lily", "max_tokens": 8, "stream": True})
    st, _, payload = s.request("GET", "/metrics")
    m = parse_metrics(payload.decode())
    lab = '{model_name="stories260K"}'
    for g in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        check(g + lab in m, "metric %s present" % g)
    check(m.get("vllm:kv_cache_usage_perc" + lab, -1) == m.get("kvserve_kv_cache_usage_ratio" + lab),
          "vllm:kv_cache_usage_perc == kvserve_kv_cache_usage_ratio")
    check(m.get("vllm:prompt_tokens_total" + lab) == m.get("kvserve_prompt_tokens_total" + lab),
          "vllm:prompt_tokens_total == kvserve_prompt_tokens_total")
    check(usage[1]["prompt_tokens_details"]["cached_tokens"] > 0 and
          m.get("vllm:prefix_cache_hits_total" + lab, 0) >= usage[1]["prompt_tokens_details"]["cached_tokens"],
          "prefix cache hits count the cached tokens (%s)" % usage[1])
    check(any(k.startswith("vllm:cache_config_info{") and 'block_size="16"' in k for k in m),
          "vllm:cache_config_info with block_size")
    for prefix in ("vllm:", "kvserve_"):
        for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                  "e2e_request_latency_seconds", "request_queue_time_seconds"):
            name = prefix + h
            buckets = sorted(((float(k.split('le="')[1].split('"')[0]), v) for k, v in m.items()
                              if k.startswith(name + "_bucket{")), key=lambda x: x[0])
            cnt = m.get(name + "_count" + lab, -1)
            ok = buckets and buckets[-1][0] == float("inf") and buckets[-1][1] == cnt and cnt >= 3 \
                and all(buckets[i][1] <= buckets[i + 1][1] for i in range(len(buckets) - 1)) \
                and m.get(name + "_sum" + lab, -1) > 0
            check(ok, "histogram %s: cumulative buckets, +Inf == count (%s) >= 3, sum > 0" % (name, cnt))
    check(m.get('vllm:request_success_total{model_name="stories260K",finished_reason="length"}', 0) >= 3,
          "vllm:request_success_total counts finished requests")


# ---------------------------------------------------------------- drain

def raw_request(port, path, body, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict((k.lower(), v) for k, v in r.getheaders()), data


def test_drain():
    # one request at a time (--max-batch-size 1). The drain time is sized from one request's
    # duration on this machine (sanitizer builds are ~15x slower): the request running at
    # SIGTERM finishes within it, the queue behind it does not.
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    s = H.Server(H.GGUF, ["--max-batch-size", "1"])
    try:
        one = 1e9
        for _ in range(3):  # the fastest of 3 (the first one pays for warm-up)
            t0 = time.time()
            raw_request(s.port, P, body)
            one = min(one, time.time() - t0)
    finally:
        s.stop()
    timeout = max(1, int(4 * one + 0.999))
    n = max(24, min(200, int(10 * timeout / max(one, 1e-3))))
    print("  drain: one request %.2fs, --shutdown-timeout %d, %d requests" % (one, timeout, n), flush=True)
    s = H.Server(H.GGUF, ["--max-batch-size", "1", "--shutdown-timeout", str(timeout)])
    results = [None] * n
    bodies = [dict(body, prompt="Once upon a time %d" % i, stream=i % 3 == 0) for i in range(n)]

    def run(i):
        results[i] = raw_request(s.port, P, bodies[i]) + (time.time(),)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: s.metrics().get("kvserve_requests_total", 0) >= n, 60, "every request accepted")
        t_term = time.time()
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: s.request("GET", "/ready")[0] == 503, 10, "/ready 503 while draining")
        st, _, body = s.request("GET", "/health")
        check(st == 200 and json.loads(body)["status"] == "draining", "/health stays 200 while draining (%s)" % body)
        st, hdrs, body = raw_request(s.port, P, {"prompt": "late", "max_tokens": 2})
        check(st == 503 and hdrs.get("retry-after") and json.loads(body)["error"]["code"] == "shutting_down",
              "a new request while draining -> 503 with Retry-After (%s)" % body[:120])
        for t in threads:
            t.join(timeout + 60)
        rc = s.proc.wait(30)
        check(rc == 0, "exit 0 after the drain (rc %s)" % rc)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    done = failed = after = 0
    for i, (st, hdrs, body, t_end) in enumerate(results):
        text = body.decode()
        check("cancelled" not in text, "request %d: no finish_reason cancelled" % i)
        if not bodies[i]["stream"]:
            if st == 200:
                done += json.loads(body)["choices"][0]["finish_reason"] == "length"
                after += t_end > t_term
            else:
                e = json.loads(body).get("error", {})
                ok = st == 503 and hdrs.get("retry-after") and e.get("type") == "server_error"
                check(ok, "request %d: 503 error JSON with Retry-After (%s %s)" % (i, st, text[:160]))
                failed += 1
        elif st == 503:  # (a stream refused before it started is an ordinary 503)
            e = json.loads(body).get("error", {})
            check(hdrs.get("retry-after") and e.get("code") == "shutting_down", "stream %d: 503 (%s)" % (i, text[:160]))
            failed += 1
        else:
            events = [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]
            check(st == 200 and events and events[-1] == "[DONE]", "stream %d ends with [DONE]" % i)
            if len(events) >= 2 and '"error"' in events[-2]:
                check(json.loads(events[-2])["error"]["code"] == "shutting_down", "stream %d: error event" % i)
                failed += 1
            else:
                done += 1
                after += t_end > t_term
    check(after >= 1 and failed >= 1, "drain: %d finished (%d after SIGTERM), %d failed with 503 (want both)"
          % (done, after, failed))
    print("  drain: %d finished (%d after SIGTERM), %d failed with 503" % (done, after, failed), flush=True)


def main():
    if not os.path.exists(H.GGUF):
        print("SKIP: test data %s not found (set KVSERVE_TEST_DATA)" % H.GGUF)
        return 77
    only = set(sys.argv[1:])
    shared = [("choices", test_choices), ("sampling", test_sampling), ("chat", test_chat),
              ("metrics", test_metrics)]
    alone = [("models", test_models), ("access", test_access), ("drain", test_drain)]
    s = H.Server(H.GGUF) if any(not only or n in only for n, _ in shared) else None
    try:
        for name, fn in shared + alone:
            if only and name not in only:
                continue
            t0 = time.time()
            before = len(H.failures)
            try:
                fn(s) if (name, fn) in shared else fn()
            except Exception as e:  # a crash of one group must not hide the others
                check(False, "%s raised %r" % (name, e))
            print("%-10s %s (%.1fs)" % (name, "ok" if len(H.failures) == before else "FAILED", time.time() - t0), flush=True)
    finally:
        if s:
            s.stop()
    print("%d checks passed, %d failed" % (H.passed, len(H.failures)))
    return 1 if H.failures else 0


if __name__ == "__main__":
    sys.exit(main())
