"""One builder per op of the core table: it turns a node into prepared launches.

A builder is `fn(b: Build, node, ins: list[V], outs: list[V])`; view builders return the
view instead. Semantics follow the NumPy reference backend (rlx_core/backends/numpy).
"""
from __future__ import annotations

import math

import attrs
import numpy as np
from rlx_core.backends.base import strided_transposes
from rlx_core.ir.dtype import BF16, BOOL, F16, F32, F64, I32, I64, U8, DType
from rlx_core.ir.errors import BackendError
from rlx_core.ir.ops import Level, MaskKind, get_op

from . import codegen, device, sources
from . import rows as row_kernels
from .codegen import acc_of, ctype
from .fft import build_fft
from .values import CONFIG, V, contiguous_strides, nocopy_reshape_strides

LOW = (F16, BF16)
i32, i64, f64 = np.int32, np.int64, np.float64


# split-K attention: blocks per SM the key splits aim for, threads per block, K (and V) vector
# loads per lane and key tile, keys per split at least (tools/attn_bench.py --sweep on the H100,
# 1B-shape decode, batch 1..64 at ctx 384 and 2048: 2 loads beat 1 and 4 by up to 1.4x at batch
# 32-64, 128 threads beat 64 and 256, 2 blocks per SM beat 1 and 4 at batch 8-32)
ATTN_BLOCKS_PER_SM = 2
# the tensor-core attention's warps take 2 m-tiles of 16 query rows (a block 128 rows) where
# that still gives this many blocks per SM, else 1. FLUX's 1x24x4608x128 on the H200: 0.885
# against 1.029 ms (each K/V tile feeds twice the rows); 1x24x1024x64 (192 blocks of 128
# rows): 0.039 against 0.033 ms
ATTN_TC_MIN_BLOCKS_PER_SM = 2
# head dims the tensor-core attention takes (mma.sync; at 256 a warp holds one m-tile)
ATTN_TC_DIMS = (32, 64, 96, 128, 256)
ATTN_THREADS = sources.ATTN_THREADS
ATTN_LOADS = sources.ATTN_LOADS
ATTN_SMALL_GRID = sources.ATTN_SMALL_GRID
ATTN_MIN_CHUNK = 64
ROW_THREADS = 1024           # threads of a row kernel (norms, softmax) at most
ROPE_ROWS = 8                # (head, position) rows of a RoPE block, a warp each


def pow2(n: int, lo: int = 32, hi: int = 1024) -> int:
    """The smallest power of two from lo up that reaches n, at most hi."""
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def _block(n: int, cap: int | None = None) -> int:
    return pow2(n, 32, cap or ROW_THREADS)


def _ew(b, n, ins, outs):
    program = _program(n)
    taken = b.attn_epilogues.pop(b.node, None)
    if taken is None:
        return b.elementwise(program, ins, outs[0])
    fns = _collected(b, lambda: b.elementwise(program, ins, outs[0]))

    def unless_taken():          # (the attention's dispatch says whether its kernel computed it)
        if not taken["done"]:
            for fn in fns:
                fn()
    b.add(unless_taken)


def _program(n) -> tuple:
    """An elementwise node's program (fused_elementwise's, or the one op on its inputs)."""
    return n.a["program"] if n.op == "fused_elementwise" else ((n.op, n.attrs, tuple(range(len(n.inputs)))),)


# ----------------------------------------------------------------------------- matrices
def _as_matrix(b, v: V, rows: int, cols: int) -> tuple:
    """(V, row_stride) viewing v as contiguous-inner rows [rows, cols] (copying if needed)."""
    if v.size == 0:
        return v, cols
    st = nocopy_reshape_strides(v.shape, v.es, (rows, cols))
    if st is not None and (cols == 1 or st[1] == 1):
        return v, (st[0] if rows > 1 else cols)
    c = b.contiguous(v)
    return c, cols


def _rows_ld(v: V) -> int | None:
    """The row stride of v seen as rows [prod(shape[:-1]), shape[-1]] of unit element stride
    (a GEMM's output: its ldc), or None where no such view exists."""
    return _row_stride(v.shape, v.es)


def _row_stride(shape: tuple, strides: tuple) -> int | None:
    """`_rows_ld` of an array of `shape` and element `strides`."""
    size = math.prod(shape)
    rows = size // max(shape[-1], 1)
    st = nocopy_reshape_strides(shape, strides, (rows, shape[-1])) if size and len(shape) > 1 else None
    if st is None or (shape[-1] > 1 and st[1] != 1):
        return None
    return st[0] if rows > 1 else shape[-1]


def _mat_layout(R, C, sr, sc):
    """'r' row-major (ld=sr), 'c' column-major (ld=sc), or None."""
    if R == 1:
        sr = max(C, 1)
    if C == 1:
        sc = 1
    if sc == 1 and sr >= max(1, C):
        return "r", sr
    if sr == 1 and sc >= max(1, R):
        return "c", sc
    return None, 0


_CUDA_T = {F32: "CUDA_R_32F", F64: "CUDA_R_64F", F16: "CUDA_R_16F", BF16: "CUDA_R_16BF"}


@attrs.frozen(eq=False)
class MatmulCall:
    """One out <- a @ w (a, w transposed per ta, tb) and what may fuse into it: swiglu (also
    compute the fused_swiglu of out's two halves into this value, in the same step) or
    epilogue (bias, act: added and applied in cuBLASLt's epilogue)."""
    a: V
    w: V
    ta: bool
    tb: bool
    out: V
    swiglu: V | None = None
    epilogue: tuple | None = None


OP_N, OP_T = 0, 1            # cuBLAS's operations: as stored, transposed
# a float matmul's strategies (matmul_strategy); UNFUSABLE: its swiglu or epilogue cannot fuse
ROWS, STAGED, REPACKED, GEMV, GEMV_TC, LT_EPILOGUE, BLAS, UNFUSABLE = (
    "rows", "staged", "repacked", "gemv", "gemv_tc", "lt_epilogue", "blas", "unfusable")


def _as_read(call: MatmulCall) -> tuple:
    """(A [.., M, K], W [.., K, N]): the operands' arrays transposed per ta/tb (views)."""
    return (call.a.arr.swapaxes(-1, -2) if call.ta else call.a.arr,
            call.w.arr.swapaxes(-1, -2) if call.tb else call.w.arr)


def _gemm_operands(xp, call: MatmulCall) -> tuple:
    """(A, W): `_as_read`'s operands broadcast to the output's batch dims (views)."""
    a_mat, w_mat = _as_read(call)
    batch = tuple(call.out.shape[:-2])
    return (xp.broadcast_to(a_mat, batch + a_mat.shape[-2:]),
            xp.broadcast_to(w_mat, batch + (a_mat.shape[-1], w_mat.shape[-1])))


@attrs.frozen
class MatmulCase:
    """What chooses a float matmul's strategy (its operands already in the output's dtype),
    as plain values: `matmul_strategy` reads nothing else, so its choices are testable without
    a device. a_strides / w_strides: element strides of the GEMM's operands (`_gemm_operands`)."""
    dtype: DType
    a_shape: tuple
    a_contiguous: bool
    ta: bool
    w_ndim: int
    out_shape: tuple
    out_strides: tuple
    out_contiguous: bool
    a_strides: tuple
    w_strides: tuple
    mkn: tuple                      # (M, K, N)
    aligned: bool                   # A's and W's first bytes on 16-byte boundaries (GEMV loads)
    swiglu: bool = False
    swiglu_contiguous: bool = False
    epilogue: bool = False

    @classmethod
    def of(cls, xp, call: MatmulCall) -> MatmulCase:
        a_mat, w_mat = _gemm_operands(xp, call)
        size = call.out.arr.itemsize

        def elements(arr):
            return tuple(s // size for s in arr.strides)
        return cls(call.out.dt, call.a.shape, call.a.contiguous(), call.ta, call.w.arr.ndim, call.out.shape,
                   call.out.es, call.out.contiguous(), elements(a_mat), elements(w_mat),
                   (a_mat.shape[-2], a_mat.shape[-1], w_mat.shape[-1]),
                   call.a.arr.data.ptr % 16 == 0 and call.w.arr.data.ptr % 16 == 0,
                   call.swiglu is not None, call.swiglu is not None and call.swiglu.contiguous(),
                   call.epilogue is not None)

    @property
    def batch(self) -> tuple:
        return self.out_shape[:-2]

    @property
    def ldc(self) -> int | None:
        """The output's row stride where cuBLAS writes it as one matrix of any row stride."""
        return _row_stride(self.out_shape, self.out_strides) if len(self.out_shape) == 2 else None

    def layouts(self) -> tuple:
        """(A's, W's) `_mat_layout`: (layout, leading dimension)."""
        M, K, N = self.mkn
        return (_mat_layout(M, K, self.a_strides[-2], self.a_strides[-1]),
                _mat_layout(K, N, self.w_strides[-2], self.w_strides[-1]))

    def batch_calls(self) -> tuple:
        """`_batch_calls` of this product."""
        M, _, N = self.mkn
        out_strides = contiguous_strides(self.out_shape)
        return _batch_calls(self.batch, self.a_strides, self.w_strides, out_strides, M * N)

    def rows_of_one_weight(self) -> bool:
        """x [..., M, K] (contiguous) @ one 2-D weight into rows of one row stride."""
        return (len(self.out_shape) > 2 and self.w_ndim == 2 and not self.ta
                and self.a_shape[:-1] == self.out_shape[:-1] and self.a_contiguous
                and _row_stride(self.out_shape, self.out_strides) is not None
                and (not self.swiglu or self.swiglu_contiguous))

    def gemv_fits(self) -> bool:
        """A 16-bit decode product the GEMV kernel takes: up to GEMV_MAX_M x rows, `_streams_w`."""
        return self.x_rows() <= GEMV_MAX_M and self._streams_w()

    def gemv_tc_fits(self) -> bool:
        """A 16-bit decode product sources.GEMV_TC takes: GEMV_MAX_M + 1 to GEMV_TC_MAX_M x rows,
        K a multiple of 32 (whole chunks of the lanes' loads), `_streams_w`, a SwiGLU's rows contiguous."""
        return (GEMV_MAX_M < self.x_rows() <= GEMV_TC_MAX_M and self.mkn[1] % 32 == 0 and self._streams_w()
                and (not self.swiglu or self.swiglu_contiguous))

    def x_rows(self) -> int:
        return self.mkn[0] * math.prod(self.batch)

    def _streams_w(self) -> bool:
        """x rows contiguous and aligned, W [N, K] row-major (one matrix for the whole batch), K a
        multiple of 8, a contiguous output: the weight streamed row by row as a GEMV streams it."""
        _, K, _ = self.mkn
        nb = math.prod(self.batch)
        (_, _), (w_layout, ldw) = self.layouts()
        return (self.dtype in LOW and w_layout == "c" and ldw == K
                and (nb == 1 or all(s == 0 for s in self.w_strides[:-2]))
                and self.a_contiguous and not self.ta
                and math.prod(self.a_shape[:-2]) == nb and K % 8 == 0 and self.out_contiguous
                and self.aligned)


def matmul_strategy(case: MatmulCase) -> str:
    """The strategy computing a float, non-empty matmul (each strategy function says when
    and why it is chosen), or UNFUSABLE where its swiglu or epilogue cannot fuse into it."""
    if case.rows_of_one_weight():
        return ROWS
    if not case.out_contiguous and case.ldc is None:
        return STAGED
    (a_layout, _), (w_layout, _) = case.layouts()
    if a_layout is None or w_layout is None:
        return UNFUSABLE if case.swiglu or case.epilogue else REPACKED
    gemv = case.gemv_fits()
    if case.epilogue:
        offsets, (count, *_) = case.batch_calls()
        return LT_EPILOGUE if not gemv and not case.swiglu and len(offsets) == 1 and count == 1 else UNFUSABLE
    if gemv:
        return GEMV
    if case.gemv_tc_fits():
        return GEMV_TC
    return UNFUSABLE if case.swiglu else BLAS


def _matmul(builder, a: V, w: V, ta: bool, tb: bool, out: V, swiglu: V | None = None, epilogue=None) -> bool:
    """out <- a @ w (cuBLAS, or the GEMV kernel for decode shapes). swiglu: also compute the
    fused_swiglu of out's two halves into this array in the same step; epilogue (bias, act):
    add the bias and apply act in cuBLASLt's epilogue. Returns False (adding no step) when
    that swiglu or epilogue cannot be fused here."""
    return _matmul_call(builder, MatmulCall(a, w, ta, tb, out, swiglu, epilogue))


def _matmul_call(builder, call: MatmulCall) -> bool:
    """`_matmul`: what needs no strategy (no fusion possible, an empty output, an integer
    product), else the operands cast to the output's dtype and `matmul_strategy`'s choice."""
    if not _fusion_fits(call):
        return False
    out = call.out
    if out.size == 0:
        return True
    if not out.dt.is_float:
        _matmul_naive(builder, call.a, call.w, call.ta, call.tb, out)
        return True
    if call.a.dt is not out.dt:
        call = attrs.evolve(call, a=builder.contiguous(call.a, out.dt))
    if call.w.dt is not out.dt:
        call = attrs.evolve(call, w=builder.contiguous(call.w, out.dt))
    case = MatmulCase.of(builder.cp, call)
    return _MATMUL_STRATEGIES[matmul_strategy(case)](builder, case, call)


def _fusion_fits(call: MatmulCall) -> bool:
    """Whether the call's swiglu (16-bit, one dtype throughout, a non-empty output) or
    epilogue (`_lt_fits`) may fuse at all, before any strategy is weighed."""
    out = call.out
    if call.swiglu is not None and (out.dt not in LOW or call.a.dt is not out.dt or call.w.dt is not out.dt
                                    or out.size == 0):
        return False
    return call.epilogue is None or _lt_fits(call.a, call.w, out, *call.epilogue)


def _matmul_rows(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """x [..., M, K] @ one weight: all leading rows as one GEMM, so the weight is read once
    for the batch (a strided batch of M=1 products re-reads it per row); the output rows may
    have any stride (a part of a concat)."""
    rows = math.prod(call.out.shape[:-1])

    def flat(v):
        ld = _rows_ld(v)
        return V(builder.cp.lib.stride_tricks.as_strided(v.arr, (rows, v.shape[-1]),
                                                         (ld * v.arr.itemsize, v.arr.itemsize)), v.dt)
    return _matmul_call(builder, attrs.evolve(call, a=flat(call.a), ta=False, out=flat(call.out),
                                              swiglu=None if call.swiglu is None else flat(call.swiglu)))


def _matmul_staged(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """An output cuBLAS cannot write (neither contiguous nor rows of one stride; no planned
    layout asks this): the product into a fresh buffer, then copied."""
    staging = builder.buffer(call.out.shape, call.out.dt, "matmul output")
    if not _matmul_call(builder, attrs.evolve(call, out=staging)):
        return False
    builder.copy(staging, call.out)
    return True


def _matmul_repacked(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """An operand with no matrix layout cuBLAS reads (neither rows nor columns of unit
    stride): that operand copied contiguous (as the GEMM reads it, so no longer transposed)."""
    a_mat, w_mat = _as_read(call)
    (a_layout, _), (w_layout, _) = case.layouts()
    if a_layout is None:
        a_mat = builder.contiguous(V(a_mat, case.dtype)).arr
    if w_layout is None:
        w_mat = builder.contiguous(V(w_mat, case.dtype)).arr
    repacked = MatmulCall(V(a_mat, case.dtype), V(w_mat, case.dtype), False, False, call.out)
    return _matmul_call(builder, repacked)


def _matmul_gemv(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """A 16-bit decode product (`MatmulCase.gemv_fits`): the GEMV kernel, which beats cuBLAS
    up to GEMV_MAX_M rows and can write the SwiGLU of the result; cuBLAS (and an unfused
    SwiGLU) where CONFIG["gemv"] is off."""
    return _matmul_streamed(builder, case, call, _gemv_step, "gemv")


def _matmul_gemv_tc(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """A 16-bit decode product of a few more rows (`MatmulCase.gemv_tc_fits`): sources.GEMV_TC
    (with the SwiGLU of the result where asked), or cuBLAS (and an unfused SwiGLU) where
    CONFIG["gemv_tc"] is off or the GPU has no mma.sync."""
    step = None if device.mma_missing(builder.cc, builder.hip) else _gemv_tc_step
    return _matmul_streamed(builder, case, call, step, "gemv_tc")


def _matmul_streamed(builder, case: MatmulCase, call: MatmulCall, step, switch: str) -> bool:
    """A product on a kernel streaming W [N, K] row by row: `step`(builder, x, W, target, rows,
    N, K, swiglu) -> (run, reads), writing the SwiGLU of the result where the call asks for it;
    cuBLAS (and an unfused SwiGLU) where CONFIG[switch] is off or there is no step."""
    a_mat, w_mat = _gemm_operands(builder.cp, call)
    _, K, N = case.mkn
    target = call.out if call.swiglu is None else call.swiglu
    run, reads = None, ()
    if step is not None:
        run, reads = step(builder, a_mat, _as_read(call)[1], target, case.x_rows(), N, K,
                          call.swiglu is not None)
    blas = _CublasGemm(builder, case, a_mat, w_mat, call.out)
    tail = [] if call.swiglu is None else _swiglu_tail(builder, call.out, call.swiglu, N)

    def dispatch():
        if run is not None and CONFIG[switch]:
            return run()
        blas()
        for fn in tail:
            fn()
    builder.add(dispatch, reads=reads)
    return True


def _matmul_lt_epilogue(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """A matmul with a bias/activation epilogue cuBLASLt has, as one GEMM: the epilogue in
    cuBLASLt's call (one launch, no extra pass over out); cuBLAS and an elementwise launch
    where CONFIG["lt_epilogue"] is off. False where cuBLASLt finds no algorithm for it."""
    from . import blas as cublas

    a_mat, w_mat = _gemm_operands(builder.cp, call)
    M, K, N = case.mkn
    blas = _CublasGemm(builder, case, a_mat, w_mat, call.out)
    bias, act = call.epilogue
    lt = cublas.lt_library().prepare(blas.op_w, blas.op_a, N, M, K, blas.ld_w, blas.ld_a, blas.dtype_c,
                                     bias.arr.data.ptr, blas.dtype_c, act, case.ldc)
    if lt is None:
        return False
    mark = len(builder.steps)           # the unfused epilogue, for the switch
    _bias_act(builder, call.out, bias, act)
    tail = [st.fn for st in builder.steps[mark:]]
    del builder.steps[mark:]
    (ptr_w, ptr_a, ptr_c), = blas.calls
    alpha, beta, stream = blas.alpha, blas.beta, builder.stream

    def lt_or_blas():
        if CONFIG["lt_epilogue"]:
            return lt(ptr_w, ptr_a, ptr_c, alpha, beta, stream.ptr)
        blas()
        for fn in tail:
            fn()
    builder.add(lt_or_blas)
    return True


def _matmul_blas(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """Every other float matmul: cuBLAS (`_CublasGemm`)."""
    a_mat, w_mat = _gemm_operands(builder.cp, call)
    builder.add(_CublasGemm(builder, case, a_mat, w_mat, call.out))
    return True


def _matmul_unfusable(builder, case: MatmulCase, call: MatmulCall) -> bool:
    """The swiglu or epilogue asked for cannot fuse into this product's strategy: no step."""
    return False


_MATMUL_STRATEGIES = {ROWS: _matmul_rows, STAGED: _matmul_staged, REPACKED: _matmul_repacked,
                      GEMV: _matmul_gemv, GEMV_TC: _matmul_gemv_tc, LT_EPILOGUE: _matmul_lt_epilogue,
                      BLAS: _matmul_blas, UNFUSABLE: _matmul_unfusable}


def _swiglu_tail(builder, out: V, swiglu: V, n: int) -> list:
    """The run functions of the unfused SwiGLU of out's halves into swiglu (built, not added
    as steps: the GEMV's cuBLAS switch runs them)."""
    half = n // 2
    mark = len(builder.steps)
    builder.elementwise(((("fused_swiglu", (), (0, 1))),),
                        [V(out.arr[..., :half], out.dt), V(out.arr[..., half:], out.dt)], swiglu)
    tail = [st.fn for st in builder.steps[mark:]]
    del builder.steps[mark:]
    return tail


def _batch_calls(batch: tuple, a_strides, w_strides, out_strides, matrix_size: int) -> tuple:
    """How a batched GEMM's batch dims become cuBLAS calls: dims (of size > 1) merged where
    the strides of A, W and out all chain; the innermost run is one strided-batched call,
    (count, A stride, W stride, out stride), made at each of the (A, W, out) element offsets
    of the outer ones."""
    merged: list = []
    for i, d in enumerate(batch):
        if d == 1:
            continue
        x, y, z = a_strides[i], w_strides[i], out_strides[i]
        if merged:
            pd, px, py, pz = merged[-1]
            if px == x * d and py == y * d and pz == z * d:
                merged[-1] = (pd * d, x, y, z)
                continue
        merged.append((d, x, y, z))
    inner = merged[-1] if merged else (1, 0, 0, matrix_size)
    offsets = [(0, 0, 0)]
    for d, x, y, z in merged[:-1]:
        offsets = [(oa + i * x, ob + i * y, oc + i * z) for oa, ob, oc in offsets for i in range(d)]
    return offsets, inner


class _CublasGemm:
    """The cuBLAS calls of out <- A @ W (`_gemm_operands`; row-major out, so cuBLAS, column-
    major, computes out^T = W^T A^T): one per outer batch offset, each a GEMM or one strided-
    batched GEMM over the innermost merged batch dims (`_batch_calls`). Calling it runs them."""

    def __init__(self, builder, case: MatmulCase, a_mat, w_mat, out: V):
        from . import blas as cublas

        M, K, N = case.mkn
        (a_layout, self.ld_a), (w_layout, self.ld_w) = case.layouts()
        self.op_w, self.op_a = (OP_N if w_layout == "r" else OP_T), (OP_N if a_layout == "r" else OP_T)
        self.dtype_c = dtype_c = getattr(builder.cp.cuda.runtime, _CUDA_T[case.dtype])
        compute = cublas.COMPUTE_64F if case.dtype is F64 else cublas.COMPUTE_32F
        scalar = np.float64 if case.dtype is F64 else np.float32
        alpha, beta = np.ones(1, scalar), np.zeros(1, scalar)
        builder.keep += [alpha, beta]
        self.alpha, self.beta = alpha.ctypes.data, beta.ctypes.data
        offsets, (count, stride_a, stride_w, stride_c) = case.batch_calls()
        size = out.arr.itemsize
        ptr_a, ptr_w, ptr_c = a_mat.data.ptr, w_mat.data.ptr, out.arr.data.ptr
        self.calls = [(ptr_w + ow * size, ptr_a + oa * size, ptr_c + oc * size) for oa, ow, oc in offsets]
        lib = cublas.library()
        # every call's arguments bound here: a prefill step is host-bound, and looking them up
        # per call cost about 1 us a GEMM
        head = (lib.handle, self.op_w, self.op_a, N, M, K, self.alpha)
        if count == 1:
            self.gemm = lib.gemm
            self.args = [head + (pw, dtype_c, self.ld_w, pa, dtype_c, self.ld_a, self.beta, pc, dtype_c,
                                 case.ldc or N, compute) for pw, pa, pc in self.calls]
        else:
            self.gemm = lib.gemm_strided
            self.args = [head + (pw, dtype_c, self.ld_w, stride_w, pa, dtype_c, self.ld_a, stride_a, self.beta,
                                 pc, dtype_c, N, stride_c, count, compute) for pw, pa, pc in self.calls]
        self.prepare, self.handle, self.stream = lib.prepare, lib.handle, builder.stream

    def __call__(self):
        self.prepare(self.handle, self.stream.ptr)
        gemm = self.gemm
        for args in self.args:
            gemm(*args)


# rows of W per warp, 16-byte loads in flight per row and lane: at 2 rows (four loads a lane in
# flight, as the gate/up pair has) Qwen3.5-2B's decode took 1.707 -> 1.686 ms and Llama-1B's bf16
# 1.118 -> 1.100 ms on an H100 (session 32)
GEMV_ROWS, GEMV_LOADS = 2, 2
# x rows up to which 16-bit matmuls run the GEMV, not cuBLAS: the 1B-shape decode step on the
# H100 (tools/batch_decode.py --cublas) at batch 1/2/4/8: GEMV 1.68/1.89/2.49/4.35 ms, cuBLAS
# 2.45/2.02/2.13/2.24 ms
GEMV_MAX_M = 2
# x rows up to which products past GEMV_MAX_M run sources.GEMV_TC (CONFIG["gemv_tc"]); the
# columns of x its blocks stage in shared memory at a time; the blocks a launch aims for an SM,
# splitting K across blocks (each keeping GEMV_TC_MIN_KB columns) while it has fewer
GEMV_TC_MAX_M, GEMV_TC_KC, GEMV_TC_BLOCKS_PER_SM, GEMV_TC_MIN_KB = 64, 128, 2, 256
# a GEMV with fewer warps than this an SM gives each row more warps (more than an SM holds:
# split as far as the row length allows, but not lm_head's 128K rows). The 1B decode graph on
# an H100, variants alternating in one process: 0 / 32 / 64 -> 1.264 / 1.200 / 1.185 ms; in
# another run 48 / 64 / 96 / 128 -> 1.200 / 1.186 / 1.185 / 1.179 ms
GEMV_WARPS_PER_SM = 128


def warps_per_row(units: int, loads: int, more=lambda ks: True) -> int:
    """Warps that split one row of a decode GEMV (1, 2, 4 or 8): doubled while each keeps a
    whole round of loads of the row's `units` (32 lanes x `loads`) and `more(ks)` holds."""
    ks = 1
    while ks < 8 and 64 * loads * ks <= units and more(ks):
        ks *= 2
    return ks


def gemv_split(warps: int, K: int, sms: int) -> int:
    """Warps per row of sources.GEMV (16-byte units of a row): split while the launch has
    fewer than GEMV_WARPS_PER_SM warps an SM."""
    return warps_per_row(K // 8, GEMV_LOADS, lambda ks: warps * ks < GEMV_WARPS_PER_SM * sms)


def row_streams(b, w: V, rows: int, row_stride: int, row_bytes: int, halves: bool) -> tuple:
    """The (address, bytes) ranges a decode GEMV streams w's `rows` rows in, front to back
    (halves: the gate and up halves side by side), for Step.reads; () where a kernel writes w."""
    if not rows or not b.written_by_no_kernel(w):
        return ()
    parts = 2 if halves else 1
    n = rows // parts
    span = (n - 1) * row_stride + row_bytes
    return tuple((w.arr.data.ptr + k * n * row_stride, span) for k in range(parts))


def _gemv_step(builder, x, weight, out: V, M: int, N: int, K: int, swiglu: bool = False,
               norm: GemvNorm | None = None, residual: GemvResidual | None = None):
    """(run, reads): the GEMV launch for out[M, N] = x[M, K] @ weight (W [N, K] row-major)
    (swiglu: out[M, N/2] = silu(gate) * up) and the weight ranges it streams (row_streams).
    norm: x is norm.x's rows, normed in the kernel from the sums of squares its producer left
    (x only names the shape); residual: out = its rows + the product (its h), which it goes
    on to norm."""
    dtype = ctype(out.dt)
    mmax = pow2(M, 1, M)
    rows = 2 if swiglu else GEMV_ROWS
    n_out = N // 2 if swiglu else N
    warps = n_out if swiglu else -(-N // rows)
    ks = gemv_split(warps, K, builder.sms)
    src = sources.render(sources.GEMV, T=dtype, TO=dtype, MMAX=mmax, R=rows, U=GEMV_LOADS, SWIGLU=int(swiglu),
                         KS=ks, SWIGLU_OF=codegen.swiglu_of("float"), NORM=int(norm is not None),
                         TN=ctype(residual.w.dt) if residual is not None else dtype,
                         RESID=int(residual is not None),
                         EARLY=int(builder.written_by_no_kernel(V(weight, out.dt))))
    fn = builder.kernel(src, "rlx_gemv")
    row = K * weight.itemsize
    reads = row_streams(builder, V(weight, out.dt), N, row, row, swiglu)
    xrs = i64(K)
    if norm is not None:
        x, xrs = norm.rows(M, K)
    args = _with_norms(builder, [x, xrs, weight, out.arr, i32(M), i32(n_out), i32(K)], norm, residual, M, N)
    grid, block, stream = (-(-warps * ks // 8),), (256,), builder.stream

    def run():
        fn(grid, block, tuple(args), 0, stream)
    return run, reads


def gemv_tc_split(blocks: int, K: int, sms: int) -> int:
    """Columns of x a block of sources.GEMV_TC sums over (a multiple of 32): all of K, or a
    part where `blocks` blocks (of 128 rows of W) give fewer than GEMV_TC_BLOCKS_PER_SM an SM."""
    parts = max(1, min(-(-GEMV_TC_BLOCKS_PER_SM * sms // blocks), K // GEMV_TC_MIN_KB))
    return 32 * -(-K // (32 * parts))


def _gemv_tc_step(builder, x, weight, out: V, M: int, N: int, K: int, swiglu: bool = False) -> tuple:
    """(run, reads): the GEMV_TC launch for out[M, N] = x[M, K] @ weight (W [N, K] row-major;
    swiglu: out[M, N/2] = silu(gate) * up), with its partial sums' scratch and counters where K
    is split across blocks."""
    dtype = ctype(out.dt)
    n_out = N // 2 if swiglu else N
    blocks = -(-n_out // 64) if swiglu else -(-N // 128)
    kb = gemv_tc_split(blocks, K, builder.sms)
    parts = -(-K // kb)
    early = int(builder.written_by_no_kernel(V(weight, out.dt)))
    src = sources.render(sources.GEMV_TC, T=dtype, TO=dtype, MMAT="bf16" if out.dt is BF16 else "f16",
                         MT=-(-M // 8), KC=GEMV_TC_KC, EARLY=early, SWIGLU=int(swiglu),
                         SWIGLU_OF=codegen.swiglu_of("float"))
    fn = builder.kernel(src, "rlx_gemv_tc")
    ws = builder.node_buffer((parts, M, N), F32, "gemv_tc partial sums").arr if parts > 1 else None
    counters = builder.counters(blocks) if parts > 1 else None
    row = K * weight.itemsize
    reads = row_streams(builder, V(weight, out.dt), N, row, row, swiglu)
    args = (x, i64(K), weight, out.arr, i32(M), i32(n_out), i32(K), i32(kb), ws, counters)
    grid, block, stream = (blocks, parts), (256,), builder.stream

    def run():
        fn(grid, block, args, 0, stream)
    return run, reads


# the arguments rlx_gemv and rlx_dq_gemv end with (eps, nsq, nw, noff, res, rrs, yw, osq, zero, zn):
# here no NORM, no RESID
NO_NORMS = (np.float32(0), None, None, np.float32(0), None, i64(0), None, None, None, i32(0))


def _with_norms(b, args: list, norm: GemvNorm | None, residual: GemvResidual | None, M: int, N: int,
                normed_q8: bool = False) -> list:
    """A GEMV's launch arguments `args` and the NORM / RESID ones (NO_NORMS) after them, the
    NORM GEMV put in the sums' ring. normed_q8: a RESID GEMV that also rounds its y * w into
    int8 rows divided by the norm (dq.cu's Q8) reads the sums it adds up, so joins the ring."""
    tail = list(NO_NORMS)
    if norm is not None:
        tail[:2] = [np.float32(norm.eps), norm.ssq]
    if residual is not None:
        r = residual
        tail[2:8] = [r.w.arr, np.float32(r.off), r.x.arr.reshape(M, N), i64(N), r.xw.arr, r.ssq]
        if normed_q8:
            tail[0] = np.float32(r.eps)
    args = args + tail
    if norm is not None or normed_q8:
        b.gemv_sums.follow(norm.ssq if norm is not None else residual.ssq, args)
    return args


class GemvSums:
    """Who zeroes the sums of squares the NORM GEMVs read (gemv.cu): each such GEMV zeroes
    the sums of the one before it in the step, whose launch has finished when its own grid
    wait returns; the step's first zeroes the last one's (set by `close` at the end of the
    build: they are zero again before the next step's GEMV adds into them), unless those were
    written before it ran (`early`: an embedding gather's, read late), which a memset after the
    step's last launch then zeroes, as it does the sums of a step with one NORM GEMV. GEMVs
    reading the same sums one after the other (q/k and v of mixed formats) zero the same sums
    before them (`_gemv_norm` keeps other readers out of the ring)."""

    def __init__(self):
        self.sums: list = []
        self.readers: list = []           # per sums: the launch arguments of the GEMVs reading them
        self.early: list = []             # sums written before (or by) the step's first NORM GEMV

    @staticmethod
    def _zeroes(args: list, sums) -> None:
        """A NORM GEMV's launch arguments (ending with zero, zn) point at `sums`."""
        args[-2:] = [sums, i32(sums.size)]

    def written(self, ssq) -> None:
        """Register sums a step's launch is about to write."""
        if not self.sums:
            self.early.append(ssq)

    def follow(self, ssq, args: list) -> None:
        """Register a NORM GEMV reading `ssq` (its launch arguments end with zero, zn); a second
        GEMV reading the last GEMV's sums zeroes what that one zeroes."""
        if self.sums and self.sums[-1] is ssq:
            args[-2:] = self.readers[-1][0][-2:]
            self.readers[-1].append(args)
            return
        if self.sums:
            self._zeroes(args, self.sums[-1])
        self.sums.append(ssq)
        self.readers.append([args])

    def close(self, b) -> None:
        """At the end of the build: the first NORM GEMVs zero the last one's sums, or a memset
        after the step does."""
        if not self.sums:
            return
        last = self.sums[-1]
        if len(self.sums) > 1 and not any(last is s for s in self.early):
            for args in self.readers[0]:
                self._zeroes(args, last)
            return
        rt, stream = b.cp.cuda.runtime, b.stream
        b.add(lambda: rt.memsetAsync(last.data.ptr, 0, last.nbytes, stream.ptr))


def _matmul_naive(builder, a: V, w: V, ta, tb, out: V) -> None:
    """An integer or bool matmul (cuBLAS has none): one thread per output element, summing
    in long long (bool: or of ands), over dense copies of the operands."""
    cp = builder.cp
    a_mat = a.arr.swapaxes(-1, -2) if ta else a.arr
    w_mat = w.arr.swapaxes(-1, -2) if tb else w.arr
    batch = tuple(out.shape[:-2])
    M, K, N = a_mat.shape[-2], a_mat.shape[-1], w_mat.shape[-1]
    a_dense = builder.contiguous(V(cp.broadcast_to(a_mat, batch + (M, K)), a.dt))
    w_dense = builder.contiguous(V(cp.broadcast_to(w_mat, batch + (K, N)), w.dt))
    if out.dt is BOOL:
        acc, mac = "bool", "(s) || ((a) && (b))"
    else:
        acc, mac = "long long", "(s) + (a) * (b)"
    src = sources.render(sources.MATMUL_NAIVE, TA=ctype(a.dt), TB=ctype(w.dt), TO=ctype(out.dt),
                         ACC=acc, MAC=mac)
    fn = builder.kernel(src, "rlx_matmul_naive")
    nb = math.prod(batch)
    builder.launch(fn, ((nb * M * N + 255) // 256,), (256,),
                   (a_dense.arr, w_dense.arr, out.arr, i64(nb), i32(M), i32(N), i32(K), i64(M * K), i64(K), i64(1),
                    i64(K * N), i64(N), i64(1)))


def _swiglu_consumer(b, n) -> int | None:
    """The fused_swiglu node taking this matmul's two last-axis halves (gate, up) as the
    only uses of its output (decode's gate/up projection), or None."""
    N = n.outs[0].dims[-1]
    nodes = b.r.lir.graph.nodes
    use = b.uses.get((b.node, 0), [])
    if len(use) != 2 or N % 2:
        return None
    found = set()
    for j in use:
        m = nodes[j] if j >= 0 else None
        if m is None or m.op != "narrow" or m.a["length"] != N // 2:
            return None
        if m.a["axis"] % len(m.outs[0].dims) != len(m.outs[0].dims) - 1:
            return None
        sw = b.sole_consumer(j, "fused_swiglu")
        if sw is None:
            return None
        found.add((sw, m.a["start"] % N, [tuple(r) for r in nodes[sw].inputs].index((j, 0))))
    sws = {f[0] for f in found}
    if len(sws) != 1 or {f[1:] for f in found} != {(0, 0), (N // 2, 1)}:
        return None
    j = sws.pop()
    return j if nodes[j].outs[0].dtype is n.outs[0].dtype else None


def _b_matmul(b, n, ins, outs):
    x = ins[0]
    # only the GEMVs (x rows <= GEMV_TC_MAX_M) compute the SwiGLU: else no private output for it
    # (at prefill it was one [batch, seq, intermediate] buffer per layer: 2.1 GB at batch 32)
    rows = x.size // max(x.shape[-1], 1) if x.shape else 1
    sw = _swiglu_consumer(b, n) if rows <= GEMV_TC_MAX_M else None
    norm = _gemv_norm(b, tuple(n.inputs[0]))
    resid = _residual_norm(b, n) if rows <= GEMV_MAX_M else None
    if norm is not None or resid is not None:
        def gemv(dst, norm, residual):
            return _gemv_fused(b, ins[0], ins[1], n.a["trans_b"], outs[0], dst, norm, residual)
        if _b_matmul_fused(b, n, ins, outs, sw, norm, resid, gemv):
            return
        if norm is not None:
            norm.add_unfused(b)
    if sw is not None:
        dst = b.out_value(sw)
        if not b.disjoint(dst, ins[0]):
            # the planner may give swiglu's bytes to x (dead by the swiglu node): not here
            dst = b.vals[(sw, 0)] = b.buffer(dst.shape, dst.dt, "fused swiglu output")
        if _matmul(b, ins[0], ins[1], n.a["trans_a"], n.a["trans_b"], outs[0], swiglu=dst):
            b.absorbed.add(sw)
            return
    _matmul(b, ins[0], ins[1], n.a["trans_a"], n.a["trans_b"], outs[0])


# ----------------------------------------------------------------------------- norms in the GEMV
# A decode step's residual RMSNorms sit between two GEMVs (o_proj -> q/k/v, down -> gate/up):
# the GEMV before a fused_residual_rms_norm writes its h = x + the product and adds up h's
# squares (gemv.cu's RESID), the GEMV after it norms its x rows from those sums as it reads them
# (NORM), so the norm is no launch of its own: each small launch between two GEMVs leaves the
# memory system idle while it runs. CONFIG["gemv_fusion"] (on by default; RLX_CUDA_GEMV_FUSION=0
# at build turns it off) builds the norms as launches of their own when off.
@attrs.define(eq=False)
class GemvNorm:
    """y = rms_norm(h) * (w + off) left for y's readers, GEMVs, to compute on their rows:
    x = h * (w + off) and ssq (the sums of squares of h's rows in 32 parts), both written by
    h's producer (GemvResidual); `unfused`: the norm's own launch (run where a reader is no
    GEMV, or under the cuBLAS switch). `readers` not yet built; `fused`: a GEMV computed it;
    `ran`: its own launch ran (later readers read y)."""
    node: int
    x: V
    eps: float
    ssq: object
    unfused: tuple
    readers: int
    fused: bool = False
    ran: bool = False

    def add_unfused(self, b) -> None:
        """Add the norm's own launch as its node's step (in its reader's place), then zero the
        sums its producer left (no later GEMV reads them)."""
        self.ran = True
        with b.at_node(self.node):
            for fn in self.unfused:
                b.add(fn)
            rt, ptr, nbytes, stream = b.cp.cuda.runtime, self.ssq.data.ptr, self.ssq.nbytes, b.stream
            b.add(lambda: rt.memsetAsync(ptr, 0, nbytes, stream.ptr))

    def fits(self, M: int, K: int, dt: DType) -> bool:
        """Whether the GEMV kernel can norm x for a product of M rows of K (x of its dtype)."""
        return self.x.dt is dt and self.x.size == M * K and self.x.shape[-1] == K

    def rows(self, M: int, K: int) -> tuple:
        """(x as an [M, K] array, its row stride) for the kernel."""
        return self.x.arr.reshape(M, K), i64(K)


@attrs.frozen(eq=False)
class GemvResidual:
    """What a GEMV computing a fused_residual_rms_norm's r writes beside it: its h = x + r,
    xw = h * (w + off) (the next GEMV's x, GemvNorm) and the sums of h's squares into ssq;
    `tail`: the norm's own launch after it (under the cuBLAS switch); eps: the norm's."""
    x: V
    h: V
    xw: V
    w: V
    off: float
    ssq: object
    tail: tuple
    eps: float


def _gemv_norm(b, ref: tuple) -> GemvNorm | None:
    """The norm a GEMV reading x = `ref` computes on its rows (its last reader takes it out of
    b.gemv_norms), or None: x is no such norm's y, or the norm ran as its own launch (a reader
    before could not compute it). A second reader with another NORM GEMV since the first (which
    zeroed the sums: GemvSums) gets the norm's own launch."""
    if ref not in b.gemv_norms:
        ref = _view_root(b, ref)         # (x a view of all of y's rows: _whole_view_readers)
    norm = b.gemv_norms.get(ref)
    if norm is None:
        return None
    norm.readers -= 1
    if not norm.readers:
        del b.gemv_norms[ref]
    if not norm.ran and norm.fused and b.gemv_sums.sums[-1] is not norm.ssq:
        norm.add_unfused(b)
    return None if norm.ran else norm


def _collected(b, build) -> tuple:
    """The run functions of the steps `build()` adds, taken out of the step list."""
    mark = len(b.steps)
    build()
    fns = tuple(st.fn for st in b.steps[mark:])
    del b.steps[mark:]
    return fns


def _residual_norm(b, n) -> tuple | None:
    """(node, x, w, eps, off) of the fused_residual_rms_norm (x + r) that is this matmul's
    output's only use (as r; or as x, then its r is returned as x), with nothing but params
    between them (its h may be written at the matmul) and its y read only as the x of matmuls
    or dequant_matmuls (q/k and v of mixed formats: two) that may run as GEMVs, or by a
    fake_quantize rounding it into int8 rows for such GEMVs (`_int8_x`); else None."""
    if not CONFIG["gemv_fusion"] or n.a.get("trans_a") or n.outs[0].dtype not in LOW:
        return None
    g = b.r.lir.graph
    j = b.sole_consumer(b.node, "fused_residual_rms_norm")
    if j is None:
        return None
    m = g.nodes[j]
    rin = [tuple(r) for r in m.inputs]
    if len(rin) < 3 or rin[:2].count((b.node, 0)) != 1:
        return None
    if any(g.nodes[t].op not in ("param", "constant") for t in range(b.node + 1, j)):
        return None
    if not _gemv_readers(b, (j, 1)):
        return None
    # (x + r, either way round: the same float sum)
    x, w = b.vals.get(rin[1] if rin[0] == (b.node, 0) else rin[0]), b.vals.get(rin[2])
    if x is None or w is None:
        return None
    return j, x, w, m.a["eps"], m.a["offset"]


def _gemv_readers(b, ref: tuple) -> list:
    """The readers of `ref` (a norm's y; `_whole_view_readers`) where each is the x of a matmul
    or dequant_matmul that may run as a GEMV, or of a fake_quantize rounding it into int8 rows for
    such GEMVs (`_int8_x`), directly or through views of all its bytes: then they can norm it
    themselves; else []."""
    g = b.r.lir.graph

    def gemv_x(c, r):
        m = g.nodes[c] if c >= 0 else None
        if m is not None and m.op == "fake_quantize":        # (its int8 rows: the norm computed there)
            return tuple(m.inputs[0]) == r and int8_gemv_x(g, c, b.hip, b.uses)
        return (m is not None and m.op in ("matmul", "dequant_matmul") and tuple(m.inputs[0]) == r
                and tuple(m.inputs[1]) != r and not m.a.get("trans_a"))
    readers = _whole_view_readers(b, ref)
    return readers if all(gemv_x(c, r) for c, r in readers) else []


def _whole_view_readers(b, ref: tuple) -> list:
    """(node, the value it reads) for each reader of `ref`, looking through views of all its
    bytes (the last-token narrow of a one-token step, a reshape): where a norm's y reaches its
    GEMVs only through such views, they read the very rows the norm wrote."""
    g, slots = b.r.lir.graph, b.r.lir.slots
    whole = g.nodes[ref[0]].outs[ref[1]].nbytes()
    out = []
    for c in b.uses.get(ref, []):
        view = c >= 0 and getattr(slots.get((c, 0)), "home", "") == "view"
        if view and g.nodes[c].outs[0].nbytes() == whole:
            out += _whole_view_readers(b, (c, 0))
        else:
            out.append((c, ref))
    return out


def _norm_inputs(b, j: int, h: V) -> tuple:
    """(ssq, xw): what the producer of norm node j's rows h writes for the GEMVs that norm them
    (GemvNorm): the rows' sums of squares in 32 parts (zeroed; GemvSums keeps them so) and
    h * (w + off)."""
    rows = h.size // max(h.shape[-1], 1)
    ssq = device.empty((pow2(rows, 1, rows) * 32,), F32, f"row sums of squares of node %{j}")
    ssq.fill(0)
    b.r.counters.append(ssq)          # (kept outside the poisoned scratch)
    b.gemv_sums.written(ssq)
    return ssq, b.buffer(h.shape, h.dt, "norm-weighted rows")


def _b_matmul_fused(b, n, ins, outs, sw, norm: GemvNorm | None, resid, gemv) -> bool:
    """The decode GEMV of this matmul with its x normed in the kernel (norm) and / or the
    following fused_residual_rms_norm's h written by it (resid: `_residual_norm`; that norm's
    y is then left to its GEMV), the SwiGLU too where sw; False (no step) where it does not fit.
    gemv(swiglu output, norm, residual): the dense or packed GEMV's step, False where it cannot."""
    reads = [ins[0]] + ([norm.x] if norm is not None else [])

    def written(i, k, what):
        """(i, k)'s array, private where it shares bytes with what the kernel reads."""
        v = b.out_value(i, k)
        if not all(b.disjoint(v, r) for r in reads):
            v = b.vals[(i, k)] = b.buffer(v.shape, v.dt, what)
        return v
    dst = written(sw, 0, "fused swiglu output") if sw is not None else None
    if not all(b.disjoint(outs[0], r) for r in reads[1:]):
        return False
    residual = None
    if resid is not None:
        j, x, w, eps, off = resid
        h, y = written(j, 0, "fused residual output"), b.out_value(j, 1)
        if x.shape != outs[0].shape or not (b.disjoint(h, x) or (h.arr.data.ptr == x.arr.data.ptr
                                                                   and h.es == x.es)):
            return False
        if not (x.contiguous() and h.contiguous() and x.dt is h.dt and w.shape == (h.shape[-1],)
                and w.contiguous() and w.dt.is_float):
            return False
        tail = _collected(b, lambda: _rms_norm(b, x, outs[0], w, h, y, eps, off))
        ssq, xw = _norm_inputs(b, j, h)
        residual = GemvResidual(x, h, xw, w, off, ssq, tail, eps)
    if not gemv(dst, norm, residual):
        return False
    if sw is not None:
        b.absorbed.add(sw)
    if norm is not None:
        norm.fused = True
    if resid is not None:
        b.absorbed.add(j)
        # (not the GEMV's Q8)
        readers = [c for c, _ in _whole_view_readers(b, (j, 1)) if c not in b.absorbed]
        if readers:
            own = _collected(b, lambda: _rms_norm(b, h, None, w, None, y, eps, off))
            b.gemv_norms[(j, 1)] = GemvNorm(j, xw, eps, ssq, own, len(readers))
    return True


def _gemv_fused(b, a: V, w: V, tb: bool, out: V, swiglu: V | None, norm: GemvNorm | None,
                residual: GemvResidual | None) -> bool:
    """out <- a @ w as the GEMV kernel with a norm of its x rows (norm) or the residual rows
    added (residual: h <- x + out), one dtype throughout, all contiguous; False (no step)
    otherwise. Under the cuBLAS switch: the norm's launch, cuBLAS, then the SwiGLU / the
    residual norm's launch."""
    if out.dt not in LOW or a.dt is not out.dt or w.dt is not out.dt or w.arr.ndim != 2 or not a.shape:
        return False
    K, N = a.shape[-1], out.shape[-1]
    M = a.size // max(K, 1)

    def flat(v, cols):
        return V(v.arr.reshape(M, cols), v.dt) if v.contiguous() and v.size == M * cols else None
    af, of = flat(a, K), flat(out, N)
    sf = flat(swiglu, N // 2) if swiglu is not None else None
    if af is None or of is None or (swiglu is not None and sf is None) or M == 0:
        return False
    call = MatmulCall(af, w, False, tb, of, sf)
    case = MatmulCase.of(b.cp, call)
    if not case.gemv_fits() or (norm is not None and not norm.fits(M, K, out.dt)):
        return False
    target, tail = (of if sf is None else sf), ()
    if residual is not None:
        if swiglu is not None or residual.h.dt is not out.dt:
            return False
        target, tail = flat(residual.h, N), residual.tail
    elif swiglu is not None:
        tail = tuple(_swiglu_tail(b, of, sf, N))
    gemv, reads = _gemv_step(b, af.arr, _as_read(call)[1], target, M, N, K, swiglu is not None, norm,
                             residual)
    a_mat, w_mat = _gemm_operands(b.cp, call)
    blas = _CublasGemm(b, case, a_mat, w_mat, of)
    head = norm.unfused if norm is not None else ()

    def dispatch():
        if CONFIG["gemv"]:
            return gemv()
        for fn in head:
            fn()
        blas()
        for fn in tail:
            fn()
    b.add(dispatch, reads=reads)
    return True


def _b_mba(b, n, ins, outs):
    bias, act = (ins[2] if len(ins) > 2 else None), n.a["act"]
    if bias is not None and _matmul(b, ins[0], ins[1], False, n.a["trans_b"], outs[0], epilogue=(bias, act)):
        return
    _matmul(b, ins[0], ins[1], False, n.a["trans_b"], outs[0])
    _bias_act(b, outs[0], bias, act)


def _lt_fits(a: V, w: V, out: V, bias: V, act: str) -> bool:
    """Whether cuBLASLt can take this matmul's bias and act (same float type throughout, a
    contiguous bias per output column, an activation its epilogues have)."""
    from . import blas as cublas

    od = out.dt
    return (od in (F16, BF16, F32) and a.dt is od and w.dt is od and bias.dt is od and out.size > 0
            and bias.shape == (out.shape[-1],) and bias.contiguous() and bias.arr.data.ptr % 16 == 0
            and _rows_ld(out) is not None and act in cublas.LT_EPILOGUES and cublas.lt_library() is not None)


def _bias_act(b, out: V, bias: V | None, act: str) -> None:
    """out <- act(out + bias) in place (one elementwise launch; none when there is nothing)."""
    program, args = [], [out]
    last = 0
    if bias is not None:
        args.append(bias)
        program.append(("binary", (("op", "add"),), (0, 1)))
        last = 2
    if act != "identity":
        program.append(("activation", (("fn", act),), (last,)))
    if program:
        b.elementwise(tuple(program), args, out)


# ----------------------------------------------------------------------------- packed weights
DQ_ROWS, DQ_LOADS = 4, 1    # decode: rows of W per warp (sharing x loads), parts in flight per lane (tools/dq_sweep.py)
# rows of W a warp where a plain or residual GEMV at DQ_ROWS would launch fewer than
# DQ_SMALL_BLOCKS_PER_SM blocks an SM (the 1B shape's o and q/k/v projections: one block an SM,
# each warp's chain of products after the grid wait the launch's latency); 0: DQ_ROWS everywhere.
# H100, Llama-1B decode (benchmarks/README.md, llm_gpu section): q6_k 0.850 -> 0.819 ms/token,
# q4_k 0.680 -> 0.676; at 1 row a warp q4_k 0.731
DQ_SMALL_ROWS, DQ_SMALL_BLOCKS_PER_SM = 2, 2
# decode GEMVs of one bf16 x row on tensor cores where the scheme has the form (dq_tc). Off: on an
# H100 (session 33) the Llama-1B q4_k step took 0.907 ms/token with it against 0.690 without
# (benchmarks/README.md); RLX_BENCH_SET=rlx_backend_cuda.ops.DQ_TC=True turns it on.
DQ_TC = False
DQ_TC_BLOCKS_PER_SM = 2     # TC: warps split a row's groups only until the launch has this many blocks an SM
DQ_MAX_M = 8                # x rows up to which dequant_matmul runs the fused GEMV
DQ_TILE = 1 << 24           # prefill: weights decoded per tile (elements) before its GEMM


def _scheme(n):
    from rlx_core.ir.quant import QuantScheme

    return QuantScheme.parse(n.a["scheme"])


def _packed(b, w: V, rows: int, row_bytes: int) -> tuple:
    """(V, row stride, alignment in 2..16 of its base and rows) of packed bytes as [rows, row_bytes]."""
    wv, rs = _as_matrix(b, w, rows, row_bytes)
    if wv.arr.data.ptr % 2 or rs % 2:        # odd offsets: a fresh (aligned) copy
        fresh = b.buffer(wv.shape, wv.dt, "aligned packed bytes")
        b.copy(wv, fresh)
        wv, rs = fresh, row_bytes
    wv = V(b.cp.lib.stride_tricks.as_strided(wv.arr, shape=(rows, row_bytes), strides=(rs, 1)), wv.dt)
    a = 16
    while a > 2 and (wv.arr.data.ptr % a or rs % a):
        a //= 2
    return wv, rs, a


def _dq_kernel(b, kernel: str, s, name: str, dynamic_smem: int = 0, **subs):
    return b.kernel(sources.dq_source(kernel, s.kind, s.block, **subs), name, dynamic_smem)


def _b_dequantize(b, n, ins, outs):
    s, out = _scheme(n), outs[0]
    if out.size == 0:
        return
    K = out.shape[-1]
    rows, nb = out.size // K, K // s.block
    w, wrs, al = _packed(b, ins[0], rows, ins[0].shape[-1])
    dst = out if out.contiguous() else b.buffer(out.shape, out.dt)
    _dq_rows(b, s, w.arr, wrs, al, dst.arr, dst.dt, rows, nb)
    if dst is not out:
        b.copy(dst, out)


def _dq_rows(b, s, w, wrs, al, y, dt: DType, rows: int, nb: int) -> None:
    """The DQ_DEQUANT launch: packed rows w (row stride wrs) into the contiguous y [rows, K]."""
    shape = sources.dq_dequant_shape(s.kind, s.block, y.itemsize)
    fn = _dq_kernel(b, sources.DQ_DEQUANT, s, "rlx_dequant", TO=ctype(dt), ACC=acc_of(dt), A=al,
                    YV=int(y.data.ptr % 16 == 0), **shape)
    if shape["STAGE"]:
        grid = (max(1, min(-(-rows * nb // shape["BPT"]), b.sms * 16)),)
    else:
        grid = _grid(rows * nb * sources.dq_parts(s.kind, s.block), b.sms)
    b.launch(fn, grid, (shape["THREADS"],), (w, i64(wrs), y, i64(rows), i32(nb)))


def _b_dequant_matmul(b, n, ins, outs):
    """act(x @ dequant(w)^T + bias): the fused GEMV for decode (M <= DQ_MAX_M), else each tile
    of rows decoded into a scratch shared by the backend's runners, then cuBLAS. x from a
    fake_quantize that wrote its int8 rows (`_int8_x`): the GEMV multiplies those (QX)."""
    s, out = _scheme(n), outs[0]
    x, w = ins[0], ins[1]
    bias = b.contiguous(ins[2]) if len(ins) > 2 else None
    if not x.dt.is_float or out.dt is not x.dt:
        raise BackendError(f"cuda backend: dequant_matmul needs a float x and output of its dtype, got "
                           f"{x.dt.value} -> {out.dt.value} (node %{b.node})")
    if out.size == 0:
        return
    K, N = x.shape[-1], out.shape[-1]
    M = out.size // N
    wv, wrs, al = _packed(b, w, N, w.shape[-1])
    act = n.a.get("act", "identity")
    plain = M <= DQ_MAX_M and bias is None and act == "identity"
    sw = _swiglu_consumer(b, n) if plain else None
    norm = _gemv_norm(b, tuple(n.inputs[0]))
    resid = _residual_norm(b, n) if plain else None
    ref = tuple(n.inputs[0])
    target = b.out_value(resid[0]) if resid is not None else b.out_value(sw) if sw is not None else out
    x8 = _int8_rows_kept(b, ref, [target])
    if norm is not None or resid is not None:
        def gemv(dst, norm, residual):
            q8 = _q8_reader(b, (resid[0], 1)) if residual is not None and norm is None else None
            return plain and _dq_gemv_fused(b, s, x, (wv, wrs, al), outs[0], dst, norm, residual, x8, q8)
        if _b_matmul_fused(b, n, ins, outs, sw, norm, resid, gemv):
            return
        if norm is not None:
            norm.add_unfused(b)
        x8 = _int8_rows_kept(b, ref, [out, b.out_value(sw) if sw is not None else out])
    xv, xrs = (x, i64(K)) if x8 is not None else _as_matrix(b, x, M, K)     # (QX: x names the dtype)
    if sw is not None:            # gate/up of decode: the GEMV writes silu(gate) * up
        dst = b.out_value(sw)
        if not b.disjoint(dst, xv):
            dst = b.vals[(sw, 0)] = b.buffer(dst.shape, dst.dt, "fused swiglu output")
        _dq_gemv(b, s, xv, xrs, wv, wrs, al, None, act, dst, M, N // 2, K, swiglu=True, x8=x8,
                 q8=_q8_reader(b, (sw, 0)))
        b.absorbed.add(sw)
        return
    dst = out if out.contiguous() else b.buffer(out.shape, out.dt)
    if M <= DQ_MAX_M:
        _dq_gemv(b, s, xv, xrs, wv, wrs, al, bias, act, dst, M, N, K, x8=x8)
    else:
        _dq_gemm(b, s, xv, xrs, wv, wrs, al, dst, M, N, K)
        _bias_act(b, dst, bias, act)
    if dst is not out:
        b.copy(dst, out)


def _dq_epilogue(out_dt: DType, has_bias: bool, act: str) -> str:
    """C lines on the f32/f64 sum `v`: + bias, activation, each step rounded to the output
    dtype first as the unfused ops round (f16/bf16)."""
    rnd = f"v = (W)tof(ST({ctype(out_dt)}, v));" if out_dt in LOW else ""
    lines = []
    if has_bias:
        lines += [rnd, "v = v + LD(W, bias[n]);"]
    if act != "identity":
        cdt = F64 if out_dt is F64 else F32
        body: list = []
        e = codegen.emit_op("activation", {"fn": act}, [("v", cdt)], cdt, body, "ta")
        lines += [rnd, "{", *body, f"v = (W)({e});", "}"]
    return "\n    ".join(ln for ln in lines if ln)


def dq_tc(kind: str, dt: DType, M: int, K: int) -> bool:
    """Whether the decode GEMV takes its tensor-core form (dq.cu's TC, ops.DQ_TC): a scheme with a
    TC view, one bf16 x row, x's copy small enough for shared memory."""
    return DQ_TC and kind in sources.DQ_TC_VIEWS and dt is BF16 and M == 1 and tc_bytes(kind, K) <= 48 * 1024


def tc_bytes(kind: str, K: int) -> int:
    """The TC GEMV's shared memory: x's K bf16 values in the mmas' order, a float sum a sub-block
    (8 sub-blocks a group)."""
    return 2 * K + 4 * 8 * (K // 256) * sources.DQ_TC_VIEWS[kind][0]


def dq_gemv_shape(kind: str, block: int, M: int, K: int, loads: int | None = None, rows: int = 0,
                  sms: int = 0, n: int = 0) -> tuple:
    """(MMAX, KW, R) of the decode GEMV: M rounded up to a power of 2; warps of a block that
    split a row (as many as keep each lane `loads` parts busy, DQ_LOADS by default); rows per warp.
    rows (of W), sms: the TC form's (16 rows a warp; a row's groups split over warps only while
    the launch has fewer than DQ_TC_BLOCKS_PER_SM blocks an SM: each warp then streams its
    groups, the next loaded during this one's products, and a block's copy of x serves more rows).
    n: the rows of W of a launch that may take fewer rows a warp where it is small (DQ_SMALL_ROWS)."""
    if rows:
        groups, kw = K // block * sources.DQ_TC_VIEWS[kind][0], 1
        while 2 * kw <= min(groups, 8) and -(-rows // (16 * 8 // kw)) < DQ_TC_BLOCKS_PER_SM * sms:
            kw *= 2
        return 1, kw, 16
    mmax = pow2(M, 1, M)
    kw = warps_per_row(K // block * sources.dq_parts(kind, block), loads or DQ_LOADS)
    r = DQ_ROWS if mmax <= 2 else 2
    if DQ_SMALL_ROWS and n and -(-n // (8 // kw * r)) < DQ_SMALL_BLOCKS_PER_SM * sms:
        r = min(r, DQ_SMALL_ROWS)
    return mmax, kw, r


def _dq_gemv_fused(b, s, a: V, packed: tuple, out: V, swiglu: V | None, norm: GemvNorm | None,
                   residual: GemvResidual | None, x8: V | None = None, q8: int | None = None) -> bool:
    """out <- a @ dequant(w)^T as the packed decode GEMV with a norm of its x rows (norm; a
    only names the shape) or the residual rows added (residual, as `_gemv_fused` takes it),
    16-bit data of one dtype, contiguous rows; False (no step) otherwise. x8, q8: as `_dq_gemv`
    takes them."""
    K, N = a.shape[-1], out.shape[-1]
    M = out.size // max(N, 1)
    if out.dt not in LOW or a.dt is not out.dt or M == 0:
        return False
    if norm is not None and not norm.fits(M, K, a.dt):
        return False
    target = swiglu if swiglu is not None else out
    if residual is not None:
        if swiglu is not None:
            return False
        target = residual.h
    if target.dt is not out.dt or not target.contiguous():
        return False
    if norm is not None:
        xrows, xrs = norm.rows(M, K)
        xv = V(xrows, a.dt)
    elif x8 is not None:
        xv, xrs = a, i64(K)
    else:
        xv, xrs = _as_matrix(b, a, M, K)
    _dq_gemv(b, s, xv, xrs, *packed, None, "identity", target, M, N // 2 if swiglu is not None else N, K,
             swiglu=swiglu is not None, norm=norm, residual=residual, x8=x8, q8=q8)
    return True


def _dq_gemv(b, s, x: V, xrs, w: V, wrs, al, bias, act, out: V, M, N, K, swiglu=False,
             norm: GemvNorm | None = None, residual: GemvResidual | None = None, x8: V | None = None,
             q8: int | None = None):
    """The decode GEMV launch for out[M, N] (swiglu: w holds 2N rows, out = silu(gate) * up;
    norm, residual: as `_gemv_step` takes them; x8: quant_q8's int8 rows of x, which the kernel
    reads instead of x (x then only names the dtype), copied into `qx_bytes` of dynamic shared
    memory; float rows instead: x rounded there by each block, QX 2). q8: the fake_quantize node
    (`_q8_reader`) whose int8 rows the kernel writes from its outputs (Q8; under residual from its
    h * w, divided by the norm), which is then built."""
    qx = 0 if x8 is None else 1 if x8.dt is U8 else 2
    if qx == 2:
        x, xrs, x8 = x8, i64(x8.arr.strides[0] // x8.arr.itemsize), None
    nb = K // s.block
    tc = not qx and q8 is None and dq_tc(s.kind, x.dt, M, K)
    wrows = (2 * N if swiglu else N) if tc else 0
    mmax, kw, rows = dq_gemv_shape(s.kind, s.block, M, K, rows=wrows, sms=b.sms, n=0 if swiglu else N)
    xv = _x4_vectors(x.arr, xrs)
    fn = _dq_kernel(b, sources.DQ_GEMV, s, "rlx_dq_gemv", T=ctype(x.dt), TO=ctype(out.dt), ACC=acc_of(x.dt),
                    TB=ctype(bias.dt) if bias is not None else "float",
                    A=al, MMAX=mmax, R=rows, U=DQ_LOADS, KW=kw, XV=xv, SWIGLU=int(swiglu),
                    EPILOGUE=_dq_epilogue(out.dt, bias is not None, act),
                    SWIGLU_OF=codegen.swiglu_of(acc_of(x.dt)), EARLY=int(b.written_by_no_kernel(w)),
                    NORM=int(norm is not None), TN=ctype(residual.w.dt) if residual is not None else "float",
                    RESID=int(residual is not None), QX=qx, Q8=int(q8 is not None), TC=int(tc),
                    dynamic_smem=QX_SMEM if qx else 0)
    per_block = 8 // kw * (rows // 2 if swiglu else rows)
    xp = (x8 if x8 is not None else x).arr
    y8 = counters = None
    if q8 is not None:
        y8 = b.int8_x[(q8, 0)] = b.buffer((qx_bytes(M, N),), U8, f"int8 rows of node %{q8}")
        counters = b.counters(N // 32 + 1)
        b.absorbed.add(q8)
    args = _with_norms(b, [xp, i64(xrs), w.arr, i64(wrs), bias.arr if bias else None, out.arr, i32(M), i32(N),
                           i32(nb), y8.arr if y8 is not None else None, counters], norm, residual, M, N,
                       normed_q8=q8 is not None and residual is not None)
    smem = qx_bytes(M, K) if qx else tc_bytes(s.kind, K) if tc else 0
    grid, stream = (-(-N // per_block),), b.stream
    reads = row_streams(b, w, 2 * N if swiglu else N, wrs, w.shape[1] * w.arr.itemsize, swiglu)
    b.add(lambda: fn(grid, (256,), tuple(args), smem, stream), reads=reads)


def _x4_vectors(arr, rs) -> int:
    """dq.cu's XV: whether rows of `arr` (row stride rs elements) take 4 values as one vector load."""
    vec = 4 * arr.itemsize
    return int(arr.data.ptr % vec == 0 and (rs * arr.itemsize) % vec == 0)


def _dq_gemm(b, s, x: V, xrs, w: V, wrs, al, out: V, M, N, K):
    od = out.dt
    cp = b.cp
    tile = max(1, min(N, DQ_TILE // K))
    sd = device.storage_dtype(od)
    mem = b.r.backend.scratch(tile * K * sd.itemsize)
    b.keep.append(mem)                     # a grown scratch must outlive the launches that point at it
    scratch = cp.ndarray((tile, K), sd, memptr=mem)
    nb = K // s.block
    from . import blas as cublas

    dtype_c = getattr(cp.cuda.runtime, _CUDA_T[od])
    compute = cublas.COMPUTE_64F if od is F64 else cublas.COMPUTE_32F
    scal = np.float64 if od is F64 else np.float32
    alpha, beta = np.ones(1, scal), np.zeros(1, scal)
    b.keep += [alpha, beta]
    lib, stream = cublas.library(), b.stream
    handle = lib.handle
    isz = out.arr.itemsize
    for r0 in range(0, N, tile):
        t = min(tile, N - r0)
        _dq_rows(b, s, w.arr[r0:r0 + t], wrs, al, scratch, od, t, nb)
        args = (t, M, K, alpha.ctypes.data, scratch.data.ptr, dtype_c, K, x.arr.data.ptr, dtype_c, xrs,
                beta.ctypes.data, out.arr.data.ptr + r0 * isz, dtype_c, N, compute)

        def gemm(args=args):
            lib.prepare(handle, stream.ptr)
            lib.gemm(handle, 1, 0, *args)
        b.add(gemm)


# ----------------------------------------------------------------------------- int8 activations
# `[precision] activations = "int8"` puts a fake_quantize to int8_b32 before each packed matmul's
# x (rlx_core.passes.packed). Where its every reader is a decode GEMV (`int8_gemv_x`), its step
# rounds x into int8 rows and scales (dq.cu's rlx_quant_q8; the norm of a residual norm left to the
# GEMVs computed there too) and each GEMV multiplies them in dp4a (dq.cu's QX). Elsewhere its
# step writes the rounded floats (dq.cu's rlx_fake_q8). CONFIG["int8_gemv"] (RLX_CUDA_INT8_GEMV=0,
# read at build) keeps the floats and the float GEMV.
QX_SMEM = 96 * 1024         # the most dynamic shared memory a QX GEMV takes (x's int8 rows, scales)
# the most values of x (rows x K) a QX GEMV block rounds itself (QX 2) rather than reading the int8
# rows of a quant_q8 launch before it (4096: an attention's output at batch 1-2); and whether the
# GEMVs before a rounding write its int8 rows (Q8). Both off: on the H200 (session 29) the Llama-1B
# q4_k+int8 decode took 0.666 ms/token with neither, 0.735 with Q8, 0.723 with both
# (benchmarks/README.md, llm_gpu_gguf section); on the H100 every GEMV rounding its own x, the
# residual norms' too (8192, built and removed again in session 35), took 0.841 against 0.727:
# the down GEMV's blocks each rounding 8192 values cost 3x its products (the llm_gpu section)
QX_ROUND_MAX = 0
Q8_IN_GEMV = False


def qx_bytes(M: int, K: int) -> int:
    """The int8 rows of x [M, K] as quant_q8 writes them and a QX GEMV holds them: the q, then a
    float scale a block of 32."""
    return M * K + M * (K // 32) * 4


def _rounds_x(n) -> bool:
    """Whether node n is a fake_quantize to int8_b32 of float rows of a multiple of 32."""
    s = n.outs[0]
    return (n.op == "fake_quantize" and _scheme(n).name == "int8_b32" and s.dtype in (F32, F16, BF16)
            and bool(s.dims) and s.dims[-1] > 0 and s.dims[-1] % 32 == 0)


def int8_gemv_x(g, i: int, hip: bool = False, uses: dict | None = None) -> bool:
    """Whether fake_quantize node i of the static graph g rounds x into int8 rows for decode
    GEMVs: every reader a dequant_matmul taking it as x only, of at most DQ_MAX_M rows whose int8
    rows fit QX_SMEM (CUDA only: the GEMV's dp4a is not HIP's; CONFIG["int8_gemv"]). uses: g's
    consumers where the caller has them."""
    n = g.nodes[i]
    if not _rounds_x(n) or hip or not CONFIG["int8_gemv"]:
        return False
    K = n.outs[0].dims[-1]
    M = math.prod(n.outs[0].dims) // K
    readers = (uses if uses is not None else g.consumers()).get((i, 0), [])

    def gemv_x(c: int) -> bool:
        m = g.nodes[c] if c >= 0 else None
        return (m is not None and m.op == "dequant_matmul" and tuple(m.inputs[0]) == (i, 0)
                and [tuple(r) for r in m.inputs].count((i, 0)) == 1)
    return bool(readers) and M <= DQ_MAX_M and qx_bytes(M, K) <= QX_SMEM and all(map(gemv_x, readers))


def _q8_reader(b, ref: tuple) -> int | None:
    """The fake_quantize node that is the only reader of `ref` (a decode GEMV's output: the
    SwiGLU's, or a residual norm's y) and rounds it into int8 rows for decode GEMVs, which the
    GEMV writing `ref` then writes itself (dq.cu's Q8, where Q8_IN_GEMV); else None."""
    readers = b.uses.get(ref, [])
    if not Q8_IN_GEMV or len(readers) != 1 or readers[0] < 0:
        return None
    g, j = b.r.lir.graph, readers[0]
    return j if g.nodes[j].op == "fake_quantize" and int8_gemv_x(g, j, b.hip, b.uses) else None


def _read_next(b, ref: tuple) -> bool:
    """Whether only params and constants lie between this node and the last reader of `ref`,
    other than its readers (what else a step writes in between is not known here)."""
    g, readers = b.r.lir.graph, b.uses.get(ref, [])
    between = range(b.node + 1, max(readers))
    return all(j in readers or g.nodes[j].op in ("param", "constant") for j in between)


def _int8_x(b, ref: tuple, x: V) -> None:
    """x rounded into int8 rows (quant_q8) for the GEMVs reading `ref`, the fake_quantize's
    output: from the norm those GEMVs would compute where x is its y (GemvNorm: its weighted rows
    and sums; the sums' ring as a NORM GEMV joins it), else from x. A small x (QX_ROUND_MAX) no
    norm is left to, read next, is left to the GEMVs to round: its float rows in b.int8_x (QX 2;
    `_int8_rows_kept`)."""
    K = x.shape[-1]
    M = x.size // K
    norm = _gemv_norm(b, tuple(b.r.lir.graph.nodes[ref[0]].inputs[0]))
    if norm is not None and not norm.fits(M, K, x.dt):
        norm.add_unfused(b)
        norm = None
    if norm is not None:
        xr, xrs = norm.rows(M, K)
        rows = V(xr, x.dt)
    else:
        rows, xrs = _as_matrix(b, x, M, K)
        if M * K <= QX_ROUND_MAX and _read_next(b, ref):
            b.int8_x[ref] = V(b.cp.lib.stride_tricks.as_strided(
                rows.arr, shape=(M, K), strides=(xrs * rows.arr.itemsize, rows.arr.itemsize)), x.dt)
            return
    b.int8_x[ref] = _quant_q8(b, rows, xrs, M, K, norm)


def _int8_rows_kept(b, ref: tuple, writes: list) -> V | None:
    """The x a GEMV writing `writes` reads for the fake_quantize `ref` (b.int8_x): float rows
    it may round itself only where it writes none of their bytes; else the rows are rounded
    by quant_q8 now, before it, for it and the GEMVs after it."""
    x8 = b.int8_x.get(ref)
    if x8 is None or x8.dt is U8 or all(b.disjoint(w, x8) for w in writes):
        return x8
    M, K = x8.shape
    x8 = b.int8_x[ref] = _quant_q8(b, x8, x8.arr.strides[0] // x8.arr.itemsize, M, K, None)
    return x8


def _quant_q8(b, rows: V, xrs, M: int, K: int, norm: GemvNorm | None) -> V:
    """The quant_q8 launch rounding rows [M, K] (row stride xrs; norm: the rows are its weighted
    rows, the scales divided by it) into int8 rows for QX GEMVs: returns them."""
    y8 = b.buffer((qx_bytes(M, K),), U8, "int8 rows of x")
    src = sources.render(sources.ROUND_Q8, ACC="float", A=16, T=ctype(rows.dt), TO=ctype(rows.dt),
                         NORM=int(norm is not None), XV=_x4_vectors(rows.arr, xrs))
    fn = b.kernel(src, "rlx_quant_q8")
    args = [rows.arr, i64(xrs), i32(M), i32(K), y8.arr, norm.ssq if norm is not None else None,
            np.float32(norm.eps if norm is not None else 0), None, i32(0)]
    if norm is not None:
        norm.fused = True
        b.gemv_sums.follow(norm.ssq, args)
    blocks = M * K // 32
    grid, stream = (max(1, min(-(-blocks // 32), b.sms)),), b.stream
    b.add(lambda: fn(grid, (256,), tuple(args), 0, stream))
    return y8


def _b_fake_quantize(b, n, ins, outs):
    """fake_quantize to int8_b32 of float rows: int8 rows for the decode GEMVs reading it
    (int8_gemv_x), else the rounded floats; other schemes (weight preparation) and f64 on the host."""
    if not _rounds_x(n):
        _b_host(b, n, ins, outs)
    elif ins[0].size and int8_gemv_x(b.r.lir.graph, b.node, b.hip, b.uses):
        _int8_x(b, (b.node, 0), ins[0])
    else:
        round_int8(b, ins[0], outs[0])


class _Int8Rounding:
    """A fake_quantize to int8_b32 as `_b_host` takes a node (f64 rows: no kernel)."""
    op, a = "fake_quantize", {"scheme": "int8_b32"}


def round_int8(b, x: V, out: V) -> None:
    """out <- x rounded through int8_b32 blocks (rows of a multiple of 32): the fake_q8 kernel,
    in place where out is x (a block's lanes read it before they write it); f64 on the host."""
    if x.dt not in (F32, F16, BF16):
        _b_host(b, _Int8Rounding, [x], [out])
        return
    if x.size == 0:
        return
    src = b.contiguous(x)
    same = out.arr.data.ptr == src.arr.data.ptr
    dst = out if out.contiguous() and (same or b.disjoint(out, src)) else b.buffer(out.shape, out.dt)
    fn = b.kernel(sources.render(sources.ROUND_Q8, ACC="float", A=16, T=ctype(x.dt), TO=ctype(out.dt), NORM=0,
                                 XV=_x4_vectors(src.arr, 32)), "rlx_fake_q8")
    blocks = x.size // 32
    b.launch(fn, (max(1, min(-(-blocks // 32), b.sms * 8)),), (256,), (src.arr, dst.arr, i64(blocks)))
    if dst is not out:
        b.copy(dst, out)


def _b_host(b, n, ins, outs):
    """An op with no GPU kernel (quantize, fake_quantize: weight preparation, not a model
    step) runs its NumPy kernel on host copies; such a step keeps its graph out of capture."""
    from rlx_core.ir.numpy_kernels import KERNELS

    fn, a, cp, stream = KERNELS[n.op], dict(n.a), b.cp, b.stream

    def run():
        with stream:
            host = [v.arr.get(stream=stream).view(v.dt.np) for v in ins]
            res = [np.empty(o.shape, o.dt.np) for o in outs]
            fn(a, res, *host)
            for o, r in zip(outs, res):
                o.arr[...] = cp.asarray(r.view(device.storage_dtype(o.dt)))
    b.add(run, capturable=False)


def _b_collective(b, n, ins, outs):
    """all_reduce, all_gather, reduce_scatter (issue 19) on the communicator bound in the
    process. On the NCCL one (rlx_backend_cuda.nccl) the collective runs on the runner's
    stream over buffers made here (the rank-major layout NCCL gathers and scatters along),
    so a decode step's collectives are captured into its CUDA graph; any other one (the CPU
    one) gets host copies, out of capture; with none bound a group of one is a copy."""
    from rlx_core.ir import comm

    from .nccl import NcclCommunicator

    x, out, a, op = ins[0], outs[0], n.a, n.op
    c = comm.current(a["world"], a["rank"])
    if not isinstance(c, NcclCommunicator):
        if a["world"] == 1:
            b.copy(x, out)
        else:
            _b_host(b, n, ins, outs)
        return
    cp, stream = b.cp, b.stream
    ax = 0 if op == "all_reduce" else a["axis"] % len(x.shape)

    def major(v: V) -> V:
        return V(cp.moveaxis(v.arr, ax, 0), v.dt)

    src = b.contiguous(major(x))
    dst = out if op == "all_reduce" and out.contiguous() else b.buffer(major(out).shape, out.dt)

    def run():
        c.on_device(op, src.arr, dst.arr, out.dt.np, stream)
    b.add(run)
    if dst is not out:
        b.copy(V(cp.moveaxis(dst.arr, 0, ax), out.dt), out)


# ----------------------------------------------------------------------------- rows
def _rowargs(b, x: V):
    rows = math.prod(x.shape[:-1]) if x.shape else 1
    n = x.shape[-1] if x.shape else 1
    v, rs = _as_matrix(b, x, rows, n)
    return v, rows, n, rs


def _norm_rows(b, x: V, r: V | None) -> tuple:
    """(x rows, rows, n, x row stride, r rows or None, r row stride) for a (residual) norm."""
    xv, rows, nn, xrs = _rowargs(b, x)
    rv, rrs = (None, 0)
    if r is not None:
        rv, _, _, rrs = _rowargs(b, r)
    return xv, rows, nn, xrs, rv, rrs


WARP_ROW = 512               # rows this long or shorter get a warp each (RMSNorm), longer a block


def _vpt(n: int, threads: int | None = None) -> int:
    """Values per thread that keep a row of n in registers with `threads` (default _block(n))
    threads (0: too long)."""
    v = -(-n // (threads or _block(n)))
    return v if v <= 16 else 0


def _rms_norm(b, x, r, w, h, y, eps, off, pair: tuple | None = None):
    """y <- rms_norm(x [+ r]) * (w + off); with r also h <- x + r (fused_residual_rms_norm);
    pair (x2, w2, y2): also y2 <- rms_norm(x2) * (w2 + off), rows as long, in the same launch."""
    if y.size == 0:
        return
    xv, rows, nn, xrs, rv, rrs = _norm_rows(b, x, r)
    wv = b.contiguous(w) if w is not None else None
    x2v, rows2, xrs2, w2v, y2 = xv, 0, xrs, wv, y          # (no second norm: none of its rows run)
    if pair:
        x2, w2, y2 = pair
        x2v, rows2, _, xrs2 = _rowargs(b, x2)
        w2v = b.contiguous(w2) if w2 is not None else None
    arrays, strides = [xv, rv, h, y, x2v, y2], [xrs, rrs, xrs2]
    warp = nn <= WARP_ROW
    lanes = 32
    if warp:                  # a warp a row: its lanes' values in one vector each where they fit
        vec, threads, vpt = _row_vectors(nn, arrays, strides, 32, 1)
        # fewer lanes a row, each with a wider vector, while one vector a lane covers the row
        # (FLUX's q/k rows of 128 bf16 values: 16 lanes of 16 bytes, two rows a warp)
        while not b.hip and lanes > 1 and vec == vpt and 2 * vec * y.arr.itemsize <= 16:
            cand = _row_vectors(nn, arrays, strides, lanes // 2, 1)
            if cand[0] != 2 * vec:
                break
            lanes, (vec, threads, vpt) = lanes // 2, cand
    else:
        vec, threads, vpt = _row_vectors(nn, arrays, strides)
    src = sources.render(sources.RMS_NORM, TX=ctype(x.dt), TR=ctype(r.dt) if r else "float",
                         TW=ctype(w.dt) if w else "float", TH=ctype(h.dt) if h else "float",
                         TO=ctype(y.dt), ACC=acc_of(x.dt, r.dt if r else x.dt),
                         HAS_R=int(r is not None), HAS_W=int(w is not None), WARP=int(warp), VPT=vpt, VEC=vec,
                         LANES=lanes,
                         EARLY=int(all(b.written_by_no_kernel(v) for v in (wv, w2v) if v is not None)))
    fn = b.kernel(src, "rlx_rms_norm")
    total = rows + rows2
    grid, block = ((-(-total // (256 // lanes)),), (256,)) if warp else ((total,), (threads,))
    b.launch(fn, grid, block, (xv.arr, i64(xrs), rv.arr if rv else None, i64(rrs), wv.arr if wv else None,
                               h.arr if h else None, y.arr, i32(nn), f64(eps), f64(off), i64(total),
                               x2v.arr, i64(xrs2), w2v.arr if w2v else None, y2.arr, i64(rows)))


def _paired_norm(b, n) -> int | None:
    """The rms_norm node this one can share a launch with: the next node that launches
    anything, when it is an rms_norm of the same eps, offset and weight presence whose x does
    not come from this one (only params and views lie between, so neither reads the other's
    output: a decode step's q and k norms); else None."""
    j = _next_launch(b)
    if j is None:
        return None
    m = b.r.lir.graph.nodes[j]
    same = (m.op == "rms_norm" and j not in b.absorbed and len(m.inputs) == len(n.inputs)
            and (m.a["eps"], m.a["offset"]) == (n.a["eps"], n.a["offset"]))
    return j if same and _view_root(b, tuple(m.inputs[0]))[0] != b.node else None


def _next_launch(b) -> int | None:
    """The first node after this one that may launch anything (not a param, constant or view)."""
    g, slots = b.r.lir.graph, b.r.lir.slots
    return next((j for j in range(b.node + 1, len(g.nodes)) if g.nodes[j].op not in ("param", "constant")
                 and getattr(slots.get((j, 0)), "home", "") != "view"), None)


def _apart(a: V, c: V) -> bool:
    """Whether two arrays' byte spans (first to last element) do not meet: the second norm of a
    pair writes its y while the first's x is read, and the plan may have let y take x's bytes."""
    def span(v: V) -> tuple:
        lo = v.arr.data.ptr + sum((d - 1) * s for d, s in zip(v.arr.shape, v.arr.strides) if s < 0)
        return lo, lo + sum((d - 1) * abs(s) for d, s in zip(v.arr.shape, v.arr.strides)) + v.arr.itemsize
    (a0, a1), (c0, c1) = span(a), span(c)
    return a1 <= c0 or c1 <= a0


def _view_root(b, ref: tuple) -> tuple:
    """The (node, output) that `ref` is, looking through views."""
    g, slots = b.r.lir.graph, b.r.lir.slots
    while getattr(slots.get(ref), "home", "") == "view":
        ref = tuple(g.nodes[ref[0]].inputs[0])
    return ref


def _b_rms_norm(b, n, ins, outs):
    """A plain RMSNorm; one whose only reader is a RoPE is left to that rope's launch
    (`RopeNorm`); the first of a pair (`_paired_norm`) waits for the second, which runs both in
    one launch where their rows fit one kernel (same dtypes and row length)."""
    w = ins[1] if len(ins) > 1 else None
    first = b.waiting_norms.pop(b.node, None)
    later = RopeNorm.of(b, n, ins, outs)
    if later is not None:
        b.rope_norms[b.node] = later
    elif first is None:
        j = _paired_norm(b, n)
        if j is not None:
            b.waiting_norms[j] = (b.node, ins[0], w, outs[0])
            return
    else:
        i, x1, w1, y1 = first
        x, y = ins[0], outs[0]
        kind = (x.dt, y.dt, getattr(w, "dt", None), x.shape[-1])
        if (kind == (x1.dt, y1.dt, getattr(w1, "dt", None), x1.shape[-1]) and y1.size and y.size
                and _apart(y, x1)):
            return _rms_norm(b, x1, None, w1, None, y1, n.a["eps"], n.a["offset"], pair=(x, w, y))
    if first is not None:
        with b.at_node(first[0]):         # (no pair after all: the first norm's own launch, as its node's)
            _rms_norm(b, first[1], None, first[2], None, first[3], n.a["eps"], n.a["offset"])
    if later is None:
        _rms_norm(b, ins[0], None, w, None, outs[0], n.a["eps"], n.a["offset"])


# ----------------------------------------------------------------------------- norms in the RoPE
# A decode step's q and k norms (OLMoE's over a position's whole projection, Qwen3's and Gemma's
# per head) are read only by the RoPE after them, which also writes k and v into the cache: the
# rope launch norms the rows it loads, so the norms are no launch of their own. CONFIG["rope_norm"]
# (RLX_CUDA_ROPE_NORM=0 at build) turns it off.
@attrs.frozen(eq=False)
class RopeNorm:
    """y = rms_norm(x) * (w + off), left for the rope reading y (through views only) to compute
    from x as it loads its rows; `whole`: a norm row is all H heads of a position (y [B, S, H*D]),
    else one head (y [B, S, H, D])."""
    node: int
    x: V
    w: V
    y: V
    eps: float
    off: float
    whole: bool

    # a whole-row norm is summed by each head's warp again: only where the rows are decode's few
    WHOLE_MAX_ROWS = 64

    @classmethod
    def of(cls, b, n, ins, outs) -> RopeNorm | None:
        """The record when this rms_norm's one reader is a rope's x (through views), it has a
        weight, x and y one dtype, y [B, S, H*D] or [B, S, H, D] for the rope's [B, H, S, D]."""
        if not CONFIG["rope_norm"] or len(ins) < 2 or ins[0].dt is not outs[0].dt or not outs[0].size:
            return None
        reader = _reader_through_views(b, (b.node, 0))
        if (reader is None or b.r.lir.graph.nodes[reader[0]].op != "rope" or reader[1] != 0
                or not _alive_until(b, tuple(n.inputs[0]), reader[0])):
            return None
        rope_shape = tuple(b.r.lir.graph.nodes[reader[0]].outs[0].dims)
        y = outs[0]
        if len(rope_shape) != 4 or len(y.shape) not in (3, 4) or ins[1].shape != (y.shape[-1],):
            return None
        B, H, S, D = rope_shape
        whole = y.shape == (B, S, H * D) and (H == 1 or B * S <= cls.WHOLE_MAX_ROWS)
        if not whole and y.shape != (B, S, H, D):
            return None
        return cls(b.node, ins[0], ins[1], y, n.a["eps"], n.a["offset"], whole)

    def add_unfused(self, b) -> None:
        """The norm's own launch, as its node's step (the rope could not take it)."""
        with b.at_node(self.node):
            _rms_norm(b, self.x, None, self.w, None, self.y, self.eps, self.off)

    def source(self, b, seen: V) -> V | None:
        """x seen as the rope sees y ([B, H, S, D]), or None where the rope's view of y is not
        the plain reshape and transpose (then the norm runs on its own)."""
        D = seen.shape[3]

        def bhsd(v: V) -> tuple:
            e = v.es
            return (e[0], D * e[2], e[1], e[2]) if self.whole else (e[0], e[2], e[1], e[3])
        steps = [(a, c) for a, c, d in zip(seen.es, bhsd(self.y), seen.shape) if d > 1]
        if seen.arr.data.ptr != self.y.arr.data.ptr or any(a != c for a, c in steps):
            return None
        isz = self.x.arr.itemsize
        strides = tuple(e * isz for e in bhsd(self.x))
        return V(b.cp.lib.stride_tricks.as_strided(self.x.arr, seen.shape, strides), self.x.dt)


# A decode step's RoPE launch (q roped; k roped into its cache; v into its cache; q's and k's
# per-head norms) is left to the cluster decode attention reading those three, which does it in
# its own launch (attn.cu:decode ROPE): one launch a layer fewer. CONFIG["attn_rope"]
# (RLX_CUDA_ATTN_ROPE=1 at build) turns it on.
@attrs.frozen(eq=False)
class AttnRope:
    """The rope node's work left to attention node `attention`: raw rows q, k, v ([B, H, 1, D],
    unit element stride; a norm's x where qn / kn norms them), the caches kc, vc k and v go
    into at position pos[b] (kv_write node err_node names an overflow), the tables; fallback:
    the rope launch's run functions, for an attention kernel that cannot take it."""
    node: int
    attention: int
    q: V
    k: V
    v: V
    kc: V
    vc: V
    qn: RopeNorm | None
    kn: RopeNorm | None
    cos: V
    sin: V
    interleaved: bool
    pos: V
    err_node: int
    fallback: tuple = ()

    @classmethod
    def of(cls, b, n, jobs: list, norms: list, refs_of: list, pos: V | None,
           err_node: int) -> AttnRope | None:
        """The record where the rope launch's jobs are exactly q, k into a cache and v into a
        cache, of one row each and one dtype, read (through views) by one attention node only
        as its q, k and v, with no launch between (so what they read is as the rope left it:
        `_takes_rope` checks the attention's output against it), the tables contiguous; else None."""
        kinds = [(rot, at) for _, _, rot, at in jobs]
        if (not CONFIG["attn_rope"] or device.cluster_missing(b.cc, b.hip) or pos is None
                or sorted(kinds) != [(False, True), (True, False), (True, True)]):
            return None
        iq, ik, iv = (kinds.index(k) for k in ((True, False), (True, True), (False, True)))
        readers = [_reader_through_views(b, refs_of[i][1]) for i in (iq, ik, iv)]
        j = readers[0][0] if readers[0] else -1
        if (readers != [(j, 0), (j, 1), (j, 2)] or b.r.lir.graph.nodes[j].op != "attention"
                or not _no_launch_between(b, b.node, j)):
            return None
        xs = []
        for i in (iq, ik, iv):
            x, m = jobs[i][0], norms[i]
            if m is not None:
                x = m.source(b, x) if not m.whole else None
            if x is None or x.shape[2] != 1 or x.es[3] != 1 or x.dt is not jobs[i][1].dt:
                return None
            xs.append(x)
        cos, sin = (b.vals[tuple(r)] for r in n.inputs[1:])
        weights = [m.w for m in norms if m is not None]
        if (len({x.dt for x in xs}) != 1 or len({w.dt for w in weights}) > 1
                or not all(t.contiguous() for t in (cos, sin, *weights)) or cos.dt is not sin.dt):
            return None
        return cls(b.node, j, *xs, jobs[ik][1], jobs[iv][1], norms[iq], norms[ik], cos, sin,
                   n.a["style"] == "interleaved", pos, err_node)


# The elementwise node that is a decode attention's output's one reader (Qwen3.5's output gate,
# o * sigmoid(gate)) is computed in the cluster decode attention's store (attn.cu:decode EPI): one
# launch a full-attention layer fewer. CONFIG["attn_epilogue"] (RLX_CUDA_ATTN_EPILOGUE=1 at build)
# turns it on.
@attrs.frozen(eq=False)
class AttnEpilogue:
    """Node `node` (program on the attention's output, input `slot`, and ex) written to ey by
    the attention kernel; `taken` {"done": bool}: set by the attention's dispatch, read by the
    node's own step (which runs only where another kernel attended)."""
    node: int
    slot: int
    program: tuple
    ex: V
    ey: V
    taken: dict

    @classmethod
    def of(cls, b, out: V) -> AttnEpilogue | None:
        """The record where the attention's output [B, H, 1, D] is read only by an elementwise node
        of two inputs, through reshapes (so its element order is the output's), with no launch
        between, the other input and the node's output 16-bit or f32 rows of the same [B, H, D]."""
        if not CONFIG["attn_epilogue"] or device.cluster_missing(b.cc, b.hip):
            return None
        reader = _reader_through_views(b, (b.node, 0), ("reshape",))
        if reader is None:
            return None
        u, slot = reader
        n = b.r.lir.graph.nodes[u]
        if (n.op not in ("fused_elementwise", "binary") or len(n.inputs) != 2 or len(n.outs) != 1
                or not _no_launch_between(b, b.node, u)):
            return None
        ex = b.vals.get(tuple(n.inputs[1 - slot]))
        if ex is None or ex.dt not in (F32, BF16, F16):
            return None
        ey = b.out_value(u)
        B, H, _, D = out.shape
        if _bhd(ex, B, H, D) is None or _bhd(ey, B, H, D) is None or ey.dt not in (F32, BF16, F16):
            return None
        return cls(u, slot, _program(n), ex, ey, {"done": False})

    def source(self, out_dt: DType) -> dict:
        """ATTN_DECODE's EPI defines for an output stored as out_dt."""
        dts = [out_dt, self.ex.dt] if self.slot == 0 else [self.ex.dt, out_dt]
        return dict(EPI=1, EPI_FN=codegen.epilogue_function(self.program, dts, self.ey.dt, "rlx_epi"),
                    EPI_CALL="rlx_epi(o, e)" if self.slot == 0 else "rlx_epi(e, o)",
                    TE=ctype(self.ex.dt), TY=ctype(self.ey.dt))

    def args(self, B: int, H: int, D: int) -> tuple:
        (xb, xh), (yb, yh) = _bhd(self.ex, B, H, D), _bhd(self.ey, B, H, D)
        return (self.ex.arr, i64(xb), i64(xh), self.ey.arr, i64(yb), i64(yh))


def _bhd(v: V, B: int, H: int, D: int) -> tuple | None:
    """(batch, head) element strides of v read as [B, H, D] in its own element order (its dims
    of size > 1 those of (B, H, D), the last of unit stride), or None."""
    dims = [(d, e) for d, e in zip(v.shape, v.es) if d > 1]
    want = [d for d in (B, H, D) if d > 1]
    if [d for d, _ in dims] != want or (D > 1 and dims[-1][1] != 1):
        return None
    st = dict(zip([k for k, d in enumerate((B, H, D)) if d > 1], [e for _, e in dims]))
    return st.get(0, 0), st.get(1, 0)


def _alive_until(b, ref: tuple, j: int) -> bool:
    """Whether the bytes of value ref (through views) stay its own until node j reads them: the
    plan may give a dead value's bytes to a node between (a GEMV of v between the q/k norms and
    their rope, where v's weights are in another scheme than q's and k's)."""
    slot = b.r.lir.slots.get(_view_root(b, ref))
    return slot is not None and (slot.home in ("input", "param", "state", "const")
                                 or (slot.home == "arena" and slot.end >= j))


def _reader_through_views(b, ref: tuple, views: tuple | None = None) -> tuple | None:
    """(node, input index) of the one node reading ref, looking through views that are each the
    one use of the value before (of the ops `views` only, where given); None where a value on
    the way has other uses or is an output."""
    g, slots = b.r.lir.graph, b.r.lir.slots
    while True:
        use = b.uses.get(ref, [])
        if len(use) != 1 or use[0] < 0:
            return None
        u = use[0]
        if getattr(slots.get((u, 0)), "home", "") != "view":
            return u, [tuple(r) for r in g.nodes[u].inputs].index(ref)
        if views is not None and g.nodes[u].op not in views:
            return None
        ref = (u, 0)


def _no_launch_between(b, i: int, j: int) -> bool:
    """Whether nodes i + 1 .. j - 1 launch nothing (absorbed, views, params, constants)."""
    g, slots = b.r.lir.graph, b.r.lir.slots
    return all(t in b.absorbed or g.nodes[t].op in ("param", "constant")
               or getattr(slots.get((t, 0)), "home", "") == "view" for t in range(i + 1, j))


def _full(b, r: V, shape) -> V:
    if r.shape == tuple(shape):
        return r
    buf = b.buffer(shape, r.dt)
    b.copy(r, buf)
    return buf


def _b_res_rms(b, n, ins, outs):
    w = ins[2] if len(ins) > 2 else None
    _rms_norm(b, ins[0], _full(b, ins[1], ins[0].shape), w, outs[0], outs[1], n.a["eps"], n.a["offset"])


def _layer_norm(b, x, r, g, bb, h, y, eps):
    if y.size == 0:
        return
    xv, rows, nn, xrs, rv, rrs = _norm_rows(b, x, r)
    gv = b.contiguous(g) if g is not None else None
    bv = b.contiguous(bb) if bb is not None else None
    dts = [x.dt] + ([r.dt] if r is not None else [])
    vec, threads, vpt = _row_vectors(nn, [xv, rv, h, y], [xrs, rrs])
    src = sources.render(sources.LAYER_NORM, TX=ctype(x.dt), TR=ctype(r.dt) if r else "float",
                         TG=ctype(g.dt) if g else "float", TB=ctype(bb.dt) if bb else "float",
                         TH=ctype(h.dt) if h else "float", TO=ctype(y.dt), ACC=acc_of(*dts),
                         HAS_R=int(r is not None), HAS_G=int(g is not None), HAS_B=int(bb is not None),
                         VPT=vpt, VEC=vec)
    fn = b.kernel(src, "rlx_layer_norm")
    b.launch(fn, (rows,), (threads,), (xv.arr, i64(xrs), rv.arr if rv else None, i64(rrs),
                                           gv.arr if gv else None, bv.arr if bv else None,
                                           h.arr if h else None, y.arr, i32(nn), f64(eps)))


def _row_vectors(n: int, rows: list, strides: list, threads: int | None = None, per: int = 4) -> tuple:
    """(values a vector, threads, values a thread) of a norm over rows of n: vectors of 16-bit
    values (16 bytes, or 8 / 4 where a row is shorter than `threads` x 8) where every row array
    (None: absent) and stride allows, about `per` a thread, threads `threads` (default: a
    power of two for that); else single values, a block of _block(n) threads (or `threads`)."""
    vs = [v for v in rows if v is not None]
    vec = 8
    while threads and vec > 2 and n < threads * vec:
        vec //= 2
    if (n % vec == 0 and all(v.arr.itemsize == 2 and v.arr.data.ptr % (2 * vec) == 0 for v in vs)
            and all(s % vec == 0 for s in strides)):
        nvec = n // vec
        t = threads or _block(-(-nvec // per))
        nv = -(-nvec // t)
        if nv <= 4:
            return vec, t, vec * nv
    t = threads or _block(n)
    return 1, t, _vpt(n, t)


def _b_layer_norm(b, n, ins, outs):
    g = ins[1] if len(ins) > 1 else None
    bb = ins[2] if len(ins) > 2 else None
    _layer_norm(b, ins[0], None, g, bb, None, outs[0], n.a["eps"])


def _b_res_ln(b, n, ins, outs):
    x, r = ins[0], _full(b, ins[1], ins[0].shape)
    g = ins[2] if len(ins) > 2 else None
    bb = ins[3] if len(ins) > 3 else None
    _layer_norm(b, x, r, g, bb, outs[0], outs[1], n.a["eps"])


def _along_axis(b, x: V, out: V, axis: int, kernel_fn):
    """Run a row kernel along `axis`: kernel_fn(xv, rows, n, rs, y) writes contiguous rows y."""
    rank = len(x.shape)
    ax = axis % rank if rank else 0
    if ax == rank - 1 or rank == 0:
        xv, rows, nn, rs = _rowargs(b, x)
        if out.contiguous():
            kernel_fn(xv, rows, nn, rs, out)
            return
        tmp = b.buffer(out.shape, out.dt)
        kernel_fn(xv, rows, nn, rs, tmp)
        b.copy(tmp, out)
        return
    perm = [i for i in range(rank) if i != ax] + [ax]
    inv = list(np.argsort(perm))
    xm = b.contiguous(V(x.arr.transpose(perm), x.dt))
    xv, rows, nn, rs = _rowargs(b, xm)
    ym = b.buffer(xm.shape, out.dt)
    kernel_fn(xv, rows, nn, rs, ym)
    b.copy(V(ym.arr.transpose(inv), out.dt), out)


def _b_softmax(b, n, ins, outs):
    x, y = ins[0], outs[0]
    if y.size == 0:
        return
    fn = b.kernel(row_kernels.source("softmax", x.dt, y.dt), "rlx_softmax")

    def k(xv, rows, nn, rs, yv):
        b.launch(fn, (rows,), (_block(nn),), (xv.arr, i64(rs), yv.arr, i32(nn)))
    _along_axis(b, x, y, n.a["axis"], k)


def _b_softmax_grad(b, n, ins, outs):
    y, g = ins
    dx = outs[0]
    if dx.size == 0:
        return
    ax = (n.a["axis"] % len(y.shape),)
    yv, gv = b.contiguous(b.moved_last(y, ax)), b.contiguous(b.moved_last(g, ax))
    target = b.moved_last(dx, ax)                 # dx with the axis last: the rows the kernel writes
    o = target if target.contiguous() else b.buffer(yv.shape, dx.dt)
    nn = yv.shape[-1]
    src = sources.render(sources.SOFTMAX_GRAD, TY=ctype(y.dt), TG=ctype(g.dt), TO=ctype(dx.dt),
                         ACC=acc_of(y.dt, g.dt))
    b.launch(b.kernel(src, "rlx_softmax_grad"), (yv.size // nn,), (_block(nn),), (yv.arr, gv.arr, o.arr, i32(nn)))
    if o is not target:
        b.copy(o, target)


def _norm_grad(b, x, w, g, outs, eps, off, center: bool):
    """dx into outs[0]; the weight's gradient (rows summed) into outs[1]; for layer_norm the
    bias's (the rows of g summed) into outs[2]."""
    dx = outs[0]
    if dx.size == 0:
        return
    xv, gv, wv = b.contiguous(x), b.contiguous(g), b.contiguous(w)
    nn = x.shape[-1]
    rows = x.size // nn
    acc = acc_of(x.dt, g.dt)
    o = dx if dx.contiguous() else b.buffer(dx.shape, dx.dt)
    pw = b.buffer((rows, nn), F64 if acc == "double" else F32)
    src = sources.render(sources.NORM_GRAD, TX=ctype(x.dt), TW=ctype(w.dt), TG=ctype(g.dt), TO=ctype(dx.dt),
                         ACC=acc, CENTER=int(center))
    b.launch(b.kernel(src, "rlx_norm_grad"), (rows,), (_block(nn),),
             (xv.arr, wv.arr, gv.arr, o.arr, pw.arr, i32(nn), f64(eps), f64(off)))
    if o is not dx:
        b.copy(o, dx)
    for src_rows, out in ((pw, outs[1]),) + (((gv, outs[2]),) if len(outs) > 2 else ()):
        _sum_rows(b, src_rows, rows, nn, out)


def _sum_rows(b, t: V, rows: int, nn: int, out: V) -> None:
    """out [nn] <- the sum of contiguous t's rows (viewed as [rows, nn]), accumulated in f32/f64."""
    macros = row_kernels.reduce_macros("sum", t.dt, out.dt)
    o = out if out.contiguous() else b.buffer(out.shape, out.dt)
    _reduce_cols(b, macros, t, o, (1, rows, nn))
    if o is not out:
        b.copy(o, out)


def _b_rms_norm_grad(b, n, ins, outs):
    _norm_grad(b, ins[0], ins[1], ins[2], outs, n.a["eps"], n.a["offset"], False)


def _b_layer_norm_grad(b, n, ins, outs):
    _norm_grad(b, ins[0], ins[1], ins[2], outs, n.a["eps"], 0.0, True)


def _int_acc(dt: DType) -> str:
    return "long long"


def _loader(dt: DType) -> tuple:
    """(ACC, load expression of macro arg v)."""
    if dt.is_float:
        return acc_of(dt), "LD(ACC, v)"
    return "long long", "(ACC)(v)"


_ACC_DT = {"float": F32, "double": F64, "long long": I64}      # the dtype of an ACC type


def _storer(dt: DType, var: str) -> str:
    if dt.is_float:
        return f"ST({ctype(dt)}, {var})"
    if dt is BOOL:
        return f"({var} != 0)"
    return f"({ctype(dt)})({var})"


def _b_reduce(b, n, ins, outs):
    x, y = ins[0], outs[0]
    rank = len(x.shape)
    axes = n.a["axes"]
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    axes = tuple(sorted({a % rank for a in axes})) if rank else ()
    kept = [i for i in range(rank) if i not in axes]
    rows = math.prod(x.shape[i] for i in kept)
    R = math.prod(x.shape[i] for i in axes)
    if y.size == 0:
        return
    op = n.a["op"]
    if R == 0 and op in ("max", "min"):
        raise BackendError(f"reduce {op} over an empty axis (node %{b.node})")
    macros = row_kernels.reduce_macros(op, x.dt, y.dt)
    oni = _one_run(x.shape, axes)
    if oni is not None and (oni[2] > 1 or R <= REDUCE_SERIAL):
        _reduce_cols(b, macros, b.contiguous(x), y, oni)
        return
    xv, rs = _as_matrix(b, b.moved_last(x, axes), rows, R)
    epi = _reduce_epilogue(b, y)
    fn = b.kernel(row_kernels.source("reduce", x.dt, y.dt, op, epi and (epi[2], epi[1].dt)), "rlx_reduce")
    if epi is not None:                 # (the kernel stores its reader's output, rlx_epi of each result)
        b.absorbed.add(epi[0])
        y = epi[1]
    ns, chunk = _row_split(b, rows, R)
    if ns == 1:
        b.launch(fn, (rows,), (_block(R),), (xv.arr, i64(rs), y.arr, i32(R), i32(R), None, None))
        return
    part = b.node_buffer((rows * ns,), _ACC_DT[macros["ACC"]], "reduce partials")
    b.launch(fn, (rows, ns), (256,), (xv.arr, i64(rs), y.arr, i32(R), i32(chunk), part.arr, b.counters(rows)))


def _reduce_epilogue(b, y: V) -> tuple | None:
    """(node, its output, rlx_epi's source) where the reduce's output y is read only by an
    elementwise node the plan gave bytes from this node on (planned_layouts' early:
    reduce_readers), whose contiguous output the reduce kernel then writes in its store: the
    same bits as the two launches'."""
    u = _epilogue_reader(b.r.lir.graph, b.uses, b.node)
    slot = None if u is None else b.r.lir.slots.get((u, 0))
    if slot is None or slot.home != "arena" or slot.start > b.node:
        return None
    ey = b.out_value(u)
    if ey.size != y.size or not ey.contiguous():
        return None
    return u, ey, codegen.epilogue_function(_program(b.r.lir.graph.nodes[u]), [y.dt], ey.dt, "rlx_epi")


REDUCE_SERIAL = 32      # a reduction this short runs one thread per output, not one block per row
ROW_CHUNK = 4096        # few rows longer than this are cut into chunks of a block each (_row_split)
# the blocks an SM such a split fills at most. At batch 32 the 1B-shape decode's logit sum and
# argmax (8 chunks a row) took 46.9 and 31.7 us on the H200 (benchmarks/README.md, llm_gpu)
ROW_BLOCKS_PER_SM = 2


def _row_split(b, rows: int, R: int) -> tuple:
    """(chunks per row, chunk length) of a row reduction: rows much longer than ROW_CHUNK,
    too few to fill the GPU with a block each, go in up to ROW_BLOCKS_PER_SM blocks per SM in
    all. The 1B-shape decode's argmax and logit sum over 128256 entries: 33 and 28 us as one block."""
    ns = max(1, min(-(-R // ROW_CHUNK), ROW_BLOCKS_PER_SM * b.sms // max(rows, 1)))
    return ns, -(-R // ns)


def _reduce_cols(b, macros: dict, x: V, y: V, oni: tuple) -> None:
    """y [O, I] <- contiguous x [O, R, I] reduced over R (rlx_reduce_cols)."""
    O, R, I = oni
    ty = 1
    while ty < 32 and ty * 16 < R and O * I * ty < b.sms * 2048:
        ty *= 2
    bx = 32 if ty > 1 else 256
    b.launch(b.kernel(sources.render(sources.REDUCE_COLS, **macros), "rlx_reduce_cols"),
             ((O * I + bx - 1) // bx,), (bx, ty), (x.arr, y.arr, i64(O), i32(R), i64(I)))


def _one_run(shape: tuple, axes: tuple) -> tuple | None:
    """(O, R, I) when the reduced axes, size-1 axes aside, are one run of adjacent axes, so
    the contiguous x is [O, R, I] reduced over the middle; None otherwise."""
    marks = [(d, k in axes) for k, d in enumerate(shape) if d != 1]
    red = [i for i, (_, m) in enumerate(marks) if m]
    if red and red != list(range(red[0], red[-1] + 1)):
        return None
    first, last = (red[0], red[-1] + 1) if red else (len(marks), len(marks))
    return (math.prod(d for d, _ in marks[:first]), math.prod(d for d, _ in marks[first:last]),
            math.prod(d for d, _ in marks[last:]))


def _b_argmax(b, n, ins, outs):
    x, y = ins[0], outs[0]
    rank = len(x.shape)
    ax = n.a["axis"] % rank if rank else 0
    if y.size == 0:
        return
    rows = x.size // max(x.shape[ax], 1) if rank else 1
    R = x.shape[ax] if rank else 1
    xm = b.moved_last(x, (ax,)) if rank else x
    xv, rs = _as_matrix(b, xm, rows, R)
    acc = row_kernels.acc_type(x.dt)
    fn = b.kernel(row_kernels.source("argmax", x.dt, I64), "rlx_argmax")
    ns, chunk = _row_split(b, rows, R)
    if ns == 1:
        b.launch(fn, (rows,), (_block(R),), (xv.arr, i64(rs), y.arr, i32(R), i32(R), None, None, None))
        return
    pv = b.node_buffer((rows * ns,), _ACC_DT[acc], "argmax partial values")
    pi = b.node_buffer((rows * ns,), I32, "argmax partial indices")
    b.launch(fn, (rows, ns), (256,), (xv.arr, i64(rs), y.arr, i32(R), i32(chunk), pv.arr, pi.arr,
                                      b.counters(rows)))


def _b_topk(b, n, ins, outs):
    x = ins[0]
    vals, idx = outs
    k = n.a["k"]
    rank = len(x.shape)
    ax = n.a["axis"] % rank
    if vals.size == 0:
        return
    fn = b.kernel(row_kernels.source("topk", x.dt, x.dt), "rlx_topk")
    perm = [i for i in range(rank) if i != ax] + [ax]
    inv = list(np.argsort(perm))
    xm = b.contiguous(V(x.arr.transpose(perm), x.dt)) if ax != rank - 1 else x
    xv, rows, nn, rs = _rowargs(b, xm)
    direct = ax == rank - 1 and vals.contiguous() and idx.contiguous()
    if direct:
        vo, io = vals, idx
    else:
        shp = tuple(xm.shape[:-1]) + (k,)
        vo, io = b.buffer(shp, vals.dt), b.buffer(shp, I64)
    b.launch(fn, (rows,), (256,), (xv.arr, i64(rs), vo.arr, io.arr, i32(nn), i32(k)))
    if not direct:
        b.copy(V(vo.arr.transpose(inv), vals.dt), vals)
        b.copy(V(io.arr.transpose(inv), I64), idx)


def _b_cumsum(b, n, ins, outs):
    x, y = ins[0], outs[0]
    if y.size == 0:
        return
    acc, ld = _loader(x.dt)
    st = _storer(y.dt, "v")
    src = sources.render(sources.CUMSUM, TX=ctype(x.dt), TO=ctype(y.dt), ACC=acc, LOAD=ld, STORE=st)
    fn = b.kernel(src, "rlx_cumsum")

    def k(xv, rows, nn, rs, yv):
        b.launch(fn, (rows,), (_block(nn),), (xv.arr, i64(rs), yv.arr, i32(nn)))
    _along_axis(b, x, y, n.a["axis"], k)


# ----------------------------------------------------------------------------- indexing
def _gather_norm(b, n, t: V, ix: V, out: V) -> tuple | None:
    """(node, w, eps, off, its GEMV readers) of an rms_norm (with weights) of this row gather's
    output (a 16-bit table [nax, n], n a multiple of 8, 16-byte rows) whose y only GEMVs read
    (`_gemv_readers`): a decode step's embeddings and the first layer's norm, which those GEMVs
    then compute (GemvNorm; the rows are still written for their other readers, the residual);
    else None."""
    if (not CONFIG["gemv_fusion"] or t.dt not in LOW or len(t.shape) != 2 or n.a["axis"] % 2
            or ix.size > GEMV_MAX_M or t.shape[1] % 8 or not out.contiguous()
            or any(v.arr.data.ptr % 16 for v in (t, out))):
        return None
    g = b.r.lir.graph
    for j in b.uses.get((b.node, 0), []):
        m = g.nodes[j] if j >= 0 else None
        if m is None or m.op != "rms_norm" or len(m.inputs) != 2 or tuple(m.inputs[0]) != (b.node, 0):
            continue
        readers, w = _gemv_readers(b, (j, 0)), b.vals.get(tuple(m.inputs[1]))
        if readers and w is not None and w.shape == (t.shape[1],) and w.contiguous() and w.dt.is_float:
            return j, w, m.a["eps"], m.a["offset"], readers
    return None


def _gather_rows_for_gemvs(b, t: V, ix: V, out: V, fold: tuple) -> None:
    """The gather of `_gather_norm`'s fold: the rows, their weighted copy and sums of squares
    (rlx_gather_norm), the norm left to its GEMVs (GemvNorm), its own launch kept for a reader
    that cannot take it."""
    j, w, eps, off, readers = fold
    ssq, xw = _norm_inputs(b, j, out)
    src = sources.render(sources.GATHER_NORM, TT=ctype(t.dt), TI=ctype(ix.dt), TW=ctype(w.dt))
    b.launch(b.kernel(src, "rlx_gather_norm"), (ix.size,), (256,), (
        t.arr, ix.arr, out.arr, xw.arr, w.arr, np.float32(off), ssq, i64(t.shape[0]), i32(t.shape[1]),
        b.r.err, i32(b.node)))
    own = _collected(b, lambda: _rms_norm(b, out, None, w, None, b.out_value(j, 0), eps, off))
    b.gemv_norms[(j, 0)] = GemvNorm(j, xw, eps, ssq, own, len(readers))
    b.absorbed.add(j)


def _b_gather(b, n, ins, outs):
    t, ix = b.contiguous(ins[0]), b.contiguous(ins[1])
    out = outs[0]
    if out.size == 0:
        return
    fold = _gather_norm(b, n, t, ix, out)
    if fold is not None:
        _gather_rows_for_gemvs(b, t, ix, out, fold)
        return
    rank = len(t.shape)
    ax = n.a["axis"] % rank
    outer = math.prod(t.shape[:ax])
    nax = t.shape[ax]
    inner = math.prod(t.shape[ax + 1:])
    src = sources.render(sources.GATHER, TT=ctype(t.dt), TI=ctype(ix.dt))
    fn = b.kernel(src, "rlx_gather")
    total = outer * ix.size * inner
    b.launch(fn, _grid(total, b.sms), (256,), (t.arr, ix.arr, out.arr, i64(outer), i64(nax), i64(ix.size),
                                               i64(inner), b.r.err, i32(b.node)))


def _grid(n, sms, block=256):
    return (max(1, min((n + block - 1) // block, sms * 32)),)


def _v_assign(b, n, ins):
    if (ins[1].arr.data.ptr, ins[1].arr.strides) != (ins[0].arr.data.ptr, ins[0].arr.strides):
        b.copy(ins[1], ins[0])         # (else an op wrote the state in place: nothing to copy)
    return ins[0]


def _v_kv_write(b, n, ins):
    cache, new, pos = ins
    if b.node in b.absorbed:          # its producer (rope) wrote the rows already
        return cache
    pos = b.contiguous(pos)
    ax = n.a["axis"] % len(cache.shape)
    if ax == 0:
        raise BackendError(f"kv_write: axis 0 is the batch axis (node %{b.node})")
    R = len(new.shape)
    if new.size:
        dims = ", ".join(f"long long d{j}" for j in range(R))
        nstr = ", ".join(f"long long ns{j}" for j in range(R))
        cstr = ", ".join(f"long long cs{j}" for j in range(R))
        dec = []
        for j in reversed(range(R)):
            line = f"    {{ i64 c = r % d{j}; r /= d{j}; src += c * ns{j}; dst += c * cs{j};"
            if j == 0:
                line += " b = c;"
            dec.append(line + " }")
        src = sources.render(sources.KV_WRITE, T=ctype(cache.dt), TP=ctype(pos.dt), DIMS_ARGS=dims,
                             NSTR_ARGS=nstr, CSTR_ARGS=cstr, DECOMP="\n".join(dec), AXIS=ax)
        fn = b.kernel(src, "rlx_kv_write")
        args = [cache.arr, new.arr, pos.arr, i64(new.size)]
        args += [i64(d) for d in new.shape] + [i64(s) for s in new.es] + [i64(s) for s in cache.es]
        args += [i64(cache.shape[ax]), i64(new.shape[ax]), b.r.err, i32(b.node)]
        b.launch(fn, _grid(new.size, b.sms), (256,), args)
    return cache


def _v_reshape(b, n, ins):
    x = ins[0]
    dims = tuple(n.outs[0].dims)
    st = nocopy_reshape_strides(x.shape, x.es, dims) if x.size else None
    if st is not None or x.size == 0:
        if x.size == 0:
            return V(b.cp.empty(dims, x.arr.dtype), x.dt)
        isz = x.arr.itemsize
        arr = b.cp.lib.stride_tricks.as_strided(x.arr, shape=dims, strides=tuple(s * isz for s in st))
        return V(arr, x.dt)
    c = b.contiguous(x)
    return V(c.arr.reshape(dims), x.dt)


def _v_narrow(b, n, ins):
    x = ins[0]
    ax = n.a["axis"] % len(x.shape)
    start = n.a["start"] + x.shape[ax] if n.a["start"] < 0 else n.a["start"]   # negative: from the end
    sl = (slice(None),) * ax + (slice(start, start + n.a["length"]),)
    return V(x.arr[sl], x.dt)


def _v_expand(b, n, ins):
    x = ins[0]
    return V(b.cp.broadcast_to(x.arr, tuple(n.a["shape"])), x.dt)


def _b_transpose(b, n, ins, outs):
    x = ins[0]
    b.copy(V(x.arr.transpose(tuple(n.a["perm"])), x.dt), outs[0])


def _v_transpose(b, n, ins):
    x = ins[0]
    return V(x.arr.transpose(tuple(n.a["perm"])), x.dt)


# readers that take a value through any strides of unit last stride: op -> its input positions that
# may be such views (None: all); and the ops that write their output in any such layout
STRIDED_READERS = {"concat": None, "rope": (0,), "attention": (0, 1, 2), "fused_attention_block": (0, 1, 2),
                   "kv_write": (1,)}
STRIDED_WRITERS = ("attention", "fused_attention_block")
ROW_WRITERS = ("matmul", "fused_matmul_bias_act")      # rows of any stride (cuBLAS's ldc)


def planned_layouts(g) -> tuple:
    """(views, placed, early) for the buffer plan (Backend.planned_layouts). Views: the transposes
    keeping the last axis where either every reader takes strides, or an attention's output is
    read by the transpose alone (the attention then writes its rows in the transposed order,
    so the view is contiguous); FLUX's step copied 285 transposes, 4.9 ms on an H200. Placed:
    concat inputs whose producer writes into the concat's output: any producer where its
    part is a contiguous, aligned run of the output, an attention where it is any layout of
    unit last stride, a GEMM where it is rows of one stride (FLUX's single blocks join the
    attention and the MLP's GEMM this way). Early: the one elementwise reader of a reduce
    (reduce_readers)."""
    views = strided_transposes(g, STRIDED_READERS, STRIDED_WRITERS)
    placed = set()
    for c, n in enumerate(g.nodes):
        for k, r in enumerate(n.inputs if n.op == "concat" else ()):
            own, chain = owner_chain(g, views, tuple(r))
            lay = part_layout(g, c, k, chain)
            op = g.nodes[own[0]].op
            if lay is None or op == "concat" or get_op(op).level is Level.LEAF:
                continue
            off, st = lay
            shape = g.shape_of(own).dims
            isz = g.shape_of(own).dtype.itemsize
            rows = nocopy_reshape_strides(shape, st, (math.prod(shape[:-1]), shape[-1]))
            if ((_same_strides(shape, st, contiguous_strides(shape)) and off * isz % 64 == 0)
                    or (op in STRIDED_WRITERS and st[-1] == 1)
                    or (op in ROW_WRITERS and st[-1] == 1 and rows is not None and off * isz % 16 == 0
                        and rows[0] * isz % 16 == 0)):        # (16-byte rows: cuBLAS's fast kernels)
                placed.add((c, k))
    return frozenset(views), frozenset(placed), reduce_readers(g)


def reduce_readers(g) -> frozenset:
    """The elementwise nodes the kernels of reduces compute in their store (_reduce_epilogue):
    the decode step's logit sum and its cast to f32 in one launch."""
    uses = g.consumers()
    return frozenset(u for i, n in enumerate(g.nodes) if n.op == "reduce"
                     for u in [_epilogue_reader(g, uses, i)] if u is not None)


def _epilogue_reader(g, uses: dict, i: int) -> int | None:
    """The elementwise node of one input that is the one reader of node i's output, or None."""
    use = uses.get((i, 0), [])
    n = g.nodes[use[0]] if len(use) == 1 and use[0] >= 0 else None
    ok = n is not None and n.op in EPILOGUE_OPS and len(n.inputs) == 1 and len(n.outs) == 1
    return use[0] if ok else None


EPILOGUE_OPS = ("cast", "activation", "fused_elementwise")


def owner_chain(g, views, r: tuple) -> tuple:
    """(the value owning r's bytes, the view nodes from r back to it)."""
    chain = []
    while True:
        n = g.nodes[r[0]]
        d = get_op(n.op)
        if not (r[0] in views or (d.view_of is not None and not d.effect)):
            return r, chain
        chain.append(r[0])
        r = tuple(n.inputs[d.view_of or 0])


def _same_strides(shape, a, b) -> bool:
    return all(x == y for d, x, y in zip(shape, a, b) if d != 1)


def part_layout(g, c: int, k: int, chain: list) -> tuple | None:
    """(offset, strides) in elements of concat c's output at which the owner of its input k
    (reached through the view nodes `chain`) lies, or None where a view cannot be undone."""
    cat = g.nodes[c]
    dims = cat.outs[0].dims
    ax = cat.a["axis"] % len(dims)
    st = contiguous_strides(dims)
    off = sum(g.shape_of(r).dims[ax] for r in cat.inputs[:k]) * st[ax]
    shape = g.shape_of(cat.inputs[k]).dims
    for j in chain:
        n = g.nodes[j]
        src = g.shape_of(n.inputs[0]).dims
        if n.op == "transpose":
            back = [0] * len(st)
            for at, p in enumerate(n.a["perm"]):
                back[p] = st[at]
            st = tuple(back)
        elif n.op == "reshape":
            st = nocopy_reshape_strides(shape, st, src)
            if st is None:
                return None
        else:
            return None
        shape = src
    return off, tuple(st)


def _b_concat(b, n, ins, outs):
    """Copies each part not already written in place (a planned part's producer wrote it)."""
    out = outs[0]
    ax = n.a["axis"] % len(out.shape)
    off = 0
    for x in ins:
        ln = x.shape[ax]
        sl = out.arr[(slice(None),) * ax + (slice(off, off + ln),)]
        if ln and not (x.arr.data.ptr == sl.data.ptr and x.dt is out.dt
                       and _same_strides(x.shape, x.arr.strides, sl.strides)):   # (size-1 dims: any stride)
            b.copy(x, V(sl, out.dt))
        off += ln


# ----------------------------------------------------------------------------- attention
def _split_attn(a, ins):
    q, k, v, *rest = ins
    mask = rest.pop(0) if a["has_mask"] else None
    pos = rest.pop(0) if a["has_pos"] else None
    return q, k, v, mask, pos


def _unit_last(b, x: V) -> V:
    if x.shape[-1] > 1 and x.es[-1] != 1:
        return b.contiguous(x)
    return x


def _mask_args(b, mask: V | None, shape) -> tuple:
    if mask is None:
        return None, (0, 0, 0, 0), 0, "float"
    mv = b.cp.broadcast_to(mask.arr, shape)
    isz = mv.itemsize
    st = tuple(s // isz for s in mv.strides)
    return mv, st, (1 if mask.dt is BOOL else 2), ctype(mask.dt)


def _attn_vec(t: V, d: int, nbytes: int = 16) -> int:
    """Elements per vector load of rows of d elements of t [B, heads, S, d]: `nbytes` where
    t's base, row strides and d allow."""
    isz = t.arr.itemsize
    w = max(1, nbytes // isz)
    while w > 1 and (d % w or t.arr.data.ptr % (w * isz) or any(s % w for s in t.es[:3])):
        w //= 2
    return w


def _attention(b, a: dict, q: V, k: V, v: V, mask, pos, out: V, rope: AttnRope | None = None) -> None:
    """The attention launch (its kernel picked at run time by the switches); rope: the step's
    RoPE, done by the decode kernel where it runs, else by the rope launch's functions first."""
    if out.size == 0:
        for fn in rope.fallback if rope is not None else ():
            b.add(fn)
        return
    q, k, v = _unit_last(b, q), _unit_last(b, k), _unit_last(b, v)
    B, H, Sq, Dk = q.shape
    KVH, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    kind = MaskKind(a["mask_kind"])
    mk = {MaskKind.CAUSAL: 1, MaskKind.SLIDING_WINDOW: 2}.get(kind, 0)
    mv, mst, mmode, tm = _mask_args(b, mask, (B, H, Sq, Sk))
    pv = b.contiguous(pos) if pos is not None else None
    tp = ctype(pv.dt) if pv is not None else "int"
    G = H // KVH
    qs, ks, vs = q.es, k.es, v.es
    ostr = tuple(i64(s) for s in out.es[:3])          # any layout with unit head-dim stride
    scale, cap, window = f64(a["scale"]), f64(a["softcap"]), i32(a["window"])
    common = dict(MASKKIND=mk, MASKMODE=mmode, TM=tm, TP=tp, HAS_POS=int(pv is not None))
    tc = None
    same = q.dt is k.dt is v.dt
    if (same and q.dt in LOW and Dk == Dv and Dk in ATTN_TC_DIMS and not device.mma_missing(b.cc, b.hip)
            and Sq >= 16):
        vec = all(t.arr.data.ptr % 16 == 0 for t in (q, k, v)) and all(
            s % 8 == 0 for s in qs[:3] + ks[:3] + vs[:3])
        # (two m-tiles a warp at D 256 would hold 256 accumulators a thread: one)
        mt = 2 if Dk <= 128 and -(-Sq // 128) * H * B >= ATTN_TC_MIN_BLOCKS_PER_SM * b.sms else 1
        src = sources.render(sources.ATTN_TC, T=ctype(q.dt), MMAT="bf16" if q.dt is BF16 else "f16",
                             D=Dk, VEC=int(vec), MT=mt, **common)
        smem = sources.attn_tc_smem(Dk, mt)
        fn = b.kernel(src, "rlx_attn_tc", smem)
        args = (q.arr, i64(qs[0]), i64(qs[1]), i64(qs[2]), k.arr, i64(ks[0]), i64(ks[1]), i64(ks[2]),
                v.arr, i64(vs[0]), i64(vs[1]), i64(vs[2]), mv, *[i64(s) for s in mst], pv.arr if pv else None,
                out.arr, *ostr, i32(B), i32(H), i32(KVH), i32(Sq), i32(Sk), scale, cap, window)
        grid, block, stream = (-(-Sq // (64 * mt)), H, B), (128,), b.stream

        wg = _wg_attention(b, a, q, k, v, mv, mst, pv, out, common) if vec else None

        def tc_run():
            if wg is not None and CONFIG["wg_attention"]:
                return wg()
            fn(grid, block, args, smem, stream)
        tc = tc_run
    # split-K kernel (always built: the decode path, f32/f64, and the TC fallback)
    acc = "double" if F64 in (q.dt, k.dt, v.dt) else "float"
    accsz = 8 if acc == "double" else 4
    def split_shape(threads: int, loads: int):
        return sources.attn_split_shape(Dk, Dv, _attn_vec(k, Dk), _attn_vec(v, Dv), G * Sq, accsz, threads, loads)
    sh = split_shape(ATTN_THREADS, ATTN_LOADS)
    if sh is None:
        raise BackendError(f"cuda backend: attention head_dim {Dk}/{Dv} is too large (node %{b.node})")
    small = split_shape(*ATTN_SMALL_GRID) if B * KVH * -(-G * Sq // sh["ROWS"]) < b.sms else None
    if small is not None and small["TILE"] <= ATTN_MIN_CHUNK:       # (a wider tile: lanes idle, not measured)
        sh = small
    ROWS, NT = sh["ROWS"], sh["NT"]
    rows_needed = G * Sq
    rowblocks = (rows_needed + ROWS - 1) // ROWS
    blocks = B * KVH * rowblocks
    minchunk = max(ATTN_MIN_CHUNK, NT // sh["TPK"])
    # splits (the merge takes at most 64); each cuts the keys the rows may keep at run time
    nsplit = max(1, min(-(-ATTN_BLOCKS_PER_SM * b.sms // blocks), -(-max(Sk, 1) // minchunk), 64))
    src = sources.render(sources.ATTN_SPLIT, TQ=ctype(q.dt), TK=ctype(k.dt), TV=ctype(v.dt), ACC=acc,
                         TO=ctype(out.dt), DK=Dk, DV=Dv, **sh, **common)
    fn_s = b.kernel(src, "rlx_attn_split")
    pdt = F64 if acc == "double" else F32
    part_o = part_ml = counters = None            # one split writes the output itself
    if nsplit > 1:
        part_o = b.node_buffer((nsplit * B * H * Sq * Dv,), pdt, "attention partials (o)").arr
        part_ml = b.node_buffer((nsplit * B * H * Sq * 2,), pdt, "attention partials (m, l)").arr
        counters = b.counters(B * KVH * rowblocks)
    args_s = (q.arr, i64(qs[0]), i64(qs[1]), i64(qs[2]), k.arr, i64(ks[0]), i64(ks[1]), i64(ks[2]),
              v.arr, i64(vs[0]), i64(vs[1]), i64(vs[2]), mv, *[i64(s) for s in mst], pv.arr if pv else None,
              part_o, part_ml, i32(B), i32(H), i32(KVH), i32(Sq), i32(Sk), i32(minchunk), scale, cap,
              window, counters, out.arr, *ostr)
    grid_s = (B * KVH, rowblocks, nsplit)
    stream = b.stream

    def split():
        fn_s(grid_s, (NT,), args_s, 0, stream)
    decode_args = (b, q, k, v, mv, mst, pv, out, scale, cap, window, common)     # (the decode-row kernels)
    short = _short_attention(*decode_args) if acc == "float" else None
    # the decode kernel may do the step's RoPE (then it reads the rope's rows, not q) and the
    # output's elementwise reader (where the plan gave its output no bytes the kernel reads)
    takes = rope if rope is not None and _takes_rope(rope, q, k, v, pv, out) else None
    epi = AttnEpilogue.of(b, out) if acc == "float" and Sq == 1 else None
    if epi is not None and not all(_apart(epi.ey, t) for t in (
            *((takes.q, takes.k, takes.v) if takes is not None else (q,)), epi.ex)):
        epi = None
    folded = (_decode_attention(*decode_args, takes, epi) if acc == "float" and (takes or epi) is not None
              else None)
    decode = folded or (_decode_attention(*decode_args) if acc == "float" else None)
    if folded is not None and epi is not None:
        b.attn_epilogues[epi.node] = epi.taken
    first = rope.fallback if rope is not None else ()
    if tc is None and short is None and decode is None:
        for fn in first:
            b.add(fn)
        b.add(split)
    else:
        def dispatch():
            if tc is not None and CONFIG["tc_attention"]:
                run = tc
            elif short is not None and CONFIG["short_attention"]:
                run = short
            elif decode is not None and CONFIG["decode_attention"]:
                run = decode
            else:
                run = split
            if epi is not None:           # (read by the elementwise node's own step)
                epi.taken["done"] = run is folded
            if not (run is folded and takes is not None):
                for fn in first:
                    fn()
            run()
        b.add(dispatch)


def _wg_attention(b, a: dict, q: V, k: V, v: V, mv, mst, pv, out: V, common: dict):
    """A launch of sources.ATTN_WG (Hopper's wgmma: 128 query rows a block, two warpgroups)
    for 16-byte-aligned rows of head_dim 64, 128 or 256 on an sm_90 GPU, or None; K and V
    through tensor maps. FLUX's attention (4608 tokens, 24 heads x 128, bf16, H200): 0.473 ms
    against rlx_attn_tc's 0.885. Qwen3.5's (8 / 2 heads x 256, causal, bf16, H200) at 8k / 32k
    tokens: 0.682 / 8.34 ms against rlx_attn_tc's 1.13 / 14.2 and torch's flash SDPA 1.22 / 13.97
    (benchmarks/attn_gpu.py)."""
    B, H, Sq, D = q.shape
    KVH, Sk = k.shape[1], k.shape[2]
    oe = out.es
    if (D not in (64, 128, 256) or device.wgmma_missing(b.cc, b.hip) or oe[3] != 1
            or any(s % 2 for s in oe[:3]) or out.arr.data.ptr % 4):
        return None
    bn = sources.attn_wg_bn(D)
    box = (64, bn, 1, 1)
    try:                      # (a layout the copy engine cannot take, a broadcast head say: the mma.sync kernel)
        tk, tv = device.tensor_map(k.arr, box, "attention keys"), device.tensor_map(v.arr, box, "attention values")
    except BackendError:
        return None
    cap = int(float(a["softcap"]) != 0.0)
    whole = int(common["MASKKIND"] == 0 and common["MASKMODE"] == 0 and not cap and float(a["scale"]) > 0.0
                and Sk % bn == 0)
    keymask = int(common["MASKMODE"] == 1 and mst[2] == 0)     # (a padding mask: one row for every query)
    src = sources.attn_wg_source(D, T=ctype(q.dt), MMAT="bf16" if q.dt is BF16 else "f16", WHOLE=whole,
                                 CAP=cap, KEYMASK=keymask, **common)
    smem = sources.attn_wg_smem(D)
    fn = b.kernel(src, "rlx_attn_wg", smem)
    qs = q.es
    args = (q.arr, i64(qs[0]), i64(qs[1]), i64(qs[2]), tk, tv, mv, *[i64(s) for s in mst], pv.arr if pv else None,
            out.arr, i64(oe[0]), i64(oe[1]), i64(oe[2]), i32(B), i32(H), i32(KVH), i32(Sq), i32(Sk),
            f64(a["scale"]), f64(a["softcap"]), i32(a["window"]))
    grid, stream = (-(-Sq // 128), H, B), b.stream

    def run():
        fn(grid, (256,), args, smem, stream)
    return run


def _short_attention(b, q: V, k: V, v: V, mv, mst, pv, out: V, scale, cap, window, common: dict):
    """A launch of sources.ATTN_SHORT for one decode row per head over a KV cache that fits its
    shared memory, or None where it does not apply."""
    B, H, Sq, D = q.shape
    KVH, Sk = k.shape[1], k.shape[2]
    vd = D // 32 if D % 32 == 0 else 0
    if (Sq != 1 or b.hip or v.shape[3] != D or not vd or _attn_vec(v, D) % vd or out.es[3] != 1
            or B * KVH > 2 * b.sms):                  # more blocks than that: the split kernel's loads win
        return None
    sh = sources.attn_short_shape(H // KVH, D, Sk, _attn_vec(k, D))
    if sh is None:
        return None
    src = sources.render(sources.ATTN_SHORT, TQ=ctype(q.dt), TK=ctype(k.dt), TV=ctype(v.dt), TO=ctype(out.dt),
                         **sh, **common)
    fn = b.kernel(src, "rlx_attn_short")
    return _decode_row_launch(b, fn, (B * KVH,), sh["NT"], q, k, v, mv, mst, pv, out, scale, cap, window)


def _decode_row_launch(b, fn, grid, threads: int, q: V, k: V, v: V, mv, mst, pv, out: V, scale, cap, window,
                       more: tuple = ()):
    """The launch of a decode-row attention kernel (ATTN_SHORT, ATTN_DECODE: one argument list,
    then `more`: ATTN_DECODE's RoPE arguments)."""
    qs, ks, vs = q.es, k.es, v.es
    args = (q.arr, i64(qs[0]), i64(qs[1]), k.arr, i64(ks[0]), i64(ks[1]), i64(ks[2]), v.arr, i64(vs[0]),
            i64(vs[1]), i64(vs[2]), mv, i64(mst[0]), i64(mst[1]), i64(mst[3]),
            pv.arr if pv is not None else None, i32(q.shape[1]), i32(k.shape[1]), i32(k.shape[2]), scale, cap,
            window, out.arr, i64(out.es[0]), i64(out.es[1])) + more
    stream = b.stream

    def run():
        fn(grid, (threads,), args, 0, stream)
    return run


# ATTN_DECODE's RoPE arguments where it does no RoPE
NO_ROPE_ARGS = (None, i64(0), i64(0), None, i64(0), i64(0), None, None, None, None, i32(0), i32(0), None,
                None, np.float32(0), np.float32(0), np.float32(0), np.float32(0), None, i32(0))
NO_EPI_ARGS = (None, i64(0), i64(0), None, i64(0), i64(0))           # (nor its epilogue's)


def _decode_attention(b, q: V, k: V, v: V, mv, mst, pv, out: V, scale, cap, window, common: dict,
                      rope: AttnRope | None = None, epi: AttnEpilogue | None = None):
    """A launch of sources.ATTN_DECODE for one query row per head over a KV cache of at most
    ATTN_DECODE_KEYS positions on an sm_90+ GPU (a cluster of blocks per (batch row, kv head):
    sources.attn_decode_cluster), or None where it does not apply. rope: the kernel also does
    the step's RoPE (q: the rope's output, then rope.q the rows it ropes; `_takes_rope`); epi:
    it computes that node instead of writing out (ey apart from the rows it reads)."""
    B, H, Sq, D = q.shape
    KVH, Sk = k.shape[1], k.shape[2]
    vk = min(_attn_vec(k, D), _attn_vec(v, D))
    cl = sources.attn_decode_cluster(B * KVH, b.sms)
    if (Sq != 1 or device.cluster_missing(b.cc, b.hip) or v.shape[3] != D or out.es[3] != 1
            or Sk > sources.ATTN_DECODE_KEYS
            or (cl < sources.ATTN_DECODE_CLUSTER and not sources.ATTN_DECODE_SMALL_CLUSTERS)):
        return None
    pair = min(_attn_vec(k, D, 32), _attn_vec(v, D, 32)) == 2 * vk
    groups = sources.attn_decode_groups(H // KVH, B * KVH * cl, b.sms)     # (blocks of one group a kv head)
    G = H // KVH // groups
    rope_bytes = (G + 2) * D * k.arr.itemsize if rope is not None else 0
    sh = sources.attn_decode_shape(G, D, vk, pair, rope_bytes, cl)
    if sh is None:
        return None
    more, defines = NO_ROPE_ARGS, dict(sources.ATTN_DECODE_PLAIN)
    if epi is not None:
        defines.update(epi.source(out.dt))
    if rope is not None:
        norms = [m for m in (rope.qn, rope.kn) if m is not None]
        defines.update(ROPE=1, INTERLEAVED=int(rope.interleaved), TC=ctype(rope.cos.dt),
                       TN=ctype(norms[0].w.dt) if norms else "float")
        qw, qeo = _norm_args(rope.qn)
        kw, keo = _norm_args(rope.kn)
        more = (rope.k.arr, i64(rope.k.es[0]), i64(rope.k.es[1]), rope.v.arr, i64(rope.v.es[0]),
                i64(rope.v.es[1]), rope.kc.arr, rope.vc.arr, rope.cos.arr, rope.sin.arr,
                i32(rope.cos.shape[-1]), i32(len(rope.cos.shape) == 3), qw, kw, *qeo, *keo, b.r.err,
                i32(rope.err_node))
        q = rope.q
    src = sources.render(sources.ATTN_DECODE, TQ=ctype(q.dt), TK=ctype(k.dt), TV=ctype(v.dt),
                         TO=ctype(out.dt), QV=int(_attn_vec(q, D, 32) % sh["VK"] == 0),
                         HEADMASK=int(mst[1] != 0), **sh, **common, **defines)
    fn = b.kernel(src, "rlx_attn_decode")
    grid = (B * KVH, sh["CL"], groups)
    more += epi.args(B, H, D) if epi is not None else NO_EPI_ARGS
    return _decode_row_launch(b, fn, grid, sh["NT"], q, k, v, mv, mst, pv, out, scale, cap, window, more)


def _norm_args(m: RopeNorm | None) -> tuple:
    """A RopeNorm's weights and (eps, offset) as ATTN_DECODE's RoPE takes them (none: null, 0s)."""
    if m is None:
        return None, (np.float32(0), np.float32(0))
    return m.w.arr, (np.float32(m.eps), np.float32(m.off))


def _takes_rope(rope: AttnRope, q: V, k: V, v: V, pv: V | None, out: V) -> bool:
    """Whether the decode kernel can do `rope` for attention rows q, k, v into out: the caches
    its k and v (same bytes, same strides), its q the rope's output shape, pos the kv_write's,
    and out apart from every row and table it reads (the plan may give out the bytes of values
    whose last reader was the rope)."""
    return (pv is not None and pv.arr.data.ptr == rope.pos.arr.data.ptr and rope.q.shape == q.shape
            and all(a.arr.data.ptr == c.arr.data.ptr and a.es == c.es and a.shape == c.shape
                    for a, c in ((k, rope.kc), (v, rope.vc)))
            and all(_apart(out, t) for t in (rope.q, rope.k, rope.v, rope.cos, rope.sin)))


def _b_attention(b, n, ins, outs):
    a = n.a
    q, k, v, mask, pos = _split_attn(a, ins)
    _attention(b, a, q, k, v, mask, pos, outs[0], b.attn_ropes.pop(b.node, None))


def _rope(b, jobs: list, cos: V, sin: V, style: str, pos: V | None = None, node: int = 0,
          norms: list | None = None) -> None:
    """One launch for up to three jobs (x [B, H, S, D], out, rotate, at_pos) sharing B, S, D
    and the tables: out <- rope(x) (or x itself, rotate False); at_pos: out is a KV cache and
    the rows go to position pos[b] (the kv_write node `node`, named if the cache overflows);
    norms: per job a RopeNorm whose x the job's x is (normed as it is loaded), or None."""
    norms = norms or [None] * len(jobs)
    kept = [(j, m) for j, m in zip(jobs, norms) if j[0].size]
    if not kept:
        return
    jobs, norms = [j for j, _ in kept], [m for _, m in kept]
    c = b.contiguous(cos)
    s = b.contiguous(sin, c.dt)
    B, _, S, D = jobs[0][0].shape
    half = c.shape[-1]
    pos = b.contiguous(pos) if pos is not None else None
    if not any(norms) and _rope_vec(b, jobs, c, s, style, B, S, D, half):
        return
    nax = next((o.shape[2] for _, o, _, at in jobs if at), 0)
    tn = next((ctype(m.w.dt) for m in norms if m is not None), "float")
    src = sources.render(sources.ROPE, TX=ctype(jobs[0][0].dt), TC=ctype(c.dt), TO=ctype(jobs[0][1].dt),
                         ACC=acc_of(jobs[0][0].dt), INTERLEAVED=int(style == "interleaved"),
                         TP=ctype(pos.dt) if pos is not None else "int", TN=tn)
    fn = b.kernel(src, "rlx_rope")
    args = [c.arr, s.arr, i32(B), i32(S), i32(D), i32(half), i32(len(c.shape) == 3),
            pos.arr if pos is not None else None, i64(nax), b.r.err, i32(node)]
    for k in range(3):
        if k < len(jobs):
            (x, o, rot, at), m = jobs[k], norms[k]
            args += [x.arr, *[i64(v) for v in x.es], o.arr, *[i64(v) for v in o.es], i32(x.shape[1]),
                     i32(rot), i32(at)]
            args += ([b.contiguous(m.w).arr, i32(2 if m.whole else 1), np.float32(m.eps), np.float32(m.off)]
                     if m is not None else [None, i32(0), np.float32(0), np.float32(0)])
        else:
            args += [None, *[i64(0)] * 4, None, *[i64(0)] * 4, i32(0), i32(0), i32(0)]
            args += [None, i32(0), np.float32(0), np.float32(0)]
    rows = B * sum(x.shape[1] for x, _, _, _ in jobs) * S
    b.launch(fn, _grid(rows, b.sms, ROPE_ROWS), (32, ROPE_ROWS), args)


def _normed_jobs(b, jobs: list, norms: list) -> tuple:
    """(jobs, norms) for `_rope`: each job whose x is a RopeNorm's y (norms[k]) reads that
    norm's x instead, where the rope's view of y is the plain one and nothing the launch writes
    meets the bytes it reads (a later rope the launch absorbs may have been planned onto them;
    nodes before it cannot: RopeNorm.of took only an x alive until its rope); the norms that
    cannot be taken so get their own launches here (before the rope's)."""
    taken = [m.source(b, x) if m is not None else None for (x, *_), m in zip(jobs, norms)]
    written = [o for _, o, _, _ in jobs]
    tn = {m.w.dt for m, src in zip(norms, taken) if src is not None}
    fits = len(tn) <= 1 and all(_apart(src, w) for src in taken if src is not None for w in written)
    out_jobs, out_norms = [], []
    for job, m, src in zip(jobs, norms, taken):
        if m is not None and (src is None or not fits):
            m.add_unfused(b)
            src, m = None, None
        out_jobs.append((src, *job[1:]) if src is not None else job)
        out_norms.append(m)
    return out_jobs, out_norms


def _rope_vec(b, jobs: list, c: V, s: V, style: str, B: int, S: int, D: int, half: int) -> bool:
    """The launch of sources.ROPE_VEC where every job ropes 16-bit rows of unit element
    stride and 16-byte aligned starts, every element in a pair (prefill's q and k), else False."""
    if D != 2 * half or D % 16 or jobs[0][0].dt not in (BF16, F16) or jobs[0][1].dt not in (BF16, F16):
        return False
    for x, o, rot, at in jobs:
        if not rot or at or any(t.es[3] != 1 or t.arr.data.ptr % 16 or any(e % 8 for e in t.es[:3])
                                for t in (x, o)):
            return False
    per_row = (D if style == "interleaved" else half) // 8
    src = sources.render(sources.ROPE_VEC, TX=ctype(jobs[0][0].dt), TC=ctype(c.dt), TO=ctype(jobs[0][1].dt),
                         ACC="float", INTERLEAVED=int(style == "interleaved"))
    args = [c.arr, s.arr, i32(B), i32(S), i32(D), i32(half), i32(len(c.shape) == 3)]
    for k in range(3):
        if k < len(jobs):
            x, o, _, _ = jobs[k]
            args += [x.arr, *[i64(v) for v in x.es[:3]], o.arr, *[i64(v) for v in o.es[:3]], i32(x.shape[1])]
        else:
            args += [None, *[i64(0)] * 3, None, *[i64(0)] * 3, i32(0)]
    total = B * S * per_row * sum(x.shape[1] for x, _, _, _ in jobs)
    b.launch(b.kernel(src, "rlx_rope_vec"), _grid(total, b.sms), (256,), args)
    return True


def _into_cache(b, w: int, new: V):
    """(cache, pos) when kv_write node w can be done by writing `new`'s rows straight into its
    cache (same dtype, position axis 2), else None."""
    node = b.r.lir.graph.nodes[w]
    cache = b.vals[tuple(node.inputs[0])]
    if node.a["axis"] % 4 != 2 or cache.dt is not new.dt or len(cache.shape) != 4 or w in b.absorbed:
        return None
    return cache, b.vals[tuple(node.inputs[2])]


_QKV_OPS = ("rope", "kv_write", "reshape", "narrow", "expand")     # what a rope launch may span


def _b_rope(b, n, ins, outs):
    """A rope, plus what decode does next in the same launch: the k rope, writing k into the
    cache (its kv_write) and v into its cache: the nodes that follow, up to the first that
    cannot join (its inputs not built by earlier launches, other dtypes or shapes)."""
    nodes = b.r.lir.graph.nodes
    x, cos, sin = ins
    jobs, norms, pos, err_node = [], [], None, 0
    refs_of: list = []                     # per job: (its x, the value its readers read: AttnRope)

    def add(i, xv, out):
        nonlocal pos, err_node
        norms.append(b.rope_norms.pop(_view_root(b, tuple(nodes[i].inputs[0]))[0], None))
        refs_of.append((tuple(nodes[i].inputs[0]), (i, 0)))
        w = b.sole_consumer(i, "kv_write")
        # its kv_write done now: nothing in between may read the cache (only views, ropes, writes)
        if (w is not None and tuple(nodes[w].inputs[1]) == (i, 0)
                and all(nodes[t].op in _QKV_OPS for t in range(i + 1, w))
                and (got := _into_cache(b, w, out)) is not None):
            if pos is None or got[1] is pos:
                pos, err_node = got[1], err_node or w
                b.absorbed.add(w)
                return jobs.append((xv, got[0], True, True))
        jobs.append((xv, out, True, False))

    add(b.node, x, outs[0])
    written = {(b.node, 0)}                # values this launch makes: no job may read them
    for j in range(b.node + 1, len(nodes)):
        m = nodes[j]
        if m.op in _QKV_OPS[2:] or j in b.absorbed:
            continue
        if len(jobs) == 3 or m.op not in ("rope", "kv_write"):
            break
        refs = [tuple(r) for r in m.inputs]
        if not all(r in b.vals and r not in written for r in refs):
            break
        if m.op == "rope":
            xj = b.vals[refs[0]]
            if not (m.inputs[1:] == n.inputs[1:] and m.a["style"] == n.a["style"] and xj.dt is x.dt
                    and m.outs[0].dtype is n.outs[0].dtype and _same_bsd(xj, x)):
                break
            b.absorbed.add(j)
            written.add((j, 0))
            add(j, xj, b.out_value(j))
        else:
            new = b.vals[refs[1]]
            got = _into_cache(b, j, new)
            if not (got is not None and new.dt is x.dt and n.outs[0].dtype is new.dt and _same_bsd(new, x)
                    and (pos is None or got[1] is pos)):
                break
            pos, err_node = got[1], err_node or j
            b.absorbed.add(j)
            jobs.append((new, got[0], False, True))
            norms.append(None)
            refs_of.append((refs[1], (j, 0)))

    def launch():
        done, normed = _normed_jobs(b, jobs, norms)
        _rope(b, done, cos, sin, n.a["style"], pos, err_node, normed)
    fold = AttnRope.of(b, n, jobs, norms, refs_of, pos, err_node)
    if fold is None:
        launch()
    else:                    # (the attention's launch does it, or these where it cannot)
        b.attn_ropes[fold.attention] = attrs.evolve(fold, fallback=_collected(b, launch))


def _same_bsd(a: V, c: V) -> bool:
    """Same batch, sequence and head-dim sizes ([B, H, S, D] values; heads may differ)."""
    return len(a.shape) == len(c.shape) == 4 and (a.shape[0], a.shape[2], a.shape[3]) == (
        c.shape[0], c.shape[2], c.shape[3])


def _b_attn_block(b, n, ins, outs):
    a = n.a
    q, k, v, cos, sin, *rest = ins
    qr = b.node_buffer(q.shape, q.dt, "roped q")
    kr = b.node_buffer(k.shape, k.dt, "roped k")
    if _same_bsd(q, k) and q.dt is k.dt:
        _rope(b, [(q, qr, True, False), (k, kr, True, False)], cos, sin, a["style"])
    else:
        _rope(b, [(q, qr, True, False)], cos, sin, a["style"])
        _rope(b, [(k, kr, True, False)], cos, sin, a["style"])
    _, _, _, mask, pos = _split_attn(a, [q, k, v] + rest)
    _attention(b, a, qr, kr, v, mask, pos, outs[0])


def _b_mask_fill(b, n, ins, outs):
    a = n.a
    sc, *rest = ins
    mask = rest.pop(0) if a["has_mask"] else None
    pos = rest.pop(0) if a["has_pos"] else None
    out = outs[0]
    if out.size == 0:
        return
    B, H, Sq, Sk = sc.shape
    kind = MaskKind(a["mask_kind"])
    mk = {MaskKind.CAUSAL: 1, MaskKind.SLIDING_WINDOW: 2}.get(kind, 0)
    mv, mst, mmode, tm = _mask_args(b, mask, (B, H, Sq, Sk))
    pv = b.contiguous(pos) if pos is not None else None
    ss = sc.es
    src = sources.render(sources.MASK_FILL, TS=ctype(sc.dt), TM=tm, TP=ctype(pv.dt) if pv else "int",
                         TO=ctype(out.dt), ACC=acc_of(sc.dt), MASKKIND=mk, MASKMODE=mmode,
                         HAS_POS=int(pv is not None))
    fn = b.kernel(src, "rlx_mask_fill")
    b.launch(fn, _grid(out.size, b.sms), (256,), (sc.arr, *[i64(s) for s in ss], mv, *[i64(s) for s in mst],
                                                  pv.arr if pv else None, out.arr, i32(B), i32(H), i32(Sq),
                                                  i32(Sk), i32(a["window"])))


# ----------------------------------------------------------------------------- custom
def _b_custom(b, n, ins, outs):
    from rlx_core.ir.custom import custom_op

    op = custom_op(n.a["name"])
    fn = op.kernels.get("cuda")
    if fn is None:
        raise BackendError(f"cuda backend has no kernel for custom op {n.a['name']!r}")
    params = dict(n.a["params"])
    arrays = [x.arr for x in ins]
    cp = b.cp
    stream = b.stream

    def run():
        with stream:
            res = fn(*arrays, **params)
            res = res if isinstance(res, tuple) else (res,)
            for o, r in zip(outs, res):
                o.arr[...] = cp.asarray(r).astype(o.arr.dtype, copy=False)
    b.add(run, capturable=False)


BUILDERS = {
    "matmul": _b_matmul,
    "binary": _ew, "compare": _ew, "where": _ew, "activation": _ew, "cast": _ew,
    "fused_swiglu": _ew, "fused_elementwise": _ew,
    "fft": build_fft, "ifft": build_fft, "rfft": build_fft, "irfft": build_fft,
    "reduce": _b_reduce,
    "softmax": _b_softmax,
    "layer_norm": _b_layer_norm,
    "rms_norm": _b_rms_norm,
    "rope": _b_rope,
    "attention": _b_attention,
    "mask_fill": _b_mask_fill,
    "gather": _b_gather,
    "transpose": _b_transpose,
    "concat": _b_concat,
    "cumsum": _b_cumsum,
    "topk": _b_topk,
    "argmax": _b_argmax,
    "custom": _b_custom,
    "fused_matmul_bias_act": _b_mba,
    "fused_residual_rms_norm": _b_res_rms,
    "fused_residual_ln": _b_res_ln,
    "fused_attention_block": _b_attn_block,
    "softmax_grad": _b_softmax_grad,
    "rms_norm_grad": _b_rms_norm_grad,
    "layer_norm_grad": _b_layer_norm_grad,
    "dequant_matmul": _b_dequant_matmul,
    "dequantize": _b_dequantize,
    "quantize": _b_host,
    "fake_quantize": _b_fake_quantize,
    "all_reduce": _b_collective, "all_gather": _b_collective, "reduce_scatter": _b_collective,
}

VIEW_BUILDERS = {
    "reshape": _v_reshape,
    "narrow": _v_narrow,
    "expand": _v_expand,
    "kv_write": _v_kv_write,
    "assign": _v_assign,
    "transpose": _v_transpose,         # where the plan made it a view (planned_layouts)
}

__all__ = ["BUILDERS", "VIEW_BUILDERS", "STRIDED_WRITERS", "planned_layouts", "owner_chain", "part_layout"]
