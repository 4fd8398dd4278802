"""examples/train_tiny_llama.py: a few Adam steps of the 2-layer tiny Llama (flow DSL, train
mode, rlx_core.Trainer) lower the loss on the toy corpus."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_llama.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_tiny_llama", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loss_falls():
    ex = _example()
    losses = ex.train(steps=25, batch=4, seq=16, lr=1e-2)
    assert len(losses) == 25 and np.isfinite(losses).all()
    # from about ln(vocab) (small random init) at the start to well below it
    vocab = len(set(ex.CORPUS))
    assert abs(losses[0] - np.log(vocab)) < 0.3
    assert np.mean(losses[-5:]) < losses[0] - 0.7, losses
