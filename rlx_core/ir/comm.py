"""Communicators: what the collective ops' kernels (all_reduce, all_gather, reduce_scatter)
call. A tensor-parallel rank runs in its own process, so the communicator is bound once
per process (`bind`) by whoever starts the rank; core never imports a transport. The CPU
one (shared memory) lives in rlx_core/backends/numpy/comm.py, NCCL in the cuda plugin.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .errors import BackendError


@runtime_checkable
class Communicator(Protocol):
    """A group of `world` ranks; this process is `rank`. Every rank calls the same
    collectives in the same order (each rank runs the same sharded graph)."""
    world: int
    rank: int

    def all_reduce(self, x, out) -> None:
        """out = the sum of every rank's x."""

    def all_gather(self, x, out, axis: int) -> None:
        """out = every rank's x joined along `axis`, in rank order."""

    def reduce_scatter(self, x, out, axis: int) -> None:
        """out = this rank's chunk (along `axis`) of the sum of every rank's x."""


class SingleProcess:
    """The group of one: every collective is a copy (tp = 1, and unit tests of kernels)."""
    world, rank = 1, 0

    def all_reduce(self, x, out) -> None:
        np.copyto(out, x, casting="unsafe")

    def all_gather(self, x, out, axis: int) -> None:
        np.copyto(out, x, casting="unsafe")

    def reduce_scatter(self, x, out, axis: int) -> None:
        np.copyto(out, x, casting="unsafe")


_BOUND: list = [None]


def bind(comm) -> None:
    """Make `comm` (or None) this process's communicator."""
    if comm is not None and not isinstance(comm, Communicator):
        raise BackendError(f"bind: {type(comm).__name__} is not a Communicator (world, rank, "
                           "all_reduce, all_gather, reduce_scatter)")
    _BOUND[0] = comm


def bound():
    """This process's communicator, or None."""
    return _BOUND[0]


def current(world: int, rank: int):
    """The communicator a collective of group (`world`, `rank`) runs on: the bound one, which
    must be that group's rank; a group of one needs none."""
    comm = _BOUND[0]
    if comm is None:
        if world == 1:
            return SingleProcess()
        raise BackendError(f"a collective of {world} ranks runs here but no communicator is bound "
                           "in this process (start the ranks with `rlx generate --tp N` or "
                           "rlx_core.runtime.tp)")
    if comm.world != world or comm.rank != rank:
        raise BackendError(f"graph sharded for rank {rank} of {world} runs on a communicator of "
                           f"rank {comm.rank} of {comm.world}")
    return comm


__all__ = ["Communicator", "SingleProcess", "bind", "bound", "current"]
