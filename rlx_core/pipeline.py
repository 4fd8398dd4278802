"""CompilePipeline: module + profile + backend -> Executable.

HIR is lowered by the profile's fusion policy, optimized (DCE, constant folding, CSE),
fused for the backend's target, legalized for what the backend lacks, checked, and put in
the profile's precision. That MIR stays symbolic; an Executable specializes it to the dims
of each call (plan + backend compile, cached) and keeps params and states resident.
"""
from __future__ import annotations

import collections
import ctypes
import hashlib
import mmap
import sys
import time
import warnings

import attrs
import numpy as np

from . import cache, progress
from .ir.dtype import DType
from .ir.errors import BackendError, GraphError, ModelError, ProfileError
from .ir.graph import HIR, MIR, Graph
from .ir.lir import LirModule, plan
from .ir.lower import legalize, lower
from .ir.ops import OPS, Level, infer
from .ir.quant import PackedTensor
from .ir.registry import registry
from .ir.verify import verify
from .passes import fusion
from .passes.packed import pack_params, packed_bytes, packed_params
from .passes.generic import const_fold, cse, dce, leaves_first
from .passes.shard import bind_slices, shard
from .passes.transform import hoist_params, to_precision
from .profile import BackendConfig, CompileProfile


def available_backends() -> list:
    """(backend, available, reason) for every registered backend, best first."""
    out = []
    for b in registry().backends.values():
        ok, why = b.availability()
        out.append((b, ok, why))
    return sorted(out, key=lambda t: -t[0].priority)


def backends_for_scheme(scheme: str) -> list:
    """Names of the registered backends with a packed-weight kernel for `scheme`."""
    return sorted(b.name for b in registry().backends.values()
                  if "dequant_matmul" in b.supported_ops() and b.supports_scheme(scheme))


def _packed_source(g: Graph, ref) -> str:
    """The param whose packed bytes reach `ref` (through concat, gather and views)."""
    n = g.nodes[ref[0]]
    while n.op != "param" and n.inputs:
        n = g.nodes[n.inputs[0][0]]
    return n.name or "?"


def select_backend(name: str | None = None):
    """By name, or the highest-priority available backend. Never a silent substitute."""
    table = registry().backends
    if name:
        if name not in table:
            raise BackendError(f"unknown backend {name!r}; installed: {sorted(table)}")
        ok, why = table[name].availability()
        if not ok:
            raise BackendError(f"backend {name!r} is not available here: {why}")
        return table[name]
    for b, ok, _ in available_backends():
        if ok:
            return b
    raise BackendError("no backend is available")


class CompilePipeline:
    def __init__(self, profile: CompileProfile | None = None, backend=None):
        self.profile = profile or CompileProfile()
        self.backend = backend if backend is not None and not isinstance(backend, str) else \
            select_backend(backend or self.profile.backend.name or None)
        if attrs.evolve(self.profile.backend, name="") != BackendConfig():   # a setting besides the name
            self.backend = self.backend.configure(self.profile.backend)
        self.trace: list = []          # (pass name, nodes after, seconds)
        self.graphs: list | None = None   # a list here keeps (pass name, graph after it)
        self.rank: int | None = None      # tensor-parallel rank; None: the bound communicator's
        self.shard_log: list = []         # nodes the shard pass left replicated, and why

    def _step(self, name, g, fn):
        progress.detail(name)
        t = time.perf_counter()
        out = fn(g)
        if self.profile.passes.verify_each:
            try:
                verify(out)
            except GraphError as e:
                raise GraphError(f"after pass {name!r}: {e}") from None
        self.trace.append((name, len(out.nodes), time.perf_counter() - t))
        if self.graphs is not None:
            self.graphs.append((name, out))
        if self.profile.passes.verbose:
            print(f"[rlx] {name}: {len(out.nodes)} nodes")
        return out

    def optimize(self, g: Graph) -> Graph:
        """HIR (or MIR) -> optimized MIR for this backend, still symbolic in its dims."""
        verify(g)
        p, b = self.profile, self.backend
        if g.level == HIR:
            g = self._step("lower", g, lambda x: lower(x, p.fusion.policy))
        if packed_params(g):
            g = self._step("pack", g, lambda x: pack_params(x, p.precision.activations))
        g = self._step("leaves_first", g, leaves_first)
        if p.passes.dce:
            g = self._step("dce", g, dce)
        if p.passes.constant_folding:
            g = self._step("const_fold", g, const_fold)
        if p.passes.cse:
            g = self._step("cse", g, cse)
        if p.parallel.tensor > 1:
            rank = self.tp_rank()
            self.shard_log = []
            g = self._step("shard", g, lambda x: shard(x, p.parallel.tensor, rank, self.shard_log))
            if self.shard_log and rank == 0:      # (every rank does the same; one says so)
                warnings.warn(f"tensor parallel: {len(self.shard_log)} packed matmul(s) of graph "
                              f"{g.name!r} run replicated: " + "; ".join(self.shard_log), stacklevel=2)
        target = b.target if p.fusion.target == "auto" else p.fusion.target
        groups = fusion.groups_for(target, p.fusion.skip)
        log: list = []
        rule_groups = tuple(gr for gr in groups if gr not in fusion.PASSES)
        g = self._step("fusion", g, lambda x: fusion.fuse(x, rule_groups, log=log))
        self.fusion_log = log
        if p.fusion.assert_clean:   # checked before the region passes absorb leftover chains
            # every group the target fuses, skipped or not: a skip leaves its patterns unfused
            full = fusion.groups_for(target, ())
            left = fusion.unfused(g, full)
            if left:
                detail = ", ".join(f"{r} at %{i} ({g.nodes[i].op})" for r, i in left[:8])
                skipped = [x for x in full if x not in groups]
                hint = f" (fusion.skip leaves groups {skipped} unfused)" if skipped else ""
                raise GraphError(f"assert_clean: fusable patterns left unfused: {detail}{hint}")
        pass_groups = tuple(gr for gr in groups if gr in fusion.PASSES)
        if pass_groups:
            g = self._step("fusion passes", g, lambda x: fusion.fuse(x, pass_groups, log=log))
        supported = b.supported_ops()
        g, self.legalized = legalize(g, supported)
        self.trace.append(("legalize", len(g.nodes), 0.0))
        if self.graphs is not None:
            self.graphs.append(("legalize", g))
        if p.passes.dce:
            g = self._step("dce", g, dce)
        compute = p.precision.compute
        b.check_dtype(compute, f"profile {p.name!r} precision.compute")
        g = self._step("precision", g, lambda x: to_precision(x, compute))
        self._check_support(g)
        return g

    def tp_rank(self) -> int:
        """This pipeline's tensor-parallel rank: set, or the communicator bound in the process
        (the rank processes of rlx_core.runtime.tp bind one)."""
        from .ir import comm

        world = self.profile.parallel.tensor
        if self.rank is not None:
            return self.rank
        c = comm.bound()
        if c is None or c.world != world:
            raise ProfileError(f"profile {self.profile.name!r} asks [parallel] tensor = {world} but this "
                               f"process is no rank of such a group (launch with `rlx generate --tp "
                               f"{world}` or rlx_core.runtime.tp.TensorParallel)")
        return c.rank

    def _check_support(self, g: Graph) -> None:
        b = self.backend
        supported = b.runnable_ops()       # (control flow: core runs it from the host when b lacks it)
        for i, n in enumerate(g.nodes):
            for s in n.outs:
                if s.dtype.is_float:
                    b.check_dtype(s.dtype, f"node %{i} ({n.op})")
            scheme = n.a.get("scheme") if n.op in ("dequant_matmul", "dequantize") else None
            if scheme and not b.supports_scheme(scheme):
                w = _packed_source(g, n.inputs[1 if n.op == "dequant_matmul" else 0])
                raise BackendError(f"backend {b.name!r} has no kernel for packed weight {w!r} in scheme "
                                   f"{scheme!r} (node %{i}, {n.op}); backends that do: "
                                   f"{backends_for_scheme(scheme) or 'none'}")
            if n.op == "custom":
                if not b.supports_custom(n.a["name"]):
                    raise BackendError(f"backend {b.name!r} has no kernel for custom op "
                                       f"{n.a['name']!r} (node %{i})")
            elif n.op not in supported:
                have = [x.name for x, _, _ in available_backends() if n.op in x.supported_ops()]
                raise BackendError(f"backend {b.name!r} does not implement op {n.op!r} (node %{i}); "
                                   f"backends that do: {have or 'none'}")

    def cache_key(self, g: Graph) -> str | None:
        """The compile cache's key for optimizing `g` here: the graph, the profile, what the
        backend supports and the code of every package taking part (core, backend, plugins'
        fusion rules). None when `g` has no JSON form."""
        b = self.backend
        try:
            text = g.key_text()
        except (TypeError, ValueError):
            return None
        rules = registry().rules
        packages = {"rlx_core", type(b).__module__.partition(".")[0]} | {
            r.emit.__module__.partition(".")[0] for group in rules.values() for r in group}
        rank = self.tp_rank() if self.profile.parallel.tensor > 1 else 0
        return cache.key("mir", text, self.profile.text(), f"rank {rank}", b.name, b.target, sorted(b.supported_ops()),
                         sorted(d.value for d in b.dtypes), sorted(rules),
                         *(f"{p}:{cache.code_fingerprint(p)}" for p in sorted(packages)))

    def optimize_cached(self, g: Graph) -> Graph:
        """optimize(g), or its result read back from the compile cache (a process before made
        it); the backend's support is checked either way."""
        k = self.cache_key(g) if cache.root() is not None else None
        mir = cache.read_graph("mir", k) if k else None
        if mir is None:
            mir = self.optimize(g)
            if k:
                cache.write_graph("mir", k, mir)
            return mir
        self.trace.append(("compile cache", len(mir.nodes), 0.0))
        self._check_support(mir)
        return mir

    def compile(self, module: Graph, params: dict | None = None, states=None,
                shared: dict | None = None) -> "Executable":
        mir = self.optimize_cached(module)
        return Executable(mir, self.backend, self.profile, params, states, source=module, shared=shared)


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 32
MAX_RUNNERS = 16          # shape specializations an Executable keeps (each owns an arena)


def compile(module: Graph, profile: CompileProfile | str | None = None, backend=None,
            params: dict | None = None, states=None) -> "Executable":
    """rlx_core.compile(module, profile=..., backend=...): the optimized MIR is cached by
    (graph hash, profile hash, backend) in this process and in the compile cache on disk;
    specializations are cached per bound dims."""
    if isinstance(profile, str):
        profile = CompileProfile.preset(profile)
    pipe = CompilePipeline(profile, backend)
    key = (module.stable_hash(), pipe.profile.stable_hash(), pipe.backend.name,
           pipe.tp_rank() if pipe.profile.parallel.tensor > 1 else 0)
    mir = _CACHE.get(key)
    if mir is None:
        mir = pipe.optimize_cached(module)
        _CACHE[key] = mir
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return Executable(mir, pipe.backend, pipe.profile, params, states, source=module)


class StateStore(dict):
    """Named device buffers shared by executables (a KV cache used by prefill and decode).
    `version` changes whenever a buffer is put in or taken out, so a runner bound to the
    buffers checks them once per change, not on every decode step."""
    version = 0

    def __setitem__(self, name, value):
        super().__setitem__(name, value)
        self.version += 1

    def __delitem__(self, name):
        super().__delitem__(name)
        self.version += 1

    def pop(self, *a):
        self.version += 1
        return super().pop(*a)

    def update(self, *a, **kw):
        super().update(*a, **kw)
        self.version += 1

    def clear(self):
        super().clear()
        self.version += 1


def states_moved(states, bound: dict, seen) -> bool:
    """Whether any of the `bound` buffers (name -> buffer) is no longer the one in `states`;
    `seen` is the states' version when they last matched (a StateStore skips the check then)."""
    version = getattr(states, "version", None)
    if version is not None and version == seen:
        return False
    return any(states.get(n) is not a for n, a in bound.items())


def _moves_only_unit_dims(dims: tuple, perm: tuple) -> bool:
    """A transpose that only moves size-1 axes keeps the element order: it is a reshape."""
    order = [p for p in perm if dims[p] != 1]
    return order == sorted(order)


def specialize(g: Graph, env: dict) -> Graph:
    """Bind named dims to ints and re-infer every shape. Once dims are known, a transpose
    that moves only size-1 axes (the head transposes of a one-token decode step) becomes a
    reshape, which every backend and the buffer planner treat as a free view."""
    from .ir.graph import Builder, Node

    m = Builder(g.name, g.level)
    m.constants = dict(g.constants)

    def bind(v):
        if isinstance(v, str):
            return env.get(v, v)
        if isinstance(v, tuple):
            return tuple(bind(x) for x in v)
        return v

    for n in g.nodes:
        a = {k: (bind(v) if k in ("shape", "length") else v) for k, v in n.attrs}
        ins = [m.nodes[r[0]].outs[r[1]] for r in n.inputs]
        op = n.op
        if op == "transpose" and ins[0].is_static and _moves_only_unit_dims(ins[0].dims, a["perm"]):
            op, a = "reshape", {"shape": tuple(ins[0].dims[p] for p in a["perm"])}
        outs = infer(op, ins, a)
        if op in ("input", "param", "state", "constant"):
            outs = tuple(s.bind(env) for s in outs)
        m.nodes.append(Node(op, n.inputs, tuple(sorted(a.items())), tuple(outs), n.name))
    m.outputs = list(g.outputs)
    return m.build()


def numeric(what: str, value, dtype) -> np.ndarray:
    """`value` as a C-contiguous array of `dtype` (0-d stays 0-d); a ModelError for strings,
    objects, dates or complex numbers, which numpy would refuse deep inside or parse."""
    a = np.asarray(value)
    if a.dtype.kind in "OSUMmc" and a.dtype != dtype.np:
        raise ModelError(f"{what}: expected {dtype.value} numbers, got an array of {a.dtype}")
    return np.asarray(a.astype(dtype.np, copy=False), order="C")


def unpack(name: str, value, scheme: str, bad: list):
    """What a param binds: a packed param takes a PackedTensor of its scheme (its bytes), a
    float param a PackedTensor dequantized; a mismatch is recorded in `bad`."""
    if not isinstance(value, PackedTensor):
        if scheme:
            bad.append(f"{name}: expected a packed {scheme} weight, got an array")
        return value
    if not scheme:
        return value.dequantize()
    if value.scheme.name != scheme:
        bad.append(f"{name}: expected packed {scheme}, got {value.scheme.name}")
    return packed_bytes(value)


def read_only_mapping(arr) -> bool:
    """Whether array `arr` views a read-only file mapping (a checkpoint's weight as loaded)."""
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None and not (
            isinstance(base, np.memmap) and base._mmap is not None):
        base = base.base
    return (isinstance(arr, np.ndarray) and isinstance(base, np.memmap) and base._mmap is not None
            and base.mode == "r")


def release_file_pages(arr) -> None:
    """Let the OS take back the resident pages of a weight read from a read-only file
    mapping (touching them again reads the file again): once fused weights are derived from
    a checkpoint's q/k/v or gate/up, the file's copies of those bytes only add to RSS."""
    if not sys.platform.startswith("linux") or not read_only_mapping(arr):
        return
    page = mmap.PAGESIZE
    lo, hi = arr.ctypes.data, arr.ctypes.data + arr.nbytes
    lo, hi = -(-lo // page) * page, hi // page * page          # whole pages inside the weight
    if hi > lo:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def derived_keys(prologue: Graph, params: dict) -> dict:
    """Prologue output -> a key naming what computes it (ops, attrs, the param arrays and
    constants it reads): the prefill and decode executables of one model derive the same
    fused weights, which are then computed and held once."""
    memo: dict = {}

    def key(ref):
        ref = tuple(ref)
        if ref not in memo:
            n = prologue.nodes[ref[0]]
            if n.op == "param":
                memo[ref] = ("param", n.name, id(params[n.name]))
            elif n.op == "constant":
                c = np.ascontiguousarray(prologue.constants[n.name])
                memo[ref] = ("constant", c.dtype.str, c.shape, hashlib.sha256(c.tobytes()).hexdigest())
            else:
                memo[ref] = (n.op, ref[1], repr(sorted(n.a.items())), tuple(key(r) for r in n.inputs))
        return memo[ref]

    return {name: ("derived", key(ref)) for name, ref in prologue.outputs}


class Executable:
    """A compiled model: `run(**inputs)` or `run(dict)` -> dict of numpy outputs."""

    def __init__(self, mir: Graph, backend, profile, params=None, states=None, source=None,
                 shared: dict | None = None):
        # the CompileProfile it was compiled under (`profile` is the method that times it)
        self.backend, self.compile_profile, self.source = backend, profile, source
        self.mir, self.prologue = hoist_params(mir)
        # name -> Shape of each graph input (looked up on every run: a decode step's hot path)
        self.input_specs = {n.name: n.outs[0] for n in self.mir.nodes if n.op == "input"}
        self._dims_seen: dict = {}       # input shapes -> their dims (checked once)
        self.states = states if states is not None else StateStore()
        self.fixed_dims: dict = {}       # dims no input carries (the KV cache length "ctx")
        # executables of one model share uploaded and derived params through this cache
        self.shared = shared if shared is not None else {}
        self._params: dict = {}
        self._runners: dict = {}
        self._bound: dict = {}           # runner key -> (state buffers it was compiled with, version)
        self.lir_cache: dict = {}
        self.progress = False            # a bar for each slow specialization (rlx_core.progress)
        if params is not None:
            self.set_params(params)

    # -- binding
    @property
    def param_specs(self) -> dict:
        """name -> Shape of every param the caller must bind (hoisted ones excluded)."""
        specs = {n.name: n.outs[0] for n in self.mir.nodes if n.op == "param"
                 and not n.name.startswith("__hoisted.")}
        if self.prologue is not None:
            specs.update({n.name: n.outs[0] for n in self.prologue.nodes if n.op == "param"})
        return specs

    def set_params(self, params: dict) -> None:
        """Check every param (all problems in one error) and make them resident."""
        specs = self.param_specs
        pnodes = [n for g in (self.mir, self.prologue) if g is not None for n in g.nodes if n.op == "param"]
        if any(n.a.get("shard") for n in pnodes):    # a tensor-parallel rank binds its slices
            params = bind_slices(pnodes, params)
        missing = sorted(set(specs) - set(params))
        unexpected = sorted(set(params) - set(specs))
        bad = []
        schemes = {n.name: n.a.get("scheme", "") for n in pnodes}
        params = {k: unpack(k, v, schemes.get(k, ""), bad) for k, v in params.items()}
        for name, s in specs.items():
            if name in params:
                shape = tuple(np.shape(params[name]))
                if not s.is_static or shape != s.dims:
                    bad.append(f"{name}: expected {list(s.dims)}, got {list(shape)}")
        if missing or unexpected or bad:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if unexpected:
                parts.append(f"unexpected {unexpected}")
            if bad:
                parts.append("mis-shaped " + "; ".join(bad))
            raise ModelError(f"graph {self.mir.name!r} params: " + " | ".join(parts))
        b = self.backend

        needed = {n.name for n in self.mir.nodes if n.op == "param"}

        def upload(name):
            key = ("param", name, id(params[name]), specs[name].dtype)
            if key not in self.shared:
                value = numeric(f"param {name!r}", params[name], specs[name].dtype)  # (keeps 0-d 0-d)
                self.shared[key] = (params[name], (b.adopt if name in needed else b.to_device)(value))
            return key, self.shared[key][1]

        resident = {}
        if self.prologue is not None:
            keys = derived_keys(self.prologue, params)
            todo = [(name, ref) for name, ref in self.prologue.outputs if keys[name] not in self.shared]
            if todo:                   # what no executable sharing these weights derived yet
                pro = dce(attrs.evolve(self.prologue, outputs=tuple(todo)), keep=())
                uploads = {n: upload(n) for n in pro.params}
                derived = b.compile_runner(plan(pro), {n: v for n, (_, v) in uploads.items()}, {}).run({})
                for name, v in derived.items():
                    self.shared[keys[name]] = b.to_device(v)
                for n, (ukey, _) in uploads.items():   # weights only the prologue reads go away
                    if n not in needed:
                        self.shared.pop(ukey, None)
                        release_file_pages(params[n])
                del derived, uploads                   # (the last references to them)
                b.release_cache()                      # and what the one-off run held
            resident.update({name: self.shared[k] for name, k in keys.items()})
        for name in specs:
            if name in needed:
                resident[name] = upload(name)[1]
        self._params = resident
        self._runners.clear()

    # -- running
    def _bind_dims(self, inputs: dict) -> dict:
        specs = self.input_specs
        if inputs.keys() == specs.keys():           # seen shapes: known dims (the decode loop)
            shapes = tuple(np.shape(inputs[n]) for n in specs)
            env = self._dims_seen.get(shapes)
            if env is None:
                if len(self._dims_seen) > 256:
                    self._dims_seen.clear()
                env = self._dims_seen[shapes] = self._check_dims(inputs)
            return dict(env)
        return self._check_dims(inputs)

    def _check_dims(self, inputs: dict) -> dict:
        env: dict = {}
        specs = self.input_specs
        missing = sorted(set(specs) - set(inputs))
        unexpected = sorted(set(inputs) - set(specs))
        if missing or unexpected:
            raise ModelError(f"graph {self.mir.name!r}: missing inputs {missing}, unexpected "
                             f"{unexpected}; expected {sorted(specs)}")
        for name, s in specs.items():
            shape = np.shape(inputs[name])
            if len(shape) != s.rank:
                raise ModelError(f"input {name!r}: expected rank {s.rank} {s}, got shape {list(shape)}")
            for d, got in zip(s.dims, shape):
                if isinstance(d, str):
                    if env.setdefault(d, got) != got:
                        raise ModelError(f"input {name!r}: dim {d!r} is {got} here but "
                                         f"{env[d]} in another input")
                elif d != got:
                    raise ModelError(f"input {name!r}: expected {s}, got shape {list(shape)}")
        return env

    def runner(self, env: dict):
        key = tuple(sorted(env.items()))
        r = self._runners.get(key)
        if r is not None:
            bound, seen = self._bound.get(key, ({}, None))
            version = getattr(self.states, "version", None)
            if states_moved(self.states, bound, seen):
                r = None    # another executable re-sized a shared state: bind the new buffers
            elif version != seen:
                self._bound[key] = (bound, version)
        if r is None:
            if not self._params and self.param_specs:
                raise ModelError(f"graph {self.mir.name!r}: params are not bound (set_params)")
            dims = ", ".join(f"{k}={v}" for k, v in key) or "static"
            with progress.task(f"specializing {self.mir.name} ({dims})", 3, self.progress):
                progress.stage("bind dims")
                g = specialize(self.mir, env)
                progress.stage("plan buffers")
                lir = plan(g, *self.backend.planned_layouts(g))
                self.lir_cache[key] = lir
                for name, i in g.states.items():
                    s = g.nodes[i].outs[0]
                    cur = self.states.get(name)
                    if cur is None or tuple(cur.shape) != s.dims:
                        self.states[name] = self.backend.zeros(s.dims, s.dtype)
                self._drop_stale()
                progress.stage(f"{self.backend.name} compile")
                r = self.backend.compile_runner(lir, self._params, self.states)
            self._bound[key] = ({n: self.states[n] for n in g.states}, getattr(self.states, "version", None))
            self._runners[key] = r
            while len(self._runners) > MAX_RUNNERS:      # each holds an arena: keep the newest
                oldest = next(iter(self._runners))
                del self._runners[oldest]
                self._bound.pop(oldest, None)
        return r

    def _drop_stale(self) -> None:
        """Forget the runners bound to state buffers that were replaced (by buffers of another
        batch or context bucket: such a runner is rebuilt on use anyway), so the old buffers
        and the runners' own memory can go."""
        for key in [k for k, (bound, _) in self._bound.items() if states_moved(self.states, bound, None)]:
            self._runners.pop(key, None)
            self._bound.pop(key, None)

    def prepare(self, inputs: dict) -> tuple:
        """(runner, arrays, dims) of a call: the dims bound and checked, the inputs converted,
        the runner of those dims (specialized on first use)."""
        env = {**self.fixed_dims, **self._bind_dims(inputs)}
        specs = self.input_specs
        arrays = {k: numeric(f"input {k!r}", v, specs[k].dtype) for k, v in inputs.items()}
        return self.runner(env), arrays, env

    def run(self, inputs: dict | None = None, fetch=None, **kw) -> dict:
        """Outputs by name; `fetch` (names) returns only those, and a backend whose outputs
        live on a device copies back only those (greedy decode: ids, not [batch, vocab])."""
        if fetch is not None:
            fetch = self._outputs_named("fetch", fetch)
        runner, arrays, _ = self.prepare(dict(inputs or {}, **kw))
        return runner.run(arrays) if fetch is None else runner.run_fetch(arrays, fetch)

    def submit(self, inputs: dict, fetch, chain: dict | None = None):
        """Start a run; returns a function that waits for it and gives the outputs `fetch`.
        `chain` ({input: output}) feeds inputs from the outputs of the last submit on the same
        dims, whose values in `inputs` then only give their shapes: on a backend whose runs
        overlap the host (`Backend.overlaps`, a GPU), a decode step so starts before the
        step before it has been read back."""
        fetch = self._outputs_named("fetch", fetch)
        chain = dict(chain or {})
        self._outputs_named("chain", chain.values())
        unknown = sorted(set(chain) - set(self.input_specs))
        if unknown:
            raise GraphError(f"graph {self.mir.name!r}: chain names no input(s) {unknown}; inputs: "
                             f"{sorted(self.input_specs)}")
        runner, arrays, _ = self.prepare(dict(inputs))
        return runner.submit(arrays, fetch, chain)

    def _outputs_named(self, what: str, names) -> tuple:
        names = tuple(names)
        unknown = sorted(set(names) - {n for n, _ in self.mir.outputs})
        if unknown:
            raise GraphError(f"graph {self.mir.name!r}: no output(s) {unknown} to {what}; outputs: "
                             f"{[n for n, _ in self.mir.outputs]}")
        return names

    __call__ = run

    def profile(self, inputs: dict, repeat: int = 10, warmup: int = 2):
        """Time every node on `inputs`, the median of `repeat` runs: a ProfileReport (a
        top-10 table as str(), to_json(), chrome_trace(path)); see rlx_core.profiler."""
        from .profiler import profile_executable

        return profile_executable(self, inputs, repeat, warmup)

    def _repr_svg_(self):
        """Jupyter shows the MIR it runs drawn (None without Graphviz's `dot`: see Graph)."""
        return self.mir._repr_svg_()

    def lir(self, **dims) -> LirModule:
        key = tuple(sorted(dims.items()))
        if key not in self.lir_cache:
            g = specialize(self.mir, dims)
            self.lir_cache[key] = plan(g, *self.backend.planned_layouts(g))
        return self.lir_cache[key]

    def drop_runners(self) -> None:
        """Forget the specialized runners (their arenas and the state buffers they were bound
        to) and their plans; the graph stays compiled and the next run specializes it again."""
        self._runners.clear()
        self._bound.clear()
        self.lir_cache.clear()

    def reset_states(self) -> None:
        # zero in place: runners of other executables sharing the StateStore hold these buffers
        for name, v in list(self.states.items()):
            if hasattr(v, "fill"):
                v.fill(0)
            else:
                self.states[name] = self.backend.zeros(tuple(v.shape), DType.parse(v.dtype))
                self._runners.clear()


__all__ = ["CompilePipeline", "Executable", "compile", "select_backend", "available_backends",
           "backends_for_scheme",
           "StateStore", "states_moved", "specialize", "Level", "OPS", "MIR"]
