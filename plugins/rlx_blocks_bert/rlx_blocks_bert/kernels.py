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

# GELU = x * Phi(x). Phi is tabulated on [-8, 8] in steps of 1/512 as one linear piece per
# step (value and slope at the left end, stored as complex64 so one gather fetches both):
# |Phi error| < 4e-8 inside, and Phi is 0 / 1 to float32 precision outside. That is ~8
# float32 passes and one gather per element, against ~20 passes for a rational erf.
_TAB_RANGE, _TAB_STEP = 8.0, 512.0


def _phi_table() -> np.ndarray:
    n = int(2 * _TAB_RANGE * _TAB_STEP) + 1
    xs = np.arange(n + 1, dtype=np.float64) / _TAB_STEP - _TAB_RANGE
    phi = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in xs])
    slope = (phi[1:] - phi[:-1]) * _TAB_STEP
    icpt = phi[:-1] - slope * xs[:-1]
    # a piece's chord is below the convex part of Phi and above the concave one: shift half
    # the midpoint gap so the error is centred (halves the worst case)
    mid = xs[:-1] + 0.5 / _TAB_STEP
    gap = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in mid]) - (icpt + slope * mid)
    tab = (icpt + 0.5 * gap) + 1j * slope
    tab[0], tab[-1] = 0.0, 1.0          # saturate: Phi(-8) ~ 6e-16, Phi(8) ~ 1 - 6e-16
    return tab.astype(np.complex64)


_PHI = _phi_table()
_TAB_LAST = np.float32(len(_PHI) - 1)
_TAB_OFF = np.float32(_TAB_RANGE * _TAB_STEP)
_CHUNK = 1 << 16                      # elements per chunk: the chunk and its temporaries stay in L2


def gelu_inplace(y: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y <- GELU(y + bias), the exact (erf) GELU to |error| < 1e-7 * |y|, float32, in place,
    in cache-sized chunks of whole rows (y contiguous float32; bias [y.shape[-1]] or None).
    Few, large numpy calls: a part running in a thread beside another hands the GIL over at
    every call."""
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


def _sigmoid(y):
    return np.exp(-np.logaddexp(0, -y)).astype(y.dtype, copy=False)


def _act(y: np.ndarray, act: str) -> np.ndarray:
    if act == "identity":
        return y
    if act == "gelu":
        return gelu_inplace(y) if y.dtype == np.float32 and y.flags.c_contiguous else (
            0.5 * y * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(y / math.sqrt(2.0)))).astype(y.dtype)
    if act == "gelu_tanh":
        c, a = np.asarray(math.sqrt(2 / math.pi), y.dtype), np.asarray(0.044715, y.dtype)
        return 0.5 * y * (1.0 + np.tanh(c * (y + a * y ** 3)))
    if act == "relu":
        return np.maximum(y, 0, out=y)
    if act == "silu":
        return y * _sigmoid(y)
    if act == "tanh":
        return np.tanh(y, out=y)
    if act == "sigmoid":
        return _sigmoid(y)
    raise ShapeError(f"{NAME}: unknown act {act!r}")


def dense_numpy(x, w, b=None, *, act: str = "identity", wt: bool = False):
    """act(x @ w^T + b) for x [..., K], w [N, K] (HF layout; [K, N] with wt), b [N]; one GEMM
    over all rows."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    compute = np.float32 if x.dtype in (np.float16,) or str(x.dtype) == "bfloat16" else x.dtype
    if x2.dtype != compute:
        x2 = x2.astype(compute)
    w = w if w.dtype == compute else w.astype(compute)
    y = x2 @ (w if wt else w.T)
    if b is not None:
        y += b.astype(compute, copy=False)
    y = _act(y, act)
    return y.reshape(x.shape[:-1] + (w.shape[1] if wt else w.shape[0],))


def dense_numpy_into(outs, x, w, b=None, *, act: str = "identity", wt: bool = False):
    """dense_numpy written straight into the arena's output (float32: GEMM, bias and the
    activation in place, no result to copy)."""
    y = outs[0]
    if not (x.dtype == w.dtype == y.dtype == np.float32 and y.flags.c_contiguous):
        np.copyto(y, dense_numpy(x, w, b, act=act, wt=wt), casting="unsafe")
        return
    y2 = y.reshape(-1, y.shape[-1])
    np.matmul(x.reshape(-1, x.shape[-1]), w if wt else w.T, out=y2)
    if act == "gelu":                                  # the bias added chunk by chunk, in cache
        gelu_inplace(y2, b)
        return
    if b is not None:
        y2 += b
    r = _act(y2, act)
    if r is not y2:
        np.copyto(y2, r, casting="unsafe")


def dense_meta(shapes, params):
    x, w = shapes[0], shapes[1]
    if params.get("act", "identity") not in ACTS:
        raise ShapeError(f"{NAME}: act must be one of {ACTS}, got {params.get('act')!r}")
    if w.rank != 2 or x.rank < 1:
        raise ShapeError(f"{NAME}: needs x [..., K] and w [N, K] ([K, N] with wt), got {x} and {w}")
    n_out, k_in = (w.dims[1], w.dims[0]) if params.get("wt") else (w.dims[0], w.dims[1])
    k = x.dims[-1]
    if isinstance(k, int) and isinstance(k_in, int) and k != k_in:
        raise ShapeError(f"{NAME}: x {x} and w {w} disagree on K")
    if len(shapes) > 2 and (shapes[2].rank != 1 or shapes[2].dims[0] != n_out):
        raise ShapeError(f"{NAME}: bias {shapes[2]} does not match w {w}")
    if len(shapes) > 3:
        raise ShapeError(f"{NAME}: takes x, w and an optional bias, got {len(shapes)} inputs")
    return (Shape(x.dims[:-1] + (n_out,), x.dtype),)


DENSE = CustomOp(NAME, dense_meta, {"numpy": dense_numpy},
                 doc="act(x @ W^T + b) with HF-layout W [N, K] (wt: W^T [K, N]); one GEMM over the "
                     "flattened rows",
                 out_kernels={"numpy": dense_numpy_into})


# ------------------------------------------------------------------------------ packed sequences
# The packed ("varlen") layout: a batch of texts is one row of tokens [1, T], text i being
# tokens [starts[i], starts[i] + lens[i]). Projections then run as single GEMMs over exactly
# the real tokens (no padding), attention runs within each text, pooling per text. Empty
# segments (lens 0) are allowed, so a batch can keep a fixed number of segments.
VARLEN = "bert.varlen_attention"
VARLEN_QKV = "bert.varlen_qkv_attention"
SEGPOOL = "bert.segment_pool"
ADD_LN = "bert.add_layer_norm"
POOL_MODES = ("mean", "cls", "max")


def attention_groups(starts, lens, heads: int, budget: int = 1 << 22, slack: int = 1 << 16) -> list:
    """Segments grouped for batched attention: longest first, a group padded to its first
    (longest) member while that wastes under 25% of its score matrix, or under `slack`
    scores in all (for short texts one batched pass costs less than a few more passes over
    a little padding), and stays under `budget` scores.
    Each group: (idx [g, L] token indices, valid [g, L] or None when all full)."""
    st, ln = np.asarray(starts).astype(np.int64), np.asarray(lens).astype(np.int64)
    order = [int(i) for i in np.argsort(-ln, kind="stable") if ln[i] > 0]
    groups, cur, real = [], [], 0
    for i in order:
        n = int(ln[i])
        if cur:
            top = int(ln[cur[0]])
            g = len(cur) + 1
            padded = g * top * top
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


def _softmax_attend(q, k, v, valid, scale):
    """q, k, v [h, g, L, d] (views allowed) -> [h, g, L, d]; keys outside `valid` masked."""
    a = np.matmul(q, k.swapaxes(-1, -2))                                  # [h, g, L, L]
    a *= scale
    if valid is not None:
        a += np.where(valid, np.float32(0.0), np.float32(-np.inf))[None, :, None, :]
    a -= a.max(-1, keepdims=True)
    np.exp(a, out=a)
    a /= a.sum(-1, keepdims=True)
    return np.matmul(a, v)


def varlen_attention_numpy(q, k, v, starts, lens, *, scale: float):
    """softmax(q k^T * scale) v within each segment; q, k, v [1, heads, T, d]."""
    out = np.zeros(q.shape[:3] + (v.shape[-1],), np.result_type(q.dtype, np.float32))
    sc = np.asarray(scale, out.dtype)
    for idx, valid in attention_groups(starts, lens, q.shape[1]):
        o = _softmax_attend(q[0][:, idx], k[0][:, idx], v[0][:, idx], valid, sc)     # [h, g, L, d]
        if valid is None:
            out[0][:, idx.reshape(-1)] = o.reshape(o.shape[0], -1, o.shape[-1])
        else:
            out[0][:, idx[valid]] = o[:, valid]
    return out


def varlen_qkv_attention_numpy(qkv, starts, lens, *, heads: int, scale: float):
    """The same from a fused projection qkv [1, T, 3*H] ([q; k; v], heads-major within each):
    heads are split and merged by views, so the graph needs no transposes. -> [1, T, H]."""
    out = np.empty((1, qkv.shape[1], qkv.shape[2] // 3), np.result_type(qkv.dtype, np.float32))
    varlen_qkv_attention_into([out], qkv, starts, lens, heads=heads, scale=scale)
    return out


def varlen_qkv_attention_into(outs, qkv, starts, lens, *, heads: int, scale: float):
    """varlen_qkv_attention_numpy written into outs[0]; per group of segments: one gather of
    their rows, q k^T batched over [segments, heads], softmax normalized on the smaller
    [L, d] product (d <= L is rare for sentences, and either way it is one pass less)."""
    if outs[0].dtype != np.result_type(qkv.dtype, np.float32):
        np.copyto(outs[0], varlen_qkv_attention_numpy(qkv, starts, lens, heads=heads, scale=scale),
                  casting="unsafe")
        return
    x, out = qkv[0], outs[0][0]
    hidden = x.shape[-1] // 3
    d = hidden // heads
    out.fill(0)
    sc = np.asarray(scale, out.dtype)
    for idx, valid in attention_groups(starts, lens, heads):
        g, top = idx.shape
        rows = x[idx].reshape(g, top, 3, heads, d)                             # one gather
        q = rows[:, :, 0].transpose(0, 2, 1, 3)                                # [g, h, L, d] views
        kt = rows[:, :, 1].transpose(0, 2, 3, 1)                               # [g, h, d, L]
        v = rows[:, :, 2].transpose(0, 2, 1, 3)
        a = np.matmul(q, kt)                                                   # [g, h, L, L]
        a *= sc
        if valid is not None:
            a += np.where(valid, np.float32(0.0), np.float32(-np.inf))[:, None, None, :]
        a -= a.max(-1, keepdims=True)
        np.exp(a, out=a)
        o = np.matmul(a, v)                                                    # [g, h, L, d]
        o /= a.sum(-1, keepdims=True)
        o = o.transpose(0, 2, 1, 3)                                            # [g, L, h, d]
        if valid is None:
            out[idx.reshape(-1)] = o.reshape(g * top, hidden)
        else:
            out[idx[valid]] = o[valid].reshape(-1, hidden)


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
    if q.dims[1:] != k.dims[1:] or k.dims[1:3] != v.dims[1:3]:
        raise ShapeError(f"{VARLEN}: q {q}, k {k}, v {v} do not agree")
    _segments_meta(shapes, VARLEN)
    return (Shape(q.dims[:3] + (v.dims[3],), q.dtype),)


def varlen_qkv_meta(shapes, params):
    if len(shapes) != 3:
        raise ShapeError(f"{VARLEN_QKV}: takes qkv, starts, lens; got {len(shapes)} inputs")
    x, heads = shapes[0], params.get("heads")
    if x.rank != 3 or x.dims[0] != 1:
        raise ShapeError(f"{VARLEN_QKV}: qkv must be [1, tokens, 3 * hidden], got {x}")
    if not isinstance(heads, int) or heads <= 0 or (isinstance(x.dims[2], int) and x.dims[2] % (3 * heads)):
        raise ShapeError(f"{VARLEN_QKV}: {x.dims[2]} is not 3 x heads ({heads}) x head_dim")
    _segments_meta(shapes, VARLEN_QKV)
    return (Shape((1, x.dims[1], x.dims[2] // 3), x.dtype),)


def add_layer_norm_numpy(x, r, g, b, *, eps: float):
    """LayerNorm(x + r) over the last axis with gamma g and beta b."""
    h = np.empty(x.shape, np.result_type(x.dtype, np.float32))
    add_layer_norm_into([h], x, r, g, b, eps=eps)
    return h


def add_layer_norm_into(outs, x, r, g, b, *, eps: float):
    """add_layer_norm_numpy written into outs[0] (the sum, then normalized in place)."""
    h = outs[0]
    if h.dtype != np.result_type(x.dtype, np.float32) or not h.flags.c_contiguous:
        np.copyto(h, add_layer_norm_numpy(x, r, g, b, eps=eps), casting="unsafe")
        return
    np.add(x, r, out=h)
    h2 = h.reshape(-1, h.shape[-1])
    h2 -= h2.mean(-1, keepdims=True)
    var = np.einsum("ij,ij->i", h2, h2)
    var *= np.float32(1.0 / h2.shape[-1])
    var += np.float32(eps)
    np.sqrt(var, out=var)
    np.reciprocal(var, out=var)
    h2 *= var[:, None]
    h2 *= g
    h2 += b


def add_layer_norm_meta(shapes, params):
    if len(shapes) != 4:
        raise ShapeError(f"{ADD_LN}: takes x, residual, gamma, beta; got {len(shapes)} inputs")
    x, r, g, b = shapes
    if x.dims != r.dims or g.rank != 1 or b.rank != 1 or g.dims[0] != x.dims[-1] or b.dims != g.dims:
        raise ShapeError(f"{ADD_LN}: x {x}, residual {r}, gamma {g}, beta {b} do not agree")
    return (x,)


def segment_pool_numpy(x, starts, lens, *, mode: str):
    """Per-segment pooling of x [1, T, H] -> [segments, H] (mean divides by max(n, 1e-9))."""
    out = np.empty((len(starts), x.shape[-1]), np.result_type(x.dtype, np.float32))
    segment_pool_into([out], x, starts, lens, mode=mode)
    return out


def segment_pool_into(outs, x, starts, lens, *, mode: str):
    """segment_pool_numpy written into outs[0] (empty segments give zeros)."""
    out = outs[0]
    if out.dtype != np.result_type(x.dtype, np.float32):
        np.copyto(out, segment_pool_numpy(x, starts, lens, mode=mode), casting="unsafe")
        return
    x0 = x.reshape(-1, x.shape[-1])
    out.fill(0)
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


def segment_pool_meta(shapes, params):
    if params.get("mode") not in POOL_MODES:
        raise ShapeError(f"{SEGPOOL}: mode must be one of {POOL_MODES}, got {params.get('mode')!r}")
    if len(shapes) != 3 or shapes[0].rank != 3 or shapes[0].dims[0] != 1:
        raise ShapeError(f"{SEGPOOL}: takes x [1, tokens, hidden], starts, lens; "
                         f"got {[str(s) for s in shapes]}")
    _segments_meta(shapes, SEGPOOL)
    return (Shape((shapes[1].dims[0], shapes[0].dims[2]), shapes[0].dtype),)


VARLEN_ATTENTION = CustomOp(VARLEN, varlen_meta, {"numpy": varlen_attention_numpy},
                            doc="bidirectional attention within each [start, start+len) segment")
SEGMENT_POOL = CustomOp(SEGPOOL, segment_pool_meta, {"numpy": segment_pool_numpy},
                        doc="mean / cls / max pooling of each segment of packed tokens",
                        out_kernels={"numpy": segment_pool_into})
VARLEN_QKV_ATTENTION = CustomOp(VARLEN_QKV, varlen_qkv_meta, {"numpy": varlen_qkv_attention_numpy},
                                doc="bert.varlen_attention on a fused [q; k; v] projection",
                                out_kernels={"numpy": varlen_qkv_attention_into})
ADD_LAYER_NORM = CustomOp(ADD_LN, add_layer_norm_meta, {"numpy": add_layer_norm_numpy},
                          doc="LayerNorm(x + residual) (post-norm residual blocks)",
                          out_kernels={"numpy": add_layer_norm_into})
CUSTOM_OPS = (DENSE, VARLEN_ATTENTION, VARLEN_QKV_ATTENTION, SEGMENT_POOL, ADD_LAYER_NORM)
