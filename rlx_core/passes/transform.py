"""Passes that change what is bound rather than what is computed: hoisting param-only
subgraphs to load time, and the compute-precision rewrite."""
from __future__ import annotations


from ..ir.dtype import DType
from ..ir.graph import Builder, Graph
from ..ir.ops import get_op
from ..ir.rewrite import copy_node, rewrite

HOISTED = "__hoisted."


def hoist_params(g: Graph) -> tuple:
    """Split off nodes computed only from params and constants (a concat of weights, a
    transposed weight) into a prologue graph run once when params are bound. The main graph
    keeps only the params it reads (the prologue holds every param, so the binding contract
    stays), so a weight only the prologue reads is not kept resident.
    Returns (main graph, prologue graph or None)."""
    pure: set = set()
    for i, n in enumerate(g.nodes):
        if n.op in ("param", "constant"):
            pure.add(i)
        elif n.op not in ("input", "state") and not get_op(n.op).effect and n.inputs and \
                all(r[0] in pure for r in n.inputs):
            pure.add(i)
    computed = {i for i in pure if g.nodes[i].op not in ("param", "constant")}
    consumers = g.consumers()
    frontier = [(i, k) for i in sorted(computed) for k in range(len(g.nodes[i].outs))
                if any(c not in computed for c in consumers.get((i, k), ()))]
    if not frontier:
        return g, None
    pro = Builder(g.name + ".prologue", g.level)
    pro.constants = dict(g.constants)
    pmap: dict = {}
    for i, n in enumerate(g.nodes):
        if i not in pure:
            continue
        out = copy_node(pro, n, [pmap[tuple(r)] for r in n.inputs])
        for k, v in enumerate(out if isinstance(out, tuple) else (out,)):
            pmap[(i, k)] = v
    names = {ref: f"{HOISTED}{n}" for n, ref in enumerate(frontier)}
    for ref, name in names.items():
        pro.output(name, pmap[ref])
    prologue = pro.build()

    def replace(m, node, ins, i, lookup):
        if i not in computed:
            return None
        vals = []
        for k, s in enumerate(node.outs):
            if (i, k) in names:
                v = m.param(names[(i, k)], s.dims, s.dtype)
            else:
                v = None
            vals.append(v)
        if all(v is None for v in vals):
            return copy_node(m, node, ins)     # dead after the split; DCE drops it
        if any(v is None for v in vals):
            real = copy_node(m, node, ins)
            real = real if isinstance(real, tuple) else (real,)
            vals = [v or r for v, r in zip(vals, real)]
        return tuple(vals) if len(vals) > 1 else vals[0]

    from .generic import dce

    return dce(rewrite(g, replace), keep=("input", "state")), prologue   # (params: the prologue binds them all)


def to_precision(g: Graph, compute: DType) -> Graph:
    """Run the graph in `compute` (f16/bf16): float params, states and constants change
    dtype (params are converted when bound), float inputs are cast on entry and outputs
    cast back, so the binding contract keeps its dtypes."""
    if compute is DType.F32:
        return g
    floats = (DType.F32, DType.F64, DType.F16, DType.BF16)

    def replace(m, node, ins, i, lookup):
        s = node.outs[0] if node.outs else None
        if node.op in ("param", "state") and s.dtype in floats and s.dtype is not compute:
            return m._leaf_add(node.op, node.name, s.dims, compute)
        if node.op == "constant" and s.dtype in floats and s.dtype is not compute and s.dims:
            m.constants[node.name] = m.constants[node.name].astype(compute.np)
            return m.emit_node(type(node)(node.op, (), tuple(sorted({**node.a, "dtype": compute.value}.items())),
                                          (s.with_dtype(compute),), node.name))
        if node.op == "input" and s.dtype in floats and s.dtype is not compute:
            return m.cast(copy_node(m, node, []), compute)
        if node.op == "dequantize" and s.dtype in floats and s.dtype is not compute:
            return m.add("dequantize", tuple(ins), scheme=node.a["scheme"], dtype=compute.value)
        return None

    out = rewrite(g, replace)
    m = Builder(out.name, out.level)
    m.nodes, m.constants = list(out.nodes), dict(out.constants)
    m.outputs = []
    for (name, r), (_, r0) in zip(out.outputs, g.outputs):
        want = g.shape_of(r0).dtype
        v = m.value(r)
        m.outputs.append((name, (m.cast(v, want) if v.dtype is not want else v).ref))
    return m.build()
