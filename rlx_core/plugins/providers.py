"""Which package provides a model type, GGUF architecture or packaged model name, for the
errors that say what to install (or unblock) when no loaded plugin registers it.

What loaded plugins registered answers first; then what installed distributions declare in
the entry-point groups `rlx.model_types` and `rlx.packaged_models` (read from their metadata,
nothing imported: a blocked or broken third-party plugin is still named); then
`providers.toml` beside this file (data, not code), for plugins that are not installed.
"""
from __future__ import annotations

import functools
import importlib.metadata as md
import os

from ..ir.errors import PluginError
from .manager import _norm, plugin_infos, registry

TABLE = os.path.join(os.path.dirname(__file__), "providers.toml")
TABLES = {"model_types": ("recipe", "gguf architecture"), "packaged_models": ("packaged model",)}


@functools.lru_cache(maxsize=1)
def known_providers() -> dict:
    """providers.toml's tables: {table: {name: distribution}} for each of TABLES."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(TABLE, "rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError) as e:
        raise PluginError(f"{TABLE}: cannot read the tables of providers: {e}") from None
    for table in TABLES:
        rows = data.get(table)
        if not isinstance(rows, dict) or not all(isinstance(v, str) and v for v in rows.values()):
            raise PluginError(f"{TABLE}: expected a [{table}] table of name = \"distribution\"")
    return {table: dict(data[table]) for table in TABLES}


def declared_providers(table: str) -> dict:
    """{name: distribution} from the entry points of group `rlx.<table>` of every installed
    distribution (`[project.entry-points."rlx.model_types"] olmo2 = "rlx_blocks_olmo2"`)."""
    try:
        eps = md.entry_points(group=f"rlx.{table}")
    except Exception:  # pragma: no cover - broken metadata somewhere on sys.path
        return {}
    return {ep.name: ep.dist.name for ep in eps if ep.dist is not None}


def _registered_by(name: str, table: str) -> str:
    """The distribution of the loaded plugin that registered `name` (of `table`'s kinds), or ""."""
    owners = registry().owner
    plugin = next((owners[(k, name)] for k in TABLES[table] if (k, name) in owners), "")
    info = next((i for i in plugin_infos() if i.name == plugin), None)
    return info.package if info is not None else ""


def provider_of(name: str, table: str = "model_types") -> str:
    """The distribution that provides `name`, or "" when none is known: a model type or GGUF
    architecture (table "model_types"), or a packaged model's name ("packaged_models")."""
    if table not in TABLES:
        raise PluginError(f"no table of providers {table!r}; tables: {sorted(TABLES)}")
    return (_registered_by(name, table) or declared_providers(table).get(name)
            or known_providers()[table].get(name, ""))


def provider_hint(name: str, table: str = "model_types") -> str:
    """A clause for an error about `name` that no loaded plugin provides: which package
    provides it and why it is not loaded (absent, blocked, broken); "" when none is known."""
    dist = provider_of(name, table)
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


__all__ = ["TABLE", "TABLES", "declared_providers", "known_providers", "provider_hint", "provider_of"]
