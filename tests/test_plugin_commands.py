"""CLI commands from plugins (rlx_register_commands): listed by `rlx --help`, run with the
group's error handling, and a name a core command or another plugin has breaks the plugin
that asks for it (shown by `rlx plugins`), the others keep working."""
from __future__ import annotations

import json
import sys
import textwrap
import uuid

import click
import pytest
from click.testing import CliRunner

from rlx_core.cli import main
from rlx_core.ir.errors import ModelError, PluginError
from rlx_core.plugins import RlxPluginWarning, hookimpl, manager, register_plugin, temporary_plugin


pytestmark = pytest.mark.usefixtures("plugins_env")   # rlx_core.testing: plugins afresh


def command(name: str, fail: bool = False) -> click.Command:
    @click.command(name)
    @click.argument("who", default="world")
    def cmd(who):
        """Say hello."""
        if fail:
            raise ModelError(f"{who} is not welcome")
        click.echo(f"hello {who} from {name}")
    return cmd


class Commands:
    def __init__(self, *commands):
        self.commands = commands

    @hookimpl
    def rlx_register_commands(self, register):
        for c in self.commands:
            register(c)


def test_a_plugin_command_is_listed_and_runs():
    with temporary_plugin(Commands(command("tp-hello"), command("tp-fail", fail=True)), "tpcmds"):
        r = CliRunner().invoke(main, ["--help"])
        assert r.exit_code == 0 and "tp-hello" in r.stdout and "Say hello." in r.stdout
        r = CliRunner().invoke(main, ["tp-hello", "rlx"])
        assert r.exit_code == 0 and r.stdout == "hello rlx from tp-hello\n"
        r = CliRunner().invoke(main, ["tp-fail", "bob"])          # the group's RlxError handling
        assert r.exit_code == 2 and r.stderr == "error: bob is not welcome\n"
        rep = json.loads(CliRunner().invoke(main, ["plugins", "--json"]).stdout)
        assert rep["commands"] == {**rep["commands"], "tp-hello": "tpcmds", "tp-fail": "tpcmds"}
    r = CliRunner().invoke(main, ["tp-hello"])
    assert r.exit_code == 2 and "No such command 'tp-hello'" in r.stderr


def test_core_commands_are_reserved():
    assert {"generate", "embed", "plugins", "quantize", "cache"} <= manager.RESERVED_COMMANDS
    with pytest.warns(RlxPluginWarning), \
            pytest.raises(PluginError, match="command 'generate' is a core rlx command"):
        register_plugin(Commands(command("generate"), command("tp-other")), "tpclash")
    r = CliRunner().invoke(main, ["tp-other"])                    # all or nothing: none of it stays
    assert r.exit_code == 2 and "No such command" in r.stderr


def test_a_registry_built_before_the_reservation_is_rebuilt():
    with temporary_plugin(Commands(command("tp-late")), "tplate"):
        assert "tp-late" in manager.registry().commands
        try:
            with pytest.warns(RlxPluginWarning, match="command 'tp-late' is a core rlx command"):
                manager.reserve_commands(["tp-late"])
                assert "tp-late" not in manager.registry().commands
            assert {i.name: i.status for i in manager.plugin_infos()}["tplate"] == "broken"
        finally:
            manager.RESERVED_COMMANDS.discard("tp-late")


def write_dist(site, dist: str, ep_name: str, module: str, source: str) -> None:
    """A tiny installed distribution with an entry point in the group `rlx` (no pip needed)."""
    (site / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[rlx]\n{ep_name} = {module}\n", encoding="utf-8")


PLUGIN = """
    import click
    from rlx_core.plugins import hookimpl


    @click.command({name!r})
    def cmd():
        click.echo("ran {ep}")


    @hookimpl
    def rlx_register_commands(register):
        register(cmd)
"""


@pytest.fixture
def clashing(tmp_path, monkeypatch):
    """Entry-point plugins: tpa adds `tp-shared`, tpb the same name, tpc `inspect` (a core
    command), tpd `tp-own`."""
    site = tmp_path / "site"
    site.mkdir()
    tag = uuid.uuid4().hex[:8]
    mods = []
    for ep, name in (("tpa", "tp-shared"), ("tpb", "tp-shared"), ("tpc", "inspect"), ("tpd", "tp-own")):
        mods.append(f"rlx_tp_{ep}_{tag}")
        write_dist(site, f"rlx-tp-{ep}", ep, mods[-1], PLUGIN.format(name=name, ep=ep))
    monkeypatch.syspath_prepend(str(site))
    manager.reset()
    yield
    for m in mods:
        sys.modules.pop(m, None)


def test_clashing_commands_break_only_the_plugins_that_ask_for_a_taken_name(clashing):
    r = CliRunner().invoke(main, ["plugins", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    status = {p["name"]: (p["status"], p["error"]) for p in rep["plugins"]}
    assert status["tpa"] == ("ok", "")
    assert status["tpb"][0] == "broken" and "command 'tp-shared' is registered by both 'tpa' and 'tpb'" \
        in status["tpb"][1]
    assert status["tpc"][0] == "broken" and "command 'inspect' is a core rlx command" in status["tpc"][1]
    assert rep["commands"]["tp-shared"] == "tpa" and rep["commands"]["tp-own"] == "tpd"
    text = CliRunner().invoke(main, ["plugins"]).stdout
    assert "broken: command 'tp-shared' is registered by both 'tpa' and 'tpb'" in text
    assert "command 'inspect' is a core rlx command" in text and "tp-own      tpd" in text
    assert CliRunner().invoke(main, ["tp-shared"]).stdout == "ran tpa\n"
    assert CliRunner().invoke(main, ["tp-own"]).stdout == "ran tpd\n"
    r = CliRunner().invoke(main, ["inspect", "--help"])           # the core command, untouched
    assert r.exit_code == 0 and "MODEL|FILE" in r.stdout
