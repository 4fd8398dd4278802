"""Gemma 2 / Gemma 3 configs, read the way transformers 5 reads them.

One function, `gemma_arch(config)`, turns any of the config spellings into a `GemmaArch`:

* transformers 5 `Gemma3TextConfig`: `rope_parameters = {"full_attention": {...},
  "sliding_attention": {...}}` (one RoPE per layer type), `layer_types`;
* older Gemma 3 configs: `rope_theta` (global layers), `rope_local_base_freq` (sliding
  layers), `rope_scaling` (global layers only), `sliding_window_pattern`;
* the config the core synthesizes from a GGUF file (the older spelling plus `layer_types`);
* a multimodal `gemma3` (`Gemma3ForConditionalGeneration`) config: its `text_config`;
* Gemma 2: one RoPE for every layer (`rope_parameters` or `rope_theta`), sliding window on
  the even layers unless `layer_types` says otherwise, attention and final-logit softcaps.
"""
from __future__ import annotations

import attrs

from rlx_core.flow.rope import rope_params
from rlx_core.ir.errors import ModelError
from rlx_core.weights.config import HF_ACTIVATIONS as ACTIVATIONS
from rlx_core.weights.config import check_config, config_source, hf_activation

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3TextConfig.default_theta
GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@attrs.frozen
class GemmaArch:
    """Everything the Gemma blocks need, normalized (HF names in comments)."""
    family: str                    # "gemma2" | "gemma3"
    hidden: int                    # hidden_size
    heads: int                     # num_attention_heads
    kv_heads: int                  # num_key_value_heads
    head_dim: int                  # head_dim
    intermediate: int              # intermediate_size
    layers: int                    # num_hidden_layers
    vocab: int                     # vocab_size
    eps: float                     # rms_norm_eps
    layer_types: tuple             # per layer: "sliding_attention" | "full_attention"
    window: int                    # sliding_window
    rope: dict = attrs.field(eq=False)   # layer type -> (theta, scaling dict or None)
    scale: float = 1.0             # query_pre_attn_scalar ** -0.5
    attn_softcap: float = 0.0      # attn_logit_softcapping (Gemma 2 only: HF's Gemma 3 ignores it)
    final_softcap: float = 0.0     # final_logit_softcapping
    qk_norm: bool = False          # Gemma 3: q_norm / k_norm (1 + w) RMSNorms per head
    act: str = "gelu_tanh"         # hidden_activation
    tied: bool = True              # tie_word_embeddings
    max_positions: int = 8192      # max_position_embeddings

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING and self.window > 0


def text_config(config: dict) -> dict:
    """The language-model part of a config: a multimodal `gemma3` config's `text_config`
    (with the top-level token ids and tying it inherits), anything else as it is."""
    cfg = dict(config)
    if cfg.get("model_type") == "gemma3" and isinstance(cfg.get("text_config"), dict):
        text = dict(cfg["text_config"])
        text.setdefault("model_type", "gemma3_text")
        for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                  "_name_or_path"):
            if k in cfg and k not in text:
                text[k] = cfg[k]
        return text
    return cfg


def _layer_types(cfg: dict, family: str, n: int) -> tuple:
    types = cfg.get("layer_types")
    if types:
        types = tuple(types)
        if len(types) != n:
            raise ModelError(f"config layer_types has {len(types)} entries for {n} layers")
        bad = sorted(set(types) - {SLIDING, FULL})
        if bad:
            raise ModelError(f"config layer_types: unknown layer types {bad}; Gemma layers are "
                             f"{SLIDING!r} or {FULL!r}")
        return types
    if family == "gemma2":       # Gemma2Config: sliding on even layers (i + 1 odd)
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))


def _rope(cfg: dict, family: str) -> dict:
    """layer type -> (theta, scaling), as transformers 5 resolves `rope_parameters`."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and (FULL in rp or SLIDING in rp):
        out = {}
        for t in (FULL, SLIDING):
            p = dict(rp.get(t) or {"rope_type": "default"})
            p.setdefault("rope_theta", GEMMA3_THETA[t] if family == "gemma3" else 10_000.0)
            out[t] = rope_params({"rope_parameters": p})
        return out
    if family == "gemma2" or (isinstance(rp, dict) and "rope_theta" in rp):
        theta, scaling = rope_params(cfg)          # rope_theta defaults to 10000 there
        return {FULL: (theta, scaling), SLIDING: (theta, scaling)}
    # older Gemma 3 spelling: rope_theta / rope_scaling for global layers, a local base for sliding
    glob = dict(cfg)
    glob.setdefault("rope_theta", GEMMA3_THETA[FULL])
    theta, scaling = rope_params(glob)
    local = float(cfg.get("rope_local_base_freq") or GEMMA3_THETA[SLIDING])
    return {FULL: (theta, scaling), SLIDING: (local, None)}


def gemma_arch(config: dict) -> GemmaArch:
    """Normalize a Gemma 2 / Gemma 3 config (HF config.json dict or one synthesized from GGUF)."""
    cfg = text_config(check_config(config, config_source(config), ModelError))
    mt = cfg.get("model_type", "")
    if mt == "gemma2":
        family = "gemma2"
    elif mt in ("gemma3_text", "gemma3"):
        family = "gemma3"
    else:
        raise ModelError(f"not a Gemma 2 / Gemma 3 config: model_type {mt!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                           "vocab_size") if cfg.get(k) is None]
    if missing:
        raise ModelError(f"{mt} config lacks {missing}")
    if cfg.get("use_bidirectional_attention"):
        raise ModelError(f"{mt} config with use_bidirectional_attention=true (an encoder, e.g. "
                         "EmbeddingGemma) is not a causal LM; rlx-blocks-gemma builds causal Gemma only")
    act = hf_activation(cfg, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
    if cfg.get("attention_bias"):
        raise ModelError(f"{mt} configs with attention_bias=true are not supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    n = int(cfg["num_hidden_layers"])
    types = _layer_types(cfg, family, n)
    window = int(cfg.get("sliding_window") or 0)
    scalar = cfg.get("query_pre_attn_scalar")
    scale = float(scalar) ** -0.5 if scalar else head_dim ** -0.5
    return GemmaArch(
        family=family, hidden=hidden, heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate=int(cfg["intermediate_size"]), layers=n, vocab=int(cfg["vocab_size"]),
        eps=float(cfg.get("rms_norm_eps", 1e-6)), layer_types=types, window=window,
        rope=_rope(cfg, family), scale=scale,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if family == "gemma2" else 0.0,
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        qk_norm=family == "gemma3", act=act,
        tied=bool(cfg.get("tie_word_embeddings", True)),
        max_positions=int(cfg.get("max_position_embeddings") or 8192))


__all__ = ["GemmaArch", "gemma_arch", "text_config", "SLIDING", "FULL", "ACTIVATIONS"]
