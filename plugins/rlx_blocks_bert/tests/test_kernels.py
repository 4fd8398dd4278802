"""The bert.* custom ops' NumPy kernels against float64 references, on fresh random inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rlx_blocks_bert import kernels as K


def _gelu64(x):
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in np.asarray(x, np.float64).ravel()]
                    ).reshape(np.shape(x))


def test_gelu_is_the_erf_gelu(rng):
    x = np.concatenate([np.linspace(-12, 12, 200001), 3 * rng.standard_normal(50000),
                        [0.0, -0.0, 1e-30, -1e-30, 8.0, -8.0, 7.999, -7.999, 100.0, -100.0]]).astype(np.float32)
    got = K.gelu_inplace(x.copy())
    err = np.abs(got - _gelu64(x))
    assert (err <= 2e-7 * np.maximum(np.abs(x), 1.0)).all(), err.max()
    y = rng.standard_normal((3, 5, 7)).astype(np.float32)        # shape kept, in place
    z = y.copy()
    assert K.gelu_inplace(z) is z and np.abs(z - _gelu64(y)).max() < 1e-6
    y = rng.standard_normal((300, 700)).astype(np.float32)        # several chunks, with a bias
    b = rng.standard_normal(700).astype(np.float32)
    np.testing.assert_allclose(K.gelu_inplace(y.copy(), b), _gelu64(y + b), atol=1e-6)


@pytest.mark.parametrize("act", ["identity", "gelu", "gelu_tanh", "relu", "silu", "tanh", "sigmoid"])
def test_dense(rng, act):
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    w = rng.standard_normal((24, 16)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    y = x.astype(np.float64) @ w.T.astype(np.float64) + b
    ref = {"identity": y, "gelu": _gelu64(y), "relu": np.maximum(y, 0), "tanh": np.tanh(y),
           "gelu_tanh": 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3))),
           "silu": y / (1 + np.exp(-y)), "sigmoid": 1 / (1 + np.exp(-y))}[act]
    got = K.dense_numpy(x, w, b, act=act)
    assert got.shape == (2, 5, 24) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    wt = np.ascontiguousarray(w.T)                                  # the pre-transposed form
    np.testing.assert_allclose(K.dense_numpy(x, wt, b, act=act, wt=True), ref, atol=2e-5, rtol=1e-5)
    out = np.full((2, 5, 24), np.nan, np.float32)
    K.dense_numpy_into([out], x, wt, b, act=act, wt=True)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(K.dense_numpy(x.astype(np.float16), w.astype(np.float16), act="identity"),
                               x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T,
                               rtol=2e-3, atol=2e-3)


def _segments(rng, lens, gap=0):
    starts, at = [], 0
    for n in lens:
        starts.append(at)
        at += n + gap
    return np.array(starts, np.int64), np.array(lens, np.int64), at


def _attn64(q, k, v, starts, lens, scale):
    """Per-segment float64 reference on [h, T, d]."""
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    for s, n in zip(starts, lens):
        if n:
            a = np.einsum("hqd,hkd->hqk", q[:, s:s + n], k[:, s:s + n]) * scale
            a = np.exp(a - a.max(-1, keepdims=True))
            out[:, s:s + n] = (a / a.sum(-1, keepdims=True)) @ v[:, s:s + n]
    return out


@pytest.mark.parametrize("lens", [[5], [7, 1, 12, 3, 0, 0], [40, 2, 2, 2, 2, 2, 39, 17, 1], [1, 1, 1]])
def test_varlen_attention_both_forms(rng, lens):
    heads, d = 3, 8
    starts, lens, total = _segments(rng, lens)
    qkv = rng.standard_normal((1, total, 3 * heads * d)).astype(np.float32)
    split = [qkv[0, :, i * heads * d:(i + 1) * heads * d].reshape(total, heads, d).transpose(1, 0, 2)
             for i in range(3)]
    ref = _attn64(*[s.astype(np.float64) for s in split], starts, lens, 0.3)
    got = K.varlen_attention_numpy(*[np.ascontiguousarray(s)[None] for s in split], starts, lens, scale=0.3)
    np.testing.assert_allclose(got[0], ref, atol=1e-5)
    got2 = K.varlen_qkv_attention_numpy(qkv, starts, lens, heads=heads, scale=0.3)
    np.testing.assert_allclose(got2[0], ref.transpose(1, 0, 2).reshape(total, heads * d), atol=1e-5)


def test_attention_groups_pad_little_and_bound_memory():
    lens = np.array([3, 300, 4, 5, 299, 3, 3], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    groups = K.attention_groups(starts, lens, heads=12, budget=2 * 12 * 300 * 300)
    seen = sorted(int(i) for idx, valid in groups for i in (idx[valid] if valid is not None else idx.ravel()))
    assert seen == list(range(int(lens.sum())))                     # every token once
    for idx, valid in groups:
        g, top = idx.shape
        real = (valid.sum(1) if valid is not None else np.full(g, top)) ** 2
        padded = g * top * top
        assert padded * 4 <= 5 * real.sum() or (padded - real.sum()) * 12 <= 1 << 16
        assert padded * 12 <= 2 * 12 * 300 * 300
    assert [idx.shape for idx, _ in groups] == [(2, 300), (5, 5)]  # short texts in one group


def test_add_layer_norm(rng):
    x, r = rng.standard_normal((2, 4, 16)).astype(np.float32), rng.standard_normal((2, 4, 16)).astype(np.float32)
    g, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    h = x.astype(np.float64) + r
    ref = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-12) * g + b
    x0 = x.copy()
    np.testing.assert_allclose(K.add_layer_norm_numpy(x, r, g, b, eps=1e-12), ref, atol=1e-5)
    np.testing.assert_array_equal(x, x0)                             # inputs untouched


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_segment_pool(rng, mode):
    starts, lens, total = _segments(rng, [4, 1, 0, 6], gap=2)        # gaps and an empty segment
    x = rng.standard_normal((1, total, 8)).astype(np.float32)
    got = K.segment_pool_numpy(x, starts, lens, mode=mode)
    for i, (s, n) in enumerate(zip(starts, lens)):
        seg = x[0, s:s + n]
        ref = np.zeros(8) if n == 0 else {"mean": seg.mean(0), "cls": seg[0], "max": seg.max(0)}[mode]
        np.testing.assert_allclose(got[i], ref, atol=1e-6)


def test_metas_reject_bad_shapes():
    from rlx_core.ir.dtype import F32, I64
    from rlx_core.ir.errors import ShapeError
    from rlx_core.ir.shape import Shape

    x, w = Shape((1, "t", 16), F32), Shape((8, 12), F32)
    seg = Shape(("s",), I64)
    with pytest.raises(ShapeError, match="disagree on K"):
        K.dense_meta([x, w], {"act": "identity"})
    assert K.dense_meta([x, Shape((16, 8), F32), Shape((8,), F32)], {"act": "gelu", "wt": True})[0].dims \
        == (1, "t", 8)
    with pytest.raises(ShapeError, match="disagree on K"):
        K.dense_meta([x, Shape((8, 16), F32)], {"act": "identity", "wt": True})
    with pytest.raises(ShapeError, match="act must be"):
        K.dense_meta([x, Shape((8, 16), F32)], {"act": "mish"})
    with pytest.raises(ShapeError, match="3 x heads"):
        K.varlen_qkv_meta([Shape((1, "t", 16), F32), seg, seg], {"heads": 3, "scale": 1.0})
    with pytest.raises(ShapeError, match="int vector"):
        K.segment_pool_meta([x, Shape(("s",), F32), seg], {"mode": "mean"})
    assert K.segment_pool_meta([x, seg, seg], {"mode": "cls"})[0].dims == ("s", 16)


def test_out_kernels_fill_every_output_element(rng):
    """The kernels that write into the arena's (reused, garbage-filled) outputs: NaN-filled
    outputs come back equal to the references, gaps between segments as zeros."""
    def nan(*shape):
        return np.full(shape, np.nan, np.float32)

    x = rng.standard_normal((1, 7, 16)).astype(np.float32)
    w, b = rng.standard_normal((24, 16)).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    for act in ("identity", "gelu", "silu"):
        out = nan(1, 7, 24)
        K.dense_numpy_into([out], x, w, b, act=act)
        np.testing.assert_allclose(out, K.dense_numpy(x, w, b, act=act), atol=1e-6)
    heads, d = 3, 8
    starts, lens, total = _segments(rng, [5, 0, 9, 1, 2], gap=2)
    qkv = rng.standard_normal((1, total, 3 * heads * d)).astype(np.float32)
    split = [qkv[0, :, i * heads * d:(i + 1) * heads * d].reshape(total, heads, d).transpose(1, 0, 2)
             for i in range(3)]
    ref = _attn64(*[s.astype(np.float64) for s in split], starts, lens, 0.3)
    out = nan(1, total, heads * d)
    K.varlen_qkv_attention_into([out], qkv, starts, lens, heads=heads, scale=0.3)
    np.testing.assert_allclose(out[0], ref.transpose(1, 0, 2).reshape(total, heads * d), atol=1e-5)
    r, g, beta = (rng.standard_normal(s).astype(np.float32) for s in ((1, 7, 16), 16, 16))
    out = nan(1, 7, 16)
    K.add_layer_norm_into([out], x, r, g, beta, eps=1e-12)
    h = x.astype(np.float64) + r
    np.testing.assert_allclose(out, (h - h.mean(-1, keepdims=True)) / h.std(-1, keepdims=True) * g + beta,
                               atol=1e-5)
    xs = rng.standard_normal((1, total, 8)).astype(np.float32)
    out = nan(len(starts), 8)
    K.segment_pool_into([out], xs, starts, lens, mode="mean")
    ref = [xs[0, s:s + n].mean(0) if n else np.zeros(8) for s, n in zip(starts, lens)]
    np.testing.assert_allclose(out, np.array(ref), atol=1e-6)
