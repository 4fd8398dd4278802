"""Element types and promotion. bf16 arrays use ml_dtypes on numpy."""
from __future__ import annotations

import enum
from typing import Any, Union

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    F64 = "f64"
    I8 = "i8"
    I16 = "i16"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"
    U32 = "u32"
    BOOL = "bool"
    C64 = "c64"

    @property
    def np(self) -> np.dtype:
        return _NP[self]

    @property
    def itemsize(self) -> int:
        return self.np.itemsize

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16, DType.F64)

    @property
    def is_int(self) -> bool:
        return self in (DType.I8, DType.I16, DType.I32, DType.I64, DType.U8, DType.U32)

    @property
    def is_complex(self) -> bool:
        return self is DType.C64

    @classmethod
    def parse(cls, value: "DTypeLike") -> "DType":
        """Accept a DType, its short name ('f32'), a numpy dtype or a type like np.float32."""
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            key = value.lower()
            if key in _ALIASES:
                return _ALIASES[key]
        npd = None
        # names are only ours (numpy's 'f8' is f64, not fp8); np.dtype(None) would be f64
        if value is not None and not isinstance(value, str):
            try:
                npd = np.dtype(value)
            except (TypeError, ValueError):
                npd = None
        if npd is not None:
            for dt, candidate in _NP.items():
                if candidate == npd:
                    return dt
        from .errors import DTypeError

        raise DTypeError(f"unknown dtype {value!r}; expected one of {sorted(_ALIASES)}")

    def __repr__(self) -> str:
        return self.value


# what DType.parse accepts: a DType, a name ('f32', 'float32'), a numpy dtype or a scalar type (np.float32)
DTypeLike = Union[DType, str, "np.dtype[Any]", type]

F32, F16, BF16, F64 = DType.F32, DType.F16, DType.BF16, DType.F64
I8, I16, I32, I64, U8, U32, BOOL, C64 = (
    DType.I8, DType.I16, DType.I32, DType.I64, DType.U8, DType.U32, DType.BOOL, DType.C64)

_NP = {
    F32: np.dtype(np.float32), F16: np.dtype(np.float16), BF16: np.dtype(ml_dtypes.bfloat16),
    F64: np.dtype(np.float64), I8: np.dtype(np.int8), I16: np.dtype(np.int16),
    I32: np.dtype(np.int32), I64: np.dtype(np.int64), U8: np.dtype(np.uint8),
    U32: np.dtype(np.uint32), BOOL: np.dtype(np.bool_), C64: np.dtype(np.complex64),
}
_ALIASES = {d.value: d for d in DType} | {
    "float32": F32, "float16": F16, "bfloat16": BF16, "float64": F64, "half": F16,
    "float": F32, "int8": I8, "int16": I16, "int32": I32, "int64": I64, "uint8": U8,
    "uint32": U32, "complex64": C64, "bool_": BOOL,
}

# Rank of each type in the promotion lattice: bool < ints < floats < complex.
_INT_ORDER = [U8, I8, I16, U32, I32, I64]
_FLOAT_ORDER = [F16, BF16, F32, F64]


def promote(a: DType, b: DType) -> DType:
    """Result type of a binary op on `a` and `b` (JAX-like: stay in the widest kind, f16+bf16 -> f32)."""
    if a is b:
        return a
    if C64 in (a, b):
        return C64
    if a.is_float or b.is_float:
        if a.is_float and b.is_float:
            if {a, b} == {F16, BF16}:
                return F32
            return max(a, b, key=_FLOAT_ORDER.index)
        return a if a.is_float else b
    if BOOL in (a, b):
        return b if a is BOOL else a
    if I64 in (a, b) or (U32 in (a, b) and {a, b} & {I8, I16, I32}):
        return I64                   # i64 is the only type here that holds u32 and a signed int
    if U8 in (a, b) and I8 in (a, b):
        return I16                   # i8 cannot hold 128..255
    return max(a, b, key=_INT_ORDER.index)
