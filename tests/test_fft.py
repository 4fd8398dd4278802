"""FFT helpers (ir/fft.py) composed from the ops, against numpy in float64; errors of bad
input; JSON; a backend without FFT kernels runs their composites."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.ir import fft as F
from rlx_core.ir.dtype import C64, F32, F64
from rlx_core.ir.errors import DTypeError, GraphError, ShapeError
from rlx_core.ir.graph import Graph
from rlx_core.ir.serialize import graph_from_json
from rlx_core.pipeline import compile as compile_graph
from rlx_core.testing.parity import numpy_without


def _close(got, want, tol=1e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("n_fft,hop,t", [(8, 4, 30), (7, 3, 20), (16, 16, 64)])
def test_stft_matches_frame_loop(rng, n_fft, hop, t):
    x, win = rng.standard_normal((2, t)), np.hanning(n_fft)
    g = Graph.define("stft", lambda m: F.stft(m, m.input("x", (2, t), F64), n_fft, hop, win))
    got = compile_graph(g).run({"x": x})["out"]
    frames = 1 + (t - n_fft) // hop
    want = np.stack([[np.fft.rfft(row[f * hop:f * hop + n_fft] * win) for f in range(frames)] for row in x])
    assert got.dtype == np.complex64 and got.shape == want.shape
    _close(got, want)


def test_fftfreq_is_numpys():
    g = Graph.define("f", lambda m: F.fftfreq(m, 9, 0.1, F64) * 1.0)
    np.testing.assert_array_equal(compile_graph(g).run({})["out"], np.fft.fftfreq(9, 0.1))


@pytest.mark.parametrize("lx,lk", [(16, 5), (9, 4), (7, 7)])
def test_fft_conv1d_matches_convolve(rng, lx, lk):
    x, k = rng.standard_normal((3, lx)), rng.standard_normal(lk)
    g = Graph.define("conv", lambda m: F.fft_conv1d(m, m.input("x", (3, lx), F64), m.input("k", (lk,), F64)))
    got = compile_graph(g).run({"x": x, "k": k})["out"]
    _close(got, np.stack([np.convolve(r, k) for r in x]))


@pytest.mark.parametrize("norm", F.NORMS)
@pytest.mark.parametrize("n", [10, 11])
def test_round_trips(rng, norm, n):
    """irfft(rfft(x), n) == x and ifft(fft(z)) == z for every norm, even and odd lengths."""
    def f(m):
        x, z = m.input("x", (3, n), F32), m.input("z", (n, 2), C64)
        return {"x": m.irfft(m.rfft(x, norm=norm), n=n, norm=norm),
                "z": m.ifft(m.fft(z, axis=0, norm=norm), axis=0, norm=norm)}
    g = graph_from_json(Graph.define("rt", f).to_json())
    x = rng.standard_normal((3, n)).astype(np.float32)
    z = (rng.standard_normal((n, 2)) + 1j * rng.standard_normal((n, 2))).astype(np.complex64)
    got = compile_graph(g).run({"x": x, "z": z})
    _close(got["x"], x)
    _close(got["z"], z)


@pytest.mark.parametrize("build,err,msg", [
    (lambda m: m.fft(m.input("x", (4,), F32)), DTypeError, r"op 'fft': fft takes c64, got f32"),
    (lambda m: m.rfft(m.input("x", (4,), C64)), DTypeError, r"op 'rfft': rfft takes a float input"),
    (lambda m: m.irfft(m.input("x", (5,), C64), n=4), ShapeError, r"irfft n=4: 4 outputs need 3 frequencies"),
    (lambda m: m.rfft(m.input("x", ("t",), F32)), ShapeError, r"rfft needs a static length"),
    (lambda m: m.fft(m.input("x", (4,), C64), axis=1), ShapeError, r"axis 1 out of range"),
    (lambda m: m.fft(m.input("x", (4,), C64), norm="half"), GraphError, r"op 'fft': attr 'norm'"),
])
def test_bad_input_names_the_op(build, err, msg):
    with pytest.raises(err, match=msg):
        Graph.define("bad", build)


def test_backend_without_fft_runs_the_composites(rng):
    """A backend without FFT kernels (the NumPy backend less the FFT ops) gets the composites
    (ir/fft.py: a DFT as a matmul with a constant table): numpy's result. A length known
    only at run time has no such table: a ShapeError naming the op."""
    g = Graph.define("r", lambda m: m.rfft(m.input("x", (8,), F32)))
    x = rng.standard_normal(8).astype(np.float32)
    sym = Graph.define("f", lambda m: m.fft(m.input("x", ("t",), C64)))
    with numpy_without({"fft", "ifft", "rfft", "irfft"}, "no-fft") as name:
        _close(compile_graph(g, backend=name).run({"x": x})["out"], np.fft.rfft(x.astype(np.float64)))
        with pytest.raises(ShapeError, match="fft needs a static length along axis 0"):
            compile_graph(sym, backend=name)
