"""BERT-family blocks: small stages with `emit(ctx, value) -> value`, composed by the BertFlow
and NomicBertFlow recipes and registered (prefixed `bert.`) through rlx_register_blocks.

Flow inputs the blocks read (declared by the recipe), in one of two layouts:

- padded (any backend): `ids`, `token_type_ids`, `positions` [B,S] (int) and `key_mask`
  [B,1,1,S] (bool, True = a real token); attention is masked by key_mask.
- packed (any backend; the default where the backend has kernels for the table's
  `varlen_attention` and `segment_pool`): the texts of a batch concatenated into `ids`,
  `token_type_ids`, `positions` [1,T], and `seq_starts`, `seq_lens` [N] giving each text's
  tokens; projections see only real tokens, attention and pooling run per text.

The blocks emit plain IR (`linear`, `layer_norm(x + residual)`, ...); the fused kernels those
become (matmul epilogues, residual + LayerNorm) are the backends' business.

Keys are the checkpoint's own (HF) names, relative to the layer prefix inside a layer.
"""
from __future__ import annotations

import math

import attrs

from rlx_core.flow import AttnSpec, ModelFlow
from rlx_core.flow.blocks import Input, L2Normalize, LayerNorm, Tap, rope_for
from rlx_core.flow.flow import LayerScope
from rlx_core.ir.dtype import BOOL, I64
from rlx_core.ir.errors import ModelError
from rlx_core.ir.ops import MaskKind
from rlx_core.weights.config import hf_activation


def ir_activation(name: str, what: str = "hidden_act") -> str:
    """The IR activation for an HF activation name, or a ModelError listing the supported ones."""
    return hf_activation({what: name}, what, default="gelu")


def _join(*parts: str) -> str:
    return ".".join(p.strip(".") for p in parts if p)


# ------------------------------------------------------------------------------ specs
@attrs.frozen
class BertSpec:
    """One BERT encoder layer (HF BertLayer): fused QKV self-attention over a key padding
    mask, post-LayerNorm residuals, an activation FFN. Keys follow HF BertModel."""
    hidden: int
    heads: int
    intermediate: int
    eps: float = 1e-12
    act: str = "gelu"                  # IR activation of the FFN
    fused_qkv: bool = True             # one [3H, H] matmul (weights concatenated at load time)

    def __attrs_post_init__(self):
        if self.heads <= 0 or self.hidden % self.heads:
            raise ModelError(f"hidden size {self.hidden} is not a multiple of {self.heads} attention heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@attrs.frozen
class NomicSpec:
    """One NomicBERT layer: fused Wqkv, rotary q/k, post-norm residuals, gated (SwiGLU) MLP.
    Keys follow nomic-ai's modeling_hf_nomic_bert (`attn.Wqkv`, `mlp.fc11`, `norm1`, ...)."""
    hidden: int
    heads: int
    intermediate: int
    eps: float = 1e-12
    rotary_dim: int = 0                # 0: no rotary (absolute position embeddings instead)
    rope_theta: float = 1000.0
    rope_style: str = "half"           # half (GPT-NeoX) or interleaved (GPT-J)
    max_positions: int = 2048
    mlp: str = "gated"                 # gated: fc2(fc11(x) * act(fc12(x))); plain: fc2(act(fc1(x)))
    act: str = "silu"                  # IR activation (silu for swiglu, gelu for geglu, sigmoid for glu)
    qkv_bias: bool = False             # Wqkv and out_proj biases (nomic's qkv_proj_bias)
    fc1_bias: bool = False
    fc2_bias: bool = False

    def __attrs_post_init__(self):
        if self.heads <= 0 or self.hidden % self.heads:
            raise ModelError(f"hidden size {self.hidden} is not a multiple of {self.heads} attention heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.hidden // self.heads:
            raise ModelError(f"rotary dim {self.rotary_dim} must be even and at most the head dim "
                             f"{self.hidden // self.heads}")
        if self.mlp not in ("gated", "plain"):
            raise ModelError(f"NomicSpec.mlp must be 'gated' or 'plain', got {self.mlp!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# ------------------------------------------------------------------------------ helpers
def dense(ctx, x, w, b=None, act: str = "identity"):
    """act(x @ w^T + b) with an HF-layout weight: `linear` (+ the activation), which fusion
    makes one matmul with a bias/activation epilogue."""
    y = ctx.m.linear(x, w, b)
    return y if act == "identity" else ctx.m.act(y, act)


def _heads(m, t, heads: int, d: int):
    """[B,S,heads*d] -> [B,heads,S,d]."""
    return m.transpose(m.reshape(t, (t.dims[0], t.dims[1], heads, d)), (0, 2, 1, 3))


def _merge(m, o):
    """[B,heads,S,d] -> [B,S,heads*d]."""
    b, h, s, d = o.dims
    return m.reshape(m.transpose(o, (0, 2, 1, 3)), (b, s, h * d))


def _split(m, qkv, n: int) -> tuple:
    """A fused projection [B,S,3n] ([q; k; v] along the last axis) -> q, k, v [B,S,n] (views)."""
    return tuple(m.narrow(qkv, 2, i * n, n) for i in range(3))


def _segments(ctx):
    """(seq_starts, seq_lens) of a packed flow, or None for the padded layout."""
    starts = ctx.inputs.get("seq_starts")
    return None if starts is None else (starts, ctx.inputs["seq_lens"])


def _attend(ctx, q, k, v, heads: int, rope=None):
    """Bidirectional self-attention of projections q, k, v [B,S,heads*d] -> [B,S,heads*d]:
    within each text of a packed flow (`varlen_attention` on tokens-major [T, heads, d]
    views: no transposes), or over the key padding mask of a padded one. `rope` = (cos, sin,
    style) rotates q and k first (tables [B,S,R/2] at the flow's positions)."""
    m = ctx.m
    b, s, n = q.dims
    d = n // heads
    scale = 1.0 / math.sqrt(d)
    seg = _segments(ctx)
    if seg is not None:
        qt, kt, vt = (m.reshape(t, (s, heads, d)) for t in (q, k, v))
        if rope is not None:
            # each token a batch row of one position: [T, heads, 1, d] against tables [T, 1, R/2]
            cos, sin, style = rope
            tab = [m.reshape(t, (s, 1, t.dims[-1])) for t in (cos, sin)]
            qt, kt = (m.reshape(m.rope(m.reshape(t, (s, heads, 1, d)), *tab, style), (s, heads, d))
                      for t in (qt, kt))
        o = m.add("varlen_attention", (qt, kt, vt) + seg, scale=scale)
        return m.reshape(o, (b, s, n))
    qh, kh, vh = (_heads(m, t, heads, d) for t in (q, k, v))
    if rope is not None:
        cos, sin, style = rope
        qh, kh = m.rope(qh, cos, sin, style), m.rope(kh, cos, sin, style)
    o = m.attention(qh, kh, vh, ctx.inputs.get("key_mask"), None, scale=scale, mask_kind=MaskKind.NONE)
    return _merge(m, o)


def _segment_pool(ctx, x, mode):
    """The table's `segment_pool` of a packed flow's [1, T, H] -> [texts, H]."""
    m = ctx.m
    flat = m.reshape(x, x.dims[1:])
    return m.add("segment_pool", (flat,) + _segments(ctx), mode=mode)


def _mask_f(ctx, x):
    """The key mask as x's dtype, [B,S,1] (None when the flow has no key_mask)."""
    km = ctx.inputs.get("key_mask")
    if km is None:
        return None
    m = ctx.m
    return m.reshape(m.cast(km, x.dtype), (km.dims[0], km.dims[3], 1))


# ------------------------------------------------------------------------------ embedding blocks
@attrs.frozen
class Embed:
    """table[ids]: the word embeddings (`input` names the flow input of token ids)."""
    weight: str
    rows: int | None = None
    dim: int | None = None
    input: str = "ids"

    def emit(self, ctx, value):
        idx = ctx.inputs.get(self.input)
        if idx is None:
            raise ModelError(f"embed: the flow has no {self.input!r} input")
        shape = (self.rows, self.dim) if self.rows and self.dim else None
        return ctx.m.gather(ctx.param(self.weight, shape), idx)


@attrs.frozen
class GatherAdd:
    """x + table[input]: position or token-type embeddings added to the current value."""
    input: str
    weight: str
    rows: int | None = None

    def emit(self, ctx, x):
        idx = ctx.inputs.get(self.input)
        if idx is None:
            raise ModelError(f"gather_add: the flow has no {self.input!r} input")
        shape = (self.rows, x.dims[-1]) if self.rows and x is not None else None
        e = ctx.m.gather(ctx.param(ctx.key(self.weight), shape), idx)
        return e if x is None else x + e


# ------------------------------------------------------------------------------ layer blocks
@attrs.frozen
class GeluFfn:
    """down(act(up(x))) with biases: BERT's intermediate.dense / output.dense pair. `prefix` is
    prepended (inside a layer: relative to the layer prefix)."""
    prefix: str = ""
    act: str = "gelu"
    intermediate: int | None = None
    up: str = "intermediate.dense"
    down: str = "output.dense"
    bias: bool = True

    def emit(self, ctx, x):
        d = x.dims[-1]
        inter = self.intermediate or ctx.cfg("intermediate_size")
        up, down = ctx.key(_join(self.prefix, self.up)), ctx.key(_join(self.prefix, self.down))
        w1 = ctx.param(f"{up}.weight", (inter, d) if inter else None)
        b1 = ctx.param(f"{up}.bias", (inter,) if inter else None) if self.bias else None
        h = dense(ctx, x, w1, b1, self.act)
        w2 = ctx.param(f"{down}.weight", (d, h.dims[-1]))
        b2 = ctx.param(f"{down}.bias", (d,)) if self.bias else None
        return dense(ctx, h, w2, b2)


@attrs.frozen
class BertSelfAttention:
    """HF BertAttention without its output LayerNorm: q/k/v projections (fused into one
    matmul when spec.fused_qkv), padding-masked attention, the output dense."""
    spec: BertSpec
    prefix: str = "attention"

    def emit(self, ctx, x):
        s, m = self.spec, ctx.m
        p = ctx.key(self.prefix)
        shp_w, shp_b = (s.hidden, s.hidden), (s.hidden,)
        ws = [ctx.param(f"{p}.self.{n}.weight", shp_w) for n in ("query", "key", "value")]
        bs = [ctx.param(f"{p}.self.{n}.bias", shp_b) for n in ("query", "key", "value")]
        if s.fused_qkv:
            # a concat of params: hoisted to load time by the pipeline, one matmul per layer
            q, k, v = _split(m, dense(ctx, x, m.concat(ws, 0), m.concat(bs, 0)), s.hidden)
        else:
            q, k, v = (dense(ctx, x, w, b) for w, b in zip(ws, bs))
        o = _attend(ctx, q, k, v, s.heads)
        return dense(ctx, o, ctx.param(f"{p}.output.dense.weight", shp_w),
                     ctx.param(f"{p}.output.dense.bias", shp_b))


def _add_norm(ctx, y, residual, key, eps):
    """LayerNorm(y + residual): fusion makes it one fused_residual_ln."""
    d = y.dims[-1]
    g, b = ctx.param(f"{key}.weight", (d,)), ctx.param(f"{key}.bias", (d,))
    return ctx.m.layer_norm(y + residual, g, b, eps=eps)


@attrs.frozen
class BertEncoderLayer:
    """One HF BertLayer: LN(x + attn(x)), then LN(h + ffn(h))."""
    spec: BertSpec

    def emit(self, ctx, x):
        s = self.spec
        h = _add_norm(ctx, ctx.emit(BertSelfAttention(s), x), x, ctx.key("attention.output.LayerNorm"), s.eps)
        f = ctx.emit(GeluFfn(act=s.act, intermediate=s.intermediate), h)
        return _add_norm(ctx, f, h, ctx.key("output.LayerNorm"), s.eps)


@attrs.frozen
class NomicMlp:
    """NomicBERT's MLP: gated fc2(fc11(x) * act(fc12(x))) or plain fc2(act(fc1(x)))."""
    spec: NomicSpec
    prefix: str = "mlp"

    def emit(self, ctx, x):
        s, m, d = self.spec, ctx.m, x.dims[-1]
        p, inter = ctx.key(self.prefix), s.intermediate

        def lin(name, y, out, bias, act="identity"):
            w = ctx.param(f"{p}.{name}.weight", (out, y.dims[-1]))
            b = ctx.param(f"{p}.{name}.bias", (out,)) if bias else None
            return dense(ctx, y, w, b, act)

        if s.mlp == "plain":
            return lin("fc2", lin("fc1", x, inter, s.fc1_bias, s.act), d, s.fc2_bias)
        if s.act == "silu" and not s.fc1_bias and not s.fc2_bias:
            up = ctx.param(f"{p}.fc11.weight", (inter, d))
            gate = ctx.param(f"{p}.fc12.weight", (inter, d))
            return m.swiglu(x, gate, up, ctx.param(f"{p}.fc2.weight", (d, inter)))
        y = lin("fc11", x, inter, s.fc1_bias) * lin("fc12", x, inter, s.fc1_bias, s.act)
        return lin("fc2", y, d, s.fc2_bias)


@attrs.frozen
class NomicEncoderLayer:
    """One NomicBERT block (prenorm=False): LN1(x + attn(x)), then LN2(h + mlp(h)); the
    attention rotates q and k by RoPE at the flow's `positions`."""
    spec: NomicSpec

    def _rope_spec(self) -> AttnSpec:
        s = self.spec
        return AttnSpec(heads=s.heads, kv_heads=s.heads, head_dim=s.head_dim, hidden=s.hidden,
                        rope_theta=s.rope_theta, max_positions=s.max_positions,
                        rotary_dim=s.rotary_dim, rope_style=s.rope_style)

    def emit(self, ctx, x):
        s, m = self.spec, ctx.m
        p = ctx.key("attn")
        w = ctx.param(f"{p}.Wqkv.weight", (3 * s.hidden, s.hidden))
        b = ctx.param(f"{p}.Wqkv.bias", (3 * s.hidden,)) if s.qkv_bias else None
        q, k, v = _split(m, dense(ctx, x, w, b), s.hidden)
        rope = (*rope_for(ctx, self._rope_spec()), s.rope_style) if s.rotary_dim else None
        o = _attend(ctx, q, k, v, s.heads, rope)
        wo = ctx.param(f"{p}.out_proj.weight", (s.hidden, s.hidden))
        bo = ctx.param(f"{p}.out_proj.bias", (s.hidden,)) if s.qkv_bias else None
        h = _add_norm(ctx, dense(ctx, o, wo, bo), x, ctx.key("norm1"), s.eps)
        return _add_norm(ctx, ctx.emit(NomicMlp(s), h), h, ctx.key("norm2"), s.eps)


# ------------------------------------------------------------------------------ pooling
@attrs.frozen
class MeanPool:
    """Mean over the real tokens (sentence-transformers' mean pooling): sum(x * mask) / max(n, 1e-9)."""

    def emit(self, ctx, x):
        if _segments(ctx) is not None:
            return _segment_pool(ctx, x, "mean")
        m = ctx.m
        mf = _mask_f(ctx, x)
        if mf is None:
            return m.mean(x, (1,))
        return m.sum(x * mf, (1,)) / m.maximum(m.sum(mf, (1,)), 1e-9)


@attrs.frozen
class ClsPool:
    """The first token's state ([CLS])."""

    def emit(self, ctx, x):
        if _segments(ctx) is not None:
            return _segment_pool(ctx, x, "cls")
        b, _, d = x.dims
        return ctx.m.reshape(ctx.m.narrow(x, 1, 0, 1), (b, d))


@attrs.frozen
class MaxPool:
    """Max over the real tokens (padding set to -1e9 first, as sentence-transformers does)."""

    def emit(self, ctx, x):
        if _segments(ctx) is not None:
            return _segment_pool(ctx, x, "max")
        m = ctx.m
        km = ctx.inputs.get("key_mask")
        if km is not None:
            x = m.where(m.reshape(km, (km.dims[0], km.dims[3], 1)), x, -1e9)
        return m.max(x, (1,))


POOLING = {"mean": MeanPool, "cls": ClsPool, "max": MaxPool}


def pool_stage(mode: str):
    if mode not in POOLING:
        raise ModelError(f"unsupported pooling {mode!r}; supported: {sorted(POOLING)}")
    return POOLING[mode]()


# ------------------------------------------------------------------------------ fluent wrapper
class BertFlowBuilder(ModelFlow):
    """ModelFlow with the BERT-family blocks as fluent methods:

        BertFlowBuilder("bert").encoder_inputs()
            .embed("embeddings.word_embeddings.weight")
            .gather_add("positions", "embeddings.position_embeddings.weight")
            .gather_add("token_type_ids", "embeddings.token_type_embeddings.weight")
            .layer_norm("embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias", 1e-12)
            .repeat_bert_layers(6, spec).output("last_hidden_state")
            .mean_pool().l2_normalize().build(weights)
    """

    def __init__(self, name: str = "bert", layer_prefix: str = "encoder.layer"):
        super().__init__(name, layer_prefix)

    def sub(self) -> "BertFlowBuilder":
        return BertFlowBuilder(self.name, self.layer_prefix)

    def encoder_inputs(self, batch="batch", seq="seq", token_types: bool = True,
                       positions: bool = True) -> "BertFlowBuilder":
        """ids, token_type_ids, positions [batch, seq] (i64) and key_mask [batch,1,1,seq] (bool)."""
        self._add(Input("ids", (batch, seq), I64))
        if token_types:
            self._add(Input("token_type_ids", (batch, seq), I64))
        if positions:
            self._add(Input("positions", (batch, seq), I64))
        return self._add(Input("key_mask", (batch, 1, 1, seq), BOOL))

    def packed_inputs(self, tokens="tokens", seqs="seqs", token_types: bool = True,
                      positions: bool = True) -> "BertFlowBuilder":
        """The packed layout: ids, token_type_ids, positions [1, tokens] (i64), the texts' token
        ranges seq_starts, seq_lens [seqs] (i64)."""
        self._add(Input("ids", (1, tokens), I64))
        if token_types:
            self._add(Input("token_type_ids", (1, tokens), I64))
        if positions:
            self._add(Input("positions", (1, tokens), I64))
        self._add(Input("seq_starts", (seqs,), I64))
        return self._add(Input("seq_lens", (seqs,), I64))

    def embed(self, weight: str, rows: int | None = None, dim: int | None = None,
              input: str = "ids") -> "BertFlowBuilder":
        return self._add(Embed(weight, rows, dim, input))

    def gather_add(self, input: str, weight: str, rows: int | None = None) -> "BertFlowBuilder":
        return self._add(GatherAdd(input, weight, rows))

    def layer_norm(self, gamma: str, beta: str | None = None, eps: float = 1e-12) -> "BertFlowBuilder":
        return self._add(LayerNorm(gamma, beta, eps))

    def gelu_ffn(self, prefix: str = "", act: str = "gelu", intermediate: int | None = None,
                 up: str = "intermediate.dense", down: str = "output.dense") -> "BertFlowBuilder":
        return self._add(GeluFfn(prefix, act, intermediate, up, down))

    def bert_encoder_layer(self, spec: BertSpec) -> "BertFlowBuilder":
        return self._add(BertEncoderLayer(spec))

    def nomic_encoder_layer(self, spec: NomicSpec) -> "BertFlowBuilder":
        return self._add(NomicEncoderLayer(spec))

    def _repeat(self, n: int, prefix: str, stage_for, taps: bool = False) -> "BertFlowBuilder":
        for i in range(n):
            stage = stage_for(i)
            if isinstance(stage, ModelFlow):
                from rlx_core.flow.flow import Sequence

                stage = Sequence(tuple(stage.stages))
            self._add(LayerScope(i, f"{prefix}.{i}", stage))
            if taps:
                self._add(Tap(f"layer.{i}"))
        return self

    def repeat_bert_layers(self, n: int, spec: BertSpec, prefix: str = "encoder.layer",
                           layer=None, taps: bool = False) -> "BertFlowBuilder":
        """n BERT layers under `<prefix>.<i>`; `layer(i)` may return a replacement stage/flow."""
        return self._repeat(n, prefix, lambda i: (layer(i) if layer else None) or BertEncoderLayer(spec),
                            taps)

    def repeat_nomic_layers(self, n: int, spec: NomicSpec, prefix: str = "encoder.layers",
                            layer=None, taps: bool = False) -> "BertFlowBuilder":
        return self._repeat(n, prefix, lambda i: (layer(i) if layer else None) or NomicEncoderLayer(spec),
                            taps)

    def pool(self, mode: str = "mean") -> "BertFlowBuilder":
        return self._add(pool_stage(mode))

    def mean_pool(self) -> "BertFlowBuilder":
        return self._add(MeanPool())

    def cls_pool(self) -> "BertFlowBuilder":
        return self._add(ClsPool())

    def max_pool(self) -> "BertFlowBuilder":
        return self._add(MaxPool())

    def l2_normalize(self, eps: float = 1e-12) -> "BertFlowBuilder":
        return self._add(L2Normalize(eps))


BLOCKS = {
    "bert.embed": Embed,
    "bert.gather_add": GatherAdd,
    "bert.gelu_ffn": GeluFfn,
    "bert.self_attention": lambda spec, prefix="attention": BertSelfAttention(spec, prefix),
    "bert.encoder_layer": BertEncoderLayer,
    "bert.nomic_encoder_layer": NomicEncoderLayer,
    "bert.nomic_mlp": NomicMlp,
    "bert.mean_pool": MeanPool,
    "bert.cls_pool": ClsPool,
    "bert.max_pool": MaxPool,
    "bert.l2_normalize": L2Normalize,
}
