"""The KV cache of a batched decode: one row per running request, resized by buckets.

A decode graph's KV states are [batch, kv_heads, ctx, head_dim]; states without a ctx axis
(a recurrent layer's [batch, ...] conv and delta-rule states) move whole, per row. The cache is sized to a
(batch bucket, ctx bucket); when the running requests need another size, their rows move
(in order, compacted) into buffers of that size. Buffers of a size used before are kept and
reused, so the decode runner compiled for that size finds the very buffers it was bound to
and is not specialized again."""
from __future__ import annotations

from ..pipeline import StateStore

KEEP_SIZES = 4               # buffer sets kept for reuse (the current one included)


class BatchCache:
    """KV rows of a batched decode executable (`exe`, compiled over `self.store`)."""

    def __init__(self, backend, state_specs: dict, batch_dim: str):
        self.backend, self.specs, self.batch_dim = backend, dict(state_specs), batch_dim
        self.store = StateStore()
        self.batch = self.ctx = 0
        self._sets: dict = {}        # (batch, ctx) -> {name: buffer}, least recently used first

    def _axis(self, name: str) -> int | None:
        """The context axis of state `name`; None for a state without one (a recurrent
        layer's conv or delta-rule state: a row's whole state moves with the row)."""
        dims = list(self.specs[name].dims)
        return dims.index("ctx") if "ctx" in dims else None

    def _buffers(self, batch: int, ctx: int) -> dict:
        key = (batch, ctx)
        bufs = self._sets.pop(key, None)
        if bufs is None:
            env = {self.batch_dim: batch, "ctx": ctx}
            bufs = {n: self.backend.zeros(s.bind(env).dims, s.dtype) for n, s in self.specs.items()}
        self._sets[key] = bufs
        while len(self._sets) > KEEP_SIZES:
            self._sets.pop(next(iter(self._sets)))
        return bufs

    def _region(self, name: str, row: int, length: int) -> tuple:
        """Row `row`'s first `length` cache positions of state `name` (all of a state
        without a context axis)."""
        idx = [row] + [slice(None)] * (len(self.specs[name].dims) - 1)
        axis = self._axis(name)
        if axis is not None:
            idx[axis] = slice(0, length)
        return tuple(idx)

    def resize(self, batch: int, ctx: int, moves: list) -> None:
        """Become [batch, ..., ctx, ...]; moves: (old row, new row, length) of each row kept
        (its first `length` cache positions move; the rest of the new buffers is stale)."""
        if (batch, ctx) == (self.batch, self.ctx) and all(o == n for o, n, _ in moves):
            return
        old = {n: self.store[n] for n in self.specs} if self.batch else {}
        new = self._buffers(batch, ctx)
        names = [name for name in self.specs for _, _, length in moves if length]
        jobs = [(new[name], self._region(name, n, length), old[name], self._region(name, o, length))
                for name in self.specs for o, n, length in moves if length]
        if any(new[name] is old.get(name) for name in self.specs):       # (rows moving within a buffer:
            for name, (_, index, src, src_index) in zip(names, jobs):     # one after the other)
                new[name] = self.backend.copy_into(new[name], index, src, src_index)
        else:
            for name, buf in zip(names, self.backend.copy_regions(jobs)):
                new[name] = buf
        self.store.update(new)
        self._sets[(batch, ctx)] = new
        self.batch, self.ctx = batch, ctx

    def place(self, row: int, states, length: int) -> None:
        """Copy positions [0, length) of row 0 of `states` (a prefill's KV; a state without a
        ctx axis: all of row 0) into `row`."""
        names = list(self.specs)
        done = self.backend.copy_regions([(self.store[name], self._region(name, row, length),
                                           states[name], self._region(name, 0, length)) for name in names])
        for name, buf in zip(names, done):
            if buf is not self.store[name]:
                self.store[name] = self._sets[(self.batch, self.ctx)][name] = buf

    def clear(self) -> None:
        self._sets.clear()
        self.store.clear()
        self.batch = self.ctx = 0


__all__ = ["BatchCache"]
