"""`dot_general`: a contraction with batch and contracting dims, like `jax.lax.dot_general`.

The output is (batch dims, lhs free dims, rhs free dims) in that order, free dims in their
input order. `matmul` stays the common case; a backend without a `dot_general` kernel gets
it legalized into transpose + reshape + matmul (`dot_general_prims`), which is also what
the NumPy kernel computes, so BLAS does the work either way.
"""
from __future__ import annotations

import math

import numpy as np

from .dtype import promote
from .errors import GraphError, ShapeError
from .composites import composite, ex
from .numpy_kernels import KERNELS, put, up
from .ops import INTS, op
from .shape import Shape

_DIMS = ("lhs_contract", "rhs_contract", "lhs_batch", "rhs_batch")


def _check_axes(name: str, axes: tuple, rank: int) -> tuple:
    for x in axes:
        if not 0 <= x < rank:
            raise ShapeError(f"dot_general {name} axis {x} out of range for rank {rank}")
    if len(set(axes)) != len(axes):
        raise ShapeError(f"dot_general {name} {axes} repeats an axis")
    return axes


def dims_of(lhs: Shape, rhs: Shape, a: dict) -> tuple:
    """(lhs_contract, rhs_contract, lhs_batch, rhs_batch, lhs_free, rhs_free), checked."""
    lc, rc, lb, rb = (tuple(a[k]) for k in _DIMS)
    for nm, ax, s in (("lhs_contract", lc, lhs), ("rhs_contract", rc, rhs),
                      ("lhs_batch", lb, lhs), ("rhs_batch", rb, rhs)):
        _check_axes(nm, ax, s.rank)
    if len(lc) != len(rc):
        raise ShapeError(f"dot_general lhs_contract {lc} and rhs_contract {rc} differ in length")
    if len(lb) != len(rb):
        raise ShapeError(f"dot_general lhs_batch {lb} and rhs_batch {rb} differ in length")
    for side, c, b in (("lhs", lc, lb), ("rhs", rc, rb)):
        if set(c) & set(b):
            raise ShapeError(f"dot_general {side} axes {sorted(set(c) & set(b))} are both batch "
                             "and contracting")
    for kind, xs, ys in (("contracting", lc, rc), ("batch", lb, rb)):
        for x, y in zip(xs, ys):
            dx, dy = lhs.dims[x], rhs.dims[y]
            if dx != dy and not (isinstance(dx, str) or isinstance(dy, str)):
                raise ShapeError(f"dot_general {kind} dims differ: lhs axis {x} ({dx}) vs rhs "
                                 f"axis {y} ({dy}) of {lhs} and {rhs}")
    lf = tuple(i for i in range(lhs.rank) if i not in lc and i not in lb)
    rf = tuple(i for i in range(rhs.rank) if i not in rc and i not in rb)
    return lc, rc, lb, rb, lf, rf


@op("dot_general", ["lhs", "rhs"], attrs={k: INTS(()) for k in _DIMS})
def _m_dot_general(s, a):
    """Contract lhs and rhs over paired contracting axes, batched over paired batch axes
    (jax.lax.dot_general); out = batch dims + lhs free dims + rhs free dims."""
    lhs, rhs = s
    lc, rc, lb, rb, lf, rf = dims_of(lhs, rhs, a)
    dims = tuple(lhs.dims[i] for i in lb) + tuple(lhs.dims[i] for i in lf) + tuple(rhs.dims[i] for i in rf)
    return (Shape(dims, promote(lhs.dtype, rhs.dtype)),)


def _merged(dims: tuple, what: str):
    """The product of `dims` as one dim; a symbol survives only alone."""
    if len(dims) == 1:
        return dims[0]
    if any(isinstance(d, str) for d in dims):
        raise GraphError(f"dot_general: cannot merge {what} dims {dims} holding a symbol into one "
                         "matmul dim; bind the symbols first (specialize)")
    return math.prod(dims)


def _as_matmul(lhs_dims, rhs_dims, a):
    """The permutations and the [batch.., M, K] / [batch.., K, N] shapes of the matmul form."""
    ls = Shape(lhs_dims, "f32")
    rs = Shape(rhs_dims, "f32")
    lc, rc, lb, rb, lf, rf = dims_of(ls, rs, a)
    batch = tuple(lhs_dims[i] for i in lb)
    m = _merged(tuple(lhs_dims[i] for i in lf) or (1,), "lhs free")
    k = _merged(tuple(lhs_dims[i] for i in lc) or (1,), "contracting")
    n = _merged(tuple(rhs_dims[i] for i in rf) or (1,), "rhs free")
    out = batch + tuple(lhs_dims[i] for i in lf) + tuple(rhs_dims[i] for i in rf)
    return lb + lf + lc, rb + rc + rf, batch + (m, k), batch + (k, n), out


def _identity(perm: tuple) -> bool:
    return perm == tuple(range(len(perm)))


def dot_general_prims(m, lhs, rhs, **a):
    """transpose + reshape + matmul + reshape: the legalization for backends without a kernel."""
    lp, rp, l3, r3, out = _as_matmul(lhs.dims, rhs.dims, a)
    x = lhs if _identity(lp) else m.transpose(lhs, lp)
    y = rhs if _identity(rp) else m.transpose(rhs, rp)
    return m.reshape(m.matmul(m.reshape(x, l3), m.reshape(y, r3)), out)


def _dot_general(a, out, x, y):
    lp, rp, l3, r3, shape = _as_matmul(x.shape, y.shape, a)
    o = out[0]
    xs = up(x).transpose(lp).reshape(l3)
    ys = up(y).transpose(rp).reshape(r3)
    if o.dtype != xs.dtype or o.dtype != ys.dtype:
        xs, ys = xs.astype(np.result_type(xs, ys)), ys.astype(np.result_type(xs, ys))
    put(o, np.matmul(xs, ys).reshape(shape))


KERNELS["dot_general"] = _dot_general
@composite("dot_general", ex("f16[2,3,4]", "f16[2,4,5]", lhs_contract=(2,), rhs_contract=(1,),
                             lhs_batch=(0,), rhs_batch=(0,)),
           ex("f32[4,3]", "f32[5,4]", lhs_contract=(0,), rhs_contract=(1,)))
def _dot_general_composite(m, ins, a):
    return dot_general_prims(m, *ins, **a)
