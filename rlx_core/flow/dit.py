"""Generic diffusion-transformer (DiT) blocks and helpers: sinusoidal timestep embeddings
and their MLPs, adaLN modulation (shift / scale / gate vectors from a conditioning vector),
multi-axis RoPE tables from position ids, and attention over several token groups joined
along the sequence (MM-DiT joint attention). A DiT family's plugin composes them. Computed
the way diffusers computes them, so outputs match it."""
from __future__ import annotations

import math

import attrs
import numpy as np

from ..ir.errors import ModelError
from ..ir.ops import MaskKind


def flow_input(ctx, name: str, stage):
    """The flow input `name`, or an error naming the stage and the inputs there are."""
    if name not in ctx.inputs:
        raise ModelError(f"{type(stage).__name__}: the flow has no input {name!r}; inputs: {sorted(ctx.inputs)}")
    return ctx.inputs[name]


def linear(ctx, x, key: str, bias: bool, out: int | None = None):
    """x @ W^T (+ b) for the HF-layout weight `<key>.weight` (relative to the layer prefix)."""
    k = ctx.key(key)
    w = ctx.param(f"{k}.weight", (out, x.dims[-1]) if out else None)
    b = ctx.param(f"{k}.bias", (w.dims[0],)) if bias else None
    return ctx.m.linear(x, w, b)


def mlp2(ctx, x, prefix: str, bias: bool, hidden: int | None = None):
    """linear_2(silu(linear_1(x))): diffusers' TimestepEmbedding and its text projection."""
    h = ctx.m.silu(linear(ctx, x, f"{prefix}.linear_1", bias, hidden))
    return linear(ctx, h, f"{prefix}.linear_2", bias, hidden)


def sinusoid_freqs(channels: int, shift: float = 0.0, max_period: float = 10000.0) -> np.ndarray:
    """exp(-log(max_period) * i / (half - shift)) in f32, as diffusers' get_timestep_embedding."""
    half = channels // 2
    e = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half - shift)
    return np.exp(e.astype(np.float64)).astype(np.float32)


def sinusoidal(m, t, channels: int, flip: bool = True, shift: float = 0.0, max_period: float = 10000.0):
    """[B] -> [B, channels]: sin | cos of t * freqs (cos | sin when `flip`)."""
    if channels % 2:
        raise ModelError(f"sinusoidal embedding: {channels} channels is odd")
    freqs = m.constant(sinusoid_freqs(channels, shift, max_period)[None, :])
    arg = m.reshape(t, (t.dims[0], 1)) * freqs
    sin, cos = m.act(arg, "sin"), m.act(arg, "cos")
    return m.concat([cos, sin] if flip else [sin, cos], -1)


@attrs.frozen
class TimestepEmbed:
    """A [batch] input (timestep or guidance, in [0, 1]) times `scale`, embedded sinusoidally
    and through the MLP at `prefix` (linear_1, SiLU, linear_2): [batch, hidden]."""
    input: str
    prefix: str
    channels: int = 256
    scale: float = 1000.0
    bias: bool = True
    flip: bool = True
    shift: float = 0.0

    def emit(self, ctx, value):
        t = flow_input(ctx, self.input, self)
        if self.scale != 1.0:
            t = t * self.scale
        return mlp2(ctx, sinusoidal(ctx.m, t, self.channels, self.flip, self.shift), self.prefix, self.bias)


@attrs.frozen
class ConditionMlp:
    """A [batch, features] input through the MLP at `prefix` (pooled text embeddings)."""
    input: str
    prefix: str
    bias: bool = True

    def emit(self, ctx, value):
        return mlp2(ctx, flow_input(ctx, self.input, self), self.prefix, self.bias)


def modulation(ctx, cond, key: str, n: int, bias: bool) -> list:
    """adaLN: linear(silu(cond)) [B, n*D] split into n vectors [B, 1, D] (diffusers' chunk order)."""
    m = ctx.m
    d = cond.dims[-1]
    y = linear(ctx, m.silu(cond), key, bias, n * d)
    return [m.reshape(m.narrow(y, -1, i * d, d), (y.dims[0], 1, d)) for i in range(n)]


def modulate(m, x, shift, scale):
    """x * (1 + scale) + shift."""
    return x * (scale + 1.0) + shift


def plain_layer_norm(m, x, eps: float):
    """LayerNorm without affine weights (elementwise_affine=False)."""
    return m.layer_norm(x, None, None, eps=eps)


@attrs.frozen
class AdaLnModulation:
    """Shared modulation: linear(silu(stream `cond`)) at `key`, split into n vectors kept in
    the flow state under `name` for the blocks that read them."""
    cond: str
    key: str
    n: int
    name: str
    bias: bool = False

    def emit(self, ctx, value):
        ctx.state[self.name] = modulation(ctx, ctx.stream(self.cond, self), self.key, self.n, self.bias)
        return value


@attrs.frozen
class AdaNormOut:
    """diffusers' AdaLayerNormContinuous on the current value: LayerNorm(x) * (1 + scale) +
    shift with (scale, shift) = linear(silu(stream `cond`)) at `key`."""
    cond: str
    key: str
    eps: float = 1e-6
    bias: bool = True

    def emit(self, ctx, x):
        scale, shift = modulation(ctx, ctx.stream(self.cond, self), self.key, 2, self.bias)
        return modulate(ctx.m, plain_layer_norm(ctx.m, x, self.eps), shift, scale)


def rope_inv_freq(dim: int, theta: float) -> np.ndarray:
    """1 / theta^(2i/dim), computed in f64 as diffusers does, stored f32."""
    if dim % 2:
        raise ModelError(f"multi-axis RoPE: axis dim {dim} is odd")
    return (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)


@attrs.frozen
class MultiAxisRope:
    """RoPE tables from position ids with one column per axis (e.g. (t, h, w), or
    four): the id inputs [S_i, axes] are joined along the sequence in the order
    given; axis j rotates axes_dim[j] channels. Sets state `name` = (cos, sin) [S, sum/2]
    for the interleaved rope op."""
    inputs: tuple
    axes_dim: tuple
    theta: float = 10000.0
    name: str = "rope"

    def emit(self, ctx, value):
        m = ctx.m
        ids = []
        for inp in self.inputs:
            v = flow_input(ctx, inp, self)
            if len(v.dims) != 2 or v.dims[1] != len(self.axes_dim):
                raise ModelError(f"input {inp!r}: position ids must be [tokens, {len(self.axes_dim)}] (one "
                                 f"column per RoPE axis {list(self.axes_dim)}), got {list(v.dims)}")
            ids.append(m.cast(v, "f32"))
        pos = ids[0] if len(ids) == 1 else m.concat(ids, 0)
        freqs = [m.narrow(pos, 1, j, 1) * m.constant(rope_inv_freq(d, self.theta)[None, :])
                 for j, d in enumerate(self.axes_dim)]
        f = freqs[0] if len(freqs) == 1 else m.concat(freqs, -1)
        ctx.state[self.name] = (m.act(f, "cos"), m.act(f, "sin"))
        return value


def to_heads(ctx, y, head_dim: int, norm_key: str | None = None, eps: float = 1e-6):
    """[B, S, H*D] -> [B, S, H, D], RMS-normalized over D by `<norm_key>.weight` (QK-norm)."""
    m = ctx.m
    b, s, hd = y.dims
    y = m.reshape(y, (b, s, hd // head_dim, head_dim))
    if norm_key:
        y = m.rms_norm(y, ctx.param(ctx.key(f"{norm_key}.weight"), (head_dim,)), eps=eps)
    return y


def joint_attention(ctx, parts: list, rope: str | None = "rope", scale: float | None = None) -> list:
    """Bidirectional attention over token groups joined along the sequence: parts are
    (q, k, v) [B, S_i, H, D] (to_heads); RoPE (state `rope`, interleaved pairs) on the joined q
    and k. The groups join before the head transpose, so a backend can have each group's
    producer write its rows into the joined value. Returns each group's output [B, S_i, H*D]."""
    m = ctx.m
    cat = (lambda xs: xs[0] if len(xs) == 1 else m.concat(xs, 1))
    q, k, v = (m.transpose(cat([p[i] for p in parts]), (0, 2, 1, 3)) for i in range(3))
    if rope:
        if rope not in ctx.state:
            raise ModelError(f"joint attention: no RoPE tables {rope!r} in the flow state (add MultiAxisRope "
                             "before the blocks)")
        cos, sin = ctx.state[rope]
        if 2 * cos.dims[-1] != q.dims[-1]:
            raise ModelError(f"joint attention: RoPE axes cover {2 * cos.dims[-1]} channels, head_dim is "
                             f"{q.dims[-1]} (axes_dims_rope must sum to attention_head_dim)")
        q, k = m.rope(q, cos, sin, "interleaved"), m.rope(k, cos, sin, "interleaved")
    o = m.attention(q, k, v, scale=scale if scale is not None else q.dims[-1] ** -0.5, mask_kind=MaskKind.NONE)
    b, h, s, d = o.dims
    o = m.reshape(m.transpose(o, (0, 2, 1, 3)), (b, s, h * d))
    if len(parts) == 1:
        return [o]
    out, at = [], 0
    for p in parts:
        n = p[0].dims[1]
        out.append(m.narrow(o, 1, at, n))
        at += n
    return out


DIT_BLOCKS = {"timestep_embed": TimestepEmbed, "condition_mlp": ConditionMlp,
              "adaln_modulation": AdaLnModulation, "ada_norm_out": AdaNormOut,
              "multi_axis_rope": MultiAxisRope}

__all__ = ["TimestepEmbed", "ConditionMlp", "AdaLnModulation", "AdaNormOut", "MultiAxisRope", "DIT_BLOCKS",
           "sinusoidal", "modulation", "modulate", "plain_layer_norm", "to_heads", "joint_attention", "linear",
           "mlp2", "rope_inv_freq", "sinusoid_freqs"]
