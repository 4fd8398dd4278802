"""The cuda backend's runner built on the CPU, no GPU needed (a dry build): CuPy stands in as host
arrays at device-style addresses, kernels are neither compiled nor launched, cuBLAS is a stub.
A test plans a graph as the backend would (`planned`), gives its leaves values (`leaves`), builds
it (the `dry` fixture) and reads the step list (which launches, what each step streams, what
fused into what) for the GPU the stand-in names; running a step records its kernels' launches.
Nothing computes: the kernels' own tests (cuda_emu, the GPU) say what they compute."""
from __future__ import annotations

import types

import numpy as np
import pytest

import rlx_backend_cuda
from rlx_backend_cuda import blas, device
from rlx_core.ir.errors import BackendError

HOPPER = {"name": "stand-in H200", "cc": (9, 0), "sms": 132, "hip": False, "total_mem": 141 << 30}


class DevArr(np.ndarray):
    """A host array standing in for a CuPy array: `.data.ptr` its address, `.set` an upload."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def set(self, a) -> None:
        self[...] = a


class Mem:
    """A MemoryPointer: host bytes and an offset into them."""

    def __init__(self, buf: np.ndarray, off: int = 0):
        self.buf, self.off = buf, off

    def __add__(self, k: int) -> Mem:
        return Mem(self.buf, self.off + int(k))

    @property
    def ptr(self) -> int:
        return self.buf.__array_interface__["data"][0] + self.off


def _ndarray(shape, dtype, memptr=None):
    dtype = np.dtype(dtype)
    memptr = memptr or Mem(np.zeros(max(int(np.prod(shape)) * dtype.itemsize, 1), np.uint8))
    return np.ndarray(shape, dtype, buffer=memptr.buf, offset=memptr.off).view(DevArr)


def _fake_cupy():
    nothing = lambda *a, **k: None          # noqa: E731
    stream = type("Stream", (), {"__init__": lambda self, **k: None, "ptr": 0, "wait_event": nothing,
                                 "synchronize": nothing})
    event = type("Event", (), {"__init__": lambda self, **k: None, "record": nothing, "synchronize": nothing})
    def memset(ptr, value, nbytes, stream):
        EVENTS.append(("memset", (ptr, value, nbytes), None))
    runtime = types.SimpleNamespace(deviceSynchronize=nothing, memsetAsync=memset, is_hip=False,
                                    memGetInfo=lambda: (1 << 40, 1 << 40), CUDA_R_16BF=14, CUDA_R_16F=2,
                                    CUDA_R_32F=0, CUDA_R_64F=1)
    as_strided = lambda x, shape=None, strides=None: np.lib.stride_tricks.as_strided(  # noqa: E731
        x, shape, strides).view(DevArr)
    return types.SimpleNamespace(
        ndarray=_ndarray, zeros=lambda shape, dtype=np.float32: _ndarray(tuple(np.atleast_1d(shape)), dtype),
        broadcast_to=lambda x, shape: np.broadcast_to(x, shape).view(DevArr),
        lib=types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=as_strided)),
        cuda=types.SimpleNamespace(Stream=stream, Event=event, runtime=runtime,
                                   alloc=lambda n: Mem(np.zeros(max(int(n), 1), np.uint8)),
                                   alloc_pinned_memory=lambda n: np.zeros(max(int(n), 1), np.uint8)),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=nothing))


# in order: (kernel name, its arguments, the Launch) a launch, ("memset", (ptr, value, nbytes), None)
EVENTS: list = []


class Launch:
    """A kernel that records its launches instead of running: (grid, block) each, and their
    arguments in `args` (and in EVENTS, in order with the memsets)."""

    def __init__(self, name: str, source: str):
        self.name, self.source, self.launches, self.args = name, source, [], []

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.launches.append((tuple(grid), tuple(block)))
        self.args.append(tuple(args))
        EVENTS.append((self.name, tuple(args), self))


@pytest.fixture
def dry(monkeypatch):
    """dry(lir, params, states, info=HOPPER) -> the CudaRunner built on the stand-ins (its steps
    not run); `dry.kernels` the kernels made, in order."""
    from rlx_backend_cuda.runner import CudaRunner

    made: list = []
    monkeypatch.setattr(device, "_cp", _fake_cupy())
    monkeypatch.setattr(device, "dependent_launch", lambda: False)
    monkeypatch.setattr(blas, "library", lambda: types.SimpleNamespace(
        handle=0, gemm=lambda *a: None, gemm_strided=lambda *a: None, prepare=lambda *a: None))

    def kernel(source, name, op, dynamic_smem=0):
        made.append(Launch(name, source))
        return made[-1]
    monkeypatch.setattr(device, "kernel", kernel)

    def tensor_map(*a):
        raise BackendError("dry build: no tensor maps")
    monkeypatch.setattr(device, "tensor_map", tensor_map)

    def build(lir, params: dict, states: dict, info: dict = HOPPER):
        monkeypatch.setattr(device, "probe", lambda: (True, "", dict(info)))
        from rlx_backend_cuda import control, deltanet, moe  # noqa: F401  (their ops' builders)

        return CudaRunner(rlx_backend_cuda.CudaBackend(), lir, dict(params), dict(states))
    build.kernels = made
    return build


def leaves(lir, rng) -> tuple:
    """(params, states) for every param and state leaf of an LIR graph: random values."""
    params, states = {}, {}
    for n in lir.graph.nodes:
        if n.op in ("param", "state"):
            s = n.outs[0]
            v = rng.standard_normal(s.dims).astype(np.float32).astype(s.dtype.np)
            (params if n.op == "param" else states)[n.name] = v
    return params, states


def planned(g, compute: str = "bf16", activations: str = "f32"):
    """Graph g's LIR as the cuda backend plans it (its passes, fusion patterns and layouts),
    its dims as they are (a decode-shaped graph); activations: the profile's (int8: packed
    matmuls' x rounded)."""
    from rlx_core.ir.lir import plan
    from rlx_core.pipeline import CompilePipeline, specialize
    from rlx_core.profile import CompileProfile, PrecisionConfig

    backend = rlx_backend_cuda.CudaBackend()
    profile = CompileProfile("dry", precision=PrecisionConfig(compute=compute, activations=activations))
    mir = CompilePipeline(profile, backend).optimize_cached(g)
    s = specialize(mir, {})
    return plan(s, *backend.planned_layouts(s))


def replay(runner, steps: int = 1) -> list:
    """The runner's steps run `steps` times on the stand-ins: their launches and memsets, in
    order (EVENTS' entries)."""
    EVENTS.clear()
    for _ in range(steps):
        for st in runner.steps:
            st.fn()
    return list(EVENTS)


# the arguments of the launches that read, write (add into) and zero sums of squares (ops.GemvSums)
SUMS_ARGS = {"rlx_gather_norm": (None, 6, None), "rlx_gemv": (-9, -3, -2), "rlx_dq_gemv": (-9, -3, -2),
             "rlx_quant_q8": (5, None, -2)}


def sums_hazards(runner, steps: int = 2) -> list:
    """The step run `steps` times on the stand-ins, its launches and memsets replayed on the
    sums of squares the norms' GEMVs share: each sums starts zeroed, a launch may add into
    them only while zero and read them only once written, and never zero what it reads or
    writes itself. Returns each broken rule as (launch, argument role, its sums); fails where
    no launch reads or writes sums (nothing to check)."""
    written: dict = {}                  # sums address -> written since last zeroed
    bad, touched = [], False
    for i, (name, args, _) in enumerate(replay(runner, steps)):
        if name == "memset":
            written[args[0]] = False
            continue
        read, write, zero = (None if k is None or args[k] is None else args[k].data.ptr
                             for k in SUMS_ARGS.get(name, (None,) * 3))
        touched = touched or read is not None or write is not None
        if zero is not None:
            bad += [(i, name, "zeroes what it uses", zero)] if zero in (read, write) else []
            written[zero] = False
        if read is not None and not written.get(read, False):
            bad.append((i, name, "reads unwritten sums", read))
        if write is not None:
            bad += [(i, name, "adds into unzeroed sums", write)] if written.get(write, False) else []
            written[write] = True
    assert touched, "no launch read or wrote sums of squares"
    return bad
