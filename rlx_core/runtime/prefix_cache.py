"""A prefix cache: the KV rows (and recurrent states) of token prefixes seen before, so a
request whose prompt starts with one skips computing it (a shared system prompt, the
earlier turns of a conversation).

Prompts are cut into blocks of BLOCK tokens. A block's key hashes the previous block's key
with this block's ids, so equal keys mean equal whole prefixes. An entry holds, for each
state with a context axis (a layer's K or V cache), that block's rows ([1, ..., BLOCK, ...]),
and, where the model has states without one (a recurrent layer's conv and delta-rule
states, which cannot be cut per block), optionally a snapshot of them after the block: a
hit may end only at a block with a snapshot. Entries are backend buffers moved with the
backend's own `split_blocks` / `join_blocks` (host arrays on the CPU backends, device memory on
a GPU: every state's blocks in one launch), least recently used out first, their bytes bounded
by `capacity` (a parent is always used more recently than its children, so a chain is cut from
its end)."""
from __future__ import annotations

import collections
import hashlib
import math

import attrs
import numpy as np

from ..ir.dtype import DType
from ..ir.errors import ModelError

BLOCK = 32                   # tokens per block


@attrs.define
class Entry:
    """One block: its token ids, its rows of each KV state, an optional recurrent snapshot."""
    ids: tuple
    kv: dict
    snapshot: dict | None = None
    nbytes: int = 0


def block_keys(ids, block: int = BLOCK) -> list:
    """The hash-chain keys of `ids`' full blocks (a key names the whole prefix up to it)."""
    keys, prev = [], b""
    arr = np.asarray(ids, np.int64)
    for start in range(0, len(arr) - block + 1, block):
        prev = hashlib.blake2b(prev + arr[start:start + block].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Blocks of KV rows of `specs` (state name -> Shape of the generation graphs' states,
    batch axis first, named `batch_dim`) on `backend`, at most `capacity` bytes."""

    def __init__(self, backend, specs: dict, batch_dim, capacity: int, block: int = BLOCK):
        if not isinstance(capacity, int) or capacity < 0:
            raise ModelError(f"prefix cache capacity must be a whole number of bytes >= 0, got {capacity!r}")
        self.backend, self.capacity, self.block = backend, capacity, block
        # name -> (dims of one block's buffer, dtype, its ctx axis: None for a recurrent state)
        self.kv: dict[str, tuple] = {}
        self.recurrent: dict[str, tuple] = {}
        for name, s in specs.items():
            dims = list(s.dims)
            env = {batch_dim: 1, "ctx": block}
            bound = tuple(d if isinstance(d, int) else env.get(d, d) for d in dims)
            if any(not isinstance(d, int) for d in bound):
                raise ModelError(f"prefix cache: state {name!r} has dims {tuple(dims)}: only its batch and "
                                 "ctx axes may be symbolic")
            (self.kv if "ctx" in dims else self.recurrent)[name] = (bound, DType.parse(s.dtype),
                                                                   dims.index("ctx") if "ctx" in dims else None)
        self.entries: collections.OrderedDict = collections.OrderedDict()     # key -> Entry, LRU first
        self.bytes = 0
        self.evictions = 0

    @property
    def needs_snapshot(self) -> bool:
        """Whether a hit must end at a recurrent snapshot (the model has recurrent states)."""
        return bool(self.recurrent)

    def _nbytes(self, specs: dict) -> int:
        return sum(math.prod(dims) * dt.np.itemsize for dims, dt, _ in specs.values())

    # -- lookup
    def lookup(self, ids, limit: int) -> tuple:
        """(tokens hit, their entries): the longest cached prefix of `ids` of at most `limit`
        tokens made of whole blocks (ending at a snapshot where the model needs one). The
        entries used become the most recently used, parents after children."""
        chain = []
        for j, key in enumerate(block_keys(ids[:limit], self.block)):
            e = self.entries.get(key)
            if e is None or e.ids != tuple(int(t) for t in ids[j * self.block:(j + 1) * self.block]):
                break                      # (a different block: a hash collision is never a hit)
            chain.append((key, e))
        if self.needs_snapshot:
            while chain and chain[-1][1].snapshot is None:
                chain.pop()
        for key, _ in reversed(chain):
            self.entries.move_to_end(key)
        return len(chain) * self.block, [e for _, e in chain]

    def restore(self, entries: list, states) -> None:
        """Copy the entries' rows into row 0 of `states` (positions 0 .. len * block), all the
        states' blocks in one `join_blocks` (a 1,000-token prefix of a 30-layer model: 1,860
        blocks, one launch on a GPU), and the last entry's snapshot into the recurrent states."""
        if entries:
            names = list(self.kv)
            joined = self.backend.join_blocks([(states[name], self._region(name, 0, 0, len(entries)),
                                                [e.kv[name] for e in entries], self.kv[name][2])
                                               for name in names])
            for name, buf in zip(names, joined):
                states[name] = buf
        if entries and self.recurrent:
            for name, (dims, _, _) in self.recurrent.items():
                states[name] = self.backend.copy_into(states[name], (slice(0, 1),) + (slice(None),) * (len(dims) - 1),
                                                      entries[-1].snapshot[name], (slice(None),) * len(dims))

    def _region(self, name: str, row: int, start: int, blocks: int = 1) -> tuple:
        """Row `row`'s positions [start, start + blocks * block) of state `name`."""
        dims, _, axis = self.kv[name]
        idx = [slice(row, row + 1)] + [slice(None)] * (len(dims) - 1)
        idx[axis] = slice(start, start + blocks * self.block)
        return tuple(idx)

    # -- insertion
    def insert(self, ids, states, row: int, length: int, snapshot: bool = False) -> int:
        """Keep the full blocks of ids[:length] whose rows are `row` of `states` (positions
        0 .. length); `snapshot`: the recurrent states of that row are those after
        ids[:length] (length then a whole number of blocks) and go with its last block.
        Returns the blocks added."""
        if self._nbytes(self.kv) > self.capacity:
            return 0                       # (one block would not fit: nothing to keep)
        keys = block_keys(ids[:length], self.block)
        new = [j for j, key in enumerate(keys) if key not in self.entries]
        names, nbytes = list(self.kv), self._nbytes(self.kv)
        for j0, j1 in _runs(new):                 # (a run of new blocks: one split_blocks for every state)
            regions = [self._region(name, row, j0 * self.block, j1 - j0) for name in names]
            parts = self.backend.split_blocks([(states[name], region, self.kv[name][2], j1 - j0)
                                               for name, region in zip(names, regions)])
            for j in range(j0, j1):
                self.entries[keys[j]] = Entry(tuple(int(t) for t in ids[j * self.block:(j + 1) * self.block]),
                                              {name: blocks[j - j0] for name, blocks in zip(names, parts)},
                                              nbytes=nbytes)
                self.bytes += nbytes
        last = self.entries[keys[-1]] if keys else None
        if snapshot and self.recurrent and last is not None and last.snapshot is None \
                and len(keys) * self.block == length:
            last.snapshot = {name: self.backend.copy_of(states[name], (slice(row, row + 1),)
                                                        + (slice(None),) * (len(dims) - 1))
                             for name, (dims, _, _) in self.recurrent.items()}
            extra = self._nbytes(self.recurrent)
            last.nbytes += extra
            self.bytes += extra
        for key in reversed(keys):            # parents the most recent: a chain is cut at its end
            self.entries.move_to_end(key)
        self._evict()
        return len(new)

    def _evict(self) -> None:
        while self.bytes > self.capacity and self.entries:
            _, e = self.entries.popitem(last=False)
            self.bytes -= e.nbytes
            self.evictions += 1

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return cache_stats(len(self.entries), self.bytes, self.capacity, self.evictions)


def _runs(indices: list) -> list:
    """[start, end) of each run of consecutive ints in the sorted `indices`."""
    runs: list = []
    for j in indices:
        if runs and runs[-1][1] == j:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1])
    return [tuple(r) for r in runs]


def cache_stats(blocks: int = 0, nbytes: int = 0, capacity: int = 0, evictions: int = 0) -> dict:
    """A prefix cache's numbers as operators see them (/metrics); a scheduler without a cache
    yet reports zeros through this too."""
    return {"prefix_cache_blocks": blocks, "prefix_cache_bytes": nbytes, "prefix_cache_capacity": capacity,
            "prefix_cache_evictions": evictions}


__all__ = ["PrefixCache", "Entry", "block_keys", "cache_stats", "BLOCK"]
