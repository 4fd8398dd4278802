"""The conformance kit's recipe checks (rlx_core.testing) on the OLMo 2 recipe: fused against
composed, a padded batch against each row alone, decode with the KV cache against recompute,
on the tiny random model of `Olmo2Recipe.tiny_config()` / `tiny_tensors()`."""
from rlx_core.testing.recipe_suite import *  # noqa: F401,F403

RLX_RECIPES = ("olmo2",)
