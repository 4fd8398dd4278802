"""Matmul GFLOP/s of the OpenCL backend at 1024^3 fp32 (the tiled local-memory kernel),
against the peer in the same run: numpy (BLAS) on a CPU device, cuBLAS through CuPy when
CuPy is importable and the device is a GPU. On a GPU with the CUDA backend installed it also
times SmolLM2-135M decode (fp32) on both backends. Prints the hardware and the ratios.

    python benchmarks/opencl.py [--n 1024] [--device SEL] [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name  # noqa: E402




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
    print(f"host      : {cpu_name()} ({os.cpu_count()} logical cpus, load average {load:.2f}), "
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
        smollm2_decode()
    return 0


def smollm2_decode(prompt_tokens: int = 128, new_tokens: int = 64) -> None:
    """SmolLM2-135M fp32 decode ms/token, OpenCL vs the CUDA backend (same weights)."""
    import rlx_core
    from rlx_core.plugins import registry

    cuda = registry().backends.get("cuda")
    if cuda is None or not cuda.availability()[0]:
        print("smollm2 decode: CUDA backend not available, not measured")
        return
    try:
        from rlx_core.weights import resolve_model_path

        path = os.environ.get("RLX_SMOLLM2_GGUF") or resolve_model_path("smollm2")
    except Exception as e:
        print(f"smollm2 decode: weights not available ({e})")
        return
    times = {}
    for name in ("opencl", "cuda"):
        m = rlx_core.load(path, backend=name, progress=False)
        text = "The history of the printing press begins in the fifteenth century. " * 20
        ids = np.array([m.tokenizer.encode(text)[:prompt_tokens]])
        m.generate(ids, max_new_tokens=4, min_new_tokens=4)
        best = min((m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens),
                    m.last_timings["decode_s_per_token"])[1] for _ in range(2))
        times[name] = best
    print(f"smollm2-135M fp32 decode ({prompt_tokens}-token prompt, {new_tokens} tokens): "
          f"opencl {times['opencl'] * 1e3:.2f} ms/token, cuda {times['cuda'] * 1e3:.2f} ms/token, "
          f"ratio opencl/cuda {times['opencl'] / times['cuda']:.2f}x (target <= 3x)")


if __name__ == "__main__":
    sys.exit(main())
