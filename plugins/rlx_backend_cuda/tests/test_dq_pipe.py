"""The packed decode GEMV as a grid of blocks that each loop over groups of rows (dq.cu's PIPE:
the next group's loads in flight during this group's products, in registers or asked into L2)
against the same kernel at one group a block: the same arithmetic in the same order, so the
outputs are the same bits. Emulated on the CPU over schemes that decode scales as they load
(Q4_K, Q5_K, Q6_K: their bytes held apart from the decode) and ones that do not, in the plain,
SwiGLU, residual and norm forms, with the last group cut short; on a GPU, a decode graph with
the form on and off, against float64."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from test_cuda import gpu
from test_dq_tc import _close
from test_int8_gemv import BF, _gemv_kernel, _launch, _norms

import rlx_core
from rlx_core import Graph
from rlx_core.ir.dtype import BF16, U8
from rlx_core.ir.quant import QuantScheme, quantize

BFT = "__nv_bfloat16"
SCHEMES = ["q4_k", "q5_k", "q6_k", "q8_0", "q4_1"]


def _run(s, k, x, w, n, pipe, blocks=0, **kw):
    """(y, and under resid its yw and osq) of the GEMV over n outputs, PIPE `pipe` (0: one group of
    rows a block; else at most `blocks` blocks, each taking several groups; 3: the L2 form)."""
    m = x.shape[0]
    kern = _gemv_kernel(s, BFT, m, k, 0, A=4 if s.kind == "q6_k" else 16, pipe=pipe, pf=int(pipe == 3), **kw)
    y, tail, rest = np.zeros((m, n), BF), _norms(), ()
    if kw.get("norm"):              # (x0's squares: 1.5 in each of a row's 32 parts)
        tail = (np.float32(1e-5), np.full(32 * m, 1.5, np.float32)) + _norms()[2:]
    if kw.get("resid"):
        r = np.random.default_rng(7)
        res, nw = r.standard_normal((m, n)).astype(BF), r.uniform(0.5, 1.5, n).astype(np.float32)
        rest = (np.zeros((m, n), BF), np.zeros(32 * m, np.float32))
        tail = _norms(nw, 0.0, res, n, *rest)
    _launch(kern, x, w, y, m, n, k, s, tail=tail, blocks=blocks)
    return (y,) + rest


FORMS = {"plain": {}, "swiglu": dict(swiglu=1), "resid": dict(resid=1), "norm": dict(norm=1)}


@cuda_emu.emulated
@pytest.mark.parametrize("name, m, forms", [("q4_k", 1, list(FORMS)), ("q4_k", 2, ["plain"]),
                                             ("q6_k", 1, ["plain", "resid"]), ("q8_0", 1, ["swiglu", "norm"])])
def test_emulated_pipe_gemv_is_the_one_group_gemv(rng, name, m, forms):
    s = QuantScheme.parse(name)
    n, k = 76, 512 if s.block_size == 256 else 256
    w = quantize(rng.standard_normal((2 * n, k)).astype(np.float32), s)
    x = (rng.standard_normal((m, k)) + 1.0).astype(BF)
    for form in forms:
        rows = 2 * n if form == "plain" else n
        want = _run(s, k, x, w, rows, 0, **FORMS[form])
        for pipe, blocks in ((2, 3), (3, 2)):
            got = _run(s, k, x, w, rows, pipe, blocks, **FORMS[form])
            for a, b in zip(got[:2], want[:2]):
                np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"{form} {pipe}")
            if len(got) > 2:        # (the squares' atomic adds may come in another order)
                np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
        if form == "plain":
            _close(want[0], x.astype(np.float64) @ s.dequantize_reference(w, (2 * n, k)).T, ulps=2)


@gpu
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0"])
def test_pipe_gemv_in_a_graph_matches_float64(rng, name, monkeypatch):
    """A dequant_matmul at one bf16 row with more row groups than a grid of PIPE blocks an SM,
    captured and replayed, PIPE in registers, in L2 and off: the float64 product rounded to bf16,
    the PIPE forms bit for bit the same as the plain one."""
    from rlx_backend_cuda import device, ops

    n, k = 16384, 2048
    s = QuantScheme.parse(name)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32), s)
    x = rng.standard_normal((1, k)).astype(BF)
    g = Graph.define("pipe", lambda m: {"y": m.add("dequant_matmul", (m.input("x", (1, k), BF16),
                                                                      m.param("w", w.shape, U8)),
                                                   scheme=name, act="identity")})
    real, srcs, outs = device.kernel, [], []
    monkeypatch.setattr(device, "kernel", lambda src, name, *a: srcs.append(src) or real(src, name, *a))
    for pipe, l2 in ((0, False), (2, False), (3, True)):
        monkeypatch.setattr(ops, "DQ_PIPE", pipe)
        monkeypatch.setattr(ops, "DQ_PIPE_L2", l2)
        srcs.clear()
        exe = rlx_core.compile(g, backend="cuda", params={"w": w})
        for _ in range(2):
            y = exe.backend.to_host(exe.run(x=x)["y"])
        assert any(f"#define PIPE {pipe}\n" in src for src in srcs), pipe
        outs.append(y)
    _close(outs[0], x.astype(np.float64) @ s.dequantize_reference(w, (n, k)).T)
    for y in outs[1:]:
        np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(outs[0]).view(np.uint16))
