"""OLMo 2 against HF transformers' Olmo2ForCausalLM: tiny random models built in-process and
saved as HF folders, loaded with `rlx_core.load` like any checkpoint; logits, 32 greedy tokens
and a left-padded batch on numpy, numba and OpenCL (a backend not available here is skipped
with its reason)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.plugins import registry, reset
from rlx_core.testing.parity import assert_greedy_agrees, backend_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BACKENDS = backend_params(("numpy", "numba", "opencl"))
VOCAB = 151
TINY = {
    # OLMo 2's own shape: GQA, untied embeddings, no biases
    "gqa2-untied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                        tie_word_embeddings=False),
    # the rest of what Olmo2Config allows: a head_dim that is not hidden / heads, q/k/v/o biases,
    # tied embeddings, another activation
    "headdim-bias-tied": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=20,
                              intermediate_size=80, attention_bias=True, tie_word_embeddings=True,
                              hidden_act="gelu"),
}


def hf_logits(hf):
    """HF's logits for a [1, n] prefix: the reference assert_greedy_agrees asks where tokens differ."""
    def logits(prefix):
        with torch.no_grad():
            return hf(torch.tensor(prefix)).logits.numpy()
    return logits


def hf_model(name, tmp_path_factory):
    """A random Olmo2ForCausalLM of TINY[name] (norm weights random too, so a norm applied in
    the wrong place cannot hide), saved as an HF folder: (model, path)."""
    cfg = transformers.Olmo2Config(num_hidden_layers=3, vocab_size=VOCAB, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, rope_theta=500000.0, pad_token_id=0, eos_token_id=2,
                                   **TINY[name])
    torch.manual_seed(sorted(TINY).index(name))
    model = transformers.Olmo2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return {name: hf_model(name, tmp_path_factory) for name in TINY}


# every config on numpy; OLMo 2's own shape on the compiled backends too
CASES = [pytest.param((name, "numpy"), id=f"{name}-numpy") for name in sorted(TINY)] + [
    pytest.param(("gqa2-untied", b.values[0]), id=f"gqa2-untied-{b.values[0]}", marks=b.marks)
    for b in BACKENDS if b.values[0] != "numpy"]


@pytest.fixture(scope="module", params=CASES)
def tiny(request, hf_models):
    name, backend = request.param
    hf, path = hf_models[name]
    return hf, rlx_core.load(path, backend=backend, progress=False)


def test_logits_match_hf(tiny, rng):
    hf, rlx = tiny
    ids = rng.integers(0, VOCAB, (2, 13))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = rlx.logits(ids)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4


def test_greedy_32_tokens_with_kv_cache(tiny, rng):
    hf, rlx = tiny
    ids = rng.integers(1, VOCAB, (1, 7))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                          max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0).numpy()
    got = rlx.generate(ids, max_new_tokens=32, min_new_tokens=32)
    assert_greedy_agrees(got, ref, hf_logits(hf), 2e-4, "greedy against HF")


def test_left_padded_batch_matches_hf(tiny, rng):
    hf, rlx = tiny
    rows = [list(rng.integers(1, VOCAB, n)) for n in (5, 9, 2)]
    s = max(map(len, rows))
    ids = np.zeros((3, s), np.int64)
    mask = np.zeros((3, s), np.int64)
    for b, r in enumerate(rows):
        ids[b, s - len(r):] = r
        mask[b, s - len(r):] = 1
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=12,
                          min_new_tokens=12, do_sample=False, pad_token_id=0).numpy()
    got = rlx.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12)
    for b, r in enumerate(rows):
        assert_greedy_agrees(got[b:b + 1, s - len(r):], ref[b:b + 1, s - len(r):], hf_logits(hf), 2e-4,
                             f"row {b} against HF")


# ---------------------------------------------------------------- the family's own rules
def test_qk_norm_spans_all_heads(hf_models, rng):
    """The q/k norms are one RMSNorm over heads * head_dim: rescaling one head's slice of
    q_proj changes every head's normalized q (a per-head norm would absorb the scale), so
    the logits move exactly as HF's do."""
    hf, path = hf_models["gqa2-untied"]
    rlx = rlx_core.load(path, backend="numpy", progress=False)
    d = rlx.config["hidden_size"] // rlx.config["num_attention_heads"]
    key = "model.layers.0.self_attn.q_proj.weight"
    w = rlx.tensors[key].copy()
    w[:d] *= 3.0
    from rlx_core.runtime.model import CausalLM

    scaled = CausalLM.from_tensors(rlx.config, dict(rlx.tensors, **{key: w}), backend="numpy")
    ids = rng.integers(0, VOCAB, (1, 9))
    with torch.no_grad():
        hf.model.layers[0].self_attn.q_proj.weight[:d] *= 3.0
        try:
            ref = hf(torch.tensor(ids)).logits.numpy()
        finally:
            hf.model.layers[0].self_attn.q_proj.weight[:d] /= 3.0
    got = scaled.logits(ids)
    assert np.abs(got - rlx.logits(ids)).max() > 1e-3        # the scale was not absorbed
    assert np.abs(got - ref).max() <= 1e-4


def test_a_pre_norm_checkpoint_is_refused(hf_models, tmp_path):
    """A LLaMA-style tensor (input_layernorm) in an olmo2 folder is no OLMo 2 layer: the error
    names the folder and the unexpected tensors, and the missing post-feed-forward norm."""
    from safetensors.numpy import load_file, save_file

    _, path = hf_models["gqa2-untied"]
    folder = tmp_path / "m"
    shutil.copytree(path, folder)
    t = load_file(str(folder / "model.safetensors"))
    t["model.layers.1.input_layernorm.weight"] = t.pop("model.layers.1.post_feedforward_layernorm.weight")
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    want = (r"missing 1: \['model.layers.1.post_feedforward_layernorm.weight'\]"
            r".*unexpected 1: \['model.layers.1.input_layernorm.weight'\]")
    with pytest.raises(WeightError, match=want) as e:
        rlx_core.load(str(folder), backend="numpy", progress=False).logits(np.zeros((1, 3), int))
    assert str(folder) in str(e.value)


def test_a_config_without_a_required_size_is_refused(hf_models, tmp_path):
    _, path = hf_models["gqa2-untied"]
    folder = tmp_path / "m"
    shutil.copytree(path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ModelError, WeightError), match="intermediate_size"):
        rlx_core.load(str(folder), backend="numpy", progress=False).logits(np.zeros((1, 3), int))


# ---------------------------------------------------------------- a plugin like any other


def test_found_through_its_entry_point_and_blockable(hf_models, plugins_env, rng):
    """The recipe arrives through the `rlx` entry point `olmo2` alone; blocked, an OLMo 2
    folder is the project's error naming the model type and this package (from its
    `rlx.model_types` entry point, read without importing it); unblocked, it loads again."""
    from rlx_core.plugins import plugin_infos

    info = next(i for i in plugin_infos() if i.name == "olmo2")
    assert info.package == "rlx-blocks-olmo2" and info.status == "ok"
    assert "olmo2" in registry().recipes
    _, path = hf_models["gqa2-untied"]
    plugins_env.setenv("RLX_DISABLE_PLUGINS", "rlx-blocks-olmo2")
    reset()
    assert "olmo2" not in registry().recipes
    with pytest.raises(ModelError, match="unknown architecture 'olmo2'") as e:
        rlx_core.load(path, backend="numpy", progress=False)
    assert "rlx-blocks-olmo2 provides it but is not loaded: blocked by RLX_DISABLE_PLUGINS" in str(e.value)
    plugins_env.delenv("RLX_DISABLE_PLUGINS")
    reset()
    assert rlx_core.load(path, backend="numpy", progress=False).logits(rng.integers(0, VOCAB, (1, 4))).shape \
        == (1, 4, VOCAB)


def test_blocks_registered_for_plugin_named(hf_models, rng):
    """`olmo2.decoder_layer` through ModelFlow.plugin_named builds the same layer the recipe does."""
    from rlx_blocks_olmo2 import Olmo2Flow

    _, path = hf_models["gqa2-untied"]
    model = rlx_core.load(path, backend="numpy", progress=False)
    eps = model.config["rms_norm_eps"]
    flow = Olmo2Flow.for_logits(model.config).layer(
        lambda ctx: ctx.flow.plugin_named("olmo2.decoder_layer", spec=ctx.spec, eps=eps))
    built = flow.flow().build(model.tensors, model.config, ignore_unused=("rotary_emb.inv_freq",))
    exe = built.compile("numpy")
    ids = rng.integers(0, VOCAB, (1, 6))
    got = exe.run(ids=ids, positions=np.arange(6)[None], key_mask=np.ones((1, 1, 1, 6), bool))["logits"]
    np.testing.assert_allclose(got, model.logits(ids), atol=1e-5)
