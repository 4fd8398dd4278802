"""A decode step's q and k RMSNorms read only by the RoPE after them (OLMoE's over a position's
whole projection, Qwen3's and Gemma's per head) run inside the rope launch, which also writes k
and v into the caches (ops.RopeNorm): no rms_norm launch is left. A norm read by anything else,
or the switch off, keeps its launch. Each case against a float64 NumPy reference on fresh
random inputs, the last run a CUDA-graph replay."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.dtype import BF16, F32, I32
from rlx_core.ir.graph import Graph
from rlx_core.pipeline import available_backends

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
gpu = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")
EPS = 1e-6
CTX = 48


def norm(t, w, off):
    return t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * (np.asarray(w, np.float64) + off)


def rope(x, cos, sin, style):
    """x [B, H, S, D] rotated by cos / sin [B, S, half] (half < D / 2: the rest kept)."""
    half = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]
    out = x.copy()
    i1, i2 = (np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)) if style == "interleaved" else (
        np.arange(half), np.arange(half, 2 * half))
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i2] * c + x[..., i1] * s
    return out


def build(B, S, H, KV, D, half, dt, whole, style, off, extra_reader):
    """qkv [B, S, (H + 2 KV) D] -> q, k normed (whole rows or per head), roped, k and v written
    into the caches at pos; extra_reader: the q norm's y is also an output."""
    def f(m):
        qkv = m.input("qkv", (B, S, (H + 2 * KV) * D), dt)
        pos = m.input("pos", (B,), I32)
        cos, sin = m.input("cos", (B, S, half)), m.input("sin", (B, S, half))
        q, k, v = (m.narrow(qkv, 2, a * D, n * D) for a, n in ((0, H), (H, KV), (H + KV, KV)))
        heads = [(q, H, "wq"), (k, KV, "wk")]
        normed = []
        for t, n, w in heads:
            if whole:
                t = m.reshape(m.rms_norm(t, m.param(w, (n * D,), dt), eps=EPS, offset=off), (B, S, n, D))
            else:
                t = m.rms_norm(m.reshape(t, (B, S, n, D)), m.param(w, (D,), dt), eps=EPS, offset=off)
            normed.append(t)
        qn, kn = (m.transpose(t, (0, 2, 1, 3)) for t in normed)
        vt = m.transpose(m.reshape(v, (B, S, KV, D)), (0, 2, 1, 3))
        kc = m.kv_write(m.state("kc", (B, KV, CTX, D), dt), m.rope(kn, cos, sin, style), pos)
        vc = m.kv_write(m.state("vc", (B, KV, CTX, D), dt), vt, pos)
        out = {"q": m.rope(qn, cos, sin, style), "kc": kc, "vc": vc}
        if extra_reader:
            out["qn"] = normed[0]
        return out
    return Graph.define("qk_norm_rope", f)


def reference(ins, params, B, S, H, KV, D, whole, style, off):
    x = np.asarray(ins["qkv"], np.float64)
    q, k, v = x[..., :H * D], x[..., H * D:(H + KV) * D], x[..., (H + KV) * D:]
    if whole:
        q, k = norm(q, params["wq"], off), norm(k, params["wk"], off)
    q, k, v = (t.reshape(B, S, n, D) for t, n in ((q, H), (k, KV), (v, KV)))
    if not whole:
        q, k = norm(q, params["wq"], off), norm(k, params["wk"], off)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    cos, sin = np.asarray(ins["cos"], np.float64), np.asarray(ins["sin"], np.float64)
    return rope(q, cos, sin, style), rope(k, cos, sin, style), v


def run(g, params, ins):
    exe = rlx_core.compile(g, backend="cuda", params=params)
    for _ in range(3):                   # the third run replays the captured CUDA graph
        out = exe.run(dict(ins))
    host = {k: np.asarray(exe.backend.to_host(v), np.float64) for k, v in out.items()}
    return host, next(iter(exe._runners.values())).describe()["steps_by_op"]


def rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


CASES = [  # B, S, H, KV, D, half, whole, style, off
    (1, 1, 16, 16, 128, 64, True, "half", 0.0),         # OLMoE's decode row
    (1, 1, 8, 2, 128, 64, False, "half", 0.0),          # Qwen3's per-head norms, grouped kv heads
    (2, 1, 4, 2, 64, 32, False, "interleaved", 1.0),    # Gemma's w + 1, a batch of two
    (2, 3, 3, 1, 32, 8, True, "half", 0.0),             # partial rotation, several positions
    (1, 5, 2, 2, 48, 24, False, "half", 0.0),           # a short prefill
    (2, 40, 2, 1, 32, 16, True, "half", 0.0),           # whole rows past decode's few: a launch
]


# (the q norm read by an output too: only at decode's one row a position, where its launch is
# one step; strided rows of more positions are copied first, a second rms_norm step)
RUNS = [(c, False) for c in CASES] + [(c, True) for c in CASES if c[0] * c[1] == 1]


@gpu
@pytest.mark.parametrize("dt", [BF16, F32])
@pytest.mark.parametrize("case,extra_reader", RUNS, ids=[
    f"{c[0]}x{c[1]}-{c[2]}/{c[3]}x{c[4]}-{'whole' if c[6] else 'head'}-{c[7]}-{'y-read-too' if e else 'rope-only'}"
    for c, e in RUNS])
def test_qk_norms_run_inside_the_rope_launch(dt, case, extra_reader, rng):
    from rlx_backend_cuda.ops import RopeNorm

    B, S, H, KV, D, half, whole, style, off = case
    ins = {"qkv": rng.uniform(-2, 2, (B, S, (H + 2 * KV) * D)).astype(np.float32).astype(dt.np),
           "pos": rng.integers(0, CTX - S + 1, (B,)).astype(np.int32)}
    ang = rng.uniform(0, 6, (B, S, half))
    ins.update(cos=np.cos(ang).astype(np.float32), sin=np.sin(ang).astype(np.float32))
    n = H * D if whole else D
    params = {w: rng.uniform(0.5, 1.5, (k,)).astype(np.float32).astype(dt.np)
              for w, k in (("wq", n), ("wk", KV * D if whole else D))}
    out, ops = run(build(B, S, H, KV, D, half, dt, whole, style, off, extra_reader), params, ins)
    q, k, v = reference(ins, params, B, S, H, KV, D, whole, style, off)
    tol = 2e-2 if dt is BF16 else 1e-5
    assert rel(out["q"], q) < tol
    for b in range(B):
        p = int(ins["pos"][b])
        assert rel(out["kc"][b, :, p:p + S], k[b]) < tol
        assert rel(out["vc"][b, :, p:p + S], v[b]) < tol
    # whole rows of more positions than decode's few stay a (paired) launch: each head's warp
    # would sum its position's row again; a norm with another reader keeps its own launch
    fused = not whole or B * S <= RopeNorm.WHOLE_MAX_ROWS
    assert ops.get("rope") == 1 and "kv_write" not in ops, ops
    assert ops.get("rms_norm", 0) == (0 if fused and not extra_reader else 1), ops


@gpu
def test_the_switch_keeps_the_norms_launch(rng):
    from rlx_backend_cuda import set_config

    B, S, H, KV, D, half = 1, 1, 4, 2, 64, 32
    ins = {"qkv": rng.uniform(-2, 2, (B, S, (H + 2 * KV) * D)).astype(np.float32),
           "pos": np.array([3], np.int32)}
    ang = rng.uniform(0, 6, (B, S, half))
    ins.update(cos=np.cos(ang).astype(np.float32), sin=np.sin(ang).astype(np.float32))
    params = {w: rng.uniform(0.5, 1.5, (D,)).astype(np.float32) for w in ("wq", "wk")}
    set_config(rope_norm=False)
    try:
        out, ops = run(build(B, S, H, KV, D, half, F32, False, "half", 0.0, False), params, ins)
    finally:
        set_config(rope_norm=True)
    q, _, _ = reference(ins, params, B, S, H, KV, D, False, "half", 0.0)
    assert rel(out["q"], q) < 1e-5
    assert ops.get("rms_norm") == 1 and ops.get("rope") == 1, ops       # the q/k pair, then the rope


@pytest.mark.parametrize("v_between", [False, True], ids=["qkv-one-matmul", "v-matmul-between"])
def test_norm_x_must_live_until_the_rope(v_between, rng):
    """The rope can norm x only if x's bytes are still x's when it runs: where v's GEMV comes
    between the norms and the rope (v's weights in another packed scheme than q's and k's, as in
    llama.cpp's Q4_K_M) the plan may hand the dead q/k product's bytes to v. Decided on the plan
    alone (host only: no GPU needed)."""
    from types import SimpleNamespace

    from rlx_backend_cuda import ops
    from rlx_core.ir.lir import plan

    B, H, D, hid = 1, 2, 16, 32

    def f(m):
        h = m.input("h", (B, 1, hid))
        wqk, wv = m.param("wqk", (2 * H * D, hid)), m.param("wv", (H * D, hid))
        qk = m.matmul(h, wqk, trans_b=True)
        cos, sin = m.input("cos", (B, 1, D // 2)), m.input("sin", (B, 1, D // 2))
        q, k = (m.rms_norm(m.narrow(qk, 2, a * H * D, H * D), m.param(w, (H * D,)), eps=EPS)
                for a, w in ((0, "wq"), (1, "wk")))
        # (v from its own input: a matmul sharing h would join q's and k's as one, as matmuls of one
        # packed scheme do)
        v = m.matmul(m.input("hv", (B, 1, hid)), wv, trans_b=True) if v_between else m.narrow(qk, 2, 0, H * D)
        heads = [m.transpose(m.reshape(t, (B, 1, H, D)), (0, 2, 1, 3)) for t in (q, k, v)]
        return {"q": m.rope(heads[0], cos, sin), "k": m.rope(heads[1], cos, sin), "v": heads[2] * 1.0}
    exe = rlx_core.compile(Graph.define("qk_norm_v_between", f), backend="numpy", params={
        n: rng.standard_normal(s).astype(np.float32)
        for n, s in (("wqk", (2 * H * D, hid)), ("wv", (H * D, hid)), ("wq", (H * D,)), ("wk", (H * D,)))})
    feed = {n: rng.standard_normal((B, 1, hid)).astype(np.float32) for n in ("h", "hv")[:1 + v_between]}
    exe.run({**feed,
             "cos": np.ones((B, 1, D // 2), np.float32), "sin": np.zeros((B, 1, D // 2), np.float32)})
    g = next(iter(exe.lir_cache.values())).graph          # the MIR as the cuda backend gets it, planned its way
    lir = plan(g, *ops.planned_layouts(g))
    b = SimpleNamespace(r=SimpleNamespace(lir=lir), uses=g.consumers())
    norms = [i for i, n in enumerate(g.nodes) if n.op == "rms_norm"]
    assert len(norms) == 2
    for i in norms:
        rope, at = ops._reader_through_views(b, (i, 0))
        assert g.nodes[rope].op == "rope" and at == 0
        assert ops._alive_until(b, tuple(g.nodes[i].inputs[0]), rope) is not v_between
