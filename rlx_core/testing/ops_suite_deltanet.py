"""The op parity suite's cases for rlx_core.ir.deltanet's ops (pulled into ops_suite): each op
against an independent float64 reference on the kit's backends.

The references are the definitions step by step (one token at a time, one head at a time),
never a chunked form: a kernel's chunking, padding and triangular solve are what is tested."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from rlx_core.ir.dtype import F32, F64

from .parity import REF_ACT, Arg, exact, rand, run_parity
from .suite_base import covers, fdtype

# gated_delta_rule's shapes: batch, key heads, value heads (GQA: 2 per key head), K, V
GDN = dict(b=2, hk=2, h=4, kd=8, vd=6)
DECAYS = {"typical": (-1.0, 0.0), "near0": (-0.02, 0.0), "strong": (-20.0, -5.0)}


# ----------------------------------------------------------------------------- references
def ref_gated_delta_rule(q, k, v, g, beta, state, scale: float) -> tuple:
    """The recurrence one step at a time, float64: per batch b, head h (key head h // (H / Hk)),
    S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q)."""
    b_, t_, hk, _ = q.shape
    h_ = v.shape[2]
    per = h_ // hk
    o = np.zeros(v.shape)
    s_out = np.array(state, np.float64)
    for b in range(b_):
        for h in range(h_):
            s = s_out[b, h]
            for t in range(t_):
                kt, qt = k[b, t, h // per], q[b, t, h // per]
                s = s * np.exp(g[b, t, h])
                s = s + np.outer(kt, beta[b, t, h] * (v[b, t, h] - s.T @ kt))
                o[b, t, h] = s.T @ (scale * qt)
            s_out[b, h] = s
    return o, s_out


def ref_causal_conv1d(x, w, state, bias=None, act: str = "identity") -> tuple:
    """Each channel's taps over the inputs before it, oldest tap first, float64: u = the
    state's W - 1 steps then x; y[t] = act(bias + sum_i w[:, i] u[t + i]); the new state is
    u's last W - 1 steps."""
    b_, t_, c_ = x.shape
    width = w.shape[1]
    u = np.concatenate([np.transpose(state, (0, 2, 1)), x], axis=1)
    y = np.zeros(x.shape)
    for t in range(t_):
        for i in range(width):
            y[:, t] += w[:, i] * u[:, t + i]
    if bias is not None:
        y = y + bias
    return REF_ACT[act](y), np.transpose(u[:, t_:], (0, 2, 1))


def ref_gated_delta_net(x, w, conv_state, z, b, a, a_log, dt_bias, norm_w, state, scale: float,
                        eps: float) -> tuple:
    """A Gated DeltaNet layer between its projections, float64, from the definitions above: the
    short conv with silu, q and k L2-normalized (eps 1e-6), g = -exp(A_log) log(1 + exp(a +
    dt_bias)), beta = 1 / (1 + exp(-b)), the rule, then o / sqrt(mean(o^2) + eps) norm_w silu(z)."""
    h, kd, vd = state.shape[1], state.shape[2], state.shape[3]
    hk = (x.shape[2] - h * vd) // (2 * kd)
    bt, t = x.shape[0], x.shape[1]
    y, conv_new = ref_causal_conv1d(x, w, conv_state, act="silu")

    def unit(u):
        return u / np.sqrt(np.sum(u * u, axis=-1, keepdims=True) + 1e-6)
    q = unit(y[:, :, :hk * kd].reshape(bt, t, hk, kd))
    k = unit(y[:, :, hk * kd:2 * hk * kd].reshape(bt, t, hk, kd))
    v = y[:, :, 2 * hk * kd:].reshape(bt, t, h, vd)
    g = -np.exp(a_log) * np.log1p(np.exp(a + dt_bias))
    o, s = ref_gated_delta_rule(q, k, v, g, REF_ACT["sigmoid"](b), state, scale)
    o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * norm_w * REF_ACT["silu"](z)
    return o, conv_new, s


# ----------------------------------------------------------------------------- inputs
def _unit_rows(rng, dims, dt) -> np.ndarray:
    """Rows of length 1 (models L2-normalize q and k before the rule: the state stays bounded)."""
    x = rng.normal(size=dims)
    return exact(x / np.linalg.norm(x, axis=-1, keepdims=True), dt)


def gdn_args(rng, t: int, dt, decay: str = "typical", hk: int = GDN["hk"], h: int = GDN["h"],
             state_kind: str = "input") -> list:
    """q, k, v, g, beta, state of a gated_delta_rule call: unit q and k rows, beta in (0, 1),
    g (<= 0) in the range DECAYS names, a nonzero start state."""
    b, kd, vd = GDN["b"], GDN["kd"], GDN["vd"]
    lo, hi = DECAYS[decay]
    return [Arg("q", _unit_rows(rng, (b, t, hk, kd), dt), dt),
            Arg("k", _unit_rows(rng, (b, t, hk, kd), dt), dt),
            Arg("v", rand(rng, (b, t, h, vd), dt), dt), Arg("g", rand(rng, (b, t, h), dt, lo, hi), dt),
            Arg("beta", rand(rng, (b, t, h), dt, 0.0, 1.0), dt),
            Arg("state", rand(rng, (b, h, kd, vd), dt, -1.0, 1.0), dt, state_kind)]


def run_gdn(backend, args: list, scale: float = 0.35, chunk: int = 16, tol=None) -> list:
    """gated_delta_rule on `args` against the step-by-step reference: both outputs."""
    return run_parity(backend, "gated_delta_rule", args, {"scale": scale, "chunk": chunk},
                      lambda q, k, v, g, beta, st: ref_gated_delta_rule(q, k, v, g, beta, st, scale), tol=tol)


# ----------------------------------------------------------------------------- gated_delta_rule
@covers("gated_delta_rule")
@fdtype
@pytest.mark.parametrize("t", [1, 5, 37], ids=lambda t: f"T{t}")
def test_gated_delta_rule(backend, rng, dt, t):
    """Decode (one step from a nonzero state), a prefill shorter than a chunk and one of 37
    steps (chunk 16: two whole chunks and a partial one); GQA (2 value heads a key head);
    both outputs, the state after the last step included."""
    run_gdn(backend, gdn_args(rng, t, dt))


@pytest.mark.parametrize("decay", sorted(DECAYS))
@pytest.mark.parametrize("dt", [F32, F64], ids=lambda d: d.value)
def test_gated_delta_rule_decays(backend, rng, decay, dt):
    """g near 0 (the state barely decays: the chunk's products reach far back) and strongly
    negative (a step's decay underflows to 0: nothing carries over, no inf or NaN)."""
    run_gdn(backend, gdn_args(rng, 37, dt, decay))


@pytest.mark.parametrize("t", [1, 40])
def test_gated_delta_rule_state_leaf(backend, rng, t):
    """The state read from a state leaf (a decode graph's), heads not grouped (H = Hk)."""
    run_gdn(backend, gdn_args(rng, t, F32, hk=4, state_kind="state"))


def test_gated_delta_rule_chunk_independent(backend, rng):
    """The chunk length is a kernel's tuning: 16, 64 and 5 give the same result (each within
    tolerance of the reference, and of each other) on 150 steps."""
    args = gdn_args(rng, 150, F32)
    outs = [run_gdn(backend, args, chunk=c) for c in (16, 64, 5)]
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(a))))


# ----------------------------------------------------------------------------- gated_delta_net
def net_args(rng, t: int, dt, hk: int = GDN["hk"], width: int = 4, state_kind: str = "input") -> list:
    """x, conv_w, conv_state, z, b, a, A_log, dt_bias, norm_w, state of a gated_delta_net call:
    GDN's heads, decays from A_log in log [1, 16) and a + dt_bias in [-3, 3), nonzero states."""
    b, h, kd, vd = GDN["b"], GDN["h"], GDN["kd"], GDN["vd"]
    c = 2 * hk * kd + h * vd
    return [Arg("x", rand(rng, (b, t, c), dt), dt), Arg("conv_w", rand(rng, (c, width), dt, -1, 1), dt),
            Arg("conv_state", rand(rng, (b, c, width - 1), dt), dt, state_kind),
            Arg("z", rand(rng, (b, t, h, vd), dt), dt), Arg("b", rand(rng, (b, t, h), dt, -3, 3), dt),
            Arg("a", rand(rng, (b, t, h), dt, -2, 2), dt),
            Arg("A_log", exact(np.log(rng.uniform(1, 16, h)), dt), dt), Arg("dt_bias", rand(rng, (h,), dt, -1, 1), dt),
            Arg("norm_w", rand(rng, (vd,), dt, 0.5, 1.5), dt),
            Arg("state", rand(rng, (b, h, kd, vd), dt, -1.0, 1.0), dt, state_kind)]


def run_net(backend, args: list, scale: float = 0.35, eps: float = 1e-5, chunk: int = 16) -> list:
    """gated_delta_net on `args` against ref_gated_delta_net: all three outputs, within the
    dtype's TOL (kernels and the composite compute in f32 and round each output once)."""
    return run_parity(backend, "gated_delta_net", args, {"scale": scale, "eps": eps, "chunk": chunk},
                      functools.partial(ref_gated_delta_net, scale=scale, eps=eps))


@covers("gated_delta_net")
@fdtype
@pytest.mark.parametrize("t", [1, 5, 37], ids=lambda t: f"T{t}")
def test_gated_delta_net(backend, rng, dt, t):
    """A decode step, a few steps and 37 (chunk 16: two whole chunks and a partial one, where a
    kernel takes the chunked form); GQA (2 value heads a key head); every output."""
    run_net(backend, net_args(rng, t, dt))


@pytest.mark.parametrize("t,width", [(1, 4), (3, 2), (1, 1)], ids=str)
def test_gated_delta_net_state_leaves(backend, rng, t, width):
    """Both states read from and written to state leaves (a decode graph's: in place), heads
    not grouped (H = Hk); conv widths 4, 2 and 1 (no conv state to carry)."""
    run_net(backend, net_args(rng, t, F32, hk=GDN["h"], width=width, state_kind="state"))


# ----------------------------------------------------------------------------- causal_conv1d
def conv_args(rng, t: int, dt, width: int = 4, channels: int = 12, bias: bool = True) -> list:
    b = 2
    args = [Arg("x", rand(rng, (b, t, channels), dt), dt),
            Arg("w", rand(rng, (channels, width), dt, -1, 1), dt),
            Arg("state", rand(rng, (b, channels, width - 1), dt), dt)]
    return args + ([Arg("bias", rand(rng, (channels,), dt, -1, 1), dt)] if bias else [])


@covers("causal_conv1d")
@fdtype
@pytest.mark.parametrize("t", [1, 9], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("act,bias", [("identity", False), ("silu", True)], ids=["plain", "bias_silu"])
def test_causal_conv1d(backend, rng, dt, t, act, bias):
    """Decode (T = 1: every tap but the last from the state) and prefill, from a nonzero
    state; the new state is the last W - 1 inputs."""
    run_parity(backend, "causal_conv1d", conv_args(rng, t, dt, bias=bias), {"act": act},
               lambda x, w, st, b=None: ref_causal_conv1d(x, w, st, b, act))


@pytest.mark.parametrize("width,t", [(1, 5), (2, 1), (4, 2), (5, 3)], ids=str)
def test_causal_conv1d_widths(backend, rng, width, t):
    """Width 1 (no state to carry: an empty one), and prompts shorter than the width (the
    new state mixes the old one's steps with x's)."""
    run_parity(backend, "causal_conv1d", conv_args(rng, t, F32, width=width), {"act": "identity"},
               ref_causal_conv1d)


__all__ = [n for n in dir() if n.startswith("test_")] + [
    "DECAYS", "GDN", "conv_args", "gdn_args", "net_args", "ref_causal_conv1d", "ref_gated_delta_net",
    "ref_gated_delta_rule", "run_gdn", "run_net"]
