"""Reverse-mode AD (ir/autodiff.py): every VJP rule against central finite differences in
float64 and against torch.autograd on fresh random inputs; blocks (norms, softmax, rope,
attention, linear, swiglu) through their primitive decompositions; errors name the op."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import rlx_core
from rlx_core.ir.dtype import F64, I64
from rlx_core.ir.errors import GraphError
from rlx_core.ir.graph import Graph
from rlx_core.pipeline import compile as compile_graph

T = torch.float64


def _cos_sin(s, half):
    inv = 1.0 / (10000 ** (np.arange(half) / half))
    ang = np.arange(s)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


def _rope_torch(x, cos, sin):
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h:2 * h]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _attn_torch(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return torch.softmax(s, -1) @ v


_C, _S = _cos_sin(5, 2)
# name -> (input dims, build(m, *vals), torch fn(*tensors), positive inputs?)
CASES = {
    **{f"binary_{op}": (((2, 3), (3,)), (lambda op: lambda m, a, b: m.binary(a, b, op))(op),
                        (lambda op: lambda a, b: {"add": torch.add, "sub": torch.sub, "mul": torch.mul,
                                                  "div": torch.div, "max": torch.maximum,
                                                  "min": torch.minimum, "pow": torch.pow}[op](a, b))(op),
                        op in ("pow", "div"))
       for op in ("add", "sub", "mul", "div", "max", "min", "pow")},
    **{f"act_{fn}": (((2, 5),), (lambda fn: lambda m, x: m.act(x, fn))(fn),
                     (lambda fn: lambda x: {"tanh": torch.tanh, "exp": torch.exp, "log": torch.log,
                                            "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
                                            "recip": torch.reciprocal, "sin": torch.sin, "cos": torch.cos,
                                            "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
                                            "relu": torch.relu, "abs": torch.abs, "neg": torch.neg,
                                            "identity": lambda t: t,
                                            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
                                            "gelu": torch.nn.functional.gelu,
                                            }[fn](x))(fn),
                     fn in ("log", "sqrt", "rsqrt", "recip"))
       for fn in ("tanh", "exp", "log", "sqrt", "rsqrt", "recip", "sin", "cos", "sigmoid", "silu",
                  "relu", "abs", "neg", "identity", "gelu_tanh", "gelu")},
    "reduce_sum": (((2, 3, 4),), lambda m, x: m.sum(x, (0, 2)), lambda x: x.sum((0, 2)), False),
    "reduce_mean_keep": (((2, 3, 4),), lambda m, x: m.mean(x, (1,), True), lambda x: x.mean(1, True), False),
    "reduce_max": (((3, 4),), lambda m, x: m.max(x, (-1,)), lambda x: x.amax(-1), False),
    "matmul": (((2, 3, 4), (4, 5)), lambda m, a, b: m.matmul(a, b), torch.matmul, False),
    "matmul_tt": (((2, 4, 3), (2, 5, 4)), lambda m, a, b: m.matmul(a, b, True, True),
                  lambda a, b: a.transpose(-1, -2) @ b.transpose(-1, -2), False),
    "matmul_bcast": (((2, 1, 3, 4), (3, 4, 2)), lambda m, a, b: m.matmul(a, b), torch.matmul, False),
    "softmax": (((2, 6),), lambda m, x: m.softmax(x, -1), lambda x: torch.softmax(x, -1), False),
    "reshape_transpose": (((2, 6),), lambda m, x: m.transpose(m.reshape(x, (3, 2, 2)), (2, 0, 1)),
                          lambda x: x.reshape(3, 2, 2).permute(2, 0, 1), False),
    "narrow": (((3, 7),), lambda m, x: m.narrow(x, 1, 2, 3), lambda x: x[:, 2:5], False),
    "concat": (((2, 3), (2, 2)), lambda m, a, b: m.concat([a, b, a], 1), lambda a, b: torch.cat([a, b, a], 1), False),
    "expand": (((3, 1),), lambda m, x: m.expand(x, (2, 3, 4)), lambda x: x.expand(2, 3, 4), False),
    "where": (((2, 3), (3,)), lambda m, a, b: m.where(m.compare(a, 0.0, "gt"), a, b),
              lambda a, b: torch.where(a > 0, a, b), False),
    "gather": (((6, 3),), lambda m, t: m.gather(t, m.constant(np.array([[1, 4], [1, 0]]), I64)),
               lambda t: t[torch.tensor([[1, 4], [1, 0]])], False),
    # a + 4 I keeps the systems well conditioned for the finite differences
    "dense_solve": (((2, 3, 3), (2, 3, 2)), lambda m, a, b: m.dense_solve(a + m.constant(4 * np.eye(3), F64), b),
                    lambda a, b: torch.linalg.solve(a + 4 * torch.eye(3, dtype=T), b), False),
    "dense_solve_vector": (((3, 3), (3,)), lambda m, a, b: m.dense_solve(a + m.constant(4 * np.eye(3), F64), b),
                           lambda a, b: torch.linalg.solve(a + 4 * torch.eye(3, dtype=T), b), False),
    "rms_norm": (((2, 5), (5,)), lambda m, x, w: m.rms_norm(x, w, eps=1e-5),
                 lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w, False),
    "layer_norm": (((2, 5), (5,), (5,)), lambda m, x, g, b: m.layer_norm(x, g, b, eps=1e-5),
                   lambda x, g, b: torch.nn.functional.layer_norm(x, (5,), g, b, 1e-5), False),
    "rms_norm_3d_offset": (((2, 3, 5), (5,)), lambda m, x, w: m.rms_norm(x, w, eps=1e-5, offset=1.0),
                           lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * (w + 1), False),
    "rms_norm_no_weight": (((2, 5),), lambda m, x: m.rms_norm(x, eps=1e-5),
                           lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5), False),
    "layer_norm_gamma_only": (((3, 2, 5), (5,)), lambda m, x, g: m.layer_norm(x, g, eps=1e-5),
                              lambda x, g: torch.nn.functional.layer_norm(x, (5,), g, None, 1e-5), False),
    "layer_norm_bare": (((2, 5),), lambda m, x: m.layer_norm(x, eps=1e-5),
                        lambda x: torch.nn.functional.layer_norm(x, (5,), None, None, 1e-5), False),
    "softmax_axis0": (((4, 3),), lambda m, x: m.softmax(x, 0), lambda x: torch.softmax(x, 0), False),
    "linear_bias": (((2, 3), (4, 3), (4,)), lambda m, x, w, b: m.linear(x, w, b),
                    lambda x, w, b: x @ w.T + b, False),
    "swiglu": (((2, 3), (4, 3), (4, 3), (3, 4)), lambda m, x, g, u, d: m.swiglu(x, g, u, d),
               lambda x, g, u, d: (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T, False),
    "rope": (((1, 2, 5, 4),), lambda m, x: m.rope(x, m.constant(_C, F64), m.constant(_S, F64)),
             lambda x: _rope_torch(x, torch.tensor(_C), torch.tensor(_S)), False),
    "attention_gqa_causal": (((1, 4, 5, 3), (1, 2, 5, 3), (1, 2, 5, 3)), lambda m, q, k, v: m.attention(q, k, v),
                             lambda q, k, v: _attn_torch(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)),
                             False),
}


def _graph(case):
    dims, build, _, _ = CASES[case]

    def f(m):
        xs = [m.input(f"x{i}", d, F64) for i, d in enumerate(dims)]
        y = build(m, *xs)
        r = m.input("r", y.dims, F64)           # a random cotangent: loss = sum(y * r)
        return m.sum(y * r, tuple(range(len(y.dims)))) if y.dims else y * r
    return Graph.define(case, f), dims


def _draw(rng, dims, positive):
    return [rng.uniform(0.5, 2.0, d) if positive else rng.standard_normal(d) for d in dims]


@pytest.mark.parametrize("case", list(CASES))
def test_vjp_rule_vs_finite_differences_and_torch(rng, case):
    g, dims = _graph(case)
    _, _, tfn, positive = CASES[case]
    wrt = [f"x{i}" for i in range(len(dims))]
    exe = compile_graph(rlx_core.value_and_grad(g, wrt), backend="numpy")
    fwd = compile_graph(g, backend="numpy")
    xs = _draw(rng, dims, positive)
    if case == "binary_pow":
        xs[1] = rng.uniform(-1.5, 1.5, dims[1])
    ts = [torch.tensor(x, dtype=T, requires_grad=True) for x in xs]
    y = tfn(*ts)
    r = rng.standard_normal(tuple(y.shape))
    feed = {**{f"x{i}": x for i, x in enumerate(xs)}, "r": r}
    got = exe.run(feed)
    loss = (y * torch.tensor(r)).sum()
    loss.backward()
    np.testing.assert_allclose(got["out"], loss.item(), rtol=1e-10, atol=1e-12)
    eps = 1e-6
    for i, (x, t) in enumerate(zip(xs, ts)):
        want = t.grad.numpy()
        np.testing.assert_allclose(got[f"grad_x{i}"], want, rtol=1e-9, atol=1e-10,
                                   err_msg=f"{case}: grad of x{i} vs torch")
        fd = np.zeros_like(x)
        for j in np.ndindex(x.shape):
            hi, lo = x.copy(), x.copy()
            hi[j] += eps
            lo[j] -= eps
            fd[j] = (fwd.run({**feed, f"x{i}": hi})["out"] - fwd.run({**feed, f"x{i}": lo})["out"]) / (2 * eps)
        np.testing.assert_allclose(got[f"grad_x{i}"], fd, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{case}: grad of x{i} vs finite differences")


def test_grad_only_and_param_wrt(rng):
    def f(m):
        x, w = m.input("x", (3, 4), F64), m.param("w", (2, 4), F64)
        return m.sum(m.tanh(m.linear(x, w)), (0, 1))
    gg = rlx_core.grad(Graph.define("p", f), ["w"])
    assert [n for n, _ in gg.outputs] == ["grad_w"]
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((2, 4))
    got = compile_graph(gg, backend="numpy")
    got.set_params({"w": w})
    tw = torch.tensor(w, requires_grad=True)
    torch.tanh(torch.tensor(x) @ tw.T).sum().backward()
    np.testing.assert_allclose(got.run({"x": x})["grad_w"], tw.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_unreached_wrt_gets_zeros_and_other_backends_run_the_grad(rng):
    def f(m):
        x, z = m.input("x", (3,), F64), m.input("z", (2,), F64)
        return m.sum(m.exp(x) * 2.0, (0,)) + m.sum(z * 0.0, (0,)) * 0.0
    vg = rlx_core.value_and_grad(Graph.define("z", f), ["x", "z"])
    x, z = rng.standard_normal(3), rng.standard_normal(2)
    for b in ("numpy", "numba"):
        got = compile_graph(vg, backend=b).run({"x": x, "z": z})
        np.testing.assert_allclose(got["grad_x"], 2 * np.exp(x), rtol=1e-12)
        np.testing.assert_array_equal(got["grad_z"], np.zeros(2))


def test_ops_without_a_rule_are_named():
    def f(m):
        x = m.input("x", (4,), F64)
        return m.sum(m.cumsum(x * 2.0, 0), (0,))
    with pytest.raises(GraphError, match=r"no VJP rule for op\(s\) \['cumsum'\]"):
        rlx_core.value_and_grad(Graph.define("c", f), ["x"])
    with pytest.raises(GraphError, match=r"'y' is not an input or param"):
        rlx_core.value_and_grad(Graph.define("c", f), ["y"])


def test_norms_softmax_and_attention_backward_are_fused_ops_and_legalize(rng):
    """value_and_grad keeps softmax / rms_norm / layer_norm / attention and emits their fused
    backward ops; legalized to primitives (as for a backend without the kernels, the
    attention_grad decomposition's own softmax_grad legalized in turn) they give the same
    gradients. The attention has GQA, a softcap and a sliding window."""
    from rlx_core.ir.lower import legalize
    from rlx_core.ir.ops import OPS

    grad_ops = {"softmax_grad", "rms_norm_grad", "layer_norm_grad", "attention_grad"}

    def f(m):
        x, w, gm = m.input("x", (2, 3, 8), F64), m.input("w", (8,), F64), m.input("gm", (8,), F64)
        h = m.softmax(m.rms_norm(x, w, eps=1e-5), -1)
        q, kv = m.reshape(h, (2, 4, 3, 2)), m.reshape(x, (2, 2, 6, 2))
        a = m.attention(q, kv, kv * 0.5, scale=0.7, softcap=2.0, mask_kind="sliding_window", window=4)
        h = m.reshape(a, (2, 3, 8)) + h
        return m.sum(m.layer_norm(h, gm, eps=1e-5) * m.input("r", (2, 3, 8), F64), (0, 1, 2))
    vg = rlx_core.value_and_grad(Graph.define("nsm", f), ["x", "w", "gm"])
    assert grad_ops <= {n.op for n in vg.nodes}
    half, names = legalize(vg, set(OPS) - {"attention_grad"})      # its softmax_grad stays
    assert names == ["attention_grad"] and "softmax_grad" in {n.op for n in half.nodes}
    plain, names = legalize(vg, set(OPS) - grad_ops)
    assert not grad_ops & {n.op for n in plain.nodes} and set(names) == grad_ops
    feed = {"x": rng.standard_normal((2, 3, 8)), "w": rng.standard_normal(8), "gm": rng.standard_normal(8),
            "r": rng.standard_normal((2, 3, 8))}
    a = compile_graph(vg, backend="numpy").run(feed)
    for other in (half, plain):
        b = compile_graph(other, backend="numpy").run(feed)
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-13, err_msg=k)
