"""The recipe conformance checks (rlx_core.testing.recipes) as tests, one per recipe the kit's
pytest plugin picks (`--rlx-recipe`, else the test module's `RLX_RECIPES`, else every
registered recipe), on `--rlx-backend` or numpy. A plugin's tests pull them in with

    from rlx_core.testing.recipe_suite import *  # noqa: F401,F403
    RLX_RECIPES = ("myrecipe",)
"""
from __future__ import annotations

from .recipes import (check_batch_equals_rows, check_decode_equals_recompute, check_fused_equals_composed,
                      rlx_recipe, tiny_checkpoint)
from .session import rng  # noqa: F401


def test_fused_equals_composed(rlx_recipe, rng):
    check_fused_equals_composed(rlx_recipe, tiny_checkpoint(rlx_recipe, rng), rng)


def test_decode_with_cache_equals_recompute(rlx_recipe, rng):
    check_decode_equals_recompute(rlx_recipe, tiny_checkpoint(rlx_recipe, rng), rng)


def test_batch_equals_one_by_one(rlx_recipe, rng):
    check_batch_equals_rows(rlx_recipe, tiny_checkpoint(rlx_recipe, rng), rng)


__all__ = ["rlx_recipe", "rng", "test_batch_equals_one_by_one", "test_decode_with_cache_equals_recompute",
           "test_fused_equals_composed"]
