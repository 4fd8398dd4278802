"""Routed experts (mixture of experts): two ops of the one table.

  moe_route    router logits [..., E] -> (weights [..., k], expert ids [..., k]): which k
               of E experts each token goes to, and with what weight;
  moe_experts  x [..., H], weights, ids, and every expert's gated MLP (gate, up [E, I, H],
               down [E, H, I], dense or packed) -> y [..., H]: each token through its k
               experts, their outputs summed with the route's weights.

The tokens are all the leading dims ([batch, seq] in a model, [T] alone in a test): a flow's
symbolic batch and seq cannot be merged into one dim, and a kernel flattens them for free.

The router variants are attributes, not code paths per model:
  order="softmax_topk"                   softmax over E, then the k largest
  order="softmax_topk", normalize=True   ... rescaled to sum 1 (HF's norm_topk_prob)
  order="topk_softmax"                   the k largest logits, softmaxed among themselves
                                         (the same weights as the line above)
A shared expert with a sigmoid gate is a dense gated MLP beside these
ops (rlx_core.flow's MoE block), not a router variant.
"""
from __future__ import annotations

import numpy as np

from .composites import composite, ex
from .dtype import I64
from .errors import DTypeError, ModelError, ShapeError
from .numpy_kernels import ACT as NUMPY_ACT, KERNELS, _softmax_f32, fake_quantized, put, scheme, up
from .ops import ACT, COUNT, FLAG, Level, _float, _packed_k, _same_dim, one_of, op
from .ops import A, _BAD, _scheme
from .shape import Shape

INT8_SCHEME, INT8_BLOCK = "int8_b32", 32     # the rounding of `activations = "int8"`

ROUTE_ORDERS = ("softmax_topk", "topk_softmax")
EXPERT_NAMES = ("gate", "up", "down")


def _schemes(v):
    """Three scheme names (gate, up, down), each "" for a dense float weight."""
    if not (isinstance(v, tuple) and len(v) == 3):
        return _BAD
    out = tuple("" if s == "" else _scheme(s) for s in v)
    return _BAD if any(s is _BAD for s in out) else out


SCHEMES = A('three entries (gate, up, down), each "" (dense) or a quant scheme name', _schemes)


@op("moe_route", ["logits"], Level.FUSED, n_outputs=2,
    attrs={"k": COUNT, "order": one_of(ROUTE_ORDERS)("softmax_topk"), "normalize": FLAG(False)})
def _m_moe_route(s, a):
    """Router logits [..., E] -> (weights [..., k] in the logits' dtype, expert ids [..., k]
    i64): each token's k chosen experts, largest first (the lowest id first on ties); see the
    module docstring for `order` and `normalize`."""
    x = s[0]
    _float(x, "moe_route")
    if x.rank < 2:
        raise ShapeError(f"moe_route logits must be [..., tokens, experts], got {x}")
    e = x.dims[-1]
    if a["k"] < 1 or (isinstance(e, int) and a["k"] > e):
        raise ShapeError(f"moe_route k={a['k']}: expected 1 <= k <= the {e} experts")
    dims = x.dims[:-1] + (a["k"],)
    return (Shape(dims, x.dtype), Shape(dims, I64))


def _expert_k(w: Shape, scheme: str, name: str, x: Shape):
    """(E, rows, K) of one expert stack: dense [E, rows, K] in x's dtype or packed u8
    [E, rows, bytes of K]."""
    if w.rank != 3:
        raise ShapeError(f"moe_experts {name} must be [experts, rows, cols] "
                         f"({'packed ' + scheme if scheme else 'dense'}), got {w}")
    if scheme:
        return w.dims[0], w.dims[1], _packed_k(w, scheme, f"moe_experts {name}")
    if w.dtype is not x.dtype:
        raise DTypeError(f"moe_experts {name} is {w.dtype.value}, expected x's dtype {x.dtype.value} "
                         "(or a packed scheme)")
    return w.dims


@op("moe_experts", ["x", "weights", "ids", "gate", "up", "down"], Level.FUSED,
    attrs={"act": ACT("silu"), "schemes": SCHEMES(("", "", "")), "int8_h": FLAG(False)})
def _m_moe_experts(s, a):
    """Routed gated MLPs: y[t] = sum_j weights[t, j] * down[e] @ (act(gate[e] @ x[t]) *
    (up[e] @ x[t])) with e = ids[t, j]. x [..., H]; weights [..., k] (x's dtype); ids [..., k]
    int, each in [0, E); gate, up [E, I, H] and down [E, H, I] (each expert an nn.Linear weight),
    or per `schemes` their packed rows u8 [E, I, bytes of H] / [E, H, bytes of I] (GGUF's
    ffn_{gate,up,down}_exps). `int8_h`: the intermediate h is rounded through int8 blocks of
    32 (int8_b32) before the down projection, as `[precision] activations = "int8"` rounds a
    packed matmul's input, so a backend may run the down pass in integers. -> [..., H] in x's
    dtype."""
    x, w, ids = s[:3]
    _float(x, "moe_experts")
    if x.rank < 2:
        raise ShapeError(f"moe_experts x must be [..., tokens, hidden], got {x}")
    if w.rank != x.rank or ids.rank != x.rank:
        raise ShapeError(f"moe_experts weights and ids must be [..., tokens, k] with x's leading dims, "
                         f"got {w} and {ids} for x {x}")
    if w.dtype is not x.dtype:
        raise DTypeError(f"moe_experts weights are {w.dtype.value}, expected x's dtype {x.dtype.value}")
    if not ids.dtype.is_int:
        raise DTypeError(f"moe_experts ids must be an int type, got {ids.dtype.value}")
    for i in range(x.rank):
        _same_dim(w.dims[i], ids.dims[i], f"moe_experts weights vs ids dim {i}")
        if i < x.rank - 1:
            _same_dim(w.dims[i], x.dims[i], f"moe_experts weights vs x dim {i} (tokens)")
    (eg, ig, hg), (eu, iu, hu), (ed, hd, id_) = (
        _expert_k(t, sch, n, x) for t, sch, n in zip(s[3:], a["schemes"], EXPERT_NAMES))
    for what, dims in (("experts", (eg, eu, ed)), ("intermediate", (ig, iu, id_)),
                       ("hidden", (x.dims[-1], hg, hu, hd))):
        for d in dims[1:]:
            _same_dim(dims[0], d, f"moe_experts {what} of x/gate/up/down")
    if a["int8_h"] and not (isinstance(ig, int) and ig % INT8_BLOCK == 0):
        raise ShapeError(f"moe_experts int8_h rounds h in blocks of {INT8_BLOCK}: the intermediate "
                         f"size must be a multiple of {INT8_BLOCK}, got {ig}")
    return (Shape(x.dims, x.dtype),)


# ----------------------------------------------------------------- NumPy kernels
def _top_ids(z: np.ndarray, k: int) -> np.ndarray:
    """The k largest along the last axis, largest first, the lowest id first on ties (a
    stable sort of -z: torch.topk's order on distinct values, the composite's on ties)."""
    return np.argsort(-z, axis=-1, kind="stable")[..., :k]


def _moe_route_kernel(a, out, logits):
    z, k = up(logits), a["k"]
    if a["order"] == "topk_softmax":
        ids = _top_ids(z, k)
        w = _softmax_f32(np.take_along_axis(z, ids, -1), -1)
    else:
        p = _softmax_f32(z, -1)
        ids = _top_ids(p, k)
        w = np.take_along_axis(p, ids, -1)
        if a["normalize"]:
            w = w / w.sum(-1, keepdims=True)
    put(out[0], w)
    put(out[1], ids)


def _expert_rows(stack: np.ndarray, sch: str, e: int, k: int, ct, scratch: dict) -> np.ndarray:
    """Expert e's [rows, k] weight in the compute dtype: a view of a dense f32/f64 stack, or
    decoded from its packed bytes into a scratch reused across experts."""
    if not sch:
        return stack[e] if stack.dtype == ct else stack[e].astype(ct)
    buf = scratch.get(id(stack))
    if buf is None:
        buf = scratch[id(stack)] = np.empty((stack.shape[1], k), ct)
    return scheme(sch).dequantize(stack[e], buf.shape, out=buf, dtype=ct)


def _moe_experts_kernel(a, out, x, weights, ids, gate, up_, down):
    """Tokens grouped by expert with one stable argsort; per expert that has tokens, one
    matmul per projection (packed experts decoded one at a time); each (token, slot) result
    lands in its own row, and a [T, 1, k] @ [T, k, H] matmul sums them with the weights."""
    hid, k = x.shape[-1], ids.shape[-1]
    xf = up(x).reshape(-1, hid)
    ct = np.float64 if xf.dtype == np.float64 else np.float32
    xf = xf.astype(ct, copy=False)
    flat = ids.reshape(-1).astype(np.int64)
    n_exp, inter = gate.shape[0], gate.shape[1]
    if flat.size and (flat.min() < 0 or flat.max() >= n_exp):
        raise ModelError(f"moe_experts: expert id out of range [0, {n_exp}) (min {flat.min()}, "
                         f"max {flat.max()})")
    order = np.argsort(flat, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n_exp))])
    slots = np.zeros((flat.size, hid), ct)
    sg, su, sd = a["schemes"]
    act = NUMPY_ACT[a["act"]]
    scratch: dict = {}
    for e in map(int, np.flatnonzero(np.diff(bounds))):
        sel = order[bounds[e]:bounds[e + 1]]
        xs = xf[sel // k]
        h = act(xs @ _expert_rows(gate, sg, e, hid, ct, scratch).T)
        h *= xs @ _expert_rows(up_, su, e, hid, ct, scratch).T
        if a["int8_h"]:
            h = fake_quantized(h, INT8_SCHEME)
        slots[sel] = h @ _expert_rows(down, sd, e, inter, ct, scratch).T
    w = up(weights).reshape(-1, 1, k).astype(ct, copy=False)
    y = np.matmul(w, slots.reshape(-1, k, hid))
    put(out[0], y.reshape(out[0].shape))


KERNELS.update({"moe_route": _moe_route_kernel, "moe_experts": _moe_experts_kernel})


# ----------------------------------------------------------------- composites
@composite("moe_route", ex("f16[3,5]", k=2), ex("f16[3,5]", k=2, normalize=True),
           ex("f16[3,5]", k=2, order="topk_softmax"), ex("f32[b,s,6]", k=3, normalize=True))
def _moe_route(m, ins, a):
    logits, k = ins[0], a["k"]
    last = logits.shape.rank - 1
    if a["order"] == "topk_softmax":
        top, ids = m.topk(logits, k)
        return m.softmax(top), ids
    w, ids = m.topk(m.softmax(logits), k)
    return (w / m.sum(w, (last,), keepdims=True) if a["normalize"] else w), ids


def route_matrix(m, weights, ids, experts: int):
    """The dense [..., E] routing matrix: weights[..., j] at column ids[..., j], zeros elsewhere."""
    lead, k = weights.dims[:-1], weights.dims[-1]
    cols = m.constant(np.arange(experts, dtype=np.int64))
    hit = m.compare(m.reshape(m.cast(ids, I64), lead + (k, 1)), cols, "eq")
    zero = m.constant(0.0, weights.dtype)
    return m.sum(m.where(hit, m.reshape(weights, lead + (k, 1)), zero), (len(lead),))


@composite("moe_experts", ex("f16[3,4]", "f16[3,2]", "i64[3,2]", "f16[5,6,4]", "f16[5,6,4]", "f16[5,4,6]"),
           ex("f32[3,32]", "f32[3,2]", "i64[3,2]", "u8[5,6,34]", "u8[5,6,34]", "f32[5,32,6]",
              schemes=("q8_0", "q8_0", "")),
           ex("f32[b,s,4]", "f32[b,s,2]", "i32[b,s,2]", "f32[3,6,4]", "f32[3,6,4]", "f32[3,4,6]"),
           ex("f32[3,32]", "f32[3,2]", "i64[3,2]", "u8[5,32,34]", "u8[5,32,34]", "u8[5,32,34]",
              schemes=("q8_0", "q8_0", "q8_0"), int8_h=True))
def _moe_experts(m, ins, a):
    """Every expert on every token (gathers by expert would copy k weight stacks per token),
    then the outputs weighted by the dense routing matrix: E / k times the work of the fused
    op, no loop, only primitives. The leading token dims stay (symbolic ones cannot merge):
    x [..., H] becomes [E, ..., H] and each stack [E, 1.., rows, cols] broadcasts over it."""
    x, weights, ids = ins[:3]
    stacks = [w if not sch else m.add("dequantize", (w,), scheme=sch, dtype=x.dtype.value)
              for w, sch in zip(ins[3:], a["schemes"])]
    lead = x.dims[:-1]
    e, ones = stacks[0].dims[0], (1,) * (len(lead) - 1)
    gate, up_, down = (m.reshape(w, (e,) + ones + w.dims[1:]) for w in stacks)
    xe = m.expand(m.reshape(x, (1,) + x.dims), (e,) + x.dims)
    inner = m.act(m.matmul(xe, gate, trans_b=True), a["act"]) * m.matmul(xe, up_, trans_b=True)
    if a["int8_h"]:
        inner = m.add("fake_quantize", (inner,), scheme=INT8_SCHEME)
    ys = m.matmul(inner, down, trans_b=True)                              # [E, ..., H]
    r = route_matrix(m, weights, ids, e)                                  # [..., E]
    r = m.transpose(r, (len(lead),) + tuple(range(len(lead))))           # [E, ...]
    return m.sum(ys * m.reshape(r, (e,) + lead + (1,)), (0,))


__all__ = ["ROUTE_ORDERS", "EXPERT_NAMES", "SCHEMES", "INT8_SCHEME", "route_matrix"]
