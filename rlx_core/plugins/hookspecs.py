"""The plugin hooks. Each hook receives a `register` callback (simonw/llm style) and calls
it once per thing it adds. Every hook is documented here; a test fails if one is not."""
from __future__ import annotations

import pluggy

PROJECT = "rlx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def rlx_register_backends(register):
    """Register backends: `register(backend)` with an object implementing
    `rlx_core.backends.Backend` (name, priority, availability(), supported_ops(), compile())."""


@hookspec
def rlx_register_blocks(register):
    """Register flow blocks: `register(name, factory)` where `factory(**kw)` returns a
    FlowStage; `ModelFlow.plugin_named(name, **kw)` resolves it."""


@hookspec
def rlx_register_recipes(register):
    """Register model recipes: `register(recipe)` with an object having `name`,
    `model_types` (HF `model_type` values and GGUF architectures it builds) and
    `build(checkpoint, **options)` returning a runtime model."""


@hookspec
def rlx_register_ops(register):
    """Register custom ops: `register(rlx_core.ir.custom.CustomOp(...))` with a meta
    function and per-backend kernels; graphs use them through the `custom` op."""


@hookspec
def rlx_register_passes(register):
    """Register fusion rules: `register(group, rule)` adds an `rlx_core.ir.rewrite.Rule` to a
    pattern group (a new group is fused on every target that does not list its groups)."""


@hookspec
def rlx_register_weight_formats(register):
    """Register checkpoint formats: `register(name, detect, load)` where `detect(path) -> bool`
    and `load(path, progress) -> rlx_core.weights.Checkpoint`."""
