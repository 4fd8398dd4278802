"""Packed weights on OpenCL: dequant_matmul (GEMV for M = 1 and 7, the tiled GEMM for M = 64)
and dequantize for every scheme, against the float64 dequantize-then-matmul reference, outputs
poisoned first; a packed model end to end against numpy; the error for a scheme without a
kernel. One graph per scheme holds every case, so each scheme builds one program."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_opencl import ocl, run_cl  # noqa: F401

import rlx_core
from rlx_core import Graph
from rlx_core.ir.dtype import F32, I32, U8
from rlx_core.ir.errors import BackendError
from rlx_core.ir.quant import PackedTensor, QuantScheme, matmul_reference, quantize

# int4_b48: a 16-element unit and nibble halves of 24 (RLX's int blocks need not be 32-multiples)
SCHEMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8", "int4_b48"]
N = 67                                  # two GEMM tiles, the second partial
SEED = int(os.environ.get("RLX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


@pytest.fixture
def rng(request):
    """Fresh inputs on every run, replayed with RLX_TEST_SEED as the repository's conftest does
    (run on its own, this folder is its own pytest rootdir, without that conftest)."""
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


def _ref_act(v, act):
    if act == "silu":
        return v / (1 + np.exp(-v))
    if act == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))
    return v


def _assert_close(got, ref, rtol=1e-5):
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=rtol * np.abs(ref).max(),
                               err_msg=f"RLX_TEST_SEED={SEED}")


@pytest.mark.parametrize("name", SCHEMES)
def test_dequant_matmul_and_dequantize(ocl, rng, name):
    s = QuantScheme.parse(name)
    k = s.block_size * (3 if s.block_size >= 256 else 9)
    w = quantize(rng.standard_normal((N, k)).astype(np.float32), s)
    cases = {"m1": ((1, k), "silu", True), "m7": ((7, k), "identity", False),
             "m64": ((2, 32, k), "gelu_tanh", True)}

    def build(m):
        wp, b = m.param("w", w.shape, U8), m.input("b", (N,), F32)
        out = {c: m.add("dequant_matmul", (m.input(c, shape, F32), wp) + ((b,) if bias else ()),
                        scheme=name, act=act) for c, (shape, act, bias) in cases.items()}
        # an input, not the param: dequantize of a param is hoisted out of the poisoned run
        return out | {"deq": m.add("dequantize", (m.input("wi", w.shape, U8),), scheme=name, dtype="f32")}

    ex = rlx_core.compile(Graph.define("dq", build), backend=ocl, params={"w": w})
    assert {n.op for n in ex.mir.nodes} >= {"dequant_matmul", "dequantize"}
    inputs = {c: rng.standard_normal(shape).astype(np.float32) for c, (shape, _, _) in cases.items()}
    inputs |= {"b": rng.standard_normal(N).astype(np.float32), "wi": w}
    got = run_cl(ex, inputs)
    for c, (shape, act, bias) in cases.items():
        ref = matmul_reference(inputs[c], w, s, (N, k)) + (inputs["b"] if bias else 0.0)
        _assert_close(got[c], _ref_act(ref, act))
    _assert_close(got["deq"], s.dequantize_reference(w, (N, k)), rtol=1e-6)


def test_packed_model_matches_numpy(ocl, rng):
    """Packed params through the core path: x @ W^T (+ bias, act) becomes dequant_matmul, an
    embedding lookup gathers packed rows and dequantizes them."""
    d, v, h = 64, 50, 96

    def build(m):
        ids = m.input("ids", (2, 5), I32)
        e = m.gather(m.param("emb", (v, d), scheme="q8_0"), ids)
        up = m.silu(m.matmul(e, m.param("up", (h, d), scheme="q4_0"), trans_b=True) + m.param("bu", (h,)))
        return m.matmul(up, m.param("down", (d, h), scheme="q8_0"), trans_b=True)

    def packed(name, shape, scheme):
        raw = quantize(rng.standard_normal(shape).astype(np.float32), scheme)
        return PackedTensor(raw, QuantScheme.parse(scheme), shape, name)

    params = {"emb": packed("emb", (v, d), "q8_0"), "up": packed("up", (h, d), "q4_0"),
              "down": packed("down", (d, h), "q8_0"), "bu": rng.standard_normal(h).astype(np.float32)}
    g = Graph.define("packed", build)
    ex = rlx_core.compile(g, backend=ocl, params=params)
    assert {"dequant_matmul", "dequantize"} <= {n.op for n in ex.mir.nodes}
    inputs = {"ids": rng.integers(0, v, (2, 5)).astype(np.int32)}
    got = run_cl(ex, inputs)
    ref = rlx_core.compile(g, backend="numpy", params=params).run(inputs)
    for key in ref:
        _assert_close(got[key], ref[key].astype(np.float64), rtol=1e-5)


def test_scheme_without_kernel_names_tensor_and_backends(ocl, monkeypatch):
    from rlx_backend_opencl import quant

    monkeypatch.setattr(quant, "KINDS", quant.KINDS - {"q5_k"})
    assert not ocl.supports_scheme("q5_k") and ocl.supports_scheme("q4_k")
    w = np.zeros(QuantScheme.parse("q5_k").packed_shape((3, 256)), np.uint8)

    def build(m):
        return m.add("dequant_matmul", (m.input("x", (1, 256), F32), m.param("w_q", w.shape, U8)),
                     scheme="q5_k", act="identity")

    with pytest.raises(BackendError, match=r"'opencl' has no kernel for packed weight 'w_q' in scheme "
                                           r"'q5_k'.*backends that do: \[.*'numpy'"):
        rlx_core.compile(Graph.define("dq", build), backend=ocl, params={"w_q": w})
