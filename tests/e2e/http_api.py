#!/usr/bin/python3
"""End-to-end test of `kvserve serve` (the OpenAI-compatible HTTP API) on stories260K.

Starts real server processes and checks, against llama.cpp's reference outputs:
greedy /v1/completions (text + token ids + top logprobs), /tokenize, streaming == non-stream,
chat, the HF checkpoint, a bad-input suite (status + OpenAI error JSON, then a normal request
still works), random client disconnects (KV blocks all freed afterwards), and 32 concurrent
requests == the same requests one at a time. Python stdlib only.

env: KVSERVE_BIN, KVSERVE_TEST_DATA. Exit 0 = all passed, 77 = skipped (data missing).
KVSERVE_E2E_TOL=bf16 (scripts/gpu-test.sh sets it for `--backend cuda` with bf16 weights):
the greedy comparisons with llama.cpp's fp32 tokens (completions, chat, the HF checkpoint)
accept a divergence at a near-tie. The tokens must equal the reference up to the first
difference at position i, and there the reference's token must be in the server's own top-5
with a log-probability at most BF16_NATS (0.1) below the token the server chose (its argmax):
bf16 weights and activations move logits by ~1e-2 of their norm (docs/benchmarks.md, CUDA
section), enough to flip a near-tie; every later token follows a different prefix and is not
compared. Top-5 logprobs (where the reference has them) are compared before position i only,
within BF16_NATS instead of 2e-3. 0.1 nats is 1.6x the largest difference seen on the H200
(0.063 nats; near-tie margins 0.003-0.027; docs/benchmarks.md). Each divergence is printed with its margin.
32 concurrent == sequential: with this tolerance the two runs may part at a near-tie too (the same rule,
against the concurrent run's own top-5): the CUDA backend's default mode is not batch-invariant (cuBLAS
kernels by row count; a prompt's last row runs the decode attention kernel when the rest of the prompt
came from the prefix cache, the prefill one otherwise). Everything else (stream == non-stream, the
bad-input suite, disconnects) stays exact; the chat stream is compared with the same server's non-stream
chat instead of llama.cpp.
"""
import concurrent.futures
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

BIN = os.environ.get("KVSERVE_BIN", "build/kvserve")
DATA = os.environ.get("KVSERVE_TEST_DATA", os.path.join(os.path.dirname(__file__), "../../../shared/data"))
GGUF = os.path.join(DATA, "models/stories260K/stories260K.gguf")
HF = os.path.join(DATA, "models/stories260K/hf")
REF = os.path.join(DATA, "references/stories260K")

failures = []
passed = 0
TOL = os.environ.get("KVSERVE_E2E_TOL", "")  # "" (exact) or "bf16"
BF16_NATS = 0.1  # bf16 tolerance on log-probabilities and near-ties (docstring)


def tol_match(label, got_ids, got_top, ref_ids):
    """Greedy ids against a reference: exact, or (TOL=bf16) equal up to a near-tie.
    got_top[i]: {token id: logprob} of the server's top alternatives at position i.
    Returns (ok, message)."""
    if got_ids == ref_ids:
        return True, "identical"
    if TOL != "bf16":
        return False, "got %s want %s" % (got_ids, ref_ids)
    i = next((k for k in range(min(len(got_ids), len(ref_ids))) if got_ids[k] != ref_ids[k]),
             min(len(got_ids), len(ref_ids)))
    if i >= len(got_ids) or i >= len(ref_ids) or got_top is None or i >= len(got_top):
        return False, "length differs at %d (got %d ids, want %d)" % (i, len(got_ids), len(ref_ids))
    top = got_top[i]
    mine, theirs = top.get(got_ids[i]), top.get(ref_ids[i])
    if mine is None or theirs is None:
        return False, "first difference at token %d: %d vs reference %d, not in the server's top-%d" % (
            i, got_ids[i], ref_ids[i], len(top))
    margin = mine - theirs
    msg = "first difference at token %d of %d: %d vs reference %d, margin %.4f nats (tie limit %.2f)" % (
        i, len(ref_ids), got_ids[i], ref_ids[i], margin, BF16_NATS)
    print("  bf16 tolerance: %s: %s" % (label, msg), flush=True)
    return margin <= BF16_NATS, msg


def completion_top(choice_logprobs):
    return [{int(k.split(":", 1)[1]): v for k, v in d.items()} for d in choice_logprobs["top_logprobs"]]


def chat_top(content_logprobs):
    return [{int(t["token"].split(":", 1)[1]): t["logprob"] for t in c["top_logprobs"]} for c in content_logprobs]


def check(cond, what):
    global passed
    if cond:
        passed += 1
    else:
        failures.append(what)
        print("FAIL:", what, flush=True)


class Server:
    def __init__(self, model, extra=(), preexec_fn=None):
        self.tmp = tempfile.mkdtemp(prefix="kvserve-e2e-")
        self.port_file = os.path.join(self.tmp, "port")
        self.log = open(os.path.join(self.tmp, "server.log"), "w+")
        wrap = os.environ.get("KVSERVE_E2E_WRAP", "").split()  # e.g. "gdb -batch -ex run -ex bt --args"
        self.proc = subprocess.Popen(
            wrap + [BIN, "serve", "--model", model, "--port", "0", "--port-file", self.port_file,
             "--max-model-len", "512", "--threads", "1", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
        deadline = time.time() + 60
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("server did not start:\n" + self.logtext())
            time.sleep(0.05)
        self.port = int(open(self.port_file).read())

    def logtext(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def request(self, method, path, body=None, raw=None, headers=None, timeout=120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        payload = r.read()
        c.close()
        return r.status, r.getheaders(), payload

    def post(self, path, body, **kw):
        st, hdrs, payload = self.request("POST", path, body, **kw)
        try:
            return st, json.loads(payload), dict(hdrs)
        except ValueError:
            return st, payload, dict(hdrs)

    def stream(self, path, body):
        """Returns (status, list of parsed data events, raw text)."""
        st, hdrs, payload = self.request("POST", path, body)
        text = payload.decode()
        events = []
        for block in text.split("\n\n"):
            if not block.strip():
                continue
            assert block.startswith("data: "), block
            d = block[len("data: "):]
            events.append(d if d == "[DONE]" else json.loads(d))
        return st, events, dict(hdrs)

    def metrics(self):
        st, _, payload = self.request("GET", "/metrics")
        out = {}
        for line in payload.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, val = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(val)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = "killed"
            check(rc == 0, "server exits 0 on SIGTERM (rc=%s)" % rc)


def greedy_records():
    with open(os.path.join(REF, "llamacpp_greedy.public.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def token_ids_of(choice_logprobs):
    return [int(t.split(":", 1)[1]) for t in choice_logprobs["tokens"]]


def test_basics(s):
    st, body, hdrs = s.post("/health", None) if False else (None, None, None)
    st, hdrs, payload = s.request("GET", "/health")
    check(st == 200 and json.loads(payload) == {"status": "ok"}, "GET /health")
    check(any(k.lower() == "x-kvserve-worker" for k, _ in hdrs), "X-Kvserve-Worker header")
    st, hdrs, payload = s.request("GET", "/v1/models")
    m = json.loads(payload)
    check(st == 200 and m["object"] == "list" and m["data"][0]["id"] == "stories260K",
          "GET /v1/models id (%s)" % payload[:200])
    m = s.metrics()
    check("kvserve_kv_blocks_total" in m and m["kvserve_kv_blocks_total"] > 0, "/metrics has kv blocks")


def test_greedy(s, label, check_logprobs=True):
    for r in greedy_records():
        body = {"model": "stories260K" if label == "gguf" else "", "prompt": r["prompt"],
                "max_tokens": 64, "temperature": 0, "logprobs": 5, "return_tokens_as_token_ids": True}
        if label != "gguf":
            body.pop("model")
        st, resp, _ = s.post("/v1/completions", body)
        ok = st == 200
        check(ok, "%s greedy %s: status %s %s" % (label, r["id"], st, str(resp)[:300]))
        if not ok:
            continue
        ch = resp["choices"][0]
        ids = token_ids_of(ch["logprobs"])
        same, msg = tol_match("%s greedy %s" % (label, r["id"]), ids, completion_top(ch["logprobs"]),
                              r["completion_ids"])
        check(same, "%s greedy %s ids: %s" % (label, r["id"], msg))
        check(ch["text"] == r["completion_text"] or (same and ids != r["completion_ids"]),
              "%s greedy %s text:\n got %r\nwant %r" % (label, r["id"], ch["text"], r["completion_text"]))
        check(ch["finish_reason"] == r["finish_reason"], "%s greedy %s finish_reason %s" % (label, r["id"], ch["finish_reason"]))
        u = resp["usage"]
        check(u["prompt_tokens"] == r["usage"]["prompt_tokens"] and u["completion_tokens"] == 64
              and u["total_tokens"] == u["prompt_tokens"] + 64
              and "cached_tokens" in u.get("prompt_tokens_details", {}),
              "%s greedy %s usage %s" % (label, r["id"], u))
        check(resp["object"] == "text_completion" and resp["id"].startswith("cmpl-"), "completion shape")
        st, tk, _ = s.post("/tokenize", {"prompt": r["prompt"]})
        check(st == 200 and tk["tokens"] == r["prompt_ids"] and tk["count"] == len(r["prompt_ids"])
              and tk["max_model_len"] == 512,
              "%s /tokenize %s: %s want %s" % (label, r["id"], tk, r["prompt_ids"]))
        if check_logprobs and "top_logprobs" in r:
            # exact mode: every position within 2e-3; bf16: the positions before the first
            # difference from the reference ids, within BF16_NATS (an alternative missing from
            # our top-5 must then be within BF16_NATS of our 5th: a tie at the boundary)
            lim = BF16_NATS if TOL == "bf16" else 2e-3
            n_cmp = next((k for k in range(min(len(ids), len(r["completion_ids"])))
                          if ids[k] != r["completion_ids"][k]), len(r["top_logprobs"])) if TOL else len(r["top_logprobs"])
            worst = 0.0
            for i, ref in enumerate(r["top_logprobs"][:n_cmp]):
                got = ch["logprobs"]["top_logprobs"][i]
                for alt in ref["top"]:
                    key = "token_id:%d" % alt["id"]
                    if key in got:
                        worst = max(worst, abs(got[key] - alt["logprob"]))
                    elif TOL == "bf16" and got:
                        worst = max(worst, max(0.0, alt["logprob"] - min(got.values())))
                    else:
                        worst = float("inf")
                worst = max(worst, abs(ch["logprobs"]["token_logprobs"][i] - ref["logprob"]))
            check(worst < lim, "%s top-5 logprobs of %s within %g (max diff %g over %d positions)" % (
                label, r["id"], lim, worst, n_cmp))
            if TOL:
                print("  bf16 tolerance: %s logprobs of %s: max diff %.4f over %d positions" % (
                    label, r["id"], worst, n_cmp), flush=True)
    # /detokenize round trip
    r = greedy_records()[1]
    st, d, _ = s.post("/detokenize", {"tokens": r["completion_ids"]})
    check(st == 200 and d["prompt"].strip() == r["completion_text"].strip(),
          "/detokenize: %r" % (d,))


def test_stream(s):
    for r in greedy_records()[:6]:
        base = {"prompt": r["prompt"], "max_tokens": 64, "temperature": 0}
        st, full, _ = s.post("/v1/completions", base)
        st2, events, hdrs = s.stream("/v1/completions", dict(base, stream=True, stream_options={"include_usage": True}))
        ok = st == 200 and st2 == 200 and events and events[-1] == "[DONE]"
        check(ok, "stream %s status/[DONE]" % r["id"])
        if not ok:
            continue
        check(hdrs.get("Content-Type", "").startswith("text/event-stream"), "SSE content type")
        chunks = [e for e in events[:-1] if e.get("choices")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        check(text == full["choices"][0]["text"], "stream %s: concatenated deltas == non-stream text" % r["id"])
        check(chunks[-1]["choices"][0]["finish_reason"] == "length"
              and all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]),
              "stream %s: only the last chunk has finish_reason" % r["id"])
        usage = events[-2]
        check(usage.get("choices") == [] and usage["usage"]["completion_tokens"] == 64,
              "stream %s: usage chunk %s" % (r["id"], usage))
    # chat streaming
    chat = json.load(open(os.path.join(REF, "llamacpp_chat.json")))["single_user"]
    st, events, _ = s.stream("/v1/chat/completions", {"messages": chat["messages"], "max_tokens": 64,
                                                      "temperature": 0, "stream": True})
    ok = st == 200 and events[-1] == "[DONE]"
    check(ok, "chat stream status")
    if ok:
        first = events[0]["choices"][0]
        check(first["delta"].get("role") == "assistant", "chat stream: first delta has role")
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        want = chat["content"]
        if TOL:  # the same server's non-stream answer (llama.cpp's is compared in test_chat)
            st3, full, _ = s.post("/v1/chat/completions", {"messages": chat["messages"], "max_tokens": 64,
                                                           "temperature": 0})
            want = full["choices"][0]["message"]["content"] if st3 == 200 else None
        check(text == want, "chat stream text == %s: %r" % ("non-stream" if TOL else "reference", text))
        check(all(e["object"] == "chat.completion.chunk" for e in events[:-1]), "chat chunk object")


def test_chat(s):
    ref = json.load(open(os.path.join(REF, "llamacpp_chat.json")))
    for name, c in ref.items():
        body = {"messages": c["messages"], "max_tokens": 64, "temperature": 0}
        if TOL:
            body.update(logprobs=True, top_logprobs=5, return_tokens_as_token_ids=True)
        st, resp, _ = s.post("/v1/chat/completions", body)
        ok = st == 200
        check(ok, "chat %s status %s %s" % (name, st, str(resp)[:300]))
        if not ok:
            continue
        msg = resp["choices"][0]["message"]
        same = msg["content"] == c["content"]
        why = ""
        if not same and TOL:
            lp = resp["choices"][0]["logprobs"]["content"]
            ids = [int(t["token"].split(":", 1)[1]) for t in lp]
            same, why = tol_match("chat %s" % name, ids, chat_top(lp), c["completion_ids"])
        check(msg["role"] == "assistant" and same,
              "chat %s content:\n got %r\nwant %r %s" % (name, msg["content"], c["content"], why))
        check(resp["usage"]["prompt_tokens"] == c["usage"]["prompt_tokens"], "chat %s prompt_tokens" % name)
        check(resp["object"] == "chat.completion" and resp["id"].startswith("chatcmpl-"), "chat shape")
        st, tk, _ = s.post("/tokenize", {"messages": c["messages"]})
        check(st == 200 and tk["tokens"] == c["prompt_ids"], "chat /tokenize %s" % name)


def bad_cases():
    P = "/v1/completions"
    H = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    long_prompt = "Once upon a time, there was a little girl named Lily. " * 60
    return [
        ("broken json", "POST", P, b"{\"prompt\": ", 400, None),
        ("trailing comma", "POST", P, b"{\"prompt\": \"a\",}", 400, None),
        ("not an object", "POST", P, b"[1,2,3]", 400, None),
        ("empty body", "POST", P, b"", 400, None),
        ("prompt missing", "POST", P, {}, 400, "prompt"),
        ("prompt number", "POST", P, {"prompt": 5}, 400, "prompt"),
        ("prompt object", "POST", P, {"prompt": {"a": 1}}, 400, "prompt"),
        ("two prompts", "POST", P, {"prompt": ["a", "b"]}, 400, "prompt"),
        ("token id out of vocab", "POST", P, {"prompt": [1, 100000]}, 400, "prompt"),
        ("negative max_tokens", "POST", P, {"prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
        ("huge max_tokens", "POST", P, {"prompt": "a", "max_tokens": 10 ** 15}, 400, "max_tokens"),
        ("string max_tokens", "POST", P, {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
        ("temperature < 0", "POST", P, {"prompt": "a", "temperature": -1}, 400, "temperature"),
        ("temperature string", "POST", P, {"prompt": "a", "temperature": "x"}, 400, "temperature"),
        ("top_p 0", "POST", P, {"prompt": "a", "top_p": 0}, 400, "top_p"),
        ("top_k float", "POST", P, {"prompt": "a", "top_k": 2.5}, 400, "top_k"),
        ("stop number", "POST", P, {"prompt": "a", "stop": 3}, 400, "stop"),
        ("17 stops", "POST", P, {"prompt": "a", "stop": [str(i) for i in range(17)]}, 400, "stop"),
        ("n=129", "POST", P, {"prompt": "a", "n": 129}, 400, "n"),
        ("echo", "POST", P, {"prompt": "a", "echo": True}, 400, "echo"),
        ("logprobs 6", "POST", P, {"prompt": "a", "logprobs": 6}, 400, "logprobs"),
        ("stream string", "POST", P, {"prompt": "a", "stream": "yes"}, 400, "stream"),
        ("unknown model", "POST", P, {"prompt": "a", "model": "gpt-4"}, 404, "model"),
        ("invalid utf-8", "POST", P, b"{\"prompt\": \"abc\xff\xfe\"}", 400, None),
        ("prompt too long", "POST", P, {"prompt": long_prompt, "max_tokens": 4}, 400, "prompt"),
        # an explicit max_tokens that does not fit beside the prompt: refused, as vLLM does
        ("max_tokens too long beside the prompt", "POST", P, {"prompt": "a", "max_tokens": 512}, 400, "prompt"),
        ("chat max_completion_tokens too long beside the messages", "POST", H,
         {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 510}, 400, "messages"),
        ("max_tokens over max_model_len too long", "POST", P, {"prompt": "a", "max_tokens": 100000}, 400, "prompt"),
        # 505 prompt ids leave 7 tokens: the default max_tokens (16) would be capped to 7, under min_tokens
        ("min_tokens too long beside the prompt", "POST", P, {"prompt": [5] * 505, "min_tokens": 10}, 400,
         "min_tokens"),
        ("chat min_tokens too long beside the messages", "POST", H,
         {"messages": [{"role": "user", "content": "x"}], "min_tokens": 510}, 400, "min_tokens"),
        ("chat bad max_tokens beside max_completion_tokens", "POST", H,
         {"messages": [{"role": "user", "content": "x"}], "max_tokens": "abc", "max_completion_tokens": 5}, 400,
         "max_tokens"),
        ("chat empty messages", "POST", H, {"messages": []}, 400, "messages"),
        ("chat no messages", "POST", H, {"prompt": "a"}, 400, "messages"),
        # a field no parser reads is a 400 naming it, never a silent default (a typo here)
        ("typo max_token", "POST", P, {"prompt": "a", "max_token": 2}, 400, "max_token"),
        ("chat unknown field", "POST", H, {"messages": [{"role": "user", "content": "x"}], "bogus": 1}, 400, "bogus"),
        ("stream_options unknown key", "POST", P, {"prompt": "a", "stream": True,
                                                  "stream_options": {"include_usage": True, "zzz": 1}}, 400,
         "stream_options.zzz"),
        ("tokenize unknown field", "POST", "/tokenize", {"prompt": "a", "zz": 1}, 400, "zz"),
        ("chat bad role", "POST", H, {"messages": [{"role": 3, "content": "x"}]}, 400, "messages[0].role"),
        ("chat content number", "POST", H, {"messages": [{"role": "user", "content": 1}]}, 400, "messages[0].content"),
        ("chat image part", "POST", H, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
        ("chat top_logprobs 21", "POST", H, {"messages": msgs, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("chat unknown model", "POST", H, {"messages": msgs, "model": "nope"}, 404, "model"),
        ("chat too long", "POST", H, {"messages": [{"role": "user", "content": long_prompt}]}, 400, "messages"),
        ("detokenize bad ids", "POST", "/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("chat malformed tools", "POST", H, {"messages": msgs, "tools": [{"type": "function"}]}, 400, "tools"),
        ("chat kwargs not object", "POST", H, {"messages": msgs, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
        ("cache_salt number", "POST", P, {"prompt": "a", "cache_salt": 1}, 400, "cache_salt"),
        ("kv_events bad after", "GET", "/kv_events?after=-1", None, 400, None),
        ("kv_events bad max", "GET", "/kv_events?poll=1&max=0", None, 400, None),
        ("unknown route", "GET", "/v1/nothing", None, 404, None),
        ("wrong method", "GET", P, None, 405, None),
        ("wrong method 2", "POST", "/health", {}, 405, None),
        ("20 MB body", "POST", P, b"{\"prompt\": \"" + b"a" * (20 << 20) + b"\"}", 413, None),
        # regressions found by a break-it pass:
        ("top_p that is 0 as a float", "POST", P, {"prompt": "a", "top_p": 1e-300}, 400, "top_p"),
        ("tokenize id out of vocab", "POST", "/tokenize", {"prompt": [1, 512]}, 400, "prompt"),
        ("tokenize id >= 2^32", "POST", "/tokenize", {"prompt": [4294967297]}, 400, "prompt"),
    ]


def test_bad_inputs(s):
    cases = bad_cases()
    check(len(cases) >= 30, "at least 30 bad-input cases")
    for name, method, path, body, want, param in cases:
        raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        try:
            st, hdrs, payload = s.request(method, path, raw=raw)
        except (ConnectionError, http.client.HTTPException) as e:
            check(False, "bad input %s: connection error %s" % (name, e))
            continue
        check(st == want, "bad input %s: status %s want %s (%s)" % (name, st, want, payload[:200]))
        if want != 413:  # 413 comes from libevent's body limit
            try:
                err = json.loads(payload)["error"]
                ok = isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str) \
                    and "param" in err and "code" in err
                if param is not None:
                    ok = ok and err["param"] == param
                if name.startswith("unknown model") or name == "chat unknown model":
                    ok = ok and err["code"] == "model_not_found"
                if "too long" in name:
                    ok = ok and err["code"] == "context_length_exceeded"
                check(ok, "bad input %s: error JSON %s" % (name, err))
            except (ValueError, KeyError, TypeError):
                check(False, "bad input %s: body is not OpenAI error JSON: %r" % (name, payload[:200]))
        st, resp, _ = s.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
        check(st == 200 and resp["choices"][0]["text"] == ", there was a", "normal request after bad input %s" % name)


def test_context_fill(s):
    """max_tokens that exactly fills max_model_len beside the prompt is served to the end
    (one more token is the 400 of test_bad_inputs)."""
    st, tk, _ = s.post("/tokenize", {"prompt": "a"})
    check(st == 200, "tokenize 'a'")
    if st != 200:
        return
    left = tk["max_model_len"] - tk["count"]
    st, r, _ = s.post("/v1/completions", {"prompt": "a", "max_tokens": left, "ignore_eos": True})
    check(st == 200 and r["usage"]["completion_tokens"] == left and r["choices"][0]["finish_reason"] == "length",
          "max_tokens = max_model_len - prompt: %d tokens, finish length (%s)" % (left, str(r)[:200]))
    st, r, _ = s.post("/v1/completions", {"prompt": "a", "max_tokens": left + 1})
    check(st == 400 and r["error"]["code"] == "context_length_exceeded",
          "max_tokens one past the context: 400 (%s)" % str(r)[:200])


def test_text_offset(s):
    """text_offset indexes the returned text: a generated special token (BOS, no text) takes no
    room (regression: offsets after it were shifted by len("<s>"))."""
    rec = [r for r in greedy_records() if 1 in r["completion_ids"]]
    check(rec, "a reference completion generates BOS")
    if not rec:
        return
    body = {"prompt": rec[0]["prompt"], "max_tokens": rec[0]["completion_ids"].index(1) + 6,
            "temperature": 0, "logprobs": 1}
    for stream in (False, True):
        if stream:
            _, events, _ = s.stream("/v1/completions", dict(body, stream=True))
            text, toks, offs = "", [], []
            for e in events:
                if isinstance(e, dict) and e.get("choices"):
                    c = e["choices"][0]
                    text += c["text"]
                    if c.get("logprobs"):
                        toks += c["logprobs"]["tokens"]
                        offs += c["logprobs"]["text_offset"]
        else:
            st, resp, _ = s.post("/v1/completions", body)
            check(st == 200, "text_offset request: status %s" % st)
            if st != 200:
                return
            c = resp["choices"][0]
            text, toks, offs = c["text"], c["logprobs"]["tokens"], c["logprobs"]["text_offset"]
        check("<s>" in toks, "stream=%s: the completion has a BOS token (%s)" % (stream, toks))
        tb = text.encode()
        bad = [i for i, (t, o) in enumerate(zip(toks, offs)) if t != "<s>" and not tb[o:].startswith(t.encode())]
        check(len(toks) == len(offs) and not bad,
              "stream=%s: text_offset points at each token in the text (bad at %s: %s %s)" % (stream, bad[:3], toks, offs))


def test_header_limit(s):
    """Headers are bounded (regression: libevent's default is unlimited, so one client could
    make the server buffer any amount: 300 MB of headers -> 300 MB RSS)."""
    sk = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    sent = 0
    answer = b""
    try:
        sk.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        line = b"X-Big: " + b"a" * (1 << 20) + b"\r\n"
        for _ in range(64):
            sk.sendall(line)
            sent += len(line)
    except OSError:
        pass
    try:
        answer = sk.recv(4096)
    except OSError:
        pass
    sk.close()
    check(sent < (16 << 20), "huge headers: the server stops reading early (%d MB sent)" % (sent >> 20))
    check(answer == b"" or answer.startswith(b"HTTP/1.1 4"), "huge headers: refused (%r)" % answer[:60])
    st, _, payload = s.request("GET", "/health?" + "a" * 100000)
    check(st == 200, "a 100 kB URL is still fine (%s)" % st)
    with open("/proc/%d/status" % s.proc.pid) as f:
        rss_kb = int(f.read().split("VmRSS:")[1].split()[0])
    check(rss_kb < 512 * 1024, "huge headers: server RSS %d kB" % rss_kb)


def test_fd_exhaustion():
    """More connections than the process may open: accept() fails with EMFILE. The server must
    not spin on it (regression: libevent retried at once, a busy loop at 100% CPU writing
    ~400k "Error from accept() call" lines a second), and must serve again once they close."""
    import resource

    def low_nofile():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    s = Server(GGUF, preexec_fn=low_nofile)
    socks = []
    try:
        for _ in range(120):
            sk = socket.socket()
            sk.settimeout(5)
            sk.connect(("127.0.0.1", s.port))  # the kernel completes it; the server cannot accept
            socks.append(sk)

        def cpu():
            with open("/proc/%d/stat" % s.proc.pid) as f:
                v = f.read().rsplit(")", 1)[1].split()
            return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")

        time.sleep(0.5)
        c0 = cpu()
        time.sleep(2.0)
        used = cpu() - c0
        check(used < 0.5, "EMFILE: server CPU over 2 s of refused accepts is %.2f s (want < 0.5)" % used)
        log = s.logtext()
        check(log.count("accept") <= 5, "EMFILE: at most a few accept() log lines (%d)" % log.count("accept"))
    finally:
        for sk in socks:
            sk.close()
    try:
        time.sleep(0.3)
        st, resp, _ = s.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
                             timeout=30)
        check(st == 200 and resp["choices"][0]["text"] == ", there was a", "EMFILE: serves again afterwards")
    finally:
        s.stop()


def test_repeated_signals():
    """SIGTERM sent again and again (as `timeout`, process managers and shells do) while the
    server stops: it must still exit 0 (regression: a signal arriving after the event loop
    ended hit the restored default action and killed it with status -15)."""
    rcs = []
    for _ in range(3):
        s = Server(GGUF)
        t0 = time.time()
        while s.proc.poll() is None and time.time() - t0 < 30:
            try:
                s.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.0005)
        try:
            rcs.append(s.proc.wait(timeout=30))
        except subprocess.TimeoutExpired:
            s.proc.kill()
            rcs.append("hung")
    check(rcs == [0, 0, 0], "repeated SIGTERM: exit status 0 every time (%s)" % rcs)


def raw_stream_and_drop(port, body, n_bytes):
    """Sends a request, reads about n_bytes of the response, closes the socket."""
    data = json.dumps(body).encode()
    sk = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        got = 0
        while got < n_bytes:
            b = sk.recv(min(4096, n_bytes - got))
            if not b:
                break
            got += len(b)
    finally:
        sk.close()


def test_disconnects(s, n=500):
    rng = random.Random(1234)
    prompts = [r["prompt"] for r in greedy_records()]
    jobs = []
    for i in range(n):
        body = {"prompt": rng.choice(prompts) + (" %d" % i), "max_tokens": rng.randint(8, 200),
                "temperature": rng.choice([0, 0.8]), "seed": i, "stream": rng.random() < 0.8}
        jobs.append((body, rng.choice([0, 0, 50, 300, 1000, 3000])))
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as ex:
        list(ex.map(lambda j: raw_stream_and_drop(s.port, *j), jobs))
    deadline = time.time() + 30
    m = s.metrics()
    while time.time() < deadline and not (m["kvserve_kv_blocks_used"] == 0 and m["kvserve_num_requests_running"] == 0
                                          and m["kvserve_num_requests_waiting"] == 0):
        time.sleep(0.1)
        m = s.metrics()
    check(m["kvserve_kv_blocks_used"] == 0, "after %d disconnects: kv_blocks_used == 0 (%s)" % (n, m.get("kvserve_kv_blocks_used")))
    check(m["kvserve_num_requests_running"] == 0 and m["kvserve_num_requests_waiting"] == 0,
          "after disconnects: no running/waiting requests")
    check(m["kvserve_requests_cancelled_total"] > 0, "some requests were cancelled by disconnects (%s)" % m.get("kvserve_requests_cancelled_total"))
    print("  disconnect storm: %d requests in %.1fs, cancelled %d" % (n, time.time() - t0, m["kvserve_requests_cancelled_total"]), flush=True)
    st, resp, _ = s.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    check(st == 200 and resp["choices"][0]["text"] == ", there was a", "normal request after disconnects")


def test_concurrent(s, n=32):
    recs = greedy_records()
    prompts = [recs[i % len(recs)]["prompt"] + ("" if i < len(recs) else " Day %d." % i) for i in range(n)]

    def one(p):
        body = {"prompt": p, "max_tokens": 48, "temperature": 0}
        if TOL == "bf16":
            body.update({"logprobs": 5, "return_tokens_as_token_ids": True})
        st, resp, _ = s.post("/v1/completions", body)
        if st != 200:
            return (st, resp, None)
        ch = resp["choices"][0]
        return (st, ch["text"], ch["logprobs"] if TOL == "bf16" else None)

    seq = [one(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as ex:
        conc = list(ex.map(one, prompts))
    check(all(st == 200 for st, _, _ in seq), "sequential requests all 200")
    diff = [i for i in range(n) if seq[i][:2] != conc[i][:2]]
    if TOL == "bf16":
        # a backend that is not batch-invariant (cuda without --deterministic: cuBLAS picks kernels
        # by row count; a prompt's last row may run on the decode attention kernel when the rest
        # of it came from the prefix cache) may part at a near-tie: the concurrent run's own top
        # alternatives must hold the sequential token within BF16_NATS there
        tied = []
        for i in diff:
            if conc[i][0] != 200 or seq[i][0] != 200:
                continue
            same, _ = tol_match("concurrent %d" % i, token_ids_of(conc[i][2]), completion_top(conc[i][2]),
                                token_ids_of(seq[i][2]))
            if same:
                tied.append(i)
        diff = [i for i in diff if i not in tied]
    check(not diff, "32 concurrent == sequential (differ at %s)" % diff[:5])
    check(len(set(t for _, t, _ in seq)) >= 12, "the 32 prompts give at least 12 different completions")


def main():
    if not os.path.exists(GGUF):
        print("SKIP: test data %s not found (set KVSERVE_TEST_DATA)" % GGUF)
        return 77
    only = set(sys.argv[1:])

    def want(name):
        return not only or name in only

    s = Server(GGUF)
    try:
        for name, fn in [("basics", test_basics), ("greedy", lambda s: test_greedy(s, "gguf")),
                         ("stream", test_stream), ("chat", test_chat), ("bad", test_bad_inputs),
                         ("context_fill", test_context_fill), ("text_offset", test_text_offset),
                         ("headers", test_header_limit),
                         ("concurrent", test_concurrent), ("disconnect", test_disconnects)]:
            if want(name):
                t0 = time.time()
                before = len(failures)
                try:
                    fn(s)
                except Exception as e:  # a crash of one group must not hide the others
                    check(False, "%s raised %r" % (name, e))
                print("%-10s %s (%.1fs)" % (name, "ok" if len(failures) == before else "FAILED", time.time() - t0), flush=True)
            if s.proc.poll() is not None:
                check(False, "server died (rc %s) during %s:\n%s" % (s.proc.returncode, name, s.logtext()))
                break
    finally:
        s.stop()
    if want("fd_limit"):
        t0 = time.time()
        before = len(failures)
        try:
            test_fd_exhaustion()
        except Exception as e:
            check(False, "fd_limit raised %r" % e)
        print("%-10s %s (%.1fs)" % ("fd_limit", "ok" if len(failures) == before else "FAILED", time.time() - t0), flush=True)
    if want("signals"):
        t0 = time.time()
        before = len(failures)
        try:
            test_repeated_signals()
        except Exception as e:
            check(False, "signals raised %r" % e)
        print("%-10s %s (%.1fs)" % ("signals", "ok" if len(failures) == before else "FAILED", time.time() - t0), flush=True)
    if want("hf") and os.path.isdir(HF):
        t0 = time.time()
        before = len(failures)
        h = Server(HF)
        try:
            test_greedy(h, "hf", check_logprobs=True)
        except Exception as e:
            check(False, "hf raised %r" % e)
        finally:
            h.stop()
        print("%-10s %s (%.1fs)" % ("hf", "ok" if len(failures) == before else "FAILED", time.time() - t0), flush=True)
    print("%d checks passed, %d failed" % (passed, len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
