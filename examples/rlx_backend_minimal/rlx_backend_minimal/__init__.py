"""A backend of primitives only, in NumPy: the example to copy when adding a device to RLX.

It implements the ops of `kernels.PRIMITIVES` and nothing else. Every other op reaches it
already taken apart: the pipeline's `legalize` decomposes a fused op the backend lacks into
primitives, and core runs control flow (if_, while_, scan) from the host, compiling each
body with this same backend (rlx_core.backends.host_control). It is slow on purpose (no
fusion, a copy per node): speed is what a real backend adds, one fused kernel at a time.
"""
from __future__ import annotations

import time

import numpy as np

from rlx_core.backends.base import Backend, Runner
from rlx_core.ir.errors import BackendError, RlxError
from rlx_core.ir.lir import LirModule
from rlx_core.plugins.hookspecs import hookimpl

from .kernels import KERNELS, PRIMITIVES, VIEWS

LEAVES = ("input", "param", "state", "constant")


class MinimalRunner(Runner):
    """Runs the LIR's nodes in order. The LIR's buffer plan gives each computed value a slice
    of one arena (`arena`, bytes: the conformance kit fills it with NaN bytes before a run, so
    a kernel that leaves part of its output unwritten is caught); a kernel's result is copied
    into its slice. Views and in-place state writes are NumPy views, as the plan has them."""

    profile_clock = "host clock"

    def __init__(self, lir: LirModule, params: dict, states: dict):
        self.graph, self.params, self.states = lir.graph, params, states
        self.arena = np.zeros(lir.arena_bytes, np.uint8)
        self.buffers = {}                   # (node, output) -> its slice of the arena
        for (i, k), slot in lir.slots.items():
            if slot.home == "arena":
                s = self.graph.nodes[i].outs[k]
                raw = self.arena[slot.offset:slot.offset + s.nbytes()]
                self.buffers[(i, k)] = raw.view(s.dtype.np).reshape(s.dims)

    def run(self, inputs: dict) -> dict:
        return self._run(inputs, None)

    def run_profiled(self, inputs: dict) -> tuple:
        """run() with the host clock read after every node (what `Executable.profile` shows)."""
        times: list = []
        return self._run(inputs, times), times

    def _run(self, inputs: dict, times: list | None) -> dict:
        vals = {}
        start = time.perf_counter()
        for i, node in enumerate(self.graph.nodes):
            try:
                results = self._node(node, [vals[tuple(r)] for r in node.inputs], inputs)
            except RlxError as e:
                raise type(e)(f"graph {self.graph.name!r} node %{i} ({node.op}): {e}") from None
            except Exception as e:
                raise BackendError(f"minimal backend: graph {self.graph.name!r} node %{i} ({node.op}) "
                                   f"failed: {type(e).__name__}: {e}") from e
            for k, value in enumerate(results):
                vals[(i, k)] = self._keep((i, k), value)
            if times is not None and node.op not in LEAVES:
                end = time.perf_counter()
                times.append((i, end - start))
                start = end
        return {name: np.array(vals[tuple(r)]) for name, r in self.graph.outputs}

    def _node(self, node, args: list, inputs: dict) -> tuple:
        """The node's outputs: a leaf's value, a view, or a kernel's result(s)."""
        if node.op in LEAVES:
            return ({"input": inputs, "param": self.params, "state": self.states,
                     "constant": self.graph.constants}[node.op][node.name],)
        if node.op in VIEWS:
            return (VIEWS[node.op](node.a, *args),)
        out = KERNELS[node.op](node.a, *args)
        return out if isinstance(out, tuple) else (out,)

    def _keep(self, ref: tuple, value):
        """A computed value copied into its planned buffer (converted to its dtype there)."""
        buf = self.buffers.get(ref)
        if buf is None:                     # a leaf or a view: no buffer of its own
            return value
        if np.shape(value) != buf.shape:
            raise BackendError(f"minimal backend: graph {self.graph.name!r} node %{ref[0]} "
                               f"({self.graph.nodes[ref[0]].op}) gave shape {list(np.shape(value))}, "
                               f"the graph says {list(buf.shape)}")
        np.copyto(buf, value, casting="unsafe")
        return buf


class MinimalBackend(Backend):
    name = "minimal"
    priority = -50                  # below every real backend: used only when named

    def supported_ops(self) -> set:
        return set(PRIMITIVES) | set(LEAVES)

    def compile(self, lir: LirModule, params: dict, states: dict) -> Runner:
        missing = sorted({n.op for n in lir.graph.nodes} - self.supported_ops())
        if missing:
            raise BackendError(f"minimal backend: graph {lir.graph.name!r} holds op(s) {missing}, "
                               f"which it does not implement; it implements {sorted(PRIMITIVES)}")
        return MinimalRunner(lir, params, states)


@hookimpl
def rlx_register_backends(register):
    register(MinimalBackend())
