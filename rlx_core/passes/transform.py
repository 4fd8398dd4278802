"""Passes that change what is bound rather than what is computed: hoisting param-only
subgraphs to load time, and the compute-precision rewrite."""
from __future__ import annotations

import numpy as np

from ..ir.dtype import DType
from ..ir.graph import Builder, Graph
from ..ir.ops import get_op, step_dtypes
from ..ir.rewrite import copy_node, rewrite

HOISTED = "__hoisted."


def hoist_params(g: Graph) -> tuple:
    """Split off nodes computed only from params and constants (a concat of weights, a
    transposed weight) with static shapes (a constant expanded to [batch, seq] waits for the
    binding) into a prologue graph run once when params are bound. The main graph
    keeps only the params it reads (the prologue holds every param, so the binding contract
    stays), so a weight only the prologue reads is not kept resident.
    Returns (main graph, prologue graph or None)."""
    pure: set = set()
    for i, n in enumerate(g.nodes):
        if n.op in ("param", "constant"):
            pure.add(i)
        elif n.op not in ("input", "state") and not get_op(n.op).effect and n.inputs and \
                all(r[0] in pure for r in n.inputs) and all(s.is_static for s in n.outs):
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


def params_as_inputs(g: Graph, names=None) -> Graph:
    """`g` with params `names` (default: all) turned into inputs of the same name, shape and
    dtype: a training step feeds the weights it updates with every run instead of binding
    them once."""
    keep = None if names is None else set(names)

    def replace(m, node, ins, i, lookup):
        if node.op == "param" and (keep is None or node.name in keep):
            s = node.outs[0]
            return m._leaf_add("input", node.name, s.dims, s.dtype)
        return None
    return rewrite(g, replace)


# the operands that run in the compute dtype whatever precision they arrive in (autocast): a
# value a block computes in f32 on purpose meets bf16 weights here; promoting the product to
# f32 would carry f32 through every later layer
AUTOCAST = {"matmul": (0, 1), "fused_matmul_bias_act": (0, 1, 2), "dequant_matmul": (0, 2),
            "attention": (0, 1, 2), "fused_attention_block": (0, 1, 2), "varlen_attention": (0, 1, 2),
            # (one dtype for all six: q and k come out of an l2norm whose eps bf16 cannot hold)
            "gated_delta_rule": (0, 1, 2, 3, 4, 5)}
# RoPE tables may stay f32 into the ops that apply them (the kernels compute in f32)
TABLES = {"rope": (1, 2), "fused_attention_block": (3, 4)}
FLOATS = (DType.F32, DType.F64, DType.F16, DType.BF16)


def param_free(g: Graph) -> set:
    """Nodes computed from inputs and constants alone (position and time tables): these keep
    their constants' f32, as the reference implementations compute them."""
    free: set = set()
    for i, n in enumerate(g.nodes):
        if n.op not in ("param", "state") and all(r[0] in free for r in n.inputs):
            free.add(i)
    return free


def _exact_in(value, dt: DType) -> bool:
    """Whether a scalar keeps its value in dtype `dt` (1.0 in `x * (1 + scale)`: an f32 scalar
    there would promote a bf16 chain to f32 and add a cast; 0.044715 keeps promoting)."""
    v = np.asarray(value)
    return bool(np.all(v.astype(dt.np).astype(v.dtype) == v))


def to_precision(g: Graph, compute: DType) -> Graph:
    """Run the graph in `compute` (f16/bf16): float params and states change dtype (params
    are converted when bound), float inputs are cast on entry and outputs cast back, so the
    binding contract keeps its dtypes. Constants change too, except those only the
    param-free part uses: that part (tables from positions or timesteps) runs in f32 and its
    values are cast to `compute` where the rest takes them (RoPE tables excepted); matmul and
    attention operands are always `compute` (AUTOCAST). A scalar constant changes only when
    `compute` holds its value exactly."""
    if compute is DType.F32:
        return g
    free = param_free(g)
    users: dict = {}
    for i, n in enumerate(g.nodes):
        for r in n.inputs:
            users.setdefault(r[0], set()).add(i)

    def low(v, j, node, ins_refs):
        """Input j of non-free node `node` in `compute` unless it may stay as it is."""
        if v.dtype not in FLOATS or v.dtype is compute:
            return False
        if j in AUTOCAST.get(node.op, ()):
            return True
        src = ins_refs[j][0]
        return src in free and g.nodes[src].op != "constant" and j not in TABLES.get(node.op, ())

    def replace(m, node, ins, i, lookup):
        s = node.outs[0] if node.outs else None
        if i not in free and ins:
            at = [j for j, v in enumerate(ins) if low(v, j, node, node.inputs)]
            if at:
                ins = [m.cast(v, compute) if j in at else v for j, v in enumerate(ins)]
            if node.op == "fused_elementwise":     # its dtype attr was fixed when it was fused
                dt = step_dtypes(node.a["program"], [v.dtype for v in ins])[-1]
                return m.add("fused_elementwise", tuple(ins), program=node.a["program"], dtype=dt.value)
            if at:
                return copy_node(m, node, ins)
        if node.op in ("param", "state") and s.dtype in FLOATS and s.dtype is not compute:
            return m._leaf_add(node.op, node.name, s.dims, compute)
        if (node.op == "constant" and s.dtype in FLOATS and s.dtype is not compute
                and not users.get(i, set()) <= free
                and (s.dims or _exact_in(g.constants[node.name], compute))):
            m.constants[node.name] = m.constants[node.name].astype(compute.np)
            return m.emit_node(type(node)(node.op, (), tuple(sorted({**node.a, "dtype": compute.value}.items())),
                                          (s.with_dtype(compute),), node.name))
        if node.op == "input" and s.dtype in FLOATS and s.dtype is not compute:
            return m.cast(copy_node(m, node, []), compute)
        if node.op == "dequantize" and s.dtype in FLOATS and s.dtype is not compute:
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
