"""Plugin discovery and the registry of what plugins registered.

pluggy, project `rlx`, entry-point group `rlx`. Built-ins (the NumPy backend) are plugins
too and register through the same hooks; they always load.

Environment (read when plugins are first loaded, and again after `reset()`):

* `RLX_PLUGINS` — an allow-list: comma-separated entry-point names or distribution names.
  When set, only those third-party plugins load; set but empty loads none.
* `RLX_DISABLE_PLUGINS` — a block-list of the same form; it wins over the allow-list.

Names match case-insensitively with `-`, `_` and `.` equivalent (`rlx-blocks-gemma` ==
`rlx_blocks_gemma`). A plugin that is filtered out is never imported and is listed with
status `disabled` and the reason.

Failure is never fatal: a plugin that raises on import, implements an unknown hook, or
whose hooks raise or register a name another plugin owns is reported once with an
`RlxPluginWarning` and listed with status `broken` and the error; what it registered is
dropped as a whole, everything else keeps working.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import os
import re
import threading
import warnings
import weakref
from typing import Callable

import attrs
import pluggy

from ..ir import custom
from ..ir.errors import PluginError
from ..ir.registry import Registry, set_source
from ..version import core_version
from . import hookspecs

ENTRY_GROUP = "rlx"
BUILTINS = ("rlx_core.backends.numpy", "rlx_core.flow.blocks")
ALLOW_ENV = "RLX_PLUGINS"
BLOCK_ENV = "RLX_DISABLE_PLUGINS"
HOOKS = tuple(n for n in dir(hookspecs) if n.startswith("rlx_register_"))


class RlxPluginWarning(UserWarning):
    """A plugin failed to load or to register; RLX goes on without it."""


@attrs.define
class PluginInfo:
    name: str                 # entry-point name (or module name for built-ins)
    version: str
    kind: str                 # builtin | entrypoint | registered
    hooks: list
    status: str = "ok"        # ok | broken | disabled
    error: str = ""           # why broken / disabled
    package: str = ""         # distribution that provides it

    def to_dict(self) -> dict:
        return attrs.asdict(self)


_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_infos: dict = {}
_registry: Registry | None = None
_plugin_ops: set = set()      # custom op names this manager put in rlx_core.ir.custom
_calls: dict = {}             # plugin name -> what its hooks registered (see _collect)


# ------------------------------------------------------------------------ filtering
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def _names(var: str) -> set | None:
    """The normalized names in an env var; None when the variable is unset."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {_norm(x) for x in raw.split(",") if x.strip()}


def filter_reason(name: str, dist: str = "") -> str:
    """Why the plugin `name` (from distribution `dist`) must not load, or "" if it may."""
    keys = {_norm(name)} | ({_norm(dist)} if dist else set())
    block = _names(BLOCK_ENV) or set()
    if keys & block:
        return f"blocked by {BLOCK_ENV}"
    allow = _names(ALLOW_ENV)
    if allow is not None and not keys & allow:
        return f"not in the {ALLOW_ENV} allow-list"
    return ""


def _allowed(name: str, dist: str = "") -> bool:
    return not filter_reason(name, dist)


# ------------------------------------------------------------------------ loading
def _error_text(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _broken(name: str, msg: str, where: str = "failed to load") -> None:
    info = _infos.get(name)
    if info is not None:
        info.status, info.error = "broken", msg
    pkg = f" ({info.package})" if info is not None and info.package else ""
    warnings.warn(f"rlx plugin {name!r}{pkg} {where}: {msg}", RlxPluginWarning, stacklevel=3)


def _check_hooks(pm: pluggy.PluginManager, plugin) -> list:
    """The hooks `plugin` implements; PluginError on a hook that is not in hookspecs.py
    or a hook-named function that lacks the @hookimpl marker (both silently do nothing)."""
    names = sorted(hc.name for hc in pm.get_hookcallers(plugin) or ())
    unknown = [n for n in names if n not in HOOKS]
    if unknown:
        raise PluginError(f"implements unknown hook(s) {unknown}; known hooks: {list(HOOKS)}")
    unmarked = [n for n in HOOKS if n not in names and callable(getattr(plugin, n, None))
                and not hasattr(getattr(plugin, n), hookspecs.PROJECT + "_spec")]
    if unmarked:
        raise PluginError(f"defines {unmarked} without @hookimpl "
                          "(from rlx_core.plugins import hookimpl)")
    return names


def _register(pm: pluggy.PluginManager, plugin, name: str) -> list:
    try:
        pm.register(plugin, name=name)
    except (ValueError, pluggy.PluginValidationError) as e:
        raise PluginError(_error_text(e)) from None
    try:
        return _check_hooks(pm, plugin)
    except PluginError:
        pm.unregister(plugin)
        raise


def _entry_points() -> list:
    try:
        eps = md.entry_points(group=ENTRY_GROUP)
    except Exception:  # pragma: no cover - broken metadata somewhere on sys.path
        return []
    return sorted(eps, key=lambda ep: (ep.name, ep.value))


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading built-ins and entry points on first use."""
    global _pm
    with _lock:
        if _pm is not None:
            return _pm
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        _pm = pm
        for mod in BUILTINS:
            _infos[mod] = PluginInfo(mod, core_version(), "builtin", [], package="rlx-core")
            try:
                _infos[mod].hooks = _register(pm, importlib.import_module(mod), mod)
            except Exception as e:  # a broken built-in is a bug, but still not fatal
                _broken(mod, _error_text(e))
        for ep in _entry_points():
            _load_entry_point(pm, ep)
        return pm


def _load_entry_point(pm: pluggy.PluginManager, ep) -> None:
    dist = ep.dist.name if ep.dist is not None else ""
    version = ep.dist.version if ep.dist is not None else ""
    if ep.name in _infos:
        other = _infos[ep.name]
        if other.package == dist and other.kind == "entrypoint":
            return                               # the same distribution seen twice on sys.path
        key = f"{ep.name} ({dist})"
        _infos[key] = PluginInfo(key, version, "entrypoint", [], package=dist)
        _broken(key, f"PluginError: entry point name {ep.name!r} is already used by "
                     f"{other.package or other.kind!r}")
        return
    info = PluginInfo(ep.name, version, "entrypoint", [], package=dist)
    _infos[ep.name] = info
    reason = filter_reason(ep.name, dist)
    if reason:
        info.status, info.error = "disabled", reason
        return
    try:
        module = ep.load()
    except (Exception, SystemExit) as e:  # a broken plugin must not break RLX
        _broken(ep.name, _error_text(e))
        return
    try:
        info.hooks = _register(pm, module, ep.name)
    except PluginError as e:
        _broken(ep.name, _error_text(e))


# ------------------------------------------------------------------------ registry
_REGISTER_ARGS = {
    "rlx_register_backends": ("backend",), "rlx_register_blocks": ("name", "factory"),
    "rlx_register_recipes": ("recipe",), "rlx_register_ops": ("op",),
    "rlx_register_passes": ("group", "rule"),
    "rlx_register_weight_formats": ("name", "detect", "load"),
    "rlx_register_gguf_architectures": ("architecture", "mapping"),
    "rlx_register_packaged_models": ("name", "locate"),
    "rlx_register_commands": ("command",),
}
RESERVED_COMMANDS: set = set()   # the core CLI's own command names (filled by rlx_core.cli)


def reserve_commands(names) -> None:
    """Mark `names` as the core CLI's own commands (rlx_core.cli does, on import): a plugin
    registering one is broken. A registry built before with such a plugin command is dropped,
    so the next build lists that plugin broken too."""
    global _registry
    with _lock:
        RESERVED_COMMANDS.update(names)
        if _registry is not None and RESERVED_COMMANDS & set(_registry.commands):
            _registry = None


def _recorder(hook: str, calls: list) -> Callable:
    """The `register` callback handed to `hook`: records each call (positional or by the
    parameter names the hookspec documents) for validation in `_commit`."""
    names = _REGISTER_ARGS[hook]

    def register(*args, **kw):
        if kw:
            unknown = sorted(set(kw) - set(names[len(args):]))
            if unknown:
                raise TypeError(f"register() got unexpected argument(s) {unknown}; "
                                f"expected register({', '.join(names)})")
            args = args + tuple(kw[n] for n in names[len(args):] if n in kw)
        calls.append((hook,) + args)

    register.__doc__ = f"register({', '.join(names)})"
    return register


def _collect(pm: pluggy.PluginManager) -> dict:
    """plugin name -> [(hook, args...)] in registration order (a str when one of its hooks
    raised). Each plugin's hooks run once per process (until `reset()`): a rebuild after
    `register_plugin` reuses what the others registered, so backend objects stay the same."""
    order = [name for name, _ in pm.list_name_plugin()]
    fresh: dict = {name: [] for name in order if name not in _calls}
    failed: dict = {}
    for hook in HOOKS:
        for impl in getattr(pm.hook, hook).get_hookimpls():
            name = impl.plugin_name
            if name not in fresh or name in failed:
                continue
            try:
                impl.function(_recorder(hook, fresh[name]))
            except Exception as e:
                failed[name] = f"{hook} raised {_error_text(e)}"
    for name, calls in fresh.items():
        _calls[name] = failed.get(name, calls)
    return {name: _calls[name] for name in order}


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise PluginError(msg)


def _entries(hook: str, args: tuple) -> list:
    """Validate one `register(...)` call; returns [(kind, key, table, value)]."""
    from ..ir.custom import CustomOp

    where = f"{hook}: register{args!r}"[:200]
    if hook == "rlx_register_backends":
        _need(len(args) == 1, f"{where}: expected register(backend)")
        b = args[0]
        _need(isinstance(getattr(b, "name", None), str) and b.name and
              all(callable(getattr(b, m, None)) for m in ("availability", "supported_ops", "compile")),
              f"{where}: a backend needs a name and availability(), supported_ops(), compile()")
        _covers(b, where)
        return [("backend", b.name, "backends", b)]
    if hook == "rlx_register_blocks":
        _need(len(args) == 2 and isinstance(args[0], str) and args[0] and callable(args[1]),
              f"{where}: expected register(name: str, factory: callable)")
        return [("block", args[0], "blocks", args[1])]
    if hook == "rlx_register_recipes":
        _need(len(args) == 1, f"{where}: expected register(recipe)")
        r = args[0]
        types = getattr(r, "model_types", None)
        _need(isinstance(types, (list, tuple, set, frozenset)) and types and
              all(isinstance(t, str) for t in types) and callable(getattr(r, "build", None)),
              f"{where}: a recipe needs model_types (a list of str) and build()")
        return [("recipe", t, "recipes", r) for t in types]
    if hook == "rlx_register_ops":
        _need(len(args) == 1 and isinstance(args[0], CustomOp),
              f"{where}: expected register(rlx_core.ir.custom.CustomOp(...))")
        return [("op", args[0].name, "ops", args[0])]
    if hook == "rlx_register_passes":
        _need(len(args) == 2 and isinstance(args[0], str) and args[0] and
              hasattr(args[1], "pattern"), f"{where}: expected register(group: str, rule: Rule)")
        return [("rule", f"{args[0]}:{getattr(args[1], 'name', '?')}", "rules", args)]
    if hook == "rlx_register_weight_formats":
        _need(len(args) == 3 and isinstance(args[0], str) and args[0] and callable(args[1])
              and callable(args[2]), f"{where}: expected register(name: str, detect, load)")
        return [("weight format", args[0], "weight_formats", (args[1], args[2]))]
    if hook == "rlx_register_gguf_architectures":
        _need(len(args) == 2 and isinstance(args[0], str) and args[0] and args[1] is not None,
              f"{where}: expected register(architecture: str, mapping: GGUFArchitecture)")
        return [("gguf architecture", args[0], "gguf_architectures", args[1])]
    if hook == "rlx_register_packaged_models":
        _need(len(args) == 2 and isinstance(args[0], str) and args[0] and callable(args[1]),
              f"{where}: expected register(name: str, locate: callable)")
        return [("packaged model", args[0], "packaged_models", args[1])]
    if hook == "rlx_register_commands":
        name = getattr(args[0], "name", None) if len(args) == 1 else None
        _need(isinstance(name, str) and bool(name) and callable(getattr(args[0], "main", None)),
              f"{where}: expected register(command: click.Command)")
        _need(name not in RESERVED_COMMANDS, f"{where}: command {name!r} is a core rlx command")
        return [("command", name, "commands", args[0])]
    raise PluginError(f"unknown hook {hook!r}")  # pragma: no cover - HOOKS is the spec list


_covered: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # backend -> ops it passed with


def _covers(backend, where: str) -> None:
    """A backend runs every op of the table, itself or through composites, and its expression
    renderers write every formula (composites.check_coverage): checked here, when it registers,
    so a missing primitive is an error now and not at a model's first run. Once per backend
    object and set of ops (the registry is rebuilt whenever a plugin comes or goes)."""
    from ..ir.composites import check_coverage

    try:
        ops = frozenset(backend.supported_ops())
        if _covered.get(backend) == ops:
            return
        check_coverage(backend)
    except Exception as e:                   # a backend's own method may raise anything
        raise PluginError(f"{where}: {_error_text(e)}") from e
    try:
        _covered[backend] = ops
    except TypeError:                        # (an object without weak references: checked each time)
        pass


def _commit(reg: Registry, plugin: str, calls: list) -> None:
    """Add one plugin's registrations, all or nothing."""
    entries = [e for hook, *args in calls for e in _entries(hook, tuple(args))]
    seen: set = set()
    for kind, key, _, _ in entries:
        if kind == "rule":
            continue
        if (kind, key) in seen:
            raise PluginError(f"{kind} {key!r} is registered twice by {plugin!r}")
        other = reg.owner.get((kind, key))
        if kind == "op" and other is None and key in custom._CUSTOM and key not in _plugin_ops:
            other = "rlx_core.ir.custom.register_custom_op"
        if other is not None:
            raise PluginError(f"{kind} {key!r} is registered by both {other!r} and {plugin!r}")
        seen.add((kind, key))
    for kind, key, table, value in entries:
        if kind == "rule":
            group, rule = value
            reg.rules.setdefault(group, []).append(rule)
        else:
            getattr(reg, table)[key] = value
        reg.owner[(kind, key)] = plugin
    for kind, key, _, value in entries:
        if kind == "op":
            custom._CUSTOM[key] = value
            _plugin_ops.add(key)


def registry() -> Registry:
    """Run every hook once and collect what the plugins registered (cached until a plugin
    is registered or unregistered, or `reset()`)."""
    global _registry
    with _lock:
        if _registry is not None:
            return _registry
        pm = plugin_manager()
        for name in _plugin_ops:                 # rebuilt below from the hooks
            custom._CUSTOM.pop(name, None)
        _plugin_ops.clear()
        reg = Registry()
        for name, calls in _collect(pm).items():
            try:
                if isinstance(calls, str):
                    raise PluginError(calls)
                _commit(reg, name, calls)
            except PluginError as e:
                plugin = pm.get_plugin(name)
                if plugin is not None:
                    pm.unregister(plugin)
                _calls.pop(name, None)
                _broken(name, str(e), "failed to register")
        _registry = reg
        return reg


def owner_of(kind: str, name: str) -> str:
    """The plugin that registered `name` of `kind` (backend, block, recipe, op, weight
    format, rule), or ""."""
    return registry().owner.get((kind, name), "")


def ensure_loaded() -> None:
    registry()


set_source(registry)


def plugin_infos() -> list:
    """Every plugin seen: built-ins, entry points (loaded, disabled or broken) and plugins
    registered in-process, in discovery order."""
    with _lock:
        registry()
        return list(_infos.values())


# ------------------------------------------------------------------------ in-process
def register_plugin(plugin, name: str | None = None) -> None:
    """Register a plugin object (a module, a class or an instance with @hookimpl methods)
    for this process — tests, notebooks. Raises PluginError if it is invalid or conflicts
    with a plugin already registered; then nothing of it stays registered."""
    global _registry
    with _lock:
        pm = plugin_manager()
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        if name in _infos or pm.has_plugin(name):
            raise PluginError(f"a plugin named {name!r} is already registered")
        hooks = _register(pm, plugin, name)
        _infos[name] = PluginInfo(name, str(getattr(plugin, "__version__", "")), "registered", hooks)
        _registry = None
        registry()
        if _infos[name].status == "broken":
            err = _infos.pop(name).error
            raise PluginError(f"plugin {name!r}: {err}")


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with `register_plugin` (or any plugin, by name)."""
    global _registry
    with _lock:
        pm = plugin_manager()
        plugin = pm.get_plugin(name)
        if plugin is not None:
            pm.unregister(plugin)
        _infos.pop(name, None)
        _calls.pop(name, None)
        _registry = None


@contextlib.contextmanager
def temporary_plugin(plugin, name: str | None = None):
    """`with temporary_plugin(obj): ...` registers `obj` for the duration of the block."""
    name = name or getattr(plugin, "__name__", None) or repr(plugin)
    register_plugin(plugin, name)
    try:
        yield plugin
    finally:
        unregister_plugin(name)


def reset() -> None:
    """Forget everything loaded; the next use rediscovers plugins from the current sys.path
    and environment (tests that change RLX_PLUGINS or sys.path). Modules already imported
    stay in sys.modules."""
    global _pm, _registry
    with _lock:
        _pm, _registry = None, None
        _infos.clear()
        _calls.clear()
        _plugin_ops.clear()
        from ..ir import custom

        custom._CUSTOM.clear()
        importlib.invalidate_caches()


__all__ = ["ENTRY_GROUP", "HOOKS", "PluginInfo", "Registry", "RlxPluginWarning", "ensure_loaded",
           "filter_reason", "owner_of", "plugin_infos", "plugin_manager", "register_plugin",
           "registry", "reserve_commands", "reset", "temporary_plugin", "unregister_plugin"]
