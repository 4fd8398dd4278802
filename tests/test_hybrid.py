"""rlx_core.flow.hybrid (the generic pieces of hybrid linear-attention decoders) and the
runtime's recurrent states: the pieces against float64 NumPy; the conv and delta-rule stages'
state leaves (a prefill of T tokens then decode steps equal one pass over all of them; left
pads leave the states exactly zero); BatchCache moving a state without a context axis whole
per row."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.flow import ModelFlow
from rlx_core.flow import hybrid as H
from rlx_core.ir.dtype import BOOL, F32, I32
from rlx_core.ir.shape import Shape
from rlx_core.pipeline import StateStore, select_backend
from rlx_core.runtime.batch_cache import BatchCache
from rlx_core.testing.parity import REF_ACT, backend, rlx_backend  # noqa: F401  (fixtures)

HK, HV, K, V, W = 1, 2, 2, 2, 4                # key heads, value heads, their sizes, conv width
C = 2 * HK * K + HV * V                        # conv channels: q | k | v


def ref_softplus(x):
    return np.logaddexp(0.0, x)


def ref_l2norm(x, eps=1e-6):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def test_pieces_match_float64(backend, rng):
    x = rng.standard_normal((2, 5, 8)).astype(np.float32) * 3
    x[0, 0, :2] = (30.0, -30.0)                          # softplus far out on both sides
    z = rng.standard_normal((2, 5, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    mask = np.ones((2, 1, 1, 5), bool)
    mask[1, ..., :2] = False

    def body(m, value, ctx):
        zz = ctx.inputs["z"]
        ctx.outputs["gated"] = H.gated_rms_norm(m, value, ctx.param("w", (8,)), zz, 1e-6)
        ctx.outputs["gate"] = H.output_gate(m, value, zz)
        ctx.outputs["l2"] = H.l2norm(m, value)
        ctx.outputs["pads"] = H.zero_pads(ctx, value, H.PREFILL)
        return H.softplus(m, value)

    f = (ModelFlow("pieces").input("x", ("batch", "seq", 8), F32).input("z", ("batch", "seq", 8), F32)
         .input("key_mask", ("batch", 1, 1, "seq"), BOOL).custom(body))
    out = f.build({"w": w}).compile(backend).run({"x": x, "z": z, "key_mask": mask})
    xd, zd = x.astype(np.float64), z.astype(np.float64)
    rms = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    want = {"logits": ref_softplus(xd), "gated": rms * w * REF_ACT["silu"](zd),
            "gate": xd * REF_ACT["sigmoid"](zd), "l2": ref_l2norm(xd),
            "pads": np.where(mask[:, 0, 0, :, None], xd, 0.0)}
    for name, ref in want.items():
        np.testing.assert_allclose(out[name], ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max(), err_msg=name)


def mixer(decode: bool):
    """A tiny generic linear-attention layer: conv over x [B, T, C + 4] (q | k | v | g-input |
    beta-input), then the delta rule, both with their state leaves (layer 0)."""
    def body(m, x, ctx):
        mode = H.state_mode(ctx, decode)
        x = H.zero_pads(ctx, x, mode)
        b, t = x.dims[0], x.dims[1]
        conv = H.RecurrentState("state.0.conv", (C, W - 1), mode)
        y = H.short_conv(ctx, m.narrow(x, 2, 0, C), ctx.param("conv", (C, W)), conv, act="silu")
        q = H.l2norm(m, m.reshape(m.narrow(y, 2, 0, HK * K), (b, t, HK, K)))
        k = H.l2norm(m, m.reshape(m.narrow(y, 2, HK * K, HK * K), (b, t, HK, K)))
        v = m.reshape(m.narrow(y, 2, 2 * HK * K, HV * V), (b, t, HV, V))
        g = -H.softplus(m, m.narrow(x, 2, C, HV))
        beta = m.act(m.narrow(x, 2, C + HV, HV), "sigmoid")
        rec = H.RecurrentState("state.0.recurrent", (HV, K, V), mode)
        o = H.delta_rule(ctx, q, k, v, g, beta, rec, chunk=4)
        return m.reshape(o, (b, t, HV * V))
    return body


def build(decode: bool, generation: bool = True):
    f = ModelFlow("hybrid").input("x", ("batch", "seq", C + 2 * HV), F32)
    f.input("key_mask", ("batch", 1, 1, "ctx" if decode else "seq"), BOOL)
    if generation:
        f.input("cache_pos", ("batch",), I32)
    return f.custom(mixer(decode))


@pytest.fixture
def conv_w(rng):
    return {"conv": (0.5 * rng.standard_normal((C, W))).astype(np.float32)}


def test_prefill_then_decode_equals_one_pass(backend, rng, conv_w):
    """The prefill writes the conv and recurrent states into their leaves, each decode step
    reads and rewrites them: T = 9 tokens (over two chunks of 4) then 3 steps equal one
    stateless pass over all 12."""
    x = rng.standard_normal((2, 12, C + 2 * HV)).astype(np.float32)
    whole = build(False, generation=False).build(conv_w).compile(backend).run(
        {"x": x, "key_mask": np.ones((2, 1, 1, 12), bool)})["logits"]
    store = StateStore()
    prefill = build(False).build(conv_w).compile(backend, states=store)
    decode = build(True).build(conv_w).compile(backend, states=store)
    outs = [prefill.run({"x": x[:, :9], "key_mask": np.ones((2, 1, 1, 9), bool),
                         "cache_pos": np.zeros(2, np.int32)})["logits"]]
    assert set(store) == {"state.0.conv", "state.0.recurrent"}
    for t in range(9, 12):
        outs.append(decode.run({"x": x[:, t:t + 1], "key_mask": np.ones((2, 1, 1, 16), bool),
                                "cache_pos": np.full(2, t, np.int32)})["logits"])
    got = np.concatenate(outs, 1)
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())


def test_left_pads_leave_the_states_zero(rng, conv_w):
    """A row left-padded by 3 ends the prefill with the states of the row alone."""
    x = rng.standard_normal((1, 6, C + 2 * HV)).astype(np.float32)
    runs = []
    for pad in (0, 3):
        store = StateStore()
        exe = build(False).build(conv_w).compile("numpy", states=store)
        xp = np.concatenate([rng.standard_normal((1, pad, C + 2 * HV)).astype(np.float32), x], 1)
        mask = np.ones((1, 1, 1, 6 + pad), bool)
        mask[..., :pad] = False
        out = exe.run({"x": xp, "key_mask": mask, "cache_pos": np.zeros(1, np.int32)})["logits"]
        runs.append((out[:, pad:], {k: np.array(v) for k, v in store.items()}))
    (a, sa), (b, sb) = runs
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    for name in sa:
        np.testing.assert_allclose(sb[name], sa[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_batch_cache_moves_fixed_states_whole():
    """A state without a ctx axis is placed and moved whole per row; a KV state only its
    first `length` positions."""
    be = select_backend("numpy")
    specs = {"kv": Shape(("b", 2, "ctx", 3), F32), "rec": Shape(("b", 2, 3), F32)}
    cache = BatchCache(be, specs, "b")
    cache.resize(2, 8, [])
    one = {"kv": np.arange(2 * 8 * 3, dtype=np.float32).reshape(1, 2, 8, 3) + 1,
           "rec": np.arange(6, dtype=np.float32).reshape(1, 2, 3) + 1}
    cache.place(1, one, 5)
    np.testing.assert_array_equal(cache.store["rec"][1], one["rec"][0])
    np.testing.assert_array_equal(cache.store["kv"][1, :, :5], one["kv"][0, :, :5])
    cache.resize(4, 16, [(1, 0, 5)])
    assert cache.store["rec"].shape == (4, 2, 3) and cache.store["kv"].shape == (4, 2, 16, 3)
    np.testing.assert_array_equal(cache.store["rec"][0], one["rec"][0])
    np.testing.assert_array_equal(cache.store["kv"][0, :, :5], one["kv"][0, :, :5])
