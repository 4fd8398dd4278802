"""The primitive ops, in NumPy: each kernel is `fn(attrs, *inputs) -> result` (a tuple for an
op of several outputs). A view kernel (VIEWS) returns a view of its first input, or writes into
it in place and returns it (kv_write, assign); the runner copies any other result into the
node's buffer.

f16 and bf16 compute in f32 (`up`) and round once, when the result is copied out. The
formulas of the elementwise ops are core's expression table (rlx_core.ir.expr) rendered for
NumPy, as the NumPy backend has them (`rlx_core.ir.numpy_kernels`: ACT, BIN, CMP): one
definition of each.
"""
from __future__ import annotations

import numpy as np

from rlx_core.ir.dtype import BF16, F16, DType
from rlx_core.ir.errors import ModelError
from rlx_core.ir.numpy_kernels import ACT, BIN, BIN_INT, CMP
from rlx_core.ir.quant import QuantScheme

LOW = (F16.np, BF16.np)


def up(x):
    """f16 / bf16 as f32; anything else as it is."""
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype in LOW else x


def axis_of(a: dict, x) -> int:
    return a["axis"] % x.ndim


# --- elementwise
def binary(a, x, y):
    x, y = up(x), up(y)
    ints = np.result_type(x, y).kind in "iub"        # integer formulas (div floors)
    return (BIN_INT if ints else BIN)[a["op"]](x, y)


def activation(a, x):
    return ACT[a["fn"]](up(x))


# --- reductions and scans
REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


def reduce(a, x):
    axes = (a["axes"],) if isinstance(a["axes"], int) else tuple(a["axes"])
    return REDUCE[a["op"]](up(x), axis=tuple(ax % x.ndim for ax in axes) if x.ndim else None,
                           keepdims=a["keepdims"])


# --- data movement
def gather(a, table, idx):
    ax = axis_of(a, table)
    n = table.shape[ax]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise ModelError(f"gather: index out of range [0, {n}) (min {idx.min()}, max {idx.max()})")
    return np.take(table, idx, axis=ax)


def narrow(a, x):
    ax = axis_of(a, x)
    start = a["start"] + x.shape[ax] if a["start"] < 0 else a["start"]
    return x[(slice(None),) * ax + (slice(start, start + a["length"]),)]


# --- state, written in place
def kv_write(a, cache, new, pos):
    """new [B, .., S, ..] into cache at pos[b] along `axis`, for each row b."""
    ax = axis_of(a, cache)
    s = new.shape[ax]
    if ax == 0:
        raise ModelError("kv_write: axis 0 is the batch axis")
    pos = pos.astype(np.int64)
    if pos.size and (pos.min() < 0 or pos.max() + s > cache.shape[ax]):
        raise ModelError(f"kv_write: writing {s} entries at position {int(pos.max())} overflows the "
                         f"cache of length {cache.shape[ax]} (context full)")
    for b, p in enumerate(pos):
        cache[(b,) + (slice(None),) * (ax - 1) + (slice(p, p + s),)] = new[b]
    return cache


def assign(a, state, value):
    state[...] = value
    return state


# --- packed weights
def dequantize(a, raw):
    q = QuantScheme.parse(a["scheme"])
    k = raw.shape[-1] // q.bytes_per_block * q.block_size
    return q.dequantize(raw, raw.shape[:-1] + (k,), dtype=DType.parse(a["dtype"]).np)


KERNELS = {
    "binary": binary,
    "activation": activation,
    "compare": lambda a, x, y: CMP[a["op"]](x, y),
    "where": lambda a, c, x, y: np.where(c, x, y),
    # the copy out converts; a complex value cast to a real dtype keeps its real part
    "cast": lambda a, x: np.real(x) if np.iscomplexobj(x) and not DType.parse(a["dtype"]).is_complex else x,
    "reduce": reduce,
    "cumsum": lambda a, x: np.cumsum(up(x), axis=a["axis"]),
    "matmul": lambda a, x, y: np.matmul(up(x).swapaxes(-1, -2) if a["trans_a"] else up(x),
                                        up(y).swapaxes(-1, -2) if a["trans_b"] else up(y)),
    "gather": gather,
    "concat": lambda a, *xs: np.concatenate(xs, axis=a["axis"]),
    "transpose": lambda a, x: x.transpose(a["perm"]),
    "dequantize": dequantize,
}

VIEWS = {
    "reshape": lambda a, x: x.reshape(a["shape"]),
    "narrow": narrow,
    "expand": lambda a, x: np.broadcast_to(x, a["shape"]),
    "kv_write": kv_write,
    "assign": assign,
}

PRIMITIVES = frozenset(KERNELS) | frozenset(VIEWS)
