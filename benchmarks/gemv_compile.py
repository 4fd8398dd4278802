"""Cold compile of the numba packed GEMV, by format and by function (CI's and a first run's cost).

Each format in a process of its own with empty caches (NUMBA_CACHE_DIR and RLX_NUMBA_CACHE in
a fresh temporary folder: nothing of numba's or of the generated kernels is on disk), timing
the first calls of `gemv` at 1 row and at `--rows` rows (the first compiles gemv and every
tile, the second finds them compiled) and then, in the same fresh cache, a second process
doing the same (what a warm cache costs: loading, not compiling). Seconds of process CPU time
(compiling runs on one thread; a shared machine's other jobs then move the times less than
the wall clock's). numba's compile events give each function's own seconds (its callees'
compiles subtracted), summed by name.

    flock /tmp/bench.lock .venv/bin/python benchmarks/gemv_compile.py
    .venv/bin/python benchmarks/gemv_compile.py --formats q4_1,q4_k --top 6
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name, loadavg  # noqa: E402

K, N = 512, 64


def child(kind: str, rows: int) -> None:
    """Time gemv's first calls for `kind` here; print one JSON line."""
    from numba.core import event as ev

    spent: dict = collections.defaultdict(float)
    stack: list = []

    class Own(ev.Listener):
        """Each compile's own seconds: its nested compiles (callees) subtracted."""

        def on_start(self, event):
            stack.append([time.process_time(), 0.0])

        def on_end(self, event):
            t0, inner = stack.pop()
            dur = time.process_time() - t0
            if stack:
                stack[-1][1] += dur
            spent[event.data["dispatcher"].py_func.__qualname__] += dur - inner

    ev.register("numba:compile", Own())
    import numpy as np
    from rlx_core.ir.quant import QuantScheme
    from rlx_backend_numba import quant_kernels as Q

    rng = np.random.default_rng(0)
    s = QuantScheme.parse(kind)
    raw = s.quantize(rng.standard_normal((N, K)).astype(np.float32))
    t = {}
    for m in (1, rows):
        x = rng.uniform(-1, 1, (m, K)).astype(np.float32)
        t0 = time.process_time()
        Q.dequant_gemv(x, raw, s)
        t[m] = time.process_time() - t0
    print(json.dumps({"first": t[1], "more": t[rows], "spent": spent}))


def run(kind: str, rows: int, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache, "static"), RLX_NUMBA_CACHE=cache)
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--rows", str(rows)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    from rlx_backend_numba.quant_kernels import FORMATS, GEMV_TILE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--top", type=int, default=4, help="functions printed a format, by their own seconds")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.rows)
    print(f"# {cpu_name()}, GEMV_TILE {GEMV_TILE}, load {loadavg()}", flush=True)
    print(f"{'format':>6} {'cold 1 row':>10} {'+rows':>6} {'warm':>6}  most compile seconds of their own")
    total = 0.0
    for kind in a.formats.split(","):
        with tempfile.TemporaryDirectory(prefix="gemv-compile-") as cache:
            cold, warm = run(kind, a.rows, cache), run(kind, a.rows, cache)
        total += cold["first"] + cold["more"]
        top = sorted(cold["spent"].items(), key=lambda kv: -kv[1])[:a.top]
        print(f"{kind:>6} {cold['first']:10.1f} {cold['more']:6.1f} {warm['first'] + warm['more']:6.2f}  "
              + ", ".join(f"{n} {v:.1f}" for n, v in top), flush=True)
    print(f"# all formats cold: {total:.1f} s; load {loadavg()}; python benchmarks/gemv_compile.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
