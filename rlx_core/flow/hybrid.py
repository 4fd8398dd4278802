"""Generic pieces of hybrid decoders (linear-attention layers beside attention layers):

* `gated_rms_norm`      rms_norm(x) * w * silu(z) (the norm before the gate, in x's dtype);
* `output_gate`         o * sigmoid(gate) (gated attention's output gate);
* `l2norm`              x * rsqrt(sum(x^2) + eps) over the last axis (q and k of a delta rule);
* `softplus`            log(1 + exp(x)), stable for large |x|;
* `zero_pads`           a prefill's pad positions set to zero (the key mask's False columns),
                        so left padding leaves a recurrent state exactly zero;
* `RecurrentState`      one fixed-size state leaf of a layer ([batch, ...], no context axis):
                        what a graph starts from (zeros for a new sequence, the leaf when
                        decoding) and its write-back (`assign`) after the step;
* `short_conv`          `causal_conv1d` over [B, T, C] with its state leaf;
* `delta_rule`          `gated_delta_rule` with its state leaf;
* `delta_net`           a Gated DeltaNet layer between its projections (conv, l2norm, gates,
                        rule, gated RMSNorm) with both state leaves: one `gated_delta_net` op
                        for a one-token step (a decode kernel runs all of it in one launch),
                        else the ops it is made of.

The formulas (l2norm, softplus, the decay gate, the gated RMSNorm) are written once, in
rlx_core.ir.deltanet, where the fused op's composite uses them too.

Partial RoPE (rope on the first `rotary_dim` of head_dim) is AttnSpec.rotary_dim of
rlx_core.flow.blocks: the `rope` op rotates the first R dims and passes the rest.

State leaves: a generation graph (one with a `cache_pos` input) writes the state after its
last step into the leaf; the prefill starts a sequence from zeros (it never reads the leaf:
a leaf holds whatever sequence ran last in that row), decode and extend (a prefill that
continues the cached sequence, T > 1: `blocks.continues_cache`) read the leaf. Graphs without
`cache_pos` (logits, train) start from zeros and write nothing. The runtime's caches copy
such a state whole per row (rlx_core.runtime.batch_cache)."""
from __future__ import annotations

import math

import attrs
import numpy as np

from ..ir.deltanet import decay_gate, gated_rms_norm, l2norm, net_heads, softplus
from ..ir.errors import ModelError
from .blocks import continues_cache

DECODE, PREFILL, STATELESS = "decode", "prefill", "stateless"


def output_gate(m, o, gate):
    """o * sigmoid(gate): the elementwise output gate of gated attention."""
    return o * m.act(gate, "sigmoid")


def state_mode(ctx, decode: bool) -> str:
    """DECODE (read and write the leaves: decode, and extend graphs continuing the cache),
    PREFILL (start from zeros, write the leaves) or STATELESS (zeros, no leaves): by the
    graph's mode and its inputs."""
    if decode or continues_cache(ctx):
        if "cache_pos" not in ctx.inputs:
            raise ModelError("a decode graph of a recurrent layer needs a 'cache_pos' input")
        return DECODE
    return PREFILL if "cache_pos" in ctx.inputs else STATELESS


def zero_pads(ctx, x, mode: str):
    """x [B, T, ...] with the positions the key mask marks as padding set to 0 (prefill and
    logits graphs; a decoded or extending token is never padding). Without a key mask x is
    returned."""
    mask = ctx.inputs.get("key_mask")
    if mode == DECODE or mask is None:
        return x
    m = ctx.m
    b, t = x.dims[0], x.dims[1]
    keep = m.reshape(mask, (b, t) + (1,) * (x.shape.rank - 2))           # [B, 1, 1, T] -> [B, T, 1..]
    return m.where(keep, x, 0.0)


@attrs.frozen
class RecurrentState:
    """A layer's fixed-size state leaf `name` of dims [batch, *dims] (no context axis)."""
    name: str
    dims: tuple
    mode: str

    def leaf(self, ctx, batch, dtype):
        """The graph's `state` leaf (one per name and graph)."""
        key = ("state_leaf", self.name)
        if key not in ctx.state:
            ctx.state[key] = ctx.m.state(self.name, (batch,) + tuple(self.dims), dtype)
        return ctx.state[key]

    def initial(self, ctx, like):
        """The state a graph starts from: the leaf (decode) or zeros [B, *dims] like `like`'s
        batch and dtype."""
        m = ctx.m
        if self.mode == DECODE:
            return self.leaf(ctx, like.dims[0], like.dtype)
        shape = (like.dims[0],) + tuple(self.dims)
        return m.expand(m.constant(np.zeros((1,) * len(shape), like.dtype.np)), shape)

    def write(self, ctx, new) -> None:
        """The state after this graph's last step goes into the leaf (generation graphs)."""
        if self.mode != STATELESS:
            ctx.m.assign(self.leaf(ctx, new.dims[0], new.dtype), new)


def short_conv(ctx, x, w, state: RecurrentState, act: str = "silu", bias=None):
    """causal_conv1d(x [B, T, C], w [C, W]) from `state` ([B, C, W - 1]); the new state is
    written back."""
    init = state.initial(ctx, x)
    ins = (x, w, init) + ((bias,) if bias is not None else ())
    y, new = ctx.m.add("causal_conv1d", ins, act=act)
    state.write(ctx, new)
    return y


def delta_rule(ctx, q, k, v, g, beta, state: RecurrentState, scale: float | None = None,
               chunk: int = 64):
    """gated_delta_rule(q, k [B, T, Hk, K], v [B, T, H, V], g, beta [B, T, H]) from `state`
    ([B, H, K, V]); the new state is written back. scale: 1/sqrt(K) unless given."""
    init = state.initial(ctx, v)
    scale = 1.0 / math.sqrt(q.dims[3]) if scale is None else float(scale)
    o, new = ctx.m.add("gated_delta_rule", (q, k, v, g, beta, init), scale=scale, chunk=chunk)
    state.write(ctx, new)
    return o


@attrs.frozen
class DeltaNetParams:
    """A Gated DeltaNet layer's own tensors: conv_w [C, W], A_log and dt_bias [H], norm_w [V]
    (the gated RMSNorm's, eps)."""
    conv_w: object
    a_log: object
    dt_bias: object
    norm_w: object
    eps: float


def delta_net(ctx, x, z, b, a, p: DeltaNetParams, conv: RecurrentState, state: RecurrentState,
              scale: float | None = None, chunk: int = 64):
    """A Gated DeltaNet layer between its projections: x [B, T, C] the projected q|k|v (C =
    2 Hk K + H V) before the short conv, z [B, T, H, V] the output gate, b and a [B, T, H]
    the logits of beta and of the decay; `conv` and `state` the conv and recurrent state
    leaves. -> rms_norm(o) norm_w silu(z) [B, T, H, V]. One token a step: the one
    `gated_delta_net` op; longer inputs: its ops one by one (the chunked rule's kernels)."""
    m = ctx.m
    h, kd, vd = state.dims
    scale = 1.0 / math.sqrt(kd) if scale is None else float(scale)
    c0, s0 = conv.initial(ctx, x), state.initial(ctx, x)
    if x.dims[1] == 1:
        o, new_conv, new_state = m.add("gated_delta_net", (x, p.conv_w, c0, z, b, a, p.a_log, p.dt_bias, p.norm_w,
                                                           s0), scale=scale, eps=p.eps, chunk=chunk)
        conv.write(ctx, new_conv)
        state.write(ctx, new_state)
        return o
    hk = net_heads(x.shape, s0.shape)[0]
    bt, t = x.dims[0], x.dims[1]
    y, new_conv = m.add("causal_conv1d", (x, p.conv_w, c0), act="silu")
    conv.write(ctx, new_conv)
    q, k = (l2norm(m, m.reshape(m.narrow(y, 2, i * hk * kd, hk * kd), (bt, t, hk, kd))) for i in (0, 1))
    v = m.reshape(m.narrow(y, 2, 2 * hk * kd, h * vd), (bt, t, h, vd))
    # dt_bias as [1, 1, H]: a vector would fuse into a's matmul as its bias, and a matmul with a
    # bias stays out of the one GEMM over x's shared projections
    g = decay_gate(m, a, p.a_log, m.reshape(p.dt_bias, (1, 1, h)))
    o, new_state = m.add("gated_delta_rule", (q, k, v, g, m.act(b, "sigmoid"), s0), scale=scale, chunk=chunk)
    state.write(ctx, new_state)
    return gated_rms_norm(m, o, p.norm_w, z, p.eps)


__all__ = ["gated_rms_norm", "output_gate", "l2norm", "softplus", "decay_gate", "zero_pads", "state_mode",
           "RecurrentState", "short_conv", "delta_rule", "DeltaNetParams", "delta_net", "DECODE", "PREFILL",
           "STATELESS"]
