"""Decode GEMVs that compute the residual RMSNorms between them (ops.GemvNorm, gemv.cu's NORM /
RESID): the GEMV before a fused_residual_rms_norm writes its h = x + the product and adds up
h's squares, the GEMV after it norms its own x rows from those sums, so a decode step has no
norm launches. Checked against a float64 NumPy reference on fresh random inputs over repeated
runs (the sums are zeroed again each run; the last run replays the CUDA graph), against the
unfused build (CONFIG gemv_fusion off), under the cuBLAS switch (the unfused launches the fused
step keeps), and where the norm's consumer is no GEMV (a [K, N] weight: the norm's own launch).
The kernel's NORM, RESID and SWIGLU forms also run emulated on the CPU (cuda_emu)."""
from __future__ import annotations

import math

import cuda_emu
import numpy as np
import pytest

import rlx_core
from rlx_core.ir.dtype import BF16, F16, I32
from rlx_core.ir.graph import Graph
from rlx_core.ir.quant import PackedTensor, QuantScheme
from rlx_core.pipeline import available_backends

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
gpu = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")
EPS = 1e-5


@pytest.fixture
def rng(request):
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def shapes(hid: int, inner: int, inter: int, vocab: int, kn_head: bool) -> dict:
    return {"o": (hid, inner), "ln1": (hid,), "gate": (inter, hid), "up": (inter, hid), "down": (hid, inter),
            "ln2": (hid,), "q": (inner, hid), "lnf": (hid,), "head": (hid, vocab) if kn_head else (vocab, hid)}


def block(m, p: dict, x, a, kn_head: bool = False):
    """Attention output a into the residual stream x, the MLP, another projection, the head:
    three residual norms each feeding one matmul (the last through the last-token narrow, whole
    at one token, as a flow's head reads it); a plain norm of x into another. kn_head: the
    head's weight stored [K, N] (no GEMV reads it: its rows are not the dot products')."""
    h = x + m.linear(a, p["o"])
    h2 = h + m.swiglu(m.rms_norm(h, p["ln1"], eps=EPS), p["gate"], p["up"], p["down"])
    q = m.linear(m.rms_norm(h2, p["ln2"], eps=EPS), p["q"])
    f = m.narrow(m.rms_norm(h2 + m.linear(q, p["o"]), p["lnf"], eps=EPS), 1, -1, 1)
    logits = m.matmul(f, p["head"]) if kn_head else m.linear(f, p["head"])
    return {"h": h, "q": q, "logits": logits, "plain": m.linear(m.rms_norm(x, p["ln2"], eps=EPS), p["q"])}


def reference(pv: dict, x, a, kn_head: bool = False) -> dict:
    """`block` in float64 from the same (rounded) inputs."""
    p = {k: np.asarray(v, np.float64) for k, v in pv.items()}

    def norm(t, w):
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * w

    def silu(t):
        return t / (1 + np.exp(-t))
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    h = x + a @ p["o"].T
    n1 = norm(h, p["ln1"])
    h2 = h + (silu(n1 @ p["gate"].T) * (n1 @ p["up"].T)) @ p["down"].T
    q = norm(h2, p["ln2"]) @ p["q"].T
    head = p["head"] if kn_head else p["head"].T
    return {"h": h, "q": q, "logits": norm(h2 + q @ p["o"].T, p["lnf"]) @ head,
            "plain": norm(x, p["ln2"]) @ p["q"].T}


def rel(got, want) -> float:
    g = np.asarray(got, np.float64)
    return float(np.linalg.norm(g - want) / np.linalg.norm(want))


def build_and_run(g, params, ins, fusion: bool):
    from rlx_backend_cuda import set_config
    from rlx_backend_cuda.values import CONFIG

    was = CONFIG["gemv_fusion"]
    set_config(gemv_fusion=fusion)
    try:
        exe = rlx_core.compile(g, backend="cuda", params=params)
        for _ in range(3):                   # the third run replays the captured CUDA graph
            out = exe.run(dict(ins))
        out = {k: exe.backend.to_host(v) for k, v in out.items()}
        runner = next(iter(exe._runners.values()))
        return exe, out, runner
    finally:
        set_config(gemv_fusion=was)


def weights(rng, sh: dict, dt, schemes: dict) -> tuple:
    """(params, the same as float64 arrays): random weights of the shapes `sh` in dt (norms near
    one, matrices scaled by 1/sqrt(K)); those named in `schemes` packed in that scheme, their
    float arrays then the decoded weights."""
    pv = {n: (rng.uniform(0.8, 1.2, s) if len(s) == 1 else rng.uniform(-1, 1, s) / math.sqrt(s[-1]))
          .astype(np.float32).astype(dt.np) for n, s in sh.items()}
    floats = {k: np.asarray(v, np.float64) for k, v in pv.items()}
    for n, scheme in schemes.items():
        qs = QuantScheme.parse(scheme)
        raw = qs.quantize(pv[n].astype(np.float32))
        pv[n], floats[n] = PackedTensor(raw, qs, sh[n], n), qs.dequantize(raw, sh[n], dtype=np.float64)
    return pv, floats


def inputs(rng, dt, rows: int, hid: int, inner: int) -> dict:
    """The residual stream x [rows, 1, hid] and attention output a [rows, 1, inner], in dt."""
    return {"x": rng.uniform(-2, 2, (rows, 1, hid)).astype(np.float32).astype(dt.np),
            "a": rng.uniform(-2, 2, (rows, 1, inner)).astype(np.float32).astype(dt.np)}


def case(rng, dt, rows: int, hid: int, kn_head: bool = False, scheme: str = "", inner: int = 64,
         inter: int = 96):
    """(graph, params, inputs, the params as float arrays); scheme: every matrix but the head
    packed (dequant_matmul's GEMV), the float arrays then its decoded weights."""
    sh = shapes(hid, inner, inter, 300, kn_head)
    packed = {n for n, s in sh.items() if scheme and len(s) == 2 and n != "head"}
    pv, floats = weights(rng, sh, dt, {n: scheme for n in packed})
    ins = inputs(rng, dt, rows, hid, inner)

    def f(m):
        p = {n: m.param(n, s, dt, scheme=scheme if n in packed else "") for n, s in sh.items()}
        return block(m, p, m.input("x", (rows, 1, hid), dt), m.input("a", (rows, 1, inner), dt), kn_head)
    return Graph.define("gemv_norms", f), pv, ins, floats


@gpu
@pytest.mark.parametrize("dt", [BF16, F16])
@pytest.mark.parametrize("rows", [1, 2])
def test_norms_in_the_gemvs(rng, dt, rows):
    from rlx_backend_cuda import set_config

    g, pv, ins, floats = case(rng, dt, rows, 512)
    want = reference(floats, ins["x"], ins["a"])
    exe, fused, runner = build_and_run(g, pv, ins, True)
    ops = runner.describe()["steps_by_op"]
    assert "fused_residual_rms_norm" not in ops and ops["rms_norm"] == 1, ops      # (the plain norm)
    _, plain, plain_runner = build_and_run(g, pv, ins, False)
    assert plain_runner.describe()["steps_by_op"].get("fused_residual_rms_norm", 0) >= 1
    for k, w in want.items():
        assert rel(fused[k], w) < 2e-2, (k, rel(fused[k], w))
        assert rel(fused[k], plain[k].astype(np.float64)) < 2e-2, k
    # the cuBLAS switch runs the fused steps' unfused launches (norm, cuBLAS, residual norm)
    set_config(gemv=False)
    try:
        out = exe.run(dict(ins))
        blas = {k: exe.backend.to_host(v) for k, v in out.items()}
    finally:
        set_config(gemv=True)
    for k, w in want.items():
        assert rel(blas[k], w) < 2e-2, (k, rel(blas[k], w))


@gpu
@pytest.mark.parametrize("rows", [1, 2])
def test_the_embedding_gather_and_the_gemv_compute_the_first_norm(rng, rows):
    """`block` on embedding rows: token ids -> x (gather) -> its plain norm -> GEMV, x also the
    residual stream: the gather writes the rows' weighted copy and sums (rlx_gather_norm), the
    GEMV norms its rows, so the step has no norm launch; equal to float64 and to the unfused
    launches."""
    hid, inner = 512, 64
    sh = {**shapes(hid, inner, 96, 300, False), "embed": (100, hid)}
    pv, floats = weights(rng, sh, BF16, {})
    ids = np.array([[3], [77]][:rows], np.int32)
    a = rng.uniform(-2, 2, (rows, 1, inner)).astype(np.float32).astype(BF16.np)

    def f(m):
        p = {n: m.param(n, s, BF16) for n, s in sh.items()}
        x = m.gather(p["embed"], m.input("ids", (rows, 1), I32))
        return block(m, p, x, m.input("a", (rows, 1, inner), BF16))
    g, ins = Graph.define("embed_norm", f), {"ids": ids, "a": a}
    want = reference(floats, floats["embed"][ids[:, 0]][:, None, :], a)
    _, fused, runner = build_and_run(g, pv, ins, True)
    ops = runner.describe()["steps_by_op"]
    assert "rms_norm" not in ops and "fused_residual_rms_norm" not in ops, ops
    _, plain, _ = build_and_run(g, pv, ins, False)
    for k, w in want.items():
        assert rel(fused[k], w) < 2e-2, (k, rel(fused[k], w))
        assert rel(fused[k], plain[k].astype(np.float64)) < 2e-2, k


@gpu
@pytest.mark.parametrize("scheme", ["q8_0", "q4_k"])
@pytest.mark.parametrize("rows", [1, 3])
def test_norms_in_the_packed_gemvs(rng, scheme, rows):
    """Packed weights (dequant_matmul's GEMV, dq.cu) write h and norm x the same way, beside a
    dense head (the ring of sums runs over both kernels). At 3 rows the dense head is no GEMV
    (GEMV_MAX_M): the last norm runs as its own launch, the packed GEMVs still take theirs."""
    g, pv, ins, floats = case(rng, BF16, rows, 512, scheme=scheme, inner=256, inter=512)
    want = reference(floats, ins["x"], ins["a"])
    _, fused, runner = build_and_run(g, pv, ins, True)
    ops = runner.describe()["steps_by_op"]
    assert (ops.get("fused_residual_rms_norm", 0) > 0) == (rows > 2) and ops["rms_norm"] == 1, ops
    assert ops["dequant_matmul"] == 6, ops         # (o and q twice each, gate/up as one, down)
    _, plain, plain_runner = build_and_run(g, pv, ins, False)
    assert plain_runner.describe()["steps_by_op"]["fused_residual_rms_norm"] >= 1
    for k, w in want.items():
        assert rel(fused[k], w) < 2e-2, (k, rel(fused[k], w))
        assert rel(fused[k], plain[k].astype(np.float64)) < 2e-2, k


@gpu
def test_norm_whose_consumer_is_no_gemv_runs_as_its_launch(rng):
    """The head's weight stored [K, N]: the GEMV before the last
    residual norm still writes h, the norm runs as its own launch, the results stay right."""
    g, pv, ins, floats = case(rng, BF16, 1, 256, kn_head=True)
    want = reference(floats, ins["x"], ins["a"], kn_head=True)
    _, out, runner = build_and_run(g, pv, ins, True)
    ops = runner.describe()["steps_by_op"]
    # the last residual norm's own launch (and the zeroing of the sums no GEMV read), as its node's
    assert ops.get("fused_residual_rms_norm", 0) >= 1 and ops["rms_norm"] == 1, ops
    for k, w in want.items():
        assert rel(out[k], w) < 2e-2, (k, rel(out[k], w))


@gpu
def test_one_norm_in_a_gemv_zeroes_its_own_sums(rng):
    """A step with one residual norm read by a GEMV (no other GEMV to zero its sums: the memset
    after it, ops.GemvSums.close): right on every run, the captured CUDA graph's replays too."""
    hid, inner = 256, 64
    pv = {"o": rng.uniform(-1, 1, (hid, inner)) / 8, "ln": rng.uniform(0.8, 1.2, (hid,)),
          "q": rng.uniform(-1, 1, (inner, hid)) / 16}
    pv = {k: v.astype(np.float32).astype(BF16.np) for k, v in pv.items()}
    ins = inputs(rng, BF16, 1, hid, inner)

    def f(m):
        p = {n: m.param(n, v.shape, BF16) for n, v in pv.items()}
        h = m.input("x", (1, 1, hid), BF16) + m.linear(m.input("a", (1, 1, inner), BF16), p["o"])
        return {"q": m.linear(m.rms_norm(h, p["ln"], eps=EPS), p["q"])}
    p64 = {k: np.asarray(v, np.float64) for k, v in pv.items()}
    h = np.asarray(ins["x"], np.float64) + np.asarray(ins["a"], np.float64) @ p64["o"].T
    want = h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS) * p64["ln"] @ p64["q"].T
    exe, out, runner = build_and_run(Graph.define("one_gemv_norm", f), pv, ins, True)
    assert "fused_residual_rms_norm" not in runner.describe()["steps_by_op"]
    for _ in range(2):                       # (more replays: stale sums would grow each run)
        out = {k: exe.backend.to_host(v) for k, v in exe.run(dict(ins)).items()}
    assert rel(out["q"], want) < 2e-2, rel(out["q"], want)


@gpu
@pytest.mark.parametrize("scheme", ["", "q8_0"])
def test_a_gemv_that_norms_its_x_and_writes_the_next_h(rng, scheme):
    """h2 = h + p(rms_norm(h)): p's GEMV norms its x from h's sums and adds up h2's own (two
    sums buffers in one launch), dense and packed."""
    hid = 256
    sh = {"o": (hid, 64), "ln": (hid,), "p": (hid, hid), "ln2": (hid,), "q": (64, hid)}
    pv, floats = weights(rng, sh, BF16, {"p": scheme} if scheme else {})
    ins = inputs(rng, BF16, 1, hid, 64)

    def f(m):
        p = {n: m.param(n, s, BF16, scheme=scheme if n == "p" else "") for n, s in sh.items()}
        h = m.input("x", (1, 1, hid), BF16) + m.linear(m.input("a", (1, 1, 64), BF16), p["o"])
        h2 = h + m.linear(m.rms_norm(h, p["ln"], eps=EPS), p["p"])
        return {"h2": h2, "q": m.linear(m.rms_norm(h2, p["ln2"], eps=EPS), p["q"])}

    def norm(t, w):
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * w
    h = np.asarray(ins["x"], np.float64) + np.asarray(ins["a"], np.float64) @ floats["o"].T
    h2 = h + norm(h, floats["ln"]) @ floats["p"].T
    want = {"h2": h2, "q": norm(h2, floats["ln2"]) @ floats["q"].T}
    exe, out, runner = build_and_run(Graph.define("norm_and_resid", f), pv, ins, True)
    assert "fused_residual_rms_norm" not in runner.describe()["steps_by_op"]
    for k, w in want.items():
        assert rel(out[k], w) < 2e-2, (k, rel(out[k], w))


@gpu
def test_a_norm_read_by_three_gemvs(rng):
    """One residual norm's y read by a q8_0, a q4_k and a dense GEMV (q/k and v of a mixed-format
    file): each computes the norm from the same sums; no norm launch is left."""
    hid = 256
    sh = {"o": (hid, 64), "ln": (hid,), "p1": (64, hid), "p2": (96, hid), "p3": (32, hid)}
    schemes = {"p1": "q8_0", "p2": "q4_k"}
    pv, floats = weights(rng, sh, BF16, schemes)
    ins = inputs(rng, BF16, 1, hid, 64)

    def f(m):
        p = {n: m.param(n, s, BF16, scheme=schemes.get(n, "")) for n, s in sh.items()}
        h = m.input("x", (1, 1, hid), BF16) + m.linear(m.input("a", (1, 1, 64), BF16), p["o"])
        y = m.rms_norm(h, p["ln"], eps=EPS)
        return {k: m.linear(y, p[k]) for k in ("p1", "p2", "p3")}
    h = np.asarray(ins["x"], np.float64) + np.asarray(ins["a"], np.float64) @ floats["o"].T
    y = h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS) * floats["ln"]
    exe, out, runner = build_and_run(Graph.define("three_readers", f), pv, ins, True)
    ops = runner.describe()["steps_by_op"]
    assert "fused_residual_rms_norm" not in ops and ops["dequant_matmul"] == 2, ops
    for _ in range(2):                       # (graph replays: stale sums would grow each run)
        out = {k: exe.backend.to_host(v) for k, v in exe.run(dict(ins)).items()}
    for k in ("p1", "p2", "p3"):
        want = y @ floats[k].T
        assert rel(out[k], want) < 2e-2, (k, rel(out[k], want))


def test_the_sums_ring_on_the_host():
    """ops.GemvSums wires each NORM GEMV to zero the sums the one before it read, the first to
    zero the last one's; with one such GEMV, a memset step after it (no GPU needed)."""
    from types import SimpleNamespace as NS

    from rlx_backend_cuda.ops import GemvSums

    sums = [NS(size=64, nbytes=256, data=NS(ptr=p)) for p in (100, 200, 300)]
    ring, launches = GemvSums(), [["x", "w", s, None, 0] for s in sums]   # (args end with zero, zn)
    for s, args in zip(sums, launches):
        ring.follow(s, args)
    ring.close(None)
    assert [a[-2] for a in launches] == [sums[2], sums[0], sums[1]]
    assert all(int(a[-1]) == 64 for a in launches)
    # two GEMVs reading the same sums one after the other zero the same sums before them
    ring, order = GemvSums(), [0, 0, 1, 1, 2]
    launches = [["x", "w", sums[i], None, 0] for i in order]
    for i, args in zip(order, launches):
        ring.follow(sums[i], args)
    ring.close(None)
    assert [a[-2] for a in launches] == [sums[2], sums[2], sums[0], sums[0], sums[1]]
    memsets, steps = [], []
    b = NS(cp=NS(cuda=NS(runtime=NS(memsetAsync=lambda *a: memsets.append(a)))), stream=NS(ptr=7),
           add=steps.append)
    one, args = GemvSums(), ["x", "w", sums[0], None, 0]
    one.follow(sums[0], args)
    one.close(b)
    assert args[-2] is None and len(steps) == 1
    steps[0]()
    assert memsets == [(100, 0, 256, 7)]


def test_a_norms_readers_on_the_host():
    """ops._gemv_norm: readers of one norm each compute it while they follow one another in the
    sums' ring; a reader after another NORM GEMV (which zeroed the sums) gets the norm's own
    launch and the memset of its sums, and so do the readers after it; the last reader takes the
    norm out (no GPU needed)."""
    import contextlib
    from types import SimpleNamespace as NS

    from rlx_backend_cuda.ops import GemvNorm, GemvSums, _gemv_norm

    S, T = (NS(size=32, nbytes=128, data=NS(ptr=p)) for p in (100, 200))
    steps, memsets = [], []
    b = NS(gemv_norms={}, gemv_sums=GemvSums(), add=steps.append, at_node=lambda i: contextlib.nullcontext(),
           cp=NS(cuda=NS(runtime=NS(memsetAsync=lambda *a: memsets.append(a)))), stream=NS(ptr=7))

    def norm_launch():
        pass
    norm = b.gemv_norms[(4, 1)] = GemvNorm(4, None, 1e-5, S, (norm_launch,), readers=4)

    def fused_reader(ssq):                   # what a NORM GEMV's build does
        got = _gemv_norm(b, (4, 1))
        if got is not None:
            b.gemv_sums.follow(ssq, ["x", None, 0])
            got.fused = True
        return got
    assert fused_reader(S) is norm and fused_reader(S) is norm and not steps     # q/k, then v
    b.gemv_sums.follow(T, ["x", None, 0])                                      # another norm's GEMV
    assert fused_reader(S) is None and norm.ran and steps[0] is norm_launch
    steps[1]()
    assert memsets == [(100, 0, 128, 7)]
    assert fused_reader(S) is None and len(steps) == 2 and (4, 1) not in b.gemv_norms



@cuda_emu.emulated
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("per_warp", [1, 2])
def test_emulated_gemv_norm_residual_and_swiglu(rng, rows, per_warp):
    """The dense decode GEMV (gemv.cu) on the CPU (cuda_emu; no GPU needed), bf16, launched as
    ops._gemv_step launches it for an H200's 132 SMs, with 1 or 2 rows of W a warp
    (ops.GEMV_ROWS; 95 rows: a warp's second row past the end): the plain product, NORM (x holds x0 * w,
    the rows' sums of x0's squares in 32 parts: the norm divides after the sums), RESID (h =
    res + the product, h * w2 for the next GEMV, h's squares added up) and SWIGLU (gate and up
    rows), against float64 from the same rounded inputs."""
    from rlx_backend_cuda import codegen, sources
    from rlx_backend_cuda.ops import GEMV_LOADS, NO_NORMS, gemv_split, pow2

    bf = BF16.np
    k, n = 512, 95
    w = (rng.uniform(-1, 1, (2 * n, k)) / math.sqrt(k)).astype(bf)
    w64 = w.astype(np.float64)
    x0 = rng.uniform(-2, 2, (rows, k)).astype(bf)
    x64 = x0.astype(np.float64)

    def run(y, x, wn, form: str, tail=NO_NORMS):
        swiglu = form == "swiglu"
        r, n_out = (2, wn // 2) if swiglu else (per_warp, wn)
        warps = n_out if swiglu else -(-wn // r)
        ks = gemv_split(warps, k, 132)
        src = sources.render(sources.GEMV, T="__nv_bfloat16", TO="__nv_bfloat16", MMAX=pow2(rows, 1, rows),
                             R=r, U=GEMV_LOADS, SWIGLU=int(swiglu), KS=ks, EARLY=0,
                             SWIGLU_OF=codegen.swiglu_of("float"), NORM=int(form == "norm"), TN="float",
                             RESID=int(form == "resid"))
        args = (x, np.int64(k), w, y, np.int32(rows),
                np.int32(n_out), np.int32(k))
        cuda_emu.compile_kernel(src, "rlx_gemv").launch((-(-warps * ks // 8),), (256,), args + tail)
    y = np.zeros((rows, n), bf)
    run(y, x0, n, "plain")
    assert rel(y, x64 @ w64[:n].T) < 1e-2
    nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
    nsq = np.repeat((x64 ** 2).sum(1, keepdims=True) / 32, 32, axis=1).astype(np.float32).reshape(-1)
    zero = np.ones(40, np.float32)
    run(y, (x0.astype(np.float32) * nw).astype(bf), n, "norm",
        (np.float32(EPS), nsq, None, np.float32(0), None, np.int64(0), None, None, zero, np.int32(zero.size)))
    assert rel(y, (x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + EPS) * nw) @ w64[:n].T) < 1e-2
    assert not zero.any()
    res = rng.uniform(-2, 2, (rows, n)).astype(bf)
    nw2 = rng.uniform(0.5, 1.5, n).astype(np.float32)
    yw, osq = np.zeros((rows, n), bf), np.zeros(rows * 32, np.float32)
    run(y, x0, n, "resid", (np.float32(0), None, nw2, np.float32(0), res, np.int64(n),
                            yw, osq, None, np.int32(0)))
    h = y.astype(np.float64)
    assert rel(h, res.astype(np.float64) + x64 @ w64[:n].T) < 1e-2 and rel(yw, h * nw2) < 1e-2
    np.testing.assert_allclose(osq.reshape(rows, 32).sum(1), (h ** 2).sum(1), rtol=1e-4)
    run(y, x0, 2 * n, "swiglu")
    gate, up = x64 @ w64[:n].T, x64 @ w64[n:].T
    assert rel(y, gate / (1 + np.exp(-gate)) * up) < 1e-2


@cuda_emu.emulated
def test_emulated_gather_writes_the_rows_their_weighted_copy_and_sums(rng):
    """rlx_gather_norm (ops._gather_norm: the embedding rows of a decode step whose first norm
    the GEMVs compute) on the CPU: the rows, x * (w + off) rounded as the NORM GEMV's x, and the
    rows' squares added into 32 parts a row (8 warps' worth, over two vectors a thread at 2056
    values); an id out of range is flagged and its row left zero."""
    from rlx_backend_cuda import sources

    bf, n, off = BF16.np, 2056, 1.0
    table = cuda_emu.aligned(rng.uniform(-2, 2, (50, n)).astype(np.float32).astype(bf))
    w = cuda_emu.aligned(rng.uniform(-0.5, 0.5, n).astype(np.float32).astype(bf))
    ids = np.array([7, -1, 50], np.int32)            # (-1: the last row; 50: past the table)
    out, xw = (cuda_emu.aligned(np.zeros((3, n), bf)) for _ in range(2))
    ssq, err = np.zeros(3 * 32, np.float32), np.zeros(4, np.int32)
    src = sources.render(sources.GATHER_NORM, TT="__nv_bfloat16", TI="int", TW="__nv_bfloat16")
    cuda_emu.compile_kernel(src, "rlx_gather_norm").launch((3,), (256,), (
        table, ids, out, xw, w, np.float32(off), ssq, np.int64(50), np.int32(n), err, np.int32(9)))
    want = np.stack([table[7], table[49], np.zeros(n, bf)]).astype(np.float64)
    np.testing.assert_array_equal(out.astype(np.float64), want)
    np.testing.assert_array_equal(xw, (want * (w.astype(np.float64) + off)).astype(np.float32).astype(bf))
    np.testing.assert_allclose(ssq.reshape(3, 32).sum(1), (want ** 2).sum(1), rtol=1e-5)
    assert err.any()

