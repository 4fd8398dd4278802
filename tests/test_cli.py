"""The `rlx` command through click's CliRunner."""
from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from rlx_core import __version__
from rlx_core.cli import RlxGroup, main
from rlx_core.ir.errors import ModelError
from rlx_core.ir.graph import Graph

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_clean_error(result, *fragments: str) -> None:
    """Exit status 2 and one line `error: ...` on stderr, never a traceback."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in lines[0]


def mlp_graph() -> Graph:
    def f(m):
        x = m.input("x", (1, "seq", 64))
        h = m.rms_norm(x, m.param("norm", (64,)))
        return x + m.swiglu(h, m.param("w_gate", (128, 64)), m.param("w_up", (128, 64)),
                            m.param("w_down", (64, 128)))
    return Graph.define("mlp", f)


@pytest.fixture
def hir_file(tmp_path):
    p = tmp_path / "mlp.json"
    p.write_text(mlp_graph().to_json(), encoding="utf-8")
    return p


# --------------------------------------------------------------------------- group
def test_version():
    r = run("--version")
    assert r.exit_code == 0
    assert r.stdout.strip() == f"rlx {__version__}"


def test_every_command_and_option_has_help():
    ctx = click.Context(main)
    assert main.help
    for name, cmd in main.commands.items():
        assert cmd.help, f"command {name!r} has no help"
        for p in cmd.params:
            if isinstance(p, click.Option):
                assert p.help, f"{name} {p.opts} has no help"
        assert run(name, "--help").exit_code == 0
    assert "inspect" in main.get_help(ctx) and "demo" in main.get_help(ctx)


def test_rlx_errors_become_one_line_with_exit_2():
    group = RlxGroup("t")

    @group.command()
    def boom():
        """Fail."""
        raise ModelError("first line\n  second line")

    r = CliRunner().invoke(group, ["boom"])
    assert_clean_error(r, "error: first line; second line")


def test_other_exceptions_are_not_swallowed():
    group = RlxGroup("t")

    @group.command()
    def bug():
        """A bug."""
        raise ZeroDivisionError("bug")

    r = CliRunner().invoke(group, ["bug"])
    assert isinstance(r.exception, ZeroDivisionError)


# --------------------------------------------------------------------------- plugins
def test_plugins_json_parses():
    r = run("plugins", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["version"] == __version__
    names = {p["name"]: p for p in rep["plugins"]}
    numpy = names["rlx_core.backends.numpy"]
    assert numpy["kind"] == "builtin" and numpy["status"] == "ok" and numpy["hooks"]
    for p in rep["plugins"]:
        assert set(p) >= {"name", "version", "kind", "hooks", "status", "error"}
    backends = {b["name"]: b for b in rep["backends"]}
    assert backends["numpy"]["available"] is True
    assert backends["numpy"]["plugin"] == "rlx_core.backends.numpy"


def test_plugins_kernel_paths_never_break_the_listing():
    """A backend's kernel_paths() that raises becomes one entry saying so; the base gives none."""
    from rlx_core.backends.numpy import NumpyBackend
    from rlx_core.cli import _kernel_paths

    class Broken:
        def kernel_paths(self):
            raise RuntimeError("no probe")
    assert _kernel_paths(Broken()) == [{"path": "kernel_paths()", "on": False,
                                        "reason": "raised RuntimeError: no probe"}]
    assert _kernel_paths(NumpyBackend()) == []
    rep = json.loads(run("plugins", "--json").stdout)
    assert all(isinstance(b["kernel_paths"], list) for b in rep["backends"])


def test_plugins_text():
    r = run("plugins")
    assert r.exit_code == 0, r.output
    assert "plugins:" in r.stdout and "backends:" in r.stdout
    assert re.search(r"^\s+numpy\s+10\s+numpy\s+yes", r.stdout, re.M)


# --------------------------------------------------------------------------- inspect
def test_inspect_hir_json_at_every_level(hir_file):
    r = run("inspect", str(hir_file), "--dim", "seq=8")
    assert r.exit_code == 0, r.output
    out = r.stdout
    hir, mir, lir = out.index("graph mlp (hir)"), out.index("graph mlp (mir)"), out.index("graph mlp (lir)")
    assert hir < mir < lir
    assert "swiglu_mlp(" in out[hir:mir]                          # HIR block
    assert "fused_swiglu(" in out[mir:lir]                        # lowered and fused
    assert "f32[1,seq,64]" in out[mir:lir] and "f32[1,8,64]" in out[lir:]
    assert re.search(r"lir mlp: arena \d+ B \(liveness bound \d+ B\)", out)
    assert "# arena[" in out or "arena[" in out[lir:]
    assert "# passes: lower" in out


def test_inspect_without_dims_stops_before_lir(hir_file):
    r = run("inspect", str(hir_file))
    assert r.exit_code == 0, r.output
    assert "graph mlp (mir)" in r.stdout and "(lir)" not in r.stdout
    assert "LIR not planned: unbound dims ['seq']; bind them with --dim seq=N" in r.stdout


def test_inspect_with_profile_and_backend(hir_file):
    r = run("inspect", str(hir_file), "-d", "seq=4", "--profile", "unfused", "--backend", "numpy")
    assert r.exit_code == 0, r.output
    assert "profile unfused, backend numpy" in r.stdout
    assert "# fused:" not in r.stdout            # `unfused` skips every fusion pattern group


def test_inspect_unknown_dim_is_a_usage_error(hir_file):
    r = run("inspect", str(hir_file), "--dim", "batch=2")
    assert r.exit_code == 2 and "no dim(s) ['batch']" in r.output
    r = run("inspect", str(hir_file), "--dim", "seq")
    assert r.exit_code == 2 and "NAME=N" in r.output


@pytest.mark.parametrize("target", ["llama32_prefill", str(PROFILES / "gemma.rlx.toml")])
def test_inspect_profile(target):
    r = run("inspect", target)
    assert r.exit_code == 0, r.output
    first = r.stdout.splitlines()[0]
    assert re.match(r"# profile (llama32_prefill|gemma) \(hash [0-9a-f]{16}\)$", first)
    assert "[fusion]" in r.stdout and "[precision]" in r.stdout


def test_inspect_truncated_json_is_a_clean_error(hir_file, tmp_path):
    bad = tmp_path / "truncated.json"
    bad.write_text(hir_file.read_text()[:200], encoding="utf-8")
    assert_clean_error(run("inspect", str(bad)), "truncated.json", "not valid JSON")


def test_inspect_missing_file_and_bad_profiles(hir_file, tmp_path):
    assert_clean_error(run("inspect", str(tmp_path / "nope.json")), "cannot read")
    assert_clean_error(run("inspect", str(hir_file), "--profile", "no_such_preset"),
                       "unknown profile preset 'no_such_preset'")
    toml = tmp_path / "bad.rlx.toml"
    toml.write_text('[fusion]\npolicy = "sideways"\n', encoding="utf-8")
    assert_clean_error(run("inspect", str(toml)), "bad.rlx.toml", "[fusion] policy")
    assert_clean_error(run("inspect", str(hir_file), "--backend", "nope"), "unknown backend 'nope'")


# --------------------------------------------------------------------------- demo
def demo_diff(stdout: str) -> float:
    m = re.search(r"max abs diff vs numpy \(float64\): ([0-9.e+-]+) \(ok tolerance", stdout)
    assert m, stdout[-500:]
    return float(m.group(1))


def test_demo_prints_every_level_and_a_small_diff():
    r = run("demo", "--seq", "12")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.index("(hir)") < out.index("(mir)") < out.index("(lir)")
    assert "fused_attention_block" in out and "arena[" in out and "manifest:" in out
    assert "f32[1,12,64]" in out
    assert demo_diff(out) < 1e-4


@pytest.mark.parametrize("profile", ["fusable", "unfused", "debug"])
def test_demo_under_other_profiles(profile):
    r = run("demo", "-q", "--seq", "5", "--profile", profile)
    assert r.exit_code == 0, r.output
    assert len(r.stdout.splitlines()) == 1 + (profile == "debug") * r.stdout.count("[rlx]")
    assert demo_diff(r.stdout) < 1e-4


def test_demo_rejects_bad_sizes():
    r = run("demo", "--hidden", "60", "--heads", "4")
    assert r.exit_code == 2 and "multiple of 2*heads" in r.output
