"""Runtime arguments at the boundary: every bad value given to `generate`, `logits` or
`embed` is a ModelError naming the argument; fuzzed arguments give the project's own error
or a valid result, never a foreign exception."""
from __future__ import annotations

import math
import os
import tracemalloc
import warnings

import numpy as np
import pytest

from rlx_core.ir.errors import ModelError, RlxError

pytest.importorskip("rlx_blocks_llama")
pytest.importorskip("rlx_blocks_bert")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_models import BERT, LLAMA, tiny_bert, tiny_llama  # noqa: E402

# fresh examples on a developer's runs (they find bugs); CI replays a fixed set, so a rare
# example cannot fail a submission by chance
IN_CI = bool(os.environ.get("CI"))

VOCAB = LLAMA["vocab_size"]


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(np.random.default_rng(7))


@pytest.fixture(scope="module")
def enc():
    return tiny_bert(np.random.default_rng(8))


PROMPT = [5, 6, 7]
BAD_GENERATE = [
    ("max_new_tokens", -1), ("max_new_tokens", -100), ("max_new_tokens", "5"), ("max_new_tokens", None),
    ("max_new_tokens", 2.5), ("max_new_tokens", True),
    ("min_new_tokens", -3), ("min_new_tokens", 1.5), ("min_new_tokens", "x"),
    ("top_k", 1.5), ("top_k", -1), ("top_k", "3"), ("top_k", True),
    ("top_p", 2.0), ("top_p", 0.0), ("top_p", -0.1), ("top_p", math.nan), ("top_p", math.inf),
    ("top_p", "0.5"),
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", -1.0), ("temperature", "1"),
    ("seed", "abc"), ("seed", -1), ("seed", 1.5), ("seed", True),
    ("stream", 5), ("stream", "print"),
    ("do_sample", "yes"), ("do_sample", 1), ("do_sample", None),
]


@pytest.mark.parametrize("name,value", BAD_GENERATE, ids=[f"{n}={v!r}" for n, v in BAD_GENERATE])
def test_bad_generate_argument_is_named(lm, name, value):
    kw = {"max_new_tokens": 3, name: value}
    if name in ("top_k", "top_p", "temperature", "seed"):
        kw["do_sample"] = True
    with pytest.raises(ModelError, match=name):
        lm.generate(PROMPT, **kw)


def test_min_new_tokens_more_than_max_and_zero_temperature_sampling(lm):
    with pytest.raises(ModelError, match="min_new_tokens.*max_new_tokens"):
        lm.generate(PROMPT, max_new_tokens=2, min_new_tokens=3)
    with pytest.raises(ModelError, match="temperature must be > 0 when sampling"):
        lm.generate(PROMPT, max_new_tokens=2, do_sample=True, temperature=0)


BAD_IDS = [([1.0, 2.0], "token 0 must be an integer"), ([True, False], "token 0 must be an integer"),
           (["a", "b"], "prompt"), ("", "prompt"), ([[1, 2], [3, "x"]], "row 1 token 1"),
           (np.array([[1.5, 2.0]]), "integer token ids"), (np.array([True]), "integer token ids"),
           ([VOCAB], f"token id {VOCAB} is out of range \\[0, {VOCAB}\\)"), ([-1], "token id -1"),
           ([], "prompt is empty"), ([[1, 2], []], "row 1 is empty"),
           (np.zeros((0, 4), np.int64), "empty batch"),
           (np.zeros((1, 2, 3), np.int64), "1-D or 2-D"), ({1, 2}, "sequence"), (None, "sequence")]


@pytest.mark.parametrize("ids,match", BAD_IDS, ids=[repr(i)[:30] for i, _ in BAD_IDS])
def test_bad_token_ids_to_generate(lm, ids, match):
    if isinstance(ids, str):            # text: goes through the tokenizer, then is empty
        ids, match = "", "prompt \\(as tokenized\\) is empty"
    with pytest.raises(ModelError, match=match):
        lm.generate(ids, max_new_tokens=2)


def test_lone_surrogate_prompt_and_mask_with_text(lm):
    with pytest.raises(ModelError, match="prompt has a lone surrogate"):
        lm.generate("w1 \ud800 w2", max_new_tokens=2)
    with pytest.raises(ModelError, match="attention_mask goes with token ids"):
        lm.generate("w1 w2", max_new_tokens=2, attention_mask=[[1, 1]])


@pytest.mark.parametrize("mask,match", [
    (np.ones((1, 4), bool), "attention_mask must be a \\[1, 3\\] array"),
    ([[1, 2, 1]], "bools or 0/1 integers"), ([["a", "b", "c"]], "bools or 0/1 integers"),
    ([[0.5, 1, 1]], "bools or 0/1 integers"), ([[1, 1], [1]], "attention_mask must be"),
    ([[0, 0, 0]], "attention_mask row 0 masks every token")])
def test_bad_attention_mask(lm, mask, match):
    with pytest.raises(ModelError, match=match):
        lm.logits([PROMPT], attention_mask=mask)
    with pytest.raises(ModelError, match=match):
        lm.generate(np.array([PROMPT]), attention_mask=mask, max_new_tokens=2)


def test_logits_ids(lm):
    with pytest.raises(ModelError, match="ids row 1 has 2 tokens but row 0 has 3"):
        lm.logits([[1, 2, 3], [4, 5]])
    with pytest.raises(ModelError, match="empty batch"):         # an error, not an empty array
        lm.logits(np.zeros((0, 5), np.int64))
    with pytest.raises(ModelError, match="ids row 0 is empty"):
        lm.logits(np.zeros((2, 0), np.int64))
    with pytest.raises(ModelError, match="ids token 1 must be an integer"):
        lm.logits([1, 2.0])
    with pytest.raises(ModelError, match="longer than the context"):
        lm.logits(np.ones((1, LLAMA["max_position_embeddings"] + 1), np.int64))


def test_valid_edges(lm, rng):
    """The edges of the valid ranges work and mean what HF means."""
    ids = [int(x) for x in rng.integers(3, VOCAB, 5)]
    greedy = lm.generate(ids, max_new_tokens=6, min_new_tokens=6)
    assert lm.generate(ids, max_new_tokens=0) == ids
    # top_k=1 and a vanishing temperature leave only the argmax: sampling is greedy
    for kw in (dict(top_k=1), dict(temperature=1e-300, top_k=0), dict(top_p=1e-9, top_k=None)):
        assert lm.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=True, seed=3, **kw) == greedy
    # numpy integers and a bool mask of 0/1 ints are fine; a left-padded row equals the row alone
    padded = np.array([[0, 0] + ids[:3], ids])
    mask = np.array([[0, 0, 1, 1, 1], [1] * 5])
    got = lm.logits(padded, attention_mask=mask)
    np.testing.assert_allclose(got[0, 2:], lm.logits([np.int32(i) for i in ids[:3]])[0], atol=1e-5)


# ------------------------------------------------------------------------------ embed
def test_embed_bad_texts_and_arguments(enc):
    with pytest.raises(ModelError, match="text 1 has a lone surrogate '\\\\udc80' at character 2"):
        enc.embed(["w1", "w1\udc80"])
    with pytest.raises(ModelError, match="text 0 must be a string"):
        enc.tokenize([b"w1"])
    with pytest.raises(ModelError, match="batch_size"):
        enc.embed(["w1"], batch_size=0)
    with pytest.raises(ModelError, match="normalize"):
        enc.embed(["w1"], normalize="yes")
    with pytest.raises(ModelError, match="not a mix"):
        enc.embed(["w1", 3])
    with pytest.raises(ModelError, match="out of range"):
        enc.embed([[1, BERT["vocab_size"]]])
    with pytest.raises(ModelError, match="token_type_ids row 0: token id 2 is out of range"):
        enc.forward([[1, 2]], token_type_ids=[[0, 2]])
    with pytest.raises(ModelError, match="attention_mask must be"):
        enc.forward([[1, 2]], attention_mask=[[1, 1, 1]])


def test_nan_weight_gives_nan_not_a_kernel_index_error(rng):
    """The GELU kernel's table index of a NaN was INT_MIN (an IndexError); now a NaN
    weight gives NaN embeddings."""
    from tiny_models import bert_tensors

    from rlx_core.runtime.encoder import Encoder

    t = bert_tensors(BERT, rng)
    w = t["encoder.layer.0.intermediate.dense.weight"].copy()
    w[3, 1] = np.nan
    t["encoder.layer.0.intermediate.dense.weight"] = w
    for layout in ("padded", "packed"):
        e = Encoder.from_tensors(BERT, t, backend="numpy", flow_options={"layout": layout})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = e.embed([[2, 7, 9, 3], [2, 5, 3]])
        assert np.isnan(out).all()


# ------------------------------------------------------------------------------ fuzzing
ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.integers(-2**70, 2**70),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                st.lists(st.integers(-2, 70), max_size=3))
IDS = st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=6),
                st.lists(st.lists(st.one_of(st.integers(0, VOCAB), st.floats(0, 5), st.booleans()),
                                  max_size=4), max_size=3),
                st.lists(st.sampled_from(["w1", " ", "w7", "\ud800", "x"]), max_size=6).map("".join),
                ANY)


def _bounded(fn):
    """fn() with its peak traced memory bounded (an argument must not size an allocation)."""
    tracemalloc.start()
    try:
        return fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 << 20, f"peak memory {peak} bytes"


VALID = dict(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
             max_new_tokens=st.integers(0, 8), min_new_tokens=st.just(0), top_k=st.one_of(st.none(), st.integers(0, 80)),
             top_p=st.one_of(st.none(), st.floats(0.01, 1.0)), temperature=st.floats(0.01, 5.0),
             seed=st.one_of(st.none(), st.integers(0, 2**64)), do_sample=st.booleans())


@st.composite
def generate_args(draw):
    """Valid arguments with none, one or two of them replaced by anything."""
    kw = {k: draw(v) for k, v in VALID.items()}
    for k in draw(st.lists(st.sampled_from(sorted(VALID)), max_size=2, unique=True)):
        kw[k] = draw(IDS if k == "prompt" else ANY)
    return kw


@settings(max_examples=40, deadline=None, derandomize=IN_CI, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kw=generate_args())
def test_fuzz_generate(lm, kw):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # (max_new_tokens past the context warns)
            out = _bounded(lambda: lm.generate(**kw))
    except RlxError:
        return
    if isinstance(kw["prompt"], str):
        assert isinstance(out, str)
    else:
        out = np.asarray(out)
        assert out.ndim in (1, 2) and out.min() >= 0 and out.max() < VOCAB


@settings(max_examples=40, deadline=None, derandomize=IN_CI, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=IDS, mask=ANY)
def test_fuzz_logits(lm, ids, mask):
    try:
        out = _bounded(lambda: lm.logits(ids, attention_mask=mask if mask != [] else None))
    except RlxError:
        return
    assert out.ndim == 3 and out.shape[-1] == VOCAB and np.isfinite(out).all()


@settings(max_examples=40, deadline=None, derandomize=IN_CI, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=st.one_of(IDS, st.lists(st.text(max_size=8), max_size=3)), bs=ANY, norm=ANY)
def test_fuzz_embed(enc, x, bs, norm):
    try:
        out = _bounded(lambda: enc.embed(x, batch_size=bs, normalize=norm))
    except RlxError:
        return
    assert out.shape[-1] == enc.dim and np.isfinite(out).all()


@pytest.mark.parametrize("key,value", [("eos_token_id", 10**9), ("eos_token_id", "2"), ("pad_token_id", -1),
                                       ("pad_token_id", VOCAB)])
def test_model_eos_or_pad_id_outside_the_vocab(rng, key, value):
    from tiny_models import llama_tensors

    from rlx_core.runtime.model import CausalLM

    m = CausalLM.from_tensors(dict(LLAMA, **{key: value}), llama_tensors(LLAMA, rng))
    with pytest.raises(ModelError, match=f"{key} must be a token id in \\[0, {VOCAB}\\)"):
        m.generate([5, 6], max_new_tokens=2, min_new_tokens=1)


def test_executable_refuses_strings_for_numbers():
    import rlx_core
    from rlx_core import Graph
    from rlx_core.ir.errors import ModelError

    g = Graph.define("s", lambda m: m.input("x", (2,)) * m.param("w", (2,)))
    exe = rlx_core.compile(g, backend="numpy")
    with pytest.raises(ModelError, match=r"param 'w': expected f32 numbers, got an array of <U1"):
        exe.set_params({"w": np.array(["a", "b"])})
    exe.set_params({"w": np.ones(2, np.float32)})
    with pytest.raises(ModelError, match=r"input 'x': expected f32 numbers, got an array of object"):
        exe.run(x=np.array([None, 1.0], dtype=object))
    np.testing.assert_array_equal(exe.run(x=np.array([2.0, 3.0]))[next(iter(g.outputs))[0]], [2.0, 3.0])
