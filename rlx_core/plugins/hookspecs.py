"""The plugin hooks: the one place where RLX's extension points are declared.

Every hook receives a `register` callback (simonw/llm style) and calls it once per thing it
adds; the return value is ignored. A plugin implements any subset of the hooks with
functions marked `@rlx_core.plugins.hookimpl`::

    from rlx_core.plugins import hookimpl

    @hookimpl
    def rlx_register_backends(register):
        register(MyBackend())

and is found through an entry point in the group `rlx`::

    [project.entry-points.rlx]
    mybackend = "rlx_backend_mine"

What one plugin registers is committed atomically: if any of its hooks raises, or it
registers a name another plugin already owns, none of its registrations are kept and the
plugin is listed as broken (`rlx plugins`) with the reason.

Every hook is documented here; tests/test_plugins.py fails if one is not.
"""
from __future__ import annotations

from typing import Callable

import pluggy

PROJECT = "rlx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def rlx_register_backends(register: Callable) -> None:
    """Register backends: call `register(backend)` with an object implementing
    `rlx_core.backends.Backend` (`name`, `priority`, `target`, `availability()`,
    `supported_ops()`, `compile(lir, params, states)`).

    A backend that cannot run here (no device, missing driver) should still register and
    say why through `availability() -> (False, reason)`; `rlx plugins` shows the reason and
    the pipeline never falls back to another backend silently. Names are unique across
    plugins."""


@hookspec
def rlx_register_blocks(register: Callable) -> None:
    """Register flow blocks: call `register(name, factory)` where `factory(**kw)` returns a
    FlowStage (an object with `emit(ctx, value) -> value`). `ModelFlow.plugin_named(name,
    **kw)` resolves it. Names are unique across plugins; prefix them with the family
    (`"gemma.attention"`) when they are not generic."""


@hookspec
def rlx_register_recipes(register: Callable) -> None:
    """Register model recipes: call `register(recipe)` with an object having `name`,
    `model_types` (the HF `config.model_type` values and GGUF `general.architecture`
    values it builds) and `build(checkpoint, **options)` returning a runtime model.
    Each model type may be claimed by one plugin only. Optionally `tiny_config()` (a small
    config of its model type) and `tiny_tensors(config, rng)` (random tensors for it): the
    conformance kit (`pytest --rlx-recipe=NAME`, rlx_core.testing) checks the recipe on them."""


@hookspec
def rlx_register_ops(register: Callable) -> None:
    """Register custom ops: call `register(rlx_core.ir.custom.CustomOp(name, meta,
    kernels))` with a meta function `(shapes, params) -> tuple[Shape, ...]` and kernels
    keyed by backend name. Graphs use them through the table's single `custom` op; a
    backend without a kernel for one is a compile error naming the op."""


@hookspec
def rlx_register_passes(register: Callable) -> None:
    """Register fusion rules: call `register(group, rule)` to add an
    `rlx_core.ir.rewrite.Rule` to a pattern group. A rule added to an existing group runs
    wherever that group runs; a new group is fused on every target and can be skipped by
    name through a profile's `[fusion] skip`."""


@hookspec
def rlx_register_weight_formats(register: Callable) -> None:
    """Register checkpoint formats: call `register(name, detect, load)` where
    `detect(path) -> bool` says whether `path` is in this format (cheaply: a suffix, a
    magic number) and `load(path, progress) -> rlx_core.weights.Checkpoint` reads it.
    Names are unique across plugins."""


@hookspec
def rlx_register_gguf_architectures(register: Callable) -> None:
    """Register how a family's checkpoints are laid out in GGUF, both ways: call
    `register(architecture, mapping)` with a GGUF `general.architecture` value and an
    `rlx_core.weights.gguf_arch.GGUFArchitecture` (see its docstring): the HF model type and
    class, tensor names GGUF <-> HF, and, in methods a subclass overrides, value transforms
    (`from_gguf` / `to_gguf`: llama.cpp's row permutations, norms stored as 1 + w), metadata ->
    config for loading (`head_dim`, `config`), config -> metadata for `rlx quantize`
    (`write_metadata`) and the tokenizer quirk of the family's GGUF files
    (`sentencepiece_tokenizer`, `sentencepiece_special_tokens`). The core keeps only the
    container, the quantization schemes and the generic llama.cpp keys; a GGUF file of an
    architecture nobody registered is a WeightError naming it, the registered ones and the
    package that provides it where one is known. Each architecture is owned by one plugin;
    `rlx quantize` writes a model under the architecture whose mapping has its model_type."""


@hookspec
def rlx_register_packaged_models(register: Callable) -> None:
    """Register checkpoints shipped inside Python packages: call `register(name, locate)`
    where `locate() -> str` returns the checkpoint's path (an HF folder or a GGUF file) and
    raises `rlx_core.ir.errors.WeightError` naming the package to install when it is absent.
    `rlx_core.load(name)` and `rlx generate NAME` then find it; an unknown name lists the
    registered ones. Names are unique across plugins."""


@hookspec
def rlx_register_commands(register: Callable) -> None:
    """Register command-line commands: call `register(command)` with a `click.Command`; it
    becomes `rlx <command.name>`. A name that a core command or another plugin's command
    already has makes the plugin broken (`rlx plugins` says why); the others keep working."""
