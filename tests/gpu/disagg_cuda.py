#!/usr/bin/env python3
"""Disaggregated serving on one GPU: KV GPU to GPU through CUDA IPC (issue 10), for a GPU machine.

    disagg_cuda.py KVSERVE        (test data from KVSERVE_TEST_DATA, as tests/e2e/disagg.py)

For the KV dtypes bf16 and f32: an aggregated `serve --backend cuda` worker gives the reference
greedy tokens for every public stories260K reference prompt (32 tokens each); then a context
and a generation worker, both `--backend cuda` on GPU 0 (transport picked automatically:
cuda_ipc, checked in /server_info) behind `kvserve router`, must give the same tokens,
streamed and not, context first and generation first; the generation worker must count the
received transfers, and both workers' blocks must return to idle.
Then the mixed pairs: a cuda context worker with a cpu generation worker, and a cpu context
worker with a cuda generation worker (same KV dtype, so only the transport differs): the
request fails with an error that says why (never a 200 with text from unmoved blocks), and the
blocks return to idle.
Exit 0 when every check passed, 1 otherwise, 77 when the test data is missing. Used by
scripts/gpu-test.sh (DISAGG_E2E=1).
"""
import json
import os
import sys
import time

if len(sys.argv) > 1:
    os.environ["KVSERVE_BIN"] = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import disagg as D  # noqa: E402
import http_api as H  # noqa: E402

check = H.check
ARGS = ["--max-model-len", "512"]


def serve(role, backend, dt, extra=()):
    args = ["serve", "--model", H.GGUF, "--backend", backend, "--kv-cache-dtype", dt] + ARGS
    if role != "aggregated":
        args += ["--role", role, "--kv-transfer-timeout", "5"]
        if backend == "cpu":  # (its default would be ucx where built; the refusal is the same)
            args += ["--kv-transport", "tcp"]
    return D.Proc(args + list(extra), name="%s-%s" % (role, backend))


def pair(recs, refs, dt):
    ctx, gen = serve("context", "cuda", dt), serve("generation", "cuda", dt)
    try:
        for p in (ctx, gen):
            st, info = p.request("GET", "/server_info")
            tp = json.loads(info).get("disaggregated_params", {}).get("kv_transport")
            check(tp == "cuda_ipc", "%s: kv_transport cuda_ipc picked by itself (%s)" % (p.name, tp))
        for style in ("context_first", "generation_first"):
            rt = D.router([ctx], [gen], ["--schedule-style", style])
            try:
                D.run_flow(refs, recs, rt, "cuda_ipc %s/%s" % (dt, style))
            finally:
                rt.stop()
        D.wait_idle([ctx, gen], "cuda_ipc %s" % dt)
        m = gen.metrics()
        got = m.get("kvserve_kv_transfer_recvs_ok_total", 0)
        check(got >= 4 * len(recs), "generation worker received %d transfers (>= %d)" % (got, 4 * len(recs)))
    finally:
        ctx.stop()
        gen.stop()


def mixed(recs, dt):
    for cb, gb in (("cuda", "cpu"), ("cpu", "cuda")):
        ctx, gen = serve("context", cb, dt), serve("generation", gb, dt)
        rt = D.router([ctx], [gen], env=dict(os.environ, KVSERVE_DISAGG_NO_RETRY="1"))
        label = "%s context + %s generation" % (cb, gb)
        try:
            st, resp = rt.post("/v1/completions", D.completion_body(recs[0], 8))
            text = json.dumps(resp) if not isinstance(resp, bytes) else resp.decode(errors="replace")
            check(st >= 400, "%s: an error, not text (status %s)" % (label, st))
            check("transports do not match" in text or "GPU memory" in text,
                  "%s: the error says why: %s" % (label, text[:300]))
            print("  %s: %s %s" % (label, st, text[:200]))
            D.wait_idle([ctx, gen], label, timeout=30)
        finally:
            rt.stop()
            ctx.stop()
            gen.stop()


def main():
    if not os.path.exists(H.GGUF):
        print("SKIP: test data %s not found (set KVSERVE_TEST_DATA)" % H.GGUF)
        return 77
    recs = H.greedy_records()
    for dt in ("bf16", "f32"):
        t0 = time.time()
        agg = serve("aggregated", "cuda", dt)
        try:
            refs = D.references(agg, recs)
        finally:
            agg.stop()
        before = len(H.failures)
        pair(recs, refs, dt)
        print("cuda_ipc %-5s %s: %d prompts x 4 (stream/not, context/generation first) (%.1fs)" %
              (dt, "ok" if len(H.failures) == before else "FAILED", len(recs), time.time() - t0), flush=True)
    before = len(H.failures)
    mixed(recs, "f32")
    print("mixed cuda/cpu %s" % ("ok" if len(H.failures) == before else "FAILED"), flush=True)
    print("disagg_cuda: %d checks passed, %d failed" % (H.passed, len(H.failures)))
    return 1 if H.failures else 0


if __name__ == "__main__":
    sys.exit(main())
