"""The decode-time state kernels of the numba backend against float64 references: the short
convolution's few-step kernel (deltanet.conv_steps) on the op's own layouts, written into a
separate new state or in place over the state it read (as the runner binds it where the
op's new state is only assigned back: NumbaRunner._state_rewrites), and the prepared
causal_conv1d and gated_delta_rule steps with `in_place` set, which must leave the new state
in the state array and the same outputs as without it."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.testing.ops_suite_deltanet import ref_causal_conv1d, ref_gated_delta_rule
from rlx_core.testing.parity import rng  # noqa: F401  (seeded per test; RLX_TEST_SEED replays)

pytest.importorskip("numba")

from rlx_backend_numba import deltanet as ND  # noqa: E402


def close(got, want, tol: float = 2e-5):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tol * float(np.abs(want).max()))


def conv_operands(rng, t: int, width: int = 4, channels: int = 37):
    """x as a narrow of a wider row (the fused projection's output), w [C, W], state [B, C, W - 1]."""
    wide = rng.standard_normal((2, t, channels + 11)).astype(np.float32)
    x = wide[:, :, 5:5 + channels]
    w = rng.standard_normal((channels, width)).astype(np.float32)
    state = rng.standard_normal((2, channels, width - 1)).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    return x, w, state, bias


@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("in_place", [False, True], ids=["new_state", "in_place"])
def test_conv_steps(rng, t, in_place):
    x, w, state, bias = conv_operands(rng, t)
    want_y, want_s = ref_causal_conv1d(x.astype(np.float64), w.astype(np.float64), state.astype(np.float64),
                                       bias.astype(np.float64))
    y = np.full(x.shape, np.nan, np.float32)
    new = state if in_place else np.full(state.shape, np.nan, np.float32)
    before = state.copy()
    ND.conv_steps(x, w, state, bias, y, new)
    close(y, want_y)
    close(new, want_s)
    if not in_place:
        np.testing.assert_array_equal(state, before)          # the state it read is untouched


def _outs(shapes):
    return [np.full(s, np.nan, np.float32) for s in shapes]


@pytest.mark.parametrize("t", [1, 4, 9], ids=lambda t: f"T{t}")     # 9: the prefill kernel
def test_conv_step_in_place(rng, t):
    x, w, state, bias = conv_operands(rng, t)
    want_y, want_s = ref_causal_conv1d(x.astype(np.float64), w.astype(np.float64), state.astype(np.float64),
                                       bias.astype(np.float64), "silu")
    for in_place in (False, True):
        st = state.copy()
        outs = _outs([x.shape, st.shape])
        step = ND.prepare_causal_conv1d({"act": "silu", "in_place": in_place}, outs, [x, w, st, bias])
        step(None, outs, x, w, st, bias)
        close(outs[0], want_y)
        close(st if in_place else outs[1], want_s)
        if in_place:
            assert np.isnan(outs[1]).all()               # the op's own new-state buffer stays unwritten
        else:
            np.testing.assert_array_equal(st, state)


@pytest.mark.parametrize("t", [1, 6], ids=lambda t: f"T{t}")     # recurrent and chunked forms
def test_gated_delta_rule_step_in_place(rng, t):
    b, hk, h, kd, vd = 1, 2, 4, 16, 8
    q, k = (rng.standard_normal((b, t, hk, kd)).astype(np.float32) for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, vd)).astype(np.float32)
    g = -rng.uniform(0.01, 1, (b, t, h)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    state = rng.standard_normal((b, h, kd, vd)).astype(np.float32)
    a = {"scale": kd ** -0.5, "chunk": 4}
    want_o, want_s = ref_gated_delta_rule(*(z.astype(np.float64) for z in (q, k, v, g, beta, state)),
                                          scale=a["scale"])
    st = state.copy()
    outs = _outs([v.shape, state.shape])
    step = ND.prepare_gated_delta_rule({**a, "in_place": True}, outs, [q, k, v, g, beta, st])
    step(None, outs, q, k, v, g, beta, st)
    close(outs[0], want_o, 1e-4)
    close(st, want_s, 1e-4)
    assert np.isnan(outs[1]).all()
