"""Shapes: a tuple of dims (int or named symbol such as "seq") plus a dtype."""
from __future__ import annotations

import math
from typing import Mapping, Union

import attrs

from .dtype import DType
from .errors import ShapeError

Dim = Union[int, str]


def _dims(value) -> tuple:
    dims = tuple(value)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, str)):
            raise ShapeError(f"a dim must be an int or a symbol name, got {d!r} in {dims}")
        if isinstance(d, int) and d < 0:
            raise ShapeError(f"a dim must be >= 0, got {d} in {dims}")
    return dims


@attrs.frozen
class Shape:
    dims: tuple = attrs.field(converter=_dims)
    dtype: DType = attrs.field(converter=DType.parse)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.dims)

    @property
    def symbols(self) -> set:
        return {d for d in self.dims if isinstance(d, str)}

    def numel(self) -> int:
        if not self.is_static:
            raise ShapeError(f"shape {self} has unbound dims {sorted(self.symbols)}")
        return math.prod(self.dims)

    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def bind(self, env: Mapping[str, int]) -> "Shape":
        return Shape(tuple(env.get(d, d) if isinstance(d, str) else d for d in self.dims), self.dtype)

    def with_dtype(self, dtype: DType) -> "Shape":
        return Shape(self.dims, dtype)

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(str(d) for d in self.dims)}]"


def bind_dim(d: Dim, env: Mapping[str, int]) -> Dim:
    return env.get(d, d) if isinstance(d, str) else d


def broadcast_dims(a: tuple, b: tuple, what: str = "broadcast") -> tuple:
    """numpy broadcasting over dims that may be symbols (equal symbols match, 1 stretches)."""
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ShapeError(f"{what}: dims {a} and {b} do not broadcast (axis -{i + 1}: {x} vs {y})")
    return tuple(reversed(out))


def norm_axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{what}: axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0
