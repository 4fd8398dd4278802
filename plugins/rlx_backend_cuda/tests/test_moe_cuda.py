"""moe_experts on CUDA's own kernels (rlx_backend_cuda/moe.py): against the float64 loop over
tokens and their experts (rlx_core.testing.ops_suite_moe), outputs poisoned first, at shapes
past the parity suite's (16 experts, hidden 128, uneven load; decode T = 1, batched decode,
a prefill of 40 tokens), dense in every float dtype and packed in K-quant mixes as GGUF's
Q4_K_M writes them; the routing changing between replays of one compiled graph (the ids are
read on the device, never synced to the host); an expert id out of range is the project's
error. The grouped tensor-core GEMM (f16/bf16 from a few pairs an expert) at token counts
that fill one and two 16-pair m-tiles, an expert with more pairs than a tile, experts with
none, tile rows and output rows past the tiles' edges, dense and packed (the dense one also
emulated on the CPU, cuda_emu). At one token, the
two launches of gemv1 (no sort, the combine in the down launch) at rows and widths no multiple
of the kernels' and with more pairs than the down launch's warps. moe_route's one kernel (a
warp per token) at OLMoE's 64 experts top-8 and at 100 (a partial last slot of the lanes),
and that the node stays moe_route. Skipped with the backend's reason without a GPU."""
from __future__ import annotations

import cuda_emu
import numpy as np
import pytest
from test_cuda import gpu

import rlx_core
from rlx_core.ir.dtype import BF16, F16, F32, F64, I32, I64
from rlx_core.ir.errors import RlxError
from rlx_core.ir.graph import Graph
from rlx_core.testing.ops_suite_moe import (ROUTER_IDS, ROUTERS, expert_args, ref_moe_experts, ref_moe_route,
                                            run_experts, separated_logits, uneven_ids)
from rlx_core.testing.parity import Arg, arg, run_parity

DIMS = (16, 96, 128)          # experts, intermediate, hidden


@gpu
@pytest.mark.parametrize("dt", [F32, F16, BF16, F64], ids=lambda d: d.value)
@pytest.mark.parametrize("tokens", [(1,), (4, 8), (40,)], ids=["decode", "batch32", "prefill40"])
def test_dense(rng, dt, tokens):
    run_experts("cuda", rng, dt, tokens, 4, DIMS)


@gpu
@pytest.mark.parametrize("schemes", [("q4_k", "q4_k", "q6_k"), ("q8_0",) * 3, ("q5_k", "q5_k", "q8_0"),
                                     ("q4_0", "q4_0", "q4_1"), ("int4_b32", "int4_b32", "int8_b32")], ids=str)
@pytest.mark.parametrize("tokens", [(1,), (33,)], ids=["decode", "prefill33"])
def test_packed(rng, schemes, tokens):
    run_experts("cuda", rng, F32, tokens, 4, (8, 256, 256), schemes=schemes)


@gpu
@pytest.mark.parametrize("dt", [BF16, F16], ids=lambda d: d.value)
def test_packed_16bit(rng, dt):
    run_experts("cuda", rng, dt, (3,), 2, (8, 256, 256), schemes=("q4_k", "q4_k", "q6_k"))


@gpu
def test_gate_and_up_in_two_schemes(rng):
    """Gate and up packed differently (each product its own launch), down dense."""
    run_experts("cuda", rng, BF16, (6,), 2, (6, 64, 96), schemes=("q8_0", "q4_0", ""))


@gpu
@pytest.mark.parametrize("act", ["gelu_tanh", "relu"])
def test_activation(rng, act):
    run_experts("cuda", rng, F32, (5,), 2, (6, 40, 72), act=act)


@gpu
def test_k_equal_experts_and_i32_ids(rng):
    run_experts("cuda", rng, F32, (2, 3), 6, (6, 24, 40), ids_dtype=I32)


def _experts_graph(shapes: dict, dt):
    def build(m):
        x, w, ids = (m.input(n, shapes[n], t) for n, t in (("x", dt), ("weights", dt), ("ids", I64)))
        stacks = [m.input(n, shapes[n], dt) for n in ("gate", "up", "down")]
        return {"y": m.add("moe_experts", (x, w, ids, *stacks), act="silu")}
    return Graph.define("moe", build)


@gpu
@pytest.mark.parametrize("order,normalize", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("experts,k", [(64, 8), (100, 5)], ids=["e64k8", "e100k5"])
@pytest.mark.parametrize("dt", [F32, BF16, F64], ids=lambda d: d.value)
def test_route(rng, dt, experts, k, order, normalize):
    logits = separated_logits(rng, (3, 2), experts, dt)
    run_parity("cuda", "moe_route", [logits], {"k": k, "order": order, "normalize": normalize},
               lambda z: ref_moe_route(z, k, order, normalize))


@gpu
def test_route_is_one_kernel():
    def build(m):
        w, ids = m.add("moe_route", (m.input("z", (2, 16), F32),), k=4)
        return {"w": w, "ids": ids}
    ex = rlx_core.compile(Graph.define("route", build), backend="cuda")
    assert [n.op for n in ex.mir.nodes if n.op not in ("input", "output")] == ["moe_route"]


@pytest.fixture
def one_token_calls(monkeypatch):
    """What each build of moe_experts' one-token path returned (True: gemv1 ran)."""
    from rlx_backend_cuda import moe
    calls = []
    real = moe._one_token

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]
    monkeypatch.setattr(moe, "_one_token", spy)
    return calls


@gpu
@pytest.mark.parametrize("k", [1, 10], ids=lambda k: f"k{k}")     # (10: more pairs than 8 warps)
@pytest.mark.parametrize("dt", [F32, BF16, F64], ids=lambda d: d.value)
def test_one_token(rng, one_token_calls, dt, k):
    """97 intermediate rows (a partial block of gate/up rows, odd K for down), 131 outputs (a
    partial pair of down rows)."""
    run_experts("cuda", rng, dt, (1,), k, (16, 97, 131))
    assert one_token_calls and all(one_token_calls)


@gpu
@pytest.mark.parametrize("schemes", [("q4_k", "q4_k", "q6_k"), ("q5_k", "q5_k", "q8_0"), ("q4_0", "q4_0", "")])
def test_one_token_packed(rng, one_token_calls, schemes):
    run_experts("cuda", rng, BF16, (1, 1), 8, (12, 256, 512), schemes=schemes)
    assert one_token_calls and all(one_token_calls)


@gpu
def test_one_token_gate_and_up_in_two_schemes_take_the_sort(rng, one_token_calls):
    run_experts("cuda", rng, F32, (1,), 2, (6, 64, 96), schemes=("q8_0", "q4_0", ""))
    assert one_token_calls and not any(one_token_calls)


@gpu
@pytest.mark.parametrize("tokens", [1, 3])
def test_native_kernel_and_routing_changes_between_replays(rng, tokens):
    """The node stays moe_experts (not legalized), and one compiled graph replayed with new
    ids each run follows them: the routing is read on the device."""
    e, i, h = DIMS
    stacks, dense = expert_args(rng, DIMS, F32)
    shapes = {"x": (tokens, h), "weights": (tokens, 4), "ids": (tokens, 4), **{a.name: a.data.shape for a in stacks}}
    ex = rlx_core.compile(_experts_graph(shapes, F32), backend="cuda")
    assert "moe_experts" in {n.op for n in ex.mir.nodes}
    for _ in range(4):
        x = arg(rng, "x", (tokens, h), F32, lo=-1, hi=1).data
        w = rng.uniform(0.1, 1, (tokens, 4))
        ids = uneven_ids(rng, tokens, 4, e).data
        feeds = {"x": x.astype(np.float32), "weights": w.astype(np.float32), "ids": ids,
                 **{a.name: a.data.astype(np.float32) for a in stacks}}
        got = ex.backend.to_host(ex.run(feeds)["y"])
        ref = ref_moe_experts(x, w.astype(np.float32).astype(np.float64), ids, *dense)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@gpu
@pytest.mark.parametrize("ids", [[[0, 1], [2, 4]], [[4, 1]], [[1, -1]]], ids=["sort", "one-token", "one-token-neg"])
def test_expert_id_out_of_range_is_an_error(rng, ids):
    e, i, h = 4, 8, 32
    t = len(ids)
    stacks, _ = expert_args(rng, (e, i, h), F32)
    shapes = {"x": (t, h), "weights": (t, 2), "ids": (t, 2), **{a.name: a.data.shape for a in stacks}}
    ex = rlx_core.compile(_experts_graph(shapes, F32), backend="cuda")
    feeds = {"x": np.ones((t, h), np.float32), "weights": np.ones((t, 2), np.float32),
             "ids": np.array(ids, np.int64), **{a.name: a.data.astype(np.float32) for a in stacks}}
    with pytest.raises(RlxError, match="moe_experts"):
        ex.backend.to_host(ex.run(feeds)["y"])


@pytest.fixture
def gemm_calls(monkeypatch):
    """The grouped-GEMM launches a compile makes (so a test knows the GEMM ran, not the gemv)."""
    from rlx_backend_cuda import moe
    calls = []
    real = moe._gemm

    def spy(b, x, xdiv, a, bb, sort, out, N, K, act, BK):
        calls.append((N, K, BK, sort.mt, bb is not None))
        return real(b, x, xdiv, a, bb, sort, out, N, K, act, BK)
    monkeypatch.setattr(moe, "_gemm", spy)
    return calls


@gpu
@pytest.mark.parametrize("dt", [BF16, F16], ids=lambda d: d.value)
@pytest.mark.parametrize("tokens", [(16,), (37,), (2, 65)], ids=["batch16", "tokens37", "prefill130"])
@pytest.mark.parametrize("dims", [(16, 96, 160), (16, 128, 256)], ids=["ragged", "even"])
def test_gemm_dense(rng, gemm_calls, dt, tokens, dims):
    """Expert 0 in most tokens (several tiles at 130 tokens), the last two in none; 96 and
    160 output rows end inside a 64-row tile; K steps of 32 (ragged) and 64 (even)."""
    run_experts("cuda", rng, dt, tokens, 4, dims)
    assert {c[4] for c in gemm_calls} == {True, False}      # gate/up fused, and down
    assert {c[3] for c in gemm_calls} == {1 if np.prod(tokens) < 40 else 2}


@gpu
@pytest.mark.parametrize("schemes", [("q4_k", "q4_k", "q6_k"), ("q8_0",) * 3, ("q5_k", "q5_k", "q4_0"),
                                     ("q4_0", "q4_0", "q4_1"), ("q5_0", "q5_1", "q5_0"),
                                     ("int4_b32", "int4_b32", "int8_b32")], ids=str)
@pytest.mark.parametrize("tokens", [(20,), (33,)], ids=["tokens20", "tokens33"])
def test_gemm_packed(rng, gemm_calls, schemes, tokens):
    """Packed stacks decoded tile by tile into shared memory (K-quants by half super-blocks)."""
    run_experts("cuda", rng, BF16, tokens, 4, (8, 256, 512), schemes=schemes)
    assert {c[4] for c in gemm_calls} == ({True, False} if schemes[0] == schemes[1] else {False})


@gpu
def test_gemm_gate_and_up_in_two_schemes(rng, gemm_calls):
    """Gate and up packed differently: two unfused GEMMs into f32 rows, then act(gate) * up."""
    run_experts("cuda", rng, F16, (24,), 2, (6, 64, 128), schemes=("q8_0", "q4_0", ""))
    assert len(gemm_calls) >= 3 and not any(c[4] for c in gemm_calls)


@gpu
@pytest.mark.parametrize("act", ["gelu_tanh", "relu"])
def test_gemm_activation(rng, gemm_calls, act):
    run_experts("cuda", rng, BF16, (24,), 2, (6, 64, 96), act=act)
    assert gemm_calls


@gpu
def test_gemm_routing_changes_between_replays(rng, gemm_calls):
    """One compiled graph on the GEMM path replayed with new ids: the tile list follows them."""
    e, i, h = 16, 128, 128
    stacks, dense = expert_args(rng, (e, i, h), BF16)
    t, k = 48, 4
    shapes = {"x": (t, h), "weights": (t, k), "ids": (t, k), **{a.name: a.data.shape for a in stacks}}
    ex = rlx_core.compile(_experts_graph(shapes, BF16), backend="cuda")
    dense = [d.astype(np.float64) for d in dense]
    for rep in range(3):
        x = arg(rng, "x", (t, h), BF16, lo=-1, hi=1).data
        w = arg(rng, "weights", (t, k), BF16, lo=0.1, hi=1).data
        ids = uneven_ids(rng, t, k, e).data if rep != 1 else np.tile(np.arange(k), (t, 1))   # all in experts 0..3
        feeds = {"x": x, "weights": w, "ids": ids, **{a.name: a.data for a in stacks}}
        got = np.asarray(ex.backend.to_host(ex.run(feeds)["y"]), np.float64)
        ref = ref_moe_experts(np.asarray(x, np.float64), np.asarray(w, np.float64), ids, *dense)
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    assert gemm_calls                      # (the steps are built at the first run)


@cuda_emu.emulated
@pytest.mark.parametrize("mt,dual", [(1, 0), (2, 1)], ids=["mt1", "mt2-dual"])
def test_emulated_sort_and_grouped_gemm(rng, mt, dual):
    """The sort (counting sort of the pairs by expert, the tile list) and the dense grouped
    GEMM on tensor cores run on the CPU (cuda_emu; mma.sync, ldmatrix and cp.async as warp
    collectives), launched as moe.py launches them: 5 experts, one with no pair and one with
    more pairs than a 16-pair tile (about 20 of 40), output rows past the last 64-row tile;
    DUAL: silu(gate) * up in bf16. Against float64 within bf16's tolerance."""
    import cuda_emu as emu

    from rlx_backend_cuda import moe, sources
    from rlx_backend_cuda.ops import _dq_epilogue

    tokens, k, E, N, K = 20, 2, 5, 80, 64
    P, bm = tokens * k, 16 * mt
    ids = rng.choice([0, 1, 1, 1, 3, 4], (tokens, k)).astype(np.int32)     # expert 2: none
    x = emu.aligned(rng.standard_normal((tokens, K)).astype(BF16.np))
    stacks = [emu.aligned((rng.standard_normal((E, N, K)) / 8).astype(BF16.np)) for _ in range(1 + dual)]
    ntiles = P // bm + min(E, P)
    offsets, order, active = np.zeros(E + 1, np.int32), np.zeros(P, np.int32), np.zeros(E, np.int32)
    tiles, err = np.zeros((ntiles, 2), np.int32), np.zeros(8, np.int32)
    emu.compile_kernel(sources.render(sources.MOE_SORT, TI="int", NE=E, BM=bm), "rlx_moe_sort").launch(
        (1,), (1024,), (ids, np.int32(P), offsets, order, active, tiles, np.int32(ntiles), err, np.int32(0)))
    epi = _dq_epilogue(BF16, False, "silu") if dual else ""
    src = sources.render(sources.MOE_GEMM_DENSE, ACC="float", STAGES=2, T="__nv_bfloat16", MMAT="bf16", BK=32,
                         TO="__nv_bfloat16", MT=mt, DUAL=dual, EPILOGUE=epi)
    out = emu.aligned(np.zeros((P, N), BF16.np if dual else np.float32))
    ers, rs = N * K * 2, K * 2
    emu.compile_kernel(src, "rlx_moe_gemm").launch((-(-N // moe.GEMM_BN), ntiles), (128,), (
        x, np.int64(K), np.int32(k), stacks[0], stacks[-1], np.int64(ers), np.int64(rs), offsets, order,
        tiles, out, np.int32(N), np.int32(K)))
    x64, w64 = x.astype(np.float64), [s.astype(np.float64) for s in stacks]
    pe = ids.reshape(-1)
    want = np.stack([x64[p // k] @ w64[0][pe[p]].T for p in range(P)])
    if dual:
        up = np.stack([x64[p // k] @ w64[1][pe[p]].T for p in range(P)])
        want = want / (1 + np.exp(-want)) * up
    assert not err.any() and offsets[-1] == P
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
