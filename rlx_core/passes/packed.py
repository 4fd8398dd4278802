"""Packed weights: a param marked with a quant scheme becomes its packed bytes, and every use
reads them through the op that can.

In the HIR a packed weight is an ordinary float param of its logical shape [N, K] with a
`scheme` attr, so blocks, metas and printing need nothing special. This pass (MIR, before
fusion) turns it into the bytes the checkpoint holds, u8 [N, bytes_per_row(K)] (a stack of
three or more dims keeps its leading dims: [E, N, bytes], as a PackedTensor binds it), and
rewrites its consumers: `x @ W^T` (plain or with a bias/activation epilogue) becomes
`dequant_matmul`, routed experts (moe_experts) read packed stacks with their `schemes` set, an
embedding lookup gathers packed rows and dequantizes only those, and any other use
dequantizes the whole weight (correct, at the cost of a float copy).
"""
from __future__ import annotations

import weakref

import numpy as np

from ..ir.graph import Graph
from ..ir.moe import INT8_BLOCK, INT8_SCHEME
from ..ir.quant import PackedTensor, QuantScheme
from ..ir.rewrite import copy_node, rewrite


def packed_params(g: Graph) -> dict:
    """node id -> QuantScheme of every param still in its logical (float) form."""
    return {i: QuantScheme.parse(n.a["scheme"]) for i, n in enumerate(g.nodes)
            if n.op == "param" and n.a.get("scheme") and n.outs[0].dtype.is_float}


def packed_dims(dims: tuple, scheme: QuantScheme, name: str | None) -> tuple:
    """The packed bytes' dims of a weight of logical `dims` (..., K): [rows, bytes per row]
    for a matrix (or a vector: one row), the leading dims kept for a stack of three or more."""
    rows, row_bytes = scheme.packed_shape(dims, name)
    return tuple(dims[:-1]) + (row_bytes,) if len(dims) > 2 else (rows, row_bytes)


# each packed stack's [E, rows, bytes] view of its PackedTensor's bytes, made once while the
# PackedTensor lives: executables sharing the weight (a model's prefill and decode) then bind
# the same array, and the upload cache (keyed on its id) holds it once
_STACK_VIEWS: "weakref.WeakKeyDictionary[PackedTensor, np.ndarray]" = weakref.WeakKeyDictionary()


def packed_bytes(w: PackedTensor) -> np.ndarray:
    """What a packed param binds: `w`'s bytes, in the param's dims (`packed_dims`)."""
    dims = packed_dims(w.shape, w.scheme, w.name)
    if w.raw.shape == dims:
        return w.raw
    view = _STACK_VIEWS.get(w)
    if view is None:
        view = _STACK_VIEWS[w] = w.raw.reshape(dims)
    return view


def in_blocks(k) -> bool:
    """A static width that int8 blocks of 32 tile."""
    return isinstance(k, int) and k % INT8_BLOCK == 0


def pack_params(g: Graph, activations: str = "f32") -> Graph:
    """`activations="int8"`: each dequant_matmul's x, and the x and intermediate h of routed
    experts with packed stacks, are rounded through int8 blocks of 32 (a fake_quantize to
    int8_b32; moe_experts' int8_h), which a backend may multiply as integers."""
    packed = packed_params(g)
    if not packed:
        return g

    def is_packed(ref) -> bool:
        return ref[0] in packed

    def replace(m, node, ins, i, lookup):
        if i in packed:
            dims = packed_dims(node.outs[0].dims, packed[i], node.name)
            return m.add("param", (), _leaf_name=node.name, shape=dims, dtype="u8", scheme=packed[i].name)
        refs = [tuple(r) for r in node.inputs]
        if not any(is_packed(r) for r in refs):
            return None
        a = node.a
        w = refs[1] if len(refs) > 1 else None
        if node.op in ("matmul", "fused_matmul_bias_act") and is_packed(w) and not is_packed(refs[0]) \
                and a.get("trans_b") and not a.get("trans_a") and ins[1].shape.rank == 2:
            x = ins[0]
            k = x.shape.dims[-1]
            if activations == "int8" and in_blocks(k):
                x = m.add("fake_quantize", (x,), scheme=INT8_SCHEME)
            return m.add("dequant_matmul", (x, *ins[1:]), scheme=packed[w[0]].name,
                         act=a.get("act", "identity"))
        if node.op == "moe_experts" and not any(is_packed(r) for r in refs[:3]):
            schemes = tuple(packed[r[0]].name if is_packed(r) else sch
                            for r, sch in zip(refs[3:], a["schemes"]))
            x, hidden, inter = ins[0], ins[0].dims[-1], g.nodes[refs[5][0]].outs[0].dims[-1]
            if activations == "int8" and schemes[0] and schemes[1] and in_blocks(hidden):
                x = m.add("fake_quantize", (x,), scheme=INT8_SCHEME)
            int8_h = activations == "int8" and bool(schemes[2]) and in_blocks(inter)
            return m.add("moe_experts", (x, *ins[1:]), act=a["act"], schemes=schemes,
                         int8_h=a["int8_h"] or int8_h)
        if node.op == "gather" and is_packed(refs[0]) and a["axis"] == 0:
            rows = m.gather(ins[0], ins[1])
            return m.add("dequantize", (rows,), scheme=packed[refs[0][0]].name,
                         dtype=g.nodes[refs[0][0]].outs[0].dtype.value)
        floats = [m.add("dequantize", (v,), scheme=packed[r[0]].name,
                        dtype=g.nodes[r[0]].outs[0].dtype.value) if is_packed(r) else v
                  for r, v in zip(refs, ins)]
        return copy_node(m, node, floats)

    return rewrite(g, replace)


__all__ = ["pack_params", "packed_params", "packed_dims", "packed_bytes"]
