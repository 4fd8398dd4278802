"""dense_solve beyond the parity suite (rlx_core/testing/ops_suite.py) and the VJP cases of
tests/test_autodiff.py: shape and dtype errors name the op and the mismatch; a symbolic batch
binds at run time; the gradient graph runs on every backend (skipped with the reason where one
is unavailable)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rlx_core
from rlx_core.ir.dtype import F32, F64, I64
from rlx_core.ir.errors import DTypeError, ShapeError
from rlx_core.ir.graph import Graph
from rlx_core.pipeline import compile as compile_graph
from rlx_core.testing.parity import backend_params


@pytest.mark.parametrize("a,b,err,msg", [
    ((3, 4), (3,), ShapeError, r"op 'dense_solve': a must be square matrices"),
    ((2, 3, 3), (2, 4, 1), ShapeError, r"op 'dense_solve': b .* does not fit a .*expected b \[2, 3, k\]"),
    ((2, 3, 3), (5, 3), ShapeError, r"op 'dense_solve': b .* does not fit a .*expected b \[2, 3\]"),
    ((3, 3), (3, 2, 1, 1), ShapeError, r"op 'dense_solve': b must be \[..., n, k\] or \[..., n\]"),
    ((3, 3), (3, 2, "f32"), DTypeError, r"op 'dense_solve': a and b must be the same float dtype"),
    ((3, 3, "i64"), (3, "i64"), DTypeError, r"op 'dense_solve': a and b must be the same float dtype"),
])
def test_bad_operands_name_the_op(a, b, err, msg):
    def dt(d):
        return (d[:-1], F32 if d[-1] == "f32" else I64) if isinstance(d[-1], str) else (d, F64)

    def f(m):
        return m.dense_solve(m.input("a", *dt(a)), m.input("b", *dt(b)))
    with pytest.raises(err, match=msg):
        Graph.define("bad", f)


@pytest.mark.parametrize("backend", backend_params(("numpy", "numba", "cuda", "opencl")))
def test_symbolic_batch_and_grad(rng, backend):
    def f(m):
        a, b = m.input("a", ("batch", 3, 3), F64), m.input("b", ("batch", 3), F64)
        return m.sum(m.tanh(m.dense_solve(a, b)), (0, 1))
    vg = rlx_core.value_and_grad(Graph.define("solve", f), ["a", "b"])
    a = rng.standard_normal((5, 3, 3)) + 3 * np.eye(3)
    b = rng.standard_normal((5, 3))
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    loss = torch.tanh(torch.linalg.solve(ta, tb)).sum()
    loss.backward()
    got = compile_graph(vg, backend=backend).run({"a": a, "b": b})
    np.testing.assert_allclose(got["out"], loss.item(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got["grad_a"], ta.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["grad_b"], tb.grad.numpy(), rtol=1e-10, atol=1e-12)
