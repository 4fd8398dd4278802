"""The device layer: CuPy import and availability, allocation with useful out-of-memory
errors, the stream, and the NVRTC kernel cache (errors name the op and the source line)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os

import numpy as np
from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError

from . import sources
from .values import CONFIG

_cp = None


def cupy():
    """The cupy module (imported on first use so CPU-only installs never pay for it)."""
    global _cp
    if _cp is None:
        import cupy as cp  # noqa: PLC0415

        _cp = cp
    return _cp


@functools.lru_cache(maxsize=1)
def probe() -> tuple:
    """(available, reason, info dict). Never raises."""
    try:
        import cupy as cp  # noqa: PLC0415
    except Exception as e:  # ImportError, or a broken CUDA install under it
        return False, f"cupy is not importable ({type(e).__name__}: {e}); install cupy-cuda12x/13x", {}
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no usable CUDA driver/GPU ({type(e).__name__}: {e})", {}
    if n < 1:
        return False, "no CUDA GPU is visible (device count 0)", {}
    try:
        hip = bool(cp.cuda.runtime.is_hip)
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        cc = (int(props["major"]), int(props["minor"]))
        info = {"name": name, "cc": cc, "sms": int(props["multiProcessorCount"]), "hip": hip,
                "total_mem": int(props["totalGlobalMem"])}
    except Exception as e:
        return False, f"cannot query the GPU ({type(e).__name__}: {e})", {}
    return True, "", info


def info() -> dict:
    return probe()[2]


def _sm(cc) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def mma_missing(cc, hip: bool) -> str:
    """Why the mma.sync tensor-core kernels (attention, the Gated DeltaNet prefill, the MoE
    grouped GEMM) cannot run on this GPU; '' where they can."""
    if hip:
        return "a ROCm GPU: their inline PTX is CUDA's"
    if tuple(cc) < (8, 0):
        return f"they need sm_80 or later; this GPU is {_sm(cc)}"
    return ""


def wgmma_missing(cc, hip: bool) -> str:
    """Why the wgmma + TMA attention cannot run on this GPU; '' where it can (sm_90a only:
    Hopper's warpgroup MMA is not in sm_100 and later)."""
    if hip:
        return "a ROCm GPU: its inline PTX is CUDA's"
    if tuple(cc) != (9, 0):
        return f"it needs sm_90 (Hopper's wgmma and TMA); this GPU is {_sm(cc)}"
    return ""


def cluster_missing(cc, hip: bool) -> str:
    """Why the cluster decode attention (thread-block clusters, distributed shared memory)
    cannot run on this GPU; '' where it can."""
    if hip:
        return "a ROCm GPU: its inline PTX is CUDA's"
    if tuple(cc) < (9, 0):
        return f"it needs sm_90 or later (thread-block clusters); this GPU is {_sm(cc)}"
    return ""


def supported_dtypes() -> frozenset:
    """What this GPU computes: every type (complex64 in FFTs, elementwise arithmetic and
    views); bf16 needs sm_80+."""
    ok, _, inf = probe()
    out = set(DType)
    if ok and not inf.get("hip") and inf["cc"] < (8, 0):
        out.discard(DType.BF16)
    if ok and not inf.get("hip") and inf["cc"] < (5, 3):
        out.discard(DType.F16)
    return frozenset(out)


def storage_dtype(dt: DType) -> np.dtype:
    """The numpy/cupy dtype holding `dt` on the device: bf16 lives in 16-bit buffers."""
    return np.dtype(np.uint16) if dt is DType.BF16 else dt.np


# ----------------------------------------------------------------------------- memory
def mem_info() -> tuple:
    free, total = cupy().cuda.runtime.memGetInfo()
    return int(free), int(total)


def alloc(nbytes: int, what: str):
    """Device memory (a cupy MemoryPointer) of `nbytes`; an OOM names bytes requested and free."""
    cp = cupy()
    nbytes = max(int(nbytes), 1)
    try:
        return cp.cuda.alloc(nbytes)
    except cp.cuda.memory.OutOfMemoryError:
        cp.get_default_memory_pool().free_all_blocks()
        try:
            return cp.cuda.alloc(nbytes)
        except cp.cuda.memory.OutOfMemoryError:
            free, total = mem_info()
            pool = cp.get_default_memory_pool()
            raise BackendError(
                f"cuda backend: out of GPU memory allocating {nbytes} bytes for {what}: "
                f"{free} bytes free of {total} on the device (this process's pool holds "
                f"{pool.total_bytes()} bytes, {pool.used_bytes()} in use)") from None


def empty(shape, dt: DType, what: str):
    """A contiguous device array of logical dtype `dt` (storage dtype for bf16)."""
    cp = cupy()
    sd = storage_dtype(dt)
    n = int(np.prod(shape, dtype=np.int64)) * sd.itemsize
    mem = alloc(n, what)
    return cp.ndarray(tuple(shape), sd, memptr=mem)


def from_host(array: np.ndarray, what: str):
    """Upload a host array (bf16 as its 16-bit pattern) into fresh device memory; a 0-d
    array stays 0-d (ascontiguousarray alone makes it [1])."""
    a = np.ascontiguousarray(array).reshape(np.shape(array))
    dt = DType.parse(a.dtype)
    out = empty(a.shape, dt, what)
    if a.size:
        out.set(a.view(storage_dtype(dt)) if dt is DType.BF16 else a)
        cp = cupy()
        cp.cuda.runtime.deviceSynchronize()
    return out


# ----------------------------------------------------------------------------- kernels
_KERNELS: dict = {}
OPTIONS = ("--std=c++17",)


def kernel(source: str, name: str, op: str, dynamic_smem: int = 0):
    """The compiled function `name` of `source` (compiled once per process, NVRTC's disk
    cache across processes), launched as `fn(grid, block, args, shared_mem, stream)`. A
    compile error is a BackendError naming the op and the line. `dynamic_smem`: the bytes of
    dynamic shared memory its launches take (above 48 KB a kernel must opt in; the source
    fixes the size, so once per compile). A kernel on wgmma compiles for sm_90a
    (sources.own_arch)."""
    key = (hashlib.sha1(source.encode()).hexdigest(), name)
    fn = _KERNELS.get(key)
    if fn is not None:
        return fn
    cp = cupy()
    source = sources.with_grid_wait(source, name)
    arch = sources.own_arch(source)
    try:
        mod = cp.RawModule(code=source, options=OPTIONS + ((f"-arch={arch}",) if arch else ()))
        raw = mod.get_function(name)
    except cp.cuda.compiler.CompileException as e:
        log = str(e)
        raise BackendError(f"cuda backend: compiling kernel {name!r} for op {op!r} failed:\n"
                           f"{log.strip()[:2000]}{sources.error_line(source, log)}") from None
    if dynamic_smem > 48 * 1024:
        try:
            raw.max_dynamic_shared_size_bytes = dynamic_smem
        except Exception as e:
            raise BackendError(f"cuda backend: kernel {name!r} for op {op!r} needs {dynamic_smem} bytes of "
                               f"shared memory: {e}") from None
    # (raw.kernel: the launchable cupy.cuda.function.Function)
    fn = _KERNELS[key] = Kernel(raw.kernel, name) if dependent_launch() else raw.kernel
    return fn


@functools.lru_cache(maxsize=1)
def driver():
    """The CUDA driver library (libcuda), opened once."""
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=1)
def dependent_launch():
    """cuLaunchKernelEx of the driver where a kernel may launch as a programmatic dependent
    (Hopper and later, CUDA not HIP), else None."""
    if dependent_launch_missing():
        return None
    fn = driver().cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def dependent_launch_missing() -> str:
    """Why kernels cannot launch as programmatic dependents here (device.Kernel); '' where
    they can (CUDA on sm_90 or later, a driver with cuLaunchKernelEx)."""
    inf = probe()[2]
    if inf.get("hip"):
        return "a ROCm GPU"
    if tuple(inf.get("cc", (0, 0))) < (9, 0):
        return f"it needs sm_90 or later; this GPU is {_sm(inf.get('cc', (0, 0)))}"
    try:
        driver().cuLaunchKernelEx
    except (OSError, AttributeError) as e:
        return f"the CUDA driver has no cuLaunchKernelEx ({type(e).__name__}: {e})"
    return ""


class _LaunchAttr(ctypes.Structure):          # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):        # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("nattrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6        # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_DEPENDENT = _LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)       # (the same for every launch)
_DEPENDENT.value[0] = 1
_ARG_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
               np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
               np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


class Kernel:
    """A kernel launched as a programmatic dependent of the kernel before it on the stream
    (Hopper's PDL): its blocks start while that kernel's last blocks finish, run what reads
    no result of it (a GEMV's first weight loads), and wait for it at RLX_GRID_WAIT(). A
    decode step is ~130 small kernels, so each one's start no longer waits for the drain of
    the one before. Arguments CuPy would convert otherwise (Python ints) launch as CuPy does."""
    __slots__ = ("fn", "name")

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        params = _c_args(args) if CONFIG["dependent_launch"] else None
        if params is None:
            return self.fn(grid, block, args, shared_mem, stream)
        cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid, *[1] * (3 - len(grid))),
                            (ctypes.c_uint * 3)(*block, *[1] * (3 - len(block))), shared_mem,
                            stream.ptr if stream is not None else 0, ctypes.pointer(_DEPENDENT), 1)
        ptrs = (ctypes.c_void_p * len(params))(*[ctypes.addressof(c) for c in params])
        err = dependent_launch()(ctypes.byref(cfg), self.fn.ptr, ptrs, None)
        if err:
            raise BackendError(f"cuda backend: launching kernel {self.name!r} failed (CUresult {err})")


def _c_args(args) -> list | None:
    """The kernel arguments as ctypes values, or None where one is not a device array, None
    (a null pointer), float (a double) or a NumPy scalar of a known type."""
    out = []
    for a in args:
        if a is None:
            out.append(ctypes.c_void_p(0))
        elif isinstance(a, np.generic):
            t = _ARG_CTYPES.get(a.dtype)
            if t is None:
                return None
            out.append(t(a.item()))
        elif isinstance(a, float):
            out.append(ctypes.c_double(a))
        elif hasattr(a, "data") and hasattr(a.data, "ptr"):
            out.append(ctypes.c_void_p(a.data.ptr))
        else:
            return None
    return out


def tensor_map(arr, box: tuple, what: str):
    """A tiled TMA descriptor (CUtensorMap, 128-byte swizzle) of the 16-bit device array
    `arr` for boxes of `box` elements (innermost first), in device memory: a kernel's
    cp.async.bulk.tensor reads it there (cuTensorMapEncodeTiled of the driver)."""
    fn = driver().cuTensorMapEncodeTiled
    rank = arr.ndim
    dims = (ctypes.c_uint64 * rank)(*reversed(arr.shape))
    strides = (ctypes.c_uint64 * (rank - 1))(*reversed(arr.strides[:-1]))
    tmap = (ctypes.c_uint64 * 16)()
    err = fn(ctypes.byref(tmap), 1, rank, ctypes.c_void_p(arr.data.ptr), dims, strides,
             (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*[1] * rank), 0, 3, 2, 0)
    if err:
        raise BackendError(f"cuda backend: cuTensorMapEncodeTiled failed for {what} (CUresult {err}; shape "
                           f"{tuple(arr.shape)}, strides {tuple(arr.strides)} bytes)")
    return from_host(np.frombuffer(bytes(tmap), np.uint8), f"the tensor map of {what}")


def compile_check_sources() -> list:
    """(name, source) of representative specializations, for an offline nvcc check."""
    from . import kernels_catalog

    return kernels_catalog.catalog()


def loaded_library(*prefixes: str) -> str | None:
    """The path of the first shared library this process has mapped whose file name starts
    with one of `prefixes` (the cuBLAS / cuFFT that CuPy loaded, called through ctypes)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if "/" in line else ""
            if path.rsplit("/", 1)[-1].startswith(prefixes):
                return path
    return None


def required_library(what: str, *prefixes: str) -> str:
    """loaded_library(*prefixes), or a BackendError saying CuPy did not load `what`."""
    path = loaded_library(*prefixes)
    if path is None:
        raise BackendError(f"cuda backend: cannot find the {what} library CuPy loaded")
    return path


def env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")
