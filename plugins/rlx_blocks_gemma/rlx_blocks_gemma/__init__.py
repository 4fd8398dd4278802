"""Gemma 2 / Gemma 3 for RLX: blocks (Gemma RMSNorm, GeGLU, Gemma attention with a
sliding-window ring-buffer KV cache, the decoder layer) and the recipes Gemma2Flow and
Gemma3Flow, registered through the rlx plugin hooks for model types `gemma2`,
`gemma3_text` and `gemma3` (the multimodal HF config's text model, and the GGUF
architecture). Installed separately: `pip install ./plugins/rlx_blocks_gemma`.
"""
from __future__ import annotations

from rlx_core.plugins import hookimpl

from .blocks import GEMMA_BLOCKS, GeGLU, GemmaAttention, GemmaDecoderLayer, GemmaRmsNorm, gemma_rope
from .config import GemmaArch, gemma_arch, text_config
from .gguf import rlx_register_gguf_architectures  # noqa: F401
from .recipes import (Gemma2Flow, Gemma2Recipe, Gemma3Flow, Gemma3Recipe, GemmaFlow, GemmaLM,
                      GemmaRecipe, LayerCtx, attn_spec, text_tensors)
from .packaged import rlx_register_packaged_models  # noqa: F401


@hookimpl
def rlx_register_recipes(register):
    register(Gemma2Recipe())
    register(Gemma3Recipe())


@hookimpl
def rlx_register_blocks(register):
    for name, factory in GEMMA_BLOCKS.items():
        register(name, factory)


__all__ = ["Gemma2Flow", "Gemma3Flow", "GemmaFlow", "GemmaLM", "GemmaRecipe", "Gemma2Recipe",
           "Gemma3Recipe", "LayerCtx", "attn_spec", "GemmaArch", "gemma_arch", "text_config",
           "text_tensors", "GemmaRmsNorm", "GeGLU", "GemmaAttention", "GemmaDecoderLayer",
           "gemma_rope"]
