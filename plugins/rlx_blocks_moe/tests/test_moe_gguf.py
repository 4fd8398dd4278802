"""The MoE families' GGUF files: tiny random HF models (hidden 256, so q4_k's 256-element
blocks pack every matrix; 8 experts, top-2, uneven load) written in q8_0 and q4_k as llama.cpp
lays them out (`qwen3moe`, `olmoe`, and Mixtral as `llama` with experts), then loaded: the
layout and keys against gguf's own reader, RLX packed against RLX dequantized, RLX on the file
against HF holding the file's dequantized weights, and the errors for what llama.cpp could not
read or a file whose expert count disagrees with its tensors. (llama.cpp itself is not run:
llama-cpp-python is not installed here.)"""
from __future__ import annotations

import attrs
import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import WeightError
from rlx_core.ir.quant import PackedTensor
from rlx_core.profile import CompileProfile
from rlx_core.weights.checkpoint import load_checkpoint
from rlx_core.weights.gguf_write import write_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_moe_families import backends_here, uneven_router  # noqa: E402  (shared helpers)


VOCAB = 61
# configs llama.cpp's graphs compute as transformers does: Qwen3-MoE normalized top-k and no
# dense layer, Qwen2-MoE with biases and its shared expert, no window, Mixtral without a
# window, OLMoE without clip_qkv, kv heads = heads, untied
COMMON = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe",
                  dict(moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2moe",
                  dict(moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=8,
                       num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", dict(num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "olmoe", dict(num_experts=8, num_experts_per_tok=2)),
}
SCHEMES = ("q8_0", "q4_k")
QUIET = dict(echo=lambda *a: None)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def written(request, tmp_path_factory):
    """(family, HF folder, {scheme: GGUF path}) with both schemes written from one model."""
    family = request.param
    cfg_cls, model_cls, _, opts = FAMILIES[family]
    torch.manual_seed(3)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**COMMON, **opts))
    uneven_router(model, scale=0.08)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder)
    out = {}
    for scheme in SCHEMES:
        out[scheme] = str(folder.parent / f"{family}-{scheme}.gguf")
        write_gguf(load_checkpoint(str(folder)), out[scheme], scheme, **QUIET)
    return family, str(folder), out


def test_layout_and_keys_as_llama_cpp_reads_them(written):
    """gguf's reader sees llama.cpp's architecture, expert keys and 3-D ffn_*_exps tensors
    (ggml ne [cols, rows, E]) in the scheme's type, and no per-expert tensor."""
    family, _, files = written
    arch = FAMILIES[family][2]
    for scheme, path in files.items():
        r = gguf.GGUFReader(path)
        field = lambda k: r.fields[k].contents()                # noqa: E731
        tensors = {t.name: t for t in r.tensors}
        assert field("general.architecture") == arch
        assert field(f"{arch}.expert_count") == 8 and field(f"{arch}.expert_used_count") == 2
        if family in ("qwen3_moe", "qwen2_moe"):
            assert field(f"{arch}.expert_feed_forward_length") == 256
        if family == "qwen2_moe":
            assert field("qwen2moe.expert_shared_feed_forward_length") == 256
            for leaf in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
                assert list(tensors[f"blk.0.{leaf}.weight"].shape) == [256, 256]
            assert list(tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == [256, 1]
        assert not [n for n in tensors if ".experts." in n or "exps." in n and not n.endswith(".weight")]
        want = gguf.GGMLQuantizationType[scheme.upper()]
        for i in range(2):
            for leaf in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                t = tensors[f"blk.{i}.{leaf}.weight"]
                assert list(t.shape) == [256, 256, 8] and t.tensor_type == want, (leaf, t.shape, t.tensor_type)
            assert list(tensors[f"blk.{i}.ffn_gate_inp.weight"].shape) == [256, 8]


def test_config_read_back(written):
    family, folder, files = written
    want = load_checkpoint(folder).config
    for path in files.values():
        got = load_checkpoint(path).config
        assert got["model_type"] == family
        assert got["num_experts_per_tok"] == 2
        assert (got.get("num_experts") or got.get("num_local_experts")) == 8
        if family != "mixtral":
            assert got["norm_topk_prob"] == want["norm_topk_prob"]
        if family in ("qwen3_moe", "qwen2_moe"):
            assert got["moe_intermediate_size"] == 256
        if family == "qwen2_moe":
            assert got["shared_expert_intermediate_size"] == 256


@pytest.mark.parametrize("backend", backends_here())
@pytest.mark.parametrize("scheme", SCHEMES)
def test_packed_equals_dequantized(written, scheme, backend, rng):
    """The experts stay packed (PackedTensor stacks into moe_experts) and compute what the same
    file dequantized at load (`[precision] weights = "f32"`) computes."""
    family, _, files = written
    packed = rlx_core.load(files[scheme], backend=backend, progress=False)
    stacks = [k for k, t in packed.tensors.items() if ".experts." in k]
    assert len(stacks) == 6 and all(isinstance(packed.tensors[k], PackedTensor) for k in stacks)
    prof = CompileProfile.preset(packed.profile.name).evolve(precision={"weights": "f32"})
    f32 = rlx_core.load(files[scheme], backend=backend, progress=False, profile=prof)
    assert not any(isinstance(t, PackedTensor) for t in f32.tensors.values())
    ids = rng.integers(1, VOCAB, (2, 11))
    a, b = packed.logits(ids), f32.logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), (family, scheme)


def _hf_with(folder: str, tensors: dict):
    """The HF model of `folder` holding `tensors` (RLX's canonical names, dequantized) instead."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        for k, v in hf.state_dict().items():
            k = k.replace("block_sparse_moe.", "mlp.")
            if k.endswith("experts.gate_up_proj"):
                base = k[:-len("gate_up_proj")]
                new = np.concatenate([tensors[base + "gate_proj.weight"], tensors[base + "up_proj.weight"]], 1)
            else:
                new = tensors[k + ".weight" if k.endswith("experts.down_proj") else k]
            v.copy_(torch.from_numpy(np.ascontiguousarray(new)))
    return hf


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gguf_equals_hf_on_its_weights(written, scheme, rng):
    """RLX on the file = transformers holding the file's dequantized weights: names, Q/K
    permutation (Mixtral as llama), router and expert layout all read back right."""
    family, folder, files = written
    hf = _hf_with(folder, load_checkpoint(files[scheme]).tensors)
    ids = rng.integers(1, VOCAB, (2, 13))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = rlx_core.load(files[scheme], backend="numpy", progress=False).logits(ids)
    assert np.abs(got - ref).max() <= 1e-4, family


def test_rlx_quantize_writes_the_same_file(written, tmp_path):
    """`rlx quantize FOLDER DST --scheme q8_0` writes what write_gguf writes, byte for byte."""
    from click.testing import CliRunner

    from rlx_core.cli import main

    family, folder, files = written
    dst = tmp_path / "cli.gguf"
    res = CliRunner().invoke(main, ["quantize", folder, str(dst), "--scheme", "q8_0"])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    assert res.exit_code == 0, res.output
    assert dst.read_bytes() == open(files["q8_0"], "rb").read()


# ------------------------------------------------------------------ bad input
def test_expert_count_disagreeing_with_tensors_names_key_and_tensor(written, tmp_path):
    """A file whose {arch}.expert_count says 4 while its stacks hold 8 experts is refused,
    naming the key and the tensor (so no such file is left either)."""
    from rlx_core.plugins import registry

    family, folder, _ = written
    ckpt = registry().recipes[family].gguf_checkpoint(load_checkpoint(folder))
    count = "num_local_experts" if "num_local_experts" in ckpt.config else "num_experts"
    lying = attrs.evolve(ckpt, config={**ckpt.config, count: 4})
    dst = tmp_path / "lying.gguf"
    with pytest.raises(WeightError, match=r"expert_count|num_(local_)?experts = 4"):
        write_gguf(lying, str(dst), "q8_0", **QUIET)
    assert not dst.exists()


@pytest.mark.parametrize("family, change, what", [
    ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob = false"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), r"dense MLP layers \[1\]"),
    ("qwen2_moe", dict(norm_topk_prob=True), "norm_topk_prob = true"),
    ("qwen2_moe", dict(qkv_bias=False), "qkv_bias = false"),
    ("olmoe", dict(clip_qkv=2.0), "clip_qkv = 2.0"),
    ("olmoe", dict(norm_topk_prob=True), "norm_topk_prob = true"),
    ("olmoe", dict(num_key_value_heads=2), "num_key_value_heads = 2"),
    ("mixtral", dict(sliding_window=8), "sliding_window = 8"),
])
def test_what_llama_cpp_would_compute_otherwise_is_refused(family, change, what, tmp_path):
    from rlx_core.plugins import registry
    from rlx_core.weights.checkpoint import Checkpoint

    recipe = registry().recipes[family]
    cfg = {**dict(COMMON, hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                  model_type=family), **FAMILIES[family][3], "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32, **change}
    tensors = recipe.tiny_tensors(cfg, np.random.default_rng(0))
    ckpt = Checkpoint(str(tmp_path), "safetensors", cfg, tensors, None)
    dst = tmp_path / "out.gguf"
    with pytest.raises(WeightError, match=what):
        write_gguf(ckpt, str(dst), "q8_0", **QUIET)
    assert not dst.exists()


def test_llama_gguf_with_experts_needs_the_moe_plugin(written, plugins_env):
    """The LLaMA plugin reads a `llama` file with experts as Mixtral through the recipe
    registry; with this plugin disabled the error names the package to install."""
    from rlx_core.plugins import reset

    family, _, files = written
    if family != "mixtral":
        pytest.skip("Mixtral is the family stored as llama.cpp's llama")
    plugins_env.setenv("RLX_DISABLE_PLUGINS", "moe")
    reset()
    with pytest.raises(WeightError, match="rlx-blocks-moe"):
        load_checkpoint(files["q8_0"])
    plugins_env.delenv("RLX_DISABLE_PLUGINS")
    reset()
    assert load_checkpoint(files["q8_0"]).config["model_type"] == "mixtral"


def test_more_experts_used_than_held_names_both_keys():
    from rlx_blocks_moe.gguf import QWEN3MOE
    from rlx_core.weights.gguf_arch import MetadataReader

    meta = MetadataReader("f.gguf", {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 6}, "qwen3moe")
    with pytest.raises(WeightError, match=r"f\.gguf: GGUF metadata qwen3moe\.expert_used_count = 6 exceeds "
                                          r"qwen3moe\.expert_count = 4"):
        QWEN3MOE.config(meta, {"intermediate_size": 64}, 2)


def test_without_the_llama_plugin(written, plugins_env, rng):
    """The MoE plugin needs no other family plugin for its own architectures (the same logits
    with the LLaMA plugin disabled); a Mixtral file (llama.cpp's `llama`) then names the
    LLaMA plugin that reads it."""
    from rlx_core.plugins import reset

    family, _, files = written
    ids = rng.integers(1, VOCAB, (1, 6))
    want = rlx_core.load(files["q8_0"], backend="numpy", progress=False).logits(ids)
    plugins_env.setenv("RLX_DISABLE_PLUGINS", "llama")
    reset()
    if family == "mixtral":
        with pytest.raises(WeightError, match="rlx-blocks-llama"):
            load_checkpoint(files["q8_0"])
        return
    got = rlx_core.load(files["q8_0"], backend="numpy", progress=False)
    assert got.config["model_type"] == family
    np.testing.assert_array_equal(got.logits(ids), want)
