"""gated_delta_rule and causal_conv1d on CUDA's own kernels (rlx_backend_cuda/deltanet.py):
against the step-by-step float64 references of rlx_core.testing.ops_suite_deltanet, outputs
poisoned first, at a Qwen3.5-like head shape (K = V = 128, 2 value heads a key head) and an
odd one (K = 48, V = 72: partial warps, column groups and tiles) and one the tensor-core
kernels take with 16-column state blocks (K = 64, V = 48), decode (T = 1 from a nonzero state:
the recurrent kernel) and prefills past two chunks (the chunked kernels from T =
GDN_CHUNKED_MIN: on tensor cores for f16/bf16, f32 FMA otherwise; f64 stays recurrent), every
float dtype; long prefills (T = 4096 and 4099, a partial last chunk) and a state leaf written
in place; the chunked form's outputs independent of the chunk length (and of the kernels:
bf16 on tensor cores against the FMA kernels); a decode loop over a state leaf equals one
prefill. Skipped with the backend's reason without a GPU; the tensor-core chunked kernels also
run emulated on the CPU (cuda_emu)."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from test_cuda import gpu

import rlx_core
from rlx_core.ir.dtype import BF16, F16, F32, F64
from rlx_core.ir.graph import Graph
from rlx_core.testing.ops_suite_deltanet import conv_args, ref_causal_conv1d, ref_gated_delta_rule
from rlx_core.testing.parity import Arg, exact, rand, run_parity


def _unit(rng, dims, dt):
    x = rng.normal(size=dims)
    return exact(x / np.linalg.norm(x, axis=-1, keepdims=True), dt)


def _gdn_args(rng, b, t, hk, h, kd, vd, dt, state_kind="input"):
    return [Arg("q", _unit(rng, (b, t, hk, kd), dt), dt), Arg("k", _unit(rng, (b, t, hk, kd), dt), dt),
            Arg("v", rand(rng, (b, t, h, vd), dt), dt), Arg("g", rand(rng, (b, t, h), dt, -1.0, 0.0), dt),
            Arg("beta", rand(rng, (b, t, h), dt, 0.0, 1.0), dt),
            Arg("state", rand(rng, (b, h, kd, vd), dt, -1.0, 1.0), dt, state_kind)]


SHAPES = {"qwen35": (1, 2, 4, 128, 128), "odd": (2, 1, 3, 48, 72),      # b, hk, h, kd, vd
          "tc16": (2, 2, 4, 64, 48)}


@gpu
@pytest.mark.parametrize("dt", [F32, F16, BF16, F64], ids=lambda d: d.value)
@pytest.mark.parametrize("t", [1, 150], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gated_delta_rule(rng, dt, t, shape):
    b, hk, h, kd, vd = SHAPES[shape]
    scale = kd ** -0.5
    run_parity("cuda", "gated_delta_rule", _gdn_args(rng, b, t, hk, h, kd, vd, dt),
               {"scale": scale, "chunk": 64}, lambda *a: ref_gated_delta_rule(*a, scale=scale))


@gpu
@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=lambda d: d.value)
@pytest.mark.parametrize("t", [64, 4096, 4099], ids=lambda t: f"T{t}")
def test_gated_delta_rule_long_prefill_in_place(rng, dt, t):
    """The chunked kernels over many chunks (T = 4099: a last chunk of 3 steps; T = 64: the
    shortest chunked call, one whole chunk), GQA heads, the state a leaf the op writes."""
    b, hk, h, kd, vd = SHAPES["qwen35"]
    run_parity("cuda", "gated_delta_rule", _gdn_args(rng, b, t, hk, h, kd, vd, dt, "state"),
               {"scale": 0.3, "chunk": 64}, lambda *a: ref_gated_delta_rule(*a, scale=0.3))


@gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gated_delta_rule_chunk_length_does_not_change_results(rng, shape):
    """Chunks of 16, 37 (not a power of two) and 64 steps: the same outputs and state within
    f32 rounding, each also against the float64 recurrence."""
    b, hk, h, kd, vd = SHAPES[shape]
    args = _gdn_args(rng, b, 300, hk, h, kd, vd, F32)
    want = ref_gated_delta_rule(*(a.data for a in args), scale=0.25)
    got = {}
    for chunk in (16, 37, 64):
        def build(m):
            ins = [m.input(a.name, a.data.shape, F32) for a in args]
            o, s1 = m.add("gated_delta_rule", ins, scale=0.25, chunk=chunk)
            return {"o": o, "state": s1}
        ex = rlx_core.compile(Graph.define(f"gdn_chunk{chunk}", build), backend="cuda")
        out = ex.run({a.name: a.data.astype(np.float32) for a in args})
        got[chunk] = [ex.backend.to_host(out[k]) for k in ("o", "state")]
        for x, w in zip(got[chunk], want):
            np.testing.assert_allclose(x, w, rtol=2e-4, atol=2e-4 * np.abs(w).max())
    for chunk in (16, 37):
        for x, y in zip(got[chunk], got[64]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * np.abs(y).max())


def _run_gdn(args, dt, chunk, scale):
    def build(m):
        ins = [m.input(a.name, a.data.shape, dt) for a in args]
        o, s1 = m.add("gated_delta_rule", ins, scale=scale, chunk=chunk)
        return {"o": o, "state": s1}
    ex = rlx_core.compile(Graph.define(f"gdn_{dt.value}_{chunk}", build), backend="cuda")
    out = ex.run({a.name: a.data.astype(dt.np) for a in args})
    return [ex.backend.to_host(out[k]).astype(np.float64) for k in ("o", "state")]


@gpu
@pytest.mark.parametrize("dt", [F16, BF16], ids=lambda d: d.value)
@pytest.mark.parametrize("shape,bv", [("qwen35", 16), ("qwen35", 32), ("tc16", 32)])
def test_tensor_core_kernels_agree_with_fma_kernels(rng, monkeypatch, dt, shape, bv):
    """16-bit data over 5 chunks and a partial one: chunk 64 runs the tensor-core kernels
    (their scan kernel is compiled; its blocks hold `bv` state columns, 16 where V = 48 needs),
    chunk 32 the f32 FMA ones; each within the dtype's tolerance of the float64 recurrence,
    and of each other."""
    from rlx_backend_cuda import deltanet, device
    monkeypatch.setattr(deltanet, "GDN_TC_BV", bv)
    b, hk, h, kd, vd = SHAPES[shape]
    args = _gdn_args(rng, b, 5 * 64 + 17, hk, h, kd, vd, dt)
    want = ref_gated_delta_rule(*(a.data.astype(np.float64) for a in args), scale=0.3)
    tc = _run_gdn(args, dt, 64, 0.3)
    assert any(name == "rlx_gdn_tc_scan" for _, name in device._KERNELS), "the tensor-core kernels are unused"
    fma = _run_gdn(args, dt, 32, 0.3)
    for got in (tc, fma):
        for x, w in zip(got, want):
            np.testing.assert_allclose(x, w, rtol=1e-2, atol=1e-2 * np.abs(w).max())
    for x, y in zip(tc, fma):
        np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2 * np.abs(y).max())


@gpu
def test_decode_steps_on_a_state_leaf_equal_one_prefill(rng):
    """Eight one-token runs of one compiled graph, the state written back into its leaf,
    give the outputs and final state of one 8-token call (the decode path in place)."""
    b, hk, h, kd, vd = SHAPES["odd"]
    args = _gdn_args(rng, b, 8, hk, h, kd, vd, F32)
    q, k, v, g, beta, s0 = (a.data for a in args)

    def build(m):
        ins = [m.input(n, (b, 1) + x.shape[2:], F32) for n, x in zip("q k v g beta".split(), (q, k, v, g, beta))]
        st = m.state("state", s0.shape, F32)
        o, s1 = m.add("gated_delta_rule", (*ins, st), scale=0.3, chunk=64)
        m.assign(st, s1)
        return {"o": o}
    ex = rlx_core.compile(Graph.define("gdn_decode", build), backend="cuda")
    assert "gated_delta_rule" in {n.op for n in ex.mir.nodes}
    ex.states["state"] = ex.backend.to_device(s0.astype(np.float32))
    outs = [ex.backend.to_host(ex.run({n: x[:, i:i + 1].astype(np.float32) for n, x in
                                       zip("q k v g beta".split(), (q, k, v, g, beta))})["o"]) for i in range(8)]
    want_o, want_s = ref_gated_delta_rule(q, k, v, g, beta, s0, scale=0.3)
    np.testing.assert_allclose(np.concatenate(outs, 1), want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ex.backend.to_host(ex.states["state"]), want_s, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=lambda d: d.value)
@pytest.mark.parametrize("t", [1, 2, 33], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("width", [2, 4], ids=lambda w: f"W{w}")
def test_causal_conv1d(rng, dt, t, width):
    """Channels past one block (200), T past one thread's run of steps with a partial last
    run (33), and T shorter than the state (2: windows mixing state and input)."""
    args = conv_args(rng, t, dt, width=width, channels=200)
    run_parity("cuda", "causal_conv1d", args, {"act": "silu"}, lambda *a: ref_causal_conv1d(*a, act="silu"))


@gpu
@pytest.mark.parametrize("dt", [F32, BF16], ids=lambda d: d.value)
@pytest.mark.parametrize("t", [2, 40], ids=lambda t: f"T{t}")
def test_causal_conv1d_reads_a_column_slice_in_place(rng, dt, t):
    """x a column slice of a wider input (as Qwen3.5's conv reads its part of the fused
    projection): the kernels read it through its strides, outputs and new state as the
    float64 reference on the slice."""
    b, c, extra, width = 2, 200, 24, 4
    wide = rand(rng, (b, t, c + extra), dt)
    w, st = rand(rng, (c, width), dt, -1, 1), rand(rng, (b, c, width - 1), dt)

    def build(m):
        x = m.narrow(m.input("wide", wide.shape, dt), 2, 8, c)
        y, s1 = m.add("causal_conv1d", (x, m.input("w", w.shape, dt), m.input("state", st.shape, dt)), act="silu")
        return {"y": y, "state": s1}
    ex = rlx_core.compile(Graph.define(f"conv_slice_{dt.value}_{t}", build), backend="cuda")
    out = ex.run({"wide": wide.astype(dt.np), "w": w.astype(dt.np), "state": st.astype(dt.np)})
    want = ref_causal_conv1d(*(a.astype(np.float64) for a in (wide[:, :, 8:8 + c], w, st)), act="silu")
    tol = 1e-5 if dt is F32 else 2e-2
    for k, ref in zip(("y", "state"), want):
        np.testing.assert_allclose(ex.backend.to_host(out[k]).astype(np.float64), ref, rtol=tol, atol=tol)


@cuda_emu.emulated
@pytest.mark.parametrize("dt", [F16, BF16], ids=lambda d: d.value)
def test_emulated_tensor_core_chunked_rule(rng, dt):
    """The tensor-core chunked kernels (rlx_gdn_tc_prep, _scan, _out) run on the CPU, their
    mma.sync, ldmatrix and cp.async as cuda_emu's warp collectives, launched as
    deltanet._chunked_tc launches them: two chunks and a partial one, two value heads a key
    head, 16 state columns a walk's block, from a nonzero state; within the dtype's tolerance
    of the float64 recurrence (the same bound as the GPU test's)."""
    from rlx_backend_cuda import deltanet, sources
    from rlx_backend_cuda.codegen import ctype

    b, hk, h, kd, vd, t, bv, scale = 1, 1, 2, 32, 32, 2 * 64 + 17, 16, 0.3
    args = _gdn_args(rng, b, t, hk, h, kd, vd, dt)
    q, k, v, g, beta, s0 = (cuda_emu.aligned(a.data.astype(dt.np)) for a in args)
    c = deltanet.GDN_TC_CHUNK
    nch = -(-t // c)
    wbuf, ubuf = (cuda_emu.aligned(np.zeros((b, h, nch * c, n), dt.np)) for n in (kd, vd))
    cbuf, hbuf = np.zeros((b, h, nch * c), np.float32), cuda_emu.aligned(np.zeros((b, h, nch, kd, vd), dt.np))
    o, s1 = cuda_emu.aligned(np.zeros(v.shape, dt.np)), cuda_emu.aligned(np.zeros(s0.shape, dt.np))
    mm = {"T": ctype(dt), "MMAT": "bf16" if dt is BF16 else "f16", "KD": kd, "VD": vd}
    sm_prep, sm_scan, sm_out = deltanet._tc_smem(kd, vd, bv)
    common = (np.int32(t), np.int32(h), np.int32(hk))
    cuda_emu.compile_kernel(sources.render(sources.GDN_TC_PREP, **mm), "rlx_gdn_tc_prep").launch(
        (nch, h, b), (128,), (k, v, g, beta, wbuf, ubuf, cbuf, *common), sm_prep)
    cuda_emu.compile_kernel(sources.render(sources.GDN_TC_SCAN, BV=bv, **mm), "rlx_gdn_tc_scan").launch(
        (vd // bv, h, b), (128,), (k, wbuf, ubuf, cbuf, s0, s1, hbuf, *common, np.int32(nch)), sm_scan)
    cuda_emu.compile_kernel(sources.render(sources.GDN_TC_OUT, **mm), "rlx_gdn_tc_out").launch(
        (nch, h, b), (128,), (q, k, ubuf, cbuf, hbuf, o, *common, np.float32(scale)), sm_out)
    want = ref_gated_delta_rule(*(a.data.astype(np.float64) for a in args), scale=scale)
    for got, w in zip((o, s1), want):
        np.testing.assert_allclose(got.astype(np.float64), w, rtol=1e-2, atol=1e-2 * np.abs(w).max())
