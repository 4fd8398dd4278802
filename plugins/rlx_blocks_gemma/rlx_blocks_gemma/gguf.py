"""Gemma 2 / Gemma 3 GGUF files, both ways (llama.cpp's `gemma2` and `gemma3` architectures):
four norms per block, stored as llama.cpp's (1 + w), the sliding-window pattern, softcaps and
the local rope base in metadata, and transformers' Gemma tokenizer for the sentencepiece
vocabulary."""
from __future__ import annotations

import numpy as np

from rlx_core.ir.errors import WeightError
from rlx_core.plugins import hookimpl
from rlx_core.weights.gguf_arch import STANDARD_LAYER_NAMES, GGUFArchitecture, write_rope_scaling
from rlx_core.weights.gguf_meta import meta_int
from rlx_core.weights.tokenizer import vocabulary_merges

# blk.N.<GGUF leaf> -> model.layers.N.<HF leaf>: norms around attention and around the MLP
LAYER_NAMES = {
    **STANDARD_LAYER_NAMES,
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _is_norm(gguf_name: str) -> bool:
    return gguf_name.endswith("norm.weight")


class GemmaGGUF(GGUFArchitecture):
    """What Gemma 2 and 3 files share; `pattern` is the sliding-window pattern when the file
    states none (every pattern-th layer global), `softcaps` and `local_rope` the keys one has."""

    pattern: int = 2
    softcaps: bool = False
    local_rope: bool = False

    def from_gguf(self, gguf_name, w, config, path):
        return w - np.float32(1.0) if _is_norm(gguf_name) else w  # llama.cpp stores (1 + w)

    def to_gguf(self, gguf_name, w, config, hf):
        return w + np.float32(1.0) if _is_norm(gguf_name) else w

    def config(self, meta, cfg, held):
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        pattern, sliding = self._sliding(meta, cfg["num_hidden_layers"], held)
        cfg |= {
            "sliding_window": meta.num("attention.sliding_window", None, lo=0, to="sliding_window"),
            "query_pre_attn_scalar": meta.real("attention.query_pre_attn_scalar", cfg["head_dim"],
                                               to="query_pre_attn_scalar"),
            "sliding_window_pattern": pattern,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        }
        if self.local_rope:
            cfg["rope_local_base_freq"] = meta.real("rope.freq_base_swa", 10000.0,
                                                    to="rope_local_base_freq")
        if self.softcaps:
            for key in SOFTCAPS:
                held_key = meta.key(key) in meta.metadata
                cfg[key] = meta.real(key, None, strict=False, to=key) if held_key else None

    def _sliding(self, meta, layers: int, held: int) -> tuple[int, list]:
        """(pattern, per-layer sliding flags) from `attention.sliding_window_pattern`: a list of
        flags in newer files, an int (every pattern-th layer global) in older ones."""
        pkey = meta.key("attention.sliding_window_pattern")
        pattern = meta.metadata.get(pkey, self.pattern)
        meta.took(pkey, "sliding_window_pattern")
        meta.took(pkey, "layer_types")
        if isinstance(pattern, list):
            if len(pattern) != layers or not all(isinstance(p, (bool, int)) for p in pattern):
                raise WeightError(
                    f"{meta.path}: GGUF metadata {pkey} is a list of {len(pattern)} values, expected "
                    f"{layers} booleans (one per layer)"
                )
            sliding = [bool(p) for p in pattern]
            return (sliding.index(False) + 1 if False in sliding else len(sliding) + 1), sliding
        pattern = meta_int(meta.path, meta.metadata, pkey, pattern)
        return pattern, [bool((i + 1) % pattern) for i in range(layers if held else 0)]

    def write_metadata(self, writer, cfg, head_dim):
        write_rope_scaling(writer, cfg)
        arch = writer.arch
        if cfg.get("sliding_window") is not None:
            writer.add_sliding_window(cfg["sliding_window"])
        scalar = cfg.get("query_pre_attn_scalar")
        writer.add_float32(f"{arch}.attention.query_pre_attn_scalar",
                           float(scalar if scalar is not None else head_dim))
        types = cfg.get("layer_types")
        if types:
            writer.add_array(f"{arch}.attention.sliding_window_pattern",
                             [t == "sliding_attention" for t in types])
        if self.local_rope:
            local = cfg.get("rope_local_base_freq")
            writer.add_rope_freq_base_swa(float(local if local is not None else 10000.0))
        if self.softcaps:
            for key in SOFTCAPS:
                if cfg.get(key) is not None:
                    writer.add_float32(f"{arch}.{key}", float(cfg[key]))

    def sentencepiece_tokenizer(self, tokens):
        """transformers' Gemma GGUF tokenizer: whitespace runs spelled with '▁', merges rebuilt
        in file order."""
        from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import BPE

        respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = dict(zip(respelled, range(len(respelled))))
        merges = vocabulary_merges(respelled, None)
        tk = Tokenizer(
            BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None,
                byte_fallback=True)
        )
        tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tk.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        return tk

    def sentencepiece_special_tokens(self):
        return {"mask_token": "<mask>"}  # GemmaTokenizer's default, which transformers adds too


class Gemma2GGUF(GemmaGGUF):
    softcaps = True


class Gemma3GGUF(GemmaGGUF):
    pattern = 6
    local_rope = True


GEMMA2 = Gemma2GGUF("gemma2", "Gemma2ForCausalLM", LAYER_NAMES)
GEMMA3 = Gemma3GGUF("gemma3_text", "Gemma3ForCausalLM", LAYER_NAMES)


@hookimpl
def rlx_register_gguf_architectures(register):
    register("gemma2", GEMMA2)
    register("gemma3", GEMMA3)
