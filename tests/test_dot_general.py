"""dot_general beyond the parity suite: the legalized form (transpose + reshape + matmul) for
a backend without a kernel, the errors of bad dimension numbers, JSON and symbolic dims."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.ir.dtype import F32, F64
from rlx_core.ir.errors import GraphError, RlxError, ShapeError
from rlx_core.ir.graph import Graph
from rlx_core.ir.serialize import graph_from_json
from rlx_core.pipeline import compile as compile_graph
from rlx_core.testing.ops_suite import DOT_GENERAL_CASES, ref_dot_general
from rlx_core.testing.parity import arg, numpy_without, run_parity


@pytest.mark.parametrize("case", list(DOT_GENERAL_CASES))
def test_dot_general_legalized(rng, case):
    ld, rd, lc, rc, lb, rb = DOT_GENERAL_CASES[case]
    attrs_ = {"lhs_contract": lc, "rhs_contract": rc, "lhs_batch": lb, "rhs_batch": rb}
    with numpy_without({"dot_general"}, "no-dot-general") as name:
        run_parity(name, "dot_general", [arg(rng, "a", ld, F64), arg(rng, "b", rd, F64)], attrs_,
                   lambda x, y: ref_dot_general(x, y, lc, rc, lb, rb))
        g = Graph.define("d", lambda m: m.dot_general(m.input("a", ld, F64), m.input("b", rd, F64),
                                                      (lc, rc), (lb, rb)))
        exe = compile_graph(g, backend=name)
        assert "dot_general" not in {n.op for n in exe.mir.nodes}
        assert "matmul" in {n.op for n in exe.mir.nodes}


@pytest.mark.parametrize("lc,rc,lb,rb,msg", [
    ((1,), (1,), (), (), "contracting dims differ: lhs axis 1 (5) vs rhs axis 1 (4)"),
    ((2,), (0,), (), (), "lhs_contract axis 2 out of range for rank 2"),
    ((1,), (0, 1), (), (), "differ in length"),
    ((1,), (0,), (1,), (0,), "both batch and contracting"),
    ((1, 1), (0, 0), (), (), "repeats an axis"),
    ((0,), (0,), (), (), "contracting dims differ"),
])
def test_dot_general_bad_dims_name_the_op(lc, rc, lb, rb, msg):
    with pytest.raises(ShapeError, match="dot_general") as e:
        Graph.define("d", lambda m: m.dot_general(m.input("a", (3, 5)), m.input("b", (5, 4)),
                                                  (lc, rc), (lb, rb)))
    assert msg in str(e.value)


def test_dot_general_bad_attr_is_a_graph_error():
    with pytest.raises(GraphError, match="dot_general.*lhs_contract"):
        Graph.define("d", lambda m: m.add("dot_general", (m.input("a", (3, 5)), m.input("b", (5, 4))),
                                          lhs_contract="1"))


def test_dot_general_json_round_trip_and_symbolic_batch(rng):
    g = Graph.define("d", lambda m: m.dot_general(m.input("a", ("n", 3, 5)), m.input("b", ("n", 5, 4)),
                                                  ((2,), (1,)), ((0,), (0,))))
    assert g.shape_of(g.outputs[0][1]).dims == ("n", 3, 4)
    back = graph_from_json(g.to_json())
    assert back.to_json() == g.to_json()
    a, b = rng.standard_normal((2, 3, 5)).astype(np.float32), rng.standard_normal((2, 5, 4)).astype(np.float32)
    got = compile_graph(back).run({"a": a, "b": b})["out"]
    np.testing.assert_allclose(got, np.einsum("nik,nkj->nij", a.astype(np.float64), b), rtol=1e-5, atol=1e-5)


def test_dot_general_legalize_refuses_merging_symbols():
    """Two free dims holding a symbol cannot become one matmul dim: a clear error, not a wrong reshape."""
    g = Graph.define("d", lambda m: m.dot_general(m.input("a", ("s", 2, 5)), m.input("b", (5, 4)),
                                                  ((2,), (0,))))
    with numpy_without({"dot_general"}, "no-dot-general-sym") as name:
        with pytest.raises(RlxError, match="dot_general: cannot merge lhs free dims"):
            compile_graph(g, backend=name)
