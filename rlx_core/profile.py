"""CompileProfile: fusion policy, passes, precision and backend choice — frozen, loadable
from strict TOML, with presets and a stable hash usable as a compile-cache key."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import attrs

from .ir.dtype import DType
from .ir.errors import ProfileError
from .ir.lower import FusionPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _policy(v):
    return FusionPolicy(v)


@attrs.frozen
class FusionConfig:
    policy: FusionPolicy = attrs.field(default=FusionPolicy.DIRECT, converter=_policy)
    target: str = "auto"          # "auto": the backend's own pattern set
    assert_clean: bool = False
    skip: object = ()             # True skips fusion; a list skips those pattern groups


@attrs.frozen
class PassConfig:
    dce: bool = True
    constant_folding: bool = True
    cse: bool = True
    verbose: bool = False
    verify_each: bool = False     # verify the graph after every pass (debug mode)


@attrs.frozen
class PrecisionConfig:
    compute: DType = attrs.field(default=DType.F32, converter=DType.parse)
    mixed: bool = True            # norms, softmax and attention accumulate in f32


@attrs.frozen
class BackendConfig:
    name: str = ""                # "" picks the highest-priority available backend
    device: str = ""              # device selector for backends with several devices


@attrs.frozen
class CompileProfile:
    name: str = "default"
    fusion: FusionConfig = FusionConfig()
    passes: PassConfig = PassConfig()
    precision: PrecisionConfig = PrecisionConfig()
    backend: BackendConfig = BackendConfig()

    def to_dict(self) -> dict:
        def conv(inst, a, v):
            if isinstance(v, (FusionPolicy, DType)):
                return v.value
            if isinstance(v, tuple):
                return list(v)
            return v
        return attrs.asdict(self, value_serializer=conv)

    def stable_hash(self) -> str:
        """Of the settings only: the name does not change what compiles (a compile-cache key)."""
        d = self.to_dict()
        d.pop("name")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def text(self) -> str:
        lines = [f"# profile {self.name} (hash {self.stable_hash()})"]
        for section, values in self.to_dict().items():
            if section == "name":
                continue
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        return "\n".join(lines)

    def evolve(self, **sections) -> "CompileProfile":
        """Copy with some section fields changed: evolve(fusion={"policy": "fusable"})."""
        changes = {}
        for section, values in sections.items():
            if section == "name":
                changes["name"] = values
                continue
            changes[section] = attrs.evolve(getattr(self, section), **values)
        return attrs.evolve(self, **changes)

    @staticmethod
    def from_toml_str(text: str, source: str = "<string>") -> "CompileProfile":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ProfileError(f"{source}: not valid TOML: {e}") from None
        return from_dict(data, source)

    @staticmethod
    def from_toml_path(path) -> "CompileProfile":
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"{p}: cannot read profile: {e}") from None
        return CompileProfile.from_toml_str(text, str(p))

    @staticmethod
    def resolve(value=None, default: str = "default", near: str | None = None) -> "CompileProfile":
        """A profile object, a preset name or a *.rlx.toml path; with None, a *.rlx.toml
        beside the weights at `near` if there is one, else the preset `default`."""
        if isinstance(value, CompileProfile):
            return value
        if isinstance(value, str):
            if value.endswith(".toml") or "/" in value or Path(value).is_file():
                return CompileProfile.from_toml_path(value)
            return CompileProfile.preset(value)
        if near:
            folder = Path(near) if Path(near).is_dir() else Path(near).parent
            found = sorted(folder.glob("*.rlx.toml"))
            if found:
                return CompileProfile.from_toml_path(found[0])
        return CompileProfile.preset(default)

    @staticmethod
    def preset(name: str) -> "CompileProfile":
        try:
            return PRESETS[name]
        except KeyError:
            raise ProfileError(f"unknown profile preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


_SECTIONS = {"fusion": FusionConfig, "passes": PassConfig, "precision": PrecisionConfig,
             "backend": BackendConfig}
_ALLOWED = {
    ("fusion", "policy"): [p.value for p in FusionPolicy],
    ("precision", "compute"): ["f32", "f16", "bf16", "f64"],
}


def _check_value(source, section, key, value, default):
    where = f"{source}: [{section}] {key}"
    allowed = _ALLOWED.get((section, key))
    if allowed is not None:
        if value not in allowed:
            raise ProfileError(f"{where} = {value!r}: expected one of {allowed}")
        return value
    if (section, key) == ("fusion", "skip"):
        if isinstance(value, bool):
            return value
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            from .passes.fusion import ALL_GROUPS

            unknown = [x for x in value if x not in ALL_GROUPS]
            if unknown:
                raise ProfileError(f"{where}: unknown pattern groups {unknown}; expected some of "
                                   f"{list(ALL_GROUPS)} or true")
            return tuple(value)
        raise ProfileError(f"{where} = {value!r}: expected true/false or a list of pattern groups")
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ProfileError(f"{where} = {value!r}: expected true or false")
        return value
    if isinstance(default, str) and not isinstance(value, str):
        raise ProfileError(f"{where} = {value!r}: expected a string")
    return value


def from_dict(data: dict, source: str = "<dict>") -> CompileProfile:
    """Strict: an unknown section or key, or a bad value, names the file, key and choices."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a table at top level")
    allowed_top = ["profile", *_SECTIONS]
    base = CompileProfile()
    name = Path(source).name.split(".")[0] if source not in ("<string>", "<dict>") else "custom"
    unknown = [k for k in data if k not in allowed_top]
    if unknown:
        raise ProfileError(f"{source}: unknown section(s) {unknown}; expected {allowed_top}")
    head = data.get("profile", {})
    if not isinstance(head, dict):
        raise ProfileError(f"{source}: [profile] must be a table")
    for k in head:
        if k not in ("name", "preset"):
            raise ProfileError(f"{source}: unknown key [profile] {k!r}; expected ['name', 'preset']")
    if "preset" in head:
        if not isinstance(head["preset"], str) or head["preset"] not in PRESETS:
            raise ProfileError(f"{source}: [profile] preset = {head['preset']!r}: expected one of "
                               f"{sorted(PRESETS)}")
        base = PRESETS[head["preset"]]
    if "name" in head:
        if not isinstance(head["name"], str):
            raise ProfileError(f"{source}: [profile] name must be a string")
        name = head["name"]
    changes = {}
    for section, cls in _SECTIONS.items():
        values = data.get(section, {})
        if not isinstance(values, dict):
            raise ProfileError(f"{source}: [{section}] must be a table")
        fields = {f.name: f.default for f in attrs.fields(cls)}
        checked = {}
        for k, v in values.items():
            if k not in fields:
                raise ProfileError(f"{source}: unknown key [{section}] {k!r}; expected one of "
                                   f"{sorted(fields)}")
            checked[k] = _check_value(source, section, k, v, fields[k])
        changes[section] = checked
    return base.evolve(name=name, **changes)


def _preset(name, policy="direct", compute="f32", **fusion) -> CompileProfile:
    return CompileProfile(name, FusionConfig(policy=policy, **fusion), PassConfig(),
                          PrecisionConfig(compute=compute))


PRESETS = {p.name: p for p in [
    CompileProfile("default"),
    _preset("llama32_prefill"), _preset("llama32_decode"),
    _preset("qwen3_prefill"), _preset("qwen3_decode"),
    _preset("gemma_prefill"), _preset("gemma_decode"),
    _preset("flux2", compute="bf16"),
    _preset("encoder"), _preset("sam_encoder"),
    _preset("fusable", policy="fusable", assert_clean=True),
    _preset("unfused", skip=True),
    CompileProfile("debug", FusionConfig(assert_clean=True), PassConfig(verbose=True, verify_each=True)),
]}
