"""rlx-backend-cuda: the CUDA backend of RLX on CuPy (ROCm through CuPy's ROCm build).

Installing the package registers backend "cuda" (entry-point group "rlx"); where a GPU
is present it outranks the NumPy backend and becomes the default.
"""
from __future__ import annotations

import numpy as np
from rlx_core.backends.base import Backend, kernel_path
from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError
from rlx_core.ir.ops import OPS, Level
from rlx_core.plugins import hookimpl

from . import device, sources

__version__ = "0.1.0"


class CudaArray:
    """A device-resident array (a param, a state, a KV cache). bf16 is stored as its 16-bit
    pattern; `dtype` is the logical numpy dtype (ml_dtypes.bfloat16 for bf16)."""
    __slots__ = ("data", "dtype", "shape", "__weakref__")

    def __init__(self, data, dtype):
        self.data = data
        self.dtype = np.dtype(dtype)
        self.shape = tuple(data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def get(self) -> np.ndarray:
        host = self.data.get()
        return host.view(self.dtype) if host.dtype != self.dtype else host

    def __array__(self, dtype=None, copy=None):
        a = self.get()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"CudaArray({DType.parse(self.dtype).value}{list(self.shape)})"


class CudaBackend(Backend):
    name = "cuda"
    priority = 30
    overlaps = True          # a submit returns before its run ends (Runner.submit)
    target = "cuda"

    def __init__(self):
        self._stream = None
        self._arena = None
        self._arena_bytes = 0
        self._scratch = None
        self._scratch_bytes = 0
        self.runs = 0               # runs enqueued on the stream (a chained submit checks it)

    # -- identity
    def availability(self) -> tuple:
        ok, why, _ = device.probe()
        return ok, why

    @property
    def dtypes(self) -> frozenset:
        return device.supported_dtypes()

    def supported_ops(self) -> set:
        """Ops with a builder; a fused op without one (varlen_attention, segment_pool) is legalized."""
        from . import control, deltanet, moe  # noqa: F401  (register control flow, dense_solve and the MoE / GDN ops)
        from .ops import BUILDERS, VIEW_BUILDERS

        return {n for n, d in OPS.items() if d.level is Level.LEAF or n in BUILDERS or n in VIEW_BUILDERS}

    def expression_renderers(self) -> tuple:
        from .codegen import CUDA

        return (CUDA,)

    def supports_scheme(self, scheme) -> bool:
        """Whether dequant_matmul / dequantize have a kernel for this QuantScheme (or name): all do."""
        from rlx_core.ir.quant import QuantScheme

        from .sources import DQ_SCHEMES

        return QuantScheme.parse(scheme).kind in DQ_SCHEMES

    def device_name(self) -> str:
        return device.info().get("name", "?")

    def kernel_paths(self) -> list:
        """The kernels this GPU and the switches (set_config, RLX_CUDA_*) leave on or off."""
        from .values import CONFIG

        inf = device.info()
        cc, hip = inf.get("cc", (0, 0)), bool(inf.get("hip"))
        mma, wg = device.mma_missing(cc, hip), device.wgmma_missing(cc, hip)

        def path(name: str, why: str, instead: str, switch: str = "") -> dict:
            if not why and switch and not CONFIG[switch]:
                why = f"switched off (rlx_backend_cuda.set_config({switch}=False))"
            return kernel_path(name, why, instead)
        def opt_in(switch: str) -> str:
            return "" if CONFIG[switch] else (f"off by default, measured no faster (RLX_CUDA_{switch.upper()}=1 "
                                              "turns it on)")
        split = "the CUDA-core split attention runs instead"
        attention = path("tensor-core attention (mma.sync)", mma, split, "tc_attention")
        return [
            path("tensor-core Gated DeltaNet prefill and MoE grouped GEMM (mma.sync)", mma,
                 "CUDA-core kernels run instead"),
            attention,
            path("wgmma + TMA attention",
                 wg or ("" if attention["on"] else "the tensor-core attention is off"),
                 "the mma.sync attention runs instead" if attention["on"] else split, "wg_attention"),
            path("cluster decode attention (KV caches of 513-2048 positions, few batch rows)",
                 device.cluster_missing(cc, hip), "the split attention runs instead", "decode_attention"),
            path("programmatic dependent launch", device.dependent_launch_missing(),
                 "each kernel starts once the one before it has drained", "dependent_launch"),
            path("decode GEMV kernel", "", "cuBLAS runs the decode products", "gemv"),
            path("tensor-core GEMV for 3-64 decode rows (mma.sync)",
                 mma or ("" if CONFIG["gemv_tc"] else "off by default, measured slower than cuBLAS "
                         "(RLX_CUDA_GEMV_TC=1 turns it on)"), "cuBLAS runs those products"),
            path("residual norms inside the decode GEMVs", "", "each norm is a launch of its own",
                 "gemv_fusion"),
            path('int8-activation decode GEMV (dp4a; [precision] activations = "int8")',
                 "a ROCm GPU: its inline PTX is CUDA's" if hip else "",
                 "a kernel rounds x, then the float GEMV", "int8_gemv"),
            path("RoPE inside the cluster decode attention",
                 device.cluster_missing(cc, hip) or opt_in("attn_rope"), "the RoPE is a launch of its own"),
            path("output gate inside the cluster decode attention",
                 device.cluster_missing(cc, hip) or opt_in("attn_epilogue"),
                 "the gate is a launch of its own"),
        ]

    # -- resources
    def stream(self):
        if self._stream is None:
            self._stream = device.cupy().cuda.Stream(non_blocking=True)
        return self._stream

    def arena(self, nbytes: int):
        """The shared activation arena (runners run one at a time on one stream)."""
        if self._arena is None or nbytes > self._arena_bytes:
            size = max(int(nbytes), 256)
            if self._arena is not None:
                size = max(size, self._arena_bytes + self._arena_bytes // 2)
            self._arena = device.alloc(size, "the activation arena")
            self._arena_bytes = size
        return self._arena

    def scratch(self, nbytes: int):
        """Scratch shared by the runners (packed weights decoded for a GEMM). Growing it makes
        a new buffer; launches built on the old one keep it alive through their runner."""
        if self._scratch is None or nbytes > self._scratch_bytes:
            size = max(int(nbytes), 256)
            self._scratch = device.alloc(size, "the dequantization scratch")
            self._scratch_bytes = size
        return self._scratch

    def release_cache(self) -> None:
        """Drop the shared arena and scratch (runners built on them keep theirs; the next
        runner sizes a fresh one to its own plan) and the pool's free blocks: deriving the
        weights at load grows the arena to the derived weights' size (1.3 GB for the 1B shape)."""
        self._arena = self._scratch = None
        self._arena_bytes = self._scratch_bytes = 0
        self.trim()

    def copy_bandwidth(self, nbytes: int = 1 << 28) -> float:
        """Device memory bandwidth of a large device-to-device copy (read + written bytes),
        timed with events on this backend's stream, best of 5."""
        cp = device.cupy()
        src = cp.ones(nbytes // 4, cp.float32)
        dst = cp.empty_like(src)
        s, e0, e1 = self.stream(), cp.cuda.Event(), cp.cuda.Event()
        best = float("inf")
        with s:
            cp.copyto(dst, src)                   # warm up
            for _ in range(5):
                e0.record(s)
                cp.copyto(dst, src)
                e1.record(s)
                e1.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        return 2 * src.nbytes / best

    # -- residency
    def to_device(self, array):
        if isinstance(array, CudaArray):
            return array
        a = np.asarray(array)
        return CudaArray(device.from_host(a, f"a {a.dtype}{list(a.shape)} array"), a.dtype)

    def to_host(self, value) -> np.ndarray:
        if isinstance(value, CudaArray):
            return value.get()
        if hasattr(value, "get") and hasattr(value, "data") and not isinstance(value, np.ndarray):
            return value.get()
        return np.asarray(value)

    def zeros(self, shape: tuple, dtype: DType):
        dt = DType.parse(dtype)
        arr = device.empty(tuple(shape), dt, f"a {dt.value}{list(shape)} state")
        arr.fill(0)
        device.cupy().cuda.runtime.deviceSynchronize()
        return CudaArray(arr, dt.np)

    def copy_into(self, dst, index: tuple, src, src_index: tuple):
        """A device-to-device copy on this backend's stream (ordered with the runs)."""
        if isinstance(dst, CudaArray) and isinstance(src, CudaArray):
            with self.stream():
                dst.data[index] = src.data[src_index]
            return dst
        return super().copy_into(dst, index, src, src_index)

    def copy_regions(self, jobs: list) -> list:
        """One launch a geometry for the jobs between buffers on this device of one dtype,
        their regions of ints and unit-step slices (a prefill's KV rows of every state into the
        batch cache: 60 copy launches before, ~30 us of host time each); the others as the
        base class does them."""
        copies: dict = {}
        rest = []
        for i, (dst, index, src, src_index) in enumerate(jobs):
            d = _geometry(dst.data, index) if isinstance(dst, CudaArray) else None
            s = _geometry(src.data, src_index) if isinstance(src, CudaArray) and d is not None else None
            if s is None or d[1] != s[1] or dst.dtype != src.dtype:
                rest.append(i)
            elif all(d[1]):
                copies.setdefault((d[1], s[2], d[2], dst.data.itemsize), []).append((s[0], d[0]))
        return self._batched(jobs, copies, rest, super().copy_regions)

    def join_blocks(self, jobs: list) -> list:
        """Every job's blocks in one launch where all are on this device and each job's are
        alike (a prefix-cache hit: ~1,900 blocks; cupy's concatenate a state cost ~0.1 ms of
        host time each); other jobs as the base class does them."""
        copies: dict = {}
        rest = [i for i, (dst, index, srcs, axis) in enumerate(jobs)
                if not (isinstance(dst, CudaArray) and srcs and all(isinstance(s, CudaArray) for s in srcs)
                        and _join_copies(dst.data[index], [s.data for s in srcs], axis, copies))]
        return self._batched(jobs, copies, rest, super().join_blocks)

    def _batched(self, jobs: list, copies: dict, rest: list, fallback) -> list:
        """`copies` (see _copy_many), then the jobs at the indices `rest` through `fallback`
        (the base class's way): each job's result buffer, its dst where the copies wrote it."""
        _copy_many(self.stream(), copies)
        out = [job[0] for job in jobs]
        for i, buf in zip(rest, fallback([jobs[i] for i in rest])):
            out[i] = buf
        return out

    def split_blocks(self, jobs: list) -> list:
        """Every job's parts in one launch where the sources are on this device (a prompt's
        new blocks of every state); other jobs as the base class does them."""
        copies: dict = {}
        out = []
        for src, index, axis, parts in jobs:
            if not isinstance(src, CudaArray):
                out.append(super().split_blocks([(src, index, axis, parts)])[0])
                continue
            region = src.data[index]
            shape = region.shape[:axis] + (region.shape[axis] // parts,) + region.shape[axis + 1:]
            bufs = [device.empty(shape, DType.parse(src.dtype), "a prefix cache block") for _ in range(parts)]
            step = shape[axis] * region.strides[axis]
            copies.setdefault((shape, region.strides, bufs[0].strides, region.itemsize), []).extend(
                (region.data.ptr + k * step, b.data.ptr) for k, b in enumerate(bufs))
            out.append([CudaArray(b, src.dtype) for b in bufs])
        _copy_many(self.stream(), copies)
        return out

    def copy_of(self, src, index: tuple):
        """A device copy of src[index] on this backend's stream (no zeroed buffer, no device sync)."""
        if isinstance(src, CudaArray):
            view = src.data[index]
            out = device.empty(view.shape, DType.parse(src.dtype), "a prefix cache block")
            with self.stream():
                out[...] = view
            return CudaArray(out, src.dtype)
        return super().copy_of(src, index)

    def memory_stats(self) -> dict:
        pool = device.cupy().get_default_memory_pool()
        return {"arena_bytes": int(self._arena_bytes), "scratch_bytes": int(self._scratch_bytes),
                "pool_total_bytes": int(pool.total_bytes()), "pool_used_bytes": int(pool.used_bytes())}

    def ensure_device(self, table: dict, name: str) -> CudaArray:
        """table[name] as a CudaArray; host arrays are uploaded once and replaced in place."""
        v = table[name]
        if not isinstance(v, CudaArray):
            v = self.to_device(v)
            table[name] = v
        return v

    def planned_layouts(self, g) -> tuple:
        """Transposes read through strides, concat inputs written in place (ops.planned_layouts)."""
        from .ops import planned_layouts

        return planned_layouts(g)

    # -- compile
    def compile(self, lir, params: dict, states: dict):
        ok, why = self.availability()
        if not ok:
            raise BackendError(f"backend 'cuda' is not available here: {why}")
        from . import control, deltanet, moe  # noqa: F401  (register control flow, dense_solve and the MoE / GDN ops)
        from .runner import CudaRunner

        self.trim()
        return CudaRunner(self, lir, params, states)

    def trim(self) -> None:
        """Give the memory pool's free blocks back to the device (what dropped runners,
        replaced KV caches and the weights' one-off derivation left cached in the pool), once
        per runner built: a decode step allocates nothing, so the pool then holds what is in
        use and not the high-water mark of every earlier build (1B shape, batch 1: 2.3 GB)."""
        import gc

        gc.collect()                 # a runner's launch closures form cycles that hold its buffers
        device.cupy().get_default_memory_pool().free_all_blocks()


_BACKEND = CudaBackend()


def backend() -> CudaBackend:
    return _BACKEND


def _geometry(arr, index: tuple) -> tuple | None:
    """(address, shape, byte strides) of cupy array arr[index] for an index of ints and
    unit-step slices (None for any other), without making the view; a scalar as one value."""
    ptr, shape, strides = arr.data.ptr, [], []
    for d, (n, st) in enumerate(zip(arr.shape, arr.strides)):
        i = index[d] if d < len(index) else slice(None)
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step != 1:
                return None
            ptr, shape, strides = ptr + a * st, shape + [max(b - a, 0)], strides + [st]
        elif isinstance(i, (int, np.integer)) and -n <= i < n:
            ptr += (int(i) % n) * st
        else:
            return None
    return (ptr, tuple(shape), tuple(strides)) if shape else (ptr, (1,), (arr.itemsize,))


def _join_copies(region, srcs: list, axis: int, copies: dict) -> bool:
    """Add the copies joining `srcs` (cupy arrays, contiguous, alike) along `axis` into `region`
    to `copies` ({geometry: address pairs}, see _copy_many); False (nothing added) where they
    are not alike or do not fill the region."""
    first = srcs[0]
    n = first.shape[axis]
    if (first.dtype != region.dtype or not first.flags.c_contiguous or first.ndim != region.ndim
            or first.shape[:axis] + first.shape[axis + 1:] != region.shape[:axis] + region.shape[axis + 1:]
            or n * len(srcs) != region.shape[axis]
            or any(s.shape != first.shape or s.strides != first.strides or s.dtype != first.dtype
                   for s in srcs)):
        return False
    step = n * region.strides[axis]
    copies.setdefault((first.shape, first.strides, region.strides, first.itemsize), []).extend(
        (s.data.ptr, region.data.ptr + k * step) for k, s in enumerate(srcs))
    return True


_UNITS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long", 16: "uint4"}


def _copy_many(stream, copies: dict) -> None:
    """The copies, one launch a geometry: `copies` maps (shape, source byte strides,
    destination byte strides, item size) to [(source address, destination address)]. Each
    moves in the widest unit its addresses, strides and contiguous last axis allow."""
    cp = device.cupy()
    for (shape, ss, ds, isz), pairs in copies.items():
        unit, shape = isz, tuple(shape)
        if ss[-1] == ds[-1] == isz:
            row, addrs = shape[-1] * isz, np.array(pairs, np.int64)
            unit = next(u for u in (16, 8, 4, 2, isz) if u <= isz or (
                row % u == 0 and all(s % u == 0 for s in ss[:-1] + ds[:-1]) and not (addrs % u).any()))
            shape = shape[:-1] + (row // unit,)
            ss, ds = tuple(ss[:-1]) + (unit,), tuple(ds[:-1]) + (unit,)
        n = int(np.prod(shape))
        table = np.array([*shape, *(s // unit for s in ss), *(s // unit for s in ds),
                          *(a for pair in pairs for a in pair)], np.int64)
        fn = device.kernel(sources.render(sources.COPY_MANY, T=_UNITS[unit], RANK=len(shape)),
                           "rlx_copy_many", "the KV caches' block copies")
        with stream:
            dev = cp.asarray(table)
            fn((min(-(-n // 256), 64), min(len(pairs), 65535)), (256,),
               (dev, np.int64(n), np.int64(len(pairs))), 0, stream)


@hookimpl
def rlx_register_backends(register):
    register(_BACKEND)


def set_config(**kw) -> None:
    """Implementation switches: gemv (decode GEMV kernel vs cuBLAS), tc_attention
    (tensor-core prefill attention vs CUDA cores), graphs (CUDA graph replay),
    dependent_launch (kernels start as programmatic dependents on Hopper: device.Kernel),
    gemv_fusion (residual RMSNorms inside the decode GEMVs; read when a runner is built)."""
    from .values import set_config as _set

    _set(**kw)


__all__ = ["CudaBackend", "CudaArray", "backend", "rlx_register_backends", "set_config"]
