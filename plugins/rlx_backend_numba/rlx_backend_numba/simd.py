"""Eight-lane vectors for numba kernels, as LLVM vector values.

LLVM's auto-vectorizer picks its own loop to vectorize; over packed weight blocks (bytes
at 18- or 20-byte strides, nibbles split in two) it picks the wrong one and gathers bytes
one at a time (2.4 G weights/s a core where the data allows several times that). These
types let a kernel say which lanes it means: `F32x8` / `I32x8` are `<8 x float>` /
`<8 x i32>` values that live in registers, with loads, integer bit ops, conversion and a
fused multiply-add. They are plain LLVM vectors, so any target LLVM supports runs them
(AVX2: one ymm register each; SSE or NEON: two).

Loads take a contiguous 1-D array and an element index and do not check bounds: the
caller's loop bounds come from shapes it has checked.
"""
from __future__ import annotations

import operator
import sys

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

LANES = 8
_HOST = set(llvm_binding.get_host_cpu_features().flatten().split(","))       # numba compiles for the host
AVX2 = "+avx2" in _HOST
VNNI = "+avxvnni" in _HOST or {"+avx512vnni", "+avx512vl"} <= _HOST     # u8 x s8 dot products of 4
_I32 = ir.IntType(32)
_I8 = ir.IntType(8)


class VecType(types.Type):
    """A fixed-length LLVM vector; `scalar` is the numba type a scalar operand is cast to."""

    def __init__(self, name: str, elem, lanes: int, scalar):
        self.llvm = ir.VectorType(elem, lanes)
        self.scalar = scalar
        super().__init__(name=name)


@register_model(VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.llvm)


F32x8 = VecType("F32x8", ir.FloatType(), LANES, types.float32)
I32x8 = VecType("I32x8", _I32, LANES, types.int32)
I8x32 = VecType("I8x32", _I8, 32, types.int8)       # the bytes of a 32-element block
_VF, _VI, _VB = F32x8.llvm, I32x8.llvm, I8x32.llvm


def _splat(builder, scalar, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), mask)


def _vec(context, builder, ty, val, vt):
    """`val` of numba type `ty` as a value of vector type `vt` (a scalar is cast, splatted)."""
    if isinstance(ty, VecType):
        return val
    return _splat(builder, context.cast(builder, val, ty, vt.scalar), vt.llvm)


def _register(op, vt, emit):
    """`op` lane-wise on `vt` values; either side may be a scalar of `vt`'s kind."""
    kind = types.Float if isinstance(vt.scalar, types.Float) else types.Integer

    @intrinsic
    def impl(typingctx, a, b):
        def codegen(context, builder, sig, args):
            va = _vec(context, builder, sig.args[0], args[0], vt)
            vb = _vec(context, builder, sig.args[1], args[1], vt)
            return emit(builder, va, vb)
        return vt(a, b), codegen

    @overload(op)
    def _ov(a, b):
        if (a is vt or b is vt) and all(t is vt or isinstance(t, kind) for t in (a, b)):
            return lambda a, b: impl(a, b)


_register(operator.add, F32x8, lambda b, x, y: b.fadd(x, y, flags=("contract",)))
_register(operator.sub, F32x8, lambda b, x, y: b.fsub(x, y, flags=("contract",)))
_register(operator.mul, F32x8, lambda b, x, y: b.fmul(x, y, flags=("contract",)))
for _vt in (I32x8, I8x32):
    _register(operator.add, _vt, lambda b, x, y: b.add(x, y))
    _register(operator.sub, _vt, lambda b, x, y: b.sub(x, y))
    _register(operator.and_, _vt, lambda b, x, y: b.and_(x, y))
    _register(operator.or_, _vt, lambda b, x, y: b.or_(x, y))
    _register(operator.lshift, _vt, lambda b, x, y: b.shl(x, y))
    _register(operator.rshift, _vt, lambda b, x, y: b.lshr(x, y))  # logical: lanes hold bits


def element_ptr(context, builder, aty, ary, idx, ity, elem):
    """A pointer to `elem`-typed lanes starting at element `idx` of contiguous array `ary`."""
    arr = context.make_array(aty)(context, builder, ary)
    i = context.cast(builder, idx, ity, types.intp)
    return builder.bitcast(builder.gep(arr.data, [i]), elem.as_pointer())


def _load(vt, align: int):
    @intrinsic
    def impl(typingctx, a, i):
        def codegen(context, builder, sig, args):
            return builder.load(element_ptr(context, builder, sig.args[0], args[0], args[1],
                                             sig.args[1], vt.llvm), align=align)
        return vt(a, i), codegen
    return impl


load_f32 = _load(F32x8, 4)          # a[i:i+8] of a float32 array
load_bytes32 = _load(I8x32, 1)      # a[i:i+32] of a byte array


@intrinsic
def prefetch(typingctx, a, i):
    """Hint that byte i of array a (which may lie past its end: a hint never faults) is read
    soon: a GEMV asks for the bytes a few rows ahead, which the hardware prefetcher of a
    two-stream read alone leaves late."""
    def codegen(context, builder, sig, args):
        ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I8)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(a, i), codegen


def _store_f32(context, builder, sig, args):
    builder.store(args[2], element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                                       args[2].type), align=4)
    return context.get_dummy_value()


_SIXTEEN = ir.Constant(_VI, [16] * LANES)


def _put_bf16(context, builder, sig, args):
    """Store the bf16 nearest each lane of args[2] (ties to even) at args[0][args[1]:+8];
    returns those bf16 values' bits in the high halves of i32 lanes."""
    bits = builder.bitcast(args[2], _VI)
    one, half = (ir.Constant(_VI, [c] * LANES) for c in (1, 0x7FFF))
    odd = builder.and_(builder.lshr(bits, _SIXTEEN), one)
    r = builder.lshr(builder.add(builder.add(bits, half), odd), _SIXTEEN)
    v16 = ir.VectorType(ir.IntType(16), LANES)
    builder.store(builder.trunc(r, v16), element_ptr(context, builder, sig.args[0], args[0], args[1],
                                                      sig.args[1], v16), align=2)
    return builder.shl(r, _SIXTEEN)


def _store_bf16(context, builder, sig, args):
    _put_bf16(context, builder, sig, args)
    return context.get_dummy_value()


def _store_i8(context, builder, sig, args):
    ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(_I8, LANES))
    builder.store(builder.trunc(args[2], ir.VectorType(_I8, LANES)), ptr, align=1)
    return context.get_dummy_value()


@intrinsic
def store_lanes(typingctx, a, i, v):
    """a[i:i+8] = v for a float32 array (a[i:i+16] for an F32x16 v); for a uint16 array, v
    rounded to bf16 (nearest, ties to even; NaN is not kept apart): the bits AMX tiles read
    (amx.py); for an int8 array, the I32x8 v's low bytes."""
    if a.dtype == types.float32 and v is F32x8:
        return types.none(a, i, v), _store_f32
    if a.dtype == types.float32 and v is F32x16:
        return types.none(a, i, v), _store_f32
    if a.dtype == types.uint16 and v is F32x8:
        return types.none(a, i, v), _store_bf16
    if a.dtype == types.int8 and v is I32x8:
        return types.none(a, i, v), _store_i8
    return None


def _split_bf16(context, builder, sig, args):
    """store_bf16_part's body: the rounded store, then what it left of each lane."""
    return builder.fsub(args[2], builder.bitcast(_put_bf16(context, builder, sig, args), _VF))


@intrinsic
def store_bf16_part(typingctx, a, i, v):
    """a[i:i+8] (uint16) = the bits of h, the bf16 nearest each lane of v (ties to even);
    returns v - h, exactly (h has 8 significand bits, v - h at most 16): called three times,
    an f32 split into three bf16 parts that sum to it (amx.py), for lanes whose parts stay
    normal (|v| >= 2**-110 or 0: a subnormal bf16 cannot hold a subnormal f32's low bits)."""
    if a.dtype != types.uint16:
        return None
    return F32x8(a, i, v), _split_bf16


class _BFloat(ir.types._BaseFloatType):
    """LLVM's bfloat (llvmlite names no such type): fptrunc to it is one vcvtneps2bf16."""
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()
AVX512_BF16 = "+avx512bf16" in llvm_binding.get_host_cpu_features().flatten().split(",")


@intrinsic
def store_bf16_part_normal(typingctx, a, i, v):
    """store_bf16_part for lanes that are 0 or normal floats, with normal parts, in the CPU's
    own rounding instruction where it has one (AVX512-BF16, which reads a subnormal as 0):
    a decoded weight (an f16 scale times a small integer) and its remainders never are
    subnormal. About a quarter fewer instructions a part than the integer rounding."""
    if a.dtype != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        if not AVX512_BF16:
            return _split_bf16(context, builder, sig, args)
        v16 = ir.VectorType(ir.IntType(16), LANES)
        h = builder.bitcast(builder.fptrunc(args[2], ir.VectorType(_BFloat(), LANES)), v16)
        ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], v16)
        builder.store(h, ptr, align=2)
        return builder.fsub(args[2], builder.bitcast(builder.shl(builder.zext(h, _VI), _SIXTEEN), _VF))
    return F32x8(a, i, v), codegen


@intrinsic
def transpose8(typingctx, src, si, ss, dst, di, ds):
    """dst[di + ds * j + i] = src[si + ss * i + j] for i, j < 8 (float32 arrays, row strides
    ss and ds in elements): an 8x8 block moved across the diagonal in registers, eight row
    loads, 24 shuffles and eight row stores (an element-by-element copy reads one column
    element at a time)."""
    if src.dtype != types.float32 or dst.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        def row(at, j):                 # row j of the array at argument at (its start, stride next)
            base, stride = (context.cast(builder, args[at + k], sig.args[at + k], types.intp) for k in (1, 2))
            i = builder.add(base, builder.mul(stride, ir.Constant(ir.IntType(64), j)))
            return element_ptr(context, builder, sig.args[at], args[at], i, types.intp, _VF)

        rows = [builder.load(row(0, j), align=4) for j in range(8)]
        shuffle = lambda a, b, mask: builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), mask))
        for step in (1, 2, 4):          # swap the off-diagonal step x step blocks of each 2step x 2step block
            out = list(rows)
            for j in range(8):
                if j & step:
                    continue
                a, b = rows[j], rows[j + step]
                lo = [i if not (i & step) else 8 + i - step for i in range(8)]
                hi = [i + step if not (i & step) else 8 + i for i in range(8)]
                out[j], out[j + step] = shuffle(a, b, lo), shuffle(a, b, hi)
            rows = out
        for j in range(8):
            builder.store(rows[j], row(3, j), align=4)
        return context.get_dummy_value()
    return types.none(src, si, ss, dst, di, ds), codegen


@intrinsic
def load_u32(typingctx, a, i):
    """The little-endian uint32 at byte i of byte array a, in one unaligned load (four byte
    loads, shifted and or-ed, stayed four: q5_0's GEMV spent a fifth of its time there)."""
    def codegen(context, builder, sig, args):
        ptr = element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I32)
        w = builder.load(ptr, align=1)
        return call_intrinsic(builder, "llvm.bswap.i32", _I32, w) if sys.byteorder == "big" else w
    return types.uint32(a, i), codegen


def _load_bytes(signed: bool):
    @intrinsic
    def impl(typingctx, a, i):
        def codegen(context, builder, sig, args):
            vb = builder.load(element_ptr(context, builder, sig.args[0], args[0], args[1],
                                           sig.args[1], ir.VectorType(ir.IntType(8), LANES)),
                              align=1)
            return builder.sext(vb, _VI) if signed else builder.zext(vb, _VI)
        return I32x8(a, i), codegen
    return impl


load_u8 = _load_bytes(False)        # a[i:i+8] of a byte array, zero-extended to I32x8
load_i8 = _load_bytes(True)         # the same bytes read as int8, sign-extended


@intrinsic
def zeros(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * LANES)
    return F32x8(), codegen


@intrinsic
def to_f32(typingctx, v):
    """I32x8 -> F32x8 (signed)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)
    return F32x8(v), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c lane-wise (fused where the target has FMA; llvm.fmuladd never calls libm)."""
    def codegen(context, builder, sig, args):
        vs = [_vec(context, builder, t, v, F32x8) for t, v in zip(sig.args, args)]
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3),
                                           "llvm.fmuladd.v8f32")
        return builder.call(f, vs)
    return F32x8(a, b, c), codegen


def _vcall(builder, name, *args):
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * len(args)), name)
    return builder.call(f, list(args))


# Cephes' expf: x = n ln2 + r (ln2 in two parts), e^r a degree-6 polynomial, 2^n in the exponent bits
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)


@intrinsic
def exp(typingctx, v):
    """e^v lane-wise in a few multiply-adds (within 2 ulp of expf; 0 below -87.3, where expf's
    results go subnormal; NaN stays NaN; +inf above 88.37). A softmax takes one per score,
    and a call to libm's expf per lane would cost more than the scores' dot products."""
    def codegen(context, builder, sig, args):
        c = lambda x: ir.Constant(_VF, [x] * LANES)                      # noqa: E731
        x = args[0]
        xc = _vcall(builder, "llvm.maxnum.v8f32", _vcall(builder, "llvm.minnum.v8f32", x, c(88.37)), c(-87.33))
        n = _vcall(builder, "llvm.floor.v8f32", builder.fadd(builder.fmul(xc, c(1.44269504088896341)), c(0.5)))
        r = builder.fsub(builder.fsub(xc, builder.fmul(n, c(0.693359375))), builder.fmul(n, c(-2.12194440e-4)))
        p = c(_EXP_POLY[0])
        for k in _EXP_POLY[1:]:
            p = _vcall(builder, "llvm.fmuladd.v8f32", p, r, c(k))
        y = builder.fadd(_vcall(builder, "llvm.fmuladd.v8f32", p, builder.fmul(r, r), r), c(1.0))
        e = builder.shl(builder.add(builder.fptosi(n, _VI), ir.Constant(_VI, [127] * LANES)),
                        ir.Constant(_VI, [23] * LANES))
        y = builder.fmul(y, builder.bitcast(e, _VF))
        y = builder.select(builder.fcmp_ordered(">", x, c(88.37)), c(float("inf")), y)
        y = builder.select(builder.fcmp_ordered("<", x, c(-87.33)), c(0.0), y)
        return builder.select(builder.fcmp_unordered("uno", x, x), x, y)
    return F32x8(v), codegen


@intrinsic
def bits(typingctx, word, start):
    """Lane j: bit start + j of the 32-bit `word` (0 or 1), as I32x8."""
    def codegen(context, builder, sig, args):
        w = _splat(builder, context.cast(builder, args[0], sig.args[0], types.uint32), _VI)
        s = _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _VI)
        shift = builder.add(s, ir.Constant(_VI, list(range(LANES))))
        return builder.and_(builder.lshr(w, shift), ir.Constant(_VI, [1] * LANES))
    return I32x8(word, start), codegen


def _fold_halves(builder, x, combine):
    """The eight lanes of x folded into one by `combine(lo half, hi half)`, a tree of halves."""
    n = LANES
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        x = combine(lo, hi)
    return builder.extract_element(x, ir.Constant(_I32, 0))


@intrinsic
def hsum(typingctx, v):
    """The sum of the eight lanes."""
    def codegen(context, builder, sig, args):
        return _fold_halves(builder, args[0], builder.fadd)
    return types.float32(v), codegen


def _max_nan(builder, a, b):
    """Lane-wise maximum of float vectors a and b, NaN where either lane is NaN (numpy's
    maximum; LLVM's maxnum alone lets a NaN lose, which hid NaN scores and activations)."""
    m = call_intrinsic(builder, f"llvm.maxnum.v{a.type.count}f32", a.type, a, b)
    return builder.select(builder.fcmp_unordered("uno", a, b), builder.fadd(a, b), m)


@intrinsic
def hmax(typingctx, v):
    """The largest of the eight lanes; NaN if any lane is."""
    def codegen(context, builder, sig, args):
        return _fold_halves(builder, args[0], lambda lo, hi: _max_nan(builder, lo, hi))
    return types.float32(v), codegen


@intrinsic
def vabs(typingctx, v):
    """Lane-wise |v| (f32)."""
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.fabs.v8f32", _VF, args[0])
    return F32x8(v), codegen


@intrinsic
def round_int8(typingctx, v):
    """Lane-wise v rounded half away from zero (llvm.round: exact for every f32) and clamped
    to -127..127, as I32x8: int8_b32's rounding of x / d. A NaN lane gives 0 (fptosi of NaN
    is undefined): its block's scale d is NaN or inf then, which the products carry."""
    def codegen(context, builder, sig, args):
        v = builder.select(builder.fcmp_unordered("uno", args[0], args[0]), ir.Constant(_VF, [0.0] * LANES),
                           args[0])
        r = builder.fptosi(call_intrinsic(builder, "llvm.round.v8f32", _VF, v), _VI)
        r = call_intrinsic(builder, "llvm.smin.v8i32", _VI, r, ir.Constant(_VI, [127] * LANES))
        return call_intrinsic(builder, "llvm.smax.v8i32", _VI, r, ir.Constant(_VI, [-127] * LANES))
    return I32x8(v), codegen


@intrinsic
def vmax(typingctx, a, b):
    """Lane-wise maximum of two F32x8, NaN where either lane is (_max_nan)."""
    def codegen(context, builder, sig, args):
        return _max_nan(builder, *args)
    return F32x8(a, b), codegen


@intrinsic
def below(typingctx, v, k, fill):
    """Lanes j < k of v, the others `fill`: a row's lanes past its end (k may be <= 0 or
    >= 8)."""
    def codegen(context, builder, sig, args):
        kk = _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _VI)
        keep = builder.icmp_signed("<", ir.Constant(_VI, list(range(LANES))), kk)
        return builder.select(keep, args[0], _vec(context, builder, sig.args[2], args[2], F32x8))
    return F32x8(v, k, fill), codegen


@intrinsic
def halves(typingctx, a, b):
    """Lanes 0-3 a, lanes 4-7 b (f32)."""
    def codegen(context, builder, sig, args):
        va, vb = (_vec(context, builder, t, v, F32x8) for t, v in zip(sig.args, args))
        return builder.shuffle_vector(va, vb, _lane_mask([0, 0, 0, 0, 8, 8, 8, 8]))
    return F32x8(a, b), codegen


@intrinsic
def blend4(typingctx, a, b):
    """Lanes 0-3 of a, lanes 4-7 of b (I32x8)."""
    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[1], _lane_mask([0, 1, 2, 3, 12, 13, 14, 15]))
    return I32x8(a, b), codegen


@intrinsic
def lane(typingctx, v, j):
    """Lane j of F32x8 v in every lane (one permute, j being a constant after inlining)."""
    def codegen(context, builder, sig, args):
        x = builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))
        return _splat(builder, x, _VF)
    return F32x8(v, j), codegen


def _lane_mask(idx):
    return ir.Constant(ir.VectorType(_I32, len(idx)), list(idx))


@intrinsic
def nibbles32(typingctx, a, i):
    """The 16 bytes at a[i]: lane j < 16 the low nibble of byte j, lane 16 + j its high one."""
    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        q = builder.load(element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], v16),
                         align=1)
        m = ir.Constant(v16, [15] * 16)
        words = builder.bitcast(q, ir.VectorType(ir.IntType(16), 8))       # one shift for all bytes
        hi = builder.bitcast(builder.lshr(words, ir.Constant(words.type, [4] * 8)), v16)
        return builder.shuffle_vector(builder.and_(q, m), builder.and_(hi, m), _lane_mask(range(32)))
    return I8x32(a, i), codegen


@intrinsic
def bits32(typingctx, word):
    """Lane j: bit j of the 32-bit `word` (0 or 1), as I8x32."""
    def codegen(context, builder, sig, args):      # byte j // 8 to lane j, then its bit j % 8 tested
        w = builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), ir.VectorType(_I8, 4))
        byte = [j // 8 if sys.byteorder == "little" else 3 - j // 8 for j in range(32)]
        b = builder.and_(builder.shuffle_vector(w, w, _lane_mask(byte)), ir.Constant(_VB, [1 << (j % 8) for j in range(32)]))
        return builder.zext(builder.icmp_unsigned("!=", b, ir.Constant(_VB, [0] * 32)), _VB)
    return I8x32(word), codegen


def call_intrinsic(builder, name, ret, *args):
    """A call of LLVM intrinsic `name` returning `ret`, typed by its arguments."""
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(f, args)


def _idot(signed: bool):
    @intrinsic
    def impl(typingctx, q, x, i):
        """Lane k: sum over e = 4k..4k+3 of q[e] * x[i + e] (x int8; q unsigned or signed)."""
        def codegen(context, builder, sig, args):
            xb = builder.load(element_ptr(context, builder, sig.args[1], args[1], args[2], sig.args[2], _VB),
                              align=1)
            q = args[0]
            if AVX2:                     # llama.cpp's sequence: u8 x s8 pairs, then i16 pairs
                if signed:               # |q| unsigned, its sign moved onto x
                    xb = call_intrinsic(builder, "llvm.x86.avx2.psign.b", _VB, xb, q)
                    q = call_intrinsic(builder, "llvm.abs.v32i8", _VB, q, ir.Constant(ir.IntType(1), 0))
                if VNNI:                 # or one vpdpbusd
                    return call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", _VI, ir.Constant(_VI, [0] * LANES),
                                          builder.bitcast(q, _VI), builder.bitcast(xb, _VI))
                v16 = ir.VectorType(ir.IntType(16), 16)
                pairs = call_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, q, xb)
                return call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", _VI, pairs, ir.Constant(v16, [1] * 16))
            v16 = ir.VectorType(ir.IntType(16), 32)
            qa = builder.sext(q, v16) if signed else builder.zext(q, v16)
            xa = builder.sext(xb, v16)
            prod = []
            for half in (range(0, 32, 2), range(1, 32, 2)):
                m = _lane_mask(half)
                prod.append(builder.mul(builder.sext(builder.shuffle_vector(qa, qa, m), ir.VectorType(_I32, 16)),
                                        builder.sext(builder.shuffle_vector(xa, xa, m), ir.VectorType(_I32, 16))))
            s = builder.add(*prod)                                  # 16 lanes: pairs
            ev = builder.shuffle_vector(s, s, _lane_mask(range(0, 16, 2)))
            od = builder.shuffle_vector(s, s, _lane_mask(range(1, 16, 2)))
            return builder.add(ev, od)
        return I32x8(q, x, i), codegen
    return impl


idot_u = _idot(False)        # q lanes 0..255
idot_s = _idot(True)         # q lanes -128..127


@intrinsic
def izeros(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, [0] * LANES)
    return I32x8(), codegen


@intrinsic
def dot4(typingctx, acc, u, x4):
    """Lane j: acc[j] + sum over e < 4 of u[4j + e] (unsigned) * byte e of the 32-bit x4
    (signed): one vpdpbusd where the CPU has VNNI; elsewhere the same sums in plain LLVM
    (exact, several instructions: callers pick this path only where VNNI holds)."""
    def codegen(context, builder, sig, args):
        acc, u = args[0], args[1]
        xs = _splat(builder, context.cast(builder, args[2], sig.args[2], types.int32), _VI)
        if VNNI:
            return call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", _VI, acc, builder.bitcast(u, _VI), xs)
        v32 = ir.VectorType(_I32, 32)
        p = builder.mul(builder.zext(u, v32), builder.sext(builder.bitcast(xs, _VB), v32))
        for e in range(4):
            acc = builder.add(acc, builder.shuffle_vector(p, p, _lane_mask([4 * j + e for j in range(LANES)])))
        return acc
    return I32x8(acc, u, x4), codegen


@intrinsic
def store_words(typingctx, a, i, stride, v):
    """Word t of the 32 bytes v (bytes 4t..4t+3) to a[i + stride * t] (a 32-bit array)."""
    def codegen(context, builder, sig, args):
        words = builder.bitcast(args[3], _VI)
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        st = context.cast(builder, args[2], sig.args[2], types.intp)
        ptr = builder.bitcast(arr.data, _I32.as_pointer())
        for t in range(LANES):
            at = builder.add(i, builder.mul(st, ir.Constant(st.type, t)))
            builder.store(builder.extract_element(words, ir.Constant(_I32, t)), builder.gep(ptr, [at]), align=4)
        return context.get_dummy_value()
    return types.none(a, i, stride, v), codegen


# --------------------------------------------------------------------------- 16 lanes (AVX-512)
# The int8 GEMV of q4_k (quant_kernels.iblock_q4_k) on a CPU with AVX-512 VNNI: a 32-byte
# chunk of codes holds two sub-blocks (low nibbles, high nibbles); read once into both halves
# of a 64-byte vector and masked (0x0F | 0xF0), one vpdpbusd multiplies both sub-blocks with
# their 64 contiguous bytes of x, the high half's sums 16x (its factor divided by 16:
# exact). 5 instructions a pair of sub-blocks where the 8-lane form takes 13 (a Zen 5 core:
# 23 -> ~35 GB/s of q4_k).
AVX512 = {"+avx512f", "+avx512bw"} <= _HOST                # 16-lane floats and bytes in one register
VNNI512 = AVX512 and "+avx512vnni" in _HOST
F32x16 = VecType("F32x16", ir.FloatType(), 16, types.float32)
_VF16, _VI16 = F32x16.llvm, ir.VectorType(_I32, 16)
_register(operator.add, F32x16, lambda b, x, y: b.fadd(x, y, flags=("contract",)))


@intrinsic
def zeros16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF16, [0.0] * 16)
    return F32x16(), codegen


@intrinsic
def nibble_pair_dot(typingctx, acc, r, qo, xq, xo, fp):
    """acc + fp * (the 32 bytes of codes at r[qo], low nibbles against x bytes xq[xo:xo+32],
    high nibbles (as 16 times their value) against xq[xo+32:xo+64]), in 16 float lanes of
    partial sums (each the integer dot product of 4 pairs, exact)."""
    def codegen(context, builder, sig, args):
        v32 = builder.load(element_ptr(context, builder, sig.args[1], args[1], args[2], sig.args[2],
                                       ir.VectorType(_I8, 32)), align=1)
        v64 = builder.shuffle_vector(v32, v32, _lane_mask(list(range(32)) * 2))
        v64 = builder.and_(v64, ir.Constant(ir.VectorType(_I8, 64), [15] * 32 + [240] * 32))
        x = builder.load(element_ptr(context, builder, sig.args[3], args[3], args[4], sig.args[4], _VI16),
                         align=1)
        d = call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", _VI16, ir.Constant(_VI16, [0] * 16),
                           builder.bitcast(v64, _VI16), x)
        return builder.call(cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF16, [_VF16] * 3), "llvm.fmuladd.v16f32"),
            [builder.sitofp(d, _VF16), args[5], args[0]])
    return F32x16(acc, r, qo, xq, xo, fp), codegen


@intrinsic
def nibble_fma16(typingctx, acc, r, qo, x, p, shift):
    """acc + (the 16 bytes at r[qo], shifted right by `shift` (0: low nibbles, 4: high), & 15)
    * x[p:p+16] (float32) in 16 lanes: the f32 GEMV's q4_k codes, 16 at a time."""
    def codegen(context, builder, sig, args):
        b16 = builder.load(element_ptr(context, builder, sig.args[1], args[1], args[2], sig.args[2],
                                       ir.VectorType(_I8, 16)), align=1)
        q = builder.zext(b16, _VI16)
        sh = builder.trunc(context.cast(builder, args[5], sig.args[5], types.int32), _I32)
        q = builder.and_(builder.lshr(q, _splat(builder, sh, _VI16)), ir.Constant(_VI16, [15] * 16))
        xv = builder.load(element_ptr(context, builder, sig.args[3], args[3], args[4], sig.args[4], _VF16),
                          align=4)
        return builder.call(cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF16, [_VF16] * 3), "llvm.fmuladd.v16f32"),
            [builder.sitofp(q, _VF16), xv, args[0]])
    return F32x16(acc, r, qo, x, p, shift), codegen


@intrinsic
def scaled16(typingctx, acc, s, f, j):
    """acc + s * f[j] in 16 lanes (f an F32x8, j a constant after inlining)."""
    def codegen(context, builder, sig, args):
        fj = builder.extract_element(args[2], context.cast(builder, args[3], sig.args[3], types.int32))
        return builder.call(cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF16, [_VF16] * 3), "llvm.fmuladd.v16f32"),
            [args[1], _splat(builder, fj, _VF16), args[0]])
    return F32x16(acc, s, f, j), codegen


load_f32x16 = _load(F32x16, 4)      # a[i:i+16] of a float32 array


@intrinsic
def join16(typingctx, a, b):
    """Two F32x8 as one F32x16 (a's lanes first): the f32 GEMV's tiles decode a packed row
    eight lanes at a time and multiply-add sixteen (quant_kernels._gemv_tile)."""
    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[1], _lane_mask(range(16)))
    return F32x16(a, b), codegen


@intrinsic
def fma16(typingctx, a, b, c):
    """a * b + c in 16 lanes (F32x16)."""
    def codegen(context, builder, sig, args):
        return builder.call(cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF16, [_VF16] * 3), "llvm.fmuladd.v16f32"), list(args))
    return F32x16(a, b, c), codegen


@intrinsic
def fold16(typingctx, v):
    """F32x16 -> F32x8: lanes j and j + 8 added."""
    def codegen(context, builder, sig, args):
        lo = builder.shuffle_vector(args[0], args[0], _lane_mask(range(8)))
        hi = builder.shuffle_vector(args[0], args[0], _lane_mask(range(8, 16)))
        return builder.fadd(lo, hi)
    return F32x8(v), codegen


# q4_k's super-block header in 16 lanes: the eight 6-bit scales and mins decoded from their
# 12 bytes with byte shuffles (not lane by lane in 32 bits), d and dmin converted by the CPU's
# f16 instruction (not two table lookups), and every factor the block's dot products need
# made at once: 28 -> ~14 instructions a super-block of the int8 GEMV (a Zen 5 core).
_I8x16 = ir.VectorType(_I8, 16)
_SC_LO = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 24, 25, 26, 27]     # b[..] or, from 16, b[..] >> 4
_SC_HI = [16, 16, 16, 16, 0, 1, 2, 3, 16, 16, 16, 16, 4, 5, 6, 7]    # 16: a zero byte
_SC_MASK = [63] * 4 + [15] * 4 + [63] * 4 + [15] * 4
_D_SCALE = [1.0, 1.0 / 16] * 4 + [-1.0] * 8      # odd sub-blocks' codes read as 16 q (0xF0 masks)


def _k4_scales(builder, b):
    """The 16 bytes b (a q4_k super-block's bytes 4..19) -> <16 x i32>: its scales sc_0..7,
    then mins m_0..7 (get_scale_min_k4: j < 4 the low 6 bits of bytes j and j + 4; j >= 4
    the low / high nibble of byte j + 4 with the top two bits of byte j - 4 / j above)."""
    words = ir.VectorType(ir.IntType(16), 8)
    b4 = builder.bitcast(builder.lshr(builder.bitcast(b, words), ir.Constant(words, [4] * 8)), _I8x16)
    b4 = builder.and_(b4, ir.Constant(_I8x16, [15] * 16))
    lo = builder.and_(builder.shuffle_vector(b, b4, _lane_mask(_SC_LO)), ir.Constant(_I8x16, _SC_MASK))
    hi = builder.shuffle_vector(b, ir.Constant(_I8x16, [0] * 16), _lane_mask(_SC_HI))
    hi = builder.shl(builder.lshr(hi, ir.Constant(_I8x16, [6] * 16)), ir.Constant(_I8x16, [4] * 16))
    return builder.zext(builder.or_(lo, hi), _VI16)


@intrinsic
def k4_factors(typingctx, r, o, xd, xs, c):
    """The q4_k super-block at byte o of row r against x blocks c .. c + 7 (scales xd, scale
    times sum xs): lane j < 8 sc_j d xd[c + j] (odd j: / 16, for nibble_pair_dot's high
    halves), lane 8 + j m_j (-dmin) xs[c + j] (the mins' part of the block's dot product)."""
    def codegen(context, builder, sig, args):
        b = builder.load(element_ptr(context, builder, sig.args[0], args[0], builder.add(
            context.cast(builder, args[1], sig.args[1], types.intp), ir.Constant(ir.IntType(64), 4)),
            types.intp, _I8x16), align=1)
        sc = builder.sitofp(_k4_scales(builder, b), _VF16)
        v2h = ir.VectorType(ir.HalfType(), 2)
        dm = builder.fpext(builder.load(element_ptr(context, builder, sig.args[0], args[0], args[1],
                                                    sig.args[1], v2h), align=1), ir.VectorType(ir.FloatType(), 2))
        dv = builder.fmul(builder.shuffle_vector(dm, dm, _lane_mask([0] * 8 + [1] * 8)), ir.Constant(_VF16, _D_SCALE))
        xv = [builder.load(element_ptr(context, builder, sig.args[k], args[k], args[4], sig.args[4], _VF), align=4)
              for k in (2, 3)]
        return builder.fmul(builder.fmul(sc, dv), builder.shuffle_vector(xv[0], xv[1], _lane_mask(range(16))))
    return F32x16(r, o, xd, xs, c), codegen


@intrinsic
def pair_lanes(typingctx, g, k):
    """[g[2k]] * 8 + [g[2k + 1]] * 8 (k a constant after inlining): pair k's factors."""
    def codegen(context, builder, sig, args):
        k2 = builder.mul(context.cast(builder, args[1], sig.args[1], types.int32), ir.Constant(_I32, 2))
        lo = _splat(builder, builder.extract_element(args[0], k2), _VF)
        hi = _splat(builder, builder.extract_element(args[0], builder.add(k2, ir.Constant(_I32, 1))), _VF)
        return builder.shuffle_vector(lo, hi, _lane_mask(range(16)))
    return F32x16(g, k), codegen


@intrinsic
def high8(typingctx, g):
    """Lanes 8..15 of an F32x16."""
    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[0], _lane_mask(range(8, 16)))
    return F32x8(g), codegen


@intrinsic
def add_high8(typingctx, acc, g):
    """acc + g on lanes 8..15 (F32x16; lanes 0..7 of acc kept): one masked add."""
    def codegen(context, builder, sig, args):
        keep = ir.Constant(ir.VectorType(ir.IntType(1), 16), [0] * 8 + [1] * 8)
        return builder.select(keep, builder.fadd(args[0], args[1]), args[0])
    return F32x16(acc, g), codegen


__all__ = ["F32x8", "F32x16", "AVX512", "VNNI512", "fma16", "fold16", "join16", "load_f32x16", "add_high8", "high8", "k4_factors", "pair_lanes", "nibble_fma16", "nibble_pair_dot", "scaled16",
           "zeros16", "I32x8", "I8x32", "LANES", "VNNI", "bits", "bits32", "blend4",
           "lane", "dot4", "exp", "halves", "idot_s", "idot_u", "izeros", "load_bytes32", "nibbles32",
           "fma", "hsum", "round_int8", "vabs", "load_f32", "load_i8", "load_u8", "load_u32",
           "store_lanes", "store_words", "to_f32", "zeros"]
