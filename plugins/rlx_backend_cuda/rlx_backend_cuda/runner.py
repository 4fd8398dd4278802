"""CudaRunner: a shape-specialized LIR graph as a list of prepared kernel launches.

Build (once per specialization): every value gets a device array — the arena slice the
LIR plan gives it (one arena, allocated once and shared by the backend's runners, which
run one at a time on one stream), a resident param/state, an uploaded constant, an input
staging buffer, or a strided view of another value (reshape/narrow/expand/kv_write are
free). Every op becomes one or a few launches with their arguments fixed, so a run is:
one host->device copy of the inputs, the launches (a CUDA graph replay from the second
run on), device->host copies of the outputs, one synchronize.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
from rlx_core.backends.base import Runner
from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError, ModelError, RlxError
from rlx_core.pipeline import states_moved

from . import codegen, device
from .ops import BUILDERS, STRIDED_WRITERS, VIEW_BUILDERS, GemvSums, owner_chain, part_layout
from .values import CONFIG, V, contiguous_strides, nocopy_reshape_strides

EW_VEC = 8                   # elements a thread of a contiguous elementwise kernel moves at once
# ops a complex64 value may come out of: leaves, FFTs, views and copies, and elementwise
# arithmetic (codegen names any other elementwise op given a complex operand)
LEAVES = {"input", "param", "state", "constant"}
COMPLEX_OPS = LEAVES | {"fft", "ifft", "rfft", "irfft", "reshape", "narrow", "expand", "transpose",
                        "concat", "binary", "activation", "cast", "where", "fused_elementwise"}
# ops whose launches write their own node's values and nothing else: a run that fetches none
# of the graph outputs such a node alone feeds skips its launches (unfetched_only)
PRUNABLE = {"binary", "activation", "cast", "where", "fused_elementwise", "reduce", "argmax"}

def pinned(n: int) -> np.ndarray:
    """n bytes of page-locked host memory (asynchronous copies to and from the device)."""
    return np.frombuffer(device.cupy().cuda.alloc_pinned_memory(n), np.uint8, n)


def _grid(n: int, block: int, sms: int) -> tuple:
    return (max(1, min((n + block - 1) // block, sms * 32)),)


class Step:
    """One launch (or host call) of the step list; reads: the (address, bytes) ranges of
    weights it streams front to back, side by side (a decode GEMV's; what gpu_kernels' knock-out tells
    its GEMVs apart by)."""
    __slots__ = ("node", "op", "fn", "capturable", "reads")

    def __init__(self, node, op, fn, capturable=True, reads=()):
        self.node, self.op, self.fn, self.capturable, self.reads = node, op, fn, capturable, reads


def unfetched_only(g) -> dict:
    """node -> the names of the graph outputs its values reach, for PRUNABLE nodes whose values
    reach nothing else, directly or through other such nodes (a greedy decode step's f32
    logits and its sum: needed only on a re-run that fetches them)."""
    consumers = g.consumers()
    names: dict = {}
    for name, r in g.outputs:
        names.setdefault(tuple(r), set()).add(name)
    reach: dict = {}
    for i in range(len(g.nodes) - 1, -1, -1):
        refs = [(i, k) for k in range(len(g.nodes[i].outs))]
        users = [c for r in refs for c in consumers.get(r, ())]
        if g.nodes[i].op in PRUNABLE and all(c == -1 or c in reach for c in users):
            reach[i] = frozenset().union(*(names.get(r, ()) for r in refs),
                                         *(reach[c] for c in users if c >= 0))
    return reach


class Build:
    """Build-time context: allocation, kernels, and the step list under construction."""

    def __init__(self, runner):
        self.r = runner
        self.cp = device.cupy()
        self.stream = runner.backend.stream()
        self.sms = device.info().get("sms", 80)
        self.hip = bool(device.info().get("hip"))
        self.cc = device.info().get("cc", (8, 0))
        self.steps: list = []
        self.node = -1
        self.op = ""
        self.keep: list = []          # host buffers the launches point at (alpha/beta)
        # producer/consumer fusion: a step may compute a later node too (its epilogue)
        self.vals: dict = {}          # (node, out) -> V built so far
        self.uses = runner.lir.graph.consumers()     # (node, out) -> consumer nodes (-1: output)
        self.absorbed: set = set()    # nodes an earlier step already computed
        self.node_local: dict = {}    # (purpose, dtype) -> buffer shared by the nodes (node_buffer)
        self.gemv_norms: dict = {}    # (node, out) -> ops.GemvNorm its consuming GEMV computes
        self.int8_x: dict = {}        # (fake_quantize node, 0) -> the int8 rows its GEMVs read (ops)
        self.gemv_sums = GemvSums()   # the sums of squares those GEMVs read, and who zeroes them
        self.waiting_norms: dict = {}  # rms_norm node -> the earlier rms_norm sharing its launch (ops)
        self.rope_norms: dict = {}    # rms_norm node -> ops.RopeNorm the rope reading it computes
        self.attn_ropes: dict = {}    # attention node -> ops.AttnRope: the rope it does in its launch
        self.attn_epilogues: dict = {}  # elementwise node -> {"done": ...} its attention may compute it (ops)
        self.resident: list = []      # (first, end) byte addresses of the params and constants
        g = runner.lir.graph
        self.view_transposes = {i for i, n in enumerate(g.nodes)
                                if n.op == "transpose" and runner.lir.slots[(i, 0)].home == "view"}

    # -- fusion helpers
    @contextlib.contextmanager
    def at_node(self, i: int):
        """Steps added meanwhile are node i's (a step built at a later node: profiles and
        errors name the node it computes)."""
        at = self.node, self.op
        self.node, self.op = i, self.r.lir.graph.nodes[i].op
        try:
            yield
        finally:
            self.node, self.op = at

    def sole_consumer(self, i: int, op: str, k: int = 0) -> int | None:
        """The one node using (i, k), if there is exactly one, it is an `op` and not an output."""
        use = self.uses.get((i, k), [])
        if len(use) == 1 and use[0] >= 0 and self.r.lir.graph.nodes[use[0]].op == op:
            return use[0]
        return None

    def counters(self, n: int):
        """n zeroed int32 counters a kernel leaves at zero again (outside `private`, so
        poisoning the scratch buffers for a test leaves them alone)."""
        arr = device.empty((n,), DType.I32, f"counters of node %{self.node} ({self.op})")
        arr.fill(0)
        self.r.counters.append(arr)
        return arr

    def keep_resident(self, arr) -> None:
        """Note a param's or constant's device array: bytes no kernel of the run writes."""
        self.resident.append((arr.data.ptr, arr.data.ptr + arr.nbytes))

    def written_by_no_kernel(self, v: V) -> bool:
        """Whether v's bytes lie in a param or a constant, which no kernel writes (the graph
        assigns only states): a kernel launched as a programmatic dependent (device.Kernel) may
        load them before it waits for the kernel before it."""
        if not v.size:
            return True
        reach = [(d - 1) * s for d, s in zip(v.arr.shape, v.arr.strides)]
        first = v.arr.data.ptr + sum(r for r in reach if r < 0)
        end = v.arr.data.ptr + sum(r for r in reach if r > 0) + v.arr.itemsize
        return any(lo <= first and end <= hi for lo, hi in self.resident)

    @staticmethod
    def disjoint(a: V, c: V) -> bool:
        """Whether two contiguous arrays share no byte (False when unsure): a step computing a
        later node's output early must not write bytes its own inputs still occupy."""
        if not (a.contiguous() and c.contiguous()):
            return False
        pa, pc = a.arr.data.ptr, c.arr.data.ptr
        return pa + a.arr.nbytes <= pc or pc + c.arr.nbytes <= pa

    def out_value(self, i: int, k: int = 0) -> V:
        """The arena array of node i's output k (made once; an epilogue may fill it early). A
        value the plan placed in a concat's output is its part there; an attention read only
        by a transpose the plan made a view lays its bytes out in that transpose's order
        (ops.planned_layouts)."""
        v = self.vals.get((i, k))
        if v is None:
            g = self.r.lir.graph
            s = g.nodes[i].outs[k]
            sl = self.r.lir.slots[(i, k)]
            if sl.home == "placed":
                v = self.vals[(i, k)] = self._placed(i, k, sl.base[0])
                return v
            use = self.uses.get((i, k), [])
            perm = (g.nodes[use[0]].a["perm"] if len(use) == 1 and use[0] in self.view_transposes
                    and g.nodes[i].op in STRIDED_WRITERS else tuple(range(len(s.dims))))
            arr = self.cp.ndarray(tuple(s.dims[p] for p in perm), device.storage_dtype(s.dtype),
                                  memptr=self.r.arena + sl.offset)
            v = V(arr.transpose(tuple(perm.index(j) for j in range(len(perm)))), s.dtype)
            self.vals[(i, k)] = v
        return v

    def _placed(self, i: int, k: int, c: int) -> V:
        g = self.r.lir.graph
        whole = self.out_value(c).arr.reshape(-1)
        for at, r in enumerate(g.nodes[c].inputs):
            own, chain = owner_chain(g, self.view_transposes, tuple(r))
            if own == (i, k):
                off, st = part_layout(g, c, at, chain)
                isz = whole.itemsize
                arr = self.cp.lib.stride_tricks.as_strided(whole[off:], g.nodes[i].outs[k].dims,
                                                           tuple(x * isz for x in st))
                return V(arr, g.nodes[i].outs[k].dtype)
        raise BackendError(f"cuda backend: node %{i} is placed in concat %{c}, which does not read it")

    # -- memory
    def buffer(self, shape, dt: DType, what: str = "scratch") -> V:
        arr = device.empty(tuple(shape), dt, f"{what} of node %{self.node} ({self.op})")
        self.r.private.append(arr)
        return V(arr, dt)

    def node_buffer(self, shape, dt: DType, what: str) -> V:
        """Scratch a node reads and writes only within its own steps (attention partials,
        roped q and k): one buffer per purpose for all the runner's nodes, which run one after
        another on its stream (16 layers each holding their own partials was 1 GB at batch 32)."""
        n = math.prod(shape)
        arr = self.node_local.get((what, dt))
        if arr is None or arr.size < n:
            arr = device.empty((n,), dt, f"{what} (node-local scratch, from node %{self.node})")
            self.r.private.append(arr)
            self.node_local[(what, dt)] = arr
        return V(arr[:n].reshape(tuple(shape)), dt)

    # -- launches
    def kernel(self, source: str, name: str, dynamic_smem: int = 0):
        return device.kernel(source, name, self.op, dynamic_smem)

    def launch(self, fn, grid, block, args, capturable=True):
        stream = self.stream
        grid, block, args = tuple(grid), tuple(block), tuple(args)

        def run():
            fn(grid, block, args, 0, stream)
        self.steps.append(Step(self.node, self.op, run, capturable))

    def add(self, run, capturable=True, reads=()):
        self.steps.append(Step(self.node, self.op, run, capturable, reads))

    # -- generic elementwise / copies
    def elementwise(self, program, ins: list, out: V) -> None:
        n = out.size
        if n == 0:
            return
        cp = self.cp
        views = []
        for v in ins:
            a = v.arr if v.shape == out.shape else cp.broadcast_to(v.arr, out.shape)
            views.append(V(a, v.dt))
        views.append(out)
        shape, strides = codegen.collapse(out.shape, [list(v.es) for v in views])
        rank = len(shape)
        contig = list(contiguous_strides(shape))
        row = [0] * (rank - 1) + [1]
        kinds = []
        for st in strides:
            if all(s == 0 for s in st):
                kinds.append("z")
            elif list(st) == contig:
                kinds.append("c")
            elif rank > 1 and list(st) == row:
                kinds.append("r")            # a bias broadcast over the rows
            else:
                kinds.append("s")
        if kinds[-1] == "z" and n > 1:
            raise BackendError(f"cuda backend: node %{self.node} ({self.op}) writes a broadcast view")
        maxoff = max([n] + [sum(abs(s) * (d - 1) for s, d in zip(st, shape)) for st in strides])
        idx64 = maxoff >= 2 ** 31 - 2 ** 26
        vec = EW_VEC if self._vectors(views, kinds, n, shape) else 1
        src = codegen.elementwise_source(program, [v.dt for v in ins], out.dt, kinds, rank, idx64, vec)
        fn = self.kernel(src, "rlx_ew")
        itype = np.int64 if idx64 else np.int32
        args = [v.arr for v in views] + [itype(n)]
        if "s" in kinds or "r" in kinds:
            args += [itype(d) for d in shape]
            for k, kd in enumerate(kinds):
                if kd == "s":
                    args += [itype(s) for s in strides[k]]
        self.launch(fn, _grid(n // vec, 256, self.sms), (256,), args)

    @staticmethod
    def _vectors(views: list, kinds: list, n: int, shape: tuple) -> bool:
        """Whether EW_VEC elements a thread can move as aligned vectors: no strided operand,
        the output contiguous, n and a row vector's length multiples of EW_VEC, and every
        vector operand's address aligned to EW_VEC elements."""
        if "s" in kinds or kinds[-1] != "c" or n % EW_VEC or ("r" in kinds and shape[-1] % EW_VEC):
            return False
        return all(v.arr.data.ptr % (v.arr.itemsize * EW_VEC) == 0 for v, k in zip(views, kinds) if k in "cr")

    def copy(self, src: V, dst: V) -> None:
        """dst <- src (any strides, dtype conversion), one kernel: 16 bytes a thread where
        both walk their last axis contiguously in 16-byte aligned chunks (a transpose that
        keeps the head dim, a concat, a contiguous copy), else one element a thread."""
        if src.dt is dst.dt and CONFIG["copy16"] and self._copy16(src, dst):
            return
        self.elementwise(((("cast", (("dtype", dst.dt.value),), (0,))),), [src], dst)

    def _copy16(self, src: V, dst: V) -> bool:
        n, isz = dst.size, dst.arr.itemsize
        a = src.arr if src.shape == dst.shape else self.cp.broadcast_to(src.arr, dst.shape)
        if n == 0 or isz > 8 or a.itemsize != isz or a.data.ptr % 16 or dst.arr.data.ptr % 16:
            return False
        shape, strides = codegen.collapse(dst.shape, [[s // isz for s in a.strides], list(dst.es)])
        w = 16 // isz
        if not shape or shape[-1] % w or any(st[-1] != 1 or any(x < 0 or x % w for x in st[:-1])
                                             for st in strides):
            return False
        dims = list(shape[:-1]) + [shape[-1] // w]
        chunks = [[x // w for x in st[:-1]] + [1] for st in strides]
        fn = self.kernel(codegen.copy16_source(len(dims)), "rlx_copy16")
        i64 = np.int64
        self.launch(fn, _grid(n // w, 256, self.sms), (256,),
                    [a, dst.arr, i64(n // w)] + [i64(d) for d in dims] + [i64(x) for st in chunks for x in st])
        return True

    def contiguous(self, v: V, dt: DType | None = None) -> V:
        dt = dt or v.dt
        if v.contiguous() and dt is v.dt:
            return v
        out = self.buffer(v.shape, dt)
        self.copy(v, out)
        return out

    def rows(self, v: V) -> tuple:
        """(V, rows, n, row_stride) for a row kernel over the last axis."""
        shape = v.shape
        n = shape[-1] if shape else 1
        rows = math.prod(shape[:-1]) if shape else 1
        es = v.es
        if not shape:
            return v, 1, 1, 1
        if (n == 1 or es[-1] == 1):
            st = nocopy_reshape_strides(shape, es, (rows, n))
            if st is not None and (n == 1 or st[1] == 1):
                return v, rows, n, (st[0] if rows > 1 else n)
        c = self.contiguous(v)
        return c, rows, n, n

    def moved_last(self, v: V, axes: tuple) -> V:
        """v with `axes` moved to the end (a view when the layout allows it)."""
        rank = len(v.shape)
        perm = [i for i in range(rank) if i not in axes] + list(axes)
        if perm == list(range(rank)):
            return v
        return V(v.arr.transpose(perm), v.dt)


class CudaRunner(Runner):
    def __init__(self, backend, lir, params: dict, states: dict, private_arena: bool = False):
        self.backend = backend
        self.private_arena = private_arena    # a body runs while its graph's arena is live
        self.lir = lir
        self.params = params
        self.states = states
        self.name = lir.graph.name
        self._build()

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        cp = device.cupy()
        lir, g = self.lir, self.lir.graph
        self.private: list = []
        self.counters: list = []
        self.graph = None                 # the CUDA graph the last run launched
        self.graphs: dict = {}            # the steps it skips (frozenset) -> its captured CUDA graph
        self.graph_version = None
        self.runs = 0
        self.capture_failed = ""
        b = Build(self)
        self.stream = b.stream
        for i, n in enumerate(g.nodes):
            if n.op not in COMPLEX_OPS and any(s.dtype is DType.C64 for s in n.outs):
                raise BackendError(f"cuda backend: node %{i} ({n.op}) computes in complex64, which this "
                                   f"backend supports only in {sorted(COMPLEX_OPS - LEAVES)}")
        # arena (shared, grown monotonically)
        self.arena = (device.alloc(max(lir.arena_bytes, 256), f"the arena of graph {self.name!r}")
                      if self.private_arena else self.backend.arena(lir.arena_bytes))
        # error flag
        self.err = cp.zeros(4, np.int32)
        self.err_host = np.zeros(4, np.int32)
        # inputs: one device block and one pinned staging block
        ins = [(n.name, i, n.outs[0]) for i, n in enumerate(g.nodes) if n.op == "input"]
        offs, tot = [], 0
        for _, _, s in ins:
            offs.append(tot)
            tot += (s.nbytes() + 63) // 64 * 64
        self.in_bytes = tot
        self.in_dev = device.alloc(max(tot, 64), f"inputs of graph {self.name!r}")
        vals = b.vals
        self.inputs = {}
        for (name, i, s), off in zip(ins, offs):
            arr = cp.ndarray(s.dims, device.storage_dtype(s.dtype), memptr=self.in_dev + off)
            vals[(i, 0)] = V(arr, s.dtype)
            self.inputs[name] = (off, s.nbytes(), s)
        self.bound_states = {}
        self.states_seen = None
        consts: dict = {}
        for i, n in enumerate(g.nodes):
            b.node, b.op = i, n.op
            if n.op == "input":
                continue
            if n.op in ("param", "state"):
                table = self.params if n.op == "param" else self.states
                if n.name not in table:
                    raise BackendError(f"cuda backend: graph {self.name!r} {n.op} {n.name!r} is not bound")
                dv = self.backend.ensure_device(table, n.name)
                s = n.outs[0]
                if dv.dtype != s.dtype.np or tuple(dv.shape) != s.dims:
                    raise BackendError(f"cuda backend: {n.op} {n.name!r} is {dv.dtype}{list(dv.shape)} "
                                       f"but the graph needs {s}")
                vals[(i, 0)] = V(dv.data, s.dtype)
                if n.op == "state":
                    self.bound_states[n.name] = table[n.name]
                else:
                    b.keep_resident(dv.data)
                continue
            if n.op == "constant":
                if n.name not in consts:
                    consts[n.name] = device.from_host(np.asarray(g.constants[n.name]).astype(
                        n.outs[0].dtype.np, copy=False), f"constant {n.name!r}")
                vals[(i, 0)] = V(consts[n.name], n.outs[0].dtype)
                b.keep_resident(consts[n.name])
                continue
            ins_v = [vals[tuple(r)] for r in n.inputs]
            if lir.slots[(i, 0)].home == "view":       # (a value placed in a concat is not one)
                vals[(i, 0)] = VIEW_BUILDERS[n.op](b, n, ins_v)
                continue
            outs = [b.out_value(i, k) for k in range(len(n.outs))]
            if i in b.absorbed:
                continue
            fn = BUILDERS.get(n.op)
            if fn is None:
                raise BackendError(f"cuda backend: no kernel for op {n.op!r} (node %{i})")
            try:
                fn(b, n, ins_v, outs)
            except RlxError:
                raise
            except Exception as e:
                raise BackendError(f"cuda backend: building node %{i} ({n.op}) of graph {self.name!r} "
                                   f"failed: {type(e).__name__}: {e}") from e
        if b.waiting_norms:
            firsts = sorted(v[0] for v in b.waiting_norms.values())
            raise BackendError(f"cuda backend: graph {self.name!r}: the norms of nodes {firsts} waited "
                               "for a pair that never ran")
        if b.rope_norms:
            raise BackendError(f"cuda backend: graph {self.name!r}: the norms of nodes {sorted(b.rope_norms)} "
                               "were left to a rope that never ran")
        if b.attn_epilogues:
            raise BackendError(f"cuda backend: graph {self.name!r}: the nodes {sorted(b.attn_epilogues)} "
                               "were left to an attention's epilogue and never built")
        if b.attn_ropes:
            raise BackendError(f"cuda backend: graph {self.name!r}: the ropes of nodes "
                               f"{sorted(r.node for r in b.attn_ropes.values())} were left to an attention "
                               "that never ran")
        b.gemv_sums.close(b)
        if b.gemv_norms:
            raise BackendError(f"cuda backend: graph {self.name!r}: the norms {sorted(b.gemv_norms)} were "
                               "left to a GEMV that never ran (RLX_CUDA_GEMV_FUSION=0 builds them as "
                               "launches)")
        self.consts = consts
        # outputs: contiguous device sources, one pinned block
        b.node, b.op = len(g.nodes), "output"
        self.outputs = []
        otot = 16
        for name, r in g.outputs:
            v = vals[tuple(r)]
            if not v.contiguous():
                v = b.contiguous(v)
            nb = v.size * v.arr.itemsize
            self.outputs.append((name, v, otot, nb))
            otot += (nb + 63) // 64 * 64
        # pinned staging, two slots (a run can be enqueued while the one before runs): the
        # inputs' bytes, the outputs' bytes, the event that says the slot's run is done
        self.slots = [(pinned(max(tot, 64)), pinned(otot), cp.cuda.Event(disable_timing=True))
                      for _ in range(2)]
        self.slot = 0
        self.chain_mark = None            # (backend's runs, this runner's runs, slot) after a submit
        self.steps = b.steps
        self.keep = b.keep
        feeds = unfetched_only(g)
        self.prunable = [(k, feeds[st.node]) for k, st in enumerate(self.steps)
                         if st.op in PRUNABLE and st.node in feeds]
        self.capturable = all(s.capturable for s in self.steps) and not b.hip
        self.vals = vals
        cp.cuda.runtime.deviceSynchronize()

    # ------------------------------------------------------------------ run
    def _states_changed(self) -> bool:
        if states_moved(self.states, self.bound_states, self.states_seen):
            return True
        self.states_seen = getattr(self.states, "version", None)
        return False

    def _skipped(self, fetch: set | None) -> frozenset:
        """The indices of the steps whose values reach only graph outputs outside `fetch` (a
        run's work: over the few steps found prunable at build, not the whole list)."""
        if fetch is None:
            return frozenset()
        return frozenset(k for k, feeds in self.prunable if not feeds & fetch)

    def _eager(self, skip: frozenset = frozenset()) -> None:
        sync = device.env_flag("RLX_CUDA_SYNC_EACH", False)
        for k, st in enumerate(self.steps):
            if k in skip:
                continue
            st.fn()
            if sync:
                try:
                    self.stream.synchronize()
                except Exception as e:
                    raise BackendError(f"cuda backend: graph {self.name!r} node %{st.node} ({st.op}) "
                                       f"failed: {e}") from e

    def _capture(self, skip: frozenset = frozenset()) -> None:
        s = self.stream
        s.begin_capture()
        try:
            for k, st in enumerate(self.steps):
                if k not in skip:
                    st.fn()
        except Exception as e:
            try:
                s.end_capture()
            except Exception:
                pass
            self.capture_failed = f"{type(e).__name__}: {e}"
            self.capturable = False
            return
        self.graph = self.graphs[skip] = s.end_capture()
        self.graph.upload(s)
        self.graph_version = CONFIG["version"]

    profile_clock = "CUDA events (steps launched one by one, not as the CUDA graph)"

    def run(self, inputs: dict) -> dict:
        return self._run(inputs, None)

    def run_fetch(self, inputs: dict, names: tuple) -> dict:
        return self._run(inputs, None, set(names))

    def submit(self, inputs: dict, names: tuple, chain: dict):
        """Enqueue the run and return at once. A chained input is copied on the device from
        this runner's last submit's output when nothing ran on the backend since (else from
        that submit's host copy, once it is done)."""
        from_dev = {}
        if chain:
            mark = self.chain_mark
            if mark is None or mark[1] != self.runs:
                raise BackendError(f"cuda backend: graph {self.name!r}: a chained run must follow a submit "
                                   "of the same graph, with no other run of it between")
            outs = {name: (v, off, nb) for name, v, off, nb in self.outputs}
            for i, o in chain.items():
                v, off, nb = outs[o]
                if (nb, v.dt) != (self.inputs[i][1], self.inputs[i][2].dtype):
                    raise BackendError(f"cuda backend: graph {self.name!r}: output {o!r} ({v.dt}{list(v.shape)}) "
                                       f"cannot feed input {i!r} ({self.inputs[i][2]})")
                if mark[0] == self.backend.runs:
                    from_dev[i] = v
                else:
                    done_slot = self.slots[mark[2]]
                    done_slot[2].synchronize()
                    inputs = dict(inputs, **{i: done_slot[1][off:off + nb].view(v.dt.np)})
        fetch = set(names) | set(chain.values())
        slot = self._enqueue(inputs, None, fetch, from_dev)
        self.chain_mark = (self.backend.runs, self.runs, slot)
        return lambda: {k: v for k, v in self._collect(slot, fetch).items() if k in names}

    def run_profiled(self, inputs: dict) -> tuple:
        """run() with the steps launched eagerly and a CUDA event recorded after each (the
        graph replay has no points to time between kernels): (outputs, [(node, seconds)])."""
        cp = device.cupy()
        events: list = []

        def launch():
            events[:] = [cp.cuda.Event() for _ in range(len(self.steps) + 1)]
            events[0].record(self.stream)
            for st, ev in zip(self.steps, events[1:]):
                st.fn()
                ev.record(self.stream)

        out = self._run(inputs, launch)
        return out, [(st.node, cp.cuda.get_elapsed_time(a, b) / 1e3)
                     for st, a, b in zip(self.steps, events, events[1:])]

    def replay_seconds(self, times: int = 20) -> float:
        """Seconds of one replay of the captured CUDA graph alone, timed with events on the
        runner's stream (no input or output copies): the device time benchmarks compare. The
        graph is the one the last run launched (a greedy step's skips the unfetched logits),
        captured by the second run, so run twice first."""
        if self.graph is None:
            raise BackendError(f"cuda backend: graph {self.name!r} has no captured CUDA graph to time "
                               f"(run it twice first; why none: {self.describe()})")
        cp = device.cupy()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        with self.stream:
            self.graph.launch(self.stream)
            e0.record(self.stream)
            for _ in range(times):
                self.graph.launch(self.stream)
            e1.record(self.stream)
            e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / 1e3 / times

    def _run(self, inputs: dict, launch, fetch: set | None = None) -> dict:
        return self._collect(self._enqueue(inputs, launch, fetch, {}), fetch)

    def _enqueue(self, inputs: dict, launch, fetch: set | None, from_dev: dict) -> int:
        """Stage the inputs in the next slot, copy `from_dev` (input -> device value) into
        the device inputs, enqueue the steps (`launch()`, else the CUDA graph or the eager
        loop) and the copies back of the outputs in `fetch` (default all): the slot."""
        cp = device.cupy()
        if self._states_changed():
            self._build()
        rt = cp.cuda.runtime
        self.slot = slot = 1 - self.slot
        host, oh, done = self.slots[slot]
        done.synchronize()                  # (its last run has finished with the slot's buffers)
        for name, (off, nb, s) in self.inputs.items():
            a = inputs[name]
            if nb and name not in from_dev:
                host[off:off + nb] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        s = self.stream
        try:
            with s:
                if self.in_bytes:
                    rt.memcpyAsync(self.in_dev.ptr, host.ctypes.data, self.in_bytes,
                                   rt.memcpyHostToDevice, s.ptr)
                for name, v in from_dev.items():
                    off, nb, _ = self.inputs[name]
                    rt.memcpyAsync(self.in_dev.ptr + off, v.arr.data.ptr, nb, rt.memcpyDeviceToDevice, s.ptr)
                if self.graphs and self.graph_version != CONFIG["version"]:
                    self.graphs.clear()
                    self.graph = None
                skip = self._skipped(fetch)
                use_graph = launch is None and CONFIG["graphs"] and self.capturable and self.runs >= 1
                if use_graph and skip not in self.graphs:
                    self._capture(skip)
                if launch is not None:
                    launch()
                elif use_graph and skip in self.graphs:
                    self.graph = self.graphs[skip]
                    self.graph.launch(s)
                else:
                    self._eager(skip)
                rt.memcpyAsync(oh.ctypes.data, self.err.data.ptr, 16, rt.memcpyDeviceToHost, s.ptr)
                for name, v, off, nb in self.outputs:
                    if nb and (fetch is None or name in fetch):
                        rt.memcpyAsync(oh.ctypes.data + off, v.arr.data.ptr, nb, rt.memcpyDeviceToHost, s.ptr)
                done.record(s)
        except RlxError:
            raise
        except Exception as e:
            raise self._failed(e) from e
        self.runs += 1
        self.backend.runs += 1
        return slot

    def _collect(self, slot: int, fetch: set | None) -> dict:
        """Wait for the run of `slot`; its outputs in `fetch` (default all) as numpy arrays,
        after raising what a kernel flagged."""
        _, oh, done = self.slots[slot]
        try:
            done.synchronize()
        except Exception as e:
            raise self._failed(e) from e
        self._raise_flagged(oh[:16].view(np.int32))
        out = {}
        for name, v, off, nb in self.outputs:
            if fetch is not None and name not in fetch:
                continue
            npdt = v.dt.np
            out[name] = np.array(oh[off:off + nb]).view(npdt).reshape(v.shape) if nb else np.zeros(v.shape, npdt)
        return out

    def _failed(self, e) -> BackendError:
        return BackendError(f"cuda backend: running graph {self.name!r} failed: {type(e).__name__}: {e} "
                            "(set RLX_CUDA_SYNC_EACH=1 to name the failing node)")

    def _raise_flagged(self, err) -> None:
        """Raise what a kernel flagged in the error word (host copy `err`: code, node, value,
        limit), after clearing it; nothing when the code is 0."""
        code, node, value, limit = (int(x) for x in err)
        if not code:
            return
        with self.stream:
            self.err.fill(0)
        self.stream.synchronize()
        op = self.lir.graph.nodes[node].op if 0 <= node < len(self.lir.graph.nodes) else "?"
        if code == 1:
            msg = f"gather: index out of range [0, {limit}) (got {value})"
        elif code == 2:
            msg = (f"kv_write: writing at position {value} overflows the cache of length {limit} "
                   "(context full)")
        else:
            msg = f"device error code {code}"
        raise ModelError(f"graph {self.name!r} node %{node} ({op}): {msg}")

    def run_device(self, arrays: dict) -> list:
        """Run on device arrays (by input name) with the steps launched eagerly on this
        runner's stream: its outputs as device arrays, valid until it runs again (control-flow
        bodies run so; `check_flags` afterwards raises what a kernel flagged)."""
        cp = device.cupy()
        with self.stream:
            for name, a in arrays.items():
                off, nb, s = self.inputs[name]
                if nb:
                    cp.copyto(cp.ndarray(s.dims, device.storage_dtype(s.dtype), memptr=self.in_dev + off), a)
            self._eager()
        self.backend.runs += 1
        return [v.arr for _, v, _, _ in self.outputs]

    def check_flags(self) -> None:
        self._raise_flagged(self.err.get())

    def poison(self, byte: int) -> bool:
        """Fill the arena and scratch buffers with `byte` (tests: unwritten outputs show)."""
        cp = device.cupy()
        rt = cp.cuda.runtime
        if self.lir.arena_bytes:
            rt.memset(self.arena.ptr, byte, self.lir.arena_bytes)
        for a in self.private:
            if a.nbytes:
                rt.memset(a.data.ptr, byte, a.nbytes)
        rt.deviceSynchronize()
        return True

    # ------------------------------------------------------------------ introspection
    def describe(self) -> dict:
        ops: dict = {}
        for st in self.steps:
            ops[st.op] = ops.get(st.op, 0) + 1
        return {"steps": len(self.steps), "steps_by_op": ops, "graph": self.graph is not None,
                "capturable": self.capturable, "capture_failed": self.capture_failed,
                "arena_bytes": self.lir.arena_bytes}


__all__ = ["CudaRunner", "Build"]
