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
* `delta_rule`          `gated_delta_rule` with its state leaf.

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

from ..ir.errors import ModelError
from .blocks import continues_cache

DECODE, PREFILL, STATELESS = "decode", "prefill", "stateless"


def gated_rms_norm(m, x, w, z, eps: float):
    """w * rms_norm(x) * silu(z): the gated RMSNorm of Gated DeltaNet's output (norm first)."""
    return m.rms_norm(x, w, eps=eps) * m.act(z, "silu")


def output_gate(m, o, gate):
    """o * sigmoid(gate): the elementwise output gate of gated attention."""
    return o * m.act(gate, "sigmoid")


def l2norm(m, x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2, last axis) + eps) (flash-linear-attention's and HF's l2norm)."""
    last = x.shape.rank - 1
    return x * m.act(m.sum(x * x, (last,), keepdims=True) + eps, "rsqrt")


def softplus(m, x):
    """log(1 + exp(x)) as max(x, 0) + log(1 + exp(-|x|)): no overflow for large x."""
    return m.maximum(x, 0.0) + m.act(m.act(-m.act(x, "abs"), "exp") + 1.0, "log")


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


__all__ = ["gated_rms_norm", "output_gate", "l2norm", "softplus", "zero_pads", "state_mode",
           "RecurrentState", "short_conv", "delta_rule", "DECODE", "PREFILL", "STATELESS"]
