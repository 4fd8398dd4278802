"""The conformance kit's recipe checks (rlx_core.testing) on the qwen35 recipe: fused against
composed, batch against one row at a time, and decode with the KV cache and the recurrent
states against recompute, on the recipe's tiny random model."""
from rlx_core.testing.recipe_suite import *  # noqa: F401,F403

RLX_RECIPES = ("qwen35",)
