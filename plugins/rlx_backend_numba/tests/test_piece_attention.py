"""Attention of a few query rows over a long cache (a decode step's row, a prefill piece riding
a decode step: issue 48) through the numba runner's split-keys kernel, against float64 numpy
on fresh random inputs: pieces of 1-16 queries after 0 to a few thousand cached keys, as the
mixed graph lays them out (q a view of the packed rows, o in the output projection's order, a
[1, 1, 1, ctx] key mask, causal from the piece's position), the register tiles (f32, rows a
multiple of 8) and the dot products (f64, odd head sizes), masks per head and query row,
windows, softcap, a bias, rows with every key masked, and many small chunks merged."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from rlx_backend_numba import runner  # noqa: E402
from rlx_core.testing import parity  # noqa: E402
from rlx_core.testing.parity import rng  # noqa: E402,F401  (seeded per test; RLX_TEST_SEED replays)

EPS = {np.dtype(np.float32): np.finfo(np.float32).eps, np.dtype(np.float64): np.finfo(np.float64).eps}


def spy(monkeypatch) -> list:
    """Calls of the split-keys kernel (so a test cannot pass on another path)."""
    calls = []
    kern = runner.K.attention_split_keys
    monkeypatch.setattr(runner.K, "attention_split_keys", lambda *a: calls.append(a[0].shape) or kern(*a))
    return calls


def check(o, q, k, v, mask, pos, a):
    """o against float64. A row is a convex combination of value rows: its error is at most
    the scores' (d terms a dot, scaled) and the sums' (keys / 8 lanes a chunk, then the
    merge) rounding, times the largest |v|: 64 eps per (d + keys / 8) ** 0.5 bounds it
    with room, and stays far below what one dropped key of a thousand moves."""
    m64 = None if mask is None or mask.dtype == np.bool_ else mask.astype(np.float64)
    want = parity.ref_attention(*(x.astype(np.float64) for x in (q, k, v)), mask if m64 is None else m64,
                                pos, scale=a["scale"], mask_kind=a["mask_kind"], window=a["window"],
                                softcap=a["softcap"])
    eps = EPS[np.dtype(o.dtype)]
    atol = 64 * eps * np.sqrt(q.shape[3] + k.shape[2] / 8) * max(float(np.abs(v).max()), 1e-30)
    np.testing.assert_allclose(o, want, rtol=0, atol=atol)
    return want


def attrs(kind="causal", window=0, scale=0.125, softcap=0.0) -> dict:
    return {"mask_kind": kind, "window": window, "scale": scale, "softcap": softcap}


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 8, 11, 16])
def test_piece_after_cached_keys(rng, monkeypatch, piece):
    """A piece of `piece` tokens at position `filled` of a prompt's states (ctx keys, those past
    filled + piece masked), 9 heads on 3 kv heads of 64, as the mixed graph runs it: equal to
    float64 for a cache empty, of one key, and a few thousand (odd) keys."""
    calls = spy(monkeypatch)
    for filled in (0, 1, int(rng.integers(2, 3000)) | 1):
        ctx = filled + piece + int(rng.integers(0, 300))
        packed = rng.standard_normal((1, 9, 5 + piece, 64)).astype(np.float32)
        q = packed[:, :, 5:]                                    # the piece's rows of the packed tokens
        k, v = (rng.standard_normal((1, 3, ctx, 64)).astype(np.float32) for _ in "kv")
        o = np.full((1, piece, 9, 64), np.nan, np.float32).transpose(0, 2, 1, 3)
        mask = np.zeros((1, 1, 1, ctx), bool)
        mask[..., :filled + piece] = True
        pos = np.array([filled], np.int32)
        a = attrs(scale=float(rng.uniform(0.1, 0.6)))          # (peaked rows: each key weighs)
        runner._attention_fn(a, q, k, v, o, mask)(q, k, v, mask, pos)
        check(o, q, k, v, mask, pos, a)
    assert len(calls) == 3


@pytest.mark.parametrize("dt,d,dv", [(np.float32, 64, 24), (np.float32, 12, 16), (np.float64, 16, 16)],
                         ids=["tiles_odd_lane_group", "f32_dots", "f64_dots"])
@pytest.mark.parametrize("piece", [1, 7, 16])
def test_head_sizes_and_dtypes(rng, monkeypatch, dt, d, dv, piece):
    """The register tiles with a value row of three lane groups (the last one twice), and the
    dot products (a head size no multiple of 8, float64): two sequences at different
    positions, 6 heads on 2 kv heads."""
    calls = spy(monkeypatch)
    ctx = 700 + int(rng.integers(0, 64))
    q = rng.standard_normal((2, 6, piece, d)).astype(dt)
    k = rng.standard_normal((2, 2, ctx, d)).astype(dt)
    v = rng.standard_normal((2, 2, ctx, dv)).astype(dt)
    o = np.full((2, 6, piece, dv), np.nan, dt)
    pos = np.array([int(rng.integers(0, ctx - piece)), ctx - piece], np.int32)
    a = attrs(scale=d ** -0.5)
    runner._attention_fn(a, q, k, v, o, None)(q, k, v, None, pos)
    check(o, q, k, v, None, pos, a)
    assert calls


@pytest.mark.parametrize("kind,window,mask,softcap", [("causal", 0, "bool_rows", 0.0),
                                                      ("sliding_window", 37, "bool_keys", 0.0),
                                                      ("causal", 0, "bias", 5.0),
                                                      ("custom", 0, "bool_rows", 0.0)])
def test_masks_per_row_and_head(rng, monkeypatch, kind, window, mask, softcap):
    """Masks that differ by query row (and head, for the bias), a key mask with holes, a
    window that moves with each query row, softcap; one query row with every key masked
    gives zeros, as every other path does. Many small chunks (16 threads' split) are merged,
    some of them empty for the shorter sequence."""
    calls = spy(monkeypatch)
    monkeypatch.setattr(runner.numba, "get_num_threads", lambda: 16)
    piece, ctx = 13, 1500 + int(rng.integers(0, 64))
    q = rng.standard_normal((2, 9, piece, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 3, ctx, 32)).astype(np.float32) for _ in "kv")
    pos = np.array([ctx - piece, int(rng.integers(0, 400))], np.int32)
    if mask == "bool_rows":
        m = rng.random((2, 1, piece, ctx)) < 0.7
        m[1, 0, 4] = False                                     # every key of one row masked
    elif mask == "bool_keys":
        m = rng.random((2, 1, 1, ctx)) < 0.8
    else:
        m = rng.standard_normal((1, 9, piece, ctx)).astype(np.float32)
    o = np.full((2, 9, piece, 32), np.nan, np.float32)
    a = attrs(kind, window, scale=0.3, softcap=softcap)
    runner._attention_fn(a, q, k, v, o, m)(q, k, v, m, pos)
    want = check(o, q, k, v, m, pos, a)
    if mask == "bool_rows":
        assert not o[1, :, 4].any() and not want[1, :, 4].any()
    assert calls


def test_nan_scores_reach_the_output(rng, monkeypatch):
    """A NaN in a key reaches every query row that sees it (numpy's softmax), not only the
    decode row: the tiles' row max keeps it."""
    spy(monkeypatch)
    q = rng.standard_normal((1, 3, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 50, 16)).astype(np.float32) for _ in "kv")
    k[0, 0, 40, 3] = np.nan
    o = np.zeros((1, 3, 4, 16), np.float32)
    pos = np.array([38], np.int32)                             # rows at 38..41: the last two see key 40
    runner._attention_fn(attrs(), q, k, v, o, None)(q, k, v, None, pos)
    assert np.isfinite(o[0, :, :2]).all() and np.isnan(o[0, :, 2:]).all()
