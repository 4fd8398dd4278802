"""The CUDA backend against the NumPy reference backend, on the GPU.

Everything but the registration checks is skipped with the backend's own reason where
there is no GPU (CPU CI). Each case builds a small graph, runs it on "cuda" and "numpy"
with the same fresh random inputs and compares (relative L2 error: f32 1e-5, f16 5e-3,
bf16 1e-2); integer and bool outputs must match exactly.
"""
from __future__ import annotations

import math

import cuda_emu
import numpy as np
import pytest

import rlx_core
from rlx_core.ir.dtype import BF16, BOOL, F16, F32, F64, I32, I64, DType
from rlx_core.ir.errors import BackendError, ModelError, RlxError
from rlx_core.ir.graph import Graph
from rlx_core.ir.ops import MaskKind
from rlx_core.pipeline import available_backends
from rlx_core.profile import CompileProfile, FusionConfig

TOL = {F32: 1e-5, F16: 5e-3, BF16: 1e-2, F64: 1e-10}


def _cuda():
    for b, ok, why in available_backends():
        if b.name == "cuda":
            return b, ok, why
    return None, False, "rlx-backend-cuda is not registered"


_B, _OK, _WHY = _cuda()
gpu = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")
FLOATS = [F32, F16, BF16]


# ----------------------------------------------------------------------------- registration
def test_registered_with_reason():
    assert _B is not None, "the cuda backend is not registered through the rlx entry point"
    ok, why = _B.availability()
    assert ok or why, "an unavailable backend must say why"
    assert _B.priority > 10
    assert _B.name == "cuda"


def test_default_backend_where_gpu():
    from rlx_core.pipeline import select_backend

    if _OK:
        assert select_backend().name == "cuda"
    else:
        assert select_backend().name != "cuda"


def test_loaded_library_finds_what_the_process_mapped():
    """cuBLAS and cuFFT are found this way, after CuPy loaded them (checked here on libc)."""
    import os

    from rlx_backend_cuda import device

    path = device.loaded_library("libc.so", "libc-")
    assert path is not None and os.path.exists(path), path
    assert device.loaded_library("librlx-never-loaded.so") is None


def test_supported_ops_cover_the_table():
    """Every op below HIR has a kernel here, or is a fused op the pipeline legalizes."""
    from rlx_backend_cuda.ops import BUILDERS, VIEW_BUILDERS
    from rlx_core.ir.lower import DECOMPOSE_FUSED
    from rlx_core.ir.ops import OPS, Level

    supported = _B.supported_ops()
    missing = {n for n, d in OPS.items() if d.level is not Level.HIR} - supported
    assert missing <= set(DECOMPOSE_FUSED), missing
    assert {"dequant_matmul", "dequantize", "quantize", "fake_quantize"} <= supported
    assert supported <= {n for n, d in OPS.items() if d.level is Level.LEAF} | set(BUILDERS) | set(VIEW_BUILDERS)


def test_planned_views_pick_the_transposes_read_through_strides():
    """Transposes around attention become views (no GPU needed: the rule reads the graph);
    one a matmul reads, one that leaves the graph, and one of an attention output another
    node also reads stay copies."""
    from rlx_backend_cuda.ops import planned_layouts
    from rlx_core.ir.graph import Builder

    swap = (0, 2, 1, 3)
    m = Builder("views", "mir")
    q, k, v = (m.input(n, (1, 6, 2, 8), F16) for n in "qkv")
    heads = [m.transpose(t, swap) for t in (q, k, v)]
    joined = m.concat([heads[0], m.transpose(m.input("q2", (1, 3, 2, 8), F16), swap)], 2)
    o = m.attention(heads[0], heads[1], heads[2], mask_kind="none")
    o2 = m.attention(joined, joined, joined, mask_kind="none")
    m.output("o", m.reshape(m.transpose(o, swap), (1, 6, 16)))
    m.output("o2t", m.transpose(o2, swap))
    m.output("o2", o2)                                   # o2 read twice: its transpose copies
    w = m.transpose(m.input("w", (1, 8, 8, 8), F16), swap)
    m.output("mm", m.matmul(w, w))
    m.output("t", m.transpose(v, (0, 1, 3, 2)))          # moves the last axis
    g = m.build()
    ts = [i for i, n in enumerate(g.nodes) if n.op == "transpose"]
    views, placed, _ = planned_layouts(g)
    assert [i in views for i in ts] == [True, True, True, True, True, False, False, False]
    assert placed == frozenset()


def test_planned_layouts_place_concat_parts():
    """Concat inputs written in place: a contiguous, aligned run of the output (any producer),
    an attention's output in any layout (through its transpose and reshape); not a part at
    an unaligned offset, nor one behind a narrow."""
    from rlx_backend_cuda.ops import planned_layouts
    from rlx_core.ir.graph import Builder

    swap = (0, 2, 1, 3)
    m = Builder("placed", "mir")
    x = m.input("x", (1, 32, 64), F16)
    a, b = m.act(x, "tanh"), m.act(x, "exp")
    m.output("rows", m.concat([a, b], 1))                              # runs of 32 x 64 x 2 bytes
    y = m.input("y", (1, 3, 5), F16)
    m.output("odd", m.concat([m.act(y, "neg"), m.act(y, "abs")], 1))     # the second at byte 30
    m.output("cut", m.concat([m.narrow(a, 1, 0, 3), x], 1))
    q = m.transpose(m.reshape(m.act(x, "sin"), (1, 32, 4, 16)), swap)
    o = m.reshape(m.transpose(m.attention(q, q, q, mask_kind="none"), swap), (1, 32, 64))
    m.output("cols", m.concat([o, m.act(x, "cos")], -1))
    g = m.build()
    cats = [i for i, n in enumerate(g.nodes) if n.op == "concat"]
    _, placed, _ = planned_layouts(g)
    assert sorted(placed) == [(cats[0], 0), (cats[0], 1), (cats[1], 0), (cats[3], 0)]


def test_concat_copies_only_the_parts_not_in_place():
    """ops._b_concat (numpy arrays standing in for CuPy's: no GPU needed) skips a part whose
    bytes already are its slice of the output, whatever the stride of a size-1 dim (a reshape
    view's batch stride differs from the slice's), and copies one that lives elsewhere."""
    from rlx_backend_cuda import ops
    from rlx_backend_cuda.values import V

    class Dev(np.ndarray):                       # .data.ptr, as a CuPy array has
        @property
        def data(self):
            return type("Mem", (), {"ptr": self.ctypes.data})()

    class Build:
        def __init__(self):
            self.copies = []

        def copy(self, src, dst):
            self.copies.append(src.shape)
            dst.arr[...] = src.arr

    out = np.zeros((1, 10, 4, 8), np.float32).view(Dev)
    same = out[:, 0:3]
    batch_stride = np.lib.stride_tricks.as_strided(out[:, 3:7], (1, 4, 4, 8), (4 * 32 * 4, 32 * 4, 8 * 4, 4))
    elsewhere = np.ones((1, 3, 4, 8), np.float32).view(Dev)
    b = Build()
    node = type("Node", (), {"a": {"axis": 1}})()
    ops._b_concat(b, node, [V(same, F32), V(batch_stride.view(Dev), F32), V(elsewhere, F32)], [V(out, F32)])
    assert b.copies == [(1, 3, 4, 8)]
    assert (out[:, 7:] == 1).all() and (out[:, :7] == 0).all()


def test_elementwise_codegen_is_pure_python():
    from rlx_backend_cuda import codegen

    src = codegen.elementwise_source(((("binary", (("op", "add"),), (0, 1))),), [BF16, BF16], BF16,
                                     ["c", "z", "c"], 1, False)
    assert "rlx_ew" in src and "__nv_bfloat16" in src


# ----------------------------------------------------------------------------- helpers
def rand(rng, shape, dt, lo=-2.0, hi=2.0):
    if dt is BOOL:
        return rng.random(shape) < 0.5
    if dt.is_int:
        return rng.integers(-5 if dt not in (DType.U8, DType.U32) else 0, 6, size=shape).astype(dt.np)
    return rng.uniform(lo, hi, size=shape).astype(np.float32).astype(dt.np)


def err(got, want) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(w)
    assert (np.isfinite(g) == fin).all(), "non-finite entries differ"
    g, w = np.where(fin, g, 0), np.where(fin, w, 0)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def compare(g: Graph, inputs: dict, tol_dt: DType, params=None, states=None, profile=None, runs=1):
    """Run on cuda and numpy; assert closeness; returns cuda outputs."""
    outs = {}
    for name in ("numpy", "cuda"):
        exe = rlx_core.compile(g, profile=profile or CompileProfile(), backend=name, params=params)
        if states:
            for k, v in states.items():
                exe.states[k] = exe.backend.to_device(np.array(v))
        for _ in range(runs):
            res = exe.run(dict(inputs))
        outs[name] = {k: exe.backend.to_host(v) for k, v in res.items()}
        if states:
            outs[name].update({f"state:{k}": exe.backend.to_host(exe.states[k]) for k in states})
    for k, want in outs["numpy"].items():
        got = outs["cuda"][k]
        assert got.shape == want.shape, (k, got.shape, want.shape)
        assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
        if want.dtype.kind in "biu":
            np.testing.assert_array_equal(got, want, err_msg=k)
        else:
            e = err(got, want)
            assert e <= TOL[tol_dt], f"{k}: relative error {e:.3g} > {TOL[tol_dt]}"
    return outs["cuda"]


def spy(monkeypatch, module, name: str) -> list:
    """Replace module.name by a wrapper that records each result; returns the record."""
    seen, real = [], getattr(module, name)

    def record(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]
    monkeypatch.setattr(module, name, record)
    return seen


@pytest.fixture
def rng(request):
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


UNFUSED = CompileProfile("unfused", FusionConfig(skip=True))


# ----------------------------------------------------------------------------- primitives
@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max", "min", "pow"])
def test_binary(rng, dt, op):
    a = rand(rng, (3, 1, 5), dt, 0.5, 2.0)
    b = rand(rng, (4, 5), dt, 0.5, 2.0)
    g = Graph.define("bin", lambda m: m.binary(m.input("a", (3, 1, 5), dt), m.input("b", (4, 5), dt), op))
    compare(g, {"a": a, "b": b}, dt, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("da,db", [(I32, I32), (I64, I32), (F32, I32), (BOOL, BOOL), (F16, BF16)])
@pytest.mark.parametrize("op", ["add", "mul", "div", "max"])
def test_binary_mixed(rng, da, db, op):
    if op == "div" and da is BOOL:
        pytest.skip("numpy has no bool division")
    a = rand(rng, (6, 7), da)
    b = rand(rng, (6, 7), db)
    if db.is_int:
        b = np.where(b == 0, 3, b).astype(db.np)
    g = Graph.define("mix", lambda m: m.binary(m.input("a", (6, 7), da), m.input("b", (6, 7), db), op))
    compare(g, {"a": a, "b": b}, F32, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("dt", FLOATS + [I32])
@pytest.mark.parametrize("op", ["eq", "lt", "ge"])
def test_compare_where(rng, dt, op):
    a, b = rand(rng, (4, 6), dt), rand(rng, (4, 6), dt)
    b[0] = a[0]

    def f(m):
        x, y = m.input("a", (4, 6), dt), m.input("b", (4, 6), dt)
        c = m.compare(x, y, op)
        return {"c": c, "w": m.where(c, x, y)}
    compare(Graph.define("cw", f), {"a": a, "b": b}, dt if dt.is_float else F32, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("fn", ["gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh", "exp", "log",
                                "sqrt", "rsqrt", "neg", "abs", "sin", "cos", "recip", "identity"])
def test_activation(rng, dt, fn):
    lo = 0.1 if fn in ("log", "sqrt", "rsqrt", "recip") else -3.0
    x = rand(rng, (5, 33), dt, lo, 3.0)
    g = Graph.define("act", lambda m: m.act(m.input("x", (5, 33), dt), fn))
    compare(g, {"x": x}, dt, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("src,dst", [(F32, BF16), (BF16, F32), (F16, BF16), (F32, I32), (I64, F16),
                                     (F32, BOOL), (BOOL, F32), (F64, BF16), (I32, I64)])
def test_cast(rng, src, dst):
    x = rand(rng, (7, 9), src, -40, 40)
    g = Graph.define("cast", lambda m: m.cast(m.input("x", (7, 9), src), dst))
    compare(g, {"x": x}, dst if dst.is_float else F32, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("dt", FLOATS + [I32, BOOL])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("axes,keep", [((-1,), False), ((0, 2), True), ((1,), False), ((0, 1, 2), False)])
def test_reduce(rng, dt, op, axes, keep):
    if dt is BOOL and op in ("mean", "prod"):
        pytest.skip("not meaningful on bool")
    x = rand(rng, (3, 4, 37), dt, 0.5, 1.5)
    g = Graph.define("red", lambda m: m.reduce(m.input("x", (3, 4, 37), dt), op, axes, keep))
    compare(g, {"x": x}, dt if dt.is_float else F32, profile=UNFUSED)


@cuda_emu.emulated
@pytest.mark.parametrize("ns", [1, 3])
@pytest.mark.parametrize("reader", ["cast", "exp"])
def test_emulated_reduce_computes_its_readers_output_in_its_store(rng, ns, reader):
    """A reduce whose one reader is an elementwise node writes that node's output itself
    (ops._reduce_epilogue: the decode step's logit sum and its cast to f32): run on the CPU
    (cuda_emu), whole rows and rows in chunks, the same bits as the reduce's own kernel and
    then the reader's elementwise kernel on its bf16 results."""
    from cuda_emu import compile_kernel

    from rlx_backend_cuda import codegen
    from rlx_backend_cuda import rows as row_kernels

    R, n = 2, 3000
    x = cuda_emu.aligned(rand(rng, (R, n), BF16, -3, 3))
    program = {"cast": (("cast", (("dtype", "f32"),), (0,)),),
               "exp": (("activation", (("fn", "exp"),), (0,)), ("cast", (("dtype", "f32"),), (1,)))}[reader]
    chunk = -(-n // ns)

    def run(epilogue, dt):
        y = cuda_emu.aligned(np.zeros(R, dt.np))
        part, counters = cuda_emu.aligned(np.zeros(R * ns, np.float32)), cuda_emu.aligned(np.zeros(R, np.int32))
        compile_kernel(row_kernels.source("reduce", BF16, BF16, "sum", epilogue), "rlx_reduce").launch(
            (R, ns), (256,), (x, np.int64(n), y, np.int32(n), np.int32(chunk), part, counters))
        return y
    sums = run(None, BF16)
    got = run((codegen.epilogue_function(program, [BF16], F32, "rlx_epi"), F32), F32)
    want = cuda_emu.aligned(np.zeros(R, np.float32))
    compile_kernel(codegen.elementwise_source(program, [BF16], F32, ["c", "c"], 1, False), "rlx_ew").launch(
        (1,), (32,), (sums, want, np.int32(R)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_allclose(sums.astype(np.float64), x.astype(np.float64).sum(-1), rtol=1e-2)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_cumsum_argmax_topk(rng, dt, axis):
    x = rand(rng, (3, 50, 7), dt)

    def f(m):
        v = m.input("x", (3, 50, 7), dt)
        vals, idx = m.topk(v, 5, axis)
        return {"sm": m.softmax(v, axis), "cs": m.cumsum(v, axis), "am": m.argmax(v, axis),
                "tv": vals, "ti": idx}
    compare(Graph.define("rows", f), {"x": x}, dt, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("dt", [F32, BF16, I32])
@pytest.mark.parametrize("rows,n", [(1, 128256), (3, 40001), (64, 9000)])
def test_long_row_reductions_in_chunks(rng, dt, rows, n):
    """Few rows much longer than a block's chunk (decode's argmax and logit sum over the
    vocabulary) go in chunks of a block each, the last block of a row combining them: argmax
    keeps the first index of a tie across chunks and a NaN beats any number; sums, means,
    maxima and minima match float64 NumPy."""
    x = rand(rng, (rows, n), dt, -3, 3)
    x[0, n // 2] = x[0, n - 5] = 100                 # a tie in two chunks: the lower index wins
    z = x.copy()
    if dt.is_float:
        z[-1, 3] = z[-1, n - 2] = np.nan              # NaN wins over any number, the first one

    def f(m):
        v, w = m.input("x", (rows, n), dt), m.input("z", (rows, n), dt)
        out = {"am": m.argmax(v, -1), "amz": m.argmax(w, -1), "sum": m.reduce(v, "sum", (-1,))}
        out |= {op: m.reduce(v, op, (-1,)) for op in ("max", "min") + (("mean",) if dt.is_float else ())}
        return out
    exe = rlx_core.compile(Graph.define("long_rows", f), backend="cuda", profile=UNFUSED)
    got = {k: np.asarray(exe.backend.to_host(v), np.float64) for k, v in exe.run({"x": x, "z": z}).items()}
    x64, z64 = np.asarray(x, np.float64), np.asarray(z, np.float64)
    np.testing.assert_array_equal(got["am"], np.argmax(x64, -1))
    np.testing.assert_array_equal(got["amz"], np.argmax(z64, -1))      # (NumPy's argmax takes the first NaN)
    np.testing.assert_array_equal(got["max"], x64.max(-1))
    np.testing.assert_array_equal(got["min"], x64.min(-1))
    mag = np.abs(x64).sum(-1)
    rtol, acc = {F32: (1e-6, 1e-6), BF16: (2.0 ** -8, 1e-6), I32: (0.0, 0.0)}[dt]
    for k, want, scale in (("sum", x64.sum(-1), 1), ("mean", x64.mean(-1), n)):
        if k in got:
            assert (np.abs(got[k] - want) <= rtol * np.abs(want) + acc * mag / scale).all(), k


@gpu
def test_topk_vocab(rng):
    x = rng.standard_normal((2, 128256)).astype(np.float32)
    x[0, 7] = x[0, 9] = 50.0                     # a tie: lower index first
    g = Graph.define("tk", lambda m: dict(zip(("v", "i"), m.topk(m.input("x", (2, 128256)), 40))))
    compare(g, {"x": x}, F32)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
def test_norms(rng, dt):
    x, r = rand(rng, (2, 3, 96), dt), rand(rng, (2, 3, 96), dt)
    w, b = rand(rng, (96,), dt), rand(rng, (96,), dt)

    def f(m):
        xv, rv = m.input("x", (2, 3, 96), dt), m.input("r", (2, 3, 96), dt)
        wv, bv = m.input("w", (96,), dt), m.input("b", (96,), dt)
        return {"rms": m.rms_norm(xv, wv, eps=1e-5, offset=1.0), "rms0": m.rms_norm(xv),
                "ln": m.layer_norm(xv, wv, bv), "ln0": m.layer_norm(xv),
                "rrms": m.rms_norm(xv + rv, wv), "rln": m.layer_norm(xv + rv, wv, bv), "h": xv + rv}
    ins = {"x": x, "r": r, "w": w, "b": b}
    compare(Graph.define("norms", f), ins, dt, profile=UNFUSED)
    compare(Graph.define("norms", f), ins, dt)            # fused residual variants


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("n", [100, 1000, 3072])
def test_layer_norm_row_lengths(rng, dt, n):
    """(Residual) LayerNorm rows of 16-bit data in 16-byte vectors (1000: a thread's last
    vector past the row end; 3072: three a thread), single values otherwise (100)."""
    ins = {"x": rand(rng, (5, n), dt), "r": rand(rng, (5, n), dt), "w": rand(rng, (n,), dt), "b": rand(rng, (n,), dt)}

    def f(m):
        x, r = m.input("x", (5, n), dt), m.input("r", (5, n), dt)
        h = x + r
        return {"ln": m.layer_norm(h, m.input("w", (n,), dt), m.input("b", (n,), dt)), "ln0": m.layer_norm(x),
                "h": h}
    compare(Graph.define("ln", f), ins, dt)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("n", [40, 64, 128, 200, 512, 99, 1536, 3000, 1001])
def test_rms_norm_row_lengths(rng, dt, n):
    """(Residual) RMSNorm rows: a warp a row up to 512 values, a block beyond; 16-bit data in
    vectors of 2 to 8 values where n allows (a lane's last vector past the row end: 200),
    single values where none fits (99, 1001); rows of 64 and 128 16-bit values take 8 and 16
    lanes of one 16-byte vector each, the groups past the 7th row redoing the last one."""
    ins = {"x": rand(rng, (7, n), dt), "r": rand(rng, (7, n), dt), "w": rand(rng, (n,), dt)}

    def f(m):
        x, r = m.input("x", (7, n), dt), m.input("r", (7, n), dt)
        return {"rms": m.rms_norm(x + r, m.input("w", (n,), dt), eps=1e-6), "rms0": m.rms_norm(x)}
    compare(Graph.define("rms", f), ins, dt)
    compare(Graph.define("rms", f), ins, dt, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rot,batched,D", [(16, False, 16), (8, True, 16), (64, True, 64)])
def test_rope(rng, dt, style, rot, batched, D):
    """Partial rotation (the generic kernel), full rotation of 16-bit rows (the vector one)."""
    B, H, S = 2, 3, 5
    x = rand(rng, (B, S, H, D), dt)
    tshape = (B, S, rot // 2) if batched else (S, rot // 2)
    ang = rng.uniform(0, 6, size=tshape)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def f(m):
        xv = m.transpose(m.input("x", (B, S, H, D), dt), (0, 2, 1, 3))       # strided input
        return m.rope(xv, m.input("cos", tshape), m.input("sin", tshape), style)
    compare(Graph.define("rope", f), {"x": x, "cos": cos, "sin": sin}, dt, profile=UNFUSED)


ATTN_CASES = [
    # B, H, KVH, Sq, Sk, D, kind, window, softcap, mask, pos
    (1, 4, 2, 1, 37, 64, "causal", 0, 0.0, None, True),
    (2, 8, 2, 1, 130, 64, "none", 0, 0.0, "bool", True),
    (2, 4, 4, 20, 20, 32, "causal", 0, 0.0, None, False),
    (1, 8, 2, 70, 70, 64, "causal", 0, 0.0, "bool", False),
    (1, 4, 1, 33, 90, 128, "sliding_window", 16, 0.0, None, True),
    (2, 4, 2, 17, 17, 64, "causal", 0, 30.0, "bias", False),
    (1, 2, 2, 5, 9, 40, "none", 0, 0.0, None, False),
    (1, 8, 8, 64, 64, 96, "bias", 0, 0.0, "bias", False),
    # 128 query rows and more: the tensor-core kernel's blocks of 2 m-tiles a warp
    (1, 4, 2, 200, 200, 128, "causal", 0, 0.0, None, False),
    (1, 2, 2, 160, 300, 64, "none", 0, 30.0, "bool", True),
    (1, 2, 1, 130, 130, 96, "sliding_window", 50, 0.0, "bias", False),
    (1, 2, 2, 256, 256, 128, "none", 0, 0.0, None, False),
    (1, 4, 2, 256, 384, 64, "none", 0, 0.0, None, False),      # whole tiles, GQA (the wgmma kernel's fast path)
    # head_dim 256 (Qwen3.5's full attention: 8 query heads on 2 KV heads, causal): one m-tile a
    # warp (mma.sync), 64-key tiles (wgmma); odd lengths, a right-padding mask, an extend (Sq < Sk)
    (1, 8, 2, 1000, 1000, 256, "causal", 0, 0.0, None, False),
    (1, 8, 2, 17, 17, 256, "causal", 0, 0.0, None, False),
    (2, 4, 1, 130, 130, 256, "causal", 0, 0.0, "pad", False),
    (2, 8, 2, 100, 300, 256, "causal", 0, 0.0, None, True),
    (1, 4, 2, 128, 256, 256, "none", 0, 30.0, "bias", False),
    (1, 4, 1, 200, 200, 256, "sliding_window", 50, 0.0, None, False),
    (1, 4, 2, 256, 512, 256, "none", 0, 0.0, None, False),     # whole tiles (the wgmma kernel's fast path)
    # a ViT's (257 tokens: one past whole tiles, the last query tile's rows mostly past Sq);
    # whole keys with a cut query tile; a mask per query row (the path that reads a byte a score)
    (2, 4, 4, 257, 257, 64, "none", 0, 0.0, None, False),
    (1, 4, 2, 200, 256, 128, "none", 0, 0.0, None, False),
    (2, 4, 2, 300, 300, 64, "causal", 0, 0.0, "pad", False),
    # a mask of keys only, [B, 1, 1, Sk] (a model's padding mask: the wgmma kernel's KEYMASK,
    # whole tiles where row 0 keeps every key, cut ones in row 1)
    (2, 8, 2, 300, 300, 256, "causal", 0, 0.0, "keys", False),
    (2, 8, 2, 100, 300, 256, "causal", 0, 0.0, "keys", True),
    (2, 4, 4, 257, 257, 64, "none", 0, 0.0, "keys", False),
    (2, 4, 2, 200, 384, 128, "none", 0, 0.0, "keys", False),
    (2, 4, 1, 200, 200, 64, "sliding_window", 50, 0.0, "keys", False),
]


@gpu
@pytest.mark.parametrize("dt", [F32, BF16])
def test_concat_parts_written_in_place(rng, dt):
    """Producers writing straight into a concat's output (ops.planned_layouts): an RMSNorm
    and a matmul into contiguous runs, an attention through its transpose and reshape and a
    GEMM with its bias and GELU into columns, beside a part that is copied, and a part that
    another node also reads."""
    swap = (0, 2, 1, 3)
    S, H, D = 40, 4, 32
    ins = {"x": rand(rng, (1, S, H * D), dt), "w": rand(rng, (H * D, H * D), dt, -0.1, 0.1),
           "g": rand(rng, (D,), dt), "bias": rand(rng, (H * D,), dt)}

    def f(m):
        x, w = m.input("x", (1, S, H * D), dt), m.input("w", (H * D, H * D), dt)
        heads = m.rms_norm(m.reshape(x, (1, S, H, D)), m.input("g", (D,), dt))
        up = m.reshape(m.matmul(x, w), (1, S, H, D))
        shared = m.act(m.reshape(x, (1, S, H, D)), "tanh")
        joined = m.concat([heads, up, shared], 1)                       # [1, 3S, H, D]
        q = m.transpose(joined, swap)
        o = m.reshape(m.transpose(m.attention(q, q, q, mask_kind="none"), swap), (1, 3 * S, H * D))
        xs = m.concat([x, x, x], 1)
        lin = m.act(m.matmul(xs, w) + m.input("bias", (H * D,), dt), "gelu_tanh")     # GEMM rows, strided
        cols = m.concat([o, lin, m.act(xs, "exp")], -1)
        return {"cols": cols, "shared": shared}
    g = Graph.define("placed", f)
    exe = rlx_core.compile(g, backend="cuda")
    homes = [s.home for s in exe.lir().slots.values()]
    assert homes.count("placed") == 4, exe.lir().text()
    compare(g, ins, dt)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"{c[6]}-Sq{c[3]}-Sk{c[4]}-D{c[5]}-{c[9]}")
@pytest.mark.parametrize("tc", ["wg", "mt1", "mt2", "off"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_attention(rng, dt, case, tc, layout, monkeypatch):
    """Each kernel: Hopper's wgmma one (wg), the tensor-core one with warps of 1 or 2 m-tiles
    of 16 query rows (mt1, mt2; 16-bit data and 16+ query rows), and the split-K one (off).
    bshd: q, k, v come [B, S, H, D] and the output leaves so, through transposes the plan runs
    as views: the kernels read and write through strides."""
    from rlx_backend_cuda import device, ops, set_config

    if tc == "wg" and tuple(device.info().get("cc", (0, 0))) != (9, 0):
        pytest.skip("the wgmma attention runs on sm_90 GPUs (H100, H200) only")
    monkeypatch.setattr(ops, "ATTN_TC_MIN_BLOCKS_PER_SM", 0 if tc == "mt2" else 1 << 30)

    B, H, KVH, Sq, Sk, D, kind, window, cap, mask, pos = case
    ins = {"q": rand(rng, (B, H, Sq, D), dt), "k": rand(rng, (B, KVH, Sk, D), dt),
           "v": rand(rng, (B, KVH, Sk, D), dt)}
    if mask == "bool":
        mk = rng.random((B, 1, Sq, Sk)) < 0.8
        mk[..., 0] = True
        ins["mask"] = mk
    elif mask == "pad":                        # batch row b's last 7 * b keys are padding
        mk = np.ones((B, 1, Sq, Sk), bool)
        for b in range(1, B):
            mk[b, ..., Sk - 7 * b:] = False
        ins["mask"] = mk
    elif mask == "keys":                       # row 0 keeps every key; row 1 not its last 7 or key 100
        mk = np.ones((B, 1, 1, Sk), bool)
        mk[1:, ..., Sk - 7:] = False
        mk[1:, ..., 100] = False
        ins["mask"] = mk
    elif mask == "bias":
        ins["mask"] = rand(rng, (1, H, Sq, Sk), dt)
    if pos:
        ins["pos"] = np.array([Sk - Sq - b for b in range(B)], np.int32)
    swap = (0, 2, 1, 3)
    if layout == "bshd":
        ins.update({n: np.ascontiguousarray(ins[n].transpose(swap)) for n in "qkv"})

    def f(m):
        q, k, v = (m.input(n, ins[n].shape, dt) for n in ("q", "k", "v"))
        if layout == "bshd":
            q, k, v = (m.transpose(t, swap) for t in (q, k, v))
        mdt = BOOL if mask in ("bool", "pad", "keys") else dt
        mv = m.input("mask", ins["mask"].shape, mdt) if mask else None
        pv = m.input("pos", (B,), I32) if pos else None
        o = m.attention(q, k, v, mv, pv, mask_kind=kind, window=window, softcap=cap)
        return m.transpose(o, swap) if layout == "bshd" else o
    set_config(tc_attention=tc != "off", wg_attention=tc == "wg")
    try:
        compare(Graph.define("attn", f), ins, dt, profile=UNFUSED)
    finally:
        set_config(tc_attention=True, wg_attention=True)


@gpu
@pytest.mark.parametrize("dt", [F16, BF16])
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("B,S,D,batched", [(1, 200, 128, False), (2, 130, 64, True), (1, 256, 128, False)])
@pytest.mark.parametrize("wg", [True, False])
def test_attention_block_rope(rng, dt, style, B, S, D, batched, wg):
    """RoPE on q and k read through [B, S, H, D] views, then attention: one
    fused_attention_block (one RoPE launch into scratch, then the attention kernel), with the
    wgmma kernel and without it, ragged query blocks, GQA, per-batch tables."""
    from rlx_backend_cuda import set_config

    H, KVH = 4, 2
    tshape = (B, S, D // 2) if batched else (S, D // 2)
    ang = rng.uniform(0, 6, size=tshape)
    ins = {"q": rand(rng, (B, S, H, D), dt), "k": rand(rng, (B, S, KVH, D), dt), "v": rand(rng, (B, S, KVH, D), dt),
           "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    swap = (0, 2, 1, 3)

    def f(m):
        q, k, v = (m.transpose(m.input(n, ins[n].shape, dt), swap) for n in "qkv")
        c, s = m.input("cos", tshape, F32), m.input("sin", tshape, F32)
        o = m.attention(m.rope(q, c, s, style), m.rope(k, c, s, style), v, mask_kind="none")
        return m.transpose(o, swap)
    g = Graph.define("block", f)
    assert "fused_attention_block" in [n.op for n in rlx_core.compile(g, backend="cuda").lir().graph.nodes]
    set_config(wg_attention=wg)
    try:
        compare(g, ins, dt)
    finally:
        set_config(wg_attention=True)


@gpu
@pytest.mark.parametrize("dt", [F16, BF16])
@pytest.mark.parametrize("kind", ["none", "causal"])
@pytest.mark.parametrize("mt", [1, 2, "wg"])
@pytest.mark.parametrize("D", [128, 256])
def test_attention_tc_growing_scores(rng, dt, kind, mt, D, monkeypatch):
    """Keys scaled up along the sequence make each query row's max grow tile after tile: the
    tensor-core kernels rescale their running sums only when a max passes the old one by 2^8,
    so both their branches run."""
    from rlx_backend_cuda import device, ops, set_config

    if mt == "wg" and tuple(device.info().get("cc", (0, 0))) != (9, 0):
        pytest.skip("the wgmma attention runs on sm_90 GPUs (H100, H200) only")
    monkeypatch.setattr(ops, "ATTN_TC_MIN_BLOCKS_PER_SM", 0 if mt == 2 else 1 << 30)
    B, H, S = 1, 2, 256
    ramp = np.linspace(0.2, 3.0, S, dtype=np.float32)[None, None, :, None]
    ins = {"q": rand(rng, (B, H, S, D), dt), "k": (rand(rng, (B, H, S, D), F32) * ramp).astype(dt.np),
           "v": rand(rng, (B, H, S, D), dt)}

    def f(m):
        q, k, v = (m.input(n, (B, H, S, D), dt) for n in ("q", "k", "v"))
        return m.attention(q, k, v, mask_kind=kind)
    set_config(wg_attention=mt == "wg")
    try:
        compare(Graph.define("attn", f), ins, dt, profile=UNFUSED)
    finally:
        set_config(wg_attention=True)


@gpu
@pytest.mark.parametrize("dt", [F32, F16, BF16])
@pytest.mark.parametrize("act", ["identity", "relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("lt", [True, False])
def test_matmul_bias_act_epilogue(rng, dt, act, lt, monkeypatch):
    """A biased linear + activation over 111 rows: cuBLASLt adds the bias (and applies ReLU or
    GELU-tanh) in its epilogue; silu, or the switch off, takes the separate elementwise pass."""
    from rlx_backend_cuda import blas, set_config

    prepared = spy(monkeypatch, blas.LtLib, "prepare")
    ins = {"x": rand(rng, (3, 37, 64), dt)}
    params = {"w": rand(rng, (96, 64), dt), "b": rand(rng, (96,), dt)}

    def f(m):
        y = m.linear(m.input("x", (3, 37, 64), dt), m.param("w", (96, 64), dt), m.param("b", (96,), dt))
        return y if act == "identity" else m.act(y, act)
    set_config(lt_epilogue=lt)
    try:
        compare(Graph.define("mba", f), ins, dt, params=params)
    finally:
        set_config(lt_epilogue=True)
    assert any(p is not None for p in prepared) is (act != "silu")       # built either way; run when lt


DECODE_CASES = [c for c in ATTN_CASES if c[3] == 1] + [
    (2, 8, 2, 1, 300, 64, "sliding_window", 40, 30.0, "bias", True),
    (1, 12, 3, 1, 64, 128, "causal", 0, 0.0, "bool", True),
    (3, 2, 2, 1, 512, 32, "none", 0, 0.0, None, True),
    (1, 8, 2, 1, 2040, 64, "causal", 0, 0.0, "bool", True),       # decode kernel: warps take 1-2 chunks
    (1, 16, 2, 1, 700, 128, "causal", 0, 0.0, None, True),        # 8 heads a kv head: 2 loads a chunk
    (1, 8, 2, 1, 1100, 256, "causal", 0, 0.0, "bool", True),      # Qwen3.5's: 16-bit rows in two loads a lane
    (2, 4, 1, 1, 600, 256, "none", 0, 0.0, "bias", True),
]


def decode_rows(rng, B: int, H: int, KVH: int, Sk: int, D: int, dt) -> dict:
    """A decode step's attention inputs: one query row per head, the caches, row b at position Sk - 1 - 7b."""
    pos = np.array([Sk - 1 - 7 * b for b in range(B)], np.int32)
    return {"q": rand(rng, (B, H, 1, D), dt), "k": rand(rng, (B, KVH, Sk, D), dt),
            "v": rand(rng, (B, KVH, Sk, D), dt), "pos": pos}


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[6]}-Sk{c[4]}-D{c[5]}-{c[9]}")
@pytest.mark.parametrize("kernel", ["short", "decode", "split"])
def test_decode_attention_kernels(rng, dt, case, kernel, monkeypatch):
    """One query row per head: the short-context kernel (one block per kv head, caches up
    to 512 positions), the decode kernel (a cluster of blocks per kv head, up to 2048; sm_90)
    and the split-K kernel each equal the NumPy backend; every case takes the kernel asked
    for where it applies."""
    from rlx_backend_cuda import device, ops, set_config

    made = {k: spy(monkeypatch, ops, f"_{k}_attention") for k in ("short", "decode")}
    B, H, KVH, Sq, Sk, D, kind, window, cap, mask, pos = case
    ins = decode_rows(rng, B, H, KVH, Sk, D, dt)
    if mask == "bool":
        ins["mask"] = rng.random((B, 1, 1, Sk)) < 0.8
        ins["mask"][..., 0] = True
    elif mask == "bias":
        ins["mask"] = rand(rng, (1, H, 1, Sk), dt)

    def f(m):
        q, k, v = (m.input(n, ins[n].shape, dt) for n in ("q", "k", "v"))
        mv = m.input("mask", ins["mask"].shape, BOOL if mask in ("bool", "pad") else dt) if mask else None
        return m.attention(q, k, v, mv, m.input("pos", (B,), I32), mask_kind=kind, window=window, softcap=cap)
    set_config(short_attention=kernel == "short", decode_attention=kernel == "decode")
    try:
        compare(Graph.define("attn", f), ins, dt, profile=UNFUSED)
    finally:
        set_config(short_attention=True, decode_attention=True)
    applies = {"short": Sk <= 512,             # (the decode kernel: a key row in at most 32 bytes a lane)
               "decode": tuple(device.info().get("cc", (0, 0))) >= (9, 0) and D * np.dtype(dt.np).itemsize <= 512}
    if applies.get(kernel):
        assert made[kernel] and made[kernel][-1] is not None


@gpu
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("B", [5, 24])
def test_decode_attention_small_clusters(rng, dt, B, monkeypatch):
    """Batch decode (more (batch row, kv head) pairs than a wave holds clusters of 8) on the
    decode kernel with smaller clusters (ATTN_DECODE_SMALL_CLUSTERS; on 132 SMs 5 rows take 2
    blocks a pair, 24 rows one) equals the NumPy backend, and the decode kernel ran (sm_90)."""
    from rlx_backend_cuda import device, ops, sources

    monkeypatch.setattr(sources, "ATTN_DECODE_SMALL_CLUSTERS", True)
    made = spy(monkeypatch, ops, "_decode_attention")
    H, KVH, Sk, D = 32, 8, 600, 64
    ins = decode_rows(rng, B, H, KVH, Sk, D, dt)

    def f(m):
        q, k, v = (m.input(n, ins[n].shape, dt) for n in ("q", "k", "v"))
        return m.attention(q, k, v, None, m.input("pos", (B,), I32), mask_kind="causal")
    compare(Graph.define("attn", f), ins, dt, profile=UNFUSED)
    if tuple(device.info().get("cc", (0, 0))) >= (9, 0):
        assert made and made[-1] is not None


# (B, H, KVH, Sk, D, dtype, mask, groups, cluster): H / KVH query heads a kv head in groups
EMULATED_DECODE = [
    (1, 8, 2, 1100, 64, BF16, "bool", 1, 8),  # a key mask read once a key for the G heads; keys in each block
    (1, 4, 1, 300, 256, BF16, "bias", 1, 8),  # a mask per head; 256-wide 16-bit rows: two loads a lane
    (2, 4, 2, 45, 32, F32, None, 1, 8),       # (rows of two batch entries; most blocks see no key)
    (1, 8, 2, 200, 256, BF16, "bias", 4, 8),  # a block a query head (grid z): its q, mask and output rows
    (2, 8, 2, 90, 64, F32, "bool", 2, 8),     # two heads a block
    (3, 8, 2, 300, 64, BF16, "bool", 1, 1),   # batch decode: one block a (batch row, kv head), no partner
    (2, 4, 2, 150, 128, BF16, None, 1, 2),    # clusters of two
]


@cuda_emu.emulated
@pytest.mark.parametrize("case", EMULATED_DECODE,
                         ids=lambda c: f"D{c[4]}-{c[5].value}-{c[6]}-z{c[7]}-cl{c[8]}")
def test_emulated_cluster_decode_attention(rng, case):
    """The decode attention kernel (a cluster of blocks a kv head and group of its query heads,
    merged through each other's shared memory) run on the CPU (cuda_emu) as
    ops._decode_attention renders and launches it, causal at each row's position, against
    float64 within the dtype's tolerance."""
    from cuda_emu import compile_kernel

    from rlx_backend_cuda import sources
    from rlx_backend_cuda.codegen import ctype
    from rlx_backend_cuda.ops import NO_EPI_ARGS, NO_ROPE_ARGS
    from rlx_core.testing.parity import TOL, ref_attention

    B, H, KVH, Sk, D, dt, mask, groups, cl = case
    G, isz = H // KVH // groups, np.dtype(dt.np).itemsize
    q, k, v = (rand(rng, s, dt) for s in ((B, H, 1, D), (B, KVH, Sk, D), (B, KVH, Sk, D)))
    pos = np.array([Sk - 1 - 7 * b for b in range(B)], np.int32)
    m = {"bool": rng.random((B, 1, 1, Sk)) < 0.8, "bias": rand(rng, (1, H, 1, Sk), dt), None: None}[mask]
    if mask == "bool":
        m[..., 0] = True
    sh = sources.attn_decode_shape(G, D, 16 // isz, pair=True, cl=cl)
    masking = dict(MASKKIND=1, MASKMODE={"bool": 1, "bias": 2, None: 0}[mask], HEADMASK=int(mask == "bias"),
                   TM={"bool": "bool", "bias": ctype(dt), None: "float"}[mask], TP="int", HAS_POS=1)
    src = sources.render(sources.ATTN_DECODE, TQ=ctype(dt), TK=ctype(dt), TV=ctype(dt), TO=ctype(dt), QV=1,
                         **masking, **sh, **sources.ATTN_DECODE_PLAIN)
    out = cuda_emu.aligned(np.zeros((B, H, 1, D), dt.np))
    mst = (0, 0, 0) if m is None else (Sk if mask == "bool" else 0, Sk if mask == "bias" else 0, 1)
    i64 = np.int64
    compile_kernel(src, "rlx_attn_decode").launch((B * KVH, sh["CL"], groups), (sh["NT"],), (
        cuda_emu.aligned(q), i64(H * D), i64(D), cuda_emu.aligned(k), i64(KVH * Sk * D), i64(Sk * D), i64(D),
        cuda_emu.aligned(v), i64(KVH * Sk * D), i64(Sk * D), i64(D),
        None if m is None else (m if mask == "bool" else cuda_emu.aligned(m)), *map(i64, mst),
        pos, np.int32(H), np.int32(KVH), np.int32(Sk), 1 / math.sqrt(D), 0.0, np.int32(0),
        out, i64(H * D), i64(D), *NO_ROPE_ARGS, *NO_EPI_ARGS))
    f64 = [a.astype(np.float64) for a in (q, k, v)]
    want = ref_attention(*f64, m if mask != "bias" else m.astype(np.float64), pos, scale=1 / math.sqrt(D))
    err = np.abs(out.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= TOL[dt], err


EMULATED_SPLIT = [         # (B, H, KVH, Sq, Sk, D, dtype, mask, nsplit)
    (2, 8, 2, 1, 200, 64, BF16, "bool", 3),    # decode rows: 3 tiles, 3 and 2 (the last cut) a split
    (1, 4, 2, 3, 90, 32, F32, "bias", 2),      # three query rows a head, a mask per head
    (2, 2, 1, 1, 45, 64, BF16, None, 1),       # one split: the block writes the output itself
]


@cuda_emu.emulated
@pytest.mark.parametrize("case", EMULATED_SPLIT, ids=lambda c: f"Sq{c[3]}-{c[6].value}-{c[7]}-s{c[8]}")
def test_emulated_split_attention(rng, case):
    """The split-K attention kernel (batch decode; its splits merged by the last block of each)
    run on the CPU as ops renders and launches it, causal at each batch row's position, against
    float64."""
    from cuda_emu import compile_kernel

    from rlx_backend_cuda import sources
    from rlx_backend_cuda.codegen import ctype
    from rlx_core.testing.parity import TOL, ref_attention

    B, H, KVH, Sq, Sk, D, dt, mask, nsplit = case
    G, i64, i32 = H // KVH, np.int64, np.int32
    q, k, v = (rand(rng, s, dt) for s in ((B, H, Sq, D), (B, KVH, Sk, D), (B, KVH, Sk, D)))
    pos = np.array([Sk - Sq - 7 * b for b in range(B)], np.int32)
    m = {"bool": rng.random((B, 1, 1, Sk)) < 0.8, "bias": rand(rng, (1, H, Sq, Sk), dt), None: None}[mask]
    if mask == "bool":
        m[..., 0] = True
    vec = 16 // np.dtype(dt.np).itemsize
    sh = sources.attn_split_shape(D, D, vec, vec, G * Sq, 4)
    src = sources.render(sources.ATTN_SPLIT, TQ=ctype(dt), TK=ctype(dt), TV=ctype(dt), TO=ctype(dt),
                         ACC="float", DK=D, DV=D, MASKKIND=1, MASKMODE={"bool": 1, "bias": 2, None: 0}[mask],
                         HAS_POS=1, TM={"bool": "bool", "bias": ctype(dt), None: "float"}[mask], TP="int",
                         **sh)
    rowblocks = -(-G * Sq // sh["ROWS"])
    out = cuda_emu.aligned(np.zeros((B, H, Sq, D), dt.np))
    part_o = np.zeros(nsplit * B * H * Sq * D, np.float32)
    part_ml = np.zeros(nsplit * B * H * Sq * 2, np.float32)
    counters = np.zeros(B * KVH * rowblocks, np.int32)
    mst = {"bool": (Sk, 0, 0, 1), "bias": (0, Sq * Sk, Sk, 1), None: (0, 0, 0, 0)}[mask]
    kernel = compile_kernel(src, "rlx_attn_split")
    for _ in range(2):              # (twice: the merging blocks leave their counters at 0)
        kernel.launch((B * KVH, rowblocks, nsplit), (sh["NT"],), (
            cuda_emu.aligned(q), i64(H * Sq * D), i64(Sq * D), i64(D), cuda_emu.aligned(k), i64(KVH * Sk * D),
            i64(Sk * D), i64(D), cuda_emu.aligned(v), i64(KVH * Sk * D), i64(Sk * D), i64(D),
            None if m is None else (m if mask == "bool" else cuda_emu.aligned(m)), *map(i64, mst), pos,
            part_o, part_ml, i32(B), i32(H), i32(KVH), i32(Sq), i32(Sk), i32(16), 1 / math.sqrt(D), 0.0,
            i32(0), counters, out, i64(H * Sq * D), i64(Sq * D), i64(D)))
        assert not counters.any()
    f64 = [a.astype(np.float64) for a in (q, k, v)]
    want = ref_attention(*f64, m if mask != "bias" else m.astype(np.float64), pos, scale=1 / math.sqrt(D))
    err = np.abs(out.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= TOL[dt], err


EMULATED_TC = [           # (B, H, KVH, Sq, Sk, D, dtype, VEC, MT, causal)
    (1, 2, 1, 20, 70, 64, BF16, 1, 1, True),      # keys of two tiles, the last one cut; GQA
    (2, 2, 2, 70, 70, 32, F16, 1, 2, False),      # two m-tiles a warp (query rows past Sq), whole tiles
    (1, 1, 1, 33, 40, 128, BF16, 0, 1, True),     # the element-wise tile copies (no 16-byte rows)
]


@cuda_emu.emulated
@pytest.mark.parametrize("case", EMULATED_TC, ids=lambda c: f"D{c[5]}-{c[6].value}-vec{c[7]}-mt{c[8]}")
def test_emulated_tensor_core_attention(rng, case):
    """rlx_attn_tc (mma.sync flash attention, the GPU's prefill kernel before sm_90) run on the
    CPU, its mma.sync, ldmatrix and cp.async as cuda_emu's warp collectives, as ops renders and
    launches it, against float64: a check of the emulation's fragment layouts as much as of the
    kernel, which the GPU tests run."""
    from cuda_emu import compile_kernel

    from rlx_backend_cuda import sources
    from rlx_backend_cuda.codegen import ctype
    from rlx_core.testing.parity import TOL, ref_attention

    B, H, KVH, Sq, Sk, D, dt, vec, mt, causal = case
    q, k, v = (cuda_emu.aligned(rand(rng, s, dt)) for s in ((B, H, Sq, D), (B, KVH, Sk, D), (B, KVH, Sk, D)))
    src = sources.render(sources.ATTN_TC, T=ctype(dt), MMAT="bf16" if dt is BF16 else "f16", D=D, VEC=vec,
                         MT=mt, MASKKIND=int(causal), MASKMODE=0, TM="float", TP="int", HAS_POS=0)
    out = cuda_emu.aligned(np.zeros((B, H, Sq, D), dt.np))
    i64 = np.int64
    strides = [(i64(t.shape[1] * t.shape[2] * D), i64(t.shape[2] * D), i64(D)) for t in (q, k, v, out)]
    compile_kernel(src, "rlx_attn_tc").launch((-(-Sq // (64 * mt)), H, B), (128,), (
        q, *strides[0], k, *strides[1], v, *strides[2], None, i64(0), i64(0), i64(0), i64(0), None,
        out, *strides[3], np.int32(B), np.int32(H), np.int32(KVH), np.int32(Sq), np.int32(Sk),
        1 / math.sqrt(D), 0.0, np.int32(0)), sources.attn_tc_smem(D, mt))
    f64 = [a.astype(np.float64) for a in (q, k, v)]
    pos = np.full(B, Sk - Sq, np.int32)
    want = ref_attention(*f64, None, pos, scale=1 / math.sqrt(D), mask_kind="causal" if causal else "none")
    err = np.abs(out.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= TOL[dt], err


@gpu
@pytest.mark.parametrize("dt", FLOATS)
def test_mask_fill_gather_views(rng, dt):
    s = rand(rng, (2, 3, 4, 6), dt)
    mk = rng.random((2, 1, 4, 6)) < 0.7
    tab = rand(rng, (11, 8), dt)
    idx = np.array([[0, 3, -1], [10, 2, 2]], np.int64)

    def f(m):
        sv = m.input("s", (2, 3, 4, 6), dt)
        t = m.input("t", (11, 8), dt)
        e = m.gather(t, m.input("i", (2, 3), I64))
        e1 = m.gather(t, m.input("j", (4,), I32), axis=1)
        mf = m.add("mask_fill", (sv, m.input("mk", (2, 1, 4, 6), BOOL)), mask_kind="causal", has_mask=True)
        nar = m.narrow(sv, 3, 1, 4)
        cat = m.concat([nar, m.expand(m.narrow(sv, 3, 0, 1), (2, 3, 4, 2))], 3)
        rs = m.reshape(m.transpose(sv, (0, 2, 1, 3)), (2, 4, 18))
        return {"e": e, "e1": e1, "mf": mf, "cat": cat, "rs": rs, "rs2": m.reshape(nar, (2, 12, 4)) * 2.0}
    ins = {"s": s, "t": tab, "i": idx, "j": np.array([7, 0, -2, 3], np.int32), "mk": mk}
    compare(Graph.define("views", f), ins, dt, profile=UNFUSED)


@gpu
@pytest.mark.parametrize("dt", FLOATS + [I64])
def test_copies_in_16_byte_chunks(rng, dt):
    """Transposes that keep the last axis, concats and broadcast sources copy 16 bytes a
    thread; a source off 16-byte alignment (a narrow by one element) takes the element
    kernel. Every result is exact."""
    x = rand(rng, (2, 5, 3, 16), dt)

    def f(m):
        v = m.input("x", (2, 5, 3, 16), dt)
        flat = m.reshape(v, (2, 15, 16))
        return {"t": m.transpose(v, (0, 2, 1, 3)),
                "cat": m.concat([m.narrow(flat, 1, 0, 4), m.narrow(flat, 1, 6, 9)], 1),
                "bc": m.transpose(m.expand(m.narrow(flat, 0, 1, 1), (3, 15, 16)), (1, 0, 2)),
                "off": m.transpose(m.narrow(v, 3, 1, 8), (0, 2, 1, 3)),
                "t2": m.transpose(m.reshape(v, (2, 5, 24, 2)), (2, 1, 0, 3))}
    outs = {}
    for name in ("numpy", "cuda"):
        exe = rlx_core.compile(Graph.define("copies", f), profile=UNFUSED, backend=name)
        outs[name] = {k: exe.backend.to_host(a) for k, a in exe.run({"x": x}).items()}
    for k, want in outs["numpy"].items():
        np.testing.assert_array_equal(outs["cuda"][k], want, err_msg=k)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("sa,sb,ta,tb", [((5, 7), (7, 3), False, False), ((2, 5, 7), (3, 7), False, True),
                                         ((2, 1, 7, 5), (3, 7, 4), True, False), ((1, 64), (96, 64), False, True),
                                         ((3, 1, 64), (40, 64), False, True), ((1, 4096), (37, 4096), False, True),
                                         ((2, 1, 2048), (45, 2048), False, True)])
def test_matmul(rng, dt, sa, sb, ta, tb):
    from rlx_backend_cuda import set_config

    a, b = rand(rng, sa, dt), rand(rng, sb, dt)
    g = Graph.define("mm", lambda m: m.matmul(m.input("a", sa, dt), m.input("b", sb, dt), ta, tb))
    for gemv in (True, False):
        set_config(gemv=gemv)
        compare(g, {"a": a, "b": b}, dt, profile=UNFUSED)
    set_config(gemv=True)


@gpu
@pytest.mark.parametrize("dt", [F16, BF16])
@pytest.mark.parametrize("hid,inter", [(2048, 21), (4096, 8), (256, 40)])
def test_gemv_rows_split_over_warps(rng, dt, hid, inter, monkeypatch):
    """Decode's gate/up GEMV computing the SwiGLU, then the down GEMV, with few rows and long
    ones: each row's dot product split over 2-8 warps (added in a fixed order) equals NumPy."""
    from rlx_backend_cuda import ops

    splits = spy(monkeypatch, ops, "gemv_split")
    shapes = {"gate": (inter, hid), "up": (inter, hid), "down": (hid, inter)}
    pv = {n: rand(rng, sh, dt, -1, 1) / math.sqrt(sh[-1]) for n, sh in shapes.items()}

    def f(m):
        p = {n: m.param(n, sh, dt) for n, sh in shapes.items()}
        return m.swiglu(m.input("x", (1, 1, hid), dt), p["gate"], p["up"], p["down"])
    compare(Graph.define("mlp", f), {"x": rand(rng, (1, 1, hid), dt)}, dt, params=pv)
    assert splits and splits[0] == {2048: 4, 4096: 8, 256: 1}[hid], splits     # (the gate/up GEMV's)


@gpu
def test_matmul_int(rng):
    a, b = rand(rng, (2, 4, 5), I32), rand(rng, (5, 3), I32)
    g = Graph.define("mmi", lambda m: m.matmul(m.input("a", (2, 4, 5), I32), m.input("b", (5, 3), I32)))
    compare(g, {"a": a, "b": b}, F32)


# ----------------------------------------------------------------------------- transformer graphs
def tiny_layer(m, x, p, H, KVH, D, cos, sin, eps=1e-5, cache=None, pos=None, mask=None):
    B, S, hid = x.dims
    h = m.rms_norm(x, p["ln1"], eps=eps)
    q = m.transpose(m.reshape(m.linear(h, p["q"]), (B, S, H, D)), (0, 2, 1, 3))
    k = m.transpose(m.reshape(m.linear(h, p["k"]), (B, S, KVH, D)), (0, 2, 1, 3))
    v = m.transpose(m.reshape(m.linear(h, p["v"]), (B, S, KVH, D)), (0, 2, 1, 3))
    q, k = m.rope(q, cos, sin), m.rope(k, cos, sin)
    if cache is not None:
        k = m.kv_write(cache[0], k, pos)
        v = m.kv_write(cache[1], v, pos)
        a = m.attention(q, k, v, mask, pos, mask_kind=MaskKind.CAUSAL)
    else:
        a = m.attention(q, k, v, mask_kind=MaskKind.CAUSAL)
    a = m.reshape(m.transpose(a, (0, 2, 1, 3)), (B, S, H * D))
    x = x + m.linear(a, p["o"])
    h = m.rms_norm(x, p["ln2"], eps=eps)
    return x + m.swiglu(h, p["gate"], p["up"], p["down"])


def tiny_params(rng, hid, H, KVH, D, I, dt):
    shapes = {"ln1": (hid,), "ln2": (hid,), "q": (H * D, hid), "k": (KVH * D, hid), "v": (KVH * D, hid),
              "o": (hid, H * D), "gate": (I, hid), "up": (I, hid), "down": (hid, I)}
    return {n: (rand(rng, s, dt, 0.8, 1.2) if n.startswith("ln") else
                rand(rng, s, dt, -1, 1) / math.sqrt(s[-1])) for n, s in shapes.items()}, shapes


@gpu
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("policy", ["direct", "fusable"])
def test_tiny_transformer_prefill(rng, dt, policy):
    B, S, hid, H, KVH, D, I = 2, 24, 128, 4, 2, 32, 256
    pv, shapes = tiny_params(rng, hid, H, KVH, D, I, dt)
    ang = rng.uniform(0, 6, (S, D // 2))

    def f(m):
        x = m.input("x", (B, S, hid), dt)
        p = {n: m.param(n, s, dt) for n, s in shapes.items()}
        cos, sin = m.input("cos", (S, D // 2)), m.input("sin", (S, D // 2))
        y = tiny_layer(m, x, p, H, KVH, D, cos, sin)
        return tiny_layer(m, y, p, H, KVH, D, cos, sin)
    prof = CompileProfile("t", FusionConfig(policy=policy))
    ins = {"x": rand(rng, (B, S, hid), dt), "cos": np.cos(ang).astype(np.float32),
           "sin": np.sin(ang).astype(np.float32)}
    compare(Graph.define("tiny", f), ins, dt, params=pv, profile=prof, runs=3)


@gpu
@pytest.mark.parametrize("dt", FLOATS)
def test_tiny_decode_kv_cache_graph_replay(rng, dt):
    """Decode steps with kv_write at `pos` into a state cache; from the second step on the
    runner replays a CUDA graph. Every step is compared with the numpy backend."""
    B, hid, H, KVH, D, I, CTX = 2, 64, 4, 2, 16, 128, 32
    pv, shapes = tiny_params(rng, hid, H, KVH, D, I, dt)

    def f(m):
        x = m.input("x", (B, 1, hid), dt)
        pos = m.input("pos", (B,), I32)
        p = {n: m.param(n, s, dt) for n, s in shapes.items()}
        cos, sin = m.input("cos", (B, 1, D // 2)), m.input("sin", (B, 1, D // 2))
        cache = (m.state("cache_k", (B, KVH, CTX, D), dt), m.state("cache_v", (B, KVH, CTX, D), dt))
        return tiny_layer(m, x, p, H, KVH, D, cos, sin, cache=cache, pos=pos)
    g = Graph.define("dec", f)
    exes = {name: rlx_core.compile(g, backend=name, params=pv) for name in ("numpy", "cuda")}
    from rlx_backend_cuda import set_config

    try:
        for t in range(8):
            # the last steps: cuBLAS and the unfused SwiGLU launch; every other step's kernels
            # launch as programmatic dependents
            set_config(gemv=t < 6, dependent_launch=t % 2 == 0)
            pos = np.array([t, t + 3], np.int32)
            ang = pos[:, None, None] * (0.3 + np.arange(D // 2))[None, None, :] * 0.1
            ins = {"x": rand(rng, (B, 1, hid), dt), "pos": pos, "cos": np.cos(ang).astype(np.float32),
                   "sin": np.sin(ang).astype(np.float32)}
            outs = {n: e.run(dict(ins))["out"] for n, e in exes.items()}
            assert err(outs["cuda"], outs["numpy"]) <= TOL[dt], f"step {t}"
            kc = exes["cuda"].backend.to_host(exes["cuda"].states["cache_k"])
            kn = np.asarray(exes["numpy"].states["cache_k"])
            assert err(kc, kn) <= TOL[dt]
    finally:
        set_config(gemv=True, dependent_launch=True)
    runner = next(iter(exes["cuda"]._runners.values()))
    d = runner.describe()
    assert d["graph"], f"decode was not replayed as a CUDA graph: {d}"
    # fused by the runner: one launch ropes q and k and writes k and v into the caches, the
    # 16-bit gate/up GEMV computes the SwiGLU, attention merges its splits in one launch
    ops = d["steps_by_op"]
    assert ops.get("rope") == 1 and "kv_write" not in ops, ops
    assert ("fused_swiglu" in ops) is (dt not in (F16, BF16)), ops
    assert ops.get("attention") == 1 and "transpose" not in ops, ops


@gpu
def test_a_greedy_fetch_replays_a_graph_without_the_logits_launches(rng):
    """A run fetching only the arg-max ids skips the launches that reach nothing but the
    unfetched logits and their sum (one CUDA graph per skipped set); a run fetching
    everything computes them again, equal to the numpy backend's."""
    hid, vocab = 64, 1000

    def f(m):
        z = m.linear(m.input("x", (2, 1, hid), BF16), m.param("head", (vocab, hid), BF16))
        return {"logits": m.cast(z, "f32"), "next_ids": m.argmax(z),
                "logits_sum": m.cast(m.sum(z, (-1,)), "f32")}
    g = Graph.define("greedy", f)
    pv = {"head": rand(rng, (vocab, hid), BF16)}
    exes = {name: rlx_core.compile(g, backend=name, params=pv) for name in ("numpy", "cuda")}
    for fetch in [("next_ids",)] * 3 + [None, ("next_ids",)]:
        ins = {"x": rand(rng, (2, 1, hid), BF16)}
        want = exes["numpy"].run(dict(ins))
        got = exes["cuda"].run(dict(ins), fetch=fetch)
        assert set(got) == set(fetch or want)
        picked = np.take_along_axis(want["logits"][:, 0], got["next_ids"], axis=1)[:, 0]
        top = want["logits"].max(axis=(1, 2))              # (within bf16's rounding of the logits)
        assert np.all(picked >= top - 0.02 * np.abs(top)), (got["next_ids"], want["next_ids"])
        if fetch is None:
            assert err(got["logits"], want["logits"]) <= TOL[BF16]
            assert err(got["logits_sum"], want["logits_sum"]) <= 2 * TOL[BF16]
    runner = next(iter(exes["cuda"]._runners.values()))
    # the logits' cast and the reduce (whose store does the sum's cast: ops._reduce_epilogue)
    assert sorted(len(k) for k in runner.graphs) == [0, 2], runner.describe()


@gpu
@pytest.mark.parametrize("dt", [F32, BF16])
def test_prefill_attends_fresh_k_and_fills_the_cache(rng, dt):
    """Prefill's pattern: attention reads the roped k itself while kv_write stores it (and v)
    at pos. The rope launch that also writes the caches must not read its own output."""
    B, H, KVH, S, D, CTX = 2, 4, 2, 5, 16, 12

    def f(m):
        q, k, v = (m.input(n, (B, h, S, D), dt) for n, h in (("q", H), ("k", KVH), ("v", KVH)))
        pos = m.input("pos", (B,), I32)
        cos, sin = m.input("cos", (S, D // 2)), m.input("sin", (S, D // 2))
        qr, kr = m.rope(q, cos, sin), m.rope(k, cos, sin)
        kc = m.kv_write(m.state("ck", (B, KVH, CTX, D), dt), kr, pos)
        vc = m.kv_write(m.state("cv", (B, KVH, CTX, D), dt), v, pos)
        return {"out": m.attention(qr, kr, v, mask_kind=MaskKind.CAUSAL), "kc": kc, "vc": vc}
    ang = rng.uniform(0, 6, (S, D // 2))
    ins = {"q": rand(rng, (B, H, S, D), dt), "k": rand(rng, (B, KVH, S, D), dt),
           "v": rand(rng, (B, KVH, S, D), dt), "pos": np.array([0, 4], np.int32),
           "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    zeros = {n: np.zeros((B, KVH, CTX, D), dt.np) for n in ("ck", "cv")}
    compare(Graph.define("prefill", f), ins, dt, states=zeros)     # one run: a race shows


# ----------------------------------------------------------------------------- bad input
@gpu
def test_out_of_memory_names_bytes():
    from rlx_backend_cuda import device

    with pytest.raises(BackendError, match=r"out of GPU memory allocating \d+ bytes.*\d+ bytes free"):
        device.alloc(1 << 50, "a test buffer")


def test_every_kernel_waits_for_the_kernel_before_it():
    """Launched as programmatic dependents (device.Kernel), kernels must wait for the kernel
    before them before reading its results: each catalog kernel gets one RLX_GRID_WAIT()
    (the GEMVs, the RMSNorm, the split and decode attention and the Gated DeltaNet step place their own,
    after their first loads of what no kernel of the run writes or an L2 prefetch), and no
    line moves."""
    from rlx_backend_cuda import kernels_catalog, sources

    for name, src, kname in kernels_catalog.catalog():
        out = sources.with_grid_wait(src, kname)
        assert out.count("RLX_GRID_WAIT();") == 1, name
        assert out.count("\n") == src.count("\n"), name
        body = out[out.index(f" {kname}("):]
        assert "RLX_GRID_WAIT();" in body, name
        placed = kname in ("rlx_gemv", "rlx_gemv_tc", "rlx_dq_gemv", "rlx_gdn_net", "rlx_rms_norm",
                           "rlx_attn_split", "rlx_attn_decode")
        assert ("{ RLX_GRID_WAIT();" in body) is not placed, name


@gpu
def test_compile_error_names_op_and_line():
    from rlx_backend_cuda import device

    src = 'extern "C" __global__ void k(float* x) {\n  x[0] = undefined_thing;\n}\n'
    with pytest.raises(BackendError, match=r"(?s)op 'my_op'.*line 2: x\[0\] = undefined_thing"):
        device.kernel(src, "k", "my_op")


@gpu
def test_complex_values_take_arithmetic_and_name_what_they_cannot(rng):
    """c64 inputs and outputs, + - * / with complex and real operands, negation; an op
    without complex support fails when the runner is built, naming it."""
    def c64(*dims):
        return (rng.standard_normal(dims) + 1j * rng.standard_normal(dims)).astype(np.complex64)

    def f(m):
        a, b, r = m.input("a", (3, 4), DType.C64), m.input("b", (4,), DType.C64), m.input("r", (3, 1))
        return -(a * b - b / (a + 2.0)) * r
    a, b, r = c64(3, 4), c64(4), rng.standard_normal((3, 1)).astype(np.float32)
    want = -(a.astype(np.complex128) * b - b / (a + 2.0)) * r
    for profile in (UNFUSED, None):
        got = rlx_core.compile(Graph.define("c", f), profile=profile, backend="cuda").run(
            {"a": a, "b": b, "r": r})["out"]
        assert got.dtype == np.complex64
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g = Graph.define("s", lambda m: m.sum(m.input("x", (3,), DType.C64), (0,)))
    with pytest.raises(RlxError, match=r"\(reduce\) computes in complex64"):
        rlx_core.compile(g, profile=UNFUSED, backend="cuda").runner({})
    g = Graph.define("e", lambda m: m.exp(m.input("x", (3,), DType.C64)))
    with pytest.raises(RlxError, match=r"activation 'exp' on complex64"):
        rlx_core.compile(g, profile=UNFUSED, backend="cuda").run({"x": c64(3)})


@gpu
def test_device_errors_are_model_errors(rng):
    g = Graph.define("g", lambda m: m.gather(m.input("t", (4, 3)), m.input("i", (2,), I64)))
    exe = rlx_core.compile(g, backend="cuda")
    with pytest.raises(ModelError, match="out of range"):
        exe.run({"t": np.ones((4, 3), np.float32), "i": np.array([1, 9])})
    out = exe.run({"t": np.ones((4, 3), np.float32), "i": np.array([1, 3])})   # flag was reset
    assert out["out"].shape == (2, 3)

    def f(m):
        c = m.state("c", (1, 2, 4, 3))
        return m.kv_write(c, m.input("n", (1, 2, 2, 3)), m.input("p", (1,), I32))
    exe = rlx_core.compile(Graph.define("kv", f), backend="cuda")
    with pytest.raises(ModelError, match="context full"):
        exe.run({"n": np.ones((1, 2, 2, 3), np.float32), "p": np.array([3], np.int32)})

    def roped(m):           # the rope that writes straight into the cache checks it too
        c = m.state("c", (1, 2, 4, 4))
        k = m.rope(m.input("n", (1, 2, 1, 4)), m.input("cos", (1, 2)), m.input("sin", (1, 2)))
        return m.kv_write(c, k, m.input("p", (1,), I32))
    exe = rlx_core.compile(Graph.define("kv_rope", roped), backend="cuda")
    ins = {"n": np.ones((1, 2, 1, 4), np.float32), "cos": np.ones((1, 2), np.float32),
           "sin": np.zeros((1, 2), np.float32)}
    assert exe.run(dict(ins, p=np.array([3], np.int32)))["out"][0, :, 3].tolist() == [[1.0] * 4] * 2
    with pytest.raises(ModelError, match=r"kv_write\): kv_write: writing at position 4 .*context full"):
        exe.run(dict(ins, p=np.array([4], np.int32)))


@gpu
def test_params_and_cache_stay_on_device(rng):
    from rlx_backend_cuda import CudaArray

    w = rand(rng, (8, 8), F32)
    g = Graph.define("p", lambda m: m.linear(m.input("x", (1, 8)), m.param("w", (8, 8))))
    exe = rlx_core.compile(g, backend="cuda", params={"w": w})
    assert all(isinstance(v, CudaArray) for v in exe._params.values())
    out = exe.run({"x": np.ones((1, 8), np.float32)})["out"]
    np.testing.assert_allclose(out, np.ones((1, 8)) @ w.T, rtol=1e-5, atol=1e-5)
