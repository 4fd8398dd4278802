"""Reading safetensors files into numpy arrays.

The header is parsed here rather than through `safetensors.numpy`, because numpy has no bfloat16:
`framework="np"` cannot hand back bf16 (or fp8) tensors, while `ml_dtypes` can view the raw bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import NamedTuple

import ml_dtypes
import numpy as np

from rlx_core.ir.errors import WeightError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit; a bigger number means a corrupt file
# a header nests 3 deep (file -> tensor -> shape); the parser recurses per level, so deeper
# headers are refused before parsing (the safetensors library's parser allows 128)
_MAX_DEPTH = 64


class TensorEntry(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # byte range in the data section
    end: int


def _uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_safetensors_header(path: str) -> tuple[dict[str, TensorEntry], int]:
    """`(entries, data_start)`: the checked tensor table of a safetensors file, no tensor read.

    The `safetensors` library's rules: dtypes known, shapes and offsets non-negative integers,
    each tensor's bytes = elements x dtype size, and the byte ranges tile the data section
    from 0 to its end in order, without gaps or overlaps."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightError(
                    f"{path}: file is {size} bytes, too short to be safetensors "
                    "(expected an 8-byte header length)"
                )
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise WeightError(
                    f"{path}: header length {length} exceeds the format's limit of {_MAX_HEADER} bytes; "
                    "corrupt or not safetensors"
                )
            if 8 + length > size:
                raise WeightError(
                    f"{path}: header length {length} does not fit a {size}-byte file; "
                    "truncated or not safetensors"
                )
            raw = f.read(length)
        depth = json_depth(raw)
        if depth > _MAX_DEPTH:
            raise WeightError(f"{path}: safetensors header nests {depth} levels deep, over the limit of "
                              f"{_MAX_DEPTH} (a header nests 3); corrupt or not safetensors")
        header = json.loads(raw)
    except OSError as e:
        raise WeightError(f"{path}: cannot read safetensors file ({e})") from e
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WeightError(
            f"{path}: safetensors header is not valid JSON ({type(e).__name__}: {e}); "
            "corrupt or not safetensors"
        ) from None
    if not isinstance(header, dict):
        raise WeightError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WeightError(f"{path}: safetensors __metadata__ must be an object of strings")
    entries = {name: _entry(path, name, info) for name, info in header.items()}
    data = size - 8 - length
    pos = 0
    for name, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != pos:
            what = "overlaps the tensor before it" if entry.begin < pos else f"leaves a gap after byte {pos}"
            raise WeightError(
                f"{path}: tensor {name!r} data_offsets [{entry.begin}, {entry.end}) {what}; expected the "
                "tensors to cover the data section in order without gaps or overlaps"
            )
        pos = entry.end
    if pos != data:
        raise WeightError(
            f"{path}: the tensors cover {pos} bytes but the data section has {data}; "
            + ("the file is truncated" if pos > data else "corrupt (bytes no tensor owns)")
        )
    return entries, 8 + length


def json_depth(text: bytes) -> int:
    """How deep JSON `text` nests arrays and objects (brackets in strings skipped), found without
    parsing it, in linear time and bounded memory: a bound to check before json.loads, which
    recurses per level (a hostile file drives it into RecursionError)."""
    # escaped backslashes, then escaped quotes, go first: every quote left opens or closes a string
    t = np.frombuffer(text.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    quotes = level = deepest = 0
    for i in range(0, len(t), 1 << 20):           # in chunks: a 100 MB header takes ~40 MB
        c = t[i:i + (1 << 20)]
        is_quote = c == ord('"')
        outside = (quotes + np.cumsum(is_quote)) % 2 == 0
        steps = (((c == ord("[")) | (c == ord("{"))).astype(np.int64)
                 - ((c == ord("]")) | (c == ord("}")))) * outside
        levels = level + np.cumsum(steps)
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
        quotes += int(is_quote.sum())
    return deepest


def _entry(path: str, name: str, info) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise WeightError(f"{where}: entry is {type(info).__name__}, expected an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise WeightError(f"{where}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_uint(d) for d in shape):
        raise WeightError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_uint(o) for o in offsets):
        raise WeightError(f"{where}: data_offsets {offsets!r} is not two non-negative integers")
    begin, end = offsets
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize  # Python ints: no overflow
    if end < begin or end - begin != nbytes:
        raise WeightError(
            f"{where}: {dtype} {shape} needs {nbytes} bytes but data_offsets [{begin}, {end}) "
            f"hold {end - begin}"
        )
    return TensorEntry(_DTYPES[dtype], tuple(shape), begin, end)


def iter_safetensors(path: str):
    """Yield `(name, array)` for every tensor of one file, copied into memory in its stored dtype."""
    entries, start = read_safetensors_header(path)
    if not any(e.end > e.begin for e in entries.values()):
        for name, e in entries.items():
            yield name, np.zeros(e.shape, e.dtype)
        return
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    for name, e in entries.items():
        yield name, np.array(blob[start + e.begin : start + e.end].view(e.dtype).reshape(e.shape))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one file, by name."""
    return dict(iter_safetensors(path))
