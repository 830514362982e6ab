#!/usr/bin/env python3
"""Decode-step time of PyTorch + HF transformers on the random-weight Llama-3-8B shape, the
peer of bench_cuda's decode table (issue 10 benchmarks). GPU machine only; needs torch and
transformers (the device image has torch 2.11 and transformers 5.17).

    python3 bench/hf_decode.py [--batches 1,8,32,128] [--ctxs 512,4096] [--steps 10]
                               [--modes eager,compiled] [--layers 32] [--budget-s S]
                               [--json FILE] [--kvserve-table FILE]

Model: LlamaForCausalLM built from a LlamaConfig of the Llama-3-8B shape (32 layers, hidden
4096, 32/8 heads, head_dim 128, FFN 14336, vocab 128256, Llama-3 RoPE scaling), bf16 weights
made by transformers' own random init on the GPU, SDPA attention. A decode step = one
`model(input_ids[B, 1], past_key_values=cache, position_ids, cache_position)` call for B
sequences at position `context` (+ step), logits of every sequence left on the GPU (kvserve's
step also copies them to the host), timed with torch.cuda.synchronize() around it (host
clock), median of --steps after 3 warm-ups. The cache is filled with random bf16 K/V of
`context` positions (no prefill: only the decode step is measured).

  eager     DynamicCache (the default of `generate`): torch.cat grows K/V every step.
  compiled  StaticCache(max_cache_len = context + warm-ups + steps + 1) and
            `model.forward = torch.compile(model.forward, mode="reduce-overhead",
            fullgraph=True)` (CUDA graphs), the recipe of transformers' docs. Attention runs
            over the whole static length with a mask (that is how the static cache works).
            torch.compile's automatic dynamic shapes is left on, so after the first shape
            change the batch / cache length become dynamic (fewer recompiles); the compile
            time of each shape's first call is printed, not counted.

Prints a markdown table (batch, context, mode, step ms, tokens/s) and, with --kvserve-table
FILE (bench_cuda's stdout), a side-by-side table with kvserve's step and the ratios.
"""
import argparse
import json
import os
import re
import statistics
import sys
import time

import torch


def parse_list(s):
    return [int(x) for x in s.split(",") if x]


def build_model(layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    import inspect

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    kw = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers >= 5
        kw["rope_parameters"] = dict(rope, rope_theta=500000.0)
    else:
        kw.update(rope_theta=500000.0, rope_scaling=rope)
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(old)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    return cfg, model


def fill_cache(cache, layers, B, ctx, static):
    """Random K/V for positions 0..ctx-1 of every layer (values like post-RoPE keys: N(0,1))."""
    g = torch.Generator(device="cuda").manual_seed(99)
    pos = torch.arange(ctx, device="cuda")
    for l in range(layers):
        k = torch.randn((B, 8, ctx, 128), device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn((B, 8, ctx, 128), device="cuda", dtype=torch.bfloat16, generator=g)
        cache.update(k, v, l, {"cache_position": pos} if static else None)
        del k, v


def make_cache(cfg, B, ctx, max_len, static):
    from transformers import DynamicCache, StaticCache

    if not static:
        try:
            return DynamicCache(config=cfg)
        except TypeError:
            return DynamicCache()
    try:
        return StaticCache(config=cfg, max_cache_len=max_len)
    except TypeError:  # older signature
        return StaticCache(config=cfg, max_batch_size=B, max_cache_len=max_len, device="cuda",
                           dtype=torch.bfloat16)


def run_shape(cfg, model, fwd, B, ctx, steps, static, layers):
    warm = 3
    cache = make_cache(cfg, B, ctx, ctx + warm + steps + 1, static)
    fill_cache(cache, layers, B, ctx, static)
    torch.cuda.synchronize()
    ts, first = [], None
    with torch.inference_mode():
        for s in range(warm + steps):
            p = ctx + s
            ids = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
            pos_ids = torch.full((B, 1), p, device="cuda", dtype=torch.long)
            cpos = torch.tensor([p], device="cuda", dtype=torch.long)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fwd(input_ids=ids, past_key_values=cache, position_ids=pos_ids, cache_position=cpos, use_cache=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if s == 0:
                first = dt
            if s >= warm:
                ts.append(dt)
            del out
    del cache
    torch.cuda.empty_cache()
    return statistics.median(ts), first


def kvserve_rows(path):
    """(batch, ctx) -> (step ms, floor ms) from bench_cuda's decode table."""
    rows = {}
    for line in open(path):
        m = re.match(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|", line)
        if m:
            rows[(int(m.group(1)), int(m.group(2)))] = (float(m.group(3)), float(m.group(4)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--ctxs", default="512,4096")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=0,
                    help="skip the shapes not started within this many seconds of the start (0: no limit)")
    ap.add_argument("--json")
    ap.add_argument("--kvserve-table")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    import transformers

    print("torch %s, transformers %s, %s" % (torch.__version__, transformers.__version__,
                                             torch.cuda.get_device_name(0)), flush=True)
    t0 = time.time()
    cfg, model = build_model(a.layers)
    nparam = sum(p.numel() for p in model.parameters())
    print("model: %d layers, %.2f GB bf16 (built in %.1f s)" % (a.layers, nparam * 2 / 1e9, time.time() - t0),
          flush=True)
    res = []
    modes = a.modes.split(",")
    for mode in modes:
        static = mode == "compiled"
        fwd = model.forward
        if static:
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        for ctx in parse_list(a.ctxs):
            for B in parse_list(a.batches):
                if a.budget_s and time.time() - t0 > a.budget_s:
                    print("%s batch %d ctx %d: not run (--budget-s %.0f spent)" % (mode, B, ctx, a.budget_s), flush=True)
                    continue
                try:
                    med, first = run_shape(cfg, model, fwd, B, ctx, a.steps, static, a.layers)
                except torch.cuda.OutOfMemoryError:
                    print("%s batch %d ctx %d: out of memory" % (mode, B, ctx), flush=True)
                    torch.cuda.empty_cache()
                    continue
                except Exception as e:  # a failed compile must not hide the other rows
                    import traceback
                    traceback.print_exc()
                    print("%s batch %d ctx %d: failed: %r" % (mode, B, ctx, e), flush=True)
                    torch.cuda.empty_cache()
                    continue
                res.append({"batch": B, "ctx": ctx, "mode": mode, "step_ms": med * 1e3, "first_call_s": first})
                print("%s batch %d ctx %d: step %.3f ms (%.0f tok/s), first call %.1f s" %
                      (mode, B, ctx, med * 1e3, B / med, first), flush=True)
    print("\n| batch | context | HF mode | step ms (median) | tokens/s |\n|---|---|---|---|---|")
    for r in res:
        print("| %d | %d | %s | %.3f | %.0f |" % (r["batch"], r["ctx"], r["mode"], r["step_ms"],
                                                 r["batch"] / r["step_ms"] * 1e3))
    if a.kvserve_table and os.path.exists(a.kvserve_table):
        kv = kvserve_rows(a.kvserve_table)
        by = {(r["batch"], r["ctx"], r["mode"]): r["step_ms"] for r in res}
        print("\n| batch | context | kvserve ms | floor ms | kvserve / floor | HF eager ms | HF compiled ms |"
              " eager / kvserve | compiled / kvserve |\n|---|---|---|---|---|---|---|---|---|")
        for (B, ctx), (ms, fl) in sorted(kv.items(), key=lambda x: (x[0][1], x[0][0])):
            e, c = by.get((B, ctx, "eager")), by.get((B, ctx, "compiled"))
            f = lambda v: "%.3f" % v if v else "-"
            g = lambda v: "%.2fx" % (v / ms) if v else "-"
            print("| %d | %d | %.3f | %.3f | %.2fx | %s | %s | %s | %s |" % (B, ctx, ms, fl, ms / fl, f(e), f(c),
                                                                        g(e), g(c)))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
