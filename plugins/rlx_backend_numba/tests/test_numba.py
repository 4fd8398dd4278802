"""The numba backend against float64 numpy references on fresh random inputs: generated
elementwise kernels in every operand layout, the row kernels, attention (causal, window,
GQA, masks, softcap, decode over the KV cache) and the GEMV on both their one-thread and
all-thread drivers, a tiny LLaMA against the numpy backend, selection and availability.
The op table's parity suite (rlx_core.testing, run by tests/test_ops.py) runs on this backend
as on every other."""
from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import rlx_core
from rlx_core.backends.numpy.blas import single_threaded_blas
from rlx_core.ir.dtype import BOOL, F32, F64, I32, DType
from rlx_core.ir.errors import BackendError
from rlx_core.ir.graph import Builder
from rlx_core.ir.ops import ACTIVATIONS, BINARY_OPS, COMPARE_OPS
from rlx_core.pipeline import available_backends, select_backend
from rlx_core.profile import CompileProfile

pytest.importorskip("numba")

from rlx_backend_numba import NumbaBackend, codegen, requested_threads, runner  # noqa: E402
from rlx_core.testing import parity  # noqa: E402
from rlx_core.testing.parity import assert_greedy_agrees  # noqa: E402
from rlx_core.testing.parity import rng  # noqa: E402,F401  (seeded per test; RLX_TEST_SEED replays)
RAW = CompileProfile().evolve(fusion={"skip": True})
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-10}


def close(got, want, dtype):
    want = np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)), 1e-30)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=TOL[np.dtype(dtype)], atol=TOL[np.dtype(dtype)] * scale)


@pytest.fixture(params=["ser", "par"])
def driver(request, monkeypatch):
    """Both drivers of every kernel: one thread (small work) and prange over rows."""
    if request.param == "par":
        monkeypatch.setattr(codegen, "PAR_MIN", 0)
        monkeypatch.setattr(runner, "PAR_MIN", 0)
    return request.param


def compile_numba(build, params=None, profile=RAW):
    return rlx_core.compile(graph(build), profile=profile, backend="numba", params=params)


def graph(build):
    m = Builder("t", "mir")
    outs = build(m)
    for k, v in enumerate(outs if isinstance(outs, tuple) else (outs,)):
        m.output(f"out{k}", v)
    return m.build()


def run_poisoned(exe, inputs):
    r = exe.runner(exe._bind_dims(inputs))
    r.arena.fill(0xFF)
    return exe.run(inputs)


# --------------------------------------------------------------------------- generated kernels
def test_expression_table_covers_the_op_table():
    assert set(codegen.ACT) == set(ACTIVATIONS)
    assert set(codegen.BINARY) == set(BINARY_OPS)
    assert set(codegen.COMPARE) == set(COMPARE_OPS)


# x * y + silu(x), then where(x > y, that, y) cast to the output dtype
PROGRAM = (("binary", (("op", "mul"),), (0, 1)),
           ("activation", (("fn", "silu"),), (0,)),
           ("binary", (("op", "add"),), (2, 3)),
           ("compare", (("op", "gt"),), (0, 1)),
           ("where", (), (5, 4, 1)))


def ref_program(x, y):
    t = x * y + x / (1 + np.exp(-x))
    return np.where(x > y, t, y)


def _layout(rng, case, dt):
    """(x, y) host arrays laid out as `case`: the generator's F, P, X, R, C, S kinds and a copy."""
    full = rng.uniform(-3, 3, (3, 5, 40)).astype(dt)
    if case == "flat":
        return full, rng.uniform(-3, 3, (3, 5, 40)).astype(dt)
    if case == "row":
        return full, rng.uniform(-3, 3, (40,)).astype(dt)
    if case == "col":
        return full, rng.uniform(-3, 3, (3, 5, 1)).astype(dt)
    if case == "scalar":
        return full, np.asarray(rng.uniform(-3, 3), dt)
    if case == "strided":                    # rows of 40 contiguous values, 80 apart
        return rng.uniform(-3, 3, (3, 5, 80)).astype(dt)[..., 10:50], full
    if case == "gapped":                     # every other value
        return rng.uniform(-3, 3, (3, 5, 80)).astype(dt)[..., ::2], full
    if case == "copy":
        return full, rng.uniform(-3, 3, (40, 5, 3)).astype(dt).transpose(2, 1, 0)
    raise AssertionError(case)


@pytest.mark.parametrize("case,kinds", [("flat", "FF"), ("row", "FR"), ("col", "FC"), ("scalar", "FS"),
                                        ("strided", "PF"), ("gapped", "XF"), ("copy", "FF")])
@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=["f32", "f64"])
def test_generated_layouts(rng, driver, case, kinds, dt):
    x, y = _layout(rng, case, dt)
    out = np.full(np.broadcast_shapes(x.shape, y.shape), np.nan, dt)
    C, got_kinds, copies = codegen.plan_operands(out.shape, [x, y])
    assert got_kinds == kinds and bool(copies) == (case == "copy")
    fn = codegen.elementwise_step(PROGRAM, [x, y], out)
    assert fn is not None
    fn(None, [out], x, y)
    close(out, ref_program(x.astype(np.float64), y.astype(np.float64)), dt)


def test_generated_in_place_and_mixed_dtypes(rng):
    """The output may be the buffer of its first input (the planner's in-place reuse); f32
    and f64 operands meet through the graph's own promotion and casts."""
    x = rng.uniform(-3, 3, (4, 33)).astype(np.float32)
    y = rng.uniform(-3, 3, (33,))
    want = y / (1 + np.exp(-x.astype(np.float64)))
    program = (("activation", (("fn", "sigmoid"),), (0,)),
               ("binary", (("op", "mul"),), (2, 1)),
               ("cast", (("dtype", "f32"),), (3,)))
    fn = codegen.elementwise_step(program, [x, y], x)
    fn(None, [x], x, y)
    close(x, want, np.float32)


def test_not_native_programs_stay_on_numpy():
    ints = np.arange(12, dtype=np.int32).reshape(3, 4)
    prog = (("binary", (("op", "div"),), (0, 1)),)
    assert codegen.elementwise_step(prog, [ints, ints], np.empty((3, 4), np.int32)) is None
    assert codegen.elementwise_source(prog, [DType.F16, DType.F16], DType.F16, "FF") is None


def test_source_is_one_expression_per_step_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_CACHE", str(tmp_path))
    src = codegen.elementwise_source(PROGRAM + (("activation", (("fn", "gelu_tanh"),), (6,)),),
                                     [F32, F32], F32, "FR")
    assert "tanh32(" in src and "prange" in src and "fastmath=False" in src and "cache=True" in src
    mod = codegen.load_source(src)
    assert codegen.load_source(src) is mod
    files = [p.name for p in tmp_path.iterdir() if p.suffix == ".py"]
    assert len(files) == 1 and Path(mod.__file__).parent == tmp_path
    o = np.empty(8, np.float32)
    mod.ser(o, 8, 8, np.ones(8, np.float32), np.ones(8, np.float32))
    index = Path(mod.ser._cache._cache_path)                # numba's cache of this kernel
    assert any(p.suffix == ".nbi" and p.name.startswith(Path(mod.__file__).stem) for p in index.iterdir())


def test_generated_source_is_named_by_the_plugin_code(tmp_path, monkeypatch):
    """The same generated text under another version of the plugin's code is another file
    (numba's cache of it would hold the machine code of the kernels it calls as they were)."""
    monkeypatch.setenv("RLX_NUMBA_CACHE", str(tmp_path))
    src = codegen.elementwise_source(PROGRAM, [F32, F32], F32, "FR")
    first = codegen.load_source(src)
    monkeypatch.setattr(codegen, "_plugin_code", lambda: "another version")
    second = codegen.load_source(src)
    assert first is not second and first.__file__ != second.__file__
    assert "another version" in Path(second.__file__).read_text().splitlines()[0]


# --------------------------------------------------------------------------- row kernels
@pytest.mark.parametrize("dt", [F32, F64], ids=["f32", "f64"])
def test_row_kernels_on_strided_rows(rng, driver, dt):
    """Norms with and without residual, softmax and rope read a narrowed (row-strided) input;
    an RMSNorm over its heads reads rows that are not evenly spaced."""
    npdt = dt.np
    xs = rng.uniform(-2, 2, (2, 5, 48)).astype(npdt)
    r = rng.uniform(-2, 2, (2, 5, 32)).astype(npdt)
    w = rng.uniform(0.5, 1.5, (32,)).astype(npdt)
    b = rng.uniform(-1, 1, (32,)).astype(npdt)
    ang = rng.uniform(0, 6.3, (2, 8))
    cos, sin = np.cos(ang).astype(npdt), np.sin(ang).astype(npdt)

    def build(m):
        x = m.narrow(m.input("x", (2, 5, 48), dt), -1, 8, 32)
        h, y = m.add("fused_residual_rms_norm", (x, m.input("r", (2, 5, 32), dt), m.input("w", (32,), dt)),
                     eps=1e-6, offset=1.0)
        h2, z = m.add("fused_residual_ln", (x, m.input("r2", (2, 5, 32), dt), m.input("g", (32,), dt),
                                            m.input("b", (32,), dt)), eps=1e-5)
        s = m.softmax(x, -1)
        q = m.reshape(x, (2, 5, 2, 16))
        rot = m.rope(q, m.input("cos", (2, 8), dt), m.input("sin", (2, 8), dt), style="interleaved")
        heads = m.rms_norm(q, m.input("wh", (16,), dt), eps=1e-6)      # rows 16 then 32 apart
        return h, y, z, s, rot, m.rms_norm(x, eps=1e-6), m.layer_norm(x, eps=1e-5), heads

    exe = compile_numba(build)
    got = run_poisoned(exe, {"x": xs, "r": r, "r2": r, "w": w, "g": w, "b": b, "cos": cos, "sin": sin,
                             "wh": w[:16]})
    x64 = xs[..., 8:40].astype(np.float64)
    h = x64 + r
    close(got["out0"], h, npdt)
    close(got["out1"], parity.ref_rms_norm(h, w, eps=1e-6, offset=1.0), npdt)
    close(got["out2"], parity.ref_layer_norm(h, w, b, eps=1e-5), npdt)
    close(got["out3"], parity.ref_softmax(x64, -1), npdt)
    close(got["out4"], parity.ref_rope(x64.reshape(2, 5, 2, 16), cos, sin, "interleaved"), npdt)
    close(got["out5"], parity.ref_rms_norm(x64, eps=1e-6), npdt)
    close(got["out6"], parity.ref_layer_norm(x64, eps=1e-5), npdt)
    close(got["out7"], parity.ref_rms_norm(x64.reshape(2, 5, 2, 16), w[:16], eps=1e-6), npdt)


# --------------------------------------------------------------------------- attention
ATTN = {  # mask_kind, window, mask input, softcap, Sq, Sk, pos
    "causal": ("causal", 0, None, 0.0, 6, 6, None),
    "sliding_pos": ("sliding_window", 3, None, 0.0, 2, 9, (5, 2)),
    "custom_bool": ("custom", 0, "bool", 0.0, 4, 5, None),
    "bias_pos_softcap": ("causal", 0, "bias", 4.0, 2, 6, (1, 3)),
    "chunk_pos": ("causal", 0, None, 0.0, 3, 8, (0, 4)),
    "rows_sliding_bool": ("sliding_window", 7, "bool", 0.0, 37, 40, (3, 0)),
    # prefill rows past FEW_QUERIES, in tasks of ATTN_TILE (sgemm) or ATTN_ROWS rows: several, the last ragged
    "long_rows_sliding_bool": ("sliding_window", 7, "bool", 0.0, runner.FEW_QUERIES + 7, runner.FEW_QUERIES + 11,
                               (3, 0)),
    # one query row over a long cache: decode attention splits the keys into chunks
    "decode_sliding": ("sliding_window", 50, None, 0.0, 1, 130, (120, 40)),
    "decode_custom_bool": ("custom", 0, "bool", 0.0, 1, 130, None),
    "decode_bias_softcap": ("causal", 0, "bias", 4.0, 1, 130, (129, 70)),
}


def attention_case(rng, case, dt, heads, kv_heads, d=16, extra=()):
    kind, window, mask, softcap, sq, sk, pos = ATTN[case]
    args = [parity.arg(rng, "q", (2, heads, sq, d), dt), parity.arg(rng, "k", (2, kv_heads, sk, d), dt),
            parity.arg(rng, "v", (2, kv_heads, sk, d), dt)] + list(extra)
    if mask == "bool":
        m = rng.random((2, 1, sq, sk)) < 0.6
        m[..., 0] = True
        m[..., 30:100] = False           # longer than a chunk of decode attention: one chunk all masked
        args.append(parity.Arg("mask", m, BOOL))
    elif mask == "bias":
        args.append(parity.arg(rng, "mask", (1, heads, sq, sk), F32))
    if pos is not None:
        args.append(parity.Arg("pos", np.array(pos, np.int32), I32))
    return args, {"mask_kind": kind, "window": window, "scale": d ** -0.5, "softcap": softcap,
                  "has_mask": mask is not None, "has_pos": pos is not None}


def attention_ref(attrs_, n_extra=0):
    def ref(q, k, v, *rest):
        rest = list(rest[n_extra:])
        mask = rest.pop(0) if attrs_["has_mask"] else None
        pos = rest.pop(0) if attrs_["has_pos"] else None
        return parity.ref_attention(q, k, v, mask, pos, scale=attrs_["scale"], mask_kind=attrs_["mask_kind"],
                                    window=attrs_["window"], softcap=attrs_["softcap"])
    return ref


@pytest.mark.parametrize("d", [24, 12], ids=["lanes_and_tail", "scalar"])
@pytest.mark.parametrize("case", ["decode_bias_softcap", "decode_custom_bool"])
def test_decode_attention_head_sizes(rng, driver, case, d):
    """Decode attention multiplies f32 key and value rows 8 lanes at a time when the head
    size is a multiple of 8 (24: a pair of lane groups, then one more), else in scalar loops."""
    args, attrs_ = attention_case(rng, case, F32, 6, 2, d=d)
    parity.run_parity("numba", "attention", args, attrs_, attention_ref(attrs_), tol=2e-5)


@pytest.mark.parametrize("case", list(ATTN))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("sgemm", [True, False], ids=["sgemm", "no_sgemm"])
def test_attention_variants(rng, driver, monkeypatch, case, heads, kv_heads, sgemm):
    if not sgemm:                                    # f32 prefill without a cblas_sgemm to call
        monkeypatch.setattr(runner, "SGEMM", None)
    args, attrs_ = attention_case(rng, case, F32, heads, kv_heads)
    parity.run_parity("numba", "attention", args, attrs_, attention_ref(attrs_), tol=2e-5)


@pytest.mark.skipif(runner.SGEMM is None, reason="numpy's BLAS has no cblas_sgemm to call")
@pytest.mark.parametrize("kind,window,mask,softcap", [("sliding_window", 21, "bool", 0.0),
                                                      ("causal", 0, "bias", 5.0), ("custom", 0, "bool", 0.0),
                                                      ("causal", 0, None, 0.0)])
def test_prefill_attention_as_sgemm_tiles(rng, driver, monkeypatch, kind, window, mask, softcap):
    """f32 prefill attention runs as tiles of query rows x a GQA group's heads, two sgemm
    calls each, equal to float64: three tiles (the last ragged) after cached positions, 6
    heads on 2 kv heads, a k and v with strided rows read in place, one fully masked row, no
    mask at all."""
    called = []
    for name in ("attention_gemm_par", "attention_gemm_ser"):
        kern = getattr(runner.K, name)
        monkeypatch.setattr(runner.K, name, lambda *args, kern=kern: called.append(kern) or kern(*args))
    b, h, kvh, sq, d, sk = 2, 6, 2, 2 * runner.ATTN_TILE + 7, 16, 2 * runner.ATTN_TILE + 20
    pos = np.array([13, 0], np.int64)
    q = rng.standard_normal((b, h, sq, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, kvh, sk, 3 * d)).astype(np.float32)[..., d:2 * d] for _ in "kv")
    if mask == "bool":
        m = rng.random((b, 1, sq, sk)) < 0.7
        m[1, 0, 40] = False                          # every key of this row masked: zeros
    elif mask == "bias":
        m = rng.standard_normal((1, h, sq, sk)).astype(np.float32)
    else:                                            # scores as they are: the vector row max
        m = None
    a = {"mask_kind": kind, "window": window, "scale": d ** -0.5, "softcap": softcap}
    o = np.full((b, h, sq, d), np.nan, np.float32)
    runner._attention_fn(a, q, k, v, o, m)(q, k, v, m, pos)
    assert called, "not the sgemm path"
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    want = parity.ref_attention(q64, k64, v64, m if mask != "bias" else m.astype(np.float64), pos,
                                scale=a["scale"], mask_kind=kind, window=window, softcap=softcap)
    close(o, want, np.float32)
    if mask == "bool":
        assert not o[1, :3, 40].any()


def test_attention_tile_sizes():
    """Causal tiles stay small; unmasked ones grow to the whole query (a ViT's 257 tokens),
    split equally when their scores would pass ATTN_TILE_BYTES, and split further so that
    every thread has two tasks."""
    tile = runner.K.attention_tile
    assert tile(32, 257, 257, 96, 2, True) == 32
    assert tile(32, 257, 257, 96, 2, False) == 257
    assert tile(32, 1000, 1000, 96, 2, False) == 125                # 131 rows fit: 8 equal tiles
    assert tile(32, 257, 257, 6, 16, False) == 33                   # 8 tiles x 6 heads >= 32 tasks
    assert tile(32, 40, 40, 1, 64, False) == 40                     # no tile under `rows` rows
    assert tile(32, 5, 9, 1, 2, True) == 5


@pytest.mark.skipif(runner.SGEMM is None, reason="numpy's BLAS has no cblas_sgemm to call")
@pytest.mark.parametrize("mask", [None, "bool"])
def test_unmasked_prefill_attention_in_large_tiles(rng, driver, monkeypatch, mask):
    """Attention without a causal mask (an encoder's) runs in tiles as large as fit
    ATTN_TILE_BYTES: here two of 150 query rows over 600 keys, equal to float64."""
    rows = []
    monkeypatch.setattr(runner.numba, "get_num_threads", lambda: 2)     # (the split depends on it)
    for name in ("attention_gemm_par", "attention_gemm_ser"):
        kern = getattr(runner.K, name)
        monkeypatch.setattr(runner.K, name, lambda *args, kern=kern: rows.append(args[-3]) or kern(*args))
    b, h, sq, sk, d = 1, 2, 300, 600, 16
    q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for n in (sq, sk, sk))
    m = rng.random((b, 1, sq, sk)) < 0.5 if mask else None
    a = {"mask_kind": "custom" if mask else "none", "window": 0, "scale": d ** -0.5, "softcap": 0.0}
    o = np.full((b, h, sq, d), np.nan, np.float32)
    runner._attention_fn(a, q, k, v, o, m)(q, k, v, m, None)
    assert rows == [150]
    want = parity.ref_attention(*(x.astype(np.float64) for x in (q, k, v)), m, None, scale=a["scale"],
                                mask_kind=a["mask_kind"], window=0, softcap=0.0)
    close(o, want, np.float32)


@pytest.mark.parametrize("dt", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("seq,heads,kv_heads", [(37, 4, 4), (5, 6, 2), (131, 3, 3)])
@pytest.mark.parametrize("mask", [None, "bool", "bias"])
@pytest.mark.parametrize("tap", [False, True], ids=["alone", "tapped"])
def test_encoder_attention_reads_heads_in_place(rng, driver, monkeypatch, dt, seq, heads, kv_heads, mask, tap):
    """An encoder's attention on the q, k, v heads of one fused QKV matmul, transposed to
    [B, H, S, D] and back for the output projection (ViT, BERT): the four transposes are views
    (strided_transposes), the attention reads its heads from the QKV rows and, where the
    transpose alone reads it, writes its output in the [B, S, H, D] order the projection reads;
    equal to float64 with the sgemm tiles and without, at odd lengths, in groups of heads, with
    and without a mask. `tap`: the attention's output is also a graph output (its own order)."""
    if dt == F32 and mask == "bias":                 # one f32 case without cblas_sgemm's tiles
        monkeypatch.setattr(runner, "SGEMM", None)
    b, d = 2, 8
    e, ekv = heads * d, kv_heads * d
    x = rng.standard_normal((b, seq, e)).astype(dt.np)
    wqkv = (rng.standard_normal((e + 2 * ekv, e)) * e ** -0.5).astype(dt.np)
    wo = (rng.standard_normal((e, e)) * e ** -0.5).astype(dt.np)
    mk = {None: None, "bool": rng.random((b, 1, seq, seq)) < 0.7,
          "bias": rng.standard_normal((b, heads, seq, seq)).astype(dt.np)}[mask]

    def build(m):
        qkv = m.matmul(m.input("x", (b, seq, e), dt), m.param("wqkv", wqkv.shape, dt), trans_b=True)
        q, k, v = (m.transpose(m.reshape(m.narrow(qkv, 2, at, n * d), (b, seq, n, d)), (0, 2, 1, 3))
                   for at, n in ((0, heads), (e, kv_heads), (e + ekv, kv_heads)))
        mv = None if mk is None else m.input("mask", mk.shape, BOOL if mask == "bool" else dt)
        o = m.attention(q, k, v, mv, mask_kind="none" if mk is None else "custom")
        y = m.matmul(m.reshape(m.transpose(o, (0, 2, 1, 3)), (b, seq, e)), m.param("wo", wo.shape, dt),
                     trans_b=True)
        return (y, o) if tap else y

    exe = compile_numba(build, params={"wqkv": wqkv, "wo": wo})
    feed = {"x": x} if mk is None else {"x": x, "mask": mk}
    r = exe.runner(exe._bind_dims(feed))
    assert [r.graph.nodes[st[0]].op for st in r.steps].count("transpose") == tap    # (tapped: the output's)
    (att,) = [i for i, n in enumerate(r.graph.nodes) if n.op == "attention"]
    (out,) = [st[5][0] for st in r.steps if st[0] == att]
    assert (out.strides[1] == d * out.itemsize) != tap        # [B, S, H, D] bytes unless tapped
    got = run_poisoned(exe, feed)
    qkv64 = x.astype(np.float64) @ wqkv.astype(np.float64).T
    q, k, v = (qkv64[..., at:at + n * d].reshape(b, seq, n, d).transpose(0, 2, 1, 3)
               for at, n in ((0, heads), (e, kv_heads), (e + ekv, kv_heads)))
    o = parity.ref_attention(q, k, v, mk, None, scale=d ** -0.5, mask_kind="none" if mk is None else "custom")
    close(got["out0"], o.transpose(0, 2, 1, 3).reshape(b, seq, e) @ wo.astype(np.float64).T, dt.np)
    if tap:
        close(got["out1"], o, dt.np)


def test_fused_attention_block(rng, driver):
    ang = rng.uniform(0, 2 * math.pi, (6, 8))
    tables = (parity.Arg("cos", np.cos(ang), F64), parity.Arg("sin", np.sin(ang), F64))
    args, attrs_ = attention_case(rng, "causal", F64, 4, 2, extra=tables)
    inner = attention_ref(attrs_, n_extra=2)
    attrs_["style"] = "half"

    def ref(q, k, v, c, s):
        return inner(parity.ref_rope(q, c, s), parity.ref_rope(k, c, s), v, c, s)

    parity.run_parity("numba", "fused_attention_block", args, attrs_, ref)


def test_gathered_rows_written_to_a_cache_in_one_step(rng, monkeypatch):
    """kv_write(cache, gather(k, idx)) as Gemma's ring prefill emits it: one copy of the chosen
    rows (negative indices from the end), equal to gathering then writing; an index or a
    position out of range is the NumPy backend's error, with nothing written."""
    from rlx_core.ir.errors import ModelError

    calls = []
    real = runner.K.kv_write_rows
    monkeypatch.setattr(runner.K, "kv_write_rows", lambda *a: calls.append(1) or real(*a))
    b, kvh, s, ctx, d, n = 2, 3, 5, 12, 8, 7

    def build(m):
        cache = m.state("kc", (b, kvh, ctx, d))
        idx = m.input("idx", (n,), rlx_core.I64)
        return m.kv_write(cache, m.gather(m.input("k", (b, kvh, s, d)), idx, axis=2), m.input("pos", (b,), I32))

    exe = compile_numba(build)
    k = rng.uniform(-2, 2, (b, kvh, s, d)).astype(np.float32)
    idx = np.array([4, 0, -1, 2, 2, -5, 1])
    pos = np.array([0, 5], np.int32)
    got = exe.run(k=k, idx=idx, pos=pos)["out0"]
    want = np.zeros((b, kvh, ctx, d), np.float32)
    for i in range(b):
        want[i, :, pos[i]:pos[i] + n] = k[i][:, idx]
    np.testing.assert_array_equal(got, want)
    assert calls, "not the one-step write"
    before = exe.states["kc"].copy()
    with pytest.raises(ModelError, match="index out of range"):
        exe.run(k=k, idx=np.array([0, 1, 2, 3, 4, 5, 0]), pos=pos)
    with pytest.raises(ModelError, match="kv_write"):
        exe.run(k=k, idx=idx, pos=np.array([0, 6], np.int32))
    np.testing.assert_array_equal(exe.states["kc"], before)


def test_decode_over_kv_cache(rng, driver):
    """Steps of one token each: kv_write into state caches, attention at pos over the cache."""
    b, h, kvh, ctx, d = 2, 4, 2, 12, 8

    def build(m):
        kc, vc = m.state("kc", (b, kvh, ctx, d)), m.state("vc", (b, kvh, ctx, d))
        pos = m.input("pos", (b,), I32)
        k = m.add("kv_write", (kc, m.input("k", (b, kvh, 1, d)), pos), axis=2)
        v = m.add("kv_write", (vc, m.input("v", (b, kvh, 1, d)), pos), axis=2)
        return m.attention(m.input("q", (b, h, 1, d)), k, v, pos=pos, scale=d ** -0.5)

    exe = compile_numba(build)
    keys, vals = np.zeros((b, kvh, ctx, d)), np.zeros((b, kvh, ctx, d))
    start = np.array([0, 3], np.int32)
    for step in range(5):
        pos = start + step
        q, k, v = (rng.uniform(-2, 2, s).astype(np.float32) for s in
                   ((b, h, 1, d), (b, kvh, 1, d), (b, kvh, 1, d)))
        for i in range(b):
            keys[i, :, pos[i]], vals[i, :, pos[i]] = k[i, :, 0], v[i, :, 0]
        got = run_poisoned(exe, {"q": q, "k": k, "v": v, "pos": pos})["out0"]
        want = parity.ref_attention(q.astype(np.float64), keys, vals, None, pos, scale=d ** -0.5)
        close(got, want, np.float32)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_decode_step_makes_its_attention_inputs_in_one_step(rng, driver, style):
    """A decode layer's RoPE of q and k, both cache writes and the attention run as one step
    (no rope or kv_write step left), equal to float64 RoPE + cache + attention over several
    steps with rows at different positions; a position past the cache is kv_write's error."""
    from rlx_core.ir.errors import ModelError

    b, h, kvh, ctx, d, half = 2, 4, 2, 12, 8, 3        # half < d / 2: the dims past 2 * half pass through

    def build(m):
        kc, vc = m.state("kc", (b, kvh, ctx, d)), m.state("vc", (b, kvh, ctx, d))
        pos = m.input("pos", (b,), I32)
        cos, sin = m.input("cos", (b, 1, half)), m.input("sin", (b, 1, half))
        q = m.add("rope", (m.input("q", (b, h, 1, d)), cos, sin), style=style)
        k = m.add("rope", (m.input("k", (b, kvh, 1, d)), cos, sin), style=style)
        keys = m.add("kv_write", (kc, k, pos), axis=2)
        vals = m.add("kv_write", (vc, m.input("v", (b, kvh, 1, d)), pos), axis=2)
        return m.attention(q, keys, vals, pos=pos, scale=d ** -0.5)

    exe = compile_numba(build)
    keys, vals = np.zeros((b, kvh, ctx, d)), np.zeros((b, kvh, ctx, d))
    start = np.array([0, 5], np.int32)
    for step in range(4):
        pos = start + step
        q, k, v = (rng.uniform(-2, 2, s).astype(np.float32) for s in ((b, h, 1, d), (b, kvh, 1, d), (b, kvh, 1, d)))
        ang = rng.uniform(-3, 3, (b, 1, half))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        feed = {"q": q, "k": k, "v": v, "pos": pos, "cos": cos, "sin": sin}
        r = exe.runner(exe._bind_dims(feed))
        assert [r.graph.nodes[st[0]].op for st in r.steps] == ["attention"]
        kr = parity.ref_rope(k, cos.astype(np.float64), sin.astype(np.float64), style)
        for i in range(b):
            keys[i, :, pos[i]], vals[i, :, pos[i]] = kr[i, :, 0], v[i, :, 0]
        got = run_poisoned(exe, feed)["out0"]
        qr = parity.ref_rope(q, cos.astype(np.float64), sin.astype(np.float64), style)
        close(got, parity.ref_attention(qr, keys, vals, None, pos, scale=d ** -0.5), np.float32)
    with pytest.raises(ModelError, match="kv_write.*overflows the cache of length 12"):
        exe.run(dict(feed, pos=np.array([3, ctx], np.int32)))


# --------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("rows", [1, 5, 300], ids=["gemv", "blas", "tall"])   # tall: M split
@pytest.mark.parametrize("dt", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("n", [40, 200], ids=["narrow", "cblas"])     # >= 128 columns: cblas_sgemm parts
def test_linear_epilogue(rng, driver, rows, dt, n):
    x = rng.uniform(-1, 1, (1, rows, 24)).astype(dt.np)
    w = rng.uniform(-1, 1, (n, 24)).astype(dt.np)
    bias = rng.uniform(-1, 1, (n,)).astype(dt.np)

    def build(m):
        y = m.add("fused_matmul_bias_act", (m.input("x", (1, rows, 24), dt), m.param("w", (n, 24), dt),
                                            m.param("b", (n,), dt)), trans_b=True, act="gelu_tanh")
        return y, m.matmul(m.input("x2", (1, rows, 24), dt), m.param("w2", (n, 24), dt), trans_b=True)

    exe = compile_numba(build, params={"w": w, "b": bias, "w2": w})
    y = x.astype(np.float64) @ w.T.astype(np.float64)
    for scope in (contextlib.nullcontext, single_threaded_blas):   # (an encoder's data-parallel part)
        with scope():
            got = run_poisoned(exe, {"x": x, "x2": x})
        close(got["out0"], parity.REF_ACT["gelu_tanh"](y + bias), dt.np)
        close(got["out1"], y, dt.np)


@pytest.mark.skipif(runner.SGEMM is None, reason="numpy's BLAS has no cblas_sgemm to call")
@pytest.mark.parametrize("m,n,kernel", [(300, 200, "gemm_rows_par"), (150, 200, "gemm_par")])
def test_f32_gemm_splits_its_longer_side(rng, monkeypatch, m, n, kernel):
    """An f32 product on numba's threads splits its rows when it has more rows than columns
    (the weight is then the operand each part packs), else its columns; both equal float64."""
    called = []
    monkeypatch.setattr(runner, "blas_threads", lambda: 2)       # (not a data-parallel part's one thread)
    for name in ("gemm_par", "gemm_rows_par"):
        kern = getattr(runner.K, name)
        monkeypatch.setattr(runner.K, name, lambda *args, kern=kern, name=name: called.append(name) or kern(*args))
    x = rng.standard_normal((m, 48)).astype(np.float32)
    w = rng.standard_normal((n, 48)).astype(np.float32)
    o = np.full((m, n), np.nan, np.float32)
    runner._matmul_fn(x, w, o, trans_b=True)(x, w)
    assert called == [kernel]
    close(o, x.astype(np.float64) @ w.T.astype(np.float64), np.float32)


# --------------------------------------------------------------------------- selection
def test_numba_ranks_above_numpy_and_numpy_stays_selectable():
    order = [b.name for b, ok, _ in available_backends() if ok]
    assert order.index("numba") < order.index("numpy")
    assert select_backend().priority >= NumbaBackend.priority
    assert select_backend("numpy").name == "numpy"


def test_adopt_copies_large_file_mapped_weights(tmp_path, monkeypatch, rng):
    """A file-mapped weight from ADOPT_MIN_BYTES on becomes the backend's own copy (same
    values, no memory shared with the file); a smaller one and an in-memory array stay."""
    import rlx_backend_numba

    monkeypatch.setattr(rlx_backend_numba, "ADOPT_MIN_BYTES", 1 << 16)
    data = rng.integers(0, 256, (3000, 100), dtype=np.uint8)
    data.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r", shape=data.shape)
    b = NumbaBackend()
    big = b.adopt(mapped[100:2900])
    assert not np.shares_memory(big, mapped) and np.array_equal(big, data[100:2900])
    small = mapped[:10]
    assert b.adopt(small) is small
    assert b.adopt(data) is data


def test_unavailable_without_numba(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)
    ok, why = NumbaBackend().availability()
    assert not ok and "numba is not importable" in why
    from rlx_core.cli import plugins_report

    rows = {b["name"]: b for b in plugins_report()["backends"]}
    assert rows["numba"]["available"] is False and "numba is not importable" in rows["numba"]["reason"]


@pytest.mark.parametrize("vnni,avx512", [(True, True), (False, False)])
def test_kernel_paths_name_the_cpu_features(monkeypatch, vnni, avx512):
    """`rlx plugins` says which CPU-dependent kernels run here and, for one that does not, why
    and what runs instead (the flags replaced: any host runs this)."""
    from rlx_backend_numba import amx, simd
    from rlx_core.cli import plugins_report

    monkeypatch.setattr(simd, "VNNI", vnni)
    monkeypatch.setattr(simd, "AVX512", avx512)
    monkeypatch.setattr(amx, "missing", lambda: "this CPU has no AMX-BF16")
    paths = {p["path"]: p for p in NumbaBackend().kernel_paths()}
    amx_path = paths["AMX bf16 tiles (packed-weight prefill)"]
    assert not amx_path["on"], amx_path
    assert amx_path["reason"].startswith("this CPU has no AMX-BF16; f32 BLAS"), amx_path
    for name, flag, word in (('int8 dot products (VNNI) for activations = "int8"', vnni, "VNNI"),
                             ("16-lane AVX-512 kernels", avx512, "AVX-512")):
        assert paths[name]["on"] is flag and (flag or word in paths[name]["reason"]), paths[name]
    row = next(b for b in plugins_report()["backends"] if b["name"] == "numba")
    assert {p["path"] for p in row["kernel_paths"]} == set(paths)
    assert not amx.available()            # (available() follows missing())


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_thread_count_is_named(monkeypatch, value):
    monkeypatch.setenv("RLX_NUM_THREADS", value)
    ok, why = NumbaBackend().availability()
    assert not ok and "RLX_NUM_THREADS" in why and repr(value) in why
    with pytest.raises(BackendError, match="RLX_NUM_THREADS"):
        requested_threads()


def test_thread_count_from_env(monkeypatch):
    import numba

    before = numba.get_num_threads()
    monkeypatch.setenv("RLX_NUM_THREADS", "1")
    try:
        from rlx_backend_numba import set_threads

        assert set_threads() == 1 and numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(before)


# --------------------------------------------------------------------------- a tiny model
def test_tiny_llama_matches_numpy(rng, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, vocab_size=151, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=False)
    torch.manual_seed(int(rng.integers(1 << 30)))
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ids = rng.integers(0, 151, (2, 11))
    lm = {be: rlx_core.load(str(tmp_path), backend=be, progress=False) for be in ("numpy", "numba")}
    assert lm["numba"].backend.name == "numba"
    np.testing.assert_array_less(np.abs(lm["numba"].logits(ids) - lm["numpy"].logits(ids)).max(), 1e-4)
    prompt = ids[:1, :6]
    tokens = {be: m.generate(prompt, max_new_tokens=16, min_new_tokens=16) for be, m in lm.items()}
    assert_greedy_agrees(tokens["numba"], tokens["numpy"], lm["numpy"].logits, 2e-4,
                         "numba's greedy tokens against numpy's")


def test_profile_threads_set_numba_threads():
    import numba

    import rlx_core
    from rlx_core import CompileProfile, Graph
    from rlx_core.ir.errors import ProfileError
    from rlx_backend_numba import set_threads

    g = Graph.define("t", lambda m: m.input("x", (4,)) * 2.0)
    try:
        rlx_core.compile(g, profile=CompileProfile().evolve(backend={"threads": 1}), backend="numba")
        assert numba.get_num_threads() == 1
    finally:
        set_threads()
    with pytest.raises(ProfileError, match=r"\[backend\] threads = -2: expected an integer"):
        CompileProfile.from_toml_str("[backend]\nthreads = -2\n")


def test_f32_tanh_family_is_accurate_and_keeps_nan():
    """The vectorizing tanh32 against float64 tanh: relative error < 5e-7; NaN stays NaN."""
    x = np.concatenate([np.linspace(-30, 30, 200001), np.logspace(-8, 1.5, 2001)]).astype(np.float32)
    x[7] = np.nan
    src = codegen.elementwise_source((("activation", (("fn", "tanh"),), (0,)),), [F32], F32, "F")
    mod = codegen.load_source(src)
    o = np.empty_like(x)
    mod.ser(o, x.size, 8192, x)
    ref = np.tanh(x.astype(np.float64))
    ok = ~np.isnan(ref)
    assert np.isnan(o[7]) and (np.abs(o[ok] - ref[ok]) <= 5e-7 * np.maximum(np.abs(ref[ok]), 1e-30)).all()
