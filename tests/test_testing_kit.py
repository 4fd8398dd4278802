"""The conformance kit (rlx_core.testing) as a third party uses it: a backend package written
here, found through its entry point on a temporary path, runs the op parity suite in a pytest
of its own (`--rlx-backend`, no project conftest) and passes for the op it claims, or fails
with a report naming the op, dtype and error when its kernel is wrong; the recipe checks
fail on recipes that break them."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from rlx_core.ir.errors import ModelError
from rlx_core.testing import recipes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]

BACKEND = '''
"""A third-party backend: the NumPy backend's housekeeping, its own softmax, f32/f64 only."""
import numpy as np

from rlx_core.backends.base import Runner
from rlx_core.backends.numpy import NumpyBackend
from rlx_core.ir.composites import PRIMITIVES
from rlx_core.ir.dtype import F32, F64
from rlx_core.plugins import hookimpl

AXIS_SHIFT = {shift}          # 1: the softmax of the next axis, a deliberately wrong kernel


class TinyRunner(Runner):
    def __init__(self, graph, params):
        self.graph, self.params = graph, params

    def run(self, inputs):
        vals = {{}}
        for i, n in enumerate(self.graph.nodes):
            if n.op == "input":
                vals[i] = inputs[n.name]
            elif n.op == "param":
                vals[i] = self.params[n.name]
            else:                                         # softmax, the one op it claims
                x = vals[n.inputs[0][0]].astype(np.float64)
                axis = (n.a["axis"] + AXIS_SHIFT) % x.ndim
                m = x.max(axis, keepdims=True)
                e = np.exp(x - np.where(np.isfinite(m), m, 0))   # a row of -inf gives zeros
                s = e.sum(axis, keepdims=True)
                vals[i] = (e / np.where(s == 0, 1, s)).astype(n.outs[0].dtype.np)
        return {{name: vals[r[0]] for name, r in self.graph.outputs}}


class TinyBackend(NumpyBackend):
    name = "tinykit"
    priority = -50
    dtypes = frozenset({{F32, F64}})

    def supported_ops(self):           # its softmax, and the primitives every backend needs
        return set(PRIMITIVES) | {{"input", "param", "state", "constant", "softmax"}}

    def compile(self, lir, params, states):
        if {{n.op for n in lir.graph.nodes}} <= {{"input", "param", "softmax"}}:
            return TinyRunner(lir.graph, params)
        return super().compile(lir, params, states)     # the primitives: NumPy's kernels


@hookimpl
def rlx_register_backends(register):
    register(TinyBackend())
'''
ONE_FILE = '''
from rlx_core.testing.ops_suite import *  # noqa: F401,F403

RLX_BACKENDS = ("tinykit",)
'''


def dist_info(site, name: str, entry_points: str) -> None:
    """What pip leaves for an installed distribution: METADATA and its entry points."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


def kit_entry_points() -> str:
    """rlx-core's pytest11 entry points as pyproject.toml declares them (what pip installs)."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    return "[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())


def third_party(tmp_path, shift: int):
    """A project folder with the backend package installed on PYTHONPATH the way pip would:
    the module and a dist-info folder whose entry point is in the `rlx` group (and rlx-core's
    pytest11 entry point, which an editable checkout may not have installed yet)."""
    site = tmp_path / "site"
    (site / "rlx_backend_tinykit").mkdir(parents=True)
    (site / "rlx_backend_tinykit" / "__init__.py").write_text(BACKEND.format(shift=shift))
    dist_info(site, "rlx-backend-tinykit", "[rlx]\ntinykit = rlx_backend_tinykit\n")
    dist_info(site, "rlx-core-kit", kit_entry_points())
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_tinykit.py").write_text(ONE_FILE)
    return site


def run_pytest(tmp_path, site, *args, plugins: str = "tinykit") -> subprocess.CompletedProcess:
    """pytest in the third party's folder: its own ini (so not this project's rootdir and
    conftest), only `plugins` among the rlx entry points; the kit through its entry point."""
    env = dict(os.environ, PYTHONPATH=str(site), RLX_PLUGINS=plugins, RLX_TEST_SEED="7")
    cmd = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--confcutdir", str(tmp_path),
           "-p", "no:cacheprovider", "-q", "--tb=short", "-rfs", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_out_of_tree_backend_passes_for_the_ops_it_claims(tmp_path):
    """The one-file test module of a backend author: the suite on their backend; softmax runs
    in the dtypes it declares, the rest is skipped with the reason."""
    site = third_party(tmp_path, shift=0)
    r = run_pytest(tmp_path, site, "-p", "rlx_core.testing", "tests/test_tinykit.py", "-k", "softmax")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert " passed" in out and " failed" not in out, out
    assert "does not declare dtype(s) ['f16'] (Backend.dtypes)" in out, out
    # nothing is skipped for a missing op: what is not softmax runs as composites of the
    # primitives a backend must declare (it would not register otherwise)
    assert "does not implement op(s)" not in out, out


def test_wrong_kernel_fails_with_a_readable_report(tmp_path):
    """`pytest --rlx-backend=NAME --pyargs rlx_core.testing`: no test file at all."""
    site = third_party(tmp_path, shift=1)
    r = run_pytest(tmp_path, site, "--rlx-backend=tinykit", "--pyargs", "rlx_core.testing",
                   "-k", "test_softmax")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert failed and all("test_softmax" in line and "tinykit" in line for line in failed), out
    assert any("f32" in line for line in failed) and any("f64" in line for line in failed), out
    assert "op softmax {'axis': " in out and "on backend 'tinykit'" in out, out
    assert "output out0 (f32)" in out and "Mismatched elements" in out, out


def test_unknown_backend_is_a_usage_error(tmp_path):
    site = third_party(tmp_path, shift=0)
    r = run_pytest(tmp_path, site, "--rlx-backend=nope", "--pyargs", "rlx_core.testing")
    out = r.stdout + r.stderr
    assert r.returncode == 4, out
    assert "--rlx-backend=nope: unknown backend 'nope'" in out and "tinykit" in out, out


# ----------------------------------------------------------------------------- recipe checks
def llama_with(**flows):
    """The llama recipe with the flow of some modes changed: mode -> fn(flow) -> flow."""
    from rlx_core.runtime.model import find_recipe

    base = type(find_recipe("llama"))

    class Changed(base):
        def flow(self, cfg, mode, taps=False):
            f = super().flow(cfg, mode, taps)
            return flows[mode](f) if mode in flows else f

    return Changed()


def test_decode_check_catches_a_decode_graph_that_differs(rng):
    recipe = llama_with(decode=lambda f: f.custom(lambda emit, v, ctx: v * 1.5))
    with pytest.raises(AssertionError, match="llama: prefill of 3 tokens \\+ decode steps against recompute"):
        recipes.check_decode_equals_recompute(recipe, recipes.tiny_checkpoint(recipe, rng), rng)


def test_batch_check_catches_rows_that_see_each_other(rng):
    mix = llama_with(logits=lambda f: f.custom(lambda emit, v, ctx: v + emit.mean(v, (0,), keepdims=True)))
    with pytest.raises(AssertionError, match="row 0 .* of a padded batch against alone"):
        recipes.check_batch_equals_rows(mix, recipes.tiny_checkpoint(mix, rng), rng)


def test_fused_check_catches_a_wrong_fused_kernel(rng, monkeypatch):
    from rlx_core.ir import numpy_kernels
    from rlx_core.runtime.model import find_recipe

    def wrong_swiglu(a, out, g, u):
        out[0][...] = g * u                                    # no silu

    monkeypatch.setitem(numpy_kernels.KERNELS, "fused_swiglu", wrong_swiglu)
    recipe = find_recipe("llama")
    expected = r"profile 'llama32_prefill' against 'llama32_prefill\+composed'"
    with pytest.raises(AssertionError, match=expected):
        recipes.check_fused_equals_composed(recipe, recipes.tiny_checkpoint(recipe, rng), rng)


def test_recipe_without_a_tiny_model_is_skipped_with_the_reason():
    from rlx_core.plugins import hookimpl, temporary_plugin

    class Bare:
        name, model_types = "bare", ("bare_type",)

        def build(self, ckpt, **kw):
            raise AssertionError("not built")

    class Plugin:
        @hookimpl
        def rlx_register_recipes(self, register):
            register(Bare())

    with temporary_plugin(Plugin(), "test-bare-recipe"):
        [param] = recipes.recipe_params(["bare"])
        assert param.marks[0].kwargs["reason"] == "recipe 'bare' provides no tiny_config / tiny_tensors()"
        with pytest.raises(ModelError, match="recipe 'bare' provides no tiny_config"):
            recipes.check_recipe_option("bare_type")
    with pytest.raises(ModelError, match="no recipe named 'nope'; recipes: .*'llama'"):
        recipes.check_recipe_option("nope")


def test_tiny_models_fit_their_recipes(rng):
    """Every registered recipe with a tiny model builds it from its own tensors exactly (no
    missing, unexpected or mis-shaped tensor)."""
    built = []
    for name, r in recipes.all_recipes().items():
        if recipes.why_untestable(r):
            continue
        model = recipes.build(r, recipes.tiny_checkpoint(r, rng))
        out = recipes.outputs(model, *recipes.padded(model, recipes.sample_rows(model, rng, (4,))))
        assert all(np.isfinite(v).all() for v in out.values()), name
        built.append(name)
    assert {"llama", "qwen3", "gemma2", "gemma3", "bert", "nomic_bert"} <= set(built), built
    assert {"flux", "flux2"} <= set(built) or not {"flux", "flux2"} & set(recipes.all_recipes()), built


def test_rlx_recipe_runs_a_recipes_checks_and_names_the_seed(tmp_path):
    site = third_party(tmp_path, shift=0)
    r = run_pytest(tmp_path, site, "--rlx-recipe=llama", "--pyargs", "rlx_core.testing", "-vv",
                   plugins="tinykit,llama")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "rlx test seed: 7 (set RLX_TEST_SEED=7 to replay)" in out, out
    assert "3 passed" in out and "test_decode_with_cache_equals_recompute[llama] PASSED" in out, out


def test_greedy_agreement_allows_a_near_tie_and_nothing_else():
    """assert_greedy_agrees: equal rows pass; a first difference passes only where the
    reference's logits put the chosen token within tol of its own (after it, anything goes)."""
    from rlx_core.testing.parity import assert_greedy_agrees

    seen = []

    def logits(prefix):
        seen.append(prefix.tolist())
        return np.array([0.0, 1.0, 1.0 - 1e-5, -3.0])      # 1 the best, 2 a near tie, 0 far behind
    want = np.array([[3, 3, 1, 1]])
    assert_greedy_agrees(want, want, logits, 1e-4)
    assert seen == []
    assert_greedy_agrees(np.array([[3, 3, 2, 0]]), want, logits, 1e-4)
    assert seen == [[[3, 3]]]
    with pytest.raises(AssertionError, match=r"row 0 position 2: token 0, the reference's 1 is ahead by 1"):
        assert_greedy_agrees(np.array([[3, 3, 0, 1]]), want, logits, 1e-4)
    with pytest.raises(AssertionError, match="token rows"):
        assert_greedy_agrees(np.array([[3, 3, 1]]), want, logits, 1e-4)
