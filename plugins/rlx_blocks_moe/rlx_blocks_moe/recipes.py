"""The MoE decoders as recipes: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE.

Each is a LLaMA-shaped pre-norm decoder (RMSNorm, attention, residual, RMSNorm, MLP,
residual) whose MLP is routed experts. What differs is the attention and the router:

* Qwen3-MoE: Qwen3's attention (RMSNorm of q and k per head); `sliding_window` on every layer
  when `use_sliding_window`; softmax -> top-k, rescaled when `norm_topk_prob`; dense MLP layers
  where `mlp_only_layers` / `decoder_sparse_step` say; experts of `moe_intermediate_size`.
* Qwen2-MoE: Qwen2's attention (q/k/v biases when `qkv_bias`, default true), sliding windows
  on the layers `layer_types` marks (else every other layer below `max_window_layers` when
  `use_sliding_window`); Qwen3-MoE's router and dense layers, plus a shared expert of
  `shared_expert_intermediate_size` scaled by sigmoid(`shared_expert_gate`).
* Mixtral: Mistral's attention (`sliding_window` on every layer when set); top-k -> softmax.
* OLMoE: RMSNorm over the whole q and k projections (as OLMo 2), `clip_qkv` clamps q, k, v;
  softmax -> top-k, rescaled when `norm_topk_prob` (default false).

The router variants and expert sizes are data (`config.FAMILIES`), not a code path per model.
"""
from __future__ import annotations

import attrs
import numpy as np

from rlx_core.flow import AttnSpec, ModelFlow, SelfAttention
from rlx_core.flow.moe import MoeFfn, SharedExpert
from rlx_core.flow.recipe import DecoderFlow
from rlx_core.flow.rope import rope_params
from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.runtime.model import DecoderRecipe
from rlx_core.weights.config import check_config, config_source, hf_activation

from .config import Routing, check_moe_config, num_experts, routing, sparse_layers
from .weights import stack_experts

REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
# the RoPE base transformers uses when a config states none (MixtralConfig.default_theta)
DEFAULT_THETA = {"mixtral": 1_000_000.0}


# ----------------------------------------------------------------------------- attention
def window_of(cfg: dict, i: int) -> int:
    """Layer i's attention window (0: global) as transformers reads the config."""
    mt, window = cfg.get("model_type"), cfg.get("sliding_window") or 0
    if mt == "mixtral":
        return window
    if mt == "qwen3_moe":
        return window if cfg.get("use_sliding_window") else 0
    if mt == "qwen2_moe":
        return window if cfg.get("use_sliding_window") and layer_slides(cfg, i) else 0
    if window:          # OLMoE's attention has no window: transformers' mask ignores the key
        raise ModelError(f"{config_source(cfg)}: sliding_window = {window} on an OLMoE config; OLMoE "
                         "attends globally (expected null or absent)")
    return 0


def layer_slides(cfg: dict, i: int) -> bool:
    """Qwen2-MoE: `layer_types[i]` is "sliding_attention", or without layer_types, every other
    layer (i + 1 odd) below `max_window_layers` (default 28), as its config class fills them."""
    types = cfg.get("layer_types")
    n = cfg["num_hidden_layers"]
    if types is not None:
        if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelError(f"{config_source(cfg)}: layer_types must list 'sliding_attention' or "
                             f"'full_attention' for each of {n} layers, got {types!r}")
        return types[i] == "sliding_attention"
    first = cfg.get("max_window_layers")
    return bool((i + 1) % 2) and i < (28 if first is None else first)


def attn_spec(cfg: dict, mode: str = "prefill", i: int = 0) -> AttnSpec:
    """The attention of layer i of an MoE config (HF field names)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    mt = cfg.get("model_type")
    theta, scaling = rope_params(cfg if "rope_theta" in cfg or "rope_parameters" in cfg
                                 else {**cfg, "rope_theta": DEFAULT_THETA.get(mt, 10000.0)})
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias = cfg.get("qkv_bias", True) if mt == "qwen2_moe" else bias
    if not isinstance(qkv_bias, bool):
        raise ModelError(f"{config_source(cfg)}: qkv_bias = {qkv_bias!r}; expected true or false")
    return AttnSpec(
        heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, hidden=hidden,
        rope_theta=theta, rope_scaling=scaling,
        max_positions=int(cfg.get("max_position_embeddings") or 4096),
        qk_norm_eps=rms_eps(cfg) if mt in ("qwen3_moe", "olmoe") else None,
        bias=qkv_bias, o_bias=bias, window=window_of(cfg, i), mode=mode)


def rms_eps(cfg: dict) -> float:
    return float(cfg.get("rms_norm_eps") or 1e-6)


@attrs.frozen
class WholeQKNormAttention(SelfAttention):
    """OLMoE's attention: q and k RMS-normed over the whole projection (`q_norm.weight` of
    width heads * head_dim, `k_norm.weight` kv_heads * head_dim), then each of q, k, v clamped
    to [-clip, clip] when `clip` (the config's `clip_qkv`), then split into heads."""
    clip: float | None = None

    def heads_of(self, ctx, x, name: str, heads: int, normed: bool):
        s, m = self.spec, ctx.m
        width = heads * s.head_dim
        p = ctx.key(f"{s.prefix}.{name}")
        y = m.linear(x, ctx.param(f"{p}_proj.weight", (width, s.hidden)),
                     ctx.param(f"{p}_proj.bias", (width,)) if s.bias else None)
        if normed:
            y = m.rms_norm(y, ctx.param(f"{p}_norm.weight", (width,)), eps=s.qk_norm_eps)
        if self.clip is not None:
            y = m.minimum(m.maximum(y, m.constant(-self.clip, y.dtype)), m.constant(self.clip, y.dtype))
        return m.transpose(m.reshape(y, (x.dims[0], x.dims[1], heads, s.head_dim)), (0, 2, 1, 3))

    def project_qkv(self, ctx, x) -> tuple:
        s = self.spec
        if s.heads % s.kv_heads:
            raise ModelError(f"layer {ctx.prefix}: {s.heads} heads is not a multiple of {s.kv_heads} kv heads")
        return (self.heads_of(ctx, x, "q", s.heads, True), self.heads_of(ctx, x, "k", s.kv_heads, True),
                self.heads_of(ctx, x, "v", s.kv_heads, False))


def clip_qkv(cfg: dict) -> float | None:
    v = cfg.get("clip_qkv")
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not np.isfinite(v):
        raise ModelError(f"{config_source(cfg)}: clip_qkv = {v!r}; expected a finite number > 0 or null")
    return float(v)


def attention(cfg: dict, spec: AttnSpec):
    if cfg.get("model_type") == "olmoe":
        return WholeQKNormAttention(spec, clip_qkv(cfg))
    return SelfAttention(spec)


# ----------------------------------------------------------------------------- experts
# the canonical stacks (weights.stack_name) relative to the layer's `mlp` prefix
STACKS = ("experts.gate_proj.weight", "experts.up_proj.weight", "experts.down_proj.weight")


def routed_experts(r: Routing, act: str) -> MoeFfn:
    """The core MoE block over the canonical names (router `mlp.gate.weight`; the shared
    expert, if any, `mlp.shared_expert.*_proj.weight` gated by `mlp.shared_expert_gate.weight`)."""
    shared = SharedExpert(r.shared, "shared_expert", "shared_expert_gate.weight") if r.shared else None
    return MoeFfn(r.experts, r.k, r.inter, prefix="mlp", router="gate.weight", stacks=STACKS,
                  order=r.order, normalize=r.normalize, act=act, shared=shared)


# ----------------------------------------------------------------------------- the flow
class MoeFlow(DecoderFlow):
    """Recipe flow: the prefill / decode / logits / train graphs of an MoE decoder config."""
    family = "moe"
    profile_family = "llama32"         # the core's presets for a GQA decoder

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        check_config(cfg, config_source(cfg), ModelError, required=REQUIRED)
        if cfg.get("mlp_bias"):
            raise ModelError(f"{config_source(cfg)}: mlp_bias=true is not supported; expected false or absent")
        check_moe_config(cfg)
        if cfg.get("model_type") == "olmoe" and cfg.get("head_dim") not in (
                None, cfg["hidden_size"] // cfg["num_attention_heads"]):
            raise ModelError(f"{config_source(cfg)}: head_dim = {cfg['head_dim']}; OLMoE's q/k norms are "
                             "sized by hidden_size / num_attention_heads, expected that or absent")
        super().__init__(cfg, mode, batch, seq)
        self._sparse = sparse_layers(cfg)

    def spec(self, i: int = 0) -> AttnSpec:
        return attn_spec(self.cfg, "decode" if self.mode == "decode" else "prefill", i)

    @property
    def act(self) -> str:
        return hf_activation(self.cfg, "hidden_act", default="silu")

    def mlp(self, i: int, f: ModelFlow) -> ModelFlow:
        """Layer i's MLP: the routed experts, or a dense gated MLP (`intermediate_size`)."""
        if i in self._sparse:
            return f.raw_stage(routed_experts(routing(self.cfg), self.act))
        return f.gated_hf_mlp("mlp", self.act)

    def default_layer(self, i: int) -> ModelFlow:
        eps = rms_eps(self.cfg)
        f = (ModelFlow().residual_save().rms_norm("input_layernorm.weight", eps)
             .raw_stage(attention(self.cfg, self.spec(i))).residual_add()
             .residual_save().rms_norm("post_attention_layernorm.weight", eps))
        return self.mlp(i, f).residual_add()

    def head(self, f: ModelFlow) -> ModelFlow:
        c = self.cfg
        f.final_norm(rms_eps(c))
        if self._last:
            f.gather_last_token()
        return f.lm_head(c["vocab_size"], c["hidden_size"], tied=bool(c.get("tie_word_embeddings", False)))


class Qwen3MoeFlow(MoeFlow):
    family = "qwen3_moe"
    profile_family = "qwen3"


class Qwen2MoeFlow(MoeFlow):
    family = "qwen2_moe"


class MixtralFlow(MoeFlow):
    family = "mixtral"


class OlmoeFlow(MoeFlow):
    family = "olmoe"


# ----------------------------------------------------------------------------- recipes
class MoeRecipe(DecoderRecipe):
    """Registered recipe: an MoE checkpoint (HF folder or GGUF) -> CausalLM. The experts are
    stacked once at load (`weights.stack_experts`), whatever form the checkpoint holds them in."""
    flow_class: type[MoeFlow] = MoeFlow
    default_context = 4096
    # the model type whose GGUF architecture holds this family's files (None: its own)
    gguf_model_type: str | None = None

    def build(self, ckpt, backend=None, profile=None, **kw):
        return super().build(self.stacked(ckpt), backend, profile, **kw)

    def stacked(self, ckpt, lazy: bool = False):
        """`ckpt` with its experts as the canonical stacks (weights.stack_experts)."""
        cfg = dict(ckpt.config)
        check_moe_config(cfg)
        return attrs.evolve(ckpt, tensors=stack_experts(ckpt.tensors, cfg, ckpt.path, self.count_key(ckpt),
                                                        lazy))

    def count_key(self, ckpt) -> str:
        """Where `ckpt`'s expert count came from, as an error names it."""
        if ckpt.format != "gguf":
            return "num_experts"
        from rlx_core.plugins import registry

        mt = self.gguf_model_type or ckpt.config.get("model_type")
        arch = next((a for a, m in registry().gguf_architectures.items() if m.model_type == mt), mt)
        return f"GGUF metadata {arch}.expert_count"

    def gguf_checkpoint(self, ckpt):
        """The checkpoint as `rlx quantize` writes it: experts stacked (llama.cpp's 3-D
        ffn_*_exps) and, where another architecture holds the family's GGUF files (Mixtral:
        llama.cpp's `llama`), the config under that architecture's model type."""
        out = self.stacked(ckpt, lazy=True)
        if self.gguf_model_type:
            out = attrs.evolve(out, config={**out.config, "model_type": self.gguf_model_type})
        return out

    # -- the conformance kit's tiny model (rlx_core.testing.recipes)
    def tiny_config(self) -> dict:
        """8 experts, top-2, GQA 2, two layers."""
        return dict(model_type=self.model_types[0], vocab_size=61, hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=24, num_hidden_layers=2,
                    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                    num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, eos_token_id=2,
                    pad_token_id=0)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random HF-named tensors (per-expert, as checkpoints store them; norms around 1)."""
        return {k: (0.2 * rng.standard_normal(s) + (1.0 if "norm" in k else 0.0)).astype(np.float32)
                for k, s in hf_tensor_shapes(cfg).items()}


def hf_tensor_shapes(cfg: dict) -> dict:
    """HF name -> shape of every tensor of an MoE checkpoint of `cfg`, experts per expert."""
    h, heads, mt = cfg["hidden_size"], cfg["num_attention_heads"], cfg["model_type"]
    kv, d = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (heads * d, h), "self_attn.k_proj.weight": (kv * d, h),
             "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, heads * d)}
    if mt == "qwen3_moe":
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    elif mt == "qwen2_moe" and cfg.get("qkv_bias", True):
        layer.update({"self_attn.q_proj.bias": (heads * d,), "self_attn.k_proj.bias": (kv * d,),
                      "self_attn.v_proj.bias": (kv * d,)})
    elif mt == "olmoe":
        layer.update({"self_attn.q_norm.weight": (heads * d,), "self_attn.k_norm.weight": (kv * d,)})
    moe, names = "block_sparse_moe" if mt == "mixtral" else "mlp", (
        ("w1", "w3", "w2") if mt == "mixtral" else ("gate_proj", "up_proj", "down_proj"))
    sparse = sparse_layers(cfg)
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
        if i in sparse:
            r = routing(cfg)
            shapes[f"model.layers.{i}.{moe}.gate.weight"] = (r.experts, h)
            for e in range(r.experts):
                for n, s in zip(names, ((r.inter, h), (r.inter, h), (h, r.inter))):
                    shapes[f"model.layers.{i}.{moe}.experts.{e}.{n}.weight"] = s
            if r.shared:
                shapes[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = (1, h)
                shapes.update({f"model.layers.{i}.mlp.shared_expert.{n}.weight": s for n, s in
                               (("gate_proj", (r.shared, h)), ("up_proj", (r.shared, h)),
                                ("down_proj", (h, r.shared)))})
        else:
            inter = cfg["intermediate_size"]
            shapes.update({f"model.layers.{i}.mlp.{n}.weight": s for n, s in
                           (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))})
    return shapes


class Qwen3MoeRecipe(MoeRecipe):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    flow_class = Qwen3MoeFlow
    default_profile = "qwen3_prefill"

    def tiny_config(self) -> dict:
        """QK-norm, a head_dim that is not hidden / heads, normalized top-k, layer 1 dense."""
        return dict(super().tiny_config(), head_dim=12, moe_intermediate_size=16, norm_topk_prob=True,
                    mlp_only_layers=[1])


class Qwen2MoeRecipe(MoeRecipe):
    name = "qwen2_moe"
    model_types = ("qwen2_moe",)
    flow_class = Qwen2MoeFlow

    def tiny_config(self) -> dict:
        """q/k/v biases, a shared expert, layer 1 dense, layer 0 sliding (window 4)."""
        return dict(super().tiny_config(), moe_intermediate_size=16, shared_expert_intermediate_size=20,
                    mlp_only_layers=[1], use_sliding_window=True, sliding_window=4, max_window_layers=1)


class MixtralRecipe(MoeRecipe):
    name = "mixtral"
    model_types = ("mixtral",)
    flow_class = MixtralFlow
    gguf_model_type = "llama"           # llama.cpp's `llama` with llama.expert_count > 0

    def gguf_checkpoint(self, ckpt):
        if ckpt.config.get("sliding_window"):
            raise WeightError(f"{ckpt.path}: sliding_window = {ckpt.config['sliding_window']} cannot be "
                              "written as llama.cpp's 'llama' GGUF: its llama graph attends globally")
        return super().gguf_checkpoint(ckpt)

    def tiny_config(self) -> dict:
        """Mixtral's key for the expert count; a sliding window shorter than the kit's rows."""
        cfg = dict(super().tiny_config(), num_local_experts=8, sliding_window=4)
        del cfg["num_experts"]
        return cfg


class OlmoeRecipe(MoeRecipe):
    name = "olmoe"
    model_types = ("olmoe",)
    flow_class = OlmoeFlow

    def tiny_config(self) -> dict:
        """Whole-projection QK-norm, clip_qkv."""
        return dict(super().tiny_config(), clip_qkv=1.5)


RECIPES = (Qwen3MoeRecipe, Qwen2MoeRecipe, MixtralRecipe, OlmoeRecipe)

__all__ = ["MoeFlow", "Qwen3MoeFlow", "Qwen2MoeFlow", "MixtralFlow", "OlmoeFlow", "MoeRecipe",
           "Qwen3MoeRecipe", "Qwen2MoeRecipe", "MixtralRecipe", "OlmoeRecipe", "RECIPES", "routed_experts",
           "WholeQKNormAttention", "attn_spec", "hf_tensor_shapes", "num_experts"]
