"""The OpenCL backend against float64 numpy (the numpy backend on an f64 copy of each graph),
with outputs poisoned before each run. An unavailable backend skips these tests with the reason,
except: with RLX_REQUIRE_OPENCL set it fails them, and on CI (CI set) so does a missing OpenCL
device (PoCL from pocl-binary-distribution must be installed there). A device that opens but
cannot build or run the probe kernel (PoCL whose LLVM does not know the host CPU) is the host's
limit, not the setup's: skipped on CI too."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import rlx_core
from rlx_core import CompileProfile, Graph
from rlx_core.ir.custom import CustomOp
from rlx_core.ir.dtype import BOOL, F16, F32, F64, I32, I64, DType
from rlx_core.ir.errors import BackendError, ModelError
from rlx_core.pipeline import select_backend

RAW = CompileProfile().evolve(fusion={"skip": True})
DIRECT = CompileProfile()
FUSABLE = CompileProfile().evolve(fusion={"policy": "fusable"})


@pytest.fixture(scope="module")
def ocl():
    from rlx_backend_opencl import OpenCLBackend

    b = OpenCLBackend()
    ok, why = b.availability()
    if not ok:
        no_device = b._dev is None                   # nothing opened: not installed, no platform
        if os.environ.get("RLX_REQUIRE_OPENCL") or (os.environ.get("CI") and no_device):
            pytest.fail(f"OpenCL backend unavailable: {why}")
        pytest.skip(f"OpenCL backend unavailable: {why}")
    return b


def _cast_inputs(inputs: dict, to64: bool) -> dict:
    return {k: (v.astype(np.float64) if to64 and v.dtype == np.float32 else v) for k, v in inputs.items()}


def run_cl(ex, inputs):
    """Run with the arena and scratch poisoned first."""
    r = ex.runner(ex._bind_dims(inputs))
    r.poison()
    return ex.run(inputs)


def check(ocl, build, inputs, params=None, profile=RAW, tol=2e-5, exact=False, f64=True):
    """Build `build(m, dt)` in f32 for OpenCL and f64 for the numpy reference; compare."""
    params = params or {}
    g = Graph.define("t", lambda m: build(m, F32))
    ex = rlx_core.compile(g, profile=profile, backend=ocl, params=params)
    got = run_cl(ex, inputs)
    if f64 and not exact:
        g64 = Graph.define("t64", lambda m: build(m, F64))
        ref = rlx_core.compile(g64, profile=profile, backend="numpy",
                               params=_cast_inputs(params, True)).run(_cast_inputs(inputs, True))
    else:
        ref = rlx_core.compile(g, profile=profile, backend="numpy", params=params).run(inputs)
    assert set(got) == set(ref)
    for k in ref:
        r, o = np.asarray(ref[k]), np.asarray(got[k])
        assert o.shape == r.shape, k
        if exact:
            assert o.dtype == r.dtype, (k, o.dtype, r.dtype)
            np.testing.assert_array_equal(o, r, err_msg=k)
        else:
            np.testing.assert_allclose(o.astype(np.float64), r.astype(np.float64), rtol=tol, atol=tol,
                                       err_msg=k)
    return got


rng = np.random.default_rng(1234)


def rn(*shape, lo=None):
    a = rng.standard_normal(shape).astype(np.float32)
    return np.abs(a) + lo if lo is not None else a


# --------------------------------------------------------------------------- registration
def test_registered_through_entry_point():
    from rlx_core.plugins.manager import owner_of, registry

    from rlx_backend_opencl import OpenCLBackend

    b = registry().backends.get("opencl")
    assert isinstance(b, OpenCLBackend)
    assert owner_of("backend", "opencl") == "opencl"


def test_selected_by_name(ocl):
    assert select_backend("opencl").name == "opencl"
    assert ocl.device.name


# --------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max", "min", "pow"])
def test_binary_f32_broadcast(ocl, op):
    def build(m, dt):
        return m.binary(m.input("a", (3, 1, 5), dt), m.input("b", (4, 5), dt), op)
    a, b = rn(3, 1, 5, lo=0.5), rn(4, 5)
    if op == "div":
        b = np.where(np.abs(b) < 0.1, 0.5, b).astype(np.float32)
    check(ocl, build, {"a": a, "b": b}, tol=1e-5)


def test_binary_int_semantics(ocl):
    def build(m, dt):
        a, b = m.input("a", (12,), I32), m.input("b", (12,), I32)
        c = m.input("c", (12,), I64)
        return {o: m.binary(a, b, o) for o in ("add", "sub", "mul", "div", "max", "min")} | {
            "pow": m.binary(a, m.input("e", (12,), I32), "pow"), "mix": m.binary(a, c, "add"),
            "mixdiv": m.binary(c, a, "div")}
    a = np.array([7, -7, 7, -7, 0, 5, 9, -9, 3, 100, -1, 1], np.int32)
    b = np.array([2, 2, -2, -2, 3, 0, 4, 4, 3, 7, 5, 1], np.int32)
    e = np.array([0, 1, 2, 3, 4, 1, 2, 3, 2, 1, 5, 9], np.int32)
    c = np.arange(12, dtype=np.int64) * 3 - 5
    with np.errstate(divide="ignore", invalid="ignore"):
        check(ocl, build, {"a": a, "b": b, "c": c, "e": e}, exact=True)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_compare_and_where(ocl, op):
    def build(m, dt):
        a, b = m.input("a", (4, 6), dt), m.input("b", (6,), dt)
        c = m.compare(a, b, op)
        return {"c": c, "w": m.where(c, a, m.input("z", (4, 1), dt)),
                "i": m.compare(m.input("p", (5,), I32), m.input("q", (5,), I32), op)}
    a = rn(4, 6)
    a[0, :3] = 0.25
    b = rn(6)
    b[:3] = 0.25
    p, q = np.array([1, 2, 3, 4, 5], np.int32), np.array([5, 2, 1, 4, 0], np.int32)
    check(ocl, build, {"a": a, "b": b, "z": rn(4, 1), "p": p, "q": q}, exact=True, f64=False)


ACTS = ["gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "neg",
        "abs", "sin", "cos", "recip", "identity"]


@pytest.mark.parametrize("fn", ACTS)
def test_activation(ocl, fn):
    positive = fn in ("log", "sqrt", "rsqrt", "recip")
    x = rn(3, 7, lo=0.1) if positive else rn(3, 7) * 3
    check(ocl, lambda m, dt: m.act(m.input("x", (3, 7), dt), fn), {"x": x}, tol=2e-6 if fn != "exp" else 1e-5)


def test_int_activations_and_casts(ocl):
    def build(m, dt):
        i = m.input("i", (6,), I32)
        x = m.input("x", (6,), F32)
        return {"neg": m.act(i, "neg"), "abs": m.act(i, "abs"), "relu": m.act(i, "relu"),
                "f2i": m.cast(x, I32), "f2b": m.cast(x, BOOL), "i2f": m.cast(i, F32),
                "b2f": m.cast(m.cast(x, BOOL), F32), "i64": m.cast(i, I64),
                **({"f64": m.cast(x, F64)} if F64 in ocl.dtypes else {})}   # cl_khr_fp64 only
    i = np.array([-3, -1, 0, 1, 2, 5], np.int32)
    x = np.array([-2.7, -0.5, 0.0, 0.4, 1.9, 3.5], np.float32)
    check(ocl, build, {"i": i, "x": x}, exact=True)


def test_fused_elementwise_and_swiglu(ocl):
    def build(m, dt):
        a, b = m.input("a", (4, 8), dt), m.input("b", (4, 8), dt)
        y = m.tanh(m.silu(a) * b + 1.5) / (m.exp(b) + 2.0)
        return {"y": y, "sw": m.add("fused_swiglu", (a, b))}
    prof = CompileProfile()  # generic target fuses the elementwise region
    got = check(ocl, build, {"a": rn(4, 8), "b": rn(4, 8)}, profile=prof, tol=1e-5)
    ex = rlx_core.compile(Graph.define("t", lambda m: build(m, F32)), profile=prof, backend=ocl)
    assert any(n.op == "fused_elementwise" for n in ex.mir.nodes)
    assert got["y"].shape == (4, 8)


# --------------------------------------------------------------------------- reductions
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_reduce(ocl, op):
    def build(m, dt):
        x = m.input("x", (3, 4, 5), dt)
        return {"last": m.reduce(x, op, (-1,)), "mid": m.reduce(x, op, (1,), keepdims=True),
                "outer": m.reduce(x, op, (0, 2)), "all": m.reduce(x, op, (0, 1, 2)),
                "strided": m.reduce(m.transpose(x, (2, 0, 1)), op, (1,))}
    check(ocl, build, {"x": rn(3, 4, 5, lo=0.5) if op == "prod" else rn(3, 4, 5)}, tol=1e-5)


def test_reduce_int(ocl):
    def build(m, dt):
        x = m.input("x", (4, 50), I32)
        return {o: m.reduce(x, o, (1,)) for o in ("sum", "max", "min", "mean")}
    check(ocl, build, {"x": rng.integers(-100, 100, (4, 50)).astype(np.int32)}, exact=True)


def test_softmax(ocl):
    def build(m, dt):
        x = m.input("x", (3, 5, 300), dt)
        return {"last": m.softmax(x, -1), "axis1": m.softmax(x, 1)}
    x = rn(3, 5, 300) * 4
    x[0, 0, :] = -np.inf          # a fully masked row gives zeros, as numpy does
    x[1, 2, ::3] = -np.inf
    got = check(ocl, build, {"x": x}, tol=1e-6)
    assert np.all(got["last"][0, 0] == 0)


def test_norms(ocl):
    def build(m, dt):
        x = m.input("x", (2, 3, 40), dt)
        g, b = m.input("g", (40,), dt), m.input("b", (40,), dt)
        return {"rms": m.rms_norm(x, eps=1e-5), "rms_w": m.rms_norm(x, g, eps=1e-6, offset=1.0),
                "ln": m.layer_norm(x, eps=1e-5), "ln_gb": m.layer_norm(x, g, b, eps=1e-5),
                "rms_strided": m.rms_norm(m.transpose(x, (1, 0, 2)), g)}
    check(ocl, build, {"x": rn(2, 3, 40) * 2 + 1, "g": rn(40), "b": rn(40)}, tol=1e-5)


def test_fused_residual_norms(ocl):
    def build(m, dt):
        x, r = m.input("x", (2, 3, 40), dt), m.input("r", (3, 40), dt)
        g, b = m.input("g", (40,), dt), m.input("b", (40,), dt)
        h, y = m.add("fused_residual_rms_norm", (x, r, g), eps=1e-6, offset=0.0)
        h2, y2 = m.add("fused_residual_ln", (x, m.input("r2", (2, 3, 40), dt), g, b), eps=1e-5)
        h3, y3 = m.add("fused_residual_rms_norm", (x, r), eps=1e-6, offset=0.0)
        return {"h": h, "y": y, "h2": h2, "y2": y2, "y3": y3}
    check(ocl, build, {"x": rn(2, 3, 40), "r": rn(3, 40), "r2": rn(2, 3, 40), "g": rn(40), "b": rn(40)},
          tol=1e-5)


def test_cumsum_argmax_topk(ocl):
    def build(m, dt):
        x = m.input("x", (4, 33), dt)
        v, i = m.topk(x, 5, -1)
        v0, i0 = m.topk(x, 2, 0)
        return {"cs": m.cumsum(x, -1), "cs0": m.cumsum(x, 0), "am": m.argmax(x, -1),
                "am0": m.argmax(x, 0, keepdims=True), "v": v, "i": i, "v0": v0, "i0": i0,
                "csi": m.cumsum(m.input("n", (4, 33), I32), -1)}
    x = np.round(rn(4, 33) * 2).astype(np.float32) / 2    # many ties: order must be stable
    got = check(ocl, build, {"x": x, "n": rng.integers(-5, 5, (4, 33)).astype(np.int32)}, exact=False,
                tol=1e-5)
    ref = rlx_core.compile(Graph.define("t", lambda m: build(m, F32)), profile=RAW, backend="numpy").run(
        {"x": x, "n": rng.integers(-5, 5, (4, 33)).astype(np.int32)})
    for k in ("am", "am0", "i", "i0", "v"):
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
        assert got[k].dtype == ref[k].dtype


def test_argmax_topk_nan(ocl):
    def build(m, dt):
        x = m.input("x", (2, 6), dt)
        v, i = m.topk(x, 6)
        return {"am": m.argmax(x), "i": i, "v": v}
    x = np.array([[1, np.nan, 3, np.nan, 3, -1], [2, 2, 2, 1, 5, 5]], np.float32)
    check(ocl, build, {"x": x}, exact=True, f64=False)


# --------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("mkn", [(67, 45, 33), (1, 70, 19), (3, 16, 130), (128, 64, 64), (5, 1, 7)])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_tiled_odd_shapes(ocl, mkn, tb):
    M, K_, N = mkn
    def build(m, dt):
        w = m.input("w", (N, K_) if tb else (K_, N), dt)
        return m.matmul(m.input("x", (M, K_), dt), w, trans_b=tb)
    check(ocl, build, {"x": rn(M, K_), "w": rn(N, K_) if tb else rn(K_, N)}, tol=1e-4)


def test_matmul_batched_transposed(ocl):
    def build(m, dt):
        a = m.input("a", (2, 1, 9, 37), dt)      # trans_a: [K, M]
        b = m.input("b", (3, 9, 21), dt)
        return {"bt": m.matmul(a, b, trans_a=True),
                "strided": m.matmul(m.transpose(m.input("c", (21, 2, 40), dt), (1, 0, 2)),
                                    m.input("d", (40, 6), dt)),
                "i": m.matmul(m.input("p", (5, 7), I32), m.input("q", (7, 3), I32))}
    got = check(ocl, build, {"a": rn(2, 1, 9, 37), "b": rn(3, 9, 21), "c": rn(21, 2, 40), "d": rn(40, 6),
                             "p": rng.integers(-9, 9, (5, 7)).astype(np.int32),
                             "q": rng.integers(-9, 9, (7, 3)).astype(np.int32)}, tol=1e-4)
    assert got["bt"].shape == (2, 3, 37, 21)


@pytest.mark.parametrize("act", ["identity", "gelu", "silu", "relu"])
def test_fused_matmul_bias_act(ocl, act):
    def build(m, dt):
        x, w, b = m.input("x", (70, 24), dt), m.input("w", (40, 24), dt), m.input("b", (40,), dt)
        return {"y": m.add("fused_matmul_bias_act", (x, w, b), trans_b=True, act=act),
                "s": m.add("fused_matmul_bias_act", (m.narrow(x, 0, 0, 2), w), trans_b=True, act=act)}
    check(ocl, build, {"x": rn(70, 24), "w": rn(40, 24), "b": rn(40)}, tol=1e-4)


# --------------------------------------------------------------------------- views / indexing
def test_views_concat_transpose(ocl):
    def build(m, dt):
        x = m.input("x", (4, 6, 5), dt)
        t = m.transpose(x, (2, 0, 1))                       # [5,4,6] strided
        r = m.reshape(t, (20, 6))                           # needs a copy
        n = m.narrow(x, 1, 2, 3)                            # [4,3,5] strided
        e = m.expand(m.reshape(m.input("v", (5,), dt), (1, 1, 5)), (4, 3, 5))
        c = m.concat([n, e, m.narrow(x, 1, 0, 1)], 1)
        return {"r": r * 2.0, "c": c, "ne": n + e, "t": m.transpose(n, (1, 2, 0)),
                "flat": m.reshape(x, (24, 5))}
    check(ocl, build, {"x": rn(4, 6, 5), "v": rn(5)}, exact=True, f64=False)


def test_gather(ocl):
    def build(m, dt):
        t = m.input("t", (10, 6), dt)
        return {"rows": m.gather(t, m.input("i", (2, 3), I64)), "cols": m.gather(t, m.input("j", (4,), I32), 1)}
    i = np.array([[0, 9, -1], [3, 3, -10]], np.int64)
    check(ocl, build, {"t": rn(10, 6), "i": i, "j": np.array([5, 0, -2, 1], np.int32)}, exact=True, f64=False)


def test_gather_out_of_range(ocl):
    g = Graph.define("t", lambda m: m.gather(m.input("t", (10, 6)), m.input("i", (3,), I64)))
    ex = rlx_core.compile(g, profile=RAW, backend=ocl)
    with pytest.raises(ModelError, match="gather: index out of range"):
        ex.run(t=rn(10, 6), i=np.array([1, 10, 2]))
    out = ex.run(t=rn(10, 6), i=np.array([1, 9, 2]))["out"]    # the error flag was cleared
    assert out.shape == (3, 6)


# --------------------------------------------------------------------------- rope / attention
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rot,table3", [(16, False), (10, True)])
def test_rope(ocl, style, rot, table3):
    B, H, S, D = 2, 3, 7, 16
    tshape = (B, S, rot // 2) if table3 else (S, rot // 2)
    def build(m, dt):
        x = m.input("x", (B, S, H, D), dt)
        return m.rope(m.transpose(x, (0, 2, 1, 3)), m.input("c", tshape, dt), m.input("s", tshape, dt), style)
    ang = rng.uniform(0, 6, tshape).astype(np.float32)
    check(ocl, build, {"x": rn(B, S, H, D), "c": np.cos(ang), "s": np.sin(ang)}, tol=1e-6)


ATTN_CASES = {
    "causal": dict(mask_kind="causal"),
    "none": dict(mask_kind="none"),
    "sliding": dict(mask_kind="sliding_window", window=5),
    "bool_mask": dict(mask_kind="custom", mask="bool"),
    "bias_mask": dict(mask_kind="bias", mask="float"),
    "causal+bias": dict(mask_kind="causal", mask="float"),
    "pos": dict(mask_kind="causal", pos=True),
    "softcap": dict(mask_kind="causal", softcap=5.0),
}


@pytest.mark.parametrize("sq,sk", [(19, 19), (1, 23), (3, 23)])
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention(ocl, case, sq, sk):
    c = ATTN_CASES[case]
    B, H, KVH, D = 2, 4, 2, 16
    inputs = {"q": rn(B, H, sq, D), "k": rn(B, KVH, sk, D), "v": rn(B, KVH, sk, 8)}
    if c.get("mask") == "bool":
        inputs["mask"] = rng.random((B, 1, sq, sk)) > 0.3
    elif c.get("mask") == "float":
        inputs["mask"] = (rn(1, H, sq, sk) * 2).astype(np.float32)
    if c.get("pos"):
        inputs["pos"] = np.array([sk - sq - 2, sk - sq], np.int32)
    def build(m, dt):
        q, k, v = (m.input(n, inputs[n].shape, dt) for n in "qkv")
        mask = None
        if "mask" in inputs:
            mask = m.input("mask", inputs["mask"].shape, BOOL if inputs["mask"].dtype == np.bool_ else dt)
        pos = m.input("pos", (B,), I32) if "pos" in inputs else None
        return m.attention(q, k, v, mask, pos, scale=0.3, mask_kind=c["mask_kind"],
                           window=c.get("window", 0), softcap=c.get("softcap", 0.0))
    check(ocl, build, inputs, tol=2e-5)


@pytest.mark.parametrize("sq", [1, 17])
def test_mask_fill_and_unfused_attention(ocl, sq):
    B, H, sk = 2, 3, 17
    def build(m, dt):
        s = m.input("s", (B, H, sq, sk), dt)
        return {"mf": m.add("mask_fill", (s, m.input("pos", (B,), I64)), mask_kind="sliding_window",
                             window=4, has_mask=False, has_pos=True),
                "mb": m.add("mask_fill", (s, m.input("bias", (sq, sk), dt)), mask_kind="causal",
                             window=0, has_mask=True, has_pos=False)}
    check(ocl, build, {"s": rn(B, H, sq, sk), "pos": np.array([0, sk - sq], np.int64),
                       "bias": rn(sq, sk)}, exact=True, f64=False)


@pytest.mark.parametrize("sq", [1, 12])
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_fused_attention_block(ocl, sq, style):
    B, H, KVH, D = 1, 4, 1, 32
    def build(m, dt):
        q, k = m.input("q", (B, H, sq, D), dt), m.input("k", (B, KVH, sq, D), dt)
        v = m.input("v", (B, KVH, sq, D), dt)
        c, s = m.input("c", (sq, 12), dt), m.input("s", (sq, 12), dt)
        return m.add("fused_attention_block", (q, k, v, c, s), scale=D ** -0.5, mask_kind="causal", window=0,
                     softcap=0.0, has_mask=False, has_pos=False, style=style)
    ang = rng.uniform(0, 6, (sq, 12)).astype(np.float32)
    check(ocl, build, {"q": rn(B, H, sq, D), "k": rn(B, KVH, sq, D), "v": rn(B, KVH, sq, D),
                       "c": np.cos(ang), "s": np.sin(ang)}, tol=2e-5)


# --------------------------------------------------------------------------- KV cache
def _decode_graph(max_len=16, B=2, KVH=2, H=4, D=8):
    def fn(m):
        q = m.input("q", (B, H, "s", D))
        k, v = m.input("k", (B, KVH, "s", D)), m.input("v", (B, KVH, "s", D))
        pos = m.input("pos", (B,), I32)
        ck = m.kv_write(m.state("ck", (B, KVH, max_len, D)), k, pos)
        cv = m.kv_write(m.state("cv", (B, KVH, max_len, D)), v, pos)
        return {"o": m.attention(q, ck, cv, pos=pos), "ck": ck}
    return Graph.define("decode", fn)


def test_kv_write_decode_state_persists(ocl):
    g = _decode_graph()
    ex_cl = rlx_core.compile(g, backend=ocl)
    ex_np = rlx_core.compile(g, backend="numpy")
    pos = np.array([0, 3], np.int32)
    for step, s in enumerate([5, 1, 1, 1, 2]):      # a prefill then decode steps
        feed = {"q": rn(2, 4, s, 8), "k": rn(2, 2, s, 8), "v": rn(2, 2, s, 8), "pos": pos}
        got, ref = ex_cl.run(feed), ex_np.run(feed)
        np.testing.assert_allclose(got["o"], ref["o"], rtol=2e-5, atol=2e-5, err_msg=f"step {step}")
        np.testing.assert_array_equal(got["ck"], ref["ck"])
        pos = pos + s
    assert ex_cl.backend.to_host(ex_cl.states["ck"]).shape == (2, 2, 16, 8)
    ex_cl.reset_states()
    assert not np.any(ex_cl.backend.to_host(ex_cl.states["ck"]))


def test_kv_write_overflow(ocl):
    ex = rlx_core.compile(_decode_graph(), backend=ocl)
    feed = {"q": rn(2, 4, 3, 8), "k": rn(2, 2, 3, 8), "v": rn(2, 2, 3, 8)}
    with pytest.raises(ModelError, match="overflows the cache of length 16"):
        ex.run(feed, pos=np.array([2, 14], np.int32))
    ex.run(feed, pos=np.array([2, 13], np.int32))


# --------------------------------------------------------------------------- a transformer
def _transformer(B=2, S=11, Dm=32, H=4, KVH=2, hd=8, F=48, layers=2):
    def fn(m):
        x = m.input("x", (B, S, Dm))
        cos, sin = m.input("cos", (S, hd // 2)), m.input("sin", (S, hd // 2))
        h = x
        for i in range(layers):
            p = f"l{i}."
            n = m.rms_norm(h, m.param(p + "ln1", (Dm,)), eps=1e-5)
            q = m.linear(n, m.param(p + "wq", (H * hd, Dm)))
            k = m.linear(n, m.param(p + "wk", (KVH * hd, Dm)))
            v = m.linear(n, m.param(p + "wv", (KVH * hd, Dm)))
            q = m.transpose(m.reshape(q, (B, S, H, hd)), (0, 2, 1, 3))
            k = m.transpose(m.reshape(k, (B, S, KVH, hd)), (0, 2, 1, 3))
            v = m.transpose(m.reshape(v, (B, S, KVH, hd)), (0, 2, 1, 3))
            a = m.attention(m.rope(q, cos, sin), m.rope(k, cos, sin), v)
            a = m.reshape(m.transpose(a, (0, 2, 1, 3)), (B, S, H * hd))
            h = h + m.linear(a, m.param(p + "wo", (Dm, H * hd)))
            n2 = m.rms_norm(h, m.param(p + "ln2", (Dm,)), eps=1e-5)
            h = h + m.swiglu(n2, m.param(p + "wg", (F, Dm)), m.param(p + "wu", (F, Dm)),
                             m.param(p + "wd", (Dm, F)))
        return m.rms_norm(h, m.param("norm", (Dm,)), eps=1e-5)
    g = Graph.define("tiny", fn)
    params = {}
    for n in g.nodes:
        if n.op == "param":
            shp = n.outs[0].dims
            params[n.name] = (1 + 0.1 * rn(*shp)) if len(shp) == 1 else rn(*shp) / np.sqrt(shp[-1])
    ang = np.arange(S)[:, None] * (10000.0 ** (-np.arange(hd // 2) / (hd // 2)))[None]
    inputs = {"x": rn(B, S, Dm), "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    return g, params, inputs


@pytest.mark.parametrize("profile", [DIRECT, FUSABLE], ids=["direct", "fusable"])
def test_transformer_matches_numpy(ocl, profile):
    g, params, inputs = _transformer()
    ref = rlx_core.compile(g, profile=profile, backend="numpy", params=params).run(inputs)["out"]
    ex = rlx_core.compile(g, profile=profile, backend=ocl, params=params)
    got = run_cl(ex, inputs)["out"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    ops = {n.op for n in ex.mir.nodes}
    assert "attention" in ops or "fused_attention_block" in ops
    assert "fused_swiglu" in ops or "fused_elementwise" in ops


# --------------------------------------------------------------------------- custom ops
def test_custom_op_with_opencl_kernel(ocl):
    from rlx_core.ir.custom import _CUSTOM, register_custom_op

    op = CustomOp("ocl_test.twice_plus", meta=lambda s, p: (s[0],),
                  kernels={"numpy": lambda x, c: x * 2 + c, "opencl": lambda x, c: x * 2 + c})
    plain = CustomOp("ocl_test.numpy_only", meta=lambda s, p: (s[0],), kernels={"numpy": lambda x: x})
    register_custom_op(op)
    register_custom_op(plain)
    try:
        assert ocl.supports_custom("ocl_test.twice_plus")
        assert not ocl.supports_custom("ocl_test.numpy_only")
        g = Graph.define("c", lambda m: m.custom("ocl_test.twice_plus", m.transpose(m.input("x", (3, 4)), (1, 0)),
                                                 c=1.5) + 1.0)
        x = rn(3, 4)
        out = rlx_core.compile(g, profile=RAW, backend=ocl).run(x=x)["out"]
        np.testing.assert_allclose(out, x.T * 2 + 2.5, rtol=1e-6)
        g2 = Graph.define("c2", lambda m: m.custom("ocl_test.numpy_only", m.input("x", (3,))))
        with pytest.raises(BackendError, match="no kernel for custom op"):
            rlx_core.compile(g2, profile=RAW, backend=ocl)
    finally:
        _CUSTOM.pop(op.name, None)
        _CUSTOM.pop(plain.name, None)


# --------------------------------------------------------------------------- dtypes
def test_f64_when_device_has_fp64(ocl):
    if not ocl.device.fp64:
        pytest.skip("device lacks cl_khr_fp64")
    def build(m, dt):
        x = m.input("x", (5, 40), F64)
        return {"sm": m.softmax(x), "mm": m.matmul(x, m.input("w", (40, 7), F64)), "ln": m.layer_norm(x)}
    check(ocl, build, {"x": rn(5, 40).astype(np.float64), "w": rn(40, 7).astype(np.float64)}, tol=1e-12)


def test_f16_compiles_or_names_the_device(ocl, monkeypatch):
    monkeypatch.delenv("RLX_OPENCL_FP16", raising=False)
    g = Graph.define("h", lambda m: m.softmax(m.input("x", (4, 9), F16)) + m.input("y", (4, 9), F16))
    x, y = rn(4, 9).astype(np.float16), rn(4, 9).astype(np.float16)
    if ocl.device.fp16:
        got = rlx_core.compile(g, profile=RAW, backend=ocl).run(x=x, y=y)["out"]
        ref = rlx_core.compile(g, profile=RAW, backend="numpy").run(x=x, y=y)["out"]
        assert got.dtype == ref.dtype == np.float16     # the device's exp and sum order are its own:
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32),  # f16 ulps apart
                                   rtol=2e-3, atol=2e-3)
    else:
        with pytest.raises(BackendError, match="cl_khr_fp16") as e:
            rlx_core.compile(g, profile=RAW, backend=ocl)
        assert ocl.device.name in str(e.value)


def test_f16_kernels_match_numpy(ocl, monkeypatch):
    """f16 moves through vload_half/vstore_half and computes in f32, rounding once on store
    (and after each step of a fused region), exactly like the numpy backend: force the
    capability (RLX_OPENCL_FP16=1) so the f16 kernels run on any device."""
    monkeypatch.setenv("RLX_OPENCL_FP16", "1")
    def fn(m):
        x, w = m.input("x", (6, 40), F16), m.input("w", (24, 40), F16)
        y = m.linear(x, w)
        h, n = m.add("fused_residual_rms_norm", (y, m.input("r", (6, 24), F16), m.input("g", (24,), F16)),
                     eps=1e-5, offset=0.0)
        qkv = m.input("qkv", (1, 2, 9, 48), F16)
        a = m.attention(*(m.narrow(qkv, 3, 16 * i, 16) for i in range(3)), scale=0.25)
        return {"y": y, "h": h, "n": n, "sm": m.softmax(y), "ew": m.silu(x) * 2.0 + x, "a": a,
                "big": m.matmul(m.input("z", (70, 40), F16), w, trans_b=True), "am": m.argmax(y),
                "c": m.cast(y, F32), "ln": m.layer_norm(y)}
    g = Graph.define("h", fn)
    inp = {"x": rn(6, 40).astype(np.float16), "w": (rn(24, 40) / 6).astype(np.float16),
           "r": rn(6, 24).astype(np.float16), "g": rn(24).astype(np.float16),
           "qkv": rn(1, 2, 9, 48).astype(np.float16), "z": rn(70, 40).astype(np.float16)}
    for prof in (RAW, DIRECT):
        got = rlx_core.compile(g, profile=prof, backend=ocl).run(inp)
        ref = rlx_core.compile(g, profile=prof, backend="numpy").run(inp)
        for k in ref:
            assert got[k].dtype == ref[k].dtype, k
            np.testing.assert_allclose(got[k].astype(np.float32), ref[k].astype(np.float32), rtol=2e-3,
                                       atol=2e-3, err_msg=k)


def test_f16_on_device_without_fp16_is_a_compile_error(ocl, monkeypatch):
    from rlx_backend_opencl.device import Device

    monkeypatch.setattr(Device, "has_fp16", lambda self: False)
    g = Graph.define("h", lambda m: m.input("x", (4,), F16) * 2.0)
    with pytest.raises(BackendError, match="f16.*cl_khr_fp16") as e:
        rlx_core.compile(g, profile=RAW, backend=ocl)
    assert ocl.device.name in str(e.value)
    prof = CompileProfile().evolve(precision={"compute": "f16"})
    with pytest.raises(BackendError, match=re.escape(ocl.device.name.split(" (")[0])):
        rlx_core.compile(Graph.define("p", lambda m: m.input("x", (4,)) * 2.0), profile=prof, backend=ocl)
    with pytest.raises(BackendError, match="bf16"):
        rlx_core.compile(Graph.define("b", lambda m: m.input("x", (4,), DType.BF16) * 2.0), backend=ocl)


# --------------------------------------------------------------------------- failures
def test_broken_kernel_shows_build_log_and_op(ocl, monkeypatch):
    from rlx_backend_opencl import rows

    source = rows.source
    monkeypatch.setattr(rows, "source", lambda kind: source(kind).replace("ACC s = 0;", "ACC s = undeclared_x;"))
    g = Graph.define("b", lambda m: m.softmax(m.input("x", (2, 3))))
    with pytest.raises(BackendError) as e:
        rlx_core.compile(g, profile=RAW, backend=ocl).run(x=rn(2, 3))
    msg = str(e.value)
    assert "op 'softmax'" in msg and "build log" in msg and "undeclared_x" in msg


def test_no_platform_means_unavailable(monkeypatch):
    import pyopencl as cl

    from rlx_backend_opencl import OpenCLBackend

    def boom():
        raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")
    monkeypatch.setattr(cl, "get_platforms", boom)
    ok, why = OpenCLBackend().availability()
    assert not ok and "no OpenCL platform" in why and "register_nvidia_icd.sh" in why
    monkeypatch.setattr(cl, "get_platforms", lambda: [])
    ok, why = OpenCLBackend().availability()
    assert not ok and "no OpenCL device" in why


def test_without_pyopencl_in_a_fresh_process():
    """A process where pyopencl cannot be imported: the plugin loads, the backend is unavailable."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['pyopencl'] = None\n"
            "from rlx_core.pipeline import available_backends\n"
            "print([(b.name, ok, why) for b, ok, why in available_backends() if b.name == 'opencl'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "('opencl', False, 'pyopencl is not importable" in out.stdout


# What PoCL 3.0 raises on a CPU its LLVM does not know (AMD Zen 5: getHostCPUName() is "generic").
UNKNOWN_CPU_LOG = ("clBuildProgram failed: BUILD_PROGRAM_FAILURE - clBuildProgram failed: "
                   "BUILD_PROGRAM_FAILURE\n\nBuild on <pyopencl.Device 'pthread-x86_64-unknown-linux-gnu-"
                   "generic' on 'Portable Computing Language' at 0x55d0>:\n\nerror: unknown target CPU "
                   "'generic'\nDevice pthread-x86_64-unknown-linux-gnu-generic failed to build the program"
                   "\n\n(options: -I /x/cl)")


@pytest.fixture
def fresh_devices(ocl, monkeypatch):
    """Devices opened anew (each probes again) while the test runs; the registry's backend too."""
    from rlx_backend_opencl import device
    from rlx_core.plugins import registry

    monkeypatch.setattr(device, "_DEVICES", {})
    monkeypatch.setattr(registry().backends["opencl"], "_dev", None)


def test_a_device_that_cannot_build_kernels_is_unavailable(fresh_devices, monkeypatch):
    """The probe's build log names why: its first error line, with the device."""
    from rlx_backend_opencl import OpenCLBackend, device

    monkeypatch.setattr(device, "PROBE", device.PROBE.replace("3 * i", "3 * no_such_probe_var"))
    ok, why = OpenCLBackend().availability()
    assert not ok and "cannot build kernels" in why and "no_such_probe_var" in why, why
    assert "error" in why and "\n" not in why and OpenCLBackend().device.name in why


def test_a_device_that_cannot_run_the_probe_is_unavailable(fresh_devices, monkeypatch):
    """A probe that builds but fails to run, or writes other values, makes the device unusable."""
    import pyopencl as cl

    from rlx_backend_opencl import OpenCLBackend, device

    probe = device.PROBE
    monkeypatch.setattr(device, "PROBE", probe.replace("3 * i + 1", "3 * i + 2"))
    ok, why = OpenCLBackend().availability()
    assert not ok and "runs kernels wrongly" in why and "[2, 5, 8" in why and "expected [1, 4, 7" in why, why
    monkeypatch.setattr(device, "PROBE", probe)
    monkeypatch.setattr(device, "_DEVICES", {})              # a fresh device: probed again

    def lost(*a, **k):
        raise cl.RuntimeError("clEnqueueReadBuffer failed: OUT_OF_RESOURCES")
    monkeypatch.setattr(cl, "enqueue_copy", lost)
    ok, why = OpenCLBackend().availability()
    assert not ok and why.endswith("cannot run kernels: clEnqueueReadBuffer failed: OUT_OF_RESOURCES"), why


def test_unknown_target_cpu_is_the_reason_everywhere(fresh_devices, monkeypatch):
    """PoCL's "unknown target CPU" (issue 41, AMD Zen 5): availability(), `rlx plugins` and the
    kit's backend parameters all give that line; nothing is left to fail inside a test."""
    import pyopencl as cl
    from click.testing import CliRunner

    from rlx_backend_opencl import OpenCLBackend
    from rlx_core.cli import main
    from rlx_core.testing.parity import backend_params

    def build(self, *a, **k):
        raise cl.RuntimeError(UNKNOWN_CPU_LOG)
    monkeypatch.setattr(cl.Program, "build", build)
    line = "cannot build kernels: error: unknown target CPU 'generic'"
    ok, why = OpenCLBackend().availability()
    assert not ok and why.endswith(line), why
    out = CliRunner().invoke(main, ["plugins"])
    assert out.exit_code == 0 and line in out.output, out.output
    (param,) = backend_params(("opencl",))
    assert [m.kwargs["reason"] for m in param.marks] == [f"backend 'opencl' is not available: {why}"]


def test_tests_skip_with_the_probe_reason(ocl, tmp_path):
    """In a run where the probe cannot build, this module's tests and the kit's skip with the
    build log's line, on CI too (a fresh process: the probe's verdict is cached per device and
    process)."""
    import subprocess
    import sys

    (tmp_path / "zen5.py").write_text(
        "import pyopencl as cl\n"
        f"LOG = {UNKNOWN_CPU_LOG!r}\n"
        "def _build(self, *a, **k):\n    raise cl.RuntimeError(LOG)\n"
        "cl.Program.build = _build\n")
    (tmp_path / "test_kit_opencl.py").write_text(
        "from rlx_core.testing.parity import backend, rlx_backend  # noqa: F401\n"
        "RLX_BACKENDS = ('opencl',)\n"
        "def test_kit(backend):\n    raise AssertionError('ran on an unusable device')\n")
    env = {k: v for k, v in os.environ.items() if k != "RLX_REQUIRE_OPENCL"}
    env["CI"] = "1"                                      # the host's limit skips on CI as well
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-rs", "-p", "zen5", "-p", "no:cacheprovider",
           f"{here}/test_opencl.py::test_device_selectors", str(tmp_path / "test_kit_opencl.py")]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 skipped" in out.stdout and "passed" not in out.stdout, out.stdout[-3000:]
    assert out.stdout.count("unknown target CPU 'generic'") == 2, out.stdout[-3000:]


def test_device_selectors(ocl, monkeypatch):
    from rlx_backend_opencl import OpenCLBackend, device

    p, d = device.select("0")
    assert OpenCLBackend("0:0").device.name and OpenCLBackend("0").device.dev.int_ptr == d.int_ptr
    sub = d.name.split()[0][:4]
    assert OpenCLBackend(sub).device.dev.int_ptr == d.int_ptr
    monkeypatch.setenv("RLX_OPENCL_DEVICE", "no-such-device-xyz")
    ok, why = OpenCLBackend().availability()
    assert not ok and "no-such-device-xyz" in why
    assert OpenCLBackend("0").availability()[0]          # explicit selector wins over the env var
    with pytest.raises(BackendError, match="matches no device"):
        OpenCLBackend("99:0").device
    from rlx_core.profile import BackendConfig

    assert ocl.configure(BackendConfig(device="0")).device.dev.int_ptr == d.int_ptr


def test_local_size_shrinks_to_the_kernel_limit(ocl, monkeypatch):
    """A device that allows fewer work-items for a kernel than asked gets smaller groups."""
    import pyopencl as cl

    real = cl.Kernel.get_work_group_info

    def small(self, param, dev):
        if param == cl.kernel_work_group_info.WORK_GROUP_SIZE and self.function_name in ("softmax", "ew"):
            return 32
        return real(self, param, dev)
    monkeypatch.setattr(cl.Kernel, "get_work_group_info", small)
    check(ocl, lambda m, dt: m.softmax(m.input("x", (37, 300), dt)) * 2.0, {"x": rn(37, 300)}, tol=1e-6)
