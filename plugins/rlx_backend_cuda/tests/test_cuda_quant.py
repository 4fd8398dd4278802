"""Packed weights on CUDA: dequant_matmul (the fused decode GEMV for M = 1 and 7, decode into
a scratch + cuBLAS for M = 64) and dequantize for every scheme, against the float64
dequantize-then-matmul reference, outputs poisoned first; a packed model through the core
path against numpy, replayed as a CUDA graph. Skipped with the backend's reason without a GPU;
the kernel sources of every scheme are checked as text there too."""
from __future__ import annotations

import numpy as np
import pytest
from test_cuda import _OK, gpu, rng  # noqa: F401

import rlx_core
from rlx_core import Graph
from rlx_core.ir.dtype import BF16, F32, I32, U8
from rlx_core.ir.quant import PackedTensor, QuantScheme, matmul_reference, quantize

# int4_b48 / int8_b48: blocks that are no multiple of 16 (parts of 4 / 8 bytes)
SCHEMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8_b48", "int4_b48"]
N = 37                       # not a multiple of the rows a GEMV block takes


def _ref_act(v, act):
    if act == "silu":
        return v / (1 + np.exp(-v))
    if act == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))
    return v


def _assert_close(got, ref, rtol=1e-5):
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=rtol * np.abs(ref).max())


def _run_poisoned(ex, inputs):
    """Run twice, the arena and scratch filled with NaN bytes, then zeros, before each run."""
    outs = []
    for byte in (0xFF, 0x00):
        ex.runner(ex._bind_dims(inputs)).poison(byte)
        outs.append({k: ex.backend.to_host(v) for k, v in ex.run(dict(inputs)).items()})
    return outs


@pytest.mark.parametrize("name", SCHEMES + ["int8_b8", "int4_b8"])
def test_snippet_layout_matches_the_scheme(name):
    """Each format's decode snippet declares the block, bytes per block and parts that the
    scheme and the launch code use (no GPU needed)."""
    import re

    from rlx_backend_cuda import sources

    s = QuantScheme.parse(name)
    src = sources.dq_source(sources.DQ_DEQUANT, s.kind, s.block_size, TO="float", ACC="float", A=4, YV=1,
                            **sources.dq_dequant_shape(s.kind, s.block_size, 4))
    consts: dict = {}          # in order: the int schemes' BLK, BPB, PARTS are expressions of their IB
    for k, v in re.findall(r"#define (IB|BLK|BPB|PARTS|RUNS) (.+)", src):
        consts[k] = eval(v, {}, consts)
    assert consts["BLK"] == s.block_size and consts["BPB"] == s.bytes_per_block
    assert consts["PARTS"] == sources.dq_parts(s.kind, s.block_size)
    assert consts["PARTS"] * consts["RUNS"] * 4 == s.block_size        # the runs cover the block


@pytest.mark.parametrize("name", SCHEMES + ["int8_b8", "int4_b8", "int4_b32", "int8_b64", "int4_b16"])
def test_snippet_groups_of_runs_share_a_scale_and_an_x_block(name):
    """The int8-activation GEMV (QX) scales each group of QXG runs once and loads each QXC of
    them as one word vector: every group lies in one int8 block of 32 of x and one scale
    block of the weights, and each QXC runs are consecutive elements aligned to their size
    (the snippet's own rlx_run_off, evaluated here; no GPU needed)."""
    import re

    from rlx_backend_cuda import sources

    s = QuantScheme.parse(name)
    src = sources.dq_source(sources.DQ_DEQUANT, s.kind, s.block_size, TO="float", ACC="float", A=4, YV=1,
                            **sources.dq_dequant_shape(s.kind, s.block_size, 4))
    c: dict = {}
    for k, v in re.findall(r"#define (IB|PARTS|RUNS|QXG|QXC) (.+)", src):
        c[k] = int(eval(v, {}, c))
    off = re.search(r"int rlx_run_off\(int p, int k\) \{ return (.+); \}", src).group(1)
    scale = {"q6_k": 16, "q4_k": 32, "q5_k": 32}.get(s.kind, s.block_size)     # elements per weight scale
    assert c["RUNS"] % c["QXG"] == 0 and c["QXG"] % c["QXC"] == 0
    for p in range(c["PARTS"]):
        runs = [int(eval(off, {}, {"p": p, "k": k, **c})) for k in range(c["RUNS"])]
        for k0 in range(0, c["RUNS"], c["QXG"]):
            group = runs[k0:k0 + c["QXG"]]
            one_x_block, one_scale = len({e // 32 for e in group}) == 1, len({e // scale for e in group}) == 1
            assert one_x_block and one_scale, (p, k0, group)
            for j in range(0, c["QXG"], c["QXC"]):
                words = group[j:j + c["QXC"]]
                assert words == list(range(words[0], words[0] + 4 * c["QXC"], 4)), (p, k0, words)
                assert words[0] % (4 * c["QXC"]) == 0, (p, k0, words)


@gpu
@pytest.mark.parametrize("name", SCHEMES)
def test_dequant_matmul_and_dequantize(rng, name):
    s = QuantScheme.parse(name)
    k = s.block_size * (3 if s.block_size >= 256 else 9)
    w = quantize(rng.standard_normal((N, k)).astype(np.float32), s)
    cases = {"m1": ((1, k), "silu", True), "m7": ((7, k), "identity", False),
             "m64": ((2, 32, k), "gelu_tanh", True)}

    def build(m):
        wp, b = m.param("w", w.shape, U8), m.input("b", (N,), F32)
        out = {c: m.add("dequant_matmul", (m.input(c, shape, F32), wp) + ((b,) if bias else ()),
                        scheme=name, act=act) for c, (shape, act, bias) in cases.items()}
        # dequantize of an input (of a param it would be folded into the load-time prologue)
        return out | {"deq": m.add("dequantize", (m.input("raw", w.shape, U8),), scheme=name, dtype="f32")}

    ex = rlx_core.compile(Graph.define("dq", build), backend="cuda", params={"w": w})
    assert {n.op for n in ex.mir.nodes} >= {"dequant_matmul", "dequantize"}
    inputs = {c: rng.standard_normal(shape).astype(np.float32) for c, (shape, _, _) in cases.items()}
    inputs["b"] = rng.standard_normal(N).astype(np.float32)
    inputs["raw"] = w
    for got in _run_poisoned(ex, inputs):
        for c, (shape, act, bias) in cases.items():
            ref = matmul_reference(inputs[c], w, s, (N, k)) + (inputs["b"] if bias else 0.0)
            _assert_close(got[c], _ref_act(ref, act))
        _assert_close(got["deq"], s.dequantize_reference(w, (N, k)), rtol=1e-6)


@gpu
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0"])
def test_bf16_activations_match_numpy(rng, name):
    """bf16 x (the decode dtype of a bf16 model): the same rounding steps as the numpy backend."""
    s = QuantScheme.parse(name)
    k = 512
    w = quantize(rng.standard_normal((N, k)).astype(np.float32), s)

    def build(m):
        wp, b = m.param("w", w.shape, U8), m.input("b", (N,), BF16)
        return {c: m.add("dequant_matmul", (m.input(c, (r, k), BF16), wp, b), scheme=name, act="silu")
                for c, r in (("m1", 1), ("m20", 20))}
    g = Graph.define("dq16", build)
    inputs = {c: rng.standard_normal((r, k)).astype(BF16.np) for c, r in (("m1", 1), ("m20", 20))}
    inputs["b"] = rng.standard_normal(N).astype(BF16.np)
    want = rlx_core.compile(g, backend="numpy", params={"w": w}).run(dict(inputs))
    got = _run_poisoned(rlx_core.compile(g, backend="cuda", params={"w": w}), inputs)[0]
    for c in want:
        g64, w64 = got[c].astype(np.float64), want[c].astype(np.float64)
        assert got[c].dtype == BF16.np and np.linalg.norm(g64 - w64) <= 1e-2 * np.linalg.norm(w64), c


@gpu
def test_packed_model_matches_numpy_and_replays(rng):
    """Packed params through the core path: an embedding lookup gathers packed rows and
    dequantizes them, x @ W^T + bias, silu becomes one dequant_matmul, the SwiGLU gate/up pair
    one dequant_matmul whose GEMV writes silu(gate) * up; the one-token graph is captured and
    replayed as a CUDA graph."""
    d, v, h = 256, 50, 96

    def build(m):
        e = m.gather(m.param("emb", (v, d), scheme="q8_0"), m.input("ids", (1, 1), I32))
        a = m.silu(m.matmul(e, m.param("w1", (d, d), scheme="q4_0"), trans_b=True) + m.param("b1", (d,)))
        return m.swiglu(a, m.param("gate", (h, d), scheme="q4_k"), m.param("up", (h, d), scheme="q4_k"),
                        m.param("down", (d, h), scheme="q5_1"))

    def packed(name, shape, scheme):
        raw = quantize(rng.standard_normal(shape).astype(np.float32), scheme)
        return PackedTensor(raw, QuantScheme.parse(scheme), shape, name)

    params = {"emb": packed("emb", (v, d), "q8_0"), "w1": packed("w1", (d, d), "q4_0"),
              "gate": packed("gate", (h, d), "q4_k"), "up": packed("up", (h, d), "q4_k"),
              "down": packed("down", (d, h), "q5_1"), "b1": rng.standard_normal(d).astype(np.float32)}
    g = Graph.define("packed", build)
    ex = rlx_core.compile(g, backend="cuda", params=params)
    assert {"dequant_matmul", "dequantize"} <= {n.op for n in ex.mir.nodes}
    ref_ex = rlx_core.compile(g, backend="numpy", params=params)
    for _ in range(3):
        inputs = {"ids": rng.integers(0, v, (1, 1)).astype(np.int32)}
        got, ref = ex.run(dict(inputs)), ref_ex.run(dict(inputs))
        for key in ref:
            _assert_close(ex.backend.to_host(got[key]), ref[key].astype(np.float64), rtol=1e-5)
    d = next(iter(ex._runners.values())).describe()
    assert d["graph"], d
    assert "fused_swiglu" not in d["steps_by_op"] and d["steps_by_op"]["dequant_matmul"] == 3, d
