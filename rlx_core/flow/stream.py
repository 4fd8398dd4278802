"""Streams: named activations a flow carries beside its current value, so a block can work
on several at once (a DiT's image and text tokens). MAIN / IMG / TXT are conventions; any
string names a stream. Stages here only move values between the current value, inputs
and streams; blocks read and write streams through `ctx.stream` / `ctx.set_stream`."""
from __future__ import annotations

import inspect
from typing import Callable

import attrs

from ..ir.errors import ModelError
from ..ir.graph import Value

MAIN, IMG, TXT = "main", "img", "txt"


@attrs.frozen
class BindInputsToStreams:
    """Each stream starts as a flow input: pairs (stream, input name)."""
    pairs: tuple

    def emit(self, ctx, value):
        for name, inp in self.pairs:
            if inp not in ctx.inputs:
                raise ModelError(f"bind_inputs_to_streams: stream {name!r} names input {inp!r}, which the "
                                 f"flow does not declare; inputs: {sorted(ctx.inputs) or 'none'}")
            ctx.set_stream(name, ctx.inputs[inp], self, f"input {inp}")
        return value


@attrs.frozen
class StoreStream:
    """The current value becomes stream `name` (the value passes on unchanged)."""
    name: str

    def emit(self, ctx, value):
        if not isinstance(value, Value):
            raise ModelError(f"store_stream {self.name!r}: there is no current value to store "
                             "(load a stream or add a block first)")
        ctx.set_stream(self.name, value, self)
        return value


@attrs.frozen
class LoadStream:
    """Stream `name` becomes the current value."""
    name: str

    def emit(self, ctx, value):
        return ctx.stream(self.name, self)


@attrs.frozen
class AccumulateStream:
    """Stream `name` += the current value (or = it, when the stream does not exist yet):
    sums of conditioning embeddings."""
    name: str

    def emit(self, ctx, value):
        if not isinstance(value, Value):
            raise ModelError(f"accumulate_stream {self.name!r}: there is no current value to add")
        ctx.set_stream(self.name, ctx.streams[self.name] + value if self.name in ctx.streams else value, self)
        return value


@attrs.frozen
class JoinStreams:
    """Stream `into` = the streams `names` concatenated along the sequence axis (1)."""
    names: tuple
    into: str = MAIN
    axis: int = 1

    def emit(self, ctx, value):
        parts = [ctx.stream(n, self) for n in self.names]
        joined = ctx.m.concat(parts, self.axis)
        ctx.state.setdefault("stream_parts", {})[self.into] = tuple(
            (n, p.dims[self.axis]) for n, p in zip(self.names, parts))
        ctx.set_stream(self.into, joined, self)
        return joined


@attrs.frozen
class SplitStream:
    """Undo JoinStreams: the streams joined into `name` get their slices back."""
    name: str = MAIN
    axis: int = 1

    def emit(self, ctx, value):
        joined = ctx.stream(self.name, self)
        parts = ctx.state.get("stream_parts", {}).get(self.name)
        if parts is None:
            raise ModelError(f"split_stream {self.name!r}: the stream was not made by join_streams")
        at = 0
        for n, size in parts:
            ctx.set_stream(n, ctx.m.narrow(joined, self.axis, at, size), self)
            at += size
        return value


@attrs.frozen
class DualStream:
    """Tier 2 on two streams: `fn(emit, a, b) -> (a, b)` (or `fn(emit, a, b, ctx)`)
    rewrites streams `a` and `b` with raw IR; `name` labels the stage."""
    name: str
    a: str
    b: str
    fn: Callable

    def emit(self, ctx, value):
        va, vb = ctx.stream(self.a, self), ctx.stream(self.b, self)
        try:
            wants_ctx = len(inspect.signature(self.fn).parameters) >= 4
        except (TypeError, ValueError):
            wants_ctx = False
        out = self.fn(ctx.m, va, vb, ctx) if wants_ctx else self.fn(ctx.m, va, vb)
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(v, Value) for v in out)):
            raise ModelError(f"dual_stream {self.name!r}: fn must return a pair of values (new {self.a!r}, "
                             f"new {self.b!r}), got {type(out).__name__}")
        ctx.set_stream(self.a, out[0], self)
        ctx.set_stream(self.b, out[1], self)
        return value


__all__ = ["MAIN", "IMG", "TXT", "BindInputsToStreams", "StoreStream", "LoadStream", "AccumulateStream",
           "JoinStreams", "SplitStream", "DualStream"]
