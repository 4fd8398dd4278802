"""One OLMoE-1B-7B-shaped MoE block on the GPU (64 experts, top-8, hidden 2048, expert width
1024; router softmax -> top-8, no renormalization): RLX against HF transformers'
OlmoeSparseMoeBlock, each side in its own process (issue 44's GPU rows, at the layer level).

Sides:
* rlx      the router linear + moe_route + moe_experts on the cuda backend, experts in bf16
           or packed (q4_k gate/up, q6_k down: Q4_K_M's mix); timed as CUDA-graph replays
           (events, no host copies), the median of --reps blocks of 20 replays
* eager    transformers' OlmoeSparseMoeBlock in bf16 (random init), CUDA events
* compile  the same under torch.compile (its compile time is printed apart)
* llama.cpp CUDA on a GGUF of the same shape is not run here: printed "peer not run"

Printed: ms per block call per side, tokens 1 / 32 / 128 (decode b1, decode b32, a 128-token
prefill), the ratios rlx / eager and rlx / compile for bf16, and the weight-read floor (the
bytes of the experts the call routes to, at the copy bandwidth the rlx process measured).

    python benchmarks/moe_gpu.py                                  # the H200 run
    python benchmarks/moe_gpu.py --sides rlx --tokens 1 --small   # a smoke test
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import log, run_child  # noqa: E402

FULL = dict(experts=64, k=8, hidden=2048, inter=1024)
SMALL = dict(experts=8, k=2, hidden=256, inter=128)
SCHEMES = {"bf16": ("", "", ""), "q4_k_m": ("q4_k", "q4_k", "q6_k")}


def _events(fn, reps: int, inner: int = 20) -> float:
    """Median ms of one fn() over `reps` event-timed blocks of `inner` calls (after a warm-up)."""
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def side_rlx(cfg: dict, tokens: int, scheme: str, reps: int) -> dict:
    import cupy as cp
    import numpy as np

    import rlx_core
    from rlx_core.ir.dtype import BF16, U8
    from rlx_core.ir.graph import Graph
    from rlx_core.ir.quant import QuantScheme

    rng = np.random.default_rng(0)
    e, k, h, i = cfg["experts"], cfg["k"], cfg["hidden"], cfg["inter"]
    schemes = SCHEMES[scheme]
    params = {"router": (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32)}
    for name, shp, sch in zip(("gate", "up", "down"), ((e, i, h), (e, i, h), (e, h, i)), schemes):
        w = (rng.uniform(-1, 1, shp) / np.sqrt(shp[-1])).astype(np.float32)
        params[name] = (QuantScheme.parse(sch).quantize(w.reshape(-1, shp[-1])).reshape(shp[0], shp[1], -1)
                        if sch else w)

    def build(m):
        x = m.input("x", (tokens, h), BF16)
        logits = m.matmul(x, m.param("router", (e, h), BF16), trans_b=True)
        wts, ids = m.add("moe_route", (logits,), k=k, order="softmax_topk", normalize=False)
        st = [m.param(n, params[n].shape, U8 if s else BF16) for n, s in zip(("gate", "up", "down"), schemes)]
        return {"y": m.add("moe_experts", (x, wts, ids, *st), act="silu", schemes=schemes)}
    ex = rlx_core.compile(Graph.define("moe_block", build), backend="cuda", params=params)
    inputs = {"x": rng.uniform(-1, 1, (tokens, h)).astype(np.float32)}
    runner, arrays, _ = ex.prepare(inputs)
    for _ in range(3):
        runner.run(arrays)
    if runner.graph is None:
        raise SystemExit(f"no CUDA graph was captured: {runner.describe()}")
    s = runner.stream
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        with s:
            a.record(s)
            for _ in range(20):
                runner.graph.launch(s)
            b.record(s)
            b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 20)
    used = tokens * k if tokens * k < e else e          # experts a call reads at most
    stack_bytes = sum(params[n].nbytes if sch else params[n].nbytes // 2 for n, sch in zip(("gate", "up", "down"), schemes))
    return {"ms": statistics.median(times), "floor_bytes": stack_bytes / e * used,
            "copy_bw": ex.backend.copy_bandwidth(), "device": ex.backend.device_name()}


def side_hf(cfg: dict, tokens: int, compiled: bool, reps: int) -> dict:
    import torch
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    c = OlmoeConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["inter"], num_experts=cfg["experts"],
                    num_experts_per_tok=cfg["k"], norm_topk_prob=False, num_hidden_layers=1, num_attention_heads=16)
    block = OlmoeSparseMoeBlock(c).to("cuda", torch.bfloat16).eval()
    x = torch.randn(1, tokens, cfg["hidden"], device="cuda", dtype=torch.bfloat16)
    fn, compile_s = block, 0.0
    with torch.no_grad():
        if compiled:
            fn = torch.compile(block)
            t = time.perf_counter()
            fn(x)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t
        ms = _events(lambda: fn(x), reps)
    return {"ms": ms, "compile_s": compile_s, "device": torch.cuda.get_device_name()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sides", default="rlx,eager,compile")
    ap.add_argument("--tokens", default="1,32,128")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--budget", type=float, default=240, help="seconds a side may run")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    cfg = SMALL if a.small else FULL
    if a.side:
        out = (side_rlx(cfg, a.n, a.scheme, a.reps) if a.side == "rlx"
               else side_hf(cfg, a.n, a.side == "compile", a.reps))
        print(json.dumps(out))
        return
    log(f"MoE block {cfg}, bf16 activations")
    rows = []
    for n in (int(t) for t in a.tokens.split(",")):
        res = {}
        for side in a.sides.split(","):
            for scheme in (SCHEMES if side == "rlx" else ("bf16",)):
                cmd = [sys.executable, __file__, "--side", side, "--scheme", scheme, "--n", str(n), "--reps", str(a.reps)]
                r = run_child(cmd + (["--small"] if a.small else []), f"{side} {scheme} T={n}", a.budget)
                res[(side, scheme)] = r
                if r:                  # each result as it comes: a run stopped early keeps what it measured
                    log(f"  {side} {scheme} T={n}: {r['ms']:.3f} ms")
        rows.append((n, res))
    device = next((r["device"] for _, res in rows for r in res.values() if r), "?")
    log(f"\ndevice: {device}; llama.cpp CUDA: peer not run (no llama.cpp build in this run)")
    log(f"{'tokens':>6} {'side':>16} {'ms':>9} {'floor ms':>9} {'rlx/eager':>9} {'rlx/compile':>11}")
    for n, res in rows:
        for (side, scheme), r in res.items():
            if r is None:
                log(f"{n:>6} {side + ' ' + scheme:>16} {'failed':>9}")
                continue
            floor = r["floor_bytes"] / r["copy_bw"] * 1e3 if "floor_bytes" in r else None
            ratios = ""
            if side == "rlx" and scheme == "bf16":
                for peer in ("eager", "compile"):
                    p = res.get((peer, "bf16"))
                    ratios += f" {r['ms'] / p['ms']:>9.2f}" if p else f" {'-':>9}"
            extra = f"  (compile {r['compile_s']:.0f} s)" if r.get("compile_s") else ""
            log(f"{n:>6} {side + ' ' + scheme:>16} {r['ms']:>9.3f} {floor if floor is None else round(floor, 3)!s:>9}"
                f"{ratios}{extra}")


if __name__ == "__main__":
    main()
