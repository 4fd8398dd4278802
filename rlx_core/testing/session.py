"""What the kit knows of the test session: its seed (random, printed in the header;
RLX_TEST_SEED replays it), the `rng` fixture drawn from it, and the names the
--rlx-backend / --rlx-recipe options selected (set by the plugin's pytest_configure)."""
from __future__ import annotations

import os
import zlib

import pytest

SEED = int(os.environ.get("RLX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
_selected: dict = {}             # option dest ("rlx_backend", "rlx_recipe") -> name or None


def seed_header() -> str:
    return f"rlx test seed: {SEED} (set RLX_TEST_SEED={SEED} to replay)"


def seed_for(nodeid: str) -> list:
    return [SEED, zlib.crc32(nodeid.encode())]


def selected(option: str) -> str | None:
    """The name `--rlx-backend` / `--rlx-recipe` gave (None: every one)."""
    return _selected.get(option)


def select(option: str, name: str | None) -> None:
    _selected[option] = name or None


def clear() -> None:
    _selected.clear()


@pytest.fixture
def rng(request):
    """A numpy generator seeded from the run's seed and the test's id (a module's or
    conftest's own `rng` fixture overrides this one)."""
    import numpy as np

    return np.random.default_rng(seed_for(request.node.nodeid))


@pytest.fixture
def plugins_env(monkeypatch):
    """Plugins discovered afresh, with no RLX_PLUGINS / RLX_DISABLE_PLUGINS, before and after
    the test; yields `monkeypatch`, so a test can block a plugin (setenv, then
    `rlx_core.plugins.reset()`) without leaving it blocked for the next."""
    from rlx_core.plugins import reset

    for var in ("RLX_PLUGINS", "RLX_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    reset()
    yield monkeypatch
    for var in ("RLX_PLUGINS", "RLX_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    reset()
