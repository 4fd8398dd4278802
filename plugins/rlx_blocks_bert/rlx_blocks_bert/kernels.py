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

# Abramowitz & Stegun 7.1.26: erfc(z) ~ t * poly(t) * exp(-z^2), t = 1 / (1 + P z), z >= 0,
# |erf error| < 1.5e-7. Coefficients halved, so the polynomial gives Phi(-|x|) = erfc(|x|/sqrt2)/2.
_P = np.float32(0.3275911)
_A = [np.float32(0.5 * c) for c in (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)]
_INV_SQRT2 = np.float32(1.0 / math.sqrt(2.0))
_CHUNK = 1 << 15                      # elements per chunk: 128 KiB of float32, stays in L2


def _gelu_chunk(v: np.ndarray, u: np.ndarray, z: np.ndarray, t: np.ndarray) -> None:
    """v <- gelu(v) = relu(v) - |v| * Phi(-|v|): no sign branches, ~20 plain float32 passes."""
    np.abs(v, out=u)
    np.multiply(u, _INV_SQRT2, out=z)          # z = |x| / sqrt(2)
    np.multiply(z, _P, out=t)
    t += np.float32(1.0)
    np.reciprocal(t, out=t)                    # t = 1 / (1 + P z)
    p = np.multiply(t, _A[0])
    for c in _A[1:]:
        p += c
        p *= t                                 # 0.5 * t * poly(t)
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    p *= z                                     # Phi(-|x|)
    p *= u                                     # |x| Phi(-|x|)
    np.maximum(v, np.float32(0.0), out=v)
    v -= p


def gelu_inplace(y: np.ndarray) -> np.ndarray:
    """y <- y * Phi(y) (exact-erf GELU to |error| < 1e-7 |y|), float32, in place, in chunks
    that stay in cache (y contiguous)."""
    flat = y.reshape(-1)
    n = flat.size
    k = min(n, _CHUNK)
    u, z, t = np.empty(k, np.float32), np.empty(k, np.float32), np.empty(k, np.float32)
    for s in range(0, n, _CHUNK):
        v = flat[s:s + _CHUNK]
        m = v.size
        _gelu_chunk(v, u[:m], z[:m], t[:m])
    return y


def _sigmoid(y):
    return np.exp(-np.logaddexp(0, -y)).astype(y.dtype, copy=False)


def _act(y: np.ndarray, act: str) -> np.ndarray:
    if act == "identity":
        return y
    if act == "gelu":
        return gelu_inplace(y) if y.dtype == np.float32 and y.flags.c_contiguous else (
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


# ------------------------------------------------------------------------------ packed sequences
# The packed ("varlen") layout: a batch of texts is one row of tokens [1, T], text i being
# tokens [starts[i], starts[i] + lens[i]). Projections then run as single GEMMs over exactly
# the real tokens (no padding), attention runs within each text, pooling per text. Empty
# segments (lens 0) are allowed, so a batch can keep a fixed number of segments.
VARLEN = "bert.varlen_attention"
SEGPOOL = "bert.segment_pool"
POOL_MODES = ("mean", "cls", "max")


def varlen_attention_numpy(q, k, v, starts, lens, *, scale: float):
    """softmax(q k^T * scale) v within each segment; q, k, v [1, heads, T, d]."""
    out = np.zeros(q.shape[:3] + (v.shape[-1],), np.result_type(q.dtype, np.float32))
    q0, k0, v0, o0 = q[0], k[0], v[0], out[0]
    sc = np.asarray(scale, out.dtype)
    for s, n in zip(np.asarray(starts).tolist(), np.asarray(lens).tolist()):
        if n <= 0:
            continue
        a = np.matmul(q0[:, s:s + n], k0[:, s:s + n].transpose(0, 2, 1))      # [h, n, n]
        a *= sc
        a -= a.max(-1, keepdims=True)
        np.exp(a, out=a)
        a /= a.sum(-1, keepdims=True)
        np.matmul(a, v0[:, s:s + n], out=o0[:, s:s + n])
    return out


def _segments_meta(shapes, what):
    starts, lens = shapes[-2], shapes[-1]
    for t, nm in ((starts, "starts"), (lens, "lens")):
        if t.rank != 1 or not t.dtype.is_int:
            raise ShapeError(f"{what}: {nm} must be an int vector [segments], got {t}")
    if starts.dims != lens.dims:
        raise ShapeError(f"{what}: starts {starts} and lens {lens} differ")


def varlen_meta(shapes, params):
    if len(shapes) != 5:
        raise ShapeError(f"{VARLEN}: takes q, k, v, starts, lens; got {len(shapes)} inputs")
    q, k, v = shapes[:3]
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        if t.rank != 4 or t.dims[0] != 1:
            raise ShapeError(f"{VARLEN}: {nm} must be [1, heads, tokens, head_dim], got {t}")
    if q.dims[1] != k.dims[1] or k.dims[1:3] != v.dims[1:3] or q.dims[2] != k.dims[2] or q.dims[3] != k.dims[3]:
        raise ShapeError(f"{VARLEN}: q {q}, k {k}, v {v} do not agree")
    _segments_meta(shapes, VARLEN)
    return (Shape(q.dims[:3] + (v.dims[3],), q.dtype),)


def segment_pool_numpy(x, starts, lens, *, mode: str):
    """Per-segment pooling of x [1, T, H] -> [segments, H] (mean divides by max(n, 1e-9))."""
    x0 = x.reshape(-1, x.shape[-1])
    out = np.zeros((len(starts), x0.shape[-1]), np.result_type(x.dtype, np.float32))
    for i, (s, n) in enumerate(zip(np.asarray(starts).tolist(), np.asarray(lens).tolist())):
        if n <= 0:
            continue
        if mode == "mean":
            np.sum(x0[s:s + n], axis=0, out=out[i])
            out[i] /= np.float32(n)
        elif mode == "cls":
            out[i] = x0[s]
        else:
            np.max(x0[s:s + n], axis=0, out=out[i])
    return out


def segment_pool_meta(shapes, params):
    if params.get("mode") not in POOL_MODES:
        raise ShapeError(f"{SEGPOOL}: mode must be one of {POOL_MODES}, got {params.get('mode')!r}")
    if len(shapes) != 3 or shapes[0].rank != 3 or shapes[0].dims[0] != 1:
        raise ShapeError(f"{SEGPOOL}: takes x [1, tokens, hidden], starts, lens; got {[str(s) for s in shapes]}")
    _segments_meta(shapes, SEGPOOL)
    return (Shape((shapes[1].dims[0], shapes[0].dims[2]), shapes[0].dtype),)


VARLEN_ATTENTION = CustomOp(VARLEN, varlen_meta, {"numpy": varlen_attention_numpy},
                            doc="bidirectional attention within each [start, start+len) segment of packed tokens")
SEGMENT_POOL = CustomOp(SEGPOOL, segment_pool_meta, {"numpy": segment_pool_numpy},
                        doc="mean / cls / max pooling of each segment of packed tokens")
CUSTOM_OPS = (DENSE, VARLEN_ATTENTION, SEGMENT_POOL)
