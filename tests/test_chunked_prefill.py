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
BACKENDS = backend_params(("numpy", "numba", "cuda", "opencl"))   # skipped with the reason where absent
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
        last = np.zeros((1, 1, b - a), np.float32)
        last[..., -1] = 1
        out = ext.run({"ids": ids[None, a:b], "positions": np.arange(a, b)[None], "key_mask": mask,
                       "cache_pos": np.array([a], np.int32), "last_token": last})["logits"]
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


# ----------------------------------------------------------------------------- chunked prefill
def alone(model, ids: list, n: int) -> list:
    """Greedy new tokens of `ids` run alone by generate (end-of-sequence dropped)."""
    new = model.generate(list(ids), max_new_tokens=n)[len(ids):]
    return [t for t in new if t not in model.eos_ids]


def prompt(seed: int, n: int) -> list:
    return np.random.default_rng(seed).integers(3, 61, n).tolist()


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def streaming(s: Scheduler, seen: list, then=None):
    """A long greedy request whose every event records the scheduler's prefill runs so far
    (and calls `then()`, on the scheduler thread)."""
    first = threading.Event()

    def on_event(ev):
        seen.append(s.prefill_runs)
        if then is not None:
            then()
        first.set()
    r = s.submit(prompt(1, 6), max_tokens=200, ignore_eos=True, on_event=on_event)
    assert first.wait(WAIT)
    return r


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
@pytest.mark.parametrize("backend", backend_params(("numpy", "numba", "cuda")))
def test_chunks_interleave_with_decode_steps(llama, kind, backend):
    if kind == "qwen3_5":
        pytest.importorskip("rlx_blocks_qwen35")
    model = llama if (kind, backend) == ("llama", "numpy") else tiny(
        "llama" if kind == "llama" else "qwen3_5_text", backend)
    long = prompt(2, 100)
    with Scheduler(model, max_batch=2, prefill_chunk=16, prefix_cache_mb=0) as s:
        seen: list = []
        a = streaming(s, seen)
        before = s.prefill_runs
        got = s.submit(long, max_tokens=5).result(WAIT).token_ids
        after = s.prefill_runs
        a.cancel()
        a.result(WAIT)
    assert after - before == 7                                       # ceil(100 / 16) chunks
    # the running request got a token after each chunk but the last, before the next chunk ran
    assert set(range(before + 1, after)) <= set(seen)
    assert got == alone(model, long, 5)


def test_cancel_mid_prefill_frees_its_rows(llama):
    long, short = prompt(3, 120), prompt(4, 9)
    with Scheduler(llama, max_batch=2, prefill_chunk=8) as s:
        seen: list = []
        box: dict = {}

        def cancel_b():                  # (on the scheduler thread: the request being prefilled,
            if "start" in box and s.prefill_runs >= box["start"] + 3:      # 3 of its 15 chunks in)
                for r in list(s._active):
                    if r.slot < 0:
                        r.cancel()
        a = streaming(s, seen, cancel_b)
        box["start"] = start = s.prefill_runs
        b = s.submit(long, max_tokens=4)
        assert b.result(WAIT).finish_reason == "cancelled"
        assert s.prefill_runs < start + 15                           # it never finished its prefill
        st = s.stats()
        assert st["prefilling"] == 0 and st["running"] == 1
        a.cancel()
        a.result(WAIT)
        assert s.pending == 0 and s.stats()["running"] == 0
        assert s.submit(short, max_tokens=6).result(WAIT).token_ids == alone(llama, short, 6)
        assert s.submit(long, max_tokens=4).result(WAIT).token_ids == alone(llama, long, 4)


def test_ring_cache_model_prefills_whole():
    pytest.importorskip("rlx_blocks_gemma")
    model = tiny("gemma3_text")
    long = prompt(5, 50)
    with Scheduler(model, max_batch=2, prefill_chunk=8) as s:
        with pytest.warns(RuntimeWarning, match="ring cache"):
            got = s.submit(long, max_tokens=4).result(WAIT).token_ids
        assert "ring cache" in s.extend_refused and s.prefill_runs == 1 and s.prefix is None
        assert s.submit(long, max_tokens=4).result(WAIT).token_ids == got
    assert got == alone(model, long, 4)


# ----------------------------------------------------------------------------- pieces and the stall budget
def test_pieces_run_at_a_few_lengths(llama):
    """Prompts of 1 to 70 tokens (no cache hits) run as extend pieces of power-of-two lengths
    (a tail padded up to 16, 32 or 64, longer ones exact), so the graph specializes for a few
    lengths only, and every prompt's greedy tokens equal those of the prompt run alone."""
    lengths = [1, 5, 16, 17, 31, 33, 47, 64, 65, 70]
    with Scheduler(llama, max_batch=2, prefill_chunk=0, prefix_cache_mb=0) as s:
        got = [s.submit(prompt(30 + n, n), max_tokens=3, ignore_eos=True).result(WAIT).token_ids
               for n in lengths]
        seqs = {dict(k)["seq"] for k in s._extend._runners}
    assert seqs <= {16, 32, 64}                       # (65 and 70: 64 exact, then a tail padded to 16)
    assert got == [model_new(llama, prompt(30 + n, n), 3) for n in lengths]


def model_new(model, ids: list, n: int) -> list:
    return model.generate(list(ids), max_new_tokens=n, ignore_eos=True)[len(ids):]


def test_budget_picks_the_longest_piece_that_fits(llama):
    """The piece a round may add follows the measured costs in decode steps (interpolated
    between lengths measured): the longest that fits the budget; the round's first piece at
    least 16 tokens, a later one that fits nothing none."""
    s = Scheduler(llama, stall_budget=0.5)
    s._run_steps = {1: 0.2, 8: 0.4, 32: 1.5}
    assert s._estimate(16) == pytest.approx(0.4 + 1.1 * 8 / 24)
    assert s._estimate(64) == pytest.approx(3.0) and s._estimate(4) == pytest.approx(0.2 + 0.2 * 3 / 7)
    assert s._budget_limit(256, 0.5, first=False) == 8
    assert s._budget_limit(256, 0.8, first=True) == 16
    assert s._budget_limit(4, 0.5, first=True) == 4
    assert s._budget_limit(256, 0.1, first=True) == 16     # nothing fits 0.1: the first piece 16 anyway
    assert s._budget_limit(256, 0.1, first=False) == 0
    assert s._budget_limit(256, 0.7, first=False) == 8
    s.close()


def test_stall_budget_keeps_outputs(llama):
    """With a stall budget the pieces follow measured times (not asserted), the tokens do not."""
    long = prompt(2, 100)
    with Scheduler(llama, max_batch=2, prefill_chunk=32, stall_budget=0.5, prefix_cache_mb=0) as s:
        a = streaming(s, [])
        got = s.submit(long, max_tokens=5).result(WAIT).token_ids
        a.cancel()
        a.result(WAIT)
    assert got == alone(llama, long, 5)
