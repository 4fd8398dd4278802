"""The profiler on CUDA: CUDA events between eagerly launched steps against the CUDA graph
replay of the same runner. Skipped with the backend's reason where there is no GPU."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.graph import Graph
from rlx_core.pipeline import available_backends

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
pytestmark = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")

N, LAYERS = 2048, 6


def big_matmuls() -> Graph:
    """Six [2048, 2048] f32 matmuls with SiLU: each kernel ~0.1-1 ms, so the few us of launch
    gap between eager steps are a small part of the event times."""
    def f(m):
        x = m.input("x", (N, N))
        for i in range(LAYERS):
            x = m.silu(m.linear(x, m.param(f"w{i}", (N, N))))
        return {"y": x}
    return Graph.define("big_matmuls", f)


def test_event_times_match_the_graph_replay(rng):
    """The sum of the per-node event medians is within 25% of the graph replay: eager
    launches leave gaps the replay has not (a few us a kernel, ~1% here), and the events
    split one stream's time between kernels, so the rest is the GPU's own variation."""
    w = {f"w{i}": (rng.standard_normal((N, N)) / np.sqrt(N)).astype(np.float32) for i in range(LAYERS)}
    exe = rlx_core.compile(big_matmuls(), backend="cuda", params=w)
    inputs = {"x": rng.standard_normal((N, N)).astype(np.float32)}
    rep = exe.profile(inputs, repeat=10)
    runner, _, _ = exe.prepare(inputs)
    assert runner.graph is not None, runner.describe()
    replay = runner.replay_seconds()
    assert rep.total_s == pytest.approx(replay, rel=0.25), (replay, rep.table())
    assert "CUDA events" in rep.clock and rep.copy_bytes_per_s > 0
    assert len(rep.nodes) == len({n.index for n in rep.nodes})
    assert {n.op for n in rep.nodes} & {"matmul", "fused_matmul_bias_act"}
