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

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

LANES = 8
_I32 = ir.IntType(32)
_VF = ir.VectorType(ir.FloatType(), LANES)
_VI = ir.VectorType(_I32, LANES)


class F32x8Type(types.Type):
    def __init__(self):
        super().__init__(name="F32x8")


class I32x8Type(types.Type):
    def __init__(self):
        super().__init__(name="I32x8")


F32x8 = F32x8Type()
I32x8 = I32x8Type()


@register_model(F32x8Type)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(I32x8Type)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


def _splat(builder, scalar, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_VI, [0] * LANES))


def _vec(context, builder, ty, val, vty):
    """`val` of numba type `ty` as a vector of `vty` (a scalar is converted and splatted)."""
    if isinstance(ty, (F32x8Type, I32x8Type)):
        return val
    if vty is _VF:
        return _splat(builder, context.cast(builder, val, ty, types.float32), vty)
    return _splat(builder, context.cast(builder, val, ty, types.int32), vty)


def _is_f(t):
    return isinstance(t, F32x8Type) or isinstance(t, types.Float)


def _is_i(t):
    return isinstance(t, I32x8Type) or isinstance(t, types.Integer)


def _binary(vty, emit):
    """An intrinsic applying `emit(builder, a, b)` lane-wise; either side may be a scalar."""
    rty = F32x8 if vty is _VF else I32x8

    @intrinsic
    def impl(typingctx, a, b):
        def codegen(context, builder, sig, args):
            va = _vec(context, builder, sig.args[0], args[0], vty)
            vb = _vec(context, builder, sig.args[1], args[1], vty)
            return emit(builder, va, vb)
        return rty(a, b), codegen
    return impl


def _register(op, vty, emit):
    impl = _binary(vty, emit)
    want, accept = (F32x8Type, _is_f) if vty is _VF else (I32x8Type, _is_i)

    @overload(op)
    def _ov(a, b):
        if (isinstance(a, want) or isinstance(b, want)) and accept(a) and accept(b):
            return lambda a, b: impl(a, b)


_register(operator.add, _VF, lambda b, x, y: b.fadd(x, y, flags=("contract",)))
_register(operator.sub, _VF, lambda b, x, y: b.fsub(x, y, flags=("contract",)))
_register(operator.mul, _VF, lambda b, x, y: b.fmul(x, y, flags=("contract",)))
_register(operator.add, _VI, lambda b, x, y: b.add(x, y))
_register(operator.sub, _VI, lambda b, x, y: b.sub(x, y))
_register(operator.and_, _VI, lambda b, x, y: b.and_(x, y))
_register(operator.or_, _VI, lambda b, x, y: b.or_(x, y))
_register(operator.lshift, _VI, lambda b, x, y: b.shl(x, y))
_register(operator.rshift, _VI, lambda b, x, y: b.lshr(x, y))      # logical: lanes hold bits


def _element_ptr(context, builder, aty, ary, idx, ity, elem):
    """A pointer to `elem`-typed lanes starting at element `idx` of contiguous array `ary`."""
    arr = context.make_array(aty)(context, builder, ary)
    i = context.cast(builder, idx, ity, types.intp)
    return builder.bitcast(builder.gep(arr.data, [i]), elem.as_pointer())


@intrinsic
def load_f32(typingctx, a, i):
    """a[i:i+8] of a float32 array."""
    def codegen(context, builder, sig, args):
        return builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1],
                                         sig.args[1], _VF), align=4)
    return F32x8(a, i), codegen


@intrinsic
def store_f32(typingctx, a, i, v):
    """a[i:i+8] = v for a float32 array."""
    def codegen(context, builder, sig, args):
        builder.store(args[2], _element_ptr(context, builder, sig.args[0], args[0], args[1],
                                            sig.args[1], _VF), align=4)
        return context.get_dummy_value()
    return types.none(a, i, v), codegen


def _load_bytes(signed: bool):
    @intrinsic
    def impl(typingctx, a, i):
        def codegen(context, builder, sig, args):
            vb = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1],
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
        vs = [_vec(context, builder, t, v, _VF) for t, v in zip(sig.args, args)]
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3),
                                           "llvm.fmuladd.v8f32")
        return builder.call(f, vs)
    return F32x8(a, b, c), codegen


@intrinsic
def bits(typingctx, word, start):
    """Lane j: bit start + j of the 32-bit `word` (0 or 1), as I32x8."""
    def codegen(context, builder, sig, args):
        w = _splat(builder, context.cast(builder, args[0], sig.args[0], types.uint32), _VI)
        s = _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _VI)
        shift = builder.add(s, ir.Constant(_VI, list(range(LANES))))
        return builder.and_(builder.lshr(w, shift), ir.Constant(_VI, [1] * LANES))
    return I32x8(word, start), codegen


@intrinsic
def hsum(typingctx, v):
    """The sum of the eight lanes (as a tree of halves)."""
    def codegen(context, builder, sig, args):
        x, n = args[0], LANES
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
            hi = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
            x = builder.fadd(lo, hi)
        return builder.extract_element(x, ir.Constant(_I32, 0))
    return types.float32(v), codegen


__all__ = ["F32x8", "I32x8", "LANES", "bits", "fma", "hsum", "load_f32", "load_i8", "load_u8",
           "store_f32", "to_f32", "zeros"]
