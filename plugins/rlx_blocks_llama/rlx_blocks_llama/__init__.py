"""LLaMA / Qwen3 for RLX: blocks (composed and fused decoder layers) and the recipes
Llama32Flow and Qwen3Flow, registered through the rlx plugin hooks."""
from __future__ import annotations

from typing import Callable

import attrs

from rlx_core.flow import AttnSpec, ModelFlow, SelfAttention
from rlx_core.flow.rope import rope_params
from rlx_core.ir.dtype import BOOL, I32, I64
from rlx_core.ir.errors import ModelError
from rlx_core.plugins import hookimpl
from rlx_core.profile import CompileProfile


def attn_spec(cfg: dict, mode: str = "prefill", qk_norm: bool = False) -> AttnSpec:
    """The attention spec of a LLaMA-family config (HF field names)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = rope_params(cfg)
    return AttnSpec(
        heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, hidden=hidden,
        rope_theta=theta, rope_scaling=scaling,
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        qk_norm_eps=cfg.get("rms_norm_eps", 1e-6) if qk_norm else None,
        bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
        mode=mode)


def llama_prefill_layer_composed(i: int, spec: AttnSpec, eps: float, flow: ModelFlow | None = None) -> ModelFlow:
    """A decoder layer from small blocks."""
    f = flow or ModelFlow()
    return (f.residual_save().rms_norm("input_layernorm.weight", eps)
            .raw_stage(SelfAttention(spec)).residual_add()
            .residual_save().rms_norm("post_attention_layernorm.weight", eps)
            .swiglu_hf_mlp("mlp").residual_add())


@attrs.frozen
class LlamaLayerFused:
    """The same decoder layer as one stage that emits fused ops itself (residual+RMSNorm)."""
    spec: AttnSpec
    eps: float

    def emit(self, ctx, x):
        m, d = ctx.m, x.dims[-1]
        h = m.rms_norm(x, ctx.param(ctx.key("input_layernorm.weight"), (d,)), eps=self.eps)
        a = SelfAttention(self.spec).emit(ctx, h)
        x2, h2 = m.add("fused_residual_rms_norm",
                       (a, x, ctx.param(ctx.key("post_attention_layernorm.weight"), (d,))), eps=self.eps)
        inter = ctx.cfg("intermediate_size")
        w = [ctx.param(ctx.key(f"mlp.{n}_proj.weight"), s) for n, s in
             (("gate", (inter, d)), ("up", (inter, d)), ("down", (d, inter)))]
        return m.swiglu(h2, *w) + x2


def llama_prefill_layer_fused(i: int, spec: AttnSpec, eps: float) -> LlamaLayerFused:
    return LlamaLayerFused(spec, eps)


class LayerCtx:
    """What `.layer(lambda ctx: ...)` receives: the layer index, the spec, a fresh flow and
    the default stage, so an override can wrap or replace it."""

    def __init__(self, recipe: "Llama32Flow", i: int):
        self._recipe, self._i = recipe, i
        self.spec = recipe.spec()
        self.config = recipe.cfg
        self.flow = ModelFlow(recipe.name)

    def index(self) -> int:
        return self._i

    def default_stage(self) -> ModelFlow:
        return self._recipe.default_layer(self._i)


class Llama32Flow:
    """Recipe: builds the prefill / decode / full-logits flow of a LLaMA-family config."""
    family = "llama32"
    qk_norm = False

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        if mode not in ("prefill", "decode", "logits"):
            raise ModelError(f"mode must be prefill, decode or logits, got {mode!r}")
        if cfg.get("mlp_bias"):
            raise ModelError("LLaMA configs with mlp_bias=true are not supported")
        self.cfg, self.mode, self.batch = dict(cfg), mode, batch
        self.seq = 1 if mode == "decode" else seq
        self.name = f"{cfg.get('model_type', self.family)}_{mode}"
        self._last = mode != "logits"
        self._layer: Callable | None = None
        self._before: list = []
        self._after: list = []
        self._patches: list = []
        self._profile = CompileProfile.preset(f"{self.family}_{'decode' if mode == 'decode' else 'prefill'}")
        self._taps = False
        self._fused = False

    @classmethod
    def for_prefill(cls, cfg: dict, batch="batch", seq="seq") -> "Llama32Flow":
        return cls(cfg, "prefill", batch, seq)

    @classmethod
    def for_decode(cls, cfg: dict, batch="batch") -> "Llama32Flow":
        return cls(cfg, "decode", batch)

    @classmethod
    def for_logits(cls, cfg: dict, batch="batch", seq="seq") -> "Llama32Flow":
        return cls(cfg, "logits", batch, seq)

    # -- hooks
    def last_token_logits(self, on: bool = True) -> "Llama32Flow":
        self._last = on
        return self

    def layer(self, fn: Callable[[LayerCtx], object]) -> "Llama32Flow":
        """Override each layer: `fn(ctx)` returns a flow or stage (ctx.default_stage() is the default)."""
        self._layer = fn
        return self

    def before_layers(self, fn: Callable[[ModelFlow], ModelFlow]) -> "Llama32Flow":
        self._before.append(fn)
        return self

    def after_layers(self, fn: Callable[[ModelFlow], ModelFlow]) -> "Llama32Flow":
        self._after.append(fn)
        return self

    def patch_flow(self, fn: Callable[[ModelFlow], ModelFlow]) -> "Llama32Flow":
        self._patches.append(fn)
        return self

    def fused_layers(self, on: bool = True) -> "Llama32Flow":
        self._fused = on
        return self

    def taps(self, on: bool = True) -> "Llama32Flow":
        """Expose every layer's output as `layer.<i>` (finding the first non-finite layer)."""
        self._taps = on
        return self

    def profile_near(self, path) -> "Llama32Flow":
        from rlx_core.runtime.model import resolve_profile

        self._profile = resolve_profile(None, self._profile.name, str(path))
        return self

    # -- building
    def spec(self) -> AttnSpec:
        return attn_spec(self.cfg, "decode" if self.mode == "decode" else "prefill", self.qk_norm)

    @property
    def eps(self) -> float:
        return float(self.cfg.get("rms_norm_eps", 1e-6))

    def default_layer(self, i: int):
        if self._fused:
            return llama_prefill_layer_fused(i, self.spec(), self.eps)
        return llama_prefill_layer_composed(i, self.spec(), self.eps)

    def flow(self) -> ModelFlow:
        c = self.cfg
        f = ModelFlow(self.name).profile(self._profile)
        seq = self.seq
        f.input("ids", (self.batch, seq), I64).input("positions", (self.batch, seq), I64)
        f.input("key_mask", (self.batch, 1, 1, "ctx" if self.mode == "decode" else seq), BOOL)
        if self.mode != "logits":
            f.input("cache_pos", (self.batch,), I32)
        f.token_embed()
        for fn in self._before:
            f = fn(f) or f
        for i in range(int(c["num_hidden_layers"])):
            body = self._layer(LayerCtx(self, i)) if self._layer else self.default_layer(i)
            f.layer(i, lambda s, body=body: s.raw_stage(body) if not isinstance(body, ModelFlow)
                    else s.sequence(body))
            if self._taps:
                f.output(f"layer.{i}")
        for fn in self._after:
            f = fn(f) or f
        f.final_norm(self.eps)
        if self._last:
            f.gather_last_token()
        f.lm_head(c["vocab_size"], c["hidden_size"], tied=bool(c.get("tie_word_embeddings", False)))
        for fn in self._patches:
            f = fn(f) or f
        return f

    def build(self, weights, **kw):
        return self.flow().build(weights, self.cfg, ignore_unused=LlamaRecipe.ignore_unused, **kw)


class Qwen3Flow(Llama32Flow):
    family = "qwen3"
    qk_norm = True


class LlamaRecipe:
    """Registered recipe: checkpoint config -> CausalLM."""
    name = "llama"
    model_types = ("llama", "mistral")
    flow_class = Llama32Flow
    default_profile = "llama32_prefill"
    ignore_unused = ("rotary_emb.inv_freq",)

    def flow(self, cfg: dict, mode: str, taps: bool = False) -> ModelFlow:
        return self.flow_class(cfg, mode).taps(taps).flow()

    def build(self, ckpt, backend=None, profile=None, **kw):
        from rlx_core.runtime.model import CausalLM

        cfg = dict(ckpt.config)
        tensors = dict(ckpt.tensors)
        if cfg.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            tensors.pop("lm_head.weight")
        return CausalLM(self, cfg, tensors, ckpt.tokenizer, backend, profile, source=ckpt.path, **kw)


class Qwen3Recipe(LlamaRecipe):
    name = "qwen3"
    model_types = ("qwen3",)
    flow_class = Qwen3Flow
    default_profile = "qwen3_prefill"


@hookimpl
def rlx_register_recipes(register):
    register(LlamaRecipe())
    register(Qwen3Recipe())


@hookimpl
def rlx_register_blocks(register):
    register("llama_layer", lambda i, spec, eps=1e-6: llama_prefill_layer_composed(i, spec, eps))
    register("llama_layer_fused", lambda i, spec, eps=1e-6: llama_prefill_layer_fused(i, spec, eps))


__all__ = ["Llama32Flow", "Qwen3Flow", "LlamaRecipe", "Qwen3Recipe", "attn_spec", "LayerCtx",
           "llama_prefill_layer_composed", "llama_prefill_layer_fused", "LlamaLayerFused"]
