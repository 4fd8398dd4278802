"""Invariants of a graph: SSA order (so acyclic), inputs exist, shapes agree with the op's
meta, outputs set, level rules. The pipeline runs it after every pass in debug mode."""
from __future__ import annotations

from .errors import GraphError, RlxError
from .ops import HIR_ONLY, OPS, Level, get_op, infer


def verify(g) -> None:
    if g.level not in ("hir", "mir", "lir"):
        raise GraphError(f"graph {g.name!r}: unknown level {g.level!r}")
    names: dict = {}
    checked: dict = {}
    for i, n in enumerate(g.nodes):
        where = f"graph {g.name!r} node %{i} ({n.op})"
        if n.op not in OPS:
            raise GraphError(f"{where}: unknown op; known: {', '.join(sorted(OPS))}")
        d = get_op(n.op)
        if g.level != "hir" and n.op in HIR_ONLY:
            raise GraphError(f"{where}: HIR block op left in a {g.level} graph (lower it first)")
        for r in n.inputs:
            if not (0 <= r[0] < i):
                kind = "a later node (cycle or bad order)" if i <= r[0] < len(g.nodes) else "a missing node"
                raise GraphError(f"{where}: input %{r[0]} refers to {kind}")
            if not 0 <= r[1] < len(g.nodes[r[0]].outs):
                raise GraphError(f"{where}: input %{r[0]}:{r[1]} has no such output")
        if d.level is Level.LEAF:
            if not n.name:
                raise GraphError(f"{where}: {n.op} without a name")
            if n.name in names:
                raise GraphError(f"{where}: name {n.name!r} used twice")
            names[n.name] = i
            if n.op == "constant" and n.name not in g.constants:
                raise GraphError(f"{where}: constant {n.name!r} has no value in the constant table")
        if n.op == "assign" and n.inputs and g.nodes[n.inputs[0][0]].op != "state":
            raise GraphError(f"{where}: writes %{n.inputs[0][0]} ({g.nodes[n.inputs[0][0]].op}); "
                             "assign writes a state")
        bodies = False
        for key, body in n.attrs:               # control-flow bodies, verified recursively
            if getattr(body, "_rlx_graph_attr", False):
                bodies = True
                try:
                    verify(body)
                except RlxError as e:
                    raise GraphError(f"{where}: body {key!r}: {e}") from None
        shapes = tuple(g.shape_of(r) for r in n.inputs)
        # the op's checks are pure: a node equal to one already checked (same op, input shapes
        # and attrs, the attrs compared by repr so 1, 1.0 and True differ) gets the same answer
        memo_key = None if bodies else (n.op, shapes, repr(n.attrs))
        expect = checked.get(memo_key)
        if expect is None:
            try:
                d.check_arity(len(n.inputs))
                a = d.check_attrs(n.a)
                expect = tuple(infer(n.op, list(shapes), a))
            except RlxError as e:
                raise GraphError(f"{where}: {e}") from None
            if memo_key is not None:
                checked[memo_key] = expect
        if expect != tuple(n.outs):
            raise GraphError(f"{where}: recorded shapes {[str(s) for s in n.outs]} disagree with "
                             f"the op's meta {[str(s) for s in expect]}")
        if n.op == "constant":
            c = g.constants[n.name]
            if tuple(c.shape) != n.outs[0].dims or c.dtype != n.outs[0].dtype.np:
                raise GraphError(f"{where}: constant value {c.dtype}{list(c.shape)} != {n.outs[0]}")
    if not g.outputs:
        raise GraphError(f"graph {g.name!r}: no outputs set")
    seen = set()
    for name, r in g.outputs:
        if name in seen:
            raise GraphError(f"graph {g.name!r}: output {name!r} set twice")
        seen.add(name)
        if not (0 <= r[0] < len(g.nodes)) or not 0 <= r[1] < len(g.nodes[r[0]].outs):
            raise GraphError(f"graph {g.name!r}: output {name!r} refers to missing value {r}")
