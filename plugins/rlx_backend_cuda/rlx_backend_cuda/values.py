"""What the runner and the op builders share: the run-time switches, device values and
no-copy reshape strides (a room of its own, so neither imports the other)."""
from __future__ import annotations

import math
import os

from rlx_core.ir.dtype import DType

# dependent_launch: RLX_CUDA_DEPENDENT_LAUNCH=0 launches every kernel as CuPy does (device.Kernel)
# gemv_fusion (read at build): residual RMSNorms computed inside the decode GEMVs (ops.GemvNorm);
# RLX_CUDA_GEMV_FUSION=0 builds the norms as launches. On by default since it won on the H200 (2026-12-04):
# Llama-1B-shaped decode b1 1.043 ms/step on vs 1.105 off, Qwen3.5-2B 1.639 vs 1.697 ms/token
# (benchmarks/README.md, llm_gpu.py)
# rope_norm (read at build): q/k RMSNorms computed by the RoPE launch reading them (ops.RopeNorm);
# RLX_CUDA_ROPE_NORM=0 builds them as launches of their own
# int8_gemv (read at build): under activations = "int8" the decode GEMVs round x themselves and
# multiply in dp4a (ops.py's int8 activations); RLX_CUDA_INT8_GEMV=0 rounds x in a kernel of its own
# before the float GEMV
# gemv_tc: 16-bit decode products of 3-64 x rows on the tensor-core GEMV (ops.GEMV_TC), not
# cuBLAS. Off: measured slower on the H200 (Llama-1B batch 32 2.43 ms/step against 1.83 in
# session 30; benchmarks/README.md, llm_gpu section); RLX_CUDA_GEMV_TC=1 turns it on
# attn_rope (read at build): a decode step's RoPE launch (q, k and v into their caches, the q/k
# norms) done by the cluster decode attention reading them (ops.AttnRope). Off: measured no faster
# on the H200 (benchmarks/README.md, qwen35_gpu). RLX_CUDA_ATTN_ROPE=1 turns it on
# attn_epilogue (read at build): the elementwise node reading a decode attention's output (an
# output gate) computed in that attention's store (ops.AttnEpilogue). Off, likewise:
# RLX_CUDA_ATTN_EPILOGUE=1 turns it on
CONFIG = {"gemv": True, "tc_attention": True, "wg_attention": True, "lt_epilogue": True, "graphs": True,
          "short_attention": os.environ.get("RLX_CUDA_SHORT_ATTENTION", "1") != "0",
          "decode_attention": os.environ.get("RLX_CUDA_DECODE_ATTENTION", "1") != "0",
          "copy16": os.environ.get("RLX_CUDA_COPY16", "1") != "0",
          "dependent_launch": os.environ.get("RLX_CUDA_DEPENDENT_LAUNCH", "1") != "0",
          "gemv_fusion": os.environ.get("RLX_CUDA_GEMV_FUSION", "1") != "0",
          "rope_norm": os.environ.get("RLX_CUDA_ROPE_NORM", "1") != "0",
          "int8_gemv": os.environ.get("RLX_CUDA_INT8_GEMV", "1") != "0",
          "gemv_tc": os.environ.get("RLX_CUDA_GEMV_TC", "0") != "0",
          "attn_rope": os.environ.get("RLX_CUDA_ATTN_ROPE", "0") != "0",
          "attn_epilogue": os.environ.get("RLX_CUDA_ATTN_EPILOGUE", "0") != "0", "version": 0}


def set_config(**kw) -> None:
    """Switch implementation choices at run time (graphs are re-captured)."""
    for k, v in kw.items():
        if k not in CONFIG or k == "version":
            raise KeyError(f"unknown cuda backend option {k!r}; options: {sorted(CONFIG)}")
        CONFIG[k] = v
    CONFIG["version"] += 1


class V:
    """A device value: a cupy array over storage dtype plus the logical DType."""
    __slots__ = ("arr", "dt")

    def __init__(self, arr, dt: DType):
        self.arr, self.dt = arr, dt

    @property
    def shape(self) -> tuple:
        return tuple(self.arr.shape)

    @property
    def es(self) -> tuple:
        """Strides in elements."""
        isz = self.arr.itemsize
        return tuple(s // isz for s in self.arr.strides)

    @property
    def size(self) -> int:
        return int(self.arr.size)

    def contiguous(self) -> bool:
        return bool(self.arr.flags.c_contiguous)


def contiguous_strides(shape) -> tuple:
    """Element strides of a C-contiguous array of `shape`."""
    return tuple(math.prod(shape[j + 1:]) for j in range(len(shape)))


def nocopy_reshape_strides(shape, strides, newshape):
    """Strides for viewing (shape, strides) as newshape without a copy, or None
    (numpy's _attempt_nocopy_reshape)."""
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    new = list(newshape)
    if math.prod(shape) == 0 or math.prod(newshape) == 0:
        return None
    out = [0] * len(new)
    oi = ni = 0
    od = [d for d, _ in old]
    os_ = [s for _, s in old]
    nd = [d for d in new]
    oj = nj = 0
    while ni < len(nd) and oi < len(od):
        np_, op = nd[ni], od[oi]
        nj, oj = ni + 1, oi + 1
        while np_ != op:
            if np_ < op:
                np_ *= nd[nj]
                nj += 1
            else:
                op *= od[oj]
                oj += 1
        for ok in range(oi, oj - 1):
            if os_[ok] != od[ok + 1] * os_[ok + 1]:
                return None
        out[nj - 1] = os_[oj - 1]
        for nk in range(nj - 1, ni, -1):
            out[nk - 1] = out[nk] * nd[nk]
        ni, oi = nj, oj
    last = out[ni - 1] if ni >= 1 else 1
    for nk in range(ni, len(nd)):
        out[nk] = last
    # dims of size 1 anywhere: any stride works
    return tuple(out)


__all__ = ["CONFIG", "set_config", "V", "contiguous_strides", "nocopy_reshape_strides"]
