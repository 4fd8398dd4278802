"""Control flow on a backend that lacks it (rlx_core.backends.host_control): core cuts the graph
at if_ / while_ / scan, the minimal backend compiles the parts between and every body, and the
results equal float64 Python loops on fresh random inputs."""
import numpy as np
import pytest

from rlx_core.backends import host_control
from rlx_core.ir.dtype import F64, I64
from rlx_core.ir.errors import BackendError
from rlx_core.ir.graph import Graph
from rlx_core.ir.lir import plan
from rlx_core.pipeline import compile as compile_graph, select_backend


def _nested(m):
    """Before the loop: a scale; the scan over rows clips each row with an if_ and doubles it
    with a while_ until its sum passes a limit (nested bodies); after it: a sum."""
    xs = m.input("xs", (4, 2), F64) * 1.5
    limit = m.input("limit", (), F64)
    acc0 = m.constant(np.zeros(2), F64)

    def step(b, limit, acc, x):
        x = b.if_(b.compare(b.sum(x, (0,)), 0.0, "gt"), (x,), lambda c, v: v, lambda c, v: -v)
        (x,) = b.while_((x,), lambda c, lim, v: c.compare(c.sum(v, (0,)), lim, "lt"),
                        lambda c, lim, v: (v * 2.0,), consts=(limit,))
        return acc + x, x

    (acc,), (ys,) = m.scan(step, init=(acc0,), xs=(xs,), consts=(limit,))
    return {"acc": acc, "total": m.sum(ys, (0, 1)) + 1.0}


def _nested_ref(xs, limit):
    acc, ys = np.zeros(2), []
    for x in xs * 1.5:
        x = x if x.sum() > 0 else -x
        while x.sum() < limit:
            x = x * 2
        acc, ys = acc + x, ys + [x]
    return acc, np.sum(ys) + 1.0


def test_nested_control_flow_on_the_minimal_backend(rng):
    exe = compile_graph(Graph.define("nested", _nested), backend="minimal")
    for _ in range(3):
        xs, limit = rng.uniform(0.1, 1, (4, 2)) * rng.choice([-1, 1], (4, 1)), rng.uniform(2, 9)
        got = exe.run({"xs": xs, "limit": np.float64(limit)})
        acc, total = _nested_ref(xs, limit)
        np.testing.assert_allclose(got["acc"], acc, rtol=1e-12)
        np.testing.assert_allclose(got["total"], total, rtol=1e-12)
        only = exe.run({"xs": xs, "limit": np.float64(limit)}, fetch=("total",))     # Runner.run_fetch
        assert list(only) == ["total"] and only["total"] == got["total"]
    assert isinstance(exe.runner({}), host_control.HostControlRunner)


def _cache_around_loop(m):
    """KV-cache writes before and after a while_, the second into the first's result, and a
    read of the cache after both: each write must land in the state itself, not in a copy of
    it that crossed the cut."""
    cache = m.state("cache", (1, 1, 5, 2), F64)
    new, pos = m.input("new", (1, 1, 1, 2), F64), m.input("pos", (1,), I64)
    x = m.input("x", (2,), F64)
    written = m.add("kv_write", (cache, new, pos), axis=2)
    (y,) = m.while_((x,), lambda b, v: b.compare(b.sum(v, (0,)), 10.0, "lt"), lambda b, v: (v * 3.0,))
    again = m.add("kv_write", (written, m.reshape(y, (1, 1, 1, 2)), pos + 1), axis=2)
    return {"out": m.sum(again, (0, 1, 2)) * y}


def test_state_written_before_a_cut_is_read_after_it(rng):
    exe = compile_graph(Graph.define("cache_loop", _cache_around_loop), backend="minimal")
    cache = np.zeros((1, 1, 5, 2))
    for p in (0, 2, 3):
        new, x = rng.standard_normal((1, 1, 1, 2)), rng.uniform(0.1, 1, 2)
        got = exe.run({"new": new, "pos": np.array([p]), "x": x})
        while x.sum() < 10:
            x = x * 3
        cache[0, 0, p], cache[0, 0, p + 1] = new[0, 0, 0], x
        np.testing.assert_allclose(exe.states["cache"], cache, rtol=0)
        np.testing.assert_allclose(got["out"], cache.sum((0, 1, 2)) * x, rtol=1e-12)


def test_a_part_that_only_writes_a_state_runs(rng):
    """The cache written before the loop is read by nothing after it: the write still happens."""
    def f(m):
        cache = m.state("cache", (1, 1, 3, 2), F64)
        m.add("kv_write", (cache, m.input("new", (1, 1, 1, 2), F64), m.input("pos", (1,), I64)), axis=2)
        (y,) = m.while_((m.input("x", (2,), F64),), lambda b, v: b.compare(b.sum(v, (0,)), 5.0, "lt"),
                        lambda b, v: (v + 1.0,))
        return y
    exe = compile_graph(Graph.define("write_only", f), backend="minimal")
    new, x = rng.standard_normal((1, 1, 1, 2)), np.array([0.5, 1.0])
    got = exe.run({"new": new, "pos": np.array([1]), "x": x})
    np.testing.assert_array_equal(got["out"], [2.5, 3.0])
    np.testing.assert_array_equal(exe.states["cache"][0, 0, 1], new[0, 0, 0])
    assert not exe.states["cache"][0, 0, [0, 2]].any()


def test_a_backend_with_control_flow_is_not_cut():
    g = Graph.define("nested", _nested)
    numpy, minimal = select_backend("numpy"), select_backend("minimal")
    mir = compile_graph(g, backend="numpy").mir
    assert host_control.host_run(numpy, mir) == []
    assert type(host_control.compile_lir(numpy, plan(mir), {}, {})).__name__ == "NumpyRunner"
    assert [mir.nodes[i].op for i in host_control.host_run(minimal, mir)] == ["scan"]


def test_minimal_compile_names_an_op_it_lacks():
    mir = compile_graph(Graph.define("nested", _nested), backend="minimal").mir
    with pytest.raises(BackendError, match=r"minimal backend: graph 'nested' holds op\(s\) \['scan'\]"):
        select_backend("minimal").compile(plan(mir), {}, {})
