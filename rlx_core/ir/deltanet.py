"""Linear-attention layers' fused ops (Gated DeltaNet, Qwen3.5 / Qwen3-Next):

  gated_delta_rule  the gated delta rule over a sequence from a state, as one op: prefill in
                    the chunked (WY) form, one step the recurrent form; its composite is the
                    scan of rlx_core.ir.recurrence (the definition the kernels are tested on).
  causal_conv1d     the short depthwise causal convolution before q/k/v, from a state of the
                    inputs before this call.

Both return their new state beside the output; a decode graph writes it back into its
`state` leaf with `assign`, so a step reads and writes the state where it lives.
"""
from __future__ import annotations

from .composites import composite, ex, iota
from .errors import DTypeError, ShapeError
from .ops import ACT, COUNT, FLOAT, Level, _float, _same_dim, op
from .recurrence import gated_delta_rule as delta_scan
from .shape import Shape


def _like(t: Shape, ref: Shape, dims: tuple, what: str) -> None:
    if t.dtype is not ref.dtype:
        raise DTypeError(f"{what} is {t.dtype.value}, expected {ref.dtype.value} (like the first input)")
    if t.rank != len(dims):
        raise ShapeError(f"{what} must have dims {tuple(dims)}, got {t}")
    for a, b in zip(t.dims, dims):
        _same_dim(a, b, f"{what} dims {t.dims} vs expected {tuple(dims)}")


@op("gated_delta_rule", ["q", "k", "v", "g", "beta", "state"], Level.FUSED, n_outputs=2,
    attrs={"scale": FLOAT, "chunk": COUNT(64)})
def _m_gated_delta_rule(s, a):
    """Gated DeltaNet over T steps (rlx_core.ir.recurrence.gated_delta_rule's math): q, k
    [B, T, Hk, K]; v [B, T, H, V] with H a multiple of Hk (value head h reads key head
    h // (H / Hk), transformers' repeat_interleave); g (log-decay, <= 0) and beta [B, T, H];
    state [B, H, K, V] before step 0. -> (o [B, T, H, V], the state after step T-1).
    `chunk`: the chunk length of the chunked form (a kernel's tuning; results agree within
    rounding for any chunk)."""
    q, k, v, g, beta, st = s
    _float(q, "gated_delta_rule")
    if q.rank != 4 or v.rank != 4:
        raise ShapeError(f"gated_delta_rule q must be [batch, T, key heads, K] and v [batch, T, heads, V], "
                         f"got q {q}, v {v}")
    b, t, hk, kd = q.dims
    h, vd = v.dims[2], v.dims[3]
    _like(k, q, q.dims, "gated_delta_rule k")
    _like(v, q, (b, t, h, vd), "gated_delta_rule v")
    _like(g, q, (b, t, h), "gated_delta_rule g")
    _like(beta, q, (b, t, h), "gated_delta_rule beta")
    _like(st, q, (b, h, kd, vd), "gated_delta_rule state")
    if isinstance(h, int) and isinstance(hk, int) and (hk == 0 or h % hk):
        raise ShapeError(f"gated_delta_rule: {h} value heads is not a multiple of {hk} key heads")
    if a["chunk"] < 1:
        raise ShapeError(f"gated_delta_rule chunk={a['chunk']}: expected >= 1")
    return (Shape((b, t, h, vd), q.dtype), st)


@op("causal_conv1d", ["x", "w", "state", "bias?"], Level.FUSED, n_outputs=2,
    attrs={"act": ACT("identity")})
def _m_causal_conv1d(s, a):
    """Depthwise causal convolution over time, channels last: x [B, T, C]; w [C, W] (channel
    c's taps, oldest first: HF's Conv1d weight [C, 1, W] squeezed); state [B, C, W - 1], the
    W - 1 inputs before x (zeros at the start of a sequence); bias [C].
    y[b, t, c] = act(bias[c] + sum_i w[c, i] * u[b, t + i, c]) with u = state's steps then x.
    -> (y [B, T, C], the new state [B, C, W - 1]: the last W - 1 steps of u)."""
    x, w, st = s[:3]
    _float(x, "causal_conv1d")
    if x.rank != 3 or w.rank != 2:
        raise ShapeError(f"causal_conv1d x must be [batch, T, channels] and w [channels, width], "
                         f"got x {x}, w {w}")
    b, _, c = x.dims
    width = w.dims[1]
    if isinstance(width, str) or width < 1:
        raise ShapeError(f"causal_conv1d needs a static width >= 1, got w {w}")
    _like(w, x, (c, width), "causal_conv1d w")
    _like(st, x, (b, c, width - 1), "causal_conv1d state")
    if len(s) > 3:
        _like(s[3], x, (c,), "causal_conv1d bias")
    return (Shape(x.dims, x.dtype), st)


# ----------------------------------------------------------------- composites
def repeat_heads(m, x, times: int):
    """[B, T, Hk, K] -> [B, T, Hk * times, K], each head repeated `times` times in place
    (torch's repeat_interleave on dim 2)."""
    if times == 1:
        return x
    b, t, hk, kd = x.dims
    return m.reshape(m.expand(m.reshape(x, (b, t, hk, 1, kd)), (b, t, hk, times, kd)),
                     (b, t, hk * times, kd))


@composite("gated_delta_rule", ex("f32[1,3,2,4]", "f32[1,3,2,4]", "f32[1,3,4,5]", "f32[1,3,4]",
                                  "f32[1,3,4]", "f32[1,4,4,5]", scale=0.5))
def _gated_delta_rule(m, ins, a):
    q, k, v, g, beta, state = ins
    times = v.dims[2] // q.dims[2]
    q, k = (repeat_heads(m, t, times) for t in (q, k))
    return delta_scan(m, q, k, v, g, beta, a["scale"], state)


@composite("causal_conv1d", ex("f32[1,seq,3]", "f32[3,4]", "f32[1,3,3]"),
           ex("f32[2,5,3]", "f32[3,4]", "f32[2,3,3]", "f32[3]", act="silu"))
def _causal_conv1d(m, ins, a):
    x, w, state = ins[:3]
    b, t, c = x.dims
    width = w.dims[1]
    u = m.concat([m.transpose(state, (0, 2, 1)), x], 1)          # [B, W - 1 + T, C]
    steps = iota(m, t, x)
    y = None
    for i in range(width):
        tap = m.gather(u, steps + i, 1) * m.reshape(m.narrow(w, 1, i, 1), (c,))
        y = tap if y is None else y + tap
    if len(ins) > 3:
        y = y + ins[3]
    new_state = m.transpose(m.narrow(u, 1, -(width - 1), width - 1), (0, 2, 1)) if width > 1 else state
    return m.act(y, a["act"]), new_state


__all__ = ["repeat_heads"]
