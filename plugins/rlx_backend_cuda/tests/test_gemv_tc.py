"""The tensor-core decode GEMV (sources.GEMV_TC, ops.GEMV_TC) for 3 to 64 x rows: W streamed into
mma.sync's fragments, x's rows staged in shared memory, K split across blocks whose f32 sums the
last block of each column adds in k order; the SwiGLU of a gate/up product in its store. Emulated
on the CPU (cuda_emu) against float64 at row counts, widths and depths that are no multiple of the
kernel's tiles, with and without the split; dry-built (a batch-32 layer's launches); through the
backend on a GPU against float64 and against cuBLAS (the switch off)."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from cuda_dry import dry, leaves, planned  # noqa: F401  (the fixture)
from test_cuda import gpu
from test_gemv_fusion import rel
from test_int8_gemv import _described, _llama_layer

import rlx_core
from rlx_core.ir.dtype import BF16, F16
from rlx_core.ir.graph import Graph

TYPES = {BF16: ("__nv_bfloat16", "bf16"), F16: ("__half", "f16")}


def _kernel(dt, M: int, swiglu: int = 0):
    from rlx_backend_cuda import codegen, ops, sources

    t, mmat = TYPES[dt]
    src = sources.render(sources.GEMV_TC, T=t, TO=t, MMAT=mmat, MT=-(-M // 8), KC=ops.GEMV_TC_KC, EARLY=1,
                         SWIGLU=swiglu, SWIGLU_OF=codegen.swiglu_of("float"))
    return cuda_emu.compile_kernel(src, "rlx_gemv_tc")


@cuda_emu.emulated
@pytest.mark.parametrize("dt", [BF16, F16], ids=lambda d: d.value)
@pytest.mark.parametrize("M,N,K,kb", [(3, 200, 96, 96), (17, 130, 352, 128), (32, 128, 320, 96),
                                     (40, 100, 128, 64)],
                         ids=["3rows", "17rows-split", "32rows-split-tail", "40rows-split-two-passes"])
def test_emulated_gemv_tc_matches_float64(rng, dt, M, N, K, kb):
    """x rows of stride K + 40 (not contiguous), W [N, K]; kb < K: the K split, its last part
    shorter than the others (at 40 rows the last block adds a thread's 20 outputs in two passes);
    the counters are zero again after the launch and a second launch gives the same bits (the
    sums added in a fixed order)."""
    x = cuda_emu.aligned(rng.standard_normal((M, K + 40)).astype(dt.np))
    w = cuda_emu.aligned((rng.standard_normal((N, K)) / 8).astype(dt.np))
    parts, blocks = -(-K // kb), -(-N // 128)
    ws = cuda_emu.aligned(np.full((parts, M, N), np.nan, np.float32))
    counters = np.zeros(blocks, np.int32)
    outs = []
    for _ in range(2):
        y = cuda_emu.aligned(np.zeros((M, N), dt.np))
        _kernel(dt, M).launch((blocks, parts), (256,), (x, np.int64(K + 40), w, y, np.int32(M), np.int32(N),
                                                        np.int32(K), np.int32(kb), ws, counters))
        outs.append(y)
        assert not counters.any()
    want = x[:, :K].astype(np.float64) @ w.astype(np.float64).T
    assert rel(outs[0], want) < (1e-2 if dt is BF16 else 2e-3)
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


@cuda_emu.emulated
@pytest.mark.parametrize("kb", [320, 96], ids=["whole", "split"])
def test_emulated_gemv_tc_swiglu(rng, kb):
    """SWIGLU: W [2N, K] (gate rows, then up rows), y = silu(gate) * up, both rounded to bf16 first
    as the unfused product is; N = 100 (a partial block of 64 outputs), 11 rows of x."""
    M, N, K, dt = 11, 100, 320, BF16
    x = cuda_emu.aligned(rng.standard_normal((M, K)).astype(dt.np))
    w = cuda_emu.aligned((rng.standard_normal((2 * N, K)) / 8).astype(dt.np))
    parts, blocks = -(-K // kb), -(-N // 64)
    ws = cuda_emu.aligned(np.zeros((parts, M, 2 * N), np.float32))
    y, counters = cuda_emu.aligned(np.zeros((M, N), dt.np)), np.zeros(blocks, np.int32)
    _kernel(dt, M, swiglu=1).launch((blocks, parts), (256,), (x, np.int64(K), w, y, np.int32(M), np.int32(N),
                                                              np.int32(K), np.int32(kb), ws, counters))
    z = (x.astype(np.float64) @ w.astype(np.float64).T).astype(dt.np).astype(np.float64)
    gate, up = z[:, :N], z[:, N:]
    assert rel(y, gate / (1 + np.exp(-gate)) * up) < 1e-2
    assert not counters.any()


def _products(rng, dt, rows: int, K: int, N: int):
    def f(m):
        x = m.input("x", (rows, 1, K), dt)
        return {"y": m.linear(x, m.param("w", (N, K), dt)), "z": m.linear(x, m.param("v", (N // 2, K), dt))}
    params = {"w": (rng.standard_normal((N, K)) / 16).astype(dt.np),
              "v": (rng.standard_normal((N // 2, K)) / 16).astype(dt.np)}
    return Graph.define("gemv_tc", f), params, {"x": rng.standard_normal((rows, 1, K)).astype(dt.np)}


@gpu
@pytest.mark.parametrize("dt", [BF16, F16], ids=lambda d: d.value)
@pytest.mark.parametrize("rows,K,N", [(3, 2048, 1000), (32, 4096, 2048), (64, 512, 30000)])
def test_gemv_tc_matches_float64_and_cublas(rng, dt, rows, K, N):
    """x [rows, 1, K] @ two weights: the tensor-core GEMV (a K split at the first two shapes, none
    for the wide one) within the dtype's rounding of float64, and close to cuBLAS's products."""
    from rlx_backend_cuda import set_config
    from rlx_backend_cuda.values import CONFIG

    g, params, ins = _products(rng, dt, rows, K, N)
    x = ins["x"].astype(np.float64).reshape(rows, K)
    was = CONFIG["gemv_tc"]
    got = {}
    try:
        for on in (True, False):
            set_config(gemv_tc=on)
            exe = rlx_core.compile(g, backend="cuda", params=params)
            got[on] = [{k: exe.backend.to_host(v) for k, v in exe.run(dict(ins)).items()} for _ in range(2)]
            steps = _described(exe)
            assert steps["steps_by_op"].get("matmul") == 1, steps     # (the two weights concatenated)
    finally:
        set_config(gemv_tc=was)
    tol = 1e-2 if dt is BF16 else 2e-3
    for name in ("y", "z"):
        want = x @ params["w" if name == "y" else "v"].astype(np.float64).T
        for on in (True, False):
            for run in got[on]:
                assert rel(np.asarray(run[name], np.float64).reshape(want.shape), want) < tol, (name, on)
        tc, blas = (np.asarray(got[on][0][name], np.float64) for on in (True, False))
        assert rel(tc, blas) < tol


@gpu
@pytest.mark.parametrize("rows", [5, 32])
def test_gemv_tc_writes_the_swiglu(rng, rows):
    """An MLP, down(silu(x Wg) * (x Wu)), at 5 and 32 rows: the gate/up product writes the
    SwiGLU (no fused_swiglu step of its own), within bf16's rounding of float64, with the
    tensor-core GEMV on and off (cuBLAS and the SwiGLU's own launch)."""
    from rlx_backend_cuda import set_config
    from rlx_backend_cuda.values import CONFIG

    hid, inter = 512, 1408
    dt = BF16

    def f(m):
        x = m.input("x", (rows, 1, hid), dt)
        return {"y": m.swiglu(x, m.param("wg", (inter, hid), dt), m.param("wu", (inter, hid), dt),
                              m.param("wd", (hid, inter), dt))}
    params = {k: (rng.standard_normal(s) / 16).astype(dt.np)
              for k, s in (("wg", (inter, hid)), ("wu", (inter, hid)), ("wd", (hid, inter)))}
    ins = {"x": rng.standard_normal((rows, 1, hid)).astype(dt.np)}
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x = ins["x"].astype(np.float64).reshape(rows, hid)
    gate, up = x @ p["wg"].T, x @ p["wu"].T
    want = (gate / (1 + np.exp(-gate)) * up) @ p["wd"].T
    was = CONFIG["gemv_tc"]
    try:
        for on in (True, False):
            set_config(gemv_tc=on)
            exe = rlx_core.compile(Graph.define("mlp", f), backend="cuda", params=params)
            got = np.asarray(exe.backend.to_host(exe.run(dict(ins))["y"]), np.float64).reshape(want.shape)
            assert "fused_swiglu" not in _described(exe)["steps_by_op"], _described(exe)
            assert rel(got, want) < 2e-2, on
    finally:
        set_config(gemv_tc=was)


def test_a_batch_32_layer_runs_its_products_on_the_tensor_core_gemv(rng, dry):
    """(No GPU: cuda_dry's build on stand-ins.) A bf16 decode layer at batch 32: its five products
    are rlx_gemv_tc launches, the gate/up one writing the SwiGLU (no launch of its own), while the
    switch is on; off, cuBLAS runs them and the SwiGLU is an elementwise launch again."""
    from rlx_backend_cuda import set_config
    from rlx_backend_cuda.values import CONFIG

    lir = planned(Graph.define("b32_layer", lambda m: _llama_layer(m, bs=32, scheme=None)))
    runner = dry(lir, *leaves(lir, rng))
    assert "fused_swiglu" not in runner.describe()["steps_by_op"]
    was = CONFIG["gemv_tc"]
    launched = {}
    try:
        for on in (True, False):
            set_config(gemv_tc=on)
            before = {id(k): len(k.launches) for k in dry.kernels}
            for st in runner.steps:
                st.fn()
            launched[on] = [k for k in dry.kernels for _ in range(len(k.launches) - before.get(id(k), 0))]
    finally:
        set_config(gemv_tc=was)
    tc = [k for k in launched[True] if k.name == "rlx_gemv_tc"]
    swiglu = sorted("#define SWIGLU 1" in k.source for k in tc)
    assert len(tc) == 5 and swiglu == [False] * 4 + [True], [k.name for k in launched[True]]
    assert all("#define MT 4" in k.source for k in tc)
    assert not any(k.name == "rlx_gemv_tc" for k in launched[False])
    ew = {on: [k for k in launched[on] if k.name == "rlx_ew"] for on in launched}
    assert len(ew[False]) == len(ew[True]) + 1, (ew, launched)
