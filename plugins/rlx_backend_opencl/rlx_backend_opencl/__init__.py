"""RLX backend on OpenCL (PyOpenCL): PoCL on CPUs, vendor drivers on GPUs.

Select it with `backend="opencl"`; pick a device with RLX_OPENCL_DEVICE or
`OpenCLBackend(device=...)` / `backend.with_device(...)` (a profile's `[backend] device` once
the pipeline hands it to backends through `configure`). Selectors: "P:D" (platform and device
index), "N" (index among all devices), or a name substring ("nvidia", "pthread").
"""
from __future__ import annotations

import numpy as np

from rlx_core.backends.base import Backend, Runner, best_time
from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import BackendError
from rlx_core.ir.lir import LirModule
from rlx_core.ir.ops import OPS
from rlx_core.plugins.hookspecs import hookimpl

from . import device as _device
from .device import CLArray

__version__ = "0.1.0"


class OpenCLBackend(Backend):
    name = "opencl"
    target = "opencl"             # fusion pattern set (passes/fusion.py TARGETS): every group

    def __init__(self, device: str | None = None):
        self.selector = device
        self._dev = None

    # -- device
    @property
    def device(self) -> _device.Device:
        """The selected device (selected on first use; raises BackendError if none)."""
        if self._dev is None:
            self._dev = _device.get_device(self.selector)
        return self._dev

    def with_device(self, selector: str | None) -> "OpenCLBackend":
        """A backend bound to another device selector (same name, separate state)."""
        if not selector or selector == self.selector:
            return self
        return OpenCLBackend(selector)

    def configure(self, config) -> "OpenCLBackend":
        """Apply a profile's BackendConfig (`[backend] device`)."""
        return self.with_device(getattr(config, "device", "") or None)

    def availability(self) -> tuple:
        """(True, "") when pyopencl imports, the device opens and a probe kernel builds and runs
        on it (once per device and process); else (False, why)."""
        try:
            import pyopencl  # noqa: F401  (importable at all?)
        except Exception as e:  # ImportError, or a broken ICD loader
            return False, f"pyopencl is not importable: {type(e).__name__}: {e}"
        try:
            why = self.device.unusable()
        except BackendError as e:
            return False, str(e)
        except Exception as e:  # a driver that fails while creating the context
            return False, f"OpenCL initialisation failed: {type(e).__name__}: {e}"
        return not why, why

    @property
    def priority(self) -> int:
        """Above numpy on a GPU, below it on a CPU device (PoCL)."""
        try:
            return 20 if self.device.is_gpu else 5
        except Exception:
            return 5

    @property
    def dtypes(self) -> frozenset:
        try:
            return self.device.dtypes()
        except Exception:
            return _device.BASE_DTYPES

    def check_dtype(self, dtype: DType, where: str) -> None:
        if dtype in self.dtypes:
            return
        dev = self.device.name if self._dev is not None or self.availability()[0] else "?"
        why = {DType.F16: "it lacks cl_khr_fp16 (RLX_OPENCL_FP16=1 allows f16 storage anyway)",
               DType.F64: "it lacks cl_khr_fp64",
               DType.BF16: "bf16 is not supported by the OpenCL backend"}.get(dtype, "unsupported dtype")
        raise BackendError(f"backend 'opencl' cannot compute in {dtype.value} ({where}) on device {dev}: "
                           f"{why}; it supports {sorted(d.value for d in self.dtypes)}")

    # -- ops
    def supported_ops(self) -> set:
        """What has a kernel here (never derived from the op table: a new op is a clean error)."""
        from .runner import kernel_ops

        return kernel_ops() & set(OPS)

    def expression_renderers(self) -> tuple:
        from .kernels import OPENCL

        return (OPENCL,)

    def supports_scheme(self, scheme) -> bool:
        """Whether dequant_matmul / dequantize have a kernel for this QuantScheme (or name)."""
        from rlx_core.ir.quant import QuantScheme

        from .quant import KINDS

        return QuantScheme.parse(scheme).kind in KINDS

    def supports_custom(self, name: str) -> bool:
        from rlx_core.ir.custom import custom_ops

        op = custom_ops().get(name)
        return op is not None and "opencl" in op.kernels

    def copy_bandwidth(self, nbytes: int = 1 << 27) -> float:
        """Bytes per second of a device buffer-to-buffer copy (read + written), best of 5,
        timed on the host with the queue finished after it."""
        import pyopencl as cl

        dev = self.device
        src, dst = _device.zeros(dev, (nbytes,), DType.U8).buf, _device.alloc(dev, nbytes)
        dev.queue.finish()
        return 2 * nbytes / best_time(
            lambda: (cl.enqueue_copy(dev.queue, dst, src, byte_count=nbytes), dev.queue.finish()))

    # -- residency
    def to_device(self, array) -> CLArray:
        if isinstance(array, CLArray) and array.device is self.device:
            return array
        arr = np.asarray(array)
        DType.parse(arr.dtype)
        return _device.upload(self.device, arr)

    def to_host(self, value) -> np.ndarray:
        if isinstance(value, CLArray):
            return value.get()
        return np.asarray(value)

    def zeros(self, shape: tuple, dtype: DType) -> CLArray:
        return _device.zeros(self.device, tuple(shape), DType.parse(dtype))

    def compile(self, lir: LirModule, params: dict, states: dict) -> Runner:
        from .runner import OpenCLRunner

        return OpenCLRunner(self, self.device, lir, params, states)


@hookimpl
def rlx_register_backends(register):
    register(OpenCLBackend())


__all__ = ["OpenCLBackend", "CLArray", "rlx_register_backends"]
