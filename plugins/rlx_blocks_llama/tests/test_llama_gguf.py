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


def test_rope_of_transformers_5_reaches_the_gguf_and_the_logits(tmp_path):
    """A folder whose config states its RoPE base and linear scaling inside `rope_parameters`
    (transformers 5's spelling) keeps both through `rlx quantize`: the GGUF's config says so and
    its logits equal the HF folder's on RLX (weights already q8_0-exact, so nothing else moves)."""
    import json

    import rlx_core
    from rlx_core.weights.checkpoint import load_checkpoint
    from rlx_core.weights.gguf_write import write_gguf
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}}

    def q8_exact(shape):                       # values q8_0 stores exactly: each block of 32 has
        k = rng.integers(-127, 128, shape)     # a 127, so its scale is exactly 2**-13
        k[..., ::32] = 127
        return (k * 2.0 ** -13).astype(np.float32)

    names = {"model.embed_tokens.weight": (64, 64), "lm_head.weight": (64, 64), "model.norm.weight": None}
    layer = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
             "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
             "mlp.down_proj": (64, 96), "input_layernorm": None, "post_attention_layernorm": None}
    names |= {f"model.layers.0.{k}.weight": v for k, v in layer.items()}
    tensors = {k: (q8_exact(v) if v else np.ones(64, np.float32) + q8_exact(64)) for k, v in names.items()}
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(src / "model.safetensors"))
    dst = str(tmp_path / "m.gguf")
    write_gguf(load_checkpoint(str(src)), dst, "q8_0", echo=lambda *a: None)
    got = load_checkpoint(dst).config
    assert got["rope_theta"] == 50000.0 and got["rope_scaling"]["factor"] == 2.0
    ids = rng.integers(0, 64, (1, 40))
    want = rlx_core.load(str(src), backend="numpy", progress=False).logits(ids)
    np.testing.assert_allclose(rlx_core.load(dst, backend="numpy", progress=False).logits(ids), want,
                               atol=1e-4, rtol=1e-4)
