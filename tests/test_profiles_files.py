"""Every shipped profiles/*.rlx.toml loads strictly, has the intended values, explains its
choices in comments, and compiles a transformer block that matches numpy."""
from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from rlx_core.ir.dtype import DType
from rlx_core.ir.lower import FusionPolicy
from rlx_core.profile import PRESETS, CompileProfile

PROFILES = Path(__file__).resolve().parents[1] / "profiles"

# name -> (preset, policy, skip, compute)
EXPECTED = {
    "llama32": ("llama32_prefill", "direct", (), "f32"),
    "qwen3": ("qwen3_prefill", "direct", (), "f32"),
    "gemma": ("gemma_prefill", "direct", ("swiglu",), "f32"),
    "bert": ("encoder", "direct", ("rms_norm", "residual_rms_norm"), "f32"),
    "flux2": ("flux2", "direct", (), "bf16"),
}
# settings a file deliberately changes from its preset (saying so above the key)
OVERRIDES = {"flux2": {"compute": "bf16"}}
FILES = sorted(PROFILES.glob("*.toml"))


def test_the_expected_profile_files_ship():
    assert sorted(p.name for p in FILES) == sorted(f"{n}.rlx.toml" for n in EXPECTED)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_profile_file_values(path):
    prof = CompileProfile.from_toml_path(path)
    name = path.name.removesuffix(".rlx.toml")
    preset, policy, skip, compute = EXPECTED[name]
    assert prof.name == name
    assert prof.fusion.policy is FusionPolicy(policy)
    assert prof.fusion.target == "auto"
    assert prof.fusion.assert_clean is False
    assert tuple(prof.fusion.skip) == skip
    assert (prof.passes.dce, prof.passes.constant_folding, prof.passes.cse) == (True, True, True)
    assert (prof.passes.verbose, prof.passes.verify_each) == (False, False)
    assert prof.precision.compute is DType.parse(compute)
    assert prof.precision.mixed is True
    assert (prof.backend.name, prof.backend.device) == ("", "")
    # the file restates its preset's settings except where it says it overrides them
    base = PRESETS[preset]
    overridden = OVERRIDES.get(name, {})
    assert prof.precision == attrs.evolve(base.precision, **overridden)
    assert prof.fusion.policy == base.fusion.policy
    for key in overridden:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{key} ="))
        assert any("Overrides the" in line for line in lines[max(0, i - 3):i]), f"say why {key} differs"
    assert len(prof.stable_hash()) == 16


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_profile_file_explains_its_choices(path):
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0].startswith("# "), "start with a comment saying what the profile is for"
    sections = [i for i, line in enumerate(lines) if line.startswith("[")]
    assert [lines[i] for i in sections] == ["[profile]", "[fusion]", "[passes]", "[precision]",
                                            "[backend]"]
    comments = [line for line in lines if line.lstrip().startswith("#")]
    assert len(comments) >= 8
    # the deliberate choices each carry a comment right above them
    for key in ("policy =", "compute =", "skip =", "mixed ="):
        i = next(i for i, line in enumerate(lines) if line.startswith(key))
        assert lines[i - 1].startswith("#"), f"{path.name}: explain `{key}`"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_profile_file_compiles_a_transformer_block(path):
    from rlx_core.cli import DEMO_TOL, demo_data, demo_graph, demo_reference
    from rlx_core.pipeline import CompilePipeline

    prof = CompileProfile.from_toml_path(path)
    inputs, params = demo_data(seq=7, seed=1)
    exe = CompilePipeline(prof).compile(demo_graph(), params)
    out = exe.run(inputs)["out"]
    diff = np.max(np.abs(out.astype(np.float64) - demo_reference(inputs, params)))
    assert diff <= DEMO_TOL[prof.precision.compute.value]
