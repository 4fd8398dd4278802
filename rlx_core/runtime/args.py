"""Checks of the arguments a user passes to `generate`, `logits` and `embed`: each bad value
is a ModelError naming the argument and what was expected, raised before any work starts
(never a TypeError from numpy or an error about an op deep in a graph)."""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from ..ir.errors import ModelError


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@overload
def int_arg(name: str, v: Any, lo: int = 0, none: Literal[False] = False) -> int: ...
@overload
def int_arg(name: str, v: Any, lo: int = 0, *, none: bool) -> int | None: ...


def int_arg(name: str, v: Any, lo: int = 0, none: bool = False) -> int | None:
    """An integer >= lo (None passes through when `none`)."""
    if v is None and none:
        return None
    if not _is_int(v) or v < lo:
        raise ModelError(f"{name} must be an integer >= {lo}{' or None' if none else ''}, got {v!r}")
    return int(v)


@overload
def float_arg(name: str, v: Any, lo: float, hi: float = math.inf, lo_open: bool = False,
              none: Literal[False] = False) -> float: ...
@overload
def float_arg(name: str, v: Any, lo: float, hi: float = math.inf, lo_open: bool = False, *,
              none: bool) -> float | None: ...


def float_arg(name: str, v: Any, lo: float, hi: float = math.inf, lo_open: bool = False,
              none: bool = False) -> float | None:
    """A finite real number in [lo, hi] ((lo, hi] with lo_open)."""
    if v is None and none:
        return None
    ok = isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
    if ok:
        f = float(v)
        ok = math.isfinite(f) and (f > lo if lo_open else f >= lo) and f <= hi
    if not ok:
        rng = (f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi != math.inf
               else f"{'>' if lo_open else '>='} {lo:g}")
        raise ModelError(f"{name} must be a finite number {rng}{' or None' if none else ''}, got {v!r}")
    return f


def bool_arg(name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ModelError(f"{name} must be True or False, got {v!r}")
    return bool(v)


def callable_arg(name: str, v):
    if v is not None and not callable(v):
        raise ModelError(f"{name} must be a callable or None, got {type(v).__name__}")
    return v


def text_arg(name: str, v) -> str:
    """A str that is valid Unicode (a lone surrogate cannot be tokenized)."""
    if not isinstance(v, str):
        raise ModelError(f"{name} must be a string, got {type(v).__name__}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ModelError(f"{name} has a lone surrogate {v[e.start]!r} at character {e.start}; "
                         "expected valid Unicode text") from None
    return v


def token_id(name: str, v, vocab: int | None) -> int:
    """One token id (a model's EOS or pad id) within the vocabulary."""
    if not _is_int(v) or v < 0 or (vocab and v >= vocab):
        raise ModelError(f"{name} must be a token id in [0, {vocab or 'vocab_size'}), got {v!r}")
    return int(v)


def _row(name: str, r) -> list:
    if isinstance(r, np.ndarray):
        if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
            raise ModelError(f"{name} must be a 1-D sequence of integer token ids, got an array of "
                             f"shape {r.shape} of {r.dtype}")
        return r.tolist()
    if isinstance(r, (str, bytes)) or not isinstance(r, Sequence):
        raise ModelError(f"{name} must be a sequence of integer token ids, got {type(r).__name__}")
    for j, t in enumerate(r):
        if not _is_int(t):
            raise ModelError(f"{name} token {j} must be an integer token id, got {t!r}")
    return [int(t) for t in r]


def token_rows(name: str, ids, vocab: int | None = None) -> tuple:
    """(rows, one_dim): token id rows as lists of ints (rows may differ in length) from a 1-D
    or 2-D int array or (nested) sequence; every row non-empty, every id in [0, vocab)."""
    if isinstance(ids, np.ndarray) and ids.ndim == 2:
        if not np.issubdtype(ids.dtype, np.integer) and ids.size:
            raise ModelError(f"{name} must hold integer token ids, got an array of {ids.dtype}")
        rows, one_dim = ids.tolist(), False
    elif isinstance(ids, np.ndarray) and ids.ndim != 1:
        raise ModelError(f"{name} must be 1-D or 2-D, got shape {ids.shape}")
    elif (isinstance(ids, Sequence) and not isinstance(ids, str) and ids
          and isinstance(ids[0], (Sequence, np.ndarray)) and not isinstance(ids[0], (str, bytes))):
        rows, one_dim = [_row(f"{name} row {i}", r) for i, r in enumerate(ids)], False
    else:
        rows, one_dim = [_row(name, ids)], True
    if not rows:
        raise ModelError(f"{name} is an empty batch; expected at least one row of token ids")
    for i, r in enumerate(rows):
        where = name if one_dim else f"{name} row {i}"
        if not r:
            raise ModelError(f"{where} is empty; every row needs at least one token")
        lo, hi, top = min(r), max(r), vocab or 2**63
        if lo < 0 or hi >= top:
            raise ModelError(f"{where}: token id {lo if lo < 0 else hi} is out of range [0, {top})")
    return rows, one_dim


def id_matrix(ids, vocab: int | None = None, name: str = "ids") -> np.ndarray:
    """Token ids as an int64 [batch, seq] array (a 1-D sequence is one row): every row the
    same length, at least one row and one token, ids within the vocabulary."""
    rows, _ = token_rows(name, ids, vocab)
    n = len(rows[0])
    for i, r in enumerate(rows):
        if len(r) != n:
            raise ModelError(f"{name} row {i} has {len(r)} tokens but row 0 has {n}; rows must be "
                             "equally long (left-pad them and pass attention_mask)")
    return np.array(rows, np.int64)


def mask_arg(name: str, mask, shape: tuple) -> np.ndarray:
    """A bool [batch, seq] mask from bools or 0/1 integers, the shape of the ids, with at
    least one real token per row."""
    try:
        m = np.asarray(mask)
    except (ValueError, TypeError):
        m = None
    if m is None or m.shape != tuple(shape) or not (
            m.dtype == bool or (np.issubdtype(m.dtype, np.integer) and ((m == 0) | (m == 1)).all())):
        what = f"shape {m.shape} of {m.dtype}" if m is not None else type(mask).__name__
        raise ModelError(f"{name} must be a {list(shape)} array of bools or 0/1 integers (the shape of "
                         f"the token ids), got {what}")
    m = m.astype(bool)
    empty = np.flatnonzero(~m.any(axis=1))
    if empty.size:
        raise ModelError(f"{name} row {empty[0]} masks every token; each row needs at least one")
    return m


__all__ = ["int_arg", "float_arg", "bool_arg", "callable_arg", "text_arg", "token_id", "token_rows",
           "id_matrix", "mask_arg"]
