"""The prefix cache (rlx_core.runtime.prefix_cache) and the Scheduler using it: hash-chain keys
name whole prefixes; a hit is the longest run of cached whole blocks (for a model with
recurrent states, one ending at a snapshot); least recently used blocks go first and the
bytes stay within the bound; greedy outputs with the cache on equal those with it off
(hypothesis over request sets sharing prefixes, tiny LLaMA and the Qwen3.5 hybrid), with
the prompt tokens computed counted (a hit computes only the rest). A waiting prompt is judged
by what is left after its cached prefix (a short tail is prefilled whole, not riding in the
decode steps), looked up once, its prefix copied out at once (an eviction or a cancellation
before its first piece changes nothing)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx_core.ir.errors import ModelError
from rlx_core.pipeline import StateStore, select_backend
from rlx_core.runtime.model import CausalLM, find_recipe
from rlx_core.runtime.prefix_cache import BLOCK, PrefixCache, block_keys
from rlx_core.runtime.scheduler import Scheduler
from rlx_core.testing.parity import backend_params

pytest.importorskip("rlx_blocks_llama")
WAIT = 120


def tiny(model_type: str = "llama", backend: str = "numpy", seed: int = 5):
    recipe = find_recipe(model_type)
    cfg = dict(recipe.tiny_config(), max_position_embeddings=256)
    return CausalLM.from_tensors(cfg, recipe.tiny_tensors(cfg, np.random.default_rng(seed)), backend=backend,
                                 recipe=recipe)


@pytest.fixture(scope="module")
def llama():
    return tiny()


@pytest.fixture(scope="module")
def hybrid():
    pytest.importorskip("rlx_blocks_qwen35")
    return tiny("qwen3_5_text")


def tokens(seed: int, n: int) -> list:
    return np.random.default_rng(seed).integers(3, 61, n).tolist()


# ----------------------------------------------------------------------------- the cache alone
def test_keys_name_whole_prefixes():
    a, b = tokens(0, 3 * BLOCK), tokens(1, 3 * BLOCK)
    ka = block_keys(a)
    assert len(ka) == 3 and len(block_keys(a[:-1])) == 2
    assert block_keys(a[:BLOCK] + b[BLOCK:])[0] == ka[0]
    # the same second block after another first block is another key
    assert block_keys(b[:BLOCK] + a[BLOCK:])[1] != ka[1]


def fake_states(length: int, seed: int) -> tuple:
    """Specs and states of one 2-layer KV cache [batch, 2, ctx, 4] and a recurrent state."""
    from rlx_core.ir.shape import Shape

    specs = {f"kv.{i}.{x}": Shape(("batch", 2, "ctx", 4), "f32") for i in range(2) for x in "kv"}
    specs["state.0.recurrent"] = Shape(("batch", 3, 3), "f32")
    rng = np.random.default_rng(seed)
    states = StateStore({n: rng.standard_normal((2,) + tuple(d if isinstance(d, int) else length
                                                              for d in s.dims[1:])).astype(np.float32)
                         for n, s in specs.items()})
    return specs, states


def test_insert_lookup_restore_and_eviction():
    specs, states = fake_states(128, 0)
    kv_only = {n: s for n, s in specs.items() if n.startswith("kv")}
    block_bytes = 4 * 2 * BLOCK * 4 * 4
    pc = PrefixCache(select_backend("numpy"), kv_only, "batch", capacity=5 * block_bytes)
    ids = tokens(2, 100)
    assert pc.insert(ids, states, 1, 100) == 3                     # 3 whole blocks of row 1
    assert pc.lookup(ids, 99)[0] == 3 * BLOCK
    assert pc.lookup(ids, 3 * BLOCK - 1)[0] == 2 * BLOCK          # a hit leaves the last token out
    assert pc.lookup(ids[:40] + tokens(3, 60), 99)[0] == BLOCK
    _, fresh = fake_states(128, 1)
    pc.restore(pc.lookup(ids, 99)[1], fresh)
    for n in kv_only:
        np.testing.assert_array_equal(fresh[n][0, :, :3 * BLOCK], states[n][1, :, :3 * BLOCK])
    # 3 more blocks of another prompt: over 5 blocks, the least recently used (ids' deepest) go
    other = tokens(4, 3 * BLOCK)
    pc.insert(other, states, 0, 3 * BLOCK)
    assert pc.bytes <= pc.capacity and pc.evictions == 1 and len(pc.entries) == 5
    assert pc.lookup(ids, 99)[0] == 2 * BLOCK and pc.lookup(other, 200)[0] == 3 * BLOCK


@pytest.mark.parametrize("backend", backend_params(("numpy", "opencl", "cuda")))
@pytest.mark.parametrize("blocks", [1, 3, 10])
def test_backend_join_and_split_blocks(backend, blocks, rng):
    """Backend.join_blocks (a cached prefix's blocks into one row of each state) and split_blocks
    (a row's new blocks out of each state, a buffer each) against numpy, on strided regions of
    bigger buffers of two shapes and dtypes in one call: the regions joined, the rest untouched,
    the parts unchanged by later writes."""
    b = select_backend(backend)
    shapes = {"a": ((3, 2, 4 * blocks + 9, 4), np.float32, 2), "b": ((2, 4 * blocks + 5, 3, 8), np.float16, 1),
              "c": ((2, 3, 4 * blocks + 7, 3), np.float16, 2)}     # (rows of 6 bytes: 2-byte moves on a GPU)
    dst_h, parts, regions = {}, {}, {}
    for n, (shape, dt, axis) in shapes.items():
        dst_h[n] = rng.standard_normal(shape).astype(dt)
        piece = list(shape)
        piece[0], piece[axis] = 1, 4
        parts[n] = [rng.standard_normal(piece).astype(dt) for _ in range(blocks)]
        idx = [slice(1, 2)] + [slice(None)] * (len(shape) - 1)
        idx[axis] = slice(5, 5 + 4 * blocks)
        regions[n] = tuple(idx)
    dev = {n: b.to_device(dst_h[n].copy()) for n in shapes}
    out = b.join_blocks([(dev[n], regions[n], [b.to_device(p) for p in parts[n]], shapes[n][2]) for n in shapes])
    for n, got in zip(shapes, out):
        want = dst_h[n].copy()
        want[regions[n]] = np.concatenate(parts[n], axis=shapes[n][2])
        np.testing.assert_array_equal(np.asarray(b.to_host(got)), want)
    split = b.split_blocks([(got, regions[n], shapes[n][2], blocks) for n, got in zip(shapes, out)])
    again = b.join_blocks([(got, regions[n], [b.to_device(np.zeros_like(p)) for p in parts[n]], shapes[n][2])
                           for n, got in zip(shapes, out)])
    for n, got, pieces in zip(shapes, again, split):
        assert len(pieces) == blocks
        for want, piece in zip(parts[n], pieces):
            np.testing.assert_array_equal(np.asarray(b.to_host(piece)), want)
        assert not np.asarray(b.to_host(got))[regions[n]].any()


@pytest.mark.parametrize("backend", backend_params(("numpy", "opencl", "cuda")))
def test_backend_copy_regions(backend, rng):
    """Backend.copy_regions (a prefill's rows placed into the batch cache, every state at once)
    against numpy: rows by int and by slice, two dtypes, a job whose dtypes differ (cast, as
    copy_into casts), two jobs into one buffer; the rest untouched."""
    b = select_backend(backend)
    kv = rng.standard_normal((4, 2, 16, 8)).astype(np.float16)
    conv = rng.standard_normal((3, 5, 6)).astype(np.float32)
    src_kv = rng.standard_normal((1, 2, 16, 8)).astype(np.float16)
    src_conv = rng.standard_normal((2, 5, 6)).astype(np.float32)
    jobs = [(kv, (2, slice(None), slice(0, 11), slice(None)), src_kv, (0, slice(None), slice(0, 11), slice(None))),
            (conv, (slice(0, 1),), src_conv, (slice(1, 2),)),
            (kv, (slice(3, 4), slice(1, 2), slice(4, 9)), src_conv.astype(np.float16)[:1, :1, :5, None].repeat(8, 3),
             (slice(None), slice(None), slice(None))),
            (conv, (2, slice(1, 3)), src_kv[0, 0, :2, :6].copy(), (slice(None), slice(None)))]   # (f16 into f32)
    want = {"kv": kv.copy(), "conv": conv.copy()}
    for dst, index, src, src_index in jobs:
        want["kv" if dst is kv else "conv"][index] = src[src_index]
    dev = {id(kv): b.to_device(kv.copy()), id(conv): b.to_device(conv.copy())}
    done = b.copy_regions([(dev[id(d)], i, b.to_device(s), si) for d, i, s, si in jobs])
    got = {}
    for (dst, *_), buf in zip(jobs, done):
        got["kv" if dst is kv else "conv"] = buf
    for name in want:
        np.testing.assert_array_equal(np.asarray(b.to_host(got[name])), want[name])


def test_recurrent_hits_end_at_snapshots():
    specs, states = fake_states(128, 0)
    pc = PrefixCache(select_backend("numpy"), specs, "batch", capacity=1 << 20)
    ids = tokens(5, 100)
    pc.insert(ids, states, 0, 70)                                  # blocks, no snapshot
    assert pc.lookup(ids, 99)[0] == 0
    pc.insert(ids, states, 0, 2 * BLOCK, snapshot=True)
    hit, entries = pc.lookup(ids, 99)
    assert hit == 2 * BLOCK
    _, fresh = fake_states(128, 1)
    pc.restore(entries, fresh)
    np.testing.assert_array_equal(fresh["state.0.recurrent"][0], states["state.0.recurrent"][0])


def test_bad_capacity_is_a_model_error():
    with pytest.raises(ModelError, match="capacity"):
        PrefixCache(select_backend("numpy"), {}, "batch", capacity=-1)
    with pytest.raises(ModelError, match="prefix_cache_mb"):
        Scheduler(object(), prefix_cache_mb=-2)


# ----------------------------------------------------------------------------- in the scheduler
def run(model, jobs: list, together: bool, **kw) -> tuple:
    """Each job's new tokens (greedy) and the scheduler's stats; `together`: submitted at
    once, else one after another."""
    with Scheduler(model, max_batch=4, **kw) as s:
        if together:
            reqs = [s.submit(ids, max_tokens=n) for ids, n in jobs]
            out = [r.result(WAIT).token_ids for r in reqs]
        else:
            out = [s.submit(ids, max_tokens=n).result(WAIT).token_ids for ids, n in jobs]
        return out, s.stats()


request_sets = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 5)), min_size=2,
                        max_size=4)


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(jobs=request_sets, shared=st.integers(20, 90), together=st.booleans())
def test_greedy_equal_with_and_without_prefix_cache(llama, jobs, shared, together):
    base = tokens(9, shared)
    reqs = [(base[:shared - 7 * k] + tokens(10 + i, extra), n) for i, (k, extra, n) in enumerate(jobs)]
    off, _ = run(llama, reqs, together, prefix_cache_mb=0)
    on, stats = run(llama, reqs, together)
    assert on == off
    assert stats["prefix_query_tokens"] == sum(len(ids) for ids, _ in reqs)
    assert stats["prefill_tokens"] == stats["prefix_query_tokens"] - stats["prefix_hit_tokens"]


@pytest.mark.parametrize("backend", backend_params(("numpy", "numba", "cuda")))
def test_second_request_computes_only_the_rest(llama, backend):
    if backend != "numpy":
        llama = tiny(backend=backend)
    system = tokens(11, 70)
    a, b = system + tokens(12, 5), system + tokens(13, 9)
    out, stats = run(llama, [(a, 4), (b, 4)], together=False)
    assert stats["prefix_hit_tokens"] == 2 * BLOCK                 # system's 2 whole blocks
    assert stats["prefill_tokens"] == len(a) + len(b) - 2 * BLOCK
    off, _ = run(llama, [(a, 4), (b, 4)], together=False, prefix_cache_mb=0)
    assert out == off


def test_finished_answer_is_cached_for_the_next_turn(llama):
    first = tokens(14, 40)
    with Scheduler(llama, max_batch=2) as s:
        done = s.submit(first, max_tokens=30, ignore_eos=True).result(WAIT)
        turn2 = first + done.token_ids + tokens(15, 3)
        before = s.stats()["prefix_hit_tokens"]
        s.submit(turn2, max_tokens=2).result(WAIT)
        hit = s.stats()["prefix_hit_tokens"] - before
    # the first turn's prompt and answer (69 tokens in the cache): 2 whole blocks
    assert hit == (len(first) + len(done.token_ids) - 1) // BLOCK * BLOCK == 2 * BLOCK


def test_memory_bound_evicts(llama):
    with Scheduler(llama, max_batch=2, prefix_cache_mb=0.05) as s:    # 52 kB: 6 blocks of 8 kB
        for seed in range(4):
            s.submit(tokens(20 + seed, 2 * BLOCK + 1), max_tokens=1).result(WAIT)
        st_ = s.stats()
        assert s.memory_report()["prefix_cache_bytes"] == st_["prefix_cache_bytes"]
    assert 0 < st_["prefix_cache_bytes"] <= st_["prefix_cache_capacity"]
    assert st_["prefix_cache_evictions"] > 0


def test_hybrid_greedy_equal_and_hits_at_snapshots(hybrid):
    system = tokens(16, 70)
    jobs = [(system + tokens(17, 4), 5), (system + tokens(18, 11), 5), (system[:40], 3)]
    off, _ = run(hybrid, jobs, together=False, prefix_cache_mb=0)
    on, stats = run(hybrid, jobs, together=False)
    assert on == off
    # the first prefill stops at 64 for a snapshot (2 runs) and the second starts from it (1 run);
    # the third's one cached block has no snapshot: it prefills from 0, stopping at 32 (2 runs)
    assert stats["prefix_hit_tokens"] == 2 * BLOCK
    assert stats["prefill_runs"] == 2 + 1 + 2


# ----------------------------------------------------------------------------- judged after the hit
SYSTEM = 3 * BLOCK + 4                  # a system prompt of 3 whole blocks and 4 tokens


def request(name: str, ids: list, n: int):
    from rlx_core.runtime.sampling import SamplingParams
    from rlx_core.runtime.scheduler import Request

    return Request(name, list(ids), SamplingParams.checked(max_tokens=n, ignore_eos=True))


def alone(model, ids: list, n: int) -> list:
    return model.generate(list(ids), max_new_tokens=n, ignore_eos=True)[len(ids):]


def decoding(model, **kw) -> Scheduler:
    """A scheduler (no thread: the test runs its rounds) decoding two streams, one of them
    after the system prompt (its blocks now cached)."""
    s = Scheduler(model, max_batch=4, prefill_chunk=16, **kw)
    system = tokens(30, SYSTEM)
    s.round([request("w", system + tokens(31, 5), 40), request("s", tokens(32, 6), 40)], idle=True)
    assert len(s._running()) == 2 and s.prefix.stats()["prefix_cache_blocks"] >= 3
    return s


def finish(s: Scheduler, r) -> list:
    while not r.done:
        s.round([], idle=True)
    return r.token_ids


def test_a_cached_prefix_with_a_short_tail_is_prefilled_whole_not_riding(llama):
    """While streams decode, a prompt whose 96 first tokens are cached and 13 left is judged
    by those 13: prefilled alone, whole, in one run, placed in the round it came in (judged
    by its 109 it rode in the steps, 16 tokens a step); one with 44 left still rides. Each
    prompt is looked up once: the counters count its tokens once."""
    s = decoding(llama)
    system = tokens(30, SYSTEM)
    short, long = request("p", system + tokens(33, 9), 6), request("q", system + tokens(34, 40), 6)
    before = s.stats()
    s.round([short], idle=True)
    mid = s.stats()
    assert short.slot >= 0 and mid["mixed_steps"] == before["mixed_steps"]
    assert mid["prefill_runs"] == before["prefill_runs"] + 1
    assert mid["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 3 * BLOCK
    s.round([long], idle=True)
    assert long.slot < 0 and s.stats()["mixed_steps"] == mid["mixed_steps"] + 1
    got = finish(s, short), finish(s, long)
    stats = s.stats()
    s.close()
    assert got == (alone(llama, short.prompt_ids, 6), alone(llama, long.prompt_ids, 6))
    lengths = [SYSTEM + 5, 6, len(short.prompt_ids), len(long.prompt_ids)]
    assert stats["prefix_query_tokens"] == sum(lengths)
    assert stats["prefix_hit_tokens"] == 2 * 3 * BLOCK
    assert stats["prefill_tokens"] == stats["prefix_query_tokens"] - stats["prefix_hit_tokens"]


@pytest.mark.parametrize("tail", [9, 40])
def test_a_prefix_evicted_between_lookup_and_fill_gives_the_same_tokens(llama, tail):
    """The lookup copies the cached prefix into the prefill states at once: the cache emptied
    before the prompt's first piece (alone, or riding) changes nothing."""
    s = decoding(llama)
    p = request("p", tokens(30, SYSTEM) + tokens(35, tail), 6)
    with llama._lock:
        s._admit(p)
        assert s._front() is p and p.filled == 3 * BLOCK
    s.prefix.clear()
    got = finish(s, p)
    s.close()
    assert got == alone(llama, p.prompt_ids, 6)


def test_a_prompt_cancelled_after_its_lookup_holds_nothing(llama):
    """Cancelled after its prefix was looked up (and restored) but before any piece ran, a
    prompt leaves the scheduler and the prefix cache as they were: nothing of it waits or
    runs, every block can still be evicted, and the next prompt through the prefill states
    gets its own tokens."""
    s = decoding(llama)
    p = request("p", tokens(30, SYSTEM) + tokens(36, 40), 6)
    with llama._lock:
        s._admit(p)
        assert s._front() is p and p.filled == 3 * BLOCK
    p.cancel()
    s.round([], idle=True)
    assert p.finish_reason == "cancelled" and not s._fills and p not in s._active
    assert s.stats()["prefilling"] == 0
    nxt = request("n", tokens(30, 2 * BLOCK) + tokens(37, 20), 6)      # (2 of the 3 blocks cached)
    s.round([nxt], idle=True)
    assert finish(s, nxt) == alone(llama, nxt.prompt_ids, 6)
    pc = s.prefix
    pc.capacity = 0
    pc._evict()
    s.close()
    assert pc.bytes == 0 and not pc.entries
