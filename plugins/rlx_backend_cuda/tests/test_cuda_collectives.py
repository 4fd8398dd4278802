"""The cuda runner's collectives (issue 19) on one GPU: all_reduce, all_gather and
reduce_scatter of a group of one, with no communicator bound (a copy) and on an NCCL
communicator of one rank (the runner's NCCL path: rank-major buffers, NcclCommunicator.
on_device on the runner's stream, captured into the CUDA graph from the second run), equal
the NumPy backend's, in f32 and bf16. Skipped without cupy, a GPU or NCCL. The 2-GPU run of
a sharded model on the cuda backend is in test_nccl_tp.py."""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="cupy (cupy-cuda12x) is not installed")
try:
    from cupy.cuda import nccl  # noqa: F401
    assert cupy.cuda.runtime.getDeviceCount() >= 1
except Exception as e:  # noqa: BLE001 - no NCCL or no driver: skip with the reason
    pytest.skip(f"NCCL or CUDA unavailable: {e!r}", allow_module_level=True)

import rlx_core  # noqa: E402
from rlx_core.backends.numpy.comm import create_block  # noqa: E402
from rlx_core.ir import comm  # noqa: E402
from rlx_core.ir.dtype import BF16, F32  # noqa: E402
from rlx_core.ir.graph import MIR, Builder  # noqa: E402
from rlx_core.profile import CompileProfile  # noqa: E402


def _graph(dt):
    m = Builder("collectives", MIR)
    x = m.input("x", (3, 4, 8), dt)
    g = {"world": 1, "rank": 0}
    y = m.add("binary", (x, x), op="add")
    m.output("reduced", m.add("all_reduce", (y,), **g))
    m.output("gathered", m.add("all_gather", (m.add("transpose", (y,), perm=(0, 2, 1)),), axis=1, **g))
    m.output("scattered", m.add("reduce_scatter", (y,), axis=2, **g))
    return m.build()


@pytest.fixture(params=["none", "nccl"])
def bound(request):
    """No communicator (a group of one copies), or an NCCL one of one rank."""
    if request.param == "none":
        yield None
        return
    from rlx_backend_cuda.nccl import NcclCommunicator

    block = create_block(1, 4096)
    c = NcclCommunicator(block.name, 1, 0, mp.get_context("spawn").Barrier(1), 4096, 60)
    comm.bind(c)
    try:
        yield c
    finally:
        comm.bind(None)
        c.close()
        block.close()
        block.unlink()


@pytest.mark.parametrize("dt", [F32, BF16], ids=["f32", "bf16"])
def test_collectives_of_one_rank_equal_numpy(bound, dt):
    g = _graph(dt)
    x = np.random.default_rng(0).standard_normal((3, 4, 8)).astype(np.float32).astype(dt.np)
    want = rlx_core.compile(g, profile=CompileProfile(), backend="numpy").run({"x": x})
    exe = rlx_core.compile(g, profile=CompileProfile(), backend="cuda")
    for _ in range(3):                        # eager, captured, replayed
        got = exe.run({"x": x})
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), k)
