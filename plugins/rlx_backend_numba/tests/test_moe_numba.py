"""numba's moe_experts kernels (rlx_backend_numba/moe.py) against a float64 reference (each
token through its experts one by one, the packed stacks decoded by rlx_core.ir.quant's
reference decoder) on fresh random inputs: dense f32 and every packed format numba's
matmuls read, both passes' GEMV and GEMM forms (and the GEMV where numpy gives no
cblas_sgemm), T = 1 and 37, k from 1 to E, uneven expert load (an expert with every token,
experts with none), any activation; the runner's step equals the NumPy backend's kernel;
an id outside the experts is the project's error."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import rlx_core  # noqa: E402
from rlx_core.ir.dtype import F32, I64, U8  # noqa: E402
from rlx_core.ir.errors import ModelError  # noqa: E402
from rlx_core.ir.graph import Builder  # noqa: E402
from rlx_core.ir.quant import QuantScheme  # noqa: E402
from rlx_core.testing.parity import rng  # noqa: E402,F401  (seeded per test; RLX_TEST_SEED replays)

from rlx_backend_numba import moe as M  # noqa: E402
from rlx_backend_numba.quant_kernels import FORMATS  # noqa: E402

E, H, I = 5, 256, 256           # k-quant rows need multiples of 256
# (gate, up, down) schemes: "" dense f32; every packed format appears in one triple
TRIPLES = [("", "", ""), ("q4_0", "q4_1", "q5_0"), ("q5_1", "q8_0", "q4_k"), ("q5_k", "q4_k", "q6_k")]
assert {s for t in TRIPLES for s in t} - {""} == set(FORMATS)
ACT_OF = {TRIPLES[1]: "gelu_tanh"}      # the activation is generated per module: one other than silu
ACTS = {"silu": lambda v: v / (1 + np.exp(-v)), "relu": lambda v: np.maximum(v, 0), "gelu_tanh": lambda v: 0.5 * v * (
    1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))}


def stacks(rng, schemes, e=E):
    """(gate, up, down) as the kernel reads them (f32 or packed u8 [E, rows, bytes]) and as
    float64 (the packed ones decoded by the reference decoder)."""
    raw, f64 = [], []
    for shape, s in zip([(e, I, H), (e, I, H), (e, H, I)], schemes):
        w = (rng.standard_normal(shape) / np.sqrt(shape[2])).astype(np.float32)
        w *= rng.uniform(0.5, 2.0, (e, shape[1], 1)).astype(np.float32)
        if s:
            q = QuantScheme.parse(s)
            packed = np.stack([q.quantize(w[i]) for i in range(e)])
            raw.append(packed)
            f64.append(np.stack([q.dequantize_reference(packed[i], shape[1:]) for i in range(e)]))
        else:
            raw.append(w)
            f64.append(w.astype(np.float64))
    return raw, f64


def reference(x, weights, ids, gate, up, down, act="silu", round_h=None):
    """y[t] = sum_j weights[t, j] down[e] h, h = act(gate[e] x[t]) * up[e] x[t], e = ids[t, j],
    float64 (round_h: h rounded by it, as f32, first)."""
    y = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = ACTS[act](gate[e] @ x[t]) * (up[e] @ x[t])
            if round_h is not None:
                h = round_h(h.astype(np.float32)[None])[0].astype(np.float64)
            y[t] += weights[t, j] * (down[e] @ h)
    return y


def routes(rng, t, k, e=E, skew=False):
    """ids [t, k] of distinct experts per token (skew: expert 0 in every token, the last two in
    none) and positive weights."""
    if skew:
        ids = np.stack([np.r_[0, 1 + rng.choice(e - 3, k - 1, replace=False)] for _ in range(t)])
    else:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    return rng.uniform(0.1, 1.0, (t, k)).astype(np.float32), ids.astype(np.int64)


def run(schemes, x, weights, ids, raw, act="silu"):
    kinds = tuple(QuantScheme.parse(s).kind if s else "" for s in schemes)
    out = np.full((x.shape[0], raw[2].shape[1]), np.nan, np.float32)
    M.run_moe_experts(M.kernels(kinds, act), kinds, x, weights, ids, *raw, out)
    return out


def close(got, want):
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-5, atol=2e-6 * scale)


@pytest.fixture(params=["gemv", "gemm", "gemv-no-cblas"])
def form(request, monkeypatch):
    """Which form both passes take: the GEMV (a few tokens an expert; on one thread for the
    one-token cases, on all for T=37), the GEMM (decoded tiles times each group, whatever the
    group's size; several tiles a matrix), or the GEMV without a cblas_sgemm."""
    if request.param == "gemm":
        if M.SGEMM is None:
            pytest.skip("numpy's BLAS here gives no cblas_sgemm: the GEMM form never runs")
        monkeypatch.setattr(M, "GROUP_GEMM", 0.0)
        monkeypatch.setattr(M, "GROUP_GEMM_INT8", 0.0)
        monkeypatch.setattr(M, "TILE_FLOATS", 48 * max(H, I))     # tiles of 48 rows: a ragged last one
    elif request.param == "gemv":
        monkeypatch.setattr(M, "GROUP_GEMM", float("inf"))
        monkeypatch.setattr(M, "GROUP_GEMM_INT8", float("inf"))
        assert 2 * I * H < M.GEMV_PAR_MIN <= 37 * 2 * I * H        # both the one-thread and parallel GEMVs
    else:
        monkeypatch.setattr(M, "SGEMM", None)
    return request.param


@pytest.mark.parametrize("schemes", TRIPLES, ids=lambda t: "-".join(s or "f32" for s in t))
def test_every_scheme_tokens_and_k(rng, schemes, form):
    raw, f64 = stacks(rng, schemes)
    act = ACT_OF.get(schemes, "silu")
    for t, k, id_type in ((1, 1, np.int64), (1, 2, np.int64), (37, 2, np.int64), (37, E, np.int64),
                          (3, 3, np.int32)):
        x = rng.standard_normal((t, H)).astype(np.float32)
        weights, ids = routes(rng, t, k)
        got = run(schemes, x, weights, ids.astype(id_type), raw, act)
        close(got, reference(x.astype(np.float64), weights, ids, *f64, act=act))


@pytest.mark.parametrize("schemes", [TRIPLES[0], TRIPLES[3]], ids=["f32", "kquants"])
def test_uneven_load(rng, schemes, form):
    """Expert 0 takes every token, the last two none; the GEMM's cost split sees one big group."""
    raw, f64 = stacks(rng, schemes)
    x = rng.standard_normal((37, H)).astype(np.float32)
    weights, ids = routes(rng, 37, 2, skew=True)
    close(run(schemes, x, weights, ids, raw), reference(x.astype(np.float64), weights, ids, *f64))


def int8_rounded(x):
    """x rounded through int8_b32 blocks, as a fake_quantize leaves it (rlx_core.ir.quant)."""
    i8 = QuantScheme.parse("int8_b32")
    return i8.dequantize(i8.quantize(x), x.shape)


@pytest.mark.parametrize("schemes", TRIPLES[1:], ids=lambda t: "-".join(t))
def test_int8_up_pass(rng, schemes, form):
    """With x rounded through int8_b32 (the `activations = "int8"` opt-in), the up pass's
    integer block products (GEMV: the formats' idot; GEMM: their igemm, per group) equal the
    float64 product of the rounded x and the decoded stacks; down stays f32."""
    raw, f64 = stacks(rng, schemes)
    act = ACT_OF.get(schemes, "silu")
    kinds = tuple(QuantScheme.parse(s).kind for s in schemes)
    for t, k in ((1, 2), (37, 2), (37, E)):
        x = int8_rounded(rng.standard_normal((t, H)).astype(np.float32))
        weights, ids = routes(rng, t, k)
        out = np.full((t, H), np.nan, np.float32)
        M.run_moe_experts(M.kernels(kinds, act), kinds, x, weights, ids, *raw, out, int8_x=True)
        close(out, reference(x.astype(np.float64), weights, ids, *f64, act=act))


@pytest.mark.parametrize("down", ["q4_k", "q6_k", "q8_0"])
def test_int8_down_pass(rng, down, form):
    """int8_h: each row of h rounded through int8_b32, the down pass's integer products (GEMV:
    idot; GEMM: igemm per group, q6_k's sub-blocks of 16 included) equal the float64 down
    product of the rounded h. gate and up are dense small integers (x too) and the act relu,
    so h is exact in f32 and its rounding is the reference's, element for element."""
    schemes = ("", "", down)
    raw, f64 = stacks(rng, schemes)
    for i in (0, 1):
        raw[i] = (rng.integers(-3, 4, raw[i].shape) / 8).astype(np.float32)
        f64[i] = raw[i].astype(np.float64)
    kinds = ("", "", QuantScheme.parse(down).kind)
    for t, k in ((1, 2), (37, 2), (37, E)):
        x = rng.integers(-4, 5, (t, H)).astype(np.float32)
        weights, ids = routes(rng, t, k)
        out = np.full((t, H), np.nan, np.float32)
        M.run_moe_experts(M.kernels(kinds, "relu"), kinds, x, weights, ids, *raw, out, int8_h=True)
        want = reference(x.astype(np.float64), weights, ids, *f64, act="relu", round_h=int8_rounded)
        close(out, want)
        assert np.abs(want - reference(x.astype(np.float64), weights, ids, *f64, act="relu")).max() > 1e-3 * np.abs(want).max()


def test_split_tasks_covers_every_task_in_runs_of_about_equal_cost():
    starts = np.array([0, 30, 31, 33, 60])           # groups of 30, 1, 2, 27 tokens
    for tiles in (1, 4):
        cost = np.repeat(np.diff(starts) + M.DECODE_COST, tiles)
        for parts in (1, 2, 3, 7, 40):
            b = M.split_tasks(starts, tiles, parts)
            assert b[0] == 0 and b[-1] == 4 * tiles and len(b) == parts + 1
            assert np.all(np.diff(b) >= 0)
            runs = [cost[b[p]:b[p + 1]].sum() for p in range(parts)]
            assert max(runs) <= cost.sum() / parts + cost.max()


def test_id_outside_the_experts_is_a_model_error(rng):
    raw, _ = stacks(rng, ("", "", ""))
    x = rng.standard_normal((3, H)).astype(np.float32)
    weights, ids = routes(rng, 3, 2)
    ids[1, 1] = E
    with pytest.raises(ModelError, match=r"expert id 5 of token 1 \(slot 1;.* is outside \[0, 5\)"):
        run(("", "", ""), x, weights, ids, raw)


# --------------------------------------------------------------------------- the runner
def moe_graph(lead, k, schemes, int8=False, int8_h=False):
    """moe_experts over inputs; `int8`: x through a fake_quantize to int8_b32 first; `int8_h`:
    the op's attribute (h rounded before the down pass)."""
    m = Builder("moe", "mir")
    x, w = m.input("x", lead + (H,), F32), m.input("weights", lead + (k,), F32)
    if int8:
        x = m.add("fake_quantize", (x,), scheme="int8_b32")
    ids = m.input("ids", lead + (k,), I64)
    ws = []
    for name, shape, s in zip(("gate", "up", "down"), ((E, I, H), (E, I, H), (E, H, I)), schemes):
        if s:
            rows, nbytes = QuantScheme.parse(s).packed_shape(shape[1:])
            ws.append(m.input(name, (E, rows, nbytes), U8))
        else:
            ws.append(m.input(name, shape, F32))
    m.output("y", m.add("moe_experts", (x, w, ids, *ws), schemes=tuple(schemes), int8_h=int8_h))
    return m.build()


def runner_inputs(rng, schemes, lead):
    """(float64 stacks, tokens, x, weights, ids, the graph's inputs) over `lead` token dims, k = 2."""
    raw, f64 = stacks(rng, schemes)
    t = int(np.prod(lead))
    x = rng.standard_normal((t, H)).astype(np.float32)
    weights, ids = routes(rng, t, 2)
    inputs = dict(x=x.reshape(lead + (H,)), weights=weights.reshape(lead + (2,)), ids=ids.reshape(lead + (2,)),
                  gate=raw[0], up=raw[1], down=raw[2])
    return f64, t, x, weights, ids, inputs


@pytest.mark.parametrize("schemes", [TRIPLES[0], TRIPLES[2]], ids=["f32", "packed"])
@pytest.mark.parametrize("lead", [(1,), (37,), (2, 3)], ids=str)
def test_runner_step_equals_numpy_backend(rng, schemes, lead):
    """The step numba's runner builds (tokens over every leading dim) equals the NumPy
    backend's kernel and the reference."""
    f64, t, x, weights, ids, inputs = runner_inputs(rng, schemes, lead)
    g = moe_graph(lead, 2, schemes)
    numba_exe = rlx_core.compile(g, backend="numba")
    got = numba_exe.run(inputs)["y"]
    runner = numba_exe.runner(numba_exe._bind_dims(inputs))
    fns = [fn for i, _, fn, *_ in runner.steps if runner.graph.nodes[i].op == "moe_experts"]
    assert len(fns) == 1 and "prepare_moe_experts" in fns[0].__qualname__, "numba's kernel did not run"
    want = rlx_core.compile(g, backend="numpy").run(inputs)["y"]
    close(got, want.astype(np.float64))
    close(got.reshape(t, H), reference(x.astype(np.float64), weights, ids, *f64))


@pytest.mark.parametrize("schemes", [TRIPLES[3], ("", "q4_k", "q6_k")], ids=["packed", "dense-gate"])
@pytest.mark.parametrize("lead", [(1,), (37,)], ids=str)
def test_runner_multiplies_int8_x_after_a_rounding(rng, schemes, lead, monkeypatch):
    """x from a fake_quantize to int8_b32: numba's step runs the int8 up pass where gate and
    up are packed (f32 where one is dense) and equals the NumPy backend (which rounds x, then
    multiplies in float)."""
    monkeypatch.setattr(M, "GROUP_GEMM", 1.0)          # T = 37: the GEMM form (2 pairs a group, 5 experts)
    monkeypatch.setattr(M, "GROUP_GEMM_INT8", 1.0)
    seen = []
    real = M.run_moe_experts
    monkeypatch.setattr(M, "run_moe_experts", lambda *a: seen.append(a[-2]) or real(*a))
    f64, t, x, weights, ids, inputs = runner_inputs(rng, schemes, lead)
    g = moe_graph(lead, 2, schemes, int8=True)
    got = rlx_core.compile(g, backend="numba").run(inputs)["y"]
    assert seen == [bool(schemes[0])]
    want = rlx_core.compile(g, backend="numpy").run(inputs)["y"]
    close(got, want.astype(np.float64))
    close(got.reshape(t, H), reference(int8_rounded(x).astype(np.float64), weights, ids, *f64))


TIE_ULPS = 2e-6      # |h_f32 - h| over the sum of its products' magnitudes: ~2e-7 measured; 10x kept


def rounded_h_ways(x, weights, ids, gate, up, down, act="silu"):
    """The op's definition with h rounded through int8_b32, in float64: y [T, H], and per token
    the moves of y where an element of h lies within f32 error of a rounding tie (x.5 quanta).
    Two backends compute h in f32 in different orders, so such an element may round either
    way: each move is that element rounded the other way (one quantum times its down column,
    weighted)."""
    y = np.zeros((x.shape[0], down.shape[1]))
    moves = [[] for _ in range(x.shape[0])]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            h = ACTS[act](g) * u
            err = TIE_ULPS * (np.abs(gate[e]) @ np.abs(x[t]) * np.abs(u) + np.abs(ACTS[act](g)) * (np.abs(up[e]) @ np.abs(x[t])))
            d = np.repeat(np.abs(h).reshape(-1, 32).max(1) / 127, 32)
            q = np.copysign(np.floor(np.abs(h) / d + 0.5), h)           # int8_b32's rounding (half away from 0)
            y[t] += weights[t, j] * (down[e] @ (q * d))
            tie = np.copysign(np.floor(np.abs(h) / d) + 0.5, h)
            for n in np.flatnonzero(np.abs(h - tie * d) <= err):
                other = np.copysign(np.floor(np.abs(h[n]) / d[n]) + (np.abs(q[n]) == np.floor(np.abs(h[n]) / d[n])), h[n])
                moves[t].append(weights[t, j] * (other - q[n]) * d[n] * down[e][:, n])
    return y, moves


MAX_TIES = 16        # 2**16 subsets a token; 37 tokens x 512 h elements: 3-7 in 40 seeds, 10 in CI once


def close_either_way(got, want, moves):
    """got's row t equals want's with some subset of the row's tie moves applied (close()):
    every subset is tried, 4096 at a time."""
    scale = float(np.abs(want).max())
    for t in range(want.shape[0]):
        n = len(moves[t])
        assert n <= MAX_TIES, f"token {t}: {n} elements of h at a tie"
        table = np.array(moves[t]).reshape(n, want.shape[1])
        best = np.inf
        for first in range(0, 1 << n, 4096):
            masks = np.arange(first, min(first + 4096, 1 << n))
            chosen = ((masks[:, None] >> np.arange(n)) & 1).astype(np.float64)
            moved = want[t] + chosen @ table
            best = min(best, float((np.abs(got[t] - moved) - 2e-5 * np.abs(moved)).max(axis=1).min()))
        assert best <= 2e-6 * scale, f"token {t}: off by {best:.3g} beyond tolerance ({n} ties)"


@pytest.mark.parametrize("lead", [(1,), (37,)], ids=str)
def test_runner_rounds_h_where_the_op_says(rng, lead, monkeypatch):
    """moe_experts' int8_h (set by pack_params under activations = "int8" where down is
    packed): numba's step runs the int8 down pass; it and the NumPy backend (which rounds h
    through int8_b32 and multiplies in float) each equal the op's definition in float64, an
    element of h at a rounding tie rounded either way (the two compute h in f32 in
    different orders); the rounding changes the result."""
    monkeypatch.setattr(M, "GROUP_GEMM", 1.0)
    monkeypatch.setattr(M, "GROUP_GEMM_INT8", 1.0)
    seen = []
    real = M.run_moe_experts
    monkeypatch.setattr(M, "run_moe_experts", lambda *a: seen.append(a[-2:]) or real(*a))
    schemes = TRIPLES[3]
    f64, t, x, weights, ids, inputs = runner_inputs(rng, schemes, lead)
    g = moe_graph(lead, 2, schemes, int8=True, int8_h=True)
    got = rlx_core.compile(g, backend="numba").run(inputs)["y"]
    assert seen == [(True, True)]
    want = rlx_core.compile(g, backend="numpy").run(inputs)["y"]
    ref, moves = rounded_h_ways(int8_rounded(x).astype(np.float64), weights, ids, *f64)
    close_either_way(got.reshape(t, H).astype(np.float64), ref, moves)
    close_either_way(want.reshape(t, H).astype(np.float64), ref, moves)
    unrounded = rlx_core.compile(moe_graph(lead, 2, schemes, int8=True), backend="numpy").run(inputs)["y"]
    assert np.abs(want - unrounded).max() > 1e-6 * np.abs(want).max()


def test_rounding_twice_keeps_the_int8_blocks(rng):
    """Why the fake_quantize before a step that rounds x itself is redundant: rounding x's
    int8_b32 rounding again gives the same int8 values and scales within one ulp (the scale
    of the rounded block is fl(fl(127 d) / 127), d itself in ~99% of blocks), blocks of
    zeros, of one value and of mixed magnitudes included."""
    from rlx_backend_numba.quant_kernels import quantize_x
    x = (rng.standard_normal((64, H)) * rng.uniform(1e-3, 1e3, (64, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = -3.25
    x[2, ::7] = 0
    nb = H // 32
    for row in x:
        q1, d1, s1 = np.empty(H, np.int8), np.empty(nb, np.float32), np.empty(nb, np.float32)
        q2, d2, s2 = np.empty(H, np.int8), np.empty(nb, np.float32), np.empty(nb, np.float32)
        quantize_x(row, q1, d1, s1)
        quantize_x(int8_rounded(row[None])[0], q2, d2, s2)
        np.testing.assert_array_equal(q1, q2)
        assert np.all(np.abs(d1.view(np.int32) - d2.view(np.int32)) <= 1)
        np.testing.assert_array_equal(int8_rounded(row[None])[0], np.repeat(d1, 32) * q1.astype(np.float32))


@pytest.mark.parametrize("int8_h", [True, False], ids=["int8_h", "f32_h"])
@pytest.mark.parametrize("lead", [(1,), (37,)], ids=str)
def test_runner_drops_the_rounding_the_step_does_itself(rng, lead, int8_h, monkeypatch):
    """x through a fake_quantize to int8_b32 read only by a moe_experts step that rounds x
    itself (gate and up packed; GEMV at one token; at 37 igemm_step, or with h in f32 the
    groups' igemms): numba plans the rounding away (quant_kernels.redundant_roundings) and
    the step reads x; its output equals the same graph with the rounding kept (the drop
    disabled) and the NumPy backend's. Where gate is dense the step multiplies x in f32:
    the rounding stays."""
    from rlx_backend_numba import quant_kernels

    monkeypatch.setattr(M, "GROUP_GEMM_INT8", 1.0)
    schemes = TRIPLES[3]
    f64, t, x, weights, ids, inputs = runner_inputs(rng, schemes, lead)
    g = moe_graph(lead, 2, schemes, int8=True, int8_h=int8_h)

    def compiled(g):
        exe = rlx_core.compile(g, backend="numba")
        runner = exe.runner(exe._bind_dims(inputs))
        return exe.run(inputs)["y"], [runner.graph.nodes[i].op for i, *_ in runner.steps]

    dropped, ops = compiled(g)
    assert "fake_quantize" not in ops and "moe_experts" in ops
    with monkeypatch.context() as m:
        m.setattr(quant_kernels, "redundant_roundings", lambda g, others=None: frozenset())
        kept, kept_ops = compiled(g)
    assert "fake_quantize" in kept_ops
    scale = float(np.abs(kept).max())
    np.testing.assert_allclose(dropped, kept, rtol=1e-6, atol=1e-6 * scale)
    want = rlx_core.compile(g, backend="numpy").run(inputs)["y"]
    if int8_h:
        ref, moves = rounded_h_ways(int8_rounded(x).astype(np.float64), weights, ids, *f64)
        close_either_way(dropped.reshape(t, H).astype(np.float64), ref, moves)
        close_either_way(want.reshape(t, H).astype(np.float64), ref, moves)
    else:
        close(dropped, want.astype(np.float64))
        close(dropped.reshape(t, H), reference(int8_rounded(x).astype(np.float64), weights, ids, *f64))

    dense_gate = ("", "q4_k", "q6_k")
    _, _, _, _, _, inputs = runner_inputs(rng, dense_gate, lead)
    _, ops = compiled(moe_graph(lead, 2, dense_gate, int8=True))
    assert "fake_quantize" in ops


# --------------------------------------------------------------------------- moe_route
@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("order,normalize", [("softmax_topk", False), ("softmax_topk", True),
                                             ("topk_softmax", False)])
def test_route_step_equals_the_float64_spec(rng, dt, order, normalize, monkeypatch):
    """numba's moe_route step (route_rows) for every router variant, k = 1, 3 and E, tokens
    over [batch, seq], against ops_suite_moe's float64 reference (ids exactly, ties to the
    lowest id: rows with a tied pair at the top, at the k-th place and among equal rows) and
    the NumPy backend's kernel."""
    from rlx_core.ir.dtype import F64
    from rlx_core.testing.ops_suite_moe import ref_moe_route

    calls = []
    real = M.route_rows
    monkeypatch.setattr(M, "route_rows", lambda *args: calls.append(args[0].shape) or real(*args))
    e = 16
    z = (rng.standard_normal((2, 5, e)) * 3).astype(dt)
    z[0, 0, 3] = z[0, 0, 9] = z[0, 0].max() + 1           # a tie at the top: id 3 first
    z[0, 1, :] = 0.5                                          # every expert tied: ids 0, 1, 2, ...
    z[1, 2, [4, 11]] = np.sort(z[1, 2])[-3]                   # a tie at the 3rd place
    for k in (1, 3, e):
        m = Builder("route", "mir")
        z_in = m.input("z", z.shape, F32 if dt == np.float32 else F64)
        w, ids = m.add("moe_route", (z_in,), k=k, order=order, normalize=normalize)
        m.output("w", w)
        m.output("ids", ids)
        g = m.build()
        calls.clear()
        got = rlx_core.compile(g, backend="numba").run({"z": z})
        assert calls == [(10, e)], "numba's kernel did not run (once, over the 10 tokens)"
        want_w, want_ids = ref_moe_route(z, k, order, normalize)
        np.testing.assert_array_equal(got["ids"], want_ids)
        tol = 1e-6 if dt == np.float32 else 1e-13
        np.testing.assert_allclose(got["w"], want_w, rtol=tol, atol=tol)
        assert got["w"].dtype == dt
        numpy_out = rlx_core.compile(g, backend="numpy").run({"z": z})
        np.testing.assert_array_equal(numpy_out["ids"], got["ids"])
        np.testing.assert_allclose(numpy_out["w"], got["w"], rtol=1e-6, atol=1e-6)
