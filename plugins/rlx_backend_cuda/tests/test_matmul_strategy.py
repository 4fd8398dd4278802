"""The CUDA matmul's strategy choice (ops.matmul_strategy), pinned on a table of cases.

The decision reads only shapes, strides, dtypes, alignment and what is to fuse, so it runs
here without a GPU: each case is built over NumPy arrays (given a device pointer) through
the same `MatmulCase.of` the builder uses. The table was checked against the choices of the
single `_matmul` this decision was split out of (its every builder and cuBLAS call traced
on a fake builder, over these and ~1100 more cases)."""
from __future__ import annotations

import types

import numpy as np
import pytest
from rlx_core.ir.dtype import BF16, F16, F32, F64

from rlx_backend_cuda import ops
from rlx_backend_cuda.values import V

STORAGE = {F16: np.float16, BF16: np.uint16, F32: np.float32, F64: np.float64}


class DeviceArray(np.ndarray):
    """A NumPy array with CuPy's `.data.ptr` (its first byte's address)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def value(shape, dt, strides=None, offset=0) -> V:
    """A value of `shape` with element `strides` (None: contiguous), `offset` elements into
    a 64-byte aligned buffer (an odd offset of a 16-bit value: not 16-byte aligned)."""
    item = np.dtype(STORAGE[dt]).itemsize
    strides = strides or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    span = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    raw = np.zeros((span + offset) * item + 64, np.uint8)
    start = -raw.__array_interface__["data"][0] % 64
    buf = raw[start:start + (span + offset) * item].view(STORAGE[dt])
    arr = np.lib.stride_tricks.as_strided(buf[offset:], tuple(shape), tuple(s * item for s in strides))
    return V(arr.view(DeviceArray), dt)


NUMPY_AS_CUPY = types.SimpleNamespace(broadcast_to=lambda x, shape: np.broadcast_to(x, shape, subok=True))


def strategy(a, w, out, ta=False, tb=False, swiglu=None, epilogue=False, dt=F16) -> str:
    """The strategy of a[shape] @ w[shape] -> out[shape]; each argument a shape or (shape,
    element strides[, offset]); swiglu likewise; epilogue: one that passed `_lt_fits`."""
    def make(spec):
        if spec is None:
            return None
        if isinstance(spec[0], tuple):
            return value(spec[0], dt, *spec[1:])
        return value(spec, dt)
    out = make(out)
    bias = (value(out.shape[-1:], dt), "relu") if epilogue else None
    call = ops.MatmulCall(make(a), make(w), ta, tb, out, make(swiglu), bias)
    return ops.matmul_strategy(ops.MatmulCase.of(NUMPY_AS_CUPY, call))


# (case, arguments of `strategy`, today's choice)
TABLE = [
    # one 2-D product: cuBLAS, or the GEMV (up to 2 rows) or the tensor-core GEMV (3-64 rows) for
    # 16-bit decode rows against W [N, K]
    ("f32 decode row", dict(a=(1, 64), w=(96, 64), out=(1, 96), tb=True, dt=F32), ops.BLAS),
    ("f64 decode row", dict(a=(1, 64), w=(96, 64), out=(1, 96), tb=True, dt=F64), ops.BLAS),
    ("f16 decode row, W [N, K]", dict(a=(1, 64), w=(96, 64), out=(1, 96), tb=True), ops.GEMV),
    ("bf16 decode row, W [N, K]", dict(a=(1, 64), w=(96, 64), out=(1, 96), tb=True, dt=BF16), ops.GEMV),
    ("f16 two rows (GEMV_MAX_M)", dict(a=(2, 64), w=(96, 64), out=(2, 96), tb=True), ops.GEMV),
    ("f16 three rows: past GEMV_MAX_M", dict(a=(3, 64), w=(96, 64), out=(3, 96), tb=True), ops.GEMV_TC),
    ("bf16 64 rows (GEMV_TC_MAX_M)", dict(a=(64, 64), w=(96, 64), out=(64, 96), tb=True, dt=BF16),
     ops.GEMV_TC),
    ("f16 65 rows: past GEMV_TC_MAX_M", dict(a=(65, 64), w=(96, 64), out=(65, 96), tb=True), ops.BLAS),
    ("f16 three rows, K not a multiple of 32", dict(a=(3, 40), w=(96, 40), out=(3, 96), tb=True), ops.BLAS),
    ("f32 three rows", dict(a=(3, 64), w=(96, 64), out=(3, 96), tb=True, dt=F32), ops.BLAS),
    ("f16 W [K, N] (row-major: not the GEMV's)", dict(a=(1, 64), w=(64, 96), out=(1, 96)), ops.BLAS),
    ("f16 K not a multiple of 8", dict(a=(1, 60), w=(96, 60), out=(1, 96), tb=True), ops.BLAS),
    ("f16 x misaligned", dict(a=((1, 64), None, 1), w=(96, 64), out=(1, 96), tb=True), ops.BLAS),
    ("f16 W misaligned", dict(a=(1, 64), w=((96, 64), None, 1), out=(1, 96), tb=True), ops.BLAS),
    ("f16 x transposed", dict(a=(64, 1), w=(96, 64), out=(1, 96), ta=True, tb=True), ops.BLAS),
    ("f16 x strided rows (2 rows)", dict(a=((2, 64), (128, 1)), w=(96, 64), out=(2, 96), tb=True), ops.BLAS),
    ("f16 output rows strided", dict(a=(1, 64), w=(96, 64), out=((2, 96), (192, 1)), tb=True), ops.BLAS),
    ("f16 prefill rows", dict(a=(5, 24), w=(40, 24), out=(5, 40), tb=True), ops.BLAS),
    # batched: x [..., M, K] @ one weight flattens its rows into one GEMM first
    ("x [2, 3, K] @ W", dict(a=(2, 3, 32), w=(40, 32), out=(2, 3, 40), tb=True), ops.ROWS),
    ("x [1, 1, K] @ W", dict(a=(1, 1, 32), w=(40, 32), out=(1, 1, 40), tb=True), ops.ROWS),
    ("x [2, 3, K] @ W into rows of a concat", dict(a=(2, 3, 32), w=(32, 40), out=((2, 3, 40), (240, 80, 1))),
     ops.ROWS),
    ("x [2, 3, K] transposed @ W", dict(a=(2, 32, 3), w=(32, 40), out=(2, 3, 40), ta=True), ops.BLAS),
    ("x strided @ W", dict(a=((2, 3, 32), (192, 64, 1)), w=(32, 40), out=(2, 3, 40)), ops.BLAS),
    ("attention scores [B, H, S, D] @ [B, H, D, T]", dict(a=(2, 3, 4, 8), w=(2, 3, 8, 5), out=(2, 3, 4, 5)),
     ops.BLAS),
    ("weights broadcast over a batch", dict(a=(2, 3, 4, 8), w=(1, 3, 8, 5), out=(2, 3, 4, 5)), ops.BLAS),
    ("batched decode rows, one W [1, N, K]", dict(a=(1, 1, 64), w=(1, 96, 64), out=(1, 1, 96), tb=True),
     ops.GEMV),
    ("batched decode rows, W [1, N, K] broadcast to 2",
     dict(a=(2, 1, 64), w=(1, 96, 64), out=(2, 1, 96), tb=True),
     ops.GEMV),
    ("batched decode rows, a W per row",
     dict(a=(2, 1, 64), w=(2, 96, 64), out=(2, 1, 96), tb=True), ops.BLAS),
    ("batched 3 rows, one W: M * batch past GEMV_MAX_M",
     dict(a=(3, 1, 64), w=(1, 96, 64), out=(3, 1, 96), tb=True),
     ops.GEMV_TC),
    # layouts cuBLAS cannot take
    ("3-D output of no row stride",
     dict(a=(2, 3, 16), w=(2, 16, 8), out=((2, 3, 8), (1, 16, 2))), ops.STAGED),
    ("3-D output of no row stride, 2-D W",
     dict(a=(2, 3, 16), w=(16, 8), out=((2, 3, 8), (1, 16, 2))), ops.STAGED),
    ("column-major 2-D output", dict(a=(3, 16), w=(16, 8), out=((3, 8), (1, 3))), ops.STAGED),
    ("W of every other column", dict(a=(2, 16), w=((16, 24), (48, 2)), out=(2, 24)), ops.REPACKED),
    ("x of every other element", dict(a=((3, 16), (32, 2)), w=(24, 16), out=(3, 24), tb=True), ops.REPACKED),
    ("x column-major (a layout cuBLAS takes)", dict(a=((2, 16), (1, 2)), w=(16, 24), out=(2, 24)), ops.BLAS),
    # fused SwiGLU: only the GEMVs compute it
    ("swiglu, decode row", dict(a=(1, 64), w=(128, 64), out=(1, 128), tb=True, swiglu=(1, 64)), ops.GEMV),
    ("swiglu, two rows", dict(a=(2, 64), w=(128, 64), out=(2, 128), tb=True, swiglu=(2, 64)), ops.GEMV),
    ("swiglu, three rows (the tensor-core GEMV's)",
     dict(a=(3, 64), w=(128, 64), out=(3, 128), tb=True, swiglu=(3, 64)), ops.GEMV_TC),
    ("swiglu, three rows, K not a multiple of 32",
     dict(a=(3, 40), w=(128, 40), out=(3, 128), tb=True, swiglu=(3, 64)), ops.UNFUSABLE),
    ("swiglu, three rows into strided rows",
     dict(a=(3, 64), w=(128, 64), out=(3, 128), tb=True, swiglu=((3, 64), (128, 1))), ops.UNFUSABLE),
    ("swiglu, 65 rows", dict(a=(65, 64), w=(128, 64), out=(65, 128), tb=True, swiglu=(65, 64)),
     ops.UNFUSABLE),
    ("swiglu, W [K, N]", dict(a=(1, 64), w=(64, 128), out=(1, 128), swiglu=(1, 64)), ops.UNFUSABLE),
    ("swiglu, bf16", dict(a=(1, 64), w=(128, 64), out=(1, 128), tb=True, swiglu=(1, 64), dt=BF16), ops.GEMV),
    ("swiglu, x [1, 1, K] @ W", dict(a=(1, 1, 64), w=(128, 64), out=(1, 1, 128), tb=True, swiglu=(1, 1, 64)),
     ops.ROWS),
    ("swiglu strided, x [2, 1, K] @ W (no row flattening)",
     dict(a=(2, 1, 64), w=(128, 64), out=(2, 1, 128), tb=True, swiglu=((2, 1, 64), (128, 64, 1))), ops.GEMV),
    ("swiglu, W of every other column",
     dict(a=(1, 64), w=((64, 128), (256, 2)), out=(1, 128), swiglu=(1, 64)),
     ops.UNFUSABLE),
    # bias/activation epilogue: cuBLASLt for one GEMM, never with the GEMV
    ("epilogue, prefill rows",
     dict(a=(8, 32), w=(48, 32), out=(8, 48), tb=True, epilogue=True), ops.LT_EPILOGUE),
    ("epilogue, f32 decode row", dict(a=(1, 32), w=(48, 32), out=(1, 48), tb=True, epilogue=True, dt=F32),
     ops.LT_EPILOGUE),
    ("epilogue, f16 decode row (the GEMV's)",
     dict(a=(1, 32), w=(48, 32), out=(1, 48), tb=True, epilogue=True),
     ops.UNFUSABLE),
    ("epilogue, f16 decode row, W [K, N]", dict(a=(1, 32), w=(32, 48), out=(1, 48), epilogue=True),
     ops.LT_EPILOGUE),
    ("epilogue, x [2, 8, K] @ W",
     dict(a=(2, 8, 32), w=(48, 32), out=(2, 8, 48), tb=True, epilogue=True), ops.ROWS),
    ("epilogue, a batch of weights", dict(a=(2, 2, 32), w=(2, 32, 48), out=(2, 2, 48), epilogue=True),
     ops.UNFUSABLE),
    ("epilogue, x of every other element", dict(a=((3, 16), (32, 2)), w=(24, 16), out=(3, 24), tb=True,
                                                epilogue=True), ops.UNFUSABLE),
]


@pytest.mark.parametrize("args, expected", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_matmul_strategy_is_todays(args, expected):
    assert strategy(**args) == expected


def test_table_covers_every_strategy():
    """Each strategy is pinned by at least one case (a new one needs rows of its own)."""
    names = {ops.ROWS, ops.STAGED, ops.REPACKED, ops.GEMV, ops.GEMV_TC, ops.LT_EPILOGUE, ops.BLAS,
             ops.UNFUSABLE}
    assert names == set(ops._MATMUL_STRATEGIES) == {row[2] for row in TABLE}


def test_batch_calls_merge_chained_dims():
    """[2, 3] batch dims whose strides chain in A, W and out are one strided-batched call of
    6; a broadcast W (stride 0 in one dim only) splits them into 2 calls of 3."""
    offsets, inner = ops._batch_calls((2, 3), (96, 32), (120, 40), (60, 20), 20)
    assert (offsets, inner) == ([(0, 0, 0)], (6, 32, 40, 20))
    offsets, inner = ops._batch_calls((2, 3), (96, 32), (0, 40), (60, 20), 20)
    assert (offsets, inner) == ([(0, 0, 0), (96, 0, 60)], (3, 32, 40, 20))
    assert ops._batch_calls((1, 1), (0, 0), (0, 0), (20, 20), 20) == ([(0, 0, 0)], (1, 0, 0, 20))
