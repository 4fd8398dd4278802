"""Control flow: `if_`, `while_` and `scan`, whose bodies are `Graph`s held as attrs.

A body is a graph of its own (inputs only: no params or states; constants allowed) whose
inputs are, in order, the values the op passes it. Its signature is fixed: a loop body
returns its carries with exactly the shapes and dtypes it took them, so a loop never
changes shape. Bodies print nested, round-trip through JSON, are verified recursively and
go through the same lowering, legalization, DCE, CSE and constant folding (`map_bodies`).

Execution: the NumPy kernels drive the loop on the host and run each body through
`run_body`, a small interpreter over the NumPy kernels. numba inherits them (its
supported ops are NumPy's); cuda and opencl run each body as a runner of their own on the
device (their control.py); a backend without these ops fails to compile with an error
naming the op, never a silent wrong result.

Operand layout (JAX's `cond` / `while_loop` / `scan`):
  if_(pred, *operands)                 then_/else_(*operands) -> outs (same in both)
  while_(*consts, *carries)            cond(*consts, *carries) -> bool scalar;
                                       body(*consts, *carries) -> carries
  scan(*consts, *carries, *xs)         body(*consts, *carries, *x_t) -> (*carries, *y_t);
                                       outputs (*carries, *ys), ys stacked on a new axis 0
"""
from __future__ import annotations

import attrs
import numpy as np

from .dtype import BOOL
from .errors import GraphError, ShapeError
from .numpy_kernels import KERNELS, VIEWS, put
from .ops import A, COUNT, FLAG, _BAD, op
from .shape import Shape

CONTROL_OPS = ("if_", "while_", "scan")


def is_graph(v) -> bool:
    return getattr(v, "_rlx_graph_attr", False)


BODY = A("a Graph (a body built with Builder.body)", lambda v: v if is_graph(v) else _BAD)


def bodies(node) -> dict:
    """attr name -> body graph of a node (empty for ordinary ops)."""
    return {k: v for k, v in node.attrs if is_graph(v)}


# ----------------------------------------------------------------- signatures
def _ins(body) -> list:
    return [n.outs[0] for n in body.nodes if n.op == "input"]


def _outs(body) -> list:
    return [body.shape_of(r) for _, r in body.outputs]


def _check_leaves(body, op_name: str, key: str) -> None:
    bad = sorted(n.name for n in body.nodes if n.op in ("param", "state"))
    if bad:
        raise GraphError(f"{op_name} body {key!r}: bodies take values as inputs, not params or "
                         f"states ({bad}); pass them as operands")


def _fits(outer: Shape, inner: Shape) -> bool:
    """Outer operand vs body input: same dtype and rank; a symbol on either side matches."""
    return outer.dtype == inner.dtype and outer.rank == inner.rank and all(
        a == b or isinstance(a, str) or isinstance(b, str) for a, b in zip(outer.dims, inner.dims))


def _signature(op_name: str, key: str, body, given: list, what: list) -> dict:
    """Check the body takes `given` (outer shapes); return the symbol env body -> outer."""
    _check_leaves(body, op_name, key)
    ins = _ins(body)
    if len(ins) != len(given):
        raise ShapeError(f"{op_name} body {key!r} takes {len(ins)} inputs, the op passes "
                         f"{len(given)} ({', '.join(what)})")
    env: dict = {}
    for j, (o, i) in enumerate(zip(given, ins)):
        if not _fits(o, i):
            raise ShapeError(f"{op_name} body {key!r} input {j} ({what[j]}) is {i}, the op "
                             f"passes {o}")
        env.update({b: a for a, b in zip(o.dims, i.dims) if isinstance(b, str)})
    return env


def _carries_fixed(op_name: str, key: str, body, n_consts: int, n_carry: int) -> None:
    ins, outs = _ins(body)[n_consts:n_consts + n_carry], _outs(body)[:n_carry]
    if len(outs) < n_carry:
        raise ShapeError(f"{op_name} body {key!r} returns {len(outs)} values for {n_carry} carries")
    for j, (i, o) in enumerate(zip(ins, outs)):
        if i != o:
            raise ShapeError(f"{op_name} body {key!r}: carry {j} enters as {i} but leaves as {o} "
                             "(carry shapes and dtypes are fixed)")


def _scalar_bool(op_name: str, what: str, s: Shape) -> None:
    if s.dtype is not BOOL or not all(d == 1 for d in s.dims):
        raise ShapeError(f"{op_name} {what} must be a bool scalar (or all-ones shape), got {s}")


def _names(prefix: str, n: int, start: int = 0) -> list:
    return [f"{prefix}{k}" for k in range(start, start + n)]


@op("if_", ["pred", "operands*"], attrs={"then_": BODY, "else_": BODY})
def _m_if(s, a):
    """then_(*operands) if pred else else_(*operands); both bodies return the same shapes."""
    _scalar_bool("if_", "pred", s[0])
    given = list(s[1:])
    outs = []
    for key in ("then_", "else_"):
        env = _signature("if_", key, a[key], given, _names("operand ", len(given)))
        outs.append([o.bind(env) for o in _outs(a[key])])
    if len(outs[0]) != len(outs[1]) or any(not _fits(x, y) for x, y in zip(*outs)):
        raise ShapeError(f"if_ branches differ: then_ returns {[str(x) for x in outs[0]]}, "
                         f"else_ returns {[str(x) for x in outs[1]]}")
    return tuple(outs[0])


@op("while_", ["operands*"], attrs={"cond": BODY, "body": BODY, "n_consts": COUNT(0)})
def _m_while(s, a):
    """Loop body(*consts, *carries) -> carries while cond(*consts, *carries); returns the
    final carries (shapes fixed)."""
    k = a["n_consts"]
    if k > len(s):
        raise ShapeError(f"while_ n_consts={k} but only {len(s)} operands")
    what = _names("const ", k) + _names("carry ", len(s) - k)
    env = _signature("while_", "cond", a["cond"], list(s), what)
    c = _outs(a["cond"])
    if len(c) != 1:
        raise ShapeError(f"while_ cond returns {len(c)} values; expected one bool scalar")
    _scalar_bool("while_", "cond output", c[0].bind(env))
    _signature("while_", "body", a["body"], list(s), what)
    n_carry = len(s) - k
    if len(_outs(a["body"])) != n_carry:
        raise ShapeError(f"while_ body returns {len(_outs(a['body']))} values for {n_carry} carries")
    _carries_fixed("while_", "body", a["body"], k, n_carry)
    return tuple(s[k:])


@op("scan", ["operands*"], attrs={"body": BODY, "n_consts": COUNT(0), "n_carry": COUNT(0),
                                   "length": COUNT(0), "reverse": FLAG(False)})
def _m_scan(s, a):
    """body(*consts, *carries, *x_t) -> (*carries, *y_t) over t along axis 0 of the xs
    (from the end with reverse); returns (*final carries, *ys) with ys stacked on axis 0.
    `length` counts steps when there are no xs (with xs it must be 0 or their length)."""
    k, c = a["n_consts"], a["n_carry"]
    if k + c > len(s):
        raise ShapeError(f"scan n_consts={k} + n_carry={c} exceeds the {len(s)} operands")
    xs = s[k + c:]
    length = a["length"]
    for j, x in enumerate(xs):
        if x.rank == 0:
            raise ShapeError(f"scan x {j} is a scalar; xs are scanned along axis 0")
        d = x.dims[0]
        if xs and j == 0 and length and d != length and not isinstance(d, str):
            raise ShapeError(f"scan length={length} but x 0 has {d} steps")
        if d != xs[0].dims[0] and not (isinstance(d, str) or isinstance(xs[0].dims[0], str)):
            raise ShapeError(f"scan xs differ in length: x 0 has {xs[0].dims[0]} steps, x {j} has {d}")
    steps = xs[0].dims[0] if xs else length
    given = list(s[:k + c]) + [Shape(x.dims[1:], x.dtype) for x in xs]
    what = _names("const ", k) + _names("carry ", c) + _names("x ", len(xs))
    env = _signature("scan", "body", a["body"], given, what)
    _carries_fixed("scan", "body", a["body"], k, c)
    ys = [o.bind(env) for o in _outs(a["body"])[c:]]
    return tuple(s[k:k + c]) + tuple(Shape((steps,) + y.dims, y.dtype) for y in ys)


# ----------------------------------------------------------------- passes over bodies
def map_bodies(g, fn):
    """`g` with every body of its nodes replaced by fn(body): a pass calls it on entry with
    itself as fn, so it reaches bodies at any depth. Only for passes that keep a body's
    signature (lower, legalize, DCE, CSE, constant folding)."""
    if not any(bodies(n) for n in g.nodes):
        return g
    nodes = []
    for n in g.nodes:
        bs = bodies(n)
        if bs:
            new = dict(n.attrs)
            new.update({k: fn(b) for k, b in bs.items()})
            n = attrs.evolve(n, attrs=tuple(sorted(new.items())))
        nodes.append(n)
    return attrs.evolve(g, nodes=tuple(nodes))


# ----------------------------------------------------------------- NumPy execution
def run_body(g, args: list) -> list:
    """Evaluate graph `g` (inputs only) on host arrays `args`, node by node with the NumPy
    kernels; symbols in its shapes are bound from the arrays it is given."""
    ins = [i for i, n in enumerate(g.nodes) if n.op == "input"]
    env: dict = {}
    for i, x in zip(ins, args):
        env.update({d: v for d, v in zip(g.nodes[i].outs[0].dims, np.shape(x)) if isinstance(d, str)})
    vals: dict = {}
    for i, x in zip(ins, args):
        vals[(i, 0)] = np.asarray(x)
    for i, n in enumerate(g.nodes):
        if n.op == "input":
            continue
        if n.op == "constant":
            vals[(i, 0)] = g.constants[n.name]
            continue
        xs = [vals[tuple(r)] for r in n.inputs]
        a = n.a
        if env and "shape" in a:                  # a reshape or expand to the body's symbols
            a = dict(a, shape=tuple(env.get(d, d) if isinstance(d, str) else d for d in a["shape"]))
        if n.op in VIEWS:
            vals[(i, 0)] = VIEWS[n.op](a, *xs)
            continue
        outs = [np.empty(s.bind(env).dims, s.dtype.np) for s in n.outs]
        KERNELS[n.op](a, outs, *xs)
        for k, o in enumerate(outs):
            vals[(i, k)] = o
    return [vals[tuple(r)] for _, r in g.outputs]


def _truth(x) -> bool:
    return bool(np.asarray(x).reshape(-1)[0])


def _if(a, out, pred, *operands):
    res = run_body(a["then_"] if _truth(pred) else a["else_"], list(operands))
    for o, r in zip(out, res):
        put(o, r)


def _while(a, out, *operands):
    k = a["n_consts"]
    consts, carry = list(operands[:k]), [np.array(x) for x in operands[k:]]
    while _truth(run_body(a["cond"], consts + carry)[0]):
        carry = [np.array(x) for x in run_body(a["body"], consts + carry)]
    for o, r in zip(out, carry):
        put(o, r)


def _scan(a, out, *operands):
    k, c = a["n_consts"], a["n_carry"]
    consts, carry, xs = list(operands[:k]), [np.array(x) for x in operands[k:k + c]], operands[k + c:]
    steps = out[c].shape[0] if len(out) > c else (xs[0].shape[0] if xs else a["length"])
    order = range(steps - 1, -1, -1) if a["reverse"] else range(steps)
    for t in order:
        res = run_body(a["body"], consts + carry + [x[t] for x in xs])
        carry = [np.array(x) for x in res[:c]]
        for o, y in zip(out[c:], res[c:]):
            put(o[t, ...], y)
    for o, r in zip(out[:c], carry):
        put(o, r)


KERNELS.update({"if_": _if, "while_": _while, "scan": _scan})
