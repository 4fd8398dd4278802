"""FlowCtx: what a stage emits against — the HIR builder, the weights, named state."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

import attrs
import numpy as np

from ..ir.dtype import F32, DType
from ..ir.errors import ModelError, WeightError
from ..ir.graph import Builder, Graph, Value
from ..ir.quant import PackedTensor

if TYPE_CHECKING:
    from ..pipeline import Executable
    from ..profile import CompileProfile


@runtime_checkable
class FlowStage(Protocol):
    """One step of a flow: takes the current value, returns the next."""

    def emit(self, ctx: "FlowCtx", value: Any) -> Any: ...


@attrs.frozen
class StageRecord:
    """One stage as a flow emitted it, so `rlx inspect` can list a model's stages by layer:
    the layer (None outside layers), the block's name and checkpoint key, the HIR nodes it
    added (`start` to `end` in the graph's node list) and how deep it sits in other stages."""
    layer: int | None
    name: str
    key: str
    start: int
    end: int
    depth: int = 0


@attrs.frozen
class StreamRecord:
    """One read or write of a stream: which stage, in which layer (None outside layers), and
    for a binding the input it came from."""
    stream: str
    action: str          # read | write
    stage: str
    layer: int | None
    source: str = ""


def stage_label(stage) -> tuple[str, str]:
    """(name, key) of a stage: its class in snake_case and the checkpoint key or prefix it reads."""
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z][a-z])", "_", type(stage).__name__).lower()
    for holder, attr in ((stage, "key"), (stage, "prefix"), (stage, "gamma"), (stage, "name"),
                         (getattr(stage, "fn", None), "__name__")):
        v = getattr(holder, attr, None)
        if isinstance(v, str) and v:
            return name, v
    return name, ""


class FlowCtx:
    """Owns the builder, resolves checkpoint keys to params (checking shapes), and holds
    named state: flow inputs, the residual slot, RoPE tables, streams, layer index."""

    def __init__(self, m: Builder, weights: Mapping, config: dict | None = None, dtype: DType = F32):
        self.m = m
        self.weights = weights
        self.config = dict(config or {})
        self.dtype = dtype
        self.state: dict = {}
        self.inputs: dict = {}
        self.outputs: dict = {}          # extra outputs (KV taps, layer taps)
        self.prefix = ""
        self._index: int | None = None
        self._params: dict = {}
        self.missing: list = []
        self.misshaped: list = []
        self.mistyped: list = []         # integer tensors asked for as (float) weights
        self.stages: list = []           # StageRecord of every stage, in the order they started
        self._depth = 0
        self.streams: dict = {}          # stream name -> its current value (rlx_core.flow.stream)
        self.stream_log: list = []       # StreamRecord of every read and write, for `rlx inspect`

    def emit(self, stage: FlowStage, value: Any) -> Any:
        """Emit `stage` on `value`, recording the HIR nodes it adds. Structural stages
        (sequences, layer scopes) are walked, not recorded; a block that runs sub-stages
        should run them through here too, so they are listed."""
        if getattr(stage, "structural", False):
            return stage.emit(self, value)
        slot, start = len(self.stages), len(self.m.nodes)
        self.stages.append(None)
        self._depth += 1
        try:
            value = stage.emit(self, value)
        finally:
            self._depth -= 1
        self.stages[slot] = StageRecord(self._index, *stage_label(stage), start, len(self.m.nodes),
                                        self._depth)
        return value

    # -- streams
    def stream(self, name: str, stage=None) -> Value:
        """Stream `name`'s current value; a missing one is an error naming the stage asking
        and the streams that exist."""
        who = stage_label(stage)[0] if stage is not None else "a stage"
        if name not in self.streams:
            where = f" in {self.prefix}" if self.prefix else ""
            raise ModelError(f"{who}{where}: no stream {name!r}; streams that exist: "
                             f"{sorted(self.streams) or 'none (bind_inputs_to_streams or store_stream first)'}")
        self.stream_log.append(StreamRecord(name, "read", who, self._index, ""))
        return self.streams[name]

    def set_stream(self, name: str, value: Value, stage=None, source: str = "") -> None:
        if not isinstance(name, str) or not name:
            raise ModelError(f"a stream name is a non-empty string, got {name!r}")
        who = stage_label(stage)[0] if stage is not None else "a stage"
        self.streams[name] = value
        self.stream_log.append(StreamRecord(name, "write", who, self._index, source))

    # -- naming
    def index(self) -> int:
        if self._index is None:
            raise WeightError("ctx.index() used outside repeat_layers/layer")
        return self._index

    def key(self, suffix: str) -> str:
        """A checkpoint key relative to the current layer prefix ('self_attn.q_proj.weight')."""
        return f"{self.prefix}.{suffix}" if self.prefix else suffix

    # -- params
    def has(self, key: str) -> bool:
        return key in self.weights

    def param(self, key: str, shape: tuple | None = None) -> Value:
        """The param for checkpoint tensor `key` (absolute). A missing or mis-shaped tensor is
        recorded, and build() reports all of them in one error."""
        if key in self._params:
            return self._params[key]
        w = self.weights.get(key)
        if w is None:
            self.missing.append(key)
            if shape is None:
                raise WeightError(f"missing tensor {key!r} (and its shape is unknown)")
            got = tuple(shape)
        else:
            got = tuple(np.shape(w))
            if shape is not None and tuple(shape) != got:
                self.misshaped.append(f"{key}: expected {list(shape)}, got {list(got)}")
                got = tuple(shape)
        if w is not None and np.dtype(w.dtype).kind in "iub":     # (a PackedTensor says float32)
            self.mistyped.append(f"{key}: {np.dtype(w.dtype).name}, expected a float dtype "
                                 "(or a packed quantization scheme)")
        scheme = w.scheme.name if isinstance(w, PackedTensor) else ""
        v = self.m.param(key, got, self.dtype, scheme=scheme)
        self._params[key] = v
        return v

    def used_params(self) -> list:
        return list(self._params)

    def cfg(self, *names: str, default: Any = None) -> Any:
        """First config value present among `names`."""
        for n in names:
            if n in self.config and self.config[n] is not None:
                return self.config[n]
        return default


@attrs.frozen(eq=False)
class BuiltModel:
    """A flow's result: the HIR graph, the params it binds (name -> array), the profile the
    flow asked for, the names of extra outputs (taps) and the StageRecords of its stages."""
    graph: Graph
    params: dict
    profile: Any = None
    extra_outputs: tuple = ()
    stages: tuple = ()
    streams: tuple = ()          # StreamRecords, in emit order

    def compile(self, backend: Any = None, profile: CompileProfile | None = None,
                states: dict | None = None, shared: dict | None = None) -> Executable:
        """shared: the dict through which a model's executables hold uploaded and derived
        params once (binding into a private one first would derive the fused weights twice)."""
        from ..pipeline import CompilePipeline

        pipe = CompilePipeline(profile or self.profile, backend)
        return pipe.compile(self.graph, self.params, states, shared)
