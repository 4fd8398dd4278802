"""cblas_sgemm called from inside numba kernels, on numba's own threads.

Why: a prefill matmul over packed weights decodes blocks of weight rows and multiplies each
with BLAS. Run from Python threads beside numba's OpenMP workers, the BLAS calls shared the
cores with workers still spinning after the kernel before (SmolLM2's 128-token prefill on 2
cores: 194 ms of matmuls, 180 ms with the workers made passive, which decode cannot afford).
Called from a prange, the workers themselves run the BLAS calls.

The function's address is an argument, not a constant, so kernels that call it stay in
numba's on-disk cache (an address differs from one process to the next).
"""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from rlx_core.backends.numpy.blas import cblas_sgemm

_I32, _I64, _F32, _VP = ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.IntType(8).as_pointer()
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


@intrinsic
def sgemm(typingctx, fn, ilp64, a, b, c, trans_a, trans_b):
    """c = op(a) @ op(b) for f32 2-D arrays, c [M, N]; a is [M, K], or [K, M] when trans_a
    (a weight gradient's activations^T); b is [K, N], or [N, K] when trans_b: one call of the
    cblas_sgemm at address `fn` (64-bit integers when ilp64). Rows may be strided (a view's
    leading dimension, so sub-blocks go in without copies); elements within a row must be
    contiguous, which the caller ensures. Empty shapes are the caller's to skip."""
    def codegen(context, builder, sig, args):
        fn_, ilp, av, bv, cv, ta, tb = args
        arrs = [context.make_array(t)(context, builder, x) for t, x in zip(sig.args[2:5], (av, bv, cv))]
        r0, r1 = cgutils.unpack_tuple(builder, arrs[0].shape, 2)
        ta = context.cast(builder, ta, sig.args[5], types.boolean)
        m, k = builder.select(ta, r1, r0), builder.select(ta, r0, r1)
        n = cgutils.unpack_tuple(builder, arrs[2].shape, 2)[1]
        four = ir.Constant(_I64, 4)
        lds = [builder.sdiv(cgutils.unpack_tuple(builder, x.strides, 2)[0], four) for x in arrs]
        ptrs = [builder.bitcast(x.data, _VP) for x in arrs]
        op_a = builder.select(ta, ir.Constant(_I32, TRANS), ir.Constant(_I32, NO_TRANS))
        op_b = builder.select(context.cast(builder, tb, sig.args[6], types.boolean),
                              ir.Constant(_I32, TRANS), ir.Constant(_I32, NO_TRANS))
        address = context.cast(builder, fn_, sig.args[0], types.int64)

        def call(it):
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I32, it, it, it, _F32, _VP, it, _VP, it,
                                                   _F32, _VP, it])
            i = (lambda v: v) if it is _I64 else (lambda v: builder.trunc(v, it))
            builder.call(builder.inttoptr(address, fnty.as_pointer()), [
                ir.Constant(_I32, ROW_MAJOR), op_a, op_b,
                i(m), i(n), i(k), ir.Constant(_F32, 1.0), ptrs[0], i(lds[0]), ptrs[1], i(lds[1]),
                ir.Constant(_F32, 0.0), ptrs[2], i(lds[2])])

        with builder.if_else(context.cast(builder, ilp, sig.args[1], types.boolean)) as (wide, narrow):
            with wide:
                call(_I64)
            with narrow:
                call(_I32)
        return context.get_dummy_value()
    return types.none(fn, ilp64, a, b, c, trans_a, trans_b), codegen


def parts(n: int) -> int:
    """Column parts of an N-wide product, one per numba thread, none under 64 columns."""
    return max(1, min(numba.get_num_threads(), n // 64))


SGEMM = cblas_sgemm()         # (address, ilp64), or None where numpy's BLAS is not an OpenBLAS

__all__ = ["SGEMM", "parts", "sgemm"]
