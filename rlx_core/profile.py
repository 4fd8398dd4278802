"""CompileProfile: fusion policy, passes, precision and backend choice — frozen, loadable
from strict TOML, with presets and a stable hash usable as a compile-cache key."""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Union

import attrs

from .ir.dtype import DType
from .ir.errors import ProfileError
from .ir.lower import FusionPolicy
from .passes.fusion import ALL_GROUPS, TARGETS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _policy(v):
    return FusionPolicy(v)


@attrs.frozen
class FusionConfig:
    policy: FusionPolicy = attrs.field(default=FusionPolicy.DIRECT, converter=_policy)
    target: str = "auto"          # "auto": the backend's own pattern set, else a TARGETS key
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
    # how a quantized checkpoint's matmul weights are held: "packed" (as the file stores them,
    # read by dequant_matmul) or dequantized at load to f32/f16/bf16; float checkpoints ignore it
    weights: str = "packed"
    # the x of a packed matmul: "f32" as computed, or "int8" rounded through int8 blocks of 32
    # first (llama.cpp's q8 activations: CPU kernels and GPU decode GEMVs then multiply
    # integers; logits move ~1e-2)
    activations: str = "f32"


@attrs.frozen
class BackendConfig:
    name: str = ""                # "" picks the highest-priority available backend; checked
                                  # against the installed ones where the backend is resolved
    device: str = ""              # device selector for backends with several devices
    threads: int = 0              # worker threads of a CPU backend that has them (0: its default)
    # "bf16" lets a backend multiply large matmuls in bf16 with f32 sums where it has such a
    # kernel (numba: packed prefill matmuls in AMX tiles); "blas" keeps f32 BLAS where "f32"
    # would use another kernel of f32 accuracy (numba: AMX tiles of exact bf16 parts);
    # backends without such kernels treat both as "f32"
    matmul: str = "f32"


@attrs.frozen
class ParallelConfig:
    tensor: int = 1               # tensor-parallel ranks (passes/shard.py); RLX_TP overrides it
                                  # where ranks are launched (rlx_core.runtime.tp)


@attrs.frozen
class RuntimeConfig:
    # a prompt whose part left to compute is longer is prefilled in chunks of this many
    # tokens, one per scheduler round between the running batch's decode steps (0: never)
    prefill_chunk: int = 512


@attrs.frozen
class CompileProfile:
    name: str = "default"
    fusion: FusionConfig = FusionConfig()
    passes: PassConfig = PassConfig()
    precision: PrecisionConfig = PrecisionConfig()
    backend: BackendConfig = BackendConfig()
    parallel: ParallelConfig = ParallelConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    def to_dict(self) -> dict:
        def conv(inst, a, v):
            if isinstance(v, (FusionPolicy, DType)):
                return v.value
            if isinstance(v, tuple):
                return list(v)
            return v
        return attrs.asdict(self, value_serializer=conv)

    def stable_hash(self) -> str:
        """Of the settings that change what compiles (a compile-cache key): not the name, nor
        how the runtime schedules the compiled graphs."""
        d = self.to_dict()
        d.pop("name")
        d.pop("runtime")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def text(self) -> str:
        lines = [f"# profile {self.name} (hash {self.stable_hash()})"]
        for section, values in self.to_dict().items():
            if section == "name":
                continue
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        return "\n".join(lines)

    def evolve(self, **sections: Any) -> "CompileProfile":
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
        if not isinstance(text, str):
            raise ProfileError(f"{source}: profile TOML must be a str, got {type(text).__name__} "
                               "(decode bytes first, or use from_toml_path)")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ProfileError(f"{source}: not valid TOML: {e}") from None
        return from_dict(data, source)

    @staticmethod
    def from_toml_path(path: str | os.PathLike[str]) -> "CompileProfile":
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"{p}: cannot read profile: {e}") from None
        return CompileProfile.from_toml_str(text, str(p))

    @staticmethod
    def resolve(value: "ProfileLike" = None, default: str = "default",
                near: str | None = None) -> "CompileProfile":
        """A profile object, a preset name or a *.rlx.toml path; with None, a *.rlx.toml
        beside the weights at `near` if there is one, else the preset `default`."""
        if isinstance(value, CompileProfile):
            return value
        if isinstance(value, os.PathLike):
            return CompileProfile.from_toml_path(value)
        if isinstance(value, str):
            if value.endswith(".toml") or "/" in value or Path(value).is_file():
                return CompileProfile.from_toml_path(value)
            return CompileProfile.preset(value)
        if value is not None:
            raise ProfileError(f"profile must be a CompileProfile, a preset name or a *.rlx.toml path, "
                               f"got {type(value).__name__}")
        if near:
            folder = Path(near) if Path(near).is_dir() else Path(near).parent
            found = sorted(folder.glob("*.rlx.toml"))
            if found:
                return CompileProfile.from_toml_path(found[0])
        return CompileProfile.preset(default)

    @staticmethod
    def preset(name: str) -> "CompileProfile":
        if not isinstance(name, str) or name not in PRESETS:
            raise ProfileError(f"unknown profile preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
        return PRESETS[name]


# what `profile=` takes everywhere (CompileProfile.resolve): a profile, a preset name, a *.rlx.toml
# path, or None for the default (a *.rlx.toml beside the weights, else the caller's preset)
ProfileLike = Union[CompileProfile, str, "os.PathLike[str]", None]

_SECTIONS = {"fusion": FusionConfig, "passes": PassConfig, "precision": PrecisionConfig,
             "backend": BackendConfig, "parallel": ParallelConfig, "runtime": RuntimeConfig}
_ALLOWED = {
    ("fusion", "policy"): [p.value for p in FusionPolicy],
    ("fusion", "target"): ["auto", *TARGETS],
    ("precision", "compute"): ["f32", "f16", "bf16", "f64"],
    ("precision", "weights"): ["packed", "f32", "f16", "bf16"],
    ("precision", "activations"): ["f32", "int8"],
    ("backend", "matmul"): ["f32", "bf16", "blas"],
}
# The profile sits below the plugin registry, so it checks a backend name's form only; the
# point that resolves the backend (pipeline.select_backend) names the installed ones.
_BACKEND_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _check_value(source, section, key, value, default):
    where = f"{source}: [{section}] {key}"
    allowed = _ALLOWED.get((section, key))
    if allowed is not None:
        if not isinstance(value, str) or value not in allowed:
            raise ProfileError(f"{where} = {value!r}: expected one of {allowed}")
        return value
    if (section, key) == ("backend", "name"):
        if not isinstance(value, str) or (value and not _BACKEND_NAME.fullmatch(value)):
            raise ProfileError(f"{where} = {value!r}: expected a string: \"\" (the best available "
                               "backend) or a backend name of lowercase letters, digits and _")
        return value
    if (section, key) == ("fusion", "skip"):
        if isinstance(value, bool):
            return value
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            unknown = [x for x in value if x not in ALL_GROUPS]
            if unknown:
                raise ProfileError(f"{where}: unknown pattern groups {unknown}; expected some of "
                                   f"{list(ALL_GROUPS)} or true")
            return tuple(value)
        raise ProfileError(f"{where} = {value!r}: expected true/false or a list of pattern groups")
    if (section, key) == ("parallel", "tensor"):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise ProfileError(f"{where} = {value!r}: expected an integer in [1, 4096] (ranks)")
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ProfileError(f"{where} = {value!r}: expected true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 4096:
            raise ProfileError(f"{where} = {value!r}: expected an integer in [0, 4096]")
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


def _like(base: str, doc: str, **changes) -> tuple:
    return base, doc, changes


# The presets, each (the preset it starts from, what it is for, the settings it changes).
# The upstream names (rlx-flow's `CompileProfile::llama32_prefill()` ...) carry upstream's
# settings, mapped onto this project's fields: policy, target (upstream "auto" is ours),
# assert_clean, skip (upstream's bool), dce, constant_folding, verbose, compute. Knobs this
# project lacks are left out: upstream's `precision.mixed` ("none"/"auto", read by nothing
# upstream; every preset there says "none") is not our `mixed` (f32 accumulation in norms,
# softmax and attention, kept on), and its `[backend.metal]` / `[backend.cpu]` overrides
# (skip_fusion, unfuse_regions) and its fusion targets cpu/metal/mlx/rocm/wgpu/tpu have no
# backend here. `cse` and `verify_each` are ours and keep their defaults. default, fusable,
# unfused and debug are this project's own.
PRESET_TABLE = {
    "default": _like("", "The defaults: direct lowering, the backend's fusion groups, f32."),
    "llama32_prefill": _like("", "Fusion-first prefill: direct lowering, fusion passes on."),
    "llama32_decode": _like("llama32_prefill", "Decode graphs: fusable lowering, so the KV-cache "
                            "patterns fuse cleanly.", fusion={"policy": "fusable"}),
    "qwen35_prefill": _like("llama32_prefill", "Hybrid (gated-delta / full-attention) prefill: as "
                            "llama32_prefill."),
    "qwen35_decode": _like("llama32_decode", "Hybrid decode (GDN / full-attention KV patterns): "
                           "as llama32_decode."),
    "qwen3_prefill": _like("llama32_prefill", "Dense GQA + SwiGLU prefill: as llama32_prefill."),
    "qwen3_decode": _like("llama32_decode", "Dense decode (bucketed KV cache): as llama32_decode."),
    "gemma_prefill": _like("llama32_prefill", "Sliding-window prefill (GQA, RMSNorm, softcap): as "
                           "llama32_prefill."),
    "gemma_decode": _like("llama32_decode", "Sliding-window decode (bucketed KV cache): as "
                          "llama32_decode."),
    "encoder": _like("", "Bidirectional encoders (text, vision): direct lowering."),
    "flux2": _like("encoder", "Diffusion transformer, VAE and text-encoder graphs: as encoder."),
    "sam_encoder": _like("encoder", "SAM / SAM2 image encoder and mask decoder: as encoder."),
    "sam2": _like("sam_encoder", "SAM2 image, mask-decoder and memory graphs: as sam_encoder."),
    "sam3": _like("sam_encoder", "SAM3 detector encoder/decoder layers: as sam_encoder."),
    "sam2_memory_attention": _like("encoder", "SAM2 memory attention: fusion off (RoPE runs on the "
                                   "host between subgraphs).", fusion={"skip": True}),
    "llada2_diffusion": _like("encoder", "LLaDA2 / TIDE block-diffusion MoE: fusion off, so graphs "
                              "legalize without unfused fused-norm lowerings.", fusion={"skip": True}),
    "fusable": _like("", "Fusable lowering, and an error if a fusable chain is left unfused.",
                     fusion={"policy": "fusable", "assert_clean": True}),
    "unfused": _like("", "Every fusion group skipped (the reference for fusion tests).",
                     fusion={"skip": True}),
    "debug": _like("", "Verbose passes, the graph verified after each, assert_clean on.",
                   fusion={"assert_clean": True}, passes={"verbose": True, "verify_each": True}),
}

PRESETS: dict = {}
for _name, (_base, _doc, _changes) in PRESET_TABLE.items():
    PRESETS[_name] = (PRESETS[_base] if _base else CompileProfile()).evolve(name=_name, **_changes)

    def _get(cls, _name=_name) -> CompileProfile:
        return PRESETS[_name]
    _get.__name__, _get.__qualname__, _get.__doc__ = _name, f"CompileProfile.{_name}", _doc
    setattr(CompileProfile, _name, classmethod(_get))       # CompileProfile.llama32_prefill()
del _name, _base, _doc, _changes, _get
