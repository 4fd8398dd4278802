"""Graph rewriting: copy a graph node by node into a new builder, letting a callback replace
nodes, plus a small pattern matcher (in the spirit of tinygrad's PatternMatcher) on which
the lowering, fusion and legalize tables are written."""
from __future__ import annotations

from typing import Callable

import attrs

from .graph import Builder, Graph, Node
from .ops import get_op, infer

Replace = Callable[[Builder, Node, list, int, Callable], object]


def copy_node(m: Builder, node: Node, ins: list) -> object:
    """Re-emit `node` on new inputs, re-inferring shapes (inputs may have changed dtype)."""
    d = get_op(node.op)
    outs = infer(node.op, [v.shape for v in ins], node.a) if d.level.value != "leaf" else node.outs
    return m.emit_node(Node(node.op, tuple(v.ref for v in ins), node.attrs, tuple(outs), node.name))


def rewrite(g: Graph, replace: Replace | None = None, level: str | None = None,
            extra_map: dict | None = None) -> Graph:
    """Build a new graph from `g`. `replace(m, node, new_inputs, node_id, lookup)` returns None
    to copy the node, or the value(s) standing for its outputs; `lookup(old_ref)` gives the
    new value of any earlier ref. It may also record replacements of other, earlier refs in
    `extra_map` (old ref -> new value) for later consumers."""
    m = Builder(g.name, level or g.level)
    m.constants = dict(g.constants)
    m._leaf_names = {n.name: n.op for n in g.nodes if n.name}
    remap: dict = {}
    extra = extra_map if extra_map is not None else {}

    def lookup(r):
        r = tuple(r)
        return extra.get(r) or remap[r]

    for i, node in enumerate(g.nodes):
        ins = [lookup(r) for r in node.inputs]
        out = replace(m, node, ins, i, lookup) if replace else None
        if out is None:
            out = copy_node(m, node, ins)
        vals = out if isinstance(out, tuple) else (out,)
        if len(vals) != len(node.outs):
            raise AssertionError(f"rewrite of %{i} {node.op} gave {len(vals)} outputs")
        for k, v in enumerate(vals):
            remap[(i, k)] = v
    m.outputs = [(name, lookup(r).ref) for name, r in g.outputs]
    return m.build()


# ------------------------------------------------------------------ patterns
@attrs.frozen
class P:
    """Matches a node by op and attrs; inputs are sub-patterns. `name` captures the node.
    `X(name)` matches any value. Commutative binary ops are tried in both orders."""
    op: str | None
    inputs: tuple = ()
    attrs: dict = attrs.field(factory=dict)
    name: str | None = None
    out: int = 0                 # which output of the node this pattern refers to
    shared: bool = False         # the node may have consumers outside the match

    def __call__(self, *inputs, name=None, out=0, shared=False, **kw) -> "P":
        return P(self.op, inputs, kw, name, out, shared)


def X(name: str | None = None, **constraint) -> P:
    return P(None, (), constraint, name)


def pat(op: str) -> P:
    return P(op)


_COMMUTATIVE = {"add", "mul", "max", "min"}


def _attr_ok(want, got) -> bool:
    return want(got) if callable(want) else want == got


def match(g: Graph, p: P, ref, caps: dict, inner: set) -> bool:
    node = g.nodes[ref[0]]
    if p.op is None:
        if "pred" in p.attrs and not p.attrs["pred"](g, ref):
            return False
        if p.name:
            if p.name in caps and caps[p.name] != ref:
                return False
            caps[p.name] = ref
        return True
    if node.op != p.op or ref[1] != p.out:
        return False
    a = node.a
    for k, want in p.attrs.items():
        if k not in a or not _attr_ok(want, a[k]):
            return False
    if len(p.inputs) != len(node.inputs) and not (p.inputs and p.inputs[-1] == ...):
        return False
    orders = [list(node.inputs)]
    if node.op == "binary" and a.get("op") in _COMMUTATIVE:
        orders.append(list(reversed(node.inputs)))
    subs = [q for q in p.inputs if q is not ...]
    for order in orders:
        c2, i2 = dict(caps), set(inner)
        if all(match(g, q, tuple(r), c2, i2) for q, r in zip(subs, order)):
            i2.add((ref[0], p.shared))
            if p.name:
                if p.name in c2 and c2[p.name] != ref:
                    continue
                c2[p.name] = ref
            caps.clear(); caps.update(c2)
            inner.clear(); inner.update(i2)
            return True
    return False


@attrs.frozen
class Match:
    """What a rule's `emit` sees: the builder `m`, the old graph `g`, the captures."""
    m: Builder
    g: Graph
    caps: dict
    lookup: Callable

    def get(self, name: str):
        """The new value standing for a captured ref."""
        return self.lookup(self.caps[name])

    def attrs(self, name: str) -> dict:
        return self.g.nodes[self.caps[name][0]].a

    def shape(self, name: str):
        return self.g.shape_of(self.caps[name])

    def scalar(self, name: str):
        """The value of a captured scalar constant, else None."""
        n = self.g.nodes[self.caps[name][0]]
        c = self.g.constants.get(n.name) if n.op == "constant" else None
        return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None


@attrs.frozen
class Rule:
    """pattern -> replacement. `emit(match)` builds the replacement and returns the root's
    value(s), or a dict {capture name: value} holding "root" and replacements of shared
    nodes. `when(match)` may veto a structural match."""
    name: str
    pattern: P
    emit: Callable
    when: Callable | None = None


def _size(p) -> int:
    """Number of op nodes in a pattern."""
    return 0 if not isinstance(p, P) or p.op is None else 1 + sum(_size(q) for q in p.inputs)


def apply_rules(g: Graph, rules: list, on_match: Callable | None = None) -> tuple:
    """One sweep: every node that roots a rule's match gets replaced. Returns (graph, hits)."""
    by_op: dict = {}
    for r in rules:
        by_op.setdefault(r.pattern.op, []).append(r)
    for rs in by_op.values():      # the largest pattern first: LayerNorm's tail is an RMSNorm
        rs.sort(key=lambda r: -_size(r.pattern))
    consumers = g.consumers()
    hits: list = []
    extra: dict = {}

    def replace(m, node, ins, i, lookup):
        for rule in by_op.get(node.op, ()):
            caps: dict = {}
            inner: set = set()
            if not match(g, rule.pattern, (i, rule.pattern.out), caps, inner):
                continue
            inner_ids = {n for n, _ in inner}
            ok = True
            for n, shared in inner:
                if n == i or shared:
                    continue
                for k in range(len(g.nodes[n].outs)):
                    if any(c not in inner_ids for c in consumers.get((n, k), ())):
                        ok = False
            mt = Match(m, g, caps, lookup)
            if not ok or (rule.when and not rule.when(mt)):
                continue
            if on_match is not None:
                on_match(rule, i)
                continue
            out = rule.emit(mt)
            hits.append((rule.name, i))
            if isinstance(out, dict):
                for cname, v in out.items():
                    if cname != "root":
                        extra[caps[cname]] = v
                out = out["root"]
            return out
        return None

    return rewrite(g, replace, extra_map=extra), hits
