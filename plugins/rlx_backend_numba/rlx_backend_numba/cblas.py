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
def sgemm_nt(typingctx, fn, ilp64, x, w, rows, out, col):
    """out[:, col:col + rows] = x @ w[:rows]^T for C-ordered f32 x [M, K], w [>= rows, K] and
    out [M, N]: one call of the cblas_sgemm at address `fn` (64-bit integers when ilp64)."""
    def codegen(context, builder, sig, args):
        fn_, ilp, xv, wv, rows_, outv, col_ = args
        xa = context.make_array(sig.args[2])(context, builder, xv)
        wa = context.make_array(sig.args[3])(context, builder, wv)
        oa = context.make_array(sig.args[5])(context, builder, outv)
        m, k = cgutils.unpack_tuple(builder, xa.shape, 2)
        ldo = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
        n = context.cast(builder, rows_, sig.args[4], types.intp)
        optr = builder.gep(oa.data, [context.cast(builder, col_, sig.args[6], types.intp)])
        ptrs = [builder.bitcast(p, _VP) for p in (xa.data, wa.data, optr)]
        address = context.cast(builder, fn_, sig.args[0], types.int64)

        def call(it):
            fnty = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I32, it, it, it, _F32, _VP, it, _VP, it,
                                                   _F32, _VP, it])
            i = (lambda v: v) if it is _I64 else (lambda v: builder.trunc(v, it))
            builder.call(builder.inttoptr(address, fnty.as_pointer()), [
                ir.Constant(_I32, ROW_MAJOR), ir.Constant(_I32, NO_TRANS), ir.Constant(_I32, TRANS),
                i(m), i(n), i(k), ir.Constant(_F32, 1.0), ptrs[0], i(k), ptrs[1], i(k),
                ir.Constant(_F32, 0.0), ptrs[2], i(ldo)])

        with builder.if_else(context.cast(builder, ilp, sig.args[1], types.boolean)) as (wide, narrow):
            with wide:
                call(_I64)
            with narrow:
                call(_I32)
        return context.get_dummy_value()
    return types.none(fn, ilp64, x, w, rows, out, col), codegen


def parts(n: int) -> int:
    """Column parts of an N-wide product, one per numba thread, none under 64 columns."""
    return max(1, min(numba.get_num_threads(), n // 64))


SGEMM = cblas_sgemm()         # (address, ilp64), or None where numpy's BLAS is not an OpenBLAS

__all__ = ["SGEMM", "parts", "sgemm_nt"]
