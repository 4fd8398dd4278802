"""One Gated DeltaNet layer's recurrence (gated_delta_rule) on the GPU: RLX's fused op against
the composed scan (rlx_core.ir.recurrence, what a backend without the op runs) and against
flash-linear-attention's chunk_gated_delta_rule (Triton), each side in its own process
(issue 45's "GDN layer alone" row).

Shape: Qwen3.5-2B-like, batch 1, 16 heads (key heads = value heads), K = V = 128, bf16, a
nonzero start state, T = 1 (a decode step), 8192 and 32768. Sides:
* rlx       the gated_delta_rule op on the cuda backend (CUDA-graph replays timed with events):
            the recurrent kernel at T = 1, the chunked (WY/UT) tensor-core kernels from T = 64
            (--bv: the state columns a block of their walk holds, default the backend's)
* rlx-fma   the same op on the f32 FMA chunked kernels (the tensor-core ones switched off)
* composed  the scan of rlx_core.ir.recurrence on the cuda backend (T <= --composed-max only)
* fla       fla.ops.gated_delta_rule.chunk_gated_delta_rule (fla-core installed: carry its
            wheel), CUDA events; "peer not run" where it is not importable
Printed: ms per call and the ratio rlx / fla (target <= 1.2) and rlx / composed.

    python benchmarks/deltanet_gpu.py
    python benchmarks/deltanet_gpu.py --tokens 1,256 --sides rlx,composed   # quick
    python benchmarks/deltanet_gpu.py --tokens 8192,32768 --sides rlx,rlx-fma,fla --bv 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import log, run_child  # noqa: E402

B, H, K, V = 1, 16, 128, 128


def _inputs(t: int):
    import numpy as np
    rng = np.random.default_rng(0)

    def unit(s):
        x = rng.standard_normal(s).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    return {"q": unit((B, t, H, K)), "k": unit((B, t, H, K)), "v": rng.standard_normal((B, t, H, V), np.float32),
            "g": -rng.uniform(0.0, 1.0, (B, t, H)).astype(np.float32),
            "beta": rng.uniform(0.0, 1.0, (B, t, H)).astype(np.float32),
            "state": rng.standard_normal((B, H, K, V), np.float32)}


def side_rlx(t: int, composed: bool, reps: int, fma: bool = False, bv: int = 0) -> dict:
    import rlx_core
    from rlx_backend_cuda import deltanet
    if fma:
        deltanet._tensor_cores = lambda *a: False
    if bv:
        deltanet.GDN_TC_BV = bv
    from rlx_core.ir.dtype import BF16
    from rlx_core.ir.graph import Graph
    from rlx_core.ir.recurrence import gated_delta_rule as scan

    def build(m):
        q, k, v, g, beta, s = [m.input(n, shp, BF16) for n, shp in (
            ("q", (B, t, H, K)), ("k", (B, t, H, K)), ("v", (B, t, H, V)), ("g", (B, t, H)), ("beta", (B, t, H)),
            ("state", (B, H, K, V)))]
        if composed:
            o, s1 = scan(m, q, k, v, g, beta, K ** -0.5, s)
        else:
            o, s1 = m.add("gated_delta_rule", (q, k, v, g, beta, s), scale=K ** -0.5, chunk=64)
        return {"o": o, "state_out": s1}
    ex = rlx_core.compile(Graph.define("gdn", build), backend="cuda")
    runner, arrays, _ = ex.prepare(_inputs(t))
    for _ in range(2):
        runner.run(arrays)
    if runner.graph is None:
        raise SystemExit(f"no CUDA graph was captured: {runner.describe()}")
    return {"ms": statistics.median(runner.replay_seconds(1) * 1e3 for _ in range(reps)),
            "device": ex.backend.device_name()}


def side_fla(t: int, reps: int) -> dict:
    import torch
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise SystemExit(f"fla is not importable: {e}")
    x = {k: torch.from_numpy(v).to("cuda", torch.bfloat16) for k, v in _inputs(t).items()}
    state = x.pop("state").float()

    def call():
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K ** -0.5,
                                      initial_state=state, output_final_state=True)
    with torch.no_grad():
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return {"ms": statistics.median(times), "device": torch.cuda.get_device_name()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sides", default="rlx,composed,fla")
    ap.add_argument("--tokens", default="1,8192,32768")
    ap.add_argument("--composed-max", type=int, default=1024, help="longest T the composed scan runs")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget", type=float, default=180, help="seconds a side may run")
    ap.add_argument("--bv", type=int, default=0,
                    help="rlx: state columns a block of the tensor-core walk holds")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        out = side_fla(a.n, a.reps) if a.side == "fla" else side_rlx(a.n, a.side == "composed", a.reps,
                                                                     a.side == "rlx-fma", a.bv)
        print(json.dumps(out))
        return
    log(f"gated_delta_rule: batch {B}, {H} heads, K = V = {K}, bf16")
    rows = []
    for n in (int(t) for t in a.tokens.split(",")):
        res = {}
        for side in a.sides.split(","):
            if side == "composed" and n > a.composed_max:
                continue
            try:
                res[side] = run_child([sys.executable, __file__, "--side", side, "--n", str(n),
                                       "--reps", str(a.reps), "--bv", str(a.bv)], f"{side} T={n}", a.budget)
            except subprocess.TimeoutExpired:          # (fla's first call compiles Triton kernels: minutes)
                log(f"  {side} T={n}: not done within --budget {a.budget:g} s")
                res[side] = None
            if res[side]:              # each result as it comes: a run stopped early keeps what it measured
                log(f"  {side} T={n}: {res[side]['ms']:.3f} ms")
        rows.append((n, res))
    device = next((r["device"] for _, res in rows for r in res.values() if r), "?")
    log(f"\ndevice: {device}")
    log(f"{'T':>6} {'rlx ms':>9} {'fma ms':>9} {'composed ms':>12} {'fla ms':>9} {'rlx/fla':>8} "
        f"{'rlx/composed':>12}")
    for n, res in rows:
        def ms(side):
            r = res.get(side)
            return r["ms"] if r else None
        r, c, f = ms("rlx"), ms("composed"), ms("fla")
        fmt = lambda v, w: f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        log(f"{n:>6} {fmt(r, 9)} {fmt(ms('rlx-fma'), 9)} {fmt(c, 12)} {fmt(f, 9)} "
            f"{fmt(r / f if r and f else None, 8)} "
            f"{fmt(r / c if r and c else None, 12)}")
    if "fla" in a.sides and not any(res.get("fla") for _, res in rows):
        log("fla: peer not run (not importable here: carry fla-core's wheel)")


if __name__ == "__main__":
    main()
