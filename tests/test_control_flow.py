"""Control flow (ir/control.py): if_, while_ and scan with Graph bodies, against Python loops
in float64 on fresh random inputs; printing, JSON, recursive verify, passes inside bodies,
shape rules, and how each backend runs them (numba: the host loop; cuda and opencl: bodies as
runners of their own on the device)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rlx_core.ir.dtype import BOOL, F32, F64, I64
from rlx_core.ir.errors import GraphError, SerializeError, ShapeError
from rlx_core.ir.graph import Builder, Graph
from rlx_core.ir.serialize import graph_from_json
from rlx_core.ir.verify import verify
from rlx_core.pipeline import compile as compile_graph
from rlx_core.testing.parity import backend_params


def _halvings(m):
    """while_ with a data-dependent trip count: halve x until its max is below 1, counting."""
    x = m.input("x", (4,), F64)
    n0 = m.constant(np.array(0, np.int64))
    n, y = m.while_((n0, x), lambda b, n, y: b.compare(b.max(y, (0,)), 1.0, "ge"),
                    lambda b, n, y: (n + 1, y * 0.5))
    return {"n": n, "y": y}


def _halvings_ref(x):
    n = 0
    while x.max() >= 1.0:
        x, n = x * 0.5, n + 1
    return n, x


def test_while_data_dependent_count(rng):
    exe = compile_graph(Graph.define("halve", _halvings))
    for scale in (0.5, 3.0, 1000.0):
        x = rng.uniform(0, scale, 4)
        got = exe.run({"x": x})
        n, y = _halvings_ref(x)
        assert int(got["n"]) == n
        np.testing.assert_allclose(got["y"], y, rtol=0, atol=0)


def _rnn(m, reverse=False):
    """h_t = tanh(W h_{t-1} + x_t), ys = h_t * 2, W a const of the body."""
    w = m.input("w", (3, 3), F64)
    h0 = m.input("h0", (3,), F64)
    xs = m.input("xs", (5, 3), F64)

    def step(b, w, h, x):
        h2 = b.tanh(b.reshape(b.matmul(w, b.reshape(h, (3, 1))), (3,)) + x)
        return h2, h2 * 2.0

    (h,), (ys,) = m.scan(step, init=(h0,), xs=(xs,), consts=(w,), reverse=reverse)
    return {"h": h, "ys": ys}


def _rnn_ref(w, h0, xs, reverse=False):
    h, ys = h0, np.zeros(xs.shape)
    for t in (range(len(xs) - 1, -1, -1) if reverse else range(len(xs))):
        h = np.tanh(w @ h + xs[t])
        ys[t] = 2 * h
    return h, ys


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_matches_python_loop(rng, reverse):
    w, h0, xs = rng.standard_normal((3, 3)), rng.standard_normal(3), rng.standard_normal((5, 3))
    got = compile_graph(Graph.define("rnn", lambda m: _rnn(m, reverse))).run({"w": w, "h0": h0, "xs": xs})
    h, ys = _rnn_ref(w, h0, xs, reverse)
    np.testing.assert_allclose(got["h"], h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got["ys"], ys, rtol=1e-12, atol=1e-12)


def _nested(m):
    """scan over rows; each step clips its row with an if_ and runs a while_ doubling it
    until its sum passes a limit (a const of both nested bodies)."""
    xs = m.input("xs", (4, 2), F64)
    limit = m.input("limit", (), F64)
    acc0 = m.constant(np.zeros(2), F64)

    def step(b, limit, acc, x):
        pos = b.compare(b.sum(x, (0,)), 0.0, "gt")
        x = b.if_(pos, (x,), lambda c, v: v, lambda c, v: -v)
        (x,) = b.while_((x,), lambda c, lim, v: c.compare(c.sum(v, (0,)), lim, "lt"),
                        lambda c, lim, v: (v * 2.0,), consts=(limit,))
        return acc + x, x

    (acc,), (ys,) = m.scan(step, init=(acc0,), xs=(xs,), consts=(limit,))
    return {"acc": acc, "ys": ys}


def _nested_ref(xs, limit):
    acc, ys = np.zeros(2), []
    for x in xs:
        x = x if x.sum() > 0 else -x
        while x.sum() < limit:
            x = x * 2
        acc = acc + x
        ys.append(x)
    return acc, np.array(ys)


def test_nested_bodies_print_round_trip_and_run(rng):
    g = Graph.define("nested", _nested)
    text = g.text()
    assert "body: graph scan_body" in text and "then_: graph then" in text and "cond: graph cond" in text
    back = graph_from_json(g.to_json())
    assert back.to_json() == g.to_json() and back.text() == text
    xs, limit = rng.uniform(0.1, 1, (4, 2)) * rng.choice([-1, 1], (4, 1)), 5.0
    got = compile_graph(back).run({"xs": xs, "limit": np.float64(limit)})
    acc, ys = _nested_ref(xs, limit)
    np.testing.assert_allclose(got["acc"], acc, rtol=1e-12)
    np.testing.assert_allclose(got["ys"], ys, rtol=1e-12)


@pytest.mark.parametrize("backend", backend_params(("numpy", "numba", "cuda", "opencl")))
def test_loop_backends(rng, backend):
    """numpy and numba run the bodies with NumPy kernels on the host; cuda and opencl run
    them as runners of their own on the device: nested if_/scan, a data-dependent while_,
    both directions of scan."""
    xs = rng.uniform(0.1, 1, (4, 2)) * rng.choice([-1, 1], (4, 1))
    got = compile_graph(Graph.define("nested", _nested), backend=backend).run({"xs": xs, "limit": np.float64(3.0)})
    acc, ys = _nested_ref(xs, 3.0)
    np.testing.assert_allclose(got["acc"], acc, rtol=1e-12)
    np.testing.assert_allclose(got["ys"], ys, rtol=1e-12)
    halve = compile_graph(Graph.define("halve", _halvings), backend=backend)
    for scale in (0.5, 1000.0):
        x = rng.uniform(0, scale, 4)
        got = halve.run({"x": x})
        n, y = _halvings_ref(x)
        assert int(got["n"]) == n
        np.testing.assert_allclose(got["y"], y, rtol=1e-15)
    for reverse in (False, True):
        feed = {"w": rng.standard_normal((3, 3)) * 0.5, "h0": rng.standard_normal(3), "xs": rng.standard_normal((5, 3))}
        got = compile_graph(Graph.define("rnn", lambda m: _rnn(m, reverse)), backend=backend).run(feed)
        h, ys = _rnn_ref(**feed, reverse=reverse)
        np.testing.assert_allclose(got["h"], h, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(got["ys"], ys, rtol=1e-12, atol=1e-13)


def test_scan_without_xs_uses_length_and_symbolic_carry(rng):
    """A scan with no xs runs `length` steps; a carry with a named dim is bound at run time."""
    def f(m):
        x = m.input("x", ("n",), F64)
        (y,), (ys,) = m.scan(lambda b, v: (v * 3.0, b.sum(v, (0,))), init=(x,), length=3)
        return {"y": y, "ys": ys}
    g = Graph.define("pow3", f)
    assert g.shape_of(g.outputs[1][1]).dims == (3,)
    x = rng.standard_normal(6)
    got = compile_graph(g).run({"x": x})
    np.testing.assert_allclose(got["y"], x * 27, rtol=1e-12)
    np.testing.assert_allclose(got["ys"], [x.sum(), 3 * x.sum(), 9 * x.sum()], rtol=1e-12, atol=1e-13)


def test_body_with_hir_blocks_is_lowered_with_the_graph(rng):
    """Bodies go through lowering (fusable: rms_norm becomes primitives inside the body)."""
    def f(m):
        x = m.input("x", (2, 4), F32)
        (y,), _ = m.scan(lambda b, v: (b.rms_norm(v) * 1.5,), init=(x,), length=2)
        return y
    exe = compile_graph(Graph.define("norms", f), profile="encoder")
    x = rng.standard_normal((2, 4)).astype(np.float32)
    ref = x.astype(np.float64)
    for _ in range(2):
        ref = ref / np.sqrt((ref ** 2).mean(-1, keepdims=True) + 1e-6) * 1.5
    np.testing.assert_allclose(exe.run({"x": x})["out"], ref, rtol=1e-5, atol=1e-5)


def test_dce_and_cse_inside_bodies():
    def f(m):
        x = m.input("x", (3,), F64)

        def body(b, v):
            _dead = b.exp(v) * 7.0                    # noqa: F841  (DCE drops it)
            return (b.tanh(v) + b.tanh(v),)            # CSE merges the two tanh
        (y,), _ = m.scan(body, init=(x,), length=2)
        return y
    mir = compile_graph(Graph.define("passes", f)).mir
    (node,) = [n for n in mir.nodes if n.op == "scan"]
    ops = [n.op for n in node.a["body"].nodes]
    assert ops.count("activation") == 1, ops
    assert "input" in ops and ops.count("binary") == 1, ops


# ------------------------------------------------------------------ shape rules and errors
def test_wrong_carry_shape_names_op_and_carry():
    def f(m):
        x, s = m.input("x", (3,), F64), m.input("s", (), F64)
        return m.while_((s, x), lambda b, s, v: b.compare(s, 1.0, "lt"),
                        lambda b, s, v: (s + 1.0, b.concat([v, v], 0)))[1]
    with pytest.raises(ShapeError, match=r"op 'while_'.*carry 1 enters as f64\[3\] but leaves as f64\[6\]"):
        Graph.define("bad", f)


def test_wrong_carry_dtype_in_scan():
    def f(m):
        x = m.input("x", (3,), F64)
        return m.scan(lambda b, v: (b.cast(v, F32),), init=(x,), length=2)[0][0]
    with pytest.raises(ShapeError, match=r"op 'scan'.*carry 0 enters as f64\[3\] but leaves as f32\[3\]"):
        Graph.define("bad", f)


@pytest.mark.parametrize("case,err,msg", [
    ("branches", ShapeError, r"if_ branches differ"),
    ("pred", ShapeError, r"if_ pred must be a bool scalar"),
    ("cond", ShapeError, r"while_ cond output must be a bool scalar"),
    ("param", GraphError, r"bodies take values as inputs, not params"),
    ("arity", ShapeError, r"scan body 'body' takes 1 inputs, the op passes 2"),
    ("xs_len", ShapeError, r"scan xs differ in length"),
])
def test_malformed_bodies_are_errors(case, err, msg):
    def f(m):
        x = m.input("x", (3,), F64)
        p = m.input("p", (), BOOL)
        if case == "branches":
            return m.if_(p, (x,), lambda b, v: v, lambda b, v: b.concat([v, v], 0))
        if case == "pred":
            return m.if_(x, (x,), lambda b, v: v, lambda b, v: v)
        if case == "cond":
            return m.while_((x,), lambda b, v: v, lambda b, v: v)[0]
        if case == "param":
            return m.if_(p, (x,), lambda b, v: v + b.param("w", (3,), F64), lambda b, v: v)
        if case == "arity":
            body = Builder("one", "hir")
            body.output("o", body.input("a", (3,), F64))
            return m.add("scan", (x, m.input("xs", (2, 3), F64)), body=body.build(), n_carry=1)[0]
        return m.scan(lambda b, c, u, v: (c, u + v), init=(x,),
                      xs=(m.input("u", (2, 3), F64), m.input("v", (4, 3), F64)))[0][0]
    with pytest.raises(err, match=msg):
        Graph.define("bad", f)


def test_verify_is_recursive_and_json_checks_bodies():
    g = Graph.define("halve", _halvings)
    d = json.loads(g.to_json())
    node = [n for n in d["nodes"] if n["op"] == "while_"][0]
    node["attrs"]["body"]["graph"]["nodes"][-1]["outs"][0][0] = [5]      # a wrong recorded shape
    with pytest.raises(SerializeError, match=r"attrs.body.*disagree with the op's meta"):
        graph_from_json(json.dumps(d))
    # a body holding a node whose recorded shape lies fails verify of the outer graph
    import attrs as _attrs
    (i, n), = [(i, n) for i, n in enumerate(g.nodes) if n.op == "while_"]
    body = n.a["body"]
    bad_body = _attrs.evolve(body, nodes=body.nodes[:-1] + (_attrs.evolve(
        body.nodes[-1], outs=(body.nodes[-1].outs[0].with_dtype(F32),)),))
    bad = _attrs.evolve(g, nodes=g.nodes[:i] + (_attrs.evolve(
        n, attrs=tuple(sorted({**n.a, "body": bad_body}.items()))),) + g.nodes[i + 1:])
    with pytest.raises(GraphError, match=r"node %\d+ \(while_\): body 'body': graph 'body' node"):
        verify(bad)


def test_if_runs_the_taken_branch_only(rng):
    """The untaken branch is not run: a log of negatives in it gives no NaN."""
    def f(m):
        x = m.input("x", (3,), F64)
        p = m.compare(m.sum(x, (0,)), 0.0, "gt")
        return m.if_(p, (x,), lambda b, v: b.act(v, "log"), lambda b, v: v * -1.0)
    exe = compile_graph(Graph.define("br", f))
    x = rng.uniform(0.5, 2, 3)
    np.testing.assert_allclose(exe.run({"x": x})["out"], np.log(x), rtol=1e-12)
    with np.errstate(invalid="raise"):
        np.testing.assert_allclose(exe.run({"x": -x})["out"], x, rtol=1e-12)
