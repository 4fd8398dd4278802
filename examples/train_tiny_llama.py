"""Train a 2-layer tiny Llama, built with the flow DSL, on a toy character corpus.

The recipe's `train` mode gives a cache-free graph whose output `loss` is the mean token
cross-entropy; `rlx_core.Trainer` compiles it with its gradients and Adam's update into one
step graph, the weights and Adam's moments kept on the backend, so a step moves only the
batch in and the loss out.

    python examples/train_tiny_llama.py --steps 300            # numpy
    python examples/train_tiny_llama.py --backend cuda         # any backend that runs the graph
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from rlx_core import Adam, Trainer
from rlx_core.runtime.model import find_recipe

CORPUS = ("the quick brown fox jumps over the lazy dog. a small model learns to spell the words it "
          "reads again and again. the dog sleeps, the fox runs, and the model counts the letters. ")


def config(vocab: int, seq: int) -> dict:
    return dict(model_type="llama", vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, num_hidden_layers=2, max_position_embeddings=seq, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=True)


def init_weights(cfg: dict, rng) -> dict:
    """HF-named float32 weights: norms at one, matrices N(0, 0.02) (the LLaMA init)."""
    tensors = find_recipe("llama").tiny_tensors(cfg, rng)
    return {k: (np.ones_like(v) if "norm" in k else 0.02 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in tensors.items()}


def train(steps: int = 300, backend: str = "numpy", batch: int = 8, seq: int = 32, lr: float = 3e-3,
          seed: int = 0, log_every: int = 0) -> list:
    """Train `steps` Adam steps on random windows of CORPUS; returns the loss of every step."""
    rng = np.random.default_rng(seed)
    chars = sorted(set(CORPUS))
    data = np.array([chars.index(c) for c in CORPUS], np.int64)
    cfg = config(len(chars), seq)
    built = find_recipe("llama").flow_class.for_training(cfg, batch=batch, seq=seq).build(init_weights(cfg, rng))
    trainer = Trainer(built.graph, built.params, Adam(lr, betas=(0.9, 0.99)), backend=backend)
    fixed = {"positions": np.tile(np.arange(seq), (batch, 1)), "key_mask": np.ones((batch, 1, 1, seq), bool)}
    losses = []
    for step in range(steps):
        start = rng.integers(0, len(data) - seq - 1, batch)
        window = data[start[:, None] + np.arange(seq + 1)]
        losses.append(trainer.step({**fixed, "ids": window[:, :-1], "labels": window[:, 1:]}))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backend", default="numpy", help="numpy (default), numba, cuda, ...")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    losses = train(a.steps, a.backend, a.batch, a.seq, a.lr, a.seed, log_every=max(1, a.steps // 15))
    dt = time.perf_counter() - t
    print(f"{a.backend}: loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f} (mean of the last 10) in "
          f"{a.steps} steps, {dt:.1f} s ({1e3 * dt / a.steps:.1f} ms/step)")


if __name__ == "__main__":
    main()
