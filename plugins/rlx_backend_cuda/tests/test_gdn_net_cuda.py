"""gated_delta_net on CUDA's one-launch kernel (kernels/gdn_net.cu) against the float64
reference of rlx_core.testing.ops_suite_deltanet, outputs poisoned first: a Qwen3.5-like head
shape (K = V = 128, 2 value heads a key head: two heads' columns in one block), an odd one
(K = 48, V = 72, 3 value heads a key head: partial warps and columns straddling heads), a
decode step and a few steps, every float dtype; both states as leaves written in place over a
decode loop (equal to one call over all steps); x, z, b and a column slices of one projection
output (as Qwen3.5's decode graph gives them: read through their strides). Skipped with the
backend's reason without a GPU; the kernel also runs emulated on the CPU (cuda_emu) against the
same reference."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from test_cuda import gpu

import rlx_core
from rlx_core.ir.dtype import BF16, F16, F32, F64
from rlx_core.ir.graph import Graph
from rlx_core.testing.ops_suite_deltanet import ref_gated_delta_net
from rlx_core.testing.parity import TOL, Arg, exact, rand, run_parity

SHAPES = {"qwen35": (1, 2, 4, 128, 128), "odd": (2, 1, 3, 48, 72)}      # b, hk, h, kd, vd
SCALE, EPS = 0.3, 1e-6


def _arrays(rng, b, t, hk, h, kd, vd, dt, width=4) -> dict:
    c = 2 * hk * kd + h * vd
    return {"x": rand(rng, (b, t, c), dt), "conv_w": rand(rng, (c, width), dt, -1, 1),
            "conv_state": rand(rng, (b, c, width - 1), dt), "z": rand(rng, (b, t, h, vd), dt),
            "b": rand(rng, (b, t, h), dt, -3, 3), "a": rand(rng, (b, t, h), dt, -2, 2),
            "A_log": exact(np.log(rng.uniform(1, 16, h)), dt), "dt_bias": rand(rng, (h,), dt, -1, 1),
            "norm_w": rand(rng, (vd,), dt, 0.5, 1.5), "state": rand(rng, (b, h, kd, vd), dt, -1, 1)}


NAMES = ("x", "conv_w", "conv_state", "z", "b", "a", "A_log", "dt_bias", "norm_w", "state")


@gpu
@pytest.mark.parametrize("dt", [F32, F16, BF16, F64], ids=lambda d: d.value)
@pytest.mark.parametrize("t", [1, 3], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gated_delta_net(rng, dt, t, shape):
    arr = _arrays(rng, *SHAPES[shape][:1], t, *SHAPES[shape][1:], dt)
    args = [Arg(n, arr[n], dt) for n in NAMES]
    run_parity("cuda", "gated_delta_net", args, {"scale": SCALE, "eps": EPS},
               lambda *a: ref_gated_delta_net(*a, SCALE, EPS))


@gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_loop_on_state_leaves_from_column_slices(rng, shape):
    """Six one-token runs of one graph whose x, z, b and a are column slices of one input (the
    in-projection's output) and whose conv and recurrent states are leaves assigned in place:
    the outputs and both final states equal the reference's over all six steps."""
    b, hk, h, kd, vd = SHAPES[shape]
    steps = 6
    arr = _arrays(rng, b, steps, hk, h, kd, vd, F32)
    c = arr["x"].shape[2]
    wide = np.concatenate([arr["x"], arr["z"].reshape(b, steps, h * vd), arr["b"], arr["a"]], 2)

    def build(m):
        y = m.input("proj", (b, 1, wide.shape[2]), F32)
        x = m.narrow(y, 2, 0, c)
        z = m.reshape(m.narrow(y, 2, c, h * vd), (b, 1, h, vd))
        bl, al = m.narrow(y, 2, c + h * vd, h), m.narrow(y, 2, c + h * vd + h, h)
        leaves = [m.input(n, arr[n].shape, F32) for n in ("conv_w", "A_log", "dt_bias", "norm_w")]
        cst, st = m.state("conv", arr["conv_state"].shape, F32), m.state("rec", arr["state"].shape, F32)
        o, c1, s1 = m.add("gated_delta_net", (x, leaves[0], cst, z, bl, al, *leaves[1:], st), scale=SCALE, eps=EPS)
        m.assign(cst, c1)
        m.assign(st, s1)
        return {"o": o}
    ex = rlx_core.compile(Graph.define(f"gdn_net_decode_{shape}", build), backend="cuda")
    assert "gated_delta_net" in {n.op for n in ex.mir.nodes}
    ex.states["conv"] = ex.backend.to_device(arr["conv_state"].astype(np.float32))
    ex.states["rec"] = ex.backend.to_device(arr["state"].astype(np.float32))
    fixed = {n: arr[n].astype(np.float32) for n in ("conv_w", "A_log", "dt_bias", "norm_w")}
    outs = [ex.backend.to_host(ex.run(dict(fixed, proj=wide[:, i:i + 1].astype(np.float32)))["o"])
            for i in range(steps)]
    want_o, want_c, want_s = ref_gated_delta_net(*(arr[n] for n in NAMES), SCALE, EPS)
    np.testing.assert_allclose(np.concatenate(outs, 1), want_o, rtol=1e-4, atol=1e-4 * np.abs(want_o).max())
    np.testing.assert_allclose(ex.backend.to_host(ex.states["conv"]), want_c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ex.backend.to_host(ex.states["rec"]), want_s, rtol=1e-4, atol=1e-4)


# blocks a key head's columns spread over (a cluster): whole value heads a block (qwen35 2, odd 3),
# or parts of one whose norms meet across the cluster (qwen35 8: 32 columns; odd 6: 36)
CLUSTERS = [("qwen35", 1), ("qwen35", 2), ("qwen35", 8), ("odd", 1), ("odd", 3), ("odd", 6)]


def test_cluster_choice(monkeypatch):
    """net_cluster spreads few key heads over SMs that would idle, in one wave, by whole heads or
    equal parts of one; many heads (a batch) keep one block each."""
    from rlx_backend_cuda import sources
    from rlx_backend_cuda.sources import NET_BLOCK_COLUMNS, net_cluster

    monkeypatch.setattr(sources, "NET_CLUSTER", 8)
    for vd, r, blocks, sms in ((128, 1, 16, 132), (128, 2, 16, 132), (72, 3, 2, 132), (128, 1, 512, 132),
                               (128, 1, 40, 132), (64, 1, 1, 132)):
        cs = net_cluster(vd, r, blocks, sms)
        cols = r * vd // cs
        assert r * vd % cs == 0 and blocks * cs <= max(sms, blocks) and cs <= 8
        assert cols % vd == 0 or vd % cols == 0
        assert cs == 1 or cols >= NET_BLOCK_COLUMNS
    assert net_cluster(128, 1, 16, 132) == 8 and net_cluster(128, 1, 512, 132) == 1
    assert net_cluster(128, 1, 40, 132) == 2 and net_cluster(72, 3, 2, 132) == 6


@cuda_emu.emulated
@pytest.mark.parametrize("shape,cs,dt,t", [(s, cs, dt, t) for s, cs in CLUSTERS for dt in (F32, F16, BF16)
                                          for t in (1, 3) if cs == 1 or t == 3],
                         ids=lambda v: v.value if hasattr(v, "value") else str(v))
def test_emulated_gated_delta_net(rng, shape, cs, dt, t):
    """The kernel on the CPU (cuda_emu), launched as deltanet.build_gated_delta_net launches it
    over contiguous operands, a key head's columns in cs blocks of a cluster (whose states are
    written in place, as a decode step's: every block reads q's and k's conv rows, which rank 0
    rewrites): o and both new states against the float64 reference within the dtype's tolerance
    (no GPU needed; bf16 within TOL here is why the GPU test above no longer loosens it)."""
    from rlx_backend_cuda import sources
    from rlx_backend_cuda.codegen import ctype
    from rlx_backend_cuda.sources import net_layout

    b, hk, h, kd, vd = SHAPES[shape]
    arr = _arrays(rng, b, t, hk, h, kd, vd, dt)
    c, width = arr["x"].shape[2], arr["conv_w"].shape[1]
    lay = net_layout(kd, vd, h // hk, width, dt.np.itemsize, cs)
    src = sources.render(sources.GDN_NET, T=ctype(dt), ACC="float", KD=kd, VD=vd, R=h // hk, WID=width,
                         EARLY=int(t > 1), **lay)          # (the leaves loaded before the wait, and after)
    kern = cuda_emu.compile_kernel(src, "rlx_gdn_net")
    ins = [np.ascontiguousarray(arr[n], dt.np) for n in NAMES]          # (rand: values of dt, stored f64)
    want = ref_gated_delta_net(*[np.asarray(v, np.float64) for v in ins], SCALE, EPS)
    o = np.zeros((b, t, h, vd), dt.np)
    cs1, s1 = (ins[2], ins[9]) if cs > 1 else (np.zeros_like(ins[2]), np.zeros_like(ins[9]))
    i64, i32 = np.int64, np.int32
    strides = tuple(map(i64, (t * c, c, t * h * vd, h * vd, vd, t * h, h, t * h, h)))    # x, z, b, a
    kern.launch((hk * cs, b), (32 * lay["NW"],), (*ins[:3], cs1, *ins[3:10], s1, o, i32(t), i32(hk), *strides,
                                              np.float32(SCALE), np.float32(EPS)))
    tol = TOL[dt]
    for got, ref, what in zip((o, cs1, s1), want, ("o", "conv state", "state")):
        err = np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
        assert err <= tol, (what, err)
