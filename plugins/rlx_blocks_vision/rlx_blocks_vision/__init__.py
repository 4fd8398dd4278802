"""Vision encoders for RLX: HF ViT, DINOv2 (+ registers), CLIP and SigLIP image towers, and
the CLIP / SigLIP text towers, so images and texts embed into one space. The blocks are
core's generic ones (rlx_core.flow.vision); this plugin reads each family's config and
checkpoint names, registers the recipes, and gives `rlx_core.load(folder)` a VisionModel:
`embed(images=[...])`, `embed(texts=[...])`, `similarity(images, texts)`."""
from __future__ import annotations

from rlx_core.flow.vision import VISION_BLOCKS
from rlx_core.plugins import hookimpl

from .config import TextArch, VisionArch
from .model import VisionModel
from .recipes import (RECIPES, ClipRecipe, Dinov2Recipe, Siglip2Recipe, SiglipRecipe, VisionRecipe, ViTRecipe,
                      text_flow, vision_flow)


@hookimpl
def rlx_register_recipes(register):
    for cls in RECIPES:
        register(cls())


@hookimpl
def rlx_register_blocks(register):
    for name, factory in VISION_BLOCKS.items():
        register(name, factory)


__all__ = ["VisionModel", "VisionRecipe", "ViTRecipe", "Dinov2Recipe", "ClipRecipe", "SiglipRecipe",
           "Siglip2Recipe", "VisionArch", "TextArch", "vision_flow", "text_flow"]
