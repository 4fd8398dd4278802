"""The numba packed GEMV by rows of x, against the kernel before it and decode + BLAS (issue 48).

A decode step of `rows` streams, or a mixed step carrying a prompt's piece, multiplies every
packed weight of SmolLM2-135M Q4_1 by a few rows of x: per layer q/k/v as one [960, 576], o
[576, 576], gate/up as one [3072, 576], down [576, 1536] (q4_1; 30 layers, each its own
random weights, so they stream from memory as a model's do), and the tied head [49152, 576]
(q8_0). Three ways, in this one process, interleaved `--repeat` times:

* `gemv`: quant_kernels' GEMV (for 2+ rows, each lane group of a packed row decoded once
  into a register and multiply-added into every row's accumulator);
* `l1`: the GEMV before it (2026-12-03), reproduced here: each packed row decoded into an L1
  buffer, then one float dot product per row of x (two loads an FMA);
* `blas`: the path above GEMV_MAX_M rows, decode to a scratch + BLAS (quant_kernels._matmul).

Printed: milliseconds for the whole model's matmuls by rows (process CPU time, the least of
the repeats: on a shared machine the wall clock counts the co-tenants' turns too, and they
only ever slow a run), what each row adds over one row, and the ratios; with the load average
and the CPU. `--threads` sets numba's threads (at 2, CPU time counts both).

    flock /tmp/bench.lock python benchmarks/gemv_rows.py --threads 1 --rows 1,2,3,4,5,8,9,12,16
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name, loadavg  # noqa: E402

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)


def l1_gemv(mod):
    """The GEMV of 2+ rows before the register tile: a packed row decoded into an L1 buffer,
    then a float dot product (two loads an FMA) per row of x."""
    from numba import njit, prange
    from rlx_backend_numba.simd import fma, hsum, load_f32, zeros
    decode = mod.decode
    opt = dict(error_model="numpy", fastmath={"reassoc", "contract"})

    @njit(**opt)
    def fdot(a, x):
        a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
        for p in range(0, x.shape[0], 32):
            a0 = fma(load_f32(a, p), load_f32(x, p), a0)
            a1 = fma(load_f32(a, p + 8), load_f32(x, p + 8), a1)
            a2 = fma(load_f32(a, p + 16), load_f32(x, p + 16), a2)
            a3 = fma(load_f32(a, p + 24), load_f32(x, p + 24), a3)
        return hsum((a0 + a1) + (a2 + a3))

    @njit(parallel=True, **opt)
    def gemv(x, w, o, tab):
        m_, k_ = x.shape
        n_ = w.shape[0]
        for t in prange((n_ + 15) // 16):
            buf = np.empty(k_, np.float32)
            for n in range(16 * t, min(16 * (t + 1), n_)):
                decode(w[n], buf, tab)
                for m in range(m_):
                    o[m, n] = fdot(buf, x[m])
    return gemv


def weights(rng, layers: int) -> list:
    """(scheme, packed rows, N, K) of every matmul of a decode step."""
    from rlx_core.ir.quant import QuantScheme
    out = []
    for name, shapes in (("q4_1", LAYER * layers), ("q8_0", (HEAD,))):
        s = QuantScheme.parse(name)
        for n, k in shapes:
            raw = s.quantize(rng.standard_normal((n, k)).astype(np.float32))
            out.append((s, raw.reshape(n, -1), n, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,12,16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--sides", default="gemv,l1,blas")
    a = ap.parse_args()
    import numba
    from rlx_backend_numba import quant_kernels as Q
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    ws = weights(rng, a.layers)
    mods = {s.kind: Q.drivers(s.kind) for s, *_ in ws}
    old = {kind: l1_gemv(mod) for kind, mod in mods.items()}
    sides = {
        "gemv": lambda x, s, w, o: mods[s.kind].gemv(x, w, o, Q.F16),
        "l1": lambda x, s, w, o: old[s.kind](x, w, o, Q.F16),
        "blas": lambda x, s, w, o: Q._matmul(x, w, mods[s.kind], s.kind, o, "blas"),
    }
    names = a.sides.split(",")
    rows = [int(r) for r in a.rows.split(",")]
    print(f"# {cpu_name()}, {a.threads} thread(s), SmolLM2-135M's packed matmuls ({a.layers} layers + head), "
          f"load {loadavg()}", flush=True)
    times = {(n, m): [] for n in names for m in rows}
    for m in rows:                                   # compile and check every side against the first
        x = rng.uniform(-1, 1, (m, 1536)).astype(np.float32)
        s, w, n, k = ws[3]
        want = None
        for name in names:
            o = np.empty((m, n), np.float32)
            sides[name](np.ascontiguousarray(x[:, :k]), s, w, o)
            want = o if want is None else want
            scale = float(np.abs(want).max())
            assert np.allclose(o, want, rtol=1e-4, atol=1e-5 * scale), f"{name} differs at {m} rows"
    for _ in range(a.repeat):
        for m in rows:
            xs = {k: rng.uniform(-1, 1, (m, k)).astype(np.float32) for k in (576, 1536)}
            outs = [np.empty((m, n), np.float32) for _, _, n, _ in ws]
            for name in names:
                fn = sides[name]
                t = time.process_time()
                for (s, w, n, k), o in zip(ws, outs):
                    fn(xs[k], s, w, o)
                times[name, m].append(time.process_time() - t)
    med = {key: min(v) * 1e3 for key, v in times.items()}
    print(f"{'rows':>5} " + " ".join(f"{n + ' ms':>10} {'+/row':>6}" for n in names)
          + "".join(f" {n + '/' + names[0]:>10}" for n in names[1:]))
    for m in rows:
        cells = []
        for n in names:
            base = med.get((n, 1), med[n, m])
            cells.append(f"{med[n, m]:10.2f} {(med[n, m] - base) / max(m - 1, 1):6.2f}")
        print(f"{m:5d} " + " ".join(cells) + "".join(f" {med[n, m] / med[names[0], m]:10.2f}" for n in names[1:]))
    print(f"# load {loadavg()}; python benchmarks/gemv_rows.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
