"""Control flow (if_, while_, scan) for a backend that does not implement it: core runs it
from the host, so a backend of primitives only still runs every graph.

A graph holding such an op is cut at it: the stretches between cuts are graphs of their own,
each compiled by the backend once; the control op runs here, on host arrays, and each of its
bodies is a graph compiled by the same backend (once per shape of its operands) and run once
per branch taken or trip. Values crossing a cut come to the host and go back (a runner's
outputs are host arrays): correct everywhere, slow per trip. A backend that wants loops on
its device implements the three ops itself (cuda's control.py), and this module stays out of
its way: only the control ops a backend lacks are cut at.
"""
from __future__ import annotations

import numpy as np

from ..ir.control import CONTROL_OPS, bodies
from ..ir.graph import Builder, Graph, Node
from ..ir.lir import LirModule, plan
from ..ir.ops import get_op
from .runner import Runner

LEAVES = ("input", "param", "state", "constant")


def host_run(backend, g: Graph) -> list:
    """Indices of the nodes of `g` that core runs from the host for `backend`."""
    have = backend.supported_ops()
    return [i for i, n in enumerate(g.nodes) if n.op in CONTROL_OPS and n.op not in have]


def compile_lir(backend, lir: LirModule, params: dict, states: dict) -> Runner:
    """backend.compile(lir, ...), or, where the graph holds control ops the backend lacks, a
    runner that runs those from the host between parts the backend compiles (what
    Backend.compile_runner does)."""
    cuts = host_run(backend, lir.graph)
    if not cuts:
        return backend.compile(lir, params, states)
    return HostControlRunner(backend, lir.graph, params, states, cuts)


def compile_graph(backend, g: Graph, params: dict, states: dict) -> Runner:
    """A static graph planned with the backend's layouts and compiled (compile_lir)."""
    return compile_lir(backend, plan(g, *backend.planned_layouts(g)), params, states)


# ----------------------------------------------------------------- the three loops
# Each is fn(attrs, run, outs, *operands) -> the op's outputs: run(body name, args) runs one
# of the op's bodies, `outs` are the op's output Shapes.
def _truth(x) -> bool:
    return bool(np.asarray(x).reshape(-1)[0])


def run_if(a, run, outs, pred, *operands) -> list:
    """then_(*operands) if pred else else_(*operands)."""
    return run("then_" if _truth(pred) else "else_", list(operands))


def run_while(a, run, outs, *operands) -> list:
    """The carries once cond(*consts, *carries) is false, body(*consts, *carries) each trip."""
    k = a["n_consts"]
    consts, carry = list(operands[:k]), list(operands[k:])
    while _truth(run("cond", consts + carry)[0]):
        carry = run("body", consts + carry)
    return carry


def run_scan(a, run, outs, *operands) -> list:
    """(*final carries, *ys): body(*consts, *carries, *x_t) for t along axis 0 of the xs (from
    the end with reverse), each step's ys written into row t of their outputs."""
    k, c = a["n_consts"], a["n_carry"]
    consts, carry, xs = list(operands[:k]), list(operands[k:k + c]), operands[k + c:]
    steps = outs[c].dims[0] if len(outs) > c else (xs[0].shape[0] if xs else a["length"])
    ys = [np.empty(s.dims, s.dtype.np) for s in outs[c:]]
    for t in (range(steps - 1, -1, -1) if a["reverse"] else range(steps)):
        res = run("body", consts + carry + [x[t] for x in xs])
        carry = res[:c]
        for y, r in zip(ys, res[c:]):
            y[t, ...] = r
    return carry + ys


LOOPS = {"if_": run_if, "while_": run_while, "scan": run_scan}


class Body:
    """One body graph on host arrays: a runner of the backend per shape of its operands."""

    def __init__(self, backend, graph: Graph):
        self.backend, self.graph = backend, graph
        self.inputs = [n for n in graph.nodes if n.op == "input"]
        self.runners: dict = {}

    def __call__(self, args: list) -> list:
        from ..pipeline import specialize

        key = tuple(np.shape(x) for x in args)
        r = self.runners.get(key)
        if r is None:
            env: dict = {}
            for n, x in zip(self.inputs, args):
                env.update({d: v for d, v in zip(n.outs[0].dims, np.shape(x)) if isinstance(d, str)})
            r = self.runners[key] = compile_graph(self.backend, specialize(self.graph, env), {}, {})
        out = r.run({n.name: np.asarray(x, n.outs[0].dtype.np, order="C") for n, x in zip(self.inputs, args)})
        return [out[name] for name, _ in self.graph.outputs]


# ----------------------------------------------------------------- cutting a graph
def _state_behind(g: Graph, ref) -> tuple | None:
    """The state leaf a value is, written in place (kv_write and assign return the state
    they write); None for any other value."""
    n = g.nodes[ref[0]]
    while n.op in ("kv_write", "assign"):
        ref = tuple(n.inputs[get_op(n.op).view_of or 0])
        n = g.nodes[ref[0]]
    return ref if n.op == "state" else None


class Part:
    """A stretch of the graph between cuts, compiled by the backend as a graph of its own: its
    inputs are the values it reads from before the stretch, its outputs those read after."""

    def __init__(self, backend, g: Graph, nodes: range, read_after: set, params, states, number: int):
        m = Builder(f"{g.name}.part{number}", g.level)
        self.reads: dict = {}            # part input name -> outer value
        local: dict = {}                 # outer value -> this part's

        def value(ref):
            ref = tuple(ref)
            if ref not in local:
                leaf = g.nodes[ref[0]]
                state = _state_behind(g, ref)
                if state is not None and state != ref:
                    local[ref] = value(state)           # written in place: the state itself
                    return local[ref]
                if leaf.op in ("param", "state", "constant"):
                    m.emit_node(Node(leaf.op, (), leaf.attrs, leaf.outs, leaf.name))
                    if leaf.op == "constant":
                        m.constants[leaf.name] = g.constants[leaf.name]
                else:
                    name = f"v{ref[0]}_{ref[1]}"
                    s = g.shape_of(ref)
                    m._leaf_add("input", name, s.dims, s.dtype)
                    self.reads[name] = ref
                local[ref] = (len(m.nodes) - 1, 0)
            return local[ref]

        for i in nodes:
            n = g.nodes[i]
            if n.op in LEAVES:
                continue
            m.emit_node(Node(n.op, tuple(value(r) for r in n.inputs), n.attrs, n.outs, n.name))
            for k in range(len(n.outs)):
                local[(i, k)] = (len(m.nodes) - 1, k)
        made = [(i, k) for i in nodes if g.nodes[i].op not in LEAVES for k in range(len(g.nodes[i].outs))]
        kept = [r for r in made if r in read_after] or [r for r in made if get_op(g.nodes[r[0]].op).effect]
        self.writes = {f"v{i}_{k}": (i, k) for i, k in kept}   # (a part that only writes states: those)
        m.outputs = [(name, local[ref]) for name, ref in self.writes.items()]
        self.runner = compile_graph(backend, m.build(), params, states) if m.outputs else None

    def run(self, vals: dict) -> None:
        if self.runner is None:                 # it makes nothing read later (or nothing at all)
            return
        out = self.runner.run({name: vals[ref] for name, ref in self.reads.items()})
        vals.update({ref: out[name] for name, ref in self.writes.items()})


class HostControlRunner(Runner):
    """Parts compiled by the backend, and between them control ops run from the host."""

    def __init__(self, backend, g: Graph, params: dict, states: dict, cuts: list):
        self.backend, self.graph, self.params, self.states = backend, g, params, states
        read_at: dict = {}                       # value -> the nodes (len(nodes): an output) reading it
        for i, n in enumerate(g.nodes):
            for r in n.inputs:
                read_at.setdefault(tuple(r), []).append(i)
        for _, r in g.outputs:
            read_at.setdefault(tuple(r), []).append(len(g.nodes))
        self.steps: list = []
        start = 0
        for number, cut in enumerate(cuts + [len(g.nodes)]):
            after = {ref for ref, readers in read_at.items() if max(readers) >= cut}
            self.steps.append(Part(backend, g, range(start, cut), after, params, states, number))
            if cut < len(g.nodes):
                self.steps.append(cut)
            start = cut + 1
        self.bodies = {i: {k: Body(backend, b) for k, b in bodies(g.nodes[i]).items()} for i in cuts}

    def poison(self, byte: int) -> None:
        """Fill the scratch memory of every part's runner with `byte` (the conformance kit's
        check that each kernel writes its whole output)."""
        for r in [s.runner for s in self.steps if isinstance(s, Part) and s.runner is not None]:
            if hasattr(r, "poison"):
                r.poison(byte)
            elif (arena := getattr(r, "arena", None)) is not None:
                arena.view(np.uint8).fill(byte)

    def _leaf(self, ref, inputs: dict):
        n = self.graph.nodes[ref[0]]
        if n.op == "input":
            return inputs[n.name]
        if n.op == "constant":
            return self.graph.constants[n.name]
        return self.backend.to_host((self.params if n.op == "param" else self.states)[n.name])

    def run(self, inputs: dict) -> dict:
        vals: dict = {}

        def get(ref):
            ref = tuple(ref)
            if ref not in vals:
                vals[ref] = self._leaf(ref, inputs)
            return vals[ref]

        for step in self.steps:
            if isinstance(step, Part):
                for ref in step.reads.values():
                    get(ref)
                step.run(vals)
            else:
                self._control(step, [get(r) for r in self.graph.nodes[step].inputs], vals)
        return {name: np.array(get(r)) for name, r in self.graph.outputs}

    def _control(self, i: int, args: list, vals: dict) -> None:
        n = self.graph.nodes[i]
        body = self.bodies[i]

        res = LOOPS[n.op](n.a, lambda key, xs: body[key](xs), n.outs, *args)
        for k, (s, r) in enumerate(zip(n.outs, res)):
            vals[(i, k)] = np.array(r, s.dtype.np).reshape(s.dims)


__all__ = ["host_run", "compile_lir", "compile_graph", "HostControlRunner", "Body"]
