"""The numpy attention kernel runs long queries in blocks of rows (so a long joint sequence
never holds its whole [heads, S, S] scores): blocked results equal the one-block result for
every mask kind, with GQA, per-row positions and masks of every broadcast shape, and the
peak memory of a long attention stays below one [heads, S, S] score block."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from rlx_core.ir import numpy_kernels as K
from rlx_core.ir.ops import MaskKind


def _attrs(kind, window=0, softcap=0.0):
    return {"scale": 0.3, "softcap": softcap, "mask_kind": kind.value, "window": window}


@pytest.mark.parametrize("kind,mask_shape,with_pos", [
    (MaskKind.NONE, None, False), (MaskKind.CAUSAL, None, False), (MaskKind.CAUSAL, (2, 1, 1, 13), True),
    (MaskKind.SLIDING_WINDOW, (1, 1, 11, 13), False), (MaskKind.CUSTOM, (2, 4, 11, 13), False),
    (MaskKind.BIAS, (11, 13), False)])
def test_blocked_rows_equal_one_block(rng, monkeypatch, kind, mask_shape, with_pos):
    q = rng.standard_normal((2, 4, 11, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 13, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 13, 5)).astype(np.float32)
    mask = None
    if mask_shape is not None:
        mask = (rng.standard_normal(mask_shape).astype(np.float32) if kind is MaskKind.BIAS
                else rng.random(mask_shape) > 0.3)
        if mask.dtype == bool:
            mask[..., 0] = True                   # no fully masked row (kernels differ there)
    pos = np.array([0, 2], np.int64) if with_pos else None
    a = _attrs(kind, window=4 if kind is MaskKind.SLIDING_WINDOW else 0, softcap=2.0)
    whole = K.attention_core(a, q, k, v, mask, pos)
    monkeypatch.setattr(K, "_ATTN_BLOCK", 4 * 13 * 3)     # 3 query rows a block
    blocked = K.attention_core(a, q, k, v, mask, pos)
    assert np.isfinite(whole).all()
    np.testing.assert_allclose(blocked, whole, rtol=0, atol=1e-6)


def test_long_attention_peak_memory_below_one_score_block(rng):
    h, s, d = 4, 2500, 8          # scores 100 MB; blocks of 1 << 22 elements (16 MB)
    q, k, v = (rng.standard_normal((1, h, s, d)).astype(np.float32) for _ in range(3))
    score_block = h * s * s * 4
    tracemalloc.start()
    try:
        out = K.attention_core(_attrs(MaskKind.NONE), q, k, v)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < score_block, f"peak {peak >> 20} MiB, one [heads, S, S] block is {score_block >> 20} MiB"
    ref = K.attention_core(_attrs(MaskKind.NONE), q[:, :, :7], k, v)
    np.testing.assert_allclose(out[:, :, :7], ref, rtol=0, atol=1e-6)
