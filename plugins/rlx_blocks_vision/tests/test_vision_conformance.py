"""The conformance kit (rlx_core.testing) on the vision recipes: fused against composed, and
each image (and text) of a batch against itself alone (a VisionModel gives the kit its own
inputs: pixels, and token ids for the text towers)."""
from rlx_core.testing.recipe_suite import *  # noqa: F401,F403

RLX_RECIPES = ("vit", "dinov2", "clip", "siglip", "siglip2")
