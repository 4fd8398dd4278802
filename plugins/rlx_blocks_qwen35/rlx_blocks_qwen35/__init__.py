"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next for RLX: hybrid decoders of Gated DeltaNet layers (a
`GdnScan` stage with a short-conv state and a recurrent state) beside gated full-attention
layers, by `layer_types`; dense or routed-expert MLPs. Registered through the rlx plugin
hooks for model types qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text and qwen3_next
(text only: a vision tower's tensors are dropped). Installed separately:
`pip install ./plugins/rlx_blocks_qwen35`.
"""
from __future__ import annotations

from rlx_core.plugins import hookimpl

from .blocks import (QWEN35_BLOCKS, GatedAttention, GdnScan, Qwen35DecoderLayer, attn_spec, dense_mlp,
                     sparse_moe)
from .config import FULL, LINEAR, Qwen35Arch, qwen35_arch, text_config
from .gguf import rlx_register_gguf_architectures  # noqa: F401
from .recipes import Qwen35Flow, Qwen35Recipe, random_tensors, text_tensors


@hookimpl
def rlx_register_recipes(register):
    register(Qwen35Recipe())


@hookimpl
def rlx_register_blocks(register):
    for name, factory in QWEN35_BLOCKS.items():
        register(name, factory)


__all__ = ["Qwen35Flow", "Qwen35Recipe", "Qwen35Arch", "qwen35_arch", "text_config",
           "text_tensors", "random_tensors", "GatedAttention", "GdnScan", "sparse_moe", "dense_mlp",
           "Qwen35DecoderLayer", "attn_spec", "LINEAR", "FULL"]
