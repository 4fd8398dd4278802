"""LLVM's code pages leave the process once kernels are loaded (resident.py): only clean,
read-only mappings of libllvmlite are dropped, kernels compiled or loaded afterwards still
run, and a runner releases them after its first run only."""
from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("numba")

from rlx_backend_numba import resident, runner  # noqa: E402
from rlx_core.ir.dtype import F32  # noqa: E402
from rlx_core.ir.graph import Builder  # noqa: E402
import rlx_core  # noqa: E402

SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fd:01 42   /site/llvmlite/binding/libllvmlite.so
Rss:                 400 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
7f0000100000-7f0000900000 r-xp 00100000 fd:01 42   /site/llvmlite/binding/libllvmlite.so
Rss:               20000 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
7f0000900000-7f0000a00000 r--p 00900000 fd:01 42   /site/llvmlite/binding/libllvmlite.so
Rss:                1024 kB
Anonymous:          1024 kB
Private_Dirty:      1024 kB
7f0000a00000-7f0000a10000 r--p 00a00000 fd:01 42   /site/llvmlite/binding/libllvmlite.so
Rss:                  64 kB
Anonymous:             0 kB
Private_Dirty:         8 kB
7f0000a10000-7f0000a20000 rw-p 00a10000 fd:01 42   /site/llvmlite/binding/libllvmlite.so
Rss:                  64 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
7f0000b00000-7f0000c00000 r-xp 00000000 fd:01 77   /usr/lib/libc.so.6
Rss:                 900 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
7f0000c00000-7f0000d00000 rw-p 00000000 00:00 0
Rss:                 900 kB
Anonymous:           900 kB
"""


def test_only_clean_read_only_mappings_of_llvm_are_chosen():
    """The relocated (anonymous) and the dirtied read-only mappings, the writable one and
    other libraries' code are kept."""
    assert resident.clean_mappings(SMAPS) == [(0x7f0000000000, 0x7f0000100000),
                                               (0x7f0000100000, 0x7f0000900000)]
    assert resident.clean_mappings(SMAPS, "libc") == [(0x7f0000b00000, 0x7f0000c00000)]
    assert resident.clean_mappings("") == []


def _clean_rss_kb() -> int:
    with open("/proc/self/smaps") as f:
        text = f.read()
    clean = set(resident.clean_mappings(text))
    return sum(m.get("Rss", 0) for m in resident.mappings(text) if m["range"] in clean)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED of file pages: Linux only")
def test_released_pages_leave_and_kernels_still_compile_and_run(rng):
    from numba import njit

    @njit(cache=False)
    def axpy(a, x, y):                      # compiled here: LLVM's code runs and is resident
        return a * x + y

    x, y = rng.standard_normal(50), rng.standard_normal(50)
    np.testing.assert_allclose(axpy(2.0, x, y), 2.0 * x + y)
    before = _clean_rss_kb()
    assert before > 0
    assert resident.release_llvm_pages() > 0
    assert _clean_rss_kb() < before

    @njit(cache=False)
    def scaled_sum(x, s):                   # compiling again after the release
        return (x * s).sum()

    np.testing.assert_allclose(scaled_sum(x, 3.0), 3.0 * x.sum())
    np.testing.assert_allclose(axpy(-1.0, x, y), y - x)


def test_a_runner_releases_after_its_first_run_only(rng, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "release_llvm_pages", lambda: calls.append(1) or 0)
    b = Builder("twice")
    x = b.input("x", (4, 8), F32)
    b.output("y", b.softmax(b.mul(x, x), axis=-1))
    exe = rlx_core.compile(b.build(), backend="numba")
    xs = rng.standard_normal((4, 8)).astype(np.float32)
    want = np.exp(xs * xs) / np.exp(xs * xs).sum(-1, keepdims=True)
    for _ in range(3):
        np.testing.assert_allclose(exe.run({"x": xs})["y"], want, rtol=1e-5)
    assert calls == [1]
