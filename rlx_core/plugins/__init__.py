"""Plugins: hook specs, the plugin manager and what plugins registered.

A plugin is any module (or object) with functions marked `@hookimpl` for the hooks in
`hookspecs.py`, found through an entry point in the group `rlx` or registered in-process
with `register_plugin` / `temporary_plugin`. `registry()` holds what they registered.
"""
from .hookspecs import hookimpl, hookspec
from .manager import (HOOKS, PluginInfo, Registry, RlxPluginWarning, ensure_loaded, filter_reason,
                      owner_of, plugin_infos, plugin_manager, register_plugin, registry, reset,
                      temporary_plugin, unregister_plugin)
from .providers import provider_hint, provider_of

__all__ = ["HOOKS", "PluginInfo", "Registry", "RlxPluginWarning", "ensure_loaded", "filter_reason",
           "hookimpl", "hookspec", "owner_of", "plugin_infos", "plugin_manager", "provider_hint",
           "provider_of", "register_plugin", "registry", "reset", "temporary_plugin", "unregister_plugin"]
