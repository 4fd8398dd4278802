"""Greedy generation fetches the graph's arg-max ids and a finiteness check instead of the
[batch, vocab] logits: the ids equal the logits' arg-max, `fetch` is checked, and a model
whose logits turn non-finite still stops with the error the logits path gives."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.ir.errors import GraphError, ModelError
from rlx_core.runtime.model import GREEDY_OUTPUTS, greedy_outputs
from rlx_core.testing.parity import backend_params
from rlx_core.runtime.sampling import choose, process_logits
from tiny_models import tiny_llama


@pytest.fixture(params=backend_params(("numpy", "numba", "cuda", "opencl")))
def model(request, rng):
    return tiny_llama(rng, backend=request.param)


def _feed(model, rng, b=3, s=5):
    ids = rng.integers(1, model.vocab_size, (b, s)).astype(np.int64)
    mask = np.ones((b, s), bool)
    mask[0, :2] = False                                  # a left-padded row
    return dict(model._inputs(ids, mask), cache_pos=np.zeros(b, np.int32))


def test_greedy_outputs_equal_the_logits_argmax(model, rng):
    exe = model.executable("prefill")
    exe.fixed_dims = {"ctx": 16}
    assert greedy_outputs(exe) and greedy_outputs(model.executable("decode"))
    feed = _feed(model, rng)
    full = exe.run(feed)
    got = exe.run(feed, fetch=GREEDY_OUTPUTS)
    assert sorted(got) == sorted(GREEDY_OUTPUTS)
    last = full["logits"][:, -1].astype(np.float64)
    np.testing.assert_array_equal(got["next_ids"][:, -1], np.argmax(last, -1))
    np.testing.assert_allclose(got["logits_sum"][:, -1], last.sum(-1), rtol=1e-4, atol=1e-3)


def test_greedy_generate_equals_choosing_from_full_logits(model, rng):
    """generate's greedy path against a loop that recomputes the whole logits each step."""
    prompt = rng.integers(1, model.vocab_size, (2, 4)).astype(np.int64)
    got = model.generate(prompt, max_new_tokens=5, min_new_tokens=5)
    ids = prompt
    for _ in range(5):
        lg = process_logits(model.logits(ids)[:, -1], n_new=ids.shape[1] - 4, min_new_tokens=5,
                            eos_ids=model.eos_ids)
        nxt = choose(lg, None, False, 1.0, None, None)
        ids = np.concatenate([ids, nxt[:, None].astype(np.int64)], 1)
    np.testing.assert_array_equal(got, ids)


def test_fetch_names_a_missing_output(model):
    exe = model.executable("decode")
    with pytest.raises(GraphError, match=r"no output\(s\) \['nope'\] to fetch.*next_ids"):
        exe.run({}, fetch=("nope",))


def test_non_finite_logits_stop_greedy_generation(rng):
    """The check output is the logits' sum: a NaN weight makes it NaN, and generation falls
    back to the logits and raises instead of emitting the arg-max of NaNs."""
    from tiny_models import LLAMA, llama_tensors, word_tokenizer
    from rlx_core.runtime.model import CausalLM

    t = llama_tensors(LLAMA, rng)
    t["model.norm.weight"] = np.full_like(t["model.norm.weight"], np.nan)
    m = CausalLM.from_tensors(LLAMA, t, tokenizer=word_tokenizer(False), backend="numpy")
    with pytest.raises(ModelError, match="finite"):
        m.generate([[5, 6, 7]], max_new_tokens=3)


def test_an_eos_argmax_before_min_new_tokens_takes_the_logits_path(rng):
    """Final norm weight 0: every logit is 0 and the arg-max is id 0, here the EOS. Before
    min_new_tokens the EOS is banned, so the graph's ids are not enough: the next id (1)
    comes from the processed logits; without the ban the EOS ends generation at once."""
    from tiny_models import LLAMA, llama_tensors
    from rlx_core.runtime.model import CausalLM

    t = llama_tensors(LLAMA, rng)
    t["model.norm.weight"] = np.zeros_like(t["model.norm.weight"])
    m = CausalLM.from_tensors(dict(LLAMA, eos_token_id=0, pad_token_id=0), t, backend="numpy")
    assert m.generate([5, 6, 7], max_new_tokens=3, min_new_tokens=3) == [5, 6, 7, 1, 1, 1]
    assert m.generate([5, 6, 7], max_new_tokens=3) == [5, 6, 7, 0]


def test_queued_greedy_steps_give_the_same_tokens(model, rng, monkeypatch):
    """With the backend's runs taken as overlapping the host (a GPU's do), generate queues
    each greedy step before reading the one before, its ids chained on the device: the
    tokens are those of the in-turn loop."""
    prompt = rng.integers(1, model.vocab_size, (2, 4)).astype(np.int64)
    runs = []
    for overlaps in (False, True):
        monkeypatch.setattr(model.backend, "overlaps", overlaps)
        runs.append([model.generate(prompt, max_new_tokens=n, min_new_tokens=n) for n in (1, 2, 6)])
    for want, got in zip(*runs):
        np.testing.assert_array_equal(got, want)
    # the 4th new token of row 1 made the EOS: banned there, so that step is run again for
    # its logits (after the next step was queued on its arg-max)
    monkeypatch.setattr(model, "tokenizer", None)
    monkeypatch.setitem(model.config, "eos_token_id", int(runs[0][2][1, 4 + 3]))
    runs = []
    for overlaps in (False, True):
        monkeypatch.setattr(model.backend, "overlaps", overlaps)
        runs.append(model.generate(prompt, max_new_tokens=6, min_new_tokens=6))
    np.testing.assert_array_equal(runs[1], runs[0])


def test_a_chained_submit_takes_the_last_submits_output(model, rng):
    """submit(chain={"ids": "next_ids"}) feeds a decode step the ids the step before chose,
    also when another graph ran in between (then from the host copy)."""
    dec = model.executable("decode")
    dec.fixed_dims = {"ctx": 16}
    pre = model.executable("prefill")
    pre.fixed_dims = {"ctx": 16}
    f1, f2 = _feed(model, rng), _feed(model, rng)

    def feed(pos, ids):
        return {"ids": ids[:, None], "positions": np.full((3, 1), pos), "cache_pos": np.full(3, pos, np.int32),
                "key_mask": np.arange(16)[None, None, None, :].repeat(3, 0) <= pos}

    def ids(out):
        return out["next_ids"][:, -1]
    first, zeros = rng.integers(1, model.vocab_size, 3).astype(np.int64), np.zeros(3, np.int64)
    pre.run(f1)
    a = ids(dec.submit(feed(5, first), GREEDY_OUTPUTS)())
    b = dec.submit(feed(6, zeros), GREEDY_OUTPUTS, chain={"ids": "next_ids"})
    c = dec.submit(feed(7, zeros), GREEDY_OUTPUTS, chain={"ids": "next_ids"})
    got = [ids(b()), ids(c())]
    pre.run(f2)                                            # (rewrites the cache rows 0..4)
    got.append(ids(dec.submit(feed(8, zeros), GREEDY_OUTPUTS, chain={"ids": "next_ids"})()))
    pre.run(f1)
    want = [ids(dec.run(feed(5, first), fetch=GREEDY_OUTPUTS))]
    for pos in (6, 7, 8):
        if pos == 8:
            pre.run(f2)
        want.append(ids(dec.run(feed(pos, want[-1]), fetch=GREEDY_OUTPUTS)))
    np.testing.assert_array_equal(a, want[0])
    np.testing.assert_array_equal(np.stack(got), np.stack(want[1:]))


def test_a_chain_is_checked(model, rng):
    dec = model.executable("decode")
    with pytest.raises(GraphError, match=r"chain names no input\(s\) \['nope'\]"):
        dec.submit({}, GREEDY_OUTPUTS, chain={"nope": "next_ids"})
    with pytest.raises(GraphError, match=r"no output\(s\) \['gone'\] to chain"):
        dec.submit({}, GREEDY_OUTPUTS, chain={"ids": "gone"})


def test_an_eos_ban_when_steps_are_queued(rng, monkeypatch):
    """The banned-EOS fallback reruns a step for its logits after the next step was queued:
    the queued step is dropped and the tokens are those of the in-turn loop."""
    from tiny_models import LLAMA, llama_tensors
    from rlx_core.runtime.model import CausalLM

    t = llama_tensors(LLAMA, rng)
    t["model.norm.weight"] = np.zeros_like(t["model.norm.weight"])
    m = CausalLM.from_tensors(dict(LLAMA, eos_token_id=0, pad_token_id=0), t, backend="numpy")
    monkeypatch.setattr(m.backend, "overlaps", True)
    assert m.generate([5, 6, 7], max_new_tokens=4, min_new_tokens=3) == [5, 6, 7, 1, 1, 1, 0]
    assert m.generate([5, 6, 7], max_new_tokens=3) == [5, 6, 7, 0]
