"""HIR -> MIR under a FusionPolicy, and the decompositions of fused ops into primitives.

`direct`: a block becomes the fused MIR op that implements it.
`fusable`: a block becomes a primitive chain; the fusion passes re-fuse it for the target.
The same decomposition table legalizes a fused op for a backend that lacks it.
"""
from __future__ import annotations

import enum

from .dtype import F32, F64, I64
from .control import map_bodies
from .graph import MIR, Builder, Graph
from .ops import MaskKind
from .rewrite import rewrite


F32_LOWEST = -3.4028234663852886e38     # np.finfo(np.float32).min


class FusionPolicy(str, enum.Enum):
    DIRECT = "direct"
    FUSABLE = "fusable"


def _f32(m: Builder, x):
    return x if x.dtype in (F32, F64) else m.cast(x, F32)


def rms_norm_prims(m, x, w=None, eps=1e-6, offset=0.0):
    xf = _f32(m, x)
    inv = m.rsqrt(m.mean(xf * xf, (-1,), keepdims=True) + eps)
    y = m.cast(xf * inv, x.dtype)
    if w is not None:
        y = y * (w + offset if offset else w)
    return y


def layer_norm_prims(m, x, g=None, b=None, eps=1e-5):
    xf = _f32(m, x)
    d = xf - m.mean(xf, (-1,), keepdims=True)
    y = m.cast(d * m.rsqrt(m.mean(d * d, (-1,), keepdims=True) + eps), x.dtype)
    if g is not None:
        y = y * g
    if b is not None:
        y = y + b
    return y


def softmax_prims(m, x, axis=-1):
    """A row of all -inf (a query that may attend to nothing, e.g. a padding row) gives zeros,
    like the kernels: the max is clamped to the lowest finite f32 so exp gives 0, not NaN, and
    the sum (>= 1 whenever the row has a finite entry) to 1."""
    xf = _f32(m, x)
    e = m.exp(xf - m.maximum(m.max(xf, (axis,), keepdims=True), F32_LOWEST))
    return m.cast(e / m.maximum(m.sum(e, (axis,), keepdims=True), 1.0), x.dtype)


def _rows_sum(m, t, w):
    """t [..., D] summed over every leading axis, as w's dtype [D]."""
    return m.cast(m.sum(t, tuple(range(t.shape.rank - 1))) if t.shape.rank > 1 else t, w.dtype)


def softmax_grad_prims(m, y, g, axis=-1):
    yf, gf = _f32(m, y), _f32(m, g)
    return m.cast(yf * (gf - m.sum(gf * yf, (axis,), keepdims=True)), y.dtype)


def rms_norm_grad_prims(m, x, w, g, eps=1e-6, offset=0.0):
    """(dx, dw) of rms_norm(x, w); without w (None) dw is None."""
    xf, gf = _f32(m, x), _f32(m, g)
    inv = m.rsqrt(m.mean(xf * xf, (-1,), keepdims=True) + eps)
    n = xf * inv
    dn = gf if w is None else gf * (_f32(m, w) + offset if offset else _f32(m, w))
    dx = inv * (dn - n * m.mean(dn * n, (-1,), keepdims=True))
    return m.cast(dx, x.dtype), (None if w is None else _rows_sum(m, gf * n, w))


def layer_norm_grad_prims(m, x, gamma, g, eps=1e-5):
    """(dx, dgamma, dbeta) of layer_norm(x, gamma, beta); without gamma dgamma is None and
    dbeta is summed in x's dtype."""
    xf, gf = _f32(m, x), _f32(m, g)
    d = xf - m.mean(xf, (-1,), keepdims=True)
    inv = m.rsqrt(m.mean(d * d, (-1,), keepdims=True) + eps)
    n = d * inv
    dn = gf if gamma is None else gf * _f32(m, gamma)
    dx = inv * (dn - m.mean(dn, (-1,), keepdims=True) - n * m.mean(dn * n, (-1,), keepdims=True))
    like = gamma if gamma is not None else x
    return (m.cast(dx, x.dtype), None if gamma is None else _rows_sum(m, gf * n, gamma),
            _rows_sum(m, gf, like))


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
    s = m.matmul(_f32(m, q), _f32(m, kk), trans_b=True) * a["scale"]
    t = None
    if a["softcap"]:
        t = m.tanh(s / a["softcap"])
        s = t * a["softcap"]
    if a["mask_kind"] != MaskKind.NONE.value or a["has_mask"]:
        s = m.add("mask_fill", (s,) + tuple(x for x in (mask, pos) if x is not None),
                  **{k: a[k] for k in ("mask_kind", "window", "has_mask", "has_pos")})
    return softmax(m, s, -1), t


def attention_prims(m, q, k, v, mask=None, pos=None, *, scale, mask_kind="causal", window=0,
                    softcap=0.0, has_mask=False, has_pos=False):
    heads = q.dims[1]
    a = dict(scale=scale, mask_kind=mask_kind, window=window, softcap=softcap, has_mask=has_mask,
             has_pos=has_pos)
    p, _ = _attention_probs(m, q, repeat_kv(m, k, heads), mask, pos, a, softmax_prims)
    return m.cast(m.matmul(p, _f32(m, repeat_kv(m, v, heads))), q.dtype)


def _group_sum(m, x, kvh):
    """[B, H, S, D] -> [B, KVH, S, D]: the sum over each kv head's query heads (GQA)."""
    b, h, s, d = x.dims
    return x if h == kvh else m.sum(m.reshape(x, (b, kvh, h // kvh, s, d)), (2,))


def attention_grad_prims(m, q, k, v, out, g, mask=None, pos=None, **a):
    """attention_grad as primitives: the probabilities recomputed, dv = P^T g, dS =
    softmax_grad(P, g v^T) through the softcap's tanh, times scale; dq = dS k, dk = dS^T q."""
    heads, kvh = q.dims[1], k.dims[1]
    kk, vv, gf = repeat_kv(m, k, heads), _f32(m, repeat_kv(m, v, heads)), _f32(m, g)
    p, t = _attention_probs(m, q, kk, mask, pos, a, lambda m, x, axis: m.softmax(x, axis))
    ds = m.add("softmax_grad", (p, m.matmul(gf, vv, trans_b=True)), axis=-1)
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = ds * a["scale"]
    dq = m.matmul(ds, _f32(m, kk))
    dk = _group_sum(m, m.matmul(ds, _f32(m, q), trans_a=True), kvh)
    dv = _group_sum(m, m.matmul(p, gf, trans_a=True), kvh)
    return m.cast(dq, q.dtype), m.cast(dk, k.dtype), m.cast(dv, v.dtype)


def _iota(m, n, tie):
    """0, 1, ..., n - 1 (i64) for a dim n that may be symbolic. The ones are computed from
    `tie` (an int value of the run): built from a constant they would be hoisted to load
    time, which knows no symbolic dims."""
    one = m.sum(m.cast(tie, I64), (0,), keepdims=True) * 0 + 1         # [1]
    return m.cumsum(m.expand(one, (n,)), 0) - 1


def segment_membership(m, tokens, starts, lens):
    """[tokens, segments] f32: 1 where token t lies in [starts[n], starts[n] + lens[n])."""
    t = m.reshape(_iota(m, tokens, lens), (tokens, 1))
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
            total = m.sum(m.where(keep, m.reshape(_f32(m, x), (1, tokens, d)), 0.0), (1,))
            r = total / m.maximum(m.reshape(m.cast(lens, F32), (n, 1)), 1.0)
        else:
            r = m.max(m.where(keep, m.reshape(x, (1, tokens, d)), float("-inf")), (1,))
    return m.where(col, m.cast(r, x.dtype), 0.0)


def _elementwise_replay(m, ins, program):
    slots = list(ins)
    for op, attrs_, args in program:
        slots.append(m.add(op, tuple(slots[i] for i in args), **dict(attrs_)))
    return slots[-1]


def _mba(m, x, w, b=None, trans_b=False, act="identity"):
    y = m.matmul(x, w, trans_b=trans_b)
    if b is not None:
        y = y + b
    return y if act == "identity" else m.act(y, act)


def _dequantize(m, packed, scheme, dtype):
    return m.add("dequantize", (packed,), scheme=scheme, dtype=dtype.value)


# op -> fn(m, inputs, attrs) -> output value(s), using only primitives (and other prims of
# the PRIM level such as rms_norm when `deep` is False).
def _decompose(deep: bool):
    def norm_rms(m, ins, a):
        return rms_norm_prims(m, *ins, eps=a["eps"], offset=a["offset"]) if deep else None

    table = {
        "linear": lambda m, ins, a: _mba(m, ins[0], ins[1], ins[2] if len(ins) > 2 else None,
                                          trans_b=a["transpose_w"]),
        "swiglu_mlp": lambda m, ins, a: m.matmul(
            m.silu(m.matmul(ins[0], ins[1], trans_b=a["transpose_w"]))
            * m.matmul(ins[0], ins[2], trans_b=a["transpose_w"]), ins[3], trans_b=a["transpose_w"]),
        "fused_swiglu": lambda m, ins, a: m.silu(ins[0]) * ins[1],
        "fused_matmul_bias_act": lambda m, ins, a: _mba(
            m, ins[0], ins[1], ins[2] if len(ins) > 2 else None, a["trans_b"], a["act"]),
        "fused_residual_rms_norm": lambda m, ins, a: (
            lambda h: (h, m.rms_norm(h, *ins[2:], eps=a["eps"], offset=a["offset"])))(ins[0] + ins[1]),
        "fused_residual_ln": lambda m, ins, a: (
            lambda h: (h, m.layer_norm(h, *ins[2:], eps=a["eps"])))(ins[0] + ins[1]),
        "fused_attention_block": lambda m, ins, a: m.add(
            "attention", (m.rope(ins[0], ins[3], ins[4], a["style"]),
                          m.rope(ins[1], ins[3], ins[4], a["style"]), ins[2]) + tuple(ins[5:]),
            **{k: v for k, v in a.items() if k != "style"}),
        "fused_elementwise": lambda m, ins, a: _elementwise_replay(m, ins, a["program"]),
        "dequant_matmul": lambda m, ins, a: _mba(
            m, ins[0], _dequantize(m, ins[1], a["scheme"], ins[0].dtype), ins[2] if len(ins) > 2 else None,
            True, a["act"]),
        "varlen_attention": lambda m, ins, a: varlen_attention_prims(m, *ins, **a),
        "segment_pool": lambda m, ins, a: segment_pool_prims(m, *ins, **a),
        "fake_quantize": lambda m, ins, a: _dequantize(
            m, m.add("quantize", (ins[0],), scheme=a["scheme"]), a["scheme"], ins[0].dtype),
        "softmax_grad": lambda m, ins, a: softmax_grad_prims(m, *ins, axis=a["axis"]),
        "rms_norm_grad": lambda m, ins, a: rms_norm_grad_prims(m, *ins, eps=a["eps"], offset=a["offset"]),
        "layer_norm_grad": lambda m, ins, a: layer_norm_grad_prims(m, *ins, eps=a["eps"]),
        "attention_grad": lambda m, ins, a: attention_grad_prims(
            m, *ins[:5], *_attn_split(ins[:3] + ins[5:], a)[3:], **a),
    }
    if deep:
        table.update({
            "rms_norm": norm_rms,
            "layer_norm": lambda m, ins, a: layer_norm_prims(m, *ins, eps=a["eps"]),
            "softmax": lambda m, ins, a: softmax_prims(m, ins[0], a["axis"]),
            "rope": lambda m, ins, a: rope_prims(m, *ins, style=a["style"]),
            "attention": lambda m, ins, a: attention_prims(m, *_attn_split(ins, a), **a),
        })
    return table


def _attn_split(ins, a):
    q, k, v, *rest = ins
    mask = rest.pop(0) if a["has_mask"] else None
    pos = rest.pop(0) if a["has_pos"] else None
    return q, k, v, mask, pos


DECOMPOSE_FUSED = _decompose(deep=False)     # legalize: fused -> prims (one level)
DECOMPOSE_DEEP = _decompose(deep=True)       # fusable lowering: blocks -> elementwise chains


def _direct(m, node, ins):
    a = node.a
    if node.op == "linear":
        if len(ins) > 2:
            return m.add("fused_matmul_bias_act", tuple(ins), trans_b=a["transpose_w"])
        return m.matmul(ins[0], ins[1], trans_b=a["transpose_w"])
    if node.op == "swiglu_mlp":
        t = a["transpose_w"]
        h = m.add("fused_swiglu", (m.matmul(ins[0], ins[1], trans_b=t), m.matmul(ins[0], ins[2], trans_b=t)))
        return m.matmul(h, ins[3], trans_b=t)
    return None


def lower(g: Graph, policy: FusionPolicy | str = FusionPolicy.DIRECT, keep=frozenset()) -> Graph:
    """HIR -> MIR. Under `fusable` every block, norm, softmax, rope and attention becomes
    primitives, leaving the fusion passes to rebuild what the target can fuse; the MIR ops
    named in `keep` stay (value_and_grad keeps those whose backward is a fused op)."""
    policy = FusionPolicy(policy)
    g = map_bodies(g, lambda body: lower(body, policy, keep))        # control-flow bodies first

    def replace(m, node, ins, i, lookup):
        if policy is FusionPolicy.DIRECT:
            return _direct(m, node, ins)
        if node.op in keep:
            return None
        fn = DECOMPOSE_DEEP.get(node.op)
        return fn(m, ins, node.a) if fn else None

    return rewrite(g, replace, level=MIR)


def legalize(g: Graph, supported: set) -> tuple:
    """Decompose every fused op the backend lacks; returns (graph, names legalized)."""
    done: list = []

    def inner(body):                         # control-flow bodies: the same backend runs them
        body, names = legalize(body, supported)
        done.extend(names)
        return body

    g = map_bodies(g, inner)

    def lacking(op):
        return op in DECOMPOSE_FUSED and op not in supported

    def replace(m, node, ins, i, lookup):
        if lacking(node.op):
            done.append(node.op)
            return DECOMPOSE_FUSED[node.op](m, ins, node.a)
        return None

    g = rewrite(g, replace)
    while any(lacking(n.op) for n in g.nodes):      # a decomposition may emit another fused op
        g = rewrite(g, replace)
    return g, sorted(set(done))


__all__ = ["FusionPolicy", "lower", "legalize"]
