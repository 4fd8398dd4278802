"""Prefill that starts mid-cache (`extend` graphs) and chunked prefill in the Scheduler.

`extend` continues the sequence a prefill left in the caches: prefill(a) then extend(b) gives
the logits of prefill(a + b), for tiny random LLaMA, Qwen3 (QK-norm), a Mistral-style
sliding window, Gemma 3 with full-length caches and the Qwen3.5 hybrid (Gated DeltaNet
state leaves), on numpy and numba; Gemma's ring caches refuse to extend. The Scheduler
prefills long prompts in chunks, one per round between the running batch's decode steps
(counted, never timed), gives the tokens of whole prefills, and a request cancelled
mid-prefill frees its rows."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from rlx_core.ir.errors import ModelError
from rlx_core.pipeline import StateStore
from rlx_core.runtime.model import CausalLM, find_recipe
from rlx_core.runtime.scheduler import Scheduler
from rlx_core.testing.parity import backend_params

pytest.importorskip("rlx_blocks_llama")
BACKENDS = backend_params(("numpy", "numba"))
TOL = 1e-4
WAIT = 120


def tiny(model_type: str, backend: str = "numpy", seed: int = 3, ring: bool | None = None, **change):
    recipe = find_recipe(model_type)
    if ring is not None:
        recipe = type(recipe)(ring=ring)
    cfg = dict(recipe.tiny_config(), max_position_embeddings=256, **change)
    tensors = recipe.tiny_tensors(cfg, np.random.default_rng(seed))
    return CausalLM.from_tensors(cfg, tensors, backend=backend, recipe=recipe)


MODELS = {
    "llama": lambda b: tiny("llama", b),
    "qwen3": lambda b: tiny("qwen3", b),
    "mistral_window": lambda b: tiny("mistral", b, sliding_window=5),
    "gemma3_full_cache": lambda b: tiny("gemma3_text", b, ring=False),
    "qwen3_5": lambda b: tiny("qwen3_5_text", b),
}


def prefill_then_extend(model, ids: np.ndarray, cuts: list, ctx: int = 128) -> np.ndarray:
    """Last-token logits of `ids` run as a prefill of ids[:cuts[0]] then an extend per piece."""
    store = StateStore()
    pre, ext = model.executable_over("prefill", store), model.executable_over("extend", store)
    pre.fixed_dims = ext.fixed_dims = {"ctx": ctx}
    a = cuts[0]
    out = pre.run({"ids": ids[None, :a], "positions": np.arange(a)[None], "key_mask": np.ones((1, 1, 1, a), bool),
                   "cache_pos": np.zeros(1, np.int32)})["logits"]
    for b in cuts[1:] + [len(ids)]:
        mask = np.zeros((1, 1, 1, ctx), bool)
        mask[..., :b] = True
        out = ext.run({"ids": ids[None, a:b], "positions": np.arange(a, b)[None], "key_mask": mask,
                       "cache_pos": np.array([a], np.int32)})["logits"]
        a = b
    return out[0, -1]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_equals_prefill(kind, backend):
    pytest.importorskip({"gemma3_full_cache": "rlx_blocks_gemma", "qwen3_5": "rlx_blocks_qwen35"}.get(
        kind, "rlx_blocks_llama"))
    model = MODELS[kind](backend)
    ids = np.random.default_rng(1).integers(3, 61, 23).astype(np.int64)
    whole = model.logits(ids[None])[0, -1]
    for cuts in ([9], [1], [5, 6, 17], [22]):
        got = prefill_then_extend(model, ids, cuts)
        np.testing.assert_allclose(got, whole, atol=TOL, rtol=TOL, err_msg=f"{kind} cut at {cuts}")


def test_ring_cache_refuses_to_extend():
    pytest.importorskip("rlx_blocks_gemma")
    model = tiny("gemma3_text")
    with pytest.raises(ModelError, match="ring cache"):
        model.executable_over("extend", StateStore())
