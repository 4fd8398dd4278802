"""Reading safetensors files into numpy arrays.

The header is parsed here rather than through `safetensors.numpy`, because numpy has no bfloat16:
`framework="np"` cannot hand back bf16 (or fp8) tensors, while `ml_dtypes` can view the raw bytes.
"""

from __future__ import annotations

import json
import os
import struct

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


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """`(header, data_start)`: the tensor table of a safetensors file, without reading any tensor."""
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
            if length > _MAX_HEADER or 8 + length > size:
                raise WeightError(
                    f"{path}: header length {length} does not fit a {size}-byte file; "
                    "truncated or not safetensors"
                )
            header = json.loads(f.read(length))
    except OSError as e:
        raise WeightError(f"{path}: cannot read safetensors file ({e})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightError(
            f"{path}: safetensors header is not valid JSON ({e}); corrupt or not safetensors"
        ) from e
    if not isinstance(header, dict):
        raise WeightError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def iter_safetensors(path: str):
    """Yield `(name, array)` for every tensor of one file, copied into memory in its stored dtype."""
    header, start = read_safetensors_header(path)
    size = os.path.getsize(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r") if size > start else np.zeros(0, np.uint8)
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightError(
                f"{path}: tensor {name!r} has an unsupported dtype or a malformed entry ({e!r})"
            ) from None
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or start + end > size:
            raise WeightError(
                f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) needs {count * dtype.itemsize} "
                f"bytes at [{begin}, {end}) of the data section, which the file does not hold; "
                "truncated or corrupt"
            )
        yield name, np.array(blob[start + begin : start + end].view(dtype).reshape(shape))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one file, by name."""
    return dict(iter_safetensors(path))
