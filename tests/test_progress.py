"""Compile progress bars (rlx_core.progress): shown for work that asks for them, per graph
compiled and per specialization, and quiet otherwise (progress=False, the default of models
built in tests)."""
from __future__ import annotations

import pytest

from rlx_core import progress


@pytest.fixture
def no_delay(monkeypatch):
    """Bars at once, drawn into the captured stderr as if it were a terminal."""
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "_redraws", lambda: True)


def test_a_task_shows_its_stages_and_details(no_delay, capsys):
    with progress.task("compiling x", 2):
        progress.stage("first")
        progress.detail("a pass")
        progress.stage("second")
    err = capsys.readouterr().err
    assert "compiling x" in err and "first: a pass" in err and "stage 1/2" in err and "second" in err


def test_quiet_when_disabled_outside_a_task_and_before_the_delay(capsys, monkeypatch):
    monkeypatch.setattr(progress, "_redraws", lambda: True)
    progress.stage("nobody listens")
    with progress.task("outer", 1):                  # the real DELAY: too quick to show
        with progress.task("inner", 1, enabled=False):
            progress.stage("hidden")
        progress.stage("quick")
    assert capsys.readouterr().err == ""


def test_never_into_a_pipe_or_a_log(capsys, monkeypatch):
    monkeypatch.setattr(progress, "DELAY", 0.0)
    with progress.task("compiling x", 1):            # capsys' stderr is no terminal
        progress.stage("first")
    assert capsys.readouterr().err == ""


def test_a_model_shows_compiles_and_specializations_only_when_asked(no_delay, capsys, rng):
    pytest.importorskip("rlx_blocks_llama")
    from tiny_models import tiny_llama

    m = tiny_llama(rng)
    assert m.progress is False
    m.generate([[5, 6, 7]], max_new_tokens=2)
    assert capsys.readouterr().err == ""
    m = tiny_llama(rng)
    m.progress = True
    m.generate([[5, 6, 7]], max_new_tokens=2, min_new_tokens=2)   # (an EOS first would skip decode)
    err = capsys.readouterr().err
    for text in ("compiling prefill", "compiling decode", "optimize", "bind params",
                 "specializing llama_prefill (batch=1, ctx=64, seq=3)", "numpy compile"):
        assert text in err, text
