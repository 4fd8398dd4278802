"""Gemma blocks: stages with `emit(ctx, value) -> value`, composed by the recipes and
registered through `rlx_register_blocks` (names prefixed `gemma.`).

* `GemmaRmsNorm`   x * rsqrt(mean(x^2) + eps) * (1 + w), in float32 like HF's Gemma3RMSNorm
                   (the core `rms_norm` op with `offset=1`; its kernel computes in f32 and
                   rounds once, which is HF's Gemma order, not LLaMA's).
* `GeGLU`          down(act(gate(x)) * up(x)), act = tanh-GELU (`gelu_pytorch_tanh`).
* `GemmaAttention` GQA attention with QK-norm (Gemma 3), `query_pre_attn_scalar` scaling,
                   logit softcapping (Gemma 2), its layer type's RoPE, a causal or
                   sliding-window mask, and a KV cache: a full cache of `ctx` slots on
                   global layers, a ring buffer of `window` slots on sliding layers.
* `GemmaDecoderLayer`  pre/post attention norms, pre/post feed-forward norms, residuals.

Ring buffer (sliding layers, prefill/decode graphs). Cache column c (the index into the
key mask, 0 = first prompt column) lives in slot c % W of the state `kv.<i>.k|v`
[batch, kv_heads, R, head_dim], R = min(W, max_positions); a bool state
`kv.ring<R>.valid` [batch, 1, 1, R] says which slots hold a real (unpadded) token.
Prefill computes which column ends in each slot (the last W columns of the prompt),
gathers their K/V and writes the whole ring — so a shorter prompt also clears what an
earlier sequence left there. Decode writes the new
token at slot `cache_pos % W` and attends over the ring with that validity mask: every
slot holds one of the last W columns, which is exactly the sliding window. Prefill
starts a sequence at cache column 0 (as `CausalLM.generate` does).
"""
from __future__ import annotations

import attrs
import numpy as np

from rlx_core.flow import AttnSpec
from rlx_core.flow.blocks import ResidualAdd, ResidualSave, SelfAttention, gated_mlp_weights, rope_for
from rlx_core.flow.rope import inv_freq
from rlx_core.ir.dtype import BOOL, F32, I64
from rlx_core.ir.errors import ModelError
from rlx_core.ir.ops import MaskKind


@attrs.frozen
class GemmaRmsNorm:
    """Gemma's RMSNorm: weight stored as w, applied as (1 + w). `key` is relative to the
    layer prefix unless `absolute`."""
    key: str
    eps: float = 1e-6
    absolute: bool = False

    def emit(self, ctx, x):
        key = self.key if self.absolute else ctx.key(self.key)
        w = ctx.param(key, (x.dims[-1],))
        return ctx.m.rms_norm(x, w, eps=self.eps, offset=1.0)


@attrs.frozen
class GeGLU:
    """down_proj(act(gate_proj(x)) * up_proj(x)) with HF-layout weights under `prefix`."""
    prefix: str = "mlp"
    act: str = "gelu_tanh"

    def emit(self, ctx, x):
        m = ctx.m
        wg, wu, wd = gated_mlp_weights(ctx, self.prefix, x.dims[-1])
        h = m.act(m.linear(x, wg), self.act) * m.linear(x, wu)
        return m.linear(h, wd)


def gemma_rope(ctx, spec: AttnSpec):
    """(cos, sin) [batch, seq, rot/2] for this layer's RoPE at the flow's `positions`.

    Computed in the graph from the positions (f32 position x f32 inv_freq, then cos/sin in
    f32: HF's arithmetic, and the same numbers as the core's precomputed tables) instead
    of gathering from [max_positions, rot/2] tables: Gemma 3's 32k-131k contexts would
    make those tables tens of MB per layer type and graph. A table set with
    `ModelFlow.rope_tables` is still honoured."""
    if ctx.state.get("rope_tables") is not None:
        return rope_for(ctx, spec)
    rot = spec.rotary_dim or spec.head_dim
    key = ("gemma_rope", spec.rope_theta, repr(spec.rope_scaling), rot)
    if key not in ctx.state:
        m = ctx.m
        pos = ctx.inputs.get("positions")
        if pos is None:
            raise ModelError("Gemma attention needs a 'positions' input ([batch, seq] int)")
        inv, att = inv_freq(rot, spec.rope_theta, spec.rope_scaling)
        p = m.reshape(m.cast(pos, F32), pos.dims + (1,))
        freqs = p * m.constant(inv.astype(np.float32))
        cos, sin = m.act(freqs, "cos"), m.act(freqs, "sin")
        if att != 1.0:
            cos, sin = cos * float(np.float32(att)), sin * float(np.float32(att))
        ctx.state[key] = (cos, sin)
    return ctx.state[key]


def _ring_prefill_index(ctx, window: int, slots: int):
    """For a prefill of S columns: (cidx [slots] i64, keep [slots] bool) — the column that
    ends in each ring slot (clamped to >= 0) and whether there is one. Once per graph."""
    key = ("gemma_ring_prefill", window, slots)
    if key not in ctx.state:
        m = ctx.m
        ids = ctx.inputs["ids"]
        ones = m.cast(m.compare(ids, ids, "eq"), I64)                       # [B, S]
        s = m.reshape(m.narrow(m.narrow(m.cumsum(ones, 1), 1, -1, 1), 0, 0, 1), (1,))   # [1] = S
        last = s - 1
        j = m.constant(np.arange(slots, dtype=np.int64))
        d = last - j
        col = last - (d - (d / window) * window)                             # last - ((last-j) mod W)
        ctx.state[key] = (m.maximum(col, 0), m.compare(col, 0, "ge"))
    return ctx.state[key]


def _ring_valid_state(ctx, slots: int):
    return ctx.m.state(f"kv.ring{slots}.valid", (ctx.inputs["ids"].dims[0], 1, 1, slots), BOOL)


@attrs.frozen
class GemmaAttention(SelfAttention):
    """Self-attention of one Gemma layer. `spec` is the core's AttnSpec (qk_norm_eps and
    qk_norm_offset=1 for Gemma 3, scale, softcap, window, rope_theta/rope_scaling, mode,
    kv_cache, kv_taps); `ring` keeps a sliding layer's cache in `window` slots instead of
    a full-length cache masked by the window. Projections come from the core block."""
    ring: bool = True

    def rope_tables(self, ctx) -> tuple:
        return gemma_rope(ctx, self.spec)

    def emit(self, ctx, x):
        s, m = self.spec, ctx.m
        q, k, v = self.roped_qkv(ctx, x)
        scale = s.scale if s.scale is not None else s.head_dim ** -0.5
        kind = MaskKind.SLIDING_WINDOW if s.window else MaskKind.CAUSAL
        mask = ctx.inputs.get("key_mask")
        cache_pos = ctx.inputs.get("cache_pos")
        common = dict(scale=scale, softcap=s.softcap)
        cached = s.mode == "decode" or (s.kv_cache and cache_pos is not None)
        if cached and s.window and self.ring:
            if cache_pos is None:
                raise ModelError("decode attention needs a 'cache_pos' input ([batch] int)")
            if s.mode != "decode" and self.reads_cache(ctx):
                raise ModelError(f"layer {ctx.index()}: a sliding layer's ring cache ({s.window} slots) "
                                 "cannot be extended mid-sequence (a prefill writes it from slot 0); "
                                 "ring=False keeps a full-length cache that can")
            return self.out_proj(ctx, x, self._ring(ctx, q, k, v, mask, cache_pos, common))
        if cached:
            k, v = self.cached_kv(ctx, x, k, v, cache_pos)
        pos = cache_pos if self.reads_cache(ctx) else None
        o = m.attention(q, k, v, mask, pos, mask_kind=kind, window=s.window, **common)
        return self.out_proj(ctx, x, o)

    def _ring(self, ctx, q, k, v, mask, cache_pos, common):
        s, m, i, w = self.spec, ctx.m, ctx.index(), self.spec.window
        # R = min(W, max_positions) slots: when the context cannot pass W nothing ever wraps,
        # and c % W = c < R, so the slot arithmetic below stays mod W either way
        r = min(w, s.max_positions)
        shape = (k.dims[0], s.kv_heads, r, s.head_dim)
        kstate = m.state(f"kv.{i}.k", shape, k.dtype)
        vstate = m.state(f"kv.{i}.v", shape, v.dtype)
        vkey = ("gemma_ring_valid", w, r)
        if s.mode == "decode":
            slot = cache_pos - (cache_pos / w) * w                              # cache_pos % W
            kr, vr = m.kv_write(kstate, k, slot), m.kv_write(vstate, v, slot)
            if vkey not in ctx.state:
                new = m.reshape(m.compare(cache_pos, cache_pos, "eq"), (cache_pos.dims[0], 1, 1, 1))
                ctx.state[vkey] = m.kv_write(_ring_valid_state(ctx, r), new, slot, axis=3)
            return m.attention(q, kr, vr, ctx.state[vkey], None, mask_kind=MaskKind.CUSTOM, **common)
        # prefill: attend within the prompt, then leave its last R columns in the ring
        cidx, keep = _ring_prefill_index(ctx, w, r)
        zero = cache_pos * 0
        m.kv_write(kstate, m.gather(k, cidx, axis=2), zero)
        m.kv_write(vstate, m.gather(v, cidx, axis=2), zero)
        if vkey not in ctx.state:
            valid = (m.where(keep, m.gather(mask, cidx, axis=3), False) if mask is not None
                     else m.reshape(keep, (1, 1, 1, r)))
            ctx.state[vkey] = m.kv_write(_ring_valid_state(ctx, r), valid, zero, axis=3)
        return m.attention(q, k, v, mask, None, mask_kind=MaskKind.SLIDING_WINDOW, window=w, **common)


@attrs.frozen
class GemmaDecoderLayer:
    """x + post_attn_norm(attn(input_norm(x))), then h + post_ffw_norm(mlp(pre_ffw_norm(h)))."""
    spec: AttnSpec
    eps: float = 1e-6
    act: str = "gelu_tanh"
    ring: bool = True

    def stages(self) -> tuple:
        return (ResidualSave(), GemmaRmsNorm("input_layernorm.weight", self.eps),
                GemmaAttention(self.spec, self.ring),
                GemmaRmsNorm("post_attention_layernorm.weight", self.eps), ResidualAdd(),
                ResidualSave(), GemmaRmsNorm("pre_feedforward_layernorm.weight", self.eps),
                GeGLU("mlp", self.act),
                GemmaRmsNorm("post_feedforward_layernorm.weight", self.eps), ResidualAdd())

    def emit(self, ctx, x):
        for st in self.stages():
            x = ctx.emit(st, x)           # (recorded: `rlx inspect` lists the sub-stages)
        return x


GEMMA_BLOCKS = {
    "gemma.rms_norm": GemmaRmsNorm,
    "gemma.geglu": GeGLU,
    "gemma.attention": lambda ring=True, **kw: GemmaAttention(AttnSpec(**kw), ring),
    "gemma.decoder_layer": lambda spec, eps=1e-6, act="gelu_tanh", ring=True:
        GemmaDecoderLayer(spec, eps, act, ring),
}

__all__ = ["GemmaRmsNorm", "GeGLU", "GemmaAttention", "GemmaDecoderLayer", "gemma_rope", "GEMMA_BLOCKS"]
