"""OpenCL devices: discovery, the selector (RLX_OPENCL_DEVICE / profile `[backend] device`),
one context + in-order queue per device, the program cache, and device arrays."""
from __future__ import annotations

import hashlib
import os
import re
import warnings

import numpy as np

from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError

from .kernels import source

ENV_DEVICE = "RLX_OPENCL_DEVICE"
ENV_FP16 = "RLX_OPENCL_FP16"
ENV_BUILD_OPTIONS = "RLX_OPENCL_BUILD_OPTIONS"     # extra clBuildProgram options
# every device: c64 is a float2 (interleaved, numpy's complex64 bytes)
BASE_DTYPES = frozenset({DType.F32, DType.I8, DType.I16, DType.I32, DType.I64, DType.U8, DType.U32,
                         DType.BOOL, DType.C64})
_HINT = ("install `pocl-binary-distribution` for a CPU device, or register a vendor ICD "
         "(NVIDIA: plugins/rlx_backend_opencl/scripts/register_nvidia_icd.sh)")
# What availability() builds and runs once per device: a driver can open a device it cannot
# compile for (PoCL whose LLVM does not know the host CPU: "unknown target CPU 'generic'").
PROBE = source("probe.cl")
PROBE_ITEMS = 8


def _cl():
    import pyopencl as cl

    return cl


def list_devices() -> list:
    """[(platform index, device index, platform, device)] of every OpenCL device here."""
    cl = _cl()
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:               # e.g. PLATFORM_NOT_FOUND_KHR: no ICD registered
        raise BackendError(f"no OpenCL platform found ({e}); {_HINT}") from None
    out = []
    for pi, p in enumerate(platforms):
        try:
            devs = p.get_devices()
        except cl.Error:
            devs = []
        out.extend((pi, di, p, d) for di, d in enumerate(devs))
    if not out:
        raise BackendError(f"no OpenCL device found on platforms "
                           f"{[p.name.strip() for p in platforms]}; {_HINT}")
    return out


def describe(p, d) -> str:
    return f"{d.name.strip()} ({p.name.strip()}, {d.version.strip()})"


def select(selector: str | None = None):
    """Pick a device: 'P:D' (platform and device index), 'N' (index in the list of all
    devices), or a case-insensitive substring of 'platform device vendor'. Empty: the first
    GPU, else the first device. The explicit selector wins over RLX_OPENCL_DEVICE."""
    cl = _cl()
    devs = list_devices()
    sel = (selector or os.environ.get(ENV_DEVICE) or "").strip()
    listing = "; ".join(f"{n}: [{pi}:{di}] {describe(p, d)}" for n, (pi, di, p, d) in enumerate(devs))
    if not sel:
        gpus = [t for t in devs if t[3].type & cl.device_type.GPU]
        return (gpus or devs)[0][2:]
    m = re.fullmatch(r"(\d+):(\d+)", sel)
    if m:
        for pi, di, p, d in devs:
            if (pi, di) == (int(m.group(1)), int(m.group(2))):
                return p, d
    elif sel.isdigit():
        if int(sel) < len(devs):
            return devs[int(sel)][2:]
    else:
        for pi, di, p, d in devs:
            if sel.lower() in f"{p.name} {d.name} {d.vendor}".lower():
                return p, d
    raise BackendError(f"OpenCL device selector {sel!r} matches no device; devices: {listing}")


class BuildError(BackendError):
    """A program the device's compiler rejected; `log` is pyopencl's message with the build log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def first_log_line(log: str) -> str:
    """The line of a pyopencl build failure that says why: the first line of the compiler's
    log (after pyopencl's "Build on <device>:" header) naming an error, else its first line."""
    lines = [line.strip() for line in log.splitlines()]
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("Build on ")), 0)
    body = [line for line in lines[start:] if line and not line.startswith("(options:")]
    return next((line for line in body if "error" in line.lower()), body[0] if body else log.strip())


class Device:
    """A context and queue on one device, its capabilities and its built programs."""

    def __init__(self, platform, device):
        cl = _cl()
        self.platform, self.dev = platform, device
        self.name = describe(platform, device)
        self.ctx = cl.Context([device])
        self.queue = cl.CommandQueue(self.ctx)
        exts = set(device.extensions.split())
        self.fp16 = "cl_khr_fp16" in exts
        self.fp64 = "cl_khr_fp64" in exts
        self.is_gpu = bool(device.type & cl.device_type.GPU)
        self.local_mem = int(device.local_mem_size)
        self.max_wg = int(device.max_work_group_size)
        self.programs: dict = {}
        self._unusable: str | None = None     # the probe's verdict, once run

    def dtypes(self) -> frozenset:
        base = set(BASE_DTYPES)
        if self.has_fp16():
            base.add(DType.F16)
        if self.fp64:
            base.add(DType.F64)
        return frozenset(base)

    def has_fp16(self) -> bool:
        """f16 is offered where the device has cl_khr_fp16. The kernels only move f16 through
        vload_half/vstore_half (core OpenCL) and compute in f32, so RLX_OPENCL_FP16=1 opts in
        to f16 storage on devices without the extension (NVIDIA's driver does not expose it)."""
        return self.fp16 or os.environ.get(ENV_FP16, "") == "1"

    def build(self, source: str, what: str, options: str = ""):
        """Build (or fetch from the cache) a program; a failure names the op and shows the log."""
        cl = _cl()
        opts = options or os.environ.get(ENV_BUILD_OPTIONS, "")
        key = hashlib.sha256((source + "\0" + opts).encode()).hexdigest()
        prg = self.programs.get(key)
        if prg is not None:
            return prg
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prg = cl.Program(self.ctx, source).build(options=opts, devices=[self.dev])
        except cl.Error as e:
            numbered = "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(source.splitlines()))
            raise BuildError(f"opencl: building the kernel for {what} on {self.name} failed.\n"
                             f"--- build log ---\n{e}\n--- source ---\n{numbered}", str(e)) from None
        self.programs[key] = prg
        return prg

    def unusable(self) -> str:
        """Why this device cannot build or run kernels ("" when it can): PROBE, run once."""
        if self._unusable is None:
            self._unusable = self._probe()
        return self._unusable

    def _probe(self) -> str:
        cl = _cl()
        try:
            prg = self.build(PROBE, "the availability probe")
        except BuildError as e:
            return f"OpenCL device {self.name} cannot build kernels: {first_log_line(e.log)}"
        out = np.zeros(PROBE_ITEMS, np.int32)
        try:
            buf = cl.Buffer(self.ctx, cl.mem_flags.WRITE_ONLY, out.nbytes)
            prg.rlx_probe(self.queue, (PROBE_ITEMS,), None, buf)
            cl.enqueue_copy(self.queue, out, buf)           # blocking: the kernel has finished
        except cl.Error as e:
            return f"OpenCL device {self.name} cannot run kernels: {first_log_line(str(e))}"
        want = 3 * np.arange(PROBE_ITEMS, dtype=np.int32) + 1
        if not np.array_equal(out, want):
            return (f"OpenCL device {self.name} runs kernels wrongly: the probe kernel wrote "
                    f"{out.tolist()}, expected {want.tolist()}")
        return ""


_DEVICES: dict = {}


def get_device(selector: str | None = None) -> Device:
    p, d = select(selector)
    key = d.int_ptr
    if key not in _DEVICES:
        _DEVICES[key] = Device(p, d)
    return _DEVICES[key]


class CLArray:
    """A contiguous device array: what params, states and to_device values are."""

    def __init__(self, device: Device, buf, shape: tuple, dtype: DType):
        self.device, self.buf, self.shape, self.rlx_dtype = device, buf, tuple(shape), dtype

    @property
    def dtype(self) -> np.dtype:
        return self.rlx_dtype.np

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.rlx_dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def get(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        if out.nbytes:
            _cl().enqueue_copy(self.device.queue, out.reshape(-1).view(np.uint8), self.buf)
        return out

    def __array__(self, dtype=None, copy=None):
        a = self.get()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"CLArray({self.rlx_dtype.value}{list(self.shape)} on {self.device.name})"


def alloc(device: Device, nbytes: int):
    cl = _cl()
    return cl.Buffer(device.ctx, cl.mem_flags.READ_WRITE, max((int(nbytes) + 63) // 64 * 64, 64))


def upload(device: Device, array: np.ndarray) -> CLArray:
    cl = _cl()
    dt = DType.parse(array.dtype)
    a = np.ascontiguousarray(array)
    buf = alloc(device, a.nbytes)
    if a.nbytes:
        cl.enqueue_copy(device.queue, buf, a.reshape(-1).view(np.uint8))
    return CLArray(device, buf, a.shape, dt)


def zeros(device: Device, shape: tuple, dtype: DType) -> CLArray:
    cl = _cl()
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = alloc(device, nbytes)
    cl.enqueue_fill_buffer(device.queue, buf, np.uint8(0), 0, max(nbytes, 64))
    return CLArray(device, buf, shape, dtype)
