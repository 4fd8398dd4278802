"""The conformance kit (rlx_core.testing) on the FLUX recipes: fused against composed, and
each sample of a batch against itself alone (a FluxModel gives the kit its own inputs)."""
from rlx_core.testing.recipe_suite import *  # noqa: F401,F403

RLX_RECIPES = ("flux", "flux2")
