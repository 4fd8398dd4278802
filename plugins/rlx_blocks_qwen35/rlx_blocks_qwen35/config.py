"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next configs, read the way transformers 5 reads them.

`qwen35_arch(config)` turns a config dict (HF config.json, a multimodal wrapper's
`text_config`, or one the core synthesizes from a GGUF file) into a `Qwen35Arch`:

* the layer kinds: `layer_types` ("linear_attention" | "full_attention"), else
  `full_attention_interval` (every n-th layer full, default 4: Qwen3NextConfig);
* full attention: gated (q_proj gives query and gate per head), QK-norm, partial RoPE
  (`partial_rotary_factor`, in `rope_parameters` or top level; Qwen3-Next defaults it to 0.25);
* Gated DeltaNet: `linear_num_key_heads` / `linear_num_value_heads` heads of
  `linear_key_head_dim` / `linear_value_head_dim`, a short conv of `linear_conv_kernel_dim`;
* the MLP: dense, or (MoE configs) `num_experts` routed experts, top `num_experts_per_tok`,
  plus a shared expert behind a sigmoid gate; Qwen3-Next: MoE on layers where
  (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers.
"""
from __future__ import annotations

import attrs

from rlx_core.flow.rope import rope_params
from rlx_core.ir.errors import ModelError
from rlx_core.weights.config import check_config, config_source, hf_activation

LINEAR, FULL = "linear_attention", "full_attention"
FAMILIES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
            "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}
WRAPPERS = ("qwen3_5", "qwen3_5_moe")          # vision-language configs with a text_config


@attrs.frozen
class Qwen35Arch:
    """Everything the blocks need, normalized (HF names in comments)."""
    family: str                    # "qwen3_5" | "qwen3_5_moe" | "qwen3_next"
    hidden: int                    # hidden_size
    heads: int                     # num_attention_heads
    kv_heads: int                  # num_key_value_heads
    head_dim: int                  # head_dim
    intermediate: int              # intermediate_size (dense MLP layers)
    layers: int                    # num_hidden_layers
    vocab: int                     # vocab_size
    eps: float                     # rms_norm_eps
    layer_types: tuple             # per layer: LINEAR | FULL
    rope_theta: float
    rope_scaling: dict | None = attrs.field(eq=False)
    rotary_dim: int                # head_dim * partial_rotary_factor
    k_heads: int                   # linear_num_key_heads
    v_heads: int                   # linear_num_value_heads
    k_dim: int                     # linear_key_head_dim
    v_dim: int                     # linear_value_head_dim
    conv_width: int                # linear_conv_kernel_dim
    act: str = "silu"              # hidden_act
    tied: bool = False             # tie_word_embeddings
    max_positions: int = 32768     # max_position_embeddings
    experts: int = 0               # num_experts (0: dense MLP everywhere)
    top_k: int = 0                 # num_experts_per_tok
    moe_intermediate: int = 0      # moe_intermediate_size
    shared_intermediate: int = 0   # shared_expert_intermediate_size
    norm_topk: bool = True         # norm_topk_prob (Qwen3.5-MoE always normalizes)
    moe_layers: tuple = ()         # per layer: routed experts or not
    out_proj_tiled: bool = False   # linear_value_head_order == "tiled": out_proj's columns in
                                   # llama.cpp's order (value heads tiled over key heads; GGUF)

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == LINEAR

    @property
    def conv_channels(self) -> int:
        """The short conv's channels: q, k (key heads) and v (value heads) side by side."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


def text_config(config: dict) -> dict:
    """The language-model part of a config: a vision-language `qwen3_5` / `qwen3_5_moe`
    config's `text_config` (with the top-level tying and token ids it inherits), anything
    else as it is."""
    cfg = dict(config)
    if cfg.get("model_type") in WRAPPERS and isinstance(cfg.get("text_config"), dict):
        text = dict(cfg["text_config"])
        text.setdefault("model_type", f"{cfg['model_type']}_text")
        for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path"):
            if k in cfg and k not in text:
                text[k] = cfg[k]
        return text
    return cfg


def _need(cfg: dict, keys: tuple, mt: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ModelError(f"{config_source(cfg)}: {mt} config lacks {missing}")


def _divides(cfg: dict, big: str, small: str) -> None:
    if int(cfg[small]) <= 0 or int(cfg[big]) % int(cfg[small]):
        raise ModelError(f"{config_source(cfg)}: {big}={cfg[big]} is not a multiple of {small}={cfg[small]}")


def _layer_types(cfg: dict, n: int) -> tuple:
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        if every < 1:
            raise ModelError(f"{config_source(cfg)}: full_attention_interval={every}, expected >= 1")
        return tuple(LINEAR if (i + 1) % every else FULL for i in range(n))
    if not isinstance(types, (list, tuple)) or len(types) != n:
        got = len(types) if isinstance(types, (list, tuple)) else repr(types)
        raise ModelError(f"{config_source(cfg)}: layer_types has {got} entries for "
                         f"num_hidden_layers={n}")
    bad = sorted({str(t) for t in types} - {LINEAR, FULL})
    if bad:
        raise ModelError(f"{config_source(cfg)}: layer_types holds unknown layer kinds {bad}; "
                         f"expected {LINEAR!r} or {FULL!r}")
    return tuple(types)


def _rotary(cfg: dict, head_dim: int, family: str) -> int:
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    default = 0.25 if family == "qwen3_next" else 1.0
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    rot = int(head_dim * float(factor))
    if rot < 2 or rot % 2 or rot > head_dim:
        raise ModelError(f"{config_source(cfg)}: partial_rotary_factor={factor} gives a rotary width of "
                         f"{rot} of head_dim {head_dim}; expected an even width in [2, head_dim]")
    return rot


# rope_parameters keys that are not a scaling: the text-only mRoPE (every section at the one
# text position is plain RoPE) and the rotary width (`_rotary`)
NOT_SCALING = ("mrope_section", "mrope_interleaved", "partial_rotary_factor")


def _rope(cfg: dict) -> tuple:
    """(theta, scaling or None)."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        rp = {k: v for k, v in rp.items() if k not in NOT_SCALING}
        rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        return rope_params({"rope_parameters": rp})
    return rope_params(cfg)


def _moe_layers(cfg: dict, family: str, n: int) -> tuple:
    experts = int(cfg.get("num_experts") or 0)
    if family == "qwen3_5" or experts == 0:
        return (False,) * n
    if family == "qwen3_5_moe":
        return (True,) * n
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return tuple(i not in only and (i + 1) % step == 0 for i in range(n))


def _head_order(cfg: dict) -> str:
    order = cfg.get("linear_value_head_order", "grouped")
    if order not in ("grouped", "tiled"):
        raise ModelError(f"{config_source(cfg)}: linear_value_head_order={order!r}; expected 'grouped' "
                         "(transformers) or 'tiled' (llama.cpp's out_proj columns)")
    return order


def qwen35_arch(config: dict) -> Qwen35Arch:
    """Normalize a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config; a bad one is a ModelError
    naming the key."""
    cfg = text_config(check_config(config, config_source(config), ModelError))
    mt = cfg.get("model_type", "")
    if mt not in FAMILIES:
        raise ModelError(f"not a Qwen3.5 / Qwen3-Next config: model_type {mt!r}")
    family = FAMILIES[mt]
    _need(cfg, ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim"), mt)
    if cfg.get("attention_bias"):
        raise ModelError(f"{config_source(cfg)}: attention_bias=true is not supported")
    n = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", heads)
    _divides(cfg, "num_attention_heads", "num_key_value_heads")
    _divides(cfg, "linear_num_value_heads", "linear_num_key_heads")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    moe = _moe_layers(cfg, family, n)
    if any(moe):
        _need(cfg, ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"), mt)
    if not all(moe):
        _need(cfg, ("intermediate_size",), mt)
    theta, scaling = _rope(cfg)
    return Qwen35Arch(
        family=family, hidden=int(cfg["hidden_size"]), heads=heads, kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=head_dim, intermediate=int(cfg.get("intermediate_size") or 0), layers=n,
        vocab=int(cfg["vocab_size"]), eps=float(cfg.get("rms_norm_eps", 1e-6)),
        layer_types=_layer_types(cfg, n), rope_theta=theta, rope_scaling=scaling,
        rotary_dim=_rotary(cfg, head_dim, family),
        k_heads=int(cfg["linear_num_key_heads"]), v_heads=int(cfg["linear_num_value_heads"]),
        k_dim=int(cfg["linear_key_head_dim"]), v_dim=int(cfg["linear_value_head_dim"]),
        conv_width=int(cfg["linear_conv_kernel_dim"]),
        act=hf_activation(cfg, "hidden_act", default="silu"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=int(cfg.get("max_position_embeddings") or 32768),
        experts=int(cfg.get("num_experts") or 0) if any(moe) else 0,
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
        shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0),
        norm_topk=True if family == "qwen3_5_moe" else bool(cfg.get("norm_topk_prob", True)),
        moe_layers=moe, out_proj_tiled=_head_order(cfg) == "tiled")


__all__ = ["Qwen35Arch", "qwen35_arch", "text_config", "LINEAR", "FULL", "FAMILIES"]
