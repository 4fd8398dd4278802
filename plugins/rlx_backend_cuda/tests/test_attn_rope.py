"""The decode attention doing the step's RoPE in its own launch (attn.cu:decode ROPE,
ops.AttnRope): run on the CPU (cuda_emu) as ops renders it, against the two launches it
replaces (rlx_rope: q roped, k roped into its cache, v into its cache, q's and k's norms; then
rlx_attn_decode on the roped q) bit for bit, outputs and caches, and against a float64
reference; on the GPU, a decode step built with the switch on against it off."""
from __future__ import annotations

import math

import cuda_emu
from cuda_emu import aligned
import numpy as np
import pytest

from rlx_backend_cuda import sources
from rlx_backend_cuda.codegen import ctype
from rlx_backend_cuda.kernels_catalog import OUTPUT_GATE
from rlx_backend_cuda.ops import NO_EPI_ARGS, NO_ROPE_ARGS
from rlx_core.ir.dtype import BF16, F32
from rlx_core.pipeline import available_backends
from rlx_core.testing.parity import TOL, ref_attention

_OK, _WHY = next(((ok, why) for b, ok, why in available_backends() if b.name == "cuda"),
                 (False, "rlx-backend-cuda is not registered"))
gpu = pytest.mark.skipif(not _OK, reason=f"backend 'cuda' is not available: {_WHY}")

CASES = [    # (B, H, KVH, Sk, D, half, dtype, interleaved, norms, groups, gate): rotary dims 2 half of D
    (1, 8, 2, 600, 256, 32, BF16, False, True, 4, True),    # Qwen3.5's: partial rotary, q/k norms, gate
    (2, 4, 2, 300, 64, 32, BF16, True, False, 1, False),    # Llama-like, interleaved pairs, two batch rows
    (1, 4, 1, 200, 32, 8, F32, False, True, 2, True),       # f32, a quarter rotated
]
EPS, OFF = 1e-6, 0.0


@pytest.fixture
def rng(request):
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def rand(rng, shape, dt, lo=-2.0, hi=2.0):
    return aligned(rng.uniform(lo, hi, shape).astype(np.float32).astype(dt.np))


def ref_rope(x, cos, sin, half, interleaved, w):
    """x [B, H, 1, D] normed per head by w (None: not), its first 2 half dims rotated (float64)."""
    x = np.asarray(x, np.float64)
    if w is not None:
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * (np.asarray(w, np.float64) + OFF)
    c, s = (np.asarray(t, np.float64).reshape(-1, 1, 1, half) for t in (cos, sin))
    out = x.copy()
    i1 = np.arange(half) * 2 if interleaved else np.arange(half)
    i2 = i1 + 1 if interleaved else i1 + half
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i2] * c + x[..., i1] * s
    return out


@cuda_emu.emulated
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"D{c[4]}-{c[6].value}-{'il' if c[7] else 'half'}-z{c[9]}")
def test_emulated_decode_attention_does_the_rope(rng, case):
    """... and, with `gate`, the output gate in its store (ops.AttnEpilogue) against the
    elementwise kernel after it."""
    from cuda_emu import compile_kernel

    from rlx_backend_cuda import codegen

    B, H, KVH, Sk, D, half, dt, interleaved, normed, groups, gate = case
    G, t, isz = H // KVH // groups, ctype(dt), np.dtype(dt.np).itemsize
    i64, i32, f32 = np.int64, np.int32, np.float32
    q, k, v = (rand(rng, (B, h, 1, D), dt) for h in (H, KVH, KVH))
    kc, vc = rand(rng, (B, KVH, Sk, D), dt), rand(rng, (B, KVH, Sk, D), dt)
    ang = rng.uniform(0, 2 * np.pi, (B, half))
    cos, sin = aligned(np.cos(ang).astype(np.float32)), aligned(np.sin(ang).astype(np.float32))
    qw, kw = (rand(rng, (D,), dt, 0.5, 1.5) if normed else None for _ in range(2))
    pos = aligned(np.array([Sk - 1 - 37 * b for b in range(B)], np.int32))
    mask = aligned(np.ones((B, 1, 1, Sk), bool))
    err = aligned(np.zeros(4, np.int32))
    sh = sources.attn_decode_shape(G, D, 16 // isz, pair=True, rope_bytes=(G + 2) * D * isz)
    masking = dict(MASKKIND=1, MASKMODE=1, HEADMASK=0, TM="bool", TP="int", HAS_POS=1)

    g = rand(rng, (B, 1, H, D), dt)                  # the gate rows (o's [B, H, D] order)
    y = aligned(np.zeros((B, 1, H, D), dt.np))

    def attention(rope: bool, qx, kcache, vcache):
        defines = {**sources.ATTN_DECODE_PLAIN,
                   **(dict(ROPE=1, INTERLEAVED=int(interleaved), TC="float", TN=t) if rope else {})}
        epi = NO_EPI_ARGS
        if rope and gate:
            defines.update(EPI=1, EPI_FN=codegen.epilogue_function(OUTPUT_GATE, [dt, dt], dt, "rlx_epi"),
                           EPI_CALL="rlx_epi(o, e)", TE=t, TY=t)
            epi = (g, i64(H * D), i64(D), y, i64(H * D), i64(D))
        src = sources.render(sources.ATTN_DECODE, TQ=t, TK=t, TV=t, TO=t, QV=1, **masking, **sh, **defines)
        out = aligned(np.zeros((B, H, 1, D), dt.np))
        rope_args = (k, i64(KVH * D), i64(D), v, i64(KVH * D), i64(D), kcache, vcache, cos, sin, i32(half),
                     i32(1), qw, kw, f32(EPS), f32(OFF), f32(EPS), f32(OFF), err, i32(5))
        more = (rope_args if rope else NO_ROPE_ARGS) + epi
        compile_kernel(src, "rlx_attn_decode").launch((B * KVH, sh["CL"], groups), (sh["NT"],), (
            qx, i64(H * D), i64(D), kcache, i64(KVH * Sk * D), i64(Sk * D), i64(D),
            vcache, i64(KVH * Sk * D), i64(Sk * D), i64(D), mask, i64(Sk), i64(0), i64(1),
            pos, i32(H), i32(KVH), i32(Sk), 1 / math.sqrt(D), 0.0, i32(0), out, i64(H * D), i64(D), *more))
        return out

    # the two launches the fold replaces: the RoPE (three jobs), then the attention on its q
    rope_src = sources.render(sources.ROPE, TX=t, TC="float", TO=t, ACC="float", INTERLEAVED=int(interleaved),
                              TP="int", TN=t)
    kc0, vc0, qr = aligned(kc.copy()), aligned(vc.copy()), aligned(np.zeros_like(q))

    def job(x, h, o, ostr, rot, at, w):
        return (x, i64(h * D), i64(D), i64(D), i64(1), o, *map(i64, ostr), i32(h), i32(rot), i32(at), w,
                i32(1 if w is not None else 0), f32(EPS), f32(OFF))
    cache = (KVH * Sk * D, Sk * D, D, 1)
    compile_kernel(rope_src, "rlx_rope").launch((4,), (32, 8), (
        cos, sin, i32(B), i32(1), i32(D), i32(half), i32(1), pos, i64(Sk), err, i32(5),
        *job(q, H, qr, (H * D, D, D, 1), 1, 0, qw), *job(k, KVH, kc0, cache, 1, 1, kw),
        *job(v, KVH, vc0, cache, 0, 1, None)))
    want = attention(False, qr, kc0, vc0)
    got_kc, got_vc = aligned(kc.copy()), aligned(vc.copy())
    got = attention(True, q, got_kc, got_vc)
    assert not err.any(), err
    if gate:                       # the gate's own kernel on the unfused output, against the store's
        ew = codegen.elementwise_source(OUTPUT_GATE, [dt, dt], dt, ["c", "c", "c"], 1, False)
        want_y = aligned(np.zeros_like(y))
        compile_kernel(ew, "rlx_ew").launch((4,), (64,), (want, g, want_y, i32(want.size)))
        np.testing.assert_array_equal(y.view(np.uint8), want_y.view(np.uint8))
        assert not got.any()       # (the store wrote the gate's output, not o)
    else:
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(got_kc.view(np.uint8), kc0.view(np.uint8))
    np.testing.assert_array_equal(got_vc.view(np.uint8), vc0.view(np.uint8))
    # and the float64 reference: rope (and norms) of the new rows, attention over the caches
    f64 = lambda a: np.asarray(a, np.float64)     # noqa: E731
    rk, rv = f64(kc), f64(vc)
    for b in range(B):
        rk[b, :, pos[b]] = ref_rope(k, cos, sin, half, interleaved, kw)[b, :, 0]
        rv[b, :, pos[b]] = f64(v)[b, :, 0]
    rq = ref_rope(q, cos, sin, half, interleaved, qw)
    ref = ref_attention(rq, rk, rv, None, pos, scale=1 / math.sqrt(D))
    if gate:
        ref = ref * (1 / (1 + np.exp(-f64(g).reshape(B, H, 1, D))))
        got = y.reshape(B, H, 1, D)
    assert np.abs(f64(got) - ref).max() / np.abs(ref).max() <= 2 * TOL[dt]


@cuda_emu.emulated
def test_emulated_fold_flags_a_position_past_the_cache(rng):
    """pos[b] past the cache: the kv_write's error (2, its node), no row written anywhere."""
    from cuda_emu import compile_kernel

    B, H, KVH, Sk, D, half, dt = 1, 2, 1, 40, 32, 16, F32
    sh = sources.attn_decode_shape(2, D, 4, pair=True, rope_bytes=4 * D * 4)
    src = sources.render(sources.ATTN_DECODE, TQ="float", TK="float", TV="float", TO="float", QV=1,
                         MASKKIND=1, MASKMODE=0, HEADMASK=0, TM="float", TP="int", HAS_POS=1, **sh,
                         **{**sources.ATTN_DECODE_PLAIN, "ROPE": 1})
    q, k, v = (rand(rng, (B, h, 1, D), dt) for h in (H, KVH, KVH))
    kc, vc = rand(rng, (B, KVH, Sk, D), dt), rand(rng, (B, KVH, Sk, D), dt)
    kc0, vc0 = kc.copy(), vc.copy()
    cos, sin = aligned(np.ones((1, half), np.float32)), aligned(np.zeros((1, half), np.float32))
    err, out = aligned(np.zeros(4, np.int32)), aligned(np.zeros((B, H, 1, D), np.float32))
    i64, i32, f32 = np.int64, np.int32, np.float32
    compile_kernel(src, "rlx_attn_decode").launch((B * KVH, sh["CL"], 1), (sh["NT"],), (
        q, i64(H * D), i64(D), kc, i64(Sk * D), i64(Sk * D), i64(D), vc, i64(Sk * D), i64(Sk * D), i64(D),
        None, i64(0), i64(0), i64(0), aligned(np.array([Sk], np.int32)), i32(H), i32(KVH), i32(Sk),
        1 / math.sqrt(D), 0.0, i32(0), out, i64(H * D), i64(D),
        k, i64(D), i64(D), v, i64(D), i64(D), kc, vc, cos, sin, i32(half), i32(0), None, None,
        f32(0), f32(0), f32(0), f32(0), err, i32(9), *NO_EPI_ARGS))
    assert err[0] == 2 and err[1] == 9, err
    np.testing.assert_array_equal(kc, kc0)
    np.testing.assert_array_equal(vc, vc0)


def decode_step(B, H, KV, D, half, ctx, dt, style):
    """One decode position: qkv [B, 1, (2 H + 2 KV) D] -> q, k normed per head, roped, k and v
    written into the caches at pos, attention over them (causal at pos), times sigmoid(gate)."""
    from rlx_core.ir.dtype import I32
    from rlx_core.ir.graph import Graph

    def f(m):
        qkv = m.input("qkv", (B, 1, (2 * H + 2 * KV) * D), dt)
        pos = m.input("pos", (B,), I32)
        cos, sin = m.input("cos", (B, 1, half)), m.input("sin", (B, 1, half))
        q, k, v, gate = (m.reshape(m.narrow(qkv, 2, a * D, n * D), (B, 1, n, D))
                         for a, n in ((0, H), (H, KV), (H + KV, KV), (H + 2 * KV, H)))
        q = m.rms_norm(q, m.param("wq", (D,), dt), eps=EPS)
        k = m.rms_norm(k, m.param("wk", (D,), dt), eps=EPS)
        q, k, v = (m.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
        kc = m.kv_write(m.state("kc", (B, KV, ctx, D), dt), m.rope(k, cos, sin, style), pos)
        vc = m.kv_write(m.state("vc", (B, KV, ctx, D), dt), v, pos)
        o = m.transpose(m.attention(m.rope(q, cos, sin, style), kc, vc, pos=pos), (0, 2, 1, 3))
        return {"o": m.mul(o, m.sigmoid(gate))}
    return Graph.define("attn_rope_step", f)


@gpu
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_the_step_with_the_fold_computes_what_it_computes_without(rng, style):
    """Two decode positions of a Qwen3.5-like step (q/k norms, a quarter of each head rotated,
    an output gate) with the switches on and off: the same bits each time (outputs and both
    caches); with them on and the cluster decode attention running (sm_90), no rope launch and
    none of the gate where the attention computes it."""
    import rlx_core
    from rlx_backend_cuda import device, set_config
    from rlx_backend_cuda.values import CONFIG

    B, H, KV, D, half, ctx, dt = 1, 8, 2, 128, 16, 1024, BF16
    g = decode_step(B, H, KV, D, half, ctx, dt, style)
    params = {n: rand(rng, (D,), dt, 0.5, 1.5) for n in ("wq", "wk")}
    feeds = []
    for p in (700, 701):
        ang = rng.uniform(0, 2 * np.pi, (B, 1, half))
        feeds.append({"qkv": rand(rng, (B, 1, (2 * H + 2 * KV) * D), dt), "pos": np.full(B, p, np.int32),
                      "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)})
    outs, steps = {}, {}
    was = {k: CONFIG[k] for k in ("attn_rope", "attn_epilogue")}
    for on in (False, True):
        set_config(attn_rope=on, attn_epilogue=on)
        try:
            exe = rlx_core.compile(g, backend="cuda", params=params)
            got = []
            for feed in feeds + feeds[1:]:             # (the third run replays the captured graph)
                out = exe.run(dict(feed))
                got.append(exe.backend.to_host(out["o"]))
            got += [exe.backend.to_host(exe.states[n]) for n in ("kc", "vc")]
            outs[on] = got
            steps[on] = next(iter(exe._runners.values())).describe()["steps_by_op"]
        finally:
            set_config(**was)
    for a, c in zip(outs[False], outs[True]):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(c).view(np.uint8))
    gate = next(op for op in steps[False] if op in ("fused_elementwise", "binary"))
    assert steps[False].get("rope") == 1 and steps[False][gate] >= 1, steps[False]
    if tuple(device.info().get("cc", (0, 0))) >= (9, 0):
        # (the gate's step stays in the list: it launches nothing where the attention computed it)
        assert "rope" not in steps[True] and steps[True]["attention"] == 1, steps[True]
