"""Plugins: hook specs, the plugin manager and what plugins registered."""
from .hookspecs import hookimpl, hookspec
from .manager import (plugin_infos, plugin_manager, register_plugin, registry, reset,
                      unregister_plugin)

__all__ = ["hookimpl", "hookspec", "plugin_infos", "plugin_manager", "register_plugin",
           "registry", "reset", "unregister_plugin"]
