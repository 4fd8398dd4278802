"""numba's one-region moe_experts steps (rlx_backend_numba/moe.py): the GEMV step (`gemv_<up><down>`:
f32 or int8 x, f32 or int8 h) and the int8 GEMM step (`igemm_step`, every stack packed), each
with the expert width split into several slices (the down products then summed by the
combine), against float64 references on fresh random inputs. The int8 steps round h
themselves: h is checked against the float64 gated MLP, and the down products against
float64 products of the step's own h rounded by rlx_core's int8_b32 (so a rounding at a
tie of the f32 h cannot make the check flaky)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from rlx_core.ir.quant import QuantScheme  # noqa: E402
from rlx_core.testing.parity import rng  # noqa: E402,F401  (seeded per test; RLX_TEST_SEED replays)

from rlx_backend_numba import moe as M  # noqa: E402
from rlx_backend_numba.quant_kernels import BLOCK, FORMATS  # noqa: E402

E, H, I = 5, 256, 512           # I: two k-quant blocks (two slices), sixteen of 32
TRIPLES = [("q4_0", "q4_1", "q5_0"), ("q5_1", "q8_0", "q4_k"), ("q5_k", "q4_k", "q6_k")]
assert {s for t in TRIPLES for s in t} == set(FORMATS)


# The activation is generated per module: the first triple's module is test_moe_numba.py's
# (gelu_tanh there), so a cold numba cache compiles it once for both files.
ACTS = {"silu": lambda v: v / (1 + np.exp(-v)),
        "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))}
ACT_OF = {TRIPLES[0]: "gelu_tanh"}


def int8_rounded(x):
    i8 = QuantScheme.parse("int8_b32")
    return i8.dequantize(i8.quantize(x), x.shape)


def stacks(rng, schemes):
    """(gate, up, down) packed u8 [E, rows, bytes] and decoded to float64 by the reference decoder."""
    raw, f64 = [], []
    for shape, s in zip([(E, I, H), (E, I, H), (E, H, I)], schemes):
        w = (rng.standard_normal(shape) / np.sqrt(shape[2])).astype(np.float32)
        q = QuantScheme.parse(s)
        packed = np.stack([q.quantize(w[i]) for i in range(E)])
        raw.append(packed)
        f64.append(np.stack([q.dequantize_reference(packed[i], shape[1:]) for i in range(E)]))
    return raw, f64


def most_slices(groups, threads, inter, down_kind):
    """gemv_slices' largest choice: every block of down's format (or of 32) its own slice."""
    return inter // (BLOCK[down_kind][0] if down_kind else 32)


def check(ys, h, x, tok, expert_of, f64, round_h, act="silu"):
    """h against the float64 gated MLP of x; the summed slices of ys against down @ (h, rounded
    where round_h) in float64."""
    gate, up, down = f64
    want_h, want_y = np.empty((tok.shape[0], I)), np.empty((tok.shape[0], H))
    for s, (t, e) in enumerate(zip(tok, expert_of)):
        xt = x[t].astype(np.float64)
        want_h[s] = ACTS[act](gate[e] @ xt) * (up[e] @ xt)
        hs = int8_rounded(h[s][None])[0] if round_h else h[s]
        want_y[s] = down[e] @ hs.astype(np.float64)
    np.testing.assert_allclose(h, want_h, rtol=2e-5, atol=2e-6 * np.abs(want_h).max())
    np.testing.assert_allclose(ys.astype(np.float64).sum(0), want_y, rtol=2e-5, atol=2e-6 * np.abs(want_y).max())


def routed(rng, t, k):
    """A route of t tokens to k distinct experts each: the pairs' tokens, the experts with
    pairs, their groups' starts, each pair's expert."""
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(t)]).astype(np.int64)
    weights = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    tok, wt, slot, experts, starts, bad = M.route(ids, E, weights)
    assert bad < 0
    return tok, experts, starts, np.repeat(experts, np.diff(starts))     # each pair's expert


# every triple in the f32 and the int8 mode; the mixed modes (the same template's pieces) once
GEMV_CASES = [(t, m) for t in TRIPLES for m in ("ff", "ii")] + [(TRIPLES[2], "fi"), (TRIPLES[2], "if")]


@pytest.mark.parametrize("schemes,modes", GEMV_CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_gemv_step_slices(rng, schemes, modes, monkeypatch):
    """The GEMV step in each (x, h) mode, on one thread and on all, its width in every slice."""
    monkeypatch.setattr(M, "gemv_slices", most_slices)
    raw, f64 = stacks(rng, schemes)
    kinds = tuple(QuantScheme.parse(s).kind for s in schemes)
    act = ACT_OF.get(schemes, "silu")
    mod = M.kernels(kinds, act)
    int8_x, int8_h = modes[0] == "i", modes[1] == "i"
    for t, k in ((1, 2), (37, 3)):
        x = rng.standard_normal((t, H)).astype(np.float32)
        if int8_x:
            x = int8_rounded(x)
        tok, experts, starts, expert_of = routed(rng, t, k)
        h = np.full((tok.shape[0], I), np.nan, np.float32)
        ys = M._gemv(mod, kinds, x, tok, experts, starts, *raw, h, int8_x, int8_h)
        assert ys.shape[0] == I // BLOCK[kinds[2]][0]
        check(ys, h, x, tok, expert_of, f64, int8_h, act)


@pytest.mark.parametrize("schemes", TRIPLES, ids=lambda t: "-".join(t))
def test_igemm_step_slices(rng, schemes, monkeypatch):
    """The int8 GEMM step (x and h as int8 blocks, the formats' igemm per task, q6_k's
    sub-blocks of 16 included), its width in every slice and in one."""
    raw, f64 = stacks(rng, schemes)
    kinds = tuple(QuantScheme.parse(s).kind for s in schemes)
    act = ACT_OF.get(schemes, "silu")
    mod = M.kernels(kinds, act)
    for slicing in (most_slices, lambda *a: 1):
        monkeypatch.setattr(M, "gemv_slices", slicing)
        x = int8_rounded(rng.standard_normal((37, H)).astype(np.float32))
        tok, experts, starts, expert_of = routed(rng, 37, 3)
        h = np.full((tok.shape[0], I), np.nan, np.float32)
        ys = M._igemm_step(mod, kinds, x, tok, experts, starts, *raw, h)
        check(ys, h, x, tok, expert_of, f64, True, act)


def test_gemv_slices_keeps_the_busiest_thread_shortest():
    assert M.gemv_slices(8, 2, 1024, "q4_k") == 1          # 8 experts of a token: 4 a thread
    assert M.gemv_slices(3, 2, 1024, "q4_k") == 2          # 6 tasks, 3 a thread
    assert M.gemv_slices(1, 4, 1024, "q4_k") == 4          # a lone expert: a slice a thread
    assert M.gemv_slices(1, 4, 256, "q4_k") == 1           # one k-quant block: no split
    assert M.gemv_slices(5, 1, 1024, "q4_0") == 1          # one thread: no split
    assert M.gemv_slices(2, 3, 96, "") == 3                # dense f32: slices of 32


@pytest.mark.parametrize("m,n,col", [(5, 40, 0), (2, 32, 144), (7, 64, 288)], ids=str)
def test_igemm_q4_k_equals_the_formats_igemm(rng, m, n, col):
    """moe_igemm's q4_k GEMM (its panels moved across the diagonal, the codes masked as read)
    gives quant_kernels' igemm's results bit for bit, in 8 lanes and (AVX-512 VNNI) 16: rows
    of x past a multiple of its tile (1, 2 and 3: its tail tiles), W's rows not a multiple of
    its panel (the last row repeated past the end) and a column window from byte `col` of
    longer rows (the down pass's slices)."""
    from rlx_backend_numba import moe_igemm, quant_kernels
    k = 512
    q = QuantScheme.parse("q4_k")
    w = q.quantize((rng.standard_normal((n, k + col // 144 * 256 + 256)) / 20).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    xq, xd = np.empty((m, k), np.int8), np.empty((m, k // 32), np.float32)
    xs, xi = np.empty_like(xd), np.empty((m, k // 32), np.int32)
    quant_kernels.quantize_rows(x, xq, xd, xs, xi)
    want, got = np.empty((m, n), np.float32), np.full((m, n), np.nan, np.float32)
    quant_kernels.drivers("q4_k").igemm(xq.view(np.int32), xd, xs, xi, w[:, col:col + k // 256 * 144], want,
                                        quant_kernels.F16, 1)
    for wide in sorted({False, moe_igemm.VNNI512}):         # the 8-lane tile, and the 16-lane one where it runs
        got[:] = np.nan
        moe_igemm.module(wide).igemm_q4_k(xq.view(np.int32), xd, xs, xi, w, col, got, quant_kernels.F16)
        np.testing.assert_array_equal(got, want)
    ref = x.astype(np.float64) @ q.dequantize_reference(w, w.shape[:1] + (w.shape[1] // 144 * 256,))[:, col // 144 * 256:][:, :k].T
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()          # and it is the product (x rounded to int8)
