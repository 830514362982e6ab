#!/usr/bin/python3
"""End-to-end test of KV-cache reuse through the HTTP API of `kvserve serve` (stories260K).

Groups (run all, or name some on the command line):
  multiturn  turn 2 = turn 1 prompt + reply + new tokens: cached_tokens is exactly the full
             blocks of turn 1's computed KV; greedy outputs equal a --no-prefix-cache server's
  salt       the same prompt with another cache_salt (or none) gets cached_tokens 0
  info       /server_info fields (and their agreement with /metrics and /kv_events)
  events     GET /kv_events stream: stored events (chained parent hashes, 16 tokens per
             block equal to the request's tokens, worker id, seq + 1 each), removed events
             after evictions (small --kv-cache-blocks), ?after= resume, ?poll=1 == stream,
  ring       (--tokens-per-block 1) "lost" when the ring dropped what the client asked for;
             a client that never reads is dropped with a final "lost"
  host       --host-cache-memory: an evicted prompt replays from the host tier, same output
  ptc        --prefix-token-cache: greedy references unchanged, counters move
  tools      chat with tools / tool_calls / chat_template_kwargs accepted (ChatML fallback
             ignores them), malformed tools -> 400
env: KVSERVE_BIN, KVSERVE_TEST_DATA. Exit 0 = all passed, 77 = skipped (data missing).
"""
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import http_api as H  # noqa: E402  (Server, check, greedy_records)

check = H.check
T = 16  # tokens per block (the server default)


def ids_of(resp):
    return [int(t.split(":", 1)[1]) for t in resp["choices"][0]["logprobs"]["tokens"]]


def complete(s, prompt, max_tokens, **extra):
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                return_tokens_as_token_ids=True, **extra)
    st, resp, _ = s.post("/v1/completions", body)
    assert st == 200, (st, resp)
    return resp


def tokenize(s, text, special=True):
    st, r, _ = s.post("/tokenize", {"prompt": text, "add_special_tokens": special})
    assert st == 200, r
    return r["tokens"]


def cached(resp):
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


class EventStream:
    """Reads GET /kv_events (SSE) on a thread; .events holds the parsed data objects."""

    def __init__(self, port, query="", read=True, rcvbuf=None):
        self.sk = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sk.connect(("127.0.0.1", port))
        self.sk.sendall(b"GET /kv_events%s HTTP/1.1\r\nHost: x\r\n\r\n" % query.encode())
        self.events, self.ids, self.raw = [], [], b""
        self.headers = None
        self.ended = False
        self.lock = threading.Lock()
        self.th = None
        if read:
            self.start()

    def start(self):
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self):
        self.sk.settimeout(120)
        try:
            while True:
                d = self.sk.recv(65536)
                if not d:
                    break
                self._feed(d)
        except OSError:
            pass
        self.ended = True

    def _feed(self, d):
        # incremental: headers, then HTTP/1.1 chunks, then SSE blocks ("\n\n"-terminated)
        self._buf = getattr(self, "_buf", b"") + d
        if self.headers is None:
            if b"\r\n\r\n" not in self._buf:
                return
            head, self._buf = self._buf.split(b"\r\n\r\n", 1)
            self.headers = head.decode()
            self._data = b""
        while True:
            nl = self._buf.find(b"\r\n")
            if nl < 0:
                break
            n = int(self._buf[:nl], 16)
            if n == 0:  # the last chunk: the response is complete
                self._buf = b""
                self.ended = True
                break
            if len(self._buf) < nl + 2 + n + 2:
                break
            self._data += self._buf[nl + 2:nl + 2 + n]
            self._buf = self._buf[nl + 2 + n + 2:]
        evs, ids = [], []
        while b"\n\n" in self._data:
            block, self._data = self._data.split(b"\n\n", 1)
            self.raw += block + b"\n\n"
            for line in block.decode().split("\n"):
                if line.startswith("data: "):
                    evs.append(json.loads(line[6:]))
                elif line.startswith("id: "):
                    ids.append(int(line[4:]))
        with self.lock:
            self.events += evs
            self.ids += ids

    def wait(self, pred, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if pred(self.events):
                    return True
            time.sleep(0.02)
        return False

    def close(self):
        try:
            self.sk.close()
        except OSError:
            pass


def kv_of(evs, typ):
    return [e for e in evs if e.get("type") == typ]


# ---------------------------------------------------------------------------- groups

def multi_turn(s, ref, recs):
    """Token-id prompts make the bound exact: after turn 1 (n1 prompt ids, m generated) the
    KV of n1 + m - 1 tokens was computed (the last sampled token is never fed), and every
    full block of it is registered; turn 2 extends those ids, so its lookup hits exactly
    floor((n1 + m - 1) / 16) * 16 tokens (all below the block holding its last token)."""
    for k, rec in enumerate(recs[:4]):
        ids1 = rec["prompt_ids"]
        m = 40 + 3 * k
        r1 = complete(s, ids1, m)
        r1b = complete(ref, ids1, m)
        reply = ids_of(r1)
        check(reply == ids_of(r1b) and r1["choices"][0]["text"] == r1b["choices"][0]["text"],
              "multiturn %d: turn 1 == --no-prefix-cache server" % k)
        ids2 = ids1 + reply + tokenize(s, " Then they went home and had a nap.", special=False)
        r2 = complete(s, ids2, 32)
        r2b = complete(ref, ids2, 32)
        want = (len(ids1) + m - 1) // T * T
        check(cached(r2) == want and want >= T,
              "multiturn %d: turn 2 cached_tokens %d == floor((%d + %d - 1)/16)*16 = %d"
              % (k, cached(r2), len(ids1), m, want))
        check(cached(r2b) == 0, "multiturn %d: --no-prefix-cache server reports 0 cached" % k)
        check(ids_of(r2) == ids_of(r2b) and r2["choices"][0]["text"] == r2b["choices"][0]["text"],
              "multiturn %d: turn 2 greedy output == --no-prefix-cache server" % k)
        # turn 3 over text (chat-like growth): at least the blocks of turn 2's prompt are reused
        r3 = complete(s, ids2 + ids_of(r2) + [13], 8)
        check(cached(r3) >= len(ids2) // T * T, "multiturn %d: turn 3 cached %d >= %d"
              % (k, cached(r3), len(ids2) // T * T))


def salt(s, recs):
    ids = recs[5]["prompt_ids"] + recs[6]["prompt_ids"][1:]
    full = (len(ids) - 1) // T * T
    a1 = complete(s, ids, 8, cache_salt="tenant-A")
    a2 = complete(s, ids, 8, cache_salt="tenant-A")
    b1 = complete(s, ids, 8, cache_salt="tenant-B")
    n1 = complete(s, ids, 8)
    check(cached(a1) == 0, "salt: first request with salt A: cached 0 (%d)" % cached(a1))
    check(cached(a2) == full, "salt: same salt again reuses %d tokens (%d)" % (full, cached(a2)))
    check(cached(b1) == 0, "salt: salt B on the same prompt: cached 0 (%d)" % cached(b1))
    check(cached(n1) == 0, "salt: no salt on the same prompt: cached 0 (%d)" % cached(n1))
    check(len({json.dumps(ids_of(x)) for x in (a1, a2, b1, n1)}) == 1, "salt: same output for every salt")
    for bad, why in [(5, "number"), ("", "empty"), ("x" * 257, "257 bytes")]:
        st, resp, _ = s.post("/v1/completions", {"prompt": "a", "max_tokens": 1, "cache_salt": bad})
        check(st == 400 and resp["error"]["param"] == "cache_salt", "salt: %s cache_salt -> 400 (%s)" % (why, st))
    st, resp, _ = s.post("/v1/completions", {"prompt": "a", "max_tokens": 1, "cache_salt": "x" * 256})
    check(st == 200, "salt: 256-byte cache_salt accepted")


def info(s, ref, host):
    st, hdrs, payload = s.request("GET", "/server_info")
    i = json.loads(payload)
    check(st == 200, "info: status")
    want_keys = {"model", "tokens_per_block", "hash_scheme", "worker_id", "prefix_cache", "host_cache_blocks",
                 "kv_blocks", "max_model_len", "kv_events_ring"}
    check(want_keys <= set(i), "info: keys %s" % sorted(i))
    check(i["model"] == "stories260K" and i["tokens_per_block"] == 16 and i["max_model_len"] == 512,
          "info: model / tokens_per_block / max_model_len %s" % i)
    check(isinstance(i["worker_id"], str) and len(i["worker_id"]) == 16 and int(i["worker_id"], 16) >= 0,
          "info: worker_id is 16 hex digits")
    check(isinstance(i["hash_scheme"], str) and i["hash_scheme"], "info: hash_scheme")
    check(i["prefix_cache"] is True and i["host_cache_blocks"] == 0 and i["kv_events_ring"] == 4096,
          "info: prefix_cache on, no host tier, ring 4096")
    check(i["kv_blocks"] == s.metrics()["kvserve_kv_blocks_total"], "info: kv_blocks == /metrics")
    st, _, payload = s.request("GET", "/kv_events?poll=1&max=1")
    check(json.loads(payload)["worker_id"] == i["worker_id"], "info: worker_id == /kv_events worker_id")
    ri = json.loads(ref.request("GET", "/server_info")[2])
    check(ri["prefix_cache"] is False and ri["worker_id"] != i["worker_id"], "info: --no-prefix-cache server")
    hi = json.loads(host.request("GET", "/server_info")[2])
    check(hi["host_cache_blocks"] > 0, "info: --host-cache-memory server has host blocks (%s)" % hi["host_cache_blocks"])


def events(s, recs):
    """s: a fresh server with 40 KV blocks (so evictions come quickly)."""
    wid = json.loads(s.request("GET", "/server_info")[2])["worker_id"]
    ev = EventStream(s.port)
    check(ev.wait(lambda e: len(e) >= 1), "events: start event arrives")
    check("text/event-stream" in (ev.headers or ""), "events: SSE content type")
    start = ev.events[0]
    check(start.get("type") == "start" and start.get("worker_id") == wid and start.get("tokens_per_block") == 16,
          "events: start event %s" % start)
    ids = recs[0]["prompt_ids"] + recs[1]["prompt_ids"][1:] + recs[2]["prompt_ids"][1:]
    r = complete(s, ids, 30)
    seq_toks = ids + ids_of(r)
    nblocks = (len(ids) + 30 - 1) // T
    check(ev.wait(lambda e: len(kv_of(e, "stored")) >= nblocks), "events: %d stored events arrive" % nblocks)
    time.sleep(0.1)
    st = kv_of(ev.events, "stored")
    check(len(st) == nblocks, "events: exactly %d stored (%d)" % (nblocks, len(st)))
    check(all(e["worker_id"] == wid for e in st), "events: worker_id on every event")
    check([e["seq"] for e in st] == list(range(1, nblocks + 1)) and ev.ids == [e["seq"] for e in st],
          "events: seq 1..%d, SSE ids match" % nblocks)
    check(st[0]["parent_is_root"] and all(not e["parent_is_root"] for e in st[1:]), "events: first block's parent is the root")
    check(all(st[k]["parent_hash"] == st[k - 1]["block_hash"] for k in range(1, len(st))),
          "events: parent hashes chain")
    check(all(len(e["tokens"]) == T for e in st) and sum((e["tokens"] for e in st), []) == seq_toks[:nblocks * T],
          "events: 16 tokens per block == the request's prompt + generated ids")
    check(len({e["block_hash"] for e in st}) == nblocks and all(len(e["block_hash"]) == 64 for e in st),
          "events: distinct 32-byte hex hashes")
    # the poll form returns the same events
    page = json.loads(s.request("GET", "/kv_events?poll=1&after=0&max=1024")[2])
    check([e["block_hash"] for e in page["events"]] == [e["block_hash"] for e in st] and page["lost"] == 0
          and page["last_seq"] == nblocks, "events: ?poll=1 == stream")
    # resume with ?after=
    ev2 = EventStream(s.port, "?after=%d" % (nblocks - 2))
    check(ev2.wait(lambda e: len(e) >= 3) and [e.get("seq") for e in ev2.events[1:3]] == [nblocks - 1, nblocks],
          "events: ?after=N resumes at N+1")
    ev2.close()
    # evictions: distinct long prompts through a 40-block pool
    seen = {e["block_hash"] for e in st}
    for k in range(6):
        p = [1] + [3 + (k * 37 + j * 11) % 500 for j in range(200)]
        complete(s, p, 4)
    check(ev.wait(lambda e: len(kv_of(e, "removed")) > 0), "events: removed events after evictions")
    time.sleep(0.1)
    with ev.lock:
        allev = list(ev.events[1:])
    stored_all = {e["block_hash"] for e in kv_of(allev, "stored")}
    rem = kv_of(allev, "removed")
    check(all(e["block_hash"] in stored_all for e in rem), "events: removed blocks were stored before")
    check(any(e["block_hash"] in seen for e in rem), "events: the first request's blocks were evicted")
    seqs = [e["seq"] for e in allev]
    check(seqs == list(range(1, len(seqs) + 1)), "events: seq increases by 1 across stored/removed")
    check(ev.ids == seqs, "events: SSE id == seq")
    ev.close()
    # disconnect cleanup: many streams opened and dropped, server still fine
    for _ in range(20):
        e = EventStream(s.port, read=False)
        e.close()
    st_, _, _ = s.request("GET", "/health")
    check(st_ == 200, "events: server fine after dropped streams")
    st_, _, payload = s.request("GET", "/kv_events?after=x")
    check(st_ == 400, "events: bad after -> 400")


def ring(s):
    """s: --tokens-per-block 1 (one event per token, so the 4096-event ring wraps quickly).
    A client asking for dropped events gets a non-final "lost"; one that never reads falls
    more than a ring behind and gets a final "lost", then its stream ends."""
    slow = EventStream(s.port, "?after=0", read=False, rcvbuf=4096)
    time.sleep(0.1)
    k, dropped, t0 = 0, 0, time.time()
    # the server's socket buffers absorb a few MB for the stalled client (about 250 bytes an
    # event here): go well past one ring beyond that. The time cap only bounds a hang: an ASan
    # build on a loaded 2-core machine made 15 requests (10156 dropped) in 60 s, too few.
    while dropped < 8 * 4096 and time.time() - t0 < 400:
        p = [1] + [3 + (k * 131 + j * 7 + j * j) % 500 for j in range(495)]
        complete(s, p, 1)
        k += 1
        dropped = json.loads(s.request("GET", "/kv_events?poll=1&max=1&after=0")[2])["lost"]
    print("  ring: %d requests -> %d events dropped from the ring in %.1fs" % (k, dropped, time.time() - t0),
          flush=True)
    late = EventStream(s.port, "?after=0")
    check(dropped >= 8 * 4096, "ring: %d events dropped from the ring before the time cap" % dropped)
    check(late.wait(lambda e: len(e) >= 3), "ring: late client gets events")
    lost = late.events[1] if len(late.events) > 2 else {}
    check(lost.get("type") == "lost" and lost.get("final") is False and lost.get("lost", 0) > 0,
          "ring: a client asking for dropped events gets a non-final lost first (%s)" % lost)
    check(len(late.events) > 2 and late.events[2].get("seq") == lost.get("lost", -1) + 1,
          "ring: after lost, the oldest retained event follows")
    late.close()
    fresh = EventStream(s.port)
    check(fresh.wait(lambda e: len(e) >= 2) and fresh.events[1].get("type") in ("stored", "removed"),
          "ring: without after, the stream starts at the oldest retained event, no lost")
    fresh.close()
    slow.start()
    ok = slow.wait(lambda e: any(x.get("type") == "lost" and x.get("final") for x in e), timeout=30)
    check(ok, "ring: a client that never reads gets a final lost event (%d events read)" % len(slow.events))
    deadline = time.time() + 10
    while not slow.ended and time.time() < deadline:
        time.sleep(0.05)
    check(slow.ended, "ring: the slow client's stream ends after the final lost")
    slow.close()


def subscribers(s, ref):
    """s: --max-kv-subscribers 40. The cap answers 503 JSON; 39 streams that never read do not
    change the answers of concurrent completions (and each stalled stream is dropped with a
    final "lost" once its queue is full, not kept forever); ?after= beyond the last event is
    a 400 that names the current last_seq (a restarted worker's router resubscribes)."""
    prompts = [[1] + [3 + (k * 37 + j * 11) % 500 for j in range(200)] for k in range(10)]
    want = [ids_of(complete(ref, p, 8)) for p in prompts]
    idle = [EventStream(s.port, "?after=0", read=False, rcvbuf=4096) for _ in range(39)]
    live = EventStream(s.port)
    check(live.wait(lambda e: len(e) >= 1), "subs: stream 40 of 40 starts")
    st, _, payload = s.request("GET", "/kv_events")
    err = json.loads(payload).get("error", {}) if payload.startswith(b"{") else {}
    check(st == 503 and err.get("code") == "too_many_subscribers", "subs: stream 41 gets 503 JSON (%s %r)" % (st, payload[:120]))
    t0 = time.time()
    got = [ids_of(complete(s, p, 8)) for p in prompts]
    print("  subs: 10 completions with 39 stalled streams + 1 reader in %.2fs" % (time.time() - t0), flush=True)
    check(got == want, "subs: completions unchanged by stalled subscribers")
    check(live.wait(lambda e: sum(1 for x in e if x.get("type") == "stored") >= 10 * 12),
          "subs: the reading stream got the stored events (%d)" % len(live.events))
    last = json.loads(s.request("GET", "/kv_events?poll=1&max=1&after=0")[2])["last_seq"]
    st, _, payload = s.request("GET", "/kv_events?poll=1&after=%d" % (last + 1000))
    body = json.loads(payload)
    check(st == 400 and body.get("error", {}).get("code") == "after_beyond_last" and body.get("last_seq", -1) >= last,
          "poll: after beyond the last event -> 400 with last_seq (%s %r)" % (st, payload[:160]))
    st, _, payload = s.request("GET", "/kv_events?after=%d" % (last + 1000))
    check(st == 400 and json.loads(payload).get("last_seq", -1) >= last, "stream: after beyond the last event -> 400")
    for x in idle:
        x.close()
    live.close()
    wait_for_subs = time.time() + 10
    while time.time() < wait_for_subs:  # the closed streams free their slots
        fresh = EventStream(s.port)
        ok = fresh.wait(lambda e: len(e) >= 1, timeout=2)
        fresh.close()
        if ok:
            break
    check(ok, "subs: slots are freed when clients leave")


def host(s, recs):
    """s: 40 device blocks + a host tier. A prompt is evicted from the device by others, then
    replayed: its blocks come back from the host tier, output identical."""
    ids = recs[3]["prompt_ids"] + recs[4]["prompt_ids"][1:] + recs[7]["prompt_ids"][1:]
    a = complete(s, ids, 24)
    for k in range(4):
        complete(s, [1] + [3 + (k * 53 + j * 5) % 500 for j in range(480)], 2)
    m0 = s.metrics()
    b = complete(s, ids, 24)
    m1 = s.metrics()
    check(ids_of(a) == ids_of(b) and a["choices"][0]["text"] == b["choices"][0]["text"],
          "host: replay output identical")
    check(m1["kvserve_kv_cache_hits_host_total"] > m0["kvserve_kv_cache_hits_host_total"],
          "host: replay hit the host tier (%s -> %s)" % (m0["kvserve_kv_cache_hits_host_total"],
                                                       m1["kvserve_kv_cache_hits_host_total"]))
    check(m1["kvserve_kv_offloads_total"] > 0, "host: blocks were offloaded")
    check(cached(b) == (len(ids) - 1) // T * T, "host: replay cached_tokens %d" % cached(b))


def ptc(s, recs):
    for r in recs:
        resp = complete(s, r["prompt"], 64)
        check(resp["choices"][0]["text"] == r["completion_text"] and ids_of(resp) == r["completion_ids"],
              "ptc: greedy %s unchanged" % r["id"])
        check(tokenize(s, r["prompt"]) == r["prompt_ids"], "ptc: /tokenize %s unchanged" % r["id"])
    m0 = s.metrics()
    base = recs[0]["prompt"] + recs[0]["completion_text"]
    text = base
    for k in range(3):
        resp = complete(s, text, 16)
        text = text + resp["choices"][0]["text"] + " Then"
    m1 = s.metrics()
    check(m1["kvserve_prefix_token_cache_hits_total"] > m0["kvserve_prefix_token_cache_hits_total"],
          "ptc: hits counter moves on growing prompts (%s -> %s)" % (m0["kvserve_prefix_token_cache_hits_total"],
                                                                    m1["kvserve_prefix_token_cache_hits_total"]))
    check(m1["kvserve_prefix_token_cache_misses_total"] > 0, "ptc: misses counted")
    check(m1["kvserve_prefix_token_cache_entries"] > 0, "ptc: entries gauge")
    return text


def tools(s):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tool_list = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                   "parameters": {"type": "object",
                                                                  "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": msgs, "tools": tool_list, "tool_choice": "auto",
            "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 12, "temperature": 0}
    st, resp, _ = s.post("/v1/chat/completions", body)
    check(st == 200, "tools: chat with tools + chat_template_kwargs accepted (%s %s)" % (st, str(resp)[:200]))
    # ChatML fallback: tools / kwargs ignored, null content rendered as empty
    plain = [{"role": "user", "content": msgs[0]["content"]}, {"role": "assistant", "content": ""},
             {"role": "tool", "content": "sunny"}]
    st2, resp2, _ = s.post("/v1/chat/completions", {"messages": plain, "max_tokens": 12, "temperature": 0})
    if st == 200 and st2 == 200:
        check(resp["usage"]["prompt_tokens"] == resp2["usage"]["prompt_tokens"]
              and resp["choices"][0]["message"]["content"] == resp2["choices"][0]["message"]["content"],
              "tools: same prompt and output as the plain ChatML conversation")
    st, tk, _ = s.post("/tokenize", {"messages": msgs, "tools": tool_list})
    st2, tk2, _ = s.post("/tokenize", {"messages": plain})
    check(st == 200 and tk["tokens"] == tk2["tokens"], "tools: /tokenize with tools == plain")
    for name, extra, param in [
            ("tools object", {"tools": {"a": 1}}, "tools"),
            ("tool without name", {"tools": [{"type": "function", "function": {}}]}, "tools"),
            ("tool wrong type", {"tools": [{"type": "code", "function": {"name": "x"}}]}, "tools"),
            ("kwargs list", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
            ("tool_choice unknown function", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice")]:
        b = dict(body, **extra)
        st, resp, _ = s.post("/v1/chat/completions", b)
        check(st == 400 and resp["error"]["param"] == param, "tools: %s -> 400 %s (%s %s)" % (name, param, st, resp))
    bad_msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    st, resp, _ = s.post("/v1/chat/completions", {"messages": bad_msgs})
    check(st == 400 and resp["error"]["param"] == "messages[0].tool_calls[0]", "tools: bad arguments JSON -> 400")
    st, resp, _ = s.post("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]})
    check(st == 400 and resp["error"]["param"] == "messages[0].tool_call_id", "tools: numeric tool_call_id -> 400")


def main():
    if not os.path.exists(H.GGUF):
        print("SKIP: test data %s not found (set KVSERVE_TEST_DATA)" % H.GGUF)
        return 77
    only = set(sys.argv[1:])
    recs = H.greedy_records()
    servers = {}

    def srv(name, *extra):
        if name not in servers:
            servers[name] = H.Server(H.GGUF, extra)
        return servers[name]

    groups = [
        ("multiturn", lambda: multi_turn(srv("main"), srv("ref", "--no-prefix-cache"), recs)),
        ("salt", lambda: salt(srv("main"), recs)),
        ("info", lambda: info(srv("main"), srv("ref", "--no-prefix-cache"),
                              srv("host", "--kv-cache-blocks", "40", "--host-cache-memory", "64MiB"))),
        ("events", lambda: events(srv("small", "--kv-cache-blocks", "40"), recs)),
        ("ring", lambda: ring(srv("tiny", "--tokens-per-block", "1", "--kv-cache-blocks", "600"))),
        ("host", lambda: host(srv("host", "--kv-cache-blocks", "40", "--host-cache-memory", "64MiB"), recs)),
        ("ptc", lambda: ptc(srv("ptc", "--prefix-token-cache", "--prefix-token-cache-min-chars", "1",
                                          "--prefix-token-cache-bucket-chars", "32", "--prefix-token-cache-overlap", "16",
                                          "--prefix-token-cache-resync", "8"), recs)),
        ("tools", lambda: tools(srv("main"))),
        ("subs", lambda: subscribers(srv("subs", "--max-kv-subscribers", "40"), srv("ref", "--no-prefix-cache"))),
    ]
    try:
        for name, fn in groups:
            if only and name not in only:
                continue
            t0 = time.time()
            before = len(H.failures)
            try:
                fn()
            except Exception as e:  # one group's crash must not hide the others
                import traceback
                traceback.print_exc()
                check(False, "%s raised %r" % (name, e))
            print("%-10s %s (%.1fs)" % (name, "ok" if len(H.failures) == before else "FAILED", time.time() - t0),
                  flush=True)
            for sname, s in servers.items():
                if s.proc.poll() is not None:
                    check(False, "server %s died (rc %s) during %s:\n%s" % (sname, s.proc.returncode, name, s.logtext()))
    finally:
        for s in servers.values():
            s.stop()
    print("%d checks passed, %d failed" % (H.passed, len(H.failures)))
    return 1 if H.failures else 0


if __name__ == "__main__":
    sys.exit(main())
