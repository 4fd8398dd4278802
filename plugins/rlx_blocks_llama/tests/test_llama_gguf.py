"""The LLaMA plugin's GGUF mappings (`llama`, `qwen3`): registered by it, names both ways, and
LLaMA's rope permutation of Q/K undone on loading and redone by `rlx quantize`."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_blocks_llama.gguf import LAYER_NAMES, LLAMA, QWEN3, permute, unpermute
from rlx_core.ir.errors import WeightError
from rlx_core.plugins import owner_of, registry


def test_registered_by_the_llama_plugin():
    assert registry().gguf_architectures["llama"] is LLAMA and registry().gguf_architectures["qwen3"] is QWEN3
    assert owner_of("gguf architecture", "llama") == owner_of("gguf architecture", "qwen3") == "llama"


@pytest.mark.parametrize("mapping", [LLAMA, QWEN3])
def test_names_both_ways(mapping):
    for leaf, hf in LAYER_NAMES.items():
        name = f"blk.7.{leaf}.weight"
        assert mapping.hf_name(name) == f"model.layers.7.{hf}.weight"
        assert mapping.gguf_name(f"model.layers.7.{hf}.weight") == name
    assert mapping.hf_name("output.weight") == "lm_head.weight"
    assert mapping.gguf_name("lm_head.weight") == "output.weight"
    assert mapping.hf_name("rope_freqs.weight") is None             # transformers rebuilds the rope factors
    assert mapping.gguf_name("model.layers.0.mlp.experts.weight") is None


def test_llama_permutes_q_and_k_rows_only():
    rng = np.random.default_rng(0)
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    q, k = rng.standard_normal((32, 8)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32)
    gq = LLAMA.to_gguf("blk.0.attn_q.weight", q, cfg, "q")
    assert not np.array_equal(gq, q)
    np.testing.assert_array_equal(gq, permute(q, 4, "q"))
    np.testing.assert_array_equal(LLAMA.from_gguf("blk.0.attn_q.weight", gq, cfg, "f"), q)
    np.testing.assert_array_equal(unpermute(permute(k, 2, "k"), 2), k)
    np.testing.assert_array_equal(LLAMA.from_gguf("blk.0.attn_k.weight", permute(k, 2, "k"), cfg, "f"), k)
    assert QWEN3.to_gguf("blk.0.attn_q.weight", q, cfg, "q") is q               # qwen3: no permutation
    assert LLAMA.to_gguf("blk.0.attn_v.weight", k, cfg, "v") is k
    with pytest.raises(WeightError, match=r"f\.gguf: tensor 'blk.0.attn_q.weight' of shape \[6, 8\] does not "
                                          r"split into 4 heads"):
        LLAMA.from_gguf("blk.0.attn_q.weight", q[:6], cfg, "f.gguf")
