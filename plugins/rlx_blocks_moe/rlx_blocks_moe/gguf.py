"""The MoE families' GGUF files, both ways: llama.cpp's `qwen3moe`, `qwen2moe` and `olmoe` architectures
(Mixtral files are llama.cpp's `llama` with `llama.expert_count` > 0, which the LLaMA plugin
reads as a `mixtral` config; see `MixtralRecipe.gguf_architecture`).

Names: the router `blk.N.ffn_gate_inp` and the 3-D stacks `blk.N.ffn_{gate,up,down}_exps`
(numpy [E, rows, cols], ggml ne [cols, rows, E]) are this plugin's canonical names
(`weights.stack_name`); qwen2moe's shared expert is `blk.N.ffn_{gate,up,down}_shexp` and its
gate `blk.N.ffn_gate_inp_shexp`. Metadata: `{arch}.expert_count`, `{arch}.expert_used_count`, and for
qwen3moe / qwen2moe `expert_feed_forward_length` (absent: feed_forward_length / used count, as
llama.cpp reads it), qwen2moe `expert_shared_feed_forward_length` (absent: feed_forward_length).
llama.cpp hard-codes each architecture's router: qwen3moe renormalizes the top-k
(norm_topk_prob true), qwen2moe and olmoe do not; a config llama.cpp would compute differently
(the other norm_topk_prob, Qwen2/3-MoE dense layers or a sliding window, Qwen2-MoE without
q/k/v biases or with tied embeddings, OLMoE's clip_qkv,
grouped k heads or tied embeddings, which its loader cannot size) is refused by `rlx quantize`
with a WeightError naming the key, not written as a file llama.cpp misreads.
"""
from __future__ import annotations

from rlx_core.ir.errors import WeightError
from rlx_core.plugins import hookimpl
from rlx_core.weights.gguf_arch import STANDARD_LAYER_NAMES, GGUFArchitecture, write_rope_scaling

from .config import routing, sparse_layers

# llama.cpp's MoE tensor names -> this plugin's canonical HF names (weights.stack_name)
EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
LAYER_NAMES = {**STANDARD_LAYER_NAMES, **EXPERT_NAMES,
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


class MoeGGUF(GGUFArchitecture):
    """An MoE architecture of llama.cpp: the expert keys both ways, the router's
    normalization fixed as llama.cpp's graph for it fixes it (`normalizes`)."""

    normalizes = False

    def config(self, meta, cfg, held):
        e = meta.num("expert_count", to="num_experts")
        k = meta.num("expert_used_count", to="num_experts_per_tok")
        if k > e:
            raise WeightError(f"{meta.path}: GGUF metadata {meta.key('expert_used_count')} = {k} exceeds "
                              f"{meta.key('expert_count')} = {e}; expected at most the expert count")
        cfg.update(num_experts=e, num_experts_per_tok=k, norm_topk_prob=self.normalizes, hidden_act="silu")

    def write_metadata(self, writer, cfg, head_dim):
        self.check_writable(cfg)
        r = routing(cfg)
        writer.add_expert_count(r.experts)
        writer.add_expert_used_count(r.k)
        self.write_expert_size(writer, r)
        write_rope_scaling(writer, cfg)

    def write_expert_size(self, writer, r) -> None:
        """The expert's intermediate size where it is not feed_forward_length (the default: it is)."""

    def check_writable(self, cfg: dict) -> None:
        """A WeightError naming the key of anything llama.cpp's graph for this architecture
        would compute otherwise."""
        r = routing(cfg)
        if r.normalize != self.normalizes:
            self.refuse(cfg, f"norm_topk_prob = {str(r.normalize).lower()}",
                        f"its {self.arch} graph {'always' if self.normalizes else 'never'} renormalizes "
                        "the chosen experts' weights")

    @property
    def arch(self) -> str:
        return self.model_type.replace("_", "")

    def refuse(self, cfg: dict, what: str, why: str) -> None:
        raise WeightError(f"{cfg.get('_name_or_path') or 'config'}: {what} cannot be written as llama.cpp's "
                          f"{self.arch!r} GGUF: {why}")


class Qwen3MoeGGUF(MoeGGUF):
    """llama.cpp's `qwen3moe`: Qwen3's per-head QK norms, every layer routed, top-k renormalized."""

    normalizes = True

    def config(self, meta, cfg, held):
        super().config(meta, cfg, held)
        cfg["moe_intermediate_size"] = meta.num(
            "expert_feed_forward_length", cfg["intermediate_size"] // cfg["num_experts_per_tok"],
            to="moe_intermediate_size")

    def write_expert_size(self, writer, r) -> None:
        writer.add_expert_feed_forward_length(r.inter)

    def check_writable(self, cfg):
        super().check_writable(cfg)
        dense = sorted(set(range(cfg["num_hidden_layers"])) - sparse_layers(cfg))
        if dense:
            self.refuse(cfg, f"dense MLP layers {dense} (mlp_only_layers / decoder_sparse_step)",
                        "it routes every layer through the experts")
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            self.refuse(cfg, f"use_sliding_window with sliding_window = {cfg['sliding_window']}",
                        "it attends globally")


class Qwen2MoeGGUF(Qwen3MoeGGUF):
    """llama.cpp's `qwen2moe`: q/k/v biases, no QK norms, every layer routed, top-k not
    renormalized, and a shared expert gated by sigmoid(ffn_gate_inp_shexp)."""

    normalizes = False

    def config(self, meta, cfg, held):
        super().config(meta, cfg, held)
        cfg["shared_expert_intermediate_size"] = meta.num(
            "expert_shared_feed_forward_length", cfg["intermediate_size"],
            to="shared_expert_intermediate_size")
        cfg["qkv_bias"] = True

    def from_gguf(self, gguf_name, w, config, path):
        """The shared expert's gate as transformers holds it, [1, hidden] (a 1-D file's too)."""
        return w.reshape(1, -1) if gguf_name.endswith(".ffn_gate_inp_shexp.weight") and w.ndim == 1 else w

    def write_expert_size(self, writer, r) -> None:
        writer.add_expert_feed_forward_length(r.inter)
        writer.add_expert_shared_feed_forward_length(r.shared)

    def check_writable(self, cfg):
        super().check_writable(cfg)
        if cfg.get("qkv_bias") is False:
            self.refuse(cfg, "qkv_bias = false", "RLX reads its qwen2moe files with q/k/v biases, as every "
                        "Qwen2-MoE checkpoint has them")
        if cfg.get("tie_word_embeddings"):
            self.refuse(cfg, "tie_word_embeddings = true", "its loader requires output.weight")


class OlmoeGGUF(MoeGGUF):
    """llama.cpp's `olmoe`: q/k norms over the whole projection, top-k not renormalized."""

    def config(self, meta, cfg, held):
        super().config(meta, cfg, held)
        cfg["clip_qkv"] = None

    def check_writable(self, cfg):
        super().check_writable(cfg)
        if cfg.get("clip_qkv") is not None:
            self.refuse(cfg, f"clip_qkv = {cfg['clip_qkv']}", "its olmoe graph does not clamp q, k, v")
        kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        if kv != cfg["num_attention_heads"]:
            self.refuse(cfg, f"num_key_value_heads = {kv} (of {cfg['num_attention_heads']} heads)",
                        "its loader sizes the k norm as the hidden size")
        if cfg.get("tie_word_embeddings"):
            self.refuse(cfg, "tie_word_embeddings = true", "its loader requires output.weight")


QWEN3MOE = Qwen3MoeGGUF("qwen3_moe", "Qwen3MoeForCausalLM", LAYER_NAMES)
QWEN2MOE = Qwen2MoeGGUF("qwen2_moe", "Qwen2MoeForCausalLM", {**LAYER_NAMES, **SHARED_EXPERT_NAMES})
OLMOE = OlmoeGGUF("olmoe", "OlmoeForCausalLM", LAYER_NAMES)


@hookimpl
def rlx_register_gguf_architectures(register):
    register("qwen3moe", QWEN3MOE)
    register("qwen2moe", QWEN2MOE)
    register("olmoe", OLMOE)


__all__ = ["EXPERT_NAMES", "LAYER_NAMES", "SHARED_EXPERT_NAMES", "MoeGGUF", "Qwen3MoeGGUF", "Qwen2MoeGGUF",
           "OlmoeGGUF", "QWEN3MOE", "QWEN2MOE", "OLMOE"]
