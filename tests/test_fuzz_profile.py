"""Fuzzing TOML profiles: random documents, mutations of the shipped files and of every
preset, byte garbage and non-text input. The property: a ProfileError naming the file, or a
profile whose every value is one the pipeline accepts and that round-trips through TOML."""
from __future__ import annotations

import re
import sys
import tracemalloc
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import ProfileError
from rlx_core.ir.lower import FusionPolicy
from rlx_core.passes.fusion import ALL_GROUPS, TARGETS
from rlx_core.profile import PRESETS, CompileProfile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SOURCE = "fuzz.rlx.toml"
PEAK = 8 << 20           # bytes one load may allocate (the documents are under 2 KiB)
_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])
SHIPPED = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.rlx.toml"))


def _check_valid(p: CompileProfile) -> None:
    assert isinstance(p.fusion.policy, FusionPolicy)
    assert p.fusion.target in ("auto", *TARGETS)
    assert p.fusion.skip is True or p.fusion.skip is False or (
        isinstance(p.fusion.skip, tuple) and set(p.fusion.skip) <= set(ALL_GROUPS))
    for v in (p.fusion.assert_clean, p.passes.dce, p.passes.constant_folding, p.passes.cse,
              p.passes.verbose, p.passes.verify_each, p.precision.mixed):
        assert isinstance(v, bool)
    assert p.precision.compute in (DType.F32, DType.F16, DType.BF16, DType.F64)
    assert p.backend.name == "" or re.fullmatch(r"[a-z][a-z0-9_]*", p.backend.name)
    assert isinstance(p.backend.device, str) and isinstance(p.name, str)
    assert CompileProfile.from_toml_str(p.text()).stable_hash() == p.stable_hash()


def _load(text) -> None:
    tracemalloc.start()
    try:
        p = CompileProfile.from_toml_str(text, SOURCE)
    except ProfileError as e:
        assert SOURCE in str(e), e
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK, f"loading took {peak} bytes"
    _check_valid(p)


# ----------------------------------------------------------------------------- TOML values
class _Raw(str):
    """A TOML literal written as is (dates and times)."""


scalars = st.one_of(
    st.booleans(), st.integers(-5, 5), st.integers(-2 ** 63, 2 ** 63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["direct", "fusable", "f32", "bf16", "f8", "numpy", "nonexistent", "", "auto", "generic",
                     "Numpy", "cuda:0", "swiglu", "flux2", "llama32_decode", "nope"]),
    st.text(max_size=6), st.sampled_from(["1979-05-27T07:32:00Z", "1979-05-27", "07:32:00"]).map(_Raw))
values = st.one_of(scalars, st.lists(scalars, max_size=3),
                   st.lists(st.sampled_from(["swiglu", "rms_norm", "elementwise", "nope"]), max_size=3),
                   st.dictionaries(st.sampled_from(["a", "policy"]), scalars, max_size=2))


def _toml_value(v) -> str:
    if isinstance(v, _Raw):                              # a TOML date/time literal
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}"
                             for c in v if not 0xD800 <= ord(c) <= 0xDFFF) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"


def _toml(doc: dict) -> str:
    lines = []
    for section, table in doc.items():
        if not isinstance(table, dict):
            lines.insert(0, f"{section} = {_toml_value(table)}")
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


_SECTION_KEYS = {
    "profile": ["name", "preset"], "fusion": ["policy", "target", "assert_clean", "skip"],
    "passes": ["dce", "constant_folding", "cse", "verbose", "verify_each"],
    "precision": ["compute", "mixed"], "backend": ["name", "device"], "extra": ["x"],
}


@st.composite
def toml_docs(draw):
    doc = {}
    for section in draw(st.lists(st.sampled_from(list(_SECTION_KEYS)), unique=True, max_size=5)):
        keys = draw(st.lists(st.sampled_from(_SECTION_KEYS[section] + ["bogus"]), unique=True, max_size=4))
        doc[section] = {k: draw(values) for k in keys}
    return _toml(doc)


def _valid_texts() -> list:
    return [p.read_text(encoding="utf-8") for p in SHIPPED] + [p.text() for p in PRESETS.values()]


@st.composite
def mutated(draw):
    doc = tomllib.loads(draw(st.sampled_from(_valid_texts())))
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(doc) * 4 + ["extra"]))
        table = doc.setdefault(section, {})
        if not isinstance(table, dict) or not table or draw(st.integers(0, 9)) == 7:
            doc[section] = draw(values)                  # a section replaced by a value
            continue
        key = draw(st.sampled_from(sorted(table)))
        action = draw(st.sampled_from(["replace", "replace", "drop", "rename"]))
        if action == "replace":
            table[key] = draw(values)
        elif action == "drop":
            del table[key]
        else:
            table[key + draw(st.sampled_from(["_", "s", "X"]))] = table.pop(key)
    return _toml(doc)


# ----------------------------------------------------------------------------- properties
@_SETTINGS
@given(text=toml_docs())
def test_random_documents_give_a_valid_profile_or_a_profile_error(text):
    _load(text)


@_SETTINGS
@given(text=mutated())
def test_mutated_profiles_and_presets_give_a_valid_profile_or_a_profile_error(text):
    _load(text)


@_SETTINGS
@given(text=st.text(alphabet=st.sampled_from(list("[]=\"'. \n#abcdefgpuslionrt0123456789-_{},tf")),
                    max_size=60) | st.text(max_size=40))
def test_random_text_gives_only_profile_errors(text):
    _load(text)


@_SETTINGS
@given(data=st.data())
def test_byte_garbage_in_a_profile_file(data, tmp_path_factory):
    raw = bytearray(data.draw(st.sampled_from(SHIPPED)).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i:i + 1] = data.draw(st.binary(min_size=0, max_size=3))
    path = tmp_path_factory.mktemp("prof") / SOURCE
    path.write_bytes(bytes(raw))
    try:
        p = CompileProfile.from_toml_path(path)
    except ProfileError as e:
        assert SOURCE in str(e), e
        return
    _check_valid(p)


@_SETTINGS
@given(value=st.one_of(st.binary(max_size=20), st.integers(), st.none(), st.floats(),
                       st.lists(st.text(max_size=3), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                                  st.text(max_size=2))))
def test_non_text_input_is_a_profile_error(value):
    try:
        CompileProfile.from_toml_str(value, SOURCE)
    except ProfileError as e:
        assert SOURCE in str(e)
    else:
        raise AssertionError(f"accepted {value!r}")
