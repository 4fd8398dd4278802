"""One Gated DeltaNet layer's gated_delta_rule on the CPU, prefill at several lengths: RLX's numba
kernel vs the same op as its composite (the recurrence scan, legalized onto the NumPy backend),
RLX's NumPy kernel, and transformers' torch_chunk_gated_delta_rule (the reference PyTorch
function HF's Qwen3.5 / Qwen3-Next run without flash-linear-attention), in one run.

    .venv/bin/python benchmarks/deltanet_cpu.py [--threads 2] [--lengths 512,1024,2048,4096]
        [--heads 16] [--key-heads 16] [--dim 128] [--repeat 3] [--scan-max 4096]

The shape is a Qwen3.5-2B-like linear-attention layer: batch 1, 16 value heads, K = V = 128,
float32, q and k L2-normalized, beta in (0, 1), log-decays in (-1, 0), a nonzero start state;
the same inputs (seeded per length) go to every side. Each side and length runs in its own
process (a BLAS or OpenMP pool spinning after one side would slow the next), pinned to the
same `--threads` cores when the machine has more; numba's threads, BLAS's and torch's are set
to `--threads`. Prints the hardware and load average; per length each side's best and median
ms over `--repeat` timed calls after a warm-up call, ms per 1k tokens (constant when time grows
linearly with the length), the ratios numba / other side, and each side's largest difference
from the numba side's output (relative to its largest |value|). The composed scan is skipped
past `--scan-max` tokens (it runs step by step: seconds at 4k); a side that is not installed
(numba, torch / transformers) is reported so, never given a ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import log, run_child  # noqa: E402
from hardware import cpu_name, pin, loadavg  # noqa: E402

SIDES = ("numba", "scan", "numpy", "hf")
LABEL = {"numba": "RLX numba kernel", "scan": "RLX composed scan (legalized, NumPy backend)",
         "numpy": "RLX NumPy kernel", "hf": "HF torch_chunk_gated_delta_rule"}


def make_inputs(t: int, args) -> dict:
    """The layer's inputs for `t` tokens, float32, the same for every side (seeded by t)."""
    import numpy as np

    rng = np.random.default_rng(t)
    h, hk, d = args.heads, args.key_heads, args.dim

    def unit(shape):
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    return {"q": unit((1, t, hk, d)), "k": unit((1, t, hk, d)),
            "v": rng.standard_normal((1, t, h, d)).astype(np.float32),
            "g": -rng.uniform(0.0, 1.0, (1, t, h)).astype(np.float32),
            "beta": rng.uniform(0.0, 1.0, (1, t, h)).astype(np.float32),
            "state": rng.uniform(-1.0, 1.0, (1, h, d, d)).astype(np.float32)}


def _rlx_runner(side: str, x: dict, args):
    """fn() running the one-op graph on the side's backend (the scan: the NumPy backend
    without the op's kernel, so the pipeline legalizes it into its composite)."""
    from rlx_core.ir.dtype import F32
    from rlx_core.ir.graph import Builder
    from rlx_core.pipeline import compile as compile_graph

    m = Builder("gdn_layer", "mir")
    vals = [m.input(n, a.shape, F32) for n, a in x.items()]
    o, s = m.add("gated_delta_rule", tuple(vals), scale=args.dim ** -0.5, chunk=args.chunk)
    m.output("o", o)
    m.output("state", s)
    g = m.build()
    if side == "scan":
        from rlx_core.testing.parity import numpy_without

        ctx = numpy_without({"gated_delta_rule"}, "numpy-no-gdn")
        exe = compile_graph(g, backend=ctx.__enter__())
        assert "gated_delta_rule" not in {n.op for n in exe.mir.nodes}, "the scan side kept the fused op"
    else:
        exe = compile_graph(g, backend=side)
    return lambda: exe.run(x)["o"]


def _hf_runner(x: dict, args):
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    torch.set_num_threads(args.threads)
    tx = {n: torch.from_numpy(a) for n, a in x.items()}

    def run():
        with torch.no_grad():
            o, _ = torch_chunk_gated_delta_rule(tx["q"], tx["k"], tx["v"], tx["g"], tx["beta"], chunk_size=64,
                                                initial_state=tx["state"], output_final_state=True)
        return o.numpy()
    return run


def child(args) -> None:
    """One side at one length in its own process: a warm-up call, `--repeat` timed calls."""
    import numpy as np

    x = make_inputs(args.length, args)
    run = _hf_runner(x, args) if args.child == "hf" else _rlx_runner(args.child, x, args)
    t0 = time.perf_counter()
    out = np.asarray(run())
    first = time.perf_counter() - t0
    times = []
    for _ in range(1 if args.child == "scan" else args.repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    np.save(args.out, out)
    print(json.dumps({"times": times, "first": first}))


def missing(side: str) -> str | None:
    """Why a side cannot run here, or None."""
    import importlib.util

    if side == "hf":
        for mod in ("torch", "transformers"):
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not installed"
        return None
    if side == "numba":
        from rlx_core.ir.registry import registry

        b = registry().backends.get("numba")
        if b is None:
            return "not installed (pip install ./plugins/rlx_backend_numba)"
        return b.availability()[1] or None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--chunk", type=int, default=64, help="the op's chunk attr")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scan-max", type=int, default=4096, help="longest input the composed scan runs")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RLX_NUM_THREADS"):
        os.environ[var] = str(args.threads)          # before numpy / numba / torch load their pools
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    pinned = "not pinned (--no-pin)" if args.no_pin else pin(args.threads)
    if args.child:
        return child(args)

    import numpy as np

    load0 = loadavg()
    lengths = [int(t) for t in args.lengths.split(",")]
    sides, why = [], {}
    for side in args.sides.split(","):
        (sides.append(side) if missing(side) is None else why.setdefault(side, missing(side)))
    log(f"CPU: {cpu_name()} ({platform.machine()}), {pinned}, {args.threads} threads; "
        f"python {platform.python_version()}, numpy {np.__version__}")
    log(f"layer: batch 1, {args.heads} value heads, {args.key_heads} key heads, K = V = {args.dim}, f32, "
        f"chunk {args.chunk}")
    for side, reason in why.items():
        log(f"{LABEL[side]}: {reason} (no ratio)")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t in lengths:
            for side in sides:
                if side == "scan" and t > args.scan_max:
                    continue
                out = os.path.join(tmp, f"{side}_{t}.npy")
                cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--length", str(t),
                       "--out", out, "--threads", str(args.threads), "--heads", str(args.heads),
                       "--key-heads", str(args.key_heads), "--dim", str(args.dim), "--chunk", str(args.chunk),
                       "--repeat", str(args.repeat)]
                cmd += ["--no-pin"] if args.no_pin else []
                res = run_child(cmd, f"{side} T={t}", timeout=3600)
                if res is not None:
                    res["out"] = np.load(out).astype(np.float64)
                    results[(side, t)] = res
    log(f"\nload average: {load0} before, {loadavg()} after")
    log(f"{'T':>6} {'side':<46} {'best ms':>10} {'median ms':>10} {'ms / 1k tok':>12} {'numba / side':>13} "
        f"{'max |diff|':>11}")
    for t in lengths:
        base = results.get(("numba", t))
        for side in sides:
            r = results.get((side, t))
            if r is None:
                continue
            ts = sorted(r["times"])
            best, med = ts[0] * 1e3, ts[len(ts) // 2] * 1e3
            ratio = diff = "-"
            if base is not None:
                ratio = f"{min(base['times']) / ts[0]:.3f}" if side != "numba" else "1"
                ref = base["out"]
                diff = f"{np.max(np.abs(r['out'] - ref)) / max(np.max(np.abs(ref)), 1e-30):.1e}"
            per_k = best / t * 1e3
            log(f"{t:>6} {LABEL[side]:<46} {best:>10.1f} {med:>10.1f} {per_k:>12.2f} {ratio:>13} {diff:>11}")


if __name__ == "__main__":
    main()
