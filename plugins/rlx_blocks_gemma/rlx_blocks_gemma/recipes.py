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
from typing import Callable

from rlx_core.flow import AttnSpec, ModelFlow
from rlx_core.ir.dtype import BOOL, I32, I64
from rlx_core.ir.errors import ModelError
from rlx_core.pipeline import Executable
from rlx_core.profile import CompileProfile
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


class LayerCtx:
    """What `.layer(fn)` hands `fn`: the layer index, its spec and layer type, the config,
    a fresh flow, and the default stage (to wrap or replace)."""

    def __init__(self, recipe: "GemmaFlow", i: int):
        self._recipe, self._i = recipe, i
        self.spec = recipe.spec(i)
        self.layer_type = recipe.arch.layer_types[i]
        self.config = recipe.cfg
        self.flow = ModelFlow(recipe.name)

    def index(self) -> int:
        return self._i

    def default_stage(self):
        return self._recipe.default_layer(self._i)


class GemmaFlow:
    """Recipe: the logits / prefill / decode flow of a Gemma 2 or Gemma 3 config.

        Gemma3Flow.for_decode(cfg).ring_cache(False).kv_taps().flow().build(weights)
    """
    family = "gemma"

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        if mode not in ("prefill", "decode", "logits"):
            raise ModelError(f"mode must be prefill, decode or logits, got {mode!r}")
        self.cfg = text_config(cfg)
        self.arch = gemma_arch(self.cfg)
        if self.family != "gemma" and self.arch.family != self.family:
            raise ModelError(f"{type(self).__name__} builds {self.family} configs, got model_type "
                             f"{self.cfg.get('model_type')!r}; use {self.arch.family.title()}Flow")
        self.mode, self.batch = mode, batch
        self.seq = 1 if mode == "decode" else seq
        self.name = f"{self.cfg.get('model_type', self.arch.family)}_{mode}"
        self._last = mode != "logits"
        self._layer: Callable | None = None
        self._before: list = []
        self._after: list = []
        self._patches: list = []
        self._profile = CompileProfile.preset(f"gemma_{'decode' if mode == 'decode' else 'prefill'}")
        self._taps = False
        self._kv_taps = False
        self._ring = True

    @classmethod
    def for_prefill(cls, cfg: dict, batch="batch", seq="seq") -> "GemmaFlow":
        return cls(cfg, "prefill", batch, seq)

    @classmethod
    def for_decode(cls, cfg: dict, batch="batch") -> "GemmaFlow":
        return cls(cfg, "decode", batch)

    @classmethod
    def for_logits(cls, cfg: dict, batch="batch", seq="seq") -> "GemmaFlow":
        return cls(cfg, "logits", batch, seq)

    # -- hooks (the same as the LLaMA recipes')
    def last_token_logits(self, on: bool = True) -> "GemmaFlow":
        self._last = on
        return self

    def layer(self, fn: Callable[[LayerCtx], object]) -> "GemmaFlow":
        """Override each layer: `fn(ctx)` returns a flow or stage (ctx.default_stage() is the default)."""
        self._layer = fn
        return self

    def before_layers(self, fn: Callable[[ModelFlow], ModelFlow]) -> "GemmaFlow":
        self._before.append(fn)
        return self

    def after_layers(self, fn: Callable[[ModelFlow], ModelFlow]) -> "GemmaFlow":
        self._after.append(fn)
        return self

    def patch_flow(self, fn: Callable[[ModelFlow], ModelFlow]) -> "GemmaFlow":
        self._patches.append(fn)
        return self

    def taps(self, on: bool = True) -> "GemmaFlow":
        """Expose every layer's output as `layer.<i>`."""
        self._taps = on
        return self

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

    def profile_near(self, path) -> "GemmaFlow":
        from rlx_core.runtime.model import resolve_profile

        self._profile = resolve_profile(None, self._profile.name, str(path))
        return self

    # -- building
    def spec(self, i: int) -> AttnSpec:
        return attn_spec(self.arch, i, self.mode, self._kv_taps)

    def default_layer(self, i: int):
        return GemmaDecoderLayer(self.spec(i), self.arch.eps, self.arch.act, self._ring)

    def flow(self) -> ModelFlow:
        a = self.arch
        f = ModelFlow(self.name).profile(self._profile)
        f.input("ids", (self.batch, self.seq), I64).input("positions", (self.batch, self.seq), I64)
        f.input("key_mask", (self.batch, 1, 1, "ctx" if self.mode == "decode" else self.seq), BOOL)
        if self.mode != "logits":
            f.input("cache_pos", (self.batch,), I32)
        f.token_embed(scale=math.sqrt(a.hidden))
        for fn in self._before:
            f = fn(f) or f
        for i in range(a.layers):
            body = self._layer(LayerCtx(self, i)) if self._layer else self.default_layer(i)
            f.layer(i, lambda s, body=body: s.sequence(body) if isinstance(body, ModelFlow)
                    else s.raw_stage(body))
            if self._taps:
                f.output(f"layer.{i}")
        for fn in self._after:
            f = fn(f) or f
        f.raw_stage(GemmaRmsNorm("model.norm.weight", a.eps, absolute=True))
        if self._last:
            f.gather_last_token()
        f.lm_head(a.vocab, a.hidden, tied=a.tied, softcap=a.final_softcap)
        for fn in self._patches:
            f = fn(f) or f
        return f

    def build(self, weights, **kw):
        return self.flow().build(weights, self.cfg, ignore_unused=GemmaRecipe.ignore_unused, **kw)


class Gemma2Flow(GemmaFlow):
    """Gemma 2: softcapped attention logits and final logits, sliding window on even layers."""
    family = "gemma2"


class Gemma3Flow(GemmaFlow):
    """Gemma 3 (text): QK-norm, per-layer-type RoPE bases, 5:1 local/global layers."""
    family = "gemma3"


# ------------------------------------------------------------------------------- runtime
class _StateCheckedExecutable(Executable):
    """Works around a core issue: `Executable.runner` caches one runner per bound dims, and
    a runner binds the state arrays it found; when another executable sharing the
    StateStore reallocates a state (a new batch size or context bucket), a cached runner
    keeps the old array, so a prefill and the decode after it can use different caches.
    Here a cached runner whose state arrays are no longer the store's is rebuilt."""

    def runner(self, env: dict):
        key = tuple(sorted(env.items()))
        bound = self._state_bound.get(key)
        if bound is not None and any(self.states.get(n) is not a for n, a in bound.items()):
            self._runners.pop(key, None)
        r = super().runner(env)
        self._state_bound[key] = {n: self.states[n] for n in self.mir.states}
        return r


class GemmaLM(CausalLM):
    """CausalLM with a clearer error for chat prompts on a base model (no chat template)."""

    def executable(self, mode: str, taps: bool = False):
        exe = super().executable(mode, taps)
        if type(exe) is Executable and hasattr(exe, "_runners"):
            exe.__class__ = _StateCheckedExecutable
            exe._state_bound = {}
        return exe

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


class Gemma2Recipe(GemmaRecipe):
    name = "gemma2"
    model_types = ("gemma2",)
    flow_class = Gemma2Flow


class Gemma3Recipe(GemmaRecipe):
    # "gemma3" is both the multimodal HF model_type and the GGUF general.architecture
    name = "gemma3"
    model_types = ("gemma3_text", "gemma3")
    flow_class = Gemma3Flow


__all__ = ["GemmaFlow", "Gemma2Flow", "Gemma3Flow", "GemmaLM", "GemmaRecipe", "Gemma2Recipe",
           "Gemma3Recipe", "LayerCtx", "attn_spec", "text_tensors"]
