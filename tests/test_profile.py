"""CompileProfile: presets, strict TOML loading with errors naming file, key and choices,
and a stable hash."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from rlx_core.ir.dtype import BF16, F16, F32
from rlx_core.ir.errors import BackendError, ProfileError
from rlx_core.ir.lower import FusionPolicy
from rlx_core.passes.fusion import TARGETS
from rlx_core.profile import PRESET_TABLE, PRESETS, CompileProfile

# upstream's presets (rlx-flow/src/profile.rs) -> (policy, skip); all target auto, no
# assert_clean, dce + constant folding on, verbose off, f32
UPSTREAM = {
    "llama32_prefill": ("direct", ()), "llama32_decode": ("fusable", ()),
    "qwen35_prefill": ("direct", ()), "qwen35_decode": ("fusable", ()),
    "qwen3_prefill": ("direct", ()), "qwen3_decode": ("fusable", ()),
    "gemma_prefill": ("direct", ()), "gemma_decode": ("fusable", ()),
    "encoder": ("direct", ()), "flux2": ("direct", ()), "sam_encoder": ("direct", ()),
    "sam2": ("direct", ()), "sam3": ("direct", ()),
    "sam2_memory_attention": ("direct", True), "llada2_diffusion": ("direct", True),
}
REQUIRED_PRESETS = list(UPSTREAM)

FULL = """
[profile]
name = "mine"
preset = "llama32_decode"

[fusion]
policy = "fusable"
target = "generic"
assert_clean = true
skip = ["swiglu", "elementwise"]

[passes]
dce = true
constant_folding = false
cse = true
verbose = false
verify_each = true

[precision]
compute = "bf16"
mixed = false

[backend]
name = "numpy"
device = "0"
"""


@pytest.mark.parametrize("name", REQUIRED_PRESETS + ["default", "fusable", "unfused", "debug"])
def test_presets_exist(name):
    p = CompileProfile.preset(name)
    assert isinstance(p, CompileProfile) and p.name == name
    assert PRESETS[name] is p


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ProfileError, match=r"'nope'.*llama32_prefill"):
        CompileProfile.preset("nope")


def test_preset_flavours():
    assert CompileProfile.preset("fusable").fusion.policy is FusionPolicy.FUSABLE
    assert CompileProfile.preset("fusable").fusion.assert_clean
    assert CompileProfile.preset("unfused").fusion.skip is True
    assert CompileProfile.preset("debug").passes.verify_each


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_presets_have_upstreams_settings(name):
    p = getattr(CompileProfile, name)()
    assert p is CompileProfile.preset(name) and p.name == name
    policy, skip = UPSTREAM[name]
    assert (p.fusion.policy, p.fusion.target, p.fusion.assert_clean, p.fusion.skip) == \
        (FusionPolicy(policy), "auto", False, skip)
    assert (p.passes.dce, p.passes.constant_folding, p.passes.verbose) == (True, True, False)
    assert (p.passes.cse, p.passes.verify_each) == (True, False)        # ours, at their defaults
    assert p.precision.compute is F32 and p.backend == CompileProfile().backend


def test_one_table_defines_presets_and_classmethods():
    assert list(PRESETS) == list(PRESET_TABLE)
    for name in PRESET_TABLE:
        method = getattr(CompileProfile, name)
        assert method() is PRESETS[name] and method.__name__ == name and method.__doc__
        assert CompileProfile().evolve(name=name) is not method()          # shared, frozen
    # same settings, different names: the cache key ignores the name
    assert CompileProfile.qwen3_decode().stable_hash() == CompileProfile.llama32_decode().stable_hash()
    assert CompileProfile.llama32_decode().stable_hash() != CompileProfile.llama32_prefill().stable_hash()


@pytest.mark.parametrize("name", list(PRESET_TABLE))
def test_every_preset_round_trips_through_toml(name):
    p = CompileProfile.preset(name)
    back = CompileProfile.from_toml_str(p.text())
    assert back.stable_hash() == p.stable_hash()
    via = CompileProfile.from_toml_str(f'[profile]\npreset = "{name}"\nname = "{name}"\n')
    assert via == p


def test_from_toml_str_reads_every_field():
    p = CompileProfile.from_toml_str(FULL)
    assert p.name == "mine"
    assert p.fusion.policy is FusionPolicy.FUSABLE and p.fusion.target == "generic"
    assert p.fusion.assert_clean is True and p.fusion.skip == ("swiglu", "elementwise")
    assert (p.passes.dce, p.passes.constant_folding, p.passes.cse, p.passes.verbose,
            p.passes.verify_each) == (True, False, True, False, True)
    assert p.precision.compute is BF16 and p.precision.mixed is False
    assert (p.backend.name, p.backend.device) == ("numpy", "0")


def test_from_toml_starts_from_the_preset():
    p = CompileProfile.from_toml_str('[profile]\npreset = "debug"\n[fusion]\npolicy = "fusable"\n')
    assert p.passes.verify_each and p.fusion.assert_clean and p.fusion.policy is FusionPolicy.FUSABLE
    p = CompileProfile.from_toml_str('[profile]\npreset = "llada2_diffusion"\n[precision]\ncompute = "bf16"\n')
    assert p.fusion.skip is True and p.precision.compute is BF16
    assert CompileProfile.from_toml_str("").fusion == CompileProfile().fusion
    assert CompileProfile.from_toml_str('[fusion]\nskip = true').fusion.skip is True


def test_from_toml_path(tmp_path):
    f = tmp_path / "decode.rlx.toml"
    f.write_text('[precision]\ncompute = "f16"\n')
    p = CompileProfile.from_toml_path(f)
    assert p.name == "decode" and p.precision.compute is F16
    with pytest.raises(ProfileError, match="missing.rlx.toml"):
        CompileProfile.from_toml_path(tmp_path / "missing.rlx.toml")
    bad = tmp_path / "bad.rlx.toml"
    bad.write_text("[fusion]\npolicy = 'sideways'\n")
    with pytest.raises(ProfileError, match=r"bad\.rlx\.toml.*policy.*sideways.*direct.*fusable"):
        CompileProfile.from_toml_path(bad)
    binary = tmp_path / "bin.rlx.toml"
    binary.write_bytes(b"\xff\xfe\x00[fusion")
    with pytest.raises(ProfileError, match="bin.rlx.toml"):
        CompileProfile.from_toml_path(binary)


def test_hash_is_stable_and_tracks_content(tmp_path):
    a = CompileProfile.from_toml_str(FULL)
    b = CompileProfile.from_toml_str(FULL)
    assert a.stable_hash() == b.stable_hash() and len(a.stable_hash()) == 16
    (tmp_path / "one.rlx.toml").write_text(FULL.replace('name = "mine"\n', ""))
    (tmp_path / "two.rlx.toml").write_text(FULL.replace('name = "mine"\n', ""))
    one, two = (CompileProfile.from_toml_path(tmp_path / f"{n}.rlx.toml") for n in ("one", "two"))
    assert one.name != two.name and one.stable_hash() == two.stable_hash()   # same settings
    changes = [FULL.replace("fusable", "direct"), FULL.replace('"bf16"', '"f16"'),
               FULL.replace("verify_each = true", "verify_each = false"),
               FULL.replace('"swiglu", ', ""), FULL.replace('name = "numpy"', 'name = "cuda"'),
               FULL.replace('device = "0"', 'device = "1"')]
    hashes = {CompileProfile.from_toml_str(t).stable_hash() for t in changes} | {a.stable_hash()}
    assert len(hashes) == len(changes) + 1
    assert CompileProfile().stable_hash() != CompileProfile.preset("fusable").stable_hash()
    # ... and the same in another process (no Python hash randomization inside)
    code = ("from rlx_core.profile import CompileProfile as C; import sys; "
            "print(C.from_toml_str(sys.stdin.read()).stable_hash())")
    out = subprocess.run([sys.executable, "-c", code], input=FULL, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True).stdout.strip()
    assert out == a.stable_hash()


def test_text_round_trips_through_toml():
    for p in [CompileProfile.from_toml_str(FULL)] + [PRESETS[n] for n in REQUIRED_PRESETS + ["unfused"]]:
        text = p.text()
        assert p.stable_hash() in text
        back = CompileProfile.from_toml_str(text)
        assert back.stable_hash() == p.stable_hash(), text


@pytest.mark.parametrize("text,pattern", [
    ("[fuson]\npolicy = 'direct'", r"prof\.rlx\.toml.*unknown section.*'fuson'.*fusion"),
    ("[fusion]\npolcy = 'direct'",
     r"prof\.rlx\.toml.*\[fusion\] 'polcy'.*assert_clean.*policy.*skip.*target"),
    ("[fusion]\npolicy = 'sideways'",
     r"prof\.rlx\.toml.*\[fusion\] policy.*'sideways'.*\['direct', 'fusable'\]"),
    ("[fusion]\npolicy = 3", r"prof\.rlx\.toml.*\[fusion\] policy.*3.*\['direct', 'fusable'\]"),
    ("[precision]\ncompute = 'f8'", r"prof\.rlx\.toml.*\[precision\] compute.*'f8'.*f32.*f16.*bf16"),
    ("[fusion]\nassert_clean = 'yes'", r"prof\.rlx\.toml.*\[fusion\] assert_clean.*'yes'.*true or false"),
    ("[passes]\ndce = 1", r"prof\.rlx\.toml.*\[passes\] dce.*true or false"),
    ("[fusion]\nskip = ['swigloo']", r"prof\.rlx\.toml.*\[fusion\] skip.*swigloo.*rms_norm"),
    ("[fusion]\nskip = 'swiglu'", r"prof\.rlx\.toml.*\[fusion\] skip.*pattern groups"),
    ("[fusion]\nskip = [1, 2]", r"prof\.rlx\.toml.*\[fusion\] skip"),
    ("[backend]\nname = 5", r"prof\.rlx\.toml.*\[backend\] name.*string"),
    ("[fusion]\ntarget = []", r"prof\.rlx\.toml.*\[fusion\] target = \[\].*'auto'.*'generic'"),
    ("[fusion]\ntarget = 'nonexistent'",
     r"prof\.rlx\.toml.*\[fusion\] target = 'nonexistent'.*expected one of \['auto', 'generic'"),
    ("[fusion]\ntarget = ''", r"prof\.rlx\.toml.*\[fusion\] target = ''.*'auto'.*'numpy'"),
    ("[backend]\nname = 'Not a backend!'", r"prof\.rlx\.toml.*\[backend\] name = 'Not a backend!'.*"
     r"lowercase letters, digits and _"),
    ("[backend]\ndevice = 0", r"prof\.rlx\.toml.*\[backend\] device.*string"),
    ("[profile]\npreset = 'nope'", r"prof\.rlx\.toml.*preset.*'nope'.*llama32_prefill"),
    ("[profile]\npreset = ['a']", r"prof\.rlx\.toml.*preset.*llama32_prefill"),
    ("[profile]\ncolour = 'red'", r"prof\.rlx\.toml.*\[profile\] 'colour'.*name.*preset"),
    ("[profile]\nname = 1", r"prof\.rlx\.toml.*\[profile\] name"),
    ("fusion = 1", r"prof\.rlx\.toml.*\[fusion\] must be a table"),
    ("profile = 'x'", r"prof\.rlx\.toml.*\[profile\] must be a table"),
    ("[fusion\npolicy = 'direct'", r"prof\.rlx\.toml.*not valid TOML"),
])
def test_errors_name_file_key_and_choices(text, pattern):
    with pytest.raises(ProfileError, match=pattern):
        CompileProfile.from_toml_str(text, "profiles/prof.rlx.toml")


def test_every_fusion_target_is_accepted():
    for target in ["auto", *TARGETS]:
        assert CompileProfile.from_toml_str(f'[fusion]\ntarget = "{target}"').fusion.target == target


def test_an_unknown_backend_name_fails_where_the_backend_is_resolved():
    from rlx_core.pipeline import CompilePipeline
    from rlx_core.plugins.manager import registry

    p = CompileProfile.from_toml_str('[backend]\nname = "nonexistent"', "gpu.rlx.toml")
    assert p.backend.name == "nonexistent"      # the profile cannot know what is installed
    installed = ".*".join(map(re.escape, sorted(registry().backends)))
    with pytest.raises(BackendError, match=rf"unknown backend 'nonexistent'; installed: .*{installed}"):
        CompilePipeline(p)


@pytest.mark.parametrize("value", [b'[fusion]\npolicy = "direct"', None, 5, ["[fusion]"], bytearray(b"")])
def test_from_toml_str_takes_only_text(value):
    with pytest.raises(ProfileError, match=rf"p\.rlx\.toml: profile TOML must be a str, got {type(value).__name__}"):
        CompileProfile.from_toml_str(value, "p.rlx.toml")


def test_preset_and_resolve_reject_other_types(tmp_path):
    for bad in (["llama32_prefill"], None, 3, {"a": 1}):
        with pytest.raises(ProfileError, match="unknown profile preset"):
            CompileProfile.preset(bad)
    for bad in (3, 2.5, ["llama32_prefill"], b"fusable"):
        with pytest.raises(ProfileError, match="preset name or a"):
            CompileProfile.resolve(bad)
    f = tmp_path / "mine.rlx.toml"
    f.write_text('[profile]\npreset = "llama32_decode"\n')
    assert CompileProfile.resolve(f) == CompileProfile.llama32_decode().evolve(name="mine")


def test_profile_is_frozen():
    import attrs

    p = CompileProfile()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.name = "x"
    assert p.evolve(precision={"compute": "f16"}).precision.compute is F16
    assert p.precision.compute is F32
