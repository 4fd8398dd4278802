"""Fuzzing the checkpoint loaders: whatever the bytes, the result is a loaded checkpoint or the
project's own error (RlxError), never a foreign exception, and no example allocates more than
a small bound (the files are a few KB: nothing may be sized by a number read from them)."""

import json
import logging
import math
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx_core.ir.errors import RlxError
from rlx_core.weights import load_checkpoint
from rlx_core.weights.config import _SCHEMA
from rlx_core.weights.safetensors_io import read_safetensors

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

# fresh examples on a developer's runs (they find bugs); CI replays a fixed set, so a rare
# example cannot fail a submission by chance
IN_CI = bool(os.environ.get("CI"))
FUZZ = settings(max_examples=60, deadline=None, derandomize=IN_CI, suppress_health_check=[HealthCheck.function_scoped_fixture])
PEAK = 64 << 20
logging.getLogger("gguf.gguf_writer").setLevel(logging.ERROR)  # overwriting keys is the point here


def _outcome(fn):
    """fn's result or its RlxError, asserting the peak traced allocation stays under PEAK."""
    tracemalloc.start()
    try:
        try:
            return fn()
        except RlxError as e:
            return e
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < PEAK, f"{peak >> 20} MiB allocated for a few-KB input"
    finally:
        tracemalloc.stop()


def _use(ckpt):
    """What a caller does next with a loaded checkpoint: read its config, encode a text."""
    if isinstance(ckpt, RlxError):
        return
    assert isinstance(ckpt.config.get("model_type"), str)
    if ckpt.tokenizer is not None:
        _outcome(lambda: ckpt.tokenizer.encode("abc a"))


# ---------------------------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    """A small valid llama GGUF with a BPE vocabulary and F32 / F16 / Q8_0 tensors."""
    path = str(tmp_path_factory.mktemp("fuzz") / "base.gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "a", "b", "ab", "\u0120", "\u0120a"])
    w.add_token_types([3, 3, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "\u0120 a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", rng.standard_normal((7, 32)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float16))
    w.add_tensor("blk.0.attn_k.weight", gguf.quants.quantize(rng.standard_normal((16, 32)).astype(np.float32), Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert not isinstance(_outcome(lambda: load_checkpoint(path)), RlxError)
    return path


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8),
       st.booleans())
def test_gguf_byte_mutations(base_gguf, tmp_path, edits, header_only):
    path = base_gguf
    buf = bytearray(open(path, "rb").read())
    reader = gguf.GGUFReader(path)
    span = reader.data_offset if header_only else len(buf)  # most edits where the parser looks
    for pos, byte in edits:
        buf[pos % span] = byte
    bad = tmp_path / "m.gguf"
    bad.write_bytes(bytes(buf))
    _use(_outcome(lambda: load_checkpoint(bad)))


VALUES = st.one_of(
    st.tuples(st.integers(-(2**31), 2**31 - 1), st.just(V.INT32)),
    st.tuples(st.integers(0, 2**64 - 1), st.just(V.UINT64)),
    st.tuples(st.floats(width=32), st.just(V.FLOAT32)),
    st.tuples(st.booleans(), st.just(V.BOOL)),
    st.tuples(st.text(max_size=8), st.just(V.STRING)),
    st.tuples(st.lists(st.integers(0, 255), min_size=1, max_size=4), st.just(V.ARRAY)),
)


@FUZZ
@given(st.data())
def test_gguf_metadata_values(base_gguf, tmp_path, data):
    """Any metadata key of the file (or a known optional one) set to any value of any type."""
    path = base_gguf
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    keys = sorted(fields) + ["llama.rope.scaling.type", "llama.attention.key_length", "llama.vocab_size",
                             "tokenizer.ggml.padding_token_id", "llama.rope.dimension_count"]
    changes = data.draw(st.dictionaries(st.sampled_from(keys), VALUES, min_size=1, max_size=3))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for k, f in fields.items():
        if k != "general.architecture":
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for k, (value, vtype) in changes.items():
        w.add_key_value(k, value, vtype, V.UINT8 if vtype == V.ARRAY else None)
    for t in reader.tensors:
        quantized = t.tensor_type not in (Q.F32, Q.F16)
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type if quantized else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _use(_outcome(lambda: load_checkpoint(tmp_path / "m.gguf")))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # garbage blocks dequantize to NaN
@FUZZ
@given(st.integers(0, 2), st.integers(0, 2), st.one_of(
    st.integers(0, 80), st.sampled_from([2**31, 2**32 - 1, 2**40, 2**62, 2**63, 2**64 - 1])),
    st.sampled_from(["add", "set"]))
def test_gguf_tensor_info_fields(base_gguf, tmp_path, tensor, field, value, how):
    """One tensor's first dim, ggml type or data offset set to, or shifted by, a value."""
    bad = tmp_path / "m.gguf"
    bad.write_bytes(open(base_gguf, "rb").read())
    r = gguf.GGUFReader(str(bad), "r+")
    part = r.tensors[tensor].field.parts[3 + field]
    new = (int(part[0]) + value if how == "add" else value) % (2 ** (8 * part.dtype.itemsize))
    part[0] = new
    r.data.flush()
    del r
    _use(_outcome(lambda: load_checkpoint(bad)))


# ---------------------------------------------------------------------------------------------- safetensors

DTYPES = ["F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL", "BF16", "F8_E4M3", "Q4", 7]
SIZES = st.one_of(st.integers(0, 40), st.sampled_from([-1, -8, 2**32, 2**62, 2**63, 2**64, 1.0, "4", True, None]))
ENTRY = st.one_of(
    st.fixed_dictionaries({
        "dtype": st.sampled_from(DTYPES),
        "shape": st.one_of(st.lists(SIZES, max_size=3), SIZES),
        "data_offsets": st.one_of(st.lists(SIZES, min_size=2, max_size=2), st.lists(SIZES, max_size=3)),
    }),
    st.integers(), st.none(), st.lists(st.integers(), max_size=2),
)


def _st_file(path, header, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _st_reference(path):
    """What the `safetensors` library makes of the file (numpy framework: no bf16 / fp8)."""
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except Exception:  # its one error type, SafetensorError, or numpy's for dtypes it cannot hold
        return None


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=3), ENTRY, max_size=3), st.binary(max_size=64))
def test_safetensors_random_headers(tmp_path, header, blob):
    p = tmp_path / "m.safetensors"
    _st_file(p, header, blob)
    ours = _outcome(lambda: read_safetensors(str(p)))
    numpy_dtypes = all(isinstance(e, dict) and e.get("dtype") not in ("BF16", "F8_E4M3") for e in header.values())
    if numpy_dtypes:  # the library is the reference: it accepts exactly what we accept
        ref = _st_reference(p)
        assert (ref is None) == isinstance(ours, RlxError), (ours, ref)
        if ref is not None:
            for k, v in ref.items():
                np.testing.assert_array_equal(ours[k], v)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=6))
def test_safetensors_byte_mutations(tmp_path, edits):
    header = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]}}
    p = tmp_path / "m.safetensors"
    _st_file(p, header, bytes(range(24)))
    buf = bytearray(p.read_bytes())
    for pos, byte in edits:
        buf[pos % len(buf)] = byte
    p.write_bytes(bytes(buf))
    ours = _outcome(lambda: read_safetensors(str(p)))
    ref = _st_reference(p)
    assert (ref is None) == isinstance(ours, RlxError), (ours, ref)


def _nested(depth: int, inner: str = "1") -> str:
    """JSON text of `depth` levels, arrays and objects alternating, around `inner`."""
    text = inner
    for i in range(depth):
        text = f"[{text}]" if i % 2 else f'{{"k": {text}}}'
    return text


@FUZZ
@given(st.sampled_from(["top", "entry", "shape", "metadata", "name"]),
       st.one_of(st.integers(1, 80), st.sampled_from([1000, 5000, 100000])))
def test_safetensors_nested_headers(tmp_path, where, depth):
    """A header nested `depth` levels where a value goes: a checkpoint or the project's error,
    and over the depth limit an error naming the file and the limit, before any parsing (the
    issue's case: 5,000 levels gave a raw RecursionError)."""
    from rlx_core.weights import safetensors_io

    entry = '"dtype": "F32", "shape": [1], "data_offsets": [0, 4]'
    v = _nested(depth)
    text = {"top": f'{{"a": {{{entry}}}, "x": {v}}}', "entry": f'{{"a": {{{entry}, "x": {v}}}}}',
            "shape": f'{{"a": {{"dtype": "F32", "shape": {v}, "data_offsets": [0, 4]}}}}',
            "metadata": f'{{"__metadata__": {{"x": {v}}}, "a": {{{entry}}}}}',
            "name": f'{{{json.dumps("[" * depth)}: {{{entry}}}}}'}[where]    # brackets in a string: no depth
    p = tmp_path / "m.safetensors"
    raw = text.encode()
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
    ours = _outcome(lambda: read_safetensors(str(p)))
    nesting = {"top": depth + 1, "name": 2}.get(where, depth + 2)
    if nesting > safetensors_io._MAX_DEPTH:
        assert isinstance(ours, RlxError) and str(p) in str(ours)
        assert f"nests {nesting} levels deep, over the limit of {safetensors_io._MAX_DEPTH}" in str(ours)
    elif where in ("top", "shape", "metadata"):                   # not a tensor entry / a string
        assert isinstance(ours, RlxError) and str(p) in str(ours) and len(str(ours)) < 2000, ours
    else:
        assert not isinstance(ours, RlxError), ours


JSON = st.recursive(st.none() | st.booleans() | st.integers()
                    | st.text(alphabet='[]{}"\\ ab\n\u00e9', max_size=6),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(alphabet='[]{}"\\ ab', max_size=4), inner, max_size=3),
                    max_leaves=20)


def _depth(v) -> int:
    inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
    return 0 if inner is None else 1 + max(map(_depth, inner), default=0)


@FUZZ
@given(JSON, st.booleans(), st.booleans())
def test_json_depth_is_the_parsed_depth(value, ascii_only, indent):
    """The depth found without parsing is the parsed value's, whatever brackets, quotes and
    backslashes its strings hold."""
    from rlx_core.weights.safetensors_io import json_depth

    text = json.dumps(value, ensure_ascii=ascii_only, indent=1 if indent else None).encode()
    assert json_depth(text) == _depth(value), text


def test_safetensors_header_length_over_the_format_limit(tmp_path):
    p = tmp_path / "m.safetensors"
    p.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    limit = "exceeds the format's limit of 104857600 bytes"
    with pytest.raises(RlxError, match=rf"{p}: header length {2**40} {limit}"):
        read_safetensors(str(p))


# ---------------------------------------------------------------------------------------------- config.json

JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=5),
    st.lists(st.integers(-2, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
BASES = {
    "llama": {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 16, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 32, "rope_theta": 10000.0, "eos_token_id": 1},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 8, "num_attention_heads": 2, "head_dim": 4,
                    "num_hidden_layers": 2, "intermediate_size": 8, "vocab_size": 16, "sliding_window": 4,
                    "sliding_window_pattern": 2, "rope_scaling": None},
    "bert": {"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
             "intermediate_size": 8, "vocab_size": 16, "layer_norm_eps": 1e-12, "type_vocab_size": 2,
             "max_position_embeddings": 16, "hidden_act": "gelu"},
}


def _map_config(cfg):
    """The plugins' config mapping, where the recipe is installed."""
    mt = cfg["model_type"]
    if mt == "llama":
        from rlx_blocks_llama import Llama32Flow

        spec = Llama32Flow(cfg).spec()
        return (spec.heads, spec.kv_heads, spec.head_dim, spec.rope_theta)
    if mt == "gemma3_text":
        from rlx_blocks_gemma.config import gemma_arch

        return gemma_arch(cfg)
    from rlx_blocks_bert.recipes import bert_config

    return bert_config(cfg)


@FUZZ
@given(st.sampled_from(sorted(BASES)), st.dictionaries(
    st.sampled_from(sorted(_SCHEMA) + ["rope_scaling", "layer_types"]), JSON_VALUES, min_size=1, max_size=3))
def test_config_json_values(tmp_path, family, changes):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    cfg = {**BASES[family], **changes}
    text = json.dumps(cfg)  # NaN / Infinity as Python's json writes them
    (tmp_path / "config.json").write_text(text)
    ckpt = _outcome(lambda: load_checkpoint(tmp_path))
    if isinstance(ckpt, RlxError):
        assert "config.json" in str(ckpt)
        return
    for k, v in ckpt.config.items():
        assert not (isinstance(v, float) and not math.isfinite(v)) or k not in _SCHEMA, (k, v)
    pytest.importorskip(f"rlx_blocks_{'gemma' if family.startswith('gemma') else family}")
    _outcome(lambda: _map_config(ckpt.config))


@pytest.mark.parametrize("family", sorted(BASES))
def test_every_nullable_config_key_set_to_null(family):
    """Each key the schema lets be null, null in turn: the mapping reads it as absent or names
    it (hypothesis found max_position_embeddings = null reaching int(None))."""
    pytest.importorskip(f"rlx_blocks_{'gemma' if family.startswith('gemma') else family}")
    for key, (_, _, nullable) in _SCHEMA.items():
        if nullable:
            _outcome(lambda: _map_config({**BASES[family], key: None}))
