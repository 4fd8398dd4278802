"""Next-token choice with HF generate's meanings: temperature, then top-k, then top-p,
min_new_tokens suppressing EOS; greedy when do_sample is false."""
from __future__ import annotations

import numpy as np


def process_logits(logits: np.ndarray, *, n_new: int, min_new_tokens: int, eos_ids,
                   inplace: bool = False) -> np.ndarray:
    """float32 logits with EOS banned until min_new_tokens (changed in place when allowed,
    else in a copy, and only then)."""
    out = logits.astype(np.float32, copy=False)
    if n_new < min_new_tokens and eos_ids:
        out = out if inplace else out.copy()
        out[:, list(eos_ids)] = -np.inf
    return out


def warp(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    """float64 logits shifted so each row's max is 0, then divided by the temperature: no
    overflow for any temperature > 0 (a tiny one only sends the others to -inf)."""
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    if temperature and temperature != 1.0:
        x /= temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(x, axis=-1, kind="stable")          # ascending, as HF
        sorted_x = np.take_along_axis(x, order, axis=-1)
        p = np.exp(sorted_x - sorted_x[:, -1:])
        p /= p.sum(-1, keepdims=True)
        cum = np.cumsum(p, axis=-1)
        remove = cum <= (1 - top_p)
        remove[:, -1] = False                                   # keep at least one
        rm = np.zeros_like(remove)
        np.put_along_axis(rm, order, remove, axis=-1)
        x = np.where(rm, -np.inf, x)
    return x


def choose(logits: np.ndarray, rng: np.random.Generator | None, do_sample: bool, temperature: float,
           top_k: int | None, top_p: float | None) -> np.ndarray:
    if not do_sample:
        return np.argmax(logits, axis=-1)
    x = warp(logits, temperature, top_k, top_p)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])
