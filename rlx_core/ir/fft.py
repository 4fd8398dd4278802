"""FFT ops over one axis, like numpy.fft, with `norm` backward / ortho / forward:

  fft, ifft   c64 -> c64, same shape
  rfft        float -> c64, the axis becomes n // 2 + 1
  irfft       c64 -> f32, the axis becomes `n` (default 2 * (m - 1)); n // 2 + 1 must be m

and helpers composed from them (graph-building functions, no ops of their own): `fftfreq`
(a constant table), `stft` (frames gathered, windowed, rfft) and `fft_conv1d` (full linear
convolution by zero-padded rfft products). The NumPy kernels call numpy.fft (numba runs
them too), cuda calls cuFFT, opencl has its own Stockham kernels; a backend without them
fails to compile naming the op.
"""
from __future__ import annotations

import numpy as np

from .dtype import C64, F32, I64, DType
from .errors import DTypeError, ShapeError
from .graph import Value
from .numpy_kernels import KERNELS, put, up
from .ops import INT, COUNT, one_of, op
from .shape import Shape, norm_axis

NORMS = ("backward", "ortho", "forward")
_ATTRS = {"axis": INT(-1), "norm": one_of(NORMS)("backward")}


def _axis_len(x: Shape, a: dict, name: str) -> tuple:
    ax = norm_axis(a["axis"], x.rank, name)
    d = x.dims[ax]
    if isinstance(d, str):
        raise ShapeError(f"{name} needs a static length along axis {ax}, got {x}")
    return ax, d


def _complex_in(x: Shape, name: str) -> None:
    if not x.dtype.is_complex:
        raise DTypeError(f"{name} takes c64, got {x.dtype.value} (rfft takes real input)")


@op("fft", ["x"], attrs=dict(_ATTRS))
def _m_fft(s, a):
    """Discrete Fourier transform along `axis` (numpy.fft.fft), c64 -> c64."""
    _complex_in(s[0], "fft")
    norm_axis(a["axis"], s[0].rank, "fft")
    return (s[0],)


@op("ifft", ["x"], attrs=dict(_ATTRS))
def _m_ifft(s, a):
    """Inverse DFT along `axis` (numpy.fft.ifft), c64 -> c64."""
    _complex_in(s[0], "ifft")
    norm_axis(a["axis"], s[0].rank, "ifft")
    return (s[0],)


@op("rfft", ["x"], attrs=dict(_ATTRS))
def _m_rfft(s, a):
    """DFT of real input along `axis` (numpy.fft.rfft): the n // 2 + 1 non-negative
    frequencies, float -> c64."""
    x = s[0]
    if not x.dtype.is_float:
        raise DTypeError(f"rfft takes a float input, got {x.dtype.value}")
    ax, d = _axis_len(x, a, "rfft")
    if d == 0:
        raise ShapeError(f"rfft of an empty axis {ax} of {x}")
    return (Shape(x.dims[:ax] + (d // 2 + 1,) + x.dims[ax + 1:], C64),)


@op("irfft", ["x"], attrs=dict(_ATTRS, n=COUNT(0)))
def _m_irfft(s, a):
    """Inverse of rfft along `axis` (numpy.fft.irfft): n real outputs (0: 2 * (m - 1))
    from m = n // 2 + 1 frequencies, c64 -> f32."""
    x = s[0]
    _complex_in(x, "irfft")
    ax, m = _axis_len(x, a, "irfft")
    n = a["n"] or 2 * (m - 1)
    if n < 1 or n // 2 + 1 != m:
        raise ShapeError(f"irfft n={a['n']}: {n} outputs need {n // 2 + 1} frequencies along "
                         f"axis {ax}, the input has {m}")
    return (Shape(x.dims[:ax] + (n,) + x.dims[ax + 1:], F32),)


def _kernel(fn, with_n=False):
    def run(a, out, x):
        kw = {"n": out[0].shape[a["axis"]]} if with_n else {}
        put(out[0], fn(up(x), axis=a["axis"], norm=a["norm"], **kw))
    return run


KERNELS.update({"fft": _kernel(np.fft.fft), "ifft": _kernel(np.fft.ifft),
                "rfft": _kernel(np.fft.rfft), "irfft": _kernel(np.fft.irfft, with_n=True)})


# ----------------------------------------------------------------- helpers
def fftfreq(m, n: int, d: float = 1.0, dtype=F32):
    """The sample frequencies of an n-point fft with spacing d (numpy.fft.fftfreq): a constant."""
    return m.constant(np.fft.fftfreq(n, d), DType.parse(dtype))


def stft(m, x, n_fft: int, hop: int, window=None, norm: str = "backward"):
    """Short-time Fourier transform of real x [..., T] (no centering or padding, like
    torch.stft(center=False)): frames t * hop .. t * hop + n_fft, times `window` (a value or
    array [n_fft]; default rectangular), rfft -> c64 [..., frames, n_fft // 2 + 1]."""
    t = x.dims[-1]
    if isinstance(t, str) or t < n_fft or hop < 1:
        raise ShapeError(f"stft: n_fft={n_fft}, hop={hop} do not fit a signal of length {t}")
    frames = 1 + (t - n_fft) // hop
    idx = np.arange(frames)[:, None] * hop + np.arange(n_fft)[None, :]
    f = m.gather(x, m.constant(idx.astype(np.int64), I64), axis=-1)
    if window is not None:
        f = f * (window if isinstance(window, Value) else m.constant(np.asarray(window), x.dtype))
    return m.add("rfft", (f,), axis=-1, norm=norm)


def fft_conv1d(m, x, k):
    """Full linear convolution along the last axis (numpy.convolve 'full'): both zero-padded
    to Lx + Lk - 1, multiplied as rffts, irfft back. x [..., Lx], k [..., Lk] broadcast."""
    lx, lk = x.dims[-1], k.dims[-1]
    if isinstance(lx, str) or isinstance(lk, str):
        raise ShapeError(f"fft_conv1d needs static lengths, got {x.shape} and {k.shape}")
    n = lx + lk - 1

    def pad(v, length):
        if length == n:
            return v
        zeros = m.constant(np.zeros(v.dims[:-1] + (n - length,), v.dtype.np), v.dtype)
        return m.concat([v, zeros], -1)
    fx = m.add("rfft", (pad(x, lx),), axis=-1)
    fk = m.add("rfft", (pad(k, lk),), axis=-1)
    y = m.add("irfft", (fx * fk,), axis=-1, n=n)
    return m.cast(y, x.dtype)
