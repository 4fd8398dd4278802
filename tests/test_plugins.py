"""The plugin manager: hookspec docs, built-ins, real entry-point discovery, broken plugins,
allow/block lists, in-process registration and atomic registration."""
from __future__ import annotations

import inspect
import json
import sys
import textwrap
import uuid
import warnings

import pytest
from click.testing import CliRunner

from rlx_core.cli import main
from rlx_core.ir.errors import BackendError, PluginError
from rlx_core.plugins import (HOOKS, RlxPluginWarning, hookimpl, hookspecs, manager, owner_of,
                              plugin_infos, register_plugin, registry, reset, temporary_plugin,
                              unregister_plugin)


pytestmark = pytest.mark.usefixtures("plugins_env")   # rlx_core.testing: plugins afresh


def infos() -> dict:
    return {i.name: i for i in plugin_infos()}


# --------------------------------------------------------------------------- hookspecs
def test_every_hookspec_has_a_docstring():
    specs = {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
             if getattr(fn, hookspecs.PROJECT + "_spec", None) is not None}
    assert set(specs) == set(HOOKS)
    assert {"rlx_register_backends", "rlx_register_blocks", "rlx_register_recipes",
            "rlx_register_ops", "rlx_register_passes",
            "rlx_register_weight_formats"} <= set(specs)
    undocumented = [n for n, fn in specs.items() if len((inspect.getdoc(fn) or "").strip()) < 40]
    assert not undocumented, f"hookspecs without a docstring: {undocumented}"
    for name, fn in specs.items():
        assert "register(" in inspect.getdoc(fn), f"{name}: say how `register` is called"
        assert list(inspect.signature(fn).parameters) == ["register"], name


def test_every_hookspec_is_known_to_the_plugin_manager():
    pm = manager.plugin_manager()
    for name in HOOKS:
        assert getattr(pm.hook, name).spec is not None


# --------------------------------------------------------------------------- built-ins
def test_numpy_backend_is_a_builtin_plugin():
    reg = registry()
    assert "numpy" in reg.backends
    assert owner_of("backend", "numpy") == "rlx_core.backends.numpy"
    info = infos()["rlx_core.backends.numpy"]
    assert (info.kind, info.status) == ("builtin", "ok")
    assert "rlx_register_backends" in info.hooks


# --------------------------------------------------------------------------- entry points
def write_dist(site, dist: str, version: str, ep_name: str, module: str, source: str) -> None:
    """A tiny installed distribution: a module plus *.dist-info with METADATA and
    entry_points.txt, as pip would leave it (no pip needed)."""
    (site / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
                                   encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[rlx]\n{ep_name} = {module}\n", encoding="utf-8")


GOOD = """
    from rlx_core.backends import Backend
    from rlx_core.plugins import hookimpl

    __version__ = "1.2.3"


    class AccelBackend(Backend):
        name = "tp-accel"
        priority = 100          # would win if it were available
        target = "generic"

        def availability(self):
            return False, "no accelerator in this test"

        def supported_ops(self):
            from rlx_core.ir.composites import PRIMITIVES
            return set(PRIMITIVES)

        def compile(self, lir, params, states):
            raise NotImplementedError


    class Scale:
        def __init__(self, factor=2.0):
            self.factor = factor

        def emit(self, ctx, value):
            return value * self.factor


    @hookimpl
    def rlx_register_backends(register):
        register(AccelBackend())


    @hookimpl
    def rlx_register_blocks(register):
        register("tp.scale", Scale)
"""

BROKEN = """
    raise ImportError("boom: rlx_tp_missing_dependency is not installed")
"""


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """Two third-party plugins on sys.path: a good one (backend + block) and one that raises
    on import. Yields their module names; removes them from sys.modules afterwards."""
    site = tmp_path / "site"
    site.mkdir()
    tag = uuid.uuid4().hex[:8]
    mods = {"good": f"rlx_tp_good_{tag}", "broken": f"rlx_tp_broken_{tag}"}
    write_dist(site, "rlx-tp-good", "1.2.3", "tpgood", mods["good"], GOOD)
    write_dist(site, "rlx-tp-broken", "0.0.1", "tpbroken", mods["broken"], BROKEN)
    monkeypatch.syspath_prepend(str(site))
    reset()
    yield mods
    for m in mods.values():
        sys.modules.pop(m, None)


def test_entry_point_plugin_registers_backend_and_block(third_party):
    with pytest.warns(RlxPluginWarning, match="tpbroken"):
        reg = registry()
    assert "tp-accel" in reg.backends and "tp.scale" in reg.blocks
    assert "numpy" in reg.backends                       # built-ins unaffected
    assert owner_of("backend", "tp-accel") == "tpgood"
    assert owner_of("block", "tp.scale") == "tpgood"
    good = infos()["tpgood"]
    assert (good.kind, good.status, good.version, good.package) == ("entrypoint", "ok", "1.2.3",
                                                                     "rlx-tp-good")
    assert good.hooks == ["rlx_register_backends", "rlx_register_blocks"]
    assert reg.blocks["tp.scale"](factor=3.0).factor == 3.0


def test_unavailable_plugin_backend_is_never_picked_silently(third_party):
    from rlx_core.pipeline import available_backends, select_backend

    with pytest.warns(RlxPluginWarning):
        registry()
    rows = {b.name: (ok, why) for b, ok, why in available_backends()}
    assert rows["tp-accel"] == (False, "no accelerator in this test")
    assert select_backend().name != "tp-accel"            # unavailable: never picked
    with pytest.raises(BackendError, match="no accelerator in this test"):
        select_backend("tp-accel")


def test_plugin_raising_on_import_is_listed_broken_not_fatal(third_party):
    with pytest.warns(RlxPluginWarning, match="boom: rlx_tp_missing_dependency"):
        listed = infos()
    broken = listed["tpbroken"]
    assert broken.status == "broken"
    assert broken.error.startswith("ImportError: boom: rlx_tp_missing_dependency")
    assert (broken.package, broken.version) == ("rlx-tp-broken", "0.0.1")
    assert listed["tpgood"].status == "ok"
    assert third_party["broken"] not in sys.modules


def test_rlx_plugins_json_lists_broken_plugin_with_its_error(third_party):
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    rep = json.loads(result.stdout)
    plugins = {p["name"]: p for p in rep["plugins"]}
    assert plugins["tpbroken"]["status"] == "broken"
    assert "boom: rlx_tp_missing_dependency" in plugins["tpbroken"]["error"]
    assert plugins["tpgood"]["status"] == "ok"
    backends = {b["name"]: b for b in rep["backends"]}
    assert backends["tp-accel"]["available"] is False
    assert backends["tp-accel"]["reason"] == "no accelerator in this test"
    assert backends["numpy"]["available"] is True
    assert rep["blocks"]["tp.scale"] == "tpgood"
    assert "warning: rlx plugin 'tpbroken'" in result.stderr


def test_rlx_plugins_text_shows_why_broken(third_party):
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "tpbroken" in result.stdout and "broken: ImportError: boom" in result.stdout
    assert "unavailable: no accelerator in this test" in result.stdout


@pytest.mark.parametrize("blocked", ["tpbroken", "rlx-tp-broken", "RLX_TP_Broken", "x, tpbroken"])
def test_disable_plugins_hides_broken_plugin(third_party, monkeypatch, blocked):
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", blocked)
    reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RlxPluginWarning)      # no warning at all
        listed = infos()
    assert listed["tpbroken"].status == "disabled"
    assert "RLX_DISABLE_PLUGINS" in listed["tpbroken"].error
    assert third_party["broken"] not in sys.modules        # never imported
    assert listed["tpgood"].status == "ok" and "tp-accel" in registry().backends
    rep = json.loads(CliRunner().invoke(main, ["plugins", "--json"]).stdout)
    assert {p["name"]: p["status"] for p in rep["plugins"]}["tpbroken"] == "disabled"


@pytest.mark.parametrize("allowed", ["tpgood", "rlx-tp-good", " tpgood ,"])
def test_allow_list_keeps_only_named_plugins(third_party, monkeypatch, allowed):
    monkeypatch.setenv("RLX_PLUGINS", allowed)
    reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RlxPluginWarning)
        listed = infos()
    assert listed["tpgood"].status == "ok"
    assert listed["tpbroken"].status == "disabled"
    assert "RLX_PLUGINS" in listed["tpbroken"].error
    reg = registry()
    assert "tp-accel" in reg.backends and "numpy" in reg.backends   # built-ins always load


def test_empty_allow_list_loads_no_third_party_plugin(third_party, monkeypatch):
    monkeypatch.setenv("RLX_PLUGINS", "")
    reset()
    listed = infos()
    assert listed["tpgood"].status == listed["tpbroken"].status == "disabled"
    assert set(registry().backends) == {"numpy"}


def test_block_list_wins_over_allow_list(third_party, monkeypatch):
    monkeypatch.setenv("RLX_PLUGINS", "tpgood,tpbroken")
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "tpgood")
    reset()
    with pytest.warns(RlxPluginWarning, match="tpbroken"):
        listed = infos()
    assert listed["tpgood"].status == "disabled" and listed["tpbroken"].status == "broken"
    assert "tp-accel" not in registry().backends


def test_reset_forgets_third_party_plugins(third_party, monkeypatch):
    with pytest.warns(RlxPluginWarning):
        assert "tp-accel" in registry().backends
    monkeypatch.setenv("RLX_PLUGINS", "")
    reset()
    assert "tp-accel" not in registry().backends


# --------------------------------------------------------------------------- in-process
class BlockPlugin:
    """A plugin object, as a notebook or a test would register it."""

    @hookimpl
    def rlx_register_blocks(self, register):
        register("test.identity", lambda **kw: None)


def test_register_and_unregister_plugin_object():
    register_plugin(BlockPlugin(), "test-blocks")
    try:
        assert "test.identity" in registry().blocks
        assert owner_of("block", "test.identity") == "test-blocks"
        assert infos()["test-blocks"].kind == "registered"
    finally:
        unregister_plugin("test-blocks")
    assert "test.identity" not in registry().blocks
    assert "test-blocks" not in infos()


def test_temporary_plugin_context_manager():
    with temporary_plugin(BlockPlugin(), "tmp-blocks"):
        assert "test.identity" in registry().blocks
    assert "test.identity" not in registry().blocks


def test_registering_the_same_name_twice_is_an_error():
    with temporary_plugin(BlockPlugin(), "dup"):
        with pytest.raises(PluginError, match="already registered"):
            register_plugin(BlockPlugin(), "dup")


class NumpyImpostor:
    @hookimpl
    def rlx_register_blocks(self, register):
        register("impostor.block", lambda **kw: None)

    @hookimpl
    def rlx_register_backends(self, register):
        from rlx_core.backends.numpy import NumpyBackend

        register(NumpyBackend())


def test_conflicting_registration_is_rejected_as_a_whole():
    before = registry().backends["numpy"]
    with pytest.warns(RlxPluginWarning, match="registered by both"), \
            pytest.raises(PluginError, match="backend 'numpy' is registered by both "
                                             "'rlx_core.backends.numpy' and 'impostor'"):
        register_plugin(NumpyImpostor(), "impostor")
    reg = registry()
    assert reg.backends["numpy"] is before
    assert "impostor.block" not in reg.blocks              # nothing of it was kept
    assert "impostor" not in infos()


class RaisingHook:
    @hookimpl
    def rlx_register_blocks(self, register):
        register("half.registered", lambda **kw: None)
        raise RuntimeError("hook exploded")


def test_hook_that_raises_breaks_only_its_plugin():
    with pytest.warns(RlxPluginWarning, match="hook exploded"), \
            pytest.raises(PluginError, match="rlx_register_blocks raised RuntimeError: hook exploded"):
        register_plugin(RaisingHook(), "raiser")
    reg = registry()
    assert "half.registered" not in reg.blocks and "numpy" in reg.backends


class Typo:
    @hookimpl
    def rlx_register_backend(self, register):          # missing "s"
        pass


class Unmarked:
    def rlx_register_blocks(self, register):           # forgot @hookimpl
        register("never", lambda **kw: None)


@pytest.mark.parametrize("plugin, match", [(Typo(), "unknown hook"), (Unmarked(), "without @hookimpl")])
def test_silent_plugin_mistakes_are_reported(plugin, match):
    with pytest.raises(PluginError, match=match):
        register_plugin(plugin, "mistake")
    assert "mistake" not in infos()
    assert not manager.plugin_manager().has_plugin("mistake")


class InvalidRegistration:
    @hookimpl
    def rlx_register_weight_formats(self, register):
        register("fmt", "not callable", None)


def test_invalid_registration_names_the_hook():
    expected = r"rlx_register_weight_formats.*expected register\(name: str, detect, load\)"
    with pytest.warns(RlxPluginWarning), pytest.raises(PluginError, match=expected):
        register_plugin(InvalidRegistration(), "invalid")


class OpPlugin:
    @hookimpl
    def rlx_register_ops(self, register):
        from rlx_core.ir.custom import CustomOp

        # a fresh CustomOp object each time the hook runs
        register(CustomOp("test_double", lambda shapes, params: (shapes[0],),
                          {"numpy": lambda x: 2 * x}))


def test_custom_ops_survive_a_registry_rebuild():
    from rlx_core.ir.custom import custom_op

    with temporary_plugin(OpPlugin(), "ops"):
        assert custom_op("test_double").name == "test_double"
        assert owner_of("op", "test_double") == "ops"
        with temporary_plugin(BlockPlugin(), "more"):       # rebuilds the registry
            assert "test_double" in registry().ops
            assert custom_op("test_double").kernels["numpy"](3) == 6
    with pytest.raises(Exception, match="unknown custom op 'test_double'"):
        custom_op("test_double")


class KeywordRegister:
    @hookimpl
    def rlx_register_blocks(self, register):
        register(name="kw.block", factory=dict)


def test_register_accepts_the_documented_keyword_names():
    with temporary_plugin(KeywordRegister(), "kw"):
        assert registry().blocks["kw.block"] is dict


class TwiceBlock:
    @hookimpl
    def rlx_register_blocks(self, register):
        register("twice", dict)
        register("twice", list)


def test_registering_one_name_twice_in_a_plugin_is_an_error():
    with pytest.warns(RlxPluginWarning), \
            pytest.raises(PluginError, match="block 'twice' is registered twice by 'tw'"):
        register_plugin(TwiceBlock(), "tw")
