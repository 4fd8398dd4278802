"""Decode attention on the GPU: the attention op alone (q [B, H, 1, D], a left-padding key mask
[B, 1, 1, Sk], the cache position, K/V caches as states), checked against the float64
reference (`rlx_core.testing.parity.ref_attention`) and timed as a replayed CUDA graph.
Prints us per launch and the K/V bytes the valid keys hold over that time, against the
device-to-device copy rate (read + write bytes).

    python plugins/rlx_backend_cuda/tools/attn_bench.py [--batch 1 8 32 64] [--ctx 384] [--pos 300]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from llm_gpu import copy_bandwidth  # noqa: E402


def case(B, H, KVH, D, Sk, pos, dt, rng, pad=True, kind="causal", window=0, cap=0.0):
    """(graph, inputs, states, reference) of one decode attention; rows left-padded by up to
    a quarter of pos (pad) and each at its own position (pos + row % 3)."""
    from rlx_core.ir.dtype import BOOL, I32
    from rlx_core.ir.graph import Graph
    from rlx_core.testing.parity import ref_attention

    q = rng.standard_normal((B, H, 1, D)).astype(np.float32).astype(dt.np)
    k = rng.standard_normal((B, KVH, Sk, D)).astype(np.float32).astype(dt.np)
    v = rng.standard_normal((B, KVH, Sk, D)).astype(np.float32).astype(dt.np)
    p = np.minimum(pos + np.arange(B) % 3, Sk - 1).astype(np.int32)
    mask = np.ones((B, 1, 1, Sk), bool)
    if pad:
        for b in range(B):
            mask[b, ..., :rng.integers(0, max(1, pos // 4))] = False
    a = dict(mask_kind=kind, window=window, softcap=cap, scale=D ** -0.5)

    def f(m):
        kv = m.state("k", k.shape, dt), m.state("v", v.shape, dt)
        return m.attention(m.input("q", q.shape, dt), *kv, m.input("mask", mask.shape, BOOL),
                           m.input("pos", (B,), I32), **a)
    ref = ref_attention(*(np.asarray(t, np.float64) for t in (q, k, v)), mask, p, **a)
    return Graph.define("attn", f), {"q": q, "mask": mask, "pos": p}, {"k": k, "v": v}, ref


def timed(runner, reps=200) -> float:
    """Seconds per replay of the runner's launches captured as one CUDA graph (median of 5)."""
    import cupy as cp

    runner._capture()
    s = runner.stream
    ts = []
    with s:
        for _ in range(5):
            runner.graph.launch(s)
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            for _ in range(reps):
                runner.graph.launch(s)
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / reps)
    return float(np.median(ts))


SWEEP = {"ATTN_LOADS": (1, 2, 4), "ATTN_THREADS": (64, 128), "ATTN_BLOCKS_PER_SM": (1, 2, 4),
         "ATTN_MIN_CHUNK": (16, 32, 64, 128)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[384, 2048])
    ap.add_argument("--pos", type=float, default=0.75, help="position as a fraction of ctx")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 64], help="H KVH D (Llama-3.2-1B)")
    ap.add_argument("--compare", action="store_true", help="also time each case on each decode kernel "
                    "that applies (CONFIG short_attention, decode_attention: the short-context, decode "
                    "and split-K kernels)")
    ap.add_argument("--sweep", action="store_true", help="also time each launch-shape constant of ops.py "
                    "(ATTN_*) at the values of SWEEP, the others at their defaults")
    a = ap.parse_args()
    import rlx_core
    from rlx_core.ir.dtype import BF16

    bw = copy_bandwidth()
    H, KVH, D = a.heads
    rng = np.random.default_rng(0)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; H {H}, KV heads {KVH}, head dim {D}, bf16")
    print("| batch | ctx | pos | us/launch | valid K/V MB | TB/s | x copy rate | rel err vs f64 |")
    print("|---|---|---|---|---|---|---|---|")
    runs = []
    for ctx in a.ctx:
        pos = int(ctx * a.pos)
        for B in a.batch:
            g, ins, st, ref = case(B, H, KVH, D, ctx, pos, BF16, rng)
            exe = rlx_core.compile(g, backend="cuda", states={n: v for n, v in st.items()})

            def check(exe=exe, ins=ins, ref=ref):
                out = exe.run(dict(ins))["out"]
                return np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
            e = check()
            r = next(iter(exe._runners.values()))
            t = timed(r)
            if a.compare:                 # the launch on each kernel (one that does not apply: split-K)
                from rlx_backend_cuda.values import set_config

                cells = []
                for name in ("short", "decode", "split"):
                    set_config(short_attention=name == "short", decode_attention=name == "decode")
                    r._build()
                    cells.append(f"{name} {timed(r) * 1e6:.1f} us (rel err {check():.1e})")
                set_config(short_attention=True, decode_attention=True)
                r._build()
                print("  " + "; ".join(cells), flush=True)
            nbytes = 2 * D * 2 * KVH * int((ins["pos"].astype(np.int64) + 1).sum())
            runs.append((B, ctx, r, check, nbytes))
            print(f"| {B} | {ctx} | {pos} | {t * 1e6:.1f} | {nbytes / 1e6:.1f} | {nbytes / t / 1e12:.2f} | "
                  f"{nbytes / t / bw:.2f} | {e:.1e} |", flush=True)
    if not a.sweep:
        return
    from rlx_backend_cuda import ops

    print("\nsweep: us/launch per (batch, ctx): " + " ".join(f"{B}/{ctx}" for B, ctx, *_ in runs))
    for name, values in SWEEP.items():
        keep = getattr(ops, name)
        for val in values:
            setattr(ops, name, val)
            cells, worst = [], 0.0
            for B, ctx, r, check, nbytes in runs:
                r._build()
                worst = max(worst, check())
                cells.append(f"{timed(r) * 1e6:.1f}")
            print(f"  {name}={val}: {' '.join(cells)} (worst rel err {worst:.1e})", flush=True)
        setattr(ops, name, keep)
        for *_, r, _, _ in runs:
            r._build()


if __name__ == "__main__":
    main()
