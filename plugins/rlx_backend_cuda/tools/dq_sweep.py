"""Packed-weight decode GEMV on the GPU, outside the pipeline: every scheme at Llama-3.2-1B
decode shapes (bf16 x, M = 1). The dequantize kernel is checked against QuantScheme.dequantize
(equal up to FMA contraction), each GEMV variant (rows per warp R, parts in flight per lane U)
against x @ dequant(W)^T, and timed as 50 launches replayed in one CUDA graph. Prints GB/s
of packed bytes read, next to the bf16 rlx_gemv on the same shape.

    python plugins/rlx_backend_cuda/tools/dq_sweep.py [schemes...]
"""
from __future__ import annotations

import sys

import cupy as cp
import ml_dtypes
import numpy as np
from gemv_sweep import graph_time

from rlx_backend_cuda import codegen, sources
from rlx_backend_cuda.ops import NO_NORMS, dq_gemv_shape
from rlx_core.ir.quant import QuantScheme

SHAPES = [("qkv", 3072, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)]
SCHEMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8", "int4"]
VARIANTS = [(4, 1), (8, 1), (2, 1), (4, 2)]


def main(schemes):
    rng = np.random.default_rng(0)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}", flush=True)
    for name, N, K in SHAPES:
        wf = rng.standard_normal((N, K), dtype=np.float32) * 0.02
        xh = rng.standard_normal((1, K), dtype=np.float32).astype(ml_dtypes.bfloat16)
        x = cp.asarray(xh.view(np.uint16))
        wb = cp.asarray(wf.astype(ml_dtypes.bfloat16).view(np.uint16))
        y = cp.empty((1, N), cp.uint16)
        fn = cp.RawKernel(sources.render(sources.GEMV, T="__nv_bfloat16", TO="__nv_bfloat16", MMAX=1, R=1, U=2,
                                         SWIGLU=0, KS=1, SWIGLU_OF=codegen.swiglu_of("float"), NORM=0,
                                         TN="__nv_bfloat16", RESID=0, EARLY=1), "rlx_gemv")
        gargs = (x, np.int64(K), wb, y, np.int32(1), np.int32(N), np.int32(K)) + NO_NORMS
        t = graph_time(lambda: fn(((N + 7) // 8,), (256,), gargs))
        print(f"{name} N={N} K={K}: bf16 rlx_gemv {wb.nbytes / t / 1e9:5.0f} GB/s ({t * 1e6:5.1f} us)", flush=True)
        for sn in schemes:
            s = QuantScheme.parse(sn)
            raw = s.quantize(wf)
            w = cp.asarray(raw)
            nb = K // s.block_size
            deq = cp.empty((N, K), cp.float32)
            shape = sources.dq_dequant_shape(s.kind, s.block_size, 4)
            kd = cp.RawKernel(sources.dq_source(sources.DQ_DEQUANT, s.kind, s.block_size, TO="float", ACC="float",
                                                A=16, YV=1, **shape), "rlx_dequant")
            dargs = (w, np.int64(raw.shape[1]), deq, np.int64(N), np.int32(nb))
            dgrid = (min(-(-N * nb // shape["BPT"]), 132 * 16),)
            td = graph_time(lambda: kd(dgrid, (shape["THREADS"],), dargs))
            want = s.dequantize(raw[:64], (64, K))          # equal up to FMA contraction
            derr = float(np.abs(deq[:64].get() - want).max() / np.abs(want).max())
            ref = (deq.astype(cp.float64) @ cp.asarray(xh.astype(np.float64)).T).T
            line = [f"  {sn:5s} {raw.nbytes / 1e6:6.1f} MB dequant err {derr:.1g} {deq.nbytes / td / 1e9:5.0f} GB/s f32 written"]
            mmax, kw, _ = dq_gemv_shape(s.kind, s.block_size, 1, K)
            yo = cp.empty((1, N), cp.float32)
            for r, u in VARIANTS:
                _, kw, _ = dq_gemv_shape(s.kind, s.block_size, 1, K, u)
                src = sources.dq_source(sources.DQ_GEMV, s.kind, s.block_size, T="__nv_bfloat16", TO="float",
                                        TB="float", ACC="float", A=16, MMAX=1, R=r, U=u, KW=kw, XV=1, SWIGLU=0, EPILOGUE="",
                                        SWIGLU_OF=codegen.swiglu_of("float"), EARLY=1, NORM=0, TN="float",
                                        RESID=0, QX=0, Q8=0, TC=0)
                k = cp.RawKernel(src, "rlx_dq_gemv")
                grid = (-(-N // (8 // kw * r)),)
                args = (x, np.int64(K), w, np.int64(raw.shape[1]), None, yo, np.int32(1), np.int32(N),
                        np.int32(nb), None, None) + NO_NORMS
                t = graph_time(lambda: k(grid, (256,), args))
                err = float(cp.linalg.norm(yo - ref) / cp.linalg.norm(ref))
                line.append(f"R{r}U{u} {raw.nbytes / t / 1e9:5.0f} ({t * 1e6:5.1f} us{'' if err < 1e-5 else f' ERR {err:.2g}'})")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or SCHEMES)
