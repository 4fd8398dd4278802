"""Issue 47's sampling parameters in the runtime: each logits processor against HF's own
processor or a float64 numpy reference on random logits; end to end, generate and the
Scheduler against a loop that recomputes the whole logits each step and applies those
references; n choices off one prefill; seeds; stop strings; logprobs; the constraint hook."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

from rlx_core.ir.errors import ModelError
from rlx_core.runtime.sampling import (SamplingParams, add_logit_bias, log_softmax,
                                       presence_frequency_penalty, repetition_penalty, warp)
from rlx_core.runtime.scheduler import Scheduler
from rlx_core.testing.parity import backend_params
from tiny_models import tiny_llama

WAIT = 120
EOS = 2


@pytest.fixture
def model(rng):
    return tiny_llama(rng)


def _hf(proc, logits, ids=None):
    ids = torch.zeros((len(logits), 1), dtype=torch.long) if ids is None else torch.tensor(ids)
    return proc(ids, torch.tensor(logits, dtype=torch.float64)).numpy()


# -- the processors on random logits
def test_repetition_penalty_is_hfs(rng):
    x = rng.normal(0, 3, (3, 40))
    seen = rng.integers(0, 40, (3, 9))
    got = x.copy()
    repetition_penalty(got, seen, 1.7)
    np.testing.assert_allclose(got, _hf(hf.RepetitionPenaltyLogitsProcessor(1.7), x, seen), rtol=1e-12)


def test_presence_and_frequency_penalties_are_openais(rng):
    x = rng.normal(0, 3, (2, 30))
    out = [rng.integers(0, 30, 12).tolist(), [4, 4, 4]]
    want = x.copy()
    for b, ids in enumerate(out):                      # OpenAI's formula, token by token
        for t in set(ids):
            want[b, t] -= ids.count(t) * 0.6 + 0.4
    got = x.copy()
    presence_frequency_penalty(got, out, 0.4, 0.6)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_logit_bias_adds_to_those_tokens(rng):
    x = rng.normal(0, 1, (2, 20))
    got = x.copy()
    add_logit_bias(got, ((3, -100.0), (7, 2.5)))
    want = x.copy()
    want[:, 3] -= 100
    want[:, 7] += 2.5
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, ours, theirs", [
    ("top_k", dict(top_k=5), hf.TopKLogitsWarper(5)),
    ("top_p", dict(top_p=0.7), hf.TopPLogitsWarper(0.7)),
    ("min_p", dict(min_p=0.15), hf.MinPLogitsWarper(0.15)),
    ("typical_p", dict(typical_p=0.6), hf.TypicalLogitsWarper(0.6)),
])
def test_warpers_keep_the_tokens_hf_keeps(rng, name, ours, theirs):
    x = rng.normal(0, 2, (4, 50))
    kw = dict(top_k=None, top_p=None) | ours
    got = warp(x, 1.0, kw["top_k"], kw["top_p"], kw.get("min_p"), kw.get("typical_p"))
    want = _hf(theirs, x - x.max(-1, keepdims=True))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=name)
    assert (np.isfinite(got).sum(-1) < x.shape[1]).all()          # (each filter removed some)


def test_log_softmax_is_float64_exact(rng):
    x = rng.normal(0, 5, (3, 70)).astype(np.float32)
    want = torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1).numpy()
    np.testing.assert_allclose(log_softmax(x), want, atol=1e-12)


@pytest.mark.parametrize("kw, name", [
    ({"min_p": 1.5}, "min_p"), ({"typical_p": 0}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"), ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"constraint": 3}, "constraint"), ({"stop": ["a"] * 65}, "stop"), ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"), ({"nope": 1}, "nope"), ({"max_tokens": 3, "max_new_tokens": 3}, "max_tokens"),
])
def test_bad_arguments_are_model_errors_naming_them(model, kw, name):
    with pytest.raises(ModelError, match=name):
        SamplingParams.checked(**kw)
    if "max_tokens" not in kw:                    # (generate names it max_new_tokens)
        with pytest.raises(ModelError, match=name):
            model.generate([5, 6], max_new_tokens=2, **kw)


def test_argmax_only_when_nothing_changes_the_choice():
    assert SamplingParams().argmax and SamplingParams(min_p=0.5, typical_p=0.5, stop=("x",), n=3).argmax
    for kw in ({"do_sample": True}, {"repetition_penalty": 1.1}, {"presence_penalty": 0.1},
               {"frequency_penalty": 1},
               {"logit_bias": {3: 1}}, {"logprobs": 0}, {"constraint": lambda: None}):
        assert not SamplingParams.checked(**kw).argmax, kw


def test_choices_over_the_context_name_n_and_max_new_tokens(model):
    with pytest.raises(ModelError, match=r"n \(4\) x max_new_tokens \(20\)"):
        model.generate([5, 6, 7], max_new_tokens=20, n=4)
    with pytest.raises(ModelError, match="logit_bias key 99"):
        model.generate([5, 6, 7], max_new_tokens=2, logit_bias={99: 1.0})


# -- end to end, against a loop over the whole logits
def _reference(model, prompt: list, steps: int, *, rep=1.0, presence=0.0, freq=0.0, bias=()):
    """Greedy ids and each step's raw logits, recomputing every position's logits each step."""
    ids, raw = list(prompt), []
    for _ in range(steps):
        lg = model.logits([ids])[0, -1].astype(np.float64)
        raw.append(lg)
        x = lg[None].copy()
        repetition_penalty(x, [ids], rep)
        presence_frequency_penalty(x, [ids[len(prompt):]], presence, freq)
        if bias:
            add_logit_bias(x, bias)
        ids.append(int(np.argmax(x[0])))
    return ids[len(prompt):], raw


def test_top_k_1_equals_greedy(model):
    prompt = [5, 9, 11, 4]
    greedy = model.generate(prompt, max_new_tokens=6, ignore_eos=True)
    sampled = model.generate(prompt, max_new_tokens=6, ignore_eos=True, do_sample=True, top_k=1, seed=3)
    assert sampled == greedy


def test_penalties_and_bias_equal_the_reference(model):
    prompt = [5, 9, 11, 4, 9]
    kw = dict(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.9,
              logit_bias={7: 1.5, EOS: -100})
    out = model.generate(prompt, max_new_tokens=8, return_dict=True, logprobs=2, **kw)
    want, raw = _reference(model, prompt, 8, rep=1.8, presence=0.5, freq=0.9, bias=((7, 1.5), (EOS, -100.0)))
    assert out.ids[len(prompt):] == want
    assert out.finish_reasons == ["length"]
    for lp, lg in zip(out.logprobs[0], raw):                   # logprobs: the raw logits'
        ref = log_softmax(lg)
        assert abs(lp.logprob - ref[lp.token]) <= 1e-4
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:2])
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref)[::-1][:2], atol=1e-4)


def test_logprobs_and_prompt_logprobs_equal_a_float64_log_softmax(model):
    prompt = [5, 9, 11, 4, 20, 31]
    out = model.generate(prompt, max_new_tokens=4, return_dict=True, logprobs=0, prompt_logprobs=3,
                         ignore_eos=True)
    _, raw = _reference(model, prompt, 4)
    new = out.ids[len(prompt):]
    assert [lp.token for lp in out.logprobs[0]] == new and all(lp.top == () for lp in out.logprobs[0])
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs[0]],
                               [log_softmax(lg)[t] for lg, t in zip(raw, new)], atol=1e-4)
    full = log_softmax(model.logits([prompt])[0].astype(np.float64))
    plp = out.prompt_logprobs[0]
    assert plp[0] is None and len(plp) == len(prompt)
    for i in range(1, len(prompt)):
        assert plp[i].token == prompt[i] and abs(plp[i].logprob - full[i - 1, prompt[i]]) <= 1e-4
        assert [t for t, _ in plp[i].top] == list(np.argsort(-full[i - 1], kind="stable")[:3])


def test_n_choices_share_one_prefill(model):
    prefill = model.executable("prefill")
    runs = []
    real = prefill.run
    prefill.run = lambda *a, **k: (runs.append(1), real(*a, **k))[1]
    one = model.generate([[5, 9, 11], [7, 8, 3]], max_new_tokens=5, ignore_eos=True)
    runs.clear()
    four = model.generate([[5, 9, 11], [7, 8, 3]], max_new_tokens=5, n=4, ignore_eos=True)
    assert len(runs) == 1
    np.testing.assert_array_equal(four, np.repeat(one, 4, 0))
    texts = model.generate("w3 w4 w5", max_new_tokens=4, n=4, temperature=0)
    assert isinstance(texts, list) and len(set(texts)) == 1
    # sampled choices: each its own draw from the shared prefill, reproducible with the seed
    a = model.generate([5, 9, 11], max_new_tokens=6, n=4, do_sample=True, seed=7, ignore_eos=True)
    b = model.generate([5, 9, 11], max_new_tokens=6, n=4, do_sample=True, seed=7, ignore_eos=True)
    np.testing.assert_array_equal(a, b)
    assert len({tuple(r) for r in np.asarray(a)}) > 1


def test_seeds_reproduce_with_every_warper(model):
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.3, top_k=20, top_p=0.95, min_p=0.02,
              typical_p=0.95, ignore_eos=True)
    a, b = model.generate([5, 6, 7], seed=11, **kw), model.generate([5, 6, 7], seed=11, **kw)
    assert a == b
    assert any(model.generate([5, 6, 7], seed=s, **kw) != a for s in range(12, 16))


def test_ignore_eos_and_min_new_tokens(model):
    eos_first = dict(max_new_tokens=5, logit_bias={EOS: 100.0}, return_dict=True)
    out = model.generate([5, 6, 7], **eos_first)
    assert out.ids == [5, 6, 7, EOS] and out.finish_reasons == ["stop"]
    out = model.generate([5, 6, 7], ignore_eos=True, **eos_first)
    assert out.ids[3:] == [EOS] * 5 and out.finish_reasons == ["length"]
    out = model.generate([5, 6, 7], min_new_tokens=3, **eos_first)
    assert EOS not in out.ids[3:6] and out.ids[6] == EOS


def test_stop_strings_end_the_text_before_them(model):
    words_only = {t: -100 for t in [*range(5), *range(50, model.vocab_size)]}     # (ids with text)
    free = model.generate("w3 w4 w5", max_new_tokens=10, logit_bias=words_only)
    words = free.split()
    assert len(words) >= 4
    stop = " " + words[2]
    cut = free[:free.index(stop)]
    out = model.generate("w3 w4 w5", max_new_tokens=10, stop=["zzz", stop], return_dict=True,
                         logit_bias=words_only)
    assert out.texts == [cut] and out.finish_reasons == ["stop"]


class OneOf:
    """A hand-made constraint: `length` tokens, each from `allowed`; then finished (EOS)."""

    def __init__(self, vocab: int, allowed, length: int):
        self.mask = np.zeros(vocab, bool)
        self.mask[list(allowed)] = True
        self.left = length
        self.seen: list = []

    def allowed(self):
        return self.mask

    def accept(self, token: int) -> None:
        assert self.mask[token], token
        self.seen.append(token)
        self.left -= 1

    def finished(self) -> bool:
        return self.left <= 0


ALLOWED = (13, 17, 19, 23)


@pytest.mark.parametrize("sample", [False, True])
def test_a_constraint_is_obeyed_and_forces_eos_in_generate(model, sample):
    made = []

    def factory():
        made.append(OneOf(model.vocab_size, ALLOWED, 3))
        return made[-1]

    out = model.generate([[5, 6, 7], [9, 10, 11]], max_new_tokens=8, constraint=factory, return_dict=True,
                         do_sample=sample, seed=1, min_new_tokens=1)
    assert len(made) == 2 and out.finish_reasons == ["stop", "stop"]
    for row, c in zip(out.ids, made):
        new = row[3:].tolist()
        assert all(t in ALLOWED for t in new[:3]) and new[3] == EOS and c.seen == new[:3]


class MayEnd(OneOf):
    """OneOf whose mask allows EOS once a token is out: complete there, though it may go on."""

    def allowed(self):
        return self.mask | (np.arange(len(self.mask)) == EOS) * bool(self.seen)


def test_eos_only_where_the_constraint_allows_it(model):
    biased = dict(max_new_tokens=8, logit_bias={EOS: 100.0}, return_dict=True)
    out = model.generate([5, 6, 7], constraint=lambda: OneOf(model.vocab_size, ALLOWED, 3), **biased)
    assert all(t in ALLOWED for t in out.ids[3:6]) and out.ids[6:] == [EOS]      # (banned, then forced)
    out = model.generate([5, 6, 7], constraint=lambda: MayEnd(model.vocab_size, ALLOWED, 3), **biased)
    assert out.ids[3] in ALLOWED and out.ids[4:] == [EOS] and out.finish_reasons == ["stop"]


def test_the_scheduler_runs_constrained_rows_beside_unconstrained_ones(model):
    plain = [5, 9, 11, 4]
    alone = model.generate(plain, max_new_tokens=10, ignore_eos=True)[4:]
    later: list = []
    with Scheduler(model, max_batch=4) as s:
        def admit_tied(ev):            # (joins the batch while `free` decodes: admitted mid-decode)
            if not later:
                later.append(s.submit([7, 8, 3], max_tokens=10, logprobs=1,
                                      constraint=lambda: OneOf(model.vocab_size, ALLOWED, 4)))

        free = s.submit(plain, max_tokens=10, ignore_eos=True, on_event=admit_tied)
        got = free.result(WAIT)
        c = later[0].result(WAIT)
        assert s.max_rows == 2
    assert got.token_ids == alone
    assert c.finish_reason == "stop" and len(c.token_ids) == 4 and all(t in ALLOWED for t in c.token_ids)
    assert [lp.token for lp in c.logprobs] == c.token_ids and all(len(lp.top) == 1 for lp in c.logprobs)


def test_the_scheduler_matches_generate_with_every_parameter(model):
    kw = dict(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.6, logit_bias={7: 1.0},
              logprobs=2, prompt_logprobs=1, ignore_eos=True)
    prompt = [5, 9, 11, 4, 9]
    want = model.generate(prompt, max_new_tokens=6, return_dict=True, **kw)
    events = []
    with Scheduler(model, max_batch=4) as s:
        r = s.submit(prompt, max_tokens=6, n=3, on_event=events.append, **kw)
        done = r.results(WAIT)
    assert len(r.choices) == 3 and {e.index for e in events} == {0, 1, 2}
    for c in done:
        assert c.token_ids == want.ids[5:] and c.finish_reason == "length"
        np.testing.assert_allclose([lp.logprob for lp in c.logprobs], [lp.logprob for lp in want.logprobs[0]],
                                   atol=1e-4)
        assert [lp.token if lp else None for lp in c.prompt_logprobs] == [None] + prompt[1:]
    mine = [lp for e in events if e.index == 1 for lp in e.logprobs]
    assert [lp.token for lp in mine] == want.ids[5:]


def test_scheduler_seeds_reproduce(model):
    kw = dict(max_tokens=8, do_sample=True, seed=5, min_p=0.05, ignore_eos=True)
    with Scheduler(model, max_batch=2) as s:
        a = s.submit([5, 6, 7], **kw).result(WAIT).token_ids
        b = s.submit([5, 6, 7], **kw).result(WAIT).token_ids
    assert a == b


@pytest.fixture(params=backend_params(("numba", "cuda", "opencl")))
def device_model(request, rng):
    return tiny_llama(rng, backend=request.param)


def test_choices_and_constraints_on_every_backend(device_model):
    """The prefill's KV rows copied to n rows go through the backend's copy_into; a constraint
    and logprobs take the logits path: both on each backend."""
    m = device_model
    one = m.generate([[5, 9, 11], [7, 8, 3]], max_new_tokens=4, ignore_eos=True)
    three = m.generate([[5, 9, 11], [7, 8, 3]], max_new_tokens=4, n=3, ignore_eos=True)
    np.testing.assert_array_equal(three, np.repeat(one, 3, 0))
    out = m.generate([5, 9, 11], max_new_tokens=6, return_dict=True, logprobs=1,
                     constraint=lambda: OneOf(m.vocab_size, ALLOWED, 3))
    assert all(t in ALLOWED for t in out.ids[3:6]) and out.ids[6] == EOS and out.finish_reasons == ["stop"]
    _, raw = _reference(m, [5, 9, 11], 1)
    assert abs(out.logprobs[0][0].logprob - log_softmax(raw[0])[out.ids[3]]) <= 1e-4
