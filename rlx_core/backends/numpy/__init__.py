"""The embedded default backend: NumPy on the CPU, registered like any plugin."""
from __future__ import annotations

import functools
import math
import os
import time

import numpy as np

from ...ir.errors import BackendError, RlxError
from ...ir.lir import ALIGN, LirModule
from ...ir.ops import OPS, Level
from ...plugins.hookspecs import hookimpl
from ..base import Backend, Runner
from .blas import blas_threads, single_threaded_blas
from ...ir.numpy_kernels import KERNELS, VIEWS


def _first_input(a, x, *rest):
    """A node its backend runs as a view of its first input (Backend.planned_layouts)."""
    return x


# planned views that are not their input as is: op -> the view (a transpose's strided view)
PLANNED_VIEWS = {"transpose": lambda a, x: x.transpose(a["perm"])}


class NumpyRunner(Runner):
    """Executes the LIR node by node: one preallocated arena, `out=` writes, params and
    states resident. Steps are prepared once so a run is a tight loop."""
    backend_name = "numpy"            # in errors; a subclass that swaps kernels names itself

    def __init__(self, lir: LirModule, params: dict, states: dict):
        g = lir.graph
        raw = np.empty(lir.arena_bytes + ALIGN, np.uint8)
        shift = (-raw.ctypes.data) % ALIGN
        self.arena = raw[shift:shift + lir.arena_bytes]
        self.name = g.name
        index: dict = {}
        vals: list = []
        for i, n in enumerate(g.nodes):
            for k in range(len(n.outs)):
                index[(i, k)] = len(vals)
                vals.append(None)
        self.inputs: dict = {}
        self.steps: list = []
        for i, n in enumerate(g.nodes):
            a = n.a
            if n.op == "input":
                self.inputs[n.name] = (index[(i, 0)], n.outs[0])
            elif n.op == "param":
                vals[index[(i, 0)]] = params[n.name]
            elif n.op == "state":
                vals[index[(i, 0)]] = states[n.name]
            elif n.op == "constant":
                vals[index[(i, 0)]] = g.constants[n.name]
            else:
                ins = [index[tuple(r)] for r in n.inputs]
                if n.op in VIEWS:
                    self.steps.append((i, True, VIEWS[n.op], a, ins, index[(i, 0)]))
                    continue
                if lir.slots[(i, 0)].home == "view":     # planned so by the backend (planned_layouts)
                    self.steps.append((i, True, PLANNED_VIEWS.get(n.op, _first_input), a, ins, index[(i, 0)]))
                    continue
                outs = []
                for k, s in enumerate(n.outs):
                    sl = lir.slots[(i, k)]
                    arr = self.arena[sl.offset:sl.offset + s.nbytes()].view(s.dtype.np)
                    vals[index[(i, k)]] = arr = self.laid_out(lir, i, k, arr)
                    outs.append(arr)
                fn = KERNELS[n.op]
                if n.op == "dequant_matmul":
                    fn = _rows_in_threads(fn, math.prod(g.shape_of(n.inputs[1]).dims))
                self.steps.append((i, False, fn, a, ins, outs))
        self.steps = _fold_fixed_views(self.steps, vals, {slot for slot, _ in self.inputs.values()})
        self.vals = vals
        self.graph = g
        self.outputs = [(name, index[tuple(r)]) for name, r in g.outputs]
        self._calls = None            # bound_calls, made at the first run (a subclass swaps steps first)

    def laid_out(self, lir: LirModule, i: int, k: int, flat: np.ndarray) -> np.ndarray:
        """Node i's output k on its arena bytes `flat`: in C order here; a runner whose kernel
        for that node writes any strides may order the bytes otherwise (NumbaRunner)."""
        return flat.reshape(lir.graph.nodes[i].outs[k].dims)

    profile_clock = "host clock"

    def run(self, inputs: dict) -> dict:
        self._bind(inputs)
        self._execute_bound()
        return self._outputs()

    def run_profiled(self, inputs: dict) -> tuple:
        """run() with the host clock read after every step (each step's time runs from the
        end of the one before, so the times add up to the whole loop)."""
        self._bind(inputs)
        clock, times = time.perf_counter, []
        t0 = clock()
        for step in self.steps:
            self._execute((step,))
            t1 = clock()
            times.append((step[0], t1 - t0))
            t0 = t1
        return self._outputs(), times

    def _bind(self, inputs: dict) -> None:
        vals = self.vals
        for name, (slot, _) in self.inputs.items():
            vals[slot] = inputs[name]

    def _outputs(self) -> dict:
        return {name: np.array(self.vals[slot]) for name, slot in self.outputs}

    def _execute_bound(self) -> None:
        """All steps as calls bound at the first run (`bound_calls`): a decode step is
        hundreds of small kernels, and gathering each one's operands every token cost more
        than some of the kernels."""
        if self._calls is None:
            self._calls = bound_calls(self.steps, self.vals, {s for s, _ in self.inputs.values()})
        calls, k = self._calls, 0
        try:
            for k, call in enumerate(calls):
                call()
        except Exception as e:
            self._failed(self.steps[k][0], e)

    def _execute(self, steps) -> None:
        """Run `steps` (all of self.steps, or one) on the bound values; a failure names its node."""
        vals = self.vals
        i = -1
        try:
            for i, is_view, fn, a, ins, out in steps:
                if is_view:
                    vals[out] = fn(a, *[vals[j] for j in ins])
                else:
                    fn(a, out, *[vals[j] for j in ins])
        except Exception as e:
            self._failed(i, e)

    def _failed(self, i: int, e: Exception):
        if isinstance(e, RlxError):
            raise type(e)(f"graph {self.name!r} node %{i} ({self.graph.nodes[i].op}): {e}") from None
        raise BackendError(f"{self.backend_name} backend: graph {self.name!r} node %{i} "
                           f"({self.graph.nodes[i].op}) failed: {type(e).__name__}: {e}") from e


PARALLEL_BYTES = 1 << 20      # a packed weight this large decodes in parts side by side
_POOL: list = []            # [executor, its worker count] once made


def _rows_in_threads(kernel, nbytes: int):
    """`kernel` (dequant_matmul) with a large packed weight's rows split into one part per
    BLAS thread, run side by side: decoding the weight is most of such a step and numpy's
    ufuncs release the GIL, so one thread would leave the other cores idle. BLAS runs at
    one thread meanwhile. Inside a data-parallel scope (BLAS already at one thread) it runs
    as it is."""
    if nbytes < PARALLEL_BYTES:
        return kernel

    def step(a, out, x, w, b=None):
        parts = min(blas_parts(), w.shape[0])
        if parts < 2:
            return kernel(a, out, x, w, b)
        o, cuts = out[0], np.linspace(0, w.shape[0], parts + 1).astype(int)

        def part(j):
            r, e = cuts[j], cuts[j + 1]
            kernel(a, [o[..., r:e]], x, w[r:e], None if b is None else b[r:e])
        if not _POOL or _POOL[1] < parts:
            from concurrent.futures import ThreadPoolExecutor

            _POOL[:] = [ThreadPoolExecutor(parts, thread_name_prefix="rlx-numpy"), parts]
        with single_threaded_blas():
            list(_POOL[0].map(part, range(parts)))
    return step


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def blas_parts() -> int:
    """Parts to run side by side: one per BLAS thread (when the BLAS count can be read), at
    most one per usable core; 1 inside a single-threaded BLAS scope."""
    n = blas_threads()
    return 1 if not n or n < 2 else max(1, min(n, _cores()))


def _fold_fixed_views(steps: list, vals: list, dynamic: set) -> list:
    """Views of buffers that never move (arena slots, params, states, constants) are taken
    once here instead of every run: a decode step has hundreds of reshapes and narrows. A
    view of an input (or of such a view), a write (kv_write, assign: `returns_cache`) and a
    reshape that had to copy stay steps."""
    kept = []
    for step in steps:
        _, is_view, fn, a, ins, out = step
        if is_view and not getattr(fn, "returns_cache", False) and not dynamic.intersection(ins):
            v = fn(a, *[vals[j] for j in ins])
            if np.may_share_memory(v, vals[ins[0]]):
                vals[out] = v
                continue
        if is_view:
            dynamic.add(out)
        kept.append(step)
    return kept


def bound_calls(steps: list, vals: list, inputs: set) -> list:
    """Each step as a call without arguments: its operands bound once where none of them
    moves between runs (a graph input or a view of one moves; such a step gathers them each
    run). A view marked `returns_cache` (kv_write) returns the cache it wrote into, so its
    output moves only with the cache. A step with a `bind(a, out, *operands)` makes that
    call itself, doing once what it would do every run (reshapes, layout checks: a few
    microseconds, hundreds of times a decode token)."""
    dynamic = set(inputs)
    calls = []
    for i, is_view, fn, a, ins, out in steps:
        if dynamic.intersection(ins) or (is_view and not getattr(fn, "returns_cache", False)):
            calls.append(functools.partial(_gathered, vals, is_view, fn, a, ins, out))
            if is_view:
                dynamic.add(out)
            continue
        args = [vals[j] for j in ins]
        if is_view:
            vals[out] = args[0]
            calls.append(functools.partial(fn, a, *args))
        else:
            bind = getattr(fn, "bind", None)
            calls.append(bind(a, out, *args) if bind is not None else functools.partial(fn, a, out, *args))
    return calls


def _gathered(vals, is_view, fn, a, ins, out) -> None:
    if is_view:
        vals[out] = fn(a, *[vals[j] for j in ins])
    else:
        fn(a, out, *[vals[j] for j in ins])


class NumpyBackend(Backend):
    name = "numpy"
    priority = 10
    target = "numpy"

    def expression_renderers(self) -> tuple:
        from ...ir.numpy_kernels import NUMPY

        return (NUMPY,)

    def supported_ops(self) -> set:
        # what has a kernel: an op added to the table without one is a compile-time BackendError
        return {n for n, d in OPS.items() if d.level is Level.LEAF or n in KERNELS or n in VIEWS}

    def compile(self, lir: LirModule, params: dict, states: dict) -> Runner:
        return NumpyRunner(lir, params, states)

    def data_parallel(self) -> int:
        """One part per BLAS thread (when the BLAS count can be set): a part's numpy passes
        (softmax, LayerNorm, GELU, ...) are single-threaded, so one run alone leaves the
        other cores idle between GEMMs; parts side by side keep every core busy."""
        return blas_parts()

    def parallel_scope(self):
        return single_threaded_blas()


@hookimpl
def rlx_register_backends(register):
    register(NumpyBackend())
