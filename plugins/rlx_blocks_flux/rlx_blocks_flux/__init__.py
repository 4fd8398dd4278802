"""FLUX for RLX: the FLUX.1 (`FluxTransformer2DModel`) and FLUX.2 (`Flux2Transformer2DModel`)
diffusion transformers of diffusers as blocks (double-stream, single-stream) over the core's
streams and DiT pieces, the recipes that load a diffusers transformer folder, and a
flow-matching Euler sampler. Installed separately: `pip install ./plugins/rlx_blocks_flux`.
"""
from __future__ import annotations

from rlx_core.plugins import hookimpl

from .blocks import FLUX_BLOCKS, FluxDoubleBlock, FluxSingleBlock
from .config import FluxArch, flux_arch
from .model import FluxModel, flow_match_sigmas, flux1_mu, flux2_mu, latent_ids
from .recipes import Flux2Recipe, FluxFlow, FluxRecipe, tensor_shapes


@hookimpl
def rlx_register_recipes(register):
    register(FluxRecipe())
    register(Flux2Recipe())


@hookimpl
def rlx_register_blocks(register):
    for name, factory in FLUX_BLOCKS.items():
        register(name, factory)


__all__ = ["FluxFlow", "FluxRecipe", "Flux2Recipe", "FluxModel", "FluxArch", "flux_arch", "FluxDoubleBlock",
           "FluxSingleBlock", "flow_match_sigmas", "flux1_mu", "flux2_mu", "latent_ids", "tensor_shapes"]
