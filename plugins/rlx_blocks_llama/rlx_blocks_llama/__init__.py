"""LLaMA / Qwen3 for RLX: blocks (composed and fused decoder layers) and the recipes
Llama32Flow and Qwen3Flow, registered through the rlx plugin hooks."""
from __future__ import annotations

import attrs
import numpy as np

from rlx_core.flow import AttnSpec, ModelFlow, SelfAttention
from rlx_core.flow.blocks import gated_mlp
from rlx_core.flow.recipe import DecoderFlow, LayerCtx
from rlx_core.flow.rope import rope_params
from rlx_core.ir.errors import ModelError
from rlx_core.plugins import hookimpl
from rlx_core.runtime.model import DecoderRecipe
from rlx_core.weights.config import check_config, config_source, hf_activation

from .gguf import rlx_register_gguf_architectures  # noqa: F401
from .packaged import rlx_register_packaged_models  # noqa: F401


def sliding_window(cfg: dict, i: int) -> int:
    """Layer i's attention window (0: global) as transformers reads the config: Mistral slides
    every layer by `sliding_window`; Qwen3 only with `use_sliding_window`, on the layers
    `layer_types` marks (default: from `max_window_layers` on); LLaMA has no window."""
    window = cfg.get("sliding_window") or 0
    mt = cfg.get("model_type")
    if mt == "mistral":
        return window
    if mt != "qwen3" or not cfg.get("use_sliding_window") or not window:
        return 0
    types = cfg.get("layer_types")
    if types:
        n = cfg["num_hidden_layers"]
        if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelError(f"{config_source(cfg)}: layer_types must list 'sliding_attention' or "
                             f"'full_attention' for each of {n} layers, got {types!r}")
        return window if types[i] == "sliding_attention" else 0
    first = cfg.get("max_window_layers")
    return window if i >= (28 if first is None else first) else 0      # Qwen3Config's default: 28


def attn_spec(cfg: dict, mode: str = "prefill", qk_norm: bool = False, i: int = 0) -> AttnSpec:
    """The attention spec of layer i of a LLaMA-family config (HF field names)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = rope_params(cfg)
    return AttnSpec(
        heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, hidden=hidden,
        rope_theta=theta, rope_scaling=scaling,
        max_positions=int(cfg.get("max_position_embeddings") or 2048),     # null reads as absent
        qk_norm_eps=(cfg.get("rms_norm_eps") or 1e-6) if qk_norm else None,
        bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
        window=sliding_window(cfg, i), mode=mode)


def llama_prefill_layer_composed(i: int, spec: AttnSpec, eps: float, flow: ModelFlow | None = None,
                                 act: str = "silu") -> ModelFlow:
    """A decoder layer from small blocks; `act`: the MLP's gate activation (IR name)."""
    f = flow or ModelFlow()
    return (f.residual_save().rms_norm("input_layernorm.weight", eps)
            .raw_stage(SelfAttention(spec)).residual_add()
            .residual_save().rms_norm("post_attention_layernorm.weight", eps)
            .gated_hf_mlp("mlp", act).residual_add())


@attrs.frozen
class LlamaLayerFused:
    """The same decoder layer as one stage that emits fused ops itself (residual+RMSNorm)."""
    spec: AttnSpec
    eps: float
    act: str = "silu"

    def emit(self, ctx, x):
        m, d = ctx.m, x.dims[-1]
        h = m.rms_norm(x, ctx.param(ctx.key("input_layernorm.weight"), (d,)), eps=self.eps)
        a = ctx.emit(SelfAttention(self.spec), h)
        x2, h2 = m.add("fused_residual_rms_norm",
                       (a, x, ctx.param(ctx.key("post_attention_layernorm.weight"), (d,))), eps=self.eps)
        inter = ctx.cfg("intermediate_size")
        w = [ctx.param(ctx.key(f"mlp.{n}_proj.weight"), s) for n, s in
             (("gate", (inter, d)), ("up", (inter, d)), ("down", (d, inter)))]
        return gated_mlp(m, h2, *w, self.act) + x2


def llama_prefill_layer_fused(i: int, spec: AttnSpec, eps: float, act: str = "silu") -> LlamaLayerFused:
    return LlamaLayerFused(spec, eps, act)


class Llama32Flow(DecoderFlow):
    """Recipe: the prefill / decode / full-logits flow of a LLaMA-family config."""
    family = "llama32"
    qk_norm = False

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        check_config(cfg, config_source(cfg), ModelError, required=(
            "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"))
        if cfg.get("mlp_bias"):
            raise ModelError(f"{config_source(cfg)}: mlp_bias=true (biases on the MLP projections) is not "
                             "supported; expected false or absent")
        super().__init__(cfg, mode, batch, seq)
        self._fused = False

    def fused_layers(self, on: bool = True) -> "Llama32Flow":
        """Emit each layer as one fused stage instead of small blocks (same outputs)."""
        self._fused = on
        return self

    def spec(self, i: int = 0) -> AttnSpec:
        return attn_spec(self.cfg, "decode" if self.mode == "decode" else "prefill", self.qk_norm, i)

    @property
    def eps(self) -> float:
        return float(self.cfg.get("rms_norm_eps") or 1e-6)

    @property
    def act(self) -> str:
        """The MLP's activation: `hidden_act` (transformers' default silu)."""
        return hf_activation(self.cfg, "hidden_act", default="silu")

    def default_layer(self, i: int):
        if self._fused:
            return llama_prefill_layer_fused(i, self.spec(i), self.eps, self.act)
        return llama_prefill_layer_composed(i, self.spec(i), self.eps, act=self.act)

    def head(self, f: ModelFlow) -> ModelFlow:
        c = self.cfg
        f.final_norm(self.eps)
        if self._last:
            f.gather_last_token()
        return f.lm_head(c["vocab_size"], c["hidden_size"], tied=bool(c.get("tie_word_embeddings", False)))

    def build(self, weights, **kw):
        return self.flow().build(weights, self.cfg, ignore_unused=LlamaRecipe.ignore_unused, **kw)


class Qwen3Flow(Llama32Flow):
    family = "qwen3"
    qk_norm = True


class LlamaRecipe(DecoderRecipe):
    """Registered recipe: checkpoint config -> CausalLM."""
    name = "llama"
    model_types = ("llama", "mistral")
    flow_class = Llama32Flow

    # -- the conformance kit's tiny model (rlx_core.testing.recipes)
    def tiny_config(self) -> dict:
        """A small config of this model type: GQA 2, tied embeddings, two layers."""
        return dict(model_type=self.model_types[0], vocab_size=61, hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=48, num_hidden_layers=2,
                    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random HF-named tensors for `cfg` (norm weights around 1)."""
        h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
        kv, d = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
        shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
        if not cfg.get("tie_word_embeddings"):
            shapes["lm_head.weight"] = (cfg["vocab_size"], h)
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (heads * d, h), "self_attn.k_proj.weight": (kv * d, h),
                 "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, heads * d),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                 "mlp.down_proj.weight": (h, inter)}
        if self.flow_class.qk_norm:
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        for i in range(cfg["num_hidden_layers"]):
            shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
        return {k: (0.2 * rng.standard_normal(s) + (1.0 if "norm" in k else 0.0)).astype(np.float32)
                for k, s in shapes.items()}


class Qwen3Recipe(LlamaRecipe):
    name = "qwen3"
    model_types = ("qwen3",)
    flow_class = Qwen3Flow
    default_profile = "qwen3_prefill"

    def tiny_config(self) -> dict:
        """QK-norm, a head_dim that is not hidden / heads, untied embeddings."""
        return dict(super().tiny_config(), head_dim=12, tie_word_embeddings=False)


@hookimpl
def rlx_register_recipes(register):
    register(LlamaRecipe())
    register(Qwen3Recipe())


@hookimpl
def rlx_register_blocks(register):
    register("llama_layer",
             lambda i, spec, eps=1e-6, act="silu": llama_prefill_layer_composed(i, spec, eps, act=act))
    register("llama_layer_fused",
             lambda i, spec, eps=1e-6, act="silu": llama_prefill_layer_fused(i, spec, eps, act))


__all__ = ["Llama32Flow", "Qwen3Flow", "LlamaRecipe", "Qwen3Recipe", "attn_spec", "LayerCtx",
           "llama_prefill_layer_composed", "llama_prefill_layer_fused", "LlamaLayerFused"]
