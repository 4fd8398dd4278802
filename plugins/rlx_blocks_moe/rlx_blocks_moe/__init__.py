"""Mixture-of-experts decoders for RLX: the recipes Qwen3-MoE (`qwen3_moe`), Qwen2-MoE
(`qwen2_moe`), Mixtral (`mixtral`) and OLMoE (`olmoe`), HF folders and GGUF files (llama.cpp's
`qwen3moe`, `qwen2moe`, `olmoe`;
Mixtral GGUFs are llama.cpp's `llama` with experts, which the LLaMA plugin hands to the
`mixtral` mapping registered here), registered through the rlx plugin hooks."""
from __future__ import annotations

from rlx_core.plugins import hookimpl

from .config import FAMILIES, Routing, routing, sparse_layers
from .gguf import rlx_register_gguf_architectures  # noqa: F401
from .recipes import (RECIPES, MixtralFlow, MixtralRecipe, MoeFlow, MoeRecipe, OlmoeFlow, OlmoeRecipe,
                      Qwen2MoeFlow, Qwen2MoeRecipe, Qwen3MoeFlow, Qwen3MoeRecipe, routed_experts,
                      WholeQKNormAttention)
from .weights import stack_experts


@hookimpl
def rlx_register_recipes(register):
    for recipe in RECIPES:
        register(recipe())


__all__ = ["FAMILIES", "Routing", "routing", "sparse_layers", "MoeFlow", "Qwen3MoeFlow", "Qwen2MoeFlow",
           "MixtralFlow", "OlmoeFlow", "MoeRecipe", "Qwen3MoeRecipe", "Qwen2MoeRecipe", "MixtralRecipe",
           "OlmoeRecipe", "routed_experts",
           "WholeQKNormAttention", "stack_experts"]
