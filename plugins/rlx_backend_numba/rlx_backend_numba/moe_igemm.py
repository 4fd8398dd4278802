"""q4_k's int8 GEMM with a cheap panel build (the MoE prefill step's tasks call it per expert group).

quant_kernels' igemm decodes 32 packed rows into an integer panel (each row's codes stored
word by word across the panel, every sub-block's scale decoded with scalar code) before it
multiplies them with the rows of x; at an expert group's ~16 rows that build was ~70% of the
GEMM (OLMoE's gate: 0.35 of 0.51 ms). A prefill step pays it for every expert, every call.

Here the panel keeps q4_k's bytes as they are, only moved across the diagonal: the 32 bytes
of a row that hold two sub-blocks' codes (low nibbles: sub-block 2p, high: 2p + 1) become 8
words of 8 rows each, eight rows at a time in registers (`words8x8`: 8 loads, 24 shuffles, 8
stores), and the scales and mins of a super-block are decoded as 8 lanes (quant_kernels'
_k45_scales) and moved the same way. The multiply masks the nibbles as it reads the panel
(32 bytes: & 15, or >> 4): half the panel's bytes, a quarter of the build's instructions.
The integer sums and their scaling are quant_kernels' igemm's, in its order: the results
are bit for bit its results.
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import quant_kernels
from .codegen import load_source
from .quant_kernels import IGEMM_COLS, IGEMM_ROWS, _h, _k45_scales
from .simd import VNNI512, F32x16, VecType, store_lanes, to_f32, transpose8, zeros16

_OPT = dict(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
_I32 = ir.IntType(32)
_V8 = ir.VectorType(_I32, 8)


@intrinsic
def words8x8(typingctx, w, n0, nlast, c0, dst, d0, ds):
    """dst[d0 + ds * j + i] = word j (bytes 4j..4j+3) of w[min(n0 + i, nlast), c0:c0 + 32],
    for i, j < 8: w a 2-D byte array (rows contiguous, any row stride), dst an int32 array."""
    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        n0_, nl, c, d0_, ds_ = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2, 3, 5, 6))
        stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        rows = []
        for i in range(8):
            n = builder.add(n0_, ir.Constant(n0_.type, i))
            n = builder.select(builder.icmp_signed("<", n, nl), n, nl)
            at = builder.add(builder.mul(n, stride), c)
            rows.append(builder.load(builder.bitcast(builder.gep(base, [at]), _V8.as_pointer()), align=1))
        for step in (1, 2, 4):          # swap the off-diagonal step x step blocks (simd.transpose8's way)
            out = list(rows)
            for j in range(8):
                if j & step:
                    continue
                a, b = rows[j], rows[j + step]
                lo = [i if not (i & step) else 8 + i - step for i in range(8)]
                hi = [i + step if not (i & step) else 8 + i for i in range(8)]
                out[j] = builder.shuffle_vector(a, b, ir.Constant(_V8, lo))
                out[j + step] = builder.shuffle_vector(a, b, ir.Constant(_V8, hi))
            rows = out
        dsta = context.make_array(sig.args[4])(context, builder, args[4])
        for j in range(8):
            at = builder.add(d0_, builder.mul(ds_, ir.Constant(ds_.type, j)))
            builder.store(rows[j], builder.bitcast(builder.gep(dsta.data, [at]), _V8.as_pointer()), align=4)
        return context.get_dummy_value()
    if not (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8
            and isinstance(dst, types.Array) and dst.dtype == types.int32):
        return None
    return types.none(w, n0, nlast, c0, dst, d0, ds), codegen


@njit(**_OPT)
def panel_q4_k(w, n0, nlast, c0, nb, u, af, cf, tmp, tab):
    """Rows n0 .. n0 + P - 1 of q4_k w (past nlast: row nlast again), nb super-blocks from
    byte c0, as a panel: u[P * (32 b + 8 p + t) + i] = word t of the codes of sub-blocks
    2p, 2p + 1 of super-block b of row i (both nibbles); af[P s + i], cf[P s + i] the scale
    and float offset of sub-block s of row i."""
    p_ = u.shape[0] // (32 * nb)
    for q in range(p_ // 8):
        r0 = n0 + 8 * q
        for b in range(nb):
            o = c0 + 144 * b
            for p in range(4):
                words8x8(w, r0, nlast, o + 16 + 32 * p, u, p_ * (32 * b + 8 * p) + 8 * q, p_)
            for i in range(8):
                r = w[min(r0 + i, nlast)]
                sc, mn = _k45_scales(r, o)
                store_lanes(tmp, 8 * i, to_f32(sc) * _h(r, o, tab))
                store_lanes(tmp, 64 + 8 * i, to_f32(mn) * -_h(r, o + 2, tab))
            transpose8(tmp, 0, 8, af, p_ * 8 * b + 8 * q, p_)
            transpose8(tmp, 64, 8, cf, p_ * 8 * b + 8 * q, p_)


@intrinsic
def prefetch_l2(typingctx, a, i):
    """Hint that byte i of 1-D array a is read soon, into L2 (prefetcht1; simd.prefetch asks
    for L1, whose few miss slots a panel's 576 lines overrun)."""
    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        at = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(arr.data, [at]), ir.IntType(8).as_pointer())
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(a, i), codegen


@njit(**_OPT)
def fetch_rows(w, n0, n1, c0, nbytes):
    """Ask for bytes c0 .. c0 + nbytes of rows n0 .. n1 - 1 of w (64-byte lines): the next
    panel's rows, a few per step of the first tile (an expert's rows come from DRAM: without
    it the build ran at ~5 GB/s, each 8-row group waiting on its rows; asked for all at once,
    the 576 lines stalled the multiply behind them)."""
    for n in range(n0, n1):
        r = w[n]
        for o in range(c0, c0 + nbytes, 64):
            prefetch_l2(r, o)


# --------------------------------------------------------------------------- 16 lanes (AVX-512)
# Where the CPU has AVX-512 VNNI the multiply reads 64 bytes of the panel at a time (16 rows'
# words): one vpdpbusd does twice the 8-lane form's products (a Zen 5 core: ~1.6x the tile's rate).
I32x16 = VecType("I32x16", _I32, 16, types.int32)
I8x64 = VecType("I8x64", ir.IntType(8), 64, types.int8)
_VI16, _VB64, _VF16 = I32x16.llvm, I8x64.llvm, F32x16.llvm


def _fn(builder, name, ret, *args):
    return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                                       name), args)


def _ptr(context, builder, aty, ary, idx, ity, vt):
    arr = context.make_array(aty)(context, builder, ary)
    return builder.bitcast(builder.gep(arr.data, [context.cast(builder, idx, ity, types.intp)]), vt.as_pointer())


def _splat16(builder, v, vt):
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _nibbles64(high: bool):
    @intrinsic
    def impl(typingctx, a, i):
        """The 64 bytes at a[i] (a byte array), each's low (or high) nibble."""
        def codegen(context, builder, sig, args):
            v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VB64), align=1)
            if high:
                v = builder.lshr(v, ir.Constant(_VB64, [4] * 64))
            return builder.and_(v, ir.Constant(_VB64, [15] * 64))
        return I8x64(a, i), codegen
    return impl


low64, high64 = _nibbles64(False), _nibbles64(True)


@intrinsic
def izeros16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI16, [0] * 16)
    return I32x16(), codegen


@intrinsic
def dot4_16(typingctx, acc, u, x4):
    """simd.dot4 in 16 lanes: lane j + sum over e < 4 of u[4j + e] (unsigned) * byte e of x4 (signed)."""
    def codegen(context, builder, sig, args):
        xs = _splat16(builder, context.cast(builder, args[2], sig.args[2], types.int32), _VI16)
        return _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _VI16, args[0], builder.bitcast(args[1], _VI16), xs)
    return I32x16(acc, u, x4), codegen


@intrinsic
def load16(typingctx, a, i):
    """a[i:i+16] of a float32 array."""
    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VF16), align=4)
    return F32x16(a, i), codegen


@intrinsic
def scale16(typingctx, q, a, d, c, s, f):
    """to_f32(q) * (a * d) + (c * s + f) in 16 lanes (d, s scalars): quant_kernels' igemm's
    scaling of a sub-block's integer sums, its operations in its order."""
    def codegen(context, builder, sig, args):
        q_, a_, d_, c_, s_, f_ = args
        d16 = _splat16(builder, context.cast(builder, d_, sig.args[2], types.float32), _VF16)
        s16 = _splat16(builder, context.cast(builder, s_, sig.args[4], types.float32), _VF16)
        fmuladd = "llvm.fmuladd.v16f32"
        inner = _fn(builder, fmuladd, _VF16, c_, s16, f_)
        return _fn(builder, fmuladd, _VF16, builder.sitofp(q_, _VF16), builder.fmul(a_, d16, flags=("contract",)), inner)
    return F32x16(q, a, d, c, s, f), codegen


@intrinsic
def store16(typingctx, a, i, v):
    """a[i:i+16] = v (a float32 array)."""
    def codegen(context, builder, sig, args):
        builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VF16), align=4)
        return context.get_dummy_value()
    return types.none(a, i, v), codegen


@njit(**_OPT)
def put16(out, m, n0, tail, f0, f1):
    """Columns n0 .. n0 + 31 of row m (those inside out) from two 16-lane vectors."""
    if n0 + 32 <= out.shape[1]:
        store16(out[m], n0, f0)
        store16(out[m], n0 + 16, f1)
    else:
        store16(tail, 0, f0)
        store16(tail, 16, f1)
        for j in range(out.shape[1] - n0):
            out[m, n0 + j] = tail[j]


_IGEMM = """
import numpy as np
from numba import njit
from rlx_backend_numba.moe_igemm import (dot4_16, fetch_rows, high64, izeros16, load16, low64, panel_q4_k, put16,
                                          scale16)
from rlx_backend_numba.simd import zeros16
from {drv} import put
from rlx_backend_numba.simd import dot4, fma, izeros, load_bytes32, load_f32, to_f32, zeros

_OPT = dict(cache=True, error_model="numpy", fastmath={{"reassoc", "contract"}})
P = {cols}


@njit(**_OPT)
def igemm_q4_k(x4, xd, xs, xi, w, col, out, tab):
    \"\"\"out = x @ W^T on one thread, W the q4_k rows of w from byte col (K = 4 x4.shape[1]
    columns), x as int8 blocks (quant_kernels.quantize_rows: x4 its values as words of four,
    xd each block's scale, xs each sub-block's scale * sum): quant_kernels' igemm of q4_k
    (its sums and scaling, in its order) over panels built by panel_q4_k.\"\"\"
    m_, k4 = x4.shape
    n_ = out.shape[1]
    nb = k4 // 64
    u = np.empty(P * k4 // 2, np.int32)
    ub = u.view(np.uint8)
    af, cf = np.empty(P * k4 // 8, np.float32), np.empty(P * k4 // 8, np.float32)
    tmp, tail = np.empty(128, np.float32), np.empty(P, np.float32)
    rpi = (P + k4 // 16 - 1) // (k4 // 16)          # next panel's rows asked for per step of the first tile
    fetch_rows(w, 0, min(P, n_), col, 144 * nb)
    for pn in range((n_ + P - 1) // P):
        nxt = P * (pn + 1)
        panel_q4_k(w, P * pn, n_ - 1, col, nb, u, af, cf, tmp, tab)
        for m0 in range(0, m_ - m_ % {mrows}, {mrows}):
{tile}
        m0 = m_ - m_ % {mrows}               # the last rows of x: a tile of their count (none repeated)
{tails}
"""


def _tile16(mrows: int) -> list:
    """The 16-lane tile: `mrows` rows of x by the panel's 32 rows as two vectors."""
    rows, vecs = range(mrows), range(2)
    t = [f"            r{r} = min(m0 + {r}, m_ - 1)" for r in rows]
    t += ["            " + "; ".join(f"f{r}{v} = zeros16()" for r in rows for v in vecs),
          "            for pp in range(k4 // 16):",
          "                if m0 == 0:",
          "                    fetch_rows(w, min(nxt + rpi * pp, n_), min(nxt + rpi * (pp + 1), n_), col, 144 * nb)"]
    for half, load in ((0, "low64"), (1, "high64")):
        s = f"2 * pp + {half}"
        t += ["                " + "; ".join(f"i{r}{v} = izeros16()" for r in rows for v in vecs),
              "                for g in range(8):",
              "                    " + "; ".join(f"w{v} = {load}(ub, 4 * P * (8 * pp + g) + {64 * v})" for v in vecs),
              "                    " + "; ".join(f"b{r} = x4[r{r}, 16 * pp + {8 * half} + g]" for r in rows)]
        t += ["                    " + "; ".join(f"i{r}{v} = dot4_16(i{r}{v}, w{v}, b{r})" for v in vecs) for r in rows]
        t += ["                " + "; ".join(f"a{v} = load16(af, P * ({s}) + {16 * v})" for v in vecs),
              "                " + "; ".join(f"c{v} = load16(cf, P * ({s}) + {16 * v})" for v in vecs)]
        for r in rows:
            t += [f"                f{r}{v} = scale16(i{r}{v}, a{v}, xd[r{r}, {s}], c{v}, xs[r{r}, {s}], f{r}{v})"
                  for v in vecs]
    t += [f"            put16(out, r{r}, P * pn, tail, f{r}0, f{r}1)" for r in rows]
    return t


def _tile8(mrows: int, cols: int) -> list:
    """The 8-lane tile: `mrows` rows of x by the panel's `cols` rows as vectors of 8."""
    rows, vecs = range(mrows), range(cols // 8)
    t = [f"            r{r} = min(m0 + {r}, m_ - 1)" for r in rows]
    t += ["            " + "; ".join(f"f{r}{v} = zeros()" for r in rows for v in vecs),
          "            for pp in range(k4 // 16):",
          "                if m0 == 0:",
          "                    fetch_rows(w, min(nxt + rpi * pp, n_), min(nxt + rpi * (pp + 1), n_), col, 144 * nb)"]
    for half, code in ((0, "& 15"), (1, ">> 4")):
        s = f"2 * pp + {half}"
        t += ["                " + "; ".join(f"i{r}{v} = izeros()" for r in rows for v in vecs),
              "                for g in range(8):",
              "                    " + "; ".join(f"w{v} = load_bytes32(ub, 4 * P * (8 * pp + g) + {32 * v}) {code}"
                                               for v in vecs),
              "                    " + "; ".join(f"b{r} = x4[r{r}, 16 * pp + {8 * half} + g]" for r in rows)]
        t += ["                    " + "; ".join(f"i{r}{v} = dot4(i{r}{v}, w{v}, b{r})" for v in vecs) for r in rows]
        t += ["                " + "; ".join(f"a{v} = load_f32(af, P * ({s}) + {8 * v})" for v in vecs),
              "                " + "; ".join(f"c{v} = load_f32(cf, P * ({s}) + {8 * v})" for v in vecs)]
        for r in rows:
            t += [f"                d = xd[r{r}, {s}]"]
            t += [f"                f{r}{v} = fma(to_f32(i{r}{v}), a{v} * d, fma(c{v}, xs[r{r}, {s}], f{r}{v}))"
                  for v in vecs]
    t += [f"            put(out, r{r}, P * pn, tail, " + ", ".join(f"f{r}{v}" for v in vecs) + ")" for r in rows]
    return t




def _igemm_source(mrows: int = IGEMM_ROWS, cols: int = IGEMM_COLS, wide: bool = VNNI512) -> str:
    """igemm_q4_k with an `mrows` x `cols` register tile, unrolled (quant_kernels'
    _igemm_source's tile; the codes masked out of the panel's bytes as they are read), and
    tiles of 1 .. mrows - 1 rows for the last rows of x (an expert group's rows are rarely a
    multiple of mrows: ~9% of the products were repeated rows); in 16 lanes where `wide`
    (cols 32)."""
    tile = _tile16 if wide and cols == 32 else functools.partial(_tile8, cols=cols)
    tails = []
    for rem in range(1, mrows):
        tails += [f"        {'if' if rem == 1 else 'elif'} m_ % {mrows} == {rem}:"] + tile(rem)
    return _IGEMM.format(cols=cols, mrows=mrows, tile="\n".join(tile(mrows)), tails="\n".join(tails),
                         drv=quant_kernels.drivers("q4_k").__name__)


@functools.lru_cache(maxsize=None)
def module(wide: bool = VNNI512):
    """The generated module holding igemm_q4_k (its 16-lane tile where `wide`: AVX-512 VNNI)."""
    return load_source(_igemm_source(wide=wide))


__all__ = ["module", "panel_q4_k", "words8x8"]
