"""Routed experts (mixture of experts): two ops of the one table.

  moe_route    router logits [T, E] -> (weights [T, k], expert ids [T, k]): which k of E
               experts each token goes to, and with what weight;
  moe_experts  x [T, H], weights, ids, and every expert's gated MLP (gate, up [E, I, H],
               down [E, H, I], dense or packed) -> y [T, H]: each token through its k
               experts, their outputs summed with the route's weights.

The router variants are attributes, not code paths per model:
  order="softmax_topk"                   softmax over E, then the k largest (OLMoE)
  order="softmax_topk", normalize=True   ... rescaled to sum 1 (Qwen3-MoE norm_topk_prob)
  order="topk_softmax"                   the k largest logits, softmaxed among themselves
                                         (Mixtral; the same weights as the line above)
A shared expert with a sigmoid gate (Qwen2/Qwen3.5-MoE) is a dense gated MLP beside these
ops (rlx_core.flow's MoE block), not a router variant.
"""
from __future__ import annotations

import numpy as np

from .composites import composite, ex
from .dtype import I64
from .errors import DTypeError, ShapeError
from .ops import ACT, COUNT, FLAG, Level, _float, _packed_k, _same_dim, one_of, op
from .ops import A, _BAD, _scheme
from .shape import Shape

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
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] i64):
    each token's k chosen experts, largest first (the lowest id first on ties); see the
    module docstring for `order` and `normalize`."""
    x = s[0]
    _float(x, "moe_route")
    if x.rank != 2:
        raise ShapeError(f"moe_route logits must be [tokens, experts], got {x}")
    e = x.dims[1]
    if a["k"] < 1 or (isinstance(e, int) and a["k"] > e):
        raise ShapeError(f"moe_route k={a['k']}: expected 1 <= k <= the {e} experts")
    dims = (x.dims[0], a["k"])
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
    attrs={"act": ACT("silu"), "schemes": SCHEMES(("", "", ""))})
def _m_moe_experts(s, a):
    """Routed gated MLPs: y[t] = sum_j weights[t, j] * down[e] @ (act(gate[e] @ x[t]) *
    (up[e] @ x[t])) with e = ids[t, j]. x [T, H]; weights [T, k] (x's dtype); ids [T, k] int,
    each in [0, E); gate, up [E, I, H] and down [E, H, I] (each expert an nn.Linear weight),
    or per `schemes` their packed rows u8 [E, I, bytes of H] / [E, H, bytes of I] (GGUF's
    ffn_{gate,up,down}_exps). -> [T, H] in x's dtype."""
    x, w, ids = s[:3]
    _float(x, "moe_experts")
    if x.rank != 2:
        raise ShapeError(f"moe_experts x must be [tokens, hidden], got {x}")
    if w.rank != 2 or ids.rank != 2:
        raise ShapeError(f"moe_experts weights and ids must be [tokens, k], got {w} and {ids}")
    if w.dtype is not x.dtype:
        raise DTypeError(f"moe_experts weights are {w.dtype.value}, expected x's dtype {x.dtype.value}")
    if not ids.dtype.is_int:
        raise DTypeError(f"moe_experts ids must be an int type, got {ids.dtype.value}")
    for i, what in ((0, "tokens"), (1, "k")):
        _same_dim(w.dims[i], ids.dims[i], f"moe_experts weights vs ids {what}")
    _same_dim(w.dims[0], x.dims[0], "moe_experts weights vs x tokens")
    (eg, ig, hg), (eu, iu, hu), (ed, hd, id_) = (
        _expert_k(t, sch, n, x) for t, sch, n in zip(s[3:], a["schemes"], EXPERT_NAMES))
    for what, dims in (("experts", (eg, eu, ed)), ("intermediate", (ig, iu, id_)),
                       ("hidden", (x.dims[1], hg, hu, hd))):
        for d in dims[1:]:
            _same_dim(dims[0], d, f"moe_experts {what} of x/gate/up/down")
    return (Shape(x.dims, x.dtype),)


# ----------------------------------------------------------------- composites
@composite("moe_route", ex("f16[3,5]", k=2), ex("f16[3,5]", k=2, normalize=True),
           ex("f16[3,5]", k=2, order="topk_softmax"))
def _moe_route(m, ins, a):
    logits, k = ins[0], a["k"]
    if a["order"] == "topk_softmax":
        top, ids = m.topk(logits, k)
        return m.softmax(top), ids
    w, ids = m.topk(m.softmax(logits), k)
    return (w / m.sum(w, (1,), keepdims=True) if a["normalize"] else w), ids


def route_matrix(m, weights, ids, experts: int):
    """The dense [T, E] routing matrix: weights[t, j] at column ids[t, j], zeros elsewhere."""
    t, k = weights.dims
    cols = m.constant(np.arange(experts, dtype=np.int64).reshape(1, 1, experts))
    hit = m.compare(m.reshape(m.cast(ids, I64), (t, k, 1)), cols, "eq")
    zero = m.constant(0.0, weights.dtype)
    return m.sum(m.where(hit, m.reshape(weights, (t, k, 1)), zero), (1,))


@composite("moe_experts", ex("f16[3,4]", "f16[3,2]", "i64[3,2]", "f16[5,6,4]", "f16[5,6,4]", "f16[5,4,6]"),
           ex("f32[3,32]", "f32[3,2]", "i64[3,2]", "u8[5,6,34]", "u8[5,6,34]", "f32[5,32,6]",
              schemes=("q8_0", "q8_0", "")))
def _moe_experts(m, ins, a):
    """Every expert on every token (gathers by expert would copy k weight stacks per token),
    then the outputs weighted by the dense routing matrix: E / k times the work of the fused
    op, no loop, only primitives."""
    x, weights, ids = ins[:3]
    stacks = [w if not sch else m.add("dequantize", (w,), scheme=sch, dtype=x.dtype.value)
              for w, sch in zip(ins[3:], a["schemes"])]
    gate, up, down = stacks
    e, (t, h) = gate.dims[0], x.dims
    xe = m.expand(m.reshape(x, (1, t, h)), (e, t, h))
    inner = m.act(m.matmul(xe, gate, trans_b=True), a["act"]) * m.matmul(xe, up, trans_b=True)
    ys = m.matmul(inner, down, trans_b=True)                             # [E, T, H]
    r = m.transpose(route_matrix(m, weights, ids, e), (1, 0))             # [E, T]
    return m.sum(ys * m.reshape(r, (e, t, 1)), (0,))


__all__ = ["ROUTE_ORDERS", "EXPERT_NAMES", "SCHEMES", "route_matrix"]
