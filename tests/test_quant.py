"""Packed weight formats (rlx_core.ir.quant) against the gguf package's decoders and
quantizers, on fresh random weights and on random block bytes; round-trip error bounds
derived from each format; validation errors name the tensor."""
from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx_core.ir.errors import DTypeError, GraphError, RlxError, ShapeError, WeightError
from rlx_core.ir.quant import GGUF_SCHEMES, QuantScheme, matmul_reference, quantize

gguf = pytest.importorskip("gguf")
gq = pytest.importorskip("gguf.quants")
T = gguf.GGMLQuantizationType

GGUF_NAMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
INT_NAMES = ["int8_b8", "int8_b32", "int8_b128", "int4_b8", "int4_b32", "int4_b128"]
TENSOR = "blk.0.attn_q.weight"
# byte offsets of the f16 scale fields of one block (ggml-common.h block structs)
_GGUF_IDS = {s.gguf_type for s in GGUF_SCHEMES}
F16_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
              "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def _gguf_type(s: QuantScheme):
    return T(s.gguf_type)


def _gguf_can_quantize(s: QuantScheme) -> bool:
    try:
        gq.quantize(np.zeros((1, s.block_size), np.float32), _gguf_type(s))
    except NotImplementedError:
        return False
    return True


def _packed(s: QuantScheme, w: np.ndarray) -> np.ndarray:
    """gguf's bytes where gguf can quantize the scheme, else ours."""
    if s.gguf_type is not None and _gguf_can_quantize(s):
        return gq.quantize(w, _gguf_type(s)).reshape(s.packed_shape(w.shape))
    return s.quantize(w)


def _weights(rng, rows, k, kind="normal"):
    if kind == "normal":
        return rng.standard_normal((rows, k)).astype(np.float32)
    if kind == "heavy":
        return (rng.standard_t(2, (rows, k)) * 0.05).astype(np.float32)
    if kind == "positive":
        return (3 + rng.random((rows, k))).astype(np.float32)
    w = rng.standard_normal((rows, k)).astype(np.float32)   # "mixed": zero and constant blocks
    w[:, :32] = 0
    w[:, 32:64] = -1.5
    return w


# ----------------------------------------------------------------------------- names and sizes
def test_gguf_schemes_know_llama_cpp_sizes_and_type_ids():
    assert [s.name for s in GGUF_SCHEMES] == GGUF_NAMES
    for s in GGUF_SCHEMES:
        t = T[s.name.upper()]
        assert s.gguf_type == int(t)
        assert (s.block_size, s.bytes_per_block) == tuple(gguf.GGML_QUANT_SIZES[t])
        assert QuantScheme.from_gguf_type(int(t)) == s
        assert QuantScheme.from_gguf_type(t) == s


@pytest.mark.parametrize("name", GGUF_NAMES + INT_NAMES)
def test_scheme_is_hashable_and_round_trips_through_its_name(name):
    s = QuantScheme.parse(name)
    assert s.name == name and str(s) == name
    assert QuantScheme.parse(json.loads(json.dumps(s.to_json()))) == s
    assert QuantScheme.parse(name.upper()) == s
    assert QuantScheme.parse(s) is s
    assert len({s, QuantScheme.parse(name)}) == 1
    with pytest.raises(AttributeError):
        s.block = 64


def test_int_scheme_layouts():
    assert QuantScheme.parse("int8") == QuantScheme.parse("int8_b32")
    assert QuantScheme.parse("int4") == QuantScheme("int4", 32)
    for b in (8, 32, 256):
        assert QuantScheme.parse(f"int8_b{b}").bytes_per_block == 4 + b
        assert QuantScheme.parse(f"int4_b{b}").bytes_per_block == 4 + b // 2
        assert QuantScheme.parse(f"int8_b{b}").gguf_type is None
    assert QuantScheme.parse("int4_b64").packed_shape((3, 256)) == (3, 4 * 36)


@pytest.mark.parametrize("bad", ["q3_k", "q4", "int8_b12", "int8_b0", "int3", "int8_b", "", "q4_0 x",
                                 7, None, 3.5, ["q4_0"]])
def test_parse_rejects_unknown_schemes_naming_them_and_the_known_ones(bad):
    with pytest.raises(GraphError) as e:
        QuantScheme.parse(bad)
    msg = str(e.value)
    assert repr(bad) in msg or "block size" in msg
    if "block size" not in msg:
        assert "q4_k" in msg and "int8" in msg


@pytest.mark.parametrize("kind, block", [("q4_0", 64), ("q6_k", 32), ("int8", 12), ("int4", 0),
                                         ("int8", -8), ("int4", True), ("int8", 1 << 20), ("nope", 32),
                                         (3, 32)])
def test_constructor_validates(kind, block):
    with pytest.raises(GraphError):
        QuantScheme(kind, block)


@pytest.mark.parametrize("type_id", [0, 1, 9, 10, 30, 999, -1, "q4_0", None])
def test_unknown_gguf_type_names_the_tensor_and_type(type_id):
    with pytest.raises(WeightError, match=re.escape(TENSOR)) as e:
        QuantScheme.from_gguf_type(type_id, name=TENSOR)
    assert repr(type_id) in str(e.value) and "Q4_K" not in str(e.value) and "q4_k" in str(e.value)


# ----------------------------------------------------------------------------- decoding vs gguf
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("name", GGUF_NAMES)
def test_decoders_match_gguf_on_quantized_weights(rng, name, rows):
    s = QuantScheme.parse(name)
    w = _weights(rng, rows, 2 * 256, kind=["normal", "heavy", "positive", "mixed"][rows % 4])
    raw = _packed(s, w)
    assert raw.shape == s.packed_shape(w.shape) and raw.dtype == np.uint8
    want = gq.dequantize(raw, _gguf_type(s)).reshape(w.shape)
    ref = s.dequantize_reference(raw, w.shape)
    assert ref.dtype == np.float64 and ref.shape == w.shape
    np.testing.assert_allclose(ref, want, rtol=2.0 ** -23, atol=0)     # to float32 rounding
    out = np.full(w.shape, np.nan, np.float32)
    got = s.dequantize(raw, w.shape, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(s.dequantize(raw, w.shape, dtype=np.float64), ref)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")       # gguf's own NaN arithmetic
@pytest.mark.parametrize("name", GGUF_NAMES)
def test_decoders_match_gguf_on_random_block_bytes(rng, name):
    """Every bit pattern of the quant fields (negative Q6_K scales, high scale bits, ...) with finite
    random scales, and a few blocks whose scale is inf or NaN (they decode to inf/NaN, no error)."""
    s = QuantScheme.parse(name)
    n = 40
    raw = rng.integers(0, 256, (n, s.bytes_per_block), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scale = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 3, n)).astype("<f2")
        scale[:3] = [np.inf, -np.inf, np.nan]
        raw[:, off:off + 2] = scale.reshape(-1, 1).view(np.uint8)
    shape = (n // 4, 4 * s.block_size) if s.block_size == 32 else (n // 2, 2 * s.block_size)
    raw = raw.reshape(s.packed_shape(shape))
    want = gq.dequantize(raw, _gguf_type(s)).reshape(shape)
    ref = s.dequantize_reference(raw, shape)
    fin = np.isfinite(want)
    assert not fin.all() and fin.mean() > 0.5
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(want))
    np.testing.assert_allclose(ref[fin], want[fin], rtol=2.0 ** -23, atol=0)
    np.testing.assert_array_equal(s.dequantize(raw, shape), want)


@pytest.mark.parametrize("name", INT_NAMES)
def test_int_block_decoders_agree_on_random_bytes(rng, name):
    s = QuantScheme.parse(name)
    raw = rng.integers(0, 256, (6, 3 * s.bytes_per_block), dtype=np.uint8)
    blocks = raw.reshape(-1, s.bytes_per_block)
    blocks[:, :4] = (rng.standard_normal((len(blocks), 1)) * 100).astype("<f4").view(np.uint8)
    blocks[0, :4] = np.array([np.nan], "<f4").view(np.uint8)
    shape = (6, 3 * s.block_size)
    ref = s.dequantize_reference(raw, shape)
    assert np.isnan(ref[0, :s.block_size]).all() and np.isfinite(ref[:, s.block_size:]).all()
    np.testing.assert_allclose(s.dequantize(raw, shape), ref, rtol=2.0 ** -23, atol=0)
    np.testing.assert_array_equal(s.dequantize(raw, shape, dtype="f64"), ref)


# Scale bit patterns the vectorized decoders must treat exactly as the reference: signed zeros,
# f16 subnormals, the largest finite f16, inf and NaN.
_EDGE_F16 = np.array([0.0, -0.0, 6e-8, -6.1e-5, 65504.0, -65504.0, 1.0, -2.5, np.inf, -np.inf, np.nan],
                     "<f2")
_EDGE_F32 = np.array([0.0, -0.0, 1e-45, -1e-38, 3.4e38, 1.0, -2.5, np.inf, -np.inf, np.nan], "<f4")


@pytest.mark.parametrize("name", GGUF_NAMES + INT_NAMES + ["int4_b24", "int4_b64", "int8_b24"])
def test_vectorized_decoders_equal_the_reference_on_every_byte_value(rng, name, monkeypatch):
    """The numpy decoders (u64 nibble words, f16 table, in-place ufuncs) against the block-by-block
    reference: every value of every quant byte, edge scales, several chunks (the chunk size made
    tiny so the chunk loop and a short last chunk run), f64 exact, f32 and f16 rounded once."""
    import rlx_core.ir.quant as quant

    s = QuantScheme.parse(name)
    n = 2 * 256 + 6                                      # every byte value in every byte position
    raw = rng.integers(0, 256, (n, s.bytes_per_block), dtype=np.uint8)
    raw[:256, :] = np.arange(256, dtype=np.uint8)[:, None]
    raw[256:512, :] = np.arange(255, -1, -1, dtype=np.uint8)[:, None]
    edges, fields = (_EDGE_F32, [0]) if name.startswith("int") else (_EDGE_F16, F16_FIELDS[name])
    size = edges.dtype.itemsize
    for off in fields:
        scale = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3, n)).astype(edges.dtype)
        scale[::7][:len(edges)] = edges
        scale[-len(edges):] = edges[::-1]
        raw[:, off:off + size] = scale.reshape(-1, 1).view(np.uint8)
    shape = (n // 2, 2 * s.block_size)
    raw = raw.reshape(s.packed_shape(shape))
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 5 * s.block_size)
    ref = s.dequantize_reference(raw, shape)
    f64 = s.dequantize(raw, shape, dtype=np.float64)
    np.testing.assert_array_equal(f64, ref)
    np.testing.assert_array_equal(np.signbit(f64), np.signbit(ref))
    f32 = s.dequantize(raw, shape)
    fin = np.isfinite(ref) & (np.abs(ref) < 3e38)
    np.testing.assert_array_equal(np.isnan(f32), np.isnan(ref))
    np.testing.assert_allclose(f32[fin], ref[fin], rtol=2.0 ** -23, atol=1e-45)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(s.dequantize(raw, shape, dtype=np.float16), f32.astype(np.float16))


@pytest.mark.parametrize("model, schemes", [("smollm2", {"q4_1", "q8_0"}),
                                            ("gemma3", {"q4_k", "q6_k", "q5_0", "q8_0"})])
def test_real_llama_cpp_files_decode_like_gguf(model, schemes):
    """The GGUFs shipped in test packages (SmolLM2 Q4_1; Gemma 3 Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0):
    bytes written by llama.cpp's own quantizers."""
    from rlx_core.weights.gguf_io import read_gguf
    from rlx_core.weights.packaged import resolve_model_path

    try:
        path = resolve_model_path(model)
    except WeightError as e:
        pytest.skip(str(e))
    gf = read_gguf(path)
    blob = np.memmap(path, np.uint8, mode="r")
    checked = set()
    for t in gf.tensors:
        s = QuantScheme.from_gguf_type(t.ggml_type) if t.ggml_type in _GGUF_IDS else None
        if s is None or s in checked:
            continue
        checked.add(s)
        shape = (3, t.shape[-1])
        start = gf.data_start + t.offset
        raw = blob[start:start + s.packed_shape(shape)[1] * 3].reshape(3, -1)
        want = gq.dequantize(raw, T(s.gguf_type))
        np.testing.assert_array_equal(s.dequantize(raw, shape, name=t.name), want)
        np.testing.assert_allclose(s.dequantize_reference(raw, shape), want, rtol=2.0 ** -23, atol=0)
    assert {s.name for s in checked} == schemes


# ----------------------------------------------------------------------------- quantizing
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("name", LEGACY)
def test_legacy_quantizers_are_byte_identical_to_llama_cpp(rng, name, rows):
    s = QuantScheme.parse(name)
    assert _gguf_can_quantize(s)
    w = _weights(rng, rows, 128, kind=["normal", "heavy", "positive", "mixed"][rows % 4])
    w[0, :32] = rng.integers(-8, 8, 32) * 0.25          # values on exact rounding boundaries
    w[-1, 96:] = -w[-1, 96:].max()                       # a constant block
    np.testing.assert_array_equal(quantize(w, name), gq.quantize(w, _gguf_type(s)))


def _bound(name: str, blocks: np.ndarray) -> np.ndarray:
    """The worst-case |error| of each block of the format: half a quantization step, or a whole step
    where the format clips (Q4_0/Q5_0 map +max and -max to 7 and -8 steps), plus the f16 rounding of
    scales (relative 2**-11) times the largest multiplier. (Normal f16 scales: weights of ordinary
    magnitude; the formats lose precision once a scale is an f16 subnormal.)"""
    a = np.abs(blocks).max(axis=1)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    r = hi - lo
    eps = 2.0 ** -11
    if name in ("q4_0", "q5_0"):
        return a / (8 if name == "q4_0" else 16) + a * eps
    if name in ("q4_1", "q5_1"):
        return r / (30 if name == "q4_1" else 62) * (1 + 1e-6) + (np.abs(lo) + r) * eps
    if name == "q8_0":
        return a / 254 + a * eps
    if name in ("q4_k", "q5_k"):
        # offsets and scales are rounded up, so each sub-block's range is covered: half a step of the
        # widest sub-block span (including 0, as the format's offset is <= 0), grown by the 6-bit and
        # f16 rounding of its scale and offset: < (1 + 1/63)**2 (1 + 2**-10)
        sub = blocks.reshape(len(blocks), 8, 32)
        span = (np.maximum(sub.max(axis=2), 0) - np.minimum(sub.min(axis=2), 0)).max(axis=1)
        return 0.52 * span / (15 if name == "q4_k" else 31)
    if name == "q6_k":
        return 0.51 * a / 31
    qmax = 127 if name.startswith("int8") else 7
    return a / (2 * qmax) * (1 + 1e-6)


@pytest.mark.parametrize("kind", ["normal", "heavy", "positive", "mixed"])
@pytest.mark.parametrize("name", GGUF_NAMES + INT_NAMES)
def test_quantize_round_trip_error_is_within_the_format_bound(rng, name, kind):
    s = QuantScheme.parse(name)
    w = _weights(rng, 7, 512, kind)
    raw = s.quantize(w, name=TENSOR)
    assert raw.shape == s.packed_shape(w.shape) and raw.dtype == np.uint8
    back = s.dequantize(raw, w.shape)
    np.testing.assert_array_equal(back, s.dequantize_reference(raw, w.shape).astype(np.float32))
    err = np.abs(back.astype(np.float64) - w).reshape(-1, s.block_size).max(axis=1)
    blocks = w.astype(np.float64).reshape(-1, s.block_size)
    bound = _bound(name, blocks) + 2.0 ** -20 * np.abs(blocks).max(axis=1)    # + float32 arithmetic
    assert (err <= bound).all(), (err - bound).max()
    if kind == "mixed":                                  # an all-zero (sub-)block stays exactly zero
        assert (back[:, :32] == 0).all()


@pytest.mark.parametrize("name", GGUF_NAMES + INT_NAMES)
def test_zero_weights_quantize_to_exact_zeros(name):
    s = QuantScheme.parse(name)
    w = np.zeros((3, 256), np.float32)
    np.testing.assert_array_equal(s.dequantize(s.quantize(w), w.shape), w)


@pytest.mark.parametrize("name", ["int8_b32", "int4_b16", "q8_0"])
def test_values_on_the_grid_round_trip_exactly(rng, name):
    s = QuantScheme.parse(name)
    qmax = 7 if name.startswith("int4") else 127
    q = rng.integers(-qmax, qmax + 1, (5, 4 * s.block_size))
    q.reshape(-1, s.block_size)[:, 0] = qmax                       # the absmax fixes d = 2**-3
    w = (q * 0.125).astype(np.float32)
    np.testing.assert_array_equal(s.dequantize(s.quantize(w), w.shape), w)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(GGUF_NAMES + INT_NAMES), rows=st.integers(1, 3), nblocks=st.integers(1, 2),
       scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**32 - 1))
def test_quantize_then_decoders_agree_property(name, rows, nblocks, scale, seed):
    s = QuantScheme.parse(name)
    w = (np.random.default_rng(seed).standard_normal((rows, nblocks * s.block_size)) * scale)
    raw = s.quantize(w.astype(np.float32))
    ref = s.dequantize_reference(raw, w.shape)
    np.testing.assert_allclose(s.dequantize(raw, w.shape), ref, rtol=2.0 ** -23, atol=0)
    assert np.isfinite(ref).all()


# ----------------------------------------------------------------------------- layouts and outputs
def test_row_slices_of_packed_bytes_decode_to_row_slices_into_a_reused_scratch(rng):
    s = QuantScheme.parse("q4_k")
    w = _weights(rng, 9, 512)
    raw = s.quantize(w)
    full = s.dequantize(raw, w.shape)
    scratch = np.full((4, 512), np.nan, np.float32)
    for start in range(0, 9, 4):
        part = raw[start:start + 4]
        got = s.dequantize(part, (len(part), 512), out=scratch[:len(part)])
        np.testing.assert_array_equal(got, full[start:start + 4])


def test_nd_shapes_bytes_inputs_and_output_dtypes(rng):
    s = QuantScheme.parse("q8_0")
    w = rng.standard_normal((2, 3, 64)).astype(np.float32)
    raw = s.quantize(w)
    assert raw.shape == s.packed_shape(w.shape) == (6, 68)
    np.testing.assert_array_equal(raw, gq.quantize(w, T.Q8_0).reshape(6, 68))
    f32 = s.dequantize(raw, w.shape)
    assert f32.shape == (2, 3, 64)
    np.testing.assert_array_equal(s.dequantize(raw.tobytes(), w.shape), f32)
    np.testing.assert_array_equal(s.dequantize(raw.reshape(2, 3, 68), w.shape), f32)
    np.testing.assert_array_equal(s.dequantize(raw.reshape(-1), w.shape), f32)
    for dt in (np.float16, ml_dtypes.bfloat16, "bf16"):
        got = s.dequantize(raw, w.shape, dtype=dt)
        np.testing.assert_array_equal(got, f32.astype(got.dtype))
    for dt in (np.float16, ml_dtypes.bfloat16, np.float64, np.int32):   # float and int inputs
        np.testing.assert_array_equal(s.quantize(w.astype(dt)), s.quantize(w.astype(dt).astype(np.float32)))


# ----------------------------------------------------------------------------- matmul oracle
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("name", ["q4_0", "q6_k", "int4_b32"])
def test_matmul_reference(rng, name, m):
    s = QuantScheme.parse(name)
    w = _weights(rng, 24, 256)
    raw = s.quantize(w)
    x = rng.standard_normal((m, 256))
    want = x @ s.dequantize(raw, w.shape, dtype=np.float64).T
    np.testing.assert_allclose(matmul_reference(x, raw, name, w.shape), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ShapeError, match=re.escape(TENSOR)):
        matmul_reference(x[:, :128], raw, name, w.shape, name=TENSOR)
    with pytest.raises(WeightError, match=re.escape(TENSOR)):
        matmul_reference(x, raw, name, (2, 12, 256), name=TENSOR)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("name", GGUF_NAMES + ["int8_b64", "int4_b32"])
def test_k_not_a_multiple_of_the_block_names_the_tensor(name):
    s = QuantScheme.parse(name)
    k = s.block_size + 8
    with pytest.raises(WeightError, match=re.escape(TENSOR)) as e:
        s.packed_shape((4, k), name=TENSOR)
    assert str(k) in str(e.value) and str(s.block_size) in str(e.value) and name in str(e.value)
    with pytest.raises(WeightError, match=re.escape(TENSOR)):
        s.quantize(np.zeros((4, k), np.float32), name=TENSOR)
    with pytest.raises(WeightError, match=re.escape(TENSOR)):
        s.dequantize(np.zeros(4 * k, np.uint8), (4, k), name=TENSOR)


@pytest.mark.parametrize("name", GGUF_NAMES + ["int8_b32", "int4_b64"])
def test_mis_sized_packed_bytes_name_the_tensor_and_the_expected_size(rng, name):
    s = QuantScheme.parse(name)
    shape = (3, 2 * s.block_size)
    rows, per_row = s.packed_shape(shape)
    raw = s.quantize(rng.standard_normal(shape).astype(np.float32))
    bad = [raw.reshape(-1)[:-1], raw[:2], np.concatenate([raw, raw[:1]]),
           raw.reshape(-1)[:-1].tobytes(), raw.reshape(rows * 2, per_row // 2)]
    for b in bad:
        for fn in (s.dequantize, s.dequantize_reference):
            with pytest.raises(WeightError, match=re.escape(TENSOR)) as e:
                fn(b, shape, name=TENSOR)
            assert str(rows * per_row) in str(e.value) and name in str(e.value)
    for b in (raw.astype(np.int16), raw.view(np.int8), raw.astype(np.float32), list(raw.reshape(-1)), "x"):
        with pytest.raises(WeightError, match="uint8"):
            s.dequantize(b, shape, name=TENSOR)


@pytest.mark.parametrize("shape", [(), (0, 32), (-1, 32), (2.5, 32), (True, 32), "4x32", None, (4, None)])
def test_bad_logical_shapes(shape):
    s = QuantScheme.parse("q8_0")
    with pytest.raises(WeightError, match=re.escape(TENSOR)):
        s.packed_shape(shape, name=TENSOR)
    with pytest.raises(WeightError, match=re.escape(TENSOR)):
        s.dequantize(np.zeros(34, np.uint8), shape, name=TENSOR)


@pytest.mark.parametrize("name", GGUF_NAMES + ["int8_b32"])
def test_quantize_rejects_bad_values_naming_the_tensor(name):
    s = QuantScheme.parse(name)
    k = s.block_size
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones((2, k), np.float32)
        w[1, 3] = bad
        with pytest.raises(WeightError, match=re.escape(TENSOR)):
            s.quantize(w, name=TENSOR)
    for w in (np.ones((2, k), np.complex64), np.ones((2, k), bool), np.array([["a"] * k])):
        with pytest.raises(WeightError, match=re.escape(TENSOR)):
            s.quantize(w, name=TENSOR)


@pytest.mark.parametrize("name", GGUF_NAMES)
def test_values_beyond_the_f16_scale_range_are_an_error_not_inf(name):
    s = QuantScheme.parse(name)
    w = np.full((1, s.block_size), 1e9, np.float32)
    w[0, 1] = -1e9
    with pytest.raises(WeightError, match=re.escape(TENSOR) + ".*f16"):
        s.quantize(w, name=TENSOR)
    big = QuantScheme.parse("int8_b32")                 # the f32 scale of the int blocks takes them
    np.testing.assert_allclose(big.dequantize(big.quantize(w[:, :32]), (1, 32)), w[:, :32], rtol=1e-2)


def test_dequantize_out_and_dtype_are_checked():
    s = QuantScheme.parse("q4_0")
    raw = s.quantize(np.ones((2, 64), np.float32))
    with pytest.raises(ShapeError, match=re.escape(TENSOR)):
        s.dequantize(raw, (2, 64), out=np.empty((2, 32), np.float32), name=TENSOR)
    with pytest.raises(ShapeError):
        s.dequantize(raw, (2, 64), out=np.empty((64, 2), np.float32).T)
    ro = np.empty((2, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ShapeError):
        s.dequantize(raw, (2, 64), out=ro)
    with pytest.raises(DTypeError, match=re.escape(TENSOR)):
        s.dequantize(raw, (2, 64), out=np.empty((2, 64), np.float64), name=TENSOR)
    with pytest.raises(DTypeError):
        s.dequantize(raw, (2, 64), out=[[0.0] * 64] * 2)
    for dt in (np.int32, "i8", "nonsense"):
        with pytest.raises(DTypeError):
            s.dequantize(raw, (2, 64), dtype=dt)


def test_every_error_is_the_projects_own():
    s = QuantScheme.parse("q4_k")
    calls = [lambda: QuantScheme.parse({}), lambda: s.packed_shape((1, 2, 3)),
             lambda: s.dequantize(b"\x00" * 10, (1, 256)), lambda: s.quantize([[1.0] * 100]),
             lambda: quantize(np.zeros((1, 32)), "q9_9"), lambda: QuantScheme.from_gguf_type(3.5)]
    for call in calls:
        with pytest.raises(RlxError):
            call()
