"""Packed-weight kernels: GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K rows read by numba.

The layouts are rlx_core.ir.quant's (llama.cpp's block structs). Each format is one
function, `lanes_<fmt>`, giving eight dequantized values of a block as an explicit SIMD
vector (simd.py); drivers generated per format unroll it over a block and either
- `gemv`, decode (a few rows of x): parallel over chunks of output rows; one row of x is
  multiply-added lane by lane as the packed row is read (no float copy of the weight
  anywhere); 2-8 rows of x share each decode of a weight row's lanes in registers, and
  two weight rows each load of x (a tile, `_gemv_tile`); more rows run as even tiles, one
  after the other over a task's weight rows (so only one tile's rows of x stay in L1);
- `rows`, prefill: on a CPU with AMX, blocks of weight rows decoded into tiles of exact
  bf16 parts and multiplied with x's parts to f32 accuracy (`rows_f32`), or with
  `[backend] matmul = "bf16"` rounded to bf16 and multiplied once (`rows_bf16`); elsewhere
  (or with matmul = "blas"), decoded into a bounded scratch, then multiplied by BLAS (the
  two run one after the other, never nested).
f16 scales come from a 65536-entry table (as ggml's); values compute in f32.
`prepare_dequant_matmul` binds them to a `dequant_matmul` node (runner.PREPARE).
"""
from __future__ import annotations

import functools
import math
import threading

import numba
import numpy as np
from numba import njit, prange

from rlx_core.backends.numpy.blas import single_threaded_blas
from rlx_core.ir.errors import ShapeError
from rlx_core.ir.quant import QuantScheme

from . import amx, cblas
from .cblas import SGEMM
from .codegen import SWIGLU_HEAD, bindable, load_source, read_only, with_epilogue
from .simd import (AVX512, VNNI, VNNI512, add_high8, bits, fold16, high8, k4_factors, pair_lanes, nibble_fma16, nibble_pair_dot,
                   scaled16, zeros16, bits32, blend4, fma, halves, hmax, hsum, idot_s, idot_u, lane, prefetch,
                   load_bytes32, load_f32, load_i8, load_u8, load_u32, nibbles32, round_int8, store_lanes,
                   to_f32, vabs, vmax, zeros)

FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
GEMV_MAX_M = 16                 # rows of x up to which the GEMV beats decode-to-scratch + BLAS (SmolLM2's
                                # matmuls, one core: 1.8x at 16 rows, 1.1x at 32; benchmarks/gemv_rows.py)
GEMV_TILE = 8                   # rows of x the GEMV multiplies with one decode of a packed row (tiles of
                                # up to 12 ran 9-10 rows 7-13% faster, for 1.3-1.4x a format's cold
                                # compile: benchmarks/README.md, serve_race.py, session 13)
IGEMV_MAX_M = 8                 # the same for the int8 GEMV (a row's integer dot each: no tile)
SCRATCH = 1 << 20               # floats of weight decoded per BLAS call (prefill)
ROWS_PER_TASK = 16              # output rows per GEMV task
GEMV_SERIAL_BYTES = 1 << 20     # packed W below which the int8 GEMV runs on the calling thread (a MoE router,
                                # 64 x 2048 q4_k: ~5 us of work, where a parallel region's start costs
                                # tens of microseconds, milliseconds while the cores are busy)
AHEAD_ROWS = 4                  # GEMVs prefetch the packed row this far ahead (+5-10% from DRAM)
Q4K_AHEAD = 8192                # bytes ahead q4_k's int8 row dot asks for as it reads (idot_q4_k_512)
F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_OPT = dict(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})


@njit(**_OPT)
def _h(r, o, tab):
    """The f16 at byte o of row r."""
    return tab[np.int32(r[o]) | (np.int32(r[o + 1]) << 8)]


@njit(**_OPT)
def _nibbles(r, qo, i):
    """Lanes 8i..8i+7 of a 32-element block whose 16 bytes at qo hold element j in the low
    nibble of byte j and element j + 16 in the high one."""
    q = load_u8(r, qo + 8 * (i & 1))
    return (q & 15) if i < 2 else (q >> 4)


# --------------------------------------------------------------------------- formats
# One function per format: `lanes_<fmt>(r, o, i, tab)`, the dequantized values of lanes
# 8i..8i+7 of the block at byte o of packed row r, as an F32x8. The drivers below call it
# with constant i for every lane group of a block (so scale lookups fold and repeated byte
# loads merge) and either store the lanes (prefill's decode, as f32, bf16 or three bf16
# parts) or multiply-add them with x (decode's GEMV): one description of each format serves
# every driver.
@njit(**_OPT)
def lanes_q4_0(r, o, i, tab):
    d = _h(r, o, tab)
    return fma(d, to_f32(_nibbles(r, o + 2, i)), np.float32(-8) * d)


@njit(**_OPT)
def lanes_q4_1(r, o, i, tab):
    return fma(_h(r, o, tab), to_f32(_nibbles(r, o + 4, i)), _h(r, o + 2, tab))


@njit(**_OPT)
def lanes_q5_0(r, o, i, tab):
    d = _h(r, o, tab)
    q = _nibbles(r, o + 6, i) | (bits(load_u32(r, o + 2), 8 * i) << 4)
    return fma(d, to_f32(q), np.float32(-16) * d)


@njit(**_OPT)
def lanes_q5_1(r, o, i, tab):
    q = _nibbles(r, o + 8, i) | (bits(load_u32(r, o + 4), 8 * i) << 4)
    return fma(_h(r, o, tab), to_f32(q), _h(r, o + 2, tab))


@njit(**_OPT)
def lanes_q8_0(r, o, i, tab):
    return _h(r, o, tab) * to_f32(load_i8(r, o + 2 + 8 * i))


@njit(**_OPT)
def _scale_min(r, so, j):
    """The 6-bit scale and min of sub-block j from the 12 bytes at so (get_scale_min_k4)."""
    if j < 4:
        return np.int32(r[so + j]) & 63, np.int32(r[so + j + 4]) & 63
    a, b, c = np.int32(r[so + j + 4]), np.int32(r[so + j - 4]), np.int32(r[so + j])
    return (a & 15) | ((b >> 6) << 4), (a >> 4) | ((c >> 6) << 4)


@njit(**_OPT)
def _k45_q(r, o, j, g, qs, five):
    """The codes of lane group g (8 lanes) of sub-block j of a q4_k / q5_k super-block."""
    ll = 8 * g
    q = load_u8(r, o + qs + 32 * (j // 2) + ll)
    q = (q & 15) if j % 2 == 0 else (q >> 4)
    if five:
        q = q | (((load_u8(r, o + 16 + ll) >> j) & 1) << 4)
    return q


@njit(**_OPT)
def _k45(r, o, i, tab, qs, five):
    """Lanes of a q4_k / q5_k super-block: 8 sub-blocks of 32, each with a 6-bit scale and
    min; chunk c's 32 bytes hold sub-block 2c in the low nibbles, 2c + 1 in the high ones
    (q5_k: their 5th bits are bits 2c, 2c + 1 of the 32 bytes at o + 16)."""
    j = i // 4
    q = _k45_q(r, o, j, i % 4, qs, five)
    sc, mn = _scale_min(r, o + 4, j)
    return fma(_h(r, o, tab) * np.float32(sc), to_f32(q), -(_h(r, o + 2, tab) * np.float32(mn)))


@njit(**_OPT)
def lanes_q4_k(r, o, i, tab):
    return _k45(r, o, i, tab, 16, False)


@njit(**_OPT)
def lanes_q5_k(r, o, i, tab):
    return _k45(r, o, i, tab, 48, True)


@njit(**_OPT)
def _q6_q(r, o, j, g):
    """The codes (0..63) of lane group g (8 lanes) of sub-block j of a q6_k super-block:
    quarter j % 4 of half j // 4."""
    nh, s, ll = j // 4, j % 4, 8 * g
    a = load_u8(r, o + 64 * nh + 32 * (s % 2) + ll)
    a = (a & 15) if s < 2 else (a >> 4)
    return a | (((load_u8(r, o + 128 + 32 * nh + ll) >> (2 * s)) & 3) << 4)


@njit(**_OPT)
def lanes_q6_k(r, o, i, tab):
    """Two halves of 128: quarter s of a half takes the low (s < 2) or high nibbles of
    ql[32 * (s % 2) + ll], bits 2s..2s+1 of qh[ll] as bits 4..5, minus 32; int8 scale per 16."""
    nh, s, ll = i // 16, (i % 16) // 4, 8 * (i % 4)
    sc = np.float32(np.int8(r[o + 192 + 8 * nh + ll // 16 + 2 * s]))
    return (_h(r, o + 208, tab) * sc) * to_f32(_q6_q(r, o, i // 4, i % 4) - 32)


# The f32 GEMV's k-quant blocks (`fblock_<fmt>(r, o, x, p, xs, c, tab)`: the super-block at
# byte o against x[p:], xs the sums of x's blocks of 32): each sub-block's codes . x, then
# its scale once (one lane of a vector of the super-block's scales), the mins times x's
# sums as one vector; the lanes_<fmt> form scales every value (q4_k: 3.2 ns a block of 32).
@njit(**_OPT)
def sums32(x):
    """The sums of x's blocks of 32 (K a multiple of 32)."""
    xs = np.empty(x.shape[0] // 32, np.float32)
    for c in range(xs.shape[0]):
        v = load_f32(x, 32 * c) + load_f32(x, 32 * c + 8) + load_f32(x, 32 * c + 16) + load_f32(x, 32 * c + 24)
        xs[c] = hsum(v)
    return xs


@njit(**_OPT)
def _k45_scales(r, o):
    """The eight 6-bit scales and mins of a q4_k / q5_k super-block as I32x8 lanes
    (_scale_min of every j at once, from the 12 bytes at o + 4)."""
    lo, hi, head = load_u8(r, o + 4), load_u8(r, o + 8), load_u8(r, o)     # bytes 0-7, 4-11, (lanes 4-7) 0-3
    sc = blend4(lo & 63, (hi & 15) | ((head >> 6) << 4))
    mn = blend4(hi & 63, (hi >> 4) | ((lo >> 6) << 4))
    return sc, mn


@njit(**_OPT)
def _fk45_sub(r, o, x, p, j, f, acc, qs, five):
    s = zeros()
    for g in range(4):
        s = fma(to_f32(_k45_q(r, o, j, g, qs, five)), load_f32(x, p + 32 * j + 8 * g), s)
    return fma(s, lane(f, j), acc)


@njit(**_OPT)
def _fblock_k45(r, o, x, p, xs, c, tab, qs, five):
    sc, mn = _k45_scales(r, o)
    f = to_f32(sc) * _h(r, o, tab)
    a = (to_f32(mn) * -_h(r, o + 2, tab)) * load_f32(xs, c)
    b = _fk45_sub(r, o, x, p, 0, f, zeros(), qs, five)
    a = _fk45_sub(r, o, x, p, 1, f, a, qs, five)
    b = _fk45_sub(r, o, x, p, 2, f, b, qs, five)
    a = _fk45_sub(r, o, x, p, 3, f, a, qs, five)
    b = _fk45_sub(r, o, x, p, 4, f, b, qs, five)
    a = _fk45_sub(r, o, x, p, 5, f, a, qs, five)
    b = _fk45_sub(r, o, x, p, 6, f, b, qs, five)
    return _fk45_sub(r, o, x, p, 7, f, a, qs, five) + b


@njit(**_OPT)
def _fchunk16(r, o, x, p, f, k, acc):
    """Chunk k of a q4_k super-block's codes (sub-blocks 2k: low nibbles, 2k + 1: high) . x,
    each sub-block's sum scaled by its lane of f, in 16 lanes."""
    q, e = o + 16 + 32 * k, p + 64 * k
    lo = nibble_fma16(nibble_fma16(zeros16(), r, q, x, e, 0), r, q + 16, x, e + 16, 0)
    hi = nibble_fma16(nibble_fma16(zeros16(), r, q, x, e + 32, 4), r, q + 16, x, e + 48, 4)
    return scaled16(scaled16(acc, lo, f, 2 * k), hi, f, 2 * k + 1)


@njit(**_OPT)
def _fblock_q4_k_512(r, o, x, p, xs, c, tab):
    """_fblock_k45 of q4_k in 16 lanes (AVX-512: half the instructions a code)."""
    sc, mn = _k45_scales(r, o)
    f = to_f32(sc) * _h(r, o, tab)
    a = (to_f32(mn) * -_h(r, o + 2, tab)) * load_f32(xs, c)
    acc = _fchunk16(r, o, x, p, f, 0, zeros16())
    acc = _fchunk16(r, o, x, p, f, 1, acc)
    acc = _fchunk16(r, o, x, p, f, 2, acc)
    return fold16(_fchunk16(r, o, x, p, f, 3, acc)) + a


if AVX512:
    @njit(**_OPT)
    def fblock_q4_k(r, o, x, p, xs, c, tab):
        return _fblock_q4_k_512(r, o, x, p, xs, c, tab)
else:
    @njit(**_OPT)
    def fblock_q4_k(r, o, x, p, xs, c, tab):
        return _fblock_k45(r, o, x, p, xs, c, tab, 16, False)


@njit(**_OPT)
def fblock_q5_k(r, o, x, p, xs, c, tab):
    return _fblock_k45(r, o, x, p, xs, c, tab, 48, True)


@njit(**_OPT)
def _fq6_sub(r, o, x, p, j, sc, acc):
    """Sub-block j (lanes_q6_k's quarter j % 4 of half j // 4): its halves of 16 take lanes
    2 (j % 4) and 2 (j % 4) + 1 of the half's scales sc."""
    s = j % 4
    lo, hi = zeros(), zeros()
    for g in range(4):
        q = to_f32(_q6_q(r, o, j, g) - 32)
        if g < 2:
            lo = fma(q, load_f32(x, p + 32 * j + 8 * g), lo)
        else:
            hi = fma(q, load_f32(x, p + 32 * j + 8 * g), hi)
    return fma(lo, lane(sc, 2 * s), fma(hi, lane(sc, 2 * s + 1), acc))


@njit(**_OPT)
def fblock_q6_k(r, o, x, p, xs, c, tab):
    d = _h(r, o + 208, tab)
    s0, s1 = to_f32(load_i8(r, o + 192)) * d, to_f32(load_i8(r, o + 200)) * d
    a = _fq6_sub(r, o, x, p, 0, s0, zeros())
    b = _fq6_sub(r, o, x, p, 1, s0, zeros())
    a = _fq6_sub(r, o, x, p, 2, s0, a)
    b = _fq6_sub(r, o, x, p, 3, s0, b)
    a = _fq6_sub(r, o, x, p, 4, s1, a)
    b = _fq6_sub(r, o, x, p, 5, s1, b)
    a = _fq6_sub(r, o, x, p, 6, s1, a)
    return _fq6_sub(r, o, x, p, 7, s1, b) + a


FBLOCK_FORMATS = ("q4_k", "q5_k", "q6_k")


# --------------------------------------------------------------------------- integer codes
# `codes_<fmt>(r, o, j, tab)`: sub-block j (32 elements) of the block at byte o as unsigned
# integer codes u (an I8x32, lanes 0..255) and floats (a0, a1, c) with element value
# a * (u - ZERO[fmt]) + c, a0 the scale of elements 0-15 and a1 of 16-31 (equal but for
# q6_k's scales per 16). The int8 GEMVs and the int8 GEMM (igemm) multiply the codes.
ZERO = {"q4_0": 8, "q5_0": 16, "q8_0": 128, "q6_k": 32}      # others: 0, a float offset c
SUB = {"q6_k": 16}              # elements that share a scale (igemm's sub-blocks); others 32


@njit(**_OPT)
def codes_q4_0(r, o, j, tab):
    d = _h(r, o, tab)
    return nibbles32(r, o + 2), d, d, np.float32(0)


@njit(**_OPT)
def codes_q4_1(r, o, j, tab):
    d = _h(r, o, tab)
    return nibbles32(r, o + 4), d, d, _h(r, o + 2, tab)


@njit(**_OPT)
def codes_q5_0(r, o, j, tab):
    d = _h(r, o, tab)
    return nibbles32(r, o + 6) | (bits32(load_u32(r, o + 2)) << 4), d, d, np.float32(0)


@njit(**_OPT)
def codes_q5_1(r, o, j, tab):
    d = _h(r, o, tab)
    return nibbles32(r, o + 8) | (bits32(load_u32(r, o + 4)) << 4), d, d, _h(r, o + 2, tab)


@njit(**_OPT)
def codes_q8_0(r, o, j, tab):
    d = _h(r, o, tab)
    return load_bytes32(r, o + 2) + 128, d, d, np.float32(0)      # int8 q as q + 128


@njit(**_OPT)
def _k45_q32(r, o, j, qs, five):
    """The codes of sub-block j of a q4_k / q5_k super-block (_k45's layout)."""
    q = load_bytes32(r, o + qs + 32 * (j // 2))
    q = (q & 15) if j % 2 == 0 else (q >> 4)
    if five:
        q = q | (((load_bytes32(r, o + 16) >> j) & 1) << 4)
    return q


@njit(**_OPT)
def _kcodes(r, o, j, tab, qs, five):
    sc, mn = _scale_min(r, o + 4, j)
    a = _h(r, o, tab) * np.float32(sc)
    return _k45_q32(r, o, j, qs, five), a, a, -(_h(r, o + 2, tab) * np.float32(mn))


@njit(**_OPT)
def codes_q4_k(r, o, j, tab):
    return _kcodes(r, o, j, tab, 16, False)


@njit(**_OPT)
def codes_q5_k(r, o, j, tab):
    return _kcodes(r, o, j, tab, 48, True)


@njit(**_OPT)
def _q6_q32(r, o, j):
    """The codes (0..63) of sub-block j of a q6_k super-block: quarter j % 4 of half j // 4."""
    nh, s = j // 4, j % 4
    a = load_bytes32(r, o + 64 * nh + 32 * (s % 2))
    a = (a & 15) if s < 2 else (a >> 4)
    return a | (((load_bytes32(r, o + 128 + 32 * nh) >> (2 * s)) & 3) << 4)


@njit(**_OPT)
def codes_q6_k(r, o, j, tab):
    d, sb = _h(r, o + 208, tab), o + 192 + 2 * j
    return _q6_q32(r, o, j), d * np.float32(np.int8(r[sb])), d * np.float32(np.int8(r[sb + 1])), np.float32(0)


# --------------------------------------------------------------------------- int8 activations
# With `[precision] activations = "int8"` a packed matmul's x arrives rounded through int8
# blocks of 32 (a fake_quantize int8_b32 node). The GEMV then takes x's int8 values and
# multiplies them with each block's integer weights exactly (u8 x s8 pair sums, as
# llama.cpp's q8 dot products), scaling once per block: `iblock_<fmt>(r, o, xq, xd, xs, c,
# tab)` is the block at byte o against x blocks c, c+1, ... as (eight lanes, a scalar).


@njit(**_OPT)
def quantize_block(x, o, xq):
    """x[o:o+32] (f32) as rlx_core.ir.quant's int8_b32 does it (d = amax / 127, q = x * (1 / d)
    rounded half away from zero) into xq[o:o+32]: d and the sums of the two halves of q. A
    block holding NaN or inf gets a NaN or inf d (hmax keeps NaN), so whatever multiplies it
    stays non-finite, as in the reference."""
    v0, v1, v2, v3 = load_f32(x, o), load_f32(x, o + 8), load_f32(x, o + 16), load_f32(x, o + 24)
    d = hmax(vmax(vmax(vabs(v0), vabs(v1)), vmax(vabs(v2), vabs(v3)))) / np.float32(127)
    inv = np.float32(1) / d if d != 0 else np.float32(0)
    q0, q1, q2, q3 = round_int8(v0 * inv), round_int8(v1 * inv), round_int8(v2 * inv), round_int8(v3 * inv)
    store_lanes(xq, o, q0)
    store_lanes(xq, o + 8, q1)
    store_lanes(xq, o + 16, q2)
    store_lanes(xq, o + 24, q3)
    return d, np.int32(hsum(to_f32(q0 + q1))), np.int32(hsum(to_f32(q2 + q3)))      # sums: exact in f32


@njit(**_OPT)
def quantize_x(x, xq, xd, xs):
    """x (f32, K a multiple of 32) as int8_b32 blocks (quantize_block): ints xq, scales xd,
    xs = xd * sum(q)."""
    for b in range(x.shape[0] // 32):
        d, t0, t1 = quantize_block(x, 32 * b, xq)
        xd[b] = d
        xs[b] = d * np.float32(t0 + t1)


@njit(parallel=True, **_OPT)
def fake_quantize_int8(x, o):
    """Rows of x rounded through int8_b32 and back (f32), as the NumPy backend computes it."""
    for m in prange(x.shape[0]):
        nb = x.shape[1] // 32
        xq, xd, xs = np.empty(x.shape[1], np.int8), np.empty(nb, np.float32), np.empty(nb, np.float32)
        quantize_x(x[m], xq, xd, xs)
        for j in range(x.shape[1]):
            o[m, j] = xd[j // 32] * np.float32(xq[j])


@njit(**_OPT)
def _iblock32(q, xq, xd, xs, c, d, m):
    """A 32-element block of unsigned ints q, value d * q + m, against x block c."""
    return to_f32(idot_u(q, xq, 32 * c)) * (d * xd[c]), m * xs[c]


@njit(**_OPT)
def iblock_q4_0(r, o, xq, xd, xs, c, tab):
    q, d, _, m = codes_q4_0(r, o, 0, tab)
    return _iblock32(q, xq, xd, xs, c, d, m - np.float32(8) * d)


@njit(**_OPT)
def iblock_q4_1(r, o, xq, xd, xs, c, tab):
    q, d, _, m = codes_q4_1(r, o, 0, tab)
    return _iblock32(q, xq, xd, xs, c, d, m)


@njit(**_OPT)
def iblock_q5_0(r, o, xq, xd, xs, c, tab):
    q, d, _, m = codes_q5_0(r, o, 0, tab)
    return _iblock32(q, xq, xd, xs, c, d, m - np.float32(16) * d)


@njit(**_OPT)
def iblock_q5_1(r, o, xq, xd, xs, c, tab):
    q, d, _, m = codes_q5_1(r, o, 0, tab)
    return _iblock32(q, xq, xd, xs, c, d, m)


@njit(**_OPT)
def _ksub(r, o, xq, c, j, f, acc, qs, five):
    return fma(to_f32(idot_u(_k45_q32(r, o, j, qs, five), xq, 32 * (c + j))), lane(f, j), acc)


@njit(**_OPT)
def _iblock_k45(r, o, xq, xd, xs, c, tab, qs, five):
    """Each sub-block's integer dot product times its scale and x's (one vector of eight
    factors, a lane broadcast each); the mins times x's sums as one vector."""
    sc, mn = _k45_scales(r, o)
    f = (to_f32(sc) * _h(r, o, tab)) * load_f32(xd, c)
    extra = (to_f32(mn) * -_h(r, o + 2, tab)) * load_f32(xs, c)
    a = _ksub(r, o, xq, c, 0, f, extra, qs, five)
    b = _ksub(r, o, xq, c, 1, f, zeros(), qs, five)
    a = _ksub(r, o, xq, c, 2, f, a, qs, five)
    b = _ksub(r, o, xq, c, 3, f, b, qs, five)
    a = _ksub(r, o, xq, c, 4, f, a, qs, five)
    b = _ksub(r, o, xq, c, 5, f, b, qs, five)
    a = _ksub(r, o, xq, c, 6, f, a, qs, five)
    return _ksub(r, o, xq, c, 7, f, b, qs, five) + a, np.float32(0)


@njit(**_OPT)
def _iblock_q4_k_512(r, o, xq, xd, xs, c, tab):
    """_iblock_k45 of q4_k in 16 lanes (simd.nibble_pair_dot): chunk k of the codes is
    sub-blocks 2k and 2k + 1, against x blocks c + 2k and c + 2k + 1 (64 contiguous bytes);
    the header's factors made at once (simd.k4_factors: the same products as _iblock_k45's)."""
    g = k4_factors(r, o, xd, xs, c)
    a = nibble_pair_dot(zeros16(), r, o + 16, xq, 32 * c, pair_lanes(g, 0))
    b = nibble_pair_dot(zeros16(), r, o + 48, xq, 32 * c + 64, pair_lanes(g, 1))
    a = nibble_pair_dot(a, r, o + 80, xq, 32 * c + 128, pair_lanes(g, 2))
    b = nibble_pair_dot(b, r, o + 112, xq, 32 * c + 192, pair_lanes(g, 3))
    return fold16(a + b) + high8(g), np.float32(0)


@njit(**_OPT)
def idot_q4_k_512(r, xq, xd, xs, tab):
    """A packed q4_k row . x's int8 blocks (the generated `idot` of q4_k where VNNI512):
    _iblock_q4_k_512's products summed in four 16-lane accumulators (one a code chunk, the
    mins' part in lanes 8..15 of the first) folded once a row, not once a super-block. It
    asks for the bytes Q4K_AHEAD past the ones it reads (the next rows': a hint past the
    array's end never faults), every 48 bytes, so its callers prefetch no rows (`iahead`):
    a whole row asked for at its start (AHEAD_ROWS) stalled the multiply behind 18 requests
    (one core, 49152 rows from DRAM: K = 2048 1.78 -> 1.54 ms, 1024 1.92 -> 1.62, 8192 2.47
    -> 1.48)."""
    a0, a1, a2, a3 = zeros16(), zeros16(), zeros16(), zeros16()
    for b in range(xq.shape[0] // 256):
        o, c = 144 * b, 8 * b
        prefetch(r, o + Q4K_AHEAD)
        prefetch(r, o + Q4K_AHEAD + 48)
        prefetch(r, o + Q4K_AHEAD + 96)
        g = k4_factors(r, o, xd, xs, c)
        a0 = add_high8(nibble_pair_dot(a0, r, o + 16, xq, 32 * c, pair_lanes(g, 0)), g)
        a1 = nibble_pair_dot(a1, r, o + 48, xq, 32 * c + 64, pair_lanes(g, 1))
        a2 = nibble_pair_dot(a2, r, o + 80, xq, 32 * c + 128, pair_lanes(g, 2))
        a3 = nibble_pair_dot(a3, r, o + 112, xq, 32 * c + 192, pair_lanes(g, 3))
    return hsum(fold16((a0 + a1) + (a2 + a3)))


if VNNI512:
    @njit(**_OPT)
    def iblock_q4_k(r, o, xq, xd, xs, c, tab):
        return _iblock_q4_k_512(r, o, xq, xd, xs, c, tab)
else:
    @njit(**_OPT)
    def iblock_q4_k(r, o, xq, xd, xs, c, tab):
        return _iblock_k45(r, o, xq, xd, xs, c, tab, 16, False)


@njit(**_OPT)
def iblock_q5_k(r, o, xq, xd, xs, c, tab):
    return _iblock_k45(r, o, xq, xd, xs, c, tab, 48, True)


@njit(**_OPT)
def iblock_q8_0(r, o, xq, xd, xs, c, tab):
    return to_f32(idot_s(load_bytes32(r, o + 2), xq, 32 * c)) * (_h(r, o, tab) * xd[c]), np.float32(0)


@njit(**_OPT)
def _q6sub(r, o, xq, c, j, sc, xf, acc):
    """Sub-block j of a q6_k super-block with its scales, lanes 2j % 8 and 2j % 8 + 1 of
    sc, times x's block scale, lane j of xf."""
    q = _q6_q32(r, o, j) - 32
    k = 2 * j % 8
    return fma(to_f32(idot_s(q, xq, 32 * (c + j))), halves(lane(sc, k), lane(sc, k + 1)) * lane(xf, j), acc)


@njit(**_OPT)
def iblock_q6_k(r, o, xq, xd, xs, c, tab):
    """x block j is quarter j % 4 of half j // 4; its two halves of 16 have their own scale
    (the sixteen int8 scales read as two vectors, x's eight block scales as one)."""
    s0, s1 = to_f32(load_i8(r, o + 192)), to_f32(load_i8(r, o + 200))
    xf = load_f32(xd, c) * _h(r, o + 208, tab)
    a = _q6sub(r, o, xq, c, 0, s0, xf, zeros())
    a = _q6sub(r, o, xq, c, 1, s0, xf, a)
    a = _q6sub(r, o, xq, c, 2, s0, xf, a)
    a = _q6sub(r, o, xq, c, 3, s0, xf, a)
    a = _q6sub(r, o, xq, c, 4, s1, xf, a)
    a = _q6sub(r, o, xq, c, 5, s1, xf, a)
    a = _q6sub(r, o, xq, c, 6, s1, xf, a)
    return _q6sub(r, o, xq, c, 7, s1, xf, a), np.float32(0)


BLOCK = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
         "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}   # elements, bytes

_DRIVERS = """
import numpy as np
from numba import njit, prange
from rlx_backend_numba.quant_kernels import lanes_{fmt} as lanes, sums32
from rlx_backend_numba.cblas import sgemm
from rlx_backend_numba.simd import fma, fma16, fold16, hsum, join16, load_f32, load_f32x16, prefetch, store_lanes, zeros, zeros16

_OPT = dict(cache=True, error_model="numpy", fastmath={{"reassoc", "contract"}})
E, B = {elems}, {nbytes}                # elements and bytes per block
PF = {ahead}                              # rows prefetched ahead


@njit(**_OPT)
def dot(r, x, xs, tab):
    \"\"\"Packed row r . x (xs: x's sums per 32, sums32), four accumulators of eight lanes.\"\"\"
    a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
    for b in range(x.shape[0] // E):
        o, p = B * b, E * b
{dot_body}
    return hsum((a0 + a1) + (a2 + a3))


@njit(**_OPT)
def ahead(w, n):
    \"\"\"Prefetch packed row n, if there is one.\"\"\"
    if n < w.shape[0]:
        r = w[n]
        for c in range(0, r.shape[0], 64):
            prefetch(r, c)


@njit(**_OPT)
def decode(r, out, tab):
    for b in range(out.shape[0] // E):
        o, p = B * b, E * b
{decode_body}

{tiles}

@njit(parallel=True, **_OPT)
def gemv(x, w, o, tab):
    \"\"\"o = x @ W^T, parallel over chunks of output rows. One row of x: each packed row is
    dotted as it is read; more: each lane group of a packed row is decoded once into a
    register and multiply-added into every row's accumulator (`tile<s>`), in tiles of at
    most {tile} rows of x, as even as they split (none of one row). Tiles run one after the
    other over a chunk's packed rows (L1-warm for the next tile), so the x rows a packed row
    meets are one tile's: two tiles of 8 alternating per packed row (16 rows of 576: 37 KB)
    missed L1 and took 1.2x the time of two passes.\"\"\"
    m_ = x.shape[0]
    n_ = w.shape[0]
    xs = sums32(x[0])
    tiles = (m_ + {tile} - 1) // {tile}
    for t in prange((n_ + {rows} - 1) // {rows}):
        n0, n1 = {rows} * t, min({rows} * (t + 1), n_)
        if m_ == 1:
            for n in range(n0, n1):
                ahead(w, n + PF)
                o[0, n] = dot(w[n], x[0], xs, tab)
        else:
            for i in range(tiles):
                m0 = m_ * i // tiles
                s = m_ * (i + 1) // tiles - m0
                for n in range(n0, n1, 2):
                    n2 = min(n + 1, n1 - 1)
                    if i == 0:
                        ahead(w, n + PF)
                        ahead(w, n + 1 + PF)
{dispatch}


@njit(parallel=True, **_OPT)
def gemv_glu(x, w, o, tab):
    \"\"\"o[0, n] = swiglu(x . W[n], x . W[n + H]) for H = o's width: the gate and up halves of
    W's rows in one pass, neither written out (one row of x, copied first: o may be x's
    memory, which the buffer plan frees once this step has read it).\"\"\"
    h = o.shape[1]
    xc = x[0].copy()
    xs = sums32(xc)
    for t in prange((h + {rows} - 1) // {rows}):
        for n in range({rows} * t, min({rows} * (t + 1), h)):
            ahead(w, n + PF)
            ahead(w, n + h + PF)
            o[0, n] = swiglu(dot(w[n], xc, xs, tab), dot(w[n + h], xc, xs, tab))


@njit(parallel=True, **_OPT)
def rows(w, r0, out, tab):
    for i in prange(out.shape[0]):
        decode(w[r0 + i], out[i], tab)


@njit(nogil=True, **_OPT)
def rows_ser(w, r0, out, tab):
    for i in range(out.shape[0]):
        decode(w[r0 + i], out[i], tab)


@njit(parallel=True, **_OPT)
def rows_gemm(x, w, out, tab, scratch, gemm, ilp64):
    \"\"\"out = x @ W^T: W's rows split in len(scratch) parts, each decoding blocks of its rows
    into its scratch and multiplying them with one call of cblas_sgemm at address gemm (on
    one BLAS thread: the caller's), on numba's own threads.\"\"\"
    parts, step = scratch.shape[0], scratch.shape[1]
    n = w.shape[0]
    for p in prange(parts):
        r0, r1 = n * p // parts, n * (p + 1) // parts
        buf = scratch[p]
        for r in range(r0, r1, step):
            e = min(r1, r + step)
            rows_ser(w, r, buf[:e - r], tab)
            sgemm(gemm, ilp64, x, buf[:e - r], out[:, r:e], False, True)
"""


# AMX drivers, one per mode (amx.py says why): "f32", W's decoded rows and x each as exact
# bf16 parts (three; two for a weight d * (q - c) of 16 bits) and the products of parts
# that carry f32's precision; "bf16", both rounded to bf16, one product. A mode's W parts
# are decoded straight into A tiles, x's laid out as B tiles (amx.parts_of_rows).
_AMX_HEAD = """

from rlx_backend_numba.amx import dot_bf16, load, load_config, release, store, zero
from rlx_backend_numba.simd import store_bf16_part_normal, transpose8
"""

_AMX_DRIVER = """


@njit(**_OPT)
def decode_{mode}(r, q, row, tab):
    \"\"\"Row r decoded and split into {wp} bf16 part(s) (simd.store_bf16_part_normal: a decoded
    weight is never subnormal), written as row `row` of rows_{mode}'s A tiles in q (flat bf16
    bits).\"\"\"
    for b in range(q.shape[0] // ({wp} * 32 * E)):
        o, p = B * b, E * b
{parts_body}


@njit(**_OPT)
def products_{mode}(xf, xo, wf, wo):
    \"\"\"Tiles 0-3 += one k-step's products of parts {pairs} (W part, x part): W part i's
    two A tiles at wf[wo + 1024 i] and 512 elements on, x part j's two B tiles at xf[xo +
    512 j] and 256 words on (1 KB each, rows 64 bytes apart), each loaded just before the
    first product that reads it.\"\"\"
{products_body}


@njit(parallel=True, **_OPT)
def rows_{mode}(xt, w, out, tab, wq, cbuf, cfg):
    \"\"\"out = x @ W^T in AMX tiles (only compiled where amx.available()), x's {xp} part(s)
    in xt (amx.parts_of_rows). W's blocks of 32 rows are split in len(wq) parts, each block
    decoded into wq[p] (A tiles, flat bf16 bits: tile (k-step s, part i, rows 16t..16t+15)
    1 KB at 32 * (32 * ({wp}s + i) + 16t)); out^T tiles pass through cbuf[p] ([32 * 32]), whole
    32 x 32 blocks moved into out (C-contiguous) 8 x 8 at a time in registers.\"\"\"
    parts = wq.shape[0]
    n, k = w.shape[0], wq.shape[1] // ({wp} * 32)
    m_, ks = out.shape[0], k // 32
    blocks = (n + 31) // 32
    xf, of = xt.reshape(-1), out.reshape(-1)
    for p in prange(parts):
        load_config(cfg)
        wf, c = wq[p], cbuf[p]
        for blk in range(blocks * p // parts, blocks * (p + 1) // parts):
            r = 32 * blk
            e = min(n, r + 32)
            for i in range(32):
                if r + i < e:
                    decode_{mode}(w[r + i], wf, i, tab)
                else:
                    for t in range({wp} * ks):
                        wf[1024 * t + 32 * i:1024 * t + 32 * i + 32] = 0
            for b in range(xt.shape[0]):
                zero(0)
                zero(1)
                zero(2)
                zero(3)
                for st in range(ks):
                    products_{mode}(xf, {xp} * 512 * (b * ks + st), wf, {wp} * 1024 * st)
                store(0, c, 0, 128)
                store(1, c, 16, 128)
                store(2, c, 512, 128)
                store(3, c, 528, 128)
                if e - r == 32 and 32 * b + 32 <= m_:
                    for i in range(0, 32, 8):
                        for j in range(0, 32, 8):
                            transpose8(c, 32 * i + j, 32, of, n * (32 * b + j) + r + i, n)
                else:
                    for mm in range(32 * b, min(m_, 32 * b + 32)):
                        for i in range(e - r):
                            out[mm, r + i] = c[32 * i + mm - 32 * b]
        release()
"""

# (W part, x part) products of each AMX mode, in the order their tiles are loaded
_PAIRS = {"f32": ((0, 2), (0, 1), (1, 1), (1, 0), (2, 0), (0, 0)), "bf16": ((0, 0),)}


def amx_parts(kind: str, mode: str) -> tuple[int, int]:
    """(W parts, x parts) of an AMX mode: "f32" splits x in three and W in three, or in two
    where its values are an f16 d times a 5-bit q - c (16 bits); "bf16" rounds both."""
    if mode == "bf16":
        return 1, 1
    return (2 if kind in ("q4_0", "q5_0") else 3), 3


def _gemv_tile(groups, s: int) -> str:
    """The GEMV's tile of `s` rows of x (s >= 2) by two packed rows: `tile<s>(r, q, x, m0,
    out, n, n2, tab)` writes out[m0 .. m0 + s - 1, n] = x[m0 ..] . packed row r and column n2
    the same of q (n2 = n and q = r for the last of a chunk's odd count of rows). Each pair of lane groups
    of each packed row is decoded once (lanes, eight at a time), and each load of x (16
    lanes) feeds an FMA of both: one load two FMAs, where a tile of one packed row spent a
    load an FMA and was bound by loads (8 rows 15% slower, 16 rows 19%). ceil(8 / s)
    accumulators a row and packed row (at most one a pair of a block), so eight FMA chains run
    at once where the block allows: with one a row, 4 rows of q4_1 took as long as 8 (each
    chain 2 FMAs a block, 8 cycles of latency where the throughput needs 4). Each output's
    sum is the tile of one packed row's, in the same order."""
    rows, acc = range(s), min(-(-8 // s), len(groups) // 2)
    ws = ("r", "q")
    lines = ["@njit(**_OPT)", f"def tile{s}(r, q, x, m0, out, n, n2, tab):",
             "    " + ", ".join(f"x{j}" for j in rows) + " = " + ", ".join(f"x[m0 + {j}]" for j in rows),
             "    " + "; ".join(f"{w}{j}{c} = zeros16()" for w in ws for j in rows for c in range(acc)),
             "    for b in range(x.shape[1] // E):",
             "        o, p = B * b, E * b"]
    for g0 in range(0, len(groups), 4):
        quad = groups[g0:g0 + 4]
        lines += [f"        {w}v{i} = join16(lanes({w}, o, {i}, tab), lanes({w}, o, {i + 1}, tab))"
                  for w in ws for i in quad[::2]]
        for i in quad[::2]:
            for j in rows:
                a = f"{j}{i // 2 % acc}"
                lines += [f"        y = load_f32x16(x{j}, p + {8 * i})"]
                lines += [f"        {w}{a} = fma16({w}v{i}, y, {w}{a})" for w in ws]
    lines += [f"    out[m0 + {j}, {col}] = hsum(fold16(" + " + ".join(f"{w}{j}{k}" for k in range(acc)) + "))"
              for w, col in zip(ws, ("n", "n2")) for j in rows]
    return "\n".join(lines) + "\n\n"


def _gemv_dispatch(tile: int) -> str:
    """The GEMV's call of the tile for `s` rows (2 .. tile)."""
    call = "(w[n], w[n2], x, m0, o, n, n2, tab)"
    return "\n".join(f"                    {'if' if s == 2 else 'elif'} s == {s}:\n"
                      f"                        tile{s}{call}" for s in range(2, tile + 1))


def _decoded(groups, stores) -> str:
    """Generated lines decoding a block's lane groups (v<i> = lanes(...)) and storing each by
    `stores(i)`, every 32-element sub-block decoded before its stores: a store may alias the
    packed row as far as LLVM can tell, so a later group would read the sub-block's scales
    again (q4_k's decode: 1.17 -> 0.82 cycles a weight)."""
    lines = []
    for g0 in range(0, len(groups), 4):
        lines += [f"        v{i} = lanes(r, o, {i}, tab)" for i in groups[g0:g0 + 4]]
        for i in groups[g0:g0 + 4]:
            lines += stores(i)
    return "\n".join(lines)


def _amx_source(kind: str, mode: str, groups) -> str:
    """The AMX driver of one format and mode: decode_<mode>, products_<mode>, rows_<mode>."""
    wp, xp = amx_parts(kind, mode)
    pairs = [(i, j) for i, j in _PAIRS[mode] if i < wp]
    parts_body = _decoded(groups, lambda i: [
        f"        t = 32 * ({32 * wp} * ((p + {8 * i}) // 32) + row) + (p + {8 * i}) % 32",
        *(f"        v{i} = store_bf16_part_normal(q, t + {1024 * j}, v{i})" for j in range(wp))])
    body, w_in, x_in = [], None, None
    for i, j in pairs:
        a = ([f"load({t}, wf, wo + {1024 * i + 512 * h}, 64)" for h, t in ((0, 4), (1, 5))]
             if i != w_in else [None, None])
        b = ([f"load({t}, xf, xo + {512 * j + 256 * h}, 64)" for h, t in ((0, 6), (1, 7))]
             if j != x_in else [None, None])
        w_in, x_in = i, j
        dots = [f"dot_bf16({c}, {p}, {q})" for c, p, q in ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7))]
        if a[0] and b[0]:      # both operands new: each load just before the first dot that reads it
            seq = [a[0], b[0], dots[0], b[1], dots[1], a[1], dots[2], dots[3]]
        elif a[0]:
            seq = [a[0], dots[0], dots[1], a[1], dots[2], dots[3]]
        else:
            seq = [b[0], dots[0], dots[2], b[1], dots[1], dots[3]]
        body += ["    " + line for line in seq]
    return _AMX_DRIVER.format(mode=mode, wp=wp, xp=xp, pairs=", ".join(map(str, pairs)),
                              parts_body=parts_body, products_body="\n".join(body))


_IDOT = """
@njit(**_OPT)
def idot(r, xq, xd, xs, tab):
    \"\"\"Packed row r . x for x as int8 blocks (quantize_x's xq, xd, xs).\"\"\"
    acc, extra = zeros(), np.float32(0)
    for b in range(xq.shape[0] // E):
        v, e = iblock(r, B * b, xq, xd, xs, (E // 32) * b, tab)
        acc = acc + v
        extra += e
    return hsum(acc) + extra
"""
_IAHEAD = """

@njit(**_OPT)
def iahead(w, n):
    \"\"\"The int8 GEMVs' prefetch of packed row n (`ahead`).\"\"\"
    ahead(w, n)
"""
_IDOT_ROW = {"q4_k": """from rlx_backend_numba.quant_kernels import idot_q4_k_512 as idot


@njit(**_OPT)
def iahead(w, n):
    \"\"\"None: idot asks for the bytes ahead as it reads them.\"\"\"
    pass
"""} if VNNI512 else {}
_INT8_DRIVERS = """

from rlx_backend_numba.quant_kernels import iblock_{fmt} as iblock, quantize_x


{idot}

@njit(parallel=True, **_OPT)
def igemv(x, w, o, tab):
    \"\"\"gemv for rows of x that hold int8_b32-rounded values: integer block products.\"\"\"
    m_, k_ = x.shape
    xq, xd, xs = np.empty((m_, k_), np.int8), np.empty((m_, k_ // 32), np.float32), np.empty((m_, k_ // 32), np.float32)
    for m in range(m_):
        quantize_x(x[m], xq[m], xd[m], xs[m])
    n_ = w.shape[0]
    for t in prange((n_ + {rows} - 1) // {rows}):
        for n in range({rows} * t, min({rows} * (t + 1), n_)):
            iahead(w, n + PF)
            for m in range(m_):
                o[m, n] = idot(w[n], xq[m], xd[m], xs[m], tab)


@njit(**_OPT)
def igemv_ser(x, w, o, tab):
    \"\"\"igemv on the calling thread (a small W: no parallel region to start).\"\"\"
    m_, k_ = x.shape
    xq, xd, xs = np.empty((m_, k_), np.int8), np.empty((m_, k_ // 32), np.float32), np.empty((m_, k_ // 32), np.float32)
    for m in range(m_):
        quantize_x(x[m], xq[m], xd[m], xs[m])
    for n in range(w.shape[0]):
        iahead(w, n + PF)
        for m in range(m_):
            o[m, n] = idot(w[n], xq[m], xd[m], xs[m], tab)


@njit(parallel=True, **_OPT)
def igemv_glu(x, w, o, tab):
    \"\"\"gemv_glu in integer block products (x rounded to int8_b32 blocks first).\"\"\"
    k_ = x.shape[1]
    xq, xd, xs = np.empty(k_, np.int8), np.empty(k_ // 32, np.float32), np.empty(k_ // 32, np.float32)
    quantize_x(x[0], xq, xd, xs)
    h = o.shape[1]
    for t in prange((h + {rows} - 1) // {rows}):
        for n in range({rows} * t, min({rows} * (t + 1), h)):
            iahead(w, n + PF)
            iahead(w, n + h + PF)
            o[0, n] = swiglu(idot(w[n], xq, xd, xs, tab), idot(w[n + h], xq, xd, xs, tab))
"""


# The int8 GEMM (prefill with int8 activations; simd.VNNI says where it pays): W's rows
# decoded into integer panels of 32 rows, each multiplied by every 4 rows of x in dot4
# (vpdpbusd), each sub-block's integer sums scaled once. 4 x 32 ran 5-11% faster than 4 x 16
# on Gemma's and SmolLM2's shapes (.dev/igemm_tiles.py, AMD EPYC); 2 x 32 and 3 x 32 tie.
IGEMM_ROWS, IGEMM_COLS = 4, 32          # rows of x and of W a register tile multiplies
_IGEMM_DRIVER = """

from rlx_backend_numba.quant_kernels import codes_{fmt} as codes
from rlx_backend_numba.simd import dot4, izeros, load_bytes32, store_words, to_f32

L, Z = {sub}, {zero}               # the sub-blocks scaled as one; codes' zero point
P = {cols}                         # W rows in a panel


@njit(**_OPT)
def panel_row(r, i, u, a, c, tab):
    \"\"\"Packed row r as row i of a panel of P: group g of its codes (4 bytes) at word P g + i
    of u, the scale and float offset of its sub-block s at a[s, i] and c[s, i].\"\"\"
    for b in range(u.shape[0] // (P // 4 * E)):
        o, p = B * b, E * b
{panel_body}


@njit(**_OPT)
def put(out, m, n0, tail, {fvecs}):
    \"\"\"Columns n0..n0 + P - 1 of row m (those inside out).\"\"\"
    if n0 + P <= out.shape[1]:
{put_full}
    else:
{put_tail}
        for j in range(out.shape[1] - n0):
            out[m, n0 + j] = tail[j]


@njit(parallel=True, **_OPT)
def igemm(x4, xd, xs, xi, w, out, tab, parts):
    \"\"\"out = x @ W^T for x as int8 blocks: x4 its values as words of four [M, K/4], xd each
    block's scale, xi and xs each sub-block's sum and scale * sum. Parallel over `parts`
    runs of W's panels (rows past W's last repeat it); rows of x past the last repeat it.\"\"\"
    m_, k4 = x4.shape
    n_ = w.shape[0]
    panels = (n_ + P - 1) // P
    for part in prange(parts):
        u = np.empty(P * k4, np.int32)
        ub = u.view(np.uint8)
        a, c = np.zeros((4 * k4 // L, P), np.float32), np.zeros((4 * k4 // L, P), np.float32)
        af, cf = a.reshape(-1), c.reshape(-1)
        tail = np.empty(P, np.float32)
        for pn in range(panels * part // parts, panels * (part + 1) // parts):
            for i in range(P):
                panel_row(w[min(P * pn + i, n_ - 1)], i, u, a, c, tab)
            for m0 in range(0, m_, {mrows}):
{tile_body}
"""


def _igemm_source(kind: str, mrows: int = IGEMM_ROWS, cols: int = IGEMM_COLS) -> str:
    """The int8 GEMM of one format: its panel decoder and an `mrows` x `cols` register tile
    (rows of x by vectors of 8 W rows), unrolled here."""
    elems = BLOCK[kind][0]
    sub, zero, offset = SUB.get(kind, 32), ZERO.get(kind, 0), kind not in ZERO
    panel = []
    for j in range(elems // 32):
        e = f"p + {32 * j}"
        panel += [f"        q, a0, a1, m = codes(r, o, {j}, tab)",
                  f"        store_words(u, P * ({e}) // 4 + i, P, q)"]
        panel += ([f"        a[({e}) // 16, i] = a0", f"        a[({e}) // 16 + 1, i] = a1"] if sub == 16 else
                  [f"        a[({e}) // 32, i] = a0"] + ([f"        c[({e}) // 32, i] = m"] if offset else []))
    rows, vecs = range(mrows), range(cols // 8)
    t = [f"                r{r} = min(m0 + {r}, m_ - 1)" for r in rows]
    t += ["                " + "; ".join(f"f{r}{v} = zeros()" for r in rows for v in vecs),
          "                for s in range(4 * k4 // L):",
          "                    " + "; ".join(f"i{r}{v} = izeros()" for r in rows for v in vecs),
          "                    for g in range(s * (L // 4), (s + 1) * (L // 4)):",
          "                        " + "; ".join(f"w{v} = load_bytes32(ub, 4 * P * g + {32 * v})" for v in vecs),
          "                        " + "; ".join(f"b{r} = x4[r{r}, g]" for r in rows)]
    t += ["                        " + "; ".join(f"i{r}{v} = dot4(i{r}{v}, w{v}, b{r})" for v in vecs) for r in rows]
    t += ["                    " + "; ".join(f"a{v} = load_f32(af, P * s + {8 * v})" for v in vecs)]
    if offset:
        t += ["                    " + "; ".join(f"c{v} = load_f32(cf, P * s + {8 * v})" for v in vecs)]
    for r in rows:
        t += [f"                    d = xd[r{r}, s * L // 32]"]
        for v in vecs:
            i = f"i{r}{v} - Z * xi[r{r}, s]" if zero else f"i{r}{v}"
            acc = f"fma(c{v}, xs[r{r}, s], f{r}{v})" if offset else f"f{r}{v}"
            t += [f"                    f{r}{v} = fma(to_f32({i}), a{v} * d, {acc})"]
    t += [f"                put(out, r{r}, P * pn, tail, " + ", ".join(f"f{r}{v}" for v in vecs) + ")" for r in rows]
    return _IGEMM_DRIVER.format(
        fmt=kind, sub=sub, zero=zero, cols=cols, mrows=mrows, panel_body="\n".join(panel), tile_body="\n".join(t),
        fvecs=", ".join(f"f{v}" for v in vecs),
        put_full="\n".join(f"        store_lanes(out[m], n0 + {8 * v}, f{v})" for v in vecs),
        put_tail="\n".join(f"        store_lanes(tail, {8 * v}, f{v})" for v in vecs))


@njit(parallel=True, **_OPT)
def quantize_rows(x, xq, xd, xs, xi):
    """Rows of x as int8_b32 blocks (quantize_block) with each sub-block's sum xi and scale *
    sum xs, sub-blocks of 32 elements, or of 16 where xs has two a block."""
    halves = xs.shape[1] // xd.shape[1] == 2
    for m in prange(x.shape[0]):
        xm, qm = x[m], xq[m]
        for b in range(x.shape[1] // 32):
            d, t0, t1 = quantize_block(xm, 32 * b, qm)
            xd[m, b] = d
            if halves:
                xi[m, 2 * b], xi[m, 2 * b + 1] = t0, t1
                xs[m, 2 * b], xs[m, 2 * b + 1] = d * np.float32(t0), d * np.float32(t1)
            else:
                xi[m, b] = t0 + t1
                xs[m, b] = d * np.float32(t0 + t1)


@functools.lru_cache(maxsize=None)
def drivers(kind: str):
    """The generated module of one format: `gemv`, `rows`, `rows_ser`, ... and its AMX drivers."""
    elems, nbytes = BLOCK[kind]
    groups = range(elems // 8)         # unrolled: each lane group's scale and shifts fold
    dot_body = "\n".join(f"        a{i % 4} = fma(lanes(r, o, {i}, tab), load_f32(x, p + {8 * i}), a{i % 4})"
                          for i in groups)
    if kind in FBLOCK_FORMATS:
        dot_body = f"        a0 = a0 + fblock(r, o, x, p, xs, {elems // 32} * b, tab)"
    decode_body = _decoded(groups, lambda i: [f"        store_lanes(out, p + {8 * i}, v{i})"])
    src = _DRIVERS + _INT8_DRIVERS + _igemm_source(kind)
    if kind in FBLOCK_FORMATS:
        src = f"\nfrom rlx_backend_numba.quant_kernels import fblock_{kind} as fblock\n" + src
    src = SWIGLU_HEAD + src.format(
        fmt=kind, rows=ROWS_PER_TASK, ahead=AHEAD_ROWS, elems=elems, nbytes=nbytes, dot_body=dot_body,
        decode_body=decode_body, tile=GEMV_TILE, dispatch=_gemv_dispatch(GEMV_TILE),
        tiles="\n".join(_gemv_tile(groups, m) for m in range(2, GEMV_TILE + 1)),
        idot=_IDOT_ROW.get(kind, _IDOT + _IAHEAD))
    return load_source(src + _AMX_HEAD + "".join(_amx_source(kind, m, groups) for m in _PAIRS))


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
    return read_only(w), drivers(s.kind)


def dequant_rows(raw: np.ndarray, scheme, out: np.ndarray, r0: int = 0) -> np.ndarray:
    """Packed rows r0 .. r0 + len(out) decoded into `out` [rows, K] (f32)."""
    w, mod = _args(scheme, raw, out.shape[-1])
    mod.rows(w, r0, out, F16)
    return out


def dequant_gemv(x: np.ndarray, raw: np.ndarray, scheme, out: np.ndarray | None = None,
                 int8_x: bool = False) -> np.ndarray:
    """x [M, K] (f32) @ W^T for the packed W (rows of bytes): [M, N]. `int8_x`: x holds
    int8_b32-rounded values, multiplied in integers."""
    w, mod = _args(scheme, raw, x.shape[-1])
    out = np.empty((x.shape[0], w.shape[0]), x.dtype) if out is None else out
    (mod.igemv if int8_x else mod.gemv)(x, w, out, F16)
    return out


_LOCAL = threading.local()
_TILES = amx.tile_config()


def scratch(rows: int, k: int, parts: int = 1) -> np.ndarray:
    """This thread's decode scratch as [parts, rows, k] f32: one buffer shared by every step
    (steps of a thread run one at a time), so a model's many matmuls do not each hold one."""
    n = parts * rows * k
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < n:
        buf = _LOCAL.buf = amx.aligned_empty(n, np.float32)
    return buf[:n].reshape(parts, rows, k)


def dequant_matmul(x: np.ndarray, raw: np.ndarray, scheme, out: np.ndarray | None = None,
                   matmul: str = "f32", int8_x: bool = False) -> np.ndarray:
    """x [M, K] @ W^T by `matmul` (`[backend] matmul`): "f32", in AMX tiles to f32 accuracy
    where the CPU has them (rows_f32), else as "blas"; "blas", W's rows split over
    numba's threads, each decoding blocks of its rows into its part of the scratch and
    multiplying them with one-thread BLAS (cblas.py says why), or without a cblas_sgemm to
    call, blocks decoded in turn, each multiplied by numpy; "bf16", x and W rounded to bf16
    in AMX tiles where the CPU has them, else as "blas". `int8_x`: x holds int8_b32-rounded
    values, multiplied as integers (igemm; on any CPU, fast where simd.VNNI)."""
    s = QuantScheme.parse(scheme)
    w, mod = _args(s, raw, x.shape[-1])
    out = np.empty((x.shape[0], w.shape[0]), x.dtype) if out is None else out
    if int8_x:
        return _igemm(x, w, mod, s.kind, out)
    return _matmul(x, w, mod, s.kind, out, matmul)


def _matmul(x, w, mod, kind: str, out, matmul: str):
    """dequant_matmul on rows of bytes w (checked by _args) and the format's module."""
    k, n = x.shape[-1], w.shape[0]
    if matmul != "blas" and k % 32 == 0 and amx.available():
        return _tiles(x, w, mod, out, kind, matmul)
    xf = np.ascontiguousarray(x, np.float32)
    parts = cblas.parts(n)
    step = max(1, min(-(-n // parts), SCRATCH // max(k, 1)))
    if SGEMM is None or not out.flags.c_contiguous:
        buf = scratch(step, k)[0]
        for r in range(0, n, step):
            e = min(n, r + step)
            mod.rows_ser(w, r, buf[:e - r], F16)
            np.matmul(xf, buf[:e - r].T, out=out[:, r:e])
        return out
    with single_threaded_blas():
        mod.rows_gemm(xf, w, out, F16, scratch(step, k, parts), *SGEMM)
    return out


def _igemm(x, w, mod, kind: str, out):
    """out = x @ W^T with x rounded to int8_b32 blocks and multiplied as integers (igemm)."""
    m, k = x.shape
    sub = SUB.get(kind, 32)
    xq = np.empty((m, k), np.int8)
    xd, xs, xi = np.empty((m, k // 32), np.float32), np.empty((m, k // sub), np.float32), np.empty((m, k // sub), np.int32)
    quantize_rows(np.ascontiguousarray(x, np.float32), xq, xd, xs, xi)
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    parts = max(1, min(numba.get_num_threads(), -(-w.shape[0] // IGEMM_COLS)))
    mod.igemm(xq.view(np.int32), xd, xs, xi, w, dst, F16, parts)
    if dst is not out:
        out[...] = dst
    return out


def _tiles(x, w, mod, out, kind: str, mode: str):
    """out = x @ W^T in AMX tiles (rows_<mode>)."""
    m, k = x.shape
    wp, xp = amx_parts(kind, mode)
    xt = amx.aligned_empty((-(-m // 32), k // 32, xp, 2, 16, 16), np.float32)     # bf16 pairs as words
    amx.parts_of_rows(np.ascontiguousarray(x, np.float32), xt)
    parts = max(1, min(numba.get_num_threads(), -(-w.shape[0] // 32)))
    tiles = scratch(wp * 16, k, parts).view(np.uint16).reshape(parts, -1)     # bf16 A tiles, 2 a float
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    getattr(mod, f"rows_{mode}")(xt, w, dst, F16, tiles, amx.aligned_empty((parts, 1024), np.float32), _TILES)
    if dst is not out:
        out[...] = dst
    return out


def _has_kernel(kind: str, x_dtype, o_dtype, o_size: int) -> bool:
    """A packed matmul the steps here run: a format here, f32 x and output, not empty."""
    return kind in FORMATS and x_dtype == np.float32 and o_dtype == np.float32 and o_size > 0


def rounds_x_itself(a, rows: int) -> bool:
    """A `dequant_matmul` step (attrs `a`, `rows` rows of x) multiplies int8 blocks of x that
    it rounds itself (the GEMV, or igemm): the fake_quantize before it is then redundant."""
    if not a.get("int8_x"):
        return False
    # more rows: igemm, where VNNI holds; elsewhere the f32 kernels on the rounded x are faster
    return rows <= IGEMV_MAX_M or VNNI


def _dequant_rounds_x(g, n) -> bool:
    """The step prepare_dequant_matmul builds for dequant_matmul node n of the static graph g
    rounds x itself (`rounds_x_itself`, on the graph's shapes)."""
    x, o = g.shape_of(n.inputs[0]), n.outs[0]
    return (_has_kernel(QuantScheme.parse(n.a["scheme"]).kind, x.dtype.np, o.dtype.np, o.nbytes())
            and rounds_x_itself({"int8_x": True}, math.prod(x.dims[:-1])))


def redundant_roundings(g, others: dict | None = None) -> frozenset:
    """The fake_quantize nodes (to int8_b32) of the static graph g whose every reader is a
    step that rounds x itself: a dequant_matmul (as prepare_dequant_matmul builds it) or a
    node of an op in `others` (op -> rounds(g, node): moe.rounds_x_itself). The backend plans
    them as views of x (NumbaBackend.planned_layouts), so x's bytes live until the last
    reader, which then reads x itself (NumbaRunner drops the rounding: the steps' `rounds_x`)."""
    rules = {"dequant_matmul": _dequant_rounds_x, **(others or {})}
    users = g.consumers()

    def rounds(r: int, ref: tuple) -> bool:
        n = g.nodes[r] if r >= 0 else None
        rule = rules.get(n.op) if n is not None else None
        return rule is not None and [tuple(i) for i in n.inputs].index(ref) == 0 and rule(g, n)

    return frozenset(i for i, n in enumerate(g.nodes)
                     if n.op == "fake_quantize" and QuantScheme.parse(n.a["scheme"]).name == "int8_b32"
                     and users.get((i, 0)) and all(rounds(r, (i, 0)) for r in users[(i, 0)]))


def prepare_dequant_matmul(a, outs, protos, op=None):
    """A runner step for `dequant_matmul` (x, packed w, bias?; attrs scheme, act): the GEMV for
    a few rows, decode-to-scratch + BLAS otherwise, then the generated bias/act epilogue.
    `a["int8_x"]` (set by the runner when x comes from a fake_quantize to int8_b32): the
    GEMV multiplies x's int8 values with the packed integers."""
    x, w, o = protos[0], protos[1], outs[0]
    s = QuantScheme.parse(a["scheme"])               # checked by the op table's schema
    if not _has_kernel(s.kind, x.dtype, o.dtype, o.size):
        return None
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    o2 = o.reshape(m, -1)
    w2, mod = _args(s, w, k)                     # checked once: the step runs per token
    int8 = rounds_x_itself(a, m)
    if m <= (IGEMV_MAX_M if int8 else GEMV_MAX_M):
        gemv = (mod.gemv if not int8 else mod.igemv_ser if w2.nbytes < GEMV_SERIAL_BYTES else mod.igemv)
        mm = bindable(gemv, lambda x, w: (x.reshape(m, k), read_only(w), o2, F16))
    elif int8:
        mm = lambda x, w: _igemm(x.reshape(m, k), read_only(w.reshape(w2.shape)),  # noqa: E731
                                 mod, s.kind, o2)
    else:
        how = a.get("matmul", "f32")
        mm = lambda x, w: _matmul(x.reshape(m, k), read_only(w.reshape(w2.shape)),  # noqa: E731
                                  mod, s.kind, o2, how)
    step = with_epilogue(mm, o, protos[2:], a.get("act", "identity"))
    if step is not None:
        step.rounds_x = int8                    # x's int8 blocks made here: the rounding before is redundant
    return step


def glu_gemv(x, w, o, scheme, int8_x: bool):
    """fn(x, w) writing swiglu(x @ W[:H]^T, x @ W[H:]^T) into `o` [1, H] for one row of x,
    or None when the packed weight is not [2H, ...] of a format with kernels here."""
    s = QuantScheme.parse(scheme)
    k = x.shape[-1]
    if (not _has_kernel(s.kind, x.dtype, o.dtype, o.size) or x.size != k or w.ndim != 2
            or w.shape[0] != 2 * o.size):
        return None
    _args(s, w, k)
    mod = drivers(s.kind)
    glu = mod.igemv_glu if int8_x else mod.gemv_glu
    o2 = o.reshape(1, -1)
    return bindable(glu, lambda x, w: (x.reshape(1, k), read_only(w), o2, F16))


def prepare_dequantize(a, outs, protos, op=None):
    """dequantize of packed rows to f32, compiled (the embedding rows a decode step gathers:
    NumPy's reference decoder costs a few hundred microseconds a call)."""
    raw, o = protos[0], outs[0]
    s = QuantScheme.parse(a["scheme"])
    if s.kind not in FORMATS or o.dtype != np.float32 or o.size == 0 or not o.flags.c_contiguous:
        return None
    k = o.shape[-1]
    w, mod = _args(s, raw, k)
    rows = math.prod(o.shape[:-1])
    o2 = o.reshape(rows, k)
    per_row = w.shape[1]
    return lambda a_, out, raw: mod.rows_ser(read_only(raw.reshape(rows, per_row)), 0, o2, F16)


def prepare_fake_quantize(a, outs, protos, op=None):
    """fake_quantize to int8_b32 of f32 rows, compiled (the activations of int8 matmuls)."""
    x, o = protos[0], outs[0]
    if QuantScheme.parse(a["scheme"]).name != "int8_b32" or x.dtype != np.float32 or o.dtype != np.float32 or x.shape[-1] % 32:
        return None
    k = x.shape[-1]
    return lambda a_, out, x: fake_quantize_int8(x.reshape(-1, k), out[0].reshape(-1, k))


__all__ = ["FORMATS", "dequant_gemv", "glu_gemv", "redundant_roundings", "rounds_x_itself", "dequant_matmul", "dequant_rows", "prepare_dequant_matmul",
           "prepare_dequantize", "prepare_fake_quantize"]
