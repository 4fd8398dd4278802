"""OLMo 2 through GGUF (the plugin's `rlx_register_gguf_architectures`): `rlx quantize` writes a
tiny random Olmo2ForCausalLM as llama.cpp's `olmo2` architecture, and RLX loads the file back
with transformers' greedy tokens; llama.cpp reads the same file and agrees where
llama-cpp-python is installed.

The source's matrices are q8_0 values already (each quantized and decoded once), so writing
them in q8_0 loses nothing: the GGUF model is the HF model exactly, and its tokens must be HF's."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import rlx_core
from rlx_core.cli import main
from rlx_core.ir.quant import PackedTensor, QuantScheme
from rlx_core.testing.parity import assert_greedy_agrees
from rlx_core.weights import load_checkpoint

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

Q8 = QuantScheme.parse("q8_0")
MERGES = [("t", "h"), ("h", "i"), ("e", "r"), ("Ġ", "t")]
VOCAB = 256 + len(MERGES)       # a byte-level BPE: one token per byte, and a few merges


def byte_tokenizer_json() -> str:
    """A byte-level BPE tokenizer (GPT-2's byte alphabet and MERGES) of VOCAB tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in MERGES]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tk = Tokenizer(models.BPE(vocab, MERGES))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return tk.to_str()


def q8_exact(w: torch.Tensor) -> torch.Tensor:
    """`w` rounded to the values q8_0 holds exactly (so re-quantizing it is lossless)."""
    x = w.numpy()
    return torch.from_numpy(Q8.dequantize(Q8.quantize(x), x.shape).astype(np.float32))


def as_published(config_json) -> None:
    """The config as allenai's OLMo 2 checkpoints spell it: `rope_theta` at the top, where
    transformers 5 writes `rope_parameters` (test_rope_parameters_reach_the_gguf covers that
    spelling)."""
    cfg = json.loads(config_json.read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    config_json.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(HF model, its folder, the q8_0 GGUF `rlx quantize` wrote from it)."""
    cfg = transformers.Olmo2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=500000.0,
                                   pad_token_id=0, eos_token_id=1)
    torch.manual_seed(3)
    model = transformers.Olmo2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in n else q8_exact(p) if p.ndim == 2 else p)
    model.eval()
    folder = tmp_path_factory.mktemp("olmo2")
    model.save_pretrained(folder)
    as_published(folder / "config.json")
    (folder / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    dst = tmp_path_factory.mktemp("gguf") / "olmo2.q8_0.gguf"
    r = CliRunner().invoke(main, ["quantize", str(folder), str(dst), "--scheme", "q8_0"])
    assert r.exit_code == 0, r.output
    return model, folder, dst


def test_written_as_llama_cpp_names_it(source):
    """general.architecture `olmo2`, every tensor under the name gguf-py gives OLMo 2's."""
    _, _, dst = source
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    reader = gguf.GGUFReader(str(dst))
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "olmo2"
    names = {t.name for t in reader.tensors}
    llama_cpp = {f"{TENSOR_NAMES[t].format(bid=i)}.weight" for t in MODEL_TENSORS[MODEL_ARCH.OLMO2]
                 for i in range(2)}
    assert names == llama_cpp


def test_loads_back_as_the_source(source):
    """The GGUF's config is the source's where it matters, and its tensors are the source's
    exactly (decoded from q8_0; the norms kept in f32)."""
    model, folder, dst = source
    back = load_checkpoint(str(dst))
    src = load_checkpoint(str(folder))
    assert back.architecture() == "olmo2"
    want = dict(model_type="olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                tie_word_embeddings=False, hidden_act="silu", eos_token_id=1, pad_token_id=0)
    assert {k: back.config.get(k) for k in want} == want
    assert np.float32(back.config["rms_norm_eps"]) == np.float32(1e-6)      # GGUF holds f32
    assert back.config["rope_theta"] == 500000.0
    assert sorted(back.tensors) == sorted(src.tensors)
    for k, w in src.tensors.items():
        np.testing.assert_array_equal(back.tensors[k], w, err_msg=k)
    assert back.tokenizer.encode("hi there") == src.tokenizer.encode("hi there")


def test_gguf_greedy_matches_hf(source, rng):
    """The q8_0 GGUF run packed: HF's logits within 1e-4, its 32 greedy tokens, a left-padded batch."""
    hf, _, dst = source
    m = rlx_core.load(str(dst), backend="numpy", progress=False)
    assert isinstance(m.tensors["model.layers.0.self_attn.q_proj.weight"], PackedTensor)
    ids = rng.integers(1, VOCAB, (2, 11))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(m.logits(ids) - ref).max() <= 1e-4
    prompt = ids[:1, :7]
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                           max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0).numpy()

    def hf_logits(prefix):
        with torch.no_grad():
            return hf(torch.tensor(prefix)).logits.numpy()

    assert_greedy_agrees(m.generate(prompt, max_new_tokens=32, min_new_tokens=32), want, hf_logits, 2e-4,
                         "GGUF greedy against HF")
    text = m.generate("olmo", max_new_tokens=8, min_new_tokens=8)
    assert isinstance(text, str)


@pytest.mark.parametrize("change, named", [
    (dict(attention_bias=True), "self_attn.k_proj.bias"),       # llama.cpp's olmo2 has no biases
    (dict(head_dim=24), "head_dim 24 x 2 heads is not hidden_size 32"),     # nor a head_dim of its own
])
def test_a_model_llama_cpp_cannot_read_is_refused(tmp_path, change, named):
    """`rlx quantize` names what has no llama.cpp form (and the architecture), and writes nothing."""
    cfg = transformers.Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                                   eos_token_id=1, **change)
    folder = tmp_path / "src"
    transformers.Olmo2ForCausalLM(cfg).save_pretrained(folder)
    dst = tmp_path / "out" / "m.gguf"
    dst.parent.mkdir()
    r = CliRunner().invoke(main, ["quantize", str(folder), str(dst)])
    assert r.exit_code == 2 and r.output.startswith("error: "), r.output
    assert named in r.output and "olmo2" in r.output and "Traceback" not in r.output, r.output
    assert list(dst.parent.iterdir()) == []


def test_llama_cpp_reads_the_same_file(source):
    """llama.cpp (llama-cpp-python) loads the GGUF `rlx quantize` wrote and its 32 greedy tokens
    are RLX's, up to a near tie: llama.cpp rounds activations to 8 bits in its q8_0 matmuls."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    _, _, dst = source
    m = rlx_core.load(str(dst), backend="numpy", progress=False)
    prompt = [5, 77, 130, 9, 200, 41, 66]
    want = m.generate(np.array([prompt]), max_new_tokens=32, min_new_tokens=32)
    llm = llama_cpp.Llama(model_path=str(dst), n_ctx=64, n_threads=1, verbose=False)
    got = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        got.append(tok)
        if len(got) == 32:
            break
    assert_greedy_agrees(np.array([prompt + got]), want, m.logits, 5e-2, "llama.cpp against RLX")


def test_rope_parameters_reach_the_gguf(source, tmp_path):
    """A folder saved by transformers 5 (`rope_parameters`) keeps its rope base in the GGUF."""
    import shutil

    _, folder, _ = source
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    cfg = json.loads((src / "config.json").read_text())
    theta = cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    (src / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "m.gguf"
    r = CliRunner().invoke(main, ["quantize", str(src), str(dst)])
    assert r.exit_code == 0, r.output
    assert load_checkpoint(str(dst)).config["rope_theta"] == theta


def test_gguf_config_is_an_hf_config(source):
    """A GGUF's synthesized config names the HF class and serializes like a config.json."""
    _, _, dst = source
    cfg = load_checkpoint(str(dst)).config
    assert json.loads(json.dumps(cfg))["model_type"] == "olmo2"
    assert cfg["architectures"] == ["Olmo2ForCausalLM"]


def test_blocked_the_gguf_is_the_projects_error(source, monkeypatch):
    """With the plugin blocked, its GGUF file is a WeightError naming the file and the
    architecture nobody registered; unblocked, it loads again."""
    from rlx_core.ir.errors import WeightError
    from rlx_core.plugins import reset

    _, _, dst = source
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "rlx-blocks-olmo2")
    reset()
    try:
        with pytest.raises(WeightError, match=r"GGUF architecture 'olmo2' is not supported") as e:
            rlx_core.load(str(dst), backend="numpy", progress=False)
        assert str(dst) in str(e.value) and "rlx-blocks-olmo2 provides it but is not loaded" in str(e.value)
    finally:
        monkeypatch.delenv("RLX_DISABLE_PLUGINS")
        reset()
    assert rlx_core.load(str(dst), backend="numpy", progress=False).config["model_type"] == "olmo2"
