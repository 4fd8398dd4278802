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


def packed(rng, kind, n=N, k=K):
    s = QuantScheme.parse(kind)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.2, 3.0, (n, 1)).astype(np.float32)
    raw = s.quantize(w)
    return s, raw, s.dequantize_reference(raw, (n, k))


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


@pytest.mark.parametrize("kind", Q.FORMATS)
@pytest.mark.parametrize("blocks", [None, 5])
def test_gemv_every_row_count(rng, kind, blocks):
    """1 .. 3 GEMV_TILE + 1 rows of x (one row's dot, every tile size, two or three tiles
    split evenly, each over every chunk of packed rows, odd counts), over K of 512 and of an
    odd number of the format's blocks, N = 37 (a ragged last chunk of an odd count: its last
    packed row in a tile alone): the GEMV equals the float64 product of x and the dequantized
    W within f32's rounding, K + 2 roundings of the terms' magnitudes (the decoded weight's,
    the product's and the sum's, whatever order the lanes add in)."""
    n = 37
    k = K if blocks is None else blocks * QuantScheme.parse(kind).block_size
    s, raw, ref = packed(rng, kind, n, k)
    for m in range(1, 3 * Q.GEMV_TILE + 2):
        x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        out = np.full((m, n), np.nan, np.float32)
        Q.dequant_gemv(x, raw, s, out)
        x64 = x.astype(np.float64)
        bound = (k + 2) * 2.0 ** -24 * (np.abs(x64) @ np.abs(ref).T)
        err = np.abs(out - x64 @ ref.T)
        assert (err <= bound).all(), f"{kind}, K {k}, {m} rows: error {err.max():.3g} over f32's bound"


def test_gemv_compiles_once_for_read_only_and_writable_weights(rng):
    """A packed W mapped from a file is read-only, one quantized here is writable: the host
    side passes both read-only, so numba compiles the GEMV (its tiles, the format's decode)
    for one kind of W, not two; both give the float64 product."""
    s, raw, ref = packed(rng, "q4_1")
    frozen = raw.copy()
    frozen.flags.writeable = False
    x = rng.uniform(-1, 1, (3, K)).astype(np.float32)
    for w in (raw, frozen):
        close(Q.dequant_gemv(x, w, s), x.astype(np.float64) @ ref.T)
    assert raw.flags.writeable
    sigs = Q.drivers("q4_1").gemv.signatures
    assert sigs and all(not sig[1].mutable for sig in sigs), sigs


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
def test_int8_activation_gemv_and_gemm(rng, kind):
    """x rounded through int8_b32 (as a fake_quantize leaves it) times each format's integers
    equals the float64 product of the rounded x and the dequantized weight: in the GEMV (a few
    rows) and the int8 GEMM (rows not a multiple of its 4, N = 40 not of its 32, a strided
    output; simd.dot4 runs its plain-LLVM form where the CPU lacks VNNI)."""
    s, raw, ref = packed(rng, kind)
    i8 = QuantScheme.parse("int8_b32")
    for m in (1, 3, 13):
        x = rng.uniform(-1, 1, (m, K)).astype(np.float32)
        x[0, :32] = 0                                                  # an all-zero block
        xr = i8.dequantize(i8.quantize(x), x.shape)
        fq = np.full_like(x, np.nan)
        Q.fake_quantize_int8(x, fq)
        np.testing.assert_array_equal(fq, xr)
        want = xr.astype(np.float64) @ ref.T
        close(Q.dequant_gemv(xr, raw, s, int8_x=True), want)
        wide = np.full((m, N + 5), np.nan, np.float32)
        close(Q.dequant_matmul(xr, raw, s, wide[:, 2:N + 2], int8_x=True), want)
        assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, N + 2:]).all()


@pytest.mark.parametrize("kind", ["q4_k", "q8_0"])
def test_small_int8_gemv_runs_on_the_calling_thread(rng, kind, monkeypatch):
    """A dequant_matmul step whose packed W is under GEMV_SERIAL_BYTES (a MoE router) runs
    the int8 GEMV on the calling thread: the same results as the parallel one, bit for bit,
    and the float64 product's; a W of the limit's size keeps the parallel one."""
    s, raw, ref = packed(rng, kind)
    mod = Q.drivers(s.kind)
    xr = QuantScheme.parse("int8_b32")
    x = rng.uniform(-1, 1, (2, K)).astype(np.float32)
    x = xr.dequantize(xr.quantize(x), x.shape)
    par, ser = np.full((2, N), np.nan, np.float32), np.full((2, N), np.nan, np.float32)
    mod.igemv(x, raw, par, Q.F16)
    mod.igemv_ser(x, raw, ser, Q.F16)
    np.testing.assert_array_equal(ser, par)
    close(ser, x.astype(np.float64) @ ref.T)
    called = []
    for name in ("igemv", "igemv_ser"):
        kernel = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *args, k=kernel, n=name: (called.append(n), k(*args)))
    attrs = {"scheme": kind, "int8_x": True}
    for limit, want in ((raw.nbytes + 1, "igemv_ser"), (raw.nbytes, "igemv")):
        monkeypatch.setattr(Q, "GEMV_SERIAL_BYTES", limit)
        out = np.full((2, N), np.nan, np.float32)
        step = Q.prepare_dequant_matmul(attrs, [out], [x, raw])
        step(attrs, [out], x, raw)
        np.testing.assert_array_equal(out, par)
        assert step.rounds_x and called[-1] == want


@pytest.mark.parametrize("kind", Q.FORMATS)
def test_nonfinite_values_reach_the_int8_products(rng, kind):
    """A NaN block scale in W and a NaN or inf in x, which the int8 GEMV and GEMM round to
    int8 blocks themselves: the output is non-finite exactly where the float64 product of
    x's rounding (a block holding NaN or inf is NaN, as the NumPy backend rounds it) and the
    dequantized W is (hmax let a NaN lane lose: the block's scale came out finite)."""
    s = QuantScheme.parse(kind)
    raw = s.quantize(rng.standard_normal((N, K)).astype(np.float32))
    at = 208 if kind == "q6_k" else 0
    raw[5, at:at + 2] = (0x00, 0x7E)                               # row 5's first scale: NaN
    ref = s.dequantize_reference(raw, (N, K))
    i8 = QuantScheme.parse("int8_b32")
    for m in (1, 3, 13):
        x = rng.uniform(-1, 1, (m, K)).astype(np.float32)
        if m > 1:                                                  # (one row of x: W's NaN alone)
            x[m - 1, 40], x[0, 300] = np.nan, np.inf
        blocks = x.reshape(-1, 32)
        bad = ~np.isfinite(blocks).all(1)
        xr = i8.dequantize(i8.quantize(np.where(bad[:, None], 0, blocks)), blocks.shape)
        xr[bad] = np.nan
        with np.errstate(invalid="ignore"):
            want = ~np.isfinite(xr.reshape(m, K).astype(np.float64) @ ref.T)
        assert want.any() and not want.all()
        np.testing.assert_array_equal(~np.isfinite(Q.dequant_gemv(x, raw, s, int8_x=True)), want)
        np.testing.assert_array_equal(~np.isfinite(Q.dequant_matmul(x, raw, s, int8_x=True)), want)


@pytest.mark.parametrize("sub", [32, 16])
def test_int8_rounding_of_rows_equals_int8_b32(rng, sub):
    """quantize_rows (the int8 GEMM's rounding of x, SIMD) gives int8_b32's integers and scales
    bit for bit, ties k + 1/2 rounded away from zero, and each sub-block's integer sum."""
    m, k = 5, 256
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 100.0, (m, 1))).astype(np.float32)
    x[0, :32] = np.arange(32, dtype=np.float32) - 15.5          # ties, the scale exactly 1
    x[0, 31] = 127.0
    x[1, 32:64] = 0
    xq, xd = np.empty((m, k), np.int8), np.empty((m, k // 32), np.float32)
    xs, xi = np.empty((m, k // sub), np.float32), np.empty((m, k // sub), np.int32)
    Q.quantize_rows(x, xq, xd, xs, xi)
    raw = QuantScheme.parse("int8_b32").quantize(x.reshape(-1)).reshape(-1, 36)
    d = raw[:, :4].copy().view("<f4").reshape(m, k // 32)
    q = raw[:, 4:].copy().view(np.int8).reshape(m, k)
    np.testing.assert_array_equal(xq, q)
    np.testing.assert_array_equal(xd, d)
    j = np.arange(31)
    np.testing.assert_array_equal(q[0, :31], np.where(j < 16, j - 16, j - 15))     # -15.5 -> -16, 0.5 -> 1
    sums = q.astype(np.int64).reshape(m, k // sub, sub).sum(-1)
    np.testing.assert_array_equal(xi, sums)
    np.testing.assert_array_equal(xs, np.repeat(d, 32 // sub, axis=1) * sums.astype(np.float32))


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
@pytest.mark.parametrize("activations, vnni", [("f32", False), ("int8", False), ("int8", True)],
                         ids=["f32", "int8", "int8-igemm"])
def test_decode_fusions_in_the_runner(rng, kind, activations, vnni, monkeypatch):
    """A packed gate/up pair whose halves only feed a SwiGLU: one row computes the SwiGLU in
    the GEMV (no fused_swiglu step left), more rows keep the step; with int8 activations the
    rounding step is gone where a GEMV (up to IGEMV_MAX_M rows) rounds x itself, and for more
    rows where the runner picks the int8 GEMM (on a CPU with VNNI; forced here either way).
    Each equals the float64 reference of (rounded) x times the dequantized weights, on a
    poisoned arena."""
    monkeypatch.setattr(Q, "VNNI", vnni)
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
        assert ("fake_quantize" in ops) == (activations == "int8" and rows > Q.IGEMV_MAX_M and not vnni)
        r.arena.fill(0xFF)
        xr = (i8.dequantize(i8.quantize(x), x.shape) if activations == "int8" else x).astype(np.float64)
        g, u = xr @ ref_w["g"].T, xr @ ref_w["u"].T
        close(exe.run(x=x)["y"], g / (1 + np.exp(-g)) * u)


@pytest.mark.parametrize("vnni", [False, True], ids=["gemv", "igemm"])
def test_rounding_shared_by_two_packed_matmuls(rng, vnni, monkeypatch):
    """One int8 rounding read by two packed matmuls of different formats (Gemma 3's q5_0 q/k
    and q8_0 v): dropping it must not let the first matmul's output overwrite the x the
    second still reads (the buffer plan freed x after the rounding). Equals the float64
    reference of the rounded x, in decode (GEMV) and prefill rows (the int8 GEMM)."""
    import rlx_core
    from rlx_core import CompileProfile, Graph
    from rlx_core.ir.quant import PackedTensor

    monkeypatch.setattr(Q, "VNNI", vnni)
    kinds = {"a": "q5_0", "b": "q8_0"}
    ws = {n: rng.standard_normal((K, K)).astype(np.float32) for n in kinds}
    params = {n: PackedTensor(QuantScheme.parse(kinds[n]).quantize(w), QuantScheme.parse(kinds[n]), (K, K), n)
              for n, w in ws.items()}
    ref = {n: QuantScheme.parse(kinds[n]).dequantize_reference(p.raw, (K, K)) for n, p in params.items()}

    def two(m):
        x = m.input("x", ("s", K))
        h = m.mul(x, x)                                     # the rounding reads a value of the arena
        return {"y": m.add_(m.linear(h, m.param("a", (K, K), scheme="q5_0")),
                           m.linear(h, m.param("b", (K, K), scheme="q8_0")))}

    prof = CompileProfile().evolve(precision={"activations": "int8"})
    exe = rlx_core.compile(Graph.define("two", two), profile=prof, backend="numba", params=params)
    i8 = QuantScheme.parse("int8_b32")
    for rows in (1, Q.GEMV_MAX_M + 4):
        x = rng.uniform(-1, 1, (rows, K)).astype(np.float32)
        hr = i8.dequantize(i8.quantize(x * x), x.shape).astype(np.float64)
        close(exe.run(x=x)["y"], hr @ ref["a"].T + hr @ ref["b"].T)


AMX = pytest.mark.skipif(not Q.amx.available(), reason="no AMX-BF16 here (the CPU lacks it, numba does not "
                         "compile for this CPU, or the kernel does not grant the tile state)")


def bf16(a) -> np.ndarray:
    import ml_dtypes

    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def close_sums(got, x, w, rel: float):
    """got equals x @ w^T in float64 up to `rel` of the sum of |terms| (each output's)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bound = rel * (np.abs(x) @ np.abs(w).T) + 1e-30
    err = np.abs(got.astype(np.float64) - x @ w.T)
    assert np.isfinite(got).all() and (err <= bound).all(), float((err / bound).max())


def close_bf16(got, x, w):
    """got equals bf16(x) @ bf16(w)^T in float64 up to f32 sums."""
    close_sums(got, bf16(x), bf16(w), 1e-5)


def close_f32(got, x, w):
    """got equals x @ w^T in float64 up to f32 rounding (an f32 sgemm's own error bound at
    these K is ~K * 2^-24 of the sum of |terms|; it measures ~1e-7 here)."""
    close_sums(got, x, w, 2e-6)


@AMX
@pytest.mark.parametrize("kind", Q.FORMATS)
def test_amx_f32_matmul(rng, kind, monkeypatch):
    """The default on a CPU with AMX: x and the decoded weight each as three exact bf16 parts,
    six tile products, as accurate as f32 BLAS: a ragged block of weight rows (N = 40), rows
    of x that fill no tile (1, 33) or several (70), x spread over 12 decades, every output
    written (poisoned first)."""
    s, raw, ref = packed(rng, kind)
    spy = []
    real = Q._tiles
    monkeypatch.setattr(Q, "_tiles", lambda *a: spy.append((a[0].shape, a[-1])) or real(*a))
    for m in (1, 33, 70):
        x = (rng.standard_normal((m, K)) * 10.0 ** rng.uniform(-6, 6, (m, K))).astype(np.float32)
        out = np.full((m, N), np.nan, np.float32)
        assert Q.dequant_matmul(x, raw, s, out) is out
        close_f32(out, x, ref)
    assert spy == [((1, K), "f32"), ((33, K), "f32"), ((70, K), "f32")]


@AMX
def test_amx_f32_matmul_over_threads_on_strided_x(rng):
    """Enough 32-row blocks for every thread, an x and an out that are strided views (whole
    blocks of a C-contiguous out are moved in 8 x 8 transposes)."""
    s = QuantScheme.parse("q6_k")
    n, k = 200, 512
    raw = s.quantize(rng.standard_normal((n, k)).astype(np.float32))
    ref = s.dequantize_reference(raw, (n, k))
    x = rng.uniform(-2, 2, (64, 2 * k)).astype(np.float32)[:, ::2]
    close_f32(Q.dequant_matmul(x, raw, s), x, ref)
    out = np.full((64, 2 * n), np.nan, np.float32)[:, ::2]
    assert Q.dequant_matmul(x, raw, s, out) is out
    close_f32(out, x, ref)


def test_blas_setting_keeps_sgemm(rng, monkeypatch):
    """matmul = "blas" multiplies by BLAS even where AMX tiles are there."""
    monkeypatch.setattr(Q, "_tiles", lambda *a: pytest.fail("AMX tiles used under matmul = 'blas'"))
    s, raw, ref = packed(rng, "q5_0")
    x = rng.uniform(-1, 1, (21, K)).astype(np.float32)
    close(Q.dequant_matmul(x, raw, s, matmul="blas"), x.astype(np.float64) @ ref.T)


@AMX
@pytest.mark.parametrize("kind", Q.FORMATS)
def test_amx_bf16_matmul(rng, kind):
    """x and the decoded weight rounded to bf16 and multiplied in tiles equal the float64
    product of the same roundings: a ragged block of weight rows (N = 40), rows of x that
    fill no tile (1, 33) or several (70), every output written (poisoned first)."""
    s, raw, ref = packed(rng, kind)
    for m in (1, 33, 70):
        x = rng.uniform(-1, 1, (m, K)).astype(np.float32)
        out = np.full((m, N), np.nan, np.float32)
        assert Q.dequant_matmul(x, raw, s, out, matmul="bf16") is out
        close_bf16(out, x, ref)


@AMX
def test_amx_bf16_matmul_over_threads_on_strided_x(rng):
    """Enough 32-row blocks for every thread, full tiles stored straight into the output, and an
    x that is a strided view."""
    s = QuantScheme.parse("q8_0")
    n, k = 200, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = s.quantize(w)
    ref = s.dequantize_reference(raw, (n, k))
    x = rng.uniform(-2, 2, (64, 2 * k)).astype(np.float32)[:, ::2]
    close_bf16(Q.dequant_matmul(x, raw, s, matmul="bf16"), x, ref)


@pytest.mark.parametrize("matmul", ["f32", "bf16"])
def test_without_amx_blas_multiplies(rng, monkeypatch, matmul):
    monkeypatch.setattr(Q.amx, "available", lambda: False)
    monkeypatch.setattr(Q, "_tiles", lambda *a: pytest.fail("AMX tiles used without AMX"))
    s, raw, ref = packed(rng, "q4_k")
    x = rng.uniform(-1, 1, (21, K)).astype(np.float32)
    close(Q.dequant_matmul(x, raw, s, matmul=matmul), x.astype(np.float64) @ ref.T)


@pytest.mark.parametrize("matmul", ["f32", "bf16", "blas"])
def test_backend_matmul_setting_reaches_prefill_matmuls(rng, monkeypatch, matmul):
    """`[backend] matmul` holds for the pipeline that asked (a copy of the registry's backend),
    reaches the packed matmuls of many rows and not the GEMV; the result is the bf16 product
    for "bf16" where this CPU has AMX, else the f32 one."""
    import rlx_core
    from rlx_core import CompileProfile, Graph
    from rlx_core.ir.quant import PackedTensor
    from rlx_core.pipeline import CompilePipeline, select_backend

    s = QuantScheme.parse("q4_0")
    w = rng.standard_normal((N, K)).astype(np.float32)
    params = {"w": PackedTensor(s.quantize(w), s, (N, K), "w")}
    ref = s.dequantize_reference(params["w"].raw, (N, K))
    prof = CompileProfile().evolve(backend={"matmul": matmul})
    pipe = CompilePipeline(prof, "numba")
    assert pipe.backend.matmul == matmul and select_backend("numba").matmul == "f32"
    calls = []
    real = Q._matmul
    monkeypatch.setattr(Q, "_matmul", lambda *a: calls.append(a[-1]) or real(*a))
    exe = rlx_core.compile(Graph.define("mm", lambda m: {"y": m.linear(m.input("x", ("s", K)),
                                                                      m.param("w", (N, K), scheme="q4_0"))}),
                           profile=prof, backend="numba", params=params)
    for rows in (1, 40):
        x = rng.uniform(-1, 1, (rows, K)).astype(np.float32)
        got = exe.run(x=x)["y"]
        if matmul == "bf16" and rows > Q.GEMV_MAX_M and Q.amx.available():
            close_bf16(got, x, ref)
        else:
            close(got, x.astype(np.float64) @ ref.T)
    assert calls == [matmul]


def test_bad_matmul_setting_is_named():
    from rlx_core import CompileProfile
    from rlx_core.ir.errors import ProfileError

    with pytest.raises(ProfileError, match=r"\[backend\] matmul = 'f16'.*'f32', 'bf16'"):
        CompileProfile.from_toml_str('[backend]\nmatmul = "f16"\n')
