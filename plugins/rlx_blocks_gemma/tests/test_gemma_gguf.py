"""The Gemma plugin's GGUF mappings (`gemma2`, `gemma3`): registered by it, norms stored as
llama.cpp's 1 + w both ways, and the sentencepiece tokenizer quirk (transformers' Gemma tokenizer
and its default mask token)."""
from __future__ import annotations

import numpy as np

from rlx_blocks_gemma.gguf import GEMMA2, GEMMA3, LAYER_NAMES
from rlx_core.plugins import owner_of, registry


def test_registered_by_the_gemma_plugin():
    archs = registry().gguf_architectures
    assert archs["gemma2"] is GEMMA2 and archs["gemma3"] is GEMMA3
    assert GEMMA3.model_type == "gemma3_text"
    assert owner_of("gguf architecture", "gemma2") == owner_of("gguf architecture", "gemma3") == "gemma"


def test_four_norms_a_block_and_one_plus_w():
    assert GEMMA3.hf_name("blk.3.post_ffw_norm.weight") == "model.layers.3.post_feedforward_layernorm.weight"
    assert GEMMA2.gguf_name("model.layers.3.pre_feedforward_layernorm.weight") == "blk.3.ffn_norm.weight"
    assert set(LAYER_NAMES) >= {"attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"}
    w = np.array([0.5, -1.0], np.float32)
    stored = GEMMA3.to_gguf("blk.0.attn_norm.weight", w, {}, "n")
    np.testing.assert_array_equal(stored, w + 1)
    np.testing.assert_array_equal(GEMMA3.from_gguf("blk.0.attn_norm.weight", stored, {}, "f"), w)
    assert GEMMA2.from_gguf("blk.0.attn_q.weight", w, {}, "f") is w


def test_sentencepiece_quirk():
    assert GEMMA2.sentencepiece_special_tokens() == {"mask_token": "<mask>"}
    tk = GEMMA3.sentencepiece_tokenizer(["<unk>", "<s>", "</s>", "a", "b", "ab", " ", "  "])
    # whitespace runs are spelled with '▁' and spaces are kept with the word before them
    assert tk.token_to_id("\u2581\u2581") == 7 and tk.encode("ab a").tokens == ["ab", "\u2581", "a"]
