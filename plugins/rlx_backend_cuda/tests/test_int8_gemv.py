"""int8 activations on CUDA (`[precision] activations = "int8"`: a fake_quantize to int8_b32
before each packed matmul's x): where its readers are decode GEMVs the fake_quantize writes x's
int8 rows (dq.cu's quant_q8, a residual norm's division there too) and the GEMVs multiply them
in dp4a (QX); elsewhere (prefill rows, an x that is also an output, the switch off) it writes
the rounded floats (fake_q8). Against the float64 product of the int8-rounded x and the decoded
weight on fresh random inputs, every scheme; the rounding kernel bit for bit against the NumPy
backend; a decode block and routed experts under the profile against the NumPy backend,
captured and replayed as a CUDA graph. Without a GPU the kernels run emulated on the CPU
(cuda_emu): the same checks of their arithmetic, with the norm, residual and SwiGLU forms."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from cuda_dry import dry, leaves, planned, sums_hazards  # noqa: F401  (the fixture)
from test_cuda import gpu
from test_gemv_fusion import case, rel

import rlx_core
from rlx_core import CompileProfile, Graph
from rlx_core.ir.dtype import BF16, F16, F32, I32, U8
from rlx_core.ir.numpy_kernels import fake_quantized
from rlx_core.ir.quant import QuantScheme, quantize

SCHEMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8_b48", "int4_b48", "int4_b32"]
N = 37


def _described(exe) -> dict:
    return next(iter(exe._runners.values())).describe()


def _run(g, params, ins, monkeypatch, int8_gemv: bool = True, runs: int = 2, **compile_kw) -> tuple:
    """(outputs of the last of `runs` runs, the second on replaying the CUDA graph; the runner's
    description; the kernels the build asked for), built under the switch."""
    from rlx_backend_cuda import device, set_config
    from rlx_backend_cuda.values import CONFIG

    asked: set = set()
    real = device.kernel
    monkeypatch.setattr(device, "kernel", lambda src, name, *a: asked.add(name) or real(src, name, *a))
    was = CONFIG["int8_gemv"]
    set_config(int8_gemv=int8_gemv)
    try:
        exe = rlx_core.compile(g, backend="cuda", params=params, **compile_kw)
        for _ in range(runs):
            out = {c: exe.backend.to_host(v) for c, v in exe.run(dict(ins)).items()}
        return out, _described(exe), asked
    finally:
        set_config(int8_gemv=was)


@gpu
@pytest.mark.parametrize("name", SCHEMES)
def test_int8_gemv_matches_the_rounded_product(rng, name, monkeypatch):
    """One and three rows, two weights reading one rounded x (q/k-like), one with bias and
    silu (the GEMV's epilogue); a NaN in a block of one row makes that row NaN as in the
    reference. quant_q8 rounds x first (QX 1; ops.QX_ROUND_MAX 0, the default); with 4096, both
    x are small enough for the GEMVs to round them themselves (QX 2); the switch off (the rounding
    kernel, then the float GEMV) agrees."""
    from rlx_backend_cuda import ops
    s = QuantScheme.parse(name)
    k = 480 if s.block_size == 48 else 512
    ws = [quantize(rng.standard_normal((N, k)).astype(np.float32), s) for _ in range(2)]

    def build(m):
        w0, w1 = m.param("w0", ws[0].shape, U8), m.param("w1", ws[1].shape, U8)
        bias = m.input("b", (N,), F32)
        out = {}
        for rows in (1, 3):
            xq = m.add("fake_quantize", (m.input(f"x{rows}", (rows, k), F32),), scheme="int8_b32")
            out[f"p{rows}"] = m.add("dequant_matmul", (xq, w0), scheme=name, act="identity")
            out[f"s{rows}"] = m.add("dequant_matmul", (xq, w1, bias), scheme=name, act="silu")
        return out
    g = Graph.define("int8_gemv", build)
    ins = {f"x{r}": rng.standard_normal((r, k)).astype(np.float32) for r in (1, 3)}
    ins["x3"][1, 40] = np.nan
    ins["b"] = rng.standard_normal(N).astype(np.float32)
    deq = [s.dequantize_reference(w, (N, k)) for w in ws]
    for int8_gemv, round_max in ((True, 4096), (True, 0), (False, 4096)):
        monkeypatch.setattr(ops, "QX_ROUND_MAX", round_max)
        got, desc, asked = _run(g, {"w0": ws[0], "w1": ws[1]}, ins, monkeypatch, int8_gemv)
        assert desc["capturable"] and desc["graph"], desc
        want_kernels = (int8_gemv and not round_max, not int8_gemv)
        assert ("rlx_quant_q8" in asked, "rlx_fake_q8" in asked) == want_kernels, asked
        for r in (1, 3):
            xr = np.asarray(fake_quantized(ins[f"x{r}"], "int8_b32"), np.float64)
            p, sv = xr @ deq[0].T, xr @ deq[1].T + ins["b"]
            for c, want in ((f"p{r}", p), (f"s{r}", sv / (1 + np.exp(-sv)))):
                tol = 1e-5 * np.nanmax(np.abs(want))
                np.testing.assert_allclose(got[c].astype(np.float64), want, rtol=1e-5, atol=tol, err_msg=c)
        assert np.isnan(got["p3"][1]).all() and np.isfinite(got["p3"][[0, 2]]).all()


@gpu
@pytest.mark.parametrize("dt", [F32, BF16, F16])
def test_the_rounding_kernel_matches_numpy_bit_for_bit(rng, dt):
    """The rounded x is also an output (no GEMV may skip it): fake_q8 writes it, equal to the
    NumPy backend's in every bit, over a block of zeros, one holding inf, one holding NaN,
    values at the ties of the rounding, and rows over a whole grid."""
    rows, k = 700, 96

    def build(m):
        return {"y": m.add("fake_quantize", (m.input("x", (rows, k), dt),), scheme="int8_b32")}
    x = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-8, 8, (rows, 1)))).astype(np.float32)
    x[3, :32] = 0
    x[4, 40] = np.inf
    x[5, 70] = np.nan
    x[6, :32] = np.arange(32) - 15.5                 # |x| * 127 / 16.5 lands on halves
    x = x.astype(dt.np)
    g = Graph.define("fake_q8", build)
    want = rlx_core.compile(g, backend="numpy").run(x=x)["y"]
    exe = rlx_core.compile(g, backend="cuda")
    got = exe.backend.to_host(exe.run(x=x)["y"])
    assert _described(exe)["capturable"]
    got, want = got.astype(np.float32), np.asarray(want).astype(np.float32)
    np.testing.assert_array_equal(got, want)          # (NaN where NaN: a GPU's NaN bits differ)
    assert np.isnan(got[4, 32:64]).all() and np.isnan(got[5, 64:96]).all() and (got[3, :32] == 0).all()


@gpu
@pytest.mark.parametrize("scheme", ["q4_k", "q8_0", "q6_k"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("in_gemv", [False, True], ids=["quant_q8", "q8-qx2"])
def test_a_decode_block_under_int8_activations(rng, scheme, rows, in_gemv, monkeypatch):
    """Attention output, residual norms, the SwiGLU MLP and a second projection with packed
    weights, compiled with activations = "int8": each x is rounded into int8 rows (the residual
    norms' division there: no norm launch, as test_gemv_fusion's; at 3 rows the dense head is
    no GEMV, so the last norm runs as a launch), and the result matches the NumPy backend under
    the same profile within bf16 rounding, the third run replaying the CUDA graph; by quant_q8
    launches (the default) and by the GEMVs themselves (ops.Q8_IN_GEMV, QX 2)."""
    from rlx_backend_cuda import ops

    monkeypatch.setattr(ops, "Q8_IN_GEMV", in_gemv)
    monkeypatch.setattr(ops, "QX_ROUND_MAX", 4096 if in_gemv else 0)
    g, pv, ins, _ = case(rng, BF16, rows, 512, scheme=scheme, inner=256, inter=512)
    prof = CompileProfile().evolve(precision={"activations": "int8"})
    got, d, asked = _run(g, pv, ins, monkeypatch, runs=3, profile=prof)
    steps = d["steps_by_op"]
    assert d["capturable"] and d["graph"], d
    assert "rlx_quant_q8" in asked and "rlx_fake_q8" not in asked, asked
    assert steps["dequant_matmul"] >= 5, steps
    assert (steps.get("fused_residual_rms_norm", 0) > 0) == (rows > 2) and steps["rms_norm"] == 1, steps
    want = rlx_core.compile(g, profile=prof, backend="numpy", params=pv).run(dict(ins))
    for k, w in want.items():
        assert rel(got[k], np.asarray(w, np.float64)) < 2e-2, (k, rel(got[k], np.asarray(w, np.float64)))


def test_the_rounding_writes_int8_rows_only_for_decode_gemvs():
    """(No GPU: the rule reads the graph.) A fake_quantize read only as the x of dequant_matmuls
    of at most 8 rows writes int8 rows for them; one read by a 20-row product (prefill: the
    rounded floats, then dequantize + cuBLAS), one that is also an output, one of f64 rows, one
    on a ROCm GPU, and all of them under the switch off write floats."""
    from rlx_backend_cuda import set_config
    from rlx_backend_cuda.ops import int8_gemv_x
    from rlx_backend_cuda.values import CONFIG
    from rlx_core.ir.dtype import F64
    from rlx_core.ir.graph import Builder

    k, n = 64, 16
    m = Builder("int8_rows", "mir")
    w = m.input("w", (n, k // 32 * 34), U8)

    def rounded(name, rows, dt=F16):
        return m.add("fake_quantize", (m.act(m.input(name, (rows, k), dt), "tanh"),), scheme="int8_b32")
    x1, x20, xo, x64 = rounded("x1", 1), rounded("x20", 20), rounded("xo", 2), rounded("x64", 1, F64)
    for i, x in enumerate((x1, x1, x20, xo)):           # x1: two readers (q and k)
        m.output(f"y{i}", m.add("dequant_matmul", (x, w), scheme="q8_0", act="identity"))
    m.output("xo", xo)
    m.output("y64", m.add("dequant_matmul", (x64, w), scheme="q8_0", act="identity"))
    g = m.build()
    fq = [i for i, nd in enumerate(g.nodes) if nd.op == "fake_quantize"]
    assert [int8_gemv_x(g, i) for i in fq] == [True, False, False, False]
    assert not int8_gemv_x(g, fq[0], hip=True)
    was = CONFIG["int8_gemv"]
    set_config(int8_gemv=False)
    try:
        assert not any(int8_gemv_x(g, i) for i in fq)
    finally:
        set_config(int8_gemv=was)


@gpu
@pytest.mark.parametrize("tokens", [1, 20])
def test_routed_experts_round_x_and_h_in_the_captured_step(rng, tokens):
    """moe_experts under int8 activations: x through the fake_quantize kernel, h rounded by
    the same kernel between the passes (int8_h; both were host steps that kept the graph out
    of capture): the step is captured, equals the NumPy backend within f32 rounding (a tie
    of h's rounding may fall either way) and differs from the unrounded h's result."""
    from rlx_core.ir.dtype import I64
    from rlx_core.ir.graph import Builder

    e, inter, hid, k = 8, 64, 96, 2
    schemes = ("q8_0", "q4_0", "q8_0")
    shapes = ((e, inter, hid), (e, inter, hid), (e, hid, inter))

    def graph(int8_h: bool):
        m = Builder("moe_int8", "mir")
        x = m.add("fake_quantize", (m.input("x", (tokens, hid), F32),), scheme="int8_b32")
        w, ids = m.input("weights", (tokens, k), F32), m.input("ids", (tokens, k), I64)
        stacks = [m.input(n, (e,) + QuantScheme.parse(sc).packed_shape(sh[1:]), U8)
                  for n, sh, sc in zip(("gate", "up", "down"), shapes, schemes)]
        m.output("y", m.add("moe_experts", (x, w, ids, *stacks), schemes=schemes, int8_h=int8_h))
        return m.build()
    ins = {"x": rng.standard_normal((tokens, hid)).astype(np.float32),
           "weights": rng.uniform(0.2, 1.0, (tokens, k)).astype(np.float32),
           "ids": np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).astype(np.int64)}
    for n, sh, sc in zip(("gate", "up", "down"), shapes, schemes):
        ins[n] = np.stack([quantize((rng.standard_normal(sh[1:]) / np.sqrt(sh[2])).astype(np.float32), sc)
                           for _ in range(e)])
    exe = rlx_core.compile(graph(True), backend="cuda")
    for _ in range(3):
        got = exe.backend.to_host(exe.run(dict(ins))["y"]).astype(np.float64)
    runner = _described(exe)
    assert runner["capturable"] and runner["graph"], runner
    want = rlx_core.compile(graph(True), backend="numpy").run(dict(ins))["y"].astype(np.float64)
    unrounded = rlx_core.compile(graph(False), backend="numpy").run(dict(ins))["y"].astype(np.float64)
    assert rel(got, want) < 1e-3 and rel(unrounded, want) > 1e-5, (rel(got, want), rel(unrounded, want))


# ----------------------------------------------------------------------------- emulated on the CPU
BF = BF16.np


def _gemv_kernel(s, T: str, M: int, K: int, qx: int, resid: int = 0, swiglu: int = 0, epilogue: str = "",
                 q8: int = 0, tc: int = 0, norm: int = 0, TN: str = "float", A: int = 16):
    """(the emulated DQ_GEMV, grid, shared memory) as ops._dq_gemv specializes and launches it."""
    from rlx_backend_cuda import codegen, sources
    from rlx_backend_cuda.ops import DQ_LOADS, dq_gemv_shape, qx_bytes, tc_bytes

    # (TC: as for 80 rows of W on one SM: 2 warps a row where K has 2 groups, so most warps take several)
    mmax, kw, rows = dq_gemv_shape(s.kind, s.block_size, M, K, rows=80 if tc else 0, sms=1)
    src = sources.dq_source(sources.DQ_GEMV, s.kind, s.block_size, T=T, TO=T, TB="float", ACC="float", A=A,
                            MMAX=mmax, R=rows, U=DQ_LOADS, KW=kw, XV=1, SWIGLU=swiglu, EPILOGUE=epilogue,
                            SWIGLU_OF=codegen.swiglu_of("float"), EARLY=0, NORM=norm, TN=TN, RESID=resid,
                            QX=qx, Q8=q8, TC=tc)
    per_block = 8 // kw * (rows // 2 if swiglu else rows)
    return cuda_emu.compile_kernel(src, "rlx_dq_gemv"), per_block, qx_bytes(M, K) if qx else tc_bytes(s.kind, K) if tc else 0


def _norms(nw=None, noff=0.0, res=None, N=0, yw=None, osq=None, eps: float = 0.0, zero=None) -> tuple:
    """The arguments rlx_dq_gemv ends with: ops.NO_NORMS, RESID's where given (eps and the
    sums it zeroes: a RESID GEMV's Q8 rounding, divided by the norm)."""
    from rlx_backend_cuda.ops import NO_NORMS

    zeroed = (zero, np.int32(zero.size)) if zero is not None else NO_NORMS[8:]
    return (np.float32(eps), None, nw, np.float32(noff), res, np.int64(N), yw, osq) + zeroed


def _launch(kernel, x, w, y, M, N, K, s, bias=None, tail=_norms(), y8=None, counters=None, xrs=None):
    k, per_block, smem = kernel
    head = (x, np.int64(xrs or K), w, np.int64(w.shape[1]), bias, y, np.int32(M), np.int32(N),
            np.int32(K // s.block_size), y8, counters)
    k.launch((-(-N // per_block),), (256,), head + tail, smem)


def _int8_rows(x, T: str, nsq=None, eps: float = 0.0, zero=None):
    """quant_q8 (emulated) on x's rows, as ops._int8_x launches it (one block: its loop over the
    blocks of 32): the GEMV's int8 rows and scales. nsq: NORM (x holds x0 * w, nsq its rows' sums of x0's
    squares in 32 parts); zero: the sums it zeroes."""
    from rlx_backend_cuda import sources
    from rlx_backend_cuda.ops import qx_bytes

    M, K = x.shape
    src = sources.render(sources.ROUND_Q8, ACC="float", A=16, T=T, TO=T, XV=1, NORM=int(nsq is not None))
    y8 = np.zeros(qx_bytes(M, K), np.uint8)
    cuda_emu.compile_kernel(src, "rlx_quant_q8").launch(
        (1,), (256,), (x, np.int64(K), np.int32(M), np.int32(K), y8, nsq, np.float32(eps), zero,
                       np.int32(0 if zero is None else zero.size)))
    return y8


def _rounded(x) -> np.ndarray:
    return np.asarray(fake_quantized(np.asarray(x, np.float32), "int8_b32"), np.float64)


@cuda_emu.emulated
@pytest.mark.parametrize("name", SCHEMES)
def test_emulated_int8_gemv_matches_the_rounded_product(rng, name):
    """quant_q8 then the QX GEMV on the CPU, every scheme: f32 rows (1 and 3, a NaN in one
    block of the second of 3, whose outputs come out NaN) and bf16 rows with bias and silu in
    the epilogue, against the float64 product of the int8-rounded x; the float GEMV of the same
    weights beside (the emulation itself checked on a kernel the GPU runs)."""
    from rlx_backend_cuda.ops import _dq_epilogue

    s = QuantScheme.parse(name)
    k = 480 if s.block_size == 48 else 512
    w = quantize(rng.standard_normal((N, k)).astype(np.float32), s)
    deq = s.dequantize_reference(w, (N, k))
    kernels = {qx: _gemv_kernel(s, "float", 3, k, qx) for qx in (1, 0)}       # (MMAX 4: 1 row too)
    for rows in (1, 3):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        if rows == 3:
            x[1, 70] = np.nan
        for qx in (1, 0):
            y = np.zeros((rows, N), np.float32)
            _launch(kernels[qx], _int8_rows(x, "float") if qx else x, w, y, rows, N, k, s)
            want = (_rounded(x) if qx else x.astype(np.float64)) @ deq.T
            tol = 1e-5 * np.nanmax(np.abs(want))
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=tol, err_msg=f"{rows} rows, qx {qx}")
    xb = rng.standard_normal((2, k)).astype(BF)
    bias = rng.standard_normal(N).astype(np.float32)
    y = np.zeros((2, N), BF)
    kern = _gemv_kernel(s, "__nv_bfloat16", 2, k, 1, epilogue=_dq_epilogue(BF16, True, "silu"))
    _launch(kern, _int8_rows(xb, "__nv_bfloat16"), w, y, 2, N, k, s, bias=bias)
    v = _rounded(xb) @ deq.T + bias
    assert rel(y, v / (1 + np.exp(-v))) < 1e-2


@cuda_emu.emulated
@pytest.mark.parametrize("name", ["q4_k", "q8_0"])
def test_emulated_int8_rows_norm_and_gemv_adds_the_residual_and_the_swiglu(rng, name):
    """bf16 decode forms: the rounding divides by a residual norm (x holds x0 * w, the rows'
    sums of x0's squares beside: the same q, the scales divided; the sums it zeroes zeroed), the
    QX GEMV with RESID (h = res + the product, h * w for the next GEMV, h's squares added up)
    and with SWIGLU (gate and up rows), against float64."""
    s = QuantScheme.parse(name)
    k, n, rows, eps = 512, 40, 2, 1e-5
    w = quantize(rng.standard_normal((2 * n, k)).astype(np.float32), s)
    deq = s.dequantize_reference(w, (2 * n, k))
    x0 = rng.standard_normal((rows, k)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
    # the norm: x = x0 * nw, the sums of x0's squares spread over each row's 32 parts
    x64 = x0.astype(BF).astype(np.float64)
    nsq = np.repeat((x64 ** 2).sum(1, keepdims=True) / 32, 32, axis=1).astype(np.float32)
    xw = (x0.astype(BF).astype(np.float32) * nw).astype(BF)
    zero = np.ones(64, np.float32)
    y8 = _int8_rows(xw, "__nv_bfloat16", nsq.reshape(-1), eps, zero)
    assert not zero.any()
    y = np.zeros((rows, n), BF)
    _launch(_gemv_kernel(s, "__nv_bfloat16", rows, k, 1), y8, w, y, rows, n, k, s)
    normed = (x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + eps) * nw).astype(np.float32).astype(BF)
    assert rel(y, _rounded(normed) @ deq[:n].T) < 1e-2
    # RESID: h = res + product, yw = h * nw2, the squares of h into osq
    res = rng.standard_normal((rows, n)).astype(BF)
    nw2 = rng.uniform(0.5, 1.5, n).astype(np.float32)
    h, yw, osq = np.zeros((rows, n), BF), np.zeros((rows, n), BF), np.zeros(rows * 32, np.float32)
    xb = x0.astype(BF)
    y8 = _int8_rows(xb, "__nv_bfloat16")
    _launch(_gemv_kernel(s, "__nv_bfloat16", rows, k, 1, resid=1), y8, w, h, rows, n, k, s,
            tail=_norms(nw2, 0.0, res, n, yw, osq))
    want_h = res.astype(np.float64) + _rounded(xb) @ deq[:n].T
    assert rel(h, want_h) < 1e-2 and rel(yw, h.astype(np.float64) * nw2) < 1e-2
    np.testing.assert_allclose(osq.reshape(rows, 32).sum(1), (h.astype(np.float64) ** 2).sum(1), rtol=1e-4)
    # SWIGLU: w's first n rows the gate, the next n the up rows
    y = np.zeros((rows, n), BF)
    _launch(_gemv_kernel(s, "__nv_bfloat16", rows, k, 1, swiglu=1), y8, w, y, rows, n, k, s)
    gate, up = _rounded(xb) @ deq[:n].T, _rounded(xb) @ deq[n:].T
    assert rel(y, gate / (1 + np.exp(-gate)) * up) < 1e-2


@cuda_emu.emulated
@pytest.mark.parametrize("dt", [F32, BF16, F16])
def test_emulated_rounding_kernel_matches_numpy_bit_for_bit(rng, dt):
    """fake_q8 on the CPU over the same blocks as on the GPU (zeros, inf, NaN, ties, a scale
    range of e^16), a grid smaller than the rows (the blocks' loop), against the NumPy
    backend's rounding in every bit but NaN's."""
    from rlx_backend_cuda import sources
    from rlx_backend_cuda.codegen import ctype

    rows, k = 40, 96
    x = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-8, 8, (rows, 1)))).astype(np.float32)
    x[3, :32], x[4, 40], x[5, 70] = 0, np.inf, np.nan
    x[6, :32] = np.arange(32) - 15.5
    x = x.astype(dt.np)
    want = np.asarray(fake_quantized(x.astype(np.float32), "int8_b32"), np.float32).astype(dt.np)
    src = sources.render(sources.ROUND_Q8, ACC="float", A=16, T=ctype(dt), TO=ctype(dt), XV=1, NORM=0)
    kern = cuda_emu.compile_kernel(src, "rlx_fake_q8")
    y = np.zeros_like(x)
    kern.launch((3,), (256,), (x, y, np.int64(x.size // 32)))
    np.testing.assert_array_equal(y.astype(np.float32), want.astype(np.float32))
    assert np.isnan(y[4, 32:64].astype(np.float32)).all() and (y[3, :32] == 0).all()


@cuda_emu.emulated
@pytest.mark.parametrize("name,k,rows", [("q4_k", 512, 2), ("q8_0", 2048, 3)])
def test_emulated_gemv_rounds_its_outputs_as_quant_q8_would(rng, name, k, rows):
    """Q8: a RESID GEMV writes the int8 rows quant_q8 with NORM would write from its h * w (the
    scales divided by the norm of the squares the GEMV adds up) and a SWIGLU GEMV those of its
    output, in every bit; the sums the NORM GEMV before read are zeroed, and the counters are
    zero again for the next step (two runs). k 512 at 2 rows: a block has all 32 outputs of a
    group; k 2048 at 3 rows: 2 (RESID) and 8 (SWIGLU) blocks share a group."""
    from rlx_backend_cuda.ops import qx_bytes

    s = QuantScheme.parse(name)
    n, eps, bf = 96, 1e-5, "__nv_bfloat16"
    w = quantize(rng.standard_normal((2 * n, k)).astype(np.float32), s)
    x8 = _int8_rows(rng.standard_normal((rows, k)).astype(BF), bf)
    resid, swiglu = (_gemv_kernel(s, bf, rows, k, 1, q8=1, **kw) for kw in ({"resid": 1}, {"swiglu": 1}))
    counters = np.zeros(n // 32 + 1, np.int32)
    for _ in range(2):
        res = rng.standard_normal((rows, n)).astype(BF)
        nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
        h, yw, osq = np.zeros((rows, n), BF), np.zeros((rows, n), BF), np.zeros(rows * 32, np.float32)
        zero, y8 = np.ones(64, np.float32), np.zeros(qx_bytes(rows, n), np.uint8)
        tail = _norms(nw, 0.0, res, n, yw, osq, eps=eps, zero=zero)
        _launch(resid, x8, w, h, rows, n, k, s, tail=tail, y8=y8, counters=counters)
        assert not zero.any() and not counters.any(), counters
        np.testing.assert_array_equal(y8, _int8_rows(yw, bf, osq, eps))
        y, y8 = np.zeros((rows, n), BF), np.zeros(qx_bytes(rows, n), np.uint8)
        _launch(swiglu, x8, w, y, rows, n, k, s, y8=y8, counters=counters)
        assert not counters.any(), counters
        np.testing.assert_array_equal(y8, _int8_rows(y, bf))


def _llama_layer(m, bs: int = 1, scheme: str | None = "q4_k"):
    """A decode layer of bs rows with matrices of `scheme` (None: bf16): norm, q/k/v, RoPE,
    attention over a cache, o + x, norm, SwiGLU MLP + x, norm, one more projection."""
    h, kv, d, ctx, hid, ff = 8, 2, 64, 1024, 512, 1024

    def mat(name, n, k):
        return m.param(name, (n, k), BF16, **({"scheme": scheme} if scheme else {}))
    x, pos = m.input("x", (bs, 1, hid), BF16), m.input("pos", (bs,), I32)
    cos, sin = m.input("cos", (bs, 1, d // 2)), m.input("sin", (bs, 1, d // 2))
    qkv = m.linear(m.rms_norm(x, m.param("ln", (hid,), BF16), eps=1e-6), mat("wqkv", (h + 2 * kv) * d, hid))
    q, k, v = (m.transpose(m.reshape(m.narrow(qkv, 2, a * d, n * d), (bs, 1, n, d)), (0, 2, 1, 3))
               for a, n in ((0, h), (h, kv), (h + kv, kv)))
    kc = m.kv_write(m.state("kc", (bs, kv, ctx, d), BF16), m.rope(k, cos, sin), pos)
    vc = m.kv_write(m.state("vc", (bs, kv, ctx, d), BF16), v, pos)
    o = m.transpose(m.attention(m.rope(q, cos, sin), kc, vc, pos=pos), (0, 2, 1, 3))
    o = m.reshape(o, (bs, 1, h * d))
    x = m.add_(x, m.linear(o, mat("wo", hid, h * d)))
    x = m.add_(x, m.swiglu(m.rms_norm(x, m.param("ln2", (hid,), BF16), eps=1e-6), mat("wg", ff, hid),
                           mat("wu", ff, hid), mat("wd", hid, ff)))
    return {"up": m.linear(m.rms_norm(x, m.param("ln3", (hid,), BF16), eps=1e-6), mat("wn", ff, hid))}


def test_a_decode_layer_rounds_x_without_launches_of_its_own(rng, dry, monkeypatch):
    """(No GPU: cuda_dry's build on stand-ins, nothing computed.) A decode layer under int8
    activations: the o and down projections (before a residual norm) and gate/up (before the
    SwiGLU's rounding) write the next GEMV's int8 rows themselves (Q8), and the o projection
    rounds the attention's output itself (QX 2), so quant_q8 runs once, for the first norm of x
    (whose bytes the q/k/v GEMV's output takes over: rounded before it). Each RESID rounding
    divides by the norm of the sums it adds up and zeroes those of the one before it in the ring."""
    from rlx_backend_cuda import ops

    monkeypatch.setattr(ops, "Q8_IN_GEMV", True)
    monkeypatch.setattr(ops, "QX_ROUND_MAX", 4096)
    lir = planned(Graph.define("int8_layer", _llama_layer), activations="int8")
    runner = dry(lir, *leaves(lir, rng))
    for st in runner.steps:
        st.fn()
    launched = [k for k in dry.kernels if k.launches]
    names = [k.name for k in launched]
    assert names.count("rlx_quant_q8") == 1 and names[names.index("rlx_quant_q8") + 1] == "rlx_dq_gemv", names
    gemvs = [k for k in launched if k.name == "rlx_dq_gemv"]
    assert [("#define Q8 1" in k.source, int(k.source.split("#define QX ")[1][0])) for k in gemvs] == \
        [(False, 1), (True, 2), (True, 1), (True, 1), (False, 1)], names
    assert [("#define RESID 1" in k.source, "#define SWIGLU 1" in k.source) for k in gemvs[1:4]] == \
        [(True, False), (False, True), (True, False)]
    # (args: ..., nb, y8, counters, eps, nsq, nw, noff, res, rrs, yw, osq, zero, zn)
    o, down = gemvs[1].args[0], gemvs[3].args[0]
    assert all(a[9] is not None and a[10] is not None and a[11] > 0 for a in (o, down))
    assert down[-2] is o[-3] and o[-3] is not down[-3], "the down GEMV zeroes the o GEMV's sums"
    assert sums_hazards(runner) == []


def test_by_default_a_launch_rounds_each_x(rng, dry):
    """(No GPU.) The default (ops.Q8_IN_GEMV off, QX_ROUND_MAX 0: faster on the H200): the same
    layer rounds each of its five GEMVs' x in a quant_q8 launch before it, and no GEMV writes
    int8 rows or rounds x itself."""
    lir = planned(Graph.define("int8_layer", _llama_layer), activations="int8")
    runner = dry(lir, *leaves(lir, rng))
    for st in runner.steps:
        st.fn()
    names = [k.name for k in dry.kernels for _ in k.launches]
    gemvs = [k for k in dry.kernels if k.name == "rlx_dq_gemv" and k.launches]
    assert names.count("rlx_quant_q8") == 5 and len(gemvs) == 5, names
    assert not any("#define Q8 1" in k.source or "#define QX 2" in k.source for k in gemvs)
    assert sums_hazards(runner) == []


@cuda_emu.emulated
@pytest.mark.parametrize("name", ["q4_k", "q8_0"])
def test_emulated_gemv_rounding_x_itself_equals_reading_quant_q8s_rows(rng, name):
    """QX 2 (a small x left to the GEMV: ops.QX_ROUND_MAX): each block rounds x's float rows
    (here strided: a row stride past K) into its shared memory; the products equal, in every
    bit, those of the GEMV reading quant_q8's rows of the same x, at 1 and 3 rows."""
    s = QuantScheme.parse(name)
    k, bf = 512, "__nv_bfloat16"
    w = quantize(rng.standard_normal((N, k)).astype(np.float32), s)
    for rows in (1, 3):
        xs = rng.standard_normal((rows, k + 64)).astype(BF)
        x = np.ascontiguousarray(xs[:, :k])
        got, want = np.zeros((rows, N), BF), np.zeros((rows, N), BF)
        _launch(_gemv_kernel(s, bf, rows, k, 2), xs, w, got, rows, N, k, s, xrs=k + 64)
        _launch(_gemv_kernel(s, bf, rows, k, 1), _int8_rows(x, bf), w, want, rows, N, k, s)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        assert rel(got, _rounded(x) @ s.dequantize_reference(w, (N, k)).T) < 1e-2
