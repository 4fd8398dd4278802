"""Packed-weight kernels: GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K rows decoded by numba.

The layouts are rlx_core.ir.quant's (llama.cpp's block structs). One straight-line decoder
per format turns a packed row into floats (fixed trip counts over contiguous bytes, so LLVM
vectorizes them); two drivers are generated per format on top of it:
- `gemv`, decode (a few rows of x): parallel over chunks of output rows; each weight row is
  decoded once into an L1-sized buffer and dotted with every row of x, so each packed byte
  is read once and no float copy of the weight exists;
- `rows`, prefill: blocks of weight rows decoded in parallel into a bounded scratch, then
  multiplied by BLAS (the two run one after the other, never nested).
f16 scales come from a 65536-entry table (as ggml's); values compute in f32.
`prepare_dequant_matmul` binds them to a `dequant_matmul` node (runner.PREPARE).
"""
from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit

from rlx_core.backends.numpy.blas import single_threaded_blas
from rlx_core.ir.errors import ShapeError
from rlx_core.ir.quant import QuantScheme

from .codegen import load_source, with_epilogue

FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
GEMV_MAX_M = 8                  # rows of x up to which the GEMV beats decode-to-scratch + BLAS
SCRATCH = 1 << 20               # floats of weight decoded per BLAS call (prefill)
ROWS_PER_TASK = 16              # output rows a GEMV task decodes with one buffer
F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_OPT = dict(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})


@njit(inline="always", **_OPT)
def _h(r, o, tab):
    """The f16 at byte o of row r."""
    return tab[np.int32(r[o]) | (np.int32(r[o + 1]) << 8)]


@njit(inline="always", **_OPT)
def _u32(r, o):
    return (np.uint32(r[o]) | (np.uint32(r[o + 1]) << 8) | (np.uint32(r[o + 2]) << 16)
            | (np.uint32(r[o + 3]) << 24))


@njit(inline="always", **_OPT)
def _nib(r, qo, out, p, d, m, bias):
    """16 bytes of nibble pairs at qo: element j low, j + 16 high; value d * (q - bias) + m."""
    for j in range(16):
        b = np.int32(r[qo + j])
        out[p + j] = d * np.float32((b & 15) - bias) + m
        out[p + 16 + j] = d * np.float32((b >> 4) - bias) + m


@njit(inline="always", **_OPT)
def _nib5(r, qo, qh, out, p, d, m, bias):
    """As _nib with the 5th bit of element j in bit j of qh."""
    for j in range(16):
        b = np.int32(r[qo + j])
        lo = (b & 15) | np.int32(((qh >> j) & 1) << 4)
        hi = (b >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        out[p + j] = d * np.float32(lo - bias) + m
        out[p + 16 + j] = d * np.float32(hi - bias) + m


@njit(**_OPT)
def row_q4_0(r, out, tab):
    for b in range(out.shape[0] // 32):
        _nib(r, 18 * b + 2, out, 32 * b, _h(r, 18 * b, tab), np.float32(0), 8)


@njit(**_OPT)
def row_q4_1(r, out, tab):
    for b in range(out.shape[0] // 32):
        o = 20 * b
        _nib(r, o + 4, out, 32 * b, _h(r, o, tab), _h(r, o + 2, tab), 0)


@njit(**_OPT)
def row_q5_0(r, out, tab):
    for b in range(out.shape[0] // 32):
        o = 22 * b
        _nib5(r, o + 6, _u32(r, o + 2), out, 32 * b, _h(r, o, tab), np.float32(0), 16)


@njit(**_OPT)
def row_q5_1(r, out, tab):
    for b in range(out.shape[0] // 32):
        o = 24 * b
        _nib5(r, o + 8, _u32(r, o + 4), out, 32 * b, _h(r, o, tab), _h(r, o + 2, tab), 0)


@njit(**_OPT)
def row_q8_0(r, out, tab):
    ri = r.view(np.int8)
    for b in range(out.shape[0] // 32):
        o = 34 * b
        d = _h(r, o, tab)
        for j in range(32):
            out[32 * b + j] = d * np.float32(ri[o + 2 + j])


@njit(inline="always", **_OPT)
def _scale_min(r, so, j):
    """The 6-bit scale and min of sub-block j from the 12 bytes at so (get_scale_min_k4)."""
    if j < 4:
        return np.int32(r[so + j]) & 63, np.int32(r[so + j + 4]) & 63
    a, b, c = np.int32(r[so + j + 4]), np.int32(r[so + j - 4]), np.int32(r[so + j])
    return (a & 15) | ((b >> 6) << 4), (a >> 4) | ((c >> 6) << 4)


@njit(inline="always", **_OPT)
def _k45(r, o, out, p, five, tab):
    """One 256-element q4_k / q5_k block at byte o into out[p:p+256]."""
    d, dmin = _h(r, o, tab), _h(r, o + 2, tab)
    qs = o + (48 if five else 16)
    for c in range(4):
        s0, m0 = _scale_min(r, o + 4, 2 * c)
        s1, m1 = _scale_min(r, o + 4, 2 * c + 1)
        d0, n0 = d * np.float32(s0), dmin * np.float32(m0)
        d1, n1 = d * np.float32(s1), dmin * np.float32(m1)
        for ll in range(32):
            b = np.int32(r[qs + 32 * c + ll])
            lo, hi = b & 15, b >> 4
            if five:
                h = np.int32(r[o + 16 + ll])
                lo |= ((h >> (2 * c)) & 1) << 4
                hi |= ((h >> (2 * c + 1)) & 1) << 4
            out[p + 64 * c + ll] = d0 * np.float32(lo) - n0
            out[p + 64 * c + 32 + ll] = d1 * np.float32(hi) - n1


@njit(**_OPT)
def row_q4_k(r, out, tab):
    for b in range(out.shape[0] // 256):
        _k45(r, 144 * b, out, 256 * b, False, tab)


@njit(**_OPT)
def row_q5_k(r, out, tab):
    for b in range(out.shape[0] // 256):
        _k45(r, 176 * b, out, 256 * b, True, tab)


@njit(**_OPT)
def row_q6_k(r, out, tab):
    ri = r.view(np.int8)
    for b in range(out.shape[0] // 256):
        o, p = 210 * b, 256 * b
        d = _h(r, o + 208, tab)
        for nh in range(2):
            ql, qh, sc, q0 = o + 64 * nh, o + 128 + 32 * nh, o + 192 + 8 * nh, p + 128 * nh
            for ll in range(32):
                a, c = np.int32(r[ql + ll]), np.int32(r[ql + 32 + ll])
                h = np.int32(r[qh + ll])
                i = ll // 16
                out[q0 + ll] = d * np.float32(ri[sc + i]) * np.float32(((a & 15) | ((h & 3) << 4)) - 32)
                out[q0 + 32 + ll] = d * np.float32(ri[sc + i + 2]) * np.float32(
                    ((c & 15) | (((h >> 2) & 3) << 4)) - 32)
                out[q0 + 64 + ll] = d * np.float32(ri[sc + i + 4]) * np.float32(
                    ((a >> 4) | (((h >> 4) & 3) << 4)) - 32)
                out[q0 + 96 + ll] = d * np.float32(ri[sc + i + 6]) * np.float32(
                    ((c >> 4) | (((h >> 6) & 3) << 4)) - 32)


# --------------------------------------------------------------------------- dots
# Per format, the body of one block of a row . x dot product. Each element's product goes
# to lane j of a 32-float accumulator that lives across blocks (a fixed-length update with
# no reduction inside the block, which LLVM vectorizes); the lanes are summed once per row.
# A format with a min adds min * (sum of x over the sub-block) from `xs` to `extra`.
_LEGACY = """
        d = _h(r, o, tab)
        for j in range(16):
            q = np.int32(r[qo + j])
            lo = q & 15{lo5}
            hi = q >> 4{hi5}
            accv[j] += d * (np.float32(lo - {bias}) * x[p + j])
            accv[16 + j] += d * (np.float32(hi - {bias}) * x[p + 16 + j])"""
_K45 = """o = {nbytes} * b
        d, dmin = _h(r, o, tab), _h(r, o + 2, tab)
        for c in range(4):
            s0, m0 = _scale_min(r, o + 4, 2 * c)
            s1, m1 = _scale_min(r, o + 4, 2 * c + 1)
            extra -= dmin * (np.float32(m0) * xs[8 * b + 2 * c] + np.float32(m1) * xs[8 * b + 2 * c + 1])
            d0, d1 = d * np.float32(s0), d * np.float32(s1)
            for ll in range(32):
                q = np.int32(r[o + {qs} + 32 * c + ll])
                lo, hi = q & 15, q >> 4{five}
                accv[ll] += d0 * (np.float32(lo) * x[p + 64 * c + ll])
                accv[ll] += d1 * (np.float32(hi) * x[p + 64 * c + 32 + ll])"""
_BODIES = {
    "q4_0": ("o = 18 * b\n        qo = o + 2" + _LEGACY.format(lo5="", hi5="", bias=8), 32),
    "q4_1": ("o = 20 * b\n        qo = o + 4\n        extra += _h(r, o + 2, tab) * xs[b]"
             + _LEGACY.format(lo5="", hi5="", bias=0), 32),
    "q5_0": ("o = 22 * b\n        qo = o + 6\n        qh = _u32(r, o + 2)"
             + _LEGACY.format(lo5=" | np.int32(((qh >> j) & 1) << 4)",
                              hi5=" | np.int32(((qh >> (j + 16)) & 1) << 4)", bias=16), 32),
    "q5_1": ("o = 24 * b\n        qo = o + 8\n        qh = _u32(r, o + 4)\n"
             "        extra += _h(r, o + 2, tab) * xs[b]"
             + _LEGACY.format(lo5=" | np.int32(((qh >> j) & 1) << 4)",
                              hi5=" | np.int32(((qh >> (j + 16)) & 1) << 4)", bias=0), 32),
    "q8_0": ("""o = 34 * b
        d = _h(r, o, tab)
        for j in range(32):
            accv[j] += d * (np.float32(ri[o + 2 + j]) * x[p + j])""", 32),
    "q4_k": (_K45.format(nbytes=144, qs=16, five=""), 256),
    "q5_k": (_K45.format(nbytes=176, qs=48, five="""
                h = np.int32(r[o + 16 + ll])
                lo |= ((h >> (2 * c)) & 1) << 4
                hi |= ((h >> (2 * c + 1)) & 1) << 4"""), 256),
    "q6_k": ("""o = 210 * b
        d = _h(r, o + 208, tab)
        for nh in range(2):
            ql, qh, sc, q0 = o + 64 * nh, o + 128 + 32 * nh, o + 192 + 8 * nh, p + 128 * nh
            for half in range(2):
                d0, d1 = d * np.float32(ri[sc + half]), d * np.float32(ri[sc + half + 2])
                d2, d3 = d * np.float32(ri[sc + half + 4]), d * np.float32(ri[sc + half + 6])
                for l16 in range(16):
                    ll = 16 * half + l16
                    a, c = np.int32(r[ql + ll]), np.int32(r[ql + 32 + ll])
                    h = np.int32(r[qh + ll])
                    accv[ll] += d0 * (np.float32(((a & 15) | ((h & 3) << 4)) - 32) * x[q0 + ll])
                    accv[ll] += d1 * (np.float32(((c & 15) | (((h >> 2) & 3) << 4)) - 32) * x[q0 + 32 + ll])
                    accv[ll] += d2 * (np.float32(((a >> 4) | (((h >> 4) & 3) << 4)) - 32) * x[q0 + 64 + ll])
                    accv[ll] += d3 * (np.float32(((c >> 4) | (((h >> 6) & 3) << 4)) - 32) * x[q0 + 96 + ll])""",
             256),
}

_DRIVERS = '''
import numpy as np
from numba import njit, prange
from rlx_backend_numba.quant_kernels import _h, _scale_min, _u32, row_{fmt} as decode

_OPT = dict(cache=True, error_model="numpy", fastmath={{"reassoc", "contract"}})


@njit(inline="always", **_OPT)
def dot(r, x, xs, accv, tab):
    """Packed row r . x (xs: sums of x over its 32-element blocks)."""
    ri = r.view(np.int8)
    accv[:] = 0
    extra = np.float32(0)
    for b in range(x.shape[0] // {block}):
        p = {block} * b
        {body}
    return accv.sum() + extra


@njit(parallel=True, **_OPT)
def gemv(x, w, o, tab):
    m_, k_ = x.shape
    xs = np.empty((m_, k_ // 32), np.float32)
    for m in range(m_):
        for b in range(k_ // 32):
            xs[m, b] = x[m, 32 * b:32 * b + 32].sum()
    n_ = w.shape[0]
    for t in prange((n_ + {rows} - 1) // {rows}):
        accv = np.empty(32, np.float32)
        for n in range({rows} * t, min({rows} * (t + 1), n_)):
            for m in range(m_):
                o[m, n] = dot(w[n], x[m], xs[m], accv, tab)


@njit(parallel=True, **_OPT)
def rows(w, r0, out, tab):
    for i in prange(out.shape[0]):
        decode(w[r0 + i], out[i], tab)


@njit(nogil=True, **_OPT)
def rows_ser(w, r0, out, tab):
    for i in range(out.shape[0]):
        decode(w[r0 + i], out[i], tab)
'''


@functools.lru_cache(maxsize=None)
def drivers(kind: str):
    """The generated module with `gemv` and `rows` for one format."""
    body, block = _BODIES[kind]
    return load_source(_DRIVERS.format(fmt=kind, rows=ROWS_PER_TASK, block=block, body=body))


# --------------------------------------------------------------------------- host side
def _args(scheme, raw, k: int):
    s = QuantScheme.parse(scheme)
    if s.kind not in FORMATS:
        raise ShapeError(f"numba dequant kernels: scheme {s.name} is not one of {FORMATS}")
    rows, per_row = s.packed_shape((1, k))
    w = raw.reshape(-1, per_row) if raw.ndim != 2 else raw
    if w.shape[1] != per_row:
        raise ShapeError(f"numba dequant kernels: packed {s.name} rows of {w.shape[1]} bytes do not "
                         f"hold K={k} ({per_row} bytes expected)")
    return w, drivers(s.kind)


def dequant_rows(raw: np.ndarray, scheme, out: np.ndarray, r0: int = 0) -> np.ndarray:
    """Packed rows r0 .. r0 + len(out) decoded into `out` [rows, K] (f32)."""
    w, mod = _args(scheme, raw, out.shape[-1])
    mod.rows(w, r0, out, F16)
    return out


def dequant_gemv(x: np.ndarray, raw: np.ndarray, scheme, out: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] (f32) @ W^T for the packed W (rows of bytes): [M, N]."""
    w, mod = _args(scheme, raw, x.shape[-1])
    out = np.empty((x.shape[0], w.shape[0]), x.dtype) if out is None else out
    mod.gemv(x, w, out, F16)
    return out


_LOCAL = threading.local()


def scratch(rows: int, k: int) -> np.ndarray:
    """This thread's decode scratch as [rows, k] f32: one buffer shared by every step (steps
    of a thread run one at a time), so a model's many matmuls do not each hold one."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < rows * k:
        buf = _LOCAL.buf = np.empty(rows * k, np.float32)
    return buf[:rows * k].reshape(rows, k)


def _rows_times_x(mod, w, xf, out, r0: int, r1: int) -> None:
    """out[:, r0:r1] = xf @ W[r0:r1]^T, decoding blocks of rows into this thread's scratch."""
    k = xf.shape[1]
    step = max(1, min(r1 - r0, SCRATCH // max(k, 1)))
    buf = scratch(step, k)
    for r in range(r0, r1, step):
        e = min(r1, r + step)
        mod.rows_ser(w, r, buf[:e - r], F16)
        np.matmul(xf, buf[:e - r].T, out=out[:, r:e])


@functools.lru_cache(maxsize=None)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix="rlx-numba-gemm")


def dequant_matmul(x: np.ndarray, raw: np.ndarray, scheme, out: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] @ W^T: W's rows split over the threads, each decoding blocks of its rows into
    its own scratch and multiplying them with one-thread BLAS (BLAS's own pool would spin
    beside numba's threads on the same cores)."""
    k = x.shape[-1]
    w, mod = _args(scheme, raw, k)
    n = w.shape[0]
    out = np.empty((x.shape[0], n), x.dtype) if out is None else out
    xf = np.ascontiguousarray(x, np.float32)
    parts = max(1, min(numba.get_num_threads(), n // 64))
    bounds = [n * i // parts for i in range(parts + 1)]
    with single_threaded_blas():
        if parts == 1:
            _rows_times_x(mod, w, xf, out, 0, n)
        else:
            list(_pool(parts).map(lambda i: _rows_times_x(mod, w, xf, out, bounds[i], bounds[i + 1]),
                                  range(parts)))
    return out


def prepare_dequant_matmul(a, outs, protos, op=None):
    """A runner step for `dequant_matmul` (x, packed w, bias?; attrs scheme, act): the GEMV for
    a few rows, decode-to-scratch + BLAS otherwise, then the generated bias/act epilogue."""
    x, w, o = protos[0], protos[1], outs[0]
    s = QuantScheme.parse(a["scheme"])               # checked by the op table's schema
    if s.kind not in FORMATS or x.dtype != np.float32 or o.dtype != np.float32 or o.size == 0:
        return None
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    o2 = o.reshape(m, -1)
    if m <= GEMV_MAX_M:
        _args(s, w, k)                                   # checked once: the step runs per token
        gemv = drivers(s.kind).gemv
        mm = lambda x, w: gemv(x.reshape(m, k), w, o2, F16)  # noqa: E731
    else:
        mm = lambda x, w: dequant_matmul(x.reshape(m, k), w, s, o2)  # noqa: E731
    return with_epilogue(mm, o, protos[2:], a.get("act", "identity"))


__all__ = ["FORMATS", "dequant_gemv", "dequant_matmul", "dequant_rows", "prepare_dequant_matmul"]
