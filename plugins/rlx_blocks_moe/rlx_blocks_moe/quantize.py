"""`rlx quantize` for the MoE families: the core writer on the recipe's `gguf_checkpoint`
(experts stacked into llama.cpp's 3-D ffn_*_exps; Mixtral under llama.cpp's `llama`)."""
from __future__ import annotations

from rlx_core.ir.errors import ModelError
from rlx_core.plugins import registry
from rlx_core.weights.gguf_write import write_gguf


def write_moe_gguf(ckpt, dst, scheme, echo=print) -> dict:
    """Write the MoE checkpoint `ckpt` (an HF folder's) to the GGUF file `dst` in `scheme`."""
    mt = ckpt.config.get("model_type")
    recipe = registry().recipes.get(mt)
    if not callable(getattr(recipe, "gguf_checkpoint", None)):
        raise ModelError(f"{ckpt.path}: model_type {mt!r} is not an MoE family of rlx-blocks-moe")
    return write_gguf(recipe.gguf_checkpoint(ckpt), dst, scheme, echo=echo)


__all__ = ["write_moe_gguf"]
