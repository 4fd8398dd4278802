"""The FLUX transformer blocks, composed from the core's DiT pieces (rlx_core.flow.dit) and
reading / writing the flow's streams:

* `FluxDoubleBlock`: image and text streams, each with its own adaLN-modulated norms, QKV,
  QK-RMSNorm and MLP, attending jointly over [text; image];
* `FluxSingleBlock`: the joined stream (MAIN), attention and MLP in parallel from one norm.

FLUX.1 blocks compute their own modulation from stream "temb"; FLUX.2 blocks read the shared
modulation vectors the recipe put in the state ("mod.img", "mod.txt", "mod.single").
"""
from __future__ import annotations

import attrs

from rlx_core.flow.dit import joint_attention, linear, modulate, modulation, plain_layer_norm, to_heads
from rlx_core.flow.stream import IMG, MAIN, TXT

from .config import FluxArch

TEMB = "temb"
# diffusers' module names of each stream's attention projections in a double block
IMG_ATTN = dict(q="attn.to_q", k="attn.to_k", v="attn.to_v", q_norm="attn.norm_q", k_norm="attn.norm_k",
                out="attn.to_out.0", mod="norm1.linear", ff="ff", state="mod.img")
TXT_ATTN = dict(q="attn.add_q_proj", k="attn.add_k_proj", v="attn.add_v_proj", q_norm="attn.norm_added_q",
                k_norm="attn.norm_added_k", out="attn.to_add_out", mod="norm1_context.linear", ff="ff_context",
                state="mod.txt")


def feed_forward(ctx, a: FluxArch, x, prefix: str):
    """FLUX.1: net.2(gelu_tanh(net.0.proj(x))); FLUX.2: linear_out(silu(g) * u) with [g; u] =
    linear_in(x)."""
    m = ctx.m
    if a.version == 1:
        h = m.gelu_tanh(linear(ctx, x, f"{prefix}.net.0.proj", True, a.mlp_hidden))
        return linear(ctx, h, f"{prefix}.net.2", True, a.hidden)
    h = linear(ctx, x, f"{prefix}.linear_in", False, 2 * a.mlp_hidden)
    h = m.silu(m.narrow(h, -1, 0, a.mlp_hidden)) * m.narrow(h, -1, a.mlp_hidden, a.mlp_hidden)
    return linear(ctx, h, f"{prefix}.linear_out", False, a.hidden)


def _mods(ctx, a: FluxArch, key: str, state: str, n: int, stage) -> list:
    if a.version == 1:
        return modulation(ctx, ctx.stream(TEMB, stage), key, n, True)
    return ctx.state[state]


@attrs.frozen
class FluxDoubleBlock:
    """One double-stream block (diffusers' FluxTransformerBlock / Flux2TransformerBlock)."""
    arch: FluxArch

    def emit(self, ctx, value):
        a, m = self.arch, ctx.m
        streams = {}
        qkv = []
        for name, keys in ((TXT, TXT_ATTN), (IMG, IMG_ATTN)):
            x = ctx.stream(name, self)
            mods = _mods(ctx, a, keys["mod"], keys["state"], 6, self)
            n = modulate(m, plain_layer_norm(m, x, a.eps), mods[0], mods[1])
            heads = [to_heads(ctx, linear(ctx, n, keys[p], a.bias, a.hidden), a.head_dim,
                              keys.get(f"{p}_norm"), a.eps) for p in "qkv"]
            streams[name] = (x, mods)
            qkv.append(heads)
        outs = joint_attention(ctx, qkv)
        for (name, keys), o in zip(((TXT, TXT_ATTN), (IMG, IMG_ATTN)), outs):
            x, (_, _, gate, shift2, scale2, gate2) = streams[name]
            x = x + gate * linear(ctx, o, keys["out"], a.bias, a.hidden)
            n = modulate(m, plain_layer_norm(m, x, a.eps), shift2, scale2)
            x = x + gate2 * feed_forward(ctx, a, n, keys["ff"])
            ctx.set_stream(name, x, self)
        return value


@attrs.frozen
class FluxSingleBlock:
    """One single-stream block on the joined [text; image] stream MAIN (diffusers'
    FluxSingleTransformerBlock / Flux2SingleTransformerBlock): attention and MLP in parallel,
    their outputs concatenated into one output projection."""
    arch: FluxArch

    def emit(self, ctx, value):
        a, m = self.arch, ctx.m
        x = ctx.stream(MAIN, self)
        shift, scale, gate = _mods(ctx, a, "norm.linear", "mod.single", 3, self)
        n = modulate(m, plain_layer_norm(m, x, a.eps), shift, scale)
        if a.version == 1:
            q, k, v = (linear(ctx, n, f"attn.to_{p}", True, a.hidden) for p in "qkv")
            mlp = m.gelu_tanh(linear(ctx, n, "proj_mlp", True, a.mlp_hidden))
            out_key = "proj_out"
        else:
            y = linear(ctx, n, "attn.to_qkv_mlp_proj", False, 3 * a.hidden + 2 * a.mlp_hidden)
            q, k, v = (m.narrow(y, -1, i * a.hidden, a.hidden) for i in range(3))
            g = m.narrow(y, -1, 3 * a.hidden, a.mlp_hidden)
            u = m.narrow(y, -1, 3 * a.hidden + a.mlp_hidden, a.mlp_hidden)
            mlp = m.silu(g) * u
            out_key = "attn.to_out"
        heads = (to_heads(ctx, q, a.head_dim, "attn.norm_q", a.eps), to_heads(ctx, k, a.head_dim, "attn.norm_k", a.eps),
                 to_heads(ctx, v, a.head_dim))
        (o,) = joint_attention(ctx, [heads])
        h = m.concat([o, mlp], -1)
        ctx.set_stream(MAIN, x + gate * linear(ctx, h, out_key, a.bias, a.hidden), self)
        return value


FLUX_BLOCKS = {"flux_double_block": FluxDoubleBlock, "flux_single_block": FluxSingleBlock}

__all__ = ["FluxDoubleBlock", "FluxSingleBlock", "FLUX_BLOCKS", "feed_forward", "TEMB"]
