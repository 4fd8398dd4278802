"""Two RMSNorms with only views between them, neither reading the other (a decode step's q and
k norms: OLMoE's over the whole projection, Qwen3's per head), run as one launch
(ops._paired_norm); a norm of a norm, or norms of other row lengths, stay two launches. Each
case against a float64 NumPy reference on fresh random inputs, the last run a CUDA-graph replay."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.dtype import BF16, F32
from rlx_core.ir.graph import Graph
from rlx_core.pipeline import available_backends

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
pytestmark = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")
EPS = 1e-6


def norm(t, w, off=0.0):
    t = np.asarray(t, np.float64)
    return t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * (np.asarray(w, np.float64) + off)


def run(g, params, ins):
    exe = rlx_core.compile(g, backend="cuda", params=params)
    for _ in range(3):                   # the third run replays the captured CUDA graph
        out = exe.run(dict(ins))
    runner = next(iter(exe._runners.values()))
    return ({k: exe.backend.to_host(v).astype(np.float64) for k, v in out.items()},
            runner.describe()["steps_by_op"].get("rms_norm", 0))


def rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def tol(dt) -> float:
    return 2e-2 if dt is BF16 else 1e-5


@pytest.mark.parametrize("dt", [BF16, F32])
@pytest.mark.parametrize("rows,n,heads,kv", [(1, 2048, 1, 1), (3, 256, 1, 1), (1, 128, 4, 2), (1, 96, 3, 3)])
def test_q_and_k_norms_share_a_launch(dt, rows, n, heads, kv, rng):
    """q and k cut from one projection's rows (heads and kv heads of n values; heads 1: the norm
    over the whole projection), normed with their own weights, offset 1 (Gemma's w + 1). Heads
    of a decode row (one token) are views of it; of several rows not (a copy between: apart)."""
    width = (heads + 2 * kv) * n
    x = rng.uniform(-2, 2, (rows, width)).astype(np.float32).astype(dt.np)
    wq, wk = (rng.uniform(0.5, 1.5, (n,)).astype(np.float32).astype(dt.np) for _ in range(2))

    def f(m):
        xi = m.input("x", (rows, width), dt)
        q, k = m.narrow(xi, 1, 0, heads * n), m.narrow(xi, 1, heads * n, kv * n)
        if heads > 1:
            q, k = m.reshape(q, (rows, heads, n)), m.reshape(k, (rows, kv, n))
        return {"q": m.rms_norm(q, m.param("wq", (n,), dt), eps=EPS, offset=1.0),
                "k": m.rms_norm(k, m.param("wk", (n,), dt), eps=EPS, offset=1.0)}
    out, launches = run(Graph.define("qk_norms", f), {"wq": wq, "wk": wk}, {"x": x})
    xf = np.asarray(x, np.float64)
    q, k = xf[:, :heads * n], xf[:, heads * n:(heads + kv) * n]
    if heads > 1:
        q, k = q.reshape(rows, heads, n), k.reshape(rows, kv, n)
    want = {"q": norm(q, wq, 1.0), "k": norm(k, wk, 1.0)}
    for k, w in want.items():
        assert rel(out[k], w) < tol(dt), (k, rel(out[k], w))
    assert launches == 1


def test_a_norm_of_a_norm_and_norms_of_other_lengths_stay_apart(rng):
    x = rng.uniform(-2, 2, (2, 160)).astype(np.float32)
    w1, w2, w3 = (rng.uniform(0.5, 1.5, (s,)).astype(np.float32) for s in (160, 160, 64))

    def f(m):
        xi = m.input("x", (2, 160), F32)
        once = m.rms_norm(xi, m.param("w1", (160,), F32), eps=EPS)
        twice = m.rms_norm(once, m.param("w2", (160,), F32), eps=EPS)
        short = m.rms_norm(m.narrow(xi, 1, 0, 64), m.param("w3", (64,), F32), eps=EPS)
        return {"twice": twice, "short": short}
    out, launches = run(Graph.define("norm_chain", f), {"w1": w1, "w2": w2, "w3": w3}, {"x": x})
    xf = x.astype(np.float64)
    want = {"twice": norm(norm(xf, w1), w2), "short": norm(xf[:, :64], w3)}
    for k, w in want.items():
        assert rel(out[k], w) < 1e-5, (k, rel(out[k], w))
    assert launches == 3
