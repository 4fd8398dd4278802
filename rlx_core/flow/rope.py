"""RoPE frequency tables, computed the way HF transformers computes them (float32 inv_freq,
float32 position products) so logits match to the last bit we can get."""
from __future__ import annotations

import math

import numpy as np

from ..ir.errors import ModelError


_MAX_TABLE_BYTES = 256 << 20  # cos + sin; a 1M-position context of 64 frequencies fills it


def _positive(d: dict, key: str, what: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelError(f"config {what}: {key!r} is {v!r}, expected a finite number > 0")
    return float(v)


def rope_params(config: dict) -> tuple:
    """(theta, scaling dict or None) from either config style (`rope_parameters`, new in
    transformers 5, or the older `rope_theta` + `rope_scaling`)."""
    rp = config.get("rope_parameters")
    scaling: dict | None
    if isinstance(rp, dict) and "rope_theta" in rp:
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return _positive(rp, "rope_theta", "rope_parameters"), scaling
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelError(f"config rope_scaling is {scaling!r}, expected an object or null")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return _positive({"rope_theta": config.get("rope_theta", 10000.0)}, "rope_theta", "rope_theta"), scaling


def inv_freq(dim: int, theta: float, scaling: dict | None = None) -> tuple:
    """(inv_freq float32 [dim/2], attention scaling) for rope types default, linear, llama3."""
    if dim // 2 * 8 > _MAX_TABLE_BYTES:     # tables of even one position would be over the limit
        raise ModelError(f"RoPE width {dim} (head_dim) would take {dim // 2 * 8 >> 20} MiB of tables per "
                         f"position, over the {_MAX_TABLE_BYTES >> 20} MiB limit; the config's head size "
                         "does not fit any checkpoint")
    base = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / (np.float32(theta) ** base)).astype(np.float32)
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv / np.float32(_positive(scaling, "factor", "rope_scaling"))).astype(np.float32), 1.0
    if kind == "llama3":
        factor, low, high, old = (
            _positive(scaling, k, "rope_scaling (llama3)")
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        )
        if high <= low:
            raise ModelError(
                f"config rope_scaling (llama3): high_freq_factor {high} must be above low_freq_factor {low}"
            )
        low_wl, high_wl = old / low, old / high
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wl, inv / np.float32(factor), inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    raise ModelError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def rope_tables(inv: np.ndarray, max_pos: int, attention_scaling: float = 1.0) -> tuple:
    """cos, sin tables [max_pos, dim/2] (float32), refused past `_MAX_TABLE_BYTES`: a context
    that long must be asked for (max_context) rather than allocated because a config says so."""
    need = int(max_pos) * inv.size * 8
    if need > _MAX_TABLE_BYTES:
        raise ModelError(
            f"RoPE tables for {max_pos} positions (max_position_embeddings) would take {need >> 20} MiB, "
            f"over the {_MAX_TABLE_BYTES >> 20} MiB limit; load the model with a smaller max_context"
        )
    pos = np.arange(max_pos, dtype=np.float32)
    freqs = (pos[:, None] * inv[None, :]).astype(np.float32)
    return ((np.cos(freqs) * np.float32(attention_scaling)).astype(np.float32),
            (np.sin(freqs) * np.float32(attention_scaling)).astype(np.float32))
