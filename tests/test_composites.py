"""The composite table (rlx_core.ir.composites): the whole op parity suite on the NumPy
backend reduced to the primitives, so every op with a composite runs as that composite
against the suite's float64 references; the coverage check a backend passes when it
registers; legalize leaves backends that have every op as they were."""
from __future__ import annotations

from rlx_core.testing.ops_suite import *  # noqa: F401,F403  (the suite, legalized)
from rlx_core.testing.parity import PRIMITIVES_ONLY

RLX_BACKENDS = (PRIMITIVES_ONLY,)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rlx_core.backends.numpy import NumpyBackend  # noqa: E402
from rlx_core.ir import composites  # noqa: E402
from rlx_core.ir.composites import (COMPOSITES, OPTIONAL, PRIMITIVES, check_coverage,  # noqa: E402
                                    composite, ex, legalize)
from rlx_core.ir.errors import BackendError, GraphError, PluginError  # noqa: E402
from rlx_core.ir.graph import MIR, Builder  # noqa: E402
from rlx_core.ir.ops import LEAVES, OPS, Level  # noqa: E402
from rlx_core.plugins import RlxPluginWarning, hookimpl, registry, temporary_plugin  # noqa: E402
from rlx_core.testing.parity import compile_on, primitives_only, ref_mask_fill  # noqa: E402


class Lacking(NumpyBackend):
    """The NumPy backend without some ops."""
    priority = -100

    def __init__(self, drop, name="test-lacking"):
        self.drop, self.name = set(drop), name

    def supported_ops(self) -> set:
        return NumpyBackend().supported_ops() - self.drop


# ----------------------------------------------------------------------------- the table
def test_every_op_is_a_primitive_an_optional_op_a_composite_or_a_leaf():
    below_hir = {n for n, d in OPS.items() if d.level is not Level.HIR}
    assert below_hir <= PRIMITIVES | OPTIONAL | set(COMPOSITES) | LEAVES, \
        sorted(below_hir - PRIMITIVES - OPTIONAL - set(COMPOSITES) - LEAVES)
    assert not PRIMITIVES & set(COMPOSITES) and not OPTIONAL & set(COMPOSITES)
    assert len(PRIMITIVES) <= 20


def test_a_composite_is_one_entry_with_examples():
    with pytest.raises(GraphError, match="op 'softmax' has a composite already"):
        composite("softmax", ex("f32[2]"))(lambda m, ins, a: ins[0])
    with pytest.raises(GraphError, match="composite of 'cumsum': give at least one example"):
        composite("cumsum")(lambda m, ins, a: ins[0])
    with pytest.raises(GraphError, match="unknown op 'no_such_op'"):
        composite("no_such_op", ex("f32[2]"))(lambda m, ins, a: ins[0])
    assert "cumsum" not in COMPOSITES
    with pytest.raises(GraphError, match="expected like 'f16\\[2,3\\]'"):
        ex("f16(2,3)")


def test_composites_emit_ops_of_the_table_only_as_traced():
    """What each composite emits, traced on its examples: the deep ones bottom out in
    primitives; attention's mask goes through mask_fill, which needs cumsum for its counts."""
    for op in COMPOSITES:
        assert composites.emitted_ops(op) <= set(OPS) - LEAVES, op
    assert "mask_fill" in composites.emitted_ops("attention")
    assert "cumsum" in composites.emitted_ops("mask_fill")
    assert composites.missing_primitives("attention", PRIMITIVES) == frozenset()
    assert composites.missing_primitives("fake_quantize", PRIMITIVES) == {"quantize"}


# ----------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("drop,op", [("cumsum", "mask_fill"), ("reduce", "softmax"), ("cast", "rms_norm")])
def test_coverage_names_the_op_the_backend_and_the_missing_primitive(drop, op):
    b = Lacking(set(COMPOSITES) | {drop})
    with pytest.raises(BackendError) as e:
        check_coverage(b)
    msg = str(e.value)
    assert "backend 'test-lacking'" in msg and f"{op}: lacks ['{drop}']" in msg, msg
    assert f"{drop}: lacks ['{drop}']" in msg, msg           # the primitive itself, too
    check_coverage(Lacking(set(COMPOSITES)))                 # the primitives alone suffice


def test_optional_ops_may_be_lacking():
    check_coverage(Lacking(OPTIONAL - composites.CONTROL_FLOW | {"fake_quantize"}))


def test_a_backend_lacking_a_primitive_fails_to_register():
    class Plugin:
        @hookimpl
        def rlx_register_backends(self, register):
            register(Lacking({"softmax", "reduce"}, "test-no-reduce"))

    with pytest.warns(RlxPluginWarning, match="failed to register"), \
            pytest.raises(PluginError, match="backend 'test-no-reduce'.*softmax: lacks \\['reduce'\\]"):
        with temporary_plugin(Plugin(), "test-no-reduce-plugin"):
            pass
    assert "test-no-reduce" not in registry().backends
    with temporary_plugin(_plugin_of(Lacking(set(COMPOSITES), "test-prims")), "test-prims-plugin"):
        assert "test-prims" in registry().backends


def _plugin_of(backend):
    class Plugin:
        @hookimpl
        def rlx_register_backends(self, register):
            register(backend)
    return Plugin()


def test_registered_backends_legalize_only_fused_ops():
    """numpy, numba, cuda and opencl have a kernel for every op with a composite but fused ones
    (and dot_general; opencl has no collectives: it runs a group of one rank through their
    composite): legalize decomposes for them what it did before the table grew."""
    from rlx_core.ir.ops import COLLECTIVES
    from rlx_core.pipeline import available_backends

    seen = set()
    for b, _, _ in available_backends():
        if b.name in ("numpy", "numba", "cuda", "opencl"):
            seen.add(b.name)
            lacking = set(COMPOSITES) - set(b.supported_ops())
            fused = {n for n, d in OPS.items() if d.level is Level.FUSED}    # (modules add ops after ops.FUSED)
            allowed = fused | {"dot_general", "linear", "swiglu_mlp"}
            allowed |= set(COLLECTIVES) if b.name == "opencl" else set()
            assert lacking <= allowed, (b.name, sorted(lacking))
    assert {"numpy", "numba"} <= seen


# ----------------------------------------------------------------------------- legalize
def _graph(fn, *shapes):
    m = Builder("g", MIR)
    xs = [m.input(f"x{i}", dims, dt) for i, (dims, dt) in enumerate(shapes)]
    m.outputs_from(fn(m, *xs))
    return m.build()


def test_legalize_repeats_until_only_primitives_are_left():
    g = _graph(lambda m, q, k, v: m.attention(q, k, v, scale=0.5),
               ((1, 2, "s", 4), "f32"), ((1, 1, "s", 4), "f32"), ((1, 1, "s", 4), "f32"))
    out, names = legalize(g, PRIMITIVES | LEAVES)
    assert {n.op for n in out.nodes} <= PRIMITIVES | LEAVES
    assert names == ["attention", "mask_fill", "softmax"]
    same, none = legalize(g, set(OPS))
    assert none == [] and [n.op for n in same.nodes] == [n.op for n in g.nodes]


def test_legalize_stops_on_composites_that_emit_each_other(monkeypatch):
    loop = composites.Composite("softmax", lambda m, ins, a: m.softmax(ins[0] * 1.0), True,
                                COMPOSITES["softmax"].examples)
    monkeypatch.setitem(COMPOSITES, "softmax", loop)
    g = _graph(lambda m, x: m.softmax(x), ((2, 3), "f32"))
    with pytest.raises(GraphError, match="\\['softmax'\\] still left after 32 rounds"):
        legalize(g, PRIMITIVES | LEAVES)


# ----------------------------------------------------------------------------- symbolic dims
@pytest.mark.parametrize("kind,window", [("causal", 0), ("sliding_window", 2)])
def test_mask_fill_composite_over_symbolic_lengths(rng, kind, window):
    """Sq and Sk are symbols bound only at run time: the counts come from a cumsum."""
    g = _graph(lambda m, s: m.add("mask_fill", (s,), mask_kind=kind, window=window),
               ((1, 2, "q", "k"), "f32"))
    with primitives_only("test-prims-mask") as name:
        exe = compile_on(g, name)
        assert "mask_fill" not in {n.op for n in exe.mir.nodes}
        for sq, sk in ((1, 5), (3, 3), (2, 6)):
            s = rng.standard_normal((1, 2, sq, sk)).astype(np.float32)
            got = exe.run({"x0": s})["out"]
            np.testing.assert_array_equal(got, ref_mask_fill(s, mask_kind=kind, window=window))


def test_argmax_and_topk_composites_over_a_symbolic_axis(rng):
    g = _graph(lambda m, x: (m.argmax(x, -1), *m.topk(x, 3, -1)), ((2, "n"), "f32"))
    with primitives_only("test-prims-argmax") as name:
        exe = compile_on(g, name)
        assert not {"argmax", "topk"} & {n.op for n in exe.mir.nodes}
        for n in (3, 7):
            x = rng.standard_normal((2, n)).astype(np.float32)
            x[1, 1] = x[1, n - 1] = np.nan
            x[0, 0] = x[0, 2] = x[0].max()               # a tie: the first index wins
            out = exe.run({"x0": x})
            np.testing.assert_array_equal(out["out0"], np.argmax(x, -1))
            order = np.argsort(-x, axis=-1, kind="stable")[:, :3]
            np.testing.assert_array_equal(out["out2"], order)
            np.testing.assert_array_equal(out["out1"], np.take_along_axis(x, order, -1))


# ----------------------------------------------------------------------------- a model
@pytest.mark.parametrize("policy", ["direct", "fusable"])
@pytest.mark.parametrize("model", ["llama", "bert"])
def test_models_on_the_primitives_alone_match_numpy(rng, policy, model):
    """A decoder (causal attention over a symbolic sequence, GQA, RoPE, RMSNorm, SwiGLU) and
    an encoder on the NumPy backend reduced to the primitives: legalized into them, the
    outputs are NumPy's own."""
    import rlx_core
    from graphs import Cfg, bert, llama, llama_inputs, random_params
    from rlx_core.profile import CompileProfile

    g = llama() if model == "llama" else bert()
    params = random_params(g, rng)
    inputs = llama_inputs(Cfg(), rng, 5, batch=1) if model == "llama" else \
        {"x": rng.standard_normal((1, 5, 32)).astype(np.float32)}
    prof = CompileProfile("p").evolve(fusion={"policy": policy})
    ref = rlx_core.compile(g, profile=prof, params=params, backend="numpy").run(inputs)
    with primitives_only("test-prims-model") as name:
        exe = rlx_core.compile(g, profile=prof, params=params, backend=name)
        assert {n.op for n in exe.mir.nodes} <= PRIMITIVES | LEAVES
        got = exe.run(inputs)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5)


def test_coverage_renders_the_expression_table_in_each_dialect_the_backend_declares():
    """check_coverage runs expr.check_dialect on each of the backend's renderers: a formula
    the dialect cannot write fails the backend then (here a dialect without tanh)."""
    from rlx_core.ir import expr
    from rlx_core.ir.dtype import F32

    class NoTanh:
        name, dtypes = "no-tanh C", (F32,)

        def covers(self, entry, dt):
            return True

        def check(self, entry, dt, backend):
            if "tanh" in str(entry):
                raise BackendError(f"backend {backend!r}: dialect {self.name!r} cannot write "
                                   f"{entry.name} ({dt.value}): no tanh")

    class WithDialect(Lacking):
        def expression_renderers(self):
            return (NoTanh(),)

    assert any("tanh" in str(e) for e in expr.TABLE.values())
    with pytest.raises(BackendError, match="backend 'test-dialect'.*no tanh"):
        check_coverage(WithDialect((), "test-dialect"))
