"""One OLMoE-1B-7B-shaped MoE block on the GPU (64 experts, top-8, hidden 2048, expert width
1024; router softmax -> top-8, no renormalization): RLX against HF transformers'
OlmoeSparseMoeBlock, each side in its own process (issue 44's GPU rows, at the layer level).

Sides (a process each; a side process measures every token count on one set of weights):
* rlx      the router linear + moe_route + moe_experts on the cuda backend, experts in bf16
           or packed (q4_k gate/up, q6_k down: Q4_K_M's mix); timed as CUDA-graph replays
           (events, no host copies), the median of --reps blocks of 20 replays
* rlx-gemv the same with the grouped tensor-core GEMM off (the decode GEMV at every token
           count: what moe_experts ran before the GEMM), measured in the rlx process
* rlx-sort the same with the one-token kernels off (at 1 token: the sort, the gemv over each
           expert's pairs and the combine, what moe_experts ran before gemv1), in the rlx process
* eager    transformers' OlmoeSparseMoeBlock in bf16 (random init), CUDA events
* compile  the same under torch.compile (its compile time is printed apart)
* llama.cpp CUDA on a GGUF of the same shape is not run here: printed "peer not run"

Printed: ms per block call per side, tokens 1 / 32 / 128 (decode b1, decode b32, a 128-token
prefill), the ratios rlx / eager and rlx / compile for bf16, and the weight-read floor (the
bytes of the experts the call routes to, at the copy bandwidth the rlx process measured).

    python benchmarks/moe_gpu.py                                  # the H200 run
    python benchmarks/moe_gpu.py --sides rlx,rlx-gemv,eager,compile --json out.json
    python benchmarks/moe_gpu.py --sides rlx --tokens 1 --small   # a smoke test
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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


def _params(cfg: dict, scheme: str) -> dict:
    """Random router and expert stacks (packed where the scheme says), as the rlx side loads them."""
    import numpy as np
    from rlx_core.ir.quant import QuantScheme

    rng = np.random.default_rng(0)
    e, h, i = cfg["experts"], cfg["hidden"], cfg["inter"]
    params = {"router": (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32)}
    for name, shp, sch in zip(("gate", "up", "down"), ((e, i, h), (e, i, h), (e, h, i)), SCHEMES[scheme]):
        w = (rng.uniform(-1, 1, shp) / np.sqrt(shp[-1])).astype(np.float32)
        params[name] = _quantize(w, sch) if sch else w
    return params


def _quantize(w, scheme: str):
    """[E, rows, K] floats packed as [E, rows, bytes], an expert a thread (numpy's loops release
    the GIL: the device machine's cores quantize OLMoE's stacks in seconds, not a minute)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from rlx_core.ir.quant import QuantScheme

    q = QuantScheme.parse(scheme)
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        return np.stack(list(ex.map(q.quantize, w)))


def _rlx_ms(cfg: dict, params: dict, tokens: int, scheme: str, reps: int, kernels: bool = False):
    """Median ms of one CUDA-graph replay of the block at `tokens` tokens and, `kernels`, the
    replay's kernels (gpu_kernels.kernel_table; else None)."""
    import numpy as np

    import rlx_core
    from rlx_core.ir.dtype import BF16, U8
    from rlx_core.ir.graph import Graph

    e, k, h = cfg["experts"], cfg["k"], cfg["hidden"]
    schemes = SCHEMES[scheme]

    def build(m):
        x = m.input("x", (tokens, h), BF16)
        logits = m.matmul(x, m.param("router", (e, h), BF16), trans_b=True)
        wts, ids = m.add("moe_route", (logits,), k=k, order="softmax_topk", normalize=False)
        st = [m.param(n, params[n].shape, U8 if s else BF16) for n, s in zip(("gate", "up", "down"), schemes)]
        return {"y": m.add("moe_experts", (x, wts, ids, *st), act="silu", schemes=schemes)}
    ex = rlx_core.compile(Graph.define("moe_block", build), backend="cuda", params=params)
    inputs = {"x": np.random.default_rng(1).uniform(-1, 1, (tokens, h)).astype(np.float32)}
    runner, arrays, _ = ex.prepare(inputs)
    for _ in range(3):
        runner.run(arrays)
    if runner.graph is None:
        raise SystemExit(f"no CUDA graph was captured: {runner.describe()}")
    table = None
    if kernels:
        from gpu_kernels import kernel_table
        table = kernel_table(runner)
    return statistics.median(runner.replay_seconds(20) * 1e3 for _ in range(reps)), table


def side_rlx(cfg: dict, tokens: list, scheme: str, reps: int, gemv_too: bool, kernels: bool, sort_too: bool,
             warp_rows: list) -> dict:
    """Each token count with the GEMM as built (ms) and, gemv_too, with it off (gemv_ms);
    sort_too, with the one-token kernels off (sort_ms); each of `warp_rows` ((gate/up, down) rows a
    warp of the one-token kernels) as rows_ms."""
    from rlx_backend_cuda import moe
    from rlx_core.pipeline import select_backend

    params = _params(cfg, scheme)
    e, k = cfg["experts"], cfg["k"]
    rows = {}
    for n in tokens:
        ms, table = _rlx_ms(cfg, params, n, scheme, reps, kernels)
        row = {"ms": ms, **({"kernels": table} if table else {})}
        if gemv_too:
            on = moe.GEMM_MIN_PAIRS
            moe.GEMM_MIN_PAIRS = float("inf")          # every count below the GEMM's threshold
            try:
                row["gemv_ms"] = _rlx_ms(cfg, params, n, scheme, reps)[0]
            finally:
                moe.GEMM_MIN_PAIRS = on
        if sort_too:
            one = moe._one_token
            moe._one_token = lambda *args: False
            try:
                row["sort_ms"] = _rlx_ms(cfg, params, n, scheme, reps)[0]
            finally:
                moe._one_token = one
        if warp_rows and n == 1:
            kept = dict(moe.ONE_TOKEN_ROWS)
            row["rows_ms"] = {}
            for gu, dn in warp_rows:
                moe.ONE_TOKEN_ROWS.update(dense=gu, packed=gu, down=dn)
                row["rows_ms"][f"{gu},{dn}"] = _rlx_ms(cfg, params, n, scheme, reps)[0]
            moe.ONE_TOKEN_ROWS.update(kept)
        used = n * k if n * k < e else e          # experts a call reads at most
        row["floor_bytes"] = sum(params[x].nbytes if sch else params[x].nbytes // 2
                                 for x, sch in zip(("gate", "up", "down"), SCHEMES[scheme])) / e * used
        rows[n] = row
    be = select_backend("cuda")
    return {"rows": rows, "copy_bw": be.copy_bandwidth(), "device": be.device_name()}


def side_hf(cfg: dict, tokens: list, compiled: bool, reps: int) -> dict:
    import torch
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    c = OlmoeConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["inter"], num_experts=cfg["experts"],
                    num_experts_per_tok=cfg["k"], norm_topk_prob=False, num_hidden_layers=1, num_attention_heads=16)
    with torch.device("cuda"):             # (initialized on the GPU: 400M weights)
        block = OlmoeSparseMoeBlock(c).to(torch.bfloat16).eval()
    fn = torch.compile(block) if compiled else block
    rows = {}
    with torch.no_grad():
        for n in tokens:
            x = torch.randn(1, n, cfg["hidden"], device="cuda", dtype=torch.bfloat16)
            t = time.perf_counter()
            fn(x)                                  # (compiles for this shape)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t if compiled else 0.0
            rows[n] = {"ms": _events(lambda: fn(x), reps), "compile_s": compile_s}
    return {"rows": rows, "device": torch.cuda.get_device_name()}


def _child(cmd: list, what: str, budget: float):
    """run_child, a side over its budget logged as failed (what it measured is lost)."""
    try:
        return run_child(cmd, what, budget)
    except subprocess.TimeoutExpired:
        log(f"{what}: over its budget of {budget:.0f} s")
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sides", default="rlx,rlx-gemv,eager,compile")
    ap.add_argument("--tokens", default="1,32,128")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--budget", type=float, default=240, help="seconds a side may run")
    ap.add_argument("--json", help="write every side's result here")
    ap.add_argument("--kernels", action="store_true", help="rlx: log the kernels of each graph replay (torch.profiler)")
    ap.add_argument("--rows", default="", help="rlx: also time the one-token kernels at these rows a warp, "
                                               "gate/up,down pairs split by ';' (1,2;2,4)")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--gemv", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sort", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cfg = SMALL if a.small else FULL
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.side:
        rows = [tuple(int(v) for v in r.split(",")) for r in a.rows.split(";") if r]
        out = (side_rlx(cfg, tokens, a.scheme, a.reps, a.gemv, a.kernels, a.sort, rows) if a.side == "rlx"
               else side_hf(cfg, tokens, a.side == "compile", a.reps))
        print(json.dumps(out))
        return
    sides = a.sides.split(",")
    log(f"MoE block {cfg}, bf16 activations, tokens {tokens}")
    res = {}                                   # (side, scheme) -> side result
    base = ([sys.executable, __file__, "--tokens", a.tokens, "--reps", str(a.reps)] + (["--small"] if a.small else [])
            + (["--kernels"] if a.kernels else []) + (["--rows", a.rows] if a.rows else []))
    if {"rlx", "rlx-gemv", "rlx-sort"} & set(sides):
        for scheme in a.schemes.split(","):
            r = _child(base + ["--side", "rlx", "--scheme", scheme] + (["--gemv"] if "rlx-gemv" in sides else [])
                       + (["--sort"] if "rlx-sort" in sides else []), f"rlx {scheme}", a.budget)
            if r:
                res[("rlx", scheme)] = {n: {"ms": v["ms"], "floor_ms": v["floor_bytes"] / r["copy_bw"] * 1e3}
                                        for n, v in r["rows"].items()}
                for side in ("rlx-gemv", "rlx-sort"):
                    if side in sides:
                        res[(side, scheme)] = {n: {"ms": v[side[4:] + "_ms"]} for n, v in r["rows"].items()}
                res["device"] = r["device"]
                log(f"  rlx {scheme}: {json.dumps(r['rows'])}")
    for side in ("eager", "compile"):
        if side in sides:
            r = _child(base + ["--side", side], side, a.budget)
            if r:
                res[(side, "bf16")] = r["rows"]
                res.setdefault("device", r["device"])
                log(f"  {side}: {json.dumps(r['rows'])}")      # (kept if a later side is stopped)
    log(f"\ndevice: {res.get('device', '?')}; llama.cpp CUDA: peer not run (no llama.cpp build in this run)")
    log(f"{'tokens':>6} {'side':>18} {'ms':>9} {'floor ms':>9} {'rlx/eager':>9} {'rlx/compile':>11}")
    for n in tokens:
        for key, rows in res.items():
            if key == "device":
                continue
            side, scheme = key
            r = rows.get(str(n))
            if r is None:
                continue
            floor = f"{r['floor_ms']:.3f}" if "floor_ms" in r else "-"
            ratios = ""
            if side.startswith("rlx"):
                for peer in ("eager", "compile"):
                    p = res.get((peer, "bf16"), {}).get(str(n))
                    ratios += f" {r['ms'] / p['ms']:>9.2f}" if p else f" {'-':>9}"
            extra = f"  (compile {r['compile_s']:.0f} s)" if r.get("compile_s") else ""
            log(f"{n:>6} {side + ' ' + scheme:>18} {r['ms']:>9.3f} {floor:>9}{ratios}{extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": res.get("device"), "cfg": cfg,
                       "rows": {f"{s} {sc}": v for (s, sc), v in ((k, v) for k, v in res.items() if k != "device")}},
                      f, indent=1)


if __name__ == "__main__":
    main()
