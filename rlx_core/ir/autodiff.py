"""Reverse-mode AD: `value_and_grad` / `grad` build a backward graph from a VJP rule per op.

The graph is first lowered with the `fusable` policy, so blocks (linear, rope, swiglu, ...)
reach AD as their primitive decompositions and only primitives need rules; softmax,
rms_norm, layer_norm and attention stay ops, and their rules emit the fused backward ops
`softmax_grad`, `rms_norm_grad`, `layer_norm_grad`, `attention_grad` (one kernel where a
backend has it, legalized to primitives where not). So the forward runs the backend's
attention kernel and the backward recomputes the probabilities: no [B,H,Sq,Sk] is kept.
Forward nodes are replayed into a new MIR graph, then the cotangents flow back node by
node: a rule is graph-building code
`rule(m, attrs, inputs, output, cotangent) -> cotangent per input (None: not differentiable)`.
The result is an ordinary MIR graph: it goes through the same passes, planner and
backends. An op on the path from `wrt` to the output without a rule is a GraphError naming it.
Rules of multi-output ops (`multi=True`: scan) take every output and cotangent as lists.
`scan` differentiates through its body (the body's own VJP, run by a reverse scan); `if_`
and `while_` have no rule yet.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from .errors import GraphError
from .expr import ACTIVATION_TABLE
from .graph import MIR, Builder, Graph
from .lower import layer_norm_grad_prims, lower, rms_norm_grad_prims
from .rewrite import copy_node

VJP: dict = {}
# ops the forward keeps (not lowered to primitives) because their VJP rule emits a fused
# backward op (softmax_grad, rms_norm_grad, layer_norm_grad, attention_grad)
FUSED_BACKWARD = frozenset({"softmax", "rms_norm", "layer_norm", "attention"})
MULTI: set = set()          # ops whose rule takes every output and cotangent (lists; None: none)


def vjp(name, multi: bool = False):
    def wrap(fn):
        VJP[name] = fn
        if multi:
            MULTI.add(name)
        return fn
    return wrap


# ----------------------------------------------------------------- helpers
def unbroadcast(m, g, target):
    """Sum `g` down to the dims of `target` (undoing numpy broadcasting), in its dtype."""
    dims = target.dims
    lead = g.shape.rank - len(dims)
    if lead:
        g = m.sum(g, tuple(range(lead)))
    axes = tuple(i for i, (d, e) in enumerate(zip(dims, g.dims)) if d == 1 and e != 1)
    if axes:
        g = m.sum(g, axes, keepdims=True)
    return m.cast(m.reshape(g, dims), target.dtype)


def _scalar(m, v, like):
    return m.constant(np.asarray(v, like.dtype.np), like.dtype)


def _zeros(m, dims, like):
    return m.expand(_scalar(m, 0.0, like), dims)


def inline(m, g: Graph, args: dict) -> list:
    """Emit graph `g` into builder `m` with its inputs bound by name from `args` (its
    constants re-added, any params copied as they are); returns its outputs' values in order."""
    vals: dict = {}
    for i, n in enumerate(g.nodes):
        if n.op == "input":
            v = args[n.name]
        elif n.op == "constant":
            v = m.constant(g.constants[n.name], n.outs[0].dtype)
        else:
            v = copy_node(m, n, [vals[tuple(r)] for r in n.inputs])
        for k, x in enumerate(v if isinstance(v, tuple) else (v,)):
            vals[(i, k)] = x
    return [vals[tuple(r)] for _, r in g.outputs]


def _swap(m, x):
    r = x.shape.rank
    return m.transpose(x, tuple(range(r - 2)) + (r - 1, r - 2))


# ----------------------------------------------------------------- rules
@vjp("binary")
def _binary(m, a, ins, y, g):
    x1, x2 = ins
    op = a["op"]
    if op == "add":
        d1, d2 = g, g
    elif op == "sub":
        d1, d2 = g, -g
    elif op == "mul":
        d1, d2 = g * x2, g * x1
    elif op == "div":
        d1, d2 = g / x2, -(g * y) / x2
    elif op == "pow":
        d1 = g * x2 * m.pow(x1, x2 - 1.0)
        d2 = g * y * m.act(x1, "log")
    else:                                        # max / min: the gradient goes to the winner
        take1 = m.compare(x1, x2, "ge" if op == "max" else "le")
        d1, d2 = m.where(take1, g, 0.0), m.where(take1, 0.0, g)
    return unbroadcast(m, d1, x1.shape), unbroadcast(m, d2, x2.shape)


def _act_grad(m, fn, x, y, g):
    """The cotangent of an activation's input: its table entry's `vjp` (rlx_core.ir.expr, beside
    the formula), from x, the output y and its cotangent g, built as graph ops."""
    e = ACTIVATION_TABLE.get(fn)
    if e is None or e.vjp is None:
        raise GraphError(f"no VJP rule for activation {fn!r}")
    return _build(m, e.vjp, {"x": x, "y": y, "g": g}, {})


_ARITH = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


def _build(m, e, env: dict, memo: dict):
    """Expression `e` as graph ops on the values in `env` (constants stay Python floats, as
    operands of Value arithmetic); a repeated subexpression is built once."""
    if e.op == "var":
        return env[e.name]
    if e.op == "const":
        return e.name
    if e in memo:
        return memo[e]
    args = [_build(m, c, env, memo) for c in e.args]
    if e.op == "call":
        v = m.act(args[0], e.name)
    elif e.op == "select":
        v = m.where(*args)
    elif e.op == "cmp":
        v = m.compare(args[0], args[1], e.name)
    elif e.op == "neg":
        v = -args[0]
    else:
        v = _ARITH[e.op](*args)
    memo[e] = v
    return v


@vjp("activation")
def _activation(m, a, ins, y, g):
    return (_act_grad(m, a["fn"], ins[0], y, g),)


@vjp("cast")
def _cast(m, a, ins, y, g):
    return (m.cast(g, ins[0].dtype) if ins[0].dtype.is_float else None,)


def _keep_shape(x, a):
    axes = a["axes"] if isinstance(a["axes"], tuple) else (a["axes"],)
    axes = {ax % x.shape.rank for ax in axes}
    return tuple(1 if i in axes else d for i, d in enumerate(x.dims)), axes


@vjp("reduce")
def _reduce(m, a, ins, y, g):
    x = ins[0]
    keep, axes = _keep_shape(x, a)
    gk = m.expand(m.reshape(g, keep), x.dims)
    if a["op"] == "sum":
        return (gk,)
    if a["op"] == "mean":
        return (gk / float(math.prod(x.dims[i] for i in axes)),)
    if a["op"] in ("max", "min"):
        hit = m.compare(x, m.expand(m.reshape(y, keep), x.dims), "eq")
        return (m.where(hit, gk, 0.0),)
    if a["op"] == "prod":
        return (gk * m.expand(m.reshape(y, keep), x.dims) / x,)
    raise GraphError(f"no VJP rule for reduce {a['op']!r}")


def _rows(m, v):
    """v [..., r, c] with static leading dims as one [rows, c] matrix (None if it cannot)."""
    if v.shape.rank < 3 or not v.shape.is_static:
        return None
    return m.reshape(v, (math.prod(v.dims[:-1]), v.dims[-1]))


@vjp("matmul")
def _matmul(m, a, ins, y, g):
    x1, x2 = ins
    ta, tb = a["trans_a"], a["trans_b"]
    g2, a2 = _rows(m, g), _rows(m, x1)
    if x2.shape.rank == 2 and not ta and g2 is not None and a2 is not None:
        # activations [..., M, K] times a weight: one GEMM per gradient over all rows, not a
        # batched product summed afterwards
        d1 = m.reshape(m.matmul(g2, x2, trans_b=not tb), x1.dims)
        d2 = m.matmul(g2, a2, trans_a=True) if tb else m.matmul(a2, g2, trans_a=True)
        return d1, m.cast(d2, x2.dtype)
    d1 = m.matmul(g, x2, trans_b=not tb)          # d(op(A)) = g op(B)^T
    d2 = m.matmul(x1, g, trans_a=not ta)          # d(op(B)) = op(A)^T g
    d1 = _swap(m, d1) if ta else d1
    d2 = _swap(m, d2) if tb else d2
    return unbroadcast(m, d1, x1.shape), unbroadcast(m, d2, x2.shape)


@vjp("softmax")
def _softmax(m, a, ins, y, g):
    return (m.add("softmax_grad", (y, g), axis=a["axis"]),)


@vjp("rms_norm")
def _rms_norm(m, a, ins, y, g):
    if len(ins) == 1:
        return (rms_norm_grad_prims(m, ins[0], None, g, a["eps"], a["offset"])[0],)
    return m.add("rms_norm_grad", (ins[0], ins[1], g), eps=a["eps"], offset=a["offset"])


@vjp("layer_norm")
def _layer_norm(m, a, ins, y, g):
    if len(ins) == 1:
        return (layer_norm_grad_prims(m, ins[0], None, g, a["eps"])[0],)
    return m.add("layer_norm_grad", (ins[0], ins[1], g), eps=a["eps"])[:len(ins)]


@vjp("attention")
def _attention(m, a, ins, y, g):
    """The mask and positions get no gradient (a float bias is a constant of the step)."""
    grads = m.add("attention_grad", tuple(ins[:3]) + (y, g) + tuple(ins[3:]), **a)
    return tuple(grads) + (None,) * (len(ins) - 3)


@vjp("reshape")
def _reshape(m, a, ins, y, g):
    return (m.reshape(g, ins[0].dims),)


@vjp("transpose")
def _transpose(m, a, ins, y, g):
    inv = tuple(int(i) for i in np.argsort(a["perm"]))
    return (m.transpose(g, inv),)


@vjp("expand")
def _expand(m, a, ins, y, g):
    return (unbroadcast(m, g, ins[0].shape),)


@vjp("narrow")
def _narrow(m, a, ins, y, g):
    x = ins[0]
    ax = a["axis"] % x.shape.rank
    n = x.dims[ax]
    start = a["start"] + n if a["start"] < 0 else a["start"]
    parts = []
    for length in (start, None, n - start - a["length"]):
        if length is None:
            parts.append(g)
        elif length:
            parts.append(_zeros(m, x.dims[:ax] + (length,) + x.dims[ax + 1:], g))
    return (m.concat(parts, ax) if len(parts) > 1 else parts[0],)


@vjp("concat")
def _concat(m, a, ins, y, g):
    ax = a["axis"] % y.shape.rank
    out, at = [], 0
    for x in ins:
        out.append(m.narrow(g, ax, at, x.dims[ax]))
        at += x.dims[ax]
    return tuple(out)


@vjp("where")
def _where(m, a, ins, y, g):
    c, x1, x2 = ins
    return None, unbroadcast(m, m.where(c, g, 0.0), x1.shape), unbroadcast(m, m.where(c, 0.0, g), x2.shape)


@vjp("compare")
def _compare(m, a, ins, y, g):
    return None, None


@vjp("gather")
def _gather(m, a, ins, y, g):
    """Rows scattered back as a one-hot matmul: d table = onehot(idx)^T g, summed over the
    leading index dims (batched, so symbolic dims stay where they are)."""
    table, idx = ins
    if a["axis"] % table.shape.rank != 0:
        raise GraphError("no VJP rule for gather along an axis other than 0")
    v, r = table.dims[0], idx.shape.rank
    if r == 0:
        idx, g, r = m.reshape(idx, (1,)), m.reshape(g, (1,) + g.dims), 1
    hot = m.cast(m.compare(m.reshape(m.cast(idx, "i64"), idx.dims + (1,)),
                           m.constant(np.arange(v, dtype=np.int64)), "eq"), g.dtype)
    g = m.reshape(g, idx.dims + (math.prod(table.dims[1:]),))
    if r > 1 and idx.shape.is_static:             # one GEMM over all the indices
        hot, g, r = _rows(m, hot), _rows(m, g), 1
    d = m.matmul(hot, g, trans_a=True)
    if r > 1:
        d = m.sum(d, tuple(range(r - 1)))
    return m.reshape(d, table.dims), None


@vjp("dense_solve")
def _dense_solve(m, a, ins, x, g):
    """grad_b = solve(A^T, g); grad_A = -grad_b x^T (an outer product per vector rhs)."""
    A, b = ins
    gb = m.dense_solve(_swap(m, A), g)
    if b.shape.rank == A.shape.rank - 1:
        ga = m.reshape(gb, gb.dims + (1,)) * m.reshape(x, x.dims[:-1] + (1,) + x.dims[-1:])
    else:
        ga = m.matmul(gb, x, trans_b=True)
    return -ga, gb


@vjp("mask_fill")
def _mask_fill(m, a, ins, y, g):
    """Masked scores are constants (-inf); the gradient passes where the score was kept."""
    keep = m.compare(y, float("-inf"), "ne")
    return (m.where(keep, g, 0.0),) + (None,) * (len(ins) - 1)


def _step_vjp(body: Graph) -> Graph:
    """The VJP of a scan body as a graph: inputs a0.. (the body's) then ct<j> (a cotangent per
    float output j); outputs grad_a<i> for every float input."""
    w = Builder(f"{body.name}.step", body.level)
    args = {n.name: w.input(n.name, n.outs[0].dims, n.outs[0].dtype) for n in body.nodes if n.op == "input"}
    terms = []
    for j, r in enumerate(inline(w, body, args)):
        if r.dtype.is_float:
            t = r * w.input(f"ct{j}", r.dims, r.dtype)
            terms.append(w.sum(t, tuple(range(r.shape.rank))) if r.shape.rank else t)
    w.output("loss", sum(terms[1:], terms[0]))
    return grad(w.build(), [k for k, v in args.items() if v.dtype.is_float], "loss")


@vjp("scan", multi=True)
def _scan(m, a, ins, outs, cts):
    """Reverse-mode through a scan: the forward runs again, also stacking the carries that
    enter each step; then a scan in the opposite direction runs the body's VJP per step,
    carrying the carries' cotangents and summing the consts'. Memory: one carry per step."""
    k, c, body = a["n_consts"], a["n_carry"], a["body"]
    consts, init, xs = ins[:k], ins[k:k + c], ins[k + c:]
    names = [n.name for n in body.nodes if n.op == "input"]
    ny = len(outs) - c

    def forward(b, *args):
        return tuple(inline(b, body, dict(zip(names, args)))) + tuple(args[k:k + c])

    entering = m.scan(forward, init=init, xs=xs, consts=consts, length=a["length"],
                      reverse=a["reverse"])[1][ny:] if c else ()
    step = _step_vjp(body)
    fk = [j for j in range(k) if consts[j].dtype.is_float]
    fc = [j for j in range(c) if init[j].dtype.is_float]
    fx = [j for j in range(len(xs)) if xs[j].dtype.is_float]
    fy = [j for j in range(c, len(outs)) if outs[j].dtype.is_float]
    seed = [cts[j] if cts[j] is not None else _zeros(m, outs[j].dims, outs[j]) for j in fc + fy]

    def backward(b, *args):
        cs, ct_c, acc = args[:k], args[k:k + len(fc)], args[k + len(fc):k + len(fc) + len(fk)]
        rest = args[k + len(fc) + len(fk):]
        car, x_t, ct_y = rest[:c], rest[c:c + len(xs)], rest[c + len(xs):]
        feed = dict(zip(names, cs + car + x_t))
        feed.update({f"ct{j}": v for j, v in zip(fc + fy, ct_c + ct_y)})
        d = dict(zip([o for o, _ in step.outputs], inline(b, step, feed)))
        dn = [d.get(f"grad_{n}") for n in names]         # by body input: consts, carries, xs
        return (tuple(dn[k + j] for j in fc) + tuple(s + dn[j] for s, j in zip(acc, fk))
                + tuple(dn[k + c + j] for j in fx))

    zero_consts = tuple(_zeros(m, consts[j].dims, consts[j]) for j in fk)
    carry, dxs = m.scan(backward, init=tuple(seed[:len(fc)]) + zero_consts,
                        xs=tuple(entering) + tuple(xs) + tuple(seed[len(fc):]), consts=consts,
                        length=a["length"], reverse=not a["reverse"])
    grads = [None] * len(ins)
    for j, v in zip(fc, carry[:len(fc)]):
        grads[k + j] = v
    for j, v in zip(fk, carry[len(fc):]):
        grads[j] = v
    for j, v in zip(fx, dxs):
        grads[k + c + j] = v
    return grads


# ----------------------------------------------------------------- driver
def value_and_grad(g: Graph, wrt, output: str | None = None) -> Graph:
    """A graph computing output `output` (default: the only one) of `g` and the gradient of
    its sum with respect to each name in `wrt` (inputs or params), as outputs `output` and
    `grad_<name>`. The forward graph is lowered with the fusable policy first."""
    wrt = [wrt] if isinstance(wrt, str) else list(wrt)
    names = [n for n, _ in g.outputs]
    if output is None:
        if len(names) != 1:
            raise GraphError(f"value_and_grad of graph {g.name!r}: choose output= among {names}")
        output = names[0]
    if output not in names:
        raise GraphError(f"value_and_grad: graph {g.name!r} has no output {output!r}; it has {names}")
    f = lower(g, "fusable", keep=FUSED_BACKWARD) if g.level == "hir" else g
    leaves = {n.name: i for i, n in enumerate(f.nodes) if n.op in ("input", "param")}
    for w in wrt:
        if w not in leaves:
            raise GraphError(f"value_and_grad: {w!r} is not an input or param of {g.name!r}; "
                             f"it has {sorted(leaves)}")
        if not f.nodes[leaves[w]].outs[0].dtype.is_float:
            raise GraphError(f"value_and_grad: {w!r} is {f.nodes[leaves[w]].outs[0]}, not a float")
    m = Builder(f"{g.name}.grad", MIR)
    m.constants = dict(f.constants)
    m._leaf_names = {n.name: n.op for n in f.nodes if n.name}
    vals: dict = {}
    active = {leaves[w] for w in wrt}
    for i, n in enumerate(f.nodes):
        out = copy_node(m, n, [vals[tuple(r)] for r in n.inputs])
        for k, v in enumerate(out if isinstance(out, tuple) else (out,)):
            vals[(i, k)] = v
        if any(r[0] in active for r in n.inputs):
            active.add(i)
    ref = dict(f.outputs)[output]
    y = vals[tuple(ref)]
    if not y.dtype.is_float:
        raise GraphError(f"value_and_grad: output {output!r} is {y.shape}, not a float")
    cts: dict = {tuple(ref): m.expand(_scalar(m, 1.0, y), y.dims)}
    missing: set = set()
    for i in range(len(f.nodes) - 1, -1, -1):
        n = f.nodes[i]
        if i not in active or not n.inputs or not any((i, k) in cts for k in range(len(n.outs))):
            continue
        if n.op not in VJP or (len(n.outs) != 1 and n.op not in MULTI):
            missing.add(n.op)
            continue
        ins = [vals[tuple(r)] for r in n.inputs]
        if n.op in MULTI:
            ks = range(len(n.outs))
            grads = VJP[n.op](m, n.a, ins, [vals[(i, k)] for k in ks], [cts.get((i, k)) for k in ks])
        else:
            grads = VJP[n.op](m, n.a, ins, vals[(i, 0)], cts[(i, 0)])
        for r, d in zip(n.inputs, grads):
            if d is None or r[0] not in active:
                continue
            r = tuple(r)
            cts[r] = cts[r] + d if r in cts else d
    if missing:
        raise GraphError(f"value_and_grad of {g.name!r}: no VJP rule for op(s) {sorted(missing)} "
                         f"on the path from {wrt} to {output!r}")
    m.output(output, y)
    for w in wrt:
        s = f.nodes[leaves[w]].outs[0]
        d = cts.get((leaves[w], 0))
        m.output(f"grad_{w}", m.cast(d, s.dtype) if d is not None else _zeros(m, s.dims, vals[(leaves[w], 0)]))
    return m.build()


def grad(g: Graph, wrt, output: str | None = None) -> Graph:
    """value_and_grad without the value: outputs `grad_<name>` only."""
    vg = value_and_grad(g, wrt, output)
    keep = tuple(o for o in vg.outputs if o[0].startswith("grad_"))
    return Graph(vg.name, vg.level, vg.nodes, keep, vg.constants)


__all__ = ["VJP", "vjp", "value_and_grad", "grad", "unbroadcast"]
