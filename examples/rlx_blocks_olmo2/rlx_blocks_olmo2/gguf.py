"""OLMo 2 GGUF files, both ways (llama.cpp's `olmo2` architecture): `rlx quantize` writes them
and `rlx_core.load` reads them (and llama.cpp's own converter's) through this mapping.

llama.cpp's converter (convert_hf_to_gguf.py, `Olmo2Model`) renames the tensors and writes only
the generic metadata keys, which the core reads and writes itself: no value is transformed (no
rope row permutation: llama.cpp runs OLMo 2's rope in the NeoX layout HF uses), and the QK
norms keep their full heads * head_dim width. So the mapping is names alone."""
from __future__ import annotations

from rlx_core.ir.errors import WeightError
from rlx_core.plugins import hookimpl
from rlx_core.weights.config import config_source
from rlx_core.weights.gguf_arch import STANDARD_LAYER_NAMES, GGUFArchitecture

# blk.N.<GGUF leaf> -> model.layers.N.<HF leaf>: gguf-py's MODEL_TENSORS[MODEL_ARCH.OLMO2]
LAYER_NAMES = {
    **STANDARD_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class Olmo2GGUF(GGUFArchitecture):
    """llama.cpp's `olmo2`: the generic keys, SwiGLU (llama.cpp's graph hard-codes silu), no biases."""

    def gguf_name(self, hf):
        """None for a bias (an `attention_bias` model): llama.cpp's olmo2 has no bias tensors, so
        `rlx quantize` refuses such a model, naming the tensor, instead of writing a file that
        llama.cpp cannot load."""
        return None if hf.endswith(".bias") else super().gguf_name(hf)

    def config(self, meta, cfg, held):
        cfg["hidden_act"] = "silu"

    def write_metadata(self, writer, cfg, head_dim):
        """The generic keys suffice; but llama.cpp sizes OLMo 2's heads as hidden / heads, so a
        model whose head_dim says otherwise is refused rather than written unreadable."""
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        if head_dim * heads != hidden:
            raise WeightError(f"{config_source(cfg)}: head_dim {head_dim} x {heads} heads is not "
                              f"hidden_size {hidden}; GGUF architecture 'olmo2' (llama.cpp) takes head_dim = "
                              "hidden_size / num_attention_heads, so this model has no GGUF form")
        super().write_metadata(writer, cfg, head_dim)


OLMO2 = Olmo2GGUF("olmo2", "Olmo2ForCausalLM", LAYER_NAMES)


@hookimpl
def rlx_register_gguf_architectures(register):
    register("olmo2", OLMO2)
