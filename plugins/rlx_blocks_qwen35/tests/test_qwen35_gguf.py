"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next GGUF round trips (q8_0): `rlx quantize` (the recipe's
gguf_checkpoint for MoE and Qwen3-Next), read back with llama.cpp's conventions (names, 1 + w
norms, ssm_a = -exp(A_log), squeezed conv, value heads tiled over key heads) and run: every
tensor equals the HF one within q8_0's rounding, the file's own graph (out_proj columns left
tiled) equals the HF-ordered graph on the same dequantized weights, and the packed model runs
as its dequantized weights."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from rlx_core.runtime.model import CausalLM, load  # noqa: E402
from rlx_core.weights import load_checkpoint  # noqa: E402

from rlx_blocks_qwen35 import Qwen35Recipe, qwen35_arch, text_config  # noqa: E402
from rlx_blocks_qwen35.recipes import split_qkvz, text_tensors  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
              pad_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_range=0.1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def hf_model(kind: str):
    T = transformers
    torch.manual_seed(11)
    if kind == "dense":
        model = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**COMMON, intermediate_size=64))
    elif kind == "moe":
        model = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**COMMON, **MOE))
    else:
        model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**COMMON, **MOE, intermediate_size=64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def written(request, tmp_path_factory):
    """(kind, HF folder, GGUF file): dense through the `rlx quantize` command, the others
    through the recipe's gguf_checkpoint and the core writer (what the command runs)."""
    from click.testing import CliRunner

    from rlx_core.cli import main
    from rlx_core.weights.gguf_write import write_gguf

    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    hf_model(kind).save_pretrained(folder)
    dst = str(folder / "model.q8_0.gguf")
    if kind == "dense":
        r = CliRunner().invoke(main, ["quantize", str(folder), dst, "--scheme", "q8_0"])
        assert r.exit_code == 0, r.output
    else:
        ckpt = Qwen35Recipe().gguf_checkpoint(load_checkpoint(str(folder)))
        write_gguf(ckpt, dst, "q8_0", echo=lambda s: None)
    return kind, str(folder), dst


def tiled_columns(w: np.ndarray, hk: int, r: int, d: int) -> np.ndarray:
    """out_proj [hidden, H * d] with its value-head columns in llama.cpp's order (head k*r + j
    of HF at position j*hk + k)."""
    return w.reshape(w.shape[0], hk, r, d).transpose(0, 2, 1, 3).reshape(w.shape)


def test_tensors_round_trip_within_q8_0(written):
    kind, folder, dst = written
    src = load_checkpoint(folder)
    cfg = text_config(src.config)
    a = qwen35_arch(cfg)
    want = text_tensors(src.tensors)
    if kind == "next":
        want = split_qkvz(a, want)
    got = load_checkpoint(dst)
    assert got.config["model_type"] == cfg["model_type"]
    assert qwen35_arch(got.config).layer_types == a.layer_types
    assert set(got.tensors) == set(want)
    tiled = kind != "next"
    assert got.config.get("linear_value_head_order") == ("tiled" if tiled else None)
    for name, w in want.items():
        w = np.asarray(w, np.float32)
        if tiled and name.endswith("linear_attn.out_proj.weight"):
            w = tiled_columns(w, a.k_heads, a.v_heads // a.k_heads, a.v_dim)
        g = np.asarray(got.tensors[name], np.float32)
        assert g.shape == w.shape, name
        packed = w.ndim >= 2 and w.shape[-1] % 32 == 0          # (q8_0: half a step of max|w| / 127)
        step = np.abs(w).max() / 127 if packed else 1e-6 * (1 + np.abs(w).max())
        np.testing.assert_allclose(g, w, atol=step, rtol=1e-6, err_msg=name)


def test_gguf_graph_equals_hf_order_on_its_weights(written):
    """The GGUF model (out_proj tiled, the stage reorders its heads) against the HF-ordered
    model on the very same dequantized weights: equal to rounding."""
    kind, folder, dst = written
    got = load_checkpoint(dst)
    a = qwen35_arch(got.config)
    hf_order = dict(got.tensors)
    cfg = dict(got.config)
    if cfg.pop("linear_value_head_order", None) == "tiled":
        for name in [k for k in hf_order if k.endswith("linear_attn.out_proj.weight")]:
            hf_order[name] = tiled_columns(hf_order[name], a.v_heads // a.k_heads, a.k_heads, a.v_dim)
    ids = np.random.default_rng(1).integers(2, 64, (1, 40))
    recipe = Qwen35Recipe()
    one = CausalLM.from_tensors(got.config, dict(got.tensors), backend="numpy", recipe=recipe).logits(ids)
    two = CausalLM.from_tensors(cfg, hf_order, backend="numpy", recipe=recipe).logits(ids)
    np.testing.assert_allclose(one, two, atol=1e-5 * np.abs(two).max(), rtol=0)


def test_packed_gguf_runs_as_its_dequantized_weights(written):
    """rlx.load keeps the q8_0 weights packed (expert stacks too): its logits equal those of
    the same weights dequantized to f32 (how near those are to the folder's is
    test_tensors_round_trip_within_q8_0's: q8_0's rounding, which MoE routing amplifies)."""
    kind, folder, dst = written
    ids = np.random.default_rng(2).integers(2, 64, (1, 140))
    packed = load(dst, backend="numpy", progress=False)
    assert packed.tensors and any(type(t).__name__ == "PackedTensor" for t in packed.tensors.values())
    got = packed.logits(ids)
    ckpt = load_checkpoint(dst)
    want = CausalLM.from_tensors(ckpt.config, dict(ckpt.tensors), backend="numpy",
                                 recipe=Qwen35Recipe()).logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
