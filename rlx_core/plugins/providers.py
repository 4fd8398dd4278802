"""Which package provides a model type, GGUF architecture or packaged model name, for the
errors that say what to install (or unblock) when no loaded plugin registers it.

What loaded plugins registered answers first; `providers.toml` beside this file (data, not
code) answers for plugins that are absent, blocked or broken.
"""
from __future__ import annotations

import functools
import os

from ..ir.errors import PluginError
from .manager import _norm, plugin_infos, registry

TABLE = os.path.join(os.path.dirname(__file__), "providers.toml")
_KINDS = ("recipe", "gguf architecture", "packaged model")


@functools.lru_cache(maxsize=1)
def known_providers() -> dict:
    """providers.toml's table: name -> distribution."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(TABLE, "rb") as f:
            table = tomllib.load(f).get("providers")
    except (OSError, ValueError) as e:
        raise PluginError(f"{TABLE}: cannot read the table of providers: {e}") from None
    if not isinstance(table, dict) or not all(isinstance(v, str) and v for v in table.values()):
        raise PluginError(f"{TABLE}: expected a [providers] table of name = \"distribution\"")
    return dict(table)


def _registered_by(name: str) -> str:
    """The distribution of the loaded plugin that registered `name`, or ""."""
    owners = registry().owner
    plugin = next((owners[(k, name)] for k in _KINDS if (k, name) in owners), "")
    info = next((i for i in plugin_infos() if i.name == plugin), None)
    return info.package if info is not None else ""


def provider_of(name: str) -> str:
    """The distribution that provides `name` (a model type, a GGUF architecture or a
    packaged model's name), or "" when none is known."""
    return _registered_by(name) or known_providers().get(name, "")


def provider_hint(name: str) -> str:
    """A clause for an error about `name` that no loaded plugin provides: which package
    provides it and why it is not loaded (absent, blocked, broken); "" when none is known."""
    dist = provider_of(name)
    if not dist:
        return ""
    info = next((i for i in plugin_infos() if i.package and _norm(i.package) == _norm(dist)), None)
    if info is None:
        return (f"{dist} provides it: pip install {dist} (in a checkout of RLX: "
                f"pip install ./plugins/{dist.replace('-', '_')})")
    if info.status == "disabled":
        return f"{dist} provides it but is not loaded: {info.error}"
    if info.status == "broken":
        return f"{dist} provides it but is broken: {info.error}"
    return f"{dist} {info.version} is loaded but does not register it; upgrade it"


__all__ = ["TABLE", "known_providers", "provider_hint", "provider_of"]
