"""Generated and hand-written kernels of one backend, two source trees: A/B of each kernel's time.

    python benchmarks/kernels_ab.py --backend cuda --base-tree /tmp/base       # base vs this tree
    python benchmarks/kernels_ab.py --backend numba --base-rev HEAD~5

Each side runs in its own process (its tree first on PYTHONPATH, so its rlx_core and plugins
are imported), sides alternate `--rounds` times and each kernel keeps its best time. A kernel's
time is the sum of its graph's steps as the backend's run_profiled clocks them (CUDA events on
cuda, the host clock on the CPU backends): input uploads are not counted. Prints new/base.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import log, run_child  # noqa: E402
from hardware import cpu_name  # noqa: E402

ROWS, COLS = 4096, 4096


def cases(backend: str) -> list:
    """(name, op, attrs, [(input dims, dtype)]): the elementwise and row kernels."""
    dts = ("f32", "bf16") if backend == "cuda" else ("f32",)
    out = []
    for dt in dts:
        x = [((ROWS, COLS), dt)]
        for fn in ("gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "relu"):
            out.append((f"activation {fn} {dt}", "activation", {"fn": fn}, x))
        out.append((f"binary mul {dt}", "binary", {"op": "mul"}, x * 2))
        out.append((f"fused_swiglu {dt}", "fused_swiglu", {}, x * 2))
        out.append((f"softmax {dt}", "softmax", {"axis": -1}, x))
        out.append((f"rms_norm {dt}", "rms_norm", {"eps": 1e-6}, x + [((COLS,), dt)]))
        out.append((f"layer_norm {dt}", "layer_norm", {"eps": 1e-5}, x + [((COLS,), dt), ((COLS,), dt)]))
        out.append((f"reduce sum {dt}", "reduce", {"op": "sum", "axes": (-1,)}, x))
        out.append((f"reduce max {dt}", "reduce", {"op": "max", "axes": (-1,)}, x))
        out.append((f"cumsum {dt}", "cumsum", {"axis": -1}, x))
    v = [((64, 131072), "f32")]
    out.append(("argmax f32 64x128k", "argmax", {"axis": -1}, v))
    out.append(("topk 50 f32 64x128k", "topk", {"k": 50, "axis": -1}, v))
    return out


def side(backend: str, repeat: int) -> dict:
    """This process's times (seconds, best of `repeat`) of every case."""
    from rlx_core.ir.dtype import DType
    from rlx_core.testing.parity import compile_on, one_op, rand
    from rlx_core.testing.parity import Arg

    rng = np.random.default_rng(0)
    times = {}
    for name, op, attrs_, ins in cases(backend):
        args = [Arg(f"x{i}", rand(rng, dims, DType.parse(dt)), DType.parse(dt)) for i, (dims, dt) in enumerate(ins)]
        exe = compile_on(one_op(op, args, attrs_), backend)
        inputs = {a.name: a.data.astype(a.dtype.np) for a in args}
        runner = exe.runner(exe._bind_dims(inputs))
        best = float("inf")
        for _ in range(repeat + 2):
            _, steps = runner.run_profiled(inputs)
            best = min(best, sum(t for _, t in steps))
        times[name] = best
    return times


def tree_path(tree: str, rest: str) -> str:
    """PYTHONPATH putting `tree`'s rlx_core and plugins ahead of what is installed."""
    plugins = os.path.join(tree, "plugins")
    return os.pathsep.join([tree] + [os.path.join(plugins, p) for p in sorted(os.listdir(plugins))] + [rest])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--base-tree", help="a source tree of the base (a checkout or an unpacked git archive)")
    ap.add_argument("--base-rev", help="a git revision of this repository, unpacked into a temporary tree")
    ap.add_argument("--base-extra", help="PYTHONPATH entries after the base tree (where its plugins' "
                    "metadata is installed; default: the inherited PYTHONPATH)")
    ap.add_argument("--new-extra", help="the same for this tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        print(json.dumps(side(a.backend, a.repeat)))
        return
    new = os.path.dirname(HERE)
    base = a.base_tree
    if base is None:
        if not a.base_rev:
            ap.error("give --base-tree or --base-rev")
        base = tempfile.mkdtemp(prefix="rlx-base-")
        subprocess.run(f"git -C {new} archive {a.base_rev} | tar -x -C {base}", shell=True, check=True)
    log(f"kernels A/B on backend {a.backend}; CPU {cpu_name()}")
    best: dict = {"base": {}, "new": {}}
    rest = os.environ.get("PYTHONPATH", "")
    for r in range(a.rounds):
        for label, tree, extra in (("base", base, a.base_extra), ("new", new, a.new_extra)):
            cmd = [sys.executable, os.path.join(HERE, "kernels_ab.py"), "--side", "--backend", a.backend,
                   "--repeat", str(a.repeat)]
            os.environ["PYTHONPATH"] = tree_path(tree, rest if extra is None else extra)
            got = run_child(cmd, f"{label} round {r + 1}", 1800)
            if got is None:
                return 1
            for k, t in got.items():
                best[label][k] = min(best[label].get(k, float("inf")), t)
    worst = 0.0
    log(f"{'kernel':28s} {'base us':>10s} {'new us':>10s} {'new/base':>9s}")
    for k in best["base"]:
        b, n = best["base"][k], best["new"].get(k, float("nan"))
        worst = max(worst, n / b)
        log(f"{k:28s} {b * 1e6:10.1f} {n * 1e6:10.1f} {n / b:9.3f}")
    log(f"slowest ratio new/base: {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
