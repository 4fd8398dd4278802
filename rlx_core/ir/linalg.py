"""`dense_solve`: a batched linear solve A x = b, like `jax.numpy.linalg.solve`.

a is [..., n, n]; b is [..., n, k] (a matrix right-hand side, same batch dims) or [..., n]
(one vector per matrix: b's rank is a's minus one). The NumPy kernel is LAPACK's gesv
through numpy.linalg.solve (which computes in f64); numba inherits it; cuda calls
cupy.linalg.solve; opencl has a batched LU kernel (partial pivoting, f64 where the device
has it). Its VJP (ir/autodiff.py): grad_b = solve(A^T, g), grad_A = -grad_b x^T.
"""
from __future__ import annotations

import numpy as np

from .composites import argmax_prims, composite, ex, in_f32, iota
from .errors import DTypeError, ShapeError
from .numpy_kernels import KERNELS, put, up
from .ops import op
from .shape import Shape


def _same(x, y) -> bool:
    return x == y or isinstance(x, str) or isinstance(y, str)


@op("dense_solve", ["a", "b"])
def _m_dense_solve(s, a_):
    """x with a @ x = b: a [..., n, n]; b [..., n, k] or [..., n] (then x is a vector per matrix)."""
    a, b = s
    if not a.dtype.is_float or a.dtype is not b.dtype:
        raise DTypeError(f"a and b must be the same float dtype, got a {a}, b {b}")
    if a.rank < 2 or not _same(a.dims[-1], a.dims[-2]):
        raise ShapeError(f"a must be square matrices [..., n, n], got {a}")
    vector = b.rank == a.rank - 1
    if not vector and b.rank != a.rank:
        raise ShapeError(f"b must be [..., n, k] or [..., n] with a's batch dims {a.dims[:-2]}, got {b}")
    rows = b.dims[-1] if vector else b.dims[-2]
    batch = b.dims[:-1] if vector else b.dims[:-2]
    if not _same(rows, a.dims[-1]) or len(batch) != len(a.dims[:-2]) or \
            not all(_same(x, y) for x, y in zip(batch, a.dims[:-2])):
        raise ShapeError(f"b {b} does not fit a {a}: expected b [{', '.join(map(str, a.dims[:-1]))}"
                         f"{'' if vector else ', k'}]")
    return (Shape(b.dims, b.dtype),)


def _dense_solve(a_, out, a, b):
    x, y = up(a), up(b)
    vector = b.ndim == a.ndim - 1
    r = np.linalg.solve(x, y[..., None] if vector else y)
    put(out[0], r[..., 0] if vector else r)


KERNELS["dense_solve"] = _dense_solve


# ----------------------------------------------------------------- the composite
def dense_solve_prims(m, a, b):
    """Gauss-Jordan elimination with partial pivoting on [a | b], unrolled over a static n,
    in f32 (f64 for f64): per column, the row of the largest |entry| at or below the diagonal
    is swapped up (a one-hot permutation matmul, per batch), scaled to a pivot of 1 and
    subtracted from every other row. What is left right of a is x."""
    n = a.dims[-1]
    if not isinstance(n, int):
        raise ShapeError(f"dense_solve's composite needs a static n, got a {a.shape}: a backend "
                         f"without a dense_solve kernel solves only static sizes")
    vector = b.shape.rank == a.shape.rank - 1
    rhs = in_f32(m, m.reshape(b, b.dims + (1,)) if vector else b)
    work = m.concat([in_f32(m, a), m.cast(rhs, in_f32(m, a).dtype)], -1)     # [..., n, n + k]
    rows = m.reshape(iota(m, n, a), (n, 1))                              # [n, 1]
    cols = m.reshape(rows, (1, n))
    for c in range(n):
        size = m.act(m.narrow(work, -1, c, 1), "abs")                   # [..., n, 1]
        size = m.where(m.compare(rows, c, "ge"), size, -1.0)
        p = argmax_prims(m, size, -2, keepdims=True)                     # [..., 1, 1]
        src = m.where(m.compare(rows, c, "eq"), p, m.where(m.compare(rows, p, "eq"), c, rows))
        work = m.matmul(m.cast(m.compare(cols, src, "eq"), work.dtype), work)
        pivot_row = m.narrow(work, -2, c, 1)
        pivot_row = pivot_row / m.narrow(pivot_row, -1, c, 1)
        below = work - m.narrow(work, -1, c, 1) * pivot_row
        work = m.where(m.compare(rows, c, "eq"), pivot_row, below)
    x = m.narrow(work, -1, n, work.dims[-1] - n)
    return m.cast(m.reshape(x, b.dims) if vector else x, b.dtype)


@composite("dense_solve", ex("f16[2,3,3]", "f16[2,3]"), ex("f32[3,3]", "f32[3,2]"))
def _dense_solve_composite(m, ins, a):
    return dense_solve_prims(m, *ins)
