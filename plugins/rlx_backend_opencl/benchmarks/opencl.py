"""Matmul GFLOP/s of the OpenCL backend at 1024^3 fp32 (the tiled local-memory kernel),
against the peer in the same run: numpy (BLAS) on a CPU device, cuBLAS through CuPy when
CuPy is importable and the device is a GPU. Prints the hardware and the ratio.

    python plugins/rlx_backend_opencl/benchmarks/opencl.py [--n 1024] [--device SEL] [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--device", default=None, help="OpenCL device selector (see RLX_OPENCL_DEVICE)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)

    import rlx_core
    from rlx_core import CompileProfile, Graph

    from rlx_backend_opencl import OpenCLBackend

    b = OpenCLBackend(args.device)
    ok, why = b.availability()
    if not ok:
        print(f"OpenCL backend unavailable: {why}")
        return 1
    dev = b.device
    d = dev.dev
    n = args.n
    flop = 2.0 * n ** 3
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host      : {cpu_model()} ({os.cpu_count()} logical cpus, load average {load:.2f}), "
          f"python {sys.version.split()[0]}, numpy {np.__version__}")
    print(f"device    : {dev.name}; {d.max_compute_units} compute units, {d.max_clock_frequency} MHz, "
          f"{d.global_mem_size / 2**30:.1f} GiB, local mem {d.local_mem_size // 1024} KiB, "
          f"{'GPU' if dev.is_gpu else 'CPU'}")

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    w = rng.standard_normal((n, n), dtype=np.float32)
    g = Graph.define("mm", lambda m: m.matmul(m.input("a", (n, n)), m.input("b", (n, n))))
    ex = rlx_core.compile(g, profile=CompileProfile().evolve(fusion={"skip": True}), backend=b)
    t0 = time.perf_counter()
    out = ex.run(a=a, b=w)["out"]
    first = time.perf_counter() - t0
    err = float(np.max(np.abs(out - a @ w)) / np.max(np.abs(a @ w)))
    runner = ex.runner({})

    def kernel_only():
        runner.enqueue()
        dev.queue.finish()

    t_cl = best(kernel_only, args.reps)
    t_e2e = best(lambda: ex.run(a=a, b=w), max(3, args.reps // 4))
    t_np = best(lambda: np.matmul(a, w), args.reps)
    gf = lambda t: flop / t / 1e9  # noqa: E731
    print(f"matmul {n}^3 fp32 (first run incl. kernel build {first:.2f} s, max rel err {err:.1e})")
    print(f"  opencl tiled kernel : {t_cl * 1e3:9.3f} ms  {gf(t_cl):9.1f} GFLOP/s")
    print(f"  opencl run() e2e    : {t_e2e * 1e3:9.3f} ms  {gf(t_e2e):9.1f} GFLOP/s  (upload + kernel + readback)")
    print(f"  numpy (host BLAS)   : {t_np * 1e3:9.3f} ms  {gf(t_np):9.1f} GFLOP/s")
    print(f"  ratio opencl/numpy  : {t_np / t_cl:.3f}")
    if dev.is_gpu:
        try:
            import cupy as cp
        except Exception as e:  # no CUDA stack here
            print(f"  cuBLAS (cupy)       : not measured ({type(e).__name__}: {e})")
        else:
            ca, cb = cp.asarray(a), cp.asarray(w)
            cp.matmul(ca, cb)
            cp.cuda.Device().synchronize()
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            ts = []
            for _ in range(args.reps):
                start.record()
                cp.matmul(ca, cb)
                stop.record()
                stop.synchronize()
                ts.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
            t_cu = min(ts)
            print(f"  cuBLAS (cupy)       : {t_cu * 1e3:9.3f} ms  {gf(t_cu):9.1f} GFLOP/s")
            print(f"  ratio opencl/cuBLAS : {t_cu / t_cl:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
