"""Decode GEMV on the GPU: rlx_gemv variants (rows per warp R, loads in flight U, one warp a
row; then the warps a row ops.gemv_split picks; the SwiGLU epilogue) against cuBLAS, for the
Llama-3.2-1B decode shapes, each timed as 50 launches replayed in one CUDA graph (as a decode
step runs; cuBLAS back to back). Prints GB/s of weight bytes read.

    python plugins/rlx_backend_cuda/tools/gemv_sweep.py
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from rlx_backend_cuda import codegen, sources
from rlx_backend_cuda.ops import GEMV_LOADS, NO_NORMS, gemv_split

SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
          ("lm_head", 128256, 2048)]


def loop_time(fn, reps=50, rounds=5) -> float:
    """For cuBLAS (CuPy cannot call it under stream capture): back-to-back launches."""
    fn()
    best = 1e9
    for _ in range(rounds):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(a, b) / 1e3 / reps)
    return best


def graph_time(fn, reps=50, rounds=5) -> float:
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()
        s.synchronize()
        s.begin_capture()
        for _ in range(reps):
            fn()
        g = s.end_capture()
        g.upload(s)
        g.launch(s)
        s.synchronize()
        best = 1e9
        for _ in range(rounds):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(a, b) / 1e3 / reps)
    return best


def main():
    x = cp.random.standard_normal((1, 8192), dtype=cp.float32).astype(cp.float16)
    src = cp.empty(1 << 29, cp.uint8)
    dst = cp.empty_like(src)
    bw = 2 * src.nbytes / graph_time(lambda: dst.__setitem__(Ellipsis, src), reps=5)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: D2D copy {bw / 1e9:.0f} GB/s (read+write)")
    for name, N, K in SHAPES:
        w = (cp.random.standard_normal((N, K), dtype=cp.float32) * 0.02).astype(cp.float16)
        xk = x[:, :K]
        ref = (xk.astype(cp.float32) @ w.astype(cp.float32).T)
        y = cp.empty((1, N), cp.float16)
        t = loop_time(lambda: cp.matmul(xk, w.T, out=y))
        line = [f"{name:8s} N={N:6d} K={K:5d} {w.nbytes / 1e6:6.1f} MB  cublas {w.nbytes / t / 1e9:5.0f} GB/s ({t * 1e6:5.1f} us)"]
        ks = gemv_split(N, K, cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"])
        args = (xk, np.int64(K), w, y, np.int32(1), np.int32(N), np.int32(K)) + NO_NORMS
        variants = [(r, u, 1, f"R{r}U{u}") for r, u in ((1, 4), (1, 8), (2, 4), (2, 8), (4, 4))]
        variants.append((1, GEMV_LOADS, ks, f"ops' choice R1U{GEMV_LOADS} {ks} warps a row"))
        for r, u, s, label in variants:
            fn = cp.RawKernel(sources.render(sources.GEMV, T="__half", TO="__half", MMAX=1, R=r, U=u, SWIGLU=0,
                                             KS=s, SWIGLU_OF=codegen.swiglu_of("float"), NORM=0, TN="__half",
                                             RESID=0, EARLY=1), "rlx_gemv")
            t = graph_time(lambda: fn((-(-N // r * s // 8),), (256,), args))
            err = float(cp.max(cp.abs(y.astype(cp.float32) - ref)) / cp.max(cp.abs(ref)))
            flag = "" if err < 1e-2 else f" ERR {err:.3g}"
            line.append(f"{label} {w.nbytes / t / 1e9:5.0f} ({t * 1e6:5.1f} us{flag})")
        if name == "gate_up":
            for u in (4, 8):
                fn = cp.RawKernel(sources.render(sources.GEMV, T="__half", TO="__half", MMAX=1, R=2, U=u, SWIGLU=1,
                                                 KS=1, SWIGLU_OF=codegen.swiglu_of("float"), NORM=0,
                                                 TN="__half", RESID=0, EARLY=1),
                                  "rlx_gemv")
                ys = cp.empty((1, N // 2), cp.float16)
                args = (xk, np.int64(K), w, ys, np.int32(1), np.int32(N // 2), np.int32(K)) + NO_NORMS
                t = graph_time(lambda: fn(((N // 2 + 7) // 8,), (256,), args))
                g, up = ref[:, :N // 2], ref[:, N // 2:]
                sref = g / (1 + cp.exp(-g)) * up
                err = float(cp.max(cp.abs(ys.astype(cp.float32) - sref)) / cp.max(cp.abs(sref)))
                line.append(f"swiglu U{u} {w.nbytes / t / 1e9:5.0f} ({t * 1e6:5.1f} us{'' if err < 1e-2 else f' ERR {err:.3g}'})")
        print("\n    ".join(line), flush=True)


if __name__ == "__main__":
    main()
