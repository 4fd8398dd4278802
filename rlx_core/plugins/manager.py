"""Plugin discovery: pluggy, entry-point group `rlx`, an allow-list (RLX_PLUGINS) and a
block-list (RLX_DISABLE_PLUGINS). A plugin that fails to import is reported, never fatal."""
from __future__ import annotations

import importlib.metadata as md
import os
import warnings

import attrs
import pluggy

from ..ir.errors import PluginError
from . import hookspecs

ENTRY_GROUP = "rlx"
BUILTINS = ("rlx_core.backends.numpy",)


@attrs.define
class PluginInfo:
    name: str
    version: str
    kind: str                 # builtin | entrypoint | registered
    hooks: list
    status: str = "ok"        # ok | broken | disabled
    error: str = ""
    package: str = ""


@attrs.define
class Registry:
    backends: dict = attrs.field(factory=dict)
    blocks: dict = attrs.field(factory=dict)
    recipes: dict = attrs.field(factory=dict)     # model_type -> recipe
    rules: dict = attrs.field(factory=dict)       # fusion group -> [Rule] added by plugins
    weight_formats: dict = attrs.field(factory=dict)
    owner: dict = attrs.field(factory=dict)       # (kind, name) -> plugin name


_pm: pluggy.PluginManager | None = None
_infos: dict = {}
_registry: Registry | None = None


def _names(var: str) -> set | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {x.strip() for x in raw.split(",") if x.strip()}


def _allowed(name: str, dist: str = "") -> bool:
    allow, block = _names("RLX_PLUGINS"), _names("RLX_DISABLE_PLUGINS") or set()
    keys = {name, dist}
    if keys & block:
        return False
    return allow is None or bool(keys & allow)


def plugin_manager() -> pluggy.PluginManager:
    global _pm
    if _pm is not None:
        return _pm
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    _pm = pm
    for mod in BUILTINS:
        module = __import__(mod, fromlist=["_"])
        pm.register(module, name=mod)
        _infos[mod] = PluginInfo(mod, _core_version(), "builtin", _hooks(module))
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist else ""
        version = ep.dist.version if ep.dist else ""
        if not _allowed(ep.name, dist):
            _infos[ep.name] = PluginInfo(ep.name, version, "entrypoint", [], "disabled", package=dist)
            continue
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
            _infos[ep.name] = PluginInfo(ep.name, version, "entrypoint", _hooks(module), package=dist)
        except Exception as e:  # a broken plugin must not break RLX
            msg = f"{type(e).__name__}: {e}"
            _infos[ep.name] = PluginInfo(ep.name, version, "entrypoint", [], "broken", msg, dist)
            warnings.warn(f"rlx plugin {ep.name!r} ({dist}) failed to load: {msg}", stacklevel=2)
    return pm


def _core_version() -> str:
    from .. import __version__

    return __version__


def _entry_points():
    try:
        return list(md.entry_points(group=ENTRY_GROUP))
    except Exception:  # pragma: no cover - broken metadata on sys.path
        return []


def _hooks(module) -> list:
    return sorted(n for n in dir(module) if n.startswith("rlx_register_"))


def registry() -> Registry:
    """Run every hook once and collect what the plugins registered."""
    global _registry
    if _registry is not None:
        return _registry
    pm = plugin_manager()
    reg = Registry()
    _registry = reg

    for impl in pm.hook.rlx_register_backends.get_hookimpls():
        impl.function(lambda b, p=impl.plugin_name: _add(reg.backends, "backend", b.name, b, p))
    for impl in pm.hook.rlx_register_blocks.get_hookimpls():
        impl.function(lambda name, factory, p=impl.plugin_name: _add(reg.blocks, "block", name, factory, p))
    for impl in pm.hook.rlx_register_recipes.get_hookimpls():
        def add_recipe(recipe, p=impl.plugin_name):
            for mt in recipe.model_types:
                _add(reg.recipes, "recipe", mt, recipe, p)
        impl.function(add_recipe)
    from ..ir.custom import register_custom_op

    for impl in pm.hook.rlx_register_ops.get_hookimpls():
        impl.function(register_custom_op)
    for impl in pm.hook.rlx_register_passes.get_hookimpls():
        impl.function(lambda group, rule: reg.rules.setdefault(group, []).append(rule))
    for impl in pm.hook.rlx_register_weight_formats.get_hookimpls():
        impl.function(lambda name, detect, load, p=impl.plugin_name:
                      _add(reg.weight_formats, "weight format", name, (detect, load), p))
    return reg


def _add(table: dict, kind: str, name: str, obj, plugin: str) -> None:
    if name in table and table[name] is not obj:
        other = _registry.owner.get((kind, name), "?") if _registry else "?"
        raise PluginError(f"{kind} {name!r} registered by both {other!r} and {plugin!r}")
    table[name] = obj
    if _registry is not None:
        _registry.owner[(kind, name)] = plugin


def owner_of(kind: str, name: str) -> str:
    return registry().owner.get((kind, name), "")


def ensure_loaded() -> None:
    registry()


def plugin_infos() -> list:
    plugin_manager()
    return list(_infos.values())


def register_plugin(module, name: str | None = None) -> None:
    """Register a plugin object for this process (tests, notebooks); resets the registry."""
    global _registry
    pm = plugin_manager()
    name = name or getattr(module, "__name__", repr(module))
    pm.register(module, name=name)
    _infos[name] = PluginInfo(name, "", "registered", _hooks(module))
    _registry = None


def unregister_plugin(name: str) -> None:
    global _registry
    pm = plugin_manager()
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    _infos.pop(name, None)
    _registry = None


def reset() -> None:
    """Forget everything loaded (tests that change RLX_PLUGINS or sys.path)."""
    global _pm, _registry
    _pm, _registry = None, None
    _infos.clear()
    from ..ir import custom

    custom._CUSTOM.clear()
