"""Custom ops registered by plugins (through rlx_register_ops): a meta function and
per-backend kernels, dispatched by the table's single `custom` op."""
from __future__ import annotations

from typing import Callable

import attrs

from .errors import GraphError
from .registry import registry


@attrs.frozen
class CustomOp:
    name: str
    meta: Callable                    # (list[Shape], params dict) -> tuple[Shape, ...]
    kernels: dict = attrs.field(factory=dict)   # backend name -> fn(*arrays, **params) -> array(s)
    doc: str = ""
    # backend name -> fn(outs, *arrays, **params) writing into the preallocated output arrays
    # `outs` (a list); preferred over kernels[backend]: no fresh result to copy into the arena
    out_kernels: dict = attrs.field(factory=dict)


_CUSTOM: dict[str, CustomOp] = {}


def register_custom_op(op: CustomOp) -> None:
    if op.name in _CUSTOM and _CUSTOM[op.name] is not op:
        raise GraphError(f"custom op {op.name!r} is registered twice")
    _CUSTOM[op.name] = op


def custom_op(name: str) -> CustomOp:
    registry()        # plugins load on first use and put their custom ops in this table
    try:
        return _CUSTOM[name]
    except KeyError:
        raise GraphError(f"unknown custom op {name!r}; registered: {sorted(_CUSTOM) or 'none'} "
                         "(a plugin registers custom ops through rlx_register_ops)") from None


def custom_ops() -> dict:
    return dict(_CUSTOM)
