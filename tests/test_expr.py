"""The expression table (rlx_core.ir.expr): every entry renders in every backend's dialect,
a dialect missing a function is a BackendError naming the op, the backend and the function,
the renderings compute what the table says (checked against float64), and quick_gelu, added
as one entry, runs on numpy and numba and differentiates."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rlx_core.ir import expr as E
from rlx_core.ir.dtype import F32, F64, I32, I64, DType
from rlx_core.ir.errors import BackendError
from rlx_core.ir.numpy_kernels import ACT, BIN, BIN_INT, CMP, NUMPY
from rlx_core.ir.ops import ACTIVATIONS, INT_OK_ACTIVATIONS
from rlx_core.testing.parity import REF_ACT, ref_binary, ref_compare


def _need(module: str):
    """A backend plugin's module, or the test skips naming it (a minimal install lacks some)."""
    return pytest.importorskip(module, reason=f"{module.split('.')[0]} is not installed")


def _renderers() -> list:
    """(backend name, renderer) of every installed backend with generated kernels, available
    here or not (rendering needs no device)."""
    import importlib

    out = [pytest.param("numpy", NUMPY, id="numpy")]
    for name, module, attr in (("cuda", "rlx_backend_cuda.codegen", "CUDA"),
                               ("opencl", "rlx_backend_opencl.kernels", "OPENCL"),
                               ("numba", "rlx_backend_numba.codegen", "NUMBA")):
        try:
            out.append(pytest.param(name, getattr(importlib.import_module(module), attr), id=name))
        except ImportError as e:
            out.append(pytest.param(name, None, id=name, marks=pytest.mark.skip(reason=f"{name}: {e}")))
    return out


@pytest.mark.parametrize("backend,renderer", _renderers())
def test_every_entry_renders_in_every_dialect(backend, renderer):
    E.check_dialect(renderer, backend)
    if isinstance(renderer, E.TextRenderer):
        for e in E.TABLE.values():
            for dt in renderer.dtypes:
                if renderer.covers(e, dt):
                    text = renderer.render(e.kind, e.name, dt, backend, **{v: f"q{v}" for v in e.variables})
                    assert text and all(f"q{v}" in text for v in e.variables), (e.name, dt, text)


def test_backends_return_their_renderers():
    _cuda = _need("rlx_backend_cuda")
    CudaBackend = _cuda.CudaBackend
    _numba = _need("rlx_backend_numba")
    NumbaBackend = _numba.NumbaBackend
    _opencl = _need("rlx_backend_opencl")
    OpenCLBackend = _opencl.OpenCLBackend

    from rlx_core.backends.numpy import NumpyBackend

    got = {B.name: B.expression_renderers(B.__new__(B)) for B in (CudaBackend, OpenCLBackend, NumbaBackend,
                                                                  NumpyBackend)}
    assert {k: [r.name for r in v] for k, v in got.items()} == {
        "cuda": ["CUDA C"], "opencl": ["OpenCL C"], "numba": ["numba", "NumPy"], "numpy": ["NumPy"]}


def test_ops_table_derives_from_the_expression_table():
    assert ACTIVATIONS == tuple(E.ACTIVATION_TABLE) and ACTIVATIONS[:16] == (
        "gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "neg",
        "abs", "sin", "cos", "recip", "identity")           # the old order: OpenCL indexes by it
    assert INT_OK_ACTIVATIONS == ("relu", "neg", "abs", "identity")
    assert set(REF_ACT) == set(ACTIVATIONS)


# ----------------------------------------------------------------------------- missing functions
class _NoErf(E.CRenderer):
    name = "test C"
    dtypes = (F32,)

    def function(self, name, dt):
        return None if name == "erf" else super().function(name, dt)


def test_check_dialect_names_op_backend_and_missing_function():
    with pytest.raises(BackendError, match=r"backend 'toy': activation 'gelu' \(f32\) needs function 'erf', "
                                           r"which the test C renderer does not define"):
        E.check_dialect(_NoErf(), "toy")


def test_a_new_entry_the_dialect_cannot_write_fails_at_check(monkeypatch):
    _opencl_kernels = _need("rlx_backend_opencl.kernels")
    OPENCL = _opencl_kernels.OPENCL

    softplus = E.Entry("activation", "softplus", E.call("log1p", E.exp(E.x)))
    monkeypatch.setitem(E.TABLE, ("activation", "softplus"), softplus)
    monkeypatch.setitem(E.ACTIVATION_TABLE, "softplus", softplus)
    with pytest.raises(BackendError, match=r"backend 'opencl': activation 'softplus' \(f32\) needs function "
                                           r"'log1p', which the OpenCL C renderer does not define"):
        E.check_dialect(OPENCL, "opencl")
    with pytest.raises(BackendError, match="'log1p'.*NumPy renderer"):
        E.check_dialect(NUMPY, "numpy")


def test_an_activation_that_only_calls_itself_is_missing_not_a_recursion():
    """tanh's formula is a call of tanh: a dialect without it reports the function."""
    class NoTanh(E.CRenderer):
        dtypes = (F64,)

        def function(self, name, dt):
            return None if name == "tanh" else super().function(name, dt)
    with pytest.raises(BackendError, match="activation 'tanh' .*needs function 'tanh'"):
        NoTanh().render("activation", "tanh", F64, "toy", x="v")


def test_unknown_entry_and_float_only_activation_on_ints():
    _cuda_codegen = _need("rlx_backend_cuda.codegen")
    CUDA = _cuda_codegen.CUDA

    with pytest.raises(BackendError, match="no activation 'softsign'"):
        CUDA.render("activation", "softsign", F32, x="v")
    with pytest.raises(BackendError, match="activation 'gelu' needs a float input, got i32"):
        CUDA.render("activation", "gelu", I32, x="v")


# ----------------------------------------------------------------------------- dialect spellings
def test_dialect_spellings():
    """What each dialect overrides, pinned (the generated kernels depend on these strings)."""
    _cuda_codegen = _need("rlx_backend_cuda.codegen")
    CUDA = _cuda_codegen.CUDA
    _numba_codegen = _need("rlx_backend_numba.codegen")
    NUMBA = _numba_codegen.NUMBA
    _opencl_kernels = _need("rlx_backend_opencl.kernels")
    OPENCL, act_expr = _opencl_kernels.OPENCL, _opencl_kernels.act_expr

    assert CUDA.render("activation", "gelu", F32, x="t") == \
        "(0.5f * t * (1.0f + erff(t * 0.7071067811865476f)))"
    assert CUDA.render("activation", "gelu", F64, x="t") == "(0.5 * t * (1.0 + erf(t * 0.7071067811865476)))"
    assert CUDA.render("activation", "silu", F32, x="t") == "(t * rlx_sigmoid(t))"
    assert CUDA.render("activation", "abs", I32, x="t") == "(t < 0 ? -t : t)"
    assert CUDA.render("binary", "div", I64, a="p", b="q") == "rlx_floordiv<long long>(p, q)"
    assert CUDA.render("fused_swiglu", "fused_swiglu", F32, a="g", b="u") == "(g * rlx_sigmoid(g) * u)"
    assert act_expr("gelu", "v", "float") == \
        "((float)0.5 * v * ((float)1 + erf(v * (float)0.7071067811865476)))"
    assert act_expr("silu", "v", "double") == "(v / ((double)1 + exp(-v)))"
    assert act_expr("relu", "v", "float") == "(ISNAN(v) ? v : (v > (float)0 ? v : (float)0))"
    assert act_expr("relu", "v", "int") == "(v > 0 ? v : 0)"
    assert act_expr("identity", "v", "long") == "(v)"
    assert OPENCL.render("activation", "sigmoid", F32, x="v") == "((float)1 / ((float)1 + exp(-v)))"
    assert NUMBA.render("activation", "gelu", F32, x="x") == \
        "f32(0.5) * x * (f32(1.0) + erf32(x * f32(0.7071067811865476)))"
    assert NUMBA.render("activation", "relu", F64, x="x") == "(x if (x > f64(0.0) or x != x) else f64(0.0))"
    assert NUMBA.render("fused_swiglu", "fused_swiglu", F64, a="a", b="b") == \
        "a * (f64(0.5) * (f64(1.0) + math.tanh(a * f64(0.5)))) * b"


def test_opencl_elementwise_steps_render_from_the_table(monkeypatch):
    """binary, compare and fused_swiglu steps come from the table (text pinned: unchanged from
    the hand-written forms); an int-only fused_swiglu is refused, naming the dtypes."""
    kernels = _need("rlx_backend_opencl.kernels")
    step, F16, U8 = kernels.step_expr, DType.F16, DType.U8
    assert step("binary", {"op": "max"}, [("p", F32), ("q", F16)], F32) == \
        "((float)(MAXP(((float)p), ((float)q))))"
    assert step("binary", {"op": "div"}, [("p", U8), ("q", U8)], U8) == \
        "((uchar)(udiv_uchar(((uchar)p), ((uchar)q))))"
    assert step("binary", {"op": "min"}, [("p", I32), ("q", I32)], I32) == \
        "((int)((((int)p) < ((int)q) ? ((int)p) : ((int)q))))"
    assert step("compare", {"op": "le"}, [("p", I32), ("q", F32)], DType.BOOL) == \
        "((uchar)(((double)p) <= ((double)q)))"
    assert step("fused_swiglu", {}, [("g", F16), ("u", F32)], F32) == \
        "((float)((((float)g) / ((float)1 + exp(-((float)g)))) * ((float)u)))"
    with pytest.raises(BackendError, match="opencl backend: fused_swiglu needs a float gate or up, got i32 and i32"):
        step("fused_swiglu", {}, [("g", I32), ("u", I32)], I32)
    # a changed entry changes the kernel: nothing is written twice
    monkeypatch.setitem(E.TABLE, ("binary", "sub"), E.Entry("binary", "sub", E.a + -E.b, E.a + -E.b))
    monkeypatch.setitem(E.TABLE, ("fused_swiglu", "fused_swiglu"),
                        E.Entry("fused_swiglu", "fused_swiglu", E.sigmoid(E.a) * E.b))
    assert step("binary", {"op": "sub"}, [("p", I32), ("q", I32)], I32) == "((int)(((int)p) + -((int)q)))"
    assert step("fused_swiglu", {}, [("g", F32), ("u", F32)], F32) == \
        "((float)(((float)1 / ((float)1 + exp(-((float)g)))) * ((float)u)))"


def test_cuda_gemv_swiglu_epilogues_come_from_the_table(monkeypatch):
    """The decode GEMV and DQ GEMV kernels write silu(gate) * up through their SWIGLU_OF define,
    rendered from the table's fused_swiglu: the .cu files hold no formula of their own."""
    sources, codegen = _need("rlx_backend_cuda.sources"), _need("rlx_backend_cuda.codegen")
    assert codegen.swiglu_of("float") == "((g) * rlx_sigmoid((g)) * (u))"
    src = sources.render(sources.GEMV, T="__half", TO="__half", MMAX=1, R=2, U=4, SWIGLU=1, KS=1,
                         SWIGLU_OF=codegen.swiglu_of("float"), NORM=0, TN="__half", RESID=0, EARLY=1)
    assert "#define SWIGLU_OF(g, u) (((g) * rlx_sigmoid((g)) * (u)))" in src
    assert "ST(TO, SWIGLU_OF(g, u))" in src
    for name in ("gemv.cu", "dq.cu"):
        assert "sigmoid" not in sources._file(name), name
    monkeypatch.setitem(E.TABLE, ("fused_swiglu", "fused_swiglu"),
                        E.Entry("fused_swiglu", "fused_swiglu", E.a * 0.5 * E.b))
    assert codegen.swiglu_of("double") == "((g) * 0.5 * (u))"
    assert codegen.swiglu_of("float") == "((g) * 0.5f * (u))"


def test_parentheses_follow_precedence():
    _cuda_codegen = _need("rlx_backend_cuda.codegen")
    CUDA = _cuda_codegen.CUDA

    a, b, c = E.var("a"), E.var("b"), E.var("c")
    cases = {a - (b - c): "a - (b - c)", (a - b) - c: "a - b - c", a / (b * c): "a / (b * c)",
             -(a + b): "-(a + b)", -(-a): "-(-a)", (a + b) * c: "(a + b) * c", a * b + c: "a * b + c",
             E.select(a < b, -a, a + 1): "(a < b ? -a : a + 1.0)", a * -0.5: "a * -0.5"}
    vals = {"a": "a", "b": "b", "c": "c"}
    for e, want in cases.items():
        assert CUDA._r(e, F64, vals, ())[0] == want


def _eval_numba_text(text: str, **env):
    """A numba rendering evaluated as plain Python (f64 = float, the math module)."""
    return eval(text, {"math": math, "f64": float, "abs": abs}, env)


@pytest.mark.parametrize("fn", ACTIVATIONS)
def test_renderings_agree_with_numpy_and_float64_reference(rng, fn):
    """The numba text (run as Python) and the NumPy callable compute the same f64 function, and
    that function is the float64 reference's (parity.REF_ACT, written independently)."""
    _numba_codegen = _need("rlx_backend_numba.codegen")
    NUMBA = _numba_codegen.NUMBA

    lo, hi = (0.1, 3.0) if fn in ("log", "sqrt", "rsqrt") else (-4.0, 4.0)
    xs = rng.uniform(lo, hi, 64)
    text = NUMBA.render("activation", fn, F64, x="x")
    py = np.array([_eval_numba_text(text, x=float(v)) for v in xs])
    npy = ACT[fn](xs)
    np.testing.assert_allclose(py, npy, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(npy, REF_ACT[fn](xs), rtol=1e-12, atol=1e-14)


def test_binary_and_compare_callables(rng):
    x, y = rng.standard_normal(50), rng.uniform(0.5, 2.0, 50)
    for op in E.BINARY_TABLE:
        np.testing.assert_array_equal(BIN[op](np.abs(x), y), ref_binary(op, np.abs(x), y))
    for op in E.COMPARE_TABLE:
        np.testing.assert_array_equal(CMP[op](x, y), ref_compare(op, x, y))
    i, j = rng.integers(-20, 20, 50), rng.integers(1, 5, 50) * rng.choice([-1, 1], 50)
    assert BIN_INT["div"] is np.floor_divide and BIN["div"] is np.divide
    np.testing.assert_array_equal(BIN_INT["div"](i, j), ref_binary("div", i, j))


@pytest.mark.parametrize("fn", INT_OK_ACTIVATIONS)
@pytest.mark.parametrize("dt", [np.int8, np.int32, np.int64])
def test_integer_activations(rng, fn, dt):
    """NumPy's int path, and the C int formula evaluated (x < 0 ? -x : x etc.) on the same ints."""
    _cuda_codegen = _need("rlx_backend_cuda.codegen")
    CUDA = _cuda_codegen.CUDA

    info = np.iinfo(dt)
    x = rng.integers(-100, 100, 40).astype(dt)
    x[:2] = (info.min + 1, info.max)
    got = ACT[fn](x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, REF_ACT[fn](x))
    c = CUDA.render("activation", fn, DType.parse(np.dtype(dt)), x="v")
    py = c.replace("rlx_maxi<signed char>", "max").replace("rlx_maxi<int>", "max")
    py = py.replace("rlx_maxi<long long>", "max")
    py = py.replace("(v < 0 ? -v : v)", "(-v if v < 0 else v)")
    np.testing.assert_array_equal([eval(py, {"max": max}, {"v": int(v)}) for v in x], REF_ACT[fn](x))


# ----------------------------------------------------------------------------- quick_gelu
def _quick_gelu64(x):
    return x / (1.0 + np.exp(-1.702 * x))                  # independent of the table's form


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_quick_gelu_numpy_and_numba_vs_float64(rng, dt):
    _numba_codegen = _need("rlx_backend_numba.codegen")
    elementwise_step = _numba_codegen.elementwise_step

    x = (rng.standard_normal((7, 33)) * 4).astype(dt)
    want = _quick_gelu64(x.astype(np.float64))
    # f32: sigmoid as 0.5 * (1 + tanh(x/2)) (numpy; numba's tanh32 to 5e-7) is exact to ~3e-7
    # absolute, not relative: in the far negative tail, where quick_gelu ~ 1e-7, x times that
    tol = dict(rtol=2e-6, atol=3e-7 * float(np.abs(x).max())) if dt == np.float32 else \
        dict(rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(ACT["quick_gelu"](x), want, **tol)
    out = np.empty_like(x)
    step = elementwise_step((("activation", (("fn", "quick_gelu"),), (0,)),), [x], out)
    assert step is not None, "numba generates quick_gelu natively"
    step(None, [out], x)
    np.testing.assert_allclose(out, want, **tol)


def test_quick_gelu_is_hf_quick_gelu_and_has_a_gradient(rng):
    import rlx_core
    from rlx_core.ir.graph import Graph
    from rlx_core.pipeline import compile as compile_graph
    from rlx_core.weights.config import hf_activation

    assert hf_activation({"hidden_act": "quick_gelu"}, "hidden_act", default="gelu") == "quick_gelu"

    def f(m):
        x, r = m.input("x", (3, 4), F64), m.input("r", (3, 4), F64)
        return m.sum(m.act(x, "quick_gelu") * r, (0, 1))
    exe = compile_graph(rlx_core.value_and_grad(Graph.define("qg", f), ["x"]), backend="numpy")
    x, r = rng.uniform(-3, 3, (3, 4)), rng.standard_normal((3, 4))
    got = exe.run({"x": x, "r": r})
    np.testing.assert_allclose(got["out"], (_quick_gelu64(x) * r).sum(), rtol=1e-12)
    h = 1e-6
    fd = (_quick_gelu64(x + h) - _quick_gelu64(x - h)) / (2 * h) * r
    np.testing.assert_allclose(got["grad_x"], fd, rtol=1e-7, atol=1e-9)
