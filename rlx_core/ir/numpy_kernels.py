"""NumPy kernels for every op of the table: the embedded backend runs them, constant folding
evaluates with them, and they are the reference the other backends are checked against.

A kernel is `fn(a, out, *inputs)` writing into the preallocated `out` list; a view kernel
(`VIEWS`) returns a view instead. f16/bf16 compute in f32 and round once on the way out.
"""
from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np

from . import comm
from .dtype import DType
from .errors import ModelError
from .expr import ACTIVATIONS, BINARY_TABLE, COMPARE_TABLE, NumpyRenderer
from .ops import MaskKind
from .quant import QuantScheme

_LOW = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_F32 = np.dtype(np.float32)


def up(x: np.ndarray) -> np.ndarray:
    """Low-precision floats compute in f32."""
    return x.astype(np.float32) if x.dtype in _LOW else x


def put(out: np.ndarray, value) -> None:
    """value written into out, converted to out's dtype (a complex value into a real buffer
    keeps its real part, the IR's cast, without numpy's ComplexWarning)."""
    if np.iscomplexobj(value) and not np.iscomplexobj(out):
        value = np.real(value)
    np.copyto(out, value, casting="unsafe")


_erf_py = np.vectorize(math.erf, otypes=[np.float64])


def erf(x: np.ndarray) -> np.ndarray:
    """erf; f64 exact via math.erf, f32 by Abramowitz-Stegun 7.1.26 (|err| < 1.5e-7, below
    f32's own rounding at the scale gelu uses it)."""
    if x.dtype == np.float64:
        return _erf_py(x)
    a = np.abs(x)
    t = 1 / (1 + np.float32(0.3275911) * a)
    p = ((((np.float32(1.061405429) * t - np.float32(1.453152027)) * t + np.float32(1.421413741)) * t
          - np.float32(0.284496736)) * t + np.float32(0.254829592)) * t
    y = 1 - p * np.exp(-a * a)
    return np.copysign(y, x).astype(x.dtype, copy=False)


def _sigmoid(x):
    """0.5 * (1 + tanh(x/2)): exact identity, no overflow, ~25x faster than a logaddexp form."""
    h = np.asarray(0.5, x.dtype)
    y = np.tanh(x * h)
    y += 1
    y *= h
    return y


# the expression table's formulas as NumPy callables: erf and sigmoid are the ones above (fast
# f32), recip is np.reciprocal (on complex64 it rounds differently from 1 / z)
NUMPY = NumpyRenderer({"erf": erf, "sigmoid": _sigmoid, "recip": np.reciprocal})
ACT = {n: NUMPY.build("activation", n) for n in ACTIVATIONS}
# GELU = x * Phi(x), f32: Phi tabulated on [-8, 8] in steps of 1/512 as one linear piece per
# step (value and slope stored as complex64, so one gather fetches both): |Phi error| < 4e-8
# inside, and Phi is 0 / 1 to f32 precision outside. About 8 f32 passes and one gather per
# element, in cache-sized chunks and in place, against ~20 passes (and temporaries the size
# of the tensor) for the rational erf: 2-3x faster on an encoder's FFN.
_TAB_RANGE, _TAB_STEP = 8.0, 512.0


def _phi_table() -> np.ndarray:
    n = int(2 * _TAB_RANGE * _TAB_STEP) + 1
    xs = np.arange(n + 1, dtype=np.float64) / _TAB_STEP - _TAB_RANGE
    phi = 0.5 * _erfc_neg(xs)
    slope = (phi[1:] - phi[:-1]) * _TAB_STEP
    icpt = phi[:-1] - slope * xs[:-1]
    # a piece's chord lies below the convex part of Phi and above the concave one: shift by
    # half the midpoint gap so the error is centred (halves the worst case)
    mid = xs[:-1] + 0.5 / _TAB_STEP
    gap = 0.5 * _erfc_neg(mid) - (icpt + slope * mid)
    tab = (icpt + 0.5 * gap) + 1j * slope
    tab[0], tab[-1] = 0.0, 1.0          # saturate: Phi(-8) ~ 6e-16, Phi(8) ~ 1 - 6e-16
    return tab.astype(np.complex64)


def _erfc_neg(xs: np.ndarray) -> np.ndarray:
    """erfc(-x / sqrt(2)) in float64 (exact, math.erfc)."""
    return np.array([math.erfc(-v / math.sqrt(2.0)) for v in xs])


_PHI = _phi_table()
_TAB_LAST = np.float32(len(_PHI) - 1)
_TAB_OFF = np.float32(_TAB_RANGE * _TAB_STEP)
_CHUNK = 1 << 16                      # elements per chunk: the chunk and its temporaries stay in L2


def gelu_f32_inplace(y: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y <- GELU(y + bias), the exact (erf) GELU to |error| < 2e-7 * max(|y|, 1), in place
    (y contiguous f32; bias f32 [y.shape[-1]] or None), in chunks of whole rows. Few, large
    numpy calls: a batch part running in a thread beside another hands the GIL over at each."""
    n = y.shape[-1] if y.ndim and y.shape[-1] <= _CHUNK else 1
    if bias is not None and n == 1:
        y += bias
        bias = None
    rows = y.reshape(-1, n)
    step = max(1, _CHUNK // n)
    k = min(rows.shape[0], step) * n
    f, i, p, ab = (np.empty(k, t) for t in (np.float32, np.int32, np.float32, np.complex64))
    with np.errstate(invalid="ignore"):    # a NaN casts to some index; clipped, its GELU is NaN
        for s in range(0, rows.shape[0], step):
            block = rows[s:s + step]
            if bias is not None:
                block += bias
            v = block.reshape(-1)
            fv, iv, pv, abv = f[:v.size], i[:v.size], p[:v.size], ab[:v.size]
            np.multiply(v, np.float32(_TAB_STEP), out=fv)
            fv += _TAB_OFF
            np.clip(fv, np.float32(0.0), _TAB_LAST, out=fv)
            iv[...] = fv                               # truncation: the piece's index
            _PHI.take(iv, out=abv, mode="clip")
            np.multiply(abv.imag, v, out=pv)
            pv += abv.real                             # Phi(v)
            v *= pv
    return y


def _gelu_fast(o: np.ndarray, *others) -> bool:
    """Whether gelu_f32_inplace applies to output o (and the f32 arrays beside it)."""
    return o.dtype == _F32 and o.flags.c_contiguous and all(x is None or x.dtype == _F32 for x in others)


BIN = {n: NUMPY.build("binary", n, DType.F64) for n in BINARY_TABLE}       # ufuncs: out= works
BIN_INT = {n: NUMPY.build("binary", n, DType.I64) for n in BINARY_TABLE}   # div floors
CMP = {n: NUMPY.build("compare", n) for n in COMPARE_TABLE}
RED = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


def _binary(a, out, x, y):
    o = out[0]
    # integer div floors, whatever the input widths (mixed widths used to truncate)
    f = (BIN_INT if o.dtype.kind in "iu" else BIN)[a["op"]]
    if o.dtype == x.dtype == y.dtype and o.dtype not in _LOW:
        if a["op"] == "div" and o.dtype.kind in "iu":
            put(o, f(x, y))
        else:
            f(x, y, out=o)
    else:
        r = f(up(x).astype(o.dtype) if o.dtype not in _LOW else up(x),
              up(y).astype(o.dtype) if o.dtype not in _LOW else up(y))
        put(o, r)


def _activation(a, out, x):
    o = out[0]
    if a["fn"] == "gelu" and x.dtype == _F32 and _gelu_fast(o):
        if o is not x:
            np.copyto(o, x)
        gelu_f32_inplace(o)
    elif o.dtype in _LOW:
        put(o, ACT[a["fn"]](up(x)))
    elif a["fn"] in ("exp", "tanh", "sqrt", "neg", "abs", "sin", "cos", "log") and x.dtype == o.dtype:
        getattr(np, {"neg": "negative", "abs": "absolute"}.get(a["fn"], a["fn"]))(x, out=o)
    else:
        put(o, ACT[a["fn"]](x))


def _reduce(a, out, x):
    axes = tuple(a["axes"]) if isinstance(a["axes"], tuple) else (a["axes"],)
    axes = tuple(ax % x.ndim for ax in axes) if x.ndim else None
    put(out[0], RED[a["op"]](up(x), axis=axes, keepdims=a["keepdims"]))


def _softmax_f32(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    e /= np.where(s == 0, 1, s)
    return e


def _softmax(a, out, x):
    put(out[0], _softmax_f32(up(x), a["axis"]))


def _rms(x, w, eps, offset):
    xf = up(x)
    y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.asarray(eps, xf.dtype))
    if w is not None:
        wf = up(w)
        y = y * (wf + np.asarray(offset, wf.dtype) if offset else wf)
    return y


def _rms_norm(a, out, x, w=None):
    put(out[0], _rms(x, w, a["eps"], a["offset"]))


def _ln(x, g, b, eps):
    xf = up(x)
    d = xf - np.mean(xf, axis=-1, keepdims=True)
    y = d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + np.asarray(eps, xf.dtype))
    if g is not None:
        y = y * up(g)
    if b is not None:
        y = y + up(b)
    return y


def _layer_norm(a, out, x, g=None, b=None):
    put(out[0], _ln(x, g, b, a["eps"]))


def _softmax_grad(a, out, y, g):
    yf, gf = up(y), up(g)
    put(out[0], yf * (gf - np.sum(gf * yf, axis=a["axis"], keepdims=True)))


def _norm_grad(out, xf, gf, dn, n, inv, centered: bool):
    """dx of n = (x - mean?) * inv with dn the cotangent of n; the rows' sums of g * n and g
    into out[1:] (dweight, and dbeta when there are three outputs)."""
    c = np.mean(dn, axis=-1, keepdims=True) if centered else 0
    put(out[0], inv * (dn - c - n * np.mean(dn * n, axis=-1, keepdims=True)))
    lead = tuple(range(xf.ndim - 1))
    put(out[1], np.sum(gf * n, axis=lead))
    if len(out) > 2:
        put(out[2], np.sum(gf, axis=lead))


def _rms_norm_grad(a, out, x, w, g):
    xf, gf = up(x), up(g)
    inv = 1 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.asarray(a["eps"], xf.dtype))
    wf = up(w).astype(xf.dtype, copy=False) + np.asarray(a["offset"], xf.dtype)
    _norm_grad(out, xf, gf, gf * wf, xf * inv, inv, False)


def _layer_norm_grad(a, out, x, gamma, g):
    xf, gf = up(x), up(g)
    d = xf - np.mean(xf, axis=-1, keepdims=True)
    inv = 1 / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + np.asarray(a["eps"], xf.dtype))
    _norm_grad(out, xf, gf, gf * up(gamma).astype(xf.dtype, copy=False), d * inv, inv, True)


def rope_apply(x, cos, sin, style):
    """Rotate the first 2*R/2 dims of x [B,H,S,D] by tables [S,R/2] or [B,S,R/2]."""
    xf = up(x)
    half = cos.shape[-1]
    c = up(cos).astype(xf.dtype, copy=False)
    s = up(sin).astype(xf.dtype, copy=False)
    c = c[None, None] if c.ndim == 2 else c[:, None]
    s = s[None, None] if s.ndim == 2 else s[:, None]
    out = xf.copy()
    if style == "half":
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:2 * half] = x2 * c + x1 * s
    else:
        x1, x2 = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = x1 * c - x2 * s
        out[..., 1:2 * half:2] = x2 * c + x1 * s
    return out


def _rope(a, out, x, cos, sin):
    put(out[0], rope_apply(x, cos, sin, a["style"]))


def attention_mask(a, b, sq, sk, mask=None, pos=None, q0=0, sq_total=None):
    """Boolean keep-mask [B|1,1,Sq,Sk] (or None) and an additive bias (or None); for a block
    of query rows, `q0` is its first row and `sq_total` the rows of the whole query."""
    kind = MaskKind(a["mask_kind"])
    keep = None
    if kind in (MaskKind.CAUSAL, MaskKind.SLIDING_WINDOW):
        if pos is not None:
            qpos = pos.astype(np.int64)[:, None] + q0 + np.arange(sq)[None, :]
        else:
            qpos = (sk - (sq_total or sq) + q0 + np.arange(sq))[None, :]
        kpos = np.arange(sk)
        keep = kpos[None, None, :] <= qpos[:, :, None]
        if kind is MaskKind.SLIDING_WINDOW:
            keep &= kpos[None, None, :] > qpos[:, :, None] - a["window"]
        keep = keep[:, None]
    bias = None
    if mask is not None:
        if mask.dtype == np.bool_:
            keep = mask if keep is None else (keep & mask)
        else:
            bias = up(mask)
    return keep, bias


# score elements one attention block may hold: past it the query rows go in blocks, so a
# long joint sequence (a DiT's 4608 tokens, 24 heads) never holds its whole [heads, S, S]
_ATTN_BLOCK = 1 << 22


def _query_blocks(qf, kf, mask, pos):
    """(batch slice, row slice, mask, pos, first row) blocks of at most _ATTN_BLOCK scores:
    the whole query when it fits, else one batch row at a time in runs of query rows."""
    b, h, sq, _ = qf.shape
    rows = max(1, _ATTN_BLOCK // max(1, h * kf.shape[2]))
    if b * sq <= rows:
        yield slice(None), slice(None), mask, pos, 0
        return
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    for i in range(b):
        m_b = None if mask is None else mask[min(i, mask.shape[0] - 1)][None]
        p_b = None if pos is None else pos[i:i + 1]
        for s0 in range(0, sq, rows):
            s1 = min(sq, s0 + rows)
            m = None if m_b is None else (m_b if m_b.shape[2] == 1 else m_b[:, :, s0:s1])
            yield slice(i, i + 1), slice(s0, s1), m, p_b, s0


def attention_core(a, q, k, v, mask=None, pos=None):
    qf, kf, vf = up(q), up(k), up(v)
    b, h, sq, _ = qf.shape
    out = np.empty((b, h, sq, vf.shape[-1]), np.result_type(qf.dtype, vf.dtype))
    for bi, rows, m, p, q0 in _query_blocks(qf, kf, mask, pos):
        out[bi, :, rows] = _attention_block(a, qf[bi, :, rows], kf[bi], vf[bi], m, p, q0, sq)
    return out


def _attention_probs(a, qf, kf, mask, pos, q0, sq_total):
    """Probabilities [B, KVH, G*Sq, Sk] of a block of query rows (a kv head's G query heads
    share one [G*Sq, D] @ [D, Sk] product: a plain batched matmul, as a broadcast kv operand
    would drop numpy off BLAS), the queries as [B, KVH, G*Sq, D], and the softcap's tanh."""
    b, h, sq, d = qf.shape
    kvh, sk = kf.shape[1], kf.shape[2]
    g = h // kvh
    q4 = np.ascontiguousarray(qf).reshape(b, kvh, g * sq, d)
    s = np.matmul(q4, kf.swapaxes(-1, -2)).reshape(b, kvh, g, sq, sk)
    s *= np.asarray(a["scale"], s.dtype)
    t = None
    if a["softcap"]:
        cap = np.asarray(a["softcap"], s.dtype)
        t = np.tanh(s / cap)
        s = t * cap
    keep, bias = attention_mask(a, b, sq, sk, mask, pos, q0, sq_total)
    if bias is not None or keep is not None:
        s = s.reshape(b, h, sq, sk)
        if bias is not None:
            s = s + bias
        if keep is not None:
            s = np.where(keep, s, np.asarray(-np.inf, s.dtype))
        s = s.reshape(b, kvh, g, sq, sk)
    return _softmax_f32(s, -1).reshape(b, kvh, g * sq, sk), q4, t


def _attention_block(a, qf, kf, vf, mask=None, pos=None, q0=0, sq_total=None):
    b, h, sq, _ = qf.shape
    p, _, _ = _attention_probs(a, qf, kf, mask, pos, q0, sq_total)
    return np.matmul(p, vf).reshape(b, h, sq, vf.shape[-1])


def _attention_grad_block(a, qf, kf, vf, gf, mask, pos, q0, sq_total):
    """A block of query rows' dq and its parts of dk, dv: dv = P^T g; dS = P (dP - the row's
    sum(P dP)) with dP = g v^T (the row sum from P itself, not from the rounded `out`),
    through the softcap's tanh, times scale; dq = dS k, dk = dS^T q."""
    b, h, sq, d = qf.shape
    kvh = kf.shape[1]
    p, q4, t = _attention_probs(a, qf, kf, mask, pos, q0, sq_total)
    g4 = np.ascontiguousarray(gf).reshape(b, kvh, (h // kvh) * sq, -1)
    dv = np.matmul(p.swapaxes(-1, -2), g4)
    dp = np.matmul(g4, vf.swapaxes(-1, -2))
    ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
    if t is not None:
        ds *= 1 - np.square(t.reshape(ds.shape))
    ds *= np.asarray(a["scale"], ds.dtype)
    return np.matmul(ds, kf).reshape(b, h, sq, d), np.matmul(ds.swapaxes(-1, -2), q4), dv


def _attention_grad(a, out, *ins):
    q, k, v, mask, pos = _split_attn(a, ins[:3] + ins[5:])
    qf, kf, vf, gf = (up(t) for t in (q, k, v, ins[4]))
    dt = np.result_type(qf.dtype, kf.dtype, vf.dtype)
    dq, dk, dv = np.empty(qf.shape, dt), np.zeros(kf.shape, dt), np.zeros(vf.shape, dt)
    for bi, rows, m, p, q0 in _query_blocks(qf, kf, mask, pos):
        parts = _attention_grad_block(a, qf[bi, :, rows], kf[bi], vf[bi], gf[bi, :, rows], m, p, q0,
                                      qf.shape[2])
        dq[bi, :, rows] = parts[0]
        dk[bi] += parts[1]
        dv[bi] += parts[2]
    for o, x in zip(out, (dq, dk, dv)):
        put(o, x)


def _split_attn(a, ins):
    q, k, v, *rest = ins
    mask = rest.pop(0) if a["has_mask"] else None
    pos = rest.pop(0) if a["has_pos"] else None
    return q, k, v, mask, pos


def _attention(a, out, *ins):
    put(out[0], attention_core(a, *_split_attn(a, ins)))


def _mask_fill(a, out, scores, *rest):
    rest = list(rest)
    mask = rest.pop(0) if a["has_mask"] else None
    pos = rest.pop(0) if a["has_pos"] else None
    b, h, sq, sk = scores.shape
    keep, bias = attention_mask(a, b, sq, sk, mask, pos)
    s = up(scores)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = np.where(keep, s, np.asarray(-np.inf, s.dtype))
    put(out[0], s)


def _matmul(a, out, x, y):
    xa = x.swapaxes(-1, -2) if a["trans_a"] else x
    yb = y.swapaxes(-1, -2) if a["trans_b"] else y
    o = out[0]
    if yb.ndim == 2 and xa.ndim > 2 and xa.flags.c_contiguous and o.flags.c_contiguous:
        # [B,S,K] @ [K,N] as one [B*S,K] product: numpy would loop over B small ones
        xa, o = xa.reshape(-1, xa.shape[-1]), o.reshape(-1, o.shape[-1])
    if o.dtype == xa.dtype == yb.dtype and o.dtype not in _LOW:
        np.matmul(xa, yb, out=o)
    else:
        put(o, np.matmul(up(xa), up(yb)))


def _gather(a, out, table, idx):
    ax = a["axis"] % table.ndim
    n = table.shape[ax]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise ModelError(f"gather: index out of range [0, {n}) (min {idx.min()}, max {idx.max()})")
    if out[0].dtype == table.dtype:
        np.take(table, idx, axis=ax, out=out[0])
    else:
        put(out[0], np.take(table, idx, axis=ax))


def _topk(a, out, x):
    k, ax = a["k"], a["axis"] % x.ndim
    xf = up(x)
    order = np.argsort(-xf, axis=ax, kind="stable")
    idx = np.take(order, np.arange(k), axis=ax)
    put(out[1], idx)
    put(out[0], np.take_along_axis(x, idx, axis=ax))


def _kv_write(a, cache, new, pos):
    ax = a["axis"] % cache.ndim
    s = new.shape[ax]
    p = pos.astype(np.int64)
    n = cache.shape[ax]
    if p.size and (p.min() < 0 or p.max() + s > n):
        raise ModelError(f"kv_write: writing {s} entries at position {int(p.max())} overflows the "
                         f"cache of length {n} (context full)")
    if ax == 0:
        raise ModelError("kv_write: axis 0 is the batch axis")
    if p.size and np.all(p == p[0]):
        idx = [slice(None)] * cache.ndim
        idx[ax] = slice(int(p[0]), int(p[0]) + s)
        cache[tuple(idx)] = new
    else:
        for b in range(cache.shape[0]):
            idx = [b] + [slice(None)] * (cache.ndim - 1)
            idx[ax] = slice(int(p[b]), int(p[b]) + s)
            cache[tuple(idx)] = new[b]
    return cache


_kv_write.returns_cache = True      # its output is its first input (runners bind it once)


def _assign(a, state, value):
    state[...] = value
    return state


_assign.returns_cache = True


def _fused_swiglu(a, out, g, u):
    o = out[0]
    if o.dtype == g.dtype == u.dtype == np.float32 and o.shape == g.shape == u.shape:
        # silu(g) * u = g * (0.5 * (1 + tanh(g/2)) * u) with one temporary; `o` may alias g or u
        t = np.multiply(g, np.float32(0.5))
        np.tanh(t, out=t)
        t += 1
        t *= u
        np.multiply(g, t, out=o)
        o *= np.float32(0.5)
        return
    gf = up(g)
    put(o, gf * _sigmoid(gf) * up(u))


def _fused_mba(a, out, x, w, b=None):
    _matmul({"trans_a": False, "trans_b": a["trans_b"]}, out, x, w)
    _fused_mba_epilogue(a, out[0], b)


def _fused_mba_epilogue(a, o, b):
    """o += b, then the activation, in place."""
    if a["act"] == "gelu" and _gelu_fast(o, b):
        gelu_f32_inplace(o, b)             # the bias added chunk by chunk, in cache
        return
    if b is not None:
        if o.dtype == b.dtype and o.dtype not in _LOW:
            o += b
        else:
            put(o, up(o) + up(b))
    if a["act"] != "identity":
        _activation({"fn": a["act"]}, [o], o)


# ----------------------------------------------------------------- packed weights
_DQ_SCRATCH = 1 << 20        # floats a dequant_matmul decodes at a time: bounds its scratch


@functools.lru_cache(maxsize=64)
def scheme(name: str) -> QuantScheme:
    return QuantScheme.parse(name)


def _dequantize(a, out, raw):
    o = out[0]
    if o.flags.c_contiguous:
        scheme(a["scheme"]).dequantize(raw, o.shape, out=o, dtype=o.dtype)
    else:
        put(o, scheme(a["scheme"]).dequantize(raw, o.shape, dtype=o.dtype))


def _quantize(a, out, x):
    put(out[0], scheme(a["scheme"]).quantize(x).reshape(out[0].shape))


def fake_quantized(x: np.ndarray, scheme_name: str) -> np.ndarray:
    """x rounded through the scheme's blocks and back. A block holding NaN or inf comes out
    NaN, as x / d * d does with its NaN or inf scale d (quantize refuses non-finite weights;
    an activation's NaN must reach the logits' finiteness check)."""
    s = scheme(scheme_name)
    blocks = np.asarray(x, np.float32).reshape(-1, s.block_size)
    bad = ~np.isfinite(blocks).all(axis=1)
    y = s.dequantize(s.quantize(np.where(bad[:, None], 0, blocks).reshape(x.shape)), x.shape,
                     dtype=np.float64 if x.dtype == np.float64 else np.float32)
    y.reshape(-1, s.block_size)[bad] = np.nan
    return y


def _fake_quantize(a, out, x):
    put(out[0], fake_quantized(x, a["scheme"]))


def _dequant_matmul(a, out, x, w, b=None):
    """x @ W^T for packed W: a block of W's rows is decoded into a reused scratch and
    multiplied with BLAS, so no float copy of the whole weight ever exists."""
    s, o = scheme(a["scheme"]), out[0]
    n, k = w.shape[0], x.shape[-1]
    xf = up(x).reshape(-1, k)
    ct = np.float64 if xf.dtype == np.float64 else np.float32
    xf = xf.astype(ct, copy=False)
    direct = o.dtype == ct and o.flags.c_contiguous
    res = o.reshape(-1, n) if direct else np.empty((xf.shape[0], n), ct)
    step = max(1, min(n, _DQ_SCRATCH // k))
    scratch = np.empty((step, k), ct)
    for r in range(0, n, step):
        e = min(n, r + step)
        wd = s.dequantize(w[r:e], (e - r, k), out=scratch[:e - r], dtype=ct)
        np.matmul(xf, wd.T, out=res[:, r:e])
    if not direct:
        put(o, res.reshape(o.shape))
    _fused_mba_epilogue(a, o, b)


def _fused_rrms(a, out, x, r, w=None):
    h = up(x) + up(r)
    put(out[0], h)
    put(out[1], _rms(h, w, a["eps"], a["offset"]))


def _fused_rln(a, out, x, r, g=None, b=None):
    if all(t is None or t.dtype == _F32 for t in (x, r, g, b, *out)) and x.shape == r.shape == out[0].shape \
            and out[1].flags.c_contiguous:
        return _residual_ln_f32(a["eps"], out[0], out[1], x, r, g, b)
    h = up(x) + up(r)
    put(out[0], h)
    put(out[1], _ln(h, g, b, a["eps"]))


def _residual_ln_f32(eps, h, y, x, r, g, b):
    """h = x + r, y = LayerNorm(h), f32: in place in y, no tensor-sized temporaries."""
    np.add(x, r, out=h)
    h2, y2 = h.reshape(-1, h.shape[-1]), y.reshape(-1, y.shape[-1])
    np.subtract(h2, h2.mean(-1, keepdims=True), out=y2)
    var = np.einsum("ij,ij->i", y2, y2)
    var *= np.float32(1.0 / max(y2.shape[-1], 1))
    var += np.float32(eps)
    np.sqrt(var, out=var)
    np.reciprocal(var, out=var)
    y2 *= var[:, None]
    if g is not None:
        y2 *= g
    if b is not None:
        y2 += b


# ----------------------------------------------------------------- packed sequences
def segments(starts, lens, tokens: int, op: str) -> tuple:
    """(starts, lens) as i64 and whether they cover every token, after checking that each
    segment lies in [0, tokens) and that non-empty ones are disjoint (a ModelError otherwise)."""
    st = np.asarray(starts).astype(np.int64, copy=False).reshape(-1)
    ln = np.asarray(lens).astype(np.int64, copy=False).reshape(-1)
    if ln.size and (ln.min() < 0 or st.min() < 0 or int((st + ln).max()) > tokens):
        bad = int(np.flatnonzero((ln < 0) | (st < 0) | (st + ln > tokens))[0])
        raise ModelError(f"{op}: segment {bad} (start {int(st[bad])}, length {int(ln[bad])}) is not "
                         f"within the {tokens} tokens")
    nz = np.flatnonzero(ln > 0)
    order = nz[np.argsort(st[nz], kind="stable")]
    ends = st[order] + ln[order]
    if order.size > 1 and (st[order[1:]] < ends[:-1]).any():
        j = int(np.flatnonzero(st[order[1:]] < ends[:-1])[0])
        raise ModelError(f"{op}: segments {int(order[j])} and {int(order[j + 1])} overlap")
    return st, ln, int(ln.sum()) == tokens


def attention_groups(starts, lens, heads: int, budget: int = 1 << 22, slack: int = 1 << 16) -> list:
    """Segments grouped for batched attention: longest first, a group padded to its first
    (longest) member while that wastes under 25% of its score matrix, or under `slack`
    scores in all (for short texts one batched pass costs less than a few more passes over
    a little padding), and stays under `budget` scores.
    Each group: (idx [g, L] token indices, valid [g, L] or None when all full)."""
    st, ln = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
    order = [int(i) for i in np.argsort(-ln, kind="stable") if ln[i] > 0]
    groups, cur, real = [], [], 0
    for i in order:
        n = int(ln[i])
        if cur:
            top = int(ln[cur[0]])
            padded = (len(cur) + 1) * top * top
            if (padded * 4 <= 5 * (real + n * n) or (padded - real - n * n) * heads <= slack) \
                    and padded * heads <= budget:
                cur.append(i)
                real += n * n
                continue
            groups.append(cur)
        cur, real = [i], n * n
    if cur:
        groups.append(cur)
    out = []
    for grp in groups:
        top = int(ln[grp[0]])
        ar = np.arange(top)
        n = ln[grp][:, None]
        idx = st[grp][:, None] + np.minimum(ar[None, :], n - 1)     # padding repeats a real token
        valid = ar[None, :] < n
        out.append((idx, None if valid.all() else valid))
    return out


def _varlen_attention(a, out, q, k, v, starts, lens):
    """Per group of segments (attention_groups): one gather of their rows, q k^T batched over
    [segments, kv heads] with a kv head's query heads stacked (GQA), softmax normalized on
    the smaller [L, Dv] product."""
    o = out[0]
    tokens, h, _ = q.shape
    kvh, dv = k.shape[1], v.shape[2]
    g = h // kvh
    st, ln, covered = segments(starts, lens, tokens, "varlen_attention")
    if not covered:
        o.fill(0)
    qf, kf, vf = up(q), up(k), up(v)
    ct = np.result_type(qf.dtype, kf.dtype, vf.dtype, np.float32)
    sc = np.asarray(a["scale"], ct)
    o4 = o.reshape(tokens, kvh, g, dv)
    for idx, valid in attention_groups(st, ln, h):
        n, top = idx.shape
        qq = qf[idx].reshape(n, top, kvh, g, -1).transpose(0, 2, 3, 1, 4).reshape(n, kvh, g * top, -1)
        kt = kf[idx].transpose(0, 2, 3, 1)                                     # [n, kvh, d, L]
        vv = vf[idx].transpose(0, 2, 1, 3)                                     # [n, kvh, L, dv]
        s = np.matmul(qq, kt)                                                  # [n, kvh, g*L, L]
        s *= sc
        if valid is not None:
            s += np.where(valid, np.asarray(0, ct), np.asarray(-np.inf, ct))[:, None, None, :]
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        r = np.matmul(s, vv)                                                   # [n, kvh, g*L, dv]
        r /= s.sum(-1, keepdims=True)
        r = r.reshape(n, kvh, g, top, dv).transpose(0, 3, 1, 2, 4)             # [n, L, kvh, g, dv]
        if valid is None:
            o4[idx] = r
        else:
            o4[idx[valid]] = r[valid]


def _segment_pool(a, out, x, starts, lens):
    o, mode = out[0], a["mode"]
    st, ln, _ = segments(starts, lens, x.shape[0], "segment_pool")
    xf = up(x)
    for i, (s, n) in enumerate(zip(st.tolist(), ln.tolist())):
        if n == 0:
            o[i] = 0
        elif mode == "cls":
            o[i] = xf[s]
        elif mode == "mean":
            put(o[i], np.add.reduce(xf[s:s + n], axis=0) / np.asarray(n, xf.dtype))
        else:
            put(o[i], np.maximum.reduce(xf[s:s + n], axis=0))


def _fused_attn_block(a, out, q, k, v, cos, sin, *rest):
    qr = rope_apply(q, cos, sin, a["style"])
    kr = rope_apply(k, cos, sin, a["style"])
    _, _, _, mask, pos = _split_attn(a, (q, k, v) + tuple(rest))
    put(out[0], attention_core(a, qr, kr, v, mask, pos))


def _eval_elementwise(op, a, *xs):
    tmp = [np.empty(np.broadcast_shapes(*[x.shape for x in xs]),
                    dtype=_result_dtype(op, a, xs))]
    KERNELS[op](a, tmp, *xs)
    return tmp[0]


def _result_dtype(op, a, xs):
    if op == "compare":
        return np.bool_
    if op == "cast":
        return DType.parse(a["dtype"]).np
    if op == "where":
        return np.result_type(xs[1].dtype, xs[2].dtype)
    return np.result_type(*[x.dtype for x in xs]) if op != "fused_swiglu" else xs[0].dtype


def _fused_elementwise(a, out, *ins):
    slots = list(ins)
    for op, attrs_, args in a["program"]:
        slots.append(_eval_elementwise(op, dict(attrs_), *[slots[i] for i in args]))
    put(out[0], slots[-1])


def _custom(a, out, *ins):
    from .custom import custom_op

    op = custom_op(a["name"])
    if "numpy" in op.out_kernels:
        return op.out_kernels["numpy"](out, *ins, **dict(a["params"]))
    res = op.kernels["numpy"](*ins, **dict(a["params"]))
    res = res if isinstance(res, tuple) else (res,)
    for o, r in zip(out, res):
        put(o, r)


def _collective(name):
    """A kernel running `name` on the communicator bound in this process (ir/comm.py)."""
    def kernel(a, out, x):
        c = comm.current(a["world"], a["rank"])
        if name == "all_reduce":
            c.all_reduce(x, out[0])
        else:
            getattr(c, name)(x, out[0], a["axis"] % x.ndim)
    kernel.__name__ = f"_{name}"
    return kernel


KERNELS = {
    "matmul": _matmul,
    "binary": _binary,
    "compare": lambda a, out, x, y: CMP[a["op"]](x, y, out=out[0]),
    "where": lambda a, out, c, x, y: put(out[0], np.where(c, x, y)),
    "activation": _activation,
    "cast": lambda a, out, x: put(out[0], x),
    "reduce": _reduce,
    "softmax": _softmax,
    "softmax_grad": _softmax_grad,
    "rms_norm_grad": _rms_norm_grad,
    "layer_norm_grad": _layer_norm_grad,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "rope": _rope,
    "attention": _attention,
    "attention_grad": _attention_grad,
    "mask_fill": _mask_fill,
    "gather": _gather,
    "transpose": lambda a, out, x: put(out[0], x.transpose(a["perm"])),
    "concat": lambda a, out, *xs: np.concatenate(xs, axis=a["axis"], out=out[0]),
    "cumsum": lambda a, out, x: put(out[0], np.cumsum(up(x), axis=a["axis"])),
    "topk": _topk,
    "argmax": lambda a, out, x: put(out[0], np.argmax(x, axis=a["axis"], keepdims=a["keepdims"])),
    "custom": _custom,
    "fused_swiglu": _fused_swiglu,
    "fused_matmul_bias_act": _fused_mba,
    "fused_residual_rms_norm": _fused_rrms,
    "fused_residual_ln": _fused_rln,
    "fused_attention_block": _fused_attn_block,
    "fused_elementwise": _fused_elementwise,
    "varlen_attention": _varlen_attention,
    "segment_pool": _segment_pool,
    "dequantize": _dequantize,
    "quantize": _quantize,
    "fake_quantize": _fake_quantize,
    "dequant_matmul": _dequant_matmul,
    "all_reduce": _collective("all_reduce"),
    "all_gather": _collective("all_gather"),
    "reduce_scatter": _collective("reduce_scatter"),
}

def _narrow(a, x):
    ax = a["axis"] % x.ndim
    start = a["start"] + x.shape[ax] if a["start"] < 0 else a["start"]
    return x[(slice(None),) * ax + (slice(start, start + a["length"]),)]


VIEWS = {
    "reshape": lambda a, x: x.reshape(a["shape"]),
    "narrow": lambda a, x: _narrow(a, x),
    "expand": lambda a, x: np.broadcast_to(x, a["shape"]),
    "kv_write": _kv_write,
    "assign": _assign,
}
