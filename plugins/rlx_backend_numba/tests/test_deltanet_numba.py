"""The numba kernels of gated_delta_rule and causal_conv1d (rlx_backend_numba.deltanet) against
the step-by-step float64 references of the op suite and against the NumPy backend: both
drivers (one thread, all threads), the recurrent and the chunked form, chunks that do not
divide the steps, GQA, f64 / f32 / bf16, strided operands. The op suite itself
(tests/test_ops.py) runs these ops on this backend too."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rlx_core.ir.dtype import BF16, F32, F64
from rlx_core.ir.numpy_kernels import KERNELS
from rlx_core.testing.ops_suite_deltanet import conv_args, gdn_args, ref_causal_conv1d, ref_gated_delta_rule
from rlx_core.testing.parity import compile_on, one_op
from rlx_core.testing.parity import rng  # noqa: F401  (seeded per test; RLX_TEST_SEED replays)

pytest.importorskip("numba")

from rlx_backend_numba import deltanet as ND  # noqa: E402
from rlx_backend_numba.cblas import SGEMM  # noqa: E402

LOOPS = (0, False)                  # no cblas_sgemm: every product in loops
GEMM = SGEMM or LOOPS               # what the backend passes
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-10}


def close(got, want, tol: float):
    want = np.asarray(want, np.float64)
    atol = tol * float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=atol)


def _gdn_inputs(rng, t: int, dt, hk=2, decay="typical") -> dict:
    return {a.name: a.data for a in gdn_args(rng, t, dt, decay=decay, hk=hk)}


# ----------------------------------------------------------------------------- gated_delta_rule
@pytest.mark.parametrize("kern", [ND.gdn_par, ND.gdn_ser], ids=["par", "ser"])
@pytest.mark.parametrize("dt", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("t,chunk,recurrent", [(1, 16, True), (3, 16, True), (45, 16, False), (45, 64, False),
                                               (7, 3, False), (1, 16, False)], ids=str)
@pytest.mark.parametrize("hk", [2, 4], ids=["gqa", "mha"])
def test_gdn_kernel_matches_the_reference(rng, kern, dt, t, chunk, recurrent, hk):
    """Either form from a nonzero state, any chunk (f32: the chunk's products by cblas_sgemm
    where numpy's BLAS is an OpenBLAS): both outputs against the recurrence."""
    _check_kernel(rng, kern, dt, t, chunk, recurrent, hk, GEMM)


@pytest.mark.parametrize("t,chunk", [(45, 16), (7, 3)], ids=str)
def test_gdn_f32_products_in_loops(rng, t, chunk):
    """The f32 chunked form without cblas_sgemm (numpy's BLAS not an OpenBLAS): loops."""
    _check_kernel(rng, ND.gdn_par, np.float32, t, chunk, False, 2, LOOPS)


def _check_kernel(rng, kern, dt, t, chunk, recurrent, hk, gemm):
    x = _gdn_inputs(rng, t, F64 if dt is np.float64 else F32, hk=hk)
    args = [np.ascontiguousarray(x[n], dt) for n in ("q", "k", "v", "g", "beta", "state")]
    o, s1 = np.full(x["v"].shape, np.nan, dt), np.full(x["state"].shape, np.nan, dt)
    kern(*args, o, s1, dt(0.35), chunk, recurrent, *gemm)
    want_o, want_s = ref_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta", "state")), scale=0.35)
    close(o, want_o, TOL[np.dtype(dt)])
    close(s1, want_s, TOL[np.dtype(dt)])


@pytest.mark.parametrize("kern", [ND.gdn_par, ND.gdn_ser], ids=["par", "ser"])
@pytest.mark.parametrize("t", [1, 3], ids=lambda t: f"T{t}")
def test_gdn_recurrent_form_in_place(rng, kern, t):
    """Decode writing the new state over the start state (one array for both, as a runner
    updating a state leaf in place may pass): the same outputs as the recurrence."""
    x = _gdn_inputs(rng, t, F32)
    args = [np.ascontiguousarray(x[n], np.float32) for n in ("q", "k", "v", "g", "beta", "state")]
    state = args[-1]
    o = np.full(x["v"].shape, np.nan, np.float32)
    kern(*args, o, state, np.float32(0.35), 16, True, *LOOPS)
    want_o, want_s = ref_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta", "state")), scale=0.35)
    close(o, want_o, TOL[np.dtype(np.float32)])
    close(state, want_s, TOL[np.dtype(np.float32)])


@pytest.mark.parametrize("decay", ["near0", "strong"])
def test_gdn_kernel_decay_extremes(rng, decay):
    """A decay that keeps the state (near 0) and one whose exp underflows (every exponent the
    kernel takes is <= 0: no inf, no NaN)."""
    x = _gdn_inputs(rng, 40, F64, decay=decay)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "state")]
    o, s1 = np.empty(x["v"].shape), np.empty(x["state"].shape)
    ND.gdn_par(*args, o, s1, 0.35, 16, False, *LOOPS)
    want_o, want_s = ref_gated_delta_rule(*args, scale=0.35)
    close(o, want_o, 1e-10)
    close(s1, want_s, 1e-10)


def _numba_runner(op, args, attrs):
    exe = compile_on(one_op(op, args, attrs), "numba")
    inputs = {a.name: a.data.astype(a.dtype.np) for a in args}
    runner = exe.runner(exe._bind_dims(inputs))
    return exe, inputs, runner


@pytest.mark.parametrize("t", [2, 50], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("dt", [F32, BF16], ids=lambda d: d.value)
def test_gdn_step_runs_the_numba_kernel_and_agrees_with_numpy(rng, t, dt):
    """Through the backend: the node's step is this module's (not the NumPy kernel), and its
    outputs equal the NumPy backend's (bf16: computed in f32, rounded once, as NumPy does)."""
    args = gdn_args(rng, t, dt)
    attrs = {"scale": 0.35, "chunk": 16}
    exe, inputs, runner = _numba_runner("gated_delta_rule", args, attrs)
    assert all(fn is not KERNELS["gated_delta_rule"] for _, _, fn, *_ in runner.steps)
    got = exe.run(inputs)
    want = compile_on(one_op("gated_delta_rule", args, attrs), "numpy").run(inputs)
    for name in want:
        tol = 1e-2 if dt is BF16 else 2e-5
        close(np.asarray(got[name], np.float64), np.asarray(want[name], np.float64), tol)


# ----------------------------------------------------------------------------- causal_conv1d
@pytest.mark.parametrize("width,t", [(4, 1), (4, 2), (4, 33), (1, 5), (2, 3)], ids=str)
@pytest.mark.parametrize("act", ["identity", "silu", "gelu"])
def test_conv_step_matches_the_reference(rng, width, t, act):
    """The prepared step on its own: taps from the state then x, bias, any table activation,
    the new state; operands that are strided views (copied in) and a state of width 1."""
    x, w, st, bias = (a.data for a in conv_args(rng, t, F32, width=width))
    wide = np.zeros((x.shape[0], t, 2 * x.shape[2]), np.float32)
    wide[:, :, ::2] = x
    xv = wide[:, :, ::2]                                     # strided channels
    outs = [np.full(x.shape, np.nan, np.float32), np.full(st.shape, np.nan, np.float32)]
    protos = [xv, w.astype(np.float32), st.astype(np.float32), bias.astype(np.float32)]
    step = ND.prepare_causal_conv1d({"act": act}, outs, protos)
    assert step is not None
    step({"act": act}, outs, *protos)
    want_y, want_s = ref_causal_conv1d(x, w, st, bias, act=act)
    close(outs[0], want_y, 2e-5)
    np.testing.assert_array_equal(outs[1], want_s.astype(np.float32))


@pytest.mark.parametrize("dt", [F64, BF16], ids=lambda d: d.value)
def test_conv_through_the_backend_agrees_with_numpy(rng, dt):
    """A long prefill (all threads) in f64 and bf16 (computed in f32), through the backend."""
    args = conv_args(rng, 300, dt, channels=130)
    exe, inputs, runner = _numba_runner("causal_conv1d", args, {"act": "silu"})
    assert all(fn is not KERNELS["causal_conv1d"] for _, _, fn, *_ in runner.steps)
    got = exe.run(inputs)
    want = compile_on(one_op("causal_conv1d", args, {"act": "silu"}), "numpy").run(inputs)
    for name in want:
        g, w_ = np.asarray(got[name]), np.asarray(want[name])
        assert g.dtype == w_.dtype == (ml_dtypes.bfloat16 if dt is BF16 else np.float64)
        close(g.astype(np.float64), w_.astype(np.float64), 1e-2 if dt is BF16 else 1e-12)
