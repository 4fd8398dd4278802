"""FFT ops and c64 values on OpenCL against numpy in float64, outputs poisoned first: lengths
past the parity suite's (powers of two, composite, prime, 1) through both the local-memory
kernel and the one-launch-per-stage path, a strided middle axis, fft_conv1d and stft, round
trips, c64 inputs / params / outputs with the elementwise ops FFT users need, and the error
for an op that has no c64 kernel."""
from __future__ import annotations

import numpy as np
import pytest
from test_opencl import DIRECT, RAW, ocl, run_cl  # noqa: F401

import rlx_core
from rlx_backend_opencl import runner as R
from rlx_core import Graph
from rlx_core.ir import fft as F
from rlx_core.ir.dtype import C64, F32
from rlx_core.ir.errors import BackendError

TOL = 1e-4      # of max|reference|: float32 data, twiddles and sums against float64


@pytest.fixture(params=["local", "passes"])
def path(request, monkeypatch):
    """The local-memory kernel (a row per work-group), or with no local memory allowed one
    launch per stage through global scratch."""
    if request.param == "passes":
        monkeypatch.setattr(R, "FFT_LOCAL_CAP", 0)
    return request.param


def crand(rng, *shape):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


def close(got, want, tol=TOL):
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.complex128), want, rtol=tol,
                               atol=tol * max(float(np.abs(want).max()), 1e-30))


def run_fft(ocl, path, build, inputs, profile=RAW):
    """Compile `build` on OpenCL, check the FFT kernel `path` chose, run it poisoned."""
    ex = rlx_core.compile(Graph.define("fft", build), profile=profile, backend=ocl)
    kernels = {st[0].function_name for st in ex.runner(ex._bind_dims(inputs)).steps if type(st) is tuple}
    assert ("fft_local" if path == "local" else "fft_pass") in kernels, kernels
    return run_cl(ex, inputs)


@pytest.mark.parametrize("n", [1024, 4096, 1000, 1009, 1])
def test_lengths_match_numpy(ocl, rng, path, n):
    """Radix-4 stages (1024, 4096), mixed 4/2/5 (1000), a prime's direct DFT (1009), n = 1."""
    def build(m):
        z, x, h = m.input("z", (3, n), C64), m.input("x", (3, n), F32), m.input("h", (3, n // 2 + 1), C64)
        return {"fft": m.fft(z), "ifft": m.ifft(z, norm="ortho"), "rfft": m.rfft(x, norm="forward"),
                "irfft": m.irfft(h, n=n)}
    inp = {"z": crand(rng, 3, n), "x": rng.standard_normal((3, n)).astype(np.float32),
           "h": crand(rng, 3, n // 2 + 1)}
    got = run_fft(ocl, path, build, inp)
    z, x, h = (v.astype(np.complex128 if v.dtype == np.complex64 else np.float64) for v in inp.values())
    close(got["fft"], np.fft.fft(z))
    close(got["ifft"], np.fft.ifft(z, norm="ortho"))
    close(got["rfft"], np.fft.rfft(x, norm="forward"))
    assert got["irfft"].dtype == np.float32
    close(got["irfft"], np.fft.irfft(h, n=n))


@pytest.mark.parametrize("n", [12, 64, 7])
def test_strided_middle_axis(ocl, rng, path, n):
    """Rows along axis 1 of a narrowed [2, n, 5] view: row stride 5, batch strides 5n and 1,
    only 3 of every 5 columns read; irfft reads the first n // 2 + 1 rows of that view."""
    def build(m):
        z = m.narrow(m.input("z", (2, n, 5), C64), 2, 1, 3)
        x = m.narrow(m.input("x", (2, n, 5), F32), 2, 1, 3)
        return {"fft": m.fft(z, axis=1), "ifft": m.ifft(z, axis=-2, norm="forward"),
                "rfft": m.rfft(x, axis=1, norm="ortho"),
                "irfft": m.irfft(m.narrow(z, 1, 0, n // 2 + 1), axis=1, n=n)}
    inp = {"z": crand(rng, 2, n, 5), "x": rng.standard_normal((2, n, 5)).astype(np.float32)}
    got = run_fft(ocl, path, build, inp)
    z, x = inp["z"][:, :, 1:4].astype(np.complex128), inp["x"][:, :, 1:4].astype(np.float64)
    close(got["fft"], np.fft.fft(z, axis=1))
    close(got["ifft"], np.fft.ifft(z, axis=1, norm="forward"))
    close(got["rfft"], np.fft.rfft(x, axis=1, norm="ortho"))
    close(got["irfft"], np.fft.irfft(z[:, :n // 2 + 1], axis=1, n=n))


@pytest.mark.parametrize("norm", F.NORMS)
@pytest.mark.parametrize("n", [11, 256])
def test_round_trips(ocl, rng, path, norm, n):
    """irfft(rfft(x), n) == x and ifft(fft(z)) == z, an odd and a power-of-two length."""
    def build(m):
        x, z = m.input("x", (3, n), F32), m.input("z", (n, 2), C64)
        return {"x": m.irfft(m.rfft(x, norm=norm), n=n, norm=norm),
                "z": m.ifft(m.fft(z, axis=0, norm=norm), axis=0, norm=norm)}
    inp = {"x": rng.standard_normal((3, n)).astype(np.float32), "z": crand(rng, n, 2)}
    got = run_fft(ocl, path, build, inp)
    close(got["x"], inp["x"].astype(np.float64), 1e-5)
    close(got["z"], inp["z"].astype(np.complex128), 1e-5)


def test_fft_conv1d_and_stft(ocl, rng):
    """The helpers of ir/fft.py compiled with the default fusion: fft_conv1d (zero-padded to
    336 = 4 * 4 * 3 * 7, rfft product, irfft) and a Hann-windowed stft (64-point frames)."""
    lx, lk, t, n_fft, hop = 300, 37, 200, 64, 16
    win = np.hanning(n_fft)
    def build(m):
        return {"conv": F.fft_conv1d(m, m.input("x", (2, lx), F32), m.input("k", (lk,), F32)),
                "stft": F.stft(m, m.input("s", (3, t), F32), n_fft, hop, win)}
    inp = {"x": rng.standard_normal((2, lx)), "k": rng.standard_normal(lk), "s": rng.standard_normal((3, t))}
    inp = {k: v.astype(np.float32) for k, v in inp.items()}
    got = run_fft(ocl, "local", build, inp, profile=DIRECT)
    x, k, s = (v.astype(np.float64) for v in inp.values())
    assert got["conv"].dtype == np.float32 and got["stft"].dtype == np.complex64
    close(got["conv"], np.stack([np.convolve(r, k) for r in x]))
    frames = 1 + (t - n_fft) // hop
    close(got["stft"], np.stack([[np.fft.rfft(row[f * hop:f * hop + n_fft] * win.astype(np.float32))
                                  for f in range(frames)] for row in s]))


@pytest.mark.filterwarnings("ignore:Casting complex values to real")     # the numpy reference's cast
def test_c64_values_and_elementwise(ocl, rng):
    """c64 as graph input, param and output (numpy's complex64 bytes, passed through exactly),
    binary add/sub/mul/div with broadcasting, a real scalar and a real tensor, casts both ways,
    where, a transpose; unfused and fused, against the numpy backend."""
    def build(m):
        z, w, p, x = (m.input("z", (3, 4), C64), m.input("w", (4,), C64), m.param("p", (3, 1), C64),
                      m.input("x", (3, 1), F32))
        return {"z": z, "p": p + 0.0, "mul": z * w, "div": z / w, "add": z + p, "sub": x - z,
                "scale": z * 2.5, "recip": 1.5 / w, "real": m.cast(z, F32), "cplx": m.cast(x, C64),
                "where": m.where(m.compare(x, 0.0, "gt"), z, x), "chain": (z * w + x) * 0.5 - z / (w + 1.0),
                "t": m.transpose(z, (1, 0))}
    g = Graph.define("c64", build)
    inp = {"z": crand(rng, 3, 4), "w": crand(rng, 4), "x": rng.standard_normal((3, 1)).astype(np.float32)}
    params = {"p": crand(rng, 3, 1)}
    np.testing.assert_array_equal(ocl.to_host(ocl.to_device(params["p"])), params["p"])
    ref = rlx_core.compile(g, profile=RAW, backend="numpy", params=params).run(inp)
    for prof in (RAW, DIRECT):
        got = run_cl(rlx_core.compile(g, profile=prof, backend=ocl, params=params), inp)
        np.testing.assert_array_equal(got["z"], inp["z"])
        np.testing.assert_array_equal(got["p"], params["p"])
        for k in ref:
            assert got[k].dtype == ref[k].dtype, k
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("build,msg", [
    (lambda m, z: m.exp(z * 2.0), r"activation exp on c64"),
    (lambda m, z: m.add("binary", (z, z), op="max"), r"binary max on c64"),
    (lambda m, z: m.compare(z, z, "eq"), r"compare eq on c64"),
    (lambda m, z: m.sum(z, 0), r"\(reduce\) has no OpenCL kernel for c64"),
])
def test_c64_without_a_kernel_names_op_and_dtype(ocl, build, msg):
    """Building the runner (the backend's compile) fails with the backend's error, unfused and
    fused, before any OpenCL source is built."""
    g = Graph.define("bad", lambda m: build(m, m.input("z", (3,), C64)))
    for prof in (RAW, DIRECT):
        with pytest.raises(BackendError, match=msg):
            rlx_core.compile(g, profile=prof, backend=ocl).run(z=np.ones(3, np.complex64))
