"""The pure parts of the benchmarks' tools: gpu_kernels.py's knockout_table (what each kind of
launch costs inside a captured step), on a stand-in runner whose replay takes the sum of its
steps' costs; common.py's RLX_BENCH_SET (module constants set for an A/B)."""
from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import common  # noqa: E402
import gpu_kernels  # noqa: E402


class StandIn:
    """A runner: `steps` with a cost each; a capture freezes the current list, a replay of it
    takes the sum of its costs (seconds)."""

    def __init__(self, steps):
        self.steps, self.captured, self.captures = steps, None, 0

    def _capture(self):
        self.captured, self.captures = list(self.steps), self.captures + 1

    def replay_seconds(self, times):
        return sum(st.cost for st in self.captured)


def step(op, cost_us, reads=()):
    return types.SimpleNamespace(op=op, cost=cost_us * 1e-6, reads=tuple(reads))


def test_each_kind_costs_what_leaving_it_out_saves_and_the_step_comes_back_whole():
    gate_up, down = [(1 << 30, 50_331_648)], [(1 << 31, 25_165_824)]
    steps = [step("matmul", 15, gate_up), step("gated_delta_net", 9), step("matmul", 8, down),
             step("matmul", 15, gate_up), step("gated_delta_net", 9), step("rope", 5)]
    r = StandIn(steps)
    got = gpu_kernels.knockout_table(r, times=3)
    assert round(got["replay_us"], 6) == 61
    assert got["by_kind"] == {"matmul 50.3 MB": [2, 30.0], "gated_delta_net": [2, 18.0],
                              "matmul 25.2 MB": [1, 8.0], "rope": [1, 5.0]}
    assert list(got["by_kind"])[0] == "matmul 50.3 MB"                 # the most saved first
    assert r.steps == steps and r.captured == steps                      # captured whole again


def test_settings_set_constants_and_refuse_what_is_not_there(monkeypatch):
    import rlx_core.ir.quant as quant

    monkeypatch.setattr(quant, "BENCH_PROBE", 1, raising=False)
    got = common.apply_settings(" rlx_core.ir.quant.BENCH_PROBE = (2, 'x'),")
    assert got == {"rlx_core.ir.quant.BENCH_PROBE": (2, "x")} and quant.BENCH_PROBE == (2, "x")
    with pytest.raises(SystemExit, match="naming a constant that 'rlx_core.ir.quant' has"):
        common.apply_settings("rlx_core.ir.quant.NO_SUCH_NAME=1")
    with pytest.raises(SystemExit, match="cannot import module 'rlx_core.no_such'"):
        common.apply_settings("rlx_core.no_such.X=1")
    with pytest.raises(SystemExit, match="no Python literal"):
        common.apply_settings("rlx_core.ir.quant.BENCH_PROBE=1 << 22")
    assert common.apply_settings("") == {}


def test_gpu_ab_runs_each_configuration_in_turn_and_tables_the_medians(capsys):
    """gpu_ab on a stand-in command whose "decode" time is its environment's: each
    configuration's median, the ratio to the first; a malformed configuration is refused."""
    import gpu_ab

    cmd = [sys.executable, "-c", "import os; print('GPU: stand-in'); "
           "print(f\"rlx decode: {os.environ.get('MS', '2.0')} ms/token\"); "
           "print(f\"rlx q4_k: decode {float(os.environ.get('MS', '2.0')) / 2} ms/token = 4x\"); "
           "print(f\"rlx batch 32: decode {float(os.environ.get('MS', '2.0')) * 2} ms/step\")"]
    configs = ["--config", "base=", "--config", "half=MS=1.0 OTHER=x=y"]
    assert gpu_ab.main([*configs, "--rounds", "2", "--", *cmd]) == 0
    out = capsys.readouterr().out
    assert "GPU: stand-in" in out and out.count("round ") == 4
    assert "| rlx | 2.000 | 1.000 (0.500x) |" in out and "| rlx q4_k | 1.000 | 0.500 (0.500x) |" in out
    assert "| rlx batch 32 | 4.000 | 2.000 (0.500x) |" in out
    assert gpu_ab.parse_config("x=A=1 B=c=d") == ("x", {"A": "1", "B": "c=d"})
    with pytest.raises(SystemExit, match="is no VAR=VALUE"):
        gpu_ab.parse_config("x=A")
    with pytest.raises(SystemExit, match="expected NAME="):
        gpu_ab.parse_config("novalue")
