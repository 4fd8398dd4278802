"""FLUX transformer configs as diffusers writes them (config.json with `_class_name`), read
into one `FluxArch` for both families:

* `FluxTransformer2DModel` (FLUX.1): GELU-tanh MLPs, biases everywhere, per-block adaLN
  modulation, pooled text projections, (t, h, w) RoPE with theta 10000;
* `Flux2Transformer2DModel` (FLUX.2): SwiGLU MLPs, no biases, modulation shared by every
  block (computed once), no pooled projections, four RoPE axes with `rope_theta`.
"""
from __future__ import annotations

import math

import attrs

from rlx_core.ir.errors import ModelError

FLUX1, FLUX2 = "FluxTransformer2DModel", "Flux2Transformer2DModel"
CLASSES = (FLUX1, FLUX2)


@attrs.frozen
class FluxArch:
    """Everything the FLUX blocks need (diffusers' config names in comments)."""
    version: int                 # 1: FluxTransformer2DModel, 2: Flux2Transformer2DModel
    in_channels: int             # in_channels (patch_size^2 * latent channels: packed latents)
    out_channels: int            # patch_size^2 * (out_channels or in_channels)
    double: int                  # num_layers
    single: int                  # num_single_layers
    heads: int                   # num_attention_heads
    head_dim: int                # attention_head_dim
    joint_dim: int               # joint_attention_dim (text embedding width)
    axes: tuple                  # axes_dims_rope
    theta: float                 # 10000 (FLUX.1) / rope_theta (FLUX.2)
    guidance: bool               # guidance_embeds
    pooled_dim: int = 0          # pooled_projection_dim (FLUX.1)
    mlp_hidden: int = 0          # FLUX.1: 4 * hidden; FLUX.2: hidden * mlp_ratio
    eps: float = 1e-6
    channels: int = 256          # timestep_guidance_channels

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def bias(self) -> bool:
        return self.version == 1


def _int(cfg: dict, key: str, default=None, lo: int = 1) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ModelError(f"FLUX config: {key!r} is {v!r}, expected an integer >= {lo}")
    return v


def _real(cfg: dict, key: str, default: float) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelError(f"FLUX config: {key!r} is {v!r}, expected a finite number > 0")
    return float(v)


def _flag(cfg: dict, key: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if not isinstance(v, bool):        # bool("false") would read a string as true
        raise ModelError(f"FLUX config: {key!r} is {v!r}, expected true or false")
    return v


def flux_arch(cfg: dict) -> FluxArch:
    """The FluxArch of a diffusers FLUX transformer config (ModelError naming a bad key)."""
    cls = cfg.get("_class_name")
    if cls not in CLASSES:
        raise ModelError(f"FLUX config: _class_name is {cls!r}, expected one of {list(CLASSES)}")
    v2 = cls == FLUX2
    heads = _int(cfg, "num_attention_heads", 48 if v2 else 24)
    head_dim = _int(cfg, "attention_head_dim", 128)
    hidden = heads * head_dim
    patch = _int(cfg, "patch_size", 1)
    in_ch = _int(cfg, "in_channels", 128 if v2 else 64)
    out_ch = _int({"out_channels": cfg.get("out_channels") or in_ch}, "out_channels")   # null: in_channels
    axes = cfg.get("axes_dims_rope", (32, 32, 32, 32) if v2 else (16, 56, 56))
    if not isinstance(axes, (list, tuple)) or not all(isinstance(a, int) and a > 0 and a % 2 == 0 for a in axes):
        raise ModelError(f"FLUX config: axes_dims_rope is {axes!r}, expected a list of even positive integers")
    if sum(axes) != head_dim:
        raise ModelError(f"FLUX config: axes_dims_rope {list(axes)} sums to {sum(axes)}, but attention_head_dim "
                         f"is {head_dim}")
    if v2:
        ratio = _real(cfg, "mlp_ratio", 3.0)
        return FluxArch(2, in_ch, patch * patch * out_ch, _int(cfg, "num_layers", 8, 0),
                        _int(cfg, "num_single_layers", 48, 0), heads, head_dim,
                        _int(cfg, "joint_attention_dim", 15360), tuple(axes),
                        _real(cfg, "rope_theta", 2000.0),
                        _flag(cfg, "guidance_embeds", True), 0, int(hidden * ratio),
                        _real(cfg, "eps", 1e-6), _int(cfg, "timestep_guidance_channels", 256))
    return FluxArch(1, in_ch, patch * patch * out_ch, _int(cfg, "num_layers", 19, 0),
                    _int(cfg, "num_single_layers", 38, 0), heads, head_dim, _int(cfg, "joint_attention_dim", 4096),
                    tuple(axes), 10000.0, _flag(cfg, "guidance_embeds", False),
                    _int(cfg, "pooled_projection_dim", 768), 4 * hidden)


__all__ = ["FluxArch", "flux_arch", "FLUX1", "FLUX2", "CLASSES"]
