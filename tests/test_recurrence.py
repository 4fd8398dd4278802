"""selective_scan (Mamba) and gated_delta_rule (Gated DeltaNet), written with scan
(ir/recurrence.py): against float64 Python loops on fresh random inputs, on numpy, numba, cuda
and opencl; reverse-mode AD through them (scan's VJP) against torch.autograd on the same loops
and central finite differences; bad shapes name the op and the argument."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rlx_core
from rlx_core.ir.dtype import F32, F64
from rlx_core.ir.errors import ShapeError
from rlx_core.ir.graph import Graph
from rlx_core.ir.recurrence import gated_delta_rule, selective_scan
from rlx_core.pipeline import compile as compile_graph
from rlx_core.testing.parity import backend_params

BACKENDS = backend_params(("numpy", "numba", "cuda", "opencl"))     # unavailable ones skip with the reason
Bn, L, D, N = 2, 5, 3, 4           # selective scan: batch, length, channels, state
H, K, V = 2, 3, 4                  # gated delta rule: heads, key dim, value dim


def selective_scan_loop(u, delta, A, B, C, D=None, z=None, h0=None, xp=np):
    """The reference recurrence, one step at a time (numpy or torch)."""
    h = h0 if h0 is not None else xp.zeros((u.shape[0], A.shape[0], A.shape[1]), dtype=u.dtype)
    ys = []
    for t in range(u.shape[1]):
        h = xp.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    y = xp.stack(ys, 1)
    if D is not None:
        y = y + u * D
    if z is not None:
        y = y * z / (1 + xp.exp(-z))
    return y, h


def gated_delta_loop(q, k, v, g, beta, scale, s0=None, xp=np):
    """Qwen3-Next's torch_recurrent_gated_delta_rule, layout [batch, L, heads, dim]."""
    s = s0 if s0 is not None else xp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), dtype=q.dtype)
    out = []
    for t in range(q.shape[1]):
        s = s * xp.exp(g[:, t])[..., None, None]
        kv = (s * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((s * (q[:, t] * scale)[..., None]).sum(-2))
    return xp.stack(out, 1), s


def _mamba_inputs(rng, extras):
    x = dict(u=rng.standard_normal((Bn, L, D)), delta=rng.uniform(0.05, 0.5, (Bn, L, D)),
             A=-rng.uniform(0.5, 2.0, (D, N)), B=rng.standard_normal((Bn, L, N)), C=rng.standard_normal((Bn, L, N)))
    shapes = dict(D=(D,), z=(Bn, L, D), h0=(Bn, D, N))
    x.update({e: rng.standard_normal(shapes[e]) for e in extras})
    return x


def _delta_inputs(rng, extras):
    k = rng.standard_normal((Bn, L, H, K))
    x = dict(q=rng.standard_normal((Bn, L, H, K)), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
             v=rng.standard_normal((Bn, L, H, V)), g=-rng.uniform(0.01, 1.0, (Bn, L, H)),
             beta=rng.uniform(0.1, 0.9, (Bn, L, H)))
    if "s0" in extras:
        x["s0"] = rng.standard_normal((Bn, H, K, V))
    return x


def _graph(fn, feeds, dtype, batch=None):
    """Graph with inputs named as `feeds` (batch symbolic when asked), outputs y and h and
    loss = sum(y * r) + sum(h * rh) for the gradient tests."""
    def f(m):
        ins = {k: m.input(k, ((batch,) + v.shape[1:]) if batch and k not in ("A", "D") else v.shape, dtype)
               for k, v in feeds.items()}
        y, h = fn(m, **ins)
        loss = m.sum(y * m.input("r", y.dims, dtype), (0, 1, 2, 3)[:y.shape.rank]) + \
            m.sum(h * m.input("rh", h.dims, dtype), tuple(range(h.shape.rank)))
        return {"y": y, "h": h, "loss": loss}
    return Graph.define("rec", f)


CASES = {
    "mamba": (lambda m, **k: selective_scan(m, **k), selective_scan_loop, _mamba_inputs, ()),
    "mamba_D_z_h0": (lambda m, **k: selective_scan(m, **k), selective_scan_loop, _mamba_inputs, ("D", "z", "h0")),
    "gated_delta": (lambda m, **k: gated_delta_rule(m, **k), lambda xp=np, **k: gated_delta_loop(
        scale=K ** -0.5, xp=xp, **k), _delta_inputs, ()),
    "gated_delta_s0": (lambda m, **k: gated_delta_rule(m, **k), lambda xp=np, **k: gated_delta_loop(
        scale=K ** -0.5, xp=xp, **k), _delta_inputs, ("s0",)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_vs_python_loop(rng, case, backend):
    build, ref, draw, extras = CASES[case]
    x = draw(rng, extras)
    y, h = ref(**x)
    for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
        g = _graph(build, x, dtype, batch="batch")
        feed = {k: v.astype(dtype.np) for k, v in x.items()}
        feed.update(r=np.zeros(y.shape, dtype.np), rh=np.zeros(h.shape, dtype.np))
        got = compile_graph(g, backend=backend).run(feed)
        np.testing.assert_allclose(got["y"], y, rtol=tol, atol=tol)
        np.testing.assert_allclose(got["h"], h, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_vs_torch_and_finite_differences(rng, case):
    build, ref, draw, extras = CASES[case]
    x = draw(rng, extras)
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in x.items()}
    y, h = ref(xp=torch, **ts)
    r, rh = rng.standard_normal(tuple(y.shape)), rng.standard_normal(tuple(h.shape))
    loss = (y * torch.tensor(r)).sum() + (h * torch.tensor(rh)).sum()
    loss.backward()
    g = _graph(build, x, F64)
    vg = rlx_core.value_and_grad(g, list(x), output="loss")
    fwd = compile_graph(g, backend="numpy")
    feed = dict(x, r=r, rh=rh)
    got = compile_graph(vg, backend="numpy").run(feed)
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12, atol=1e-12)
    for name, v in x.items():
        np.testing.assert_allclose(got[f"grad_{name}"], ts[name].grad.numpy(), rtol=1e-9, atol=1e-11,
                                   err_msg=f"{case}: grad of {name} vs torch")
        j = tuple(rng.integers(0, s) for s in v.shape)       # one entry by central differences
        hi, lo = v.copy(), v.copy()
        hi[j] += 1e-6
        lo[j] -= 1e-6
        fd = (fwd.run(dict(feed, **{name: hi}))["loss"] - fwd.run(dict(feed, **{name: lo}))["loss"]) / 2e-6
        np.testing.assert_allclose(got[f"grad_{name}"][j], fd, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{case}: grad of {name} vs finite differences")


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_vjp_reverse_with_int_carry(rng, backend):
    """A reverse scan with an int step counter beside the float carry: the counter has no
    cotangent; the gradient graph runs on every backend."""
    def f(m):
        w, h0, xs = m.input("w", (3,), F64), m.input("h0", (3,), F64), m.input("xs", (4, 3), F64)
        n0 = m.constant(np.array(0, np.int64))

        def step(b, w, n, h, x):
            h2 = b.tanh(h * w + x * b.cast(n + 1, F64))
            return n + 1, h2, h2 * h2
        (n, h), (ys,) = m.scan(step, init=(n0, h0), xs=(xs,), consts=(w,), reverse=True)
        return m.sum(ys, (0, 1)) + m.sum(h, (0,))
    vg = rlx_core.value_and_grad(Graph.define("rev", f), ["w", "h0", "xs"])
    w, h0, xs = rng.standard_normal(3), rng.standard_normal(3), rng.standard_normal((4, 3))
    tw, th, tx = (torch.tensor(a, requires_grad=True) for a in (w, h0, xs))
    h, loss = th, 0.0
    for n, t in enumerate(range(3, -1, -1)):
        h = torch.tanh(h * tw + tx[t] * (n + 1))
        loss = loss + (h * h).sum()
    (loss + h.sum()).backward()
    got = compile_graph(vg, backend=backend).run({"w": w, "h0": h0, "xs": xs})
    for name, t in (("w", tw), ("h0", th), ("xs", tx)):
        np.testing.assert_allclose(got[f"grad_{name}"], t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_bad_shapes_name_the_op_and_argument():
    def mamba(m):
        u = m.input("u", (2, 5, 3), F32)
        return selective_scan(m, u, u, m.input("A", (3, 4), F32), m.input("B", (2, 5, 4), F32),
                              m.input("C", (2, 5, 5), F32))[0]
    with pytest.raises(ShapeError, match=r"selective_scan: C is .*expected dims \(2, 5, 4\)"):
        Graph.define("bad", mamba)

    def delta(m):
        q = m.input("q", (1, 4, 2, 3), F32)
        return gated_delta_rule(m, q, q, m.input("v", (1, 4, 2, 5), F32), m.input("g", (1, 4, 2), F64),
                                m.input("beta", (1, 4, 2), F32))[0]
    with pytest.raises(ShapeError, match=r"gated_delta_rule: g is .*expected dtype f32"):
        Graph.define("bad", delta)
