"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next GGUF files, both ways (llama.cpp's `qwen35`, `qwen35moe`
and `qwen3next` architectures), as llama.cpp's converter writes them:

* names: attn_qkv / attn_gate (in_proj_qkv / in_proj_z), ssm_beta / ssm_alpha (in_proj_b / _a;
  Qwen3-Next: ssm_ba, in_proj_ba), ssm_conv1d (squeezed to [C, W]), ssm_a, ssm_dt.bias,
  ssm_norm, ssm_out; routed experts as ffn_*_exps stacks, the shared expert as ffn_*_shexp;
* values: the (1 + w) RMSNorms stored as 1 + w (not the gated ssm_norm), ssm_a = -exp(A_log);
  Qwen3.5 files hold the value heads *tiled* over the key heads ([K0 v0, K1 v0, ..., K0 v1,
  ...]) where transformers groups them ([K0 v0, K0 v1, ..., K1 v0, ...]): loading puts the
  rows back in HF's order (a row permutation, which packed rows allow too), and out_proj's
  columns, which a packed tensor cannot permute, stay tiled with `linear_value_head_order =
  "tiled"` in the config (the GdnScan stage orders its heads to match);
* metadata: ssm.conv_kernel, ssm.state_size (key head dim), ssm.group_count (key heads),
  ssm.time_step_rank (value heads), ssm.inner_size, full_attention_interval (every n-th layer
  full: a layer_types of another pattern is refused), rope.dimension_count (the rotary width),
  rope.dimension_sections (Qwen3.5's mRoPE), expert counts and sizes.
A Qwen3-Next file written by `rlx quantize` splits in_proj_qkvz into attn_qkv and attn_gate as
llama.cpp does (recipes.Qwen35Recipe.gguf_checkpoint).
"""
from __future__ import annotations

import numpy as np

from rlx_core.ir.errors import WeightError
from rlx_core.plugins import hookimpl
from rlx_core.weights.gguf_arch import STANDARD_LAYER_NAMES, GGUFArchitecture, write_rope_scaling

from .config import FULL, LINEAR, qwen35_arch

LAYER_NAMES = {
    **STANDARD_LAYER_NAMES,
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# tensors whose HF names have no .weight / .bias leaf: GGUF name leaf <-> HF leaf
BARE = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
DEFAULT_MROPE = [11, 11, 10, 0]        # llama.cpp's default sections (its loaders require the key)


def _blk(name: str) -> tuple:
    """("N", leaf) of 'blk.N.<leaf>', or (None, None)."""
    if not name.startswith("blk."):
        return None, None
    idx, _, leaf = name[4:].partition(".")
    return (idx, leaf) if idx.isdigit() else (None, None)


def _regroup(w: np.ndarray, axis: int, outer: int, inner: int, size: int) -> np.ndarray:
    """Along `axis` (outer x inner units of `size`), swap outer and inner: grouped value heads
    [Hk, r, d] -> tiled [r, Hk, d] with (outer, inner) = (Hk, r), and back with (r, Hk)."""
    shape = list(w.shape)
    if shape[axis] != outer * inner * size:
        raise WeightError(f"a tensor of shape {shape} does not split into {outer} x {inner} heads of "
                          f"{size} along axis {axis}")
    v = w.reshape(shape[:axis] + [outer, inner, size] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(v, axis, axis + 1)).reshape(shape)


def _is_one_plus_norm(gguf_name: str) -> bool:
    """Norms llama.cpp stores as 1 + w (the gated ssm_norm holds w itself)."""
    return gguf_name.endswith("norm.weight") and not gguf_name.endswith("ssm_norm.weight")


class Qwen35GGUF(GGUFArchitecture):
    """One of llama.cpp's qwen35 / qwen35moe / qwen3next architectures; `tiled`: its value
    heads are stored tiled (the Qwen3.5 converters)."""

    tiled: bool = True
    mrope: bool = True

    # -- names
    def hf_name(self, gguf_name):
        idx, leaf = _blk(gguf_name)
        if leaf in BARE:
            return f"model.layers.{idx}.{BARE[leaf]}"
        return super().hf_name(gguf_name)

    def gguf_name(self, hf):
        for leaf, hf_leaf in BARE.items():
            if hf.startswith("model.layers.") and hf.endswith("." + hf_leaf):
                idx = hf[len("model.layers."):].partition(".")[0]
                return f"blk.{idx}.{leaf}"
        return super().gguf_name(hf)

    # -- values
    def _heads(self, config: dict) -> tuple:
        """(key heads, value heads per key head, key dim, value dim)."""
        hk, h = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        return hk, h // hk, int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])

    def _reorder(self, leaf: str, w: np.ndarray, config: dict, to_tiled: bool) -> np.ndarray:
        """Value-head rows between HF's grouped order and llama.cpp's tiled one (both ways);
        out_proj's columns only towards the file (loading keeps them tiled: see the module)."""
        hk, r, kd, vd = self._heads(config)
        if not self.tiled or r == 1:
            return w
        outer, inner = (hk, r) if to_tiled else (r, hk)
        if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
            qk = 2 * hk * kd
            return np.concatenate([w[:qk], _regroup(w[qk:], 0, outer, inner, vd)], 0)
        if leaf == "attn_gate.weight":
            return _regroup(w, 0, outer, inner, vd)
        if leaf in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            return _regroup(w, 0, outer, inner, 1)
        if leaf == "ssm_out.weight" and to_tiled:
            return _regroup(w, 1, outer, inner, vd)
        return w

    def from_gguf(self, gguf_name, w, config, path):
        _, leaf = _blk(gguf_name)
        try:
            if leaf is not None:
                w = self._reorder(leaf, w, config, to_tiled=False)
        except WeightError as e:
            raise WeightError(f"{path}: tensor {gguf_name!r}: {e}") from None
        if leaf == "ssm_a":
            return np.log(-w.astype(np.float32))                   # A = -exp(A_log)
        if leaf == "ssm_conv1d.weight" and w.ndim == 2:
            return w[:, None, :]                                    # HF's Conv1d [C, 1, W]
        return w - np.float32(1.0) if _is_one_plus_norm(gguf_name) else w

    def to_gguf(self, gguf_name, w, config, hf):
        _, leaf = _blk(gguf_name)
        if leaf == "ssm_a":
            w = -np.exp(w)
        elif leaf == "ssm_conv1d.weight" and w.ndim == 3:
            w = w[:, 0, :]
        elif _is_one_plus_norm(gguf_name):
            w = w + np.float32(1.0)
        return self._reorder(leaf, w, config, to_tiled=True) if leaf is not None else w

    # -- metadata
    def config(self, meta, cfg, held):
        cfg["hidden_act"] = "silu"
        hk = meta.num("ssm.group_count", to="linear_num_key_heads")
        h = meta.num("ssm.time_step_rank", to="linear_num_value_heads")
        inner = meta.num("ssm.inner_size", to="linear_value_head_dim")
        if h % hk or inner % h:
            raise WeightError(f"{meta.path}: GGUF metadata {meta.key('ssm.time_step_rank')} = {h} must be a "
                              f"multiple of {meta.key('ssm.group_count')} = {hk}, and "
                              f"{meta.key('ssm.inner_size')} = {inner} a multiple of it")
        every = meta.num("full_attention_interval", 4, to="layer_types")
        rot = meta.num("rope.dimension_count", cfg["head_dim"], to="partial_rotary_factor")
        layers = range(cfg["num_hidden_layers"])
        cfg.update(linear_num_key_heads=hk, linear_num_value_heads=h, linear_value_head_dim=inner // h,
                   linear_key_head_dim=meta.num("ssm.state_size", to="linear_key_head_dim"),
                   linear_conv_kernel_dim=meta.num("ssm.conv_kernel", to="linear_conv_kernel_dim"),
                   layer_types=[LINEAR if (i + 1) % every else FULL for i in layers],
                   partial_rotary_factor=rot / cfg["head_dim"])
        if self.tiled and h != hk:
            cfg["linear_value_head_order"] = "tiled"
        experts = meta.num("expert_count", 0, lo=0, to="num_experts")
        if experts:
            inter = meta.num("expert_feed_forward_length", to="moe_intermediate_size")
            shared = meta.num("expert_shared_feed_forward_length", to="shared_expert_intermediate_size")
            cfg.update(num_experts=experts,
                       num_experts_per_tok=meta.num("expert_used_count", to="num_experts_per_tok"),
                       moe_intermediate_size=inter, shared_expert_intermediate_size=shared,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

    def write_metadata(self, writer, cfg, head_dim):
        a = qwen35_arch(cfg)
        if a.family == "qwen3_next" and not all(a.moe_layers):
            raise WeightError("a Qwen3-Next config with dense MLP layers (mlp_only_layers / "
                              "decoder_sparse_step) cannot be written to GGUF: llama.cpp's qwen3next has "
                              "routed experts on every layer")
        writer.add_rope_dimension_count(a.rotary_dim)
        if self.mrope:
            rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
            sections = list(rp.get("mrope_section") or DEFAULT_MROPE)
            writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
        writer.add_ssm_conv_kernel(a.conv_width)
        writer.add_ssm_state_size(a.k_dim)
        writer.add_ssm_group_count(a.k_heads)
        writer.add_ssm_time_step_rank(a.v_heads)
        writer.add_ssm_inner_size(a.v_heads * a.v_dim)
        writer.add_full_attention_interval(_interval(a.layer_types))
        if a.experts:
            writer.add_expert_count(a.experts)
            writer.add_expert_used_count(a.top_k)
            writer.add_expert_feed_forward_length(a.moe_intermediate)
            writer.add_expert_shared_feed_forward_length(a.shared_intermediate)
        write_rope_scaling(writer, cfg)


def _interval(types: tuple) -> int:
    """n of 'every n-th layer is full attention' that gives `types`; a WeightError otherwise."""
    full = [i for i, t in enumerate(types) if t == FULL]
    n = full[0] + 1 if full else len(types) + 1
    if any((t == FULL) != ((i + 1) % n == 0) for i, t in enumerate(types)):
        raise WeightError(f"layer_types {list(types)} is not 'every n-th layer full attention'; GGUF "
                          "states the layer kinds only as full_attention_interval")
    return n


class Qwen3NextGGUF(Qwen35GGUF):
    tiled = False
    mrope = False


QWEN35 = Qwen35GGUF("qwen3_5_text", "Qwen3_5ForCausalLM", LAYER_NAMES)
QWEN35MOE = Qwen35GGUF("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", LAYER_NAMES)
QWEN3NEXT = Qwen3NextGGUF("qwen3_next", "Qwen3NextForCausalLM", LAYER_NAMES)


@hookimpl
def rlx_register_gguf_architectures(register):
    register("qwen35", QWEN35)
    register("qwen35moe", QWEN35MOE)
    register("qwen3next", QWEN3NEXT)


__all__ = ["Qwen35GGUF", "Qwen3NextGGUF", "QWEN35", "QWEN35MOE", "QWEN3NEXT", "LAYER_NAMES"]
