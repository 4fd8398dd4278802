"""The backend interface (after lightning-thunder's executors: a backend may decline an
op, with a reason, and is chosen by name or priority)."""
from __future__ import annotations

import abc
import contextlib

import numpy as np

from ..ir.control import CONTROL_OPS
from ..ir.dtype import DType
from ..ir.lir import LirModule
from .runner import Runner


def best_time(fn, times: int = 5) -> float:
    """Seconds of the fastest of `times` calls of fn() after one warm-up call (host clock)."""
    import time

    fn()
    best = float("inf")
    for _ in range(times):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def kernel_path(name: str, why: str, instead: str) -> dict:
    """One entry of Backend.kernel_paths: kernel path `name`, on where `why` (the reason it
    cannot run here) is empty, else off with that reason and what runs instead."""
    return {"path": name, "on": not why, "reason": f"{why}; {instead}" if why else ""}


class Backend(abc.ABC):
    name: str = ""
    priority: int = 0
    target: str = "generic"                  # fusion pattern set (passes/fusion.py TARGETS)
    dtypes: frozenset = frozenset(DType)
    overlaps: bool = False          # Runner.submit returns before the run ends (a device's queue)

    def configure(self, config) -> "Backend":
        """This backend set up for a profile's [backend] section (a device selector, a thread
        count); a backend with one device has nothing to select and one without a thread pool
        of its own ignores `threads`."""
        if config.device:
            from ..ir.errors import BackendError

            raise BackendError(f"backend {self.name!r} has no device selector; "
                               f"[backend] device = {config.device!r} cannot apply")
        return self

    def availability(self) -> tuple:
        """(available, reason when not)."""
        return True, ""

    def kernel_paths(self) -> list:
        """The kernel choices this backend makes by the machine it finds: [kernel_path(...)].
        `rlx plugins` lists them, so a slower fallback is never silent. Only an available
        backend is asked."""
        return []

    @abc.abstractmethod
    def supported_ops(self) -> set:
        """Op names this backend implements: at least rlx_core.ir.composites.PRIMITIVES (checked
        when it registers); an op it lacks that has a composite is legalized into others."""

    def runnable_ops(self) -> set:
        """The ops a graph for this backend may hold once legalized: its own, and control flow
        (if_, while_, scan), which core runs from the host where it lacks them."""
        return set(self.supported_ops()) | set(CONTROL_OPS)

    def expression_renderers(self) -> tuple:
        """The renderers (rlx_core.ir.expr) its generated elementwise kernels are written with,
        one per compute dtype or dialect; when the backend registers, every entry of the
        expression table is rendered with each, so a formula a dialect cannot write is an error
        then, naming the op, the backend and the missing piece. () for a backend without
        generated kernels."""
        return ()

    def supports_custom(self, name: str) -> bool:
        from ..ir.custom import custom_ops

        op = custom_ops().get(name)
        return op is not None and self.name in op.kernels

    def supports_scheme(self, scheme: str) -> bool:
        """Whether its dequant_matmul / dequantize kernels read packed weights of this quant
        scheme (a name); the pipeline names the backends that do when one does not."""
        return True

    def check_dtype(self, dtype: DType, where: str) -> None:
        if dtype not in self.dtypes:
            from ..ir.errors import BackendError

            raise BackendError(f"backend {self.name!r} cannot compute in {dtype.value} ({where}); "
                               f"it supports {sorted(d.value for d in self.dtypes)}")

    # host data parallelism: parts of a batch run at once in threads, each on its own runner
    def data_parallel(self) -> int:
        """How many parts of a batch are worth running concurrently in threads (1: none)."""
        return 1

    def parallel_scope(self):
        """A context manager held while parts run concurrently (the NumPy backend sets its
        BLAS to one thread meanwhile)."""
        return contextlib.nullcontext()

    def part_scope(self):
        """A context manager each part's thread holds while its part runs (a backend whose
        kernels spread over threads keeps a part's on its own core: parts run side by side)."""
        return contextlib.nullcontext()

    def copy_bandwidth(self, nbytes: int = 1 << 27) -> float:
        """Bytes per second a large array copy moves here, read and written bytes both counted
        (2x the array per copy), best of 5: the yardstick of the profiler's achieved GB/s.
        This one copies host memory with numpy; a device backend measures its own memory."""
        src = np.ones(nbytes // 8, np.float64)
        dst = np.empty_like(src)
        return 2 * src.nbytes / best_time(lambda: np.copyto(dst, src))

    # residency: params and state live on the device between runs
    def to_device(self, array: np.ndarray):
        return array

    def adopt(self, array: np.ndarray):
        """A weight that every run reads, made resident (to_device here). A CPU backend may
        copy one read from a file mapping into its own memory; weights only the load-time
        prologue reads go through to_device, so they are never copied."""
        return self.to_device(array)

    def to_host(self, value) -> np.ndarray:
        return np.asarray(value)

    def zeros(self, shape: tuple, dtype: DType):
        return np.zeros(shape, dtype.np)

    def copy_into(self, dst, index: tuple, src, src_index: tuple):
        """dst[index] = src[src_index] (ints and slices) for two resident buffers: how a
        scheduler moves one request's KV cache rows between caches. Returns the buffer that
        holds the result: dst, written in place, or (this default, for buffers that are not
        numpy arrays) a new one made through the host; a device backend overrides it."""
        def write(a):
            a[index] = self.to_host(src)[src_index]
        return self._written(dst, write)

    def copy_regions(self, jobs: list) -> list:
        """For each job (dst, index, src, src_index): dst[index] = src[src_index], as copy_into
        does it (a device backend: one launch for them all, so no job may read what another
        writes): a prefill's KV rows placed into the batch cache, every state at once. Returns
        the buffer holding each job's result (a later job on the same dst writes into it)."""
        out: list = []
        latest: dict = {}
        for dst, index, src, src_index in jobs:
            latest[id(dst)] = self.copy_into(latest.get(id(dst), dst), index, src, src_index)
            out.append(latest[id(dst)])
        return out

    def join_blocks(self, jobs: list) -> list:
        """For each job (dst, index, srcs, axis): dst[index] = srcs joined along `axis` (of
        dst[index]; ints and slices): how a prefix cache restores a prompt's cached blocks into
        every state at once (a device backend: one launch, not one a state or a block). Returns
        the buffers that hold the results, as copy_into does."""
        def joined(srcs, axis, index):
            return lambda a: np.concatenate([self.to_host(s) for s in srcs], axis=axis, out=a[index])
        return [self._written(dst, joined(srcs, axis, index)) for dst, index, srcs, axis in jobs]

    def split_blocks(self, jobs: list) -> list:
        """For each job (src, index, axis, parts): `parts` new resident buffers holding src[index]
        cut into equal parts along `axis` (whose index is a slice with a start and a stop): a
        prefix cache keeping a prompt's new blocks of every state at once. One list a job."""
        out = []
        for src, index, axis, parts in jobs:
            start, step = index[axis].start, (index[axis].stop - index[axis].start) // parts
            out.append([self.copy_of(src, index[:axis] + (slice(start + k * step, start + (k + 1) * step),)
                                     + index[axis + 1:]) for k in range(parts)])
        return out

    def _written(self, dst, write):
        """dst after write(array): in place where dst is a numpy array, else a host copy of
        it written and made resident again (the defaults of copy_into / join_blocks)."""
        if isinstance(dst, np.ndarray):
            write(dst)
            return dst
        host = np.array(self.to_host(dst))
        write(host)
        return self.to_device(host)

    def copy_of(self, src, index: tuple):
        """A new resident buffer holding src[index] (ints and slices): a prefix cache's copy of
        one block of a state."""
        return self.to_device(np.array(self.to_host(src)[index]))

    def release_cache(self) -> None:
        """Give back memory kept for reuse (a pool's free blocks, a shared arena grown for a
        one-off run such as deriving weights at load); the host backends keep nothing."""

    def memory_stats(self) -> dict:
        """Bytes this backend holds beside params and states, where it knows them
        (`arena_bytes` shared by its runners, `pool_total_bytes` / `pool_used_bytes` of a
        memory pool); {} when its runners own their memory (model.memory_report counts it)."""
        return {}

    def planned_layouts(self, g) -> tuple:
        """(views, placed, early) for ir.lir.plan on the static graph `g`: nodes this backend
        runs as views of their input (transposes whose readers take strides:
        strided_transposes), (concat, input) pairs whose input's producer writes straight into
        the concat's output, and nodes whose output their input's producer may write; none by
        default."""
        return frozenset(), frozenset(), frozenset()

    def compile_runner(self, lir: LirModule, params: dict, states: dict) -> Runner:
        """compile(), or, where the graph holds control flow this backend lacks, a runner that
        runs it from the host between parts compile() makes (backends/host_control.py): what
        the pipeline calls."""
        from .host_control import compile_lir

        return compile_lir(self, lir, params, states)

    @abc.abstractmethod
    def compile(self, lir: LirModule, params: dict, states: dict) -> Runner:
        """A Runner for this LIR, reading the resident `params` and `states` (name -> value)."""


def keeps_last_axis(n) -> bool:
    """Whether node n is a transpose that leaves the last axis in place (its view then has unit
    last stride, which strided kernels take)."""
    perm = n.a.get("perm") if n.op == "transpose" else None
    if not perm:
        return False
    return perm[-1] == len(perm) - 1


def strided_transposes(g, readers: dict, writers) -> frozenset:
    """The transposes of `g` keeping the last axis that a backend can run as views
    (Backend.planned_layouts): where every reader takes them through strides (`readers`: op ->
    the input positions its kernel reads strided, None for all), or where a `writers` op's
    output is read by the transpose alone (that op then writes its rows in the transposed
    order, so the view is contiguous)."""
    def takes_strides(c: int, ref: tuple) -> bool:
        at = readers.get(g.nodes[c].op, ())
        return all(at is None or k in at for k, r in enumerate(g.nodes[c].inputs) if tuple(r) == ref)

    uses = g.consumers()
    views = set()
    for i, n in enumerate(g.nodes):
        if not keeps_last_axis(n):
            continue
        src = tuple(n.inputs[0])
        users = uses.get((i, 0), [])
        if ((g.nodes[src[0]].op in writers and uses.get(src) == [i])
                or (users and all(c >= 0 and takes_strides(c, (i, 0)) for c in users))):
            views.add(i)
    return frozenset(views)
