"""Loads a kernel issues before it waits for the kernel before it (Hopper's programmatic
dependent launch, device.Kernel): only of bytes no kernel writes, params and constants
(`Build.written_by_no_kernel`). A decode GEMV and an RMSNorm whose weights the step itself
computes load them after the wait; against a float64 NumPy reference on fresh random inputs
over three runs (the weights change each run; the last run replays the CUDA graph)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.dtype import BF16, F16, F32
from rlx_core.ir.graph import Graph
from rlx_core.pipeline import available_backends

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
gpu = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")
EPS = 1e-5


def _device_like(a: np.ndarray):
    """A host array as the rule reads a device one: its first byte's address, shape, strides."""
    return SimpleNamespace(data=SimpleNamespace(ptr=a.__array_interface__["data"][0]), shape=a.shape,
                           strides=a.strides, itemsize=a.itemsize, size=a.size)


def test_only_bytes_inside_a_param_or_constant_count():
    """The rule on addresses alone (no GPU): a view inside a resident array counts, one that
    reaches past it, or another array, does not; a reversed view is judged by the bytes it spans."""
    from rlx_backend_cuda.runner import Build
    from rlx_backend_cuda.values import V

    param, other = np.zeros((8, 16), np.float32), np.zeros(64, np.float32)
    first = param.__array_interface__["data"][0]
    build = SimpleNamespace(resident=[(first, first + param.nbytes)])

    def inside(a) -> bool:
        return Build.written_by_no_kernel(build, V(_device_like(a), F32))
    assert inside(param) and inside(param[2:5, 3:9]) and inside(param[::-1, ::-2]) and inside(param[:0])
    shifted = np.lib.stride_tricks.as_strided(param[1:], shape=(8, 16), strides=param.strides)
    assert not inside(shifted)                     # its last row lies past the param's bytes
    assert not inside(other)


@gpu
@pytest.mark.parametrize("dt", [BF16, F16])
def test_weights_the_step_writes_are_read_after_the_wait(dt, rng):
    N, K = 320, 512
    w0 = (rng.uniform(-1, 1, (N, K)) / np.sqrt(K)).astype(np.float32).astype(dt.np)
    n0 = rng.uniform(0.5, 1.5, (K,)).astype(np.float32).astype(dt.np)

    def f(m):
        w, wn = m.state("w", (N, K), dt), m.state("wn", (K,), dt)
        w2, wn2 = w * -2.0, wn * 2.0                    # (exact in 16-bit floats: the reference's too)
        m.assign(w, w2)
        m.assign(wn, wn2)
        return {"y": m.matmul(m.rms_norm(m.input("x", (1, K), dt), wn2, eps=EPS), w2, trans_b=True)}
    exe = rlx_core.compile(Graph.define("weights_written_in_the_step", f), backend="cuda")
    exe.states["w"], exe.states["wn"] = exe.backend.to_device(w0), exe.backend.to_device(n0)
    w, wn = w0.astype(np.float64), n0.astype(np.float64)
    for _ in range(3):                                  # the third run replays the captured graph
        x = rng.uniform(-2, 2, (1, K)).astype(np.float32).astype(dt.np)
        y = np.asarray(exe.backend.to_host(exe.run({"x": x})["y"]), np.float64)
        w, wn = w * -2.0, wn * 2.0
        xf = x.astype(np.float64)
        normed = (xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + EPS) * wn).astype(dt.np).astype(np.float64)
        want = normed @ w.T
        assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-2
