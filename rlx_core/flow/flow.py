"""ModelFlow: a fluent chain of stages that builds an HIR graph from blocks.

    ModelFlow("decoder").input("ids", (1, "seq"), I64).token_embed()
        .repeat_layers(n, lambda f, i: f.rms_norm(...).self_attn_prefill(spec)...)
        .final_norm(eps).lm_head(vocab, hidden, tied=True).build(weights)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import attrs

from ..ir.dtype import F32, I64, DType
from ..ir.errors import ModelError, WeightError
from ..ir.graph import Builder, Value
from . import blocks as B
from . import stream as S
from .ctx import BuiltModel, FlowCtx, FlowStage

if TYPE_CHECKING:
    import numpy as np

    from ..profile import CompileProfile


# Structural stages (`structural = True`) only arrange others: FlowCtx.emit walks them
# without a record of their own, so the stages listed by layer are the blocks.
@attrs.frozen
class Sequence:
    stages: tuple
    structural = True

    def emit(self, ctx: FlowCtx, value: Any) -> Any:
        for s in self.stages:
            value = ctx.emit(s, value)
        return value


@attrs.frozen
class When:
    cond: Any               # bool, or fn(ctx) -> bool
    then: Any               # a flow or stage
    structural = True

    def emit(self, ctx: FlowCtx, value: Any) -> Any:
        ok = self.cond(ctx) if callable(self.cond) else bool(self.cond)
        return ctx.emit(_as_stage(self.then), value) if ok else value


@attrs.frozen
class LayerScope:
    """Runs `body` with the layer prefix and index set (one transformer layer)."""
    index: int
    prefix: str
    body: Any
    structural = True

    def emit(self, ctx: FlowCtx, value: Any) -> Any:
        saved = (ctx.prefix, ctx._index)
        ctx.prefix, ctx._index = self.prefix, self.index
        try:
            return ctx.emit(_as_stage(self.body), value)
        finally:
            ctx.prefix, ctx._index = saved


@attrs.frozen
class Custom:
    """Tier 2: `fn(emit, value, ctx)` writes raw IR with the Emit handle."""
    fn: Callable

    def emit(self, ctx: FlowCtx, value: Any) -> Any:
        return self.fn(ctx.m, value, ctx)


@attrs.frozen
class Lazy:
    """A stage produced at emit time by `fn(ctx)` (recipes' `.layer(lambda ctx: ...)`)."""
    fn: Callable
    structural = True

    def emit(self, ctx: FlowCtx, value: Any) -> Any:
        return ctx.emit(_as_stage(self.fn(ctx)), value)


def _as_stage(x: FlowStage | ModelFlow) -> FlowStage:
    if isinstance(x, ModelFlow):
        return Sequence(tuple(x.stages))
    if isinstance(x, FlowStage):
        return x
    raise ModelError(f"expected a flow stage or a ModelFlow, got {type(x).__name__}")


class ModelFlow:
    """Fluent builder: every method appends a stage and returns the flow."""

    def __init__(self, name: str = "model", layer_prefix: str = "model.layers"):
        self.name = name
        self.layer_prefix = layer_prefix
        self.stages: list = []
        self._profile: CompileProfile | None = None

    def _add(self, stage: FlowStage) -> "ModelFlow":
        self.stages.append(stage)
        return self

    def sub(self) -> "ModelFlow":
        """An empty flow sharing this one's naming, for layer bodies."""
        return ModelFlow(self.name, self.layer_prefix)

    # -- profile
    def profile(self, p: CompileProfile | str) -> "ModelFlow":
        from ..profile import CompileProfile

        self._profile = CompileProfile.preset(p) if isinstance(p, str) else p
        return self

    def profile_prefill(self, family: str | None = None) -> "ModelFlow":
        """The preset `<family>_prefill`; without a family, upstream's first (llama32_prefill)."""
        return self.profile(f"{family}_prefill" if family else "llama32_prefill")

    def profile_decode(self, family: str | None = None) -> "ModelFlow":
        """The preset `<family>_decode`; without a family, upstream's first (llama32_decode)."""
        return self.profile(f"{family}_decode" if family else "llama32_decode")

    # -- inputs and state
    def input(self, name: str, shape: tuple, dtype: DType | str = I64) -> "ModelFlow":
        return self._add(B.Input(name, tuple(shape), DType.parse(dtype)))

    def rope_tables(self, tables: tuple[np.ndarray, np.ndarray]) -> "ModelFlow":
        """Use these (cos, sin) [max_pos, rot/2] tables for RoPE instead of computing them."""
        return self._add(B.SetState("rope_tables", tables))

    def zero_beta(self, n: int) -> "ModelFlow":
        """A zero bias of size n for layer norms whose checkpoint has no beta."""
        return self._add(B.ZeroBeta(n))

    # -- blocks
    def token_embed(self, key: str = "model.embed_tokens.weight", scale: float | None = None) -> "ModelFlow":
        return self._add(B.TokenEmbed(key, scale))

    def rms_norm(self, key: str, eps: float = 1e-6, offset: float = 0.0) -> "ModelFlow":
        return self._add(B.RmsNorm(key, eps, offset))

    def layer_norm(self, gamma: str, beta: str | None = None, eps: float = 1e-12) -> "ModelFlow":
        return self._add(B.LayerNorm(gamma, beta, eps))

    def linear(self, key: str, transpose: bool = True, bias: str | None = None) -> "ModelFlow":
        return self._add(B.Linear(key, transpose, bias))

    def residual_save(self, slot: str = "residual") -> "ModelFlow":
        return self._add(B.ResidualSave(slot))

    def residual_add(self, slot: str = "residual") -> "ModelFlow":
        return self._add(B.ResidualAdd(slot))

    def swiglu_hf_mlp(self, prefix: str = "mlp") -> "ModelFlow":
        return self._add(B.SwigluMlp(prefix))

    def gated_hf_mlp(self, prefix: str = "mlp", act: str = "silu") -> "ModelFlow":
        """The gated MLP with IR activation `act` (silu: the swiglu block)."""
        return self._add(B.SwigluMlp(prefix) if act == "silu" else B.GatedMlp(prefix, act))

    def self_attn_prefill(self, spec: "B.AttnSpec") -> "ModelFlow":
        return self._add(B.SelfAttention(attrs.evolve(spec, mode="prefill")))

    def self_attn_decode(self, spec: "B.AttnSpec") -> "ModelFlow":
        return self._add(B.SelfAttention(attrs.evolve(spec, mode="decode")))

    def final_norm(self, eps: float = 1e-6, key: str = "model.norm.weight", offset: float = 0.0) -> "ModelFlow":
        return self._add(B.RmsNorm(key, eps, offset, absolute=True))

    def gather_last_token(self) -> "ModelFlow":
        return self._add(B.GatherLastToken())

    def lm_head(self, vocab: int, hidden: int, tied: bool = False, key: str | None = None,
                softcap: float = 0.0) -> "ModelFlow":
        return self._add(B.LmHead(vocab, hidden, tied, key, softcap))

    def cross_entropy_loss(self, labels: str = "labels", name: str = "loss") -> "ModelFlow":
        """Output `name`: the mean cross-entropy of the current logits [..., vocab] against
        integer input `labels` (negative labels ignored); the flow's value stays the logits."""
        return self._add(B.CrossEntropyLoss(labels, name))

    def output(self, name: str) -> "ModelFlow":
        """Also expose the current value as graph output `name` (a tap)."""
        return self._add(B.Tap(name))

    # -- structure
    def sequence(self, *stages: FlowStage | ModelFlow) -> "ModelFlow":
        return self._add(Sequence(tuple(_as_stage(s) for s in stages)))

    def when(self, cond: bool | Callable[[FlowCtx], bool], then: FlowStage | ModelFlow) -> "ModelFlow":
        return self._add(When(cond, then))

    def layer(self, name_or_index: str | int, body: Callable[["ModelFlow"], "ModelFlow"],
              prefix: str | None = None) -> "ModelFlow":
        """One layer: `.layer("L0", lambda s: s.rms_norm(...)...)` or `.layer(3, ...)`; keys
        inside are relative to `prefix`, by default `<layer_prefix>.<index>` (a model with
        two kinds of layers numbers them on, each kind under its own prefix)."""
        index = int(str(name_or_index).lstrip("Ll")) if not isinstance(name_or_index, int) else name_or_index
        sub = body(self.sub())
        return self._add(LayerScope(index, prefix or f"{self.layer_prefix}.{index}", _as_stage(sub)))

    def repeat_layers(self, n: int, body: Callable) -> "ModelFlow":
        """`body(flow, i)` (or `body(flow)`) builds layer i; runs n times with prefixes."""
        for i in range(n):
            sub = self.sub()
            try:
                out = body(sub, i)
            except TypeError:
                out = body(sub)
            self._add(LayerScope(i, f"{self.layer_prefix}.{i}", _as_stage(out if out is not None else sub)))
        return self

    # -- streams (rlx_core.flow.stream)
    def bind_inputs_to_streams(self, mapping: dict) -> "ModelFlow":
        """Start streams from inputs: `{"img": "hidden_states", "txt": "encoder_hidden_states"}`."""
        return self._add(S.BindInputsToStreams(tuple(dict(mapping).items())))

    def store_stream(self, name: str) -> "ModelFlow":
        return self._add(S.StoreStream(name))

    def load_stream(self, name: str) -> "ModelFlow":
        return self._add(S.LoadStream(name))

    def accumulate_stream(self, name: str) -> "ModelFlow":
        return self._add(S.AccumulateStream(name))

    def join_streams(self, names: Iterable[str], into: str = S.MAIN) -> "ModelFlow":
        """Stream `into` = the streams concatenated along the sequence axis."""
        return self._add(S.JoinStreams(tuple(names), into))

    def split_stream(self, name: str = S.MAIN) -> "ModelFlow":
        """The streams joined into `name` get their slices of it back."""
        return self._add(S.SplitStream(name))

    def dual_stream(self, name: str, a: str, b: str, fn: Callable) -> "ModelFlow":
        """Tier 2 on two streams: `fn(emit, a, b) -> (a, b)` with the Emit handle."""
        return self._add(S.DualStream(name, a, b, fn))

    def custom(self, fn: Callable) -> "ModelFlow":
        """Tier 2 escape: `fn(emit, value, ctx) -> value` writes raw IR."""
        return self._add(Custom(fn))

    def raw_stage(self, stage: FlowStage) -> "ModelFlow":
        return self._add(_as_stage(stage))

    def plugin_named(self, name: str, **kw: Any) -> "ModelFlow":
        """A block registered by any installed plugin through rlx_register_blocks."""
        from ..plugins.manager import registry

        blocks = registry().blocks
        if name not in blocks:
            raise ModelError(f"no block named {name!r}; registered blocks: {sorted(blocks)}")
        return self._add(_as_stage(blocks[name](**kw)))

    # -- build
    def build(self, weights: Mapping[str, Any], config: dict | None = None, dtype: DType = F32,
              check_unused: bool = True, ignore_unused: tuple = ()) -> BuiltModel:
        """Emit the graph; then one error lists every missing, unexpected, mis-shaped and
        mis-typed (integer) tensor. `weights` maps checkpoint keys to arrays."""
        m = Builder(self.name)
        ctx = FlowCtx(m, weights, config, dtype)
        value = None
        for s in self.stages:
            value = ctx.emit(s, value)
        if not isinstance(value, Value):
            raise ModelError(f"flow {self.name!r} ended without a value (add a head or an output)")
        unused = []
        if check_unused:
            used = set(ctx.used_params())
            unused = sorted(k for k in weights if k not in used and not any(
                k.endswith(s) or k == s for s in ignore_unused))
        if ctx.missing or ctx.misshaped or ctx.mistyped or unused:
            parts = []
            if ctx.missing:
                parts.append(f"missing {len(ctx.missing)}: {ctx.missing}")
            if unused:
                parts.append(f"unexpected {len(unused)}: {unused}")
            if ctx.misshaped:
                parts.append(f"mis-shaped {len(ctx.misshaped)}: {ctx.misshaped}")
            if ctx.mistyped:
                parts.append(f"mis-typed {len(ctx.mistyped)}: {ctx.mistyped}")
            raise WeightError(f"flow {self.name!r}: checkpoint does not fit the model — " + "; ".join(parts))
        m.output("logits" if "logits" not in ctx.outputs else "out", value)
        for name, v in ctx.outputs.items():
            m.output(name, v)
        params = {k: weights[k] for k in ctx.used_params()}
        return BuiltModel(m.build(), params, self._profile, tuple(ctx.outputs), tuple(ctx.stages),
                          tuple(ctx.stream_log))
