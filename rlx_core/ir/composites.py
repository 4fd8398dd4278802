"""Composites: every op that can be written with other ops, written once, here.

An entry is one decorated function, `@composite(op, *examples)`: it builds `op`'s result from
other ops of the table with a Builder (`fn(m, inputs, attrs) -> value(s)`). The table drives

* `legalize`: a backend that lacks an op with a composite gets the composite instead,
  repeated until every op left is one the backend implements (a composite may emit ops
  that have composites of their own: attention emits mask_fill, which emits compares);
* the `fusable` lowering (lower.py): the entries marked `deep` (blocks, norms, softmax,
  rope, attention) are taken apart even when the backend has them, for the fusion passes
  to rebuild what the target fuses;
* `check_coverage(backend)`: run when a backend registers, so a backend lacking a primitive
  that some composite needs fails then, naming the op, the backend and the missing piece.
  What a composite emits is found by tracing it on its `examples` (small shapes and attrs
  that take every branch of the function), once per process.

PRIMITIVES are the ops without a composite that every backend implements (17):
matmul, binary, compare, where, activation, cast, reduce, gather, reshape, transpose,
narrow, concat, expand, cumsum, kv_write, assign, dequantize. cumsum stays a primitive: it is
how a composite counts 0..n-1 along a dim whose length is a symbol ("seq"), known only at run
time (`iota`).

OPTIONAL ops are capabilities a backend may lack: a graph using one fails to compile on it,
naming the op: quantize (and so fake_quantize) and custom ops. The FFTs have composites
(ir/fft.py: a DFT as a real matmul with a constant cos/sin table, for a static length), and
so do the collectives, for a group of one rank (the identity); over more ranks a backend
without them fails to compile, naming the op. Control flow (if_, while_, scan) core runs
from the host for a backend without it (backends/host_control.py).
"""
from __future__ import annotations

import functools
import re
from typing import Callable

import attrs
import numpy as np

from .control import map_bodies
from .dtype import F32, F64, I64, DType
from .errors import BackendError, GraphError
from .graph import MIR, Builder, Graph
from .ops import COLLECTIVES, OPS, Level, MaskKind, get_op
from .quant import QuantScheme
from .rewrite import rewrite
from .shape import Shape, broadcast_dims, norm_axis

PRIMITIVES = frozenset({
    "matmul", "binary", "compare", "where", "activation", "cast", "reduce", "gather", "reshape",
    "transpose", "narrow", "concat", "expand", "cumsum", "kv_write", "assign", "dequantize"})
CONTROL_FLOW = frozenset({"if_", "while_", "scan"})
OPTIONAL = frozenset({"quantize", "custom"}) | CONTROL_FLOW

F32_LOWEST = -3.4028234663852886e38     # np.finfo(np.float32).min
F32_MAX = 3.4028234663852886e38
_NO_INDEX = np.iinfo(np.int64).max      # an index past every axis: what min-reductions skip
_MAX_ROUNDS = 32                        # legalize rounds: deeper than any chain of composites


# ----------------------------------------------------------------------------- the table
@attrs.frozen
class Composite:
    op: str
    build: Callable          # (m, inputs, attrs) -> value or tuple of values
    deep: bool               # the fusable lowering takes it apart too
    examples: tuple          # ((Shape, ...), attrs): what `emitted_ops` traces it on
    fusable: Callable | None = None   # what that lowering emits instead, where it differs


COMPOSITES: dict[str, Composite] = {}
_EMITTED: dict = {}                     # op -> the ops its composite emits (traced once)


def composite(op: str, *examples: tuple, deep: bool = False, fusable: Callable | None = None):
    """Register the decorated `fn(m, inputs, attrs)` as `op`'s composite. `examples` (made
    with `ex`) must take every branch of fn that emits a different op: coverage is traced
    on them. `fusable`: the form the fusable lowering emits instead (a `deep` op whose
    primitive chain the fusion passes' patterns re-fuse)."""
    def wrap(fn):
        get_op(op)                           # GraphError naming an op the table lacks
        if op in COMPOSITES:
            raise GraphError(f"op {op!r} has a composite already ({COMPOSITES[op].build.__qualname__})")
        if not examples:
            raise GraphError(f"composite of {op!r}: give at least one example to trace it on")
        COMPOSITES[op] = Composite(op, fn, deep, tuple(examples), fusable)
        return fn
    return wrap


_SHAPE = re.compile(r"^(\w+)\[([\w,]*)\]$")


def ex(*shapes: str, **attrs_) -> tuple:
    """An example for `composite`: shapes as "f16[2,3]" (a dim may be a symbol: "f32[seq,4]")
    and the op's attrs."""
    out = []
    for s in shapes:
        m = _SHAPE.match(s.replace(" ", ""))
        if not m:
            raise GraphError(f"composite example shape {s!r}: expected like 'f16[2,3]'")
        dims = tuple(int(d) if d.isdigit() else d for d in m.group(2).split(",") if d)
        out.append(Shape(dims, DType.parse(m.group(1))))
    return tuple(out), attrs_


def decompose(m: Builder, op: str, ins: list, attrs_: dict):
    return COMPOSITES[op].build(m, ins, attrs_)


# ----------------------------------------------------------------------------- legalize
def legalize(g: Graph, supported) -> tuple:
    """Replace every op the backend lacks that has a composite by the composite, until what
    is left is supported or has none; returns (graph, names legalized). Control-flow bodies
    are legalized for the same backend."""
    done: list = []

    def inner(body):
        body, names = legalize(body, supported)
        done.extend(names)
        return body

    g = map_bodies(g, inner)

    def lacking(op):
        return op in COMPOSITES and op not in supported

    def replace(m, node, ins, i, lookup):
        if lacking(node.op):
            done.append(node.op)
            return decompose(m, node.op, ins, node.a)
        return None

    g = rewrite(g, replace)
    rounds = 1
    while any(lacking(n.op) for n in g.nodes):      # a composite may emit another composite
        if rounds == _MAX_ROUNDS:
            left = sorted({n.op for n in g.nodes if lacking(n.op)})
            raise GraphError(f"legalize: {left} still left after {rounds} rounds: composites that "
                             f"emit each other")
        g = rewrite(g, replace)
        rounds += 1
    return g, sorted(set(done))


# ----------------------------------------------------------------------------- coverage
def emitted_ops(op: str) -> frozenset:
    """The ops `op`'s composite emits, traced once on its examples."""
    if op not in _EMITTED:
        c = COMPOSITES[op]
        found: set = set()
        for shapes, given in c.examples:
            m = Builder(f"trace_{op}", MIR)
            ins = [m.input(f"x{i}", s.dims, s.dtype) for i, s in enumerate(shapes)]
            get_op(op).check_arity(len(ins))
            c.build(m, ins, get_op(op).check_attrs(given))
            found |= {n.op for n in m.nodes if get_op(n.op).level is not Level.LEAF}
        _EMITTED[op] = frozenset(found)
    return _EMITTED[op]


def missing_primitives(op: str, supported, _seen: frozenset = frozenset()) -> frozenset:
    """The ops without a composite that running `op` on a backend implementing `supported`
    needs and the backend lacks (empty when it can run it)."""
    if op in supported:
        return frozenset()
    if op not in COMPOSITES or op in _seen:
        return frozenset({op})
    out: frozenset = frozenset()
    for e in emitted_ops(op):
        out |= missing_primitives(e, supported, _seen | {op})
    return out


def check_coverage(backend) -> None:
    """Every op of the table below HIR runs on `backend`: it implements it, or a composite
    (transitively) brings it to ops it implements; ops that would need an OPTIONAL one it
    lacks fail only when a graph uses them. Each expression renderer the backend declares is
    checked against the expression table (rlx_core.ir.expr.check_dialect). BackendError
    naming the op, the backend and what is missing."""
    supported = set(backend.supported_ops()) | CONTROL_FLOW        # host_control runs them
    problems = []
    for name, d in sorted(OPS.items()):
        if d.level in (Level.LEAF, Level.HIR):
            continue
        missing = missing_primitives(name, supported)
        if missing - OPTIONAL:
            how = " (what its composite needs)" if name in COMPOSITES else ""
            problems.append(f"{name}: lacks {sorted(missing - OPTIONAL)}{how}")
    if problems:
        raise BackendError(f"backend {backend.name!r} cannot run every op of the table; it must "
                           f"implement the primitives {sorted(PRIMITIVES)}: " + "; ".join(problems))
    renderers = tuple(backend.expression_renderers())
    if renderers:
        from .expr import check_dialect

        for r in renderers:
            check_dialect(r, backend.name)


# ----------------------------------------------------------------------------- helpers
def in_f32(m: Builder, x):
    """x as the float type composites compute in: f32, or f64 for f64."""
    return x if x.dtype in (F32, F64) else m.cast(x, F32)


def _one(m: Builder, tie):
    """An i64 [1] holding 1, computed from `tie` (a value of the run): built from a constant
    it would be hoisted to load time, which knows no symbolic dims."""
    t = m.reshape(tie, (1,)) if tie.shape.rank == 0 else tie
    while t.shape.rank > 1:
        t = m.reshape(m.narrow(t, 0, 0, 1), t.dims[1:])
    first = m.narrow(t, 0, 0, 1)                                # [1]
    return m.cast(m.compare(first, first, "eq"), I64) * 0 + 1   # (NaN == NaN is False: *0)


def iota(m: Builder, n, tie, reverse: bool = False):
    """i64 [n]: 0, 1, ..., n - 1 (reverse: n - 1, ..., 0), for a dim n that may be symbolic:
    a cumsum of ones made from `tie`, any value of the run. (Not a constant: one feeding only
    constant math is hoisted to load time, which knows no symbolic dims and runs only where
    params are bound.)"""
    ones = m.expand(_one(m, tie), (n,))
    upto = m.cumsum(ones, 0)                                    # 1 .. n
    return m.sum(ones, (0,), keepdims=True) - upto if reverse else upto - 1


def _along(m: Builder, v, axis: int, rank: int):
    """[n] -> [1, .., n, .., 1]: broadcastable along `axis` of a rank-`rank` value."""
    return m.reshape(v, tuple(v.dims[0] if i == axis else 1 for i in range(rank)))


# ----------------------------------------------------------------------------- norms, softmax
def rms_norm_prims(m, x, w=None, eps=1e-6, offset=0.0):
    xf = in_f32(m, x)
    inv = m.rsqrt(m.mean(xf * xf, (-1,), keepdims=True) + eps)
    y = m.cast(xf * inv, x.dtype)
    if w is not None:
        y = y * (w + offset if offset else w)
    return y


def layer_norm_prims(m, x, g=None, b=None, eps=1e-5):
    xf = in_f32(m, x)
    d = xf - m.mean(xf, (-1,), keepdims=True)
    y = m.cast(d * m.rsqrt(m.mean(d * d, (-1,), keepdims=True) + eps), x.dtype)
    if g is not None:
        y = y * g
    if b is not None:
        y = y + b
    return y


def softmax_prims(m, x, axis=-1, finite_max=False):
    """A row of all -inf (a query that may attend to nothing, e.g. a padding row) gives zeros,
    like the kernels: the max is clamped to the lowest finite f32 so exp gives 0, not NaN, and
    the sum (>= 1 whenever the row has a finite entry) to 1. `finite_max` clamps the max from
    above too, so a row holding +inf is NaN there and 0 elsewhere, as in the kernels (the
    fusable lowering leaves it out: fusion's softmax pattern is the form without)."""
    xf = in_f32(m, x)
    top = m.maximum(m.max(xf, (axis,), keepdims=True), F32_LOWEST)
    e = m.exp(xf - (m.minimum(top, F32_MAX) if finite_max else top))
    return m.cast(e / m.maximum(m.sum(e, (axis,), keepdims=True), 1.0), x.dtype)


def _rows_sum(m, t, w):
    """t [..., D] summed over every leading axis, as w's dtype [D]."""
    return m.cast(m.sum(t, tuple(range(t.shape.rank - 1))) if t.shape.rank > 1 else t, w.dtype)


def softmax_grad_prims(m, y, g, axis=-1):
    yf, gf = in_f32(m, y), in_f32(m, g)
    return m.cast(yf * (gf - m.sum(gf * yf, (axis,), keepdims=True)), y.dtype)


def rms_norm_grad_prims(m, x, w, g, eps=1e-6, offset=0.0):
    """(dx, dw) of rms_norm(x, w); without w (None) dw is None."""
    xf, gf = in_f32(m, x), in_f32(m, g)
    inv = m.rsqrt(m.mean(xf * xf, (-1,), keepdims=True) + eps)
    n = xf * inv
    dn = gf if w is None else gf * (in_f32(m, w) + offset if offset else in_f32(m, w))
    dx = inv * (dn - n * m.mean(dn * n, (-1,), keepdims=True))
    return m.cast(dx, x.dtype), (None if w is None else _rows_sum(m, gf * n, w))


def layer_norm_grad_prims(m, x, gamma, g, eps=1e-5):
    """(dx, dgamma, dbeta) of layer_norm(x, gamma, beta); without gamma dgamma is None and
    dbeta is summed in x's dtype."""
    xf, gf = in_f32(m, x), in_f32(m, g)
    d = xf - m.mean(xf, (-1,), keepdims=True)
    inv = m.rsqrt(m.mean(d * d, (-1,), keepdims=True) + eps)
    n = d * inv
    dn = gf if gamma is None else gf * in_f32(m, gamma)
    dx = inv * (dn - m.mean(dn, (-1,), keepdims=True) - n * m.mean(dn * n, (-1,), keepdims=True))
    like = gamma if gamma is not None else x
    return (m.cast(dx, x.dtype), None if gamma is None else _rows_sum(m, gf * n, gamma),
            _rows_sum(m, gf, like))


# ----------------------------------------------------------------------------- rope, attention
def _table(m, t, x):
    """Rope tables [S,R/2] / [B,S,R/2] -> broadcastable against [B,H,S,R/2]."""
    if t.shape.rank == 2:
        return m.reshape(t, (1, 1) + t.dims)
    return m.reshape(t, (t.dims[0], 1) + t.dims[1:])


def rope_prims(m, x, cos, sin, style="half"):
    half = cos.dims[-1]
    d = x.dims[3]
    rot = x if 2 * half == d else m.narrow(x, 3, 0, 2 * half)
    c, s = _table(m, m.cast(cos, x.dtype), x), _table(m, m.cast(sin, x.dtype), x)
    if style == "half":
        x1, x2 = m.narrow(rot, 3, 0, half), m.narrow(rot, 3, half, half)
        out = m.concat([x1 * c - x2 * s, x2 * c + x1 * s], 3)
    else:
        pairs = m.reshape(rot, rot.dims[:3] + (half, 2))
        x1, x2 = m.narrow(pairs, 4, 0, 1), m.narrow(pairs, 4, 1, 1)
        c5, s5 = m.reshape(c, c.dims + (1,)), m.reshape(s, s.dims + (1,))
        out = m.reshape(m.concat([x1 * c5 - x2 * s5, x2 * c5 + x1 * s5], 4), rot.dims)
    if 2 * half != d:
        out = m.concat([out, m.narrow(x, 3, 2 * half, d - 2 * half)], 3)
    return out


def repeat_kv(m, k, heads):
    """[B,KVH,S,D] -> [B,H,S,D] by repeating each kv head H/KVH times (GQA)."""
    b, kvh, s, d = k.dims
    if kvh == heads:
        return k
    g = heads // kvh
    k5 = m.expand(m.reshape(k, (b, kvh, 1, s, d)), (b, kvh, g, s, d))
    return m.reshape(k5, (b, heads, s, d))


def _attention_probs(m, q, kk, mask, pos, a, softmax):
    """softmax(mask(softcap(q kk^T * scale))) in f32, and the softcap's tanh (None without)."""
    s = m.matmul(in_f32(m, q), in_f32(m, kk), trans_b=True) * a["scale"]
    t = None
    if a["softcap"]:
        t = m.tanh(s / a["softcap"])
        s = t * a["softcap"]
    if a["mask_kind"] != MaskKind.NONE.value or a["has_mask"]:
        s = m.add("mask_fill", (s,) + tuple(x for x in (mask, pos) if x is not None),
                  **{k: a[k] for k in ("mask_kind", "window", "has_mask", "has_pos")})
    return softmax(m, s, -1), t


def attention_prims(m, q, k, v, mask=None, pos=None, *, scale, mask_kind="causal", window=0,
                    softcap=0.0, has_mask=False, has_pos=False, legalized=False):
    """softmax(scores) v. `legalized` (a backend without attention): the softmax as an op
    (its kernel, or its composite in turn), and a value that is NaN or inf reaches only the
    queries that give its key weight, as in the kernels (p @ v alone spreads it to every query
    through 0 * NaN: `_weighted_values`). Without, the primitive chain the fusion passes know."""
    heads = q.dims[1]
    a = dict(scale=scale, mask_kind=mask_kind, window=window, softcap=softcap, has_mask=has_mask,
             has_pos=has_pos)
    softmax = (lambda m, x, axis: m.softmax(x, axis)) if legalized else softmax_prims
    p, _ = _attention_probs(m, q, repeat_kv(m, k, heads), mask, pos, a, softmax)
    vv = in_f32(m, repeat_kv(m, v, heads))
    return m.cast(_weighted_values(m, p, vv) if legalized else m.matmul(p, vv), q.dtype)


def _weighted_values(m, p, v):
    """p @ v where a key of weight 0 adds nothing even when its value is NaN or inf: the
    product over v's finite entries (v's zeroed), and the plain product in the entries where
    a key of nonzero weight holds a non-finite value (which is NaN or inf either way)."""
    finite = m.compare(v - v, 0.0, "eq")
    out = m.matmul(p, m.where(finite, v, 0.0))
    reached = m.matmul(p, 1.0 - m.cast(finite, p.dtype))
    return m.where(m.compare(reached, 0.0, "gt"), m.matmul(p, v), out)


def _group_sum(m, x, kvh):
    """[B, H, S, D] -> [B, KVH, S, D]: the sum over each kv head's query heads (GQA)."""
    b, h, s, d = x.dims
    return x if h == kvh else m.sum(m.reshape(x, (b, kvh, h // kvh, s, d)), (2,))


def attention_grad_prims(m, q, k, v, out, g, mask=None, pos=None, **a):
    """attention_grad as primitives: the probabilities recomputed, dv = P^T g, dS =
    softmax_grad(P, g v^T) through the softcap's tanh, times scale; dq = dS k, dk = dS^T q."""
    heads, kvh = q.dims[1], k.dims[1]
    kk, vv, gf = repeat_kv(m, k, heads), in_f32(m, repeat_kv(m, v, heads)), in_f32(m, g)
    p, t = _attention_probs(m, q, kk, mask, pos, a, lambda m, x, axis: m.softmax(x, axis))
    ds = m.add("softmax_grad", (p, m.matmul(gf, vv, trans_b=True)), axis=-1)
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = ds * a["scale"]
    dq = m.matmul(ds, in_f32(m, kk))
    dk = _group_sum(m, m.matmul(ds, in_f32(m, q), trans_a=True), kvh)
    dv = _group_sum(m, m.matmul(p, gf, trans_a=True), kvh)
    return m.cast(dq, q.dtype), m.cast(dk, k.dtype), m.cast(dv, v.dtype)


def mask_fill_prims(m, scores, mask=None, pos=None, *, mask_kind="causal", window=0, **_):
    """scores [B,H,Sq,Sk] with masked entries -inf and a float mask added (in f32 for f16 and
    bf16 scores, then rounded once). Query i sits at position pos[b] + i, else Sk - Sq + i;
    causal keeps keys j <= that position, a sliding window also j > position - window.
    Without pos, j <= Sk - Sq + i is compared as (Sk-1-j) >= (Sq-1-i): the counts from the
    end need no subtraction of two symbolic lengths."""
    s = in_f32(m, scores)
    if mask is not None and mask.dtype.is_float:
        s = s + in_f32(m, mask)
    kind = MaskKind(mask_kind)
    if kind in (MaskKind.CAUSAL, MaskKind.SLIDING_WINDOW):
        sq, sk = scores.dims[2], scores.dims[3]
        from_end = pos is None
        k_at = m.reshape(iota(m, sk, scores, reverse=from_end), (1, 1, 1, sk))
        q_at = m.reshape(iota(m, sq, scores, reverse=from_end), (1, 1, sq, 1))
        if pos is not None:
            q_at = q_at + m.reshape(m.cast(pos, I64), (pos.dims[0], 1, 1, 1))
        lag = (q_at - k_at) if pos is not None else (k_at - q_at)   # query position - key position
        keep = m.compare(lag, 0, "ge")
        s = m.where(keep, s, float("-inf"))
        if kind is MaskKind.SLIDING_WINDOW:
            s = m.where(m.compare(lag, window, "lt"), s, float("-inf"))
    if mask is not None and not mask.dtype.is_float:
        s = m.where(mask, s, float("-inf"))
    return m.cast(s, scores.dtype) if s.dtype != scores.dtype else s


# ----------------------------------------------------------------------------- argmax, topk
def _nan(m, x):
    """bool: x is NaN (None for an int x)."""
    return m.compare(x, x, "ne") if x.dtype.is_float else None


def _first(m, hit, at, ax):
    """The first index along `ax` where `hit` (i64, the axis kept with size 1)."""
    return m.reduce(m.where(hit, at, _NO_INDEX), "min", (ax,), keepdims=True)


def argmax_prims(m, x, axis=-1, keepdims=False):
    """numpy's argmax: the first index of the largest value; in a row holding NaN, the first
    NaN (NaN counts as the largest)."""
    ax = norm_axis(axis, x.shape.rank, "argmax")
    at = _along(m, iota(m, x.dims[ax], x), ax, x.shape.rank)
    hit = m.compare(x, m.reduce(x, "max", (ax,), keepdims=True), "eq")
    nan = _nan(m, x)
    if nan is not None:
        any_nan = m.compare(m.reduce(m.cast(nan, I64), "max", (ax,), keepdims=True), 0, "gt")
        hit = m.where(any_nan, nan, hit)
    first = _first(m, hit, at, ax)
    return first if keepdims else m.reshape(first, x.dims[:ax] + x.dims[ax + 1:])


def topk_prims(m, x, k, axis=-1):
    """The kernels' order (a stable sort of -x): largest first, equal values by index, NaN
    after everything (-inf included). k rounds: each takes the first largest entry not taken
    yet, or, when only NaN are left, the first of those."""
    ax = norm_axis(axis, x.shape.rank, "topk")
    at = _along(m, iota(m, x.dims[ax], x), ax, x.shape.rank)
    nan = _nan(m, x)
    ok = m.compare(x, x, "eq")                  # bool, x's shape: not taken yet and not NaN
    left = ok if nan is None else m.where(nan, True, ok)       # not taken yet
    values, indices = [], []
    for _ in range(k):
        best = m.reduce(m.where(ok, x, _lowest(x.dtype)), "max", (ax,), keepdims=True)
        hit = m.where(ok, m.compare(x, best, "eq"), False)
        if nan is not None:
            any_ok = m.compare(m.reduce(m.cast(ok, I64), "max", (ax,), keepdims=True), 0, "gt")
            hit = m.where(any_ok, hit, left)
        idx = _first(m, hit, at, ax)
        chosen = m.compare(at, idx, "eq")
        values.append(m.reduce(m.where(chosen, x, 0), "sum", (ax,), keepdims=True))
        indices.append(idx)
        left = m.where(chosen, False, left)
        ok = m.where(chosen, False, ok)
    if k == 1:
        return values[0], indices[0]
    return m.concat(values, ax), m.concat(indices, ax)


def _lowest(dt: DType):
    return float("-inf") if dt.is_float else int(np.iinfo(dt.np).min)


# ----------------------------------------------------------------------------- varlen, pooling
def segment_membership(m, tokens, starts, lens):
    """[tokens, segments] f32: 1 where token t lies in [starts[n], starts[n] + lens[n])."""
    t = m.reshape(iota(m, tokens, lens), (tokens, 1))
    row = (1, starts.dims[0])
    s = m.reshape(m.cast(starts, I64), row)
    e = s + m.reshape(m.cast(lens, I64), row)
    return m.cast(m.compare(t, s, "ge"), F32) * m.cast(m.compare(t, e, "lt"), F32)


def varlen_attention_prims(m, q, k, v, starts, lens, *, scale):
    """`attention` over all tokens with a block-diagonal keep-mask: tokens t and u attend when
    they share a segment ((M M^T)[t, u] > 0 for the membership M). O(T^2) memory."""
    tokens, heads = q.dims[:2]
    mf = segment_membership(m, tokens, starts, lens)
    keep = m.reshape(m.compare(m.matmul(mf, mf, trans_b=True), 0.5, "gt"), (1, 1, tokens, tokens))

    def bhsd(x):
        return m.transpose(m.reshape(x, (1,) + x.dims), (0, 2, 1, 3))

    o = m.attention(bhsd(q), bhsd(k), bhsd(v), keep, scale=scale, mask_kind=MaskKind.CUSTOM)
    o = m.reshape(m.transpose(o, (0, 2, 1, 3)), (tokens, heads, v.dims[2]))
    inside = m.reshape(m.compare(m.sum(mf, (1,)), 0.5, "gt"), (tokens, 1, 1))
    return m.where(inside, o, 0.0)          # a token in no segment: every key masked


def segment_pool_prims(m, x, starts, lens, *, mode):
    """mean and max: a masked sum or max over [segments, T, D] (a membership matmul would
    spread one segment's NaN or inf to every other through 0 * NaN); cls: a gather of each
    first token. Empty segments give zeros."""
    tokens, d = x.dims
    n = starts.dims[0]
    nonempty = m.compare(lens, 0, "gt")
    col = m.reshape(nonempty, (n, 1))
    if mode == "cls":
        r = m.gather(x, m.where(nonempty, starts, 0))
    else:
        mf = segment_membership(m, tokens, starts, lens)
        keep = m.reshape(m.transpose(m.compare(mf, 0.5, "gt"), (1, 0)), (n, tokens, 1))
        if mode == "mean":
            total = m.sum(m.where(keep, m.reshape(in_f32(m, x), (1, tokens, d)), 0.0), (1,))
            r = total / m.maximum(m.reshape(m.cast(lens, F32), (n, 1)), 1.0)
        else:
            r = m.max(m.where(keep, m.reshape(x, (1, tokens, d)), float("-inf")), (1,))
    return m.where(col, m.cast(r, x.dtype), 0.0)


# ----------------------------------------------------------------------------- the entries
def _mba(m, x, w, b=None, trans_b=False, act="identity"):
    y = m.matmul(x, w, trans_b=trans_b)
    if b is not None:
        y = y + b
    return y if act == "identity" else m.act(y, act)


def _dequantize(m, packed, scheme, dtype):
    return m.add("dequantize", (packed,), scheme=scheme, dtype=dtype.value)


def _mask_pos(rest, a) -> tuple:
    """(mask, pos) from the optional inputs after an attention op's fixed ones."""
    rest = list(rest)
    mask = rest.pop(0) if a["has_mask"] else None
    pos = rest.pop(0) if a["has_pos"] else None
    return mask, pos


_Q, _KV = "f16[1,4,3,8]", "f16[1,2,3,8]"
_ATTN_EXAMPLES = (
    ex(_Q, _KV, _KV, scale=0.5),
    ex(_Q, _KV, _KV, "f16[1,1,3,3]", scale=0.5, softcap=30.0, mask_kind="bias", has_mask=True),
    ex(_Q, _KV, _KV, "bool[1,1,3,3]", "i32[1]", scale=0.5, mask_kind="sliding_window", window=2,
       has_mask=True, has_pos=True),
)


@composite("linear", ex("f16[2,4]", "f16[3,4]", "f16[3]"), deep=True)
def _linear(m, ins, a):
    return _mba(m, ins[0], ins[1], ins[2] if len(ins) > 2 else None, trans_b=a["transpose_w"])


@composite("swiglu_mlp", ex("f16[2,4]", "f16[6,4]", "f16[6,4]", "f16[4,6]"), deep=True)
def _swiglu_mlp(m, ins, a):
    t = a["transpose_w"]
    return m.matmul(m.silu(m.matmul(ins[0], ins[1], trans_b=t)) * m.matmul(ins[0], ins[2], trans_b=t),
                    ins[3], trans_b=t)


@composite("fused_swiglu", ex("f16[2,4]", "f16[2,4]"), deep=True)
def _fused_swiglu(m, ins, a):
    return m.silu(ins[0]) * ins[1]


@composite("fused_matmul_bias_act", ex("f16[2,4]", "f16[3,4]", "f16[3]", trans_b=True, act="gelu"),
           deep=True)
def _fused_mba(m, ins, a):
    return _mba(m, ins[0], ins[1], ins[2] if len(ins) > 2 else None, a["trans_b"], a["act"])


@composite("fused_residual_rms_norm", ex("f16[2,4]", "f16[2,4]", "f16[4]"), deep=True)
def _fused_rrms(m, ins, a):
    h = ins[0] + ins[1]
    return h, m.rms_norm(h, *ins[2:], eps=a["eps"], offset=a["offset"])


@composite("fused_residual_ln", ex("f16[2,4]", "f16[2,4]", "f16[4]", "f16[4]"), deep=True)
def _fused_rln(m, ins, a):
    h = ins[0] + ins[1]
    return h, m.layer_norm(h, *ins[2:], eps=a["eps"])


@composite("fused_attention_block", ex(_Q, _KV, _KV, "f32[3,4]", "f32[3,4]", scale=0.5), deep=True)
def _fused_attention_block(m, ins, a):
    q, k = (m.rope(x, ins[3], ins[4], a["style"]) for x in ins[:2])
    return m.add("attention", (q, k, ins[2]) + tuple(ins[5:]),
                 **{key: v for key, v in a.items() if key != "style"})


@composite("fused_elementwise",
           ex("f16[2,3]", "f16[2,3]", dtype="f16",
              program=(("binary", (("op", "mul"),), (0, 1)), ("activation", (("fn", "silu"),), (2,)))),
           deep=True)
def _fused_elementwise(m, ins, a):
    """The program replayed step by step; a step's inputs broadcast to one shape first (the
    program broadcasts, and a step like fused_swiglu takes equal shapes only)."""
    slots = list(ins)
    for op, attrs_, args in a["program"]:
        xs = [slots[i] for i in args]
        dims = functools.reduce(broadcast_dims, (x.dims for x in xs))
        slots.append(m.add(op, tuple(m.expand(x, dims) for x in xs), **dict(attrs_)))
    return slots[-1]


@composite("dequant_matmul", ex("f16[2,32]", "u8[3,34]", "f16[3]", scheme="q8_0", act="silu"),
           deep=True)
def _dequant_matmul(m, ins, a):
    w = _dequantize(m, ins[1], a["scheme"], ins[0].dtype)
    return _mba(m, ins[0], w, ins[2] if len(ins) > 2 else None, True, a["act"])


@composite("varlen_attention", ex("f16[5,4,8]", "f16[5,2,8]", "f16[5,2,8]", "i64[2]", "i64[2]",
                                  scale=0.5), deep=True)
def _varlen_attention(m, ins, a):
    return varlen_attention_prims(m, *ins, **a)


@composite("segment_pool", *(ex("f16[5,4]", "i64[2]", "i64[2]", mode=mode)
                             for mode in ("mean", "cls", "max")), deep=True)
def _segment_pool(m, ins, a):
    return segment_pool_prims(m, *ins, **a)


def _quantized(m, x, scheme: str):
    """x through quantize and dequantize (what quantize does with NaN or inf is its own)."""
    return _dequantize(m, m.add("quantize", (x,), scheme=scheme), scheme, x.dtype)


@composite("fake_quantize", ex("f32[2,32]", scheme="q8_0"), deep=True,
           fusable=lambda m, ins, a: _quantized(m, ins[0], a["scheme"]))
def _fake_quantize(m, ins, a):
    return fake_quantize_prims(m, ins[0], a["scheme"])


def fake_quantize_prims(m, x, scheme: str):
    """x quantized and dequantized, block by block. A block holding NaN or inf comes out NaN,
    as in the kernels (quantize refuses non-finite values: they go in as 0, the block is
    NaN'd after); a last dim that is a symbol has no blocks to find, and is not checked."""
    finite = m.compare(x - x, 0.0, "eq")
    y = _quantized(m, m.where(finite, x, 0.0), scheme)
    k, size = x.dims[-1], QuantScheme.parse(scheme).block_size
    if not isinstance(k, int):
        return y
    blocks = x.dims[:-1] + (k // size, size)
    bad = m.reduce(m.reshape(1.0 - m.cast(finite, F32), blocks), "max", (-1,), keepdims=True)
    bad = m.reshape(m.expand(bad, blocks), x.dims)
    return m.where(m.compare(bad, 0.0, "gt"), float("nan"), y)


@composite("softmax_grad", ex("f16[2,3]", "f16[2,3]"), deep=True)
def _softmax_grad(m, ins, a):
    return softmax_grad_prims(m, *ins, axis=a["axis"])


@composite("rms_norm_grad", ex("f16[2,4]", "f16[4]", "f16[2,4]", offset=1.0), deep=True)
def _rms_norm_grad(m, ins, a):
    return rms_norm_grad_prims(m, *ins, eps=a["eps"], offset=a["offset"])


@composite("layer_norm_grad", ex("f16[2,4]", "f16[4]", "f16[2,4]"), deep=True)
def _layer_norm_grad(m, ins, a):
    return layer_norm_grad_prims(m, *ins, eps=a["eps"])


@composite("attention_grad", ex(_Q, _KV, _KV, _Q, _Q, scale=0.5),
           ex(_Q, _KV, _KV, _Q, _Q, "f16[1,1,3,3]", scale=0.5, softcap=30.0, mask_kind="bias",
              has_mask=True), deep=True)
def _attention_grad(m, ins, a):
    return attention_grad_prims(m, *ins[:5], *_mask_pos(ins[5:], a), **a)


@composite("rms_norm", ex("f16[2,4]", "f16[4]", offset=1.0), deep=True)
def _rms_norm(m, ins, a):
    return rms_norm_prims(m, *ins, eps=a["eps"], offset=a["offset"])


@composite("layer_norm", ex("f16[2,4]", "f16[4]", "f16[4]"), deep=True)
def _layer_norm(m, ins, a):
    return layer_norm_prims(m, *ins, eps=a["eps"])


@composite("softmax", ex("f16[2,3]"), deep=True,
           fusable=lambda m, ins, a: softmax_prims(m, ins[0], a["axis"]))
def _softmax(m, ins, a):
    return softmax_prims(m, ins[0], a["axis"], finite_max=True)


@composite("rope", *(ex("f16[1,2,3,8]", "f32[3,2]", "f32[3,2]", style=s) for s in ("half", "interleaved")),
           deep=True)
def _rope(m, ins, a):
    return rope_prims(m, *ins, style=a["style"])


@composite("attention", *_ATTN_EXAMPLES, deep=True,
           fusable=lambda m, ins, a: attention_prims(m, *ins[:3], *_mask_pos(ins[3:], a), **a))
def _attention(m, ins, a):
    return attention_prims(m, *ins[:3], *_mask_pos(ins[3:], a), **a, legalized=True)


@composite("mask_fill", ex("f16[1,2,3,4]"),
           ex("f16[1,2,seq,seq]", "bool[1,1,seq,seq]", "i64[1]", mask_kind="sliding_window", window=2,
              has_mask=True, has_pos=True),
           ex("f16[1,2,3,4]", "f16[1,1,3,4]", mask_kind="bias", has_mask=True))
def _mask_fill(m, ins, a):
    return mask_fill_prims(m, ins[0], *_mask_pos(ins[1:], a), **a)


@composite("argmax", ex("f16[2,5]"), ex("i32[2,seq]", axis=1, keepdims=True))
def _argmax(m, ins, a):
    return argmax_prims(m, ins[0], a["axis"], a["keepdims"])


@composite("topk", ex("f16[2,5]", k=2), ex("i32[2,seq]", k=1, axis=1))
def _topk(m, ins, a):
    return topk_prims(m, ins[0], a["k"], a["axis"])


# ----------------------------------------------------------------------------- collectives
def _group_of_one(op: str):
    """`op`'s composite: the identity for a group of one rank; more ranks need a backend
    that has the collective (BackendError naming the op, when legalize meets it). Not
    OPTIONAL: coverage traces it at world 1 and counts the op as run, and a graph of more
    ranks still fails to compile naming the op, as an OPTIONAL op lacking would."""
    def build(m, ins, a):
        if a["world"] != 1:
            raise BackendError(f"{op} over a group of {a['world']} ranks needs a backend with "
                               f"collectives; without them only a group of one rank runs (where "
                               f"{op} is the identity)")
        return ins[0]
    build.__qualname__ = f"_{op}"
    return build


for _op in COLLECTIVES:
    composite(_op, ex("f32[2,4]", world=1, rank=0))(_group_of_one(_op))


__all__ = ["COMPOSITES", "PRIMITIVES", "OPTIONAL", "CONTROL_FLOW", "Composite", "composite", "ex",
           "legalize", "check_coverage", "emitted_ops", "missing_primitives", "iota"]
