"""Whole models on the OpenCL backend: a tiny HF LLaMA against transformers, and SmolLM2's
greedy continuation against the NumPy backend (PoCL in CI, NVIDIA OpenCL on the GPU)."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.plugins import registry
from rlx_core.testing.parity import assert_greedy_agrees

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def opencl():
    b = registry().backends.get("opencl")
    ok, why = b.availability() if b else (False, "rlx-backend-opencl is not installed")
    if not ok:
        pytest.skip(f"opencl backend not available: {why}")


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, num_hidden_layers=2, vocab_size=97,
                                   max_position_embeddings=128, rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return hf, rlx_core.load(str(path), backend="opencl", progress=False)


def test_tiny_llama_logits_match_hf(tiny, rng):
    hf, m = tiny
    ids = rng.integers(0, 97, (2, 11))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(m.logits(ids) - ref).max() <= 1e-4


def test_tiny_llama_greedy_matches_hf(tiny, rng):
    hf, m = tiny
    ids = rng.integers(1, 97, (1, 6))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                          max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0).numpy()
    assert_greedy_agrees(m.generate(ids, max_new_tokens=16, min_new_tokens=16), ref,
                         lambda p: hf(torch.tensor(p)).logits.detach().numpy(), 2e-4, "opencl against HF")


def test_smollm2_greedy_16_tokens_identical_to_numpy():
    import os

    from rlx_core.weights import resolve_model_path

    try:
        path = os.environ.get("RLX_SMOLLM2_GGUF") or resolve_model_path("smollm2")
    except Exception as e:
        pytest.skip(f"SmolLM2 weights not available: {e}")
    cpu = rlx_core.load(path, backend="numpy", progress=False)
    ocl = rlx_core.load(path, backend="opencl", progress=False)
    ids = np.array([cpu.tokenizer.encode("The three primary colors are")])
    a = cpu.generate(ids, max_new_tokens=16, min_new_tokens=16)
    b = ocl.generate(ids, max_new_tokens=16, min_new_tokens=16)
    assert_greedy_agrees(b, a, cpu.logits, 1e-3, "opencl against numpy")
