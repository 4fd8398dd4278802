"""fft / ifft / rfft / irfft on cuFFT, called directly (ctypes on the libcufft CuPy loaded,
like blas.py) so a transform is one capturable step of the runner's CUDA graph.

The axis is moved last into a contiguous scratch (C2R also overwrites its input), one
batched 1-D plan per node transforms every row, and numpy's `norm` scaling rides on the
copy into the output. irfft reads only the real parts of the DC and (even n) Nyquist bins,
as numpy does: their imaginary parts are zeroed in the scratch first.
"""
from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
from rlx_core.ir.dtype import C64, F32
from rlx_core.ir.errors import BackendError

from . import device
from .values import V

R2C, C2R, C2C = 0x2A, 0x2C, 0x29
FORWARD, INVERSE = -1, 1
_FORWARD_OPS = ("fft", "rfft")


def _find_lib() -> str:
    try:
        import cupy.cuda.cufft  # noqa: F401  (makes CuPy load libcufft)
    except ImportError as e:
        raise BackendError(f"cuda backend: FFT ops need CuPy's cuFFT module: {e}") from None
    return device.required_library("cuFFT", "libcufft.so")


class Lib:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        i, vp, ip = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
        self.plan_many = lib.cufftPlanMany
        self.plan_many.argtypes = [ip, i, ip, ip, i, i, ip, i, i, i, i]
        self.set_stream = lib.cufftSetStream
        self.set_stream.argtypes = [i, vp]
        self.exec = {C2C: lib.cufftExecC2C, R2C: lib.cufftExecR2C, C2R: lib.cufftExecC2R}
        self.exec[C2C].argtypes = [i, vp, vp, i]
        self.exec[R2C].argtypes = self.exec[C2R].argtypes = [i, vp, vp]
        self.destroy = lib.cufftDestroy
        self.destroy.argtypes = [i]

    @staticmethod
    def check(status: int, what: str) -> None:
        if status:
            raise BackendError(f"cuda backend: {what} failed with cuFFT status {status}")


@functools.lru_cache(maxsize=1)
def library() -> Lib:
    return Lib(_find_lib())


class Plan:
    """A batched 1-D cuFFT plan of length n over contiguous rows; destroyed with its step."""

    def __init__(self, kind: int, n: int, batch: int, op: str):
        self.lib, self.kind = library(), kind
        h = ctypes.c_int()
        dims = (ctypes.c_int * 1)(n)
        idist, odist = {C2C: (n, n), R2C: (n, n // 2 + 1), C2R: (n // 2 + 1, n)}[kind]
        self.lib.check(self.lib.plan_many(ctypes.byref(h), 1, dims, None, 1, idist, None, 1, odist,
                                          kind, batch), f"cufftPlanMany for op {op!r} (n={n}, batch={batch})")
        self.handle, self.op = h.value, op

    def run(self, stream: int, src: int, dst: int, direction: int) -> None:
        self.lib.check(self.lib.set_stream(self.handle, stream), "cufftSetStream")
        args = (self.handle, src, dst) + ((direction,) if self.kind == C2C else ())
        self.lib.check(self.lib.exec[self.kind](*args), f"cuFFT exec of op {self.op!r}")

    def __del__(self):
        try:
            self.lib.destroy(self.handle)
        except Exception:        # interpreter shutdown: the library may be gone already
            pass


def _norm_scale(op: str, norm: str, n: int) -> float:
    """numpy.fft's factor: `backward` scales the inverse by 1/n, `forward` the forward,
    `ortho` both by 1/sqrt(n)."""
    if norm == "ortho":
        return 1 / math.sqrt(n)
    return 1 / n if (norm == "forward") == (op in _FORWARD_OPS) else 1.0


def _scalar(value: float) -> V:
    """A 0-d device constant (outside the runner's poisoned scratch)."""
    return V(device.from_host(np.asarray(value, np.float32), "an FFT constant"), F32)


def _zero_imag(b, xs: V, n: int) -> None:
    """Zero the imaginary parts of bin 0 and, for even n, bin n / 2 of contiguous rows xs."""
    pairs = xs.arr.view(np.float32).reshape(xs.shape + (2,))
    for k in (0,) + ((n // 2,) if n % 2 == 0 else ()):
        b.copy(_scalar(0.0), V(pairs[..., k, 1], F32))


def build_fft(b, n, ins, outs):
    x, y = ins[0], outs[0]
    if device.info().get("hip"):
        raise BackendError(f"cuda backend: op {n.op!r} has no ROCm kernel (cuFFT only)")
    if y.size == 0:
        return
    ax = n.a["axis"] % len(x.shape)
    length = (y if n.op == "irfft" else x).shape[ax]
    kind = {"rfft": R2C, "irfft": C2R}.get(n.op, C2C)
    src = b.moved_last(x, (ax,))
    xs = b.buffer(src.shape, F32 if kind == R2C else C64, "FFT rows")
    b.copy(src, xs)
    if kind == C2R:
        _zero_imag(b, xs, length)
    target = b.moved_last(y, (ax,))
    scale = _norm_scale(n.op, n.a["norm"], length)
    ys = target if target.contiguous() and scale == 1.0 else b.buffer(target.shape, y.dt, "FFT result")
    plan = Plan(kind, length, xs.size // xs.shape[-1], n.op)
    stream, direction = b.stream.ptr, FORWARD if n.op in _FORWARD_OPS else INVERSE
    b.add(lambda: plan.run(stream, xs.arr.data.ptr, ys.arr.data.ptr, direction))
    if scale != 1.0:
        b.elementwise(((("binary", (("op", "mul"),), (0, 1))),), [ys, _scalar(scale)], target)
    elif ys is not target:
        b.copy(ys, target)


__all__ = ["build_fft"]
