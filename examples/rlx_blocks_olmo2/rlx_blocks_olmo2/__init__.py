"""OLMo 2 for RLX (HF `model_type` "olmo2", transformers' Olmo2ForCausalLM), written the way a
third party writes a family: only rlx_core's public API, found through the entry point `olmo2`
in the group `rlx` (pyproject.toml), no file of the core touched.

What OLMo 2 changes against a LLaMA decoder layer, and where it is built here:

* no pre-norms: each sub-block's output is normed, then added to the residual
  (`olmo2_layer`: generic `rms_norm` / `residual_*` / `gated_hf_mlp` blocks);
* QK-norm over the whole q and k projections (an RMSNorm of width heads * head_dim, before the
  split into heads; Qwen3 norms each head): `Olmo2Attention`, the core `SelfAttention` with
  its `project_qkv` hook overridden.

The rest (SwiGLU MLP, RoPE, GQA, KV cache, the LM head) is the core's generic blocks.
"""
from __future__ import annotations

import attrs
import numpy as np

from rlx_core.flow import AttnSpec, ModelFlow, SelfAttention
from rlx_core.flow.recipe import DecoderFlow
from rlx_core.flow.rope import rope_params
from rlx_core.ir.errors import ModelError
from rlx_core.plugins import hookimpl
from rlx_core.runtime.model import DecoderRecipe
from rlx_core.weights.config import check_config, config_source, hf_activation

from .gguf import rlx_register_gguf_architectures  # noqa: F401

REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


@attrs.frozen
class Olmo2Attention(SelfAttention):
    """Self-attention whose q and k projections are RMS-normed whole (`q_norm.weight` of width
    heads * head_dim, `k_norm.weight` of kv_heads * head_dim, eps `spec.qk_norm_eps`), then
    split into heads; RoPE, the mask, the KV cache and o_proj are the core block's."""

    def heads_of(self, ctx, x, name: str, heads: int, normed: bool):
        """Projection `name` of x [B,S,hidden] as [B,heads,S,head_dim], RMS-normed first if `normed`."""
        s, m = self.spec, ctx.m
        width = heads * s.head_dim
        p = ctx.key(f"{s.prefix}.{name}")
        w = ctx.param(f"{p}_proj.weight", (width, s.hidden))
        b = ctx.param(f"{p}_proj.bias", (width,)) if s.bias else None
        y = m.linear(x, w, b)
        if normed:
            y = m.rms_norm(y, ctx.param(f"{p}_norm.weight", (width,)), eps=s.qk_norm_eps)
        return m.transpose(m.reshape(y, (x.dims[0], x.dims[1], heads, s.head_dim)), (0, 2, 1, 3))

    def project_qkv(self, ctx, x) -> tuple:
        s = self.spec
        if s.heads % s.kv_heads:
            raise ModelError(f"layer {ctx.prefix}: {s.heads} heads is not a multiple of "
                             f"{s.kv_heads} kv heads")
        return (self.heads_of(ctx, x, "q", s.heads, True), self.heads_of(ctx, x, "k", s.kv_heads, True),
                self.heads_of(ctx, x, "v", s.kv_heads, False))


def olmo2_layer(spec: AttnSpec, eps: float, act: str = "silu", flow: ModelFlow | None = None) -> ModelFlow:
    """One OLMo 2 decoder layer: x + norm(attn(x)), then h + norm(mlp(h)) (post-norms only)."""
    f = flow or ModelFlow()
    return (f.residual_save().raw_stage(Olmo2Attention(spec))
            .rms_norm("post_attention_layernorm.weight", eps).residual_add()
            .residual_save().gated_hf_mlp("mlp", act)
            .rms_norm("post_feedforward_layernorm.weight", eps).residual_add())


def attn_spec(cfg: dict, mode: str = "prefill") -> AttnSpec:
    """The attention of an OLMo 2 config (HF field names; every layer is alike)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = rope_params(cfg)
    bias = bool(cfg.get("attention_bias", False))
    return AttnSpec(heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                    head_dim=cfg.get("head_dim") or hidden // heads, hidden=hidden,
                    rope_theta=theta, rope_scaling=scaling,
                    max_positions=int(cfg.get("max_position_embeddings") or 4096),
                    qk_norm_eps=rms_eps(cfg), bias=bias, o_bias=bias, mode=mode)


def rms_eps(cfg: dict) -> float:
    """Every RMSNorm's eps (Olmo2Config's default: 1e-6, which checkpoints spell out)."""
    return float(cfg.get("rms_norm_eps") or 1e-6)


class Olmo2Flow(DecoderFlow):
    """Recipe flow: the prefill / decode / logits / train graphs of an OLMo 2 config."""
    family = "olmo2"
    profile_family = "llama32"         # the core's presets for a dense GQA + SwiGLU decoder

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        check_config(cfg, config_source(cfg), ModelError, required=REQUIRED)
        super().__init__(cfg, mode, batch, seq)

    def spec(self, i: int = 0) -> AttnSpec:
        return attn_spec(self.cfg, "decode" if self.mode == "decode" else "prefill")

    def default_layer(self, i: int) -> ModelFlow:
        act = hf_activation(self.cfg, "hidden_act", default="silu")
        return olmo2_layer(self.spec(i), rms_eps(self.cfg), act)

    def head(self, f: ModelFlow) -> ModelFlow:
        c = self.cfg
        f.final_norm(rms_eps(c))
        if self._last:
            f.gather_last_token()
        return f.lm_head(c["vocab_size"], c["hidden_size"], tied=bool(c.get("tie_word_embeddings", False)))


class Olmo2Recipe(DecoderRecipe):
    """Registered recipe: an `olmo2` checkpoint (HF folder, or GGUF) -> CausalLM (core's
    DecoderRecipe builds it: the flow class is all a decoder family supplies)."""
    name = "olmo2"
    model_types = ("olmo2",)
    flow_class = Olmo2Flow
    default_context = 4096

    # -- the conformance kit's tiny model (rlx_core.testing.recipes)
    def tiny_config(self) -> dict:
        """GQA 2, untied embeddings (as OLMo 2's checkpoints), two layers."""
        return dict(model_type="olmo2", vocab_size=61, hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=48, num_hidden_layers=2,
                    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500000.0,
                    tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random HF-named tensors for `cfg` (norm weights around 1)."""
        return {k: (0.2 * rng.standard_normal(s) + (1.0 if "norm" in k else 0.0)).astype(np.float32)
                for k, s in tensor_shapes(cfg).items()}


def tensor_shapes(cfg: dict) -> dict:
    """HF name -> shape of every tensor of an OLMo 2 checkpoint of config `cfg`."""
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv, d = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    layer = {"self_attn.q_proj.weight": (heads * d, h), "self_attn.k_proj.weight": (kv * d, h),
             "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, heads * d),
             "self_attn.q_norm.weight": (heads * d,), "self_attn.k_norm.weight": (kv * d,),
             "post_attention_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter)}
    if cfg.get("attention_bias"):
        layer.update({f"self_attn.{n}_proj.bias": (s[0],) for n, s in
                      (("q", (heads * d,)), ("k", (kv * d,)), ("v", (kv * d,)), ("o", (h,)))})
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return shapes


@hookimpl
def rlx_register_recipes(register):
    register(Olmo2Recipe())


@hookimpl
def rlx_register_blocks(register):
    register("olmo2.attention", lambda **kw: Olmo2Attention(AttnSpec(**kw)))
    register("olmo2.decoder_layer", olmo2_layer)


__all__ = ["Olmo2Attention", "Olmo2Flow", "Olmo2Recipe", "attn_spec", "olmo2_layer", "tensor_shapes"]
