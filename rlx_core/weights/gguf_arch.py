"""What a model family knows about its GGUF files, both ways: a `GGUFArchitecture`.

A family's plugin registers one per GGUF `general.architecture` value through the hook
`rlx_register_gguf_architectures`; `gguf_io` (loading), `gguf_write` (`rlx quantize`) and the
GGUF tokenizer look it up with `gguf_architecture`. The core keeps what every llama.cpp file
shares: the container, the quantization schemes, the generic `{arch}.*` keys (block count,
embedding length, head counts, rope base and linear scaling, ...) and the tokenizer metadata.
A mapping adds only what its family does differently; a subclass overrides the methods it needs.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from rlx_core.ir.errors import PluginError, WeightError

from .gguf_meta import _REQUIRED, meta_float, meta_int

# llama.cpp's names of the tensors outside the blocks, as most families' converters write them
STANDARD_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's names of a decoder block's attention and MLP tensors (blk.N.<leaf>) for HF's usual
# layout (model.layers.N.<leaf>); a family adds its norms, which is where families differ
STANDARD_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_LAYER = "model.layers."


@attrs.frozen
class MetadataReader:
    """Reads a GGUF file's `{arch}.<name>` metadata with bounds (a WeightError naming the file and
    the key otherwise) and records which config key came from which metadata key (`rlx inspect`)."""

    path: str
    metadata: dict
    arch: str
    sources: dict = attrs.field(factory=dict)

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def took(self, key: str, to: str) -> None:
        """Config key `to` was read from metadata `key` (when the file has it)."""
        if to and key in self.metadata:
            self.sources.setdefault(to, key)

    def num(self, name: str, default: Any = _REQUIRED, lo: int = 1, to: str = ""):
        """The integer `{arch}.<name>` >= lo; `default` when absent (required without one)."""
        self.took(self.key(name), to)
        return meta_int(self.path, self.metadata, self.key(name), default, lo)

    def real(self, name: str, default: Any, lo: float = 0.0, strict: bool = True, to: str = ""):
        """The finite number `{arch}.<name>` > lo (>= lo unless strict); `default` when absent."""
        self.took(self.key(name), to)
        return meta_float(self.path, self.metadata, self.key(name), default, lo, strict)


def write_rope_scaling(writer, cfg: dict) -> None:
    """The generic `{arch}.rope.scaling.*` keys of a config's linear rope scaling (gguf_write
    checked that any scaling is linear)."""
    import gguf

    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


@attrs.frozen
class GGUFArchitecture:
    """One GGUF architecture of a family: the HF `model_type` and class it loads as, tensor
    names both ways (`layer_names`: the leaf after `blk.N.` -> the HF name after
    `model.layers.N.`; `top_names`: the rest, by stem), the GGUF tensors transformers drops
    (`dropped`), and, in methods a subclass overrides, value transforms, metadata <-> config
    and the tokenizer quirk. The defaults do nothing beyond the generic keys core handles."""

    model_type: str
    hf_class: str
    layer_names: Mapping[str, str]
    top_names: Mapping[str, str] = STANDARD_TOP_NAMES
    dropped: frozenset = frozenset()

    # ------------------------------------------------------------------------------ names

    def hf_name(self, gguf_name: str) -> str | None:
        """The transformers name of a GGUF tensor; None for a dropped one; an unknown one
        keeps its GGUF name, so the model builder reports it."""
        if gguf_name in self.dropped:
            return None
        if m := _BLOCK.match(gguf_name):
            layer, leaf, kind = m.groups()
            if leaf in self.layer_names:
                return f"{_LAYER}{layer}.{self.layer_names[leaf]}.{kind}"
        else:
            stem, _, kind = gguf_name.rpartition(".")
            if stem in self.top_names:
                return f"{self.top_names[stem]}.{kind}"
        return gguf_name

    def gguf_name(self, hf: str) -> str | None:
        """The GGUF name `rlx quantize` writes an HF tensor under; None when it has none."""
        stem, _, kind = hf.rpartition(".")
        if stem.startswith(_LAYER):
            idx, _, leaf = stem[len(_LAYER):].partition(".")
            gguf_leaf = next((g for g, h in self.layer_names.items() if h == leaf), None)
            if gguf_leaf is not None:
                return f"blk.{idx}.{gguf_leaf}.{kind}"
        else:
            top = next((g for g, h in self.top_names.items() if h == stem), None)
            if top is not None:
                return f"{top}.{kind}"
        return None

    # ------------------------------------------------------------------------------ values

    def from_gguf(self, gguf_name: str, w: np.ndarray, config: dict, path: str) -> np.ndarray:
        """Undo what llama.cpp's converter did to a tensor's values (loading), so it equals the
        HF original. `w` may be a packed tensor's bytes: only a row permutation may touch those."""
        return w

    def to_gguf(self, gguf_name: str, w: np.ndarray, config: dict, hf: str) -> np.ndarray:
        """What llama.cpp's converter does to an HF tensor's values (`rlx quantize`)."""
        return w

    # ------------------------------------------------------------------------------ metadata

    def head_dim(self, meta: MetadataReader) -> int | None:
        """The head size when the file has no `{arch}.attention.key_length` (None: hidden / heads)."""
        return None

    def config(self, meta: MetadataReader, cfg: dict, held: int) -> None:
        """Add the family's keys to `cfg`, the HF config core built from the generic keys
        (`held`: the blocks the file holds, 0 for a vocabulary-only file)."""

    def write_metadata(self, writer, cfg: dict, head_dim: int) -> None:
        """Write the family's `{arch}.*` keys after the generic ones (block count ... vocab size)
        and before the token ids; the default writes only the rope scaling. An override calls
        `write_rope_scaling` where llama.cpp's converter puts it: the order is the file's bytes."""
        write_rope_scaling(writer, cfg)

    # ------------------------------------------------------------------------------ tokenizer

    def sentencepiece_tokenizer(self, tokens: list[str]):
        """A `tokenizers.Tokenizer` for the file's sentencepiece vocabulary (`tokenizer.ggml.model`
        'llama'), or None for core's default (byte-fallback BPE with a metaspace pre-tokenizer)."""
        return None

    def sentencepiece_special_tokens(self) -> dict:
        """Named special tokens the family's HF tokenizer adds to a sentencepiece vocabulary by
        default (e.g. a mask token), beside those the file names."""
        return {}


def registered_gguf_architecture(arch) -> GGUFArchitecture | None:
    """The mapping a plugin registered for `arch`, or None; a PluginError naming the plugin when
    what it registered is not a GGUFArchitecture."""
    from rlx_core.plugins import owner_of, registry

    mapping = registry().gguf_architectures.get(arch) if isinstance(arch, str) else None
    if mapping is not None and not isinstance(mapping, GGUFArchitecture):
        raise PluginError(f"plugin {owner_of('gguf architecture', arch)!r} registered GGUF architecture "
                          f"{arch!r} as {type(mapping).__name__}; expected a "
                          "rlx_core.weights.gguf_arch.GGUFArchitecture")
    return mapping


def gguf_architecture(path: str, arch) -> GGUFArchitecture:
    """The mapping registered for a GGUF file's `general.architecture`; a WeightError naming the
    file, the architecture and the registered ones (and what provides it, where known) otherwise."""
    mapping = registered_gguf_architecture(arch)
    if mapping is not None:
        return mapping
    from rlx_core.plugins import provider_hint, registry

    known = ", ".join(sorted(registry().gguf_architectures)) or "none"
    hint = provider_hint(arch) if isinstance(arch, str) and arch else ""
    raise WeightError(f"{path}: GGUF architecture {arch!r} is not supported: no loaded plugin registers it "
                      f"(registered: {known}); " + (hint or "install the plugin of its model family "
                                                    "(`rlx plugins` lists what loaded)"))


__all__ = ["GGUFArchitecture", "MetadataReader", "STANDARD_LAYER_NAMES", "STANDARD_TOP_NAMES", "gguf_architecture",
           "registered_gguf_architecture", "write_rope_scaling"]
