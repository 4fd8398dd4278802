"""LLaMA and Qwen3 GGUF files, both ways (llama.cpp's `llama` and `qwen3` architectures):
tensor names, LLaMA's rope row permutation of Q/K, the head size LLaMA files state only as the
rotary width, and the keys `rlx quantize` writes for them."""
from __future__ import annotations

import numpy as np

from rlx_core.ir.errors import WeightError
from rlx_core.plugins import hookimpl
from rlx_core.weights.gguf_arch import STANDARD_LAYER_NAMES, GGUFArchitecture, write_rope_scaling

# blk.N.<GGUF leaf> -> model.layers.N.<HF leaf>
LAYER_NAMES = {
    **STANDARD_LAYER_NAMES,
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
ROPE_FACTORS = frozenset({"rope_freqs.weight"})  # llama3 rope factors; transformers rebuilds them
# llama.cpp's `llama` also holds Mixtral: a router and 3-D expert stacks per block, named as the
# `mixtral` recipe (a plugin found through the recipe registry) reads them
EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def _rope_heads(gguf_name: str) -> str | None:
    """The config key of the head count whose rows llama.cpp permuted in this tensor, or None."""
    if ".attn_q." in gguf_name:
        return "num_attention_heads"
    return "num_key_value_heads" if ".attn_k." in gguf_name else None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope row permutation (`permute` in convert_hf_to_gguf.py), as transformers does."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def permute(w: np.ndarray, n_head: int, name: str) -> np.ndarray:
    """llama.cpp's converter rope permutation of Q/K rows (convert_hf_to_gguf.py `permute`)."""
    if w.ndim != 2 or w.shape[0] % (2 * n_head):
        raise WeightError(f"tensor {name!r} of shape {list(w.shape)}: expected a matrix whose rows split "
                          f"into {n_head} heads of an even size")
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class LlamaGGUF(GGUFArchitecture):
    """llama.cpp's `llama`: Q/K rows permuted for its rope, the head size as the rotary width."""

    def from_gguf(self, gguf_name, w, config, path):
        key = _rope_heads(gguf_name)
        if key is None:
            return w
        heads = config[key]
        if w.ndim == 0 or w.shape[0] % (2 * heads):
            raise WeightError(
                f"{path}: tensor {gguf_name!r} of shape {list(w.shape)} does not split into {heads} heads "
                f"({key}) of an even size"
            )
        return unpermute(w, heads)

    def to_gguf(self, gguf_name, w, config, hf):
        key = _rope_heads(gguf_name)
        return w if key is None else permute(w, config.get(key) or config["num_attention_heads"], hf)

    def head_dim(self, meta):
        return meta.num("rope.dimension_count", None, to="head_dim")

    def config(self, meta, cfg, held):
        cfg["hidden_act"] = "silu"
        experts = meta.num("expert_count", 0, lo=0, to="num_local_experts")
        if experts:
            mixtral_config(meta, cfg, experts)

    def write_metadata(self, writer, cfg, head_dim):
        writer.add_rope_dimension_count(head_dim)
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        if experts:         # Mixtral, written as llama.cpp's converter writes it
            writer.add_expert_count(experts)
            writer.add_expert_used_count(cfg["num_experts_per_tok"])
        write_rope_scaling(writer, cfg)


def mixtral_config(meta, cfg: dict, experts: int) -> None:
    """A `llama` GGUF with experts is a Mixtral: its config as transformers names it, for the
    recipe registered for `mixtral` (a WeightError naming what provides it when none is)."""
    from rlx_core.plugins import provider_hint, registry

    if "mixtral" not in registry().recipes:
        raise WeightError(f"{meta.path}: a llama GGUF with experts ({meta.key('expert_count')} = {experts}) "
                          "is a Mixtral model, and no loaded plugin registers the recipe 'mixtral'; "
                          + (provider_hint("mixtral") or "install the plugin of the MoE families"))
    cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=experts,
               num_experts_per_tok=meta.num("expert_used_count", to="num_experts_per_tok"))


class Qwen3GGUF(GGUFArchitecture):
    """llama.cpp's `qwen3`: LLaMA's names plus QK norms, no permutation."""

    def config(self, meta, cfg, held):
        cfg["hidden_act"] = "silu"


LLAMA = LlamaGGUF("llama", "LlamaForCausalLM", {**LAYER_NAMES, **EXPERT_NAMES}, dropped=ROPE_FACTORS)
QWEN3 = Qwen3GGUF("qwen3", "Qwen3ForCausalLM", LAYER_NAMES, dropped=ROPE_FACTORS)


@hookimpl
def rlx_register_gguf_architectures(register):
    register("llama", LLAMA)
    register("qwen3", QWEN3)
