"""Packed-weight kernels: GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K rows decoded by numba.

The layouts are rlx_core.ir.quant's (llama.cpp's block structs). One decoder per format
turns a packed row into floats; on top of it:
- `dequant_gemv(x, raw, scheme)`, decode (a few rows of x): parallel over chunks of output
  rows; each weight row is decoded once into an L1-sized buffer and dotted with every row of
  x, so each packed byte is read once and no float copy of the weight exists;
- `dequant_matmul(x, raw, scheme)`, prefill: blocks of weight rows decoded in parallel into a
  bounded scratch, multiplied by BLAS (the two run one after the other, never nested).
f16 scales come from a 65536-entry table (as ggml's), values compute in f32.
`prepare_dequant_matmul` binds them to a `dequant_matmul` node (runner.PREPARE).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from rlx_core.ir.errors import ShapeError
from rlx_core.ir.quant import QuantScheme

FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
GEMV_MAX_M = 8                  # rows of x up to which the GEMV beats decode-to-scratch + BLAS
SCRATCH = 1 << 20               # floats of weight decoded per BLAS call (prefill)
ROWS_PER_TASK = 16              # output rows a GEMV task decodes with one buffer
F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_OPT = dict(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})


@njit(**_OPT)
def _h(w, n, o, tab):
    return tab[np.int64(w[n, o]) | (np.int64(w[n, o + 1]) << 8)]


@njit(**_OPT)
def _u32(w, n, o):
    return (np.int64(w[n, o]) | (np.int64(w[n, o + 1]) << 8) | (np.int64(w[n, o + 2]) << 16)
            | (np.int64(w[n, o + 3]) << 24))


@njit(**_OPT)
def _legacy(w, n, o, out, p, fmt, tab):
    """One 32-element block of q4_0/q4_1/q5_0/q5_1/q8_0 at byte o into out[p:p+32]."""
    d = _h(w, n, o, tab)
    if fmt == 4:                                          # q8_0
        for j in range(32):
            v = np.int64(w[n, o + 2 + j])
            out[p + j] = d * np.float32(v - 256 if v > 127 else v)
        return
    has_min = fmt == 1 or fmt == 3
    m = _h(w, n, o + 2, tab) if has_min else np.float32(0)
    five = fmt == 2 or fmt == 3
    qo = o + (4 if has_min else 2)
    qh = np.int64(0)
    if five:
        qh = _u32(w, n, qo)
        qo += 4
    bias = np.float32(0 if has_min else (16 if five else 8))
    for j in range(16):
        b = np.int64(w[n, qo + j])
        lo, hi = b & 15, b >> 4
        if five:
            lo |= ((qh >> j) & 1) << 4
            hi |= ((qh >> (j + 16)) & 1) << 4
        out[p + j] = d * (np.float32(lo) - bias) + m
        out[p + 16 + j] = d * (np.float32(hi) - bias) + m


@njit(**_OPT)
def _scale_min(w, n, so, j):
    if j < 4:
        return np.int64(w[n, so + j]) & 63, np.int64(w[n, so + j + 4]) & 63
    a, b, c = np.int64(w[n, so + j + 4]), np.int64(w[n, so + j - 4]), np.int64(w[n, so + j])
    return (a & 15) | ((b >> 6) << 4), (a >> 4) | ((c >> 6) << 4)


@njit(**_OPT)
def _k45(w, n, o, out, p, five, tab):
    """One 256-element q4_k / q5_k block."""
    d, dmin = _h(w, n, o, tab), _h(w, n, o + 2, tab)
    qh = o + 16
    qs = o + (48 if five else 16)
    for c in range(4):
        for half in range(2):
            s = 2 * c + half
            sc, mn = _scale_min(w, n, o + 4, s)
            ds, dm = d * np.float32(sc), dmin * np.float32(mn)
            for ll in range(32):
                b = np.int64(w[n, qs + 32 * c + ll])
                q = (b >> 4) if half else (b & 15)
                if five:
                    q += ((np.int64(w[n, qh + ll]) >> s) & 1) << 4
                out[p + 64 * c + 32 * half + ll] = ds * np.float32(q) - dm


@njit(**_OPT)
def _k6(w, n, o, out, p, tab):
    """One 256-element q6_k block."""
    d = _h(w, n, o + 208, tab)
    for nh in range(2):
        for ll in range(32):
            h = np.int64(w[n, o + 128 + 32 * nh + ll])
            lo, hi = np.int64(w[n, o + 64 * nh + ll]), np.int64(w[n, o + 64 * nh + ll + 32])
            for k in range(4):
                src = lo if k % 2 == 0 else hi
                q = ((src >> 4) if k >= 2 else (src & 15)) | (((h >> (2 * k)) & 3) << 4)
                i = 128 * nh + 32 * k + ll
                sc = np.int64(w[n, o + 192 + i // 16])
                out[p + i] = d * np.float32(sc - 256 if sc > 127 else sc) * np.float32(q - 32)


@njit(**_OPT)
def decode_row(w, n, out, fmt, block, bpb, tab):
    """Packed row n of w into out[:K]."""
    for blk in range(out.shape[0] // block):
        o, p = blk * bpb, blk * block
        if fmt <= 4:
            _legacy(w, n, o, out, p, fmt, tab)
        elif fmt == 7:
            _k6(w, n, o, out, p, tab)
        else:
            _k45(w, n, o, out, p, fmt == 6, tab)


@njit(parallel=True, **_OPT)
def gemv_packed(x, w, o, fmt, block, bpb, tab):
    """o[m, n] = x[m] . row n of the packed weight, for every m; tasks of ROWS_PER_TASK rows."""
    m_, k_ = x.shape
    n_ = w.shape[0]
    for t in prange((n_ + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        buf = np.empty(k_, np.float32)
        for n in range(ROWS_PER_TASK * t, min(ROWS_PER_TASK * (t + 1), n_)):
            decode_row(w, n, buf, fmt, block, bpb, tab)
            for m in range(m_):
                acc = x[m, 0] * 0
                for c in range(k_):
                    acc += x[m, c] * buf[c]
                o[m, n] = acc


@njit(parallel=True, **_OPT)
def dequant_rows(w, r0, out, fmt, block, bpb, tab):
    """Packed rows r0 .. r0 + len(out) into out (rows of floats), in parallel."""
    for i in prange(out.shape[0]):
        decode_row(w, r0 + i, out[i], fmt, block, bpb, tab)


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
    return w, FORMATS.index(s.kind), s.block_size, s.bytes_per_block


def dequant_gemv(x: np.ndarray, raw: np.ndarray, scheme, out: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] (f32) @ W^T for the packed W (rows of bytes): [M, N]."""
    w, fmt, block, bpb = _args(scheme, raw, x.shape[-1])
    out = np.empty((x.shape[0], w.shape[0]), x.dtype) if out is None else out
    gemv_packed(x, w, out, fmt, block, bpb, F16)
    return out


def dequant_matmul(x: np.ndarray, raw: np.ndarray, scheme, out: np.ndarray | None = None,
                   scratch: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] @ W^T: blocks of W decoded into a bounded scratch, then BLAS."""
    k = x.shape[-1]
    w, fmt, block, bpb = _args(scheme, raw, k)
    n = w.shape[0]
    out = np.empty((x.shape[0], n), x.dtype) if out is None else out
    step = max(1, min(n, SCRATCH // max(k, 1)))
    scratch = np.empty((step, k), np.float32) if scratch is None else scratch
    xf = x.astype(np.float32, copy=False)
    for r in range(0, n, step):
        e = min(n, r + step)
        dequant_rows(w, r, scratch[:e - r], fmt, block, bpb, F16)
        np.matmul(xf, scratch[:e - r].T, out=out[:, r:e])
    return out


def prepare_dequant_matmul(a, outs, protos, op=None):
    """A runner step for `dequant_matmul` (x, packed w, bias?; attrs scheme, act): the GEMV for
    a few rows, decode-to-scratch + BLAS otherwise, then the generated bias/act epilogue."""
    from . import codegen

    x, w, o = protos[0], protos[1], outs[0]
    try:
        s = QuantScheme.parse(a["scheme"])
    except Exception:
        return None
    if s.kind not in FORMATS or x.dtype != np.float32 or o.dtype != np.float32 or o.size == 0:
        return None
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    o2 = o.reshape(m, -1)
    if m <= GEMV_MAX_M:
        mm = lambda x, w: dequant_gemv(x.reshape(m, k), w, s, o2)  # noqa: E731
    else:
        scratch = np.empty((max(1, min(o2.shape[1], SCRATCH // max(k, 1))), k), np.float32)
        mm = lambda x, w: dequant_matmul(x.reshape(m, k), w, s, o2, scratch)  # noqa: E731
    epi = codegen.epilogue_step(o, protos[2:], a.get("act", "identity"))
    if epi is None:
        return None

    def run(a_, out, x, w, *bias):
        mm(x, w)
        epi(*bias)
    return run


__all__ = ["FORMATS", "dequant_gemv", "dequant_matmul", "prepare_dequant_matmul", "decode_row"]
