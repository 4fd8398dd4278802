"""NCCL communicator for tensor-parallel ranks (one process per GPU) through cupy.cuda.nccl.

Rank 0 makes the NCCL unique id and hands it to the others through the launcher's shared
block (rlx_core.runtime.tp), so no extra rendezvous service is needed. Collectives take
CuPy arrays (run on the current stream) or NumPy arrays (staged through the GPU: lets the
numpy backend's sharded graphs test the NCCL transport); the cuda runner calls `on_device`
on its own buffers and stream. Use it with RLX_TP_COMM=rlx_backend_cuda.nccl:NcclCommunicator
(benchmarks/llm_gpu_tp.py picks it on cuda). Not yet run on a multi-GPU machine.
"""
from __future__ import annotations

import threading
from multiprocessing import shared_memory

import numpy as np

from rlx_core.ir.errors import BackendError

try:                                   # import-guarded: the plugin loads without NCCL
    import cupy
    from cupy.cuda import nccl
except ImportError as e:               # pragma: no cover - machines without cupy/NCCL
    cupy = nccl = None
    _WHY = f"{type(e).__name__}: {e}"

_ID_BYTES = 128


def _dtype(dt) -> int:
    table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
             np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
             np.dtype(np.int64): nccl.NCCL_INT64}
    if np.dtype(dt).name == "bfloat16" and hasattr(nccl, "NCCL_BFLOAT16"):
        return nccl.NCCL_BFLOAT16
    try:
        return table[np.dtype(dt)]
    except KeyError:
        raise BackendError(f"NCCL collectives: no NCCL type for {np.dtype(dt)}") from None


def _id_bytes(uid) -> np.ndarray:
    """NCCL's unique id as int8 bytes: cupy gives bytes (newer) or a tuple of ints (older)."""
    if isinstance(uid, (bytes, bytearray)):
        return np.frombuffer(bytes(uid), np.int8)
    return np.asarray(uid, np.int8)


class NcclCommunicator:
    """Rank `rank` of `world` on GPU `rank % device count` (the Communicator protocol)."""

    def __init__(self, block: str, world: int, rank: int, barrier, slot_bytes: int, timeout: float):
        if nccl is None:
            raise BackendError(f"NCCL communicator: cupy.cuda.nccl is not importable ({_WHY})")
        self.world, self.rank = world, rank
        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        shm = shared_memory.SharedMemory(name=block)
        try:
            slot = np.ndarray((_ID_BYTES,), np.int8, shm.buf)
            if rank == 0:
                slot[:] = _id_bytes(nccl.get_unique_id())
            self._wait(barrier, timeout)
            uid = bytes(slot.view(np.uint8))
            self._wait(barrier, timeout)       # every rank read the id before slot 0 is reused
            del slot
        finally:
            shm.close()
        try:
            self.comm = nccl.NcclCommunicator(world, uid, rank)
        except TypeError:                      # an older cupy takes the id as a tuple of ints
            ints = tuple(int(v) for v in np.frombuffer(uid, np.int8))
            self.comm = nccl.NcclCommunicator(world, ints, rank)

    @staticmethod
    def _wait(barrier, timeout):
        try:
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise BackendError("NCCL communicator: the group broke while exchanging the NCCL id") from None

    def close(self) -> None:
        if getattr(self, "comm", None) is not None:
            self.comm.destroy()
            self.comm = None

    def on_device(self, op: str, x, out, dtype, stream) -> None:
        """`op` on contiguous device buffers of logical `dtype` (their storage may differ:
        bf16 lives in 16-bit buffers) on `stream`, allocating nothing (the cuda runner's
        collectives, captured into its CUDA graphs): all_gather and reduce_scatter join and
        split the flat buffers in rank order (along axis 0)."""
        t, s = _dtype(dtype), stream.ptr
        if op == "all_reduce":
            self.comm.allReduce(x.data.ptr, out.data.ptr, x.size, t, nccl.NCCL_SUM, s)
        elif op == "all_gather":
            self.comm.allGather(x.data.ptr, out.data.ptr, x.size, t, s)
        elif op == "reduce_scatter":
            self.comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, t, nccl.NCCL_SUM, s)
        else:
            raise BackendError(f"NCCL communicator: no collective {op!r}")

    def _run(self, x, out, fn) -> None:
        host = isinstance(x, np.ndarray)
        dx = cupy.ascontiguousarray(cupy.asarray(x))
        dout = cupy.empty(out.shape, dx.dtype) if host or not out.flags.c_contiguous else out
        fn(dx, dout, cupy.cuda.get_current_stream().ptr)
        if host:
            np.copyto(out, cupy.asnumpy(dout), casting="unsafe")
        elif dout is not out:
            out[...] = dout

    def all_reduce(self, x, out) -> None:
        self._run(x, out, lambda a, o, s: self.comm.allReduce(a.data.ptr, o.data.ptr, a.size, _dtype(a.dtype),
                                                              nccl.NCCL_SUM, s))

    def all_gather(self, x, out, axis: int) -> None:
        def fn(a, o, s):
            parts = cupy.empty((self.world,) + a.shape, a.dtype)     # rank-major, then join on axis
            self.comm.allGather(a.data.ptr, parts.data.ptr, a.size, _dtype(a.dtype), s)
            o[...] = cupy.concatenate(list(parts), axis=axis)
        self._run(x, out, fn)

    def reduce_scatter(self, x, out, axis: int) -> None:
        def fn(a, o, s):
            moved = cupy.ascontiguousarray(cupy.moveaxis(a, axis, 0))
            part = cupy.empty((moved.shape[0] // self.world,) + moved.shape[1:], a.dtype)
            self.comm.reduceScatter(moved.data.ptr, part.data.ptr, part.size, _dtype(a.dtype),
                                    nccl.NCCL_SUM, s)
            o[...] = cupy.moveaxis(part, 0, axis)
        self._run(x, out, fn)


__all__ = ["NcclCommunicator"]
