"""Qwen35Flow (the logits / prefill / decode flows of Qwen3.5, Qwen3.5-MoE and Qwen3-Next) and
the registered recipes.

Layers by `layer_types`: a `GdnScan` stage (Gated DeltaNet with its conv and recurrent state
leaves) on linear-attention layers, `GatedAttention` (with the core's KV cache) on full ones;
the MLP dense or routed experts + a gated shared expert. Inputs are the core's `CausalLM`
contract (rlx_core.flow.recipe.DecoderFlow). A vision-language checkpoint (`qwen3_5`,
`qwen3_5_moe` with a vision tower) loads as its text model: the tower's and the multi-token
prediction head's tensors are dropped by name (`text_tensors`).
"""
from __future__ import annotations

import re

import attrs
import numpy as np

from rlx_core.flow import ModelFlow
from rlx_core.flow.recipe import DecoderFlow
from rlx_core.ir.errors import WeightError
from rlx_core.runtime.model import CausalLM

from .blocks import GatedAttention, GdnScan, Qwen35DecoderLayer, attn_spec, dense_mlp, sparse_moe
from .config import FAMILIES, Qwen35Arch, qwen35_arch, text_config

ONE = 1.0


class Qwen35Flow(DecoderFlow):
    """Recipe: the flow of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config.

        Qwen35Flow.for_decode(cfg).flow().build(weights)
    """
    family = "qwen35"
    profile_family = "qwen35"

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        cfg = text_config(cfg)
        self.arch: Qwen35Arch = qwen35_arch(cfg)
        super().__init__(cfg, mode, batch, seq)

    def spec(self, i: int):
        return attn_spec(self.arch, self.mode)

    def mixer(self, i: int):
        if self.arch.is_linear(i):
            return GdnScan(self.arch, decode=self.mode == "decode",
                           fused_inputs=self.arch.family == "qwen3_next")
        return GatedAttention(self.spec(i))

    def mlp(self, i: int):
        return sparse_moe(self.arch) if self.arch.moe_layers[i] else dense_mlp(self.arch)

    def default_layer(self, i: int):
        return Qwen35DecoderLayer(self.mixer(i), self.mlp(i), self.arch.eps)

    def num_layers(self) -> int:
        return self.arch.layers

    def head(self, f: ModelFlow) -> ModelFlow:
        a = self.arch
        f.final_norm(a.eps, offset=ONE)
        if self._last:
            f.gather_last_token()
        return f.lm_head(a.vocab, a.hidden, tied=a.tied)


# checkpoint prefixes: a vision-language model's language model, and what is not text
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_DROPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def text_tensors(tensors: dict) -> dict:
    """The language model's tensors under the text model's names: a vision-language
    checkpoint's prefixes mapped, the vision tower and the multi-token-prediction head
    dropped, and routed experts as stacks `<...>.experts.gate_proj.weight` / `up_proj.weight`
    [E, I, H] and `down_proj.weight` [E, H, I] (GGUF's ffn_*_exps): from a fused
    `gate_up_proj` [E, 2I, H] (split) or from one tensor per expert (stacked)."""
    out, per_expert = {}, {}
    for k, v in tensors.items():
        if k.startswith(_DROPPED):
            continue
        for old, new in _TEXT_PREFIXES:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        hit = _PER_EXPERT.match(k)
        if hit:
            per_expert.setdefault((hit[1], hit[3]), {})[int(hit[2])] = v
        elif k.endswith(".experts.gate_up_proj"):
            out.update(_split_gate_up(k, v))
        else:
            out[k] = v
    for (base, which), rows in per_expert.items():
        n = max(rows) + 1
        gaps = [e for e in range(n) if e not in rows]
        if gaps:
            raise WeightError(f"missing tensor {base}.{gaps[0]}.{which}_proj.weight (experts 0..{n - 1} "
                              f"are stacked; {len(gaps)} absent)")
        out[f"{base}.{which}_proj.weight"] = np.stack([np.asarray(rows[e]) for e in range(n)])
    return out


def _split_gate_up(key: str, v) -> dict:
    arr = np.asarray(v)
    if arr.ndim != 3 or arr.shape[1] % 2:
        raise WeightError(f"{key}: expected [experts, 2 * moe_intermediate_size, hidden], "
                          f"got {list(arr.shape)}")
    half, base = arr.shape[1] // 2, key[: -len("gate_up_proj")]
    return {base + "gate_proj.weight": arr[:, :half], base + "up_proj.weight": arr[:, half:]}


def split_qkvz(a: Qwen35Arch, tensors: dict) -> dict:
    """Each in_proj_qkvz [Hk * (2K + 2rV), hidden] (grouped by key head) as in_proj_qkv (every
    head's q, then k, then v) and in_proj_z, as llama.cpp's converter splits it."""
    out = {}
    r = a.v_heads // a.k_heads
    cuts = np.cumsum([a.k_dim, a.k_dim, r * a.v_dim])
    for k, v in tensors.items():
        if not k.endswith(".linear_attn.in_proj_qkvz.weight"):
            out[k] = v
            continue
        w = np.asarray(v)
        q, kk, vv, z = np.split(w.reshape(a.k_heads, -1, w.shape[-1]), cuts, axis=1)
        base = k[: -len("in_proj_qkvz.weight")]
        out[base + "in_proj_qkv.weight"] = np.concatenate([t.reshape(-1, w.shape[-1]) for t in (q, kk, vv)])
        out[base + "in_proj_z.weight"] = z.reshape(-1, w.shape[-1])
    return out


REQUIRED = ("A_log", "dt_bias")


def check_linear_tensors(arch: Qwen35Arch, tensors: dict, source: str) -> None:
    """A linear-attention layer without its decay parameters is a WeightError naming the
    tensor (before any graph is built)."""
    for i in range(arch.layers):
        if arch.is_linear(i):
            for name in REQUIRED:
                key = f"model.layers.{i}.linear_attn.{name}"
                if key not in tensors:
                    raise WeightError(f"{source}: missing tensor {key!r} (layer {i} is a linear-attention "
                                      f"layer: its decay needs {name})")


class Qwen35Recipe:
    """Registered recipe: checkpoint -> CausalLM (whose graphs keep the recurrent states
    beside the KV cache)."""
    name = "qwen35"
    model_types: tuple = tuple(FAMILIES)
    flow_class = Qwen35Flow
    default_profile = "qwen35_prefill"
    ignore_unused = ("rotary_emb.inv_freq",)

    def flow(self, cfg: dict, mode: str, taps: bool = False) -> ModelFlow:
        return self.flow_class(cfg, mode).taps(taps).flow()

    def build(self, ckpt, backend=None, profile=None, **kw):
        cfg = text_config(ckpt.config)
        arch = qwen35_arch(cfg)                  # a bad config fails here, before any compile
        if kw.get("max_context"):
            cfg["max_position_embeddings"] = min(kw["max_context"], arch.max_positions)
        tensors = text_tensors(ckpt.tensors)
        if arch.tied:
            tensors.pop("lm_head.weight", None)
        check_linear_tensors(arch, tensors, str(ckpt.path))
        return CausalLM(self, cfg, tensors, ckpt.tokenizer, backend, profile, source=ckpt.path, **kw)

    def gguf_checkpoint(self, ckpt):
        """The checkpoint as `rlx quantize` writes it: the text model's config and tensors
        (experts stacked) and, for Qwen3-Next, in_proj_qkvz split into in_proj_qkv and
        in_proj_z (llama.cpp's attn_qkv / attn_gate)."""
        cfg = text_config(ckpt.config)
        arch = qwen35_arch(cfg)
        if cfg.get("intermediate_size") is None:      # (Qwen3.5-MoE has no dense MLP; GGUF's generic
            cfg["intermediate_size"] = arch.moe_intermediate      # feed_forward_length is required)
        tensors = text_tensors(ckpt.tensors)
        if arch.family == "qwen3_next":
            tensors = split_qkvz(arch, tensors)
        return attrs.evolve(ckpt, config=cfg, tensors=tensors)

    # -- the conformance kit's tiny model (rlx_core.testing.recipes)
    def tiny_config(self) -> dict:
        """Two linear-attention layers and a full one, 2 value heads per key head."""
        return dict(model_type="qwen3_5_text", vocab_size=61, hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=48, num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=64,
                    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5},
                    tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random HF-named tensors for `cfg` (norm weights of (1 + w) around 0)."""
        return random_tensors(qwen35_arch(cfg), rng)


def random_tensors(a: Qwen35Arch, rng) -> dict:
    """Random tensors of the text model's names for `a` (experts already split)."""
    h, d = a.hidden, a.head_dim
    shapes = {"model.embed_tokens.weight": (a.vocab, h), "model.norm.weight": (h,)}
    if not a.tied:
        shapes["lm_head.weight"] = (a.vocab, h)
    kd, vd = a.k_heads * a.k_dim, a.v_heads * a.v_dim
    for i in range(a.layers):
        p = f"model.layers.{i}."
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        if a.is_linear(i):
            lin = {"conv1d.weight": (a.conv_channels, 1, a.conv_width), "A_log": (a.v_heads,),
                   "dt_bias": (a.v_heads,), "norm.weight": (a.v_dim,), "out_proj.weight": (h, vd)}
            if a.family == "qwen3_next":
                lin.update({"in_proj_qkvz.weight": (2 * kd + 2 * vd, h),
                            "in_proj_ba.weight": (2 * a.v_heads, h)})
            else:
                lin.update({"in_proj_qkv.weight": (2 * kd + vd, h), "in_proj_z.weight": (vd, h),
                            "in_proj_b.weight": (a.v_heads, h), "in_proj_a.weight": (a.v_heads, h)})
            layer.update({f"linear_attn.{k}": s for k, s in lin.items()})
        else:
            attn = {"q_proj.weight": (2 * a.heads * d, h), "k_proj.weight": (a.kv_heads * d, h),
                    "v_proj.weight": (a.kv_heads * d, h), "o_proj.weight": (h, a.heads * d),
                    "q_norm.weight": (d,), "k_norm.weight": (d,)}
            layer.update({f"self_attn.{k}": s for k, s in attn.items()})
        if a.moe_layers[i]:
            e, mi, si = a.experts, a.moe_intermediate, a.shared_intermediate
            mlp = {"gate.weight": (e, h), "experts.gate_proj.weight": (e, mi, h),
                   "experts.up_proj.weight": (e, mi, h), "experts.down_proj.weight": (e, h, mi),
                   "shared_expert.gate_proj.weight": (si, h),
                   "shared_expert.up_proj.weight": (si, h), "shared_expert.down_proj.weight": (h, si),
                   "shared_expert_gate.weight": (1, h)}
        else:
            mlp = {"gate_proj.weight": (a.intermediate, h), "up_proj.weight": (a.intermediate, h),
                   "down_proj.weight": (h, a.intermediate)}
        layer.update({f"mlp.{k}": s for k, s in mlp.items()})
        shapes.update({p + k: s for k, s in layer.items()})
    return {k: (0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


__all__ = ["Qwen35Flow", "Qwen35Recipe", "text_tensors", "random_tensors", "check_linear_tensors",
           "split_qkvz"]
