"""Generic blocks: small stages with `emit(ctx, value) -> value`. Architecture plugins
compose them (and add their own); all register through rlx_register_blocks."""
from __future__ import annotations

import math

import attrs
import numpy as np

from ..ir.dtype import F32, F64, DType
from ..ir.errors import ModelError
from ..ir.graph import Value
from ..ir.ops import MaskKind
from ..plugins.hookspecs import hookimpl
from .rope import inv_freq, rope_tables

PIECE_PREFIX = "piece."          # a mixed graph's names of the prefilling request's states (recipe.py)
PIECE_CTX = "piece_ctx"          # and their context dim


def mixed_split(ctx) -> tuple | None:
    """(decode rows D, piece tokens P) of a mixed graph (its packed token axis is D + P
    long; recipe.DecoderFlow), or None for any other graph."""
    last, pos = ctx.inputs.get("last_token"), ctx.inputs.get("piece_pos")
    if last is None or pos is None:
        return None
    return ctx.inputs["cache_pos"].dims[0], last.dims[-1]


@attrs.frozen
class Input:
    name: str
    shape: tuple
    dtype: DType

    def emit(self, ctx, value):
        v = ctx.m.input(self.name, self.shape, self.dtype)
        ctx.inputs[self.name] = v
        return v if value is None else value


@attrs.frozen
class SetState:
    key: str
    value: object

    def emit(self, ctx, value):
        ctx.state[self.key] = self.value
        return value


@attrs.frozen
class ZeroBeta:
    n: int

    def emit(self, ctx, value):
        ctx.state["zero_beta"] = ctx.m.constant(np.zeros(self.n, ctx.dtype.np))
        return value


@attrs.frozen
class TokenEmbed:
    key: str = "model.embed_tokens.weight"
    scale: float | None = None       # some families multiply by sqrt(hidden)

    def emit(self, ctx, ids):
        vocab = ctx.cfg("vocab_size")
        hidden = ctx.cfg("hidden_size")
        table = ctx.param(self.key, (vocab, hidden) if vocab and hidden else None)
        x = ctx.m.gather(table, ids)
        if self.scale is not None:
            # HF casts the scale to the activation dtype before multiplying
            x = x * float(np.asarray(self.scale, dtype=x.dtype.np if x.dtype.is_float else np.float32))
        return x


@attrs.frozen
class RmsNorm:
    key: str
    eps: float = 1e-6
    offset: float = 0.0              # 1.0: x * (1 + w), for weights stored as w - 1
    absolute: bool = False

    def emit(self, ctx, x):
        key = self.key if self.absolute else ctx.key(self.key)
        w = ctx.param(key, (x.dims[-1],))
        return ctx.m.rms_norm(x, w, eps=self.eps, offset=self.offset)


@attrs.frozen
class LayerNorm:
    gamma: str
    beta: str | None = None
    eps: float = 1e-12

    def emit(self, ctx, x):
        g = ctx.param(ctx.key(self.gamma), (x.dims[-1],))
        b = ctx.param(ctx.key(self.beta), (x.dims[-1],)) if self.beta else ctx.state.get("zero_beta")
        return ctx.m.layer_norm(x, g, b, eps=self.eps)


@attrs.frozen
class Linear:
    key: str                         # weight key relative to the layer prefix
    transpose: bool = True           # HF layout [out, in]
    bias: str | None = None
    out_features: int | None = None

    def emit(self, ctx, x):
        w = ctx.param(ctx.key(self.key))
        b = ctx.param(ctx.key(self.bias)) if self.bias else None
        return ctx.m.linear(x, w, b, transpose_w=self.transpose)


@attrs.frozen
class ResidualSave:
    slot: str = "residual"

    def emit(self, ctx, x):
        ctx.state[self.slot] = x
        return x


@attrs.frozen
class ResidualAdd:
    slot: str = "residual"

    def emit(self, ctx, x):
        if self.slot not in ctx.state:
            raise ModelError(f"residual_add: nothing saved in slot {self.slot!r} (add residual_save first)")
        return x + ctx.state[self.slot]


def gated_mlp_weights(ctx, prefix: str, hidden: int) -> tuple[Value, Value, Value]:
    """(gate, up, down) HF-layout weights of a gated MLP under the layer's `prefix`."""
    inter = ctx.cfg("intermediate_size")
    p = ctx.key(prefix)
    shp = (inter, hidden) if inter else None
    return (ctx.param(f"{p}.gate_proj.weight", shp), ctx.param(f"{p}.up_proj.weight", shp),
            ctx.param(f"{p}.down_proj.weight", (hidden, inter) if inter else None))


def gated_mlp(m, x, gate, up, down, act: str = "silu"):
    """down(act(gate(x)) * up(x)) with HF-layout weights; silu as the one swiglu_mlp op."""
    if act == "silu":
        return m.swiglu(x, gate, up, down)
    return m.linear(m.act(m.linear(x, gate), act) * m.linear(x, up), down)


@attrs.frozen
class SwigluMlp:
    prefix: str = "mlp"

    def emit(self, ctx, x):
        return ctx.m.swiglu(x, *gated_mlp_weights(ctx, self.prefix, x.dims[-1]))


@attrs.frozen
class GatedMlp:
    """A gated MLP whose gate activation the config names (`hidden_act`: gelu, relu, ...)."""
    prefix: str = "mlp"
    act: str = "silu"               # an IR activation

    def emit(self, ctx, x):
        return gated_mlp(ctx.m, x, *gated_mlp_weights(ctx, self.prefix, x.dims[-1]), self.act)


@attrs.frozen
class AttnSpec:
    """Self-attention of one layer. Keys are relative to the layer prefix."""
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = attrs.field(default=None, eq=False)
    max_positions: int = 2048
    rotary_dim: int | None = None
    rope_style: str = "half"
    qk_norm_eps: float | None = None     # QK-norm (RMSNorm of q and k per head)
    qk_norm_offset: float = 0.0
    bias: bool = False                   # q/k/v biases
    o_bias: bool = False
    scale: float | None = None
    softcap: float = 0.0
    window: int = 0                      # sliding window (0: global)
    mode: str = "prefill"                # prefill | decode
    kv_cache: bool = True                # prefill writes the KV state for decode
    kv_taps: bool = False                # expose present K/V as outputs (cache export)
    prefix: str = "self_attn"
    fused_qkv: str | None = None         # key of a fused [q;k;v] weight, if the checkpoint has one


def rope_for(ctx, spec: AttnSpec):
    """(cos, sin) gathered at the flow's `positions` input: [B, S, rot/2]."""
    rot = spec.rotary_dim or spec.head_dim
    key = ("rope", spec.rope_theta, repr(spec.rope_scaling), rot)
    if key not in ctx.state:
        given = ctx.state.get("rope_tables")
        if given is not None:
            cos, sin = given
        else:
            inv, scaling = inv_freq(rot, spec.rope_theta, spec.rope_scaling)
            cos, sin = rope_tables(inv, spec.max_positions, scaling)
        m = ctx.m
        tc = m.constant(cos.astype(np.float32), name=f"rope_cos_{len(ctx.state)}")
        ts = m.constant(sin.astype(np.float32), name=f"rope_sin_{len(ctx.state)}")
        pos = ctx.inputs.get("positions")
        if pos is None:
            raise ModelError("attention with RoPE needs a 'positions' input ([batch, seq] int)")
        ctx.state[key] = (m.gather(tc, pos), m.gather(ts, pos))
    return ctx.state[key]


def continues_cache(ctx) -> bool:
    """Whether this graph continues sequences already in its caches: a decode or extend graph,
    whose key mask spans the cache ("ctx" axis) and whose `cache_pos` says where each row's
    new tokens go. Its attention then reads the KV caches with query i at cache_pos + i, and
    its recurrent layers start from their state leaves (a prefill starts from nothing)."""
    mask = ctx.inputs.get("key_mask")
    return "cache_pos" in ctx.inputs and mask is not None and mask.dims[-1] == "ctx"


@attrs.frozen
class SelfAttention:
    spec: AttnSpec

    def reads_cache(self, ctx) -> bool:
        """Whether attention reads the KV caches (decode, extend) rather than the new k, v."""
        return self.spec.mode == "decode" or continues_cache(ctx)

    def _proj(self, ctx, x, name, heads):
        s, m = self.spec, ctx.m
        p = ctx.key(f"{s.prefix}.{name}_proj")
        w = ctx.param(f"{p}.weight", (heads * s.head_dim, s.hidden))
        b = ctx.param(f"{p}.bias", (heads * s.head_dim,)) if s.bias else None
        y = m.linear(x, w, b)
        y = m.reshape(y, (x.dims[0], x.dims[1], heads, s.head_dim))
        if s.qk_norm_eps is not None and name in ("q", "k"):
            nw = ctx.param(ctx.key(f"{s.prefix}.{name}_norm.weight"), (s.head_dim,))
            y = m.rms_norm(y, nw, eps=s.qk_norm_eps, offset=s.qk_norm_offset)
        return m.transpose(y, (0, 2, 1, 3))

    def project_qkv(self, ctx, x) -> tuple:
        """q [B,H,S,D], k and v [B,KVH,S,D] (QK-norm applied, RoPE not yet)."""
        s = self.spec
        if s.heads % s.kv_heads:
            raise ModelError(f"layer {ctx.prefix}: {s.heads} heads is not a multiple of {s.kv_heads} kv heads")
        return (self._proj(ctx, x, "q", s.heads), self._proj(ctx, x, "k", s.kv_heads),
                self._proj(ctx, x, "v", s.kv_heads))

    def rope_tables(self, ctx) -> tuple:
        """(cos, sin) of this layer at the flow's positions (a hook: per-layer RoPE computes its own)."""
        return rope_for(ctx, self.spec)

    def roped_qkv(self, ctx, x) -> tuple:
        """q, k, v with RoPE applied; the present K/V become outputs when kv_taps."""
        s, m, i = self.spec, ctx.m, ctx.index()
        q, k, v = self.project_qkv(ctx, x)
        cos, sin = self.rope_tables(ctx)
        q, k = m.rope(q, cos, sin, s.rope_style), m.rope(k, cos, sin, s.rope_style)
        if s.kv_taps:
            ctx.outputs[f"present.{i}.k"], ctx.outputs[f"present.{i}.v"] = k, v
        return q, k, v

    def cached_kv(self, ctx, x, k, v, cache_pos) -> tuple:
        """Writes k, v into this layer's full-length KV cache at cache_pos; returns what the
        attention reads: the caches when continuing them (decode, extend), else k and v."""
        if cache_pos is None:
            raise ModelError("decode attention needs a 'cache_pos' input ([batch] int)")
        kc, vc = self.write_cache(ctx, "", x.dims[0], "ctx", k, v, cache_pos)
        return (kc, vc) if self.reads_cache(ctx) else (k, v)

    def write_cache(self, ctx, prefix: str, batch, length, k, v, cache_pos) -> tuple:
        """k, v written into this layer's KV states `{prefix}kv.{i}.k|v` [batch, kv_heads,
        length, head_dim] at cache_pos; the states after the write."""
        s, m, i = self.spec, ctx.m, ctx.index()
        shape = (batch, s.kv_heads, length, s.head_dim)
        return (m.kv_write(m.state(f"{prefix}kv.{i}.k", shape, k.dtype), k, cache_pos),
                m.kv_write(m.state(f"{prefix}kv.{i}.v", shape, v.dtype), v, cache_pos))

    def out_proj(self, ctx, x, o):
        """The heads [B,H,S,D] merged back to [B,S,H*D] and projected (o_proj)."""
        return self.o_proj(ctx, self.merge_heads(ctx, o, x.dims[0], x.dims[1]))

    def merge_heads(self, ctx, o, batch, seq):
        """The heads [B,H,S,D] as [batch, seq, H*D]."""
        s, m = self.spec, ctx.m
        return m.reshape(m.transpose(o, (0, 2, 1, 3)), (batch, seq, s.heads * s.head_dim))

    def o_proj(self, ctx, o):
        """o_proj of merged heads [B,S,H*D]."""
        s = self.spec
        wo = ctx.param(ctx.key(f"{s.prefix}.o_proj.weight"), (s.hidden, s.heads * s.head_dim))
        bo = ctx.param(ctx.key(f"{s.prefix}.o_proj.bias"), (s.hidden,)) if s.o_bias else None
        return ctx.m.linear(o, wo, bo)

    def attend(self, ctx, q, k, v, mask, pos):
        """The attention op with this layer's scale, mask kind, window and softcap."""
        s = self.spec
        scale = s.scale if s.scale is not None else 1.0 / math.sqrt(s.head_dim)
        kind = MaskKind.SLIDING_WINDOW if s.window else MaskKind.CAUSAL
        return ctx.m.attention(q, k, v, mask, pos, scale=scale, mask_kind=kind, window=s.window,
                               softcap=s.softcap)

    def emit(self, ctx, x):
        s = self.spec
        split = mixed_split(ctx)
        if split is not None:
            return self.mixed(ctx, x, *split)
        q, k, v = self.roped_qkv(ctx, x)
        mask = ctx.inputs.get("key_mask")
        cache_pos = ctx.inputs.get("cache_pos")
        if s.mode == "decode" or (s.kv_cache and cache_pos is not None):
            k, v = self.cached_kv(ctx, x, k, v, cache_pos)
        pos = cache_pos if self.reads_cache(ctx) else None
        return self.out_proj(ctx, x, self.attend(ctx, q, k, v, mask, pos))

    def mixed(self, ctx, x, rows: int, piece: int):
        """A mixed graph's attention (recipe.DecoderFlow): q, k, v projected on the packed
        [1, rows + piece] tokens (the weights read once), then split: the first `rows`
        tokens, one a row, roped and attending as a decode step does (the KV states at
        cache_pos under key_mask, in the decode graph's layout, so a backend's fused decode
        attention step applies: RoPE, the cache writes and attention in one), the rest as an
        extend piece of one sequence (its own states, PIECE_PREFIX, at piece_pos under
        piece_mask); the heads joined again on the token axis before o_proj."""
        s, m, inp = self.spec, ctx.m, ctx.inputs
        q, k, v = self.project_qkv(ctx, x)                         # [1, heads, rows + piece, D]
        cos, sin = self.rope_tables(ctx)                           # [1, rows + piece, rot/2]

        def decode_rows(t):                                        # -> [rows, heads, 1, D]
            return m.transpose(m.narrow(t, 2, 0, rows), (2, 1, 0, 3))

        def piece_part(t):                                         # -> [1, heads, piece, D]
            return m.narrow(t, 2, rows, piece)

        def tables(a: int, n: int, dims: tuple) -> tuple:
            return tuple(m.reshape(m.narrow(t, 1, a, n), dims) for t in (cos, sin))

        qr, kr, vr = decode_rows(q), decode_rows(k), decode_rows(v)
        c_r, s_r = tables(0, rows, (rows, 1, cos.dims[-1]))
        qr, kr = m.rope(qr, c_r, s_r, s.rope_style), m.rope(kr, c_r, s_r, s.rope_style)
        kc, vc = self.write_cache(ctx, "", rows, "ctx", kr, vr, inp["cache_pos"])
        o_rows = self.attend(ctx, qr, kc, vc, inp["key_mask"], inp["cache_pos"])
        c_p, s_p = tables(rows, piece, (1, piece, cos.dims[-1]))
        qp, kp = (m.rope(piece_part(t), c_p, s_p, s.rope_style) for t in (q, k))
        kp, vp = self.write_cache(ctx, PIECE_PREFIX, 1, PIECE_CTX, kp, piece_part(v), inp["piece_pos"])
        o_piece = self.attend(ctx, qp, kp, vp, inp["piece_mask"], inp["piece_pos"])
        o = m.concat([self.merge_heads(ctx, o_rows, 1, rows), self.merge_heads(ctx, o_piece, 1, piece)], 1)
        return self.o_proj(ctx, o)


@attrs.frozen
class GatherLastToken:
    def emit(self, ctx, x):
        return ctx.m.narrow(x, 1, -1, 1)


@attrs.frozen
class LmHead:
    vocab: int
    hidden: int
    tied: bool = False
    key: str | None = None
    softcap: float = 0.0            # final-logit softcapping: cap * tanh(logits / cap)

    def emit(self, ctx, x):
        key = self.key or ("model.embed_tokens.weight" if self.tied else "lm_head.weight")
        w = ctx.param(key, (self.vocab, self.hidden))
        y = ctx.m.linear(x, w)
        if self.softcap:
            y = ctx.m.tanh(y / self.softcap) * self.softcap
        return y


@attrs.frozen
class Tap:
    name: str

    def emit(self, ctx, x):
        ctx.outputs[self.name] = x
        return x


@attrs.frozen
class CrossEntropyLoss:
    """Output `name`: mean over the labels >= 0 of logsumexp(logits) - logits[label], in f32
    at least (f64 graphs stay f64), for training graphs. The value passes through."""
    labels: str = "labels"
    name: str = "loss"

    def emit(self, ctx, x):
        m = ctx.m
        lab = ctx.inputs.get(self.labels)
        if lab is None or lab.dtype.is_float or lab.dims != x.dims[:-1]:
            raise ModelError(f"cross_entropy_loss: needs an integer input {self.labels!r} of dims "
                             f"{x.dims[:-1]} (the logits' without the vocab axis), got "
                             f"{lab.shape if lab is not None else 'none'}")
        z = x if x.dtype in (F32, F64) else m.cast(x, F32)
        last = z.shape.rank - 1
        top = m.max(z, (last,), keepdims=True)
        lse = m.act(m.sum(m.exp(z - top), (last,), keepdims=True), "log") + top
        hot = m.compare(m.reshape(lab, lab.dims + (1,)),
                        m.constant(np.arange(x.dims[-1], dtype=np.int64)), "eq")
        keep = m.cast(m.compare(lab, 0, "ge"), z.dtype)
        nll = m.reshape(lse - m.sum(m.where(hot, z, 0.0), (last,), keepdims=True), lab.dims) * keep
        every = tuple(range(lab.shape.rank))
        ctx.outputs[self.name] = m.sum(nll, every) / m.maximum(m.sum(keep, every), 1.0)
        return x


@attrs.frozen
class GreedyNext:
    """Outputs `ids` (the arg-max over the vocabulary) and `check` (the logits' sum, finite
    exactly when every logit is) beside the logits: a greedy decode step then fetches a few
    bytes per row from the device instead of the whole [batch, vocab] logits."""
    ids: str = "next_ids"
    check: str = "logits_sum"

    def emit(self, ctx, x):
        ctx.outputs[self.ids] = ctx.m.argmax(x, axis=-1)
        ctx.outputs[self.check] = ctx.m.sum(ctx.m.cast(x, "f32"), (-1,))
        return x


GENERIC_BLOCKS = {
    "token_embed": TokenEmbed, "rms_norm": RmsNorm, "layer_norm": LayerNorm, "linear": Linear,
    "residual_save": ResidualSave, "residual_add": ResidualAdd, "swiglu_mlp": SwigluMlp,
    "gated_mlp": GatedMlp,
    "self_attention": lambda **kw: SelfAttention(AttnSpec(**kw)), "gather_last_token": GatherLastToken,
    "lm_head": LmHead, "tap": Tap, "greedy_next": GreedyNext, "cross_entropy_loss": CrossEntropyLoss,
}


@hookimpl
def rlx_register_blocks(register):
    from .dit import DIT_BLOCKS

    for name, factory in {**GENERIC_BLOCKS, **DIT_BLOCKS}.items():
        register(name, factory)


@attrs.frozen
class L2Normalize:
    """y / max(||y||, eps) over the last axis (torch.nn.functional.normalize)."""
    eps: float = 1e-12

    def emit(self, ctx, y):
        m = ctx.m
        n = m.act(m.sum(y * y, (-1,), keepdims=True), "sqrt")
        return y / m.maximum(n, self.eps)


__all__ = ["AttnSpec", "SelfAttention", "continues_cache", "mixed_split", "PIECE_PREFIX", "PIECE_CTX",
           "GENERIC_BLOCKS", "L2Normalize"]
