"""`rlx bisect` / rlx_core.bisect on a tiny random LLaMA (SmolLM2's shape: GQA, tied
embeddings): a backend with one wrong kernel is caught at that kernel's node at every level,
with its provenance and error; backends that agree report nothing; `--pass` names the pass
that changes the outputs."""
from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
from click.testing import CliRunner

import rlx_core
from rlx_core import bisection
from rlx_core.backends.numpy import NumpyBackend, NumpyRunner
from rlx_core.ir.errors import ModelError
from rlx_core.plugins import hookimpl, temporary_plugin
from rlx_core.runtime.model import CausalLM
from tiny_models import LLAMA, llama_tensors, tiny_llama


def wrong_rms_norm(a, out, x, *w):
    """RMSNorm with eps 0.5 instead of the node's."""
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + 0.5)
    out[0][...] = y * w[0] if w else y


def numpy_like(name: str, wrong: dict):
    """A NumPy-subclass backend named `name` whose kernels for the ops in `wrong` are replaced."""
    class Runner(NumpyRunner):
        backend_name = name

        def __init__(self, lir, params, states):
            super().__init__(lir, params, states)
            ops = [n.op for n in lir.graph.nodes]
            self.steps = [(i, view, wrong.get(ops[i], fn), a, ins, out)
                          for i, view, fn, a, ins, out in self.steps]

    class Backend(NumpyBackend):
        priority = -100

        def compile(self, lir, params, states):
            return Runner(lir, params, states)

    Backend.name = name

    class Plugin:
        @hookimpl
        def rlx_register_backends(self, register):
            register(Backend())

    return temporary_plugin(Plugin(), f"test-bisect-{name}")


@pytest.fixture
def broken():
    with numpy_like("broken", {"rms_norm": wrong_rms_norm}):
        yield "broken"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(np.random.default_rng(0))


def test_finds_the_broken_kernel_at_its_node(model, broken):
    report = rlx_core.bisect(model, broken, input="5, 7, 9, 11")
    hir = model.built("logits").graph
    first_norm = next(i for i, n in enumerate(hir.nodes) if n.op == "rms_norm")
    assert report.diverged and report.first.level == "hir"
    d = report.first.divergence
    assert (d.index, d.op) == (first_norm, "rms_norm")
    assert d.where == "layer 0 rms_norm (input_layernorm.weight)"
    assert d.errors.max_rel > 0.1 and not d.errors.ok and d.dtype == "f32"
    assert "gather" in d.inputs[0] and " agrees (rel 0)" in d.inputs[0]       # its input agrees
    assert 'param "model.layers.0.input_layernorm.weight"' in d.inputs[1]
    for r in report.levels:                         # the same kernel at every level
        assert r.divergence is not None and r.divergence.op == "rms_norm", r.summary()
        assert "layer 0" in r.divergence.where
    assert report.levels[-1].executables.ok is False     # the real executables differ too
    text = report.text()
    assert "first divergence at hir" in text and "max abs error" in text and "emitted by: layer 0" in text


def test_a_kernel_the_graph_does_not_use_is_not_blamed(model):
    with numpy_like("wrong-topk", {"topk": lambda a, out, x: out[0].fill(0)}):
        report = rlx_core.bisect(model, "wrong-topk")
    assert not report.diverged and report.first is None
    assert report.text().endswith("no divergence: every value agrees at every level")


def test_backends_that_agree_report_nothing(model):
    from rlx_core.pipeline import available_backends

    if not any(b.name == "numba" and ok for b, ok, _ in available_backends()):
        pytest.skip("the numba backend is not available here")
    report = rlx_core.bisect(model, "numba")
    assert not report.diverged, report.text()
    assert [r.level for r in report.levels] == list(bisection.LEVELS)
    assert all(r.values > 0 and r.worst_rel <= bisection.TOLERANCE[rlx_core.F32] for r in report.levels)


def test_pass_bisect_names_the_pass_that_changes_the_outputs(model, monkeypatch):
    import rlx_core.pipeline as pipeline

    real_cse = pipeline.cse

    def bad_cse(g):
        """cse that also changes the first rms_norm's eps."""
        g = real_cse(g)
        i = next(i for i, n in enumerate(g.nodes) if n.op == "rms_norm")
        n = g.nodes[i]
        nodes = list(g.nodes)
        nodes[i] = attrs.evolve(n, attrs=tuple(sorted({**n.a, "eps": 0.5}.items())))
        return attrs.evolve(g, nodes=tuple(nodes))

    monkeypatch.setattr(pipeline, "cse", bad_cse)
    report = rlx_core.bisect(model, "numpy", pass_name="all")
    assert report.first is not None and report.first.name == "cse"
    assert all(not r.changed for r in report.rows if r.step < report.first.step)
    assert "first pass that changes the outputs: #" in report.text()
    only = rlx_core.bisect(model, "numpy", pass_name="fusion")
    assert only.first is None and [r.name for r in only.rows] == ["fusion"]


def test_bad_arguments_are_errors_naming_them(model):
    with pytest.raises(ModelError, match="pass 'nope': .* runs no such pass; it runs \\['lower'"):
        rlx_core.bisect(model, "numpy", pass_name="nope")
    with pytest.raises(ModelError, match=r"levels: \['ir'\] given; expected some of"):
        bisection.bisect(model, "numpy", levels=("ir",))
    with pytest.raises(ModelError, match="input row 0: token id 999 is out of range"):
        rlx_core.bisect(model, "numpy", input="1 999")
    bare = CausalLM.from_tensors(LLAMA, model.tensors)
    with pytest.raises(ModelError, match="input 'hello': the model has no tokenizer; pass token ids"):
        rlx_core.bisect(bare, "numpy", input="hello")
    with pytest.raises(ModelError, match="model: expected a path, a packaged name or a loaded model"):
        rlx_core.bisect(42, "numpy")


def test_cli_prints_the_first_divergence_and_exits_1(tmp_path, broken):
    from safetensors.numpy import save_file

    from rlx_core.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    save_file(llama_tensors(LLAMA, np.random.default_rng(1)), str(tmp_path / "model.safetensors"))
    r = CliRunner().invoke(main, ["bisect", str(tmp_path), "--backend", broken, "--input", "3,4,5"])
    assert r.exit_code == 1, r.output
    assert "hir    llama_logits" in r.output and "diverges at %" in r.output and "rms_norm" in r.output
    assert "first divergence at hir" in r.output and "emitted by: layer 0 rms_norm" in r.output
    ok = CliRunner().invoke(main, ["bisect", str(tmp_path), "-b", "numpy", "-i", "3,4,5"])
    assert ok.exit_code == 0 and "no divergence" in ok.output, ok.output
    bad = CliRunner().invoke(main, ["bisect", str(tmp_path), "-b", "numpy", "--pass", "nope"])
    assert bad.exit_code == 2 and "error: pass 'nope'" in bad.output, bad.output
    both = CliRunner().invoke(main, ["bisect", str(tmp_path), "-b", "numpy", "--pass", "all", "--ref", "x"])
    assert both.exit_code == 2 and "--ref does not apply with --pass" in both.output, both.output
