#!/usr/bin/python3
"""End-to-end: `kvserve serve` on every quantized file of models/tiny-quant (llama.cpp's
F16, BF16, Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K quantizations of one random model) against the
same server on the matching dequant-f32 file (llama.cpp's own dequantization to F32).

- with --quant-matmul f32 --bf16-matmul f32: greedy completions of the stories-vocabulary reference prompts give
  identical token ids and identical top-5 logprobs (the kernels compute with exactly the
  dequantized floats, so the documented tolerance is zero; see src/backend/cpu/matmul.h), also
  with --kv-cache-dtype f16 on both sides;
- with the default --quant-matmul int8 (8-bit activations, integer dot products; src/quant/q8.h):
  the same greedy tokens as the dequant-f32 file wherever both still follow the same text, and
  the chosen token's logprob within INT8_LOGPROB_TOL of the f32 run (the documented tolerance);
  a divergence is allowed only where the f32 run's top two logprobs are within INT8_TIE of each
  other (a near tie that 8-bit activations may flip); the BF16 file with
  --bf16-matmul bf16 (bf16 activations, src/backend/cpu/matmul_bf16.h) under the same rules;
- memory: the server's RSS after serving is at most (file size + KV pool) x 1.15 + the
  fixed part (code, libraries -- libcublasLt alone is ~130 MiB in a CUDA build --, thread
  stacks, scratch), measured as the RSS of the same server (same arguments, same requests) on
  the smallest file minus that file's size. A widened f32 copy of the weights would exceed it (4-8x the file).
env: KVSERVE_BIN, KVSERVE_TEST_DATA. Exit 0 = passed, 77 = skipped (data missing).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import http_api as H  # noqa: E402

DATA = os.environ.get("KVSERVE_TEST_DATA", "")
QDIR = os.path.join(DATA, "models", "tiny-quant")
TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"]
KV_BLOCKS = 64  # x 16 tokens
INT8_LOGPROB_TOL = 0.05  # |logprob(int8) - logprob(f32)| of each agreed greedy token
INT8_TIE = 0.25          # f32 top-2 logprob gap under which int8 may pick the other token


def proc_status(pid):
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            if v.strip().endswith("kB"):
                out[k] = int(v.split()[0]) * 1024
    return out


def completions(s, prompts):
    res = []
    for p in prompts:
        st, r, _ = s.post("/v1/completions", dict(prompt=p, max_tokens=24, temperature=0, logprobs=5,
                                                 return_tokens_as_token_ids=True))
        H.check(st == 200, "completion status %s: %s" % (st, r))
        if st != 200:
            return None
        lp = r["choices"][0]["logprobs"]
        res.append((H.token_ids_of(lp), lp["top_logprobs"]))
    return res


def serve(path, extra=()):
    return H.Server(path, ["--kv-cache-blocks", str(KV_BLOCKS), "--threads", "2", *extra])


def gguf_tensor_data(buf, name):
    """(offset of tensor `name`'s data in the file, ne) for a GGUF v3 buffer."""
    import struct
    o = 24
    nt, nkv = struct.unpack_from("<QQ", buf, 8)
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    align = 32

    def skip(t, o):
        if t == 8:
            n, = struct.unpack_from("<Q", buf, o)
            return o + 8 + n
        if t == 9:
            et, n = struct.unpack_from("<IQ", buf, o)
            o += 12
            for _ in range(n):
                o = skip(et, o)
            return o
        return o + sizes[t]
    for _ in range(nkv):
        n, = struct.unpack_from("<Q", buf, o)
        key = buf[o + 8:o + 8 + n].decode()
        o += 8 + n
        t, = struct.unpack_from("<I", buf, o)
        if key == "general.alignment":
            align, = struct.unpack_from("<I", buf, o + 4)
        o = skip(t, o + 4)
    info = {}
    for _ in range(nt):
        n, = struct.unpack_from("<Q", buf, o)
        tn = buf[o + 8:o + 8 + n].decode()
        o += 8 + n
        nd, = struct.unpack_from("<I", buf, o)
        ne = struct.unpack_from("<%dQ" % nd, buf, o + 4)
        o += 4 + 8 * nd
        off, = struct.unpack_from("<Q", buf, o + 4)
        o += 12
        info[tn] = (off, ne)
    data = (o + align - 1) // align * align
    off, ne = info[name]
    return data + off, ne


def test_cli_env():
    """Bad kernel settings are refused at start by serve and generate (exit 2, the variable named)."""
    import subprocess
    q = os.path.join(QDIR, "tiny-Q4_K_M.gguf")
    cases = [({"KVSERVE_CPU_QUANT_MATMUL": "bogus"}, [], "KVSERVE_CPU_QUANT_MATMUL"),
             ({"KVSERVE_CPU_ISA": "bogus"}, [], "KVSERVE_CPU_ISA"),
             ({"KVSERVE_CPU_AMX": "no"}, [], "KVSERVE_CPU_AMX"),
             ({"KVSERVE_CPU_BF16_MATMUL": "fp8"}, [], "KVSERVE_CPU_BF16_MATMUL"),
             ({}, ["--quant-matmul", "int4"], "--quant-matmul"),
             ({}, ["--bf16-matmul", "int8"], "--bf16-matmul")]
    for env, extra, name in cases:
        for cmd in (["serve", "--model", q, "--port", "0"], ["generate", "--model", q, "--prompt", "Once", "--max-tokens", "2"]):
            e = dict(os.environ, **env)
            p = subprocess.run([os.environ["KVSERVE_BIN"], *cmd, *extra], env=e, capture_output=True, text=True, timeout=60)
            H.check(p.returncode == 2 and name in p.stderr, "%s %s %s: exit %d, stderr %r" %
                    (cmd[0], env, extra, p.returncode, p.stderr[-300:]))
    p = subprocess.run([os.environ["KVSERVE_BIN"], "generate", "--model", q, "--prompt", "Once", "--max-tokens", "2",
                        "--quant-matmul", "F32"], env=dict(os.environ, KVSERVE_CPU_AMX="0"), capture_output=True,
                       text=True, timeout=60)
    H.check(p.returncode == 0, "generate --quant-matmul F32 with KVSERVE_CPU_AMX=0: exit %d %r" % (p.returncode, p.stderr[-300:]))


def test_nan_model():
    """A model whose logits are NaN (an attention norm of NaNs) still answers with well-formed
    logprobs: one entry per token (null where the value is NaN), never shorter arrays."""
    import struct
    import tempfile
    src = os.path.join(QDIR, "tiny-f32.gguf")
    buf = bytearray(open(src, "rb").read())
    off, ne = gguf_tensor_data(buf, "blk.0.attn_norm.weight")
    buf[off:off + 4 * ne[0]] = struct.pack("<f", float("nan")) * ne[0]
    d = tempfile.mkdtemp(prefix="kvserve-nan-")
    path = os.path.join(d, "nan.gguf")
    open(path, "wb").write(buf)
    s = serve(path)
    try:
        st, r, _ = s.post("/v1/completions", dict(prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=1))
        H.check(st == 200, "NaN model: status %s %s" % (st, r))
        if st == 200:
            lp = r["choices"][0]["logprobs"]
            n = len(lp["tokens"])
            H.check(n == 4 and len(lp["token_logprobs"]) == n and len(lp["top_logprobs"]) == n and
                    len(lp["text_offset"]) == n, "NaN model: logprobs arrays have one entry per token: %s" % lp)
        st, r, _ = s.post("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                                      temperature=0, logprobs=True, top_logprobs=2))
        H.check(st == 200 and len(r["choices"][0]["logprobs"]["content"]) == 3,
                "NaN model: chat logprobs content has one entry per token: %s" % str(r)[:300])
    finally:
        s.stop()
        import shutil
        shutil.rmtree(d, ignore_errors=True)


def check_int8(t, q, prompts, want):
    """The default integer path against the dequant-f32 run `want` (see the module doc)."""
    # the BF16 file: bf16 activations named explicitly (the auto default is f32 on some CPUs)
    s8 = serve(q, ["--kv-cache-dtype", "f32"] + (["--bf16-matmul", "bf16"] if t == "BF16" else []))
    try:
        got = completions(s8, prompts)
        mode = "BF16 weights: bf16 matmul" if t == "BF16" else "quantized weights: int8 matmul"
        H.check(mode in s8.logtext(), "%s: the log names the mode (%s)" % (t, mode))
    finally:
        s8.stop()
    if got is None:
        return
    same_tokens = total = 0
    worst = 0.0
    for i, ((ia, la), (ib, lb)) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(ia, ib)):
            total += 1
            if a != b:
                top = sorted(lb[j].values(), reverse=True)
                gap = top[0] - top[1] if len(top) > 1 else 99.0
                H.check(gap < INT8_TIE, "%s int8 prompt %d token %d: %s != f32 %s with an f32 top-2 gap of %.3f" %
                        (t, i, j, a, b, gap))
                break
            same_tokens += 1
            d = abs(max(la[j].values()) - max(lb[j].values()))
            worst = max(worst, d)
            H.check(d <= INT8_LOGPROB_TOL, "%s int8 prompt %d token %d: logprob differs by %.3f" % (t, i, j, d))
    print("%-7s int8 vs dequant-f32: %d/%d greedy tokens before any divergence, worst logprob difference %.4f" %
          (t, same_tokens, total, worst), flush=True)


def main():
    if not os.path.exists(os.path.join(QDIR, "tiny-f32.gguf")):
        print("SKIP: test data %s not found (set KVSERVE_TEST_DATA)" % QDIR)
        return 77
    prompts = [r["prompt"] for r in H.greedy_records()][:6]
    kv_bytes = KV_BLOCKS * 16 * 2 * 2 * 2 * 128 * 4  # blocks x tpb x K,V x layers x kv heads x head_dim x f32
    base_file = os.path.join(QDIR, "tiny-Q4_0.gguf")
    # the same arguments and the same requests as the measured runs below, so the fixed part
    # holds the same scratch, touched KV pages and (under ASan) the same quarantine history
    sb = serve(base_file, ["--kv-cache-dtype", "f32", "--quant-matmul", "f32"])
    try:
        completions(sb, prompts)
        fixed = proc_status(sb.proc.pid)["VmRSS"] - os.path.getsize(base_file)
    finally:
        sb.stop()
    print("fixed RSS (server on tiny-Q4_0 minus its file): %.1f MiB" % (fixed / 1048576.0), flush=True)
    for kv in ("f32", "f16"):
        for t in TYPES:
            q = os.path.join(QDIR, "tiny-%s.gguf" % t)
            f = os.path.join(QDIR, "tiny-%s.dequant-f32.gguf" % t)
            sq = serve(q, ["--kv-cache-dtype", kv, "--quant-matmul", "f32", "--bf16-matmul", "f32"])
            try:
                got = completions(sq, prompts)
                log = sq.logtext()
                if kv == "f32":
                    want_type = t.split("_M")[0]
                    H.check(("matrices " + want_type) in log, "%s: the log names the stored type: %s" % (t, log[-600:]))
                    st = proc_status(sq.proc.pid)
                    size = os.path.getsize(q)
                    limit = 1.15 * (size + kv_bytes) + fixed
                    H.check(st["VmRSS"] <= limit, "%s: RSS %d B > (file %d + KV %d) x 1.15 + fixed %d" %
                            (t, st["VmRSS"], size, kv_bytes, fixed))
                    print("%-7s file %8d B  RSS %9d B  anon %9d B  file-backed %9d B" %
                          (t, size, st.get("VmRSS", 0), st.get("RssAnon", 0), st.get("RssFile", 0)), flush=True)
            finally:
                sq.stop()
            sf = serve(f, ["--kv-cache-dtype", kv])
            try:
                want = completions(sf, prompts)
            finally:
                sf.stop()
            if got is None or want is None:
                continue
            for i, (a, b) in enumerate(zip(got, want)):
                H.check(a[0] == b[0], "%s kv %s prompt %d: ids %s != dequant-f32 %s" % (t, kv, i, a[0][:8], b[0][:8]))
                H.check(a[1] == b[1], "%s kv %s prompt %d: top-5 logprobs differ" % (t, kv, i))
            H.check(len(set(tuple(a[0]) for a in got)) > 1, "%s: outputs differ between prompts" % t)
            if kv == "f32" and t != "F16" and want is not None:
                check_int8(t, q, prompts, want)
        print("kv %s: %d types ok so far (%d checks passed, %d failed)" % (kv, len(TYPES), H.passed, len(H.failures)),
              flush=True)
    test_nan_model()
    test_cli_env()
    print("%d checks passed, %d failed" % (H.passed, len(H.failures)))
    return 1 if H.failures else 0


if __name__ == "__main__":
    sys.exit(main())
