"""The tensor-core decode GEMVs of Q4_K and Q6_K (dq.cu's TC: an mma's column n holds sub-block
n's sum apart, the weights enter as bf16 pairs 128 + b) against float64 on fresh random inputs,
at one bf16 x row: emulated on the CPU (tc.cu's mma with PTX's fragment layouts), in the plain,
norm, SwiGLU and residual forms, over K of one super-block a row, of one group a warp, and of
two a warp for some warps (the next loaded while this one's products run), Q6_K's rows only
2-byte aligned, rows not a multiple of 16, x with a mean far from 0 (the 128 taken back through
the sub-block sums); on a GPU, a decode graph with the form on and off."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from test_cuda import gpu
from test_int8_gemv import BF, _gemv_kernel, _launch, _norms

import rlx_core
from rlx_core import Graph
from rlx_core.ir.dtype import BF16, U8
from rlx_core.ir.quant import QuantScheme, quantize

BFT = "__nv_bfloat16"
ALIGN = {"q4_k": 16, "q6_k": 2}          # (the row alignment the emulated kernel assumes)


def _close(got, want, ulps: int = 1) -> None:
    """got (bf16) is want rounded to bf16 (within `ulps` of bf16's rounding: a value computed from
    two rounded ones), up to the float32 sums' error."""
    g = np.asarray(got, np.float64)
    np.testing.assert_allclose(g, want, rtol=ulps * 2 ** -8, atol=1e-4 * np.abs(want).max())


def _inputs(rng, s, n: int, k: int) -> tuple:
    w = quantize(rng.standard_normal((2 * n, k)).astype(np.float32), s)
    x = (rng.standard_normal((1, k)) + 3.0).astype(BF)
    return w, s.dequantize_reference(w, (2 * n, k)), x


def _kernel(s, k, **kw):
    return _gemv_kernel(s, BFT, 1, k, 0, tc=1, A=ALIGN[s.kind], **kw)


@cuda_emu.emulated
@pytest.mark.parametrize("name", list(ALIGN))
@pytest.mark.parametrize("k", [256, 1536, 2048])
def test_emulated_tc_gemv_matches_float64(rng, name, k):
    """Plain (every row of w), SwiGLU (gate rows, then up rows) and RESID (h = res + the
    product, h * w, h's squares summed) against float64."""
    n, s = 40, QuantScheme.parse(name)
    w, deq, x = _inputs(rng, s, n, k)
    x64 = x.astype(np.float64)
    y = np.zeros((1, 2 * n), BF)
    _launch(_kernel(s, k), x, w, y, 1, 2 * n, k, s)
    _close(y, x64 @ deq.T)
    y = np.zeros((1, n), BF)
    _launch(_kernel(s, k, swiglu=1), x, w, y, 1, n, k, s)
    gate, up = (x64 @ deq[:n].T).astype(BF).astype(np.float64), (x64 @ deq[n:].T).astype(BF).astype(np.float64)
    _close(y, gate / (1 + np.exp(-gate)) * up, ulps=4)      # (gate and up each 1 ulp either way)
    res, nw = rng.standard_normal((1, n)).astype(BF), rng.uniform(0.5, 1.5, n).astype(np.float32)
    h, yw, osq = np.zeros((1, n), BF), np.zeros((1, n), BF), np.zeros(32, np.float32)
    _launch(_kernel(s, k, resid=1), x, w, h, 1, n, k, s, tail=_norms(nw, 0.0, res, n, yw, osq))
    # h rounds res + the product rounded (p: w's first n rows, the gate's above), which may round
    # the other way than p (a bf16 ulp of p)
    p = gate
    err = np.abs(h.astype(np.float64) - (res + p))
    assert (err <= 2 ** -7 * np.abs(p) + 2 ** -8 * np.abs(res + p) + 1e-4 * np.abs(p).max()).all(), err.max()
    _close(yw, h.astype(np.float64) * nw)
    np.testing.assert_allclose(osq.sum(), (h.astype(np.float64) ** 2).sum(), rtol=1e-5)


@cuda_emu.emulated
@pytest.mark.parametrize("name", list(ALIGN))
def test_emulated_tc_gemv_norms_its_x(rng, name):
    """NORM: x holds x0 * (nw + 1) and nsq x0's squares in 32 parts; the product is divided by
    the norm at the end, and the sums the GEMV zeroes are zeroed."""
    n, k, eps, s = 24, 512, 1e-5, QuantScheme.parse(name)
    w, deq, _ = _inputs(rng, s, n, k)
    x0 = rng.standard_normal((1, k)).astype(BF).astype(np.float64)
    nw = rng.uniform(-0.5, 0.5, k)
    x = (x0 * (nw + 1)).astype(BF)
    nsq = np.full(32, (x0 ** 2).sum() / 32, np.float32)
    zero = np.ones(16, np.float32)
    tail = (np.float32(eps), nsq, None, np.float32(0), None, np.int64(0), None, None, zero, np.int32(zero.size))
    y = np.zeros((1, 2 * n), BF)
    _launch(_kernel(s, k, norm=1), x, w, y, 1, 2 * n, k, s, tail=tail)
    _close(y, x.astype(np.float64) @ deq.T / np.sqrt((x0 ** 2).mean() + eps))
    assert not zero.any()


@gpu
@pytest.mark.parametrize("name", list(ALIGN))
def test_tc_gemv_in_a_graph_matches_float64(rng, name, monkeypatch):
    """A dequant_matmul at one bf16 row, captured and replayed, with the TC form (the launch
    asked for it) and without: both the float64 product rounded to bf16."""
    from rlx_backend_cuda import device, ops

    n, k = 300, 2048
    w, deq, x = _inputs(rng, QuantScheme.parse(name), n, k)
    g = Graph.define("tc", lambda m: {"y": m.add("dequant_matmul", (m.input("x", (1, k), BF16),
                                                                    m.param("w", w.shape, U8)),
                                                 scheme=name, act="identity")})
    real, srcs = device.kernel, []
    monkeypatch.setattr(device, "kernel", lambda src, name, *a: srcs.append(src) or real(src, name, *a))
    for tc in (True, False):
        monkeypatch.setattr(ops, "DQ_TC", tc)
        srcs.clear()
        exe = rlx_core.compile(g, backend="cuda", params={"w": w})
        for _ in range(2):
            y = exe.backend.to_host(exe.run(x=x)["y"])
        assert any("#define TC 1" in s for s in srcs) == tc
        _close(y, x.astype(np.float64) @ deq.T)
