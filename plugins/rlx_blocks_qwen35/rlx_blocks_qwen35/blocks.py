"""Qwen3.5 / Qwen3-Next blocks: stages with `emit(ctx, value) -> value` (HF tensor names).

* `GatedAttention`  full attention: q_proj gives each head's query and output gate side by
                    side ([heads, 2 * head_dim]), QK-norm with (1 + w), partial RoPE, the KV
                    cache of the core, output * sigmoid(gate), o_proj.
* `GdnScan`         a Gated DeltaNet layer (`linear_attn`): the projections of its version
                    (Qwen3.5's in_proj_qkv / _z / _b / _a, or Qwen3-Next's interleaved
                    in_proj_qkvz / in_proj_ba), then the core's `delta_net` (the short conv
                    (silu) with its state, l2norm of q and k, beta = sigmoid(b), g = -exp(A_log)
                    * softplus(a + dt_bias), the gated delta rule with its state, the gated
                    RMSNorm with z: one `gated_delta_net` op a decode step), out_proj.
* `sparse_moe`      the core MoeFfn: routed experts (softmax, top k, renormalized) plus the
                    shared expert behind a sigmoid gate.
* `Qwen35DecoderLayer`  x + mixer(norm(x)), then h + mlp(norm(h)); norms are (1 + w).

The conv and recurrent states live in the leaves `state.<i>.conv` [batch, channels, W - 1]
and `state.<i>.recurrent` [batch, value heads, K, V] (rlx_core.flow.hybrid).
"""
from __future__ import annotations

import attrs
import numpy as np

from rlx_core.flow import AttnSpec
from rlx_core.flow.blocks import (GatedMlp, ResidualAdd, ResidualSave, RmsNorm, SelfAttention, SwigluMlp,
                                  rope_for)
from rlx_core.flow.hybrid import DeltaNetParams, RecurrentState, delta_net, output_gate, state_mode, zero_pads
from rlx_core.flow.moe import MoeFfn, SharedExpert
from rlx_core.flow.rope import inv_freq
from rlx_core.ir.dtype import F32
from rlx_core.ir.errors import ModelError
from rlx_core.ir.ops import MaskKind

from .config import Qwen35Arch

# the routed experts' [E, I, H] / [E, H, I] stacks (recipes.text_tensors builds them)
STACKS = ("experts.gate_proj.weight", "experts.up_proj.weight", "experts.down_proj.weight")
ONE = 1.0            # Qwen3.5 / Qwen3-Next RMSNorms hold w of (1 + w) (Qwen3NextRMSNorm)


@attrs.frozen
class GatedAttention(SelfAttention):
    """Qwen3-Next / Qwen3.5 full attention (see the module docstring); `spec` carries
    QK-norm (offset 1), rotary_dim and the mode."""

    def rope_tables(self, ctx) -> tuple:
        """(cos, sin) [batch, seq, rot/2] computed in the graph from the positions (f32
        position x f32 inv_freq, HF's arithmetic) rather than gathered from tables of every
        position: Qwen3.5's 262k-position context would make those tens of MB per graph."""
        s, m = self.spec, ctx.m
        if ctx.state.get("rope_tables") is not None:          # (ModelFlow.rope_tables given)
            return rope_for(ctx, s)
        rot = s.rotary_dim or s.head_dim
        key = ("qwen35_rope", s.rope_theta, repr(s.rope_scaling), rot)
        if key not in ctx.state:
            pos = ctx.inputs.get("positions")
            if pos is None:
                raise ModelError("Qwen3.5 attention needs a 'positions' input ([batch, seq] int)")
            inv, att = inv_freq(rot, s.rope_theta, s.rope_scaling)
            freqs = m.cast(m.reshape(pos, pos.dims + (1,)), F32) * m.constant(inv.astype(np.float32))
            cos, sin = m.act(freqs, "cos"), m.act(freqs, "sin")
            if att != 1.0:
                cos, sin = cos * float(np.float32(att)), sin * float(np.float32(att))
            ctx.state[key] = (cos, sin)
        return ctx.state[key]

    def emit(self, ctx, x):
        s, m = self.spec, ctx.m
        b, t = x.dims[0], x.dims[1]
        w = ctx.param(ctx.key(f"{s.prefix}.q_proj.weight"), (s.heads * s.head_dim * 2, s.hidden))
        qg = m.reshape(m.linear(x, w), (b, t, s.heads, 2 * s.head_dim))
        q, gate = m.narrow(qg, 3, 0, s.head_dim), m.narrow(qg, 3, s.head_dim, s.head_dim)
        nq = ctx.param(ctx.key(f"{s.prefix}.q_norm.weight"), (s.head_dim,))
        q = m.transpose(m.rms_norm(q, nq, eps=s.qk_norm_eps, offset=ONE), (0, 2, 1, 3))
        k, v = self._proj(ctx, x, "k", s.kv_heads), self._proj(ctx, x, "v", s.kv_heads)
        cos, sin = self.rope_tables(ctx)
        q, k = m.rope(q, cos, sin, s.rope_style), m.rope(k, cos, sin, s.rope_style)
        cache_pos = ctx.inputs.get("cache_pos")
        if s.mode == "decode" or (s.kv_cache and cache_pos is not None):
            k, v = self.cached_kv(ctx, x, k, v, cache_pos)
        o = m.attention(q, k, v, ctx.inputs.get("key_mask"), cache_pos if self.reads_cache(ctx) else None,
                        scale=s.head_dim ** -0.5, mask_kind=MaskKind.CAUSAL)
        o = m.transpose(o, (0, 2, 1, 3))                                      # [B, T, H, D]
        o = m.reshape(output_gate(m, o, gate), (b, t, s.heads * s.head_dim))
        wo = ctx.param(ctx.key(f"{s.prefix}.o_proj.weight"), (s.hidden, s.heads * s.head_dim))
        return m.linear(o, wo)


@attrs.frozen
class GdnScan:
    """One Gated DeltaNet layer under `prefix` (HF's `linear_attn`); `fused_inputs`: the
    Qwen3-Next projections (in_proj_qkvz / in_proj_ba, grouped by key head) instead of
    Qwen3.5's separate in_proj_qkv / _z / _b / _a."""
    arch: Qwen35Arch
    decode: bool = False
    fused_inputs: bool = False
    prefix: str = "linear_attn"
    chunk: int = 64

    def _w(self, ctx, name: str, shape: tuple):
        return ctx.param(ctx.key(f"{self.prefix}.{name}"), shape)

    def project(self, ctx, x) -> tuple:
        """(mixed q|k|v [B, T, C], z [B, T, H, V], b [B, T, H], a [B, T, H]) from the
        projections the checkpoint holds: Qwen3.5's in_proj_qkv / _z / _b / _a, Qwen3-Next's
        in_proj_qkvz / in_proj_ba (grouped by key head), or a Qwen3-Next GGUF's in_proj_qkv /
        in_proj_z (llama.cpp splits qkvz) with in_proj_ba."""
        a_, m = self.arch, ctx.m
        b, t, hid = x.dims[0], x.dims[1], a_.hidden
        kd, vd, r = a_.k_heads * a_.k_dim, a_.v_heads * a_.v_dim, a_.v_heads // a_.k_heads

        def part(y, start, length, dims):          # a slice of each key head's group
            return m.reshape(m.narrow(y, 3, start, length), dims)

        qkvz = ctx.key(f"{self.prefix}.in_proj_qkvz.weight")
        if ctx.has(qkvz) or (self.fused_inputs and not ctx.has(ctx.key(f"{self.prefix}.in_proj_qkv.weight"))):
            # per key head [q (K), k (K), v (r V), z (r V)]
            per = 2 * a_.k_dim + 2 * r * a_.v_dim
            y = m.reshape(m.linear(x, ctx.param(qkvz, (a_.k_heads * per, hid))), (b, t, a_.k_heads, per))
            mixed = m.concat([part(y, 0, a_.k_dim, (b, t, kd)), part(y, a_.k_dim, a_.k_dim, (b, t, kd)),
                              part(y, 2 * a_.k_dim, r * a_.v_dim, (b, t, vd))], 2)
            z = part(y, 2 * a_.k_dim + r * a_.v_dim, r * a_.v_dim, (b, t, a_.v_heads, a_.v_dim))
        else:
            mixed = m.linear(x, self._w(ctx, "in_proj_qkv.weight", (2 * kd + vd, hid)))
            z = m.linear(x, self._w(ctx, "in_proj_z.weight", (vd, hid)))
            z = m.reshape(z, (b, t, a_.v_heads, a_.v_dim))
        ba = ctx.key(f"{self.prefix}.in_proj_ba.weight")
        if ctx.has(ba) or (self.fused_inputs and not ctx.has(ctx.key(f"{self.prefix}.in_proj_b.weight"))):
            # per key head [b (r), a (r)]
            y = m.reshape(m.linear(x, ctx.param(ba, (2 * a_.v_heads, hid))), (b, t, a_.k_heads, 2 * r))
            return mixed, z, part(y, 0, r, (b, t, a_.v_heads)), part(y, r, r, (b, t, a_.v_heads))
        return (mixed, z, m.linear(x, self._w(ctx, "in_proj_b.weight", (a_.v_heads, hid))),
                m.linear(x, self._w(ctx, "in_proj_a.weight", (a_.v_heads, hid))))

    def heads_for_out_proj(self, m, o):
        """o [B, T, H, V] in the column order of out_proj: HF's (value heads grouped by key
        head) unless the config says the checkpoint holds llama.cpp's tiled order."""
        a_ = self.arch
        if not a_.out_proj_tiled or a_.k_heads == a_.v_heads:
            return o
        b, t = o.dims[0], o.dims[1]
        r = a_.v_heads // a_.k_heads
        grouped = m.reshape(o, (b, t, a_.k_heads, r, a_.v_dim))
        return m.reshape(m.transpose(grouped, (0, 1, 3, 2, 4)), (b, t, a_.v_heads, a_.v_dim))

    def emit(self, ctx, x):
        a_, m, i = self.arch, ctx.m, ctx.index()
        b, t = x.dims[0], x.dims[1]
        mode = state_mode(ctx, self.decode)
        x = zero_pads(ctx, x, mode)          # pads leave the states zero (HF's apply_mask_to_padding_states)
        mixed, z, beta_in, alpha_in = self.project(ctx, x)
        c, width = a_.conv_channels, a_.conv_width
        p = DeltaNetParams(conv_w=m.reshape(self._w(ctx, "conv1d.weight", (c, 1, width)), (c, width)),
                           a_log=self._w(ctx, "A_log", (a_.v_heads,)), dt_bias=self._w(ctx, "dt_bias", (a_.v_heads,)),
                           norm_w=self._w(ctx, "norm.weight", (a_.v_dim,)), eps=a_.eps)
        o = delta_net(ctx, mixed, z, beta_in, alpha_in, p, RecurrentState(f"state.{i}.conv", (c, width - 1), mode),
                      RecurrentState(f"state.{i}.recurrent", (a_.v_heads, a_.k_dim, a_.v_dim), mode),
                      scale=a_.k_dim ** -0.5, chunk=self.chunk)
        o = self.heads_for_out_proj(m, o)
        return m.linear(m.reshape(o, (b, t, a_.v_heads * a_.v_dim)),
                        self._w(ctx, "out_proj.weight", (a_.hidden, a_.v_heads * a_.v_dim)))


def sparse_moe(arch: Qwen35Arch) -> MoeFfn:
    """Routed experts (softmax, top k, renormalized when norm_topk_prob) over the stacks
    `mlp.experts.gate_proj.weight` / `up_proj.weight` [E, I, H] and `down_proj.weight`
    [E, H, I] (recipes.text_tensors builds them from HF's per-expert or gate_up tensors),
    router `mlp.gate.weight`, plus
    `mlp.shared_expert` scaled by sigmoid(`mlp.shared_expert_gate`)."""
    return MoeFfn(experts=arch.experts, k=arch.top_k, inter=arch.moe_intermediate, prefix="mlp",
                  order="softmax_topk", normalize=arch.norm_topk, act=arch.act, stacks=STACKS,
                  shared=SharedExpert(arch.shared_intermediate, "shared_expert", "shared_expert_gate.weight"))


def dense_mlp(arch: Qwen35Arch):
    """The gated MLP of `intermediate_size` (HF gate_proj / up_proj / down_proj): the core's."""
    return SwigluMlp("mlp") if arch.act == "silu" else GatedMlp("mlp", arch.act)


@attrs.frozen
class Qwen35DecoderLayer:
    """Pre-norm residual layer: the token mixer (GdnScan or GatedAttention), then the MLP."""
    mixer: object
    mlp: object
    eps: float = 1e-6

    def stages(self) -> tuple:
        return (ResidualSave(), RmsNorm("input_layernorm.weight", self.eps, ONE), self.mixer, ResidualAdd(),
                ResidualSave(), RmsNorm("post_attention_layernorm.weight", self.eps, ONE), self.mlp,
                ResidualAdd())

    def emit(self, ctx, x):
        for st in self.stages():
            x = ctx.emit(st, x)           # (recorded: `rlx inspect` lists the sub-stages)
        return x


def attn_spec(arch: Qwen35Arch, mode: str = "prefill") -> AttnSpec:
    """The full-attention layers' spec (every full layer has the same)."""
    return AttnSpec(heads=arch.heads, kv_heads=arch.kv_heads, head_dim=arch.head_dim, hidden=arch.hidden,
                    rope_theta=arch.rope_theta, rope_scaling=arch.rope_scaling,
                    max_positions=arch.max_positions, rotary_dim=arch.rotary_dim, qk_norm_eps=arch.eps,
                    qk_norm_offset=ONE, mode="decode" if mode == "decode" else "prefill")


QWEN35_BLOCKS = {
    "qwen35.gated_attention": lambda **kw: GatedAttention(AttnSpec(**kw)),
    "qwen35.gdn_scan": GdnScan,
    "qwen35.sparse_moe": sparse_moe,
    "qwen35.decoder_layer": Qwen35DecoderLayer,
}

__all__ = ["GatedAttention", "GdnScan", "sparse_moe", "dense_mlp", "Qwen35DecoderLayer", "attn_spec",
           "QWEN35_BLOCKS"]
