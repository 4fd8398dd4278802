"""What plugins registered, as plain data the lower floors read.

The plugin manager (rlx_core.plugins, a floor above) fills a `Registry` and installs
itself as the source with `set_source`; the IR, the passes and the pipeline read
`registry()` without importing the manager. Nothing installed: nothing registered.
"""
from __future__ import annotations

from typing import Callable

import attrs


@attrs.define
class Registry:
    backends: dict = attrs.field(factory=dict)    # name -> Backend
    blocks: dict = attrs.field(factory=dict)      # name -> factory
    recipes: dict = attrs.field(factory=dict)     # model_type -> recipe
    rules: dict = attrs.field(factory=dict)       # fusion group -> [Rule] added by plugins
    weight_formats: dict = attrs.field(factory=dict)   # name -> (detect, load)
    ops: dict = attrs.field(factory=dict)         # custom op name -> CustomOp
    gguf_architectures: dict = attrs.field(factory=dict)  # general.architecture -> GGUFArchitecture
    packaged_models: dict = attrs.field(factory=dict)     # name -> locate() -> path
    commands: dict = attrs.field(factory=dict)    # command name -> click.Command
    owner: dict = attrs.field(factory=dict)       # (kind, name) -> plugin name


_EMPTY = Registry()
_source: Callable[[], Registry] | None = None


def set_source(source: Callable[[], Registry]) -> None:
    """Called once by the plugin manager: `source()` loads plugins on first use."""
    global _source
    _source = source


def registry() -> Registry:
    return _source() if _source is not None else _EMPTY
