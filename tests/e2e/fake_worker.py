#!/usr/bin/env python3
"""A fake kvserve worker for the router's e2e tests (tests/e2e/router_e2e.py).

Speaks the router <-> worker wire format of docs/disaggregation.md just enough to check the
router: a context worker answers a context_only leg with one choice carrying
disaggregated_params; a generation worker answers (stream or not) with text naming the
disagg_request_id it got. Every request it receives is recorded; tests read the records and
switch the failure mode through control routes:

  GET  /_log          -> {"requests": [{path, body, ...}], "events": [...]}
  POST /_mode         {"mode": M, ...options} (also clears the log)

Modes: normal, big_stream (events of event_bytes as fast as the socket takes them; /_log
"written" counts the bytes sent), close_after_read (read the request, close without answering), status500,
status400, malformed (a context answer without disaggregated_params), finished (context:
finish_reason "stop"), stall (never answer; record "client_closed" when the peer goes away),
slow_stream (one event every 0.2 s, 50 of them), fail_midstream (2 events, then close),
probe (POST /kv_probe answers {"prompt_tokens": P, "cached_tokens": C} from the options).
Usage: fake_worker.py --role context|generation|aggregated --port-file PATH
"""
import argparse
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {"mode": "normal", "opts": {}, "requests": [], "events": [], "written": 0}


def record(kind, item):
    with LOCK:
        STATE[kind].append(item)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status, obj, ctype="application/json"):
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _wait_peer_close(self, limit_s=30.0):
        """Blocks until the peer closes the connection (records client_closed) or limit_s."""
        sock = self.connection
        end = time.time() + limit_s
        while time.time() < end:
            r, _, _ = select.select([sock], [], [], 0.05)
            if r:
                try:
                    d = sock.recv(1, socket.MSG_PEEK)
                except OSError:
                    d = b""
                if not d:
                    record("events", {"event": "client_closed", "path": self.path})
                    return True
        return False

    def do_GET(self):
        if self.path == "/_log":
            with LOCK:
                self._send(200, {"requests": STATE["requests"], "events": STATE["events"],
                                 "written": STATE["written"]})
            return
        if self.path != "/health":  # the router polls it (health checks)
            record("requests", {"path": self.path, "method": "GET"})
        if self.path == "/server_info":
            info = {"role": ARGS.role, "tokens_per_block": 16, "model": "fake", "worker_id": ARGS.name}
            if ARGS.role == "context":
                info["disaggregated_params"] = {"ctx_info_endpoint": ARGS.name + ":kvx",
                                                "kv_transport": "tcp"}
            self._send(200, info)
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        elif self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"error": {"message": "no route", "type": "not_found_error",
                                       "param": None, "code": None}})

    def do_POST(self):
        raw = self._body()
        if self.path == "/_mode":
            o = json.loads(raw or b"{}")
            with LOCK:
                STATE["mode"] = o.get("mode", "normal")
                STATE["opts"] = o
                STATE["requests"] = []
                STATE["events"] = []
                STATE["written"] = 0
            self._send(200, {"ok": True})
            return
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        record("requests", {"path": self.path, "method": "POST", "body": body})
        with LOCK:
            mode, opts = STATE["mode"], dict(STATE["opts"])
        if self.path == "/kv_probe":
            if mode == "probe":
                self._send(200, {"prompt_tokens": opts.get("prompt_tokens", 100),
                                 "cached_tokens": opts.get("cached_tokens", 0)})
            else:
                self._send(404, {"error": {"message": "no probe", "type": "not_found_error",
                                           "param": None, "code": None}})
            return
        if mode == "close_after_read":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "status500":
            self._send(500, {"error": {"message": "fake failure", "type": "server_error",
                                       "param": None, "code": None}})
            return
        if mode == "status400":
            self._send(400, {"error": {"message": "fake bad request", "type": "invalid_request_error",
                                       "param": "prompt", "code": "fake_code"}})
            return
        if mode == "stall":
            self._wait_peer_close()
            self.close_connection = True
            return
        dp = (body or {}).get("disaggregated_params") or {}
        chat = self.path == "/v1/chat/completions"
        if dp.get("request_type") == "context_only":
            self._context(body, dp, mode, chat)
            return
        self._generate(body, dp, mode, chat)

    def _context(self, body, dp, mode, chat):
        finish = "stop" if mode == "finished" else "not_finished"
        params = {"request_type": "context_only", "disagg_request_id": dp.get("disagg_request_id"),
                  "ctx_request_id": 7000 + (dp.get("disagg_request_id") or 0) % 1000,
                  "schedule_style": dp.get("schedule_style"), "first_gen_tokens": [42],
                  "ctx_info_endpoint": ARGS.name + ":kvx", "prompt_token_ids": [1, 2, 3],
                  "conversation_id": dp.get("conversation_id")}
        choice = {"index": 0, "finish_reason": finish, "disaggregated_params": params}
        if chat:
            choice["message"] = {"role": "assistant", "content": "ctx"}
        else:
            choice["text"] = "ctx"
        resp = {"id": "cmpl-ctx", "object": "chat.completion" if chat else "text_completion",
                "created": 1, "model": "fake", "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        if mode == "malformed":
            del choice["disaggregated_params"]
        self._send(200, resp)

    def _generate(self, body, dp, mode, chat):
        text = "gen-%s-%s" % (ARGS.name, dp.get("disagg_request_id"))
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            self._send(200, {"id": "cmpl-gen", "object": "text_completion", "created": 1,
                             "model": "fake", "choices": [choice],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(s):
            data = s.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def event(piece, finish=None):
            if chat:
                c = {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
            else:
                c = {"index": 0, "text": piece, "finish_reason": finish}
            ev = "data: " + json.dumps({"id": "cmpl-gen", "object": "x", "created": 1,
                                        "model": "fake", "choices": [c]}) + "\n\n"
            # the first event goes out in two pieces: the router must re-frame
            if piece == text:
                chunk(ev[:10])
                time.sleep(0.01)
                chunk(ev[10:])
            else:
                chunk(ev)

        n = 50 if mode == "slow_stream" else 3
        if mode == "big_stream":  # as fast as the socket takes it; STATE["written"] counts
            n = int(STATE["opts"].get("events", 1000))
            pad = "x" * int(STATE["opts"].get("event_bytes", 65536))
        try:
            if mode == "big_stream":
                for i in range(n):
                    event(text if i == 0 else pad, "length" if i == n - 1 else None)
                    with LOCK:
                        STATE["written"] += len(pad)
                chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                return
            for i in range(n):
                # split one event over two writes: the router must re-frame
                if i == 0:
                    event(text)
                else:
                    event(" t%d" % i, "length" if i == n - 1 else None)
                if mode == "fail_midstream" and i == 1:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if mode == "slow_stream":
                    if self._wait_peer_close(0.2):
                        self.close_connection = True
                        return
            chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            record("events", {"event": "client_closed", "path": self.path})
            self.close_connection = True


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="generation")
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--name", default="")
    ARGS = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    port = srv.server_address[1]
    if not ARGS.name:
        ARGS.name = "127.0.0.1:%d" % port
    with open(ARGS.port_file + ".tmp", "w") as f:
        f.write("%d\n" % port)
    import os
    os.rename(ARGS.port_file + ".tmp", ARGS.port_file)
    try:
        srv.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
