"""The CPU communicator: tensor-parallel ranks as processes of one host exchanging numpy
buffers through one shared-memory block (a slot per rank) and a process barrier. Only raw
bytes cross between ranks (no pickle). Every rank sums the slots in rank order, so all
ranks get bit-identical results; a barrier that times out or is aborted (a rank died: the
supervisor in rlx_core.runtime.tp aborts it) is a BackendError, never a hang.
"""
from __future__ import annotations

import threading
from multiprocessing import shared_memory

import numpy as np

from ...ir.errors import BackendError

SLOT_BYTES = 8 << 20          # per rank; larger tensors go through in chunks


class ShmCommunicator:
    """Rank `rank` of `world` over the shared block `name` (world * slot_bytes bytes)."""

    def __init__(self, name: str, world: int, rank: int, barrier, slot_bytes: int = SLOT_BYTES,
                 timeout: float = 120.0):
        self.world, self.rank, self.barrier, self.timeout = world, rank, barrier, timeout
        self.slot_bytes = slot_bytes
        self.shm = shared_memory.SharedMemory(name=name)
        self.buf = np.ndarray((world, slot_bytes), np.uint8, self.shm.buf)

    def close(self) -> None:
        self.buf = None
        self.shm.close()

    def _wait(self) -> None:
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise BackendError(f"tensor-parallel rank {self.rank} of {self.world}: the group broke "
                               f"(another rank stopped, or none answered in {self.timeout:.0f} s)") from None

    def _slots(self, dtype, n):
        return [self.buf[r, :n * dtype.itemsize].view(dtype) for r in range(self.world)]

    def _chunks(self, flat):
        per = max(1, self.slot_bytes // flat.dtype.itemsize)
        for off in range(0, flat.size, per):
            yield off, flat[off:off + per]

    def _sum_flat(self, flat) -> np.ndarray:
        out = np.empty_like(flat)
        for off, part in self._chunks(flat):
            slots = self._slots(flat.dtype, part.size)
            slots[self.rank][:] = part
            self._wait()
            acc = slots[0].copy()
            for s in slots[1:]:
                acc += s
            out[off:off + part.size] = acc
            self._wait()                   # nobody writes the slots again before all have read
        return out

    def all_reduce(self, x, out) -> None:
        flat = np.ascontiguousarray(x).reshape(-1)
        np.copyto(out, self._sum_flat(flat).reshape(np.shape(x)), casting="unsafe")

    def all_gather(self, x, out, axis: int) -> None:
        moved = np.ascontiguousarray(np.moveaxis(np.asarray(x), axis, 0))
        flat = moved.reshape(-1)
        n = flat.size
        whole = np.empty(n * self.world, flat.dtype)
        for off, part in self._chunks(flat):
            slots = self._slots(flat.dtype, part.size)
            slots[self.rank][:] = part
            self._wait()
            for r, s in enumerate(slots):
                whole[r * n + off:r * n + off + part.size] = s
            self._wait()
        shape = (moved.shape[0] * self.world,) + moved.shape[1:]
        np.copyto(out, np.moveaxis(whole.reshape(shape), 0, axis), casting="unsafe")

    def reduce_scatter(self, x, out, axis: int) -> None:
        moved = np.ascontiguousarray(np.moveaxis(np.asarray(x), axis, 0))
        total = self._sum_flat(moved.reshape(-1)).reshape(moved.shape)
        m = moved.shape[0] // self.world
        np.copyto(out, np.moveaxis(total[self.rank * m:(self.rank + 1) * m], 0, axis), casting="unsafe")


def create_block(world: int, slot_bytes: int = SLOT_BYTES) -> shared_memory.SharedMemory:
    """The shared block a group's ranks attach to (the launcher owns and unlinks it)."""
    return shared_memory.SharedMemory(create=True, size=world * slot_bytes)


__all__ = ["ShmCommunicator", "create_block", "SLOT_BYTES"]
