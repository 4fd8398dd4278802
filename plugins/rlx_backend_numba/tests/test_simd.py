"""simd.py's eight-lane vectors against NumPy on the same lanes: loads (u8 zero-extended,
i8 sign-extended, f32), integer bit ops with vector and scalar operands, conversion,
multiply-add, lane bits of a word, the horizontal sum and max, lane-wise max, the lanes
below a count and the store."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
from numba import njit  # noqa: E402

from rlx_backend_numba.simd import (below, bits, exp, fma, hmax, hsum, load_f32,  # noqa: E402
                                    load_i8, load_u8, store_bf16_part, store_bf16_part_normal, store_lanes,
                                    to_f32, vmax, zeros)


@njit(cache=False)
def _lanes(raw, f, word, out):
    u = load_u8(raw, 3)                                  # unaligned on purpose
    s = load_i8(raw, 3)
    store_lanes(out, 0, to_f32(u))
    store_lanes(out, 8, to_f32(s))
    store_lanes(out, 16, to_f32(((u & 15) | (u >> 4) << 2) - 5))
    store_lanes(out, 24, to_f32(bits(word, 3)))
    v = load_f32(f, 1)
    store_lanes(out, 32, fma(v, 2.0, zeros() + 1.0) - v * v)
    out[40] = hsum(v)


def test_lanes_match_numpy(rng):
    raw = rng.integers(0, 256, 16, dtype=np.uint8)
    f = rng.standard_normal(12).astype(np.float32)
    word = int(rng.integers(0, 2 ** 32))
    out = np.full(41, np.nan, np.float32)
    _lanes(raw, f, word, out)
    u = raw[3:11].astype(np.int64)
    np.testing.assert_array_equal(out[0:8], u)
    np.testing.assert_array_equal(out[8:16], raw[3:11].view(np.int8))
    np.testing.assert_array_equal(out[16:24], ((u & 15) | (u >> 4) << 2) - 5)
    np.testing.assert_array_equal(out[24:32], [(word >> (3 + j)) & 1 for j in range(8)])
    v = f[1:9].astype(np.float64)
    np.testing.assert_allclose(out[32:40], v * 2 + 1 - v * v, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[40], v.sum(), rtol=1e-6, atol=1e-6)


@njit(cache=False)
def _max_below(a, b, k, out):
    x, y = load_f32(a, 0), load_f32(b, 0)
    store_lanes(out, 0, vmax(x, y))
    store_lanes(out, 8, below(x, k, -np.inf))
    out[16] = hmax(x)
    out[17] = hmax(below(x, k, -np.inf))


@pytest.mark.parametrize("k", [-1, 0, 3, 8, 20])
def test_max_and_lanes_below_a_count(k, rng):
    """vmax lane-wise, hmax across lanes, below(v, k, fill): lanes 0..k-1 kept, the rest
    `fill` (k past either end keeps all or none; a masked softmax row's tail)."""
    a, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    out = np.full(18, np.nan, np.float32)
    _max_below(a, b, k, out)
    np.testing.assert_array_equal(out[:8], np.maximum(a, b))
    kept = np.where(np.arange(8) < k, a, -np.inf)
    np.testing.assert_array_equal(out[8:16], kept)
    assert out[16] == a.max() and out[17] == kept.max()


@njit(cache=False)
def _exp(x, o):
    for i in range(0, x.shape[0], 8):
        store_lanes(o, i, exp(load_f32(x, i)))


def test_exp_lanes_against_float64(rng):
    """Within 2 ulp of e^x where the result is a normal float below 88.37; 0 below -87.33,
    +inf above 88.37, NaN for NaN (a softmax's masked scores are -inf)."""
    x = np.concatenate([rng.uniform(-87.3, 88.3, 40000), rng.uniform(-2, 2, 40000),
                        [0.0, -0.0, 1e-30, -1e-30, -87.3, 88.3, -90.0, 89.0, -np.inf, np.inf, np.nan, -1e4, 1e4,
                         -88.0, 88.5, 1.0]]).astype(np.float32)
    out = np.empty_like(x)
    _exp(x, out)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64))
    normal = (x > -87.33) & (x < 88.37)
    np.testing.assert_allclose(out[normal], want[normal], rtol=2 * 2.0 ** -23, atol=0)
    assert (out[(x < -87.33)] == 0).all() and (out[x > 88.37] == np.inf).all()
    assert np.isnan(out[np.isnan(x)]).all()


@njit(cache=False)
def _to_bf16(x, o):
    for i in range(0, x.shape[0], 8):
        store_lanes(o, i, load_f32(x, i))


def test_store_lanes_rounds_to_bf16_in_uint16_rows(rng):
    """Into a uint16 array the lanes are bf16 bits, rounded to nearest with ties to even as
    ml_dtypes rounds: random values, exact ties both ways (finite: NaN is not kept apart),
    infinities, signed zeros."""
    import ml_dtypes

    # High halves below 0x7F80 keep the exponent finite (the kernel does not keep NaN apart),
    # with a random sign; the low half 0x8000 is the exact tie.
    high = rng.integers(0, 0x7F80, 16, dtype=np.uint32) | (rng.integers(0, 2, 16, dtype=np.uint32) << 15)
    ties = ((high << 16) | 0x8000).view(np.float32)
    x = np.concatenate([rng.standard_normal(64) * 10.0 ** rng.integers(-30, 30, 64), ties,
                        [0.0, -0.0, np.inf, -np.inf, 1.0, -3.5, 65504.0, 1e-40]]).astype(np.float32)
    x = x[: x.size // 8 * 8]
    out = np.zeros(x.size, np.uint16)
    _to_bf16(x, out)
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.bfloat16).view(np.uint16))


def _splitter(store):
    @njit(cache=False)
    def split3(x, parts):
        for i in range(0, x.shape[0], 8):
            v = load_f32(x, i)
            for j in range(3):
                v = store(parts[j], i, v)
    return split3


_SPLITS = {"store_bf16_part": _splitter(store_bf16_part),
           "store_bf16_part_normal": _splitter(store_bf16_part_normal)}


@pytest.mark.parametrize("store", sorted(_SPLITS))
def test_store_bf16_part_splits_f32_into_three_exact_bf16_parts(store, rng):
    """Each part is the bf16 nearest what the parts before it leave (ml_dtypes' rounding), and
    the three add up to x exactly: x's 24 significand bits, over exponents far apart, ties,
    signed zeros, values down to 2**-100 (whose parts are normal too: the
    `_normal` store, which uses vcvtneps2bf16 on AVX512-BF16 hosts, is exact on them)."""
    import ml_dtypes

    high = rng.integers(0x0100, 0x7F00, 16, dtype=np.uint32) | (rng.integers(0, 2, 16, dtype=np.uint32) << 15)
    ties = ((high << 16) | 0x8000).view(np.float32)
    x = np.concatenate([rng.standard_normal(64) * 10.0 ** rng.integers(-30, 30, 64), ties,
                        [0.0, -0.0, 1.0, -3.5, 65504.0, 1.0 + 2.0 ** -23, -(1.0 + 2.0 ** -9 + 2.0 ** -17)]])
    x = x.astype(np.float32)[: x.size // 8 * 8]
    x[(x != 0) & (np.abs(x) < 2.0 ** -100)] *= np.float32(2.0 ** 40)      # parts stay normal
    bits = np.full((3, x.size), 0xFFFF, np.uint16)
    _SPLITS[store](x, bits)
    parts = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    rest = x.astype(np.float64)
    for p in parts:
        nearest = rest.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(p, nearest)
        rest = rest - p
    assert (rest == 0).all()


@pytest.mark.parametrize("vnni", [True, False], ids=["host", "plain-llvm"])
def test_dot4_and_store_words(vnni, monkeypatch, rng):
    """dot4's lane j adds the four products u[4j + e] * x's byte e (u unsigned, x signed) to
    the accumulator exactly, in vpdpbusd where the CPU has VNNI and in the plain-LLVM form
    (compiled here by hiding VNNI) either way; store_words scatters the 32 bytes' words."""
    from rlx_backend_numba import simd

    if vnni and not simd.VNNI:
        pytest.skip("the CPU has no VNNI (avxvnni, or avx512vnni with avx512vl)")
    monkeypatch.setattr(simd, "VNNI", vnni)

    @njit(cache=False)
    def run(u, x4, words, sums):
        acc = simd.izeros()
        for g in range(x4.shape[0]):
            acc = simd.dot4(acc, simd.load_bytes32(u, 32 * g), x4[g])
        store_lanes(sums, 0, to_f32(acc))                # exact: |sums| < 2 ** 24
        simd.store_words(words, 1, 3, simd.load_bytes32(u, 0))

    u = rng.integers(0, 256, 3 * 32, dtype=np.uint8)
    u[:32] = 255                                         # the largest products of a lane
    x = rng.integers(-128, 128, 3 * 4, dtype=np.int8)
    x[:4] = -128
    words, got = np.zeros(25, np.int32), np.full(8, np.nan, np.float32)
    run(u, x.view(np.int32), words, got)
    want = (u.reshape(3, 8, 4).astype(np.int64) * x.reshape(3, 1, 4)).sum(axis=(0, 2))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(words[1::3], u[:32].view(np.int32))
    assert not words[0] and not words[2::3].any()


def test_k4_factors_pair_lanes_and_high_lanes(rng):
    """k4_factors decodes a q4_k super-block's header (every 6-bit scale and min pattern of
    the 12 packed bytes, d and dmin as f16, a NaN among them) into the products the int8
    GEMV scales its sub-blocks by, exactly: lane j sc_j d xd[c + j] (odd j / 16), lane 8 + j
    m_j (-dmin) xs[c + j]; pair_lanes repeats lanes 2k, 2k + 1 eight times each; add_high8
    adds lanes 8..15 only; high8 reads them."""
    from rlx_backend_numba import simd
    if not simd.AVX512:
        pytest.skip("the CPU has no AVX-512 (F32x16)")

    @njit(cache=False)
    def run(r, o, xd, xs, c, out):
        g = simd.k4_factors(r, o, xd, xs, c)
        store_lanes(out, 0, g)
        store_lanes(out, 16, simd.pair_lanes(g, 3))
        store_lanes(out, 32, simd.add_high8(g, g))
        store_lanes(out, 48, simd.high8(g))

    rows = rng.integers(0, 256, (300, 2 * 144), dtype=np.uint8)
    d = rng.uniform(-2, 2, (300, 2, 2)).astype(np.float16)
    d[7, 1, 0] = np.nan
    rows.reshape(300, 2, 144)[:, :, :4] = d.view(np.uint8).reshape(300, 2, 4)
    xd = rng.uniform(0, 0.1, 24).astype(np.float32)
    xs = rng.uniform(-3, 3, 24).astype(np.float32)
    for n in range(300):
        for blk, c in ((0, 3), (1, 16)):
            o = 144 * blk
            sc, mn = (np.array(v, np.float32) for v in zip(*(q4k_scale_min(rows[n, o + 4:o + 16], j) for j in range(8))))
            dd, dmin = (np.float32(v) for v in d[n, blk])
            want = np.concatenate([(sc * (dd * np.float32([1, 1 / 16] * 4))) * xd[c:c + 8],
                                   (mn * -dmin) * xs[c:c + 8]]).astype(np.float32)
            out = np.full(56, -1, np.float32)
            run(rows[n], o, xd, xs, c, out)
            np.testing.assert_array_equal(out[:16], want)
            np.testing.assert_array_equal(out[16:32], np.repeat(want[6:8], 8))
            np.testing.assert_array_equal(out[32:48], np.concatenate([want[:8], 2 * want[8:]]))
            np.testing.assert_array_equal(out[48:56], want[8:])


def q4k_scale_min(b, j):
    """llama.cpp's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 bytes b."""
    b = b.astype(np.int32)
    if j < 4:
        return b[j] & 63, b[j + 4] & 63
    return (b[j + 4] & 15) | ((b[j - 4] >> 6) << 4), (b[j + 4] >> 4) | ((b[j] >> 6) << 4)
