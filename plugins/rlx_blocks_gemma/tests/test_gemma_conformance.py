"""The conformance kit's recipe checks (rlx_core.testing) on this plugin's recipes: fused
against composed, batch against one row at a time (and, for causal LMs, decode with the KV
cache against recompute), on tiny random models built from the recipes' tiny configs."""
from rlx_core.testing.recipe_suite import *  # noqa: F401,F403

RLX_RECIPES = ("gemma2", "gemma3")
