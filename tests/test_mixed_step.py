"""The mixed step (issue 48): one run that decodes the batch AND prefills a piece of another
prompt (recipe.DecoderFlow mode "mixed", SelfAttention.mixed), so the weights are read once.

The mixed graph's logits equal each sequence's own logits (model.logits, no cache) for the
decode rows and the piece, on numpy and numba, for LLaMA, Qwen3 (QK-norm) and a Mistral-style
sliding window; in the Scheduler, greedy outputs with mixed steps equal those without (and
with the prefix cache on and off: hypothesis over prompts arriving while a batch decodes);
families whose layers do not split the packed tokens (Gemma 3's attention, the Qwen3.5
hybrid's recurrent states) fall back to pieces run alone, with the same outputs."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx_core.flow.blocks import PIECE_CTX, PIECE_PREFIX
from rlx_core.ir.errors import ModelError
from rlx_core.pipeline import StateStore
from rlx_core.runtime.batch_cache import BatchCache
from rlx_core.runtime.model import CausalLM, find_recipe
from rlx_core.runtime.scheduler import Scheduler
from rlx_core.testing.parity import backend_params

pytest.importorskip("rlx_blocks_llama")
BACKENDS = backend_params(("numpy", "numba", "cuda"))   # skipped with the reason where absent
TOL = 1e-4
WAIT = 120


def tiny(model_type: str, backend: str = "numpy", seed: int = 3, **change):
    recipe = find_recipe(model_type)
    if "ring" in change:
        recipe = type(recipe)(ring=change.pop("ring"))
    cfg = dict(recipe.tiny_config(), max_position_embeddings=256, **change)
    return CausalLM.from_tensors(cfg, recipe.tiny_tensors(cfg, np.random.default_rng(seed)), backend=backend,
                                 recipe=recipe)


def tokens(seed: int, n: int) -> list:
    return np.random.default_rng(seed).integers(3, 61, n).tolist()


def prefilled(model, store: StateStore, ids: list, ctx: int) -> None:
    """Prefill `ids` (batch 1) into `store`, at context `ctx`."""
    pre = model.executable_over("prefill", store)
    pre.fixed_dims = {"ctx": ctx}
    n = len(ids)
    pre.run({"ids": np.array([ids]), "positions": np.arange(n)[None], "key_mask": np.ones((1, 1, 1, n), bool),
             "cache_pos": np.zeros(1, np.int32)})


MODELS = {"llama": {}, "qwen3": {}, "mistral": {"sliding_window": 5}}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_logits_equal_each_sequence_alone(kind, backend):
    """Decode rows of 11 and 4 cached tokens (and an idle row) plus a 7-token piece (padded
    to 8) continuing a 9-token prompt: each row's logits are its sequence's last logits."""
    model = tiny(kind, backend, **MODELS[kind])
    ctx, piece_ctx, rows = 32, 64, 3
    seqs = [tokens(1, 12), tokens(2, 5)]                   # cached: all but the last token
    prompt, a, b, run = tokens(3, 16), 9, 16, 8
    dec = model.executable_over("decode", StateStore())
    specs = {n.name: n.outs[0] for n in dec.mir.nodes if n.op == "state"}
    cache = BatchCache(model.backend, specs, dec.input_specs["ids"].dims[0])
    cache.resize(rows, ctx, [])
    for row, s in enumerate(seqs):
        one = StateStore()
        prefilled(model, one, s[:-1], ctx)
        cache.place(row, one, len(s) - 1)
    fill = StateStore()
    prefilled(model, fill, prompt[:a], piece_ctx)
    exe = model.executable_over("mixed", StateStore(), rows=rows, piece=run)
    exe.states.update(cache.store)
    exe.states.update({PIECE_PREFIX + n: v for n, v in fill.items()})
    exe.fixed_dims = {"ctx": ctx, PIECE_CTX: piece_ctx}
    lengths = [len(s) - 1 for s in seqs] + [0]
    ids = [s[-1] for s in seqs] + [0] + prompt[a:b] + [0] * (run - (b - a))
    positions = lengths + [min(p, b - 1) for p in range(a, a + run)]
    mask = np.zeros((rows, 1, 1, ctx), bool)
    for row, n in enumerate(lengths):
        mask[row, ..., :n + 1] = True
    piece_mask = np.zeros((1, 1, 1, piece_ctx), bool)
    piece_mask[..., :a + run] = True
    last = np.zeros((1, 1, run), np.float32)
    last[..., b - a - 1] = 1
    out = exe.run({"ids": np.array([ids]), "positions": np.array([positions]), "key_mask": mask,
                   "cache_pos": np.array(lengths, np.int32), "piece_mask": piece_mask,
                   "piece_pos": np.array([a], np.int32), "last_token": last})
    logits = out["logits"][:, -1]
    assert logits.shape == (rows + 1, model.vocab_size)
    for row, s in enumerate(seqs):
        np.testing.assert_allclose(logits[row], model.logits(np.array([s]))[0, -1], atol=TOL, rtol=TOL,
                                   err_msg=f"{kind} decode row {row}")
    np.testing.assert_allclose(logits[rows], model.logits(np.array([prompt[:b]]))[0, -1], atol=TOL, rtol=TOL,
                               err_msg=f"{kind} piece")
    np.testing.assert_array_equal(out["next_ids"][:, -1], logits.argmax(-1))
    # the piece's keys went to its own states, the decode rows' to the batch cache
    after = StateStore()
    prefilled(model, after, prompt[:b], piece_ctx)
    for n in fill:
        got, want = (model.backend.to_host(st[n])[:, :, :b] for st in (fill, after))
        np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg=n)


def test_mixed_graph_takes_int_counts():
    with pytest.raises(ModelError, match="positive int count"):
        tiny("llama").built("mixed", rows=0, piece=8)


# ----------------------------------------------------------------------------- in the scheduler
def served(model, long: list, n: int, sampled: dict | None = None, **kw) -> tuple:
    """(a streaming request's first tokens, `long`'s n tokens (greedy, or `sampled`'s
    sampling keywords), the scheduler) with `long` submitted while the stream decodes."""
    with Scheduler(model, max_batch=2, prefix_cache_mb=0, **kw) as s:
        started = threading.Event()
        a = s.submit(tokens(1, 6), max_tokens=60, ignore_eos=True, on_event=lambda ev: started.set())
        assert started.wait(WAIT)
        got = s.submit(long, max_tokens=n, ignore_eos=True, **(sampled or {})).result(WAIT).token_ids
        a.cancel()
        stream = a.result(WAIT).token_ids
    return stream, got, s


def alone(model, ids: list, n: int) -> list:
    return model.generate(list(ids), max_new_tokens=n, ignore_eos=True)[len(ids):]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scheduler_mixed_steps_keep_greedy_outputs(kind, backend):
    """A 70-token prompt arriving while a stream decodes rides in its decode steps, 16 tokens
    a step: 4 mixed steps, then its last 6 tokens (a short tail) ride too, padded to 16, the
    first token from that step's logits; the tokens equal those run alone."""
    model = tiny(kind, backend)
    long = tokens(2, 70)
    stream, got, s = served(model, long, 5, prefill_chunk=16)
    assert s.mixed_refused == "" and s.mixed_steps == 5 and s.prefill_runs == 1 + 5    # (the stream's own)
    runs = [(r.kind, r.piece) for r in s.step_log() if r.kind != "decode"]
    assert runs == [("piece", 16)] + [("mixed", 16)] * 5
    assert got == alone(model, long, 5)
    assert stream == alone(model, tokens(1, 6), len(stream))
    _, off, s_off = served(model, long, 5, prefill_chunk=16, mixed=False)
    assert s_off.mixed_steps == 0 and off == got


@pytest.mark.parametrize("kind", ["gemma3_full_cache", "qwen3_5"])
def test_families_that_cannot_mix_run_pieces_alone(kind):
    pytest.importorskip({"gemma3_full_cache": "rlx_blocks_gemma", "qwen3_5": "rlx_blocks_qwen35"}[kind])
    model = tiny("gemma3_text", ring=False) if kind == "gemma3_full_cache" else tiny("qwen3_5_text")
    long = tokens(2, 40)
    stream, got, s = served(model, long, 4, prefill_chunk=16)
    assert s.mixed_steps == 0
    if kind == "gemma3_full_cache":           # (the hybrid's pieces cannot pad: it never tries)
        assert "mixed graph's states" in s.mixed_refused
    assert got == alone(model, long, 4)
    assert stream == alone(model, tokens(1, 6), len(stream))


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", seed=5)


def waves(model, base: list, jobs: list, **kw) -> list:
    """Greedy tokens of each job submitted while a stream decodes (each after the one before
    finished, so every prompt arrives into a running batch)."""
    with Scheduler(model, max_batch=4, prefill_chunk=16, **kw) as s:
        started = threading.Event()
        a = s.submit(base[:5], max_tokens=500, ignore_eos=True, on_event=lambda ev: started.set())
        assert started.wait(WAIT)
        out = [s.submit(ids, max_tokens=n, ignore_eos=True).result(WAIT).token_ids for ids, n in jobs]
        a.cancel()
        a.result(WAIT)
        return out, s.mixed_steps


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(jobs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 4)), min_size=2,
                     max_size=3), shared=st.integers(20, 60))
def test_greedy_equal_mixed_and_prefix_cache_on_and_off(llama, jobs, shared):
    base = tokens(9, shared)
    reqs = [(base[:shared - 7 * k] + tokens(10 + i, extra), n) for i, (k, extra, n) in enumerate(jobs)]
    plain, none = waves(llama, base, reqs, prefix_cache_mb=0, mixed=False)
    assert none == 0
    for cache_mb in (0, 256):
        got, mixed = waves(llama, base, reqs, prefix_cache_mb=cache_mb)
        assert got == plain and mixed > 0


def test_mixed_pieces_start_small_and_grow_while_they_fit(llama):
    """With a stall budget a riding piece is the longest measured length whose addition to
    the step fits (the least of its last measurements; a shorter one over the budget rules out
    the longer), trying the length above it (never measured, or not for REMEASURE mixed
    steps) where its expected addition fits: the line through the two longest measured, or,
    with one measured, twice it within the budget twice over; with nothing measured, one
    token."""
    import collections

    from rlx_core.runtime.scheduler import REMEASURE

    s = Scheduler(llama, stall_budget=0.5)
    assert s._mixed_limit(256, 0.5) == 1
    s._mixed_added = {1: collections.deque([0.3])}
    s._mixed_when = {1: 0}
    assert s._mixed_limit(256, 0.5) == 2                  # 2 never measured: 2 x 0.3 within 0.5 + 0.5
    # (at 0.2, 1 is over the budget too, TIE: steps 0.375; 2's guess 0.6 is over 0.375 + 0.2)
    assert s._mixed_limit(256, 0.2) == 1
    s._mixed_added[2] = collections.deque([0.35, 9.0, 0.4])   # (one stalled step: the least holds)
    s._mixed_added[4] = collections.deque([0.7])
    s._mixed_when.update({2: 0, 4: 0})
    assert s._mixed_limit(256, 0.5) == 2 and s._mixed_limit(2, 0.5) == 2
    assert s._mixed_limit(256, 1.0) == 4                  # 4 fits; 8 expected 0.7 + 4 x 0.175 = 1.4
    assert s._mixed_limit(256, 1.5) == 8                  # (1.4 fits 1.5: tried)
    s.mixed_steps = REMEASURE
    assert s._mixed_limit(256, 0.5) == 4                  # 4 measured long ago, expected 0.35 + 2 x 0.05
    s._mixed_added[2] = collections.deque([0.45])
    assert s._mixed_limit(256, 0.5) == 2                  # expected 0.45 + 2 x 0.15 = 0.75: not tried
    s._mixed_added[2] = collections.deque([0.6])
    s._mixed_added[4] = collections.deque([0.3])          # (lucky: a longer piece adds no less than 2's 0.6)
    s._mixed_when.update({2: REMEASURE, 4: REMEASURE})
    assert s._mixed_limit(256, 0.5) == 1
    s.close()


def test_a_piece_measured_as_adding_nothing_does_not_make_longer_ones_free(llama):
    """A one-token step measured as adding nothing (a plain step of the reference slower
    than it) once made every longer piece's estimate 0, and the chunk rode (256 tokens, a
    20-step stall of every stream): now the pieces only double, one measured length at a
    time."""
    import collections

    s = Scheduler(llama, stall_budget=0.5)
    s._mixed_added = {1: collections.deque([0.0])}
    s._mixed_when = {1: 0}
    assert s._mixed_limit(256, 0.5) == 2
    s._mixed_added[2] = collections.deque([0.0])
    s._mixed_when[2] = 0
    assert s._mixed_limit(256, 0.5) == 4
    s.close()


def test_a_budget_below_every_pieces_addition_takes_pieces_near_the_least(llama):
    """Where the least any piece adds (the mixed step's overhead) is over the budget, pieces
    adding at most TIE more than it fit: the streams wait as long as with one-token pieces,
    the prompt goes several times faster."""
    import collections

    from rlx_core.runtime.scheduler import TIE

    s = Scheduler(llama, stall_budget=0.5)
    s._mixed_added = {n: collections.deque([c]) for n, c in {1: 0.59, 2: 0.61, 4: 0.55, 8: 0.73}.items()}
    s._mixed_when = {1: 0, 2: 0, 4: 0, 8: 0}
    assert 0.61 < 0.55 * (1 + TIE) < 0.73 and s._mixed_limit(256, 0.5) == 4
    s._mixed_added[8] = collections.deque([0.6])
    assert s._mixed_limit(256, 0.5) == 8                  # 8 fits; 16 expected 0.6 + 8 x 0.0125 > 0.6875
    s._mixed_added[8] = collections.deque([0.58])
    assert s._mixed_limit(256, 0.5) == 16                 # (0.58 + 8 x 0.0075 = 0.64: tried)
    assert s._mixed_limit(256, 2.0) == 16                 # (a budget above them: one doubling past 8)
    s.close()


@pytest.mark.parametrize("budget", [0.5, 2.0])
def test_stall_budget_with_mixed_steps_keeps_outputs(llama, budget):
    """Pieces of lengths chosen by measured times (not asserted), tokens as alone."""
    long = tokens(2, 100)
    stream, got, s = served(llama, long, 5, prefill_chunk=64, stall_budget=budget)
    assert s.mixed_steps > 0 and got == alone(llama, long, 5)
    assert stream == alone(llama, tokens(1, 6), len(stream))


def test_sampled_request_rides_as_it_runs_alone(llama):
    """A seeded sampled request prefilled in mixed steps draws the tokens it draws with its
    pieces run alone (the same logits, the same generator)."""
    long = tokens(3, 90)
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    _, on, s = served(llama, long, 8, sampled, prefill_chunk=16)
    _, off, _ = served(llama, long, 8, sampled, prefill_chunk=16, mixed=False)
    assert s.mixed_steps > 0 and on == off


def test_a_prompt_waiting_behind_a_riding_one_keeps_pieces_at_16(llama):
    """While another prompt waits behind the one being prefilled, its riding pieces are at
    least 16 tokens whatever the budget (the waiting one cannot start before it ends)."""
    import collections

    from rlx_core.runtime.sampling import SamplingParams
    from rlx_core.runtime.scheduler import Request

    s = Scheduler(llama, stall_budget=0.0, prefill_chunk=64)
    s._mixed_added = {1: collections.deque([5.0]), 2: collections.deque([9.0])}   # 2 does not fit: one token
    s._mixed_when = {1: 0, 2: 0}
    s._step_times.append(0.01)
    long = Request("a", tokens(1, 200), SamplingParams.checked(max_tokens=2))
    other = Request("b", tokens(2, 200), SamplingParams.checked(max_tokens=2))
    s._active = [long, other]
    s._fills.extend([long])
    assert s._next_rider(64) == (long, 1)
    s._fills.append(other)
    assert s._next_rider(64) == (long, 16)
    s.close()


def test_memory_report_counts_the_kv_once_with_mixed_graphs(llama):
    """The mixed graphs' states are the batch cache's and the prefill's buffers: counted once."""
    long = tokens(2, 100)
    with Scheduler(llama, max_batch=2, prefill_chunk=16, prefix_cache_mb=0) as s:
        started = threading.Event()
        a = s.submit(tokens(1, 6), max_tokens=300, ignore_eos=True, on_event=lambda ev: started.set())
        assert started.wait(WAIT)
        s.submit(long, max_tokens=2, ignore_eos=True).result(WAIT)
        assert s.mixed_steps > 0
        with llama._lock:
            rep = s.memory_report()
            stores = (llama.states, s.cache.store, s._prefill.states)
            held = sum(b.nbytes for st in stores for b in st.values())
        a.cancel()
        a.result(WAIT)
    assert rep["kv_bytes"] == held


def test_warm_mixed_builds_every_graph_a_step_can_pick(llama, monkeypatch):
    """After warm_mixed (the server's warm-up) a long prompt riding in the steps builds no
    graph, at whatever piece lengths its measured costs choose (budgets 0.5 and 4: short and
    long pieces), nor after release_cache (the graphs stay built, their runners go)."""
    built: list = []
    build = llama.executable_over

    def counted(mode, states, rows=0, piece=0):
        built.append((mode, rows, piece))
        return build(mode, states, rows, piece)

    s = Scheduler(llama, max_batch=2, prefill_chunk=16, prefix_cache_mb=0, stall_budget=0.5)
    monkeypatch.setattr(llama, "executable_over", counted)
    assert s.warm_mixed() == 2 * 5                         # batch buckets 1, 2 x pieces 1, 2, 4, 8, 16
    assert sorted(k for k in s._mixed) == [(r, p) for r in (1, 2) for p in (1, 2, 4, 8, 16)]
    assert sorted((r, p) for mode, r, p in built if mode == "mixed") == sorted(s._mixed)
    long = tokens(2, 100)
    with s:
        for budget in (0.5, 4.0):
            s.stall_budget = budget
            del built[:]
            started = threading.Event()
            a = s.submit(tokens(1, 6), max_tokens=200, ignore_eos=True, on_event=lambda ev: started.set())
            assert started.wait(WAIT)
            steps = s.mixed_steps
            got = s.submit(long, max_tokens=3, ignore_eos=True).result(WAIT).token_ids
            a.cancel()
            a.result(WAIT)
            assert s.mixed_steps > steps and got == alone(llama, long, 3)
            assert [b for b in built if b[0] == "mixed"] == []
            s.release_cache()
            assert len(s._mixed) == 10 and all(not exe._runners for exe in s._mixed.values())


def test_warm_mixed_builds_nothing_where_the_scheduler_does_not_mix(llama):
    for kw in ({"mixed": False}, {"prefill_chunk": 0}):
        with Scheduler(llama, max_batch=2, **{"prefill_chunk": 16, **kw}) as s:
            assert s.warm_mixed() == 0 and not s._mixed


def test_with_a_budget_a_plain_step_is_timed_every_reference_mixed_steps(llama):
    """What a riding piece adds is measured against a plain step of now: before the first
    timed plain step, and after REFERENCE mixed steps in a row, the next step carries no
    piece (without a budget nothing is measured: pieces ride every step)."""
    from rlx_core.runtime.sampling import SamplingParams
    from rlx_core.runtime.scheduler import REFERENCE, Request

    for budget in (0.5, None):
        s = Scheduler(llama, stall_budget=budget, prefill_chunk=64)
        long = Request("a", tokens(1, 200), SamplingParams.checked(max_tokens=2))
        s._active = [long]
        s._fills.append(long)
        rides = budget is None
        assert (s._next_rider(64) is not None) == rides      # no plain step timed yet
        s._step_times.extend([0.01, 0.03, 0.02, 0.5])
        assert s._next_rider(64) is not None and s._step_now == 0.02   # (the least of the last 3)
        s._plain_age = REFERENCE
        assert (s._next_rider(64) is not None) == rides
        s.close()


def test_a_ride_with_a_budget_interleaves_timed_plain_steps(llama):
    """In a ride with a budget, plain steps come at least every REFERENCE mixed steps; the
    tokens stay as alone."""
    from rlx_core.runtime.scheduler import REFERENCE

    long = tokens(2, 200)
    steps: list = []
    with Scheduler(llama, max_batch=2, prefill_chunk=64, prefix_cache_mb=0, stall_budget=0.5) as s:
        ride = s._mixed_step
        s._mixed_step = lambda r, limit: (steps.append("m"), ride(r, limit))
        plain = s._step
        s._step = lambda: (steps.append("p"), plain())
        started = threading.Event()
        a = s.submit(tokens(1, 6), max_tokens=300, ignore_eos=True, on_event=lambda ev: started.set())
        assert started.wait(WAIT)
        got = s.submit(long, max_tokens=2, ignore_eos=True).result(WAIT).token_ids
        a.cancel()
        a.result(WAIT)
    assert got == alone(llama, long, 2)
    runs = "".join(steps).strip("p").split("p")
    assert "m" in runs[0] and max(len(x) for x in runs) <= REFERENCE
