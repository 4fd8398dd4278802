"""scripts/typecheck.py's baseline logic (CI runs mypy itself through .ci/run; these cases feed the
script made-up mypy reports): a new error fails, a fixed one passes and says how to shrink, --update
shrinks but never grows, and a mypy that could not check is a failure, not a pass."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("typecheck", ROOT / "scripts" / "typecheck.py")
typecheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(typecheck)

RETURN = 'Incompatible return value type (got "int", expected "str")'
A = f'rlx_core/a.py:12: error: {RETURN}  [return-value]'
A_MOVED = f'rlx_core/a.py:40: error: {RETURN}  [return-value]'
B = 'rlx_core/b.py:3:5: error: Name "x" already defined on line 1  [no-redef]'
C = 'rlx_core/c.py:7: error: "object" has no attribute "graph"  [attr-defined]'
NOTE = 'rlx_core/a.py:12: note: See https://mypy.readthedocs.io'


def report(*lines: str) -> str:
    return "\n".join([*lines, f"Found {len(lines)} errors in 1 file (checked 3 source files)"]) + "\n"


@pytest.fixture
def baseline(tmp_path):
    path = tmp_path / "mypy-baseline.txt"
    assert typecheck.check(report(A, B, NOTE), path, "reset") == 0
    return path


def test_normalize_drops_line_numbers_and_notes():
    got = typecheck.normalize(report(A, A_MOVED, B, NOTE))
    assert got == {f'rlx_core/a.py: [return-value] {RETURN}': 2,
                   'rlx_core/b.py: [no-redef] Name "x" already defined on line N': 1}


def test_moved_code_passes(baseline, capsys):
    assert typecheck.check(report(A_MOVED, B.replace(":3:5:", ":9:1:").replace("line 1", "line 4")),
                           baseline) == 0
    assert "passed" in capsys.readouterr().out


def test_new_error_fails_and_is_named(baseline, capsys):
    assert typecheck.check(report(A, B, C), baseline) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and '"object" has no attribute "graph"' in out and "already defined" not in out


def test_second_copy_of_a_baselined_error_is_new(baseline, capsys):
    assert typecheck.check(report(A, A_MOVED, B), baseline) == 1
    assert "Incompatible return value" in capsys.readouterr().out


def test_fixed_error_passes_and_says_how_to_shrink(baseline, capsys):
    before = baseline.read_text()
    assert typecheck.check(report(A), baseline) == 0
    out = capsys.readouterr().out
    assert "fixed since the baseline (1)" in out and "--update" in out
    assert baseline.read_text() == before           # a check never writes


def test_update_shrinks(baseline):
    assert typecheck.check(report(B), baseline, "update") == 0
    assert typecheck.read_baseline(baseline) == typecheck.normalize(report(B))


def test_update_refuses_to_grow(baseline, capsys):
    before = baseline.read_text()
    assert typecheck.check(report(B, C), baseline, "update") == 1
    assert "refuses to grow" in capsys.readouterr().out
    assert baseline.read_text() == before


def test_missing_baseline_tolerates_nothing(tmp_path):
    assert typecheck.check(report(A), tmp_path / "absent.txt") == 1
    assert typecheck.check(report(), tmp_path / "absent.txt") == 0


def test_mypy_that_could_not_check_fails(monkeypatch):
    def fake_run(*args, **kwargs):
        return subprocess.CompletedProcess(args, 2, "rlx_core/a.py:1: error: invalid syntax  [syntax]\n", "")

    monkeypatch.setattr(typecheck.subprocess, "run", fake_run)
    with pytest.raises(typecheck.TypecheckError, match="exited 2"):
        typecheck.run_mypy()
    assert typecheck.main(["--baseline", str(ROOT / "no-such-baseline.txt")]) == 2


def test_failure_without_error_lines_fails(monkeypatch):
    monkeypatch.setattr(typecheck.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "something odd\n", ""))
    with pytest.raises(typecheck.TypecheckError, match="without an error line"):
        typecheck.run_mypy()


def test_committed_baseline_is_sorted_and_normalized():
    """The committed file is what --reset/--update write: sorted, no line numbers, no stray text."""
    text = (ROOT / ".ci" / "mypy-baseline.txt").read_text()
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert lines == sorted(lines)
    for line in lines:
        assert line.startswith("rlx_core/") and ": [" in line, line
        assert typecheck._LINE_REF.search(line) is None, line


def test_script_runs_as_a_program():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "typecheck.py"), "--update", "--reset"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "not allowed with" in proc.stderr
