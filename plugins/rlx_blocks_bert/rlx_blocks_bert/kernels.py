"""`bert.dense`: act(x @ W^T + b) as one custom op (registered through rlx_register_ops),
with a NumPy kernel tuned for encoder shapes.

Why a custom op: on the NumPy backend the generic `linear` runs `np.matmul` on [B, S, K]
activations, which numpy executes as B separate small GEMMs (about 2x slower than one
[B*S, K] GEMM for sentence-length S), and the generic `gelu` evaluates erf in float64
(tens of ms per layer). This kernel flattens the leading dims into one BLAS call and
computes the exact (erf) GELU in float32, in cache-sized chunks, to |error| < 4e-7 * |x|.

The blocks emit it only when the backend has a kernel for it (`backend.supports_custom`);
everywhere else they emit the generic `linear` + activation, which compute the same thing.
"""
from __future__ import annotations

import math

import numpy as np

from rlx_core.ir.custom import CustomOp
from rlx_core.ir.errors import ShapeError
from rlx_core.ir.shape import Shape

NAME = "bert.dense"
ACTS = ("identity", "gelu", "gelu_tanh", "relu", "silu", "tanh", "sigmoid")

# Abramowitz & Stegun 7.1.26: erfc(a) ~ t * poly(t) * exp(-a^2), t = 1 / (1 + P a), a >= 0,
# |erf error| < 1.5e-7. Coefficients halved: the kernel wants 0.5 * erfc = Phi(-|x|).
_P = np.float32(0.3275911)
_A = [np.float32(0.5 * c) for c in (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)]
_INV_SQRT2 = np.float32(1.0 / math.sqrt(2.0))
_CHUNK = 1 << 15                      # elements per chunk: 128 KiB of float32, stays in L2


def gelu_inplace(y: np.ndarray) -> np.ndarray:
    """y <- y * Phi(y), exact-erf GELU, float32, in place (y contiguous float32)."""
    flat = y.reshape(-1)
    n = flat.size
    a = np.empty(min(n, _CHUNK), np.float32)
    t = np.empty_like(a)
    p = np.empty_like(a)
    for s in range(0, n, _CHUNK):
        v = flat[s:s + _CHUNK]
        k = v.size
        av, tv, pv = a[:k], t[:k], p[:k]
        np.abs(v, out=av)
        av *= _INV_SQRT2                       # a = |x| / sqrt(2)
        np.multiply(av, _P, out=tv)
        tv += np.float32(1.0)
        np.reciprocal(tv, out=tv)              # t = 1 / (1 + P a)
        np.multiply(tv, _A[0], out=pv)
        for c in _A[1:]:
            pv += c
            pv *= tv                           # 0.5 * t * poly(t)
        np.square(av, out=av)
        np.negative(av, out=av)
        np.exp(av, out=av)
        pv *= av                               # h = Phi(-|x|)
        # Phi(x) = 1 - h for x >= 0, h for x < 0;  gelu = x * Phi(x)
        np.subtract(np.float32(1.0), pv, out=pv, where=v >= 0)
        v *= pv
    return y


def _sigmoid(y):
    return np.exp(-np.logaddexp(0, -y)).astype(y.dtype, copy=False)


def _act(y: np.ndarray, act: str) -> np.ndarray:
    if act == "identity":
        return y
    if act == "gelu":
        return gelu_inplace(y) if y.dtype == np.float32 else (
            0.5 * y * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(y / math.sqrt(2.0)))).astype(y.dtype)
    if act == "gelu_tanh":
        return 0.5 * y * (1.0 + np.tanh(np.asarray(math.sqrt(2 / math.pi), y.dtype) * (y + np.asarray(0.044715, y.dtype) * y ** 3)))
    if act == "relu":
        return np.maximum(y, 0, out=y)
    if act == "silu":
        return y * _sigmoid(y)
    if act == "tanh":
        return np.tanh(y, out=y)
    if act == "sigmoid":
        return _sigmoid(y)
    raise ShapeError(f"{NAME}: unknown act {act!r}")


def dense_numpy(x, w, b=None, *, act: str = "identity"):
    """act(x @ w^T + b) for x [..., K], w [N, K] (HF layout), b [N]; one GEMM over all rows."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    compute = np.float32 if x.dtype in (np.float16,) or str(x.dtype) == "bfloat16" else x.dtype
    if x2.dtype != compute:
        x2 = x2.astype(compute)
    wt = w.T if w.dtype == compute else w.astype(compute).T
    y = x2 @ wt
    if b is not None:
        y += b.astype(compute, copy=False)
    y = _act(y, act)
    return y.reshape(x.shape[:-1] + (w.shape[0],))


def dense_meta(shapes, params):
    x, w = shapes[0], shapes[1]
    if params.get("act", "identity") not in ACTS:
        raise ShapeError(f"{NAME}: act must be one of {ACTS}, got {params.get('act')!r}")
    if w.rank != 2 or x.rank < 1:
        raise ShapeError(f"{NAME}: needs x [..., K] and w [N, K], got {x} and {w}")
    k, n = x.dims[-1], w.dims[1]
    if isinstance(k, int) and isinstance(n, int) and k != n:
        raise ShapeError(f"{NAME}: x {x} and w {w} disagree on K")
    if len(shapes) > 2 and (shapes[2].rank != 1 or shapes[2].dims[0] != w.dims[0]):
        raise ShapeError(f"{NAME}: bias {shapes[2]} does not match w {w}")
    if len(shapes) > 3:
        raise ShapeError(f"{NAME}: takes x, w and an optional bias, got {len(shapes)} inputs")
    return (Shape(x.dims[:-1] + (w.dims[0],), x.dtype),)


DENSE = CustomOp(NAME, dense_meta, {"numpy": dense_numpy},
                 doc="act(x @ W^T + b) with HF-layout W [N, K]; one GEMM over the flattened rows")
