"""gated_delta_rule and causal_conv1d beyond the op suite's one-op cases: the composites a
backend without the kernels gets, the NumPy kernels against transformers' own torch functions
(an independent implementation of the chunked form), a decode graph that carries both states
through state leaves, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core import BF16, F32, Builder
from rlx_core.ir.errors import DTypeError, RlxError, ShapeError
from rlx_core.testing.ops_suite_deltanet import (GDN, conv_args, gdn_args, ref_causal_conv1d,
                                                 ref_gated_delta_rule, run_gdn)
from rlx_core.testing.parity import backend_params, compile_on, numpy_without, one_op, run_parity

OPS = ("gated_delta_rule", "causal_conv1d")


# ----------------------------------------------------------------------------- the composites
@pytest.mark.parametrize("dt", [F32, BF16], ids=lambda d: d.value)
def test_legalized_composites_match_the_references(rng, dt):
    """A backend without either kernel runs both ops as their composites (the scan over
    steps, gathered taps): no node of the ops is left, and the results match."""
    tol = 2e-2 if dt is BF16 else None
    with numpy_without(OPS, "no-deltanet") as name:
        args = gdn_args(rng, 21, dt)
        run_gdn(name, args, chunk=8, tol=tol)
        conv = conv_args(rng, 6, dt)
        run_parity(name, "causal_conv1d", conv, {"act": "silu"},
                   lambda x, w, st, b: ref_causal_conv1d(x, w, st, b, "silu"), tol=tol)
        for op, a, attrs in (("gated_delta_rule", args, {"scale": 0.5}), ("causal_conv1d", conv, {})):
            assert op not in {n.op for n in compile_on(one_op(op, a, attrs), name).mir.nodes}


# ----------------------------------------------------------------------------- against transformers
def _run_numpy(op, arrays: dict, attrs: dict) -> list:
    m = Builder(f"one_{op}", "mir")
    vals = [m.input(n, a.shape, F32) for n, a in arrays.items()]
    outs = m.add(op, tuple(vals), **attrs)
    for i, v in enumerate(outs):
        m.output(f"out{i}", v)
    exe = compile_on(m.build(), "numpy")
    got = exe.run({n: a.astype(np.float32) for n, a in arrays.items()})
    return [np.asarray(got[f"out{i}"], np.float64) for i in range(len(outs))]


@pytest.mark.parametrize("t", [1, 70])
def test_gated_delta_rule_matches_transformers(rng, t):
    """The NumPy kernel (our chunk 16) against transformers' torch_chunk_gated_delta_rule
    (chunk 64) and torch_recurrent_gated_delta_rule, with a start state and 2 value heads a
    key head; scale = K^-1/2 as theirs, q and k L2-normalized beforehand as a model does."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    args = {a.name: a.data for a in gdn_args(rng, t, F32)}
    kd = args["q"].shape[-1]
    o, s = _run_numpy("gated_delta_rule", args, {"scale": kd ** -0.5, "chunk": 16})
    tt = {n: torch.tensor(a, dtype=torch.float32) for n, a in args.items()}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        ho, hs = getattr(hf, name)(tt["q"], tt["k"], tt["v"], tt["g"], tt["beta"], initial_state=tt["state"],
                    output_final_state=True)
        for got, want in ((o, ho), (s, hs)):
            np.testing.assert_allclose(got, want.double().numpy(), rtol=1e-4, atol=1e-4 * np.abs(got).max(),
                                       err_msg=name)


def test_causal_conv1d_matches_transformers(rng):
    """Prefill from a zero state against causal_conv1d_fn, then a decode step from the new
    state against causal_conv1d_update (which updates its state in place)."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, _, bias = (a.data for a in conv_args(rng, 7, F32))
    zero = np.zeros((x.shape[0], x.shape[2], w.shape[1] - 1))
    y, state = _run_numpy("causal_conv1d", dict(x=x, w=w, state=zero, bias=bias), {"act": "silu"})
    tw, tb = torch.tensor(w, dtype=torch.float32), torch.tensor(bias, dtype=torch.float32)
    tx = torch.tensor(x, dtype=torch.float32).transpose(1, 2)
    want = hf.causal_conv1d_fn(tx, tw, tb, activation="silu")
    np.testing.assert_allclose(y, want.transpose(1, 2).double().numpy(), rtol=1e-5, atol=1e-5)
    x1 = rng.standard_normal((x.shape[0], 1, x.shape[2]))
    y1, state1 = _run_numpy("causal_conv1d", dict(x=x1, w=w, state=state, bias=bias), {"act": "silu"})
    hf_state = torch.tensor(state, dtype=torch.float32)
    want1 = hf.causal_conv1d_update(torch.tensor(x1, dtype=torch.float32).transpose(1, 2), hf_state, tw, tb,
                                    activation="silu")
    np.testing.assert_allclose(y1, want1.transpose(1, 2).double().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state1, hf_state.double().numpy(), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- states through a graph
def _decode_graph(dims: dict):
    """conv over the input, then the rule over the conv's output as v; both states are state
    leaves the step writes back (assign), as a model's decode graph does."""
    b, hk, h, kd, vd, width = (dims[n] for n in ("b", "hk", "h", "kd", "vd", "width"))

    def fn(m):
        x = m.input("x", (b, "seq", h * vd))
        q, k = m.input("q", (b, "seq", hk, kd)), m.input("k", (b, "seq", hk, kd))
        g, beta = m.input("g", (b, "seq", h)), m.input("beta", (b, "seq", h))
        conv_state, rule_state = m.state("conv", (b, h * vd, width - 1)), m.state("rule", (b, h, kd, vd))
        y, conv_next = m.add("causal_conv1d", (x, m.param("w", (h * vd, width)), conv_state), act="silu")
        o, rule_next = m.add("gated_delta_rule", (q, k, m.reshape(y, (b, "seq", h, vd)), g, beta, rule_state),
                             scale=0.4, chunk=8)
        m.assign(conv_state, conv_next)
        m.assign(rule_state, rule_next)
        return {"o": o}
    return rlx_core.Graph.define("gdn_decode", fn)


@pytest.mark.parametrize("backend", backend_params(only=("numpy", "numba")))
def test_prefill_then_decode_carries_both_states(backend, rng):
    """A prefill of 19 steps, then 3 one-step decodes, through one executable whose states
    persist between runs: the outputs equal the references over all 22 steps at once."""
    dims = dict(GDN, width=4)                    # gdn_args' shapes
    b, hk, h, kd, vd, width = dims.values()
    total = 22
    whole = {a.name: a.data for a in gdn_args(rng, total, F32)}
    x = rng.uniform(-1, 1, (b, total, h * vd)).astype(np.float32).astype(np.float64)
    w = rng.uniform(-1, 1, (h * vd, width)).astype(np.float32).astype(np.float64)
    conv0 = rng.uniform(-1, 1, (b, h * vd, width - 1)).astype(np.float32).astype(np.float64)
    y, conv_end = ref_causal_conv1d(x, w, conv0, act="silu")
    want, rule_end = ref_gated_delta_rule(whole["q"], whole["k"], y.reshape(b, total, h, vd), whole["g"],
                                          whole["beta"], whole["state"], scale=0.4)
    states = {"conv": conv0.astype(np.float32), "rule": whole["state"].astype(np.float32)}
    exe = rlx_core.compile(_decode_graph(dims), backend=backend, params={"w": w.astype(np.float32)},
                           states=states)
    got = []
    for lo, hi in ((0, 19), (19, 20), (20, 21), (21, 22)):
        feed = {n: whole[n][:, lo:hi].astype(np.float32) for n in ("q", "k", "g", "beta")}
        got.append(exe.backend.to_host(exe.run({**feed, "x": x[:, lo:hi].astype(np.float32)})["o"]))
    np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    host = lambda n: exe.backend.to_host(exe.states[n])  # noqa: E731
    np.testing.assert_allclose(host("conv"), conv_end, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host("rule"), rule_end, rtol=1e-5, atol=1e-5 * np.abs(rule_end).max())


# ----------------------------------------------------------------------------- bad input
def _gdn(q=(1, 3, 2, 4), k=None, v=(1, 3, 4, 5), g=(1, 3, 4), beta=None, state=(1, 4, 4, 5),
         dtypes=None, **attrs):
    m = Builder("bad", "mir")
    shapes = dict(q=q, k=k or q, v=v, g=g, beta=beta or g, state=state)
    vals = [m.input(n, s, (dtypes or {}).get(n, F32)) for n, s in shapes.items()]
    return m.add("gated_delta_rule", tuple(vals), **{"scale": 0.5, **attrs})


@pytest.mark.parametrize("kw,err,match", [
    (dict(v=(1, 3, 3, 5), g=(1, 3, 3), state=(1, 3, 4, 5)), ShapeError,
     "3 value heads is not a multiple of 2 key heads"),
    (dict(state=(1, 4, 5, 5)), ShapeError, "gated_delta_rule state"),
    (dict(k=(1, 4, 2, 4)), ShapeError, "gated_delta_rule k"),
    (dict(dtypes={"state": BF16}), DTypeError, "gated_delta_rule state is bf16, expected f32"),
    (dict(chunk=0), RlxError, "chunk"),
], ids=["heads", "state_dims", "k_steps", "state_dtype", "chunk0"])
def test_gated_delta_rule_bad_input(kw, err, match):
    with pytest.raises(err, match=match):
        _gdn(**kw)


@pytest.mark.parametrize("shapes,match", [
    (((1, 5, 3), (3, 4), (1, 3, 2)), "causal_conv1d state"),
    (((1, 5, 3), (4, 4), (1, 3, 3)), "causal_conv1d w"),
    (((1, 5, 3), (3, 4), (1, 3, 3), (4,)), "causal_conv1d bias"),
    (((5, 3), (3, 4), (1, 3, 3)), r"x must be \[batch, T, channels\]"),
], ids=["state", "w", "bias", "rank"])
def test_causal_conv1d_bad_input(shapes, match):
    m = Builder("bad", "mir")
    with pytest.raises(ShapeError, match=match):
        m.add("causal_conv1d", tuple(m.input(f"a{i}", s, F32) for i, s in enumerate(shapes)))
