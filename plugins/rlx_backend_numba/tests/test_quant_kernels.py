"""Packed-weight kernels against rlx_core.ir.quant: every GGUF scheme's numba decoder equals
the float64 block-by-block reference decoder, and the GEMV (decode), decode-to-scratch + BLAS
(prefill) and the runner step with its epilogue match dequantize + float64 matmul."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from rlx_core.ir.quant import QuantScheme  # noqa: E402
from rlx_core.testing import parity  # noqa: E402
from rlx_core.testing.parity import rng  # noqa: E402,F401

from rlx_backend_numba import quant_kernels as Q  # noqa: E402
N, K = 40, 512


def packed(rng, kind):
    s = QuantScheme.parse(kind)
    w = rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.2, 3.0, (N, 1)).astype(np.float32)
    raw = s.quantize(w)
    return s, raw, s.dequantize_reference(raw, (N, K))


def close(got, want):
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=3e-5, atol=3e-6 * scale)


@pytest.mark.parametrize("kind", Q.FORMATS)
def test_decoder_equals_reference(rng, kind):
    s, raw, ref = packed(rng, kind)
    out = np.full((N, K), np.nan, np.float32)
    Q.dequant_rows(raw, s, out)
    np.testing.assert_array_equal(out, ref.astype(np.float32))
    part = np.full((3, K), np.nan, np.float32)
    np.testing.assert_array_equal(Q.dequant_rows(raw, s, part, r0=N - 3), ref[N - 3:].astype(np.float32))


@pytest.mark.parametrize("kind", Q.FORMATS)
def test_gemv_and_blocked_matmul(rng, kind, monkeypatch):
    s, raw, ref = packed(rng, kind)
    for m in (1, 3, 21):
        x = rng.uniform(-1, 1, (m, K)).astype(np.float32)
        want = x.astype(np.float64) @ ref.T
        close(Q.dequant_gemv(x, raw, s), want)
        monkeypatch.setattr(Q, "SCRATCH", 7 * K)          # several scratch blocks, a ragged last one
        close(Q.dequant_matmul(x, raw, kind), want)


@pytest.mark.parametrize("blas", ["cblas", "numpy"])
def test_blocked_matmul_over_threads(rng, blas, monkeypatch):
    """Enough rows for a part per thread (each calling cblas_sgemm on numba's threads), several
    scratch blocks per part; and the path for a numpy whose BLAS gives no cblas_sgemm."""
    if blas == "numpy":
        monkeypatch.setattr(Q, "SGEMM", None)
    elif Q.SGEMM is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS with cblas_sgemm")
    s = QuantScheme.parse("q4_1")
    n = 300
    w = rng.standard_normal((n, K)).astype(np.float32)
    raw = s.quantize(w)
    ref = s.dequantize_reference(raw, (n, K))
    monkeypatch.setattr(Q, "SCRATCH", 23 * K)
    x = rng.uniform(-1, 1, (17, K)).astype(np.float32)
    out = np.full((17, n), np.nan, np.float32)
    close(Q.dequant_matmul(x, raw, s, out), x.astype(np.float64) @ ref.T)


@pytest.mark.parametrize("kind", Q.FORMATS)
def test_int8_activation_gemv(rng, kind):
    """x rounded through int8_b32 (as a fake_quantize leaves it) times each format's integers
    equals the float64 product of the rounded x and the dequantized weight."""
    s, raw, ref = packed(rng, kind)
    i8 = QuantScheme.parse("int8_b32")
    for m in (1, 3):
        x = rng.uniform(-1, 1, (m, K)).astype(np.float32)
        x[0, :32] = 0                                                  # an all-zero block
        xr = i8.dequantize(i8.quantize(x), x.shape)
        fq = np.full_like(x, np.nan)
        Q.fake_quantize_int8(x, fq)
        np.testing.assert_array_equal(fq, xr)
        close(Q.dequant_gemv(xr, raw, s, int8_x=True), xr.astype(np.float64) @ ref.T)


@pytest.mark.parametrize("rows", [1, 12], ids=["gemv", "blocked"])
def test_runner_step_with_epilogue(rng, rows):
    s, raw, ref = packed(rng, "q4_k")
    x = rng.uniform(-1, 1, (1, rows, K)).astype(np.float32)
    b = rng.uniform(-1, 1, (N,)).astype(np.float32)
    out = np.full((1, rows, N), np.nan, np.float32)
    step = Q.prepare_dequant_matmul({"scheme": "q4_k", "act": "silu"}, [out], [x, raw, b])
    step(None, [out], x, raw, b)
    close(out, parity.REF_ACT["silu"](x.astype(np.float64) @ ref.T + b))


def test_bad_packed_rows_are_named():
    from rlx_core.ir.errors import ShapeError

    with pytest.raises(ShapeError, match="q8_0"):
        Q.dequant_gemv(np.ones((1, 64), np.float32), np.zeros((4, 30), np.uint8), "q8_0")


@pytest.mark.parametrize("kind", ["q4_1", "q6_k", "q4_k"])
@pytest.mark.parametrize("activations", ["f32", "int8"])
def test_decode_fusions_in_the_runner(rng, kind, activations):
    """A packed gate/up pair whose halves only feed a SwiGLU: one row computes the SwiGLU in
    the GEMV (no fused_swiglu step left), more rows keep the step; with int8 activations the
    rounding step is gone where a GEMV (up to GEMV_MAX_M rows) rounds x itself. Each equals the float64 reference
    of (rounded) x times the dequantized weights, on a poisoned arena."""
    import rlx_core
    from rlx_core import CompileProfile, Graph
    from rlx_core.ir.quant import PackedTensor

    s = QuantScheme.parse(kind)
    h = 64
    ws = {n: rng.standard_normal((h, K)).astype(np.float32) for n in ("g", "u")}
    params = {n: PackedTensor(s.quantize(w), s, (h, K), n) for n, w in ws.items()}
    ref_w = {n: s.dequantize_reference(p.raw, (h, K)) for n, p in params.items()}

    def mlp(m):
        x = m.input("x", ("s", K))
        g = m.linear(x, m.param("g", (h, K), scheme=kind))
        u = m.linear(x, m.param("u", (h, K), scheme=kind))
        return {"y": m.mul(m.silu(g), u)}

    prof = CompileProfile().evolve(precision={"activations": activations})
    exe = rlx_core.compile(Graph.define("glu", mlp), profile=prof, backend="numba", params=params)
    i8 = QuantScheme.parse("int8_b32")
    for rows in (1, Q.GEMV_MAX_M + 4):
        x = rng.uniform(-1, 1, (rows, K)).astype(np.float32)
        r = exe.runner(exe._bind_dims({"x": x}))
        ops = [r.graph.nodes[st[0]].op for st in r.steps]
        assert ("fused_swiglu" in ops) == (rows > 1)
        assert ("fake_quantize" in ops) == (activations == "int8" and (rows > Q.GEMV_MAX_M or kind == "q4_k"))
        r.arena.fill(0xFF)
        xr = (i8.dequantize(i8.quantize(x), x.shape) if activations == "int8" else x).astype(np.float64)
        g, u = xr @ ref_w["g"].T, xr @ ref_w["u"].T
        close(exe.run(x=x)["y"], g / (1 + np.exp(-g)) * u)
