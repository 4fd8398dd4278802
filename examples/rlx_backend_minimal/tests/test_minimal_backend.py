"""The minimal backend is exactly core's primitive set, and registers like any plugin."""
from rlx_core.ir.composites import PRIMITIVES
from rlx_core.pipeline import select_backend

from rlx_backend_minimal.kernels import KERNELS, VIEWS


def test_its_kernels_are_exactly_the_primitives():
    assert set(KERNELS) | set(VIEWS) == set(PRIMITIVES)
    ops = select_backend("minimal").supported_ops()
    assert ops - {"input", "param", "state", "constant"} == set(PRIMITIVES), sorted(ops)


def test_it_is_never_picked_by_default():
    assert select_backend("minimal").priority < select_backend("numpy").priority
    assert select_backend().name != "minimal"


def test_it_profiles_each_node(rng):
    from rlx_core.ir.graph import Graph
    from rlx_core.pipeline import compile as compile_graph

    def f(m):
        x = m.input("x", (4, 8))
        return m.softmax(x * 2.0, -1)
    exe = compile_graph(Graph.define("soft", f), backend="minimal")
    x = rng.standard_normal((4, 8)).astype("float32")
    report = exe.profile({"x": x}, repeat=3, warmup=1)
    ops = {n.op for n in exe.mir.nodes}
    assert "softmax" not in ops and {"reduce", "activation"} <= ops, sorted(ops)   # legalized
    assert "reduce" in str(report) and "host clock" in str(report)
