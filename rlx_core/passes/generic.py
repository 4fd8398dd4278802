"""Generic passes: dead-code elimination, common-subexpression elimination, constant folding."""
from __future__ import annotations

import attrs
import numpy as np

from ..ir.control import map_bodies
from ..ir.graph import Graph
from ..ir.numpy_kernels import KERNELS, VIEWS
from ..ir.ops import get_op
from ..ir.rewrite import copy_node, rewrite


def leaves_first(g: Graph) -> Graph:
    """Move inputs, params, states and constants to the front (stable order), so passes may
    use any leaf at any point; blocks declare weights lazily, next to their first use."""
    leaf = [i for i, n in enumerate(g.nodes) if not n.inputs and get_op(n.op).level.value == "leaf"]
    order = leaf + [i for i in range(len(g.nodes)) if i not in set(leaf)]
    if order == list(range(len(g.nodes))):
        return g
    new_id = {old: k for k, old in enumerate(order)}
    nodes = tuple(attrs.evolve(g.nodes[i], inputs=tuple((new_id[r[0]], r[1]) for r in g.nodes[i].inputs))
                  for i in order)
    outputs = tuple((name, (new_id[r[0]], r[1])) for name, r in g.outputs)
    return Graph(g.name, g.level, nodes, outputs, g.constants)


LEAVES = ("input", "param", "state")


def dce(g: Graph, keep: tuple = LEAVES) -> Graph:
    """Drop nodes no output or side effect needs. Leaves of the kinds in `keep` stay even
    unused, so the binding contract of the graph does not change (a graph cut down to some
    of its outputs keeps none: it binds only what those read)."""
    g = map_bodies(g, dce)            # control-flow bodies (their inputs are kept: signature)
    live = {r[0] for _, r in g.outputs}
    for i in range(len(g.nodes) - 1, -1, -1):
        n = g.nodes[i]
        if n.op in keep or get_op(n.op).effect:
            live.add(i)
        if i in live:
            live.update(r[0] for r in n.inputs)
    if len(live) == len(g.nodes):
        return g
    keep = sorted(live)
    new_id = {old: k for k, old in enumerate(keep)}
    nodes = tuple(attrs.evolve(g.nodes[i], inputs=tuple((new_id[r[0]], r[1]) for r in g.nodes[i].inputs))
                  for i in keep)
    outputs = tuple((name, (new_id[r[0]], r[1])) for name, r in g.outputs)
    used = {g.nodes[i].name for i in keep if g.nodes[i].op == "constant"}
    return Graph(g.name, g.level, nodes, outputs, {k: v for k, v in g.constants.items() if k in used})


def cse(g: Graph) -> Graph:
    """Merge nodes with the same op, inputs and attrs (leaves and effects excluded)."""
    g = map_bodies(g, cse)                                     # control-flow bodies
    seen: dict = {}

    def replace(m, node, ins, i, lookup):
        d = get_op(node.op)
        if d.level.value == "leaf" or d.effect:
            return None
        key = (node.op, tuple(v.ref for v in ins), node.attrs)
        if key in seen:
            return seen[key]
        out = copy_node(m, node, ins)
        seen[key] = out
        return out

    return rewrite(g, replace)


def const_fold(g: Graph, max_bytes: int = 1 << 24) -> Graph:
    """Evaluate nodes whose inputs are all constants with the NumPy kernels."""
    g = map_bodies(g, lambda body: const_fold(body, max_bytes))  # control-flow bodies
    def replace(m, node, ins, i, lookup):
        d = get_op(node.op)
        if d.level.value == "leaf" or d.effect or node.op == "custom" or not ins:
            return None
        if not all(m.nodes[v.ref[0]].op == "constant" for v in ins):
            return None
        if not all(s.is_static for s in node.outs) or sum(s.nbytes() for s in node.outs) > max_bytes:
            return None
        arrays = [m.constants[m.nodes[v.ref[0]].name] for v in ins]
        if node.op in VIEWS:
            res = [np.ascontiguousarray(VIEWS[node.op](node.a, *arrays))]
        else:
            res = [np.empty(s.dims, s.dtype.np) for s in node.outs]
            KERNELS[node.op](node.a, res, *arrays)
        vals = tuple(m.constant(r, dtype=s.dtype) for r, s in zip(res, node.outs))
        return vals[0] if len(vals) == 1 else vals

    return rewrite(g, replace)
