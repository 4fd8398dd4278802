"""Reading GGUF metadata values with bounds: the one rule for every integer and float key,
shared by the container reader (gguf_io) and the family mappings (gguf_arch)."""
from __future__ import annotations

import math

from rlx_core.ir.errors import WeightError


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_REQUIRED = object()


def meta_int(path: str, md: dict, key: str, default=_REQUIRED, lo: int = 1, hi: int | None = None):
    """Integer metadata value `key` in [lo, hi]; `default` (as it is) when absent."""
    if key not in md:
        if default is _REQUIRED:
            raise WeightError(f"{path}: GGUF metadata lacks {key} (expected an integer >= {lo})")
        return default
    v = md[key]
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        want = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise WeightError(f"{path}: GGUF metadata {key} = {v!r}, expected {want}")
    return v


def meta_float(path: str, md: dict, key: str, default: float, lo: float = 0.0, strict: bool = True) -> float:
    """Finite number `key` > lo (>= lo when not strict), or `default` when absent."""
    v = md.get(key, default)
    if (
        not isinstance(v, (int, float))
        or isinstance(v, bool)
        or not math.isfinite(v)
        or v < lo
        or (strict and v == lo)
    ):
        raise WeightError(
            f"{path}: GGUF metadata {key} = {v!r}, expected a finite number {'>' if strict else '>='} {lo}"
        )
    return float(v)
