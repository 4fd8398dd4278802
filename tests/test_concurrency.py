"""One model used from 8 threads at once: `generate`, `logits` (a CausalLM) and `embed`,
`forward` (an Encoder) give results bitwise equal to the same calls made one at a time,
on every backend that is available here."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rlx_core.plugins import registry

pytest.importorskip("rlx_blocks_llama")
pytest.importorskip("rlx_blocks_bert")
from tiny_models import LLAMA, tiny_bert, tiny_llama  # noqa: E402

THREADS = 8


def _available(name: str) -> None:
    b = registry().backends.get(name)
    ok, why = b.availability() if b else (False, f"rlx-backend-{name} is not installed")
    if not ok:
        pytest.skip(f"{name} backend not available: {why}")


def _jobs(lm, enc, rng) -> list:
    """Mixed calls (different prompts, lengths, batches and kinds), 3 per thread."""
    v = LLAMA["vocab_size"]
    ids = lambda n: [int(x) for x in rng.integers(3, v, n)]          # noqa: E731
    words = lambda n: " ".join(f"w{int(x)}" for x in rng.integers(0, 45, n))  # noqa: E731
    jobs = []
    for k in range(THREADS):
        p, q = ids(2 + k % 5), ids(6 - k % 4)
        mask = np.ones((2, 7), np.int64)
        mask[0, :k % 4] = 0
        batch = np.array([ids(7), ids(7)])
        jobs += [
            lambda p=p: lm.generate(p, max_new_tokens=12, min_new_tokens=12),
            lambda p=p, q=q: lm.generate([p, q], max_new_tokens=9),                       # left-padded batch
            lambda p=p, k=k: lm.generate(p, max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9,
                                         temperature=0.8, seed=k),
            lambda w=words(3 + k): lm.generate(w, max_new_tokens=6),
            lambda b=batch, m=mask: lm.logits(b, attention_mask=m),
            lambda q=q: lm.logits([q]),
            lambda t=[words(2 + k), words(9 - k), words(1)]: enc.embed(t),
            lambda b=batch: enc.forward(np.minimum(b, 49))["last_hidden_state"],
        ]
    order = rng.permutation(len(jobs))
    return [jobs[i] for i in order[:3 * THREADS]]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == np.asarray(b).dtype and np.array_equal(a, b, equal_nan=True)
    return a == b


@pytest.mark.parametrize("backend", ["numpy", "opencl", "cuda"])
def test_threads_give_the_sequential_results(backend, rng):
    _available(backend)
    seeds = rng.integers(0, 2**32, 3)
    models = lambda: (tiny_llama(np.random.default_rng(seeds[0]), backend),          # noqa: E731
                      tiny_bert(np.random.default_rng(seeds[1]), backend))
    want = [job() for job in _jobs(*models(), np.random.default_rng(seeds[2]))]     # one at a time
    jobs = _jobs(*models(), np.random.default_rng(seeds[2]))   # the same calls on fresh (uncompiled) models
    start = threading.Barrier(THREADS)

    def worker(k: int) -> list:
        start.wait()
        return [jobs[i]() for i in range(k, len(jobs), THREADS)]

    for _ in range(2):                                  # compiling in the threads, then compiled
        with ThreadPoolExecutor(THREADS) as pool:
            got = list(pool.map(worker, range(THREADS)))
        for k, results in enumerate(got):
            for i, res in zip(range(k, len(jobs), THREADS), results):
                assert _same(res, want[i]), f"call {i} differs when run from thread {k}"
