"""The weights' L2 prefetch beside latency-bound kernels (prefetch.py): which ranges a step's
plan asks for where (on the CPU, from step lists), and on the GPU that a step with the
branches woven in computes exactly what it computes without them (the prefetch is a hint),
matching a float64 reference."""
from __future__ import annotations

import math
import types

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.dtype import BF16
from rlx_core.ir.graph import Graph
from rlx_core.ir.quant import PackedTensor, QuantScheme
from rlx_core.pipeline import available_backends
from rlx_backend_cuda import prefetch

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
gpu = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")
MB = 1 << 20


def steps(*reads) -> list:
    return [types.SimpleNamespace(reads=tuple(r)) for r in reads]


def test_a_stretch_asks_for_the_weights_after_it_in_their_order():
    """After GEMV 0: the stretch 1-2 asks for GEMV 3's weights whole, then an equal first part
    of each half of GEMV 4's (gate and up, read side by side); the stretch 5 asks for GEMV 6's.
    Ranges are (address, bytes)."""
    g0, g3, g6 = (1000 * MB, 4 * MB), (2000 * MB, 10 * MB), (4000 * MB, 8 * MB)
    gate, up = (3000 * MB, 25 * MB), (3025 * MB, 25 * MB)
    plan = prefetch.plan(steps([g0], [], [], [g3], [gate, up], [], [g6]), 30 * MB)
    assert plan == {1: [g3, (gate[0], 10 * MB), (up[0], 10 * MB)], 5: [g6]}


def test_no_ask_before_the_first_gemv_or_after_the_last():
    """A stretch before any GEMV ran has no GEMV done to fork from; one after the last has
    nothing to ask for."""
    g = (1 << 30, MB)
    assert prefetch.plan(steps([], [g], [], [g], []), 8 * MB) == {2: [g]}
    assert prefetch.plan(steps([g], [g], []), 8 * MB) == {}


def test_whole_halves_join_and_the_budget_holds():
    """The two halves of a GEMV taken whole are one range; a budget smaller than a GEMV's
    weights takes an equal first part of each range; nothing at all under 16 bytes."""
    gate, up = (1 << 30, 4 * MB), ((1 << 30) + 4 * MB, 4 * MB)
    assert prefetch.plan(steps([(0, 16)], [], [gate, up]), 8 * MB) == {1: [(gate[0], 8 * MB)]}
    assert prefetch.plan(steps([(0, 16)], [], [gate, up]), 2 * MB) == {1: [(gate[0], MB), (up[0], MB)]}
    assert prefetch.plan(steps([(0, 16)], [], [gate, up]), 8) == {}
    big = (1 << 31, 64 * MB)
    plan = prefetch.plan(steps([(0, 16)], [], [big], [gate]), 24 * MB)
    assert plan == {1: [(big[0], 24 * MB)]} and sum(n for _, n in plan[1]) <= 24 * MB


def test_under_each_gemv_the_next_ones_first_bytes():
    """With `under`: as each GEMV that another follows directly starts, the next one's first
    bytes (an equal part of each range); a stretch still asks for the GEMVs after it."""
    a, b, gate, up = (1 << 30, 8 * MB), (2 << 30, 8 * MB), (3 << 30, 25 * MB), (4 << 30, 25 * MB)
    plan = prefetch.plan(steps([a], [b], [gate, up], [], [a]), 16 * MB, under=2 * MB)
    assert plan == {1: [(gate[0], MB), (up[0], MB)], 3: [a]}
    assert prefetch.plan(steps([a], [b], [gate, up], [], [a]), 16 * MB) == {3: [a]}


def test_launch_arguments_fill_the_empty_ranges():
    args = prefetch._args([(4096, 1000), (8192, 64)])
    assert [int(a) for a in args] == [4096, 1000, 8192, 64, 0, 0, 0, 0, prefetch.CHUNK]


def chain(m, x, p: dict):
    """Three decode products with a softmax between each two (kernels that stream no weights)."""
    h = m.softmax(m.linear(x, p["w1"]), axis=-1)
    h = m.softmax(m.linear(h, p["w2"]), axis=-1)
    return {"y": m.linear(h, p["w3"])}


def chain_reference(p: dict, x) -> np.ndarray:
    def softmax(t):
        e = np.exp(t - t.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    h = softmax(x @ p["w1"].T)
    h = softmax(h @ p["w2"].T)
    return h @ p["w3"].T


def run(g, params, ins, on: bool) -> tuple:
    from rlx_backend_cuda import set_config
    from rlx_backend_cuda.values import CONFIG

    was = CONFIG["l2_prefetch"]
    set_config(l2_prefetch=on)
    try:
        exe = rlx_core.compile(g, backend="cuda", params=params)
        for _ in range(3):                   # the third run replays the captured CUDA graph
            out = exe.run(dict(ins))
        runner = next(iter(exe._runners.values()))
        return exe.backend.to_host(out["y"]), runner
    finally:
        set_config(l2_prefetch=was)


@gpu
@pytest.mark.parametrize("scheme", ["", "q4_k"])
def test_the_branches_change_no_result(scheme):
    """The chain's runner with the branches woven in (where the GPU can) forks before each
    softmax that follows a GEMV and joins at the end; its captured graph computes the same bits
    as without them, within bf16 / q4_k rounding of a float64 reference on the same weights."""
    rng = np.random.default_rng(7)
    K = 512
    shapes = {"w1": (768, K), "w2": (K, 768), "w3": (384, K)}
    pv, floats = {}, {}
    for n, s in shapes.items():
        w = (rng.uniform(-1, 1, s) / math.sqrt(s[1])).astype(np.float32)
        if scheme:
            qs = QuantScheme.parse(scheme)
            raw = qs.quantize(w)
            pv[n], floats[n] = PackedTensor(raw, qs, s, n), qs.dequantize(raw, s, dtype=np.float64)
        else:
            pv[n] = w.astype(BF16.np)
            floats[n] = np.asarray(pv[n], np.float64)
    x = rng.uniform(-2, 2, (1, 1, K)).astype(np.float32).astype(BF16.np)

    def f(m):
        p = {n: m.param(n, s, BF16, scheme=scheme) for n, s in shapes.items()}
        return chain(m, m.input("x", (1, 1, K), BF16), p)
    g = Graph.define("prefetch_chain", f)
    off, plain = run(g, pv, {"x": x}, False)
    on, woven = run(g, pv, {"x": x}, True)
    assert sum(bool(st.reads) for st in plain.steps) == 3, plain.describe()        # the GEMVs
    assert len(prefetch.plan(plain.steps, 1 << 30)) == 2, plain.describe()         # the softmaxes
    assert "l2_prefetch" not in plain.describe()["steps_by_op"]
    if not prefetch.missing():
        assert woven.describe()["steps_by_op"]["l2_prefetch"] == 3       # two forks, the join
        assert woven.describe()["graph"]
    np.testing.assert_array_equal(np.asarray(on, np.float32), np.asarray(off, np.float32))
    want = chain_reference(floats, np.asarray(x, np.float64))
    err = np.linalg.norm(np.asarray(on, np.float64) - want) / np.linalg.norm(want)
    assert err < 2e-2, err
