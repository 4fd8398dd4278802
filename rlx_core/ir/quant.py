"""Packed weight formats: llama.cpp's GGUF block quantizations and RLX's own int8/int4 blocks.

A `QuantScheme` names one format. A packed weight of logical shape (..., K) is stored as
`rows = prod(...)` rows of `bytes_per_row(K)` bytes; each row is K / block_size blocks laid
end to end, so a row slice of the packed bytes is the packed form of the same row slice of the
weight. Per format it offers a float64 reference decoder written block by block from the
format description (llama.cpp ggml-quants.c `dequantize_row_*` and the ggml-common.h block
structs), a vectorized decoder for the numpy backend, and a quantizer.

GGUF block layouts (all little-endian, "f16" an IEEE half):
  q4_0  32/18:  f16 d | 16 B nibbles: byte j = q[j] (low) | q[j+16] (high);      x = d*(q-8)
  q4_1  32/20:  f16 d | f16 m | 16 B nibbles as q4_0;                            x = d*q + m
  q5_0  32/22:  f16 d | u32 qh (bit j = 5th bit of q[j]) | 16 B nibbles;         x = d*(q-16)
  q5_1  32/24:  f16 d | f16 m | u32 qh | 16 B nibbles;                           x = d*q + m
  q8_0  32/34:  f16 d | 32 x i8 q;                                               x = d*q
  q4_k 256/144: f16 d | f16 dmin | 12 B six-bit scales/mins of 8 sub-blocks of 32 | 128 B
                nibbles (per 64 elements: 32 bytes, low nibbles the first 32, high the next);
                x = d*sc[s]*q - dmin*m[s]
  q5_k 256/176: as q4_k with 32 B qh between the scales and the nibbles: bit s of qh[l] is the
                5th bit of element l of sub-block s
  q6_k 256/210: 128 B low nibbles | 64 B high 2-bit pairs | 16 x i8 scales (one per 16
                elements) | f16 d;  x = d*sc[i//16]*(q-32)
RLX's own symmetric blocks (block size B a multiple of 8, default 32), for quantizing float
checkpoints; the f32 scale keeps any bf16 range exact, which an f16 scale would not:
  int8_b{B} B/(4+B):   f32 d | B x i8 q (|q| <= 127);                            x = d*q
  int4_b{B} B/(4+B/2): f32 d | B/2 B nibbles laid out as q4_0 (byte j = q[j] | q[j+B/2]<<4),
                       nibble = q+8 with |q| <= 7;                               x = d*(nibble-8)
with d = absmax(block) / 127 (or / 7) and q the nearest integer (half away from zero).
"""
from __future__ import annotations

import functools
import re
import struct
from typing import Callable

import attrs
import numpy as np

from .dtype import F64, DType
from .errors import DTypeError, GraphError, ShapeError, WeightError

QK_K = 256
_CHUNK_ELEMENTS = 1 << 20     # elements decoded per vectorized step: bounds the temporaries
_INT_BLOCK_MAX = 1 << 16


# ----------------------------------------------------------------------------- byte helpers
def _rf16(b: bytes, off: int) -> float:
    return struct.unpack_from("<e", b, off)[0]


def _rf32(b: bytes, off: int) -> float:
    return struct.unpack_from("<f", b, off)[0]


def _i8(v: int) -> int:
    return v - 256 if v > 127 else v


@functools.cache
def _f16_table(ct) -> np.ndarray:
    """Every f16 bit pattern as `ct`: one gather of the u16 index decodes a column of f16
    scales, 3x faster than copying the strided field and converting it."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(ct)


def _f16(blocks: np.ndarray, off: int, ct) -> np.ndarray:
    """The f16 field at byte `off` of every block as a (n, 1) column of the compute dtype."""
    idx = blocks[:, off + 1].astype(np.intp)
    idx <<= 8
    idx |= blocks[:, off]
    return _f16_table(ct)[idx][:, None]


def _f32(blocks: np.ndarray, off: int, ct) -> np.ndarray:
    """The f32 field at byte `off` of every block as a (n, 1) column of the compute dtype."""
    return np.ascontiguousarray(blocks[:, off:off + 4]).view("<f4").astype(ct)


_LOW4 = np.uint64(0x0F0F0F0F0F0F0F0F)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., m) bytes -> (..., 2m) u8 nibbles: per row the low nibbles first, then the high ones.
    Eight bytes at a time as u64 words, one column of words per ufunc call: a ufunc over an
    (n, m) view costs a loop call per row, which for a block's 16 bytes outweighs the work."""
    *lead, m = qs.shape
    if m % 8:
        return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    words = np.ascontiguousarray(qs).reshape(-1, m).view("<u8")
    w = m // 8
    out = np.empty((len(words), 2 * w), "<u8")
    for j in range(w):
        np.bitwise_and(words[:, j], _LOW4, out=out[:, j])
        np.right_shift(words[:, j], np.uint64(4), out=out[:, w + j])
        np.bitwise_and(out[:, w + j], _LOW4, out=out[:, w + j])
    return out.view(np.uint8).reshape(*lead, 2 * m)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Inverse of `_nibbles` over the last axis."""
    h = q.shape[-1] // 2
    return (q[..., :h] & np.uint8(0x0F)) | (q[..., h:] << np.uint8(4))


def _round_away(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero); done in float64 so |v| + 0.5 is exact for a float32 v."""
    v = v.astype(np.float64)
    return np.copysign(np.floor(np.abs(v) + 0.5), v)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where d is 0 (llama.cpp's `d ? 1.0f/d : 0.0f`)."""
    out = np.zeros_like(d)
    np.divide(np.asarray(1, d.dtype), d, out=out, where=d != 0)
    return out


def _f16_up(v: np.ndarray) -> np.ndarray:
    """The smallest f16 >= v (v >= 0), so a scale rounded to f16 still covers its range."""
    h = v.astype(np.float16)
    return np.where(h.astype(np.float64) < v, np.nextafter(h, np.float16(np.inf)), h)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, "<f2").reshape(-1, 1).view(np.uint8)


# ----------------------------------------------------------------------------- GGUF legacy formats
def _ref_q4_0(b: bytes) -> list:
    d = _rf16(b, 0)
    lo = [d * ((b[2 + j] & 0x0F) - 8) for j in range(16)]
    hi = [d * ((b[2 + j] >> 4) - 8) for j in range(16)]
    return lo + hi


def _ref_q4_1(b: bytes) -> list:
    d, m = _rf16(b, 0), _rf16(b, 2)
    lo = [d * (b[4 + j] & 0x0F) + m for j in range(16)]
    hi = [d * (b[4 + j] >> 4) + m for j in range(16)]
    return lo + hi


def _ref_q5(b: bytes, has_min: bool) -> list:
    d = _rf16(b, 0)
    m = _rf16(b, 2) if has_min else 0.0
    off = 4 if has_min else 2
    qh = struct.unpack_from("<I", b, off)[0]
    qs = b[off + 4:off + 20]
    q = [(qs[j] & 0x0F) | (((qh >> j) & 1) << 4) for j in range(16)]
    q += [(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) for j in range(16)]
    return [d * v + m for v in q] if has_min else [d * (v - 16) for v in q]


def _ref_q8_0(b: bytes) -> list:
    d = _rf16(b, 0)
    return [d * _i8(b[2 + j]) for j in range(32)]


# The decoders write into `out` ((n, block), the compute dtype) with in-place ufuncs: the
# integer values are built in u8 (wrapping u8 subtraction then an i8 view gives q - 8 exactly),
# and one multiply converts them and applies the scale, so each element is rounded exactly as
# in llama.cpp's `d * q (+ m)`, with no float temporaries.
def _signed(q: np.ndarray, bias: int) -> np.ndarray:
    """u8 values q (< 256) -> (q - bias) as i8, in place."""
    np.subtract(q, np.uint8(bias), out=q)
    return q.view(np.int8)


def _dq_q4_0(b, out):
    q = _signed(_nibbles(b[:, 2:18]), 8)
    np.multiply(q, _f16(b, 0, out.dtype), out=out)


def _dq_q4_1(b, out):
    np.multiply(_nibbles(b[:, 4:20]), _f16(b, 0, out.dtype), out=out)
    out += _f16(b, 2, out.dtype)


def _q5_values(b, off):
    high = np.unpackbits(b[:, off:off + 4], axis=1, bitorder="little")   # bit j of the LE u32
    np.left_shift(high, np.uint8(4), out=high)
    return np.bitwise_or(_nibbles(b[:, off + 4:off + 20]), high, out=high)


def _dq_q5_0(b, out):
    np.multiply(_signed(_q5_values(b, 2), 16), _f16(b, 0, out.dtype), out=out)


def _dq_q5_1(b, out):
    np.multiply(_q5_values(b, 4), _f16(b, 0, out.dtype), out=out)
    out += _f16(b, 2, out.dtype)


def _dq_q8_0(b, out):
    np.multiply(b[:, 2:34].view(np.int8), _f16(b, 0, out.dtype), out=out)


# The quantizers below follow llama.cpp's quantize_row_*_ref in float32 step for step, so their
# bytes equal llama.cpp's (and gguf.quants.quantize's).
def _signed_absmax(x):
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


def _q_q4_0(x):
    d = _signed_absmax(x) / np.float32(-8)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)
    return [_f16_bytes(d), _pack_nibbles(q)], [d]


def _q_q4_1(x):
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 15).astype(np.uint8)
    return [_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], [d, lo]


def _q5_pack(q):
    qh = np.packbits(q >> np.uint8(4), axis=1, bitorder="little")
    return [qh, _pack_nibbles(q)]


def _q_q5_0(x):
    d = _signed_absmax(x) / np.float32(-16)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(16.5)), 31).astype(np.uint8)
    return [_f16_bytes(d)] + _q5_pack(q), [d]


def _q_q5_1(x):
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 31).astype(np.uint8)
    return [_f16_bytes(d), _f16_bytes(lo)] + _q5_pack(q), [d, lo]


def _q_q8_0(x):
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = _round_away(x * _inverse(d)).astype(np.int8).view(np.uint8)
    return [_f16_bytes(d), q], [d]


# ----------------------------------------------------------------------------- GGUF K-quants
def _scale_min_k4(j: int, s: bytes) -> tuple[int, int]:
    """Six-bit scale and min of sub-block j (llama.cpp get_scale_min_k4)."""
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def _ref_qk(b: bytes, five: bool) -> list:
    d, dmin = _rf16(b, 0), _rf16(b, 2)
    scales = b[4:16]
    qh = b[16:48] if five else bytes(32)
    qs = b[48:176] if five else b[16:144]
    out = []
    for c in range(4):                       # 64 elements: sub-blocks 2c (low) and 2c+1 (high)
        chunk = qs[32 * c:32 * c + 32]
        for s, nib in ((2 * c, [v & 0x0F for v in chunk]), (2 * c + 1, [v >> 4 for v in chunk])):
            sc, m = _scale_min_k4(s, scales)
            out += [d * sc * (nib[l] + 16 * ((qh[l] >> s) & 1)) - dmin * m for l in range(32)]
    return out


def _ref_q6_k(b: bytes) -> list:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208], _rf16(b, 208)
    out = [0.0] * QK_K
    for n in range(2):                       # two halves of 128 elements
        for l in range(32):
            h = qh[32 * n + l]
            lo, hi = ql[64 * n + l], ql[64 * n + l + 32]
            quads = ((lo & 0x0F) | ((h & 3) << 4), (hi & 0x0F) | (((h >> 2) & 3) << 4),
                     (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | (((h >> 6) & 3) << 4))
            for k, q in enumerate(quads):
                i = 128 * n + 32 * k + l
                out[i] = d * _i8(sc[i // 16]) * (q - 32)
    return out


def _k_scales(s):
    """(n, 12) packed bytes -> six-bit scales and mins, (n, 8) each."""
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _dq_qk(b, out, five: bool):
    n, ct = b.shape[0], out.dtype
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 48:176] if five else b[:, 16:144]
    q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
    if five:
        high = b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]
        high &= np.uint8(1)
        high <<= np.uint8(4)
        q |= high
    o = out.reshape(n, 8, 32)
    np.multiply(q, (_f16(b, 0, ct) * sc)[:, :, None], out=o)
    o -= (_f16(b, 2, ct) * mn)[:, :, None]


def _dq_q6_k(b, out):
    n = b.shape[0]
    q = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    high = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    high &= np.uint8(3)
    high <<= np.uint8(4)
    q |= high
    dsc = _f16(b, 208, out.dtype) * b[:, 192:208].view(np.int8)
    np.multiply(_signed(q, 32).reshape(n, 16, 16), dsc[:, :, None], out=out.reshape(n, 16, 16))


def _ceil_div(v, d, top):
    """ceil(v / d) clipped to [0, top], 0 where d is 0: quantized scales that never shrink a range."""
    return np.clip(np.ceil(v / np.where(d > 0, d, 1)) * (d > 0), 0, top)


def _nearest(v, step, lo, hi):
    """round(v / step) clipped to [lo, hi], 0 where the step is 0."""
    return np.clip(np.where(step > 0, np.rint(v / np.where(step > 0, step, 1)), 0), lo, hi)


def _q_qk(x, nmax: int):
    """Q4_K (nmax 15) / Q5_K (nmax 31): per sub-block of 32 an offset that covers its minimum and
    a scale that covers its maximum, both rounded up, then nearest rounding of every element."""
    n = x.shape[0]
    x = x.astype(np.float64).reshape(n, 8, 32)
    mins = np.maximum(-x.min(axis=2), 0)                              # the format subtracts mins >= 0
    dmin = _f16_up(mins.max(axis=1) / 63)[:, None]
    lm = _ceil_div(mins, dmin.astype(np.float64), 63)
    offset = dmin.astype(np.float64) * lm
    need = (x.max(axis=2) + offset) / nmax
    d = _f16_up(need.max(axis=1) / 63)[:, None]
    ls = _ceil_div(need, d.astype(np.float64), 63)
    q = _nearest(x + offset[:, :, None], (d.astype(np.float64) * ls)[:, :, None], 0, nmax).astype(np.uint8)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    scales = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)], axis=1)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if nmax == 31:
        bits = ((q >> np.uint8(4)) & 1) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(np.bitwise_or.reduce(bits, axis=1))
    return parts + [_pack_nibbles(q.reshape(n, 4, 64)).reshape(n, 128)], [d, dmin]


def _q_q6_k(x):
    """Q6_K: symmetric per sub-block of 16 (a scale covering its absmax, rounded up), nearest
    rounding of every element to [-31, 31]."""
    n = x.shape[0]
    x = x.astype(np.float64).reshape(n, 16, 16)
    need = np.abs(x).max(axis=2) / 31
    d = _f16_up(need.max(axis=1) / 127)[:, None]
    sc = _ceil_div(need, d.astype(np.float64), 127)
    q = (_nearest(x, (d.astype(np.float64) * sc)[:, :, None], -32, 31) + 32).astype(np.uint8)
    ql = _pack_nibbles(q.reshape(n, 2, 128))                  # per half: byte j = q[j] | q[j+64] << 4
    quarters = q.reshape(n, 2, 4, 32) >> np.uint8(4)          # [half, quarter, lane]: the top 2 bits
    qh = np.bitwise_or.reduce(quarters << np.array([0, 2, 4, 6], np.uint8)[:, None], axis=2)
    return [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
            _f16_bytes(d)], [d]


# ----------------------------------------------------------------------------- RLX int blocks
def _ref_int8(b: bytes) -> list:
    d = _rf32(b, 0)
    return [d * _i8(v) for v in b[4:]]


def _ref_int4(b: bytes) -> list:
    d = _rf32(b, 0)
    qs = b[4:]
    return [d * ((v & 0x0F) - 8) for v in qs] + [d * ((v >> 4) - 8) for v in qs]


def _dq_int8(b, out):
    np.multiply(b[:, 4:].view(np.int8), _f32(b, 0, out.dtype), out=out)


def _dq_int4(b, out):
    np.multiply(_signed(_nibbles(b[:, 4:]), 8), _f32(b, 0, out.dtype), out=out)


def _q_int(x, qmax: int):
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(qmax)
    q = np.clip(_round_away(x * _inverse(d)), -qmax, qmax)
    scale = np.asarray(d, "<f4").view(np.uint8)
    if qmax == 127:
        return [scale, q.astype(np.int8).view(np.uint8)], []
    return [scale, _pack_nibbles((q + 8).astype(np.uint8))], []


# ----------------------------------------------------------------------------- the scheme table
@attrs.frozen
class _Format:
    block: int                     # 0: configurable (int blocks)
    nbytes: Callable[[int], int]   # block size -> bytes per block
    gguf_type: int | None
    reference: Callable            # bytes of one block -> list of floats (float64)
    decode: Callable               # (n, bytes per block) u8, out (n, block) of the compute dtype
    encode: Callable               # (n, block) f32 -> (list of byte columns, f16 scales to check)


_FORMATS = {
    "q4_0": _Format(32, lambda b: 18, 2, _ref_q4_0, _dq_q4_0, _q_q4_0),
    "q4_1": _Format(32, lambda b: 20, 3, _ref_q4_1, _dq_q4_1, _q_q4_1),
    "q5_0": _Format(32, lambda b: 22, 6, lambda b: _ref_q5(b, False), _dq_q5_0, _q_q5_0),
    "q5_1": _Format(32, lambda b: 24, 7, lambda b: _ref_q5(b, True), _dq_q5_1, _q_q5_1),
    "q8_0": _Format(32, lambda b: 34, 8, _ref_q8_0, _dq_q8_0, _q_q8_0),
    "q4_k": _Format(QK_K, lambda b: 144, 12, lambda b: _ref_qk(b, False),
                    lambda b, o: _dq_qk(b, o, False), lambda x: _q_qk(x, 15)),
    "q5_k": _Format(QK_K, lambda b: 176, 13, lambda b: _ref_qk(b, True),
                    lambda b, o: _dq_qk(b, o, True), lambda x: _q_qk(x, 31)),
    "q6_k": _Format(QK_K, lambda b: 210, 14, _ref_q6_k, _dq_q6_k, _q_q6_k),
    "int8": _Format(0, lambda b: 4 + b, None, _ref_int8, _dq_int8, lambda x: _q_int(x, 127)),
    "int4": _Format(0, lambda b: 4 + b // 2, None, _ref_int4, _dq_int4, lambda x: _q_int(x, 7)),
}
_GGUF = {f.gguf_type: k for k, f in _FORMATS.items() if f.gguf_type is not None}
_NAME = re.compile(r"(int8|int4)(?:_b(\d+))?")
_DEFAULT_INT_BLOCK = 32


def _where(name: str | None) -> str:
    return f"tensor {name!r}" if name is not None else "packed weight"


def _check_kind(inst, attribute, kind):
    if not isinstance(kind, str) or kind not in _FORMATS:
        raise GraphError(f"unknown quant scheme kind {kind!r}; known: {sorted(_FORMATS)}")


@attrs.frozen
class QuantScheme:
    """One packed weight format. Hashable; its JSON form is `name`, read back by `parse`."""

    kind: str = attrs.field(validator=_check_kind)
    block: int = attrs.field()

    @block.default
    def _block_default(self):
        fmt = _FORMATS.get(self.kind) if isinstance(self.kind, str) else None
        return (fmt.block or _DEFAULT_INT_BLOCK) if fmt else 0

    def __attrs_post_init__(self):
        fixed = _FORMATS[self.kind].block
        b = self.block
        if fixed and b != fixed:
            raise GraphError(f"quant scheme {self.kind}: block size is fixed at {fixed}, got {b!r}")
        if not fixed and (isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % 8
                          or b > _INT_BLOCK_MAX):
            raise GraphError(f"quant scheme {self.kind}: block size must be a multiple of 8 in "
                             f"[8, {_INT_BLOCK_MAX}], got {b!r}")

    # -- names
    @property
    def name(self) -> str:
        return self.kind if _FORMATS[self.kind].block else f"{self.kind}_b{self.block}"

    def __str__(self) -> str:
        return self.name

    def to_json(self) -> str:
        return self.name

    @classmethod
    def known(cls) -> list[str]:
        """The accepted spellings (the int blocks take any `_b<size>`)."""
        return [k if f.block else f"{k}[_b<size>]" for k, f in _FORMATS.items()]

    @classmethod
    def parse(cls, value: "QuantScheme | str") -> "QuantScheme":
        """A scheme from its name ('q4_k', 'Q8_0', 'int8' = 'int8_b32', 'int4_b64')."""
        if isinstance(value, QuantScheme):
            return value
        if isinstance(value, str):
            key = value.lower()
            if key in _FORMATS and _FORMATS[key].block:
                return cls(key)
            m = _NAME.fullmatch(key)
            if m:
                return cls(m.group(1), int(m.group(2)) if m.group(2) else _DEFAULT_INT_BLOCK)
        raise GraphError(f"unknown quant scheme {value!r}; known: {cls.known()}")

    @classmethod
    def from_gguf_type(cls, type_id, name: str | None = None) -> "QuantScheme":
        """The scheme of a GGUF tensor's ggml type id; WeightError naming the tensor if it has none."""
        key = _GGUF.get(int(type_id)) if isinstance(type_id, (int, np.integer)) else None
        if key is None:
            known = {v: k for k, v in sorted(_GGUF.items())}
            raise WeightError(f"{_where(name)}: GGUF type id {type_id!r} is not a supported packed "
                              f"scheme; supported: {known}")
        return cls(key)

    # -- sizes
    @property
    def block_size(self) -> int:
        return self.block

    @property
    def bytes_per_block(self) -> int:
        return _FORMATS[self.kind].nbytes(self.block)

    @property
    def gguf_type(self) -> int | None:
        """The GGMLQuantizationType value, None for RLX's own int blocks."""
        return _FORMATS[self.kind].gguf_type

    def packed_shape(self, shape, name: str | None = None) -> tuple[int, int]:
        """(rows, bytes per row) of a weight of logical shape (..., K)."""
        shape = self._logical(shape, name)
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        return rows, shape[-1] // self.block * self.bytes_per_block

    def _logical(self, shape, name) -> tuple[int, ...]:
        dims = tuple(shape) if isinstance(shape, (tuple, list)) else None
        if not dims or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0
                               for d in dims):
            raise WeightError(f"{_where(name)}: logical shape must be a non-empty tuple of positive "
                              f"ints, got {shape!r}")
        dims = tuple(int(d) for d in dims)
        if dims[-1] % self.block:
            raise WeightError(f"{_where(name)}: last dimension {dims[-1]} of shape {dims} is not a "
                              f"multiple of the {self.name} block size {self.block}")
        return dims

    def _blocks(self, raw, shape, name) -> tuple[np.ndarray, tuple[int, ...]]:
        """Validated (n blocks, bytes per block) view of the packed bytes, and the logical shape."""
        shape = self._logical(shape, name)
        rows, per_row = self.packed_shape(shape)
        if isinstance(raw, (bytes, bytearray, memoryview)):
            raw = np.frombuffer(raw, np.uint8)
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
            what = f"{type(raw).__name__}" + (f" of {raw.dtype}" if isinstance(raw, np.ndarray) else "")
            raise WeightError(f"{_where(name)}: packed {self.name} data must be uint8 bytes, got {what}")
        if raw.size != rows * per_row or raw.ndim > 1 and raw.shape[-1] != per_row:
            raise WeightError(f"{_where(name)}: packed {self.name} data of shape {raw.shape} "
                              f"({raw.size} bytes) does not hold logical shape {shape}: expected "
                              f"{rows} rows x {per_row} bytes = {rows * per_row} bytes")
        return np.ascontiguousarray(raw).reshape(-1, self.bytes_per_block), shape

    # -- decoding
    def dequantize_reference(self, raw, shape, name: str | None = None) -> np.ndarray:
        """float64 weights, decoded block by block from the format description (for tests)."""
        blocks, shape = self._blocks(raw, shape, name)
        ref = _FORMATS[self.kind].reference
        out = np.array([ref(bytes(b)) for b in blocks], np.float64)
        return out.reshape(shape)

    def dequantize(self, raw, shape, out: np.ndarray | None = None, dtype=np.float32,
                   name: str | None = None) -> np.ndarray:
        """Vectorized decode into `out` (C-contiguous, logical shape, `dtype`) or a new array.
        Computes in float32 (float64 for a float64 result): each element is rounded once, so the
        float32 result equals llama.cpp's. A NaN/inf scale decodes to NaN/inf, it does not raise."""
        blocks, shape = self._blocks(raw, shape, name)
        dt = DType.parse(dtype)
        if not dt.is_float:
            raise DTypeError(f"{_where(name)}: dequantize dtype must be a float type, got {dt!r}")
        if out is None:
            out = np.empty(shape, dt.np)
        elif not isinstance(out, np.ndarray) or out.dtype != dt.np:
            raise DTypeError(f"{_where(name)}: dequantize out must be a {dt!r} array, got "
                             f"{getattr(out, 'dtype', type(out).__name__)}")
        elif out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
            raise ShapeError(f"{_where(name)}: dequantize out must be a writeable C-contiguous array "
                             f"of shape {shape}, got shape {out.shape}")
        ct = np.float64 if dt is F64 else np.float32
        decode = _FORMATS[self.kind].decode
        flat = out.reshape(-1, self.block)
        step = max(1, _CHUNK_ELEMENTS // self.block)
        scratch = None if out.dtype == ct else np.empty((min(step, len(blocks)), self.block), ct)
        with np.errstate(invalid="ignore", over="ignore"):
            for i in range(0, len(blocks), step):
                chunk = blocks[i:i + step]
                if scratch is None:
                    decode(chunk, flat[i:i + step])
                else:                               # f16/bf16: decode in f32, then round once
                    decode(chunk, scratch[:len(chunk)])
                    flat[i:i + step] = scratch[:len(chunk)]
        return out

    # -- encoding
    def quantize(self, x, name: str | None = None) -> np.ndarray:
        """Packed bytes (rows, bytes per row) of float weights of shape (..., K). Q4_0/Q4_1/Q5_0/
        Q5_1/Q8_0 are byte-identical to llama.cpp's reference quantizers; Q4_K/Q5_K/Q6_K choose
        scales that cover each sub-block's range, so every element is within half a step."""
        arr = np.asarray(x)
        try:
            dt = DType.parse(arr.dtype)
        except DTypeError:
            dt = None
        if dt is None or not (dt.is_float or dt.is_int):
            raise WeightError(f"{_where(name)}: cannot quantize {arr.dtype} values to {self.name}")
        rows, per_row = self.packed_shape(arr.shape, name)
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise WeightError(f"{_where(name)}: cannot quantize non-finite values to {self.name}")
        with np.errstate(invalid="ignore", over="ignore"):
            columns, f16_fields = _FORMATS[self.kind].encode(arr.reshape(-1, self.block))
            overflow = not all(np.isfinite(np.asarray(f, np.float16)).all() for f in f16_fields)
        if overflow:
            raise WeightError(f"{_where(name)}: values up to {np.abs(arr).max():g} overflow the f16 "
                              f"block scales of {self.name}")
        return np.concatenate(columns, axis=1).reshape(rows, per_row)


def quantize(x, scheme: "QuantScheme | str", name: str | None = None) -> np.ndarray:
    """`QuantScheme.parse(scheme).quantize(x)`."""
    return QuantScheme.parse(scheme).quantize(x, name=name)


def matmul_reference(x, raw, scheme: "QuantScheme | str", shape, name: str | None = None) -> np.ndarray:
    """float64 x @ W.T for a packed weight W of logical shape [N, K] (the test oracle of
    dequant_matmul)."""
    s = QuantScheme.parse(scheme)
    if len(tuple(shape)) != 2:
        raise WeightError(f"{_where(name)}: a matmul weight must be [N, K], got shape {tuple(shape)}")
    w = s.dequantize_reference(raw, shape, name=name)
    x = np.asarray(x, np.float64)
    if x.shape[-1:] != w.shape[1:]:
        raise ShapeError(f"{_where(name)}: x of shape {x.shape} does not match weight [N, K] = {w.shape}")
    return x @ w.T


Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (
    QuantScheme(k) for k in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"))
GGUF_SCHEMES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)


@attrs.frozen(eq=False)
class PackedTensor:
    """A checkpoint weight kept packed: its bytes (often a view of a memory-mapped file), its
    scheme and its logical shape. `shape` and `dtype` are the logical ones, so code that
    checks a weight's shape needs nothing special; the bytes bind to a packed param."""
    raw: np.ndarray                  # u8 [rows, bytes per row]
    scheme: QuantScheme
    shape: tuple                     # logical, (..., K)
    name: str | None = None

    def __attrs_post_init__(self):
        rows, per_row = self.scheme.packed_shape(self.shape, self.name)
        if self.raw.dtype != np.uint8 or self.raw.shape != (rows, per_row):
            raise WeightError(f"{_where(self.name)}: packed {self.scheme.name} bytes of shape "
                              f"{self.raw.shape} ({self.raw.dtype}) do not hold logical shape "
                              f"{tuple(self.shape)}: expected uint8 [{rows}, {per_row}]")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        return self.scheme.dequantize(self.raw, self.shape, dtype=dtype, name=self.name)

    def take_rows(self, index) -> "PackedTensor":
        """The rows `index` (an index array or slice over the first axis) of a 2-D weight:
        rows are whole blocks, so the bytes are just the same rows."""
        raw = self.raw[index]
        return PackedTensor(np.ascontiguousarray(raw), self.scheme, (raw.shape[0],) + tuple(self.shape[1:]),
                            self.name)
