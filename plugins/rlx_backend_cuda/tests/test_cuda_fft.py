"""FFTs on the GPU (cuFFT, rlx_backend_cuda/fft.py) against numpy.fft in float64, beyond the
shared parity suite's small sizes: long rows (powers of two and not), a middle axis, f64
and bf16 input to rfft, the helpers fft_conv1d and stft, round trips, and the step inside
the runner's CUDA graph (a second and third run replay it)."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.ir import fft as F
from rlx_core.ir.dtype import BF16, C64, F32, F64
from rlx_core.ir.graph import Graph
from rlx_core.pipeline import available_backends

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
pytestmark = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(float(np.abs(want).max()), 1e-30))


def _c64(rng, dims):
    return (rng.standard_normal(dims) + 1j * rng.standard_normal(dims)).astype(np.complex64)


@pytest.mark.parametrize("n", [1000, 1024, 4096])
@pytest.mark.parametrize("norm", F.NORMS)
def test_long_rows_along_a_middle_axis(rng, n, norm):
    z, x = _c64(rng, (2, n, 3)), rng.standard_normal((2, n, 3)).astype(np.float32)

    def f(m):
        zi, xi = m.input("z", (2, n, 3), C64), m.input("x", (2, n, 3), F32)
        r = m.rfft(xi, axis=1, norm=norm)
        return {"fft": m.fft(zi, axis=1, norm=norm), "ifft": m.ifft(zi, axis=1, norm=norm), "rfft": r,
                "irfft": m.irfft(r, axis=1, n=n, norm=norm)}
    exe = rlx_core.compile(Graph.define("long", f), backend="cuda")
    for _ in range(3):                                      # build, capture, replay
        got = exe.run({"z": z, "x": x})
        _close(got["fft"], np.fft.fft(z.astype(np.complex128), axis=1, norm=norm), 1e-4)
        _close(got["ifft"], np.fft.ifft(z.astype(np.complex128), axis=1, norm=norm), 1e-4)
        _close(got["rfft"], np.fft.rfft(x.astype(np.float64), axis=1, norm=norm), 1e-4)
        _close(got["irfft"], x, 1e-4)
    d = exe.runner({}).describe()
    assert d["capturable"] and d["graph"] and not d["capture_failed"], d


@pytest.mark.parametrize("dt", [F64, BF16], ids=lambda d: d.value)
def test_rfft_of_other_float_types(rng, dt):
    x = rng.standard_normal((4, 9))
    x = x.astype(np.float64) if dt is F64 else np.asarray(x, dt.np)
    g = Graph.define("r", lambda m: m.rfft(m.input("x", (4, 9), dt)))
    got = rlx_core.compile(g, backend="cuda").run({"x": x})["out"]
    _close(got, np.fft.rfft(np.asarray(x, np.float64)), 1e-5)


def test_irfft_ignores_the_imaginary_dc_and_nyquist_parts(rng):
    z = _c64(rng, (3, 5))
    g = Graph.define("i", lambda m: m.irfft(m.input("z", (3, 5), C64), n=8))
    got = rlx_core.compile(g, backend="cuda").run({"z": z})["out"]
    _close(got, np.fft.irfft(z.astype(np.complex128), n=8))


@pytest.mark.parametrize("lx,lk", [(300, 31), (9, 4)])
def test_fft_conv1d_and_stft(rng, lx, lk):
    x, k = rng.standard_normal((3, lx)).astype(np.float32), rng.standard_normal(lk).astype(np.float32)
    n_fft, hop = min(lx, 16), 4
    win = np.hanning(n_fft)

    def f(m):
        xi = m.input("x", (3, lx), F32)
        return {"conv": F.fft_conv1d(m, xi, m.input("k", (lk,), F32)), "stft": F.stft(m, xi, n_fft, hop, win)}
    got = rlx_core.compile(Graph.define("h", f), backend="cuda").run({"x": x, "k": k})
    _close(got["conv"], np.stack([np.convolve(r, k.astype(np.float64)) for r in x.astype(np.float64)]), 1e-4)
    frames = 1 + (lx - n_fft) // hop
    want = np.stack([[np.fft.rfft(r[t * hop:t * hop + n_fft] * win) for t in range(frames)]
                     for r in x.astype(np.float64)])
    _close(got["stft"], want, 1e-4)
