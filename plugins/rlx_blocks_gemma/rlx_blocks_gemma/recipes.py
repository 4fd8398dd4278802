"""Gemma2Flow / Gemma3Flow recipes and the registered recipes that build runtime models.

A recipe class builds the flow of one mode:

* `logits`  every position's logits (no cache);
* `prefill` the last position's logits, and the KV cache written from cache column 0;
* `decode`  one token per row at cache column `cache_pos`, reading the cache.

Inputs (the core's `CausalLM` contract): `ids` [batch, seq] i64, `positions` [batch, seq]
i64 (RoPE positions), `key_mask` [batch, 1, 1, seq | ctx] bool (which cache columns are
real tokens), `cache_pos` [batch] i32 (prefill/decode).
"""
from __future__ import annotations

import math

import numpy as np

from rlx_core.flow import AttnSpec, ModelFlow
from rlx_core.flow.recipe import DecoderFlow, LayerCtx
from rlx_core.ir.errors import ModelError
from rlx_core.runtime.model import CausalLM

from .blocks import GemmaDecoderLayer, GemmaRmsNorm
from .config import GemmaArch, gemma_arch, text_config


def attn_spec(arch: GemmaArch, i: int, mode: str = "prefill", kv_taps: bool = False) -> AttnSpec:
    """The attention spec of layer `i`: its layer type's window and RoPE."""
    sliding = arch.is_sliding(i)
    theta, scaling = arch.rope[arch.layer_types[i]]
    return AttnSpec(
        heads=arch.heads, kv_heads=arch.kv_heads, head_dim=arch.head_dim, hidden=arch.hidden,
        rope_theta=theta, rope_scaling=scaling, max_positions=arch.max_positions,
        qk_norm_eps=arch.eps if arch.qk_norm else None, qk_norm_offset=1.0,
        scale=arch.scale, softcap=arch.attn_softcap, window=arch.window if sliding else 0,
        mode="decode" if mode == "decode" else "prefill", kv_taps=kv_taps)


class GemmaLayerCtx(LayerCtx):
    """LayerCtx plus the layer's type (sliding_attention / full_attention)."""

    def __init__(self, recipe: "GemmaFlow", i: int):
        super().__init__(recipe, i)
        self.layer_type = recipe.arch.layer_types[i]


class GemmaFlow(DecoderFlow):
    """Recipe: the logits / prefill / decode flow of a Gemma 2 or Gemma 3 config.

        Gemma3Flow.for_decode(cfg).ring_cache(False).kv_taps().flow().build(weights)
    """
    family = "gemma"
    profile_family = "gemma"
    layer_ctx = GemmaLayerCtx

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        cfg = text_config(cfg)
        self.arch = gemma_arch(cfg)
        if self.family != "gemma" and self.arch.family != self.family:
            raise ModelError(f"{type(self).__name__} builds {self.family} configs, got model_type "
                             f"{cfg.get('model_type')!r}; use {self.arch.family.title()}Flow")
        super().__init__(cfg, mode, batch, seq)
        self._kv_taps = False
        self._ring = True

    def kv_taps(self, on: bool = True) -> "GemmaFlow":
        """Expose every layer's new K/V (after QK-norm and RoPE) as `present.<i>.k|v`
        [batch, kv_heads, seq, head_dim]."""
        self._kv_taps = on
        return self

    def ring_cache(self, on: bool = True) -> "GemmaFlow":
        """Sliding layers keep `window` cache slots (default); off: a full-length cache
        masked by the window, like the global layers."""
        self._ring = on
        return self

    # -- building
    def spec(self, i: int) -> AttnSpec:
        return attn_spec(self.arch, i, self.mode, self._kv_taps)

    def default_layer(self, i: int):
        return GemmaDecoderLayer(self.spec(i), self.arch.eps, self.arch.act, self._ring)

    def num_layers(self) -> int:
        return self.arch.layers

    def embed(self, f: ModelFlow) -> ModelFlow:
        return f.token_embed(scale=math.sqrt(self.arch.hidden))

    def head(self, f: ModelFlow) -> ModelFlow:
        a = self.arch
        f.raw_stage(GemmaRmsNorm("model.norm.weight", a.eps, absolute=True))
        if self._last:
            f.gather_last_token()
        return f.lm_head(a.vocab, a.hidden, tied=a.tied, softcap=a.final_softcap)

    def build(self, weights, **kw):
        return self.flow().build(weights, self.cfg, ignore_unused=GemmaRecipe.ignore_unused, **kw)


class Gemma2Flow(GemmaFlow):
    """Gemma 2: softcapped attention logits and final logits, sliding window on even layers."""
    family = "gemma2"


class Gemma3Flow(GemmaFlow):
    """Gemma 3 (text): QK-norm, per-layer-type RoPE bases, 5:1 local/global layers."""
    family = "gemma3"


# ------------------------------------------------------------------------------- runtime
class GemmaLM(CausalLM):
    """CausalLM with a clearer error for chat prompts on a base model (no chat template)."""

    def encode_prompt(self, text: str, chat: bool = False) -> list:
        if chat and self.tokenizer is not None and not getattr(self.tokenizer, "chat_template", None):
            raise ModelError(f"{self.source}: --chat needs a chat template, and this model has none "
                             "(a base/pretrained Gemma, not an instruction-tuned one); run it "
                             "without --chat, on plain text")
        return super().encode_prompt(text, chat)


_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                    "model.multi_modal_projector.")


def text_tensors(tensors: dict) -> dict:
    """A multimodal Gemma 3 checkpoint's language-model tensors under Gemma3ForCausalLM's
    names (the vision tower and projector are dropped); other checkpoints unchanged."""
    if not any(k.startswith(p) for k in tensors for p, _ in _TEXT_PREFIXES):
        return dict(tensors)
    out = {}
    for k, v in tensors.items():
        if k.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out[k] = v
    return out


class GemmaRecipe:
    """Registered recipe: checkpoint -> GemmaLM (Gemma 2 and Gemma 3 text)."""
    name = "gemma"
    model_types: tuple = ()
    flow_class = GemmaFlow
    default_profile = "gemma_prefill"
    ignore_unused = ("rotary_emb.inv_freq",)

    def __init__(self, ring: bool = True):
        self.ring = ring          # False: sliding layers keep a full-length cache masked by the window

    def flow(self, cfg: dict, mode: str, taps: bool = False) -> ModelFlow:
        return self.flow_class(cfg, mode).taps(taps).ring_cache(self.ring).flow()

    def build(self, ckpt, backend=None, profile=None, **kw):
        cfg = text_config(ckpt.config)
        gemma_arch(cfg)                          # a bad config fails here, before any compile
        tensors = text_tensors(ckpt.tensors)
        if cfg.get("tie_word_embeddings", True) and "lm_head.weight" in tensors:
            tensors.pop("lm_head.weight")
        return GemmaLM(self, cfg, tensors, ckpt.tokenizer, backend, profile, source=ckpt.path, **kw)

    # -- the conformance kit's tiny model (rlx_core.testing.recipes)
    TINY = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                sliding_window=4, query_pre_attn_scalar=8, pad_token_id=0, eos_token_id=1)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random HF-named tensors for `cfg` (Gemma's norms hold w of (1 + w): around 0)."""
        a = gemma_arch(cfg)
        h, d = a.hidden, a.head_dim
        shapes = {"model.embed_tokens.weight": (a.vocab, h), "model.norm.weight": (h,)}
        if not a.tied:
            shapes["lm_head.weight"] = (a.vocab, h)
        layer = {"self_attn.q_proj.weight": (a.heads * d, h), "self_attn.k_proj.weight": (a.kv_heads * d, h),
                 "self_attn.v_proj.weight": (a.kv_heads * d, h), "self_attn.o_proj.weight": (h, a.heads * d),
                 "mlp.gate_proj.weight": (a.intermediate, h), "mlp.up_proj.weight": (a.intermediate, h),
                 "mlp.down_proj.weight": (h, a.intermediate)}
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        layer.update({f"{n}.weight": (h,) for n in norms})
        if a.qk_norm:
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        for i in range(a.layers):
            shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
        return {k: (0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


class Gemma2Recipe(GemmaRecipe):
    name = "gemma2"
    model_types = ("gemma2",)
    flow_class = Gemma2Flow

    def tiny_config(self) -> dict:
        """Sliding window on the first layer, attention and final softcaps that bite, tied."""
        return dict(self.TINY, model_type="gemma2", attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                    tie_word_embeddings=True)


class Gemma3Recipe(GemmaRecipe):
    # "gemma3" is both the multimodal HF model_type and the GGUF general.architecture
    name = "gemma3"
    model_types = ("gemma3_text", "gemma3")
    flow_class = Gemma3Flow

    def tiny_config(self) -> dict:
        """QK-norm, a local and a global layer with their own RoPE bases, untied."""
        return dict(self.TINY, model_type="gemma3_text", sliding_window_pattern=2, tie_word_embeddings=False,
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})


__all__ = ["GemmaFlow", "Gemma2Flow", "Gemma3Flow", "GemmaLM", "GemmaRecipe", "Gemma2Recipe",
           "Gemma3Recipe", "LayerCtx", "attn_spec", "text_tensors"]
