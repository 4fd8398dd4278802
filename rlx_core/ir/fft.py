"""FFT ops over one axis, like numpy.fft, with `norm` backward / ortho / forward:

  fft, ifft   c64 -> c64, same shape
  rfft        float -> c64, the axis becomes n // 2 + 1
  irfft       c64 -> f32, the axis becomes `n` (default 2 * (m - 1)); n // 2 + 1 must be m

and helpers composed from them (graph-building functions, no ops of their own): `fftfreq`
(a constant table), `stft` (frames gathered, windowed, rfft) and `fft_conv1d` (full linear
convolution by zero-padded rfft products). The NumPy kernels call numpy.fft (numba runs
them too), cuda calls cuFFT, opencl has its own Stockham kernels; a backend without them
gets the composites below (a DFT as one real matmul with a constant cos/sin table: O(n^2),
for a static length along the axis).
"""
from __future__ import annotations

import numpy as np

from .composites import composite, ex, in_f32
from .dtype import C64, F32, I64, DType
from .errors import DTypeError, ShapeError
from .graph import Value
from .numpy_kernels import KERNELS, put, up
from .ops import INT, COUNT, infer, one_of, op
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


# ----------------------------------------------------------------- composites
# A DFT along one axis is a real-linear map of the (real, imaginary) parts: one matmul of
# [re | im] [.., 2n] with a constant block table of cos and sin. The primitives have no
# complex matmul: a c64 value is split into two f32 parts and joined back at the end.
def _norm_scale(norm: str, n: int, inverse: bool) -> float:
    """numpy.fft's factor: 'backward' scales the inverse by 1/n, 'forward' the forward
    transform, 'ortho' both by 1/sqrt(n)."""
    if norm == "ortho":
        return 1.0 / float(np.sqrt(n))
    return 1.0 / n if (norm == "forward") != inverse else 1.0


def _roots(rows: int, cols: int, n: int, inverse: bool, scale: float) -> tuple:
    """(c, s) float64 [rows, cols] with scale * exp(-+2 pi i j k / n) = c + i s (+ for the
    inverse); j k is reduced mod n first, so the angles stay exact for a long axis."""
    turn = 2.0 * np.pi * (np.outer(np.arange(rows), np.arange(cols)) % n) / n
    return scale * np.cos(turn), (1.0 if inverse else -1.0) * scale * np.sin(turn)


def _parts(m, z) -> list:
    """[re, im] f32 of a c64 z: the complex -> real cast keeps the real part, and z * -i has
    z's imaginary part as its real part."""
    return [m.cast(z, F32), m.cast(z * m.constant(np.complex64(-1j), C64), F32)]


def _joined(m, y, k: int):
    """c64 re + i im from y [.., 2k] = [re | im]."""
    re, im = m.narrow(y, -1, 0, k), m.narrow(y, -1, k, k)
    return re + im * m.constant(np.complex64(1j), C64)


def _along_last(m, x, ax: int, fn):
    """fn ([.., n] -> [.., n'], rank >= 2 as matmul needs) applied along axis `ax` of x:
    the axis moved last and back, a vector made a row and back."""
    rank = x.shape.rank
    perm = [i for i in range(rank) if i != ax] + [ax]
    moved = x if ax == rank - 1 else m.transpose(x, perm)
    y = fn(moved if rank > 1 else m.reshape(moved, (1,) + moved.dims))
    y = y if rank > 1 else m.reshape(y, y.dims[1:])
    return y if ax == rank - 1 else m.transpose(y, [perm.index(i) for i in range(rank)])


def fft_prims(m, z, a: dict, inverse: bool, name: str):
    """fft / ifft of c64 z: [re | im] @ [[c, s], [-s, c]] is (re c - im s | re s + im c)."""
    ax, n = _axis_len(z.shape, a, name)
    c, s = _roots(n, n, n, inverse, _norm_scale(a["norm"], n, inverse))
    table = m.constant(np.block([[c, s], [-s, c]]), F32)
    return _along_last(m, z, ax, lambda v: _joined(m, m.matmul(m.concat(_parts(m, v), -1), table), n))


def rfft_prims(m, x, a: dict):
    """rfft of real x (in f32, f64 for f64): x @ [c | s] over the n // 2 + 1 non-negative
    frequencies."""
    ax, n = _axis_len(x.shape, a, "rfft")
    k = n // 2 + 1
    xf = in_f32(m, x)
    c, s = _roots(n, k, n, False, _norm_scale(a["norm"], n, False))
    table = m.constant(np.concatenate([c, s], 1), xf.dtype)
    return _along_last(m, xf, ax, lambda v: _joined(m, m.matmul(v, table), k))


def irfft_prims(m, z, a: dict):
    """irfft of c64 z [.., k] to the meta's n reals: the Hermitian sum re c - im s, each
    frequency weighted 2 (itself and its mirror image) but DC and, for an even n, Nyquist,
    which have no mirror: 1. Their imaginary parts meet sin(0) and sin(pi t), zero to rounding,
    and drop out as numpy drops them."""
    ax, k = _axis_len(z.shape, a, "irfft")
    n = infer("irfft", [z.shape], a)[0].dims[ax]
    c, s = _roots(k, n, n, True, _norm_scale(a["norm"], n, True))
    w = np.full((k, 1), 2.0)
    w[0] = 1.0
    if n % 2 == 0:
        w[k - 1] = 1.0
    table = m.constant(np.concatenate([w * c, -w * s], 0), F32)
    return _along_last(m, z, ax, lambda v: m.matmul(m.concat(_parts(m, v), -1), table))


_COMPLEX_EXAMPLES = (ex("c64[2,8]"), ex("c64[5,3]", axis=0), ex("c64[7]"))


@composite("fft", *_COMPLEX_EXAMPLES)
def _fft(m, ins, a):
    return fft_prims(m, ins[0], a, False, "fft")


@composite("ifft", *_COMPLEX_EXAMPLES)
def _ifft(m, ins, a):
    return fft_prims(m, ins[0], a, True, "ifft")


@composite("rfft", ex("f16[2,8]"), ex("f32[5,3]", axis=0), ex("f64[7]"))
def _rfft(m, ins, a):
    return rfft_prims(m, ins[0], a)


@composite("irfft", ex("c64[2,5]"), ex("c64[5,3]", axis=0, n=9), ex("c64[4]"))
def _irfft(m, ins, a):
    return irfft_prims(m, ins[0], a)


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
