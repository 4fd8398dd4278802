"""The packed decode GEMV's rows a warp: a launch that would have fewer than
ops.DQ_SMALL_BLOCKS_PER_SM blocks an SM at ops.DQ_ROWS takes ops.DQ_SMALL_ROWS rows a warp (more
blocks, each warp's chain of products shorter). A row's sum does not depend on how many rows
its warp holds, so each form gives the same bits: checked emulated on the CPU (cuda_emu) for the
plain, residual (h, its weighted copy and its squares) and norm forms, against float64 too, at
one x row, where a group of runs sharing a scale sums its products before scaling them."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from test_gemv_fusion import rel
from test_int8_gemv import BF, _launch, _norms

from rlx_core.ir.quant import QuantScheme, quantize


def test_a_small_launch_takes_fewer_rows_a_warp(monkeypatch):
    """(No GPU.) Llama-1B's shapes on 132 SMs: the o (2048 x 2048) and q/k/v (3072 x 2048)
    projections at 4 rows a warp would launch 128 and 192 blocks, so they take 2; the down
    projection (512 blocks), the head and a SwiGLU launch (no n) keep 4; 0 turns it off."""
    from rlx_backend_cuda import ops

    monkeypatch.setattr(ops, "DQ_SMALL_ROWS", 2)
    shapes = ((2048, 2048), (3072, 2048), (2048, 8192), (128256, 2048), (0, 2048))
    assert [ops.dq_gemv_shape("q4_k", 256, 1, k, sms=132, n=n)[2] for n, k in shapes] == [2, 2, 4, 4, 4]
    assert ops.dq_gemv_shape("q4_k", 256, 4, 2048, sms=132, n=2048)[2] == 2      # (4 x rows: 2 already)
    monkeypatch.setattr(ops, "DQ_SMALL_ROWS", 0)
    assert ops.dq_gemv_shape("q4_k", 256, 1, 2048, sms=132, n=2048)[2] == 4


def _kernel(s, rows: int, norm: int = 0, resid: int = 0):
    from rlx_backend_cuda import codegen, sources
    from rlx_backend_cuda.ops import DQ_LOADS, dq_gemv_shape

    _, kw, _ = dq_gemv_shape(s.kind, s.block_size, 1, 512)
    bf = "__nv_bfloat16"
    src = sources.dq_source(sources.DQ_GEMV, s.kind, s.block_size, T=bf, TO=bf, TB="float", ACC="float",
                            A=2 if s.kind == "q6_k" else 16, MMAX=1, R=rows, U=DQ_LOADS, KW=kw, XV=1,
                            SWIGLU=0, EPILOGUE="", SWIGLU_OF=codegen.swiglu_of("float"), EARLY=0, NORM=norm,
                            TN="float", RESID=resid, QX=0, Q8=0, TC=0)
    return cuda_emu.compile_kernel(src, "rlx_dq_gemv"), 8 // kw * rows, 0


@cuda_emu.emulated
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0", "q4_0"])
def test_emulated_rows_a_warp_give_the_same_bits(rng, name):
    """4, 2 and 1 rows a warp: the plain, norm and residual forms' outputs bit for bit (the
    squares' sum within float rounding: its atomics add in another order), and float64's."""
    s = QuantScheme.parse(name)
    n, k, eps = 40, 512, 1e-5
    w = quantize(rng.standard_normal((n, k)).astype(np.float32), s)
    deq = s.dequantize_reference(w, (n, k))
    x0 = rng.standard_normal((1, k)).astype(BF)
    res = rng.standard_normal((1, n)).astype(BF)
    nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
    nsq = np.full(32, (x0.astype(np.float64) ** 2).sum() / 32, np.float32)
    got = {}
    for rows in (4, 2, 1):
        plain, normed = np.zeros((1, n), BF), np.zeros((1, n), BF)
        h, yw, osq = np.zeros((1, n), BF), np.zeros((1, n), BF), np.zeros(32, np.float32)
        _launch(_kernel(s, rows), x0, w, plain, 1, n, k, s)
        norm_tail = (np.float32(eps), nsq) + _norms()[2:]
        _launch(_kernel(s, rows, norm=1), x0, w, normed, 1, n, k, s, tail=norm_tail)
        _launch(_kernel(s, rows, resid=1), x0, w, h, 1, n, k, s, tail=_norms(nw, 0.0, res, n, yw, osq))
        got[rows] = [a.view(np.uint16).copy() for a in (plain, normed, h, yw)] + [osq.sum()]
    for rows in (2, 1):
        for a, b in zip(got[rows][:4], got[4][:4]):
            np.testing.assert_array_equal(a, b, err_msg=f"{rows} rows a warp")
        assert got[rows][4] == pytest.approx(got[4][4], rel=1e-5)
    want = x0.astype(np.float64) @ deq.T
    # (bf16 outputs: one rounding, 2^-9 of each value; h two)
    assert rel(got[2][0].view(BF), want) < 4e-3
    assert rel(got[2][1].view(BF), want / np.sqrt((x0.astype(np.float64) ** 2).mean() + eps)) < 4e-3
    assert rel(got[2][2].view(BF), res.astype(np.float64) + want) < 8e-3
