"""The conformance kit's recipe checks (rlx_core.testing) on this plugin's recipes: fused
against composed, batch against one row at a time and decode with the KV cache against
recompute, on the recipes' tiny random models (8 experts, top-2; per-expert tensors)."""
from rlx_core.testing.recipe_suite import *  # noqa: F401,F403

RLX_RECIPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
